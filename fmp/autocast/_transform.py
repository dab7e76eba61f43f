"""Functional autocast: torch.autocast's op-level precision rules as a function transform.

`autocast(fn, dtype)` returns `fn` run under a `TorchFunctionMode` that casts each listed op's
floating-point inputs by its rule (`fmp.autocast._rules`). A function mode sits above autograd and
torch.func, so the casts are recorded like any user-written `.to()`: gradients flow back to each
input in its own dtype, and `torch.func.grad`, `vmap` and `torch.compile(fullgraph=True)` see
ordinary ops. The mode is entered inside the call and left when it returns or raises.

The mode sees public calls; torch.autocast sees the aten ops torch's C++ splits them into. A call
whose own name has no rule follows the rule of the first op with one on its path through torch
(`CALLS` for fixed paths, such as `x.square()` to pow; `ROUTES` for paths that depend on the
arguments, such as einsum reaching bmm only when it contracts).

Regions nest, and the innermost wins: every fmp mode entered through `AutocastMode.run` is kept on
a per-thread stack, and a mode that is not the innermost one passes its calls through, so an inner
`autocast`, `fmp.autocast.fixed_dtype` or `fmp.autocast.no_autocast` region is never re-cast by an outer one.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import ParamSpec
from typing import TypeVar
from typing import cast

import torch
from torch.overrides import TorchFunctionMode

import fmp._pytree as pytree
from fmp._ambient import AMBIENT
from fmp._checks import check_callable
from fmp.autocast._composite_copies import PLAIN_COPIES
from fmp.autocast._overrides import Override
from fmp.autocast._overrides import Target
from fmp.autocast._overrides import resolve_rules
from fmp.autocast._paths import argument
from fmp.autocast._paths import call_path
from fmp.autocast._paths import negative_power
from fmp.autocast._rules import RULE_SETS
from fmp.autocast._rules import Cast
from fmp.autocast._rules import RuleSet

__all__ = ["AutocastMode", "NativeRegion", "autocast", "resolve_rules"]

P = ParamSpec("P")
R = TypeVar("R")

_BCE_FLOAT16_ERROR = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast to float16: "
    "their backward can produce gradients float16 cannot represent.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer. In this case, combine "
    "the two layers using torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss. "
    "binary_cross_entropy_with_logits and BCEWithLogits are safe to autocast.\n"
    "(fmp: autocast to bfloat16 runs binary_cross_entropy in float32, or override the rule with "
    "overrides={'binary_cross_entropy': torch.float32}.)"
)

# Python-level composites that do not redispatch (torch < 2.13 lacks redispatch_function) run
# with the mode off inside, so their inner ops are not cast.
_redispatch = getattr(torch.overrides, "redispatch_function", None)
# Modules of Python composites that redispatch cleanly; Tensor's Python methods (torch._tensor)
# call the C method of the same name, which would come back here forever.
_COMPOSITE_MODULES = frozenset({"torch.nn.functional", "torch.functional"})
_IS_CPU = operator.attrgetter("is_cpu")


def _call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Compiled, a Python Tensor method called as a function (Tensor.unflatten) is inlined and
    # fails on its super() call; called as a method, Dynamo puts it in the graph.
    name = getattr(func, "__name__", "")
    if (
        torch.compiler.is_compiling()
        and args
        and isinstance(args[0], torch.Tensor)
        and getattr(func, "__module__", None) == "torch._tensor"
        and getattr(torch.Tensor, name, None) is func
    ):
        return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


class _Region:
    """What fmp's regions share: the `torch.autocast` nesting they started from, to tell a region model code entered."""

    _torch_nesting: int | None = None  # torch.autocast regions around the present `run` (its own included)

    def inside_torch_autocast(self) -> bool:
        """Whether the present call comes from inside a `torch.autocast` region entered within this one's `run`."""
        return self._torch_nesting is not None and _torch_autocast_nesting() > self._torch_nesting


