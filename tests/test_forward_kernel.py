"""The Pallas forward kernels against the reference and the float64 model.

Runs compiled on a GPU and in interpret mode on CPU (see conftest.KERNEL_KW).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, ON_GPU, assert_close, specs, tables_f64, tolerance

MIXED_DIMS = [1, 3, 17, 100, 128, 257]


def _run(rng, tables, fmap, batch, bag_len, *, pooling="sum", wdtype="float32", odtype="float32",
         weighted=False, vbe=False, alpha=1.0, config=None):
    kw = dict(feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype, output_dtype=odtype)
    emb = tbe_jax.TableBatchedEmbedding(tables, kernel_config=config, **kw, **KERNEL_KW)
    ref_emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla", **kw)
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, psw = testing.make_batch(
        rng, [tables[t].num_embeddings for t in fmap], batch, bag_len, weighted=weighted, alpha=alpha)
    bpf = tuple(batch) if vbe else None
    out = emb(params, idx, off, psw, batch_size_per_feature=bpf)
    ref = ref_emb(params, idx, off, psw, batch_size_per_feature=bpf)
    model = testing.numpy_pooled(tables_f64(emb, params), fmap, batch, idx, off, psw, pooling, vbe)
    assert out.dtype == jnp.dtype(odtype)
    max_len = int(np.diff(off).max()) if len(off) > 1 else 0
    tol = max(tolerance(wdtype, max_len), {"float32": 0, "float16": 1e-3, "bfloat16": 8e-3}[odtype])
    assert_close(out, model, tol)
    assert_close(out, ref, tol)
    return out, model


def _batch_of_lengths(rng, tables, fmap, batch, choices):
    """Offsets and ids (uniform over each feature's table) of bags whose lengths are drawn from `choices`."""
    lengths = rng.choice(choices, size=sum(batch))
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = np.repeat([tables[t].num_embeddings for t in fmap], batch)
    return (rng.random(off[-1]) * np.repeat(rows, lengths)).astype(np.int32), off


# Storage dtype x pooling x weighting pairwise (6 of the 12 combinations: every dtype with both poolings and
# both weightings, every pooling with both weightings); each combination is one interpret-mode compile on CPU.
@pytest.mark.parametrize("wdtype,pooling,weighted", [
    ("float32", "sum", False), ("float32", "mean", True), ("float16", "sum", True), ("float16", "mean", False),
    ("bfloat16", "sum", False), ("bfloat16", "mean", True)])
def test_mixed_dims_shared_tables_empty_bags(rng, wdtype, pooling, weighted):
    tables = specs([23, 5, 64, 31, 50, 17], MIXED_DIMS)  # table 1 (E=5): heavy duplicates
    fmap = [0, 1, 2, 3, 4, 5, 1]
    _run(rng, tables, fmap, [6] * len(fmap), (0, 24), pooling=pooling, wdtype=wdtype, weighted=weighted)


@pytest.mark.parametrize("odtype", ["float16", "bfloat16"])
def test_low_precision_output(rng, odtype):
    tables = specs([40, 40], [16, 48])
    _run(rng, tables, [0, 1], [5, 5], (1, 12), wdtype="float16", odtype=odtype)


# Each storage dtype and each weighting (2 of the 4 combinations); an odd dim (scalar output stores) and dims
# that are multiples of 4 (16-byte vector stores at the VBE rows' offsets, `pallas_compat.row_align`).
@pytest.mark.parametrize("wdtype,weighted,dims", [("float32", True, [8, 17, 8]), ("float16", False, [8, 12, 4])])
def test_variable_batch_size(rng, wdtype, weighted, dims):
    tables = specs([30, 20, 25], dims)
    _run(rng, tables, [0, 1, 2, 0], [7, 0, 3, 12], (0, 9), wdtype=wdtype, weighted=weighted, vbe=True)


def test_row_align():
    from tbe_jax.pallas_compat import aligned, row_align

    assert row_align([128, 64], 4) == 4 and row_align([128], 2) == 8 and row_align([12, 20], 4) == 4
    assert row_align([6, 10], 4) == 2 and row_align([5, 8], 4) == 1 and row_align([], 4) == 1
    x = jnp.arange(0, 400, 12, dtype=jnp.int32)
    np.testing.assert_array_equal(aligned(x, 4), x)


@pytest.mark.parametrize("wdtype", ["float32", "float16"])
def test_long_bags(rng, wdtype):
    # One feature, bag lengths from 0 to 5000 (crossing every unroll boundary).
    tables = specs([1000], [64])
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=wdtype, **KERNEL_KW)
    params = emb.init(jax.random.key(3))
    lengths = np.array([5000, 0, 1, 257, 4096, 3])
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = testing.sample_ids(rng, 1000, int(off[-1]), 1.2)
    out = emb(params, idx, off)
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [6], idx, off, None, "sum", False)
    assert_close(out, model, tolerance(wdtype, 5000))
    assert np.all(np.asarray(out[1]) == 0)


