from __future__ import annotations

import dataclasses
import math

import optree
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import bits
from conftest import grad_scaler_step
from conftest import torch_grad_scaler
from hypothesis import assume
from hypothesis import given
from hypothesis import strategies as st

import fmp
from fmp import DynamicLossScale
from fmp._scale_values import float32_inward
from fmp._struct import pytree_dataclass
from fmp._struct import replace

TINY = torch.finfo(torch.float32).tiny
INF = float("inf")

init_scales = st.one_of(
    st.integers(-30, 60).map(lambda k: 2.0**k),
    st.floats(1e-6, 1e12).map(lambda v: float(torch.tensor(v, dtype=torch.float32))),
)
finite_sequences = st.lists(st.booleans(), max_size=80)


def dynamic_scales(**fixed: object) -> st.SearchStrategy[fmp.DynamicLossScale]:
    args = {
        "init_scale": init_scales,
        "growth_factor": st.one_of(st.just(2.0), st.floats(1.0001, 8.0)),
        "backoff_factor": st.one_of(st.just(0.5), st.floats(0.01, 0.99)),
        "growth_interval": st.integers(1, 6),
    } | {k: st.just(v) for k, v in fixed.items()}
    return st.builds(fmp.DynamicLossScale.create, **args)


@given(dynamic_scales(), finite_sequences)
def test_adjust_reproduces_grad_scaler_exactly(state: fmp.DynamicLossScale, steps: list[bool]) -> None:
    reference, optimizer = torch_grad_scaler(state)
    for finite in steps:
        grad_scaler_step(reference, optimizer, finite)
        state = state.adjust(torch.tensor(finite))
        expected = reference.state_dict()
        if expected["scale"] < TINY:
            break  # torch's scale went subnormal: fmp's min_scale floor binds from here on, by design
        assert float(state.loss_scale) == expected["scale"]  # float32 -> float64 is exact: bitwise equal
        assert int(state.growth_tracker) == expected["_growth_tracker"]


def test_min_scale_floor_where_grad_scaler_decays_to_zero() -> None:
    reference, optimizer = torch_grad_scaler(fmp.DynamicLossScale.create())
    state = fmp.DynamicLossScale.create()
    for _ in range(200):
        grad_scaler_step(reference, optimizer, finite=False)
        state = state.adjust(torch.tensor(False))
    assert reference.state_dict()["scale"] == 0.0  # torch's scale is gone: every later loss * 0
    assert float(state.loss_scale) == TINY


@given(
    dynamic_scales(),
    st.one_of(st.sampled_from([1.0, 2.0**-8, TINY]), st.floats(TINY, 1e3)),
    st.one_of(st.sampled_from([2.0**24, 2.0**64, torch.finfo(torch.float32).max]), st.floats(1e-3, 1e30)),
    st.integers(1, 4),
    finite_sequences,
)
def test_scale_invariants(
    base: fmp.DynamicLossScale, min_scale: float, max_scale: float, hysteresis: int, steps: list[bool]
) -> None:
    assume(min_scale <= float(base.loss_scale) <= max_scale)
    state = fmp.DynamicLossScale.create(
        base.loss_scale,
        base.growth_factor,
        base.backoff_factor,
        base.growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )
    finite_run = overflow_run = 0
    for finite in steps:
        old = float(state.loss_scale)
        state = state.adjust(torch.tensor(finite))
        new = float(state.loss_scale)
        finite_run, overflow_run = (finite_run + 1, 0) if finite else (0, overflow_run + 1)
        assert 0 < min_scale <= new <= max_scale
        assert int(state.overflow_streak) == overflow_run
        if finite:
            assert new >= old  # a finite step never backs off
            if new > old:  # growth only after growth_interval consecutive finite steps
                assert finite_run == state.growth_interval
            if finite_run == state.growth_interval:
                finite_run = 0
            assert int(state.growth_tracker) == finite_run
        else:
            assert new <= old and int(state.growth_tracker) == 0
            if new < old:  # back off only from the hysteresis-th consecutive overflow on
                assert overflow_run >= hysteresis
            if overflow_run >= hysteresis and old * state.backoff_factor >= min_scale:
                assert new < old


