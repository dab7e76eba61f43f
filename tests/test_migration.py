"""Moving a run between torch.amp's GradScaler and fmp through state dicts, both ways."""

from __future__ import annotations

import io

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import grad_scaler_step
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from conftest import torch_grad_scaler
from hypothesis import example
from hypothesis import given
from hypothesis import strategies as st

import fmp

scalers = st.builds(
    fmp.DynamicLossScale.create,
    init_scale=st.integers(-10, 30).map(lambda k: 2.0**k),
    growth_factor=st.one_of(st.just(2.0), st.floats(1.0001, 8.0)),
    backoff_factor=st.one_of(st.just(0.5), st.floats(0.01, 0.99)),
    growth_interval=st.integers(1, 6),
)
runs = st.lists(st.booleans(), max_size=40)


@given(scalers, runs, runs)
@example(fmp.DynamicLossScale.create(init_scale=1.0, backoff_factor=0.01), [], [False] * 25)  # past the floor
def test_a_run_moves_from_grad_scaler_to_fmp_on_the_same_trajectory(
    start: fmp.DynamicLossScale, before: list[bool], after: list[bool]
) -> None:
    reference, optimizer = torch_grad_scaler(start)
    for finite in before:
        grad_scaler_step(reference, optimizer, finite)
    saved = reference.state_dict()
    if saved["scale"] < torch.finfo(torch.float32).tiny:  # GradScaler backed off into subnormals: refused
        with pytest.raises(ValueError, match=r"state_dict\['scale'\] must be a positive, normal float32"):
            fmp.DynamicLossScale.from_state_dict(saved)
        return
    state = fmp.DynamicLossScale.from_state_dict(saved)
    for finite in after:
        grad_scaler_step(reference, optimizer, finite)
        state = state.adjust(torch.tensor(finite))
        expected = reference.state_dict()
        if expected["scale"] < state.min_scale:  # GradScaler's has no floor; fmp's holds
            assert float(state.loss_scale) == state.min_scale
            break
        assert float(state.loss_scale) == expected["scale"]
        assert int(state.growth_tracker) == expected["_growth_tracker"]


@given(scalers, runs, runs)
def test_a_run_moves_from_fmp_to_grad_scaler_on_the_same_trajectory(
    state: fmp.DynamicLossScale, before: list[bool], after: list[bool]
) -> None:
    for finite in before:
        state = state.adjust(torch.tensor(finite))
    reference, optimizer = torch_grad_scaler(fmp.DynamicLossScale.create())
    reference.load_state_dict(state.state_dict())
    for finite in after:
        grad_scaler_step(reference, optimizer, finite)
        state = state.adjust(torch.tensor(finite))
        if reference.state_dict()["scale"] < state.min_scale:  # GradScaler's has no floor; fmp's holds
            assert float(state.loss_scale) == state.min_scale
            break
        assert reference.state_dict()["scale"] == float(state.loss_scale)
        assert reference.state_dict()["_growth_tracker"] == int(state.growth_tracker)


def test_fmp_state_dicts_round_trip_through_torch_save_with_every_field() -> None:
    state = fmp.DynamicLossScale.create(
        init_scale=3.0, growth_interval=5, min_scale=0.25, max_scale=2.0**20, hysteresis=3
    )
    for finite in [True, True, False, False]:
        state = state.adjust(torch.tensor(finite))
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    restored = fmp.DynamicLossScale.from_state_dict(torch.load(buffer, weights_only=True))
    assert_trees_bitwise_equal(restored, state)
    assert int(restored.overflow_streak) == 2 and restored.hysteresis == 3


@given(
    st.integers(0, 4),
    st.integers(2, 6),
    st.integers(1, 4),
    st.floats(2.0**-10, 1.0),
    st.lists(st.booleans(), max_size=12),
)
def test_property_fmp_state_dicts_round_trip_every_field_mid_interval(
    exponent: int, growth_interval: int, hysteresis: int, min_scale: float, finite: list[bool]
) -> None:
    state = fmp.DynamicLossScale.create(
        init_scale=2.0**exponent,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=2.0**6,
        hysteresis=hysteresis,
    )
    for flag in finite:  # the tracker and the overflow streak anywhere in their ranges
        state = state.adjust(torch.tensor(flag))
    restored = fmp.DynamicLossScale.from_state_dict(state.state_dict())
    assert_trees_bitwise_equal(restored, state)  # the treespec holds min_scale, max_scale, hysteresis
    assert restored.adjust(torch.tensor(False)).state_dict() == state.adjust(torch.tensor(False)).state_dict()


def test_a_stacked_state_dict_names_unstack_tree() -> None:
    stacked = fmp.stack_trees([fmp.DynamicLossScale.create(init_scale=2.0**k) for k in range(3)])
    with pytest.raises(ValueError, match=r"stacked \(loss_scale shape \(3,\)\).*fmp.unstack_tree"):
        stacked.state_dict()
    assert fmp.unstack_tree(stacked, 1).state_dict()["scale"] == 2.0


