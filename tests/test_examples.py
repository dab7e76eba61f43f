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
def test_readme_quickstart_and_then_its_fast_path_run() -> None:
    # One process for both: the fast path continues the quickstart's session, and a second
    # process would compile the quickstart's step again (25 s cold).
    readme = (EXAMPLES.parent / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    fast_path = readme.split("## The fast path", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    check = "print(int(state.opt_state.step), float(info.loss_scale))"
    script = "\n".join([quickstart, fast_path, check])
    result = subprocess.run([*PYTHON, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    # The quickstart prints the loss and the scale, then the check the steps and the scale.
    words = result.stdout.split()
    (loss, scale), (steps, fast_path_scale) = words[:2], words[-2:]
    assert float(loss) > 0 and float(scale) == 2.0**16
    assert int(steps) == 11 and float(fast_path_scale) == 2.0**16


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


def test_readme_training_loop_runs_after_the_quickstart() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    # The quickstart's step runs eager here: the loop below is the subject, and a compile costs 20 s.
    eager = "import torch\ntorch.compile = lambda fn, **options: fn\n"
    loop = readme.split("## A real training loop", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run(
        [*PYTHON, "-c", eager + quickstart + loop], capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.split()[-3:] == ["2", "0", "2"]


@pytest.mark.compiled
def test_readme_gradient_buffer_loop_runs_and_skips_the_overflow() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme.split("### Gradients in one buffer", 1)[1]
    loop = section.split("```python\n", 1)[1].split("```", 1)[0]
    setup = (
        "import torch\nfrom torch import nn\nimport fmp\ntorch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))\n"
        "data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]\n"
        "data[2][0][0, 0] = float('inf')\n"
        "before = [p.detach().clone() for p in model.parameters()]\n"
    )
    check = (
        "print(float(scaler.loss_scale), all(bool(p.isfinite().all()) for p in model.parameters()),"
        " all(not torch.equal(p, q) for p, q in zip(model.parameters(), before)))\n"
    )
    result = subprocess.run(
        [*PYTHON, "-c", setup + loop + check], capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.split() == [str(2.0**15), "True", "True"]  # one back-off; the params trained and stayed finite


def test_readme_real_models_section_runs_after_the_quickstart() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    real_models = readme.split("## Real models", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    # The quickstart's step compiles: run its loop eager here, the section's own steps are eager.
    quickstart = quickstart.replace("step = torch.compile(", "step = (").replace(", fullgraph=True)", ")")
    check = "print(int(cnn_state.counts.applied), int(cnn[1].num_batches_tracked))"
    result = subprocess.run(
        [*PYTHON, "-c", "\n".join([quickstart, real_models, check])],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert result.stdout.split()[-2:] == ["3", "3"]
