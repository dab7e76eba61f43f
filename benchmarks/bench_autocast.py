"""fmp.autocast vs torch.autocast: one transformer block's loss and gradients, eager and compiled.

Both run the same rule lists (fmp's rules="cpu" on CPU, rules="cuda" on CUDA, torch.autocast on
the same device type), so the ratio measures the mechanism, not different casting. Prints ms per
call and fmp's time as a ratio of torch's.

    python benchmarks/bench_autocast.py [--width 256] [--tokens 512] [--reps 20] [--no-compile]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import describe_machine
from _common import median_seconds
from torch import nn

from fmp.autocast import autocast


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    print(describe_machine(device), f"width={args.width} tokens={args.tokens} batch={args.batch} {dtype}")
    torch.manual_seed(0)
    model = Block(args.width).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(args.batch, args.tokens, args.width, device=device)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(torch.func.functional_call(model, params, (x,)), -1).mean()

    def torch_loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype):
            return loss(params, x)

    contenders: dict[str, Callable[..., Any]] = {
        "torch.autocast": torch.func.grad(torch_loss),
        "fmp.autocast": torch.func.grad(autocast(loss, dtype, rules=device.type)),
    }
    modes = [False] if args.no_compile else [False, True]
    for compiled in modes:
        times = {}
        for name, fn in contenders.items():
            step = torch.compile(fn, fullgraph=True) if compiled else fn
            times[name] = median_seconds(lambda step=step: step(params, x), device, args.reps)
        label = "compiled" if compiled else "eager"
        for name, seconds in times.items():
            print(f"{label:8s} {name:15s} {seconds * 1e3:8.2f} ms")
        print(f"{label:8s} fmp / torch     {times['fmp.autocast'] / times['torch.autocast']:8.2f}x")


if __name__ == "__main__":
    main()
