from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import pytest
import torch
import torch.utils._cxx_pytree as cxx_pytree
from conftest import bits
from hypothesis import given
from hypothesis import strategies as st

import fmp
import fmp._pytree as pytree
from fmp._donation import select_into
from fmp._tree import _finite_magnitude
from fmp._tree import _finite_rows
from fmp._tree import _finite_whole
from fmp._tree_difference import structure_difference

values = st.floats(allow_nan=True, allow_infinity=True, width=32)


@given(st.lists(st.lists(values, min_size=1, max_size=5), max_size=4), st.sampled_from([torch.float32, torch.float64]))
def test_all_finite_is_true_exactly_when_every_value_is_finite(rows: list[list[float]], dtype: torch.dtype) -> None:
    tree = {str(i): torch.tensor(row, dtype=dtype) for i, row in enumerate(rows)}
    result = fmp.all_finite(tree)
    assert result.dtype == torch.bool and result.dim() == 0
    assert bool(result) == all(math.isfinite(v) for row in rows for v in row)


def test_all_finite_edge_cases() -> None:
    assert bool(fmp.all_finite({}))
    assert bool(fmp.all_finite([None, 3, torch.tensor([1, 2])]))  # ints are finite; non-tensors ignored
    assert not bool(fmp.all_finite([torch.ones(2), torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)]))
    assert not bool(fmp.all_finite(torch.tensor(float("-inf"), dtype=torch.float16)))
    assert bool(fmp.all_finite({"empty": torch.empty(0), "zero_dim": torch.tensor(2.0)}))
    assert not bool(fmp.all_finite([torch.empty(0, 3), torch.tensor([[1.0, float("nan")]]).t()]))  # non-contiguous


@given(
    shape=st.sampled_from([(), (7,), (2048,), (3072,), (5, 3), (4, 2, 3), (1, 1030)]),
    bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([math.nan, math.inf, -math.inf])), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_the_checks_of_compiled_code_agree_with_the_eager_one(
    shape: tuple[int, ...], bad: list[tuple[int, float]], dtype: torch.dtype
) -> None:
    # fmp.all_finite reduces row by row in compiled GPU code and by magnitude in compiled CPU code;
    # this checks both forms eagerly.
    x = torch.randn(shape).to(dtype)
    flat = x.view(-1)
    for index, value in bad:
        flat[index % flat.numel()] = value
    expected = not bad
    assert bool(_finite_rows(x).all()) == bool(_finite_magnitude(x)) == bool(_finite_whole(x)) == expected


@given(st.lists(st.tuples(values, values), min_size=1, max_size=5))
def test_all_finite_checks_both_parts_of_complex_leaves(pairs: list[tuple[float, float]]) -> None:
    z = torch.complex(torch.tensor([r for r, _ in pairs]), torch.tensor([i for _, i in pairs]))
    assert bool(fmp.all_finite({"z": z})) == all(math.isfinite(r) and math.isfinite(i) for r, i in pairs)


@given(st.booleans(), st.lists(values, min_size=1, max_size=6), st.lists(values, min_size=1, max_size=6))
def test_select_tree_returns_the_chosen_side_bit_for_bit(pred: bool, a: list[float], b: list[float]) -> None:
    n = min(len(a), len(b))
    left = {"x": torch.tensor(a[:n]), "n": 7, "k": torch.arange(n)}
    right = {"x": torch.tensor(b[:n]), "n": 7, "k": torch.arange(n) * 2}
    out = fmp.select_tree(torch.tensor(pred), left, right)
    chosen = left if pred else right
    assert torch.equal(bits(out["x"]), bits(chosen["x"]))
    assert torch.equal(out["k"], chosen["k"]) and out["n"] == 7


