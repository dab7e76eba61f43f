"""Buffer donation: results written into the tensors handed over, eager and compiled, as the pure step."""

from __future__ import annotations

import functools
import itertools
from typing import Any
from typing import NamedTuple

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import assert_unmutated
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params
from conftest import snapshot
from torch.testing._internal.two_tensor import TwoTensor

import fmp
from fmp._donation import check_distinct
from fmp._donation import copy_aliases
from fmp._donation import storage_use_count
from fmp._donation import writable

BF16 = fmp.get_policy("params=float32,compute=bfloat16,output=float32")
F32 = fmp.Policy()
ADAMW = fmp.optim.adamw(1e-2)


@pytest.mark.compiled
@pytest.mark.parametrize(
    ("compute", "planned"),
    [("float32", False), ("float32", True), ("bfloat16", False)],
    ids=["float32", "float32-planned", "bfloat16"],
)
def test_donated_compiled_step_reuses_the_buffers_bit_identically(compute: str, planned: bool) -> None:
    torch._dynamo.reset()
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    policy = fmp.get_policy(f"params=float32,compute={compute},output=float32")
    # Inductor skips intermediate bf16 roundings differently per fusion unless told to round as eager
    # does; with that, the donating graph computes exactly what the pure one does. float32 needs
    # nothing. Memory planning (the README's advice for CPU steps) only changes where temporaries live.
    options = {"emulate_precision_casts": True} if compute == "bfloat16" else {}
    donating_options = options | {"memory_planning": True} if planned else options
    pure_step, donating_step = (
        torch.compile(
            functools.partial(fmp.train_step, mlp_loss, policy=policy, optimizer=optimizer, donate=donate),
            fullgraph=True,
            options=compile_options,
        )
        for donate, compile_options in ((False, options), (True, donating_options))
    )
    pure = donated = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(2.0**10))
    donated = pytree.tree_map(torch.clone, donated)
    for x, y in mlp_batches(6, overflow_every=3):
        buffers = [t.data_ptr() for t in pytree.tree_leaves((donated.params, donated.opt_state))]
        pure, _ = pure_step(pure, x, y)
        donated, _ = donating_step(donated, x, y)
        assert [t.data_ptr() for t in pytree.tree_leaves((donated.params, donated.opt_state))] == buffers
        assert_trees_bitwise_equal(donated, pure)


def _state_buffers(state: fmp.TrainState) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((state.params, state.opt_state)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize(
    ("optimizer", "param_dtype"),
    [
        (fmp.optim.sgd(0.1, momentum=0.9), torch.float32),
        (ADAMW, torch.float32),
        (fmp.optim.stochastic_rounding(ADAMW, state_dtype=torch.bfloat16), torch.bfloat16),
    ],
    ids=["sgd-momentum", "adamw", "adamw-bfloat16-params"],
)
def test_eager_donation_writes_the_pure_steps_values_into_the_donated_buffers(
    optimizer: fmp.optim.Optimizer, param_dtype: torch.dtype, compute: torch.dtype
) -> None:
    policy = fmp.Policy(param_dtype, compute, torch.float32)
    params = pytree.tree_map(lambda p: p.to(param_dtype), mlp_params())
    pure = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(2.0**10))
    donated = pytree.tree_map(torch.clone, pure)
    for x, y in mlp_batches(6, overflow_every=3):
        buffers, before = _state_buffers(donated), snapshot(pure)
        new_pure, pure_info = fmp.train_step(mlp_loss, pure, x, y, policy=policy, optimizer=optimizer)
        assert_unmutated(pure, before)  # the default stays pure
        donated, info = fmp.train_step(mlp_loss, donated, x, y, policy=policy, optimizer=optimizer, donate=True)
        assert all(new is old for new, old in zip(_state_buffers(donated), buffers, strict=True))
        assert_trees_bitwise_equal((donated, info), (new_pure, pure_info))
        pure = new_pure
    assert int(donated.counts.skipped) == 2


class PreviousParams(NamedTuple):
    previous: dict[str, torch.Tensor]


