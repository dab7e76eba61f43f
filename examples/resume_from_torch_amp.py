"""Migrating mid-run: a torch.amp checkpoint resumed with fmp, on the same loss-scale trajectory.

A small MLP trains for `--steps-before` steps with plain torch.amp (`torch.autocast`,
`torch.amp.GradScaler`, `torch.optim.AdamW` or `SGD` with momentum) and is checkpointed with
`torch.save`. From that checkpoint two runs go on side by side for `--steps-after` steps: torch.amp
as before, and fmp, whose state is built from the checkpoint: the params from the model's
state_dict, the optimizer state converted from torch.optim's state_dict
(`fmp.interop.from_torch_state_dict`), the loss scale from the GradScaler's
(`fmp.DynamicLossScale.from_state_dict`). Every fifth batch holds an inf and the scale grows
every three finite steps, so both runs back off, skip and grow; the scales they print step by
step are identical. Then the fmp state goes through
`torch.save` and `torch.load(weights_only=True)` bit for bit, and back the other way a GradScaler
loads fmp's scaler state and a torch optimizer fmp's optimizer state
(`fmp.interop.to_torch_state_dict`).

fmp's policy applies the compute dtype op by op with torch.autocast's rules (`Policy.rules`,
"cuda" by default: on this model, linear in the compute dtype and mse_loss in float32, as
autocast("cpu") does), so the two runs agree bit for bit, params and losses included, which also
shows that the converted optimizer state is exact. With `--rules none` fmp casts the whole model
and every floating argument (the targets too) to the compute dtype, as jmp does, and the params
then agree within a loose tolerance.

    python examples/resume_from_torch_amp.py [--optimizer sgd --steps-before 8 --steps-after 16]
"""

from __future__ import annotations

import argparse
import copy
import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import fmp

IN_FEATURES = 16
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3
OVERFLOW_EVERY = 5  # every fifth batch (global step 4, 9, 14, ...) holds an inf


def make_model(width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )


