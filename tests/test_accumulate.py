"""Gradient accumulation: float32 sums, one skip decision and one scale update per optimizer step."""

from __future__ import annotations

import functools
import io
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

F32 = fmp.Policy()


def pytree_clone(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


SGD = fmp.optim.sgd(0.05, momentum=0.9)


def accumulating_state(steps: int, scaler: Any = None, optimizer: fmp.optim.Optimizer = SGD) -> fmp.TrainState:
    scaler = fmp.DynamicLossScale.create(growth_interval=2) if scaler is None else scaler
    return fmp.TrainState.create(mlp_params(), optimizer, scaler, accumulation_steps=steps)


def test_a_window_of_micro_batches_steps_as_one_batch() -> None:
    """Four micro-batches of 16 update as one batch of 64 (mean of the micro-batch means)."""
    batches = list(mlp_batches(8, 0))
    step = functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=SGD)
    state = accumulating_state(4)
    whole = fmp.TrainState.create(mlp_params(), SGD, fmp.DynamicLossScale.create(growth_interval=2))
    applied = []
    for window in (batches[:4], batches[4:]):
        before = state
        for i, (x, y) in enumerate(window):
            state, info = step(state, x, y)
            applied.append(bool(info.applied))
            if i < 3:  # inside a window nothing but the accumulator moves
                assert_trees_bitwise_equal((state.params, state.opt_state), (before.params, before.opt_state))
                assert torch.equal(state.scaler.loss_scale, before.scaler.loss_scale)
        x, y = torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])
        whole, _ = step(whole, x, y)
        assert_trees_close(state.params, whole.params, **TOLERANCES[torch.float32])
    assert applied == [False, False, False, True] * 2
    assert int(state.counts.applied) == int(state.opt_state.step) == 2 and int(state.counts.skipped) == 0
    # The scale adjusts once per window: growth_interval=2 windows, one growth.
    assert float(state.scaler.loss_scale) == 2.0**17 and int(state.scaler.growth_tracker) == 0
    assert int(state.accumulator.micro_steps) == 0


def test_sums_are_float32_over_bf16_gradients_and_exact() -> None:
    policy = fmp.get_policy("params=bfloat16,compute=bfloat16,output=float32")
    params = policy.cast_to_param(mlp_params())
    scaler = fmp.StaticLossScale.create(2.0**10)
    state = fmp.TrainState.create(params, fmp.optim.sgd(0.1), scaler, accumulation_steps=3)
    assert {t.dtype for t in torch.utils._pytree.tree_leaves(state.accumulator.grads)} == {torch.float32}
    batches = list(mlp_batches(2, 0))
    expected = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in params.items()}
    for x, y in batches:
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=fmp.optim.sgd(0.1))
        grads = fmp.mixed_precision_grad(mlp_loss, params, scaler, x, y, policy=policy).grads
        expected = {k: expected[k] + grads[k].float() for k in expected}
    assert_trees_bitwise_equal(state.accumulator.grads, expected)


def test_scale_trajectory_and_params_match_torch_amp_accumulation() -> None:
    """GradScaler's accumulation recipe: backward per micro-batch, step and update once per window."""
    steps, windows = 3, 8
    batches = list(mlp_batches(steps * windows, 5))  # micro-batches 4, 9, 14, 19 overflow: windows 1, 3, 4, 6
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=2)
    optimizer = fmp.optim.sgd(0.05)
    state = accumulating_state(steps, scaler, optimizer)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in mlp_params().items()}
    torch_optimizer = torch.optim.SGD(params.values(), lr=0.05)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    fmp_scales, torch_scales = [], []
    for i, (x, y) in enumerate(batches):
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=F32, optimizer=optimizer)
        grad_scaler.scale(mlp_loss(params, x, y) / steps).backward()
        if i % steps == steps - 1:
            grad_scaler.step(torch_optimizer)
            grad_scaler.update()
            torch_optimizer.zero_grad()
            fmp_scales.append(float(state.scaler.loss_scale))
            torch_scales.append(grad_scaler.get_scale())
    assert fmp_scales == torch_scales
    assert int(state.counts.skipped) == 4 and int(state.counts.applied) == windows - 4
    assert_trees_close(state.params, {k: v.detach() for k, v in params.items()}, **TOLERANCES[torch.float32])


