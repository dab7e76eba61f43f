"""Validation of hyperparameters, with errors that name the argument and its allowed range."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any
from typing import cast

__all__ = ["check_bool", "check_callable", "check_int", "check_real"]


def check_real(
    name: str, value: Any, low: float, high: float, *, low_inclusive: bool = True, high_inclusive: bool = False
) -> float:
    """Returns `value` as a float, or raises naming `name` and the interval it must lie in.

    Any real number is accepted (Python and numpy floats and ints), bools are not; NaN never is.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # only an int too large for any float gets here
        number = math.inf if cast(int, value) > 0 else -math.inf
    above = number >= low if low_inclusive else number > low
    below = number <= high if high_inclusive else number < high
    if math.isnan(number) or not (above and below):
        interval = f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return number


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """Returns `value` as an int, or raises naming `name` and the closed range [low, high]."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    if getattr(value, "ndim", 0) != 0:  # a one-element tensor or array passes operator.index
        raise TypeError(f"{name} must be an int, got a {type(value).__name__} of shape {tuple(value.shape)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not low <= number <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {number}")
    return number


def check_bool(name: str, value: Any) -> bool:
    """Returns `value`, or raises a TypeError naming `name` unless it is a bool (a flag, not a truthy value)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_callable(name: str, value: Any) -> None:
    """Raises a TypeError naming `name` unless `value` can be called (here, not when it is first called)."""
    if not callable(value):
        raise TypeError(f"{name} must be a function, got {type(value).__name__}")
