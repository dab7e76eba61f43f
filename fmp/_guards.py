"""A guard filter for `torch.compile` that drops Dynamo's checks on fmp's and torch's own code.

A compiled `train_step` is one graph, and Dynamo guards everything the traced code read: the
state's tensors, the model, and the identity of every library function, class and module the step
passed through, with checks that a global name is not shadowed and that two paths to one module
still meet. It runs those guards before every call; for a whole step they cost several times what
`torch.compile(model)`'s do (benchmarks/RESULTS.md). The identity guards on library code protect
against patching fmp or torch between steps, which a training loop does not do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["skip_library_code_guards"]

# Guards that a global is still the same object, not shadowed, or still aliased as when traced.
_CODE_IDENTITY_GUARDS = frozenset(
    {
        "BUILTIN_MATCH",
        "CLASS_MATCH",
        "CLOSURE_MATCH",
        "DICT_NOT_CONTAINS",
        "DUPLICATE_INPUT",
        "FUNCTION_MATCH",
        "ID_MATCH",
        "MODULE_MATCH",
    }
)
_LIBRARIES = frozenset({"fmp", "torch", "optree", "functools"})
# Dynamo names an imported module's globals G['__import_<name with . as _dot_>']; optree's
# registry keys appear behind list(dict.keys(...)).
_MODULE_GLOBAL = re.compile(r"(?:list\(dict\.keys\()?G\['__import_([A-Za-z0-9_]+?)(?:_dot_|'\])")
_LIBRARY_PREFIXES = ("G['__builtins", "__import__('torch')")


def _on_library_global(source: str) -> bool:
    if source.startswith(_LIBRARY_PREFIXES):
        return True
    match = _MODULE_GLOBAL.match(source)
    return match is not None and match.group(1) in _LIBRARIES


def skip_library_code_guards(entries: Sequence[Any]) -> list[bool]:
    """A `guard_filter_fn` for `torch.compile`: keeps every guard except identity checks on fmp's and torch's code.

    Pass it as `torch.compile(step, fullgraph=True, options={"guard_filter_fn":
    fmp.skip_library_code_guards})`. It drops the guards that a function, class or module
    reached through fmp's, torch's, optree's or functools' globals (or a builtin) is the one
    traced, that such a global name is not shadowed, and that two paths to one such object still
    meet. Every other guard stays: on the state's tensors (so a new shape, dtype or structure
    recompiles), on the model and the loss function and everything of the caller's, on values
    such as torch's backend flags and fmp's autocast regions, and torch's global state (grad
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
    return [not (entry.guard_type in _CODE_IDENTITY_GUARDS and _on_library_global(entry.name)) for entry in entries]
