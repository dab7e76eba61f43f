from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import POLICIES
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_unmutated
from conftest import bits
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from conftest import snapshot
from hypothesis import given
from hypothesis import strategies as st

import fmp

OPTIMIZERS = {
    "sgd": fmp.optim.sgd(0.1),
    "sgd_momentum": fmp.optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw": fmp.optim.adamw(1e-2, eps=1e-7),  # eps nonzero in float16 too
}


def batch(seed: int = 1, n: int = 16, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=gen), torch.randn(n, 1, generator=gen)


@pytest.mark.parametrize("policy_spec", POLICIES)
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_step_applies_an_update_and_keeps_inputs(policy_spec: str, optimizer_name: str) -> None:
    policy, optimizer = fmp.get_policy(policy_spec), OPTIMIZERS[optimizer_name]
    # A float16 loss cannot carry a gradient seed above 65504, so start below torch's 2**16.
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=1)
    state = fmp.TrainState.create(mlp_params(), optimizer, scaler)
    x, y = batch()
    before = snapshot((state, x, y))
    new_state, info = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=optimizer)
    assert_unmutated((state, x, y), before)
    assert bool(info.grads_finite) and info.loss.dtype == policy.output_dtype and info.loss.dim() == 0
    assert float(info.loss_scale) == 2.0**10 and float(new_state.scaler.loss_scale) == 2.0**11
    for name, param in new_state.params.items():
        assert param.dtype == policy.param_dtype
        assert not torch.equal(param, state.params[name])
    expected = mlp_loss(policy.cast_to_compute(state.params), *policy.cast_to_compute((x, y))).float()
    torch.testing.assert_close(info.loss.float(), expected, **TOLERANCES[policy.compute_dtype])


@given(
    st.sampled_from(list(OPTIMIZERS)),
    st.sampled_from(POLICIES),
    st.sampled_from([float("inf"), float("-inf"), float("nan")]),
    st.integers(0, 16 * 8 - 1),
    st.integers(0, 3),
)
def test_non_finite_gradients_never_change_params_or_optimizer_state(
    optimizer_name: str, policy_spec: str, bad: float, position: int, warmup: int
) -> None:
    policy, optimizer = fmp.get_policy(policy_spec), OPTIMIZERS[optimizer_name]
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(init_scale=2.0**10))
    x, y = batch()
    for _ in range(warmup):  # non-trivial optimizer state first
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=optimizer)
    x_bad = x.clone()
    x_bad.view(-1)[position] = bad
    new_state, info = fmp.train_step(mlp_loss, state, x_bad, y, policy=policy, optimizer=optimizer)
    assert not bool(info.grads_finite)
    assert_trees_bitwise_equal((new_state.params, new_state.opt_state), (state.params, state.opt_state))
    assert float(new_state.scaler.loss_scale) == float(state.scaler.loss_scale) / 2


def test_overflow_in_the_scaled_loss_alone_is_caught() -> None:
    # Finite data, but the scale pushes float16 gradients past 65504: the step must skip and back off.
    policy = fmp.get_policy("params=float32,compute=float16,output=float32")
    state = fmp.TrainState.create(mlp_params(), fmp.optim.sgd(0.1), fmp.DynamicLossScale.create(init_scale=2.0**40))
    new_state, info = fmp.train_step(mlp_loss, state, *batch(), policy=policy, optimizer=fmp.optim.sgd(0.1))
    assert not bool(info.grads_finite)
    assert_trees_bitwise_equal(new_state.params, state.params)
    assert float(new_state.scaler.loss_scale) == 2.0**39


def test_a_gradient_that_overflows_only_when_unscaled_is_caught() -> None:
    # With a scale below 1 the scaled gradient (3.75e37) is finite and the unscaled one (6e38) is
    # not: the check must read the unscaled gradients, or the step would write inf into the params.
    params = {"w": torch.tensor([1e-3])}
    sgd = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(params, sgd, fmp.DynamicLossScale.create(init_scale=2.0**-4, min_scale=2.0**-10))
    new_state, info = fmp.train_step(lambda p: (p["w"] * 3e38).sum() * 2.0, state, policy=fmp.Policy(), optimizer=sgd)
    assert bool(torch.isfinite(info.loss)) and not bool(info.grads_finite)
    assert_trees_bitwise_equal(new_state.params, params)
    assert float(new_state.scaler.loss_scale) == 2.0**-5


SCALERS = {
    "noop": fmp.NoOpLossScale(),
    "static": fmp.StaticLossScale.create(2.0**8),
    "dynamic": fmp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=1),
}


