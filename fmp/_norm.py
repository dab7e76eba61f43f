"""The global L2 norm of a pytree, and clipping to it, as `torch.nn.utils.clip_grad_norm_` computes them."""

from __future__ import annotations

from typing import Any
from typing import TypeVar
from typing import cast

import torch

import fmp._pytree as pytree
from fmp._donation import writable
from fmp._tree import check_no_opaque_leaves
from fmp._tree import is_inexact_tensor

__all__ = ["clip_tree_by_global_norm", "global_norm"]

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
        torch.linalg.vector_norm(_dense_values(g), 2, dtype=torch.float32 if g.dtype == torch.float16 else None).to(
            device
        )
        for group in groups.values()
        for g in group
    ]
    norm: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), 2)
    return norm


def _dense_values(leaf: torch.Tensor) -> torch.Tensor:
    # A sparse COO gradient's norm is that of its values once duplicate indices are summed.
    return leaf.coalesce().values() if leaf.layout == torch.sparse_coo else leaf


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
        if g.layout == torch.sparse_coo:
            # The values are scaled as a dense gradient's elements are (in float32, then rounded):
            # a sparse tensor times a 0-dim one would round the factor to a 16-bit dtype first.
            g = g.coalesce()
            values = (g.values() * factor.to(g.device)).to(g.dtype)
            return torch.sparse_coo_tensor(g.indices(), values, g.shape, is_coalesced=True, check_invariants=False)
        return g.mul_(factor.to(g.device)) if in_place and writable(g) else (g * factor.to(g.device)).to(g.dtype)

    clipped = pytree.tree_map(clip, grads)
    return cast(Tree, clipped), norm
