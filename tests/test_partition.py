"""fmp.optim.partition against torch.optim's param groups."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import bits
from torch._dynamo.testing import CompileCounterWithBackend

import fmp


def decays(name: str, param: torch.Tensor) -> str:
    return "decay" if param.dim() >= 2 else "no_decay"


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(steps)]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_groups_match_torch_param_groups_bit_for_bit(kind: str) -> None:
    model, reference = make_model(), make_model()
    if kind == "adamw":  # no weight decay on biases and norms, the usual transformer recipe
        optimizer = fmp.optim.partition(
            {"decay": fmp.optim.adamw(1e-2, weight_decay=0.1), "no_decay": fmp.optim.adamw(1e-2, weight_decay=0.0)},
            decays,
        )
        groups = [
            {"params": [p for p in reference.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        torch_optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=1e-2)
    else:  # another learning rate and momentum for the last layer
        optimizer = fmp.optim.partition(
            {"body": fmp.optim.sgd(0.1, 0.9), "head": fmp.optim.sgd(0.01)},
            lambda name, p: "head" if name.startswith("2.") else "body",
        )
        head = [p for name, p in reference.named_parameters() if name.startswith("2.")]
        body = [p for name, p in reference.named_parameters() if not name.startswith("2.")]
        torch_optimizer = torch.optim.SGD([{"params": body, "momentum": 0.9}, {"params": head, "lr": 0.01}], lr=0.1)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())
    for x, y in batches(3):
        state, _ = fmp.train_step(loss_fn, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    for name, p in reference.named_parameters():
        assert torch.equal(bits(state.params[name]), bits(p.detach())), name
    assert sorted(state.opt_state) == sorted(optimizer.init(params))


def test_a_skipped_step_keeps_every_groups_state_and_a_clip_spans_the_groups() -> None:
    model = make_model()
    groups = {"decay": fmp.optim.adamw(1e-2, weight_decay=0.1), "no_decay": fmp.optim.adamw(1e-2, weight_decay=0.0)}
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.partition(groups, decays), 0.1)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    state = fmp.TrainState.create(
        {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer, fmp.DynamicLossScale.create()
    )
    (x, y), (x2, y2) = batches(2)
    state, info = fmp.train_step(loss_fn, state, x, y, policy=fmp.Policy(), optimizer=optimizer, grad_norm=True)
    assert bool(info.applied) and float(info.grad_norm) > 0.1  # the clip binds, over both groups
    x2[0, 0] = float("nan")
    skipped, info = fmp.train_step(loss_fn, state, x2, y2, policy=fmp.Policy(), optimizer=optimizer)
    assert not bool(info.applied)
    assert_trees_bitwise_equal((skipped.params, skipped.opt_state), (state.params, state.opt_state))
    assert int(state.opt_state["decay"].step) == int(state.opt_state["no_decay"].step) == 1


def test_labels_see_names_as_named_parameters_gives_them() -> None:
    # Nested dicts and lists are named with dots, as model.named_parameters() names a ModuleList's.
    params = {"layers": [{"weight": torch.ones(2, 2)}, {"weight": torch.ones(2, 2)}], "head": (torch.ones(2),)}
    seen: list[str] = []

    def label(name: str, param: torch.Tensor) -> str:
        seen.append(name)
        return "frozen" if name.startswith("layers.0.") else "trained"

    optimizer = fmp.optim.partition({"frozen": fmp.optim.sgd(0.0), "trained": fmp.optim.sgd(1.0)}, label)
    new, _ = optimizer.update(torch.utils._pytree.tree_map(torch.ones_like, params), optimizer.init(params), params)
    assert sorted(set(seen)) == ["head.0", "layers.0.weight", "layers.1.weight"]
    assert torch.equal(new["layers"][0]["weight"], params["layers"][0]["weight"])
    assert not torch.equal(new["layers"][1]["weight"], params["layers"][1]["weight"])


def test_bad_groups_are_named() -> None:
    sgd = fmp.optim.sgd(0.1)
    params: dict[str, Any] = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match="non-empty dict of fmp optimizers"):
        fmp.optim.partition({}, decays)
    with pytest.raises(TypeError, match=r"optimizers\['a'\] must be an fmp\.optim\.Optimizer, got SGD"):
        fmp.optim.partition({"a": torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)}, decays)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="label must be a function"):
        fmp.optim.partition({"decay": sgd}, "decay")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"label\('b', \.\.\.\) returned 'no_decay', which is not a group of \['decay'\]"
    ):
        fmp.optim.partition({"decay": sgd}, decays).init(params)
    with pytest.raises(TypeError, match=r"label\('w', \.\.\.\) must return a group name \(str\), got int"):
        fmp.optim.partition({"decay": sgd}, lambda name, p: 0).init(params)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"two parameters are both named 'a\.b'"):
        fmp.optim.partition({"decay": sgd}, lambda name, p: "decay").init(
            {"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}
        )
    optimizer = fmp.optim.partition({"decay": sgd, "no_decay": sgd}, decays)
    with pytest.raises(TypeError, match=r"partition got optimizer state tuple, expected a dict of the groups"):
        optimizer.update(params, (), params)


def test_a_state_saved_with_the_groups_listed_the_other_way_round_steps_on() -> None:
    model = make_model()
    decay, no_decay = fmp.optim.adamw(1e-2, weight_decay=0.1), fmp.optim.adamw(1e-2, weight_decay=0.0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = fmp.optim.partition({"decay": decay, "no_decay": no_decay}, decays).init(params)
    optimizer = fmp.optim.partition({"no_decay": no_decay, "decay": decay}, decays)
    state = fmp.TrainState.create(params, optimizer, fmp.NoOpLossScale())._replace(opt_state=saved)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    new_state, info = fmp.train_step(loss_fn, state, *batches(1)[0], policy=fmp.Policy(), optimizer=optimizer)
    assert bool(info.applied) and list(new_state.opt_state) == ["decay", "no_decay"]


@pytest.mark.compiled
def test_a_compiled_donated_step_with_groups_is_one_graph_and_matches_eager() -> None:
    # torch.compile of any functools.partial shares one code object; a fresh Dynamo keeps what
    # earlier tests compiled (their automatic dynamic shapes) from restarting this compile.
    torch._dynamo.reset()
    model = make_model()
    groups = {"decay": fmp.optim.adamw(1e-2, weight_decay=0.1), "no_decay": fmp.optim.sgd(1e-2, 0.9)}
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.partition(groups, decays), 1.0)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    def fresh() -> fmp.TrainState:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())

    counter = CompileCounterWithBackend("inductor")
    step = functools.partial(fmp.train_step, loss_fn, policy=fmp.Policy(), optimizer=optimizer)
    compiled = torch.compile(functools.partial(step, donate=True), backend=counter, fullgraph=True)
    eager_state, state = fresh(), fresh()
    for index, (x, y) in enumerate(batches(4)):
        if index == 2:
            x[0, 0] = float("inf")
        eager_state, _ = step(eager_state, x, y)
        state, info = compiled(state, x, y)
        assert bool(info.applied) == (index != 2)
    assert counter.frame_count == 1
    assert_trees_close(
        (state.params, state.opt_state), (eager_state.params, eager_state.opt_state), **TOLERANCES[torch.float32]
    )
