"""What a checkpoint says about itself: format, versions, tree structure and each leaf's shape and dtype."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import torch
import torch.utils._pytree as pytree

from fmp._struct import current_name
from fmp._struct import state_classes

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "check_format",
    "current_treespec",
    "leaf_entries",
    "make_header",
    "spec_text",
]

FORMAT = "fmp.serialization"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: truncated, corrupt, not written by fmp, or by a newer fmp."""


def _fmp_version() -> str:
    try:
        return importlib.metadata.version("fmp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def leaf_entries(state: Any, *, allow_dtensor: bool) -> tuple[list[tuple[str, torch.Tensor]], pytree.TreeSpec]:
    """The leaves of `state` by key path (as `pytree.keystr` writes it), and its treespec.

    Raises:
        TypeError: Naming the first leaf that is not a tensor, or is a DTensor where `allow_dtensor` is false.
    """
    flat, spec = pytree.tree_flatten_with_path(state)
    entries = []
    for path, leaf in flat:
        where = f"state{pytree.keystr(path)}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where} is a {type(leaf).__name__}; every leaf of a saved state must be a tensor "
                f"(store a number as torch.tensor(x))"
            )
        if not allow_dtensor and _is_dtensor(leaf):
            raise TypeError(
                f"{where} is a DTensor (a sharded state): save it with fmp.serialization.save_sharded, "
                f"which writes every rank's shards"
            )
        entries.append((pytree.keystr(path), leaf))
    return entries, spec


def _is_dtensor(leaf: torch.Tensor) -> bool:
    return type(leaf).__name__ == "DTensor"


def spec_text(spec: pytree.TreeSpec) -> str:
    """The treespec as `pytree.treespec_dumps` writes it, or its repr for types registered without a name."""
    try:
        return pytree.treespec_dumps(spec)
    except (NotImplementedError, TypeError, ValueError):
        return repr(spec)


# The spec of an empty tuple, the default of the fields TrainState gained (`model_state`, `fp8`).
_EMPTY_TUPLE = {"type": "builtins.tuple", "context": "null", "children_spec": []}


def _padded(node: dict[str, Any]) -> dict[str, Any]:
    """A namedtuple node of fewer children than its class has fields, padded where the rest default to `()`.

    An earlier fmp wrote a TrainState before it gained trailing fields that default to `()`; the
    pickle loads with them, so the treespec it wrote counts as having them too.
    """
    cls = {f"{c.__module__}.{c.__qualname__}": c for c in state_classes()}.get(node["context"])
    fields = getattr(cls, "_fields", ())
    children = node.get("children_spec")
    if not isinstance(children, list) or len(children) >= len(fields):
        return node
    missing = fields[len(children) :]
    if any(getattr(cls, "_field_defaults", {}).get(name, None) != () for name in missing):
        return node
    return {**node, "children_spec": children + [_EMPTY_TUPLE] * len(missing)}


def _rename(node: Any) -> Any:
    if isinstance(node, list):
        return [_rename(child) for child in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rename(value) for key, value in node.items()}
    if isinstance(node.get("type"), str):
        node["type"] = current_name(node["type"])
    if node.get("type") == "collections.namedtuple" and isinstance(node.get("context"), str):
        node["context"] = current_name(node["context"])
        node = _padded(node)
    return node


def current_treespec(text: Any) -> Any:
    """A treespec as `spec_text` wrote it, with the class names earlier fmp versions wrote made current.

    Names in `fmp._struct.LEGACY_NAMES` (such as `fmp._state.TrainState`) become today's
    (`fmp.TrainState`), and a TrainState written before it gained a field that defaults to `()`
    has it; text that is not a JSON treespec comes back as it is.
    """
    if not isinstance(text, str):
        return text
    try:
        return json.dumps(_rename(json.loads(text)))
    except (json.JSONDecodeError, RecursionError):
        return text


def make_header(entries: list[tuple[str, torch.Tensor]], spec: pytree.TreeSpec) -> dict[str, Any]:
    """The metadata a checkpoint carries: format, versions, structure, and per leaf its path, shape, dtype."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "fmp_version": _fmp_version(),
        "torch_version": str(torch.__version__),
        "treespec": spec_text(spec),
        "leaves": [[path, list(leaf.shape), str(leaf.dtype).removeprefix("torch.")] for path, leaf in entries],
    }


def check_format(header: Any, where: str) -> None:
    """Raises unless `header` is a checkpoint header of a format version this fmp reads.

    Raises:
        CheckpointError: Naming what `where` holds instead, or the newer format's version.
    """
    if not (isinstance(header, dict) and header.get("format") == FORMAT):
        found = (
            f"a dict with keys {sorted(map(str, header))[:8]}" if isinstance(header, dict) else type(header).__name__
        )
        raise CheckpointError(
            f"{where} is not an fmp checkpoint (it holds {found}): write states with fmp.serialization.save, "
            f"and read other files with torch.load"
        )
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"{where} has checkpoint format version {version!r}, written by fmp {header.get('fmp_version')}; this "
            f"fmp reads versions up to {VERSION}: upgrade fmp to load it"
        )
