"""fmp's ambient state: what regions, module policies and plain-call scopes are active, per thread.

fmp's functions take their state as arguments; what is left is the bookkeeping of context managers
and of transforms that wrap calls (`fmp.autocast.autocast`, `fmp.autocast.module_policies`,
`fmp.remat.remat`), which lives here, in one thread-local object, as torch keeps `torch.autocast`'s
own state per thread. A thread that starts inside a region does not inherit it, as with
`torch.autocast`.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["AMBIENT"]


class _Ambient(threading.local):
    # Set up in each thread on first touch, so compiled code sees the lists from its first trace on
    # (a lazily added attribute would fail a guard and recompile once).
    def __init__(self) -> None:
        # The autocast regions active on this thread (fmp's own modes and native regions), innermost last.
        self.regions: list[Any] = []
        # The modules whose forwards the running `module_policies` calls have patched, outermost first.
        self.patched_modules: list[Any] = []
        # Whether rematerialized blocks call their function as it is (`fmp.remat.calling_plainly`).
        self.remat_plainly: bool = False


AMBIENT = _Ambient()
