"""The mixed-precision training step: cast, scale, differentiate, unscale, check, update, adjust.

Everything here is a pure function of its arguments (unless the caller donates the state, see
`train_step`) and reads no tensor value on the host, so a step compiles whole under
`torch.compile(fullgraph=True)` and maps under `torch.func.vmap`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import TypeVar
from typing import cast

import torch

import fmp._pytree as pytree
from fmp._accumulate import GradientAccumulator
from fmp._checks import check_bool
from fmp._donation import check_distinct
from fmp._donation import copy_aliases
from fmp._donation import donate_into
from fmp._donation import select_into
from fmp._donation import writes_in_place
from fmp._fp8_step import advance_fp8
from fmp._fp8_step import check_fp8_step
from fmp._fp8_step import check_reduced_amaxes
from fmp._fp8_step import has_fp8_states
from fmp._fp8_step import with_fp8_scales
from fmp._grad import Gradients
from fmp._grad import LossFn
from fmp._grad import differentiate
from fmp._grad_checks import check_grad_arguments
from fmp._loss_scale import DynamicLossScale
from fmp._loss_scale import LossScale
from fmp._loss_scale import scale_in_range
from fmp._model_state import has_model_state
from fmp._model_state import returning_model_state
from fmp._model_state import settle_model_state
from fmp._norm import global_norm
from fmp._optimizer import Optimizer
from fmp._policy import Policy
from fmp._scale_checks import ScalerTree
from fmp._scaler import adjust_each
from fmp._scaler import loss_scales
from fmp._scaler import per_loss
from fmp._state import StepCounts
from fmp._state import TrainState
from fmp._state import check_model_state
from fmp._state import check_optimizer
from fmp._struct import serializable_namedtuple
from fmp._tree import all_finite
from fmp._tree import check_finite_flag
from fmp._tree import select_tree
from fmp._tree import tree_accelerator_device

__all__ = ["StepInfo", "mixed_precision_step", "train_step"]

Params = TypeVar("Params")


@serializable_namedtuple
class StepInfo(NamedTuple):
    """What a training step reports, for logging; all on device.

    Attributes:
        loss: The unscaled loss (of this micro-batch), in the policy's output dtype; a tuple of
            them for several losses.
        applied: 0-dim bool tensor: True when this call updated the params. With gradient
            accumulation only the last micro-batch of a window can apply the update.
        grads_finite: 0-dim bool tensor: True when this call's gradients were finite and every
            loss scale was in range (without accumulation, the same as `applied` unless the
            update check rejected the update).
        loss_scale: The scale this call's gradients were computed with; a tuple of them for a
            tuple of scalers.
        grad_norm: With `train_step(..., grad_norm=True)`, the global L2 norm of the unscaled
            gradients the optimizer's update received (`fmp.optim.global_norm`, what
            `clip_grad_norm_` returns, before any clipping), non-finite when they overflowed;
            with accumulation, that of the window's sums so far over its length (on the
            window's last call, the mean gradient it updates with). Otherwise `()`, as `aux`.
        aux: The loss function's auxiliary output; `()` (no leaves, so vmap can return it) unless `has_aux`.
    """

    loss: Any
    applied: torch.Tensor
    grads_finite: torch.Tensor
    loss_scale: Any
    grad_norm: torch.Tensor | tuple[()]
    aux: Any


def _at_min_scale(scaler: LossScale) -> torch.Tensor | bool:
    """Whether backing off can no longer lower the scale: a dynamic scale at `min_scale`, or any fixed one."""
    if isinstance(scaler, DynamicLossScale):
        return scaler.loss_scale <= scaler.min_scale
    return True


def _stalled(scaler: ScalerTree, finite_per_loss: Any) -> torch.Tensor:
    """Whether a loss overflowed with its scale at the minimum (computed for every call, used on skips).

    A scale out of range fails the comparison (NaN) or passes it (0, negative): `bad_scale` names such
    steps apart.
    """
    if not isinstance(scaler, tuple):
        return ~finite_per_loss & _at_min_scale(scaler)  # type: ignore[no-any-return]
    flags = [~finite & _at_min_scale(s) for s, finite in zip(scaler, per_loss(finite_per_loss), strict=True)]
    return functools.reduce(operator.or_, flags)  # type: ignore[no-any-return]


def _with_scales_in_range(
    scaler: ScalerTree, gradients: Gradients
) -> tuple[Gradients, torch.Tensor, tuple[torch.Tensor, ...]]:
    """`gradients` with each loss's flag False where its scale is out of range, whether any was, and each's range.

    Such a scale (NaN, inf, 0, negative: a crafted or corrupted state) made gradients that mean
    nothing, even where finite (a negative scale), so the step is skipped and the adjust resets it.
    """
    if not isinstance(scaler, tuple):  # one loss: the same flags, without the tuples
        one_in_range = scale_in_range(scaler)
        finite = gradients.finite_per_loss & one_in_range
        one_flag = gradients.finite_per_loss is gradients.grads_finite  # then one op serves both
        grads_finite = finite if one_flag else gradients.grads_finite & one_in_range
        return gradients._replace(grads_finite=grads_finite, finite_per_loss=finite), ~one_in_range, (one_in_range,)
    in_range = tuple(scale_in_range(s) for s in scaler)
    finite = tuple(f & r for f, r in zip(per_loss(gradients.finite_per_loss), in_range, strict=True))
    # Chained with &, not stacked: a NoOpLossScale's flag is a CPU tensor beside accelerator ones.
    all_in_range = functools.reduce(operator.and_, in_range)
    grads_finite = gradients.grads_finite & all_in_range
    return gradients._replace(grads_finite=grads_finite, finite_per_loss=finite), ~all_in_range, in_range


def _check_finite_per_loss(finite_per_loss: Any, scaler: Any) -> None:
    """Raises unless `reduce_grads` kept `finite_per_loss`'s structure: one flag per scaler of the state."""
    if isinstance(scaler, tuple):
        if isinstance(finite_per_loss, tuple) and len(finite_per_loss) == len(scaler):
            return
        expected = f"a tuple of {len(scaler)} flags, one per scaler of state.scaler"
    elif isinstance(finite_per_loss, torch.Tensor):
        return
    else:
        expected = "one flag (a 0-dim bool tensor), as state.scaler is one scaler"
    got = f"a tuple of {len(finite_per_loss)}" if isinstance(finite_per_loss, tuple) else type(finite_per_loss).__name__
    raise TypeError(f"reduce_grads' finite_per_loss must be {expected}, got {got}")


