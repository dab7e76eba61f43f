"""What a flat gradient buffer takes: its parameters checked and laid out, and an optimizer that skips on the device."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_param", "check_skips_on_device", "describe", "name_and_param", "padded", "view_like"]


def describe(index: int, param: torch.Tensor, name: str | None) -> str:
    named = f"{name!r}, " if name is not None else ""
    return f"params[{index}] ({named}shape {tuple(param.shape)}, {param.dtype})"


def name_and_param(entry: Any) -> tuple[str | None, Any]:
    """An entry of `attach`'s params as `(name, param)`: a `(name, tensor)` pair, or a tensor (name None)."""
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
        return entry[0], entry[1]
    return None, entry


def check_param(index: int, param: Any, name: str | None, first_index: dict[int, int]) -> torch.Tensor:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"params[{index}] is a {type(param).__name__}, not a tensor (nor a (name, tensor) pair)")
    where = describe(index, param, name)
    if type(param) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where} is a {type(param).__name__}: a flat buffer holds plain tensors' gradients only")
    if param.layout != torch.strided:
        raise ValueError(f"{where} has layout {param.layout}: only dense (strided) gradients fit a flat buffer")
    if not param.requires_grad:
        raise ValueError(
            f"{where} does not require grad, so backward would never write its .grad; attach the trainable "
            f"ones only: (p for p in model.parameters() if p.requires_grad)"
        )
    if not param.is_leaf:
        raise ValueError(f"{where} is not a leaf tensor: autograd accumulates .grad into leaves only")
    if param.grad is not None and param.grad.layout != torch.strided:
        raise ValueError(f"{where} has a {param.grad.layout} gradient: only dense gradients fit a flat buffer")
    if id(param) in first_index:
        raise ValueError(f"{where} is listed twice, as params[{first_index[id(param)]}] and params[{index}]")
    first_index[id(param)] = index
    return param


def padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def _is_non_overlapping_and_dense(x: torch.Tensor) -> bool:
    """Whether `x`'s elements fill a block of memory exactly once, in some order of its dimensions."""
    expected = 1
    # Innermost first: the dimension of stride 1 must come first, whatever its size.
    for stride, size in sorted((t, s) for s, t in zip(x.shape, x.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def view_like(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """`param.numel()` elements of `buffer` from `offset`, shaped as `param`, strided as autograd would.

    autograd's layout contract: a non-overlapping and dense parameter's gradient has its strides (a
    transposed or channels-last weight), which fused optimizers also expect of their state; any
    other parameter's gradient is contiguous.
    """
    if param.numel() > 0 and _is_non_overlapping_and_dense(param):
        return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)
    return buffer[offset : offset + param.numel()].view(param.shape)


def check_skips_on_device(optimizer: Any) -> None:
    """Raises a TypeError unless `optimizer` leaves everything unchanged on a step with `found_inf` 1."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise TypeError(
            f"{name} cannot skip a step on the device: only torch optimizers built with fused=True "
            "(Adam, AdamW, Adagrad, SGD) read found_inf; the others would apply an overflowed step. "
            "Build it with fused=True, or use fmp.optim with fmp.train_step"
        )
    if isinstance(optimizer, torch.optim.SGD) and any(group["momentum"] != 0 for group in optimizer.param_groups):
        raise TypeError(
            "fused SGD with momentum cannot skip its first step: torch's _fused_sgd leaves the momentum "
            "buffers uninitialized when found_inf is 1 then; use fused AdamW, or fmp.optim.sgd with fmp.train_step"
        )