def make_torch_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def batches(steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole run's batches, so both halves of it see the stream an uninterrupted run would."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(IN_FEATURES, 1, generator=gen)
    data = []
    for step in range(steps):
        x = torch.randn(batch, IN_FEATURES, generator=gen)
        y = torch.tanh(x @ teacher)
        if step % OVERFLOW_EVERY == OVERFLOW_EVERY - 1:
            x[0, 0] = float("inf")
        data.append((x, y))
    return data


def torch_amp_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[float, float, bool]:
    """One torch.amp step; returns the loss, the scale it used and whether the update was applied."""
    scale = scaler.get_scale()
    with torch.autocast(x.device.type, dtype=dtype):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    # GradScaler always backs off when it skips, so a lower scale is how a skipped step shows.
    return float(loss.detach()), scale, scaler.get_scale() >= scale


def trees_bitwise_equal(a: Any, b: Any) -> bool:
    """Same structure (hyperparameters included), and every tensor leaf the same bits."""
    a_leaves, a_spec = pytree.tree_flatten(a)
    b_leaves, b_spec = pytree.tree_flatten(b)
    if a_spec != b_spec:
        return False
    int_dtypes = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
                return False
            view = int_dtypes[x.element_size()]
            if not torch.equal(x.contiguous().view(view), y.contiguous().view(view)):
                return False
        elif x != y:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-before", type=int, default=8, help="torch.amp steps before the checkpoint")
    parser.add_argument("--steps-after", type=int, default=16, help="steps of each run after it")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--rules",
        choices=["cuda", "cpu", "none"],
        default="cuda",
        help="fmp's policy rules: op by op as autocast ('cuda', 'cpu'), or the whole model cast ('none')",
    )
    parser.add_argument("--tolerance", type=float, default=2e-3, help="the largest param difference with 'none'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    if args.steps_before < 1 or args.steps_after < 1:
        parser.error("--steps-before and --steps-after must be at least 1")
    if args.checkpoint_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            run(args, Path(tmp))
    else:
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        run(args, args.checkpoint_dir)


def run(args: argparse.Namespace, checkpoint_dir: Path) -> None:
    device = torch.device(args.device)
    # "half" is bfloat16 on CPU and float16 on CUDA, autocast's defaults there; both runs use it.
    spec = f"params=float32,compute=half,output=float32,rules={args.rules}"
    policy = fmp.get_policy(spec, device_type=device.type)
    dtype = policy.compute_dtype
    steps = args.steps_before + args.steps_after
    data = [(x.to(device), y.to(device)) for x, y in batches(steps, args.batch, args.seed)]
    torch.manual_seed(args.seed)
    print(f"{args.optimizer}, policy {policy} on {device}; an inf in every {OVERFLOW_EVERY}th batch")

    # 1. Plain torch.amp, then a checkpoint.
    model = make_model(args.width).to(device)
    optimizer = make_torch_optimizer(args.optimizer, model, args.lr)
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    applied_steps = 0
    for step, (x, y) in enumerate(data[: args.steps_before]):
        loss, scale, applied = torch_amp_step(model, optimizer, scaler, x, y, dtype)
        applied_steps += applied
        print(f"step {step:3d} torch.amp      loss {loss:9.5f}  scale {scale:g} -> {scaler.get_scale():g}")
    path = checkpoint_dir / "torch_amp.pt"
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "step": args.steps_before,
        "applied_steps": applied_steps,  # torch.optim.SGD keeps no count of its own
    }
    torch.save(checkpoint, path)
    print(f"checkpoint after {args.steps_before} steps ({applied_steps} applied) saved to {path}")

    # 2a. torch.amp resumes from the checkpoint...
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    model = make_model(args.width).to(device)
    model.load_state_dict(checkpoint["model"])
    optimizer = make_torch_optimizer(args.optimizer, model, args.lr)
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler = torch.amp.GradScaler(device.type)
    scaler.load_state_dict(checkpoint["scaler"])

    # 2b. ...and so does fmp. The module lends its structure to functional_call; its copy holds no memory.
    skeleton = copy.deepcopy(model).to("meta")
    params = {name: checkpoint["model"][name].detach().clone() for name, _ in skeleton.named_parameters()}
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(
        args.optimizer, checkpoint["optimizer"], params, checkpoint["applied_steps"]
    )
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.DynamicLossScale.from_state_dict(checkpoint["scaler"]))
    state = state._replace(opt_state=opt_state)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(skeleton, params, (x,))
        return nn.functional.mse_loss(out.float(), y.float())  # reduced in float32, as autocast does

    step_fn = functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=fmp_optimizer)
    torch_scales, fmp_scales = [], []
    for step, (x, y) in enumerate(data[args.steps_before :], start=args.steps_before):
        amp_loss, amp_scale, _ = torch_amp_step(model, optimizer, scaler, x, y, dtype)
        state, info = step_fn(state, x, y)
        # Reading fmp's values syncs with the host: fine for a demo that prints every step.
        fmp_loss, fmp_scale, fmp_next = float(info.loss), float(info.loss_scale), float(state.scaler.loss_scale)
        torch_scales.append((amp_scale, scaler.get_scale()))
        fmp_scales.append((fmp_scale, fmp_next))
        skipped = "" if bool(info.grads_finite) else "  (skipped)"
        print(
            f"step {step:3d} torch.amp      loss {amp_loss:9.5f}  scale {amp_scale:g} -> {scaler.get_scale():g}\n"
            f"         fmp            loss {fmp_loss:9.5f}  scale {fmp_scale:g} -> {fmp_next:g}{skipped}"
        )
    identical = torch_scales == fmp_scales
    growths = sum(after > before for before, after in fmp_scales)
    backoffs = sum(after < before for before, after in fmp_scales)
    print(f"loss-scale trajectories identical: {identical} ({growths} growths, {backoffs} backoffs)")
    torch_params = dict(model.named_parameters())
    difference = max(float((state.params[name] - torch_params[name].detach()).abs().max()) for name in state.params)
    moved = max(float((state.params[name] - checkpoint["model"][name]).abs().max()) for name in state.params)
    # Op by op, fmp casts as autocast does: bit for bit. Cast whole, the targets are rounded too.
    tolerance = args.tolerance if policy.rules is None else 0.0
    print(f"max |param difference| fmp vs torch.amp: {difference:.3g}, tolerance {tolerance:g}")
    dtype_name = str(dtype).removeprefix("torch.")
    why = (
        f"fmp casts the whole model and the targets to {dtype_name}, autocast op by op"
        if policy.rules is None
        else f"fmp's '{policy.rules}' rules cast op by op as autocast does"
    )
    print(f"  (params moved up to {moved:.3g} since the checkpoint; {why})")

    # 3. fmp's own checkpoint: the whole TrainState, loaded back with torch's safe loader.
    fmp_path = checkpoint_dir / "fmp_state.pt"
    torch.save(state, fmp_path)
    restored = torch.load(fmp_path, map_location=device, weights_only=True)
    reloaded = trees_bitwise_equal(restored, state)
    print(f"fmp state reloaded from {fmp_path} with weights_only=True, bit for bit: {reloaded}")

    # 4. And back to torch.amp: GradScaler reads fmp's scaler state_dict, the model its params, the
    # torch optimizer fmp's optimizer state.
    back = torch.amp.GradScaler(device.type)
    back.load_state_dict(restored.scaler.state_dict())
    back_model = make_model(args.width).to(device)
    back_model.load_state_dict(restored.params)
    back_optimizer = make_torch_optimizer(args.optimizer, back_model, args.lr)
    back_optimizer.load_state_dict(fmp.interop.to_torch_state_dict(restored.opt_state, back_optimizer))
    tracker, same = back.state_dict()["_growth_tracker"], back.state_dict() == scaler.state_dict()
    print(
        f"GradScaler loaded from fmp's scaler: scale {back.get_scale():g}, growth tracker {tracker}, "
        f"equal to the torch.amp run's: {same}"
    )
    ours, theirs = back_optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    same_keys = ours.keys() == theirs.keys() and all(ours[i].keys() == theirs[i].keys() for i in ours)
    state_difference = max(float((ours[i][k] - theirs[i][k]).abs().max()) for i in ours for k in ours[i])
    print(
        f"torch.optim.{type(optimizer).__name__} loaded from fmp's optimizer state: max |difference| from the "
        f"torch.amp run's {state_difference:.3g}, tolerance {tolerance:g}"
    )
    if not (identical and difference <= tolerance and reloaded and same and same_keys):
        raise SystemExit("a claim above does not hold")
    if state_difference > tolerance:
        raise SystemExit("a claim above does not hold")


if __name__ == "__main__":
    main()