@given(
    st.booleans(),
    st.lists(st.lists(values, min_size=4, max_size=4), min_size=2, max_size=4),
    st.lists(st.lists(values, min_size=4, max_size=4), min_size=2, max_size=4),
    st.lists(st.integers(-1, 3), min_size=4, max_size=4),
)
def test_select_into_writes_select_trees_bits_into_the_donated_tensors(
    pred: bool, new: list[list[float]], old: list[list[float]], handed_back: list[int]
) -> None:
    # A donated step's select: new values (some of which are donated tensors handed back, as by an
    # optimizer keeping the previous params) written into the donated ones, bit for bit select_tree's.
    n = min(len(new), len(old))
    donated = [torch.tensor(row) for row in old[:n]]
    on_true = [donated[j] if 0 <= j < n and j != i else torch.tensor(new[i]) for i, j in enumerate(handed_back[:n])]
    expected = fmp.select_tree(torch.tensor(pred), [t.clone() for t in on_true], [t.clone() for t in donated])
    written = select_into(torch.tensor(pred), on_true, donated)
    assert all(out is buffer for out, buffer in zip(written, donated, strict=True))
    assert all(torch.equal(bits(out), bits(want)) for out, want in zip(written, expected, strict=True))


def test_select_tree_rejects_mismatched_trees() -> None:
    yes = torch.tensor(True)
    with pytest.raises(ValueError, match="one structure"):
        fmp.select_tree(yes, {"a": torch.ones(1)}, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match=r"leaf \['a'\] is torch.float32\[2\] on one side"):
        fmp.select_tree(yes, {"a": torch.ones(2)}, {"a": torch.ones(3)})
    with pytest.raises(ValueError, match="non-tensor leaf"):
        fmp.select_tree(yes, {"a": 1}, {"a": 2})
    numpy = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="non-tensor leaf"):
        fmp.select_tree(yes, {"a": numpy.ones(2)}, {"a": numpy.ones(2)})
    with pytest.raises(ValueError, match="tensor on one side only"):
        fmp.select_tree(yes, {"a": 1.0}, {"a": torch.ones(())})
    with pytest.raises(ValueError, match="pred must be a 0-dim bool"):
        fmp.select_tree(torch.tensor([True]), {}, {})
    with pytest.raises(TypeError, match="pred must be a 0-dim bool"):
        fmp.select_tree(True, {}, {})  # type: ignore[arg-type]


_trees = st.recursive(
    st.just(torch.zeros(1)),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
    ),
    max_leaves=8,
)


@given(_trees, _trees)
def test_a_structure_difference_is_named_exactly_where_the_treespecs_differ(first: Any, other: Any) -> None:
    difference = structure_difference(first, other, "tree")
    assert (difference is None) == (pytree.tree_structure(first) == pytree.tree_structure(other))
    assert structure_difference(first, first) is None


def test_stack_trees_stacks_members_and_names_a_mismatch() -> None:
    members = [fmp.DynamicLossScale.create(init_scale=2.0**k) for k in (3, 5)]
    stacked = fmp.stack_trees(members)
    assert stacked.loss_scale.tolist() == [8.0, 32.0] and stacked.growth_interval == 2000
    assert float(fmp.unstack_tree(stacked, 1).loss_scale) == 32.0
    with pytest.raises(ValueError, match=r"trees\[1\]\.growth_interval is 7, not 2000 as in trees\[0\]"):
        fmp.stack_trees([members[0], fmp.DynamicLossScale.create(growth_interval=7)])
    states = [fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.sgd(0.1), member) for member in members]
    with pytest.raises(ValueError, match=r"trees\[1\]\.params has keys \['v'\], not \['w'\]"):
        fmp.stack_trees([states[0], states[1]._replace(params={"v": torch.ones(2)})])
    adam = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.adamw(0.1), members[1])
    with pytest.raises(ValueError, match=r"trees\[1\]\.opt_state is of type AdamState, not tuple"):
        fmp.stack_trees([states[0], adam])
    with pytest.raises(ValueError, match="at least one tree"):
        fmp.stack_trees([])


