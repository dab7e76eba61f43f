"""`fmp.compile`: `torch.compile` for functions that call fmp, with fmp's own code trusted by the guards.

Before every call of a compiled function, Dynamo checks guards on everything its trace read. A
step that calls fmp inlines a few hundred of fmp's functions, each reached through one of fmp's
modules; Dynamo guards that every function, class and module it met there is still the same
object, and on a small model that check costs as much as all the model's own guards. fmp's code
does not change while a process trains, so `compile` drops those identity guards (on fmp's
functions and classes and on the torch objects fmp's modules refer to by name) and keeps every
other one: on the state, the batch, the model and the loss function, on the values that fmp's
modules hold (the ambient autocast regions, caches, constants), and on whatever the trace reached
through any other module (the model's code, and torch as the model's modules name it).

Each function it compiles also gets a code object of its own, so that its graphs and recompiles
are counted apart from every other compiled function's; on a machine without an accelerator
Inductor generates the graph's wrapper as C++ (`cpp_wrapper`), which calls the same kernels with
less overhead per call; Inductor writes max pooling's argmax to memory where a whole-step
graph would compute it again in the backward pass (`RealizePoolIndices`); and AOTAutograd's cache
keeps a graph that enters torch.autocast (fmp's regions on torch's own rules), so a warm cache
skips tracing the step's joint graph again. A large graph's C++ wrapper is built apart from its
kernels, at -O1, which halves a deep model's cold compile.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar
from typing import cast
from typing import overload

import torch
from torch._dynamo.types import GuardFilterEntry
from torch.amp import autocast_mode

from fmp._pool_indices import RealizePoolIndices
from fmp._wrapper_build import BuildLargeWrapperApart

__all__ = ["compile", "trusted_guard"]

F = TypeVar("F", bound=Callable[..., Any])

# Dynamo names a module that traced code reaches in the frame's globals "__import_" + its name with
# each "." written "_dot_" (the module itself when it is a package's root).
_MODULE_ALIAS = "__import_"
_DOT = "_dot_"

# Guards on what an object is, not on what it holds: it is the same function (code and closure),
# class, module or object as at trace time, has or lacks an attribute. Guards on values (constants,
# lengths, dict keys) and on tensors are never dropped.
_IDENTITY_GUARDS = frozenset(
    {
        "BUILTIN_MATCH",
        "CLASS_MATCH",
        "CLOSURE_MATCH",
        "DUPLICATE_INPUT",
        "FUNCTION_MATCH",
        "HASATTR",
        "ID_MATCH",
        "MODULE_MATCH",
        "NOT_PRESENT_IN_GENERIC_DICT",
        "TYPE_MATCH",
    }
)


# Seen with torch 2.13 on a CPU: the Python-wrapper build of a whole step gave wrong gradients.
_PYTHON_WRAPPER_ON_CPU = (
    "fmp.compile: options={'cpp_wrapper': False} on a machine without an accelerator: with torch 2.13, "
    "a whole step built with Inductor's Python wrapper was seen to compute wrong BatchNorm gradients in "
    "bfloat16 with AVX-512 code on more than one thread. Keep the C++ wrapper, or check the gradients against "
    "an eager step; see fmp's docs, how-to/performance-tuning"
)

# Fusion candidates tried per kernel among those sharing a buffer (Inductor's default: 64).
_FUSION_PAIRS = 8

# AOTAutograd's cache passes over a graph that calls a function missing from its list of cacheable
# ones, and a step whose regions run on torch.autocast enters and leaves it inside the graph. What
# these two calls do is fixed by their arguments, constants of the graph and so of the cache key:
# marked cacheable (keyed by the torch version), a warm cache skips AOTAutograd's tracing too.
_AUTOCAST_IN_GRAPH = {
    f"{function.__module__}.{function.__name__}": torch.__version__
    for function in (autocast_mode._enter_autocast, autocast_mode._exit_autocast)
}


def _root_global(source: Any) -> str | None:
    """The global name a guard's source starts from, or None where it starts from a local."""
    while getattr(source, "base", None) is not None:
        source = source.base
    name = getattr(source, "global_name", None)
    return name if isinstance(name, str) else None


def _is_fmp_module(alias: str) -> bool:
    name = alias.removeprefix(_MODULE_ALIAS).replace(_DOT, ".")
    return alias.startswith(_MODULE_ALIAS) and (name == "fmp" or name.startswith("fmp."))


def trusted_guard(entry: GuardFilterEntry) -> bool:
    """Whether a Dynamo guard only checks that fmp's code, as its modules name it, is what was traced.

    Such a guard checks the identity of an object that the trace reached through one of fmp's
    modules: fmp's functions and classes, and the torch and standard-library objects fmp's code
    refers to by name (`torch.where` as fmp's modules see it). `compile` drops these; a
    `guard_filter_fn` of one's own may use this to do the same.

    Args:
        entry: One of the entries Dynamo hands a `guard_filter_fn`.

    Returns:
        True for an identity guard whose sources all start at fmp's modules.
    """
    if entry.guard_type not in _IDENTITY_GUARDS:
        return False
    sources: list[Any] = [entry.orig_guard.originating_source]
    if entry.guard_type == "DUPLICATE_INPUT":
        # Two sources that must be one object: trusted only where both start at fmp's modules.
        sources.append(getattr(entry.orig_guard.create_fn, "keywords", {}).get("source_b"))
    roots = [_root_global(source) for source in sources]
    return all(root is not None and _is_fmp_module(root) for root in roots)


