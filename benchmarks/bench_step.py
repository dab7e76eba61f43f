"""Step time of fmp against torch.amp on the seed recipe's network, measured side by side.

Runs torch.amp (autocast + GradScaler + SGD), fmp eager and fmp compiled (fullgraph) on the same
weights and batches, interleaving the contenders round by round so machine noise hits all alike,
and prints the median time per step and its ratio to torch.amp. Two CPU settings by default:
  matmul-bound:    3 x Linear(1024), batch 256, bfloat16 compute
  machinery-bound: 3 x Linear(1024), batch 8, float32 compute with dynamic loss scaling

    python benchmarks/bench_step.py [--steps 30 --rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from seed_recipe import make_model

Step = Callable[[torch.Tensor, torch.Tensor], object]


def torch_amp_step(model: nn.Module, dtype: torch.dtype) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    enabled = dtype != torch.float32

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return step


def fmp_step(model: nn.Module, policy: fmp.Policy, compiled: CompileCounterWithBackend | None) -> Step:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y.float())

    optimizer = fmp.optim.sgd(1e-3)
    train_step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss_fn, policy=policy, optimizer=optimizer
    )
    if compiled is not None:
        train_step = torch.compile(train_step, backend=compiled, fullgraph=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal state
        state, _ = train_step(state, x, y)

    return step


def time_steps(step: Step, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for x, y in data:
        step(x, y)
    return (time.perf_counter() - start) / len(data)


def run_setting(name: str, batch: int, width: int, dtype: torch.dtype, steps: int, rounds: int) -> None:
    torch.manual_seed(0)
    model = make_model(width, 3)
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(steps)]
    policy = fmp.Policy(torch.float32, dtype, torch.float32)
    counter = CompileCounterWithBackend("inductor")
    contenders: dict[str, Step] = {
        "torch.amp": torch_amp_step(make_model(width, 3).requires_grad_(True), dtype),
        "fmp eager": fmp_step(model, policy, None),
        "fmp compiled": fmp_step(model, policy, counter),
    }
    compile_seconds = 0.0
    for label, step in contenders.items():  # warm-up; the compiled step compiles here
        start = time.perf_counter()
        step(*data[0])
        if label == "fmp compiled":
            compile_seconds = time.perf_counter() - start
    times: dict[str, list[float]] = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, step in contenders.items():
            times[label].append(time_steps(step, data))
    reference = statistics.median(times["torch.amp"])
    print(f"\n{name}: 3 x Linear({width}), batch {batch}, compute {str(dtype).removeprefix('torch.')}")
    for label, samples in times.items():
        median = statistics.median(samples)
        print(f"  {label:>13}: {median * 1e3:8.3f} ms/step   ratio to torch.amp {median / reference:5.2f}")
    print(f"  fmp compiled: compile {compile_seconds:.1f} s, graphs compiled {counter.frame_count} (1 = no recompiles)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    run_setting("matmul-bound", 256, args.width, torch.bfloat16, args.steps, args.rounds)
    run_setting("machinery-bound", 8, args.width, torch.float32, args.steps, args.rounds)


if __name__ == "__main__":
    main()
