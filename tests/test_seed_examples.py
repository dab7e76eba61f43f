"""The seed documents' examples, redone with fmp, agree with torch.amp on CPU in bfloat16."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCES
from seed_recipe import make_model
from torch import nn

import fmp

BF16_POLICY = fmp.get_policy("params=float32,compute=bfloat16,output=float32")


def train_with_torch_amp(
    model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], lr: float, epochs: int
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for _ in range(epochs):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x), y)
            assert loss.dtype == torch.float32  # mse_loss autocasts to float32
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    return losses


def train_with_fmp(
    model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], lr: float, epochs: int
) -> tuple[dict[str, torch.Tensor], list[float]]:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # autocast runs mse_loss in float32; so does this loss (on targets the policy rounded to bf16).
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)).float(), y.float())

    optimizer = fmp.optim.sgd(lr)
    state = fmp.TrainState.create(
        {k: v.detach() for k, v in model.named_parameters()}, optimizer, fmp.DynamicLossScale.create()
    )
    losses = []
    for _ in range(epochs):
        for x, y in data:
            state, info = fmp.train_step(loss_fn, state, x, y, policy=BF16_POLICY, optimizer=optimizer)
            assert info.loss.dtype == torch.float32  # the quiz: the loss comes back float32
            losses.append(float(info.loss))
    return state.params, losses


@pytest.mark.parametrize(
    ("name", "make_model", "batch", "features", "targets", "batches", "lr", "epochs"),
    [
        ("intro", lambda: nn.Linear(10, 1), 16, 10, 1, 1, 0.01, 3),
        ("quiz", lambda: nn.Linear(2, 1), 1, 2, 1, 1, 0.1, 1),
        ("recipe", lambda: make_model(64, 3), 32, 64, 64, 5, 0.001, 2),
    ],
)
def test_seed_example_agrees_with_torch_amp(
    name: str, make_model: object, batch: int, features: int, targets: int, batches: int, lr: float, epochs: int
) -> None:
    torch.manual_seed(0)
    model = make_model()  # type: ignore[operator]
    reference_model = make_model()  # type: ignore[operator]
    reference_model.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(batch, features, generator=gen), torch.randn(batch, targets, generator=gen))
        for _ in range(batches)
    ]
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    reference_losses = train_with_torch_amp(reference_model, data, lr, epochs)
    params, losses = train_with_fmp(model, data, lr, epochs)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), **TOLERANCES[torch.bfloat16])
    for key, reference in reference_model.named_parameters():
        torch.testing.assert_close(params[key], reference.detach(), **TOLERANCES[torch.bfloat16])
        # The updates themselves agree to bf16 precision, however small the learning rate makes them.
        update, reference_update = params[key] - initial[key], reference.detach() - initial[key]
        assert (update - reference_update).norm() <= TOLERANCES[torch.bfloat16]["rtol"] * reference_update.norm()
        # fmp is functional: the module it read its parameters from is untouched.
        assert torch.equal(model.get_parameter(key), initial[key])
