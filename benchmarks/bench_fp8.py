"""Step time and loss of fmp.train_step with a language model's linear layers in FP8 against bfloat16.

The model: the zoo's Llama (`--model llama`, the default) or the transformer example's GPT
(`--model gpt`, examples/transformer_lm.py's, at its default sizes on a CPU, on its synthetic
sequences).

Every row trains its own copy of the model from the same weights on the same batches with AdamW
under the bfloat16 policy; the FP8 rows put every `nn.Linear` (attention, MLP and the head) on a
recipe with `fmp.fp8.fp8_modules` (delayed scaling's states threaded by the step in
`TrainState.fp8`). The rows take turns round by round. Each prints the median time per step, its
ratio to the bfloat16 row, and the loss at the last step (all rows see the same batches, so the
losses say what the recipe costs in accuracy).

Where torchao is installed, two last rows compare with torchao's float8 training (its default
recipe, per-tensor scales as fmp's tensorwise), float32 outside the FP8 matmuls in both: on a CPU
torchao casts an autocast region's inputs to the GPU's autocast dtype, float16. fmp's row is
tensorwise under a float32 policy; torchao's, its converted model in a torch loop with
AdamW(fused=True) and no loss scale.

On a CPU torch only emulates FP8 matmuls (the FP8 operands are multiplied as float32), so FP8
costs time there; the numerics are those of the hardware. On a GPU with FP8 tensor cores (H100),
at `--device cuda`'s matmul-bound size, per-tensor and rowwise scales run on `torch._scaled_mm`
(rowwise writing bfloat16, which the float32 weight gradient is rounded through).

    python benchmarks/bench_fp8.py [--model gpt] [--device cuda] [--steps 10 --rounds 5] [--compiled]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import describe_machine
from _common import synchronize
from torch import nn

import fmp
import fmp.fp8 as f8

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import transformer_lm
import zoo

# (build sizes, batch sizes) per device type: CPU small; CUDA large enough that the matmuls dominate.
SIZES = {
    "cpu": ({"layers": 2, "width": 64}, {"batch_size": 8, "seq_len": 64}),
    "cuda": (
        {"layers": 4, "width": 2048, "heads": 16, "vocab": 8192},
        {"batch_size": 64, "seq_len": 128, "vocab": 8192},
    ),
}
# The transformer example's GPT: its own defaults on a CPU (add_model_arguments), matmul-bound on CUDA.
GPT_SIZES = {
    "cpu": {"vocab": 64, "length": 32, "width": 64, "layers": 2, "heads": 4, "batch": 16},
    "cuda": {"vocab": 8192, "length": 128, "width": 2048, "layers": 4, "heads": 16, "batch": 64},
}


class GPTLoss(nn.Module):
    """The example's GPT and its next-token loss: a batch (tokens, targets) gives the loss, as the zoo's models do."""

    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = transformer_lm.GPT(sizes["vocab"], sizes["length"], sizes["width"], sizes["layers"], sizes["heads"])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.gpt(tokens).flatten(0, 1).float(), targets.flatten())


def model_and_batches(name: str, device: torch.device, steps: int) -> tuple[Callable[[], nn.Module], list[Any], str]:
    """A builder of fresh copies of the model (the same weights each time), its batches and a line describing them."""
    if name == "gpt":
        sizes = GPT_SIZES[device.type]
        data = transformer_lm.synthetic_batches(
            sizes["vocab"], sizes["length"], sizes["batch"], steps, noise=0.1, seed=1
        )
        batches = [tuple(t.to(device) for t in batch) for batch in data]
        return lambda: GPTLoss(sizes).to(device).train(), batches, f"the transformer example's GPT, {sizes}"
    build_sizes, batch_sizes = SIZES[device.type]
    case = zoo.case("llama")
    generator = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in case.batch(generator, **batch_sizes)) for _ in range(steps)]
    return lambda: case.build(**build_sizes).to(device).train(), batches, f"llama, {build_sizes | batch_sizes}"


# DeepSeek-V3's 128 blocks need features of 128 and more: the CPU size's are 64.
BLOCK = {"cpu": 32, "cuda": 128}
POLICY = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
FLOAT32 = fmp.Policy()  # the peer of torchao's row: float32 outside the FP8 matmuls


def contender(
    model: nn.Module, recipe: Any, compiled: bool, policy: fmp.Policy = POLICY
) -> tuple[Callable[..., Any], list[Any]]:
    """A step function over its own state (kept in the returned list) for `model`'s copy."""
    params, buffers = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *batch: torch.Tensor) -> Any:
        return fmp.nn.call(model, params, buffers, *batch)

    recipes = {nn.Linear: recipe} if recipe is not None else None
    fp8 = f8.init_states(model, recipes) if recipes else ()
    if recipes:
        loss_fn = f8.fp8_modules(loss_fn, model, recipes)
    optimizer = fmp.optim.adamw(1e-3)
    scaler = fmp.DynamicLossScale.create()
    state = [fmp.TrainState.create(params, optimizer, scaler, model_state=buffers, fp8=fp8)]
    train_step = functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer)
    if compiled:
        train_step = torch.compile(train_step, fullgraph=True)

    def step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        state[0], info = train_step(state[0], *batch)
        return info.loss  # type: ignore[no-any-return]

    return step, state


