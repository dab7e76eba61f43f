"""FP8 training as pure state: the scaling recipes of Transformer Engine and torchao, functional.

A recipe is configuration: `tensorwise()` and `rowwise()` (current scaling, torchao's),
`mxfp8()` (OCP Microscaling blocks of 32 with E8M0 scales), `blockwise()` (DeepSeek-V3's 1x128 and
128x128 tiles) and `delayed()` (Transformer Engine's DelayedScaling, whose amax history and
scales are a `DelayedScalingState` pytree updated by a pure function). `fp8_linear` runs a linear
layer's forward and backward matmuls in FP8 per a recipe, under autograd, `torch.func` and
`torch.compile`; `fp8_modules` runs chosen linear layers of a model in FP8, as a function
transform.
"""

from fmp._delayed_scaling import ROLES
from fmp._delayed_scaling import DelayedScaling
from fmp._delayed_scaling import DelayedScalingState
from fmp._delayed_scaling import Fp8Scales
from fmp._delayed_scaling import delayed
from fmp._fp8_formats import E4M3
from fmp._fp8_formats import E5M2
from fmp._fp8_formats import amax
from fmp._fp8_formats import dequantize
from fmp._fp8_formats import max_finite
from fmp._fp8_formats import quantize
from fmp.fp8._blocks import Quantized
from fmp.fp8._linear import fp8_linear
from fmp.fp8._linear import fp8_matmul
from fmp.fp8._modules import fp8_modules
from fmp.fp8._modules import init_states
from fmp.fp8._recipes import Fp8Recipe
from fmp.fp8._recipes import blockwise
from fmp.fp8._recipes import mxfp8
from fmp.fp8._recipes import rowwise
from fmp.fp8._recipes import tensorwise

__all__ = [
    "E4M3",
    "E5M2",
    "ROLES",
    "DelayedScaling",
    "DelayedScalingState",
    "Fp8Recipe",
    "Fp8Scales",
    "Quantized",
    "amax",
    "blockwise",
    "delayed",
    "dequantize",
    "fp8_linear",
    "fp8_matmul",
    "fp8_modules",
    "init_states",
    "max_finite",
    "mxfp8",
    "quantize",
    "rowwise",
    "tensorwise",
]
