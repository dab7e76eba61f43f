"""Checks of loss-scale states where they enter: their structure (every call) and their values (once).

`check_scaler` is a static check each entry point runs; `check_scaler_values` reads the values on
the host, for states that did not come from `create` (the raw constructor, a loaded checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._loss_scale import DynamicLossScale
from fmp._loss_scale import LossScale
from fmp._loss_scale import NoOpLossScale
from fmp._scale_values import FLOAT32_MAX
from fmp._scale_values import FLOAT32_TINY

__all__ = ["ScalerTree", "check_scaler", "check_scaler_values", "check_scalers"]

ScalerTree = LossScale | tuple[LossScale, ...]
"""One loss-scale state, or a tuple of them, one per loss."""

_INT32_MAX = torch.iinfo(torch.int32).max


def check_scaler(scaler: Any) -> None:
    """Raises a TypeError naming the type unless `scaler` is one of fmp's loss-scale states of 0-dim tensors."""
    if not isinstance(scaler, LossScale):
        raise TypeError(
            f"scaler must be an fmp loss-scale state (e.g. DynamicLossScale.create()), got {type(scaler).__name__}"
        )
    if all(isinstance(leaf, torch.Tensor) and leaf.dim() == 0 for leaf in pytree.tree_leaves(scaler)):
        return
    name = type(scaler).__name__
    for path, leaf in py_pytree.tree_flatten_with_path(scaler)[0]:  # paths only for the message
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{name} holds a {type(leaf).__name__} where a tensor belongs; build it with {name}.create(...), "
                f"which checks and converts its arguments (the constructor takes tensors as they are)"
            )
        if leaf.dim() != 0:  # 0-dim per member under vmap; a stacked state outside it would broadcast
            raise ValueError(
                f"{name}{py_pytree.keystr(path)} has shape {tuple(leaf.shape)}, but a loss-scale state holds 0-dim "
                f"tensors: run a stacked state (fmp.stack_trees) under torch.func.vmap, or take one member "
                f"with fmp.unstack_tree"
            )


def _refuse(name: str, kind: str, field: str, problem: str) -> None:
    raise ValueError(f"{name}.{field} {problem}; build the state with {kind}.create(...) or load a sound checkpoint")


def check_scaler_values(scaler: Any, name: str = "scaler") -> None:
    """Raises a ValueError naming the field unless every value of a loss-scale state is in range.

    For states that did not come from `create` (the raw constructor, a loaded checkpoint): the
    scale is a real float32 tensor that requires no grad, positive, normal and, for a dynamic one,
    in `[min_scale, max_scale]`; the counters are int32 in range; the hyperparameters are those
    `create` accepts. Stacked states (an ensemble's) are checked member by member.

    Note: syncs with the host, to read the values; call it where a state enters, not per step.

    Args:
        scaler: The loss-scale state.
        name: What to call it in the error, e.g. "state.scaler[1]".

    Raises:
        TypeError: If `scaler` is not a loss-scale state.
        ValueError: Naming the first field out of range.
    """
    if not isinstance(scaler, LossScale):
        raise TypeError(f"{name} must be an fmp loss-scale state, got {type(scaler).__name__}")
    if isinstance(scaler, NoOpLossScale):
        return
    kind = type(scaler).__name__
    scale = scaler.loss_scale
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        found = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        _refuse(name, kind, "loss_scale", f"must be a float32 tensor, got {found}")
    if scale.requires_grad:
        _refuse(name, kind, "loss_scale", "requires grad (a scale is state, not a parameter: detach it)")
    low, high = FLOAT32_TINY, FLOAT32_MAX
    if isinstance(scaler, DynamicLossScale):
        try:
            checked = DynamicLossScale.create(
                init_scale=1.0,
                growth_factor=scaler.growth_factor,
                backoff_factor=scaler.backoff_factor,
                growth_interval=scaler.growth_interval,
                min_scale=min(scaler.min_scale, 1.0),
                max_scale=max(scaler.max_scale, 1.0),
                hysteresis=scaler.hysteresis,
                device="meta",
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name}: {error}") from None
        low, high = scaler.min_scale, scaler.max_scale
        if not checked.min_scale <= low <= high <= checked.max_scale:
            _refuse(
                name,
                kind,
                "min_scale/max_scale",
                f"must satisfy {FLOAT32_TINY} <= min_scale <= max_scale, got {low}, {high}",
            )
        for field, top in (("growth_tracker", scaler.growth_interval - 1), ("overflow_streak", _INT32_MAX)):
            counter = getattr(scaler, field)
            if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int32:
                kind_found: object = counter.dtype if isinstance(counter, torch.Tensor) else type(counter).__name__
                _refuse(name, kind, field, f"must be an int32 tensor, got {kind_found}")
            if not counter.is_meta and not bool(((counter >= 0) & (counter <= top)).all()):
                _refuse(name, kind, field, f"must lie in [0, {top}], got {counter.tolist()}")
    if not scale.is_meta and not bool((torch.isfinite(scale) & (scale >= low) & (scale <= high)).all()):
        _refuse(name, kind, "loss_scale", f"must be a finite scale in [{low}, {high}], got {scale.tolist()}")


def check_scalers(scaler: Any) -> None:
    """Raises a TypeError unless `scaler` is a loss-scale state or a non-empty tuple of them."""
    if isinstance(scaler, tuple):
        if not scaler:
            raise TypeError("scaler is an empty tuple; pass one loss-scale state per loss")
        for index, item in enumerate(scaler):
            if not isinstance(item, LossScale):
                raise TypeError(
                    f"scaler[{index}] must be an fmp loss-scale state (e.g. DynamicLossScale.create()), "
                    f"got {type(item).__name__}"
                )
            try:
                check_scaler(item)
            except (TypeError, ValueError) as error:
                raise type(error)(f"scaler[{index}]: {error}") from None
        return
    check_scaler(scaler)
