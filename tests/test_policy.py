from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fmp

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FLOAT_DTYPES = [F32, F16, BF16, F64]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("p=f32,c=f16", (F32, F16, F16)),
        ("c=fp16", (F32, F16, F16)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("o=f64", (F32, F32, F64)),
        ("bf16", (BF16, BF16, BF16)),
        ("full", (F32, F32, F32)),
        ("  Params = Float32 , COMPUTE=BFloat16 ,output = fp32 ", (F32, BF16, F32)),
        ("compute=half", (F32, BF16, BF16)),  # CPU-only machine: the platform half is bfloat16
        ("p=float64,c=double", (F64, F64, F64)),
        ("p=f32,c=bf16,r=bf16", (F32, BF16, BF16)),
    ],
)
def test_get_policy_parses_jmp_and_torch_spellings(spec: str, expected: tuple[torch.dtype, ...]) -> None:
    policy = fmp.get_policy(spec, device_type="cpu")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_half_follows_the_device_type() -> None:
    assert fmp.get_policy("c=half", device_type="cuda").compute_dtype == F16
    assert fmp.get_policy("c=half", device_type="cpu").compute_dtype == BF16
    assert fmp.half_dtype("cuda") == F16 and fmp.half_dtype("cpu") == BF16


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "xpu", "mps", "hpu", "xla", "maia", "mtia", "ipu"])
def test_half_is_torch_autocasts_default_dtype(device_type: str) -> None:
    assert fmp.half_dtype(device_type) == torch.get_autocast_dtype(device_type)
    with torch.autocast("cpu", dtype=torch.float16):  # a region's dtype is not the default
        assert fmp.half_dtype("cpu") == BF16


@pytest.mark.parametrize(
    ("device", "expected"),
    [(torch.device("cpu"), BF16), ("cpu:0", BF16), (torch.device("cuda", 1), F16), ("cuda:1", F16), ("xpu:0", F16)],
    ids=str,
)
def test_half_takes_devices_as_well_as_types(device: str | torch.device, expected: torch.dtype) -> None:
    assert fmp.half_dtype(device) == expected
    assert fmp.get_policy("c=half", device_type=device).compute_dtype == expected


@pytest.mark.parametrize(("device", "error"), [("CPU", ValueError), ("tpu", ValueError), (0, TypeError)], ids=str)
def test_an_unknown_device_for_half_is_named(device: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="device_type"):
        fmp.half_dtype(device)  # type: ignore[arg-type]


@given(
    st.sampled_from(FLOAT_DTYPES),
    st.sampled_from(FLOAT_DTYPES),
    st.sampled_from(FLOAT_DTYPES),
    st.sampled_from([None, *FLOAT_DTYPES]),
    st.sampled_from(["cuda", "cpu", None]),
)
def test_str_round_trips(
    param: torch.dtype, compute: torch.dtype, output: torch.dtype, reduce: torch.dtype | None, rules: str | None
) -> None:
    policy = fmp.Policy(param, compute, output, reduce, rules)
    assert fmp.get_policy(str(policy)) == policy
    assert hash(fmp.get_policy(str(policy))) == hash(policy)
    assert ("reduce=" in str(policy)) == (reduce is not None)
    assert ("rules=" in str(policy)) == (rules != "cuda")
    assert policy.casts_by_op == (rules is not None and compute in (torch.float16, torch.bfloat16))


OVERRIDES = st.dictionaries(
    st.sampled_from(["softmax", "layer_norm", "scaled_dot_product_attention", "addcmul", "torch.fft.rfft", "aten::mm"]),
    st.sampled_from([None, *fmp.autocast.Cast]),
    max_size=3,
)


@given(OVERRIDES, st.sampled_from(["cuda", "cpu"]))
def test_overrides_round_trip_through_str_and_hash_as_a_sorted_tuple(
    overrides: dict[str, fmp.autocast.Cast | None], rules: str
) -> None:
    policy = fmp.get_policy(f"c=bf16,rules={rules}").with_overrides(overrides)
    names = {"torch.fft.rfft": "fft_rfft", "aten::mm": "mm"}
    assert policy.overrides == tuple(sorted((names.get(op, op), rule) for op, rule in overrides.items()))
    assert fmp.get_policy(str(policy)) == policy and hash(fmp.get_policy(str(policy))) == hash(policy)
    assert ("overrides=" in str(policy)) == bool(overrides)
    assert policy.with_overrides({}) == fmp.get_policy(f"c=bf16,rules={rules}")


