"""Delayed FP8 scaling threaded by fmp.train_step: states beside the loss scale, skipped, compiled, vmapped, saved."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fmp
import fmp.fp8 as f8

BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
RECIPES = {nn.Linear: f8.delayed(history_len=4)}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def setup(
    model: nn.Module, scaler: fmp.LossScale, recipes: dict[Any, Any] = RECIPES, accumulation_steps: int = 1
) -> tuple[Any, fmp.TrainState, Any]:
    params, _ = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(model, params, (x,)).float() - y).square().mean()

    optimizer = fmp.optim.adamw(1e-2)
    fp8 = f8.init_states(model, recipes)
    state = fmp.TrainState.create(params, optimizer, scaler, accumulation_steps=accumulation_steps, fp8=fp8)
    step = functools.partial(fmp.train_step, f8.fp8_modules(loss_fn, model, recipes), policy=BF16, optimizer=optimizer)
    return step, state, loss_fn


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, 32, generator=generator), torch.randn(16, 16, generator=generator)


def test_the_step_records_each_layers_amaxes_unscaled_and_moves_its_scales() -> None:
    model = mlp()
    step, state, _ = setup(model, fmp.DynamicLossScale.create())
    x, y = batch()
    new, info = step(state, x, y)
    assert bool(info.applied)
    first = new.fp8["0"]
    # The step's amaxes sit in the history's last row (the rows roll up once per step).
    assert first.amax_history[-1, 0] == x.abs().max()
    assert first.amax_history[-1, 1] == model[0].weight.abs().max()
    # The output gradient's amax, unscaled: as the same loss differentiated without loss scaling.
    scales = {name: s.scale for name, s in state.fp8.items()}
    amaxes = torch.func.grad(
        lambda s: f8.fp8_modules(setup(model, fmp.NoOpLossScale())[2], model, RECIPES)(
            state.params, f8.Fp8Scales(s, torch.ones(())), x, y
        ).float()
    )(scales)
    assert torch.equal(first.amax_history[-1], amaxes["0"])
    assert not first.amax_history[:-1].any()
    assert torch.equal(first.scale, torch.tensor([448.0, 448.0, 57344.0]) / amaxes["0"])


def test_loss_scaling_leaves_a_delayed_fp8_step_bit_for_bit_as_it_is() -> None:
    # Power-of-two loss scales are exact: the gradient's cast divides its scale by the loss scale.
    x, y = batch()
    results = []
    for scaler in (fmp.NoOpLossScale(), fmp.DynamicLossScale.create(init_scale=2.0**12)):
        step, state, _ = setup(mlp(), scaler)
        for _ in range(3):
            state, _ = step(state, x, y)
        results.append((state.params, state.fp8))
    assert_trees_bitwise_equal(results[0], results[1])


def test_a_skipped_step_keeps_the_fp8_states_and_params_bit_for_bit() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    x, y = batch()
    state, _ = step(state, x, y)
    x[3, 5] = float("inf")
    new, info = step(state, x, y)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((new.params, new.opt_state, new.fp8), (state.params, state.opt_state, state.fp8))


def test_the_zoo_llama_trains_on_delayed_scaling_as_on_bfloat16() -> None:
    case = zoo.case("llama")
    model = case.build(layers=2, width=64)
    generator = torch.Generator().manual_seed(1)
    batches = [case.batch(generator, batch_size=8, seq_len=32) for _ in range(4)]
    params, buffers = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *batch: torch.Tensor) -> Any:
        return fmp.nn.call(model, params, buffers, *batch)

    losses = {}
    for name, recipes in (("bf16", None), ("fp8", {nn.Linear: f8.delayed(history_len=16)})):
        optimizer = fmp.optim.adamw(3e-3)
        fp8 = f8.init_states(model, recipes) if recipes else ()
        state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), model_state=buffers, fp8=fp8)
        loss = f8.fp8_modules(loss_fn, model, recipes) if recipes else loss_fn
        for index in range(20):
            state, info = fmp.train_step(loss, state, *batches[index % 4], policy=BF16, optimizer=optimizer)
        losses[name] = float(info.loss)
        if recipes:
            assert len(state.fp8) == 15 and all(s.amax_history.any() for s in state.fp8.values())
    assert abs(losses["fp8"] - losses["bf16"]) <= 0.02 * losses["bf16"]


def test_the_states_save_and_load_with_the_train_state(tmp_path: Path) -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    state, _ = step(state, *batch())
    fmp.serialization.save(state, tmp_path / "state.fmp")
    loaded = fmp.serialization.load(tmp_path / "state.fmp", state)
    assert isinstance(loaded.fp8["0"], f8.DelayedScalingState) and loaded.fp8["0"].amax_compute == "max"
    assert_trees_bitwise_equal(loaded, state)
    torch.save(state, tmp_path / "state.pt")
    assert_trees_bitwise_equal(torch.load(tmp_path / "state.pt", weights_only=True), state)


def test_an_ensemble_of_fp8_states_maps_under_vmap() -> None:
    model = mlp()
    step, state, _ = setup(model, fmp.DynamicLossScale.create())
    # Members of their own: other params and another loss scale.
    other = fmp.DynamicLossScale.create(init_scale=2.0**4)
    members = [state, state._replace(params={k: v * 2 for k, v in state.params.items()}, scaler=other)]
    xs, ys = torch.stack([batch(1)[0], batch(2)[0]]), torch.stack([batch(1)[1], batch(2)[1]])
    xs[1, 0, 0] = float("inf")  # member 1 alone skips, and keeps its FP8 states
    mapped, info = torch.func.vmap(step)(fmp.stack_trees(members), xs, ys)
    assert info.applied.tolist() == [True, False]
    one, _ = step(members[0], xs[0], ys[0])
    assert_trees_close(fmp.unstack_tree(mapped, 0).fp8, one.fp8, rtol=1e-6, atol=0.0)
    assert_trees_bitwise_equal(fmp.unstack_tree(mapped, 1).fp8, members[1].fp8)
    clean = xs[1].clone()
    clean[0, 0] = 0.0
    mapped, info = torch.func.vmap(step)(fmp.stack_trees(members), torch.stack([xs[0], clean]), ys)
    alone, _ = step(members[1], clean, ys[1])
    assert info.applied.tolist() == [True, True]
    assert_trees_close(fmp.unstack_tree(mapped, 1).fp8, alone.fp8, rtol=1e-6, atol=0.0)


@pytest.mark.compiled
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
def test_a_compiled_delayed_fp8_step_is_one_graph_as_scales_move_and_tracks_eager() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_state = compiled_state = state
    for seed in range(3):
        eager_state, _ = step(eager_state, *batch(seed))
        compiled_state, _ = compiled(compiled_state, *batch(seed))
    assert counter.frame_count == 1
    assert not torch.equal(compiled_state.fp8["0"].scale, state.fp8["0"].scale)
    assert_trees_close(compiled_state.fp8, eager_state.fp8, rtol=0.02, atol=0.0)
    assert_trees_close(compiled_state.params, eager_state.params, rtol=0.02, atol=2e-3)


def test_state_and_loss_function_must_agree_on_fp8() -> None:
    model = mlp()
    step, state, loss_fn = setup(model, fmp.DynamicLossScale.create())
    plain = functools.partial(fmp.train_step, loss_fn, policy=BF16, optimizer=fmp.optim.adamw(1e-2))
    with pytest.raises(TypeError, match=r"state.fp8 holds delayed-scaling states but loss_fn does not take them"):
        plain(state, *batch())
    with pytest.raises(TypeError, match=r"loss_fn runs layers with delayed FP8 scaling but state.fp8 holds no"):
        step(state._replace(fp8=()), *batch())
    with pytest.raises(KeyError, match=r"no state for the delayed-scaling layers \['2'\]"):
        step(state._replace(fp8={"0": state.fp8["0"]}), *batch())
    with pytest.raises(TypeError, match=r"TrainState.fp8 holds DelayedScalingStates"):
        fmp.TrainState.create(state.params, fmp.optim.sgd(0.1), fmp.NoOpLossScale(), fp8={"0": torch.ones(3)})


def with_layer(state: fmp.TrainState, **changes: Any) -> dict[str, f8.DelayedScalingState]:
    """`state.fp8` with layer "0"'s state changed."""
    return {**state.fp8, "0": fmp._struct.replace(state.fp8["0"], **changes)}


