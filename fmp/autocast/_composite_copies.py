"""Plain copies of torch.nn.functional's Python composites, which compiled code redispatches to.

Dynamo sends a redispatched torch function back to the mode ("cannot skip two levels"), but
inlines a copy, which is no torch function, and its body's own has_torch_function check takes
the skip, so the body runs with fmp.autocast's mode on, as in eager. Dynamo refuses to inline
code from torch/functional.py, so compiled, torch.functional's composites (torch.split, a
non-contracting einsum) run as one call: each body wraps the op of its name (stft pads first),
which the rule sets cast only where the call's own rule already does.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from types import FunctionType
from typing import Any
from typing import cast

import torch

__all__ = ["PLAIN_COPIES"]


def _plain_copies() -> dict[Any, Callable[..., Any]]:
    """Each torch.nn.functional composite -> a plain copy of it, `boolean_dispatch` ones included."""
    copies: dict[Any, Callable[..., Any]] = {}
    functions = [v for v in vars(torch.nn.functional).values() if isinstance(v, FunctionType)]
    # Dynamo puts `_list_with_default` (adaptive pooling's output size) in the graph as a torch
    # function, which under a mode must return a tensor: the copies call a copy of it instead.
    namespace = dict(vars(torch.nn.functional))
    list_with_default = cast(FunctionType, torch.nn.modules.utils._list_with_default)
    namespace["_list_with_default"] = _function_copy(list_with_default, namespace)
    for value in functions:
        if value.__module__ == "torch.nn.functional" and value not in torch._jit_internal.boolean_dispatched:
            copies[value] = _function_copy(value, namespace)
    for value in functions:
        dispatch = torch._jit_internal.boolean_dispatched.get(value)
        if dispatch is not None and dispatch["if_true"] in copies and dispatch["if_false"] in copies:
            copies[value] = _boolean_dispatch_copy(dispatch, copies)
    return copies


def _function_copy(function: FunctionType, namespace: dict[str, Any]) -> FunctionType:
    """`function`'s code as a new function object reading its globals from `namespace`."""
    copy = FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _boolean_dispatch_copy(dispatch: Mapping[str, Any], copies: Mapping[Any, Callable[..., Any]]) -> Callable[..., Any]:
    """A traceable twin of a `boolean_dispatch` composite (`F.max_pool2d`): the same choice, between plain copies.

    Dynamo refuses to trace torch._jit_internal, where the dispatching function's code lives, so
    compiled, `F.max_pool2d(x, 2)` inside a region would end the graph.
    """
    if_true, if_false = copies[dispatch["if_true"]], copies[dispatch["if_false"]]
    arg_name, index, default = dispatch["arg_name"], dispatch["index"], dispatch["default"]

    def choose(*args: Any, **kwargs: Any) -> Any:
        flag = kwargs[arg_name] if arg_name in kwargs else args[index] if index < len(args) else default
        return if_true(*args, **kwargs) if flag else if_false(*args, **kwargs)

    return choose


PLAIN_COPIES = _plain_copies()
"""Each torch.nn.functional composite -> a plain copy of it, for `fmp.autocast`'s mode to redispatch to."""
