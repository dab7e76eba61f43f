"""A dynamic loss scale's update, as pure tensor ops and by GradScaler's own kernel; both bit for bit GradScaler's.

`DynamicLossScale.adjust` takes the kernel eager (one call where the pure form makes a dozen small
ops, each a dispatch) and the pure ops compiled and under `torch.func` transforms, which have no
rule for the kernel's in-place writes. The bounds, the range check and hysteresis stay in `adjust`.
"""

from __future__ import annotations

import torch

__all__ = ["grad_scaler_update", "runs_grad_scaler_kernel", "scale_update"]


def scale_update(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    grads_finite: torch.Tensor,
    back_off: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and growth tracker after a step, by pure ops; `back_off` says whether an overflow backs off."""
    tracker = growth_tracker + 1
    grow = grads_finite & (tracker >= growth_interval)
    # torch's kernel multiplies the float scale by a double factor and rounds once to float; a
    # float64 product of the two is that same double, so this is bit-identical to GradScaler.
    scale64 = scale.double()
    grown = (scale64 * growth_factor).float()
    # GradScaler keeps the old scale when growing would overflow float32.
    grown = torch.where(torch.isfinite(grown), grown, scale)
    backed_off = (scale64 * backoff_factor).float()
    new_scale = torch.where(grow, grown, torch.where(back_off, backed_off, scale))
    return new_scale, torch.where(grads_finite & ~grow, tracker, torch.zeros_like(tracker))


def grad_scaler_update(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    overflowed: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scale_update` without hysteresis (every overflow backs off), by GradScaler's kernel on copies.

    `overflowed` is the negated finite flag (the caller needs it too). The kernel grows when the
    tracker reaches `growth_interval` exactly, where `scale_update` grows from there on; a tracker
    clamped below the interval makes the two agree for any state.
    """
    new_scale = scale.clone()
    tracker = growth_tracker.clamp(max=growth_interval - 1)
    found_inf = overflowed.float()
    torch._amp_update_scale_(new_scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    return new_scale, tracker


def runs_grad_scaler_kernel(scale: torch.Tensor, tracker: torch.Tensor, grads_finite: torch.Tensor) -> bool:
    """Whether GradScaler's in-place update kernel may run on copies of these: eager plain tensors of its dtypes."""
    if torch.compiler.is_compiling() or torch._C._functorch.get_interpreter_stack():
        return False
    if not (type(scale) is torch.Tensor and type(tracker) is torch.Tensor and scale.dtype == torch.float32):
        return False
    if tracker.dtype != torch.int32 or scale.requires_grad or grads_finite.requires_grad:
        return False
    # `is_cpu` first: a property read, where `.device` builds a device object per tensor.
    if scale.is_cpu and tracker.is_cpu and grads_finite.is_cpu:
        return True
    return scale.device == tracker.device == grads_finite.device and scale.device.type == "cuda"
