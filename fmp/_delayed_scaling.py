"""Delayed scaling (Transformer Engine's DelayedScaling) as a pytree state and a pure update.

Transformer Engine keeps each FP8 tensor's amax history in module buffers and updates them in a
global registry when its autocast exits. Here the history and the scales are the fields of a
`DelayedScalingState`, one per FP8 linear layer, and `state.update(amaxes)` returns the next
state: no buffers, no registry, no host sync, so it compiles, vmaps over an ensemble, and saves
and loads with every other state. `fmp.train_step` updates the states in `TrainState.fp8` (see
`fmp._fp8_step`).

The update, per tensor (a linear's input, weight and output gradient), for a history of length L
whose row 0 is this step's slot:

    history[0] = amax of this step, or 0 where it is not finite
    amax = max(history) ("max") or history[0] ("most_recent")
    scale = fp8_max / amax / 2^margin, kept as it was where amax is 0,
            float32's largest where it overflows
    history = history rolled up one row (row 0 to row L-1), row 0 zeroed for the next step

A NaN or inf amax (a step whose values overflowed, which fmp's step skips anyway) is not
recorded: it says nothing about the range of the next steps, and kept in the history it would
freeze the scale for `history_len` steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._checks import check_int
from fmp._checks import check_real
from fmp._fp8_formats import Role
from fmp._fp8_formats import check_format
from fmp._fp8_formats import format_dtype
from fmp._fp8_formats import max_finite
from fmp._struct import pytree_dataclass
from fmp._struct import replace
from fmp._struct import static_field

__all__ = [
    "ROLES",
    "DelayedScaling",
    "DelayedScalingState",
    "Fp8Scales",
    "check_fp8_state_shapes",
    "check_fp8_states",
    "delayed",
]

ROLES: tuple[Role, ...] = ("input", "weight", "grad_output")
"""The tensors of an FP8 linear that a `DelayedScalingState` scales, in the order of its columns."""

_AMAX_COMPUTE = ("max", "most_recent")


@pytree_dataclass
class DelayedScalingState:
    """One FP8 linear layer's delayed-scaling state: the amax history and the scales of its three tensors.

    Made by `DelayedScaling.init()`; the recipe's `amax_compute`, `margin` and `format` are static
    (they live in the treespec), so `update` needs nothing else.

    Attributes:
        amax_history: float32 (history_len, 3): recent amaxes per tensor (columns in `ROLES`
            order); row 0 is the current step's slot, zero until the step's amaxes are recorded.
        scale: float32 (3,): what each tensor is multiplied by before its FP8 cast this step
            (the output gradient's for the unscaled gradient: see `Fp8Scales`).
        amax_compute: "max" or "most_recent".
        margin: Scales are divided by 2^margin.
        format: "hybrid", "e4m3" or "e5m2".
    """

    PUBLIC_NAMESPACE = "fmp.fp8"  # exported there; train_step, in the core, threads it

    amax_history: torch.Tensor
    scale: torch.Tensor
    amax_compute: str = static_field()
    margin: float = static_field()
    format: str = static_field()

    def update(self, amaxes: torch.Tensor) -> DelayedScalingState:
        """Records this step's amaxes and returns the state for the next step (see the module's formula).

        `record(amaxes)` then `advance()`. Pure and branch-free: a NaN or inf amax (an overflowed
        step) is recorded as 0.

        Args:
            amaxes: float32 (3,): the amaxes of this step's input, weight and output gradient,
                as `fp8_linear`'s gradient with respect to its scales gives them.

        Returns:
            The next state, of the same shapes.

        Raises:
            ValueError: If `amaxes` is not of shape (3,).
        """
        return self.record(amaxes).advance()

    def record(self, amaxes: torch.Tensor) -> DelayedScalingState:
        """The state with row 0 of its history, the step's slot, raised to `amaxes` where they are larger.

        With gradient accumulation each micro-batch records its amaxes, and the window's step
        advances once over their maximum. A NaN or inf amax is recorded as 0.

        Raises:
            ValueError: If `amaxes` is not of shape (3,).
        """
        if not isinstance(amaxes, torch.Tensor) or amaxes.shape != (len(ROLES),):
            got = tuple(amaxes.shape) if isinstance(amaxes, torch.Tensor) else type(amaxes).__name__
            raise ValueError(
                f"amaxes must be a tensor of shape ({len(ROLES)},) (input, weight, grad_output), got {got}"
            )
        amaxes = amaxes.detach().float()
        amaxes = torch.where(torch.isfinite(amaxes), amaxes, 0.0)
        slot = torch.maximum(self.amax_history[0], amaxes)
        return replace(self, amax_history=torch.cat([slot[None], self.amax_history[1:]]))

    def advance(self) -> DelayedScalingState:
        """The state for the next step: scales from the history (row 0 holding this step's amaxes), rolled."""
        amax = self.amax_history.amax(dim=0) if self.amax_compute == "max" else self.amax_history[0]
        # Filled on the device: a tensor built from a list would be copied from the host every step.
        maxima = torch.cat(
            [torch.full_like(amax[i : i + 1], max_finite(format_dtype(self.format, r))) for i, r in enumerate(ROLES)]
        )
        scale = maxima / amax / 2.0**self.margin
        scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
        scale = torch.where(amax > 0, scale, self.scale)
        return replace(self, amax_history=_cleared(torch.roll(self.amax_history, -1, dims=0)), scale=scale)

    def cleared(self) -> DelayedScalingState:
        """The state with row 0 of its history, the step's slot, zeroed: as it was before `record`."""
        return replace(self, amax_history=_cleared(self.amax_history))


def _cleared(history: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(history[:1]), history[1:]])


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling's configuration; `delayed(...)` makes one. It holds no tensors.

    Attributes:
        history_len: Rows of the amax history.
        amax_compute: "max" (the largest amax in the history) or "most_recent" (this step's).
        margin: Scales are divided by 2^margin, headroom for amaxes that grow.
        format: "hybrid" (E4M3 forward, E5M2 gradients), "e4m3" or "e5m2".
    """

    history_len: int
    amax_compute: str
    margin: float
    format: str

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype of a tensor of `role` under this recipe's format."""
        return format_dtype(self.format, role)

    def init(self, device: torch.device | str | None = None) -> DelayedScalingState:
        """A fresh state: an all-zero history and scales of 1 (as Transformer Engine starts)."""
        history = torch.zeros(self.history_len, len(ROLES), dtype=torch.float32, device=device)
        scale = torch.ones(len(ROLES), dtype=torch.float32, device=device)
        return DelayedScalingState(history, scale, self.amax_compute, self.margin, self.format)


def delayed(
    history_len: int = 1024, amax_compute: str = "max", margin: float = 0.0, format: str = "hybrid"
) -> DelayedScaling:
    """Delayed scaling, Transformer Engine's DelayedScaling: scales from a history of past amaxes.

    Args:
        history_len: Rows of the amax history (Transformer Engine's default 1024).
        amax_compute: "max" over the history, or "most_recent".
        margin: Scales are divided by 2^margin (>= 0).
        format: "hybrid" (default), "e4m3" or "e5m2".

    Returns:
        The recipe: `init()` makes a state, whose `update(amaxes)` makes the next one.

    Raises:
        ValueError: Naming the argument out of range.
    """
    history_len = check_int("history_len", history_len, 1, 1 << 20)
    if amax_compute not in _AMAX_COMPUTE:
        raise ValueError(f"amax_compute must be 'max' or 'most_recent', got {amax_compute!r}")
    margin = check_real("margin", margin, 0.0, 64.0)
    return DelayedScaling(history_len, amax_compute, margin, check_format("format", format))


class Fp8Scales(NamedTuple):
    """What `fmp.train_step` hands a loss function when the state holds FP8 states (`TrainState.fp8`).

    Attributes:
        scales: `TrainState.fp8`'s structure with each `DelayedScalingState` replaced by its
            `scale`: the tensors the step differentiates, whose gradients are the amaxes.
        loss_scale: The loss scale of the pass (1 without loss scaling; with several losses,
            the scale of the loss being differentiated): the output gradient reaches the FP8
            cast multiplied by it, so the cast divides its scale by it.
    """

    scales: Any
    loss_scale: torch.Tensor


def is_delayed_state(x: Any) -> bool:
    """Whether `x` is a `DelayedScalingState` (the leaves of `TrainState.fp8`'s structure)."""
    return isinstance(x, DelayedScalingState)


def _states(fp8: Any, where: str) -> list[tuple[str, Any]]:
    """`fp8`'s nodes that hold tensors, each with its path (`state.fp8['blocks.0.mlp']`)."""
    pairs = py_pytree.tree_flatten_with_path(fp8, is_leaf=is_delayed_state)[0]
    return [(f"{where}{py_pytree.keystr(path)}", leaf) for path, leaf in pairs]


def check_fp8_states(fp8: Any, where: str = "state.fp8") -> None:
    """Raises unless every node of `fp8` that holds tensors is a sound `DelayedScalingState`, naming it.

    Sound: float32 tensors that autograd does not track, an amax history of shape (history_len, 3)
    whose entries are finite and >= 0, and scales of shape (3,) that are finite and > 0 (a NaN or 0
    scale would skip every step from then on, as a skipped step keeps the state).

    Note: syncs with the host, to read the values; call it where a state enters, not per step.

    Raises:
        TypeError: Naming the first node that is not a DelayedScalingState, or a tensor of another dtype
            or that requires grad.
        ValueError: Naming the first state of another shape or with values out of range.
    """
    check_fp8_state_shapes(fp8, where)
    for path, state in _states(fp8, where):
        if not bool(torch.isfinite(state.scale).all() & (state.scale > 0).all()):
            raise ValueError(
                f"{path}.scale must be finite and > 0, got {state.scale.tolist()}: make the state with "
                f"fmp.fp8.init_states(model, recipes), or load a sound checkpoint"
            )
        history = state.amax_history
        if not bool(torch.isfinite(history).all() & (history >= 0).all()):
            raise ValueError(
                f"{path}.amax_history must be finite and >= 0: make the state with fmp.fp8.init_states(model, "
                f"recipes), or load a sound checkpoint"
            )


def _shape_problem(state: Any, path: str) -> TypeError | ValueError | None:
    """What is wrong with a node of `TrainState.fp8` that can be seen without reading a value, or None."""
    if not isinstance(state, DelayedScalingState):
        return TypeError(
            f"TrainState.fp8 holds DelayedScalingStates (fmp.fp8.init_states(model, recipes)), got a "
            f"{type(state).__name__} at {path}"
        )
    for name in ("amax_history", "scale"):
        tensor = getattr(state, name)
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32):
            return TypeError(f"{path}.{name} must be a float32 tensor, got {tensor!r}")
        if tensor.requires_grad:
            return TypeError(f"{path}.{name} requires grad: a state's tensors are values; pass it .detach()ed")
    history, scale = state.amax_history, state.scale
    if history.dim() != 2 or history.shape[0] < 1 or history.shape[1] != len(ROLES) or scale.shape != (3,):
        return ValueError(
            f"{path} holds an amax_history of shape {tuple(history.shape)} and a scale of shape "
            f"{tuple(scale.shape)}, where (history_len, 3) and (3,) belong: run a stacked state "
            f"(fmp.stack_trees) under torch.func.vmap, or make it with fmp.fp8.init_states(model, recipes)"
        )
    return None


def check_fp8_state_shapes(fp8: Any, where: str = "state.fp8") -> None:
    """`check_fp8_states`' static part (types, dtypes, shapes, no autograd), for every step: no host sync.

    The states are looked at without their paths; the paths are spelled out only for the message.
    """
    if all(_shape_problem(state, "") is None for state in pytree.tree_leaves(fp8, is_leaf=is_delayed_state)):
        return
    for path, state in _states(fp8, where):
        problem = _shape_problem(state, path)
        if problem is not None:
            raise problem
