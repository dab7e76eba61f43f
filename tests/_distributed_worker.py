"""One rank of test_distributed.py's process groups: `python _distributed_worker.py SCENARIO RANK WORLD PORT OUT`.

Each scenario joins a gloo group on loopback with a short timeout, runs, and saves what the test
checks to OUT/SCENARIO-RANK.pt. Warnings are errors here too, as under pytest.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a rank: warnings are errors, as under pytest (which imports this module too)
    warnings.simplefilter("error")
    # Raised inside torch's own inductor imports, not by fmp (as in pyproject's pytest settings).
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)

import torch  # after the warning filters, which must see torch's imports
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fmp
import fmp.distributed
import fmp.fp8

TIMEOUT_S = 20  # the process group's timeout: a stuck collective raises after this
STEPS = 6
PER_RANK = 8  # rows of each rank's batch
F32 = fmp.Policy()


def mlp_params(width: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(width, width, generator=gen) / width**0.5,
        "b1": torch.zeros(width),
        "w2": torch.randn(1, width, generator=gen) / width**0.5,
        "b2": torch.zeros(1),
    }


def mlp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = F.linear(F.relu(F.linear(x, params["w1"], params["b1"])), params["w2"], params["b2"])
    return F.mse_loss(out.float(), y.float())


def two_losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MSE, and a second loss on the first layer alone; an inf in y poisons the first loss only."""
    return mlp_loss(params, x, y), F.linear(x, params["w1"]).float().square().mean()


def global_batches(world: int, steps: int = STEPS, poison: tuple[int, int] | None = (2, 1), seed: int = 5) -> list[Any]:
    """The batches of every step, concatenated over ranks; `poison=(step, rank)` puts an inf in that rank's rows."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        x, y = torch.randn(world * PER_RANK, 8, generator=gen), torch.randn(world * PER_RANK, 1, generator=gen)
        if poison is not None and step == poison[0]:
            y[poison[1] * PER_RANK] = float("inf")
        batches.append((x, y))
    return batches


def shard(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in batch)


def make_state(scalers: int = 1, optimizer: fmp.optim.Optimizer | None = None, accumulate: int = 1) -> fmp.TrainState:
    """The initial state: `mlp_params`, adamw unless another optimizer is given, one scaler per loss."""

    def scaler() -> fmp.DynamicLossScale:
        return fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)

    return fmp.TrainState.create(
        mlp_params(),
        optimizer or fmp.optim.adamw(1e-2),
        scaler() if scalers == 1 else tuple(scaler() for _ in range(scalers)),
        accumulation_steps=accumulate,
    )


def train(
    rank: int,
    world: int,
    policy: fmp.Policy,
    loss_fn: Callable[..., Any] = mlp_loss,
    accumulate: int = 1,
    **kwargs: Any,
) -> Any:
    state = fmp.distributed.broadcast_tree(make_state(2 if loss_fn is two_losses else 1, accumulate=accumulate))
    step = functools.partial(fmp.distributed.train_step, loss_fn, policy=policy, optimizer=fmp.optim.adamw(1e-2))
    for batch in global_batches(world):
        state, _ = step(state, *shard(batch, rank), **kwargs)
    fmp.distributed.check_replicas(state)
    return state


def train_norms(rank: int, world: int) -> torch.Tensor:
    """Each step's `info.grad_norm` (of the averaged gradients), float32."""
    state = fmp.distributed.broadcast_tree(make_state())
    step = functools.partial(fmp.distributed.train_step, mlp_loss, policy=F32, optimizer=fmp.optim.adamw(1e-2))
    norms = []
    for batch in global_batches(world):
        state, info = step(state, *shard(batch, rank), grad_norm=True)
        norms.append(info.grad_norm)
    return torch.stack(norms)


def count_all_reduces(run: Callable[[], Any]) -> tuple[Any, int]:
    """Runs `run` and counts the functional all-reduces it issues."""
    from fmp.distributed import _reduce

    calls = 0
    original = _reduce.funcol.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    _reduce.funcol.all_reduce = counting
    try:
        return run(), calls
    finally:
        _reduce.funcol.all_reduce = original


