"""The scaler pipeline: unscale, finite check and scale adjustment, for every entry point of fmp.

`train_step` (per loss, per accumulation window), the standalone `unscale_and_adjust`,
`fmp.distributed` and `fmp.interop.GradientBuffer` all unscale, check and adjust through the
functions here, so their results agree bit for bit. The check reads the unscaled values, so a
gradient that overflows only once divided by a scale below 1 is caught too.

Eager, on gradients a step made itself, the unscale is one `torch._foreach_mul` and the check
GradScaler's `_amp_foreach_non_finite_check_and_unscale_` run with a factor of 1 over the unscaled
values (it flags any non-finite element and writes each value back unchanged): two multi-tensor
kernels where the per-leaf form dispatches a few ops per gradient. Compiled, Inductor fuses the
per-leaf form with the backward pass instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any
from typing import Generic
from typing import NamedTuple
from typing import TypeVar
from typing import cast

import torch

import fmp._pytree as pytree
from fmp._checks import check_bool
from fmp._checks import check_real
from fmp._donation import check_distinct
from fmp._donation import donate_into
from fmp._donation import writes_in_place
from fmp._loss_scale import DynamicLossScale
from fmp._loss_scale import LossScale
from fmp._loss_scale import NoOpLossScale
from fmp._loss_scale import StaticLossScale
from fmp._loss_scale import inverse_scale
from fmp._loss_scale import unscale_in_place
from fmp._norm import clip_tree_by_global_norm
from fmp._scale_checks import check_scaler
from fmp._tree import all_finite
from fmp._tree import check_gradient_leaves
from fmp._tree import check_on_device
from fmp._tree import takes_foreach
from fmp._tree import tree_accelerator_device
from fmp._tree import tree_device

__all__ = [
    "Unscaled",
    "adjust_each",
    "check_unscale_arguments",
    "compiled_unscale_and_adjust",
    "loss_scales",
    "owned_all_finite",
    "per_loss",
    "unscale",
    "unscale_and_adjust",
    "unscale_and_check",
]

Tree = TypeVar("Tree")
ScaleT = TypeVar("ScaleT", bound=LossScale)


class Unscaled(NamedTuple, Generic[Tree, ScaleT]):
    """What `unscale_and_adjust` returns.

    Attributes:
        grads: The unscaled gradients (clipped with `max_norm`), each in its input dtype.
        grads_finite: A 0-dim bool tensor, True when every unscaled gradient is finite.
        grad_norm: With `max_norm`, the global L2 norm of the unscaled gradients before clipping (a
            0-dim tensor, as `clip_grad_norm_` returns it; 0 for a tree without floating gradients);
            None without.
        scaler: The adjusted loss-scale state.
    """

    grads: Tree
    grads_finite: torch.Tensor
    grad_norm: torch.Tensor | None
    scaler: ScaleT


def unscale_and_check(
    scaler: LossScale, scaled_grads: Any, owned: frozenset[int] = frozenset()
) -> tuple[Any, torch.Tensor]:
    """`(scaler.unscale(scaled_grads), all_finite(...))` of gradients the caller made.

    Args:
        scaler: One loss-scale state.
        scaled_grads: Gradients of the scaled loss, which nobody else holds.
        owned: The ids of the gradient tensors the caller alone holds (`Differentiated.owned`):
            eager, these are unscaled in place, where fresh memory for the results could cost the
            allocator a page fault per page.

    Returns:
        `(grads, grads_finite)`, bit for bit those of `unscale` and `all_finite`.
    """
    leaves, spec = pytree.tree_flatten(scaled_grads)
    tensor_scale = isinstance(scaler, StaticLossScale | DynamicLossScale)
    if not (tensor_scale and takes_foreach(leaves, scaler.loss_scale.device)):
        grads = scaler.unscale(scaled_grads)
        return grads, all_finite(grads)
    inverse = inverse_scale(scaler.loss_scale)
    # The kernels take contiguous tensors only, each of which is `writable`.
    in_place = [x for x in leaves if id(x) in owned] if owned else []
    if len(in_place) == len(leaves):  # the usual case: every gradient ours, unscaled where it lies
        torch._foreach_mul_(leaves, inverse)
        return scaled_grads, _finite(leaves)
    if in_place:
        torch._foreach_mul_(in_place, inverse)
    written = {id(x) for x in in_place}
    rest = [x for x in leaves if id(x) not in written]
    fresh = iter(torch._foreach_mul(rest, inverse) if rest else ())
    unscaled = [x if id(x) in written else next(fresh) for x in leaves]
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


def loss_scales(scaler: Any, device: torch.device) -> Any:
    """Each scaler's scale, on `device` (a NoOpLossScale holds no tensor to place: 1 there); a tuple for a tuple."""

    def scale_of(s: LossScale) -> torch.Tensor:
        return torch.ones((), device=device) if isinstance(s, NoOpLossScale) else s.loss_scale

    return tuple(scale_of(s) for s in scaler) if isinstance(scaler, tuple) else scale_of(scaler)


