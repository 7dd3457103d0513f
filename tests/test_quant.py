"""The inference TBE over quantized rows (`tbe_jax.quant`, issue 39).

The rows are built here, byte by byte in FBGEMM's IntNBit layout: random payload bytes under valid fp16 scale and
bias headers (int8/int4/int2), random HFP8 codes, random fp16 / fp32 values, and (in the main model) random
garbage in the 16-byte padding, which nothing may read into a result. The oracle is a float64 NumPy decode of those
bytes (`_np_rows`, written from the format's definition, sharing no code with the library) pooled by
`testing.numpy_pooled`; the kernels (interpret mode on CPU) and the XLA path are both checked against it.
"""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tbe_jax
from tbe_jax import quant_format, testing
from conftest import KERNEL_KW, assert_close, jaxpr_eqns

WTS = ("int8", "int4", "int2", "fp8", "float16", "float32")
BITS = {"int8": 8, "int4": 4, "int2": 2}


def _rows(rng, e, d, wt, garbage=False):
    """FBGEMM rows (uint8 `[e, row_bytes]`) of random content; `garbage`: random bytes in the padding too."""
    nb, used = quant_format.row_bytes(d, wt), quant_format.unpadded_row_bytes(d, wt)
    rows = rng.integers(0, 256, (e, nb)).astype(np.uint8) if garbage else np.zeros((e, nb), np.uint8)
    if wt in BITS:
        rows[:, 4:used] = rng.integers(0, 256, (e, used - 4))
        sb = np.stack([rng.uniform(0.002, 0.05, e), rng.uniform(-1, 1, e)], 1).astype(np.float16)
        rows[:, :4] = sb.view(np.uint8).reshape(e, 4)
    elif wt == "fp8":
        rows[:, :used] = rng.integers(0, 256, (e, used))
    else:
        rows[:, :used] = rng.standard_normal((e, d)).astype(wt).view(np.uint8).reshape(e, used)
    return rows


