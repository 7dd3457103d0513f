"""tt_jax: specs, cores, the materialised table and the pooled jnp lookup.

The fused Pallas kernel does not exist yet; these tests pin the semantics it
will be checked against (float64 NumPy straight from the TT formula).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tt_jax
from tbe_jax import testing
from tt_jax import reference
from conftest import assert_close


@pytest.mark.parametrize("n,d,t", [(10_000_000, 32, 3), (1000, 16, 2), (777, 64, 4), (5, 6, 3)])
def test_suggested_shapes(n, d, t):
    p, q = tt_jax.suggested_tt_shapes(n, d, t)
    assert len(p) == len(q) == t
    assert math.prod(p) >= n and math.prod(q) == d
    assert math.prod(p) < n * 1.5 + 8  # little padding


@pytest.mark.parametrize(
    "spec",
    [
        tt_jax.TTSpec(97, 8, p_shapes=(10, 10), q_shapes=(2, 4), ranks=(5,)),  # T=2, N not a product
        tt_jax.TTSpec(200, 12, p_shapes=(4, 5, 11), q_shapes=(2, 3, 2), ranks=(3, 7)),  # T=3
        tt_jax.TTSpec(300, 16, p_shapes=(3, 4, 5, 6), q_shapes=(2, 2, 2, 2), ranks=(2, 4, 3)),  # T=4
        tt_jax.TTSpec(64, 4, p_shapes=(4, 4, 4), q_shapes=(1, 2, 2), ranks=(1, 1)),  # rank 1
    ],
    ids=["T2", "T3", "T4", "rank1"],
)
def test_full_table_matches_float64_formula(spec):
    emb = tt_jax.TTEmbeddingBag(spec)
    params = emb.init(jax.random.key(1), init="approx-uniform")
    got = emb.full_table(params)[0]
    want = reference.numpy_rows(emb.get_cores(params)[0], spec)
    assert got.shape == (spec.num_embeddings, spec.embedding_dim)
    assert_close(got, want, 1e-6)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_matches_dense_model(rng, pooling, weighted):
    specs = [tt_jax.TTSpec(500, 16, ranks=(6, 6)), tt_jax.TTSpec(90, 8, ranks=(4,)),
             tt_jax.TTSpec(1000, 32, ranks=(3, 5, 2))]
    emb = tt_jax.TTEmbeddingBag(specs, pooling=pooling)
    params = emb.init(jax.random.key(2))
    batch = [7, 7, 7]
    idx, off, psw = testing.make_batch(rng, [s.num_embeddings for s in specs], batch, (0, 30), alpha=1.2,
                                       weighted=weighted)
    out = jax.jit(lambda p, i, o, w: emb(p, i, o, w))(params, idx, off, psw)
    full = [np.asarray(t, np.float64) for t in jax.jit(emb.full_table)(params)]  # jitted: one compile
    want = testing.numpy_pooled(full, [0, 1, 2], batch, idx, off, psw, pooling, False)
    assert_close(out, want, 2e-6)


def test_one_hot_prefix_and_invalid_ids(rng):
    # Every lookup shares one (i1, i2) prefix; two ids are out of range and skipped.
    spec = tt_jax.TTSpec(1000, 8, p_shapes=(10, 10, 10), q_shapes=(2, 2, 2), ranks=(4, 4))
    emb = tt_jax.TTEmbeddingBag(spec)
    params = emb.init(jax.random.key(3))
    idx = (370 + rng.integers(0, 10, 40)).astype(np.int32)
    idx[[3, 17]] = [1000, -5]
    off = np.array([0, 0, 25, 40], np.int32)
    out = emb(params, idx, off)
    full = np.asarray(jax.jit(emb.full_table)(params)[0], np.float64)  # jitted: one compile
    want = testing.numpy_pooled([full], [0], [3], idx, off, None, "sum", False)
    assert_close(out, want, 2e-6)
    assert not np.any(np.asarray(out[0]))


def test_init_scale_and_round_trip():
    spec = tt_jax.TTSpec(4000, 16, ranks=(8, 8))
    emb = tt_jax.TTEmbeddingBag(spec)
    for init in ("approx-normal", "approx-uniform"):
        params = emb.init(jax.random.key(4), init=init, std=0.05)
        std = float(jnp.std(emb.full_table(params)[0]))
        assert 0.03 < std < 0.08, std
    cores = emb.get_cores(params)
    assert [c.shape for c in cores[0]] == spec.core_shapes()
    again = emb.set_cores(None, [[c * 2 for c in cores[0]]])
    assert_close(emb.full_table(again)[0], 8 * np.asarray(emb.full_table(params)[0]), 1e-6)


def test_errors():
    with pytest.raises(ValueError, match="prod\\(p_shapes"):
        tt_jax.TTSpec(1000, 8, p_shapes=(9, 10, 10), q_shapes=(2, 2, 2))
    with pytest.raises(ValueError, match="prod\\(q_shapes"):
        tt_jax.TTSpec(1000, 8, p_shapes=(10, 10, 10), q_shapes=(2, 2, 3))
    with pytest.raises(ValueError, match="T = 2..4"):
        tt_jax.TTSpec(1000, 8, ranks=(2, 2, 2, 2))
    emb = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(100, 8, ranks=(2, 2)), impl="pallas")
    params = emb.init(jax.random.key(0))
    if jax.default_backend() != "gpu":  # compiled Pallas needs a GPU (interpret=True runs anywhere)
        with pytest.raises(NotImplementedError, match="impl='xla'"):
            emb(params, np.array([1], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="init must be"):
        emb.init(jax.random.key(0), init="svd")
    emb2 = tt_jax.TTEmbeddingBag([tt_jax.TTSpec(100, 8, ranks=(2, 2))] * 2)
    with pytest.raises(ValueError, match="F\\*B\\+1"):
        emb2(emb2.init(jax.random.key(0)), np.array([1], np.int32), np.array([0, 1], np.int32))


@pytest.mark.parametrize("t_cores", [2, 3, 4])
def test_prefix_plan_and_prefix_reuse_rows(rng, t_cores):
    from tt_jax import prefix

    p = {2: (30, 40), 3: (8, 9, 10), 4: (4, 5, 6, 7)}[t_cores]
    q = {2: (2, 4), 3: (2, 2, 2), 4: (1, 2, 2, 2)}[t_cores]
    n_rows = math.prod(p) - 3  # N not a product of p
    spec = tt_jax.TTSpec(n_rows, math.prod(q), p_shapes=p, q_shapes=q, ranks=(3,) * (t_cores - 1))
    emb = tt_jax.TTEmbeddingBag(spec)
    params = emb.init(jax.random.key(5))
    ids = testing.sample_ids(rng, n_rows, 300, 1.3)
    ids[:5] = [-1, n_rows, n_rows + 2, 0, n_rows - 1]
    valid = (ids >= 0) & (ids < n_rows)
    plan = jax.jit(lambda i, v: prefix.build(i, v, spec, chunk=4))(jnp.asarray(ids), jnp.asarray(valid))
    uniq = np.unique(ids[valid])
    nu = int(plan.num_uniq)
    assert nu == len(uniq)
    np.testing.assert_array_equal(np.asarray(plan.uniq)[:nu], uniq)
    inv = np.asarray(plan.inverse)
    np.testing.assert_array_equal(np.asarray(plan.uniq)[inv[valid]], ids[valid])
    prefixes = uniq // p[-1]
    ng = int(plan.num_groups)
    assert ng == len(np.unique(prefixes))
    gs = np.asarray(plan.group_start)[: ng + 1]
    assert gs[0] == 0 and gs[-1] == nu and np.all(np.diff(gs) > 0)
    for g in range(ng):
        assert len(set(prefixes[gs[g] : gs[g + 1]])) == 1
    # Work items cover every distinct id exactly once, in chunks of at most 4.
    ni = int(plan.num_items)
    cover = np.concatenate([np.arange(f, f + c) for f, c in zip(np.asarray(plan.item_first)[:ni],
                                                                  np.asarray(plan.item_count)[:ni])])
    np.testing.assert_array_equal(cover, np.arange(nu))
    assert np.asarray(plan.item_count)[:ni].max() <= 4
    rows = prefix.rows_by_prefix(emb.get_cores(params)[0], spec, plan)
    full = reference.numpy_rows(emb.get_cores(params)[0], spec)
    assert_close(np.asarray(rows)[:nu], full[uniq], 1e-6)


def test_full_table_in_chunks_at_10m_rows():
    """The README's 10M-row spec (rank 2 here): materialised in row chunks, intermediates bounded."""
    from tt_jax import reference as tt_ref
    spec = tt_jax.TTSpec(num_embeddings=10_000_000, embedding_dim=32, p_shapes=(200, 200, 250), q_shapes=(2, 4, 4),
                         ranks=(2, 2))
    chunk = tt_ref.FULL_TABLE_WORKSPACE // tt_ref.row_workspace_bytes(spec)
    assert chunk < spec.num_embeddings  # the chunked path
    emb = tt_jax.TTEmbeddingBag([spec], impl="xla")
    params = emb.init(jax.random.key(0))
    full = emb.full_table(params)[0]
    assert full.shape == (10_000_000, 32)
    probe = np.array([0, 1, chunk - 1, chunk, 5_000_000, 9_999_999])
    got = np.asarray(full[probe], np.float64)
    want = np.asarray(tt_ref.rows([np.asarray(c, np.float64) for c in params["cores"][0]], spec.p_shapes,
                                  jnp.asarray(probe, jnp.int32)), np.float64)
    assert_close(got, want, 1e-5)
    small = tt_jax.TTSpec(num_embeddings=300, embedding_dim=8, ranks=(3,))
    small_emb = tt_jax.TTEmbeddingBag([small], impl="xla")
    p2 = small_emb.init(jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(tt_ref.full_table(p2["cores"][0], small, workspace_bytes=4096)),
                                  np.asarray(tt_ref.full_table(p2["cores"][0], small)))
