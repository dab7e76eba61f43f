"""Gradient clipping by global norm, as a wrapper around any pure optimizer."""

from __future__ import annotations

import math
from typing import Any

from fmp._checks import check_real
from fmp._norm import clip_tree_by_global_norm
from fmp._optimizer import Optimizer

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(optimizer: Optimizer, max_norm: float) -> Optimizer:
    """Wraps `optimizer` so that its update sees gradients clipped to a global L2 norm of `max_norm`.

    The arithmetic is `torch.nn.utils.clip_grad_norm_`'s (`clip_tree_by_global_norm`): the
    global norm is the L2 norm of the per-gradient L2 norms (float16 ones taken in float32), and
    every gradient is multiplied by `min(max_norm / (norm + 1e-6), 1)`, a tensor, so nothing syncs
    with the host. Inside `fmp.train_step` the optimizer receives
    unscaled gradients, so the norm is the true one: there is no `unscale_` to call first, and no
    error for calling it twice. Non-finite gradients give a non-finite norm; the step skips them.

    Args:
        optimizer: The pure optimizer to wrap, e.g. `fmp.optim.adamw(1e-3)`.
        max_norm: The largest global norm let through, > 0.

    Returns:
        An optimizer with `optimizer`'s state.

    Raises:
        TypeError, ValueError: If `optimizer` is not an fmp Optimizer or `max_norm` is not positive.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"clip_by_global_norm wraps an fmp.optim.Optimizer, got {type(optimizer).__name__}")
    max_norm = check_real("max_norm", max_norm, 0.0, math.inf, low_inclusive=False)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        clipped, _ = clip_tree_by_global_norm(grads, max_norm)
        return optimizer.update(clipped, state, params)

    return Optimizer(optimizer.init, update)
