"""On a CUDA device: no host syncs in a step, a step captured whole in a CUDA graph, exact unscale.

Skipped without a GPU; run on one with `python -m pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from torch._dynamo.testing import CompileCounterWithBackend

import fmp
from fmp._scaler import compiled_unscale_and_adjust

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
    # cudagraph trees capture partitions that hold no kernel (only views, say); torch warns about each.
    pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning"),
]

CUDA = torch.device("cuda")
FP16 = fmp.get_policy("params=float32,compute=float16,output=float32")
SGD = fmp.optim.sgd(1e-2, momentum=0.9)


def cuda_batches(steps: int, overflow_every: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return mlp_batches(steps, overflow_every, seed=5, device=CUDA)


def cuda_state(optimizer: fmp.optim.Optimizer = SGD) -> fmp.TrainState:
    params = pytree.tree_map(lambda t: t.to(CUDA), mlp_params())
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    return fmp.TrainState.create(params, optimizer, scaler)


def run_without_syncs(step: Callable[..., Any], state: fmp.TrainState, steps: int) -> fmp.TrainState:
    data = list(cuda_batches(steps, overflow_every=3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the steps raises
    try:
        for x, y in data:
            state, _ = step(state, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return state


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_eager_step_never_syncs_with_the_host(optimizer_name: str, donate: bool) -> None:
    optimizer = SGD if optimizer_name == "sgd" else fmp.optim.adamw(1e-2)
    step = functools.partial(fmp.train_step, mlp_loss, policy=FP16, optimizer=optimizer, donate=donate)
    state = cuda_state(optimizer)
    state, _ = step(state, *next(cuda_batches(1, 0)))  # first use initialises cuBLAS, which may sync
    buffers = pytree.tree_leaves((state.params, state.opt_state))
    state = run_without_syncs(step, state, steps=6)
    # Donated, the select writes into the state's own tensors (where(out=) on the device).
    kept = [new is old for new, old in zip(pytree.tree_leaves((state.params, state.opt_state)), buffers, strict=True)]
    assert all(kept) if donate else not any(kept)


def test_eager_step_with_accumulation_two_losses_a_schedule_and_the_norm_never_syncs() -> None:
    def two_losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        return mlp_loss(params, x, y), sum(p.square().sum() for p in params.values())

    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.adamw(fmp.optim.schedule.warmup_cosine(1e-2, 2, 10)), 1.0)
    params = pytree.tree_map(lambda t: t.to(CUDA), mlp_params())
    scalers = (fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2), fmp.StaticLossScale.create(4.0))
    state = fmp.TrainState.create(params, optimizer, scalers, accumulation_steps=2)
    step = functools.partial(fmp.train_step, two_losses, policy=FP16, optimizer=optimizer, grad_norm=True)
    state, info = step(state, *next(cuda_batches(1, 0)))
    assert info.grad_norm.device.type == "cuda"
    state = run_without_syncs(step, state, steps=6)
    assert int(state.counts.applied) + int(state.counts.skipped) == 3
    assert {t.device.type for t in pytree.tree_leaves(state)} == {"cuda"}


@pytest.mark.compiled
@pytest.mark.parametrize(
    ("optimizer_name", "donate", "mode"),
    [("sgd", False, "default"), ("adamw", True, "default"), ("sgd", True, "reduce-overhead")],
)
def test_compiled_step_never_syncs_with_the_host(optimizer_name: str, donate: bool, mode: str) -> None:
    torch._dynamo.reset()
    optimizer = SGD if optimizer_name == "sgd" else fmp.optim.adamw(1e-2)
    step = functools.partial(fmp.train_step, mlp_loss, policy=FP16, optimizer=optimizer, donate=donate)
    if mode == "default":
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, backend=counter, fullgraph=True)
    else:
        compiled = torch.compile(step, mode=mode, fullgraph=True)
    state = cuda_state(optimizer)
    if donate:
        for tensor in pytree.tree_leaves(state):
            torch._dynamo.mark_static_address(tensor)
    for x, y in cuda_batches(3, 0):  # compiles (autotuning may sync) and, in a CUDA graph mode, records
        state, _ = compiled(state, x, y)
    run_without_syncs(compiled, state, steps=6)
    if mode == "default":
        assert counter.frame_count == 1


@pytest.mark.compiled
def test_donated_step_replays_as_cuda_graphs_and_matches_eager() -> None:
    torch._dynamo.reset()
    eager = functools.partial(fmp.train_step, mlp_loss, policy=FP16, optimizer=SGD)
    graphed = torch.compile(functools.partial(eager, donate=True), mode="reduce-overhead", fullgraph=True)
    torch._dynamo.utils.counters.clear()
    eager_state, graphed_state = cuda_state(), cuda_state()
    for tensor in pytree.tree_leaves(graphed_state):
        torch._dynamo.mark_static_address(tensor)  # updated in place inside the graph, never copied
    skips = 0
    for x, y in cuda_batches(12, overflow_every=4):
        eager_state, info = eager(eager_state, x, y)
        graphed_state, graphed_info = graphed(graphed_state, x, y)
        assert bool(graphed_info.grads_finite) == bool(info.grads_finite)
        assert float(graphed_info.loss_scale) == float(info.loss_scale)
        skips += not bool(info.grads_finite)
        assert_trees_bitwise_equal(graphed_state.scaler, eager_state.scaler)
        assert_trees_close(graphed_state.params, eager_state.params, **TOLERANCES[torch.float16])
    assert skips == 3
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


@pytest.mark.compiled
def test_donated_compiled_step_writes_in_place_bit_identically() -> None:
    torch._dynamo.reset()
    steps = {
        donate: torch.compile(
            functools.partial(fmp.train_step, mlp_loss, policy=FP16, optimizer=SGD, donate=donate),
            fullgraph=True,
            options={"emulate_precision_casts": True},  # round float16 intermediates as eager does
        )
        for donate in (False, True)
    }
    pure, donated = cuda_state(), cuda_state()
    for x, y in cuda_batches(6, overflow_every=3):
        pointers = [t.data_ptr() for t in pytree.tree_leaves(donated)]
        pure, _ = steps[False](pure, x, y)
        donated, _ = steps[True](donated, x, y)
        assert [t.data_ptr() for t in pytree.tree_leaves(donated)] == pointers
        assert_trees_bitwise_equal(donated, pure)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_unscale_matches_eager_and_grad_scalers_kernel(dtype: torch.dtype) -> None:
    # Shapes that take each branch of the row-wise check compiled GPU code uses.
    gen = torch.Generator().manual_seed(0)
    shapes = [(3,), (4097,), (2048,), (33, 17)]
    grads = [(torch.randn(shape, generator=gen) * 100).to(dtype).to(CUDA) for shape in shapes]
    scaler = fmp.DynamicLossScale.create(init_scale=3.0, device=CUDA)
    for poisoned in (None, 1, 2, 3):
        step_grads = [g.clone() for g in grads]
        if poisoned is not None:
            step_grads[poisoned].view(-1)[poisoned * 5] = float("nan")
        fused = compiled_unscale_and_adjust(scaler, step_grads)
        assert_trees_bitwise_equal(fused, fmp.unscale_and_adjust(scaler, step_grads))
        assert bool(fused[1]) == (poisoned is None)
    if dtype == torch.bfloat16:
        return  # GradScaler's CUDA kernel does not take bfloat16 gradients (NotImplementedError)
    unscaled, _, _, _ = compiled_unscale_and_adjust(scaler, grads)
    reference = [g.clone() for g in grads]
    found_inf = torch.zeros(1, device=CUDA)
    inverse = torch.full((1,), 3.0, dtype=torch.float64, device=CUDA).reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(reference, found_inf, inverse)
    for ours, theirs in zip(unscaled, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert float(found_inf) == 0.0


@pytest.mark.compiled
def test_gradient_buffer_loop_matches_grad_scaler_with_fused_adamw_and_never_syncs() -> None:
    """The README's GradientBuffer loop under autocast, step for step against GradScaler's."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(CUDA)

    def loss(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.float16):
            return net(x).float().square().mean()

    ours, theirs = model(), model()
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
    reference_optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    grad_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    grads = fmp.interop.GradientBuffer.attach(ours.parameters())
    scaler = fmp.DynamicLossScale.create(2.0**10, growth_interval=3, device=CUDA)
    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(16, 64, generator=gen).to(CUDA) for _ in range(9)]
    for x in data[1::4]:
        x[0, 0] = float("inf")
    for step, x in enumerate(data):
        grad_scaler.scale(loss(theirs, x)).backward()
        grad_scaler.unscale_(reference_optimizer)
        grad_scaler.step(reference_optimizer)
        grad_scaler.update()
        reference_optimizer.zero_grad()

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step > 0 else "default")  # the first step compiles
        try:
            grads.scale(loss(ours, x), scaler).backward()
            grads_finite, scaler = grads.unscale_(scaler)
            grads.step(optimizer, grads_finite)
            grads.zero_()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert float(scaler.loss_scale) == grad_scaler.get_scale()
    for param, reference in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(param, reference, rtol=0, atol=0)


