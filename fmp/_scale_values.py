"""Loss-scale values: a scale given as a number or tensor, checked on the CPU as the float32 it becomes."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "checked_device", "checked_scale", "float32_inward", "scale_tensor"]

FLOAT32_TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max


def checked_scale(value: Any, name: str) -> tuple[float, torch.device | None]:
    """Validates a scale given as a number or 0-dim tensor; returns its float32 value and the tensor's device.

    The check is on the float32 value: it must be a normal number, so that it and 1/scale are finite.
    It runs on the CPU, so that a state can then be built on any device, `meta` included.
    """
    device = None
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise ValueError(
                f"{name} is a {value.dtype} tensor; a loss scale is a real number: give its real part "
                f"(e.g. {name}.real) or a float"
            )
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name} must be a 0-dim floating tensor, got {value.dtype}{list(value.shape)}")
        if value.requires_grad:
            raise ValueError(
                f"{name} requires grad; a loss scale is state, not a parameter: pass {name}.detach() or a float"
            )
        if value.is_meta:
            raise ValueError(f"{name} is a meta tensor, which holds no value: give a number (and device='meta')")
        # Validation at construction syncs once with the host; steps never do.
        value, device = value.item(), value.device
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        number = float(torch.tensor(float(value), dtype=torch.float32))
    except OverflowError:  # an int too large for any float
        number = math.inf
    if not FLOAT32_TINY <= number <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be a positive, normal float32 in [{FLOAT32_TINY}, {FLOAT32_MAX}], got {value} "
            f"(a scale of 0, inf, NaN or a subnormal loses every gradient)"
        )
    return number, device


def checked_device(device: Any) -> torch.device | None:
    """`device` as a torch.device that can hold tensors here (None stays None), or an error naming it."""
    if device is None:
        return None
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be a str or torch.device (e.g. 'cuda'), got {type(device).__name__}")
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)  # torch says why not (no such device, a build without CUDA)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"device {str(device)!r} cannot hold tensors here: {error}") from None
    return parsed


def scale_tensor(value: Any, name: str, device: torch.device | str | None) -> torch.Tensor:
    """A validated scale as a float32 tensor on `device` (by default a tensor's own device, else CPU)."""
    number, own_device = checked_scale(value, name)
    device = checked_device(device)
    return torch.tensor(number, dtype=torch.float32, device=own_device if device is None else device)


def float32_inward(bound: float, *, up: bool) -> float:
    """Rounds a bound to a float32 inside it, so that clamping the float32 scale honours it exactly."""
    rounded = torch.tensor(bound, dtype=torch.float32)
    if (up and float(rounded) < bound) or (not up and float(rounded) > bound):
        rounded = torch.nextafter(rounded, torch.tensor(math.inf if up else -math.inf))
    return float(rounded)
