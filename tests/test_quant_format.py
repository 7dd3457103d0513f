"""FBGEMM IntNBit row formats (tbe_jax/quant_format.py) against NumPy models written from FBGEMM 1.6.0's source.

The quantize model follows FBGEMM's CUDA quantize ops statement by statement in NumPy float32 arithmetic (IEEE,
round to nearest even, no flush of subnormals): `_float_to_fused8bitrowwise_cuda_kernel` and its two-kernel
variant (int8), `_float_to_fusednbitrowwise_cuda_kernel` (int4 / int2), `float_to_hfp8` with its float "bouncer"
additions (fp8), NumPy's own float -> half conversion (fp16). The dequantize model is float64. quantize_rows must
give the model's bytes exactly; the error bounds below are derived in the comments of each test.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tbe_jax import quant_format as qf

F32 = np.float32
INT_TYPES = ("int8", "int4", "int2")
TOP = {"int8": 255, "int4": 15, "int2": 3}
ULP_STEP = 2.0 ** -24


# -- NumPy models of FBGEMM's quantize ops ------------------------------------------------------------------------

def np_f16_bits(x):
    """CUDA `__float2half` bits (round to nearest even; every NaN -> 0x7FFF)."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16).view(np.uint16).astype(np.int64)
    return np.where(np.isnan(x), 0x7FFF, h)


def np_round_f16(x):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def np_lrintf(v):
    """CUDA lrintf as int64 values: round half to even, saturating, NaN -> 0."""
    r = np.rint(np.asarray(v, np.float32)).astype(np.float64)
    out = np.zeros(r.shape, np.int64)
    mid = np.isfinite(r) & (np.abs(r) < 2.0 ** 63)
    out[mid] = r[mid].astype(np.int64)
    out[r >= 2.0 ** 63] = np.iinfo(np.int64).max
    out[r <= -2.0 ** 63] = np.iinfo(np.int64).min
    return out


def np_int_cast(v):
    """`static_cast<int>` of int64 values (their low 32 bits, signed)."""
    low = np.asarray(v, np.int64) & 0xFFFFFFFF
    return np.where(low >= 2 ** 31, low - 2 ** 32, low)


def np_scan(w, is_min):
    """fbgemm_gpu::min / max: `r = *from; r = (r <= next) ? r : next` (max: `>=`), column by column."""
    r = w[:, 0].copy()
    for j in range(1, w.shape[1]):
        x = w[:, j]
        with np.errstate(invalid="ignore"):
            keep = (r <= x) if is_min else (r >= x)
        r = np.where(keep, r, x)
    return r


def np_int8(w, eps=1e-20):
    """(q, scale16 bits, bias16 bits) of FloatToFused8BitRowwiseQuantized on CUDA + quantize_embs' fp16 cast."""
    w = np.asarray(w, np.float32)
    if w.shape[0] <= 20:  # the one-kernel path: sequential scans
        mn, mx = np_scan(w, True), np_scan(w, False)
    else:  # _get_8bit_qparam_cuda_kernel: fminf / fmaxf from +inf / -inf
        mn = np.fmin.reduce(w, axis=1, initial=np.inf).astype(F32)
        mx = np.fmax.reduce(w, axis=1, initial=-np.inf).astype(F32)
    with np.errstate(all="ignore"):
        rng = mx - mn
        scale = rng / F32(255.0)
        inverse = F32(255.0) / (rng + F32(eps))
        q = np_lrintf((w - mn[:, None]) * inverse[:, None]) & 0xFF
    return q, np_f16_bits(scale), np_f16_bits(mn)


def np_nbit(w, nbits):
    """(q, scale16 bits, bias16 bits) of FloatToFusedNBitRowwiseQuantizedSBHalf (the CUDA kernel)."""
    w = np.asarray(w, np.float32)
    top = (1 << nbits) - 1
    mn, mx = np_scan(w, True), np_scan(w, False)
    with np.errstate(all="ignore"):
        mn = np_round_f16(mn)
        rng = mx - mn
        scale = np_round_f16(np.where(rng == 0, F32(1.0), rng / F32(top)))
        scale = np.where(scale == 0, F32(1.0), scale)
        inverse = F32(1.0) / scale
        bad = np.isinf(inverse)
        scale = np.where(bad, F32(1.0), scale)
        inverse = np.where(bad, F32(1.0), inverse)
        q = np.clip(np_int_cast(np_lrintf((w - mn[:, None]) * inverse[:, None])), 0, top)
    return q, np_f16_bits(scale), np_f16_bits(mn)


