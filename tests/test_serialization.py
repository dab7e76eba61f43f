"""fmp.serialization: atomic checked save/load against a target, and sharded states resharded through DCP."""

from __future__ import annotations

import collections
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import _serialization_worker as worker
import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_trees_bitwise_equal
from conftest import mlp_batches
from conftest import mlp_loss
from conftest import mlp_params

import fmp
from fmp._struct import replace
from fmp.serialization import CheckpointError
from fmp.serialization import load
from fmp.serialization import load_sharded
from fmp.serialization import save
from fmp.serialization import save_sharded
from fmp.serialization._sharded import _header_digest

WORKER = Path(__file__).resolve().parent / "_serialization_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Words an error about a damaged file must never come down to.
BAD_WORDS = ("weights_only=False", "negative seek", "EOFError('')")


def dynamic() -> fmp.DynamicLossScale:
    """A dynamic scale away from its defaults: a moved scale, counters, other hyperparameters."""
    int32 = torch.int32
    return fmp.DynamicLossScale(
        torch.tensor(2.0**9), torch.tensor(5, dtype=int32), torch.tensor(2, dtype=int32), 3.0, 0.25, 7, 1.0, 2.0**20, 2
    )


def make_state(optimizer: fmp.optim.Optimizer | None = None, scaler: Any = None, **kwargs: Any) -> fmp.TrainState:
    return fmp.TrainState.create(
        mlp_params(), optimizer or fmp.optim.adamw(1e-2), dynamic() if scaler is None else scaler, **kwargs
    )


def meta(tree: Any) -> Any:
    return pytree.tree_map(lambda t: torch.empty_like(t, device="meta"), tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[fmp.TrainState, Path]:
    path = tmp_path_factory.mktemp("saved") / "state.pt"
    state = make_state()
    save(state, path)
    return state, path


def refused(error: pytest.ExceptionInfo[BaseException], *fragments: str) -> None:
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, message
    assert not any(word in message for word in BAD_WORDS), message
    assert error.value.__cause__ is None or not any(word in str(error.value.__cause__) for word in BAD_WORDS)


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(make_state(), id="adamw-dynamic"),
        pytest.param(make_state(fmp.optim.sgd(0.1, momentum=0.9), fmp.StaticLossScale.create(8.0)), id="sgd-static"),
        pytest.param(make_state(fmp.optim.sgd(0.1), fmp.NoOpLossScale()), id="sgd-noop"),
        pytest.param(make_state(scaler=(dynamic(), fmp.StaticLossScale.create(3.0))), id="tuple-scalers"),
        pytest.param(
            make_state(accumulation_steps=2, model_state={"mean": torch.randn(8), "n": torch.tensor(3)}),
            id="model-state-accumulator",
        ),
        pytest.param(
            fmp.TrainState.create(fmp.cast_floating(mlp_params(), torch.bfloat16), fmp.optim.adamw(1e-2), dynamic()),
            id="bfloat16-params",
        ),
        pytest.param((dynamic(), fmp.StaticLossScale.create(2.0)), id="scalers-alone"),
    ],
)
def test_a_state_round_trips_bit_for_bit_and_plain_torch_load_reads_it(state: Any, tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(state, path)
    assert_trees_bitwise_equal(load(path, state), state)
    assert_trees_bitwise_equal(load(path, meta(state)), state)  # an abstract target: values on CPU
    plain = torch.load(path, weights_only=True)
    assert_trees_bitwise_equal(plain["state"], state)
    assert plain["format"] == "fmp.serialization" and plain["version"] == 1 and len(plain["sha256"]) == 64
    assert [entry[0] for entry in plain["leaves"]][:1] == [pytree.keystr(pytree.tree_flatten_with_path(state)[0][0][0])]
    assert os.listdir(tmp_path) == ["c.pt"]  # no partial file left behind


def test_a_load_leaves_the_target_alone_and_follows_its_devices(saved: tuple[fmp.TrainState, Path]) -> None:
    state, path = saved
    target = pytree.tree_map(torch.zeros_like, state)
    loaded = load(path, target)
    assert all(not bool(t.any()) for t in pytree.tree_leaves(target))
    pairs = zip(pytree.tree_leaves(loaded), pytree.tree_leaves(target), strict=True)
    assert all(a.data_ptr() != b.data_ptr() for a, b in pairs)
    assert {t.device for t in pytree.tree_leaves(load(path, meta(state), device="cpu"))} == {torch.device("cpu")}


@hypothesis.settings(max_examples=25)
@hypothesis.given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_a_truncated_file_is_named_truncated_or_corrupt(
    saved: tuple[fmp.TrainState, Path], tmp_path_factory: pytest.TempPathFactory, cut: float
) -> None:
    state, path = saved
    data = path.read_bytes()
    cut_path = tmp_path_factory.mktemp("cut") / "c.pt"
    cut_path.write_bytes(data[: int(cut * len(data))])
    with pytest.raises(CheckpointError) as error:
        load(cut_path, state)
    refused(error, f"checkpoint {cut_path} is truncated or corrupt (", "load an earlier checkpoint")


def test_garbage_and_flipped_bytes_are_named_corrupt(saved: tuple[fmp.TrainState, Path], tmp_path: Path) -> None:
    state, path = saved
    data = path.read_bytes()
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(len(data)))
    # Bytes changed inside a tensor's record: the zip and the pickle stay sound, the checksum does not.
    at = data.index(state.params["w1"].numpy().tobytes())
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    for bad in (garbage, flipped):
        with pytest.raises(CheckpointError) as error:
            load(bad, state)
        refused(error, f"checkpoint {bad} is truncated or corrupt (")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.pt", state)


