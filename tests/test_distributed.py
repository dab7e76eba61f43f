"""fmp.distributed: two gloo ranks on loopback, each a subprocess of the test, bounded in time.

The ranks run tests/_distributed_worker.py; one launch per process group, several checks per
launch, results saved with torch.save and compared here, against one process on the whole batch.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
from conftest import TOLERANCES
from conftest import assert_trees_bitwise_equal
from conftest import assert_trees_close

import fmp
import fmp.distributed

WORLD = 2
WORKER = Path(__file__).resolve().parent / "_distributed_worker.py"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WARNINGS = "error,ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(scenario: str, out: Path, timeout_s: float, exit_codes: tuple[int, ...] = (0, 0)) -> list[Any]:
    """Runs one rank per subprocess; a rank still running after `timeout_s` fails the test (and is killed)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), str(WORLD), str(port), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(WORLD)
    ]
    logs, deadline = [], time.monotonic() + timeout_s
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"scenario {scenario!r} still ran after {timeout_s} s: a collective hung")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = tuple(proc.returncode for proc in procs)
    assert codes == exit_codes, f"scenario {scenario!r} exited with {codes}:\n" + "\n".join(log[-3000:] for log in logs)
    return [torch.load(out / f"{scenario}-{r}.pt", weights_only=False) for r in range(WORLD) if exit_codes[r] == 0]


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("main", tmp_path_factory.mktemp("main"), timeout_s=120)


def one_process(loss_fn: Any = worker.mlp_loss, scalers: int = 1, accumulate: int = 1) -> fmp.TrainState:
    """The reference: one process, every step on the ranks' batches concatenated."""
    state = worker.make_state(scalers, accumulate=accumulate)
    for batch in worker.global_batches(WORLD):
        state, _ = fmp.train_step(loss_fn, state, *batch, policy=worker.F32, optimizer=fmp.optim.adamw(1e-2))
    return state


def test_ranks_stay_bit_identical_and_match_one_process_on_the_whole_batch(main: list[dict[str, Any]]) -> None:
    rank0, rank1 = main
    for key in ("f32", "bf16", "f16", "two_losses", "accumulate", "f32_eager_collectives"):
        assert_trees_bitwise_equal(rank0[key], rank1[key])
    for key, reference in (("f32", one_process()), ("accumulate", one_process(accumulate=2))):
        assert_trees_close(rank0[key].params, reference.params, **TOLERANCES[torch.float32])
        assert_trees_close(rank0[key].opt_state, reference.opt_state, **TOLERANCES[torch.float32])
        assert_trees_bitwise_equal((rank0[key].scaler, rank0[key].counts), (reference.scaler, reference.counts))
    # Accumulating 2 micro-batches: the poisoned one (the 3rd) skips the 2nd of 3 optimizer steps.
    assert (int(rank0["accumulate"].counts.applied), int(rank0["accumulate"].counts.skipped)) == (2, 1)
    # Eager collectives (dist.all_reduce) sum exactly as the functional ones.
    assert_trees_bitwise_equal(rank0["f32"], rank0["f32_eager_collectives"])


def test_every_rank_reports_the_norm_of_the_averaged_gradients(main: list[dict[str, Any]]) -> None:
    rank0, rank1 = main
    assert_trees_bitwise_equal(rank0["grad_norms"], rank1["grad_norms"])
    state, reference = worker.make_state(), []
    for batch in worker.global_batches(WORLD):
        state, info = fmp.train_step(
            worker.mlp_loss, state, *batch, policy=worker.F32, optimizer=fmp.optim.adamw(1e-2), grad_norm=True
        )
        reference.append(info.grad_norm)
    # Step 2 overflows on rank 1 only; both ranks report the averaged gradients' non-finite norm.
    assert rank0["grad_norms"].isfinite().tolist() == [True, True, False, True, True, True]
    finite = rank0["grad_norms"].isfinite()
    torch.testing.assert_close(rank0["grad_norms"][finite], torch.stack(reference)[finite], **TOLERANCES[torch.float32])


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(main: list[dict[str, Any]]) -> None:
    # The inf sits in rank 1's rows of step 2 only; rank 0's own gradients were finite.
    for result in main:
        for key in ("f32", "bf16", "f16"):
            state = result[key]
            assert (int(state.counts.applied), int(state.counts.skipped)) == (worker.STEPS - 1, 1)
            # 2**10, grown at steps 1 and 5 (every 2 finite steps), backed off once at step 2.
            assert float(state.scaler.loss_scale) == 2.0**11
    # Two losses: only the first overflowed (the inf is in its targets); only its scale backs off, everywhere.
    reference = one_process(worker.two_losses, scalers=2)
    for result in main:
        state = result["two_losses"]
        assert [float(s.loss_scale) for s in state.scaler] == [float(s.loss_scale) for s in reference.scaler]
        assert [float(s.loss_scale) for s in state.scaler] == [2.0**11, 2.0**13]
        assert_trees_close(state.params, reference.params, **TOLERANCES[torch.float32])


