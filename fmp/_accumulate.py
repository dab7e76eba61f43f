"""Gradient accumulation over micro-batches in float32, with one skip decision and one scale update per step.

The rule for a non-finite micro-batch, or for finite ones whose sum overflows: the window's
optimizer step is skipped whole (params and optimizer state kept bit for bit), and the scale backs
off once, when the window ends. The scale stays fixed inside a window, so every micro-batch's
gradients are unscaled by the same factor.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._checks import check_int
from fmp._scale_checks import ScalerTree
from fmp._struct import pytree_dataclass
from fmp._struct import replace
from fmp._struct import serializable_namedtuple
from fmp._struct import static_field
from fmp._tree import all_finite
from fmp._tree import check_finite_flag
from fmp._tree import tree_accelerator_device

__all__ = ["AccumulatedGradients", "GradientAccumulator"]


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit gradients, the gradient's own dtype when it is wider (float64, complex)."""
    return torch.promote_types(dtype, torch.float32)


@serializable_namedtuple
class AccumulatedGradients(NamedTuple):
    """What `GradientAccumulator.add` returns for one micro-batch.

    Attributes:
        window_ends: 0-dim bool tensor: this micro-batch ends the window (an optimizer step is due).
        grads: The mean gradient of the window so far, in each parameter's dtype.
        grads_finite: Whether every micro-batch of the window so far had finite gradients, and their
            sum is finite.
        finite_per_loss: The same per loss-scale state, the flags the scalers adjust by.
        accumulator: The accumulator to carry to the next micro-batch (reset when the window ends).
    """

    window_ends: torch.Tensor
    grads: Any
    grads_finite: torch.Tensor
    finite_per_loss: Any
    accumulator: GradientAccumulator