def np_hfp8(x, ebits=4, bias=7, max_pos=240.0):
    """float_to_hfp8, literally: fminf clamp, then the float bouncer additions (round to nearest even)."""
    x = np.asarray(x, np.float32)
    mbits = 7 - ebits
    i = x.view(np.uint32).astype(np.uint64)
    sign = i & 0x80000000
    with np.errstate(all="ignore"):
        a = np.fmin((i & 0x7FFFFFFF).astype(np.uint32).view(np.float32), F32(max_pos))
        smallest_normal = np.array((127 - bias + 1) << 23, np.uint32).view(np.float32)
        ai = a.view(np.uint32).astype(np.uint64)
        bouncer = ((ai & 0xFF800000) + ((23 - mbits) << 23)).astype(np.uint32).view(np.float32)
        v = (bouncer + a) - bouncer
        vi = v.view(np.uint32).astype(np.uint64)
        vi = ((vi - ((127 - bias) << 23)) << (8 - ebits)) & 0xFFFFFFFF
        normal = ((vi | sign) >> 24) & 0xFF
        sub_bouncer = np.array((127 + (23 + (1 - bias - mbits))) << 23, np.uint32).view(np.float32)
        s = (sub_bouncer + a).view(np.uint32).astype(np.uint64)
        sub = (s | (sign >> 24)) & 0xFF
    return np.where(a >= smallest_normal, normal, sub).astype(np.int64)