def test_overrides_take_ops_as_autocast_does_and_name_what_is_wrong() -> None:
    policy = fmp.get_policy("c=bf16,rules=cpu")
    spelled = policy.with_overrides({torch.softmax: None, "scaled_dot_product_attention": torch.float32})
    assert spelled.overrides == (("scaled_dot_product_attention", fmp.autocast.Cast.FLOAT32), ("softmax", None))
    parsed = fmp.get_policy("c=bf16, rules=cpu, Overrides = softmax:NONE + scaled_dot_product_attention:float32")
    assert parsed == spelled
    with pytest.raises(ValueError, match=r"unknown op 'sofmax'.*softmax"):
        policy.with_overrides({"sofmax": None})
    with pytest.raises(TypeError, match=r"Cast, torch\.float32 or None, got torch\.bfloat16"):
        policy.with_overrides({"softmax": torch.bfloat16})
    with pytest.raises(TypeError, match="takes a mapping"):
        policy.with_overrides([("softmax", None)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rules=None casts whole"):
        policy.with_rules(None).with_overrides({"softmax": None})
    with pytest.raises(ValueError, match="twice"):
        policy.with_overrides({"softmax": None, torch.softmax: None})
    with pytest.raises(ValueError, match="as with_overrides makes them: sorted"):
        fmp.Policy(rules="cpu", overrides=(("softmax", None), ("layer_norm", None)))
    with pytest.raises(ValueError, match="tuple of"):
        fmp.Policy(overrides={"softmax": None})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="malformed policy override 'softmax:bf16'"):
        fmp.get_policy("c=bf16,overrides=softmax:bf16")
    with pytest.raises(ValueError, match="twice"):
        fmp.get_policy("c=bf16,overrides=softmax:none+softmax:lower")
    assert fmp.get_policy("c=bf16,overrides=aten::mm:none").overrides == (("mm", None),)
    with pytest.raises(ValueError, match="Cast or None values"):
        fmp.Policy(overrides=(("softmax", torch.float32),))  # type: ignore[arg-type]


def test_rules_parse_and_are_checked() -> None:
    assert fmp.get_policy("c=f16").rules == "cuda" and fmp.Policy().rules == "cuda"
    assert fmp.get_policy("c=f16, Rules = CPU").rules == "cpu"
    assert fmp.get_policy("c=f16,rules=none").with_rules("cuda") == fmp.get_policy("c=f16")
    with pytest.raises(ValueError, match="unknown autocast rules 'xla'; accepted: cuda, cpu, none"):
        fmp.get_policy("c=f16,rules=xla")
    with pytest.raises(ValueError, match=r"Policy\.rules must be one of"):
        fmp.Policy(rules="CUDA")
    with pytest.raises(ValueError, match="given twice"):
        fmp.get_policy("rules=cpu,rules=none")


@pytest.mark.parametrize(
    ("spec", "reduce", "effective"),
    [
        ("p=f32,c=bf16", None, F32),
        ("bf16", None, BF16),
        ("p=f32,c=bf16,r=bf16", BF16, BF16),
        ("params=float32,compute=float16,output=float32,reduce=float16", F16, F16),
        ("p=f64, Reduce = fp32", F32, F32),
        ("p=bf16,r=None", None, BF16),
    ],
)
def test_reduce_dtype_defaults_to_param_dtype(spec: str, reduce: torch.dtype | None, effective: torch.dtype) -> None:
    policy = fmp.get_policy(spec)
    assert policy.reduce_dtype == reduce
    assert policy.effective_reduce_dtype == effective


def test_reduce_dtype_follows_params_until_set() -> None:
    policy = fmp.get_policy("c=bf16")
    assert policy.with_param_dtype(F64).effective_reduce_dtype == F64
    pinned = policy.with_reduce_dtype(BF16)
    assert pinned.with_param_dtype(F64).effective_reduce_dtype == BF16
    assert pinned.with_reduce_dtype(None) == policy
    assert str(policy) == "params=float32,compute=bfloat16,output=bfloat16"
    assert str(pinned) == "params=float32,compute=bfloat16,output=bfloat16,reduce=bfloat16"
    # A pinned reduce dtype differs from one that follows params, even where they resolve alike.
    assert policy.with_reduce_dtype(F32) != policy
    with pytest.raises(TypeError, match="reduce_dtype must be one of"):
        fmp.Policy(F32, F32, F32, torch.int32)
    with pytest.raises(ValueError, match="given twice"):
        fmp.get_policy("r=f32,reduce=bf16")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty policy"),
        ("p=f32,q=f16", "unknown policy key 'q'"),
        ("p=f32,c=int8", "unknown dtype 'int8'"),
        ("float8", "unknown dtype 'float8'"),
        ("p=f32,p=f16", "given twice"),
        ("p=f32,,c=f16", "malformed policy fragment"),
        ("p=,c=f16", "malformed policy fragment"),
        ("=f16", "malformed policy fragment"),
    ],
)
def test_bad_policy_strings_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as excinfo:
        fmp.get_policy(spec)
    if "unknown" in message:
        assert "accepted:" in str(excinfo.value)


