from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close
from conftest import assert_unmutated
from conftest import snapshot

import fmp

SGD_CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.1, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-3},
    {"lr": 0.05, "momentum": 0.8, "nesterov": True},
    {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.01},
]
ADAM_CONFIGS = [
    {"lr": 1e-2, "eps": 1e-7},  # the default 1e-8 rounds to 0 in float16, which fmp refuses
    {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
]


def scheduled(factory: Callable[..., fmp.optim.Optimizer]) -> Callable[..., fmp.optim.Optimizer]:
    """`factory` given its lr as a (constant) schedule: the lr then comes from a tensor on device."""
    return lambda lr, **config: factory(fmp.optim.schedule.constant(lr), **config)


CASES: list[tuple[str, Callable[..., fmp.optim.Optimizer], type[torch.optim.Optimizer], dict[str, Any]]] = [
    *[("sgd", fmp.optim.sgd, torch.optim.SGD, c) for c in SGD_CONFIGS],
    *[("adam", fmp.optim.adam, torch.optim.Adam, c) for c in ADAM_CONFIGS],
    *[("adamw", fmp.optim.adamw, torch.optim.AdamW, c) for c in ADAM_CONFIGS],
    ("sgd-scheduled", scheduled(fmp.optim.sgd), torch.optim.SGD, SGD_CONFIGS[3]),
    ("adamw-scheduled", scheduled(fmp.optim.adamw), torch.optim.AdamW, ADAM_CONFIGS[1]),
]


def random_like(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_complex:  # both parts random: Adam must treat them as two reals, as torch does
        return torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64])