def test_a_corrupt_or_mismatched_fp8_state_is_refused_naming_the_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A NaN or 0 scale would skip every step from then on, as a skipped step keeps the state.
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    layer = state.fp8["0"]
    refused_by_create = {
        "scale must be finite and > 0, got \\[nan": {"scale": torch.tensor([float("nan"), 1.0, 1.0])},
        "scale must be finite and > 0, got \\[0.0": {"scale": torch.tensor([0.0, 1.0, 1.0])},
        "amax_history must be finite and >= 0": {"amax_history": -torch.ones(4, 3)},
        "scale requires grad": {"scale": layer.scale.clone().requires_grad_()},
    }
    for message, changes in refused_by_create.items():
        with pytest.raises((TypeError, ValueError), match=r"state\.fp8\['0'\]\." + message):
            fmp.TrainState.create(
                state.params, fmp.optim.sgd(0.1), fmp.NoOpLossScale(), fp8=with_layer(state, **changes)
            )
    # Refused by the step, with no host sync: a shape, or settings other than the layer's recipe.
    kept = torch.utils._pytree.tree_map(torch.clone, state)
    refused_by_step = {
        r"holds an amax_history of shape \(4, 4\)": with_layer(state, amax_history=torch.zeros(4, 4)),
        r"was made with history_len=7, but loss_fn runs the layer on history_len=4": {
            **state.fp8,
            "0": f8.delayed(history_len=7).init(),
        },
        r"was made with format='e4m3', but loss_fn runs the layer on format='hybrid'": {
            **state.fp8,
            "0": f8.delayed(history_len=4, format="e4m3").init(),
        },
        r"holds states for \['3'\], which loss_fn runs on no delayed recipe": {**state.fp8, "3": layer},
    }
    for message, fp8 in refused_by_step.items():
        with pytest.raises(ValueError, match=message):
            step(state._replace(fp8=fp8), *batch())
    assert_trees_bitwise_equal(state, kept)
    # A checkpoint that holds a NaN scale (written by a save that did not check) does not load.
    bad = state._replace(fp8=with_layer(state, scale=torch.tensor([float("nan"), 1.0, 1.0])))
    with pytest.raises(ValueError, match=r"scale must be finite and > 0"):
        fmp.serialization.save(bad, tmp_path / "bad.fmp")
    with monkeypatch.context() as patch:
        patch.setattr(fmp.serialization._file, "check_values", lambda state: None)
        fmp.serialization.save(bad, tmp_path / "bad.fmp")
    with pytest.raises(ValueError, match=r"state\.fp8\['0'\]\.scale must be finite and > 0"):
        fmp.serialization.load(tmp_path / "bad.fmp", state)


