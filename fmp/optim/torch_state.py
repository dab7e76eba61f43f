"""Moving a run between `torch.optim` and fmp mid-training: optimizer state through torch's state_dict format."""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from fmp._checks import check_int
from fmp.optim._base import LearningRate
from fmp.optim._base import Optimizer
from fmp.optim.adam import AdamState
from fmp.optim.adam import adam
from fmp.optim.adam import adamw
from fmp.optim.partition import param_name
from fmp.optim.partition import partition
from fmp.optim.sgd import SgdState
from fmp.optim.sgd import sgd

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]

_TORCH_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
# Settings that only choose torch's kernels, or a scheduler's own bookkeeping (LRScheduler's
# initial_lr, OneCycleLR's and CyclicLR's bounds, SWALR's swa_lr): nothing to carry over.
_KERNEL_SETTINGS = {"maximize", "foreach", "capturable", "differentiable", "fused", "param_names"}
_SCHEDULER_SETTINGS = {"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr"}


# Prefixes that wrappers add to parameter names: DDP's and FSDP's "module.", torch.compile's "_orig_mod.".
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _wrapper_depth(torch_names: list[str], fmp_names: list[str]) -> int:
    """How many wrapper prefixes to take off all of torch's names, in every group, for them to name params.

    One prefix is taken off at a time, from all names at once, until they all name params: a model
    whose own submodule is called "module" keeps that part of its names. 0 where they already
    name params, or where no depth makes them name distinct ones (the mismatch is reported then).
    """
    known, names, depth = set(fmp_names), torch_names, 0
    while not all(name in known for name in names) and all(name.startswith(_WRAPPER_PREFIXES) for name in names):
        names, depth = [name.split(".", 1)[1] for name in names], depth + 1
    return depth if all(name in known for name in names) and len(set(names)) == len(names) else 0


def _unwrapped(name: str, depth: int) -> str:
    """`name` without its first `depth` components (the wrapper prefixes `_wrapper_depth` counted)."""
    return name.split(".", depth)[depth] if depth else name


def _check_groups(kind: str, state_dict: Any, count: int) -> list[dict[str, Any]]:
    """The param groups of a `torch.optim` state_dict of `kind` for `count` parameters, checked."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a torch.optim state_dict (a dict), got {type(state_dict).__name__}")
    groups, states = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not groups or not isinstance(states, Mapping):
        raise ValueError(
            f"not a torch.optim state_dict: keys {sorted(map(str, state_dict))}, expected 'state' and 'param_groups'"
        )
    checked = [_check_group(kind, dict(group), index) for index, group in enumerate(groups)]
    total = sum(len(group["params"]) for group in checked)
    if total != count:
        raise ValueError(f"the state_dict holds {total} parameters, params {count}")
    return checked


def _check_group(kind: str, group: dict[str, Any], index: int) -> dict[str, Any]:
    where = f"param group {index}"
    is_adam = kind != "sgd"
    required = {"params", "lr", "weight_decay"} | (
        {"betas", "eps"} if is_adam else {"momentum", "dampening", "nesterov"}
    )
    known = required | _KERNEL_SETTINGS | _SCHEDULER_SETTINGS
    known |= {"amsgrad", "decoupled_weight_decay"} if is_adam else set()
    missing, unknown = sorted(required - set(group)), sorted(set(group) - known)
    if missing or unknown:
        problems = [f"lacks {missing}"] * bool(missing) + [f"has unknown settings {unknown}"] * bool(unknown)
        raise ValueError(f"not a torch.optim.{_TORCH_NAMES[kind]} state_dict: its {where} {' and '.join(problems)}")
    if group.get("maximize"):
        raise ValueError(f"the state_dict's {where} has maximize=True, which fmp's optimizers do not offer")
    if is_adam:
        if group.get("amsgrad"):
            raise ValueError(f"the state_dict's {where} uses amsgrad=True, which fmp.optim.adam and adamw do not offer")
        # torch >= 2.6 records it; older AdamW state_dicts lack the key and are taken at their kind's word.
        decoupled = group.get("decoupled_weight_decay", kind == "adamw")
        if decoupled != (kind == "adamw"):
            raise ValueError(f"expected torch.optim.{_TORCH_NAMES[kind]} but decoupled_weight_decay={decoupled}")
    return group


def _scalar(value: Any, key: str, index: int) -> Any:
    """A one-element tensor or array as its Python value; anything else as it is."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        size = value.numel() if isinstance(value, torch.Tensor) else value.size
        if size != 1:
            raise ValueError(f"the state_dict's param group {index} has a {key} of {size} elements")
        return value.item()
    return value