def test_a_bad_micro_batch_skips_its_whole_window_and_backs_off_once() -> None:
    optimizer = fmp.optim.adamw(1e-2)
    state = accumulating_state(4, fmp.DynamicLossScale.create(init_scale=2.0**8), optimizer)
    batches = list(mlp_batches(12, 0))
    batches[5][0][0, 0] = float("nan")  # the second micro-batch of the second window
    step = functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer)
    for x, y in batches[:4]:
        state, _ = step(state, x, y)
    before = state
    flags = []
    for x, y in batches[4:8]:
        state, info = step(state, x, y)
        flags.append((bool(info.grads_finite), bool(info.applied), float(state.scaler.loss_scale)))
    assert flags == [(True, False, 2.0**8), (False, False, 2.0**8), (True, False, 2.0**8), (True, False, 2.0**7)]
    assert_trees_bitwise_equal((state.params, state.opt_state), (before.params, before.opt_state))
    assert int(state.counts.skipped) == 1 and int(state.counts.overflow_streak) == 1
    # The accumulator starts clean: the next window applies.
    for x, y in batches[8:]:
        state, info = step(state, x, y)
    assert bool(info.applied) and int(state.opt_state.step) == 2 and int(state.counts.overflow_streak) == 0
    assert all(torch.isfinite(p).all() for p in state.params.values())


@hypothesis.given(
    steps=st.integers(1, 4),
    finite=st.lists(st.booleans(), min_size=1, max_size=16),
    growth_interval=st.integers(1, 3),
)
def test_window_flags_drive_the_scale_and_counts(steps: int, finite: list[bool], growth_interval: int) -> None:
    """The scale moves as `adjust` applied once per window to the AND of its micro-batches' flags."""
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=growth_interval)
    state = fmp.TrainState.create(mlp_params(width=2), fmp.optim.sgd(0.1), scaler, accumulation_steps=steps)
    expected, window, applied = scaler, True, 0
    for i, ok in enumerate(finite):
        x = torch.full((1, 2), 1.0 if ok else float("inf"))
        state, info = fmp.train_step(mlp_loss, state, x, torch.ones(1, 1), policy=F32, optimizer=fmp.optim.sgd(0.1))
        window &= ok
        ends = i % steps == steps - 1
        assert bool(info.applied) == (ends and window)
        if ends:
            expected = expected.adjust(torch.tensor(window))
            applied += window
            window = True
        assert_trees_bitwise_equal(state.scaler, expected)
    windows = len(finite) // steps
    assert int(state.counts.applied) == applied and int(state.counts.skipped) == windows - applied


def test_several_losses_accumulate_with_one_flag_per_loss() -> None:
    def two_losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        return mlp_loss(params, x, y), 1e30 * mlp_loss(params, x, y)

    scalers = (fmp.DynamicLossScale.create(init_scale=2.0**8), fmp.DynamicLossScale.create(init_scale=2.0**40))
    state = fmp.TrainState.create(mlp_params(), SGD, scalers, accumulation_steps=2)
    for x, y in mlp_batches(2, 0):
        state, info = fmp.train_step(two_losses, state, x, y, policy=F32, optimizer=SGD)
    # The second loss overflows float32 once scaled by 2**40; only its scale backs off, once.
    assert [float(s.loss_scale) for s in state.scaler] == [2.0**8, 2.0**39]
    assert [int(s.growth_tracker) for s in state.scaler] == [1, 0]
    assert not bool(info.applied) and int(state.counts.skipped) == 1


def test_accumulating_state_round_trips_through_a_weights_only_checkpoint() -> None:
    state = accumulating_state(3, optimizer=fmp.optim.adamw(1e-3))
    for x, y in mlp_batches(4, 0):
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=F32, optimizer=fmp.optim.adamw(1e-3))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_trees_bitwise_equal(loaded, state)
    assert loaded.accumulator.steps == 3 and int(loaded.accumulator.micro_steps) == 1