def test_many_features(rng):
    tables = specs([50, 80, 33, 12, 70], [16, 32, 16, 8, 32])
    fmap = [f % 5 for f in range(40)]
    _run(rng, tables, fmap, [3] * 40, (0, 10), wdtype="float16", weighted=True)


def test_single_feature_uniform_and_zipf(rng):
    tables = specs([300], [128])
    _run(rng, tables, [0], [33], 20, wdtype="float16")
    _run(rng, tables, [0], [33], 20, wdtype="float16", alpha=1.15)


def test_row_id_tables_exact(rng):
    # Row r of every table holds r (and its column number in the fraction), so any
    # indexing or column bug shows as a wrong integer.
    dims = [3, 16, 33]
    tables = specs([40, 20, 10], dims)
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    vals = [np.arange(t.num_embeddings)[:, None] + np.arange(t.embedding_dim)[None, :] / 64.0
            for t in tables]
    params = emb.set_tables(None, [jnp.asarray(v, jnp.float32) for v in vals])
    idx, off, _ = testing.make_batch(rng, [40, 20, 10], [4, 4, 4], (0, 7))
    out = np.asarray(emb(params, idx, off))
    model = testing.numpy_pooled(vals, [0, 1, 2], [4] * 3, idx, off, None, "sum", False)
    np.testing.assert_array_equal(out, model)


@pytest.mark.parametrize("wdtype", ["float32", "float16"])
def test_pooling_none(rng, wdtype):
    tables = specs([30, 40], [24, 24])
    kw = dict(pooling="none", weights_dtype=wdtype)
    emb = tbe_jax.TableBatchedEmbedding(tables, **kw, **KERNEL_KW)
    params = emb.init(jax.random.key(5))
    idx, off, psw = testing.make_batch(rng, [30, 40], [5, 5], (0, 6), weighted=True)
    out = emb(params, idx, off, psw)
    ref = tbe_jax.TableBatchedEmbedding(tables, impl="xla", **kw)(params, idx, off, psw)
    assert out.shape == (len(idx), 24)
    assert_close(out, ref, 1e-6)


def test_no_indices_and_zero_batch():
    tables = specs([10, 10], [4, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    out = emb(params, np.zeros(0, np.int32), np.zeros(7, np.int32))
    assert out.shape == (3, 12) and not np.any(np.asarray(out))
    out = emb(params, np.zeros(0, np.int32), np.zeros(1, np.int32))
    assert out.shape == (0, 12)


def test_under_jit_with_static_module(rng):
    tables = specs([30, 30], [8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    idx, off, _ = testing.make_batch(rng, [30, 30], [4, 4], (0, 5))
    f = jax.jit(lambda e, p, i, o: e(p, i, o), static_argnums=0)
    np.testing.assert_allclose(np.asarray(f(emb, params, idx, off)), np.asarray(emb(params, idx, off)),
                               rtol=1e-6, atol=1e-6)


def test_more_buffers_than_one_launch(rng):
    # Ten distinct dims: the pooled forward is two launches (ForwardConfig.segment_buffers = 8 buffers each),
    # the second filling its features' columns of the first's output in place; weighted mean, a shared table.
    # One compiled forward (bounds_check="warning") serves both checks: the output against the float64 model
    # and the XLA reference, then bad ids counted across both launches (the same shapes: no second compile).
    import re

    dims = [4, 8, 12, 16, 20, 24, 28, 32, 5, 3]
    assert len(set(dims)) > tbe_jax.ForwardConfig().segment_buffers
    tables = specs([7, 9, 5, 8, 6, 7, 9, 5, 8, 6], dims)
    fmap = list(range(10)) + [2]
    kw = dict(feature_table_map=fmap, pooling="mean")
    checked = tbe_jax.TableBatchedEmbedding(tables, bounds_check="warning", **kw, **KERNEL_KW)
    params = checked.init(jax.random.key(int(rng.integers(1 << 30))))
    batch = [3] * len(fmap)
    idx, off, psw = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], batch, (0, 6), weighted=True)
    out, rep = checked.forward_with_report(params, idx, off, psw)
    model = testing.numpy_pooled(tables_f64(checked, params), fmap, batch, idx, off, psw, "mean", False)
    tol = tolerance("float32", int(np.diff(off).max()))
    assert_close(out, model, tol)
    assert_close(out, tbe_jax.TableBatchedEmbedding(tables, impl="xla", **kw)(params, idx, off, psw), tol)
    assert int(rep.invalid_indices) == 0
    # Bad ids counted across both launches (one in a feature of each).
    bad = idx.copy()
    first = [next(b for b in range(3 * f, 3 * f + 3) if off[b + 1] > off[b]) for f in (0, 8)]  # a non-empty bag
    bad[off[first[0]]], bad[off[first[1]]] = -5, 10_000  # feature 0 (first launch), feature 8 (dim 5: the second)
    _, rep = checked.forward_with_report(params, bad, off, psw)
    assert int(rep.invalid_indices) == 2
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, weights_dtype="float16", impl="pallas")
    emb.uses_kernel = lambda: True  # lowered for CUDA on this CPU machine: the kernel path, not run
    params = {emb.layout.key(g): jax.ShapeDtypeStruct((emb.layout.group_rows[g], d), jnp.float16)
              for g, d in enumerate(emb.layout.dims)}
    idx = jax.ShapeDtypeStruct((len(fmap) * 4 * 6,), jnp.int32)
    off = jax.ShapeDtypeStruct((len(fmap) * 4 + 1,), jnp.int32)
    text = jax.jit(lambda p, i, o: emb(p, i, o)).trace(params, idx, off).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"stablehlo\.custom_call", text)) == 2  # (eight of the dims: one)


