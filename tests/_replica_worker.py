"""One rank of test_replicas.py's process group: `python _replica_worker.py RANK WORLD PORT OUT`.

Joins a gloo group on loopback, runs every replica-agreement check in turn (each one raises on
both ranks, which stay in step), saves what it saw to OUT/replicas-RANK.pt, and then rank 1
exits early so that rank 0's next check meets a dead peer.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a rank: warnings are errors, as under pytest
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)

import torch  # after the warning filters, which must see torch's imports
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fmp
import fmp.distributed

DEAD_PEER_EXIT = 3
F32 = fmp.Policy()


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return sum((p.reshape(-1)[:1] * x).square().sum() for p in params.values())  # type: ignore[return-value]


def state_of(params: dict[str, torch.Tensor]) -> fmp.TrainState:
    return fmp.TrainState.create(params, fmp.optim.adamw(1e-2), fmp.DynamicLossScale.create(init_scale=2.0**10))


def step(state: fmp.TrainState, rank: int, policy: fmp.Policy = F32) -> fmp.TrainState:
    x = torch.full((2,), 1.0 + rank)
    new_state, _ = fmp.distributed.train_step(loss_fn, state, x, policy=policy, optimizer=fmp.optim.adamw(1e-2))
    return new_state


def error_of(run: Any) -> str | None:
    try:
        run()
    except ValueError as error:
        return str(error)
    return None


def counting_gathers(run: Any) -> tuple[Any, int]:
    """Runs `run` and counts the object gathers (the layout checks) it issues."""
    calls = 0
    original = dist.all_gather_object

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        return run(), calls
    finally:
        dist.all_gather_object = original


def scenario(rank: int, world: int) -> dict[str, Any]:
    """Ranks that disagree raise (both of them), ranks that agree train and check once."""
    results: dict[str, Any] = {}
    # Same size, other shape: an all-reduce would add w's rows to the other rank's columns.
    shape = (2, 3) if rank == 0 else (3, 2)
    results["shape"] = error_of(lambda: step(state_of({"b": torch.zeros(2), "w": torch.ones(shape)}), rank))
    # Other sizes: gloo would abort the process ("Received data size doesn't match").
    rows = 2 if rank == 0 else 4
    results["size"] = error_of(lambda: step(state_of({"w": torch.ones(rows, 3)}), rank))
    # Another dtype of the same size in bytes.
    dtype = torch.float32 if rank == 0 else torch.int32
    results["dtype"] = error_of(lambda: fmp.distributed.broadcast_tree({"w": torch.ones(3, dtype=dtype)}))
    # An extra leaf on rank 1, in the middle of the tree.
    params = {"a": torch.ones(2), "w": torch.ones(3)} | ({"extra": torch.ones(2)} if rank == 1 else {})
    results["extra"] = error_of(lambda: step(state_of(params), rank))
    results["extra_broadcast"] = error_of(lambda: fmp.distributed.broadcast_tree(params))
    # Another reduce dtype: the buckets would travel in other dtypes.
    policy = F32 if rank == 0 else fmp.get_policy("r=bf16")
    results["policy"] = error_of(lambda: step(state_of({"w": torch.ones(3)}), rank, policy))
    # Agreeing ranks train: the first step checks (one gather of a digest), later ones sync nothing.
    state = fmp.distributed.broadcast_tree(state_of({"w": torch.ones(2, 3), "b": torch.zeros(2)}))
    state, first = counting_gathers(lambda: step(state, rank))
    later = 0
    for _ in range(3):
        state, calls = counting_gathers(lambda: step(state, rank))  # noqa: B023 - run at once
        later += calls
    fmp.distributed.check_replicas(state)
    results["gathers"] = (first, later)
    results["state"] = state
    return results


def dead_peer(rank: int) -> dict[str, Any]:
    """Rank 1 has left: rank 0's next check (a new layout) fails at once, saying a rank died."""
    start = time.monotonic()
    try:
        step(state_of({"w": torch.ones(5)}), rank)
    except fmp.distributed.CollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    save = functools.partial(torch.save, f=out / f"replicas-{rank}.pt")
    results = scenario(rank, world)
    dist.barrier()
    if rank == 1:
        save(results)
        sys.stdout.flush()
        os._exit(DEAD_PEER_EXIT)
    results["dead_peer"] = dead_peer(rank)
    save(results)
    sys.stdout.flush()
    os._exit(0)  # the group lost a peer: its teardown could wait on it


if __name__ == "__main__":
    main()
