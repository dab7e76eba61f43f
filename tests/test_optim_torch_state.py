"""fmp.interop.from_torch_state_dict: a torch.optim run goes on under fmp, bit for bit in float32."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _torch_optim_runs import make_model
from _torch_optim_runs import params_in_group_order
from _torch_optim_runs import step_both_and_compare
from _torch_optim_runs import torch_run
from _torch_optim_runs import torch_step
from conftest import bits

import fmp


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_converted_optimizer_state_continues_torch_optim_bit_for_bit(kind: str) -> None:
    model, optimizer, batches = torch_run(kind, steps=3)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(kind, optimizer.state_dict(), params, applied_steps=3)
    # In float32 without loss scaling, fmp's optimizers are torch.optim's arithmetic op for op.
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    state = step_both_and_compare(model, optimizer, state, fmp_optimizer, batches[-1])
    assert int(state.opt_state.step) == 4


def adamw_checkpoint() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model, optimizer, _ = torch_run("adamw", steps=2)
    return optimizer.state_dict(), {name: p.detach().clone() for name, p in model.named_parameters()}


def test_converter_names_what_does_not_match() -> None:
    saved, params = adamw_checkpoint()
    with pytest.raises(ValueError, match=r"not a torch.optim.SGD state_dict: its param group 0 lacks \['dampening'"):
        fmp.interop.from_torch_state_dict("sgd", saved, params, 2)
    with pytest.raises(ValueError, match="the state_dict holds 6 parameters, params 5"):
        fmp.interop.from_torch_state_dict("adamw", saved, dict(list(params.items())[:5]), 2)
    with pytest.raises(ValueError, match=r"step counts are \[2.0\]; .* at most applied_steps=1"):
        fmp.interop.from_torch_state_dict("adamw", saved, params, 1)
    with pytest.raises(ValueError, match=r"expected torch\.optim\.Adam but decoupled_weight_decay=True"):
        fmp.interop.from_torch_state_dict("adam", saved, params, 2)
    swapped = dict(zip(params, reversed(list(params.values())), strict=True))
    with pytest.raises(
        ValueError, match=r"exp_avg of 0.weight is torch.float32\[8, 16\], the param torch.float32\[1\]"
    ):
        fmp.interop.from_torch_state_dict("adamw", saved, swapped, 2)
    two_groups = {**saved, "param_groups": saved["param_groups"] * 2}
    with pytest.raises(ValueError, match="the state_dict holds 12 parameters, params 6"):
        fmp.interop.from_torch_state_dict("adamw", two_groups, params, 2)
    with pytest.raises(TypeError, match=r"params\['0.weight'\] is a list; params must be a flat dict of tensors"):
        fmp.interop.from_torch_state_dict("adamw", saved, {**params, "0.weight": [1.0]}, 2)
    amsgrad = {**saved, "param_groups": [{**saved["param_groups"][0], "amsgrad": True}]}
    with pytest.raises(ValueError, match="amsgrad=True"):
        fmp.interop.from_torch_state_dict("adamw", amsgrad, params, 2)
    partial = {**saved, "state": {k: v for k, v in saved["state"].items() if k != 3}}
    with pytest.raises(ValueError, match=r"state for some parameters but not for \['2.bias'\]"):
        fmp.interop.from_torch_state_dict("adamw", partial, params, 2)
    with pytest.raises(ValueError, match=r"not a torch\.optim state_dict"):
        fmp.interop.from_torch_state_dict("adamw", {"exp_avg": 0}, params, 2)
    with pytest.raises(ValueError, match=r"kind must be one of \['adam', 'adamw', 'sgd'\], got 'AdamW'"):
        fmp.interop.from_torch_state_dict("AdamW", saved, params, 2)
    with pytest.raises(TypeError, match="applied_steps must be an int, got bool"):
        fmp.interop.from_torch_state_dict("adamw", saved, params, True)
    with pytest.raises(TypeError, match="params must be a dict of tensors by name, got list"):
        fmp.interop.from_torch_state_dict("adamw", saved, list(params.values()), 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state_dict must be a torch\.optim state_dict"):
        fmp.interop.from_torch_state_dict("adamw", [saved], params, 2)  # type: ignore[arg-type]


def test_state_the_converter_would_drop_is_refused_by_name() -> None:
    saved, params = adamw_checkpoint()
    unlisted = {**saved, "state": {**saved["state"], 6: saved["state"][0]}}
    with pytest.raises(ValueError, match=r"state for parameter ids \['6'\], which no param group lists"):
        fmp.interop.from_torch_state_dict("adamw", unlisted, params, 2)
    extra_key = {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "max_exp_avg_sq": torch.ones(8, 16)}}}
    with pytest.raises(ValueError, match=r"state of 0.weight holds \['max_exp_avg_sq'\], which fmp's adamw would drop"):
        fmp.interop.from_torch_state_dict("adamw", extra_key, params, 2)


def test_param_names_that_do_not_name_each_param_once_are_refused() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    params = {name: p.detach() for name, p in model.named_parameters()}
    saved = optimizer.state_dict()
    group = saved["param_groups"][0]
    for names, message in (
        (["weight", "weight"], r"param group 0 of the state_dict names \['weight'\] more than once"),
        (["weight"], r"param group 0 of the state_dict lists 2 params but param_names \['weight'\]: one name"),
    ):
        renamed = {**saved, "param_groups": [{**group, "param_names": names}]}
        with pytest.raises(ValueError, match=message):
            fmp.interop.from_torch_state_dict("adam", renamed, params, 1)


def test_bad_group_settings_are_named_with_their_group() -> None:
    saved, params = adamw_checkpoint()
    group = saved["param_groups"][0]
    for change, error, message in [
        ({"betas": 0.9}, TypeError, "param group 0 has betas=0.9, not a pair of numbers"),
        ({"lr": torch.tensor([0.1, 0.2])}, ValueError, "param group 0 has a lr of 2 elements"),
        ({"eps": "1e-8"}, TypeError, r"param group 0 has eps='1e-8', not a number"),
        ({"lr": True}, TypeError, "param group 0 has lr=True, not a number"),
        ({"lr": -1.0}, ValueError, r"param group 0: lr must be in \[0.0, inf\)"),
        ({"eps": 0.0}, ValueError, "param group 0: adamw: eps must be > 0 in float32"),
    ]:
        with pytest.raises(error, match=message):
            fmp.interop.from_torch_state_dict("adamw", {**saved, "param_groups": [{**group, **change}]}, params, 2)


def test_settings_saved_as_numpy_values_tensors_or_ints_convert() -> None:
    numpy = pytest.importorskip("numpy")
    model, optimizer, batches = torch_run("sgd", steps=2)
    saved = optimizer.state_dict()
    group = saved["param_groups"][0]
    loose = {"lr": numpy.float64(group["lr"]), "momentum": torch.tensor(group["momentum"]), "nesterov": numpy.bool_(1)}
    loose |= {"dampening": int(group["dampening"]), "weight_decay": numpy.array([group["weight_decay"]])}
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict(
        "sgd", {**saved, "param_groups": [{**group, **loose}]}, params, applied_steps=2
    )
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    step_both_and_compare(model, optimizer, state, fmp_optimizer, batches[-1])


def test_a_nesterov_flag_that_is_no_bool_is_refused() -> None:
    model, optimizer, _ = torch_run("sgd", steps=1)
    saved, params = optimizer.state_dict(), {name: p.detach() for name, p in model.named_parameters()}
    for flag in ("False", 2, None):
        corrupt = {**saved, "param_groups": [{**saved["param_groups"][0], "nesterov": flag}]}
        with pytest.raises(TypeError, match=f"param group 0 has nesterov={flag!r}, not a bool"):
            fmp.interop.from_torch_state_dict("sgd", corrupt, params, 1)


def test_state_keyed_by_string_ids_converts_as_by_int_ids() -> None:
    # A checkpoint that went through JSON or YAML keys the state by "0", "1", ...
    saved, params = adamw_checkpoint()
    by_str = {**saved, "state": {str(key): entry for key, entry in saved["state"].items()}}
    by_int_state = fmp.interop.from_torch_state_dict("adamw", saved, params, 2)[1]
    by_str_state = fmp.interop.from_torch_state_dict("adamw", by_str, params, 2)[1]
    leaves = [torch.utils._pytree.tree_leaves(state) for state in (by_int_state, by_str_state)]
    assert all(torch.equal(a, b) for a, b in zip(*leaves, strict=True))


def test_stateless_and_unstepped_optimizers_convert_to_a_fresh_state() -> None:
    model = make_model()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer, state = fmp.interop.from_torch_state_dict("sgd", plain.state_dict(), params, 5)
    assert state == optimizer.init(params) == ()
    unstepped = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    optimizer, state = fmp.interop.from_torch_state_dict("adamw", unstepped.state_dict(), params, 0)
    assert int(state.step) == 0 and all(not m.any() for m in state.exp_avg.values())
    with pytest.raises(ValueError, match=r"holds no optimizer state for \[.*\], yet 3 steps were applied"):
        fmp.interop.from_torch_state_dict("adamw", unstepped.state_dict(), params, 3)


def fmp_optimizer_like_torch_run(kind: str) -> fmp.optim.Optimizer:
    """fmp's optimizer with the hyperparameters `torch_run` gives torch's."""
    if kind == "sgd":
        return fmp.optim.sgd(0.1, 0.9, nesterov=True, weight_decay=0.01)
    return fmp.optim.adam(1e-2, weight_decay=0.1) if kind == "adam" else fmp.optim.adamw(1e-2)


@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_a_run_moves_back_to_torch_optim_and_continues_bit_for_bit(kind: str, steps: int) -> None:
    model, optimizer, batches = torch_run(kind, steps=0)  # torch's optimizer, never stepped
    fmp_optimizer = fmp_optimizer_like_torch_run(kind)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().mean()

    step = functools.partial(fmp.train_step, loss_fn, policy=fmp.Policy(), optimizer=fmp_optimizer)
    for x in [torch.randn(4, 16) for _ in range(steps)]:
        state, _ = step(state, x)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state.params[name])
    optimizer.load_state_dict(fmp.interop.to_torch_state_dict(state.opt_state, optimizer))
    for x in batches[:2]:  # both go on: torch's state must not share fmp's tensors
        torch_step(model, optimizer, x)
        state, _ = step(state, x)
    for name, p in model.named_parameters():
        assert torch.equal(bits(state.params[name]), bits(p.detach())), name


def test_the_way_back_names_what_does_not_match() -> None:
    model, adamw, _ = torch_run("adamw", steps=0)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    adam_state = fmp.optim.adamw().init(params)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"opt_state is a AdamState, which is not the state of a torch\.optim\.SGD"):
        fmp.interop.to_torch_state_dict(adam_state, sgd)
    ema_state = fmp.optim.ema(fmp.optim.adamw()).init(params)
    with pytest.raises(TypeError, match=r"opt_state is a EmaState, .*AdamW; pass its \.inner, the wrapped optimizer's"):
        fmp.interop.to_torch_state_dict(ema_state, adamw)
    with pytest.raises(ValueError, match=r"torch_optimizer's param group 0 has momentum=0\.9 but opt_state keeps none"):
        fmp.interop.to_torch_state_dict(fmp.optim.sgd(0.1).init(params), sgd)
    with pytest.raises(TypeError, match=r"torch_optimizer must be a torch\.optim\.SGD, Adam or AdamW, got RMSprop"):
        fmp.interop.to_torch_state_dict(adam_state, torch.optim.RMSprop(model.parameters()))
    fewer = torch.optim.AdamW(list(model.parameters())[:5])
    with pytest.raises(ValueError, match="opt_state holds 6 parameters' state, torch_optimizer 5"):
        fmp.interop.to_torch_state_dict(adam_state, fewer)
    swapped = torch.optim.AdamW(list(reversed(list(model.parameters()))))
    with pytest.raises(ValueError, match=r"parameter 0: torch_optimizer's is torch.float32\[1\], opt_state's"):
        fmp.interop.to_torch_state_dict(adam_state, swapped)
    two_groups = torch.optim.AdamW([{"params": [p]} for p in model.parameters()])
    with pytest.raises(ValueError, match="opt_state holds 1 groups' state, torch_optimizer has 6 param groups"):
        fmp.interop.to_torch_state_dict(adam_state, two_groups)
    assert fmp.interop.to_torch_state_dict(adam_state, adamw)["state"] == {}  # before the first step


def test_state_without_applied_steps_is_refused() -> None:
    for kind in ("sgd", "adamw"):
        model, optimizer, _ = torch_run(kind, steps=2)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        with pytest.raises(ValueError, match="holds optimizer state, so torch applied steps, yet applied_steps is 0"):
            fmp.interop.from_torch_state_dict(kind, optimizer.state_dict(), params, 0)


def test_several_param_groups_become_a_partition_and_continue_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = make_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(4)]
    for x in batches[:3]:
        torch_step(model, optimizer, x)
    params = params_in_group_order(model, optimizer)
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict("adamw", optimizer.state_dict(), params, 3)
    assert sorted(opt_state) == ["group0", "group1"] and sorted(opt_state["group1"].exp_avg) == [
        "0.bias",
        "2.bias",
        "3.bias",
    ]
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    state = step_both_and_compare(model, optimizer, state, fmp_optimizer, batches[-1])
    # And back: a torch optimizer with the same groups loads the partition's state and goes on.
    back_model = make_model()
    back_model.load_state_dict(dict(model.state_dict()))
    back_decay = [p for p in back_model.parameters() if p.dim() >= 2]
    back_no_decay = [p for p in back_model.parameters() if p.dim() < 2]
    back = torch.optim.AdamW([{"params": back_decay}, {"params": back_no_decay, "weight_decay": 0.0}], lr=1e-2)
    back.load_state_dict(fmp.interop.to_torch_state_dict(state.opt_state, back))
    for states in (back.state_dict()["state"], optimizer.state_dict()["state"]):
        assert len(states) == 6 and all(float(entry["step"]) == 4.0 for entry in states.values())
    for key, entry in back.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[name], optimizer.state_dict()["state"][key][name]), (key, name)


def test_named_and_late_groups_convert_in_the_models_order() -> None:
    torch.manual_seed(0)
    model = make_model()
    named = dict(model.named_parameters())
    # Built on named parameters (torch >= 2.6 saves their names), in another order than the model's,
    # with a group that starts stepping one step late.
    head = [(n, p) for n, p in named.items() if n.startswith("3.")]
    body = [(n, p) for n, p in named.items() if not n.startswith("3.")]
    optimizer = torch.optim.AdamW([{"params": head}, {"params": body, "lr": 1e-3}], lr=1e-2)
    if "param_names" not in optimizer.state_dict()["param_groups"][0]:
        pytest.skip("this torch saves no param_names")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(4)]
    for step, x in enumerate(batches[:3]):
        for _, p in body:
            p.requires_grad_(step > 0)  # the body is frozen for the first step
        torch_step(model, optimizer, x)
    params = {name: p.detach().clone() for name, p in named.items()}  # the model's order
    fmp_optimizer, opt_state = fmp.interop.from_torch_state_dict("adamw", optimizer.state_dict(), params, 3)
    assert [int(opt_state[g].step) for g in ("group0", "group1")] == [3, 2]
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())._replace(opt_state=opt_state)
    state = step_both_and_compare(model, optimizer, state, fmp_optimizer, batches[-1])
    with pytest.raises(ValueError, match=r"params\['extra'\] was not among the params converted"):
        fmp_optimizer.init({**params, "extra": torch.zeros(1)})


def test_an_empty_param_group_converts_both_ways() -> None:
    model, _, batches = torch_run("adamw", steps=0)
    optimizer = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}], lr=1e-2)
    model(batches[0]).square().mean().backward()
    optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, opt_state = fmp.interop.from_torch_state_dict("adamw", optimizer.state_dict(), params, 1)
    assert opt_state["group1"].exp_avg == {} and int(opt_state["group1"].step) == 1
    back = fmp.interop.to_torch_state_dict(opt_state, optimizer)
    assert sorted(back["state"]) == sorted(optimizer.state_dict()["state"])
    again, _ = fmp.interop.from_torch_state_dict("adamw", back, params, 1)
    assert sorted(again.init(params)) == ["group0", "group1"]


def test_the_way_back_gives_each_named_parameter_its_own_state() -> None:
    model, _, _ = torch_run("adamw", steps=0)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    fmp_optimizer = fmp.optim.adamw(1e-2)
    state = fmp.TrainState.create(params, fmp_optimizer, fmp.NoOpLossScale())
    state, _ = fmp.train_step(
        lambda p, x: torch.func.functional_call(model, p, (x,)).square().mean(),
        state,
        torch.randn(4, 16),
        policy=fmp.Policy(),
        optimizer=fmp_optimizer,
    )
    # Same-shaped layers listed in another order than the model's: only the names tell them apart.
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(named[2:4] + named[:2] + named[4:], lr=1e-2)
    if "param_names" not in optimizer.state_dict()["param_groups"][0]:
        pytest.skip("this torch saves no param_names")
    optimizer.load_state_dict(fmp.interop.to_torch_state_dict(state.opt_state, optimizer))
    saved = optimizer.state_dict()
    for index, name in enumerate(saved["param_groups"][0]["param_names"]):
        assert torch.equal(saved["state"][index]["exp_avg"], state.opt_state.exp_avg[name]), name
        assert torch.equal(saved["state"][index]["exp_avg_sq"], state.opt_state.exp_avg_sq[name]), name
    renamed = torch.optim.AdamW([("head.weight", p) if n == "3.weight" else (n, p) for n, p in named])
    message = r"param group 0 names \['head\.weight'\], which opt_state lacks and does not name \['3\.weight'\]"
    with pytest.raises(ValueError, match=message):
        fmp.interop.to_torch_state_dict(state.opt_state, renamed)


@pytest.mark.parametrize("setting", ["amsgrad", "maximize"])
def test_the_way_back_refuses_torch_settings_fmp_does_not_offer(setting: str) -> None:
    model, _, _ = torch_run("adam", steps=0)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), **{setting: True})
    with pytest.raises(ValueError, match=f"param group 0 has {setting}=True, which fmp's optimizers do not offer"):
        fmp.interop.to_torch_state_dict(fmp.optim.adam().init(params), optimizer)


def test_a_group_with_unknown_settings_is_named_without_empty_lists() -> None:
    model, optimizer, _ = torch_run("sgd", steps=0)
    saved = optimizer.state_dict()
    saved["param_groups"][0]["rho"] = 0.9
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"SGD state_dict: its param group 0 has unknown settings \['rho'\]$"):
        fmp.interop.from_torch_state_dict("sgd", saved, params, 0)


def test_names_a_wrapper_prefixed_match_the_models_own() -> None:
    # A torch optimizer built on a DDP- or torch.compile-wrapped model names "module.0.weight".
    model, _, batches = torch_run("adamw", steps=0)
    prefixed = [(f"module._orig_mod.{name}", p) for name, p in model.named_parameters()]
    optimizer = torch.optim.AdamW(list(reversed(prefixed)), lr=1e-2)
    if "param_names" not in optimizer.state_dict()["param_groups"][0]:
        pytest.skip("this torch saves no param_names")
    model(batches[0]).square().mean().backward()
    optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, opt_state = fmp.interop.from_torch_state_dict("adamw", optimizer.state_dict(), params, 1)
    by_name = {name: p for name, p in model.named_parameters()}
    for name, buffer in opt_state.exp_avg.items():
        assert torch.equal(buffer, optimizer.state[by_name[name]]["exp_avg"]), name
    back = fmp.interop.to_torch_state_dict(opt_state, optimizer)
    for index, (name, _) in enumerate(reversed(prefixed)):
        assert torch.equal(back["state"][index]["exp_avg"], opt_state.exp_avg[name.removeprefix("module._orig_mod.")])


def test_a_models_own_submodule_called_module_keeps_its_name() -> None:
    # Only wrapper prefixes on every name go: "_orig_mod.module.weight" is the param "module.weight".
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(3, 3)
            self.x = torch.nn.Parameter(torch.ones(3))

    model = Wrapper()
    optimizer = torch.optim.SGD([(f"_orig_mod.{n}", p) for n, p in model.named_parameters()], lr=0.1, momentum=0.9)
    if "param_names" not in optimizer.state_dict()["param_groups"][0]:
        pytest.skip("this torch saves no param_names")
    (model.module(model.x) * model.x).sum().backward()
    optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, opt_state = fmp.interop.from_torch_state_dict("sgd", optimizer.state_dict(), params, 1)
    for name, p in model.named_parameters():
        assert torch.equal(opt_state.momentum[name], optimizer.state[p]["momentum_buffer"]), name


def test_wrapper_prefixes_are_taken_off_by_all_groups_names_together() -> None:
    # Group 0 alone ("module.weight") would name the submodule's weight; with group 1's names the
    # prefix is DDP's on every name, so it is the root's "weight".
    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3, 3))
            self.module = torch.nn.Linear(3, 3)

    model = Root()
    groups = [
        {"params": [("module.weight", model.weight)]},
        {"params": [(f"module.module.{n}", p) for n, p in model.module.named_parameters()]},
    ]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if "param_names" not in optimizer.state_dict()["param_groups"][0]:
        pytest.skip("this torch saves no param_names")
    (model.module(model.weight) * model.weight).sum().backward()
    optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, opt_state = fmp.interop.from_torch_state_dict("sgd", optimizer.state_dict(), params, 1)
    assert list(opt_state["group0"].momentum) == ["weight"]
    assert torch.equal(opt_state["group0"].momentum["weight"], optimizer.state[model.weight]["momentum_buffer"])
    back = fmp.interop.to_torch_state_dict(opt_state, optimizer)
    assert torch.equal(back["state"][0]["momentum_buffer"], optimizer.state[model.weight]["momentum_buffer"])
    assert torch.equal(back["state"][1]["momentum_buffer"], optimizer.state[model.module.weight]["momentum_buffer"])


def test_a_wrapped_models_sgd_groups_without_momentum_convert_both_ways() -> None:
    # Group 1 keeps no buffers: only group 0's names are paired, and they decide the prefix.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    named = [(f"module.{n}", p) for n, p in model.named_parameters()]
    optimizer = torch.optim.SGD(
        [{"params": named[:2], "momentum": 0.9}, {"params": named[2:], "momentum": 0.0}], lr=0.1
    )
    if "param_names" not in optimizer.state_dict()["param_groups"][0]:
        pytest.skip("this torch saves no param_names")
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, opt_state = fmp.interop.from_torch_state_dict("sgd", optimizer.state_dict(), params, 1)
    back = fmp.interop.to_torch_state_dict(opt_state, optimizer)
    assert sorted(back["state"]) == [0, 1]
    assert torch.equal(back["state"][0]["momentum_buffer"], optimizer.state[model[0].weight]["momentum_buffer"])
