"""GradientBuffer refuses the torch.amp slips it can see: a backward that skipped the scale, among others."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

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


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [bits(p.grad.clone()) for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("make_scaler", [lambda: fmp.StaticLossScale.create(SCALE), fmp.DynamicLossScale.create])
def test_scaler_scale_backward_outside_the_buffer_is_refused_by_default(make_scaler: Any) -> None:
    """torch.amp's own loop, `scaler.scale(loss).backward()`: the buffer never sees the pure scale's result."""
    model, buffer, _ = setup()
    scaler = make_scaler()
    scaler.scale(loss_of(model)).backward()  # scaled, but not through the buffer: it cannot tell
    before = grads_of(model)
    with pytest.raises(RuntimeError, match=UNSCALED + r".*scaler.scale\(loss\).backward\(\) is refused too"):
        buffer.unscale_(scaler)
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_and_clip_(scaler, 1.0)
    after = grads_of(model)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # refused before any write
    buffer.zero_()
    buffer.scale(loss_of(model), scaler).backward()  # the right call
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_a_plain_backward_is_refused_by_a_buffer_that_never_scaled_a_loss() -> None:
    model, buffer, scaler = setup()
    loss_of(model).backward()  # the slip, in the first step: the step would be 65536 times too small
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_and_clip_(scaler, 1.0)
    with pytest.raises(TypeError, match="scaler must be an fmp loss-scale state"):  # a wrong scaler is named first
        buffer.unscale_(2.0**16)  # type: ignore[type-var]
    # Unnamed parameters are named by their index.
    unnamed = nn.Linear(2, 1)
    unnamed_buffer = fmp.interop.GradientBuffer.attach(unnamed.parameters(), compiled=False)
    unnamed(torch.ones(3, 2)).sum().backward()
    with pytest.raises(RuntimeError, match=r"params\[1\] \(shape \(1,\), torch.float32\) received a gradient"):
        unnamed_buffer.unscale_(scaler)


def test_no_op_loss_scale_accepts_a_plain_backward() -> None:
    """With no scaling a plain backward's gradients are the right ones: nothing to refuse."""
    model, buffer, _ = setup()
    twin, _, _ = setup()
    scaler = fmp.NoOpLossScale.create()
    for seed in range(2):  # accumulated over two plain backwards
        loss_of(model, seed).backward()
        loss_of(twin, seed).backward()
    grads_finite, same = buffer.unscale_(scaler)
    assert bool(grads_finite) and same is scaler
    assert all(torch.equal(a, b) for a, b in zip(grads_of(model), grads_of(twin), strict=True))
    buffer.zero_()
    loss_of(model).backward()
    grads_finite, _, _ = buffer.unscale_and_clip_(scaler, 1e9)
    assert bool(grads_finite)
    buffer.zero_()
    buffer.scale(loss_of(model), scaler).backward()  # through the buffer works as well
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_gradients_copied_in_at_attach_or_written_by_hand_are_accepted() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    scaler = fmp.StaticLossScale.create(SCALE)
    scaler.scale(loss_of(model)).backward()  # before attach: no hook saw it
    buffer = fmp.interop.GradientBuffer.attach(model.named_parameters(), compiled=False)
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)
    buffer.zero_()
    with torch.no_grad():
        for param in model.parameters():
            param.grad.fill_(SCALE)  # type: ignore[union-attr]
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite) and all(bool((p.grad == 1.0).all()) for p in model.parameters())


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
    # The calls that raised left nothing behind: a scaled backward unscales as usual.
    buffer.scale(loss_of(model), scaler).backward()
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


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


ROOTS_ELSEWHERE = {
    # (scaled + loss): the scaled loss's node runs, reached through `+`, and `loss`'s gradients are not scaled.
    "sum with an unscaled loss": lambda scaled, other, model: (scaled + loss_of(model, 1)).backward(),
    "scaled by hand": lambda scaled, other, model: (scaled / 4).backward(),
    "torch.autograd.backward": lambda scaled, other, model: torch.autograd.backward(scaled),
    "several roots": lambda scaled, other, model: torch.autograd.backward([scaled, other]),
}


