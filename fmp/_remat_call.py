"""One call of a rematerialized function: its forward without a record, its recompute, its checks.

Every tensor among the call's arguments is an input of the autograd.Function, so autograd saves
it, checks it is not updated before the backward pass, and frees it with the node; torch.func
transforms unwrap them all, whatever their dtype. Those autograd or a grad transform tracks get
gradients; other leaves (numbers, None) are constants the call closes over. The forward runs on
detached aliases of the inputs under a function mode that refuses a differentiated tensor read
from anywhere else, since that tensor's gradient (or its outer jvp's tangent) would be lost. An
input the forward updated in place that nothing differentiates, and the running statistics a
batch or instance norm was given (updated without bumping their version counters), enter the
recompute as copies, so the caller's tensor is updated once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._functorch.eager_transforms import _vjp_with_argnums
from torch.overrides import TorchFunctionMode

from fmp._replay import Ambient
from fmp.tree import functorch_base
from fmp.tree import is_inexact_tensor

__all__ = ["Call"]

# Calls whose result carries no gradient of their tensor arguments: metadata, and factories that
# take only a shape and dtype from them.
_NO_GRADIENT_THROUGH = frozenset(
    {"size", "dim", "numel", "is_floating_point", "is_complex", "element_size", "stride"}
    | {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
)
# Properties read through `__get__` that return metadata, not a view (x.T and x.real are views).
_METADATA_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "names", "itemsize", "nbytes"}
    | {"is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested"}
)


# Norms that update the running statistics they are given in place without bumping their version
# counters: the position of `running_mean` (`running_var` follows it; both may come by keyword),
# and the flag (always the sixth argument) that makes them update, with its default.
_RUNNING_STATISTICS = {
    F.batch_norm: (1, "training", False),
    F.instance_norm: (1, "use_input_stats", True),
    torch.batch_norm: (3, "training", False),
    torch.instance_norm: (3, "use_input_stats", True),
    torch.native_batch_norm: (3, "training", False),
    torch._native_batch_norm_legit: (3, "training", False),
}


def _updated_statistics(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The running statistics a norm call is about to update."""
    if func not in _RUNNING_STATISTICS:
        return []
    position, flag, default = _RUNNING_STATISTICS[func]
    if not (args[5] if len(args) > 5 else kwargs.get(flag, default)):
        return []
    given = [*args[position : position + 2], kwargs.get("running_mean"), kwargs.get("running_var")]
    return [x for x in given if isinstance(x, torch.Tensor)]


def jvp_levels() -> frozenset[int]:
    """The levels of the `torch.func.jvp` transforms active now (their tangents ride on wrappers)."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    return frozenset(i.level() for i in stack if i.key() == torch._C._functorch.TransformType.Jvp)


def _wrapper_levels(x: torch.Tensor) -> list[int]:
    levels = []
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        levels.append(torch._C._functorch.maybe_get_level(x))
        x = torch._C._functorch.get_unwrapped(x)
    return levels


def _is_differentiated(x: torch.Tensor) -> bool:
    """Whether autograd or a torch.func grad transform tracks `x`, at any of its wrappers' levels."""
    if not is_inexact_tensor(x):
        return False
    while True:
        if x.requires_grad:
            return True
        if not torch._C._functorch.is_functorch_wrapped_tensor(x):
            return False
        x = torch._C._functorch.get_unwrapped(x)


def _carries_no_gradient(func: Any) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA_PROPERTIES
    return name in _NO_GRADIENT_THROUGH


def _version(x: torch.Tensor) -> int:
    # A torch.func wrapper keeps a version counter of its own; in-place updates below it count
    # on the tensor it wraps.
    return functorch_base(x)._version


