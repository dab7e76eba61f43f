"""Rules that are the device's own run on torch.autocast itself; ctx-style autograd.Functions in the step."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from conftest import assert_trees_bitwise_equal
from torch import nn

import fmp
from fmp.autocast import autocast
from fmp.autocast._rules import CPU

NATIVE = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu")


class DocsMatMul(torch.autograd.Function):
    """A Function as torch's AMP docs write one: ctx first, no setup_context, custom_fwd/custom_bwd."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.autocast_enabled = torch.is_autocast_enabled("cpu")
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        seen.append((ctx.autocast_enabled, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return grad.mm(b.t()), a.t().mm(grad)


class DocsMatMulFloat32(DocsMatMul):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.autocast_enabled = torch.is_autocast_enabled("cpu")
        return a.mm(b)


seen: list[tuple[bool, bool, torch.dtype]] = []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LSTM(8, 8, batch_first=True))


@pytest.mark.parametrize("function", [DocsMatMul, DocsMatMulFloat32], ids=["custom_fwd", "cast_inputs"])
def test_a_docs_style_function_and_an_lstm_train_as_under_torch_amp_bit_for_bit(
    function: type[torch.autograd.Function],
) -> None:
    model, reference = _model(), _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["w"] = torch.randn(8, 3)
    reference_w = nn.Parameter(params["w"].clone())

    def loss_fn(params: Any, x: torch.Tensor) -> torch.Tensor:
        out, _ = torch.func.functional_call(model, params, (x,))
        return function.apply(out[:, -1], params["w"]).float().square().mean()

    optimizer = fmp.optim.adamw(1e-3)
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    torch_optimizer = torch.optim.AdamW([*reference.parameters(), reference_w], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 5, 6, generator=gen)
        seen.clear()
        state, info = fmp.train_step(loss_fn, state, x, policy=NATIVE, optimizer=optimizer)
        fmp_seen = list(seen)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = reference(x)
            loss = function.apply(out[:, -1], reference_w).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(torch_optimizer)
        scaler.update()
        torch_optimizer.zero_grad()
        assert torch.equal(info.loss, loss.detach())
        # The Function saw autocast on in its forward (off inside with cast_inputs) and its
        # backward ran with the forward's state, as under torch.autocast.
        assert fmp_seen == seen == [(function is DocsMatMul, function is DocsMatMul, torch.bfloat16)]
    expected = {**{k: v.detach() for k, v in reference.named_parameters()}, "w": reference_w.detach()}
    assert_trees_bitwise_equal(state.params, expected)


def test_the_region_answers_torch_autocasts_questions_and_only_for_its_own_device_and_rules() -> None:
    def ask(x: torch.Tensor) -> tuple[bool, torch.dtype, torch.dtype]:
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), (x @ x).dtype

    x = torch.randn(3, 3)
    assert autocast(ask, torch.bfloat16, rules="cpu")(x) == (True, torch.bfloat16, torch.bfloat16)
    assert autocast(ask, torch.float16, rules=CPU)(x) == (True, torch.float16, torch.float16)
    # fmp's own mode: rules of another device, a rule set of one's own, overrides, or no tensor argument.
    off = (False, torch.get_autocast_dtype("cpu"), torch.bfloat16)
    assert autocast(ask, torch.bfloat16)(x) == off
    assert autocast(ask, torch.bfloat16, rules=dict(CPU))(x) == off
    assert autocast(ask, torch.bfloat16, rules="cpu", overrides={"softmax": torch.float32})(x) == off
    assert autocast(lambda: ask(x), torch.bfloat16, rules="cpu")() == off


def test_native_and_python_regions_nest_with_the_innermost_winning() -> None:
    x = torch.randn(3, 3)

    def matmul_and_softmax(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype, bool]:
        return (x @ x).dtype, torch.softmax(x.to(torch.bfloat16), -1).dtype, torch.is_autocast_enabled("cpu")

    inner_python = autocast(matmul_and_softmax, torch.float16)  # CUDA rules: softmax in float32, not torch's
    assert autocast(inner_python, torch.bfloat16, rules="cpu")(x) == (torch.float16, torch.float32, False)
    inner_native = autocast(matmul_and_softmax, torch.bfloat16, rules="cpu")
    assert autocast(inner_native, torch.float16)(x) == (torch.bfloat16, torch.bfloat16, True)
    assert fmp.autocast.fixed_dtype(matmul_and_softmax, torch.float32)(x)[0] == torch.float32
    fixed_inside = autocast(fmp.autocast.fixed_dtype(matmul_and_softmax, torch.float32), torch.bfloat16, rules="cpu")
    assert fixed_inside(x) == (torch.float32, torch.bfloat16, False)


def test_native_regions_vmap_and_differentiate_as_torch_autocast() -> None:
    w, xs = torch.randn(4, 4), torch.randn(3, 2, 4)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ w).float().square().sum()

    ours = torch.func.vmap(torch.func.grad(autocast(loss, torch.bfloat16, rules="cpu")), in_dims=(None, 0))(w, xs)

    def with_torch(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(w, x)

    expected = torch.func.vmap(torch.func.grad(with_torch), in_dims=(None, 0))(w, xs)
    assert torch.equal(ours, expected)


def test_plain_autograd_and_torch_func_give_the_same_gradients_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 5, 6)

    def loss_fn(params: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).float().square().mean()

    eager = fmp.mixed_precision_grad(loss_fn, params, fmp.NoOpLossScale(), x, policy=NATIVE)
    assert_trees_bitwise_equal(eager.grads, torch.func.grad(fmp.with_policy(loss_fn, NATIVE))(params, x))
    assert not eager.loss.requires_grad and not any(g.requires_grad for g in eager.grads.values())


