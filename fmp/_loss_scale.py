"""Loss-scale states: immutable pytrees with pure `scale`, `unscale` and `adjust` methods.

Every dynamic value is a 0-dim tensor leaf; hyperparameters are static fields kept in the treespec.
`DynamicLossScale.adjust` reproduces `torch.amp.GradScaler.update` exactly under default bounds while
the scale stays a normal float32 (GradScaler backs off into subnormals; fmp stops at the smallest
normal), and puts a scale that is out of range (NaN, inf, 0, negative, past its bounds) back in range without a
host sync, so a corrupted state cannot leave training skipping every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from typing import TypeVar
from typing import cast

import torch

import fmp._pytree as pytree
from fmp._checks import check_int
from fmp._checks import check_real
from fmp._donation import writable
from fmp._scale_update import grad_scaler_update
from fmp._scale_update import runs_grad_scaler_kernel
from fmp._scale_update import scale_update
from fmp._scale_values import FLOAT32_MAX
from fmp._scale_values import FLOAT32_TINY
from fmp._scale_values import checked_device
from fmp._scale_values import checked_scale
from fmp._scale_values import float32_inward
from fmp._scale_values import scale_tensor
from fmp._struct import pytree_dataclass
from fmp._struct import replace
from fmp._struct import static_field
from fmp._tree import check_finite_flag
from fmp._tree import is_inexact_tensor

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "inverse_scale",
    "scale_in_range",
    "unscale_in_place",
]

Tree = TypeVar("Tree")

_INT32_MAX = torch.iinfo(torch.int32).max
# GradScaler.state_dict()'s keys, and the ones fmp adds to them.
_GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_FMP_KEYS = ("overflow_streak", "min_scale", "max_scale", "hysteresis")
# What a dynamic scale found out of range restarts from (clamped into its bounds): GradScaler's
# default initial scale, from which backing off reaches 1 in 16 skipped steps. min_scale would
# flush float16 gradients to 0 for thousands of steps, max_scale overflow for about 128.
RESET_SCALE = 2.0**16


def _multiply_leaves(tree: Tree, factor: torch.Tensor, *, keep_dtype: bool, in_place: bool = False) -> Tree:
    """Multiplies the floating and complex leaves of `tree` by the 0-dim float32 `factor`.

    The product is formed in at least float32 (as GradScaler's kernels do), so a float16 leaf is
    neither flushed by a tiny factor nor overflowed by a large one before rounding back. The result
    keeps each leaf's dtype with `keep_dtype`, else follows torch's type promotion (a 0-dim float16
    loss times the float32 scale is float32, as in GradScaler.scale). With `in_place` (and
    `keep_dtype`) the products are written into the leaves that are `writable`, rounded alike.
    """

    def multiply(x: Any) -> Any:
        if not is_inexact_tensor(x):
            return x
        compute_dtype = torch.promote_types(x.dtype, factor.dtype)
        if in_place and writable(x):
            return x.mul_(factor) if compute_dtype == x.dtype else x.copy_(x.to(compute_dtype) * factor)
        # torch.result_type(x, factor), spelled so Dynamo can trace it: a 0-dim factor widens only a
        # 0-dim x (dimensioned tensors win type promotion within a category).
        out_dtype = x.dtype if keep_dtype or x.dim() > 0 else compute_dtype
        return (x.to(compute_dtype) * factor).to(out_dtype)

    # One leaf, such as a loss, needs no tree walk.
    return cast(Tree, multiply(tree) if type(tree) is torch.Tensor else pytree.tree_map(multiply, tree))


class _TensorScale:
    """`scale` and `unscale` for states whose `loss_scale` field is a 0-dim float32 tensor."""

    loss_scale: torch.Tensor

    def scale(self, tree: Tree) -> Tree:
        """Multiplies floating leaves by the scale, with torch's type promotion (as GradScaler.scale).

        Raises:
            TypeError: If `tree` holds no floating-point or complex tensor (a Python float loss, say).
        """
        leaves = [tree] if type(tree) is torch.Tensor else pytree.tree_leaves(tree)
        if not any(is_inexact_tensor(x) for x in leaves):
            raise TypeError(f"scale() found no floating-point tensor to scale in a {type(tree).__name__}")
        return _multiply_leaves(tree, self.loss_scale, keep_dtype=False)

    def unscale(self, tree: Tree) -> Tree:
        """Multiplies floating leaves by 1/scale, keeping each leaf's dtype."""
        return _multiply_leaves(tree, inverse_scale(self.loss_scale), keep_dtype=True)


def inverse_scale(loss_scale: torch.Tensor) -> torch.Tensor:
    """1/scale as GradScaler forms it: in double precision, rounded once to float32."""
    # GradScaler forms 1/scale in double and rounds once to float32; doing the same keeps unscaled
    # gradients bit-identical to torch's.
    return loss_scale.double().reciprocal().float()


def unscale_in_place(scaler: LossScale, tree: Tree) -> Tree:
    """`scaler.unscale(tree)` written into `tree`'s floating and complex tensors, for donated gradients.

    Bit for bit `unscale`'s values. Returns `tree`, with new tensors for the leaves that are not
    `writable` (whose elements share memory, as an expanded tensor's do).
    """
    if isinstance(scaler, NoOpLossScale):
        return tree
    return _multiply_leaves(tree, inverse_scale(scaler.loss_scale), keep_dtype=True, in_place=True)


@pytree_dataclass
class NoOpLossScale:
    """No loss scaling: `scale` and `unscale` return their input, `adjust` returns the same state."""

    @classmethod
    def create(cls) -> NoOpLossScale:
        """Returns the state, as `StaticLossScale.create` and `DynamicLossScale.create` do theirs."""
        return cls()

    @property
    def loss_scale(self) -> torch.Tensor:
        """The constant scale 1.0 (a fresh CPU tensor: this state holds no tensors)."""
        return torch.ones((), dtype=torch.float32)

    def scale(self, tree: Tree) -> Tree:
        """Returns `tree` unchanged."""
        return tree

    def unscale(self, tree: Tree) -> Tree:
        """Returns `tree` unchanged."""
        return tree

    def adjust(self, grads_finite: torch.Tensor) -> NoOpLossScale:
        """Returns this state; `grads_finite` is only checked for type and shape."""
        check_finite_flag(grads_finite)
        return self

    def adjust_in_range(self, grads_finite: torch.Tensor, in_range: torch.Tensor) -> NoOpLossScale:
        """`adjust`: this state's scale is always in range."""
        return self.adjust(grads_finite)


@pytree_dataclass
class StaticLossScale(_TensorScale):
    """A fixed loss scale.

    Attributes:
        loss_scale: The scale, a 0-dim float32 tensor.
    """

    loss_scale: torch.Tensor

    @classmethod
    def create(cls, loss_scale: float | torch.Tensor, *, device: torch.device | str | None = None) -> StaticLossScale:
        """Builds a validated static scale.

        Note: syncs with the host once when `loss_scale` is a tensor, to validate it.

        Args:
            loss_scale: The scale; it must be a positive, normal float32.
            device: Where the scale tensor lives (a tensor's own device by default, else CPU; `meta`
                too, for a shape-only run).

        Returns:
            The state.
        """
        return cls(scale_tensor(loss_scale, "loss_scale", device))

    def adjust(self, grads_finite: torch.Tensor) -> StaticLossScale:
        """Returns the state with the same scale, or 1.0 where the scale is out of range; branch-free.

        A scale that `create` would refuse (NaN, inf, 0, negative, subnormal: a state built with the
        raw constructor or corrupted) becomes 1.0: a fixed scale cannot back off, and no scaling
        cannot overflow gradients that are finite unscaled. `grads_finite` is only checked for type
        and shape.

        Args:
            grads_finite: A 0-dim bool tensor, e.g. `fmp.all_finite(grads)`.

        Returns:
            The new state; its scale bit for bit this one's when in range.
        """
        return self.adjust_in_range(grads_finite, scale_in_range(self))

    def adjust_in_range(self, grads_finite: torch.Tensor, in_range: torch.Tensor) -> StaticLossScale:
        """`adjust`, given `scale_in_range(self)` already computed (a step computes it before)."""
        check_finite_flag(grads_finite)
        scale = self.loss_scale
        return replace(self, loss_scale=torch.where(in_range, scale, torch.ones_like(scale)))


@pytree_dataclass
class DynamicLossScale(_TensorScale):
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    Attributes:
        loss_scale: The current scale, a 0-dim float32 tensor.
        growth_tracker: Finite steps since the last growth or overflow, a 0-dim int32 tensor.
        overflow_streak: Consecutive non-finite steps so far, a 0-dim int32 tensor.
        growth_factor: Factor the scale grows by after `growth_interval` finite steps.
        backoff_factor: Factor the scale shrinks by on an overflow.
        growth_interval: Consecutive finite steps between growths.
        min_scale: The scale never backs off below this.
        max_scale: The scale never grows above this.
        hysteresis: The scale backs off only from the `hysteresis`-th consecutive overflow on.
    """

    loss_scale: torch.Tensor
    growth_tracker: torch.Tensor
    overflow_streak: torch.Tensor
    growth_factor: float = static_field(default=2.0)
    backoff_factor: float = static_field(default=0.5)
    growth_interval: int = static_field(default=2000)
    min_scale: float = static_field(default=FLOAT32_TINY)
    max_scale: float = static_field(default=FLOAT32_MAX)
    hysteresis: int = static_field(default=1)

    @classmethod
    def create(
        cls,
        init_scale: float | torch.Tensor = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = FLOAT32_TINY,
        max_scale: float = FLOAT32_MAX,
        hysteresis: int = 1,
        device: torch.device | str | None = None,
    ) -> DynamicLossScale:
        """Builds a validated dynamic scale; the defaults are torch.amp.GradScaler's.

        `min_scale`, `max_scale` and `hysteresis` default to values that never bind while torch's
        scale is a normal float32, so the trajectory equals GradScaler's out of the box.

        Note: syncs with the host once when `init_scale` is a tensor, to validate it.

        Args:
            init_scale: The starting scale, a positive normal float32.
            growth_factor: Growth factor, > 1.
            backoff_factor: Backoff factor, in (0, 1).
            growth_interval: Consecutive finite steps before each growth, in [1, 2**31 - 1]; for a
                scale that never grows use `StaticLossScale` or `max_scale=init_scale`.
            min_scale: Floor of the scale, at least float32's smallest normal number; stored
                rounded up to a float32.
            max_scale: Ceiling of the scale, in [min_scale, float32 max]; stored rounded down to a
                float32.
            hysteresis: Consecutive overflows before the scale backs off, >= 1 (DeepSpeed's
                `hysteresis` with `consecutive_hysteresis=True`: any finite step resets the count).
            device: Where the state's tensors live (a tensor `init_scale`'s own device by default,
                else CPU); put it on the parameters' device (`meta` too, for a shape-only run).

        Returns:
            The state.

        Raises:
            TypeError, ValueError: Naming the bad argument and its allowed range.
        """
        scale, own_device = checked_scale(init_scale, "init_scale")
        low = check_real("min_scale", min_scale, FLOAT32_TINY, FLOAT32_MAX, high_inclusive=True)
        high = check_real("max_scale", max_scale, low, FLOAT32_MAX, high_inclusive=True)
        min_scale, max_scale = float32_inward(low, up=True), float32_inward(high, up=False)
        if min_scale > max_scale:
            raise ValueError(f"no float32 scale lies in [min_scale, max_scale] = [{low}, {high}]")
        # init_scale must lie within the bounds up to its own rounding to float32, then is clamped in.
        if not float32_inward(low, up=False) <= scale <= float32_inward(high, up=True):
            raise ValueError(f"init_scale ({scale}) must lie in [min_scale, max_scale] = [{low}, {high}]")
        device = own_device if device is None else checked_device(device)
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return cls(
            loss_scale=torch.tensor(min(max(scale, min_scale), max_scale), dtype=torch.float32, device=device),
            growth_tracker=zero,
            overflow_streak=zero.clone(),
            growth_factor=check_real("growth_factor", growth_factor, 1.0, math.inf, low_inclusive=False),
            backoff_factor=check_real("backoff_factor", backoff_factor, 0.0, 1.0, low_inclusive=False),
            growth_interval=check_int("growth_interval", growth_interval, 1, _INT32_MAX),
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=check_int("hysteresis", hysteresis, 1, _INT32_MAX),
        )

    def adjust(self, grads_finite: torch.Tensor) -> DynamicLossScale:
        """Returns the state after one step whose gradients were finite or not; branch-free.

        Finite step: the tracker counts up, and on reaching `growth_interval` the scale grows
        (unless that would overflow float32 or pass `max_scale`) and the tracker restarts.
        Non-finite step: the tracker restarts and, from the `hysteresis`-th consecutive overflow on,
        the scale backs off (never below `min_scale`).
        Scale out of range (NaN, inf, 0, negative, or outside `[min_scale, max_scale]`: a state built
        with the raw constructor or corrupted): the state restarts as `create` builds it, at
        `RESET_SCALE` = 2**16 clamped into `[min_scale, max_scale]` with both counters at 0, whatever
        `grads_finite` says. Within range the result is bit for bit GradScaler's.

        Args:
            grads_finite: A 0-dim bool tensor, e.g. `fmp.all_finite(grads)`.

        Returns:
            The new state.
        """
        return self.adjust_in_range(grads_finite, scale_in_range(self))

    def adjust_in_range(self, grads_finite: torch.Tensor, in_range: torch.Tensor) -> DynamicLossScale:
        """`adjust`, given `scale_in_range(self)` already computed (a step computes it before)."""
        check_finite_flag(grads_finite)
        scale = self.loss_scale
        factors = (self.growth_factor, self.backoff_factor, self.growth_interval)
        # Saturates rather than wrapping after 2**31 - 1 consecutive overflows.
        streak = self.overflow_streak.clamp(max=_INT32_MAX - 1) + 1
        overflowed = ~grads_finite
        if self.hysteresis == 1 and runs_grad_scaler_kernel(scale, self.growth_tracker, grads_finite):
            new_scale, tracker = grad_scaler_update(scale, self.growth_tracker, overflowed, *factors)
        else:
            back_off = overflowed & (streak >= self.hysteresis)
            new_scale, tracker = scale_update(scale, self.growth_tracker, grads_finite, back_off, *factors)
        # torch.where, not clamp: clamp passes NaN through, and a NaN scale would skip every step.
        reset = torch.full_like(scale, min(max(RESET_SCALE, self.min_scale), self.max_scale))
        return replace(
            self,
            loss_scale=torch.where(in_range, new_scale.clamp(self.min_scale, self.max_scale), reset),
            # The counters times a bool flag: 0 where it is False (exact, one op where a select needs two).
            growth_tracker=tracker * in_range,
            overflow_streak=streak * (in_range & overflowed),
        )

    def state_dict(self) -> dict[str, float | int]:
        """The state in `torch.amp.GradScaler.state_dict()`'s format, plus fmp's own fields.

        `GradScaler.load_state_dict` takes it as it is (it reads its five keys and ignores
        `overflow_streak`, `min_scale`, `max_scale` and `hysteresis`), so a run moves from fmp to
        torch.amp mid-training and the scale goes on as it would have.

        Note: syncs with the host, to read the scale and the counters; call it when checkpointing.

        Returns:
            A dict of Python numbers.

        Raises:
            ValueError: If the state is stacked (an ensemble's scalers): GradScaler's format holds one;
                or on the meta device, where it holds no values.
        """
        if self.loss_scale.is_meta:
            raise ValueError("state_dict() reads the scale's values, which a state on the meta device does not hold")
        if self.loss_scale.dim() != 0:
            raise ValueError(
                f"state_dict() describes one scaler, but this state is stacked (loss_scale shape "
                f"{tuple(self.loss_scale.shape)}); take each member's with fmp.unstack_tree(scaler, i).state_dict(), "
                f"or save the whole state with torch.save"
            )
        return {
            "scale": float(self.loss_scale),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self.growth_tracker),
            "overflow_streak": int(self.overflow_streak),
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
        }

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, Any], *, device: torch.device | str | None = None
    ) -> DynamicLossScale:
        """Builds the state from `torch.amp.GradScaler(...).state_dict()` or from `state_dict()`.

        A run moves from torch.amp to fmp mid-training with the scale trajectory GradScaler would
        have followed. fmp's own fields take their defaults when absent (GradScaler's dicts).

        Note: syncs with the host once, to validate the scale (as `create`).

        Args:
            state_dict: The saved state.
            device: Where the state's tensors live; put it on the parameters' device (`meta` too).

        Returns:
            The state.

        Raises:
            TypeError, ValueError: Naming the key, if the dict is empty (a disabled GradScaler's),
                lacks a key, has an unknown one, or holds a value out of range; never a silent reset.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if not state_dict:
            raise ValueError(
                "the loss-scale state_dict is empty, as a disabled GradScaler (enabled=False) saves it; "
                "use fmp.NoOpLossScale() for a run without loss scaling"
            )
        missing = [key for key in _GRAD_SCALER_KEYS if key not in state_dict]
        unknown = sorted(set(state_dict) - set(_GRAD_SCALER_KEYS) - set(_FMP_KEYS))
        if missing or unknown:
            raise ValueError(
                f"not a GradScaler or fmp.DynamicLossScale state_dict: missing keys {missing}, unknown keys {unknown}"
            )
        scale, own_device = checked_scale(state_dict["scale"], "state_dict['scale']")
        try:
            scaler = cls.create(
                init_scale=scale,
                growth_factor=state_dict["growth_factor"],
                backoff_factor=state_dict["backoff_factor"],
                growth_interval=state_dict["growth_interval"],
                min_scale=state_dict.get("min_scale", FLOAT32_TINY),
                max_scale=state_dict.get("max_scale", FLOAT32_MAX),
                hysteresis=state_dict.get("hysteresis", 1),
                device=own_device if device is None else device,
            )
        except (TypeError, ValueError) as error:  # create's argument names, as the dict's keys
            raise type(error)(f"state_dict: {str(error).replace('init_scale', 'scale')}") from None
        tracker = check_int(
            "state_dict['_growth_tracker']", state_dict["_growth_tracker"], 0, scaler.growth_interval - 1
        )
        streak = check_int("state_dict['overflow_streak']", state_dict.get("overflow_streak", 0), 0, _INT32_MAX)
        like = scaler.growth_tracker
        return replace(
            scaler,
            growth_tracker=torch.tensor(tracker, dtype=like.dtype, device=like.device),
            overflow_streak=torch.tensor(streak, dtype=like.dtype, device=like.device),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of fmp's loss-scale states."""


def scale_in_range(scaler: LossScale) -> torch.Tensor:
    """A 0-dim bool tensor: whether the scale is one `create` accepts; branch-free and NaN-safe.

    A dynamic scale must lie in `[min_scale, max_scale]`, a static one be a positive normal float32
    (NaN and infinities fail every comparison); a `NoOpLossScale` always is.
    """
    if isinstance(scaler, NoOpLossScale):
        return torch.ones((), dtype=torch.bool)
    scale = scaler.loss_scale
    low, high = (
        (scaler.min_scale, scaler.max_scale) if isinstance(scaler, DynamicLossScale) else (FLOAT32_TINY, FLOAT32_MAX)
    )
    return (scale >= low) & (scale <= high)
