"""The optimizer interface: a pair of pure functions, `init` and `update`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

__all__ = ["Optimizer", "check_hyperparameter", "step_counter", "tree_zeros_like"]


class Optimizer(NamedTuple):
    """A pure optimizer, optax style, whose `update` returns new parameters directly.

    Attributes:
        init: `init(params) -> state`, a pytree of tensors (empty for stateless optimizers).
        update: `update(grads, state, params) -> (new_params, new_state)`; never mutates its inputs.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def check_hyperparameter(name: str, value: Any, low: float, high: float, *, low_inclusive: bool = True) -> float:
    """Returns `value` as a float, or raises naming the hyperparameter and its allowed range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    above_low = value >= low if low_inclusive else value > low
    if not (above_low and value < high):
        bracket = "[" if low_inclusive else "("
        raise ValueError(f"{name} must be in {bracket}{low}, {high}), got {value}")
    return float(value)


def tree_zeros_like(tree: Any) -> Any:
    """Zeros shaped like every tensor leaf of `tree`."""
    return pytree.tree_map(torch.zeros_like, tree)


def step_counter(params: Any) -> torch.Tensor:
    """A 0-dim int32 zero on the device of the first tensor leaf of `params` (CPU if none)."""
    first = next((x for x in pytree.tree_leaves(params) if isinstance(x, torch.Tensor)), None)
    return torch.zeros((), dtype=torch.int32, device=None if first is None else first.device)