@pytest.mark.parametrize("start", ROOTS_ELSEWHERE.values(), ids=list(ROOTS_ELSEWHERE))
def test_a_backward_not_started_by_the_scaled_loss_itself_is_refused(start: Any) -> None:
    """Only `.backward()` on the tensor `scale` returned counts, not a backward whose graph merely holds it."""
    model, buffer, scaler = setup()
    scaled = buffer.scale(loss_of(model, 0), scaler)
    start(scaled, buffer.scale(loss_of(model, 2), scaler), model)
    with pytest.raises(RuntimeError, match=UNSCALED + r".*Only .backward\(\) on the very tensor grads.scale returned"):
        buffer.unscale_(scaler)
    buffer.zero_()
    # The same losses, scaled as one: accepted, and a scaled backward right after counts again.
    buffer.scale(loss_of(model, 0) + loss_of(model, 1) / 4, scaler).backward()
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_an_unscaled_backward_after_a_scaled_one_that_raised_is_refused_without_zero() -> None:
    """A scaled backward that raised midway leaves no mark: the next unscaled one is refused, zero_() or not."""
    model, buffer, scaler = setup()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("a hook failed")

    hidden = model[0](torch.randn(5, 6))
    handle = hidden.register_hook(fail)
    scaled = buffer.scale(model[2](model[1](hidden)).square().mean(), scaler)
    with pytest.raises(ValueError, match="a hook failed"):
        scaled.backward()  # model[2]'s gradients accumulated, scaled, before the hook raised
    handle.remove()
    buffer.scale(loss_of(model, 1), scaler).backward()  # still scaled: accepted
    loss_of(model, 2).backward()  # the slip, with no zero_() in between
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)


def test_a_scaled_backward_that_raised_inside_a_checkpoint_leaves_no_mark() -> None:
    model, buffer, scaler = setup()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("a hook failed")

    def first_layer(x: torch.Tensor) -> torch.Tensor:
        hidden = model[0](x)
        if torch.is_grad_enabled():  # the recomputation, in the nested backward
            hidden.register_hook(fail)
        return hidden

    hidden = checkpoint(first_layer, torch.randn(5, 6, requires_grad=True), use_reentrant=True)
    scaled = buffer.scale(model[2](model[1](hidden)).square().mean(), scaler)
    with pytest.raises(ValueError, match="a hook failed"):
        scaled.backward()
    loss_of(model).backward()
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)


def test_the_scaled_loss_backs_up_as_a_tensor_would() -> None:
    """`.backward` keeps torch's arguments and behaviour: hooks, retain_grad, gradient, inputs, another thread."""
    model, buffer, scaler = setup()
    scaled = buffer.scale(loss_of(model), scaler)
    seen: list[float] = []
    scaled.register_hook(lambda grad: seen.append(float(grad)))
    scaled.retain_grad()
    scaled.backward(torch.tensor(1.0), retain_graph=True)
    assert seen == [1.0] and scaled.grad is not None and float(scaled.grad) == 1.0
    scaled.backward(inputs=[model[2].bias])
    buffer.unscale_(scaler)
    buffer.zero_()
    many = buffer.scale(model(torch.randn(5, 6)), scaler)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        many.backward()
    worker = threading.Thread(target=many.backward, args=(torch.ones(5, 3),))
    worker.start()
    worker.join()
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_scale_refuses_a_tensor_subclass_and_marks_nothing_it_did_not_scale() -> None:
    class Marked(torch.Tensor):
        pass

    model, buffer, scaler = setup()
    with pytest.raises(TypeError, match="loss is a Marked: the buffer marks the backward of plain tensors only"):
        buffer.scale(loss_of(model).as_subclass(Marked), scaler)
    # NoOpLossScale scales nothing: the loss is returned as it is, and its gradients are not scaled.
    loss = loss_of(model)
    assert buffer.scale(loss, fmp.NoOpLossScale.create()) is loss and "backward" not in loss.__dict__
    loss.backward()
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)


def test_an_unscaled_backward_on_another_thread_during_a_scaled_one_is_refused() -> None:
    """Only a backward nested in the scaled one, on its thread, counts as scaled while it runs."""
    model, buffer, scaler = setup()
    twin = loss_of(model, 1)

    def meanwhile(grad: torch.Tensor) -> torch.Tensor:
        worker = threading.Thread(target=twin.backward)  # unscaled, while the scaled backward runs
        worker.start()
        worker.join()
        return grad

    hidden = model[1](model[0](torch.randn(5, 6)))
    hidden.register_hook(meanwhile)  # runs midway, once the scaled backward has started
    buffer.scale(model[2](hidden).square().mean(), scaler).backward()
    with pytest.raises(RuntimeError, match=UNSCALED):
        buffer.unscale_(scaler)


IN_PLACE = {
    "divided": lambda scaled, model: scaled.div_(4),
    "added to": lambda scaled, model: scaled.add_(model[0].weight.sum() * 1000),
    "through a view": lambda scaled, model: scaled.view(1).mul_(3),
}


