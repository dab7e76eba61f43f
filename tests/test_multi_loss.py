"""Several losses, each with its own loss scale adjusted by its own overflow (apex's `num_losses`)."""

from __future__ import annotations

import functools
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
ADAMW = fmp.optim.adamw(1e-2)
INF = float("inf")


def two_losses(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, first: float = 1.0, second: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression loss and an L2 penalty; `first`/`second` multiply them (inf makes one overflow)."""
    penalty = sum(p.square().sum() for p in params.values())
    return first * mlp_loss(params, x, y), second * penalty


def test_gradients_are_the_sum_of_each_loss_unscaled_on_its_own() -> None:
    params = mlp_params()
    x, y = next(mlp_batches(1, 0))
    scalers = (fmp.StaticLossScale.create(2.0**12), fmp.StaticLossScale.create(2.0**-3))
    out = fmp.mixed_precision_grad(two_losses, params, scalers, x, y, policy=F32)
    parts = [
        fmp.mixed_precision_grad(lambda p, *a, i=i: two_losses(p, *a)[i], params, fmp.NoOpLossScale(), x, y, policy=F32)
        for i in range(2)
    ]
    # Scaling by a power of two and unscaling is exact, so each part is the unscaled gradient bit for bit.
    expected = {k: parts[0].grads[k] + parts[1].grads[k] for k in params}
    assert_trees_bitwise_equal(out.grads, expected)
    assert_trees_bitwise_equal(out.loss, (parts[0].loss, parts[1].loss))
    summed = torch.func.grad(lambda p: sum(two_losses(p, x, y)))(params)
    assert_trees_close(out.grads, summed, **TOLERANCES[torch.float32])
    assert bool(out.grads_finite) and [bool(f) for f in out.finite_per_loss] == [True, True]


def test_each_scaler_adjusts_by_its_own_overflow() -> None:
    """The penalty is multiplied by 1e36: its gradients overflow until its scale has backed off to ~2**5."""
    scalers = (fmp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=3), fmp.DynamicLossScale.create())

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        return two_losses(params, x, y, 1.0, 1e36)

    state = fmp.TrainState.create(mlp_params(), ADAMW, scalers)
    solo = list(scalers)
    for x, y in mlp_batches(30, 0):
        before = state
        state, info = fmp.train_step(loss_fn, state, x, y, policy=F32, optimizer=ADAMW)
        flags = []
        for i, scaler in enumerate(solo):
            alone = fmp.mixed_precision_grad(
                lambda p, *a, i=i: loss_fn(p, *a)[i], before.params, scaler, x, y, policy=F32
            )
            flags.append(bool(alone.grads_finite))
            solo[i] = scaler.adjust(alone.grads_finite)
        assert_trees_bitwise_equal(state.scaler, tuple(solo))
        assert bool(info.applied) == all(flags)
        assert [float(s) for s in info.loss_scale] == [float(s.loss_scale) for s in before.scaler]
        if not all(flags):
            assert_trees_bitwise_equal((state.params, state.opt_state), (before.params, before.opt_state))
    # The regression loss never overflowed: its scale grew every 3 steps, skipped ones included.
    assert float(state.scaler[0].loss_scale) == 2.0**18
    assert 0 < int(state.counts.skipped) < 30 and int(state.counts.applied) == int(state.opt_state.step)


@hypothesis.given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=12))
def test_skip_iff_any_loss_overflows_and_scalers_move_alone(overflows: list[tuple[bool, bool]]) -> None:
    scalers = (
        fmp.DynamicLossScale.create(init_scale=2.0**4, growth_interval=2),
        fmp.DynamicLossScale.create(init_scale=2.0**9, growth_interval=1, hysteresis=2),
    )
    state = fmp.TrainState.create(mlp_params(width=2), fmp.optim.sgd(0.1), scalers)
    expected = list(scalers)
    x, y = torch.ones(1, 2), torch.ones(1, 1)
    for first_bad, second_bad in overflows:
        before = state
        multipliers = (INF if first_bad else 1.0, INF if second_bad else 1.0)
        state, info = fmp.train_step(two_losses, state, x, y, *multipliers, policy=F32, optimizer=fmp.optim.sgd(0.1))
        expected = [s.adjust(torch.tensor(not bad)) for s, bad in zip(expected, (first_bad, second_bad), strict=True)]
        assert_trees_bitwise_equal(state.scaler, tuple(expected))
        assert bool(info.applied) == (not first_bad and not second_bad)
        if first_bad or second_bad:
            assert_trees_bitwise_equal(state.params, before.params)
    assert int(state.counts.skipped) == sum(a or b for a, b in overflows)


def test_a_summed_overflow_skips_the_step_and_backs_every_scale_off() -> None:
    """Each loss's gradients are finite, their sum is not: no loss is to blame alone."""

    def two_large_losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        return 2e38 * params["w1"].sum(), 2e38 * params["w1"].sum()

    scalers = (
        fmp.DynamicLossScale.create(init_scale=1.0, min_scale=2.0**-10),
        fmp.DynamicLossScale.create(init_scale=1.0, min_scale=2.0**-10, growth_interval=7),
    )
    x, y = next(mlp_batches(1, 0))
    out = fmp.mixed_precision_grad(two_large_losses, mlp_params(), scalers, x, y, policy=F32)
    assert not bool(out.grads_finite) and [bool(f) for f in out.finite_per_loss] == [False, False]
    state = fmp.TrainState.create(mlp_params(), ADAMW, scalers)
    new_state, info = fmp.train_step(two_large_losses, state, x, y, policy=F32, optimizer=ADAMW)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((new_state.params, new_state.opt_state), (state.params, state.opt_state))
    assert [float(s.loss_scale) for s in new_state.scaler] == [0.5, 0.5]


def test_several_losses_need_as_many_losses_and_scalers() -> None:
    params = mlp_params()
    x, y = next(mlp_batches(1, 0))
    scalers = (fmp.NoOpLossScale(), fmp.NoOpLossScale(), fmp.NoOpLossScale())
    with pytest.raises(TypeError, match="with a tuple of 3 scalers, loss_fn must return 3 losses, got a tuple of 2"):
        fmp.mixed_precision_grad(two_losses, params, scalers, x, y, policy=F32)
    with pytest.raises(TypeError, match="loss_fn must return 3 losses, got a Tensor"):
        fmp.mixed_precision_grad(mlp_loss, params, scalers, x, y, policy=F32)
    with pytest.raises(ValueError, match=r"loss_fn's loss\[1\] must be a scalar \(0-dim\) loss, got shape \(8,\)"):
        fmp.mixed_precision_grad(lambda p, x, y: (mlp_loss(p, x, y), p["b1"]), params, scalers[:2], x, y, policy=F32)
    with pytest.raises(TypeError, match="scaler is an empty tuple"):
        fmp.TrainState.create(params, ADAMW, ())
    with pytest.raises(TypeError, match=r"scaler\[1\] must be an fmp loss-scale state .* got GradScaler"):
        fmp.TrainState.create(params, ADAMW, (fmp.NoOpLossScale(), torch.amp.GradScaler("cpu")))


def test_vmap_over_members_with_two_scalers_each() -> None:
    members = [
        fmp.TrainState.create(
            mlp_params(seed=s), ADAMW, (fmp.DynamicLossScale.create(init_scale=2.0**k), fmp.StaticLossScale.create(1.0))
        )
        for s, k in [(0, 4), (1, 9)]
    ]
    stacked = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *members)
    x, y = next(mlp_batches(1, 0))
    step = torch.func.vmap(functools.partial(fmp.train_step, two_losses, policy=F32, optimizer=ADAMW))
    multipliers = torch.tensor([1.0, INF]), torch.tensor([1.0, 1.0])
    new, info = step(stacked, torch.stack([x, x]), torch.stack([y, y]), *multipliers)
    assert info.applied.tolist() == [True, False]
    assert new.scaler[0].loss_scale.tolist() == [2.0**4, 2.0**8] and new.counts.skipped.tolist() == [0, 1]


@pytest.mark.compiled
def test_compiled_several_losses_match_eager_in_one_graph() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
    step = functools.partial(fmp.train_step, two_losses, policy=policy, optimizer=ADAMW)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    scalers = (fmp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=2), fmp.DynamicLossScale.create())
    eager = compiled_state = fmp.TrainState.create(mlp_params(), ADAMW, scalers)
    for i, (x, y) in enumerate(mlp_batches(8, 0)):
        # The penalty overflows for 4 steps, the other loss never (a tensor: a float would specialise).
        second = torch.tensor(1e38 if i < 4 else 1.0)
        eager, _ = step(eager, x, y, 1.0, second)
        compiled_state, _ = compiled(compiled_state, x, y, 1.0, second)
    assert counter.frame_count == 1
    assert_trees_bitwise_equal((compiled_state.scaler, compiled_state.counts), (eager.scaler, eager.counts))
    assert_trees_close(compiled_state.params, eager.params, **TOLERANCES[torch.bfloat16])
    assert int(eager.counts.skipped) == 4 and float(eager.scaler[0].loss_scale) == 2.0**12
