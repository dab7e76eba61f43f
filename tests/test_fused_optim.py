"""fmp.optim's fused=True optimizers: bit for bit torch.optim's fused ones under a GradScaler, skips included."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_trees_bitwise_equal
from torch import nn

import fmp

POLICY = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu")

# (fmp optimizer, the torch.optim one it follows)
CASES: dict[str, tuple[Callable[..., fmp.optim.Optimizer], Callable[..., torch.optim.Optimizer]]] = {
    "adamw": (
        lambda: fmp.optim.adamw(1e-2, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adam": (
        lambda: fmp.optim.adam(1e-2, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "sgd": (
        lambda: fmp.optim.sgd(0.1, weight_decay=0.01, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01, fused=True),
    ),
    "sgd, scheduled": (
        lambda: fmp.optim.sgd(fmp.optim.schedule.constant(0.1), fused=True),
        lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1), fused=True),
    ),
}


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _batches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=gen).to(dtype) for _ in range(6)]
    batches[2] = batches[2].clone().fill_(float("inf"))  # an overflowing step, skipped by both
    return batches


def _torch_run(model: nn.Module, make: Callable[..., torch.optim.Optimizer], batches: list[torch.Tensor]) -> Any:
    optimizer = make(list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    losses = []
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {k: v.detach() for k, v in model.named_parameters()}, losses, scaler.get_scale()


def _fmp_run(model: nn.Module, optimizer: fmp.optim.Optimizer, batches: list[torch.Tensor], **step_kwargs: Any) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).float().square().mean()

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(growth_interval=2))
    losses = []
    for x in batches:
        state, info = fmp.train_step(loss_fn, state, x, policy=POLICY, optimizer=optimizer, **step_kwargs)
        losses.append(info.loss)
    return state, losses


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("case", CASES)
def test_fused_optimizers_follow_torch_fused_bit_for_bit(case: str, donate: bool) -> None:
    make_fmp, make_torch = CASES[case]
    model, batches = _model(), _batches()
    expected_params, expected_losses, expected_scale = _torch_run(copy.deepcopy(model), make_torch, batches)
    state, losses = _fmp_run(model, make_fmp(), batches, donate=donate)
    assert_trees_bitwise_equal(state.params, expected_params)
    assert_trees_bitwise_equal(losses, expected_losses)
    assert float(state.scaler.loss_scale) == expected_scale
    assert int(state.counts.skipped) == 1 and int(state.counts.applied) == len(batches) - 1


def test_a_skipped_fused_step_keeps_params_and_state_bit_for_bit_and_does_not_count() -> None:
    optimizer = fmp.optim.adamw(1e-2, fused=True)
    params = {"w": torch.tensor([1.0, -0.0, float("nan"), 3.0])}
    state = optimizer.init(params)
    grads = {"w": torch.ones(4)}
    for in_place in (False, True):
        kept = copy.deepcopy((params, state))
        new_params, new_state = optimizer.masked_update(grads, state, params, torch.tensor(False), in_place)
        assert_trees_bitwise_equal((new_params, new_state), kept)
    new_params, new_state = optimizer.masked_update(grads, state, params, torch.tensor(True), False)
    assert int(new_state.step) == 1 and not torch.equal(new_params["w"][0], params["w"][0])
    assert torch.equal(params["w"][:1], torch.ones(1))  # a pure call leaves its inputs as they were


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_adamw_on_16_bit_params_follows_torch(dtype: torch.dtype) -> None:
    def make_fmp() -> fmp.optim.Optimizer:
        return fmp.optim.adamw(1e-2, eps=1e-4, fused=True)  # 1e-8 rounds to 0 in float16, which fmp refuses

    def make_torch(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, fused=True)

    model = _model(dtype)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    reference = make_torch([nn.Parameter(v.clone()) for v in params.values()])
    for p, g in zip(reference.param_groups[0]["params"], grads.values(), strict=True):
        p.grad = g.clone()
    reference.step()
    optimizer = make_fmp()
    new_params, _ = optimizer.update(grads, optimizer.init(params), params)
    assert_trees_bitwise_equal(list(new_params.values()), [p.detach() for p in reference.param_groups[0]["params"]])


def test_fused_takes_the_pure_form_compiled_and_under_vmap() -> None:
    """Where the kernel cannot run, the update is fused=False's, bit for bit."""
    fused, pure = fmp.optim.adamw(1e-2, fused=True), fmp.optim.adamw(1e-2)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = pure.init(params)
    expected = pure.update(grads, state, params)
    compiled = torch.compile(fused.update, fullgraph=True, backend="eager")(grads, state, params)
    assert_trees_bitwise_equal(compiled, expected)
    stacked = fmp.stack_trees([params, params])
    stacked_grads, stacked_state = fmp.stack_trees([grads, grads]), fmp.stack_trees([state, state])
    mapped = torch.func.vmap(fused.update)(stacked_grads, stacked_state, stacked)
    assert_trees_bitwise_equal(fmp.unstack_tree(mapped, 0), expected)


def test_fused_sgd_with_momentum_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"fused=True\) takes momentum=0.*host"):
        fmp.optim.sgd(0.1, momentum=0.9, fused=True)
    with pytest.raises(TypeError, match="fused"):
        fmp.optim.adamw(fused="yes")  # type: ignore[arg-type]


def test_a_compiled_step_with_a_fused_optimizer_traces_whole_and_takes_the_pure_update() -> None:
    model, batches = _model(), _batches()[:3]
    expected, _ = _fmp_run(model, fmp.optim.adamw(1e-2), batches)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).float().square().mean()

    optimizer = fmp.optim.adamw(1e-2, fused=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(growth_interval=2))
    step = torch.compile(fmp.train_step, fullgraph=True, backend="eager")
    for x in batches:
        state, _ = step(loss_fn, state, x, policy=POLICY, optimizer=optimizer)
    assert_trees_bitwise_equal(state.params, expected.params)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("case", ["adamw", "sgd"])
def test_non_contiguous_params_take_the_unfused_update(case: str, donate: bool) -> None:
    # torch's fused kernels walk memory in order whatever the strides: a transposed or strided param
    # would be updated with another element's gradient, so such params take the fused=False maths.
    fused, _ = CASES[case]
    unfused = {
        "adamw": lambda: fmp.optim.adamw(1e-2, weight_decay=0.1),
        "sgd": lambda: fmp.optim.sgd(0.1, weight_decay=0.01),
    }
    policy = fmp.get_policy("params=float32,compute=float32,output=float32")

    def strided() -> dict[str, torch.Tensor]:
        return {"t": torch.arange(12.0).reshape(3, 4).T, "s": torch.zeros(16)[::2].add_(torch.arange(8.0))}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (p["t"] * x[:12].reshape(4, 3)).sum() + (p["s"] * p["s"] * x[12:20]).sum()

    x = torch.linspace(-1.0, 1.0, 20)
    results = []
    for optimizer, start in ((fused(), strided()), (unfused[case](), strided())):
        assert not start["t"].is_contiguous() and not start["s"].is_contiguous()
        state = fmp.TrainState.create(start, optimizer, fmp.DynamicLossScale.create(1.0))
        for _ in range(2):
            state, info = fmp.train_step(loss_fn, state, x, policy=policy, optimizer=optimizer, donate=donate)
            assert bool(info.applied)
        results.append(state.params)
    assert_trees_bitwise_equal(results[0], results[1])
