"""Activation checkpointing: fmp.remat under torch.func against torch.utils.checkpoint, side by side.

The network is a stack of residual MLP blocks (LayerNorm, Linear(width, 4 width), GELU,
Linear(4 width, width)); each contender computes the gradients of an MSE loss once per step:

  torch autograd      nn.Module, loss.backward(), torch.autocast in 16-bit compute
  torch checkpoint    the same with each block in torch.utils.checkpoint(use_reentrant=False)
  torch.func.grad     torch.func.grad of the loss (float32): what fmp's step ran before it freed
                      activations in the backward pass
  fmp grad            fmp.mixed_precision_grad (torch.func.grad) over the same params
  fmp remat           the same with each block wrapped in fmp.remat

torch.utils.checkpoint cannot run under torch.func.grad at all ("saved tensor hooks"), so the peer
of `fmp remat` is torch's checkpoint under plain autograd, and the saving each one buys is its
ratio to its own unwrapped row.

Peak memory is what a step allocates on top of the params: on a GPU from torch.cuda's allocator
statistics; on CPU from the peak resident size (VmHWM) in a subprocess per contender whose malloc
returns every large block to the system, so resident size follows live tensors.

    python benchmarks/bench_remat.py [--device cuda] [--dtype bfloat16] [--layers 8 --width 512 --batch 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _common import describe_machine
from _common import median_seconds
from _common import synchronize
from torch import nn
from torch.utils.checkpoint import checkpoint

import fmp

LABELS = ["torch autograd", "torch checkpoint", "torch.func.grad", "fmp grad", "fmp remat"]


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, wrap: Callable[[nn.Module], Callable[..., torch.Tensor]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(width) for _ in range(layers))
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.blocks:
            x = x + self.wrap(layer)(x)
        return x


def torch_checkpointed(layer: nn.Module) -> Callable[..., torch.Tensor]:
    return lambda x: checkpoint(layer, x, use_reentrant=False)  # type: ignore[no-any-return]


def contender(label: str, args: argparse.Namespace, device: torch.device) -> Callable[[], object]:
    """One step of `label`: the gradients of the loss on a fixed batch."""
    torch.manual_seed(0)
    wraps = {"torch checkpoint": torch_checkpointed, "fmp remat": fmp.remat}
    model = Stack(args.layers, args.width, wraps.get(label, lambda layer: layer)).to(device)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randn(args.batch, args.width, device=device)
    dtype = getattr(torch, args.dtype)
    if label in ("torch autograd", "torch checkpoint"):

        def torch_step() -> object:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return grads

        return torch_step
    policy = fmp.get_policy(f"params=float32,compute={args.dtype},output=float32")
    params = {k: v.detach() for k, v in model.named_parameters()}
    scaler = fmp.NoOpLossScale.create()

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    if label == "torch.func.grad":
        return lambda: torch.func.grad(loss_fn)(params, x, y)
    return lambda: fmp.mixed_precision_grad(loss_fn, params, scaler, x, y, policy=policy).grads


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """What one step allocates at its peak (its returned gradients included)."""
    step()
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _kib("VmRSS")
    step()
    return (_kib("VmHWM") - before) * 1024


def cpu_peak(label: str, argv: list[str]) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable, __file__, *argv, "--memory-probe", label]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr}")
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="compute")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--memory-probe", metavar="LABEL", choices=LABELS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.memory_probe:
        print(json.dumps(peak_bytes(contender(args.memory_probe, args, device), device)))
        return

    argv = [f"--{k}={v}" for k, v in (("layers", args.layers), ("width", args.width), ("batch", args.batch))]
    argv.append(f"--dtype={args.dtype}")
    steps = {label: contender(label, args, device) for label in LABELS}
    seconds = {label: median_seconds(step, device, args.reps) for label, step in steps.items()}
    if device.type == "cuda":
        peaks = {label: peak_bytes(step, device) for label, step in steps.items()}
    else:
        peaks = {label: cpu_peak(label, argv) for label in LABELS}
    print(f"{describe_machine(device)}; {args.layers} blocks of width {args.width}, batch {args.batch}, {args.dtype}")
    print(f"{'contender':>18}  {'ms/step':>8}  {'peak MB':>8}  {'time vs unwrapped':>17}  {'mem vs unwrapped':>16}")
    for label in LABELS:
        base = "fmp grad" if label.startswith("fmp") else "torch autograd"
        print(
            f"{label:>18}  {seconds[label] * 1e3:8.2f}  {peaks[label] / 1e6:8.1f}  "
            f"{seconds[label] / seconds[base]:17.2f}  {peaks[label] / peaks[base]:16.2f}"
        )
    print(
        f"fmp grad / torch autograd: time {seconds['fmp grad'] / seconds['torch autograd']:.2f}x, "
        f"peak memory {peaks['fmp grad'] / peaks['torch autograd']:.2f}x"
    )
    print(
        f"fmp remat / torch checkpoint: time {seconds['fmp remat'] / seconds['torch checkpoint']:.2f}x, "
        f"peak memory {peaks['fmp remat'] / peaks['torch checkpoint']:.2f}x"
    )


if __name__ == "__main__":
    main()
