"""FP8 formats and the saturating casts every recipe shares.

A recipe scales a tensor into an FP8 format's range, casts it, and keeps the scale to undo it
later: `quantize(x, scale, dtype)` is `x * scale` cast with saturation, `dequantize(q, scale)` is
`q * (1 / scale)`. Scales here always multiply into the FP8 range (Transformer Engine's `scale`, the
reciprocal of its `scale_inv` and of torchao's dequantization scale).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "Format",
    "Role",
    "amax",
    "check_format",
    "dequantize",
    "format_dtype",
    "max_finite",
    "quantize",
]

E4M3 = torch.float8_e4m3fn
"""4 exponent bits, 3 mantissa bits, no infinity: largest finite 448, for activations and weights."""

E5M2 = torch.float8_e5m2
"""5 exponent bits, 2 mantissa bits: largest finite 57344, the wider range gradients need."""

Format = Literal["e4m3", "e5m2", "hybrid"]
"""A recipe's FP8 format: one for every tensor, or "hybrid" (E4M3 forward, E5M2 for gradients)."""

Role = Literal["input", "weight", "grad_output"]
"""What a quantized tensor is to a matmul: its two forward operands or the gradient flowing back."""

_FORMATS = ("e4m3", "e5m2", "hybrid")


def check_format(name: str, format: str) -> str:
    """Returns `format` if it is one of "e4m3", "e5m2", "hybrid"; else raises naming `name`."""
    if format not in _FORMATS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, _FORMATS))}, got {format!r}")
    return format


def format_dtype(format: str, role: str) -> torch.dtype:
    """The FP8 dtype a tensor of this role takes under `format` ("hybrid": E5M2 for gradients only)."""
    if format == "hybrid":
        return E5M2 if role == "grad_output" else E4M3
    return E5M2 if format == "e5m2" else E4M3


def max_finite(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(dtype).max)


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of `x`, in float32 (0-dim); NaN if any element is NaN, 0 if it has none."""
    if x.numel() == 0:  # an empty batch: torch's amax refuses a reduction over no elements
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().float().amax()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x * scale` in float32, clamped to the format's finite range, cast to `dtype`.

    Saturating as Transformer Engine and torchao cast: a value beyond the range becomes the largest
    finite one, never infinity (E5M2 has one) or NaN (E4M3's only non-finite code); NaN stays NaN.

    Args:
        x: The tensor to quantize.
        scale: float32, broadcastable to `x`: what brings `x` into range (for example
            `max_finite(dtype) / amax(x)`).
        dtype: `E4M3` or `E5M2`.

    Returns:
        `x` in `dtype`, of `x`'s shape.
    """
    limit = max_finite(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q` times `scale`'s reciprocal in float32, cast to `dtype`: `quantize` undone up to FP8 rounding."""
    return (q.float() * scale.reciprocal()).to(dtype)