def train_step(
    loss_fn: LossFn,
    state: TrainState,
    *args: Any,
    policy: Policy,
    optimizer: Optimizer,
    has_aux: bool = False,
    donate: bool = False,
    reduce_grads: Callable[[Gradients], Gradients] | None = None,
    grad_norm: bool = False,
    check_update: bool = False,
) -> tuple[TrainState, StepInfo]:
    """One mixed-precision optimizer step; skipped (state kept bit for bit) when gradients overflow.

    Runs `loss_fn` in the policy's compute dtype, differentiates the scaled loss, unscales the
    gradients and checks them for finiteness after unscaling. On a finite step the optimizer's
    update is applied; on a non-finite one the params and optimizer state come back bit for bit and
    only the scaler moves (it backs off). The choice is a `torch.where`, never a host sync, so the
    step compiles whole with `torch.compile(fullgraph=True)` and maps under `torch.func.vmap`.
    `state.counts` counts applied and skipped steps on device, and the optimizer's step count
    (hence its schedule) advances on applied steps only.

    With a tuple of scalers, `loss_fn` returns as many losses, each scaled and checked on its own
    ([Several losses](../how-to/several-losses.md)). With `TrainState.create(...,
    accumulation_steps=k)` each call takes one micro-batch and the k-th call updates
    ([Gradient accumulation](../how-to/accumulation.md)). With `donate=True` the caller hands over
    `state` and must not read it again: the step may write the new values into its buffers
    ([Performance and memory tuning](../how-to/performance-tuning.md)). Do not donate under
    `torch.func` transforms, and list tied weights once.

    A loss scale out of range (NaN, inf, 0, negative: a crafted or corrupted state) skips the step,
    counts as stalled (`counts.bad_scale`) and is put back in range by the scaler's `adjust`. With
    `check_update=True` the update is checked too: a step whose gradients are finite but whose new
    params or optimizer state are not (a NaN in Adam's moments, an update that overflows a 16-bit
    param) is skipped the same way, except that the scale does not back off (the gradients were
    fine, so the scaler counts a finite step); it counts as skipped and as stalled
    (`counts.bad_update`), since backing off cannot help.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss`, or `-> (loss, aux)` with `has_aux`; loss 0-dim,
            or a tuple of 0-dim losses, one per scaler. With model state in `state.model_state`
            (`TrainState.create(..., model_state=buffers)`), `loss_fn(params, model_state,
            *args) -> (out, new_model_state)`, `out` being what it would return otherwise: it
            gets a copy of the model state to update (`fmp.nn.call` returns a module's updated
            buffers) and the step returns what it gives back, on skipped steps too, as
            BatchNorm's running statistics move under torch.amp.
        state: The training state, from `TrainState.create`.
        *args: Further arguments of `loss_fn` (with accumulation, one micro-batch).
        policy: The precision policy.
        optimizer: A pure optimizer, e.g. `fmp.optim.adamw(...)`.
        has_aux: Whether `loss_fn` returns `(loss, aux)`.
        donate: Whether the step may overwrite the tensors of `state` (as `jax.jit`'s `donate_argnums`).
        reduce_grads: Applied to each call's `Gradients` before they are accumulated or used, e.g.
            to average them across data-parallel ranks (`fmp.distributed`); it must return
            `Gradients` of the same structure, flags that every rank agrees on and, with FP8
            states, `amaxes` (their maximum over the ranks).
        grad_norm: Whether to report the gradients' global norm in `info.grad_norm`. Compiled
            for a CPU, Inductor takes it in the loop that checks the gradients; eager, it reads
            them once more.
        check_update: Whether to skip a step whose new params or optimizer state are not finite:
            one `all_finite` over the new tree, ANDed with the gradients' flag, no host sync.
            Opt-in: the select that keeps or replaces the state then waits for a reduction over
            the whole update, so a compiled step holds the update in a temporary (with `donate`,
            one more copy of the params and optimizer state) and reads it once more;
            benchmarks/RESULTS.md has its cost. Without it such an update is applied.

    Returns:
        `(new_state, info)`; `info.applied` says whether the update was applied.

    Raises:
        TypeError: If `state` is not a TrainState (or its counts not StepCounts of 0-dim int64
            tensors), `optimizer` not an Optimizer, or `donate`, `grad_norm` or `check_update`
            not a bool.
        ValueError: If `donate` and the state lists one tensor twice (under torch.compile Dynamo
            reports it as `torch._dynamo.exc.Unsupported` carrying this message) or, eager, two of
            its tensors share elements (one a view of the other), or the scaler
            or the counts are on another device than the params (their first accelerator).
    """
    check_bool("donate", donate)
    check_bool("grad_norm", grad_norm)
    check_bool("check_update", check_update)
    if reduce_grads is not None and not callable(reduce_grads):
        raise TypeError(f"reduce_grads must be a function of fmp.Gradients, got {type(reduce_grads).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an fmp.TrainState (TrainState.create(...)), got {type(state).__name__}")
    check_optimizer(optimizer)
    if not isinstance(state.counts, StepCounts):
        got = type(state.counts).__name__
        raise TypeError(f"state.counts must be an fmp.StepCounts (TrainState.create makes one), got {got}")
    donated_leaves = check_distinct(state, "state") if donate else []  # checked before anything is written
    params, opt_state, scaler, model_state = state.params, state.opt_state, state.scaler, state.model_state
    fp8 = has_fp8_states(state.fp8)
    check_grad_arguments(loss_fn, scaler, policy, has_aux)
    check_fp8_step(loss_fn, state.fp8, policy)
    # With FP8 states, the step differentiates (params, scales): the scales' gradients are the amaxes.
    loss_fn, differentiated = with_fp8_scales(loss_fn, params, state.fp8) if fp8 else (loss_fn, params)
    if has_model_state(model_state):
        check_model_state(model_state)
        stateful = returning_model_state(loss_fn, has_aux)
        gradients = differentiate(
            stateful, differentiated, scaler, (model_state, *args), policy=policy, has_aux=True, fp8_scales=fp8
        )
        aux, new_model_state = gradients.aux
        new_model_state = settle_model_state(new_model_state, model_state)
        gradients = gradients._replace(aux=aux)
    else:
        gradients = differentiate(loss_fn, differentiated, scaler, args, policy=policy, has_aux=has_aux, fp8_scales=fp8)
        new_model_state = model_state
    state.counts.check(gradients.grads_finite.device)  # where the params are (their first accelerator)
    if reduce_grads is not None:
        gradients = reduce_grads(gradients)
        if not isinstance(gradients, Gradients):
            raise TypeError(f"reduce_grads must return fmp.Gradients, got {type(gradients).__name__}")
        _check_finite_per_loss(gradients.finite_per_loss, state.scaler)
        check_finite_flag(gradients.grads_finite, "reduce_grads' grads_finite")
        for index, flag in enumerate(pytree.tree_leaves(gradients.finite_per_loss)):
            check_finite_flag(flag, f"reduce_grads' finite_per_loss[{index}]")
        if fp8:
            check_reduced_amaxes(gradients.amaxes, state.fp8)
    gradients, bad_scale, in_range = _with_scales_in_range(scaler, gradients)
    grads, grads_finite, loss, aux, finite_per_loss, amaxes = gradients
    accumulator = state.accumulator
    if isinstance(accumulator, GradientAccumulator):
        window = accumulator.add(grads, grads_finite, finite_per_loss)
        stepped, grads, window_finite, step_per_loss, accumulator = window
        applied = stepped & window_finite
        # The scale stays fixed inside a window and adjusts once, by the whole window's flags.
        new_scaler = select_tree(stepped, adjust_each(scaler, step_per_loss, in_range), scaler)
    elif accumulator == ():
        stepped, applied, step_per_loss = None, grads_finite, finite_per_loss  # every call steps
        new_scaler = adjust_each(scaler, finite_per_loss, in_range)
    else:
        raise TypeError(f"state.accumulator must be () or a GradientAccumulator, got {type(accumulator).__name__}")
    norm: torch.Tensor | tuple[()] = global_norm(grads).to(grads_finite.device) if grad_norm else ()
    bad_update = None  # unless the update is checked
    # An optimizer with a masked update skips by itself (a fused kernel's found_inf): no select after it.
    masked_update = None if check_update else optimizer.masked_update
    updated: Any = optimizer.update(grads, opt_state, params) if masked_update is None else None
    if check_update:
        update_finite = all_finite(updated)
        bad_update = applied & ~update_finite
        applied = applied & update_finite
    # Only the params and the optimizer state are written eagerly: the rest of the state does not decide.
    writes_eagerly = donate and writes_in_place(updated if masked_update is None else grads, (params, opt_state))
    if writes_eagerly or (donate and torch.compiler.is_compiling()):
        # The loss, aux and model state the step returns keep their values when the state's buffers
        # are written (a loss function may hand back a param, or a view of one, in either).
        loss, aux, new_model_state = copy_aliases((loss, aux, new_model_state), donated_leaves)
    if masked_update is not None:
        new_params, new_opt_state = masked_update(grads, opt_state, params, applied, writes_eagerly)
    elif writes_eagerly:
        new_params, new_opt_state = select_into(applied, updated, (params, opt_state))
    else:
        new_params, new_opt_state = select_tree(applied, updated, (params, opt_state))
    counts = state.counts.advance(stepped, applied, _stalled(scaler, step_per_loss), bad_scale, bad_update)
    new_fp8 = advance_fp8(state.fp8, amaxes, applied, stepped) if fp8 else state.fp8
    # Model state moves on a skipped step too, as a module's buffers do under torch.amp.
    new_state = TrainState(new_params, new_opt_state, new_scaler, counts, accumulator, new_model_state, new_fp8)
    loss_scale = loss_scales(scaler, grads_finite.device)
    if donate:
        # The donated scalers' buffers receive the new scales.
        loss_scale = pytree.tree_map(torch.clone, loss_scale)
        new_state = donate_into(state, new_state)
    return new_state, StepInfo(loss, applied, grads_finite, loss_scale, norm, aux)


