"""What a rematerialized block's forward reads and writes, watched call by call by a function mode.

The block runs twice, so it must read every differentiated tensor through its arguments (a
captured one would lose its gradient, or its outer jvp's tangent) and must not update a tensor
it captured (the recompute would update it again). An argument it updates in place is saved as
it was before the first update, and the recompute updates a copy of that: the caller's tensor
moves once, and the recompute starts where the first run did. Norms update the running
statistics they are given without bumping version counters, so their calls are watched by name.
"""

from __future__ import annotations

import functools
import inspect
from types import FunctionType
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fmp._tree import functorch_base
from fmp._tree import is_inexact_tensor

__all__ = ["CAPTURED", "MADE", "Watch", "is_differentiated", "jvp_levels"]

MADE = -1
"""`Watch.owners`' mark of a tensor the block made, with memory of its own."""
CAPTURED = -2
"""`Watch.owners`' mark of a tensor in a captured tensor's memory."""

# Calls whose result carries no gradient of their tensor arguments: metadata, and factories that
# take only a shape and dtype from them.
_NO_GRADIENT_THROUGH = frozenset(
    {"size", "dim", "numel", "is_floating_point", "is_complex", "element_size", "stride", "__len__", "detach"}
    | {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
)
# Properties read through `__get__` that return metadata, not a view (x.T and x.real are views).
_METADATA_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "names", "itemsize", "nbytes", "data"}
    | {"is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested"}
)
_IN_PLACE_OPERATORS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__"}
    | {"__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}
)
# Norms that update the running statistics they are given: the position of `running_mean`
# (`running_var` follows it; both may come by keyword), and the flag that makes them update (the
# sixth argument), with its default; None where they always update.
_NORM_FUNCTIONS = {
    F.batch_norm: (1, "training", False),
    F.instance_norm: (1, "use_input_stats", True),
    torch.batch_norm: (3, "training", False),
    torch.instance_norm: (3, "use_input_stats", True),
    torch.native_batch_norm: (3, "training", False),
    torch._native_batch_norm_legit: (3, "training", False),
}
_NORM_OPS = {  # torch.ops.aten's, by name
    "batch_norm": (3, "training", False),
    "instance_norm": (3, "use_input_stats", True),
    "native_batch_norm": (3, "training", False),
    "_native_batch_norm_legit": (3, "training", False),
    "_batch_norm_impl_index": (3, "training", False),
    "cudnn_batch_norm": (3, "training", False),
    "miopen_batch_norm": (3, "training", False),
    "_batch_norm_with_update": (3, None, True),
}


def jvp_levels() -> frozenset[int]:
    """The levels of the `torch.func.jvp` transforms active now (their tangents ride on wrappers)."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    return frozenset(i.level() for i in stack if i.key() == torch._C._functorch.TransformType.Jvp)


def _wrapper_levels(x: torch.Tensor) -> list[int]:
    levels = []
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        levels.append(torch._C._functorch.maybe_get_level(x))
        x = torch._C._functorch.get_unwrapped(x)
    return levels


def is_differentiated(x: torch.Tensor) -> bool:
    """Whether autograd or a torch.func grad transform tracks `x`, at any of its wrappers' levels."""
    if not is_inexact_tensor(x):
        return False
    while True:
        if x.requires_grad:
            return True
        if not torch._C._functorch.is_functorch_wrapped_tensor(x):
            return False
        x = torch._C._functorch.get_unwrapped(x)


def _name(func: Any) -> str | None:
    name = getattr(func, "__name__", None)
    if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and isinstance(name, str):
        return name.split(".")[0]  # "add_.Tensor" is add_
    return name


def _carries_no_gradient(func: Any) -> bool:
    name = _name(func)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA_PROPERTIES
    return name in _NO_GRADIENT_THROUGH