def keeps_previous_params(lr: float) -> fmp.optim.Optimizer:
    """SGD whose state holds the params it was handed, the tensors themselves (as a pure optimizer may)."""

    def init(params: dict[str, torch.Tensor]) -> PreviousParams:
        return PreviousParams({k: v.clone() for k, v in params.items()})

    def update(grads: Any, state: PreviousParams, params: Any) -> tuple[Any, PreviousParams]:
        return {k: p - lr * grads[k] for k, p in params.items()}, PreviousParams(dict(params))

    return fmp.optim.Optimizer(init, update)


@hypothesis.given(
    layout=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=0, max_size=3),
    permuted=st.booleans(),
)
def test_a_tensor_is_writable_in_place_only_where_no_two_elements_share_memory(
    layout: list[tuple[int, int]], permuted: bool
) -> None:
    sizes, strides = [size for size, _ in layout], [stride for _, stride in layout]
    view = torch.zeros(200).as_strided(sizes, strides)
    offsets = [
        sum(index * stride for index, stride in zip(position, strides, strict=True))
        for position in itertools.product(*(range(size) for size in sizes))
    ]
    if writable(view):
        assert len(set(offsets)) == len(offsets)
    dense = torch.zeros(sizes).permute(list(reversed(range(len(sizes))))) if permuted else torch.zeros(sizes)
    assert writable(dense)  # contiguous and transposed layouts always are


def expanded_bias_state(optimizer: fmp.optim.Optimizer) -> fmp.TrainState:
    params = mlp_params()
    params["b1"] = torch.zeros(1).expand(8)  # stride 0: no memory to write eight values into
    overlapping = torch.randn(15, generator=torch.Generator().manual_seed(0)).as_strided((8, 8), (1, 1))
    params["w1"] = overlapping  # rows that overlap: the last write into them would win
    return fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(2.0**10))


def test_eager_donation_reads_donated_tensors_handed_back_and_replaces_expanded_ones() -> None:
    optimizer = keeps_previous_params(0.1)
    pure, donated = expanded_bias_state(optimizer), expanded_bias_state(optimizer)
    for x, y in mlp_batches(4, overflow_every=2):
        buffers = {k: t for k, t in donated.params.items() if k not in ("b1", "w1")}
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=optimizer)
        donated, _ = fmp.train_step(mlp_loss, donated, x, y, policy=F32, optimizer=optimizer, donate=True)
        assert_trees_bitwise_equal(donated, pure)
        assert all(donated.params[k] is t for k, t in buffers.items())


@pytest.mark.compiled
def test_compiled_donation_replaces_expanded_tensors() -> None:
    optimizer = keeps_previous_params(0.1)
    pure, compiled = expanded_bias_state(optimizer), expanded_bias_state(optimizer)
    # Functionalized as Inductor's input is (aot_eager), without generating code.
    step = torch.compile(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer, donate=True),
        backend="aot_eager",
        fullgraph=True,
    )
    for x, y in mlp_batches(4, overflow_every=2):
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=optimizer)
        compiled, _ = step(compiled, x, y)
        assert_trees_bitwise_equal(compiled, pure)


def test_eager_donation_under_transforms_or_autograd_writes_nothing() -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    step = functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer)
    members = [fmp.TrainState.create(mlp_params(seed=s), optimizer, fmp.DynamicLossScale.create()) for s in (0, 1)]
    stacked, (x, y) = fmp.stack_trees(members), next(mlp_batches(1, 0))
    xs, ys, before = torch.stack([x, x]), torch.stack([y, y]), snapshot(stacked)
    # vmap needs its inputs intact: the donated ensemble step leaves them so and equals the pure one.
    donated = torch.func.vmap(functools.partial(step, donate=True))(stacked, xs, ys)
    assert_unmutated(stacked, before)
    assert_trees_bitwise_equal(donated, torch.func.vmap(step)(stacked, xs, ys))
    # Autograd records the update (a meta-gradient through the step): written in place, it would be cut.
    state, tracked = members[0], x.clone().requires_grad_()
    before = snapshot(state)
    new_state, _ = step(state, tracked, y, donate=True)
    assert_unmutated(state, before)
    mlp_loss(new_state.params, x, y).backward()
    assert tracked.grad is not None and bool(tracked.grad.abs().sum() > 0)


