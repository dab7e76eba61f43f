"""fmp.debug.locate_nonfinite: names the op and module where inf or NaN first appear, and agrees with the step."""

from __future__ import annotations

import math
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import POLICIES
from conftest import assert_trees_bitwise_equal
from torch import nn

import fmp

FLOAT16 = fmp.get_policy("params=float32,compute=float16,output=float32")


def mlp(
    seed: int = 0, hidden_scale: float = 1.0
) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Linear, Tanh, (Linear, Tanh) in a nested Sequential, Linear; the hidden Linear's weight scaled."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["2.0.weight"] = params["2.0.weight"] * hidden_scale
    return model, params, torch.randn(4, 8), torch.randn(4, 1)


def loss_of(model: nn.Module) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    return loss_fn


def test_a_float16_forward_overflow_is_named_with_its_module_and_absorbed_by_tanh() -> None:
    model, params, x, y = mlp(hidden_scale=1e5)
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16)
    origin = report.forward
    assert origin is not None and (origin.op, origin.module, origin.node) == ("linear", "2.0", "")
    assert origin.output_dtypes == (torch.float16,) and set(origin.input_dtypes) == {torch.float16}
    assert 0 < origin.largest_input < torch.finfo(torch.float16).max
    # tanh(inf) is 1: the loss and gradients stay finite, as the step's flag says.
    grads = fmp.mixed_precision_grad(loss_of(model), params, fmp.NoOpLossScale(), x, y, policy=FLOAT16)
    assert report.finite and bool(grads.grads_finite) and report.backward is None
    text = str(report)
    assert "`linear` in module `2.0` (Linear): inf in its float16 output (it holds at most 6.55e+04)" in text
    assert "did not reach the loss (a mask or a saturating op took it in)" in text


@hypothesis.given(log2_scale=st.integers(0, 40), seed=st.integers(0, 3), hidden_scale=st.sampled_from([1.0, 300.0]))
@hypothesis.settings(max_examples=25)
def test_the_report_agrees_with_the_step_leaf_by_leaf(log2_scale: int, seed: int, hidden_scale: float) -> None:
    model, params, x, y = mlp(seed, hidden_scale)
    scaler = fmp.StaticLossScale.create(2.0**log2_scale)
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scaler)
    grads = fmp.mixed_precision_grad(loss_of(model), params, scaler, x, y, policy=FLOAT16)
    expected = tuple(f"params[{k!r}]" for k, g in grads.grads.items() if not bool(torch.isfinite(g).all()))
    assert report.nonfinite_grads == expected and report.finite == bool(grads.grads_finite)
    assert report.loss == float(grads.loss) and report.loss_scale == 2.0**log2_scale
    # The forward is finite at every scale, so a skipped step is the scaled backward's overflow.
    assert report.forward is None and report.nonfinite_inputs == ()
    assert (report.backward is None) == report.finite
    if report.backward is not None:
        assert report.backward.output_dtypes[0] == torch.float16 and report.backward.node.endswith("Backward0")
        assert report.backward.largest_input <= torch.finfo(report.backward.input_dtypes[0]).max


def test_a_backward_overflow_inside_a_module_names_the_module_and_the_gradient_function() -> None:
    model, params, x, y = mlp(hidden_scale=300.0)
    scaler = fmp.StaticLossScale.create(2.0**15)
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scaler)
    assert report.backward is not None and not report.finite
    assert (report.backward.op, report.backward.node, report.backward.module) == ("linear", "AddmmBackward0", "3")
    assert "the scaled backward pass overflowed" in str(report)
    # Past 65504 the gradient reaching the model's float16 output overflows first, in the cast
    # the policy's output rule made outside any module.
    report = fmp.debug.locate_nonfinite(
        loss_of(model), params, x, y, policy=FLOAT16, scaler=fmp.StaticLossScale.create(2.0**30)
    )
    assert report.backward is not None and (report.backward.op, report.backward.module) == ("to", "")
    assert report.backward.input_dtypes == (torch.float32,) and report.backward.output_dtypes == (torch.float16,)


@pytest.mark.parametrize("policy", POLICIES)
def test_nan_in_the_batch_is_named_and_not_blamed_on_any_op(policy: str) -> None:
    model, params, x, y = mlp()
    x[1, 3] = float("nan")
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=fmp.get_policy(policy))
    assert report.nonfinite_inputs == ("args[0]",) and report.forward is None and report.backward is None
    assert set(report.nonfinite_grads) == {f"params[{k!r}]" for k in params} and not report.finite
    assert "check the batch" in str(report)


def test_a_float32_log_of_zero_is_located_outside_any_module() -> None:
    model, params, x, y = mlp()

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (x,))
        return (out - y).square().mean() + torch.log(out - out).mean()

    report = fmp.debug.locate_nonfinite(loss_fn, params, x, y, policy=fmp.Policy())
    assert report.forward is not None and (report.forward.op, report.forward.module) == ("log", "")
    assert report.forward.output_dtypes == (torch.float32,) and report.loss == float("-inf")
    assert "a log of 0" in str(report) and not report.finite


