"""Swapping a module's tensors for a call, with each module's slots looked up once and checked per call.

`torch.func.functional_call` walks the module tree (twice, to find tied weights) and resolves each
dotted name on every call; on a small model eager that walk costs a good part of the forward pass.
`swapped_call` does the same swap from a plan built once per module: for each name, the dicts
(`_parameters` or `_buffers`) that hold its tensor, tied names included. Before each call the plan
is checked against the module (every submodule still where it was, every slot still holding the
tensor it held), a pass of dictionary lookups; a module that changed gets a new plan. What the plan
cannot express (a name the module lacks, two tied names given at once) goes to
`torch.func.functional_call`, which defines the behaviour.

Traced (`torch.compile`), the plan is taken as the graph is traced and becomes a constant of it:
each slot by its submodule path, reached through `_modules` as the forward reaches it. Dynamo then
guards only what the swap and the forward read, where tracing `functional_call`'s walk over the
whole tree guarded every module's `_parameters`, `_buffers` and `_modules`, and each call paid for
those checks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any
from typing import cast

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
        # The same slots by address (submodule path, "_parameters" or "_buffers", key): a traced call
        # reaches them through the module, as its forward does.
        addresses: dict[int, list[tuple[str, str, str]]] = {}
        names: dict[str, int] = {}
        # Each slot with the tensor it holds now; tied names share one list of slots.
        self.held: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for attr, table in (("_parameters", owner._parameters), ("_buffers", owner._buffers)):
                for key, tensor in table.items():
                    if tensor is None:
                        continue
                    by_tensor.setdefault(id(tensor), []).append((table, key))
                    addresses.setdefault(id(tensor), []).append((prefix, attr, key))
                    names[f"{prefix}.{key}" if prefix else key] = id(tensor)
                    self.held.append((table, key, tensor))
        self.slots: dict[str, list[_Slot]] = {name: by_tensor[tensor_id] for name, tensor_id in names.items()}
        self.addresses = {name: tuple(addresses[tensor_id]) for name, tensor_id in names.items()}
        self.tied = {name for name, slots in self.slots.items() if len(slots) > 1}
        self.rnns = [m for m in module.modules() if isinstance(m, nn.RNNBase)]
        self.rnn_paths = tuple(path for path, m in module.named_modules() if isinstance(m, nn.RNNBase))

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


def _fits(plan: _Plan, names: Iterable[str]) -> bool:
    """Whether the plan can swap in tensors of these names (else `torch.func.functional_call` does)."""
    names = list(names)
    if any(name not in plan.slots for name in names):
        return False
    return not (plan.tied and sum(name in plan.tied for name in names) > 1)  # torch decides whether tied values agree


def _addresses(module: nn.Module, names: tuple[str, ...]) -> tuple[Any, ...] | None:
    """Each name's slots by address, and the RNNs' paths; None where the plan cannot swap these names."""
    plan = _plan(module)
    if not _fits(plan, names):
        return None
    return tuple(plan.addresses[name] for name in names), plan.rnn_paths


# Traced, run once as the graph is traced, its result a constant of the graph.
_traced_addresses: Callable[[nn.Module, tuple[str, ...]], tuple[Any, ...] | None] = (
    torch.compiler.assume_constant_result(_addresses)  # type: ignore[no-untyped-call]
)


def _submodule(module: nn.Module, path: str) -> nn.Module:
    # Through `_modules`, as a forward's `self.child` reads it: `get_submodule` would add a `hasattr` guard per level.
    for part in path.split(".") if path else ():
        module = cast(nn.Module, module._modules[part])  # the plan holds only paths to modules
    return module


def _slots(module: nn.Module, values: dict[str, torch.Tensor]) -> tuple[list[list[_Slot]], list[Any]] | None:
    """Each value's slots, in order (a tied name has several), and the module's RNNs; None where the plan cannot."""
    if torch.compiler.is_compiling():
        found = _traced_addresses(module, tuple(values))
        if found is None:
            return None
        addresses, rnn_paths = found
        slots = [[(getattr(_submodule(module, path), attr), key) for path, attr, key in each] for each in addresses]
        return slots, [_submodule(module, path) for path in rnn_paths]
    plan = _plan(module)
    if not _fits(plan, values):
        return None
    return [plan.slots[name] for name in values], plan.rnns


def swapped_call(
    module: nn.Module, values: dict[str, torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """`module(*args, **kwargs)` with `values` in place of its tensors of those names.

    Returns the output and the tensors the call left in the swapped slots where the module
    reassigned one (`self.buffer = new`), by name, as `torch.func.functional_call` writes them back.
    """
    found = _slots(module, values)
    if found is None:
        merged = dict(values)
        try:
            output = torch.func.functional_call(module, merged, args, kwargs, tie_weights=True, strict=False)
        finally:
            _reset_rnns(module.modules())
        return output, {name: merged[name] for name in values if merged[name] is not values[name]}
    slots, rnns = found
    saved = []
    for value, each in zip(values.values(), slots, strict=True):
        for table, key in each:
            saved.append((table, key, table[key]))
            table[key] = value
    try:
        output = module(*args, **kwargs)
    finally:
        reassigned = {}
        for (name, value), ((table, key), *_) in zip(values.items(), slots, strict=True):
            current = table.get(key)
            if current is not value and current is not None:
                reassigned[name] = current
        for table, key, original in reversed(saved):
            table[key] = original
        _reset_rnns(rnns)
    return output, reassigned


def _reset_rnns(modules: Any) -> None:
    # An RNN caches its weights in `_flat_weights`, which the call left on the tensors it was
    # given: compiled, the next trace would read the last step's (a transform's wrappers).
    for submodule in modules:
        if isinstance(submodule, nn.RNNBase):
            submodule._init_flat_weights()