@pytest.mark.parametrize("steps", [0, -1, 2**31])
def test_accumulation_steps_out_of_range_is_named(steps: int) -> None:
    with pytest.raises(ValueError, match="accumulation_steps must be in"):
        accumulating_state(steps)


def test_an_accumulator_on_another_device_is_named() -> None:
    state = accumulating_state(2)
    on_meta = fmp.TrainState.create(
        torch.utils._pytree.tree_map(lambda t: t.to("meta"), state.params),
        SGD,
        fmp.DynamicLossScale.create(),
        accumulation_steps=2,
    )
    with pytest.raises(ValueError, match=r"grads\['\w+'\] is on cpu, but its sum is on meta: move the accumulator"):
        fmp.train_step(
            mlp_loss,
            state._replace(accumulator=on_meta.accumulator),
            *next(mlp_batches(1, 0)),
            policy=F32,
            optimizer=SGD,
        )


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("steps", 0, ValueError, r"state\.accumulator\.steps must be in \[1, 2147483647\], got 0"),
        ("steps", -1, ValueError, r"state\.accumulator\.steps must be in \[1, 2147483647\], got -1"),
        ("steps", "2", TypeError, r"state\.accumulator\.steps must be an int, got str"),
        ("micro_steps", torch.tensor(0.0), TypeError, r"micro_steps must be a 0-dim int32 tensor, got torch\.float32"),
        ("micro_steps", torch.zeros(2, dtype=torch.int32), ValueError, r"micro_steps has shape \(2,\)"),
        ("grads_finite", torch.tensor(1.0), ValueError, r"state\.accumulator\.grads_finite must be a 0-dim bool"),
    ],
)
def test_a_hand_built_accumulator_is_refused_naming_the_field(
    field: str, value: Any, error: type, message: str
) -> None:
    # steps=0 would divide the window's sum by 0, and a negative one flip the gradients' sign, with
    # no non-finite gradient to skip the step.
    state = accumulating_state(2)
    crafted = state._replace(accumulator=fmp._struct.replace(state.accumulator, **{field: value}))
    kept = pytree_clone(crafted)
    x, y = next(mlp_batches(1, 0))
    with pytest.raises(error, match=message):
        fmp.train_step(mlp_loss, crafted, x, y, policy=F32, optimizer=SGD)
    assert_trees_bitwise_equal(crafted, kept)


def test_accumulation_steps_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="accumulation_steps must be an int, got float"):
        accumulating_state(2.0)  # type: ignore[arg-type]
    state = accumulating_state(1)._replace(accumulator=None)
    with pytest.raises(TypeError, match=r"state.accumulator must be \(\) or a GradientAccumulator, got NoneType"):
        fmp.train_step(mlp_loss, state, *next(mlp_batches(1, 0)), policy=F32, optimizer=SGD)


@pytest.mark.compiled
def test_compiled_donated_accumulation_matches_eager_in_one_graph() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=SGD, donate=True),
        backend=counter,
        fullgraph=True,
    )
    eager_state, compiled_state = accumulating_state(3), accumulating_state(3)
    buffers = [t.data_ptr() for t in torch.utils._pytree.tree_leaves(compiled_state)]
    for x, y in mlp_batches(9, 4):
        eager_state, eager_info = fmp.train_step(mlp_loss, eager_state, x, y, policy=F32, optimizer=SGD)
        compiled_state, info = compiled(compiled_state, x, y)
        assert bool(info.applied) == bool(eager_info.applied)
    assert counter.frame_count == 1
    # Inductor may reorder float32 reductions: values within rounding, decisions and counts exact.
    assert_trees_close(compiled_state, eager_state, **TOLERANCES[torch.float32])
    assert_trees_bitwise_equal((compiled_state.scaler, compiled_state.counts), (eager_state.scaler, eager_state.counts))
    assert [t.data_ptr() for t in torch.utils._pytree.tree_leaves(compiled_state)] == buffers


