"""The torch.amp recipe (3 x Linear + ReLU, MSE, SGD) redone with fmp, beside fp32 and torch.amp.

The seed recipe runs on a GPU at width 4096 and batch 4096 in float16; this CPU demo keeps its
shape at a smaller size, in bfloat16, and prints loss and loss scale per epoch for each run. Two
fmp runs: "fmp", the functional step (`fmp.train_step` with `fmp.optim.sgd(lr, fused=True)`, whose
kernel skips an overflowing step by itself, and the state donated, so the update is written in
place as torch.optim's is), and "fmp.autograd", the recipe's own
loop (`torch.nn`, `torch.autocast`, a backward of `grads.scale(loss, scaler)`) with fmp's scaler and a `GradientBuffer`,
which follows torch.amp bit for bit without a host sync.
Every run starts from the same weights and sees the same batches; each is warmed up on one batch
first (fmp's compile happens there), so the times compare steady-state training. The runs take
turns four times, each round in another order, and each keeps its fastest, so neither a slow
moment of the machine nor a place in the order favours one.

    python examples/seed_recipe.py [--width 512 --batch 256 --compile]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from torch import nn

import fmp

Data = list[tuple[torch.Tensor, torch.Tensor]]
History = list[tuple[float, float]]  # (last loss, loss scale) per epoch
ROUNDS = 4  # every run in each place of the order once


def make_model(width: int, layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, width))


def train_fp32(model: nn.Module, data: Data, epochs: int, lr: float) -> History:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for _ in range(epochs):
        for x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        history.append((float(loss.detach()), 1.0))
    return history


def train_torch_amp(model: nn.Module, data: Data, epochs: int, lr: float, dtype: torch.dtype, growth: int) -> History:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth)
    history = []
    for _ in range(epochs):
        for x, y in data:
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        history.append((float(loss.detach()), scaler.get_scale()))
    return history


def train_fmp_autograd(
    model: nn.Module, data: Data, epochs: int, lr: float, dtype: torch.dtype, growth: int, compiled: bool
) -> History:
    # Compiled, the unscale is one pass per buffer; eager (no C++ compiler needed), the same bits.
    grads = fmp.interop.GradientBuffer.attach(model.parameters(), compiled=compiled)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, fused=True)  # fused: it skips on the device
    scaler = fmp.DynamicLossScale.create(growth_interval=growth)
    history = []
    for _ in range(epochs):
        for x, y in data:
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(x), y)
            grads.scale(loss, scaler).backward()  # through the buffer: unscale_ refuses a backward it did not scale
            grads_finite, scaler = grads.unscale_(scaler)
            grads.step(optimizer, grads_finite)
            grads.zero_()
        history.append((float(loss.detach()), float(scaler.loss_scale)))  # a host sync, once per epoch
    return history


def train_fmp(
    model: nn.Module, data: Data, epochs: int, lr: float, policy: fmp.Policy, growth: int, compile_step: bool
) -> History:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The network runs in the compute dtype; the loss is reduced in float32, as autocast does for mse_loss.
        output, _ = fmp.nn.call(model, params, {}, x)  # the model with these params; no buffers
        return nn.functional.mse_loss(output.float(), y.float())

    optimizer = fmp.optim.sgd(lr, fused=True)
    # donate: each step hands its state over, so the new params are written into the old ones.
    step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss_fn, policy=policy, optimizer=optimizer, donate=True
    )
    if compile_step:
        step = fmp.compile(step)
    params = {name: p.detach() for name, p in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(growth_interval=growth))
    history = []
    for _ in range(epochs):
        for x, y in data:
            state, info = step(state, x, y)
        # Reading the loss and scale syncs with the host: once per epoch, for printing only. The scale
        # printed is the one for the next step, as GradScaler.get_scale() reports after update().
        history.append((float(info.loss), float(state.scaler.loss_scale)))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.001)
    # torch.autocast("cpu")'s own rules, as the torch.amp run has them: fmp runs on torch.autocast itself.
    parser.add_argument("--policy", default="params=float32,compute=bfloat16,output=float32,rules=cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run fmp's step compiled whole (fmp.compile), and GradientBuffer's unscale compiled",
    )
    args = parser.parse_args()

    policy = fmp.get_policy(args.policy)
    torch.manual_seed(0)
    data = [(torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)) for _ in range(args.batches)]
    initial = make_model(args.width, args.layers).state_dict()
    growth = args.batches  # both scalers grow once an epoch, so the scale visibly moves

    def fresh_model() -> nn.Module:
        model = make_model(args.width, args.layers)
        model.load_state_dict(initial)
        return model

    runs: dict[str, Callable[[Data, int], History]] = {
        "fp32": lambda d, e: train_fp32(fresh_model(), d, e, args.lr),
        "torch.amp": lambda d, e: train_torch_amp(fresh_model(), d, e, args.lr, policy.compute_dtype, growth),
        "fmp": lambda d, e: train_fmp(fresh_model(), d, e, args.lr, policy, growth, args.compile),
        "fmp.autograd": lambda d, e: train_fmp_autograd(
            fresh_model(), d, e, args.lr, policy.compute_dtype, growth, args.compile
        ),
    }
    print(f"policy {policy}; {args.layers} x Linear({args.width}), batch {args.batch}, {args.batches} batches/epoch")
    seconds = {name: float("inf") for name in runs}
    histories = {}
    for run in runs.values():
        run(data[:1], 1)  # warm-up
    names = list(runs)
    for turn in range(ROUNDS):
        # Each round in another order: a run's place in the round moves its time (what ran before it
        # left the caches and the allocator), so no run keeps one place.
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            start = time.perf_counter()
            histories[name] = runs[name](data, args.epochs)
            seconds[name] = min(seconds[name], time.perf_counter() - start)
    for name, history in histories.items():
        for epoch, (loss, scale) in enumerate(history, 1):
            print(f"{name:>12} epoch {epoch}: loss {loss:.9g}  loss scale {scale:g}")  # 9 digits: a float32 exactly
    ratio = seconds["fmp"] / seconds["torch.amp"]
    print("time: " + ", ".join(f"{name} {t:.2f} s" for name, t in seconds.items()))
    autograd_ratio = seconds["fmp.autograd"] / seconds["torch.amp"]
    print(f"fmp / torch.amp time: {ratio:.2f}; fmp.autograd / torch.amp: {autograd_ratio:.2f}")


if __name__ == "__main__":
    main()
