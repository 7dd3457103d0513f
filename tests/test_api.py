"""Public contract: construction, hashing, storage round trip, impl selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from conftest import KERNEL_KW, specs


def test_hashable_and_equal():
    a = tbe_jax.TableBatchedEmbedding(specs([10, 20], [4, 8]), pooling="mean")
    b = tbe_jax.TableBatchedEmbedding(specs([10, 20], [4, 8]), pooling="mean")
    c = tbe_jax.TableBatchedEmbedding(specs([10, 20], [4, 8]), pooling="sum")
    assert a == b and hash(a) == hash(b) and a != c
    assert len({a, b, c}) == 2


@pytest.mark.parametrize("wdtype", ["float32", "float16", "bfloat16"])
def test_storage_round_trip(wdtype):
    tables = specs([10, 20, 5, 7], [4, 8, 4, 3])
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=wdtype)
    params = emb.init(jax.random.key(0))
    assert sorted(params) == ["d3", "d4", "d8"]
    assert params["d4"].shape == (15, 4)  # tables 0 and 2 share one buffer, no padding
    got = emb.get_tables(params)
    assert [g.shape for g in got] == [(10, 4), (20, 8), (5, 4), (7, 3)]
    assert all(g.dtype == jnp.dtype(wdtype) for g in got)
    new = [jnp.full(g.shape, float(i + 1)) for i, g in enumerate(got)]
    back = emb.get_tables(emb.set_tables(params, new))
    for i, g in enumerate(back):
        np.testing.assert_array_equal(np.asarray(g, np.float32), i + 1.0)
    bound = 1 / np.sqrt(20)
    assert np.abs(np.asarray(got[1], np.float32)).max() <= bound
    assert np.std(np.asarray(got[1], np.float32)) > bound / 4  # really random


def test_constructor_errors():
    t = specs([10], [4])
    with pytest.raises(ValueError, match="pooling"):
        tbe_jax.TableBatchedEmbedding(t, pooling="max")
    with pytest.raises(ValueError, match="weights_dtype"):
        tbe_jax.TableBatchedEmbedding(t, weights_dtype=jnp.int8)
    with pytest.raises(ValueError, match="bounds_check"):
        tbe_jax.TableBatchedEmbedding(t, bounds_check="strict")
    with pytest.raises(ValueError, match="feature_table_map\\[0\\]=3"):
        tbe_jax.TableBatchedEmbedding(t, feature_table_map=[3])
    with pytest.raises(ValueError, match='pooling="none"'):
        tbe_jax.TableBatchedEmbedding(specs([10, 10], [4, 8]), pooling="none")
    with pytest.raises(ValueError, match="num_embeddings"):
        tbe_jax.TableSpec(0, 4)
    with pytest.raises(ValueError, match="embedding_dim"):
        tbe_jax.TableSpec(4, 2.5)
    with pytest.raises(ValueError, match="set_tables|shape"):
        emb = tbe_jax.TableBatchedEmbedding(t)
        emb.set_tables(None, [jnp.zeros((10, 5))])


def test_auto_impl_matches_explicit_paths():
    tables = specs([30, 40], [8, 12])
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 30, 20).astype(np.int32)
    off = np.array([0, 3, 9, 15, 20], np.int32)
    auto = tbe_jax.TableBatchedEmbedding(tables)
    params = auto.init(jax.random.key(1))
    xla = tbe_jax.TableBatchedEmbedding(tables, impl="xla")
    ker = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    np.testing.assert_allclose(auto(params, idx, off), xla(params, idx, off), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ker(params, idx, off), xla(params, idx, off), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only behaviour")
def test_pallas_without_gpu_says_how():
    emb = tbe_jax.TableBatchedEmbedding(specs([10], [4]), impl="pallas")
    params = emb.init(jax.random.key(0))
    with pytest.raises(ValueError, match="interpret=True"):
        emb(params, np.array([1], np.int32), np.array([0, 1], np.int32))


def test_int64_ids_with_x64():
    with jax.enable_x64(True):
        tables = specs([30, 40], [8, 8])
        emb = tbe_jax.TableBatchedEmbedding(tables, bounds_check="warning", **KERNEL_KW)
        params = emb.init(jax.random.key(1))
        idx = np.array([1, 2, 2**32 + 3, 39], np.int64)  # 2**32+3 must not wrap to 3
        off = np.array([0, 2, 3, 3, 4], np.int64)
        with pytest.warns(RuntimeWarning, match="1 index"):
            out = np.asarray(emb(params, idx, off))
            jax.effects_barrier()
        t0, t1 = (np.asarray(t) for t in emb.get_tables(params))
        np.testing.assert_allclose(out[0, :8], t0[1] + t0[2], rtol=1e-6)
        np.testing.assert_allclose(out[1, :8], 0)
        np.testing.assert_allclose(out[1, 8:], t1[39], rtol=1e-6)
