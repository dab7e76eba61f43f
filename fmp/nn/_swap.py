"""Swapping a module's tensors for a call, with each module's slots looked up once and checked per call.

`torch.func.functional_call` walks the module tree (twice, to find tied weights) and resolves each
dotted name on every call; on a small model eager that walk costs a good part of the forward pass.
`swapped_call` does the same swap from a plan built once per module: for each name, the dicts
(`_parameters` or `_buffers`) that hold its tensor, tied names included. Before each call the plan
is checked against the module (every submodule still where it was, every slot still holding the
tensor it held), a pass of dictionary lookups; a module that changed gets a new plan. What the plan
cannot express (a name the module lacks, two tied names given at once) goes to
`torch.func.functional_call`, which defines the behaviour.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["swapped_call"]

# One slot: the dict holding the tensor (a module's `_parameters` or `_buffers`) and its key.
_Slot = tuple[dict[str, Any], str]


class _Plan:
    """Where each of a module's tensors lives, and what to check before trusting that."""

    def __init__(self, module: nn.Module) -> None:
        # Every parent-child link, so a submodule replaced since is noticed.
        self.links = [
            (parent._modules, name, child)
            for parent in module.modules()
            for name, child in parent._modules.items()
            if child is not None
        ]
        by_tensor: dict[int, list[_Slot]] = {}
        names: dict[str, int] = {}
        # Each slot with the tensor it holds now; tied names share one list of slots.
        self.held: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for table in (owner._parameters, owner._buffers):
                for key, tensor in table.items():
                    if tensor is None:
                        continue
                    by_tensor.setdefault(id(tensor), []).append((table, key))
                    names[f"{prefix}.{key}" if prefix else key] = id(tensor)
                    self.held.append((table, key, tensor))
        self.slots: dict[str, list[_Slot]] = {name: by_tensor[tensor_id] for name, tensor_id in names.items()}
        self.tied = {name for name, slots in self.slots.items() if len(slots) > 1}
        self.rnns = [m for m in module.modules() if isinstance(m, nn.RNNBase)]

    def holds(self) -> bool:
        """Whether the module still has this plan's structure and tensors."""
        for modules, name, child in self.links:
            if modules.get(name) is not child:
                return False
        return all(table.get(key) is tensor for table, key, tensor in self.held)


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _plan(module: nn.Module) -> _Plan:
    plan = _PLANS.get(module)
    if plan is None or not plan.holds():
        plan = _PLANS[module] = _Plan(module)
    return plan


def _swap_in(plan: _Plan, values: Mapping[str, torch.Tensor]) -> list[tuple[dict[str, Any], str, Any]] | None:
    """Puts `values` into their slots; returns what they held, or None (nothing swapped) if the plan cannot."""
    slots = plan.slots
    if any(name not in slots for name in values):
        return None
    if plan.tied and sum(name in plan.tied for name in values) > 1:
        return None  # torch decides whether two values for tied names agree
    saved = []
    for name, value in values.items():
        for table, key in slots[name]:
            saved.append((table, key, table[key]))
            table[key] = value
    return saved


def swapped_call(
    module: nn.Module, values: dict[str, torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """`module(*args, **kwargs)` with `values` in place of its tensors of those names.

    Returns the output and the tensors the call left in the swapped slots where the module
    reassigned one (`self.buffer = new`), by name, as `torch.func.functional_call` writes them back.
    """
    plan = None if torch.compiler.is_compiling() else _plan(module)
    saved = None if plan is None else _swap_in(plan, values)
    if plan is None or saved is None:
        merged = dict(values)
        try:
            output = torch.func.functional_call(module, merged, args, kwargs, tie_weights=True, strict=False)
        finally:
            _reset_rnns(module.modules())
        return output, {name: merged[name] for name in values if merged[name] is not values[name]}
    try:
        output = module(*args, **kwargs)
    finally:
        reassigned = {}
        for name, value in values.items():
            table, key = plan.slots[name][0]
            current = table.get(key)
            if current is not value and current is not None:
                reassigned[name] = current
        for table, key, original in reversed(saved):
            table[key] = original
        _reset_rnns(plan.rnns)
    return output, reassigned


def _reset_rnns(modules: Any) -> None:
    # An RNN caches its weights in `_flat_weights`, which the call left on the tensors it was
    # given: compiled, the next trace would read the last step's (a transform's wrappers).
    for submodule in modules:
        if isinstance(submodule, nn.RNNBase):
            submodule._init_flat_weights()
