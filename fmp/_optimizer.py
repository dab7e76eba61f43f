"""The optimizer interface fmp's step drives: a pair of pure functions, `init` and `update`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

__all__ = ["Optimizer"]


class Optimizer(NamedTuple):
    """A pure optimizer, optax style, whose `update` returns new parameters directly.

    Attributes:
        init: `init(params) -> state`, a pytree of tensors (empty for stateless optimizers).
        update: `update(grads, state, params) -> (new_params, new_state)`; never mutates its inputs.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]
