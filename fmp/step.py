"""The mixed-precision training step: cast, scale, differentiate, unscale, check, update, adjust.

Everything here is a pure function of its arguments and reads no tensor value on the host, so a
step compiles whole under `torch.compile(fullgraph=True)` and maps under `torch.func.vmap`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import TypeVar

import torch
import torch.utils._pytree as pytree

from fmp.loss_scale import DynamicLossScale
from fmp.loss_scale import LossScale
from fmp.loss_scale import NoOpLossScale
from fmp.loss_scale import StaticLossScale
from fmp.optim._base import Optimizer
from fmp.policy import Policy
from fmp.tree import all_finite
from fmp.tree import select_tree

__all__ = ["Gradients", "StepInfo", "TrainState", "mixed_precision_grad", "mixed_precision_step", "train_step"]

Params = TypeVar("Params")
LossFn = Callable[..., Any]


class Gradients(NamedTuple):
    """What `mixed_precision_grad` returns.

    Attributes:
        grads: Unscaled gradients in the parameters' structure and dtype.
        grads_finite: 0-dim bool tensor, True when every gradient is finite after unscaling.
        loss: The unscaled loss, in the policy's output dtype.
        aux: The loss function's auxiliary output (`()` unless `has_aux`, so vmap can return it).
    """

    grads: Any
    grads_finite: torch.Tensor
    loss: torch.Tensor
    aux: Any


class StepInfo(NamedTuple):
    """What a training step reports, for logging; all on device.

    Attributes:
        loss: The unscaled loss, in the policy's output dtype.
        grads_finite: 0-dim bool tensor: True when the update was applied, False when skipped.
        loss_scale: The scale the step's gradients were computed with.
        aux: The loss function's auxiliary output (`()` unless `has_aux`, so vmap can return it).
    """

    loss: torch.Tensor
    grads_finite: torch.Tensor
    loss_scale: torch.Tensor
    aux: Any


class TrainState(NamedTuple):
    """Everything a training step updates: parameters, optimizer state, loss-scale state.

    Attributes:
        params: The parameters, a pytree of tensors in the policy's param dtype.
        opt_state: The optimizer's state.
        scaler: The loss-scale state.
    """

    params: Any
    opt_state: Any
    scaler: LossScale

    @classmethod
    def create(cls, params: Any, optimizer: Optimizer, scaler: LossScale) -> TrainState:
        """Builds the state for `params`, initialising the optimizer's state from them."""
        return cls(params, optimizer.init(params), scaler)


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar (0-dim) loss, got shape {tuple(loss.shape)}; reduce it, e.g. with .mean()"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating-point loss, got {loss.dtype}")
    return loss


def _check_config(scaler: Any, policy: Any) -> None:
    if not isinstance(scaler, NoOpLossScale | StaticLossScale | DynamicLossScale):
        raise TypeError(
            f"scaler must be an fmp loss-scale state (e.g. DynamicLossScale.create()), got {type(scaler).__name__}"
        )
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy (e.g. fmp.get_policy('c=bf16')), got {type(policy).__name__}")


def mixed_precision_grad(
    loss_fn: LossFn, params: Any, scaler: LossScale, *args: Any, policy: Policy, has_aux: bool = False
) -> Gradients:
    """Computes unscaled gradients of `loss_fn` under a precision policy and a loss scale.

    Params and floating-point args are cast to the compute dtype, the loss to the output dtype; the
    loss is scaled, differentiated with `torch.func.grad`, and the gradients (which come back in the
    param dtype) are unscaled and checked for finiteness after unscaling.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss`, or `-> (loss, aux)` with `has_aux`; loss 0-dim.
        params: The parameters, a pytree of tensors.
        scaler: The loss-scale state.
        *args: Further arguments of `loss_fn` (inputs, targets, ...).
        policy: The precision policy.
        has_aux: Whether `loss_fn` returns `(loss, aux)`.

    Returns:
        A `Gradients` tuple.

    Raises:
        TypeError, ValueError: If `loss_fn` returns anything but a 0-dim floating loss (and aux), or
            `scaler` or `policy` is of the wrong type.
    """
    _check_config(scaler, policy)

    def scaled_loss_fn(params: Any, *args: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
        out = loss_fn(policy.cast_to_compute(params), *policy.cast_to_compute(args))
        # torch.func.grad's aux holds tensors only, so the aux slot exists only with has_aux.
        aux: tuple[Any, ...] = ()
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"with has_aux=True, loss_fn must return (loss, aux), got {type(out).__name__}")
            out, aux = out[0], (out[1],)
        loss = policy.cast_to_output(_check_loss(out))
        return scaler.scale(loss), (loss, *aux)

    scaled_grads, (loss, *aux) = torch.func.grad(scaled_loss_fn, has_aux=True)(params, *args)
    grads = scaler.unscale(policy.cast_to_param(scaled_grads))
    return Gradients(grads, all_finite(grads), loss, aux[0] if has_aux else ())