@given(
    st.sampled_from(list(OPTIMIZERS)),
    st.sampled_from(POLICIES),
    st.sampled_from(list(SCALERS)),
    st.booleans(),
    st.booleans(),
)
def test_steps_never_mutate_their_inputs(
    optimizer_name: str, policy_spec: str, scaler_name: str, overflow: bool, warm: bool
) -> None:
    policy, optimizer = fmp.get_policy(policy_spec), OPTIMIZERS[optimizer_name]
    state = fmp.TrainState.create(mlp_params(), optimizer, SCALERS[scaler_name])
    x, y = batch()
    if warm:
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=optimizer)
    if overflow:
        x[3, 3] = float("inf")
    before = snapshot((state, x, y))
    _, info = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=optimizer)
    assert_unmutated((state, x, y), before)
    assert bool(info.grads_finite) is not overflow
    scaler_and_x = snapshot((state.scaler, x))
    state.scaler.adjust(info.grads_finite)
    state.scaler.unscale(state.scaler.scale(x))
    assert_unmutated((state.scaler, x), scaler_and_x)


@given(st.integers(-12, 40))
def test_power_of_two_scaling_gives_bitwise_the_unscaled_gradients(exponent: int) -> None:
    policy = fmp.Policy()
    params, (x, y) = mlp_params(), batch()
    scaled = fmp.mixed_precision_grad(mlp_loss, params, fmp.StaticLossScale.create(2.0**exponent), x, y, policy=policy)
    plain = fmp.mixed_precision_grad(mlp_loss, params, fmp.NoOpLossScale(), x, y, policy=policy)
    assert_trees_bitwise_equal(scaled.grads, plain.grads)
    assert_trees_bitwise_equal(scaled.loss, plain.loss)
    reference = torch.func.grad(mlp_loss)(params, x, y)
    assert_trees_bitwise_equal(plain.grads, reference)


def test_grads_come_back_in_the_param_dtype_and_args_are_cast() -> None:
    seen: dict[str, torch.dtype] = {}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.update(w=params["w1"].dtype, x=x.dtype, labels=labels.dtype)
        return mlp_loss(params, x, torch.ones(x.shape[0], 1, dtype=x.dtype))

    policy = fmp.get_policy("p=f32,c=bf16,o=f32,rules=none")  # the whole cast; rules: tests/test_policy_rules.py
    labels = torch.arange(16)
    out = fmp.mixed_precision_grad(loss_fn, mlp_params(), fmp.NoOpLossScale(), batch()[0], labels, policy=policy)
    assert seen == {"w": torch.bfloat16, "x": torch.bfloat16, "labels": torch.int64}
    assert all(g.dtype == torch.float32 for g in out.grads.values())
    assert out.loss.dtype == torch.float32


def test_has_aux_returns_the_auxiliary_output() -> None:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        loss = mlp_loss(params, x, y)
        return loss, {"double": loss * 2}

    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    policy = fmp.Policy()
    _, info = fmp.train_step(loss_fn, state, *batch(), policy=policy, optimizer=optimizer, has_aux=True)
    torch.testing.assert_close(info.aux["double"], info.loss * 2)
    _, plain = fmp.train_step(mlp_loss, state, *batch(), policy=policy, optimizer=optimizer)
    assert plain.aux == ()


@pytest.mark.parametrize(
    ("loss_fn", "has_aux", "error", "message"),
    [
        (lambda p, x, y: (x @ p["w1"]).sum(dim=1), False, ValueError, r"scalar \(0-dim\) loss, got shape \(16,\)"),
        (lambda p, x, y: 1.0, False, TypeError, "must return a scalar tensor, got float"),
        (lambda p, x, y: torch.tensor(3), False, TypeError, "floating-point loss, got torch.int64"),
        (lambda p, x, y: mlp_loss(p, x, y), True, TypeError, "must return \\(loss, aux\\)"),
        (lambda p, x, y: (mlp_loss(p, x, y), 1, 2), True, TypeError, "must return \\(loss, aux\\)"),
        (lambda p, x, y: (mlp_loss(p, x, y), {}), False, TypeError, "got a tuple of 2: with has_aux=True it returns"),
    ],
)
def test_bad_loss_functions_get_clear_errors(loss_fn: Any, has_aux: bool, error: type, message: str) -> None:
    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    with pytest.raises(error, match=message):
        fmp.train_step(loss_fn, state, *batch(), policy=fmp.Policy(), optimizer=optimizer, has_aux=has_aux)


