"""GradientBuffer: every .grad a view into one flat buffer per dtype, unscaled in place in one pass."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import bits
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fmp

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.complex128]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@given(st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=8))
def test_each_grad_is_an_aligned_view_into_its_dtypes_buffer(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    params = [torch.zeros(shape, dtype=dtype, requires_grad=True) for shape, dtype in specs]
    buffer = fmp.interop.GradientBuffer.attach(params)
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
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
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


def test_attach_moves_the_gradients_accumulated_so_far_into_the_buffer() -> None:
    model = make_model()
    loss_of(model, torch.randn(5, 6)).backward()
    first = next(model.parameters())
    first.grad = torch.randn(6, 16).t()  # a gradient with other strides than its parameter's
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    (flat,) = fmp.interop.GradientBuffer.attach(model.parameters()).flat()
    for param, grad in zip(model.parameters(), before, strict=True):
        assert param.grad is not None and torch.equal(param.grad, grad)
        assert param.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert param.grad.stride() == param.stride() and not param.grad.requires_grad


def test_a_dense_parameter_keeps_its_strides_and_its_gradient() -> None:
    """A transposed weight's gradient is strided as the weight, as autograd and fused optimizers expect."""
    weight = nn.Parameter(torch.randn(16, 6).t())
    twin = nn.Parameter(weight.detach().clone())
    fmp.interop.GradientBuffer.attach([weight])
    x = torch.randn(4, 6)
    (x @ weight).square().sum().backward()
    (x @ twin).square().sum().backward()
    assert weight.grad is not None and twin.grad is not None
    assert weight.grad.stride() == weight.stride() == (1, 6)
    assert torch.equal(weight.grad, twin.grad)


@given(
    st.lists(st.integers(2, 5), min_size=2, max_size=4).flatmap(
        lambda sizes: st.tuples(st.just(sizes), st.permutations(range(len(sizes))))
    )
)
def test_a_permuted_parameters_gradient_is_strided_as_autograd_strides_it(case: tuple[list[int], list[int]]) -> None:
    """Whatever order its dimensions lie in memory (transposed, channels-last), the view's strides are autograd's."""
    sizes, order = case
    weight = nn.Parameter(torch.randn(sizes).permute(order))
    twin = nn.Parameter(weight.detach().clone())
    fmp.interop.GradientBuffer.attach([weight])
    (weight * 3.0).sum().backward()
    (twin * 3.0).sum().backward()
    assert weight.grad is not None and twin.grad is not None
    assert weight.grad.stride() == twin.grad.stride() == weight.stride()
    assert torch.equal(weight.grad, twin.grad)


def test_zero_grad_to_none_is_named_and_zero__reattaches() -> None:
    model = make_model()
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, torch.randn(5, 6)).backward()
    optimizer.zero_grad(set_to_none=False)  # zeros the views in place: still attached
    (flat,) = buffer.flat()
    assert not bool(flat.any())
    optimizer.zero_grad()  # sets .grad to None
    with pytest.raises(RuntimeError, match=r"params\[0\] \(shape \(16, 6\), torch.float32\) has .grad None"):
        buffer.flat()
    loss_of(model, torch.randn(5, 6)).backward()  # fresh gradients outside the buffer
    with pytest.raises(RuntimeError, match=r"params\[0\] .* a backward after optimizer.zero_grad\(\)"):
        buffer.unscale_(fmp.StaticLossScale.create(2.0))
    buffer.zero_()
    assert buffer.flat()[0] is flat
    for param in model.parameters():
        assert param.grad is not None and param.grad.untyped_storage().data_ptr() == flat.data_ptr()


def test_a_model_cast_after_attach_is_named() -> None:
    model = make_model()
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    model.double()  # rebinds each .grad's data: the same tensor object, new memory
    with pytest.raises(RuntimeError, match=r"params\[0\] .* moved or cast \(.to\(\), .half\(\)\) after attach"):
        buffer.flat()