@hypothesis.settings(max_examples=40)
@hypothesis.given(extra=st.binary(min_size=1, max_size=300))
def test_bytes_appended_to_a_checkpoint_are_refused(
    saved: tuple[fmp.TrainState, Path], tmp_path_factory: pytest.TempPathFactory, extra: bytes
) -> None:
    # torch.load reads the archive from its end record and ignores what follows it.
    state, path = saved
    bad = tmp_path_factory.mktemp("appended") / "c.pt"
    bad.write_bytes(path.read_bytes() + extra)
    with pytest.raises(CheckpointError) as error:
        load(bad, state)
    refused(error, f"checkpoint {bad} is truncated or corrupt (", "load an earlier checkpoint")


def test_a_checkpoint_written_twice_into_one_file_or_behind_its_end_record_is_refused(tmp_path: Path) -> None:
    # Larger than the 64 KiB in which a zip's end record may lie, so that the records are sought, not found.
    state = {"w": torch.randn(40_000), "b": torch.randn(3)}
    path = tmp_path / "state.pt"
    save(state, path)
    data = path.read_bytes()
    assert_trees_bitwise_equal(load(path, state), state)
    end = data.rindex(b"PK\x05\x06")
    end_record, locator = data[end:], data[end - 20 : end]
    # An end record whose comment runs past the file (its last byte cut off, as zip readers take it).
    comment_cut = end_record[:20] + (1).to_bytes(2, "little")
    # A fake locator and end record whose comment covers the real records: a locator pointing
    # past the file must be named, not sought.
    far = locator[:8] + (2**64 - 1).to_bytes(8, "little") + locator[16:]
    fake_end = b"PK\x05\x06" + bytes(16) + (len(locator) + len(comment_cut)).to_bytes(2, "little")
    cases = {
        "twice.pt": (data + data, f"{len(data)} bytes precede its zip archive"),
        "end.pt": (data + end_record, "its central directory does not end where its end records begin"),
        "tail.pt": (data + b"\0" * 5, "5 bytes follow the end of its zip archive"),
        "cut.pt": (data[:end] + comment_cut, "the file ends inside its zip archive's end record"),
        "far.pt": (data + far + fake_end + locator + comment_cut, "its zip64 end record lies outside the file"),
    }
    for name, (content, cause) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError) as error:
            load(tmp_path / name, state)
        refused(error, f"checkpoint {tmp_path / name} is truncated or corrupt ({cause})")