@pytest.mark.parametrize(
    ("name", "ours", "theirs", "config"), CASES, ids=lambda v: str(v) if isinstance(v, dict) else v
)
def test_matches_torch_optim(
    name: str,
    ours: Callable[..., fmp.optim.Optimizer],
    theirs: type[torch.optim.Optimizer],
    config: dict[str, Any],
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": random_like((5, 4), dtype, gen),
        "b": random_like((4,), dtype, gen),
        "t": random_like((), dtype, gen),
    }
    reference = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = theirs(list(reference.values()), **config)
    optimizer = ours(**config)
    state = optimizer.init(params)
    for _ in range(12):
        grads = {k: random_like(tuple(v.shape), dtype, gen) for k, v in params.items()}
        for k, p in reference.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        inputs = (grads, state, params)
        before = snapshot(inputs)
        params, state = optimizer.update(grads, state, params)
        assert_unmutated(inputs, before)
    # The arithmetic is torch's, op for op: 32- and 16-bit results agree bit for bit. In float64,
    # Adam's on-device beta**step may differ from Python's pow in the last bit, and the update with it.
    expected = {k: p.detach() for k, p in reference.items()}
    if dtype == torch.float64 and name not in ("sgd", "sgd-scheduled"):
        assert_trees_close(params, expected, rtol=1e-13, atol=0.0)
    elif name == "sgd-scheduled" and dtype in (torch.bfloat16, torch.float16):
        # torch's CPU kernel rounds a float lr to the param's dtype; fmp keeps a scheduled lr in float32.
        assert_trees_close(params, expected, **TOLERANCES[dtype])
    else:
        assert_trees_bitwise_equal(params, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize(
    "optimizer",
    [
        fmp.optim.adam(1e-2, weight_decay=0.1),
        fmp.optim.adamw(1e-2, weight_decay=0.1),
        fmp.optim.adamw(fmp.optim.schedule.warmup_cosine(1e-2, 2, 10), weight_decay=0.1),
    ],
    ids=["adam", "adamw", "adamw-scheduled"],
)
def test_adams_eager_temporaries_written_in_place_give_the_pure_forms_bits(
    optimizer: fmp.optim.Optimizer, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    params = {"w": random_like((5, 4), dtype, gen), "t": random_like((), dtype, gen)}
    in_place = pure = (params, optimizer.init(params))
    for _ in range(4):
        grads = {k: random_like(tuple(v.shape), dtype, gen) for k, v in params.items()}
        in_place = optimizer.update(grads, in_place[1], in_place[0])
        with monkeypatch.context() as patched:  # the form compiled code and transforms get
            patched.setattr(importlib.import_module("fmp.optim._adam"), "writes_in_place", lambda *trees: False)
            pure = optimizer.update(grads, pure[1], pure[0])
        assert_trees_bitwise_equal(in_place, pure)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [True, False], ids=["eager", "pure"])
def test_a_0_dim_16_bit_param_rounds_adams_denominator_as_torch_does(
    dtype: torch.dtype, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pure form (compiled, under torch.func or autograd) divided a 0-dim 16-bit moment by the
    # 0-dim float32 bias correction and kept the quotient in float32, where torch rounds it.
    if not in_place:
        monkeypatch.setattr(importlib.import_module("fmp.optim._adam"), "writes_in_place", lambda *trees: False)
    params, grads = {"t": torch.tensor(0.7, dtype=dtype)}, {"t": torch.tensor(0.3, dtype=dtype)}
    optimizer = fmp.optim.adam(1e30, eps=1e-7)
    ours, _ = optimizer.update(grads, optimizer.init(params), params)
    reference = torch.nn.Parameter(params["t"].clone())
    reference.grad = grads["t"].clone()
    torch.optim.Adam([reference], lr=1e30, eps=1e-7, foreach=False).step()
    assert_trees_bitwise_equal(ours, {"t": reference.detach()})


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("finite", [True, False], ids=["applied", "skipped"])
def test_a_train_step_with_a_learned_lr_keeps_the_hypergradient(donate: bool, finite: bool) -> None:
    # The step's masked update writes its select in place only into temporaries autograd does not record.
    log_lr = torch.tensor(-4.0, requires_grad=True)
    optimizer = fmp.optim.adamw(lambda count: log_lr.exp() + 0.0 * count)
    params = {"w": torch.linspace(-1.0, 1.0, 16).reshape(4, 4), "b": torch.zeros(4)}
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(2.0**4))
    x = torch.randn(3, 4) if finite else torch.full((3, 4), float("nan"))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return ((x @ p["w"] + p["b"]) ** 2).mean()

    new, info = fmp.train_step(loss_fn, state, x, policy=fmp.Policy(), optimizer=optimizer, donate=donate)
    assert bool(info.applied) == finite
    if finite:
        (hypergradient,) = torch.autograd.grad(new.params["w"].sum(), log_lr)
        assert float(hypergradient) != 0.0
    else:  # a skipped step keeps the params (bit for bit)
        assert torch.equal(new.params["w"].detach(), params["w"]) and new.params["w"].requires_grad


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward AD's first use
@pytest.mark.parametrize("optimizer_of", [fmp.optim.adam, fmp.optim.adamw], ids=["adam", "adamw"])
def test_adam_differentiates_through_a_learned_lr_and_in_forward_mode(
    optimizer_of: Callable[..., fmp.optim.Optimizer],
) -> None:
    # Autograd records the update through the lr (a hypergradient) and forward-mode AD carries
    # tangents through it: both need the pure form, whose ops all differentiate.
    params, grads = {"w": torch.linspace(-1.0, 1.0, 6)}, {"w": torch.linspace(0.5, -0.2, 6)}

    def updated_sum(log_lr: torch.Tensor) -> torch.Tensor:
        optimizer = optimizer_of(lambda count: log_lr.exp() + 0.0 * count)
        new, _ = optimizer.update(grads, optimizer.init(params), params)
        return new["w"].sum()

    log_lr = torch.tensor(-4.0, dtype=torch.float64, requires_grad=True)
    (hypergradient,) = torch.autograd.grad(updated_sum(log_lr), log_lr)
    torch.testing.assert_close(hypergradient, torch.func.grad(updated_sum)(log_lr.detach()), rtol=1e-12, atol=0.0)
    assert float(hypergradient) != 0.0
    optimizer = optimizer_of(1e-2)
    with torch.autograd.forward_ad.dual_level():
        tangents = {"w": torch.autograd.forward_ad.make_dual(grads["w"], torch.ones(6))}
        dual, _ = optimizer.update(tangents, optimizer.init(params), params)
        assert torch.autograd.forward_ad.unpack_dual(dual["w"]).tangent is not None


def test_stateless_sgd_has_empty_state_and_stateful_ones_count_steps() -> None:
    params = {"w": torch.ones(2)}
    assert fmp.optim.sgd(0.1).init(params) == ()
    state = fmp.optim.sgd(0.1, momentum=0.9).init(params)
    assert isinstance(state, fmp.optim.SgdState) and int(state.step) == 0
    adam_state = fmp.optim.adamw().init(params)
    _, adam_state = fmp.optim.adamw().update({"w": torch.ones(2)}, adam_state, params)
    assert int(adam_state.step) == 1 and adam_state.step.dtype == torch.int32


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (fmp.optim.sgd, {"lr": -1.0}, r"lr must be in \[0.0, inf\)"),
        (fmp.optim.sgd, {"lr": 0.1, "momentum": 1.5}, r"momentum must be in \[0.0, 1.0\]"),
        (fmp.optim.sgd, {"lr": 0.1, "nesterov": True}, "nesterov momentum needs momentum > 0"),
        (fmp.optim.sgd, {"lr": "fast"}, "lr must be a real number"),
        (fmp.optim.sgd, {"lr": float("nan")}, "lr must be in"),
        (fmp.optim.sgd, {"lr": -(2**2000)}, "lr must be in"),
        (fmp.optim.adamw, {"betas": (0.9, 1.0)}, r"betas\[1\] must be in"),
        (fmp.optim.adamw, {"betas": 0.9}, "betas must be a pair"),
        (fmp.optim.adam, {"eps": -1e-8}, "eps must be in"),
        (fmp.optim.adamw, {"eps": 0.0}, "adamw: eps must be > 0 in float32, got 0.0: with eps=0, an element"),
        (fmp.optim.adam, {"eps": 1e-46}, "adam: eps must be > 0 in float32, got 1e-46"),
        (fmp.optim.adamw, {"weight_decay": -0.1}, "weight_decay must be in"),
    ],
)
def test_bad_hyperparameters_are_named(factory: Callable[..., Any], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        factory(**kwargs)


def test_numpy_hyperparameters_are_accepted() -> None:
    numpy = pytest.importorskip("numpy")
    optimizer = fmp.optim.sgd(numpy.float32(0.5), momentum=numpy.float64(0.9))
    new_params, _ = optimizer.update({"w": torch.ones(2)}, optimizer.init({"w": torch.ones(2)}), {"w": torch.ones(2)})
    assert torch.equal(new_params["w"], torch.full((2,), 0.5))


@pytest.mark.parametrize(
    ("optimizer", "wrong_state", "expected"),
    [
        (fmp.optim.sgd(0.1), fmp.optim.adamw().init({"w": torch.ones(1)}), "no state"),
        (fmp.optim.sgd(0.1, momentum=0.9), (), "SgdState"),
        (fmp.optim.adamw(), fmp.optim.sgd(0.1, momentum=0.9).init({"w": torch.ones(1)}), "AdamState"),
    ],
)
def test_a_state_from_another_optimizer_is_named(
    optimizer: fmp.optim.Optimizer, wrong_state: Any, expected: str
) -> None:
    params = {"w": torch.ones(1)}
    with pytest.raises(TypeError, match=f"{expected}.*was it created by another optimizer"):
        optimizer.update(params, wrong_state, params)


# One optimizer of each state kind: none, momentum buffers, two moment trees.
each_state_kind = pytest.mark.parametrize(
    "optimizer",
    [fmp.optim.sgd(0.1), fmp.optim.sgd(0.1, momentum=0.9), fmp.optim.adamw()],
    ids=["sgd", "sgd-momentum", "adamw"],
)


@each_state_kind
def test_state_or_grads_of_other_params_are_named(optimizer: fmp.optim.Optimizer) -> None:
    params = {"w": torch.ones(3), "v": torch.ones(2)}
    state = optimizer.init(params)
    with pytest.raises(ValueError, match=r"grads must have the params' structure, but they differ at params\['v'\]"):
        optimizer.update({"w": torch.ones(3)}, state, params)
    if not torch.utils._pytree.tree_leaves(state):
        return
    other = optimizer.init({"w": torch.ones(4), "v": torch.ones(2)})
    with pytest.raises(ValueError, match=r"opt_state\.\w+\['w'\] is shape \(4,\), but params\['w'\] has shape \(3,\)"):
        optimizer.update(params, other, params)
    fewer = optimizer.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"which opt_state.* lacks; was the optimizer state created for other params"):
        optimizer.update(params, fewer, params)


