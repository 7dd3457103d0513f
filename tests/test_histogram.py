"""Small-table histogram path: eligibility, dispatch, and exactness.

Runs compiled on a GPU and in interpret mode on CPU (conftest.KERNEL_KW).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from tbe_jax.kernels import histogram
from conftest import KERNEL_KW, assert_close, tables_f64, tolerance


def _emb(tables, **kw):
    kw.setdefault("weights_dtype", "float16")
    return tbe_jax.TableBatchedEmbedding(tables, **kw, **KERNEL_KW)


def _check(rng, tables, batch, bag_len, *, expect, pooling="sum", fmap=None, alpha=1.0):
    fmap = list(range(len(tables))) if fmap is None else fmap
    emb = _emb(tables, feature_table_map=fmap, pooling=pooling)
    assert emb.plan() == expect
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, _ = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], batch, bag_len,
                                     alpha=alpha)
    out = emb(params, idx, off)
    generic = _emb(tables, feature_table_map=fmap, pooling=pooling, use_histogram=False)
    assert set(generic.plan()) == {"generic"}
    out_generic = generic(params, idx, off)
    model = testing.numpy_pooled(tables_f64(emb, params), fmap, batch, idx, off, None, pooling, False)
    max_len = int(np.diff(off).max())
    tol = tolerance("float32", max_len)  # fp32 rounding: products are exact
    assert_close(out, model, tol)
    assert_close(out, out_generic, tol)
    return emb, params, idx, off


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("dim", [64, 100, 128])
def test_table_sizes_and_dims(rng, rows, dim):
    t = tbe_jax.TableSpec(rows, dim, bag_size_hint=128)
    _check(rng, [t], [19], (0, 300), expect=("histogram",))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_long_short_and_empty_bags(rng, pooling):
    # Bags from 0 to 1000 ids (crossing the 256-id histogram head), heavy duplicates (E=5).
    t = tbe_jax.TableSpec(5, 128, bag_size_hint=64)
    emb = _emb([t], pooling=pooling)
    params = emb.init(jax.random.key(1))
    lengths = np.array([0, 1, 63, 255, 256, 257, 1000, 511, 0, 64, 3, 700, 256, 2, 999, 5, 17])
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = rng.integers(0, 5, int(off[-1])).astype(np.int32)
    out = emb(params, idx, off)
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [len(lengths)], idx, off, None, pooling, False)
    assert_close(out, model, tolerance("float32", 1000))
    assert not np.any(np.asarray(out)[lengths == 0])


def test_mixed_batch_and_limits(rng):
    # One small table among ordinary ones, and one just outside each limit.
    tables = [
        tbe_jax.TableSpec(64, 128, bag_size_hint=100),  # eligible
        tbe_jax.TableSpec(500, 128),  # ordinary
        tbe_jax.TableSpec(65, 128, bag_size_hint=100),  # E = 65
        tbe_jax.TableSpec(40, 63, bag_size_hint=100),  # D = 63
        tbe_jax.TableSpec(40, 129, bag_size_hint=100),  # D = 129
        tbe_jax.TableSpec(40, 64, bag_size_hint=63),  # hint = 63
        tbe_jax.TableSpec(40, 64),  # no hint
        tbe_jax.TableSpec(10, 64, bag_size_hint=64),  # eligible
    ]
    expect = ("histogram", "generic", "generic", "generic", "generic", "generic", "generic", "histogram",
              "histogram")
    _check(rng, tables, [9] * 9, (0, 300), expect=expect, fmap=[0, 1, 2, 3, 4, 5, 6, 7, 0])


def test_ineligible_dtypes_weighted_and_vbe_plan_generic(rng):
    t = [tbe_jax.TableSpec(32, 64, bag_size_hint=128)]
    assert _emb(t).plan() == ("histogram",)
    assert _emb(t, weights_dtype="float32").plan() == ("generic",)
    assert _emb(t, weights_dtype="bfloat16").plan() == ("generic",)
    assert _emb(t, output_dtype="float16").plan() == ("generic",)
    assert _emb(t).plan(weighted=True) == ("generic",)
    assert _emb(t).plan(vbe=True) == ("generic",)
    assert _emb(t, use_histogram=False).plan() == ("generic",)
    # A weighted call on an eligible feature takes the generic path and is right.
    emb = _emb(t)
    params = emb.init(jax.random.key(0))
    idx, off, psw = testing.make_batch(rng, [32], [5], (0, 300), weighted=True)
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [5], idx, off, psw, "sum", False)
    assert_close(emb(params, idx, off, psw), model, tolerance("float16", 300))
    out = emb(params, idx, off, batch_size_per_feature=(5,))
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [5], idx, off, None, "sum", True)
    assert_close(out, model, tolerance("float16", 300))


def test_bad_ids_warning_mode(rng):
    t = [tbe_jax.TableSpec(20, 64, bag_size_hint=128)]
    emb = _emb(t, bounds_check="warning")
    params = emb.init(jax.random.key(0))
    idx = rng.integers(0, 20, 700).astype(np.int32)
    idx[[3, 300, 600]] = [20, -7, 25]  # bad in the head and in the tail
    idx[10] = -1  # pruned: skipped, not counted
    off = np.array([0, 350, 700], np.int32)
    with pytest.warns(RuntimeWarning, match="3 index"):
        out = emb(params, idx, off)
        jax.block_until_ready(out)
        jax.effects_barrier()
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [2], idx, off, None, "sum", False)
    assert_close(out, model, tolerance("float32", 350))


def test_saved_counts_match_numpy(rng):
    t = tbe_jax.TableSpec(30, 64, bag_size_hint=64)
    emb = _emb([t])
    params = emb.init(jax.random.key(0))
    batch = 20
    idx, off, _ = testing.make_batch(rng, [30], [batch], (0, 400))
    plan = emb.plan_for(len(off))
    out, counts = histogram.histogram_forward(
        None, params, emb.layout, plan, [0], jnp.asarray(idx), jnp.asarray(off),
        pooling="sum", check_upper=False, interpret=KERNEL_KW["interpret"], save_counts=True)
    rows = histogram.histogram_programs(plan, [0])
    counts = np.asarray(counts)
    for r, (f, b) in enumerate(rows):
        if b < 0:
            continue
        ids = idx[off[b] : off[b + 1]][: histogram.HEAD]
        np.testing.assert_array_equal(counts[r, :30], np.bincount(ids, minlength=30))