def test_small_launch_stays_whole(rng, monkeypatch):
    # ForwardConfig.merge_programs: ten dims (two launches by default) stay one launch when the whole launch runs
    # at most `merge_programs` programs (and has at most 2 * segment_buffers buffers). The same branches pool the
    # same bags in the same order: outputs bitwise those of the two launches; bad ids counted across the one.
    import re

    dims = [4, 8, 12, 16, 20, 24, 28, 32, 5, 3]
    tables = specs([7, 9, 5, 8, 6, 7, 9, 5, 8, 6], dims)
    merged_cfg = tbe_jax.ForwardConfig(merge_programs=1 << 20)
    split = tbe_jax.TableBatchedEmbedding(tables, bounds_check="warning", **KERNEL_KW)
    merged = tbe_jax.TableBatchedEmbedding(tables, bounds_check="warning", kernel_config=merged_cfg, **KERNEL_KW)
    params = split.init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, _ = testing.make_batch(rng, [t.num_embeddings for t in tables], [3] * 10, (0, 6))
    idx[off[1]] = 10_000  # a bad id in feature 0 (the first launch when split)
    idx[off[-2]] = -3  # and one in feature 9 (the second)
    out, rep = merged.forward_with_report(params, idx, off)
    want, want_rep = split.forward_with_report(params, idx, off)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert int(rep.invalid_indices) == int(want_rep.invalid_indices) == 2

    def launches(cfg, quantized=False):
        kw = dict(impl="pallas", kernel_config=cfg)
        if quantized:  # int8 rows: their (weight type, row words) buffers, the same rule
            emb = tbe_jax.QuantizedTableBatchedEmbedding(specs([7] * 10, [4 * d for d in dims]), "int8", **kw)
            p = {emb.layout.buffer_key(b): jax.ShapeDtypeStruct(emb.layout.buffer_shape(b), jnp.int32)
                 for b in range(emb.layout.num_buffers)}
            assert emb.layout.num_buffers > cfg.segment_buffers
        else:
            emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype="float16", **kw)
            p = {emb.layout.key(g): jax.ShapeDtypeStruct((emb.layout.group_rows[g], d), jnp.float16)
                 for g, d in enumerate(emb.layout.dims)}
        (emb._base if quantized else emb).uses_kernel = lambda: True  # lowered for CUDA here, not run
        i, o = jax.ShapeDtypeStruct((10 * 4 * 6,), jnp.int32), jax.ShapeDtypeStruct((10 * 4 + 1,), jnp.int32)
        text = jax.jit(lambda p, i, o: emb(p, i, o)).trace(p, i, o).lower(lowering_platforms=("cuda",)).as_text()
        return len(re.findall(r"stablehlo\.custom_call", text))

    assert launches(tbe_jax.ForwardConfig()) == 2
    assert launches(merged_cfg) == 1
    assert launches(tbe_jax.ForwardConfig(merge_programs=1)) == 2  # more programs than that: split
    # the bound itself: the one launch's program count (lowering records it) merges, one less splits
    from tbe_jax.kernels import forward as fwd_kernels
    counts, schedule = [], fwd_kernels._schedule

    def spy(*a, **k):
        res = schedule(*a, **k)
        counts.append(res[2].num_programs)
        return res

    with monkeypatch.context() as m:
        m.setattr(fwd_kernels, "_schedule", spy)
        launches(merged_cfg)
    programs = counts[-1]  # the launch's own schedule, after `_merge`'s
    assert launches(tbe_jax.ForwardConfig(merge_programs=programs)) == 1
    assert launches(tbe_jax.ForwardConfig(merge_programs=programs - 1)) == 2
    assert launches(tbe_jax.ForwardConfig(merge_programs=1 << 20, segment_buffers=4)) == 3  # > 2 x 4 buffers
    assert launches(tbe_jax.ForwardConfig(), quantized=True) == 2
    assert launches(merged_cfg, quantized=True) == 1
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="merge_programs must be a non-negative int"):
            tbe_jax.ForwardConfig(merge_programs=bad)


