"""Per-module precision policies, Haiku-style, for models called through `torch.func.functional_call`.

`module_policies(fn, model, {nn.LayerNorm: fmp.get_policy("f32"), "head": ...})` returns `fn` run
with each matched submodule of `model` in its own policy: on entry to the submodule's forward its
floating inputs and parameters are cast to the policy's compute dtype, its ops run with autocast
off (a region that wins over any outer `fmp.autocast`, as `fmp.autocast.fixed_dtype`), and its floating
outputs are cast to the policy's output dtype. Everything else follows whatever surrounds it:
the outer policy's casts, an outer `fmp.autocast`, or nothing.

The submodules' `forward` is wrapped for the duration of the call only, as an instance attribute
removed when `fn` returns or raises (a `forward` another library patched onto the instance is
wrapped, and put back after), so nothing outlives the call. The parameters cast are the ones in
place when the submodule runs, those `functional_call` swapped in or the module's own: cast copies
are swapped in for its forward and out again, so gradients flow back to the originals in their
own dtype.

Buffers are never cast: BatchNorm's running statistics are updated in place and must stay the
caller's tensors. A norm layer with running statistics (BatchNorm, InstanceNorm) has its
parameters cast to the statistics' dtype instead of the compute dtype (see `module_policies`).
"""

from __future__ import annotations

import abc
import contextlib
import fnmatch
import functools
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import ParamSpec
from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.utils.stateless import _reparametrize_module

from fmp._ambient import AMBIENT
from fmp._checks import check_callable
from fmp._policy import Policy
from fmp._tree import cast_floating
from fmp.autocast._transform import AutocastMode

__all__ = [
    "PolicyKey",
    "ReadingForward",
    "check_key",
    "matched_modules",
    "module_policies",
    "patched_forwards",
    "patched_modules",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

PolicyKey = type[nn.Module] | str
"""A module class (matched with isinstance) or an fnmatch pattern over `named_modules()` names."""

_FORWARD = "forward"
_ACTIVE = "_fmp_module_policy"  # marks a module whose forward is wrapped now


class _Match(NamedTuple):
    name: str
    module: nn.Module
    policy: Policy
    # Its parameters (relative names) that no nested match owns, each with the module holding it.
    owned: tuple[tuple[str, nn.Module], ...]


class ReadingForward(abc.ABC):
    """A patched forward that reads tensors besides its module's parameters and buffers.

    `fmp.fp8.fp8_modules` patches a layer on a delayed recipe with one: it reads the layer's
    scales, which the step differentiates. `fmp.remat` cannot let a block read a differentiated
    tensor it does not take as an argument, so it passes the tensors of each such forward in the
    block in, and runs the block with the forwards reading what it passed.
    """

    @abc.abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors this forward reads."""

    @abc.abstractmethod
    def reading(self, tensors: tuple[torch.Tensor, ...], *, counted: bool) -> ReadingForward:
        """The same forward, reading `tensors` (as `tensors()` returned them, or their replacements) instead.

        Args:
            tensors: What it reads.
            counted: Whether its runs count with this forward's (a block's first run), or apart
                from them (the block's recompute, which runs its layers again).
        """

    @abc.abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward."""


def _shown(items: list[str]) -> str:
    return ", ".join(repr(item) for item in items[:8]) + (", ..." if len(items) > 8 else "")


def check_key(key: Any, named: list[tuple[str, nn.Module]], what: str, *, class_must_match: bool = True) -> None:
    """Raises unless `key` is a name pattern that names a module of `named` or an nn.Module subclass.

    With `class_must_match`, a class must also match one of `named`'s modules. `what` names the
    mapping's values in the message ("policy").
    """
    if isinstance(key, str):
        if not any(fnmatch.fnmatchcase(name, key) for name, _ in named):
            names = [name for name, _ in named]
            raise ValueError(f"module name pattern {key!r} matches no module of the model; names: {_shown(names)}")
    elif not (isinstance(key, type) and issubclass(key, nn.Module)):
        raise TypeError(f"{what} key {key!r} is neither an nn.Module subclass nor a name pattern (str)")
    elif class_must_match and not any(isinstance(module, key) for _, module in named):
        classes = list(dict.fromkeys(type(module).__name__ for _, module in named))
        raise ValueError(f"module class {key.__name__} matches no module of the model; classes: {_shown(classes)}")


def _check_policies(model: Any, policies: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"module_policies needs an nn.Module, got {type(model).__name__}")
    if not isinstance(policies, Mapping):
        raise TypeError(f"policies must be a mapping of module class or name pattern to Policy, got {policies!r}")
    named = list(model.named_modules(remove_duplicate=False))
    for key, policy in policies.items():
        if not isinstance(policy, Policy):
            raise TypeError(
                f"the policy for {key!r} must be an fmp.Policy (e.g. fmp.get_policy('c=f32')), "
                f"got {type(policy).__name__}"
            )
        check_key(key, named, "policy")


def matched_modules(model: nn.Module, mapping: Mapping[Any, T]) -> list[tuple[str, nn.Module, T]]:
    """Each module of `model` a key matches, under its first name, with the first matching key's value.

    Keys are module classes (isinstance) or fnmatch patterns over every name a module has in
    `model.named_modules(remove_duplicate=False)`, so a shared submodule matches by any of its names.
    """
    aliases: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), (module, []))[1].append(name)
    matched = []
    for module, names in aliases.values():
        for key, value in mapping.items():
            by_name = isinstance(key, str) and any(fnmatch.fnmatchcase(name, key) for name in names)
            if by_name or (isinstance(key, type) and isinstance(module, key)):
                matched.append((names[0], module, value))
                break
    return matched


