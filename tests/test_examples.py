"""The examples run, small, and say what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Warnings are errors, as in pytest's own settings, except the one torch's inductor raises at import.
PYTHON = [sys.executable, "-W", "error", "-W", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"]


def run_example(script: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*PYTHON, str(EXAMPLES / script), *args]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=300, env=env)


def test_seed_recipe_demo_runs_and_tracks_torch_amp() -> None:
    result = run_example("seed_recipe.py", ["--width", "32", "--batch", "16", "--batches", "3", "--epochs", "3"])
    rows = re.findall(r"^\s*(\S+) epoch (\d): loss (\S+)  loss scale (\S+)$", result.stdout, re.MULTILINE)
    by_run: dict[str, list[tuple[float, float]]] = {}
    for run, _, loss, scale in rows:
        by_run.setdefault(run, []).append((float(loss), float(scale)))
    assert set(by_run) == {"fp32", "torch.amp", "fmp", "fmp.autograd"} and all(len(h) == 3 for h in by_run.values())
    assert by_run["fmp.autograd"] == by_run["torch.amp"]  # the recipe's own loop with fmp: bit for bit
    assert [s for _, s in by_run["fmp"]] == [s for _, s in by_run["torch.amp"]] == [2.0**17, 2.0**18, 2.0**19]
    for (fmp_loss, _), (amp_loss, _) in zip(by_run["fmp"], by_run["torch.amp"], strict=True):
        assert abs(fmp_loss - amp_loss) <= 3e-2 * abs(amp_loss)
    assert "fmp / torch.amp time:" in result.stdout and "fmp.autograd / torch.amp:" in result.stdout


@pytest.mark.compiled
def test_quickstart_snippet_runs_compiled() -> None:
    # The README's quickstart is this file (tests/test_docs.py checks it); the docs' other snippets
    # run eager in tests/test_docs.py, this one with its compiled step.
    script = EXAMPLES / "snippets" / "quickstart.py"
    result = subprocess.run([*PYTHON, str(script)], capture_output=True, text=True, check=True, timeout=300)
    loss, scale = result.stdout.split()[-2:]
    assert float(loss) > 0 and float(scale) == 2.0**16


def run_transformer_lm(plot: Path, env: dict[str, str] | None = None, *extra: str) -> str:
    args = ["--steps", "6", "--accumulate", "2", "--poison-step", "3", "--growth-interval", "2", "--layers", "1"]
    args += ["--width", "32", "--length", "16", "--batch", "8", "--plot", str(plot), *extra]
    result = run_example("transformer_lm.py", args, env)
    assert re.search(r"6/6 \[.*loss=\S+, grad_norm=\S+, scale=\S+, skipped=1\]", result.stderr)  # the progress bar
    return result.stdout


def test_transformer_lm_skips_the_poisoned_step_saves_its_plot_and_trains_the_same_with_remat(tmp_path: Path) -> None:
    stdout = run_transformer_lm(tmp_path / "lm.png")
    # Scale 2**16 grows after steps 2 and 5 (two finite steps each) and backs off once for step 3.
    assert "steps applied 5 skipped 1; final loss scale 131072;" in stdout
    first, last = map(float, re.findall(r"first step (\S+) .* last applied steps (\S+)", stdout)[0])
    assert last < first
    assert f"plot saved to {tmp_path / 'lm.png'}" in stdout
    assert (tmp_path / "lm.png").read_bytes().startswith(b"\x89PNG")
    # The located report names the poison among the inputs, and every parameter's gradient.
    report = stdout.split("the poisoned micro-batch, located ", 1)[1]
    assert report.startswith("at loss scale 131072, loss nan:\n  inputs already not finite: args[2]\n")
    assert "gradients not finite (the step skips): params['tokens.weight']" in report
    # Recomputing each block in the backward pass changes no gradient: the same losses, digit for digit.
    remat = run_transformer_lm(tmp_path / "remat.png", None, "--remat")
    assert re.findall(r"loss: .*", remat) == re.findall(r"loss: .*", stdout)


def test_transformer_lm_trains_bfloat16_params_and_runs_without_matplotlib(tmp_path: Path) -> None:
    # One run for both (each costs a process and a compile): matplotlib hidden, the plot is skipped.
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(stub.parent)}
    stdout = run_transformer_lm(tmp_path / "lm.png", env, "--bf16-params")
    assert "policy params=bfloat16,compute=bfloat16,output=float32" in stdout
    assert "steps applied 5 skipped 1; final loss scale 131072;" in stdout
    first, last = map(float, re.findall(r"first step (\S+) .* last applied steps (\S+)", stdout)[0])
    assert last < first
    assert "matplotlib is not installed: no plot saved to" in stdout and not (tmp_path / "lm.png").exists()


def test_fp8_lm_trains_within_a_stated_margin_of_bfloat16_and_plots_both(tmp_path: Path) -> None:
    plot = tmp_path / "fp8.png"
    result = run_example("fp8_lm.py", ["--steps", "40", "--plot", str(plot)])
    losses = re.search(r"bfloat16 (\S+), fp8 delayed (\S+)$", result.stdout, re.MULTILINE)
    assert losses is not None
    bf16, fp8 = float(losses[1]), float(losses[2])
    assert fp8 < 2.0  # it learned the sequences: log(64) = 4.16 at the start
    assert abs(fp8 - bf16) <= 0.02 * bf16
    assert plot.exists() or "matplotlib is not installed" in result.stdout
