"""`fp8_linear`: `x @ weight.T + bias` with both matmuls of the backward pass in FP8 too, per a recipe.

Forward, the input and the weight are quantized along the dim they are contracted over and
multiplied; backward, the output gradient is quantized (E5M2 under "hybrid") and multiplied with
the weight for the input's gradient and with the input for the weight's. Each operand is
quantized in the orientation its matmul contracts it, as a rowwise or block scale must be, so
with those the backward re-quantizes the saved high-precision input and weight; a per-tensor
scale is the same in either orientation, so there the backward reuses the forward's FP8 operands.

A matmul runs as `torch._scaled_mm` where torch has a kernel for it (per-tensor, delayed and rowwise
scales: emulated on a CPU, FP8 tensor cores on a CUDA device of compute capability 8.9 or newer)
and otherwise on the dequantized operands in float32, which gives the same result: `_scaled_mm`
multiplies by the scales' reciprocals as `Quantized.dequantize` does and accumulates in float32.
On CUDA a rowwise product is rounded to bfloat16 first, the one output dtype every torch release
and GPU generation takes for rowwise scales.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from fmp._delayed_scaling import ROLES
from fmp._delayed_scaling import DelayedScaling
from fmp._fp8_formats import amax
from fmp._fp8_formats import quantize
from fmp.autocast import no_autocast
from fmp.fp8._blocks import Quantized
from fmp.fp8._recipes import Fp8Recipe

__all__ = ["fp8_linear", "fp8_matmul"]

Recipe = Fp8Recipe | DelayedScaling
Scales = tuple[torch.Tensor, torch.Tensor] | None  # a delayed recipe's (scales, loss scale)
_NATIVE = ("tensorwise", "rowwise", "delayed")  # the scale layouts torch._scaled_mm takes
_CUDA_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what cuBLAS's FP8 matmuls write


def _name(recipe: Recipe) -> str:
    return "delayed" if isinstance(recipe, DelayedScaling) else recipe.name


def _quantize(recipe: Recipe, x: torch.Tensor, role: str, contract_dim: int, scales: Scales) -> Quantized:
    if isinstance(recipe, DelayedScaling):
        assert scales is not None  # fp8_linear requires them with a delayed recipe
        state_scales, loss_scale = scales
        scale = state_scales[ROLES.index(role)]
        if role == "grad_output":  # the gradient arrives multiplied by the loss scale
            scale = scale / loss_scale
        return Quantized(quantize(x, scale, recipe.dtype(role)), scale.reshape(1, 1))
    return recipe.quantize(x, role, contract_dim)


def fp8_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, native: bool) -> torch.Tensor:
    """`a @ b` of two quantized matrices (a contracted along dim 1, b along dim 0), accumulated in float32.

    Args:
        a: (M, K), with one scale per row or per tensor where `native`.
        b: (K, N), with one scale per column or per tensor where `native`.
        out_dtype: The result's dtype.
        native: Whether to call `torch._scaled_mm` (only for per-tensor and per-row/column scales).

    Returns:
        (M, N) in `out_dtype`; natively off a CPU with per-row scales, rounded to bfloat16 first.
    """
    if not native:
        return (a.dequantize() @ b.dequantize()).to(out_dtype)
    scale_a, scale_b = a.scale.reciprocal(), b.scale.reciprocal()
    per_tensor = scale_a.numel() == 1 and scale_b.numel() == 1
    if per_tensor:
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    # CUDA's rowwise kernel writes bfloat16 only (float32 too on sm_90 with cuBLAS 12.9, which torch
    # cannot be asked about): off a CPU the product is rounded to bfloat16, as torchao's is.
    kernel_dtype = out_dtype if per_tensor or a.data.device.type == "cpu" else torch.bfloat16
    # cuBLASLt multiplies a row-major by a column-major matrix only (the weight gradient's
    # grad_output.t() arrives column-major).
    row_major, column_major = a.data.contiguous(), b.data.t().contiguous().t()
    product = torch._scaled_mm(row_major, column_major, scale_a=scale_a, scale_b=scale_b, out_dtype=kernel_dtype)
    return product.to(out_dtype)


def cuda_runs_fp8(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` has a kernel on this CUDA device: compute capability 8.9 or newer, not ROCm.

    ROCm's GPUs take the `fnuz` FP8 formats, not the OCP ones the recipes use. Dynamo folds the
    device's properties into a constant, so this costs a compiled step nothing.
    """
    if torch.version.hip is not None:
        return False
    properties = torch.cuda.get_device_properties(device)
    return (properties.major, properties.minor) >= (8, 9)


