"""Timing and memory helpers shared by the benchmarks: medians of synchronized wall-clock times."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall-clock time of `fn()` over `reps` calls, each synchronized with the device.

    Args:
        fn: The work to time.
        device: Where `fn` queues its work.
        reps: Timed calls.
        warmup: Untimed calls first.

    Returns:
        Seconds per call.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def tree_bytes(tree: Any) -> int:
    """Bytes held by the distinct tensor leaves of `tree`."""
    seen: dict[int, int] = {}
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            seen[id(leaf)] = leaf.numel() * leaf.element_size()
    return sum(seen.values())


# A CPU peak-memory probe runs in a subprocess whose malloc hands every block of 64 KiB or more back
# to the system when freed, so the resident size follows the live tensors.
CPU_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_free_heap() -> None:
    """Hands the free pages of malloc's heap back to the system (glibc), so that none is reused unseen."""
    # Not glibc (no malloc_trim): the resident size then depends on what was freed before.
    with contextlib.suppress(AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def cpu_peak_bytes(step: Callable[[], object], state: Callable[[], Any]) -> int:
    """Bytes of `state()` plus the most two calls of `step` raise the resident size (Linux, CPU_MEMORY_ENV).

    The heap's free pages are handed back first: memory an earlier compile freed would otherwise take
    some of the step's small allocations unseen, and by how much would depend on what ran before.
    """
    gc.collect()
    _release_free_heap()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _resident_kib("VmRSS")
    for _ in range(2):
        step()
    return tree_bytes(state()) + (_resident_kib("VmHWM") - before) * 1024


def run_probe(command: list[str], env: Mapping[str, str]) -> Any:
    """Runs a probe subprocess and returns the JSON on its last line of output."""
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def describe_machine(device: torch.device) -> str:
    """torch's version and the device's name, for the first line of a benchmark's output."""
    if device.type == "cuda":
        return f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}"
    return f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads"
