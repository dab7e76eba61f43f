"""The step's unscale and check in multi-tensor kernels: bit for bit `unscale` and `all_finite`."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import torch
from conftest import assert_trees_bitwise_equal

import fmp
from fmp._scaler import owned_all_finite
from fmp._scaler import unscale_and_check

_SPECIALS = [float("inf"), float("-inf"), float("nan"), 3.0e38, -3.0e38, 1.0e-40, 0.0, -0.0]


@hypothesis.given(
    exponent=st.integers(-126, 127),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    special=st.none() | st.sampled_from(_SPECIALS),
    seed=st.integers(0, 2**16),
)
def test_unscale_and_check_equals_unscale_then_all_finite(
    exponent: int, sizes: list[int], special: float | None, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = {f"p{i}": torch.randn(n, generator=gen) * 1e3 for i, n in enumerate(sizes)}
    if special is not None and sizes[-1] > 0:
        grads[f"p{len(sizes) - 1}"][-1] = special
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**exponent, min_scale=2.0**-126)
    expected = scaler.unscale(grads)
    unscaled, finite = unscale_and_check(scaler, grads)
    assert_trees_bitwise_equal(unscaled, expected)
    # A scale below 1 can overflow a gradient on unscaling: the check reads the unscaled values.
    assert bool(finite) == bool(fmp.all_finite(expected))
    assert bool(owned_all_finite(unscaled)) == bool(finite)


def test_gradients_it_cannot_take_whole_go_leaf_by_leaf() -> None:
    grads = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.full((2,), 2.0**120)}
    scaler = fmp.StaticLossScale.create(2.0**-10)
    unscaled, finite = unscale_and_check(scaler, grads)
    assert_trees_bitwise_equal(unscaled, scaler.unscale(grads))
    assert not bool(finite)
    unscaled, finite = unscale_and_check(fmp.NoOpLossScale(), grads)
    assert unscaled is grads and bool(finite)
