"""fmp's fixed-dtype regions inside torch.autocast: off inside, as custom_fwd and autocast(enabled=False)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fmp

REGIONS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]] = {
    "fixed_dtype": lambda fn: fmp.fixed_dtype(fn, torch.float32),
    "no_autocast": fmp.no_autocast,
}


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@pytest.mark.parametrize("region", REGIONS)
def test_a_region_turns_torch_autocast_off_inside_and_only_inside(region: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 3, generator=gen)
    wrapped = REGIONS[region](matmul)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = wrapped(x, w)
        after = x @ w
        assert torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
        expected = x @ w
    assert inside.dtype == torch.float32 and torch.equal(inside, expected)
    assert after.dtype == torch.bfloat16


def test_fixed_dtype_matches_custom_fwd_under_torch_autocast() -> None:
    class Matmul(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x @ w

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[None, None]:
            return None, None

    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fmp.fixed_dtype(matmul, torch.float32)(x, w)
        theirs = Matmul.apply(x, w)
    assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs)


@pytest.mark.compiled
def test_a_region_inside_torch_autocast_compiles_whole() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    region = fmp.fixed_dtype(matmul, torch.float32)
    compiled = torch.compile(lambda x, w: region(x, w) * 2, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, w)
    assert out.dtype == torch.float32 and torch.equal(out, (x @ w) * 2)