@pytest.mark.parametrize(
    ("other", "error", "message"),
    [
        (
            {"w": torch.zeros(3, 3), "b": torch.zeros(3)},
            ValueError,
            r"leaf \['w'\] is torch.float32\[3, 3\] on cpu in tree 1",
        ),
        ({"w": torch.zeros(3, 2, dtype=torch.float16), "b": torch.zeros(3)}, ValueError, r"torch.float16\[3, 2\]"),
        ({"w": torch.zeros(3, 2), "b": 0.0}, TypeError, r"leaf \['b'\] of tree 1 is a float, not a tensor"),
    ],
)
def test_stack_trees_names_a_leaf_that_differs(other: dict[str, object], error: type[Exception], message: str) -> None:
    first = {"w": torch.zeros(3, 2), "b": torch.zeros(3)}
    with pytest.raises(error, match=message):
        fmp.stack_trees([first, other])
    with pytest.raises(TypeError, match=r"takes a list of trees, e.g. \[state_0, state_1\], got a dict"):
        fmp.stack_trees(first)  # type: ignore[arg-type]


def test_cast_floating_takes_only_a_floating_dtype() -> None:
    tree = {"x": torch.tensor([0.7, -1.9]), "n": torch.tensor([1, 2])}
    cast_tree = fmp.cast_floating(tree, torch.bfloat16)
    assert cast_tree["x"].dtype == torch.bfloat16 and cast_tree["n"] is tree["n"]
    for dtype in (torch.int32, torch.bool, "float16"):
        with pytest.raises(TypeError, match=r"dtype must be a floating-point torch\.dtype"):
            fmp.cast_floating(tree, dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_all_finite_reads_float8_leaves(dtype: torch.dtype) -> None:
    finite = torch.tensor([0.5, -2.0, 0.0]).to(dtype)
    assert bool(fmp.all_finite([finite]))
    assert not bool(fmp.all_finite([finite, torch.tensor([1.0, float("nan")]).to(dtype)]))
    if dtype == torch.float8_e5m2:  # e4m3fn has no infinity: inf becomes NaN
        assert not bool(fmp.all_finite([torch.tensor([float("inf")]).to(dtype)]))


def _opaque_containers() -> dict[str, object]:
    model = torch.nn.Linear(2, 2)
    grads = {"w": torch.full((2,), float("inf"))}
    return {
        "generator": (g for g in grads.values()),
        "dict view": grads.values(),
        "set": {1.0},
        "module": model,
    }


@pytest.mark.parametrize("kind", ["generator", "dict view", "set", "module"])
def test_containers_that_pytrees_do_not_open_are_named(kind: str) -> None:
    # Each is one opaque leaf to a pytree: its infinite gradient would read as finite, a cast cast nothing.
    message = r"\['g'\] is a \w+, which pytrees keep as one opaque leaf, so the tensors in it would go unseen"
    calls = {
        "all_finite": lambda t: fmp.all_finite(t),
        "global_norm": lambda t: fmp.optim.global_norm(t),
        "unscale_and_adjust": lambda t: fmp.unscale_and_adjust(fmp.DynamicLossScale.create(), t),
        "TrainState.create": lambda t: fmp.TrainState.create(t, fmp.optim.sgd(0.1), fmp.NoOpLossScale()),
    }
    for call in calls.values():
        with pytest.raises(TypeError, match=message):
            call({"g": _opaque_containers()[kind]})
    # A cast passes a Module or a set through (a model handed to the loss function as an argument).
    if kind in ("module", "set"):
        tree = {"g": _opaque_containers()[kind]}
        assert fmp.cast_floating(tree, torch.bfloat16)["g"] is tree["g"]
    else:
        with pytest.raises(TypeError, match=message):
            fmp.cast_floating({"g": _opaque_containers()[kind]}, torch.bfloat16)


def test_unstack_tree_names_a_tree_that_is_not_a_stack() -> None:
    stacked = fmp.stack_trees([{"w": torch.zeros(2)}, {"w": torch.ones(2)}])
    assert torch.equal(fmp.unstack_tree(stacked, -1)["w"], torch.ones(2))
    assert torch.equal(fmp.unstack_tree(stacked, torch.tensor(1))["w"], torch.ones(2))  # e.g. losses.argmin()
    with pytest.raises(TypeError, match="index must be an int, got bool"):
        fmp.unstack_tree(stacked, True)
    with pytest.raises(ValueError, match="index 2 is out of range for a stack of 2"):
        fmp.unstack_tree(stacked, 2)
    with pytest.raises(ValueError, match=r"tree\['s'\] is a 0-dim tensor; pass a tree stacked by fmp.stack_trees"):
        fmp.unstack_tree({"s": torch.zeros(())}, 0)
    with pytest.raises(TypeError, match=r"tree\['x'\] is a float"):
        fmp.unstack_tree({"x": 1.0}, 0)
    with pytest.raises(ValueError, match=r"leading sizes differ \(\[2, 3\]\)"):
        fmp.unstack_tree({"a": torch.zeros(2), "b": torch.zeros(3)}, 0)


class _Pair(NamedTuple):
    a: object
    b: object


class _Key(str):
    """A string key of its own type, which optree keeps in the spec."""


def _flattening_cases() -> dict[str, object]:
    t = [torch.full((i + 1,), float(i)) for i in range(4)]
    return {
        "dict": {"w": t[0], "b": t[1], "a": t[2]},  # insertion order, not sorted
        "dict, keys reordered": {"a": t[2], "w": t[0], "b": t[1]},
        "empty dict": {},
        "int keys": {1: t[0], 0: t[1]},
        "key subclass": {_Key("w"): t[0]},
        "None value": {"w": t[0], "n": None},
        "Parameter value": {"w": torch.nn.Parameter(t[0])},
        "nested dict": {"outer": {"w": t[0]}},
        "tuple of trees": (t[0], ((), {"w": t[1], "b": t[2]}), [t[3]]),
        "namedtuple": _Pair(t[0], {"w": t[1]}),
        "tensor": t[0],
        "number": 3.0,
    }


@pytest.mark.parametrize("case", list(_flattening_cases()))
def test_fast_flattening_agrees_with_torchs_cxx_pytree(case: str) -> None:
    tree = _flattening_cases()[case]
    for _ in range(2):  # the second time from the cache of dict specs
        leaves, spec = pytree.tree_flatten(tree)
        expected_leaves, expected_spec = cxx_pytree.tree_flatten(tree)
        assert spec == expected_spec and str(spec) == str(expected_spec)
        assert all(x is y for x, y in zip(leaves, expected_leaves, strict=True))
        assert all(x is y for x, y in zip(pytree.tree_leaves(tree), expected_leaves, strict=True))
        rebuilt = pytree.tree_unflatten(leaves, spec)
        assert cxx_pytree.tree_structure(rebuilt) == expected_spec
        if isinstance(tree, dict):
            assert [type(k) for k in rebuilt] == [type(k) for k in tree]


_tensors = st.builds(torch.zeros, st.just(1))  # distinct tensors: the leaves' order shows
_trees = st.recursive(
    st.one_of(_tensors, st.sampled_from([None, 1.0])),
    lambda children: st.one_of(
        st.dictionaries(st.text(max_size=3), _tensors, max_size=5),  # the shortcut's case: tensors only
        st.dictionaries(st.text(max_size=3), children, max_size=4),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=12,
)


@given(_trees)
def test_fast_flattening_agrees_with_torchs_cxx_pytree_on_any_nesting(tree: object) -> None:
    for _ in range(2):  # the second time from the cache of dict specs
        leaves, spec = pytree.tree_flatten(tree)
        expected_leaves, expected_spec = cxx_pytree.tree_flatten(tree)
        assert spec == expected_spec
        expected = [id(x) for x in expected_leaves]
        assert [id(x) for x in leaves] == expected and [id(x) for x in pytree.tree_leaves(tree)] == expected