def test_mixed_precision_step_short_form() -> None:
    params, scaler, (x, y) = mlp_params(), fmp.DynamicLossScale.create(), batch()
    policy, optimizer = fmp.get_policy("p=f32,c=bf16,o=f32"), fmp.optim.sgd(0.01)
    new_params, new_scaler = fmp.mixed_precision_step(
        mlp_loss, params, scaler, x, y, policy=policy, optimizer=optimizer
    )
    state, _ = fmp.train_step(
        mlp_loss, fmp.TrainState.create(params, optimizer, scaler), x, y, policy=policy, optimizer=optimizer
    )
    assert_trees_bitwise_equal((new_params, new_scaler), (state.params, state.scaler))
    with pytest.raises(ValueError, match=r"takes a stateless optimizer.*use fmp\.train_step"):
        fmp.mixed_precision_step(mlp_loss, params, scaler, x, y, policy=policy, optimizer=fmp.optim.adamw())


def test_a_training_run_converges_under_every_policy() -> None:
    x, y = batch(n=64)
    finals = {}
    for spec in POLICIES:
        policy, optimizer = fmp.get_policy(spec), fmp.optim.adamw(3e-2, weight_decay=0.0)
        state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(growth_interval=10))
        for _ in range(60):
            state, info = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=optimizer)
        finals[policy.compute_dtype] = float(mlp_loss(state.params, x, y))
        assert float(info.loss) < 0.75 * float(mlp_loss(mlp_params(), x, y))
    for dtype in (torch.bfloat16, torch.float16):
        assert finals[dtype] == pytest.approx(finals[torch.float32], rel=0.1)


def test_wrong_argument_types_are_named() -> None:
    optimizer, scaler, policy = fmp.optim.sgd(0.1), fmp.DynamicLossScale.create(), fmp.Policy()
    state = fmp.TrainState.create(mlp_params(), optimizer, scaler)
    x, y = batch()
    with pytest.raises(TypeError, match=r"state must be an fmp\.TrainState"):
        fmp.train_step(mlp_loss, (state.params, (), scaler), x, y, policy=policy, optimizer=optimizer)
    with pytest.raises(TypeError, match=r"optimizer must be an fmp\.optim\.Optimizer"):
        fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=torch.optim.SGD)
    with pytest.raises(TypeError, match=r"optimizer must be an fmp\.optim\.Optimizer"):
        fmp.mixed_precision_step(mlp_loss, state.params, scaler, x, y, policy=policy, optimizer="sgd")
    with pytest.raises(TypeError, match="scaler must be an fmp loss-scale state"):
        fmp.mixed_precision_grad(mlp_loss, state.params, torch.amp.GradScaler("cpu"), x, y, policy=policy)
    with pytest.raises(TypeError, match=r"policy must be an fmp\.Policy"):
        fmp.mixed_precision_grad(mlp_loss, state.params, scaler, x, y, policy="c=bf16")
    with pytest.raises(TypeError, match="loss_fn must be a function, got int"):
        fmp.train_step(3, state, x, y, policy=policy, optimizer=optimizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="with_policy's fn must be a function, got int"):
        fmp.with_policy(3, policy)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state.counts must be an fmp\.StepCounts \(TrainState.create makes one\)"):
        fmp.train_step(mlp_loss, state._replace(counts=(0, 0, 0, 0)), x, y, policy=policy, optimizer=optimizer)
    floats = fmp.StepCounts(*(torch.zeros(()) for _ in fmp.StepCounts._fields))
    with pytest.raises(TypeError, match=r"state.counts.applied must be a 0-dim int64 tensor, got torch.float32\[\]"):
        fmp.train_step(mlp_loss, state._replace(counts=floats), x, y, policy=policy, optimizer=optimizer)


def test_a_stacked_scaler_outside_vmap_is_refused_where_it_would_broadcast() -> None:
    # Two members' scales against a weight whose last dimension is 2: the scaled loss would have
    # two elements, the backward seeded with ones would sum them, and unscaling would broadcast.
    stacked = fmp.stack_trees([fmp.DynamicLossScale.create(init_scale=s) for s in (2.0**10, 2.0**12)])
    params, x = {"w": torch.ones(2, 2)}, torch.ones(2)
    message = r"DynamicLossScale.loss_scale has shape \(2,\), but a loss-scale state holds 0-dim tensors: run a stacked"
    with pytest.raises(ValueError, match=message):
        fmp.mixed_precision_grad(lambda p, x: (p["w"] @ x).sum(), params, stacked, x, policy=fmp.Policy())
    with pytest.raises(ValueError, match=message):
        fmp.unscale_and_adjust(stacked, [torch.ones(2, 2)])
    with pytest.raises(ValueError, match=message):
        fmp.TrainState.create(params, fmp.optim.sgd(0.1), stacked)
    with pytest.raises(ValueError, match=r"scaler\[1\]: " + message):  # one of several losses' scalers
        fmp.mixed_precision_grad(
            lambda p, x: ((p["w"] @ x).sum(), p["w"].sum()),
            params,
            (fmp.NoOpLossScale(), stacked),
            x,
            policy=fmp.Policy(),
        )
    # A whole stacked state, its scaler holding no tensor: the counts say it.
    states = fmp.stack_trees([fmp.TrainState.create(params, fmp.optim.sgd(0.1), fmp.NoOpLossScale())] * 2)
    with pytest.raises(
        ValueError, match=r"state.counts.applied has shape \(2,\), but a step's counts are 0-dim: run a"
    ):
        fmp.train_step(lambda p, x: (p["w"] @ x).sum(), states, x, policy=fmp.Policy(), optimizer=fmp.optim.sgd(0.1))


