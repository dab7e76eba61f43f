"""Setting up and checking replicas: one initial state on every rank, and a check that they still agree.

These run outside the step (once at start-up, or where you log) and read values on the host.
"""

from __future__ import annotations

import hashlib
from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fmp._struct import dataclass_fields
from fmp._tree_difference import tree_children
from fmp.distributed._reduce import _collective
from fmp.distributed._reduce import resolve_group

__all__ = ["broadcast_tree", "check_replicas"]

Tree = TypeVar("Tree")

_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _layout(tree: Any, prefix: str = "") -> list[tuple[str, str]]:
    """`(path, kind)` per leaf (its dtype and shape, or its repr) and per static field of fmp's states (its value).

    A static field (a scaler's growth interval, an accumulator's steps) lives in the treespec, not
    in a leaf: ranks that differ there would step apart without a collective noticing.
    """
    lines = []
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        kind = f"{leaf.dtype}{list(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
        lines.append((prefix + pytree.keystr(path), kind))
    lines.extend(_static_fields(tree, prefix))
    return lines


def _static_fields(node: Any, path: str) -> list[tuple[str, str]]:
    """`(path, repr)` of each static field of the `pytree_dataclass` states in `node`, depth first."""
    fields = dataclass_fields(type(node))
    lines = [] if fields is None else [(f"{path}.{name}", repr(getattr(node, name))) for name in fields[1]]
    for child_path, child in tree_children(node, path) or []:
        lines.extend(_static_fields(child, child_path))
    return lines


def _first_difference(mine: list[tuple[str, str]], theirs: list[tuple[str, str]], me: int, other: int) -> str:
    """The first leaf, in this rank's order, that the other rank lacks or holds with another kind; else the reverse."""
    their_kinds = dict(theirs)
    for path, kind in mine:
        if path not in their_kinds:
            return f"rank {me} has {path}: {kind} where rank {other} has no such leaf"
        if their_kinds[path] != kind:
            return f"rank {me} has {path}: {kind} where rank {other} has {path}: {their_kinds[path]}"
    my_paths = {path for path, _ in mine}
    extra = next(((path, kind) for path, kind in theirs if path not in my_paths), None)
    if extra is not None:
        return f"rank {me} has no leaf {extra[0]} where rank {other} has {extra[0]}: {extra[1]}"
    # The same leaves, in another order (a dict built in another order), which flattens differently.
    return f"rank {me} orders its leaves {[p for p, _ in mine]} where rank {other} orders them {[p for p, _ in theirs]}"


def check_same_layout(layout: list[tuple[str, str]], group: dist.ProcessGroup, world: int, caller: str) -> None:
    """Raises the same ValueError on every rank of `group` unless all hold `layout`, naming the first difference.

    A digest travels first (a few dozen bytes per rank); the layouts themselves only where the
    digests differ, so every rank takes the same branch and enters the same collectives.

    Args:
        layout: This rank's `(path, kind)` lines (`_layout`), and any other lines the ranks must agree on.
        group: The process group.
        world: Its size.
        caller: The public function's name, for the message.

    Raises:
        ValueError: On every rank, if the layouts differ: this rank's first differing leaf beside the other rank's.
        CollectiveError: If a gather fails (a rank died or timed out).
    """
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    digests: list[Any] = [None] * world
    _collective(lambda: dist.all_gather_object(digests, digest, group=group), f"{caller}'s layout check", world)
    if len(set(digests)) == 1:
        return
    layouts: list[Any] = [None] * world
    _collective(lambda: dist.all_gather_object(layouts, layout, group=group), f"{caller}'s layout check", world)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    other = next(index for index, theirs in enumerate(layouts) if theirs != layout)
    where = _first_difference(layout, layouts[other], ranks[me], ranks[other])
    raise ValueError(
        f"{caller}: the ranks hold trees of different layouts: {where}. Every rank must build the same "
        f"model, optimizer, scalers and policy, as with DDP; a collective over different layouts would sum "
        f"unrelated values or abort"
    )


def broadcast_tree(tree: Tree, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Tree:
    """Returns `tree` with every tensor leaf copied from rank `src` of `group`, as DDP does at construction.

    Call it on every rank before training (on the params, or a whole `TrainState`) so all replicas
    start bit-identical; the data-parallel step keeps them so. It first checks that every rank
    holds a tree of the same paths, shapes and dtypes, and states of the same settings (a
    scaler's growth interval, an accumulator's steps). The input is not modified; the copies are
    contiguous whatever the input's strides.

    Note:
        Syncs: the layout check goes through the host, and the broadcasts are waited for.

    Args:
        tree: A pytree whose tensor leaves are on the group backend's device.
        src: The source rank, within `group`.
        group: The process group; None for the default group.

    Returns:
        A tree of the same structure with new tensors holding rank `src`'s values.

    Raises:
        ValueError: If the ranks' trees differ in layout, or `src` is not a rank of `group`.
        RuntimeError: If no process group is initialized.
        CollectiveError: If a collective fails (a rank died or timed out).
    """
    group, world = resolve_group(group, "fmp.distributed.broadcast_tree")
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"broadcast_tree: src must be a rank of the group, in [0, {world}), got {src!r}")
    check_same_layout(_layout(tree), group, world, "broadcast_tree")
    global_src = dist.get_global_rank(group, src)

    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        # Contiguous on every rank: the broadcast copies raw storage, so strides must agree too.
        out = leaf.detach().clone(memory_format=torch.contiguous_format)
        _collective(lambda: dist.broadcast(out, global_src, group=group), "broadcast", world)
        return out

    return cast(Tree, pytree.tree_map(copy, tree))