def np_pack(q, nbits):
    e, d = q.shape
    per = 8 // nbits
    q = q.reshape(e, d // per, per)
    out = np.zeros((e, d // per), np.int64)
    for k in range(per):
        out |= q[:, :, k] << (nbits * k)
    return out.astype(np.uint8)


def np_quantize_rows(w, wt, eps=1e-20):
    """The IntNBit TBE row bytes: [scale16][bias16] in front (assign_embedding_weights), payload, zeros to 16."""
    w = np.asarray(w, np.float32)
    e, d = w.shape
    if wt == "float32":
        body = w.view(np.uint8).reshape(e, 4 * d)
    elif wt == "float16":
        body = np_f16_bits(w).astype(np.uint16).view(np.uint8).reshape(e, 2 * d)
    elif wt == "fp8":
        body = np_hfp8(w).astype(np.uint8)
    else:
        q, s, b = np_int8(w, eps) if wt == "int8" else np_nbit(w, qf.bits(wt))
        head = np.stack([s & 0xFF, s >> 8, b & 0xFF, b >> 8], axis=1).astype(np.uint8)
        body = np.concatenate([head, np_pack(q, qf.bits(wt))], axis=1)
    total = -(-body.shape[1] // 16) * 16
    return np.pad(body, ((0, 0), (0, total - body.shape[1])))


# -- float64 dequantize model -------------------------------------------------------------------------------------

def np_f16_value(bits16):
    return np.asarray(bits16, np.uint16).view(np.float16).astype(np.float64)


def np_hfp8_value(code, ebits=4, bias=7):
    code = np.asarray(code, np.int64)
    mbits = 7 - ebits
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = (code & ((1 << mbits) - 1)).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - mbits), 2.0 ** (e - bias) * (1 + m / 2 ** mbits))
    return np.where(code & 0x80, -mag, mag)


def np_fields(rows, wt, d):
    """(q int64 [E, D], scale float64 [E], bias float64 [E]) of integer rows."""
    rows = np.asarray(rows, np.uint8)
    nb = qf.bits(wt)
    per = 8 // nb
    j = np.arange(d)
    q = (rows[:, 4 + j // per].astype(np.int64) >> (nb * (j % per))) & ((1 << nb) - 1)
    s = rows[:, 0].astype(np.int64) | (rows[:, 1].astype(np.int64) << 8)
    b = rows[:, 2].astype(np.int64) | (rows[:, 3].astype(np.int64) << 8)
    return q, np_f16_value(s), np_f16_value(b)


def np_dequantize_rows(rows, wt, d):
    """float64 [E, D]: q * scale + bias (exact in float64), or the fp8 / fp16 / fp32 values."""
    rows = np.asarray(rows, np.uint8)
    e = rows.shape[0]
    if wt == "float32":
        return rows[:, :4 * d].copy().view(np.float32).astype(np.float64)
    if wt == "float16":
        return rows[:, :2 * d].copy().view(np.float16).astype(np.float64)
    if wt == "fp8":
        return np_hfp8_value(rows[:, :d])
    q, s, b = np_fields(rows, wt, d)
    with np.errstate(invalid="ignore"):
        return q * s[:, None] + b[:, None] if e else np.zeros((0, d))


# -- tables -------------------------------------------------------------------------------------------------------

def random_table(rng, e, d, spread=(-5, 3)):
    """Rows of mixed scales: each row offset + scale * N(0, 1), scale 10^U(spread), |offset| up to 3 scales."""
    scale = 10.0 ** rng.uniform(*spread, size=(e, 1))
    offset = rng.standard_normal((e, 1)) * scale * rng.uniform(0, 3, size=(e, 1))
    return (offset + scale * rng.standard_normal((e, d))).astype(np.float32)


DIMS = {"float32": (13, 64), "float16": (13, 64), "fp8": (13, 64), "int8": (13, 64, 3),
        "int4": (2, 6, 14, 64), "int2": (4, 12, 64)}
CASES = [(wt, d) for wt, ds in DIMS.items() for d in ds]


_quantize = jax.jit(qf.quantize_rows, static_argnums=1, static_argnames="int8_epsilon")


def quantize(w, wt, **kw):
    return np.asarray(_quantize(jnp.asarray(w), wt, **kw))


def assert_bytes_equal(got, want):
    assert got.shape == want.shape and got.dtype == np.uint8
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} bytes differ, first at (row, byte) {tuple(bad[0])}: " \
                          f"got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}"


# -- layout -------------------------------------------------------------------------------------------------------

def test_row_sizes_match_fbgemm():
    # FBGEMM's unpadded_row_size_in_bytes (split_table_batched_embeddings_ops_inference.py), rounded up to 16
    fb = {"float32": lambda d: 4 * d, "float16": lambda d: 2 * d, "fp8": lambda d: d, "int8": lambda d: d + 4,
          "int4": lambda d: d // 2 + 4, "int2": lambda d: d // 4 + 4}
    for wt, f in fb.items():
        for d in range(4, 520, 4):
            assert qf.row_bytes(d, wt) == -(-f(d) // 16) * 16, (wt, d)
    assert [qf.row_bytes(128, wt) for wt in qf.WEIGHT_DTYPES] == [512, 256, 128, 144, 80, 48]
    assert qf.row_bytes(13, "int8") == 32 and qf.row_bytes(2, "int4") == 16 and qf.row_bytes(13, "fp8") == 16


@pytest.mark.parametrize("wt,d", [("int4", 3), ("int4", 13), ("int2", 2), ("int2", 6), ("int8", 0), ("fp8", -1)])
def test_dims_that_do_not_fill_bytes_are_refused(wt, d):
    with pytest.raises(ValueError, match="dim"):
        qf.row_bytes(d, wt)
    with pytest.raises(ValueError, match="dim"):
        qf.quantize_rows(jnp.ones((2, max(d, 0)), jnp.float32), wt)


def test_bad_arguments():
    with pytest.raises(ValueError, match="weight dtype"):
        qf.quantize_rows(jnp.ones((2, 8)), "int3")
    with pytest.raises(ValueError, match="rows, dim"):
        qf.quantize_rows(jnp.ones((8,)), "int8")


@pytest.mark.parametrize("wt,d", CASES)
def test_row_size_padding_and_header(wt, d):
    rng = np.random.default_rng(d)
    w = random_table(rng, 40, d)
    rows = quantize(w, wt)
    assert rows.shape == (40, qf.row_bytes(d, wt)) and rows.dtype == np.uint8
    used = qf.unpadded_row_bytes(d, wt)
    assert used == d * qf.bits(wt) // 8 + (4 if wt in INT_TYPES else 0)
    assert not rows[:, used:].any(), "padding must be zero"
    if wt in INT_TYPES:  # the header is the fp16 scale, then the fp16 bias (the row's min rounded to fp16)
        _, s, b = np_fields(rows, wt, d)
        np.testing.assert_array_equal(b, np_round_f16(w.min(axis=1)).astype(np.float64) if wt != "int8"
                                      else w.min(axis=1).astype(np.float16).astype(np.float64))
        assert (s > 0).all()


def test_packed_value_order():
    # a row whose values are its own codes: value j = j % levels, so the payload spells the nibble order out
    for wt, d in (("int4", 32), ("int2", 32), ("int8", 16)):
        top = TOP[wt]
        w = (np.arange(d) % (top + 1)).astype(np.float32)[None, :]
        w[0, -1] = top  # range = top, so scale 1 and bias 0: q = value
        rows = quantize(w, wt)
        q, s, b = np_fields(rows, wt, d)
        assert s[0] == 1.0 and b[0] == 0.0
        np.testing.assert_array_equal(q[0], w[0].astype(np.int64))
    rows = quantize(np.array([[1.0, 2.0, 3.0, 0.0] * 2], np.float32), "int4")
    # range 3: scale fp16(0.2) = 0.19995, so values 1 and 2 quantize to 5 and 10; value 0 is the low nibble
    assert rows[0, 4] == 5 | 10 << 4 and rows[0, 5] == 15 | 0 << 4


def test_words_round_trip():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, size=(9, 48), dtype=np.uint8)
    words = qf.to_words(jnp.asarray(rows))
    assert words.shape == (9, 12) and words.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(words), rows.view("<i4"))
    np.testing.assert_array_equal(np.asarray(qf.from_words(words)), rows)
    w = random_table(rng, 5, 64)
    r = quantize(w, "int4")
    word0 = np.asarray(qf.to_words(jnp.asarray(r)))[:, 0]
    np.testing.assert_array_equal(word0 & 0xFFFF, r[:, 0].astype(np.int64) | r[:, 1].astype(np.int64) << 8)
    np.testing.assert_array_equal((word0 >> 16) & 0xFFFF, r[:, 2].astype(np.int64) | r[:, 3].astype(np.int64) << 8)


# -- bytes against the model --------------------------------------------------------------------------------------

@pytest.mark.parametrize("wt,d", CASES)
def test_bytes_match_model_random(wt, d):
    rng = np.random.default_rng(100 + d)
    for e, spread in ((300, (-5, 3)), (7, (-3, 2))):  # > 20 and <= 20 rows (int8's two CUDA paths)
        w = random_table(rng, e, d, spread)
        assert_bytes_equal(quantize(w, wt), np_quantize_rows(w, wt))


@pytest.mark.parametrize("wt", qf.WEIGHT_DTYPES)
def test_bytes_match_model_edge_rows(wt):
    d = 16
    rng = np.random.default_rng(7)
    rows = [
        np.full(d, 0.0), np.full(d, 1.0), np.full(d, -3.25), np.full(d, 1.0004), np.full(d, 40000.5),  # constant
        np.full(d, 1e-30), np.linspace(0, 1e-7, d), np.linspace(-1e-12, 1e-12, d),  # tiny ranges
        np.linspace(-3e4, 3e4, d), np.linspace(1000.0, 1000.01, d), np.linspace(-60000, 60000, d),  # huge
        np.linspace(2.0 ** -7, 250.0, d), np.linspace(-300, 300, d), np.arange(d) * 0.5,  # fp8 clamp, ties
        np.r_[np.zeros(d - 1), 1e-3], rng.standard_normal(d) * 1e-5, rng.standard_normal(d) * 1e4,
        np.arange(d) / 15.0, np.arange(d) / 3.0, np.arange(d) * (255 / (d - 1)) / 255.0,  # exact-grid rows
    ]
    w = np.stack(rows).astype(np.float32)
    for table in (w, np.concatenate([w] * 2)):  # 20 rows and 40 rows
        assert_bytes_equal(quantize(table, wt), np_quantize_rows(table, wt))


@pytest.mark.parametrize("wt", qf.WEIGHT_DTYPES)
@pytest.mark.parametrize("e", [6, 30])
def test_bytes_match_model_nan_inf_rows(wt, e):
    d = 8
    rng = np.random.default_rng(e)
    w = random_table(rng, e, d)
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    w[0, 3] = nan                      # a NaN inside
    w[1, -1] = nan                     # a NaN last: the scans give NaN
    w[2, 0] = nan                      # a NaN first
    w[3, 2] = inf                      # +inf
    w[4, 5] = -inf                     # -inf
    w[5, :] = nan                      # all NaN
    if e > 6:
        w[6, 1], w[6, 4] = inf, -inf
        w[7, 2], w[7, 6] = -nan, nan
        w[8, :] = inf
    assert_bytes_equal(quantize(w, wt), np_quantize_rows(w, wt))


def test_special_rows_as_documented():
    d = 8
    w = np.zeros((24, d), np.float32) + np.arange(d, dtype=np.float32)
    w[0, 3] = np.nan
    w[1, 2] = np.inf
    w[2, :] = np.nan
    w[3, :] = 5.0
    w[4, :] = 1.0004  # not an fp16 value
    i8 = quantize(w, "int8")
    q, s, b = np_fields(i8, "int8", d)
    assert q[0, 3] == 0 and s[0] == np.float16(F32(7) / F32(255)) and b[0] == 0  # NaN ignored (> 20 rows)
    assert np.isinf(s[1]) and (q[1] == 0).all()                   # inf row: scale inf, q = 0
    assert s[2] == -np.inf and b[2] == np.inf and (q[2] == 0).all()  # all NaN
    assert s[3] == 0 and b[3] == 5.0 and (q[3] == 0).all()       # constant row
    i4 = quantize(w, "int4")
    q, s, b = np_fields(i4, "int4", d)
    assert np.isnan(b[2]) and np.isnan(s[2]) and int(i4[2, 0]) | int(i4[2, 1]) << 8 == 0x7FFF  # CUDA's canonical NaN
    assert s[3] == 1.0 and b[3] == 5.0 and (q[3] == 0).all()
    assert b[4] != 1.0004 and q[4, 0] > 0 and abs(b[4] + q[4, 0] * s[4] - 1.0004) < 1e-6
    assert np.isinf(s[1]) and (q[1] == 0).all()
    f8 = quantize(np.array([[np.nan, -np.nan, np.inf, -np.inf, 1e9, -250.0, 240.0, 0.0]], np.float32), "fp8")
    assert list(f8[0, :8]) == [0x77, 0xF7, 0x77, 0xF7, 0x77, 0xF7, 0x77, 0x00]
    f16 = quantize(np.array([[np.nan, -np.nan, 65520.0, 65519.0, -1e6, 2.0 ** -25, 2.0 ** -24, 1.0]], np.float32),
                   "float16").view(np.uint16)
    assert list(f16[0, :8]) == [0x7FFF, 0x7FFF, 0x7C00, 0x7BFF, 0xFC00, 0x0000, 0x0001, 0x3C00]


def test_int8_epsilon_is_cuda_by_default():
    w = np.stack([np.linspace(0, r, 16) for r in (1e-9, 3e-8, 1e-6, 0.1)]).astype(np.float32)
    cuda, cpu = quantize(w, "int8"), quantize(w, "int8", int8_epsilon=qf.INT8_EPSILON_CPU)
    assert_bytes_equal(cuda, np_quantize_rows(w, "int8"))
    assert_bytes_equal(cpu, np_quantize_rows(w, "int8", eps=1e-8))
    assert (cuda != cpu).any()  # ranges near 1e-8 quantize differently on FBGEMM's CPU op


def test_jit_equals_eager():
    rng = np.random.default_rng(3)
    w = jnp.asarray(random_table(rng, 50, 12))
    w = w.at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf)
    fn = jax.jit(qf.quantize_rows, static_argnums=1)
    for wt in qf.WEIGHT_DTYPES:
        np.testing.assert_array_equal(np.asarray(fn(w, wt)), np.asarray(qf.quantize_rows(w, wt)))
    deq = jax.jit(qf.dequantize_rows, static_argnums=(1, 2))
    r = qf.quantize_rows(w[2:], "int4")
    np.testing.assert_array_equal(np.asarray(deq(r, "int4", 12)), np.asarray(qf.dequantize_rows(r, "int4", 12)))


def test_empty_table():
    for wt in qf.WEIGHT_DTYPES:
        assert quantize(np.zeros((0, 8), np.float32), wt).shape == (0, qf.row_bytes(8, wt))


# -- scalar pieces ------------------------------------------------------------------------------------------------

def test_lrintf_int32():
    rng = np.random.default_rng(5)
    v = np.concatenate([
        np.arange(-10, 10, 0.25), rng.standard_normal(2000) * 10.0 ** rng.uniform(0, 25, 2000),
        [2.0 ** 31, -2.0 ** 31, 2.0 ** 31 + 256, 2.0 ** 32, 2.0 ** 40 + 2 ** 17, -(2.0 ** 45) - 2 ** 22, 2.0 ** 63,
         -(2.0 ** 63), 1e30, -1e30, np.inf, -np.inf, np.nan, 0.5, 1.5, 2.5, -0.5, -1.5, 8388609.0],
    ]).astype(np.float32)
    got = np.asarray(qf.lrintf_int32(jnp.asarray(v)))
    np.testing.assert_array_equal(got, np_int_cast(np_lrintf(v)))


def test_f32_to_fp16_bits():
    rng = np.random.default_rng(6)
    pats = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # plus every float32 around the fp16 normal/subnormal/overflow boundaries
    edges = [np.float32(v).view(np.uint32) for v in (65504.0, 65520.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 1.0)]
    near = np.concatenate([np.arange(int(p) - 4096, int(p) + 4096) for p in edges]).astype(np.uint32)
    pats = np.concatenate([pats, near, near | 0x80000000])
    x = pats.view(np.float32)
    x = x[(np.abs(x) >= 2.0 ** -126) | (x == 0) | np.isnan(x)]  # float32 subnormals: XLA reads them as zero
    np.testing.assert_array_equal(np.asarray(qf.f32_to_fp16_bits(jnp.asarray(x))), np_f16_bits(x))


def test_division_is_ieee():
    # the rewrite this guards against: x / 255 as x * (1/255) differs in the last bit for most x
    rng = np.random.default_rng(8)
    x = np.abs(rng.standard_normal(100_000) * 10.0 ** rng.uniform(-30, 30, 100_000)).astype(np.float32)
    for c in (255.0, 15.0, 3.0):
        got = np.asarray(jax.jit(lambda a: qf._div(a, c))(jnp.asarray(x)))
        np.testing.assert_array_equal(got.view(np.uint32), (x / F32(c)).view(np.uint32))


# -- fp8 ----------------------------------------------------------------------------------------------------------

def test_fp8_all_codes():
    codes = np.arange(256)
    dec = np.asarray(qf.hfp8_to_float(jnp.asarray(codes, jnp.int32)))
    want = np_hfp8_value(codes)
    np.testing.assert_array_equal(dec.astype(np.float64), want)  # every code decodes exactly, no inf / NaN
    assert np.isfinite(dec).all() and dec[0x77] == 240.0 and dec[0x01] == 2.0 ** -9 and dec[0x08] == 2.0 ** -6
    assert np.signbit(dec[0x80]) and dec[0x80] == 0
    # every code the encoder can produce (|value| <= max_pos) encodes back to itself; the exponent-15 codes
    # (256..480) lie above max_pos and clamp to 240
    enc = np.asarray(qf.float_to_hfp8(jnp.asarray(dec)))
    np.testing.assert_array_equal(enc, np_hfp8(dec))
    ok = np.abs(want) <= 240
    np.testing.assert_array_equal(enc[ok], codes[ok])
    np.testing.assert_array_equal(enc[~ok], np.where(codes[~ok] & 0x80, 0xF7, 0x77))
    assert qf.hfp8_max_pos() == 240.0


def test_fp8_rounds_to_nearest_even():
    vals = np.sort(np_hfp8_value(np.arange(0x78)))  # the non-negative codes up to 240
    lo, hi = vals[:-1], vals[1:]
    mid = ((lo + hi) / 2).astype(np.float32)  # exact in float32
    assert (mid.astype(np.float64) == (lo + hi) / 2).all()
    codes_lo = np.asarray(qf.float_to_hfp8(jnp.asarray(lo.astype(np.float32))))
    codes_hi = codes_lo + 1
    got = np.asarray(qf.float_to_hfp8(jnp.asarray(mid)))
    np.testing.assert_array_equal(got, np.where(codes_lo % 2 == 0, codes_lo, codes_hi))  # ties to the even code
    below = np.nextafter(mid, F32(0))
    above = np.nextafter(mid, F32(np.inf))
    np.testing.assert_array_equal(np.asarray(qf.float_to_hfp8(jnp.asarray(below))), codes_lo)
    np.testing.assert_array_equal(np.asarray(qf.float_to_hfp8(jnp.asarray(above))), codes_hi)
    np.testing.assert_array_equal(np.asarray(qf.float_to_hfp8(jnp.asarray(-mid))), 0x80 | got)
    for x in (below, above, mid):  # the integer encoder equals FBGEMM's float bouncer arithmetic
        np.testing.assert_array_equal(np.asarray(qf.float_to_hfp8(jnp.asarray(x))), np_hfp8(x))


def test_fp8_encoder_random_and_other_configs():
    rng = np.random.default_rng(9)
    pats = rng.integers(0, 2 ** 32, size=300_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([pats.view(np.float32), (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-4, 3, 100_000))
                        .astype(np.float32), np.float32([1e-45, -1e-45, 1e-39, 0.0, -0.0])])
    np.testing.assert_array_equal(np.asarray(qf.float_to_hfp8(jnp.asarray(x))), np_hfp8(x))
    for ebits, bias in ((5, 15), (3, 3), (4, 8)):
        mp = qf.hfp8_max_pos(ebits, bias)
        got = np.asarray(qf.float_to_hfp8(jnp.asarray(x), ebits, bias, mp))
        np.testing.assert_array_equal(got, np_hfp8(x, ebits, bias, mp))
        ok = np.isfinite(x) & (np.abs(x) <= mp)
        dec = np.asarray(qf.hfp8_to_float(jnp.asarray(got), ebits, bias)).astype(np.float64)
        np.testing.assert_array_equal(dec, np_hfp8_value(got, ebits, bias))
        # round to nearest: within half a step of the code's binade (the subnormal step below 2^(1-bias))
        step = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(x[ok].astype(np.float64)), 1e-300)))
                                  - (7 - ebits)),
                          2.0 ** (1 - bias - (7 - ebits)))
        assert (np.abs(dec[ok] - x[ok]) <= step / 2).all()


