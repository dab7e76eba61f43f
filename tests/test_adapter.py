"""from_gradient_transformation: optax-style (init, update) pairs over torch tensors as fmp optimizers."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import assert_unmutated
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from conftest import snapshot

import fmp

# A power of two, so that -LR * buffer is exact and p + (-LR * buffer) rounds as torch.add(p, buffer,
# alpha=-LR) does: the optax-style form, which adds precomputed updates, then agrees bit for bit.
LR = 2.0**-4
MOMENTUM = 0.9


class GradientTransformation(NamedTuple):
    """optax's GradientTransformation, redeclared so the tests need no JAX."""

    init: Callable[[Any], Any]
    update: Callable[..., Any]


class TraceState(NamedTuple):
    steps: torch.Tensor
    trace: Any


def sgd_momentum(lr: float = LR, momentum: float = MOMENTUM) -> GradientTransformation:
    """optax.sgd(lr, momentum) in torch, with torch.optim.SGD's arithmetic (first buffer = first gradient)."""

    def init(params: Any) -> TraceState:
        return TraceState(torch.zeros((), dtype=torch.int32), pytree.tree_map(torch.zeros_like, params))

    def update(updates: Any, state: TraceState, params: Any = None) -> tuple[Any, TraceState]:
        del params
        first = state.steps == 0
        trace = pytree.tree_map(
            lambda g, b: torch.where(first, g, torch.add(b * momentum, g, alpha=1.0)), updates, state.trace
        )
        return pytree.tree_map(lambda b: b * -lr, trace), TraceState(state.steps + 1, trace)

    return GradientTransformation(init, update)


@pytest.mark.parametrize("form", ["namedtuple", "namespace", "two-callables"])
def test_optax_style_sgd_matches_fmp_sgd_bit_for_bit(form: str) -> None:
    transformation = sgd_momentum()
    if form == "namedtuple":
        optimizer = fmp.optim.from_gradient_transformation(transformation)
    elif form == "namespace":
        optimizer = fmp.optim.from_gradient_transformation(
            SimpleNamespace(init=transformation.init, update=transformation.update)
        )
    else:
        optimizer = fmp.optim.from_gradient_transformation(transformation.init, transformation.update)
    reference = fmp.optim.sgd(LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(0)
    params = ref_params = {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    state, ref_state = optimizer.init(params), reference.init(params)
    for _ in range(8):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        inputs = (grads, state, params)
        before = snapshot(inputs)
        params, state = optimizer.update(grads, state, params)
        assert_unmutated(inputs, before)
        ref_params, ref_state = reference.update(grads, ref_state, ref_params)
    assert_trees_bitwise_equal(params, ref_params)
    assert_trees_bitwise_equal(state.trace, ref_state.momentum)
    assert int(state.steps) == 8


def test_inside_train_step_a_skipped_step_keeps_the_state_bit_for_bit() -> None:
    optimizer = fmp.optim.from_gradient_transformation(sgd_momentum())
    reference = fmp.optim.sgd(LR, momentum=MOMENTUM)
    scaler = fmp.DynamicLossScale.create()
    state = fmp.TrainState.create(mlp_params(), optimizer, scaler)
    ref_state = fmp.TrainState.create(mlp_params(), reference, scaler)
    skipped = 0
    for x, y in mlp_batches(10, overflow_every=4):
        before = state
        state, info = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
        ref_state, _ = fmp.train_step(mlp_loss, ref_state, x, y, policy=fmp.Policy(), optimizer=reference)
        if not bool(info.grads_finite):
            skipped += 1
            assert_trees_bitwise_equal(state.opt_state, before.opt_state)
            assert_trees_bitwise_equal(state.params, before.params)
    assert skipped == 2 and int(state.opt_state.steps) == 8
    assert_trees_bitwise_equal(state.params, ref_state.params)


def test_updates_are_added_in_the_promoted_dtype_and_cast_back() -> None:
    def init(params: Any) -> tuple[()]:
        return ()

    def update(updates: Any, state: tuple[()], params: Any) -> tuple[Any, tuple[()]]:
        return pytree.tree_map(lambda g: g.float() * -0.3, updates), state

    optimizer = fmp.optim.from_gradient_transformation(init, update)
    params = {"w": torch.linspace(-2, 2, 7).bfloat16()}
    grads = {"w": torch.linspace(1, 3, 7).bfloat16()}
    new_params, _ = optimizer.update(grads, (), params)
    assert new_params["w"].dtype == torch.bfloat16
    assert torch.equal(new_params["w"], (params["w"].float() + grads["w"].float() * -0.3).bfloat16())


@pytest.mark.parametrize(
    ("update", "error", "message"),
    [
        (lambda g, s, p: g, TypeError, r"must return a pair \(updates, new_state\), got dict"),
        (lambda g, s, p: (g, s, s), TypeError, "got a tuple of 3"),
        (lambda g, s, p: ({"w": g["w"]}, s), ValueError, "updates must have the params' structure"),
        (lambda g, s, p: ({**g, "b": 0.0}, s), TypeError, r"updates\['b'\] is a float, expected a tensor"),
        (lambda g, s, p: ({**g, "b": g["w"]}, s), ValueError, r"updates\['b'\] has shape \(2, 3\), but its param"),
        (lambda g, s, p: (g, (s.steps + 1, ())), ValueError, "returned a state of structure"),
        (lambda g, s, p: (g, s._replace(steps=1)), TypeError, r"state\.steps came back as int, was Tensor"),
        (lambda g, s, p: (g, s._replace(steps=s.steps.double())), ValueError, r"state\.steps changed from torch"),
    ],
)
def test_bad_returns_are_named(update: Callable[..., Any], error: type[Exception], message: str) -> None:
    optimizer = fmp.optim.from_gradient_transformation(lambda params: TraceState(torch.zeros(()), ()), update)
    params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    with pytest.raises(error, match=message):
        optimizer.update(params, optimizer.init(params), params)


def test_a_non_tensor_state_leaf_may_stay_but_not_change() -> None:
    params = {"w": torch.ones(3)}

    def update(grads: Any, state: tuple[int, str], params: Any) -> tuple[Any, tuple[int, str]]:
        count, label = state
        return grads, (count + 1, label)

    counting = fmp.optim.from_gradient_transformation(lambda params: (0, "sgd"), update)
    with pytest.raises(TypeError, match=r"state\[0\] changed from 0 to 1: a skipped step keeps the old state"):
        counting.update(params, counting.init(params), params)
    constant = fmp.optim.from_gradient_transformation(lambda params: (0, "sgd"), lambda g, s, p: (g, s))
    assert constant.update(params, constant.init(params), params)[1] == (0, "sgd")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((fmp.optim.sgd(0.1),), "got an fmp.optim.Optimizer"),
        ((object(),), "takes an object with callable init and update"),
        ((SimpleNamespace(init=lambda p: (), update=None),), "takes an object with callable init and update"),
        ((lambda p: (), "update"), "update must be callable, got str"),
        ((None, lambda g, s, p: (g, s)), "init must be callable, got NoneType"),
    ],
)
def test_bad_arguments_are_named(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        fmp.optim.from_gradient_transformation(*args)
