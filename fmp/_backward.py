"""Gradients of a loss: plain autograd where nothing around the call transforms it, else torch.func.

`torch.func.grad` always backpropagates with `create_graph=True`, so that a transform around it
can differentiate the backward pass too. That keeps every activation the forward pass saved, and
every intermediate of the backward pass, alive until the last gradient is out: on a residual MLP,
2x the peak memory of `loss.backward()` (benchmarks/RESULTS.md), and an `fmp.remat` block's
recompute stays alive as well, which undoes its saving. It also wraps every tensor the loss
function touches, and refuses an `autograd.Function` written in the ctx-first style of torch's AMP
docs (no `setup_context`), which most third-party kernels use.

So eager, with no `torch.func` transform around the call, `grad_and_aux` runs the loss function on
detached copies of the params that require grad and calls `torch.autograd.grad`, as
`loss.backward()` would. Compiled, or inside `vmap`/`grad`/`jvp`, it takes `torch.func.grad`
(Dynamo traces it whole, ctx-style Functions included; a transform needs it); inside a transform
a ctx-style Function fails in torch with its own message, which `grad_and_aux` completes with
the way out.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import cast

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

import fmp._pytree as pytree
from fmp._donation import storage_use_count
from fmp._tree import functorch_base

__all__ = ["Differentiated", "check_reads_no_module_parameters", "grad_and_aux", "tracked_leaves", "warn_while_tracing"]

_SETUP_CONTEXT_ERROR = "must override the setup_context staticmethod"


def _inside_transform() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap, functionalize) is running around the call."""
    return bool(retrieve_all_functorch_interpreters())


