"""Block-scaled quantization of a matrix: one scale per block of elements, the shape every recipe shares.

A per-tensor scale is one block the size of the matrix, a rowwise scale a block of one row, MXFP8
blocks of 32 elements along the contracted dim, DeepSeek-V3's 1x128 and 128x128 tiles. So one
quantizer serves them all: `quantize_blocks(x, block, dtype, scale_of)` takes each block's amax,
turns it into that block's scale with the recipe's `scale_of`, and casts with saturation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fmp._fp8_formats import max_finite
from fmp._fp8_formats import quantize

__all__ = ["Quantized", "check_blocks", "max_over_amax", "power_of_2_below", "quantize_blocks"]

ScaleOf = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


class Quantized(NamedTuple):
    """A matrix in FP8 with one float32 scale per block; `dequantize()` gives it back in float32.

    Dequantizing multiplies by each scale's reciprocal, as `torch._scaled_mm` does with the
    reciprocals it is given, so the emulated and the native matmul agree bit for bit.

    Attributes:
        data: The FP8 values, of the matrix's shape (rows, cols).
        scale: float32 of shape (rows // block_rows, cols // block_cols): what each block was
            multiplied by before the cast.
    """

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The matrix in float32: each block's FP8 values times its scale's reciprocal."""
        rows, cols = self.data.shape
        blocks_r, blocks_c = self.scale.shape
        blocked = self.data.float().reshape(blocks_r, rows // blocks_r, blocks_c, cols // blocks_c)
        return (blocked * self.scale.reciprocal()[:, None, :, None]).reshape(rows, cols)


def check_blocks(shape: torch.Size | tuple[int, ...], block: tuple[int, int], what: str) -> None:
    """Raises unless `block` tiles a matrix of `shape` exactly, naming `what` and both shapes."""
    if len(shape) != 2 or shape[0] % block[0] or shape[1] % block[1]:
        raise ValueError(
            f"{what} of shape {tuple(shape)} does not divide into blocks of {block[0]}x{block[1]}: "
            f"this recipe needs each dim a multiple of its block (pad the layer's features)"
        )


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, scale_of: ScaleOf) -> Quantized:
    """Quantizes a matrix block by block: each block's scale is `scale_of(its amax, dtype)`.

    Args:
        x: A 2-d tensor whose dims are multiples of `block`'s (see `check_blocks`).
        block: (rows, cols) of one block.
        dtype: The FP8 dtype.
        scale_of: Maps a float32 tensor of block amaxes to their scales (same shape).

    Returns:
        The `Quantized` matrix.
    """
    rows, cols = x.shape
    blocks_r, blocks_c = rows // block[0], cols // block[1]
    blocked = x.detach().float().reshape(blocks_r, block[0], blocks_c, block[1])
    amaxes = blocked.abs().amax(dim=(1, 3))
    scale = scale_of(amaxes, dtype)
    data = quantize(blocked, scale[:, None, :, None], dtype).reshape(rows, cols)
    return Quantized(data, scale)


def max_over_amax(amaxes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`max_finite(dtype) / amax`, an amax of 0 taken as 1e-12 so that a zero block keeps a finite scale."""
    return max_finite(dtype) / amaxes.clamp(min=1e-12)


def power_of_2_below(scales: torch.Tensor) -> torch.Tensor:
    """Each scale rounded down to a power of two (so dequantizing is exact in the exponent)."""
    return torch.exp2(torch.floor(torch.log2(scales)))
