"""Policies carry autocast rules: a 16-bit compute dtype is applied op by op, as torch.autocast does."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_trees_bitwise_equal
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from torch._dynamo.testing import CompileCounterWithBackend

import fmp


def recorded_dtypes(policy: fmp.Policy) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen["param"], seen["input"] = params["w1"].dtype, x.dtype
        hidden = F.linear(x, params["w1"], params["b1"])
        probs = torch.softmax(hidden, dim=-1)
        seen["linear"], seen["softmax"] = hidden.dtype, probs.dtype
        return F.mse_loss(probs.sum(-1, keepdim=True), y)

    x, y = next(mlp_batches(1, 0))
    fmp.mixed_precision_grad(loss_fn, mlp_params(), fmp.NoOpLossScale(), x, y, policy=policy)
    return seen


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_default_rules_keep_softmax_in_float32_and_params_in_their_dtype(compute: str) -> None:
    low = getattr(torch, compute)
    seen = recorded_dtypes(fmp.get_policy(f"params=float32,compute={compute},output=float32"))
    assert seen == {"param": torch.float32, "input": torch.float32, "linear": low, "softmax": torch.float32}


def test_rules_none_casts_the_whole_model_as_jmp() -> None:
    seen = recorded_dtypes(fmp.get_policy("params=float32,compute=float16,output=float32,rules=none"))
    assert set(seen.values()) == {torch.float16}


def test_float32_compute_casts_nothing_op_by_op() -> None:
    seen = recorded_dtypes(fmp.get_policy("params=float32,compute=float32,output=float32,rules=cpu"))
    assert set(seen.values()) == {torch.float32}


def test_cpu_rules_train_bit_for_bit_as_torch_amp() -> None:
    """rules="cpu" is torch.autocast("cpu"): losses, params and scales equal GradScaler's run exactly."""
    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu")
    optimizer = fmp.optim.sgd(0.05, momentum=0.9)
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=2)
    state = fmp.TrainState.create(mlp_params(), optimizer, scaler)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in mlp_params().items()}
    torch_optimizer = torch.optim.SGD(params.values(), lr=0.05, momentum=0.9)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    step = functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=optimizer)
    for x, y in mlp_batches(10, 4):
        state, info = step(state, x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = mlp_loss(params, x, y)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(torch_optimizer)
        grad_scaler.update()
        torch_optimizer.zero_grad()
        torch.testing.assert_close(info.loss, loss.detach(), rtol=0, atol=0, equal_nan=True)
        assert float(state.scaler.loss_scale) == grad_scaler.get_scale()
    assert int(state.counts.skipped) == 2
    assert_trees_bitwise_equal(state.params, {k: v.detach() for k, v in params.items()})


def test_a_policys_overrides_change_one_op_as_autocasts_own_overrides_do() -> None:
    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu")
    seen = recorded_dtypes(policy.with_overrides({"linear": torch.float32}))
    assert seen == {"param": torch.float32, "input": torch.float32, "linear": torch.float32, "softmax": torch.float32}
    assert recorded_dtypes(policy)["linear"] == torch.bfloat16
    # A step on the policy's overrides is the step on autocast's with a policy that casts nothing whole.
    overrides = {"relu": torch.float32, "linear": torch.float32}  # relu: in neither rule set
    optimizer = fmp.optim.adamw(1e-2)
    by_policy = functools.partial(
        fmp.train_step, mlp_loss, policy=policy.with_overrides(overrides), optimizer=optimizer
    )
    by_hand = functools.partial(
        fmp.train_step,
        fmp.autocast.autocast(mlp_loss, torch.bfloat16, rules="cpu", overrides=overrides),
        policy=fmp.get_policy("params=float32,compute=float32,output=float32"),
        optimizer=optimizer,
    )
    states = [fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create()) for _ in range(2)]
    for x, y in mlp_batches(4, 1):
        states = [step(state, x, y)[0] for step, state in zip((by_policy, by_hand), states, strict=True)]
    assert_trees_bitwise_equal(states[0], states[1])


def test_a_step_on_a_policys_overrides_compiles_to_one_graph_and_equals_the_eager_step() -> None:
    # relu is in neither rule set: its name is checked where the policy is made, not in the trace.
    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu").with_overrides(
        {"relu": fmp.autocast.Cast.LOWER, "linear": torch.float32}
    )
    optimizer = fmp.optim.adamw(1e-2)
    step = functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=optimizer)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    states = [fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create()) for _ in range(2)]
    try:
        for x, y in mlp_batches(3, 0):
            states = [s(state, x, y)[0] for s, state in zip((compiled, step), states, strict=True)]
    finally:
        torch._dynamo.reset()  # torch.compile keeps every partial's graphs under one code object
    assert counter.frame_count == 1
    assert_trees_bitwise_equal(states[0].params, states[1].params)


def test_overrides_change_nothing_where_the_policy_casts_whole() -> None:
    policy = fmp.get_policy("params=float32,compute=float32,output=float32,rules=cpu")
    assert recorded_dtypes(policy.with_overrides({"linear": fmp.autocast.Cast.LOWER})) == recorded_dtypes(policy)


def test_step_info_loss_scale_is_on_the_step_device_for_no_op_scalers() -> None:
    state = fmp.TrainState.create(mlp_params(), fmp.optim.sgd(0.1), fmp.NoOpLossScale())
    _, info = fmp.train_step(
        mlp_loss, state, *next(mlp_batches(1, 0)), policy=fmp.Policy(), optimizer=fmp.optim.sgd(0.1)
    )
    assert float(info.loss_scale) == 1.0 and info.loss_scale.device == info.grads_finite.device


def test_bad_rules_and_hooks_are_named() -> None:
    with pytest.raises(ValueError, match=r"Policy\.rules must be one of .* got \['cuda'\]; for a rule set of your own"):
        fmp.Policy(rules=["cuda"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="autocast rules must be a rule-set name"):
        fmp.autocast.autocast(torch.mm, torch.bfloat16, rules=None)  # type: ignore[arg-type]
    state = fmp.TrainState.create(mlp_params(), fmp.optim.sgd(0.1), fmp.NoOpLossScale())
    with pytest.raises(TypeError, match=r"reduce_grads must be a function of fmp\.Gradients, got int"):
        fmp.train_step(
            mlp_loss, state, *next(mlp_batches(1, 0)), policy=fmp.Policy(), optimizer=fmp.optim.sgd(0.1), reduce_grads=3
        )
    with pytest.raises(ValueError, match=r"steps must be in \[1, "):
        fmp.GradientAccumulator.create(mlp_params(), fmp.NoOpLossScale(), 0)