def test_with_accumulation_a_window_records_its_largest_amaxes_and_advances_once() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create(), accumulation_steps=2)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    x2 = 3 * x2
    middle, info = step(state, x1, y1)
    assert not bool(info.applied)
    assert torch.equal(middle.fp8["0"].scale, state.fp8["0"].scale)  # scales hold within a window
    assert middle.fp8["0"].amax_history[0, 0] == x1.abs().max()
    end, info = step(middle, x2, y2)
    assert bool(info.applied)
    assert end.fp8["0"].amax_history[-1, 0] == torch.maximum(x1.abs().max(), x2.abs().max())
    assert not end.fp8["0"].amax_history[0].any() and not torch.equal(end.fp8["0"].scale, state.fp8["0"].scale)
    # A window that overflows leaves the states as the window found them.
    poisoned = x1.clone()
    poisoned[0, 0] = float("inf")
    middle, _ = step(end, poisoned, y1)
    skipped, info = step(middle, x2, y2)
    assert not bool(info.applied)
    assert_trees_bitwise_equal(skipped.fp8, end.fp8)


def test_a_window_keeps_its_first_micro_batchs_amax_when_it_is_the_largest() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create(), accumulation_steps=2)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    x1 = 3 * x1
    middle, _ = step(state, x1, y1)
    end, info = step(middle, x2, y2)
    assert bool(info.applied) and end.fp8["0"].amax_history[-1, 0] == x1.abs().max()


