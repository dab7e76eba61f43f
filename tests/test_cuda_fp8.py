"""fmp.fp8 on a GPU with FP8 tensor cores: torch._scaled_mm against the CPU's numerics, no host syncs, one graph.

Skipped without a CUDA device of compute capability 8.9 or newer (Ada, Hopper); run on one with
`python -m pytest tests/test_cuda_fp8.py`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import assert_trees_close
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fmp
import fmp.fp8 as f8

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA device with FP8 tensor cores (compute capability 8.9 or newer)",
    ),
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
    pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated"),
]

CUDA = torch.device("cuda")
BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")


def operands(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=generator).bfloat16()
    weight = torch.randn(96, 128, generator=generator) / 8
    upstream = torch.randn(64, 96, generator=generator).bfloat16()
    return x.to(device), weight.to(device), upstream.to(device)


@pytest.mark.parametrize("recipe", [f8.tensorwise(), f8.rowwise(), f8.delayed()], ids=lambda r: type(r).__name__)
def test_the_gpus_scaled_mm_gives_the_cpus_results_forward_and_backward(
    recipe: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_calls = []
    scaled_mm = torch._scaled_mm

    def spy(a: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if a.is_cuda:
            gpu_calls.append(kwargs["out_dtype"])
        return scaled_mm(a, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    results = []
    for device in (torch.device("cpu"), CUDA):
        x, weight, upstream = operands(device)
        x.requires_grad_()
        weight.requires_grad_()
        scales = {"scales": torch.ones(3, device=device)} if isinstance(recipe, f8.DelayedScaling) else {}
        y = f8.fp8_linear(x, weight, recipe=recipe, **scales)  # type: ignore[arg-type]
        results.append([y, *torch.autograd.grad(y, (x, weight), upstream)])
    # All three matmuls ran on the GPU's FP8 kernel (rowwise's writing bfloat16).
    rowwise = isinstance(recipe, f8.Fp8Recipe) and recipe.name == "rowwise"
    assert gpu_calls == [torch.bfloat16, torch.bfloat16, torch.bfloat16 if rowwise else torch.float32]
    for cpu, gpu in zip(*results, strict=True):
        # The same FP8 operands; the sums accumulate in float32 in another order.
        torch.testing.assert_close(gpu.cpu().float(), cpu.float(), rtol=2e-2, atol=1e-3)


def mlp_setup() -> tuple[functools.partial[tuple[fmp.TrainState, fmp.StepInfo]], fmp.TrainState]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(CUDA)
    params, _ = fmp.nn.split(model)
    recipes = {nn.Linear: f8.delayed(history_len=16)}

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y)

    optimizer = fmp.optim.adamw(1e-3)
    scaler = fmp.DynamicLossScale.create(device=CUDA)
    state = fmp.TrainState.create(params, optimizer, scaler, fp8=f8.init_states(model, recipes, CUDA))
    step = functools.partial(fmp.train_step, f8.fp8_modules(loss_fn, model, recipes), policy=BF16, optimizer=optimizer)
    return step, state


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(64, 128, generator=generator).to(CUDA), torch.randn(64, 128, generator=generator).to(CUDA))
        for _ in range(count)
    ]


def test_a_delayed_fp8_step_never_syncs_with_the_host() -> None:
    step, state = mlp_setup()
    data = batches(4)
    state, _ = step(state, *data[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the steps raises
    try:
        for x, y in data[1:]:
            state, _ = step(state, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(state.counts.applied) == 4


@pytest.mark.compiled
def test_a_compiled_delayed_fp8_step_is_one_graph_and_tracks_eager() -> None:
    step, state = mlp_setup()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_state = compiled_state = state
    for x, y in batches(3):
        eager_state, _ = step(eager_state, x, y)
        compiled_state, _ = compiled(compiled_state, x, y)
    assert counter.frame_count == 1
    assert_trees_close(compiled_state.fp8, eager_state.fp8, rtol=0.02, atol=0.0)
    assert_trees_close(compiled_state.params, eager_state.params, rtol=0.02, atol=2e-3)