# ForwardConfig.bag_groups: a program owns G * bag_groups bags (G = 2 here: tile_elems 64 over dims up to 32),
# loads every bag's first row at once, then pools the sub-groups one after another. The sums run in the same
# order as with one group, so the outputs are bitwise those of bag_groups=1 without weights (with weights the
# compiler may fuse a product into the sum (an FMA) on one path and not the other: within 1e-6), and the
# bad-id counts equal: batches that leave a program's last sub-groups empty or partly filled, one-id, empty
# and long bags, VBE.
@pytest.mark.parametrize("groups,weighted,pooling,wdtype", [
    (2, False, "sum", "float16"),
    pytest.param(4, True, "mean", "float32", marks=pytest.mark.skipif(
        not ON_GPU, reason="compiled only; interpret mode covers the sub-group path in [2-False-sum-float16] and "
        "test_short_bag_hint_segment (4 sub-groups), weighted mean pooling in "
        "test_mixed_dims_shared_tables_empty_bags[float32-mean-True]"))])
def test_bag_groups_bitwise_equal_one_group(rng, groups, weighted, pooling, wdtype):
    tables = specs([40, 9, 300], [32, 8, 17])
    fmap = [0, 1, 2, 1]
    batch = [13, 1, 6, 9]  # 13 bags at 2 * 4 per program: one full program, one with 5 bags (3 sub-groups)
    kw = dict(feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype, bounds_check="warning", **KERNEL_KW)
    one = tbe_jax.TableBatchedEmbedding(tables, kernel_config=tbe_jax.ForwardConfig(tile_elems=64, bag_groups=1), **kw)
    many = tbe_jax.TableBatchedEmbedding(
        tables, kernel_config=tbe_jax.ForwardConfig(tile_elems=64, bag_groups=groups), **kw)
    params = one.init(jax.random.key(3))
    idx, off = _batch_of_lengths(rng, tables, fmap, batch, [0, 1, 1, 2, 11])  # one-id bags mostly, some empty, long
    idx[::7] = 10_000  # bad ids: dropped and counted the same
    psw = rng.random(off[-1]).astype(np.float32) if weighted else None
    out1, rep1 = one.forward_with_report(params, idx, off, psw, batch_size_per_feature=tuple(batch))
    outg, repg = many.forward_with_report(params, idx, off, psw, batch_size_per_feature=tuple(batch))
    if weighted:
        assert_close(outg, out1, 1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(outg), np.asarray(out1))
    assert int(repg.invalid_indices) == int(rep1.invalid_indices) == int(np.sum(idx == 10_000))
    ref = tbe_jax.TableBatchedEmbedding(tables, impl="xla", feature_table_map=fmap, pooling=pooling,
                                        weights_dtype=wdtype)
    assert_close(outg, ref(params, idx, off, psw, batch_size_per_feature=tuple(batch)), tolerance(wdtype, 11))


