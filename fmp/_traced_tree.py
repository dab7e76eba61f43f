"""Tree traversal for traced steps: fmp's own walk of the containers a step's trees are made of.

Under torch.compile, `torch.utils._cxx_pytree` runs as Dynamo's Python stand-in for optree: for
each node it looks the type up in optree's registry and builds a treespec object, and a step
flattens its params, gradients, moments and scaler state a few dozen times. That is a large part
of the time Dynamo spends tracing a step, and the registry reads leave guards (hundreds, some of
them Python lambdas) that every call of the compiled step evaluates. This walk reads a node's
type with `type()` and builds nothing but tuples.

It covers tensors and other leaves (None among them), dicts, lists, tuples, namedtuples and fmp's
state dataclasses, with the leaves of `torch.utils._cxx_pytree` in its order. A tree holding any
other container (a type registered with torch's pytree, a subclass of dict, list or tuple) is
left to `torch.utils._cxx_pytree`, whole: `flatten` returns None.

A spec here is a tuple: empty for a leaf, else `(type, context, children, leaf count)`, with the
dict's keys or the dataclass's static fields as context and a tuple of the children's specs.
Specs compare by value, as optree's do: two dicts with the same keys in another order differ.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as python_pytree
from torch import nn

from fmp._struct import dataclass_fields

__all__ = ["LEAF", "Spec", "describe", "flatten", "flatten_up_to", "is_spec", "num_leaves", "unflatten"]

Spec = tuple[Any, ...]  # () for a leaf, else (type, context, tuple of specs, leaf count)
LEAF: Spec = ()

_OTHER: Any = object()  # what `_flatten` returns for a node this walk leaves to optree
_LEAF_TENSORS = (torch.Tensor, nn.Parameter)
_DICT_KINDS = (dict, collections.OrderedDict, collections.defaultdict)


def _node_kind(node: Any) -> tuple[type, Any, list[Any]] | None:
    """`(type, context, children)` of a node this walk takes; None for a leaf; `_OTHER` for another container."""
    kind = type(node)
    if kind in _LEAF_TENSORS:
        return None
    if kind is dict:
        return kind, tuple(node), list(node.values())
    if kind is list or kind is tuple:
        return kind, None, list(node)
    fields = dataclass_fields(kind)
    if fields is not None:
        leaf_names, static_names = fields
        return kind, tuple(getattr(node, name) for name in static_names), [getattr(node, n) for n in leaf_names]
    if issubclass(kind, tuple) and kind.__bases__ == (tuple,) and python_pytree.is_namedtuple_class(kind):
        return kind, None, list(node)
    if kind in python_pytree.SUPPORTED_NODES or issubclass(kind, (dict, list, tuple)):
        return _OTHER  # type: ignore[no-any-return]
    return None


def _flatten(node: Any, leaves: list[Any], is_leaf: Callable[[Any], bool] | None) -> Spec:
    """Appends `node`'s leaves to `leaves`; returns its spec, or `_OTHER`."""
    if is_leaf is not None and is_leaf(node):
        leaves.append(node)
        return LEAF
    taken = _node_kind(node)
    if taken is None:
        leaves.append(node)
        return LEAF
    if taken is _OTHER:
        return _OTHER
    kind, context, children = taken
    count = len(leaves)
    specs = []
    for child in children:
        if is_leaf is None and type(child) in _LEAF_TENSORS:  # the usual child, without a call
            leaves.append(child)
            specs.append(LEAF)
            continue
        spec = _flatten(child, leaves, is_leaf)
        if spec is _OTHER:
            return _OTHER
        specs.append(spec)
    return kind, context, tuple(specs), len(leaves) - count


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Spec] | None:
    """`(leaves, spec)` of `tree`, or None where it holds a container this walk leaves to optree."""
    leaves: list[Any] = []
    spec = _flatten(tree, leaves, is_leaf)
    return None if spec is _OTHER else (leaves, spec)


def is_spec(spec: Any) -> bool:
    """Whether `spec` was made here (rather than by optree)."""
    return type(spec) is tuple


def num_leaves(spec: Spec) -> int:
    """How many leaves a tree of `spec` has."""
    return spec[3] if spec else 1


def _build(kind: type, context: Any, values: list[Any]) -> Any:
    if kind is dict:
        return dict(zip(context, values, strict=True))
    if kind is list:
        return values
    if kind is tuple:
        return tuple(values)
    fields = dataclass_fields(kind)
    if fields is not None:
        leaf_names, static_names = fields
        return kind(**dict(zip(leaf_names, values, strict=True)), **dict(zip(static_names, context, strict=True)))
    return kind(*values)  # a namedtuple


def _unflatten(spec: Spec, leaves: Iterator[Any]) -> Any:
    kind, context, children, _ = spec
    values = [_unflatten(child, leaves) if child else next(leaves) for child in children]
    return _build(kind, context, values)


def unflatten(leaves: Iterable[Any], spec: Spec) -> Any:
    """The tree of `spec` with `leaves`, in order.

    Raises:
        ValueError: If there are more or fewer leaves than the spec has.
    """
    given = list(leaves)
    expected = num_leaves(spec)
    if len(given) != expected:
        raise ValueError(f"tree_unflatten: the treespec has {expected} leaves, but {len(given)} were given")
    return _unflatten(spec, iter(given)) if spec else given[0]


def _up_to(spec: Spec, node: Any, found: list[Any]) -> None:
    if not spec:
        found.append(node)
        return
    kind, context, children, _ = spec
    # optree takes an OrderedDict or a defaultdict where the spec has a dict, key by key.
    if type(node) is not kind and not (kind is dict and type(node) in _DICT_KINDS):
        raise ValueError(f"expected a {kind.__name__}, got a {type(node).__name__}")
    if kind is dict:
        if len(node) != len(context) or any(key not in node for key in context):
            raise ValueError(f"expected a dict with keys {list(context)}, got keys {list(node)}")
        values = [node[key] for key in context]
    else:
        taken = _node_kind(node)
        if taken is None or taken is _OTHER or taken[1] != context or len(taken[2]) != len(children):
            raise ValueError(f"a {kind.__name__} of another structure than the treespec's")
        values = taken[2]
    for child, value in zip(children, values, strict=True):
        _up_to(child, value, found)


def flatten_up_to(spec: Spec, tree: Any) -> list[Any]:
    """The subtrees of `tree` at the leaves of `spec`, in order (a dict taken key by key).

    Raises:
        ValueError: If `tree` does not have `spec`'s structure down to its leaves.
    """
    found: list[Any] = []
    _up_to(spec, tree, found)
    return found


def describe(spec: Spec) -> str:
    """`spec` in words for messages, as optree writes its specs: `*` for a leaf, `{'w': *, 'b': [*, *]}`."""
    if not spec:
        return "*"
    kind, context, children, _ = spec
    inner = [describe(child) for child in children]
    if kind is dict:
        return "{" + ", ".join(f"{key!r}: {text}" for key, text in zip(context, inner, strict=True)) + "}"
    if kind is list:
        return "[" + ", ".join(inner) + "]"
    if kind is tuple:
        return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"
    return f"{kind.__name__}(" + ", ".join(inner) + ")"
