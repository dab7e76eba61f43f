"""fmp.fp8.fp8_modules: chosen linear layers of real models in FP8 inside fmp.train_step, against the bfloat16 run."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import zoo
from conftest import assert_trees_bitwise_equal
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fmp
import fmp.fp8 as f8

BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
STEPS = 20
# The FP8 run's last loss within this fraction of the bfloat16 run's, from the same weights and batches.
MARGIN = 0.02


def train(model: nn.Module, batches: list[tuple[torch.Tensor, ...]], recipe: f8.Fp8Recipe | None) -> list[float]:
    params, buffers = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *batch: torch.Tensor) -> Any:
        return fmp.nn.call(model, params, buffers, *batch)  # zoo models return their loss

    if recipe is not None:
        loss_fn = f8.fp8_modules(loss_fn, model, {nn.Linear: recipe})
    optimizer = fmp.optim.adamw(3e-3)
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), model_state=buffers)
    losses = []
    for index in range(STEPS):
        state, info = fmp.train_step(loss_fn, state, *batches[index % len(batches)], policy=BF16, optimizer=optimizer)
        assert bool(info.applied)
        losses.append(float(info.loss))
    return losses


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, list[tuple[torch.Tensor, ...]], list[float]]:
    case = zoo.case("llama")
    model = case.build(layers=2, width=64)
    generator = torch.Generator().manual_seed(1)
    batches = [case.batch(generator, batch_size=8, seq_len=32) for _ in range(4)]
    return model, batches, train(model, batches, None)


@pytest.mark.parametrize("recipe", [f8.tensorwise(), f8.rowwise(), f8.mxfp8(), f8.blockwise(32)], ids=lambda r: r.name)
def test_llama_trains_in_fp8_within_a_stated_margin_of_bfloat16(llama: Any, recipe: f8.Fp8Recipe) -> None:
    model, batches, bf16_losses = llama
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = train(model, batches, recipe)
    assert losses[-1] < losses[0] - 0.3  # it learns
    assert abs(losses[-1] - bf16_losses[-1]) <= MARGIN * bf16_losses[-1]
    assert losses != bf16_losses  # the matmuls did run in FP8
    # The model is left as it was: same parameters, same names, its own forwards.
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not any("forward" in m.__dict__ for m in model.modules())


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def test_a_name_pattern_puts_only_the_layers_it_names_in_fp8() -> None:
    model, x = two_layers(), torch.randn(16, 32)
    only_first = f8.fp8_modules(lambda x: model(x), model, {"0": f8.tensorwise()})(x)
    first = f8.fp8_linear(x, model[0].weight, model[0].bias, recipe=f8.tensorwise())
    assert torch.equal(only_first, model[2](model[1](first)))


def test_the_first_matching_key_wins() -> None:
    model, x = two_layers(), torch.randn(16, 32)
    recipes = {"2": f8.rowwise(), nn.Linear: f8.tensorwise()}
    out = f8.fp8_modules(lambda x: model(x), model, recipes)(x)
    hidden = model[1](f8.fp8_linear(x, model[0].weight, model[0].bias, recipe=f8.tensorwise()))
    assert torch.equal(out, f8.fp8_linear(hidden, model[2].weight, model[2].bias, recipe=f8.rowwise()))


@pytest.mark.parametrize(
    ("recipes", "error", "message"),
    [
        ({nn.ReLU: f8.tensorwise()}, TypeError, r"matched '1', a ReLU with a forward of its own: only nn.Linear"),
        ({nn.Linear: "tensorwise"}, TypeError, r"must be an fmp.fp8 recipe .* got str"),
        ({"blocks.*": f8.tensorwise()}, ValueError, "pattern 'blocks.*' matches no module"),
        ({nn.Conv2d: f8.tensorwise()}, ValueError, "the keys match no nn.Linear"),
        ({3: f8.tensorwise()}, TypeError, "neither an nn.Module subclass nor a name pattern"),
        ({}, TypeError, "non-empty mapping"),
    ],
)
def test_fp8_modules_refuses_what_it_cannot_run(recipes: dict[Any, Any], error: type, message: str) -> None:
    model = two_layers()
    with pytest.raises(error, match=message):
        f8.fp8_modules(lambda x: model(x), model, recipes)


def test_fp8_modules_and_module_policies_over_one_layer_refuse_to_nest() -> None:
    model = two_layers()
    inner = fmp.autocast.module_policies(lambda x: model(x), model, {"0": fmp.get_policy("f32")})
    with pytest.raises(RuntimeError, match=r"module '0' is already under module_policies or another call"):
        f8.fp8_modules(inner, model, {"0": f8.tensorwise()})(torch.randn(2, 32))


@pytest.mark.compiled
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
def test_a_compiled_train_step_with_fp8_layers_is_one_graph_and_tracks_eager() -> None:
    model, x, target = two_layers(), torch.randn(32, 32), torch.randn(32, 16)
    params, _ = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(model, params, (x,)).float() - target).square().mean()

    optimizer = fmp.optim.adamw(1e-2)
    step = functools.partial(
        fmp.train_step, f8.fp8_modules(loss_fn, model, {nn.Linear: f8.tensorwise()}), policy=BF16, optimizer=optimizer
    )
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_state = compiled_state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    for _ in range(3):
        eager_state, eager_info = step(eager_state, x, target)
        compiled_state, compiled_info = compiled(compiled_state, x, target)
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled_info.loss, eager_info.loss, rtol=0.02, atol=0.0)
    for name in params:
        torch.testing.assert_close(compiled_state.params[name], eager_state.params[name], rtol=0.02, atol=2e-3)


def test_a_model_with_attention_takes_a_class_key_and_runs_its_linear_layers_in_fp8() -> None:
    # nn.MultiheadAttention's out_proj is a subclass of nn.Linear whose weight its parent reads directly.
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    x = torch.randn(2, 8, 32)
    out = f8.fp8_modules(lambda x: model(x), model, {nn.Linear: f8.tensorwise()})(x)
    assert out.shape == (2, 8, 32) and not torch.equal(out, model(x))


class DoubledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_linear_subclass_with_a_forward_of_its_own_is_refused_by_name() -> None:
    model = nn.Sequential(DoubledLinear(32, 16))
    with pytest.raises(TypeError, match=r"matched '0', a DoubledLinear with a forward of its own"):
        f8.fp8_modules(lambda x: model(x), model, {nn.Linear: f8.tensorwise()})


def test_delayed_and_current_scaling_mix_in_one_model() -> None:
    model, x = two_layers(), torch.randn(16, 32)
    recipes = {"0": f8.delayed(4), "2": f8.rowwise()}
    states = f8.init_states(model, recipes)
    assert set(states) == {"0"}
    scales = f8.Fp8Scales({"0": states["0"].scale}, torch.ones(()))
    out = f8.fp8_modules(lambda p, x: model(x), model, recipes)({}, scales, x)
    hidden = model[1](f8.fp8_linear(x, model[0].weight, model[0].bias, recipe=recipes["0"], scales=scales.scales["0"]))
    assert torch.equal(out, f8.fp8_linear(hidden, model[2].weight, model[2].bias, recipe=f8.rowwise()))


def test_a_delayed_layer_that_runs_twice_in_a_call_is_refused_by_name() -> None:
    layer = nn.Linear(16, 16)
    model = nn.Sequential(layer)
    recipes = {nn.Linear: f8.delayed(4)}
    scales = f8.Fp8Scales({"0": f8.init_states(model, recipes)["0"].scale}, torch.ones(()))
    twice = f8.fp8_modules(lambda p, x: model(model(x)), model, recipes)
    with pytest.raises(RuntimeError, match=r"the delayed-scaling layer '0' ran twice in one call"):
        twice({}, scales, torch.randn(4, 16))


class RematBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.beside = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.inner(x))


class OuterBlock(nn.Module):
    def __init__(self, remat: bool) -> None:
        super().__init__()
        self.block, self.out, self.remat = RematBlock(), nn.Linear(32, 32), remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(fmp.remat.remat(self.block)(x) if self.remat else self.block(x))


class RematModel(nn.Module):
    """`shape`: "flat" (one block), "nested" (a block inside a block) or "beside" (a layer of the
    block run outside it, after it)."""

    def __init__(self, remat: bool, shape: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.outer, self.head, self.remat, self.shape = (
            OuterBlock(remat and shape == "nested"),
            nn.Linear(32, 16),
            remat,
            shape,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.outer if self.shape == "nested" else self.outer.block
        h = fmp.remat.remat(block)(x) if self.remat else block(x)
        return self.head(self.outer.block.beside(h) if self.shape == "beside" else h)


def remat_step(model: nn.Module, recipes: dict[Any, Any]) -> tuple[Any, fmp.TrainState]:
    params, _ = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).float().square().mean()

    optimizer = fmp.optim.sgd(0.1)
    scaler = fmp.DynamicLossScale.create(init_scale=2.0**10)
    state = fmp.TrainState.create(params, optimizer, scaler, fp8=f8.init_states(model, recipes))
    step = functools.partial(fmp.train_step, f8.fp8_modules(loss_fn, model, recipes), policy=BF16, optimizer=optimizer)
    return step, state


@pytest.mark.parametrize(
    ("recipe", "shape"),
    [(f8.tensorwise(), "flat"), (f8.delayed(4), "flat"), (f8.delayed(4), "nested"), (f8.delayed(4), "beside")],
    ids=["tensorwise", "delayed", "delayed-nested", "delayed-beside"],
)
def test_inside_remat_fp8_layers_train_bit_for_bit_as_outside(recipe: Any, shape: str) -> None:
    recipes = {nn.Linear: recipe}
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    results = []
    for remat in (False, True):
        step, state = remat_step(RematModel(remat, shape), recipes)
        for _ in range(2):
            state, info = step(state, x)
            assert bool(info.applied)
        results.append((state.params, state.fp8))
    assert_trees_bitwise_equal(results[0], results[1])
    if isinstance(recipe, f8.DelayedScaling):
        assert results[1][1]["outer.block.inner"].amax_history[-1, 0] == x.abs().max()


def head_bias_jvp(model: nn.Module, recipes: dict[Any, Any], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    params, _ = fmp.nn.split(model)
    fn = f8.fp8_modules(lambda p, x: torch.func.functional_call(model, p, (x,)).sum(), model, recipes)
    scales = f8.Fp8Scales({n: s.scale for n, s in f8.init_states(model, recipes).items()}, torch.ones(()))
    bias = params["head.bias"]
    return torch.func.jvp(lambda b: fn({**params, "head.bias": b}, scales, x), (bias,), (torch.ones(16),))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp's first use
def test_a_forward_mode_derivative_through_a_remat_block_with_a_delayed_layer() -> None:
    recipes = {nn.Linear: f8.delayed(4)}
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    plain, rematerialized = (head_bias_jvp(RematModel(remat, "flat"), recipes, x) for remat in (False, True))
    assert_trees_bitwise_equal(plain, rematerialized)


class TwiceThroughRemat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(fmp.remat.remat(self.inner)(x))


class TwiceInRemat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.inner(x)))


class RematTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = TwiceInRemat()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fmp.remat.remat(self.block)(x)


@pytest.mark.parametrize(
    ("model", "layer"), [(TwiceThroughRemat(), "inner"), (RematTwice(), "block.inner")], ids=["through", "inside"]
)
def test_a_delayed_layer_run_twice_through_or_inside_a_remat_block_is_refused(model: nn.Module, layer: str) -> None:
    recipes = {nn.Linear: f8.delayed(4)}
    params, _ = fmp.nn.split(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).float().sum()

    scales = f8.Fp8Scales({layer: f8.delayed(4).init().scale.requires_grad_()}, torch.ones(()))
    with pytest.raises(RuntimeError, match=rf"the delayed-scaling layer '{layer}' ran twice in one call"):
        f8.fp8_modules(loss_fn, model, recipes)(params, scales, torch.randn(4, 8))
