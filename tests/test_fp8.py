"""FP8 recipes: each quantizer and scale update against reference formulas written from the published recipes."""

from __future__ import annotations

import io
import math
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import fmp.fp8 as f8
from fmp._struct import OPTREE_NAMESPACE

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
RECIPES = {
    "tensorwise": f8.tensorwise(),
    "tensorwise_e4m3_pow2": f8.tensorwise("e4m3", power_of_2=True),
    "rowwise": f8.rowwise(),
    "rowwise_gw_hp": f8.rowwise(high_precision_weight_grad=True),
    "mxfp8": f8.mxfp8(),
    "blockwise": f8.blockwise(32),
}

magnitudes = st.floats(1e-6, 1e6, allow_nan=False)


def matrix(rows: int, cols: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    """Values over a few decades, so blocks and rows differ in scale."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=generator)
    return values * torch.exp2(spread * torch.randn(rows, 1, generator=generator))


def is_power_of_2(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa == 0.5).all())


# --- formats and the saturating cast ---------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "limit"), [(f8.E4M3, E4M3_MAX), (f8.E5M2, E5M2_MAX)])
def test_quantize_saturates_keeps_nan_and_never_makes_inf(dtype: torch.dtype, limit: float) -> None:
    x = torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan, 1.0])
    q = f8.quantize(x, torch.tensor(1.0), dtype).float()
    assert q[:4].tolist() == [limit, -limit, limit, -limit]
    assert math.isnan(q[4]) and q[5] == 1.0
    assert f8.max_finite(dtype) == limit


@given(st.lists(magnitudes, min_size=1, max_size=40), st.sampled_from([f8.E4M3, f8.E5M2]))
def test_a_current_scale_round_trips_within_the_formats_precision(values: list[float], dtype: torch.dtype) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    scale = f8.max_finite(dtype) / f8.amax(x)
    back = f8.dequantize(f8.quantize(x, scale, dtype), scale)
    mantissa_bits = 3 if dtype == f8.E4M3 else 2
    # Normal numbers round to within half an ulp; the subnormal range loses up to its own step.
    subnormal_step = torch.finfo(dtype).tiny * 2.0**-mantissa_bits / scale
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), subnormal_step / 2) * (1 + 1e-6)
    assert bool(((back - x).abs() <= bound).all())
    assert bool(torch.isfinite(back).all())


# --- current scaling: tensorwise and rowwise --------------------------------------------------------


@pytest.mark.parametrize("power_of_2", [False, True])
def test_tensorwise_scale_is_max_over_amax(power_of_2: bool) -> None:
    x = matrix(16, 32, seed=0)
    q = f8.tensorwise("e4m3", power_of_2=power_of_2).quantize(x, "input", 1)
    expected = torch.tensor(E4M3_MAX, dtype=torch.float32) / x.abs().max()
    if power_of_2:
        expected = torch.tensor(2.0 ** math.floor(math.log2(float(expected))))
    assert q.scale.shape == (1, 1)
    assert torch.equal(q.scale[0, 0], expected)
    assert torch.equal(q.data, (x * expected).clamp(-E4M3_MAX, E4M3_MAX).to(f8.E4M3))


def test_a_zero_tensor_gets_a_finite_scale_and_zeros() -> None:
    q = f8.tensorwise().quantize(torch.zeros(4, 8), "input", 1)
    assert torch.isfinite(q.scale).all() and not q.dequantize().any()


@pytest.mark.parametrize("contract_dim", [0, 1])
def test_rowwise_scales_one_per_row_along_the_contracted_dim_in_powers_of_2(contract_dim: int) -> None:
    x = matrix(16, 32, seed=1)
    q = f8.rowwise().quantize(x, "input", contract_dim)
    amaxes = x.abs().amax(dim=contract_dim, keepdim=True)
    expected = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amaxes)))
    assert torch.equal(q.scale, expected)
    assert is_power_of_2(q.scale)
    assert torch.equal(q.data, (x * expected).clamp(-E4M3_MAX, E4M3_MAX).to(f8.E4M3))


@given(st.integers(0, 2**16), st.sampled_from(["tensorwise_e4m3_pow2", "rowwise", "mxfp8"]))
def test_recipes_that_say_power_of_2_make_powers_of_2(seed: int, name: str) -> None:
    q = RECIPES[name].quantize(matrix(8, 64, seed, spread=12.0), "weight", 1)
    assert is_power_of_2(q.scale)


# --- MXFP8 and blockwise -----------------------------------------------------------------------------


def mx_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX v1.0 spec, element by element: X = floor(log2(amax)) - emax(E4M3) per 32-block, P = x / 2^X."""
    rows, cols = x.shape
    data, scales = torch.empty(rows, cols, dtype=f8.E4M3), torch.empty(rows, cols // 32)
    for r in range(rows):
        for b in range(cols // 32):
            block = x[r, 32 * b : 32 * (b + 1)]
            block_amax = float(block.abs().max())
            shared = math.frexp(block_amax)[1] - 1 - 8 if block_amax > 0 else -127
            shared = min(max(shared, -127), 127)
            scales[r, b] = 2.0**-shared
            data[r, 32 * b : 32 * (b + 1)] = (block * 2.0**-shared).clamp(-E4M3_MAX, E4M3_MAX).to(f8.E4M3)
    return data, scales


# Blocks where the spec's exponent arithmetic has its edges: a zero block (the smallest exponent),
# an exact power of two as a block's amax, and amaxes at the top of float32's range.
MX_EDGES = {
    "zero and power of two": [((0, slice(0, 32)), 0.0), ((1, 5), 2.0**7)],
    "float32 top": [((0, 3), 2.0**120), ((1, 40), -3.0e38)],
}


@pytest.mark.parametrize("edges", list(MX_EDGES.values()), ids=list(MX_EDGES))
def test_mxfp8_matches_the_spec_bit_for_bit(edges: list[tuple[Any, float]]) -> None:
    x = matrix(4, 128, seed=2, spread=20.0)
    for where, value in edges:
        x[where] = value
    q = f8.mxfp8().quantize(x, "input", 1)
    data, scales = mx_reference(x)
    assert torch.equal(q.scale, scales)
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))


def test_mxfp8_scales_fit_e8m0_and_a_non_finite_block_comes_out_nan() -> None:
    x = matrix(2, 64, seed=3)
    x[1, 40] = math.inf
    q = f8.mxfp8().quantize(x, "input", 1)
    as_e8m0 = q.scale[0].reciprocal().to(torch.float8_e8m0fnu).float()
    assert torch.equal(as_e8m0, q.scale[0].reciprocal())
    assert math.isnan(q.scale[1, 1]) and bool(q.data[1, 32:].float().isnan().all())
    assert not q.data[1, :32].float().isnan().any()


def test_blockwise_tiles_activations_by_rows_and_weights_by_squares_with_float32_scales() -> None:
    recipe = f8.blockwise(32)
    x = matrix(64, 64, seed=4)
    activation, weight = recipe.quantize(x, "input", 1), recipe.quantize(x, "weight", 1)
    assert activation.scale.shape == (64, 2) and weight.scale.shape == (2, 2)
    tiles = x.reshape(2, 32, 2, 32).abs().amax(dim=(1, 3))
    assert torch.equal(weight.scale, E4M3_MAX / tiles)
    assert torch.equal(activation.scale, E4M3_MAX / x.reshape(64, 2, 32).abs().amax(dim=2))


def test_blocks_that_do_not_tile_the_matrix_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"the input \(mxfp8 FP8\) of shape \(4, 48\).*blocks of 1x32"):
        f8.mxfp8().quantize(torch.ones(4, 48), "input", 1)


