"""Saving and loading fmp's states: whole, atomic and checked, or sharded across ranks.

`save(state, path)` writes a state atomically (a crash mid-save leaves the previous file whole)
with a header and a sha256 checksum; `load(path, target)` reads it with
`torch.load(weights_only=True)`, refuses a truncated or corrupt file, a state that does not fit
`target` (naming the first differing leaf) and loss scales or counters out of range, and puts the
leaves on `target`'s devices. `save_sharded` and `load_sharded` save and restore states of
DTensors (FSDP2) through `torch.distributed.checkpoint`, resharding to the target's world size;
they check the structure, that every shard can be read, the loss scales' and counters' ranges and
a sha256 of each plain (replicated) leaf, but not the values of DTensor shards: a damaged shard
can load as wrong values.

Files name fmp's classes by their public names (`fmp.TrainState`); the names earlier fmp versions
wrote load as today's classes (`fmp._struct.LEGACY_NAMES`).

Plain `torch.save(state, path)` and `torch.load(path, weights_only=True)` also work: fmp's state
classes are allowed when fmp is imported, and `state_classes` lists them for a loader with an
allow-list of its own. Do not wrap a load in
`torch.serialization.safe_globals(fmp.serialization.state_classes())`: that context removes the
classes from torch's allow-list when it exits.
"""

from fmp._struct import state_classes
from fmp.serialization._file import load
from fmp.serialization._file import save
from fmp.serialization._header import CheckpointError
from fmp.serialization._sharded import load_sharded
from fmp.serialization._sharded import save_sharded

__all__ = ["CheckpointError", "load", "load_sharded", "save", "save_sharded", "state_classes"]
