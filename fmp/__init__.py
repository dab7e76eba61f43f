"""fmp: functional mixed precision for PyTorch."""

from fmp import nn
from fmp import optim
from fmp._struct import OPTREE_NAMESPACE
from fmp.accumulate import GradientAccumulator
from fmp.autocast import autocast
from fmp.autocast_regions import fixed_dtype
from fmp.autocast_regions import no_autocast
from fmp.checkpoint import checkpoint_classes
from fmp.debug import NonFiniteOrigin
from fmp.debug import NonFiniteReport
from fmp.debug import locate_nonfinite
from fmp.fused import fused_unscale_and_adjust
from fmp.fused import fused_unscale_clip_and_adjust
from fmp.fused import unscale_and_adjust
from fmp.fused import unscale_clip_and_adjust
from fmp.grad import Gradients
from fmp.grad import mixed_precision_grad
from fmp.grad import with_policy
from fmp.gradient_buffer import GradientBuffer
from fmp.loss_scale import DynamicLossScale
from fmp.loss_scale import LossScale
from fmp.loss_scale import NoOpLossScale
from fmp.loss_scale import StaticLossScale
from fmp.module_policy import module_policies
from fmp.policy import Policy
from fmp.policy import get_policy
from fmp.policy import half_dtype
from fmp.remat import remat
from fmp.rounding import stochastic_round
from fmp.state import StepCounts
from fmp.state import TrainState
from fmp.step import LossScaleStalledError
from fmp.step import StepInfo
from fmp.step import mixed_precision_step
from fmp.step import raise_if_stalled
from fmp.step import train_step
from fmp.tree import all_finite
from fmp.tree import cast_floating
from fmp.tree import select_tree
from fmp.tree import stack_trees
from fmp.tree import unstack_tree

__version__ = "0.1.0"

__all__ = [
    "OPTREE_NAMESPACE",
    "DynamicLossScale",
    "GradientAccumulator",
    "GradientBuffer",
    "Gradients",
    "LossScale",
    "LossScaleStalledError",
    "NoOpLossScale",
    "NonFiniteOrigin",
    "NonFiniteReport",
    "Policy",
    "StaticLossScale",
    "StepCounts",
    "StepInfo",
    "TrainState",
    "all_finite",
    "autocast",
    "cast_floating",
    "checkpoint_classes",
    "fixed_dtype",
    "fused_unscale_and_adjust",
    "fused_unscale_clip_and_adjust",
    "get_policy",
    "half_dtype",
    "locate_nonfinite",
    "mixed_precision_grad",
    "mixed_precision_step",
    "module_policies",
    "nn",
    "no_autocast",
    "optim",
    "raise_if_stalled",
    "remat",
    "select_tree",
    "stack_trees",
    "stochastic_round",
    "train_step",
    "unscale_and_adjust",
    "unscale_clip_and_adjust",
    "unstack_tree",
    "with_policy",
]
