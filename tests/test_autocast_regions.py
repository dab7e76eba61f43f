"""Regions across fmp and torch: fmp's inside torch.autocast, and torch.autocast's inside fmp.autocast."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fmp

REGIONS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]] = {
    "fixed_dtype": lambda fn: fmp.autocast.fixed_dtype(fn, torch.float32),
    "no_autocast": fmp.autocast.no_autocast,
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
        ours = fmp.autocast.fixed_dtype(matmul, torch.float32)(x, w)
        theirs = Matmul.apply(x, w)
    assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs)


@pytest.mark.compiled
def test_a_region_inside_torch_autocast_compiles_whole() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    region = fmp.autocast.fixed_dtype(matmul, torch.float32)
    compiled = torch.compile(lambda x, w: region(x, w) * 2, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, w)
    assert out.dtype == torch.float32 and torch.equal(out, (x @ w) * 2)


def rotary_angles(freq: torch.Tensor, positions: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Model code that keeps its angles in float32 with torch's own opt-out, as rotary embeddings do."""
    with torch.autocast("cpu", enabled=False):
        angles = freq[:, None] @ positions[None, :]
    return angles, angles.T @ w


def bfloat16_inside(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inner = x @ w
    return inner, x @ w


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torch_autocast_regions_in_model_code_take_over_inside_fmp_autocast(compiled: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    freq, positions, w = torch.rand(8, generator=gen), torch.arange(64.0), torch.randn(8, 3, generator=gen)
    opt_out = fmp.autocast.autocast(rotary_angles, torch.bfloat16, rules="cpu")
    opt_in = fmp.autocast.autocast(bfloat16_inside, torch.float16, rules="cpu")
    if compiled:  # Dynamo enters the model's regions while tracing, so the mode sees them there too
        opt_out = torch.compile(opt_out, fullgraph=True, backend="eager")
        opt_in = torch.compile(opt_in, fullgraph=True, backend="eager")
    angles, projected = opt_out(freq, positions, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = rotary_angles(freq, positions, w)
    assert angles.dtype == torch.float32 and torch.equal(angles, freq[:, None] @ positions[None, :])
    assert projected.dtype == torch.bfloat16 and torch.equal(projected, expected[1])
    # A region that turns torch.autocast on casts by torch's rules and dtype; after it, fmp's again.
    x = torch.randn(4, 8, generator=gen)
    inner, outer = opt_in(x, w)
    assert inner.dtype == torch.bfloat16 and outer.dtype == torch.float16
    assert torch.equal(outer, x.half() @ w.half())


def test_a_wrapped_function_that_cannot_be_called_is_named_when_wrapped() -> None:
    with pytest.raises(TypeError, match="autocast's fn must be a function, got int"):
        fmp.autocast.autocast(3, torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no_autocast's fn must be a function, got str"):
        fmp.autocast.no_autocast("relu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fixed_dtype's fn must be a function, got NoneType"):
        fmp.autocast.fixed_dtype(None, torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module_policies' fn must be a function, got int"):
        fmp.autocast.module_policies(3, torch.nn.Linear(2, 2), {})  # type: ignore[arg-type]
