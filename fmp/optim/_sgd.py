"""Stochastic gradient descent as a pure function, numerically matching `torch.optim.SGD`."""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import torch

import fmp._pytree as pytree
from fmp._checks import check_bool
from fmp._checks import check_real
from fmp._optimizer import Optimizer
from fmp._struct import serializable_namedtuple
from fmp._tree import clone_leaves
from fmp.optim._base import LearningRate
from fmp.optim._base import check_lr
from fmp.optim._base import check_optimizable_params
from fmp.optim._base import check_schedule_start
from fmp.optim._base import check_state
from fmp.optim._base import first_sparse_gradient
from fmp.optim._base import leaves_like_params
from fmp.optim._base import scheduled_lr
from fmp.optim._base import step_counter
from fmp.optim._base import tree_zeros_like
from fmp.optim._base import unflatten_as
from fmp.optim._fused import counted_step
from fmp.optim._fused import group_by_device_and_dtype
from fmp.optim._fused import runs_fused
from fmp.optim._fused import skip_flag
from fmp.optim._fused import unfused_update

__all__ = ["SgdState", "sgd"]


@serializable_namedtuple
class SgdState(NamedTuple):
    """State of SGD with momentum, or with a learning-rate schedule.

    Attributes:
        step: Applied steps so far, a 0-dim int32 tensor (a schedule's `count`).
        momentum: The momentum buffers, shaped like the parameters; `()` without momentum.
    """

    step: torch.Tensor
    momentum: Any


def _descend(param: torch.Tensor, step: torch.Tensor, lr: float | torch.Tensor) -> torch.Tensor:
    """`param - lr * step`, rounded as torch.optim.SGD rounds it."""
    if isinstance(lr, float):
        return torch.add(param, step, alpha=-lr)
    # torch.optim's own form for a tensor lr; on CPU it rounds as add(alpha=-lr) does (one rounding
    # of the multiply-add), so float32 and float64 results are bit-identical to a float lr of that value.
    # 16-bit params are updated in float32 (opmath) with a float32 lr, where torch's CPU kernel rounds
    # a float lr to the param dtype: those results may differ from torch's by an ulp.
    opmath = torch.promote_types(param.dtype, torch.float32)
    return torch.addcmul(param.to(opmath), step.to(opmath), lr.to(opmath), value=-1.0).to(param.dtype)


def _check_sparse(name: str, grads: Any, grad_leaves: list[Any], weight_decay: float) -> None:
    """Raises naming the first sparse gradient if `weight_decay` would add the dense param to it.

    torch.optim.SGD refuses that too (`add(sparse, dense) is not supported`); fmp says which param.
    """
    sparse = first_sparse_gradient(grads, grad_leaves) if weight_decay else None
    if sparse is not None:
        path, layout = sparse
        raise ValueError(
            f"{name}: grads{path} is {layout}, and weight_decay={weight_decay} would add the dense param "
            f"to it, which torch.optim.SGD refuses too; pass weight_decay=0.0 for sparse gradients (or "
            f"sparse=False to nn.Embedding)"
        )


