"""Averaging gradients across data-parallel ranks: flat buckets in the reduce dtype, agreed finite flags.

Each bucket is one all-reduce (SUM) of a flat buffer; the finite flags ride in the first bucket as
extra elements, 0 for finite and inf for an overflow, whose sum is inf exactly when some rank
overflowed, for any number of ranks. So a step issues one collective per bucket and none for the
flags, and every rank reads the same sums, hence takes the same skip decision and scale update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Literal
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fmp._checks import check_real
from fmp._grad import Gradients
from fmp._policy import Policy
from fmp._tree import all_finite
from fmp._tree import check_finite_flag
from fmp._tree import is_inexact_tensor

if not dist.is_available():  # pragma: no cover - torch builds without distributed support
    raise ImportError("fmp.distributed needs a torch build with torch.distributed (torch.distributed.is_available())")

import torch.distributed._functional_collectives as funcol

__all__ = ["CollectiveError", "Collectives", "agree_finite", "all_reduce_gradients", "resolve_group"]

Collectives = Literal["functional", "eager"]
"""How collectives are issued: "functional" (traceable by torch.compile) or "eager" (`dist.all_reduce`)."""

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective of `fmp.distributed` failed: a rank died, or did not arrive within the group's timeout."""


def resolve_group(group: Any, caller: str) -> tuple[dist.ProcessGroup, int]:
    """The process group (the default group for None) and its size, validated.

    Args:
        group: A `torch.distributed.ProcessGroup`, or None for the default group.
        caller: The public function's name, for error messages.

    Returns:
        `(group, world_size)`.

    Raises:
        RuntimeError: If no process group is initialized.
        TypeError: If `group` is not a ProcessGroup.
        ValueError: If this process is not a member of `group`.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialized process group: call torch.distributed.init_process_group(backend, "
            f"timeout=...) on every rank first ('gloo' for CPU tensors, 'nccl' for CUDA), e.g. under torchrun"
        )
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out
        raise ValueError(
            f"{caller}: this process (global rank {dist.get_rank()}) is not a member of the group; "
            f"torch.distributed.new_group returned its non-member marker here, so call it only on the group's members"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{caller}: group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"{caller}: this process (global rank {dist.get_rank()}) is not a member of the group of ranks "
            f"{dist.get_process_group_ranks(group)}; call it only on the group's members"
        )
    return group, dist.get_world_size(group)


def _collective(run: Callable[[], T], what: str, world: int) -> T:
    """Runs `run`; eager, a failure becomes a `CollectiveError` that says what to look for."""
    if torch.compiler.is_compiling():
        return run()  # compiled, the error surfaces from the graph's wait as torch raises it
    try:
        return run()
    except RuntimeError as error:  # DistBackendError and DistNetworkError are RuntimeErrors
        raise CollectiveError(
            f"the {what} across {world} ranks failed on global rank {dist.get_rank()}: {error}. A rank died, or did "
            f"not reach this collective within the process group's timeout (init_process_group(timeout=...)); every "
            f"rank must run the same steps with parameters of the same shapes"
        ) from error


def _all_reduce(buckets: list[torch.Tensor], op: str, group: dist.ProcessGroup, collectives: str) -> list[torch.Tensor]:
    """All-reduces each bucket; all are issued before the first wait, so transfers can overlap."""
    if collectives == "eager":
        if torch.compiler.is_compiling():
            raise RuntimeError("collectives='eager' cannot be traced; use collectives='functional' under torch.compile")
        reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op]
        works = [dist.all_reduce(bucket, op=reduce_op, group=group, async_op=True) for bucket in buckets]
        for work in works:
            work.wait()
        return buckets
    handles = [funcol.all_reduce(bucket, op, group) for bucket in buckets]
    return [torch.ops._c10d_functional.wait_tensor(handle) for handle in handles]


@dataclasses.dataclass
class _Bucket:
    """Gradients that travel in one flat buffer: their indices among the leaves, and how they travel."""

    indices: list[int]
    wire_dtype: torch.dtype  # the buffer's dtype (complex gradients travel as their real view)
    scaled: bool  # carried multiplied by the loss scale: the wire dtype flushes small gradients to zero
    nbytes: int


def _plan(leaves: list[torch.Tensor], reduce_dtype: torch.dtype, cap_bytes: int, has_scale: bool) -> list[_Bucket]:
    """Groups the leaves by dtype, in order, into buckets of at most `cap_bytes` (a larger leaf goes alone)."""
    buckets: list[_Bucket] = []
    filling: dict[torch.dtype, _Bucket] = {}
    for index, leaf in enumerate(leaves):
        real_dtype = _real_view(leaf).dtype
        # Complex gradients keep their precision: no complex dtype matches bfloat16.
        wire = real_dtype if leaf.is_complex() else reduce_dtype
        nbytes = _real_view(leaf).numel() * wire.itemsize
        bucket = filling.get(leaf.dtype)
        if bucket is not None and bucket.nbytes + nbytes <= cap_bytes:
            bucket.indices.append(index)
            bucket.nbytes += nbytes
            continue
        # Small gradients flush to zero on a wire with a larger smallest normal (float16, not bfloat16).
        scaled = has_scale and torch.finfo(wire).tiny > torch.finfo(real_dtype).tiny
        filling[leaf.dtype] = _Bucket([index], wire, scaled, nbytes)
        buckets.append(filling[leaf.dtype])
    return buckets


def _real_view(leaf: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(leaf) if leaf.is_complex() else leaf


def all_reduce_gradients(
    gradients: Gradients,
    *,
    policy: Policy,
    group: dist.ProcessGroup | None = None,
    loss_scale: torch.Tensor | None = None,
    bucket_cap_mb: float = 25.0,
    collectives: Collectives = "functional",
) -> Gradients:
    """Averages gradients across the ranks of `group` in the policy's reduce dtype; all ranks agree on the flags.

    The hook `fmp.train_step(..., reduce_grads=...)` takes (`fmp.distributed.train_step` passes it
    for you). Gradients are packed into flat buckets of at most `bucket_cap_mb` per dtype (DDP's
    default size), cast to `policy.effective_reduce_dtype`, summed with one all-reduce per bucket,
    divided by the group size and cast back. The finite flags travel in the first bucket, so no
    collective of their own. Afterwards `grads_finite` is True on every rank exactly when every
    rank's gradients were finite and so is their average (a sum can overflow a 16-bit reduce dtype);
    each per-loss flag is True when that loss was finite on every rank and the average did not
    overflow. Complex gradients are reduced in their own precision. The loss and aux stay local.
    FP8 amaxes (`gradients.amaxes`, with delayed-scaling states) come back as their maximum over
    the ranks: they travel with the flags, in a float32 buffer of their own, each rank's in a row
    of its own, so the one all-reduce serves both.

    With `loss_scale` and a reduce dtype of less range than the gradients (float16 for float32
    gradients), the gradients are multiplied by it on the wire and divided after, so the sum sees
    the scaled values a torch.amp + DDP step reduces, and a reduce overflow backs the scale off.

    Note:
        No host sync: the sums and flags stay on the device. Every rank of `group` must call it
        with gradients of the same structure, shapes and dtypes, or the collective fails or hangs
        until the group's timeout.

    Args:
        gradients: This rank's `Gradients` (unscaled, in the param dtype).
        policy: The precision policy; its `effective_reduce_dtype` is the dtype on the wire.
        group: The data-parallel process group; None for the default group.
        loss_scale: The scale to carry 16-bit float buffers in (a 0-dim tensor), or None.
        bucket_cap_mb: The most MiB one bucket holds (a larger gradient travels alone).
        collectives: "functional" (`torch.distributed._functional_collectives`, which torch.compile
            traces, so a step compiles with `fullgraph=True`), or "eager" (`dist.all_reduce`, for a
            backend without functional collectives; not compilable). The sums are the same.

    Returns:
        `Gradients` of the same structure, identical on every rank of `group`.

    Raises:
        RuntimeError: If no process group is initialized.
        TypeError, ValueError: If an argument has the wrong type, a flag is not a 0-dim bool tensor, a
            gradient is not a floating or complex tensor, or this process is not in `group`.
        CollectiveError: Eager, if a collective fails (a rank died or timed out); compiled, torch's
            own error surfaces instead.
    """
    if not isinstance(gradients, Gradients):
        raise TypeError(f"all_reduce_gradients takes fmp.Gradients, got {type(gradients).__name__}")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy, got {type(policy).__name__}")
    _check_collectives(collectives)
    cap_bytes = int(check_real("bucket_cap_mb", bucket_cap_mb, 0.0, float("inf"), low_inclusive=False) * 2**20)
    group, world = resolve_group(group, "fmp.distributed.all_reduce_gradients")
    if loss_scale is not None and not (
        isinstance(loss_scale, torch.Tensor) and loss_scale.dim() == 0 and loss_scale.is_floating_point()
    ):
        got = (
            f"shape {tuple(loss_scale.shape)} {loss_scale.dtype}"
            if isinstance(loss_scale, torch.Tensor)
            else type(loss_scale).__name__
        )
        raise TypeError(f"loss_scale must be a 0-dim floating tensor such as scaler.loss_scale, or None; got {got}")
    grads, grads_finite, loss, aux, finite_per_loss, amaxes = gradients
    check_finite_flag(grads_finite, "gradients.grads_finite")
    flags, flags_spec = pytree.tree_flatten(finite_per_loss)
    for index, flag in enumerate(flags):
        check_finite_flag(flag, "gradients.finite_per_loss" + (f"[{index}]" if len(flags) > 1 else ""))
    paths_and_leaves, grads_spec = pytree.tree_flatten_with_path(grads)
    for path, leaf in paths_and_leaves:
        if not is_inexact_tensor(leaf):
            kind = leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise TypeError(f"grads{pytree.keystr(path)} is {kind}; gradients must be floating or complex tensors")
    leaves = [leaf for _, leaf in paths_and_leaves]
    plan = _plan(leaves, policy.effective_reduce_dtype, cap_bytes, loss_scale is not None)

    buffers = []
    for bucket in plan:
        flat = torch.cat([_real_view(leaves[i]).reshape(-1) for i in bucket.indices])
        # Dividing first keeps the sum of `world` terms in range (DDP's gradient pre-divide); `flat`
        # is a fresh copy, so it can be scaled in place.
        if bucket.scaled and loss_scale is not None:
            flat.mul_(loss_scale / world)
        elif world > 1:
            flat.mul_(1.0 / world)
        buffers.append(flat.to(bucket.wire_dtype))
    # Flags as 0 (finite) or inf (overflow): a sum over ranks is inf exactly when some rank overflowed.
    stacked = torch.stack([grads_finite, *(flag.to(grads_finite.device) for flag in flags)])
    slots = torch.where(stacked, 0.0, float("inf"))
    amax_leaves, amax_spec = pytree.tree_flatten(amaxes)
    if amax_leaves:
        # FP8 amaxes travel with the flags, in float32, each rank's in a row of its own: the sum's
        # rows are the ranks' amaxes exactly, whose maximum every rank takes.
        buffers.append(_amax_rows(amax_leaves, group, world, slots))
    elif buffers:
        buffers[0] = torch.cat([buffers[0], slots.to(buffers[0].device, buffers[0].dtype)])
    else:
        buffers.append(slots)
    reduced = _collective(lambda: _all_reduce(buffers, "sum", group, collectives), "gradient all-reduce", world)
    if amax_leaves:
        meta = reduced.pop()
        agreed = torch.isfinite(meta[: len(slots)])
        rows = meta[len(slots) :].view(world, -1).amax(dim=0)
        parts = torch.split(rows, [a.numel() for a in amax_leaves])
        new_amaxes = pytree.tree_unflatten(
            [p.view(a.shape) for p, a in zip(parts, amax_leaves, strict=True)], amax_spec
        )
    else:
        agreed = torch.isfinite(reduced[0][-len(slots) :])
        reduced[0] = reduced[0][: -len(slots)]
        new_amaxes = amaxes

    new_leaves: list[torch.Tensor] = list(leaves)
    # Without gradients `reduced` holds the flags' buffer alone, and zip stops at the empty plan.
    for bucket, flat in zip(plan, reduced, strict=False):
        sizes = [_real_view(leaves[i]).numel() for i in bucket.indices]
        for i, part in zip(bucket.indices, torch.split(flat, sizes), strict=True):
            value = part.to(_real_view(leaves[i]).dtype)
            if bucket.scaled and loss_scale is not None:
                value = value / loss_scale
            value = value.view(_real_view(leaves[i]).shape)
            new_leaves[i] = torch.view_as_complex(value) if leaves[i].is_complex() else value
    new_grads = pytree.tree_unflatten(new_leaves, grads_spec)
    every_rank_finite = agreed[0]
    average_finite = all_finite(new_grads).to(agreed.device)
    # An overflow of the average itself (finite parts, a 16-bit sum) backs off every loss's scale.
    reduce_overflowed = every_rank_finite & ~average_finite
    new_flags = [agreed[1 + index] & ~reduce_overflowed for index in range(len(flags))]
    new_finite_per_loss = pytree.tree_unflatten(new_flags, flags_spec)
    return Gradients(new_grads, every_rank_finite & average_finite, loss, aux, new_finite_per_loss, new_amaxes)


def _amax_rows(amaxes: list[torch.Tensor], group: dist.ProcessGroup, world: int, flags: torch.Tensor) -> torch.Tensor:
    """The flags, then a (world, n) block of zeros holding this rank's `n` amaxes in its row, flat, float32."""
    mine = torch.cat([a.reshape(-1).float() for a in amaxes]).to(flags.device)
    rows = torch.arange(world, device=flags.device)[:, None] == dist.get_rank(group)
    return torch.cat([flags.float(), torch.where(rows, mine, 0.0).reshape(-1)])