def test_hysteresis_delays_backoff_until_consecutive_overflows() -> None:
    state = fmp.DynamicLossScale.create(init_scale=1024.0, hysteresis=3)
    trajectory = []
    for finite in [False, False, True, False, False, False, False]:
        state = state.adjust(torch.tensor(finite))
        trajectory.append(float(state.loss_scale))
    assert trajectory == [1024, 1024, 1024, 1024, 1024, 512, 256]


def test_max_scale_caps_growth() -> None:
    state = fmp.DynamicLossScale.create(init_scale=4.0, growth_interval=1, max_scale=10.0)
    for _ in range(3):
        state = state.adjust(torch.tensor(True))
    assert float(state.loss_scale) == 10.0


def test_bounds_hold_exactly_when_they_are_not_float32_numbers() -> None:
    state = fmp.DynamicLossScale.create(init_scale=0.25, growth_interval=1, min_scale=0.1, max_scale=0.3)
    assert state.max_scale <= 0.3 and state.min_scale >= 0.1  # rounded inward to float32 numbers
    for finite in [True] * 3 + [False] * 6:
        state = state.adjust(torch.tensor(finite))
        assert 0.1 <= float(state.loss_scale) <= 0.3
    at_the_cap = fmp.DynamicLossScale.create(init_scale=0.3, max_scale=0.3)  # float32(0.3) > 0.3: clamped in
    assert float(at_the_cap.loss_scale) == at_the_cap.max_scale <= 0.3
    with pytest.raises(ValueError, match="no float32 scale lies in"):
        fmp.DynamicLossScale.create(init_scale=0.3, min_scale=0.3, max_scale=0.3)


def test_overflow_streak_saturates_instead_of_wrapping() -> None:
    int32_max = torch.iinfo(torch.int32).max
    state = dataclasses.replace(
        fmp.DynamicLossScale.create(hysteresis=3), overflow_streak=torch.tensor(int32_max, dtype=torch.int32)
    )
    state = state.adjust(torch.tensor(False))
    assert int(state.overflow_streak) == int32_max and float(state.loss_scale) == 2.0**15


def test_scale_needs_a_tensor() -> None:
    with pytest.raises(TypeError, match="scale\\(\\) found no floating-point tensor to scale in a float"):
        fmp.DynamicLossScale.create().scale(3.0)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="found no floating-point tensor"):
        fmp.StaticLossScale.create(2.0).scale({"n": torch.arange(3)})


def test_growth_never_overflows_to_inf() -> None:
    state = fmp.DynamicLossScale.create(init_scale=2.0**127, growth_interval=1)
    state = state.adjust(torch.tensor(True))
    assert float(state.loss_scale) == 2.0**127


@given(
    st.sampled_from(
        [(torch.float32, 60, 40), (torch.float64, 60, 40), (torch.bfloat16, 60, 40), (torch.float16, 4, 8)]
    ).flatmap(
        lambda spec: st.tuples(
            st.just(spec[0]),
            st.lists(st.integers(-spec[1], spec[1]), min_size=1, max_size=8),
            st.lists(st.floats(1.0, 2.0, exclude_max=True), min_size=8, max_size=8),
            st.integers(-spec[2], spec[2]),
        )
    ),
    st.sampled_from(["static", "dynamic"]),
)
def test_unscale_inverts_scale_exactly_for_powers_of_two(
    case: tuple[torch.dtype, list[int], list[float], int], kind: str
) -> None:
    # Values and scales are kept where x * 2**k stays a normal number of the dtype (per-dtype table above).
    dtype, exponents, mantissas, k = case
    x = torch.tensor([m * 2.0**e for m, e in zip(mantissas, exponents, strict=False)]).to(dtype)
    x = x * torch.where(torch.arange(len(x)) % 2 == 0, 1.0, -1.0).to(dtype)
    state: fmp.LossScale
    if kind == "static":
        state = fmp.StaticLossScale.create(2.0**k)
    else:
        state = fmp.DynamicLossScale.create(init_scale=2.0**k)
    tree = {"x": x, "n": torch.arange(3), "s": None}
    restored = state.unscale(state.scale(tree))
    assert restored["x"].dtype == dtype and torch.equal(bits(restored["x"]), bits(x))
    assert restored["n"] is tree["n"] and restored["s"] is None