def test_gradients_are_not_unscaled_twice() -> None:
    model = make_model()
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    scaler = fmp.StaticLossScale.create(4.0)
    with torch.compiler.set_stance("force_eager"):  # the subject is the bookkeeping, not the kernel
        buffer.scale(loss_of(model, torch.randn(5, 6)), scaler).backward()
        buffer.unscale_(scaler)
        with pytest.raises(RuntimeError, match="the gradients were already unscaled"):
            buffer.unscale_(scaler)
        # An in-place edit, as clip_grad_norm_ makes even where it clips nothing, is no backward.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        with pytest.raises(RuntimeError, match="no backward has accumulated into them since, nor has zero_"):
            buffer.unscale_and_clip_(scaler, 1.0)
        buffer.zero_()
        buffer.scale(loss_of(model, torch.randn(5, 6)), scaler).backward()
        buffer.unscale_(scaler)


class Subclass(torch.Tensor):
    pass


def sparse_grad_param() -> torch.Tensor:
    param = torch.zeros(4, 2, requires_grad=True)
    param.grad = torch.zeros(4, 2).to_sparse()
    return param


BAD_PARAMS: dict[str, tuple[Callable[[], list[Any]], type[Exception], str]] = {
    "empty": (lambda: [], ValueError, r"params is empty"),
    "not a tensor": (lambda: [torch.zeros(2, requires_grad=True), 3.0], TypeError, r"params\[1\] is a float"),
    "no grad": (
        lambda: [torch.zeros(2)],
        ValueError,
        r"params\[0\] \(shape \(2,\), torch.float32\) does not require.* if p.requires_grad\)",
    ),
    "not a leaf": (lambda: [torch.zeros(2, requires_grad=True) * 2], ValueError, r"params\[0\] .* not a leaf"),
    "sparse": (
        lambda: [torch.zeros(2, 2).to_sparse().requires_grad_()],
        ValueError,
        r"params\[0\] .* layout torch.sparse_coo",
    ),
    "sparse grad": (lambda: [sparse_grad_param()], ValueError, r"params\[0\] .* has a torch.sparse_coo gradient"),
    "two devices": (
        lambda: [torch.zeros(2, requires_grad=True), torch.zeros(2, device="meta", requires_grad=True)],
        ValueError,
        r"params span cpu, meta: attach one GradientBuffer per device",
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
        fmp.interop.GradientBuffer.attach(make())


def test_a_parameter_listed_twice_is_named_and_nothing_is_attached() -> None:
    shared = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"params\[2\] .* listed twice, as params\[0\] and params\[2\]"):
        fmp.interop.GradientBuffer.attach([shared, torch.zeros(2, requires_grad=True), shared])
    assert shared.grad is None


def refuse_to_compile(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("torch.compile was called")


@pytest.mark.compiled
@pytest.mark.parametrize("mode", ["compiled", "eager-fallback", "not-compiled"])
def test_a_training_loop_matches_grad_scaler_with_fused_adamw_bit_for_bit(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.amp (unscale_, step, update) against GradientBuffer.unscale_ with found_inf, skips included.

    Both sides drive the same fused AdamW; on fmp's side `step` has it skip on the device through
    `found_inf`, as GradScaler does. With "eager-fallback" the compiled unscale runs eagerly, as
    past Dynamo's recompile limit, and must still write in place; "not-compiled" attaches with
    `compiled=False`, which never calls torch.compile (no C++ compiler needed).
    """
    torch._dynamo.reset()
    fallback = mode == "eager-fallback"
    if mode == "not-compiled":
        monkeypatch.setattr(torch, "compile", refuse_to_compile)
    model, twin = make_model(), make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    reference_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    buffer = fmp.interop.GradientBuffer.attach(model.parameters(), compiled=mode != "not-compiled")
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

            buffer.scale(loss_of(model, x), scaler).backward()
            grads_finite, scaler = buffer.unscale_(scaler)
            buffer.step(optimizer, grads_finite)
            buffer.zero_()
            skipped += int(not bool(grads_finite))
            assert float(scaler.loss_scale) == grad_scaler.get_scale()
    assert skipped == 3
    for param, reference in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(bits(param.detach()), bits(reference.detach()))
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], reference_optimizer.state[reference][key])


@pytest.mark.compiled
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex operators")
@pytest.mark.parametrize("stance", ["default", "force_eager"])
def test_unscale_writes_the_unscaled_values_over_the_gradients_and_checks_them(stance: str) -> None:
    torch._dynamo.reset()
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, dtype=torch.complex64, requires_grad=True)]
    buffer = fmp.interop.GradientBuffer.attach(params)
    params[0].grad.copy_(torch.tensor([4.0, -8.0, 0.5]))  # type: ignore[union-attr]
    params[1].grad.fill_(2.0 + 4.0j)  # type: ignore[union-attr]
    flat = buffer.flat()
    with torch.compiler.set_stance(stance):
        grads_finite, scaler = buffer.unscale_(fmp.StaticLossScale.create(4.0))
        assert bool(grads_finite) and isinstance(scaler, fmp.StaticLossScale)
        assert all(a is b for a, b in zip(buffer.flat(), flat, strict=True))
        assert params[0].grad is not None and params[0].grad.tolist() == [1.0, -2.0, 0.125]
        assert params[1].grad is not None and bool((params[1].grad == 0.5 + 1.0j).all())
        buffer.zero_()  # gradients written by hand: zero_() first, or the next unscale_ is refused
        params[1].grad[0, 1] = complex(float("nan"), 0.0)
        grads_finite, _ = buffer.unscale_(scaler)
        assert not bool(grads_finite)


def zero_size_and_real() -> list[torch.Tensor]:
    return [torch.zeros(0, 3, requires_grad=True), torch.ones(3, requires_grad=True)]


@pytest.mark.parametrize("make", [lambda: [torch.zeros(0, 3, requires_grad=True)], zero_size_and_real])
def test_zero_size_parameters_unscale_to_finite(make: Callable[[], list[torch.Tensor]]) -> None:
    buffer = fmp.interop.GradientBuffer.attach(make())
    with torch.compiler.set_stance("force_eager"):
        grads_finite, _ = buffer.unscale_(fmp.StaticLossScale.create(2.0))
    assert bool(grads_finite)


OPTIMIZERS_THAT_SKIP: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1, fused=True),
}


def step_on(
    model: nn.Module, buffer: fmp.interop.GradientBuffer, optimizer: torch.optim.Optimizer, x: torch.Tensor
) -> bool:
    """One step of the README's loop with a static scale; returns whether its gradients were finite."""
    scaler = fmp.StaticLossScale.create(2.0)
    with torch.compiler.set_stance("force_eager"):
        buffer.scale(loss_of(model, x), scaler).backward()
        grads_finite, _ = buffer.unscale_(scaler)
    buffer.step(optimizer, grads_finite)
    buffer.zero_()
    return bool(grads_finite)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS_THAT_SKIP))
def test_a_skipped_step_leaves_params_and_optimizer_state_bit_for_bit(name: str) -> None:
    model = make_model()
    optimizer = OPTIMIZERS_THAT_SKIP[name](list(model.parameters()))
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    poisoned = torch.randn(5, 6)
    poisoned[0, 0] = float("inf")

    def snapshot() -> tuple[list[torch.Tensor], dict[Any, Any]]:
        return [bits(p.detach().clone()) for p in model.parameters()], copy.deepcopy(optimizer.state_dict()["state"])

    params_before, _ = snapshot()
    assert not step_on(model, buffer, optimizer, poisoned)
    params_after, state_after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(params_after, params_before, strict=True))
    # Fused optimizers fill their state on the first step, skipped or not: it must be the initial one.
    keeps_state = name != "sgd"  # SGD without momentum has none
    assert bool(state_after) == keeps_state
    for index, entries in state_after.items():
        for key, value in entries.items():
            assert value is None or not value.any(), (index, key)  # step 0, zero moments and sums
    assert step_on(model, buffer, optimizer, torch.randn(5, 6))
    params_before, state_before = snapshot()
    assert not keeps_state or any(
        v is not None and v.any() for entries in state_before.values() for v in entries.values()
    )
    assert not step_on(model, buffer, optimizer, poisoned)
    params_after, state_after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(params_after, params_before, strict=True))
    assert state_after.keys() == state_before.keys()
    for index, entries in state_before.items():
        for key, value in entries.items():
            after = state_after[index][key]
            assert (after is None and value is None) or torch.equal(bits(after), bits(value)), (index, key)
    assert not hasattr(optimizer, "found_inf")  # handed over for the step only