def test_nothing_is_updated_and_the_hooks_are_removed() -> None:
    model, params, x, y = mlp(hidden_scale=300.0)
    scaler = fmp.DynamicLossScale.create()
    before = pytree.tree_map(torch.clone, (params, scaler, x, y))
    hooks = (
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
    )
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scaler)
    assert report.loss_scale == 2.0**16
    assert_trees_bitwise_equal((params, scaler, x, y), before)
    assert not any(p.requires_grad for p in params.values())
    assert hooks == (len(nn.modules.module._global_forward_pre_hooks), len(nn.modules.module._global_forward_hooks))


@pytest.mark.compiled
def test_called_inside_a_compiled_function_it_runs_eagerly() -> None:
    model, params, x, y = mlp()
    x = x.clone()
    x[0, 0] = float("inf")
    compiled = torch.compile(lambda x: fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16))
    assert str(compiled(x)) == str(fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16))


def test_bad_calls_raise_clear_errors() -> None:
    model, params, x, y = mlp()
    with pytest.raises(TypeError, match="locate_nonfinite's loss_fn must be a function, got int"):
        fmp.debug.locate_nonfinite(5, params, x, y, policy=FLOAT16)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="call it eagerly"):
        torch.func.grad(lambda p: fmp.debug.locate_nonfinite(loss_of(model), p, x, y, policy=FLOAT16).loss)(params)
    with pytest.raises(TypeError, match=r"policy must be an fmp\.Policy"):
        fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy="compute=float16")  # type: ignore[arg-type]
    ensemble = fmp.stack_trees([fmp.DynamicLossScale.create()] * 2)
    with pytest.raises(
        ValueError, match=r"loss_scale has shape \(2,\), but .* or take one member with fmp\.unstack_tree"
    ):
        fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=ensemble)
    with pytest.raises(TypeError, match="0-dim floating loss"):
        fmp.debug.locate_nonfinite(lambda p, x, y: loss_of(model)(p, x, y)[None], params, x, y, policy=FLOAT16)
    with pytest.raises(TypeError, match=r"nn\.Parameter"):
        fmp.debug.locate_nonfinite(loss_of(model), dict(model.named_parameters()), x, y, policy=FLOAT16)


class Attention(nn.Module):
    """Causal self-attention with an -inf mask, an in-place residual, a remat'd MLP and its own op."""

    def __init__(self, remat: bool = False, whole_rows: bool = False) -> None:
        super().__init__()
        self.qkv, self.mlp = nn.Linear(8, 24), nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.remat, self.whole_rows = remat, whole_rows

    def forward(self, x: torch.Tensor, gain: float) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), device=x.device).triu(1)
        # With `whole_rows`, the first row is masked whole: its softmax is NaN.
        dropped = torch.zeros(x.shape[1], x.shape[1], dtype=torch.bool)
        dropped[int(not self.whole_rows) :, 0] = True
        scores = (q @ k.transpose(-1, -2) + mask).masked_fill(dropped, float("-inf"))
        h = scores.softmax(-1) @ v
        h *= gain  # in place: its input is read before it runs
        return (fmp.remat.remat(self.mlp) if self.remat else self.mlp)(h).exp()


def attention_loss(model: nn.Module, gain: float) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x, gain)).mean()

    return loss_fn


def test_masks_in_place_ops_remat_and_the_outermost_module_are_reported_as_they_ran() -> None:
    torch.manual_seed(0)
    model = Attention()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(2, 5, 8)
    # The -inf masks are made on purpose: no overflow. An in-place op that overflows is named.
    report = fmp.debug.locate_nonfinite(attention_loss(model, 1.0), params, x, policy=FLOAT16)
    assert report.forward is None and report.finite and "forward: no overflow, no NaN" in str(report)
    report = fmp.debug.locate_nonfinite(attention_loss(model, 1e5), params, x, policy=FLOAT16)
    assert report.forward is not None and (report.forward.op, report.forward.module) == ("mul_", "")
    assert "in the outermost module (Attention): inf in its float16 output" in str(report)
    # A row masked whole: the softmax makes NaN from inputs holding only -inf besides finite values.
    report = fmp.debug.locate_nonfinite(attention_loss(Attention(whole_rows=True), 1.0), params, x, policy=FLOAT16)
    assert report.forward is not None and (report.forward.op, report.forward.made) == ("softmax", "NaN")
    assert "from float32 inputs holding inf (finite values of magnitude at most" in str(report) and not report.finite
    # A scaled backward overflow is placed in the same op with the MLP rematerialized or not.
    scaler = fmp.StaticLossScale.create(2.0**20)
    reports = [
        fmp.debug.locate_nonfinite(attention_loss(m, 1.0), params, x, policy=FLOAT16, scaler=scaler)
        for m in (model, Attention(remat=True))
    ]
    assert reports[0].backward is not None and reports[0].backward.module_type in {"Linear", "Attention", "GELU"}
    assert reports[0] == reports[1] and not reports[0].finite


