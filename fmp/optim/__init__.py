"""Pure optimizers: `init(params) -> state` and `update(grads, state, params) -> (params, state)`."""

from fmp.optim import schedule
from fmp.optim._base import Optimizer
from fmp.optim._base import Schedule
from fmp.optim.adam import AdamState
from fmp.optim.adam import adam
from fmp.optim.adam import adamw
from fmp.optim.adapter import from_gradient_transformation
from fmp.optim.clip import clip_by_global_norm
from fmp.optim.clip import global_norm
from fmp.optim.ema import EmaState
from fmp.optim.ema import ema
from fmp.optim.partition import partition
from fmp.optim.sgd import SgdState
from fmp.optim.sgd import sgd
from fmp.optim.stochastic_rounding import StochasticRoundingState
from fmp.optim.stochastic_rounding import stochastic_rounding
from fmp.optim.to_torch import to_torch_state_dict
from fmp.optim.torch_state import from_torch_state_dict

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
    "from_torch_state_dict",
    "global_norm",
    "partition",
    "schedule",
    "sgd",
    "stochastic_rounding",
    "to_torch_state_dict",
]
