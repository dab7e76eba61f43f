"""unscale_and_adjust with max_norm: GradScaler's unscale_, clip_grad_norm_ and update in one, eager and compiled."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import bits
from torch import nn
from torch._dynamo.utils import counters

import fmp
from fmp._scaler import compiled_unscale_and_adjust

SCALE = 2.0**10


def scaled_grads(dtype: torch.dtype, magnitude: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(shape, generator=gen) * magnitude * SCALE).to(dtype) for shape in [(7, 5), (5,), (300,)]]


def torch_amp_reference(grads: list[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
    """GradScaler's unscale kernel on copies of `grads`, then torch.nn.utils.clip_grad_norm_."""
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    found_inf = torch.zeros(1)
    inverse = torch.full((1,), SCALE, dtype=torch.float64).reciprocal().float()
    for param in params:  # one call per gradient, as the kernel takes one dtype at a time
        torch._amp_foreach_non_finite_check_and_unscale_([param.grad], found_inf, inverse)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params if p.grad is not None], norm, float(found_inf) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("magnitude", "max_norm"), [(10.0, 1.0), (0.01, 1.0), (3.0, 0.5)])
def test_matches_grad_scaler_then_clip_grad_norm_bit_for_bit(
    dtype: torch.dtype, magnitude: float, max_norm: float
) -> None:
    grads = scaled_grads(dtype, magnitude)
    scaler = fmp.DynamicLossScale.create(SCALE)
    clipped, grads_finite, grad_norm, new_scaler = fmp.unscale_and_adjust(scaler, grads, max_norm=max_norm)
    reference, reference_norm, reference_finite = torch_amp_reference(grads, max_norm)
    assert_trees_bitwise_equal(clipped, reference)
    assert torch.equal(bits(grad_norm), bits(reference_norm))
    assert bool(grads_finite) is reference_finite is True
    assert_trees_bitwise_equal(new_scaler, fmp.unscale_and_adjust(scaler, grads).scaler)


def test_mixed_dtypes_match_clip_grad_norm_s_grouping_bit_for_bit() -> None:
    """torch takes the norms group by group of dtype; interleaved leaves must come out the same."""
    grads = scaled_grads(torch.float32, 3.0)
    grads[1] = grads[1].to(torch.bfloat16)
    grads.append(scaled_grads(torch.bfloat16, 2.0)[0])
    clipped, _, grad_norm, _ = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(SCALE), grads, max_norm=1.0)
    reference, reference_norm, _ = torch_amp_reference(grads, 1.0)
    assert_trees_bitwise_equal(clipped, reference)
    assert torch.equal(bits(grad_norm), bits(reference_norm))


def test_the_norm_and_the_clip_act_on_the_unscaled_gradients() -> None:
    grads = scaled_grads(torch.float32, 10.0)  # scaled norm ~ 2**10 * 10 * 18: the clip must see ~180
    clipped, _, grad_norm, _ = fmp.unscale_and_adjust(fmp.StaticLossScale.create(SCALE), grads, max_norm=1.0)
    unscaled = [g / SCALE for g in grads]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unscaled]))
    torch.testing.assert_close(grad_norm, expected, **TOLERANCES[torch.float32])
    factor = 1.0 / (float(expected) + 1e-6)
    torch.testing.assert_close(list(clipped), [g * factor for g in unscaled], **TOLERANCES[torch.float32])


def test_a_float16_norm_beyond_its_range_does_not_zero_the_gradients() -> None:
    grads = [torch.full((4096,), 2048.0, dtype=torch.float16)]  # norm 131072, past float16's 65504
    clipped, grads_finite, grad_norm, _ = fmp.unscale_and_adjust(fmp.NoOpLossScale(), grads, max_norm=1.0)
    assert bool(grads_finite) and float(grad_norm) == 131072.0
    assert bool((clipped[0] > 0).all())  # torch's float16 norm would be inf and the factor 0


def test_integer_and_missing_leaves_pass_through_and_an_empty_tree_has_norm_zero() -> None:
    grads = {"w": scaled_grads(torch.float32, 1.0)[0], "count": torch.tensor([3, 4]), "none": None}
    clipped, grads_finite, _, _ = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(SCALE), grads, max_norm=1.0)
    assert clipped["count"] is grads["count"] and clipped["none"] is None and bool(grads_finite)
    _, empty_finite, empty_norm, _ = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(SCALE), [], max_norm=1.0)
    assert bool(empty_finite) and float(empty_norm) == 0.0


