"""Learning-rate schedules against torch.optim.lr_scheduler, inside optimizers, and across skipped steps."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from hypothesis import given
from hypothesis import strategies as st
from torch.optim import lr_scheduler

import fmp
from fmp.optim import schedule

BASE_LR = 0.1
Scheduler = Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]


def sequential_warmup_cosine(
    warmup: int, total: int, start_factor: float, eta_min: float
) -> Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]:
    def make(opt: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        warm = lr_scheduler.LinearLR(opt, start_factor, 1.0, warmup)
        cosine = lr_scheduler.CosineAnnealingLR(opt, total - warmup, eta_min)
        return lr_scheduler.SequentialLR(opt, [warm, cosine], [warmup])

    return make


# (our schedule, the torch scheduler that gives the same values, steps to compare over).
PAIRS: dict[str, tuple[fmp.optim.Schedule, Scheduler, int]] = {
    "constant": (schedule.constant(BASE_LR), functools.partial(lr_scheduler.ConstantLR, factor=1.0), 30),
    "linear-defaults": (schedule.linear(BASE_LR), lr_scheduler.LinearLR, 30),
    "linear-warmup": (
        schedule.linear(BASE_LR, 0.25, 1.0, 10),
        functools.partial(lr_scheduler.LinearLR, start_factor=0.25, total_iters=10),
        30,
    ),
    "linear-decay": (
        schedule.linear(BASE_LR, 1.0, 0.1, 12),
        functools.partial(lr_scheduler.LinearLR, start_factor=1.0, end_factor=0.1, total_iters=12),
        30,
    ),
    "exponential": (schedule.exponential(BASE_LR, 0.93), functools.partial(lr_scheduler.ExponentialLR, gamma=0.93), 30),
    # Up to t_max: past it torch's cosine rises again where ours stays at eta_min (tested below).
    "cosine": (
        schedule.cosine_annealing(BASE_LR, 29, 1e-3),
        functools.partial(lr_scheduler.CosineAnnealingLR, T_max=29, eta_min=1e-3),
        30,
    ),
    "warmup-cosine": (
        schedule.warmup_cosine(BASE_LR, 6, 29, start_factor=0.1, eta_min=1e-3),
        sequential_warmup_cosine(6, 29, 0.1, 1e-3),
        30,
    ),
}


def torch_lrs(make_scheduler: Scheduler, steps: int, base_lr: float = BASE_LR) -> list[float]:
    """The lr torch.optim uses at each of `steps` steps, stepping the scheduler after each."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    return lrs


def values(sched: fmp.optim.Schedule, steps: int) -> torch.Tensor:
    return sched(torch.arange(steps, dtype=torch.int32))


