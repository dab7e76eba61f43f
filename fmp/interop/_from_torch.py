"""Moving a run from `torch.optim` to fmp mid-training: optimizer state from torch's state_dict format.

The way back is `fmp.interop._to_torch`.
"""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch

from fmp._checks import check_int
from fmp._optimizer import Optimizer
from fmp.interop._torch_names import unwrapped
from fmp.interop._torch_names import wrapper_depth
from fmp.optim._adam import AdamState
from fmp.optim._adam import adam
from fmp.optim._adam import adamw
from fmp.optim._base import LearningRate
from fmp.optim._base import Schedule
from fmp.optim._base import check_schedule_start
from fmp.optim._base import step_counter
from fmp.optim._partition import partition
from fmp.optim._sgd import SgdState
from fmp.optim._sgd import sgd

__all__ = ["from_torch_state_dict"]

_TORCH_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
# Settings that only choose torch's kernels, or a scheduler's own bookkeeping (LRScheduler's
# initial_lr, OneCycleLR's and CyclicLR's bounds, SWALR's swa_lr): nothing to carry over.
_KERNEL_SETTINGS = {"maximize", "foreach", "capturable", "differentiable", "fused", "param_names"}
_SCHEDULER_SETTINGS = {"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr"}


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
    listed = {str(key) for group in checked for key in group["params"]}
    unlisted = sorted(str(key) for key in states if str(key) not in listed)
    if unlisted:
        raise ValueError(
            f"the state_dict holds state for parameter ids {unlisted}, which no param group lists: it would be "
            f"dropped; save the optimizer's state_dict as torch wrote it"
        )
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


def _optimizer(
    kind: str, group: Mapping[str, Any], index: int, lr_override: LearningRate | None, source: str
) -> Optimizer:
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
    try:  # the optimizers' own range checks, named with the group (or the caller's lr)
        return build()
    except (TypeError, ValueError) as error:
        raise type(error)(f"{source} param group {index}: {error}") from None


def _counted_from(schedule: Schedule, shift: int) -> Schedule:
    """`schedule` read at the count `shift` steps ahead of the one it is given (torch's scheduler's count).

    Never below 0: a resumed run reads counts from its own on, where the shifted count is torch's
    and at least 0; only an `init` check at a fresh counter reads lower ones.
    """

    def shifted(count: torch.Tensor) -> torch.Tensor:
        return schedule((count + shift).clamp(min=0))

    return shifted


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
    lr_count: int | None = None,
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
            group), groups left out keeping theirs. None keeps every group's. A schedule reads
            torch's scheduler's count, `lr_count`, and goes on with it (each step counts one).
        lr_count: The count torch's scheduler had reached (`scheduler.last_epoch`): it steps on
            skipped steps too, where fmp's schedules count applied ones. None: `applied_steps`.

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
    if lr_count is not None:
        lr_count = check_int("lr_count", lr_count, 0, torch.iinfo(torch.int32).max)
        if not any(callable(value) for value in (lr.values() if isinstance(lr, Mapping) else [lr])):
            raise ValueError("lr_count is the count a schedule given as lr= reads; without one it would do nothing")
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
        override = lr.get(label) if isinstance(lr, Mapping) else lr
        group_params = {n: params[n] for n in members[index]}
        # The state from the group's settings (a saved lr replaced by `lr` need not be valid);
        # a schedule given for it then reads torch's scheduler's count.
        as_saved = _optimizer(kind, group, index, None if override is None else 0.0, "the state_dict's")
        state = _group_state(kind, as_saved, group, group_params, entries, applied_steps)
        if callable(override):
            if state == ():  # plain SGD: a scheduled one counts its applied steps
                state = SgdState(torch.full_like(step_counter(group_params), applied_steps), ())
            # Checked where torch's scheduler is, the count it reads next.
            scheduler_count = applied_steps if lr_count is None else lr_count
            check_schedule_start(
                override, torch.full_like(state.step, scheduler_count), f"lr= given for param group {index}"
            )
            # The group's own count may lag the scheduler's: the group started late (Adam's own
            # count), or torch.amp skipped steps the scheduler still counted.
            shift = scheduler_count - int(state.step)
            override = override if shift == 0 else _counted_from(override, shift)
        optimizers[label] = as_saved if override is None else _optimizer(kind, group, index, override, "lr= given for")
        states[label] = state
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
        for index, group in enumerate(groups):
            if not isinstance(group["param_names"], list | tuple) or len(group["param_names"]) != len(group["params"]):
                raise ValueError(
                    f"param group {index} of the state_dict lists {len(group['params'])} params but param_names "
                    f"{group['param_names']!r}: one name per param"
                )
        depth = wrapper_depth([str(name) for group in groups for name in group["param_names"]], names)
        members = [[unwrapped(str(name), depth) for name in group["param_names"]] for group in groups]
        seen: set[str] = set()
        for index, group_names in enumerate(members):
            unknown = [name for name in group_names if name not in known]
            if unknown:
                raise ValueError(f"param group {index} of the state_dict names {unknown}, which params lacks")
            twice = sorted({name for name in group_names if name in seen or group_names.count(name) > 1})
            if twice:
                raise ValueError(f"param group {index} of the state_dict names {twice} more than once")
            seen.update(group_names)
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
    known = {"momentum_buffer"} if kind == "sgd" else {"step", "exp_avg", "exp_avg_sq"}
    for name, entry in zip(names, entries, strict=True):
        unknown = sorted(map(str, set(entry) - known))
        if unknown:
            raise ValueError(
                f"the optimizer state of {name} holds {unknown}, which fmp's {kind} would drop (it keeps "
                f"{sorted(known)}): was the state_dict saved by another optimizer or with other settings?"
            )
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
