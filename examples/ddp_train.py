"""Data-parallel mixed precision: `fmp.distributed.train_step` over a gloo (CPU) or NCCL (GPU) group.

Each rank trains the same MLP on its own batches of a synthetic regression task, in bfloat16
compute with a dynamic loss scale. Gradients are averaged across ranks in the policy's reduce dtype
(float32 unless `--reduce` says otherwise) and the finite flags ride in the same all-reduce, so
when one rank's batch holds an inf (`--poison-step`, on the last rank only) every rank skips that
step and backs its scale off together. Ranks start from different random weights and
`fmp.distributed.broadcast_tree` gives them rank 0's, as DDP does. At the end every rank checks
that all replicas hold the same state bit for bit, and prints one line:

    rank R params checksum: X scale: S skipped: K

    torchrun --nproc_per_node=2 examples/ddp_train.py --steps 20 [--reduce bfloat16 --compile]
    torchrun --nproc_per_node=NUM_GPUS examples/ddp_train.py --device cuda   # NCCL, a GPU per rank

Run with plain `python`, it trains as a single rank.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fmp
import fmp.distributed


def make_model(width: int, layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = [nn.Linear(16, width), nn.GELU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def init_process_group(device_type: str, timeout_s: float) -> torch.device:
    """gloo (CPU) or NCCL (CUDA, one GPU per rank) over torchrun's environment; without it, a group of one.

    Returns:
        This rank's device.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device(device_type)
    if device_type == "cuda":
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= gpus:
            raise SystemExit(f"--device cuda needs a GPU per rank: local rank {local_rank}, {gpus} GPU(s) visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # device_id binds NCCL's communicator to this rank's GPU.
    bound = {"device_id": device} if device_type == "cuda" else {}
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, **bound)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound)
    return device


def batch(step: int, rank: int, size: int, teacher: torch.Tensor, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for `step`: its own draw of inputs, targets from a fixed linear teacher."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 16, generator=gen)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(size, 1, generator=gen)
    if poison:
        y[0] = float("inf")
    return x, y


def checksum(params: Any) -> str:
    """A float64 sum of every parameter, printed with all its digits: equal states print equal sums."""
    total = sum(p.double().sum() for p in torch.utils._pytree.tree_leaves(params))
    return f"{float(total):.17g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="examples per rank and step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--policy", default="p=f32,c=bf16,o=f32")
    parser.add_argument("--reduce", default=None, help="reduce dtype (default: the policy's, the param dtype)")
    parser.add_argument("--poison-step", type=int, default=3, help="step whose batch on the last rank holds an inf")
    parser.add_argument("--growth-interval", type=int, default=5, help="finite steps between scale growths")
    parser.add_argument("--log-every", type=int, default=5, help="steps between rank 0's loss lines")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    parser.add_argument("--compile", action="store_true", help="run the step compiled whole (fmp.compile)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    args = parser.parse_args()

    device = init_process_group(args.device, args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = fmp.get_policy(args.policy if args.reduce is None else f"{args.policy},r={args.reduce}")
    torch.manual_seed(rank)  # different weights on every rank until the broadcast
    model = make_model(args.width, args.layers).to(device)
    params = fmp.distributed.broadcast_tree({k: v.detach() for k, v in model.named_parameters()})
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))  # batches are drawn on the CPU

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (x,))
        return nn.functional.mse_loss(out.float(), y.float())

    optimizer = fmp.optim.adamw(args.lr)
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**12, growth_interval=args.growth_interval, device=device)
    state = fmp.TrainState.create(params, optimizer, scaler)
    step = functools.partial(fmp.distributed.train_step, loss_fn, policy=policy, optimizer=optimizer)
    if args.compile:
        step = fmp.compile(step)
    if rank == 0:
        backend, reduce_dtype = dist.get_backend(), policy.effective_reduce_dtype
        print(f"world {world} ({backend}), policy {policy}, reduce dtype {reduce_dtype}", flush=True)
    for i in range(args.steps):
        poison = i == args.poison_step and rank == world - 1
        x, y = batch(i, rank, args.batch, teacher, poison)
        if device.type == "cuda":  # from pinned memory the copy is queued, not waited for
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        state, info = step(state, x, y)
        if rank == 0 and (i % args.log_every == 0 or i == args.steps - 1):  # reading info syncs: only here
            print(f"step {i} loss (rank 0's batch) {float(info.loss):.4f} applied {bool(info.applied)}", flush=True)
    fmp.distributed.check_replicas(state)  # raises, naming the leaf, if the replicas drifted apart
    scale, skipped = float(state.scaler.loss_scale), int(state.counts.skipped)
    for r in range(world):  # one line per rank, in rank order
        if r == rank:
            line = f"rank {rank} params checksum: {checksum(state.params)} scale: {scale:g} skipped: {skipped}"
            print(line, flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
