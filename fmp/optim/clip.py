"""Gradient clipping by global norm, as a wrapper around any pure optimizer."""

from __future__ import annotations

import math
from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.utils._pytree as pytree

from fmp._checks import check_real
from fmp._donation import writable
from fmp.optim._base import Optimizer
from fmp.tree import check_no_opaque_leaves
from fmp.tree import is_inexact_tensor

__all__ = ["clip_by_global_norm", "clip_tree_by_global_norm", "global_norm"]

Tree = TypeVar("Tree")


def global_norm(tree: Any) -> torch.Tensor:
    """The global L2 norm of a pytree's floating and complex tensor leaves, as `clip_grad_norm_` takes it.

    As torch does, the leaves' L2 norms are taken group by group of (device, dtype), gathered on
    the first leaf's device, and reduced to their L2 norm. The groups come in order of their first
    leaf; torch orders them by an internal map, so with mixed dtypes the norm may differ from
    torch's in the last bit (with one dtype per device they are equal). Unlike torch, a float16
    leaf's norm is taken in float32, where it cannot overflow. Nothing syncs with the host unless
    the first leaf is on the CPU and a later one on an accelerator (its norm is copied back).

    Args:
        tree: Any pytree; leaves that are not floating or complex tensors are left out.

    Returns:
        A 0-dim tensor on the first leaf's device: 0 (on the CPU) for a tree without such leaves,
        non-finite if any leaf is.
    """
    all_leaves = pytree.tree_leaves(tree)
    check_no_opaque_leaves(all_leaves, tree, "global_norm: tree")
    leaves = [leaf for leaf in all_leaves if is_inexact_tensor(leaf)]
    if not leaves:
        return torch.zeros(())
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for leaf in leaves:
        groups.setdefault((leaf.device, leaf.dtype), []).append(leaf)
    device = leaves[0].device
    norms = [
        torch.linalg.vector_norm(g, 2, dtype=torch.float32 if g.dtype == torch.float16 else None).to(device)
        for group in groups.values()
        for g in group
    ]
    norm: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), 2)
    return norm


def clip_tree_by_global_norm(grads: Tree, max_norm: float, *, in_place: bool = False) -> tuple[Tree, torch.Tensor]:
    """Clips a pytree as `clip_grad_norm_` does: every gradient times `min(max_norm / (norm + 1e-6), 1)`.

    The norm is `global_norm(grads)`. The factor is a 0-dim tensor, so nothing syncs with the host
    (but see `global_norm` for leaves on several devices).

    Args:
        grads: A pytree of gradients; leaves that are not floating or complex tensors pass through.
        max_norm: The largest global norm let through, checked by the caller.
        in_place: Whether to write the clipped values into `grads`' tensors (donated gradients)
            where they are `writable`.

    Returns:
        `(clipped, norm)`: the clipped tree and the global norm before clipping (0-dim; 0 for a
        tree without floating gradients).
    """
    norm = global_norm(grads)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    def clip(g: Any) -> Any:
        if not is_inexact_tensor(g):
            return g
        # Each gradient keeps its dtype, as under clip_grad_norm_'s in-place multiply: a 0-dim
        # float16 gradient times the float32 factor would otherwise be promoted to float32.
        return g.mul_(factor.to(g.device)) if in_place and writable(g) else (g * factor.to(g.device)).to(g.dtype)

    clipped = pytree.tree_map(clip, grads)
    return cast(Tree, clipped), norm


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