def test_reduce_in_bfloat16_costs_the_documented_accuracy_and_the_default_is_exact(main: list[dict[str, Any]]) -> None:
    errors = main[0]["errors"]
    assert errors == main[1]["errors"]
    # Relative error (L2) of the 2-rank mean of N(0, 1) gradients against a float64 mean.
    assert errors["float32"] < 2**-23  # the default, the param dtype: float32 rounding only
    assert 2**-10 < errors["bfloat16"] < 2**-8  # measured 2.5e-3: 8 significant bits
    assert errors["float16"] < 2**-11  # measured 3.1e-4
    # float16 travels scaled by the loss scale: gradients of 2**-26 survive, unscaled they flush to zero.
    assert errors["float16_tiny_scaled"] < 2**-11 and errors["float16_tiny_unscaled"] > 0.9
    # Six AdamW steps in bfloat16 compute: the reduce dtype moves the params by far less than bf16's epsilon.
    assert errors["params_after_training"] < 2**-10
    policy = fmp.get_policy("p=f32,c=bf16,o=f32")
    assert policy.effective_reduce_dtype == torch.float32
    assert_trees_close(main[0]["bf16"].params, main[0]["f32"].params, **TOLERANCES[torch.bfloat16])


def test_a_float16_average_that_overflows_drops_every_flag_and_an_unscaled_loss_travels_unscaled(
    main: list[dict[str, Any]],
) -> None:
    # Finite on every rank, 70000 each: the float16 sum overflows, so no loss's scale is to blame alone.
    for result in main:
        assert result["float16_overflow"] == {"grads_finite": False, "finite_per_loss": [False, False]}
        # With a NoOpLossScale beside a scale of 2**16, float16 carries the gradients at scale 1.
        assert result["unscaled_loss_on_the_wire"] is True


def test_hundreds_of_parameters_take_one_all_reduce(main: list[dict[str, Any]]) -> None:
    rank0, rank1 = main
    (state, calls), (small_state, small_calls) = rank0["many_params"], rank0["many_params_small_buckets"]
    assert calls == 1  # 240 gradients of 512 bytes, and the flags, in one 25 MiB bucket
    assert small_calls == 12  # 10 KiB buckets: 20 gradients each
    assert_trees_bitwise_equal(state, small_state)
    assert_trees_bitwise_equal(state, rank0["many_params_eager"])
    assert_trees_bitwise_equal(state, rank1["many_params"][0])


def test_misuse_is_named(main: list[dict[str, Any]]) -> None:
    rank0, rank1 = main
    assert (
        "different layouts: rank 0 has ['w']: torch.float32[2] where rank 1 has ['w']: torch.float32[3]"
        in (rank0["layout_error"])
    )
    assert rank1["values_error"] == "check_replicas: tree['w'] differs between rank 0 and ranks [1]"
    assert rank1["order_error"] == "check_replicas: tree['w'] differs between rank 0 and ranks [1]"  # same sum
    assert rank1["cancelling_error"] == "check_replicas: tree['w'] differs between rank 0 and ranks [1]"
    assert "rank 1 has .accumulator.steps: 3 where rank 0 has .accumulator.steps: 2" in rank1["static_error"]
    square = torch.arange(12.0).reshape(3, 4)
    assert all(torch.equal(rank["strided"]["w"], square) for rank in main)
    assert "global rank 1) is not a member of the group" in rank1["group_error"]


