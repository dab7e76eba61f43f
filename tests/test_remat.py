"""fmp.remat: gradients equal the unwrapped function's bit for bit, under every transform, with less memory."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import POLICIES
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import block_fn
from conftest import block_weights
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.multiprocessing.reductions import StorageWeakRef

import fmp


class Residual(nn.Module):
    """A stack of residual MLP blocks with dropout, each optionally wrapped by `fmp.remat`."""

    def __init__(self, width: int = 8, layers: int = 3, dropout: float = 0.25, remat: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 2 * width),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(2 * width, width),
            )
            for _ in range(layers)
        )
        self.remat = remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (fmp.remat.remat(block) if self.remat else block)(x)
        return x


def residual_pair(seed: int = 0, **sizes: Any) -> tuple[Residual, Residual, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    plain = Residual(**sizes)
    wrapped = Residual(**sizes, remat=True)
    wrapped.load_state_dict(plain.state_dict())
    return plain, wrapped, {k: v.detach() for k, v in plain.named_parameters()}


def mse_of(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    return loss_fn


def seeded(fn: Callable[[], Any], seed: int = 1) -> Any:
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_precision_grads_equal_the_unwrapped_model_bit_for_bit(policy: str) -> None:
    # Dropout draws the same mask in the recompute, and the recompute runs under the policy's
    # autocast region, which the backward pass has already left.
    plain, wrapped, params = residual_pair()
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    scaler, pol = fmp.DynamicLossScale.create(), fmp.get_policy(policy)
    ours = seeded(lambda: fmp.mixed_precision_grad(mse_of(wrapped), params, scaler, x, y, policy=pol))
    reference = seeded(lambda: fmp.mixed_precision_grad(mse_of(plain), params, scaler, x, y, policy=pol))
    assert_trees_bitwise_equal(ours, reference)
    assert all(bool(g.abs().sum() > 0) for g in ours.grads.values())


def test_train_steps_equal_the_unwrapped_model_and_draw_the_same_random_numbers() -> None:
    plain, wrapped, params = residual_pair()
    optimizer, policy = fmp.optim.adamw(1e-2), fmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def run(model: nn.Module) -> tuple[fmp.TrainState, torch.Tensor]:
        state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
        torch.manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(6, 8), torch.randn(6, 8)
            state, _ = fmp.train_step(mse_of(model), state, x, y, policy=policy, optimizer=optimizer)
        return state, torch.rand(4)  # the generator advanced by the forward passes only

    assert_trees_bitwise_equal(run(wrapped), run(plain))


def test_an_ensemble_under_vmap_equals_the_unwrapped_model() -> None:
    plain, wrapped, params = residual_pair(dropout=0.0)
    members = fmp.stack_trees([params, pytree.tree_map(lambda p: p * 1.5, params)])
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def grads(model: nn.Module) -> Any:
        def member(p: Any) -> Any:
            return fmp.mixed_precision_grad(mse_of(model), p, fmp.NoOpLossScale(), x, y, policy=policy).grads

        return torch.func.vmap(member)(members)

    assert_trees_bitwise_equal(grads(wrapped), grads(plain))


def test_plain_autograd_and_torch_autocast_match_and_keep_only_the_inputs() -> None:
    plain, wrapped, _ = residual_pair()
    x = torch.randn(256, 8)  # activations outweigh the weights, which both save
    saved: dict[str, int] = {}

    def backward(model: nn.Module, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        saved[name] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[name] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()  # outside autocast, as recommended: the recompute restores it
        return loss.detach(), [p.grad for p in model.parameters()]

    assert_trees_bitwise_equal(backward(wrapped, "remat"), backward(plain, "plain"))
    assert saved["remat"] < saved["plain"] / 2


def test_a_function_is_recomputed_once_in_the_backward_pass() -> None:
    calls = []

    def counted(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return block_fn(x, w1, w2)

    x, w1, w2 = block_weights()
    wrapped = fmp.remat.remat(counted)
    assert wrapped.__name__ == "counted"
    grads = torch.func.grad(lambda w1, w2: wrapped(x, w1, w2).sum(), argnums=(0, 1))(w1, w2)
    assert calls == [True, True]  # both runs in grad mode, as the unwrapped function runs
    with torch.no_grad():  # evaluation: a plain call
        assert torch.equal(wrapped(x, w1, w2), block_fn(x, w1, w2)) and calls == [True, True, False]
    assert_trees_bitwise_equal(grads, torch.func.grad(lambda w1, w2: block_fn(x, w1, w2).sum(), argnums=(0, 1))(w1, w2))


def test_the_inputs_are_freed_with_the_backward_pass() -> None:
    # Nothing but autograd's saved tensors holds a block's inputs: they go when its node has run,
    # while the output (and so the node) lives on.
    x, w1, w2 = block_weights()
    h = x.requires_grad_() * 2
    weak = StorageWeakRef(h.untyped_storage())
    out = fmp.remat.remat(block_fn)(h, w1, w2)
    del h
    assert not weak.expired()
    out.sum().backward()
    assert weak.expired() and out.grad_fn is not None


def test_the_recomputes_activations_are_freed_as_its_backward_uses_them_in_the_step() -> None:
    # Under the step's torch.func transform too, the recompute's backward frees what its ops saved
    # once they have run: h, saved by the final mul, is gone when the backward reaches a1's producer.
    alive: list[bool] = []

    def block(a: torch.Tensor) -> torch.Tensor:
        a1 = a * 1.0
        h = a1.exp()
        saved = weakref.ref(fmp._tree.functorch_base(h))
        if a1.requires_grad:  # the recompute (the forward ran without tracking)
            a1.register_hook(lambda grad: alive.append(saved() is not None) or grad)
        return h * h

    loss_fn = lambda params, x: fmp.remat.remat(block)(params["w"] * x).sum()  # noqa: E731
    fmp.mixed_precision_grad(
        loss_fn, {"w": torch.randn(1000)}, fmp.NoOpLossScale(), torch.ones(1000), policy=fmp.Policy()
    )
    assert alive == [False]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp's first use
def test_forward_mode_second_order_and_nested_remat_match() -> None:
    x, w1, w2 = block_weights()
    wrapped = fmp.remat.remat(block_fn)
    tangent = torch.ones_like(w1)
    ours = torch.func.jvp(lambda w: wrapped(x, w, w2), (w1,), (tangent,))
    reference = torch.func.jvp(lambda w: block_fn(x, w, w2), (w1,), (tangent,))
    assert_trees_bitwise_equal(ours, reference)
    # Forward mode alone saves nothing for a backward pass: the block runs as it is, so a
    # captured tensor's tangent flows too.
    captured = torch.func.jvp(lambda w: fmp.remat.remat(lambda h: block_fn(h, w, w2))(x), (w1,), (tangent,))
    assert_trees_bitwise_equal(captured, reference)

    # A Hessian-vector product: forward over reverse runs the Function's jvp rule and its backward.
    def hvp(block: Callable[..., torch.Tensor]) -> Any:
        gradient = torch.func.grad(lambda w: block(x, w, w2).square().sum())
        return torch.func.jvp(gradient, (w1,), (tangent,))

    assert_trees_bitwise_equal(hvp(wrapped), hvp(block_fn))

    # There a tensor of the jvp read without being passed in would lose its tangent.
    # An integer tensor carries no tangent, so a captured one passes.
    def indexed(w: torch.Tensor) -> torch.Tensor:
        index = w.argmax(0)
        return fmp.remat.remat(lambda h, w: (h @ w)[:, index])(x, w).sum()

    torch.func.jvp(torch.func.grad(indexed), (w1,), (tangent,))
    with pytest.raises(RuntimeError, match=r"not one of its arguments .*outer torch\.func\.jvp"):
        gradient = torch.func.grad(lambda w, v: fmp.remat.remat(lambda h, w: h @ w @ v)(x, w).sum())
        torch.func.jvp(lambda v: gradient(w1, v), (w2,), (w2,))

    def grad_norm(block: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: torch.func.grad(lambda w: block(x, w, w2).sum())(w).square().sum()

    torch.testing.assert_close(torch.func.grad(grad_norm(wrapped))(w1), torch.func.grad(grad_norm(block_fn))(w1))

    def two_blocks(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return fmp.remat.remat(block_fn)(x, w1, w2) @ w1 @ w2

    nested = torch.func.grad(lambda w: fmp.remat.remat(two_blocks)(x, w, w2).sum())(w1)
    assert_trees_bitwise_equal(nested, torch.func.grad(lambda w: two_blocks(x, w, w2).sum())(w1))


def test_constants_keywords_integer_outputs_and_returned_inputs_pass_through() -> None:
    x, w1, w2 = block_weights()

    def block(x: torch.Tensor, weights: dict[str, Any], *, scale: float, index: torch.Tensor) -> dict[str, Any]:
        y = block_fn(x, weights["w1"], weights["w2"]) * scale
        return {"y": y[index], "argmax": y.argmax(-1), "x": x, "unused": y.exp()}

    def loss(w1: torch.Tensor, fn: Callable[..., dict[str, Any]]) -> torch.Tensor:
        out = fn(x, {"w1": w1, "w2": w2, "name": None}, scale=2.0, index=torch.tensor([0, 2]))
        assert out["argmax"].dtype == torch.int64 and not out["argmax"].requires_grad
        return out["y"].sum() + out["x"].sum()

    assert_trees_bitwise_equal(torch.func.grad(loss)(w1, fmp.remat.remat(block)), torch.func.grad(loss)(w1, block))


def test_preserve_rng_state_false_lets_the_recompute_draw_a_new_mask() -> None:
    x, w1, _ = block_weights()

    def dropped(x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        return F.dropout(x @ w1, 0.5)

    def grad(block: Callable[..., torch.Tensor]) -> torch.Tensor:
        return seeded(lambda: torch.func.grad(lambda w: block(x, w).sum())(w1))  # type: ignore[no-any-return]

    assert torch.equal(grad(fmp.remat.remat(dropped)), grad(dropped))
    assert not torch.equal(grad(fmp.remat.remat(dropped, preserve_rng_state=False)), grad(dropped))


def test_nested_fmp_regions_are_replayed() -> None:
    # fixed_dtype inside the block keeps float32; the policy's bf16 region applies around it.
    x, w1, w2 = block_weights()

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return fmp.autocast.fixed_dtype(torch.matmul, torch.float32)(torch.tanh(x @ w1), w2)

    def loss(block: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return fmp.autocast.autocast(lambda w1: block(x, w1, w2).float().sum(), torch.float16)

    assert_trees_bitwise_equal(torch.func.grad(loss(fmp.remat.remat(block)))(w1), torch.func.grad(loss(block))(w1))


def test_module_policies_are_replayed_in_the_recompute() -> None:
    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self, remat: bool) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
            self.remat = remat

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (fmp.remat.remat(self.block) if self.remat else self.block)(x)

    plain, wrapped = Net(False), Net(True)
    wrapped.load_state_dict(plain.state_dict())
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    for key in ("block", "block.0"):  # the wrapped module itself, and a module inside it

        def grads(model: nn.Module, key: str) -> Any:
            def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

            fn = fmp.autocast.module_policies(loss, model, {key: fmp.get_policy("float32")})
            return fmp.mixed_precision_grad(fn, params, fmp.NoOpLossScale(), x, y, policy=policy)

        assert_trees_bitwise_equal(grads(wrapped, key), grads(plain, key))


@hypothesis.given(
    layers=st.integers(1, 3),
    width=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
    policy=st.sampled_from(POLICIES),
)
@hypothesis.settings(max_examples=15)
def test_property_remat_never_changes_a_gradient(layers: int, width: int, seed: int, policy: str) -> None:
    plain, wrapped, params = residual_pair(seed, width=width, layers=layers)
    x, y = torch.randn(5, width), torch.randn(5, width)
    pol = fmp.get_policy(policy)
    ours = seeded(lambda: fmp.mixed_precision_grad(mse_of(wrapped), params, fmp.NoOpLossScale(), x, y, policy=pol))
    reference = seeded(lambda: fmp.mixed_precision_grad(mse_of(plain), params, fmp.NoOpLossScale(), x, y, policy=pol))
    assert_trees_bitwise_equal(ours, reference)


@pytest.mark.compiled
def test_compiled_step_with_remat_is_one_graph_and_matches_eager() -> None:
    # torch.compile of any functools.partial shares one code object; a fresh Dynamo keeps what
    # earlier tests compiled (their automatic dynamic shapes) from restarting this compile.
    torch._dynamo.reset()
    # Compiled, remat calls the block as it is (Inductor plans the one graph's memory itself).
    plain, wrapped, params = residual_pair(dropout=0.0)
    plain.eval(), wrapped.eval()
    optimizer, policy = (
        fmp.optim.sgd(0.1, momentum=0.9),
        fmp.get_policy("params=float32,compute=float32,output=float32"),
    )
    counter = CompileCounter()
    compiled = torch.compile(
        functools.partial(fmp.train_step, mse_of(wrapped), policy=policy, optimizer=optimizer),
        backend=counter,
        fullgraph=True,
    )
    state = eager = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    for _ in range(3):
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        state, _ = compiled(state, x, y)
        eager, _ = fmp.train_step(mse_of(plain), eager, x, y, policy=policy, optimizer=optimizer)
    assert counter.frame_count == 1
    assert_trees_close(state.params, eager.params, **TOLERANCES[torch.float32])


_PEAK_SCRIPT = """
import gc, json, sys, torch, fmp
from pathlib import Path
from torch import nn
from torch.utils.checkpoint import checkpoint
sys.path.insert(0, {tests!r})
from test_remat import Residual, mse_of