REFUSED: dict[str, tuple[Callable[[list[nn.Parameter]], Any], str]] = {
    "unfused adamw": (lambda p: torch.optim.AdamW(p, lr=0.1), r"AdamW cannot skip a step on the device"),
    "rmsprop": (lambda p: torch.optim.RMSprop(p, lr=0.1), r"RMSprop cannot skip a step on the device"),
    "fused sgd with momentum": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
        r"fused SGD with momentum cannot skip its first step",
    ),
    "not an optimizer": (lambda p: object(), r"optimizer must be a torch.optim.Optimizer, got object"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_step_refuses_optimizers_that_would_apply_an_overflowed_step(case: str) -> None:
    model = make_model()
    make, message = REFUSED[case]
    optimizer = make(list(model.parameters()))
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    params_before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=message):
        buffer.step(optimizer, torch.tensor(False))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params_before, strict=True))


def test_step_names_a_wrong_finite_flag() -> None:
    model = make_model()
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(ValueError, match=r"grads_finite must be a 0-dim bool tensor"):
        buffer.step(optimizer, torch.tensor([True]))


def test_compiled_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="compiled must be a bool, got int"):
        fmp.interop.GradientBuffer.attach([torch.zeros(2, requires_grad=True)], compiled=1)  # type: ignore[arg-type]


