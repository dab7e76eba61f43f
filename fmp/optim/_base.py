"""What the optimizers share: learning rates and schedules, and checks of the trees an update takes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import TypeAlias
from typing import cast

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._checks import check_real
from fmp._tree import tree_accelerator_device

__all__ = [
    "LearningRate",
    "Schedule",
    "check_lr",
    "check_schedule_start",
    "check_schedule_value",
    "check_state",
    "first_sparse_gradient",
    "leaves_like_params",
    "scheduled_lr",
    "step_counter",
    "tree_zeros_like",
    "unflatten_as",
]

Schedule: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
"""`lr(count) -> 0-dim floating tensor`, `count` the 0-dim int32 tensor of applied steps so far."""

LearningRate: TypeAlias = float | Schedule
"""What the optimizers' `lr` takes: a fixed float or a `Schedule`."""


def check_state(name: str, state: Any, expected: type) -> None:
    """Raises unless `state` is the state type optimizer `name` creates."""
    if not isinstance(state, expected):
        raise TypeError(
            f"{name} got optimizer state of type {type(state).__name__}, expected {expected.__name__}: "
            f"was it created by another optimizer's init?"
        )


def check_optimizable_params(name: str, params: Any) -> None:
    """Raises a TypeError naming the first leaf of `params` that is not a floating-point or complex tensor.

    An optimizer's arithmetic would otherwise fail deep inside torch (`None`, an integer tensor's
    lerp) or, worse, promote an integer param to float32 and hand it back in another dtype.
    """
    for path, param in py_pytree.tree_flatten_with_path(params)[0]:
        if isinstance(param, torch.Tensor) and (param.is_floating_point() or param.is_complex()):
            continue
        found = f"a {param.dtype} tensor" if isinstance(param, torch.Tensor) else f"a {type(param).__name__}"
        raise TypeError(
            f"{name}: params{py_pytree.keystr(path)} is {found}; an optimizer updates floating-point or complex "
            f"tensors only (leave integer buffers and None out of params)"
        )


