"""A `torch.nn.Module` as pure state: trainable params and buffers apart, called functionally, written back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fmp.nn._swap import swapped_call

__all__ = ["call", "split", "write_back"]


def _check_module(module: Any, what: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what} needs an nn.Module, got {type(module).__name__}")


def split(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Splits `module` into its trainable params and its buffers, as detached tensors sharing its storage.

    The short path to a step's state: `params, buffers = fmp.nn.split(model)`, then
    `TrainState.create(params, optimizer, scaler, model_state=buffers)`. Trainable params are
    those that require grad; frozen ones (`requires_grad_(False)`) stay in the module, which
    `call` reads them from, so the optimizer never sees them. Tied weights (an output layer
    sharing its embedding's weight) are one tensor listed once, under the first name
    `named_parameters()` gives, so they stay tied through training. Buffers are the persistent
    ones (those `state_dict()` saves: BatchNorm's running statistics and batch count); a
    non-persistent buffer is a constant the module rebuilds (a rotary table, a causal mask) and
    stays in the module.

    Args:
        module: The model.

    Returns:
        `(params, buffers)`: dicts from dotted name to tensor.

    Raises:
        TypeError: If `module` is not an `nn.Module`.
    """
    _check_module(module, "fmp.nn.split")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    buffers = {name: b.detach() for name, b in _persistent_buffers(module)}
    return params, buffers


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`named_buffers()` less the non-persistent ones, each buffer once."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for prefix, owner in module.named_modules():
        for name, buffer in owner.named_buffers(prefix=prefix, recurse=False):
            if name.rpartition(".")[2] not in owner._non_persistent_buffers_set:
                found.setdefault(id(buffer), (name, buffer))
    return list(found.values())


def call(
    module: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], /, *args: Any, **kwargs: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Calls `module(*args, **kwargs)` with `params` and `buffers` in place of its own; returns the buffers after.

    As `torch.func.functional_call` with both dicts: a train-mode BatchNorm updates the running
    statistics in `buffers` in place, and they are returned as the model's new state, as is a
    buffer the module assigns anew (`self.count = self.count + 1`). In a step
    the buffers are the step's own copies (see `fmp.train_step`); called elsewhere, pass copies
    to keep yours. Names missing from both dicts (frozen params, non-persistent buffers) are
    read from the module; tied weights follow the name `split` gave them.

    Args:
        module: The model.
        params: Its params by name, e.g. from `split`.
        buffers: Its buffers by name, e.g. from `split` (an empty dict for a model without).
        *args: The module's positional arguments.
        **kwargs: Its keyword arguments.

    Returns:
        `(output, buffers)`.

    Raises:
        TypeError: If `module` is not an `nn.Module` or a name is in both dicts.
    """
    _check_module(module, "fmp.nn.call")
    shared = params.keys() & buffers.keys()
    if shared:
        raise TypeError(f"fmp.nn.call: {sorted(shared)[0]!r} is both in params and in buffers")
    output, reassigned = swapped_call(module, {**params, **buffers}, args, kwargs)
    if any(name in buffers for name in reassigned):
        # A module that assigns a new tensor to a buffer (`self.count = self.count + 1`) returns it too.
        buffers = {name: reassigned.get(name, tensor) for name, tensor in buffers.items()}
    return output, buffers


def write_back(
    module: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Copies trained `params` and `buffers` into `module`'s own tensors, for evaluation or `state_dict()`.

    Tied weights are one parameter in the module, written once. Under no_grad; the module's
    tensors keep their dtypes and devices (values are cast to them).

    Note: a step with `donate=True` already writes into the tensors `split` returned, which share
    the module's storage; then this copies each tensor onto itself.

    Args:
        module: The model `params` and `buffers` came from.
        params: Params by name (a state's `params`).
        buffers: Buffers by name (a state's `model_state`).

    Raises:
        TypeError: If `module` is not an `nn.Module`.
        KeyError: Naming a name the module has no parameter or buffer of.
        ValueError: Naming a tensor whose shape differs from the module's.
    """
    _check_module(module, "fmp.nn.write_back")
    own = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, value in [*params.items(), *(buffers or {}).items()]:
            if name not in own:
                raise KeyError(f"fmp.nn.write_back: the module has no parameter or buffer named {name!r}")
            target = own[name]
            if target.shape != value.shape:
                raise ValueError(
                    f"fmp.nn.write_back: {name!r} has shape {tuple(value.shape)}, the module's {tuple(target.shape)}"
                )
            if target.data_ptr() != value.data_ptr():
                target.copy_(value)
