"""Step time, peak memory and compile time of fmp against torch.amp on real models from examples/zoo.py.

Models: the zoo's "resnet_cnn" (convolutions, BatchNorm running statistics as model state),
"gpt2" and "llama" (transformers causal LMs), at CPU sizes by default and at GPU sizes with
`--device cuda` (see SIZES). Every contender trains its own copy of the model from the same
weights on the same batches, AdamW (lr 1e-3, weight decay 1e-2); the contenders take turns round
by round (the order rotating each round) so machine noise hits all alike, or with --interleave
step by step within each round (steadier where the noise comes in bursts shorter than a round,
though each contender then runs with the others' data in the caches). Each row prints the
median time per step over the rounds and its ratio to torch.amp eager (eager rows; the fused
row to torch.amp's fused row) or to torch.amp compiled (compiled rows), then the same for the
best round (on a shared machine, where other processes slow some rounds several-fold, the best
rounds show what a step costs on its own):

  fp32                    plain float32 training, torch.optim.AdamW (no autocast, no scaler)
  torch.amp eager         torch.autocast + GradScaler + torch.optim.AdamW (its default, a loop
                          over the params, on a CPU; fused=True on CUDA)
  torch.amp eager, fused  CPU only: the same with AdamW(fused=True), one kernel for every param
                          that takes the scale and the inf flag
  torch.amp compiled      torch.compile(model) under torch.autocast + GradScaler + AdamW(fused=True),
                          which takes the scale and the inf flag into its kernel: the peer of
                          compiled fmp, as torch.amp loops are compiled (the model; GradScaler
                          and the optimizer run eager)
  fmp eager               fmp.train_step, eager, with the device's own rules ("cpu" on a CPU runs
                          the loss function inside torch.autocast("cpu") itself)
  fmp eager, fused        the same with fmp.optim.adamw(fused=True): torch's fused kernel, which
                          skips inside itself; its ratio is to torch.amp eager, fused on a CPU
  fmp eager, cuda rules   CPU only: the default rules ("cuda"), applied op by op by fmp.autocast's
                          Python mode
  fmp compiled            fmp.train_step compiled whole by fmp.compile, the device's rules
  fmp donated             the same with donate=True (the update is written into the old buffers)
  fmp donated, torch.compile
                          the same compiled by torch.compile(fullgraph=True): Dynamo's guards on
                          the identity of what the trace reached through fmp's modules, which
                          fmp.compile drops; on a CPU the graph's Python wrapper, which
                          fmp.compile generates as C++ there (cpp_wrapper); and max pooling's
                          argmax recomputed in the backward kernel, where fmp.compile's
                          RealizePoolIndices pass has Inductor write it once. On an AVX-512 CPU with
                          torch 2.13 the Python wrapper's build was seen to compute wrong BatchNorm
                          gradients for resnet_cnn (docs/how-to/performance-tuning.md): its last
                          loss shows it
  fmp eager, float32 attention
  fmp donated, float32 attention
                          CPU only: fmp eager and fmp donated with the CPU rules changed for one op,
                          scaled_dot_product_attention kept in float32 (Policy.with_overrides, so
                          eager on fmp's per-op mode): torch 2.13's bfloat16 attention kernel on a
                          CPU is several times slower than its float32 one. A recipe of fmp's, where
                          torch.amp would need the model's attention code changed; on resnet_cnn,
                          which has no attention, only the eager mode's cost shows

The compute dtype is bfloat16 on a CPU and float16 on CUDA (torch.amp's usual GPU recipe, where
loss scaling matters); --dtype overrides it. Compiled rows also print their first call's time
(compile included; Inductor's caches are on disk, so set TORCHINDUCTOR_CACHE_DIR=<empty dir> for
cold figures) and the graphs Dynamo compiled over all their calls: 1 for a whole step, or a
forward without graph breaks, that never recompiles. Peak memory is the contender's state kept
between steps (params, optimizer state, scaler) plus the most one step allocates on top of what was
allocated before it: on CUDA from torch.cuda.max_memory_allocated; on a CPU from the peak resident
size (VmHWM) over two steps, in a subprocess that builds the contenders anew and whose malloc hands
every freed block of 64 KiB or more back to the system (MALLOC_MMAP_THRESHOLD_), and that first
hands back its heap's free pages (malloc_trim), so that resident size follows the live tensors and
not what the contenders before it (or their compiles) left free.
The last column is each contender's loss at its last step, on the same batches for all, as a check
that they train alike.

--machinery keeps each model's params and buffers but replaces its forward with the sum of each
param's squares, so that a step is nearly all machinery (the scaler, the optimizer, the step's
checks and bookkeeping over that model's tensors): it times what the library adds to a step, with
the eager rows only, and far less noise than the model's own time carries on a shared machine.

--skip-guards times the rounds (after the warm-up steps) under
torch.compiler.set_stance("default", skip_guard_eval_unsafe=True): every compiled row, torch.amp's
included, then runs its graph without Dynamo's guard check before each call (safe here: the same
models and batch shapes throughout).

    python benchmarks/bench_models.py [--device cuda] [--models gpt2 llama] [--steps 10 --rounds 5]
                                      [--interleave] [--machinery] [--skip-guards] [--threads 2]
                                      [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import CPU_MEMORY_ENV
from _common import cpu_peak_bytes
from _common import describe_machine
from _common import run_probe
from _common import synchronize
from _common import tree_bytes
from torch import nn
from torch._dynamo.utils import counters

import fmp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import zoo

LR = 1e-3
Batch = tuple[torch.Tensor, ...]

# (build sizes, batch sizes) per device type and model. GPU: the zoo's GPT-2 has 128 positions,
# so its batches are 32 x 128 tokens (4,096 a batch, as 16 x 256).
_LM_GPU = {"layers": 6, "width": 768, "heads": 12, "vocab": 8192}
SIZES: dict[str, dict[str, tuple[dict[str, int], dict[str, int]]]] = {
    "cpu": {
        "resnet_cnn": ({"width": 16}, {"batch_size": 16, "image_size": 32}),
        "gpt2": ({"layers": 2, "width": 64}, {"batch_size": 8, "seq_len": 64}),
        "llama": ({"layers": 2, "width": 64}, {"batch_size": 8, "seq_len": 64}),
    },
    "cuda": {
        "resnet_cnn": ({"width": 64}, {"batch_size": 128, "image_size": 32}),
        "gpt2": (_LM_GPU, {"batch_size": 32, "seq_len": 128, "vocab": 8192}),
        "llama": (_LM_GPU, {"batch_size": 32, "seq_len": 128, "vocab": 8192}),
    },
}
# The CPU rules with attention kept in float32: torch's bfloat16 attention kernel is the slower there.
FLOAT32_ATTENTION = {"scaled_dot_product_attention": torch.float32}
EAGER_REF, COMPILED_REF = "torch.amp eager", "torch.amp compiled"  # the rows ratios divide by
FUSED_REF = "torch.amp eager, fused"  # CPU: the peer of fmp's fused optimizer (CUDA's eager row is fused)


@dataclasses.dataclass
class Contender:
    step: Callable[[Batch], torch.Tensor]  # one training step; returns the loss (on device)
    state: Callable[[], Any]  # what the contender keeps between steps
    compiled: bool = False
    reference: str = EAGER_REF  # the torch.amp row its ratios divide by
    first_call: float = 0.0  # seconds of the first step, compile included
    graphs: int = 0  # graphs Dynamo compiled in this contender's calls (a recompile adds one)
    times: list[float] = dataclasses.field(default_factory=list)  # seconds per step, one per round
    loss: float = float("nan")


def torch_contender(
    model: nn.Module, dtype: torch.dtype, *, amp: bool, compiled: bool, fused: bool = False
) -> Contender:
    device_type = next(model.parameters()).device.type
    params = [p for p in model.parameters() if p.requires_grad]
    fused = True if fused or compiled or device_type == "cuda" else None
    optimizer = torch.optim.AdamW(params, lr=LR, fused=fused)
    scaler = torch.amp.GradScaler(device_type, enabled=amp)
    forward = torch.compile(model) if compiled else model

    def step(batch: Batch) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype, enabled=amp):
            loss = forward(*batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    reference = COMPILED_REF if compiled else EAGER_REF
    return Contender(step, lambda: (params, optimizer.state, scaler.state_dict()), compiled, reference)


def fmp_contender(
    model: nn.Module,
    dtype: torch.dtype,
    rules: str,
    *,
    mode: str | None,
    fused: bool = False,
    options: dict[str, Any] | None = None,
    overrides: dict[str, torch.dtype] | None = None,
) -> Contender:
    """fmp.train_step: `mode` None (eager), "compiled" or "donated" (donate=True) by fmp.compile with Inductor
    `options`, or "torch.compile" (donated, by torch.compile(fullgraph=True)); `overrides` change the policy's
    `rules` op by op (`Policy.with_overrides`)."""
    device = next(model.parameters()).device
    params, buffers = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *batch: torch.Tensor) -> Any:
        return fmp.nn.call(model, params, buffers, *batch)

    compute = str(dtype).removeprefix("torch.")
    policy = fmp.get_policy(f"params=float32,compute={compute},output=float32,rules={rules}")
    if overrides:
        policy = policy.with_overrides(overrides)
    optimizer = fmp.optim.adamw(LR, fused=fused)
    scaler = fmp.DynamicLossScale.create(device=device)
    state = fmp.TrainState.create(params, optimizer, scaler, model_state=buffers)
    train_step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=mode in ("donated", "torch.compile")
    )
    if mode == "torch.compile":
        train_step = torch.compile(train_step, fullgraph=True)
    elif mode is not None:
        train_step = fmp.compile(train_step, options=options)

    def step(batch: Batch) -> torch.Tensor:
        nonlocal state
        state, info = train_step(state, *batch)
        return info.loss  # type: ignore[no-any-return]

    compiled = mode is not None
    reference = COMPILED_REF if compiled else FUSED_REF if fused and device.type == "cpu" else EAGER_REF
    return Contender(step, lambda: state, compiled, reference)


def build_contenders(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, Contender]:
    """Every contender, each with its own deep copy of `model` (the same weights for all)."""

    def fresh() -> nn.Module:
        return copy.deepcopy(model).to(device).train()

    rules = "cpu" if device.type == "cpu" else "cuda"
    contenders = {
        "fp32": torch_contender(fresh(), dtype, amp=False, compiled=False),
        EAGER_REF: torch_contender(fresh(), dtype, amp=True, compiled=False),
        COMPILED_REF: torch_contender(fresh(), dtype, amp=True, compiled=True),
        "fmp eager": fmp_contender(fresh(), dtype, rules, mode=None),
    }
    if device.type == "cpu":
        contenders[FUSED_REF] = torch_contender(fresh(), dtype, amp=True, compiled=False, fused=True)
    contenders["fmp eager, fused"] = fmp_contender(fresh(), dtype, rules, mode=None, fused=True)
    if device.type == "cpu":
        contenders["fmp eager, cuda rules"] = fmp_contender(fresh(), dtype, "cuda", mode=None)
    contenders["fmp compiled"] = fmp_contender(fresh(), dtype, rules, mode="compiled")
    contenders["fmp donated"] = fmp_contender(fresh(), dtype, rules, mode="donated")
    contenders["fmp donated, torch.compile"] = fmp_contender(fresh(), dtype, rules, mode="torch.compile")
    if device.type == "cpu":
        contenders["fmp eager, float32 attention"] = fmp_contender(
            fresh(), dtype, rules, mode=None, overrides=FLOAT32_ATTENTION
        )
        contenders["fmp donated, float32 attention"] = fmp_contender(
            fresh(), dtype, rules, mode="donated", overrides=FLOAT32_ATTENTION
        )
    return contenders


class Machinery(nn.Module):
    """A model's params and buffers with a forward that reads each trainable param once: a step of machinery."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        squares = [(p * p).sum() for p in self.model.parameters() if p.requires_grad]
        return torch.stack(squares).sum() * 1e-3


