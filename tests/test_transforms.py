"""fmp under torch.compile(fullgraph=True), torch.func.vmap and torch.func.grad."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
F32 = fmp.Policy()
ADAMW = fmp.optim.adamw(1e-2)


@pytest.fixture(scope="module")
def compiled_train_step() -> tuple[Callable[..., Any], CompileCounterWithBackend]:
    # Dynamo caches per code object: earlier compiles of train_step would count as recompiles here.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = functools.partial(fmp.train_step, mlp_loss, policy=BF16, optimizer=ADAMW, grad_norm=True)
    return torch.compile(step, backend=counter, fullgraph=True), counter


@pytest.mark.compiled
def test_compiled_step_matches_eager_without_recompiling(
    compiled_train_step: tuple[Callable[..., Any], CompileCounterWithBackend],
) -> None:
    compiled, counter = compiled_train_step
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    eager_state = compiled_state = fmp.TrainState.create(mlp_params(), ADAMW, scaler)
    scales, skips = set(), 0
    for x, y in mlp_batches(20, overflow_every=5):
        eager_state, eager_info = fmp.train_step(
            mlp_loss, eager_state, x, y, policy=BF16, optimizer=ADAMW, grad_norm=True
        )
        compiled_state, info = compiled(compiled_state, x, y)
        assert bool(info.grads_finite) == bool(eager_info.grads_finite) == bool(info.grad_norm.isfinite())
        if bool(info.grads_finite):
            torch.testing.assert_close(info.grad_norm, eager_info.grad_norm, **TOLERANCES[torch.bfloat16])
        assert_trees_bitwise_equal(compiled_state.scaler, eager_state.scaler)
        assert_trees_close(compiled_state.params, eager_state.params, **TOLERANCES[torch.bfloat16])
        scales.add(float(info.loss_scale))
        skips += not bool(info.grads_finite)
    assert skips == 4 and len(scales) > 3  # the scale moved both ways...
    assert counter.frame_count == 1  # ...and the step compiled once, as one graph
    # A fresh scaler with another value but the same hyperparameters reuses the graph too.
    compiled(fmp.TrainState.create(mlp_params(), ADAMW, scaler), *next(mlp_batches(1, 0)))
    assert counter.frame_count == 1


@pytest.mark.compiled
def test_a_thousand_compiled_steps_compile_once(
    compiled_train_step: tuple[Callable[..., Any], CompileCounterWithBackend],
) -> None:
    compiled, counter = compiled_train_step
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    state = fmp.TrainState.create(mlp_params(), ADAMW, scaler)
    data = list(mlp_batches(1000, overflow_every=7))
    state, _ = compiled(state, *data[0])
    graphs = counter.frame_count
    finite, scales = [], []
    for x, y in data[1:]:
        state, info = compiled(state, x, y)
        finite.append(info.grads_finite)
        scales.append(info.loss_scale)
    assert counter.frame_count == graphs == 1
    applied, scale = torch.stack(finite), torch.stack(scales)
    assert int((~applied).sum()) == 1000 // 7  # every seventh batch holds an inf
    assert bool((scale.diff() > 0).any() and (scale.diff() < 0).any())  # the scale moved both ways
    assert int(state.opt_state.step) == int(applied.sum()) + 1  # skipped steps leave Adam's count alone


@pytest.mark.compiled
def test_compiled_step_takes_other_scaler_hyperparameters(
    compiled_train_step: tuple[Callable[..., Any], CompileCounterWithBackend],
) -> None:
    # Hyperparameters are static (in the treespec): a new set recompiles (once Dynamo has seen a float
    # change it traces it symbolically, so later sets may reuse that graph), and the results stay exact.
    compiled, counter = compiled_train_step
    graphs = counter.frame_count
    for factors in [(3.0, 0.25), (1.5, 0.3), (2.0, 0.5)]:
        scaler = fmp.DynamicLossScale.create(
            init_scale=2.0**10, growth_factor=factors[0], backoff_factor=factors[1], growth_interval=1
        )
        eager_state = compiled_state = fmp.TrainState.create(mlp_params(), ADAMW, scaler)
        for x, y in mlp_batches(3, overflow_every=2):
            eager_state, _ = fmp.train_step(mlp_loss, eager_state, x, y, policy=BF16, optimizer=ADAMW)
            compiled_state, _ = compiled(compiled_state, x, y)
            assert_trees_bitwise_equal(compiled_state.scaler, eager_state.scaler)
    assert graphs < counter.frame_count <= graphs + 2  # the defaults (2.0, 0.5) were compiled already


@pytest.mark.compiled
def test_compiled_short_form_skips_bit_for_bit() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    optimizer = fmp.optim.sgd(0.1)
    step = torch.compile(
        functools.partial(fmp.mixed_precision_step, mlp_loss, policy=BF16, optimizer=optimizer),
        backend=counter,
        fullgraph=True,
    )
    params, scaler = mlp_params(), fmp.DynamicLossScale.create()
    for x, y in mlp_batches(3, overflow_every=2):
        new_params, new_scaler = step(params, scaler, x, y)
        eager_params, eager_scaler = fmp.mixed_precision_step(
            mlp_loss, params, scaler, x, y, policy=BF16, optimizer=optimizer
        )
        assert_trees_bitwise_equal(new_scaler, eager_scaler)
        assert_trees_close(new_params, eager_params, **TOLERANCES[torch.bfloat16])
        if not bool(fmp.all_finite(x)):
            assert_trees_bitwise_equal(new_params, params)
        params, scaler = new_params, new_scaler
    assert counter.frame_count == 1


def test_vmap_over_an_ensemble_gives_each_member_its_own_scale() -> None:
    policy = fmp.Policy()
    members = [
        fmp.TrainState.create(
            mlp_params(seed=s), ADAMW, fmp.DynamicLossScale.create(init_scale=2.0**k, growth_interval=1)
        )
        for s, k in [(0, 4), (1, 8), (2, 12)]
    ]
    data = [next(mlp_batches(1, 0)) for _ in range(3)]
    xs, ys = torch.stack([x for x, _ in data]), torch.stack([y for _, y in data])
    xs[1, 2, 3] = float("nan")  # member 1 alone overflows
    step = torch.func.vmap(functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=ADAMW))
    new, info = step(fmp.stack_trees(members), xs, ys)
    assert info.grads_finite.tolist() == [True, False, True]
    assert new.scaler.loss_scale.tolist() == [2.0**5, 2.0**7, 2.0**13]
    assert_trees_bitwise_equal(
        fmp.unstack_tree((new.params, new.opt_state), 1), (members[1].params, members[1].opt_state)
    )
    for i in (0, 2):
        alone, alone_info = fmp.train_step(mlp_loss, members[i], xs[i], ys[i], policy=policy, optimizer=ADAMW)
        assert_trees_close(fmp.unstack_tree(new.params, i), alone.params, **TOLERANCES[torch.float32])
        torch.testing.assert_close(info.loss[i], alone_info.loss, **TOLERANCES[torch.float32])


def test_vmap_over_per_example_gradients_in_bf16() -> None:
    params, (x, y) = mlp_params(), next(mlp_batches(1, 0))
    scaler = fmp.DynamicLossScale.create()

    def per_example(x1: torch.Tensor, y1: torch.Tensor) -> fmp.Gradients:
        return fmp.mixed_precision_grad(mlp_loss, params, scaler, x1[None], y1[None], policy=BF16)

    out = torch.func.vmap(per_example)(x, y)
    assert out.grads["w1"].shape == (16, 8, 8) and out.grads_finite.shape == (16,)
    mean = pytree.tree_map(lambda g: g.mean(0), out.grads)
    full = fmp.mixed_precision_grad(mlp_loss, params, scaler, x, y, policy=BF16).grads
    assert_trees_close(mean, full, **TOLERANCES[torch.bfloat16])


def test_grad_through_a_train_step_equals_the_plain_meta_gradient() -> None:
    # Differentiate a validation loss through one fmp step w.r.t. the training inputs (meta-learning).
    params, (x, y), (x_val, y_val) = mlp_params(), next(mlp_batches(1, 0)), next(mlp_batches(2, 0))
    optimizer = fmp.optim.sgd(0.1)

    def after_fmp_step(x: torch.Tensor) -> torch.Tensor:
        state = fmp.TrainState.create(params, optimizer, fmp.StaticLossScale.create(2.0**8))
        new_state, _ = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
        return mlp_loss(new_state.params, x_val, y_val)

    def after_plain_step(x: torch.Tensor) -> torch.Tensor:
        grads = torch.func.grad(mlp_loss)(params, x, y)
        return mlp_loss(pytree.tree_map(lambda p, g: p - 0.1 * g, params, grads), x_val, y_val)

    ours, plain = torch.func.grad(after_fmp_step)(x), torch.func.grad(after_plain_step)(x)
    torch.testing.assert_close(ours, plain, **TOLERANCES[torch.float32])
    assert ours.abs().sum() > 0


def test_gradients_equal_torch_func_grad_whether_or_not_an_outer_transform_differentiates_them() -> None:
    # Alone (and under vmap) the step backpropagates without recording its backward pass, freeing
    # activations as it goes; under an outer grad it records it, as torch.func.grad does.
    params, (x, y) = mlp_params(), next(mlp_batches(1, 0))

    def grads(p: Any) -> Any:
        return fmp.mixed_precision_grad(mlp_loss, p, fmp.NoOpLossScale(), x, y, policy=F32).grads

    assert_trees_bitwise_equal(grads(params), torch.func.grad(mlp_loss)(params, x, y))
    # Second order through an outer grad, and with plain autograd tracking an input.
    norm = torch.func.grad(lambda p: sum(g.square().sum() for g in grads(p).values()))(params)
    plain = torch.func.grad(lambda p: sum(g.square().sum() for g in torch.func.grad(mlp_loss)(p, x, y).values()))
    assert_trees_close(norm, plain(params), **TOLERANCES[torch.float32])
    assert all(bool(n.abs().sum() > 0) for n in pytree.tree_leaves(norm))
    tracked = x.clone().requires_grad_()
    loss = fmp.mixed_precision_grad(mlp_loss, params, fmp.NoOpLossScale(), tracked, y, policy=F32)
    sum(g.square().sum() for g in loss.grads.values()).backward()
    by_x = torch.func.grad(lambda x: sum(g.square().sum() for g in torch.func.grad(mlp_loss)(params, x, y).values()))
    assert_trees_close(tracked.grad, by_x(x), **TOLERANCES[torch.float32])
    # And through a tensor the loss captures rather than takes (a learned loss weight).
    weight = torch.tensor(0.5, requires_grad=True)
    weighted = fmp.mixed_precision_grad(
        lambda p, x, y: weight * mlp_loss(p, x, y), params, fmp.NoOpLossScale(), x, y, policy=F32
    )
    (by_weight,) = torch.autograd.grad(sum(g.sum() for g in weighted.grads.values()), weight)
    plain_by_weight = sum(g.sum() for g in torch.func.grad(mlp_loss)(params, x, y).values())
    torch.testing.assert_close(by_weight, plain_by_weight, **TOLERANCES[torch.float32])


@pytest.mark.compiled
def test_compiled_step_updates_batchnorm_statistics_passed_as_args_like_eager() -> None:
    # torch.compile of any functools.partial shares one code object; a fresh Dynamo keeps what
    # earlier tests compiled (their automatic dynamic shapes) from restarting this compile.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = fmp.optim.sgd(0.1)

    def loss_fn(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, {**params, **buffers}, (x,)), y)

    def run(step: Callable[..., Any]) -> tuple[fmp.TrainState, dict[str, torch.Tensor]]:
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
        for x, y in mlp_batches(3, 0):
            state, _ = step(state, buffers, x, y)
        return state, buffers

    counter = CompileCounterWithBackend("inductor")
    step = functools.partial(fmp.train_step, loss_fn, policy=F32, optimizer=optimizer)
    (eager_state, eager_buffers), (state, buffers) = (
        run(step),
        run(torch.compile(step, backend=counter, fullgraph=True)),
    )
    assert counter.frame_count == 1 and int(buffers["1.num_batches_tracked"]) == 3
    assert_trees_close(buffers, eager_buffers, **TOLERANCES[torch.float32])
    assert_trees_close(state.params, eager_state.params, **TOLERANCES[torch.float32])
