"""The model zoo itself, under torch.amp only: every case trains, builds and batches deterministically."""

from __future__ import annotations

import math

import pytest
import torch
import zoo
from torch.func import functional_call
from torch.func import grad
from torch.func import stack_module_state
from torch.func import vmap

CASES = [pytest.param(c, id=c.name) for c in zoo.CASES]


def test_case_names_are_unique_and_looked_up() -> None:
    names = [c.name for c in zoo.CASES]
    assert len(set(names)) == len(names)
    assert all(zoo.case(name).name == name for name in names)
    with pytest.raises(KeyError):
        zoo.case("no_such_model")


@pytest.mark.parametrize("zoo_case", CASES)
def test_torch_amp_loop_trains(zoo_case: zoo.ZooCase) -> None:
    model = zoo_case.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses, trained = zoo.torch_amp_train(model, zoo_case, steps=3)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the caller's model was trained"

    after = trained.state_dict()
    for name, param in trained.named_parameters():
        changed = not torch.equal(after[name], before[name])
        assert changed == param.requires_grad, f"{name}: changed={changed}, requires_grad={param.requires_grad}"
    if zoo_case.name == "frozen_submodule":
        assert not any(p.requires_grad for p in trained.encoder.parameters())  # type: ignore[union-attr]
    if zoo_case.name == "resnet_cnn":
        stats = [k for k in after if k.endswith(("running_mean", "running_var"))]
        assert stats and all(not torch.equal(after[k], before[k]) for k in stats)
        assert all(after[k] == before[k] + 3 for k in after if k.endswith("num_batches_tracked"))


@pytest.mark.parametrize("zoo_case", CASES)
def test_forward_returns_scalar_loss_under_autocast(zoo_case: zoo.ZooCase) -> None:
    model = zoo_case.build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*zoo_case.batch(torch.Generator().manual_seed(0)))
    assert loss.ndim == 0 and loss.dtype == torch.float32 and loss.requires_grad


@pytest.mark.parametrize("zoo_case", CASES)
def test_build_is_deterministic_and_leaves_global_rng_alone(zoo_case: zoo.ZooCase) -> None:
    rng = torch.random.get_rng_state()
    first, second = zoo_case.build().state_dict(), zoo_case.build().state_dict()
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("zoo_case", CASES)
def test_batches_are_deterministic_per_seed(zoo_case: zoo.ZooCase) -> None:
    def draw(seed: int) -> tuple[torch.Tensor, ...]:
        return zoo_case.batch(torch.Generator().manual_seed(seed))

    first, again, other = draw(0), draw(0), draw(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    generator = torch.Generator().manual_seed(0)
    next_batch = (zoo_case.batch(generator), zoo_case.batch(generator))[1]
    assert not all(torch.equal(a, b) for a, b in zip(first, next_batch, strict=True))


@pytest.mark.parametrize("zoo_case", [pytest.param(c, id=c.name) for c in zoo.CASES if c.vmappable])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16"])
def test_vmappable_cases_map_over_stacked_params(zoo_case: zoo.ZooCase, autocast: bool) -> None:
    model, other = zoo_case.build(), zoo_case.build()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a second ensemble member with other weights
        for param in other.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    params, buffers = stack_module_state([model, other])
    trainable = {k: v for k, v in params.items() if model.get_parameter(k).requires_grad}
    batch = zoo_case.batch(torch.Generator().manual_seed(0))

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *batch: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(model, (p, b), batch, strict=False)
        return out

    in_dims = (0, 0) + (None,) * len(batch)
    with zoo.vmap_context(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        grads = vmap(grad(loss), in_dims=in_dims, randomness="different")(trainable, buffers, *batch)
    assert grads.keys() == trainable.keys()
    assert all(g.shape == trainable[k].shape and torch.isfinite(g).all() for k, g in grads.items())
    assert not torch.equal(*next(iter(grads.values())).unbind())  # the members differ
