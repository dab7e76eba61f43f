"""The examples run, small, and say what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Warnings are errors, as in pytest's own settings, except the one torch's inductor raises at import.
PYTHON = [sys.executable, "-W", "error", "-W", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"]


def test_seed_recipe_demo_runs_and_tracks_torch_amp() -> None:
    args = ["--width", "32", "--batch", "16", "--batches", "3", "--epochs", "3"]
    result = subprocess.run(
        [*PYTHON, str(EXAMPLES / "seed_recipe.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    rows = re.findall(r"^\s*(\S+) epoch (\d): loss (\S+)  loss scale (\S+)$", result.stdout, re.MULTILINE)
    by_run: dict[str, list[tuple[float, float]]] = {}
    for run, _, loss, scale in rows:
        by_run.setdefault(run, []).append((float(loss), float(scale)))
    assert set(by_run) == {"fp32", "torch.amp", "fmp"} and all(len(h) == 3 for h in by_run.values())
    assert [s for _, s in by_run["fmp"]] == [s for _, s in by_run["torch.amp"]] == [2.0**17, 2.0**18, 2.0**19]
    for (fmp_loss, _), (amp_loss, _) in zip(by_run["fmp"], by_run["torch.amp"], strict=True):
        assert abs(fmp_loss - amp_loss) <= 3e-2 * abs(amp_loss)
    assert "fmp / torch.amp time:" in result.stdout


@pytest.mark.compiled
def test_readme_quickstart_runs() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run([*PYTHON, "-c", quickstart], capture_output=True, text=True, check=True, timeout=300)
    loss, scale = map(float, result.stdout.split())
    assert loss > 0 and scale == 2.0**16


@pytest.mark.compiled
def test_readme_fast_path_runs_after_the_quickstart() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    fast_path = readme.split("## The fast path", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    check = "print(int(state.opt_state.step), float(info.loss_scale))"
    script = "\n".join([quickstart, fast_path, check])
    result = subprocess.run([*PYTHON, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    steps, scale = result.stdout.split()[-2:]
    assert int(steps) == 11 and float(scale) == 2.0**16