# --- delayed scaling ----------------------------------------------------------------------------------


def te_reference(history_len: int, algo: str, margin: float, steps: list[list[float]]) -> tuple[list, list]:
    """Transformer Engine's delayed scaling in plain Python lists: write row 0, reduce, scale, roll, zero row 0.

    A non-finite amax is written as 0 (fmp's rule where Transformer Engine's kernels differ).
    """
    maxima = [E4M3_MAX, E4M3_MAX, E5M2_MAX]
    history = [[0.0] * 3 for _ in range(history_len)]
    scale = [1.0] * 3
    for amaxes in steps:
        history[0] = [a if math.isfinite(a) else 0.0 for a in amaxes]
        for i in range(3):
            column = [row[i] for row in history]
            amax = max(column) if algo == "max" else column[0]
            if amax > 0:
                scale[i] = float(torch.tensor(maxima[i]) / torch.tensor(amax) / 2.0**margin)
        history = history[1:] + history[:1]
        history[0] = [0.0] * 3
    return history, scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize(("history_len", "margin"), [(1, 0.0), (4, 0.0), (4, 2.0)])
def test_delayed_update_follows_transformer_engines_recipe(algo: str, history_len: int, margin: float) -> None:
    steps = [[3.0, 0.5, 100.0], [0.25, 0.75, 7.0], [0.0, 0.5, math.inf], [5.0, math.nan, 1e-3], [1.0, 2.0, 3.0]]
    recipe = f8.delayed(history_len, algo, margin)
    state = recipe.init()
    for amaxes in steps:
        state = state.update(torch.tensor(amaxes))
    history, scale = te_reference(history_len, algo, margin, steps)
    assert state.amax_history.tolist() == [[float(torch.tensor(a)) for a in row] for row in history]
    assert state.scale.tolist() == scale