@pytest.mark.parametrize("edit", IN_PLACE.values(), ids=list(IN_PLACE))
def test_backward_after_an_in_place_edit_is_torchs_own_and_refused(edit: Any) -> None:
    """`scaled /= n; scaled.backward()` differentiates the edited history, as torch does, and is not marked."""
    model, buffer, scaler = setup()
    twin, _, _ = setup()
    scaled = buffer.scale(loss_of(model), scaler)
    edit(scaled, model)
    scaled.backward()
    reference = scaler.scale(loss_of(twin))
    edit(reference, twin)
    reference.backward()  # torch.Tensor.backward: from the tensor's grad_fn after the edit
    assert all(torch.equal(a, b) for a, b in zip(grads_of(model), grads_of(twin), strict=True))
    with pytest.raises(RuntimeError, match=UNSCALED + r".*nor its own after an in-place edit \(scaled /= n"):
        buffer.unscale_(scaler)
    buffer.zero_()
    buffer.scale(loss_of(model) / 4, scaler).backward()  # the right call: scale the loss you differentiate
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_backward_after_detach_is_refused_as_torch_refuses_it() -> None:
    model, buffer, scaler = setup()
    scaled = buffer.scale(loss_of(model), scaler)
    scaled.detach_()
    with pytest.raises(RuntimeError, match="does not require grad"):
        scaled.backward()
    assert all(not p.grad.any() for p in model.parameters())  # type: ignore[union-attr]


def test_a_temporary_edited_in_place_and_dropped_raises_at_backward() -> None:
    """The tensor is gone by the time its `.backward` runs; a detached alias still shows the edit."""
    model, buffer, scaler = setup()
    with pytest.raises(RuntimeError, match=r"edited in place \(grads.scale\(loss, scaler\).add_\(x\), say\)"):
        buffer.scale(loss_of(model), scaler).add_(model[0].weight.sum()).backward()
    assert all(not p.grad.any() for p in model.parameters())  # type: ignore[union-attr]
    # Unedited, a backward whose tensor is gone still counts as scaled.
    backward = buffer.scale(loss_of(model), scaler).backward
    backward()
    grads_finite, _ = buffer.unscale_(scaler)
    assert bool(grads_finite)


def test_the_scaled_loss_and_its_graph_are_freed_without_a_collection() -> None:
    """`.backward` holds the tensor weakly: no reference cycle keeps the graph alive until the cyclic GC."""
    model, buffer, scaler = setup()
    hidden = model[0](torch.randn(5, 6))
    saved = weakref.ref(hidden)  # saved by the graph (for ReLU's backward), freed with it
    scaled = buffer.scale(model[2](model[1](hidden)).square().mean(), scaler)
    tensor = weakref.ref(scaled)
    del hidden
    gc.disable()
    try:
        del scaled
        assert tensor() is None and saved() is None
    finally:
        gc.enable()


@pytest.mark.compiled
# Dynamo's own, at any graph break with a non-leaf tensor live across it (the loss here), in torch 2.13.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed")
def test_a_compiled_forward_that_scales_graph_breaks_and_its_backward_counts() -> None:
    """Dynamo cannot mark the tensor: `scale` runs its marking eagerly, and the compiled result keeps `.backward`."""
    torch._dynamo.reset()
    model, buffer, scaler = setup()
    twin, twin_buffer, _ = setup()

    def forward(module: nn.Module, grads: fmp.interop.GradientBuffer, x: torch.Tensor) -> torch.Tensor:
        return grads.scale(module(x).square().mean(), scaler)

    compiled = torch.compile(forward, backend="aot_eager")
    for seed in range(2):  # the second call runs the compiled code
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
        scaled = compiled(model, buffer, x)
        assert "backward" in scaled.__dict__
        scaled.backward()
        grads_finite, _ = buffer.unscale_(scaler)
        forward(twin, twin_buffer, x).backward()
        twin_buffer.unscale_(scaler)
        assert bool(grads_finite)
        assert all(torch.equal(a, b) for a, b in zip(grads_of(model), grads_of(twin), strict=True))
        buffer.zero_()
        twin_buffer.zero_()
    torch._dynamo.reset()


def test_unscaling_by_another_loss_scale_than_scale_multiplied_by_is_refused() -> None:
    model, grads, a = setup()
    b = fmp.StaticLossScale.create(SCALE / 2)
    grads.scale(loss_of(model), a).backward()
    with pytest.raises(RuntimeError, match="unscale_ got another loss-scale state than scale"):
        grads.unscale_(b)
    grads.scale(loss_of(model, seed=1), b).backward()  # two scales in one accumulation
    with pytest.raises(RuntimeError, match=r"or scale\(\) got two"):
        grads.unscale_(b)
    grads.zero_()
    grads.scale(loss_of(model), b).backward()
    finite, _ = grads.unscale_(b)
    assert bool(finite)
