"""Buffer donation, as `jax.jit`'s donate_argnums: results written into the tensors a caller hands over.

Compiled, a donated call copies its results into the donated tensors and Inductor turns the copy
into the store of the kernel that computes them (`donate_into`). Eager, a copy would be one more
pass, so the eager forms write in place where they can: a skipped step's select goes straight into
the donated buffers (`select_into`), whose pages are already mapped, instead of into fresh memory
that the CPU allocator may have to fault in.
"""

from __future__ import annotations

from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._tree import selectable_pairs

__all__ = [
    "check_distinct",
    "copy_aliases",
    "donate_into",
    "select_into",
    "storage_use_count",
    "writable",
    "writes_in_place",
]

Tree = TypeVar("Tree")


def check_distinct(donated: Any, name: str) -> list[Any]:
    """Raises a ValueError naming both leaves if `donated` lists one tensor twice; returns its leaves.

    Eager, also if two of its tensors share elements (one a view of the other, or two views of
    one buffer that meet), which would take two updates into one buffer.

    Leaves are compared with `is` within groups of equal shape, dtype and device (only those can be
    one tensor): Dynamo traces `is` without a guard, where `id()` would guard on each tensor's
    identity and recompile for every new set of tensors. Eager, a set of ids answers first; traced,
    a set of the tensors (Dynamo compares what it traced them as). The paths are only spelled out
    for the message.

    Returns:
        `donated`'s leaves, for the caller's further looks at them (a list of them is a tree too).
    """
    leaves = pytree.tree_leaves(donated)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not torch.compiler.is_compiling():
        if len({id(leaf) for leaf in tensors}) == len(tensors):
            _check_no_overlap(donated, leaves, name)
            return leaves
    elif len(set(tensors)) == len(tensors):
        # Dynamo takes a set of tensors by what it traced them as, with no guard on their identity.
        return leaves
    groups: dict[tuple[Any, ...], list[tuple[int, torch.Tensor]]] = {}
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        group = groups.setdefault((tuple(leaf.shape), leaf.dtype, leaf.device), [])
        for other_index, other in group:
            if other is leaf:
                paths = [f"{name}{py_pytree.keystr(path)}" for path, _ in py_pytree.tree_flatten_with_path(donated)[0]]
                raise ValueError(
                    f"donate=True needs distinct tensors, but {paths[other_index]} and {paths[index]} are one "
                    f"tensor (tied weights listed twice?): the step would write two updates into one buffer"
                )
        group.append((index, leaf))
    return leaves


def _element_bytes(x: torch.Tensor) -> torch.Tensor:
    """The address of each element of `x`'s first byte, relative to its storage, sorted."""
    offsets = torch.full((), int(x.storage_offset()), dtype=torch.int64)
    for size, stride in zip(x.shape, x.stride(), strict=True):
        offsets = offsets[..., None] + torch.arange(size) * stride
    return (offsets.reshape(-1) * x.element_size()).sort().values


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors over one storage have an element with a byte in common (exact, by enumeration)."""
    starts_a, starts_b = _element_bytes(a), _element_bytes(b)
    # An element of b begins inside one of a, or one of a inside one of b.
    before = torch.searchsorted(starts_a, starts_b, right=True) - 1
    inside_a = (before >= 0) & (starts_b < starts_a[before.clamp(min=0)] + a.element_size())
    before = torch.searchsorted(starts_b, starts_a, right=True) - 1
    inside_b = (before >= 0) & (starts_a < starts_b[before.clamp(min=0)] + b.element_size())
    return bool(inside_a.any() or inside_b.any())


def _span(x: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that `x` reaches, from its first element's first to its last's last (eager)."""
    extent = sum(int(size - 1) * int(stride) for size, stride in zip(x.shape, x.stride(), strict=True)) + 1
    start = int(x.storage_offset()) * x.element_size()
    return start, start + extent * x.element_size()


