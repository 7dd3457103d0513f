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
