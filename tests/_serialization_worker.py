"""Subprocesses of test_serialization.py.

    python _serialization_worker.py writer PATH               # saves a growing count to PATH until killed
    python _serialization_worker.py sharded RANK WORLD PORT DIR  # one gloo rank: save_sharded, load_sharded

Warnings are errors here too, as under pytest.
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":  # warnings are errors, as under pytest (which imports this module too)
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)

import torch  # after the warning filters, which must see torch's imports
import torch.distributed as dist
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fmp

WRITER_ELEMENTS = 4 * 2**20  # 16 MiB of float32: a save takes long enough to be killed midway


def writer_state(count: int) -> fmp.TrainState:
    """A state whose every param element and applied-step count is `count`."""
    state = fmp.TrainState.create(
        {"w": torch.full((WRITER_ELEMENTS,), float(count))}, fmp.optim.sgd(0.1), fmp.StaticLossScale.create(4.0)
    )
    return state._replace(counts=state.counts._replace(applied=torch.tensor(count)))


def reference_state() -> fmp.TrainState:
    """A state with nothing at its initial value: uneven rows (5 over 2 ranks), adamw moments, a moved scale."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(5, 4, generator=gen),
        "b1": torch.randn(5, generator=gen),
        "w2": torch.randn(3, 5, generator=gen),
    }
    moments = [pytree.tree_map(lambda p: torch.rand(p.shape, generator=gen), params) for _ in range(2)]
    scaler = fmp.DynamicLossScale(
        torch.tensor(2.0**7), torch.tensor(3, dtype=torch.int32), torch.tensor(1, dtype=torch.int32), growth_interval=10
    )
    state = fmp.TrainState.create(params, fmp.optim.adamw(1e-2), scaler)
    counts = fmp.StepCounts.zeros()._replace(applied=torch.tensor(7), skipped=torch.tensor(2))
    return state._replace(
        opt_state=state.opt_state._replace(
            step=torch.tensor(7, dtype=torch.int32), exp_avg=moments[0], exp_avg_sq=moments[1]
        ),
        counts=counts,
    )


def sharded_like(state: fmp.TrainState, mesh: object) -> fmp.TrainState:
    """`state` with params and moments split by rows over `mesh`, as fully_shard splits them."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    def shard(tree: object) -> object:
        return pytree.tree_map(lambda t: distribute_tensor(t, mesh, [Shard(0)]), tree)  # type: ignore[arg-type]

    opt = state.opt_state._replace(exp_avg=shard(state.opt_state.exp_avg), exp_avg_sq=shard(state.opt_state.exp_avg_sq))
    return state._replace(params=shard(state.params), opt_state=opt)


def writer(path: str) -> None:
    count = 0
    while True:
        count += 1
        fmp.serialization.save(writer_state(count), path)
        print(f"saved {count}", flush=True)


def sharded(rank: int, world: int, port: int, directory: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    try:
        mesh = init_device_mesh("cpu", (world,))
        reference = reference_state()
        fmp.serialization.save_sharded(sharded_like(reference, mesh), directory / "checkpoint")
        # Back on the same ranks, into zeros sharded alike: each rank gets its own rows.
        zeros = pytree.tree_map(torch.zeros_like, reference)
        loaded = fmp.serialization.load_sharded(directory / "checkpoint", sharded_like(zeros, mesh))
        full = pytree.tree_map(lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t, loaded)
        local_rows = loaded.params["w1"].to_local().shape[0]
        torch.save({"full": full, "local_rows": local_rows}, directory / f"result-{rank}.pt")
        dist.barrier()  # rank 0 holds the store: no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        writer(sys.argv[2])
    else:
        sharded(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
        sys.stdout.flush()
        # The results are on disk; interpreter shutdown with gloo's threads still winding down
        # aborts now and then ("terminate called without an active exception").
        os._exit(0)
