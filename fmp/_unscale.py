"""Unscale and check gradients: `scaler.unscale` then `all_finite`, in two multi-tensor kernels eager.

Per leaf, the check takes a reduction and a few 0-dim ops, and the unscale one multiply: for a
model of a few hundred small parameters, each a dispatch from Python, several times the work
GradScaler does in one `_amp_foreach_non_finite_check_and_unscale_` call. Eager, on gradients this
step made itself, the same values come from `torch._foreach_mul` (new tensors, bit for bit the
per-leaf multiply) and GradScaler's kernel run with a factor of 1 over the unscaled values: it
flags any non-finite element, and writes each value back unchanged. So the check still reads the
unscaled gradients, where GradScaler's reads the scaled ones. Compiled, Inductor fuses the
per-leaf form with the backward pass instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fmp.loss_scale import DynamicLossScale
from fmp.loss_scale import LossScale
from fmp.loss_scale import StaticLossScale
from fmp.loss_scale import inverse_scale
from fmp.tree import all_finite
from fmp.tree import takes_foreach

__all__ = ["owned_all_finite", "unscale_and_check"]


def unscale_and_check(scaler: LossScale, scaled_grads: Any) -> tuple[Any, torch.Tensor]:
    """`(scaler.unscale(scaled_grads), all_finite(...))` of gradients the caller made and owns.

    Args:
        scaler: One loss-scale state.
        scaled_grads: Gradients of the scaled loss, which nobody else holds.

    Returns:
        `(grads, grads_finite)`, bit for bit those of `unscale` and `all_finite`.
    """
    leaves, spec = pytree.tree_flatten(scaled_grads)
    tensor_scale = isinstance(scaler, StaticLossScale | DynamicLossScale)
    if not (tensor_scale and takes_foreach(leaves, scaler.loss_scale.device)):
        grads = scaler.unscale(scaled_grads)
        return grads, all_finite(grads)
    unscaled = list(torch._foreach_mul(leaves, inverse_scale(scaler.loss_scale)))
    return pytree.tree_unflatten(unscaled, spec), _finite(unscaled)


def _finite(leaves: list[torch.Tensor]) -> torch.Tensor:
    found_inf = torch.zeros((), dtype=torch.float32, device=leaves[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(leaves, found_inf, torch.ones_like(found_inf))
    return found_inf == 0


def owned_all_finite(grads: Any) -> torch.Tensor:
    """`all_finite(grads)` of gradients the caller made and owns, in one multi-tensor kernel eager.

    Args:
        grads: Gradients nobody else holds (GradScaler's kernel writes each value back unchanged).

    Returns:
        A 0-dim bool tensor, as `all_finite`'s.
    """
    leaves = pytree.tree_leaves(grads)
    if leaves and takes_foreach(leaves, leaves[0].device):
        return _finite(leaves)
    return all_finite(grads)