def test_a_float32_policy_without_op_rules_threads_the_states() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    whole_f32 = fmp.get_policy("params=float32,compute=float32,output=float32,rules=none")
    new, info = step(state, *batch(), policy=whole_f32)
    assert bool(info.applied) and not torch.equal(new.fp8["0"].scale, state.fp8["0"].scale)


def test_a_reduce_grads_hook_gets_the_amaxes_and_must_give_them_back() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    seen = []
    plain, _ = step(state, *batch())
    hooked, _ = step(state, *batch(), reduce_grads=lambda g: seen.append(g.amaxes) or g)
    assert_trees_bitwise_equal(hooked, plain)
    assert set(seen[0]) == {"0", "2"} and seen[0]["0"].shape == (3,)
    with pytest.raises(TypeError, match=r"reduce_grads must keep Gradients.amaxes"):
        step(state, *batch(), reduce_grads=lambda g: g._replace(amaxes=()))


def test_a_huge_loss_scale_does_not_make_a_finite_step_look_overflowed() -> None:
    # The input's amax times the loss scale passes float32's largest; every gradient stays finite.
    model = nn.Sequential(nn.Linear(32, 16))
    params, _ = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(model, params, (x,)).float() * 1e-10).sum()

    optimizer = fmp.optim.sgd(1e-3)
    state = fmp.TrainState.create(
        params, optimizer, fmp.StaticLossScale.create(2.0**110), fp8=f8.init_states(model, RECIPES)
    )
    x = 1e6 * batch()[0]
    new, info = fmp.train_step(f8.fp8_modules(loss_fn, model, RECIPES), state, x, policy=BF16, optimizer=optimizer)
    assert bool(info.applied)
    assert new.fp8["0"].amax_history[-1, 0] == torch.finfo(torch.float32).max / 2.0**110


def test_a_policy_that_casts_params_whole_to_16_bits_is_refused_by_name() -> None:
    step, state, _ = setup(mlp(), fmp.DynamicLossScale.create())
    whole = fmp.get_policy("params=float32,compute=float16,output=float32,rules=none")
    with pytest.raises(ValueError, match=r"casts params whole to torch.float16 \(rules=None\)"):
        step(state, *batch(), policy=whole)


def two_losses(model: nn.Module, swapped: bool = False) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = torch.func.functional_call(model, params, (x,)).float()
        losses = (out - y).square().mean(), 50 * (out - 2 * y).abs().mean()
        return losses[::-1] if swapped else losses

    return loss_fn


