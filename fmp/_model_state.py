"""Model state through a step: a loss function that takes the model's buffers and returns them updated.

A train-mode BatchNorm updates its running statistics in place as the forward pass runs. As
state of the step they stay pure: the step hands the loss function copies, made inside the
`torch.func` transform (where in-place writes of tracked values are allowed), and keeps what it
returns, as flax keeps `batch_stats`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._tree import clone_leaves

__all__ = ["has_model_state", "returning_model_state", "settle_model_state"]


def has_model_state(model_state: Any) -> bool:
    """Whether a state's `model_state` holds model state (anything but the empty tuple)."""
    return not (isinstance(model_state, tuple) and len(model_state) == 0)


def returning_model_state(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """`loss_fn(params, model_state, *args) -> (out, new_model_state)` as a function with aux `(aux, new_model_state)`.

    `out` is what a loss function without model state returns: a loss, a tuple of losses, or
    `(loss, aux)` with `has_aux`. The function it makes takes the model state as its first
    argument after the params, and hands `loss_fn` copies of it.
    """

    def with_state(params: Any, model_state: Any, *args: Any) -> tuple[Any, tuple[Any, Any]]:
        leaves, spec = pytree.tree_flatten(model_state)
        returned = loss_fn(params, pytree.tree_unflatten(clone_leaves(leaves), spec), *args)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            got = f"a tuple of {len(returned)}" if isinstance(returned, tuple) else type(returned).__name__
            raise TypeError(
                f"with model_state in the TrainState, loss_fn(params, model_state, *args) must return "
                f"(out, new_model_state), out being the loss (or (loss, aux) with has_aux); got {got}"
            )
        out, new_model_state = returned
        _check_like(new_model_state, model_state, leaves, spec)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"with has_aux=True, loss_fn's out must be (loss, aux), got {type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, ()
        return loss, (aux, new_model_state)

    return with_state


def _check_like(new_model_state: Any, model_state: Any, leaves: list[torch.Tensor], spec: pytree.TreeSpec) -> None:
    """Raises naming the first leaf of `new_model_state` whose structure, type or shape differs from `model_state`'s.

    `leaves` and `spec` are `model_state` flattened.
    """
    new_leaves, new_spec = pytree.tree_flatten(new_model_state)
    if new_spec != spec:
        raise TypeError(
            f"loss_fn's new_model_state must have the structure of state.model_state: "
            f"expected {pytree.spec_str(spec)}, got {pytree.spec_str(new_spec)}"
        )
    for index, (new, old) in enumerate(zip(new_leaves, leaves, strict=True)):
        if isinstance(new, torch.Tensor) and new.shape == old.shape:
            continue
        # Key paths only for the message: flattening with them costs several times a plain flatten.
        where = f"new_model_state{py_pytree.keystr(py_pytree.tree_flatten_with_path(model_state)[0][index][0])}"
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{where} is a {type(new).__name__}, where state.model_state holds a tensor")
        raise ValueError(f"{where} has shape {tuple(new.shape)}, where state.model_state's is {tuple(old.shape)}")


def settle_model_state(new_model_state: Any, model_state: Any) -> Any:
    """The model state a step returns: `new_model_state` (checked by the loss function's wrapper) in the state's dtypes.

    A policy that casts whole (rules None) hands the loss function the model state in the compute
    dtype; what comes back is stored in the dtypes the state keeps.
    """
    new_leaves, spec = pytree.tree_flatten(new_model_state)
    leaves = pytree.tree_leaves(model_state)
    if all(new.dtype == old.dtype for new, old in zip(new_leaves, leaves, strict=True)):
        return new_model_state
    return pytree.tree_unflatten([new.to(old.dtype) for new, old in zip(new_leaves, leaves, strict=True)], spec)
