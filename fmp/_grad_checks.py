"""The checks of `mixed_precision_grad`'s arguments and of what the loss function returns.

Each raises a TypeError or ValueError naming the argument or leaf at fault; none reads a tensor's
value on the host. Key paths are built only for an error message.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree
from fmp._backward import check_reads_no_module_parameters
from fmp._backward import warn_while_tracing
from fmp._checks import check_bool
from fmp._checks import check_callable
from fmp._policy import Policy
from fmp._scale_checks import ScalerTree
from fmp._scale_checks import check_scalers
from fmp._tree import check_no_opaque_leaves
from fmp._tree import leaves_accelerator_device
from fmp._tree import tree_accelerator_device

__all__ = [
    "check_aux",
    "check_grad_arguments",
    "check_losses",
    "check_param_leaves",
    "check_params",
    "warn_unless_depends_on_params",
]


def _param_leaf_problem(leaf: Any) -> str | None:
    """Why `leaf` cannot be a parameter, or None."""
    if not isinstance(leaf, torch.Tensor):
        return f"is a {type(leaf).__name__}; every leaf of params must be a tensor"
    if isinstance(leaf, torch.nn.Parameter):
        return (
            "is an nn.Parameter: autograd would chain every step's graph onto the last "
            "(a memory leak); pass {k: v.detach() for k, v in model.named_parameters()}"
        )
    if leaf.requires_grad and not torch._C._functorch.is_functorch_wrapped_tensor(leaf):
        if leaf.grad_fn is not None:
            return (
                "requires grad, as a step's output does while plain autograd records: autograd would "
                "chain every step's graph onto the last (a memory leak); pass it .detach()ed, or take a "
                "meta-gradient through several steps with torch.func.grad"
            )
        return (
            "requires grad (torch.func.stack_module_state returns such tensors): autograd would "
            "chain every step's graph onto the last (a memory leak); pass it .detach()ed"
        )
    return None


def _checked_leaves(params: Any, policy: Policy | None) -> torch.device | None:
    """Checks every leaf of `params` (and its dtype against `policy`'s, if given); returns their device."""
    leaves = pytree.tree_leaves(params)
    if policy is not None and all(
        type(x) is torch.Tensor and not x.requires_grad and x.dtype == policy.param_dtype for x in leaves
    ):
        return leaves_accelerator_device(leaves)  # the usual params, passed without a look at each problem
    check_no_opaque_leaves(leaves, params, "params")
    for index, leaf in enumerate(leaves):
        problem = _param_leaf_problem(leaf)
        if problem is None and policy is not None:
            if not (leaf.is_floating_point() or leaf.is_complex()):
                problem = (
                    f"is {leaf.dtype}; every leaf of params is differentiated, "
                    f"so pass integer buffers (e.g. num_batches_tracked) through *args instead"
                )
            elif leaf.is_floating_point() and leaf.dtype != policy.param_dtype:
                problem = (
                    f"is {leaf.dtype} but the policy stores params in {policy.param_dtype}; "
                    f"cast them with policy.cast_to_param(params) or choose another policy"
                )
        if problem is not None:
            # Key paths only for the message: flattening with them costs several times a plain flatten.
            path = py_pytree.tree_flatten_with_path(params)[0][index][0]
            raise TypeError(f"params{py_pytree.keystr(path)} {problem}")
    return tree_accelerator_device(leaves)


def check_param_leaves(params: Any) -> torch.device | None:
    """Raises a TypeError naming the leaf unless every leaf of `params` is a tensor autograd does not track.

    An opaque container (a generator, a Module) or a non-tensor cannot be a parameter. An
    `nn.Parameter`, or a tensor that requires grad, would chain every step's graph onto the last,
    since the step's new params are computed from the old ones (a memory leak). Tensors wrapped by
    a `torch.func` transform (a meta-gradient through the step) are differentiated on purpose and pass.

    Returns:
        The params' device (their first accelerator, where the step's finite flag lives), or None
        for params without tensors.
    """
    return _checked_leaves(params, None)


def check_params(params: Any, policy: Policy) -> torch.device | None:
    """As `check_param_leaves`, and every parameter, being differentiated, a floating tensor in the param dtype."""
    return _checked_leaves(params, policy)


def _check_loss(loss: Any, subject: str) -> torch.Tensor:
    """Checks one loss; `subject` opens the error message ("loss_fn must return")."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{subject} a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"{subject} a scalar (0-dim) loss, got shape {tuple(loss.shape)}; reduce it, e.g. with .mean()"
        )
    if not loss.is_floating_point():
        raise TypeError(f"{subject} a floating-point loss, got {loss.dtype}")
    return loss


def check_losses(out: Any, scaler: ScalerTree) -> Any:
    """The loss, or the tuple of losses with one per scaler, each checked."""
    if not isinstance(scaler, tuple):
        if isinstance(out, tuple):
            raise TypeError(
                f"loss_fn must return a scalar tensor, got a tuple of {len(out)}: with has_aux=True it returns "
                f"(loss, aux), and with a tuple of scalers one loss per scaler"
            )
        return _check_loss(out, "loss_fn must return")
    if not (isinstance(out, tuple) and len(out) == len(scaler)):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(f"with a tuple of {len(scaler)} scalers, loss_fn must return {len(scaler)} losses, got {got}")
    return tuple(_check_loss(loss, f"loss_fn's loss[{index}] must be") for index, loss in enumerate(out))


def _no_dependence(which: str) -> str:
    return (
        f"loss_fn's {which} does not depend on params, so its gradients are all zero (weight decay and "
        f"momentum still move the params): was it detached, computed under torch.no_grad or rebuilt from "
        f".item(), or the model called as model(x) instead of torch.func.functional_call(model, params, (x,))?"
    )


def warn_unless_depends_on_params(loss: torch.Tensor, which: str, params: Any, args: Any) -> None:
    """Warns if `loss`, inside `torch.func.grad`, is not computed from `params` (its gradients are zeros).

    Inside the transform a loss tracks the params exactly when it requires grad: a static property,
    read without a sync. A warning, not an error: a loss may be constant on purpose (a term not yet
    switched on, an empty batch), though more often it was detached by mistake. Compiled, it warns
    once, while the step is traced (where warnings are errors, Dynamo raises its own
    InternalTorchDynamoError carrying the UserWarning). Eager, the module-parameter check runs
    first and raises where it applies (a loss that reads a module's own parameters, which compiled
    steps cannot see).
    """
    if loss.requires_grad or not pytree.tree_leaves(params):
        return
    if torch.compiler.is_compiling():
        warn_while_tracing(_no_dependence(which))
        return
    check_reads_no_module_parameters(loss, args)
    warnings.warn(_no_dependence(which), UserWarning, stacklevel=2)


def check_aux(aux: Any) -> None:
    if all(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(aux)):
        return
    for path, leaf in py_pytree.tree_flatten_with_path(aux)[0]:  # paths only for the message
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"aux{py_pytree.keystr(path)} is a {type(leaf).__name__}; aux must be a pytree of tensors")


def check_grad_arguments(loss_fn: Any, scaler: Any, policy: Any, has_aux: Any) -> None:
    """Raises a TypeError naming the first of `mixed_precision_grad`'s arguments of the wrong type."""
    check_callable("loss_fn", loss_fn)
    check_scalers(scaler)
    check_bool("has_aux", has_aux)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be an fmp.Policy (e.g. fmp.get_policy('c=bf16')), got {type(policy).__name__}")