@overload
def compile(
    fn: F,
    *,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> F: ...


@overload
def compile(
    fn: None = None,
    *,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> Callable[[F], F]: ...


def compile(
    fn: F | None = None,
    *,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> F | Callable[[F], F]:
    """`torch.compile(fn)` whose guards trust fmp's own code; whole-graph by default.

    Takes what `torch.compile` takes and traces the same graph. The guards differ: those
    that check that an object reached through fmp's modules (fmp's functions and classes, the torch
    functions they call) is the one traced are dropped (see `trusted_guard` and
    [Performance and memory tuning](../how-to/performance-tuning.md)). With the inductor backend,
    one pass differs too: max pooling's argmax is written once to memory, as `torch.compile(model)`'s
    forward saves it for its backward, where a graph holding both passes would compute it again
    in the backward (`RealizePoolIndices`).
    Every guard on the state, the batch, the model, the loss function and on values is kept, so a
    new batch shape, a changed model or a new policy still recompiles. Code that replaces one of
    fmp's functions (a test's monkeypatch) after the first call is not seen until
    `torch._dynamo.reset()`. Each function compiled here keeps its own graphs and its own count
    against `torch._dynamo.config.recompile_limit`, where torch.compile puts every
    `functools.partial` it compiles in one process into one shared list (the ninth raises under
    `fullgraph=True`); so compiling one function twice compiles it twice. A module is compiled as
    torch.compile compiles it. With the inductor backend on a machine without an accelerator, it
    also sets Inductor's `cpp_wrapper` unless `options` do: the graph's kernels are called from
    generated C++ rather than Python; `options={"cpp_wrapper": False}` there warns (but for a
    module), as torch 2.13's Python-wrapper build of a whole step was seen to compute wrong gradients
    ([Performance and memory tuning](../how-to/performance-tuning.md)). There, unless `options` (or
    Inductor's config as this is called) set `cpp_wrapper_build_separate`, a function's graph of
    more than 4000 calls, counted after every other post-grad pass (the caller's included), has its
    wrapper built apart from its kernels, at -O1: on a 2-core Xeon VM a 12-layer GPT-2's whole step
    then compiled in half the time, its steps as fast or up to 2% slower, where a small graph's
    step ran a few percent slower so built. With the inductor
    backend, torch.autocast's enter and exit, which a step on torch's own rules calls inside its
    graph, are marked cacheable beside any the caller marked (`unsafe_marked_cacheable_functions`):
    their arguments are constants of the graph, and without the mark AOTAutograd's cache passes
    such a graph over. And unless `options` set it, Inductor tries 8 fusion partners per kernel
    among those sharing a buffer (`max_fusion_buffer_group_pairwise_attempts`, 64 by default):
    every param's update reads the step's few scalars, so each of its kernels was tried against 64
    others that cannot fuse with it.

    Args:
        fn: The function to compile, e.g. `functools.partial(fmp.train_step, loss_fn, ...)`; without
            it, a decorator (`@fmp.compile(options=...)`), as torch.compile's.
        fullgraph: As torch.compile's; True, as fmp's steps compile whole.
        dynamic: As torch.compile's.
        backend: As torch.compile's.
        mode: As torch.compile's; with the inductor backend it is folded into `options` (torch.compile
            takes one or the other), with another backend it cannot be given.
        options: As torch.compile's. A `guard_filter_fn` in them also runs: a guard stays where both
            keep it. A `post_grad_custom_post_pass` in them (or else in `torch._inductor.config`
            as this is called) runs after fmp's `RealizePoolIndices`; one set to None runs no
            post-grad pass, fmp's included. The dict is not modified.
        **compile_kwargs: torch.compile's other keywords (`disable`, `recompile_limit`, ... as the
            installed torch has them), passed on.

    Returns:
        The compiled function, or without `fn` a decorator that compiles one.

    Raises:
        TypeError: If `fn` is not callable, `options` is not a dict or its `guard_filter_fn` is not
            callable.
        ValueError: If `mode` is unknown, or given with a backend other than inductor; and at the
            first call, if a `guard_filter_fn` in `options` answers for another number of guards.

    Warns:
        UserWarning: With the inductor backend on a machine without an accelerator, if `options`
            set `cpp_wrapper` to False for a function (see above).
    """
    if fn is None:

        def decorate(function: F) -> F:
            return _compiled(function, fullgraph, dynamic, backend, mode, options, compile_kwargs)

        return decorate
    return _compiled(fn, fullgraph, dynamic, backend, mode, options, compile_kwargs)


def _compiled(
    fn: F,
    fullgraph: bool,
    dynamic: bool | None,
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    compile_kwargs: dict[str, Any],
) -> F:
    """`compile`'s work, called from `compile` itself or from its decorator (so a warning names the caller's line)."""
    if not callable(fn):
        raise TypeError(f"fmp.compile: fn must be callable, got {type(fn).__name__}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"fmp.compile: options must be a dict, got {type(options).__name__}")
    merged: dict[str, Any] = {}
    if mode not in (None, "default"):
        if backend != "inductor":
            raise ValueError(
                f"fmp.compile: mode={mode!r} works with the inductor backend only, got backend={backend!r}; "
                "pass the backend's own options instead"
            )
        try:
            merged.update(torch._inductor.list_mode_options(mode, dynamic))
        except RuntimeError as error:  # torch's "Unrecognized mode=..., should be one of: ..."
            raise ValueError(f"fmp.compile: {error}") from None
    merged.update(options or {})
    merged["guard_filter_fn"] = _keep_untrusted(merged.get("guard_filter_fn"))
    wrapper_by_size = False
    is_module = isinstance(fn, torch.nn.Module)  # a model's forward and backward compile apart
    if backend == "inductor":
        if not torch.accelerator.is_available():
            # Everything runs on the CPU: the graph's Python wrapper (buffer allocation, kernel
            # calls) is generated as C++, the same kernels called with less overhead per step.
            merged.setdefault("cpp_wrapper", True)
            if merged["cpp_wrapper"] is False and not is_module:
                warnings.warn(_PYTHON_WRAPPER_ON_CPU, UserWarning, stacklevel=3)
            # A large graph's wrapper is built apart, at -O1 (see BuildLargeWrapperApart), unless the
            # caller chose; the key goes in the options so that the pass's choice reverts with them.
            wrapper_by_size = (
                merged["cpp_wrapper"] is True
                and not is_module
                and "cpp_wrapper_build_separate" not in merged
                and not torch._inductor.config.cpp_wrapper_build_separate
            )
            if wrapper_by_size:
                merged["cpp_wrapper_build_separate"] = False
        # Inductor tries to fuse each kernel with the next 64 that use one of its buffers; in a
        # whole step every param's update reads the same few scalars (scale, skip flag, step
        # sizes), so each update kernel met 64 others it cannot fuse with: a quarter of a cold
        # compile on a model of a hundred param tensors.
        merged.setdefault("max_fusion_buffer_group_pairwise_attempts", _FUSION_PAIRS)
        theirs = merged.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
        opted_out = "post_grad_custom_post_pass" in merged and theirs is None
        if not opted_out:
            passes = _after_pool_indices(theirs)
            if wrapper_by_size and not any(isinstance(each, BuildLargeWrapperApart) for each in passes):
                passes.append(BuildLargeWrapperApart())
            merged["post_grad_custom_post_pass"] = passes
        cacheable = "unsafe_marked_cacheable_functions"
        marked = merged.get(cacheable, torch._inductor.config.unsafe_marked_cacheable_functions)
        merged[cacheable] = {**_AUTOCAST_IN_GRAPH, **marked}
    target = fn if is_module else _own_frame(fn)
    compiled = torch.compile(
        target, fullgraph=fullgraph, dynamic=dynamic, backend=backend, options=merged, **compile_kwargs
    )
    return cast(F, compiled)


def _own_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` called from a function whose code object is its own.

    Dynamo keeps compiled graphs, and counts recompiles against `recompile_limit`, per code object.
    torch.compile calls a `functools.partial` (the usual way to bind a step's loss function and
    settings) from one shared wrapper, so every compiled partial in a process shares one list of
    graphs: each call checks the others' guards first, and the ninth partial hits the limit.
    """

    def compiled_function(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # replace() makes a new code object (copy.deepcopy would return the same one).
    compiled_function.__code__ = compiled_function.__code__.replace()
    return functools.wraps(fn)(compiled_function)


def _after_pool_indices(theirs: Any) -> list[Any]:
    """Inductor's post-grad passes: fmp's `RealizePoolIndices`, then the caller's own (one, or a list)."""
    passes = list(theirs) if isinstance(theirs, (list, tuple)) else [] if theirs is None else [theirs]
    if any(isinstance(each, RealizePoolIndices) for each in passes):
        return passes
    return [RealizePoolIndices(), *passes]


def _keep_untrusted(
    user_filter: Callable[[Sequence[GuardFilterEntry]], Sequence[bool]] | None,
) -> Callable[[Sequence[GuardFilterEntry]], list[bool]]:
    if user_filter is not None and not callable(user_filter):
        raise TypeError(f"fmp.compile: options['guard_filter_fn'] must be callable, got {type(user_filter).__name__}")

    def guard_filter(entries: Sequence[GuardFilterEntry]) -> list[bool]:
        kept = [not trusted_guard(entry) for entry in entries]
        if user_filter is None:
            return kept
        theirs = user_filter(entries)
        if len(theirs) != len(entries):
            raise ValueError(
                f"fmp.compile: options['guard_filter_fn'] returned {len(theirs)} answers for {len(entries)} guards"
            )
        return [bool(ours) and bool(their) for ours, their in zip(kept, theirs, strict=True)]

    return guard_filter
