"""A small GPT-style language model trained with fmp: 16-bit compute, dynamic loss scaling, gradient
accumulation, clipping, AdamW with weight decay on the matrices only (two param groups,
`fmp.optim.partition`) and a warmup-cosine learning rate, with a progress bar (loss, gradient norm,
loss scale) and a plot of loss and loss scale per step.

The tokens are synthetic: each sequence follows a fixed random permutation of the vocabulary (the
next token is `perm[token]`), with a few tokens replaced at random, so a model that learns the
permutation drives the loss from log(vocab) towards the noise floor.

    python examples/transformer_lm.py [--dtype float16 --steps 200 --accumulate 4 --compile]

One micro-batch of step `--poison-step` has its logits multiplied by inf, standing in for a bad
batch: that whole step is skipped, the scale backs off once, and the plot marks it. At the end,
`fmp.debug.locate_nonfinite` runs that micro-batch again and says where its inf came from.

The plot (`--plot transformer_lm.png`) needs matplotlib (`pip install matplotlib`); without it the
run says so and goes on.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _plotting import plot_scale
from _plotting import pyplot
from _plotting import save
from torch import nn
from tqdm import tqdm

import fmp


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int, remat: bool = False) -> None:
        super().__init__()
        self.remat = remat
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            # With remat, a block keeps only its input for the backward pass, which runs it again.
            x = fmp.remat.remat(block)(x) if self.remat else block(x)
        return self.head(self.norm(x))


def synthetic_batches(
    vocab: int, length: int, batch: int, count: int, noise: float, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of (inputs, targets): sequences that follow one random permutation, with noise."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    batches = []
    for _ in range(count):
        seq = torch.empty(batch, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        for t in range(length):
            seq[:, t + 1] = perm[seq[:, t]]
        noisy = torch.rand(batch, length + 1, generator=gen) < noise
        seq[noisy] = torch.randint(vocab, (int(noisy.sum()),), generator=gen)
        batches.append((seq[:, :-1], seq[:, 1:]))
    return batches


def save_plot(path: Path, losses: list[float], scales: list[float], applied: list[bool]) -> None:
    """Loss and loss scale per optimizer step, skipped steps marked; skipped with a note without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return
    steps = range(1, len(losses) + 1)
    figure, (loss_axes, scale_axes) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    loss_axes.plot(steps, losses)
    loss_axes.set_ylabel("loss")
    plot_scale(scale_axes, scales, applied)
    save(plt, figure, path)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT's and its data's sizes (examples/fp8_lm.py trains the same model)."""
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="compute dtype")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--growth-interval", type=int, default=15, help="finite steps between scale growths")
    parser.add_argument("--poison-step", type=int, default=20, help="optimizer step given a non-finite micro-batch")
    parser.add_argument("--noise", type=float, default=0.1, help="fraction of tokens replaced at random")
    parser.add_argument("--plot", type=Path, default=Path("transformer_lm.png"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="run the step compiled whole (fmp.compile)")
    parser.add_argument(
        "--bf16-params",
        action="store_true",
        help="keep params and AdamW's moments in bfloat16 (no float32 copy), updated with stochastic rounding",
    )
    parser.add_argument(
        "--remat", action="store_true", help="recompute each block in the backward pass (activation checkpointing)"
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = GPT(args.vocab, args.length, args.width, args.layers, args.heads, args.remat).to(device)
    param_dtype = "bfloat16" if args.bf16_params else "float32"
    policy = fmp.get_policy(f"params={param_dtype},compute={args.dtype},output=float32")

    def loss_fn(
        params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, poison: torch.Tensor
    ) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (tokens,)) * poison
        # The model runs in the compute dtype; the cross-entropy is taken in float32, as autocast does.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    # The schedule counts applied steps only: the skipped step does not advance the warmup or the decay.
    lr = fmp.optim.schedule.warmup_cosine(args.lr, warmup_steps=max(args.steps // 10, 1), total_steps=args.steps + 1)
    # Weight decay on the matrices only, not on biases and norms: two param groups, as GPT recipes have them.
    groups = {"decay": fmp.optim.adamw(lr, weight_decay=0.1), "no_decay": fmp.optim.adamw(lr, weight_decay=0.0)}
    decayed = fmp.optim.partition(groups, lambda name, param: "decay" if param.dim() >= 2 else "no_decay")
    optimizer = fmp.optim.clip_by_global_norm(decayed, args.clip)
    if args.bf16_params:  # rounded to nearest, AdamW's small late updates would vanish in bfloat16
        optimizer = fmp.optim.stochastic_rounding(optimizer, seed=args.seed, state_dtype=torch.bfloat16)
    params = policy.cast_to_param({name: p.detach() for name, p in model.named_parameters()})
    scaler = fmp.DynamicLossScale.create(growth_interval=args.growth_interval)
    state = fmp.TrainState.create(params, optimizer, scaler, accumulation_steps=args.accumulate)
    step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=args.compile, grad_norm=True
    )
    if args.compile:
        step = fmp.compile(step)

    micro_batches = args.steps * args.accumulate
    data = synthetic_batches(args.vocab, args.length, args.batch, micro_batches, args.noise, args.seed)
    print(
        f"GPT: {args.layers} layers, width {args.width}, vocab {args.vocab}, {sum(p.numel() for p in params.values())} "
        f"params; policy {policy}; {args.accumulate} micro-batches of {args.batch} per step, clip {args.clip}"
    )
    # Per-step values stay on device; reading them syncs, so that happens only for the progress bar.
    losses, scales, applied = [], [], []
    clean, poisoned = torch.ones((), device=device), torch.full((), math.inf, device=device)
    bad_batch: tuple[torch.Tensor, ...] = ()
    start = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", dynamic_ncols=True)
    for done in bar:
        window_loss = torch.zeros((), device=device)
        for micro in range(args.accumulate):
            tokens, targets = (t.to(device) for t in data[(done - 1) * args.accumulate + micro])
            poison = poisoned if done == args.poison_step and micro == 0 else clean
            if poison is poisoned:
                bad_batch = (tokens, targets, poison)
            state, info = step(state, tokens, targets, poison)
            window_loss = window_loss + info.loss / args.accumulate
        losses.append(window_loss)
        scales.append(info.loss_scale.clone())
        applied.append(info.applied.clone())
        if done % 10 == 0 or done == args.steps:
            fmp.raise_if_stalled(state, patience=20)  # fail fast if every step overflows at the floor
            # The norm of the window's mean gradient, before clipping (`clip_grad_norm_`'s return value).
            postfix = {"loss": f"{float(window_loss):.4f}", "grad_norm": f"{float(info.grad_norm):.3g}"}
            postfix |= {"scale": f"{float(info.loss_scale):g}", "skipped": int(state.counts.skipped)}
            bar.set_postfix(postfix, refresh=False)
    bar.close()
    seconds = time.perf_counter() - start
    loss_values, applied_values = torch.stack(losses).tolist(), torch.stack(applied).tolist()
    # The summary averages the last five applied steps: a skipped step's loss is not finite.
    kept = [loss for loss, ok in zip(loss_values, applied_values, strict=True) if ok][-5:]
    first, last = loss_values[0], sum(kept) / max(len(kept), 1)
    counts = state.counts
    print(f"loss: first step {first:.4f} (log(vocab) = {math.log(args.vocab):.4f}), last applied steps {last:.4f}")
    print(
        f"steps applied {int(counts.applied)} skipped {int(counts.skipped)}; "
        f"final loss scale {float(state.scaler.loss_scale):g}; {seconds:.1f} s"
    )
    save_plot(args.plot, loss_values, torch.stack(scales).tolist(), applied_values)
    if bad_batch and int(counts.skipped):
        # A debugging pass (it reads every op's output): which op made the skipped step's inf or NaN.
        report = fmp.debug.locate_nonfinite(loss_fn, state.params, *bad_batch, policy=policy, scaler=state.scaler)
        print(f"the poisoned micro-batch, located {report}")


if __name__ == "__main__":
    main()
