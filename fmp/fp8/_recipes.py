"""The FP8 recipes whose scales come from the tensor being cast: tensorwise, rowwise, MXFP8, blockwise.

Each recipe says, for a matmul operand of a given role contracted along a given dim, which blocks
share a scale, in which FP8 dtype, and how a block's amax becomes its scale. A recipe is
configuration only (frozen, hashable, so `torch.compile` takes it as a constant); it holds no
tensors. Delayed scaling, whose scales come from a state, is in `fmp/_delayed_scaling.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from fmp._checks import check_bool
from fmp._checks import check_int
from fmp._fp8_formats import check_format
from fmp._fp8_formats import format_dtype
from fmp.fp8._blocks import Quantized
from fmp.fp8._blocks import ScaleOf
from fmp.fp8._blocks import check_blocks
from fmp.fp8._blocks import max_over_amax
from fmp.fp8._blocks import power_of_2_below
from fmp.fp8._blocks import quantize_blocks

__all__ = ["Fp8Recipe", "blockwise", "mxfp8", "rowwise", "tensorwise"]

_MX_BLOCK = 32  # the OCP Microscaling spec's block for MXFP8
_F32_EXPONENT_BIAS = 127
_E8M0_MIN_EXPONENT, _E8M0_MAX_EXPONENT = -127, 127


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 matmul quantizes its operands; made by `tensorwise`, `rowwise`, `mxfp8` or `blockwise`.

    Attributes:
        name: The recipe's name ("tensorwise", "rowwise", "mxfp8", "blockwise").
        format: "e4m3", "e5m2" or "hybrid" (E4M3 forward, E5M2 for gradients).
        power_of_2: Whether scales are rounded down to powers of two.
        block: The block length along the contracted dim (0: the whole dim).
        weight_block: For blockwise: the square tile of the weight (0: as other operands).
        high_precision_weight_grad: Whether the weight gradient's matmul runs in the compute
            dtype instead of FP8 (torchao's rowwise_with_gw_hp).
    """

    name: str
    format: str
    power_of_2: bool
    block: int = 0
    weight_block: int = 0
    high_precision_weight_grad: bool = False

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype of an operand of this role ("input", "weight" or "grad_output")."""
        return format_dtype(self.format, role)

    def block_shape(self, role: str, shape: torch.Size, contract_dim: int) -> tuple[int, int]:
        """The (rows, cols) of the blocks that share one scale, for a matrix contracted along `contract_dim`."""
        if self.name == "tensorwise":
            return (shape[0], shape[1])
        if self.weight_block and role == "weight":
            return (self.weight_block, self.weight_block)
        along = self.block or shape[contract_dim]
        return (along, 1) if contract_dim == 0 else (1, along)

    def scale_of(self) -> ScaleOf:
        """The map from block amaxes to scales: max / amax, or MX's power of two from the amax's exponent."""
        if self.name == "mxfp8":
            return _mx_scale
        if self.power_of_2:
            return lambda amaxes, dtype: power_of_2_below(max_over_amax(amaxes, dtype))
        return max_over_amax

    def quantize(self, x: torch.Tensor, role: str, contract_dim: int) -> Quantized:
        """Quantizes a matmul operand (2-d) of `role` contracted along `contract_dim` (0 or 1).

        Raises:
            ValueError: If the operand's dims are not multiples of the recipe's blocks.
        """
        block = self.block_shape(role, x.shape, contract_dim)
        check_blocks(x.shape, block, f"the {role} ({self.name} FP8)")
        return quantize_blocks(x, block, self.dtype(role), self.scale_of())


def _mx_scale(amaxes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The OCP MX spec's shared scale: 2^-(floor(log2(amax)) - emax) as the multiplier, E8M0's range.

    The exponent is read from the float32 bits, so it is exact at powers of two; an amax of 0 (or
    a subnormal one) takes E8M0's smallest exponent, a non-finite amax gives a NaN scale (E8M0's
    NaN), so the block comes out NaN.
    """
    emax = int(torch.finfo(dtype).max).bit_length() - 1  # 8 for E4M3 (448 = 1.75 * 2^8), 15 for E5M2
    exponent = ((amaxes.view(torch.int32) >> 23) & 0xFF) - _F32_EXPONENT_BIAS
    shared = (exponent - emax).clamp(_E8M0_MIN_EXPONENT, _E8M0_MAX_EXPONENT)
    scale = torch.exp2(-shared.float())
    return torch.where(torch.isfinite(amaxes), scale, float("nan"))


def tensorwise(format: str = "hybrid", *, power_of_2: bool = False) -> Fp8Recipe:
    """Current (dynamic) per-tensor scaling, torchao's default: scale = max / amax of the tensor now.

    Args:
        format: "hybrid" (E4M3 forward, E5M2 gradients, Transformer Engine's default), "e4m3" or "e5m2".
        power_of_2: Round scales down to powers of two.

    Returns:
        The recipe.

    Raises:
        ValueError: If `format` is not one of the three.
    """
    return Fp8Recipe("tensorwise", check_format("format", format), check_bool("power_of_2", power_of_2))


def rowwise(*, power_of_2: bool = True, high_precision_weight_grad: bool = False) -> Fp8Recipe:
    """Current scaling per row of each operand along its contracted dim, E4M3 throughout (torchao's rowwise).

    Args:
        power_of_2: Round scales down to powers of two (torchao's rowwise recipes do).
        high_precision_weight_grad: Compute the weight gradient in the compute dtype instead of
            FP8 (torchao's rowwise_with_gw_hp), which keeps its accuracy at the cost of speed.

    Returns:
        The recipe.
    """
    hp = check_bool("high_precision_weight_grad", high_precision_weight_grad)
    return Fp8Recipe("rowwise", "e4m3", check_bool("power_of_2", power_of_2), high_precision_weight_grad=hp)


def mxfp8() -> Fp8Recipe:
    """MXFP8 (OCP Microscaling): E4M3, one power-of-two (E8M0) scale per 32 elements along the contracted dim.

    Every dim an operand is contracted along must be a multiple of 32.
    """
    return Fp8Recipe("mxfp8", "e4m3", power_of_2=True, block=_MX_BLOCK)


def blockwise(block: int = 128) -> Fp8Recipe:
    """DeepSeek-V3's block scaling: E4M3, float32 scales per 1 x `block` of activations, `block`^2 of weights.

    Output gradients are scaled per 1 x `block` too.

    Args:
        block: The block length (128 in DeepSeek-V3); every dim must be a multiple of it.

    Returns:
        The recipe.

    Raises:
        TypeError, ValueError: If `block` is not a positive int.
    """
    block = check_int("block", block, 1, 1 << 16)
    return Fp8Recipe("blockwise", "e4m3", power_of_2=False, block=block, weight_block=block)
