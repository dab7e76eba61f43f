"""A moving average of the params, kept in the optimizer state, so a skipped step leaves it alone."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._checks import check_real
from fmp._optimizer import Optimizer
from fmp._struct import serializable_namedtuple
from fmp.optim._base import check_state
from fmp.optim._base import step_counter
from fmp.optim._base import unflatten_as

__all__ = ["EmaState", "ema"]


@serializable_namedtuple
class EmaState(NamedTuple):
    """State of `ema`.

    Attributes:
        step: Averaged updates so far, a 0-dim int32 tensor (the first one copies the params).
        average: The moving average of the params, shaped like them; float16 and bfloat16 leaves
            are averaged in float32, others in their own dtype.
        inner: The wrapped optimizer's state.
    """

    step: torch.Tensor
    average: Any
    inner: Any


def _average_dtype(dtype: torch.dtype) -> torch.dtype:
    # A 16-bit average would lose what it exists for: decay 0.999 moves it by 0.1% of the
    # difference, below half a bfloat16 spacing for anything but a large jump.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ema(optimizer: Optimizer, decay: float = 0.999) -> Optimizer:
    """Wraps `optimizer` to keep an exponential moving average of the params it returns.

    After each update, `average = decay * average + (1 - decay) * new_params`, computed as
    `torch.lerp(average, new_params, 1 - decay)`; the first update copies the new params. This is
    `torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))` with
    `update_parameters` called after every `optimizer.step()`: eager and in float32 the averages
    are bit for bit torch's (compiled, Inductor may fuse the lerp into the update and round its
    last bit otherwise). Like `AveragedModel`'s default (`use_buffers=False`) it averages the
    params only, not buffers such as BatchNorm's running statistics. As the average lives in the
    optimizer state, a skipped mixed-precision step keeps it unchanged, where an `AveragedModel`
    updated after a step GradScaler skipped counts that step's params once more. Evaluate with
    `state.opt_state.average` as the params.

    Params in float16 or bfloat16 are averaged in float32, so bfloat16 training keeps a float32
    average; cast it when evaluating in 16 bits. Wrap it outermost, around
    `fmp.optim.stochastic_rounding` (which refuses it inside), so that it averages the bfloat16
    params the model holds. Nothing syncs with the host.

    Args:
        optimizer: The pure optimizer to wrap, e.g. `fmp.optim.adamw(1e-3)`.
        decay: The average's decay per update, in [0, 1] (0 keeps the latest params, 1 the first).

    Returns:
        An optimizer whose state is an `EmaState`.

    Raises:
        TypeError, ValueError: If `optimizer` is not an fmp Optimizer or `decay` is not a number
            in [0, 1]. `update` raises a ValueError naming the first leaf whose average does not
            match the params.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"ema wraps an fmp.optim.Optimizer, got {type(optimizer).__name__}")
    decay = check_real("decay", decay, 0.0, 1.0, high_inclusive=True)
    weight = 1.0 - decay

    def init(params: Any) -> EmaState:
        for path, param in py_pytree.tree_flatten_with_path(params)[0]:
            if not (isinstance(param, torch.Tensor) and (param.is_floating_point() or param.is_complex())):
                found = param.dtype if isinstance(param, torch.Tensor) else type(param).__name__
                raise TypeError(f"ema: params{py_pytree.keystr(path)} is {found}; it averages floating tensors")
        average = pytree.tree_map(lambda p: p.detach().to(_average_dtype(p.dtype), copy=True), params)
        return EmaState(step_counter(params), average, optimizer.init(params))

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, EmaState]:
        check_state("ema", state, EmaState)
        new_params, new_inner = optimizer.update(grads, state.inner, params)
        param_leaves, spec = pytree.tree_flatten(new_params)
        average_leaves, average_spec = pytree.tree_flatten(state.average)
        if average_spec != spec:
            try:  # the same keys in another dict order: taken key by key, and kept in the state's order
                average_leaves = pytree.flatten_up_to(spec, state.average)
            except (TypeError, ValueError):
                raise ValueError(
                    f"ema: opt_state.average must have the params' structure, got "
                    f"{pytree.spec_str(average_spec)} for params {pytree.spec_str(spec)}; "
                    f"was the state created for other params?"
                ) from None
        first = state.step == 0
        averages = []
        for index, (param, average) in enumerate(zip(param_leaves, average_leaves, strict=True)):
            expected = _average_dtype(param.dtype)
            if not (isinstance(average, torch.Tensor) and average.shape == param.shape and average.dtype == expected):
                # Key paths only for the message: flattening with them costs several times a plain flatten.
                key = py_pytree.keystr(py_pytree.tree_flatten_with_path(new_params)[0][index][0])
                found = f"{average.dtype}{list(average.shape)}" if isinstance(average, torch.Tensor) else "no tensor"
                raise ValueError(
                    f"ema: opt_state.average{key} is {found}, expected {expected}{list(param.shape)} for "
                    f"params{key}; was the state created for other params?"
                )
            new = param if param.dtype == expected else param.to(expected)
            averages.append(torch.where(first, new, torch.lerp(average, new, weight)))
        average = unflatten_as(averages, spec, None if average_spec == spec else average_spec)
        return new_params, EmaState(state.step + 1, average, new_inner)

    return Optimizer(init, update)