def test_a_vmap_inside_the_loss_and_the_caller_state_are_left_alone() -> None:
    model, params, x, _ = mlp()
    norm = nn.BatchNorm1d(1, affine=False)
    buffers = {k: v.clone() for k, v in norm.named_buffers()}

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = torch.func.vmap(lambda row: torch.func.functional_call(model, params, (row,)))(x)
        out = torch.func.functional_call(norm, buffers, (nn.functional.dropout(out, 0.5),))
        return out.square().mean()

    torch.manual_seed(3)
    before = pytree.tree_map(torch.clone, buffers), torch.get_rng_state()
    report = fmp.debug.locate_nonfinite(loss_fn, params, buffers, x, policy=FLOAT16)
    assert report.finite and report.loss > 0
    assert_trees_bitwise_equal((buffers, torch.get_rng_state()), before)


class CountingNorm(nn.Module):
    """A train-mode BatchNorm1d beside a counter that the forward replaces rather than updates."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.norm(x)


def test_the_modules_own_buffers_are_put_back_after_the_forward_and_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), CountingNorm(), nn.Linear(8, 8), nn.BatchNorm1d(8).eval(), nn.Linear(8, 1))
    model[3].running_var.fill_(1e-9)  # the eval-mode norm (which its backward reads) blows up: inf in float16
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    before = {k: v.clone() for k, v in buffers.items()}
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    report = fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16)
    assert report.backward is not None and report.backward.module == "4" and not report.finite
    # The same tensors, holding the same values: running statistics, batch count and counter.
    assert all(model.get_buffer(k) is v for k, v in buffers.items())
    assert_trees_bitwise_equal(dict(model.named_buffers()), before)
    assert fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16) == report


class Lazy(nn.Module):
    """Adds a buffer in its first forward and sets one that was None."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.register_buffer("scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cache"):
            self.register_buffer("cache", x.detach().mean(0))
        if self.scale is None:
            self.scale = torch.ones(())
        return self.linear(x) * self.scale


def test_buffers_swapped_in_added_or_read_outside_functional_call_are_undone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), Lazy())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    own = dict(model.named_buffers())
    before = {k: v.clone() for k, v in own.items()}

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # The README's way (buffers as an argument, which this policy casts to bfloat16), then the
        # module with its own statistics, in float32, reading and updating them.
        swapped = torch.func.functional_call(model, {**params, **buffers}, (x,))
        in_float32 = {k: v.float() for k, v in params.items()}
        return swapped.float().square().mean() + torch.func.functional_call(model, in_float32, (x.float(),)).mean()

    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32,rules=none")
    report = fmp.debug.locate_nonfinite(loss_fn, params, own, torch.randn(4, 8), policy=policy)
    assert report.finite
    assert dict(model.named_buffers()).keys() == own.keys() and model[2].scale is None
    assert all(model.get_buffer(k) is v for k, v in own.items())
    assert_trees_bitwise_equal(dict(model.named_buffers()), before)


def test_what_the_step_refuses_is_refused_here_too() -> None:
    model, params, x, y = mlp()
    with pytest.raises(ValueError, match=r"reads 6 nn\.Parameter"):
        fmp.debug.locate_nonfinite(lambda p, x, y: nn.functional.mse_loss(model(x), y), params, x, y, policy=FLOAT16)
    with pytest.raises(TypeError, match=r"with has_aux=True, loss_fn must return \(loss, aux\)"):
        fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, has_aux=True)
    with pytest.raises(TypeError, match=r"params\['steps'\] is torch\.int64"):
        fmp.debug.locate_nonfinite(
            loss_of(model), {**params, "steps": torch.zeros((), dtype=torch.int64)}, x, y, policy=FLOAT16
        )
    scalers = (fmp.DynamicLossScale.create(), fmp.DynamicLossScale.create())
    with pytest.raises(TypeError, match=r"takes one scaler.*scaler=state\.scaler\[i\]"):
        fmp.debug.locate_nonfinite(loss_of(model), params, x, y, policy=FLOAT16, scaler=scalers)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
def test_an_absorbed_forward_overflow_is_said_to_be_absorbed_and_sparse_inputs_are_read() -> None:
    # An additive mask of float16's lowest value overflows to -inf in float16, which the softmax
    # takes in: the report says so, and points at the backward overflow that skips the step.
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    causal = torch.ones(5, 5, dtype=torch.float16).triu(1)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = x @ params["w"]
        scores = h @ h.T - 30000.0 + causal * torch.finfo(torch.float16).min
        return (scores.softmax(-1) @ h).square().mean() + extra.to_dense().sum()

    params = {"w": torch.randn(8, 8)}
    extra = torch.zeros(2, 3).to_sparse_csr()
    scaler = fmp.StaticLossScale.create(2.0**40)
    report = fmp.debug.locate_nonfinite(loss_fn, params, x, extra, policy=FLOAT16, scaler=scaler)
    assert report.forward is not None and report.forward.made == "inf" and not math.isnan(report.loss)
    assert report.backward is not None and not report.finite
    text = str(report)
    assert "did not reach the loss" in text and "the scaled backward pass overflowed" in text
    assert "a float16 forward op overflowed" not in text
