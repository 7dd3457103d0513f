"""Row formats of quantized inference tables: FBGEMM's IntNBit rows, byte for byte.

Layout
------
One row of a table of weight type `wt` and dimension `D` is `row_bytes(D, wt)` bytes:

    int8 / int4 / int2:  [scale fp16][bias fp16][payload: D values of 8 / 4 / 2 bits][zero padding]
    fp8:                 [D bytes, FBGEMM's HFP8: 1 sign, 4 exponent bits, bias 7][zero padding]
    float16 / float32:   [D values][zero padding]

padded to a multiple of 16 bytes (`ROW_ALIGNMENT`, FBGEMM's row alignment on CUDA; its CPU TBE uses 1). Packed
values: value `j` of an int4 row sits in byte `4 + j // 2`, the low nibble for even `j`; of an int2 row in byte
`4 + j // 4`, bits `2 * (j % 4)`. A value dequantizes to `q * scale + bias` (fp16 scale and bias). This is what
`IntNBitTableBatchedEmbeddingBagsCodegen` (fbgemm_gpu 1.6.0, `reverse_qparam=False`, the default) holds after
`assign_embedding_weights` of `tbe/utils/quantize.py::quantize_embs` output: the quantize ops put scale and bias at
the END of their rows (fp32 for int8, fp16 for int4/int2); `quantize_embs` converts int8's pair to fp16 and the
assignment moves the pair to the front; the TBE's buffer is allocated with zeros, so the padding is zero. FBGEMM's
IntNBit TBE needs `D * bits % 8 == 0` (int4: D even, int2: D % 4 == 0); its quantize ops are stricter (int4:
D % 4, int2: D % 8; int8 on CUDA pads its payload to D % 4 == 0, so `quantize_embs` + assignment fails there for
other D). `quantize_rows` takes every D the TBE takes; its bytes are what the ops' arithmetic gives for that D.

The kernels read a row as `row_bytes // 4` little-endian int32 words (`to_words`): word 0 of an integer row holds
the scale (low 16 bits) and the bias (high 16 bits), FBGEMM's `half2 shift_scale` (`.x` the scale).

Quantization (`quantize_rows`, float32 in, FBGEMM's CUDA ops' float32 arithmetic reproduced exactly)
-----------------------------------------------------------------------------------------------------
- float32: the bits as given. float16: round to nearest even (CUDA's `__float2half`), |x| >= 65520 -> inf, every
  NaN -> 0x7FFF (CUDA's canonical NaN; FBGEMM's CPU path gives 0x7E00 for a positive NaN).
- fp8 (`FloatToHFP8Quantized`, `quantize_ops_utils.h::float_to_hfp8`): |x| clamped to `max_pos` (240 for the
  default 4 exponent bits, bias 7) with `fminf`, so +-inf and NaN become +-240 (the NaN's sign bit kept); then round
  to nearest even on 3 mantissa bits (normal codes) or to a multiple of 2^-9 (subnormal codes, below 2^-6).
- int8 (`FloatToFused8BitRowwiseQuantized`, CUDA): per row `min`, `max`, `range = max - min`, fp32
  `scale = range / 255`, `inverse = 255 / (range + 1e-20)`, `q = lrintf((x - min) * inverse)` (round half to
  even, the low 8 bits kept); `quantize_embs` stores fp16(scale) and fp16(min). So q is computed with the fp32
  scale and min, dequantized with the fp16 ones. The CPU op uses 1e-8 (`int8_epsilon=1e-8` gives its bytes for
  finite rows). Tables of more than 20 rows take min/max with `fminf`/`fmaxf` (NaNs ignored); up to 20 rows FBGEMM
  runs another kernel whose sequential `<=` scan is the int4/int2 one below.
- int4 / int2 (`FloatToFusedNBitRowwiseQuantizedSBHalf`): `min` rounded to fp16 first, `range = max - min16`,
  `scale = fp16(range / (2^bits - 1))` (1 if range == 0; then 1 if it rounded to 0 or 1/scale is inf),
  `inverse = 1 / scale`, `q = clamp(lrintf((x - min16) * inverse), 0, 2^bits - 1)`; stored fp16(scale), min16.
  Its min/max is a sequential scan `r = r <= x ? r : x`: a NaN replaces the running value and the next element
  replaces the NaN, so min/max are those of the elements after the row's last NaN (NaN if it is the last one).
- Special rows (no FBGEMM check rejects them): a constant row c stores int8 scale 0, bias fp16(c), q = 0; int4/int2
  scale 1 and q = 0 when c is an fp16 value, else the scale of the residual c - fp16(c) (q near 2^bits - 1). A row
  with an inf has range inf: int8/int4/int2 store scale inf and every q = 0 (inf * 0 is NaN; NaN converts to 0),
  so every value of that row dequantizes to NaN. NaN entries store q = 0. `lrintf` is CUDA's: round half to even,
  saturated to int64, NaN -> 0, then narrowed (int8: low byte; int4/int2: `static_cast<int>`, then clamped).
- Not pinned down: which zero a row's min is when its smallest values are -0.0 and +0.0 (int8, > 20 rows);
  float32 subnormal inputs (|x| < 2^-126), which XLA reads as zero in arithmetic.
Two XLA rewrites would break exactness and are kept out: a division by a broadcast value becomes a multiplication
by its reciprocal (`_div` hides the divisor behind an optimization barrier), and float32 subnormal bit patterns are
flushed (HFP8 encoding and decoding work on the integer bits).

Dequantization and FBGEMM's forward (`dequantize_rows` is float32 `q * scale + bias`)
-------------------------------------------------------------------------------------
FBGEMM's IntNBit forward (`codegen/inference/embedding_forward_quantized_split_nbit_kernel_template.cu`,
`include/fbgemm_gpu/utils/vecn.cuh`: `dequantize_permuted_int{8,4,2}`) dequantizes integer rows in HALF
precision: the packed q become fp16 values q * 2^-k (`hmul_short2`, exact), then `hfma2(q * 2^-k, scale * 2^k,
bias)`, one fused fp16 multiply-add, so each value is fp16(q * scale + bias), rounded once; it is widened to
float32 and accumulated in float32 (sum pooling: in bag order; mean: times 1/L), and rounded to fp16 (RN) for fp16
output. `scale * 2^k` is an fp16 product (k = 9 for int8; 9 and 5 for int4; 9, 7, 5, 3 for int2): rows whose
fp16 scale is >= 128 overflow it to inf, and FBGEMM returns inf/NaN for them. FP8 rows decode exactly (the
`hfp8_to_float` bits, times 2^(127 - bias) in float32) and fp16/fp32 rows are widened exactly; all accumulate in
float32. Ours is `q * scale + bias` in float32, exact but for one float32 rounding (q * scale is exact in float32).
So for integer rows, per looked-up value FBGEMM's term differs from ours by at most the fp16 rounding,
max(2^-11 |v|, 2^-25) (v = q * scale + bias), plus 2^-24 |v| for ours; a pooled output of L rows by their sum, plus
each side's float32 accumulation (at most (L - 1) 2^-24 sum |v|) and, for fp16 output, the final fp16 rounding.
FP8 / fp16 / fp32 rows differ only by the accumulation order and the output rounding.
"""

