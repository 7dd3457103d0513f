"""Row formats of quantized inference tables: FBGEMM's IntNBit rows, byte for byte.

One row of a table of weight type `wt` and dimension `D` is `row_bytes(D, wt)` bytes:

    int8 / int4 / int2:  [scale fp16][bias fp16][payload: D values of 8 / 4 / 2 bits][zero padding]
    fp8:                 [D bytes, FBGEMM's HFP8: 1 sign, 4 exponent bits, bias 7][zero padding]
    float16 / float32:   [D values][zero padding]

padded to a multiple of 16 bytes (`ROW_ALIGNMENT`, FBGEMM's row alignment on CUDA). Packed values: value `j`
of an int4 row sits in byte `4 + j // 2`, the low nibble for even `j`; of an int2 row in byte `4 + j // 4`, bits
`2 * (j % 4)`. A value dequantizes to `q * scale + bias` (fp16 scale and bias, widened to float32).

The kernels read a row as `row_bytes // 4` little-endian int32 words (`to_words`): word 0 of an integer row holds
the scale (low 16 bits) and the bias (high 16 bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WEIGHT_DTYPES = ("float32", "float16", "fp8", "int8", "int4", "int2")
ROW_ALIGNMENT = 16
SCALE_BIAS_BYTES = 4
FP8_EXPONENT_BITS = 4
FP8_EXPONENT_BIAS = 7

_BITS = {"float32": 32, "float16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}


def check_weight_dtype(wt: str) -> str:
    if wt not in _BITS:
        raise ValueError(f"weight dtype {wt!r}: expected one of {WEIGHT_DTYPES}")
    return wt


def bits(wt: str) -> int:
    """Bits per value."""
    return _BITS[check_weight_dtype(wt)]


def has_scale_bias(wt: str) -> bool:
    """Integer rows carry a per-row fp16 scale and bias in front of the payload."""
    return check_weight_dtype(wt) in ("int8", "int4", "int2")


def header_bytes(wt: str) -> int:
    return SCALE_BIAS_BYTES if has_scale_bias(wt) else 0


def unpadded_row_bytes(dim: int, wt: str) -> int:
    if (dim * bits(wt)) % 8:
        raise ValueError(f"dim {dim} of a {wt} table: dim * {bits(wt)} bits must fill whole bytes")
    return dim * bits(wt) // 8 + header_bytes(wt)


def row_bytes(dim: int, wt: str) -> int:
    """Bytes of one stored row (padded to `ROW_ALIGNMENT`)."""
    r = unpadded_row_bytes(dim, wt)
    return -(-r // ROW_ALIGNMENT) * ROW_ALIGNMENT


def to_words(rows: jax.Array) -> jax.Array:
    """uint8 `[E, row_bytes]` -> int32 `[E, row_bytes // 4]` (little-endian words)."""
    e, nb = rows.shape
    return jax.lax.bitcast_convert_type(rows.reshape(e, nb // 4, 4), jnp.int32)


def from_words(words: jax.Array) -> jax.Array:
    """int32 `[E, W]` -> uint8 `[E, 4 * W]`."""
    e, w = words.shape
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(e, 4 * w)


def _fp16_bits_to_f32(h: jax.Array) -> jax.Array:
    """int32 holding fp16 bit patterns in its low 16 bits -> float32."""
    return jax.lax.bitcast_convert_type((h & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def hfp8_to_float(code: jax.Array, ebits: int = FP8_EXPONENT_BITS, bias: int = FP8_EXPONENT_BIAS) -> jax.Array:
    """FBGEMM's HFP8 codes (int32, low 8 bits) -> float32: sign, `ebits` exponent bits of bias `bias`, the rest
    mantissa; exponent 0 is subnormal (no inf or nan codes)."""
    code = code.astype(jnp.int32)
    mbits = 7 - ebits
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    # Normal codes by their bits (exponent rebiased to float32's); subnormal ones (e == 0) as m * 2^(1-bias-mbits),
    # computed in float32 arithmetic (a float32 subnormal pattern would be flushed to zero by XLA).
    normal = jax.lax.bitcast_convert_type(((e + 127 - bias) << 23) | (m << (23 - mbits)), jnp.float32)
    sub = m.astype(jnp.float32) * jnp.float32(2.0 ** (1 - bias - mbits))
    mag = jnp.where(e == 0, sub, normal)
    return jnp.where((code & 0x80) != 0, -mag, mag)


def dequantize_rows(rows: jax.Array, wt: str, dim: int) -> jax.Array:
    """Stored rows (uint8 `[E, row_bytes]`) -> float32 `[E, dim]`: `q * scale + bias` for integer rows."""
    nb = bits(wt)
    words = to_words(rows)
    h = header_bytes(wt) // 4
    j = jnp.arange(dim, dtype=jnp.int32)
    per = 32 // nb
    vals = (words[:, h + j // per] >> (nb * (j % per))) & ((1 << nb) - 1) if nb < 32 else words[:, :dim]
    if wt == "float32":
        return jax.lax.bitcast_convert_type(vals, jnp.float32)
    if wt == "float16":
        return _fp16_bits_to_f32(vals)
    if wt == "fp8":
        return hfp8_to_float(vals)
    scale = _fp16_bits_to_f32(words[:, 0])[:, None]
    bias = _fp16_bits_to_f32(words[:, 0] >> 16)[:, None]
    return vals.astype(jnp.float32) * scale + bias