@each_state_kind
def test_grads_or_state_of_another_dtype_are_named(optimizer: fmp.optim.Optimizer) -> None:
    # torch would promote the new params to float64 (SGD), or fail inside lerp (Adam).
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match=r"grads\['w'\] is torch.float64, but params\['w'\] is torch.float32"):
        optimizer.update({"w": torch.ones(3, dtype=torch.float64)}, optimizer.init(params), params)
    if torch.utils._pytree.tree_leaves(optimizer.init(params))[1:]:
        other = optimizer.init({"w": torch.ones(3, dtype=torch.bfloat16)})
        with pytest.raises(
            ValueError, match=r"opt_state\.\w+\['w'\] is torch.bfloat16, but .* created for other params"
        ):
            optimizer.update(params, other, params)


@each_state_kind
def test_grads_or_state_on_another_device_are_named(optimizer: fmp.optim.Optimizer) -> None:
    # A state loaded with map_location="cpu" whose params alone moved (meta stands for the GPU).
    params = {"w": torch.ones(3, device="meta")}
    with pytest.raises(ValueError, match=r"grads\['w'\] is on cpu, but params\['w'\] is on meta; move it"):
        optimizer.update({"w": torch.ones(3)}, optimizer.init(params), params)
    if torch.utils._pytree.tree_leaves(optimizer.init(params))[1:]:
        with pytest.raises(ValueError, match=r"opt_state\.\w+\['w'\] is on cpu, but params\['w'\] is on meta"):
            optimizer.update(params, optimizer.init({"w": torch.ones(3)}), params)