def _check_collectives(collectives: Any) -> None:
    if collectives not in ("functional", "eager"):
        raise ValueError(f"collectives must be 'functional' or 'eager', got {collectives!r}")


def agree_finite(flags: T, *, group: dist.ProcessGroup | None = None, collectives: Collectives = "functional") -> T:
    """ANDs finite flags across the ranks of `group`: one tiny all-reduce (MIN), no host sync.

    For gradients that no rank holds whole (FSDP2's shards), each rank checks its own part and
    the step must go by the flag of the whole (as torch's ShardedGradScaler does, with a sync).

    Args:
        flags: A 0-dim bool tensor, or a tuple of them (one per loss).
        group: The process group; None for the default group.
        collectives: As `all_reduce_gradients`: "functional" (traceable) or "eager".

    Returns:
        Flags of the same structure, True where the flag was True on every rank.

    Raises:
        RuntimeError, TypeError, ValueError: As `all_reduce_gradients`, or if a flag is not a 0-dim bool.
        CollectiveError: Eager, if the all-reduce fails.
    """
    _check_collectives(collectives)
    group, world = resolve_group(group, "fmp.distributed.agree_finite")
    leaves, spec = pytree.tree_flatten(flags)
    if not leaves:
        raise ValueError("agree_finite needs at least one flag")
    for index, flag in enumerate(leaves):
        check_finite_flag(flag, f"flags[{index}]" if len(leaves) > 1 else "flags")
    # uint8: NCCL has no bool reductions.
    stacked = torch.stack([flag.to(leaves[0].device) for flag in leaves]).to(torch.uint8)
    (agreed,) = _collective(lambda: _all_reduce([stacked], "min", group, collectives), "finite-flag all-reduce", world)
    return pytree.tree_unflatten(list(agreed.bool().unbind()), spec)  # type: ignore[no-any-return]
