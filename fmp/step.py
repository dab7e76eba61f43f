"""The mixed-precision training step: cast, scale, differentiate, unscale, check, update, adjust.

Everything here is a pure function of its arguments (unless the caller donates the state, see
`train_step`) and reads no tensor value on the host, so a step compiles whole under
`torch.compile(fullgraph=True)` and maps under `torch.func.vmap`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import TypeVar

import torch
import torch.utils._pytree as pytree

from fmp._checks import check_bool
from fmp.loss_scale import LossScale
from fmp.loss_scale import check_scaler
from fmp.optim._base import Optimizer
from fmp.policy import Policy
from fmp.tree import all_finite
from fmp.tree import donate_into
from fmp.tree import select_tree
from fmp.tree import tree_device

__all__ = ["Gradients", "StepInfo", "TrainState", "mixed_precision_grad", "mixed_precision_step", "train_step"]

Params = TypeVar("Params")
LossFn = Callable[..., Any]


class Gradients(NamedTuple):
    """What `mixed_precision_grad` returns.

    Attributes:
        grads: Unscaled gradients in the parameters' structure and dtype.
        grads_finite: 0-dim bool tensor, True when every gradient is finite after unscaling.
        loss: The unscaled loss, in the policy's output dtype.
        aux: The loss function's auxiliary output; `()` (no leaves, so vmap can return it) unless `has_aux`.
    """

    grads: Any
    grads_finite: torch.Tensor
    loss: torch.Tensor
    aux: Any


class StepInfo(NamedTuple):
    """What a training step reports, for logging; all on device.

    Attributes:
        loss: The unscaled loss, in the policy's output dtype.
        grads_finite: 0-dim bool tensor: True when the update was applied, False when skipped.
        loss_scale: The scale the step's gradients were computed with.
        aux: The loss function's auxiliary output; `()` (no leaves, so vmap can return it) unless `has_aux`.
    """

    loss: torch.Tensor
    grads_finite: torch.Tensor
    loss_scale: torch.Tensor
    aux: Any


class TrainState(NamedTuple):
    """Everything a training step updates: parameters, optimizer state, loss-scale state.

    Attributes:
        params: The parameters, a pytree of tensors in the policy's param dtype.
        opt_state: The optimizer's state.
        scaler: The loss-scale state.
    """

    params: Any
    opt_state: Any
    scaler: LossScale

    @classmethod
    def create(cls, params: Any, optimizer: Optimizer, scaler: LossScale) -> TrainState:
        """Builds the state for `params`: initialises the optimizer, puts the scaler on their device.

        Args:
            params: The parameters, a pytree of tensors.
            optimizer: A pure optimizer, e.g. `fmp.optim.adamw(...)`.
            scaler: The loss-scale state; its tensors move to the device of the first parameter, so
                a compiled step sees one device from the first call on.

        Returns:
            The state.
        """
        _check_optimizer(optimizer)
        check_scaler(scaler)
        _check_no_module_parameters(params)
        device = tree_device(params)
        if device is not None:
            scaler = pytree.tree_map(lambda t: t.to(device), scaler)
        return cls(params, optimizer.init(params), scaler)


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be an fmp.optim.Optimizer (e.g. fmp.optim.adamw()), got {type(optimizer).__name__}"
        )


def _check_no_module_parameters(params: Any) -> None:
    for path, leaf in pytree.tree_flatten_with_path(params)[0]:
        if isinstance(leaf, torch.nn.Parameter):
            raise TypeError(
                f"params{pytree.keystr(path)} is an nn.Parameter: autograd would chain every step's graph onto "
                f"the last (a memory leak); pass {{k: v.detach() for k, v in model.named_parameters()}}"
            )


def _check_params(params: Any, policy: Policy) -> None:
    """Every parameter is differentiated, so each must be a floating tensor in the param dtype."""
    _check_no_module_parameters(params)
    for path, leaf in pytree.tree_flatten_with_path(params)[0]:
        where = f"params{pytree.keystr(path)}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where} is a {type(leaf).__name__}; every leaf of params must be a tensor")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{where} is {leaf.dtype}; every leaf of params is differentiated, "
                f"so pass integer buffers (e.g. num_batches_tracked) through *args instead"
            )
        if leaf.is_floating_point() and leaf.dtype != policy.param_dtype:
            raise TypeError(
                f"{where} is {leaf.dtype} but the policy stores params in {policy.param_dtype}; "
                f"cast them with policy.cast_to_param(params) or choose another policy"
            )


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar (0-dim) loss, got shape {tuple(loss.shape)}; reduce it, e.g. with .mean()"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating-point loss, got {loss.dtype}")
    return loss


def _check_aux(aux: Any) -> None:
    for path, leaf in pytree.tree_flatten_with_path(aux)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"aux{pytree.keystr(path)} is a {type(leaf).__name__}; aux must be a pytree of tensors")


def mixed_precision_grad(
    loss_fn: LossFn, params: Any, scaler: LossScale, *args: Any, policy: Policy, has_aux: bool = False
) -> Gradients:
    """Computes unscaled gradients of `loss_fn` under a precision policy and a loss scale.

    Params and floating-point args are cast to the compute dtype, the loss to the output dtype; the
    loss is scaled and differentiated with `torch.func.grad`. Gradients come back in the param dtype
    (autograd returns each in its parameter's dtype), are unscaled, and are checked for finiteness
    after unscaling, so a gradient that overflows only when unscaled is caught too.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss`, or `-> (loss, aux)` with `has_aux`; loss 0-dim.
        params: The parameters, a pytree of floating tensors in the policy's param dtype.
        scaler: The loss-scale state.
        *args: Further arguments of `loss_fn` (inputs, targets, ...).
        policy: The precision policy.
        has_aux: Whether `loss_fn` returns `(loss, aux)`, aux a pytree of tensors.

    Returns:
        A `Gradients` tuple.

    Raises:
        TypeError, ValueError: Naming the problem, if `loss_fn` returns anything but a 0-dim floating
            loss (and a tensor aux), a parameter is not a floating tensor in the param dtype, or
            `scaler` or `policy` is of the wrong type.
    """
    check_scaler(scaler)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy (e.g. fmp.get_policy('c=bf16')), got {type(policy).__name__}")
    _check_params(params, policy)

    def scaled_loss_fn(params: Any, *args: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, Any]]:
        out = loss_fn(policy.cast_to_compute(params), *policy.cast_to_compute(args))
        aux: Any = ()  # no leaves: torch.func.grad's aux must hold tensors only
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"with has_aux=True, loss_fn must return (loss, aux), got {type(out).__name__}")
            out, aux = out
            _check_aux(aux)
        loss = policy.cast_to_output(_check_loss(out))
        return scaler.scale(loss), (loss, aux)

    scaled_grads, (loss, aux) = torch.func.grad(scaled_loss_fn, has_aux=True)(params, *args)
    grads = scaler.unscale(scaled_grads)
    return Gradients(grads, all_finite(grads), loss, aux)


def train_step(
    loss_fn: LossFn,
    state: TrainState,
    *args: Any,
    policy: Policy,
    optimizer: Optimizer,
    has_aux: bool = False,
    donate: bool = False,
) -> tuple[TrainState, StepInfo]:
    """One mixed-precision optimizer step; skipped (state kept bit for bit) when gradients overflow.

    On a non-finite step the returned params and optimizer state equal the inputs bit for bit and
    only the scaler moves (it backs off). Without `donate`, inputs are never mutated.

    Donation, as `jax.jit`'s `donate_argnums`: with `donate=True` the caller hands over `state`
    and must not read it after the call. Under `torch.compile` the step then writes the new values
    into its buffers instead of allocating new ones (the returned state lives in the same
    buffers), which saves the allocation, the page faults of fresh memory on CPU, and peak memory;
    with the state's tensors marked static (`torch._dynamo.mark_static_address`) the step replays
    as CUDA graphs under `mode="reduce-overhead"`. Params made with `v.detach()` share their
    module's storage, so donating them updates the module too. Eager, `donate` changes nothing. The
    values are those of the pure step: bit for bit in float32 compute, and in 16-bit compute when
    Inductor rounds intermediates as eager does (`options={"emulate_precision_casts": True}`);
    otherwise Inductor's fusions skip 16-bit roundings differently in the two graphs. Do not donate
    under `torch.func` transforms (`grad`, `vmap`), which need the inputs intact.

    Args:
        loss_fn: `loss_fn(params, *args) -> loss`, or `-> (loss, aux)` with `has_aux`; loss 0-dim.
        state: Params, optimizer state and scaler state.
        *args: Further arguments of `loss_fn`.
        policy: The precision policy.
        optimizer: A pure optimizer, e.g. `fmp.optim.adamw(...)`.
        has_aux: Whether `loss_fn` returns `(loss, aux)`.
        donate: Whether the step may overwrite the tensors of `state` (see above).

    Returns:
        `(new_state, info)`; `info.grads_finite` says whether the update was applied.

    Raises:
        TypeError: If `state` is not a TrainState, `optimizer` not an Optimizer or `donate` not a bool.
        ValueError: If `donate` and the state lists one tensor twice (under torch.compile Dynamo
            reports it as `torch._dynamo.exc.Unsupported` carrying this message).
    """
    check_bool("donate", donate)
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an fmp.TrainState (TrainState.create(...)), got {type(state).__name__}")
    _check_optimizer(optimizer)
    params, opt_state, scaler = state
    grads, grads_finite, loss, aux = mixed_precision_grad(
        loss_fn, params, scaler, *args, policy=policy, has_aux=has_aux
    )
    updated = optimizer.update(grads, opt_state, params)
    new_params, new_opt_state = select_tree(grads_finite, updated, (params, opt_state))
    new_state = TrainState(new_params, new_opt_state, scaler.adjust(grads_finite))
    loss_scale = scaler.loss_scale
    if donate:
        loss_scale = loss_scale.clone()  # the donated scaler's buffer receives the new scale
        new_state = donate_into(state, new_state, "state")
    return new_state, StepInfo(loss, grads_finite, loss_scale, aux)


def mixed_precision_step(
    loss_fn: LossFn,
    params: Params,
    scaler: LossScale,
    *args: Any,
    policy: Policy,
    optimizer: Optimizer,
    donate: bool = False,
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

    Returns:
        `(new_params, new_scaler)`.

    Raises:
        TypeError: If `optimizer` is not an fmp Optimizer (and as `train_step`).
        ValueError: If the optimizer keeps state, or (with `donate`) a tensor is listed twice.
    """
    _check_optimizer(optimizer)
    opt_state = optimizer.init(params)
    if pytree.tree_leaves(opt_state):
        raise ValueError(
            "mixed_precision_step takes a stateless optimizer; this one keeps state "
            "(momentum, moments): use fmp.train_step with fmp.TrainState.create(params, optimizer, scaler)"
        )
    new_state, _ = train_step(
        loss_fn, TrainState(params, opt_state, scaler), *args, policy=policy, optimizer=optimizer, donate=donate
    )
    return new_state.params, new_state.scaler
