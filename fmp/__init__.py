"""fmp: functional mixed precision for PyTorch.

The core lives here: precision policies, loss-scale states, the training step and its gradients,
gradient accumulation, compiling a step (`fmp.compile`), and tree utilities. Each other concern
has a subpackage: `fmp.autocast` (op-level autocast), `fmp.optim` (pure optimizers), `fmp.nn`
(modules as pure state), `fmp.remat` (activation checkpointing), `fmp.debug` (locating
overflows), `fmp.interop` (`torch.nn`/`torch.optim` loops), `fmp.serialization` (saving states),
and, each imported on its own, `fmp.fp8` (FP8 recipes) and `fmp.distributed` (data parallel).
"""

from fmp import autocast
from fmp import debug
from fmp import interop
from fmp import nn
from fmp import optim
from fmp import remat
from fmp import serialization
from fmp._accumulate import AccumulatedGradients
from fmp._accumulate import GradientAccumulator
from fmp._compile import compile
from fmp._compile import trusted_guard
from fmp._grad import Gradients
from fmp._grad import mixed_precision_grad
from fmp._grad import with_policy
from fmp._loss_scale import DynamicLossScale
from fmp._loss_scale import LossScale
from fmp._loss_scale import NoOpLossScale
from fmp._loss_scale import StaticLossScale
from fmp._policy import Policy
from fmp._policy import get_policy
from fmp._policy import half_dtype
from fmp._pool_indices import RealizePoolIndices
from fmp._rounding import stochastic_round
from fmp._scaler import Unscaled
from fmp._scaler import unscale_and_adjust
from fmp._stack import stack_trees
from fmp._stack import unstack_tree
from fmp._stall import LossScaleStalledError
from fmp._stall import raise_if_stalled
from fmp._state import StepCounts
from fmp._state import TrainState
from fmp._step import StepInfo
from fmp._step import mixed_precision_step
from fmp._step import train_step
from fmp._struct import OPTREE_NAMESPACE
from fmp._struct import resolve_annotations as _resolve_annotations
from fmp._tree import all_finite
from fmp._tree import cast_floating
from fmp._tree import select_tree

_resolve_annotations()  # every state class is defined by now

__version__ = "0.1.0"

__all__ = [
    "OPTREE_NAMESPACE",
    "AccumulatedGradients",
    "DynamicLossScale",
    "GradientAccumulator",
    "Gradients",
    "LossScale",
    "LossScaleStalledError",
    "NoOpLossScale",
    "Policy",
    "RealizePoolIndices",
    "StaticLossScale",
    "StepCounts",
    "StepInfo",
    "TrainState",
    "Unscaled",
    "all_finite",
    "autocast",
    "cast_floating",
    "compile",
    "debug",
    "get_policy",
    "half_dtype",
    "interop",
    "mixed_precision_grad",
    "mixed_precision_step",
    "nn",
    "optim",
    "raise_if_stalled",
    "remat",
    "select_tree",
    "serialization",
    "stack_trees",
    "stochastic_round",
    "train_step",
    "trusted_guard",
    "unscale_and_adjust",
    "unstack_tree",
    "with_policy",
]
