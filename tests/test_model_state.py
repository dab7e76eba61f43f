"""Model state through train_step (BatchNorm statistics as state) and fmp.nn's split, call and write_back."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

NATIVE = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=cpu")
PYTHON_MODE = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
WHOLE_CAST = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=none")
ADAMW = fmp.optim.adamw(1e-3)


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


MODEL = _cnn()


def _loss(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
    logits, buffers = fmp.nn.call(MODEL, params, buffers, x)
    return F.cross_entropy(logits, y), buffers


def _state(seed: int = 0, scaler: fmp.LossScale | None = None) -> fmp.TrainState:
    params, buffers = fmp.nn.split(_cnn(seed))
    scaler = fmp.DynamicLossScale.create() if scaler is None else scaler
    return fmp.TrainState.create(params, ADAMW, scaler, model_state=buffers)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 12, 12, generator=gen), torch.randint(0, 10, (4,), generator=gen)) for _ in range(n)]


def _copy(tree: Any) -> Any:
    return pytree.tree_map(torch.clone, tree)


def test_the_step_matches_torch_amp_bit_for_bit_with_statistics_moving_on_a_skipped_step() -> None:
    reference = _cnn()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    state = _state()
    state = state._replace(params=_copy(state.params), model_state=_copy(state.model_state))
    batches = _batches(4)
    batches[2][0][0, 0, 0, 0] = float("inf")  # both skip this step; BatchNorm's statistics still move
    for x, y in batches:
        before = _copy(state.params)
        state, info = fmp.train_step(_loss, state, x, y, policy=NATIVE, optimizer=ADAMW)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(reference(x), y)
        torch.testing.assert_close(info.loss, loss.detach(), rtol=0, atol=0, equal_nan=True)
        assert float(info.loss_scale) == scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if not bool(info.applied):
            assert_trees_bitwise_equal(state.params, before)
    assert state.counts.skipped.item() == 1
    assert_trees_bitwise_equal(state.params, {k: v.detach() for k, v in reference.named_parameters()})
    assert_trees_bitwise_equal(state.model_state, {k: v for k, v in reference.named_buffers()})
    assert int(state.model_state["1.num_batches_tracked"]) == 4


def test_the_step_is_pure_and_returns_state_in_its_dtypes_under_every_policy() -> None:
    state = _state()
    kept = _copy(state)
    x, y = _batches(1)[0]
    for policy in (NATIVE, PYTHON_MODE, WHOLE_CAST):
        new, info = fmp.train_step(_loss, state, x, y, policy=policy, optimizer=ADAMW)
        assert bool(info.applied)
        assert_trees_bitwise_equal(state, kept)  # nothing written into the given state
        for name, value in new.model_state.items():
            assert value.dtype == kept.model_state[name].dtype
        # A whole cast (rules None) once dropped the statistics: they move under every policy.
        assert not torch.equal(new.model_state["1.running_mean"], kept.model_state["1.running_mean"])
        assert int(new.model_state["5.num_batches_tracked"]) == 1


def test_the_statistics_match_a_module_run_in_train_mode() -> None:
    model = _cnn()
    state = _state()
    x, y = _batches(1)[0]
    new, _ = fmp.train_step(_loss, state, x, y, policy=fmp.Policy(), optimizer=ADAMW)
    model(x)
    assert_trees_close(new.model_state, dict(model.named_buffers()), **TOLERANCES[torch.float32])


def test_with_aux_and_accumulation_the_statistics_move_every_micro_batch() -> None:
    params, buffers = fmp.nn.split(_cnn())

    def loss_with_aux(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        logits, buffers = fmp.nn.call(MODEL, params, buffers, x)
        return (F.cross_entropy(logits, y), logits.argmax(-1)), buffers

    state = fmp.TrainState.create(
        params, ADAMW, fmp.DynamicLossScale.create(), accumulation_steps=2, model_state=buffers
    )
    for x, y in _batches(4):
        state, info = fmp.train_step(loss_with_aux, state, x, y, policy=NATIVE, optimizer=ADAMW, has_aux=True)
        assert info.aux.shape == (4,)
    assert int(state.model_state["1.num_batches_tracked"]) == 4
    assert int(state.counts.applied) == 2


def test_a_donated_step_returns_the_pure_steps_model_state() -> None:
    # Eager, the model state comes back new (as the scaler does); compiled, it lands in the donated buffers.
    state = _state()
    x, y = _batches(1)[0]
    expected, _ = fmp.train_step(_loss, _copy(state), x, y, policy=fmp.Policy(), optimizer=ADAMW)
    new, _ = fmp.train_step(_loss, state, x, y, policy=fmp.Policy(), optimizer=ADAMW, donate=True)
    assert_trees_bitwise_equal(new, expected)


def test_vmap_over_an_ensemble_keeps_each_members_statistics() -> None:
    # SGD: Adam's first step is lr * sign(gradient), and the conv biases before BatchNorm have
    # gradients at rounding level, whose sign differs between a batched and a single run.
    sgd = fmp.optim.sgd(0.1)
    members = [
        fmp.TrainState.create(p, sgd, fmp.NoOpLossScale(), model_state=b)
        for p, b in map(fmp.nn.split, map(_cnn, (0, 1)))
    ]
    xs = torch.stack([x for x, _ in _batches(2)])
    ys = torch.stack([y for _, y in _batches(2)])
    step = functools.partial(fmp.train_step, _loss, policy=fmp.Policy(), optimizer=sgd)
    stacked, info = torch.func.vmap(step)(fmp.stack_trees(members), xs, ys)
    for i, member in enumerate(members):
        alone, alone_info = step(member, xs[i], ys[i])
        assert_trees_close(fmp.unstack_tree(stacked.model_state, i), alone.model_state, **TOLERANCES[torch.float32])
        assert_trees_close(fmp.unstack_tree(stacked.params, i), alone.params, **TOLERANCES[torch.float32])
        torch.testing.assert_close(info.loss[i], alone_info.loss, **TOLERANCES[torch.float32])


@pytest.mark.compiled
@pytest.mark.parametrize("policy", [NATIVE, PYTHON_MODE], ids=["native", "python-mode"])
def test_compiled_steps_with_max_pooling_track_eager_and_do_not_recompile(policy: fmp.Policy) -> None:
    # The Python mode's max pooling (a boolean_dispatch composite) once ended the graph.
    torch._dynamo.reset()
    # aot_eager traces forward and backward as Inductor does (graph breaks, recompiles) without its code generation.
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        functools.partial(fmp.train_step, _loss, policy=policy, optimizer=ADAMW), backend=counter, fullgraph=True
    )
    eager_state = compiled_state = _state(scaler=fmp.DynamicLossScale.create(growth_interval=1))
    batches = _batches(4)
    batches[1][0][0, 0, 0, 0] = float("nan")
    for x, y in batches:
        eager_state, eager_info = fmp.train_step(_loss, eager_state, x, y, policy=policy, optimizer=ADAMW)
        compiled_state, info = compiled(compiled_state, x, y)
        assert bool(info.applied) == bool(eager_info.applied)
        assert_trees_bitwise_equal(compiled_state.scaler, eager_state.scaler)
        assert_trees_close(compiled_state.params, eager_state.params, **TOLERANCES[torch.bfloat16])
        # A NaN batch makes NaN statistics, as in a torch.nn module: the same in both.
        assert_trees_close(
            compiled_state.model_state, eager_state.model_state, equal_nan=True, **TOLERANCES[torch.bfloat16]
        )
    assert counter.frame_count == 1  # the scale moved both ways in one graph


def test_a_loss_function_that_breaks_the_contract_is_named() -> None:
    state = _state()
    x, y = _batches(1)[0]

    def run(loss_fn: Callable[..., Any]) -> None:
        fmp.train_step(loss_fn, state, x, y, policy=fmp.Policy(), optimizer=ADAMW)

    with pytest.raises(TypeError, match=r"must return \(out, new_model_state\).*got Tensor"):
        run(lambda p, b, x, y: _loss(p, b, x, y)[0])
    with pytest.raises(TypeError, match=r"must have the structure of state.model_state"):
        run(lambda p, b, x, y: (_loss(p, b, x, y)[0], {}))
    with pytest.raises(ValueError, match=r"new_model_state\['1.running_mean'\] has shape \(3,\)"):
        run(lambda p, b, x, y: (_loss(p, b, x, y)[0], {**b, "1.running_mean": torch.zeros(3)}))
    with pytest.raises(TypeError, match=r"new_model_state\['1.running_mean'\] is a float"):
        run(lambda p, b, x, y: (_loss(p, b, x, y)[0], {**b, "1.running_mean": 0.0}))
    with pytest.raises(TypeError, match=r"with has_aux=True, loss_fn's out must be \(loss, aux\)"):
        fmp.train_step(_loss, state, x, y, policy=fmp.Policy(), optimizer=ADAMW, has_aux=True)


def test_model_state_that_autograd_tracks_or_is_no_tensor_is_refused() -> None:
    params, buffers = fmp.nn.split(_cnn())
    with pytest.raises(TypeError, match=r"model_state\['1.running_mean'\] requires grad: model state is not trained"):
        fmp.TrainState.create(
            params, ADAMW, fmp.NoOpLossScale(), model_state={**buffers, "1.running_mean": nn.Parameter(torch.zeros(8))}
        )
    with pytest.raises(TypeError, match=r"model_state\['n'\] is a int"):
        fmp.TrainState.create(params, ADAMW, fmp.NoOpLossScale(), model_state={"n": 3})


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.encoder = nn.Linear(8, 8).requires_grad_(False)  # frozen, as a pretrained part
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(self.embed(tokens)) + self.table)
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def test_split_lists_tied_weights_once_leaves_frozen_and_non_persistent_tensors_and_training_keeps_ties() -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    frozen = model.encoder.weight.detach().clone()
    params, buffers = fmp.nn.split(model)
    assert sorted(params) == ["embed.weight"] and buffers == {}
    assert params["embed.weight"].data_ptr() == model.embed.weight.data_ptr()

    def loss_fn(params: Any, buffers: Any, tokens: torch.Tensor) -> Any:
        return fmp.nn.call(model, params, buffers, tokens)

    state = fmp.TrainState.create(_copy(params), ADAMW, fmp.DynamicLossScale.create(), model_state=buffers)
    tokens = torch.randint(0, 16, (4, 5))
    for _ in range(2):
        state, info = fmp.train_step(loss_fn, state, tokens, policy=NATIVE, optimizer=ADAMW)
        assert bool(info.applied)
    fmp.nn.write_back(model, state.params, state.model_state)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, state.params["embed.weight"])
    assert torch.equal(model.encoder.weight, frozen)


def test_tied_weights_train_as_under_torch_amp() -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    reference = copy.deepcopy(model)
    assert reference.head.weight is reference.embed.weight
    params, buffers = fmp.nn.split(model)
    state = fmp.TrainState.create(_copy(params), ADAMW, fmp.DynamicLossScale.create(), model_state=buffers)
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 16, (4, 5), generator=gen)
        state, _ = fmp.train_step(
            lambda p, b, t: fmp.nn.call(model, p, b, t), state, tokens, policy=NATIVE, optimizer=ADAMW
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(tokens)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert torch.equal(state.params["embed.weight"], reference.embed.weight.detach())


def test_call_and_write_back_name_what_does_not_fit() -> None:
    model = _cnn()
    params, buffers = fmp.nn.split(model)
    with pytest.raises(TypeError, match=r"fmp.nn.split needs an nn.Module, got dict"):
        fmp.nn.split(params)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'0.weight' is both in params and in buffers"):
        fmp.nn.call(model, params, {"0.weight": params["0.weight"]}, torch.randn(1, 3, 8, 8))
    with pytest.raises(KeyError, match=r"no parameter or buffer named 'head.weight'"):
        fmp.nn.write_back(model, {"head.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'0.bias' has shape \(3,\), the module's \(8,\)"):
        fmp.nn.write_back(model, {"0.bias": torch.zeros(3)})
    trained = {name: value + 1 for name, value in params.items()}
    fmp.nn.write_back(model, trained, {name: value + 1 for name, value in buffers.items()})
    assert torch.equal(model[0].bias, trained["0.bias"])
    assert int(model[1].num_batches_tracked) == 1