def torchao_contender(model: nn.Module, compiled: bool) -> tuple[Callable[..., Any], list[Any]]:
    """torchao's float8 training (its default: dynamic per-tensor scales) on `model`, a torch loop, no autocast."""
    from torchao.float8 import convert_to_float8_training

    converted = convert_to_float8_training(model)
    optimizer = torch.optim.AdamW(converted.parameters(), lr=1e-3, fused=True)
    forward = torch.compile(converted) if compiled else converted

    def step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward(*batch)  # the zoo's models return their loss
        loss.backward()
        optimizer.step()
        return loss.detach()  # type: ignore[no-any-return]

    return step, [optimizer.state]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="llama", choices=["llama", "gpt"])
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="compile every row's whole step")
    args = parser.parse_args()
    device = torch.device(args.device)
    build, batches, described = model_and_batches(args.model, device, args.steps)
    recipes: dict[str, Any] = {
        "bfloat16": None,
        "fp8 delayed": f8.delayed(),
        "fp8 tensorwise": f8.tensorwise(),
        "fp8 rowwise": f8.rowwise(),
        "fp8 mxfp8": f8.mxfp8(),
        f"fp8 blockwise {BLOCK[device.type]}": f8.blockwise(BLOCK[device.type]),
    }
    rows = {}
    for label, recipe in recipes.items():
        rows[label] = contender(build(), recipe, args.compiled)
    if importlib.util.find_spec("torchao") is not None:
        rows["fp8 tensorwise, f32"] = contender(build(), f8.tensorwise(), args.compiled, FLOAT32)
        rows["torchao float8, f32"] = torchao_contender(build(), args.compiled)
    times: dict[str, list[float]] = {label: [] for label in rows}
    losses: dict[str, float] = {}
    for step, _ in rows.values():  # warm-up (compiles)
        step(batches[0])
    for index in range(args.rounds):
        labels = list(rows)
        for label in labels[index % len(labels) :] + labels[: index % len(labels)]:
            step = rows[label][0]
            synchronize(device)
            start = time.perf_counter()
            for batch in batches:
                loss = step(batch)
            synchronize(device)
            times[label].append((time.perf_counter() - start) / len(batches))
            losses[label] = float(loss)
    n_params = sum(p.numel() for p in build().parameters())
    mode = "compiled" if args.compiled else "eager"
    print(describe_machine(device))
    print(f"{described}: {n_params / 1e6:.1f} M params, {mode}, {args.steps} steps x {args.rounds} rounds")
    base = statistics.median(times["bfloat16"])
    print(f"  {'row':>18}  {'ms/step':>8}  {'ratio':>5}  {'last loss':>9}")
    for label in rows:
        median = statistics.median(times[label])
        print(f"  {label:>18}  {median * 1e3:8.2f}  {median / base:5.2f}  {losses[label]:9.4f}")


if __name__ == "__main__":
    main()