# ForwardConfig.max_programs: a persistent grid, P looping programs running entries pid, pid + P, ... and one
# program for each entry of the rest (2 and 3 loops over the 12 entries of three segments, the hinted short
# one among them): each bag is pooled by the same code in the same order, so the outputs are bitwise equal
# and the bad-id counts the same; a cap above a third of the entries is the plain grid.
@pytest.mark.parametrize("cap", [2, 3, 1000])
def test_max_programs_persistent_grid_bitwise(rng, cap):
    tables = [tbe_jax.TableSpec(40, 32), tbe_jax.TableSpec(9, 8, bag_size_hint=1), tbe_jax.TableSpec(300, 17)]
    fmap = [0, 1, 2, 1]
    batch = [13, 1, 6, 9]
    kw = dict(feature_table_map=fmap, weights_dtype="float16", bounds_check="warning", **KERNEL_KW)
    one = tbe_jax.TableBatchedEmbedding(tables, kernel_config=tbe_jax.ForwardConfig(tile_elems=64), **kw)
    few = tbe_jax.TableBatchedEmbedding(tables, kernel_config=tbe_jax.ForwardConfig(tile_elems=64, max_programs=cap),
                                        **kw)
    params = one.init(jax.random.key(4))
    idx, off = _batch_of_lengths(rng, tables, fmap, batch, [0, 1, 1, 2, 11])
    idx[::5] = 10_000
    out1, rep1 = one.forward_with_report(params, idx, off, batch_size_per_feature=tuple(batch))
    outp, repp = few.forward_with_report(params, idx, off, batch_size_per_feature=tuple(batch))
    np.testing.assert_array_equal(np.asarray(outp), np.asarray(out1))
    assert int(repp.invalid_indices) == int(rep1.invalid_indices) == int(np.sum(idx == 10_000))
    ref = tbe_jax.TableBatchedEmbedding(tables, impl="xla", feature_table_map=fmap, weights_dtype="float16")
    assert_close(outp, ref(params, idx, off, batch_size_per_feature=tuple(batch)), tolerance("float16", 11))


def test_max_programs_validated():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_programs"):
            tbe_jax.ForwardConfig(max_programs=bad)
    for bad in (-1.0, True, "10"):
        for name in ("persistent_max_mean", "persistent_max_values"):
            with pytest.raises(ValueError, match=name):
                tbe_jax.ForwardConfig(**{name: bad})


# The rule: one resident wave of looping programs (32 an SM) for one-warp float launches whose bags hold at most
# `persistent_max_mean` ids and pool at most `persistent_max_values` values on average (ids a bag times the bags'
# mean row width); plain grids for more, several warps, quantized rows, or with the rule off; an explicit
# `max_programs` wins.
def test_persistent_rule(monkeypatch):
    from tbe_jax.kernels import forward_config
    monkeypatch.setattr(forward_config, "sm_count", lambda: 132)
    cfg = tbe_jax.ForwardConfig()
    assert (cfg.persistent_max_mean, cfg.persistent_max_values) == (10, 1280)
    kw = dict(warps=1, num_bags=1_000, quantized=False)
    assert cfg.launch_programs(num_ids=8_000, mean_dim=128, **kw) == 4224
    assert cfg.launch_programs(num_ids=10_000, mean_dim=128, **kw) == 4224
    assert cfg.launch_programs(num_ids=10_001, mean_dim=128, **kw) is None
    assert cfg.launch_programs(num_ids=8_400, mean_dim=192, **kw) is None  # 1613 values a bag
    assert cfg.launch_programs(num_ids=6_600, mean_dim=192, **kw) == 4224
    assert cfg.launch_programs(num_ids=20_000, mean_dim=32, **kw) is None  # few values, but 20 ids a bag
    wide = tbe_jax.ForwardConfig(persistent_max_mean=100)
    assert wide.launch_programs(num_ids=40_000, mean_dim=32, **kw) == 4224
    assert wide.launch_programs(num_ids=40_001, mean_dim=32, **kw) is None
    assert cfg.launch_programs(num_ids=1_000, mean_dim=128, warps=2, num_bags=1_000, quantized=False) is None
    assert cfg.launch_programs(num_ids=1_000, mean_dim=128, warps=1, num_bags=1_000, quantized=True) is None
    for off in (tbe_jax.ForwardConfig(persistent_max_mean=0), tbe_jax.ForwardConfig(persistent_max_values=0)):
        assert off.launch_programs(num_ids=1, mean_dim=128, **kw) is None
        assert off.launch_programs(num_ids=0, mean_dim=128, **kw) is None
    assert tbe_jax.ForwardConfig(max_programs=7).launch_programs(
        warps=2, num_ids=9, num_bags=1, mean_dim=8, quantized=True) == 7


