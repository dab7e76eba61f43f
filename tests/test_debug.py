"""fmp.locate_nonfinite: names the op and module where inf or NaN first appear, and agrees with the step."""

from __future__ import annotations

from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import POLICIES
from conftest import assert_trees_bitwise_equal
from torch import nn

import fmp

FLOAT16 = fmp.get_policy("params=float32,compute=float16,output=float32")


def mlp(
    seed: int = 0, hidden_scale: float = 1.0
) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Linear, Tanh, (Linear, Tanh) in a nested Sequential, Linear; the hidden Linear's weight scaled."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["2.0.weight"] = params["2.0.weight"] * hidden_scale
    return model, params, torch.randn(4, 8), torch.randn(4, 1)


def loss_of(model: nn.Module) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    return loss_fn


def test_a_float16_forward_overflow_is_named_with_its_module_and_absorbed_by_tanh() -> None:
    model, params, x, y = mlp(hidden_scale=1e5)
    report = fmp.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16)
    origin = report.forward
    assert origin is not None and (origin.op, origin.module, origin.node) == ("linear", "2.0", "")
    assert origin.output_dtypes == (torch.float16,) and set(origin.input_dtypes) == {torch.float16}
    assert 0 < origin.largest_input < torch.finfo(torch.float16).max
    # tanh(inf) is 1: the loss and gradients stay finite, as the step's flag says.
    grads = fmp.mixed_precision_grad(loss_of(model), params, fmp.NoOpLossScale(), x, y, policy=FLOAT16)
    assert report.finite and bool(grads.grads_finite) and report.backward is None
    assert "`linear` in module `2.0`: float16 output" in str(report) and "a float16 forward op overflowed" in str(
        report
    )


@hypothesis.given(log2_scale=st.integers(0, 40), seed=st.integers(0, 3), hidden_scale=st.sampled_from([1.0, 300.0]))
@hypothesis.settings(max_examples=25)
def test_the_report_agrees_with_the_step_leaf_by_leaf(log2_scale: int, seed: int, hidden_scale: float) -> None:
    model, params, x, y = mlp(seed, hidden_scale)
    scaler = fmp.StaticLossScale.create(2.0**log2_scale)
    report = fmp.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scaler)
    grads = fmp.mixed_precision_grad(loss_of(model), params, scaler, x, y, policy=FLOAT16)
    expected = tuple(f"params[{k!r}]" for k, g in grads.grads.items() if not bool(torch.isfinite(g).all()))
    assert report.nonfinite_grads == expected and report.finite == bool(grads.grads_finite)
    assert report.loss == float(grads.loss) and report.loss_scale == 2.0**log2_scale
    # The forward is finite at every scale, so a skipped step is the scaled backward's overflow.
    assert report.forward is None and report.nonfinite_inputs == ()
    assert (report.backward is None) == report.finite
    if report.backward is not None:
        assert report.backward.output_dtypes[0] == torch.float16 and report.backward.node.endswith("Backward0")
        assert report.backward.largest_input <= torch.finfo(report.backward.input_dtypes[0]).max


def test_a_backward_overflow_inside_a_module_names_the_module_and_the_gradient_function() -> None:
    model, params, x, y = mlp(hidden_scale=300.0)
    scaler = fmp.StaticLossScale.create(2.0**15)
    report = fmp.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scaler)
    assert report.backward is not None and not report.finite
    assert (report.backward.op, report.backward.node, report.backward.module) == ("linear", "AddmmBackward0", "3")
    assert "only the scaled backward pass overflowed" in str(report)
    # Past 65504 the gradient reaching the model's float16 output overflows first, in the cast
    # the policy's output rule made outside any module.
    report = fmp.locate_nonfinite(
        loss_of(model), params, x, y, policy=FLOAT16, scaler=fmp.StaticLossScale.create(2.0**30)
    )
    assert report.backward is not None and (report.backward.op, report.backward.module) == ("to", "")
    assert report.backward.input_dtypes == (torch.float32,) and report.backward.output_dtypes == (torch.float16,)


@pytest.mark.parametrize("policy", POLICIES)
def test_nan_in_the_batch_is_named_and_not_blamed_on_any_op(policy: str) -> None:
    model, params, x, y = mlp()
    x[1, 3] = float("nan")
    report = fmp.locate_nonfinite(loss_of(model), params, x, y, policy=fmp.get_policy(policy))
    assert report.nonfinite_inputs == ("args[0]",) and report.forward is None and report.backward is None
    assert set(report.nonfinite_grads) == {f"params[{k!r}]" for k in params} and not report.finite
    assert "check the batch" in str(report)


def test_a_float32_log_of_zero_is_located_outside_any_module() -> None:
    model, params, x, y = mlp()

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (x,))
        return (out - y).square().mean() + torch.log(out - out).mean()

    report = fmp.locate_nonfinite(loss_fn, params, x, y, policy=fmp.Policy())
    assert report.forward is not None and (report.forward.op, report.forward.module) == ("log", "")
    assert report.forward.output_dtypes == (torch.float32,) and report.loss == float("-inf")
    assert "a log of 0" in str(report) and not report.finite


def test_nothing_is_updated_and_the_hooks_are_removed() -> None:
    model, params, x, y = mlp(hidden_scale=300.0)
    scaler = fmp.DynamicLossScale.create()
    before = pytree.tree_map(torch.clone, (params, scaler, x, y))
    hooks = (
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
    )
    report = fmp.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scaler)
    assert report.loss_scale == 2.0**16
    assert_trees_bitwise_equal((params, scaler, x, y), before)
    assert not any(p.requires_grad for p in params.values())
    assert hooks == (len(nn.modules.module._global_forward_pre_hooks), len(nn.modules.module._global_forward_hooks))


def test_bad_calls_raise_clear_errors() -> None:
    model, params, x, y = mlp()
    with pytest.raises(RuntimeError, match="call it eagerly"):
        torch.func.grad(lambda p: fmp.locate_nonfinite(loss_of(model), p, x, y, policy=FLOAT16).loss)(params)
    with pytest.raises(TypeError, match=r"policy must be an fmp\.Policy"):
        fmp.locate_nonfinite(loss_of(model), params, x, y, policy="compute=float16")  # type: ignore[arg-type]
    ensemble = fmp.stack_trees([fmp.DynamicLossScale.create()] * 2)
    with pytest.raises(ValueError, match="holds 2 scales"):
        fmp.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=ensemble)
    with pytest.raises(TypeError, match="0-dim floating loss"):
        fmp.locate_nonfinite(lambda p, x, y: loss_of(model)(p, x, y)[None], params, x, y, policy=FLOAT16)
    with pytest.raises(TypeError, match=r"nn\.Parameter"):
        fmp.locate_nonfinite(loss_of(model), dict(model.named_parameters()), x, y, policy=FLOAT16)