def many_params_step(rank: int, bucket_cap_mb: float, collectives: str) -> Any:
    """One step of a model with 240 small parameters."""
    params = {f"p{i}": torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(240)}
    state = fmp.TrainState.create(params, fmp.optim.sgd(0.1), fmp.DynamicLossScale.create())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return sum((x @ p.T).square().mean() for p in params.values())  # type: ignore[return-value]

    step = functools.partial(fmp.distributed.train_step, loss_fn, policy=F32, optimizer=fmp.optim.sgd(0.1))
    return step(state, x, bucket_cap_mb=bucket_cap_mb, collectives=collectives)[0]


def reduce_errors(rank: int, world: int) -> dict[str, Any]:
    """The relative error of averaging gradients in each reduce dtype, against a float64 mean."""
    size = 1 << 16
    per_rank = [torch.randn(size, generator=torch.Generator().manual_seed(50 + r)) for r in range(world)]
    exact = torch.stack([g.double() for g in per_rank]).mean(0)
    finite = torch.ones((), dtype=torch.bool)
    errors = {}
    for name in ("float32", "bfloat16", "float16"):
        policy = fmp.get_policy(f"p=f32,r={name}")
        scale = torch.tensor(2.0**10) if name == "float16" else None
        gradients = fmp.Gradients({"g": per_rank[rank]}, finite, (), (), finite)
        reduced = fmp.distributed.all_reduce_gradients(gradients, policy=policy, loss_scale=scale)
        error = (reduced.grads["g"].double() - exact).norm() / exact.norm()
        errors[name] = float(error)
        errors[f"{name}_max"] = float(((reduced.grads["g"].double() - exact).abs() / exact.abs().clamp(min=1e-3)).max())
    # Small gradients: float16 without the scale flushes values below 2**-24 to zero.
    tiny = per_rank[rank] * 2.0**-26
    for name, scale in (("float16_tiny_scaled", torch.tensor(2.0**16)), ("float16_tiny_unscaled", None)):
        gradients = fmp.Gradients({"g": tiny}, finite, (), (), finite)
        reduced = fmp.distributed.all_reduce_gradients(gradients, policy=fmp.get_policy("r=f16"), loss_scale=scale)
        errors[name] = float((reduced.grads["g"].double() - exact * 2.0**-26).norm() / (exact * 2.0**-26).norm())
    # After training: the params of a bfloat16 reduce against a float32 one.
    f32 = train(rank, world, fmp.get_policy("p=f32,c=bf16,o=f32"))
    bf16 = train(rank, world, fmp.get_policy("p=f32,c=bf16,o=f32,r=bf16"))
    errors["params_after_training"] = max(
        float((f32.params[k] - bf16.params[k]).norm() / f32.params[k].norm()) for k in ("w1", "w2")
    )
    return errors


def float16_overflow(rank: int) -> dict[str, Any]:
    """Finite gradients of 70000 on every rank, averaged in float16 (max 65504): every flag drops."""
    del rank
    finite = torch.ones((), dtype=torch.bool)
    gradients = fmp.Gradients({"w": torch.tensor([70000.0])}, finite, (), (), (finite, finite.clone()))
    reduced = fmp.distributed.all_reduce_gradients(gradients, policy=fmp.get_policy("p=f32,r=f16"))
    return {"grads_finite": bool(reduced.grads_finite), "finite_per_loss": [bool(f) for f in reduced.finite_per_loss]}


def unscaled_loss_on_the_wire() -> bool:
    """One loss unscaled (NoOpLossScale), one scaled by 2**16, reduced in float16: the gradients go
    over the wire at the smallest scale, capped at 1, so the unscaled loss's do not overflow."""
    sgd = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create({"w": torch.ones(4)}, sgd, (fmp.NoOpLossScale(), fmp.StaticLossScale.create(2.0**16)))

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 10.0 * (params["w"] * x).sum(), 1e-3 * params["w"].sum()

    policy = fmp.get_policy("p=f32,r=f16")
    _, info = fmp.distributed.train_step(loss_fn, state, torch.ones(4), policy=policy, optimizer=sgd)
    return bool(info.applied)