def tracked_leaves(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors that require grad which autograd's graphs of `roots` accumulate into (or that they are)."""
    found = [x for x in roots if x.grad_fn is None and x.requires_grad]
    stack = [x.grad_fn for x in roots if x.grad_fn is not None]
    seen = set(stack)
    # Bound once: the loop visits every node of the graph, a few hundred for a small model.
    pop, push, add = stack.pop, stack.append, seen.add
    accumulate = cast(Any, torch._C._functions).AccumulateGrad  # the node class of a leaf that requires grad
    while stack:
        node = pop()
        if type(node) is accumulate:  # a leaf's node, which has no further nodes
            found.append(cast(Any, node).variable)
            continue
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                add(next_node)
                push(next_node)
    return found


def _raise_for_module_parameters(read: Sequence[torch.Tensor]) -> None:
    shapes = sorted({str(list(p.shape)) for p in read})
    raise ValueError(
        f"loss_fn's loss reads {len(read)} nn.Parameter(s) (shapes {', '.join(shapes)}) outside params: "
        f"they get no update. Call the model as torch.func.functional_call(model, params, (x,)), "
        f"not model(x), and call requires_grad_(False) on frozen weights left out of params"
    )


def _module_parameters(tensors: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [x for x in tracked_leaves(tensors) if isinstance(x, torch.nn.Parameter)]


def _warn(message: str) -> bool:
    warnings.warn(message, UserWarning, stacklevel=3)
    return True


# Dynamo calls a function of constant result once, while it traces: the warning comes when the step
# compiles, where `warnings.warn` itself cannot be traced.
warn_while_tracing: Callable[[str], bool] = torch.compiler.assume_constant_result(_warn)  # type: ignore[no-untyped-call]

_READS_OUTSIDE_PARAMS = (
    "loss_fn's loss reaches tensors outside params that require grad, which the compiled step does not "
    "update: a module called as model(x) instead of torch.func.functional_call(model, params, (x,)), or "
    "frozen weights that still require grad (call requires_grad_(False) on them). A meta-gradient (a learned "
    "tensor the loss captures on purpose, or a torch.func transform compiled around the step that "
    "differentiates through it) is computed as eager: then filter this warning. Eager, the step names the "
    "nn.Parameters it reads"
)


def check_reads_no_module_parameters(loss: Any, args: Any) -> None:
    """Raises if the loss reads a module's own `nn.Parameter`s, which get no gradient from the step.

    Only a loss that autograd tracks is searched, so the usual step pays nothing, and what the
    caller passed in `args` passes, `nn.Parameter`s included: a meta-gradient with plain autograd
    through an input that requires grad (a learned hyperparameter, or a tensor computed from one).
    Compiled, autograd's graph cannot be read while the step is traced, but whether the loss
    requires grad outside the differentiation can: where it does and no argument does, the step
    warns once, as it compiles. It cannot tell a module's parameters from a learned tensor the
    loss captures on purpose, nor from a `torch.func` transform compiled around the step that
    differentiates through it (a meta-gradient through the step); the warning says so.

    Args:
        loss: The loss (a tensor or a pytree of them).
        args: The further arguments `loss_fn` was given.

    Raises:
        ValueError: Naming how many parameters were read and their shapes.
    """
    if torch.compiler.is_compiling():
        if _requires_grad(loss) and not _requires_grad(args):
            warn_while_tracing(_READS_OUTSIDE_PARAMS)
        return
    tracked = [functorch_base(x) for x in pytree.tree_leaves(loss) if isinstance(x, torch.Tensor)]
    tracked = [x for x in tracked if x.requires_grad]
    if not tracked:
        return
    inputs = [functorch_base(x) for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    passed = {id(p) for p in _module_parameters([x for x in inputs if x.requires_grad])}
    for base in tracked:
        read = [p for p in _module_parameters([base]) if id(p) not in passed]
        if read:
            _raise_for_module_parameters(read)


class Differentiated(NamedTuple):
    """What `grad_and_aux` returns."""

    grads: Any
    aux: Any
    owned: frozenset[int]
    """The ids of the gradient tensors that nothing but `grads` holds, which the caller may overwrite."""


def _sole_references(tensors: list[torch.Tensor]) -> frozenset[int]:
    """The ids of the tensors that only `tensors` holds, once each, none sharing its storage with another tensor.

    Counted against a probe held the same way, so the count does not depend on how the interpreter
    counts its own references. A tensor listed twice, kept by the loss function (returned in aux,
    saved by a custom backward that returned it), or a view of, or viewed by, another is not owned.
    """
    tensors.append(torch.empty(1))  # the probe, held by the list alone
    counts = [sys.getrefcount(x) for x in tensors]
    # Only plain strided tensors have a storage to count (a sparse gradient has none).
    storages = [storage_use_count(x) if type(x) is torch.Tensor and x.layout == torch.strided else -1 for x in tensors]
    tensors.pop()
    count, storage = counts.pop(), storages.pop()
    return frozenset(id(x) for x, c, s in zip(tensors, counts, storages, strict=True) if c == count and s == storage)


def _with_autograd(fn: Callable[..., tuple[torch.Tensor, Any]], params: Any, *args: Any) -> Differentiated:
    leaves, spec = pytree.tree_flatten(params)
    inputs = [leaf.detach().requires_grad_() for leaf in leaves]
    with torch.enable_grad():
        loss, aux = fn(pytree.tree_unflatten(inputs, spec), *args)
    if not loss.requires_grad:
        grads = [torch.zeros_like(x) for x in inputs]
        return Differentiated(pytree.tree_unflatten(grads, spec), aux, frozenset())
    # A loss that also reaches tensors outside params that require grad (a captured learned
    # hyperparameter: a meta-gradient) needs the backward recorded, as torch.func.grad does.
    own = {id(x) for x in inputs}
    foreign = [leaf for leaf in tracked_leaves([loss]) if id(leaf) not in own]
    read = [leaf for leaf in foreign if isinstance(leaf, torch.nn.Parameter)]
    if read:
        _raise_for_module_parameters(read)
    record = bool(foreign)
    # One name for both lists: the tuple autograd returns would otherwise hold each gradient once
    # more, and none would count as owned.
    grads = list(torch.autograd.grad(loss, inputs, allow_unused=True, create_graph=record))
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]
    if record:
        return Differentiated(pytree.tree_unflatten(grads, spec), aux, frozenset())
    # As torch.func.grad's aux: values, not a handle on this step's graph (which only a tensor
    # that requires grad holds).
    aux_leaves, aux_spec = pytree.tree_flatten(aux)
    aux_leaves = [x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in aux_leaves]
    aux = pytree.tree_unflatten(aux_leaves, aux_spec)
    del loss, inputs  # the graph and its saved tensors go before ownership is counted
    owned = _sole_references(grads)
    return Differentiated(pytree.tree_unflatten(grads, spec), aux, owned)


def _requires_grad(tree: Any) -> bool:
    """Whether a tensor of `tree` requires grad (of the arguments: a meta-gradient, which torch.func.grad records)."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(tree))


def _viewing_params(fn: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """`fn` called with a view of each param, so that Dynamo calls the backward of the Functions it reaches.

    Dynamo (torch 2.13) inlines an `autograd.Function`'s forward, and differentiates that instead of
    calling the Function's backward, when none of its tensor arguments requires grad as Dynamo sees
    them; `torch.func.grad`'s own inputs do not, the results of ops on them (a view: no copy) do.
    So a straight-through estimator or an FP8 matmul applied to a param as it is would otherwise
    train on the wrong gradients, compiled only.
    """

    def with_views(params: Any, *args: Any) -> tuple[torch.Tensor, Any]:
        views = pytree.tree_map(lambda p: p.view_as(p) if isinstance(p, torch.Tensor) else p, params)
        return fn(views, *args)

    return with_views


def grad_and_aux(fn: Callable[..., tuple[torch.Tensor, Any]], params: Any, *args: Any) -> Differentiated:
    """`torch.func.grad(fn, argnums=0, has_aux=True)(params, *args)`, by plain autograd where it can.

    Args:
        fn: `fn(params, *args) -> (scalar loss, aux)`.
        params: What to differentiate with respect to.
        *args: Further inputs, which enter a transform as inputs (so `fn` may update them in
            place) but are not differentiated.

    Returns:
        A `Differentiated`: the gradients in the structure of `params`, `fn`'s aux, and which
        gradients the caller alone holds (by plain autograd; none under torch.func).

    Raises:
        RuntimeError: Inside a torch.func transform, if the loss reaches an `autograd.Function`
            without `setup_context`, naming what to do.
    """
    if not (torch.compiler.is_compiling() or _inside_transform() or _requires_grad(args)):
        return _with_autograd(fn, params, *args)
    try:
        differentiated = _viewing_params(fn) if torch.compiler.is_compiling() else fn
        grads, aux = torch.func.grad(differentiated, argnums=0, has_aux=True)(params, *args)
        return Differentiated(grads, aux, frozenset())
    except RuntimeError as error:
        if _SETUP_CONTEXT_ERROR not in str(error):
            raise
        raise RuntimeError(
            f"{error}\n(fmp: the loss reaches an autograd.Function written with ctx as forward's first argument, "
            f"which torch.func transforms cannot differentiate. fmp's step runs such a Function eager and "
            f"compiled, but not inside vmap, grad or jvp: give it a setup_context staticmethod (torch's "
            f"'Extending torch.func with autograd.Function' page) to map an ensemble over it.)"
        ) from error