# The rule end to end: bags of 1.5 ids on average, 2 SMs (64 looping programs over 256 entries: 3 each, then
# 64 plain programs) against the rule off, bitwise, with weights, empty bags and bad ids.
def test_persistent_rule_launch(rng, monkeypatch):
    from tbe_jax.kernels import forward_config
    monkeypatch.setattr(forward_config, "sm_count", lambda: 2)
    taken = []
    rule = forward_config.ForwardConfig.launch_programs
    monkeypatch.setattr(forward_config.ForwardConfig, "launch_programs",
                        lambda self, **kw: taken.append(rule(self, **kw)) or taken[-1])
    tables = specs([50, 7000], [128, 128])
    batch = [256, 256]
    kw = dict(weights_dtype="float16", bounds_check="warning", **KERNEL_KW)
    on = tbe_jax.TableBatchedEmbedding(tables, **kw)
    off = tbe_jax.TableBatchedEmbedding(tables, kernel_config=tbe_jax.ForwardConfig(persistent_max_values=0), **kw)
    params = on.init(jax.random.key(5))
    idx, off_ = _batch_of_lengths(rng, tables, [0, 1], batch, [0, 1, 1, 2, 3])
    idx[::9] = 10_000
    psw = rng.random(off_[-1]).astype(np.float32)
    out_on, rep_on = on.forward_with_report(params, idx, off_, psw)
    assert 64 in taken
    taken.clear()
    out_off, rep_off = off.forward_with_report(params, idx, off_, psw)
    assert taken and all(t is None for t in taken)
    np.testing.assert_array_equal(np.asarray(out_on), np.asarray(out_off))
    assert int(rep_on.invalid_indices) == int(rep_off.invalid_indices) == int(np.sum(idx == 10_000))


# Programs of several warps (`ForwardConfig.num_warps`): the tile's bags spread over the warps. Interpret mode
# ignores warps, so this checks the compiled layouts only on a GPU; on a CPU it still runs the configs' schedules.
@pytest.mark.parametrize("wdtype,num_warps,weighted", [("float32", 2, True), ("float16", 4, False)])
def test_warps_per_program(rng, wdtype, num_warps, weighted):
    tables = specs([23, 5, 64, 31, 300], [8, 17, 100, 128, 257])
    fmap = [0, 1, 2, 3, 4, 3]
    cfg = tbe_jax.ForwardConfig(num_warps=num_warps)
    _run(rng, tables, fmap, [9, 0, 5, 33, 2, 17], (0, 30), wdtype=wdtype, weighted=weighted, vbe=True, config=cfg)
    _run(rng, tables, fmap, [8] * len(fmap), (1, 5), wdtype=wdtype, alpha=1.2,
         config=tbe_jax.ForwardConfig(num_warps=num_warps, unroll=8))


def test_num_warps_validated():
    assert tbe_jax.ForwardConfig().num_warps is None
    for bad in (0, 3, "auto", True, 2.0):
        with pytest.raises(ValueError, match="num_warps"):
            tbe_jax.ForwardConfig(num_warps=bad)


def test_default_warps_rule():
    """The default (`num_warps=None`): two warps only for launches of fp32 rows with per-sample weights that
    have a tile of at most 128 columns; an explicit `num_warps` always wins."""
    rule = tbe_jax.ForwardConfig().launch_warps
    assert rule(fp32_rows=True, weighted=True, block_dims=[128]) == 2
    assert rule(fp32_rows=True, weighted=True, block_dims=[16, 256]) == 2  # a mixed-dims launch
    assert rule(fp32_rows=True, weighted=True, block_dims=[256]) == 1
    assert rule(fp32_rows=True, weighted=False, block_dims=[64]) == 1
    assert rule(fp32_rows=False, weighted=True, block_dims=[64]) == 1  # fp16 or quantized rows
    for w in (1, 2, 4):
        assert tbe_jax.ForwardConfig(num_warps=w).launch_warps(fp32_rows=True, weighted=True, block_dims=[64]) == w


def test_default_warps_launch(rng, monkeypatch):
    """What the forward launches under the rule: 2 warps for weighted fp32 rows of D <= 128, 1 otherwise (the
    warps handed to Triton, captured from `pallas_call`'s compiler params); the results are the reference's."""
    from tbe_jax.kernels import forward as fwd

    seen = []
    real = fwd.pallas_call

    def spy(kernel, **kw):
        if kw.get("name") == "tbe_pooled_forward":
            seen.append(kw["compiler_params"].num_warps)
        return real(kernel, **kw)

    monkeypatch.setattr(fwd, "pallas_call", spy)
    for wdtype, dims, weighted, want in (("float32", [8, 100], True, 2), ("float32", [200], True, 1),
                                         ("float32", [8, 100], False, 1), ("float16", [8, 100], True, 1)):
        seen.clear()
        tables = specs([29, 71][: len(dims)], dims)
        _run(rng, tables, list(range(len(dims))), [7] * len(dims), (0, 9), wdtype=wdtype, weighted=weighted,
             config=tbe_jax.ForwardConfig())
        assert seen and set(seen) == {want}, (wdtype, dims, weighted, seen)


