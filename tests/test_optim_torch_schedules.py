"""fmp.interop.from_torch_state_dict with learning-rate schedulers: saved mid-schedule, and schedules given as lr."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _torch_optim_runs import make_model
from _torch_optim_runs import params_in_group_order
from _torch_optim_runs import step_both_and_compare
from _torch_optim_runs import torch_run
from _torch_optim_runs import torch_step

import fmp


@pytest.mark.parametrize(
    "scheduler",
    [
        functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=1e-2, total_steps=10),
        functools.partial(torch.optim.lr_scheduler.CyclicLR, base_lr=1e-4, max_lr=1e-2),
        functools.partial(torch.optim.swa_utils.SWALR, swa_lr=1e-3),
    ],
    ids=["OneCycleLR", "CyclicLR", "SWALR"],
)
def test_a_state_dict_saved_with_a_scheduler_converts_at_its_current_settings(scheduler: Any) -> None:
    model, optimizer, batches = torch_run("adamw", steps=0)
    schedule = scheduler(optimizer)
    for x in batches[:1] * 2:
        torch_step(model, optimizer, x, schedule)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict("adamw", optimizer.state_dict(), params, 2)
    # The scheduler's bookkeeping is left behind; lr and betas are taken as they stand now.
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    step_both_and_compare(model, optimizer, state, fmp_optimizer, batches[0])


def test_a_scheduled_run_goes_on_with_the_schedule_given_as_lr() -> None:
    # torch.optim + LinearLR warmup over two groups, checkpointed mid-warmup; fmp goes on with the
    # same schedules, whose counts (Adam's applied steps) pick up where torch's left off.
    torch.manual_seed(0)
    model = make_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "lr": 1e-3, "weight_decay": 0.0}], lr=1e-2)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=5)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(6)]
    for x in batches[:3]:
        torch_step(model, optimizer, x, warmup)
    params = params_in_group_order(model, optimizer)
    schedules = {
        "group0": fmp.optim.schedule.linear(1e-2, start_factor=0.25, total_iters=5),
        "group1": fmp.optim.schedule.linear(1e-3, start_factor=0.25, total_iters=5),
    }
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(
        "adamw", optimizer.state_dict(), params, 3, lr=schedules
    )
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().mean()

    for x in batches[3:]:  # the warmup's last steps and one past it
        torch_step(model, optimizer, x, warmup)
        state, _ = fmp.train_step(loss_fn, state, x, policy=fmp.Policy(), optimizer=fmp_optimizer)
    for name, p in model.named_parameters():  # closed-form lr against LinearLR's running product
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"lr names groups \['decay'\]; the state_dict's groups are \['group0', "):
        fmp.interop.from_torch_state_dict("adamw", optimizer.state_dict(), params, 6, lr={"decay": 1e-3})


def test_plain_sgd_given_a_schedule_counts_on_from_torchs_applied_steps() -> None:
    model = make_model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(
        "sgd", plain.state_dict(), params, 7, lr=fmp.optim.schedule.exponential(0.1, 0.5)
    )
    assert int(opt_state.step) == 7 and opt_state.momentum == ()
    new_params, _ = fmp_optimizer.update({k: torch.ones_like(v) for k, v in params.items()}, opt_state, params)
    name = next(iter(params))
    torch.testing.assert_close(params[name] - new_params[name], torch.full_like(params[name], 0.1 * 0.5**7))


def exponential_run(late_group: bool, skipped: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Two Adam groups under ExponentialLR(0.5), three applied steps; the body frozen for the first
    if `late_group`; the scheduler stepped `skipped` more times, as for steps torch.amp skipped."""
    torch.manual_seed(0)
    model = make_model()
    head, body = list(model[3].parameters()), [p for m in list(model)[:3] for p in m.parameters()]
    optimizer = torch.optim.Adam([{"params": head}, {"params": body}], lr=0.1)
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    for step in range(3):
        for p in body:
            p.requires_grad_(step > 0 or not late_group)
        torch_step(model, optimizer, torch.randn(4, 16), decay)
    for _ in range(skipped):
        decay.step()
    return model, optimizer, decay


@pytest.mark.parametrize(("late_group", "skipped"), [(True, 0), (False, 2)], ids=["late-group", "skipped-steps"])
def test_a_schedule_reads_torchs_scheduler_count_in_every_group(late_group: bool, skipped: int) -> None:
    # A group that started late has a smaller Adam count, and torch's scheduler counted steps
    # torch.amp skipped: the schedule must read the scheduler's count all the same.
    model, optimizer, decay = exponential_run(late_group, skipped)
    params = params_in_group_order(model, optimizer)
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(
        "adam",
        optimizer.state_dict(),
        params,
        3,
        lr=fmp.optim.schedule.exponential(0.1, 0.5),
        lr_count=decay.last_epoch,
    )
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    step_both_and_compare(model, optimizer, state, fmp_optimizer, torch.randn(4, 16))


def test_a_schedule_is_checked_where_the_run_resumes() -> None:
    model, optimizer, _ = exponential_run(False, 0)
    params = params_in_group_order(model, optimizer)
    overshoots = lambda count: 0.1 - 0.05 * count.double()  # noqa: E731  (negative from count 3 on)
    with pytest.raises(ValueError, match=r"lr= given for param group 0: the lr schedule returned -0\.05\d* at count 3"):
        fmp.interop.from_torch_state_dict("adam", optimizer.state_dict(), params, 3, lr=overshoots)


def test_a_scheduler_started_mid_run_and_a_replaced_saved_lr_are_taken() -> None:
    # Three applied steps, the scheduler (a warmup) created after two: lr_count 1 < applied_steps.
    model, optimizer, _ = exponential_run(False, 0)
    params = params_in_group_order(model, optimizer)
    warmup = fmp.optim.schedule.linear(0.1, start_factor=0.1, total_iters=10)  # negative below count 0
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(
        "adam", optimizer.state_dict(), params, 3, lr=warmup, lr_count=1
    )
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    _, info = fmp.train_step(
        lambda p, x: torch.func.functional_call(model, p, (x,)).square().mean(),
        state,
        torch.randn(4, 16),
        policy=fmp.Policy(),
        optimizer=fmp_optimizer,
    )
    assert bool(info.applied)
    # A saved lr that fmp would refuse is no matter when lr= replaces it.
    saved = optimizer.state_dict()
    saved["param_groups"][0]["lr"] = -0.05
    fmp.interop.from_torch_state_dict("adam", saved, params, 3, lr=warmup)
    with pytest.raises(ValueError, match=r"the state_dict's param group 0: lr must be in \[0\.0, inf\), got -0\.05"):
        fmp.interop.from_torch_state_dict("adam", saved, params, 3)
    with pytest.raises(ValueError, match="lr_count is the count a schedule given as lr= reads; without one"):
        fmp.interop.from_torch_state_dict("adam", optimizer.state_dict(), params, 3, lr_count=5)
    negative_from_11 = lambda count: 0.1 - 0.01 * count.double()  # noqa: E731
    with pytest.raises(ValueError, match=r"returned -0\.0099\d* at count 11"):  # the scheduler's count, not fmp's
        fmp.interop.from_torch_state_dict("adam", optimizer.state_dict(), params, 3, lr=negative_from_11, lr_count=11)