@each_state_kind
def test_state_and_grads_with_keys_in_another_order_are_taken_key_by_key(optimizer: fmp.optim.Optimizer) -> None:
    params = {"w": torch.linspace(0, 1, 3), "b": torch.linspace(-1, 0, 2)}
    reordered = {"b": params["b"], "w": params["w"]}
    grads = {"w": torch.full((3,), 0.5), "b": torch.full((2,), -0.25)}
    expected_params, expected_state = optimizer.update(grads, optimizer.init(params), params)
    state = optimizer.init(reordered)
    new_params, new_state = optimizer.update({"b": grads["b"], "w": grads["w"]}, state, params)
    assert_trees_bitwise_equal(new_params, expected_params)
    # The new state keeps the structure it was given (a skipped step keeps the old one leaf by leaf).
    assert torch.utils._pytree.tree_structure(new_state) == torch.utils._pytree.tree_structure(state)
    by_key = [
        [{k: f[k] for k in sorted(f)} if isinstance(f, dict) else f for f in s] for s in (new_state, expected_state)
    ]
    assert_trees_bitwise_equal(*by_key)


@pytest.mark.parametrize("optimizer_of", [fmp.optim.adam, fmp.optim.adamw], ids=["adam", "adamw"])
def test_an_eps_that_rounds_to_0_in_a_params_dtype_is_refused(optimizer_of: Callable[..., fmp.optim.Optimizer]) -> None:
    # In float16 eps=1e-8 is 0: torch.optim.Adam turns a param whose gradient is 0 into NaN and one
    # whose gradient is small into inf, with finite gradients, so a mixed-precision step applies it.
    params = {"w": torch.ones(4, dtype=torch.float16), "b": torch.ones(2)}
    grads = {"w": torch.tensor([0.0, 1e-3, 1e-2, 1.0], dtype=torch.float16), "b": torch.ones(2)}
    reference = torch.nn.Parameter(params["w"].clone())
    reference.grad = grads["w"].clone()
    torch.optim.Adam([reference], lr=1e-3, foreach=False).step()
    assert not bool(reference.isfinite().all())
    message = r"eps=1e-08 rounds to 0 in torch.float16, params\['w'\]'s dtype.*eps >= 5.96e-08"
    with pytest.raises(ValueError, match=message):
        optimizer_of(1e-3).init(params)
    f32_state = optimizer_of(1e-3).init({"w": torch.ones(4), "b": torch.ones(2)})
    with pytest.raises(ValueError, match=message):  # at update too: the state may come from elsewhere
        optimizer_of(1e-3).update(
            grads,
            f32_state._replace(
                exp_avg={"w": torch.zeros(4, dtype=torch.float16), "b": torch.zeros(2)},
                exp_avg_sq={"w": torch.zeros(4, dtype=torch.float16), "b": torch.zeros(2)},
            ),
            params,
        )
    new_params, _ = optimizer_of(1e-3, eps=1e-7).update(grads, optimizer_of(1e-3, eps=1e-7).init(params), params)
    assert all(bool(p.isfinite().all()) for p in new_params.values())
    # bfloat16 has float32's exponent range: 1e-8 is no 0 there.
    optimizer_of(1e-3).init({"w": torch.ones(4, dtype=torch.bfloat16)})