# -- dequantization and error bounds ------------------------------------------------------------------------------

@pytest.mark.parametrize("wt,d", CASES)
def test_dequantize_rows_is_exact_float32_of_the_model(wt, d):
    # q * scale is exact in float32 (8 x 11 bits), so ours is the float32 rounding of the exact value
    w = random_table(np.random.default_rng(200 + d), 64, d)
    rows = quantize(w, wt)
    got = np.asarray(jax.jit(qf.dequantize_rows, static_argnums=(1, 2))(jnp.asarray(rows), wt, d))
    assert got.dtype == np.float32 and got.shape == (64, d)
    np.testing.assert_array_equal(got, np_dequantize_rows(rows, wt, d).astype(np.float32))


@pytest.mark.parametrize("d", [8, 64])
def test_int8_error_bound(d):
    # q = rint(u), u = (x - min) * fl(255 / fl(range + eps)) in float32 (relative error <= 4 ulp-halves), scale
    # s = fl(range / 255), stored s16 = fp16(s), b16 = fp16(min). With t = x - min in [0, range]:
    #   |t - q s| <= s / 2 + eps + 5 * 2^-24 t,   x - (q s16 + b16) = (t - q s) + q (s - s16) + (min - b16)
    # so |x - x^| <= s / 2 + q |s - s16| + |min - b16| + 5 * 2^-24 (x - min) + eps: half a step plus the fp16
    # rounding of the scale (times q <= 255) and of the bias.
    rng = np.random.default_rng(d)
    w = random_table(rng, 500, d, spread=(-6, 2))
    rows = quantize(w, "int8")
    q, s16, b16 = np_fields(rows, "int8", d)
    x = w.astype(np.float64)
    mn = w.min(axis=1).astype(np.float64)
    s = (np.ptp(w, axis=1) / F32(255)).astype(np.float64)  # float32 range, float32 division
    err = np.abs(x - (q * s16[:, None] + b16[:, None]))
    bound = (s / 2)[:, None] + q * np.abs(s - s16)[:, None] + np.abs(mn - b16)[:, None] \
        + 5 * ULP_STEP * (x - mn[:, None]) + 1e-20
    assert (err <= bound * (1 + 1e-12)).all()
    assert (err.max(axis=1) > 0.3 * s).mean() > 0.9  # the bound is not loose: rows reach ~ half a step


