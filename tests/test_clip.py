"""clip_by_global_norm against torch.nn.utils.clip_grad_norm_, alone and inside a train step."""

from __future__ import annotations

import functools

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
    shapes = {"w": (7, 5), "b": (5,), "v": (300,), "t": ()}  # "t": a 0-dim param (a temperature) keeps its dtype
    grads = {k: (torch.randn(s, generator=gen) * scale).to(dtype) for k, s in shapes.items()}
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    return grads, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# A norm near max_norm (0.1, 0.5) shows clip_grad_norm_'s 1e-6 in the factor's last bits.
@pytest.mark.parametrize(("grad_scale", "max_norm"), [(10.0, 1.0), (0.01, 1.0), (3.0, 0.5), (0.1, 0.5)])
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


def test_every_gradient_keeps_its_dtype_a_0_dim_float16_one_too() -> None:
    # float16 norms are taken in float32, so the factor is float32: a 0-dim float16 gradient times
    # it would be promoted to float32, which the optimizer then refuses for a float16 param.
    grads = {"w": torch.full((3,), 4.0, dtype=torch.float16), "t": torch.tensor(3.0, dtype=torch.float16)}
    params = {k: torch.zeros_like(g) for k, g in grads.items()}
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.sgd(1.0), 1.0)
    new, _ = optimizer.update(grads, optimizer.init(params), params)
    factor = 1.0 / (57.0**0.5 + 1e-6)  # the global norm is sqrt(3 * 16 + 9)
    expected = {k: (-(g.float() * factor)).to(torch.float16) for k, g in grads.items()}
    assert_trees_bitwise_equal(new, expected)


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


def clip_grad_norm_value(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """What torch's clip_grad_norm_ returns for these gradients (an infinite max_norm clips nothing)."""
    torch_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(torch_params, grads.values(), strict=True):
        p.grad = g.clone()
    return torch.nn.utils.clip_grad_norm_(torch_params, float("inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_norm_is_clip_grad_norms_value(dtype: torch.dtype) -> None:
    grads, _ = grads_and_params(dtype, 3.0)
    torch.testing.assert_close(fmp.optim.global_norm({**grads, "steps": torch.tensor(7)}), clip_grad_norm_value(grads))
    assert float(fmp.optim.global_norm({"steps": torch.tensor(7)})) == 0.0


def test_complex_gradients_are_measured_and_clipped_as_clip_grad_norm_does() -> None:
    grads = {"w": torch.tensor([3.0, 4.0]), "z": torch.tensor([10 + 10j, 5 - 2j])}
    torch.testing.assert_close(fmp.optim.global_norm(grads), clip_grad_norm_value(grads))
    torch_params = {k: torch.nn.Parameter(torch.zeros_like(g)) for k, g in grads.items()}
    for k, p in torch_params.items():
        p.grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(torch_params.values(), 1.0)
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.sgd(1.0), 1.0)
    new, _ = optimizer.update(
        grads,
        optimizer.init({k: torch.zeros_like(g) for k, g in grads.items()}),
        {k: torch.zeros_like(g) for k, g in grads.items()},
    )
    assert_trees_bitwise_equal(new, {k: -p.grad for k, p in torch_params.items()})


def test_a_step_reports_the_norm_of_the_gradients_its_update_received_when_asked() -> None:
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.sgd(0.1), 0.05)
    (x1, y1), (x2, y2) = mlp_batches(2, 0)
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(init_scale=2.0**20))
    step_kwargs = {"policy": fmp.Policy(), "optimizer": optimizer}
    _, info = fmp.train_step(mlp_loss, state, x1, y1, **step_kwargs)
    assert info.grad_norm == ()
    _, info = fmp.train_step(mlp_loss, state, x1, y1, **step_kwargs, grad_norm=True)
    # The unscaled gradients' norm, before the clip binds (the scaled ones' is 2**20 times larger).
    assert torch.equal(info.grad_norm, clip_grad_norm_value(torch.func.grad(mlp_loss)(state.params, x1, y1)))
    x1[0, 0] = float("inf")
    _, info = fmp.train_step(mlp_loss, state, x1, y1, **step_kwargs, grad_norm=True)
    assert not bool(info.applied) and not bool(torch.isfinite(info.grad_norm))
    x1[0, 0] = 0.5
    # Accumulated: the window's last call reports the norm of the mean gradient it updates with.
    state = fmp.TrainState.create(mlp_params(), optimizer, fmp.NoOpLossScale(), accumulation_steps=2)
    state, _ = fmp.train_step(mlp_loss, state, x1, y1, **step_kwargs, grad_norm=True)
    state, info = fmp.train_step(mlp_loss, state, x2, y2, **step_kwargs, grad_norm=True)
    parts = [torch.func.grad(mlp_loss)(mlp_params(), x, y) for x, y in ((x1, y1), (x2, y2))]
    mean = {k: (parts[0][k] + parts[1][k]) / 2 for k in parts[0]}
    assert bool(info.applied)
    torch.testing.assert_close(info.grad_norm, clip_grad_norm_value(mean), rtol=1e-6, atol=0)

    # Several losses: the norm of their summed gradients, which the update receives.
    def decay(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return 0.1 * params["w1"].square().sum()

    two = fmp.TrainState.create(mlp_params(), optimizer, (fmp.NoOpLossScale(), fmp.StaticLossScale.create(8.0)))
    _, info = fmp.train_step(lambda p, x, y: (mlp_loss(p, x, y), decay(p)), two, x2, y2, **step_kwargs, grad_norm=True)
    summed = torch.func.grad(lambda p: mlp_loss(p, x2, y2) + decay(p))(mlp_params())
    torch.testing.assert_close(info.grad_norm, clip_grad_norm_value(summed), rtol=1e-6, atol=0)
    with pytest.raises(TypeError, match="grad_norm must be a bool"):
        fmp.train_step(mlp_loss, state, x1, y1, **step_kwargs, grad_norm=1)  # type: ignore[arg-type]


def test_a_vmapped_ensemble_reports_each_members_norm() -> None:
    optimizer = fmp.optim.sgd(0.1)
    states = [fmp.TrainState.create(mlp_params(seed=i), optimizer, fmp.DynamicLossScale.create()) for i in range(3)]
    xs, ys = torch.randn(3, 16, 8), torch.randn(3, 16, 1)
    for grad_norm in (False, True):
        policy = fmp.Policy()
        step = functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=optimizer, grad_norm=grad_norm)
        _, info = torch.func.vmap(step)(fmp.stack_trees(states), xs, ys)
        alone = [step(state, xs[i], ys[i])[1].grad_norm for i, state in enumerate(states)]
        if grad_norm:
            torch.testing.assert_close(info.grad_norm, torch.stack(alone))
        else:
            assert info.grad_norm == () and alone == [(), (), ()]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="max_norm must be in"):
        fmp.optim.clip_by_global_norm(fmp.optim.sgd(0.1), 0.0)
    with pytest.raises(TypeError, match=r"wraps an fmp\.optim\.Optimizer"):
        fmp.optim.clip_by_global_norm(torch.optim.SGD, 1.0)  # type: ignore[arg-type]
