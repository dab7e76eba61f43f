"""The fine-tuning and BatchNorm examples run, small and in process, and leave trained modules behind."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cnn_batchnorm
import finetune_hf
import pytest
import torch

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run(main: Callable[[list[str]], Any], *args: str) -> Any:
    """`main(args)` on one thread (2 cores, maybe shared), leaving the thread count and the global RNG as they were."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            return main([*args, "--threads", "1", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)


def assert_png(path: Path) -> None:
    if HAS_MATPLOTLIB:
        assert path.read_bytes().startswith(b"\x89PNG")
    else:
        assert not path.exists()


HF_ARGS = ["--steps", "12", "--batch-size", "4", "--seq-len", "32", "--log-every", "4", "--sample", "8"]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """One small default fine-tune, its plot and its saved directory, shared by the tests below."""
    out = tmp_path_factory.mktemp("finetune")
    plot, saved = out / "finetune.png", out / "saved"
    result = run(finetune_hf.main, *HF_ARGS, "--growth-interval", "5", "--plot", str(plot), "--save", str(saved))
    return result, plot, saved


def test_finetune_hf_loss_falls_and_the_scale_grows(finetuned: tuple[Any, Path, Path]) -> None:
    result, plot, _ = finetuned
    assert len(result.losses) == 12 and all(result.applied)  # bfloat16 compute: nothing overflows
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.5  # from log(256) = 5.5
    state = result.state
    assert (int(state.counts.applied), int(state.counts.skipped)) == (12, 0)
    # Doubled after every 5 finite steps: the scale used at steps 1-5, 6-10, 11-12, and the one after.
    assert result.scales == [2.0**16] * 5 + [2.0**17] * 5 + [2.0**18] * 2
    assert float(state.scaler.loss_scale) == 2.0**18
    assert_png(plot)


def test_finetune_hf_writes_the_trained_weights_back_into_the_module(finetuned: tuple[Any, Path, Path]) -> None:
    result, _, _ = finetuned
    model, params = result.model, result.state.params
    initial = finetune_hf.tiny_gpt2(seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied, and trained once
    assert "lm_head.weight" not in params and "transformer.wte.weight" in params
    for name, value in params.items():
        assert torch.equal(model.get_parameter(name), value), name
        assert not torch.equal(initial.get_parameter(name), value), f"{name} was not trained"
    assert model.training
    # The module's own forward pass, float32 and eval mode, on a fixed batch: it learnt too.
    assert result.module_loss_after < result.module_loss_before - 0.5


def test_finetune_hf_saves_a_model_that_loads_and_fine_tunes_again(finetuned: tuple[Any, Path, Path]) -> None:
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    result, _, saved = finetuned
    loaded = AutoModelForCausalLM.from_pretrained(saved, local_files_only=True)
    trained = result.model.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(value, trained[name]) for name, value in loaded.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    text = "Bytes: é\n\t~"
    assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text

    # --model PATH: the same fixed batch (same seed and sizes) gives the saved model's loss before training.
    again = run(finetune_hf.main, *HF_ARGS[:-2], "--sample", "0", "--steps", "2", "--model", str(saved))
    assert again.module_loss_before == pytest.approx(result.module_loss_after, rel=1e-5)
    assert all(again.applied) and all(torch.isfinite(torch.tensor(again.losses)))


def test_finetune_hf_trains_on_a_text_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("abcd" * 5)  # 20 bytes: repeated to fill a window of 32
    result = run(finetune_hf.main, "--text", str(text), "--steps", "8", "--batch-size", "4", "--seq-len", "32")
    assert "; 40 tokens of text;" in capsys.readouterr().out
    assert result.losses[-1] < result.losses[0] - 1.0


CNN_ARGS = ["--steps", "60", "--batch-size", "32", "--width", "8", "--signal", "2.5", "--growth-interval", "20"]
CNN_ARGS += ["--eval-every", "20", "--eval-size", "128", "--log-every", "20"]


def test_cnn_batchnorm_trains_and_evaluates_with_its_running_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(cnn_batchnorm.main, *CNN_ARGS, "--plot", str(tmp_path / "cnn.png"))
    out = capsys.readouterr().out
    losses, state, model = result.losses, result.state, result.model
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3
    assert (int(state.counts.applied), int(state.counts.skipped)) == (60, 0)
    assert float(state.scaler.loss_scale) == 2.0**19  # doubled every 20 finite steps
    assert [step for step, _, _ in result.evals] == [0, 20, 40, 60]
    (_, loss_before, accuracy_before), (_, loss_after, accuracy_after) = result.evals[0], result.evals[-1]
    assert accuracy_before < 0.4 and accuracy_after > 0.5 and loss_after < loss_before
    # Without the running statistics the step kept, the trained params do little better than chance.
    assert result.accuracy_initial_statistics < accuracy_after - 0.2
    assert f"accuracy {accuracy_before:.1%} -> {accuracy_after:.1%}" in out
    assert_png(tmp_path / "cnn.png")

    # write_back put the trained params and statistics into the module, left in train mode.
    assert model.training
    initial = cnn_batchnorm.build_resnet_cnn(seed=0, width=8, classes=4).state_dict()
    own = model.state_dict()
    assert state.params.keys() | state.model_state.keys() == own.keys()
    for name, value in {**state.params, **state.model_state}.items():
        assert torch.equal(own[name], value), name
        if name.endswith("num_batches_tracked"):
            assert int(value) == 60
        else:
            assert not torch.equal(initial[name], value), f"{name} did not change"
    assert any(name.endswith("running_var") for name in state.model_state)


def test_bar_images_put_one_bar_of_the_labelled_direction_in_each_image() -> None:
    generator = torch.Generator().manual_seed(0)
    images, labels = cnn_batchnorm.bar_images(generator, 64, image_size=12, length=5, signal=100.0)
    assert images.shape == (64, 3, 12, 12) and set(labels.tolist()) == {0, 1, 2, 3}
    for image, label in zip(images, labels, strict=True):
        rows, cols = (image[0] > 50).nonzero().unbind(1)  # the bar's pixels, far above the unit noise
        assert len(rows) == 5
        direction = {
            (True, False): 0,  # one row: horizontal
            (False, True): 1,  # one column: vertical
        }.get((len(set(rows.tolist())) == 1, len(set(cols.tolist())) == 1))
        if direction is None:  # a diagonal: columns rise with rows, or fall
            direction = 2 if torch.equal(cols - cols[0], rows - rows[0]) else 3
        assert direction == int(label)


@pytest.mark.parametrize("example", [finetune_hf, cnn_batchnorm], ids=["finetune_hf", "cnn_batchnorm"])
def test_plots_mark_skipped_steps_and_need_no_matplotlib(
    example: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    losses, scales, applied = [2.0, float("inf"), 1.0], [2.0**16, 2.0**16, 2.0**15], [True, False, True]
    extra = ["a title"] if example is finetune_hf else [[(0, 1.4, 0.25), (3, 1.0, 0.5)]]
    if HAS_MATPLOTLIB:
        example.save_plot(tmp_path / "plot.png", losses, scales, applied, *extra)
        assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    example.save_plot(tmp_path / "none.png", losses, scales, applied, *extra)
    assert "matplotlib is not installed: no plot saved to" in capsys.readouterr().out
    assert not (tmp_path / "none.png").exists()
