"""Train a ResNet-style CNN (convolutions, BatchNorm, max pooling, residual blocks) with fmp, and
evaluate it as a `torch.nn` module with `model.eval()`, where BatchNorm uses its running statistics.

The running statistics are model state: `fmp.nn.split` takes them out of the module with the
params, `fmp.train_step` hands the loss function a copy each step and keeps the one it gives back
(updated by the train-mode forward pass, as under torch.amp), and `fmp.nn.write_back` copies params
and statistics back into the module. The run evaluates that module every `--eval-every` steps, and
at the end once more with BatchNorm's initial statistics, to show what the trained ones are worth.

The task is synthetic and learnable: each image is noise with one short bar in it, horizontal,
vertical, diagonal or anti-diagonal, at a random place; the class is the bar's direction (4 classes,
chance 25%). The model is `ResNetCNN` from `zoo.py` (its forward returns the cross-entropy).

    python examples/cnn_batchnorm.py [--steps 150 --compile --plot cnn.png]

The plot (`--plot`) needs matplotlib (`pip install matplotlib`); without it the run says so and goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path

import torch
from _plotting import plot_scale
from _plotting import pyplot
from _plotting import save
from _plotting import scale_text
from torch import nn
from tqdm import tqdm
from zoo import build_resnet_cnn

import fmp

CLASSES = ("horizontal", "vertical", "diagonal", "anti-diagonal")


@dataclasses.dataclass
class Result:
    """What a run leaves: the trained module (params and statistics written back), its state and records."""

    model: nn.Module
    state: fmp.TrainState
    losses: list[float]
    scales: list[float]
    applied: list[bool]
    evals: list[tuple[int, float, float]]  # (step, eval loss, eval accuracy), step 0 before training
    accuracy_initial_statistics: float
    seconds: float


def bar_images(
    generator: torch.Generator, batch_size: int, *, image_size: int = 16, length: int = 7, signal: float = 1.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images, each with a bar of `length` pixels added at a random place; labels: its direction."""
    labels = torch.randint(len(CLASSES), (batch_size,), generator=generator)
    along, middle = torch.arange(length), torch.full((length,), length // 2)
    # Row and column offsets of the bar's pixels, per direction.
    rows = torch.stack([middle, along, along, along])[labels]
    cols = torch.stack([along, middle, along, length - 1 - along])[labels]
    top = torch.randint(image_size - length + 1, (batch_size, 1), generator=generator)
    left = torch.randint(image_size - length + 1, (batch_size, 1), generator=generator)
    bars = torch.zeros(batch_size, image_size, image_size)
    bars[torch.arange(batch_size)[:, None], top + rows, left + cols] = signal
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator) + bars[:, None]
    return images, labels


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, buffers: dict[str, torch.Tensor] | None = None
) -> tuple[float, float]:
    """(mean loss, accuracy) of the module in eval mode, in float32; `buffers` in place of its own if given."""
    model.eval()
    logits: list[torch.Tensor] = []
    # The model's forward returns the loss; the head's output, caught on the way, gives the predictions.
    hook = model.head.register_forward_hook(lambda module, inputs, output: logits.append(output))
    try:
        if buffers is None:
            loss = model(images, labels)
        else:  # the module's own (trained) params, other statistics
            loss, _ = fmp.nn.call(model, {}, buffers, images, labels)
    finally:
        hook.remove()
        model.train()
    accuracy = (logits[0].argmax(1) == labels).float().mean()
    return float(loss), float(accuracy)