def test_wide_bags_rule():
    """`ForwardConfig.for_launch`: `wide_bags` bags and warps a program only for float launches whose every tile
    is `tile_elems` wide, with at least `wide_min_bags` bags averaging at most `wide_max_mean` ids."""
    cfg = tbe_jax.ForwardConfig()
    wide = cfg.for_launch(dims=[160, 256], num_ids=2 * 8192, num_bags=8192, quantized=False)
    assert (wide.tile_elems, wide.num_warps) == (512, 2) and wide.bags_per_program(160, 8192) == 2
    assert wide.launch_warps(fp32_rows=False, weighted=False, block_dims=[256]) == 2
    keep = [dict(dims=[160, 128], num_ids=8192, num_bags=8192, quantized=False),  # a tile narrower than 256
            dict(dims=[160, 300], num_ids=8192, num_bags=8192, quantized=False),  # one wider: still one bag
            dict(dims=[192], num_ids=8192, num_bags=8191, quantized=False),  # too few bags
            dict(dims=[192], num_ids=3 * 8192 + 1, num_bags=8192, quantized=False),  # bags too long
            dict(dims=[192], num_ids=8192, num_bags=8192, quantized=True),
            dict(dims=[], num_ids=0, num_bags=8192, quantized=False)]
    for kw in keep:
        assert cfg.for_launch(**kw) is cfg, kw
    for c in (tbe_jax.ForwardConfig(wide_bags=1), tbe_jax.ForwardConfig(num_warps=1)):
        assert c.for_launch(dims=[256], num_ids=8192, num_bags=8192, quantized=False) is c
    c = tbe_jax.ForwardConfig(wide_bags=4, wide_min_bags=0, wide_max_mean=1.5)
    assert c.for_launch(dims=[256], num_ids=3, num_bags=2, quantized=False).num_warps == 4
    assert c.for_launch(dims=[256], num_ids=4, num_bags=2, quantized=False) is c
    for bad in (dict(wide_bags=3), dict(wide_bags=0), dict(wide_min_bags=-1), dict(wide_min_bags=1.0),
                dict(wide_max_mean=-1.0), dict(wide_max_mean=float("nan")), dict(wide_max_mean=True)):
        with pytest.raises(ValueError, match="wide_"):
            tbe_jax.ForwardConfig(**bad)


