"""Loss-scale states: immutable pytrees with pure `scale`, `unscale` and `adjust` methods.

Every dynamic value is a 0-dim tensor leaf; hyperparameters are static fields kept in the treespec.
`DynamicLossScale.adjust` reproduces `torch.amp.GradScaler.update` exactly under default bounds.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.utils._pytree as pytree

from fmp._struct import pytree_dataclass
from fmp._struct import static_field
from fmp.tree import check_finite_flag
from fmp.tree import is_floating_tensor

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale"]

Tree = TypeVar("Tree")

_FLOAT32_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _scale_tree(tree: Tree, factor: torch.Tensor) -> Tree:
    """Multiplies floating leaves by `factor` with torch's type promotion (as GradScaler.scale)."""
    return cast(Tree, pytree.tree_map(lambda x: x * factor if is_floating_tensor(x) else x, tree))


def _unscale_tree(tree: Tree, inv_scale: torch.Tensor) -> Tree:
    """Multiplies floating leaves by `inv_scale`, keeping each leaf's dtype (grads must match params)."""

    def unscale_leaf(x: Any) -> Any:
        return (x * inv_scale).to(x.dtype) if is_floating_tensor(x) else x

    return cast(Tree, pytree.tree_map(unscale_leaf, tree))


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    # GradScaler forms 1/scale in double and rounds once to float32; doing the same keeps unscaled
    # gradients bit-identical to torch's.
    return scale.double().reciprocal().float()


def _is_float32(value: float) -> bool:
    """Whether `value` is exactly representable as a float32 (checked in Python: no tensor involved)."""
    try:
        return bool(struct.unpack("f", struct.pack("f", value))[0] == value)
    except OverflowError:
        return False


