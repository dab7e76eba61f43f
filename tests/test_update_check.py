"""The update checked too: a non-finite update from finite gradients is skipped, counted and reported."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from conftest import assert_trees_bitwise_equal
from conftest import mlp_loss
from conftest import mlp_params

import fmp
import fmp.distributed

F32 = fmp.Policy()
ADAM = fmp.optim.adam(1e-3)
BATCH = (torch.ones(2, 8), torch.ones(2, 1))


def poisoned(optimizer: fmp.optim.Optimizer = ADAM, **create: int) -> fmp.TrainState:
    """A state whose Adam first moment holds a NaN (as a corrupted checkpoint or a bad restore leaves it)."""
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(8.0), **create)
    exp_avg = dict(
        state.opt_state.exp_avg,
        w1=state.opt_state.exp_avg["w1"].clone().index_fill_(0, torch.tensor([2]), float("nan")),
    )
    return state._replace(opt_state=state.opt_state._replace(exp_avg=exp_avg))


def test_the_check_is_opt_in_everywhere() -> None:
    for step in (fmp.train_step, fmp.mixed_precision_step, fmp.distributed.train_step):
        assert inspect.signature(step).parameters["check_update"].default is False


@pytest.mark.parametrize("donate", [False, True])
def test_a_nan_moment_skips_the_step_without_backing_off(donate: bool) -> None:
    state = poisoned()
    before = torch.utils._pytree.tree_map(torch.clone, (state.params, state.opt_state))
    expected_scaler = state.scaler.adjust(torch.tensor(True))
    new, info = fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=ADAM, donate=donate, check_update=True)
    assert bool(info.grads_finite) and not bool(info.applied)
    assert_trees_bitwise_equal((new.params, new.opt_state), before)  # NaN kept where it was, nothing spread
    assert_trees_bitwise_equal(new.scaler, expected_scaler)  # the gradients were fine: no backoff
    counts = new.counts
    assert [int(counts.applied), int(counts.skipped), int(counts.stalled), int(counts.bad_update)] == [0, 1, 1, 1]
    assert int(counts.bad_scale) == 0
    with pytest.raises(fmp.LossScaleStalledError, match=r"1 of them had finite gradients but a non-finite update"):
        fmp.raise_if_stalled(new, patience=1)


def test_without_the_check_the_nan_is_applied() -> None:
    new, info = fmp.train_step(mlp_loss, poisoned(), *BATCH, policy=F32, optimizer=ADAM)
    assert bool(info.applied) and not bool(fmp.all_finite(new.params))
    assert int(new.counts.skipped) == int(new.counts.bad_update) == 0


def test_an_overflowing_update_of_a_stateless_optimizer_is_skipped() -> None:
    # -1e38 - 1.5e38 * 2 overflows float32 from a finite gradient: mixed_precision_step keeps the params.
    huge = fmp.optim.sgd(1.5e38)
    params, x = {"w": torch.tensor([-1e38, 1.0])}, torch.tensor([2.0, 2.0])

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * x).sum()

    new_params, _ = fmp.mixed_precision_step(
        loss_fn, params, fmp.NoOpLossScale(), x, policy=F32, optimizer=huge, check_update=True
    )
    assert_trees_bitwise_equal(new_params, params)
    unchecked, _ = fmp.mixed_precision_step(loss_fn, params, fmp.NoOpLossScale(), x, policy=F32, optimizer=huge)
    assert not bool(fmp.all_finite(unchecked))


def test_a_window_whose_update_is_not_finite_is_skipped_at_its_end() -> None:
    state = poisoned(accumulation_steps=2)
    for _ in range(2):
        state, info = fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=ADAM, check_update=True)
    assert not bool(info.applied) and bool(info.grads_finite)
    assert [int(state.counts.skipped), int(state.counts.bad_update)] == [1, 1]


def test_overflowing_gradients_are_not_counted_as_a_bad_update() -> None:
    x, y = BATCH
    new, info = fmp.train_step(mlp_loss, poisoned(), x * float("inf"), y, policy=F32, optimizer=ADAM, check_update=True)
    assert not bool(info.applied) and float(new.scaler.loss_scale) == 4.0
    assert [int(new.counts.skipped), int(new.counts.bad_update)] == [1, 0]


def test_check_update_must_be_a_bool() -> None:
    state = fmp.TrainState.create(mlp_params(), ADAM, fmp.DynamicLossScale.create())
    with pytest.raises(TypeError, match="check_update must be a bool"):
        fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=ADAM, check_update=1)  # type: ignore[arg-type]


@pytest.mark.compiled
def test_the_compiled_step_checks_the_update_without_a_graph_break() -> None:
    step = torch.compile(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=ADAM, check_update=True),
        backend="aot_eager",
        fullgraph=True,
    )
    state = poisoned()
    new, info = step(state, *BATCH)
    assert not bool(info.applied) and int(new.counts.bad_update) == 1
    assert_trees_bitwise_equal(new.params, state.params)
    healthy = fmp.TrainState.create(mlp_params(), ADAM, fmp.DynamicLossScale.create(8.0))
    new, info = step(healthy, *BATCH)
    assert bool(info.applied) and int(new.counts.bad_update) == 0
