"""Learning-rate schedules: pure functions of the applied-step count, evaluated on device.

A schedule is any callable `lr(count) -> 0-dim floating tensor`. fmp's optimizers call it with
`count`, the 0-dim int32 tensor of optimizer steps applied before the current one, kept in their
state. A mixed-precision step that overflows keeps the optimizer state unchanged, so skipped steps
do not advance the schedule: unlike a `torch.optim.lr_scheduler` stepped next to a GradScaler,
which advances on every call whether or not the optimizer stepped (pytorch issues 67590, 152279).

The schedules here follow the closed forms of `torch.optim.lr_scheduler` and compute in float64,
as torch's Python-float arithmetic does. They use torch ops only (no `.item()`, no branch on a
value), so a compiled step never syncs or recompiles as the count advances. They work elementwise:
`schedule(torch.arange(n))` gives the first `n` values at once, e.g. for plotting.

    optimizer = fmp.optim.adamw(fmp.optim.schedule.warmup_cosine(1e-3, warmup_steps=100, total_steps=10_000))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import torch

from fmp._checks import check_int
from fmp._checks import check_real
from fmp.optim._base import Schedule

__all__ = ["constant", "cosine_annealing", "exponential", "join", "linear", "warmup_cosine"]

# The count is an int32 tensor, so no schedule can usefully span more steps than this.
_MAX_STEPS = 2**31 - 1


def _check_lr(name: str, value: Any) -> float:
    return check_real(name, value, 0.0, math.inf)


def _steps(count: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """`count` as float64, clamped to `limit` (a tensor op: no branch on the value)."""
    if not isinstance(count, torch.Tensor) or count.is_floating_point() or count.is_complex():
        raise TypeError(f"a schedule takes the step count as an integer tensor, got {_describe(count)}")
    if limit is not None:
        count = torch.clamp(count, max=limit)
    return count.to(torch.float64)


def _describe(value: Any) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def constant(lr: float) -> Schedule:
    """A fixed learning rate, as a schedule (e.g. to `join` it with others).

    Args:
        lr: The learning rate, >= 0.

    Returns:
        `schedule(count) -> lr`, a float64 tensor shaped like `count`.

    Raises:
        TypeError, ValueError: If `lr` is not a real number >= 0.
    """
    lr = _check_lr("lr", lr)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return torch.full_like(_steps(count), lr)

    return schedule


def linear(lr: float, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5) -> Schedule:
    """`lr` times a factor going linearly from `start_factor` to `end_factor`, as `LinearLR`.

    `lr * (start_factor + (end_factor - start_factor) * min(count, total_iters) / total_iters)`, the
    closed form of `torch.optim.lr_scheduler.LinearLR` with torch's defaults. torch needs
    `start_factor > 0` (it updates the lr recursively, dividing by it) and both factors <= 1; here
    any factors >= 0 work, so a linear warmup may start at 0.

    Args:
        lr: The base learning rate, >= 0.
        start_factor: The factor at count 0, >= 0.
        end_factor: The factor from count `total_iters` on, >= 0.
        total_iters: Steps the factor takes to reach `end_factor`, >= 1.

    Returns:
        The schedule; its values are float64.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range.
    """
    lr = _check_lr("lr", lr)
    start_factor = check_real("start_factor", start_factor, 0.0, math.inf)
    end_factor = check_real("end_factor", end_factor, 0.0, math.inf)
    total_iters = check_int("total_iters", total_iters, 1, _MAX_STEPS)
    slope = end_factor - start_factor

    def schedule(count: torch.Tensor) -> torch.Tensor:
        # torch's operation order: lr * (start + ((end - start) * t) / total).
        return lr * (start_factor + slope * _steps(count, total_iters) / total_iters)

    return schedule


def exponential(lr: float, gamma: float) -> Schedule:
    """`lr * gamma**count`, as `ExponentialLR` (whose lr torch multiplies by gamma every step).

    Args:
        lr: The base learning rate, >= 0.
        gamma: The factor per applied step, in [0, 1].

    Returns:
        The schedule; its values are float64.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range.
    """
    lr = _check_lr("lr", lr)
    gamma = check_real("gamma", gamma, 0.0, 1.0, high_inclusive=True)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return lr * torch.pow(gamma, _steps(count))

    return schedule


def cosine_annealing(lr: float, t_max: int, eta_min: float = 0.0) -> Schedule:
    """Cosine annealing from `lr` to `eta_min` over `t_max` steps, as `CosineAnnealingLR`.

    `eta_min + (lr - eta_min) * (1 + cos(pi * count / t_max)) / 2`, the closed form of
    `torch.optim.lr_scheduler.CosineAnnealingLR` (torch updates the lr recursively, which agrees
    with it to float64 rounding). From `t_max` on the value stays at `eta_min`, where torch's
    cosine goes on and rises again: runs usually set `t_max` to their length and expect no rise.

    Args:
        lr: The learning rate at count 0, >= 0.
        t_max: Steps to reach `eta_min`, >= 1.
        eta_min: The final learning rate, >= 0.

    Returns:
        The schedule; its values are float64.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range.
    """
    lr = _check_lr("lr", lr)
    t_max = check_int("t_max", t_max, 1, _MAX_STEPS)
    eta_min = _check_lr("eta_min", eta_min)
    amplitude = lr - eta_min

    def schedule(count: torch.Tensor) -> torch.Tensor:
        # torch's operation order: eta_min + ((lr - eta_min) * (1 + cos((pi * t) / t_max))) / 2.
        return eta_min + amplitude * (1 + torch.cos(math.pi * _steps(count, t_max) / t_max)) / 2

    return schedule


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs `schedules[i]` from `boundaries[i - 1]` on, each restarting its count at 0.

    As `torch.optim.lr_scheduler.SequentialLR` with `milestones=boundaries`, and optax's
    `join_schedules`: at count `c` in `[boundaries[i - 1], boundaries[i])` the value is
    `schedules[i](c - boundaries[i - 1])`. Every schedule is evaluated and the right value picked
    with `torch.where`, which costs a few scalar ops and never branches on the count.

    Args:
        schedules: One or more schedules.
        boundaries: Strictly increasing counts >= 1, one fewer than `schedules`.

    Returns:
        The joined schedule.

    Raises:
        TypeError, ValueError: If `schedules` or `boundaries` is not a sequence, a schedule is
            not callable, or the boundaries are not strictly increasing positive ints, one fewer
            than the schedules. When evaluated, a part that returns anything but a floating tensor
            is named.
    """
    for name, argument in (("schedules", schedules), ("boundaries", boundaries)):
        if not isinstance(argument, Iterable) or isinstance(argument, str):
            raise TypeError(f"join: {name} must be a sequence (a list, say), got {type(argument).__name__}")
    schedules = list(schedules)
    boundaries = [check_int(f"boundaries[{i}]", b, 1, _MAX_STEPS) for i, b in enumerate(boundaries)]
    if not schedules:
        raise ValueError("join needs at least one schedule")
    for i, part in enumerate(schedules):
        if not callable(part):
            raise TypeError(f"schedules[{i}] must be a callable schedule, got {type(part).__name__}")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"join needs one boundary fewer than schedules, got {len(boundaries)} for {len(schedules)}")
    if any(a >= b for a, b in itertools.pairwise(boundaries)):
        raise ValueError(f"boundaries must be strictly increasing, got {boundaries}")

    def value(i: int, count: torch.Tensor) -> torch.Tensor:
        out = schedules[i](count)
        # Parts run on counts shaped like `count` (a vector, when plotting): the optimizer checks
        # the joined value's shape, this names the part that returns no floating tensor.
        if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
            raise TypeError(f"schedules[{i}] must return a floating tensor, got {_describe(out)}")
        return out

    def schedule(count: torch.Tensor) -> torch.Tensor:
        _steps(count)  # checks the count's type
        lr = value(0, count)
        for i, boundary in enumerate(boundaries, start=1):
            # Clamped at 0 so that parts not yet reached never see a negative count.
            later = value(i, torch.clamp(count - boundary, min=0))
            lr = torch.where(count >= boundary, later, lr)
        return lr

    return schedule


