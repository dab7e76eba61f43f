"""Stochastic rounding of float32 to bfloat16, with random bits derived from a key (no RNG state)."""

from __future__ import annotations

import torch

__all__ = ["stochastic_round"]

_LOW_32_BITS = 0xFFFFFFFF
# A float32 becomes a bfloat16 by dropping the low 16 bits of its pattern; as an int32 mask that is -2**16.
_HIGH_16_BITS_INT32 = -(1 << 16)
_LOW_16_BITS = 0xFFFF
# Multipliers of a 32-bit integer finalizer (xor-shift, multiply, xor-shift ...) and of the key's two
# halves. All are odd (a bijection modulo 2**32) and below 2**31, so a 32-bit value times one stays
# below 2**63: the int64 arithmetic never overflows, on any backend.
_MIX_MULTIPLIER = 0x45D9F3B
_KEY_LOW_MULTIPLIER = 0x2545F491
_KEY_HIGH_MULTIPLIER = 0x4F6CDD1D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A bijective hash of int64 values in [0, 2**32) onto that range, spreading every input bit."""
    h = h ^ (h >> 16)
    h = (h * _MIX_MULTIPLIER) & _LOW_32_BITS
    h = h ^ (h >> 16)
    h = (h * _MIX_MULTIPLIER) & _LOW_32_BITS
    return h ^ (h >> 16)


def _stream_seed(key: torch.Tensor) -> torch.Tensor:
    """The 32-bit seed of one key's element stream: distinct for keys that differ in their low 32 bits only.

    Only multiplies, no xor-shift: inductor inlines this 0-dim value into the per-element kernel
    and expands each reuse of a value in the expression again, so a finalizer here (each of its
    xor-shifts reads a value twice) made a cold compile of the rounding ~20 s slower per tensor.
    """
    key = key.to(torch.int64)
    low = (key & _LOW_32_BITS) * _KEY_LOW_MULTIPLIER
    high = ((key >> 32) & _LOW_32_BITS) * _KEY_HIGH_MULTIPLIER
    return (low ^ high) & _LOW_32_BITS


def stochastic_round(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Rounds float32 `x` to bfloat16, up or down at random with odds that make the result unbiased.

    A value a quarter of the way from one bfloat16 to the next comes out as the upper one with
    probability 1/4, so the expected result is `x` itself: small updates to a bfloat16 parameter,
    each below half its spacing, add up instead of rounding away. The result is always one of the
    two bfloat16 values around `x`; a value that is already a bfloat16 (zeros and infinities
    included) comes out unchanged, NaN stays NaN, and a value beyond bfloat16's largest may round
    to infinity.

    The random bits are a hash of `key` and each element's index, so the function is pure: the
    same `x` and `key` always give the same result, under `torch.compile`, `torch.func.vmap` and on
    any device, and no generator state is read or advanced. Use a new key for every rounding
    (e.g. derived from a step count): one key reused rounds the same elements the same way.

    Args:
        x: A float32 tensor.
        key: A 0-dim integer tensor (any value; all 64 bits count). A tensor, not a Python int, so a
            compiled caller does not recompile when it changes.

    Returns:
        A bfloat16 tensor shaped like `x`.

    Raises:
        TypeError: If `x` is not a float32 tensor or `key` not a 0-dim integer tensor.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"stochastic_round rounds a float32 tensor to bfloat16, got {got}")
    if not isinstance(key, torch.Tensor) or key.dim() != 0 or key.is_floating_point() or key.is_complex():
        found = f"shape {tuple(key.shape)} {key.dtype}" if isinstance(key, torch.Tensor) else type(key).__name__
        raise TypeError(f"stochastic_round needs a 0-dim integer tensor key, got {found}")
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    seed = _stream_seed(key.to(x.device))
    noise = (_mix32(index ^ seed) & _LOW_16_BITS).to(torch.int32)
    nan = x != x  # isnan, which Inductor's CPU code runs element by element instead of vectorized
    # Adding up to 2**16 - 1 to the pattern carries into the kept bits with probability equal to the
    # dropped fraction; the pattern is sign and magnitude, so this rounds the magnitude and is
    # unbiased for either sign. NaN is set aside first: its pattern could overflow the int32.
    bits = torch.where(nan, 0.0, x).view(torch.int32)
    rounded = ((bits + noise) & _HIGH_16_BITS_INT32).view(torch.float32).to(torch.bfloat16)
    return torch.where(nan, x.to(torch.bfloat16), rounded)
