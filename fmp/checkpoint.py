"""Checkpoints: the classes `torch.load(weights_only=True)` must be allowed to rebuild fmp's states."""

from __future__ import annotations

from fmp.accumulate import GradientAccumulator
from fmp.loss_scale import DynamicLossScale
from fmp.loss_scale import NoOpLossScale
from fmp.loss_scale import StaticLossScale
from fmp.optim.adam import AdamState
from fmp.optim.ema import EmaState
from fmp.optim.sgd import SgdState
from fmp.optim.stochastic_rounding import StochasticRoundingState
from fmp.state import StepCounts
from fmp.state import TrainState

__all__ = ["checkpoint_classes"]


def checkpoint_classes() -> list[type]:
    """Fmp's state classes, for `torch.serialization.safe_globals` when loading a saved state.

    `torch.save(state, path)` saves a `TrainState` (or any of its parts) as it is; loading it with
    `weights_only=True`, torch's safe default, needs these classes allowed:

        with torch.serialization.safe_globals(fmp.checkpoint_classes()):
            state = torch.load(path, weights_only=True)

    Returns:
        The classes, a fresh list.
    """
    return [
        TrainState,
        StepCounts,
        GradientAccumulator,
        NoOpLossScale,
        StaticLossScale,
        DynamicLossScale,
        AdamState,
        SgdState,
        StochasticRoundingState,
        EmaState,
    ]
