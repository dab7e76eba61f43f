"""Rule tables for `fmp.autocast`: a rule set and overrides, checked and resolved to the table the mode reads.

Overrides and custom rule sets are keyed by op: a function (`torch.softmax`), its name, or a
function written out as a string (`"torch.softmax"`, `"F.softmax"`). A name no torch function or
op has is refused with the closest one suggested, since a rule the mode never sees would silently
do nothing.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import types
from collections.abc import Mapping
from typing import Any

import torch

from fmp.autocast._paths import CALLS
from fmp.autocast._paths import ROUTES
from fmp.autocast._rules import RULE_SETS
from fmp.autocast._rules import Cast
from fmp.autocast._rules import RuleSet

__all__ = ["Override", "Target", "checked_override", "resolve_rules", "seen_names"]

Override = Cast | torch.dtype | None
"""An override's value: a Cast, a fixed dtype to cast to, or None to leave the op uncast."""
Target = torch.dtype | Cast
"""A resolved rule: the dtype to cast to, or Cast.PROMOTE."""

_LOW_DTYPES = (torch.float16, torch.bfloat16)

# Tensor's operator methods reach the mode as the op they call: `x @ y` as "matmul", `x ** y` as
# "pow", `1 / x` as "__rdiv__" (`__rmatmul__`, a Python method, reaches it as itself and is routed to
# "matmul"). An override keyed by one applies to that op.
_OPERATORS = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rtruediv__": "__rdiv__"}
_OPERATORS |= {"__add__": "add", "__radd__": "add", "__sub__": "sub", "__mul__": "mul", "__rmul__": "mul"}
_OPERATORS |= {"__truediv__": "div", "__div__": "div", "__mod__": "remainder"}


# Short module names a string key may start with, as users import them.
_MODULE_ALIASES = {"F": "torch.nn.functional", "Tensor": "torch.Tensor", "aten": "torch.ops.aten"}


def _function_written_out(key: str, where: str) -> Any:
    """The object a dotted string such as "torch.fft.fft" or "F.linear" names; None for an op name."""
    head, dot, rest = key.partition(".")
    if not dot or "::" in key:  # an op's name: "softmax", "aten::mm"
        return None
    path = f"{_MODULE_ALIASES.get(head, head)}.{rest}".split(".")
    if path[0] != "torch":
        if _is_op_name(head):  # an overload's name: "mm.default"
            return None
        raise ValueError(
            f"unknown op {key!r} in autocast {where}: a path names a function from torch, e.g. "
            f"'torch.nn.functional.gelu', 'F.gelu', 'Tensor.softmax' or 'aten.mm'"
        )
    found: Any = torch
    for depth, attribute in enumerate(path[1:], start=1):
        if not hasattr(found, attribute):
            close = difflib.get_close_matches(attribute, dir(found), n=1)
            hint = f"; did you mean {'.'.join([*path[:depth], close[0]])!r}?" if close else ""
            raise ValueError(f"unknown op {key!r} in autocast {where}: torch has nothing at that path{hint}")
        found = getattr(found, attribute)
    if isinstance(found, types.ModuleType):
        raise TypeError(f"autocast {where}: key {key!r} names a module; key an op in it (e.g. {key}.<op>)")
    return found


def _op_name(op: Any, where: str) -> str:
    if isinstance(op, str):
        # Keyed by what the function is called (torch.fft.fft is "fft_fft"), as if passed itself.
        op = _function_written_out(op, where) or op
    if isinstance(op, type):
        raise TypeError(
            f"autocast {where}: key {op.__qualname__} is a class; {where} take ops (a function such as "
            "torch.softmax, or its name), not modules"
        )
    qualified = op.split("::")[-1] if isinstance(op, str) else getattr(op, "__name__", None)
    if not isinstance(qualified, str):
        raise TypeError(f"autocast {where}: key {op!r} is neither an op name nor a function with a __name__")
    name = qualified.split(".")[0]  # torch.ops.aten.mm.default is named "mm.default"
    return _OPERATORS.get(name, name)


@functools.cache
def seen_names() -> frozenset[str]:
    """The names the mode can see a call under: torch's overridable functions and methods, and its ops."""
    functions = itertools.chain.from_iterable(torch.overrides.get_overridable_functions().values())
    names = {getattr(f, "__name__", "").split(".")[0] for f in functions}
    names.update(op.split("::")[-1].split(".")[0] for op in torch._C._dispatch_get_all_op_names())
    return frozenset({_OPERATORS.get(name, name) for name in names} | set(CALLS) | set(ROUTES))


def _is_op_name(name: str) -> bool:
    if name in seen_names():
        return True
    seen_names.cache_clear()  # a custom op registered (torch.library) since the names were read
    return name in seen_names()