def _alive(tensors: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
    # A block nested in a rematerialized block is pulled back after the outer recompute's
    # torch.func level has exited; the tensors it kept still wear that dead level's wrapper.
    return tuple(torch._C._functorch.unwrap_if_dead(x) if isinstance(x, torch.Tensor) else x for x in tensors)


class _NoCapturedGradients(TorchFunctionMode):
    """Refuses a differentiated tensor the function reads without taking it as an argument.

    A tensor of an outer `torch.func.jvp` (one of `jvp_levels`) counts as differentiated: its
    tangent cannot be read from inside the Function, so it is refused whether it has one or not.
    Also records the tensors the calls return, so outputs made before the call can be told apart,
    and the running statistics a norm updates, unseen by version counters (captured ones it refuses).
    """

    def __init__(self, name: str, inputs: tuple[torch.Tensor, ...], jvp_levels: frozenset[int]) -> None:
        super().__init__()
        self.name = name
        self.input_ids = {id(x) for x in inputs}
        self.jvp_levels = jvp_levels
        self.created: set[int] = set()
        self.statistics: set[int] = set()

    def _refused(self, x: torch.Tensor) -> bool:
        if id(x) in self.input_ids:
            return False
        return _is_differentiated(x) or not self.jvp_levels.isdisjoint(_wrapper_levels(x))

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not _carries_no_gradient(func):
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and self._refused(leaf):
                    # Not a TypeError: Tensor's operators turn a TypeError into NotImplemented.
                    raise RuntimeError(
                        f"fmp.remat: {self.name} reads a tensor of shape {tuple(leaf.shape)} that is being "
                        f"differentiated but is not one of its arguments (a captured parameter or activation, "
                        f"or a tensor of an outer torch.func.jvp); its gradient or tangent would be lost. Pass it "
                        f"as an argument, or wrap the nn.Module itself (fmp.remat(layer)), which passes the "
                        f"module's parameters for you"
                    )
        for statistic in _updated_statistics(func, args, kwargs):
            if id(statistic) not in self.input_ids:
                raise RuntimeError(
                    f"fmp.remat: {self.name} updates running statistics of shape {tuple(statistic.shape)} that "
                    f"are not among its arguments (a norm layer called from a closure), so its recompute would "
                    f"update them again. Wrap the nn.Module itself (fmp.remat(layer)), or pass them as arguments"
                )
            self.statistics.add(id(statistic))
        out = func(*args, **kwargs)
        self.created.update(id(x) for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))
        return out


