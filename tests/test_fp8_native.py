"""Which FP8 matmuls go to torch._scaled_mm on CUDA, checked on this CPU with fake CUDA tensors.

A fake tensor on "cuda" runs torch's own CUDA checks of `_scaled_mm` (row- and column-major
operands, dims of 16, scale shapes) in its meta function, so these tests show, without a GPU,
that every matmul fmp sends there passes them, and which ones it keeps on the dequantized path:
a GPU without FP8 tensor cores, ROCm, a float64 output, a contracted dim not a multiple of 16.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode

import fmp.fp8 as f8
import fmp.fp8._linear as linear
from fmp.fp8._blocks import Quantized
from fmp.fp8._linear import cuda_runs_fp8

RECIPES = {"tensorwise": f8.tensorwise(), "rowwise": f8.rowwise(), "delayed": f8.delayed()}


@pytest.fixture
def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_cuda(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor on cuda:0 with `t`'s shape, strides and dtype."""
    return FakeTensor(mode, on_meta(t), torch.device("cuda", 0))


def on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], hip: str | None = None) -> None:
    """Makes torch report a CUDA device of this compute capability (a ROCm build where `hip` is given)."""
    properties = SimpleNamespace(major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.version, "hip", hip)


Matmul = tuple[Any, Quantized, Quantized, torch.dtype]  # recipe, a, b, out_dtype


def cpu_matmuls(recipe: Any, tokens: int = 32, dtype: torch.dtype = torch.bfloat16) -> list[Matmul]:
    """The three FP8 matmuls of `fp8_linear`'s forward and backward on this CPU, with their quantized operands."""
    recorded: list[Matmul] = []
    multiply = linear._multiply

    def record(recipe: Any, a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
        recorded.append((recipe, a, b, out_dtype))
        return multiply(recipe, a, b, out_dtype)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 128, generator=generator, dtype=dtype, requires_grad=True)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    weight = torch.randn(64, 128, generator=generator, dtype=weight_dtype, requires_grad=True)
    scales = {"scales": torch.ones(3)} if isinstance(recipe, f8.DelayedScaling) else {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear, "_multiply", record)
        y = f8.fp8_linear(x, weight, recipe=recipe, **scales)
        torch.autograd.grad(y, (x, weight), torch.ones_like(y))
    assert len(recorded) == 3  # forward, input gradient, weight gradient
    return recorded


