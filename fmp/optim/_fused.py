"""torch's fused optimizer kernels behind fmp's pure optimizers (`fused=True`).

torch's fused Adam, AdamW and SGD kernels update every tensor in one call and take the mixed-precision
skip as a tensor (`found_inf`): on a skipped step they leave their inputs as they were, so the step
needs no select pass over the params and optimizer state. They write in place, so fmp runs them on
copies, or, when the step's state is donated, on the state's own tensors. Their numerics are those
of `torch.optim.AdamW(fused=True)` (and Adam's, SGD's), which round differently from the
single-tensor and foreach forms in the last bits.

Eager only: under torch.compile or a `torch.func` transform (which have no rule for these kernels)
the optimizer takes its pure form, with the numerics of `fused=False`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fmp._pytree as pytree
from fmp._donation import writable
from fmp._donation import writes_in_place
from fmp._tree import select_tree

__all__ = [
    "FUSED_DTYPES",
    "counted_step",
    "group_by_device_and_dtype",
    "runs_fused",
    "select_leaves",
    "skip_flag",
    "unfused_update",
]

FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def runs_fused(params: list[Any], grads: list[Any], *trees: Any) -> bool:
    """Whether the fused kernel can take these leaves now: eager, plain contiguous tensors of a fused dtype.

    Not while compiling or under a `torch.func` transform, nor where autograd records a leaf (a
    meta-gradient through the step), nor for complex or sparse tensors, tensor subclasses, or
    devices without the kernels. Every tensor the kernel receives (params, gradients and the
    tensors of `trees`, such as Adam's moments) must be contiguous: torch's fused kernels walk
    their memory in order whatever the strides (a transposed param would be updated with
    another element's gradient), and a contiguous param is one the kernel may also write in place.
    """
    others = pytree.tree_leaves(trees)
    if not params or not writes_in_place(params, grads, others):
        return False
    for x in params:
        # The devices with the kernels, read as properties: `.device` builds a device object per leaf.
        if type(x) is not torch.Tensor or x.dtype not in FUSED_DTYPES or not (x.is_cpu or x.is_cuda):
            return False
        if not x.is_contiguous():
            return False
    if not all(type(g) is torch.Tensor and g.layout == torch.strided and g.is_contiguous() for g in grads):
        return False
    return all(x.is_contiguous() for x in others if isinstance(x, torch.Tensor))


def counted_step(step: torch.Tensor, applied: torch.Tensor | None) -> torch.Tensor:
    """The optimizer's step count after a kernel call: one more where applied (None: always)."""
    return step + 1 if applied is None else step + applied.to(step.dtype)


def skip_flag(applied: torch.Tensor | None) -> torch.Tensor | None:
    """The `found_inf` the kernels take: 1.0 where the step is skipped, 0.0 where applied (None: always applied)."""
    return None if applied is None else (~applied).float()


def group_by_device_and_dtype(params: list[torch.Tensor]) -> list[list[int]]:
    """The indices of `params` in groups of one device and dtype, each group one kernel call (as torch groups them)."""
    groups: dict[tuple[Any, torch.dtype], list[int]] = {}
    for index, param in enumerate(params):
        # A CPU tensor's device read as a flag: `.device` builds a device object per leaf.
        device = "cpu" if param.is_cpu else param.device
        groups.setdefault((device, param.dtype), []).append(index)
    return list(groups.values())


def unfused_update(
    update: Callable[[Any, Any, Any], tuple[Any, Any]],
    grads: Any,
    state: Any,
    params: Any,
    applied: torch.Tensor | None,
) -> tuple[Any, Any]:
    """The masked update where the kernel cannot run: the pure `update`, then the select the step would make."""
    updated = update(grads, state, params)
    return updated if applied is None else select_tree(applied, updated, (params, state))


def select_leaves(
    applied: torch.Tensor, new: list[torch.Tensor], old: list[torch.Tensor], *, into_old: bool
) -> list[torch.Tensor]:
    """`new` where `applied`, else `old`, leaf by leaf, written into `old` (donated) or into `new`.

    For eager updates whose new leaves are temporaries of their own: `torch.where` with `out=`,
    bit for bit `select_tree`'s values. With `into_old`, the caller donated `old`, and each
    `writable` leaf of it receives the result (one that is not is replaced by a new tensor).
    Temporaries share no memory with the donated leaves, so none needs copying before the writes
    that `select_into` guards against.
    """
    if into_old:
        return [torch.where(applied, n, o, out=o if writable(o) else None) for n, o in zip(new, old, strict=True)]
    return [torch.where(applied, n, o, out=n) for n, o in zip(new, old, strict=True)]
