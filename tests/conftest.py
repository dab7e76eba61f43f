"""Shared test helpers: tolerances per dtype, bitwise comparison, small functional models."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

# Tests reuse the examples' model builders rather than copying them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

hypothesis.settings.register_profile("fmp", deadline=None, max_examples=60, print_blob=True)
# CI replays a fixed set of examples, so a submission's verdict does not depend on the draw.
hypothesis.settings.register_profile("ci", parent=hypothesis.settings.get_profile("fmp"), derandomize=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "fmp")

# One tolerance table per compute dtype: how far a mixed-precision result may sit from float32.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 5e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 1e-2},
}

POLICIES = [
    "params=float32,compute=float32,output=float32",
    "params=float32,compute=bfloat16,output=float32",
    "params=float32,compute=float16,output=float32",
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor, so -0.0 != 0.0 and NaN payloads compare."""
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    return t.resolve_conj().resolve_neg().contiguous().view(int_dtype)


def assert_trees_bitwise_equal(a: Any, b: Any) -> None:
    a_leaves, a_spec = pytree.tree_flatten(a)
    b_leaves, b_spec = pytree.tree_flatten(b)
    assert a_spec == b_spec
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(bits(x), bits(y))
        else:
            assert x == y


def assert_trees_close(a: Any, b: Any, **tolerance: float) -> None:
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, **tolerance)


def snapshot(tree: Any) -> list[tuple[torch.Tensor, int]]:
    """A copy of every tensor leaf with its version counter, to detect mutation later."""
    return [(x.clone(), x._version) for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def assert_unmutated(tree: Any, before: list[tuple[torch.Tensor, int]]) -> None:
    tensors = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    assert len(tensors) == len(before)
    for x, (copy, version) in zip(tensors, before, strict=True):
        assert x._version == version, "an input tensor was modified in place"
        assert torch.equal(bits(x), bits(copy))


def mlp_params(width: int = 8, out: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(width, width, generator=gen) / width**0.5,
        "b1": torch.zeros(width),
        "w2": torch.randn(out, width, generator=gen) / width**0.5,
        "b2": torch.zeros(out),
    }


def mlp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    hidden = F.relu(F.linear(x, params["w1"], params["b1"]))
    return F.mse_loss(F.linear(hidden, params["w2"], params["b2"]), y)


def mlp_batches(
    steps: int, overflow_every: int, *, seed: int = 3, device: torch.device | str = "cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches for `mlp_loss`; every `overflow_every`-th one (if nonzero) holds an inf input."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        if overflow_every and i % overflow_every == overflow_every - 1:
            x[0, 0] = float("inf")
        yield x.to(device), y.to(device)


def torch_grad_scaler(state: Any) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    """A CPU GradScaler with `state`'s scale and hyperparameters, and an optimizer for it to step."""
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=float(state.loss_scale),
        growth_factor=state.growth_factor,
        backoff_factor=state.backoff_factor,
        growth_interval=state.growth_interval,
    )
    param = torch.nn.Parameter(torch.zeros(3))
    return scaler, torch.optim.SGD([param], lr=0.0)


def grad_scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, finite: bool) -> None:
    """One GradScaler step whose gradients are finite or not."""
    (param,) = optimizer.param_groups[0]["params"]
    scaler.scale(torch.ones(()))
    param.grad = torch.full((3,), 1.0 if finite else float("inf"))
    scaler.step(optimizer)
    scaler.update()


def block_fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A small block for fmp.remat: two matmuls with a tanh and a softmax between them."""
    return torch.tanh(x @ w1).softmax(-1) @ w2


def block_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_fn`'s input and weights, from their own generator."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=generator)
    return x, torch.randn(8, 16, generator=generator) / 3, torch.randn(16, 8, generator=generator) / 4
