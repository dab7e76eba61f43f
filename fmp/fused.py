"""The scaler's per-step work, unscale, finite check and scale update (and clipping), as pure functions.

`unscale_and_adjust` is what a training step does between backward and the optimizer, for
gradients computed outside fmp's step; `unscale_clip_and_adjust` also clips them to a global norm
as `clip_grad_norm_` does. Eager, they run as a handful of torch ops per gradient; their `fused_`
forms are the same functions compiled by `torch.compile(fullgraph=True)`. The fused unscale makes
one pass per gradient: read it, write the unscaled values, and reduce the finite flag in the same
loop. On GPUs each gradient is reduced row by row in that pass, every gradient's row flags meet in
one final reduction that also moves the scale, and combo kernels group the passes into a few
launches; on CPUs each unscaled gradient is realized once, so that with donation the in-place
write and the check share one loop. Inside a compiled `fmp.train_step` the unscale has no pass of
its own: it folds into the optimizer's kernels, no unscaled gradient is written out, and the
gradients are read twice (the check, then the update).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any
from typing import TypeVar
from typing import cast

import torch

from fmp._checks import check_bool
from fmp._checks import check_real
from fmp._donation import check_distinct
from fmp._donation import donate_into
from fmp._donation import writes_in_place
from fmp.loss_scale import LossScale
from fmp.loss_scale import check_scaler
from fmp.loss_scale import unscale_in_place
from fmp.optim.clip import clip_tree_by_global_norm
from fmp.tree import all_finite
from fmp.tree import check_gradient_leaves
from fmp.tree import check_on_device
from fmp.tree import tree_accelerator_device
from fmp.tree import tree_device

__all__ = [
    "fused_unscale_and_adjust",
    "fused_unscale_clip_and_adjust",
    "unscale_and_adjust",
    "unscale_clip_and_adjust",
]

Tree = TypeVar("Tree")
ScaleT = TypeVar("ScaleT", bound=LossScale)


def _check_arguments(scaler: Any, scaled_grads: Any, donate: Any) -> torch.device:
    """Checks the arguments and returns the device the work runs on (the flags' device)."""
    check_scaler(scaler)
    check_bool("donate", donate)
    check_gradient_leaves(scaled_grads, "scaled_grads")
    grads_device = tree_accelerator_device(scaled_grads)
    hint = f"create it there (DynamicLossScale.create(device={str(grads_device)!r}))"
    check_on_device(scaler, grads_device, "scaler", "gradients", hint)
    return grads_device or tree_device(scaler) or torch.device("cpu")


def unscale_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, *, donate: bool = False
) -> tuple[Tree, torch.Tensor, ScaleT]:
    """Unscales gradients, checks them, and moves the scale: `torch.amp`'s unscale_ plus update.

    Unlike GradScaler's kernel, which checks only the scaled gradients, the check reads the
    unscaled values, so a gradient that overflows when divided by a scale below 1 is caught.

    Args:
        scaler: The loss-scale state the gradients were computed with.
        scaled_grads: A pytree of gradients of the scaled loss.
        donate: Whether the caller hands `scaled_grads` over: the unscaled values are then
            written into their buffers (as GradScaler's in-place kernel does) instead of new tensors,
            which on CPU spares fresh pages and their faults; eager, they are multiplied in place.
            Gradients get new tensors under `torch.func` transforms, where autograd records them,
            and where they are tensor subclasses or their elements share memory (expanded ones).
            Bit for bit the values without donation.

    Returns:
        `(grads, grads_finite, new_scaler)`: the unscaled gradients (each in its input dtype), a
        0-dim bool tensor that is True when all are finite, and the adjusted scaler state.

    Raises:
        TypeError: If `scaler` is not an fmp loss-scale state or `donate` not a bool.
        ValueError: If the scaler's tensors are on another device than the gradients, or (with
            `donate`) a gradient tensor is listed twice.
    """
    _check_arguments(scaler, scaled_grads, donate)
    grads, _ = _unscale(scaler, scaled_grads, donate)
    grads_finite = all_finite(grads)
    if donate:
        grads = donate_into(scaled_grads, grads)
    return grads, grads_finite, cast(ScaleT, scaler.adjust(grads_finite))


