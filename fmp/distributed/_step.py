"""The data-parallel training step, and the loss-scale update for sharded gradients (FSDP2)."""

from __future__ import annotations

import functools
from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fmp._grad import LossFn
from fmp._loss_scale import LossScale
from fmp._loss_scale import NoOpLossScale
from fmp._optimizer import Optimizer
from fmp._policy import Policy
from fmp._scale_checks import ScalerTree
from fmp._scale_checks import check_scaler
from fmp._scale_checks import check_scalers
from fmp._scaler import Unscaled
from fmp._scaler import unscale
from fmp._state import TrainState
from fmp._step import StepInfo
from fmp._step import train_step as local_train_step
from fmp._tree import all_finite
from fmp._tree import check_gradient_leaves
from fmp._tree import tree_device
from fmp.distributed._reduce import Collectives
from fmp.distributed._reduce import agree_finite
from fmp.distributed._reduce import all_reduce_gradients
from fmp.distributed._replicas import check_step_layout

__all__ = ["train_step", "unscale_and_adjust"]

ScaleT = TypeVar("ScaleT", bound=LossScale)
Tree = TypeVar("Tree")


def _wire_scale(scaler: ScalerTree) -> torch.Tensor | None:
    """The scale 16-bit buffers travel in: the smallest of the scalers' (safe for every loss), None without one."""
    scalers = scaler if isinstance(scaler, tuple) else (scaler,)
    scales = [s.loss_scale for s in scalers if not isinstance(s, NoOpLossScale)]
    if not scales:
        return None
    smallest = scales[0] if len(scales) == 1 else torch.stack(scales).amin()
    # A NoOpLossScale's loss is not scaled: its gradients must fit at scale 1.
    return smallest.clamp(max=1.0) if len(scales) < len(scalers) else smallest