from __future__ import annotations

import struct

import jax
import jax.numpy as jnp

WEIGHT_DTYPES = ("float32", "float16", "fp8", "int8", "int4", "int2")
ROW_ALIGNMENT = 16
SCALE_BIAS_BYTES = 4
FP8_EXPONENT_BITS = 4
FP8_EXPONENT_BIAS = 7
INT8_EPSILON_CUDA = 1e-20  # FBGEMM's `_float_to_fused8bitrowwise_cuda_kernel` (`kEpsilon`)
INT8_EPSILON_CPU = 1e-8  # FBGEMM's CPU `FloatOrHalfToFused8BitRowwiseQuantizedSBFloat`
INT8_SEQUENTIAL_MAX_ROWS = 20  # FBGEMM's int8 CUDA op scans rows sequentially for tables of at most this many rows
F16_NAN = 0x7FFF  # what CUDA's float -> half conversion makes of every NaN

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
    """Header plus payload bytes of one row; `dim * bits` must fill whole bytes (FBGEMM's IntNBit TBE asserts the
    same: int4 needs an even dim, int2 a multiple of 4)."""
    if dim <= 0:
        raise ValueError(f"{dim=} must be > 0")
    if (dim * bits(wt)) % 8:
        raise ValueError(f"dim {dim} of a {wt} table: dim * {bits(wt)} bits must fill whole bytes "
                         f"({wt} needs dim % {8 // bits(wt)} == 0)")
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