@pytest.mark.parametrize("swapped", [False, True], ids=["larger-last", "larger-first"])
def test_several_losses_record_the_largest_output_gradient_amax_of_their_passes(swapped: bool) -> None:
    model = mlp()
    params, _ = fmp.nn.split(model)
    fp8_fn = f8.fp8_modules(two_losses(model, swapped), model, RECIPES)
    optimizer = fmp.optim.adamw(1e-2)
    fp8 = f8.init_states(model, RECIPES)
    x, y = batch()
    results = []
    # Power-of-two scales, different per loss: exact, so the step is the step without loss scaling.
    for scalers in [
        (fmp.NoOpLossScale(), fmp.NoOpLossScale()),
        (fmp.DynamicLossScale.create(init_scale=2.0**14), fmp.DynamicLossScale.create(init_scale=2.0**3)),
    ]:
        state = fmp.TrainState.create(params, optimizer, scalers, fp8=fp8)
        new, info = fmp.train_step(fp8_fn, state, x, y, policy=BF16, optimizer=optimizer)
        assert bool(info.applied)
        results.append((new.params, new.fp8))
    assert_trees_bitwise_equal(results[0], results[1])
    # Each loss's pass quantizes its own output gradient: the history keeps the larger amax.
    scales = {name: s.scale for name, s in fp8.items()}
    per_loss = [
        torch.func.grad(lambda s, i=i: fmp.with_policy(fp8_fn, BF16)(params, f8.Fp8Scales(s, torch.ones(())), x, y)[i])(
            scales
        )
        for i in range(2)
    ]
    assert not torch.equal(per_loss[0]["0"][2], per_loss[1]["0"][2])
    for name, state in results[0][1].items():
        assert torch.equal(state.amax_history[-1], torch.maximum(per_loss[0][name], per_loss[1][name]))
    assert results[0][1]["0"].amax_history[-1, 0] == x.abs().max()  # the input's, not the sum of two passes'


def test_with_several_losses_an_overflow_in_one_skips_the_step_and_keeps_the_states() -> None:
    model = mlp()
    params, _ = fmp.nn.split(model)
    fp8_fn = f8.fp8_modules(two_losses(model), model, RECIPES)
    optimizer = fmp.optim.adamw(1e-2)
    scalers = (fmp.DynamicLossScale.create(init_scale=2.0**14), fmp.DynamicLossScale.create(init_scale=2.0**127))
    state = fmp.TrainState.create(params, optimizer, scalers, fp8=f8.init_states(model, RECIPES))
    new, info = fmp.train_step(fp8_fn, state, *batch(), policy=BF16, optimizer=optimizer)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((new.params, new.opt_state, new.fp8), (state.params, state.opt_state, state.fp8))
    assert new.scaler[0].loss_scale == 2.0**14 and new.scaler[1].loss_scale == 2.0**126


def test_with_several_losses_an_input_that_only_the_fp8_cast_saturates_skips_the_step() -> None:
    # The FP8 cast saturates an inf input, so only the amax is non-finite: it must skip the step.
    model = mlp()
    params, _ = fmp.nn.split(model)
    fp8_fn = f8.fp8_modules(two_losses(model), model, RECIPES)
    optimizer = fmp.optim.adamw(1e-2)
    state = fmp.TrainState.create(params, optimizer, (fmp.NoOpLossScale(),) * 2, fp8=f8.init_states(model, RECIPES))
    x, y = batch()
    x[3, 5] = float("inf")
    new, info = fmp.train_step(fp8_fn, state, x, y, policy=BF16, optimizer=optimizer)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((new.params, new.opt_state, new.fp8), (state.params, state.opt_state, state.fp8))


def test_bfloat16_params_thread_float32_scales() -> None:
    model = mlp()
    half = fmp.get_policy("params=bfloat16,compute=bfloat16,output=float32")
    params = half.cast_to_param(fmp.nn.split(model)[0])
    _, _, loss_fn = setup(model, fmp.NoOpLossScale())
    optimizer = fmp.optim.adamw(1e-2)
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), fp8=f8.init_states(model, RECIPES))
    step = functools.partial(fmp.train_step, f8.fp8_modules(loss_fn, model, RECIPES), policy=half, optimizer=optimizer)
    x, y = batch()
    new, info = step(state, x, y)
    assert bool(info.applied)
    assert all(p.dtype == torch.bfloat16 for p in new.params.values())
    first = new.fp8["0"]
    assert first.scale.dtype == torch.float32 and first.amax_history.dtype == torch.float32
    assert first.amax_history[-1, 0] == x.abs().max()
    assert first.amax_history[-1, 1] == params["0.weight"].abs().max()
    assert not torch.equal(first.scale, state.fp8["0"].scale)
    x[0, 0] = float("nan")
    skipped, info = step(new, x, y)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((skipped.params, skipped.fp8), (new.params, new.fp8))