def _number(value: Any, key: str, index: int) -> float:
    """A group's numeric setting as a float: a number, or a one-element tensor or array (torch allows a tensor lr)."""
    number = _scalar(value, key, index)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise TypeError(f"the state_dict's param group {index} has {key}={value!r}, not a number")
    return float(number)


def _flag(value: Any, key: str, index: int) -> bool:
    """A group's on/off setting: a bool, 0 or 1, or a one-element tensor or array of one."""
    flag = _scalar(value, key, index)
    if isinstance(flag, bool) or (isinstance(flag, int) and flag in (0, 1)):
        return bool(flag)
    raise TypeError(f"the state_dict's param group {index} has {key}={value!r}, not a bool")


def _optimizer(kind: str, group: Mapping[str, Any], index: int, lr_override: LearningRate | None) -> Optimizer:
    lr: LearningRate = _number(group["lr"], "lr", index) if lr_override is None else lr_override
    weight_decay = _number(group["weight_decay"], "weight_decay", index)
    build: Callable[[], Optimizer]
    if kind == "sgd":
        momentum, dampening = (
            _number(group["momentum"], "momentum", index),
            _number(group["dampening"], "dampening", index),
        )
        nesterov = _flag(group["nesterov"], "nesterov", index)
        build = functools.partial(sgd, lr, momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    else:
        betas = group["betas"]
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise TypeError(f"the state_dict's param group {index} has betas={betas!r}, not a pair of numbers")
        beta1, beta2 = (_number(beta, f"betas[{i}]", index) for i, beta in enumerate(betas))
        eps = _number(group["eps"], "eps", index)
        build = functools.partial(adamw if kind == "adamw" else adam, lr, (beta1, beta2), eps, weight_decay)
    try:  # the optimizers' own range checks, named with the group
        return build()
    except (TypeError, ValueError) as error:
        raise type(error)(f"the state_dict's param group {index}: {error}") from None


def _restored(name: str, entry: Mapping[str, Any], key: str, param: torch.Tensor) -> torch.Tensor:
    """One state tensor, checked against its param and copied onto the param's device."""
    value = entry.get(key)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"the optimizer state of {name} has no tensor {key!r}: keys {sorted(entry)}")
    if value.shape != param.shape or value.dtype != param.dtype:
        raise ValueError(
            f"{key} of {name} is {value.dtype}{list(value.shape)}, the param {param.dtype}{list(param.shape)}"
        )
    # A copy: a live optimizer's state_dict() shares these tensors, and torch.optim updates them in place.
    return value.to(param.device, copy=True)


