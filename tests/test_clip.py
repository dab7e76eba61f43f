"""clip_by_global_norm against torch.nn.utils.clip_grad_norm_, alone and inside a train step."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params

import fmp


def grads_and_params(dtype: torch.dtype, scale: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    shapes = {"w": (7, 5), "b": (5,), "v": (300,)}
    grads = {k: (torch.randn(s, generator=gen) * scale).to(dtype) for k, s in shapes.items()}
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    return grads, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("grad_scale", "max_norm"), [(10.0, 1.0), (0.01, 1.0), (3.0, 0.5)])
def test_matches_clip_grad_norm_then_sgd_bit_for_bit(dtype: torch.dtype, grad_scale: float, max_norm: float) -> None:
    grads, params = grads_and_params(dtype, grad_scale)
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.sgd(0.1), max_norm)
    ours, _ = optimizer.update(grads, optimizer.init(params), params)
    torch_params = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    for k, p in torch_params.items():
        p.grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(torch_params.values(), max_norm)
    torch.optim.SGD(torch_params.values(), lr=0.1).step()
    assert_trees_bitwise_equal(ours, {k: p.detach() for k, p in torch_params.items()})


def test_clipping_inside_a_step_sees_the_unscaled_gradients() -> None:
    # With a loss scale of 2**20 the scaled gradients are huge; clipping must act on the true ones.
    params, (x, y) = mlp_params(), next(mlp_batches(1, 0))
    max_norm = 0.05
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.sgd(0.1), max_norm)
    state = fmp.TrainState.create(params, optimizer, fmp.StaticLossScale.create(2.0**20))
    new_state, info = fmp.train_step(mlp_loss, state, x, y, policy=fmp.Policy(), optimizer=optimizer)
    assert bool(info.grads_finite)
    grads = torch.func.grad(mlp_loss)(params, x, y)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert total > max_norm  # the clip binds
    expected = {k: p - 0.1 * grads[k] * (max_norm / (total + 1e-6)) for k, p in params.items()}
    assert_trees_close(new_state.params, expected, **TOLERANCES[torch.float32])


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="max_norm must be in"):
        fmp.optim.clip_by_global_norm(fmp.optim.sgd(0.1), 0.0)
    with pytest.raises(TypeError, match=r"wraps an fmp\.optim\.Optimizer"):
        fmp.optim.clip_by_global_norm(torch.optim.SGD, 1.0)  # type: ignore[arg-type]
