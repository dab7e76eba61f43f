"""fmp.nn.call's swap against torch.func.functional_call: the same outputs, buffers and module afterwards."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import assert_trees_bitwise_equal
from torch import nn
from torch._dynamo.testing import CompileCounter

import fmp


class _Counting(nn.Module):
    """A module that assigns a new tensor to a buffer in forward, and ties its head to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.GRU(6, 6, batch_first=True))
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        x = self.embed(tokens)
        x = self.body[1](self.body[0](x).transpose(1, 2)).transpose(1, 2)
        x, _ = self.body[2](x)
        return self.head(x).float().logsumexp(-1).mean() * self.calls


def _copies(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    params, buffers = fmp.nn.split(model)
    return {k: v.clone() + 0.01 for k, v in params.items()}, {k: v.clone() for k, v in buffers.items()}


def _module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _reference(model: nn.Module, params: Any, buffers: Any, *args: Any) -> tuple[Any, Any]:
    merged = {**params, **buffers}
    output = torch.func.functional_call(model, merged, args, tie_weights=True, strict=False)
    return output, {name: merged[name] for name in buffers}


def test_call_matches_functional_call_with_tied_weights_rnn_batchnorm_and_a_reassigned_buffer() -> None:
    torch.manual_seed(0)
    model = _Counting().train()
    before = _module_tensors(model)
    tokens = torch.randint(0, 10, (3, 5))
    for _ in range(3):  # the plan is built on the first call and reused
        params, buffers = _copies(model)
        ref_params, ref_buffers = copy.deepcopy((params, buffers))
        output, new_buffers = fmp.nn.call(model, params, buffers, tokens)
        expected, expected_buffers = _reference(model, ref_params, ref_buffers, tokens)
        assert_trees_bitwise_equal(output, expected)
        assert_trees_bitwise_equal(new_buffers, expected_buffers)
        assert int(new_buffers["calls"]) == 1  # the reassigned buffer comes back
        grads = torch.autograd.grad(
            fmp.nn.call(model, {k: v.requires_grad_() for k, v in params.items()}, buffers, tokens)[0],
            list(params.values()),
        )
        assert all(g is not None for g in grads)
    after = _module_tensors(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert model.head.weight is model.embed.weight


def test_call_follows_a_module_changed_between_calls() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    params, _ = _copies(model)
    fmp.nn.call(model, params, {}, x)
    model[2] = nn.Linear(4, 2)  # a new submodule: its weights come from params by name
    output, _ = fmp.nn.call(model, params, {}, x)
    assert_trees_bitwise_equal(output, torch.func.functional_call(model, params, (x,)))
    model[0].bias = nn.Parameter(torch.ones(4))  # a new tensor in an old slot
    output, _ = fmp.nn.call(model, params, {}, x)
    assert_trees_bitwise_equal(output, torch.func.functional_call(model, params, (x,)))
    model.register_buffer("shift", torch.ones(2))  # a name the first plan did not have
    model.forward = lambda x: nn.Sequential.forward(model, x) + model.shift  # type: ignore[method-assign]
    shift = {"shift": torch.full((2,), 3.0)}
    output, _ = fmp.nn.call(model, params, shift, x)
    assert_trees_bitwise_equal(output, torch.func.functional_call(model, {**params, **shift}, (x,)))
    assert torch.equal(model.shift, torch.ones(2))


def test_call_restores_the_module_when_forward_raises() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("forward failed")

    model = Failing()
    before = _module_tensors(model)
    with pytest.raises(RuntimeError, match="forward failed"):
        fmp.nn.call(model, _copies(model)[0], {}, torch.ones(2))
    assert all(_module_tensors(model)[k] is before[k] for k in before)


def test_call_leaves_names_it_cannot_place_to_functional_call() -> None:
    torch.manual_seed(0)
    model = _Counting()
    params, buffers = _copies(model)
    tokens = torch.randint(0, 10, (2, 3))
    # Both names of the tied weight, with different values: torch refuses, and so does call.
    both = {**params, "head.weight": params["embed.weight"] + 1}
    with pytest.raises(ValueError, match="tied"):
        fmp.nn.call(model, both, buffers, tokens)
    # Both names with one tensor: torch takes it.
    same = {**params, "head.weight": params["embed.weight"]}
    output, _ = fmp.nn.call(model, same, copy.deepcopy(buffers), tokens)
    assert_trees_bitwise_equal(output, _reference(model, params, copy.deepcopy(buffers), tokens)[0])


class _TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.compiled
def test_one_compiled_call_serves_every_instance_of_a_model_and_follows_weights_untied_since() -> None:
    """Compiled once, call takes any instance (no graph per module) and sees a weight untied after the first call."""
    torch._dynamo.reset()
    counter = CompileCounter()

    def run(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fmp.nn.call(model, params, {}, x)[0]

    compiled = torch.compile(run, backend=counter, fullgraph=True)
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    models = [_TiedPair() for _ in range(10)]  # more than the recompile limit
    for model in models:
        params, _ = _copies(model)
        torch.testing.assert_close(compiled(model, params, x), _reference(model, params, {}, x)[0])
    assert counter.frame_count == 1
    model = models[0]
    params, _ = _copies(model)  # taken while tied: a.weight stands for both
    compiled(model, params, x)
    model.b.weight = nn.Parameter(torch.ones(4, 4))
    torch.testing.assert_close(compiled(model, params, x), _reference(model, params, {}, x)[0])
