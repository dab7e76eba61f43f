"""Contiguous gradient storage for autograd users: each parameter's `.grad` a view into one flat buffer.

`loss.backward()` gives each parameter a gradient tensor of its own, so an unscale runs once per
gradient: hundreds of small gradients cost hundreds of loops (or launches), plus the compiled
wrapper's bookkeeping for every one of them. `GradientBuffer.attach(params)` allocates one flat
buffer per (device, dtype) and makes each parameter's `.grad` a view into it. Backward accumulates
into those views in place, optimizers read them as ordinary gradients, and `unscale_` unscales
and checks all of them in one compiled pass over one tensor per buffer, writing in place.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any
from typing import TypeVar

import torch

from fmp.fused import fused_unscale_and_adjust
from fmp.loss_scale import LossScale
from fmp.tree import _ROW_LENGTH

__all__ = ["GradientBuffer"]

# Each view starts on a 64-byte boundary, so that vectorized kernels (multi-tensor optimizers on
# GPUs among them) see aligned gradients. The padding between views stays zero: backward never
# writes it, and zero is finite and unscales to zero.
_ALIGNMENT_BYTES = 64

ScaleT = TypeVar("ScaleT", bound=LossScale)


def _describe(index: int, param: torch.Tensor) -> str:
    return f"params[{index}] (shape {tuple(param.shape)}, {param.dtype})"


def _check_param(index: int, param: Any, first_index: dict[int, int]) -> torch.Tensor:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"params[{index}] is a {type(param).__name__}, not a tensor")
    where = _describe(index, param)
    if type(param) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where} is a {type(param).__name__}: a flat buffer holds plain tensors' gradients only")
    if param.layout != torch.strided:
        raise ValueError(f"{where} has layout {param.layout}: only dense (strided) gradients fit a flat buffer")
    if not param.requires_grad:
        raise ValueError(f"{where} does not require grad, so backward would never write its .grad")
    if not param.is_leaf:
        raise ValueError(f"{where} is not a leaf tensor: autograd accumulates .grad into leaves only")
    if id(param) in first_index:
        raise ValueError(f"{where} is listed twice, as params[{first_index[id(param)]}] and params[{index}]")
    first_index[id(param)] = index
    return param


def _padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


class GradientBuffer:
    """The gradients of a list of parameters, kept in one flat buffer per (device, dtype).

    A host-side handle, like a `torch.optim.Optimizer`: it refers to the parameters and is not a
    pytree. Build it with `attach`. Every parameter then has a gradient (zeros until a backward
    writes it), as with DDP's `gradient_as_bucket_view`: one that no loss reaches keeps a zero
    gradient where it would otherwise have none, which optimizers with weight decay or momentum
    act on.

    Example:
        ```python
        grads = fmp.GradientBuffer.attach(model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for x, y in data:
            scaler.scale(loss_fn(model(x), y)).backward()
            grads_finite, scaler = grads.unscale_(scaler)
            optimizer.found_inf = (~grads_finite).float()  # fused optimizers skip on the device
            optimizer.step()
            grads.zero_()
        ```
    """

    def __init__(
        self, params: tuple[torch.Tensor, ...], views: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...]
    ) -> None:
        self._params = params
        self._views = views
        self._buffers = buffers

    @classmethod
    def attach(cls, params: Iterable[torch.Tensor]) -> GradientBuffer:
        """Allocates the buffers and makes each parameter's `.grad` a view into them.

        Parameters are grouped by (device, dtype), one buffer per group in order of first
        appearance, and laid out in the order given. A gradient a parameter already has is copied
        into its view, so nothing accumulated so far is lost.

        Args:
            params: Leaf tensors that require grad, each listed once (e.g. `model.parameters()`).

        Returns:
            The buffer handle.

        Raises:
            TypeError: If an entry is not a tensor, or is a tensor subclass (such as a DTensor).
            ValueError: If `params` is empty, or an entry is sparse, does not require grad, is not
                a leaf, or is listed twice.
        """
        first_index: dict[int, int] = {}
        checked = [_check_param(i, p, first_index) for i, p in enumerate(params)]
        if not checked:
            raise ValueError("params is empty: there are no gradients to keep in a buffer")
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, param in enumerate(checked):
            groups.setdefault((param.device, param.dtype), []).append(i)
        views: list[torch.Tensor | None] = [None] * len(checked)
        buffers = []
        for (device, dtype), members in groups.items():
            alignment = max(1, _ALIGNMENT_BYTES // checked[members[0]].element_size())
            lengths = [_padded(checked[i].numel(), alignment) for i in members]
            # A whole number of rows, so a compiled GPU finite check reads the buffer row by row
            # in the pass that unscales it (see fmp.tree.all_finite).
            buffer = torch.zeros(_padded(sum(lengths), _ROW_LENGTH), device=device, dtype=dtype)
            offsets = itertools.accumulate(lengths, initial=0)
            for i, offset in zip(members, offsets, strict=False):  # one offset more than members
                param = checked[i]
                view = buffer[offset : offset + param.numel()].view(param.shape)
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
                views[i] = view
            buffers.append(buffer)
        return cls(tuple(checked), tuple(v for v in views if v is not None), tuple(buffers))

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The buffers, one 1-D tensor per (device, dtype), after checking each `.grad` is still its view.

        Returns:
            The flat buffers, in order of each group's first parameter. Writing to them writes the
            parameters' gradients (that is what `fused_unscale_and_adjust(..., donate=True)` does).

        Raises:
            RuntimeError: If a parameter's `.grad` is no longer its view: set to None (what
                `optimizer.zero_grad()` does by default; zero with `zero_()` instead, or with
                `zero_grad(set_to_none=False)`), or replaced by another tensor (an assignment, or a
                backward with `create_graph=True`, which accumulates out of place).
        """
        for index, (param, view) in enumerate(zip(self._params, self._views, strict=True)):
            if param.grad is view:
                continue
            where = _describe(index, param)
            if param.grad is None:
                raise RuntimeError(
                    f"{where} has .grad None, so its gradient is no longer in the buffer: zero gradients "
                    "with GradientBuffer.zero_() or optimizer.zero_grad(set_to_none=False), not set_to_none"
                )
            raise RuntimeError(
                f"{where} has a .grad that is not its view into the buffer: it was assigned, or a backward "
                "with create_graph=True accumulated out of place; call GradientBuffer.zero_() to re-attach"
            )
        return self._buffers

    def zero_(self) -> None:
        """Zeros every gradient, one fill per buffer, and re-attaches any `.grad` set to None or replaced."""
        for buffer in self._buffers:
            buffer.zero_()
        for param, view in zip(self._params, self._views, strict=True):
            if param.grad is not view:
                param.grad = view

    def unscale_(self, scaler: ScaleT) -> tuple[torch.Tensor, ScaleT]:
        """Unscales every gradient in place, checks them and moves the scale: GradScaler's `unscale_` + `update`.

        One `fused_unscale_and_adjust(scaler, self.flat(), donate=True)`: a compiled pass over each
        buffer that writes the unscaled values back and checks them (the unscaled values, unlike
        GradScaler's kernel). Where the compiled function falls back to eager (past Dynamo's
        recompile limit, with a warning), the results are copied into the buffers, so the
        gradients are unscaled in place either way.

        Args:
            scaler: The loss-scale state the gradients were computed with.

        Returns:
            `(grads_finite, new_scaler)`: a 0-dim bool tensor, True when every gradient is finite
            (on the device: nothing is read on the host), and the adjusted scaler state.

        Raises:
            RuntimeError: As `flat`, if a `.grad` is no longer its view.
            TypeError, ValueError: As `fused_unscale_and_adjust`, for a wrong scaler or one on
                another device than the gradients.
        """
        buffers = self.flat()
        unscaled, grads_finite, new_scaler = fused_unscale_and_adjust(scaler, buffers, donate=True)
        for buffer, values in zip(buffers, unscaled, strict=True):
            if values.data_ptr() != buffer.data_ptr():
                buffer.copy_(values)
        return grads_finite, new_scaler