def _runs_native(recipe: Recipe, a: Quantized, b: Quantized, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes this matmul: its scale layouts and dims of 16, no transform around.

    Compiled, Dynamo cannot ask whether a torch.func transform is running, so the native kernel is
    taken on CUDA only (where it is fast) and a CPU, which only emulates it, multiplies the
    dequantized operands, which Inductor fuses. On CUDA the device must have FP8 tensor cores
    (`cuda_runs_fp8`), the output be a 16- or 32-bit float, and the operands not both E5M2.
    """
    devices = {a.data.device.type, b.data.device.type}
    if _name(recipe) not in _NATIVE or devices not in ({"cpu"}, {"cuda"}):
        return False
    # CUDA's kernel wants the contracted dim and the second operand's columns in multiples of 16;
    # the first's rows may be any number. The CPU emulation keeps to every dim a multiple of 16, where
    # it sums in the dequantized product's order, bit for bit.
    (rows, contracted), (_, columns) = a.data.shape, b.data.shape
    if contracted % 16 or columns % 16 or (devices == {"cpu"} and rows % 16):
        return False
    if devices == {"cuda"} and (
        a.data.dtype == b.data.dtype == torch.float8_e5m2
        or out_dtype not in _CUDA_OUT_DTYPES
        or not cuda_runs_fp8(a.data.device)
    ):
        return False
    if torch.compiler.is_compiling():
        return devices == {"cuda"}
    return not retrieve_all_functorch_interpreters()


def _matmul(
    recipe: Recipe, a: tuple[torch.Tensor, str], b: tuple[torch.Tensor, str], out_dtype: torch.dtype, scales: Scales
) -> torch.Tensor:
    """Quantizes `a` (contracted along dim 1) and `b` (along dim 0) per the recipe and multiplies them."""
    (x, x_role), (y, y_role) = a, b
    return _multiply(
        recipe, _quantize(recipe, x, x_role, 1, scales), _quantize(recipe, y, y_role, 0, scales), out_dtype
    )


def _multiply(recipe: Recipe, a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_matmul(a, b, out_dtype, native=_runs_native(recipe, a, b, out_dtype))


def _per_tensor(recipe: Recipe) -> bool:
    """Whether one scale covers each operand, so its FP8 values are the same in either orientation.

    A recipe that keeps the weight's gradient in high precision needs the input as it was.
    """
    if isinstance(recipe, DelayedScaling):
        return True
    return recipe.name == "tensorwise" and not recipe.high_precision_weight_grad


def _transposed(q: Quantized) -> Quantized:
    return Quantized(q.data.t(), q.scale)  # a per-tensor scale, (1, 1)


class _Fp8Linear(torch.autograd.Function):
    """The FP8 matmul of `fp8_linear`; its extra outputs are what the backward pass needs.

    With one scale per tensor (tensorwise, delayed) the backward multiplies the very FP8 operands
    the forward made, transposed where its matmul contracts them the other way, and quantizes the
    output gradient once for both of its matmuls: the same values a re-quantization would give,
    in half the casts, and the saved input takes one byte an element. Other recipes scale along
    the contracted dim, so the backward re-quantizes the saved high-precision input and weight.
    The per-tensor backward keeps the FP8 weight (one byte an element) until it runs, beside
    the weight itself.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        scales: torch.Tensor | None,
        loss_scale: torch.Tensor | None,
        recipe: Recipe,
    ) -> tuple[torch.Tensor, ...]:
        pair = None if scales is None or loss_scale is None else (scales, loss_scale)
        qx = _quantize(recipe, x, "input", 1, pair)
        qw = _quantize(recipe, weight.t(), "weight", 0, pair)
        out = _multiply(recipe, qx, qw, x.dtype)
        if not _per_tensor(recipe):
            return (out,)
        if scales is None:
            return out, qx.data, qx.scale, qw.data, qw.scale
        # Delayed scaling's amaxes of the input and weight, for the scales' gradient.
        return out, qx.data, qx.scale, qw.data, qw.scale, torch.stack([amax(x), amax(weight)])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, weight, scales, loss_scale, recipe = inputs
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, weight.dtype)
        ctx.mark_non_differentiable(*output[1:])
        # The extra outputs get no gradient: no zero tensors of the operands' sizes for them.
        ctx.set_materialize_grads(False)
        saved = output[1:] if _per_tensor(recipe) else (x, weight)
        ctx.save_for_backward(*saved, scales, loss_scale)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        if grad_output is None:  # the output reaches no loss
            return None, None, None, None, None
        # Autograd runs a backward with the autocast state of the thread that calls it; the
        # matmuls here must see their float32 operands as they are, as in the forward.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return _backward(ctx, grad_output)


