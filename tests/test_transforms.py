"""fmp under torch.compile(fullgraph=True), torch.func.vmap and torch.func.grad."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import assert_unmutated
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from conftest import snapshot
from torch._dynamo.testing import CompileCounterWithBackend

import fmp
from fmp._donation import writable

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
@pytest.mark.parametrize(
    ("compute", "planned"),
    [("float32", False), ("float32", True), ("bfloat16", False)],
    ids=["float32", "float32-planned", "bfloat16"],
)
def test_donated_compiled_step_reuses_the_buffers_bit_identically(compute: str, planned: bool) -> None:
    torch._dynamo.reset()
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    policy = fmp.get_policy(f"params=float32,compute={compute},output=float32")
    # Inductor skips intermediate bf16 roundings differently per fusion unless told to round as eager
    # does; with that, the donating graph computes exactly what the pure one does. float32 needs
    # nothing. Memory planning (the README's advice for CPU steps) only changes where temporaries live.
    options = {"emulate_precision_casts": True} if compute == "bfloat16" else {}
    donating_options = options | {"memory_planning": True} if planned else options
    pure_step, donating_step = (
        torch.compile(
            functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=optimizer, donate=donate),
            fullgraph=True,
            options=compile_options,
        )
        for donate, compile_options in ((False, options), (True, donating_options))
    )
    pure = donated = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(2.0**10))
    donated = pytree.tree_map(torch.clone, donated)
    for x, y in mlp_batches(6, overflow_every=3):
        buffers = [t.data_ptr() for t in pytree.tree_leaves((donated.params, donated.opt_state))]
        pure, _ = pure_step(pure, x, y)
        donated, _ = donating_step(donated, x, y)
        assert [t.data_ptr() for t in pytree.tree_leaves((donated.params, donated.opt_state))] == buffers
        assert_trees_bitwise_equal(donated, pure)


def _state_buffers(state: fmp.TrainState) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((state.params, state.opt_state)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize(
    ("optimizer", "param_dtype"),
    [
        (fmp.optim.sgd(0.1, momentum=0.9), torch.float32),
        (ADAMW, torch.float32),
        (fmp.optim.stochastic_rounding(ADAMW, state_dtype=torch.bfloat16), torch.bfloat16),
    ],
    ids=["sgd-momentum", "adamw", "adamw-bfloat16-params"],
)
def test_eager_donation_writes_the_pure_steps_values_into_the_donated_buffers(
    optimizer: fmp.optim.Optimizer, param_dtype: torch.dtype, compute: torch.dtype
) -> None:
    policy = fmp.Policy(param_dtype, compute, torch.float32)
    params = pytree.tree_map(lambda p: p.to(param_dtype), mlp_params())
    pure = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(2.0**10))
    donated = pytree.tree_map(torch.clone, pure)
    for x, y in mlp_batches(6, overflow_every=3):
        buffers, before = _state_buffers(donated), snapshot(pure)
        new_pure, pure_info = fmp.train_step(mlp_loss, pure, x, y, policy=policy, optimizer=optimizer)
        assert_unmutated(pure, before)  # the default stays pure
        donated, info = fmp.train_step(mlp_loss, donated, x, y, policy=policy, optimizer=optimizer, donate=True)
        assert all(new is old for new, old in zip(_state_buffers(donated), buffers, strict=True))
        assert_trees_bitwise_equal((donated, info), (new_pure, pure_info))
        pure = new_pure
    assert int(donated.counts.skipped) == 2


class PreviousParams(NamedTuple):
    previous: dict[str, torch.Tensor]


def keeps_previous_params(lr: float) -> fmp.optim.Optimizer:
    """SGD whose state holds the params it was handed, the tensors themselves (as a pure optimizer may)."""

    def init(params: dict[str, torch.Tensor]) -> PreviousParams:
        return PreviousParams({k: v.clone() for k, v in params.items()})

    def update(grads: Any, state: PreviousParams, params: Any) -> tuple[Any, PreviousParams]:
        return {k: p - lr * grads[k] for k, p in params.items()}, PreviousParams(dict(params))

    return fmp.optim.Optimizer(init, update)


@hypothesis.given(
    layout=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=0, max_size=3),
    permuted=st.booleans(),
)
def test_a_tensor_is_writable_in_place_only_where_no_two_elements_share_memory(
    layout: list[tuple[int, int]], permuted: bool
) -> None:
    sizes, strides = [size for size, _ in layout], [stride for _, stride in layout]
    view = torch.zeros(200).as_strided(sizes, strides)
    offsets = [
        sum(index * stride for index, stride in zip(position, strides, strict=True))
        for position in itertools.product(*(range(size) for size in sizes))
    ]
    if writable(view):
        assert len(set(offsets)) == len(offsets)
    dense = torch.zeros(sizes).permute(list(reversed(range(len(sizes))))) if permuted else torch.zeros(sizes)
    assert writable(dense)  # contiguous and transposed layouts always are


def expanded_bias_state(optimizer: fmp.optim.Optimizer) -> fmp.TrainState:
    params = mlp_params()
    params["b1"] = torch.zeros(1).expand(8)  # stride 0: no memory to write eight values into
    overlapping = torch.randn(15, generator=torch.Generator().manual_seed(0)).as_strided((8, 8), (1, 1))
    params["w1"] = overlapping  # rows that overlap: the last write into them would win
    return fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(2.0**10))


def test_eager_donation_reads_donated_tensors_handed_back_and_replaces_expanded_ones() -> None:
    optimizer = keeps_previous_params(0.1)
    pure, donated = expanded_bias_state(optimizer), expanded_bias_state(optimizer)
    for x, y in mlp_batches(4, overflow_every=2):
        buffers = {k: t for k, t in donated.params.items() if k not in ("b1", "w1")}
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=optimizer)
        donated, _ = fmp.train_step(mlp_loss, donated, x, y, policy=F32, optimizer=optimizer, donate=True)
        assert_trees_bitwise_equal(donated, pure)
        assert all(donated.params[k] is t for k, t in buffers.items())


@pytest.mark.compiled
def test_compiled_donation_replaces_expanded_tensors() -> None:
    optimizer = keeps_previous_params(0.1)
    pure, compiled = expanded_bias_state(optimizer), expanded_bias_state(optimizer)
    # Functionalized as Inductor's input is (aot_eager), without generating code.
    step = torch.compile(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer, donate=True),
        backend="aot_eager",
        fullgraph=True,
    )
    for x, y in mlp_batches(4, overflow_every=2):
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=optimizer)
        compiled, _ = step(compiled, x, y)
        assert_trees_bitwise_equal(compiled, pure)


def test_eager_donation_under_transforms_or_autograd_writes_nothing() -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    step = functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer)
    members = [fmp.TrainState.create(mlp_params(seed=s), optimizer, fmp.DynamicLossScale.create()) for s in (0, 1)]
    stacked, (x, y) = fmp.stack_trees(members), next(mlp_batches(1, 0))
    xs, ys, before = torch.stack([x, x]), torch.stack([y, y]), snapshot(stacked)
    # vmap needs its inputs intact: the donated ensemble step leaves them so and equals the pure one.
    donated = torch.func.vmap(functools.partial(step, donate=True))(stacked, xs, ys)
    assert_unmutated(stacked, before)
    assert_trees_bitwise_equal(donated, torch.func.vmap(step)(stacked, xs, ys))
    # Autograd records the update (a meta-gradient through the step): written in place, it would be cut.
    state, tracked = members[0], x.clone().requires_grad_()
    before = snapshot(state)
    new_state, _ = step(state, tracked, y, donate=True)
    assert_unmutated(state, before)
    mlp_loss(new_state.params, x, y).backward()
    assert tracked.grad is not None and bool(tracked.grad.abs().sum() > 0)


def test_a_donated_state_whose_dicts_list_keys_in_another_order_is_written_key_by_key() -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    pure = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    momentum = {key: pure.opt_state.momentum[key].clone() for key in reversed(list(pure.opt_state.momentum))}
    donated = pytree.tree_map(torch.clone, pure)._replace(opt_state=pure.opt_state._replace(momentum=momentum))
    buffers = {key: t.data_ptr() for key, t in momentum.items()}
    # The copies into the donated buffers happen while Dynamo traces: no code generation needed.
    step = torch.compile(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer, donate=True),
        backend="eager",
        fullgraph=True,
    )
    for x, y in mlp_batches(3, 0):
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=optimizer)
        donated, _ = step(donated, x, y)
        assert list(donated.opt_state.momentum) == list(momentum)  # its own order, kept
        assert {key: t.data_ptr() for key, t in donated.opt_state.momentum.items()} == buffers
        by_key = [
            {key: tree[key] for key in sorted(tree)} for tree in (donated.opt_state.momentum, pure.opt_state.momentum)
        ]
        assert_trees_bitwise_equal(*by_key)
        assert_trees_bitwise_equal(donated.params, pure.params)


def test_donating_a_tensor_listed_twice_is_refused() -> None:
    params = mlp_params()
    params["w1_tied"] = params["w1"]
    optimizer = fmp.optim.sgd(0.1)

    def tied_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mlp_loss(params, x, y) + params["w1_tied"].sum()

    step = torch.compile(
        functools.partial(fmp.train_step, tied_loss, policy=BF16, optimizer=optimizer, donate=True),
        backend="eager",  # the check runs while tracing; no code generation needed
        fullgraph=True,
    )
    state, (x, y) = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create()), next(mlp_batches(1, 0))
    message = r"state\.params\['w1'\] and state\.params\['w1_tied'\] are one tensor"
    with pytest.raises(ValueError, match=message):
        fmp.train_step(tied_loss, state, x, y, policy=BF16, optimizer=optimizer, donate=True)
    with pytest.raises(RuntimeError, match=message):  # Dynamo wraps the ValueError raised while tracing
        step(state, x, y)
    with pytest.raises(TypeError, match="donate must be a bool"):
        fmp.train_step(tied_loss, state, x, y, policy=BF16, optimizer=optimizer, donate="yes")  # type: ignore[arg-type]


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
