"""A guard filter for `torch.compile` that drops Dynamo's checks on fmp's and torch's own code.

A compiled `train_step` is one graph, and Dynamo guards everything the traced code read: the
state's tensors, the model, and the identity of every library function, class and module the step
passed through, with checks that two paths to one module still meet. It runs those guards before
every call; for a whole step they cost several times what `torch.compile(model)`'s do
(benchmarks/RESULTS.md). The identity guards on library code protect against patching fmp or
torch between steps, which a training loop does not do.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

__all__ = ["skip_library_code_guards"]

# Guards that an object reached through a global is still the one traced, or still aliased as then.
_IDENTITY_GUARDS = frozenset(
    {"BUILTIN_MATCH", "CLASS_MATCH", "CLOSURE_MATCH", "DUPLICATE_INPUT", "FUNCTION_MATCH", "ID_MATCH", "MODULE_MATCH"}
)
_LIBRARIES = frozenset({"fmp", "torch", "optree", "functools", "builtins"})
# What code is made of. Anything else (a dict such as a pytree registry, a list of regions, a flag)
# is state that can change between calls, and keeps its guards.
_CODE = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    type,
    TypeVar,
    types.UnionType,
)
# Dynamo names a module's globals G['__import_<its name, each "." spelled "_dot_">'], builtins
# G['__builtins_dict___<n>'], and reaches torch's pytree registry through __import__('torch').
_ROOT = re.compile(r"(?:list\(dict\.keys\()?G\['__(import|builtins)_([A-Za-z0-9_]+?)'\]|__import__\('(\w+)'\)")


def _library_root(source: str) -> bool:
    """Whether `source` starts at a global of fmp's, torch's, optree's, functools' or the builtins' modules."""
    match = _ROOT.match(source)
    if match is None:
        return False
    kind, alias, imported = match.groups()
    if imported is not None:
        return imported in _LIBRARIES
    if kind == "builtins":
        return True
    name = alias.replace("_dot_", ".")
    # A module whose own name holds "_dot_" (torch_dot_layers) would read as a library's submodule.
    if name != alias and alias in sys.modules:
        return False
    return name in sys.modules and name.split(".")[0] in _LIBRARIES


def skip_library_code_guards(entries: Sequence[Any]) -> list[bool]:
    """A `guard_filter_fn` for `torch.compile`: keeps every guard except identity checks on fmp's and torch's code.

    Pass it as `torch.compile(step, fullgraph=True, options={"guard_filter_fn":
    fmp.skip_library_code_guards})`. It drops the guards that a module, function or class
    reached through fmp's, torch's, optree's or functools' globals (or a builtin) is the one
    traced, and that two paths to one such object still meet. Every other guard stays: on the
    state's tensors (so a new shape, dtype or structure recompiles), on the model and the loss
    function and everything of the caller's, on library state that can change (the pytree
    registries, torch's backend flags, fmp's autocast regions), and torch's global state (grad
    mode, autocast). So patching a library function between calls (a monkeypatched
    `torch.nn.functional.gelu`, say) would go unnoticed by the compiled step, as with torch's
    own `torch.compiler.skip_guard_on_*_unsafe` filters, of which this one skips the least.
    [Performance and memory tuning](../how-to/performance-tuning.md) has the figures.

    Args:
        entries: Dynamo's guard entries (`torch._dynamo.types.GuardFilterEntry`), each with a
            `name` (its source) and a `guard_type`.

    Returns:
        One bool per entry: whether to keep its guard.
    """
    return [not _drops(entry) for entry in entries]


def _drops(entry: Any) -> bool:
    if entry.guard_type not in _IDENTITY_GUARDS or not getattr(entry, "has_value", False):
        return False
    return isinstance(entry.value, _CODE) and _library_root(entry.name)