def fp8_train(rank: int | None, world: int) -> list[fmp.TrainState]:
    """The MLP as nn.Linear layers on delayed FP8 scaling: the state after each step, on this rank's rows
    (`fmp.distributed.train_step`) or, with `rank` None, on the whole batch in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    recipes = {torch.nn.Linear: fmp.fp8.delayed(history_len=4)}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y.float())

    params = {name: p.detach() for name, p in model.named_parameters()}
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    state = fmp.TrainState.create(params, fmp.optim.adamw(1e-2), scaler, fp8=fmp.fp8.init_states(model, recipes))
    fp8_loss = fmp.fp8.fp8_modules(loss_fn, model, recipes)
    kwargs = {"policy": F32, "optimizer": fmp.optim.adamw(1e-2)}
    states = []
    for batch in global_batches(world):
        if rank is None:
            state, _ = fmp.train_step(fp8_loss, state, *batch, **kwargs)
        else:
            state, _ = fmp.distributed.train_step(fp8_loss, state, *shard(batch, rank), **kwargs)
        states.append(state)
    return states


def scenario_main(rank: int, world: int) -> dict[str, Any]:
    """Everything that shares one healthy process group."""
    results: dict[str, Any] = {}
    results["f32"] = train(rank, world, F32)
    results["f32_eager_collectives"] = train(rank, world, F32, collectives="eager")
    results["bf16"] = train(rank, world, fmp.get_policy("p=f32,c=bf16,o=f32,r=bf16"))
    results["f16"] = train(rank, world, fmp.get_policy("p=f32,c=f16,o=f32,r=f16"))
    results["two_losses"] = train(rank, world, F32, two_losses)
    results["accumulate"] = train(rank, world, F32, accumulate=2)  # each micro-batch is reduced
    results["grad_norms"] = train_norms(rank, world)
    results["many_params"] = count_all_reduces(lambda: many_params_step(rank, 25.0, "functional"))
    results["many_params_small_buckets"] = count_all_reduces(lambda: many_params_step(rank, 0.01, "functional"))
    results["many_params_eager"] = many_params_step(rank, 0.01, "eager")
    results["errors"] = reduce_errors(rank, world)
    results["float16_overflow"] = float16_overflow(rank)
    results["unscaled_loss_on_the_wire"] = unscaled_loss_on_the_wire()
    # Misuse is named: another layout on one rank, replicas that differ (in value, or only in order),
    # a group without this rank.
    reordered = {"w": torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.tensor([3.0, 2.0, 1.0])}
    # Raw bits +1, -2, +1 on rank 1: the plain and the position-weighted sums both stay.
    ones = torch.ones(3)
    bits = torch.tensor([1, -2, 1], dtype=torch.int32)
    cancelling = ones if rank == 0 else (ones.view(torch.int32) + bits).view(torch.float32)
    accumulating = make_state(accumulate=2 + rank)  # a static field that differs, which no leaf shows
    for name, tree, check in (
        ("layout", {"w": torch.zeros(2 + rank)}, fmp.distributed.broadcast_tree),
        ("values", {"w": torch.full((2,), float(rank))}, fmp.distributed.check_replicas),
        ("order", reordered, fmp.distributed.check_replicas),
        ("cancelling", {"w": cancelling}, fmp.distributed.check_replicas),
        ("static", accumulating, fmp.distributed.broadcast_tree),
    ):
        try:
            check(tree)
        except ValueError as error:
            results[f"{name}_error"] = str(error)
    # One rank's tensor column-major: the broadcast copies storage, so it must not copy strides.
    square = torch.arange(12.0).reshape(3, 4)
    results["strided"] = fmp.distributed.broadcast_tree({"w": square if rank == 0 else square.t().contiguous().t()})
    solo = dist.new_group([0])
    if rank == 1:
        try:
            fmp.distributed.agree_finite(torch.ones((), dtype=torch.bool), group=solo)
        except ValueError as error:
            results["group_error"] = str(error)
    results["fsdp2"] = fsdp2_train(rank, world)
    results["fp8"] = fp8_train(rank, world)
    return results


def fsdp2_train(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 shards and reduces; fmp scales, agrees on the skip and updates the shards.

    At step 2 an inf goes into rank 1's shard of one gradient only, which rank 0 cannot see.
    """
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard

    names = {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(mlp_params()[names[name]])
    mesh = init_device_mesh("cpu", (world,))
    policy = F32
    mp = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=policy.effective_reduce_dtype)
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, mp_policy=mp)
    optimizer, scaler = fmp.optim.adamw(1e-2), make_state().scaler
    with torch.no_grad():  # views of the shards' storage, without autograd's tracking
        params = {names[n]: p.to_local() for n, p in model.named_parameters()}
    opt_state = optimizer.init(params)
    dtensor_error = None
    for step, batch in enumerate(global_batches(world, poison=None)):
        x, y = shard(batch, rank)
        scaler.scale(F.mse_loss(model(x).float(), y.float())).backward()
        if step == 0:
            try:
                fmp.distributed.unscale_and_adjust(scaler, {n: p.grad for n, p in model.named_parameters()})
            except TypeError as error:
                dtensor_error = str(error)
        grads = {names[n]: p.grad.to_local() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        if step == 2 and rank == 1:
            grads["w1"] = grads["w1"].clone().index_fill_(0, torch.tensor([0]), float("inf"))
        grads, finite, _, scaler = fmp.distributed.unscale_and_adjust(scaler, grads)
        new_params, opt_state = fmp.select_tree(finite, optimizer.update(grads, opt_state, params), (params, opt_state))
        with torch.no_grad():
            for key, value in new_params.items():
                params[key].copy_(value)
        model.zero_grad()
    full = {names[n]: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[operator]
    return {"params": full, "scaler": scaler, "dtensor_error": dtensor_error, "local_rows": params["w1"].shape[0]}


def timed_failure(run: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        run()
    except fmp.distributed.CollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


STALL_TIMEOUT_S = 3


def scenario_failures(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 stalls (alive, not stepping), then dies after a step: rank 0 must fail soon, both times."""
    stall_group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
    pair = dist.new_group([0, 1])
    step = functools.partial(fmp.distributed.train_step, mlp_loss, policy=F32, optimizer=fmp.optim.adamw(1e-2))
    batches, state, results = global_batches(world), make_state(), {}
    if rank == 0:  # rank 1 never joins this all-reduce
        results["stall"] = timed_failure(lambda: step(state, *shard(batches[0], rank), group=stall_group))
    state, _ = step(state, *shard(batches[0], rank), group=pair)
    if rank == 1:
        os._exit(3)
    results["dead"] = timed_failure(lambda: step(state, *shard(batches[1], rank), group=pair))
    return results


def compiled_run(rank: int, world: int, compiled: bool) -> fmp.TrainState:
    """Four steps, the second skipped (an inf in rank 1's batch), donated when compiled."""
    policy, optimizer = fmp.get_policy("p=f32,r=bf16"), fmp.optim.sgd(0.05, momentum=0.9)
    step: Callable[..., Any] = functools.partial(
        fmp.distributed.train_step, mlp_loss, policy=policy, optimizer=optimizer, donate=compiled
    )
    if compiled:
        step = torch.compile(step, fullgraph=True)
    state = make_state(optimizer=optimizer)
    for batch in global_batches(world, steps=4, poison=(1, 1)):
        state, _ = step(state, *shard(batch, rank))
    return state


def scenario_compiled(rank: int, world: int) -> dict[str, Any]:
    """The step compiled whole with fullgraph=True: one graph for every step, skipped ones included."""
    from torch._dynamo.utils import counters

    torch._dynamo.config.error_on_recompile = True
    state = compiled_run(rank, world, compiled=True)
    fmp.distributed.check_replicas(state)
    return {"state": state, "graphs": counters["stats"]["unique_graphs"], "eager": compiled_run(rank, world, False)}


def main() -> None:
    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    result = globals()[f"scenario_{scenario}"](rank, world)
    torch.save(result, out / f"{scenario}-{rank}.pt")
    if scenario in ("main", "compiled"):
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    # The failures scenario leaves broken groups, whose teardown could wait on the lost peer.
    os._exit(0)


if __name__ == "__main__":
    main()