def train_step(
    loss_fn: LossFn, state: TrainState, *args: Any, policy: Policy, optimizer: Optimizer, has_aux: bool = False
) -> tuple[TrainState, StepInfo]:
    """One mixed-precision optimizer step; skipped (state kept bit for bit) when gradients overflow.

    On a non-finite step the returned params and optimizer state equal the inputs bit for bit and
    only the scaler moves (it backs off). Inputs are never mutated.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss`, or `-> (loss, aux)` with `has_aux`; loss 0-dim.
        state: Params, optimizer state and scaler state.
        *args: Further arguments of `loss_fn`.
        policy: The precision policy.
        optimizer: A pure optimizer, e.g. `fmp.optim.adamw(...)`.
        has_aux: Whether `loss_fn` returns `(loss, aux)`.

    Returns:
        `(new_state, info)`; `info.grads_finite` says whether the update was applied.

    Raises:
        TypeError: If `state` is not a TrainState or `optimizer` not an Optimizer.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an fmp.TrainState (TrainState.create(...)), got {type(state).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be an fmp.optim.Optimizer (e.g. fmp.optim.adamw()), got {type(optimizer).__name__}"
        )
    params, opt_state, scaler = state
    grads, grads_finite, loss, aux = mixed_precision_grad(
        loss_fn, params, scaler, *args, policy=policy, has_aux=has_aux
    )
    updated = optimizer.update(grads, opt_state, params)
    new_params, new_opt_state = select_tree(grads_finite, updated, (params, opt_state))
    new_state = TrainState(new_params, new_opt_state, scaler.adjust(grads_finite))
    return new_state, StepInfo(loss, grads_finite, scaler.loss_scale, aux)


def mixed_precision_step(
    loss_fn: LossFn, params: Params, scaler: LossScale, *args: Any, policy: Policy, optimizer: Optimizer
) -> tuple[Params, LossScale]:
    """One mixed-precision step with a stateless optimizer: `(params, scaler) -> (params, scaler)`.

    The short form of `train_step` for optimizers that keep no state (e.g. `fmp.optim.sgd(lr)`).
    Stateful optimizers need `train_step`, which threads their state through.

    Args:
        loss_fn: `loss_fn(params, *args) -> 0-dim loss`.
        params: The parameters, a pytree of tensors.
        scaler: The loss-scale state.
        *args: Further arguments of `loss_fn`.
        policy: The precision policy.
        optimizer: A stateless pure optimizer.

    Returns:
        `(new_params, new_scaler)`.

    Raises:
        ValueError: If the optimizer keeps state.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be an fmp.optim.Optimizer (e.g. fmp.optim.sgd(0.1)), got {type(optimizer).__name__}"
        )
    opt_state = optimizer.init(params)
    if pytree.tree_leaves(opt_state):
        raise ValueError(
            "mixed_precision_step takes a stateless optimizer; this one keeps state "
            "(momentum, moments): use fmp.train_step with fmp.TrainState.create(params, optimizer, scaler)"
        )
    new_state, _ = train_step(loss_fn, TrainState(params, opt_state, scaler), *args, policy=policy, optimizer=optimizer)
    return new_state.params, new_state.scaler
