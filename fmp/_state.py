"""The training state: parameters, optimizer state, loss scale, step counts, gradient accumulator."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._accumulate import GradientAccumulator
from fmp._checks import check_int
from fmp._delayed_scaling import check_fp8_states
from fmp._grad_checks import check_param_leaves
from fmp._optimizer import Optimizer
from fmp._scale_checks import ScalerTree
from fmp._scale_checks import check_scaler_values
from fmp._scale_checks import check_scalers
from fmp._struct import serializable_namedtuple
from fmp._tree import check_on_device
from fmp._tree import tree_accelerator_device

__all__ = ["StepCounts", "TrainState", "check_model_state", "check_optimizer"]


@serializable_namedtuple
class StepCounts(NamedTuple):
    """Optimizer steps applied and skipped, counted on device (no host sync), as 0-dim int64 tensors.

    A step here is an optimizer step: with gradient accumulation, one per `accumulation_steps`
    micro-batches.

    Attributes:
        applied: Steps whose update was applied.
        skipped: Steps skipped because their gradients, their loss scale or (with
            `train_step(..., check_update=True)`) their update were not finite.
        overflow_streak: Consecutive skipped steps up to now (0 after an applied step).
        stalled: Consecutive skipped steps that backing off could not help: an overflowing loss
            had its scale at the minimum (`min_scale` of a `DynamicLossScale`; a static scale is
            always at its minimum), a loss scale was itself out of range, or the gradients were
            finite but the update was not; `raise_if_stalled` reads it.
        bad_scale: Of the `stalled` steps, those that ran with a loss scale out of range (NaN,
            inf, 0, negative or past its bounds); the step put the scale back in range.
        bad_update: Of the `stalled` steps, those whose gradients were finite but whose new params
            or optimizer state were not (a NaN in the optimizer state, an update that overflows
            the param dtype).
    """

    applied: torch.Tensor
    skipped: torch.Tensor
    overflow_streak: torch.Tensor
    stalled: torch.Tensor
    bad_scale: torch.Tensor
    bad_update: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device | None = None) -> StepCounts:
        """All counts at zero, on `device` (CPU by default)."""
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return cls(*(zero.clone() for _ in cls._fields))

    def check(self, device: torch.device | None) -> None:
        """Raises naming the field unless each count is a 0-dim int64 tensor on `device` (None: any).

        Raises:
            TypeError: If a count is not an int64 tensor.
            ValueError: If a count is not 0-dim (a stacked state outside vmap) or is on another device.
        """
        for field, count in zip(self._fields, self, strict=True):
            if not (isinstance(count, torch.Tensor) and count.dtype == torch.int64):
                found = f"{count.dtype}{list(count.shape)}" if isinstance(count, torch.Tensor) else type(count).__name__
                raise TypeError(f"state.counts.{field} must be a 0-dim int64 tensor, got {found}")
            if count.dim() != 0:
                raise ValueError(
                    f"state.counts.{field} has shape {tuple(count.shape)}, but a step's counts are 0-dim: run a "
                    f"stacked state (fmp.stack_trees) under torch.func.vmap, or take one member with fmp.unstack_tree"
                )
        hint = "build the state with TrainState.create, which puts it there"
        check_on_device(self, device, "state.counts", "params", hint)

    def advance(
        self,
        stepped: torch.Tensor | None,
        applied: torch.Tensor,
        stalled: torch.Tensor,
        bad_scale: torch.Tensor,
        bad_update: torch.Tensor | None,
    ) -> StepCounts:
        """The counts after one call of the step; branch-free.

        Args:
            stepped: Whether this call ended an optimizer step, a 0-dim bool tensor; None when
                every call does (no gradient accumulation).
            applied: Whether the update was applied (implies `stepped`).
            stalled: Whether the step was skipped with an overflowing loss's scale at its minimum.
            bad_scale: Whether a loss scale was out of range (such a step counts as stalled).
            bad_update: Whether the gradients were finite but the update was not (stalled too);
                None when the update was not checked.

        Returns:
            The new counts.
        """
        # Each 0-dim op costs an eager step a few microseconds: the known flags (None) take none.
        not_applied = ~applied
        skipped = not_applied if stepped is None else stepped & not_applied
        bad_scale = skipped & bad_scale
        stalled = stalled | bad_scale
        if bad_update is not None:
            bad_update = skipped & bad_update
            stalled = stalled | bad_update
        stalled = skipped & stalled
        # Arithmetic on int64 counts and bool flags (exact, and fewer ops than nested selects):
        # an applied step zeroes the streak, a skipped one adds 1, a call that ends no step keeps it.
        streak = (self.overflow_streak + skipped) * not_applied
        # Counted within the current stall: a step that ends it restarts the count; `now` implies `stalled`.
        keep = stalled if stepped is None else stalled | ~stepped

        def run(count: torch.Tensor, now: torch.Tensor | None) -> torch.Tensor:
            return count * keep if now is None else count * keep + now

        return StepCounts(
            applied=self.applied + applied,
            skipped=self.skipped + skipped,
            overflow_streak=streak,
            stalled=run(self.stalled, stalled),
            bad_scale=run(self.bad_scale, bad_scale),
            bad_update=run(self.bad_update, bad_update),
        )


@serializable_namedtuple
class TrainState(NamedTuple):
    """Everything a training step updates.

    Attributes:
        params: The parameters, a pytree of tensors in the policy's param dtype.
        opt_state: The optimizer's state.
        scaler: The loss-scale state, or a tuple of them, one per loss.
        counts: Applied and skipped optimizer steps (`StepCounts`).
        accumulator: The gradient accumulator; `()` (no leaves, unlike None, which torch's pytree
            counts as a leaf) when every call is an optimizer step.
        model_state: The model's state that is not trained, such as BatchNorm's running
            statistics (flax's `batch_stats`): `()` for none, else a pytree of tensors that
            the loss function takes after the params and returns updated (see `train_step`).
        fp8: FP8 delayed-scaling states, one `fmp.fp8.DelayedScalingState` per layer
            (`fmp.fp8.init_states`): `()` for none. The step updates them from each step's
            amaxes, and keeps them on a skipped step (see the FP8 how-to).
    """

    params: Any
    opt_state: Any
    scaler: ScalerTree
    counts: StepCounts
    accumulator: GradientAccumulator | tuple[()]
    model_state: Any = ()
    fp8: Any = ()

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: Optimizer,
        scaler: ScalerTree,
        *,
        accumulation_steps: int = 1,
        model_state: Any = (),
        fp8: Any = (),
    ) -> TrainState:
        """Builds the state for `params`: initialises the optimizer, puts everything on their device.

        Note: syncs with the host once, to validate the scalers' values (`check_scaler_values`): a
        scale built with the raw constructor that is NaN, inf, 0, negative or complex is refused
        here rather than skipping steps later.

        Args:
            params: The parameters, a pytree of tensors.
            optimizer: A pure optimizer, e.g. `fmp.optim.adamw(...)`.
            scaler: The loss-scale state, or a tuple of them for a loss function that returns as
                many losses; its tensors move to the params' device (the first accelerator among
                several), where the step's finite flag lives, so a compiled step sees one device
                from the first call on.
            accumulation_steps: Micro-batches per optimizer step: with more than 1, each call of
                the step adds its gradients to float32 accumulators, and every
                `accumulation_steps`-th call updates with their mean (see `GradientAccumulator`).
            model_state: The model's untrained state, e.g. the buffers of `fmp.nn.split(model)`;
                with it, the step calls `loss_fn(params, model_state, *args)`, which returns
                `(out, new_model_state)`.
            fp8: The FP8 delayed-scaling states of the layers `fmp.fp8.fp8_modules` runs with a
                delayed recipe, from `fmp.fp8.init_states(model, recipes)`; they move to the
                params' device.

        Returns:
            The state.

        Raises:
            TypeError, ValueError: If an argument has the wrong type or `accumulation_steps` < 1,
                a leaf of `model_state` is not a tensor or is tracked by autograd, `fp8` holds
                anything but DelayedScalingStates, or a scaler holds a value out of range (naming
                the field).
        """
        check_optimizer(optimizer)
        check_scalers(scaler)
        for index, one in enumerate(scaler if isinstance(scaler, tuple) else (scaler,)):
            check_scaler_values(one, f"scaler[{index}]" if isinstance(scaler, tuple) else "scaler")
        check_param_leaves(params)
        check_model_state(model_state)
        check_fp8_states(fp8)
        steps = check_int("accumulation_steps", accumulation_steps, 1, torch.iinfo(torch.int32).max)
        device = tree_accelerator_device(params)
        if device is not None:
            scaler = pytree.tree_map(lambda t: t.to(device), scaler)
            fp8 = pytree.tree_map(lambda t: t.to(device), fp8)
        accumulator = GradientAccumulator.create(params, scaler, steps) if steps > 1 else ()
        counts = StepCounts.zeros(device)
        return cls(params, optimizer.init(params), scaler, counts, accumulator, model_state, fp8)


def check_model_state(model_state: Any) -> None:
    """Raises naming the leaf unless every leaf of `model_state` is a tensor that autograd does not track.

    Raises:
        TypeError: For a leaf that is not a tensor, or an `nn.Parameter` or tensor that requires grad.
    """
    leaves = pytree.tree_leaves(model_state)
    if all(type(x) is torch.Tensor and not x.requires_grad for x in leaves):
        return
    # Key paths only for the message: flattening with them costs several times a plain flatten.
    for path, leaf in py_pytree.tree_flatten_with_path(model_state)[0]:
        where = f"model_state{py_pytree.keystr(path)}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where} is a {type(leaf).__name__}; every leaf of model_state must be a tensor")
        if leaf.requires_grad and not torch._C._functorch.is_functorch_wrapped_tensor(leaf):
            raise TypeError(
                f"{where} requires grad: model state is not trained; pass it .detach()ed "
                f"(fmp.nn.split(model) returns trainable params and buffers apart)"
            )


def check_optimizer(optimizer: Any) -> None:
    """Raises a TypeError naming the type unless `optimizer` is an `fmp.optim.Optimizer`."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be an fmp.optim.Optimizer (e.g. fmp.optim.adamw()), got {type(optimizer).__name__}"
        )
    if optimizer.masked_update is not None and not callable(optimizer.masked_update):
        raise TypeError(
            f"optimizer.masked_update must be a function or None, got {type(optimizer.masked_update).__name__}"
        )
