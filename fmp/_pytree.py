"""Tree traversal for fmp's per-step code: torch's C++ pytree, kept in step with its Python registry.

`torch.utils._cxx_pytree` (optree) flattens and maps trees several times faster than
`torch.utils._pytree`, and Dynamo traces it as well. But torch registers a type with the C++
registry only through `register_pytree_node`: `torch.utils._pytree.register_dataclass` and
`torch.export.register_dataclass` reach the Python registry alone, and the C++ functions would take
such a container for a leaf. So before each traversal the Python registry's size is compared with
the count already mirrored (one `len`), and newly registered types are mirrored into the C++ one.
Key paths (for error messages) stay with `torch.utils._pytree`, which has them.

Traced by Dynamo, the functions walk the tree with `fmp._traced_tree`, whose specs are tuples;
`tree_unflatten`, `flatten_up_to` and `num_leaves` take either kind of spec.

optree spends ~0.2 µs a leaf (a registry lookup for each), and a step flattens its params,
gradients, optimizer moments and buffers several times: dicts of tensors keyed by names. Such a
dict flattens to its values in insertion order (torch orders dicts so in its namespace), so eager
calls take its values as they are, with the spec optree made for the same keys, cached; the
leaves of tuples and lists of those (a loss function's arguments) are gathered the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import optree
import torch
import torch.utils._cxx_pytree as cxx_pytree
import torch.utils._pytree as python_pytree

from fmp import _traced_tree as traced

__all__ = [
    "TreeSpec",
    "flatten_up_to",
    "num_leaves",
    "spec_str",
    "tree_flatten",
    "tree_iter",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "tree_unflatten",
]

TreeSpec = Any  # optree's `PyTreeSpec`, or in traced code `fmp._traced_tree`'s nested tuples

_mirrored = 0  # how many entries of the Python registry have been looked at

# The spec of a dict of tensors by its keys, as optree made it; None where the keys do not
# flatten in insertion order. Cleared when full: a program has a few such structures.
_DICT_SPECS: dict[tuple[str, ...], TreeSpec | None] = {}
_DICT_SPECS_LIMIT = 256
_UNSEEN: Any = object()


def _mirror_registry() -> None:
    """Registers with the C++ registry every type the Python one has gained since the last call."""
    global _mirrored
    nodes = python_pytree.SUPPORTED_NODES
    if len(nodes) == _mirrored or torch.compiler.is_compiling():
        return
    for cls, node in list(nodes.items()):
        builtin_or_known = (
            cls.__module__ == "builtins"
            or python_pytree.is_namedtuple_class(cls)
            or optree.is_structseq_class(cls)
            or optree.register_pytree_node.get(cls, namespace="torch") is not None
        )
        if not builtin_or_known:
            cxx_pytree._private_register_pytree_node(cls, node.flatten_fn, node.unflatten_fn)
    _mirrored = len(nodes)


def _tensor_dict_flatten(tree: Any) -> tuple[list[Any], TreeSpec] | None:
    """`tree_flatten(tree)` of an eager dict of plain tensors keyed by strings, or None for any other tree."""
    if type(tree) is not dict or torch.compiler.is_compiling():
        return None
    values = list(tree.values())
    if set(map(type, values)) != {torch.Tensor} or set(map(type, tree)) != {str}:
        return None
    keys = tuple(tree)
    spec = _DICT_SPECS.get(keys, _UNSEEN)
    if spec is _UNSEEN:
        if len(_DICT_SPECS) >= _DICT_SPECS_LIMIT:
            _DICT_SPECS.clear()
        spec = cxx_pytree.tree_structure(tree)
        spec = _DICT_SPECS[keys] = spec if spec.entries() == list(keys) else None
    return None if spec is None else (values, spec)


def tree_flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeSpec]:
    """`torch.utils._pytree.tree_flatten`, in C++."""
    if torch.compiler.is_compiling():
        flat = traced.flatten(tree, is_leaf)
    else:
        flat = None if is_leaf is not None else _tensor_dict_flatten(tree)
    if flat is not None:
        return flat
    _mirror_registry()
    return cxx_pytree.tree_flatten(tree, is_leaf=is_leaf)


def _plain_leaves(tree: Any) -> list[Any] | None:
    """`tree_leaves(tree)` of a tensor, or of a tuple or list of such trees and dicts of tensors; else None.

    Plain types only (a namedtuple or a tensor subclass may be registered as a node of its own).
    """
    kind = type(tree)
    if kind is torch.Tensor:
        return [tree]
    if kind is dict:
        flat = _tensor_dict_flatten(tree) if tree else ([], None)
        return None if flat is None else flat[0]
    if kind is not tuple and kind is not list:
        return None
    leaves: list[Any] = []
    for item in tree:
        part = _plain_leaves(item)
        if part is None:
            return None
        leaves += part
    return leaves


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """`torch.utils._pytree.tree_leaves`, in C++."""
    if torch.compiler.is_compiling():
        flat = traced.flatten(tree, is_leaf)
        leaves = None if flat is None else flat[0]
    else:
        leaves = None if is_leaf is not None else _plain_leaves(tree)
    if leaves is not None:
        return leaves
    _mirror_registry()
    return cxx_pytree.tree_leaves(tree, is_leaf=is_leaf)


def tree_iter(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Iterable[Any]:
    """`torch.utils._pytree.tree_iter`, in C++."""
    if torch.compiler.is_compiling():
        return iter(tree_leaves(tree, is_leaf))
    _mirror_registry()
    return cxx_pytree.tree_iter(tree, is_leaf=is_leaf)


def tree_map(func: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """`torch.utils._pytree.tree_map`, in C++."""
    flat = traced.flatten(tree, is_leaf) if torch.compiler.is_compiling() else None
    if flat is not None:
        leaves, spec = flat
        others = [traced.flatten_up_to(spec, rest) for rest in rests]
        return traced.unflatten([func(*xs) for xs in zip(leaves, *others, strict=True)], spec)
    _mirror_registry()
    return cxx_pytree.tree_map(func, tree, *rests, is_leaf=is_leaf)


def tree_structure(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> TreeSpec:
    """`torch.utils._pytree.tree_structure`, in C++."""
    flat = traced.flatten(tree, is_leaf) if torch.compiler.is_compiling() else None
    if flat is not None:
        return flat[1]
    _mirror_registry()
    return cxx_pytree.tree_structure(tree, is_leaf=is_leaf)


def tree_unflatten(leaves: Iterable[Any], treespec: TreeSpec) -> Any:
    """`torch.utils._pytree.tree_unflatten`, in C++."""
    if traced.is_spec(treespec):
        return traced.unflatten(leaves, treespec)
    return cxx_pytree.tree_unflatten(leaves, treespec)


def flatten_up_to(treespec: TreeSpec, tree: Any) -> list[Any]:
    """`treespec.flatten_up_to(tree)`: the subtrees of `tree` at the spec's leaves, for either kind of spec.

    Raises:
        ValueError: If `tree` does not have the spec's structure down to its leaves.
    """
    if traced.is_spec(treespec):
        return traced.flatten_up_to(treespec, tree)
    subtrees: list[Any] = treespec.flatten_up_to(tree)
    return subtrees


def num_leaves(treespec: TreeSpec) -> int:
    """How many leaves a tree of `treespec` has, for either kind of spec."""
    count: int = traced.num_leaves(treespec) if traced.is_spec(treespec) else treespec.num_leaves
    return count


def spec_str(treespec: TreeSpec) -> str:
    """`treespec` in words for messages, for either kind of spec."""
    return traced.describe(treespec) if traced.is_spec(treespec) else str(treespec)
