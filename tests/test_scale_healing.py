"""Scales that cannot get stuck: refused at entry, put back in range by the step, seen by raise_if_stalled."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from conftest import assert_trees_bitwise_equal
from conftest import mlp_loss
from conftest import mlp_params

import fmp
from fmp._struct import replace

TINY = torch.finfo(torch.float32).tiny
MAX = torch.finfo(torch.float32).max
F32 = fmp.Policy()
SGD = fmp.optim.sgd(0.1)
BATCH = (torch.ones(2, 8), torch.ones(2, 1))

any_scale = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, TINY / 8, MAX, 2.0**16]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)


def crafted(scaler: fmp.LossScale, value: float) -> fmp.LossScale:
    """`scaler` with its scale replaced by `value`, as the raw constructor or a corrupted checkpoint gives it."""
    return replace(scaler, loss_scale=torch.tensor(value, dtype=torch.float32))


@hypothesis.given(
    any_scale,
    st.lists(st.booleans(), min_size=1, max_size=12),
    st.sampled_from([(TINY, MAX), (1.0, 2.0**10), (2.0**20, 2.0**30)]),
    st.integers(1, 3),
)
def test_one_adjust_puts_any_scale_in_range(
    value: float, steps: list[bool], bounds: tuple[float, float], hysteresis: int
) -> None:
    low, high = bounds
    state = crafted(
        fmp.DynamicLossScale.create(low, growth_interval=2, min_scale=low, max_scale=high, hysteresis=hysteresis), value
    )
    static = crafted(fmp.StaticLossScale.create(1.0), value)
    in_range = low <= value <= high
    for index, finite in enumerate(steps):
        flag = torch.tensor(finite)
        new, new_static = state.adjust(flag), static.adjust(flag)
        scale = float(new.loss_scale)
        assert low <= scale <= high  # NaN fails this
        assert TINY <= float(new_static.loss_scale) <= MAX
        if index == 0 and not in_range:
            # Restarted as create builds it: GradScaler's default scale clamped into the bounds.
            assert scale == min(max(2.0**16, low), high)
            assert int(new.growth_tracker) == int(new.overflow_streak) == 0
        if index == 0 and not TINY <= value <= MAX:
            assert float(new_static.loss_scale) == 1.0
        state, static = new, new_static


@hypothesis.given(st.floats(TINY, MAX, width=32), st.booleans())
def test_a_scale_in_range_adjusts_as_before(value: float, finite: bool) -> None:
    # Within range the result is the clamped GradScaler rule: no reset, same bits as a created state.
    created = fmp.DynamicLossScale.create(value)
    assert_trees_bitwise_equal(
        crafted(created, value).adjust(torch.tensor(finite)), created.adjust(torch.tensor(finite))
    )
    static = fmp.StaticLossScale.create(value)
    assert_trees_bitwise_equal(static.adjust(torch.tensor(finite)), static)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0.0, -4.0])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_train_state_create_refuses_a_bad_scale_naming_the_field(value: float, kind: str) -> None:
    scaler = fmp.StaticLossScale.create(4.0) if kind == "static" else fmp.DynamicLossScale.create(4.0)
    with pytest.raises(ValueError, match=r"^scaler\.loss_scale must be a finite scale in .*\.create\(\.\.\.\)"):
        fmp.TrainState.create(mlp_params(), SGD, crafted(scaler, value))
    with pytest.raises(ValueError, match=r"^scaler\[1\]\.loss_scale must be a finite scale"):
        fmp.TrainState.create(mlp_params(), SGD, (fmp.NoOpLossScale(), crafted(scaler, value)))


def test_complex_and_grad_requiring_scales_are_refused() -> None:
    complex_scale = torch.tensor(4.0 + 0j)
    learned = torch.tensor(4.0, requires_grad=True)
    for create in (fmp.StaticLossScale.create, fmp.DynamicLossScale.create):
        with pytest.raises(ValueError, match=r"is a torch.complex64 tensor; a loss scale is a real number"):
            create(complex_scale)
        with pytest.raises(ValueError, match=r"requires grad; a loss scale is state, not a parameter: pass .*detach"):
            create(learned)
    raw = fmp.StaticLossScale(complex_scale)
    with pytest.raises(ValueError, match=r"scaler\.loss_scale must be a float32 tensor, got torch.complex64"):
        fmp.TrainState.create(mlp_params(), SGD, raw)
    with pytest.raises(ValueError, match=r"scaler\.loss_scale requires grad"):
        fmp.TrainState.create(mlp_params(), SGD, replace(fmp.DynamicLossScale.create(), loss_scale=learned))


def crafted_state(value: float, scaler: fmp.LossScale | None = None, **create: int) -> fmp.TrainState:
    """A state whose scale went bad after TrainState.create checked it."""
    good = fmp.TrainState.create(mlp_params(), SGD, scaler or fmp.DynamicLossScale.create(), **create)
    return good._replace(scaler=crafted(good.scaler, value))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -4.0])
def test_a_step_with_a_bad_scale_is_skipped_counted_as_stalled_and_heals(value: float) -> None:
    state = crafted_state(value)
    new, info = fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=SGD)
    assert not bool(info.applied) and not bool(info.grads_finite)
    assert torch.equal(info.loss_scale, torch.tensor(value)) or bool(info.loss_scale.isnan())  # the scale it ran with
    assert_trees_bitwise_equal(new.params, state.params)
    assert float(new.scaler.loss_scale) == 2.0**16
    counts = new.counts
    assert [int(counts.skipped), int(counts.stalled), int(counts.bad_scale), int(counts.bad_update)] == [1, 1, 1, 0]
    with pytest.raises(
        fmp.LossScaleStalledError, match=r"1 of them ran with a loss scale that was itself out of range"
    ):
        fmp.raise_if_stalled(new, patience=1)
    healed, info = fmp.train_step(mlp_loss, new, *BATCH, policy=F32, optimizer=SGD)
    assert bool(info.applied) and int(healed.counts.stalled) == int(healed.counts.bad_scale) == 0
    fmp.raise_if_stalled(healed, patience=1)


def test_a_bad_static_scale_falls_back_to_one() -> None:
    state = crafted_state(float("nan"), fmp.StaticLossScale.create(128.0))
    state, info = fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=SGD)
    assert not bool(info.applied) and float(state.scaler.loss_scale) == 1.0
    assert int(state.counts.bad_scale) == 1
    state, info = fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=SGD)
    assert bool(info.applied)


def test_a_window_with_a_bad_scale_is_skipped_and_the_scale_reset_at_its_end() -> None:
    state = crafted_state(-1.0, accumulation_steps=2)
    for _ in range(2):
        state, info = fmp.train_step(mlp_loss, state, *BATCH, policy=F32, optimizer=SGD)
    assert not bool(info.applied) and float(state.scaler.loss_scale) == 2.0**16
    assert [int(state.counts.skipped), int(state.counts.bad_scale)] == [1, 1]


def test_only_the_member_with_a_bad_scale_heals_under_vmap() -> None:
    members = [fmp.TrainState.create(mlp_params(seed=s), SGD, fmp.DynamicLossScale.create(8.0)) for s in range(3)]
    members[1] = members[1]._replace(scaler=crafted(members[1].scaler, float("nan")))
    state = fmp.stack_trees(members)
    step = torch.func.vmap(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=SGD), in_dims=(0, None, None)
    )
    state, info = step(state, *BATCH)
    assert info.applied.tolist() == [True, False, True]
    assert state.scaler.loss_scale.tolist() == [8.0, 2.0**16, 8.0]
    assert state.counts.bad_scale.tolist() == [0, 1, 0]
    with pytest.raises(fmp.LossScaleStalledError, match=r"\(ensemble members \[1\]\).*itself out of range"):
        fmp.raise_if_stalled(state, patience=1)


def test_the_reset_traces_without_a_branch() -> None:
    adjust = torch.compile(lambda s, f: s.adjust(f), backend="aot_eager", fullgraph=True)
    nan = crafted(fmp.DynamicLossScale.create(), float("nan"))
    assert float(adjust(nan, torch.tensor(False)).loss_scale) == 2.0**16
    assert float(adjust(fmp.DynamicLossScale.create(4.0), torch.tensor(False)).loss_scale) == 2.0
