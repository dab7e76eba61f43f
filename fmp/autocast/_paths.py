"""Which op a public torch call reaches inside torch, where torch.autocast casts it.

fmp's mode sees public calls (`x.square()`, `torch.special.softmax`, `F.pad`); torch.autocast sees
the aten ops torch's C++ turns them into (pow, softmax, reflection_pad2d). `call_path` gives those
inner ops, outermost first, so the mode can apply the rule of the first one a rule set lists:
`CALLS` for calls that always reach one op, `ROUTES` for those whose path depends on the arguments
(measured against torch.autocast with torch 2.13).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["CALLS", "ROUTES", "Path", "argument", "call_path", "negative_power"]


def _einsum_contracts(args: tuple[Any, ...]) -> bool:
    """Whether torch's einsum reaches bmm, the op torch.autocast casts: an index summed over two operands."""
    equation = args[0] if args else None
    operands = args[1:] if len(args) != 2 or isinstance(args[1], torch.Tensor) else args[1]
    if not isinstance(equation, str):
        return sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args)) > 1  # sublist form: assume so
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) < 2 or len(operands) < 2:
        return False  # one operand: a sum or trace, no bmm
    letters = [set(filter(str.isalpha, term)) for term in terms]
    if not arrow:  # implicit output: the indices that appear once, so the summed ones appear twice
        rhs = "".join(c for c in lhs if c.isalpha() and lhs.count(c) == 1)
    summed = set().union(*letters) - set(rhs)
    return any(sum(c in term for term in letters) > 1 for c in summed)


Path = tuple[str, ...]
"""The ops a call reaches inside torch, outermost first: torch.autocast casts at the first one it lists."""


def argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, *names: str) -> Any:
    """The argument at position `index`, or given by one of the keyword `names`; None if absent."""
    if len(args) > index:
        return args[index]
    return next((kwargs[name] for name in names if name in kwargs), None)


def _einsum_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    return ("bmm",) if _einsum_contracts(args) else ()


def _kept_numel(x: torch.Tensor, dims: Iterable[int]) -> int:
    """The number of elements of `x` per element of its contracted `dims`."""
    contracted = {d % max(x.dim(), 1) for d in dims}
    return math.prod([size for i, size in enumerate(x.shape) if i not in contracted])


def _tensordot_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    """Matrices for mm, or vectors for dot where the contraction leaves one element of each input."""
    a, b = argument(args, kwargs, 0, "a", "input"), argument(args, kwargs, 1, "b", "other")
    dims_a, dims_b = argument(args, kwargs, 2, "dims_self"), argument(args, kwargs, 3, "dims_other")
    if dims_b is None:  # torch.tensordot's `dims`: a count, a pair of dim lists, or a tensor of either
        dims = argument(args, kwargs, 2, "dims")
        # A tensor `dims` is read on the host, as torch.tensordot itself reads it.
        dims = 2 if dims is None else dims.tolist() if isinstance(dims, torch.Tensor) else dims
        dims_a, dims_b = (range(a.dim() - dims, a.dim()), range(dims)) if isinstance(dims, int) else dims
    return ("dot",) if _kept_numel(a, dims_a) == 1 == _kept_numel(b, dims_b) else ("mm",)


def _inner_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    a, b = argument(args, kwargs, 0, "input"), argument(args, kwargs, 1, "other")
    if a.dim() == 0 or b.dim() == 0:
        return ("mul",)
    return ("tensordot", *_tensordot_path((a, b, [-1], [-1]), {}))


def _chain_matmul_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    # One matrix comes back as a copy. torch.chain_matmul(*matrices) calls _VF.chain_matmul(matrices).
    return ("mm",) if sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args)) > 1 else ()


def _matrix_power_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    # Powers 0 and 1 are the identity and a copy; a negative one inverts first (`negative_power`).
    return ("matmul",) if argument(args, kwargs, 1, "n") >= 2 else ()


