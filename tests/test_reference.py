"""The pure-jnp reference (impl="xla") against the float64 NumPy model."""

import jax
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from conftest import assert_close, specs, tables_f64, tolerance


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("wdtype", ["float32", "float16", "bfloat16"])
def test_reference_pooled_matches_float64(rng, pooling, weighted, wdtype):
    dims = [1, 3, 17, 100, 128, 257]
    tables = specs([30 + 7 * i for i in range(6)], dims)
    fmap = [0, 1, 2, 3, 4, 5, 3]  # table 3 shared by two features
    emb = tbe_jax.TableBatchedEmbedding(
        tables, feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype, impl="xla")
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    batch = [9] * len(fmap)
    idx, off, psw = testing.make_batch(
        rng, [tables[t].num_embeddings for t in fmap], batch, (0, 40), weighted=weighted)
    out = emb(params, idx, off, psw)
    ref = testing.numpy_pooled(tables_f64(emb, params), fmap, batch, idx, off, psw, pooling, False)
    assert_close(out, ref, tolerance("float32", 40))


def test_reference_vbe_and_none(rng):
    tables = specs([50, 60, 70], [8, 8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla")
    params = emb.init(jax.random.key(0))
    batch = (3, 0, 5)
    idx, off, psw = testing.make_batch(rng, [50, 60, 70], batch, (0, 6), weighted=True)
    out = emb(params, idx, off, psw, batch_size_per_feature=batch)
    ref = testing.numpy_pooled(tables_f64(emb, params), [0, 1, 2], batch, idx, off, psw, "sum", True)
    assert out.shape == (8 * 8,)
    assert_close(out, ref, 1e-6)

    seq = tbe_jax.TableBatchedEmbedding(tables, pooling="none", impl="xla")
    out = seq(params, idx, off, psw, batch_size_per_feature=batch)
    feat = np.repeat(np.arange(3), [off[3] - off[0], off[3] - off[3], off[8] - off[3]])
    tabs = tables_f64(emb, params)
    ref = np.stack([psw[p] * tabs[feat[p]][idx[p]] for p in range(len(idx))])
    assert_close(out, ref, 1e-6)


def test_position_feature_equals_position_features_on_repaired_offsets(rng):
    """`preprocess.position_feature` (boundary compares, the host tier's routing) gives `position_features`'
    feature at every position for repaired offsets: empty features (at the start, middle and end), empty bags,
    padding past the last bag, offsets that needed the repair, VBE batch sizes, and the fallback past
    `max_compares` features."""
    import jax.numpy as jnp

    from tbe_jax import bounds, preprocess

    for trial in range(60):
        nf = int(rng.integers(1, 7))
        batch = [int(rng.integers(0, 4)) for _ in range(nf)] if trial % 2 else [int(rng.integers(1, 4))] * nf
        nb = sum(batch)
        off = np.concatenate([[0], np.cumsum(rng.integers(0, 4, nb))])
        n = int(off[-1]) + int(rng.integers(0, 4))
        if trial % 5 == 0:  # malformed: the repair makes them non-decreasing within [0, n]
            off = rng.integers(-2, n + 3, nb + 1)
        off, _ = bounds.repair_offsets(jnp.asarray(off, jnp.int32), n)
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(10, 4) for _ in range(nf)], impl="xla")
        vbe = len(set(batch)) > 1 or 0 in batch
        plan = emb.plan_for(nb + 1, batch_size_per_feature=batch) if vbe else emb.plan_for(nb + 1)
        want = np.asarray(preprocess.position_features(plan, off, n)[1])
        for cap in (64, 1):
            got = np.asarray(preprocess.position_feature(plan, off, n, max_compares=cap))
            np.testing.assert_array_equal(got, want, err_msg=f"batch {batch} offsets {np.asarray(off)}")
