"""Unscale + finite check + scale update: fmp fused vs GradScaler's kernels vs eager, side by side.

Every contender reads each gradient once and writes it once (torch's kernel in place, fmp into new
tensors), so all move the bytes of a copy of the gradients; GB/s counts bytes read plus written,
and each row prints its share of the copy's bandwidth and its time relative to torch's kernels.

  copy                 torch._foreach_copy_ of every gradient into preallocated tensors: the
                       bandwidth of reading and writing them once, in torch's multi-tensor kernel
  torch kernels        torch._amp_foreach_non_finite_check_and_unscale_ + torch._amp_update_scale_
  fmp eager            fmp.unscale_and_adjust, op by op
  fmp eager donated    the same with donate=True: multiplied in place, then checked (two passes)
  fmp fused            compiled_unscale_and_adjust (torch.compile, fullgraph)
  fmp fused donated    the same with donate=True: the unscaled values overwrite the gradients
  fmp fused graph      the same replayed as a CUDA graph (GPU, cases under 4 GB)
  fmp fused donated graph
                       the donated form replayed as a CUDA graph (GPU, cases under 4 GB)
  fmp GradientBuffer   the same gradients held as views into one flat buffer
                       (fmp.interop.GradientBuffer), unscaled in place by its unscale_: one tensor, one pass
  torch kernels, flat  GradScaler's kernels on that flat buffer: what the layout alone gives them
  fmp GradientBuffer, clipped
                       its unscale_and_clip_: unscale, check, clip to a global norm, in two passes
  torch.amp, clipped   GradScaler's kernels and torch.nn.utils.clip_grad_norm_ on the buffer's views
                       (max_norm 1e9: the clip never binds, so repeated calls keep the values; both
                       sides multiply by the clip factor all the same)

Cases: 200 gradients of 262,144 float32, and the 291 parameter shapes of a 7B Llama-style model
(full size on a GPU; each dimension divided by --shrink on CPU, 8 by default).

    python benchmarks/bench_unscale.py [--device cuda] [--reps 20] [--shrink 8] [--case uniform]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import cast

import torch
from _common import describe_machine
from _common import median_seconds
from _common import synchronize
from torch._inductor import metrics

import fmp
from fmp._scaler import _inductor_options
from fmp._scaler import compiled_unscale_and_adjust

Grads = list[torch.Tensor]


def llama_7b_shapes(shrink: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a 7B Llama-style model (32 layers, width 4096, MLP 11008, vocab 32000)."""

    def dim(n: int) -> int:
        return -(-n // shrink)

    width, mlp, vocab = dim(4096), dim(11008), dim(32000)
    layer = [(width, width)] * 4 + [(mlp, width), (mlp, width), (width, mlp), (width,), (width,)]
    return [(vocab, width), *layer * 32, (width,), (vocab, width)]


def check_agreement(grads: Grads, scale: float) -> None:
    """fmp's fused and eager results equal GradScaler's kernel bit for bit (first 8 leaves)."""
    sample = [g[:64].clone() for g in grads[:8]]
    scaler = fmp.StaticLossScale.create(scale, device=grads[0].device)
    eager, eager_finite, _, _ = fmp.unscale_and_adjust(scaler, sample)
    fused, fused_finite, _, _ = compiled_unscale_and_adjust(scaler, sample)
    found_inf = torch.zeros(1, device=grads[0].device)
    inverse = torch.full((1,), scale, dtype=torch.float64, device=grads[0].device).reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(sample, found_inf, inverse)
    for ours, theirs, other in zip(fused, sample, eager, strict=True):
        if not (torch.equal(ours, theirs) and torch.equal(ours, other)):
            raise AssertionError("fmp's unscale differs from GradScaler's")
    if not (bool(fused_finite) == bool(eager_finite) == (float(found_inf) == 0.0)):
        raise AssertionError("fmp's finite flag differs from GradScaler's")


def torch_kernels(grads: Grads) -> Callable[[], None]:
    """GradScaler's two kernels on `grads`, with a scale of 1 so that repeated calls keep the values."""
    device = grads[0].device
    scale, tracker = torch.ones((), device=device), torch.zeros((), dtype=torch.int32, device=device)
    found_inf = torch.zeros((), device=device)

    def run() -> None:
        found_inf.zero_()
        inverse = scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inverse)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000)

    return run


def contenders(grads: Grads) -> dict[str, Callable[[], object]]:
    device = grads[0].device
    scaler = fmp.DynamicLossScale.create(1.0, device=device)

    timed: dict[str, Callable[[], object]] = {
        "torch kernels": torch_kernels(grads),
        "fmp eager": lambda: fmp.unscale_and_adjust(scaler, grads),
        "fmp eager donated": lambda: fmp.unscale_and_adjust(scaler, grads, donate=True),
        "fmp fused": lambda: compiled_unscale_and_adjust(scaler, grads),
        # In place, as torch's kernel; the scale stays 1, so repeated calls keep the values.
        "fmp fused donated": lambda: compiled_unscale_and_adjust(scaler, grads, donate=True),
    }
    if device.type == "cuda" and sum(g.numel() for g in grads) < 2**30:
        # Replayed as one CUDA graph, as inside a step compiled with mode="reduce-overhead"; the
        # gradients stay where they are (as a step's would), so the graph reads them in place.
        for g in grads:
            torch._dynamo.mark_static_address(g)
        options = {**_inductor_options("cuda", clips=False), "triton.cudagraphs": True}
        graphed = torch.compile(fmp.unscale_and_adjust, fullgraph=True, options=options)
        timed["fmp fused graph"] = lambda: graphed(scaler, grads)
        timed["fmp fused donated graph"] = lambda: graphed(scaler, grads, donate=True)
    return timed