def _np_rows(rows, wt, d):
    """Float64 values of FBGEMM rows, from the format's definition."""
    rows = np.asarray(rows, np.uint8)
    if wt in ("float32", "float16"):
        return rows[:, : d * np.dtype(wt).itemsize].copy().view(wt).astype(np.float64)
    if wt == "fp8":  # 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0: subnormal
        c = rows[:, :d].astype(np.int64)
        e, m = (c >> 3) & 15, c & 7
        mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
        return np.where(c & 0x80, -mag, mag)
    nb = BITS[wt]
    stream = np.unpackbits(rows[:, 4 : 4 + d * nb // 8], axis=1, bitorder="little")
    q = stream.reshape(len(rows), d, nb).astype(np.int64) @ (1 << np.arange(nb))
    sb = rows[:, :4].copy().view(np.float16).astype(np.float64)
    return q * sb[:, :1] + sb[:, 1:]


def _batch(rng, num_rows, lengths, weighted=True, sizes=None):
    """ids (duplicates likely: small tables) for bags of the given lengths (feature-major; `sizes`: bags per
    feature, default equal), offsets, weights."""
    lengths = np.asarray(lengths)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    sizes = sizes or [len(lengths) // len(num_rows)] * len(num_rows)
    first = np.concatenate([[0], np.cumsum(sizes)])
    idx = np.concatenate([rng.integers(0, e, int(lengths[first[f] : first[f + 1]].sum()))
                          for f, e in enumerate(num_rows)]).astype(np.int32)
    psw = rng.uniform(0.5, 1.5, len(idx)).astype(np.float32) if weighted else None
    return idx, off, psw


# The main model: every weight type; odd dims (13) for int8 / fp8 / fp16 / fp32; two int8 and two int4 tables of
# different dims sharing a buffer (same row bytes); a table read by two features; padding full of garbage.
SPECS = [tbe_jax.TableSpec(e, d, name=f"t{i}") for i, (e, d) in enumerate(
    [(50, 13), (30, 16), (40, 24), (20, 8), (25, 36), (30, 13), (20, 13), (15, 13)])]
SPEC_WTS = ("int8", "int8", "int4", "int4", "int2", "fp8", "float16", "float32")
FMAP = list(range(8)) + [2]
B = 4


def _model(rng, **kw):
    qemb = tbe_jax.QuantizedTableBatchedEmbedding(SPECS, SPEC_WTS, feature_table_map=FMAP, **kw)
    rows = [_rows(rng, s.num_embeddings, s.embedding_dim, wt, garbage=True) for s, wt in zip(SPECS, SPEC_WTS)]
    return qemb, rows, [_np_rows(r, wt, s.embedding_dim) for r, s, wt in zip(rows, SPECS, SPEC_WTS)]


def _lengths(rng):
    """B bags per feature: empty bags, one long bag (40 ids), the rest 0..5."""
    lengths = rng.integers(0, 6, len(FMAP) * B)
    lengths[[0, 5, 13]] = 0
    lengths[9] = 40
    return lengths


def test_layout_groups_and_buffers():
    qemb = tbe_jax.QuantizedTableBatchedEmbedding(SPECS, SPEC_WTS, feature_table_map=FMAP)
    lay = qemb.layout
    assert [lay.buffer_key(b) for b in range(lay.num_buffers)] == [
        "int8_w8", "int4_w4", "int2_w4", "fp8_w4", "float16_w8", "float32_w16"]
    assert lay.buffer_rows[:2] == (80, 60) and lay.table_row_offset[:4] == (0, 50, 0, 40)
    assert lay.dims == (13, 16, 24, 8, 36, 13, 13, 13) and lay.group_buffer == (0, 0, 1, 1, 2, 3, 4, 5)
    plan = qemb.plan_for(len(FMAP) * B + 1)
    assert plan.group == (0, 1, 2, 3, 4, 5, 6, 7, 2) and plan.row_offset[:4] == (0, 50, 0, 40)


def test_every_weight_type_sum_weighted_matches_float64(rng):
    """Kernel and XLA path, weighted sum, fp32 output: the float64 model of the decoded bytes; get_tables is the
    decode; to_fbgemm gives back every byte (the garbage padding too)."""
    kern, rows, tabs = _model(rng, output_dtype=jnp.float32, **KERNEL_KW)
    xla = tbe_jax.QuantizedTableBatchedEmbedding(SPECS, SPEC_WTS, feature_table_map=FMAP, output_dtype=jnp.float32,
                                                 impl="xla")
    qp = kern.from_fbgemm(rows)
    for got, want in zip(kern.get_tables(qp), tabs):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    for got, want in zip(kern.to_fbgemm(qp), rows):
        assert got.dtype == np.uint8 and np.array_equal(np.asarray(got), want)
    idx, off, psw = _batch(rng, [SPECS[t].num_embeddings for t in FMAP], _lengths(rng))
    model = testing.numpy_pooled(tabs, FMAP, [B] * len(FMAP), idx, off, psw, "sum", False)
    out = kern(qp, idx, off, psw)
    assert out.dtype == jnp.float32 and out.shape == (B, sum(kern.feature_dims))
    assert_close(out, model, 2e-6)
    assert_close(xla(qp, idx, off, psw), model, 2e-6)
    # the jnp reference on the dequantized tables (the training TBE's XLA path)
    ref = tbe_jax.TableBatchedEmbedding(SPECS, feature_table_map=FMAP, impl="xla", pad_rows=False)
    assert_close(ref(ref.set_tables(None, kern.get_tables(qp)), idx, off, psw), model, 2e-6)


@pytest.mark.parametrize("wt", sorted(BITS))
def test_integer_rows_with_extreme_scales(wt, rng):
    """The kernel pools integer rows from their codes (one multiply-add per value, the biases per row, int4 / int2
    codes scaled by powers of two): rows whose fp16 scales and biases span subnormal to 65504, both signs, every
    position of every word, weighted bags of up to 40 ids: each bag within float32 rounding of the float64 model,
    relative to the bag's own magnitude (its absolute terms), not the batch's largest."""
    e, d, b = 64, 128, 16
    rows = _rows(rng, e, d, wt)
    scale = np.clip(10.0 ** rng.uniform(-7.5, 4.9, e), 0, 65504) * rng.choice([-1, 1], e)
    bias = 10.0 ** rng.uniform(-7.5, 4.5, e) * rng.choice([-1, 1], e)
    scale[:3], bias[:3] = [2.0**-24, 65504.0, 0.0], [0.0, -65504.0, 1e-7]
    rows[:, :4] = np.stack([scale, bias], 1).astype(np.float16).view(np.uint8).reshape(e, 4)
    qemb = tbe_jax.QuantizedTableBatchedEmbedding([tbe_jax.TableSpec(e, d)], wt, output_dtype=jnp.float32,
                                                  **KERNEL_KW)
    qp = qemb.from_fbgemm([rows])
    lengths = rng.integers(0, 41, b)
    lengths[:2] = [0, 40]
    idx, off, psw = _batch(rng, [e], lengths)
    vals = _np_rows(rows, wt, d)
    out = np.asarray(qemb(qp, idx, off, psw), np.float64)
    for k in range(b):
        ids, w = idx[off[k]:off[k + 1]], psw[off[k]:off[k + 1]].astype(np.float64)
        want = (w[:, None] * vals[ids]).sum(0)
        b_k = bias[ids].astype(np.float16).astype(np.float64)[:, None]
        size = (np.abs(w)[:, None] * (np.abs(vals[ids] - b_k) + np.abs(b_k))).sum(0)  # |q * s| and |b| terms
        err = np.abs(out[k] - want) / np.maximum(size, 1e-300)
        assert err.max() <= 2 ** -20, (k, lengths[k], err.max())


def test_many_dims_share_a_branch_per_buffer(rng):
    """Int4 tables of eight dims (8 .. 64) in three buffers (16-, 32- and 48-byte rows): one launch whose kernel
    has a branch per buffer (the hinted table's features: a segment of their own), each feature storing its own
    dim's columns (read at run time) from a tile as wide as its buffer's largest dim; garbage padding, weighted
    sum, B = 3 with empty bags; sub-groups of bags too. Matches the float64 model."""
    from tbe_jax import dispatch
    from tbe_jax.kernels import forward

    dims = (8, 16, 24, 32, 40, 48, 56, 64)
    specs = [tbe_jax.TableSpec(9 + t, d, bag_size_hint=1 if d == 16 else None) for t, d in enumerate(dims)]
    fmap = [0, 1, 2, 3, 4, 5, 6, 7, 0, 6]
    b = 3
    rows = [_rows(rng, s.num_embeddings, s.embedding_dim, "int4", garbage=True) for s in specs]
    tabs = [_np_rows(r, "int4", s.embedding_dim) for r, s in zip(rows, specs)]
    lengths = rng.integers(0, 5, len(fmap) * b)
    lengths[[0, 4, 11, 25]] = 0
    lengths[3] = 2  # the hinted feature's bags: at most two ids (any length is correct)
    idx, off, psw = _batch(rng, [specs[t].num_embeddings for t in fmap], lengths)
    model = testing.numpy_pooled(tabs, fmap, [b] * len(fmap), idx, off, psw, "sum", False)
    for cfg in (tbe_jax.ForwardConfig(), tbe_jax.ForwardConfig(max_bags=1, bag_groups=2)):
        qemb = tbe_jax.QuantizedTableBatchedEmbedding(specs, "int4", feature_table_map=fmap, output_dtype=jnp.float32,
                                                      kernel_config=cfg, **KERNEL_KW)
        lay = qemb.layout
        assert [lay.buffer_key(i) for i in range(lay.num_buffers)] == ["int4_w4", "int4_w8", "int4_w12"]
        assert lay.kernel_layout.dims == (24, 56, 64)
        plan = lay.kernel_plan(qemb.plan_for(len(fmap) * b + 1))
        assert plan.group == (0, 0, 0, 1, 1, 1, 1, 2, 0, 1) and plan.dim == tuple(dims[t] for t in fmap)
        _, branches, _, meta = forward._schedule(lay.kernel_layout, plan, cfg, range(len(fmap)),
                                                 frozenset(dispatch.short_bag_features(qemb)), lay.kernel_layout.formats)
        # per buffer one branch (buffer 0: a second for its hinted feature, D = 16); tiles of the largest dim
        assert [(br.buffer, br.dim, br.block_dim, br.dyn_dim) for br in branches] == [
            (0, 24, 4, True), (0, 24, 4, True), (1, 56, 8, True), (2, 64, 8, False)]
        assert meta.shape == (len(fmap), 5) and meta[:, 4].tolist() == list(plan.dim)
        if cfg.bag_groups == 2:
            assert [br.groups for br in branches] == [2, 2, 2, 2]
        qp = qemb.from_fbgemm(rows)
        jaxpr = jax.make_jaxpr(lambda p, i, o, w: qemb(p, i, o, w))(qp, idx, off, psw)
        assert sum(e.primitive.name == "pallas_call" for e in jaxpr_eqns(jaxpr.jaxpr)) == 1  # one launch
        assert_close(qemb(qp, idx, off, psw), model, 2e-6)
    sizes = [2, 3, 1, 3, 2, 1, 3, 2, 1, 2]  # VBE: a flat output, each feature's rows its own dim wide
    idx, off, psw = _batch(rng, [specs[t].num_embeddings for t in fmap], rng.integers(0, 4, sum(sizes)), sizes=sizes)
    assert_close(qemb(qp, idx, off, psw, batch_size_per_feature=sizes),
                 testing.numpy_pooled(tabs, fmap, sizes, idx, off, psw, "sum", True), 2e-6)


def test_rows_whose_words_are_not_a_power_of_two_load_as_two_tiles(rng):
    """Integer rows whose value words are not a power of two load as two tiles of power-of-two widths where the
    second is at least 4 words, each still gives every thread a word and a step gathers at least 4 bags
    (`quant_rows.word_pieces`: int8 D = 96, 24 words, as 16 + 8 lanes, not 32; int8 D = 24 stays one 8-word
    tile, 4 + 2 was slower), each tile storing its own columns: with the default tiles int8 D = 48 and 96; with
    larger tiles int4 and int2 too. Garbage padding, weighted sum and mean, empty and long bags. Matches the
    float64 model."""
    from tbe_jax.kernels import forward, quant_rows

    tabs_wts = [(96, "int8"), (80, "int8"), (20, "int8"), (48, "int8"), (64, "int8"), (160, "int8"), (96, "int4"),
                (160, "int4"), (96, "int2"), (192, "int2")]
    specs = [tbe_jax.TableSpec(11 + t, d) for t, (d, _) in enumerate(tabs_wts)]
    wts = [wt for _, wt in tabs_wts]
    fmap = list(range(len(specs))) + [0]
    b = 8
    rows = [_rows(rng, s.num_embeddings, s.embedding_dim, wt, garbage=True) for s, wt in zip(specs, wts)]
    tabs = [_np_rows(r, wt, s.embedding_dim) for r, s, wt in zip(rows, specs, wts)]
    lengths = rng.integers(0, 5, len(fmap) * b)
    lengths[[0, 7, 21]] = 0
    lengths[[3, 12, 30, 45]] = 40  # long bags next to short ones
    idx, off, psw = _batch(rng, [specs[t].num_embeddings for t in fmap], lengths)
    two = {("int8", 48), ("int8", 96)}
    cases = [  # (config, pooling, the (weight type, dim) whose rows load as two tiles)
        (tbe_jax.ForwardConfig(), "mean", two),
        (tbe_jax.ForwardConfig(row_tile_elems=2048, row_tile_bytes=2048), "sum",
         {("int8", 48), ("int8", 80), ("int8", 96), ("int8", 160), ("int4", 96), ("int4", 160), ("int2", 192)}),
    ]
    def int8(d):
        return quant_rows.RowFormat("int8", quant_format.row_bytes(d, "int8") // 4)
    assert quant_rows.word_pieces(int8(24), 24, 16) == ((0, 8),)  # 6 value words: not 4 + 2
    assert quant_rows.word_pieces(int8(96), 96, 4) == ((0, 16), (16, 8))
    assert quant_rows.word_pieces(int8(96), 96, 2) == ((0, 32),)  # G = 2
    for cfg, pooling, two in cases:
        qemb = tbe_jax.QuantizedTableBatchedEmbedding(specs, wts, feature_table_map=fmap, pooling=pooling,
                                                      output_dtype=jnp.float32, kernel_config=cfg, **KERNEL_KW)
        lay = qemb.layout
        plan = lay.kernel_plan(qemb.plan_for(len(fmap) * b + 1))
        _, branches, _, _ = forward._schedule(lay.kernel_layout, plan, cfg, range(len(fmap)), frozenset(),
                                              lay.kernel_layout.formats)
        assert {(br.fmt.weight_dtype, br.dim) for br in branches
                if len(quant_rows.word_pieces(br.fmt, br.dim, br.bags)) == 2} == two
        qp = qemb.from_fbgemm(rows)
        model = testing.numpy_pooled(tabs, fmap, [b] * len(fmap), idx, off, psw, pooling, False)
        assert_close(qemb(qp, idx, off, psw), model, 2e-6)


def test_one_bag_of_one_word_rows(rng):
    """A batch of one bag per feature whose rows hold their values in one word (int4 D = 8, int8 D = 4, int2
    D = 16, fp16 D = 2, fp8 D = 4): one-word tiles, which Triton 3.6 failed to compile as `[1, 1]` joins (a
    segfault on the H200) before `quant_rows.tile_words` gave them two columns; pooled and sequence."""
    specs = [tbe_jax.TableSpec(9, d) for d in (8, 4, 16, 2, 4)]
    wts = ("int4", "int8", "int2", "float16", "fp8")
    rows = [_rows(rng, 9, s.embedding_dim, wt, garbage=True) for s, wt in zip(specs, wts)]
    tabs = [_np_rows(r, wt, s.embedding_dim) for r, s, wt in zip(rows, specs, wts)]
    fmap = list(range(len(specs)))
    idx, off, psw = _batch(rng, [9] * len(specs), [3, 0, 1, 5, 2])
    qemb = tbe_jax.QuantizedTableBatchedEmbedding(specs, wts, output_dtype=jnp.float32, **KERNEL_KW)
    out = qemb(qemb.from_fbgemm(rows), idx, off, psw)
    assert_close(out, testing.numpy_pooled(tabs, fmap, [1] * len(specs), idx, off, psw, "sum", False), 2e-6)
    for s, wt, r, t in zip(specs, wts, rows, tabs):  # pooling="none": one table of one dim per model
        seq = tbe_jax.QuantizedTableBatchedEmbedding([s], wt, pooling="none", output_dtype=jnp.float32, **KERNEL_KW)
        ids = np.array([4], np.int32)
        got = seq(seq.from_fbgemm([r]), ids, np.array([0, 1], np.int32))
        np.testing.assert_allclose(np.asarray(got, np.float64).reshape(-1), t[4], rtol=1e-6, atol=1e-6)


def test_mean_fp16_output_and_chained_launches(rng):
    """Mean pooling, FBGEMM's default fp16 output, two buffers per launch (four chained launches)."""
    cfg = tbe_jax.ForwardConfig(segment_buffers=2)
    qemb, rows, tabs = _model(rng, pooling="mean", kernel_config=cfg, **KERNEL_KW)
    qp = qemb.from_fbgemm(rows)
    idx, off, _ = _batch(rng, [SPECS[t].num_embeddings for t in FMAP], _lengths(rng), weighted=False)
    out = qemb(qp, idx, off)
    assert out.dtype == jnp.float16
    assert_close(out, testing.numpy_pooled(tabs, FMAP, [B] * len(FMAP), idx, off, None, "mean", False), 1e-3)


def test_two_warps_per_program(rng):
    """Programs of two warps (`ForwardConfig(num_warps=2)`; the two-tile rule then needs 64 word lanes a tile):
    every weight type, weighted sum, garbage padding. Matches the float64 model (the warps' layouts are checked
    compiled only: interpret mode ignores warps)."""
    qemb, rows, tabs = _model(rng, output_dtype=jnp.float32, kernel_config=tbe_jax.ForwardConfig(num_warps=2),
                              **KERNEL_KW)
    qp = qemb.from_fbgemm(rows)
    idx, off, psw = _batch(rng, [SPECS[t].num_embeddings for t in FMAP], _lengths(rng))
    assert_close(qemb(qp, idx, off, psw), testing.numpy_pooled(tabs, FMAP, [B] * len(FMAP), idx, off, psw, "sum",
                                                              False), 2e-6)


def test_output_dtypes_and_sequence(rng):
    """pooling="none" (weighted; two buffers of one dim: one launch each), in bf16 and fp32 outputs, kernel and
    XLA; -1 and out-of-range ids give zero rows."""
    specs = [tbe_jax.TableSpec(20, 16), tbe_jax.TableSpec(30, 16), tbe_jax.TableSpec(10, 16)]
    wts = ["int4", "fp8", "int4"]
    rows = [_rows(rng, s.num_embeddings, 16, wt) for s, wt in zip(specs, wts)]
    tabs = [_np_rows(r, wt, 16) for r, wt in zip(rows, wts)]
    idx, off, psw = _batch(rng, [20, 30, 10], [3, 0, 4, 5, 2, 1])
    idx[[1, 12]] = [-1, 30]
    table = (np.searchsorted(off, np.arange(len(idx)), side="right") - 1) // 2  # feature = table
    ok = (idx >= 0) & (idx < np.array([20, 30, 10])[table])
    want = np.where(ok[:, None], np.stack([tabs[t][i] if o else np.zeros(16) for t, i, o in zip(table, idx, ok)])
                    * psw[:, None], 0)
    for dtype, kw in ((jnp.bfloat16, KERNEL_KW), (jnp.float32, KERNEL_KW), (jnp.float32, dict(impl="xla"))):
        qemb = tbe_jax.QuantizedTableBatchedEmbedding(specs, wts, pooling="none", output_dtype=dtype, **kw)
        out = qemb(qemb.from_fbgemm(rows), idx, off, psw)
        assert out.dtype == dtype and out.shape == (len(idx), 16)
        assert_close(out, want, 8e-3 if dtype == jnp.bfloat16 else 1e-6)


# -- bounds modes, as tests/test_bounds.py checks the training TBE ------------------------------------------------

BSPECS = [tbe_jax.TableSpec(10, 8, name="t0"), tbe_jax.TableSpec(20, 16, name="t1")]


def _bounded(mode, kernel):
    kw = KERNEL_KW if kernel else dict(impl="xla")
    qemb = tbe_jax.QuantizedTableBatchedEmbedding(BSPECS, ["int8", "fp8"], bounds_check=mode,
                                                  output_dtype=jnp.float32, **kw)
    rows = [_rows(np.random.default_rng(t), s.num_embeddings, s.embedding_dim, wt)
            for t, (s, wt) in enumerate(zip(BSPECS, ["int8", "fp8"]))]
    return qemb, qemb.from_fbgemm(rows), [_np_rows(r, wt, s.embedding_dim)
                                           for r, s, wt in zip(rows, BSPECS, ["int8", "fp8"])]


def _bad_batch():
    # feature 0 (E=10): bag 0 = [1, 12(bad), -1(pruned)], bag 1 = [3]; feature 1 (E=20): [19, -5(bad)], [20(bad), 0]
    return np.array([1, 12, -1, 3, 19, -5, 20, 0], np.int32), np.array([0, 3, 4, 6, 8], np.int32)


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_bounds_ignore_warning_none(kernel):
    idx, off = _bad_batch()
    qemb, qp, tabs = _bounded("ignore", kernel)
    model = testing.numpy_pooled(tabs, [0, 1], [2, 2], idx, off, None, "sum", False)
    out, rep = jax.jit(qemb.forward_with_report)(qp, idx, off)
    assert_close(out, model, 1e-6)
    assert int(rep.invalid_indices) == 3 and int(rep.repaired_offsets) == 0
    qemb, qp, _ = _bounded("warning", kernel)
    bad_off = np.array([2, 4, 3, 9, 5], np.int32)  # first not 0, decreasing, past len(indices)
    fixed = np.array([0, 4, 4, 8, 8], np.int32)
    good = np.where(idx >= 10, 0, np.abs(idx)).astype(np.int32)
    with pytest.warns(RuntimeWarning, match="0 index.*4 offsets"):
        out = qemb(qp, good, bad_off)
        jax.block_until_ready(out)
        jax.effects_barrier()
    assert_close(out, testing.numpy_pooled(tabs, [0, 1], [2, 2], good, fixed, None, "sum", False), 1e-6)
    assert int(qemb.bounds_report(idx, bad_off).invalid_indices) == 3
    if kernel:  # "none": no upper check in the kernel; negative ids (-1 too) still skipped
        qemb, qp, _ = _bounded("none", kernel)
        idx_none = np.where(idx >= 10, 0, idx).astype(np.int32)
        assert_close(qemb(qp, idx_none, off), testing.numpy_pooled(tabs, [0, 1], [2, 2], idx_none, off, None,
                                                                   "sum", False), 1e-6)


def test_bounds_fatal():
    qemb, qp, _ = _bounded("fatal", kernel=True)
    idx, off = _bad_batch()
    with pytest.raises(ValueError, match=r"feature 0 \(table 0 \('t0'\)\), bag 0: index 12"):
        qemb(qp, idx, off)
    f = jax.jit(checkify.checkify(lambda p, i, o: qemb(p, i, o)))
    err, _ = f(qp, idx, off)
    with pytest.raises(Exception, match=r"feature 0, bag 0: index 12"):
        err.throw()
    with pytest.raises(ValueError, match=r"bounds_check='fatal' under jax.jit"):
        jax.jit(lambda p, i, o: qemb(p, i, o))(qp, idx, off)


# -- VBE ---------------------------------------------------------------------------------------------------------


def test_vbe_static_and_traced_sizes(rng):
    qemb, qp, tabs = _bounded("ignore", kernel=True)
    sizes = (3, 5)
    idx, off, psw = _batch(rng, [10, 20], [2, 0, 3, 1, 4, 0, 2, 6], sizes=sizes)
    flat = qemb(qp, idx, off, psw, batch_size_per_feature=sizes)
    model = testing.numpy_pooled(tabs, [0, 1], list(sizes), idx, off, psw, "sum", True)
    assert flat.shape == (3 * 8 + 5 * 16,)
    assert_close(flat, model, 1e-6)
    off_pad = np.concatenate([off, np.full(4, off[-1], np.int32)])  # [F * M + 1] entries: one shape for all sizes
    call = jax.jit(lambda p, i, o, w, s: qemb(p, i, o, w, batch_size_per_feature=tbe_jax.VariableBatchSizes(s, 6)))
    out = call(qp, idx, off_pad, psw, jnp.asarray(sizes, jnp.int32))
    assert out.shape == (6, 24)
    want = np.zeros((6, 24))
    want[:3, :8] = model[:24].reshape(3, 8)
    want[:5, 8:] = model[24:].reshape(5, 16)
    assert_close(out, want, 1e-6)


# -- identity, jit, format round trip, errors --------------------------------------------------------------------


def test_hashable_static_and_one_compile(rng):
    a = tbe_jax.QuantizedTableBatchedEmbedding(BSPECS, "int8", impl="xla")
    b = tbe_jax.QuantizedTableBatchedEmbedding(BSPECS, ["int8", "int8"], impl="xla")
    c = tbe_jax.QuantizedTableBatchedEmbedding(BSPECS, "int4", impl="xla")
    d = tbe_jax.QuantizedTableBatchedEmbedding(BSPECS, "int8", impl="xla", output_dtype=jnp.float32)
    assert a == b and hash(a) == hash(b) and a != c and a != d and len({a, b, c, d}) == 3
    f = jax.jit(lambda q, p, i, o: q(p, i, o), static_argnums=0)
    rows = [_rows(rng, s.num_embeddings, s.embedding_dim, "int8") for s in BSPECS]
    qp = a.from_fbgemm(rows)
    idx, off, _ = _batch(rng, [10, 20], [1, 2, 3, 0], weighted=False)
    x = f(a, qp, idx, off)
    y = f(b, b.from_fbgemm(rows), idx, off)
    assert f._cache_size() == 1 and np.array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_allclose(np.asarray(a(qp, idx, off), np.float32), np.asarray(x, np.float32), rtol=1e-3)
    assert "int8" in repr(a)


def test_fbgemm_round_trip_every_type_and_errors(rng):
    specs = [tbe_jax.TableSpec(7, d) for d in (12, 16, 8, 13, 13, 13)]
    wts = ["int8", "int4", "int2", "fp8", "float16", "float32"]
    qemb = tbe_jax.QuantizedTableBatchedEmbedding(specs, wts, impl="xla")
    rows = [_rows(rng, 7, s.embedding_dim, wt, garbage=True) for s, wt in zip(specs, wts)]
    qp = qemb.from_fbgemm(rows)
    assert all(v.dtype == jnp.int32 for v in qp.values())
    for got, want, s, wt in zip(qemb.to_fbgemm(qp), rows, specs, wts):
        assert got.shape == (7, quant_format.row_bytes(s.embedding_dim, wt)) and np.array_equal(np.asarray(got), want)
    for got, r, s, wt in zip(qemb.get_tables(qp), rows, specs, wts):
        assert got.dtype == jnp.float32 and got.shape == (7, s.embedding_dim)
        np.testing.assert_allclose(np.asarray(got, np.float64), _np_rows(r, wt, s.embedding_dim), rtol=1e-6,
                                   atol=1e-6)
    with pytest.raises(ValueError, match=r"rows must be uint8\[7, 16\]"):
        qemb.from_fbgemm([r.astype(np.int8) if i == 1 else r for i, r in enumerate(rows)])
    with pytest.raises(ValueError, match="expected 6 tables"):
        qemb.from_fbgemm(rows[:5])
    with pytest.raises(ValueError, match=r"qparams\['int8_w4'\] must be int32"):
        qemb.get_tables({**qp, "int8_w4": qp["int8_w4"][:3]})
    with pytest.raises(ValueError, match="qparams hold buffers"):
        qemb(dict(list(qp.items())[1:]), np.zeros(6, np.int32), np.arange(7, dtype=np.int32))
    with pytest.raises(ValueError, match="table 0: dim 3 of a int4 table"):
        tbe_jax.QuantizedTableBatchedEmbedding([tbe_jax.TableSpec(4, 3)], "int4")
    with pytest.raises(ValueError, match="weight dtype must be one of"):
        tbe_jax.QuantizedTableBatchedEmbedding(specs[:1], "int3")
    with pytest.raises(ValueError, match="names 2 types; there are 6"):
        tbe_jax.QuantizedTableBatchedEmbedding(specs, ["int8", "int4"])
    with pytest.raises(ValueError, match="pooling must be one of"):
        tbe_jax.QuantizedTableBatchedEmbedding(specs, "int8", pooling="max")


def test_quantize_a_trained_embedding(rng):
    emb = tbe_jax.TableBatchedEmbedding(BSPECS, weights_dtype=jnp.float16, pooling="mean", impl="xla")
    params = emb.init(jax.random.key(0))
    qemb, qp = tbe_jax.quantize(emb, params, ["int8", "float16"])
    assert qemb.pooling == "mean" and qemb.output_dtype == jnp.float16 and qemb.weight_dtypes == ("int8", "float16")
    tables = emb.get_tables(params)
    for got, w, wt in zip(qemb.to_fbgemm(qp), tables, qemb.weight_dtypes):
        assert np.array_equal(np.asarray(got), np.asarray(quant_format.quantize_rows(w.astype(jnp.float32), wt)))
    deq = qemb.get_tables(qp)
    np.testing.assert_array_equal(np.asarray(deq[1]), np.asarray(tables[1], np.float32))  # fp16 rows: exact
    assert np.abs(np.asarray(deq[0]) - np.asarray(tables[0], np.float32)).max() <= 2 / 255 / np.sqrt(10) + 1e-3
    idx, off, _ = _batch(rng, [10, 20], [2, 1, 0, 3], weighted=False)
    model = testing.numpy_pooled([np.asarray(t, np.float64) for t in deq], [0, 1], [2, 2], idx, off, None, "mean",
                                 False)
    assert_close(qemb(qp, idx, off), model, 1e-3)


def test_quantize_carries_the_options(rng):
    """`quantize`: `emb`'s tables, features, pooling and bounds mode, one type per table, fp16 output by default,
    the rows `quantize_rows` gives."""
    specs = [tbe_jax.TableSpec(30, 8), tbe_jax.TableSpec(20, 16), tbe_jax.TableSpec(10, 6)]
    emb = tbe_jax.TableBatchedEmbedding(specs, feature_table_map=[0, 1, 2, 1], pooling="mean",
                                        bounds_check="warning", impl="xla")
    params = emb.init(jax.random.key(1))
    qemb, qp = tbe_jax.quantize(emb, params, ["int4", "int8", "float16"])
    assert (qemb.feature_table_map, qemb.pooling, qemb.bounds_check, qemb.impl) == ((0, 1, 2, 1), "mean",
                                                                                   "warning", "xla")
    assert qemb.output_dtype == jnp.float16 and qemb.weight_dtypes == ("int4", "int8", "float16")
    tables = emb.get_tables(params)
    for got, w, wt in zip(qemb.to_fbgemm(qp), tables, qemb.weight_dtypes):
        assert np.array_equal(np.asarray(got), np.asarray(quant_format.quantize_rows(w.astype(jnp.float32), wt)))
    deq = [np.asarray(t, np.float64) for t in qemb.get_tables(qp)]
    for got, w, levels in zip(deq, tables, (15, 255, None)):
        w = np.asarray(w, np.float64)
        step = (w.max(1) - w.min(1)) / levels if levels else 1e-3 * np.abs(w).max()
        assert np.all(np.abs(got - w) <= 0.51 * np.max(step) + 2e-3 * np.abs(w).max())
    idx, off, _ = _batch(rng, [30, 20, 10, 20], [2, 1, 0, 3, 4, 1, 2, 2], weighted=False)
    model = testing.numpy_pooled(deq, [0, 1, 2, 1], [2] * 4, idx, off, None, "mean", False)
    assert_close(qemb(qp, idx, off), model, 1e-3)
    q32, _ = tbe_jax.quantize(emb, params, "float32", output_dtype=jnp.float32, impl="auto")
    assert q32.output_dtype == jnp.float32 and q32.impl == "auto" and q32.weight_dtypes == ("float32",) * 3
    with pytest.raises(TypeError, match="emb must be a tbe_jax.TableBatchedEmbedding"):
        tbe_jax.quantize(qemb, qp, "int8")


def test_rows_per_program_follow_the_config():
    """`ForwardConfig.row_tile_bytes` / `row_tile_elems`: quantized rows get bags per program by their bytes (the
    derived defaults), float rows keep the dim rule; a set value reaches the kernel's grid."""
    cfg = tbe_jax.ForwardConfig()
    assert cfg.bags_per_program(128, 1024) == 2  # fp16 / fp32 rows: tile_elems // Dp
    assert cfg.bags_per_program(128, 1024, row_bytes=80) == 4  # an int4 row of D = 128: 512 // 128
    assert cfg.bags_per_program(128, 1024, row_bytes=48) == 4  # int2: 512 // 64 = 8, capped by 512 // Dp
    assert cfg.bags_per_program(128, 1024, row_bytes=512) == 2  # fp32 rows: never fewer than the dim rule
    assert tbe_jax.ForwardConfig(row_tile_bytes=2048, row_tile_elems=4096).bags_per_program(128, 1024, 80) == 16
    with pytest.raises(ValueError, match="row_tile_bytes must be None or a positive int"):
        tbe_jax.ForwardConfig(row_tile_bytes=0)

    def grid(cfg):
        qemb = tbe_jax.QuantizedTableBatchedEmbedding([tbe_jax.TableSpec(50, 128)], "int4", kernel_config=cfg,
                                                      **KERNEL_KW)
        words = jax.ShapeDtypeStruct(qemb.layout.buffer_shape(0), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda p, i, o: qemb(p, i, o))({"int4_w20": words}, np.zeros(64, np.int32),
                                                              np.arange(65, dtype=np.int32))
        calls = [e for e in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
        return tuple(calls[0].params["grid_mapping"].grid)

    assert grid(tbe_jax.ForwardConfig()) == (16,)  # 64 bags, 4 per program
    assert grid(tbe_jax.ForwardConfig(row_tile_bytes=2048, row_tile_elems=1024)) == (8,)


def test_lowers_for_cuda_every_type():
    """Lowered for CUDA on this CPU machine (every Triton lowering rule: the shifts, masks, bit casts and int to
    float conversions of each weight type's decode), pooled with counts and sequence, and a buffer of three dims
    (its dim read at run time); the float forward's kernel has none of the decode's ops."""
    from jax._src.pallas.triton import lowering as triton_lowering  # to read the Triton IR without locations

    kernels = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        res = original(*args, **kwargs)
        kernels.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    def lower(core, params, n=48, bags=8):
        core.uses_kernel = lambda: True  # the kernel path, lowered, not run
        kernels.clear()
        i, o = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((bags + 1,), jnp.int32)
        w = jax.ShapeDtypeStruct((n,), jnp.float32)
        jax.jit(lambda p, i, o, w: core.forward_with_report(p, i, o, w)).trace(params, i, o, w).lower(
            lowering_platforms=("cuda",))
        return list(kernels)

    def words(q):
        return {q.layout.buffer_key(b): jax.ShapeDtypeStruct(q.layout.buffer_shape(b), jnp.int32)
                for b in range(q.layout.num_buffers)}

    triton_lowering.lower_jaxpr_to_triton_module = capture
    try:
        specs = [tbe_jax.TableSpec(40, 16) for _ in WTS]
        pooled = tbe_jax.QuantizedTableBatchedEmbedding(specs, WTS, impl="pallas")
        [k] = lower(pooled, words(pooled), 6 * 48, 6 * 8)
        seq = tbe_jax.QuantizedTableBatchedEmbedding(specs, WTS, pooling="none", impl="pallas")
        seq_kernels = lower(seq, words(seq), 6 * 48, 6 * 8)
        shared = tbe_jax.QuantizedTableBatchedEmbedding([tbe_jax.TableSpec(40, d) for d in (8, 16, 24)], "int4",
                                                        impl="pallas")  # one branch, the dim read at run time
        [shared_kernel] = lower(shared, words(shared), 3 * 48, 3 * 8)
        emb = tbe_jax.TableBatchedEmbedding(specs[:2], weights_dtype=jnp.float16, impl="pallas")
        [float_kernel] = lower(emb, {"d16": jax.ShapeDtypeStruct((80, 16), jnp.float16)}, 96, 16)
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    assert len(seq_kernels) == len(WTS)
    for op in ("arith.shrsi", "arith.andi", "tt.bitcast", "arith.trunci", "arith.extf", "arith.sitofp"):
        assert op in k, op
    for text, wt in zip(seq_kernels, WTS):
        assert ("arith.sitofp" in text) == (wt in BITS or wt == "fp8") and "tt.bitcast" in text, wt
        assert ("arith.shrsi" in text) == (wt != "float32"), wt
    assert not re.search(r"arith\.shrsi|tt\.bitcast|arith\.sitofp", float_kernel)


def test_docstring_example():
    import tbe_jax.quant

    result = doctest.testmod(tbe_jax.quant, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