def _check_no_overlap(donated: Any, leaves: list[Any], name: str) -> None:
    """Raises naming two donated tensors that share an element: views made of one another or of one base.

    Eager only: storages cannot be read while Dynamo traces, nor through a torch.func transform's
    wrappers, under which nothing is written in place. Only views (`_base` set) are looked at, so
    a state without views costs one attribute read per leaf; tensors that share memory otherwise
    (one storage loaded twice, NumPy arrays over one buffer) are not seen. Tensors that are not
    written in place (expanded ones: `writable`) and views of one buffer whose elements do not
    meet (slices, column blocks, a complex tensor's real and imaginary parts) pass.
    """
    if torch._C._functorch.get_interpreter_stack():
        return
    views = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf._base is not None]
    if not views:
        return
    index_of = {id(leaf): index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    by_base: dict[int, list[int]] = {}
    for index in views:
        base = leaves[index]._base
        group = by_base.setdefault(id(base), [])
        if not group and id(base) in index_of:
            group.append(index_of[id(base)])  # the base itself, donated beside its view
        group.append(index)
    for group in by_base.values():
        members = [i for i in group if _plain(leaves[i]) and leaves[i].numel() and not leaves[i].is_meta]
        members = [i for i in members if writable(leaves[i])]
        spans = sorted((_span(leaves[i]), i) for i in members)
        active: list[tuple[int, int]] = []  # (end, index) of the spans met so far
        for (start, end), second in spans:
            for reach, first in active:
                if start < reach and _share_elements(leaves[first], leaves[second]):
                    paths = [f"{name}{py_pytree.keystr(p)}" for p, _ in py_pytree.tree_flatten_with_path(donated)[0]]
                    raise ValueError(
                        f"donate=True needs tensors that own their memory, but {paths[first]} and {paths[second]} "
                        f"share elements (one is a view of the other?): the step would write two updates into one "
                        f"buffer"
                    )
            active = [(reach, i) for reach, i in active if reach > start]
            active.append((end, second))


def writes_in_place(*trees: Any) -> bool:
    """Whether eager code may write in place into these tensors, or into temporaries made from them.

    A donated call writes into the donated tensors, and an optimizer into its own temporaries
    (saving their memory), where this holds. Not under torch.compile, where `donate_into` does it
    and Inductor fuses temporaries away; not under `torch.func` transforms, which need their inputs
    intact; not where autograd records any of the tensors (a write in place would cut its graph) or
    forward-mode AD may carry tangents, nor for inference tensors outside inference mode, which
    refuse writes, nor for tensor subclasses (a `DTensor`'s shards, say), whose storage and strides
    are not their values'. There a call makes new tensors, as a pure one does.

    Args:
        *trees: The trees whose tensors (or temporaries made from them) would be written; a list
            is walked as it is, so leaves already flattened are not flattened again.
    """
    # Inside a forward-mode AD level any tensor may carry a tangent, which out= forms refuse.
    if torch.compiler.is_compiling() or torch._C._functorch.get_interpreter_stack() or _forward_ad_active():
        return False
    # One pass, as cheap per tensor as it can be: an eager step asks this of every leaf of its state.
    recording, inference_mode = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    pending = list(trees)
    while pending:
        tree = pending.pop()
        in_list = type(tree) is list
        for x in tree if in_list else pytree.tree_leaves(tree):
            kind = type(x)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                if (recording and x.requires_grad) or (not inference_mode and x.is_inference()):
                    return False
            elif isinstance(x, torch.Tensor):
                return False
            elif in_list:
                pending.append(x)  # a list's element may be a tree itself
    return True


def _forward_ad_active() -> bool:
    return bool(torch.autograd.forward_ad._current_level >= 0)


def writable(x: torch.Tensor) -> bool:
    """Whether `x` can take a result in place: a strided tensor whose elements never share memory.

    Taken from sizes and strides, without sorting them (Dynamo cannot sort symbolic ones): each
    dimension's stride must step past everything the dimensions of smaller or equal stride
    reach. An expanded tensor (stride 0, as autograd returns the gradient of a `sum`) or an
    overlapping `as_strided` view is not writable (torch would refuse the first and write the
    second element by element, the last write winning); nor, conservatively, is a layout that
    interleaves dimensions without overlapping.
    """
    if x.layout != torch.strided:
        return False
    if x.is_contiguous():  # the usual case, answered without the walk below
        return True
    if any(size == 0 for size in x.shape):
        return True
    dims = [(stride, size) for stride, size in zip(x.stride(), x.shape, strict=True) if size > 1]

    def reach_below(i: int) -> Any:  # an int, or a SymInt under Dynamo
        stride_i = dims[i][0]
        return sum((size - 1) * stride for j, (stride, size) in enumerate(dims) if j != i and stride <= stride_i)

    return all(stride > reach_below(i) for i, (stride, _) in enumerate(dims))


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


def _memory(x: torch.Tensor) -> tuple[int, int]:
    """The addresses `x`'s storage spans, from its first byte to one past its last."""
    storage = x.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def storage_use_count(x: torch.Tensor) -> int:
    """How many references `x`'s storage has: its tensors (views and aliases included) and its Python object.

    Compare it with a probe's (a new tensor's), not with 1: the Python object that reading the
    storage makes holds a reference too.
    """
    return int(torch._C._storage_Use_Count(x.untyped_storage()._cdata))


def select_into(pred: torch.Tensor, on_true: Tree, donated: Tree) -> Tree:
    """`fmp.select_tree(pred, on_true, donated)`, written into `donated`'s tensors.

    For eager calls where `writes_in_place` holds, once `check_distinct` has passed on what the
    caller donated: each writable tensor of `donated` receives the chosen values (`torch.where`
    with `out=`), bit for bit `select_tree`'s; one that is not (`writable`) is replaced by a new
    tensor. A new value that is itself donated (an optimizer that keeps the previous params in its
    state) or a view of a donated tensor is copied before anything is written.

    Args:
        pred: A 0-dim bool tensor.
        on_true: The values picked where `pred` holds.
        donated: The tree handed over, picked elsewhere and overwritten with the result.

    Returns:
        `donated`'s tensors (new ones where not writable, and its non-tensor leaves), in
        `on_true`'s structure.

    Raises:
        ValueError: As `select_tree`, before anything is written.
    """
    spec, pairs = selectable_pairs(pred, on_true, donated)
    donated_storages = {_storage(b) for _, b in pairs if isinstance(b, torch.Tensor) and b.layout == torch.strided}

    def read_before_writes(a: Any, b: Any) -> Any:
        aliases = isinstance(a, torch.Tensor) and a is not b and a.layout == torch.strided
        return a.clone() if aliases and _storage(a) in donated_storages else a

    new_values = [read_before_writes(a, b) for a, b in pairs]
    selected = [
        torch.where(pred, a, b, out=b if writable(b) else None) if isinstance(a, torch.Tensor) else a
        for a, (_, b) in zip(new_values, pairs, strict=True)
    ]
    return cast(Tree, pytree.tree_unflatten(selected, spec))


def copy_aliases(tree: Tree, donated_leaves: list[Any]) -> Tree:
    """`tree` with a copy of each tensor that may share memory with a donated one.

    For results a donated call returns beside the donated state (a loss function's `aux` that hands
    back a param, a view of one or its `detach()`): copied before the writes, they keep the values
    they had. Eager, sharing is read from the memory the storages span, so a result that views a
    donated tensor's memory through another storage (a NumPy round trip) is copied too; a tensor
    subclass is left as it is (its storage need not be its values', and some cannot even be
    copied). Compiling, storages cannot be traced, and a detached view of a donated tensor keeps no
    link to it, so every tensor is copied: one copy of the loss and `aux` per step, which Inductor
    folds into the kernel that computes them where it can.

    Args:
        tree: The results to protect.
        donated_leaves: The leaves of the tree that will be overwritten (as `check_distinct` returns them).

    Returns:
        `tree`, with new tensors where its tensors may alias donated ones.
    """
    if torch.compiler.is_compiling():
        return cast(Tree, pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree))
    # A result that is not itself donated, whose storage torch allocated (not memory taken over from
    # NumPy, DLPack or a buffer, which another storage may hold too) and which no other tensor refers
    # to (the usual loss, made by the step) shares nothing: the donated memory is only looked at otherwise.
    donated_ids = {id(d) for d in donated_leaves}
    results = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and _plain(x)]
    alone = storage_use_count(torch.empty(()))  # the count of a storage with one tensor, measured the same way
    if all(
        id(x) not in donated_ids and x.untyped_storage().resizable() and storage_use_count(x) == alone for x in results
    ):
        return tree
    donated_memory = [_memory(d) for d in donated_leaves if isinstance(d, torch.Tensor) and _plain(d)]

    def may_alias(x: torch.Tensor) -> bool:
        if not _plain(x):
            return False
        start, end = _memory(x)
        return any(start < other_end and other_start < end for other_start, other_end in donated_memory)

    return cast(Tree, pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) and may_alias(x) else x, tree))


def _plain(x: torch.Tensor) -> bool:
    """Whether `x` is a plain strided tensor, whose storage holds its values."""
    return type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided


def donate_into(donated: Tree, new: Tree) -> Tree:
    """Writes `new` into the buffers of `donated` when compiling, once `check_distinct` has passed on them.

    Under torch.compile the copy is no extra pass: Inductor stores the result straight into the
    donated buffers, so nothing new is allocated. Eager, the tensors of `new` are returned as they
    are (a copy would only add work): eager callers write in place beforehand where they can.

    Args:
        donated: The tree of tensors the caller hands over.
        new: Its new values, of the same structure, shapes and dtypes.

    Returns:
        A tree with `new`'s values: `donated`'s tensors when compiling (`new`'s where a donated
        tensor is not `writable`), else `new` itself.
    """
    if not torch.compiler.is_compiling():
        return new
    donated_leaves, spec = pytree.tree_flatten(donated)
    written = [
        old.copy_(value) if isinstance(old, torch.Tensor) and writable(old) else value
        for old, value in zip(donated_leaves, pytree.tree_leaves(new), strict=True)
    ]
    return cast(Tree, pytree.tree_unflatten(written, spec))