def save_plot(
    path: Path,
    losses: Sequence[float],
    scales: Sequence[float],
    applied: Sequence[bool],
    evals: Sequence[tuple[int, float, float]],
) -> None:
    """Train loss, eval accuracy and loss scale (log base 2) per step; a note instead without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return
    steps = range(1, len(losses) + 1)
    figure, (loss_axes, accuracy_axes, scale_axes) = plt.subplots(
        3, 1, sharex=True, figsize=(7, 6.5), height_ratios=[2, 1.3, 1]
    )
    loss_axes.plot(steps, losses, linewidth=1, label="train loss (batch statistics)")
    loss_axes.plot(
        [s for s, _, _ in evals], [loss for _, loss, _ in evals], "o-", label="eval loss (running statistics)"
    )
    loss_axes.set_ylabel("cross-entropy")
    loss_axes.set_title("ResNet-style CNN with BatchNorm, trained with fmp")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    accuracy_axes.plot([s for s, _, _ in evals], [100 * a for _, _, a in evals], "o-", color="tab:green")
    accuracy_axes.axhline(100 / len(CLASSES), color="gray", linestyle=":", label="chance")
    accuracy_axes.set_ylabel("eval accuracy (%)")
    accuracy_axes.set_ylim(0, 100)
    accuracy_axes.legend(loc="lower right")
    accuracy_axes.grid(alpha=0.3)
    plot_scale(scale_axes, scales, applied)
    save(plt, figure, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="images per step")
    parser.add_argument("--image-size", type=int, default=16, help="image height and width")
    parser.add_argument("--signal", type=float, default=1.5, help="the bar's brightness over unit noise")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--compute", default="half", help="compute dtype; half: bfloat16 on CPU, float16 on CUDA")
    parser.add_argument("--growth-interval", type=int, default=30, help="finite steps before the scale doubles")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--eval-size", type=int, default=512, help="held-out images")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true", help="run the step compiled whole (fmp.compile)")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress-bar updates (a sync)")
    parser.add_argument("--plot", type=Path, help="save a plot of loss, accuracy and loss scale to this PNG")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (on a busy machine: the free cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> Result:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_resnet_cnn(seed=args.seed, width=args.width, classes=len(CLASSES)).to(device).train()
    data = functools.partial(bar_images, batch_size=args.batch_size, image_size=args.image_size, signal=args.signal)
    generator = torch.Generator().manual_seed(args.seed)
    held_out = bar_images(
        torch.Generator().manual_seed(args.seed + 1), args.eval_size, image_size=args.image_size, signal=args.signal
    )
    eval_images, eval_labels = (t.to(device) for t in held_out)

    # Trainable params, and the persistent buffers: every BatchNorm's running mean, variance and batch count.
    params, buffers = fmp.nn.split(model)
    initial_buffers = {name: b.clone() for name, b in buffers.items()}  # split shares the module's storage

    def loss_fn(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Train mode: BatchNorm normalises by the batch's statistics and updates its running ones in
        # `buffers`, which go back to the step as the model's new state.
        return fmp.nn.call(model, params, buffers, images, labels)

    rules = "cpu" if device.type == "cpu" else "cuda"  # torch.autocast's own op lists for the device
    policy = fmp.get_policy(f"params=float32,compute={args.compute},output=float32,rules={rules}", device_type=device)
    schedule = fmp.optim.schedule.warmup_cosine(
        args.lr, warmup_steps=max(args.steps // 10, 1), total_steps=args.steps + 1
    )
    optimizer = fmp.optim.adamw(schedule, weight_decay=0.01)
    scaler = fmp.DynamicLossScale.create(growth_interval=args.growth_interval)
    state = fmp.TrainState.create(params, optimizer, scaler, model_state=buffers)
    step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss_fn, policy=policy, optimizer=optimizer
    )
    if args.compile:
        step = fmp.compile(step)

    count = sum(p.numel() for p in params.values())
    print(
        f"ResNetCNN: {count} params, {len(buffers)} BatchNorm buffers; policy {policy}; {args.steps} steps of "
        f"{args.batch_size} images {args.image_size}x{args.image_size}, classes {', '.join(CLASSES)} on {device}"
    )
    evals = [(0, *evaluate(model, eval_images, eval_labels))]
    losses, scales, applied = [], [], []
    first_seconds, start = 0.0, time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", dynamic_ncols=True)
    for i in bar:
        images, labels = (t.to(device, non_blocking=True) for t in data(generator))
        state, info = step(state, images, labels)
        losses.append(info.loss)
        scales.append(info.loss_scale)
        applied.append(info.applied)
        if i == 1:  # reading the loss waits for the step; with --compile the first step compiles it
            float(info.loss)
            first_seconds = time.perf_counter() - start
        if i % args.eval_every == 0 or i == args.steps:
            # Into the module, params and running statistics, to evaluate it as a torch.nn model.
            fmp.nn.write_back(model, state.params, state.model_state)
            evals.append((i, *evaluate(model, eval_images, eval_labels)))
        if i % args.log_every == 0 or i == args.steps:
            postfix = {"loss": f"{float(info.loss):.4f}", "scale": f"2^{math.log2(float(info.loss_scale)):.4g}"}
            bar.set_postfix(postfix, eval_acc=f"{evals[-1][2]:.1%}", refresh=False)
    bar.close()
    seconds = time.perf_counter() - start
    rest_seconds = (seconds - first_seconds) / max(args.steps - 1, 1)

    loss_values = torch.stack(losses).tolist()
    applied_values = torch.stack(applied).tolist()
    kept = [loss for loss, ok in zip(loss_values, applied_values, strict=True) if ok][-10:]
    counts = state.counts
    last = sum(kept) / len(kept) if kept else math.nan
    print(f"train loss: first step {loss_values[0]:.4f}, last {len(kept)} applied steps {last:.4f}")
    print(
        f"steps applied {int(counts.applied)} skipped {int(counts.skipped)}; "
        f"final loss scale {scale_text(float(state.scaler.loss_scale))}; "
        f"{seconds:.1f} s: the first step {first_seconds:.1f} s, then {1000 * rest_seconds:.0f} ms/step "
        "(evaluations included)"
    )
    (_, loss_before, accuracy_before), (_, loss_after, accuracy_after) = evals[0], evals[-1]
    print(
        f"eval ({args.eval_size} held-out images, model.eval()): loss {loss_before:.4f} -> {loss_after:.4f}, "
        f"accuracy {accuracy_before:.1%} -> {accuracy_after:.1%}"
    )
    _, accuracy_initial_statistics = evaluate(model, eval_images, eval_labels, initial_buffers)
    print(f"the trained params with BatchNorm's initial statistics instead: accuracy {accuracy_initial_statistics:.1%}")
    if args.plot is not None:
        save_plot(args.plot, loss_values, torch.stack(scales).tolist(), applied_values, evals)
    return Result(
        model=model,
        state=state,
        losses=loss_values,
        scales=torch.stack(scales).tolist(),
        applied=applied_values,
        evals=evals,
        accuracy_initial_statistics=accuracy_initial_statistics,
        seconds=seconds,
    )


if __name__ == "__main__":
    main()
