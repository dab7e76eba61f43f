"""An adapter from optax-style gradient transformations, written for torch tensors, to fmp optimizers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import Protocol
from typing import overload

import torch
import torch.utils._pytree as pytree

from fmp._optimizer import Optimizer
from fmp._tree import same_static_leaf

__all__ = ["GradientTransformationLike", "from_gradient_transformation"]

InitFn = Callable[[Any], Any]
UpdateFn = Callable[..., Any]


class GradientTransformationLike(Protocol):
    """Anything with optax's `init` and `update` attributes, e.g. an `optax.GradientTransformation`-like NamedTuple."""

    @property
    def init(self) -> InitFn:
        """`init(params) -> state`."""

    @property
    def update(self) -> UpdateFn:
        """`update(updates, state, params) -> (updates, new_state)`."""


@overload
def from_gradient_transformation(transformation: GradientTransformationLike, /) -> Optimizer: ...


@overload
def from_gradient_transformation(init: InitFn, update: UpdateFn, /) -> Optimizer: ...


def from_gradient_transformation(transformation: Any, update: Any = None, /) -> Optimizer:
    """Turns an optax-style gradient transformation over torch tensors into an fmp optimizer.

    optax splits an optimizer into `init(params) -> state` and `update(updates, state, params) ->
    (updates, new_state)`, whose updates are added to the params (`optax.apply_updates`). fmp's
    optimizers return the new params instead; this adapter adds the updates, `p + u` cast back to
    each param's dtype as `optax.apply_updates` does, so that a transformation written for torch
    tensors runs in `fmp.train_step` (which keeps its state bit for bit on skipped steps).

    Call it with the transformation, any object with `init` and `update` attributes (a NamedTuple
    like optax's `GradientTransformation`), or with the two functions: `from_gradient_transformation
    (init, update)`. The state must be a tree torch's pytree flattens (tuples, NamedTuples, lists,
    dicts) with tensors for everything that changes: `train_step` picks the old or the new state
    leaf by leaf with `torch.where`. To load it with `torch.load(weights_only=True)`, allow its
    NamedTuple classes too (`torch.serialization.safe_globals`).

    Args:
        transformation: The transformation; or, with `update` given, its `init` function.
        update: The transformation's `update` function, when `transformation` is its `init`.

    Returns:
        An optimizer whose state is the transformation's state. Its `update` checks, at trace time,
        that the transformation returned `(updates, new_state)` with updates shaped like the params
        and a new state of the old one's structure, shapes and dtypes.

    Raises:
        TypeError: If the arguments are not a transformation or two callables, or are already an
            fmp `Optimizer` (whose update returns new params, not updates).
    """
    if isinstance(transformation, Optimizer):
        raise TypeError(
            "from_gradient_transformation got an fmp.optim.Optimizer, whose update returns new params, "
            "not updates: use it as it is"
        )
    if update is None:
        init = getattr(transformation, "init", None)
        update = getattr(transformation, "update", None)
        if not (callable(init) and callable(update)):
            raise TypeError(
                "from_gradient_transformation takes an object with callable init and update attributes "
                f"(e.g. optax.GradientTransformation) or the two functions, got {type(transformation).__name__}"
            )
    else:
        init = transformation
        for name, value in (("init", init), ("update", update)):
            if not callable(value):
                raise TypeError(f"from_gradient_transformation: {name} must be callable, got {type(value).__name__}")
    transformation_update: UpdateFn = update

    def optimizer_update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        result = transformation_update(grads, state, params)
        if not (isinstance(result, tuple) and len(result) == 2):
            got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
            raise TypeError(f"the transformation's update must return a pair (updates, new_state), got {got}")
        updates, new_state = result
        new_params = _apply_updates(params, updates)
        _check_same_state(state, new_state)
        return new_params, new_state

    return Optimizer(init, optimizer_update)


def _apply_updates(params: Any, updates: Any) -> Any:
    """`p + u` cast to `p`'s dtype, leaf by leaf, after checking `updates` has the params' structure."""
    param_pairs, param_spec = pytree.tree_flatten_with_path(params)
    update_leaves, update_spec = pytree.tree_flatten(updates)
    if update_spec != param_spec:
        raise ValueError(
            f"the transformation's updates must have the params' structure {param_spec}, got {update_spec}"
        )
    new_leaves = []
    for (path, p), u in zip(param_pairs, update_leaves, strict=True):
        where = f"updates{pytree.keystr(path)}"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params{pytree.keystr(path)} is a {type(p).__name__}; the params must be tensors")
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"{where} is a {type(u).__name__}, expected a tensor")
        if u.shape != p.shape:
            raise ValueError(f"{where} has shape {tuple(u.shape)}, but its param has shape {tuple(p.shape)}")
        # As optax.apply_updates: add in the promoted dtype, then round once to the param's dtype.
        new_leaves.append((p + u).to(p.dtype))
    return pytree.tree_unflatten(new_leaves, param_spec)


def _check_same_state(state: Any, new_state: Any) -> None:
    """Raises unless `new_state` has `state`'s structure, and each tensor leaf keeps its shape and dtype.

    `train_step` keeps the old state on a skipped step, leaf by leaf: the two must line up.
    """
    old_pairs, old_spec = pytree.tree_flatten_with_path(state)
    new_leaves, new_spec = pytree.tree_flatten(new_state)
    if new_spec != old_spec:
        raise ValueError(
            f"the transformation's update returned a state of structure {new_spec}, "
            f"but was given one of structure {old_spec}; the state must keep its structure"
        )
    for (path, old), new in zip(old_pairs, new_leaves, strict=True):
        where = f"state{pytree.keystr(path)}"
        if isinstance(old, torch.Tensor) != isinstance(new, torch.Tensor):
            raise TypeError(
                f"{where} came back as {type(new).__name__}, was {type(old).__name__}; "
                f"keep everything that changes in tensors"
            )
        if not isinstance(old, torch.Tensor) and not same_static_leaf(old, new):
            raise TypeError(
                f"{where} changed from {old!r} to {new!r}: a skipped step keeps the old state with torch.where, "
                f"so keep everything that changes in tensors (e.g. a step count as torch.zeros((), dtype=torch.int32))"
            )
        if isinstance(old, torch.Tensor) and (old.shape != new.shape or old.dtype != new.dtype):
            raise ValueError(
                f"{where} changed from {old.dtype}{list(old.shape)} to {new.dtype}{list(new.shape)}; "
                f"the state must keep its shapes and dtypes"
            )