def test_step_names_an_optimizer_parameter_outside_the_buffer() -> None:
    # unscale_ never sees its gradient: the optimizer would apply it times the loss scale.
    model, other = make_model(), torch.nn.Linear(2, 1)
    buffer = fmp.interop.GradientBuffer.attach(model.parameters())
    optimizer = torch.optim.AdamW([*model.parameters(), *other.parameters()], fused=True)
    for param in other.parameters():
        param.grad = torch.ones_like(param)  # written by a backward, never unscaled
    before = [p.detach().clone() for p in [*model.parameters(), *other.parameters()]]
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[\d+\] \(shape \(1, 2\), torch.float32\), whose gradient no"
    ):
        buffer.step(optimizer, torch.tensor(True))
    after = [*model.parameters(), *other.parameters()]
    assert all(torch.equal(p, b) for p, b in zip(after, before, strict=True))
    # Frozen parameters (no gradient) outside the buffer are not stepped: fine-tuning with an optimizer
    # over model.parameters() and a buffer over the trainable ones.
    for param in other.parameters():
        param.grad = None
    other.requires_grad_(False)
    buffer.step(optimizer, torch.tensor(True))
    assert all(torch.equal(p, b) for p, b in zip(other.parameters(), before[-2:], strict=True))
    # Parameters in another buffer (one per device, say) are another unscale_'s: once it has run.
    other_buffer = fmp.interop.GradientBuffer.attach(other.requires_grad_().parameters(), compiled=False)
    buffer.step(optimizer, torch.tensor(True))  # nothing accumulated into the other buffer yet
    scaler = fmp.StaticLossScale.create(2.0**10)
    other_buffer.scale(other(torch.randn(5, 2)).square().mean(), scaler).backward()
    before = [p.detach().clone() for p in [*model.parameters(), *other.parameters()]]
    with pytest.raises(ValueError, match=r"whose GradientBuffer has not been unscaled since its last backward"):
        buffer.step(optimizer, torch.tensor(True))
    after = [*model.parameters(), *other.parameters()]
    assert all(torch.equal(p, b) for p, b in zip(after, before, strict=True))
    other_buffer.unscale_(scaler)
    buffer.step(optimizer, torch.tensor(True))
    # A view set by hand as a gradient is no buffer's.
    other.weight.grad = torch.ones(4)[:2].view(1, 2)
    with pytest.raises(ValueError, match=r"\(shape \(1, 2\), torch.float32\), whose gradient no GradientBuffer holds"):
        buffer.step(optimizer, torch.tensor(True))


