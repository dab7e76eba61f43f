"""What fmp.remat's recompute replays: module policies met by a function block, generators, torch.autocast takeovers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_trees_bitwise_equal
from torch import nn

import fmp

BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")


class Net(nn.Module):
    """A block run twice, plainly, through `fmp.remat.remat(module)`, or through `fmp.remat` of functions calling it."""

    def __init__(self, remat: str) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.remat = remat

    def forward(self, x: torch.Tensor) -> Any:
        if self.remat in ("", "module"):
            block = fmp.remat.remat(self.block) if self.remat else self.block
            return block(torch.tanh(block(x)))
        params = dict(self.block.named_parameters())
        run = fmp.remat.remat(
            lambda h, p: torch.func.functional_call(self.block, p, (h,))
        )  # params passed in, as required
        twice = lambda h, p: run(torch.tanh(run(h, p)), p)  # noqa: E731
        # Nested: the inner blocks run again inside the outer one's recompute, after module_policies returned.
        return fmp.remat.remat(twice)(x, params) if self.remat == "nested" else twice(x, params)


@pytest.mark.parametrize("form", ["module", "function", "nested"])
@pytest.mark.parametrize("key", ["block", "block.0"])
def test_the_recompute_runs_the_module_policies_the_forward_ran(form: str, key: str) -> None:
    # A function block does not name the modules it calls: those module_policies patched are kept.
    torch.manual_seed(0)
    plain, wrapped = Net(""), Net(form)
    wrapped.load_state_dict(plain.state_dict())
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x, y = torch.randn(5, 4), torch.randn(5, 4)

    def grads(model: nn.Module) -> Any:
        def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(torch.func.functional_call(model, p, (x,)), y)

        fn = fmp.autocast.module_policies(loss, model, {key: fmp.get_policy("float32")})
        return fmp.mixed_precision_grad(fn, params, fmp.NoOpLossScale(), x, y, policy=BF16)

    assert_trees_bitwise_equal(grads(wrapped), grads(plain))


def noisy_block(x: torch.Tensor, w: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.tanh(x @ w) * torch.rand(x.shape[0], w.shape[1], generator=generator)


@pytest.mark.parametrize("backward", ["torch.func.grad", "loss.backward"])
def test_a_generator_passed_in_is_replayed_and_left_where_the_forward_left_it(backward: str) -> None:
    x, w = torch.randn(3, 4), torch.randn(4, 5)

    def grad_and_generator(block: Any) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(7)
        if backward == "torch.func.grad":
            grad = torch.func.grad(lambda w: block(x, w, generator).sum())(w)
        else:
            tracked = w.clone().requires_grad_()
            block(x, tracked, generator).sum().backward()
            grad = tracked.grad
        assert grad is not None
        return grad, generator.get_state()

    assert_trees_bitwise_equal(grad_and_generator(fmp.remat.remat(noisy_block)), grad_and_generator(noisy_block))


def test_draws_the_caller_makes_between_forward_and_backward_are_not_undone() -> None:
    # The recompute sets the passed generator to its forward state, then puts back where the
    # caller has moved it since: the caller's next draw is new, not a repeat.
    generator = torch.Generator().manual_seed(0)
    block = fmp.remat.remat(lambda a, gen: F.dropout(a, 0.5) * torch.rand(a.shape, generator=gen))
    w = torch.randn(8, requires_grad=True)
    out = block(w, generator)
    drawn_between = torch.rand(3, generator=generator)
    after = generator.get_state()
    out.sum().backward()
    assert torch.equal(generator.get_state(), after)
    assert not torch.equal(torch.rand(3, generator=generator), drawn_between)


def test_a_block_inside_a_torch_autocast_takeover_is_recomputed_as_it_ran() -> None:
    # Model code turning torch.autocast off inside fmp.autocast: the block runs in float32, so
    # must its recompute, and the region's ops after it are still torch's.
    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def model(block: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", enabled=False):
            inner = block(x, w)
            after = x @ w
        return inner, after

    def run(block: Any) -> tuple[torch.Tensor, list[torch.dtype]]:
        dtypes: list[torch.dtype] = []

        def loss(w: torch.Tensor) -> torch.Tensor:
            inner, after = fmp.autocast.autocast(model, torch.bfloat16)(block, x, w)
            dtypes.extend((inner.dtype, after.dtype))
            return inner.sum() + (x @ w).float().sum()

        return torch.func.grad(loss)(w), dtypes

    grad, dtypes = run(fmp.remat.remat(torch.matmul))
    assert dtypes == [torch.float32, torch.float32]
    assert_trees_bitwise_equal(grad, run(torch.matmul)[0])