def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
    """`_Fp8Linear`'s backward: the gradients of the input, weight and (delayed scaling) scales."""
    recipe, (x_dtype, weight_dtype) = ctx.recipe, ctx.dtypes
    *saved, scales, loss_scale = ctx.saved_tensors
    if _per_tensor(recipe):
        pair = None if scales is None or loss_scale is None else (scales, loss_scale)
        x_data, x_scale, wt_data, wt_scale, *forward_amaxes = saved
        qx, qwt = Quantized(x_data, x_scale), Quantized(wt_data, wt_scale)
        qg = _quantize(recipe, grad_output, "grad_output", 1, pair)
        grad_x = _multiply(recipe, qg, _transposed(qwt), x_dtype)
        grad_w = _multiply(recipe, _transposed(qg), qx, weight_dtype)
        if scales is None:
            return grad_x, grad_w, None, None, None
        return grad_x, grad_w, _scales_gradient(forward_amaxes[0], grad_output, loss_scale, scales.dtype), None, None
    # Scales along the contracted dim (rowwise, blocks): from the saved input and weight again.
    # Delayed scaling is per tensor, so these recipes take no scales.
    assert isinstance(recipe, Fp8Recipe)
    x, weight = saved
    grad_x = _matmul(recipe, (grad_output, "grad_output"), (weight, "weight"), x_dtype, None)
    if recipe.high_precision_weight_grad:
        grad_w = (grad_output.t() @ x.to(grad_output.dtype)).to(weight_dtype)
    else:
        grad_w = _matmul(recipe, (grad_output.t(), "grad_output"), (x, "input"), weight_dtype, None)
    return grad_x, grad_w, None, None, None


