"""Sparse COO gradients (nn.Embedding(sparse=True)) through unscale, check and update, as torch takes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import bits

import fmp

INDICES = torch.tensor([1, 3, 1, 7, 3, 3])  # repeated rows: the gradient holds duplicate indices


def embedding_grad(dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """The sparse, uncoalesced gradient of a weighted embedding lookup, as autograd makes it."""
    emb = torch.nn.Embedding(10, 4, sparse=True, dtype=dtype)
    weights = torch.linspace(0.3, 2.1, INDICES.numel() * 4, dtype=dtype).reshape(-1, 4)
    ((emb(INDICES) * weights).sum() * scale).backward()
    grad = emb.weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo
    return grad


def assert_sparse_bitwise_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.layout == theirs.layout == torch.sparse_coo and ours.dtype == theirs.dtype
    assert torch.equal(ours._indices(), theirs._indices())
    assert torch.equal(bits(ours._values()), bits(theirs._values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unscale_equals_grad_scaler_unscale_bit_for_bit(dtype: torch.dtype) -> None:
    # (GradScaler.unscale_ refuses float16 gradients: it expects float32 master params.)
    scaled = embedding_grad(dtype, scale=2.0**10 + 3)
    param = torch.nn.Parameter(torch.zeros(10, 4, dtype=dtype))
    param.grad = scaled.clone()
    reference = torch.amp.GradScaler("cpu", init_scale=3.0 * 2**10)
    reference.scale(torch.ones(()))
    reference.unscale_(torch.optim.SGD([param], lr=0.1))
    out = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(init_scale=3.0 * 2**10), {"w": scaled})
    assert bool(out.grads_finite)
    assert_sparse_bitwise_equal(out.grads["w"], param.grad)


def test_a_non_finite_sparse_gradient_is_caught_and_backs_off() -> None:
    grad = embedding_grad()
    values = grad._values().clone()
    values[2, 1] = float("inf")
    bad = torch.sparse_coo_tensor(grad._indices(), values, grad.shape, check_invariants=True)
    out = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(init_scale=8.0), {"w": bad})
    assert not bool(out.grads_finite) and float(out.scaler.loss_scale) == 4.0


def test_sgd_step_equals_torch_sgd_bit_for_bit() -> None:
    grad = embedding_grad()
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(weight.clone())
    param.grad = grad.clone()
    torch.optim.SGD([param], lr=0.1).step()
    optimizer = fmp.optim.sgd(0.1)
    new_params, _ = optimizer.update({"w": grad}, optimizer.init({"w": weight}), {"w": weight})
    assert torch.equal(bits(new_params["w"]), bits(param.detach()))


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_with_momentum_takes_sparse_gradients_as_torch_does(nesterov: bool) -> None:
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(weight.clone())
    reference = torch.optim.SGD([param], lr=0.1, momentum=0.9, nesterov=nesterov)
    optimizer = fmp.optim.sgd(0.1, momentum=0.9, nesterov=nesterov)
    params = {"w": weight}
    state = optimizer.init(params)
    for scale in (1.0, -0.5, 2.0):
        grad = embedding_grad(scale=scale)
        param.grad = grad.clone()
        reference.step()
        params, state = optimizer.update({"w": grad}, state, params)
    # fmp's momentum buffer is dense, torch's sparse: the same sums, duplicates rounded in another order.
    torch.testing.assert_close(params["w"], param.detach(), rtol=1e-6, atol=1e-7)


def test_weight_decay_and_adam_refuse_sparse_gradients_naming_the_param() -> None:
    params = {"emb": torch.zeros(10, 4)}
    grads = {"emb": embedding_grad()}
    for optimizer in (fmp.optim.sgd(0.1, weight_decay=0.1), fmp.optim.sgd(0.1, momentum=0.9, weight_decay=0.1)):
        with pytest.raises(
            ValueError, match=r"grads\['emb'\] is torch.sparse_coo, and weight_decay=0.1 .*weight_decay=0.0"
        ):
            optimizer.update(grads, optimizer.init(params), params)
    adam = fmp.optim.adam()
    with pytest.raises(TypeError, match=r"adam does not take sparse gradients.*grads\['emb'\] is torch.sparse_coo"):
        adam.update(grads, adam.init(params), params)


class Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(indices)).squeeze(-1)


def test_train_step_with_a_sparse_embedding_equals_torch_amp() -> None:
    """torch.func.grad gives the embedding a sparse gradient; the step equals GradScaler + SGD."""
    torch.manual_seed(0)
    model = Bag()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    targets = torch.linspace(-1, 1, INDICES.numel())

    def loss_fn(p: dict[str, torch.Tensor], indices: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (indices,)), y)

    sgd = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(params, sgd, fmp.DynamicLossScale.create())
    reference = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        state, info = fmp.train_step(loss_fn, state, INDICES, targets, policy=fmp.Policy(), optimizer=sgd)
        reference.zero_grad(set_to_none=True)
        scaler.scale(F.mse_loss(model(INDICES), targets)).backward()
        assert model.emb.weight.grad is not None and model.emb.weight.grad.layout == torch.sparse_coo
        scaler.step(reference)
        scaler.update()
        assert bool(info.applied)
    for name, param in model.named_parameters():
        assert torch.equal(bits(state.params[name]), bits(param.detach())), name
    # A NaN target makes the gradients non-finite: the step is skipped with the params kept.
    before = state.params
    state, info = fmp.train_step(loss_fn, state, INDICES, targets * float("nan"), policy=fmp.Policy(), optimizer=sgd)
    assert not bool(info.applied) and all(torch.equal(state.params[k], before[k]) for k in before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("donate", [False, True])
def test_clipping_measures_and_scales_a_sparse_gradient_as_its_dense_form(donate: bool, dtype: torch.dtype) -> None:
    # torch's clip_grad_norm_ cannot take the norm of a sparse gradient; its dense form is the reference.
    grad = embedding_grad(dtype, scale=8.0)
    dense = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(8.0), {"w": grad.to_dense()}, max_norm=0.5)
    out = fmp.unscale_and_adjust(fmp.DynamicLossScale.create(8.0), {"w": grad}, max_norm=0.5, donate=donate)
    assert out.grads["w"].layout == torch.sparse_coo
    torch.testing.assert_close(out.grad_norm, dense.grad_norm)
    assert torch.equal(bits(out.grads["w"].to_dense()), bits(dense.grads["w"]))
    assert float(out.grad_norm) > 0.5 and bool(out.grads_finite)


def test_a_step_reports_the_norm_of_sparse_gradients() -> None:
    def loss_fn(params: dict[str, torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, params["emb"], sparse=True).sum()

    state = fmp.TrainState.create({"emb": torch.ones(10, 4)}, fmp.optim.sgd(0.1), fmp.DynamicLossScale.create(8.0))
    _, info = fmp.train_step(loss_fn, state, INDICES, policy=fmp.Policy(), optimizer=fmp.optim.sgd(0.1), grad_norm=True)
    # Rows 1 and 7 once or twice, row 3 three times: the norm of the summed rows' gradients.
    torch.testing.assert_close(info.grad_norm, torch.tensor((4 * (2**2 + 3**2 + 1**2)) ** 0.5))
