"""Replica agreement: ranks whose states differ in layout raise on every rank, naming the leaf.

Two gloo ranks on loopback run tests/_replica_worker.py once; every check of the run is asserted here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _replica_worker as worker
import pytest
import torch
from conftest import assert_trees_bitwise_equal

import fmp

WORKER = Path(__file__).resolve().parent / "_replica_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results; rank 1 exits early with DEAD_PEER_EXIT, by design."""
    out = tmp_path_factory.mktemp("replicas")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(port), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + 90
    try:
        logs = [proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for proc in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("the replica run still ran after 90 s: a collective hung")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    assert codes == [0, worker.DEAD_PEER_EXIT], f"exit codes {codes}:\n" + "\n".join(log[-3000:] for log in logs)
    return [torch.load(out / f"replicas-{rank}.pt", weights_only=False) for rank in range(2)]


PREFIX = "fmp.distributed.train_step: the ranks hold trees of different layouts: "


def test_same_size_other_shape_is_named_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (result["shape"] for result in ranks)
    assert rank0.startswith(PREFIX + "rank 0 has state.params['w']: torch.float32[2, 3] where rank 1 has ")
    assert rank1.startswith(PREFIX + "rank 1 has state.params['w']: torch.float32[3, 2] where rank 0 has ")
    assert "Every rank must build the same model" in rank0


def test_other_sizes_raise_instead_of_aborting(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["size"].startswith(PREFIX + "rank 0 has state.params['w']: torch.float32[2, 3] where rank 1")
    assert ranks[1]["size"].startswith(PREFIX + "rank 1 has state.params['w']: torch.float32[4, 3] where rank 0")
    assert "rank 1 has ['w']: torch.int32[3] where rank 0 has ['w']: torch.float32[3]" in ranks[1]["dtype"]


def test_an_extra_leaf_is_named_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert (
        "rank 0 has no leaf state.params['extra'] where rank 1 has state.params['extra']: torch.float32[2]"
        in (rank0["extra"])
    )
    assert "rank 1 has state.params['extra']: torch.float32[2] where rank 0 has no such leaf" in rank1["extra"]
    assert "rank 1 has ['extra']: torch.float32[2] where rank 0 has no such leaf" in rank1["extra_broadcast"]


def test_another_policy_is_named(ranks: list[dict[str, Any]]) -> None:
    assert "rank 1 has policy: Policy(" in ranks[1]["policy"] and "reduce_dtype=torch.bfloat16" in ranks[1]["policy"]


def test_agreeing_ranks_train_and_check_once(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert rank0["gathers"] == rank1["gathers"] == (1, 0)  # one digest gather at the first step, none after
    assert_trees_bitwise_equal(rank0["state"], rank1["state"])
    assert int(rank0["state"].counts.applied) == 4


def test_a_dead_peer_fails_the_check_at_once(ranks: list[dict[str, Any]]) -> None:
    dead = ranks[0]["dead_peer"]
    assert "train_step's layout check across 2 ranks failed" in dead["error"] and "A rank died" in dead["error"]
    assert dead["seconds"] < 10


def test_a_compiled_step_skips_the_check() -> None:
    # Traced, the check is skipped before it looks for a process group (see check_step_layout).
    state = worker.state_of({"w": torch.ones(3)})
    seen = []

    def traced(state: fmp.TrainState) -> None:
        seen.append(torch.compiler.is_compiling())
        fmp.distributed._replicas.check_step_layout(state, None, worker.F32, 25.0)

    torch.compile(traced, backend="eager", fullgraph=True)(state)
    assert seen == [True]