@pytest.mark.parametrize("wt", ["int4", "int2"])
def test_nbit_error_bound(wt):
    # The stored grid is b16 + k s16, k = 0..top (s16, b16 the same fp16 values the op quantizes with).
    # u = (x - b16) * fl(1 / s16) in float32 is (x - b16) / s16 within 3 ulp-halves; q = clamp(rint(u)). Unclamped:
    # |x - x^| <= |s16| / 2 + 3 * 2^-24 |x - b16|; clamped, x^ is the grid's nearest end, |x - x^| = dist(x, grid).
    # A row's values lie in [min, max]; the grid spans [b16, b16 + top s16] with b16 = fp16(min) and
    # s16 = fp16((max - b16) / top), so dist(x, grid) <= max(b16 - min, top (s - s16)): the fp16 rounding of the
    # bias and of the scale (times top).
    d = 64 if wt == "int4" else 32
    top = TOP[wt]
    w = random_table(np.random.default_rng(11), 500, d, spread=(-6, 2))
    rows = quantize(w, wt)
    q, s16, b16 = np_fields(rows, wt, d)
    x = w.astype(np.float64)
    deq = q * s16[:, None] + b16[:, None]
    lo = np.minimum(b16, b16 + top * s16)[:, None]
    hi = np.maximum(b16, b16 + top * s16)[:, None]
    dist = np.maximum(lo - x, 0) + np.maximum(x - hi, 0)
    err = np.abs(x - deq)
    bound = np.maximum(np.abs(s16)[:, None] / 2 + 4 * ULP_STEP * np.abs(x - b16[:, None]), dist)
    assert (err <= bound * (1 + 1e-12)).all()
    mn, mx = x.min(axis=1), x.max(axis=1)
    s_exact = (mx - b16) / top
    row_dist = np.maximum(np.maximum(b16 - mn, 0), top * np.maximum(s_exact - s16, 0))
    assert (dist.max(axis=1) <= row_dist * (1 + 1e-9) + 1e-300).all()
    assert (err.max(axis=1) > 0.3 * np.abs(s16)).mean() > 0.9