class NativeRegion(_Region):
    """An fmp region run on torch's own autocast: a built-in rule set on the device it is for.

    `autocast(fn, dtype, rules="cpu")` on CPU tensors (or "cuda" on CUDA ones) asks for exactly
    what `torch.autocast` does there, so it runs `fn` inside `torch.autocast(device_type, dtype)`:
    torch's dispatcher casts the aten ops, bit for bit as torch.amp, with no Python call per op,
    and code that asks `torch.is_autocast_enabled()` or `torch.get_autocast_dtype()` (RNN input
    checks, `custom_fwd`/`custom_bwd`) gets torch.autocast's answers.

    Args:
        device_type: "cpu" or "cuda".
        dtype: The lower dtype.
    """

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type = device_type
        self.dtype = dtype

    def run(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Calls `fn(*args, **kwargs)` inside `torch.autocast`, as the innermost fmp region.

        Args:
            fn: The function to call.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            What `fn` returns.
        """
        stack = active_modes()
        stack.append(self)
        outer_nesting = self._torch_nesting
        try:
            with torch.autocast(self.device_type, dtype=self.dtype):
                self._torch_nesting = _torch_autocast_nesting()
                return fn(*args, **kwargs)
        finally:
            self._torch_nesting = outer_nesting
            stack.pop()


def active_modes() -> list[AutocastMode | NativeRegion]:
    """The fmp regions active on this thread, innermost last (the list itself, for push and pop)."""
    return AMBIENT.regions


def _torch_autocast_nesting() -> int:
    """How many `torch.autocast` regions (enabled or not) this thread is inside.

    torch counts them but offers no getter: incrementing returns the new count, and the decrement
    puts it back (clearing the cast cache is left to `torch.autocast`'s exit). Dynamo runs both
    while tracing, inside the regions the traced code has entered.
    """
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return nesting - 1


def _eligible(x: Any) -> bool:
    # torch.autocast's rule: floating tensors other than float64 are cast; all else is left alone.
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast_to(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda x: x.to(dtype) if _eligible(x) and x.dtype != dtype else x, tree)


def _widest(tree: Any) -> torch.dtype | None:
    # Of float16 and bfloat16 neither holds the other: mixed, they promote to float32 as torch does.
    dtypes: set[torch.dtype] = {x.dtype for x in pytree.tree_leaves(tree) if _eligible(x)}
    if len(dtypes) <= 1:
        return None
    return functools.reduce(torch.promote_types, dtypes)


class AutocastMode(_Region, TorchFunctionMode):
    """The function mode behind `autocast`: casts listed ops' inputs by a resolved rule table.

    Enter it with `run`, which makes it the innermost fmp region on this thread; an empty table is
    a region with autocast off. A mode entered with a bare `with` is not on fmp's stack, and passes
    its calls through while another fmp region is active.

    Args:
        table: Op name -> target, as `resolve_rules` returns it (None: the op's inputs are not cast);
            empty to disable autocast.
    """

    def __init__(self, table: Mapping[str, Target | None]) -> None:
        super().__init__()
        self.table = table
        self._torch_nesting: int | None = None  # torch.autocast regions around `run`'s call

    def run(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Calls `fn(*args, **kwargs)` with this mode on, as the innermost fmp region.

        Args:
            fn: The function to call.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            What `fn` returns. The mode is left when `fn` returns or raises.
        """
        stack = active_modes()
        outer = stack[-1] if stack else None
        if isinstance(outer, NativeRegion):
            # The outer region's torch.autocast would cast this region's ops again: the innermost wins.
            with torch.autocast(outer.device_type, enabled=False):
                return self._run(stack, fn, *args, **kwargs)
        return self._run(stack, fn, *args, **kwargs)

    def _run(
        self, stack: list[AutocastMode | NativeRegion], fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        stack.append(self)
        # A mode run again inside its own run (fmp.remat's recompute) takes the present nesting as
        # its baseline for that call only.
        outer_nesting, self._torch_nesting = self._torch_nesting, _torch_autocast_nesting()
        try:
            with self:
                return fn(*args, **kwargs)
        finally:
            self._torch_nesting = outer_nesting
            stack.pop()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        stack = active_modes()
        if not self.table or (stack and stack[-1] is not self) or self.inside_torch_autocast():
            # Off, or an outer region reached from an inner one (which has already cast), or from
            # a torch.autocast region entered inside this one (model code's `enabled=False`): the
            # innermost region's rules are the only ones applied.
            return _call(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if isinstance(func, torch._ops.OpOverload):
            name = func.overloadpacket.__name__  # torch.ops.aten.mm.default is named "mm.default"
        target = self._target(name, args, kwargs)
        if target is None:
            return self._uncast(func, name, types, args, kwargs)
        # out= and an explicit dtype= opt an op out of autocast, as under torch.autocast; so does
        # inplace=True (F.relu's), whose write must land in the caller's tensor, not a cast copy.
        if kwargs.get("out") is not None or kwargs.get("dtype") is not None or kwargs.get("inplace") is True:
            return _call(func, args, kwargs)
        if any(isinstance(a, torch.dtype) for a in args):
            return _call(func, args, kwargs)
        if name == "einsum" and self._einsum_as_torch_cpu(target, args, kwargs):
            # Which pairs torch contracts with bmm (cast) and which with mul (promoting) depends on
            # the shapes and the contraction order: torch.autocast("cpu") itself casts at its bmms.
            # An enabled one around the region does so already, in its own dtype, as for matmul.
            if torch.is_autocast_enabled("cpu"):
                return _call(func, args, kwargs)
            with torch.autocast("cpu", dtype=cast(torch.dtype, target)):
                return _call(func, args, kwargs)
        if isinstance(target, torch.dtype):
            args, kwargs = _cast_to((args, kwargs), target)
            return _call(func, args, kwargs)
        if target is Cast.PROMOTE:
            widest = _widest((args, kwargs))
            if widest is not None:
                args, kwargs = _cast_to((args, kwargs), widest)
            return _call(func, args, kwargs)
        raise RuntimeError(_BCE_FLOAT16_ERROR)  # Cast.FLOAT32_UNLESS_FLOAT16 under float16

    def _einsum_as_torch_cpu(self, target: Target, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Whether to run an einsum on CPU tensors under torch.autocast("cpu"), whose casts are the rules'.

        Where the rules do not list einsum itself (the CPU set) and it reaches bmm, whose rule is the
        lower dtype: torch casts the inputs of each bmm inside, and of nothing else einsum runs.
        """
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        return (
            "einsum" not in self.table
            and target in (torch.float16, torch.bfloat16)
            and target == self.table.get("bmm")
            and all(x.device.type == "cpu" for x in tensors)
        )

    def _target(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Target | None:
        """The rule of the first op on the call's path that the table lists; None if none does."""
        if name in self.table:
            return self.table[name]
        for inner in call_path(name, args, kwargs):
            if inner in self.table:
                return self.table[inner]
        return None

    def _uncast(self, func: Any, name: str, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs a call whose own inputs are not cast; the ops a composite calls inside still follow the rules."""
        if name in {"matrix_power", "linalg_matrix_power"} and negative_power(args, kwargs):
            return self._inverse_first(func, types, args, kwargs)
        # A Python composite (F.multi_head_attention_forward) runs its body with the mode on so its
        # inner ops are cast; a builtin has no inner torch calls.
        if _redispatch is not None and getattr(func, "__module__", None) in _COMPOSITE_MODULES:
            body = PLAIN_COPIES.get(func) if torch.compiler.is_compiling() else func
            if body is not None:
                with self:
                    return _redispatch(body, types, args, kwargs)
        return _call(func, args, kwargs)

    def _inverse_first(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """A negative matrix power as torch computes one: the inverse, by its own rule, to the power -n."""
        matrix, n = argument(args, kwargs, 0, "input"), argument(args, kwargs, 1, "n")
        return self.__torch_function__(func, types, (self.__torch_function__(torch.linalg.inv, types, (matrix,)), -n))


# The step wraps its loss function anew each call: the named rule sets' tables are built once, in
# plain dicts, which Dynamo reads as constants (it warns on functools' caches, and a MappingProxyType
# breaks the graph once the traced code has mutated any dict, as functional_call does).
_NAMED_TABLES: dict[tuple[str, torch.dtype], dict[str, Target | None]] = {
    (name, dtype): resolve_rules(name, dtype) for name in RULE_SETS for dtype in (torch.float16, torch.bfloat16)
}


def autocast_on_table(fn: Callable[P, R], table: Mapping[str, Target | None]) -> Callable[P, R]:
    """`fn` run on fmp's per-op mode with a table `resolve_rules` made (a policy's rules and overrides).

    For a table resolved once, where the policy was made: a compiled step then reads a plain dict
    instead of checking op names while Dynamo traces it, and an eager step skips the resolving.
    """

    @functools.wraps(fn)
    def autocast_fn(*args: P.args, **kwargs: P.kwargs) -> R:
        return AutocastMode(cast(RuleSet, table)).run(fn, *args, **kwargs)

    return autocast_fn


def autocast(
    fn: Callable[P, R],
    dtype: torch.dtype,
    *,
    rules: str | RuleSet = "cuda",
    overrides: Mapping[Any, Override] | None = None,
) -> Callable[P, R]:
    """Returns `fn` run with torch.autocast's per-op casting, as a pure function transform.

    Listed ops cast their floating-point inputs by rule: matmuls, convolutions and linear layers
    to `dtype`; softmax, norms, losses, exp/log/pow and reductions to float32; "promote" ops
    (addcmul, atan2, ...) to the widest dtype among their inputs. As under torch.autocast, float64
    and non-floating tensors are never cast, in-place ops and calls with `out=` or an explicit
    `dtype=` are not cast, and every other op runs in the dtypes of its inputs. A call torch
    splits up in C++ follows the rule of the op torch.autocast catches inside it: `x.square()`
    that of pow, `torch.special.softmax` that of softmax, `F.pad(x, p, mode="reflect")` that of
    reflection_pad2d, a fully contracted tensordot that of dot.

    The default "cuda" rules are torch's CUDA lists on every device: on CPU they keep softmax
    and layer_norm in float32 where torch.autocast("cpu") runs them in bfloat16. "cpu" gives
    torch's CPU lists, for parity with torch.autocast("cpu"). Nothing outlives the call: the
    casting is active only while `fn` runs, and in nested regions the innermost one's rules win.
    So a generator function's body, which runs when it is iterated, after `fn` has returned the
    generator, is not cast: wrap the function that iterates it.

    Args:
        fn: The function to transform.
        dtype: The lower dtype: torch.float16 or torch.bfloat16.
        rules: "cuda", "cpu", or a mapping of op name to `fmp.autocast._rules.Cast`.
        overrides: Per-op changes on top of `rules`: op (a function such as `torch.softmax`, its
            name, e.g. "layer_norm", or its path, e.g. "torch.fft.rfft"; `x @ y` is "matmul") -> a
            `Cast`, a floating dtype to always cast to, or None for no cast. An override of an inner
            op (pow) applies to the calls that reach it (`x.square()`).

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError, ValueError: For a bad dtype, rule set or override (an op name no torch function
            has, a class, a dtype that is not floating, overrides that are not a mapping), when
            `autocast` is called (not when the returned function is), so a typo fails before any
            compute.
        RuntimeError: From the returned function, for `binary_cross_entropy` under float16.
    """
    check_callable("autocast's fn", fn)
    named = (rules, dtype) if isinstance(rules, str) and not overrides and (rules, dtype) in _NAMED_TABLES else None
    # A named table is looked up only where a call needs it: a compiled step guards on every
    # table it reads, and one that runs on torch.autocast reads none.
    table = None if named is not None else resolve_rules(rules, dtype, overrides)
    native = None if overrides else _native_device_type(rules)

    @functools.wraps(fn)
    def autocast_fn(*args: P.args, **kwargs: P.kwargs) -> R:
        if native is not None and _floating_tensors_on(native, (args, kwargs)):
            return NativeRegion(native, dtype).run(fn, *args, **kwargs)
        rule_set = _NAMED_TABLES[named] if named is not None else cast(RuleSet, table)
        return AutocastMode(rule_set).run(fn, *args, **kwargs)

    return autocast_fn


def _native_device_type(rules: str | RuleSet) -> str | None:
    """The device type whose torch.autocast `rules` are, or None for rules of one's own."""
    if isinstance(rules, str):  # a name reads no table (a compiled step would guard on the tables it reads)
        return rules if rules in RULE_SETS else None
    for device_type, built_in in RULE_SETS.items():
        if rules is built_in:
            return device_type
    return None


def _floating_tensors_on(device_type: str, tree: Any) -> bool:
    """Whether `tree` holds floating tensors and all of them are on `device_type`."""
    leaves = pytree.tree_leaves(tree)
    # Eager, the usual arguments, plain tensors all on the CPU: one look at each, not three.
    plain = device_type == "cpu" and not torch.compiler.is_compiling() and set(map(type, leaves)) == {torch.Tensor}
    if plain and all(map(_IS_CPU, leaves)):
        return any(map(torch.Tensor.is_floating_point, leaves))
    floating = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
    # Property reads, where `.device` builds a device object per leaf; the named rule sets are CPU's and CUDA's.
    if device_type == "cpu":
        return bool(floating) and all(x.is_cpu for x in floating)
    return bool(floating) and all(x.is_cuda for x in floating)
