"""Which backwards accumulated into a `GradientBuffer`'s gradients, and whether each started at a loss it scaled.

Autograd hooks keep the record on the host (Python flags only, no tensor read): `GradientBuffer`
reads it to refuse unscaling gradients twice, or gradients that a backward of an unscaled loss
(`loss.backward()`) wrote.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Accumulation"]


def _same_edge(a: torch.autograd.graph.GradientEdge, b: torch.autograd.graph.GradientEdge) -> bool:
    """Whether two gradient edges lead into the same input of the same node (whatever their ownership tokens)."""
    return a.node is b.node and a.output_nr == b.output_nr


class _ScaledLoss:
    """One loss `GradientBuffer.scale` returned: whether its `.backward()` is starting, and its graph task."""

    __slots__ = ("starting", "task")

    def __init__(self) -> None:
        self.starting = False
        self.task: int | None = None


class Accumulation:
    """What the gradients went through since the last unscale or `zero_()`, kept by autograd hooks on the host.

    `since_unscale`: a backward accumulated into them, or `zero_()` ran. A post-accumulate-grad
    hook on each parameter sets it, which only autograd's accumulation fires: an in-place edit of
    the gradients (`clip_grad_norm_`) leaves it as it was.

    `unscaled_param`: the first parameter to receive a gradient from a backward that did not
    start with `.backward()` on a loss `GradientBuffer.scale` returned. `scale` gives that loss a
    `.backward` of its own (an attribute of that tensor only), which flags the loss as starting
    and runs `torch.autograd.backward` from the loss's gradient edge, as `torch.Tensor.backward`
    does from the loss; a pre-hook on the loss's autograd node, that graph task's root, then enters
    the task in `scaled_backwards` with the thread that runs the node, and the `.backward` takes it
    out when it returns or raises. A backward that starts anywhere else is not entered, even one
    whose graph holds the scaled loss: `(scaled + loss).backward()` reaches the scaled loss's node
    through `+` (no flag is up then), and `loss`'s gradients are not scaled. An accumulation counts
    as scaled when its graph task is in `scaled_backwards`, or runs on the thread of one while that
    one runs: a backward nested in it (a reentrant checkpoint's), whose gradients are scaled too.
    That thread is the one engine thread of a GPU, so there a backward that another Python thread
    runs at the same time on the same parameters counts as scaled as well. Python flags only: no
    tensor is read.

    The hooks hold this object weakly and are taken off the parameters when it dies with the last
    handle sharing it (a buffer attached again, after moving the model, say, leaves no hooks of
    the old one).
    """

    def __init__(self, params: tuple[torch.Tensor, ...]) -> None:
        self.since_unscale = True  # gradients copied in at attach may be unscaled once
        self.scaled_backwards: dict[int, int] = {}  # graph task id -> the thread that runs it
        self.unscaled_param: int | None = None
        self.accumulated = False  # a backward accumulated since the last unscale or zero_()
        self.unscaled = False  # the gradients hold unscaled values: unscaled, and not zeroed since
        self.onto_unscaled = False  # a backward accumulated into unscaled values: they mix two scales
        self.scale: torch.Tensor | None = None  # the loss scale `scale` multiplied by since zero_() or unscale
        self.scales_differ = False  # `scale` was given two loss-scale states since then
        flag = weakref.ref(self)

        def marker(index: int) -> Callable[[torch.Tensor], None]:
            def mark(param: torch.Tensor) -> None:
                alive = flag()
                if alive is None:
                    return
                alive.since_unscale = alive.accumulated = True
                alive.onto_unscaled = alive.onto_unscaled or alive.unscaled
                if alive.unscaled_param is None and not alive.scaled_now():
                    alive.unscaled_param = index

            return mark

        hooks = [param.register_post_accumulate_grad_hook(marker(i)) for i, param in enumerate(params)]  # type: ignore[no-untyped-call]
        weakref.finalize(self, _remove_hooks, hooks)

    def scaled_now(self) -> bool:
        """Whether the graph task accumulating now is a scaled backward, or nested in one (on its thread)."""
        running = self.scaled_backwards
        return torch._C._current_graph_task_id() in running or threading.get_ident() in running.values()

    def watch(self, scaled: torch.Tensor) -> None:
        """Gives `scaled` a `.backward` of its own, whose backward counts as scaled while it runs.

        Only that call counts: a backward started at any other tensor (one computed from `scaled`,
        or `torch.autograd.backward(scaled)`) reaches `scaled`'s node too, but not as its root; so
        does `.backward()` on `scaled` after an in-place edit (`scaled /= n`, `scaled.add_(x)`,
        `scaled.detach_()`), which runs torch's own backward from the edited history, unmarked.
        """
        flag = weakref.ref(self)
        loss = _ScaledLoss()
        # The edge into `scaled`'s node, and `scaled` held weakly: the tensor holds this
        # `.backward`, and a reference back to the tensor would be a cycle keeping its graph alive
        # until a collection. A detached alias shares its version counter (and storage, not its
        # graph): an in-place edit shows there even once the tensor itself is gone.
        edge = torch.autograd.graph.get_gradient_edge(scaled)
        tensor_ref = weakref.ref(scaled)
        alias = scaled.detach()
        version = scaled._version

        def starts(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            alive = flag()
            # The root of the backward `backward` below started: the first task to reach the node
            # once it flagged the loss, before any other node of that task ran.
            if alive is None or not loss.starting:
                return
            loss.starting = False
            loss.task = torch._C._current_graph_task_id()
            alive.scaled_backwards[loss.task] = threading.get_ident()

        # No closure refers to the node: a cycle through the node's C++ hooks would never be freed.
        edge.node.register_prehook(starts)

        def backward(
            gradient: torch.Tensor | None = None,
            retain_graph: bool | None = None,
            create_graph: bool = False,
            inputs: Any = None,
        ) -> None:
            """`torch.Tensor.backward`, counted by the `GradientBuffer` that scaled this loss."""
            tensor = tensor_ref()
            if tensor is not None and (
                tensor._version != version
                or not tensor.requires_grad
                or not _same_edge(torch.autograd.graph.get_gradient_edge(tensor), edge)
            ):
                # Edited in place since `scale`: torch's backward from its history now, which holds
                # what the edit added (or raises, after `detach_()`). Not marked, so `unscale_`
                # refuses it rather than take `scaled / n` for the scaled loss.
                torch.Tensor.backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)  # type: ignore[no-untyped-call]
                return
            if tensor is None and alias._version != version:
                raise RuntimeError(
                    "the loss grads.scale returned was edited in place (grads.scale(loss, scaler).add_(x), say) "
                    "and dropped before its .backward() ran, so that backward cannot see the edit and would "
                    "miss it; scale the loss you differentiate: grads.scale(loss + x, scaler).backward()"
                )
            loss.starting = True
            try:
                # What torch.Tensor.backward runs, from the tensor's edge: the same root and gradient.
                torch.autograd.backward(edge, gradient, retain_graph, create_graph, inputs=inputs)
            finally:  # also when the backward raised midway: no scaled mark stays behind
                loss.starting = False
                alive = flag()
                if alive is not None and loss.task is not None:
                    alive.scaled_backwards.pop(loss.task, None)
                loss.task = None

        # An attribute of this tensor only: a backward started at any other tensor is not marked.
        scaled.__dict__["backward"] = backward

    def note_scale(self, scale: torch.Tensor | None) -> None:
        """Records the loss scale `GradientBuffer.scale` multiplied a loss by (a state's tensor, by identity)."""
        self.scales_differ |= self.scale is not None and scale is not self.scale
        self.scale = scale

    def zeroed(self) -> None:
        """After `zero_()`: zeros, which any unscale may take, and nothing accumulated into them yet."""
        self.since_unscale = True  # gradients written by hand after this unscale once
        self.accumulated = self.unscaled = self.onto_unscaled = False
        self._forget()

    def unscaled_now(self) -> None:
        """After an unscale: the gradients hold unscaled values, which only `zero_()` renews."""
        self.since_unscale = self.accumulated = False
        self.unscaled = True
        self._forget()

    def _forget(self) -> None:
        self.unscaled_param = None
        self.scale = None
        self.scales_differ = False


def _remove_hooks(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()