def test_scale_promotes_a_half_loss_like_grad_scaler() -> None:
    state = fmp.DynamicLossScale.create()
    loss = torch.tensor(3.0, dtype=torch.float16)
    reference = torch.amp.GradScaler("cpu")
    assert state.scale(loss).dtype == reference.scale(loss).dtype == torch.float32
    grads = torch.ones(4, dtype=torch.float16) * 2.0**16 * 0.5
    assert state.unscale(grads).dtype == torch.float16


@given(dynamic_scales(), st.floats(TINY, 1.0), st.integers(1, 5))
def test_pytree_round_trips_keep_every_field(base: fmp.DynamicLossScale, min_scale: float, hysteresis: int) -> None:
    state = dataclasses.replace(base, min_scale=min_scale, hysteresis=hysteresis)
    leaves, spec = pytree.tree_flatten(state)
    assert len(leaves) == 3 and all(isinstance(x, torch.Tensor) for x in leaves)
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec
    opt_leaves, opt_spec = optree.tree_flatten(state, namespace=fmp.OPTREE_NAMESPACE)
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(state)[0]]
    assert paths == [".loss_scale", ".growth_tracker", ".overflow_streak"]
    round_trips = [
        pytree.tree_unflatten(leaves, spec),
        optree.tree_unflatten(opt_spec, opt_leaves),
        pytree.tree_map(lambda x: x.clone(), state),
        optree.tree_map(lambda x: x.clone(), state, namespace=fmp.OPTREE_NAMESPACE),
    ]
    for copy in round_trips:
        assert type(copy) is DynamicLossScale
        for field in dataclasses.fields(state):
            ours, theirs = getattr(copy, field.name), getattr(state, field.name)
            if isinstance(theirs, torch.Tensor):
                assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype
            else:
                assert ours == theirs and type(ours) is type(theirs)


def test_replace_copies_the_other_fields_and_names_unknown_ones() -> None:
    state = fmp.DynamicLossScale.create(hysteresis=2)
    scale = torch.tensor(4.0)
    ours, theirs = replace(state, loss_scale=scale), dataclasses.replace(state, loss_scale=scale)
    assert type(ours) is DynamicLossScale
    assert all(getattr(ours, f.name) is getattr(theirs, f.name) for f in dataclasses.fields(state))
    with pytest.raises(TypeError, match=r"DynamicLossScale has no fields \['scale'\]"):
        replace(state, scale=scale)


def test_replace_refuses_what_is_not_a_pytree_dataclass() -> None:
    @dataclasses.dataclass(frozen=True)
    class Extended(fmp.StaticLossScale):  # a subclass that pytree_dataclass did not register
        note: str = "kept by dataclasses.replace"

    extended = Extended(torch.tensor(2.0), note="mine")
    for obj in (extended, (torch.tensor(1.0),)):
        with pytest.raises(TypeError, match="replace\\(\\) takes an instance of a pytree_dataclass"):
            replace(obj, loss_scale=torch.tensor(1.0))


def test_pytree_dataclass_refuses_fields_left_out_of_init() -> None:
    with pytest.raises(TypeError, match=r"fields \['count'\] must not be init=False"):

        @pytree_dataclass
        class Counter:
            count: torch.Tensor = dataclasses.field(init=False)


@pytest.mark.compiled
def test_compiled_adjust_does_not_guard_on_dataclass_internals() -> None:
    # Dynamo evaluates every guard on every call of a compiled step; dataclasses.replace would add
    # one for each entry of __dataclass_fields__ it reads.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # private: import only here

    def adjust(scaler: fmp.DynamicLossScale, grads_finite: torch.Tensor) -> fmp.DynamicLossScale:
        return scaler.adjust(grads_finite)

    torch.compile(adjust, backend="eager", fullgraph=True)(fmp.DynamicLossScale.create(), torch.tensor(True))
    (entry,) = _debug_get_cache_entry_list(adjust.__code__)
    guards = str(entry.guard_manager)
    assert "loss_scale" in guards and "__dataclass_fields__" not in guards


