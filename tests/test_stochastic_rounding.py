"""Stochastic rounding to bfloat16: the rounding's invariants, and bfloat16 params trained without a master copy."""

from __future__ import annotations

import functools
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_trees_bitwise_equal
from conftest import bits
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

BF16_POLICY = fmp.get_policy("params=bfloat16,compute=bfloat16,output=float32")
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
keys = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values around float32 `x`: toward zero (its top 16 bits) and the next one out."""
    toward_zero = bits(x) & -(1 << 16)
    return toward_zero.view(torch.float32), (toward_zero + (1 << 16)).view(torch.float32)


def assert_rounds(rounded: torch.Tensor, exact: torch.Tensor) -> None:
    """`rounded` is `exact` where that is a bfloat16, elsewhere one of its two bfloat16 neighbours."""
    down, up = neighbours(exact)
    representable = exact.to(torch.bfloat16).float() == exact
    rounded = rounded.float()
    assert torch.where(representable, rounded == exact, (rounded == down) | (rounded == up)).all()


@given(floats32, keys)
def test_the_result_is_x_when_representable_else_one_of_its_two_neighbours(value: float, key: int) -> None:
    x = torch.full((64,), value)
    rounded = fmp.stochastic_round(x, torch.tensor(key))
    assert rounded.dtype == torch.bfloat16
    if math.isnan(value):
        assert rounded.isnan().all()
    elif torch.equal(x.to(torch.bfloat16).float(), x):  # already a bfloat16: zeros (signed), infinities
        assert torch.equal(bits(rounded.float()), bits(x))
    else:
        assert_rounds(rounded, x)


@given(
    st.floats(min_value=2.0**-140, max_value=2.0**120, width=32)
    | st.floats(min_value=-(2.0**120), max_value=-(2.0**-140), width=32),
    keys,
)
def test_the_rounding_is_unbiased(value: float, key: int) -> None:
    # 2**14 copies of one value: the share rounded away from zero estimates the dropped fraction,
    # within 6 binomial standard deviations (the bits are a fixed function of the key: no flakes).
    count = 1 << 14
    x = torch.full((count,), value)
    down, up = neighbours(x[:1])
    fraction = ((x[0].double() - down.double()) / (up.double() - down.double())).item()
    rounded_up = (fmp.stochastic_round(x, torch.tensor(key)).float() != down).double().mean().item()
    tolerance = 6 * math.sqrt(fraction * (1 - fraction) / count) + 1 / count
    assert abs(rounded_up - fraction) <= tolerance


def test_one_value_over_many_keys_is_unbiased() -> None:
    # The same element under 4,096 consecutive keys (as one parameter over 4,096 updates).
    x = torch.tensor([1.0 + 2.0**-9])  # a quarter of the way from 1 to the next bfloat16, 1 + 2**-7
    ups = sum(fmp.stochastic_round(x, torch.tensor(key)).item() > 1.0 for key in range(4096))
    assert abs(ups / 4096 - 0.25) <= 6 * math.sqrt(0.25 * 0.75 / 4096)


@given(floats32, keys)
def test_the_rounding_is_odd(value: float, key: int) -> None:
    # Sign and magnitude: -x rounds to minus what x rounds to under the same key.
    x = torch.full((8, 8), value)
    rounded = fmp.stochastic_round(x, torch.tensor(key))
    negated = fmp.stochastic_round(-x, torch.tensor(key))
    assert torch.equal(bits(negated.float()), bits(-rounded.float())) or math.isnan(value)


def test_the_rounding_is_a_pure_function_of_x_and_the_key() -> None:
    x = torch.full((4096,), 1.0 + 2.0**-8)  # halfway: every element is a coin flip
    rng_state = torch.get_rng_state()
    first = fmp.stochastic_round(x, torch.tensor(7))
    assert torch.equal(first, fmp.stochastic_round(x.clone(), torch.tensor(7)))
    assert torch.equal(torch.get_rng_state(), rng_state)
    other = fmp.stochastic_round(x, torch.tensor(8))
    assert 0.4 < (first != other).double().mean().item() < 0.6
    # The high 32 bits of the key count too.
    assert not torch.equal(first, fmp.stochastic_round(x, torch.tensor(7 + 2**32)))
    strided = torch.full((64, 64), 1.0 + 2.0**-8).t()
    assert torch.equal(fmp.stochastic_round(strided, torch.tensor(7)), first.view(64, 64))


def test_vmap_over_keys_matches_a_loop() -> None:
    x = torch.randn(3, 100)
    key = torch.tensor([1, 2, 3])
    expected = torch.stack([fmp.stochastic_round(x[i], key[i]) for i in range(3)])
    assert torch.equal(torch.func.vmap(fmp.stochastic_round)(x, key), expected)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(TypeError, match=r"float32 tensor to bfloat16, got torch.float16"):
        fmp.stochastic_round(torch.ones(2, dtype=torch.float16), torch.tensor(0))
    with pytest.raises(TypeError, match=r"0-dim integer tensor key, got int"):
        fmp.stochastic_round(torch.ones(2), 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"0-dim integer tensor key, got shape \(2,\) torch.int64"):
        fmp.stochastic_round(torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match=r"wraps an fmp\.optim\.Optimizer"):
        fmp.optim.stochastic_rounding(torch.optim.SGD)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2147483647\]"):
        fmp.optim.stochastic_rounding(fmp.optim.sgd(0.1), seed=-1)
    with pytest.raises(ValueError, match=r"state_dtype must be torch\.float32 or torch\.bfloat16"):
        fmp.optim.stochastic_rounding(fmp.optim.sgd(0.1), state_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"params\['w'\] is float16; it rounds bfloat16 params"):
        fmp.optim.stochastic_rounding(fmp.optim.sgd(0.1)).init({"w": torch.ones(2, dtype=torch.float16)})
    with pytest.raises(TypeError, match="expected StochasticRoundingState"):
        optimizer = fmp.optim.stochastic_rounding(fmp.optim.sgd(0.1))
        optimizer.update({"w": torch.ones(2)}, (), {"w": torch.ones(2)})


def regression_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(x @ params["w"] + params["b"], y)


@pytest.fixture(scope="module")
def regression() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen)
    return x, x @ (torch.randn(32, 1, generator=gen) / 32**0.5)


def train_regression(
    regression: tuple[torch.Tensor, torch.Tensor], policy: fmp.Policy, optimizer: fmp.optim.Optimizer
) -> float:
    params = policy.cast_to_param({"w": torch.full((32, 1), 0.5), "b": torch.zeros(1)})
    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())
    for _ in range(150):
        state, _ = fmp.train_step(regression_loss, state, *regression, policy=policy, optimizer=optimizer)
    return regression_loss(fmp.cast_floating(state.params, torch.float32), *regression).item()


def test_bfloat16_params_train_like_float32_where_rounding_to_nearest_stalls(
    regression: tuple[torch.Tensor, torch.Tensor],
) -> None:
    # AdamW's steps of at most ~5e-4 on weights in [0.25, 1) are below half their bfloat16 spacing
    # (2**-10 or more): to nearest they all vanish and only the bias learns; stochastically they add up.
    adamw = fmp.optim.adamw(5e-4)
    float32 = train_regression(regression, fmp.Policy(), adamw)
    start = regression_loss({"w": torch.full((32, 1), 0.5), "b": torch.zeros(1)}, *regression).item()
    to_nearest = train_regression(regression, BF16_POLICY, adamw)
    assert to_nearest > 0.99 * start
    for state_dtype in (torch.float32, torch.bfloat16):
        stochastic = train_regression(
            regression, BF16_POLICY, fmp.optim.stochastic_rounding(adamw, state_dtype=state_dtype)
        )
        assert float32 < 0.8 * start and abs(stochastic - float32) < 0.02 * (start - float32)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_an_update_rounds_the_float32_update_to_a_neighbour(state_dtype: torch.dtype) -> None:
    params = fmp.cast_floating(mlp_params(), torch.bfloat16)
    grads = fmp.cast_floating(mlp_params(seed=1), torch.bfloat16)
    inner = fmp.optim.adamw(1e-2, weight_decay=0.1)
    optimizer = fmp.optim.stochastic_rounding(inner, state_dtype=state_dtype)
    new_params, new_state = optimizer.update(grads, optimizer.init(params), params)
    grads32, params32 = fmp.cast_floating((grads, params), torch.float32)
    exact_params, exact_state = inner.update(grads32, inner.init(params32), params32)
    assert int(new_state.step) == 1 and torch.equal(new_state.inner.step, exact_state.step)
    for new, exact in zip(new_params.values(), exact_params.values(), strict=True):
        assert new.dtype == torch.bfloat16
        assert_rounds(new, exact)
    for new, exact in zip(
        [*new_state.inner.exp_avg.values(), *new_state.inner.exp_avg_sq.values()],
        [*exact_state.exp_avg.values(), *exact_state.exp_avg_sq.values()],
        strict=True,
    ):
        assert new.dtype == state_dtype
        if state_dtype == torch.float32:
            assert torch.equal(new, exact)
        else:
            assert_rounds(new, exact)


def test_float32_leaves_pass_through_exactly() -> None:
    params, grads = mlp_params(), mlp_params(seed=1)
    inner = fmp.optim.sgd(0.1, momentum=0.9)
    optimizer = fmp.optim.stochastic_rounding(inner)
    new_params, new_state = optimizer.update(grads, optimizer.init(params), params)
    expected_params, expected_state = inner.update(grads, inner.init(params), params)
    assert_trees_bitwise_equal((new_params, new_state.inner), (expected_params, expected_state))


def test_each_leaf_and_each_seed_draws_its_own_bits() -> None:
    # Twin leaves get the same float32 update; one key for every leaf, or a seed left out of the key,
    # would round them alike.
    twin = torch.randn(4096).to(torch.bfloat16)
    params, grads = {"a": twin, "b": twin.clone()}, {"a": torch.full((4096,), 1e-3), "b": torch.full((4096,), 1e-3)}

    def rounded(seed: int) -> dict[str, torch.Tensor]:
        optimizer = fmp.optim.stochastic_rounding(fmp.optim.sgd(0.1), seed=seed)
        return optimizer.update(grads, optimizer.init(params), params)[0]

    seed_0, seed_1 = rounded(0), rounded(1)
    assert not torch.equal(seed_0["a"], seed_0["b"])
    assert not torch.equal(seed_0["a"], seed_1["a"]) and not torch.equal(seed_0["b"], seed_1["b"])
    assert_trees_bitwise_equal(rounded(0), seed_0)


def test_a_skipped_step_keeps_params_and_state_and_the_next_draws_what_it_would_have() -> None:
    optimizer = fmp.optim.stochastic_rounding(fmp.optim.adamw(1e-2), state_dtype=torch.bfloat16)
    state = fmp.TrainState.create(fmp.cast_floating(mlp_params(), torch.bfloat16), optimizer, fmp.NoOpLossScale())
    step = functools.partial(fmp.train_step, mlp_loss, policy=BF16_POLICY, optimizer=optimizer)
    (x, y), (bad_x, _) = list(mlp_batches(2, 2))
    skipped, info = step(state, bad_x, y)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((skipped.params, skipped.opt_state), (state.params, state.opt_state))
    assert_trees_bitwise_equal(step(skipped, x, y)[0].params, step(state, x, y)[0].params)


def test_a_saved_state_loads_bit_for_bit(tmp_path: pathlib.Path) -> None:
    optimizer = fmp.optim.stochastic_rounding(fmp.optim.adamw(1e-2), state_dtype=torch.bfloat16)
    state = fmp.TrainState.create(fmp.cast_floating(mlp_params(), torch.bfloat16), optimizer, fmp.NoOpLossScale())
    state, _ = fmp.train_step(mlp_loss, state, *next(mlp_batches(1, 0)), policy=BF16_POLICY, optimizer=optimizer)
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert_trees_bitwise_equal(loaded, state)


@pytest.mark.compiled
def test_a_compiled_step_is_one_graph_across_updates_and_matches_eager() -> None:
    # torch.compile of any functools.partial shares one code object; a fresh Dynamo keeps what
    # earlier tests compiled (their automatic dynamic shapes) from restarting this compile.
    torch._dynamo.reset()
    # With a float32 moving average of the bfloat16 params on top (fmp.optim.ema), as it is used.
    optimizer = fmp.optim.ema(fmp.optim.stochastic_rounding(fmp.optim.adamw(1e-2), seed=3), decay=0.9)
    step = functools.partial(fmp.train_step, mlp_loss, policy=BF16_POLICY, optimizer=optimizer)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    state = fmp.TrainState.create(fmp.cast_floating(mlp_params(), torch.bfloat16), optimizer, fmp.NoOpLossScale())
    eager_state = state
    for index, (x, y) in enumerate(mlp_batches(4, 3)):  # the third batch overflows
        state, info = compiled(state, x, y)
        eager_state, _ = step(eager_state, x, y)
        assert bool(info.applied) == (index != 2)
    assert counter.frame_count == 1 and int(state.opt_state.step) == int(state.opt_state.inner.step) == 3
    # The rounding is exact integer arithmetic, so compiled and eager round the same float32 values
    # alike; the float32 update itself may differ in the last bit once inductor fuses it.
    compiled_leaves = [*state.params.values(), *state.opt_state.average.values()]
    eager_leaves = [*eager_state.params.values(), *eager_state.opt_state.average.values()]
    for compiled_leaf, eager_leaf in zip(compiled_leaves, eager_leaves, strict=True):
        torch.testing.assert_close(compiled_leaf, eager_leaf, rtol=2**-7, atol=1e-6)


def test_a_bfloat16_state_keeps_0_dim_leaves_in_float32() -> None:
    # A counter or running scalar in bfloat16 would stop counting at 256.
    inner = fmp.optim.Optimizer(lambda p: {"buffer": torch.zeros(3), "scalar": torch.zeros(())}, lambda g, s, p: (p, s))
    state = fmp.optim.stochastic_rounding(inner, state_dtype=torch.bfloat16).init(
        {"w": torch.zeros(3, dtype=torch.bfloat16)}
    )
    assert state.inner["buffer"].dtype == torch.bfloat16 and state.inner["scalar"].dtype == torch.float32
