"""Step time and peak memory of fmp against torch.amp on the seed recipe's network, side by side.

Every contender trains its own copy of 3 x Linear(width) + ReLU from the same weights on the same
batches; the contenders take turns round by round so machine noise hits all alike, and each row
prints the median time per step and its ratio to the torch.amp row with the same optimizer:

  fp32                       plain float32 training, SGD
  torch.amp sgd              autocast + GradScaler + torch.optim.SGD
  torch.amp adamw(fused)     autocast + GradScaler + torch.optim.AdamW(fused=True)
  fmp eager sgd / adamw      fmp.train_step, eager
  fmp eager donated sgd / adamw
                             eager with donate=True: the kept or updated values are written into
                             the old params and optimizer state
  fmp compiled sgd           fmp.train_step under torch.compile(fullgraph=True)
  fmp donated sgd / adamw    the same with donate=True: the update is written into the old buffers
  fmp donated sgd +norm      donated, also reporting the gradients' global norm (grad_norm=True)
  fmp compiled sgd +check, fmp donated adamw +check
                             with the update check (check_update=True): its cost, checking that
                             the new params and optimizer state are finite, is the ratio to the
                             row without +check
  fmp planned sgd            donated, compiled with Inductor's memory_planning (CPU only): one
                             allocation per step for all temporaries, which glibc keeps between steps
  fmp buffer sgd             the torch.amp sgd loop with fmp's scaler: a GradientBuffer holds the
                             gradients, unscale_ checks them in one compiled pass, and a fused SGD
                             skips an overflowed step on the device
  fmp cuda-graph sgd         donated, mode="reduce-overhead": the whole step replayed as a CUDA graph

Each row also prints the process's minor page faults per step (on CPU, where they matter): glibc
returns a freed block to the kernel when it is above its mmap threshold, or when it leaves more
than its trim threshold free at the top of the heap, and the next step that allocates that memory
gets fresh zeroed pages, one fault per 4 KiB. With --isolate (CPU) each contender is timed in a
process of its own that builds only its own model, as a training run has its malloc to itself,
instead of sharing one malloc with the others (whose frees change its faults); warm-up times are
then medians over fresh processes, which may find Inductor's on-disk cache warm. --only times the
named contenders (and the torch.amp rows their ratios need).

Peak memory is the contender's state kept between steps (params, optimizer state, scaler) plus the
most a step allocates on top of it: from torch.cuda's allocator statistics on a GPU; on CPU from the
process's peak resident size (VmHWM) in a subprocess whose malloc returns every large block to
the system (MALLOC_MMAP_THRESHOLD_) and whose heap's free pages are handed back before each
contender (malloc_trim), so resident size follows live tensors.

    python benchmarks/bench_step.py [--device cuda] [--setting cpu-machinery] [--isolate] [--only LABEL ...]
                                    [--steps 20 --rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from _common import CPU_MEMORY_ENV
from _common import cpu_peak_bytes
from _common import describe_machine
from _common import run_probe
from _common import synchronize
from _common import tree_bytes
from torch import nn
from torch._inductor.compile_fx import compile_fx

import fmp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from seed_recipe import make_model

LR = 1e-3
REFERENCE = {"sgd": "torch.amp sgd", "adamw": "torch.amp adamw(fused)"}  # the row each family's ratios divide by
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    width: int
    batch: int
    dtype: torch.dtype


SETTINGS = {
    "gpu-seed": Setting("seed recipe", 4096, 4096, torch.float16),
    "cpu-matmul": Setting("matmul-bound", 1024, 256, torch.bfloat16),
    "cpu-machinery": Setting("machinery-bound", 1024, 8, torch.float32),
}


@dataclasses.dataclass
class Contender:
    family: str  # the optimizer: rows are compared with the torch.amp row of the same family
    step: Callable[[torch.Tensor, torch.Tensor], None]
    state: Callable[[], Any]  # what the contender keeps between steps
    compiled: bool = False
    counter: InductorCounter | None = None  # counts the graphs Dynamo compiles (default mode)
    warm_up_seconds: float = 0.0  # the first 3 steps, compile and CUDA-graph recording included


class InductorCounter:
    """A torch.compile backend: Inductor with `options`, counting the graphs it is handed.

    A frame compiles once per count, except where Dynamo restarts its analysis of a frame (to
    specialize a float it first traced as a symbol): the backend is then handed the frame twice.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        return compile_fx(gm, example_inputs, config_patches=self.options)