def test_fp16_and_fp8_error_bounds():
    rng = np.random.default_rng(12)
    w = random_table(rng, 200, 32, spread=(-6, 4))
    x = w.astype(np.float64)
    f16 = np_dequantize_rows(quantize(w, "float16"), "float16", 32)
    ok = np.abs(x) <= 65504
    half_ulp = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-300))) - 11), 2.0 ** -25)
    assert (np.abs(f16 - x)[ok] <= half_ulp[ok]).all()
    f8 = np_dequantize_rows(quantize(w, "fp8"), "fp8", 32)
    ok = np.abs(x) <= 240
    half_step = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-300))) - 4), 2.0 ** -10)
    assert (np.abs(f8 - x)[ok] <= half_step[ok]).all()
    np.testing.assert_array_equal(np.abs(f8[~ok]), 240.0)


# -- benchmarks/fbgemm_quant.py: its pure parts -------------------------------------------------------------------

def test_benchmark_workloads_and_inputs():
    from benchmarks import fbgemm_quant as fq

    cases = fq.workload_cases(["base", "mixed", "dims8-192/8"], [1, 16, 4096])
    assert [c.name for c in cases[:3]] == ["base@B4096", "base@B1", "base@B16"]  # own B first, no duplicate
    base = cases[0]
    assert base.rows == (100_000,) * 32 and base.dims == (128,) * 32 and base.bags == (20.0,) * 32
    mixed = [c for c in cases if c.name.startswith("dims")][0]
    assert set(mixed.dims) == set(range(8, 193, 8)) and all(d % 8 == 0 for d in mixed.dims)
    assert len([c for c in cases if c.name.startswith("mixed")][0].rows) == 33
    small = [c for c in cases if c.name == "base@B16"][0]
    i, o, w = fq.case_inputs(small, 0)
    assert o.shape == (32 * 16 + 1,) and len(i) == 32 * 16 * 20 and w is None and i.max() < 100_000
    shards = fq.shard_cases(3, 20261202)
    assert len(shards) == 3 and all(d % 8 == 0 for c in shards for d in c.dims)  # int4 / int2 need even dims
    i, o, w = fq.case_inputs(shards[0], 1)
    assert len(o) == shards[0].B * len(shards[0].rows) + 1 and o[-1] == len(i)
    for wt in ("int8", "int4", "int2"):
        assert not fq.check_dims_ok(wt, {"int8": 13, "int4": 6, "int2": 12}[wt]) and fq.check_dims_ok(wt, 64)