def run_native(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.dtype]:
    """`fp8_matmul(a, b, out_dtype, native=True)` and the output dtype it asked torch._scaled_mm for."""
    asked: list[torch.dtype] = []
    scaled_mm = torch._scaled_mm

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append(kwargs["out_dtype"])
        return scaled_mm(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_scaled_mm", spy)
        product = f8.fp8_matmul(a, b, out_dtype, native=True)
    (kernel_dtype,) = asked
    return product, kernel_dtype


def on_cuda(mode: FakeTensorMode, matmuls: list[Matmul]) -> list[tuple[bool, Any]]:
    """Each matmul on CUDA: whether it goes to torch._scaled_mm, and the output dtype it then asks for.

    The choice is made on fake CUDA operands. A native matmul then runs `fp8_matmul` on meta
    operands of the same strides, where torch's meta function of `_scaled_mm` makes the checks its
    CUDA kernel makes (a fake CUDA tensor cannot be copied in a CPU build, as `fp8_matmul` copies
    an operand into the layout cuBLAS wants).
    """
    taken = []
    for recipe, a, b, out_dtype in matmuls:
        fake_a, fake_b = (Quantized(fake_cuda(mode, q.data), fake_cuda(mode, q.scale)) for q in (a, b))
        with mode:
            native = linear._runs_native(recipe, fake_a, fake_b, out_dtype)
        kernel_dtype = None
        if native:
            meta_a, meta_b = (Quantized(on_meta(q.data), on_meta(q.scale)) for q in (a, b))
            product, kernel_dtype = run_native(meta_a, meta_b, out_dtype)
            assert product.dtype == out_dtype and product.shape == (a.data.shape[0], b.data.shape[1])
        taken.append((native, kernel_dtype))
    return taken


@pytest.mark.parametrize("name", list(RECIPES))
def test_on_an_h100_all_three_matmuls_pass_torchs_cuda_checks(
    name: str, monkeypatch: pytest.MonkeyPatch, fake_mode: FakeTensorMode
) -> None:
    matmuls = cpu_matmuls(RECIPES[name])
    gpu(monkeypatch, (9, 0))
    taken = on_cuda(fake_mode, matmuls)
    # The output and the input's gradient in bfloat16 (x's dtype), the weight's gradient in float32;
    # CUDA's rowwise kernel writes bfloat16, so there the weight's gradient is rounded through it.
    weight_grad = torch.bfloat16 if name == "rowwise" else torch.float32
    assert taken == [(True, torch.bfloat16), (True, torch.bfloat16), (True, weight_grad)]


@pytest.mark.parametrize(
    ("capability", "hip"), [((8, 0), None), ((8, 6), None), ((9, 4), "6.2")], ids=["A100", "sm_86", "ROCm"]
)
def test_without_fp8_tensor_cores_every_matmul_takes_the_dequantized_path(
    capability: tuple[int, int],
    hip: str | None,
    monkeypatch: pytest.MonkeyPatch,
    fake_mode: FakeTensorMode,
) -> None:
    matmuls = [matmul for recipe in RECIPES.values() for matmul in cpu_matmuls(recipe)]
    gpu(monkeypatch, capability, hip)
    assert not cuda_runs_fp8(torch.device("cuda", 0))
    assert on_cuda(fake_mode, matmuls) == [(False, None)] * 9


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_ada_hopper_and_blackwell_run_fp8(capability: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    gpu(monkeypatch, capability)
    assert cuda_runs_fp8(torch.device("cuda", 0))


def test_a_float64_output_takes_the_dequantized_path_on_cuda(
    monkeypatch: pytest.MonkeyPatch, fake_mode: FakeTensorMode
) -> None:
    matmuls = cpu_matmuls(f8.tensorwise(), dtype=torch.float64)
    assert [out_dtype for *_, out_dtype in matmuls] == [torch.float64] * 3
    gpu(monkeypatch, (9, 0))
    assert on_cuda(fake_mode, matmuls) == [(False, None)] * 3  # no cuBLAS FP8 matmul writes float64


@pytest.mark.parametrize("name", list(RECIPES))
def test_tokens_not_a_multiple_of_16_keep_the_forward_and_input_gradient_native(
    name: str, monkeypatch: pytest.MonkeyPatch, fake_mode: FakeTensorMode
) -> None:
    matmuls = cpu_matmuls(RECIPES[name], tokens=24)
    gpu(monkeypatch, (9, 0))
    # The weight's gradient contracts over the tokens, which torch wants in multiples of 16.
    assert [native for native, _ in on_cuda(fake_mode, matmuls)] == [True, True, False]


def test_on_a_cpu_rows_not_a_multiple_of_16_stay_on_the_dequantized_path() -> None:
    # The CPU emulation of _scaled_mm sums in another order there: the dequantized path's bits stay.
    matmuls = cpu_matmuls(f8.tensorwise(), tokens=24)
    assert [linear._runs_native(recipe, a, b, out) for recipe, a, b, out in matmuls] == [False, False, False]
    assert [linear._runs_native(recipe, a, b, out) for recipe, a, b, out in cpu_matmuls(f8.tensorwise())] == [
        True,
        True,
        True,
    ]


def test_fp8_linear_names_an_operand_on_another_device() -> None:
    x, weight = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match=r"x is on cpu but weight on meta"):
        f8.fp8_linear(x, weight.to("meta"), recipe=f8.tensorwise())
    scales = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match=r"x is on cpu but scales on meta, loss_scale on meta"):
        f8.fp8_linear(x, weight, recipe=f8.delayed(), scales=scales, loss_scale=scales[0])


@pytest.mark.parametrize("recipe", [f8.tensorwise(), f8.rowwise(), f8.mxfp8(), f8.blockwise(), f8.delayed()])
def test_no_tokens_give_an_empty_output_as_f_linear_does(recipe: Any) -> None:
    x = torch.randn(0, 128, requires_grad=True)
    weight = torch.randn(128, 128, requires_grad=True)
    scales = {"scales": torch.ones(3)} if isinstance(recipe, f8.DelayedScaling) else {}
    y = f8.fp8_linear(x, weight, torch.ones(128), recipe=recipe, **scales)
    assert y.shape == (0, 128)
    grad_x, grad_w = torch.autograd.grad(y.sum(), (x, weight))
    assert grad_x.shape == (0, 128) and bool((grad_w == 0).all())
