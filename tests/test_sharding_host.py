"""`tbe_jax.shard` with tables in host memory (`TableSpec.location="host"`): their shards stay in host memory
(pools of their own, `ShardLayout.pool_keys`), trained by the same kernels, with results equal to the all-device
model's on the global batch.

CPU: 4 fake devices (tests/conftest.py; a "host" buffer is an ordinary array there, the same programs); GPU: the
devices present (pinned host memory; with one GPU only the mesh of one runs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import memory
from conftest import KERNEL_KW, ON_GPU
from test_sharding import FMAP, N_DEV, TABLES, assert_tables, local_batches, mesh, run_case

multi = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")


def with_host(tables, where):
    """`tables` with the tables at indices `where` in host memory."""
    return [tbe_jax.TableSpec(t.num_embeddings, t.embedding_dim, name=t.name,
                              location="host" if i in where else t.location) for i, t in enumerate(tables)]


HOST = with_host(TABLES, {1, 3})  # table 1 (D 16, read by two features) and table 3 (D 12) in host memory
# table 1 by rows, table 3 whole on device 1; a replicated and two table-wise device tables beside them
PLAN = {0: "table", 1: "row", 2: "data", 3: ("table", 1), 4: ("table", N_DEV - 1)}


def check_host_pools(sharded, params, st=None):
    """The host tables' pools are buffers of their own (a D 16 pool on each side), in pinned host memory on a GPU,
    and so is their optimizer state."""
    lay = sharded.layout
    assert (16, "host") in lay.pool_keys and (16, "device") in lay.pool_keys and (12, "host") in lay.pool_keys
    host = sharded.host_keys()
    assert host and host <= set(params)
    trees = [params] + ([getattr(st, f) for f in st._fields if f != "count"] if st is not None else [])
    for tree in trees:
        for k, v in tree.items():
            assert memory.on_host(v) == (k in host and memory.host_memory()), k


@multi
@pytest.mark.parametrize("pooling,opt", [
    ("sum", tbe_jax.RowwiseAdagrad(0.2)),
    ("mean", tbe_jax.Adam(0.05, weight_decay=0.01)),
], ids=["rowwise_adagrad-sum", "adam-mean"])
def test_host_tables_train_as_the_all_device_model(pooling, opt):
    """Two steps (duplicates, empty bags and invalid ids in every batch): outputs, tables and states equal the
    all-device model's on the global batch."""
    kw = dict(feature_table_map=FMAP, pooling=pooling, impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(HOST, **kw)
    sharded, params, st = run_case(emb, PLAN, opt, steps=2, seed=21, ref_emb=tbe_jax.TableBatchedEmbedding(TABLES, **kw))
    check_host_pools(sharded, params, st)


@multi
def test_kernels_with_host_tables():
    """The Pallas kernels inside shard_map read and update the host pools (compiled on GPU, interpret mode on CPU)."""
    kw = dict(feature_table_map=[0, 1, 2, 3, 1])
    emb = tbe_jax.TableBatchedEmbedding(HOST[:4], **kw, **KERNEL_KW)
    run_case(emb, {0: "table", 1: "row", 2: "data", 3: "table"}, tbe_jax.RowwiseAdagrad(0.2), steps=1, seed=22,
             b=2, cap=24, ref_emb=tbe_jax.TableBatchedEmbedding(TABLES[:4], **kw, impl="xla"))


@multi
def test_init_and_checkpoint_round_trip():
    """`init` draws the host tables in +-1/sqrt(E) and puts them in host memory; the state of their pools is made
    there; `to_unsharded` gives emb's own format (its host buffers) and `from_unsharded` puts it back bitwise."""
    emb = tbe_jax.TableBatchedEmbedding(HOST, feature_table_map=FMAP, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", PLAN)
    params = sharded.init(jax.random.key(4))
    opt = tbe_jax.Adagrad(0.1)
    st = sharded.init_opt_state(params, opt)
    check_host_pools(sharded, params, st)
    for spec, tab in zip(HOST, sharded.get_tables(params)):
        tab = np.asarray(tab)
        assert tab.shape == (spec.num_embeddings, spec.embedding_dim)
        bound = 1 / np.sqrt(spec.num_embeddings)
        assert np.abs(tab).max() <= bound and np.abs(tab).max() > 0.5 * bound
    rng = np.random.default_rng(6)
    idx, off, w = local_batches(rng, emb, N_DEV, 3, 40)
    g = rng.normal(size=(N_DEV * 3, sum(emb.feature_dims))).astype(np.float32)
    params, st = sharded.apply_gradients(params, st, opt, idx, off, g, w)
    emb_params, emb_st = sharded.to_unsharded(params, st)
    assert set(emb_params) == set(emb.init(jax.random.key(0)))  # emb's buffers, its host ones included
    p2, s2 = sharded.from_unsharded(emb_params, emb_st)
    check_host_pools(sharded, p2, s2)
    assert_tables(sharded.get_tables(p2), sharded.get_tables(params), 0)
    assert_tables(sharded.get_momentum(s2), sharded.get_momentum(st), 0)
    out = np.asarray(sharded(p2, idx, off, w))
    np.testing.assert_array_equal(out, np.asarray(sharded(params, idx, off, w)))


def test_mesh_of_one_is_emb_bitwise():
    """On a mesh of one device (the one GPU of the test machine: pinned host memory), the sharded model with host
    tables is `emb` itself: lookups, tables and states bitwise."""
    kw = KERNEL_KW if ON_GPU else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(HOST, feature_table_map=FMAP, **kw)
    sharded = tbe_jax.shard(emb, mesh(1), "data")
    rng = np.random.default_rng(7)
    idx, off, w = local_batches(rng, emb, 1, 4, 50)
    ref_params = emb.init(jax.random.key(0))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    opt = tbe_jax.RowwiseAdagrad(0.1)
    st = sharded.init_opt_state(params, opt)
    check_host_pools(sharded, params, st)
    out = sharded(params, idx, off, w)
    assert np.array_equal(np.asarray(out), np.asarray(emb(ref_params, idx[0], off[0], w[0])))
    g = rng.normal(size=out.shape).astype(np.float32)
    p1, s1 = sharded.apply_gradients(params, st, opt, idx, off, g, w)
    p2, s2 = emb.apply_gradients(ref_params, emb.init_opt_state(ref_params, opt), opt, idx[0], off[0], g, w[0])
    check_host_pools(sharded, p1, s1)
    for a, c in zip(sharded.get_tables(p1), emb.get_tables(p2)):
        assert np.array_equal(np.asarray(a), np.asarray(c))
    for a, c in zip(sharded.get_momentum(s1), emb.get_momentum(s2)):
        assert np.array_equal(np.asarray(a), np.asarray(c))


def test_planner_counts_host_memory_apart():
    """The device tables' memory shares are of the device tables alone: with a large host table beside them, the
    largest device table (over a fair share of the device tables' memory) still goes by rows, and the large host
    table (over a fair share of the host tables') goes by rows too."""
    tables = [tbe_jax.TableSpec(10_000, 16, location="host"), tbe_jax.TableSpec(400, 16),
              tbe_jax.TableSpec(100, 16), tbe_jax.TableSpec(100, 16), tbe_jax.TableSpec(100, 16)]
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)  # XLA's ops take no host tables on a GPU
    plan = tbe_jax.plan_sharding(emb, 4)
    assert plan.strategies == ("row", "row", "table", "table", "table")
    assert len({plan.owners[t] for t in (2, 3, 4)}) == 3
    device_only = tbe_jax.plan_sharding(tbe_jax.TableBatchedEmbedding(tables[1:], **KERNEL_KW), 4)
    assert device_only.strategies[0] == "row"


def test_host_tables_take_table_or_row_only():
    emb = tbe_jax.TableBatchedEmbedding(HOST, feature_table_map=FMAP, **KERNEL_KW)
    for bad in ("column", "data"):
        with pytest.raises(ValueError, match=r"table 3 .*location 'host'.*'table' or 'row'"):
            tbe_jax.shard(emb, mesh(), "data", {3: bad})
