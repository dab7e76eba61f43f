"""fmp.autocast under torch.func.grad, vmap and torch.compile, and its numerics on a transformer block."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import TOLERANCES
from torch import nn

from fmp.autocast import autocast
from fmp.autocast._rules import CPU

LOW = [torch.bfloat16, torch.float16]


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.norm(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
        x = x + scores @ v
        return x + self.mlp(self.norm(x))


def _block_loss(model: nn.Module) -> Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (x,))
        return F.log_softmax(out, -1).mean() ** 2

    return loss


def _block() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Block()
    return model, {k: v.detach() for k, v in model.named_parameters()}


def test_vmap_over_grad_with_layer_norm_in_bfloat16() -> None:
    # pytorch issue 184890: torch.autocast fails here ("expected scalar type BFloat16 but found Float").
    model, params = _block()
    xs = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    loss = _block_loss(model)
    grads = torch.func.vmap(torch.func.grad(autocast(loss, torch.bfloat16)), in_dims=(None, 0))(params, xs)
    for name, g in grads.items():
        assert g.shape == (3, *params[name].shape) and g.dtype == torch.float32
        assert torch.isfinite(g).all()
    one = torch.func.grad(autocast(loss, torch.bfloat16))(params, xs[1])
    # Batched and unbatched bfloat16 matmuls round differently.
    pytree.tree_map(lambda g, h: torch.testing.assert_close(g[1], h, **TOLERANCES[torch.bfloat16]), grads, one)


@pytest.mark.parametrize("dtype", LOW)
def test_block_loss_and_grads_near_float32_and_nearer_than_casting_all(dtype: torch.dtype) -> None:
    model, params = _block()
    x = torch.randn(8, 16)
    loss = _block_loss(model)
    ref_loss, ref_grads = torch.func.grad_and_value(loss)(params, x)[::-1]
    ac_grads, ac_loss = torch.func.grad_and_value(autocast(loss, dtype))(params, x)
    half = {k: v.to(dtype) for k, v in params.items()}
    all_grads, all_loss = torch.func.grad_and_value(loss)(half, x.to(dtype))

    def error(grads: dict[str, torch.Tensor], value: torch.Tensor) -> float:
        grad_err = max(float((grads[k].float() - g).abs().max() / g.abs().max()) for k, g in ref_grads.items())
        return max(grad_err, float((value.float() - ref_loss).abs() / ref_loss.abs()))

    assert ac_loss.dtype == torch.float32
    assert error(ac_grads, ac_loss) < (0.05 if dtype == torch.bfloat16 else 0.01)
    assert error(ac_grads, ac_loss) < error(all_grads, all_loss)


@pytest.mark.compiled
def test_compiled_fullgraph_grad_compiles_once() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    model, params = _block()
    backend = CompileCounterWithBackend("aot_eager")
    step = torch.compile(torch.func.grad(autocast(_block_loss(model), torch.bfloat16)), fullgraph=True, backend=backend)
    eager = torch.func.grad(autocast(_block_loss(model), torch.bfloat16))
    for seed in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        pytree.tree_map(torch.testing.assert_close, step(params, x), eager(params, x))
    assert backend.frame_count == 1


def _pooling(x: torch.Tensor) -> torch.Tensor:
    y = F.conv2d(x, torch.ones(4, 3, 3, 3) / 27)
    pooled = [
        F.max_pool2d(y, 2),
        F.max_pool2d(y, 2, return_indices=True)[0],
        F.max_pool1d(y.flatten(2), 2),
        F.adaptive_max_pool2d(y, (1, None)),
        F.adaptive_avg_pool2d(y, 1),
        F.max_unpool2d(*F.max_pool2d(y, 2, return_indices=True), 2),
        nn.MaxPool3d(2)(y.unsqueeze(0)),
    ]
    return torch.stack([p.float().sum() for p in pooled])


@pytest.mark.compiled
@pytest.mark.parametrize("rules", ["cuda", "cpu"])
def test_pooling_compiles_whole_in_the_mode(rules: str) -> None:
    # max_pool2d and kin are boolean_dispatch composites and adaptive pooling calls
    # `_list_with_default`: both once ended the graph under the mode.
    fn = autocast(_pooling, torch.bfloat16, rules=dict(CPU) if rules == "cpu" else rules)  # a copy: the mode
    x = torch.randn(2, 3, 10, 10)
    torch._dynamo.reset()  # every autocast-wrapped function shares one code object, and its recompile limit
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x), **TOLERANCES[torch.bfloat16])
