"""fmp.optim.ema: torch's AveragedModel EMA, kept in the optimizer state and skipped with the step."""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
from conftest import assert_trees_bitwise_equal
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from torch.optim.swa_utils import AveragedModel
from torch.optim.swa_utils import get_ema_multi_avg_fn

import fmp


@pytest.mark.parametrize("decay", [0.9, 0.999])
def test_the_average_is_averaged_models_ema_bit_for_bit(decay: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    torch_optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = fmp.optim.ema(fmp.optim.sgd(0.1, momentum=0.9), decay)
    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().mean()

    for x in torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(1)):
        model(x).square().mean().backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        averaged.update_parameters(model)
        state, _ = fmp.train_step(loss_fn, state, x, policy=fmp.Policy(), optimizer=optimizer)
        expected = {name: p.detach() for name, p in averaged.module.named_parameters()}
        assert_trees_bitwise_equal(state.opt_state.average, expected)
    assert int(state.opt_state.step) == 5 and not torch.equal(state.opt_state.average["0.weight"], params["0.weight"])


def test_a_skipped_step_keeps_the_average_and_the_next_averages_as_if_it_never_ran() -> None:
    optimizer = fmp.optim.ema(fmp.optim.adamw(1e-2), 0.9)
    step = functools.partial(fmp.train_step, mlp_loss, policy=fmp.Policy(), optimizer=optimizer)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(2.0**10))
    (x, y), (bad_x, _) = list(mlp_batches(2, 2))
    skipped, info = step(state, bad_x, y)
    assert not bool(info.applied)
    assert_trees_bitwise_equal(skipped.opt_state, state.opt_state)
    assert_trees_bitwise_equal(step(skipped, x, y)[0].opt_state, step(state, x, y)[0].opt_state)


def test_bfloat16_params_keep_a_float32_average_that_moves_below_their_spacing() -> None:
    # Updates of 1e-4 on values near 1 are below half a bfloat16 spacing (2**-8): a bfloat16
    # average could not follow them, the float32 one holds the mean of the rounded params.
    params = {"w": torch.ones(4096, dtype=torch.bfloat16)}
    optimizer = fmp.optim.ema(fmp.optim.stochastic_rounding(fmp.optim.sgd(1e-4)), decay=0.5)
    state = optimizer.init(params)
    assert state.average["w"].dtype == torch.float32
    for _ in range(20):
        params, state = optimizer.update({"w": torch.ones(4096, dtype=torch.bfloat16)}, state, params)
    average = state.average["w"]
    assert params["w"].dtype == torch.bfloat16 and average.dtype == torch.float32
    assert bool((average != average.to(torch.bfloat16).float()).any())  # values between bfloat16 neighbours
    assert abs(float(average.mean()) - (1 - 19 * 1e-4)) < 2e-4  # unbiased, lagging ~1 update at decay 0.5


@pytest.mark.parametrize("decay", [0.0, 0.5, 1.0])
def test_the_first_update_copies_the_params_and_decay_weighs_the_old_average(decay: float) -> None:
    optimizer = fmp.optim.ema(fmp.optim.sgd(0.1), decay)
    first_params, state = optimizer.update(mlp_params(seed=1), optimizer.init(mlp_params()), mlp_params())
    assert_trees_bitwise_equal(state.average, first_params)
    second_params, state = optimizer.update(mlp_params(seed=1), state, first_params)
    expected = {0.0: second_params, 1.0: first_params}.get(decay)
    if expected is None:
        expected = {k: torch.lerp(first_params[k], second_params[k], 0.5) for k in first_params}
    assert_trees_bitwise_equal(state.average, expected)


def test_a_saved_state_loads_bit_for_bit(tmp_path: pathlib.Path) -> None:
    optimizer = fmp.optim.ema(fmp.optim.adamw(1e-2))
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    state, _ = fmp.train_step(mlp_loss, state, *next(mlp_batches(1, 0)), policy=fmp.Policy(), optimizer=optimizer)
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert_trees_bitwise_equal(loaded, state)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"decay must be in \[0.0, 1.0\], got 1.5"):
        fmp.optim.ema(fmp.optim.sgd(0.1), 1.5)
    with pytest.raises(TypeError, match=r"ema wraps an fmp\.optim\.Optimizer, got SGD"):
        fmp.optim.ema(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))  # type: ignore[arg-type]
    optimizer = fmp.optim.ema(fmp.optim.sgd(0.1))
    params = mlp_params()
    state = optimizer.init(params)
    with pytest.raises(TypeError, match=r"ema got optimizer state of type tuple, expected EmaState"):
        optimizer.update(params, (), params)
    wrong_dtype = state._replace(average={**state.average, "b1": state.average["b1"].double()})
    with pytest.raises(
        ValueError, match=r"opt_state.average\['b1'\] is torch.float64\[8\], expected torch.float32\[8\]"
    ):
        optimizer.update(params, wrong_dtype, params)
    with pytest.raises(ValueError, match=r"opt_state\.average must have the params' structure"):
        optimizer.update(params, state._replace(average={"w1": state.average["w1"]}), params)
    with pytest.raises(TypeError, match=r"ema: params\['n'\] is int; it averages floating tensors"):
        optimizer.init({**params, "n": 3})
    with pytest.raises(TypeError, match=r"wrap ema outside: ema\(stochastic_rounding\(\.\.\.\)\)"):
        fmp.optim.stochastic_rounding(optimizer).init(params)


def test_params_in_another_dict_order_than_the_state_keep_the_states_order() -> None:
    # As every fmp optimizer: the new state keeps its structure, so a skipped step can keep the old one.
    optimizer = fmp.optim.ema(fmp.optim.adamw(1e-2), 0.9)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(2.0**10))
    state = state._replace(params=dict(reversed(list(state.params.items()))))
    for x, y in mlp_batches(3, 2):  # the second batch overflows
        new_state, _ = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
        assert list(new_state.opt_state.average) == list(state.opt_state.average)
        state = new_state
    assert int(state.opt_state.step) == 2
