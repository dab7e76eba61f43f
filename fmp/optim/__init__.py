"""Pure optimizers: `init(params) -> state` and `update(grads, state, params) -> (params, state)`."""

from fmp._norm import global_norm
from fmp._optimizer import Optimizer
from fmp.optim import schedule
from fmp.optim._adam import AdamState
from fmp.optim._adam import adam
from fmp.optim._adam import adamw
from fmp.optim._adapter import from_gradient_transformation
from fmp.optim._base import Schedule
from fmp.optim._clip import clip_by_global_norm
from fmp.optim._ema import EmaState
from fmp.optim._ema import ema
from fmp.optim._partition import partition
from fmp.optim._sgd import SgdState
from fmp.optim._sgd import sgd
from fmp.optim._stochastic_rounding import StochasticRoundingState
from fmp.optim._stochastic_rounding import stochastic_rounding

__all__ = [
    "AdamState",
    "EmaState",
    "Optimizer",
    "Schedule",
    "SgdState",
    "StochasticRoundingState",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "ema",
    "from_gradient_transformation",
    "global_norm",
    "partition",
    "schedule",
    "sgd",
    "stochastic_rounding",
]