def from_torch_state_dict(
    kind: str,
    state_dict: Mapping[str, Any],
    params: Mapping[str, torch.Tensor],
    applied_steps: int,
    *,
    lr: LearningRate | Mapping[str, LearningRate] | None = None,
) -> tuple[Optimizer, Any]:
    """Fmp's optimizer and optimizer state equal to a `torch.optim` optimizer's `state_dict()`.

    With them a run checkpointed under torch.amp goes on under fmp (the loss scale comes over with
    `fmp.DynamicLossScale.from_state_dict`). fmp's optimizers are torch.optim's arithmetic op for
    op, so in float32 the continued run is bit-identical to torch's (tested). The hyperparameters
    come from the state_dict's param groups, as they stand; a learning-rate scheduler's state does
    not: pass the run's schedule as `lr` (an `fmp.optim.schedule` reads the applied steps, which
    go on from torch's), and a momentum that OneCycleLR or CyclicLR cycles (Adam's beta1, SGD's
    momentum) stays at its present value. A tensor `lr` is
    taken as a float: torch's Adam divides a tensor lr by the bias correction in float32 and fmp
    in float64, so such runs agree to about an ulp a step rather than bit for bit.

    Args:
        kind: "adamw", "adam" or "sgd": the `torch.optim` class that saved `state_dict` (its
            state_dict does not say, and torch before 2.6 saves Adam and AdamW alike).
        state_dict: `optimizer.state_dict()` of that optimizer. With several param groups the
            result is a `partition` of one optimizer per group, named "group0", "group1", ...
        params: The parameters by name, a flat dict, on the device the state goes to. Where the
            optimizer was built on `model.named_parameters()` (torch >= 2.6 then saves each
            group's `param_names`), the names decide the groups (names a wrapper prefixed, DDP's
            "module." or torch.compile's "_orig_mod.", match without the prefix); otherwise
            `params` must list the parameters in the order the optimizer was given them, group
            by group (`model.parameters()` for one group), which only their shapes can check.
        applied_steps: Optimizer steps torch applied, skipped ones not counted. torch.optim.SGD keeps
            no count of its own and fmp's `SgdState` does (its first step seeds the momentum
            buffers, a schedule reads it); Adam's own counts in `state_dict` go on, each group's
            one number, at most this (a group may have started late).
        lr: The learning rate in place of the groups' present ones: a float or a schedule for
            every group, or a dict of them by group ("group0", "group1", ..., or "all" for one
            group), groups left out keeping theirs. None keeps every group's.

    Returns:
        `(optimizer, opt_state)`, for `TrainState.create(params, optimizer, scaler)._replace(opt_state=opt_state)`.

    Raises:
        TypeError, ValueError: Naming what does not match: the kind, a param group, the number,
            shapes or dtypes of the parameters, a state entry, a step count, or a setting fmp's
            optimizers do not offer (`maximize`, `amsgrad`).
    """
    if kind not in _TORCH_NAMES:
        raise ValueError(f"kind must be one of {sorted(_TORCH_NAMES)}, got {kind!r}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of tensors by name, got {type(params).__name__}")
    for name, param in params.items():
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"params[{name!r}] is a {type(param).__name__}; params must be a flat dict of tensors")
    applied_steps = check_int("applied_steps", applied_steps, 0, torch.iinfo(torch.int32).max)
    groups = _check_groups(kind, state_dict, len(params))
    if isinstance(lr, Mapping):
        group_labels = [f"group{index}" for index in range(len(groups))] if len(groups) > 1 else ["all"]
        unknown = sorted(set(map(str, lr)) - set(group_labels))
        if unknown:
            raise ValueError(f"lr names groups {unknown}; the state_dict's groups are {group_labels}")
    names = [str(name) for name in params]  # as partition names a flat dict's leaves
    params = dict(zip(names, params.values(), strict=True))
    members = _members(groups, names)
    optimizers, states, labels = {}, {}, {}
    for index, group in enumerate(groups):
        label = f"group{index}" if len(groups) > 1 else "all"
        entries = [_entry(state_dict["state"], key) for key in group["params"]]
        optimizers[label] = _optimizer(kind, group, index, lr.get(label) if isinstance(lr, Mapping) else lr)
        group_params = {n: params[n] for n in members[index]}
        states[label] = _group_state(kind, optimizers[label], group, group_params, entries, applied_steps)
        labels.update(dict.fromkeys(members[index], label))
    if len(groups) == 1:
        return optimizers["all"], states["all"]

    def label_of(name: str, param: torch.Tensor) -> str:
        if name not in labels:
            raise ValueError(f"params[{name!r}] was not among the params converted from the torch state_dict")
        return labels[name]

    return partition(optimizers, label_of), states