def warmup_cosine(
    lr: float, warmup_steps: int, total_steps: int, *, start_factor: float = 0.0, eta_min: float = 0.0
) -> Schedule:
    """A linear warmup to `lr`, then cosine annealing to `eta_min` at `total_steps`.

    `join([linear(lr, start_factor, 1.0, warmup_steps), cosine_annealing(lr, total_steps -
    warmup_steps, eta_min)], [warmup_steps])`: the values of torch's `SequentialLR` over `LinearLR`
    and `CosineAnnealingLR` with `milestones=[warmup_steps]` (torch needs `start_factor > 0`). The
    peak `lr` is reached at count `warmup_steps`, and `eta_min` at `total_steps`, where it stays.

    Args:
        lr: The peak learning rate, >= 0.
        warmup_steps: Steps of linear warmup, >= 0 (0: cosine annealing alone).
        total_steps: Steps of warmup and annealing together, > `warmup_steps`.
        start_factor: The fraction of `lr` the warmup starts from, in [0, 1].
        eta_min: The final learning rate, >= 0.

    Returns:
        The schedule; its values are float64.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range.
    """
    lr = _check_lr("lr", lr)
    warmup_steps = check_int("warmup_steps", warmup_steps, 0, _MAX_STEPS - 1)
    total_steps = check_int("total_steps", total_steps, warmup_steps + 1, _MAX_STEPS)
    start_factor = check_real("start_factor", start_factor, 0.0, 1.0, high_inclusive=True)
    decay = cosine_annealing(lr, total_steps - warmup_steps, eta_min)
    if warmup_steps == 0:
        return decay
    return join([linear(lr, start_factor, 1.0, warmup_steps), decay], [warmup_steps])