def test_a_model_called_directly_is_still_named_on_the_plain_autograd_path() -> None:
    model = nn.Linear(3, 1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(ValueError, match=r"reads 2 nn.Parameter\(s\) \(shapes .*\) outside params"):
        fmp.mixed_precision_grad(
            lambda p, x: model(x).sum() + sum(v.sum() for v in p.values()),
            params,
            fmp.NoOpLossScale(),
            torch.randn(2, 3),
            policy=NATIVE,
        )


def test_a_captured_tensor_that_requires_grad_still_gets_its_meta_gradient() -> None:
    lr_scale = torch.tensor(2.0, requires_grad=True)
    params = {"w": torch.randn(3)}
    x = torch.randn(3)
    grads = fmp.mixed_precision_grad(
        lambda p, x: (p["w"] * x * lr_scale).sum().square(), params, fmp.NoOpLossScale(), x, policy=fmp.Policy()
    ).grads
    (meta,) = torch.autograd.grad(grads["w"].sum(), lr_scale)
    expected = torch.func.grad(lambda s: torch.func.grad(lambda w: (w * x * s).sum().square())(params["w"]).sum())(
        lr_scale.detach()
    )
    torch.testing.assert_close(meta, expected)


def _docs_function_grad(params: Any, scaler: fmp.LossScale, x: torch.Tensor) -> fmp.Gradients:
    return fmp.mixed_precision_grad(
        lambda p, x: DocsMatMul.apply(x, p["w"]).float().sum(), params, scaler, x, policy=NATIVE
    )


class ScaledBackwardMatMul(zoo.MatMul):
    """The zoo's docs-style matmul with a backward that doubles the gradient: not the forward's derivative."""

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return 2 * grad.mm(b.t()), 2 * a.t().mm(grad)


def _scaled_backward_grad(params: Any, scaler: fmp.LossScale, x: torch.Tensor) -> fmp.Gradients:
    return fmp.mixed_precision_grad(
        lambda p, x: ScaledBackwardMatMul.apply(x, p["w"]).float().sum(), params, scaler, x, policy=NATIVE
    )


@pytest.mark.compiled
# Dynamo instantiates the Function class itself while tracing it, which torch deprecates.
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
def test_compiled_a_ctx_style_function_runs_its_own_backward_as_eager() -> None:
    # (Its backward must not write Python state, as under torch.compile(model): Dynamo traces it.)
    params, scaler, x = {"w": torch.randn(3, 3)}, fmp.DynamicLossScale.create(), torch.randn(2, 3)
    compiled = torch.compile(_scaled_backward_grad, fullgraph=True)(params, scaler, x)
    eager = _scaled_backward_grad(params, scaler, x)
    assert torch.equal(compiled.grads["w"], eager.grads["w"])
    derivative = fmp.mixed_precision_grad(
        lambda p, x: x.mm(p["w"]).float().sum(), params, scaler, x, policy=NATIVE
    ).grads["w"]
    assert torch.equal(eager.grads["w"], 2 * derivative)


class StraightThroughRound(torch.autograd.Function):
    """Rounds forward, passes the gradient through backward: a backward that is not the forward's derivative."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@pytest.mark.compiled
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
@pytest.mark.parametrize("rules", ["cpu", "none"])
def test_compiled_a_function_applied_to_a_param_as_it_is_runs_its_own_backward(rules: str) -> None:
    # With the device's own rules the param reaches the Function uncast: a torch.func.grad input as
    # it is, for which Dynamo would differentiate the forward (round: zero gradients) instead.
    policy = fmp.get_policy(f"params=float32,compute=bfloat16,output=float32,rules={rules}")
    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create({"w": 3 * torch.randn(4, 3)}, optimizer, fmp.DynamicLossScale.create())
    x = torch.randn(8, 4)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (x @ StraightThroughRound.apply(params["w"])).square().mean()

    step = functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer)
    eager, _ = step(state, x)
    compiled, _ = torch.compile(step, fullgraph=True)(state, x)
    assert not torch.equal(eager.params["w"], state.params["w"])
    torch.testing.assert_close(compiled.params["w"], eager.params["w"], rtol=0.02, atol=0.01)


def test_under_vmap_a_ctx_style_function_is_refused_with_the_way_out() -> None:
    params, scaler = {"w": torch.randn(3, 3)}, fmp.DynamicLossScale.create()
    with pytest.raises(RuntimeError, match=r"(?s)setup_context staticmethod.*fmp's step runs such a Function eager"):
        torch.func.vmap(_docs_function_grad, in_dims=(None, None, 0))(params, scaler, torch.randn(2, 2, 3))


def test_remat_inside_a_native_region_recomputes_an_inner_region_as_it_ran() -> None:
    seen: list[tuple[torch.dtype, bool]] = []

    def inner(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x @ w
        seen.append((y.dtype, torch.is_autocast_enabled("cpu")))
        return y

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return autocast(inner, torch.float16)(x, w).float().sin()

    def loss(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, rematerialize: bool) -> torch.Tensor:
        h = (fmp.remat.remat(block) if rematerialize else block)(x, w1)
        return (h @ w2).float().square().sum()

    gen = torch.Generator().manual_seed(0)
    w1, w2, x = (torch.randn(shape, generator=gen) for shape in ((8, 8), (8, 8), (4, 8)))
    grads = []
    for rematerialize in (False, True):
        seen.clear()
        grads.append(
            torch.func.grad(
                autocast(functools.partial(loss, rematerialize=rematerialize), torch.bfloat16, rules="cpu")
            )(w1, w2, x)
        )
        # The recompute runs the inner region as the forward did: float16, torch.autocast off.
        assert seen == [(torch.float16, False)] * (1 + rematerialize)
    assert torch.equal(grads[0], grads[1])
