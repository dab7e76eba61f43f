"""unscale_clip_and_adjust: GradScaler's unscale_, clip_grad_norm_ and update as one function, and fused."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import bits
from torch import nn

import fmp

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
    torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found_inf, inverse)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params if p.grad is not None], norm, float(found_inf) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("magnitude", "max_norm"), [(10.0, 1.0), (0.01, 1.0), (3.0, 0.5)])
def test_matches_grad_scaler_then_clip_grad_norm_bit_for_bit(
    dtype: torch.dtype, magnitude: float, max_norm: float
) -> None:
    grads = scaled_grads(dtype, magnitude)
    scaler = fmp.DynamicLossScale.create(SCALE)
    clipped, grads_finite, grad_norm, new_scaler = fmp.unscale_clip_and_adjust(scaler, grads, max_norm)
    reference, reference_norm, reference_finite = torch_amp_reference(grads, max_norm)
    assert_trees_bitwise_equal(clipped, reference)
    assert torch.equal(bits(grad_norm), bits(reference_norm))
    assert bool(grads_finite) is reference_finite is True
    assert_trees_bitwise_equal(new_scaler, fmp.unscale_and_adjust(scaler, grads)[2])


def test_the_norm_and_the_clip_act_on_the_unscaled_gradients() -> None:
    grads = scaled_grads(torch.float32, 10.0)  # scaled norm ~ 2**10 * 10 * 18: the clip must see ~180
    _, _, grad_norm, _ = fmp.unscale_clip_and_adjust(fmp.StaticLossScale.create(SCALE), grads, 1.0)
    unscaled = [g / SCALE for g in grads]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unscaled]))
    torch.testing.assert_close(grad_norm, expected, **TOLERANCES[torch.float32])


def test_non_finite_gradients_back_the_scale_off_and_give_a_non_finite_norm() -> None:
    grads = scaled_grads(torch.float32, 1.0)
    grads[1][2] = float("inf")
    scaler = fmp.DynamicLossScale.create(SCALE)
    _, grads_finite, grad_norm, new_scaler = fmp.unscale_clip_and_adjust(scaler, grads, 1.0)
    assert not bool(grads_finite) and not bool(torch.isfinite(grad_norm))
    assert float(new_scaler.loss_scale) == SCALE / 2


@pytest.mark.parametrize(
    ("max_norm", "error", "message"),
    [
        (0.0, ValueError, r"max_norm must be in \(0.0, inf\), got 0.0"),
        (math.nan, ValueError, "max_norm"),
        ("1", TypeError, "max_norm"),
    ],
)
def test_a_bad_max_norm_is_named(max_norm: Any, error: type[Exception], message: str) -> None:
    scaler = fmp.DynamicLossScale.create(SCALE)
    for function in (fmp.unscale_clip_and_adjust, fmp.fused_unscale_clip_and_adjust):
        with pytest.raises(error, match=message):
            function(scaler, scaled_grads(torch.float32, 1.0), max_norm)


@pytest.mark.compiled
def test_fused_form_clips_in_place_as_the_eager_one_does() -> None:
    torch._dynamo.reset()
    scaler = fmp.DynamicLossScale.create(SCALE)
    for magnitude in (10.0, 0.01):  # the clip binds, then not: one graph for both
        grads = scaled_grads(torch.float32, magnitude)
        eager = fmp.unscale_clip_and_adjust(scaler, grads, 1.0)
        donated = [g.clone() for g in grads]
        fused = fmp.fused_unscale_clip_and_adjust(scaler, donated, 1.0, donate=True)
        for ours, buffer in zip(fused[0], donated, strict=True):
            assert ours.data_ptr() == buffer.data_ptr()  # written into the donated gradients
        torch.testing.assert_close(list(fused[0]), list(eager[0]), **TOLERANCES[torch.float32])
        torch.testing.assert_close(fused[2], eager[2], **TOLERANCES[torch.float32])
        assert bool(fused[1]) and bool(eager[1])
        assert_trees_bitwise_equal(fused[3], eager[3])


@pytest.mark.compiled
def test_gradient_buffer_unscales_and_clips_as_grad_scaler_and_clip_grad_norm_() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    grads = fmp.GradientBuffer.attach(model.parameters())
    x = torch.randn(5, 6) * 30
    scaler = fmp.DynamicLossScale.create(SCALE)
    scaler.scale(model(x).square().mean()).backward()
    reference, reference_norm, _ = torch_amp_reference([p.grad.clone() for p in model.parameters()], 1.0)  # type: ignore[union-attr]
    grads_finite, grad_norm, _ = grads.unscale_and_clip_(scaler, 1.0)
    assert bool(grads_finite) and float(reference_norm) > 1.0  # the clip binds
    torch.testing.assert_close(grad_norm, reference_norm, **TOLERANCES[torch.float32])
    torch.testing.assert_close([p.grad for p in model.parameters()], reference, **TOLERANCES[torch.float32])
    with pytest.raises(RuntimeError, match="the gradients were already unscaled"):
        grads.unscale_(scaler)
