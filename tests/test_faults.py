"""Fault injection: NaN, inf, 0 and negative values in every kind of leaf, and what reaches the params.

The invariant, for every fault: a step either applies an update whose params and optimizer state
are finite, or is skipped and leaves them bit for bit (model state moves either way, as a
module's buffers do under torch.amp). Non-finite gradients, losses, loss scales and updates skip;
the refusals and stall reports name the problem. The steps here check their update
(`check_update=True`; without it, a NaN moment or an update that overflows reaches the params).
Eager, donated, accumulated, with several losses, vmapped over an ensemble, and compiled (one
aot_eager graph for the module).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import mlp_params
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import fmp

ADAMW = fmp.optim.adamw(1e-2, weight_decay=0.1)
F32 = fmp.Policy()
POLICIES = {"f32": F32, "bf16": fmp.get_policy("p=f32,c=bf16,o=f32"), "f16": fmp.get_policy("p=f32,c=f16,o=f32")}
NON_FINITE = [float("nan"), float("inf"), float("-inf")]
VALUES = [*NON_FINITE, 0.0, -1.0, -1e30]
INPUTS = ("x", "y", "activation", "loss")


def loss_fn(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, act: torch.Tensor, extra: torch.Tensor
) -> torch.Tensor:
    """The MLP's MSE, with a poison added to the hidden activation (`act`) and one that scales the loss (`extra`).

    The loss is multiplied by `1 + extra`: a constant added to a loss would leave its gradients finite.
    """
    hidden = F.relu(F.linear(x, params["w1"], params["b1"])) + act
    return F.mse_loss(F.linear(hidden, params["w2"], params["b2"]).float(), y.float()) * (1.0 + extra)


def batch(seed: int = 0, rows: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(rows, 8, generator=gen),
        torch.randn(rows, 1, generator=gen),
        torch.zeros(rows, 8),
        torch.zeros(()),
    ]


def poison(tensor: torch.Tensor, index: int, value: float) -> torch.Tensor:
    out = tensor.clone()
    if out.numel():
        out.view(-1)[index % out.numel()] = value
    return out


def poisoned_batch(where: str, index: int, value: float, seed: int = 0) -> list[torch.Tensor]:
    args = batch(seed)
    position = INPUTS.index(where)
    args[position] = poison(args[position], index, value)
    return args


def make_state(scale: float = 2.0**10, accumulation_steps: int = 1) -> fmp.TrainState:
    scaler = fmp.DynamicLossScale.create(init_scale=scale, growth_interval=1000)
    return fmp.TrainState.create(mlp_params(), ADAMW, scaler, accumulation_steps=accumulation_steps)


def clone_tree(tree: Any) -> Any:
    return pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, tree)


def finite(tree: Any) -> bool:
    return bool(fmp.all_finite(tree))


def check_invariant(before: fmp.TrainState, after: fmp.TrainState, applied: torch.Tensor) -> bool:
    """Applied: finite params and optimizer state; skipped: both bit for bit. Returns whether it applied."""
    if bool(applied):
        assert finite((after.params, after.opt_state)), "an applied step wrote a non-finite value"
    else:
        assert_trees_bitwise_equal((after.params, after.opt_state), (before.params, before.opt_state))
    return bool(applied)


def step(state: fmp.TrainState, args: list[torch.Tensor], policy: fmp.Policy = F32, **kwargs: Any) -> Any:
    return fmp.train_step(loss_fn, state, *args, policy=policy, optimizer=ADAMW, **{"check_update": True, **kwargs})


@settings(max_examples=30)
@given(
    st.sampled_from(INPUTS),
    st.integers(0, 47),
    st.sampled_from(VALUES),
    st.sampled_from(sorted(POLICIES)),
    st.booleans(),
)
def test_a_poisoned_input_activation_or_loss_never_reaches_the_params(
    where: str, index: int, value: float, policy: str, donate: bool
) -> None:
    state = make_state()
    before = clone_tree(state)
    new, info = step(state, poisoned_batch(where, index, value), POLICIES[policy], donate=donate)
    applied = check_invariant(before, new, info.applied)
    if value in NON_FINITE:
        assert not applied and not bool(info.grads_finite)
        assert float(new.scaler.loss_scale) == 2.0**9  # backed off once
    assert (int(new.counts.applied), int(new.counts.skipped)) == (int(applied), int(not applied))


LEAVES = [("params", name) for name in ("w1", "b1", "w2", "b2")] + [
    ("opt_state", f"{moment}.{name}") for moment in ("exp_avg", "exp_avg_sq") for name in ("w1", "b2")
]


def poison_state(state: fmp.TrainState, leaf: tuple[str, str], index: int, value: float) -> fmp.TrainState:
    part, name = leaf
    if part == "params":
        return state._replace(params={**state.params, name: poison(state.params[name], index, value)})
    moment, key = name.split(".")
    tree = getattr(state.opt_state, moment)
    return state._replace(
        opt_state=state.opt_state._replace(**{moment: {**tree, key: poison(tree[key], index, value)}})
    )


@settings(max_examples=30)
@given(st.sampled_from(LEAVES), st.integers(0, 63), st.sampled_from(VALUES), st.booleans())
def test_a_poisoned_param_or_optimizer_state_skips_the_step_bit_for_bit(
    leaf: tuple[str, str], index: int, value: float, donate: bool
) -> None:
    state = poison_state(make_state(), leaf, index, value)
    before = clone_tree(state)
    new, info = step(state, batch(), donate=donate)
    applied = check_invariant(before, new, info.applied)
    if value in NON_FINITE:
        assert not applied
        # Finite gradients (a NaN moment; an inf bias behind a ReLU) but a non-finite update: the update check skips it.
        assert int(new.counts.bad_update) == int(bool(info.grads_finite))


def test_without_the_update_check_a_nan_moment_reaches_the_params() -> None:
    # check_update=False trades the check's pass over the new state for this: documented, pinned here.
    state = poison_state(make_state(), ("opt_state", "exp_avg.w1"), 0, float("nan"))
    new, info = step(state, batch(), check_update=False)
    assert bool(info.applied) and not finite(new.params["w1"])


def test_a_stalled_run_is_named_for_what_poisons_it() -> None:
    state = poison_state(make_state(), ("opt_state", "exp_avg.w1"), 0, float("nan"))
    for _ in range(3):
        state, _ = step(state, batch())
    with pytest.raises(fmp.LossScaleStalledError, match="3 of them had finite gradients but a non-finite update"):
        fmp.raise_if_stalled(state, 3)
    state = make_state(scale=1.0)  # already at min_scale: backing off cannot help
    state = state._replace(scaler=dataclasses.replace(state.scaler, min_scale=1.0))
    for _ in range(2):
        state, _ = step(state, poisoned_batch("x", 0, float("nan")))
    with pytest.raises(fmp.LossScaleStalledError, match="Look for inf or NaN in the inputs, the labels or the model"):
        fmp.raise_if_stalled(state, 2)


BAD_SCALES = [*NON_FINITE, 0.0, -4.0, 2.0**-140, 2.0**200]


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("scale", BAD_SCALES)
def test_a_loss_scale_out_of_range_skips_heals_and_is_refused_at_create(kind: str, scale: float) -> None:
    good = make_state()
    scaler: fmp.LossScale = good.scaler if kind == "dynamic" else fmp.StaticLossScale.create(2.0**10)
    bad = dataclasses.replace(scaler, loss_scale=torch.tensor(scale))  # type: ignore[type-var]
    state = good._replace(scaler=bad)
    new, info = step(state, batch())
    check_invariant(state, new, info.applied)
    assert not bool(info.applied) and int(new.counts.bad_scale) == 1
    assert bool(fmp._loss_scale.scale_in_range(new.scaler))
    _, info = step(new, batch())  # the healed scale trains on
    assert bool(info.applied)
    with pytest.raises(ValueError, match=r"scaler\[1\]\.loss_scale must be a finite scale in"):
        fmp.TrainState.create(mlp_params(), ADAMW, (scaler, bad))


def test_a_poisoned_micro_batch_skips_its_whole_window() -> None:
    for poisoned in (0, 1):
        state = make_state(accumulation_steps=2)
        before = clone_tree(state)
        for micro in range(2):
            args = poisoned_batch("activation", 5, float("inf"), seed=micro) if micro == poisoned else batch(micro)
            state, info = step(state, args)
        check_invariant(before, state, info.applied)
        assert not bool(info.applied) and float(state.scaler.loss_scale) == 2.0**9  # one back-off per window
        for micro in range(2):  # the next window is clean, and applies
            state, info = step(state, batch(micro))
        assert bool(info.applied) and finite(state.params)


def two_losses(params: dict[str, torch.Tensor], *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _, extra = args
    return loss_fn(params, x, y, torch.zeros(x.shape[0], 8), torch.zeros(())), F.linear(
        x, params["w1"]
    ).square().mean() * (1.0 + extra)


@pytest.mark.parametrize("value", NON_FINITE)
def test_one_poisoned_loss_of_two_skips_and_backs_off_its_own_scale(value: float) -> None:
    scalers = tuple(fmp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=1000) for _ in range(2))
    state = fmp.TrainState.create(mlp_params(), ADAMW, scalers)
    new, info = fmp.train_step(
        two_losses, state, *poisoned_batch("loss", 0, value), policy=F32, optimizer=ADAMW, check_update=True
    )
    check_invariant(state, new, info.applied)
    assert not bool(info.applied)
    assert [float(s.loss_scale) for s in new.scaler] == [2.0**10, 2.0**9]


def test_an_ensemble_skips_the_poisoned_members_alone() -> None:
    members = [make_state() for _ in range(3)]
    members[2] = poison_state(members[2], ("opt_state", "exp_avg_sq.w1"), 3, float("nan"))
    args = [torch.stack(parts) for parts in zip(*(batch(seed) for seed in range(3)), strict=True)]
    args[0][1, 2, 3] = float("inf")  # member 1: its input
    stacked = fmp.stack_trees(members)
    new, info = torch.func.vmap(
        functools.partial(fmp.train_step, loss_fn, policy=F32, optimizer=ADAMW, check_update=True)
    )(stacked, *args)
    assert info.applied.tolist() == [True, False, False]
    assert info.grads_finite.tolist() == [True, False, True]  # member 2's gradients were fine, its update not
    for i in range(3):
        check_invariant(members[i], fmp.unstack_tree(new, i), info.applied[i])


def stateful_loss(
    params: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor], *args: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Normalizes the hidden activation by its batch statistics and tracks a running mean, as BatchNorm trains."""
    x = args[0]
    hidden = F.linear(x, params["w1"], params["b1"])
    mean = hidden.mean(0)
    out = F.linear(F.relu(hidden - mean), params["w2"], params["b2"])
    return F.mse_loss(out, args[1]), {"running_mean": 0.9 * model_state["running_mean"] + 0.1 * mean.detach()}