@pytest.mark.parametrize("name", PAIRS)
def test_values_match_torch_schedulers(name: str) -> None:
    ours, make_scheduler, steps = PAIRS[name]
    expected = torch.tensor(torch_lrs(make_scheduler, steps), dtype=torch.float64)
    # Close, not equal: torch updates the lr recursively (lr_t from lr_t-1), ours is the closed form;
    # they differ by float64 rounding. Each value, evaluated alone as an optimizer evaluates it, equals
    # the vectorised one.
    torch.testing.assert_close(values(ours, steps), expected, rtol=1e-12, atol=1e-15)
    for t in (0, 1, steps // 2, steps - 1):
        value = ours(torch.tensor(t, dtype=torch.int32))
        assert value.dim() == 0 and value.dtype == torch.float64
        assert torch.equal(value, values(ours, steps)[t])


def test_cosine_stays_at_eta_min_after_t_max_and_linear_at_its_end_factor() -> None:
    assert values(schedule.cosine_annealing(0.1, 10, 0.01), 40)[10:].tolist() == [0.01] * 30
    assert values(schedule.linear(0.1, 1.0, 0.5, 10), 40)[10:].tolist() == [0.1 * 0.5] * 30
    assert values(schedule.warmup_cosine(0.1, 5, 20), 40)[20:].tolist() == [0.0] * 20


def test_join_restarts_each_count_at_its_boundary() -> None:
    joined = schedule.join([schedule.constant(1.0), schedule.linear(1.0, 0.0, 1.0, 4), schedule.constant(3.0)], [3, 7])
    expected = [1.0, 1.0, 1.0, 0.0, 0.25, 0.5, 0.75, 3.0, 3.0]
    assert values(joined, 9).tolist() == expected


# (fmp factory, torch class, hyperparameters, our schedule, the matching torch scheduler).
OPTIMIZER_CASES: dict[str, tuple[Callable[..., fmp.optim.Optimizer], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (fmp.optim.sgd, torch.optim.SGD, {"weight_decay": 0.01}),
    "sgd-momentum": (fmp.optim.sgd, torch.optim.SGD, {"momentum": 0.9, "dampening": 0.1}),
    "sgd-nesterov": (fmp.optim.sgd, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "adam": (fmp.optim.adam, torch.optim.Adam, {"weight_decay": 0.1}),
    "adamw": (fmp.optim.adamw, torch.optim.AdamW, {"weight_decay": 0.1}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sched", ["warmup-cosine", "linear-decay"])
@pytest.mark.parametrize("case", OPTIMIZER_CASES)
def test_optimizers_with_a_schedule_match_torch_optim_and_its_scheduler(
    case: str, sched: str, dtype: torch.dtype
) -> None:
    ours, theirs, config = OPTIMIZER_CASES[case]
    lr_schedule, make_scheduler, _ = PAIRS[sched]
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 4, generator=gen).to(dtype), "t": torch.randn((), generator=gen).to(dtype)}
    # torch once with its scheduler, once with our schedule's value written into the param group.
    scheduled = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    manual = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    scheduled_opt = theirs(list(scheduled.values()), lr=BASE_LR, **config)
    manual_opt = theirs(list(manual.values()), lr=BASE_LR, **config)
    scheduler = make_scheduler(scheduled_opt)
    optimizer = ours(lr_schedule, **config)
    state = optimizer.init(params)
    for t in range(10):
        grads = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()}
        manual_opt.param_groups[0]["lr"] = float(lr_schedule(torch.tensor(t, dtype=torch.int32)))
        for group in (scheduled, manual):
            for k, p in group.items():
                p.grad = grads[k].clone()
        scheduled_opt.step()
        scheduler.step()
        manual_opt.step()
        params, state = optimizer.update(grads, state, params)
    assert int(state.step) == 10
    if dtype == torch.float32:
        # The same lr gives the same arithmetic, op for op: bit for bit.
        assert_trees_bitwise_equal(params, {k: p.detach() for k, p in manual.items()})
    else:
        # In bfloat16, torch's CPU add(alpha=-lr) rounds the lr to bfloat16 (and its scalar tail rounds
        # the product too); a tensor lr is applied in float32 (opmath), so results move by a bfloat16 ulp.
        assert_trees_close(params, {k: p.detach() for k, p in manual.items()}, rtol=1e-2, atol=1e-2)
    # torch's scheduler agrees with the closed form to float64 rounding, hence to float32 tolerance here.
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert_trees_close(params, {k: p.detach() for k, p in scheduled.items()}, **tolerance)


def torch_run(
    factory: Callable[..., torch.optim.Optimizer], make_scheduler: Scheduler, batches: list[Any], *, skip: bool
) -> dict[str, torch.Tensor]:
    """torch.optim over `batches`: inf batches are skipped whole, or (skip=False) step the scheduler only."""
    params = {k: torch.nn.Parameter(v) for k, v in mlp_params().items()}
    opt = factory(list(params.values()))
    scheduler = make_scheduler(opt)
    for x, y in batches:
        if bool(torch.isfinite(x).all()):
            opt.zero_grad()
            mlp_loss(params, x, y).backward()
            opt.step()
        elif skip:
            continue
        scheduler.step()  # as GradScaler users do: the scheduler steps whether or not the optimizer did
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.parametrize("case", ["sgd-momentum", "adamw"])
def test_skipped_steps_do_not_advance_the_schedule(case: str) -> None:
    ours, theirs, config = OPTIMIZER_CASES[case]
    lr_schedule, make_scheduler, _ = PAIRS["warmup-cosine"]
    optimizer = ours(lr_schedule, **config)
    batches = list(mlp_batches(16, overflow_every=3))
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    skipped = 0
    for x, y in batches:
        state, info = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
        skipped += not bool(info.grads_finite)
    assert skipped == 5 and int(state.opt_state.step) == 11
    factory = functools.partial(theirs, lr=BASE_LR, **config)
    expected = torch_run(factory, make_scheduler, batches, skip=True)
    assert_trees_close(state.params, expected, rtol=1e-5, atol=1e-6)
    # The run whose scheduler also counts the skipped steps, as with GradScaler, ends elsewhere.
    counting_skips = torch_run(factory, make_scheduler, batches, skip=False)
    assert not all(torch.allclose(state.params[k], counting_skips[k], rtol=1e-3) for k in expected)


def test_the_schedule_sees_the_applied_steps_before_each_update() -> None:
    seen: list[int] = []

    def recording(count: torch.Tensor) -> torch.Tensor:  # eager only: it reads the count on the host
        seen.append(int(count))
        return torch.full((), 0.01, dtype=torch.float64)

    optimizer = fmp.optim.sgd(recording)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    assert seen == [0, 1]  # init checks the first counts' lr
    seen.clear()
    assert isinstance(state.opt_state, fmp.optim.SgdState) and state.opt_state.momentum == ()
    for x, y in mlp_batches(7, overflow_every=3):
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
    # Steps 2 and 5 overflow: the update they computed was dropped, and the count with it.
    assert seen == [0, 1, 2, 2, 3, 4, 4]
    assert int(state.opt_state.step) == 5


def test_sgd_with_a_schedule_keeps_state_so_mixed_precision_step_refuses_it() -> None:
    params, (x, y) = mlp_params(), next(mlp_batches(1, 0))
    with pytest.raises(ValueError, match="takes a stateless optimizer"):
        fmp.mixed_precision_step(
            mlp_loss,
            params,
            fmp.DynamicLossScale.create(),
            x,
            y,
            policy=fmp.Policy(),
            optimizer=fmp.optim.sgd(schedule.constant(0.1)),
        )


@pytest.mark.compiled
def test_compiled_step_with_a_schedule_compiles_once() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    optimizer = fmp.optim.adamw(schedule.warmup_cosine(1e-2, 2, 8, start_factor=0.1))
    step = functools.partial(fmp.train_step, mlp_loss, policy=fmp.Policy(), optimizer=optimizer)
    compiled = torch.compile(step, fullgraph=True)
    eager_state = compiled_state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    for x, y in mlp_batches(6, overflow_every=4):
        eager_state, _ = step(eager_state, x, y)
        compiled_state, _ = compiled(compiled_state, x, y)
    assert int(compiled_state.opt_state.step) == 5
    assert_trees_close(compiled_state.params, eager_state.params, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@st.composite
def linear_args(draw: st.DrawFn) -> tuple[float, float, float, int]:
    lr = draw(st.floats(0.0, 10.0))
    return lr, draw(st.floats(0.0, 2.0)), draw(st.floats(0.0, 2.0)), draw(st.integers(1, 60))


def assert_within(v: torch.Tensor, low: float, high: float) -> None:
    slack = 1e-12 * max(abs(low), abs(high))  # a - b + b may round one ulp past b
    assert bool((v >= low - slack).all()) and bool((v <= high + slack).all())


def assert_monotone(v: torch.Tensor, *, increasing: bool) -> None:
    steps = v.diff() if increasing else -v.diff()
    assert bool((steps >= -1e-12 * v.abs().max()).all())


@given(linear_args())
def test_linear_stays_between_its_factors_and_is_monotone(args: tuple[float, float, float, int]) -> None:
    lr, start, end, total = args
    v = values(schedule.linear(lr, start, end, total), total + 10)
    assert_within(v, lr * min(start, end), lr * max(start, end))
    assert_monotone(v, increasing=end >= start)
    assert math.isclose(float(v[0]), lr * start, rel_tol=1e-12) and float(v[-1]) == float(v[total])


@given(
    st.floats(0.0, 10.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 40),
    st.integers(1, 200),
)
def test_warmup_cosine_rises_to_its_peak_then_decays_to_eta_min(
    lr: float, start_factor: float, eta_fraction: float, warmup: int, decay: int
) -> None:
    eta_min = lr * eta_fraction
    v = values(schedule.warmup_cosine(lr, warmup, warmup + decay, start_factor=start_factor, eta_min=eta_min), 300)
    assert_within(v, min(lr * start_factor, eta_min), lr)
    assert_monotone(v[: warmup + 1], increasing=True)
    assert_monotone(v[warmup:], increasing=False)
    assert math.isclose(float(v[warmup]), lr, rel_tol=1e-12)
    assert math.isclose(float(v[-1]), eta_min, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: fmp.optim.sgd("fast"), TypeError, "lr must be a real number or a schedule"),
        (lambda: fmp.optim.adamw(torch.tensor(0.1)), TypeError, "lr must be a real number or a schedule.*Tensor"),
        (lambda: schedule.constant(-1.0), ValueError, r"lr must be in \[0.0, inf\)"),
        (lambda: schedule.linear(0.1, total_iters=0), ValueError, r"total_iters must be in \[1, "),
        (lambda: schedule.linear(0.1, start_factor=-0.5), ValueError, "start_factor must be in"),
        (lambda: schedule.exponential(0.1, 1.5), ValueError, "gamma must be in"),
        (lambda: schedule.cosine_annealing(0.1, 1.5), TypeError, "t_max must be an int"),
        (lambda: schedule.cosine_annealing(0.1, 10, eta_min=float("nan")), ValueError, "eta_min must be in"),
        (lambda: schedule.warmup_cosine(0.1, 10, 10), ValueError, r"total_steps must be in \[11, "),
        (lambda: schedule.warmup_cosine(0.1, 1, 10, start_factor=2.0), ValueError, "start_factor must be in"),
        (lambda: schedule.join([], []), ValueError, "at least one schedule"),
        (lambda: schedule.join([schedule.constant(0.1)], [5]), ValueError, "one boundary fewer"),
        (lambda: schedule.join([schedule.constant(0.1), 0.2], [5]), TypeError, r"schedules\[1\] must be a callable"),
        (lambda: schedule.join([schedule.constant(0.1)] * 3, [5, 5]), ValueError, "strictly increasing"),
        (lambda: schedule.join([schedule.constant(0.1)] * 2, [0]), ValueError, r"boundaries\[0\] must be in"),
        (lambda: schedule.join(schedule.constant(0.1), []), TypeError, "schedules must be a sequence"),
        (lambda: schedule.join([schedule.constant(0.1)] * 2, 10), TypeError, "boundaries must be a sequence"),
    ],
)
def test_bad_arguments_are_named(make: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize(
    ("bad_schedule", "error", "message"),
    [
        (lambda count: 0.1, TypeError, "must return a 0-dim floating tensor.*got float"),
        (lambda count: torch.full((2,), 0.1), ValueError, r"shape=\(2,\)"),
        (lambda count: count, ValueError, "dtype=torch.int32"),
        (schedule.join([schedule.constant(0.1), lambda c: 0.2], [1]), TypeError, r"schedules\[1\] must return"),
        (
            lambda count: torch.tensor(0.1, device="meta"),
            ValueError,
            "returned a tensor on meta for a step count on cpu",
        ),
    ],
)
@pytest.mark.parametrize("factory", [fmp.optim.sgd, functools.partial(fmp.optim.sgd, momentum=0.9), fmp.optim.adamw])
def test_a_schedule_returning_no_scalar_tensor_is_named(
    factory: Callable[..., fmp.optim.Optimizer], bad_schedule: Any, error: type[Exception], message: str
) -> None:
    # By init, which calls the schedule at the first counts, and by update at any other count.
    params = {"w": torch.ones(2)}
    optimizer = factory(bad_schedule)
    with pytest.raises(error, match=message):
        optimizer.init(params)
    later = factory(schedule.constant(0.1)).init(params)._replace(step=torch.tensor(7, dtype=torch.int32))
    with pytest.raises(error, match=message):
        optimizer.update(params, later, params)


@pytest.mark.parametrize(
    ("bad_schedule", "message"),
    [
        (lambda count: 1e-3 * torch.rsqrt(count.double()), r"^\w[^:]*: the lr schedule returned inf at count 0.*rsqrt"),
        (lambda count: 0.1 - 0.2 * count.double(), r"returned -0\.1 at count 1; an lr must be a finite number >= 0"),
        (lambda count: torch.tensor(float("nan")), "returned nan at count 0"),
    ],
)
@pytest.mark.parametrize("factory", [fmp.optim.sgd, fmp.optim.adamw])
def test_an_infinite_nan_or_negative_lr_at_the_first_counts_is_named_by_init(
    factory: Callable[..., fmp.optim.Optimizer], bad_schedule: Any, message: str
) -> None:
    optimizer = factory(bad_schedule)
    with pytest.raises(ValueError, match=message):
        fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())


def test_the_first_counts_are_read_only_where_they_have_values() -> None:
    # On the meta device (a shape-only run) the schedule has no value to read: init passes.
    meta_params = {"w": torch.ones(2, device="meta")}
    optimizer = fmp.optim.adamw(lambda count: 0.1 * torch.ones_like(count, dtype=torch.float64))
    assert optimizer.init(meta_params).step.is_meta


def test_a_schedule_takes_an_integer_count_and_sgd_rejects_a_foreign_state() -> None:
    with pytest.raises(TypeError, match=r"integer tensor, got a torch\.float32 tensor"):
        schedule.linear(0.1)(torch.tensor(1.0))
    params = {"w": torch.ones(2)}
    momentum_state = fmp.optim.sgd(0.1, momentum=0.9).init(params)
    with pytest.raises(TypeError, match="keeps no momentum buffers"):
        fmp.optim.sgd(schedule.constant(0.1)).update(params, momentum_state, params)