def test_eager_donated_accumulation_equals_the_pure_step_bit_for_bit() -> None:
    # The params and optimizer state are written in place; the sums come back new, so a step that
    # raises after adding a micro-batch (in the optimizer, say) leaves the donated state as it was.
    pure, donated = accumulating_state(3), accumulating_state(3)
    for x, y in mlp_batches(9, 4):
        pure, pure_info = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=SGD)
        donated, info = fmp.train_step(mlp_loss, donated, x, y, policy=F32, optimizer=SGD, donate=True)
        assert_trees_bitwise_equal((donated, info), (pure, pure_info))
    assert int(donated.counts.applied) == 1 and int(donated.counts.skipped) == 2  # batches 3 and 7 hold inf


@pytest.mark.parametrize(
    "scaler",
    [fmp.NoOpLossScale(), fmp.StaticLossScale.create(1.0), fmp.DynamicLossScale.create(1.0)],
    ids=["noop", "static", "dynamic"],
)
def test_finite_micro_batches_whose_sum_overflows_skip_the_window(scaler: Any) -> None:
    """Each micro-batch's gradient (2e38) is finite in float32; their sum is not: nothing is applied."""
    optimizer = fmp.optim.sgd(1e-3, momentum=0.9)
    state = fmp.TrainState.create({"w": torch.ones(2)}, optimizer, scaler, accumulation_steps=2)
    before = state
    x = torch.full((2,), 2e38)
    infos = []
    for _ in range(2):
        state, info = fmp.train_step(lambda p, x: (p["w"] * x).sum(), state, x, policy=F32, optimizer=optimizer)
        infos.append(info)
    assert [bool(info.grads_finite) for info in infos] == [True, True]  # each micro-batch's own flag
    assert not bool(infos[1].applied)
    assert_trees_bitwise_equal((state.params, state.opt_state), (before.params, before.opt_state))
    assert int(state.counts.skipped) == 1 and int(state.counts.applied) == 0
    if isinstance(scaler, fmp.DynamicLossScale):
        assert float(state.scaler.loss_scale) == 0.5
    # The next window starts clean.
    assert bool(state.accumulator.grads_finite) and int(state.accumulator.micro_steps) == 0


def test_a_window_sum_that_overflows_backs_off_every_loss_scale() -> None:
    """No loss is to blame alone when finite micro-batches overflow on adding: every scale backs off."""
    optimizer = fmp.optim.sgd(1e-3)
    scalers = (fmp.DynamicLossScale.create(1.0), fmp.DynamicLossScale.create(1.0))
    state = fmp.TrainState.create({"w": torch.ones(2)}, optimizer, scalers, accumulation_steps=2)
    before = state

    def two_losses(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (params["w"] * x).sum(), params["w"].sum()

    for _ in range(2):
        state, info = fmp.train_step(two_losses, state, torch.full((2,), 2e38), policy=F32, optimizer=optimizer)
        assert bool(info.grads_finite)  # each micro-batch's own gradients are finite
    assert not bool(info.applied)
    assert_trees_bitwise_equal(state.params, before.params)
    assert [float(s.loss_scale) for s in state.scaler] == [0.5, 0.5]


def test_add_names_gradients_or_flags_that_do_not_fit_the_window() -> None:
    params = {"w": torch.zeros(4), "b": torch.zeros(1)}
    accumulator = fmp.GradientAccumulator.create(params, fmp.NoOpLossScale(), 2)
    ok = torch.ones((), dtype=torch.bool)
    with pytest.raises(ValueError, match=r"grads\['b'\] is shape \(2,\), but its sum has shape \(1,\)"):
        accumulator.add({"w": torch.ones(4), "b": torch.ones(2)}, ok, ok)  # would broadcast into the sum
    with pytest.raises(ValueError, match="grads have another structure than the accumulator's sums"):
        accumulator.add({"w": torch.ones(4)}, ok, ok)
    with pytest.raises(ValueError, match=r"grads_finite must be a 0-dim bool tensor"):
        accumulator.add(params, torch.tensor(1.0), ok)
    with pytest.raises(ValueError, match=r"made for 1 loss-scale state\(s\) but finite_per_loss holds 2"):
        accumulator.add(params, ok, (ok, ok))
    mean = accumulator.add({"b": torch.ones(1), "w": torch.ones(4)}, ok, ok).grads  # keys in another order
    assert torch.equal(mean["w"], torch.full((4,), 0.5))
