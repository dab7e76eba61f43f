"""locate_nonfinite on origins easy to miss: masked ops' backward, indexed writes, custom Functions, the seed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fmp

F32 = fmp.Policy()


def masked_log(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = (x @ params["w"]).square()
    return torch.where(h > 0, torch.log(h), torch.zeros_like(h)).sum()


def masked_exp(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = x @ params["w"]
    return torch.where(h < 50, torch.exp(h), torch.zeros_like(h)).sum()


def masked_log_beside_an_inf(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    # log also meets an inf it carries on: its backward still makes NaN at the masked log(0).
    h = (x @ params["w"]).square() + torch.tensor([float("inf"), 0.0, 0.0, 0.0])
    return torch.where(torch.isfinite(h.log()) & (h > 0), h.log(), torch.zeros_like(h)).sum()


@pytest.mark.parametrize(("loss_fn", "op"), [(masked_log, "log"), (masked_exp, "exp")], ids=["log", "exp"])
def test_a_masked_ops_backward_that_makes_nan_is_named(loss_fn: Any, op: str) -> None:
    # The forward's inf is masked away, but the op's backward meets it with the mask's zero
    # gradient and makes NaN (0/0, 0 * inf): the step skips, and the report says where.
    params, x = {"w": torch.eye(4) * 100}, torch.eye(4)[:3].clone()
    x[0] = 0  # log(0) = -inf; for exp, 100 on the diagonal overflows
    if op == "exp":
        x[0] = 1
    report = fmp.debug.locate_nonfinite(loss_fn, params, x, policy=F32)
    assert report.forward is not None and report.forward.op == op and not report.finite
    backward = report.backward
    assert backward is not None and (backward.op, backward.made) == (op, "NaN")
    assert backward.node.lower().startswith(op)
    assert "which makes NaN: keep the op's output finite" in str(report)


def test_a_masked_ops_backward_nan_is_named_where_the_op_also_carries_an_inf_on() -> None:
    # The inf comes in with a constant, so no forward op made it; log's backward still makes NaN at
    # the masked log(0), at another element.
    report = fmp.debug.locate_nonfinite(masked_log_beside_an_inf, {"w": torch.eye(4)}, torch.eye(4)[:3] * 0, policy=F32)
    backward = report.backward
    assert backward is not None and (backward.op, backward.made) == ("log", "NaN") and not report.finite


class Exp(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.exp()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (output,) = ctx.saved_tensors
        return grad * output


class ExpAndCopy(torch.autograd.Function):
    """Two outputs, a finite copy and an exp that overflows: its node made what both held."""

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), x.exp()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(output[1])

    @staticmethod
    def backward(ctx: Any, grad_copy: torch.Tensor, grad_exp: torch.Tensor) -> torch.Tensor:
        (exp,) = ctx.saved_tensors
        return grad_copy + grad_exp * exp


def copy_then_exp(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    copy, exp = ExpAndCopy.apply(x @ p["w"])
    return copy.sum() + exp.sum()  # the finite output read first


UNMASKED = {
    "exp": lambda p, x: (x @ p["w"]).exp().sum(),
    "custom_exp": lambda p, x: Exp.apply(x @ p["w"]).sum(),
    "custom_exp_is_the_loss": lambda p, x: Exp.apply((x @ p["w"]).sum()),  # read by no call
    "custom_two_outputs": copy_then_exp,
}


@pytest.mark.parametrize("name", UNMASKED)
def test_an_overflow_that_reaches_the_loss_is_named_in_the_forward_only(name: str) -> None:
    # A backward meeting the forward's inf passes it on (grad * inf): it makes nothing the forward did not.
    report = fmp.debug.locate_nonfinite(UNMASKED[name], {"w": torch.eye(2) * 100}, torch.ones(2, 2), policy=F32)
    assert report.forward is not None and report.forward.op == "exp" and report.backward is None


def test_an_overflow_in_an_indexed_write_is_named() -> None:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(2, 2, dtype=torch.float16)
        out[:] = x @ params["w"] * 1000  # float32 values past 65504, written into a float16 buffer
        return out.float().mean()

    report = fmp.debug.locate_nonfinite(loss_fn, {"w": torch.eye(2) * 100}, torch.eye(2), policy=F32)
    origin = report.forward
    assert origin is not None and (origin.op, origin.made) == ("__setitem__", "inf")
    assert origin.output_dtypes == (torch.float16,)


class NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Child(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return NanBackward.apply(h)  # type: ignore[no-any-return]


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Child()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.child(h).sum()


def test_nan_made_by_a_custom_functions_backward_names_the_function_and_its_module() -> None:
    # The Function runs in `child`; its output is read in the parent.
    model = Parent()
    loss_fn = lambda p, x: model(x @ p["w"])  # noqa: E731
    report = fmp.debug.locate_nonfinite(loss_fn, {"w": torch.eye(4)}, torch.ones(2, 4), policy=F32)
    backward = report.backward
    assert backward is not None and (backward.op, backward.node) == ("NanBackward.apply", "NanBackwardBackward")
    assert (backward.module, backward.module_type) == ("child", "Child")


def test_a_float16_loss_that_cannot_carry_the_scaled_seed_is_explained() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    params = {k: v.detach() for k, v in model.named_parameters()}
    policy = fmp.get_policy("p=f32,c=f16,o=f16")
    loss_fn = lambda p, x: torch.func.functional_call(model, p, (x,)).sum()  # noqa: E731
    scaler = fmp.DynamicLossScale.create()
    report = fmp.debug.locate_nonfinite(loss_fn, params, torch.ones(2, 4), policy=policy, scaler=scaler)
    backward = report.backward
    assert backward is not None and backward.op == "" and backward.node.startswith("ToCopyBackward")
    text = str(report)
    assert f"from {backward.node} outside any module" in text and "``" not in text
    assert "the float16 loss cannot carry the scaled gradient seed (65536 > 65504)" in text


def test_a_backward_nan_that_never_reaches_the_gradients_gets_no_step_advice() -> None:
    # The norm's backward meets an inf from a captured constant and makes NaN, which relu's
    # backward zeroes: the step applies, so nothing about the loss scale is suggested.
    offset = torch.tensor([float("inf"), 0.0])

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.minimum((torch.relu(x @ p["w"] - 10) + offset).norm(), torch.tensor(1.0))

    scaler = fmp.DynamicLossScale.create()
    report = fmp.debug.locate_nonfinite(loss_fn, {"w": torch.eye(2)}, torch.ones(1, 2), policy=F32, scaler=scaler)
    assert report.finite and report.backward is not None
    assert "gradients: finite" in str(report) and "backs off" not in str(report)


def test_a_mask_filled_with_minus_inf_before_a_softmax_is_no_origin() -> None:
    # masked_fill(mask, -inf) puts the inf there on purpose (attention masks): not an overflow.
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[:, 0] = True

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (x @ params["w"]).masked_fill(mask, float("-inf")).softmax(-1).sum()

    report = fmp.debug.locate_nonfinite(loss_fn, {"w": torch.randn(6, 6)}, torch.randn(3, 6), policy=F32)
    assert report.forward is None and report.finite


def test_the_origin_is_named_in_the_largest_module_that_ran() -> None:
    # The loss runs a submodule alone (where the overflow first happens), then the whole model:
    # the module is named by its path in the model, "2.0", not by its path in the submodule, "0".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["2.0.weight"] = params["2.0.weight"] * 1e5

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        inner = torch.func.functional_call(model[2], {k[2:]: v for k, v in params.items() if k.startswith("2.")}, (x,))
        out = torch.func.functional_call(model, params, (x,))
        return nn.functional.mse_loss(out, y) + 0 * inner.sum().clamp(max=0)

    policy = fmp.get_policy("params=float32,compute=float16,output=float32")
    report = fmp.debug.locate_nonfinite(loss_fn, params, torch.randn(4, 8), torch.randn(4, 1), policy=policy)
    assert report.forward is not None and (report.forward.module, report.forward.module_type) == ("2.0", "Linear")
