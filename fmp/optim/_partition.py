"""Param groups: one optimizer per group of parameters, as torch.optim's param groups and optax's multi_transform."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._optimizer import Optimizer
from fmp.optim._base import leaves_like_params

__all__ = ["partition"]

LabelFn = Callable[[str, torch.Tensor], str]
"""`label(name, param) -> group`, `name` the parameter's key ("0.weight" in a flat dict)."""


def param_name(path: tuple[Any, ...]) -> str:
    """A parameter's name from its key path: dict keys, sequence indices and attributes joined by dots."""
    parts = []
    for key in path:
        if isinstance(key, py_pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, py_pytree.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, py_pytree.GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key))
    return ".".join(parts)


def _groups(params: Any, label: LabelFn, optimizers: Mapping[str, Optimizer]) -> dict[str, dict[str, int]]:
    """Each group's parameters, `{name: leaf index}` in the params' order; every group of `optimizers`, empty or not."""
    groups: dict[str, dict[str, int]] = {group: {} for group in optimizers}
    seen: set[str] = set()
    for index, (path, param) in enumerate(py_pytree.tree_flatten_with_path(params)[0]):
        name = param_name(path)
        if name in seen:
            raise ValueError(f"two parameters are both named {name!r} (params{py_pytree.keystr(path)} and another)")
        seen.add(name)
        group = label(name, param)
        if not isinstance(group, str):
            raise TypeError(f"label({name!r}, ...) must return a group name (str), got {type(group).__name__}")
        if group not in groups:
            raise ValueError(f"label({name!r}, ...) returned {group!r}, which is not a group of {sorted(optimizers)}")
        groups[group][name] = index
    return groups


def partition(optimizers: Mapping[str, Optimizer], label: LabelFn) -> Optimizer:
    """One optimizer per group of parameters: torch.optim's param groups, optax's `multi_transform`.

    `label(name, param)` puts each parameter in a group; that group's optimizer updates it and
    keeps its state. The usual use is AdamW without weight decay on biases and norms:

        decay = fmp.optim.adamw(1e-3, weight_decay=0.1)
        no_decay = fmp.optim.adamw(1e-3, weight_decay=0.0)
        optimizer = fmp.optim.partition(
            {"decay": decay, "no_decay": no_decay}, lambda name, p: "decay" if p.dim() >= 2 else "no_decay"
        )

    Each group's optimizer sees its parameters as a flat dict by name, so its state is keyed by
    the same names; the state is a dict of the groups' states. The groups are decided from the
    names and shapes alone (nothing is read on the host), once per trace when compiled. Wrap the
    result in `clip_by_global_norm` to clip by the norm over all groups, as `clip_grad_norm_` over
    a model's parameters does.

    Args:
        optimizers: The optimizer of each group, by group name (at least one).
        label: `label(name, param) -> group name`; `name` is the parameter's key in a flat dict
            (`"0.weight"`), its key path joined by dots in a nested tree.

    Returns:
        An optimizer whose state is `{group: that group's optimizer state}`.

    Raises:
        TypeError, ValueError: If `optimizers` is empty or holds something other than fmp
            optimizers, or `label` is not callable; at `init` and `update`, naming the parameter
            whose label is not a str or not a group.
    """
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise ValueError("partition needs a non-empty dict of fmp optimizers by group name")
    for group, optimizer in optimizers.items():
        if not isinstance(group, str):
            raise TypeError(f"partition's group names must be str (label returns one), got {group!r}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizers[{group!r}] must be an fmp.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(label):
        raise TypeError(f"label must be a function label(name, param) -> group, got {type(label).__name__}")
    optimizers = dict(optimizers)

    def members(leaves: list[Any], indices: dict[str, int]) -> dict[str, Any]:
        return {name: leaves[index] for name, index in indices.items()}

    def init(params: Any) -> dict[str, Any]:
        groups, leaves = _groups(params, label, optimizers), pytree.tree_leaves(params)
        return {group: optimizers[group].init(members(leaves, indices)) for group, indices in groups.items()}

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, dict[str, Any]]:
        if not (isinstance(state, dict) and state.keys() == optimizers.keys()):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise TypeError(
                f"partition got optimizer state {got}, expected a dict of the groups {sorted(optimizers)}: "
                f"was it created by another optimizer's init?"
            )
        groups = _groups(params, label, optimizers)
        spec, param_leaves, (grad_leaves,), _ = leaves_like_params("partition", params, {"grads": grads})
        new_leaves: list[Any] = list(param_leaves)
        new_state = {}
        for group in state:  # the state's own key order: a skipped step keeps the state as it came
            indices = groups[group]
            new_params, new_state[group] = optimizers[group].update(
                members(grad_leaves, indices), state[group], members(param_leaves, indices)
            )
            for name, index in indices.items():
                new_leaves[index] = new_params[name]
        return pytree.tree_unflatten(new_leaves, spec), new_state

    return Optimizer(init, update)