def _unscale(scaler: LossScale, scaled_grads: Tree, donate: bool) -> tuple[Tree, bool]:
    """The unscaled gradients, and whether they were written into `scaled_grads` (eager, donated).

    With `donate`, first checks that no gradient is listed twice: before anything is written.
    """
    if donate:
        check_distinct(scaled_grads, "scaled_grads")
    if donate and writes_in_place(scaled_grads):
        return unscale_in_place(scaler, scaled_grads), True
    return scaler.unscale(scaled_grads), False


# Gradients per combo kernel: Inductor's default of 8 gives 200 gradients 25 launches, where 64
# gives 4 and stays under its 250-argument cap (3 arguments per gradient).
_GRADIENTS_PER_COMBO_KERNEL = 64


def _combo_kernel_options() -> dict[str, Any]:
    """Inductor options that fuse per-gradient kernels side by side into a few launches on GPUs.

    `combo_kernel_max_num_nodes` is passed only where the installed Inductor has it (newer than
    torch 2.11); older ones group 8 kernels per launch.
    """
    import torch._inductor.config as inductor_config

    options: dict[str, Any] = {"combo_kernels": True}
    if hasattr(inductor_config, "combo_kernel_max_num_nodes"):
        options["combo_kernel_max_num_nodes"] = _GRADIENTS_PER_COMBO_KERNEL
    return options


def _inductor_options(device_type: str, *, check_in_write_loop: bool) -> dict[str, Any]:
    if device_type == "cpu":
        # cpp_wrapper moves the per-gradient buffer and stride bookkeeping out of Python: 200
        # gradients cost ~1.8 ms a call, not ~2.6.
        options: dict[str, Any] = {"cpp_wrapper": True}
        if check_in_write_loop:
            # realize_reads_threshold=1 realizes each unscaled gradient before its finite check
            # reads it. Otherwise Inductor's C++ backend recomputes it from the scaled gradient
            # inside the check's loop, and with donate=True that loop cannot also write in place:
            # each gradient is read twice (200 x 1 MB: 1.7-2.0x torch's kernel). Where the write
            # must wait for a reduction over every gradient (the clip's norm), realizing would
            # only add a temporary as large as the gradients.
            options["realize_reads_threshold"] = 1
        return options
    return _combo_kernel_options()


@functools.cache
def _compiled(function: Callable[..., Any], device_type: str, *, check_in_write_loop: bool) -> Callable[..., Any]:
    # Compiled lazily, on first use, so importing fmp does not load the compiler.
    options = _inductor_options(device_type, check_in_write_loop=check_in_write_loop)
    return torch.compile(function, fullgraph=True, options=options)


def fused_unscale_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, *, donate: bool = False
) -> tuple[Tree, torch.Tensor, ScaleT]:
    """`unscale_and_adjust` compiled by `torch.compile(fullgraph=True)`: one pass per gradient.

    The first call with a new gradient structure (shapes, dtypes, devices) or new scaler
    hyperparameters compiles (for 200 gradients, tens of seconds on a GPU machine and about two
    minutes on a 2-core CPU); later calls with the same ones reuse the graph whatever the scale's
    value. After a shape changes Dynamo compiles a dynamic-shape graph, and past its recompile
    limit (8 by default, shared by the CPU and GPU forms and by any other `torch.compile` of
    `unscale_and_adjust`) it runs the function eagerly with a warning. Results equal
    `unscale_and_adjust`'s bit for bit.

    Args:
        scaler: The loss-scale state the gradients were computed with.
        scaled_grads: A pytree of gradients of the scaled loss.
        donate: Whether to write the unscaled values into `scaled_grads`' buffers (see
            `unscale_and_adjust`); the caller must not read `scaled_grads` afterwards.

    Returns:
        `(grads, grads_finite, new_scaler)`, as `unscale_and_adjust`.

    Raises:
        TypeError, ValueError: As `unscale_and_adjust`, raised before compiling.
    """
    device = _check_arguments(scaler, scaled_grads, donate)  # here, so errors are not wrapped by Dynamo
    compiled = _compiled(unscale_and_adjust, device.type, check_in_write_loop=True)
    result: tuple[Tree, torch.Tensor, ScaleT] = compiled(scaler, scaled_grads, donate=donate)
    return result


def _unscale_clip_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, max_norm: float, donate: bool
) -> tuple[Tree, torch.Tensor, torch.Tensor, ScaleT]:
    # No argument checks here: compiled, max_norm may be a symbolic float, which they cannot read.
    grads, in_place = _unscale(scaler, scaled_grads, donate)
    grads_finite = all_finite(grads)
    clipped, grad_norm = clip_tree_by_global_norm(grads, max_norm, in_place=in_place)
    if donate:
        clipped = donate_into(scaled_grads, clipped)
    return clipped, grads_finite, grad_norm, cast(ScaleT, scaler.adjust(grads_finite))


