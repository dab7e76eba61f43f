"""Autocast rule sets as plain data: which ops run in the lower dtype, in float32, or promoted.

Each rule set maps an op name to a `Cast`. Names are torch's op names as `__name__` gives them
(`torch.mm`, `Tensor.mm` and `torch.ops.aten.mm` are all "mm"; `F.layer_norm` and
`torch.layer_norm` are "layer_norm"; `torch.linalg.inv` is "linalg_inv"; `x @ y` is "matmul"). An
op not in a rule set runs in the dtypes of its inputs. In-place variants ("addmm_") are never in a
rule set, so they are never cast, as under torch.autocast.

The lists are the op reference of the torch.amp documentation (`torch.autocast`'s "CUDA Ops that
can autocast to float16 / float32 / promote" and "CPU Ops that can autocast to bfloat16 / float32 /
promote"), with the docs' spellings mapped to op names: "GRUCell" is "gru_cell", "multi_dot" is
"linalg_multi_dot" and so on. Build your own by copying one: `{**CUDA, "softmax": Cast.LOWER}`.

A call whose public name is not that of the op torch.autocast catches follows that op's rule in
every rule set, so the sets leave such names out: `x.square()` follows "pow",
`torch.special.log_softmax` "log_softmax", `torch.linalg.matmul` and `x.__rmatmul__(y)` "matmul";
and where torch's path depends on the arguments, tensordot follows "mm" ("dot" when fully
contracted), `F.pad(x, (1, 1, 1, 1), mode="reflect")` "reflection_pad2d", and einsum, where a set
does not list it (the CPU set; torch casts it whole on CUDA), "bmm" when it sums an index over two
operands (the routes in fmp/autocast/_paths.py); on CPU tensors such an einsum runs under
torch.autocast("cpu") itself, which casts at each bmm its contraction order reaches and not at a
final mul (an outer product, a contracted index of size 1). Each set also lists the RNN
ops that torch splits up in C++ into listed ones (LSTM into mkldnn_rnn_layer or cuDNN's autocast
RNN): fmp sees such an op as one call, so it casts the whole op where torch.autocast casts its
inner matmuls.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["CPU", "CUDA", "RULE_SETS", "Cast", "RuleSet"]


class Cast(enum.Enum):
    """What autocast does with an op's floating-point inputs (float64 ones are never touched)."""

    LOWER = "lower"
    """Cast to the autocast dtype (float16 or bfloat16): matmuls, convolutions, linear layers."""
    FLOAT32 = "float32"
    """Cast to float32: numerically fragile ops (softmax, norms, losses, exp/log/pow, reductions)."""
    PROMOTE = "promote"
    """Cast every input to the widest floating dtype among them (float32 if any input is float32)."""
    FLOAT32_UNLESS_FLOAT16 = "float32_unless_float16"
    """Raise under float16, run in float32 otherwise: `binary_cross_entropy`, whose backward can
    produce gradients float16 cannot hold (torch.autocast on CUDA raises for every dtype)."""


RuleSet = Mapping[str, Cast]
"""A rule set: op name -> Cast."""

_L, _F, _P = Cast.LOWER, Cast.FLOAT32, Cast.PROMOTE


def _rules(lower: str, float32: str, promote: str, **extra: Cast) -> RuleSet:
    table = {name: _L for name in lower.split()}
    table |= {name: _F for name in float32.split()}
    table |= {name: _P for name in promote.split()}
    return MappingProxyType(table | extra)


# RNN ops whose inner matmuls torch.autocast casts (measured on CPU with torch 2.13; on CUDA GRU
# goes through cuDNN).
_COMPOSITES_CUDA = dict.fromkeys(["lstm", "gru", "rnn_tanh", "rnn_relu"], _L)
# The CPU set leaves out lstm, which reaches mkldnn_rnn_layer only for a padded batch (its route).
_COMPOSITES_CPU = dict.fromkeys(["rnn_tanh", "rnn_relu", "rnn_tanh_cell", "rnn_relu_cell"], _L)