class Opaque:
    pass


def test_loaded_leaves_never_require_grad_nor_share_memory_whatever_the_file_says(tmp_path: Path) -> None:
    # A state that lists one tensor twice saves as one storage; flags are outside the checksum.
    params = mlp_params()
    params["w1_tied"] = params["w1"]
    state = fmp.TrainState.create(params, fmp.optim.sgd(0.1, momentum=0.9), fmp.DynamicLossScale.create())
    path = tmp_path / "state.pt"
    save(state, path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state"].params["w2"].requires_grad_()  # as a flipped flag byte would read
    torch.save(checkpoint, path)
    loaded = load(path, state)
    assert_trees_bitwise_equal(loaded, state)
    leaves = [leaf for leaf in pytree.tree_leaves(loaded) if leaf.numel()]
    assert not any(leaf.requires_grad for leaf in leaves)
    assert len({leaf.untyped_storage().data_ptr() for leaf in leaves}) == len(leaves)
    optimizer = fmp.optim.sgd(0.1, momentum=0.9)
    x, y = next(mlp_batches(1, 0))
    policy = fmp.get_policy("params=float32,compute=float32,output=float32")

    def tied_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mlp_loss(params, x, y) + params["w1_tied"].sum()

    pure, _ = fmp.train_step(tied_loss, loaded, x, y, policy=policy, optimizer=optimizer)
    donated, _ = fmp.train_step(tied_loss, loaded, x, y, policy=policy, optimizer=optimizer, donate=True)
    assert_trees_bitwise_equal(donated, pure)


def test_a_file_that_is_not_an_fmp_checkpoint_says_so(saved: tuple[fmp.TrainState, Path], tmp_path: Path) -> None:
    state, path = saved
    cases = {
        "tensor.pt": (torch.zeros(3), "is not an fmp checkpoint (it holds Tensor)"),
        "plain-state.pt": (state, "is not an fmp checkpoint (it holds TrainState)"),
        "object.pt": ({"x": Opaque()}, "it holds a test_serialization.Opaque, which torch.load(weights_only=True)"),
        "newer.pt": ({**torch.load(path, weights_only=True), "version": 99}, "format version 99"),
    }
    for name, (content, fragment) in cases.items():
        torch.save(content, tmp_path / name)
        with pytest.raises(CheckpointError) as error:
            load(tmp_path / name, state)
        refused(error, fragment, "fmp.serialization.save" if name != "newer.pt" else "upgrade fmp")


@pytest.mark.parametrize(
    ("target", "fragments"),
    [
        (
            fmp.TrainState.create(mlp_params(width=6), fmp.optim.adamw(1e-2), dynamic()),
            ["state.params['w1'] differs in shape: shape (8, 8), float32 in the checkpoint, shape (6, 6), float32"],
        ),
        (
            fmp.TrainState.create(fmp.cast_floating(mlp_params(), torch.float64), fmp.optim.adamw(1e-2), dynamic()),
            ["state.params['w1'] differs in dtype: shape (8, 8), float32 in the checkpoint, shape (8, 8), float64"],
        ),
        (
            fmp.TrainState.create({**mlp_params(), "extra": torch.zeros(2)}, fmp.optim.adamw(1e-2), dynamic()),
            ["the target holds [\"state.params['extra']\"], which the checkpoint lacks"],
        ),
        (
            fmp.TrainState.create(
                {k: v for k, v in mlp_params().items() if k != "b2"}, fmp.optim.adamw(1e-2), dynamic()
            ),
            ["the checkpoint holds [\"state.params['b2']\"], which the target lacks"],
        ),
        (
            make_state(fmp.optim.sgd(0.1, momentum=0.9)),
            ["state.opt_state differs in type: AdamState in the checkpoint, SgdState in the target (another optimizer"],
        ),
        (
            make_state(scaler=fmp.DynamicLossScale.create()),
            ["state.scaler.growth_factor is 3.0 in the checkpoint but 2.0"],
        ),
        (
            make_state(scaler=(dynamic(), dynamic())),
            ["state.scaler differs in type: DynamicLossScale in the checkpoint"],
        ),
    ],
    ids=["width", "dtype", "extra-param", "missing-param", "optimizer", "scaler-settings", "scaler-tuple"],
)
def test_a_target_that_does_not_fit_is_refused_at_its_first_difference(
    saved: tuple[fmp.TrainState, Path], target: fmp.TrainState, fragments: list[str]
) -> None:
    _, path = saved
    for candidate in (target, meta(target)):
        with pytest.raises(ValueError, match="does not fit the target") as error:
            load(path, candidate)
        refused(error, *fragments, "build the target as the checkpoint's run built its state")


def raw_dynamic(scale: float, tracker: int = 0) -> fmp.DynamicLossScale:
    return fmp.DynamicLossScale(
        torch.tensor(scale), torch.tensor(tracker, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)
    )


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        *[
            (lambda s, v=v: s._replace(scaler=raw_dynamic(v)), "state.scaler.loss_scale must be a finite scale")
            for v in (float("nan"), float("inf"), 0.0, -2.0)
        ],
        (
            lambda s: s._replace(scaler=raw_dynamic(2.0, tracker=5000)),
            "state.scaler.growth_tracker must lie in [0, 1999]",
        ),
        (
            lambda s: s._replace(scaler=(raw_dynamic(2.0), fmp.StaticLossScale(torch.tensor(-1.0)))),
            "state.scaler[1].loss_scale must be a finite scale",
        ),
        (
            lambda s: s._replace(counts=s.counts._replace(skipped=torch.tensor(-1))),
            "state.counts.skipped must lie in [0,",
        ),
        (
            lambda s: s._replace(counts=s.counts._replace(applied=torch.tensor(1.0))),
            "state.counts.applied must be an integer tensor, got torch.float32",
        ),
        (
            lambda s: s._replace(opt_state=s.opt_state._replace(step=torch.tensor(-3, dtype=torch.int32))),
            "state.opt_state.step must lie in [0,",
        ),
    ],
    ids=["nan", "inf", "zero", "negative", "tracker", "second-scaler", "counts", "float-counter", "adam-step"],
)
def test_a_saved_scale_or_counter_out_of_range_is_refused_naming_the_field(
    edit: Any, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = edit(make_state(scaler=raw_dynamic(2.0)))
    with pytest.raises(ValueError) as error:
        save(bad, tmp_path / "bad.pt")
    refused(error, fragment)
    with monkeypatch.context() as patch:  # a file written by a save that did not check: an edited one
        patch.setattr(fmp.serialization._file, "check_values", lambda state: None)
        save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError) as error:
        load(tmp_path / "bad.pt", bad)  # a target alike, so only the values are wrong
    refused(error, f"checkpoint {tmp_path / 'bad.pt'}: {fragment}")


