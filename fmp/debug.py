"""Finding where a step's inf or NaN comes from: the op, its module and its dtypes, forward and backward.

A skipped step says only that some gradient was not finite. `locate_nonfinite` runs the loss once
more, eagerly and op by op as the step runs it (the policy's casts, the loss scale), and names the
first op whose output is inf or NaN while its inputs are finite: in the forward pass a call such
as `linear` or a cast to float16, in the backward pass the gradient function of such a call. Each
is placed in the `nn.Module` that ran it. It is a debugging tool: it reads every op's output on
the host, so it syncs once per op, and it does not run under `torch.compile` or `torch.func`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from fmp.grad import check_param_leaves
from fmp.grad import with_policy
from fmp.loss_scale import LossScale
from fmp.loss_scale import NoOpLossScale
from fmp.loss_scale import check_scaler
from fmp.policy import Policy
from fmp.tree import is_inexact_tensor

__all__ = ["NonFiniteOrigin", "NonFiniteReport", "locate_nonfinite"]


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """The first op that made an inf or NaN out of finite inputs.

    Attributes:
        op: The call's name (`linear`, `to`, `exp`); in the backward pass, the forward call whose
            gradient function it was (or, for a node inside a composite call, that call's).
        node: The autograd node's name in the backward pass (`AddmmBackward0`), "" in the forward.
        module: The qualified name of the innermost `nn.Module` running, "" outside any module.
        input_dtypes: The dtypes of the floating inputs (in the backward: the incoming gradients).
        output_dtypes: The dtypes of the floating outputs (in the backward: the gradients made).
        largest_input: The largest magnitude among those inputs, all finite.
    """

    op: str
    node: str
    module: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtypes: tuple[torch.dtype, ...]
    largest_input: float

    def __str__(self) -> str:
        where = f" in module `{self.module}`" if self.module else " outside any module"
        node = f" ({self.node})" if self.node else ""
        dtypes = ", ".join(sorted({str(d).removeprefix("torch.") for d in self.output_dtypes}))
        inputs = ", ".join(sorted({str(d).removeprefix("torch.") for d in self.input_dtypes})) or "no"
        limits = sorted({torch.finfo(d).max for d in self.output_dtypes if d.is_floating_point})
        bound = f" (which holds at most {limits[0]:.4g})" if limits else ""
        return (
            f"`{self.op}`{node}{where}: {dtypes} output{bound} from finite {inputs} inputs "
            f"of magnitude at most {self.largest_input:.4g}"
        )


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """What `locate_nonfinite` found; `str(report)` explains it.

    Attributes:
        loss: The loss in the policy's output dtype, read on the host.
        loss_scale: The scale the backward pass ran with.
        nonfinite_inputs: Paths (`params['w']`, `args[0]`) of inputs already holding inf or NaN.
        forward: The forward pass's first op to make inf or NaN from finite inputs, if any.
        backward: The backward pass's first such gradient function, if any.
        nonfinite_grads: Paths of the parameters whose unscaled gradients are not finite: the step
            skips exactly when this is not empty.
    """

    loss: float
    loss_scale: float
    nonfinite_inputs: tuple[str, ...]
    forward: NonFiniteOrigin | None
    backward: NonFiniteOrigin | None
    nonfinite_grads: tuple[str, ...]

    @property
    def finite(self) -> bool:
        """Whether every gradient is finite after unscaling (the step would apply its update)."""
        return not self.nonfinite_grads

    def __str__(self) -> str:
        lines = [f"at loss scale {self.loss_scale:g}, loss {self.loss:g}:"]
        if self.nonfinite_inputs:
            lines.append(f"  inputs already not finite: {', '.join(self.nonfinite_inputs)}")
        if self.forward:
            lines.append(f"  forward: first inf/NaN from {self.forward}")
        elif self.nonfinite_inputs or not math.isfinite(self.loss):
            lines.append(
                "  forward: no op made inf or NaN from finite inputs (they came in with an input or a captured tensor)"
            )
        else:
            lines.append("  forward: finite")
        if self.backward:
            lines.append(f"  backward: first inf/NaN from {self.backward}")
        if self.finite:
            lines.append("  gradients: finite, so the step applies its update")
        else:
            lines.append(f"  gradients not finite (the step skips): {', '.join(self.nonfinite_grads)}")
        lines += [f"  {hint}" for hint in self._hints()]
        return "\n".join(lines)

    def _hints(self) -> list[str]:
        if self.nonfinite_inputs:
            return ["the inputs hold inf or NaN already, which no loss scale can help: check the batch and params"]
        if self.forward and torch.float16 in self.forward.output_dtypes:
            return [
                "a float16 forward op overflowed: run it in float32 (fmp.fixed_dtype, or an autocast override), "
                "or compute in bfloat16, whose range is float32's"
            ]
        if self.forward:
            return ["an op made inf or NaN from finite inputs: a log of 0, a division by 0, or an exploding activation"]
        if self.backward and self.loss_scale > 1:
            return [
                "only the scaled backward pass overflowed: a DynamicLossScale backs off and retries; if it "
                "keeps overflowing at its minimum scale, run that op in float32 or compute in bfloat16"
            ]
        return []


def _floating(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if is_inexact_tensor(x) and x.numel() > 0]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    # Debugging only: a host read per call.
    return all(bool(torch.isfinite(x).all()) for x in tensors)


def _largest_magnitude(tensors: list[torch.Tensor]) -> float:
    return max((float(x.detach().abs().max()) for x in tensors), default=0.0)


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    return f"{owner}.{name}" if name == "__get__" and owner else name


class _ModuleStack:
    """The qualified name of the innermost module running, from global forward hooks."""

    def __init__(self) -> None:
        self.running: list[nn.Module] = []
        self.names: dict[int, str] = {}

    def enter(self, module: nn.Module, *_: Any) -> None:
        if not self.running and id(module) not in self.names:
            self.names.update({id(m): name for name, m in module.named_modules()})
        self.running.append(module)

    def leave(self, module: nn.Module, *_: Any) -> None:
        if self.running and self.running[-1] is module:
            self.running.pop()

    def current(self) -> str:
        return self.names.get(id(self.running[-1]), type(self.running[-1]).__name__) if self.running else ""

    @contextmanager
    def hooked(self) -> Iterator[None]:
        pre = nn.modules.module.register_module_forward_pre_hook(self.enter)
        post = nn.modules.module.register_module_forward_hook(self.leave, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


class _Label(NamedTuple):
    op: str
    module: str
    forward_finite: bool  # whether the call's floating inputs and outputs were all finite


class _ForwardWatch(TorchFunctionMode):
    """Checks every call's floating inputs and outputs, and labels each output's gradient function."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.origin: NonFiniteOrigin | None = None
        self.labels: dict[Any, _Label] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = _floating(out)
        if not outputs:
            return out
        inputs = _floating((args, kwargs))
        inputs_finite, outputs_finite = _all_finite(inputs), _all_finite(outputs)
        label = _Label(_op_name(func), self.modules.current(), inputs_finite and outputs_finite)
        for x in outputs:
            if x.grad_fn is not None:
                self.labels.setdefault(x.grad_fn, label)
        if self.origin is None and inputs_finite and not outputs_finite:
            dtypes = tuple(x.dtype for x in inputs), tuple(x.dtype for x in outputs)
            self.origin = NonFiniteOrigin(label.op, "", label.module, *dtypes, _largest_magnitude(inputs))
        return out


def _watch_backward(root: Any, labels: dict[Any, _Label]) -> tuple[list[NonFiniteOrigin], list[Any]]:
    """Hooks every gradient function under `root`; the list fills with origins in execution order.

    A gradient function counts only where its forward call's values were finite: one that meets
    the forward's inf or NaN passes it on rather than making it.
    """
    found: list[NonFiniteOrigin] = []
    handles = []
    seen: set[Any] = set()
    stack = [(root, labels.get(root, _Label("", "", True)))]
    while stack:
        node, inherited = stack.pop()
        if node is None or node in seen or hasattr(node, "variable"):  # AccumulateGrad: a leaf
            continue
        seen.add(node)
        label = labels.get(node, inherited)  # a node inside a composite call takes the call's label

        def hook(grad_inputs: Any, grad_outputs: Any, node: Any = node, label: _Label = label) -> None:
            incoming, made = _floating(grad_outputs), _floating(grad_inputs)
            if found or not label.forward_finite or not made or _all_finite(made) or not _all_finite(incoming):
                return
            dtypes = tuple(x.dtype for x in incoming), tuple(x.dtype for x in made)
            found.append(NonFiniteOrigin(label.op, node.name(), label.module, *dtypes, _largest_magnitude(incoming)))

        handles.append(node.register_hook(hook))
        stack.extend((next_node, label) for next_node, _ in node.next_functions)
    return found, handles


def _nonfinite_paths(tree: Any, name: str) -> tuple[str, ...]:
    pairs = pytree.tree_flatten_with_path(tree)[0]
    return tuple(f"{name}{pytree.keystr(p)}" for p, x in pairs if _floating([x]) and not _all_finite([x]))


def locate_nonfinite(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    policy: Policy,
    scaler: LossScale | None = None,
    has_aux: bool = False,
) -> NonFiniteReport:
    """Runs one forward and backward pass as the step does, and names the first op to make inf or NaN.

    Call it with the params, batch and scaler of a step that skipped (`info.applied` False), to
    learn whether the data held inf or NaN, which forward op overflowed (a float16 matmul past
    65504, a cast, a log of 0) or, when the forward was finite, which gradient function of the
    scaled backward pass did, with the module that ran it. Nothing is updated: params and
    scaler are read only. Module names come from global forward hooks, registered for the call.

    Note: syncs with the host after every op (it reads each output); eager only.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss` (or `(loss, aux)` with `has_aux`), as the step takes it.
        params: The parameters, a pytree of tensors.
        *args: Further arguments of `loss_fn`.
        policy: The precision policy the step runs under.
        scaler: The loss-scale state the step saw (e.g. `state.scaler`); None for no scaling.
        has_aux: Whether `loss_fn` returns `(loss, aux)`.

    Returns:
        A `NonFiniteReport`; print it for an explanation.

    Raises:
        RuntimeError: Under `torch.compile` or a `torch.func` transform.
        TypeError: If `policy` or `scaler` is of the wrong type, a leaf of `params` is not a tensor
            autograd does not track, or `loss_fn` does not return a 0-dim floating loss.
    """
    if torch.compiler.is_compiling() or torch._C._functorch.get_interpreter_stack():
        raise RuntimeError("fmp.locate_nonfinite is a debugging tool that reads every op's output: call it eagerly")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy (e.g. fmp.get_policy('c=bf16')), got {type(policy).__name__}")
    scaler = NoOpLossScale() if scaler is None else scaler
    check_scaler(scaler)
    if scaler.loss_scale.dim():
        raise ValueError(
            f"scaler holds {scaler.loss_scale.numel()} scales (a vmapped ensemble's): locate one member's "
            f"overflow at a time, with its params, batch and scaler taken out by fmp.unstack_tree"
        )
    check_param_leaves(params)
    tracked = pytree.tree_map(lambda x: x.detach().requires_grad_(is_inexact_tensor(x)), params)
    modules = _ModuleStack()
    watch = _ForwardWatch(modules)
    with modules.hooked(), watch, torch.enable_grad():
        out = with_policy(loss_fn, policy)(tracked, *args)
        loss = out[0] if has_aux and isinstance(out, tuple) else out
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            raise TypeError(f"loss_fn must return a 0-dim floating loss{' and aux' if has_aux else ''}, got {out!r}")
        scaled = scaler.scale(loss)
    leaves, spec = pytree.tree_flatten(tracked)
    differentiated = [x for x in leaves if x.requires_grad]
    backward: list[NonFiniteOrigin] = []
    scaled_grads: tuple[torch.Tensor | None, ...] = (None,) * len(differentiated)
    if scaled.requires_grad and differentiated:
        backward, handles = _watch_backward(scaled.grad_fn, watch.labels)
        try:
            scaled_grads = torch.autograd.grad(scaled, differentiated, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
    by_leaf = dict(zip(map(id, differentiated), scaled_grads, strict=True))
    grads = [torch.zeros_like(x) if by_leaf.get(id(x)) is None else by_leaf[id(x)] for x in leaves]
    unscaled = scaler.unscale(pytree.tree_unflatten(grads, spec))
    return NonFiniteReport(
        loss=float(loss.detach()),
        loss_scale=float(scaler.loss_scale),
        nonfinite_inputs=_nonfinite_paths(params, "params") + _nonfinite_paths(args, "args"),
        forward=watch.origin,
        backward=backward[0] if backward else None,
        nonfinite_grads=_nonfinite_paths(unscaled, "params"),
    )
