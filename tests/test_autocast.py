"""fmp.autocast: parity with torch.autocast's CPU lists, the CUDA lists on CPU, semantics, transforms."""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from conftest import bits
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from fmp.autocast import autocast
from fmp.autocast._rules import CPU
from fmp.autocast._rules import CUDA
from fmp.autocast._rules import Cast
from fmp.autocast._transform import resolve_rules

LOW = [torch.bfloat16, torch.float16]

# Registered for AutocastCPU but internal: reached through the public ops sampled here
# (conv*, multi_head_attention, rnn layers, multilabel_margin_loss), or needing inputs this
# file does not build (ctc_loss).
UNSAMPLED = {"_convolution", "_native_multi_head_attention", "mkldnn_rnn_layer", "multilabel_margin_loss_forward"}
UNSAMPLED |= {"ctc_loss"}


def _generic_samples() -> Iterator[tuple[Any, ...]]:
    """Argument lists tried in turn on an op until one runs (in float32, without autocast)."""
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    a = r(4, 4)
    m = a @ a.T / 4 + torch.eye(4)  # symmetric positive definite, well conditioned
    b = torch.stack([m, m + torch.eye(4)])
    v = torch.rand(4, generator=gen) * 0.8 + 0.1  # in (0, 1): valid probabilities and positive
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])
    x3, x4, x5 = r(1, 2, 8), r(1, 2, 8, 8), r(1, 2, 4, 4, 4)
    target = torch.tensor([0, 2, 1, 0])
    yield from [(m,), (m, m), (m, m, m), (b,), (b, b), (b, b, b), (m, b, b), (m, 1), (m, m, sign)]
    yield from [(v,), (v, v), (v, v, v), (v, v, sign), (r(4, 2),), (r(4, 3).log_softmax(-1), target)]
    yield (r(4, 3).log_softmax(-1), torch.tensor([[0, 2, -1], [1, -1, -1], [2, -1, -1], [0, 1, -1]]))
    yield (r(1, 3, 2, 2).log_softmax(1), torch.zeros(1, 2, 2, dtype=torch.long))
    yield from [(x3, r(2, 2, 3)), (x4, r(2, 2, 3, 3)), (x5, r(2, 2, 3, 3, 3)), (r(8, 1, 2), r(3, 2, 2), r(2))]
    yield from [(x5, 2), (x3, [1, 1]), (x4, [1, 1, 1, 1]), (x5, [1] * 6)]
    yield from [(x4, r(1, 4, 4, 2), 0, 0, False), (x5, r(1, 2, 2, 2, 3), 0, 0, False), (x4, r(1, 4, 4, 2))]
    yield from [(m, 0.1, 0, 0, 255), (m, 0.5), (v, torch.tensor(0.5)), (m, r(4)), ([m, m],), ([m, m], 0)]
    yield from [(m, 0, target[:2], r(2, 4)), (r(2, 3, 4), r(2, 3, 4), r(2, 3, 4)), (v, m, v), (m, v, v)]
    yield from [(m, (4,)), (m, 2.0, 0, 1.0)]


def _special_samples(name: str) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    m = torch.eye(4) * 2 + 0.1
    if name == "stft":
        return (torch.randn(64), 16), {"return_complex": True}
    if name in {"fractional_max_pool2d", "fractional_max_pool3d"}:
        x = torch.randn(1, 2, *([8] * (2 if name.endswith("2d") else 3)))
        return (x, 2), {"output_ratio": (0.5,) * (x.dim() - 2), "_random_samples": torch.full((1, 2, x.dim() - 2), 0.5)}
    if name in {"max_unpool2d", "max_unpool3d"}:
        x = torch.randn(1, 2, *([4] * (2 if name.endswith("2d") else 3)))
        pool = F.max_pool2d if name.endswith("2d") else F.max_pool3d
        out, indices = pool(x, 2, return_indices=True)
        return (out, indices, 2), {}
    if name == "lu_solve":
        lu, pivots = torch.linalg.lu_factor(m)
        return (torch.randn(4, 2), lu, pivots), {}
    if name == "ormqr":
        a, tau = torch.geqrf(m)
        return (a, tau, torch.randn(4, 2)), {}
    return None


def _resolve(name: str) -> Callable[..., Any] | None:
    # torch.nn.functional first: its losses take defaults the aten bindings require.
    for namespace in (F, torch, torch._C._nn, torch._C._linalg, torch._C._fft, torch.Tensor):
        op = getattr(namespace, name, None)
        if callable(op):
            return op  # type: ignore[no-any-return]
    return None