def kib(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))


def peak(step):
    step(); gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS:")
    step()
    return kib("VmHWM:") - before

torch.manual_seed(0)
peaks = {{}}
for remat in (False, True):
    model = Residual(width=128, layers=6, dropout=0.0, remat=remat)
    x, y = torch.randn(2048, 128), torch.randn(2048, 128)
    params = {{k: v.detach() for k, v in model.named_parameters()}}
    policy = fmp.get_policy("params=float32,compute=float32,output=float32")
    peaks["fmp remat" if remat else "fmp"] = peak(
        lambda: fmp.mixed_precision_grad(mse_of(model), params, fmp.NoOpLossScale(), x, y, policy=policy).grads
    )
    if not remat:
        def plain():
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            return [p.grad for p in model.parameters()]
        peaks["loss.backward()"] = peak(plain)

        def checkpointed():
            model.zero_grad(set_to_none=True)
            h = x
            for block in model.blocks:
                h = h + checkpoint(block, h, use_reentrant=False)
            nn.functional.mse_loss(h, y).backward()
            return [p.grad for p in model.parameters()]
        peaks["torch checkpoint"] = peak(checkpointed)
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads Linux's peak resident size")
def test_peak_memory_is_plain_autograds_and_remat_lowers_it() -> None:
    # Measured in a process of its own whose malloc hands every freed block back, so the peak
    # resident size follows live tensors. Activations (9 MB a block) dwarf the 0.8 MB of params;
    # remat keeps each block's 1 MB input.
    script = _PEAK_SCRIPT.format(tests=os.path.dirname(__file__))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    # torch.func.grad would hold every activation and backward temporary to the end: ~1.9x.
    assert peaks["fmp"] < 1.15 * peaks["loss.backward()"], peaks
    assert peaks["fmp remat"] < 0.5 * peaks["fmp"], peaks
    # Nothing of a block outlives its backward: torch.utils.checkpoint's peak, give or take a block.
    assert peaks["fmp remat"] < peaks["torch checkpoint"] + 10_000, peaks