class Call:
    """One call of a wrapped function, from its arguments to the gradients of its outputs.

    Args:
        fn: The wrapped function.
        name: Its name, for error messages.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        ambient: The state around the call, which the recompute replays.
    """

    def __init__(
        self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ambient: Ambient
    ) -> None:
        self.fn, self.name, self.ambient = fn, name, ambient
        self.jvp_levels = jvp_levels()
        with_paths, self.spec = pytree.tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _, leaf in with_paths]
        self.where = [_argument_name(path) for path, _ in with_paths]
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        slots = set(self.slots)
        self.constants: list[Any] = [None if i in slots else leaf for i, leaf in enumerate(leaves)]
        self.differentiated = [_is_differentiated(leaves[i]) for i in self.slots]
        self.copies = [False for _ in self.slots]  # inputs the recompute gets copies of
        self.out_spec: pytree.TreeSpec | None = None
        self.differentiable_outputs: list[bool] = []

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The autograd.Function's inputs among the call's arguments (not kept: autograd saves them)."""
        leaves = pytree.tree_leaves((args, kwargs))
        return [leaves[i] for i in self.slots]

    def _run(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.constants)
        for slot, tensor in zip(self.slots, inputs, strict=True):
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.ambient.run(self.fn, *args, **kwargs)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Runs the call with nothing recorded, and notes its outputs and what it updated in place."""
        # Fresh objects: the same tensor read from elsewhere (a module's own weight) is told apart.
        aliases = tuple(x.detach() for x in inputs)
        before = [_version(x) for x in aliases]
        mode = _NoCapturedGradients(self.name, aliases, self.jvp_levels)
        with torch.no_grad(), mode:
            out = self._run(aliases)
        for n, (x, version) in enumerate(zip(aliases, before, strict=True)):
            if _version(x) == version and id(x) not in mode.statistics:
                continue
            if self.differentiated[n]:
                raise RuntimeError(
                    f"fmp.remat: {self.name} updated its argument {self.where[self.slots[n]]} in place, so its "
                    f"recompute would start from the updated value; update a copy (x = x.clone()) instead"
                )
            self.copies[n] = True
        out_leaves, self.out_spec = pytree.tree_flatten(out)
        for path, leaf in pytree.tree_flatten_with_path(out)[0]:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"fmp.remat: {self.name} returned a {type(leaf).__name__} at output{pytree.keystr(path)}; "
                    f"a rematerialized function returns tensors only (compute constants outside it)"
                )
        self.differentiable_outputs = [is_inexact_tensor(leaf) for leaf in out_leaves]
        # A tensor that existed before the call (an argument, a captured constant) returned as it
        # is would be marked as the Function's output in place; a view of it is a new tensor.
        return tuple(o if id(o) in mode.created else o.view_as(o) for o in out_leaves)

    def _recomputed(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = pytree.tree_leaves(self._run(inputs))
        return tuple(o for o, keep in zip(outs, self.differentiable_outputs, strict=True) if keep)

    def _recompute_arguments(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # The recompute updates copies, so the caller's tensors are updated once, by the forward.
        return tuple(x.clone() if copy else x for x, copy in zip(_alive(inputs), self.copies, strict=True))

    def pullback(
        self, inputs: tuple[torch.Tensor, ...], cotangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Recomputes the call under the state it first ran in, and pulls `cotangents` back to the inputs."""
        arguments = self._recompute_arguments(inputs)
        cotangents = _alive(cotangents)
        argnums = tuple(n for n, differentiated in enumerate(self.differentiated) if differentiated)
        with self.ambient.replayed():
            # Everything goes in as an argument: torch.func lets a function update its arguments in
            # place, not the tensors it captures, and differentiates only those in argnums.
            outs, vjp_fn = _vjp_with_argnums(self._recomputed, *arguments, argnums=argnums)[:2]
        kept = [c for c, keep in zip(cotangents, self.differentiable_outputs, strict=True) if keep]
        # An output the loss does not use may come back as None; its cotangent is zero.
        kept = [torch.zeros_like(o) if c is None else c for c, o in zip(kept, outs, strict=True)]
        # The recompute's activations are freed as its backward uses them, unless an outer
        # transform differentiates this backward (the outer backward then runs with grad enabled).
        record = torch.is_grad_enabled()
        grads = iter(vjp_fn(tuple(kept), retain_graph=record, create_graph=record))
        return tuple(next(grads) if differentiated else None for differentiated in self.differentiated)

    def pushforward(
        self, inputs: tuple[torch.Tensor, ...], tangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Recomputes the call under the state it first ran in, pushing `tangents` forward to the outputs."""
        arguments = self._recompute_arguments(inputs)
        tangents = _alive(tangents)
        # The inputs given tangents are the primals; the others (integers, data) stay fixed.
        moving = [t is not None and is_inexact_tensor(x) for x, t in zip(arguments, tangents, strict=True)]
        primals = tuple(x for x, m in zip(arguments, moving, strict=True) if m)
        tangents = tuple(t for t, m in zip(tangents, moving, strict=True) if m)

        def with_primals(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            given = iter(xs)
            return self._recomputed(*(next(given) if m else x for x, m in zip(arguments, moving, strict=True)))

        with self.ambient.replayed():
            out_tangents = torch.func.jvp(with_primals, primals, tangents)[1]
        kept = iter(out_tangents)
        return tuple(next(kept) if keep else None for keep in self.differentiable_outputs)


def _argument_name(path: tuple[Any, ...]) -> str:
    # Paths run through the (args, kwargs) pair: (0, 2) is the third positional argument.
    (which, position), rest = path[:2], path[2:]
    head = f"args[{position.idx}]" if which.idx == 0 else repr(position.key)
    return head + pytree.keystr(rest)
