"""Moving a run from fmp back to `torch.optim` mid-training: optimizer state in torch's state_dict format."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from fmp.interop._torch_names import unwrapped
from fmp.interop._torch_names import wrapper_depth
from fmp.optim._adam import AdamState
from fmp.optim._partition import param_name
from fmp.optim._sgd import SgdState

__all__ = ["to_torch_state_dict"]


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
        names = [unwrapped(str(name), depth) for name in group["param_names"]]
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
    The param groups are `torch_optimizer`'s own, lr included: where fmp ran a schedule, set each
    group's lr to the schedule's present value (and a torch scheduler's `last_epoch` to its count)
    first, since torch's chainable schedulers go on from the lr they find.

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
    depth = wrapper_depth(torch_names, [name for _, names in pairs for name in names])
    state: dict[int, dict[str, torch.Tensor]] = {}
    first_id = 0
    for index, (label, group_state) in enumerate(groups.items()):
        where = f"[{label!r}]" if label else ""
        state.update(_torch_group_state(group_state, torch_optimizer, index, first_id, where, depth))
        first_id += len(torch_optimizer.param_groups[index]["params"])
    return {"state": state, "param_groups": torch_optimizer.state_dict()["param_groups"]}