@pytest.mark.compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_unscale_and_clip_matches_eager(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(shape, generator=gen) * 3000).to(dtype).to(CUDA) for shape in [(3,), (4097,), (33, 17)]]
    scaler = fmp.DynamicLossScale.create(init_scale=1024.0, device=CUDA)
    eager = fmp.unscale_and_adjust(scaler, grads, max_norm=1.0)
    donated = [g.clone() for g in grads]
    fused = compiled_unscale_and_adjust(scaler, donated, max_norm=1.0, donate=True)
    assert all(ours.data_ptr() == buffer.data_ptr() for ours, buffer in zip(fused[0], donated, strict=True))
    assert_trees_close(fused[0], eager[0], **TOLERANCES[dtype])
    assert_trees_close(fused[2], eager[2], **TOLERANCES[dtype])
    assert bool(fused[1]) and bool(eager[1])
    assert_trees_bitwise_equal(fused[3], eager[3])


def test_remat_steps_equal_the_unwrapped_model_with_dropout_and_never_sync() -> None:
    # The recompute replays the CUDA generator's state (read on the host, from the generator's
    # own counters: no device sync), so dropout draws the same mask as the first run.
    from test_remat import mse_of
    from test_remat import residual_pair

    plain, wrapped, params = residual_pair()
    params = pytree.tree_map(lambda t: t.to(CUDA), params)
    plain.to(CUDA)
    wrapped.to(CUDA)
    optimizer = fmp.optim.adamw(1e-2)

    def run(model: torch.nn.Module) -> tuple[fmp.TrainState, torch.Tensor]:
        step = functools.partial(fmp.train_step, mse_of(model), policy=FP16, optimizer=optimizer)
        state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
        torch.manual_seed(1)
        batches = [(torch.randn(6, 8, device=CUDA), torch.randn(6, 8, device=CUDA)) for _ in range(4)]
        state, _ = step(state, *batches[0])  # cuBLAS initialises on first use, which may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, y in batches[1:]:
                state, _ = step(state, x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return state, torch.rand(4, device=CUDA)  # the generator advanced by the forward passes only

    assert_trees_bitwise_equal(run(wrapped), run(plain))


def test_locate_nonfinite_names_a_float16_overflow_on_the_gpu() -> None:
    from test_debug import loss_of
    from test_debug import mlp

    model, params, x, y = mlp(hidden_scale=1e5)
    model.to(CUDA)
    params, x, y = pytree.tree_map(lambda t: t.to(CUDA), (params, x, y))
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FP16)
    assert report.forward is not None and (report.forward.op, report.forward.module) == ("linear", "2.0")
    scaler = fmp.StaticLossScale.create(2.0**30, device=CUDA)
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FP16, scaler=scaler)
    grads = fmp.mixed_precision_grad(loss_of(model), params, scaler, x, y, policy=FP16)
    assert report.finite == bool(grads.grads_finite) and report.backward is not None
