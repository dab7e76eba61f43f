"""Setting up and checking replicas: one initial state on every rank, and a check that they still agree.

These run outside the step (once at start-up, or where you log) and read values on the host.
"""

from __future__ import annotations

from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fmp.distributed._reduce import _collective
from fmp.distributed._reduce import resolve_group

__all__ = ["broadcast_tree", "check_replicas"]

Tree = TypeVar("Tree")

_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _layout(tree: Any) -> list[str]:
    """One line per leaf: its path, and its dtype and shape (a tensor) or its repr."""
    lines = []
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        kind = f"{leaf.dtype}{list(leaf.shape)}" if isinstance(leaf, torch.Tensor) else repr(leaf)
        lines.append(f"{pytree.keystr(path)}: {kind}")
    return lines


def _check_same_layout(tree: Any, group: dist.ProcessGroup, world: int, caller: str) -> None:
    """Raises a ValueError naming the first leaf whose path, shape or dtype differs between ranks."""
    layouts: list[Any] = [None] * world
    _collective(lambda: dist.all_gather_object(layouts, _layout(tree), group=group), f"{caller}'s layout check", world)
    ranks = dist.get_process_group_ranks(group)
    reference = layouts[0]
    for rank, layout in zip(ranks[1:], layouts[1:], strict=True):
        if layout == reference:
            continue
        mismatch = next((i for i, (a, b) in enumerate(zip(reference, layout, strict=False)) if a != b), None)
        if mismatch is None:
            where = f"{len(reference)} leaves on rank {ranks[0]} but {len(layout)} on rank {rank}"
        else:
            where = f"rank {ranks[0]} has {reference[mismatch]} where rank {rank} has {layout[mismatch]}"
        raise ValueError(f"{caller}: the ranks hold trees of different layouts: {where}")


def broadcast_tree(tree: Tree, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Tree:
    """Returns `tree` with every tensor leaf copied from rank `src` of `group`, as DDP does at construction.

    Call it on every rank before training (on the params, or a whole `TrainState`) so all replicas
    start bit-identical; the data-parallel step keeps them so. It first checks that every rank
    holds a tree of the same paths, shapes and dtypes. The input is not modified.

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
    _check_same_layout(tree, group, world, "broadcast_tree")
    global_src = dist.get_global_rank(group, src)

    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        out = leaf.detach().clone()
        _collective(lambda: dist.broadcast(out, global_src, group=group), "broadcast", world)
        return out

    return cast(Tree, pytree.tree_map(copy, tree))


def _fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums per tensor over its raw bits (plain and position-weighted); wrap-around is deterministic."""
    rows = []
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        raw = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
        weights = torch.arange(1, raw.numel() + 1, dtype=torch.int64, device=raw.device)
        rows.append(torch.stack([raw.sum(), (raw * weights).sum()]))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64)
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
    _check_same_layout(tree, group, world, "check_replicas")
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
