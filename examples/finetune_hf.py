"""Fine-tune a Hugging Face causal language model with fmp: 16-bit compute, dynamic loss scaling,
AdamW with gradient clipping and a warmup-cosine learning rate, then the trained weights written
back into the `transformers` module to sample from it and `save_pretrained` it.

By default the model is a tiny GPT-2 made from a config (nothing is downloaded) with a byte-level
tokenizer (one token per byte, built with `tokenizers`), trained on a short text written into this
file; it learns the text by heart, so the loss falls from log(256) = 5.5 to well under 1 and the
sample at the end quotes it. `--model PATH` fine-tunes a model saved on disk instead, with its own
tokenizer (`AutoModelForCausalLM` / `AutoTokenizer`, `local_files_only=True`), for instance the
directory an earlier run wrote with `--save`; `--text FILE` trains on a text file of your own.

    python examples/finetune_hf.py [--steps 300 --compile --plot finetune.png --save tiny-gpt2]
    python examples/finetune_hf.py --model tiny-gpt2 --text notes.txt --lr 1e-4

The step runs the model through `fmp.nn.call` (a functional call with the params and buffers that
`fmp.nn.split` took out of it), so the module keeps its own weights until `fmp.nn.write_back` copies
the trained ones in. On CPU the compute dtype is bfloat16 with torch.autocast's CPU rules (compiled,
the default rules, as the pitfalls page says for attention with dropout), on CUDA float16 with its
CUDA rules (`--compute` picks another); the loss is taken in float32 either way.

The plot (`--plot`) needs matplotlib (`pip install matplotlib`); without it the run says so and goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _plotting import plot_scale
from _plotting import pyplot
from _plotting import save
from _plotting import scale_text
from torch import nn
from tqdm import tqdm

import fmp

TEXT = """\
The lamp at the end of the harbour wall was lit every evening at six, whatever the weather, by a
keeper who had long ago stopped counting the ships. She climbed the ninety steps with a can of oil
and a rag, trimmed the wick, wound the clockwork that turned the lens, and sat by the window with a
cup of tea until the first boat rounded the point. The fishermen said that they could set their
watches by her light, and the few who owned watches did. On clear nights the beam reached the far
shore; on foggy ones it reached no further than the end of the wall, and she rang the bell instead,
twice a minute, until her arms ached and the fog lifted or the morning came. In the spring the
gulls nested on the gallery and complained when she walked past them. In the autumn the storms
came in from the west and threw the sea over the wall, and the whole tower hummed like a struck
glass. She wrote the weather in a book every night, in the same blue ink, in the same small hand:
wind, sea, cloud, and the ships that passed. Nobody ever read the book, and she did not mind.
"""


@dataclasses.dataclass
class Result:
    """What a run leaves: the trained module (weights written back), its state and per-step records."""

    model: nn.Module
    tokenizer: Any
    state: fmp.TrainState
    losses: list[float]
    scales: list[float]
    applied: list[bool]
    module_loss_before: float
    module_loss_after: float
    seconds: float


def byte_tokenizer() -> Any:
    """A tokenizer with one token per byte (id = the byte's value), built offline with `tokenizers`."""
    import tokenizers
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-character table: printable bytes stand for themselves, the rest move past 255.
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    vocab = {chr(b if b in printable else next(shifted)): b for b in range(256)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def tiny_gpt2(*, seed: int = 0, vocab: int = 256, positions: int = 256, layers: int = 2, width: int = 128) -> nn.Module:
    """A small GPT-2 from a config, no download; the same weights for the same seed."""
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel

    # No dropout, and bos/eos inside the vocabulary (GPT-2's default id, 50256, is not in it).
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def load_model(path: Path) -> tuple[nn.Module, Any]:
    """A causal LM and its tokenizer from a local directory, in float32 (the step keeps float32 params)."""
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def token_windows(tokens: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` windows of `seq_len` consecutive tokens at random places in `tokens`."""
    starts = torch.randint(len(tokens) - seq_len + 1, (batch_size,), generator=generator)
    return tokens[starts[:, None] + torch.arange(seq_len)]


@torch.no_grad()
def module_loss(model: nn.Module, input_ids: torch.Tensor) -> float:
    """The module's own next-token loss (its own weights, eval mode, float32)."""
    model.eval()
    loss = float(model(input_ids, labels=input_ids, use_cache=False).loss)
    model.train()
    return loss


@torch.no_grad()
def greedy_sample(model: nn.Module, tokenizer: Any, prompt: str, new_tokens: int, window: int) -> str:
    """The prompt continued by the module's most likely token, `new_tokens` times, seeing `window` tokens back.

    The window is the training sequence length: positions past it were never trained.
    """
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=device)
    for _ in range(new_tokens):
        logits = model(ids[:, -window:], use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    model.train()
    return str(tokenizer.decode(ids[0].tolist()))


def save_plot(
    path: Path, losses: Sequence[float], scales: Sequence[float], applied: Sequence[bool], title: str
) -> None:
    """Loss and loss scale (log base 2) per step, skipped steps marked; a note instead without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return
    steps = range(1, len(losses) + 1)
    figure, (loss_axes, scale_axes) = plt.subplots(2, 1, sharex=True, figsize=(7, 5), height_ratios=[2, 1])
    loss_axes.plot(steps, losses, linewidth=1)
    loss_axes.set_ylabel("training loss")
    loss_axes.set_title(title)
    loss_axes.grid(alpha=0.3)
    plot_scale(scale_axes, scales, applied)
    save(plt, figure, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a local model directory (default: a tiny GPT-2 config)")
    parser.add_argument("--text", type=Path, help="a text file to train on (default: a paragraph in this file)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 3e-3, with --model 5e-5)")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--compute", default="half", help="compute dtype; half: bfloat16 on CPU, float16 on CUDA")
    parser.add_argument("--growth-interval", type=int, default=50, help="finite steps before the scale doubles")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true", help="run the step compiled whole (fmp.compile)")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress-bar updates (a sync)")
    parser.add_argument("--plot", type=Path, help="save a plot of loss and loss scale to this PNG")
    parser.add_argument("--save", type=Path, help="save the fine-tuned model and tokenizer to this directory")
    parser.add_argument("--sample", type=int, default=60, help="tokens to generate after training (0: none)")
    parser.add_argument("--prompt", default="The fishermen said", help="the start of the sample")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (on a busy machine: the free cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> Result:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if args.model is None:
        model, tokenizer = tiny_gpt2(seed=args.seed, positions=max(256, args.seq_len)), byte_tokenizer()
    else:
        model, tokenizer = load_model(args.model)
    model.to(device).train()  # training mode: dropout on in a model that has any
    if hasattr(model, "loss_type"):
        # Named once here; left unset, transformers works it out on every call (a Dynamo warning each time).
        model.loss_type = "ForCausalLM"
    lr = args.lr if args.lr is not None else (3e-3 if args.model is None else 5e-5)

    text = args.text.read_text() if args.text is not None else TEXT
    tokens = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
    if len(tokens) < args.seq_len + 1:  # a short text is repeated to fill one window
        tokens = tokens.repeat(math.ceil((args.seq_len + 1) / len(tokens)))
    generator = torch.Generator().manual_seed(args.seed)
    probe_batch = token_windows(tokens, args.seq_len, args.batch_size, generator).to(device)
    module_loss_before = module_loss(model, probe_batch)

    # The params the optimizer trains (tied weights once: GPT-2's lm_head is its token embedding) and
    # the persistent buffers (none in GPT-2; a BatchNorm model's statistics would go here).
    params, buffers = fmp.nn.split(model)

    def loss_fn(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # transformers shifts the labels itself and takes the cross-entropy in float32.
        out, buffers = fmp.nn.call(model, params, buffers, input_ids, labels=input_ids, use_cache=False)
        return out.loss, buffers

    # torch.autocast's own op lists for the device; compiled on a CPU, fmp's own mode with the default
    # rules, as torch cannot differentiate attention with dropout under torch.func.grad with the CPU ones.
    rules = "cpu" if device.type == "cpu" and not args.compile else "cuda"
    policy = fmp.get_policy(f"params=float32,compute={args.compute},output=float32,rules={rules}", device_type=device)
    schedule = fmp.optim.schedule.warmup_cosine(lr, warmup_steps=max(args.steps // 10, 1), total_steps=args.steps + 1)
    optimizer = fmp.optim.clip_by_global_norm(fmp.optim.adamw(schedule, weight_decay=0.01), args.clip)
    scaler = fmp.DynamicLossScale.create(growth_interval=args.growth_interval)
    state = fmp.TrainState.create(params, optimizer, scaler, model_state=buffers)
    step: Callable[..., tuple[fmp.TrainState, fmp.StepInfo]] = functools.partial(
        fmp.train_step, loss_fn, policy=policy, optimizer=optimizer
    )
    if args.compile:
        step = fmp.compile(step)

    count = sum(p.numel() for p in params.values())
    print(
        f"{type(model).__name__}: {count / 1e6:.2f}M trainable params; {len(tokens)} tokens of text; policy {policy}; "
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, peak lr {lr:g} on {device}"
    )
    # Per-step values stay on the device; reading one syncs, so it happens only for the progress bar.
    losses, scales, applied = [], [], []
    first_seconds, start = 0.0, time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="fine-tune", unit="step", dynamic_ncols=True)
    for i in bar:
        input_ids = token_windows(tokens, args.seq_len, args.batch_size, generator).to(device, non_blocking=True)
        state, info = step(state, input_ids)
        losses.append(info.loss)
        scales.append(info.loss_scale)
        applied.append(info.applied)
        if i == 1:  # reading the loss waits for the step; with --compile the first step compiles it
            float(info.loss)
            first_seconds = time.perf_counter() - start
        if i % args.log_every == 0 or i == args.steps:
            bar.set_postfix(
                loss=f"{float(info.loss):.4f}", scale=f"2^{math.log2(float(info.loss_scale)):.4g}", refresh=False
            )
    bar.close()
    seconds = time.perf_counter() - start
    rest_seconds = (seconds - first_seconds) / max(args.steps - 1, 1)

    # The module still holds its initial weights: copy the trained ones in, then use it as any model.
    fmp.nn.write_back(model, state.params, state.model_state)
    module_loss_after = module_loss(model, probe_batch)
    loss_values = torch.stack(losses).tolist()
    applied_values = torch.stack(applied).tolist()
    kept = [loss for loss, ok in zip(loss_values, applied_values, strict=True) if ok][-10:]
    counts = state.counts
    last = sum(kept) / len(kept) if kept else math.nan
    print(f"train loss: first step {loss_values[0]:.4f}, last {len(kept)} applied steps {last:.4f}")
    print(
        f"steps applied {int(counts.applied)} skipped {int(counts.skipped)}; "
        f"final loss scale {scale_text(float(state.scaler.loss_scale))}; "
        f"{seconds:.1f} s: the first step {first_seconds:.1f} s, then {1000 * rest_seconds:.0f} ms/step"
    )
    print(
        f"the module's own loss on a fixed batch: {module_loss_before:.4f} before training, "
        f"{module_loss_after:.4f} after write_back"
    )
    if args.sample > 0:
        print(f"sample: {greedy_sample(model, tokenizer, args.prompt, args.sample, args.seq_len)!r}")
    if args.plot is not None:
        compute = str(policy.compute_dtype).removeprefix("torch.")
        title = f"{type(model).__name__} fine-tuned with fmp, {compute} compute"
        save_plot(args.plot, loss_values, torch.stack(scales).tolist(), applied_values, title)
    if args.save is not None:
        model.save_pretrained(args.save)
        tokenizer.save_pretrained(args.save)
        print(f"model and tokenizer saved to {args.save}")
    return Result(
        model=model,
        tokenizer=tokenizer,
        state=state,
        losses=loss_values,
        scales=torch.stack(scales).tolist(),
        applied=applied_values,
        module_loss_before=module_loss_before,
        module_loss_after=module_loss_after,
        seconds=seconds,
    )


if __name__ == "__main__":
    main()