def test_benchmark_reference_and_bound():
    # dequantize64 is the exact value; its float32 rounding is ours; the bound covers FBGEMM's forward arithmetic
    # as quant_format's docstring describes it (each value rounded to fp16, float32 sums in bag order, fp16 output)
    from benchmarks import fbgemm_quant as fq

    rng = np.random.default_rng(21)
    for wt, d in (("int8", 13), ("int4", 64), ("int2", 12), ("fp8", 13), ("float16", 64), ("float32", 13)):
        w = fq.random_table(rng, 200, d)
        rows = quantize(w, wt)
        values = fq.dequantize64(rows, wt, d)
        np.testing.assert_array_equal(values, np_dequantize_rows(rows, wt, d))
        np.testing.assert_array_equal(values.astype(np.float32), np.asarray(qf.dequantize_rows(jnp.asarray(rows),
                                                                                             wt, d)))
        idx, off = fq.bags(rng, 200, 300, 8)
        assert (np.diff(off) == 0).any()
        want = fq.pooled(values, idx, off)
        h = values.astype(np.float16).astype(np.float32) if wt in INT_TYPES else values.astype(np.float32)
        acc = np.zeros((300, d), np.float32)
        for b in range(300):
            for r in idx[off[b]:off[b + 1]]:
                acc[b] += h[r]
        for out16 in (False, True):
            got = acc.astype(np.float16) if out16 else acc
            res = fq.compare(got, want, fq.fbgemm_error_bound(values, idx, off, wt, out16))
            assert res["within_bound"] and res["nonfinite"] == 0, (wt, out16, res)
            if wt in INT_TYPES or out16:  # the bound is not vacuous where FBGEMM rounds (fp8 sums are exact here)
                assert res["bound_used"] > 0.05, (wt, out16, res)
        assert np.all(want[np.diff(off) == 0] == 0)