@pytest.mark.parametrize("policy_spec", ["p=bf16,c=bf16,o=f32", "p=f16,c=f16,o=f32", "p=f64,c=f32,o=f64"])
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_params_stored_in_other_dtypes(policy_spec: str, optimizer_name: str) -> None:
    policy, optimizer = fmp.get_policy(policy_spec), OPTIMIZERS[optimizer_name]
    params = policy.cast_to_param(mlp_params())
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(init_scale=2.0**8))
    x, y = batch()
    new_state, info = fmp.train_step(mlp_loss, state, x, y, policy=policy, optimizer=optimizer)
    assert bool(info.grads_finite) and info.loss.dtype == policy.output_dtype
    assert all(
        p.dtype == policy.param_dtype
        for p in pytree.tree_leaves((new_state.params, new_state.opt_state))
        if p.is_floating_point()
    )
    x[0, 0] = float("nan")
    skipped, info = fmp.train_step(mlp_loss, new_state, x, y, policy=policy, optimizer=optimizer)
    assert not bool(info.grads_finite)
    assert_trees_bitwise_equal((skipped.params, skipped.opt_state), (new_state.params, new_state.opt_state))


def test_params_that_the_step_cannot_differentiate_are_named() -> None:
    scaler, policy, (x, y) = fmp.DynamicLossScale.create(), fmp.Policy(), batch()
    params = mlp_params()
    with pytest.raises(
        TypeError, match=r"params\['w1'\] is torch.bfloat16 but the policy stores params in torch.float32"
    ):
        fmp.mixed_precision_grad(mlp_loss, {**params, "w1": params["w1"].bfloat16()}, scaler, x, y, policy=policy)
    with pytest.raises(TypeError, match=r"params\['steps'\] is torch.int64; .* pass integer buffers"):
        fmp.mixed_precision_grad(mlp_loss, {**params, "steps": torch.tensor(3)}, scaler, x, y, policy=policy)
    with pytest.raises(TypeError, match=r"params\['lr'\] is a float; every leaf of params must be a tensor"):
        fmp.mixed_precision_grad(mlp_loss, {**params, "lr": 0.1}, scaler, x, y, policy=policy)
    module_params = dict(torch.nn.Linear(8, 8).named_parameters())
    with pytest.raises(TypeError, match=r"params\['weight'\] is an nn.Parameter: .* v.detach\(\)"):
        fmp.TrainState.create(module_params, fmp.optim.sgd(0.1), scaler)
    with pytest.raises(TypeError, match=r"params\['w1'\] is an nn.Parameter"):
        fmp.mixed_precision_grad(
            mlp_loss, {**params, "w1": torch.nn.Parameter(params["w1"])}, scaler, x, y, policy=policy
        )
    stacked, _ = torch.func.stack_module_state([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
    with pytest.raises(TypeError, match=r"params\['weight'\] requires grad \(torch.func.stack_module_state"):
        fmp.TrainState.create(stacked, fmp.optim.sgd(0.1), scaler)


def test_non_tensor_aux_is_named() -> None:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return mlp_loss(params, x, y), {"tag": "epoch-1"}

    with pytest.raises(TypeError, match=r"aux\['tag'\] is a str; aux must be a pytree of tensors"):
        fmp.mixed_precision_grad(
            loss_fn, mlp_params(), fmp.NoOpLossScale(), *batch(), policy=fmp.Policy(), has_aux=True
        )


def test_train_state_create_checks_types_and_moves_the_scaler_to_the_params() -> None:
    with pytest.raises(TypeError, match=r"optimizer must be an fmp\.optim\.Optimizer"):
        fmp.TrainState.create(mlp_params(), torch.optim.SGD, fmp.DynamicLossScale.create())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler must be an fmp loss-scale state"):
        fmp.TrainState.create(mlp_params(), fmp.optim.sgd(0.1), torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    params = {"w": torch.ones(3, device="meta")}
    state = fmp.TrainState.create(params, fmp.optim.adamw(), fmp.DynamicLossScale.create(hysteresis=2))
    assert {t.device.type for t in pytree.tree_leaves(state)} == {"meta"}
    assert state.scaler.hysteresis == 2


def test_a_scaler_or_counts_on_another_device_than_the_params_are_named() -> None:
    # Left there, they would drift to the params' device on the first update (and recompile).
    params, x = {"w": torch.ones(3, device="meta")}, torch.ones(3, device="meta")
    sgd, policy = fmp.optim.sgd(0.1), fmp.Policy()

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (params["w"] * x).sum()

    with pytest.raises(ValueError, match=r"scaler\.loss_scale is on cpu but the params are on meta"):
        fmp.mixed_precision_step(loss_fn, params, fmp.DynamicLossScale.create(), x, policy=policy, optimizer=sgd)
    scalers = (fmp.NoOpLossScale.create(), fmp.StaticLossScale.create(4.0))
    with pytest.raises(ValueError, match=r"scaler\[1\]\.loss_scale is on cpu but the params are on meta"):
        fmp.mixed_precision_grad(loss_fn, params, scalers, x, policy=policy)
    state = fmp.TrainState.create(params, sgd, fmp.DynamicLossScale.create())._replace(counts=fmp.StepCounts.zeros())
    with pytest.raises(ValueError, match=r"state\.counts\.applied is on cpu but the params are on meta"):
        fmp.train_step(loss_fn, state, x, policy=policy, optimizer=sgd)
    # Params on the CPU and on an accelerator (meta stands for one): the state goes where the flag does.
    mixed = {"bias": torch.ones(3), "w": torch.ones(3, device="meta")}
    state = fmp.TrainState.create(mixed, fmp.optim.adam(), fmp.DynamicLossScale.create(), accumulation_steps=2)
    assert state.opt_state.step.device.type == "meta"
    assert {t.device.type for t in pytree.tree_leaves((state.scaler, state.counts))} == {"meta"}
    assert {state.accumulator.micro_steps.device.type, state.accumulator.grads_finite.device.type} == {"meta"}


@given(st.integers(-8, 20))
def test_complex_parameters_are_unscaled_and_checked(exponent: int) -> None:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (params["z"] * x).abs().square().mean()

    params = {"z": torch.complex(torch.randn(4), torch.randn(4))}
    x = torch.randn(4)
    scaled = fmp.mixed_precision_grad(
        loss_fn, params, fmp.StaticLossScale.create(2.0**exponent), x, policy=fmp.Policy()
    )
    plain = fmp.mixed_precision_grad(loss_fn, params, fmp.NoOpLossScale(), x, policy=fmp.Policy())
    assert_trees_bitwise_equal(scaled.grads, plain.grads)
    x[1] = float("inf")
    assert not bool(fmp.mixed_precision_grad(loss_fn, params, fmp.NoOpLossScale(), x, policy=fmp.Policy()).grads_finite)


def test_reduce_grads_sees_each_calls_gradients_and_its_flags_decide() -> None:
    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(init_scale=8.0))
    x, y = next(mlp_batches(1, 0))
    seen = []

    def veto(gradients: fmp.Gradients) -> fmp.Gradients:
        seen.append(gradients)
        no = torch.zeros((), dtype=torch.bool)
        return gradients._replace(grads_finite=no, finite_per_loss=no)

    new, info = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer, reduce_grads=veto)
    assert len(seen) == 1 and bool(seen[0].grads_finite)
    assert not bool(info.applied) and float(new.scaler.loss_scale) == 4.0
    assert_trees_bitwise_equal(new.params, state.params)
    with pytest.raises(TypeError, match=r"reduce_grads must return fmp\.Gradients, got tuple"):
        fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer, reduce_grads=lambda g: tuple(g))