def _entry(states: Mapping[Any, Any], key: Any) -> Any:
    """A parameter's state by its id; ids saved as strings (a checkpoint through JSON or YAML) count too."""
    entry = states.get(key)
    return states.get(str(key)) if entry is None else entry


def _members(groups: list[dict[str, Any]], names: list[str]) -> list[list[str]]:
    """Each param group's parameter names: by torch's `param_names` where every group has them, else by order."""
    if all("param_names" in group for group in groups):
        known = set(names)
        depth = _wrapper_depth([str(name) for group in groups for name in group["param_names"]], names)
        members = [[_unwrapped(str(name), depth) for name in group["param_names"]] for group in groups]
        for index, group_names in enumerate(members):
            unknown = [name for name in group_names if name not in known]
            if unknown:
                raise ValueError(f"param group {index} of the state_dict names {unknown}, which params lacks")
        return members
    # Without names, torch numbers the parameters group by group, in the order it was given them.
    starts = [0, *itertools.accumulate(len(group["params"]) for group in groups)]
    return [names[starts[index] : starts[index + 1]] for index in range(len(groups))]


def _group_state(
    kind: str,
    optimizer: Optimizer,
    group: Mapping[str, Any],
    params: dict[str, torch.Tensor],
    entries: list[Any],
    applied_steps: int,
) -> Any:
    """One param group's fmp optimizer state from torch's per-parameter `entries` (None where torch has none)."""
    # fmp's init gives the state's structure, dtypes and device; the state_dict fills in the values.
    fresh = optimizer.init(params)
    names = list(params)
    if kind == "sgd" and not group["momentum"]:
        # Plain SGD keeps no state in torch; in fmp only a scheduled one does, its count, which goes on.
        return fresh._replace(step=torch.full_like(fresh.step, applied_steps)) if fresh != () else fresh
    if not names:  # an empty group (a no-decay group of a model without biases): only its count goes on
        return fresh._replace(step=torch.full_like(fresh.step, applied_steps))
    if all(entry is None for entry in entries):
        if applied_steps:
            raise ValueError(
                f"the state_dict holds no optimizer state for {names}, yet {applied_steps} steps were applied"
            )
        return fresh  # torch never stepped: nothing to carry over
    missing = [name for name, entry in zip(names, entries, strict=True) if entry is None]
    if missing:
        raise ValueError(
            f"the state_dict has state for some parameters but not for {missing}: torch keeps none for a "
            f"parameter that never had a gradient, and fmp keeps one step count per group; give those "
            f"parameters a param group of their own, or leave them out of params"
        )
    if not applied_steps:  # fmp's first step would seed the momentum afresh, dropping the loaded buffers
        raise ValueError("the state_dict holds optimizer state, so torch applied steps, yet applied_steps is 0")
    if kind == "sgd":
        momentum = {n: _restored(n, e, "momentum_buffer", params[n]) for n, e in zip(names, entries, strict=True)}
        return SgdState(torch.full_like(fresh.step, applied_steps), momentum)
    counts = set()
    for name, entry in zip(names, entries, strict=True):
        if not isinstance(entry.get("step"), torch.Tensor | float | int):
            raise ValueError(f"the optimizer state of {name} has no step count: keys {sorted(entry)}")
        counts.add(float(entry["step"]))
    # Adam's own count (which its bias correction reads) goes on; a group may have started late.
    (count, *others) = sorted(counts)
    if others or count > applied_steps or count != int(count):
        raise ValueError(
            f"the state_dict's Adam step counts are {sorted(counts)}; a group's must be one whole number, "
            f"at most applied_steps={applied_steps}"
        )
    step = torch.full_like(fresh.step, int(count))
    exp_avg = {n: _restored(n, e, "exp_avg", params[n]) for n, e in zip(names, entries, strict=True)}
    exp_avg_sq = {n: _restored(n, e, "exp_avg_sq", params[n]) for n, e in zip(names, entries, strict=True)}
    return AdamState(step, exp_avg, exp_avg_sq)


