"""Stochastic gradient descent as a pure function, numerically matching `torch.optim.SGD`."""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from fmp._checks import check_real
from fmp.optim._base import Optimizer
from fmp.optim._base import check_state
from fmp.optim._base import step_counter
from fmp.optim._base import tree_zeros_like

__all__ = ["SgdState", "sgd"]


class SgdState(NamedTuple):
    """State of SGD with momentum.

    Attributes:
        step: Applied steps so far, a 0-dim int32 tensor.
        momentum: The momentum buffers, shaped like the parameters.
    """

    step: torch.Tensor
    momentum: Any


def sgd(
    lr: float,
    momentum: float = 0.0,
    *,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> Optimizer:
    """SGD with optional momentum, Nesterov momentum and L2 weight decay, as `torch.optim.SGD`.

    The arithmetic is torch's, op for op, so float32 results are bit-identical to torch.optim.SGD.
    Without momentum the optimizer is stateless (its state is `()`), so it works with
    `fmp.mixed_precision_step`; with momentum the state is an `SgdState`.

    Args:
        lr: Learning rate, >= 0.
        momentum: Momentum factor in [0, 1].
        dampening: Dampening of momentum in [0, 1].
        nesterov: Use Nesterov momentum (needs momentum > 0 and dampening 0, as torch).
        weight_decay: L2 penalty added to the gradient, >= 0.

    Returns:
        The optimizer.
    """
    lr = check_real("lr", lr, 0.0, math.inf)
    momentum = check_real("momentum", momentum, 0.0, 1.0, high_inclusive=True)
    dampening = check_real("dampening", dampening, 0.0, 1.0, high_inclusive=True)
    weight_decay = check_real("weight_decay", weight_decay, 0.0, math.inf)
    if nesterov and (momentum == 0.0 or dampening != 0.0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")

    def direction(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return torch.add(grad, param, alpha=weight_decay) if weight_decay else grad

    if momentum == 0.0:

        def init_stateless(params: Any) -> tuple[()]:
            del params
            return ()

        def update_stateless(grads: Any, state: tuple[()], params: Any) -> tuple[Any, tuple[()]]:
            if not (type(state) is tuple and not state):
                raise TypeError(
                    f"sgd without momentum keeps no state, got {type(state).__name__}: "
                    f"was it created by another optimizer's init?"
                )
            new_params = pytree.tree_map(lambda g, p: torch.add(p, direction(g, p), alpha=-lr), grads, params)
            return new_params, state

        return Optimizer(init_stateless, update_stateless)

    def init(params: Any) -> SgdState:
        return SgdState(step_counter(params), tree_zeros_like(params))

    def update(grads: Any, state: SgdState, params: Any) -> tuple[Any, SgdState]:
        check_state("sgd with momentum", state, SgdState)
        # torch seeds the buffer with the first step's direction, undamped.
        first_step = state.step == 0

        def new_buffer(grad: torch.Tensor, param: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            d = direction(grad, param)
            return torch.where(first_step, d, torch.add(buf * momentum, d, alpha=1.0 - dampening))

        buffers = pytree.tree_map(new_buffer, grads, params, state.momentum)

        def new_param(grad: torch.Tensor, param: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            step = torch.add(direction(grad, param), buf, alpha=momentum) if nesterov else buf
            return torch.add(param, step, alpha=-lr)

        return pytree.tree_map(new_param, grads, params, buffers), SgdState(state.step + 1, buffers)

    return Optimizer(init, update)
