"""Where two pytrees differ in structure, named by path: for messages about trees that must agree."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as py_pytree

from fmp._struct import dataclass_fields

__all__ = ["structure_difference", "tree_children"]


def tree_children(node: Any, where: str) -> list[tuple[str, Any]] | None:
    """A node's children with their paths below `where`, or None for a leaf (a tensor, say).

    A dict's entries, a list's or tuple's (a namedtuple's by field name), an fmp state's leaf fields.
    """
    if isinstance(node, dict):
        return [(f"{where}[{key!r}]", child) for key, child in node.items()]
    if isinstance(node, tuple | list):
        names = getattr(type(node), "_fields", None)
        paths = [f"{where}.{name}" for name in names] if names else [f"{where}[{i}]" for i in range(len(node))]
        return list(zip(paths, node, strict=True))
    fields = dataclass_fields(type(node))
    return None if fields is None else [(f"{where}.{name}", getattr(node, name)) for name in fields[0]]


def structure_difference(first: Any, other: Any, where: str = "") -> str | None:
    """The first node where `other` differs from `first` in type, keys, length or static fields, or None.

    Tensors count as alike here (their shapes and dtypes are the caller's to compare). The message
    names the path (`where` and the keys below it) and both sides, `other`'s first.
    """
    at = where or "the root"
    if isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor):
        return None
    if type(first) is not type(other):
        return f"{at} is of type {type(other).__name__}, not {type(first).__name__}"
    if isinstance(first, dict) and list(first) != list(other):
        return f"{at} has keys {list(other)}, not {list(first)}"
    if isinstance(first, tuple | list) and len(first) != len(other):
        return f"{at} has {len(other)} entries, not {len(first)}"
    fields = dataclass_fields(type(first))
    for name in () if fields is None else fields[1]:
        if getattr(first, name) != getattr(other, name):
            return f"{where}.{name} is {getattr(other, name)!r}, not {getattr(first, name)!r}"
    pairs, other_pairs = tree_children(first, where), tree_children(other, where)
    if pairs is None or other_pairs is None:
        first_spec, other_spec = py_pytree.tree_structure(first), py_pytree.tree_structure(other)
        return None if first_spec == other_spec else f"{at} is {other_spec}, not {first_spec}"
    return _first_of(structure_difference(a, b, path) for (path, a), (_, b) in zip(pairs, other_pairs, strict=True))


def _first_of(differences: Any) -> str | None:
    return next((difference for difference in differences if difference is not None), None)