def per_loss(tree: Any) -> tuple[Any, ...]:
    """One loss's scaler (or flag) as a 1-tuple; several losses' tuple as it is."""
    return tree if isinstance(tree, tuple) else (tree,)


def adjust_each(scaler: Any, finite_per_loss: Any, in_range: tuple[torch.Tensor, ...]) -> Any:
    """Each scaler adjusted by its own flag (one scaler and flag, or tuples of them, one per loss).

    `in_range` holds `scale_in_range` of each scaler, which the step computed already.
    """
    if not isinstance(scaler, tuple):
        (one_in_range,) = in_range
        return scaler.adjust_in_range(finite_per_loss, one_in_range)
    flags = per_loss(finite_per_loss)
    return tuple(s.adjust_in_range(f, r) for s, f, r in zip(scaler, flags, in_range, strict=True))


def check_unscale_arguments(scaler: Any, scaled_grads: Any, donate: Any, max_norm: Any) -> torch.device:
    """Checks `unscale_and_adjust`'s arguments; returns the device the work runs on (the flags' device)."""
    check_scaler(scaler)
    check_bool("donate", donate)
    if max_norm is not None:
        check_real("max_norm", max_norm, 0.0, math.inf, low_inclusive=False, high_inclusive=True)
    check_gradient_leaves(scaled_grads, "scaled_grads")
    grads_device = tree_accelerator_device(scaled_grads)
    hint = f"create it there (DynamicLossScale.create(device={str(grads_device)!r}))"
    check_on_device(scaler, grads_device, "scaler", "gradients", hint)
    return grads_device or tree_device(scaler) or torch.device("cpu")


def unscale(scaler: LossScale, scaled_grads: Tree, donate: bool) -> tuple[Tree, bool]:
    """The unscaled gradients, and whether they were written into `scaled_grads` (eager, donated).

    With `donate`, first checks that no gradient is listed twice: before anything is written.
    """
    if donate:
        check_distinct(scaled_grads, "scaled_grads")
    if donate and writes_in_place(scaled_grads):
        return unscale_in_place(scaler, scaled_grads), True
    return scaler.unscale(scaled_grads), False


def _unscale_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, max_norm: float | None, donate: bool
) -> Unscaled[Tree, ScaleT]:
    # No argument checks here: compiled, max_norm may be a symbolic float, which they cannot read.
    grads, in_place = unscale(scaler, scaled_grads, donate)
    grads_finite = all_finite(grads)
    grad_norm = None
    if max_norm is not None:
        grads, grad_norm = clip_tree_by_global_norm(grads, max_norm, in_place=in_place)
    if donate:
        grads = donate_into(scaled_grads, grads)
    return Unscaled(grads, grads_finite, grad_norm, cast(ScaleT, scaler.adjust(grads_finite)))