def test_a_donated_state_whose_dicts_list_keys_in_another_order_is_written_key_by_key() -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    pure = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create())
    momentum = {key: pure.opt_state.momentum[key].clone() for key in reversed(list(pure.opt_state.momentum))}
    donated = pytree.tree_map(torch.clone, pure)._replace(opt_state=pure.opt_state._replace(momentum=momentum))
    buffers = {key: t.data_ptr() for key, t in momentum.items()}
    # The copies into the donated buffers happen while Dynamo traces: no code generation needed.
    step = torch.compile(
        functools.partial(fmp.train_step, mlp_loss, policy=F32, optimizer=optimizer, donate=True),
        backend="eager",
        fullgraph=True,
    )
    for x, y in mlp_batches(3, 0):
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=F32, optimizer=optimizer)
        donated, _ = step(donated, x, y)
        assert list(donated.opt_state.momentum) == list(momentum)  # its own order, kept
        assert {key: t.data_ptr() for key, t in donated.opt_state.momentum.items()} == buffers
        by_key = [
            {key: tree[key] for key in sorted(tree)} for tree in (donated.opt_state.momentum, pure.opt_state.momentum)
        ]
        assert_trees_bitwise_equal(*by_key)
        assert_trees_bitwise_equal(donated.params, pure.params)


def test_donating_a_tensor_listed_twice_is_refused() -> None:
    params = mlp_params()
    params["w1_tied"] = params["w1"]
    optimizer = fmp.optim.sgd(0.1)

    def tied_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mlp_loss(params, x, y) + params["w1_tied"].sum()

    step = torch.compile(
        functools.partial(fmp.train_step, tied_loss, policy=BF16, optimizer=optimizer, donate=True),
        backend="eager",  # the check runs while tracing; no code generation needed
        fullgraph=True,
    )
    state, (x, y) = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create()), next(mlp_batches(1, 0))
    message = r"state\.params\['w1'\] and state\.params\['w1_tied'\] are one tensor"
    with pytest.raises(ValueError, match=message):
        fmp.train_step(tied_loss, state, x, y, policy=BF16, optimizer=optimizer, donate=True)
    with pytest.raises(RuntimeError, match=message):  # Dynamo wraps the ValueError raised while tracing
        step(state, x, y)
    with pytest.raises(TypeError, match="donate must be a bool"):
        fmp.train_step(tied_loss, state, x, y, policy=BF16, optimizer=optimizer, donate="yes")  # type: ignore[arg-type]


def test_donating_tensors_that_view_one_another_is_refused_eager() -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    state, (x, y) = (
        fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create()),
        next(mlp_batches(1, 0)),
    )
    state, _ = fmp.train_step(mlp_loss, state, x, y, policy=BF16, optimizer=optimizer)  # momentum made
    momentum = {**state.opt_state.momentum, "w1": state.params["w1"].view(-1).view_as(state.params["w1"])}
    viewing = state._replace(opt_state=state.opt_state._replace(momentum=momentum))
    kept = snapshot(viewing)
    message = r"state\.params\['w1'\] and state\.opt_state\.momentum\['w1'\] share elements"
    with pytest.raises(ValueError, match=message):
        fmp.train_step(mlp_loss, viewing, x, y, policy=BF16, optimizer=optimizer, donate=True)
    assert_unmutated(viewing, kept)


def test_the_overlap_check_refuses_exactly_the_views_that_share_an_element() -> None:
    buffer = torch.zeros(8, 18)
    complex_buffer = torch.zeros(4, dtype=torch.complex64)
    scalar = torch.zeros(())
    apart = {
        "column blocks": {"a": buffer[:, :8], "b": buffer[:, 8:9].t(), "c": buffer[:, 9:]},
        "interleaved rows": dict(zip("ab", torch.stack([torch.zeros(3), torch.zeros(3)], 1).unbind(1), strict=True)),
        "real and imaginary parts": {"re": complex_buffer.real, "im": complex_buffer.imag[1:]},
        "expanded, never written in place": {"a": scalar.expand(3), "b": scalar.expand(2)},
        "meta": {"a": torch.empty(4, device="meta")[:2], "b": torch.empty(4, device="meta")[2:]},
        "a base and a view beyond it": {"a": buffer[0], "b": buffer[1:]},
    }
    for layout, tree in apart.items():
        assert check_distinct(tree, "state") == pytree.tree_leaves(tree), layout
    meeting = {
        "a view of a donated tensor": ({"w": buffer, "m": buffer[2:4]}, r"state\['w'\] and state\['m'\]"),
        "column blocks that meet": ({"a": buffer[:, :8], "b": buffer[:, 7:9]}, r"state\['a'\] and state\['b'\]"),
        "one complex element, both parts": (
            {"z": complex_buffer[1:2], "re": complex_buffer.real[1:]},
            r"state\['z'\] and state\['re'\]",
        ),
    }
    for layout, (tree, names) in meeting.items():
        with pytest.raises(ValueError, match=names + " share elements"):
            check_distinct(tree, "state")
            raise AssertionError(layout)


