"""Activation checkpointing (rematerialization) that works under torch.func and plain autograd.

`torch.utils.checkpoint` fails under `torch.func.grad` and `vjp` in both of its forms (the
non-reentrant one uses saved-tensor hooks, which torch.func refuses; the reentrant one is an
`autograd.Function` without `setup_context`). `remat(fn)` is an `autograd.Function` written for
torch.func: its forward runs `fn` as the recompute will and keeps only `fn`'s inputs and outputs,
and its backward runs `fn` again (under `torch.func.vjp`, or plain autograd outside torch.func)
to get the gradients. So a wrapped block holds none of its activations between the forward and
the backward pass, at the price of running its forward twice. `fmp.remat._call` runs one call,
`fmp.remat._watch` checks what it reads and writes, `fmp.remat._replay` keeps what its recompute replays.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import ParamSpec
from typing import TypeVar
from typing import cast

import torch
import torch.utils._pytree as pytree
from torch.autograd import forward_ad

from fmp._ambient import AMBIENT
from fmp._tree import functorch_base
from fmp._tree import is_inexact_tensor
from fmp.autocast._module_policy import ReadingForward
from fmp.remat._call import Call
from fmp.remat._replay import Ambient
from fmp.remat._watch import jvp_levels

__all__ = ["calling_plainly", "remat"]

P = ParamSpec("P")
R = TypeVar("R")


class _Recompute(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return call.forward(inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        call, *tensors = inputs
        ctx.call = call
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.mark_non_differentiable(*(o for o in output if not is_inexact_tensor(o)))
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx: Any, _: None, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return ctx.call.pushforward(ctx.saved_tensors, tangents)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.call.pullback(ctx.saved_tensors, cotangents))


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def remat(fn: Callable[P, R], *, preserve_rng_state: bool = True) -> Callable[P, R]:
    """Returns `fn` rematerialized: its activations are recomputed in the backward pass, not stored.

    Wrap a block of a model (a transformer layer, a residual stage) so that differentiating a loss
    keeps only the block's inputs between the forward and the backward pass; the backward runs
    the block again to get its gradients. Works eagerly in fmp's step, under `torch.func.vjp`,
    `vmap` and `jvp`, and with plain autograd (`loss.backward()`), where `torch.utils.checkpoint`
    fails under torch.func. The gradients equal those of `fn` itself bit for bit (in fmp's step,
    a `vmap` over it, and `loss.backward()`): the recompute runs under the fmp autocast region,
    `fmp.autocast.module_policies` forwards, torch.autocast state and random number generator states the
    first run saw, and both runs are set up alike (grad mode, inputs requiring grad, a torch.func
    level where the caller has one), so modules pick the same kernels and random ops place their
    numbers alike (dropout on a transposed tensor). Where a `vmap` runs inside the
    differentiation with weights shared across the batch (`grad(vmap(f))`), torch's batching
    rule for an autograd.Function sums per-sample weight gradients, which rounds differently
    (~1e-7 in float32). `torch.autograd.forward_ad` dual tensors are refused: use
    `torch.func.jvp`.

    The saving needs a backward pass that frees what it has used, as fmp's step and
    `loss.backward()` run it. A bare `torch.func.grad` keeps its whole graph to the end
    (`create_graph=True`), recomputes included, so there remat saves nothing.

    Under `torch.compile`, the wrapper calls `fn` as it is: Dynamo would inline the forward and
    drop the recompute, and in a compiled fmp step forward and backward are one graph whose
    memory Inductor plans itself. So the memory saving is an eager one. Under `torch.no_grad()`
    (evaluation), and under `torch.func.jvp` with nothing differentiating in reverse mode, it
    calls `fn` as it is too, at no cost.

    `fn` must be a pure function of its arguments. A tensor it differentiates but does not take
    as an argument (a captured parameter, or a module's weight read beside the one passed in)
    would get no gradient, so reading one raises; wrap an `nn.Module` itself and its current
    parameters and buffers are passed in for you (including the ones
    `torch.func.functional_call` swapped in), as are the scales its `fmp.fp8.fp8_modules` layers
    on a delayed recipe read. Where `torch.func.jvp` and reverse mode meet
    (`jvp(grad(f))`, a Hessian-vector product), only arguments carry tangents into the block, so
    reading any captured tensor of the jvp raises too. Updating a differentiated argument in
    place raises, and so does updating a captured tensor (the recompute would update it again).
    Any other argument the forward updates in place is updated once, by the forward: its value
    from before the first update is kept, and the recompute updates a copy of that. So running
    statistics move once per step, where `torch.utils.checkpoint` moves them twice, whether the
    block is a wrapped module with BatchNorm layers or a function passing buffers (or views of
    one) to `F.batch_norm` (whose updates, unseen by version counters, are caught at the call),
    and a block that reads statistics it also updates recomputes from the values it first read.

    Args:
        fn: The function or `nn.Module` to wrap. Its arguments are pytrees; their floating-point
            and complex tensors that autograd or a torch.func transform tracks are differentiated,
            every other leaf is passed through as a constant. It returns a pytree of tensors.
        preserve_rng_state: Whether the recompute replays the CPU generator's state, that of each
            accelerator the inputs live on and that of every `torch.Generator` among the arguments,
            so random ops (dropout) draw the same values as the first run; the generators' states
            are read on the host, with no sync. (A generator the block captures, rather than takes
            as an argument, is not seen: pass it in.)

    Returns:
        A function taking `fn`'s arguments (a module's: its forward's), named after it.

    Raises:
        TypeError: If `fn` is not callable or `preserve_rng_state` is not a bool; from the returned
            function, if `fn` returns a leaf that is not a tensor.
        RuntimeError: From the returned function, if `fn` reads a differentiated tensor that is
            not one of its arguments, updates one in place, or updates a captured tensor (running
            statistics included), or if a tensor argument is updated in place between the forward
            and the backward pass.
    """
    if not callable(fn):
        raise TypeError(f"fmp.remat wraps a function or an nn.Module, got {type(fn).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
    if isinstance(fn, torch.nn.Module):
        return _remat_module(fn, preserve_rng_state)

    @functools.wraps(fn)
    def rematerialized(*args: P.args, **kwargs: P.kwargs) -> R:
        if _runs_plain() or _forward_mode_only((args, kwargs)):
            return fn(*args, **kwargs)
        call = Call(fn, _name(fn), args, kwargs, _ambient((args, kwargs), preserve_rng_state, ()))
        return _apply(call, call.inputs(args, kwargs))  # type: ignore[no-any-return]

    return rematerialized


@contextlib.contextmanager
def calling_plainly() -> Iterator[None]:
    """Rematerialized blocks call their function as it is inside this context (on this thread).

    For `fmp.debug.locate_nonfinite`, which watches every op of the forward and backward passes.
    """
    previous = AMBIENT.remat_plainly
    AMBIENT.remat_plainly = True
    try:
        yield
    finally:
        AMBIENT.remat_plainly = previous


def _runs_plain() -> bool:
    # Compiled, Dynamo would inline the forward and drop the recompute. Under no_grad nothing is
    # saved for a backward pass (forward-mode tangents still flow through the plain call).
    return torch.compiler.is_compiling() or not torch.is_grad_enabled() or AMBIENT.remat_plainly


def _forward_mode_only(arguments: Any) -> bool:
    # Under torch.func.jvp with no reverse-mode differentiation, nothing is saved for a backward
    # pass; the plain call also carries the tangents of tensors `fn` captures.
    if not jvp_levels():
        return False
    stack = torch._C._functorch.get_interpreter_stack() or []
    if any(i.key() == torch._C._functorch.TransformType.Grad for i in stack):
        return False
    tensors = [x for x in pytree.tree_leaves(arguments) if isinstance(x, torch.Tensor)]
    return not any(functorch_base(x).requires_grad for x in tensors)


def _remat_module(module: torch.nn.Module, preserve_rng_state: bool) -> Callable[..., Any]:
    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        if _runs_plain():
            return module(*args, **kwargs)
        # Read per call: under functional_call these are the tensors it swapped in.
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        # The tensors patched forwards read (FP8 scales) go in as arguments, as the parameters do.
        reads = {
            name: forward.tensors()
            for name, sub in module.named_modules()
            if isinstance(forward := sub.__dict__.get("forward"), ReadingForward)
        }
        arguments = (state, reads, args, kwargs)
        if _forward_mode_only(arguments):
            return module(*args, **kwargs)
        first_run = [True]

        def run_module(
            state: dict[str, torch.Tensor],
            reads: dict[str, tuple[torch.Tensor, ...]],
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
        ) -> Any:
            # The first run's layer runs count as the call's; the recompute's stand apart.
            counted, first_run[0] = first_run[0], False
            with _reading(module, reads, counted):
                return torch.func.functional_call(module, state, args, kwargs)

        ambient = _ambient(arguments, preserve_rng_state, tuple(module.modules()))
        call = Call(run_module, type(module).__name__, arguments, {}, ambient)
        return _apply(call, call.inputs(arguments, {}))

    # The forward's name, docstring and signature (inspect.signature follows __wrapped__).
    return functools.update_wrapper(rematerialized, module.forward, updated=())


@contextlib.contextmanager
def _reading(module: torch.nn.Module, reads: dict[str, tuple[torch.Tensor, ...]], counted: bool) -> Iterator[None]:
    """Runs the body with the reading forwards of `module`'s submodules reading `reads`, put back after."""
    submodules = dict(module.named_modules())
    with contextlib.ExitStack() as stack:
        for name, tensors in reads.items():
            attrs = submodules[name].__dict__
            forward = attrs["forward"]
            stack.callback(attrs.__setitem__, "forward", forward)
            attrs["forward"] = forward.reading(tensors, counted=counted)
        yield


def _ambient(arguments: Any, rng: bool, modules: tuple[torch.nn.Module, ...]) -> Ambient:
    leaves = pytree.tree_leaves(arguments)
    devices = [x.device for x in leaves if isinstance(x, torch.Tensor)]
    return Ambient(devices, rng, modules, [x for x in leaves if isinstance(x, torch.Generator)])


def _apply(call: Call, inputs: list[torch.Tensor]) -> Any:
    if forward_ad._current_level >= 0 and any(
        not torch._C._functorch.is_functorch_wrapped_tensor(x) and forward_ad.unpack_dual(x).tangent is not None  # type: ignore[no-untyped-call]
        for x in inputs
    ):
        # Its jvp would nest forward-mode AD inside the caller's dual level, which torch refuses.
        raise RuntimeError(
            f"fmp.remat: {call.name} got a dual tensor of torch.autograd.forward_ad, which remat does not "
            f"support; take forward-mode derivatives with torch.func.jvp"
        )
    # The call keeps no reference to its inputs: autograd saves them, and frees them with the node.
    outputs = _Recompute.apply(call, *inputs)  # type: ignore[no-untyped-call]
    # The forward that just ran recorded the output structure.
    return pytree.tree_unflatten(list(outputs), cast(pytree.TreeSpec, call.out_spec))
