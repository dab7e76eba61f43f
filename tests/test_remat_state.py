"""fmp.remat with state: in-place updates, running statistics, captured tensors, and the inputs it refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import block_fn
from conftest import block_weights
from torch import nn
from torch.autograd import forward_ad
from torch.multiprocessing.reductions import StorageWeakRef

import fmp


def test_captured_tensors_that_need_gradients_are_refused() -> None:
    x, w1, _ = block_weights()
    message = r"fmp.remat: .*<lambda> reads a tensor of shape \(8, 16\) .* not one of its arguments"
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(lambda w: fmp.remat.remat(lambda h: torch.tanh(h @ w))(x).sum())(w1)
    tracked = w1.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=message):
        fmp.remat.remat(lambda h: torch.tanh(h @ tracked))(x)
    layer = nn.Linear(8, 8)
    with pytest.raises(RuntimeError, match=r"wrap the nn\.Module itself"):
        fmp.remat.remat(lambda h: layer(h))(x)
    # Captured constants (nothing differentiates them) are fine, also ones made inside a transform,
    # and so are reads of a tracked tensor's shape and dtype alone (no gradient flows through them).
    shaped_like = fmp.remat.remat(
        lambda h: (h @ w1).sum() + torch.zeros_like(tracked).sum() + torch.ones_like(tracked)[0, 0]
    )
    shaped_like(x.clone().requires_grad_()).sum().backward()
    fmp.remat.remat(lambda h: torch.tanh(h @ w1))(x.clone().requires_grad_()).sum().backward()

    def masked(w: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(4, 8)
        return fmp.remat.remat(lambda h, w: torch.tanh((h * mask) @ w))(x, w).sum()

    assert torch.func.grad(masked)(w1).abs().sum() > 0


class NormNet(nn.Module):
    def __init__(self, remat: bool) -> None:
        super().__init__()
        self.inner, self.norm, self.outer = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)
        self.remat = remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu((fmp.remat.remat(self.norm) if self.remat else self.norm)(self.inner(x))))


def test_batchnorm_inside_updates_its_statistics_once_and_matches_the_unwrapped_model() -> None:
    # The recompute updates copies of the running statistics, so they move once per forward pass
    # (torch.utils.checkpoint moves them twice). Buffers go in through *args, as fmp's step takes them.
    torch.manual_seed(0)
    plain, wrapped = NormNet(False), NormNet(True)
    wrapped.load_state_dict(plain.state_dict())
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x, y = torch.randn(6, 8), torch.randn(6, 8)

    def run(model: nn.Module, train: bool) -> tuple[Any, dict[str, torch.Tensor]]:
        model.train(train)
        buffers = {k: v.clone() for k, v in model.named_buffers()}

        def loss(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(torch.func.functional_call(model, {**params, **buffers}, (x,)), y)

        grads = fmp.mixed_precision_grad(loss, params, fmp.NoOpLossScale(), buffers, x, y, policy=fmp.Policy())
        return grads.grads, buffers

    for train in (True, False):
        ours, reference = run(wrapped, train), run(plain, train)
        assert_trees_bitwise_equal(ours, reference)
        assert int(ours[1]["norm.num_batches_tracked"]) == int(train)
        assert train == (not torch.equal(ours[1]["norm.running_mean"], torch.zeros(8)))


def test_running_statistics_passed_to_batch_norm_move_once_and_captured_ones_are_refused() -> None:
    x, w1, _ = block_weights()

    def normed(h: torch.Tensor, w: torch.Tensor, stats: list[torch.Tensor]) -> torch.Tensor:
        h = F.batch_norm(h @ w, stats[0], running_var=stats[1], training=True)
        return torch.instance_norm(h.T[None], None, None, stats[2], stats[3], True, 0.1, 1e-5, False)[0].T.tanh()

    def run(block: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
        stats = [torch.zeros(16), torch.ones(16), torch.zeros(16), torch.ones(16)]
        return torch.func.grad(lambda w: block(x, w, stats=stats).sum())(w1), stats

    ours, reference = run(fmp.remat.remat(normed)), run(normed)
    assert_trees_bitwise_equal(ours, reference)
    assert not any(torch.equal(s, s.new_full((16,), float(n % 2))) for n, s in enumerate(reference[1]))
    # In evaluation (training=False) the statistics are read, not updated: captured ones pass.
    mean, var = torch.zeros(8), torch.ones(8)
    fmp.remat.remat(lambda h: F.batch_norm(h, mean, var))(x.clone().requires_grad_()).sum().backward()
    with pytest.raises(RuntimeError, match=r"updates a tensor of shape \(8,\) in place .*Wrap the nn\.Module"):
        fmp.remat.remat(lambda h: F.batch_norm(h, mean, var, training=True))(x.clone().requires_grad_())
    assert torch.equal(mean, torch.zeros(8))
    with pytest.raises(RuntimeError, match=r"updates a tensor of shape \(8,\) in place"):
        fmp.remat.remat(lambda h: h + mean.add_(1))(x.clone().requires_grad_())
    assert torch.equal(mean, torch.zeros(8))
    # Only norms are looked at: a call with six or more arguments is none of them.
    fmp.remat.remat(lambda h: h.view(1, 1, 1, 1, 4, 8).tanh())(x.clone().requires_grad_()).sum().backward()


def test_a_block_reading_what_it_updates_in_place_recomputes_from_the_values_it_first_read() -> None:
    # Batch renormalisation reads the running variance it updates; a counter is read, then bumped;
    # statistics come as views of one argument (torch.ops too), and temporary ones are made inside.
    x, w1, _ = block_weights()

    def renorm(h: torch.Tensor, w: torch.Tensor, stats: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        z = h @ w
        r = ((z.var(0, unbiased=False) + 1e-5) / (stats[1] + 1e-5)).sqrt()
        z = F.batch_norm(z, stats[0], stats[1], training=True) * r + count
        count += 1
        z = torch.ops.aten.native_batch_norm(z, None, None, stats[2], stats[3], True, 0.1, 1e-5)[0]
        return F.batch_norm(z, torch.zeros(16), torch.ones(16), training=True).tanh()

    def run(block: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
        stats, count = torch.stack([torch.zeros(16), torch.ones(16)] * 2), torch.ones(())
        return torch.func.grad(lambda w, *state: block(x, w, *state).sum())(w1, stats, count), stats, count

    ours, reference = run(fmp.remat.remat(renorm)), run(renorm)
    assert_trees_bitwise_equal(ours, reference)
    assert float(reference[2]) == 2.0 and not torch.equal(reference[1][3], torch.ones(16))


def test_a_tensor_passed_and_also_read_from_a_module_is_refused_and_views_of_arguments_pass() -> None:
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="not one of its arguments"):
        fmp.remat.remat(lambda h, w: layer(h) @ w)(x, layer.weight)  # the module reads its own weight too
    # Views of the arguments, and a module's own weights when the module itself is wrapped, pass.
    fmp.remat.remat(lambda h, w: h.t().t() @ w.T)(x, layer.weight).sum().backward()

    class Transposed(nn.Linear):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h @ self.weight.T + self.bias

    torch.manual_seed(0)
    module = Transposed(8, 8)
    loss = fmp.remat.remat(module)(x).square().sum()
    assert fmp.remat.remat(module).__name__ == "forward"
    ours = torch.autograd.grad(loss, [x, module.weight, module.bias])
    assert_trees_bitwise_equal(ours, torch.autograd.grad(module(x).square().sum(), [x, module.weight, module.bias]))
    # Reading only a captured tensor's shape carries no gradient, so it passes.
    w = torch.randn(8, 8, requires_grad=True)
    fmp.remat.remat(lambda h, v: (h @ v).reshape(w.shape[0] // 2, -1))(x, w).sum().backward()


def test_inputs_updated_in_place_and_returned_constants_are_handled() -> None:
    x, w1, _ = block_weights()
    tracked = x.clone().requires_grad_()

    def doubles_its_input(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h.mul_(2)
        return h @ w

    with pytest.raises(RuntimeError, match=r"updates its argument args\[0\] in place"):
        torch.func.grad(lambda h: fmp.remat.remat(doubles_its_input)(h, w1).sum())(tracked.detach() + 0)
    # A constant returned as it is stays the caller's tensor, untouched by autograd.
    constant = torch.ones(3)
    out = fmp.remat.remat(lambda h: (h.sum(), constant))(tracked)
    assert out[1] is not constant and torch.equal(out[1], constant)
    assert constant.is_leaf and constant.grad_fn is None and not constant.requires_grad
    # A constant updated between the forward and the backward pass would feed the recompute new values.
    scale = torch.full((8,), 2.0)
    y = fmp.remat.remat(lambda h, s: h * s)(tracked, scale)
    scale.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # autograd's check on saved inputs
        y.sum().backward()


def test_integer_arguments_under_an_ensemble_and_views_read_through_properties() -> None:
    # Integer labels enter a remat'd head in a vmap ensemble; torch.func wraps them too.
    torch.manual_seed(0)
    head = nn.Linear(8, 4)
    params = {k: v.detach() for k, v in head.named_parameters()}
    members = fmp.stack_trees([params, pytree.tree_map(lambda p: p * 2, params)])
    x, labels = torch.randn(6, 8), torch.randint(0, 4, (6,))

    def grads(block: Callable[..., torch.Tensor]) -> Any:
        def loss(p: Any, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return block(torch.func.functional_call(head, p, (x,)), labels)

        def member(p: Any) -> Any:
            return fmp.mixed_precision_grad(loss, p, fmp.NoOpLossScale(), x, labels, policy=fmp.Policy()).grads

        return torch.func.vmap(member)(members)

    assert_trees_bitwise_equal(grads(fmp.remat.remat(F.cross_entropy)), grads(F.cross_entropy))
    # A captured parameter read through a view property (.T, .mT) is refused like any other read.
    w = torch.randn(8, 8)
    for read in (lambda v: v.T, lambda v: v.mT):
        with pytest.raises(RuntimeError, match="not one of its arguments"):
            torch.func.grad(lambda v, read=read: fmp.remat.remat(lambda h: torch.tanh(h @ read(v)))(x).sum())(w)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward AD's first use
def test_forward_ad_dual_tensors_are_refused_and_data_is_freed_after_the_backward() -> None:

    x, w1, w2 = block_weights()
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match=r"dual tensor of torch\.autograd\.forward_ad"):
        fmp.remat.remat(block_fn)(forward_ad.make_dual(x, torch.ones_like(x)), w1, w2)
    # Data nothing differentiates is an input too: autograd frees it with the node.
    features = x * 2
    weak = StorageWeakRef(features.untyped_storage())
    out = fmp.remat.remat(block_fn)(features, w1.requires_grad_(), w2)
    del features
    out.sum().backward()
    assert weak.expired() and out.grad_fn is not None


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"fmp\.remat wraps a function or an nn\.Module, got int"):
        fmp.remat.remat(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="preserve_rng_state must be a bool, got int"):
        fmp.remat.remat(block_fn, preserve_rng_state=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"<lambda> returned a int at output\[1\]; .* returns tensors only"):
        fmp.remat.remat(lambda x: (x * 2, 3))(torch.ones(2))


def test_updates_through_aliases_of_captured_tensors_are_refused() -> None:
    x, w1, _ = block_weights()
    counter = torch.zeros(())
    aliases: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda t: t.detach(),
        lambda t: t.data,
        lambda t: t.to(t.device),
        lambda t: t.view(()),
    ]
    for alias in aliases:
        with pytest.raises(RuntimeError, match=r"updates a tensor of shape \(\) in place that is not one of"):
            fmp.remat.remat(lambda h, w, alias=alias: h @ w + alias(counter).add_(1))(x, w1.clone().requires_grad_())
    assert float(counter) == 0.0
