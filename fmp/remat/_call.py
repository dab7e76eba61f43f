"""One call of a rematerialized function: its first run, its recompute, its checks.

Every tensor among the call's arguments is an input of the autograd.Function, so autograd saves
it, checks it is not updated before the backward pass, and frees it with the node; torch.func
transforms unwrap them all, whatever their dtype. Those autograd or a grad transform tracks get
gradients; other leaves (numbers, None) are constants the call closes over. The forward runs on
detached aliases of the inputs under `fmp.remat._watch.Watch`, which refuses what a recompute
cannot repeat and saves the inputs the forward overwrites, so the recompute starts from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._functorch.eager_transforms import _vjp_with_argnums
from torch.autograd.graph import saved_tensors_hooks

from fmp._tree import functorch_base
from fmp._tree import is_inexact_tensor
from fmp.remat._replay import Ambient
from fmp.remat._watch import Watch
from fmp.remat._watch import is_differentiated
from fmp.remat._watch import jvp_levels

__all__ = ["Call"]


def _version(x: torch.Tensor) -> int:
    # A torch.func wrapper keeps a version counter of its own; in-place updates below it count
    # on the tensor it wraps.
    return functorch_base(x)._version


def _alive(tensors: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
    # A block nested in a rematerialized block is pulled back after the outer recompute's
    # torch.func level has exited; the tensors it kept still wear that dead level's wrapper.
    return tuple(torch._C._functorch.unwrap_if_dead(x) if isinstance(x, torch.Tensor) else x for x in tensors)


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
        # Under torch.func the recompute runs in a vjp, and the first run at a torch.func level of
        # its own; with plain autograd, both run without one. Some random ops place their numbers
        # differently at a level (dropout on a transposed tensor), so both runs must agree, and each
        # agrees with the unwrapped function run in the same setting.
        stack = torch._C._functorch.get_interpreter_stack() or []
        self.leveled = bool(stack)
        self.outer_level = max((i.level() for i in stack), default=0)
        with_paths, self.spec = pytree.tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _, leaf in with_paths]
        self.where = [_argument_name(path) for path, _ in with_paths]
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        slots = set(self.slots)
        self.constants: list[Any] = [None if i in slots else leaf for i, leaf in enumerate(leaves)]
        self.differentiated = [is_differentiated(leaves[i]) for i in self.slots]
        # The inputs the forward updated in place, as they were before: the recompute updates copies.
        self.before: dict[int, torch.Tensor] = {}
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
        """Runs the call as the recompute will, keeping nothing of it but its outputs and the inputs it overwrote.

        The differentiated inputs require grad here too, so modules pick the kernels they pick in
        the recompute and in the unwrapped function (attention's fast path, say); what autograd
        records is dropped with the run.
        """
        # Fresh objects: the same tensor read from elsewhere (a module's own weight) is told apart.
        aliases = tuple(x.detach() for x in inputs)
        versions = [_version(x) for x in aliases]
        where = [self.where[slot] for slot in self.slots]
        levels = self._enter_levels()
        try:
            leveled = self._marked(aliases, levels)
            watch = Watch(self.name, leveled, where, self.differentiated, self.jvp_levels)
            # The record is never used: with plain autograd nothing of it is kept (torch.func refuses
            # saved-tensor hooks, and frees it when this run's level exits).
            dropped = contextlib.nullcontext() if self.leveled else saved_tensors_hooks(_drop, _never_used)
            with torch.enable_grad(), dropped, _no_autocast_cache(), watch:
                out = self._run(leveled)
            out_leaves, self.out_spec = pytree.tree_flatten(out)
            for path, leaf in pytree.tree_flatten_with_path(out)[0]:
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(
                        f"fmp.remat: {self.name} returned a {type(leaf).__name__} at output{pytree.keystr(path)}; "
                        f"a rematerialized function returns tensors only (compute constants outside it)"
                    )
            fresh = [watch.made(o) for o in out_leaves]
            self.before = dict(watch.before)
            unwrap = torch._C._functorch._unwrap_for_grad
            for entered in reversed(levels):
                out_leaves = [unwrap(o, entered) for o in out_leaves]
                self.before = {n: unwrap(x, entered) for n, x in self.before.items()}
        finally:
            for _ in levels:
                torch._C._functorch._grad_decrement_nesting()
        for n, (x, version) in enumerate(zip(aliases, versions, strict=True)):
            if _version(x) != version and n not in self.before:
                raise RuntimeError(
                    f"fmp.remat: {self.name} updated its argument {where[n]} in place through a call fmp cannot "
                    f"see, so its recompute could not start from the value the first run read; update a copy "
                    f"(x = x.clone()) instead"
                )
        self.differentiable_outputs = [is_inexact_tensor(leaf) for leaf in out_leaves]
        if not self.leveled:
            return tuple(o.detach() for o in out_leaves)
        # A tensor that existed before the call (an argument, a captured constant) returned as it
        # is would be marked as the Function's output in place; a view of it is a new tensor.
        return tuple(o if made else o.view_as(o) for o, made in zip(out_leaves, fresh, strict=True))

    def _enter_levels(self) -> list[int]:
        """Enters the torch.func levels the first run takes: above every level of the caller's tensors.

        The Function's forward runs with the caller's transforms set aside, so a new level would
        take the number of one of theirs, whose captured tensors would then look like its own;
        levels below it keep those numbers taken (each passes their tensors through).
        """
        levels: list[int] = []
        while self.leveled and (not levels or levels[-1] <= self.outer_level):
            levels.append(torch._C._functorch._grad_increment_nesting())
        return levels

    def _marked(self, aliases: tuple[torch.Tensor, ...], levels: list[int]) -> tuple[torch.Tensor, ...]:
        """The inputs wrapped at every entered level, the differentiated ones requiring grad.

        An input at every level, so that each lets the block update it in place; marked as
        torch.func marks the inputs it differentiates.
        """
        for level in levels:
            aliases = tuple(torch._C._functorch._wrap_for_grad(x, level) for x in aliases)
        allowed = torch._C._functorch.get_inplace_requires_grad_allowed()
        torch._C._functorch.set_inplace_requires_grad_allowed(True)
        try:
            for x, differentiated in zip(aliases, self.differentiated, strict=True):
                x.requires_grad_(differentiated)
        finally:
            torch._C._functorch.set_inplace_requires_grad_allowed(allowed)
        return aliases

    def _recomputed(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = pytree.tree_leaves(self._run(inputs))
        return tuple(o for o, keep in zip(outs, self.differentiable_outputs, strict=True) if keep)

    def _recompute_arguments(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # The recompute updates copies, so the caller's tensors are updated once, by the forward.
        return tuple(self.before[n].clone() if n in self.before else x for n, x in enumerate(_alive(inputs)))

    def pullback(
        self, inputs: tuple[torch.Tensor, ...], cotangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Recomputes the call under the state it first ran in, and pulls `cotangents` back to the inputs."""
        arguments = self._recompute_arguments(inputs)
        cotangents = _alive(cotangents)
        if not self.leveled:
            return self._plain_pullback(arguments, cotangents)
        argnums = tuple(n for n, differentiated in enumerate(self.differentiated) if differentiated)
        with self.ambient.replayed(), _no_autocast_cache():
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

    def _plain_pullback(
        self, arguments: tuple[torch.Tensor, ...], cotangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        # With plain autograd (loss.backward()). A backward pass that builds its own graph
        # (create_graph=True) differentiates the recompute from the inputs themselves.
        record = torch.is_grad_enabled()
        differentiated = [
            x if record else x.detach().requires_grad_()
            for x, d in zip(arguments, self.differentiated, strict=True)
            if d
        ]
        given = iter(differentiated)
        arguments = tuple(next(given) if d else x for x, d in zip(arguments, self.differentiated, strict=True))
        with torch.enable_grad(), self.ambient.replayed(), _no_autocast_cache():
            outs = self._recomputed(*arguments)
        kept = [c for c, keep in zip(cotangents, self.differentiable_outputs, strict=True) if keep]
        pairs = [(o, c) for o, c in zip(outs, kept, strict=True) if c is not None and o.requires_grad]
        grads = iter(
            torch.autograd.grad(
                [o for o, _ in pairs],
                differentiated,
                [c for _, c in pairs],
                retain_graph=record,
                create_graph=record,
                allow_unused=True,
            )
            if pairs
            else [None] * len(differentiated)
        )
        return tuple(next(grads) if d else None for d in self.differentiated)

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


def _drop(_: torch.Tensor) -> None:
    return None


def _never_used(_: None) -> torch.Tensor:
    raise RuntimeError(
        "fmp.remat: a rematerialized block that differentiates inside its own forward (torch.autograd.grad "
        "for a gradient penalty, say) is not supported; call that block without remat"
    )


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """torch.autocast without its cache of casts, for the blocks' runs.

    The cache keeps the cast of every leaf that requires grad until the outermost autocast region
    exits; each run's inputs are new leaves, so it would only grow. A cast gives the same values
    either way.
    """
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _argument_name(path: tuple[Any, ...]) -> str:
    # Paths run through the (args, kwargs) pair: (0, 2) is the third positional argument.
    (which, position), rest = path[:2], path[2:]
    head = f"args[{position.idx}]" if which.idx == 0 else repr(position.key)
    return head + pytree.keystr(rest)