def test_save_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['epoch'\] is a int; every leaf .* torch.tensor\(x\)"):
        save({"epoch": 3}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match=r"state\.params\['w1'\] is on the meta device"):
        save(meta(make_state()), tmp_path / "c.pt")
    assert os.listdir(tmp_path) == []


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "writer", str(path)], stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved 1"
        deadline, partials = time.monotonic() + 20, []
        while not partials and time.monotonic() < deadline:  # the next save's partial file, mid-write
            partials = [p for p in tmp_path.iterdir() if p.name.endswith(".partial") and p.stat().st_size > 0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert partials, "no save was caught mid-write"
    whole = os.path.getsize(path)
    state = load(path, worker.writer_state(0))
    count = int(state.counts.applied)
    assert count >= 1 and bool((state.params["w"] == count).all())
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert [p.name for p in leftovers] == [partials[0].name]
    assert leftovers[0].name.startswith(f".{path.name}.")  # hidden, and never the checkpoint's own name
    if leftovers[0].stat().st_size < whole:  # cut short: never read as a checkpoint
        with pytest.raises(CheckpointError, match="is truncated or corrupt"):
            load(leftovers[0], state)
    save(state, path)  # the dead writer's partial file goes
    assert os.listdir(tmp_path) == [path.name]


def test_a_save_removes_its_dead_writers_partial_files_and_no_other_checkpoints(tmp_path: Path) -> None:
    host, dead = socket.gethostname(), 2**22 + 1  # above Linux's largest pid: no such process
    own = tmp_path / f".ckpt.{host}.{dead}.a1b2c3d4.partial"
    # A checkpoint named ckpt.HOST.N starts with this one's name and host; its writer's partial is not ours.
    other = tmp_path / f".ckpt.{host}.{dead}.{host}.{dead}.e5f6g7h8.partial"
    for partial in (own, other):
        partial.write_bytes(b"partial")
    save(make_state(), tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", other.name])


def test_a_state_load_would_refuse_is_refused_by_save_naming_the_leaf(tmp_path: Path) -> None:
    state = make_state()
    crafted = state._replace(scaler=replace(state.scaler, loss_scale=state.scaler.loss_scale.double()))
    with pytest.raises(ValueError, match=r"state\.scaler\.loss_scale must be a float32 tensor, got torch\.float64"):
        save(crafted, tmp_path / "crafted.pt")
    sparse = {"emb": torch.eye(3).to_sparse()}
    with pytest.raises(
        TypeError, match=r"state\['emb'\] is a torch\.sparse_coo tensor; .* save state\['emb'\]\.to_dense"
    ):
        save(sparse, tmp_path / "sparse.pt")
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_sharded_state_saved_on_two_ranks_loads_whole_in_one_process(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a free port for the ranks' store
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "sharded", str(rank), "2", str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
        )
        for rank in range(2)
    ]
    try:
        logs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    reference = worker.reference_state()
    results = [torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in range(2)]
    assert [result["local_rows"] for result in results] == [3, 2]  # 5 rows over 2 ranks
    for result in results:  # back into the same sharding on two ranks
        assert_trees_bitwise_equal(result["full"], reference)
    # One process, plain tensors: the shards gathered back whole, into a fresh or an abstract target.
    directory = tmp_path / "checkpoint"
    target = pytree.tree_map(torch.zeros_like, reference)
    assert_trees_bitwise_equal(load_sharded(directory, target), reference)
    assert_trees_bitwise_equal(load_sharded(directory, meta(reference)), reference)
    assert not any(bool(t.any()) for t in pytree.tree_leaves(target))
    wider = reference._replace(params={**reference.params, "w2": torch.zeros(3, 6)})
    with pytest.raises(ValueError) as error:
        load_sharded(directory, wider)
    refused(error, "state.params['w2'] differs in shape: shape (3, 5), float32 in the checkpoint, shape (3, 6)")


def test_a_sharded_save_in_one_process_and_an_unfinished_directory(tmp_path: Path) -> None:
    state = make_state(scaler=(dynamic(), fmp.StaticLossScale.create(4.0)))
    save_sharded(state, tmp_path / "one")
    assert_trees_bitwise_equal(load_sharded(tmp_path / "one", meta(state)), state)
    (tmp_path / "one" / "fmp_checkpoint.json").unlink()  # as a save that died before finishing
    with pytest.raises(CheckpointError) as error:
        load_sharded(tmp_path / "one", state)
    refused(error, "holds no fmp_checkpoint.json: no save_sharded finished writing there")
    bad = state._replace(scaler=(raw_dynamic(float("inf")), state.scaler[1]))
    save_sharded(bad, tmp_path / "bad")
    with pytest.raises(ValueError) as error:
        load_sharded(tmp_path / "bad", bad)
    refused(error, "state.scaler[0].loss_scale must be a finite scale")


DATA = Path(__file__).resolve().parent / "data"  # made by tests/data/make_legacy_checkpoints.py


@pytest.mark.parametrize("commit", ["b733f70", "e53d265"])
def test_states_torch_saved_by_earlier_fmp_versions_load_as_todays_classes(commit: str, tmp_path: Path) -> None:
    # b733f70 wrote fmp.state.TrainState, e53d265 fmp._state.TrainState; both 4 counts, not 6.
    loaded = torch.load(DATA / f"{commit}-torch-save.pt", weights_only=True)
    adam, sgd = loaded["adam"], loaded["sgd"]
    assert type(adam) is fmp.TrainState and type(adam.opt_state) is fmp.optim.AdamState
    assert type(adam.scaler) is fmp.DynamicLossScale and type(adam.accumulator) is fmp.GradientAccumulator
    assert type(sgd.opt_state) is fmp.optim.SgdState and type(sgd.scaler) is fmp.StaticLossScale
    assert type(loaded["ema"]) is fmp.optim.EmaState and type(loaded["rounding"]) is fmp.optim.StochasticRoundingState
    assert type(loaded["noop"]) is fmp.NoOpLossScale
    counts = adam.counts
    assert type(counts) is fmp.StepCounts
    assert [int(c) for c in counts] == [7, 2, 0, 1, 0, 0]  # bad_scale and bad_update: zero
    assert {(c.dtype, c.device, c.dim()) for c in counts} == {(torch.int64, torch.device("cpu"), 0)}
    assert torch.equal(adam.params["w"], torch.arange(3.0))
    counts.check(None)
    # Saved again, the names are today's public ones.
    save(adam, tmp_path / "again.pt")
    assert_trees_bitwise_equal(load(tmp_path / "again.pt", adam), adam)
    # fmp.serialization.load reads only its own format, and says how to read this one.
    with pytest.raises(CheckpointError) as error:
        load(DATA / f"{commit}-torch-save.pt", loaded)
    refused(error, "is not an fmp checkpoint (it holds a dict", "read other files with torch.load")


def test_a_checkpoint_fmp_serialization_saved_under_private_class_names_loads(tmp_path: Path) -> None:
    # 9a0f3df named its classes by their private modules (fmp._state.TrainState) in the pickle and treespec.
    path = DATA / "9a0f3df-fmp-save.pt"
    plain = torch.load(path, weights_only=True)
    assert "fmp._state.TrainState" in plain["treespec"]
    target = torch.load(DATA / "e53d265-torch-save.pt", weights_only=True)  # the same states
    loaded = load(path, meta(target))
    assert_trees_bitwise_equal(loaded, plain["state"])
    assert_trees_bitwise_equal(loaded, target)
    assert type(loaded["adam"]) is fmp.TrainState and type(loaded["adam"].opt_state) is fmp.optim.AdamState


def test_pickles_and_treespecs_use_public_class_names(tmp_path: Path) -> None:
    state = make_state()
    torch.save(state, tmp_path / "plain.pt")
    data = (tmp_path / "plain.pt").read_bytes()
    assert b"fmp._" not in data and b"fmp.optim._" not in data and b"fmp.optim\nAdamState" in data
    assert "fmp._" not in pytree.treespec_dumps(pytree.tree_structure(state))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(where=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=3), bit=st.integers(0, 7))