def _in_torch_order(
    buffers: dict[str, Any], group: Mapping[str, Any], index: int, where: str, depth: int
) -> dict[str, list[torch.Tensor]]:
    """Each buffer's leaves in the order of torch param group `index`: by its `param_names` where it has them.

    fmp names a leaf by its key path joined by dots ("0.weight"), as `partition` does and as
    `model.named_parameters()` names it, torch's without their first `depth` (wrapper) components;
    without torch's names, the leaves go in fmp's order.
    """
    named = {
        key: {param_name(path): leaf for path, leaf in pytree.tree_flatten_with_path(tree)[0]}
        for key, tree in buffers.items()
    }
    torch_params: list[torch.Tensor] = list(group["params"])
    if "param_names" not in group:
        ordered = {key: list(leaves.values()) for key, leaves in named.items()}
    else:
        held = next(iter(named.values()))
        names = [_unwrapped(str(name), depth) for name in group["param_names"]]
        unknown, unlisted = [n for n in names if n not in held], [n for n in held if n not in names]
        if unknown or unlisted:
            problems = [f"names {unknown}, which opt_state{where} lacks"] * bool(unknown)
            problems += [f"does not name {unlisted}, which opt_state{where} holds"] * bool(unlisted)
            raise ValueError(f"torch_optimizer's param group {index} {' and '.join(problems)}")
        ordered = {key: [leaves[name] for name in names] for key, leaves in named.items()}
    leaves = next(iter(ordered.values()))
    if len(torch_params) != len(leaves):
        raise ValueError(f"opt_state{where} holds {len(leaves)} parameters' state, torch_optimizer {len(torch_params)}")
    for position, (param, leaf) in enumerate(zip(torch_params, leaves, strict=True)):
        if param.shape != leaf.shape or param.dtype != leaf.dtype:
            raise ValueError(
                f"parameter {position}{where}: torch_optimizer's is {param.dtype}{list(param.shape)}, "
                f"opt_state's {leaf.dtype}{list(leaf.shape)}"
            )
    return ordered


