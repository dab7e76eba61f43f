"""Skip accounting on device, and the opt-in fail-fast when steps overflow at the minimum scale."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params

import fmp

F32 = fmp.Policy()
ADAM = fmp.optim.adam(1e-3)


def run(state: fmp.TrainState, finite: list[bool]) -> fmp.TrainState:
    x, y = torch.ones(2, 8), torch.ones(2, 1)
    for ok in finite:
        state, _ = fmp.train_step(mlp_loss, state, x if ok else x * float("nan"), y, policy=F32, optimizer=ADAM)
    return state


@hypothesis.given(st.lists(st.booleans(), max_size=20), st.integers(1, 3))
def test_counts_follow_a_reference_model(finite: list[bool], hysteresis: int) -> None:
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**3, min_scale=1.0, hysteresis=hysteresis)
    state = run(fmp.TrainState.create(mlp_params(), ADAM, scaler), finite)
    applied = skipped = streak = stalled = 0
    scale = 2.0**3
    for ok in finite:
        if ok:
            applied, streak, stalled = applied + 1, 0, 0
            continue
        skipped, streak = skipped + 1, streak + 1
        stalled = stalled + 1 if scale == 1.0 else 0  # the scale this step ran with was the minimum
        if streak >= hysteresis:
            scale = max(scale / 2, 1.0)
    counts = state.counts
    assert [int(counts.applied), int(counts.skipped), int(counts.overflow_streak), int(counts.stalled)] == [
        applied,
        skipped,
        streak,
        stalled,
    ]
    assert int(state.opt_state.step) == applied  # the optimizer (and its schedule) counts applied steps only
    assert {t.dtype for t in counts} == {torch.int64} and {t.shape for t in counts} == {torch.Size([])}


@hypothesis.given(
    st.lists(st.integers(0, 2**40), min_size=6, max_size=6),
    st.lists(st.tuples(*[st.booleans()] * 5, st.booleans(), st.booleans()), max_size=12),
)
def test_advance_follows_a_reference_model(start: list[int], calls: list[tuple[bool, ...]]) -> None:
    counts = fmp.StepCounts(*(torch.tensor(value, dtype=torch.int64) for value in start))
    applied, skipped, streak, stalled, bad_scale, bad_update = start
    for stepped, finite, at_min, scale_bad, update_bad, every_call_steps, update_unchecked in calls:
        stepped, update_bad = stepped or every_call_steps, update_bad and not update_unchecked
        applied_now = stepped and finite
        flags = [torch.tensor(flag) for flag in (stepped, applied_now, at_min, scale_bad, update_bad)]
        # None stands for a flag the step knows: every call steps, or the update was not checked.
        counts = counts.advance(
            None if every_call_steps else flags[0], *flags[1:4], None if update_unchecked else flags[4]
        )
        if not stepped:  # a micro-batch inside an accumulation window moves no count
            continue
        if applied_now:
            applied, streak, stalled, bad_scale, bad_update = applied + 1, 0, 0, 0, 0
            continue
        skipped, streak = skipped + 1, streak + 1
        if at_min or scale_bad or update_bad:
            stalled, bad_scale, bad_update = stalled + 1, bad_scale + scale_bad, bad_update + update_bad
        else:
            stalled, bad_scale, bad_update = 0, 0, 0
    assert [int(count) for count in counts] == [applied, skipped, streak, stalled, bad_scale, bad_update]
    assert {t.dtype for t in counts} == {torch.int64} and {t.shape for t in counts} == {torch.Size([])}


def test_a_window_that_overflowed_at_the_minimum_scale_counts_as_stalled() -> None:
    # The window's first micro-batch overflows, its last is finite: the window is skipped, and
    # since the scale was already at its minimum, it is stalled.
    sgd = fmp.optim.sgd(0.1)
    scaler = fmp.DynamicLossScale.create(init_scale=1.0, min_scale=1.0)
    state = fmp.TrainState.create({"w": torch.ones(2)}, sgd, scaler, accumulation_steps=2)
    for x in (torch.tensor([float("nan"), 1.0]), torch.ones(2)):
        state, info = fmp.train_step(lambda p, x: (p["w"] * x).sum(), state, x, policy=F32, optimizer=sgd)
    assert not bool(info.applied) and bool(info.grads_finite)
    assert [int(state.counts.skipped), int(state.counts.stalled)] == [1, 1]


def test_a_skip_with_the_overflowing_scale_above_its_minimum_ends_a_stall() -> None:
    # Two losses: the first overflows at its minimum (stalled), then the second overflows with room
    # to back off; that skip is no stall, so the count starts again.
    sgd = fmp.optim.sgd(0.1)
    at_minimum = fmp.DynamicLossScale.create(init_scale=1.0, min_scale=1.0)
    with_room = fmp.DynamicLossScale.create(init_scale=8.0, min_scale=1.0)
    state = fmp.TrainState.create({"w": torch.ones(2)}, sgd, (at_minimum, with_room))
    nan, one = torch.tensor([float("nan"), 1.0]), torch.ones(2)
    stalled = []
    for xa, xb in ((nan, one), (one, nan)):
        state, info = fmp.train_step(
            lambda p, xa, xb: ((p["w"] * xa).sum(), (p["w"] * xb).sum()), state, xa, xb, policy=F32, optimizer=sgd
        )
        assert not bool(info.applied)
        stalled.append(int(state.counts.stalled))
    assert stalled == [1, 0] and int(state.counts.skipped) == 2


def test_a_static_scale_is_always_at_its_minimum() -> None:
    state = run(
        fmp.TrainState.create(mlp_params(), ADAM, fmp.StaticLossScale.create(128.0)), [False, False, True, False]
    )
    assert int(state.counts.stalled) == 1 and int(state.counts.skipped) == 3
    with pytest.raises(
        fmp.LossScaleStalledError,
        match=r"\(128\.0\).*use a lower fixed scale or a DynamicLossScale\. fmp\.debug\.locate_nonfinite",
    ):
        fmp.raise_if_stalled(state, patience=1)


def test_raise_if_stalled_fails_fast_only_past_patience() -> None:
    scaler = fmp.DynamicLossScale.create(init_scale=4.0, min_scale=1.0)
    state = run(fmp.TrainState.create(mlp_params(), ADAM, scaler), [False] * 4)
    # Scales 4, 2, 1, 1: the last two steps overflowed at the minimum.
    assert int(state.counts.stalled) == 2
    fmp.raise_if_stalled(state, patience=3)
    with pytest.raises(
        fmp.LossScaleStalledError,
        match=r"last 2 optimizer steps were all skipped.*\(1\.0\).*min_scale\. fmp\.debug\.locate_nonfinite",
    ):
        fmp.raise_if_stalled(state, patience=2)
    recovered = run(state, [True])
    assert int(recovered.counts.stalled) == 0
    fmp.raise_if_stalled(recovered, patience=1)


def test_raise_if_stalled_names_the_ensemble_members() -> None:
    members = [
        fmp.TrainState.create(mlp_params(seed=s), ADAM, fmp.DynamicLossScale.create(init_scale=1.0, min_scale=1.0))
        for s in range(3)
    ]
    state = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *members)
    step = torch.func.vmap(functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=ADAM))
    x, y = next(mlp_batches(1, 0))
    xs = torch.stack([x, x * float("inf"), x])
    for _ in range(2):
        state, _ = step(state, xs, torch.stack([y] * 3))
    assert state.counts.stalled.tolist() == [0, 2, 0]
    with pytest.raises(fmp.LossScaleStalledError, match=r"\(ensemble members \[1\]\)"):
        fmp.raise_if_stalled(state, patience=2)


def test_raise_if_stalled_checks_its_arguments() -> None:
    state = fmp.TrainState.create(mlp_params(), ADAM, fmp.NoOpLossScale())
    with pytest.raises(ValueError, match=r"patience must be in \[1, "):
        fmp.raise_if_stalled(state, patience=0)
    with pytest.raises(TypeError, match="patience must be an int, got float"):
        fmp.raise_if_stalled(state, patience=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state must be an fmp\.TrainState, got dict"):
        fmp.raise_if_stalled({}, patience=2)  # type: ignore[arg-type]