def _owned(module: nn.Module, matched: set[int]) -> tuple[tuple[str, nn.Module], ...]:
    submodules = list(module.named_modules(remove_duplicate=False))
    # A nested match casts its own parameters from the originals, not from this one's copies.
    nested = tuple(f"{name}." for name, sub in submodules if name and id(sub) in matched)
    holders = dict(submodules)
    return tuple(
        (param, holders[param.rpartition(".")[0]])
        for param, _ in module.named_parameters(remove_duplicate=False)
        if not param.startswith(nested)
    )


def _plan(model: nn.Module, policies: Mapping[Any, Policy]) -> tuple[_Match, ...]:
    chosen = matched_modules(model, policies)
    matched = {id(module) for _, module, _ in chosen}
    return tuple(_Match(name, module, policy, _owned(module, matched)) for name, module, policy in chosen)


def _param_dtype(holder: nn.Module, policy: Policy) -> torch.dtype:
    # Buffers are never cast (BatchNorm updates its running statistics in place), so a norm layer's
    # parameters meet its statistics in their dtype: torch's mixed BatchNorm kernel takes a 16-bit
    # input with float32 weight and statistics, but not 16-bit weight with float32 statistics. Other
    # modules' buffers (a gain, a positional table) are ordinary inputs: their params follow the policy.
    if not isinstance(holder, _NormBase):
        return policy.compute_dtype
    dtypes = [buffer.dtype for buffer in holder.buffers(recurse=False) if buffer.is_floating_point()]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else policy.compute_dtype


def _policy_forward(match: _Match, forward: Callable[..., Any], ran: set[str]) -> Callable[..., Any]:
    policy, module = match.policy, match.module

    @functools.wraps(forward)
    def policy_forward(*args: Any, **kwargs: Any) -> Any:
        ran.add(match.name)
        args, kwargs = policy.cast_to_compute((args, kwargs))
        # The tensors functional_call swapped in (or the module's own outside one).
        params = dict(module.named_parameters(remove_duplicate=False))
        cast: dict[str, torch.Tensor] = {
            name: cast_floating(params[name], _param_dtype(holder, policy)) for name, holder in match.owned
        }
        with _reparametrize_module(module, cast):
            out = AutocastMode({}).run(forward, *args, **kwargs)
        return policy.cast_to_output(out)

    return policy_forward


def patched_modules() -> tuple[nn.Module, ...]:
    """The modules whose forwards `module_policies` calls running on this thread have patched, outermost first.

    `fmp.remat` keeps their forwards for its recompute, which runs after the call has put them back.
    """
    return tuple(AMBIENT.patched_modules)


@contextlib.contextmanager
def patched_again(modules: tuple[nn.Module, ...]) -> Iterator[None]:
    """Counts `modules` as patched on this thread for the body.

    For `fmp.remat`'s recompute, which puts their forwards back: a block rematerialized inside it
    then keeps them in turn.
    """
    AMBIENT.patched_modules.extend(modules)
    try:
        yield
    finally:
        del AMBIENT.patched_modules[len(AMBIENT.patched_modules) - len(modules) :]


@contextlib.contextmanager
def patched_forwards(forwards: Sequence[tuple[str, nn.Module, Callable[..., Any]]], by: str) -> Iterator[None]:
    """Runs the body with each module's `forward` replaced, put back after (on errors too).

    The replacement is an instance attribute, set and removed through `__dict__` (Dynamo replays
    setattr/delattr on a module as a bare delattr, which fails); a `forward` another library
    patched onto the instance is put back after. The modules count as patched on this thread
    (`patched_modules`) for `fmp.remat`'s recompute.

    Args:
        forwards: (name, module, new forward) triples; the name is for the error below.
        by: What patches them ("module_policies"), for the error below.

    Raises:
        RuntimeError: If a module is already patched by a call running now (nested calls over one module).
    """
    saved: list[tuple[dict[str, Any], Any]] = []
    try:
        for name, module, forward in forwards:
            attrs = module.__dict__
            if _ACTIVE in attrs:
                raise RuntimeError(
                    f"module {name or '<model>'!r} is already under {by} or another call that replaces "
                    f"forwards (module_policies, fmp.fp8.fp8_modules) over one module; merge the mappings into one call"
                )
            saved.append((attrs, attrs.get(_FORWARD)))
            attrs[_ACTIVE] = True
            attrs[_FORWARD] = forward
            AMBIENT.patched_modules.append(module)
        yield
    finally:
        for attrs, previous in reversed(saved):
            AMBIENT.patched_modules.pop()
            del attrs[_ACTIVE]
            if previous is None:
                del attrs[_FORWARD]
            else:
                attrs[_FORWARD] = previous


