"""Ensembles' trees: members stacked leaf by leaf along a new leading dim, and one member taken back out."""

from __future__ import annotations

import operator
from typing import TypeVar
from typing import cast

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._tree_difference import structure_difference

__all__ = ["stack_trees", "unstack_tree"]

Tree = TypeVar("Tree")


def stack_trees(trees: list[Tree]) -> Tree:
    """Stacks trees of one structure leaf by leaf along a new leading dim, e.g. an ensemble's states.

    The result maps under `torch.func.vmap` (each member one slice). Hyperparameters live in the
    treespec, so the members' must agree: one `DynamicLossScale.create(...)` configuration for all,
    with any starting scale.

    Args:
        trees: One or more pytrees of tensors with the same structure, shapes and dtypes.

    Returns:
        One tree whose leaves have a leading dim of `len(trees)`.

    Raises:
        TypeError: If `trees` is not a list or tuple (one tree passed alone, say), or a leaf is not a tensor.
        ValueError: If `trees` is empty, or a tree differs from the first in structure (its
            hyperparameters, say) or in a leaf's shape, dtype or device.
    """
    if type(trees) not in (list, tuple):
        raise TypeError(f"stack_trees takes a list of trees, e.g. [state_0, state_1], got a {type(trees).__name__}")
    if not trees:
        raise ValueError("stack_trees needs at least one tree")
    first_pairs, spec = py_pytree.tree_flatten_with_path(trees[0])
    others = []
    for index, tree in enumerate(trees[1:], start=1):
        leaves, other_spec = py_pytree.tree_flatten(tree)
        if other_spec != spec:
            difference = structure_difference(trees[0], tree, f"trees[{index}]") or f"{other_spec} vs {spec}"
            raise ValueError(
                f"stack_trees: tree {index} differs in structure from tree 0 (hyperparameters included): "
                f"{difference} as in trees[0]; members must be built alike"
            )
        others.append(leaves)
    stacked = []
    for (path, first), *rest in zip(first_pairs, *others, strict=True):
        where = f"leaf {py_pytree.keystr(path)}" if path else "the leaf"
        for index, leaf in enumerate((first, *rest)):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"stack_trees: {where} of tree {index} is a {type(leaf).__name__}, not a tensor")
            if (leaf.shape, leaf.dtype, leaf.device) != (first.shape, first.dtype, first.device):
                raise ValueError(
                    f"stack_trees: {where} is {leaf.dtype}{list(leaf.shape)} on {leaf.device} in tree {index} "
                    f"but {first.dtype}{list(first.shape)} on {first.device} in tree 0; members must match"
                )
        stacked.append(torch.stack((first, *rest)))
    return cast(Tree, py_pytree.tree_unflatten(stacked, spec))


def unstack_tree(tree: Tree, index: int | torch.Tensor) -> Tree:
    """The `index`-th member of a tree stacked by `stack_trees` (a view of each leaf's slice).

    The leaves view the whole stack's storage, which `torch.save` writes out in full: clone the
    member (`tree_map(torch.clone, ...)`) to save it alone.

    Raises:
        TypeError: If `index` is neither an int nor a 0-dim integer tensor, or a leaf is not a tensor.
        ValueError: If a leaf is 0-dim (not stacked) or an int `index` is out of range for the stack.
        IndexError: From torch, for a tensor `index` out of range (checked where it is read).
    """
    if isinstance(index, torch.Tensor):  # e.g. losses.argmin(): torch checks its range on indexing
        if index.dim() != 0 or index.is_floating_point() or index.dtype == torch.bool:
            raise TypeError(
                f"unstack_tree: a tensor index must be a 0-dim integer, got {index.dtype} {tuple(index.shape)}"
            )
    elif isinstance(index, bool) or not hasattr(index, "__index__"):
        raise TypeError(f"unstack_tree: index must be an int, got {type(index).__name__}")
    leaves, spec = pytree.tree_flatten(tree)
    sizes = set()
    for position, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            key = py_pytree.keystr(py_pytree.tree_flatten_with_path(tree)[0][position][0])
            found = "a 0-dim tensor" if isinstance(leaf, torch.Tensor) else f"a {type(leaf).__name__}"
            error = ValueError if isinstance(leaf, torch.Tensor) else TypeError
            raise error(f"unstack_tree: tree{key} is {found}; pass a tree stacked by fmp.stack_trees")
        sizes.add(leaf.shape[0])
    if len(sizes) > 1:
        raise ValueError(f"unstack_tree: the leaves' leading sizes differ ({sorted(sizes)}): not one stack")
    if sizes and not isinstance(index, torch.Tensor) and not -min(sizes) <= operator.index(index) < min(sizes):
        raise ValueError(f"unstack_tree: index {index} is out of range for a stack of {min(sizes)}")
    return cast(Tree, pytree.tree_unflatten([leaf[index] for leaf in leaves], spec))