def make_batches(zoo_case: zoo.ZooCase, sizes: dict[str, int], device: torch.device, steps: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    batches = [zoo_case.batch(generator, **sizes) for _ in range(steps)]
    return [tuple(t.to(device) for t in batch) for batch in batches]


def run_steps(contender: Contender, batches: list[Batch], device: torch.device) -> float:
    """Seconds per step over `batches`, synchronized; counts the graphs compiled meanwhile."""
    graphs = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    for batch in batches:
        loss = contender.step(batch)
    synchronize(device)
    seconds = (time.perf_counter() - start) / len(batches)
    contender.graphs += counters["stats"]["unique_graphs"] - graphs
    contender.loss = float(loss)
    return seconds


def gpu_peak_bytes(contender: Contender, batch: Batch, device: torch.device) -> int:
    gc.collect()
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    contender.step(batch)
    synchronize(device)
    return tree_bytes(contender.state()) + torch.cuda.max_memory_allocated(device) - before


def model_contenders(
    model: nn.Module, device: torch.device, dtype: torch.dtype, machinery: bool
) -> dict[str, Contender]:
    """The contenders for `model`: every one, or with `machinery` the eager ones on its machinery."""
    contenders = build_contenders(Machinery(model) if machinery else model, device, dtype)
    if not machinery:
        return contenders
    eager = (EAGER_REF, FUSED_REF, "fmp eager", "fmp eager, fused")
    return {label: c for label, c in contenders.items() if label in eager}


def memory_probe(name: str, dtype: torch.dtype, machinery: bool) -> dict[str, int]:
    """Runs in a subprocess on CPU: each contender's peak bytes, measured one after another."""
    device = torch.device("cpu")
    zoo_case = zoo.case(name)
    build_sizes, batch_sizes = SIZES["cpu"][name]
    contenders = model_contenders(zoo_case.build(**build_sizes), device, dtype, machinery)
    batch = make_batches(zoo_case, batch_sizes, device, 1)[0]
    peaks = {}
    for label, contender in contenders.items():
        for _ in range(2):  # compiles, and allocates what the contender keeps
            contender.step(batch)
        peaks[label] = cpu_peak_bytes(functools.partial(contender.step, batch), contender.state)
    return peaks


def cpu_peaks(name: str, dtype: torch.dtype, machinery: bool) -> dict[str, int]:
    command = [sys.executable, __file__, "--memory-probe", name, "--dtype", str(dtype).removeprefix("torch.")]
    if machinery:
        command.append("--machinery")
    peaks: dict[str, int] = run_probe(command, dict(os.environ, **CPU_MEMORY_ENV))
    return peaks


def run_model(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    steps: int,
    rounds: int,
    interleave: bool,
    machinery: bool,
    skip_guards: bool = False,
) -> dict[str, Any]:
    torch._dynamo.reset()  # the last model's graphs would count against the recompile limit
    zoo_case = zoo.case(name)
    build_sizes, batch_sizes = SIZES[device.type][name]
    model = zoo_case.build(**build_sizes)
    contenders = model_contenders(model, device, dtype, machinery)
    batches = make_batches(zoo_case, batch_sizes, device, steps)
    for contender in contenders.values():  # warm-up: compiles happen here
        contender.first_call = run_steps(contender, batches[:1], device)
        run_steps(contender, batches[1:2], device)
    labels = list(contenders)
    stance = (
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip_guards else contextlib.nullcontext()
    )
    with stance:
        for index in range(rounds):
            order = labels[index % len(labels) :] + labels[: index % len(labels)]
            if not interleave:
                for label in order:
                    contenders[label].times.append(run_steps(contenders[label], batches, device))
                continue
            spent = dict.fromkeys(order, 0.0)
            for batch in batches:  # one step each in turn
                for label in order:
                    spent[label] += run_steps(contenders[label], [batch], device)
            for label in order:
                contenders[label].times.append(spent[label] / len(batches))
    if device.type == "cuda":
        peaks = {label: gpu_peak_bytes(c, batches[0], device) for label, c in contenders.items()}
    else:
        peaks = cpu_peaks(name, dtype, machinery)

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sizes = ", ".join(f"{k}={v}" for k, v in {**build_sizes, **batch_sizes}.items())
    what = f"{name}'s machinery ({len(fmp.nn.split(model)[0])} params)" if machinery else name
    print(f"\n{what}: {n_params / 1e6:.2f} M params, {sizes}, {steps} steps x {rounds} rounds")
    print(
        f"  {'contender':>30}  {'ms/step':>8}  {'ratio':>5}  {'best ms':>8}  {'ratio':>5}  {'peak MB':>8}  "
        f"{'mem ratio':>9}  {'first call, graphs':>18}  {'last loss':>9}"
    )
    rows = {}
    for label, c in contenders.items():
        ref = contenders[c.reference]
        median, best = statistics.median(c.times), min(c.times)
        ratio, best_ratio = median / statistics.median(ref.times), best / min(ref.times)
        peak = f"{peaks[label] / 1e6:8.1f}  {peaks[label] / peaks[c.reference]:9.2f}"
        first = f"{c.first_call:6.1f} s, {c.graphs:>3}" if c.compiled else ""
        print(
            f"  {label:>30}  {median * 1e3:8.2f}  {ratio:5.2f}  {best * 1e3:8.2f}  {best_ratio:5.2f}  {peak}  "
            f"{first:>18}  {c.loss:9.4f}"
        )
        rows[label] = {
            "ms_per_step": median * 1e3,
            "ratio": ratio,
            "best_ms_per_step": best * 1e3,
            "best_ratio": best_ratio,
            "reference": c.reference,
            "rounds_ms": [t * 1e3 for t in c.times],
            "peak_bytes": peaks[label],
            "first_call_s": c.first_call if c.compiled else None,
            "graphs": c.graphs if c.compiled else None,
            "last_loss": c.loss,
        }
    return {"params": n_params, "batch": batch_sizes, "build": build_sizes, "contenders": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="+", default=list(SIZES["cpu"]), choices=list(SIZES["cpu"]))
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="contenders take turns step by step within a round, not round by round",
    )
    parser.add_argument(
        "--machinery",
        action="store_true",
        help="eager rows only, each model's forward replaced by the sum of its params' squares",
    )
    parser.add_argument(
        "--skip-guards",
        action="store_true",
        help="time the rounds under torch.compiler.set_stance(skip_guard_eval_unsafe=True)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], help="compute dtype (bfloat16 CPU, float16 CUDA)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--memory-probe", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cpu" else "float16"))
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe, dtype, args.machinery)))
        return
    print(describe_machine(device) + f", compute {str(dtype).removeprefix('torch.')}")
    print("ratio: time over torch.amp eager (eager rows; fused over fused) or compiled (compiled rows)")
    results = {
        name: run_model(name, device, dtype, args.steps, args.rounds, args.interleave, args.machinery, args.skip_guards)
        for name in args.models
    }
    if args.json:
        machine = describe_machine(device)
        Path(args.json).write_text(json.dumps({"machine": machine, "models": results}, indent=1))


if __name__ == "__main__":
    main()
