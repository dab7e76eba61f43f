"""fmp.fp8's tensorwise recipe against torchao's float8 training (its default recipe), which runs on a CPU too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fmp.fp8 as f8

torchao_float8 = pytest.importorskip("torchao.float8")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def test_tensorwise_matches_torchaos_float8_linear() -> None:
    # torchao's default: dynamic per-tensor scales, E4M3 input and weight, E5M2 output gradient (fmp's
    # "hybrid"). A bfloat16 input as a model in bfloat16 compute feeds it; both quantize the float32
    # weight from its own values. (Under a CPU autocast torchao casts to the GPU's autocast dtype.)
    reference = model()
    converted = torchao_float8.convert_to_float8_training(copy.deepcopy(reference))
    x = torch.randn(32, 64).bfloat16().requires_grad_()
    y_torchao = converted(x)
    grads_torchao = torch.autograd.grad(y_torchao.float().square().mean(), [x, *converted.parameters()])

    params = {k: v.detach().requires_grad_() for k, v in reference.named_parameters()}
    forward = f8.fp8_modules(
        lambda p, x: torch.func.functional_call(reference, p, (x,)), reference, {nn.Linear: f8.tensorwise()}
    )
    y_fmp = forward(params, x)
    grads_fmp = torch.autograd.grad(y_fmp.float().square().mean(), [x, *params.values()])

    assert torch.equal(y_fmp, y_torchao)
    assert torch.equal(grads_fmp[0], grads_torchao[0])  # the input's gradient, bfloat16 in both
    for name, ours, theirs in zip(params, grads_fmp[1:], grads_torchao[1:], strict=True):
        # torchao's weight gradient leaves its matmul in the output gradient's bfloat16; fmp's in the
        # weight's float32: they agree to bfloat16's rounding.
        torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=1e-7, msg=name)
