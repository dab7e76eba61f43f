"""Activation checkpointing (rematerialization) that works under `torch.func.grad` and `vmap`.

`torch.utils.checkpoint` fails under `torch.func.grad` and `vjp` in both of its forms (the
non-reentrant one uses saved-tensor hooks, which torch.func refuses; the reentrant one is an
`autograd.Function` without `setup_context`). `remat(fn)` is an `autograd.Function` written for
torch.func: its forward runs `fn` without recording anything, keeping only `fn`'s inputs, and its
backward runs `fn` again under `torch.func.vjp` to get the gradients. So a wrapped block holds
none of its activations between the forward and the backward pass, at the price of running its
forward twice.

The recompute replays what the first run saw: the innermost fmp autocast region (a backward runs
after the region is left, see `fmp.autocast_regions`), torch.autocast's state on the inputs'
devices, and, unless told otherwise, the random number generators' states, so dropout draws the
same mask twice and the gradients equal the unwrapped function's bit for bit.
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
from torch.overrides import TorchFunctionMode

from fmp.autocast import AutocastMode
from fmp.autocast import _active_modes

__all__ = ["remat"]

P = ParamSpec("P")
R = TypeVar("R")


def _alive(tensors: tuple[Any, ...]) -> tuple[Any, ...]:
    # A block nested in a rematerialized block is pulled back after the outer recompute's
    # torch.func level has exited; its saved tensors still wear that dead level's wrapper.
    return tuple(torch._C._functorch.unwrap_if_dead(x) if isinstance(x, torch.Tensor) else x for x in tensors)


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


class _Replay:
    """One call of a wrapped function: what it closes over, and the state its recompute replays.

    Attributes are set when the call runs forward; `outputs` and `pullback` are what the
    autograd.Function calls, with the differentiable inputs as separate tensors.
    """

    def __init__(self, fn: Callable[..., Any], name: str, leaves: list[Any], spec: pytree.TreeSpec, rng: bool) -> None:
        self.fn = fn
        self.name = name
        self.spec = spec
        # Non-differentiable leaves (ints, integer tensors, None) are closed over, not inputs.
        self.slots = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
        self.constants = [None if i in self.slots else leaf for i, leaf in enumerate(leaves)]
        self.region: AutocastMode | None = _active_modes()[-1] if _active_modes() else None
        devices = {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}
        self.autocast_states = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in sorted({d.type for d in devices} | {"cpu"})
            if kind in ("cpu", "cuda", "xpu", "mps", "hpu")
        ]
        self.rng_devices = sorted((d for d in devices if d.type != "cpu"), key=str) if rng else []
        self.rng_states = self._rng_snapshot() if rng else []
        self.out_spec: pytree.TreeSpec | None = None
        self.differentiable_outputs: list[bool] = []

    def _call(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.constants)
        for slot, tensor in zip(self.slots, inputs, strict=True):
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        if self.region is None:
            return self.fn(*args, **kwargs)
        return self.region.run(self.fn, *args, **kwargs)

    def outputs(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Runs the call forward and records its outputs' structure."""
        out_leaves, self.out_spec = pytree.tree_flatten(self._call(inputs))
        for path, leaf in pytree.tree_flatten_with_path(pytree.tree_unflatten(out_leaves, self.out_spec))[0]:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"fmp.remat: {self.name} returned a {type(leaf).__name__} at output{pytree.keystr(path)}; "
                    f"a rematerialized function returns tensors only (compute constants outside it)"
                )
        self.differentiable_outputs = [_differentiable(leaf) for leaf in out_leaves]
        return tuple(out_leaves)

    def _differentiable_outputs(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = pytree.tree_leaves(self._call(inputs))
        return tuple(o for o, keep in zip(outs, self.differentiable_outputs, strict=True) if keep)

    def pullback(
        self, inputs: tuple[torch.Tensor, ...], cotangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Recomputes the call under the state it first ran in, and pulls `cotangents` back to the inputs."""
        inputs, cotangents = _alive(inputs), _alive(cotangents)
        with self._replayed_state():
            outs, vjp_fn = torch.func.vjp(self._differentiable_outputs, *inputs)[:2]
        kept = [c for c, keep in zip(cotangents, self.differentiable_outputs, strict=True) if keep]
        # An output the loss does not use may come back as None; its cotangent is zero.
        kept = [torch.zeros_like(o) if c is None else c for c, o in zip(kept, outs, strict=True)]
        # The recompute's own activations are freed as its backward uses them, unless an outer
        # transform differentiates this backward (the outer backward then runs with grad enabled).
        record = torch.is_grad_enabled()
        return tuple(vjp_fn(tuple(kept), retain_graph=record, create_graph=record))

    def pushforward(
        self, inputs: tuple[torch.Tensor, ...], tangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Recomputes the call under the state it first ran in, pushing `tangents` forward to the outputs."""
        inputs, tangents = _alive(inputs), _alive(tangents)
        # An input without a tangent (None) moves by zero.
        tangents = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(inputs, tangents, strict=True))
        with self._replayed_state():
            out_tangents = torch.func.jvp(self._differentiable_outputs, inputs, tangents)[1]
        kept = iter(out_tangents)
        return tuple(next(kept) if keep else None for keep in self.differentiable_outputs)

    def _rng_snapshot(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()] + [torch.get_device_module(d.type).get_rng_state(d) for d in self.rng_devices]

    def _set_rng(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        for device, state in zip(self.rng_devices, states[1:], strict=True):
            torch.get_device_module(device.type).set_rng_state(state, device)

    @contextlib.contextmanager
    def _replayed_state(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.autocast_states:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            if self.rng_states:
                # The generators go back to where they were, so the recompute draws nothing from them.
                stack.callback(self._set_rng, self._rng_snapshot())
                self._set_rng(self.rng_states)
            yield


def _is_differentiated(x: torch.Tensor) -> bool:
    """Whether autograd or a torch.func grad transform tracks `x` (at any of its wrappers' levels)."""
    if not (x.is_floating_point() or x.is_complex()):
        return False
    while True:
        if x.requires_grad:
            return True
        if not torch._C._functorch.is_functorch_wrapped_tensor(x):
            return False
        x = torch._C._functorch.get_unwrapped(x)


class _NoCapturedGradients(TorchFunctionMode):
    """Refuses a differentiated tensor the wrapped function reads without taking it as an argument.

    The forward runs unrecorded, so such a tensor would silently get no gradient from the block.
    """

    def __init__(self, name: str, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.name = name
        self.input_ids = {id(x) for x in inputs}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self.input_ids and _is_differentiated(leaf):
                # Not a TypeError: Tensor's operators turn a TypeError into NotImplemented.
                raise RuntimeError(
                    f"fmp.remat: {self.name} reads a tensor of shape {tuple(leaf.shape)} that is being "
                    f"differentiated but is not one of its arguments (a captured parameter or activation); "
                    f"its gradient would be lost. Pass it as an argument, or wrap the nn.Module itself "
                    f"(fmp.remat(layer)), which passes the module's parameters for you"
                )
        return func(*args, **kwargs)


class _Recompute(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(replay: _Replay, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad(), _NoCapturedGradients(replay.name, inputs):
            outputs = replay.outputs(inputs)
        # autograd.Function refuses to save an input it also returns as it is; a view of it is fine.
        input_ids = {id(x) for x in inputs}
        return tuple(o.view_as(o) if id(o) in input_ids else o for o in outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        replay, *tensors = inputs
        ctx.replay = replay
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.mark_non_differentiable(*(o for o in output if not _differentiable(o)))
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx: Any, _: None, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return ctx.replay.pushforward(ctx.saved_tensors, tangents)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.replay.pullback(ctx.saved_tensors, cotangents))


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def remat(fn: Callable[P, R], *, preserve_rng_state: bool = True) -> Callable[P, R]:
    """Returns `fn` rematerialized: its activations are recomputed in the backward pass, not stored.

    Wrap a block of a model (a transformer layer, a residual stage) so that differentiating a loss
    keeps only the block's inputs between the forward and the backward pass; the backward runs
    the block again to get its gradients. Works eagerly under `torch.func.grad`, `vjp`, `vmap`
    (and so in fmp's step) and with plain autograd (`loss.backward()`), where
    `torch.utils.checkpoint` fails under torch.func. The gradients equal those of `fn` itself bit
    for bit: the recompute runs under the fmp autocast region, torch.autocast state and random
    number generator states the first run saw.

    Under `torch.compile`, the wrapper calls `fn` as it is: Dynamo would inline the forward and
    drop the recompute, and in a compiled fmp step forward and backward are one graph whose
    memory Inductor plans itself. So the memory saving is an eager one. Under `torch.no_grad()`
    (evaluation) it calls `fn` as it is too, at no cost.

    `fn` must be a pure function of its arguments. A tensor it differentiates but does not take
    as an argument (a captured parameter) would get no gradient, so reading one raises; wrap an
    `nn.Module` itself and its current parameters and buffers are passed in for you (including
    the ones `torch.func.functional_call` swapped in). An input updated in place would be seen
    updated by the recompute: a BatchNorm in training mode updates its running statistics twice,
    as under `torch.utils.checkpoint`.

    Args:
        fn: The function or `nn.Module` to wrap. Its arguments are pytrees; their floating-point
            and complex tensors are differentiated, every other leaf is passed through as a
            constant. It returns a pytree of tensors.
        preserve_rng_state: Whether the recompute replays the CPU generator's state and that of
            each accelerator the inputs live on, so random ops (dropout) draw the same values as
            the first run; the generators' states are read on the host, with no sync.

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError: If `fn` is not callable or `preserve_rng_state` is not a bool; from the returned
            function, if `fn` returns a leaf that is not a tensor.
        RuntimeError: From the returned function, if `fn` reads a differentiated tensor that is
            not one of its arguments.
    """
    if not callable(fn):
        raise TypeError(f"fmp.remat wraps a function or an nn.Module, got {type(fn).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
    if isinstance(fn, torch.nn.Module):
        return _remat_module(fn, preserve_rng_state)

    @functools.wraps(fn)
    def rematerialized(*args: P.args, **kwargs: P.kwargs) -> R:
        if _runs_plain():
            return fn(*args, **kwargs)
        return _apply(fn, _name(fn), args, kwargs, preserve_rng_state)  # type: ignore[no-any-return]

    return rematerialized


def _runs_plain() -> bool:
    # Compiled, Dynamo would inline the forward and drop the recompute. Under no_grad nothing is
    # saved for a backward pass (forward-mode tangents still flow through the plain call).
    return torch.compiler.is_compiling() or not torch.is_grad_enabled()


def _remat_module(module: torch.nn.Module, preserve_rng_state: bool) -> Callable[..., Any]:
    def run_module(state: dict[str, torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return torch.func.functional_call(module, state, args, kwargs)

    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        if _runs_plain():
            return module(*args, **kwargs)
        # Read per call: under functional_call these are the tensors it swapped in.
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        return _apply(run_module, type(module).__name__, (state, args, kwargs), {}, preserve_rng_state)

    return rematerialized


def _apply(fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], rng: bool) -> Any:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    replay = _Replay(fn, name, leaves, spec, rng)
    inputs = [leaves[slot] for slot in replay.slots]
    outputs = _Recompute.apply(replay, *inputs)  # type: ignore[no-untyped-call]
    # The forward that just ran recorded the output structure.
    return pytree.tree_unflatten(list(outputs), cast(pytree.TreeSpec, replay.out_spec))