@pytest.mark.parametrize("policy_spec", ["float32", "params=float32,compute=bfloat16,output=float32,rules=cpu"])
def test_batchnorm_statistics_passed_as_args_update_in_place_as_under_torch_autocast(policy_spec: str) -> None:
    policy, optimizer = fmp.get_policy(policy_spec), fmp.optim.sgd(0.1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}

    def loss_fn(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, {**params, **buffers}, (x,))
        return torch.nn.functional.mse_loss(out, y)

    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for seed in range(3):
        x, y = batch(seed)
        state, info = fmp.train_step(loss_fn, state, buffers, x, y, policy=policy, optimizer=optimizer)
        assert bool(info.applied)
        with torch.autocast("cpu", policy.compute_dtype, enabled=policy.compute_dtype != torch.float32):
            loss = torch.nn.functional.mse_loss(reference(x), y)
        reference_optimizer.zero_grad()
        loss.backward()
        reference_optimizer.step()
    assert int(buffers["1.num_batches_tracked"]) == 3
    assert_trees_bitwise_equal(buffers, dict(reference.named_buffers()))
    assert_trees_bitwise_equal(state.params, {name: p.detach() for name, p in reference.named_parameters()})


def test_a_loss_that_reads_a_modules_own_parameters_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    optimizer = fmp.optim.sgd(0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())
    x, y = batch()
    step = functools.partial(fmp.train_step, policy=fmp.Policy(), optimizer=optimizer)

    def forgets_params(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x), y)  # trains nothing: the module's own weights are read

    def uses_params(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    message = r"reads 4 nn.Parameter\(s\) \(shapes \[1, 4\], \[1\], \[4, 8\], \[4\]\) outside params: .* not model\(x\)"
    with pytest.raises(ValueError, match=message):
        step(forgets_params, state, x, y)
    with pytest.raises(ValueError, match=message):  # in an ensemble too
        ensemble = functools.partial(step, forgets_params)
        torch.func.vmap(ensemble)(fmp.stack_trees([state, state]), torch.stack([x, x]), torch.stack([y, y]))
    two = fmp.TrainState.create(params, optimizer, (fmp.NoOpLossScale(), fmp.NoOpLossScale()))
    with pytest.raises(ValueError, match=message):  # and with several losses
        step(lambda p, x, y: (forgets_params(p, x, y), uses_params(p, x, y)), two, x, y)
    head = {k: v for k, v in params.items() if k.startswith("1.")}  # the first layer frozen, yet requiring grad
    with pytest.raises(ValueError, match=r"reads 2 nn.Parameter\(s\) .* requires_grad_\(False\) on frozen weights"):
        step(uses_params, fmp.TrainState.create(head, optimizer, fmp.NoOpLossScale()), x, y)
    # Other tracked inputs pass: a meta-gradient with plain autograd through the step.
    x.requires_grad_()
    new_state, info = step(uses_params, state, x, y)
    assert bool(info.applied) and info.loss.requires_grad
    uses_params(new_state.params, x, y).backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    # A second step on those params would chain the graphs: refused, pointing at torch.func.grad.
    with pytest.raises(TypeError, match=r"requires grad, as a step's output does while plain autograd records"):
        step(uses_params, new_state, x, y)


def test_a_compiled_step_whose_loss_reads_a_modules_own_parameters_warns_as_it_compiles() -> None:
    # Compiled, autograd's graph cannot be walked while tracing: the loss still requiring grad outside
    # the differentiation, with no argument that does, is what shows it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    optimizer = fmp.optim.sgd(0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())
    x, y = torch.randn(5, 8), torch.randn(5, 1)

    def reads_both(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        held = torch.nn.functional.mse_loss(model(x), y)  # the module's own weights: no update
        return held + torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    def uses_params(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    step = functools.partial(fmp.train_step, policy=fmp.Policy(), optimizer=optimizer)
    compiled = fmp.compile(functools.partial(step, reads_both), backend="eager")
    with pytest.warns(UserWarning, match=r"reaches tensors outside params that require grad.* model\(x\)"):
        _, info = compiled(state, x, y)
    assert info.loss.requires_grad  # what the warning saw while tracing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(state, x, y)  # once, as the step compiles
        _, info = fmp.compile(functools.partial(step, uses_params), backend="eager")(state, x, y)
        # An argument that requires grad is a meta-gradient the caller asked for: no warning.
        fmp.compile(functools.partial(step, reads_both), backend="eager")(state, x.requires_grad_(), y)
    assert not info.loss.requires_grad


@pytest.mark.parametrize("derived", [False, True], ids=["parameter", "computed-from-one"])
def test_a_meta_gradient_through_an_nn_parameter_passed_in_args_passes(derived: bool) -> None:
    # A learned hyperparameter is an nn.Parameter handed to torch.optim: passed in args (as it is, or
    # computed from), the loss reads it, and the module-parameter check must let it through.
    log_decay = torch.nn.Parameter(torch.tensor(0.0))
    params, (x, y) = mlp_params(), batch()

    def regularized(p: Any, x: torch.Tensor, y: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
        return mlp_loss(p, x, y) + log_decay.exp() * p["w1"].square().sum()

    def meta_gradient(log_decay: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
        new_params, _ = fmp.mixed_precision_step(
            regularized, params, fmp.NoOpLossScale(), x, y, hyper, policy=fmp.Policy(), optimizer=fmp.optim.sgd(0.1)
        )
        (grad,) = torch.autograd.grad(mlp_loss(new_params, x, y), log_decay)
        return grad

    plain = torch.tensor(0.0, requires_grad=True)
    expected = meta_gradient(plain, plain)
    ours = meta_gradient(log_decay, log_decay * 1.0 if derived else log_decay)
    assert torch.equal(ours, expected) and bool(ours != 0)


def test_a_loss_that_does_not_depend_on_params_warns() -> None:
    # torch.func.grad returns zeros, and weight decay and momentum still move the params: most often a
    # mistake, but a loss may be constant on purpose (an empty batch), so it warns.
    frozen = torch.nn.Linear(8, 1).requires_grad_(False)
    params = {k: v.detach().clone() for k, v in frozen.named_parameters()}
    x, y = batch()

    def uses(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(frozen, p, (x,)), y)

    def under_no_grad(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return uses(p, x, y)

    losses = {
        "frozen model(x)": lambda p, x, y: torch.nn.functional.mse_loss(frozen(x), y),
        "detached": lambda p, x, y: uses(p, x, y).detach(),
        "no_grad": under_no_grad,
        "from .item()": lambda p, x, y: torch.tensor(uses(p, x, y).item()),
    }
    scaler = fmp.DynamicLossScale.create()
    for loss_fn in losses.values():
        with pytest.warns(UserWarning, match=r"loss_fn's loss does not depend on params, so its gradients are all"):
            fmp.mixed_precision_grad(loss_fn, params, scaler, x, y, policy=fmp.Policy())
    with pytest.warns(UserWarning, match=r"loss_fn's loss 1 does not depend on params"):
        fmp.mixed_precision_grad(
            lambda p, x, y: (uses(p, x, y), losses["detached"](p, x, y)),
            params,
            (scaler, scaler),
            x,
            y,
            policy=fmp.Policy(),
        )
    assert bool(fmp.mixed_precision_grad(uses, params, scaler, x, y, policy=fmp.Policy()).grads_finite)


@pytest.mark.compiled
def test_a_compiled_step_whose_loss_does_not_depend_on_params_warns_while_it_compiles() -> None:
    frozen = torch.nn.Linear(8, 1).requires_grad_(False)
    params = {k: v.detach().clone() for k, v in frozen.named_parameters()}
    optimizer = fmp.optim.sgd(0.1)

    def frozen_model(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(frozen(x), y)  # p unused: the model called as model(x)

    step = torch.compile(
        functools.partial(fmp.train_step, frozen_model, policy=fmp.Policy(), optimizer=optimizer),
        backend="eager",  # the warning comes while Dynamo traces; no code generation needed
        fullgraph=True,
    )
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    with pytest.warns(UserWarning, match=r"loss_fn's loss does not depend on params, so its gradients are all"):
        state, _ = step(state, *batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(state, *batch())  # compiled once: no warning per step


def test_a_loss_scale_built_without_create_and_non_bool_flags_are_named() -> None:
    params, optimizer = mlp_params(), fmp.optim.sgd(0.1)
    with pytest.raises(
        TypeError, match=r"StaticLossScale holds a float where a tensor belongs; build it with StaticLossScale\.create"
    ):
        fmp.TrainState.create(params, optimizer, fmp.StaticLossScale(1024.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="has_aux must be a bool, got str"):
        fmp.mixed_precision_grad(mlp_loss, params, fmp.NoOpLossScale(), *batch(), policy=fmp.Policy(), has_aux="False")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nesterov must be a bool, got str"):
        fmp.optim.sgd(0.1, 0.9, nesterov="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"partition's group names must be str \(label returns one\), got 0"):
        fmp.optim.partition({0: optimizer}, lambda name, p: 0)  # type: ignore[dict-item]


@pytest.mark.parametrize("policy", [*POLICIES, "params=float32,compute=bfloat16,output=float32,rules=none"])
def test_with_policy_evaluates_the_loss_the_step_reported(policy: str) -> None:
    mp = fmp.get_policy(policy)
    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.NoOpLossScale())
    x, y = batch()
    _, info = fmp.train_step(mlp_loss, state, x, y, policy=mp, optimizer=optimizer)
    evaluated = fmp.with_policy(mlp_loss, mp)(state.params, x, y)
    assert evaluated.dtype == mp.output_dtype
    assert torch.equal(bits(evaluated), bits(info.loss))
    with pytest.raises(TypeError, match=r"policy must be an fmp\.Policy"):
        fmp.with_policy(mlp_loss, "c=bf16")  # type: ignore[arg-type]


def test_flags_that_reduce_grads_returns_are_checked_by_name() -> None:
    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.NoOpLossScale())
    step = functools.partial(fmp.train_step, mlp_loss, state, *batch(), policy=fmp.Policy(), optimizer=optimizer)
    with pytest.raises(TypeError, match="reduce_grads' grads_finite must be a 0-dim bool tensor, got bool"):
        step(reduce_grads=lambda g: g._replace(grads_finite=True))
    with pytest.raises(ValueError, match=r"reduce_grads' finite_per_loss\[0\] must be a 0-dim bool tensor"):
        step(reduce_grads=lambda g: g._replace(finite_per_loss=g.grads_finite.float()))
    # The flags' structure is the scalers': one flag for one scaler, a tuple of as many for a tuple.
    one_flag = r"finite_per_loss must be one flag \(a 0-dim bool tensor\), as state.scaler is one scaler, got a tuple"
    with pytest.raises(TypeError, match=one_flag):
        step(reduce_grads=lambda g: g._replace(finite_per_loss=(g.grads_finite,)))
    two = fmp.TrainState.create(mlp_params(), optimizer, (fmp.NoOpLossScale(), fmp.NoOpLossScale()))
    with pytest.raises(TypeError, match=r"finite_per_loss must be a tuple of 2 flags, one per scaler of state\.scaler"):
        fmp.train_step(
            lambda p, x, y: (mlp_loss(p, x, y), mlp_loss(p, x, y)),
            two,
            *batch(),
            policy=fmp.Policy(),
            optimizer=optimizer,
            reduce_grads=lambda g: g._replace(finite_per_loss=g.grads_finite),
        )
    with pytest.raises(ValueError, match=r"partition: grads must have the params' structure, but they differ"):
        part = fmp.optim.partition({"all": optimizer}, lambda name, p: "all")
        part.update({"w1": torch.ones(8, 8)}, part.init(mlp_params()), mlp_params())


@pytest.mark.parametrize("policy", ["params=float32,compute=float32,output=float32", "c=bf16,rules=none", "c=bf16"])
def test_a_model_passed_to_loss_fn_as_an_argument_passes_through(policy: str) -> None:
    model = torch.nn.Linear(8, 1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    optimizer = fmp.optim.sgd(0.1)

    def loss_fn(p: Any, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(module, p, (x,)), y)

    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())
    _, info = fmp.train_step(loss_fn, state, model, *batch(), policy=fmp.get_policy(policy), optimizer=optimizer)
    assert bool(info.applied)


def test_a_skipped_pure_step_writes_into_nothing_an_optimizer_hands_back() -> None:
    # An optimizer (a user's, or an optax-style transformation) may return a tensor it keeps.
    kept = torch.zeros(3)
    optimizer = fmp.optim.Optimizer(lambda p: {"c": torch.ones(3)}, lambda g, s, p: (p, {"c": kept}))
    state = fmp.TrainState.create({"a": torch.ones(3)}, optimizer, fmp.DynamicLossScale.create())
    _, info = fmp.train_step(lambda p: p["a"].sum() * float("inf"), state, policy=fmp.Policy(), optimizer=optimizer)
    assert not bool(info.applied) and torch.equal(kept, torch.zeros(3))


@pytest.mark.parametrize("optimizer", [fmp.optim.adam(0.1), fmp.optim.adamw(0.1), fmp.optim.sgd(0.1)])
def test_a_state_without_params_steps(optimizer: fmp.optim.Optimizer) -> None:
    state = fmp.TrainState.create({}, optimizer, fmp.DynamicLossScale.create())
    new, info = fmp.train_step(lambda p, x: x.sum(), state, torch.ones(2), policy=fmp.Policy(), optimizer=optimizer)
    assert bool(info.applied) and new.params == {}


def test_one_noop_scaler_in_a_tuple_takes_expanded_gradients() -> None:
    # autograd hands a sum's gradient back expanded, one element for all: nothing may write into it.
    state = fmp.TrainState.create({"a": torch.ones(4), "b": torch.ones(4)}, fmp.optim.sgd(0.1), (fmp.NoOpLossScale(),))
    new, info = fmp.train_step(
        lambda p: ((p["a"] + p["b"]).sum(),), state, policy=fmp.Policy(), optimizer=fmp.optim.sgd(0.1)
    )
    assert bool(info.applied) and torch.equal(new.params["a"], torch.full((4,), 0.9))


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Linear:
    w: torch.Tensor
    b: torch.Tensor


torch.utils._pytree.register_dataclass(_Batch)
torch.export.register_dataclass(_Linear)


def test_containers_registered_as_torch_dataclasses_are_trees_to_the_step() -> None:
    # torch registers these with its Python pytree only; the step's C++ traversal must see them too.
    def loss_fn(params: _Linear, batch: _Batch) -> torch.Tensor:
        return ((batch.x @ params.w + params.b - batch.y) ** 2).mean()

    params = _Linear(torch.randn(3, 1, generator=torch.Generator().manual_seed(0)), torch.zeros(1))
    batch = _Batch(torch.randn(4, 3), torch.randn(4, 1))
    optimizer = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(8.0))
    state, info = fmp.train_step(loss_fn, state, batch, policy=fmp.get_policy("c=bf16"), optimizer=optimizer)
    assert bool(info.applied) and isinstance(state.params, _Linear)
    grads = torch.func.grad(lambda p: loss_fn(p, batch))(params)
    assert not torch.equal(state.params.w, params.w) and state.params.w.shape == grads.w.shape
