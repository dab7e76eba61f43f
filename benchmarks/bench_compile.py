"""Compile time of a whole fmp step against torch.amp's `torch.compile(model)`, as a model deepens.

A language model from examples/zoo.py ("gpt2" or "llama", width 64: the graph's size, not its
arithmetic, sets the compile time) at each of --layers, compiled by two contenders:

  torch.amp compiled    torch.compile(model) under torch.autocast + GradScaler + AdamW(fused=True)
                        (Dynamo and Inductor see the forward and backward; the scaler and the
                        optimizer run eager)
  fmp donated           fmp.train_step with AdamW and donate=True, compiled whole by fmp.compile
                        (forward, backward, unscale, check, update and the skip's select in one graph;
                        a graph of more than 4000 calls has its C++ wrapper built at -O1 apart from
                        its kernels)
  fmp donated, wrapper together
                        the same with Inductor's cpp_wrapper_build_separate=False: wrapper and kernels
                        in one -O3 build, whatever the graph's size

Each contender runs in a subprocess of its own, twice on one new Inductor cache directory: "cold"
(an empty cache, so every kernel is generated and built) and "warm" (what a second run of the
same training script pays: Dynamo traces again, AOTAutograd and Inductor come from the cache).
Each row prints both first calls (the compile included), the warm call's Dynamo tracing and
Inductor's share of the cold one (`torch._dynamo.utils.compile_times()`), and the time per step
after it, with the step's ratio to torch.amp's.

    python benchmarks/bench_compile.py [--model gpt2] [--layers 2 12] [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_models
import torch
from _common import describe_machine
from _common import run_probe

CONTENDERS = {
    "torch.amp compiled": "amp",
    "fmp donated": "donated",
    "fmp donated, wrapper together": "donated-together",
}
BATCH = {"batch_size": 8, "seq_len": 64}


def _phase_seconds(name: str) -> float:
    """The seconds `torch._dynamo.utils.compile_times()` counted under `name` (0 if none)."""
    return float(sum(torch._dynamo.utils.compilation_time_metrics.get(name, [])))


def probe(model_name: str, layers: int, contender: str, steps: int) -> dict[str, float]:
    """In this (sub)process: the contender's first call, its compile phases, and its time per step."""
    zoo_case = bench_models.zoo.case(model_name)
    model = zoo_case.build(layers=layers, width=64).train()
    batches = bench_models.make_batches(zoo_case, BATCH, torch.device("cpu"), steps + 1)
    if contender == "amp":
        step = bench_models.torch_contender(model, torch.bfloat16, amp=True, compiled=True).step
    else:
        options = {"cpp_wrapper_build_separate": False} if contender == "donated-together" else {}
        step = bench_models.fmp_contender(model, torch.bfloat16, "cpu", mode="donated", options=options).step
    start = time.perf_counter()
    step(batches[0])
    first_call = time.perf_counter() - start
    start = time.perf_counter()
    for batch in batches[1:]:
        loss = step(batch)
    float(loss)  # the last step done
    return {
        "first_call_s": first_call,
        "dynamo_tracing_s": _phase_seconds("bytecode_tracing"),
        "inductor_s": _phase_seconds("compile_fx_inner"),
        "ms_per_step": (time.perf_counter() - start) / steps * 1e3,
        "params": float(sum(1 for p in model.parameters() if p.requires_grad)),
    }


def measure(model_name: str, layers: int, contender: str, steps: int) -> dict[str, dict[str, float]]:
    """The contender cold (an empty Inductor cache), then warm (the same cache), each in a new process."""
    command = [sys.executable, __file__, "--probe", contender, "--model", model_name]
    command += ["--layers", str(layers), "--steps", str(steps)]
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        return {when: run_probe(command, env) for when in ("cold", "warm")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    parser.add_argument("--steps", type=int, default=10, help="steps timed after the first call")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--probe", choices=list(CONTENDERS.values()), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.probe:
        print(json.dumps(probe(args.model, args.layers[0], args.probe, args.steps)))
        return
    print(describe_machine(torch.device("cpu")) + ", compute bfloat16")
    results: dict[int, Any] = {}
    for layers in args.layers:
        rows = {label: measure(args.model, layers, key, args.steps) for label, key in CONTENDERS.items()}
        results[layers] = rows
        reference = rows["torch.amp compiled"]["warm"]["ms_per_step"]
        params = int(rows["fmp donated"]["warm"]["params"])
        print(f"\n{args.model}, {layers} layers ({params} param tensors), width 64, batch 8 x 64")
        print(
            f"  {'contender':>29}  {'cold first call':>15}  {'Inductor':>8}  {'warm first call':>15}  "
            f"{'Dynamo':>6}  {'ms/step':>7}  {'ratio':>5}"
        )
        for label, row in rows.items():
            cold, warm = row["cold"], row["warm"]
            print(
                f"  {label:>29}  {cold['first_call_s']:13.1f} s  {cold['inductor_s']:6.1f} s  "
                f"{warm['first_call_s']:13.1f} s  {warm['dynamo_tracing_s']:4.1f} s  {warm['ms_per_step']:7.2f}  "
                f"{warm['ms_per_step'] / reference:5.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": describe_machine(torch.device("cpu")), "layers": results}))


if __name__ == "__main__":
    main()
