"""Sharded states (DTensors from FSDP2, several ranks) through torch.distributed.checkpoint, resharded on load."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fmp.serialization._file import atomic_write
from fmp.serialization._header import CheckpointError
from fmp.serialization._header import check_format
from fmp.serialization._header import leaf_entries
from fmp.serialization._header import make_header
from fmp.serialization._structure import first_difference
from fmp.serialization._values import check_values

__all__ = ["HEADER_FILE", "load_sharded", "save_sharded"]

State = TypeVar("State")

HEADER_FILE = "fmp_checkpoint.json"
"""The file in a sharded checkpoint's directory that holds its header; written last, when the save is whole."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_intended() -> Iterator[None]:
    """Silences DCP's warning that it runs in one process without a process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        yield


def save_sharded(state: Any, directory: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None) -> None:
    """Writes a state whose leaves may be DTensors (FSDP2's sharded params) to `directory`, from every rank.

    Every rank of `group` calls it with its own shards; `torch.distributed.checkpoint` writes each
    shard once and a replicated tensor (plain tensors: the loss scale, the counters) once in all.
    The group's rank 0 removes the header file (`fmp_checkpoint.json`: format, structure, global
    shapes and dtypes) first and writes it last, so a directory without it holds no finished
    save. Save each checkpoint to a fresh directory: one save over another that dies midway leaves
    neither whole. Without an initialized process group, one process writes the whole state.

    Note: syncs with the host and across the group (collectives and file writes).

    Args:
        state: The state; every leaf a tensor or DTensor.
        directory: The checkpoint's directory, on storage every rank writes to.
        group: The process group (default: the default group).

    Raises:
        TypeError: Naming the first leaf that is not a tensor, or if the tree has a node type
            registered without a serialized name (a load could not rebuild its structure).
    """
    # About a second to import: only when saving shards.
    from torch.distributed.checkpoint.state_dict_saver import save

    directory = Path(directory)
    entries, spec = leaf_entries(state, allow_dtensor=True)
    header = make_header(entries, spec)
    try:
        pytree.treespec_loads(header["treespec"])
    except (NotImplementedError, TypeError, ValueError, json.JSONDecodeError) as error:
        raise TypeError(
            f"the state's structure cannot be written for a sharded load ({error}); register its classes with a "
            f"serialized_type_name (torch.utils._pytree), or keep params in dicts"
        ) from None
    distributed = _distributed()
    writes_header = not distributed or dist.get_rank(group) == 0
    if writes_header:
        (directory / HEADER_FILE).unlink(missing_ok=True)
    with _single_process_intended():
        save(dict(entries), checkpoint_id=directory, process_group=group, no_dist=not distributed)
    if writes_header:
        atomic_write(directory / HEADER_FILE, lambda file: file.write(json.dumps(header, indent=1).encode()))
    if distributed:  # no rank returns (and perhaps loads) before the header is there
        dist.barrier(group)


def _read_header(directory: Path) -> Any:
    try:
        header = json.loads((directory / HEADER_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} holds no {HEADER_FILE}: no save_sharded finished writing there (interrupted, or another "
            f"format); load an earlier checkpoint"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {directory} is truncated or corrupt ({HEADER_FILE}: {error})") from None
    check_format(header, str(directory))
    return header


def _skeleton(header: Any, directory: Path) -> Any:
    """The saved tree, rebuilt from the header with meta tensors of the saved global shapes and dtypes."""
    try:
        leaves = [
            torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for _, shape, dtype in header["leaves"]
        ]
        return pytree.treespec_loads(header["treespec"]).unflatten(leaves)
    except (KeyError, TypeError, ValueError, AttributeError, NotImplementedError) as error:
        raise CheckpointError(
            f"checkpoint {directory} is truncated or corrupt ({HEADER_FILE}: {type(error).__name__}: {error}); "
            f"load an earlier checkpoint"
        ) from None


def _buffer(leaf: torch.Tensor, where: str, device: torch.device | str | None) -> torch.Tensor:
    """A fresh tensor for the loaded value, sharded as `leaf` is: the target itself is never written."""
    if not leaf.is_meta:
        return torch.empty_like(leaf)
    if type(leaf).__name__ == "DTensor":
        raise ValueError(
            f"target{where} is a DTensor on the meta device, whose shards have nowhere to go: materialize the "
            f"sharded target first (e.g. module.to_empty(device=...) before taking its params)"
        )
    return torch.empty(leaf.shape, dtype=leaf.dtype, device="cpu" if device is None else device)


def load_sharded(
    directory: str | os.PathLike[str],
    target: State,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> State:
    """Reads the state `save_sharded` wrote, resharded as `target`'s leaves are, on any number of ranks.

    Every rank of `group` calls it. `target` gives the structure, global shapes, dtypes and
    placement: a DTensor leaf receives its own shards (any mesh and world size), a plain tensor the
    whole value. A plain leaf on the meta device gets the value on `device`. `target` is not
    modified: the values go to fresh tensors.

    Note: syncs with the host and across the group; validates every loss scale and counter.

    Args:
        directory: The checkpoint's directory.
        target: A state like the saved one, sharded as the new run shards it.
        group: The process group (default: the default group; none needed in one process).
        device: Where plain leaves go whose target is on the meta device (default: CPU).

    Returns:
        The saved state, in `target`'s structure and placement.

    Raises:
        CheckpointError: If the directory holds no finished save, or its header is corrupt or of a
            newer format, or torch.distributed.checkpoint cannot read the data.
        ValueError: Naming the first leaf or node where `target` differs from the checkpoint, a
            meta DTensor in `target`, or the first loss-scale field or counter out of range.
    """
    # About a second to import: only when loading shards.
    from torch.distributed.checkpoint.state_dict_loader import load

    directory = Path(directory)
    header = _read_header(directory)
    problem = first_difference(_skeleton(header, directory), target)
    if problem is not None:
        raise ValueError(f"checkpoint {directory} does not fit the target: {problem}")
    flat, spec = pytree.tree_flatten_with_path(target)
    buffers = {pytree.keystr(path): _buffer(leaf, pytree.keystr(path), device) for path, leaf in flat}
    try:
        with _single_process_intended():
            load(dict(buffers), checkpoint_id=directory, process_group=group, no_dist=not _distributed())
    except Exception as error:  # DCP's errors (a missing or short shard file) name what it could not read
        raise CheckpointError(
            f"checkpoint {directory} is truncated or corrupt ({type(error).__name__}: {error}); load an earlier "
            f"checkpoint"
        ) from None
    state = spec.unflatten(list(buffers.values()))
    try:
        check_values(state)
    except ValueError as error:
        raise ValueError(f"checkpoint {directory}: {error}") from None
    return state  # type: ignore[no-any-return]
