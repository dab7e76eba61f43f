"""Mixed-precision gradients: cast per policy, scale, differentiate, unscale, check for finiteness.

One loss takes one scaler; several losses (apex's `num_losses`) take a tuple of scalers, one per
loss, and each loss's gradients are unscaled and checked on their own, so each scaler adjusts by
its own overflow. Nothing here reads a tensor's value on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import cast

import torch

import fmp._pytree as pytree
from fmp._backward import Differentiated
from fmp._backward import check_reads_no_module_parameters
from fmp._backward import grad_and_aux
from fmp._checks import check_callable
from fmp._grad_checks import check_aux
from fmp._grad_checks import check_grad_arguments
from fmp._grad_checks import check_losses
from fmp._grad_checks import check_params
from fmp._grad_checks import warn_unless_depends_on_params
from fmp._policy import Policy
from fmp._scale_checks import ScalerTree
from fmp._scaler import loss_scales
from fmp._scaler import owned_all_finite
from fmp._scaler import unscale_and_check
from fmp._struct import serializable_namedtuple
from fmp._tree import check_on_device
from fmp.autocast._transform import autocast
from fmp.autocast._transform import autocast_on_table

__all__ = ["Gradients", "LossFn", "differentiate", "mixed_precision_grad", "with_policy"]

LossFn = Callable[..., Any]


@serializable_namedtuple
class Gradients(NamedTuple):
    """What `mixed_precision_grad` returns.

    Attributes:
        grads: Unscaled gradients in the parameters' structure and dtype (summed over the losses).
        grads_finite: 0-dim bool tensor, True when every gradient is finite after unscaling.
        loss: The unscaled loss in the policy's output dtype; a tuple of them for several losses.
        aux: The loss function's auxiliary output; `()` (no leaves, so vmap can return it) unless `has_aux`.
        finite_per_loss: The flag each scaler adjusts by: `grads_finite` for one scaler, and for a
            tuple of scalers a tuple of flags, one per loss, each True when that loss's own
            unscaled gradients, and their sum, are finite.
        amaxes: With FP8 delayed-scaling states in the step (`TrainState.fp8`), this step's
            amaxes of each layer's input, weight and output gradient, in `TrainState.fp8`'s
            structure: a data-parallel `reduce_grads` takes their maximum over the ranks.
            `()` otherwise.
    """

    grads: Any
    grads_finite: torch.Tensor
    loss: Any
    aux: Any
    finite_per_loss: Any
    amaxes: Any = ()


def _combined(trees: list[Any], op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """The trees' leaves combined leaf by leaf with `op` (`torch.add`: their sum)."""
    return pytree.tree_map(lambda *xs: functools.reduce(op, xs), *trees)


