"""fmp under torch.compile(fullgraph=True), torch.func.vmap and torch.func.grad."""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import mlp_loss
from conftest import mlp_params
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
ADAMW = fmp.optim.adamw(1e-2)


def batches(steps: int, overflow_every: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    for i in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        if overflow_every and i % overflow_every == overflow_every - 1:
            x[0, 0] = float("inf")
        yield x, y


@pytest.fixture(scope="module")
def compiled_train_step() -> tuple[Callable[..., Any], CompileCounterWithBackend]:
    # Dynamo caches per code object: earlier compiles of train_step would count as recompiles here.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = functools.partial(fmp.train_step, mlp_loss, policy=BF16, optimizer=ADAMW)
    return torch.compile(step, backend=counter, fullgraph=True), counter


@pytest.mark.compiled
def test_compiled_step_matches_eager_without_recompiling(
    compiled_train_step: tuple[Callable[..., Any], CompileCounterWithBackend],
) -> None:
    compiled, counter = compiled_train_step
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)
    eager_state = compiled_state = fmp.TrainState.create(mlp_params(), ADAMW, scaler)
    scales, skips = set(), 0
    for x, y in batches(20, overflow_every=5):
        eager_state, eager_info = fmp.train_step(mlp_loss, eager_state, x, y, policy=BF16, optimizer=ADAMW)
        compiled_state, info = compiled(compiled_state, x, y)
        assert bool(info.grads_finite) == bool(eager_info.grads_finite)
        assert_trees_bitwise_equal(compiled_state.scaler, eager_state.scaler)
        assert_trees_close(compiled_state.params, eager_state.params, **TOLERANCES[torch.bfloat16])
        scales.add(float(info.loss_scale))
        skips += not bool(info.grads_finite)
    assert skips == 4 and len(scales) > 3  # the scale moved both ways...
    assert counter.frame_count == 1  # ...and the step compiled once, as one graph
    # A fresh scaler with another value but the same hyperparameters reuses the graph too.
    compiled(fmp.TrainState.create(mlp_params(), ADAMW, scaler), *next(batches(1, 0)))
    assert counter.frame_count == 1


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
        for x, y in batches(3, overflow_every=2):
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
    for x, y in batches(3, overflow_every=2):
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


def stack(trees: list[Any]) -> Any:
    return pytree.tree_map(lambda *xs: torch.stack(xs), *trees)


def unstack(tree: Any, index: int) -> Any:
    return pytree.tree_map(lambda x: x[index], tree)


def test_vmap_over_an_ensemble_gives_each_member_its_own_scale() -> None:
    policy = fmp.Policy()
    members = [
        fmp.TrainState.create(
            mlp_params(seed=s), ADAMW, fmp.DynamicLossScale.create(init_scale=2.0**k, growth_interval=1)
        )
        for s, k in [(0, 4), (1, 8), (2, 12)]
    ]
    data = [next(batches(1, 0)) for _ in range(3)]
    xs, ys = torch.stack([x for x, _ in data]), torch.stack([y for _, y in data])
    xs[1, 2, 3] = float("nan")  # member 1 alone overflows
    step = torch.func.vmap(functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=ADAMW))
    new, info = step(stack(members), xs, ys)
    assert info.grads_finite.tolist() == [True, False, True]
    assert new.scaler.loss_scale.tolist() == [2.0**5, 2.0**7, 2.0**13]
    assert_trees_bitwise_equal(unstack((new.params, new.opt_state), 1), (members[1].params, members[1].opt_state))
    for i in (0, 2):
        alone, alone_info = fmp.train_step(mlp_loss, members[i], xs[i], ys[i], policy=policy, optimizer=ADAMW)
        assert_trees_close(unstack(new.params, i), alone.params, **TOLERANCES[torch.float32])
        torch.testing.assert_close(info.loss[i], alone_info.loss, **TOLERANCES[torch.float32])


def test_vmap_over_per_example_gradients_in_bf16() -> None:
    params, (x, y) = mlp_params(), next(batches(1, 0))
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
    params, (x, y), (x_val, y_val) = mlp_params(), next(batches(1, 0)), next(batches(2, 0))
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