def test_an_infinite_max_norm_measures_without_clipping() -> None:
    grads = scaled_grads(torch.float32, 10.0)
    scaler = fmp.DynamicLossScale.create(SCALE)
    clipped, _, grad_norm, _ = fmp.unscale_and_adjust(scaler, grads, max_norm=math.inf)
    assert_trees_bitwise_equal(clipped, fmp.unscale_and_adjust(scaler, grads)[0])
    assert float(grad_norm) > 1.0


def test_non_finite_gradients_back_the_scale_off_and_give_a_non_finite_norm() -> None:
    grads = scaled_grads(torch.float32, 1.0)
    grads[1][2] = float("inf")
    scaler = fmp.DynamicLossScale.create(SCALE)
    _, grads_finite, grad_norm, new_scaler = fmp.unscale_and_adjust(scaler, grads, max_norm=1.0)
    assert not bool(grads_finite) and not bool(torch.isfinite(grad_norm))
    assert float(new_scaler.loss_scale) == SCALE / 2


@pytest.mark.parametrize(
    ("max_norm", "error", "message"),
    [
        (0.0, ValueError, r"max_norm must be in \(0.0, inf\], got 0.0"),
        (math.nan, ValueError, "max_norm"),
        ("1", TypeError, "max_norm"),
    ],
)
def test_a_bad_max_norm_is_named(max_norm: Any, error: type[Exception], message: str) -> None:
    scaler = fmp.DynamicLossScale.create(SCALE)
    for function in (fmp.unscale_and_adjust, compiled_unscale_and_adjust):
        with pytest.raises(error, match=message):
            function(scaler, scaled_grads(torch.float32, 1.0), max_norm=max_norm)


@pytest.mark.compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_form_clips_in_place_as_the_eager_one_does_and_compiles_at_most_twice(dtype: torch.dtype) -> None:
    torch._dynamo.reset()
    counters.clear()
    scaler = fmp.DynamicLossScale.create(SCALE)
    # The clip binds at magnitude 10, then not; a second max_norm makes it an input of the graph.
    for magnitude, max_norm in [(10.0, 1.0), (0.01, 1.0), (10.0, 2.0), (10.0, 0.5), (10.0, 3)]:
        grads = scaled_grads(dtype, magnitude)
        eager = fmp.unscale_and_adjust(scaler, grads, max_norm=max_norm)
        donated = [g.clone() for g in grads]
        fused = compiled_unscale_and_adjust(scaler, donated, max_norm=max_norm, donate=True)
        for ours, buffer in zip(fused[0], donated, strict=True):
            assert ours.data_ptr() == buffer.data_ptr()  # written into the donated gradients
        torch.testing.assert_close(list(fused[0]), list(eager[0]), **TOLERANCES[dtype])
        torch.testing.assert_close(fused[2], eager[2], **TOLERANCES[dtype])
        assert bool(fused[1]) and bool(eager[1])
        assert_trees_bitwise_equal(fused[3], eager[3])
    assert counters["stats"]["unique_graphs"] == 2


def refuse_to_compile(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("torch.compile was called")


@pytest.mark.compiled
@pytest.mark.parametrize("compiled", [True, False])
def test_gradient_buffer_unscales_and_clips_as_grad_scaler_and_clip_grad_norm_(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:
        monkeypatch.setattr(torch, "compile", refuse_to_compile)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    grads = fmp.interop.GradientBuffer.attach(model.parameters(), compiled=compiled)
    x = torch.randn(5, 6) * 30
    scaler = fmp.DynamicLossScale.create(SCALE)
    grads.scale(model(x).square().mean(), scaler).backward()
    reference, reference_norm, _ = torch_amp_reference([p.grad.clone() for p in model.parameters()], 1.0)  # type: ignore[union-attr]
    grads_finite, grad_norm, _ = grads.unscale_and_clip_(scaler, 1.0)
    assert bool(grads_finite) and float(reference_norm) > 1.0  # the clip binds
    torch.testing.assert_close(grad_norm, reference_norm, **TOLERANCES[torch.float32])
    torch.testing.assert_close([p.grad for p in model.parameters()], reference, **TOLERANCES[torch.float32])
    with pytest.raises(RuntimeError, match="the gradients were already unscaled"):
        grads.unscale_(scaler)
