"""Tree utilities that never read a tensor's value on the host: finiteness, selection, casting, devices."""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import ItemsView
from collections.abc import Iterator
from collections.abc import KeysView
from collections.abc import Set
from collections.abc import ValuesView
from typing import Any
from typing import TypeVar
from typing import cast

import torch
import torch.utils._pytree as py_pytree

import fmp._pytree as pytree

__all__ = [
    "all_finite",
    "cast_floating",
    "check_finite_flag",
    "check_gradient_leaves",
    "check_no_opaque_leaves",
    "check_on_device",
    "clone_leaves",
    "functorch_base",
    "is_floating_tensor",
    "is_inexact_tensor",
    "leaves_accelerator_device",
    "same_static_leaf",
    "select_tree",
    "selectable_pairs",
    "takes_foreach",
    "tree_accelerator_device",
    "tree_device",
]

Tree = TypeVar("Tree")


def is_floating_tensor(leaf: Any) -> bool:
    """Whether `leaf` is a floating-point tensor (the only leaves a policy casts)."""
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point()


def is_inexact_tensor(leaf: Any) -> bool:
    """Whether `leaf` is a floating-point or complex tensor (the leaves fmp scales and checks)."""
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def functorch_base(x: torch.Tensor) -> torch.Tensor:
    """`x` with every `torch.func` wrapper (vmap's batching, an outer grad's tracking) taken off."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


# Containers that pytrees do not open: each is one leaf, so the tensors in it would go unseen.
# Iterators and dict views stand for a tree by mistake; a Module or a set may also be a genuine
# non-tensor argument (a model passed to the loss function for functional_call).
_ITERABLE_VIEWS = (Iterator, KeysView, ValuesView, ItemsView)
_OPAQUE_CONTAINERS = (*_ITERABLE_VIEWS, Set, torch.nn.Module)


def check_no_opaque_leaves(leaves: list[Any], tree: Any, name: str, *, allow_modules: bool = False) -> None:
    """Raises a TypeError if one of `tree`'s `leaves` is a container that pytrees treat as a leaf.

    A generator (`model.parameters()`), a dict view (`grads.values()`), a set or a Module holds
    tensors that every tree function would skip as a non-tensor leaf: an infinite gradient in it
    would read as finite and a cast would cast nothing.

    Args:
        leaves: `tree`'s leaves, as the caller already flattened them.
        tree: The tree, for the leaf's path in the message.
        name: What the tree is called in the message, e.g. "all_finite: tree".
        allow_modules: Let Modules and sets through (for trees of arguments, where they pass untouched).
    """
    refused = _ITERABLE_VIEWS if allow_modules else _OPAQUE_CONTAINERS
    for index, leaf in enumerate(leaves):
        # Tensors skip the isinstance against abstract classes: ~2 µs a leaf, 2.4 ms a step of 1,000.
        if not isinstance(leaf, torch.Tensor) and isinstance(leaf, refused):
            path = py_pytree.keystr(py_pytree.tree_flatten_with_path(tree)[0][index][0])
            raise TypeError(
                f"{name}{path} is a {type(leaf).__name__}, which pytrees keep as one opaque leaf, so the tensors "
                f"in it would go unseen; pass a list or a dict (e.g. [p.grad for p in model.parameters()] or "
                f"{{k: v.detach() for k, v in model.named_parameters()}})"
            )


def tree_device(tree: Any) -> torch.device | None:
    """The device of the first tensor leaf of `tree`, or None when it holds no tensor."""
    return next((x.device for x in pytree.tree_iter(tree) if isinstance(x, torch.Tensor)), None)


def check_gradient_leaves(grads: Any, name: str) -> None:
    """Raises a TypeError naming the first leaf of `grads` that is neither a tensor nor None (a frozen param's).

    A number or a numpy array among gradients would be left unscaled and unchecked, an inf in
    it read as finite. Opaque containers (a generator) are refused as `check_no_opaque_leaves` says.
    """
    leaves = pytree.tree_leaves(grads)
    check_no_opaque_leaves(leaves, grads, name)
    if all(isinstance(leaf, torch.Tensor) or leaf is None for leaf in leaves):
        return
    for path, leaf in py_pytree.tree_flatten_with_path(grads)[0]:
        if not (isinstance(leaf, torch.Tensor) or leaf is None):
            raise TypeError(f"{name}{py_pytree.keystr(path)} is a {type(leaf).__name__}; gradients must be tensors")


def check_on_device(tree: Any, device: torch.device | None, name: str, owner: str, hint: str) -> None:
    """Raises a ValueError naming the first tensor leaf of `tree` not on `device`, the `owner`'s (None: any).

    A step's state kept on another device than its params would drift to theirs on the first
    update (a 0-dim CPU tensor mixes with CUDA tensors), and a compiled step would recompile for it.
    """
    if device is None or all(
        leaf.device == device for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)
    ):
        return  # key paths only for the message: flattening with them costs several times a plain flatten
    for path, leaf in py_pytree.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            raise ValueError(
                f"{name}{py_pytree.keystr(path)} is on {leaf.device} but the {owner} are on {device}; {hint}"
            )


def tree_accelerator_device(tree: Any) -> torch.device | None:
    """The device of the first tensor leaf off the CPU, else of the first tensor leaf, else None.

    Where per-leaf results gather: collecting them there never copies from an accelerator to the host.
    """
    return leaves_accelerator_device([x for x in pytree.tree_iter(tree) if isinstance(x, torch.Tensor)])


def leaves_accelerator_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """`tree_accelerator_device` of a list of tensors already flattened."""
    for x in tensors:
        if not x.is_cpu:  # a property read, where `.device` builds a device object per leaf
            return x.device
    return tensors[0].device if tensors else None


def cast_floating(tree: Tree, dtype: torch.dtype) -> Tree:
    """Casts the floating-point tensor leaves of `tree` to `dtype`.

    Integer, bool and complex tensors, non-tensor leaves and `None` pass through untouched, and a
    leaf already in `dtype` is returned as is (no copy).

    Args:
        tree: Any pytree.
        dtype: The floating-point dtype to cast to.

    Returns:
        A tree of the same structure.

    Raises:
        TypeError: If `dtype` is not a floating-point `torch.dtype`, or a leaf is an iterator or a
            dict view (`model.parameters()`, `grads.values()`), which pytrees do not open. A Module
            leaf (a model passed as an argument) passes untouched.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"cast_floating: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if type(tree) is torch.Tensor:  # one leaf, such as a loss: no tree to walk
        leaf = cast(torch.Tensor, tree)
        return cast(Tree, leaf.to(dtype) if leaf.is_floating_point() and leaf.dtype != dtype else leaf)
    check_no_opaque_leaves(pytree.tree_leaves(tree), tree, "cast_floating: tree", allow_modules=True)
    return cast(Tree, pytree.tree_map(lambda x: x.to(dtype) if is_floating_tensor(x) and x.dtype != dtype else x, tree))


_ROW_LENGTH = 1024


def _values(x: torch.Tensor) -> torch.Tensor:
    return (x.coalesce() if x.dtype == torch.float16 else x)._values()


def takes_foreach(leaves: list[Any], device: torch.device) -> bool:
    """Whether eager code may hand `leaves` to torch's multi-tensor (`_foreach_*`) kernels at once.

    Every leaf a plain, contiguous float32 tensor on `device` that autograd does not track, and
    that takes writes (not an inference tensor outside inference mode), and at least one (the
    kernels refuse empty lists); not while compiling, where Inductor fuses the per-leaf form, nor
    under `torch.func` transforms.
    """
    if torch.compiler.is_compiling() or torch._C._functorch.get_interpreter_stack() or not leaves:
        return False
    inference_mode = torch.is_inference_mode_enabled()
    on_cpu = device.type == "cpu"
    tensor, float32 = torch.Tensor, torch.float32
    # One loop, each leaf's properties read once: an eager step asks this of every leaf of its state.
    for x in leaves:
        if type(x) is not tensor or x.dtype != float32 or x.requires_grad or not x.is_contiguous():
            return False
        if not inference_mode and x.is_inference():
            return False
        # `is_cpu` on a CPU: a property read, where `.device` builds a device object per leaf.
        if (not x.is_cpu) if on_cpu else (x.device != device):
            return False
    return True


def clone_leaves(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `leaves`, bit for bit: one multi-tensor call eager, where it takes them; else one clone each."""
    plain = leaves and all(type(x) is torch.Tensor for x in leaves)
    if plain and not (torch.compiler.is_compiling() or torch._C._functorch.get_interpreter_stack()):
        return list(torch._foreach_clone(leaves))
    return [x.clone() for x in leaves]


def _finite_whole(x: torch.Tensor) -> torch.Tensor:
    # min and max propagate NaN, and are finite only if every element is: one read of the leaf, no
    # temporary (isfinite(x).all() writes a bool copy first, ~20x slower in eager CPU).
    low, high = torch.aminmax(x)
    return torch.isfinite(low) & torch.isfinite(high)


def _finite_magnitude(x: torch.Tensor) -> torch.Tensor:
    # Compiled, one reduction that Inductor fuses with the producer of `x`: a single scalar buffer
    # per leaf, where aminmax allocates two.
    return torch.isfinite(x.abs().amax())


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """A bool vector: whether each row of a 2-D view of `x` is finite (for compiled GPU code).

    For GPUs Inductor splits a reduction to one scalar into stages that cannot fuse with the kernel
    that writes `x`; a reduction along rows can, so a compiled unscale reads each gradient once. One
    reduction (the largest magnitude, which propagates NaN) rather than aminmax's two outputs, and
    `all_finite` concatenates every leaf's row flags into one final reduction rather than one per
    leaf: on 200 gradients of 1 MB that is 27 kernels instead of 76 with Inductor's 8 gradients per
    combo kernel, 9 with 64 (benchmarks/RESULTS.md).
    """
    if x.dim() >= 2:
        rows = x.reshape(x.shape[0], -1)
    elif x.numel() % _ROW_LENGTH == 0:
        rows = x.reshape(-1, _ROW_LENGTH)
    else:
        rows = x.reshape(1, -1)
    return torch.isfinite(rows.abs().amax(dim=-1))


def _real_view(x: torch.Tensor) -> torch.Tensor:
    real = torch.view_as_real(x)
    return real.flatten(-2) if x.dim() >= 1 else real


def all_finite(tree: Any) -> torch.Tensor:
    """Returns a 0-dim bool tensor: True when every floating-point and complex leaf is finite.

    Integer and bool leaves are finite by construction, and non-tensor and empty leaves are
    ignored; an empty tree is finite. The result stays on the device (no host sync).

    Args:
        tree: Any pytree, typically gradients.

    Returns:
        A 0-dim bool tensor on the first accelerator among the leaves' devices, else on the CPU:
        gathering per-leaf flags there never copies from an accelerator to the host.
    """
    all_leaves = pytree.tree_leaves(tree)
    check_no_opaque_leaves(all_leaves, tree, "all_finite: tree")
    # A sparse COO gradient (nn.Embedding(sparse=True)) by its stored values, coalesced in float16
    # first as GradScaler does, where summing duplicates can overflow.
    leaves = [_values(x) if x.layout == torch.sparse_coo else x for x in all_leaves if is_inexact_tensor(x)]
    leaves = [x for x in leaves if x.numel() > 0]
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    # A complex leaf's real and imaginary parts side by side in its last dimension, so a 1-D leaf
    # keeps long rows.
    # float8 has no reductions on a CPU; float32 holds each of its values, NaN and inf included.
    leaves = [_real_view(x) if x.is_complex() else x.float() if x.element_size() == 1 else x for x in leaves]
    device = cast(torch.device, tree_accelerator_device(leaves))
    # Row by row pays only in compiled GPU code: eager, or compiled for a CPU (where Inductor fuses
    # a full reduction with its producer), one full reduction per leaf is 3 to 6 times faster.
    if not torch.compiler.is_compiling():
        finite = _finite_whole
    elif device.type != "cpu":
        return torch.cat([_finite_rows(x).to(device) for x in leaves]).all()
    else:
        finite = _finite_magnitude
    flags = [finite(x).to(device) for x in leaves]
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def check_finite_flag(grads_finite: Any, name: str = "grads_finite") -> None:
    """Raises unless `grads_finite` is a 0-dim bool tensor (a static check: no host sync)."""
    if not isinstance(grads_finite, torch.Tensor):
        raise TypeError(f"{name} must be a 0-dim bool tensor, got {type(grads_finite).__name__}")
    if grads_finite.dtype != torch.bool or grads_finite.dim() != 0:
        raise ValueError(
            f"{name} must be a 0-dim bool tensor (e.g. from fmp.all_finite), "
            f"got dtype={grads_finite.dtype} shape={tuple(grads_finite.shape)}"
        )


def same_static_leaf(a: Any, b: Any) -> bool:
    """Whether two non-tensor leaves are one value (`==`), for trees that must agree on them."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. numpy arrays, whose == is elementwise
        return False


def select_tree(pred: torch.Tensor, on_true: Tree, on_false: Tree) -> Tree:
    """Picks `on_true` where `pred` holds and `on_false` elsewhere, leaf by leaf, without a host sync.

    The chosen side's values come back bit for bit (NaN payloads and signed zeros included): the
    other side may hold NaN or inf without leaking into the result.

    Args:
        pred: A 0-dim bool tensor.
        on_true: A pytree.
        on_false: A pytree with the same structure, shapes and dtypes as `on_true`.

    Returns:
        A pytree with the structure of `on_true`.

    Raises:
        ValueError: If the two trees differ in structure, or a pair of leaves in shape or dtype.
    """
    spec, pairs = selectable_pairs(pred, on_true, on_false)
    selected = [torch.where(pred, a, b) if isinstance(a, torch.Tensor) else a for a, b in pairs]
    return cast(Tree, pytree.tree_unflatten(selected, spec))


def selectable_pairs(pred: torch.Tensor, on_true: Any, on_false: Any) -> tuple[pytree.TreeSpec, list[tuple[Any, Any]]]:
    """Checks `select_tree`'s arguments; returns `on_true`'s spec and the two trees' leaves in pairs.

    Raises:
        ValueError: As `select_tree`.
    """
    check_finite_flag(pred, name="pred")
    true_leaves, true_spec = pytree.tree_flatten(on_true)
    false_leaves, false_spec = pytree.tree_flatten(on_false)
    if true_spec != false_spec:
        raise ValueError(
            f"select_tree needs two trees of one structure, got {pytree.spec_str(true_spec)} "
            f"and {pytree.spec_str(false_spec)}"
        )
    pairs = list(zip(true_leaves, false_leaves, strict=True))
    for index, (a, b) in enumerate(pairs):
        # The usual pair, two tensors alike, passes with no check object made for it.
        alike = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        if not (alike and a.dtype == b.dtype):
            _check_selectable(a, b, functools.partial(_leaf_path, on_true, index))
    return true_spec, pairs


def _leaf_path(tree: Any, index: int) -> str:
    # Key paths only for messages: flattening with them costs several times a plain flatten.
    return py_pytree.keystr(py_pytree.tree_flatten_with_path(tree)[0][index][0])


def _check_selectable(a: Any, b: Any, where: Callable[[], str]) -> None:
    """Raises naming the leaf (`where()`) unless `a` and `b` can be selected between."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        raise ValueError(f"select_tree: leaf {where()} is a tensor on one side only")
    if not isinstance(a, torch.Tensor):
        if not same_static_leaf(a, b):
            raise ValueError(f"select_tree: non-tensor leaf {where()} differs: {a!r} vs {b!r}")
    elif a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"select_tree: leaf {where()} is {a.dtype}{list(a.shape)} on one side "
            f"and {b.dtype}{list(b.shape)} on the other"
        )