def _state_names(opt_state: Any) -> list[str]:
    """The parameter names an fmp optimizer state keeps buffers for (none for plain SGD's, or another kind)."""
    tree = opt_state.exp_avg if isinstance(opt_state, AdamState) else getattr(opt_state, "momentum", ())
    return [param_name(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]


def _torch_group_state(
    opt_state: Any, torch_optimizer: torch.optim.Optimizer, index: int, first_id: int, where: str, depth: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Torch's per-parameter state of param group `index` (numbered from `first_id`) from one fmp state."""
    kind = type(torch_optimizer).__name__
    is_adam = not isinstance(torch_optimizer, torch.optim.SGD)
    stateless = isinstance(opt_state, tuple) and opt_state == ()  # plain SGD's
    if is_adam != isinstance(opt_state, AdamState) or not (is_adam or isinstance(opt_state, SgdState) or stateless):
        # A wrapper's state (ema, stochastic_rounding) holds the wrapped optimizer's in `inner`.
        hint = "; pass its .inner, the wrapped optimizer's state" if hasattr(opt_state, "inner") else ""
        raise TypeError(
            f"opt_state{where} is a {type(opt_state).__name__}, which is not the state of a torch.optim.{kind}{hint}"
        )
    buffers: dict[str, Any] = {}
    if isinstance(opt_state, AdamState):
        buffers = {"exp_avg": opt_state.exp_avg, "exp_avg_sq": opt_state.exp_avg_sq}
    elif isinstance(opt_state, SgdState) and opt_state.momentum != ():
        buffers = {"momentum_buffer": opt_state.momentum}
    group = torch_optimizer.param_groups[index]
    for setting in ("amsgrad", "maximize"):
        if group.get(setting):
            raise ValueError(
                f"torch_optimizer's param group {index} has {setting}=True, which fmp's optimizers do not "
                f"offer: opt_state{where} cannot continue it"
            )
    if not is_adam and bool(group["momentum"]) != bool(buffers):
        raise ValueError(
            f"torch_optimizer's param group {index} has momentum={group['momentum']} but opt_state{where} keeps "
            f"{'momentum buffers' if buffers else 'none'}"
        )
    if not buffers:
        return {}
    flat = _in_torch_order(buffers, group, index, where, depth)
    torch_params: list[torch.Tensor] = list(group["params"])
    steps = int(opt_state.step)
    if steps == 0:
        return {}  # torch keeps no state before its first step
    state = {}
    for offset, param in enumerate(torch_params):
        entry = {key: leaves[offset].to(param.device, copy=True) for key, leaves in flat.items()}
        if is_adam:
            entry["step"] = torch.tensor(float(steps))  # torch loads it onto the device where it needs it
        state[first_id + offset] = entry
    return state


def to_torch_state_dict(opt_state: Any, torch_optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A state_dict that makes `torch_optimizer` go on from fmp's optimizer state.

    The way back from fmp to `torch.optim`: build the torch optimizer on the model's parameters
    with the hyperparameters the fmp optimizer had (fmp's optimizers close over theirs, so they
    cannot be checked here), then `torch_optimizer.load_state_dict(to_torch_state_dict(...))`.
    The state's tensors are copied, so the two optimizers share nothing. Together with
    `torch.amp.GradScaler.load_state_dict(state.scaler.state_dict())` a run moves back to torch.amp.

    Note:
        Reads the step counts on the host (a sync), as a checkpoint conversion may.

    Args:
        opt_state: The state of `fmp.optim.sgd`, `adam` or `adamw` (`state.opt_state`), or a
            `partition`'s state, its groups in the order of `torch_optimizer`'s param groups. Where
            `torch_optimizer` was built on `model.named_parameters()` (torch >= 2.6 keeps each
            group's `param_names`), each parameter gets the state of the param of its name (a
            key path joined by dots, "0.weight"; a wrapper's "module." or "_orig_mod." prefix
            on all of torch's names is dropped); otherwise the params must be listed in the
            order `torch_optimizer` holds them (as `model.parameters()` lists them), which only
            their shapes and dtypes can check.
        torch_optimizer: A `torch.optim.SGD`, `Adam` or `AdamW`.

    Returns:
        `{"state": ..., "param_groups": ...}` in torch's format, the param groups `torch_optimizer`'s own.

    Raises:
        TypeError, ValueError: Naming the mismatch: an optimizer or state of another kind, a
            momentum one side keeps and the other does not, another number of groups, parameters
            that differ in names, number, shape or dtype, or a setting fmp's optimizers do not
            offer (`amsgrad`, `maximize`).
    """
    if not isinstance(torch_optimizer, torch.optim.SGD | torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(
            f"torch_optimizer must be a torch.optim.SGD, Adam or AdamW, got {type(torch_optimizer).__name__}"
        )
    groups = dict(opt_state) if isinstance(opt_state, dict) else {"": opt_state}
    count = len(torch_optimizer.param_groups)
    if len(groups) != count:
        raise ValueError(f"opt_state holds {len(groups)} groups' state, torch_optimizer has {count} param groups")
    # Only groups whose state keeps buffers are paired by name (a plain SGD group's keeps none).
    states = groups.values()
    pairs = [(group, _state_names(state)) for group, state in zip(torch_optimizer.param_groups, states, strict=True)]
    torch_names = [str(name) for group, names in pairs if names for name in group.get("param_names", ())]
    depth = _wrapper_depth(torch_names, [name for _, names in pairs for name in names])
    state: dict[int, dict[str, torch.Tensor]] = {}
    first_id = 0
    for index, (label, group_state) in enumerate(groups.items()):
        where = f"[{label!r}]" if label else ""
        state.update(_torch_group_state(group_state, torch_optimizer, index, first_id, where, depth))
        first_id += len(torch_optimizer.param_groups[index]["params"])
    return {"state": state, "param_groups": torch_optimizer.state_dict()["param_groups"]}