def _sample(name: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
    op = _resolve(name)
    if op is None:
        return None
    special = _special_samples(name)
    candidates = [special] if special is not None else [(args, {}) for args in _generic_samples()]
    for args, kwargs in candidates:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                op(*args, **kwargs)
        except Exception:
            continue
        return op, args, kwargs
    return None


def _to(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _dtypes(tree: Any) -> list[Any]:
    return [x.dtype if isinstance(x, torch.Tensor) else type(x) for x in pytree.tree_leaves(tree)]


def _result(fn: Callable[[], Any]) -> Any:
    """What `fn()` returns, or the type of the exception it raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn()
        except Exception as error:
            return type(error)


def _outcome(fn: Callable[[], Any]) -> Any:
    """The dtypes of what `fn()` returns, or the type of the exception it raises."""
    result = _result(fn)
    return result if isinstance(result, type) else _dtypes(result)


def _assert_same_outcome(got: Any, expected: Any) -> None:
    """Equal exception types, or outputs equal in structure, dtype and every bit."""
    if isinstance(expected, type) or isinstance(got, type):
        assert got == expected
        return
    assert _dtypes(got) == _dtypes(expected)
    for x, y in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(bits(x), bits(y)), (x, y)


def _cpu_registrations() -> set[str]:
    keys = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
    return {key.split("::")[-1].split(".")[0] for key in keys}


CPU_OPS = sorted(_cpu_registrations())
# LAPACK's least squares on CPU differs from one call to the next in the last bits (the input's
# memory alignment decides its code path), torch.autocast's own calls included.
NOT_REPRODUCIBLE = {"linalg_lstsq"}


def test_cpu_registrations_are_sampled_and_in_the_cpu_rules() -> None:
    # Tracks torch: an op newly registered for AutocastCPU fails here until it has a rule and a sample.
    assert set(CPU_OPS) <= set(CPU), sorted(set(CPU_OPS) - set(CPU))
    unsampled = {name for name in CPU_OPS if _sample(name) is None}
    assert unsampled <= UNSAMPLED, sorted(unsampled - UNSAMPLED)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_rules_match_torch_autocast_cpu(dtype: torch.dtype, input_dtype: torch.dtype) -> None:
    checked = 0
    for name in CPU_OPS:
        sample = _sample(name)
        if sample is None:
            continue
        op, args, kwargs = sample
        args, kwargs = _to((args, kwargs), input_dtype)

        def call(op: Callable[..., Any] = op, args: Any = args, kwargs: Any = kwargs) -> Any:
            return op(*args, **kwargs)

        def under_torch(call: Callable[[], Any] = call) -> Any:
            with torch.autocast("cpu", dtype):
                return call()

        expected = _result(under_torch)
        if expected is NotImplementedError or (expected is RuntimeError and input_dtype != torch.float32):
            continue  # no kernel for this op in this input dtype on CPU
        got = _result(autocast(call, dtype, rules="cpu"))
        if name in NOT_REPRODUCIBLE:
            assert _dtypes(got) == _dtypes(expected), name
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        else:
            _assert_same_outcome(got, expected)  # bit for bit: both run torch's kernel on the same casts
        checked += 1
    assert checked >= 60


def _cuda_sample(name: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    modules = {"gru_cell": nn.GRUCell, "lstm_cell": nn.LSTMCell, "rnn_tanh_cell": nn.RNNCell, "lstm": nn.LSTM}
    modules |= {"rnn_relu_cell": functools.partial(nn.RNNCell, nonlinearity="relu"), "gru": nn.GRU}
    modules |= {"rnn_tanh": nn.RNN, "rnn_relu": functools.partial(nn.RNN, nonlinearity="relu")}
    if name in modules:
        return modules[name](4, 4), (torch.randn(2, 4),), {}  # a cell's batch, or an unbatched sequence
    if name == "einsum":
        return torch.einsum, ("ij,jk->ik", torch.randn(3, 4), torch.randn(4, 5)), {}
    if name in {"__rpow__", "__rdiv__"}:
        m = torch.rand(4, 4) + 0.5
        return getattr(torch.Tensor, name), (m, m), {}
    if name in {"index_put", "scatter_add"}:
        index = torch.tensor([0, 2])
        if name == "index_put":
            return torch.index_put, (torch.randn(4, 3), (index,), torch.randn(2, 3)), {}
        return torch.scatter_add, (torch.randn(4, 3), 0, index[:, None].expand(2, 3), torch.randn(2, 3)), {}
    if name in {"grid_sample", "bilinear", "tensordot", "cross", "dot"}:
        samples = {
            "grid_sample": (torch.randn(1, 2, 4, 4), torch.rand(1, 3, 3, 2) * 2 - 1),
            "bilinear": (torch.randn(2, 3), torch.randn(2, 4), torch.randn(5, 3, 4)),
            "tensordot": (torch.randn(3, 4), torch.randn(4, 5), 1),
            "cross": (torch.randn(2, 3), torch.randn(2, 3)),
            "dot": (torch.randn(4), torch.randn(4)),
        }
        return _resolve(name), samples[name], {}  # type: ignore[return-value]
    sample = _sample(name)
    assert sample is not None, f"no sample for {name}"
    return sample


# In the "cuda" rules because torch registers them for AutocastCUDA, not from the docs' lists:
# tests/test_autocast_cuda_rules.py checks them against torch.autocast("cuda") itself.
REGISTRY_ONLY = {"conv_tbc", "convolution", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose"}
REGISTRY_ONLY |= {"linalg_vecdot", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention"}
REGISTRY_ONLY |= {"_thnn_fused_gru_cell", "_thnn_fused_lstm_cell", "rms_norm", "native_layer_norm", "logsumexp"}
REGISTRY_ONLY |= {"huber_loss", "nll_loss2d", "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm"}
REGISTRY_ONLY |= {"nuclear_norm", "vdot", "grid_sampler"} | {name for name in CUDA if "upsample" in name}


@pytest.mark.parametrize("dtype", LOW)
def test_cuda_rules_on_cpu_land_where_the_docs_say(dtype: torch.dtype) -> None:
    for name, cast in CUDA.items():
        if cast is Cast.FLOAT32_UNLESS_FLOAT16 or name in REGISTRY_ONLY:
            continue  # tested on its own below, or against torch itself
        op, args, kwargs = _cuda_sample(name)
        if cast is Cast.PROMOTE:
            # Only the first floating input in `dtype`, by position (a sample may repeat one tensor).
            leaves, spec = pytree.tree_flatten((args, kwargs))
            first = next(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point())
            leaves[first] = leaves[first].to(dtype)
            mixed = pytree.tree_unflatten(leaves, spec)
            assert (
                _outcome(lambda op=op, mixed=mixed: autocast(op, dtype)(*mixed[0], **mixed[1]))[0] == torch.float32
            ), name
            low = _to((args, kwargs), dtype)
            expected = _outcome(lambda op=op, low=low: op(*low[0], **low[1]))  # no autocast: native dtype
            assert _outcome(lambda op=op, low=low: autocast(op, dtype)(*low[0], **low[1])) == expected, name
            continue
        source = torch.float32 if cast is Cast.LOWER else dtype
        inputs = _to((args, kwargs), source)
        want = dtype if cast is Cast.LOWER else torch.float32
        if isinstance(op, nn.Module):
            params = {k: v.to(source) for k, v in op.named_parameters()}
            op, inputs = torch.func.functional_call, ((op, params, inputs[0]), {})
        assert _outcome(lambda op=op, inputs=inputs: autocast(op, dtype)(*inputs[0], **inputs[1]))[0] == want, name


def test_seed_lists_are_the_cuda_rules() -> None:
    lower = {"addmm", "bmm", "conv2d", "einsum", "linear", "matmul", "mm", "prelu"}
    float32 = {"softmax", "log_softmax", "layer_norm", "group_norm", "exp", "log", "pow", "sum", "mse_loss", "norm"}
    assert {CUDA[name] for name in lower} == {Cast.LOWER}
    assert {CUDA[name] for name in float32} == {Cast.FLOAT32}
    assert {name for name, cast in CUDA.items() if cast is Cast.PROMOTE} == {
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put", "scatter_add",
        "tensordot", "vdot", "grid_sampler",
    }  # fmt: skip


@pytest.mark.parametrize("dtype", LOW)
def test_float64_and_integers_are_untouched(dtype: torch.dtype) -> None:
    x64 = torch.randn(3, 3, dtype=torch.float64)
    assert autocast(torch.mm, dtype)(x64, x64).dtype == torch.float64
    assert autocast(torch.softmax, dtype)(x64, -1).dtype == torch.float64
    ints = torch.arange(9).reshape(3, 3)
    assert autocast(torch.mm, dtype)(ints, ints).dtype == torch.int64
    assert autocast(torch.sum, dtype)(ints).dtype == torch.int64


@pytest.mark.parametrize("dtype", LOW)
def test_in_place_out_and_explicit_dtype_are_not_cast(dtype: torch.dtype) -> None:
    a = torch.randn(3, 3)
    out = torch.empty(3, 3)
    assert autocast(lambda: torch.mm(a, a, out=out), dtype)().dtype == torch.float32
    assert autocast(lambda: a.clone().addmm_(a, a), dtype)().dtype == torch.float32
    half = a.to(dtype)
    assert autocast(lambda: torch.softmax(half, -1, dtype=dtype), dtype)().dtype == dtype
    assert autocast(lambda: half.sum(dtype=torch.float64), dtype)().dtype == torch.float64
    # The inputs of an op given a dtype, by keyword or positionally, are not rounded first either.
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 10
    summed = autocast(lambda: torch.sum(x, dtype=torch.float32), dtype, overrides={"sum": dtype})()
    assert torch.equal(summed, torch.sum(x, dtype=torch.float32))
    soft = autocast(lambda: torch.softmax(x, 0, torch.float32), dtype, overrides={"softmax": dtype})()
    assert torch.equal(soft, torch.softmax(x, 0, torch.float32))
    # Low-precision outputs stay low: an unlisted op downstream runs in its inputs' dtype.
    assert autocast(lambda: torch.relu(a @ a) + 1, dtype)().dtype == dtype
    # inplace=True writes into the caller's tensor, even where an override casts the op.
    relu_in_place = autocast(lambda x: F.relu(x, inplace=True), dtype, overrides={"relu": torch.float64})
    written = torch.randn(3, 3)
    assert relu_in_place(written) is written and bool((written >= 0).all())


def test_binary_cross_entropy_float16_raises_helpfully() -> None:
    p, y = torch.rand(4) * 0.8 + 0.1, torch.rand(4)
    with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        autocast(F.binary_cross_entropy, torch.float16)(p, y)
    # bfloat16 has float32's range, so fmp runs it in float32 rather than refusing.
    assert autocast(F.binary_cross_entropy, torch.bfloat16)(p.bfloat16(), y).dtype == torch.float32
    assert autocast(nn.BCELoss(), torch.float16, overrides={"binary_cross_entropy": torch.float32})(p, y).ndim == 0


def test_overrides_and_custom_rule_sets() -> None:
    x = torch.randn(4, 4, dtype=torch.bfloat16)
    assert autocast(torch.softmax, torch.bfloat16, overrides={torch.softmax: None})(x, -1).dtype == torch.bfloat16
    assert autocast(torch.mm, torch.bfloat16, overrides={"mm": torch.float32})(x, x).dtype == torch.float32
    rules = {**CUDA, "softmax": Cast.LOWER}
    assert autocast(torch.softmax, torch.float16, rules=rules)(x.float(), -1).dtype == torch.float16
    with pytest.raises(ValueError, match="unknown autocast rule set 'tpu'"):
        autocast(torch.mm, torch.bfloat16, rules="tpu")
    with pytest.raises(TypeError, match=r"must be torch\.float16 or torch\.bfloat16"):
        autocast(torch.mm, torch.float32)
    with pytest.raises(TypeError, match="rule for 'mm' must be a Cast"):
        resolve_rules("cuda", torch.bfloat16, {"mm": "low"})  # type: ignore[dict-item]
    # The README's example, and ops keyed as aten ops.
    readme = {torch.softmax: torch.float32, "layer_norm": None}
    normed = autocast(lambda x: F.layer_norm(torch.softmax(x, -1), (4,)), torch.bfloat16, rules="cpu", overrides=readme)
    assert normed(x).dtype == torch.float32
    for key in ("aten::mm.default", torch.ops.aten.mm, torch.ops.aten.mm.default):
        assert autocast(torch.mm, torch.bfloat16, overrides={key: torch.float32})(x, x).dtype == torch.float32


BAD_OVERRIDES: dict[str, tuple[Any, type[Exception], str]] = {
    "typo": ({"sofmax": torch.float32}, ValueError, r"^unknown op 'sofmax' in autocast .*did you mean 'softmax'\?$"),
    "near_miss": ({"layernorm": None}, ValueError, "unknown op 'layernorm' .*did you mean 'layer_norm'"),
    "nonsense": ({"qqqqqqq": None}, ValueError, "unknown op 'qqqqqqq' .*no torch function or op has that name"),
    "user_function": ({_dtypes: None}, ValueError, "unknown op '_dtypes'"),
    "class": ({nn.Linear: torch.float32}, TypeError, "key Linear is a class; overrides take ops"),
    "int_dtype": ({torch.softmax: torch.int64}, TypeError, "'softmax' must cast to a floating dtype, got torch.int64"),
    "complex_dtype": ({"mm": torch.complex64}, TypeError, "'mm' must cast to a floating dtype"),
    "pairs": ([("softmax", torch.float32)], TypeError, "overrides must be a mapping of op to rule, got list"),
    "in_place": ({"mul_": Cast.FLOAT32}, ValueError, "for 'mul_': in-place ops are never cast .*out-of-place op"),
    "in_place_method": ({torch.Tensor.addmm_: torch.float32}, ValueError, "for 'addmm_': in-place ops are never"),
    "augmented": ({"__imul__": torch.float32}, ValueError, "for '__imul__': in-place ops are never cast"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_OVERRIDES)
def test_bad_overrides_fail_before_any_compute(case: str) -> None:
    overrides, error, message = BAD_OVERRIDES[case]
    with pytest.raises(error, match=message):
        autocast(torch.softmax, torch.bfloat16, overrides=overrides)


@pytest.mark.parametrize(
    ("key", "function"),
    [
        ("torch.softmax", torch.softmax),
        ("F.softmax", F.softmax),
        ("torch.nn.functional.softmax", F.softmax),
        ("torch.linalg.norm", torch.linalg.norm),
        ("torch.fft.rfft", torch.fft.rfft),
        ("torch.special.log_softmax", torch.special.log_softmax),
    ],
)
def test_a_function_written_out_as_a_string_keys_its_op(key: str, function: Any) -> None:
    # float64 is a dtype no rule set picks: only the override can have cast the input.
    x = torch.randn(4, 4)
    by_string = autocast(function, torch.bfloat16, overrides={key: torch.float64})(x, dim=-1)
    by_function = autocast(function, torch.bfloat16, overrides={function: torch.float64})(x, dim=-1)
    assert by_string.dtype in (torch.float64, torch.complex128) and torch.equal(by_string, by_function)


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("F.lnear", "torch.nn.functional.linear"), ("torch.fft.ftt", "torch.fft.fft"), ("torch.nope", "torch.ne")],
)
def test_a_string_path_to_nothing_in_torch_is_refused_with_the_closest_name(key: str, suggestion: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown op '{key}' in autocast overrides: .*did you mean '{suggestion}'\?"):
        autocast(torch.softmax, torch.bfloat16, overrides={key: None})
    with pytest.raises(ValueError, match=rf"unknown op '{key}' in autocast rules: "):
        autocast(torch.softmax, torch.bfloat16, rules={key: Cast.FLOAT32})


@pytest.mark.parametrize("key", ["torch.fft", "torch.nn.functional"])
def test_a_string_path_to_a_module_or_outside_torch_is_refused(key: str) -> None:
    with pytest.raises(TypeError, match=rf"autocast overrides: key '{key}' names a module; key an op in it"):
        autocast(torch.softmax, torch.bfloat16, overrides={key: None})
    with pytest.raises(
        ValueError, match=r"unknown op 'math\.exp' in autocast rules: a path names a function from torch"
    ):
        autocast(torch.softmax, torch.bfloat16, rules={"math.exp": Cast.FLOAT32})


@pytest.mark.parametrize("key", ["aten.mm", "aten.mm.default", "mm.default", "torch.ops.aten.mm", "aten::mm"])
def test_aten_op_keys_name_the_op(key: str) -> None:
    x = torch.randn(3, 3)
    assert autocast(torch.mm, torch.bfloat16, overrides={key: torch.float32})(x, x).dtype == torch.float32


def test_custom_rule_sets_are_checked_and_keyed_as_overrides() -> None:
    x = torch.randn(3, 3)
    rules = {"__matmul__": Cast.LOWER, torch.softmax: Cast.FLOAT32}
    assert autocast(operator.matmul, torch.bfloat16, rules=rules)(x, x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"unknown op 'sofmax' in autocast rules; did you mean 'softmax'\?"):
        autocast(torch.softmax, torch.bfloat16, rules={**CPU, "sofmax": Cast.FLOAT32})
    with pytest.raises(TypeError, match=r"autocast rule for 'softmax' must cast to a floating dtype, got torch.int8"):
        autocast(torch.softmax, torch.bfloat16, rules={**CPU, "softmax": torch.int8})


def test_a_custom_op_registered_after_the_names_were_read_is_known() -> None:
    autocast(torch.relu, torch.bfloat16, overrides={"relu": None})  # reads torch's op names
    assert "relu" not in CPU and "relu" not in CUDA
    library = torch.library.Library("fmp_test_late", "FRAGMENT")
    library.define("late_scale(Tensor x) -> Tensor")
    library.impl("late_scale", lambda x: x * 2, "CompositeExplicitAutograd")
    x = torch.randn(3)
    for key in ("late_scale", "torch.ops.fmp_test_late.late_scale", "fmp_test_late::late_scale"):
        scaled = autocast(torch.ops.fmp_test_late.late_scale, torch.bfloat16, overrides={key: torch.bfloat16})
        assert scaled(x).dtype == torch.bfloat16


@pytest.mark.parametrize("key", ["__matmul__", "__rmatmul__", "matmul", torch.Tensor.__matmul__, torch.matmul])
def test_matmul_overrides_apply_to_the_operator(key: Any) -> None:
    # `x @ y` reaches the mode as matmul, and `__rmatmul__` (a Python method) is routed to it.
    x = torch.randn(3, 3)
    for call in (operator.matmul, torch.Tensor.__rmatmul__, torch.matmul):
        assert autocast(call, torch.bfloat16)(x, x).dtype == torch.bfloat16
        assert autocast(call, torch.bfloat16, overrides={key: torch.float32})(x, x).dtype == torch.float32


def test_overrides_of_an_inner_op_reach_the_calls_routed_to_it() -> None:
    x, m = torch.randn(4, dtype=torch.float16), torch.randn(3, 3)
    assert autocast(torch.square, torch.float16)(x).dtype == torch.float32  # square is pow
    assert autocast(torch.square, torch.float16, overrides={"pow": None})(x).dtype == torch.float16
    assert autocast(torch.square, torch.float16, overrides={"square": None})(x).dtype == torch.float16
    assert autocast(torch.Tensor.square, torch.float16, overrides={"__pow__": None})(x).dtype == torch.float16
    # `1 / x` is __rtruediv__, which torch names __rdiv__ (a float32 rule): an override by either name reaches it.
    reciprocal = operator.truediv
    assert autocast(lambda x: reciprocal(1, x), torch.float16)(x).dtype == torch.float32
    for key in ("__rtruediv__", "__rdiv__", torch.Tensor.__rtruediv__):
        assert autocast(lambda x: reciprocal(1, x), torch.float16, overrides={key: None})(x).dtype == torch.float16
        assert autocast(lambda x: x / 2, torch.float16, overrides={key: None})(x).dtype == torch.float16  # div: no rule
    contract = functools.partial(torch.einsum, "ij,jk->ik")
    assert autocast(contract, torch.bfloat16, rules="cpu")(m, m).dtype == torch.bfloat16  # reaches bmm
    assert autocast(contract, torch.bfloat16, rules="cpu", overrides={"einsum": None})(m, m).dtype == torch.float32
    assert autocast(contract, torch.bfloat16, rules="cpu", overrides={"bmm": None})(m, m).dtype == torch.float32


def test_cuda_rules_differ_from_torch_cpu_on_softmax_and_layer_norm() -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16
    assert autocast(F.layer_norm, torch.bfloat16)(x, (8,)).dtype == torch.float32
    assert autocast(F.softmax, torch.bfloat16)(x, -1).dtype == torch.float32
    assert autocast(F.softmax, torch.bfloat16, rules="cpu")(x, -1).dtype == torch.bfloat16


def test_no_state_leaks_and_composites_are_cast_inside() -> None:
    def boom(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        autocast(boom, torch.bfloat16)(torch.ones(1))
    a = torch.randn(2, 2)
    assert (a @ a).dtype == torch.float32
    # F.multi_head_attention_forward is a Python composite not in the rules: its linears are cast.
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q = torch.randn(2, 3, 8)
    out = autocast(lambda q: mha(q, q, q, need_weights=False)[0], torch.bfloat16)(q)
    assert out.dtype == torch.bfloat16


_FLOATS = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


@hypothesis.given(a=_FLOATS, b=_FLOATS, c=_FLOATS, dtype=st.sampled_from(LOW))
def test_promote_ops_widen_like_torch_type_promotion(
    a: torch.dtype, b: torch.dtype, c: torch.dtype, dtype: torch.dtype
) -> None:
    x, y, z = (torch.randn(3, dtype=d) for d in (a, b, c))
    widest = torch.float64
    for d in (d for d in (a, b, c) if d != torch.float64):
        widest = d if widest == torch.float64 else torch.promote_types(widest, d)
    out = autocast(torch.addcmul, dtype)(x, y, z)
    # After the cast every eligible input is `widest`; float64 inputs then promote natively.
    assert out.dtype == (torch.float64 if torch.float64 in (a, b, c) else widest)
    # fmp's own mode (a copy of the CPU rules) widens float16 meeting bfloat16 to float32, as type
    # promotion does; torch.autocast("cpu") raises there, among the inputs or as the region's dtype.
    assert autocast(torch.cat, dtype, rules=dict(CPU))([x, y, z]).dtype == torch.promote_types(
        torch.promote_types(x.dtype, y.dtype), z.dtype
    )
    # rules="cpu" on CPU tensors runs on torch.autocast("cpu") itself: the same outcome, errors included.
    index = torch.tensor([0, 2, 1])
    calls: list[Callable[..., torch.Tensor]] = [
        lambda x, y, z: torch.cat([x, y, z]),
        lambda x, y, z: torch.stack([x, y, z]),
        lambda x, y, z: x.index_copy(0, index, y),
    ]
    for call in calls:
        with torch.autocast("cpu", dtype):
            expected = _result(functools.partial(call, x, y, z))
        _assert_same_outcome(_result(functools.partial(autocast(call, dtype, rules="cpu"), x, y, z)), expected)
        if expected is RuntimeError and {torch.float16, torch.bfloat16} <= {a, b, c, dtype}:
            continue
        _assert_same_outcome(_result(functools.partial(autocast(call, dtype, rules=dict(CPU)), x, y, z)), expected)


def _rnn(kind: type[nn.RNNBase], **kwargs: Any) -> Callable[[], Any]:
    return lambda: kind(4, 5, **kwargs)(torch.randn(3, 2, 4))


def _csr_beta(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` run without torch's warning that sparse CSR support is in beta (sparse products go through CSR)."""

    def run() -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
            return fn()

    return run


# Composites torch splits up in C++: torch.autocast casts their inner matmuls, fmp the whole op.
COMPOSITES: dict[str, Callable[[], Any]] = {
    "einsum_mm": lambda: torch.einsum("ij,jk->ik", torch.randn(3, 4), torch.randn(4, 5)),
    "einsum_list_implicit": lambda: torch.einsum("ij,jk", [torch.randn(3, 4), torch.randn(4, 5)]),
    "einsum_dot": lambda: torch.einsum("i,i->", torch.randn(3), torch.randn(3)),
    "einsum_ellipsis": lambda: torch.einsum("...ij,jk,kl->...il", *map(torch.randn, [(2, 3, 3), (3, 3), (3, 2)])),
    "einsum_sum": lambda: torch.einsum("ij->j", torch.randn(3, 3)),  # no bmm: not cast
    "einsum_outer": lambda: torch.einsum("i,j->ij", torch.randn(3), torch.randn(4)),  # no bmm
    "einsum_mul": lambda: torch.einsum("ij,ij->ij", torch.randn(3, 3), torch.randn(3, 3)),  # no bmm
    # bmm for the first pair, then a mul by the float32 third operand: float32 out.
    "einsum_ends_in_mul": lambda: torch.einsum("i,i,j->j", torch.randn(3), torch.randn(3), torch.randn(4)),
    "einsum_size_1": lambda: torch.einsum("bij,bjk->bik", torch.randn(2, 3, 1), torch.randn(2, 1, 4)),  # a mul
    "tensordot": lambda: torch.tensordot(torch.randn(3, 4), torch.randn(4, 5), 1),
    "inner": lambda: torch.inner(torch.randn(3, 4), torch.randn(5, 4)),
    "multi_dot": lambda: torch.linalg.multi_dot([torch.randn(2, 3), torch.randn(3, 4), torch.randn(4, 2)]),
    "lstm": _rnn(nn.LSTM),
    "lstm_packed": lambda: nn.LSTM(4, 5)(pack_padded_sequence(torch.randn(3, 2, 4), [3, 2]))[0].data,  # float32
    "sparse_mm": lambda: torch.sparse.mm(torch.eye(4).to_sparse(), torch.randn(4, 3)),
    "sparse_mm_sparse": _csr_beta(lambda: torch.sparse.mm(torch.eye(4).to_sparse(), torch.eye(4).to_sparse())),
    "sparse_mm_reduce": _csr_beta(lambda: torch.sparse.mm(torch.eye(4).to_sparse_csr(), torch.randn(4, 3), "sum")),
    "sparse_mm_dense_keyword": lambda: torch.sparse.mm(torch.eye(4).to_sparse(), dense=torch.randn(4, 3)),
    "sparse_addmm": lambda: torch.sparse.addmm(torch.randn(4, 3), torch.eye(4).to_sparse(), torch.randn(4, 3)),
    "rnn_tanh": _rnn(nn.RNN),
    "rnn_relu": _rnn(nn.RNN, nonlinearity="relu"),
    "gru": _rnn(nn.GRU),  # stays float32 on CPU
    "rnn_cell": lambda: nn.RNNCell(4, 5)(torch.randn(2, 4)),
    "lstm_cell": lambda: nn.LSTMCell(4, 5)(torch.randn(2, 4)),  # stays float32 on CPU
}  # fmt: skip


@pytest.mark.parametrize("name", COMPOSITES)
def test_cpu_rules_match_torch_autocast_cpu_on_composites(name: str) -> None:
    torch.manual_seed(0)
    try:
        with torch.autocast("cpu", torch.bfloat16):
            expected = _dtypes(COMPOSITES[name]())
    except RuntimeError as error:
        # oneDNN has no bfloat16 LSTM primitive on some CPUs (seen on an AMD EPYC without AVX-512).
        if "could not create a primitive descriptor" not in str(error):
            raise
        pytest.skip(f"torch.autocast('cpu') cannot run the reference {name} on this CPU: {error}")
    torch.manual_seed(0)
    assert _dtypes(autocast(COMPOSITES[name], torch.bfloat16, rules="cpu")()) == expected


def test_cuda_rules_cast_einsum_and_keep_tensordot_a_promote_op() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    # torch registers einsum for AutocastCUDA: every einsum is cast there, on CPU only those reaching bmm.
    assert autocast(torch.einsum, torch.float16)("ij,jk->ik", a, b).dtype == torch.float16
    assert autocast(torch.einsum, torch.float16)("ij,ij->ij", a, a).dtype == torch.float16
    assert autocast(torch.einsum, torch.float16, rules="cpu")("ij,ij->ij", a, a).dtype == torch.float32
    # On CUDA tensordot's promote wrapper turns autocast off for its inner mm: it stays float32.
    assert autocast(torch.tensordot, torch.float16)(a, b, 1).dtype == torch.float32


@pytest.mark.compiled
def test_compiled_casts_inside_python_composites_like_eager() -> None:
    # F.multi_head_attention_forward is a Python composite: compiled, its linears are cast too.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    params = {k: v.detach() for k, v in mha.named_parameters()}

    def loss(params: dict[str, torch.Tensor], q: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(mha, params, (q, q, q), {"need_weights": False})[0]
        return out.float().pow(2).mean()

    backend = CompileCounterWithBackend("aot_eager")
    eager = torch.func.grad_and_value(autocast(loss, torch.bfloat16))
    step = torch.compile(eager, fullgraph=True, backend=backend)
    for seed in range(2):
        q = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(seed))
        pytree.tree_map(torch.testing.assert_close, step(params, q), eager(params, q))
    assert backend.frame_count == 1


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("i,i,j->j", [(3,), (3,), (4,)]),
        ("bij,bjk->bik", [(2, 3, 1), (2, 1, 4)]),
        ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 2)]),
    ],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cpu_rules_run_einsum_bit_for_bit_as_torch_autocast_cpu(
    equation: str, shapes: list[tuple[int, ...]], compiled: bool
) -> None:
    # torch casts the inputs of each bmm its einsum reaches, and not those of a mul it ends with.
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn(shape, generator=gen) for shape in shapes]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.einsum(equation, *operands)
    ours = autocast(functools.partial(torch.einsum, equation), torch.bfloat16, rules="cpu")
    if compiled:
        ours = torch.compile(ours, fullgraph=True, backend="aot_eager")
    out = ours(*operands)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_inside_an_enabled_torch_autocast_einsum_follows_the_outer_casts_as_matmul_does() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    ops = autocast(lambda a, b: (a @ b, torch.einsum("ij,jk->ik", a, b)), torch.bfloat16, rules=dict(CPU))
    with torch.autocast("cpu", dtype=torch.float16):
        matmul, einsum = ops(a, b)
    assert einsum.dtype == matmul.dtype == torch.float16
    # A native region (the CPU rules on CPU tensors) is a torch.autocast region: the innermost wins.
    native = autocast(lambda a, b: (a @ b, torch.einsum("ij,jk->ik", a, b)), torch.bfloat16, rules="cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        matmul, einsum = native(a, b)
    assert einsum.dtype == matmul.dtype == torch.bfloat16


def test_inside_a_torch_autocast_of_the_same_dtype_einsum_is_torch_autocasts_bit_for_bit() -> None:
    # The outer region casts einsum's bmms, and only those: fmp adds nothing.
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn(shape, generator=gen) for shape in ((2, 3, 4), (2, 4, 5), (2, 3, 6))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.einsum("bij,bjk,bil->bikl", *operands)
        ours = autocast(functools.partial(torch.einsum, "bij,bjk,bil->bikl"), torch.bfloat16, rules="cpu")(*operands)
    assert ours.dtype == expected.dtype and torch.equal(ours, expected)