def _scales_gradient(
    forward_amaxes: torch.Tensor, grad_output: torch.Tensor, loss_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Delayed scaling's "gradient" of the scales: this step's amaxes (input, weight, output gradient).

    `DelayedScalingState.update` records them: the state comes back out of the backward pass as a
    value, as flax's FP8 meta does, with no buffer written. The input's and the weight's are
    multiplied by the loss scale, which the step's unscale divides every gradient by; the output
    gradient's is of the scaled gradient already.
    """
    # A finite amax saturates, so that a huge loss scale does not make a finite step look
    # overflowed; an inf or NaN one (an activation that overflowed) stays, and skips the step.
    scaled = (forward_amaxes * loss_scale).clamp(max=torch.finfo(torch.float32).max)
    forward_amaxes = torch.where(torch.isfinite(forward_amaxes), scaled, forward_amaxes)
    return torch.cat([forward_amaxes, amax(grad_output)[None]]).to(dtype)


def _apply(*args: Any) -> torch.Tensor:
    """`_Fp8Linear.apply(x, weight, scales, loss_scale, recipe)`.

    A function of its own, not the bound `apply`, which Dynamo cannot call through a wrapper.
    """
    return _Fp8Linear.apply(*args)[0]  # type: ignore[no-any-return,no-untyped-call]


def _check_arguments(x: Any, weight: Any, bias: Any, recipe: Any, scales: Any, loss_scale: Any) -> None:
    """Raises naming the first argument `fp8_linear` cannot take."""
    if not isinstance(recipe, Fp8Recipe | DelayedScaling):
        raise TypeError(f"recipe must be an fmp.fp8 recipe (fmp.fp8.tensorwise(), ...), got {type(recipe).__name__}")
    for what, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if what == "bias" and tensor is None:
            continue
        if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"fp8_linear: {what} must be a real floating-point tensor, got {got}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias must be of shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    on_other_devices = [
        f"{what} on {tensor.device}"
        for what, tensor in (("weight", weight), ("bias", bias), ("scales", scales), ("loss_scale", loss_scale))
        if isinstance(tensor, torch.Tensor) and tensor.device != x.device
    ]
    if on_other_devices:
        raise ValueError(
            f"fp8_linear: x is on {x.device} but {', '.join(on_other_devices)}: move them to one device "
            f"(fmp.fp8.init_states(model, recipes, device) makes delayed scaling's states there)"
        )
    delayed = isinstance(recipe, DelayedScaling)
    if delayed != (scales is not None) or (loss_scale is not None and not delayed):
        raise TypeError(
            "scales and loss_scale go with a delayed recipe and only with it: pass state.scale of the linear's "
            "DelayedScalingState"
        )
    if delayed and not (isinstance(scales, torch.Tensor) and scales.shape == (3,) and scales.dtype == torch.float32):
        found = f"{scales.dtype} of shape {tuple(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales)
        raise ValueError(f"fp8_linear: scales must be a float32 tensor of shape (3,), a state's scale; got {found}")
    if loss_scale is not None and not (
        isinstance(loss_scale, torch.Tensor) and loss_scale.dim() == 0 and loss_scale.dtype == torch.float32
    ):
        raise ValueError(f"fp8_linear: loss_scale must be a 0-dim float32 tensor, got {loss_scale!r}")
    if isinstance(recipe, Fp8Recipe) and recipe.block:
        # Blocks run along each matmul's contracted dim: the features, and the tokens for the weight's gradient.
        tokens = x.numel() // max(x.shape[-1], 1)
        for what, size in (("in features", weight.shape[1]), ("out features", weight.shape[0]), ("tokens", tokens)):
            if size % recipe.block:
                raise ValueError(
                    f"fp8_linear ({recipe.name}): the {what} ({size}) must be a multiple of the recipe's block "
                    f"({recipe.block}), along which it is scaled (the tokens, the product of x's leading dims, "
                    f"for the weight's gradient)"
                )


# Autocast off inside (fmp's and torch's): the operands' casts are the recipe's.
_apply_without_autocast = no_autocast(_apply)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Recipe,
    scales: torch.Tensor | None = None,
    loss_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`torch.nn.functional.linear` with its forward and both backward matmuls in FP8, per `recipe`.

    Differentiable by autograd and `torch.func` (grad, vmap), and traced whole by
    `torch.compile(fullgraph=True)`. Under autocast `x` is cast to autocast's dtype first, as an
    `nn.Linear`'s input is; the output and the input's gradient take `x`'s dtype, the weight's
    gradient the weight's; the bias is added in `x`'s dtype outside FP8.

    Args:
        x: (..., in_features).
        weight: (out_features, in_features).
        bias: (out_features,) or None.
        recipe: `tensorwise()`, `rowwise()`, `mxfp8()`, `blockwise()` or `delayed()`.
        scales: With a delayed recipe, this linear's `DelayedScalingState.scale`; its gradient is
            then this step's amaxes of the input, weight and output gradient, for
            `state.update(amaxes)`. None with the other recipes.
        loss_scale: With a delayed recipe, the loss scale the output gradient arrives
            multiplied by (0-dim float32; None: 1): the gradient's cast divides its scale by it,
            and the amaxes come out multiplied by it, as gradients of the scaled loss, so that
            unscaling them gives them unscaled. `fmp.train_step` passes the scale of the loss
            being differentiated.

    Returns:
        (..., out_features) in `x`'s dtype.

    Raises:
        TypeError: If `recipe` is not an FP8 recipe, `x`, `weight` or `bias` is not a real
            floating-point tensor, or `scales` is missing for a delayed recipe (or it or
            `loss_scale` is given to another).
        ValueError: If the shapes do not match, `scales` or `loss_scale` has the wrong shape or
            dtype, or the features or tokens are not multiples of the recipe's block.
    """
    _check_arguments(x, weight, bias, recipe, scales, loss_scale)
    if scales is not None and loss_scale is None:
        loss_scale = torch.ones((), dtype=torch.float32, device=scales.device)
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype != torch.float64:  # x is floating (checked above)
        # As an nn.Linear under autocast, and as torchao's Float8Linear: the input and the output
        # in the autocast dtype (the weight is quantized from its own dtype).
        x = x.to(torch.get_autocast_dtype(device))
    if x.numel() == 0:  # no tokens: nothing to scale (an amax of nothing), an empty output as F.linear's
        out = torch.nn.functional.linear(x, weight.to(x.dtype))
    else:
        if torch.compiler.is_compiling():
            # Views, so that Dynamo calls the Function's backward even where every argument is a
            # torch.func.grad input as it is (see fmp._backward._viewing_params).
            weight = weight.view_as(weight)
            scales = None if scales is None else scales.view_as(scales)
        flat = x.reshape(-1, x.shape[-1])
        out = _apply_without_autocast(flat, weight, scales, loss_scale, recipe).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)