def test_model_state_moves_on_skipped_steps_and_a_poisoned_buffer_does_not_block_training() -> None:
    state = fmp.TrainState.create(
        mlp_params(), ADAMW, make_state().scaler, model_state={"running_mean": torch.zeros(8)}
    )
    # A NaN input: skipped, yet the running mean moves (to NaN), by design, as under torch.amp.
    new, info = fmp.train_step(
        stateful_loss, state, *poisoned_batch("x", 0, float("nan"))[:2], policy=F32, optimizer=ADAMW, check_update=True
    )
    check_invariant(state, new, info.applied)
    assert not bool(info.applied) and not finite(new.model_state)
    # A NaN buffer that the loss does not read (training uses batch statistics) does not skip steps.
    again, info = fmp.train_step(stateful_loss, new, *batch()[:2], policy=F32, optimizer=ADAMW, check_update=True)
    assert bool(info.applied) and finite((again.params, again.opt_state)) and not finite(again.model_state)


@pytest.fixture(scope="module")
def compiled_step() -> Any:
    torch._dynamo.reset()
    return torch.compile(
        functools.partial(fmp.train_step, loss_fn, policy=F32, optimizer=ADAMW, check_update=True),
        backend="aot_eager",
        fullgraph=True,
    )


@pytest.mark.compiled
@pytest.mark.parametrize(
    "fault",
    ["clean", "x=nan", "activation=inf", "loss=-inf", "exp_avg=nan", "param=inf", "scale=nan", "scale=0"],
)
def test_compiled_steps_skip_every_fault_as_eager_does(compiled_step: Any, fault: str) -> None:
    state, args = make_state(), batch()
    where, _, value = fault.partition("=")
    if where in INPUTS:
        args = poisoned_batch(where, 7, float(value))
    elif where == "exp_avg":
        state = poison_state(state, ("opt_state", "exp_avg.w2"), 1, float(value))
    elif where == "param":
        state = poison_state(state, ("params", "b1"), 2, float(value))
    elif where == "scale":
        state = state._replace(scaler=dataclasses.replace(state.scaler, loss_scale=torch.tensor(float(value))))
    new, info = compiled_step(state, *args)
    eager, eager_info = step(state, args)
    assert bool(info.applied) == (fault == "clean")
    check_invariant(state, new, info.applied)
    assert_trees_bitwise_equal((new, info.applied), (eager, eager_info.applied))
