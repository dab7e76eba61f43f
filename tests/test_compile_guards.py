"""fmp.skip_library_code_guards: a compiled step keeps every guard but the identity checks on library code."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_close
from conftest import mlp_loss
from conftest import mlp_params
from torch._dynamo.testing import CompileCounterWithBackend

import fmp

F32 = fmp.get_policy("params=float32,compute=float32,output=float32")
SGD = fmp.optim.sgd(0.1)
LOSS_WEIGHT = 1.0  # a global of the caller's, read by the traced loss function


def weighted_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mlp_loss(params, x, y) * LOSS_WEIGHT


def entry(name: str, guard_type: str, value: Any) -> Any:
    return types.SimpleNamespace(name=name, guard_type=guard_type, has_value=True, value=value)


@pytest.mark.parametrize(
    ("name", "guard_type", "value", "kept"),
    [
        ("G['__import_fmp_dot__step'].check_bool", "FUNCTION_MATCH", fmp.train_step, False),
        ("G['__import_torch_dot_nn_dot_functional'].gelu", "CLOSURE_MATCH", torch.nn.functional.gelu, False),
        ("G['__import_functools']", "DUPLICATE_INPUT", functools, False),
        (
            "list(dict.keys(G['__import_optree_dot_registry']._NODETYPE_REGISTRY))[3][1]",
            "CLASS_MATCH",
            fmp.DynamicLossScale,
            False,
        ),
        ("G['__builtins_dict___0']['len']", "BUILTIN_MATCH", len, False),
        # Library state that can change between calls: a registry, the regions, a flag.
        ("G['__import_optree_dot_registry']._NODETYPE_REGISTRY", "DICT_NOT_CONTAINS", {}, True),
        ("G['__import_fmp_dot_autocast_dot__transform'].AMBIENT.regions[0]", "DUPLICATE_INPUT", object(), True),
        ("G['__import_fmp_dot_autocast_dot__transform'].AMBIENT.regions", "LENGTH_CHECK", [], True),
        ("G['__import_torch_dot_backends_dot_mkldnn'].enabled", "CONSTANT_MATCH", True, True),
        # Modules of the caller's whose names start like a library's.
        ("G['__import_fmpx_dot_layers'].block", "FUNCTION_MATCH", mlp_loss, True),
        ("G['__import_torchvision_dot_ops'].nms", "FUNCTION_MATCH", mlp_loss, True),
        ("G['__import_torch_dot_layers'].act", "FUNCTION_MATCH", mlp_loss, True),
        # The caller's own objects and the state.
        ("G['model']", "ID_MATCH", torch.nn.Linear(1, 1), True),
        ("G['__import___main__'].loss_fn", "FUNCTION_MATCH", mlp_loss, True),
        ("L['args'][0].params['w1']", "TENSOR_MATCH", torch.zeros(1), True),
        ("L['fn'].keywords['optimizer']", "ID_MATCH", SGD, True),
    ],
)
def test_drops_only_identity_guards_on_library_code(
    name: str, guard_type: str, value: Any, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module of the caller's named torch_dot_layers, which Dynamo spells as torch.layers would be.
    monkeypatch.setitem(sys.modules, "torch_dot_layers", types.ModuleType("torch_dot_layers"))
    monkeypatch.setitem(sys.modules, "torch.layers", types.ModuleType("torch.layers"))
    assert fmp.skip_library_code_guards([entry(name, guard_type, value)]) == [kept]


def test_a_filtered_compiled_step_trains_and_still_recompiles_for_what_changed() -> None:
    global LOSS_WEIGHT
    decisions: list[tuple[str, str, bool]] = []

    def recording_filter(entries: list[Any]) -> list[bool]:
        keep = fmp.skip_library_code_guards(entries)
        decisions.extend((e.name, e.guard_type, k) for e, k in zip(entries, keep, strict=True))
        return keep

    step = functools.partial(fmp.train_step, weighted_loss, policy=F32, optimizer=SGD)
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=backend, fullgraph=True, options={"guard_filter_fn": recording_filter})
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    state = eager = fmp.TrainState.create(mlp_params(), SGD, fmp.DynamicLossScale.create(growth_interval=1))
    try:
        for batch_x in (x, x * float("nan"), x):  # the scale grows, backs off and grows: no recompile
            state, info = compiled(state, batch_x, y)
            eager, _ = step(eager, batch_x, y)
        assert backend.frame_count == 1
        assert_trees_close(state, eager, **TOLERANCES[torch.float32])
        assert int(state.counts.skipped) == 1 and float(info.loss_scale) == float(eager.scaler.loss_scale) / 2
        dropped = [(name, kind) for name, kind, keep in decisions if not keep]
        assert dropped, "nothing dropped: the filter no longer matches Dynamo's guard names"
        assert not any(name.startswith("L[") or kind == "TENSOR_MATCH" for name, kind in dropped)

        # Guards on the state and on the caller's globals stay.
        wider = fmp.TrainState.create(mlp_params(width=16), SGD, fmp.DynamicLossScale.create())
        compiled(wider, torch.randn(4, 16), y)
        assert backend.frame_count == 2
        LOSS_WEIGHT = 2.0
        state, _ = compiled(state, x, y)
        assert backend.frame_count == 3
    finally:
        LOSS_WEIGHT = 1.0
