"""Saving and loading fmp's states.

`torch.save(state, path)` saves a `TrainState` (or any part of it) as it is, and
`torch.load(path, weights_only=True)`, torch's safe default, loads it: fmp's state classes are
allowed when fmp is imported. `state_classes` lists them for a loader with an allow-list of its own.
Do not wrap a load in `torch.serialization.safe_globals(fmp.serialization.state_classes())`: that
context removes the classes from torch's allow-list when it exits.
"""

from fmp._struct import state_classes

__all__ = ["state_classes"]