def test_flipped_bits_anywhere_are_refused_as_corrupt(
    saved: tuple[fmp.TrainState, Path], tmp_path_factory: pytest.TempPathFactory, where: list[float], bit: int
) -> None:
    state, path = saved
    data = bytearray(path.read_bytes())
    for fraction in where:
        data[int(fraction * len(data))] ^= 1 << bit
    bad = tmp_path_factory.mktemp("flip") / "c.pt"
    bad.write_bytes(bytes(data))
    try:
        loaded = load(bad, state)
    except CheckpointError as error:
        assert (
            "truncated or corrupt" in str(error)
            or "not an fmp checkpoint" in str(error)
            or "format version" in str(error)
        )
        return
    except ValueError as error:  # a clean structural refusal names a leaf or node
        assert type(error) is ValueError and "state" in str(error), error
        return
    assert_trees_bitwise_equal(loaded, state)  # a flip in bytes nothing reads (zip padding, a name)


def test_saved_files_get_the_mode_torch_save_gives_or_keep_their_own(tmp_path: Path) -> None:
    umask = os.umask(0o027)
    try:
        save({"x": torch.ones(2)}, tmp_path / "new.pt")
        torch.save({"x": torch.ones(2)}, tmp_path / "torch.pt")
    finally:
        os.umask(umask)
    mode = (tmp_path / "new.pt").stat().st_mode & 0o777
    assert mode == (tmp_path / "torch.pt").stat().st_mode & 0o777 == 0o640
    (tmp_path / "new.pt").chmod(0o604)
    save({"x": torch.ones(2)}, tmp_path / "new.pt")
    assert (tmp_path / "new.pt").stat().st_mode & 0o777 == 0o604


