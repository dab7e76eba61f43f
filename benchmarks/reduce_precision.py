"""The accuracy of fmp.distributed's gradient average in each reduce dtype, for README's table.

Each of N ranks (gloo processes on the CPU) holds 65,536 N(0, 1) gradients of its own; they are
averaged by `fmp.distributed.all_reduce_gradients` in float32, bfloat16 and float16 (float16
scaled by 2**10, as the step sends it), and the result is compared with a float64 mean: the
relative L2 error, rank 0's print.

    python benchmarks/reduce_precision.py --ranks 2 4 8
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fmp
import fmp.distributed

SIZE = 1 << 16
DTYPES = ("float32", "bfloat16", "float16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _errors(rank: int, world: int) -> dict[str, float]:
    per_rank = [torch.randn(SIZE, generator=torch.Generator().manual_seed(50 + r)) for r in range(world)]
    exact = torch.stack([g.double() for g in per_rank]).mean(0)
    finite = torch.ones((), dtype=torch.bool)
    errors = {}
    for name in DTYPES:
        scale = torch.tensor(2.0**10) if name == "float16" else None
        gradients = fmp.Gradients({"g": per_rank[rank]}, finite, (), (), finite)
        reduced = fmp.distributed.all_reduce_gradients(gradients, policy=fmp.get_policy(f"r={name}"), loss_scale=scale)
        errors[name] = float((reduced.grads["g"].double() - exact).norm() / exact.norm())
    return errors


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        errors = _errors(rank, world)
        if rank == 0:
            torch.save(errors, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    print("| ranks | " + " | ".join(DTYPES) + " |")
    print("| --- |" + " --- |" * len(DTYPES))
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "errors.pt")
            mp.spawn(_worker, args=(world, _free_port(), out), nprocs=world)
            errors = torch.load(out)
        print(f"| {world} | " + " | ".join(f"{errors[name]:.1e}" for name in DTYPES) + " |")


if __name__ == "__main__":
    main()