class Layers(nn.Module):
    """Dropout on a transposed tensor, an in-place LeakyReLU on the block's input, and a transformer layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.act = nn.LeakyReLU(0.2, inplace=True)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.25, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.inner(self.act(x)).transpose(1, 2), 0.5).transpose(1, 2)
        return self.layer(h)


class Remat(nn.Module):
    def __init__(self, inner: nn.Module, remat: bool) -> None:
        super().__init__()
        self.inner, self.remat = inner, remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (fmp.remat.remat(self.inner) if self.remat else self.inner)(x)


@pytest.mark.parametrize("transform", ["loss.backward()", "mixed_precision_grad"])
def test_random_layouts_in_place_flags_and_attention_kernels_match_the_unwrapped_model(transform: str) -> None:
    # The first run and the recompute place dropout's random numbers alike (a torch.func level
    # changes where they fall on a transposed tensor), see `inplace=True` as an update of the data
    # they are given, and pick the kernels the unwrapped model picks (attention's fast path only
    # runs where nothing requires grad).
    torch.manual_seed(0)
    layers = Layers()
    params = {f"inner.{k}": v.detach() for k, v in layers.named_parameters()}

    def run(remat: bool) -> Any:
        model = Remat(layers, remat)
        torch.manual_seed(5)
        x = torch.randn(2, 5, 8)
        if transform == "loss.backward()":
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            return loss.detach(), [p.grad for p in model.parameters()], x
        loss_fn = lambda p, x: torch.func.functional_call(model, p, (x,)).square().mean()  # noqa: E731
        return fmp.mixed_precision_grad(loss_fn, params, fmp.NoOpLossScale(), x, policy=fmp.Policy()), x

    assert_trees_bitwise_equal(run(True), run(False))
