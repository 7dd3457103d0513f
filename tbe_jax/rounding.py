"""Stochastic rounding of fp32 values to float16 / bfloat16 (FBGEMM's `stochastic_rounding` for low-precision
tables): pure jnp on int32 / fp32, so the Pallas kernels' row update, the XLA update and the reference share it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stochastic_round(x, dtype, row, col, *salts):
    """`x` (fp32) rounded to `dtype` (float16 or bfloat16) stochastically, as fp32 values.

    Unbiased: each value goes to one of its two `dtype` neighbours with probability
    proportional to closeness, so E[result] = x (no drift when updates are smaller
    than half an ulp, which round-to-nearest would drop). The uniform draw is a hash
    of the row, the column and the bits of `salts` (fp32 arrays that change every
    step: the update's gradient, the old weight, the new accumulator), so it is
    bitwise reproducible and needs no RNG state; with SGD, a row whose gradient and
    weight repeat exactly repeats its rounding decision. Pure jnp on int32/fp32, so
    the same code runs inside the Pallas kernels and in the reference.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    h = row * jnp.int32(-1640531535) ^ col * jnp.int32(-2048144789)  # 0x9E3779B1, 0x85EBCA6B
    for s in salts:
        h = h ^ jax.lax.bitcast_convert_type(s, jnp.int32)
    for mult in (0x7FEB352D, -2073254261):  # 0x846CA68B
        h = h ^ jax.lax.shift_right_logical(h, jnp.int32(16))
        h = h * jnp.int32(mult)
    h = h ^ jax.lax.shift_right_logical(h, jnp.int32(15))
    finite = jnp.abs(x) < jnp.inf
    if jnp.dtype(dtype) == jnp.bfloat16:  # bf16 is fp32's top half: add 16 random bits, truncate
        y = jax.lax.bitcast_convert_type((bits + (h & 0xFFFF)) & jnp.int32(-65536), jnp.float32)
        return jnp.where(finite, y, x)
    if jnp.dtype(dtype) != jnp.float16:
        raise ValueError(f"stochastic rounding targets float16 or bfloat16, not {jnp.dtype(dtype)}")
    e = jnp.clip(jax.lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF, 127 - 14, 127 + 15)  # biased exponent
    ulp = jax.lax.bitcast_convert_type((e - 10) << 23, jnp.float32)  # fp16 spacing at x: a power of two
    lo = jnp.floor(x / ulp) * ulp
    u = (jax.lax.shift_right_logical(h, jnp.int32(8)) & 0xFFFFFF).astype(jnp.float32) * (1.0 / (1 << 24))
    y = lo + jnp.where(u < (x - lo) / ulp, ulp, 0.0)
    return jnp.where(finite, y, x)
