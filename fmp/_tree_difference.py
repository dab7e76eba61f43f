"""Where two pytrees differ in structure, named by path: for messages about trees that must agree."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as py_pytree

from fmp._struct import dataclass_fields

__all__ = ["structure_difference"]


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
    if isinstance(first, dict):
        if list(first) != list(other):
            return f"{at} has keys {list(other)}, not {list(first)}"
        return _first_of(structure_difference(first[key], other[key], f"{where}[{key!r}]") for key in first)
    if isinstance(first, tuple | list):
        if len(first) != len(other):
            return f"{at} has {len(other)} entries, not {len(first)}"
        names = getattr(type(first), "_fields", None)
        paths = [f"{where}.{name}" for name in names] if names else [f"{where}[{i}]" for i in range(len(first))]
        return _first_of(structure_difference(a, b, path) for a, b, path in zip(first, other, paths, strict=True))
    fields = dataclass_fields(type(first))
    if fields is not None:
        leaf_names, static_names = fields
        for name in static_names:
            if getattr(first, name) != getattr(other, name):
                return f"{where}.{name} is {getattr(other, name)!r}, not {getattr(first, name)!r}"
        return _first_of(
            structure_difference(getattr(first, name), getattr(other, name), f"{where}.{name}") for name in leaf_names
        )
    first_spec, other_spec = py_pytree.tree_structure(first), py_pytree.tree_structure(other)
    return None if first_spec == other_spec else f"{at} is {other_spec}, not {first_spec}"


def _first_of(differences: Any) -> str | None:
    return next((difference for difference in differences if difference is not None), None)
