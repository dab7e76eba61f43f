"""A zoo of small real-world model kinds that people train with torch.amp, for tests, benchmarks and examples.

Every model's `forward(*batch)` returns the scalar loss (its criterion is inside), so one training
loop serves every case: `loss = model(*batch)` under `torch.autocast`, or
`torch.func.functional_call(model, (params, buffers), batch)` for a functional step.

Each `ZooCase` pairs a deterministic `build()` (CPU test size by default) with `batch(generator)`,
which draws a fresh batch from the generator. Builders take `seed` and the model's keyword sizes, batch
functions take keyword sizes, so a benchmark makes a bigger case with `dataclasses.replace(case("gpt2"),
build=functools.partial(build_gpt2, width=256), batch=functools.partial(token_batch, batch_size=32))`.

`torch_amp_train` is the reference loop: torch.autocast (bfloat16) + GradScaler + AdamW on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel

Batch = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class ZooCase:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    # vmap(grad(functional_call)) over stacked params and buffers runs, in float32 and under bfloat16
    # autocast, without warnings, inside `vmap_context()` (dropout: with randomness="different").
    vmappable: bool
    notes: str


@contextlib.contextmanager
def vmap_context() -> Iterator[None]:
    """CPU kernels that have vmap batching rules, so vmap needs no (warning) per-sample fallback.

    The fused SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`) and oneDNN's LSTM
    (`mkldnn_rnn_layer`) have none; the math SDPA and the native LSTM decompose into ops that do.
    """
    mkldnn_enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mkldnn.enabled = mkldnn_enabled


def _builder(module: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A build function: `build(seed=0, **sizes)` makes `module(**sizes)`, leaving the global RNG alone."""

    def build(*, seed: int = 0, **sizes: Any) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return module(**sizes)

    return build


def image_batch(generator: torch.Generator, *, batch_size: int = 8, image_size: int = 32, classes: int = 10) -> Batch:
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    return images, torch.randint(classes, (batch_size,), generator=generator)


def token_batch(generator: torch.Generator, *, batch_size: int = 8, seq_len: int = 64, vocab: int = 256) -> Batch:
    return (torch.randint(vocab, (batch_size, seq_len), generator=generator),)


def features_batch(generator: torch.Generator, *, batch_size: int = 16, features: int = 32, outputs: int = 1) -> Batch:
    return torch.randn(batch_size, features, generator=generator), torch.randn(batch_size, outputs, generator=generator)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class ResNetCNN(nn.Module):
    def __init__(self, *, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = BasicBlock(width, width, 1)
        self.block2 = BasicBlock(width, 2 * width, 2)
        # The max-pool branch is there so adaptive_max_pool2d is exercised alongside the average pool.
        self.avgpool, self.maxpool = nn.AdaptiveAvgPool2d(1), nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(F.max_pool2d(self.stem(images), 2)))
        pooled = (self.avgpool(x) + self.maxpool(x)).flatten(1)
        return F.cross_entropy(self.head(pooled), labels)


class HFCausalLM(nn.Module):
    """Wraps a Hugging Face causal LM so that forward(input_ids) returns its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        if hasattr(model, "loss_type"):
            # An explicit loss type; left unset, transformers resolves it on every call (a Dynamo warning).
            model.loss_type = "ForCausalLM"  # type: ignore[assignment]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids, labels=input_ids).loss
        return loss


def _gpt2(*, layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 256) -> nn.Module:
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel

    # Token ids inside the small vocabulary: the defaults (50256) make transformers log a complaint.
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=128,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return HFCausalLM(GPT2LMHeadModel(config))


def _llama(*, layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 256) -> nn.Module:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, num_key_value_heads=heads // 2,
        intermediate_size=2 * width, vocab_size=vocab, max_position_embeddings=128,
    )  # fmt: skip
    return HFCausalLM(LlamaForCausalLM(config))


class RecurrentLM(nn.Module):
    def __init__(self, *, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        hidden, _ = self.gru(hidden)
        return next_token_loss(self.head(hidden), tokens)


class ViTBlock(nn.Module):
    def __init__(
        self, *, width: int = 64, heads: int = 4, patch: int = 8, image_size: int = 32, classes: int = 10
    ) -> None:
        super().__init__()
        self.heads = heads
        self.patchify = nn.Conv2d(3, width, patch, stride=patch)
        self.positions = nn.Parameter(torch.randn((image_size // patch) ** 2, width) * 0.02)
        self.norm1, self.norm2, self.norm_out = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patchify(images).flatten(2).transpose(1, 2) + self.positions
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return F.cross_entropy(self.head(self.norm_out(x).mean(1)), labels)


class SparseBag(nn.Module):
    def __init__(self, *, vocab: int = 1000, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, sparse=True)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.embed(tokens).mean(1)), labels)


def bag_batch(
    generator: torch.Generator, *, batch_size: int = 8, seq_len: int = 16, vocab: int = 1000, classes: int = 10
) -> Batch:
    tokens = torch.randint(vocab, (batch_size, seq_len), generator=generator)
    return tokens, torch.randint(classes, (batch_size,), generator=generator)


class MatMul(torch.autograd.Function):
    """A matmul written as torch's AMP docs show a custom Function (ctx first, no setup_context)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class MatMulFloat32(MatMul):
    """MatMul with `cast_inputs=torch.float32`: float32 inputs, autocast off inside forward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.mm(b)


class CustomFunctionMLP(nn.Module):
    def __init__(self, *, features: int = 32, width: int = 64, cast_inputs: bool = False) -> None:
        super().__init__()
        self.matmul = MatMulFloat32 if cast_inputs else MatMul
        self.fc1 = nn.Linear(features, width)
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.matmul.apply(F.relu(self.fc1(x)), self.weight))
        return F.mse_loss(self.fc2(hidden), y)


class TiedLM(nn.Module):
    def __init__(self, *, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=width**-0.5)  # N(0, 1) would give logits of std ~sqrt(width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied: one Parameter under two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.out(torch.tanh(self.mix(self.embed(tokens)))), tokens)


class FrozenEncoderClassifier(nn.Module):
    def __init__(self, *, features: int = 32, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(features, width), nn.GELU(), nn.Linear(width, width), nn.LayerNorm(width)
        )
        self.encoder.requires_grad_(False)  # a "pretrained" encoder: only the head trains
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(x)), labels)


def labelled_batch(generator: torch.Generator, *, batch_size: int = 16, features: int = 32, classes: int = 10) -> Batch:
    x = torch.randn(batch_size, features, generator=generator)
    return x, torch.randint(classes, (batch_size,), generator=generator)


class DropoutMLP(nn.Module):
    def __init__(self, *, features: int = 32, width: int = 64, p: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, width), nn.ReLU(), nn.Dropout(p),
            nn.Linear(width, width), nn.ReLU(), nn.Dropout(p), nn.Linear(width, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


class BiasedAttentionLM(nn.Module):
    """T5-style attention: a learned float bias per head and position pair as SDPA's mask, dropout inside SDPA."""

    def __init__(self, *, vocab: int = 64, width: int = 32, heads: int = 4, seq_len: int = 16, dropout: float = 0.1):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.embed = nn.Embedding(vocab, width)
        self.position_bias = nn.Parameter(torch.randn(heads, seq_len, seq_len) * 0.02)
        self.norm, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=self.position_bias, dropout_p=p)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return next_token_loss(self.head(x), tokens)


build_resnet_cnn = _builder(ResNetCNN)
build_gpt2 = _builder(_gpt2)
build_llama = _builder(_llama)
build_lstm = _builder(RecurrentLM)
build_vit_block = _builder(ViTBlock)
build_sparse_embedding = _builder(SparseBag)
build_custom_fwd = _builder(CustomFunctionMLP)
build_tied_embeddings = _builder(TiedLM)
build_frozen_submodule = _builder(FrozenEncoderClassifier)
build_dropout = _builder(DropoutMLP)
build_biased_attention = _builder(BiasedAttentionLM)

_SDPA_NOTE = " Under vmap needs vmap_context() (math SDPA): the fused CPU kernel has no batching rule."
CASES: tuple[ZooCase, ...] = (
    ZooCase("resnet_cnn", build_resnet_cnn, image_batch, False,
            "Conv + BatchNorm2d (running stats change in train mode), max_pool2d, residual blocks with a 1x1 "
            "downsample, adaptive avg + max pool. vmap runs in float32 only: under bfloat16 autocast, batch_norm's "
            "batching rule rejects a bfloat16 input with float32 weight and stats, which a plain call accepts."),
    ZooCase("gpt2", build_gpt2, token_batch, True,
            "transformers GPT2LMHeadModel; lm_head.weight is tied to transformer.wte.weight; dropout 0." + _SDPA_NOTE),
    ZooCase("llama", build_llama, token_batch, True,
            "transformers LlamaForCausalLM: RMSNorm, rotary embeddings, grouped-query attention." + _SDPA_NOTE),
    ZooCase("lstm", build_lstm, functools.partial(token_batch, seq_len=16, vocab=64), True,
            "Embedding + nn.LSTM + nn.GRU + Linear, next-token loss. CPU autocast runs the LSTM in bfloat16 "
            "(mkldnn_rnn_layer); GRU has no autocast rule and takes the LSTM's bfloat16 output as is. Under "
            "vmap needs vmap_context() (oneDNN off): mkldnn_rnn_layer has no batching rule. torch.compile breaks "
            "the graph at the LSTM unless torch._dynamo.config.allow_rnn = True (then fullgraph=True works)."),
    ZooCase("vit_block", build_vit_block, image_batch, True,
            "Patch conv + one pre-LN transformer block (LayerNorm, GELU, scaled_dot_product_attention)." + _SDPA_NOTE),
    ZooCase("sparse_embedding", build_sparse_embedding, bag_batch, False,
            "nn.Embedding(sparse=True): a sparse COO gradient; AdamW refuses it, so the reference loop uses SGD."),
    ZooCase("custom_fwd", build_custom_fwd, features_batch, False,
            "autograd.Function with @torch.amp.custom_fwd/custom_bwd, no cast_inputs: runs under autocast. "
            "Not vmappable: functorch needs setup_context, which the docs-style Function lacks. Under torch.compile, "
            "Dynamo itself instantiates torch.autograd.Function(), which raises a DeprecationWarning ('should not "
            "be instantiated'): tests with filterwarnings=error must ignore it."),
    ZooCase("custom_fwd_cast", functools.partial(build_custom_fwd, cast_inputs=True), features_batch, False,
            "As custom_fwd with cast_inputs=torch.float32: float32 inside, autocast off. Not vmappable either."),
    ZooCase("tied_embeddings", build_tied_embeddings, functools.partial(token_batch, seq_len=32), True,
            "The output Linear's weight IS the Embedding's weight; named_parameters() lists it once."),
    ZooCase("frozen_submodule", build_frozen_submodule, labelled_batch, True,
            "Encoder params have requires_grad=False and must stay unchanged; only the head trains."),
    ZooCase("dropout", build_dropout, features_batch, True,
            "nn.Dropout(0.1): fmp and torch.amp agree only when their RNG draws do (same seed, same op order); "
            "vmap needs randomness='different' or 'same'."),
    ZooCase("biased_attention", build_biased_attention, functools.partial(token_batch, seq_len=16, vocab=64), True,
            "T5-style attention: a learned float position bias as scaled_dot_product_attention's mask and dropout "
            "0.1 inside it, which run on its math kernel. Eager it trains as under torch.amp; compiled or under "
            "vmap with the CPU rules torch fails in the backward torch.func.grad records (mixed float32 and "
            "bfloat16): use the default rules (fmp's own mode) there." + _SDPA_NOTE),
)  # fmt: skip


def case(name: str) -> ZooCase:
    for zoo_case in CASES:
        if zoo_case.name == name:
            return zoo_case
    raise KeyError(f"no zoo case {name!r}; known: {[c.name for c in CASES]}")


def has_sparse_grads(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Embedding) and m.sparse for m in model.modules())


def torch_amp_train(
    model: nn.Module,
    zoo_case: ZooCase,
    steps: int,
    *,
    compile: bool = False,
    generator_seed: int = 0,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[float], nn.Module]:
    """Train a deep copy of `model` with torch.autocast + GradScaler; return (loss per step, trained copy).

    Batches come from `zoo_case.batch` with a generator seeded `generator_seed`; the global RNG
    (dropout) is seeded with it too, inside `fork_rng` so the caller's RNG is left alone.
    """
    model = copy.deepcopy(model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd" or has_sparse_grads(model):  # AdamW raises on sparse gradients
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    scaler = torch.amp.GradScaler("cpu")
    forward = torch.compile(model) if compile else model
    generator = torch.Generator().manual_seed(generator_seed)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(generator_seed)
        for _ in range(steps):
            batch = zoo_case.batch(generator)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                loss = forward(*batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    return losses, model