def leaves_like_params(
    name: str, params: Any, trees: Mapping[str, Any]
) -> tuple[pytree.TreeSpec, list[Any], list[list[Any]], list[pytree.TreeSpec | None]]:
    """Flattens `params` and `trees`, checking each has the params' structure, leaf shapes, dtypes and devices.

    A static check (no host sync) that costs nothing over the flattening an update needs anyway:
    it catches an optimizer state made for another model, which torch would otherwise report deep
    inside an op or, for a shape that broadcasts, not at all, and it names the first key that differs.

    Args:
        name: The optimizer, for the message.
        params: The parameters.
        trees: The trees that must line up with them (gradients, moment buffers), by name.

    Returns:
        `(spec, param_leaves, leaves, specs)`: the params' tree spec and leaves; each of `trees`'
        leaves, in the order given, each in the params' order (a dict whose keys come in another
        order is taken key by key, as `tree_map` takes it); and each tree's own spec where it
        differs so (else None), for `unflatten_as`.

    Raises:
        TypeError: Naming the first param that is not a floating-point or complex tensor.
        ValueError: Naming the tree and the first key, shape, dtype or device that differs.
    """
    param_leaves, param_spec = pytree.tree_flatten(params)
    if not all(isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) for x in param_leaves):
        check_optimizable_params(name, params)  # names the leaf (a path flatten only for the message)
    all_leaves, own_specs = [], []
    on_cpu = all(p.is_cpu for p in param_leaves)
    shapes_and_dtypes = [(p.shape, p.dtype) for p in param_leaves] if on_cpu else []
    for what, tree in trees.items():
        hint = "; was the optimizer state created for other params?" if what.startswith("opt_state") else ""
        leaves, spec = pytree.tree_flatten(tree)
        own_specs.append(None if spec == param_spec else spec)
        if own_specs[-1] is not None:
            try:  # the same keys, in another dict order (as tree_map takes them): the params' order
                leaves = pytree.flatten_up_to(param_spec, tree)
            except (ValueError, TypeError):
                difference = _first_difference(params, tree, what)
                raise ValueError(f"{name}: {what} must have the params' structure, but {difference}{hint}") from None
        # The usual tree, tensors like the params leaf for leaf on the CPU, passes without a look at each pair.
        plain = on_cpu and all(isinstance(x, torch.Tensor) and x.is_cpu for x in leaves)
        if plain and [(x.shape, x.dtype) for x in leaves] == shapes_and_dtypes:
            all_leaves.append(leaves)
            continue
        for index, (param, leaf) in enumerate(zip(param_leaves, leaves, strict=True)):
            if not isinstance(param, torch.Tensor):
                continue
            if not (isinstance(leaf, torch.Tensor) and leaf.shape == param.shape):
                # Key paths only for the message: flattening with them costs ~10x a plain flatten.
                key = py_pytree.keystr(py_pytree.tree_flatten_with_path(params)[0][index][0])
                found = f"shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else f"a {type(leaf).__name__}"
                raise ValueError(
                    f"{name}: {what}{key} is {found}, but params{key} has shape {tuple(param.shape)}{hint}"
                )
            if leaf.dtype != param.dtype:  # torch would promote the new params to it, or fail inside an op
                key = py_pytree.keystr(py_pytree.tree_flatten_with_path(params)[0][index][0])
                raise ValueError(f"{name}: {what}{key} is {leaf.dtype}, but params{key} is {param.dtype}{hint}")
            # A state loaded with map_location="cpu", say, the params moved. `is_cpu` first: a property
            # read, where `.device` builds a device object per leaf.
            if not (leaf.is_cpu and param.is_cpu) and leaf.device != param.device:
                key = py_pytree.keystr(py_pytree.tree_flatten_with_path(params)[0][index][0])
                raise ValueError(
                    f"{name}: {what}{key} is on {leaf.device}, but params{key} is on {param.device}; "
                    f"move it with the params"
                )
        all_leaves.append(leaves)
    return param_spec, param_leaves, all_leaves, own_specs


def first_sparse_gradient(grads: Any, grad_leaves: list[Any]) -> tuple[str, torch.layout] | None:
    """The key path and layout of the first gradient in `grads` that is not dense (strided), or None.

    `grad_leaves` are `grads`' leaves, already flattened; the paths are only built when one is found.
    """
    for index, grad in enumerate(grad_leaves):
        if isinstance(grad, torch.Tensor) and grad.layout != torch.strided:
            return py_pytree.keystr(py_pytree.tree_flatten_with_path(grads)[0][index][0]), grad.layout
    return None


def unflatten_as(leaves: list[Any], param_spec: pytree.TreeSpec, spec: pytree.TreeSpec | None) -> Any:
    """Leaves in the params' order as a tree of `spec` (the params' structure where None).

    An optimizer's new state keeps the structure it was given, dict order included, so a step
    that keeps the old state leaf by leaf (a skipped one) finds the two alike.
    """
    tree = pytree.tree_unflatten(leaves, param_spec)
    return tree if spec is None else pytree.tree_unflatten(pytree.flatten_up_to(spec, tree), spec)


def _first_difference(params: Any, tree: Any, what: str) -> str:
    """Where `tree`'s structure first departs from that of `params`, in words."""
    param_keys = [py_pytree.keystr(path) for path, _ in py_pytree.tree_flatten_with_path(params)[0]]
    keys = [py_pytree.keystr(path) for path, _ in py_pytree.tree_flatten_with_path(tree)[0]]
    first = next((i for i, pair in enumerate(zip(param_keys, keys, strict=False)) if pair[0] != pair[1]), None)
    if first is not None:
        return f"they differ at params{param_keys[first]} where {what} has {what}{keys[first]}"
    if len(param_keys) > len(keys):
        return f"they differ at params{param_keys[len(keys)]}, which {what} lacks"
    if len(keys) > len(param_keys):
        return f"they differ at {what}{keys[len(param_keys)]}, which params lack"
    ours, theirs = pytree.spec_str(pytree.tree_structure(params)), pytree.spec_str(pytree.tree_structure(tree))
    return f"the same keys sit in other containers ({ours} vs {theirs})"