# A 64-bit odd constant (2**64 over the golden ratio): position times it scatters the weights.
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64


def _fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Three int64 sums per tensor over its raw bits; wrap-around is deterministic.

    The plain sum, one weighted by position, and one weighted by a scrambled position: changes
    that cancel in the first two (+1, -2, +1 at neighbouring elements) do not in the third.
    """
    rows = []
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        raw = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
        positions = torch.arange(1, raw.numel() + 1, dtype=torch.int64, device=raw.device)
        scrambled = positions * _MIX
        scrambled = scrambled ^ (scrambled >> 29)
        rows.append(torch.stack([raw.sum(), (raw * positions).sum(), (raw * scrambled).sum()]))
    if not rows:
        return torch.zeros((0, 3), dtype=torch.int64)
    return torch.stack([row.to(rows[0].device) for row in rows])


def check_replicas(tree: Any, *, group: dist.ProcessGroup | None = None) -> None:
    """Raises unless every rank of `group` holds `tree` bit for bit (NaN payloads and signed zeros too).

    For tests and debugging a data-parallel run: replicas that drift apart (different data
    order in a random op, a rank that skipped a step) show up here, with the first leaf that differs.

    Note:
        Syncs: each tensor is fingerprinted on its device and the fingerprints are gathered on the
        host; it reads every tensor once.

    Args:
        tree: A pytree, e.g. a `TrainState`.
        group: The process group; None for the default group.

    Raises:
        ValueError: Naming the first leaf that differs, and the ranks, or the first difference in layout.
        RuntimeError: If no process group is initialized.
        CollectiveError: If a collective fails.
    """
    group, world = resolve_group(group, "fmp.distributed.check_replicas")
    check_same_layout(_layout(tree), group, world, "check_replicas")
    pairs = [(path, leaf) for path, leaf in pytree.tree_flatten_with_path(tree)[0] if isinstance(leaf, torch.Tensor)]
    local = _fingerprints([leaf for _, leaf in pairs])
    gathered = [torch.empty_like(local) for _ in range(world)]
    _collective(lambda: dist.all_gather(gathered, local, group=group), "check_replicas all-gather", world)
    ranks = dist.get_process_group_ranks(group)
    rows = torch.stack(gathered).cpu()
    for index, (path, _) in enumerate(pairs):
        differ = [rank for rank, row in zip(ranks, rows[:, index], strict=True) if not torch.equal(row, rows[0, index])]
        if differ:
            raise ValueError(
                f"check_replicas: tree{pytree.keystr(path)} differs between rank {ranks[0]} and ranks {differ}"
            )


# The (group, layout) pairs every rank of the group has agreed on, so that only a step with a new
# layout pays for the check. A group is known by its id: one created after another was destroyed
# may reuse it, which at worst skips a check the old group passed.
_AGREED_LAYOUTS: set[tuple[int, Any]] = set()


def check_step_layout(state: Any, group: dist.ProcessGroup | None, policy: Any, bucket_cap_mb: Any) -> None:
    """Raises on every rank unless all hold states of the same layout and step alike; once per layout and group.

    The data-parallel step's buckets follow from the params' shapes and dtypes, the number of
    scalers, the reduce dtype and the bucket size: ranks that differ in one of them would sum
    unrelated gradients (the same sizes) or abort inside the backend (other sizes). The first
    step with a given params layout on a group compares the ranks' whole states, policies and
    bucket sizes; later ones only look the params' layout up on the host. A rank whose layout
    changes later while the others keep theirs is not caught: its check's gather meets the
    others' all-reduce. Skipped
    while `torch.compile` traces: a compiled step relies on `broadcast_tree` or a first eager
    step having checked.

    Note:
        Syncs once per layout and group: one gather of a digest through the host (and one of the
        layouts where the digests differ). Later steps flatten the params on the host (0.25 ms for
        200 params on a CPU core, under 1% of that eager step) and sync nothing.

    Args:
        state: The step's `TrainState`.
        group: The data-parallel process group; None for the default group.
        policy: The step's precision policy (its reduce dtype sets the buckets' dtype).
        bucket_cap_mb: The step's bucket size.

    Raises:
        ValueError: On every rank, naming the first leaf (or setting) that differs and both ranks' values.
        RuntimeError: If no process group is initialized.
        CollectiveError: If the gathers fail (a rank died or timed out).
    """
    if torch.compiler.is_compiling():
        return
    resolved, world = resolve_group(group, "fmp.distributed.train_step")
    # The key covers what the buckets follow from (the params' layout, the number of scalers and the
    # settings): flattening the whole state every step would cost several times as much.
    leaves, spec = pytree.tree_flatten(state.params)
    kinds = tuple((leaf.dtype, leaf.shape) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in leaves)
    scalers = len(state.scaler) if isinstance(state.scaler, tuple) else 1
    settings = [("policy", repr(policy)), ("bucket_cap_mb", repr(bucket_cap_mb))]
    key = (id(resolved), (spec, kinds, scalers, tuple(settings)))
    if key in _AGREED_LAYOUTS:
        return
    layout = [*_layout(state, "state"), *settings]
    check_same_layout(layout, resolved, world, "fmp.distributed.train_step")
    _AGREED_LAYOUTS.add(key)