@pytest.mark.parametrize(
    ("state_dict", "error", "message"),
    [
        ({}, ValueError, "empty, as a disabled GradScaler"),
        ({"scale": 1.0}, ValueError, r"missing keys \['growth_factor'"),
        ({**torch.amp.GradScaler("cpu").state_dict(), "scael": 2.0}, ValueError, r"unknown keys \['scael'\]"),
        (
            {**torch.amp.GradScaler("cpu").state_dict(), "scale": 0.0},
            ValueError,
            r"^state_dict\['scale'\] must be a pos",
        ),
        (
            {**torch.amp.GradScaler("cpu").state_dict(), "scale": "65536"},
            TypeError,
            r"^state_dict\['scale'\] must be a",
        ),
        (
            {**torch.amp.GradScaler("cpu").state_dict(), "_growth_tracker": 2000},
            ValueError,
            r"^state_dict\['_growth_tracker'\] must be in \[0, 1999\]",
        ),
        (
            {**torch.amp.GradScaler("cpu").state_dict(), "_growth_tracker": torch.tensor([2])},
            TypeError,
            r"^state_dict\['_growth_tracker'\] must be an int, got a Tensor of shape \(1,\)",
        ),
        (
            {**torch.amp.GradScaler("cpu").state_dict(), "overflow_streak": -1},
            ValueError,
            r"^state_dict\['overflow_streak'\] must be in",
        ),
        ({**torch.amp.GradScaler("cpu").state_dict(), "growth_factor": "2"}, TypeError, "growth_factor must be"),
        ([("scale", 1.0)], TypeError, "state_dict must be a mapping"),
        (
            {**torch.amp.GradScaler("cpu").state_dict(), "scale": 1e-3, "min_scale": 1.0},
            ValueError,
            r"state_dict: scale \(0\.0010.*\) must lie in \[min_scale, max_scale\]",
        ),
    ],
)
def test_corrupt_or_mismatched_state_dicts_are_named(state_dict: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        fmp.DynamicLossScale.from_state_dict(state_dict)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "optimizer",
    [fmp.optim.adamw(1e-2), fmp.optim.sgd(0.1, momentum=0.9), fmp.optim.sgd(0.1)],
    ids=["adamw", "sgd-momentum", "sgd"],
)
@pytest.mark.parametrize(
    "scaler",
    [fmp.DynamicLossScale.create(init_scale=8.0, hysteresis=2), fmp.StaticLossScale.create(4.0), fmp.NoOpLossScale()],
    ids=lambda s: type(s).__name__,
)
def test_whole_train_states_load_with_weights_only(optimizer: fmp.optim.Optimizer, scaler: fmp.LossScale) -> None:
    state = fmp.TrainState.create(mlp_params(), optimizer, scaler)
    for x, y in mlp_batches(3, overflow_every=2):
        state, _ = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=True)  # fmp's classes are allowed on import
    assert_trees_bitwise_equal(restored, state)
    assert type(restored.scaler) is type(scaler)
    allowed = set(torch.serialization.get_safe_globals())
    assert {fmp.TrainState, type(scaler), fmp.StepCounts} <= set(fmp.serialization.state_classes()) <= allowed


def test_treespecs_of_the_state_serialize_and_torch_export_saves_a_program_taking_it() -> None:
    optimizer = fmp.optim.ema(fmp.optim.adamw(1e-2))
    scalers = (fmp.DynamicLossScale.create(init_scale=8.0), fmp.StaticLossScale.create(2.0))
    state = fmp.TrainState.create(mlp_params(), optimizer, scalers, accumulation_steps=2)
    x, y = next(mlp_batches(1, overflow_every=0))

    def two_losses(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return mlp_loss(params, x, y), mlp_loss(params, x, 2 * y)

    _, info = fmp.train_step(two_losses, state, x, y, policy=fmp.Policy(), optimizer=optimizer, grad_norm=True)
    gradients = fmp.mixed_precision_grad(mlp_loss, state.params, scalers[0], x, y, policy=fmp.Policy())
    for tree in (state, info, gradients, fmp.optim.sgd(0.1, momentum=0.9).init(state.params)):
        spec = pytree.tree_structure(tree)
        assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec

    class Adjust(torch.nn.Module):
        def forward(self, state: fmp.TrainState) -> tuple[fmp.LossScale, fmp.StepCounts]:
            finite = fmp.all_finite(state.params)
            return state.scaler[0].adjust(finite), state.counts.advance(
                finite, finite, ~finite, torch.zeros_like(finite), torch.zeros_like(finite)
            )

    buffer = io.BytesIO()
    torch.export.save(torch.export.export(Adjust(), (state,)), buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert_trees_bitwise_equal(loaded.module()(state), Adjust()(state))
