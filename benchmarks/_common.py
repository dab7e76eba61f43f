"""Timing and memory helpers shared by the benchmarks: medians of synchronized wall-clock times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
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


def describe_machine(device: torch.device) -> str:
    """torch's version and the device's name, for the first line of a benchmark's output."""
    if device.type == "cuda":
        return f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}"
    return f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads"
