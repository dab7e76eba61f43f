"""Validating a loaded state's loss scales and counters, which a training step trusts without checking."""

from __future__ import annotations

from typing import Any

import torch

from fmp._accumulate import GradientAccumulator
from fmp._delayed_scaling import DelayedScalingState
from fmp._delayed_scaling import check_fp8_states
from fmp._loss_scale import LossScale
from fmp._scale_checks import check_scaler_values
from fmp._state import StepCounts
from fmp._struct import state_classes
from fmp.serialization._structure import children

__all__ = ["check_values"]

_INT32_MAX = torch.iinfo(torch.int32).max


def _check_counter(counter: Any, where: str, high: int) -> None:
    if not isinstance(counter, torch.Tensor) or counter.is_floating_point() or counter.is_complex():
        found = counter.dtype if isinstance(counter, torch.Tensor) else type(counter).__name__
        raise ValueError(f"{where} must be an integer tensor, got {found}; load a checkpoint fmp wrote from its state")
    if counter.dtype == torch.bool:
        raise ValueError(f"{where} must be an integer tensor, got torch.bool; load a checkpoint fmp wrote")
    if counter.is_meta:
        return
    if not bool(((counter >= 0) & (counter <= high)).all()):
        raise ValueError(
            f"{where} must lie in [0, {high}], got {counter.tolist()}: the checkpoint was corrupted or edited; "
            f"load an earlier one, or rebuild the state with TrainState.create"
        )


def _counters(node: Any) -> list[tuple[str, Any, int]]:
    """The counters a node of fmp's own holds: (field, tensor, largest value)."""
    if isinstance(node, StepCounts):
        return [
            (f".{field}", value, torch.iinfo(torch.int64).max) for field, value in zip(node._fields, node, strict=True)
        ]
    if isinstance(node, GradientAccumulator):
        return [(".micro_steps", node.micro_steps, node.steps - 1)]
    # An optimizer's state (fmp.optim's, which this layer does not import) counts its updates in `step`.
    if type(node) in state_classes() and hasattr(node, "step"):
        return [(".step", node.step, _INT32_MAX)]
    return []


def check_values(state: Any, where: str = "state") -> None:
    """Raises naming the field unless every loss scale and counter in `state` is in range.

    Loss scales (one, or a tuple for several losses, anywhere in the tree) pass
    `check_scaler_values`; `StepCounts`, a `GradientAccumulator`'s `micro_steps` and an
    optimizer's `step` are integer tensors in range.

    Note: syncs with the host, to read the values; call it where a state enters, not per step.

    Raises:
        ValueError: Naming the path of the first field out of range.
    """
    if isinstance(state, LossScale):
        check_scaler_values(state, where)
        return
    if isinstance(state, DelayedScalingState):
        check_fp8_states(state, where)  # its scales and amax history, by value
        return
    for field, counter, high in _counters(state):
        _check_counter(counter, where + field, high)
    spec, nodes = children(state)
    if spec.is_leaf():
        return
    for key, child in nodes:
        check_values(child, where + key)