def negative_power(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a matrix_power call raises to a negative power, which torch takes in two steps.

    torch inverts the matrix, then raises the inverse to -n: torch.autocast casts each step by its
    own rule (on CPU, the inverse in float32 and its products in the lower dtype).
    """
    n = argument(args, kwargs, 1, "n")
    return isinstance(n, int) and n < 0 and kwargs.get("out") is None


def _linalg_norm_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    x, order, dim = (
        argument(args, kwargs, 0, "input"),
        argument(args, kwargs, 1, "ord"),
        argument(args, kwargs, 2, "dim"),
    )
    # An order over two dims (given, or those of a matrix) is a matrix norm; without an order, the 2-norm of a vector.
    reduced = x.dim() if dim is None else 1 if isinstance(dim, int) else len(dim)
    matrix = isinstance(order, str) or (order is not None and reduced == 2)
    return ("linalg_matrix_norm",) if matrix else ("linalg_vector_norm",)


def _pad_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    x, pad, mode = (
        argument(args, kwargs, 0, "input"),
        argument(args, kwargs, 1, "pad"),
        argument(args, kwargs, 2, "mode"),
    )
    kind = {"reflect": "reflection", "replicate": "replication"}.get(mode)
    padded = len(pad) // 2
    # torch pads the last 1 to 3 dims of an input with one or two leading (batch, channel) dims.
    if kind is None or len(pad) % 2 or padded not in (1, 2, 3) or x.dim() not in (padded + 1, padded + 2):
        return ()
    return (f"{kind}_pad{padded}d",)


def _sum_to_size_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    x = args[0]
    size = args[1] if len(args) == 2 and isinstance(args[1], Sequence) else args[1:] or kwargs.get("size", ())
    leading = x.dim() - len(size)
    # A size that broadcasts to the input's without reduction returns the input itself.
    reduces = leading > 0 or any(s == 1 and n != 1 for s, n in zip(size, x.shape[leading:], strict=True))
    return ("sum",) if reduces else ()


def _lstm_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    # On CPU a padded batch's LSTM runs its layers as mkldnn_rnn_layer; a packed one's (its batch
    # sizes come second, where the padded form takes hx) runs on ops torch.autocast does not list.
    packed = isinstance(argument(args, kwargs, 1, "batch_sizes"), torch.Tensor)
    return () if packed else ("mkldnn_rnn_layer",)


def _sparse_mm_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    # torch.sparse.mm reaches mm for a dense second matrix and no reduction; a sparse one goes to
    # sparse_sparse_matmul and a reduction to _sparse_mm_reduce_impl, which torch.autocast leaves alone.
    dense = argument(args, kwargs, 1, "dense", "mat2").layout == torch.strided
    return ("mm",) if dense and argument(args, kwargs, 2, "reduce") is None else ()


def _sparse_addmm_path(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    return ("addmm",) if argument(args, kwargs, 2, "mat2").layout == torch.strided else ()


# Ops that reach one other op on their inputs, whatever the arguments. fmp casts the whole call by
# that op's rule, so arithmetic torch runs before it (pairwise_distance's subtraction, trapezoid's
# additions) runs in that dtype too.
CALLS: dict[str, str] = {
    # Aliases: torch.special's, NumPy's and torch.linalg's names for listed ops.
    "special_expm1": "expm1", "special_log1p": "log1p", "special_erfinv": "erfinv", "special_softmax": "softmax",
    "special_log_softmax": "log_softmax", "special_logsumexp": "logsumexp", "arccos": "acos", "arcsin": "asin",
    "arctan2": "atan2", "linalg_matmul": "matmul", "linalg_matrix_power": "matrix_power",
    "view_as_complex_copy": "view_as_complex",
    # C++ composites.
    "square": "pow", "pairwise_distance": "norm", "norm_except_dim": "norm", "trapezoid": "sum", "trapz": "sum",
    "cumulative_trapezoid": "cumsum", "linalg_multi_dot": "mm",
    # Tensor's Python methods (torch._tensor), whose bodies the mode does not see.
    "__rmatmul__": "matmul", "lu": "_lu_with_info",
}  # fmt: skip

# Ops whose path depends on the arguments (measured against torch.autocast with torch 2.13).
ROUTES: dict[str, Callable[[tuple[Any, ...], Mapping[str, Any]], Path]] = {
    "einsum": _einsum_path,
    "tensordot": _tensordot_path,
    "inner": _inner_path,
    "chain_matmul": _chain_matmul_path,
    "matrix_power": _matrix_power_path,
    "linalg_norm": _linalg_norm_path,
    "pad": _pad_path,
    "sum_to_size": _sum_to_size_path,
    "lstm": _lstm_path,
    "_sparse_mm": _sparse_mm_path,
    "_sparse_addmm": _sparse_addmm_path,
}


def call_path(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Path:
    """The ops a call of `name` reaches inside torch, outermost first, itself left out."""
    path: list[str] = []
    while name in CALLS:
        name = CALLS[name]
        path.append(name)
    route = ROUTES.get(name)
    if route is None:
        return tuple(path)
    try:
        return (*path, *route(args, kwargs))
    except (TypeError, ValueError, AttributeError, IndexError):
        return tuple(path)  # arguments torch itself rejects: its own call reports them
