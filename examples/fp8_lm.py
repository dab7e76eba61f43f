"""The transformer example's GPT trained with its linear layers in FP8, beside the same run in bfloat16.

Both runs start from the same weights and see the same synthetic batches (examples/transformer_lm.py),
with AdamW under the bfloat16 policy and a dynamic loss scale; the FP8 run puts every `nn.Linear`
(attention, MLP and the head) on a recipe with `fmp.fp8.fp8_modules`: "delayed" (Transformer
Engine's DelayedScaling, whose states `fmp.train_step` threads in `TrainState.fp8`), "tensorwise",
"rowwise", "mxfp8" or "blockwise" (32 blocks at these sizes). On a CPU the FP8 matmuls are
emulated, so the run shows FP8's numerics, not its speed. At the end it prints both runs' losses
over the last steps and their gap, and plots both curves (`--plot fp8_lm.png`, with matplotlib).

    python examples/fp8_lm.py [--recipe delayed --steps 100 --compile]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _plotting import pyplot
from _plotting import save
from torch import nn
from transformer_lm import GPT
from transformer_lm import add_model_arguments
from transformer_lm import synthetic_batches

import fmp
import fmp.fp8

RECIPES: dict[str, Callable[[], Any]] = {
    "delayed": lambda: fmp.fp8.delayed(history_len=16),
    "tensorwise": fmp.fp8.tensorwise,
    "rowwise": fmp.fp8.rowwise,
    "mxfp8": fmp.fp8.mxfp8,
    "blockwise": lambda: fmp.fp8.blockwise(32),
}
LAST = 10  # steps the summary averages


def train(model: nn.Module, recipe: Any, data: list[tuple[torch.Tensor, ...]], args: argparse.Namespace) -> list[float]:
    """Per-step losses of `model`'s copy trained on `data`, its linear layers on `recipe` (None: bfloat16)."""

    def loss_fn(params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (tokens,))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
    optimizer = fmp.optim.adamw(args.lr, weight_decay=0.01)
    params = {name: p.detach() for name, p in model.named_parameters()}
    recipes = {nn.Linear: recipe} if recipe is not None else None
    fp8 = fmp.fp8.init_states(model, recipes) if recipes else ()
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), fp8=fp8)
    loss = fmp.fp8.fp8_modules(loss_fn, model, recipes) if recipes else loss_fn
    step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss, policy=policy, optimizer=optimizer
    )
    if args.compile:
        step = fmp.compile(step)
    losses = []
    for tokens, targets in data:
        state, info = step(state, tokens, targets)
        losses.append(info.loss)
    return torch.stack(losses).tolist()


def save_plot(path: Path, curves: dict[str, list[float]]) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        axes.plot(range(1, len(losses) + 1), losses, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    axes.grid(alpha=0.3)
    save(plt, figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=list(RECIPES), default="delayed")
    parser.add_argument("--steps", type=int, default=100)
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--noise", type=float, default=0.1, help="fraction of tokens replaced at random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="run both steps compiled whole (fmp.compile)")
    parser.add_argument("--plot", type=Path, default=Path("fp8_lm.png"))
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.length, args.width, args.layers, args.heads)
    data = synthetic_batches(args.vocab, args.length, args.batch, args.steps, args.noise, args.seed)
    curves = {}
    for label, recipe in (("bfloat16", None), (f"fp8 {args.recipe}", RECIPES[args.recipe]())):
        start = time.perf_counter()
        curves[label] = train(model, recipe, data, args)
        print(f"{label}: {time.perf_counter() - start:.1f} s")
    (bf16, bf16_losses), (fp8, fp8_losses) = curves.items()
    bf16_last, fp8_last = (sum(losses[-LAST:]) / LAST for losses in (bf16_losses, fp8_losses))
    gap = (fp8_last - bf16_last) / bf16_last
    print(f"loss over the last {LAST} of {args.steps} steps: {bf16} {bf16_last:.4f}, {fp8} {fp8_last:.4f}")
    print(f"fp8 gap: {gap:+.2%} of the bfloat16 loss")
    save_plot(args.plot, curves)


if __name__ == "__main__":
    main()
