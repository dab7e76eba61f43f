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

import torch
import torch.utils._pytree as pytree
from torch._functorch import eager_transforms
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

# The vjp torch.func.jacrev uses, which differentiates with respect to chosen arguments only; a
# torch without it takes torch.func.grad's path.
_vjp_with_argnums: Callable[..., Any] | None = getattr(eager_transforms, "_vjp_with_argnums", None)

__all__ = ["grad_and_aux"]


def _differentiated_outside(tree: Any) -> bool:
    """Whether something outside the call will differentiate through it.

    A torch.func grad or jvp transform around it, or an input autograd tracks (a plain-autograd
    meta-gradient through a step), needs the backward pass recorded.
    """
    differentiating = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
    if any(interpreter.key() in differentiating for interpreter in retrieve_all_functorch_interpreters()):
        return True
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(tree))


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
    if _vjp_with_argnums is None or torch.compiler.is_compiling() or _differentiated_outside((params, args)):
        return torch.func.grad(fn, argnums=0, has_aux=True)(params, *args)  # type: ignore[no-any-return]
    loss, pullback, aux = _vjp_with_argnums(fn, params, *args, argnums=0, has_aux=True)
    grads = pullback(torch.ones_like(loss), retain_graph=False, create_graph=False)
    return grads, aux
