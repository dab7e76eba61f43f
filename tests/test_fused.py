"""unscale_and_adjust and its compiled form against GradScaler's own kernels."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import bits
from hypothesis import given
from hypothesis import strategies as st

import fmp
from fmp._scaler import compiled_unscale_and_adjust

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def grad_scaler_unscale(grads: list[torch.Tensor], scale: float) -> tuple[list[torch.Tensor], bool]:
    """GradScaler's unscale kernel on copies of `grads`: (unscaled, found_inf)."""
    unscaled = [g.clone() for g in grads]
    found_inf = torch.zeros(1)
    inverse = torch.full((1,), scale, dtype=torch.float64).reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(unscaled, found_inf, inverse)
    return unscaled, bool(found_inf)


def sample_grads(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=gen) * 100).to(dtype) for shape in [(3,), (33, 17), (2048,), ()]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [3.0, 2.0**16, 0.75])
def test_unscale_matches_grad_scalers_kernel_bit_for_bit(dtype: torch.dtype, scale: float) -> None:
    grads = sample_grads(dtype)
    scaler = fmp.DynamicLossScale.create(init_scale=scale, growth_interval=1)
    unscaled, finite, _, new_scaler = fmp.unscale_and_adjust(scaler, grads)
    reference, found_inf = grad_scaler_unscale(grads, scale)
    assert_trees_bitwise_equal(unscaled, reference)
    assert bool(finite) is not found_inf
    assert_trees_bitwise_equal(new_scaler, scaler.adjust(finite))
    assert float(new_scaler.loss_scale) == scale * 2  # growth_interval=1: a finite step grows the scale


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_gradients_back_the_scale_off(bad: float) -> None:
    grads = sample_grads(torch.float16)
    grads[1][5, 3] = bad
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**8)
    _, finite, _, new_scaler = fmp.unscale_and_adjust(scaler, grads)
    assert not bool(finite) and grad_scaler_unscale(grads, 2.0**8)[1]
    assert float(new_scaler.loss_scale) == 2.0**7


def test_an_overflow_that_appears_only_when_unscaling_is_caught() -> None:
    # A scale below 1 multiplies on unscaling: 3e38 / 0.5 is inf in float32. GradScaler's kernel
    # checks the scaled value only and reports the step finite; fmp checks what the optimizer gets.
    grads = [torch.tensor([3e38, 1.0])]
    unscaled, found_inf = grad_scaler_unscale(grads, 0.5)
    assert not found_inf and torch.isinf(unscaled[0][0])
    _, finite, _, new_scaler = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(init_scale=0.5), grads)
    assert not bool(finite) and float(new_scaler.loss_scale) == 0.25


@pytest.mark.compiled
def test_donated_fused_form_unscales_in_place_bit_identically() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    scaler = fmp.DynamicLossScale.create(init_scale=3.0)
    grads = sample_grads(torch.float32)
    pure = fmp.unscale_and_adjust(scaler, grads)
    for _ in range(3):  # fresh gradients every call, the previous ones freed, as in training
        donated_grads = [g.clone() for g in grads]
        buffers = [g.data_ptr() for g in donated_grads]
        donated = compiled_unscale_and_adjust(scaler, donated_grads, donate=True)
        assert_trees_bitwise_equal(donated, pure)
        assert [g.data_ptr() for g in donated[0]] == buffers
        del donated, donated_grads
    # The check for a tensor listed twice compares with `is`: an `id()` would guard on every
    # tensor's identity and recompile for each new set of gradients.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.compiled
def test_donated_cpu_kernel_reads_each_gradient_in_one_loop() -> None:
    # Inductor's C++ code must write each unscaled gradient in place and reduce its finite flag in
    # one loop; recomputing it in a check loop of its own reads it twice (the 1.7-2x of issue 4).
    # The pattern matches the C++ that torch 2.11-2.13 generate for a flat loop over N elements.
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    scaler = fmp.DynamicLossScale.create(init_scale=3.0)
    grads = [torch.randn(8, 30), torch.randn(1000)]
    _, codes = run_and_get_code(compiled_unscale_and_adjust, scaler, grads, donate=True)
    loop_bounds = re.findall(r"x0<static_cast<int64_t>\((\d+)L\)", "\n".join(codes))
    assert loop_bounds.count("240") == 1 and loop_bounds.count("1000") == 1, (
        f"loops over the gradients' elements: {loop_bounds}"
    )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64, torch.complex64])
@pytest.mark.parametrize("scale", [3.0, 2.0**16, 0.5])
@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "unscale-clip"])
def test_eager_donation_unscales_in_place_bit_identically(dtype: torch.dtype, scale: float, clip: bool) -> None:
    grads = sample_grads(dtype)
    grads[1][0, 0] = torch.finfo(grads[1].real.dtype).max  # overflows on unscaling at 0.5
    scaler = fmp.DynamicLossScale.create(init_scale=scale)
    before = [g.clone() for g in grads]
    function = functools.partial(fmp.unscale_and_adjust, max_norm=1.0) if clip else fmp.unscale_and_adjust
    pure = function(scaler, grads)
    assert_trees_bitwise_equal(grads, before)  # the default stays pure
    donated = function(scaler, grads, donate=True)
    assert_trees_bitwise_equal(donated, pure)
    assert all(ours is buffer for ours, buffer in zip(donated[0], grads, strict=True))
    assert bool(donated[1]) is (scale != 0.5)