def test_fsdp2_shards_and_reduces_while_fmp_scales_and_agrees_on_the_skip(main: list[dict[str, Any]]) -> None:
    # The inf went into rank 1's shard only: rank 0 skipped too, by the agreed flag.
    rank0, rank1 = (result["fsdp2"] for result in main)
    assert rank0["local_rows"] == rank1["local_rows"] == 4  # w1's 8 rows, sharded
    assert "is a DTensor; pass the local shards" in rank0["dtensor_error"]
    assert_trees_bitwise_equal(rank0, rank1)
    reference = one_process()
    assert_trees_bitwise_equal(rank0["scaler"], reference.scaler)
    assert_trees_close(rank0["params"], reference.params, **TOLERANCES[torch.float32])


def test_a_dead_or_stalled_rank_fails_the_others_in_bounded_time(tmp_path: Path) -> None:
    # Rank 1 stalls through rank 0's first all-reduce (3 s group timeout), then exits after one step.
    (results,) = launch("failures", tmp_path, timeout_s=60, exit_codes=(0, 3))
    stall, dead = results["stall"], results["dead"]
    assert "Timed out" in stall["error"] and "did not reach this collective" in stall["error"]
    assert worker.STALL_TIMEOUT_S <= stall["seconds"] < worker.STALL_TIMEOUT_S + 15
    assert "A rank died" in dead["error"] and dead["seconds"] < 10


@pytest.mark.compiled
def test_the_step_compiles_whole_with_its_collectives(tmp_path: Path) -> None:
    # fullgraph=True, error_on_recompile: one graph for every step, the skipped one included.
    rank0, rank1 = launch("compiled", tmp_path, timeout_s=300)
    assert rank0["graphs"] == rank1["graphs"] == 1
    assert_trees_bitwise_equal(rank0["state"], rank1["state"])
    assert int(rank0["state"].counts.skipped) == 1
    assert_trees_bitwise_equal(rank0["state"].scaler, rank0["eager"].scaler)
    assert_trees_close(rank0["state"].params, rank0["eager"].params, **TOLERANCES[torch.float32])