def unscale_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, *, max_norm: float | None = None, donate: bool = False
) -> Unscaled[Tree, ScaleT]:
    """Unscales gradients, checks them, optionally clips them, and moves the scale.

    GradScaler's `unscale_`, then (with `max_norm`) `torch.nn.utils.clip_grad_norm_` with
    `error_if_nonfinite=False`, then `update`, as one pure function. The finite check reads the
    unscaled values, where GradScaler's kernel reads the scaled ones. The norm is that of the
    unscaled gradients, the L2 norm of the per-gradient L2 norms (float16 gradients' norms taken in
    float32, so a large norm does not overflow and zero every gradient), and every gradient is
    multiplied by `min(max_norm / (norm + 1e-6), 1)`. On CPU, for gradients of one dtype, the
    results equal GradScaler's kernel then `clip_grad_norm_` bit for bit. Non-finite gradients
    give a non-finite norm and `grads_finite` False: skip the step then.

    To run it as one compiled pass per gradient, wrap it in `torch.compile(..., fullgraph=True)`;
    a moving scale does not recompile. See the how-to page on the `torch.nn` loop.

    Args:
        scaler: The loss-scale state the gradients were computed with.
        scaled_grads: A pytree of gradients of the scaled loss.
        max_norm: Clip the unscaled gradients to this global L2 norm, > 0 (`inf` only measures
            the norm); None neither clips nor measures.
        donate: Whether the caller hands `scaled_grads` over: the results are then written into
            their buffers (as GradScaler's in-place kernel does) instead of new tensors. Gradients
            get new tensors under `torch.func` transforms, where autograd records them, and where
            they are tensor subclasses or their elements share memory (expanded ones). Bit for bit
            the values without donation.

    Returns:
        An `Unscaled`: `(grads, grads_finite, grad_norm, scaler)`.

    Raises:
        TypeError: If `scaler` is not an fmp loss-scale state, `donate` not a bool or `max_norm`
            not a real number.
        ValueError: If the scaler's tensors are on another device than the gradients, `max_norm`
            is not positive, or (with `donate`) a gradient tensor is listed twice.
    """
    check_unscale_arguments(scaler, scaled_grads, donate, max_norm)
    return _unscale_and_adjust(scaler, scaled_grads, None if max_norm is None else float(max_norm), donate)


# Gradients per combo kernel: Inductor's default of 8 gives 200 gradients 25 launches, where 64
# gives 4 and stays under its 250-argument cap (3 arguments per gradient).
_GRADIENTS_PER_COMBO_KERNEL = 64


def _inductor_options(device_type: str, *, clips: bool) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    if device_type == "cpu":
        # cpp_wrapper moves the per-gradient buffer and stride bookkeeping out of Python.
        options: dict[str, Any] = {"cpp_wrapper": True}
        if not clips:
            # realize_reads_threshold=1 realizes each unscaled gradient before its finite check
            # reads it. Otherwise Inductor's C++ backend recomputes it from the scaled gradient
            # inside the check's loop, and with donation that loop cannot also write in place: each
            # gradient is read twice. Where the write must wait for a reduction over every gradient
            # (the clip's norm), realizing would only add a temporary as large as the gradients.
            options["realize_reads_threshold"] = 1
        return options
    # Combo kernels group the per-gradient passes into a few launches on GPUs.
    options = {"combo_kernels": True}
    if hasattr(inductor_config, "combo_kernel_max_num_nodes"):  # newer than torch 2.11
        options["combo_kernel_max_num_nodes"] = _GRADIENTS_PER_COMBO_KERNEL
    return options


@functools.cache
def _compiled(device_type: str, clips: bool) -> Callable[..., Any]:
    # Compiled lazily, on first use, so importing fmp does not load the compiler.
    options = _inductor_options(device_type, clips=clips)
    return torch.compile(_unscale_and_adjust, fullgraph=True, options=options)


def compiled_unscale_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, *, max_norm: float | None = None, donate: bool = False
) -> Unscaled[Tree, ScaleT]:
    """`unscale_and_adjust` compiled with Inductor options tuned for one pass per gradient.

    For `GradientBuffer`, whose few flat buffers make a compiled pass cheap to launch. Arguments
    are checked before compiling, so errors are not wrapped by Dynamo.
    """
    device = check_unscale_arguments(scaler, scaled_grads, donate, max_norm)
    compiled = _compiled(device.type, max_norm is not None)
    result: Unscaled[Tree, ScaleT] = compiled(
        scaler, scaled_grads, None if max_norm is None else float(max_norm), donate
    )
    return result
