"""GradientBuffer refuses the torch.amp slips it can see: a backward that skipped the scale, among others."""

from __future__ import annotations

import pytest
import torch
from conftest import bits
from torch import nn
from torch.utils.checkpoint import checkpoint

import fmp

SCALE = 2.0**16


def setup() -> tuple[nn.Sequential, fmp.interop.GradientBuffer, fmp.StaticLossScale]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    buffer = fmp.interop.GradientBuffer.attach(model.named_parameters(), compiled=False)
    return model, buffer, fmp.StaticLossScale.create(SCALE)


def loss_of(model: nn.Module, seed: int = 0) -> torch.Tensor:
    return model(torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))).square().mean()


UNSCALED = (
    r"params\[3\] \('2.bias', shape \(3,\), torch.float32\) received a gradient from a backward that did not "
    r"start at a loss this buffer scaled: loss.backward\(\) where grads.scale\(loss, scaler\).backward\(\) belongs"
)


def test_a_scaled_backward_unscales_to_the_plain_gradients() -> None:
    model, buffer, scaler = setup()
    twin, _, _ = setup()
    buffer.scale(loss_of(model), scaler).backward()
    grads_finite, _ = buffer.unscale_(scaler)
    loss_of(twin).backward()  # no buffer: plain float32 gradients
    assert bool(grads_finite)
    for param, reference in zip(model.parameters(), twin.parameters(), strict=True):
        assert param.grad is not None and reference.grad is not None
        assert torch.equal(bits(param.grad), bits(reference.grad))  # a power-of-two scale unscales exactly


def test_loss_backward_after_the_buffer_scaled_a_loss_is_refused_with_the_right_call() -> None:
    model, buffer, scaler = setup()
    buffer.scale(loss_of(model), scaler).backward()
    buffer.unscale_(scaler)
    buffer.zero_()
    loss_of(model).backward()  # the slip: the step would be 65536 times too small
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_and_clip_(scaler, 1.0)
    buffer.zero_()
    buffer.scale(loss_of(model), scaler).backward()
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_one_unscaled_micro_batch_among_scaled_ones_is_refused() -> None:
    model, buffer, scaler = setup()
    buffer.scale(loss_of(model, 0), scaler).backward()
    loss_of(model, 1).backward()
    buffer.scale(loss_of(model, 2), scaler).backward()
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)


def test_scaled_backwards_that_nest_retain_or_accumulate_are_accepted() -> None:
    model, buffer, scaler = setup()
    # A reentrant checkpoint runs a backward of its own inside the scaled one, with scaled gradients.
    hidden = checkpoint(model[0], torch.randn(5, 6, requires_grad=True), use_reentrant=True)
    scaled = buffer.scale(model[2](model[1](hidden)).square().mean(), scaler)
    scaled.backward(retain_graph=True)
    scaled.backward()  # the same scaled loss again: the hook fires again
    buffer.scale(loss_of(model, 1), scaler).backward()  # accumulation over micro-batches
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_a_backward_that_raised_midway_leaves_no_scaled_mark_behind() -> None:
    model, buffer, scaler = setup()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("a hook failed")

    hidden = model[0](torch.randn(5, 6))
    hidden.register_hook(fail)
    scaled = buffer.scale(model[2](model[1](hidden)).square().mean(), scaler)
    with pytest.raises(ValueError, match="a hook failed"):
        scaled.backward()  # its end-of-backward callback never runs
    buffer.zero_()
    loss_of(model).backward()
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)


def test_scale_names_what_it_cannot_scale() -> None:
    model, buffer, scaler = setup()
    with pytest.raises(TypeError, match="loss must be a tensor, got float"):
        buffer.scale(1.0, scaler)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be an fmp"):
        buffer.scale(loss_of(model), 2.0**16)  # type: ignore[arg-type]
    with torch.no_grad(), pytest.raises(ValueError, match=r"loss has no autograd history \(computed under"):
        buffer.scale(loss_of(model), scaler)
    # Nothing was marked: a buffer that never scaled a loss accepts every backward.
    loss_of(model).backward()
    buffer.unscale_(scaler)


def test_misuses_named_elsewhere_stay_refused() -> None:
    """The other refusals docs/pitfalls.md lists for the torch.nn loop, each in one line."""
    model, buffer, scaler = setup()
    buffer.scale(loss_of(model), scaler).backward()
    grads_finite, scaler = buffer.unscale_(scaler)
    with pytest.raises(RuntimeError, match="the gradients were already unscaled"):  # unscale_ twice
        buffer.unscale_(scaler)
    with pytest.raises(TypeError, match="cannot skip a step on the device: only torch optimizers built with fused"):
        buffer.step(torch.optim.AdamW(model.parameters()), grads_finite)  # an optimizer that cannot skip
    with pytest.raises(ValueError, match="must be a 0-dim bool tensor"):
        buffer.step(torch.optim.AdamW(model.parameters(), fused=True), grads_finite.float())
    model.zero_grad()  # set_to_none: the next backward writes outside the buffer
    buffer.scale(loss_of(model), scaler).backward()
    with pytest.raises(RuntimeError, match=r"a backward after optimizer.zero_grad\(\) \(set_to_none\)"):
        buffer.unscale_(scaler)
