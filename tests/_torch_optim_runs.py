"""A small float32 torch.optim run step by step, and the step that checks fmp goes on from it bit for bit."""

from __future__ import annotations

from typing import Any

import torch
from conftest import bits

import fmp


def make_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, *schedulers: Any) -> None:
    """One step of torch's run on batch `x` (the mean square of the output as the loss)."""
    model(x).square().mean().backward()
    optimizer.step()
    for scheduler in schedulers:
        scheduler.step()
    optimizer.zero_grad()


def torch_run(kind: str, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """A float32 torch.optim run of `steps` steps, and the batch for one more."""
    torch.manual_seed(0)
    model = make_model()
    optimizer: torch.optim.Optimizer
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    elif kind == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(steps + 1)]
    for x in batches[:steps]:
        torch_step(model, optimizer, x)
    return model, optimizer, batches


def params_in_group_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of the params by name, in the order the optimizer was given them: group by group."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)]: p.detach().clone() for group in optimizer.param_groups for p in group["params"]}


def step_both_and_compare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: fmp.TrainState,
    fmp_optimizer: fmp.optim.Optimizer,
    x: torch.Tensor,
) -> fmp.TrainState:
    """One more step of torch's run, then of fmp's from the converted state: the params agree bit for bit."""

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().mean()

    # torch steps first, updating its buffers in place: fmp's converted state must not share them.
    model(x).square().mean().backward()
    optimizer.step()
    state, _ = fmp.train_step(loss_fn, state, x, policy=fmp.Policy(), optimizer=fmp_optimizer)
    for name, p in model.named_parameters():
        assert torch.equal(bits(state.params[name]), bits(p.detach())), name
    return state
