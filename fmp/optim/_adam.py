"""Adam and AdamW as pure functions, numerically matching `torch.optim.Adam` and `torch.optim.AdamW`."""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple
from typing import cast

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._checks import check_bool
from fmp._checks import check_real
from fmp._donation import writes_in_place
from fmp._optimizer import Optimizer
from fmp._struct import serializable_namedtuple
from fmp._tree import clone_leaves
from fmp._tree import select_tree
from fmp._tree import takes_foreach
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
from fmp.optim._fused import select_leaves
from fmp.optim._fused import skip_flag
from fmp.optim._fused import unfused_update

__all__ = ["AdamState", "adam", "adamw"]


@serializable_namedtuple
class AdamState(NamedTuple):
    """State of Adam and AdamW.

    Attributes:
        step: Applied steps so far, a 0-dim int32 tensor (bias correction reads it on device).
        exp_avg: First-moment estimates, shaped like the parameters.
        exp_avg_sq: Second-moment estimates, shaped like the parameters.
    """

    step: torch.Tensor
    exp_avg: Any
    exp_avg_sq: Any


def _real(x: torch.Tensor) -> torch.Tensor:
    # torch.optim's Adam treats a complex number as two reals: |g|^2, not g*g, in the second moment.
    return torch.view_as_real(x) if x.is_complex() else x


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # x itself where it has the dtype, as x.to(dtype) returns it, without an op for Dynamo to trace.
    return x if x.dtype == dtype else x.to(dtype)


