"""The examples run, small, and say what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_seed_recipe_demo_runs_and_tracks_torch_amp() -> None:
    args = ["--width", "32", "--batch", "16", "--batches", "3", "--epochs", "3"]
    result = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / "seed_recipe.py"), *args],
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