# The CUDA lists (float16 and bfloat16 share them): the docs' lists (whose `__matmul__`, `__pow__` and
# `__rtruediv__` reach the mode as matmul, pow and __rdiv__) plus every op torch registers for the
# AutocastCUDA dispatch key (einsum, rms_norm, logsumexp, the vector norms, the upsample family, ...;
# tests/test_autocast_cuda_rules.py checks them against torch.autocast("cuda") on fake CUDA tensors). "cuda" is
# fmp's default on every device, CPU included, where torch.autocast("cpu") would run softmax and
# layer_norm in bfloat16.
CUDA: RuleSet = _rules(
    lower="""
        addbmm addmm addmv addr baddbmm bmm chain_matmul einsum linalg_multi_dot
        conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
        gru_cell linear lstm_cell matmul mm mv prelu rnn_relu_cell rnn_tanh_cell
        conv_tbc convolution _convolution cudnn_convolution cudnn_convolution_transpose linalg_vecdot
        scaled_dot_product_attention _scaled_dot_product_flash_attention _thnn_fused_gru_cell
        _thnn_fused_lstm_cell
    """,
    float32="""
        __rdiv__ __rpow__ acos asin binary_cross_entropy_with_logits cosh
        cosine_embedding_loss cdist cosine_similarity cross_entropy cumprod cumsum dist erfinv exp expm1
        group_norm hinge_embedding_loss kl_div l1_loss layer_norm log log_softmax log10 log1p log2
        margin_ranking_loss mse_loss multilabel_margin_loss multi_margin_loss nll_loss norm normalize pdist
        poisson_nll_loss pow prod reciprocal rsqrt sinh smooth_l1_loss soft_margin_loss softmax softmin
        softplus sum renorm tan triplet_margin_loss
        rms_norm native_layer_norm logsumexp huber_loss nll_loss2d linalg_vector_norm linalg_matrix_norm
        frobenius_norm nuclear_norm upsample_nearest1d upsample_nearest2d upsample_nearest3d
        upsample_linear1d upsample_bilinear2d upsample_bicubic2d upsample_trilinear3d
        _upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d
        _upsample_bilinear2d_aa _upsample_bicubic2d_aa
    """,
    promote="addcdiv addcmul atan2 bilinear cross dot vdot grid_sample grid_sampler index_put scatter_add tensordot",
    binary_cross_entropy=Cast.FLOAT32_UNLESS_FLOAT16,
    **_COMPOSITES_CUDA,
)
"""torch.autocast's CUDA rules, op name -> `Cast`: `rules="cuda"`, the default on every device.

Listed op by op in the [autocast op reference](../reference/autocast-ops.md).
"""

# torch's CPU lists (bfloat16 and float16 share them), including the ops registered for the
# AutocastCPU dispatch key that the docs leave out (`_addmm_activation`, `smooth_l1_loss`).
CPU: RuleSet = _rules(
    lower="""
        conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear matmul _convolution conv_tbc
        mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
        _native_multi_head_attention _addmm_activation
    """,
    float32="""
        avg_pool3d binary_cross_entropy grid_sampler grid_sampler_2d _grid_sampler_2d_cpu_fallback
        grid_sampler_3d polar prod quantile nanquantile stft cdist trace view_as_complex cholesky
        cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d
        max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d
        replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d
        hinge_embedding_loss poisson_nll_loss cross_entropy_loss cross_entropy l1_loss huber_loss
        margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn
        fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond
        linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh
        linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d
        fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr
        linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex smooth_l1_loss
    """,
    promote="cat stack index_copy",
    **_COMPOSITES_CPU,
)
"""torch.autocast's CPU rules, op name -> `Cast`: `rules="cpu"`, bit for bit `torch.autocast("cpu")`.

Listed op by op in the [autocast op reference](../reference/autocast-ops.md).
"""

RULE_SETS: Mapping[str, RuleSet] = MappingProxyType({"cuda": CUDA, "cpu": CPU})
"""The named rule sets `fmp.autocast.autocast(..., rules=name)` accepts."""