def _check_name(name: str, where: str) -> None:
    # A name the mode never sees would make a rule that silently does nothing.
    if any(name in rules for rules in RULE_SETS.values()) or _is_op_name(name):
        return
    known = seen_names().union(*RULE_SETS.values())
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; no torch function or op has that name"
        raise ValueError(f"unknown op {name!r} in autocast {where}{hint}")


def _in_place(name: str) -> bool:
    """Whether `name` is an in-place op: `mul_`, `addmm_`, or an augmented operator such as `__imul__`."""
    if name.startswith("__i") and name.endswith("__"):
        return True
    return name.endswith("_") and not name.startswith("_")


def _check_value(name: str, value: Any, what: str) -> None:
    if isinstance(value, torch.dtype) and not value.is_floating_point:
        raise TypeError(f"autocast {what} for {name!r} must cast to a floating dtype, got {value}")
    if value is not None and _in_place(name):
        # A cast makes a copy: the op would update the copy and leave the caller's tensor as it was.
        raise ValueError(
            f"autocast {what} for {name!r}: in-place ops are never cast (the op would update a cast copy, "
            f"not the caller's tensor), as under torch.autocast; key the out-of-place op instead"
        )


def _checked_rules(rules: Mapping[Any, Override]) -> dict[str, Override]:
    """A custom rule set keyed by op name, each name checked as an override's is."""
    checked: dict[str, Override] = {}
    for op, value in rules.items():
        name = _op_name(op, "rules")
        _check_name(name, "rules")
        _check_value(name, value, "rule")
        checked[name] = value
    return checked


def checked_override(op: Any, value: Override) -> str:
    """The op name of one override, checked as `autocast` checks its overrides: for `Policy.with_overrides`.

    Args:
        op: A torch function, its name or its path.
        value: The override's rule.

    Returns:
        The op's name, as rule sets key it.

    Raises:
        TypeError: For a class, a module or a value that is not a floating dtype, Cast or None.
        ValueError: For a name no torch function or op has, or an in-place op given a cast.
    """
    name = _op_name(op, "overrides")
    _check_name(name, "overrides")
    _check_value(name, value, "override")
    return name


def _merge(rules: Mapping[str, Override], overrides: Mapping[Any, Override] | None) -> dict[str, Override]:
    """The rule set with the overrides on top, keyed by op name, each override checked."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"autocast overrides must be a mapping of op to rule, got {type(overrides).__name__}")
    merged: dict[str, Override] = dict(rules)
    for op, value in (overrides or {}).items():
        merged[checked_override(op, value)] = value
    return merged


def resolve_rules(
    rules: str | RuleSet, dtype: torch.dtype, overrides: Mapping[Any, Override] | None = None
) -> dict[str, Target | None]:
    """Turns a rule set and overrides into the table the mode reads: op name -> dtype, PROMOTE or None.

    Args:
        rules: "cuda", "cpu", or a mapping of op name to `Cast`.
        dtype: The lower dtype, float16 or bfloat16.
        overrides: Op (a function such as `torch.softmax`, or its name) -> a `Cast`, a floating
            dtype to always cast to, or None to leave the op uncast.

    Returns:
        A dict from op name to the dtype its inputs are cast to, `Cast.PROMOTE`, or None for an op
        overridden to stay uncast (where the rule of an op it calls inside no longer applies).

    Raises:
        ValueError: For an unknown rule-set name, or a rule or override of an op no torch
            function has the name of.
        TypeError: For a dtype that is not float16 or bfloat16, overrides that are not a mapping, an
            override keyed by a class, or a value that is not a Cast, a floating dtype or None.
    """
    if dtype not in _LOW_DTYPES:
        raise TypeError(f"autocast dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    if not isinstance(rules, str | Mapping):
        raise TypeError(
            f"autocast rules must be a rule-set name ({', '.join(RULE_SETS)}) or a mapping of op name to Cast, "
            f"got {type(rules).__name__}; without rules, call the function as it is"
        )
    base: Mapping[str, Override]
    if isinstance(rules, str):
        if rules not in RULE_SETS:
            raise ValueError(f"unknown autocast rule set {rules!r}; accepted: {', '.join(RULE_SETS)} or a mapping")
        base = RULE_SETS[rules]
    else:
        base = rules if any(rules is built_in for built_in in RULE_SETS.values()) else _checked_rules(rules)
    table: dict[str, Target | None] = {}
    for name, value in _merge(base, overrides).items():
        if value is None or isinstance(value, torch.dtype):
            table[name] = value
        elif value is Cast.LOWER:
            table[name] = dtype
        elif value is Cast.FLOAT32:
            table[name] = torch.float32
        elif value is Cast.PROMOTE:
            table[name] = Cast.PROMOTE
        elif value is Cast.FLOAT32_UNLESS_FLOAT16:
            table[name] = Cast.FLOAT32_UNLESS_FLOAT16 if dtype == torch.float16 else torch.float32
        else:
            raise TypeError(f"autocast rule for {name!r} must be a Cast, a torch.dtype or None, got {value!r}")
    return table