def test_donated_slices_of_one_flat_buffer_that_do_not_meet_are_written_as_the_pure_step() -> None:
    optimizer = fmp.optim.sgd(0.1)
    params = mlp_params()
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    sizes = [p.numel() for p in params.values()]
    views = dict(
        zip(params, (v.view_as(p) for v, p in zip(flat.split(sizes), params.values(), strict=True)), strict=True)
    )
    pure = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create())
    donated = fmp.TrainState.create(views, optimizer, fmp.DynamicLossScale.create())
    for x, y in mlp_batches(2, 0):
        pure, _ = fmp.train_step(mlp_loss, pure, x, y, policy=BF16, optimizer=optimizer)
        donated, _ = fmp.train_step(mlp_loss, donated, x, y, policy=BF16, optimizer=optimizer, donate=True)
    assert_trees_bitwise_equal(donated.params, pure.params)


def params_as_model_state(
    params: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`mlp_loss`, returning as the new model state a detached param and a view of another."""
    return mlp_loss(params, x, y), {"w1": params["w1"].detach(), "b1": params["b1"].detach()[:4]}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compiled)], ids=["eager", "compiled"])
def test_a_model_state_that_returns_the_donated_params_keeps_their_values(compiled: bool) -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    step = functools.partial(fmp.train_step, params_as_model_state, policy=F32, optimizer=optimizer)
    donating_step = functools.partial(step, donate=True)
    if compiled:  # functionalized as Inductor's input is (aot_eager), without generating code
        donating_step = torch.compile(donating_step, backend="aot_eager", fullgraph=True)
    params = mlp_params()
    model_state = {"w1": params["w1"].clone(), "b1": params["b1"][:4].clone()}
    pure = fmp.TrainState.create(params, optimizer, fmp.DynamicLossScale.create(), model_state=model_state)
    donated = pytree.tree_map(torch.clone, pure)
    for x, y in mlp_batches(3, 0):
        before = pytree.tree_map(torch.clone, donated.params)
        pure, _ = step(pure, x, y)
        donated, _ = donating_step(donated, x, y)
        assert_trees_bitwise_equal(donated, pure)
        assert torch.equal(donated.model_state["w1"], before["w1"])  # the params the loss function saw


def params_in_aux(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`mlp_loss`, returning as `aux` the params themselves, views, `detach()`es, and views of them and detached."""
    w1, w2, b1 = params["w1"], params["w2"], params["b1"]
    aux = {"w1": w1, "w1_row": w1[0], "w2": w2.detach(), "b1": b1.detach()[2:]}
    aux |= {"w1_flat": w1.view(-1).detach(), "w1_part": w1[0, :5].detach(), "w1_t": w1.t()[:3].detach()}
    return mlp_loss(params, x, y), aux


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compiled)], ids=["eager", "compiled"])
def test_an_aux_that_returns_the_donated_params_keeps_their_values(compiled: bool) -> None:
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    step = functools.partial(fmp.train_step, params_in_aux, policy=F32, optimizer=optimizer, has_aux=True)
    donating_step = functools.partial(step, donate=True)
    if compiled:  # functionalized as Inductor's input is (aot_eager), without generating code
        donating_step = torch.compile(donating_step, backend="aot_eager", fullgraph=True)
    pure = fmp.TrainState.create(mlp_params(), optimizer, fmp.DynamicLossScale.create(2.0**10))
    donated = pytree.tree_map(torch.clone, pure)
    for x, y in mlp_batches(4, overflow_every=2):
        before = pytree.tree_map(torch.clone, donated.params)
        pure, pure_info = step(pure, x, y)
        donated, info = donating_step(donated, x, y)
        assert_trees_bitwise_equal((donated, info), (pure, pure_info))
        expected = params_in_aux(before, x, y)[1]
        assert_trees_bitwise_equal(info.aux, expected)  # the values the loss function saw
        assert torch.equal(donated.params["w1"], before["w1"]) != bool(info.applied)
    assert int(donated.counts.skipped) == 2


