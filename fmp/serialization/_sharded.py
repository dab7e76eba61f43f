"""Sharded states (DTensors from FSDP2, several ranks) through torch.distributed.checkpoint, resharded on load."""

from __future__ import annotations

import contextlib
import hashlib
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
from fmp.serialization._header import current_treespec
from fmp.serialization._header import leaf_entries
from fmp.serialization._header import make_header
from fmp.serialization._structure import first_difference
from fmp.serialization._values import check_values

__all__ = ["HEADER_FILE", "load_sharded", "save_sharded"]

State = TypeVar("State")

HEADER_FILE = "fmp_checkpoint.json"
"""The file in a sharded checkpoint's directory that holds its header; written last, when the save is whole."""

_REPLICATED_SHA256 = "replicated_sha256"
_HEADER_SHA256 = "header_sha256"  # of the rest of the header, so that damage to it reads as corruption


def _header_digest(header: dict[str, Any]) -> str:
    rest = {key: value for key, value in header.items() if key != _HEADER_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _is_dtensor(leaf: torch.Tensor) -> bool:
    return type(leaf).__name__ == "DTensor"


def _digest(leaf: torch.Tensor) -> str:
    """The sha256 of a plain tensor's values (its bytes, row-major), on the host."""
    flat = leaf.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


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
    shapes and dtypes, a sha256 of each plain, replicated leaf and one of the header) first and writes it last, so
    a directory without it holds no finished save. Save each checkpoint to a fresh directory: one
    save over another that dies midway leaves neither whole. Without an initialized process group,
    one process writes the whole state.

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
        # Plain leaves are replicated (a loss scale, the counters; every leaf in one process): cheap
        # to check on load. DTensor shards are not checksummed: see load_sharded.
        header[_REPLICATED_SHA256] = {key: _digest(leaf) for key, leaf in entries if not _is_dtensor(leaf)}
        header[_HEADER_SHA256] = _header_digest(header)
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
    recorded = header.get(_HEADER_SHA256)  # absent from checkpoints written before fmp recorded it
    if recorded is not None and recorded != _header_digest(header):
        raise CheckpointError(
            f"checkpoint {directory} is truncated or corrupt (the sha256 of its {HEADER_FILE} does not match); "
            f"load an earlier checkpoint"
        )
    return header


def _skeleton(header: Any, directory: Path) -> Any:
    """The saved tree, rebuilt from the header with meta tensors of the saved global shapes and dtypes."""
    try:
        leaves = [
            torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for _, shape, dtype in header["leaves"]
        ]
        # Class names an earlier fmp wrote (fmp._state.TrainState) read as today's.
        return pytree.treespec_loads(current_treespec(header["treespec"])).unflatten(leaves)
    except (KeyError, TypeError, ValueError, AttributeError, NotImplementedError) as error:
        raise CheckpointError(
            f"checkpoint {directory} is truncated or corrupt ({HEADER_FILE}: {type(error).__name__}: {error}); "
            f"load an earlier checkpoint"
        ) from None


def _buffer(leaf: torch.Tensor, where: str, device: torch.device | str | None) -> torch.Tensor:
    """A fresh tensor for the loaded value, sharded as `leaf` is: the target itself is never written."""
    if not leaf.is_meta:
        return torch.empty_like(leaf)
    if _is_dtensor(leaf):
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

    What is checked: the header's own sha256 (for checkpoints that record it), then the header
    (format, structure, global shapes and dtypes) against `target`;
    that torch.distributed.checkpoint finds every shard it needs and can read it; every loss
    scale and counter's range; and, for checkpoints that record it, the sha256 of each leaf that
    was saved as a plain (replicated) tensor and is loaded into a plain one. What is not: the
    values of DTensor shards. Unlike `load`'s file, a flipped bit in a shard's data is not
    detected, and loads as a wrong value.

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
            newer format, or torch.distributed.checkpoint cannot read the data (its
            `CheckpointException`, a `BaseException`, included), or a replicated leaf's sha256
            does not match.
        ValueError: Naming the first leaf or node where `target` differs from the checkpoint, a
            meta DTensor in `target`, or the first loss-scale field or counter out of range.
    """
    # About a second to import: only when loading shards.
    from torch.distributed.checkpoint.api import CheckpointException
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
    # DCP's errors (a missing or short shard file) name what it could not read. Its CheckpointException
    # derives from BaseException, not Exception: name it, or it escapes `except Exception`.
    except (Exception, CheckpointException) as error:
        raise CheckpointError(
            f"checkpoint {directory} is truncated or corrupt ({type(error).__name__}: {_first_line(error)}); load an "
            f"earlier checkpoint"
        ) from None
    _check_replicated(header, buffers, directory)
    state = spec.unflatten(list(buffers.values()))
    try:
        check_values(state)
    except ValueError as error:
        raise ValueError(f"checkpoint {directory}: {error}") from None
    return state  # type: ignore[no-any-return]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"


def _check_replicated(header: dict[str, Any], buffers: dict[str, torch.Tensor], directory: Path) -> None:
    """Raises unless each plain leaf loaded whole has the sha256 the header recorded for it (if any)."""
    recorded = header.get(_REPLICATED_SHA256)
    if not isinstance(recorded, dict):  # written before fmp recorded them
        return
    for key, buffer in buffers.items():
        if key in recorded and not _is_dtensor(buffer) and _digest(buffer) != recorded[key]:
            raise CheckpointError(
                f"checkpoint {directory} is truncated or corrupt (the sha256 of state{key} does not match); load an "
                f"earlier checkpoint"
            )