def test_lazily_conjugated_and_negated_leaves_save_as_their_values(tmp_path: Path) -> None:
    z = torch.randn(3, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": z.conj().imag, "expanded": torch.ones(1).expand(4)}
    save(state, tmp_path / "c.pt")
    loaded = load(tmp_path / "c.pt", state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value.resolve_conj().resolve_neg()), key
        assert not loaded[key].is_conj() and not loaded[key].is_neg()


def test_a_damaged_shard_file_or_replicated_leaf_is_a_checkpoint_error(tmp_path: Path) -> None:
    state = make_state(fmp.optim.sgd(0.1))
    save_sharded(state, tmp_path / "cut")
    shard = next((tmp_path / "cut").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError) as error:  # DCP's CheckpointException is a BaseException
        load_sharded(tmp_path / "cut", state)
    refused(error, f"checkpoint {tmp_path / 'cut'} is truncated or corrupt (CheckpointException")
    save_sharded(state, tmp_path / "edited")
    header_file = tmp_path / "edited" / "fmp_checkpoint.json"
    written = header_file.read_text()
    # A changed setting (a flipped digit) reads as damage, not as a target that does not fit.
    header_file.write_text(written.replace("0.25, 7, 1.0", "0.25, 8, 1.0", 1))  # the growth interval
    assert header_file.read_text() != written
    with pytest.raises(CheckpointError) as error:
        load_sharded(tmp_path / "edited", state)
    refused(error, "the sha256 of its fmp_checkpoint.json does not match")
    header = json.loads(written)
    header["replicated_sha256"][".scaler.loss_scale"] = "0" * 64  # a leaf whose bytes changed, the header whole
    header["header_sha256"] = _header_digest(header)
    header_file.write_text(json.dumps(header))
    with pytest.raises(CheckpointError) as error:
        load_sharded(tmp_path / "edited", state)
    refused(error, "the sha256 of state.scaler.loss_scale does not match")
    del header["header_sha256"]  # as checkpoints written before fmp recorded it
    header["replicated_sha256"] = json.loads(written)["replicated_sha256"]
    header_file.write_text(json.dumps(header))
    assert_trees_bitwise_equal(load_sharded(tmp_path / "edited", state), state)


def test_a_legacy_step_counts_of_expanded_views_is_refused_not_padded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Zeros shaped like an expanded field would cost memory that the file never paid for.
    legacy = collections.namedtuple("StepCounts", ["applied", "skipped", "stalled", "calls"])  # type: ignore[misc]
    module = types.ModuleType("fmp.state")
    module.StepCounts = legacy  # type: ignore[attr-defined]
    legacy.__module__ = "fmp.state"
    monkeypatch.setitem(sys.modules, "fmp.state", module)
    huge = torch.zeros((), dtype=torch.int64).expand(2**20)
    torch.save({"counts": legacy(huge, huge, huge, huge)}, tmp_path / "crafted.pt")
    with pytest.raises(pickle.UnpicklingError, match="stored whole"):
        torch.load(tmp_path / "crafted.pt", weights_only=True)
    fine = torch.zeros((), dtype=torch.int64)
    torch.save({"counts": legacy(fine, fine + 1, fine, fine)}, tmp_path / "sound.pt")
    counts = torch.load(tmp_path / "sound.pt", weights_only=True)["counts"]
    assert type(counts) is fmp.StepCounts and [int(c) for c in counts] == [0, 1, 0, 0, 0, 0]