def with_policy(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """`fn(params, *args)` run as the step runs `loss_fn`, for evaluation with the training numerics.

    In the compute dtype by the policy's rules (op by op under `fmp.autocast`, or with params and
    floating args cast whole when `policy.rules` is None), its floating outputs cast to the output
    dtype: a loss evaluated this way on the params a step saw equals that step's `info.loss` bit for
    bit. With a float32 compute dtype only floating params and args in another dtype are cast.

    Args:
        fn: `fn(params, *args) -> outputs`, e.g. the loss function or the model's forward.
        policy: The precision policy.

    Returns:
        The wrapped function.
    """
    check_callable("with_policy's fn", fn)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy (e.g. fmp.get_policy('c=bf16')), got {type(policy).__name__}")
    forward = _forward(fn, policy)

    @functools.wraps(fn)
    def run(params: Any, *args: Any) -> Any:
        return policy.cast_to_output(forward(params, *args))

    return run


def _forward(loss_fn: LossFn, policy: Policy) -> LossFn:
    """`loss_fn` under the policy's compute dtype: op by op with rules, else with params and args cast whole."""
    if policy.casts_by_op:
        if policy.overrides:
            return autocast_on_table(loss_fn, policy.override_table())
        return autocast(loss_fn, policy.compute_dtype, rules=cast(str, policy.rules))

    def cast_whole(params: Any, *args: Any) -> Any:
        return loss_fn(policy.cast_to_compute(params), *policy.cast_to_compute(args))

    return cast_whole


def mixed_precision_grad(
    loss_fn: LossFn, params: Any, scaler: ScalerTree, *args: Any, policy: Policy, has_aux: bool = False
) -> Gradients:
    """Computes unscaled gradients of `loss_fn` under a precision policy and a loss scale.

    The loss function runs in the policy's compute dtype: op by op under `fmp.autocast` with the
    policy's rules (the default for 16-bit compute: matmuls in the compute dtype, softmax, norms
    and losses in float32, params and args left in their dtypes), or, with `rules=None` or a
    32/64-bit compute dtype, on params and floating args cast whole to it. The loss is cast to
    the output dtype, scaled and differentiated with `torch.func`. Gradients come back in the param dtype
    (autograd returns each in its parameter's dtype), are unscaled, and are checked for finiteness
    after unscaling, so a gradient that overflows only when unscaled is caught too.

    Several losses: with a tuple of scalers, `loss_fn` returns a tuple of as many losses. Each
    loss is differentiated on its own with its own scale (a forward and backward pass each, so an
    overflow in one loss cannot reach another's gradients), its gradients are unscaled and checked
    alone, and the returned gradients are their sum (the gradient of the summed loss). The forward
    pass runs once per loss, so it must be deterministic: dropout would draw a new mask for each
    loss, and a train-mode BatchNorm would update its running statistics once per loss. If the
    sum of finite gradients overflows, every scale backs off.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss`, or `-> (loss, aux)` with `has_aux`; loss 0-dim,
            or a tuple of 0-dim losses with a tuple of scalers.
        params: The parameters, a pytree of floating tensors in the policy's param dtype.
        scaler: The loss-scale state, or a tuple of them, one per loss.
        *args: Further arguments of `loss_fn` (inputs, targets, buffers). They enter the
            `torch.func` transform as inputs, so `loss_fn` may update them in place, as a
            train-mode BatchNorm updates running statistics passed here. A whole cast (see above)
            hands `loss_fn` copies of floating args, so such updates are lost there.
        policy: The precision policy.
        has_aux: Whether `loss_fn` returns `(loss, aux)`, aux a pytree of tensors.

    Returns:
        A `Gradients` tuple.

    Raises:
        TypeError, ValueError: Naming the problem, if `loss_fn` returns anything but 0-dim floating
            losses (one per scaler) and a tensor aux, a parameter is not a floating tensor in the
            param dtype, `scaler` or `policy` is of the wrong type, or the scaler is on another
            device than the params (their first accelerator) or stacked (outside vmap). Eager, also if the loss
            reads a module's own parameters outside `params` (a module called as `model(x)`, or
            frozen weights that still require grad), which the step would not update.
    """
    check_grad_arguments(loss_fn, scaler, policy, has_aux)
    return differentiate(loss_fn, params, scaler, args, policy=policy, has_aux=has_aux, fp8_scales=False)


def differentiate(
    loss_fn: LossFn,
    params: Any,
    scaler: ScalerTree,
    args: tuple[Any, ...],
    *,
    policy: Policy,
    has_aux: bool,
    fp8_scales: bool,
) -> Gradients:
    """`mixed_precision_grad`'s work, its arguments checked; with `fp8_scales`, over the params and FP8 scales.

    With `fp8_scales`, `params` is `(params, scales)`: the scales (float32, whatever the param
    dtype) are differentiated beside the params, `loss_fn` takes each pass's loss scale as its
    last argument (the FP8 layers quantize the output gradient by it), and the scales' gradients,
    the pass's amaxes, come back in `Gradients.amaxes`, the maximum over the losses' passes.
    """
    hint = "create it there (its create(..., device=...)), or let TrainState.create move it there"
    device = check_params(params[0], policy) if fp8_scales else check_params(params, policy)
    check_on_device(scaler, device, "scaler", "params", hint)
    scalers = scaler if isinstance(scaler, tuple) else (scaler,)
    forward = _forward(loss_fn, policy)

    def scaled_losses_fn(params: Any, *args: Any) -> tuple[tuple[torch.Tensor, ...], tuple[Any, Any]]:
        out = forward(params, *args)
        aux: Any = ()  # no leaves: torch.func's aux must hold tensors only
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"with has_aux=True, loss_fn must return (loss, aux), got {type(out).__name__}")
            out, aux = out
            check_aux(aux)
        checked = check_losses(out, scaler)
        if isinstance(scaler, tuple):
            loss = losses = tuple(map(policy.cast_to_output, checked))
        else:
            loss = policy.cast_to_output(checked)
            losses = (loss,)
        return tuple(s.scale(x) for s, x in zip(scalers, losses, strict=True)), (loss, aux)

    def grad_of_loss(index: int) -> Differentiated:
        def scaled_loss_fn(params: Any, *args: Any) -> tuple[torch.Tensor, tuple[Any, Any]]:
            scaled, loss_and_aux = scaled_losses_fn(params, *args)
            warn_unless_depends_on_params(
                scaled[index], f"loss {index}" if isinstance(scaler, tuple) else "loss", params, args
            )
            return scaled[index], loss_and_aux

        # `args` go in as inputs, not captured: torch.func refuses in-place updates of captured
        # tensors, such as a train-mode BatchNorm's running statistics passed as an argument.
        if not fp8_scales:
            return grad_and_aux(scaled_loss_fn, params, *args)
        scales_device = pytree.tree_leaves(params[1])[0].device
        return grad_and_aux(scaled_loss_fn, params, *args, loss_scales(scalers[index], scales_device))

    if not isinstance(scaler, tuple):
        scaled_grads, (loss, aux), owned = grad_of_loss(0)
        check_reads_no_module_parameters(loss, args)
        grads, grads_finite = unscale_and_check(scaler, scaled_grads, owned)
        return _split(Gradients(grads, grads_finite, loss, aux, grads_finite), fp8_scales)
    # One forward and backward pass per loss. A shared forward with one vjp per loss would send a
    # zero cotangent through the other losses' backward, where a non-finite local derivative
    # (0 * inf = NaN) would poison this loss's gradients and back its scale off for another's overflow.
    per_loss, parts_finite = [], []
    for index, s in enumerate(scalers):
        scaled_grads, (loss, aux), owned = grad_of_loss(index)
        unscaled, finite = unscale_and_check(s, scaled_grads, owned)
        per_loss.append(unscaled)
        parts_finite.append(finite)
    check_reads_no_module_parameters(loss, args)
    if fp8_scales:
        # Each pass quantized its own output gradients: the scale must cover the largest of them.
        grads = (_combined([g for g, _ in per_loss], torch.add), _combined([a for _, a in per_loss], torch.maximum))
    else:
        grads = _combined(per_loss, torch.add)
    # The sum is non-finite whenever a part is, and also when finite parts overflow on adding;
    # then no loss is to blame alone and every scale backs off.
    # With one loss the sum is that loss's gradients; with several, new tensors of the step's own.
    grads_finite = owned_all_finite(grads) if len(per_loss) > 1 else parts_finite[0]
    sum_overflowed = torch.stack(parts_finite).all() & ~grads_finite
    finite_per_loss = tuple(finite & ~sum_overflowed for finite in parts_finite)
    return _split(Gradients(grads, grads_finite, loss, aux, finite_per_loss), fp8_scales)


def _split(gradients: Gradients, fp8_scales: bool) -> Gradients:
    """With FP8 scales differentiated, the params' gradients in `grads` and the scales' (the amaxes) in `amaxes`."""
    if not fp8_scales:
        return gradients
    grads, amaxes = gradients.grads
    return gradients._replace(grads=grads, amaxes=amaxes)