def _check_max_norm(max_norm: Any) -> float:
    return check_real("max_norm", max_norm, 0.0, math.inf, low_inclusive=False, high_inclusive=True)


def unscale_clip_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, max_norm: float, *, donate: bool = False
) -> tuple[Tree, torch.Tensor, torch.Tensor, ScaleT]:
    """`unscale_and_adjust`, then the gradients clipped to a global L2 norm, as `clip_grad_norm_` clips.

    GradScaler's `unscale_` followed by `torch.nn.utils.clip_grad_norm_(params, max_norm)` (with
    `error_if_nonfinite=False`, since raising would read the norm on the host) and `update`, in
    one function: the norm is that of the unscaled gradients, the L2 norm of the per-gradient L2
    norms (float16 gradients' norms taken in float32, so a large norm does not overflow to inf and
    zero every gradient), and every gradient is multiplied by `min(max_norm / (norm + 1e-6), 1)`.
    On CPU, for gradients of one dtype, the results equal GradScaler's kernel then
    `clip_grad_norm_` bit for bit (for float16 gradients, which GradScaler refuses, the norm is more
    accurate); with mixed dtypes the norm may differ in the last bit (see `clip_tree_by_global_norm`). Compiled
    (`fused_unscale_clip_and_adjust`) the gradients are traversed three times (read for the finite
    check and the norm, then read and written clipped) where torch.amp traverses them five times
    (unscale: read and write; norm: read; clip: read and write). Non-finite gradients give a
    non-finite norm and `grads_finite` False: skip the step then.

    Args:
        scaler: The loss-scale state the gradients were computed with.
        scaled_grads: A pytree of gradients of the scaled loss.
        max_norm: The largest global norm let through, > 0 (`inf` clips nothing and only
            measures the norm, as with `clip_grad_norm_`).
        donate: As `unscale_and_adjust`: the clipped values overwrite `scaled_grads`.

    Returns:
        `(grads, grads_finite, grad_norm, new_scaler)`: the unscaled, clipped gradients, the finite
        flag, the global norm of the unscaled gradients before clipping (a 0-dim tensor, as
        `clip_grad_norm_` returns it; 0 for a tree without floating gradients) and the adjusted
        scaler state.

    Raises:
        TypeError: If `scaler` is not an fmp loss-scale state, `donate` not a bool or `max_norm`
            not a real number.
        ValueError: As `unscale_and_adjust`, or if `max_norm` is not positive.
    """
    _check_arguments(scaler, scaled_grads, donate)
    return _unscale_clip_and_adjust(scaler, scaled_grads, _check_max_norm(max_norm), donate)


def fused_unscale_clip_and_adjust(
    scaler: ScaleT, scaled_grads: Tree, max_norm: float, *, donate: bool = False
) -> tuple[Tree, torch.Tensor, torch.Tensor, ScaleT]:
    """`unscale_clip_and_adjust` compiled by `torch.compile(fullgraph=True)`: two passes over the gradients.

    Compiles and recompiles as `fused_unscale_and_adjust` does. The first `max_norm` is a constant
    of the graph; a call with another value recompiles once, with `max_norm` an input, and later
    values reuse that graph. In float32 results equal the eager function's up to the order in
    which the norm's sums are taken; in 16-bit dtypes Inductor may also skip the rounding of the
    unscaled values before the clip multiplies them.

    Args:
        scaler: The loss-scale state the gradients were computed with.
        scaled_grads: A pytree of gradients of the scaled loss.
        max_norm: The largest global norm let through, > 0.
        donate: Whether to write the clipped values into `scaled_grads`' buffers; the caller must
            not read `scaled_grads` afterwards.

    Returns:
        `(grads, grads_finite, grad_norm, new_scaler)`, as `unscale_clip_and_adjust`.

    Raises:
        TypeError, ValueError: As `unscale_clip_and_adjust`, raised before compiling.
    """
    device = _check_arguments(scaler, scaled_grads, donate)
    max_norm = _check_max_norm(max_norm)
    compiled = _compiled(_unscale_clip_and_adjust, device.type, check_in_write_loop=False)
    result: tuple[Tree, torch.Tensor, torch.Tensor, ScaleT] = compiled(scaler, scaled_grads, max_norm, donate)
    return result