def torch_contender(model: nn.Module, setting: Setting, family: str, *, amp: bool) -> Contender:
    device_type = next(model.parameters()).device.type
    optimizer: torch.optim.Optimizer
    if family == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    scaler = torch.amp.GradScaler(device_type, enabled=amp)
    autocast = amp and setting.dtype != torch.float32

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device_type, dtype=setting.dtype, enabled=autocast):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return Contender(family, step, lambda: (list(model.parameters()), optimizer.state))


def buffer_contender(model: nn.Module, setting: Setting) -> Contender:
    """The torch.nn loop of torch_contender with fmp's scaler and a GradientBuffer, stepping a fused SGD."""
    device_type = next(model.parameters()).device.type
    grads = fmp.interop.GradientBuffer.attach(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, fused=True)  # fused: it skips on the device
    scaler = fmp.DynamicLossScale.create(device=device_type)
    autocast = setting.dtype != torch.float32

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal scaler
        with torch.autocast(device_type, dtype=setting.dtype, enabled=autocast):
            loss = nn.functional.mse_loss(model(x), y)
        grads.scale(loss, scaler).backward()
        grads_finite, scaler = grads.unscale_(scaler)
        grads.step(optimizer, grads_finite)
        grads.zero_()

    return Contender("sgd", step, lambda: (list(model.parameters()), grads.flat(), scaler), compiled=True)


