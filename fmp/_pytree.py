"""Tree traversal for fmp's per-step code: torch's C++ pytree, kept in step with its Python registry.

`torch.utils._cxx_pytree` (optree) flattens and maps trees several times faster than
`torch.utils._pytree`, and Dynamo traces it as well. But torch registers a type with the C++
registry only through `register_pytree_node`: `torch.utils._pytree.register_dataclass` and
`torch.export.register_dataclass` reach the Python registry alone, and the C++ functions would take
such a container for a leaf. So before each traversal the Python registry's size is compared with
the count already mirrored (one `len`), and newly registered types are mirrored into the C++ one.
Key paths (for error messages) stay with `torch.utils._pytree`, which has them.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import optree
import torch
import torch.utils._cxx_pytree as cxx_pytree
import torch.utils._pytree as python_pytree

__all__ = ["TreeSpec", "tree_flatten", "tree_iter", "tree_leaves", "tree_map", "tree_structure", "tree_unflatten"]

TreeSpec = cxx_pytree.TreeSpec

_mirrored = 0  # how many entries of the Python registry have been looked at


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


def tree_flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeSpec]:
    """`torch.utils._pytree.tree_flatten`, in C++."""
    _mirror_registry()
    return cxx_pytree.tree_flatten(tree, is_leaf=is_leaf)


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """`torch.utils._pytree.tree_leaves`, in C++."""
    _mirror_registry()
    return cxx_pytree.tree_leaves(tree, is_leaf=is_leaf)


def tree_iter(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Iterable[Any]:
    """`torch.utils._pytree.tree_iter`, in C++."""
    _mirror_registry()
    return cxx_pytree.tree_iter(tree, is_leaf=is_leaf)


def tree_map(func: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """`torch.utils._pytree.tree_map`, in C++."""
    _mirror_registry()
    return cxx_pytree.tree_map(func, tree, *rests, is_leaf=is_leaf)


def tree_structure(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> TreeSpec:
    """`torch.utils._pytree.tree_structure`, in C++."""
    _mirror_registry()
    return cxx_pytree.tree_structure(tree, is_leaf=is_leaf)


def tree_unflatten(leaves: Iterable[Any], treespec: TreeSpec) -> Any:
    """`torch.utils._pytree.tree_unflatten`, in C++."""
    return cxx_pytree.tree_unflatten(leaves, treespec)
