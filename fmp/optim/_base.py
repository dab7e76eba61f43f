"""The optimizer interface: a pair of pure functions, `init` and `update`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from fmp.tree import tree_device

__all__ = ["Optimizer", "check_state", "step_counter", "tree_zeros_like"]


class Optimizer(NamedTuple):
    """A pure optimizer, optax style, whose `update` returns new parameters directly.

    Attributes:
        init: `init(params) -> state`, a pytree of tensors (empty for stateless optimizers).
        update: `update(grads, state, params) -> (new_params, new_state)`; never mutates its inputs.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def check_state(name: str, state: Any, expected: type) -> None:
    """Raises unless `state` is the state type optimizer `name` creates."""
    if not isinstance(state, expected):
        raise TypeError(
            f"{name} got optimizer state of type {type(state).__name__}, expected {expected.__name__}: "
            f"was it created by another optimizer's init?"
        )


def step_counter(params: Any) -> torch.Tensor:
    """A 0-dim int32 zero on the device of the first tensor leaf of `params` (CPU if none)."""
    return torch.zeros((), dtype=torch.int32, device=tree_device(params))


def tree_zeros_like(tree: Any) -> Any:
    """Zeros shaped like every tensor leaf of `tree`."""
    return pytree.tree_map(torch.zeros_like, tree)