def test_static_and_noop_states() -> None:
    static = fmp.StaticLossScale.create(128.0)
    assert pytree.tree_unflatten(*pytree.tree_flatten(static)).loss_scale is static.loss_scale
    adjusted = static.adjust(torch.tensor(False))  # a scale in range stays, bit for bit
    assert type(adjusted) is fmp.StaticLossScale and torch.equal(bits(adjusted.loss_scale), bits(static.loss_scale))
    noop = fmp.NoOpLossScale.create()  # as the other states are made; NoOpLossScale() is the same
    assert type(noop) is fmp.NoOpLossScale and pytree.tree_leaves(noop) == []
    assert optree.tree_leaves(noop, namespace=fmp.OPTREE_NAMESPACE) == []
    tree = {"a": torch.ones(2)}
    assert noop.scale(tree) is tree and noop.unscale(tree) is tree
    assert noop.adjust(torch.tensor(True)) is noop and float(noop.loss_scale) == 1.0


normal_float32s = (
    st.floats(TINY, torch.finfo(torch.float32).max)
    .map(lambda v: float(torch.tensor(v, dtype=torch.float32)))
    .filter(lambda v: TINY <= v < INF)
)


@given(
    normal_float32s,
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.integers(-40, 40),
    st.booleans(),
)
def test_property_unscale_is_grad_scalers_kernel_bit_for_bit(
    scale: float, dtype: torch.dtype, exponent: int, in_place: bool
) -> None:
    # Against torch._amp_foreach_non_finite_check_and_unscale_, given 1/scale as GradScaler.unscale_
    # forms it (in double, rounded once to float32); overflows to inf and underflows alike.
    grads = (torch.randn(33, generator=torch.Generator().manual_seed(exponent)) * 2.0**exponent).to(dtype)
    expected = grads.clone()
    inverse = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_([expected], torch.zeros(1), inverse)
    scaler = fmp.StaticLossScale.create(scale)
    ours = fmp.unscale_and_adjust(scaler, [grads.clone()], donate=True)[0][0] if in_place else scaler.unscale(grads)
    assert ours.dtype == dtype and torch.equal(bits(ours), bits(expected))


@given(st.floats(1e-300, 1e300), st.booleans())
def test_property_float32_inward_is_the_nearest_float32_on_the_inner_side(bound: float, up: bool) -> None:
    rounded = float32_inward(bound, up=up)
    assert rounded == float(torch.tensor(rounded, dtype=torch.float32))  # a float32
    assert rounded >= bound if up else rounded <= bound
    # The next float32 towards the bound lies beyond it: none is closer on the inner side.
    toward = torch.nextafter(torch.tensor(rounded, dtype=torch.float32), torch.tensor(-INF if up else INF))
    assert float(toward) < bound if up else float(toward) > bound


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**200), 2**200)))
def test_property_a_scale_is_accepted_exactly_when_its_float32_is_normal(value: float) -> None:
    try:
        as_float32 = float(torch.tensor(float(value), dtype=torch.float32))
    except OverflowError:  # an int beyond every float
        as_float32 = INF
    if TINY <= as_float32 <= torch.finfo(torch.float32).max:
        assert float(fmp.StaticLossScale.create(value).loss_scale) == as_float32
    else:
        with pytest.raises(ValueError, match="must be a positive, normal float32"):
            fmp.StaticLossScale.create(value)


@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]), st.integers(0, 2), init_scales)
def test_property_scale_promotes_as_grad_scaler_scale(dtype: torch.dtype, ndim: int, scale: float) -> None:
    loss = torch.full((2,) * ndim, 3.0, dtype=dtype)
    reference = torch.amp.GradScaler("cpu", init_scale=scale)
    expected = reference.scale(loss)
    ours = fmp.DynamicLossScale.create(init_scale=scale).scale(loss)
    assert ours.dtype == expected.dtype and torch.equal(bits(ours), bits(expected))


