"""The "cuda" rule set against torch.autocast("cuda") itself, run on fake CUDA tensors on this CPU.

A fake tensor on device "cuda" dispatches through torch's AutocastCUDA kernels without a GPU, so
the output dtype torch.autocast("cuda") gives each op is measured here, and the op set is read from
the dispatcher: an op torch newly registers for AutocastCUDA fails here until "cuda" has a rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from test_autocast import _dtypes
from test_autocast import _outcome
from test_autocast import _sample
from test_autocast import _to
from torch._subclasses.fake_tensor import FakeTensorMode

from fmp.autocast import autocast
from fmp.autocast._rules import CUDA

LOW = [torch.bfloat16, torch.float16]
CUDA_OPS = sorted(
    {key.split("::")[-1].split(".")[0] for key in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}
)


def under_torch_cuda_autocast(op: Callable[..., Any], args: Any, kwargs: Any, dtype: torch.dtype) -> Any:
    """The output dtypes of `op` under torch.autocast("cuda", dtype), on fake CUDA tensors."""
    mode = FakeTensorMode()
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    # torch.autocast("cuda") refuses to turn on without a GPU; the dispatcher's flags do not.
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        with mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fake_args, fake_kwargs = pytree.tree_map(
                lambda x: torch.empty(x.shape, dtype=x.dtype, device="cuda") if isinstance(x, torch.Tensor) else x,
                (args, kwargs),
            )
            return _dtypes(op(*fake_args, **fake_kwargs))
    except Exception as error:
        return type(error)
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def test_every_op_torch_autocasts_on_cuda_has_a_cuda_rule() -> None:
    assert len(CUDA_OPS) > 100
    assert set(CUDA_OPS) <= set(CUDA), sorted(set(CUDA_OPS) - set(CUDA))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_cuda_rules_give_torch_cuda_autocasts_dtypes(dtype: torch.dtype, input_dtype: torch.dtype) -> None:
    checked = []
    for name in CUDA_OPS:
        sample = _sample(name)
        if sample is None:
            continue  # internal ops (cudnn_convolution, _thnn_fused_*), reached through public ones
        op, args, kwargs = sample
        args, kwargs = _to((args, kwargs), input_dtype)
        expected = under_torch_cuda_autocast(op, args, kwargs, dtype)
        if not isinstance(expected, list):
            continue  # no meta kernel for the fake tensors
        got = _outcome(autocast(lambda op=op, args=args, kwargs=kwargs: op(*args, **kwargs), dtype, rules="cuda"))
        if not isinstance(got, list):
            continue  # no CPU kernel for this op in this dtype
        assert got == expected, name
        checked.append(name)
    assert len(checked) >= 50, checked


EINSUMS = {
    "ij,jk->ik": [(3, 4), (4, 5)],
    "bhqd,bhkd->bhqk": [(1, 2, 3, 4), (1, 2, 3, 4)],
    "i,i->": [(4,), (4,)],
    "ij,ij->ij": [(3, 4), (3, 4)],  # no index summed over two operands: no bmm on CPU
    "i,j->ij": [(3,), (4,)],
    "ij->j": [(3, 4)],
    "ii": [(3, 3)],
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("equation", EINSUMS)
def test_cuda_rules_cast_every_einsum_as_torch_cuda_does(equation: str, dtype: torch.dtype) -> None:
    # torch registers einsum itself for AutocastCUDA, so the CUDA path never reaches the bmm test
    # that decides it on CPU.
    operands = [torch.randn(shape) for shape in EINSUMS[equation]]
    for input_dtype in (torch.float32, dtype):
        args = (equation, *_to(operands, input_dtype))
        expected = under_torch_cuda_autocast(torch.einsum, args, {}, dtype)
        assert expected == [dtype]
        assert _outcome(lambda args=args: autocast(torch.einsum, dtype, rules="cuda")(*args)) == expected
