"""One checkpoint file: written atomically with a checksum, read against a target state."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import socket
import tempfile
from pathlib import Path
from typing import Any
from typing import TypeVar

import torch
import torch.utils._pytree as pytree

from fmp.serialization._archive import bytes_outside_archive
from fmp.serialization._header import CheckpointError
from fmp.serialization._header import check_format
from fmp.serialization._header import current_treespec
from fmp.serialization._header import leaf_entries
from fmp.serialization._header import make_header
from fmp.serialization._structure import first_difference
from fmp.serialization._values import check_values

__all__ = ["atomic_write", "load", "place", "save"]

State = TypeVar("State")

_PARTIAL = ".partial"


def _checksum(header: dict[str, Any], leaves: list[torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for leaf in leaves:
        # Bytes of any dtype (bfloat16 has no numpy twin) through a uint8 view of a flat copy; the
        # values a conjugate or negative bit stands for, not the bytes beneath it.
        flat = leaf.resolve_conj().resolve_neg().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _host_copy(leaf: torch.Tensor, where: str) -> torch.Tensor:
    if leaf.is_meta:
        raise ValueError(f"{where} is on the meta device, which holds no values to save; save a materialized state")
    if leaf.layout != torch.strided or leaf.is_nested:
        kind = "a nested" if leaf.is_nested else f"a {leaf.layout}"
        raise TypeError(f"{where} is {kind} tensor; a state's leaves are dense tensors: save {where}.to_dense()")
    # resolve_conj/resolve_neg: a lazily conjugated complex leaf (`x.conj()`) has no uint8 view.
    leaf = leaf.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    # torch.save writes a view's whole storage: copy a slice out so the file holds only the state.
    if leaf.untyped_storage().nbytes() != leaf.numel() * leaf.element_size():
        leaf = leaf.clone()
    return leaf


def _partial_prefix(path: Path) -> str:
    return f".{path.name}.{socket.gethostname()}."


def _remove_stale_partials(path: Path) -> None:
    """Removes partial files a writer of `path` on this host left when it died mid-save."""
    prefix = _partial_prefix(path)
    for entry in os.scandir(path.parent):
        if not (entry.name.startswith(prefix) and entry.name.endswith(_PARTIAL)):
            continue
        # PID.TOKEN, the token mkstemp's (no dots): another checkpoint's name may start with this
        # one's and the host's (`ckpt.HOST.7`), and its partial files are not this one's.
        pid, _, token = entry.name[len(prefix) : -len(_PARTIAL)].partition(".")
        if not pid.isdigit() or not token or "." in token:
            continue
        try:
            os.kill(int(pid), 0)  # signal 0 only asks whether the process exists
        except ProcessLookupError:
            Path(entry.path).unlink(missing_ok=True)
        except PermissionError:  # another user's live process
            pass


def _umask() -> int:
    """The process's umask, read without changing it where the system tells (Linux), else set and restored."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _final_mode(path: Path) -> int:
    """The permissions `path` keeps if it exists, else those `open(path, "w")` gives (0o666 less the umask)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def atomic_write(path: Path, write: Any) -> None:
    """Calls `write(file)` on a partial file beside `path`, then moves it onto `path` durably.

    The partial file (`.NAME.HOST.PID.XXXX.partial`) is flushed and fsynced before `os.replace`, and
    the directory after it, so a crash leaves either the old file or the new one at `path`. The file
    gets the mode `torch.save` would give it (0o666 less the umask), or keeps the mode of the file
    it replaces; the partial file stays private (0o600) until it is whole.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path)
    mode = _final_mode(path)
    descriptor, partial = tempfile.mkstemp(
        prefix=f"{_partial_prefix(path)}{os.getpid()}.", suffix=_PARTIAL, dir=path.parent
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(file.fileno(), mode)
            else:  # pragma: no cover - Windows
                os.chmod(partial, mode)
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    if os.name == "posix":  # the rename itself reaches the disk once the directory is synced
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def save(state: Any, path: str | os.PathLike[str]) -> None:
    """Writes `state` (a `TrainState`, or any pytree of tensors) to the file `path`, atomically.

    The file is a `torch.save` of a dict: the state under "state", with its format version, fmp's
    version, the tree structure, each leaf's path, shape and dtype, and a sha256 checksum of them
    and the leaves' bytes. It is written to a partial file beside `path`, fsynced and moved onto
    `path`: a crash mid-save leaves the previous checkpoint whole. The leaves are saved on CPU;
    `torch.load(path, weights_only=True)["state"]` reads the state back without fmp's checks.

    Note: syncs with the host, to copy the leaves there and check the loss scales and counters.

    Args:
        state: The state; every leaf a dense tensor (not a DTensor: see `save_sharded`).
        path: The file to write; its directory is created if missing.

    Raises:
        TypeError: Naming the first leaf that is not a tensor, or is a DTensor, sparse or nested.
        ValueError: Naming a leaf on the meta device, or a loss-scale field or counter that `load`
            would refuse (out of range, or of another dtype than fmp's own states hold).
    """
    path = Path(path)
    entries, spec = leaf_entries(state, allow_dtensor=False)
    leaves = [_host_copy(leaf, f"state{key}") for key, leaf in entries]
    check_values(spec.unflatten(leaves))  # what load would refuse, refused before anything is written
    header = make_header(list(zip((key for key, _ in entries), leaves, strict=True)), spec)
    checkpoint = {**header, "sha256": _checksum(header, leaves), "state": spec.unflatten(leaves)}
    atomic_write(path, lambda file: torch.save(checkpoint, file))


def _first_sentence(message: str) -> str:
    """The first sentence of an error message (torch's zip errors add a paragraph of advice)."""
    message = message.strip()
    return message.splitlines()[0].split(". ", 1)[0] if message else "no data"


def _read(path: Path) -> Any:
    """The object in `path`, read with `torch.load(weights_only=True)` onto the CPU."""
    with open(path, "rb") as file:  # a missing file raises FileNotFoundError as it is
        try:
            checkpoint = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            # torch's message would suggest weights_only=False; name only what it found.
            reason = str(error).rsplit("WeightsUnpickler error:", 1)[-1].strip()
            unsupported = re.search(r"Unsupported global: GLOBAL (\S+)", reason)
            if unsupported:
                raise CheckpointError(
                    f"{path} is not an fmp checkpoint: it holds a {unsupported[1]}, which "
                    f"torch.load(weights_only=True) does not rebuild; write states with fmp.serialization.save"
                ) from None
            cause = f"UnpicklingError: {_first_sentence(reason)}"
        except Exception as error:  # a damaged file fails wherever the damage lies: in the zip, the pickle, a record
            cause = f"{type(error).__name__}: {_first_sentence(str(error))}"
        else:
            extra = bytes_outside_archive(file)
            if extra is None:
                return checkpoint
            cause = extra
    raise _corrupt(path, cause)


def _corrupt(path: Path, cause: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is truncated or corrupt ({cause}); load an earlier checkpoint, or save the state again"
    )


def _unwrap(checkpoint: Any, path: Path) -> Any:
    """The state in a checkpoint read from `path`, once its header and checksum agree with it."""
    check_format(checkpoint, str(path))
    try:
        return _verified_state(checkpoint, path)
    except CheckpointError:
        raise
    except Exception as error:  # damage that unpickled: a changed stride, field name or dtype fails anywhere here
        raise _corrupt(path, f"{type(error).__name__}: {_first_sentence(str(error))}") from None


def _verified_state(checkpoint: dict[str, Any], path: Path) -> Any:
    state = checkpoint.get("state")
    try:
        entries, spec = leaf_entries(state, allow_dtensor=False)
    except TypeError as error:
        raise _corrupt(path, str(error)) from None
    leaves = [leaf.contiguous() for _, leaf in entries]
    header = make_header(entries, spec)
    # The versions describe the writer, not the content; the rest must be what was written. Class
    # names an earlier fmp wrote into the treespec (fmp._state.TrainState) count as today's.
    mismatch = [key for key in ("format", "version", "leaves") if checkpoint.get(key) != header[key]]
    if current_treespec(checkpoint.get("treespec")) != current_treespec(header["treespec"]):
        mismatch.append("treespec")
    header = {**header, **{key: checkpoint.get(key) for key in ("fmp_version", "torch_version", "treespec")}}
    if mismatch or checkpoint.get("sha256") != _checksum(header, leaves):
        what = f"its header's {mismatch} disagree with its state" if mismatch else "the sha256 checksum does not match"
        raise _corrupt(path, what)
    return _independent(state)


def _independent(state: Any) -> Any:
    """`state` with leaves that require no grad and share no memory with one another.

    The checksum covers the values, not these: a damaged flag or storage key would otherwise load
    a leaf that requires grad, or two leaves over one buffer (a donated step would write both
    updates into it). A state that listed one tensor twice loads as two equal tensors, as the
    step's pure update would make them anyway.
    """
    seen: set[int] = set()

    def independent(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.detach()
        storage = leaf.untyped_storage().data_ptr()
        if storage == 0:  # no elements: nothing to share
            return leaf
        if storage in seen:
            return leaf.clone()
        seen.add(storage)
        return leaf

    return pytree.tree_map(independent, state)


def place(state: Any, target: Any, device: torch.device | str | None) -> Any:
    """`state`'s leaves in `target`'s structure, each on its target leaf's device (`device` for meta ones)."""
    by_path = dict((pytree.keystr(path), leaf) for path, leaf in pytree.tree_flatten_with_path(state)[0])
    flat, spec = pytree.tree_flatten_with_path(target)
    fallback = torch.device("cpu" if device is None else device)
    moved = [by_path[pytree.keystr(path)].to(fallback if leaf.is_meta else leaf.device) for path, leaf in flat]
    return spec.unflatten(moved)


def load(path: str | os.PathLike[str], target: State, *, device: torch.device | str | None = None) -> State:
    """Reads the state `save` wrote to `path`, checked against `target` and put on its devices.

    `target` gives the structure, shapes, dtypes and devices the state must have: build it as the
    run that saved it did (`TrainState.create`), or abstractly on the meta device, to restore
    without allocating twice. The file is read with `torch.load(weights_only=True)`.

    The loaded leaves are plain tensors: only the structure, shapes, dtypes and devices come from
    `target`, not its leaves' types or flags. An `nn.Parameter` in `target` comes back a plain
    tensor, and `requires_grad` is False; wrap or flag them again where a loop needs it. No two
    leaves share memory, so the state can be donated (a state that listed one tensor twice comes
    back with two equal tensors).

    Files of earlier fmp versions load as today's classes (`fmp._struct.LEGACY_NAMES`). A file
    written by plain `torch.save(state, path)` is refused, as not an fmp checkpoint: read it with
    `torch.load(path, weights_only=True)`, which rebuilds fmp's classes (earlier names included).

    Note: syncs with the host: reads the file, verifies its checksum, and validates every loss
    scale (`check_scaler_values`) and counter before the tensors move to their devices.

    Args:
        path: The checkpoint file.
        target: A state like the saved one; its values are not read, and not modified.
        device: Where leaves go whose target leaf is on the meta device (default: CPU).

    Returns:
        The saved state, in `target`'s structure, each leaf on its target leaf's device.

    Raises:
        FileNotFoundError: If `path` does not exist.
        CheckpointError: If the file is truncated or corrupt, is not an fmp checkpoint, or is of a
            newer format.
        ValueError: Naming the first leaf (path, saved and target shape and dtype) or node (keys,
            types, settings) where `target` differs from the checkpoint, or the first loss-scale
            field or counter out of range.
    """
    path = Path(path)
    state = _unwrap(_read(path), path)  # from here on, the state is the one that was saved
    problem = first_difference(state, target)
    if problem is not None:
        raise ValueError(f"checkpoint {path} does not fit the target: {problem}")
    try:
        check_values(state)
    except ValueError as error:
        raise ValueError(f"checkpoint {path}: {error}") from None
    return place(state, target, device)  # type: ignore[no-any-return]