def test_copy_aliases_copies_only_what_shares_the_donated_storage() -> None:
    donated = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    unrelated, alias, view = torch.ones(4), donated["w"].detach(), donated["b"][1:]
    kept, copied_alias, copied_view = copy_aliases((unrelated, alias, view), list(donated.values()))
    assert kept is unrelated
    assert copied_alias is not alias and copied_view is not view
    assert copied_alias.data_ptr() != alias.data_ptr() and torch.equal(copied_view, view)
    subclass = TwoTensor(donated["b"], donated["b"])  # no storage of its own to compare: left as it is
    assert copy_aliases(subclass, list(donated.values())) is subclass


def test_copy_aliases_copies_a_donated_tensor_itself_and_keeps_results_that_share_nothing() -> None:
    donated = {"w": torch.ones(4), "b": torch.zeros(4)}
    own = torch.ones(())  # a storage no other tensor refers to
    kept, copied = copy_aliases((own, donated["w"]), list(donated.values()))
    assert kept is own
    assert copied is not donated["w"] and copied.data_ptr() != donated["w"].data_ptr()
    # The donated tensor alone refers to its storage, so only its identity tells it apart.
    assert storage_use_count(donated["w"]) == storage_use_count(torch.empty(()))


@pytest.mark.parametrize("offset", [0, 1], ids=["whole", "from-the-second-element"])
def test_an_aux_viewing_a_donated_param_through_numpy_keeps_its_values(offset: int) -> None:
    # Another storage over the same memory: only the addresses tell that it aliases the param.
    optimizer = fmp.optim.sgd(0.5)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return torch.nn.functional.mse_loss(x @ p["w"], y), torch.from_numpy(p["w"].detach().numpy()[offset:])

    results = []
    for donate in (False, True):
        state = fmp.TrainState.create({"w": torch.ones(8, 1)}, optimizer, fmp.DynamicLossScale.create(1.0))
        _, info = fmp.train_step(
            loss_fn,
            state,
            torch.ones(4, 8),
            torch.zeros(4, 1),
            policy=F32,
            optimizer=optimizer,
            has_aux=True,
            donate=donate,
        )
        assert bool(info.applied)
        results.append(info.aux)
    assert torch.equal(results[1], torch.ones(8 - offset, 1))
    assert_trees_bitwise_equal(results[0], results[1])


def test_eager_donation_writes_the_params_whatever_the_model_state_holds() -> None:
    # The model state is not written in place: an inference tensor there leaves donation on.
    with torch.inference_mode():
        constant = torch.ones(3)

    def loss_fn(p: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return (x @ p["w"]).square().mean() + 0 * model_state["c"].sum(), {"c": model_state["c"]}

    state = fmp.TrainState.create(
        {"w": torch.randn(8, 1)}, ADAMW, fmp.DynamicLossScale.create(1.0), model_state={"c": constant}
    )
    before = [
        x.data_ptr() for x in pytree.tree_leaves((state.params, state.opt_state.exp_avg, state.opt_state.exp_avg_sq))
    ]
    copied = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    pure, _ = fmp.train_step(loss_fn, copied, torch.ones(4, 8), policy=F32, optimizer=ADAMW)
    state, _ = fmp.train_step(loss_fn, state, torch.ones(4, 8), policy=F32, optimizer=ADAMW, donate=True)
    after = [
        x.data_ptr() for x in pytree.tree_leaves((state.params, state.opt_state.exp_avg, state.opt_state.exp_avg_sq))
    ]
    assert after == before
    assert_trees_bitwise_equal(state, pure)
