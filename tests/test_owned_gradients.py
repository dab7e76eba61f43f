"""The eager step unscales in place only gradients nothing else holds: shared or held ones keep their values."""

from __future__ import annotations

from typing import Any

import torch

import fmp
from fmp._backward import grad_and_aux

POLICY = fmp.get_policy("params=float32,compute=float32,output=float32")
SCALE = 2.0**10


class _ReturnsHeld(torch.autograd.Function):
    """A third-party-style kernel whose backward hands back a tensor the caller keeps."""

    held = torch.full((3,), 7.0)

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _ReturnsHeld.held


def _step(loss_fn: Any, params: dict[str, torch.Tensor]) -> fmp.StepInfo:
    scaler = fmp.StaticLossScale.create(SCALE)
    state = fmp.TrainState.create(params, fmp.optim.sgd(1.0), scaler)
    new_state, info = fmp.train_step(loss_fn, state, policy=POLICY, optimizer=fmp.optim.sgd(1.0), grad_norm=True)
    return new_state, info


def test_a_gradient_the_loss_function_keeps_is_not_overwritten() -> None:
    params = {"w": torch.zeros(3)}
    new_state, _ = _step(lambda p: _ReturnsHeld.apply(p["w"]).sum(), params)
    assert torch.equal(_ReturnsHeld.held, torch.full((3,), 7.0))  # read back, not unscaled in place
    assert torch.equal(new_state.params["w"], torch.full((3,), -7.0 / SCALE))


def test_one_gradient_tensor_for_two_params_is_unscaled_once_for_each() -> None:
    # The backward of a + b hands the same tensor to both inputs.
    params = {"a": torch.ones(4), "b": torch.ones(4)}
    found = grad_and_aux(lambda p: ((p["a"] + p["b"]).sum() * 3.0, ()), params)
    assert found.grads["a"] is found.grads["b"] and not found.owned
    new_state, _ = _step(lambda p: (p["a"] + p["b"]).sum() * 3.0, params)
    assert torch.equal(new_state.params["a"], torch.full((4,), -2.0))
    assert torch.equal(new_state.params["b"], torch.full((4,), -2.0))


def test_gradients_only_the_step_holds_are_owned() -> None:
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    x = torch.randn(2, 5)
    found = grad_and_aux(lambda p: ((x @ p["w"]).square().sum() + (p["b"] ** 2).sum(), ()), params)
    assert found.owned == {id(found.grads["w"]), id(found.grads["b"])}
    # A view (a broadcast bias's gradient, summed to its shape) shares its base's storage: not owned.
    found = grad_and_aux(lambda p: ((x @ p["w"] + p["b"]).square().sum(), ()), params)
    assert id(found.grads["w"]) in found.owned and id(found.grads["b"]) not in found.owned