def test_wide_bags_launch(rng, monkeypatch):
    """Wide rows with short bags run two bags a two-warp program (the warps handed to Triton, captured); long
    bags, a narrow table beside them, or few bags keep one; every launch gives the reference's results,
    empty bags and duplicates included."""
    from tbe_jax.kernels import forward as fwd

    seen = []
    real = fwd.pallas_call

    def spy(kernel, **kw):
        if kw.get("name") == "tbe_pooled_forward":
            seen.append((kw["compiler_params"].num_warps, kw["grid"][0]))
        return real(kernel, **kw)

    monkeypatch.setattr(fwd, "pallas_call", spy)
    cfg = tbe_jax.ForwardConfig(wide_min_bags=16)
    for wdtype, dims, bag_len, weighted, batch, want in (
            ("float16", [160], (0, 3), False, 21, 2), ("float32", [200, 256], (0, 3), True, 9, 2),
            ("float16", [160], (0, 12), False, 21, 1), ("float16", [160, 64], (0, 3), False, 11, 1),
            ("float32", [192], (0, 3), False, 15, 1)):
        seen.clear()
        tables = specs([29, 7][: len(dims)], dims)  # table 1 (E = 7): heavy duplicates
        _run(rng, tables, list(range(len(dims))), [batch] * len(dims), bag_len, wdtype=wdtype, weighted=weighted,
             config=cfg)
        bags = batch * len(dims)
        assert [w for w, _ in seen] == [want], (wdtype, dims, bag_len, seen)
        if want == 2 and len(dims) == 1:
            assert seen[0][1] == -(-bags // 2)  # two bags a program


def test_bag_groups_validated():
    assert tbe_jax.ForwardConfig().bag_groups == 1
    for bad in (0, 3, -2, 1.0, None):
        with pytest.raises(ValueError, match="bag_groups"):
            tbe_jax.ForwardConfig(bag_groups=bad)


def test_short_bag_hint_segment(rng):
    """Features whose table has `bag_size_hint` <= 2 get their own segment with `short_bag_groups` sub-groups;
    a wrong hint (longer bags) stays exact: bitwise the output without hints, bad ids counted the same."""
    from tbe_jax import dispatch
    from tbe_jax.kernels import forward

    rows, dims, hints = [40, 9, 300], [16, 16, 16], [1, None, 2]
    hinted = [tbe_jax.TableSpec(e, d, bag_size_hint=h) for e, d, h in zip(rows, dims, hints)]
    plain = [tbe_jax.TableSpec(e, d) for e, d in zip(rows, dims)]
    fmap, b = [0, 1, 2, 0], 11
    cfg = tbe_jax.ForwardConfig(tile_elems=32, short_bag_groups=4)
    kw = dict(feature_table_map=fmap, weights_dtype="float16", bounds_check="warning", kernel_config=cfg,
              **KERNEL_KW)
    emb, ref = tbe_jax.TableBatchedEmbedding(hinted, **kw), tbe_jax.TableBatchedEmbedding(plain, **kw)
    assert dispatch.short_bag_features(emb) == (0, 2, 3)
    plan = emb.plan_for(len(fmap) * b + 1)
    _, branches, _, _ = forward._schedule(emb.layout, plan, cfg, range(4), frozenset({0, 2, 3}))
    assert sorted(br.groups for br in branches) == [1, 4]  # G = 2 bags: 11 bags fill 4 sub-groups
    params = emb.init(jax.random.key(1))
    lengths = rng.choice([0, 1, 2, 7], size=b * len(fmap))
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    e_per_bag = np.repeat([rows[t] for t in fmap], b)
    idx = (rng.random(off[-1]) * np.repeat(e_per_bag, lengths)).astype(np.int32)
    idx[::5] = -3
    out, rep = emb.forward_with_report(params, idx, off)
    want, want_rep = ref.forward_with_report(params, idx, off)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert int(rep.invalid_indices) == int(want_rep.invalid_indices) == int(np.sum(idx == -3))
    with pytest.raises(ValueError, match="short_bag_groups"):
        tbe_jax.ForwardConfig(short_bag_groups=3)


def test_hint_bag_sizes_from_a_sample_batch(rng):
    """`tbe_jax.hint_bag_sizes`: per table the mean bag length of its features in a sample (shared tables pooled,
    VBE, a table without bags keeps its hint); the hinted embedding's output equals the unhinted one's (one-id
    features then take the short-bag segment); bad samples are refused with the reason."""
    tables = specs([40, 9, 300, 20], [16, 16, 16, 8])
    tables[3] = tbe_jax.TableSpec(20, 8, bag_size_hint=7)
    fmap, batch = [0, 1, 0, 2, 3], [5, 4, 3, 6, 0]
    lengths = np.concatenate([np.ones(5), [0, 2, 3, 4], [2, 2, 1], np.full(6, 30), []]).astype(np.int64)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    hinted = tbe_jax.hint_bag_sizes(tables, off, fmap, batch_size_per_feature=batch)
    assert [t.bag_size_hint for t in hinted] == [1, 2, 30, 7]  # table 0: (5 + 5) ids / 8 bags = 1.25
    assert [(t.num_embeddings, t.embedding_dim) for t in hinted] == [(t.num_embeddings, t.embedding_dim) for t in tables]
    idx = (rng.random(off[-1]) * np.repeat(np.repeat([tables[t].num_embeddings for t in fmap], batch), lengths)
           ).astype(np.int32)
    kw = dict(feature_table_map=fmap, weights_dtype="float16", **KERNEL_KW)
    plain, hint = tbe_jax.TableBatchedEmbedding(tables, **kw), tbe_jax.TableBatchedEmbedding(hinted, **kw)
    params = plain.init(jax.random.key(0))
    bpf = tuple(batch)
    np.testing.assert_array_equal(np.asarray(hint(params, idx, off, batch_size_per_feature=bpf)),
                                  np.asarray(plain(params, idx, off, batch_size_per_feature=bpf)))
    # B = 2 (no batch_size_per_feature): 1.5 ids a bag rounds up to 2, 1.0 stays 1
    assert [t.bag_size_hint for t in tbe_jax.hint_bag_sizes(tables[:2], np.array([0, 1, 3, 3, 5]))] == [2, 1]
    with pytest.raises(ValueError, match="not a multiple"):
        tbe_jax.hint_bag_sizes(tables[:2], np.arange(4))
    with pytest.raises(ValueError, match="non-decreasing"):
        tbe_jax.hint_bag_sizes(tables[:2], np.array([0, 2, 1, 3, 4]))
    with pytest.raises(ValueError, match="batch_size_per_feature"):
        tbe_jax.hint_bag_sizes(tables[:2], np.arange(5), batch_size_per_feature=[3, 3])
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda o: tbe_jax.hint_bag_sizes(tables[:2], o))(jnp.arange(5))