def test_ddp_example_prints_identical_replicas() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    command += [str(EXAMPLES / "ddp_train.py"), "--steps", "4", "--width", "16", "--timeout", "30"]
    env = {**os.environ, "PYTHONWARNINGS": WARNINGS, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = re.findall(r"^rank (\d+) params checksum: (\S+) scale: (\S+) skipped: (\d+)$", result.stdout, re.M)
    assert [int(rank) for rank, *_ in lines] == list(range(WORLD))
    assert len({tuple(line[1:]) for line in lines}) == 1  # identical checksums, scales and skips
    assert lines[0][2:] == ("2048", "1")  # 4096, backed off once at the poisoned step 3


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """A one-rank gloo group in this process (no network), for the checks that need a group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_the_step_says_so() -> None:
    state = worker.make_state()
    x, y = worker.global_batches(1, poison=None)[0]
    step = functools.partial(fmp.distributed.train_step, worker.mlp_loss, policy=worker.F32)
    with pytest.raises(
        RuntimeError, match=r"needs an initialized process group: call torch\.distributed\.init_process"
    ):
        step(state, x, y, optimizer=fmp.optim.adamw(1e-2))


def test_one_rank_is_the_local_step_and_bad_arguments_are_named(group_of_one: None) -> None:
    state, optimizer = worker.make_state(), fmp.optim.adamw(1e-2)
    for x, y in worker.global_batches(1, poison=(2, 0)):
        local, _ = fmp.train_step(worker.mlp_loss, state, x, y, policy=worker.F32, optimizer=optimizer)
        state, _ = fmp.distributed.train_step(worker.mlp_loss, state, x, y, policy=worker.F32, optimizer=optimizer)
        assert_trees_bitwise_equal(state, local)
    finite = torch.ones((), dtype=torch.bool)
    gradients = fmp.Gradients({"w": torch.ones(3)}, finite, (), (), finite)
    reduce = functools.partial(fmp.distributed.all_reduce_gradients, policy=worker.F32)
    with pytest.raises(
        ValueError, match=r"gradients.finite_per_loss must be a 0-dim bool tensor .* dtype=torch.float32"
    ):
        reduce(gradients._replace(finite_per_loss=torch.ones(())))
    with pytest.raises(TypeError, match=r"grads\['w'\] is torch.int64; gradients must be floating or complex"):
        reduce(gradients._replace(grads={"w": torch.ones(3, dtype=torch.long)}))
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be in \(0.0, inf\)"):
        reduce(gradients, bucket_cap_mb=0)
    with pytest.raises(TypeError, match=r"loss_scale must be a 0-dim floating tensor such as scaler\.loss_scale"):
        reduce(gradients, loss_scale=fmp.DynamicLossScale.create())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collectives must be 'functional' or 'eager'"):
        reduce(gradients, collectives="nccl")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup or None, got str"):
        reduce(gradients, group="world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"src must be a rank of the group, in \[0, 1\), got 1"):
        fmp.distributed.broadcast_tree({"w": torch.ones(2)}, src=1)
    # Complex gradients keep their precision; a no-gradient tree still carries its flags.
    complex_grads = {"z": torch.tensor([1 + 2j, 3 - 1j]), "w": torch.ones(3)}
    out = reduce(gradients._replace(grads=complex_grads), policy=fmp.get_policy("r=bf16"))
    assert_trees_bitwise_equal(out.grads, complex_grads)
    empty = reduce(gradients._replace(grads={}, grads_finite=~finite, finite_per_loss=~finite))
    assert not bool(empty.grads_finite) and not bool(empty.finite_per_loss)


def test_one_rank_gets_its_own_fp8_amaxes_back(group_of_one: None) -> None:
    # Each rank's amaxes go in a row of its own, which a group of one reads back as they were.
    finite = torch.ones((), dtype=torch.bool)
    amaxes = {"0": torch.tensor([1.0, 2.0, 3.0]), "2": torch.tensor([0.5, 4.0, 8.0])}
    gradients = fmp.Gradients({"w": torch.ones(3)}, finite, (), (), finite, amaxes)
    reduced = fmp.distributed.all_reduce_gradients(gradients, policy=worker.F32)
    assert_trees_bitwise_equal(reduced.amaxes, amaxes)


def test_agreeing_on_flags_takes_either_kind_of_collective(group_of_one: None) -> None:
    flags = (torch.ones((), dtype=torch.bool), torch.zeros((), dtype=torch.bool))
    for collectives in ("functional", "eager"):
        agreed = fmp.distributed.agree_finite(flags, collectives=collectives)  # type: ignore[arg-type]
        assert [bool(f) for f in agreed] == [True, False]
        scaler = fmp.DynamicLossScale.create(init_scale=8.0)
        grads, finite, _, new = fmp.distributed.unscale_and_adjust(
            scaler,
            {"w": torch.full((2,), 16.0)},
            collectives=collectives,  # type: ignore[arg-type]
        )
        assert bool(finite) and grads["w"].tolist() == [2.0, 2.0] and float(new.loss_scale) == 8.0
    with pytest.raises(ValueError, match="collectives must be 'functional' or 'eager'"):
        fmp.distributed.agree_finite(flags, collectives="nccl")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler must be an fmp loss-scale state"):
        fmp.distributed.train_step(
            worker.mlp_loss, worker.make_state()._replace(scaler=3), *worker.global_batches(1, poison=None)[0],
            policy=worker.F32, optimizer=fmp.optim.adamw(1e-2),
        )  # fmt: skip


def test_fp8_amaxes_are_the_maximum_over_ranks_and_the_states_stay_identical(main: list[dict[str, Any]]) -> None:
    rank0, rank1 = main
    assert_trees_bitwise_equal(rank0["fp8"], rank1["fp8"])
    reference = worker.fp8_train(None, WORLD)  # one process on the ranks' rows together
    first, one = rank0["fp8"][0].fp8, reference[0].fp8
    for name in ("0", "2"):
        # The input's and the weight's amaxes are the whole batch's; each rank's output gradient is of
        # its own rows' mean loss, twice the whole batch's mean: the maximum over ranks is twice its amax.
        assert torch.equal(first[name].amax_history[-1, :2], one[name].amax_history[-1, :2])
        torch.testing.assert_close(
            first[name].amax_history[-1, 2], 2 * one[name].amax_history[-1, 2], rtol=1e-6, atol=0
        )
    # Step 2 overflows on rank 1 alone: every rank skips it and keeps its FP8 states.
    assert_trees_bitwise_equal(rank0["fp8"][2].fp8, rank0["fp8"][1].fp8)
    assert (int(rank0["fp8"][-1].counts.applied), int(rank0["fp8"][-1].counts.skipped)) == (worker.STEPS - 1, 1)