@pytree_dataclass
class GradientAccumulator:
    """Sums of unscaled gradients over a window of micro-batches, as optax's `MultiSteps`.

    Each micro-batch's gradients are unscaled first and then added in float32 (or wider), so
    16-bit gradients lose nothing to the sum; the optimizer sees the window's mean. Built by
    `fmp.TrainState.create(..., accumulation_steps=k)`.

    Attributes:
        micro_steps: Micro-batches already added in the current window, a 0-dim int32 tensor.
        grads: The sums, shaped like the parameters.
        grads_finite: 0-dim bool tensor: every micro-batch of the window so far was finite, and so is
            their sum.
        finite_per_loss: The same per loss-scale state (a flag, or a tuple of flags).
        steps: Micro-batches per window (per optimizer step).
    """

    micro_steps: torch.Tensor
    grads: Any
    grads_finite: torch.Tensor
    finite_per_loss: Any
    steps: int = static_field()

    @classmethod
    def create(cls, params: Any, scaler: ScalerTree, steps: int) -> GradientAccumulator:
        """An empty window for `params` and `scaler` (one flag per loss-scale state).

        Args:
            params: The parameters, a pytree of tensors.
            scaler: The loss-scale state or tuple of them.
            steps: Micro-batches per optimizer step, >= 1.

        Returns:
            The accumulator, on the parameters' devices.

        Raises:
            TypeError, ValueError: If `steps` is not an int in [1, 2**31 - 1].
        """
        check_int("steps", steps, 1, torch.iinfo(torch.int32).max)
        device = tree_accelerator_device(params)
        true = torch.ones((), dtype=torch.bool, device=device)
        per_loss = tuple(true.clone() for _ in scaler) if isinstance(scaler, tuple) else true.clone()
        return cls(
            micro_steps=torch.zeros((), dtype=torch.int32, device=device),
            grads=pytree.tree_map(lambda p: torch.zeros_like(p, dtype=_accumulator_dtype(p.dtype)), params),
            grads_finite=true,
            finite_per_loss=per_loss,
            steps=steps,
        )

    def _check_fields(self) -> None:
        """Raises naming the field unless the accumulator's own fields are as `create` makes them.

        A hand-built one with `steps=0` would divide the window's sum by 0, and a negative count
        flip the gradients' sign, both without a non-finite gradient to skip the step.
        """
        check_int("state.accumulator.steps", self.steps, 1, torch.iinfo(torch.int32).max)
        micro_steps = self.micro_steps
        if not (isinstance(micro_steps, torch.Tensor) and micro_steps.dtype == torch.int32):
            found = micro_steps.dtype if isinstance(micro_steps, torch.Tensor) else type(micro_steps).__name__
            raise TypeError(f"state.accumulator.micro_steps must be a 0-dim int32 tensor, got {found}")
        if micro_steps.dim() != 0:
            raise ValueError(
                f"state.accumulator.micro_steps has shape {tuple(micro_steps.shape)}, but a step's is 0-dim: run a "
                f"stacked state (fmp.stack_trees) under torch.func.vmap, or take one member with fmp.unstack_tree"
            )
        check_finite_flag(self.grads_finite, "state.accumulator.grads_finite")
        for index, flag in enumerate(pytree.tree_leaves(self.finite_per_loss)):
            check_finite_flag(flag, f"state.accumulator.finite_per_loss[{index}]")

    def _check_like_sums(self, grads: Any) -> None:
        """Raises a ValueError naming the first key, shape or device where `grads` differs from the sums."""
        sum_leaves, spec = pytree.tree_flatten(self.grads)
        try:
            grad_leaves = pytree.flatten_up_to(spec, grads)
        except (TypeError, ValueError):
            raise ValueError(
                f"GradientAccumulator.add: grads have another structure than the accumulator's sums, "
                f"{pytree.spec_str(pytree.tree_structure(grads))} vs {pytree.spec_str(spec)}: "
                f"was it made for other params?"
            ) from None
        for index, (total, grad) in enumerate(zip(sum_leaves, grad_leaves, strict=True)):
            if not (isinstance(grad, torch.Tensor) and grad.shape == total.shape):
                path = py_pytree.tree_flatten_with_path(self.grads)[0][index][0]
                found = f"shape {tuple(grad.shape)}" if isinstance(grad, torch.Tensor) else f"a {type(grad).__name__}"
                raise ValueError(
                    f"GradientAccumulator.add: grads{py_pytree.keystr(path)} is {found}, but its sum has shape "
                    f"{tuple(total.shape)}: was the accumulator made for other params?"
                )
            if grad.device != total.device:
                path = py_pytree.tree_flatten_with_path(self.grads)[0][index][0]
                raise ValueError(
                    f"GradientAccumulator.add: grads{py_pytree.keystr(path)} is on {grad.device}, but its sum is on "
                    f"{total.device}: move the accumulator with the params"
                )

    def add(self, grads: Any, grads_finite: torch.Tensor, finite_per_loss: Any) -> AccumulatedGradients:
        """Adds one micro-batch's unscaled gradients; branch-free.

        Args:
            grads: The micro-batch's unscaled gradients, in the parameters' dtypes.
            grads_finite: Whether they are all finite.
            finite_per_loss: The same per loss-scale state.

        Returns:
            The window's mean and flags, and the accumulator for the next micro-batch.

        Raises:
            TypeError, ValueError: If the accumulator's own `steps`, `micro_steps` or flags are not
                as `create` makes them (naming the field), a flag is not a 0-dim bool tensor, `finite_per_loss` has
                another number of flags than the accumulator was made for, or a gradient's
                key, shape or device differs from its sum's.
        """
        self._check_fields()
        check_finite_flag(grads_finite)
        ours, theirs = pytree.tree_structure(self.finite_per_loss), pytree.tree_structure(finite_per_loss)
        if ours != theirs:
            raise ValueError(
                f"the accumulator was made for {pytree.num_leaves(ours)} loss-scale "
                f"state(s) but finite_per_loss holds {pytree.num_leaves(theirs)}: rebuild it with TrainState.create"
            )
        for index, flag in enumerate(pytree.tree_leaves(finite_per_loss)):
            check_finite_flag(flag, f"finite_per_loss[{index}]")
        self._check_like_sums(grads)
        sums = pytree.tree_map(lambda total, g: total + g.to(total.dtype), self.grads, grads)
        micro_batches_finite = self.grads_finite & grads_finite
        window_finite = micro_batches_finite & all_finite(sums)
        # Finite micro-batches can overflow when added; then no loss is to blame alone (as for the
        # sum of several losses' gradients) and every scale backs off.
        sum_overflowed = micro_batches_finite & ~window_finite
        window_per_loss = pytree.tree_map(
            lambda window, micro_batch: window & micro_batch & ~sum_overflowed, self.finite_per_loss, finite_per_loss
        )
        micro_steps = self.micro_steps + 1
        window_ends = micro_steps >= self.steps
        mean = pytree.tree_map(lambda total, g: (total / self.steps).to(g.dtype), sums, grads)
        reset = replace(
            self,
            micro_steps=torch.where(window_ends, 0, micro_steps),
            grads=pytree.tree_map(lambda total: torch.where(window_ends, 0.0, total), sums),
            grads_finite=window_finite | window_ends,
            finite_per_loss=pytree.tree_map(lambda flag: flag | window_ends, window_per_loss),
        )
        return AccumulatedGradients(window_ends, mean, window_finite, window_per_loss, reset)
