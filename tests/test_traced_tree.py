"""The tree walk traced steps use (fmp._traced_tree) against torch's C++ pytree, eager and under torch.compile."""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import pytest
import torch
import torch.utils._cxx_pytree as cxx_pytree
from hypothesis import given
from hypothesis import strategies as st

import fmp
from fmp import _pytree as pytree
from fmp import _traced_tree as traced


class _Pair(NamedTuple):
    a: object
    b: object


class _SubPair(_Pair):
    """A namedtuple's subclass: left to optree."""


class _FieldsOnly(tuple):
    """A tuple subclass with `_fields` but no `_make`: not a namedtuple to torch's pytrees (a leaf)."""

    _fields = ("a", "b")


class _Key(str):
    """A string key of its own type, which the rebuilt dict keeps."""


def _cases() -> dict[str, object]:
    t = [torch.full((i + 1,), float(i)) for i in range(4)]
    return {
        "dict": {"w": t[0], "b": t[1], "a": t[2]},  # insertion order, not sorted
        "empty dict": {},
        "int keys": {1: t[0], 0: t[1]},
        "key subclass": {_Key("w"): t[0]},
        "None value": {"w": t[0], "n": None},
        "Parameter value": {"w": torch.nn.Parameter(t[0])},
        "numbers and strings": {"lr": 1e-3, "name": "adam", "w": t[0]},
        "nested": {"outer": {"w": t[0]}, "list": [t[1], (t[2], None)], "empty": ()},
        "namedtuple": _Pair(t[0], {"w": t[1]}),
        "loss scale": fmp.DynamicLossScale.create(),
        "step counts": fmp.StepCounts(*(torch.zeros((), dtype=torch.int64) for _ in fmp.StepCounts._fields)),
        "tensor": t[0],
        "None": None,
        "number": 3.0,
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_the_walk_flattens_and_rebuilds_as_torchs_cxx_pytree(case: str) -> None:
    tree = _cases()[case]
    flat = traced.flatten(tree)
    assert flat is not None
    leaves, spec = flat
    expected_leaves, expected_spec = cxx_pytree.tree_flatten(tree)
    assert [id(x) for x in leaves] == [id(x) for x in expected_leaves]
    assert traced.num_leaves(spec) == expected_spec.num_leaves
    rebuilt = traced.unflatten(leaves, spec)
    assert type(rebuilt) is type(tree) and cxx_pytree.tree_structure(rebuilt) == expected_spec
    assert [id(x) for x in cxx_pytree.tree_leaves(rebuilt)] == [id(x) for x in expected_leaves]
    if isinstance(tree, dict):
        assert [type(k) for k in rebuilt] == [type(k) for k in tree]
    assert [id(x) for x in traced.flatten_up_to(spec, tree)] == [id(x) for x in expected_spec.flatten_up_to(tree)]


@pytest.mark.parametrize(
    "tree",
    [
        collections.OrderedDict(w=torch.zeros(1)),
        collections.defaultdict(list, w=torch.zeros(1)),
        collections.deque([torch.zeros(1)]),
        {"inner": _SubPair(torch.zeros(1), torch.ones(1))},
        [torch.return_types.max((torch.zeros(1), torch.zeros(1)))],
    ],
    ids=["OrderedDict", "defaultdict", "deque", "namedtuple subclass", "structseq"],
)
def test_other_containers_are_left_to_optree_whole(tree: object) -> None:
    assert traced.flatten(tree) is None
    compiled = torch.compile(lambda t: pytree.tree_map(lambda x: x + 1, t), fullgraph=True, backend="eager")
    expected = cxx_pytree.tree_map(lambda x: x + 1, tree)
    out = compiled(tree)
    assert cxx_pytree.tree_structure(out) == cxx_pytree.tree_structure(expected)
    pairs = zip(cxx_pytree.tree_leaves(out), cxx_pytree.tree_leaves(expected), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_tuple_with_fields_but_no_namedtuple_methods_stays_a_leaf() -> None:
    tree = [_FieldsOnly((torch.zeros(1), torch.ones(1)))]
    assert traced.flatten(tree) is None
    leaves = torch.compile(pytree.tree_leaves, fullgraph=True, backend="eager")(tree)
    assert len(leaves) == 1 and type(leaves[0]) is _FieldsOnly


def test_is_leaf_stops_the_walk_where_it_says() -> None:
    tree = {"a": (torch.zeros(1), torch.ones(1)), "b": [torch.zeros(2)]}

    def is_pair(x: object) -> bool:
        return isinstance(x, tuple)

    flat = traced.flatten(tree, is_pair)
    assert flat is not None
    expected = cxx_pytree.tree_leaves(tree, is_leaf=is_pair)
    assert [id(x) for x in flat[0]] == [id(x) for x in expected]
    assert traced.unflatten(flat[0], flat[1])["a"] is tree["a"]


def test_unflatten_and_flatten_up_to_name_what_does_not_fit() -> None:
    leaves, spec = traced.flatten({"a": torch.zeros(1), "b": [torch.zeros(1)]}) or ([], traced.LEAF)
    with pytest.raises(ValueError, match="the treespec has 2 leaves, but 1 were given"):
        traced.unflatten(leaves[:1], spec)
    with pytest.raises(ValueError, match=r"expected a dict with keys \['a', 'b'\], got keys \['a'\]"):
        traced.flatten_up_to(spec, {"a": 1})
    with pytest.raises(ValueError, match="expected a list, got a tuple"):
        traced.flatten_up_to(spec, {"a": 1, "b": (1,)})
    with pytest.raises(ValueError, match="a list of another structure"):
        traced.flatten_up_to(spec, {"a": 1, "b": [1, 2]})
    # Keys in another order are taken key by key, as optree takes them.
    assert traced.flatten_up_to(spec, {"b": [2], "a": 1}) == [1, 2]


@pytest.mark.parametrize("kind", [collections.OrderedDict, functools.partial(collections.defaultdict, list)])
def test_a_dict_spec_takes_the_other_dicts_key_by_key_as_optree_does(kind: object) -> None:
    x, y = torch.zeros(2), torch.ones(3)
    other = kind()  # type: ignore[operator]
    other["b"], other["a"] = y, x
    _, spec = traced.flatten({"a": x, "b": y}) or ([], traced.LEAF)
    expected = cxx_pytree.tree_structure({"a": x, "b": y}).flatten_up_to(other)
    assert [id(v) for v in traced.flatten_up_to(spec, other)] == [id(v) for v in expected]
    # Traced, a dict of params meets an OrderedDict of gradients (which optree walks): as eager.
    params = {"a": x, "b": y}
    adam = fmp.optim.adamw(0.1)
    update = torch.compile(adam.update, fullgraph=True, backend="eager")
    got, _ = update(other, adam.init(params), params)
    want, _ = adam.update(other, adam.init(params), params)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_messages_write_a_traced_spec_as_optree_writes_its_own() -> None:
    tree = {"w": torch.zeros(1), "b": [torch.zeros(1), (torch.zeros(1),)], "e": ()}
    _, spec = traced.flatten(tree) or ([], traced.LEAF)
    assert f"PyTreeSpec({traced.describe(spec)}, NoneIsLeaf, namespace='torch')" == str(cxx_pytree.tree_structure(tree))
    assert traced.describe(traced.LEAF) == "*"
    select = torch.compile(fmp.select_tree, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"two trees of one structure, got \{'a': \*\} and \{'b': \*\}"):
        select(torch.tensor(True), {"a": torch.zeros(1)}, {"b": torch.zeros(1)})


_tensors = st.builds(torch.zeros, st.just(1))  # distinct tensors: the leaves' order shows
_trees = st.recursive(
    st.one_of(_tensors, st.sampled_from([None, 1.0, "s"])),
    lambda children: st.one_of(
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda pair: _Pair(*pair)),
    ),
    max_leaves=10,
)


@given(_trees, _trees)
def test_the_walk_agrees_with_cxx_pytree_on_any_nesting(tree: object, other: object) -> None:
    flat, other_flat = traced.flatten(tree), traced.flatten(other)
    assert flat is not None and other_flat is not None
    expected_leaves, expected_spec = cxx_pytree.tree_flatten(tree)
    assert [id(x) for x in flat[0]] == [id(x) for x in expected_leaves]
    # Two specs are equal exactly where optree's are: structure, keys and their order, leaf for leaf.
    assert (flat[1] == other_flat[1]) == (expected_spec == cxx_pytree.tree_structure(other))
    assert cxx_pytree.tree_structure(traced.unflatten(flat[0], flat[1])) == expected_spec


def test_a_compiled_step_walks_its_trees_without_optree(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    params, buffers = fmp.nn.split(model)
    optimizer = fmp.optim.adamw(1e-2)
    state = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), model_state=buffers)
    x = torch.randn(8, 4)

    def loss_fn(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> object:
        out, buffers = fmp.nn.call(model, params, buffers, x)
        return out.square().mean(), buffers

    policy = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
    step = functools.partial(fmp.train_step, loss_fn, policy=policy, optimizer=optimizer)
    expected, _ = step(state, x)

    class NoOptree:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the traced step called torch.utils._cxx_pytree.{name}")

    torch._dynamo.reset()
    monkeypatch.setattr(pytree, "cxx_pytree", NoOptree())
    new_state, _ = torch.compile(step, fullgraph=True, backend="eager")(state, x)
    monkeypatch.undo()
    assert cxx_pytree.tree_structure(new_state) == cxx_pytree.tree_structure(expected)
    for a, b in zip(cxx_pytree.tree_leaves(new_state), cxx_pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