# -- scalar conversions -------------------------------------------------------------------------------------------


def _fp16_bits_to_f32(h: jax.Array) -> jax.Array:
    """int32 holding fp16 bit patterns in its low 16 bits -> float32."""
    return jax.lax.bitcast_convert_type((h & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def f32_to_fp16_bits(x: jax.Array) -> jax.Array:
    """float32 -> int32 holding the fp16 bits CUDA's `__float2half` gives: round to nearest even, overflow to inf,
    every NaN to 0x7FFF."""
    h = jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16).astype(jnp.int32)
    return jnp.where(jnp.isnan(x), F16_NAN, h)


def _round_fp16(x: jax.Array) -> jax.Array:
    """float32 -> float32 value of its fp16 rounding (`__half2float(__float2half(x))`). The fp16 value sits
    behind an optimization barrier: with `xla_allow_excess_precision` (on by default) XLA's GPU compiler may drop
    an f32 -> f16 -> f32 round trip inside a fusion, keeping the unrounded value (the bytes of int4 / int2 rows
    then differed from FBGEMM's on the H200)."""
    return jax.lax.optimization_barrier(x.astype(jnp.float16)).astype(jnp.float32)


def _div(a, b) -> jax.Array:
    """IEEE float32 `a / b` (correctly rounded, as CUDA's `/` on floats). Two XLA behaviours stand in the way:
    XLA turns a division by a broadcast (a constant or a per-row value) into a multiplication by its reciprocal,
    and XLA's GPU backend divides float32 approximately (within 2 ulp, not rounded to nearest). So the quotient
    is computed in float64 (IEEE on both backends) and rounded once to float32, which is the correctly rounded
    float32 quotient (53 >= 2 * 24 + 2 bits: the double rounding cannot err), with a full-shaped divisor behind
    an optimization barrier."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    with jax.enable_x64(True):
        q = a.astype(jnp.float64) / jax.lax.optimization_barrier(b.astype(jnp.float64))
        return q.astype(jnp.float32)


def lrintf_int32(v: jax.Array) -> jax.Array:
    """`static_cast<int>(lrintf(v))` as CUDA computes it, float32 -> int32: round half to even to a 64-bit integer
    (saturating; NaN -> 0), then its low 32 bits."""
    r = jnp.round(v)
    small = jnp.abs(r) < 2.0 ** 31
    direct = jnp.where(small, r, 0.0).astype(jnp.int32)
    b = jax.lax.bitcast_convert_type(r, jnp.int32)
    s = ((b >> 23) & 0xFF) - 150  # r = m * 2^s with m the 24-bit significand; s >= 8 when |r| >= 2^31
    m = (b & 0x7FFFFF) | 0x800000
    mag = jnp.where(s < 32, m << jnp.clip(s, 0, 31), 0)  # low 32 bits of |r| (int32 arithmetic wraps)
    big = jnp.where(r > 0, mag, -mag)
    big = jnp.where(jnp.abs(r) >= 2.0 ** 63, jnp.where(r > 0, -1, 0), big)  # INT64_MAX / INT64_MIN, low halves
    return jnp.where(jnp.isnan(v), 0, jnp.where(small, direct, big))


# -- HFP8 ---------------------------------------------------------------------------------------------------------


def hfp8_max_pos(ebits: int = FP8_EXPONENT_BITS, bias: int = FP8_EXPONENT_BIAS) -> float:
    """FBGEMM's `FP8QuantizationConfig` max_position: the largest value the encoder produces (240 by default)."""
    return (1 << ((1 << ebits) - 2 - bias)) * (2 - 2.0 ** (ebits - 7))


def float_to_hfp8(x: jax.Array, ebits: int = FP8_EXPONENT_BITS, bias: int = FP8_EXPONENT_BIAS,
                  max_pos: float | None = None) -> jax.Array:
    """float32 -> int32 HFP8 codes (0..255), FBGEMM's `float_to_hfp8` on the integer bits: |x| clamped to
    `max_pos` (NaN and inf too), then round to nearest even to `7 - ebits` mantissa bits (normal codes, |x| >=
    2^(1-bias)) or to a multiple of 2^(1-bias-mbits) (subnormal codes); the sign bit is the input's."""
    mbits = 7 - ebits
    max_pos = hfp8_max_pos(ebits, bias) if max_pos is None else max_pos
    max_bits = struct.unpack("<i", struct.pack("<f", max_pos))[0]  # max_pos as a float32 (FBGEMM's float param)
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    sign = (b >> 31) & 1
    a = b & 0x7FFFFFFF
    a = jnp.where(a > max_bits, max_bits, a)  # fminf(|x|, max_pos): NaN and inf patterns lie above
    # normal: drop 23 - mbits bits, ties to even (a carry moves into the exponent), then rebias the exponent
    sh = 23 - mbits
    normal = ((a + (1 << (sh - 1)) - 1 + ((a >> sh) & 1)) >> sh) - ((127 - bias) << mbits)
    # subnormal: |x| / 2^(1-bias-mbits) rounded to nearest even; |x| = m * 2^(e - 150) (m = a's 24-bit significand)
    e = a >> 23
    m = jnp.where(e == 0, a, (a & 0x7FFFFF) | 0x800000)
    s = jnp.clip(151 - bias - mbits - jnp.maximum(e, 1), 1, 31)
    sub = (m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s
    mag = jnp.where(a >= (128 - bias) << 23, normal, sub)
    return (sign << 7) | (mag & 0x7F)


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


# -- row-wise integer quantization --------------------------------------------------------------------------------


def _minmax_scan(w: jax.Array):
    """Per-row (min, max) of FBGEMM's sequential scan `r = r <= x ? r : x` (max: `>=`): over the elements after
    the row's last NaN, NaN when the last element is NaN; ties keep the earlier element (so its zero sign)."""
    d = w.shape[1]
    j = jnp.arange(d, dtype=jnp.int32)
    last_nan = jnp.max(jnp.where(jnp.isnan(w), j, -1), axis=1, keepdims=True)
    tail = j > last_nan

    def first(val):  # the earliest tail element equal to val
        hit = tail & (w == val[:, None])
        pick = jnp.take_along_axis(w, jnp.argmax(hit, axis=1)[:, None], axis=1)[:, 0]
        return jnp.where(last_nan[:, 0] == d - 1, jnp.nan, pick)

    mn = jnp.min(jnp.where(tail, w, jnp.inf), axis=1)
    mx = jnp.max(jnp.where(tail, w, -jnp.inf), axis=1)
    return first(mn), first(mx)


def _minmax_ignore_nan(w: jax.Array):
    """Per-row (min, max) of `fminf` / `fmaxf` reductions from +inf / -inf: NaNs ignored (all NaN: +inf, -inf)."""
    nan = jnp.isnan(w)
    return jnp.min(jnp.where(nan, jnp.inf, w), axis=1), jnp.max(jnp.where(nan, -jnp.inf, w), axis=1)


def _int8_rows(w: jax.Array, epsilon: float):
    """(q int32 [E, D], scale fp16 bits [E], bias fp16 bits [E]) of FBGEMM's fused 8-bit row-wise op."""
    mn, mx = (_minmax_scan if w.shape[0] <= INT8_SEQUENTIAL_MAX_ROWS else _minmax_ignore_nan)(w)
    rng = mx - mn
    scale = _div(rng, 255.0)
    inverse = _div(255.0, rng + jnp.float32(epsilon))
    q = lrintf_int32((w - mn[:, None]) * inverse[:, None]) & 0xFF
    return q, f32_to_fp16_bits(scale), f32_to_fp16_bits(mn)


def _nbit_rows(w: jax.Array, nbits: int):
    """(q int32 [E, D], scale fp16 bits [E], bias fp16 bits [E]) of FBGEMM's fused N-bit row-wise op (fp16 scale
    and bias)."""
    top = (1 << nbits) - 1
    mn, mx = _minmax_scan(w)
    mn = _round_fp16(mn)
    rng = mx - mn
    scale = _round_fp16(jnp.where(rng == 0, jnp.float32(1), _div(rng, float(top))))
    scale = jnp.where(scale == 0, jnp.float32(1), scale)
    inverse = _div(1.0, scale)
    bad = jnp.isinf(inverse)
    scale = jnp.where(bad, jnp.float32(1), scale)
    inverse = jnp.where(bad, jnp.float32(1), inverse)
    q = jnp.clip(lrintf_int32((w - mn[:, None]) * inverse[:, None]), 0, top)
    return q, f32_to_fp16_bits(scale), f32_to_fp16_bits(mn)


def _pack(q: jax.Array, nbits: int) -> jax.Array:
    """int32 `[E, D]` values of `nbits` bits -> uint8 `[E, D * nbits / 8]`, value j at bits `nbits * (j % per)` of
    byte `j // per` (per = 8 / nbits)."""
    e, d = q.shape
    per = 8 // nbits
    shifts = jnp.arange(per, dtype=jnp.int32) * nbits
    return jnp.sum(q.reshape(e, d // per, per) << shifts, axis=2).astype(jnp.uint8)


def _bytes_of(x: jax.Array) -> jax.Array:
    """`[E, D]` array of a 2- or 4-byte dtype -> uint8 `[E, D * itemsize]` (little-endian)."""
    e, d = x.shape
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(e, d * x.dtype.itemsize)


def quantize_rows(w: jax.Array, wt: str, *, int8_epsilon: float = INT8_EPSILON_CUDA) -> jax.Array:
    """float32 `[E, D]` -> uint8 `[E, row_bytes(D, wt)]`: the rows FBGEMM's IntNBit TBE stores for `w` after
    `quantize_embs` (its CUDA quantize ops) and `assign_embedding_weights`, byte for byte (the module docstring
    gives the arithmetic and what it does with NaN, inf and constant rows). Jittable with `wt` static.

    Args:
      w: the float table (other float dtypes are widened to float32 first).
      wt: one of `WEIGHT_DTYPES`.
      int8_epsilon: the int8 op's `range + epsilon` (FBGEMM's CUDA op 1e-20, its CPU op 1e-8).
    """
    nb = bits(wt)
    if w.ndim != 2:
        raise ValueError(f"w of shape {w.shape}: expected [rows, dim]")
    e, d = w.shape
    total = row_bytes(d, wt)  # checks d
    w = jnp.asarray(w).astype(jnp.float32)
    if wt == "float32":
        body = _bytes_of(w)
    elif wt == "float16":
        body = _bytes_of(f32_to_fp16_bits(w).astype(jnp.uint16))
    elif wt == "fp8":
        body = float_to_hfp8(w).astype(jnp.uint8)
    else:
        q, scale, bias = _int8_rows(w, int8_epsilon) if wt == "int8" else _nbit_rows(w, nb)
        header = _bytes_of((scale | (bias << 16))[:, None])
        body = jnp.concatenate([header, _pack(q, nb)], axis=1)
    return jnp.pad(body, ((0, 0), (0, total - body.shape[1])))


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
