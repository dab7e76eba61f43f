"""Finding where a step's inf or NaN comes from: the op, its module and its dtypes, forward and backward.

A skipped step says only that some gradient was not finite. `locate_nonfinite` runs the loss once
more, eagerly and op by op as the step runs it (the policy's casts, the loss scale), and names the
first op whose output is inf or NaN while its inputs are finite: in the forward pass a call such
as `linear` or a cast to float16, in the backward pass the gradient function of such a call. Each
is placed in the `nn.Module` that ran it. It is a debugging tool: it reads every op's output on
the host, so it syncs once per op, and it does not run under `torch.compile` or `torch.func`.
`fmp.debug._watch` holds the watchers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from fmp._backward import check_reads_no_module_parameters
from fmp._checks import check_bool
from fmp._checks import check_callable
from fmp._grad import with_policy
from fmp._grad_checks import check_params
from fmp._loss_scale import LossScale
from fmp._loss_scale import NoOpLossScale
from fmp._policy import Policy
from fmp._scale_checks import check_scaler
from fmp.debug._watch import BackwardWatch
from fmp.debug._watch import ForwardWatch
from fmp.debug._watch import Found
from fmp.debug._watch import ModuleStack
from fmp.debug._watch import floating
from fmp.debug._watch import kinds
from fmp.remat._remat import calling_plainly

__all__ = ["NonFiniteOrigin", "NonFiniteReport", "locate_nonfinite"]


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """The first op that made an inf or NaN out of finite inputs.

    Attributes:
        op: The call's name (`linear`, `to`, `exp`); in the backward pass, the forward call whose
            gradient function it was (or, for a node inside a composite call, that call's).
        node: The autograd node's name in the backward pass (`AddmmBackward0`), "" in the forward.
        module: The qualified name of the innermost `nn.Module` running, in the largest module
            that ran (`blocks.3.fc2`); "" for that module itself, or outside any module.
        module_type: That module's class name; "" outside any module.
        made: What its outputs hold: "inf", "NaN" or "inf and NaN".
        inputs_held: What its inputs held already: "" (all finite), or "inf" where it made NaN
            (inf - inf, a softmax over a row masked whole with -inf).
        input_dtypes: The dtypes of the floating inputs (in the backward: the incoming gradients).
        output_dtypes: The dtypes of the floating outputs (in the backward: the gradients made).
        largest_input: The largest finite magnitude among those inputs (NaN if none is finite).
    """

    op: str
    node: str
    module: str
    module_type: str
    made: str
    inputs_held: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtypes: tuple[torch.dtype, ...]
    largest_input: float

    def __str__(self) -> str:
        if not self.module_type:
            where = " outside any module"
        elif self.module:
            where = f" in module `{self.module}` ({self.module_type})"
        else:
            where = f" in the outermost module ({self.module_type})"
        node = f" ({self.node})" if self.node else ""
        dtypes = ", ".join(sorted({str(d).removeprefix("torch.") for d in self.output_dtypes}))
        inputs = ", ".join(sorted({str(d).removeprefix("torch.") for d in self.input_dtypes}))
        limits = sorted({torch.finfo(d).max for d in self.output_dtypes if d.is_floating_point})
        bound = f" (it holds at most {limits[0]:.4g})" if "inf" in self.made and limits else ""
        largest = f"{self.largest_input:.4g}"
        if math.isnan(self.largest_input):
            held = f"{inputs} inputs holding {self.inputs_held} and no finite value"
        elif self.inputs_held:
            held = f"{inputs} inputs holding {self.inputs_held} (finite values of magnitude at most {largest})"
        else:
            held = f"finite {inputs} inputs of magnitude at most {largest}"
        # No call of the loss function made it (fmp's cast of the loss, say): the node names it.
        op = f"`{self.op}`{node}" if self.op else node.strip().removeprefix("(").removesuffix(")")
        return f"{op}{where}: {self.made} in its {dtypes} output{bound}, from {held}"


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
            lines.append("  forward: no overflow, no NaN")
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
        if self.forward and math.isfinite(self.loss):
            # Absorbed on the way to the loss (a mask, a saturating op): not what a skip is about.
            absorbed = "the forward's inf or NaN did not reach the loss (a mask or a saturating op took it in)"
            backward = self._hints_for_backward()
            if self.backward is not None and self.backward.made == "NaN" and not self.finite:
                backward.insert(
                    0,
                    "but that op's backward met its inf with a zero gradient from downstream (a mask, or an op "
                    "the inf saturated), which makes NaN: keep the op's output finite (torch.where(mask, x, "
                    "1).log(), not torch.where(mask, x.log(), 0); clamp before exp)",
                )
            return [absorbed, *backward] if backward or not self.finite else [absorbed]
        if self.forward and torch.float16 in self.forward.output_dtypes:
            return [
                "a float16 forward op overflowed: run it in float32 (fmp.autocast.fixed_dtype, or an autocast "
                "override), or compute in bfloat16, whose range is float32's"
            ]
        if self.forward:
            return ["an op made inf or NaN from finite inputs: a log of 0, a division by 0, or an exploding activation"]
        return self._hints_for_backward()

    def _hints_for_backward(self) -> list[str]:
        if self.finite:  # what the backward made did not reach the gradients: nothing for the step to fix
            return []
        float16_max = torch.finfo(torch.float16).max
        backward = self.backward
        # No call of the loss function made it: fmp's cast of a float16 loss, carrying the seed.
        seed = backward is not None and not backward.op and torch.float16 in backward.output_dtypes
        if seed and self.loss_scale > float16_max:
            return [
                f"the float16 loss cannot carry the scaled gradient seed ({self.loss_scale:g} > {float16_max:g}): "
                "reduce the loss in float32 (a policy's output=float32) or start from a smaller init_scale"
            ]
        if self.backward and self.loss_scale > 1:
            return [
                "the scaled backward pass overflowed: a DynamicLossScale backs off and retries; if it "
                "keeps overflowing at its minimum scale, run that op in float32 or compute in bfloat16"
            ]
        return []


def _origin(found: Found | None, modules: ModuleStack) -> NonFiniteOrigin | None:
    if found is None:
        return None
    module = "" if found.module is None else modules.name_of(found.module)
    module_type = "" if found.module is None else type(found.module).__name__
    op, node, _, made, held, inputs, outputs, largest = found
    return NonFiniteOrigin(op, node, module, module_type, made, held, inputs, outputs, largest)


def _nonfinite_paths(tree: Any, name: str) -> tuple[str, ...]:
    pairs = pytree.tree_flatten_with_path(tree)[0]
    return tuple(f"{name}{pytree.keystr(p)}" for p, x in pairs if kinds(floating([x])))


# Never traced: called inside a compiled function, it breaks the graph and runs eagerly, the loss
# function it calls included (a graph break alone would leave that one to Dynamo, under the watch).
@torch.compiler.disable  # type: ignore[untyped-decorator]
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
    scaled backward pass did, with the module that ran it. `fmp.remat` blocks run as they are,
    so their ops are watched too. Module names come from global forward hooks, registered for
    the call and acting on this thread only.

    Nothing the caller holds is updated: params and scaler are read, tensors in `args` are copied
    first (running statistics passed there do not move), what the run does to the buffers of the
    modules that run is undone after (a train-mode BatchNorm's statistics are put back, a buffer the
    forward replaces or adds is put back or removed), and random ops draw from torch's generators,
    whose states (CPU, and the CUDA devices of the params and args) are restored after. To draw a
    step's dropout mask, seed them as they were before that step.

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

    Called inside a `torch.compile`d function it runs eagerly (`torch.compiler.disable`): the
    graph breaks there, which `fullgraph=True` refuses.

    Raises:
        RuntimeError: Under a `torch.func` transform.
        TypeError, ValueError: As the step raises them: if `policy` or `scaler` is of the wrong
            type (or a tuple, or an ensemble's), a leaf of `params` is not a floating tensor in
            the param dtype that autograd does not track, `loss_fn` does not return a 0-dim
            floating loss (and aux), or the loss reads a module's own parameters.
    """
    if torch.compiler.is_compiling() or torch._C._functorch.get_interpreter_stack():
        raise RuntimeError(
            "fmp.debug.locate_nonfinite is a debugging tool that reads every op's output: call it eagerly"
        )
    check_callable("locate_nonfinite's loss_fn", loss_fn)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy (e.g. fmp.get_policy('c=bf16')), got {type(policy).__name__}")
    if isinstance(scaler, tuple):
        raise TypeError(
            "locate_nonfinite takes one scaler: for several losses, locate each one's overflow with "
            "lambda params, *args: loss_fn(params, *args)[i] and scaler=state.scaler[i]"
        )
    scaler = NoOpLossScale() if scaler is None else scaler
    check_scaler(scaler)  # a stacked ensemble's is refused: locate one member's overflow at a time
    check_bool("has_aux", has_aux)
    check_params(params, policy)
    tracked = pytree.tree_map(lambda x: x.detach().requires_grad_(), params)
    # Copies, so running statistics passed in do not move; the generators are restored after,
    # torch's own and those passed in `args` alike.
    copied = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args)
    generators = [(g, g.get_state()) for g in pytree.tree_leaves(args) if isinstance(g, torch.Generator)]
    tensors = [x for x in pytree.tree_leaves((params, args)) if isinstance(x, torch.Tensor)]
    cuda = sorted({x.device.index or 0 for x in tensors if x.device.type == "cuda"})
    modules = ModuleStack()
    forward = ForwardWatch(modules)
    leaves, spec = pytree.tree_flatten(tracked)
    backward = None
    with torch.random.fork_rng(devices=cuda), calling_plainly(), torch.enable_grad():
        try:
            with modules.hooked(), forward:
                out = with_policy(loss_fn, policy)(tracked, *copied)
            loss = _loss_of(out, has_aux)
            forward.note_function_outputs(floating(loss), None)  # a custom Function's output as the loss
            check_reads_no_module_parameters(loss, copied)
            scaled = scaler.scale(loss)
            scaled_grads: tuple[torch.Tensor | None, ...] = (None,) * len(leaves)
            if scaled.requires_grad:
                backward = BackwardWatch(scaled.grad_fn, forward.labels)
                try:
                    scaled_grads = torch.autograd.grad(scaled, leaves, allow_unused=True)
                finally:
                    backward.remove()
        finally:
            # After the backward pass, which may read the buffers as the forward saved them (eval-mode norms).
            modules.restore_buffers()
            for generator, generator_state in generators:
                generator.set_state(generator_state)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(scaled_grads, leaves, strict=True)]
    unscaled = scaler.unscale(pytree.tree_unflatten(grads, spec))
    return NonFiniteReport(
        loss=float(loss.detach()),
        loss_scale=float(scaler.loss_scale),
        nonfinite_inputs=_nonfinite_paths(params, "params") + _nonfinite_paths(args, "args"),
        forward=_origin(forward.found, modules),
        backward=_origin(backward.found if backward else None, modules),
        nonfinite_grads=_nonfinite_paths(unscaled, "params"),
    )


def _loss_of(out: Any, has_aux: bool) -> torch.Tensor:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"with has_aux=True, loss_fn must return (loss, aux), got {type(out).__name__}")
        out = out[0]
    if not (isinstance(out, torch.Tensor) and out.dim() == 0 and out.is_floating_point()):
        raise TypeError(f"loss_fn must return a 0-dim floating loss, got {out!r}")
    return out