def train_step(
    loss_fn: LossFn,
    state: TrainState,
    *args: Any,
    policy: Policy,
    optimizer: Optimizer,
    has_aux: bool = False,
    donate: bool = False,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    collectives: Collectives = "functional",
    grad_norm: bool = False,
    check_update: bool = False,
) -> tuple[TrainState, StepInfo]:
    """`fmp.train_step` across data-parallel ranks: gradients averaged, one skip decision for all.

    Each rank passes its own batch; the gradients are averaged over `group` in the policy's reduce
    dtype (`all_reduce_gradients`), so every rank applies the same update, skips the same steps and
    moves its scale identically: their states stay bit-identical if they start so (see
    `broadcast_tree`). With equal per-rank batches and a mean loss, the step equals one process's
    step on the concatenated batch, up to rounding. `info.loss` and `info.aux` are this rank's own. Every rank must
    call it the same number of times; under `torch.compile(fullgraph=True)` the collectives are
    traced into the graph. With gradient accumulation, each micro-batch is reduced.

    Note:
        The first call for a state layout on a group syncs once: the ranks compare their states'
        paths, shapes and dtypes, policies and bucket sizes, and all raise a ValueError naming the
        first difference (see `check_replicas` for values). Later calls sync nothing: the
        all-reduce's result stays on the device. Under `torch.compile` the comparison is skipped,
        so a compiled step relies on `broadcast_tree` (which compares too) or a first eager call.
        A rank whose layout changes after its first step is not compared again: its all-reduce
        then meets the others' with other sizes (a hang or a gloo/NCCL error); call
        `check_replicas` after changing a model.
        A rank that dies or stalls makes the others fail after the process group's timeout
        (`init_process_group(timeout=...)`).

    Args:
        loss_fn: As `fmp.train_step`.
        state: The training state, the same on every rank.
        *args: This rank's batch (further arguments of `loss_fn`).
        policy: The precision policy; `policy.effective_reduce_dtype` is the reduce dtype.
        optimizer: A pure optimizer.
        has_aux: Whether `loss_fn` returns `(loss, aux)`.
        donate: As `fmp.train_step`.
        group: The data-parallel process group; None for the default group.
        bucket_cap_mb: The most MiB one all-reduce carries (see `all_reduce_gradients`).
        collectives: "functional" (compilable) or "eager" (see `all_reduce_gradients`).
        grad_norm: As `fmp.train_step`: the norm of the averaged gradients, the same on every rank.
        check_update: As `fmp.train_step`: every rank's update is the same, so is its verdict.

    Returns:
        `(new_state, info)`, as `fmp.train_step`.

    Raises:
        RuntimeError: If no process group is initialized.
        ValueError: On every rank, if the ranks' state layouts, policies or bucket sizes differ.
        CollectiveError: Eager, if the all-reduce fails; and as `fmp.train_step` and `all_reduce_gradients`.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an fmp.TrainState (TrainState.create(...)), got {type(state).__name__}")
    check_scalers(state.scaler)  # before the wire scale reads it
    check_step_layout(state, group, policy, bucket_cap_mb)  # once per layout: a C++ abort or a silent mix else
    reduce = functools.partial(
        all_reduce_gradients,
        policy=policy,
        group=group,
        loss_scale=_wire_scale(state.scaler),
        bucket_cap_mb=bucket_cap_mb,
        collectives=collectives,
    )
    return local_train_step(
        loss_fn,
        state,
        *args,
        policy=policy,
        optimizer=optimizer,
        has_aux=has_aux,
        donate=donate,
        reduce_grads=reduce,
        grad_norm=grad_norm,
        check_update=check_update,
    )


def _check_local(grads: Any) -> None:
    check_gradient_leaves(grads, "scaled_grads")
    # A DTensor's own ops would run collectives behind our back (aminmax of a shard is Partial).
    for path, leaf in pytree.tree_flatten_with_path(grads)[0]:
        if type(leaf).__name__ == "DTensor":
            raise TypeError(
                f"grads{pytree.keystr(path)} is a DTensor; pass the local shards, e.g. "
                f"{{n: p.grad.to_local() for n, p in model.named_parameters()}}"
            )


def unscale_and_adjust(
    scaler: ScaleT,
    scaled_grads: Tree,
    *,
    group: dist.ProcessGroup | None = None,
    collectives: Collectives = "functional",
) -> Unscaled[Tree, ScaleT]:
    """`fmp.unscale_and_adjust` for gradients sharded across ranks (FSDP2): the finite flag is agreed.

    Each rank unscales and checks its own shards; the flags are ANDed over `group`
    (`agree_finite`), so an overflow in any rank's shard skips the step and backs the scale off
    on every rank, as torch's ShardedGradScaler does, without its `.item()`.

    Note:
        No host sync; one all-reduce of one byte.

    Args:
        scaler: The loss-scale state the gradients were computed with, the same on every rank.
        scaled_grads: This rank's gradients of the scaled loss: plain tensors (`p.grad.to_local()`).
        group: The process group the gradients are sharded over; None for the default group.
        collectives: As `all_reduce_gradients`: "functional" (traceable) or "eager".

    Returns:
        An `fmp.Unscaled`: this rank's unscaled gradients, the flag of all ranks' gradients, no
        norm (None), and the adjusted scaler (identical on every rank).

    Raises:
        TypeError: If `scaler` is not an fmp loss-scale state or a gradient is a DTensor.
        RuntimeError, ValueError: As `agree_finite`.
    """
    check_scaler(scaler)
    _check_local(scaled_grads)
    grads, _ = unscale(scaler, scaled_grads, donate=False)
    local = all_finite(grads)
    # A rank with empty shards still votes, from the device its collectives run on.
    device = tree_device(scaled_grads) or tree_device(scaler)
    grads_finite = agree_finite(local if device is None else local.to(device), group=group, collectives=collectives)
    return Unscaled(grads, grads_finite, None, cast(ScaleT, scaler.adjust(grads_finite)))