def _warn_not_run(matches: tuple[_Match, ...], ran: set[str], warned: set[str]) -> None:
    for match in matches:
        if match.name not in ran and match.name not in warned:
            warned.add(match.name)
            warnings.warn(
                f"module_policies: module {match.name or '<model>'!r} ({type(match.module).__name__}) was matched "
                f"but its forward did not run in this call: its parent uses its parameters directly (as "
                f"nn.MultiheadAttention does with out_proj) or does not call it, so its policy does not apply",
                UserWarning,
                stacklevel=3,
            )


def module_policies(fn: Callable[P, R], model: nn.Module, policies: Mapping[Any, Policy]) -> Callable[P, R]:
    """Returns `fn` run with chosen submodules of `model` in their own precision policies.

    Keys are module classes, matched with isinstance (`nn.LayerNorm`, or a base class such as
    `nn.modules.batchnorm._NormBase`), or fnmatch patterns over the names
    `model.named_modules(remove_duplicate=False)` gives ("head", "blocks.*.attn"; "" is the model
    itself; a submodule registered under several names matches by any of them). A module matched
    by several keys takes the first in the mapping's order. A matched module's inputs and
    parameters are cast to the policy's compute dtype on entry, its ops run with autocast off, and
    its outputs are cast to the policy's output dtype; the policy's param dtype is not used
    (parameters arrive in whatever dtype the caller keeps them). Modules nested in a matched one
    follow it unless matched themselves.

    Buffers are never cast, so a norm layer holding floating buffers (`_NormBase`: BatchNorm's and
    InstanceNorm's running statistics) gets its parameters cast to the buffers' dtype (the widest,
    should they differ) and only its inputs to the compute dtype; other modules' parameters follow
    the policy, their buffers being ordinary inputs. BatchNorm with float32 statistics under a bfloat16 or float16
    policy normalizes a 16-bit input with float32 weight and bias, as under `torch.autocast`,
    updates its statistics in place and returns float32 gradients to float32 weight and bias.
    Where torch's kernel refuses the mix, under `vmap` (its batching rule) or for a float64
    compute dtype over float32 statistics, give BatchNorm a float32-compute policy
    (`get_policy("c=f32,o=bf16")`) or keep its buffers in the compute dtype.

    Example: keep all norm layers in float32 under a bfloat16 policy or autocast::

        loss = fmp.autocast.module_policies(loss_fn, model, {nn.LayerNorm: fmp.get_policy("f32")})

    A policy applies only where the matched module's `forward` runs. A parent that reads a
    submodule's parameters directly bypasses it (`nn.MultiheadAttention` passes `out_proj.weight`
    to its functional form); a matched module whose forward did not run in a call is named in a
    `UserWarning`, once per module for the returned function, after an eager call (not while
    `torch.compile` traces it, where the warning cannot be traced).

    Works under `torch.func.grad`, `vmap` and `torch.compile(fullgraph=True)` (one graph).
    Matching is resolved here, from the model's structure now.

    Args:
        fn: The function to transform; it calls `model` (usually through `functional_call`).
        model: The module whose submodules the keys match.
        policies: `PolicyKey` (a module class or a name pattern) -> `fmp.Policy`.

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError: For a model that is not an nn.Module, a value that is not a Policy, or a key
            that is neither an nn.Module subclass nor a string.
        ValueError: For a name pattern or a module class that matches no module.
    """
    check_callable("module_policies' fn", fn)
    _check_policies(model, policies)
    matches = _plan(model, policies)
    warned: set[str] = set()  # the matches already warned about, so each is named once

    @functools.wraps(fn)
    def module_policies_fn(*args: P.args, **kwargs: P.kwargs) -> R:
        ran: set[str] = set()  # the matches whose forward ran in this call
        forwards = [(m.name, m.module, _policy_forward(m, m.module.forward, ran)) for m in matches]
        with patched_forwards(forwards, "module_policies"):
            out = fn(*args, **kwargs)
        # Dynamo cannot trace warnings.warn, so only eager calls check; the graph is the same either way.
        if not torch.compiler.is_compiling():
            _warn_not_run(matches, ran, warned)
        return out

    return module_policies_fn