def _like(real: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(real) if like.is_complex() else real


def _operand(number: float, on_cpu: bool) -> float | torch.Tensor:
    """`number` as the multi-tensor kernels' operand for float32 leaves: a 0-dim float32 tensor on a CPU.

    The CPU kernels wrap a number in a new tensor for each leaf; a float32 tensor of it is the
    same operand (a number meets float32 leaves in float32), so the same bits. It is made once per
    number (an optimizer's betas, eps and decay are constants), as making it costs more than the
    kernels' own wrapping saves; the kernels only read it.
    """
    # Keyed by the bits, as 0.0 == -0.0: the operand is the number given, to the sign of a zero.
    return _cpu_scalar(float(number).hex()) if on_cpu else number


@functools.lru_cache(maxsize=64)
def _cpu_scalar(bits: str) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor, whatever mode the first step runs in
        return torch.tensor(float.fromhex(bits), dtype=torch.float32, device="cpu")


def _check_eps_in_param_dtypes(name: str, eps: float, params: Any, leaves: list[Any]) -> None:
    """Raises unless `eps` is nonzero in every param's dtype, in which Adam adds it to the denominator.

    In float16, eps=1e-8 rounds to 0: a param whose gradients are all 0 (or below ~5e-3, whose
    squares underflow) divides by 0 and becomes NaN or inf, with finite gradients, so the step is
    applied. Read from the dtypes alone: no sync.
    """
    for dtype in dict.fromkeys(leaf.dtype for leaf in leaves):
        info = torch.finfo(dtype)
        if 2 * eps <= info.tiny * info.eps:  # at most half the smallest subnormal: rounds to 0
            key = next(
                py_pytree.keystr(path)
                for path, leaf in py_pytree.tree_flatten_with_path(params)[0]
                if leaf.dtype == dtype
            )
            raise ValueError(
                f"{name}: eps={eps} rounds to 0 in {dtype}, params{key}'s dtype, where it is added to the "
                f"denominator: an element whose gradients are all 0 or tiny would become NaN or inf. Keep the "
                f"params in float32 (a policy's params=float32) or give eps >= {info.tiny * info.eps:.3g}"
            )


class _NewLeaves(NamedTuple):
    """An update's results as leaves, in the params' order, beside the leaves they replace."""

    spec: pytree.TreeSpec
    specs: list[pytree.TreeSpec | None]
    old: list[list[torch.Tensor]]  # params, exp_avg, exp_avg_sq
    leaves: list[list[torch.Tensor]]  # their new values, in the same order
    step: torch.Tensor
    fresh: bool  # whether every new leaf is a temporary of the update's own, free to write


def _assemble(new: _NewLeaves) -> tuple[Any, AdamState]:
    params, exp_avg, exp_avg_sq = new.leaves
    moments = (unflatten_as(exp_avg, new.spec, new.specs[1]), unflatten_as(exp_avg_sq, new.spec, new.specs[2]))
    return pytree.tree_unflatten(params, new.spec), AdamState(new.step, *moments)


def _check_dense(name: str, grads: Any, grad_leaves: list[Any]) -> None:
    """Raises naming the first sparse gradient: Adam's moments are dense, as torch.optim.Adam's refusal says."""
    sparse = first_sparse_gradient(grads, grad_leaves)
    if sparse is not None:
        path, layout = sparse
        raise TypeError(
            f"{name} does not take sparse gradients, as torch.optim's Adam and AdamW do not: grads{path} is "
            f"{layout}. Train sparse embeddings with fmp.optim.sgd, or pass sparse=False to nn.Embedding"
        )


def _adam(
    lr: LearningRate, betas: tuple[float, float], eps: float, weight_decay: float, *, decoupled: bool, fused: bool
) -> Optimizer:
    name = "adamw" if decoupled else "adam"
    fused = check_bool("fused", fused)
    lr = check_lr(lr)
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of floats, got {betas!r}")
    beta1 = check_real("betas[0]", betas[0], 0.0, 1.0)
    beta2 = check_real("betas[1]", betas[1], 0.0, 1.0)
    eps = check_real("eps", eps, 0.0, math.inf)
    if float(torch.tensor(eps, dtype=torch.float32)) == 0.0:
        raise ValueError(
            f"{name}: eps must be > 0 in float32, got {eps}: with eps=0, an element whose gradients have all "
            f"been 0 divides 0 by 0 and its param becomes NaN"
        )
    weight_decay = check_real("weight_decay", weight_decay, 0.0, math.inf)

    def init(params: Any) -> AdamState:
        check_optimizable_params(name, params)
        _check_eps_in_param_dtypes(name, eps, params, pytree.tree_leaves(params))
        step = step_counter(params)
        check_schedule_start(lr, step, name)
        return AdamState(step, tree_zeros_like(params), tree_zeros_like(params))

    def new_leaves(grads: Any, state: AdamState, params: Any) -> _NewLeaves:
        check_state(name, state, AdamState)
        trees = {"grads": grads, "opt_state.exp_avg": state.exp_avg, "opt_state.exp_avg_sq": state.exp_avg_sq}
        spec, param_leaves, leaves, specs = leaves_like_params(name, params, trees)
        _check_eps_in_param_dtypes(name, eps, params, param_leaves)
        grad_leaves, exp_avg_leaves, exp_avg_sq_leaves = leaves
        _check_dense(name, grads, grad_leaves)
        # A schedule sees the applied steps before this one; a float lr passes through as is. A
        # scheduled lr is taken in double precision, as torch takes a Python float lr.
        lr_now = scheduled_lr(lr, state.step)
        lr_now = lr_now.double() if isinstance(lr_now, torch.Tensor) else lr_now
        step = state.step + 1
        # torch forms the bias corrections in double precision; so does this, on device.
        step64 = step.double()
        bias_correction1 = 1.0 - torch.pow(beta1, step64)
        bias_correction2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, step64))
        # One stacked tensor: Inductor computes it once, where two 0-dim results would be inlined
        # into the update and their pows recomputed for every vector of every parameter (3x slower on CPU).
        scalars = [lr_now / bias_correction1, bias_correction2_sqrt]
        scheduled_decay = False
        if decoupled and weight_decay and isinstance(lr_now, torch.Tensor):
            # torch forms 1 - lr * weight_decay in double precision too, then multiplies in opmath.
            scheduled_decay = True
            scalars.append(1.0 - lr_now * weight_decay)
        step_scalars = torch.stack(scalars)
        # Eager, the arithmetic below writes into its own temporaries where it may (the same ops,
        # so the same bits): half the allocations, each a pass over fresh memory. Compiled, Inductor
        # fuses the pure form into one loop; autograd (of a learned lr too) and torch.func need it pure.
        every = [*param_leaves, *grad_leaves, *exp_avg_leaves, *exp_avg_sq_leaves]
        foreach = bool(every) and takes_foreach(every, every[0].device)
        # Leaves the multi-tensor kernels take are plain tensors that autograd does not track, as
        # writes_in_place asks of them: one look at each leaf, not two.
        written = (state.step, step_scalars) if foreach else (*leaves, param_leaves, state.step, step_scalars)
        in_place = writes_in_place(*written)
        if not decoupled and weight_decay:
            # Where the kernels take the leaves, they take these sums of them too.
            grad_leaves = [torch.add(g, p, alpha=weight_decay) for g, p in zip(grad_leaves, param_leaves, strict=True)]
        if in_place and foreach:
            # The same ops, one call per op for all leaves instead of one per leaf (the same bits).
            on_cpu = every[0].is_cpu
            moment1 = list(torch._foreach_lerp(exp_avg_leaves, grad_leaves, 1.0 - beta1))
            moment2 = list(torch._foreach_mul(exp_avg_sq_leaves, _operand(beta2, on_cpu)))
            torch._foreach_addcmul_(moment2, grad_leaves, grad_leaves, value=1.0 - beta2)
            scalars32 = step_scalars.float()
            if scheduled_decay:
                decayed = list(torch._foreach_mul(param_leaves, scalars32[2]))
            elif decoupled and weight_decay:
                decay = _operand(1.0 - cast(float, lr_now) * weight_decay, on_cpu)
                decayed = list(torch._foreach_mul(param_leaves, decay))
            else:
                decayed = param_leaves
            denom = torch._foreach_sqrt(moment2)
            torch._foreach_div_(denom, scalars32[1])
            eps_operand = _operand(eps, on_cpu)
            if isinstance(eps_operand, torch.Tensor):
                # A list of the one tensor: the kernel's single-tensor form wraps it per leaf as it does a number.
                torch._foreach_add_(denom, [eps_operand] * len(denom))
            else:
                torch._foreach_add_(denom, eps_operand)
            if on_cpu:
                # As torch.optim's param.addcdiv_(exp_avg, denom, value=-step_size), in one call: the
                # kernel reads its per-tensor values from a CPU tensor (on CUDA it would have to sync).
                step_sizes = scalars32[:1].neg().expand(len(param_leaves)).contiguous()
                updated = list(torch._foreach_addcdiv(decayed, moment1, denom, step_sizes))
            else:
                step_update = torch._foreach_mul(moment1, scalars32[0])
                torch._foreach_div_(step_update, denom)
                updated = list(torch._foreach_sub(decayed, step_update))
            old = [param_leaves, exp_avg_leaves, exp_avg_sq_leaves]
            return _NewLeaves(spec, specs, old, [updated, moment1, moment2], step, fresh=True)
        exp_avg = [
            _like(torch.lerp(_real(m), _real(g), 1.0 - beta1), m)
            for m, g in zip(exp_avg_leaves, grad_leaves, strict=True)
        ]

        def new_exp_avg_sq(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            decayed, g = _real(v) * beta2, _real(g)
            if in_place:
                return _like(decayed.addcmul_(g, g, value=1.0 - beta2), v)
            return _like(torch.addcmul(decayed, g, g, value=1.0 - beta2), v)

        exp_avg_sq = [new_exp_avg_sq(v, g) for v, g in zip(exp_avg_sq_leaves, grad_leaves, strict=True)]

        # Each op here is traced once per param: the scalars are cast and split once per opmath dtype.
        scalars_in: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

        def new_param(complex_param: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            param, m, v = _real(complex_param), _real(m), _real(v)
            opmath = torch.promote_types(param.dtype, torch.float32)
            if opmath not in scalars_in:
                scalars_in[opmath] = step_scalars.to(opmath).unbind()
            scalars = scalars_in[opmath]
            if scheduled_decay:
                param = _cast(_cast(param, opmath) * scalars[2], param.dtype)
            elif decoupled and weight_decay:
                param = param * (1.0 - lr_now * weight_decay)
            # torch divides by a Python float, which its kernels read in at least float32 (opmath); its
            # addcdiv(param, m, denom, value=-step_size) forms param + (-step_size * m) / denom in
            # opmath too and rounds once to the param dtype.
            if in_place:
                denom = torch.sqrt(v).div_(scalars[1]).add_(eps)
                update = (scalars[0] * _cast(m, opmath)).div_(_cast(denom, opmath))
                return _like(_cast(torch.sub(_cast(param, opmath), update, out=update), param.dtype), complex_param)
            # Rounded to v's dtype before eps is added, as torch's (and the in-place form's) division
            # by a number rounds it: a 0-dim 16-bit v divided by the 0-dim float32 tensor would
            # otherwise stay float32.
            denom = _cast(torch.sqrt(v) / scalars[1], v.dtype) + eps
            update = scalars[0] * _cast(m, opmath) / _cast(denom, opmath)
            return _like(_cast(_cast(param, opmath) - update, param.dtype), complex_param)

        new_params = [new_param(p, m, v) for p, m, v in zip(param_leaves, exp_avg, exp_avg_sq, strict=True)]
        old = [param_leaves, exp_avg_leaves, exp_avg_sq_leaves]
        return _NewLeaves(spec, specs, old, [new_params, exp_avg, exp_avg_sq], step, fresh=in_place)

    def update(grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState]:
        return _assemble(new_leaves(grads, state, params))

    def unfused_masked_update(
        grads: Any, state: AdamState, params: Any, applied: torch.Tensor | None, in_place: bool
    ) -> tuple[Any, AdamState]:
        new = new_leaves(grads, state, params)
        if applied is None:
            return _assemble(new)
        if not new.fresh:  # autograd records the update (a learned lr), or a transform runs: pure
            return select_tree(applied, _assemble(new), (params, state))
        # Into the donated state's buffers, else into this update's own temporaries: no new tensors.
        chosen = [select_leaves(applied, n, o, into_old=in_place) for n, o in zip(new.leaves, new.old, strict=True)]
        (step,) = select_leaves(applied, [new.step], [state.step], into_old=in_place)
        return _assemble(new._replace(leaves=chosen, step=step))

    if not fused:
        return Optimizer(init, update, unfused_masked_update)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def masked_update(
        grads: Any, state: AdamState, params: Any, applied: torch.Tensor | None, in_place: bool
    ) -> tuple[Any, AdamState]:
        check_state(name, state, AdamState)
        trees = {"grads": grads, "opt_state.exp_avg": state.exp_avg, "opt_state.exp_avg_sq": state.exp_avg_sq}
        spec, param_leaves, (grad_leaves, exp_avg_leaves, exp_avg_sq_leaves), specs = leaves_like_params(
            name, params, trees
        )
        if not runs_fused(param_leaves, grad_leaves, state):
            return unfused_update(update, grads, state, params, applied)
        _check_eps_in_param_dtypes(name, eps, params, param_leaves)
        _check_dense(name, grads, grad_leaves)
        lr_now = scheduled_lr(lr, state.step)
        lr_now = lr_now.double() if isinstance(lr_now, torch.Tensor) else lr_now
        if not in_place:
            param_leaves, exp_avg_leaves, exp_avg_sq_leaves = (
                clone_leaves(param_leaves),
                clone_leaves(exp_avg_leaves),
                clone_leaves(exp_avg_sq_leaves),
            )
        # The kernel reads the step for its bias corrections as torch.optim keeps it: a float32 count.
        counted = (state.step + 1).float()
        found_inf = skip_flag(applied)
        for group in group_by_device_and_dtype(param_leaves):
            kernel(
                [param_leaves[i] for i in group],
                [grad_leaves[i] for i in group],
                [exp_avg_leaves[i] for i in group],
                [exp_avg_sq_leaves[i] for i in group],
                [],
                [counted] * len(group),
                lr=lr_now,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=None,
                found_inf=found_inf,
            )
        moments = (unflatten_as(exp_avg_leaves, spec, specs[1]), unflatten_as(exp_avg_sq_leaves, spec, specs[2]))
        new_state = AdamState(counted_step(state.step, applied), *moments)
        return pytree.tree_unflatten(param_leaves, spec), new_state

    def fused_update(grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState]:
        return masked_update(grads, state, params, None, False)

    return Optimizer(init, fused_update, masked_update)


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    fused: bool = False,
) -> Optimizer:
    """Adam with L2 weight decay folded into the gradient, as `torch.optim.Adam`.

    Args:
        lr: Learning rate, a float >= 0, or a schedule `lr(count) -> 0-dim floating tensor` (see
            `fmp.optim.schedule`), `count` being the applied steps before this one (skipped
            mixed-precision steps do not count).
        betas: Decay rates of the first and second moment estimates, each in [0, 1).
        eps: Added to the denominator, > 0 (also once rounded to float32).
        weight_decay: L2 penalty, >= 0.
        fused: Run torch's fused kernel eager, as `torch.optim.Adam(fused=True)`: one call for
            every tensor, results bit for bit that optimizer's (which differ from `fused=False`'s
            in the last bits), and a skipped step handled inside the kernel instead of by a
            select. Under torch.compile or `torch.func` transforms, and for tensors the kernel
            does not take (complex or non-contiguous ones), the update is `fused=False`'s. See
            [Performance and memory tuning](../how-to/performance-tuning.md).

    Returns:
        The optimizer; its state is an `AdamState`.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range. A
            schedule must return a 0-dim floating tensor (checked when `update` runs) and a finite
            lr >= 0 at counts 0 and 1 (checked by `init`, which syncs with the host to read them).
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=False, fused=fused)


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    fused: bool = False,
) -> Optimizer:
    """AdamW (decoupled weight decay), as `torch.optim.AdamW`.

    Args:
        lr: Learning rate, a float >= 0, or a schedule `lr(count) -> 0-dim floating tensor` (see
            `fmp.optim.schedule`), `count` being the applied steps before this one (skipped
            mixed-precision steps do not count).
        betas: Decay rates of the first and second moment estimates, each in [0, 1).
        eps: Added to the denominator, > 0 (also once rounded to float32).
        weight_decay: Decoupled weight decay, >= 0.
        fused: Run torch's fused kernel eager, as `torch.optim.AdamW(fused=True)`: one call for
            every tensor, results bit for bit that optimizer's (which differ from `fused=False`'s
            in the last bits), and a skipped step handled inside the kernel instead of by a
            select. Under torch.compile or `torch.func` transforms, and for tensors the kernel
            does not take (complex or non-contiguous ones), the update is `fused=False`'s. See
            [Performance and memory tuning](../how-to/performance-tuning.md).

    Returns:
        The optimizer; its state is an `AdamState`.

    Raises:
        TypeError, ValueError: Naming the argument, if one is of the wrong type or out of range. A
            schedule must return a 0-dim floating tensor (checked when `update` runs) and a finite
            lr >= 0 at counts 0 and 1 (checked by `init`, which syncs with the host to read them).
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=True, fused=fused)
