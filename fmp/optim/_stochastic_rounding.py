"""bfloat16 parameters without a float32 master copy: any optimizer, its result rounded stochastically."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._checks import check_int
from fmp._optimizer import Optimizer
from fmp._rounding import stochastic_round
from fmp._struct import serializable_namedtuple
from fmp.optim._base import check_state
from fmp.optim._base import step_counter
from fmp.optim._ema import EmaState

__all__ = ["StochasticRoundingState", "stochastic_rounding"]

_STATE_DTYPES = (torch.float32, torch.bfloat16)


@serializable_namedtuple
class StochasticRoundingState(NamedTuple):
    """State of `stochastic_rounding`.

    Attributes:
        step: Updates so far, a 0-dim int32 tensor; with the seed it keys each update's random bits.
        inner: The wrapped optimizer's state.
    """

    step: torch.Tensor
    inner: Any


def _is_bfloat16(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16


def _to_float32(leaf: Any) -> Any:
    return leaf.to(torch.float32) if _is_bfloat16(leaf) else leaf


def _state_leaf_to_bfloat16(leaf: Any) -> Any:
    # Per-element buffers (moments) only: a 0-dim float32 leaf may be a counter or a running scalar,
    # which bfloat16's 8 bits would hold too coarsely.
    is_buffer = isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32 and leaf.dim() > 0
    return leaf.to(torch.bfloat16) if is_buffer else leaf


def _is_ema_state(node: Any) -> bool:
    return isinstance(node, EmaState)


def _check_params(params: Any) -> None:
    for path, leaf in py_pytree.tree_flatten_with_path(params)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float16:
            raise TypeError(
                f"stochastic_rounding: params{py_pytree.keystr(path)} is float16; it rounds bfloat16 params "
                f"(float16's range needs a loss scale: keep float16 training's params in float32)"
            )


def stochastic_rounding(optimizer: Optimizer, *, seed: int = 0, state_dtype: torch.dtype = torch.float32) -> Optimizer:
    """Wraps `optimizer` to keep bfloat16 params in bfloat16, updated in float32 and rounded stochastically.

    Pure bfloat16 training halves the parameters' memory and drops the float32 master copy that
    apex O2 and Megatron keep, but rounding each update to nearest loses every change below half
    a bfloat16 spacing (~0.4% of the value): late in training most updates vanish and the loss
    stalls. Here the inner optimizer runs in float32 on the bfloat16 params and gradients cast up,
    and its new params are rounded to bfloat16 with `fmp.stochastic_round`, whose result is
    unbiased: small updates add up on average.

    Leaves in float32 or float64 pass through the inner optimizer exactly (with the default
    `state_dtype`); float16 leaves are refused. With `state_dtype=torch.bfloat16` the inner state's
    float32 leaves of one or more dimensions (Adam's moments, those of float32 params included)
    are kept in bfloat16 too and rounded the same way, which halves the optimizer's memory as well;
    0-dim float32 leaves (counters, running scalars) stay float32.
    The random bits come from `seed` and the state's update count (`step`), so the optimizer stays a pure
    function and needs no generator: a skipped mixed-precision step keeps it, and the next
    update draws what the skipped one would have. Nothing syncs with the host.

    Use it with a policy that keeps params in bfloat16, e.g.
    `fmp.get_policy("params=bfloat16,compute=bfloat16,output=float32")` and `fmp.NoOpLossScale.create()`.

    Args:
        optimizer: The pure optimizer to wrap, e.g. `fmp.optim.adamw(1e-3)`.
        seed: Chooses the random bits, an int in [0, 2**31).
        state_dtype: `torch.float32` (the default) or `torch.bfloat16`, the dtype of the inner state's
            per-element float32 leaves.

    Returns:
        An optimizer whose state is a `StochasticRoundingState`.

    Raises:
        TypeError, ValueError: If `optimizer` is not an fmp Optimizer, `seed` is not an int in range,
            or `state_dtype` is neither float32 nor bfloat16. `init` raises a TypeError for a
            float16 parameter, or for an `fmp.optim.ema` inside (wrap it outside instead).
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"stochastic_rounding wraps an fmp.optim.Optimizer, got {type(optimizer).__name__}")
    seed = check_int("seed", seed, 0, 2**31 - 1)
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}")
    # Each update rounds a leaf with key seed * 2**32 + step * leaves + index: distinct for every
    # leaf and update (for 2**32 / leaves updates), and different seeds never share a key.
    seed_offset = seed << 32

    def init(params: Any) -> StochasticRoundingState:
        _check_params(params)
        inner = optimizer.init(pytree.tree_map(_to_float32, params))
        if any(isinstance(node, EmaState) for node in pytree.tree_leaves(inner, is_leaf=_is_ema_state)):
            raise TypeError(
                "stochastic_rounding: the wrapped optimizer keeps an fmp.optim.ema average, which would average "
                "the float32 params before rounding, not the bfloat16 ones the model holds; wrap ema outside: "
                "ema(stochastic_rounding(...))"
            )
        if state_dtype == torch.bfloat16:
            inner = pytree.tree_map(_state_leaf_to_bfloat16, inner)
        return StochasticRoundingState(step_counter(params), inner)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, StochasticRoundingState]:
        check_state("stochastic_rounding", state, StochasticRoundingState)
        param_leaves, param_spec = pytree.tree_flatten(params)
        state_leaves, state_spec = pytree.tree_flatten(state.inner)
        new_params, new_inner = optimizer.update(
            pytree.tree_map(_to_float32, grads),
            pytree.tree_unflatten([_to_float32(x) for x in state_leaves], state_spec),
            pytree.tree_unflatten([_to_float32(x) for x in param_leaves], param_spec),
        )
        new_state_leaves, new_state_spec = pytree.tree_flatten(new_inner)
        if new_state_spec != state_spec:
            raise ValueError(
                "stochastic_rounding: the wrapped optimizer's update returned a state of another structure "
                f"than it was given ({pytree.spec_str(new_state_spec)} vs {pytree.spec_str(state_spec)})"
            )
        first_key = state.step.to(torch.int64) * (len(param_leaves) + len(state_leaves)) + seed_offset
        rounded = [
            stochastic_round(new, first_key + index) if _is_bfloat16(old) else new
            for index, (old, new) in enumerate(
                zip([*param_leaves, *state_leaves], [*pytree.tree_leaves(new_params), *new_state_leaves], strict=True)
            )
        ]
        return (
            pytree.tree_unflatten(rounded[: len(param_leaves)], param_spec),
            StochasticRoundingState(
                state.step + 1, pytree.tree_unflatten(rounded[len(param_leaves) :], new_state_spec)
            ),
        )

    return Optimizer(init, update)
