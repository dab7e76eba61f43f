"""Gradients with torch.func that free each activation once the backward pass has used it.

`torch.func.grad` always backpropagates with `create_graph=True`, so that a transform around it
can differentiate the backward pass too. That keeps every activation the forward pass saved, and
every intermediate of the backward pass, alive until the last gradient is out: on a residual MLP,
2x the peak memory of `loss.backward()` (benchmarks/RESULTS.md), and an `fmp.remat` block's
recompute stays alive as well, which undoes its saving. Where nothing around the call
differentiates, `grad_and_aux` runs the backward pass as `loss.backward()` does instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import cast

import torch
from torch._functorch.eager_transforms import _vjp_with_argnums
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

__all__ = ["grad_and_aux"]


def _inside_differentiating_transform() -> bool:
    """Whether a torch.func grad or jvp transform around the call will differentiate through it."""
    differentiating = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
    return any(interpreter.key() in differentiating for interpreter in retrieve_all_functorch_interpreters())


def grad_and_aux(fn: Callable[..., tuple[torch.Tensor, Any]], params: Any, *args: Any) -> tuple[Any, Any]:
    """`torch.func.grad(fn, argnums=0, has_aux=True)(params, *args)`, freeing activations as it goes.

    Args:
        fn: `fn(params, *args) -> (scalar loss, aux)`.
        params: What to differentiate with respect to.
        *args: Further inputs, which enter the transform as inputs (so `fn` may update them in
            place) but are not differentiated.

    Returns:
        `(grads, aux)`: the gradients in the structure of `params`, and `fn`'s aux.
    """
    # Compiled, forward and backward are one graph whose buffers Inductor frees by itself.
    if torch.compiler.is_compiling() or _inside_differentiating_transform():
        return torch.func.grad(fn, argnums=0, has_aux=True)(params, *args)  # type: ignore[no-any-return]
    loss, pullback, aux = cast(tuple[Any, Any, Any], _vjp_with_argnums(fn, params, *args, argnums=0, has_aux=True))
    # A loss autograd tracks outside the transform (through an input, or a tensor `fn` captured,
    # that requires grad: a meta-gradient) needs the backward pass recorded, as torch.func.grad does.
    record = loss.requires_grad
    grads = pullback(torch.ones_like(loss), retain_graph=record, create_graph=record)
    return grads, aux