def _dense(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """`leaves` with sparse gradients made dense, for momentum buffers and scheduled lrs (dense arithmetic)."""
    return [g.to_dense() if g.layout != torch.strided else g for g in leaves]


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    *,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    fused: bool = False,
) -> Optimizer:
    """SGD with optional momentum, Nesterov momentum and L2 weight decay, as `torch.optim.SGD`.

    The arithmetic is torch's, op for op, so float32 results are bit-identical to torch.optim.SGD.
    With a float `lr` and no momentum the optimizer is stateless (its state is `()`), so it works
    with `fmp.mixed_precision_step`. With momentum, or with a schedule, the state is an `SgdState`
    counting the applied steps (its `momentum` is `()` without momentum); such an optimizer needs
    `fmp.train_step`.

    Sparse gradients (`nn.Embedding(sparse=True)`'s COO ones) are taken as torch.optim.SGD takes
    them: with a float `lr` and no momentum the update adds them to the params as torch does, bit
    for bit; with momentum or a schedule they are made dense first (the momentum buffers are dense,
    where torch's are sparse), so results agree with torch's up to the rounding of duplicate
    indices. Like torch, `weight_decay` refuses them.

    Args:
        lr: Learning rate, a float >= 0, or a schedule `lr(count) -> 0-dim floating tensor` (see
            `fmp.optim.schedule`), `count` being the 0-dim int32 tensor of applied steps before
            this one. Skipped mixed-precision steps keep the state, so they do not advance it.
        momentum: Momentum factor in [0, 1].
        dampening: Dampening of momentum in [0, 1].
        nesterov: Use Nesterov momentum (needs momentum > 0 and dampening 0, as torch).
        weight_decay: L2 penalty added to the gradient, >= 0.
        fused: Run torch's fused kernel eager, as `torch.optim.SGD(fused=True)`: one call for
            every tensor, results bit for bit that optimizer's, and a skipped step handled inside
            the kernel instead of by a select. Without momentum only (torch's fused kernel seeds
            momentum buffers by a flag read on the host). Under torch.compile or `torch.func`
            transforms, and for tensors the kernel does not take (complex, sparse or
            non-contiguous ones), the update is `fused=False`'s. See
            [Performance and memory tuning](../how-to/performance-tuning.md).

    Returns:
        The optimizer.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range, or
            (from `update`) the sparse gradient `weight_decay` cannot take. A schedule must
            return a 0-dim floating tensor (checked when `update` runs, at trace time under
            torch.compile) and a finite lr >= 0 at counts 0 and 1 (checked by `init`, which syncs
            with the host to read them).
    """
    lr = check_lr(lr)
    momentum = check_real("momentum", momentum, 0.0, 1.0, high_inclusive=True)
    dampening = check_real("dampening", dampening, 0.0, 1.0, high_inclusive=True)
    weight_decay = check_real("weight_decay", weight_decay, 0.0, math.inf)
    nesterov = check_bool("nesterov", nesterov)
    if nesterov and (momentum == 0.0 or dampening != 0.0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")
    fused = check_bool("fused", fused)
    if fused and momentum:
        raise ValueError(
            f"sgd(fused=True) takes momentum=0, got momentum={momentum}: torch's fused kernel seeds its momentum "
            f"buffers by a flag read on the host, which a step cannot do without a sync; use fused=False"
        )

    def direction(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return torch.add(grad, param, alpha=weight_decay) if weight_decay else grad

    if momentum == 0.0 and isinstance(lr, float):
        fixed_lr = lr

        def init_stateless(params: Any) -> tuple[()]:
            del params
            return ()

        def update_stateless(grads: Any, state: tuple[()], params: Any) -> tuple[Any, tuple[()]]:
            if not (type(state) is tuple and not state):
                raise TypeError(
                    f"sgd without momentum keeps no state, got {type(state).__name__}: "
                    f"was it created by another optimizer's init?"
                )
            spec, param_leaves, (grad_leaves,), _ = leaves_like_params("sgd", params, {"grads": grads})
            _check_sparse("sgd", grads, grad_leaves, weight_decay)
            new_params = [
                torch.add(p, direction(g, p), alpha=-fixed_lr) for g, p in zip(grad_leaves, param_leaves, strict=True)
            ]
            return pytree.tree_unflatten(new_params, spec), state

        if not fused:
            return Optimizer(init_stateless, update_stateless)

        def masked_stateless(
            grads: Any, state: tuple[()], params: Any, applied: torch.Tensor | None, in_place: bool
        ) -> tuple[Any, tuple[()]]:
            spec, param_leaves, (grad_leaves,), _ = leaves_like_params("sgd", params, {"grads": grads})
            if not (type(state) is tuple and not state) or not runs_fused(param_leaves, grad_leaves):
                return unfused_update(update_stateless, grads, state, params, applied)
            new_params = _fused_descent(param_leaves, grad_leaves, fixed_lr, weight_decay, applied, in_place)
            return pytree.tree_unflatten(new_params, spec), state

        def fused_stateless(grads: Any, state: tuple[()], params: Any) -> tuple[Any, tuple[()]]:
            return masked_stateless(grads, state, params, None, False)

        return Optimizer(init_stateless, fused_stateless, masked_stateless)

    name = "sgd with momentum" if momentum else "sgd with an lr schedule"

    def init(params: Any) -> SgdState:
        check_optimizable_params(name, params)
        step = step_counter(params)
        check_schedule_start(lr, step, name)
        return SgdState(step, tree_zeros_like(params) if momentum else ())

    def update(grads: Any, state: SgdState, params: Any) -> tuple[Any, SgdState]:
        check_state(name, state, SgdState)
        lr_now = scheduled_lr(lr, state.step)
        if not momentum:
            if pytree.tree_leaves(state.momentum):
                raise TypeError(f"{name} keeps no momentum buffers: was its state created by another optimizer's init?")
            spec, param_leaves, (grad_leaves,), _ = leaves_like_params(name, params, {"grads": grads})
            _check_sparse(name, grads, grad_leaves, weight_decay)
            grad_leaves = _dense(grad_leaves)
            new_params = [_descend(p, direction(g, p), lr_now) for g, p in zip(grad_leaves, param_leaves, strict=True)]
            return pytree.tree_unflatten(new_params, spec), SgdState(state.step + 1, state.momentum)
        trees = {"grads": grads, "opt_state.momentum": state.momentum}
        spec, param_leaves, (grad_leaves, buffer_leaves), specs = leaves_like_params(name, params, trees)
        _check_sparse(name, grads, grad_leaves, weight_decay)
        grad_leaves = _dense(grad_leaves)
        # torch seeds the buffer with the first step's direction, undamped.
        first_step = state.step == 0

        def new_buffer(grad: torch.Tensor, param: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            d = direction(grad, param)
            return torch.where(first_step, d, torch.add(buf * momentum, d, alpha=1.0 - dampening))

        buffers = [new_buffer(*leaves) for leaves in zip(grad_leaves, param_leaves, buffer_leaves, strict=True)]

        def new_param(grad: torch.Tensor, param: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            step = torch.add(direction(grad, param), buf, alpha=momentum) if nesterov else buf
            return _descend(param, step, lr_now)

        new_params = [new_param(*leaves) for leaves in zip(grad_leaves, param_leaves, buffers, strict=True)]
        return pytree.tree_unflatten(new_params, spec), SgdState(state.step + 1, unflatten_as(buffers, spec, specs[1]))

    if not fused:
        return Optimizer(init, update)

    def masked_update(
        grads: Any, state: SgdState, params: Any, applied: torch.Tensor | None, in_place: bool
    ) -> tuple[Any, SgdState]:
        check_state(name, state, SgdState)
        spec, param_leaves, (grad_leaves,), _ = leaves_like_params(name, params, {"grads": grads})
        if pytree.tree_leaves(state.momentum) or not runs_fused(param_leaves, grad_leaves, state):
            return unfused_update(update, grads, state, params, applied)
        lr_now = scheduled_lr(lr, state.step)
        new_params = _fused_descent(param_leaves, grad_leaves, lr_now, weight_decay, applied, in_place)
        return pytree.tree_unflatten(new_params, spec), SgdState(counted_step(state.step, applied), state.momentum)

    def fused_update(grads: Any, state: SgdState, params: Any) -> tuple[Any, SgdState]:
        return masked_update(grads, state, params, None, False)

    return Optimizer(init, fused_update, masked_update)


def _fused_descent(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    lr: float | torch.Tensor,
    weight_decay: float,
    applied: torch.Tensor | None,
    in_place: bool,
) -> list[torch.Tensor]:
    """The fused SGD step without momentum, on copies of `params` unless `in_place`; skipped unless `applied`."""
    params = params if in_place else clone_leaves(params)
    found_inf = skip_flag(applied)
    for group in group_by_device_and_dtype(params):
        torch._fused_sgd_(
            [params[i] for i in group],
            [grads[i] for i in group],
            [],
            weight_decay=weight_decay,
            momentum=0.0,
            lr=lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=False,
            grad_scale=None,
            found_inf=found_inf,
        )
    return params