def _updated_statistics(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The running statistics a norm call is about to update."""
    is_op = isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
    rule = _NORM_OPS.get(_name(func) or "") if is_op else _NORM_FUNCTIONS.get(func)
    if rule is None:
        return []
    position, flag, default = rule
    if flag is not None and not (args[5] if len(args) > 5 else kwargs.get(flag, default)):
        return []
    return [*args[position : position + 2], kwargs.get("running_mean"), kwargs.get("running_var")]


@functools.cache
def _inplace_position(func: Any) -> int | None:
    """Where a Python function (F.dropout, F.leaky_relu) takes its `inplace` flag, if it has one."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return None
    return names.index("inplace") if "inplace" in names else None


def _updates_its_input(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if not isinstance(func, FunctionType):
        return False
    position = _inplace_position(func)
    return position is not None and bool(args[position] if len(args) > position else kwargs.get("inplace", False))


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a call is about to update in place: its `self` or input, its `out=`, a norm's statistics."""
    name = _name(func) or ""
    targets: list[Any] = _updated_statistics(func, args, kwargs) + pytree.tree_leaves(kwargs.get("out"))
    updates_self = name.endswith("_") and not name.startswith("__") and name != "requires_grad_"
    if args and (updates_self or name in _IN_PLACE_OPERATORS or _updates_its_input(func, args, kwargs)):
        targets.append(args[0])
    return [x for x in targets if isinstance(x, torch.Tensor)]


class Watch(TorchFunctionMode):
    """Runs a block's forward call by call, checking what it reads and saving what it overwrites.

    Args:
        name: The block's name, for error messages.
        inputs: The block's tensor arguments (the detached aliases it runs on).
        where: Each input's name in the call (`args[0]`), for error messages.
        differentiated: Whether each input is differentiated (updating one in place raises).
        jvp_levels: The outer `torch.func.jvp` levels: a captured tensor of one is refused whether
            it has a tangent or not, which cannot be read from inside the Function.

    Attributes:
        before: The value of each input the block updated in place, from before its first update.
        owners: For each tensor the block's calls returned (by id): `MADE` where it has memory of
            its own, the input's index where it shares an input's memory (a view, `.detach()`,
            `.data`), `CAPTURED` where it shares a captured tensor's.
    """

    def __init__(
        self,
        name: str,
        inputs: tuple[torch.Tensor, ...],
        where: list[str],
        differentiated: list[bool],
        jvp_levels: frozenset[int],
    ) -> None:
        super().__init__()
        self.name, self.inputs, self.where, self.differentiated = name, inputs, where, differentiated
        self.owners: dict[int, int] = {id(x): n for n, x in enumerate(inputs)}
        self.jvp_levels = jvp_levels
        self.before: dict[int, torch.Tensor] = {}

    def made(self, x: torch.Tensor) -> bool:
        """Whether `x` came out of one of the block's calls with memory of its own."""
        return self.owners.get(id(x)) == MADE

    def _refused(self, x: torch.Tensor) -> bool:
        # What the block made or took in is its own: its intermediates may wear this run's torch.func
        # level, whose number an outer jvp's (set aside for the run) can share.
        if self.owners.get(id(x), CAPTURED) != CAPTURED or not is_inexact_tensor(x):
            return False
        return is_differentiated(x) or not self.jvp_levels.isdisjoint(_wrapper_levels(x))

    def _check_read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and self._refused(leaf):
                # Not a TypeError: Tensor's operators turn a TypeError into NotImplemented.
                raise RuntimeError(
                    f"fmp.remat: {self.name} reads a tensor of shape {tuple(leaf.shape)} that is being "
                    f"differentiated but is not one of its arguments (a captured parameter or activation, "
                    f"or a tensor of an outer torch.func.jvp); its gradient or tangent would be lost. Pass it "
                    f"as an argument, or wrap the nn.Module itself (fmp.remat.remat(layer)), which passes the "
                    f"module's parameters for you"
                )

    def _save_before_write(self, target: torch.Tensor) -> None:
        owner = self.owners.get(id(target), CAPTURED)
        if owner == CAPTURED and target._base is not None:  # a view made where no call showed it
            owner = self.owners.get(id(target._base), CAPTURED)
        if owner == MADE:
            return
        if owner == CAPTURED:
            raise RuntimeError(
                f"fmp.remat: {self.name} updates a tensor of shape {tuple(target.shape)} in place that is not one of "
                f"its arguments (a buffer or running statistics it captured; or one made by a constructor fmp "
                f"cannot see, such as torch.from_numpy: make it with torch.tensor or torch.empty), so its recompute "
                f"would update it again. Wrap the nn.Module itself (fmp.remat.remat(layer)), or pass the tensor as an "
                f"argument"
            )
        if self.differentiated[owner]:
            raise RuntimeError(
                f"fmp.remat: {self.name} updates its argument {self.where[owner]} in place, so its recompute would "
                f"start from the updated value; update a copy (x = x.clone()) instead"
            )
        if owner not in self.before:
            self.before[owner] = self.inputs[owner].clone()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not _carries_no_gradient(func):
            self._check_read(args, kwargs)
        for target in _written(func, args, kwargs):
            self._save_before_write(target)
        out = func(*args, **kwargs)
        given = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        memory = {_memory(x): self.owners.get(id(x), CAPTURED) for x in given}
        memory.pop(0, None)
        for x in pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and all(x is not g for g in given):
                # An output in an argument's memory belongs where that argument does.
                self.owners[id(x)] = memory.get(_memory(x) or -1, MADE)
            elif isinstance(x, torch.Tensor) and id(x) not in self.owners:
                self.owners[id(x)] = CAPTURED  # an argument returned as it is (x.to(x.device))
        return out


def _memory(x: torch.Tensor) -> int:
    """Where `x`'s memory starts (0 where it cannot be told: no storage, or an empty one)."""
    try:
        return int(functorch_base(x).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0