@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "unscale-clip"])
def test_eager_donation_gives_expanded_gradients_new_tensors(clip: bool) -> None:
    # Autograd returns the gradient of a sum expanded (stride 0): no memory to write each value into.
    weight = torch.randn(4, 3, requires_grad=True)
    (expanded,) = torch.autograd.grad(weight.sum() * 2.0**16, weight)
    overlapping = torch.full((15,), 2.0**15).as_strided((8, 8), (1, 1))  # the last write would win
    grads = {"expanded": expanded, "overlapping": overlapping, "own": torch.full((5,), 2.0**16)}
    scaler = fmp.DynamicLossScale.create()
    function = functools.partial(fmp.unscale_and_adjust, max_norm=1.0) if clip else fmp.unscale_and_adjust
    pure = function(scaler, grads)
    own = grads["own"]
    donated = function(scaler, grads, donate=True)
    assert_trees_bitwise_equal(donated, pure)
    assert donated[0]["own"] is own and expanded.stride() == (0, 0)


def test_eager_donation_checks_its_input_and_writes_nothing_where_it_may_not() -> None:
    scaler, grads = fmp.DynamicLossScale.create(init_scale=3.0), sample_grads(torch.float16)
    before = [g.clone() for g in grads]
    with pytest.raises(ValueError, match=r"scaled_grads\[0\] and scaled_grads\[1\] are one tensor"):
        fmp.unscale_and_adjust(scaler, [grads[0], grads[0]], donate=True)
    assert_trees_bitwise_equal(grads, before)  # refused before anything was written
    with pytest.raises(TypeError, match="donate must be a bool"):
        fmp.unscale_and_adjust(scaler, grads, donate=1)  # type: ignore[arg-type]
    tracked = [g.float().requires_grad_() for g in grads]
    unscaled, _, _, _ = fmp.unscale_and_adjust(scaler, tracked, donate=True)
    sum(g.sum() for g in unscaled).backward()
    assert all(torch.equal(g.grad, torch.full_like(g, 1 / 3.0)) for g in tracked)
    # A tensor subclass's storage need not hold its values: it gets a new tensor.
    subclassed = [g.as_subclass(SubclassedTensor) for g in grads]
    unscaled, _, _, _ = fmp.unscale_and_adjust(scaler, subclassed, donate=True)
    assert_trees_bitwise_equal(subclassed, before)
    assert all(type(g) is SubclassedTensor for g in unscaled)


class SubclassedTensor(torch.Tensor):
    pass


def test_wrong_scalers_are_named() -> None:
    with pytest.raises(TypeError, match="scaler must be an fmp loss-scale state"):
        fmp.unscale_and_adjust(2.0**16, [torch.ones(3)])  # type: ignore[type-var]
    with pytest.raises(TypeError, match="scaler must be an fmp loss-scale state"):
        compiled_unscale_and_adjust(None, [torch.ones(3)])  # type: ignore[type-var]
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"scaled_grads\['w'\] is a ndarray; gradients must be tensors"):
        fmp.unscale_and_adjust(fmp.DynamicLossScale.create(), {"v": None, "w": numpy.array([numpy.inf])})
    with pytest.raises(TypeError, match=r"scaled_grads\[1\] is a float; gradients must be tensors"):
        compiled_unscale_and_adjust(fmp.DynamicLossScale.create(), [torch.ones(2), float("inf")])
    grads, finite, _, _ = fmp.unscale_and_adjust(fmp.StaticLossScale.create(2.0), {"v": None, "w": torch.ones(2)})
    assert grads["v"] is None and bool(finite)  # a frozen param's None passes
    on_meta = pytree.tree_map(lambda t: t.to("meta"), fmp.DynamicLossScale.create())
    with pytest.raises(ValueError, match=r"scaler\.loss_scale is on meta but the gradients are on cpu"):
        fmp.unscale_and_adjust(on_meta, [torch.ones(3)])


@given(
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from([3e38, -3e38]),
        min_size=1,
        max_size=40,
    ),
    exponent=st.integers(-4, 20),
)
def test_the_flag_says_whether_every_unscaled_gradient_is_finite(values: list[float], exponent: int) -> None:
    grads = [torch.tensor(values, dtype=torch.float32)]
    scaler = fmp.StaticLossScale.create(2.0**exponent)
    unscaled, finite, _, _ = fmp.unscale_and_adjust(scaler, grads)
    # A power of two scales exactly: a value unscales to inf only past float32's largest.
    largest = torch.finfo(torch.float32).max
    stored = grads[0].tolist()  # the float32 values
    assert bool(finite) == all(math.isfinite(v) and abs(v * 2.0**-exponent) <= largest for v in stored)
    expected = (grads[0].double() * 2.0**-exponent).float()
    torch.testing.assert_close(unscaled[0], expected, rtol=0, atol=0, equal_nan=True)
    # Donated, the same bits and flag, written into the gradients themselves.
    donated = [grads[0].clone()]
    in_place, in_place_finite, _, _ = fmp.unscale_and_adjust(scaler, donated, donate=True)
    assert in_place[0] is donated[0] and bool(in_place_finite) == bool(finite)
    assert torch.equal(bits(in_place[0]), bits(unscaled[0]))


@pytest.mark.compiled
def test_fused_form_equals_the_eager_one_bit_for_bit_without_recompiling() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    scaler = fmp.DynamicLossScale.create(init_scale=3.0, growth_interval=2)
    grads = [*sample_grads(torch.float32), sample_grads(torch.float16)[1]]
    poisoned = [g.clone() for g in grads]
    poisoned[2][100] = float("nan")
    for step in range(4):
        step_grads = poisoned if step == 2 else grads
        eager = fmp.unscale_and_adjust(scaler, step_grads)
        fused = compiled_unscale_and_adjust(scaler, step_grads)
        assert_trees_bitwise_equal(fused, eager)
        scaler = fused.scaler
    assert float(scaler.loss_scale) == 3.0  # grew once (steps 0, 1), backed off once (step 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