def test_a_buffer_attached_again_leaves_no_hooks_of_the_old_one() -> None:
    model = make_model()
    for _ in range(3):  # as after moving the model, which the errors advise
        buffer = fmp.interop.GradientBuffer.attach(model.parameters(), compiled=False)
    gc.collect()
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in model.parameters())
    del buffer
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_shallow_copy_keeps_seeing_backwards_after_the_original_is_gone() -> None:
    model = make_model()
    original = fmp.interop.GradientBuffer.attach(model.parameters(), compiled=False)
    handle = copy.copy(original)
    del original
    gc.collect()
    scaler = fmp.StaticLossScale.create(2.0)
    handle.scale(loss_of(model, torch.randn(5, 6)), scaler).backward()
    handle.unscale_(scaler)
    # No zero_() between: the second backward's hooks must still mark the gradients, mixed now.
    handle.scale(loss_of(model, torch.randn(5, 6)), scaler).backward()
    with pytest.raises(RuntimeError, match="they mix unscaled and scaled values"):
        handle.unscale_(scaler)
    handle.zero_()
    handle.scale(loss_of(model, torch.randn(5, 6)), scaler).backward()
    handle.unscale_(scaler)


def test_named_parameters_attach_alike_and_their_names_are_given() -> None:
    model = make_model()
    buffer = fmp.interop.GradientBuffer.attach(model.named_parameters(), compiled=False)
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()  # sets .grad to None
    with pytest.raises(
        RuntimeError, match=r"params\[0\] \('0\.weight', shape \(16, 6\), torch.float32\) has .grad None"
    ):
        buffer.flat()
    by_name = make_model()
    fmp.interop.GradientBuffer.attach(dict(by_name.named_parameters()), compiled=False)  # a dict gives its items
    assert by_name[0].weight.grad is not None and by_name[0].weight.grad._base is not None
    frozen = make_model()
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"params\[0\] \('0\.weight', shape .* does not require grad"):
        fmp.interop.GradientBuffer.attach(frozen.named_parameters())


def test_zero__clears_the_padding_a_non_finite_clip_wrote() -> None:
    # A NaN norm makes a NaN clip factor, multiplied over the whole buffer, padding included; a
    # padding left NaN would make every later norm NaN and skip every later step.
    param = torch.nn.Parameter(torch.randn(10, generator=torch.Generator().manual_seed(0)))
    buffer = fmp.interop.GradientBuffer.attach([param], compiled=False)
    scaler = fmp.DynamicLossScale.create(init_scale=4.0)
    buffer.scale((param * float("nan")).sum(), scaler).backward()
    grads_finite, _, scaler = buffer.unscale_and_clip_(scaler, 1.0)
    assert not bool(grads_finite)
    buffer.zero_()
    assert not bool(buffer.flat()[0].isnan().any())
    buffer.scale(param.sum(), scaler).backward()
    grads_finite, norm, _ = buffer.unscale_and_clip_(scaler, 1.0)
    assert bool(grads_finite) and float(norm) == float(torch.linalg.vector_norm(torch.ones(10)))
