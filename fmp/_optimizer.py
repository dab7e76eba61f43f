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
        masked_update: Optional. `masked_update(grads, state, params, applied, in_place) -> (new_params,
            new_state)`: `update`'s results where the 0-dim bool tensor `applied` holds and `(params,
            state)`'s values elsewhere, bit for bit as selecting between them would give, without a
            host sync; with `in_place` (an eager step whose state is donated) it may write them into
            `params`' and `state`'s tensors. `fmp.train_step` calls it instead of `update` and a
            select where it is given; the fused optimizers (`adamw(..., fused=True)`) skip inside
            their kernel so.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]
    masked_update: Callable[[Any, Any, Any, Any, bool], tuple[Any, Any]] | None = None