def test_policy_rejects_non_floating_dtypes() -> None:
    with pytest.raises(TypeError, match="compute_dtype must be one of"):
        fmp.Policy(F32, torch.int8, F32)
    with pytest.raises(TypeError, match="param_dtype must be one of"):
        fmp.Policy(torch.float8_e4m3fn, F32, F32)
    with pytest.raises(TypeError, match=r"param_dtype must be one of .*, got \[torch.float32\]"):
        fmp.Policy([F32])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="get_policy takes a string"):
        fmp.get_policy(F32)  # type: ignore[arg-type]


def test_policy_is_configuration_not_a_pytree() -> None:
    policy = fmp.get_policy("c=bf16")
    assert torch.utils._pytree.tree_leaves(policy) == [policy]
    assert {policy: 1}[fmp.Policy(F32, BF16, BF16)] == 1
    with pytest.raises(AttributeError):
        policy.compute_dtype = F16  # type: ignore[misc]


def test_with_methods_replace_one_dtype() -> None:
    policy = fmp.Policy()
    assert policy.with_param_dtype(BF16) == fmp.Policy(BF16, F32, F32)
    assert policy.with_compute_dtype(F16) == fmp.Policy(F32, F16, F32)
    assert policy.with_output_dtype(F64) == fmp.Policy(F32, F32, F64)
    assert policy.with_reduce_dtype(BF16) == fmp.Policy(F32, F32, F32, BF16)


leaves = st.one_of(
    st.sampled_from(FLOAT_DTYPES).map(lambda d: torch.randn(3).to(d)),
    st.sampled_from([torch.complex64, torch.complex128]).map(lambda d: torch.randn(2, dtype=d)),
    st.sampled_from([torch.int32, torch.int64, torch.bool, torch.uint8]).map(lambda d: torch.ones(2, dtype=d)),
    st.sampled_from([None, 3, 2.5, "name"]),
)
trees = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids))


@given(trees, st.lists(st.sampled_from(FLOAT_DTYPES), min_size=3, max_size=3), st.sampled_from([0, 1, 2]))
def test_casts_touch_floating_tensors_only(tree: object, dtypes: list[torch.dtype], which: int) -> None:
    # Three dtypes drawn apart, so each cast must take its own field; complex leaves pass uncast.
    policy, dtype = fmp.Policy(*dtypes), dtypes[which]
    cast = (policy.cast_to_param, policy.cast_to_compute, policy.cast_to_output)[which](tree)
    in_leaves, in_spec = torch.utils._pytree.tree_flatten(tree)
    out_leaves, out_spec = torch.utils._pytree.tree_flatten(cast)
    assert in_spec == out_spec
    for before, after in zip(in_leaves, out_leaves, strict=True):
        if isinstance(before, torch.Tensor) and before.is_floating_point():
            assert after.dtype == dtype
            if before.dtype == dtype:
                assert after is before  # no copy when already in the target dtype
            else:
                torch.testing.assert_close(after, before.to(dtype))
        else:
            assert after is before


@given(
    st.fixed_dictionaries(
        {},
        optional={
            key: st.sampled_from(["float32", "bfloat16", "float16", "float64"])
            for key in ("params", "compute", "output", "reduce")
        },
    )
)
def test_missing_keys_follow_jmp_for_any_subset(given_keys: dict[str, str]) -> None:
    # params default to float32, compute follows params, output follows compute, reduce is None
    # (the gradients' own dtype) unless given.
    spec = ",".join(f"{key}={name}" for key, name in given_keys.items()) or "full"
    policy = fmp.get_policy(spec)
    dtype_of = {key: getattr(torch, name) for key, name in given_keys.items()}
    params = dtype_of.get("params", F32)
    compute = dtype_of.get("compute", params)
    assert (policy.param_dtype, policy.compute_dtype) == (params, compute)
    assert policy.output_dtype == dtype_of.get("output", compute)
    assert policy.reduce_dtype == dtype_of.get("reduce")
    assert fmp.get_policy(str(policy)) == policy