def mixed_precision_step(
    loss_fn: LossFn,
    params: Params,
    scaler: LossScale,
    *args: Any,
    policy: Policy,
    optimizer: Optimizer,
    donate: bool = False,
    check_update: bool = False,
) -> tuple[Params, LossScale]:
    """One mixed-precision step with a stateless optimizer: `(params, scaler) -> (params, scaler)`.

    The short form of `train_step` for optimizers that keep no state (e.g. `fmp.optim.sgd(lr)`).
    Stateful optimizers need `train_step`, which threads their state through. Create `scaler` on the
    params' device (`DynamicLossScale.create(device=...)`): its state follows the gradients there.

    Args:
        loss_fn: `loss_fn(params, *args) -> 0-dim loss`.
        params: The parameters, a pytree of tensors.
        scaler: The loss-scale state.
        *args: Further arguments of `loss_fn`.
        policy: The precision policy.
        optimizer: A stateless pure optimizer.
        donate: Whether the step may overwrite `params` and `scaler` (see `train_step`).
        check_update: Whether to skip a step whose new params are not finite (see `train_step`).

    Returns:
        `(new_params, new_scaler)`.

    Raises:
        TypeError: If `optimizer` is not an fmp Optimizer (and as `train_step`).
        ValueError: If the optimizer keeps state, or (with `donate`) a tensor is listed twice.
    """
    check_optimizer(optimizer)
    opt_state = optimizer.init(params)
    if pytree.tree_leaves(opt_state):
        raise ValueError(
            "mixed_precision_step takes a stateless optimizer; this one keeps state "
            "(momentum, moments): use fmp.train_step with fmp.TrainState.create(params, optimizer, scaler)"
        )
    state = TrainState(params, opt_state, scaler, StepCounts.zeros(tree_accelerator_device(params)), ())
    new_state, _ = train_step(
        loss_fn, state, *args, policy=policy, optimizer=optimizer, donate=donate, check_update=check_update
    )
    return new_state.params, cast(LossScale, new_state.scaler)