@given(st.lists(st.lists(magnitudes, min_size=3, max_size=3), min_size=1, max_size=12), st.integers(1, 6))
def test_delayed_history_invariants(steps: list[list[float]], history_len: int) -> None:
    recipe = f8.delayed(history_len)
    state = recipe.init()
    for index, amaxes in enumerate(steps):
        previous = state
        state = state.update(torch.tensor(amaxes))
        assert state.amax_history.shape == (history_len, 3) and state.scale.shape == (3,)
        assert not state.amax_history[0].any()  # the next step's slot
        if history_len > 1:
            recorded = torch.tensor(amaxes, dtype=torch.float32)
            assert torch.equal(state.amax_history[-1], recorded)
            assert torch.equal(state.amax_history[1:-1], previous.amax_history[2:])
        window = torch.tensor(steps[max(0, index + 1 - history_len) : index + 1], dtype=torch.float32)
        expected = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX]) / window.amax(dim=0)
        assert torch.equal(state.scale, expected)


def test_record_keeps_the_slots_larger_amax_and_drops_a_non_finite_one() -> None:
    state = f8.delayed(4).init().record(torch.tensor([4.0, 1.0, 2.0])).record(torch.tensor([1.0, 3.0, math.inf]))
    assert state.amax_history[0].tolist() == [4.0, 3.0, 2.0]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_zero_or_non_finite_amax_keeps_the_scale_the_state_had(algo: str) -> None:
    state = f8.delayed(1, algo).init().update(torch.tensor([2.0, 4.0, 8.0]))
    kept = state.scale.clone()
    assert not torch.equal(kept, torch.ones(3))
    assert torch.equal(state.update(torch.tensor([0.0, math.nan, math.inf])).scale, kept)
    assert torch.equal(f8.delayed(4, algo).init().update(torch.zeros(3)).scale, torch.ones(3))


def test_delayed_scale_saturates_at_float32_max_for_a_tiny_amax() -> None:
    recipe = f8.delayed(1)
    state = recipe.init().update(torch.tensor([1e-45, 1.0, 1.0]))
    assert state.scale[0] == torch.finfo(torch.float32).max


def test_delayed_state_is_a_pytree_for_torch_and_optree_and_loads_with_weights_only() -> None:
    state = f8.delayed(8).init()
    assert len(torch_pytree.tree_leaves(state)) == 2
    assert len(optree.tree_leaves(state, namespace=OPTREE_NAMESPACE)) == 2
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded, f8.DelayedScalingState) and torch.equal(loaded.scale, state.scale)