def fmp_contender(
    model: nn.Module,
    setting: Setting,
    family: str,
    *,
    mode: str | None,
    donate: bool,
    options: dict[str, Any] | None = None,
    grad_norm: bool = False,
    bfloat16_params: bool = False,
    check_update: bool = False,
) -> Contender:
    """fmp.train_step; `options` are Inductor's, for mode="default" (the counted backend) only.

    With `bfloat16_params` the params and the optimizer's state are kept in bfloat16, without a
    float32 copy, and updated through `fmp.optim.stochastic_rounding`.
    """
    if options is not None and mode != "default":
        raise ValueError(f"options are for mode='default', not mode={mode!r}")

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y.float())

    optimizer = fmp.optim.sgd(LR) if family == "sgd" else fmp.optim.adamw(LR)
    param_dtype = torch.bfloat16 if bfloat16_params else torch.float32
    if bfloat16_params:
        optimizer = fmp.optim.stochastic_rounding(optimizer, state_dtype=torch.bfloat16)
    policy = fmp.Policy(param_dtype, setting.dtype, torch.float32)
    train_step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step,
        loss_fn,
        policy=policy,
        optimizer=optimizer,
        donate=donate,
        grad_norm=grad_norm,
        check_update=check_update,
    )
    counter = None
    if mode == "default":
        counter = InductorCounter(options or {})
        train_step = torch.compile(train_step, backend=counter, fullgraph=True)
    elif mode is not None:
        train_step = torch.compile(train_step, mode=mode, fullgraph=True)
    params = {k: v.detach().to(param_dtype, copy=True) for k, v in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    if mode == "reduce-overhead":  # a donated state updated in place inside the CUDA graph
        for tensor in pytree.tree_leaves(state):
            torch._dynamo.mark_static_address(tensor)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal state
        state, _ = train_step(state, x, y)

    return Contender(family, step, lambda: state, compiled=mode is not None, counter=counter)


def contender_builders(setting: Setting, device: torch.device) -> dict[str, Callable[[], Contender]]:
    """Each contender's constructor, so that a process can build only the one it times."""
    torch.manual_seed(0)
    initial = make_model(setting.width, 3).state_dict()

    def model() -> nn.Module:
        fresh = make_model(setting.width, 3)
        fresh.load_state_dict(initial)
        return fresh.to(device)

    builders: dict[str, Callable[[], Contender]] = {
        "fp32": lambda: torch_contender(model(), setting, "sgd", amp=False),
        "torch.amp sgd": lambda: torch_contender(model(), setting, "sgd", amp=True),
        "torch.amp adamw(fused)": lambda: torch_contender(model(), setting, "adamw", amp=True),
        "fmp eager sgd": lambda: fmp_contender(model(), setting, "sgd", mode=None, donate=False),
        "fmp eager donated sgd": lambda: fmp_contender(model(), setting, "sgd", mode=None, donate=True),
        "fmp eager adamw": lambda: fmp_contender(model(), setting, "adamw", mode=None, donate=False),
        "fmp eager donated adamw": lambda: fmp_contender(model(), setting, "adamw", mode=None, donate=True),
        "fmp compiled sgd": lambda: fmp_contender(model(), setting, "sgd", mode="default", donate=False),
        "fmp compiled sgd +check": lambda: fmp_contender(
            model(), setting, "sgd", mode="default", donate=False, check_update=True
        ),
        "fmp donated sgd": lambda: fmp_contender(model(), setting, "sgd", mode="default", donate=True),
        "fmp donated sgd +norm": lambda: fmp_contender(
            model(), setting, "sgd", mode="default", donate=True, grad_norm=True
        ),
        "fmp donated adamw": lambda: fmp_contender(model(), setting, "adamw", mode="default", donate=True),
        "fmp donated adamw +check": lambda: fmp_contender(
            model(), setting, "adamw", mode="default", donate=True, check_update=True
        ),
        "fmp donated adamw bf16+sr": lambda: fmp_contender(
            model(), setting, "adamw", mode="default", donate=True, bfloat16_params=True
        ),
        "fmp buffer sgd": lambda: buffer_contender(model(), setting),
    }
    if device.type == "cpu":
        builders["fmp planned sgd"] = lambda: fmp_contender(
            model(), setting, "sgd", mode="default", donate=True, options={"memory_planning": True}
        )
    if device.type == "cuda":
        builders["fmp cuda-graph sgd"] = lambda: fmp_contender(
            model(), setting, "sgd", mode="reduce-overhead", donate=True
        )
    return builders


def build_contenders(setting: Setting, device: torch.device, labels: list[str]) -> dict[str, Contender]:
    """The contenders named in `labels`, in the order `contender_builders` lists them."""
    return {label: build() for label, build in contender_builders(setting, device).items() if label in labels}


def make_data(setting: Setting, device: torch.device, steps: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    shape = (setting.batch, setting.width)
    batches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(steps)]
    return [(x.to(device), y.to(device)) for x, y in batches]


def warm_up(contenders: dict[str, Contender], batch: Batch, device: torch.device) -> None:
    """Runs each contender's first steps (compiles happen here, CUDA graphs are recorded)."""
    for contender in contenders.values():
        start = time.perf_counter()
        for _ in range(3):
            contender.step(*batch)
        synchronize(device)
        contender.warm_up_seconds = time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Timing:
    """One timed round of a contender."""

    seconds: float  # per step
    faults: float  # minor page faults per step: fresh pages the kernel mapped for this process


def _minor_faults() -> int:
    """Page faults this process took that needed no disk read: fresh pages the kernel zeroed for it."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_steps(step: Callable[[torch.Tensor, torch.Tensor], None], data: list[Batch], device: torch.device) -> Timing:
    faults = _minor_faults()
    start = time.perf_counter()
    for x, y in data:
        step(x, y)
    synchronize(device)
    return Timing((time.perf_counter() - start) / len(data), (_minor_faults() - faults) / len(data))


def time_probe(key: str, label: str, steps: int) -> dict[str, Any]:
    """Runs in a subprocess of its own: one contender's warm-up and one timed round."""
    device = torch.device("cpu")
    contender = contender_builders(SETTINGS[key], device)[label]()  # the only model in this process
    data = make_data(SETTINGS[key], device, steps)
    warm_up({label: contender}, data[0], device)
    timing = time_steps(contender.step, data, device)
    graphs = contender.counter.graphs if contender.counter else None
    return {"seconds": timing.seconds, "faults": timing.faults, "warm_up": contender.warm_up_seconds, "graphs": graphs}


def isolated_timings(key: str, labels: list[str], steps: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Times each contender in a process of its own, the processes taking turns round by round.

    A CPU step's allocations are served by the process's malloc, whose state (what it kept, what
    it returned to the system) depends on everything the process allocated before: contenders
    sharing a process change each other's page faults.
    """
    timings: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for _ in range(rounds):
        for label in labels:
            command = [sys.executable, __file__, "--time-probe", key, label, "--steps", str(steps)]
            timings[label].append(run_probe(command, os.environ))
    return timings


def gpu_peak_bytes(contender: Contender, batch: Batch, device: torch.device) -> int:
    gc.collect()
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    contender.step(*batch)
    synchronize(device)
    return tree_bytes(contender.state()) + torch.cuda.max_memory_allocated(device) - before


def memory_probe(setting: Setting, labels: list[str]) -> dict[str, int]:
    """Runs in a subprocess on CPU: each contender's peak bytes, measured one after another."""
    device = torch.device("cpu")
    contenders = build_contenders(setting, device, labels)
    batch = make_data(setting, device, 1)[0]
    peaks = {}
    for label, contender in contenders.items():
        for _ in range(2):
            contender.step(*batch)
        peaks[label] = cpu_peak_bytes(functools.partial(contender.step, *batch), contender.state)
    return peaks


def cpu_peaks(key: str, labels: list[str]) -> dict[str, int]:
    env = dict(os.environ, **CPU_MEMORY_ENV)
    peaks: dict[str, int] = run_probe([sys.executable, __file__, "--memory-probe", key, *labels], env)
    return peaks


def run_setting(
    key: str, device: torch.device, steps: int, rounds: int, *, isolate: bool, only: list[str] | None
) -> None:
    setting = SETTINGS[key]
    torch._dynamo.reset()  # graphs compiled for another setting would count as recompiles here
    labels = list(contender_builders(setting, device))
    if only:
        unknown = sorted(set(only) - set(labels))
        if unknown:
            raise SystemExit(f"--only: no contenders {unknown} on {device.type}; there are {labels}")
        labels = [label for label in labels if label in {*only, *REFERENCE.values()}]
    contenders = build_contenders(setting, device, labels)
    times: dict[str, list[Timing]] = {label: [] for label in contenders}
    compiles: dict[str, str] = {}
    if isolate:
        for label, runs in isolated_timings(key, list(contenders), steps, rounds).items():
            times[label] = [Timing(run["seconds"], run["faults"]) for run in runs]
            if contenders[label].compiled:
                warm_up_seconds = statistics.median(run["warm_up"] for run in runs)
                counts = {run["graphs"] for run in runs}  # every round's, so a recompile in any shows
                graphs = "-" if counts == {None} else "/".join(str(count) for count in sorted(counts))
                compiles[label] = f"{warm_up_seconds:5.1f} s / {graphs}"
    else:
        data = make_data(setting, device, steps)
        warm_up(contenders, data[0], device)
        for _ in range(rounds):
            for label, contender in contenders.items():
                times[label].append(time_steps(contender.step, data, device))
        for label, contender in contenders.items():
            if contender.compiled:
                graphs = contender.counter.graphs if contender.counter else "-"
                compiles[label] = f"{contender.warm_up_seconds:5.1f} s / {graphs}"
    if device.type == "cuda":
        data = make_data(setting, device, 1)
        peaks = {label: gpu_peak_bytes(c, data[0], device) for label, c in contenders.items()}
    else:
        peaks = cpu_peaks(key, labels)
    dtype = str(setting.dtype).removeprefix("torch.")
    shape = f"3 x Linear({setting.width}), batch {setting.batch}"
    how = "each contender in a process of its own" if isolate else "contenders sharing one process"
    print(f"\n{setting.name}: {shape}, compute {dtype}, {steps} steps x {rounds} rounds, {how}")
    columns = f"{'ms/step':>9}  {'time ratio':>10}  {'faults/step':>11}  {'peak MB':>8}  {'mem ratio':>9}"
    print(f"  {'contender':>22}  {columns}  warm-up, graphs")
    for label, contender in contenders.items():
        ref = REFERENCE[contender.family]
        median = statistics.median(t.seconds for t in times[label])
        ref_median = statistics.median(t.seconds for t in times[ref])
        faults = statistics.median(t.faults for t in times[label])
        print(
            f"  {label:>22}  {median * 1e3:9.3f}  {median / ref_median:10.2f}  {faults:11.0f}  "
            f"{peaks[label] / 1e6:8.1f}  {peaks[label] / peaks[ref]:9.2f}  {compiles.get(label, '')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--setting", choices=sorted(SETTINGS), help="run this setting only")
    parser.add_argument(
        "--isolate", action="store_true", help="CPU: time each contender in a process of its own (see isolated_timings)"
    )
    parser.add_argument("--only", nargs="+", metavar="LABEL", help="time these contenders (and their torch.amp rows)")
    parser.add_argument("--memory-probe", nargs="+", metavar=("SETTING", "LABEL"), help=argparse.SUPPRESS)
    parser.add_argument("--time-probe", nargs=2, metavar=("SETTING", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        key, *labels = args.memory_probe
        print(json.dumps(memory_probe(SETTINGS[key], labels)))
        return
    if args.time_probe:
        print(json.dumps(time_probe(*args.time_probe, args.steps)))
        return
    if args.isolate and torch.device(args.device).type != "cpu":
        parser.error("--isolate times CPU runs: add --device cpu (a GPU's caching allocator keeps its memory)")
    device = torch.device(args.device)
    print(describe_machine(device))
    print("ratios: time and peak memory over the torch.amp row with the same optimizer (sgd or adamw)")
    keys = ["gpu-seed"] if device.type == "cuda" else ["cpu-matmul", "cpu-machinery"]
    if args.setting:
        keys = [args.setting]
    for key in keys:
        run_setting(key, device, args.steps, args.rounds, isolate=args.isolate, only=args.only)


if __name__ == "__main__":
    main()
