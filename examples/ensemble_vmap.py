"""An ensemble of small MLPs trained at once: `fmp.train_step` mapped with `torch.func.vmap`.

`torch.func.stack_module_state` stacks the members' parameters along a new leading dimension; the
AdamW state and the `fmp.DynamicLossScale` state are stacked the same way, so under vmap every
member has its own loss scale. Members start from different weights and different loss scales
(2**(8 + 2 i) for member i), each sees its own batches of a synthetic regression task, and one
member's batch holds an inf every few steps: that member alone skips those steps (its params and
optimizer state are kept bit for bit) and backs its scale off, while the others train on and grow
theirs. Skips are summed on device from the per-member `info.grads_finite` and read once at the end;
so is a check that every skipped step kept its member's state bit for bit and every applied one
changed it (the script exits with an error otherwise).

Compute runs in the platform's 16-bit float: bfloat16 on CPU, float16 on CUDA (where the larger
scales may also overflow on their own, so skip counts there can exceed the injected ones).

    python examples/ensemble_vmap.py [--members 4 --steps 200 --device cuda --compile]
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import fmp

IN_FEATURES = 8


def make_member(width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    )


def member_unchanged(old: Any, new: Any) -> torch.Tensor:
    """Per member (leading dim), True when every leaf of `new` equals `old`'s bit for bit; on device."""
    int_dtypes = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    same = []
    for a, b in zip(pytree.tree_leaves(old), pytree.tree_leaves(new), strict=True):
        # Compare raw bits, so -0.0 vs 0.0 or a changed NaN payload would count as a change.
        a_bits, b_bits = a.view(int_dtypes[a.element_size()]), b.view(int_dtypes[b.element_size()])
        same.append((a_bits == b_bits).reshape(a.shape[0], -1).all(dim=1))
    return torch.stack(same).all(dim=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--growth-interval", type=int, default=20)
    parser.add_argument("--inject-member", type=int, default=1, help="the member whose batches get an inf")
    parser.add_argument("--inject-every", type=int, default=25, help="inject on every N-th step (0: never)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="compile the vmapped step with fullgraph=True")
    args = parser.parse_args()
    if not 0 <= args.inject_member < args.members:
        parser.error(f"--inject-member must lie in [0, {args.members - 1}]")

    device = torch.device(args.device)
    # "half" is bfloat16 on CPU and float16 on CUDA.
    policy = fmp.get_policy("params=float32,compute=half,output=float32", device_type=device.type)
    optimizer = fmp.optim.adamw(args.lr)

    torch.manual_seed(args.seed)
    members: list[nn.Module] = [make_member(args.width).to(device) for _ in range(args.members)]
    stacked, _ = torch.func.stack_module_state(members)
    # stack_module_state returns leaves that require grad; fmp's step must get plain tensors, or each
    # step's autograd graph would chain onto the previous one.
    params = {name: p.detach() for name, p in stacked.items()}
    # The members' modules only lend their structure to functional_call: a copy on "meta" holds no memory.
    skeleton = copy.deepcopy(members[0]).to("meta")

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(skeleton, params, (x,))
        return nn.functional.mse_loss(out.float(), y.float())  # reduce in float32, as autocast does

    # One scaler per member with the same hyperparameters (their treespecs must agree to stack) but
    # its own starting scale. TrainState.create sets up one model (its step counters are 0-dim), so
    # each member gets its own state, and the states are stacked leaf by leaf as the params were.
    scalers = [
        fmp.DynamicLossScale.create(init_scale=2.0 ** (8 + 2 * i), growth_interval=args.growth_interval)
        for i in range(args.members)
    ]
    state = fmp.stack_trees(
        [
            fmp.TrainState.create({name: p[i] for name, p in params.items()}, optimizer, scaler)
            for i, scaler in enumerate(scalers)
        ]
    )

    step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = torch.func.vmap(
        functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer)
    )
    if args.compile:
        step = fmp.compile(step)

    # A synthetic regression task; every member draws its own batches (as in bagging).
    gen = torch.Generator().manual_seed(args.seed + 1)
    teacher = torch.randn(IN_FEATURES, 1, generator=gen)
    teacher *= 2.0 / teacher.norm()  # the same difficulty for every seed: sin of a N(0, 4) variable

    def batch(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(*shape, IN_FEATURES, generator=gen)
        return x.to(device), torch.sin(x @ teacher).to(device)

    x_val, y_val = batch(1024)

    def eval_losses(params: dict[str, torch.Tensor]) -> torch.Tensor:
        def one(member: dict[str, torch.Tensor]) -> torch.Tensor:
            out = torch.func.functional_call(skeleton, member, (x_val,))
            return nn.functional.mse_loss(out, y_val)  # float32 throughout: the members' true quality

        return torch.func.vmap(one)(params)

    initial_loss = eval_losses(state.params).tolist()
    skipped = torch.zeros(args.members, dtype=torch.int64, device=device)
    # Counts, per member, the steps where "skipped" and "state unchanged bit for bit" disagree.
    disagreements = torch.zeros_like(skipped)
    first_step_seconds = 0.0
    start = time.perf_counter()
    for i in range(args.steps):
        xs, ys = batch(args.members, args.batch)
        if args.inject_every and i % args.inject_every == args.inject_every - 1:
            xs[args.inject_member, 0, 0] = float("inf")
        new_state, info = step(state, xs, ys)
        skipped += ~info.grads_finite
        unchanged = member_unchanged((state.params, state.opt_state), (new_state.params, new_state.opt_state))
        disagreements += unchanged != ~info.grads_finite
        state = new_state
        if i == 0:  # the first step compiles, with --compile: timed apart
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_step_seconds = time.perf_counter() - start
    # The first read of a result on the host: everything above stayed on device.
    final_loss = eval_losses(state.params).tolist()
    seconds = time.perf_counter() - start - first_step_seconds

    print(
        f"policy {policy}; {args.members} members x MLP(width {args.width}), batch {args.batch}, "
        f"{args.steps} steps, {'compiled' if args.compile else 'eager'} on {device}"
    )
    for m in range(args.members):
        print(
            f"member {m}: held-out loss {initial_loss[m]:.5f} -> {final_loss[m]:.5f}  "
            f"loss scale {state.scaler.loss_scale[m].item():g}  skipped {skipped[m].item()} steps"
        )
    if args.members > 1:
        spread = min(
            max((state.params[name][a] - state.params[name][b]).abs().max().item() for name in state.params)
            for a, b in itertools.combinations(range(args.members), 2)
        )
        print(f"members differ: smallest max |param difference| between two members {spread:.4g}")
    kept = bool((disagreements == 0).all())
    print(f"skipped steps kept params and optimizer state bit for bit, applied steps changed them: {kept}")
    print(f"Adam steps applied per member: {state.opt_state.step.tolist()}")
    print(f"time: first step {first_step_seconds:.2f} s, then {1e3 * seconds / max(args.steps - 1, 1):.1f} ms/step")
    if not kept:
        raise SystemExit("a skipped step changed its member's state, or an applied one did not")


if __name__ == "__main__":
    main()
