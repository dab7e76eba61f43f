"""Comparing a saved tree with a restore target: the first difference, named by its path."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["children", "first_difference"]

_FIX = "build the target as the checkpoint's run built its state"


def children(tree: Any) -> tuple[pytree.TreeSpec, list[tuple[str, Any]]]:
    """One level of `tree`: its node's spec (a leaf spec for a leaf) and its children by key."""
    flat, spec = pytree.tree_flatten_with_path(tree, is_leaf=lambda node: node is not tree)
    return spec, [(pytree.keystr(path), child) for path, child in flat]


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"shape {tuple(leaf.shape)}, {str(leaf.dtype).removeprefix('torch.')}"
    return type(leaf).__name__


def _leaf_difference(saved: Any, target: Any, where: str) -> str | None:
    if not isinstance(target, torch.Tensor):
        return f"{where} is a {type(target).__name__} in the target, where the checkpoint holds a tensor; {_FIX}"
    if saved.shape != target.shape or saved.dtype != target.dtype:
        what = "shape" if saved.shape != target.shape else "dtype"
        return (
            f"{where} differs in {what}: {_describe(saved)} in the checkpoint, {_describe(target)} in the target; "
            f"{_FIX} (same model widths, param dtype and optimizer)"
        )
    return None


def _static_difference(saved: Any, target: Any, where: str, leaf_keys: list[str]) -> str:
    """Names the configuration (a dataclass's static field) that differs, else the node's context."""
    if dataclasses.is_dataclass(saved) and not isinstance(saved, type):
        for field in dataclasses.fields(saved):
            if f".{field.name}" not in leaf_keys and getattr(saved, field.name) != getattr(target, field.name):
                return (
                    f"{where}.{field.name} is {getattr(saved, field.name)!r} in the checkpoint but "
                    f"{getattr(target, field.name)!r} in the target; {_FIX} (same settings)"
                )
    return f"{where} has another configuration in the checkpoint than in the target; {_FIX}"


def first_difference(saved: Any, target: Any, where: str = "state") -> str | None:
    """The first place, in the target's order, where `target` differs from `saved` in structure, shape or dtype.

    Types, keys, lengths and static configuration (such as a loss scale's hyperparameters) must
    match; dict keys may come in another order. `saved`'s leaves are tensors (meta ones will do).

    Returns:
        A message naming the path and both sides, or None where the trees fit.
    """
    saved_spec, saved_children = children(saved)
    target_spec, target_children = children(target)
    if saved_spec.is_leaf() and target_spec.is_leaf():
        return _leaf_difference(saved, target, where)
    # The node's own class: a namedtuple's spec type is namedtuple itself, its class is the context.
    if saved_spec.is_leaf() or target_spec.is_leaf() or type(saved) is not type(target):
        saved_kind, target_kind = type(saved).__name__, type(target).__name__
        hint = " (another optimizer?)" if where.endswith("opt_state") else ""
        return f"{where} differs in type: {saved_kind} in the checkpoint, {target_kind} in the target{hint}; {_FIX}"
    saved_keys = [key for key, _ in saved_children]
    target_keys = [key for key, _ in target_children]
    missing = [key for key in saved_keys if key not in target_keys]
    extra = [key for key in target_keys if key not in saved_keys]
    if missing or extra:
        lacks = f"the checkpoint holds {[where + key for key in missing]}, which the target lacks" if missing else ""
        more = f"the target holds {[where + key for key in extra]}, which the checkpoint lacks" if extra else ""
        return f"{where} differs in entries: {'; '.join(filter(None, (lacks, more)))}; {_FIX}"
    # A dict's context is its keys in order; the keys matched above, in any order.
    if saved_spec.type is not dict and saved_spec.context != target_spec.context:
        return _static_difference(saved, target, where, saved_keys)
    by_key = dict(saved_children)
    for key, child in target_children:
        problem = first_difference(by_key[key], child, where + key)
        if problem is not None:
            return problem
    return None