def test_benchmark_byte_diff_and_tables():
    from benchmarks import fbgemm_quant as fq

    a = np.zeros((3, 16), np.uint8)
    b = a.copy()
    assert fq.byte_diff(a, b) == {"equal": True, "bytes_differing": 0, "rows_differing": 0}
    b[2, 5] = 7
    r = fq.byte_diff(a, b)
    assert not r["equal"] and r["first"] == [2, 5] and r["rows_differing"] == 1
    assert not fq.byte_diff(a, b[:2])["equal"]
    w = fq.special_table(30, 8)
    assert np.isnan(w[4]).all() and (w[5] == np.float32(1.0004)).all() and np.isinf(w[7]).all()
    rows = quantize(w, "int8")
    assert_bytes_equal(rows, np_quantize_rows(w, "int8"))
    big = fq.random_table(np.random.default_rng(0), 1000, 64)
    scale = np.ptp(big, axis=1) / 3
    assert scale.max() < 128  # int2's fp16 scale stays below FBGEMM's hmul(scale, 512) overflow


def test_benchmark_result_line():
    from benchmarks import fbgemm_quant as fq

    res = {"wt": "int8", "dim": 13, "bytes_vs_ours": {"equal": True},
           "forward_float16": {"max_abs_err": 1e-3, "rel_err": 1e-4, "bound_used": 0.5, "nonfinite": 0},
           "forward_float32": {"max_abs_err": None, "rel_err": None, "bound_used": None, "nonfinite": 12}}
    line = fq._line(res)
    assert "bytes equal" in line and "bound used 0.50" in line and "12 outputs non-finite" in line
    assert "ERROR" in fq._line({"wt": "int4", "dim": 6, "error": "RuntimeError: x"})