def test_unscale_rounds_like_grad_scaler_for_any_scale() -> None:
    # 1/scale is formed in double and rounded once to float32, as GradScaler's unscale_ does.
    for scale in (3.0, 1000.3, 2.0**20 * 1.7, 0.37):
        reference, optimizer = torch_grad_scaler(fmp.DynamicLossScale.create(init_scale=scale))
        (param,) = optimizer.param_groups[0]["params"]
        grads = torch.randn(3, generator=torch.Generator().manual_seed(0)) * 1e4
        reference.scale(torch.ones(()))
        param.grad = grads.clone()
        reference.unscale_(optimizer)
        ours = fmp.StaticLossScale.create(scale).unscale(grads)
        assert torch.equal(bits(ours), bits(param.grad))


def test_states_compare_by_identity_without_reading_tensors() -> None:
    state = fmp.DynamicLossScale.create()
    same_values = fmp.DynamicLossScale.create()
    assert state == state and state != same_values  # no tensor is read on the host
    assert len({state, same_values}) == 2
    stacked = pytree.tree_map(lambda *xs: torch.stack(xs), state, same_values)
    assert stacked == stacked


def test_states_are_immutable() -> None:
    state = fmp.DynamicLossScale.create()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.loss_scale = torch.tensor(1.0)  # type: ignore[misc]
    before = state.loss_scale.clone()
    state.adjust(torch.tensor(False))
    assert torch.equal(state.loss_scale, before)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"init_scale": 0.0}, ValueError, "init_scale must be a positive, normal float32"),
        ({"init_scale": -1.0}, ValueError, "init_scale must be a positive, normal float32"),
        ({"init_scale": math.inf}, ValueError, "init_scale must be a positive, normal float32"),
        ({"init_scale": math.nan}, ValueError, "init_scale must be a positive, normal float32"),
        ({"init_scale": 1e39}, ValueError, "init_scale must be a positive, normal float32"),  # inf in float32
        ({"init_scale": 1e-40}, ValueError, "init_scale must be a positive, normal float32"),  # subnormal
        ({"init_scale": 1e-50}, ValueError, "init_scale must be a positive, normal float32"),  # 0 in float32
        ({"init_scale": 2**2000}, ValueError, "init_scale must be a positive, normal float32"),
        ({"init_scale": "big"}, TypeError, "init_scale must be a real number"),
        ({"init_scale": torch.ones(2)}, ValueError, "init_scale must be a 0-dim floating tensor"),
        ({"growth_factor": 1.0}, ValueError, r"growth_factor must be in \(1.0, inf\)"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"backoff_factor": 1.0}, ValueError, r"backoff_factor must be in \(0.0, 1.0\)"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"growth_interval": 0}, ValueError, r"growth_interval must be in \[1, 2147483647\]"),
        ({"growth_interval": 2**31}, ValueError, r"growth_interval must be in \[1, 2147483647\]"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int"),
        ({"hysteresis": 0}, ValueError, "hysteresis must be in"),
        ({"hysteresis": True}, TypeError, "hysteresis must be an int, got bool"),
        ({"min_scale": 0.0}, ValueError, "min_scale must be in"),
        ({"min_scale": 1e-45}, ValueError, "min_scale must be in"),  # subnormal: 1/scale would be inf
        ({"max_scale": 1e39}, ValueError, "max_scale must be in"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, r"max_scale must be in \[4.0"),
        ({"min_scale": 1.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, r"init_scale \(3.0\) must lie in"),
        ({"max_scale": 1024.0}, ValueError, r"init_scale \(65536.0\) must lie in"),
    ],
)
def test_create_rejects_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        fmp.DynamicLossScale.create(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "error", "message"),
    [
        ("gpu", ValueError, r"device 'gpu' cannot hold tensors here: Expected one of cpu"),
        (0.5, TypeError, r"device must be a str or torch.device \(e.g. 'cuda'\), got float"),
        pytest.param(
            "cuda",
            ValueError,
            "device 'cuda' cannot hold tensors here: Torch not compiled with CUDA",
            marks=pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build holds tensors there"),
        ),
    ],
)
def test_a_device_that_cannot_hold_the_state_is_named(device: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        fmp.DynamicLossScale.create(device=device)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        fmp.StaticLossScale.create(2.0, device=device)  # type: ignore[arg-type]


def test_create_accepts_a_tensor_scale_and_a_device() -> None:
    state = fmp.DynamicLossScale.create(init_scale=torch.tensor(8.0, dtype=torch.float64), device="cpu")
    assert state.loss_scale.dtype == torch.float32 and float(state.loss_scale) == 8.0
    assert state.growth_tracker.dtype == torch.int32 and state.growth_tracker.dim() == 0
    for bad in (-2.0, 1e39, 1e-40, 1e-50):
        with pytest.raises(ValueError, match="loss_scale must be a positive, normal float32"):
            fmp.StaticLossScale.create(bad)
    numpy = pytest.importorskip("numpy")
    state = fmp.DynamicLossScale.create(numpy.float32(2.0), numpy.float64(1.5), growth_interval=numpy.int64(7))
    assert state.growth_interval == 7 and type(state.growth_interval) is int and state.growth_factor == 1.5


def test_states_build_on_the_meta_device_for_shape_only_runs() -> None:
    # Validation reads the number on the CPU, never back from the target device.
    dynamic = fmp.DynamicLossScale.create(init_scale=2.0**10, device="meta")
    loaded = fmp.DynamicLossScale.from_state_dict(fmp.DynamicLossScale.create().state_dict(), device="meta")
    static = fmp.StaticLossScale.create(4.0, device="meta")
    for state in (dynamic, loaded, static):
        assert all(t.is_meta for t in pytree.tree_leaves(state))
        adjusted = state.adjust(torch.ones((), dtype=torch.bool, device="meta"))
        assert type(adjusted) is type(state) and all(t.is_meta for t in pytree.tree_leaves(adjusted))
    with pytest.raises(ValueError, match=r"state_dict\(\) reads the scale's values, which a state on the meta device"):
        dynamic.state_dict()
    with pytest.raises(ValueError, match="init_scale is a meta tensor, which holds no value: give a number"):
        fmp.DynamicLossScale.create(init_scale=torch.ones((), device="meta"))


@pytest.mark.parametrize(
    "state", [fmp.NoOpLossScale(), fmp.StaticLossScale.create(2.0), fmp.DynamicLossScale.create()], ids=type
)
@pytest.mark.parametrize(
    ("flag", "error"),
    [
        (True, TypeError),
        (torch.tensor(1.0), ValueError),
        (torch.tensor([True]), ValueError),
        (torch.tensor(1), ValueError),
    ],
)
def test_adjust_rejects_a_flag_that_is_not_a_0_dim_bool(state: fmp.LossScale, flag: object, error: type) -> None:
    with pytest.raises(error, match="grads_finite must be a 0-dim bool tensor"):
        state.adjust(flag)  # type: ignore[arg-type]


@given(
    scale=st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 2.0**-149])),
    tracker=st.integers(-5, 40),
    streak=st.integers(0, 2**31 - 1),
    interval=st.integers(1, 30),
    growth=st.sampled_from([2.0, 1.5, 3.0, 1e30]),
    backoff=st.sampled_from([0.5, 0.25, 0.9]),
    finite=st.booleans(),
)
def test_grad_scalers_update_kernel_and_the_pure_update_agree_on_any_state(
    scale: float, tracker: int, streak: int, interval: int, growth: float, backoff: float, finite: bool
) -> None:
    """Eager adjust runs GradScaler's kernel; compiled and under transforms the pure ops: the same bits."""
    base = DynamicLossScale.create(growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    state = replace(
        base,
        loss_scale=torch.tensor(scale, dtype=torch.float32),
        growth_tracker=torch.tensor(tracker, dtype=torch.int32),
        overflow_streak=torch.tensor(streak, dtype=torch.int32),
    )
    flag = torch.tensor(finite)
    kernel = state.adjust(flag)
    pure = torch.func.vmap(lambda f: state.adjust(f))(flag.unsqueeze(0))  # no kernel under vmap
    for field in ("loss_scale", "growth_tracker", "overflow_streak"):
        assert torch.equal(bits(getattr(kernel, field)), bits(getattr(pure, field)[0])), field
