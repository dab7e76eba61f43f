"""GradientBuffer: every .grad a view into one flat buffer per dtype, unscaled in place in one pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import bits
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fmp

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@given(st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=8))
def test_each_grad_is_an_aligned_view_into_its_dtypes_buffer(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    params = [torch.zeros(shape, dtype=dtype, requires_grad=True) for shape, dtype in specs]
    buffer = fmp.GradientBuffer.attach(params)
    flat = buffer.flat()
    first_seen = list(dict.fromkeys(dtype for _, dtype in specs))
    assert [b.dtype for b in flat] == first_seen
    for b in flat:  # whole rows of 1024 for the compiled GPU finite check
        assert b.dim() == 1 and b.numel() % 1024 == 0 and not bool(b.any())
    ends: dict[torch.dtype, int] = {}
    for param in params:
        grad = param.grad
        assert grad is not None
        assert (grad.shape, grad.dtype, grad.device) == (param.shape, param.dtype, param.device)
        owner = flat[first_seen.index(param.dtype)]
        assert grad.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()
        start = grad.storage_offset()
        assert start * grad.element_size() % 64 == 0
        assert start >= ends.get(param.dtype, 0), "views overlap or are out of order"
        ends[param.dtype] = start + grad.numel()
    for b in flat:
        assert ends[b.dtype] <= b.numel()


def test_backward_accumulates_into_the_views_exactly_as_into_tensors_of_their_own() -> None:
    model, twin = make_model(), make_model()
    buffer = fmp.GradientBuffer.attach(model.parameters())
    views = [p.grad for p in model.parameters()]
    for seed in range(2):  # the second backward accumulates onto the first
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
        loss_of(model, x).backward()
        loss_of(twin, x).backward()
    for param, view, reference in zip(model.parameters(), views, twin.parameters(), strict=True):
        assert param.grad is view
        assert reference.grad is not None and torch.equal(bits(param.grad), bits(reference.grad))
    (flat,) = buffer.flat()  # the padding between views stays zero
    nonzero = [int(p.grad.count_nonzero()) for p in twin.parameters() if p.grad is not None]
    assert int(flat.count_nonzero()) == sum(nonzero)


def test_attach_keeps_the_gradients_accumulated_so_far() -> None:
    model = make_model()
    loss_of(model, torch.randn(5, 6)).backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    fmp.GradientBuffer.attach(model.parameters())
    for param, grad in zip(model.parameters(), before, strict=True):
        assert param.grad is not None and torch.equal(param.grad, grad)


def test_zero_grad_to_none_is_named_and_zero__reattaches() -> None:
    model = make_model()
    buffer = fmp.GradientBuffer.attach(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, torch.randn(5, 6)).backward()
    optimizer.zero_grad(set_to_none=False)  # zeros the views in place: still attached
    (flat,) = buffer.flat()
    assert not bool(flat.any())
    optimizer.zero_grad()  # sets .grad to None
    with pytest.raises(RuntimeError, match=r"params\[0\] \(shape \(16, 6\), torch.float32\) has .grad None"):
        buffer.flat()
    buffer.zero_()
    assert buffer.flat()[0] is flat
    next(model.parameters()).grad = torch.ones(16, 6)
    with pytest.raises(RuntimeError, match=r"params\[0\] .* not its view into the buffer"):
        buffer.unscale_(fmp.StaticLossScale.create(2.0))
    buffer.zero_()
    for param in model.parameters():
        assert param.grad is not None and param.grad.untyped_storage().data_ptr() == flat.data_ptr()


class Subclass(torch.Tensor):
    pass


BAD_PARAMS: dict[str, tuple[Callable[[], list[Any]], type[Exception], str]] = {
    "empty": (lambda: [], ValueError, r"params is empty"),
    "not a tensor": (lambda: [torch.zeros(2, requires_grad=True), 3.0], TypeError, r"params\[1\] is a float"),
    "no grad": (lambda: [torch.zeros(2)], ValueError, r"params\[0\] \(shape \(2,\), torch.float32\) does not require"),
    "not a leaf": (lambda: [torch.zeros(2, requires_grad=True) * 2], ValueError, r"params\[0\] .* not a leaf"),
    "sparse": (
        lambda: [torch.zeros(2, 2).to_sparse().requires_grad_()],
        ValueError,
        r"params\[0\] .* layout torch.sparse_coo",
    ),
    "subclass": (
        lambda: [torch.zeros(2).as_subclass(Subclass).requires_grad_()],
        TypeError,
        r"params\[0\] .* is a Subclass",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_bad_params_are_named(case: str) -> None:
    make, error, message = BAD_PARAMS[case]
    with pytest.raises(error, match=message):
        fmp.GradientBuffer.attach(make())


def test_a_parameter_listed_twice_is_named_and_nothing_is_attached() -> None:
    shared = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"params\[2\] .* listed twice, as params\[0\] and params\[2\]"):
        fmp.GradientBuffer.attach([shared, torch.zeros(2, requires_grad=True), shared])
    assert shared.grad is None


@pytest.mark.parametrize("fallback", [False, True], ids=["compiled", "eager-fallback"])
def test_a_training_loop_matches_grad_scaler_with_fused_adamw_bit_for_bit(fallback: bool) -> None:
    """torch.amp (unscale_, step, update) against GradientBuffer.unscale_ with found_inf, skips included.

    Both sides drive the same fused AdamW; on fmp's side it skips on the device through
    `found_inf`, as GradScaler hands it. With `fallback` the compiled unscale runs eagerly, as past
    Dynamo's recompile limit, and must still write in place.
    """
    torch._dynamo.reset()
    model, twin = make_model(), make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    reference_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    buffer = fmp.GradientBuffer.attach(model.parameters())
    scaler = fmp.DynamicLossScale.create(2.0**10, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    skipped = 0
    with torch.compiler.set_stance("force_eager" if fallback else "default"):
        for step in range(10):
            x = torch.randn(4, 6, generator=gen)
            if step % 4 == 1:
                x[0, 0] = float("inf")
            grad_scaler.scale(loss_of(twin, x)).backward()
            grad_scaler.unscale_(reference_optimizer)
            grad_scaler.step(reference_optimizer)
            grad_scaler.update()
            reference_optimizer.zero_grad()

            scaler.scale(loss_of(model, x)).backward()
            grads_finite, scaler = buffer.unscale_(scaler)
            optimizer.found_inf = (~grads_finite).float()
            optimizer.step()
            buffer.zero_()
            skipped += int(not bool(grads_finite))
            assert float(scaler.loss_scale) == grad_scaler.get_scale()
    assert skipped == 3
    for param, reference in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(bits(param.detach()), bits(reference.detach()))
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], reference_optimizer.state[reference][key])


def test_unscale_writes_the_unscaled_values_over_the_gradients_and_checks_them() -> None:
    torch._dynamo.reset()
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)]
    buffer = fmp.GradientBuffer.attach(params)
    params[0].grad.copy_(torch.tensor([4.0, -8.0, 0.5]))  # type: ignore[union-attr]
    params[1].grad.fill_(2.0)  # type: ignore[union-attr]
    flat = buffer.flat()
    grads_finite, scaler = buffer.unscale_(fmp.StaticLossScale.create(4.0))
    assert bool(grads_finite) and isinstance(scaler, fmp.StaticLossScale)
    assert buffer.flat() == flat
    assert params[0].grad is not None and params[0].grad.tolist() == [1.0, -2.0, 0.125]
    assert params[1].grad is not None and bool((params[1].grad == 0.5).all())
    params[1].grad[0, 1] = float("nan")
    grads_finite, _ = buffer.unscale_(scaler)
    assert not bool(grads_finite)