def copy_seconds(grads: Grads, reps: int) -> float:
    """Time of `torch._foreach_copy_` of the gradients into preallocated tensors, freed on return.

    Freed before the other contenders run, since 7B-shaped gradients take 27 GB of the GPU.
    """
    copies = [torch.empty_like(g) for g in grads]
    return median_seconds(lambda: torch._foreach_copy_(copies, grads), grads[0].device, reps)


def gradient_buffer(grads: Grads) -> tuple[fmp.interop.GradientBuffer, list[torch.Tensor]]:
    """A GradientBuffer holding copies of `grads`, and the parameters it is attached to.

    Each parameter is a scalar expanded to its gradient's shape, which takes no memory: only the
    gradients matter here, and 7B-shaped parameters would not fit on the GPU beside them.
    """
    params = [torch.zeros((), device=g.device).expand(g.shape).requires_grad_() for g in grads]
    buffer = fmp.interop.GradientBuffer.attach(params)
    for param, grad in zip(params, grads, strict=True):
        cast(torch.Tensor, param.grad).copy_(grad)
    return buffer, params


def buffer_contenders(
    buffer: fmp.interop.GradientBuffer, params: list[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    """The rows timed on the buffer: fmp's unscale and unscale-and-clip, torch's on the same bytes."""
    device = params[0].device
    scaler = fmp.DynamicLossScale.create(1.0, device=device)  # scale 1: repeated calls keep the values
    views = [cast(torch.Tensor, p.grad) for p in params]
    unscale_views = torch_kernels(views)

    def written() -> None:
        # What a backward's accumulate hooks do between two unscales in training, at no cost: mark
        # the gradients renewed, so the buffer does not refuse them as unscaled already.
        buffer._accumulation.since_unscale = True

    def torch_amp_clipped() -> None:
        unscale_views()
        torch.nn.utils.clip_grad_norm_(params, 1e9)

    return {
        "fmp GradientBuffer": lambda: (written(), buffer.unscale_(scaler)),
        "torch kernels, flat": torch_kernels(list(buffer.flat())),
        "fmp GradientBuffer, clipped": lambda: (written(), buffer.unscale_and_clip_(scaler, 1e9)),
        "torch.amp, clipped": torch_amp_clipped,
    }


def run_case(name: str, shapes: list[tuple[int, ...]], device: torch.device, reps: int) -> None:
    torch.manual_seed(0)
    grads = [torch.randn(shape, device=device) for shape in shapes]
    torch._dynamo.reset()  # a fresh compile for these shapes, not a dynamic-shape recompile
    moved = 2 * sum(g.numel() * g.element_size() for g in grads)  # each byte read once, written once
    metrics.reset()
    start = time.perf_counter()
    compiled_unscale_and_adjust(fmp.DynamicLossScale.create(1.0, device=device), grads)
    synchronize(device)
    compile_seconds = time.perf_counter() - start
    kernels = metrics.generated_kernel_count
    seconds = {"copy": copy_seconds(grads, reps)}
    seconds |= {label: median_seconds(fn, device, reps) for label, fn in contenders(grads).items()}
    check_agreement(grads, scale=3.0)
    buffer, params = gradient_buffer(grads)
    del grads  # 7B-shaped gradients and their buffer both fit on the GPU, not a third copy
    for label, fn in buffer_contenders(buffer, params).items():
        fn()  # compiles for the flat buffers' shapes
        seconds[label] = median_seconds(fn, device, reps)
    print(f"\n{name}: {len(shapes)} gradients, {moved / 2 / 1e9:.3f} GB float32")
    for label, t in seconds.items():
        print(
            f"  {label:>27}: {t * 1e3:9.3f} ms  {moved / t / 1e9:8.1f} GB/s  "
            f"{seconds['copy'] / t:6.1%} of copy  time ratio to torch kernels {t / seconds['torch kernels']:5.2f}"
        )
    print(f"  fmp fused: first call (compile) {compile_seconds:.1f} s, {kernels} kernels generated")
    clipped = seconds["fmp GradientBuffer, clipped"] / seconds["torch.amp, clipped"]
    print(f"  unscale and clip: fmp GradientBuffer / torch.amp time {clipped:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per contender (20 on GPU, 5 on CPU)")
    parser.add_argument("--shrink", type=int, default=None, help="divide 7B dims by this (1 on GPU, 8 on CPU)")
    parser.add_argument("--case", choices=["both", "uniform", "7b"], default="both", help="which gradient lists")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    reps = args.reps or (20 if on_gpu else 5)
    shrink = args.shrink or (1 if on_gpu else 8)
    print(describe_machine(device))
    if args.case in ("both", "uniform"):
        run_case("uniform", [(262_144,)] * 200, device, reps)
    if args.case in ("both", "7b"):
        label = "7B-shaped" if shrink == 1 else f"7B-shaped, each dimension / {shrink}"
        run_case(label, llama_7b_shapes(shrink), device, reps)


if __name__ == "__main__":
    main()