def check_lr(lr: Any) -> LearningRate:
    """Returns `lr` as a float in [0, inf), or as is if it is a schedule (any callable).

    Raises:
        TypeError: If `lr` is neither a real number nor callable.
        ValueError: If `lr` is a negative or NaN number.
    """
    if callable(lr):
        return lr  # type: ignore[no-any-return]
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(
            f"lr must be a real number or a schedule, a callable lr(count) -> 0-dim floating tensor "
            f"(see fmp.optim.schedule), got {type(lr).__name__}"
        )
    return check_real("lr", lr, 0.0, math.inf)


def check_schedule_start(lr: LearningRate, count: torch.Tensor, name: str) -> None:
    """Raises unless a schedule's lr at `count` and `count + 1` is a finite number >= 0.

    Optimizers call it in `init` with their fresh step counter (on the params' device): an lr that
    is infinite at the first steps (an unguarded inverse square root of the count) or negative (a
    decay that overshoots) would write NaN into the params or ascend the loss, and the step never
    reads values to catch it. Later counts are not checked. Skipped for a float `lr`, under
    torch.compile and torch.func transforms, and where the lr has no value to read (`meta`).

    Note: syncs with the host twice, in `init`, never in a step; it calls the schedule twice.

    Raises:
        TypeError, ValueError: If the schedule returns no 0-dim floating tensor on the count's device.
        ValueError: If it returns an infinite, NaN or negative lr there.
    """
    if not callable(lr) or torch.compiler.is_compiling():
        return
    for offset in (0, 1):
        value = cast(torch.Tensor, scheduled_lr(lr, count + offset))  # a schedule's value is a tensor
        if value.is_meta or torch._C._functorch.is_functorch_wrapped_tensor(value):
            return
        if not bool(torch.isfinite(value) & (value >= 0)):
            raise ValueError(
                f"{name}: the lr schedule returned {float(value)} at count {int(count) + offset}; an lr must be a "
                f"finite number >= 0 (guard the first steps, e.g. rsqrt(count.clamp(min=1)), or clamp a decay at 0)"
            )


def check_schedule_value(value: Any, name: str = "the lr schedule") -> torch.Tensor:
    """Returns `value` if it is a 0-dim floating tensor, else raises naming `name` (a static check)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must return a 0-dim floating tensor computed from count with torch ops, "
            f"got {type(value).__name__} (a Python number would be fixed at trace time)"
        )
    if value.dim() != 0 or not value.is_floating_point():
        raise ValueError(
            f"{name} must return a 0-dim floating tensor, got dtype={value.dtype} shape={tuple(value.shape)}"
        )
    return value


def scheduled_lr(lr: LearningRate, count: torch.Tensor) -> float | torch.Tensor:
    """`lr` itself when it is a float, else the schedule's value at `count` (checked, on device)."""
    if isinstance(lr, float):
        return lr
    value = check_schedule_value(lr(count))
    if value.device != count.device:
        raise ValueError(
            f"the lr schedule returned a tensor on {value.device} for a step count on {count.device}; "
            f"compute it from the count (e.g. torch.full_like(count, lr, dtype=torch.float64))"
        )
    return value


def step_counter(params: Any) -> torch.Tensor:
    """A 0-dim int32 zero where the step's finite flag lives: the params' first accelerator, else CPU."""
    return torch.zeros((), dtype=torch.int32, device=tree_accelerator_device(params))


def tree_zeros_like(tree: Any) -> Any:
    """Zeros shaped like every tensor leaf of `tree`."""
    return pytree.tree_map(torch.zeros_like, tree)
