"""Calls whose public name is not the op torch.autocast catches, against torch.autocast itself.

torch.autocast acts on aten ops after torch's C++ has split a call up: `x.square()` is caught as
pow, `torch.special.log_softmax` as log_softmax, `F.pad(x, p, mode="reflect")` as
reflection_pad2d, a fully contracted tensordot as dot. fmp sees the public call, and routes it to
the op torch reaches. Each case here runs under torch.autocast("cpu") (dtypes and values, bit for
bit, against rules="cpu") and torch.autocast("cuda") on fake CUDA tensors (dtypes, against
rules="cuda"); a sweep over every function the mode can see catches the names no case lists.
einsum, which torch casts itself on CUDA, is tested in test_autocast.py and
test_autocast_cuda_rules.py.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import bits
from test_autocast import _assert_same_outcome
from test_autocast import _dtypes
from test_autocast import _generic_samples
from test_autocast import _outcome
from test_autocast import _to
from test_autocast_cuda_rules import under_torch_cuda_autocast
from torch import nn

from fmp.autocast import autocast
from fmp.autocast._overrides import seen_names
from fmp.autocast._paths import CALLS
from fmp.autocast._paths import ROUTES

LOW = [torch.bfloat16, torch.float16]
Case = Callable[[torch.dtype], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]


def _same(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Case:
    """A case whose floating inputs all come in the input dtype of the test."""
    return lambda dtype: (op, *_to((args, kwargs), dtype))


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


_A = torch.randn(4, 4, generator=_gen())
M = _A @ _A.T / 4 + torch.eye(4)  # symmetric positive definite, well conditioned
V = torch.rand(4, generator=_gen()) * 0.8 + 0.1  # in (0, 1)
T3 = torch.randn(2, 3, 4, generator=_gen())


def _pads() -> Iterator[tuple[str, Case]]:
    for mode in ["reflect", "replicate", "circular", "constant"]:
        for padded in (1, 2, 3):
            for extra in (1, 2):  # a channel dim, or a batch and a channel dim
                x = torch.randn(*[1] * (extra - 1), 2, *[4] * padded, generator=_gen())
                yield f"F.pad-{mode}-{padded}d-{x.dim()}", _same(F.pad, x, (1, 1) * padded, mode=mode)
    yield "F.pad-reflect-1d-4", _same(F.pad, torch.randn(1, 2, 4, 4), (1, 1), "reflect")  # torch refuses it
    yield "F.pad-keywords", _same(F.pad, input=torch.randn(1, 2, 4), pad=(1, 1), mode="replicate")
    for module in [nn.ReflectionPad1d, nn.ReplicationPad1d, nn.CircularPad1d]:
        yield module.__name__, _same(module(1), torch.randn(1, 2, 4))
    for module in [nn.ReflectionPad2d, nn.ReplicationPad2d, nn.ReflectionPad3d, nn.ReplicationPad3d]:
        yield module.__name__, _same(module(1), torch.randn(1, 2, *[3] * int(module.__name__[-2])))


CASES: dict[str, Case] = {
    # Ops on the float32 lists, under another name or inside a composite.
    "Tensor.square": _same(torch.Tensor.square, V),
    "torch.square": _same(torch.square, V),
    "linalg.norm": _same(torch.linalg.norm, M),
    "linalg.norm-vector-ord": _same(torch.linalg.norm, V, 3),
    "linalg.norm-matrix-ord": _same(torch.linalg.norm, M, 1),
    "linalg.norm-fro": _same(torch.linalg.norm, M, "fro"),
    "linalg.norm-dims": _same(torch.linalg.norm, T3, float("inf"), (1, 2)),
    "linalg.norm-dim": _same(torch.linalg.norm, T3, 1, 2),
    "linalg.norm-keywords": _same(torch.linalg.norm, input=M, ord=-1, keepdim=True),
    "pairwise_distance": _same(F.pairwise_distance, M, M.flip(0)),
    "triplet_margin_with_distance_loss": _same(F.triplet_margin_with_distance_loss, M, M.flip(0), M.flip(1)),
    "special.log_softmax": _same(torch.special.log_softmax, M, 0),
    "special.softmax": _same(torch.special.softmax, M, -1),
    "special.logsumexp": _same(torch.special.logsumexp, M, 1),
    "special.expm1": _same(torch.special.expm1, V),
    "special.log1p": _same(torch.special.log1p, V),
    "special.erfinv": _same(torch.special.erfinv, V),
    "arccos": _same(torch.arccos, V),
    "Tensor.arcsin": _same(torch.Tensor.arcsin, V),
    "arctan2-mixed": lambda dtype: (torch.arctan2, (V.to(dtype), V), {}),
    "trapezoid": _same(torch.trapezoid, M),
    "trapezoid-x": _same(torch.trapezoid, M, V.cumsum(0)),
    "trapz-dx": _same(torch.trapz, M, dx=0.5),
    "cumulative_trapezoid": _same(torch.cumulative_trapezoid, M),
    "norm_except_dim": _same(torch.norm_except_dim, M, 2, 0),
    "sum_to_size": _same(torch.Tensor.sum_to_size, M, 1, 4),
    "sum_to_size-list": _same(torch.Tensor.sum_to_size, T3, [3, 4]),
    "sum_to_size-none": _same(torch.Tensor.sum_to_size, M, (4, 4)),
    "sum_to_size-none-ones": _same(torch.Tensor.sum_to_size, M[:1], 1, 4),  # size-1 dims that stay: no sum
    "rnn_relu_cell": _same(torch.rnn_relu_cell, M[:2], M[:2], M, M, V, V),
    "rnn_tanh_cell": _same(torch.rnn_tanh_cell, M[:2], M[:2], M, M, V, V),
    # Matmuls under another name, and the powers that reach one.
    "linalg.matmul": _same(torch.linalg.matmul, M, M),
    "x @ y": _same(operator.matmul, M, M),
    "Tensor.__rmatmul__": _same(torch.Tensor.__rmatmul__, M, M),
    **{f"matrix_power-{n}": _same(torch.matrix_power, M, n) for n in (-3, -2, -1, 0, 1, 2, 3, 4)},
    "linalg.matrix_power--2": _same(torch.linalg.matrix_power, M, -2),
    "linalg.matrix_power-3": _same(torch.linalg.matrix_power, M, 3),
    "Tensor.matrix_power": _same(torch.Tensor.matrix_power, M, 2),
    "matrix_power-keywords": _same(torch.matrix_power, input=M, n=-2),
    "chain_matmul-1": _same(torch.chain_matmul, M),
    "chain_matmul-3": _same(torch.chain_matmul, M, M, M),
    "multi_dot": _same(torch.linalg.multi_dot, [V, M, V]),
    # tensordot and inner reach dot (not cast on CPU) where nothing is left outside the contraction.
    "tensordot-full": _same(torch.tensordot, M, M),
    "tensordot-1": _same(torch.tensordot, M, M, 1),
    "tensordot-0": _same(torch.tensordot, V, V, 0),
    "tensordot-lists": _same(torch.tensordot, T3, M, ([2], [0])),
    "tensordot-transposed-full": _same(torch.tensordot, M, M, ([1, 0], [0, 1])),
    "tensordot-tensor-dims": _same(torch.tensordot, M, M, torch.tensor(2)),
    "tensordot-size-1": _same(torch.tensordot, M[:1], M[:, :1], 1),
    "tensordot-vector-matrix": _same(torch.tensordot, V, M, 1),
    "tensordot-keywords": _same(torch.tensordot, a=M, b=M, dims=1),
    "inner-vectors": _same(torch.inner, V, V),
    "inner-matrix-vector": _same(torch.inner, M, V),
    "inner-matrices": _same(torch.inner, M, M),
    "inner-scalar": _same(torch.inner, V, torch.tensor(2.0)),
    "Tensor.lu": _same(torch.Tensor.lu, M),
    "torch.lu": _same(torch.lu, M),
    "view_as_complex_copy": _same(torch.view_as_complex_copy, M.reshape(8, 2)),
    **dict(_pads()),
}  # fmt: skip


def _under_torch_cpu(op: Callable[..., Any], args: Any, kwargs: Any, dtype: torch.dtype) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast("cpu", dtype):
                return op(*args, **kwargs)
        except Exception as error:
            return type(error)


def _under_fmp(op: Callable[..., Any], args: Any, kwargs: Any, dtype: torch.dtype, rules: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return autocast(op, dtype, rules=rules)(*args, **kwargs)
        except Exception as error:
            return type(error)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", CASES)
def test_cpu_rules_match_torch_autocast_cpu_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    for input_dtype in (torch.float32, dtype):
        op, args, kwargs = CASES[name](input_dtype)
        expected = _under_torch_cpu(op, args, kwargs, dtype)
        _assert_same_outcome(_under_fmp(op, args, kwargs, dtype, "cpu"), expected)


# A fake tensor has no value, so torch's tensordot cannot read its dims from one.
NOT_FAKEABLE = {"tensordot-tensor-dims"}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(set(CASES) - NOT_FAKEABLE))
def test_cuda_rules_give_torch_cuda_autocasts_dtypes(name: str, dtype: torch.dtype) -> None:
    compared = 0
    for input_dtype in (torch.float32, dtype):
        op, args, kwargs = CASES[name](input_dtype)
        expected = under_torch_cuda_autocast(op, args, kwargs, dtype)
        got = _outcome(lambda op=op, args=args, kwargs=kwargs: autocast(op, dtype, rules="cuda")(*args, **kwargs))
        if isinstance(expected, list) == isinstance(got, list):
            assert got == expected, input_dtype
            compared += 1
        # Otherwise only one side has a kernel: no CPU kernel for this dtype here, or no meta kernel.
    assert compared, "nothing compared"


def test_routes_end_and_name_ops_the_mode_knows() -> None:
    for name in CALLS:
        seen = [name]
        while seen[-1] in CALLS:
            seen.append(CALLS[seen[-1]])
            assert len(seen) <= len(CALLS), f"{name} routes in a cycle: {seen}"
    assert set(CALLS) | set(CALLS.values()) | set(ROUTES) <= seen_names()


# Functions the sweep does not call: a slow iterative solver, and operators that write into their inputs
# (in-place methods, named with a trailing underscore, are left out too).
SWEEP_SKIPS = {"lobpcg", "__setitem__", "__setstate__"} | {
    f"__i{op}__" for op in ("add", "and", "div", "floordiv", "lshift", "mod", "mul", "or", "rshift", "sub", "xor")
}

# C++ composites that torch.autocast("cpu") casts halfway through, which fmp cannot mirror by casting
# the call's inputs: cov and corrcoef average in float32 then reach mm; pinv runs svd (float32 list)
# then matmul. fmp leaves them in their inputs' dtypes.
CPU_DIFFERENCES = {"cov", "corrcoef", "linalg_pinv"}


def _sweep_ops() -> Iterator[tuple[str, Callable[..., Any]]]:
    for namespace, functions in torch.overrides.get_overridable_functions().items():
        for op in functions:
            name = getattr(op, "__name__", "")
            in_place = name.endswith("_") and not name.endswith("__")
            if name and not in_place and name not in SWEEP_SKIPS:
                yield f"{getattr(namespace, '__name__', namespace)}.{name}", op


@functools.cache
def _sweep_samples() -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    """Each function with the first generic sample it runs on in float32 and returns a floating tensor from."""
    found = []
    for label, op in _sweep_ops():
        for args in _generic_samples():
            result = _outcome(lambda op=op, args=args: op(*args))
            if isinstance(result, list) and any(d in (torch.float32, torch.complex64) for d in result):
                found.append((label, op, args))
                break
    return found


@pytest.mark.parametrize("rules", ["cpu", "cuda"])
def test_sweep_every_function_the_mode_sees_matches_torch(rules: str) -> None:
    dtype = torch.bfloat16 if rules == "cpu" else torch.float16  # the dtype each device autocasts to
    samples = _sweep_samples()
    assert len(samples) > 700
    mismatches = []
    for label, op, samples_args in samples:
        if rules == "cpu" and getattr(op, "__name__", "") in CPU_DIFFERENCES:
            continue
        for input_dtype in (torch.float32, dtype):
            args = _to(samples_args, input_dtype)
            got = _outcome(lambda op=op, args=args: autocast(op, dtype, rules=rules)(*args))
            if rules == "cpu":
                expected = _under_torch_cpu(op, args, {}, dtype)
                expected = expected if isinstance(expected, type) else _dtypes(expected)
            else:
                expected = under_torch_cuda_autocast(op, args, {}, dtype)
                if not isinstance(expected, list) or not isinstance(got, list):
                    continue  # no meta kernel for the fake tensors, or no CPU kernel in this dtype here
            if got != expected:
                mismatches.append((label, input_dtype, expected, got))
    assert not mismatches, mismatches


def _routed(x: torch.Tensor, m: torch.Tensor) -> list[torch.Tensor]:
    return [
        x.square(), torch.linalg.norm(x), torch.special.logsumexp(x, 0), F.pairwise_distance(x, x.flip(0)),
        torch.matrix_power(m, -2), torch.linalg.matrix_power(m, 3), torch.linalg.matmul(m, m), m.__rmatmul__(m),
        torch.tensordot(m, m), torch.tensordot(m, m, 1), torch.inner(x[0], x[0]), torch.inner(m, m),
        torch.einsum("ij,ij->ij", m, m), F.pad(x[None, None], (1, 1, 1, 1), mode="reflect"), m.lu()[0],
        torch.split(x, 2)[0],
    ]  # fmt: skip


@pytest.mark.compiled
@pytest.mark.parametrize("rules", ["cpu", "cuda"])
def test_compiled_routes_match_eager_in_one_graph(rules: str) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    x, m = torch.randn(4, 4, generator=_gen()), M
    eager = autocast(_routed, torch.bfloat16, rules=rules)
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(eager, fullgraph=True, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.lu's deprecation, raised inside Tensor.lu
        expected, got = eager(x, m), compiled(x, m)
    assert _dtypes(got) == _dtypes(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(bits(a), bits(b))
    assert backend.frame_count == 1
