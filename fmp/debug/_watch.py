"""The watchers behind `fmp.debug.locate_nonfinite`: a function mode over the forward, hooks on the backward.

Both look for the first call that makes inf or NaN out of finite values, and note the module that
ran it (through global forward hooks, on the calling thread only). Reading a tensor's values here
syncs with the host: these are debugging tools.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from fmp._tree import functorch_base
from fmp._tree import is_inexact_tensor

__all__ = ["BackwardWatch", "ForwardWatch", "Found", "ModuleStack", "floating", "kinds"]


def _values(x: torch.Tensor) -> torch.Tensor:
    # A sparse tensor's stored values (the implicit zeros are finite).
    if x.layout == torch.sparse_coo:
        return x._values()
    return x if x.layout == torch.strided else x.values()


def floating(tree: Any) -> list[torch.Tensor]:
    """The non-empty floating and complex tensors of `tree` (their stored values, with any `torch.func` wrapper off)."""
    leaves = [x for x in pytree.tree_leaves(tree) if is_inexact_tensor(x) and x.numel() > 0]
    return [_values(functorch_base(x)) for x in leaves]


def _largest_magnitude(tensors: list[torch.Tensor]) -> float:
    """The largest finite magnitude among the values (NaN if none is finite)."""
    magnitudes = [x.detach().abs() for x in tensors]
    finite = [m[torch.isfinite(m)] for m in magnitudes]
    return max((float(m.max()) for m in finite if m.numel()), default=math.nan)


def kinds(tensors: list[torch.Tensor]) -> str:
    """Which non-finite values the tensors hold: "", "inf", "NaN" or "inf and NaN"."""
    infinite = any(bool(torch.isinf(x).any()) for x in tensors)
    nan = any(bool(torch.isnan(x).any()) for x in tensors)
    return " and ".join(kind for kind, present in (("inf", infinite), ("NaN", nan)) if present)


def _new_kinds(before: str, after: str) -> bool:
    # An op is an origin where it makes a kind its inputs did not hold: inf from finite values,
    # or NaN from values without NaN (inf - inf, or a softmax over a row masked whole with -inf).
    return any(kind in after and kind not in before for kind in ("inf", "NaN"))


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    return f"{owner}.{name}" if name == "__get__" and owner else name


class Found(NamedTuple):
    """One call that made inf or NaN its inputs did not hold, its module still an object."""

    op: str
    node: str
    module: nn.Module | None
    made: str
    inputs_held: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtypes: tuple[torch.dtype, ...]
    largest_input: float


def _found(
    op: str, node: str, module: nn.Module | None, inputs: list[Any], outputs: list[Any], held: str, largest: float
) -> Found:
    """A `Found` for one call, from its inputs' `kinds` (`held`) and largest finite magnitude.

    Both are read before the call runs: an in-place call's inputs are its outputs after.
    """
    dtypes = tuple(x.dtype for x in inputs), tuple(x.dtype for x in outputs)
    return Found(op, node, module, kinds(outputs), held, *dtypes, largest)


_ABSENT = object()  # a buffer name a module did not have


class _BufferLog:
    """What a run did to modules' buffers, to undo: values written in place, and buffers replaced.

    Each buffer tensor is copied when a module holding it first enters. A module that replaces a
    buffer in its forward (`self.count = self.count + 1`), or adds one, is seen by comparing its
    buffers as it leaves with those it entered with; tensors that `torch.func.functional_call`
    swaps in and out around a call are not the module's doing, and are left to it.
    """

    def __init__(self) -> None:
        self.values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entered: list[dict[str, Any]] = []
        self.replaced: list[tuple[nn.Module, str, Any, Any]] = []

    def enter(self, module: nn.Module) -> None:
        buffers = dict(module._buffers)
        for tensor in buffers.values():
            # Wrapped buffers are swapped in under a transform inside the loss, and die with it.
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.layout == torch.strided
                and id(tensor) not in self.values
                and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
            ):
                self.values[id(tensor)] = (tensor, tensor.detach().clone())
        self.entered.append(buffers)

    def leave(self, module: nn.Module) -> None:
        before, after = self.entered.pop(), module._buffers
        for name in [*before, *(name for name in after if name not in before)]:
            old, new = before.get(name, _ABSENT), after.get(name, _ABSENT)
            if old is not new:
                self.replaced.append((module, name, old, new))

    def undo(self) -> None:
        """Puts the values back, then the replaced buffers (where the replacement is still there)."""
        for tensor, values in self.values.values():
            if not torch.equal(tensor, values):  # left alone otherwise, its version counter too
                with torch.no_grad():
                    tensor.copy_(values)
        for module, name, old, new in reversed(self.replaced):
            if module._buffers.get(name, _ABSENT) is not new:
                continue
            if old is _ABSENT:
                del module._buffers[name]
            else:
                module._buffers[name] = old


class ModuleStack:
    """The innermost module running on the calling thread, from global forward hooks.

    It also logs what the run does to the running modules' buffers, for `restore_buffers`.
    """

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.running: list[nn.Module] = []
        self.roots: list[nn.Module] = []
        self.buffers = _BufferLog()

    def _enter(self, module: nn.Module, *_: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if not self.running and all(root is not module for root in self.roots):
            self.roots.append(module)
        self.buffers.enter(module)
        self.running.append(module)

    def _leave(self, module: nn.Module, *_: Any) -> None:
        if threading.get_ident() == self.thread and self.running and self.running[-1] is module:
            self.running.pop()
            self.buffers.leave(module)

    def restore_buffers(self) -> None:
        """Undoes what the run did to the buffers of the modules that ran: values and replacements."""
        self.buffers.undo()

    def current(self) -> nn.Module | None:
        """The innermost module running, None outside any."""
        return self.running[-1] if self.running else None

    def name_of(self, module: nn.Module) -> str:
        """Its qualified name in the largest module it ran under ("" for that module itself)."""
        for root in sorted(self.roots, key=lambda r: -sum(1 for _ in r.modules())):
            for name, candidate in root.named_modules():
                if candidate is module:
                    return str(name)
        return ""

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """Registers the global forward hooks for the body, and removes them after."""
        pre = nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = nn.modules.module.register_module_forward_hook(self._leave, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


class _Label(NamedTuple):
    op: str
    module: nn.Module | None
    forward_made: str  # the non-finite kinds among the call's outputs (`kinds`), "" if all finite


def _intends_nonfinite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # A factory given no tensor (torch.full(..., -inf)) or a call given an inf or NaN number
    # (masked_fill(mask, -inf)) makes a mask, not an overflow.
    leaves = pytree.tree_leaves((args, kwargs))
    numbers = [x for x in leaves if isinstance(x, float)]
    return not any(isinstance(x, torch.Tensor) for x in leaves) or any(not math.isfinite(x) for x in numbers)


class ForwardWatch(TorchFunctionMode):
    """Checks every call's floating inputs (before it runs) and outputs; labels their gradient functions."""

    def __init__(self, modules: ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.found: Found | None = None
        self.labels: dict[Any, _Label] = {}
        # id -> (the tensor, weakly, so a reused id is told apart; the module it was made in).
        self.made_without_grad: dict[int, tuple[weakref.ref[torch.Tensor], nn.Module | None]] = {}

    def note_function_outputs(self, tensors: list[torch.Tensor], module: nn.Module | None) -> None:
        """Labels the gradient functions of custom autograd.Function outputs among `tensors`.

        No mode sees a Function's `apply`, so its node is named by the Function, placed in the
        module its forward's ops ran in (else `module`, the reader's), and given what all of its
        outputs that anything read held.
        """
        for x in tensors:
            node = x.grad_fn
            if not isinstance(node, torch.autograd.function.BackwardCFunction):
                continue
            made, noted = kinds([x]), self.labels.get(node)
            if noted is None:
                function = node._forward_cls
                made_in = self.made_without_grad.get(id(x))
                where = made_in[1] if made_in is not None and made_in[0]() is x else module
                self.labels[node] = _Label(f"{function.__name__}.apply", where, made)
            else:  # another of its outputs
                both = " and ".join(k for k in ("inf", "NaN") if k in noted.forward_made or k in made)
                self.labels[node] = noted._replace(forward_made=both)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        inputs = floating((args, kwargs))
        # Read before the call, which may update its inputs in place.
        held = kinds(inputs)
        largest = _largest_magnitude(inputs) if self.found is None else math.nan
        out = func(*args, **kwargs)
        written = args[0] if _op_name(func) == "__setitem__" and args else None
        # Indexed assignment returns None: what it made is in the tensor it wrote.
        outputs = floating(out if written is None else written)
        if not outputs:
            return out
        made = kinds(outputs)
        module = self.modules.current()
        label = _Label(_op_name(func), module, made)
        self.note_function_outputs(inputs, module)
        if not torch.is_grad_enabled():  # inside a custom Function's forward, whose apply hands these out
            for x in outputs:
                self.made_without_grad[id(x)] = (weakref.ref(x), module)
        for x in outputs:
            if x.grad_fn is not None:
                self.labels.setdefault(x.grad_fn, label)
        if self.found is None and _new_kinds(held, made) and not _intends_nonfinite(args, kwargs):
            self.found = _found(label.op, "", label.module, inputs, outputs, held, largest)
        return out


class BackwardWatch:
    """Hooks every gradient function under a loss; `found` holds the first to make inf or NaN.

    A gradient function counts where it makes a kind of non-finite value that neither its incoming
    gradients nor its forward call's outputs held: exp's backward meeting the inf exp made passes it
    on, but log's turning a masked log(0)'s -inf and a zero gradient into NaN (the gradient of
    `torch.where(x > 0, x.log(), 0)`) makes it, and so does a norm's backward dividing the inf it
    was given by itself (the forward's origin is named too). A node inside a composite call (no
    call returned its output) takes the label of the call it feeds; a custom autograd.Function's
    is named by the Function (`ForwardWatch.note_function_outputs`).

    Args:
        root: The loss's gradient function.
        labels: Each gradient function's forward call, from `ForwardWatch`.
    """

    def __init__(self, root: Any, labels: dict[Any, _Label]) -> None:
        self.found: Found | None = None
        self.handles: list[Any] = []
        seen: set[Any] = set()
        stack = [(root, labels.get(root, _Label("", None, "")))]
        while stack:
            node, inherited = stack.pop()
            if node is None or node in seen or hasattr(node, "variable"):  # AccumulateGrad: a leaf
                continue
            seen.add(node)
            label = labels.get(node, inherited)
            self.handles.append(node.register_hook(self._hook(node, label)))
            stack.extend((next_node, label) for next_node, _ in node.next_functions)

    def _hook(self, node: Any, label: _Label) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if self.found is not None:
                return
            incoming, made = floating(grad_outputs), floating(grad_inputs)
            held = kinds(incoming)
            if made and _new_kinds(f"{held} {label.forward_made}", kinds(made)):
                largest = _largest_magnitude(incoming)
                self.found = _found(label.op, node.name(), label.module, incoming, made, held, largest)

        return hook

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self.handles:
            handle.remove()