@pytest.mark.parametrize(
    ("params", "found"),
    [({"w": torch.ones(3, dtype=torch.long)}, "a torch.int64 tensor"), ({"w": torch.ones(3), "n": None}, "a NoneType")],
    ids=["integer", "none"],
)
@pytest.mark.parametrize(
    "optimizer",
    [fmp.optim.sgd(0.1), fmp.optim.sgd(0.1, momentum=0.9), fmp.optim.adamw()],
    ids=["sgd", "momentum", "adamw"],
)
def test_params_an_optimizer_cannot_update_are_named(
    params: dict[str, Any], found: str, optimizer: fmp.optim.Optimizer
) -> None:
    # sgd with momentum handed an integer param back as float32; others failed deep inside torch.
    message = rf"params\['[wn]'\] is {found}; an optimizer updates floating-point or complex tensors only"
    with pytest.raises(TypeError, match=message):
        optimizer.update(params, optimizer.init({"w": torch.ones(3)}), params)
    with pytest.raises(TypeError, match=message):  # and at init, where the optimizer keeps state
        fmp.optim.adam().init(params)


def _sparse_rows(rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """A (10, 4) sparse COO gradient, as nn.Embedding(sparse=True) makes, with these rows (duplicates kept)."""
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, (10, 4), check_invariants=True)


def test_adam_names_a_sparse_gradient_and_the_way_out() -> None:
    params = {"embed": torch.randn(10, 4)}
    grads = {"embed": _sparse_rows([1, 3], torch.ones(2, 4))}
    optimizer = fmp.optim.adamw(1e-3)
    with pytest.raises(TypeError, match=r"adamw does not take sparse gradients.*grads\['embed'\] is torch.sparse_coo"):
        optimizer.update(grads, optimizer.init(params), params)


def test_all_finite_reads_sparse_gradients_by_their_values() -> None:
    rows = [1, 3, 3]
    nan_row = torch.tensor([[1.0] * 4, [float("nan")] * 4, [1.0] * 4])
    for dtype in (torch.float32, torch.float16):
        assert bool(fmp.all_finite({"embed": _sparse_rows(rows, torch.ones(3, 4, dtype=dtype))}))
        assert not bool(fmp.all_finite({"embed": _sparse_rows(rows, nan_row.to(dtype))}))
    # Duplicates that overflow float16 only once summed, as GradScaler coalesces them.
    assert not bool(fmp.all_finite({"embed": _sparse_rows(rows, torch.full((3, 4), 40000.0, dtype=torch.float16))}))