def test_delayed_states_map_under_vmap() -> None:
    recipe = f8.delayed(4)
    states = torch.func.vmap(lambda _: recipe.init(), randomness="same")(torch.zeros(3))
    amaxes = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, 0.25, 8.0]])
    mapped = torch.func.vmap(f8.DelayedScalingState.update)(states, amaxes)
    for member in range(3):
        one = recipe.init().update(amaxes[member])
        assert torch.equal(mapped.scale[member], one.scale)
        assert torch.equal(mapped.amax_history[member], one.amax_history)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"amax_compute": "mean"}, "amax_compute must be 'max' or 'most_recent'"),
        ({"format": "e3m4"}, "format must be one of"),
        ({"margin": -1.0}, r"margin must be in \[0.0, 64.0\)"),
        ({"history_len": 0}, r"history_len must be in \[1,"),
    ],
)
def test_delayed_refuses_bad_configuration(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        f8.delayed(**kwargs)  # type: ignore[arg-type]


def test_delayed_update_refuses_amaxes_of_another_shape() -> None:
    with pytest.raises(ValueError, match=r"amaxes must be a tensor of shape \(3,\)"):
        f8.delayed(4).init().update(torch.ones(2))


# --- fp8_linear -----------------------------------------------------------------------------------------


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.detach().float() - reference.detach()).norm() / reference.detach().norm())


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_linear_tracks_the_float32_linear_forward_and_backward(name: str) -> None:
    x = matrix(64, 64, seed=5, spread=1.0).bfloat16().requires_grad_()
    weight = (matrix(32, 64, seed=6, spread=1.0) / 8).requires_grad_()
    bias = torch.randn(32)
    y = f8.fp8_linear(x, weight, bias, recipe=RECIPES[name])
    reference = torch.nn.functional.linear(x.float(), weight, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (64, 32)
    grads = torch.autograd.grad(y.float().square().sum(), (x, weight))
    expected = torch.autograd.grad(reference.square().sum(), (x, weight))
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    assert relative_error(y, reference) < 0.08
    for grad, want in zip(grads, expected, strict=True):
        assert relative_error(grad, want) < 0.12


def reference_fake_quantize(matrix: torch.Tensor, block: tuple[int, int], scale_of: Any) -> torch.Tensor:
    """Quantize-dequantize by blocks, written apart from fmp's: per block, scale_of(amax), saturate, cast, undo."""
    rows, cols = matrix.shape
    blocks = matrix.detach().float().reshape(rows // block[0], block[0], cols // block[1], block[1])
    scale = scale_of(blocks.abs().amax(dim=(1, 3), keepdim=True))
    return ((blocks * scale).clamp(-E4M3_MAX, E4M3_MAX).to(f8.E4M3).float() * (1 / scale)).reshape(rows, cols)


def mx_scale(amaxes: torch.Tensor) -> torch.Tensor:
    exponents = [math.frexp(a)[1] - 1 - 8 if a > 0 else -127 for a in amaxes.flatten().tolist()]
    return torch.tensor([2.0 ** -min(max(e, -127), 127) for e in exponents]).reshape(amaxes.shape)


@pytest.mark.parametrize("name", ["rowwise", "mxfp8", "blockwise"])
def test_each_matmul_of_fp8_linear_scales_along_the_dim_it_contracts(name: str) -> None:
    # y = x W^T contracts the features; grad_x = g W the out features; grad_W = g^T x the tokens.
    def along(contracted: int, size: int) -> tuple[int, int]:
        return (size, 1) if contracted == 0 else (1, size)

    pow2 = lambda a: torch.exp2(torch.floor(torch.log2(E4M3_MAX / a.clamp(min=1e-12))))  # noqa: E731
    quantizers = {
        "rowwise": lambda m, role, dim: reference_fake_quantize(m, along(dim, m.shape[dim]), pow2),
        "mxfp8": lambda m, role, dim: reference_fake_quantize(m, along(dim, 32), mx_scale),
        "blockwise": lambda m, role, dim: reference_fake_quantize(
            m, (32, 32) if role == "weight" else along(dim, 32), lambda a: E4M3_MAX / a.clamp(min=1e-12)
        ),
    }
    q = quantizers[name]
    x, weight, g = (
        matrix(64, 128, seed=20).requires_grad_(),
        matrix(64, 128, seed=21).requires_grad_(),
        matrix(64, 64, 22),
    )
    y = f8.fp8_linear(x, weight, recipe=RECIPES[name])
    grad_x, grad_w = torch.autograd.grad(y, (x, weight), g)
    x, weight = x.detach(), weight.detach()
    assert torch.equal(y, q(x, "input", 1) @ q(weight.t(), "weight", 0))
    assert torch.equal(grad_x, q(g, "grad_output", 1) @ q(weight, "weight", 0))
    assert torch.equal(grad_w, q(g.t(), "grad_output", 1) @ q(x, "input", 0))


PER_TENSOR = {"tensorwise": f8.tensorwise("e4m3"), "delayed": f8.delayed(4, format="e4m3")}


@pytest.mark.parametrize("name", list(PER_TENSOR))
def test_per_tensor_recipes_multiply_the_forwards_fp8_operands_in_the_backward_bit_for_bit(name: str) -> None:
    # One scale per tensor: the backward's operands are the forward's, transposed. A bfloat16
    # input, a float32 weight: the output and the input's gradient in bfloat16, the weight's in float32.
    recipe = PER_TENSOR[name]
    scales = torch.tensor([64.0, 2.0, 0.5]) if name == "delayed" else None

    def q(m: torch.Tensor, role: str) -> torch.Tensor:
        if scales is None:
            return reference_fake_quantize(m, tuple(m.shape), lambda a: E4M3_MAX / a)
        return reference_fake_quantize(m, tuple(m.shape), lambda a: scales[f8.ROLES.index(role)])

    x, weight = matrix(64, 128, seed=20).bfloat16().requires_grad_(), matrix(48, 128, seed=21).requires_grad_()
    g = matrix(64, 48, seed=22, spread=1.0).bfloat16()
    y = f8.fp8_linear(x, weight, recipe=recipe, **({} if scales is None else {"scales": scales}))
    grad_x, grad_w = torch.autograd.grad(y, (x, weight), g)
    x, weight = x.detach(), weight.detach()
    assert torch.equal(y, (q(x, "input") @ q(weight.t(), "weight")).bfloat16())
    assert torch.equal(grad_x, (q(g, "grad_output") @ q(weight, "weight")).bfloat16())
    assert grad_w.dtype == torch.float32 and torch.equal(grad_w, q(g.t(), "grad_output") @ q(x, "input"))


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise"])
def test_per_tensor_recipes_save_the_fp8_input_for_the_backward_and_others_the_input(name: str) -> None:
    recipe = {**PER_TENSOR, "rowwise": f8.rowwise()}[name]
    saved: list[torch.Tensor] = []
    x, weight = matrix(32, 64, seed=23).bfloat16().requires_grad_(), matrix(48, 64, seed=24).requires_grad_()
    scales = {"scales": torch.ones(3, requires_grad=True)} if name == "delayed" else {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = f8.fp8_linear(x, weight, recipe=recipe, **scales)
    per_tensor = name != "rowwise"
    assert any(t.dtype == f8.E4M3 and t.shape == (32, 64) for t in saved) == per_tensor
    assert any(t.dtype == torch.bfloat16 and t.shape == (32, 64) for t in saved) != per_tensor
    assert torch.autograd.grad(y.float().sum(), x)[0].shape == x.shape


def test_a_delayed_fp8_linear_takes_an_empty_batch() -> None:
    weight, scales = matrix(16, 32, seed=25), f8.delayed(4).init().scale
    with torch.no_grad():
        assert f8.fp8_linear(torch.randn(0, 32), weight, recipe=f8.delayed(4), scales=scales).shape == (0, 16)
    assert f8.amax(torch.randn(0, 3)) == 0


@pytest.mark.parametrize("recipe", [f8.tensorwise(), f8.rowwise(), f8.delayed()], ids=lambda r: type(r).__name__)
def test_scaled_mm_gets_a_row_major_and_a_column_major_operand_in_all_three_matmuls(
    recipe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuBLASLt takes no other layout; the CPU's kernel takes any, so the layouts are checked here.
    layouts = []
    scaled_mm = torch._scaled_mm

    def spy(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        layouts.append((a.is_contiguous(), b.t().is_contiguous()))
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x, weight = matrix(32, 64, seed=23).bfloat16().requires_grad_(), matrix(48, 64, seed=24).requires_grad_()
    scales = {"scales": torch.ones(3)} if isinstance(recipe, f8.DelayedScaling) else {}
    y = f8.fp8_linear(x, weight, recipe=recipe, **scales)
    torch.autograd.grad(y.float().sum(), (x, weight))
    assert len(layouts) == 3 and all(row and column for row, column in layouts)


def test_the_native_scaled_mm_and_the_emulated_matmul_agree_bit_for_bit() -> None:
    a, b = matrix(32, 64, seed=7), matrix(64, 48, seed=8)
    for recipe in (f8.tensorwise(), f8.rowwise(), f8.rowwise(power_of_2=False)):
        qa, qb = recipe.quantize(a, "input", 1), recipe.quantize(b, "weight", 0)
        for dtype in (torch.float32, torch.bfloat16):
            native = f8.fp8_matmul(qa, qb, dtype, native=True)
            assert torch.equal(native, f8.fp8_matmul(qa, qb, dtype, native=False))


def test_fp8_linear_takes_leading_dims_and_the_autocast_dtype_as_nn_linear_does() -> None:
    x, weight = matrix(4 * 16, 32, seed=9).reshape(4, 16, 32), matrix(16, 32, seed=10)
    plain = f8.fp8_linear(x, weight, recipe=f8.tensorwise())
    assert plain.shape == (4, 16, 16) and plain.dtype == torch.float32
    # Under autocast the input is cast to its dtype, as nn.Linear's (and torchao's Float8Linear's);
    # inside, the matmul is the recipe's, not autocast's.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = f8.fp8_linear(x, weight, recipe=f8.tensorwise())
    assert torch.equal(under_autocast, f8.fp8_linear(x.bfloat16(), weight, recipe=f8.tensorwise()))


def test_delayed_fp8_linear_gives_the_steps_amaxes_as_the_scales_gradient() -> None:
    recipe = f8.delayed(4)
    state = recipe.init()
    x, weight = matrix(16, 32, seed=11).requires_grad_(), matrix(8, 32, seed=12)
    scales = state.scale.clone().requires_grad_()
    y = f8.fp8_linear(x, weight, recipe=recipe, scales=scales)
    upstream = matrix(16, 8, seed=13)
    (amaxes,) = torch.autograd.grad(y, scales, upstream)
    assert amaxes.tolist() == [x.abs().max().item(), weight.abs().max().item(), upstream.abs().max().item()]
    new = state.update(amaxes)
    y_next = f8.fp8_linear(x, weight, recipe=recipe, scales=new.scale)
    assert relative_error(y_next, torch.nn.functional.linear(x, weight)) < 0.08


def test_fp8_linear_under_torch_func_grad_and_vmap_matches_a_loop() -> None:
    recipe = f8.mxfp8()
    x = matrix(32, 64, seed=14)
    weights = torch.stack([matrix(32, 64, seed=s) for s in (15, 16, 17)])

    def loss(weight: torch.Tensor) -> torch.Tensor:
        return f8.fp8_linear(x, weight, recipe=recipe).square().mean()

    mapped = torch.func.vmap(torch.func.grad(loss))(weights)
    for member in range(3):
        assert torch.equal(mapped[member], torch.func.grad(loss)(weights[member]))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"recipe": "tensorwise"}, TypeError, "recipe must be an fmp.fp8 recipe"),
        ({"recipe": f8.delayed()}, TypeError, "scales and loss_scale go with a delayed recipe"),
        ({"recipe": f8.tensorwise(), "scales": torch.ones(3)}, TypeError, "go with a delayed recipe"),
        ({"recipe": f8.tensorwise(), "loss_scale": torch.ones(())}, TypeError, "go with a delayed recipe"),
        ({"recipe": f8.delayed(), "scales": torch.ones(2)}, ValueError, r"float32 tensor of shape \(3,\)"),
        ({"recipe": f8.delayed(), "scales": torch.ones(3).half()}, ValueError, "float32 tensor of shape"),
        (
            {"recipe": f8.delayed(), "scales": torch.ones(3), "loss_scale": torch.ones(2)},
            ValueError,
            "loss_scale must be a 0-dim float32 tensor",
        ),
        ({"recipe": f8.tensorwise(), "bias": torch.ones(16, 1)}, ValueError, r"bias must be of shape \(16,\)"),
        ({"recipe": f8.mxfp8()}, ValueError, r"the tokens \(2\) must be a multiple of the recipe's block \(32\)"),
    ],
)
def test_fp8_linear_refuses_bad_arguments(kwargs: dict[str, object], error: type, message: str) -> None:
    weight = torch.ones(16 if "bias" in kwargs else 32, 32)
    with pytest.raises(error, match=message):
        f8.fp8_linear(torch.ones(2, 32), weight, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("x", [torch.ones(2, 16, dtype=torch.int64), torch.ones(2, 16, dtype=torch.complex64)])
def test_fp8_linear_refuses_inputs_that_are_not_real_floats(x: torch.Tensor) -> None:
    with pytest.raises(TypeError, match=r"x must be a real floating-point tensor, got torch\.(int64|complex64)"):
        f8.fp8_linear(x, torch.ones(16, 16), recipe=f8.tensorwise())


def test_fp8_linear_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"x \(2, 16\) and weight \(16, 8\) do not match"):
        f8.fp8_linear(torch.ones(2, 16), torch.ones(16, 8), recipe=f8.tensorwise())
    with pytest.raises(ValueError, match=r"x \(\) and weight \(16, 8\) do not match"):
        f8.fp8_linear(torch.ones(()), torch.ones(16, 8), recipe=f8.tensorwise())


def test_recipes_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match="format must be one of"):
        f8.tensorwise("fp8")
    with pytest.raises(TypeError, match="power_of_2 must be a bool"):
        f8.rowwise(power_of_2=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block must be in \[1,"):
        f8.blockwise(0)


@pytest.mark.compiled
# Dynamo instantiates the Function class itself while tracing it, which torch deprecates.
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
def test_a_delayed_fp8_step_compiles_whole_and_moving_scales_do_not_recompile() -> None:
    recipe = f8.delayed(4)
    x, weight = matrix(16, 32, seed=18), matrix(16, 32, seed=19)

    def step(weight: torch.Tensor, state: f8.DelayedScalingState) -> tuple[torch.Tensor, f8.DelayedScalingState]:
        def loss(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            return f8.fp8_linear(x, weight, recipe=recipe, scales=scales).square().mean()

        grad_w, amaxes = torch.func.grad(loss, argnums=(0, 1))(weight, state.scale)
        return weight - 0.1 * grad_w, state.update(amaxes)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    state, eager_state, eager_weight = recipe.init(), recipe.init(), weight
    for _ in range(3):
        weight, state = compiled(weight, state)
        eager_weight, eager_state = step(eager_weight, eager_state)
    assert counter.frame_count == 1
    assert torch.equal(state.scale, eager_state.scale) and not torch.equal(state.scale, torch.ones(3))
    assert torch.allclose(weight, eager_weight, rtol=1e-5, atol=1e-6)
