"""Fixed-dtype regions: torch.amp's `custom_fwd`/`custom_bwd` as function transforms.

`fixed_dtype(fn, dtype)` runs `fn` with its floating-point inputs cast to `dtype` and autocast off
inside, so its ops run in `dtype` even inside an `fmp.autocast` region (the innermost region wins,
see `fmp.autocast`) or a `torch.autocast` one on CPU or CUDA. `no_autocast(fn)` only turns
autocast off, as `torch.autocast(enabled=False)`.

Differences from `torch.amp.custom_fwd(cast_inputs=dtype)`:

- The cast always happens. custom_fwd casts only when it runs inside an autocast-enabled region
  and is a no-op outside one (inside fmp's own mode too; a native region, the device's own rules,
  is torch.autocast and enables it), so the region is the same function wherever it is called.
- No `device_type`: fmp's regions are not tied to a device.
- It wraps any function, not only an autograd.Function's `forward`: wrap the Function's `apply`
  (`fixed_dtype(MyFunction.apply, torch.float32)`), so the casts are recorded by autograd and
  gradients come back to each input in its own dtype.
- No `custom_bwd` is needed. The backward of ops recorded inside the region runs in the dtypes
  the forward ran in, and a hand-written `autograd.Function.backward` never runs under an fmp
  region: `torch.func.grad(fmp.autocast.autocast(f))` differentiates after the region is left, and
  `torch.autograd.grad` and `Tensor.backward` called inside one are torch functions the region
  passes through with its mode off. So a backward sees the dtypes its forward saved, which under
  `fixed_dtype` are `dtype`: what custom_bwd arranges by replaying the forward's autocast state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import ParamSpec
from typing import TypeVar

import torch

import fmp._pytree as pytree
from fmp._checks import check_callable
from fmp.autocast._transform import AutocastMode

__all__ = ["fixed_dtype", "no_autocast"]

P = ParamSpec("P")
R = TypeVar("R")


def cast_inputs(tree: Any, dtype: torch.dtype) -> Any:
    """Casts the floating-point tensor leaves of `tree` to `dtype`, leaving float64 ones alone.

    The eligibility rule of `custom_fwd(cast_inputs=...)` and of torch.autocast: float64 tensors
    and non-floating leaves pass through.

    Args:
        tree: A pytree.
        dtype: The dtype to cast to.

    Returns:
        `tree` with its eligible leaves cast.
    """

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype not in (torch.float64, dtype):
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)


def check_floating_dtype(dtype: Any, what: str) -> None:
    """Raises a TypeError, naming `what`, unless `dtype` is a floating-point torch.dtype."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{what} must be a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}")


def _run_without_torch_autocast(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Runs `fn` with `torch.autocast` off on CPU and CUDA, as `custom_fwd(cast_inputs=...)` does."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        # Both, unconditionally: a with-statement per device traces under torch.compile, where an
        # ExitStack of autocast contexts does not.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def no_autocast(fn: Callable[P, R]) -> Callable[P, R]:
    """Returns `fn` run with autocast off: its ops run in the dtypes of their inputs.

    The equivalent of `torch.autocast(enabled=False)` around the body, and the innermost region
    wins, so the body is cast neither by an outer `fmp.autocast` nor by an outer `torch.autocast`
    (on CPU or CUDA). Inputs are not cast: cast them inside `fn`, or use `fixed_dtype`.

    Args:
        fn: The function to transform.

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError: When `fn` is not callable.
    """
    check_callable("no_autocast's fn", fn)

    @functools.wraps(fn)
    def no_autocast_fn(*args: P.args, **kwargs: P.kwargs) -> R:
        return _run_without_torch_autocast(AutocastMode({}).run, fn, *args, **kwargs)

    return no_autocast_fn


def fixed_dtype(fn: Callable[P, R], dtype: torch.dtype) -> Callable[P, R]:
    """Returns `fn` run in `dtype`: floating inputs cast to it on entry, autocast off inside.

    The equivalent of `torch.amp.custom_fwd(cast_inputs=dtype)`, for any function or an
    autograd.Function's `apply`: a region that must run in one dtype (a numerically fragile
    custom kernel in float32, say) inside a model run under `fmp.autocast` or `torch.autocast`
    (on CPU or CUDA; both are off inside). Floating-point tensors
    in the arguments (nested in lists, tuples and dicts too) are cast to `dtype`, except float64
    ones; the casts are recorded by autograd, so each input's gradient comes back in its own dtype.
    Outputs are returned as `fn` makes them (cast them, or the caller's ops will see `dtype`).

    Args:
        fn: The function to transform.
        dtype: The dtype the region runs in: any floating-point dtype.

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError: When `fn` is not callable or `dtype` is not a floating-point torch.dtype (raised
            here, not on the call).
    """
    check_callable("fixed_dtype's fn", fn)
    check_floating_dtype(dtype, "fixed_dtype's dtype")

    @functools.wraps(fn)
    def fixed_dtype_fn(*args: P.args, **kwargs: P.kwargs) -> R:
        cast_args, cast_kwargs = cast_inputs((args, kwargs), dtype)
        return _run_without_torch_autocast(AutocastMode({}).run, fn, *cast_args, **cast_kwargs)

    return fixed_dtype_fn