def _multiply_like_torch(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """Returns float32(scale * factor) rounded as torch's `_amp_update_scale_` kernel rounds it.

    The kernel multiplies a float by a double factor. When the factor is exactly a float32 (2.0, 0.5)
    a float32 multiply rounds identically; otherwise the product is formed in float64 first.
    """
    if _is_float32(factor):
        return scale * factor
    return (scale.double() * factor).float()


@pytree_dataclass
class NoOpLossScale:
    """No loss scaling: `scale` and `unscale` return their input, `adjust` returns the same state."""

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


def _scale_tensor(value: float | torch.Tensor, name: str, device: torch.device | str | None) -> torch.Tensor:
    """Validates a positive finite scale given as a float or a 0-dim tensor; returns a float32 tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name} must be a 0-dim floating tensor, got {value.dtype}{list(value.shape)}")
        # Validation at construction syncs once with the host; steps never do.
        number = float(value)
        device = value.device if device is None else device
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be positive and finite, got {number}")
    return torch.tensor(number, dtype=torch.float32, device=device)


@pytree_dataclass
class StaticLossScale:
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
            loss_scale: A positive, finite scale.
            device: Where the scale tensor lives.

        Returns:
            The state.
        """
        return cls(_scale_tensor(loss_scale, "loss_scale", device))

    def scale(self, tree: Tree) -> Tree:
        """Multiplies floating leaves by the scale, with torch's type promotion (as GradScaler.scale)."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Tree) -> Tree:
        """Multiplies floating leaves by 1/scale, keeping each leaf's dtype."""
        return _unscale_tree(tree, _inverse(self.loss_scale))

    def adjust(self, grads_finite: torch.Tensor) -> StaticLossScale:
        """Returns this state; `grads_finite` is only checked for type and shape."""
        check_finite_flag(grads_finite)
        return self


def _check_factor(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (low < value < high):
        raise ValueError(f"{name} must be in ({low}, {high}), got {value}")
    return float(value)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@pytree_dataclass
class DynamicLossScale:
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
    min_scale: float = static_field(default=_FLOAT32_TINY)
    max_scale: float = static_field(default=_FLOAT32_MAX)
    hysteresis: int = static_field(default=1)

    @classmethod
    def create(
        cls,
        init_scale: float | torch.Tensor = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = _FLOAT32_TINY,
        max_scale: float = _FLOAT32_MAX,
        hysteresis: int = 1,
        device: torch.device | str | None = None,
    ) -> DynamicLossScale:
        """Builds a validated dynamic scale; the defaults are torch.amp.GradScaler's.

        `min_scale`, `max_scale` and `hysteresis` default to values that never bind while torch's
        scale is a normal float32, so the trajectory equals GradScaler's out of the box.

        Note: syncs with the host once when `init_scale` is a tensor, to validate it.

        Args:
            init_scale: The starting scale, positive and finite.
            growth_factor: Growth factor, > 1.
            backoff_factor: Backoff factor, in (0, 1).
            growth_interval: Consecutive finite steps before each growth, >= 1.
            min_scale: Floor of the scale, positive and finite.
            max_scale: Ceiling of the scale, >= min_scale and finite.
            hysteresis: Consecutive overflows before the scale backs off, >= 1 (DeepSpeed, Megatron).
            device: Where the state's tensors live.

        Returns:
            The state.

        Raises:
            TypeError, ValueError: Naming the bad argument and its allowed range.
        """
        scale = _scale_tensor(init_scale, "init_scale", device)
        growth_factor = _check_factor("growth_factor", growth_factor, 1.0, math.inf)
        backoff_factor = _check_factor("backoff_factor", backoff_factor, 0.0, 1.0)
        min_scale = _check_factor("min_scale", min_scale, 0.0, math.inf)
        max_scale = _check_factor("max_scale", max_scale, 0.0, math.inf)
        if min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale})")
        if not min_scale <= float(scale) <= max_scale:
            raise ValueError(
                f"init_scale ({float(scale)}) must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}]"
            )
        zero = torch.zeros((), dtype=torch.int32, device=scale.device)
        return cls(
            loss_scale=scale,
            growth_tracker=zero,
            overflow_streak=zero.clone(),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=_check_count("growth_interval", growth_interval),
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=_check_count("hysteresis", hysteresis),
        )

    def scale(self, tree: Tree) -> Tree:
        """Multiplies floating leaves by the scale, with torch's type promotion (as GradScaler.scale)."""
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Tree) -> Tree:
        """Multiplies floating leaves by 1/scale (rounded as GradScaler does), keeping each leaf's dtype."""
        return _unscale_tree(tree, _inverse(self.loss_scale))

    def adjust(self, grads_finite: torch.Tensor) -> DynamicLossScale:
        """Returns the state after one step whose gradients were finite or not; branch-free.

        Finite step: the tracker counts up, and on reaching `growth_interval` the scale grows
        (unless that would overflow float32 or pass `max_scale`) and the tracker restarts.
        Non-finite step: the tracker restarts and, from the `hysteresis`-th consecutive overflow on,
        the scale backs off (never below `min_scale`).

        Args:
            grads_finite: A 0-dim bool tensor, e.g. `fmp.all_finite(grads)`.

        Returns:
            The new state.
        """
        check_finite_flag(grads_finite)
        scale = self.loss_scale
        tracker = self.growth_tracker + 1
        streak = self.overflow_streak + 1
        grow = grads_finite & (tracker >= self.growth_interval)
        back_off = ~grads_finite & (streak >= self.hysteresis)
        grown = _multiply_like_torch(scale, self.growth_factor)
        # GradScaler keeps the old scale when growing would overflow float32.
        grown = torch.where(torch.isfinite(grown), grown, scale)
        backed_off = _multiply_like_torch(scale, self.backoff_factor)
        new_scale = torch.where(grow, grown, torch.where(back_off, backed_off, scale))
        zero = torch.zeros_like(tracker)
        return dataclasses.replace(
            self,
            loss_scale=new_scale.clamp(self.min_scale, self.max_scale),
            growth_tracker=torch.where(grads_finite & ~grow, tracker, zero),
            overflow_streak=torch.where(grads_finite, zero, streak),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of fmp's loss-scale states."""
