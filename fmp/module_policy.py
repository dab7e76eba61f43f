"""Per-module precision policies, Haiku-style, for models called through `torch.func.functional_call`.

`module_policies(fn, model, {nn.LayerNorm: fmp.get_policy("f32"), "head": ...})` returns `fn` run
with each matched submodule of `model` in its own policy: on entry to the submodule's forward its
floating inputs and parameters are cast to the policy's compute dtype, its ops run with autocast
off (a region that wins over any outer `fmp.autocast`, as `fmp.fixed_dtype`), and its floating
outputs are cast to the policy's output dtype. Everything else follows whatever surrounds it:
the outer policy's casts, an outer `fmp.autocast`, or nothing.

The submodules' `forward` is wrapped for the duration of the call only, as an instance attribute
removed when `fn` returns or raises (a `forward` another library patched onto the instance is
wrapped, and put back after), so nothing outlives the call. The parameters cast are the ones in
place when the submodule runs, those `functional_call` swapped in or the module's own: cast copies
are swapped in for its forward and out again, so gradients flow back to the originals in their
own dtype. Buffers are not cast: BatchNorm's running statistics are updated in place and must
stay the caller's tensors.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple
from typing import ParamSpec
from typing import TypeVar

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from fmp.autocast import AutocastMode
from fmp.policy import Policy

__all__ = ["PolicyKey", "module_policies"]

P = ParamSpec("P")
R = TypeVar("R")

PolicyKey = type[nn.Module] | str
"""A module class (matched with isinstance) or an fnmatch pattern over `named_modules()` names."""

_FORWARD = "forward"
_ACTIVE = "_fmp_module_policy"  # marks a module whose forward is wrapped now


class _Match(NamedTuple):
    name: str
    module: nn.Module
    policy: Policy
    owned: tuple[str, ...]  # its parameters (relative names) that no nested match owns


def _check_policies(model: Any, policies: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"module_policies needs an nn.Module, got {type(model).__name__}")
    if not isinstance(policies, Mapping):
        raise TypeError(f"policies must be a mapping of module class or name pattern to Policy, got {policies!r}")
    names = [name for name, _ in model.named_modules()]
    for key, policy in policies.items():
        if not isinstance(policy, Policy):
            raise TypeError(
                f"the policy for {key!r} must be an fmp.Policy (e.g. fmp.get_policy('c=f32')), "
                f"got {type(policy).__name__}"
            )
        if isinstance(key, str):
            if not any(fnmatch.fnmatchcase(name, key) for name in names):
                shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(f"module name pattern {key!r} matches no module of the model; names: {shown}")
        elif not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise TypeError(f"policy key {key!r} is neither an nn.Module subclass nor a name pattern (str)")


def _policy_for(name: str, module: nn.Module, policies: Mapping[Any, Policy]) -> Policy | None:
    for key, policy in policies.items():
        if fnmatch.fnmatchcase(name, key) if isinstance(key, str) else isinstance(module, key):
            return policy
    return None


def _plan(model: nn.Module, policies: Mapping[Any, Policy]) -> tuple[_Match, ...]:
    chosen = [
        (name, module, policy)
        for name, module in model.named_modules()
        if (policy := _policy_for(name, module, policies)) is not None
    ]
    matches = []
    for name, module, policy in chosen:
        prefix = f"{name}." if name else ""
        # A nested match casts its own parameters from the originals, not from this one's copies.
        nested = [other[len(prefix) :] + "." for other, _, _ in chosen if other != name and other.startswith(prefix)]
        owned = tuple(
            param
            for param, _ in module.named_parameters(remove_duplicate=False)
            if not any(param.startswith(sub) for sub in nested)
        )
        matches.append(_Match(name, module, policy, owned))
    return tuple(matches)


def _policy_forward(match: _Match, forward: Callable[..., Any]) -> Callable[..., Any]:
    policy, module = match.policy, match.module

    @functools.wraps(forward)
    def policy_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = policy.cast_to_compute((args, kwargs))
        # The tensors functional_call swapped in (or the module's own outside one).
        params = dict(module.named_parameters(remove_duplicate=False))
        cast: dict[str, torch.Tensor] = {name: policy.cast_to_compute(params[name]) for name in match.owned}
        with _reparametrize_module(module, cast):
            out = AutocastMode({}).run(forward, *args, **kwargs)
        return policy.cast_to_output(out)

    return policy_forward


def module_policies(fn: Callable[P, R], model: nn.Module, policies: Mapping[Any, Policy]) -> Callable[P, R]:
    """Returns `fn` run with chosen submodules of `model` in their own precision policies.

    Keys are module classes, matched with isinstance (`nn.LayerNorm`, or a base class such as
    `nn.modules.batchnorm._NormBase`), or fnmatch patterns over the names
    `model.named_modules()` gives ("head", "blocks.*.attn"; "" is the model itself). A module
    matched by several keys takes the first in the mapping's order. A matched module's inputs and
    parameters are cast to the policy's compute dtype on entry, its ops run with autocast off,
    and its outputs are cast to the policy's output dtype; the policy's param dtype is not used
    (parameters arrive in whatever dtype the caller keeps them). Modules nested in a matched one
    follow it unless matched themselves.

    Example: keep all norm layers in float32 under a bfloat16 policy or autocast::

        loss = fmp.module_policies(loss_fn, model, {nn.LayerNorm: fmp.get_policy("f32")})

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
        ValueError: For a name pattern that matches no module.
    """
    _check_policies(model, policies)
    matches = _plan(model, policies)

    @functools.wraps(fn)
    def module_policies_fn(*args: P.args, **kwargs: P.kwargs) -> R:
        # Through __dict__: Dynamo replays setattr/delattr on a module as a bare delattr, which fails.
        saved: list[tuple[dict[str, Any], Any]] = []
        try:
            for match in matches:
                attrs = match.module.__dict__
                if _ACTIVE in attrs:
                    raise RuntimeError(
                        f"module {match.name or '<model>'!r} is already under module_policies (nested calls "
                        f"over one module); merge the mappings into one call"
                    )
                # A forward patched on the instance (by another library) is wrapped and put back after.
                saved.append((attrs, attrs.get(_FORWARD)))
                attrs[_ACTIVE] = True
                attrs[_FORWARD] = _policy_forward(match, match.module.forward)
            return fn(*args, **kwargs)
        finally:
            for attrs, previous in reversed(saved):
                del attrs[_ACTIVE]
                if previous is None:
                    del attrs[_FORWARD]
                else:
                    attrs[_FORWARD] = previous

    return module_policies_fn
