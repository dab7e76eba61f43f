"""The ensemble and migration examples run, small, and say what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Warnings are errors, as in pytest's own settings, except the one torch's inductor raises at import.
PYTHON = [sys.executable, "-W", "error", "-W", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"]


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [*PYTHON, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def number(pattern: str, out: str) -> float:
    """The number the first group of `pattern` captures in `out`."""
    match = re.search(pattern, out, re.MULTILINE)
    assert match is not None, f"{pattern!r} not in the output:\n{out}"
    return float(match.group(1))


ENSEMBLE_ARGS = ["--members", "3", "--steps", "30", "--width", "16", "--batch", "8", "--growth-interval", "4"]
MEMBER_LINE = re.compile(
    r"^member (\d+): held-out loss (\S+) -> (\S+)  loss scale (\S+)  skipped (\d+) steps$", re.MULTILINE
)


# Member i starts at 2**(8 + 2i) and, over 30 steps, grows every 4 finite steps: 7 times unless it
# skips. Injected every 7th step (6, 13, 20, 27), member 1 skips 4 times, each skip backing off the
# one growth since the last, so it ends where it began; every 5th (4, 9, ..., 29), member 2 skips 6.
@pytest.mark.parametrize(
    ("member", "every", "scales", "skipped"),
    [(1, 7, [2**15, 2**10, 2**19], [0, 4, 0]), (2, 5, [2**15, 2**17, 2**12], [0, 0, 6])],
)
def test_ensemble_members_keep_their_own_scales_and_skips(
    member: int, every: int, scales: list[int], skipped: list[int]
) -> None:
    out = run_example("ensemble_vmap.py", *ENSEMBLE_ARGS, "--inject-member", str(member), "--inject-every", str(every))
    rows = MEMBER_LINE.findall(out)
    assert [int(m) for m, *_ in rows] == [0, 1, 2]
    assert [float(scale) for *_, scale, _ in rows] == scales
    assert [int(n) for *_, n in rows] == skipped
    # Skipped steps leave Adam's step count alone: it counts the applied ones.
    assert f"Adam steps applied per member: {[30 - n for n in skipped]}" in out
    assert "skipped steps kept params and optimizer state bit for bit, applied steps changed them: True" in out
    before, after = [float(b) for _, b, _, _, _ in rows], [float(a) for _, _, a, _, _ in rows]
    assert all(a < 0.9 * b for a, b in zip(after, before, strict=True))  # every member learns...
    assert len(set(after)) == 3  # ...and they are different models
    assert number(r"between two members (\S+)$", out) > 0.1


RESUME_ARGS = ["--steps-before", "6", "--steps-after", "10", "--width", "16", "--batch", "8"]
# Scale 1024, growth every 3 finite steps, an inf at global steps 4, 9 and 14: the checkpoint after
# step 5 holds scale 1024 and growth tracker 1, and steps 6 to 15 use and leave these scales.
RESUMED_SCALES = [(1024, 1024), (1024, 2048), (2048, 2048), (2048, 1024), (1024, 1024)] * 2
STEP_LINE = re.compile(r"^(?:step +\d+)? +(torch\.amp|fmp) +loss +\S+  scale (\S+) -> (\S+)", re.MULTILINE)


def resumed_scales(out: str) -> dict[str, list[tuple[float, float]]]:
    after = out.split("saved to", 1)[1]
    by_run: dict[str, list[tuple[float, float]]] = {"torch.amp": [], "fmp": []}
    for run, used, new in STEP_LINE.findall(after):
        by_run[run].append((float(used), float(new)))
    return by_run


@pytest.mark.parametrize(("optimizer", "rules"), [("adamw", "cuda"), ("sgd", "cpu"), ("adamw", "none")])
def test_resume_from_torch_amp_follows_its_scale_and_round_trips(optimizer: str, rules: str, tmp_path: Path) -> None:
    out = run_example(
        "resume_from_torch_amp.py",
        *RESUME_ARGS,
        "--optimizer",
        optimizer,
        "--rules",
        rules,
        "--checkpoint-dir",
        str(tmp_path),
    )
    assert "checkpoint after 6 steps (5 applied)" in out
    scales = resumed_scales(out)
    assert scales["torch.amp"] == scales["fmp"] == RESUMED_SCALES
    assert out.count("(skipped)") == 2
    assert "loss-scale trajectories identical: True (2 growths, 2 backoffs)" in out
    difference = number(r"fmp vs torch.amp: (\S+), tolerance", out)
    moved = number(r"params moved up to (\S+) since", out)
    if rules != "none":  # op by op as autocast: the runs, and so the converted optimizer state, agree bit for bit
        assert difference == 0.0
    else:  # the whole model and the targets cast to bfloat16: well below the movement the training made
        assert 0.0 < difference < 0.1 * moved
    assert "bit for bit: True" in out
    assert "scale 1024, growth tracker 1, equal to the torch.amp run's: True" in out
    # Back to torch.optim: its state equals the torch.amp run's, bit for bit where the runs are.
    state_difference = number(
        r"loaded from fmp's optimizer state: max \|difference\| from the torch.amp run's (\S+),", out
    )
    assert state_difference == 0.0 if rules != "none" else state_difference < 0.1 * moved
    # The state the example saved loads here too, with torch's safe loader.
    state = torch.load(tmp_path / "fmp_state.pt", weights_only=True)
    assert float(state.scaler.loss_scale) == 1024.0 and int(state.scaler.growth_tracker) == 1
    assert int(state.opt_state.step) == 5 + 8  # applied before the checkpoint, then after it
    assert (tmp_path / "torch_amp.pt").is_file()
