"""Replicated (`"data"`) tables in `tbe_jax.shard`: each device looks up its own samples from its own copy (no ids
routed), and the update combines the devices' sparse gradients (an `all_gather` of per-row lists) so that every copy
takes the same, unsharded update. Against the unsharded embedding on the global batch.

CPU: 4 fake devices (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import shard_programs, testing
from test_sharding import N_DEV, TABLES, FMAP, SEQ_TABLES, SEQ_FMAP, assert_tables, global_batch, local_batches, \
    mesh, run_case

pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

# Replicated tables next to table-, row- and column-wise ones; table 1 (read by two features) replicated.
PLAN = {0: "data", 1: "data", 2: "row", 3: "column", 4: "table"}


def replica_rows(sharded, tree):
    """Per storage buffer of `tree` (params or a state field): every device's copy of the replicated rows."""
    lay = sharded.layout
    out = {}
    for c, w in enumerate(lay.widths):
        key = sharded.local.layout.key(c)
        rows = sum(p.rows for p in lay.pieces if p.cols == w and p.device == 0
                   and sharded.plan.strategies[p.table] == "data")
        if rows:
            shards = sorted(tree[key].addressable_shards, key=lambda x: x.index[0].start or 0)
            out[key] = [np.asarray(x.data)[:rows] for x in shards]
    return out


def assert_replicas_identical(sharded, params, st):
    trees = [params] + [getattr(st, f) for f in st._fields if f != "count"]
    for tree in trees:
        for key, copies in replica_rows(sharded, tree).items():
            assert len(copies) == N_DEV
            for c in copies[1:]:
                assert np.array_equal(c, copies[0]), key  # bitwise


def test_data_ids_are_not_routed():
    """The replicated features have no slot on any device (their ids stay where their samples are), and the
    replicated tables sit at the same buffer rows on every device."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", PLAN)
    lay = sharded.layout
    assert lay.data_features == (0, 1, 5)
    assert (lay.slot_of[:, list(lay.data_features)] == -1).all()
    for p in lay.pieces:
        if sharded.plan.strategies[p.table] == "data":
            assert lay.pool_row[p] == lay.data_row0[p.table]
    params = sharded.init(jax.random.key(0))  # the copies are drawn alike
    st = sharded.init_opt_state(params, tbe_jax.Adam(0.1))
    assert_replicas_identical(sharded, params, st)


@pytest.mark.parametrize("pooling,opt", [
    ("sum", tbe_jax.SGD(0.3)),
    ("mean", tbe_jax.Adam(0.05, weight_decay=0.01)),
    ("mean", tbe_jax.RowwiseAdagrad(0.2, weight_decay=0.01, weight_decay_mode="decoupled")),
    ("sum", tbe_jax.PartialRowwiseLamb(0.05)),
])
def test_mixed_plan_with_replicated_tables(pooling, opt):
    """Forward and 3 steps (duplicates, empty bags, an invalid id, per-sample weights) equal the unsharded ones;
    the copies stay bitwise identical; the checkpoint round trip keeps everything. Row-wise optimizers with a
    column-wise table take the summed-statistics path for the routed tables."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling=pooling, impl="xla")
    sharded, params, st = run_case(emb, PLAN, opt, steps=3, seed=11)
    assert_replicas_identical(sharded, params, st)
    emb_params, emb_st = sharded.to_unsharded(params, st)
    p2, s2 = sharded.from_unsharded(emb_params, emb_st)
    assert_tables(sharded.get_tables(p2), sharded.get_tables(params), 0)
    for name in (f for f in st._fields if f != "count"):
        assert_tables(sharded.get_state(s2, name), sharded.get_state(st, name), 0)
    assert_replicas_identical(sharded, p2, s2)


def test_unweighted_and_sequence_lookups():
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling="mean", impl="xla")
    run_case(emb, {0: "table", 1: "data", 2: "data", 3: "row", 4: "data"}, tbe_jax.Adagrad(0.2), steps=2, seed=12,
             weighted=False)
    emb = tbe_jax.TableBatchedEmbedding(SEQ_TABLES, feature_table_map=SEQ_FMAP, pooling="none", impl="xla")
    sharded, params, st = run_case(emb, {0: "data", 1: "data", 2: "table"}, tbe_jax.RowwiseAdagrad(0.1), steps=2,
                                   seed=13)
    assert_replicas_identical(sharded, params, st)


def test_every_table_replicated():
    emb = tbe_jax.TableBatchedEmbedding(TABLES[:3], feature_table_map=[0, 1, 2, 1], impl="xla")
    sharded, params, st = run_case(emb, "data", tbe_jax.Adam(0.05), steps=2, seed=14)
    assert_replicas_identical(sharded, params, st)


def test_train_step_jitted():
    """`tbe_jax.train_step` (jitted, one compile for 3 batches) with replicated tables, mean pooling, per-sample
    weights, row-wise Adagrad, against the unsharded train_step on the global batch and a float64 model of it.

    The head is small enough that `tanh` never saturates: with `linspace(-1, 1)` (this test until 2026-12-04) the
    pre-activations reached |x| ~ 15 by step 3, where float32's `1 - tanh(x)**2` is 0 or a few ulp of 1 (float64:
    1e-12), so some rows' gradients were rounding noise; row-wise Adagrad's `g / sqrt(m)` turns any gradient, however
    small, into a step of size ~lr, and the column-wise table differed by 8e-5 relative between the two float32 runs
    while both were 0.5 relative away from the float64 model. Not a sharding error: both runs were as far from it."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling="mean", impl="xla")
    sharded = tbe_jax.shard(emb, mesh(auto=True), "data", PLAN)
    opt = tbe_jax.RowwiseAdagrad(0.5)
    ref_params = emb.init(jax.random.key(3))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    st, ref_st = sharded.init_opt_state(params, opt), emb.init_opt_state(ref_params, opt)
    head = jnp.linspace(-0.1, 0.1, sum(emb.feature_dims))
    h64 = np.asarray(head, np.float64)
    lr, eps = 0.5, float(opt.eps)
    tab64 = [np.asarray(t, np.float64) for t in emb.get_tables(ref_params)]
    mom64 = [np.zeros(t.shape[0]) for t in tab64]
    traces = []

    def make_step(core, count):
        @jax.jit
        def step(params, st, opt, idx, off, w):
            count.append(1)
            res = tbe_jax.train_step(lambda h, out: jnp.sum(jnp.tanh(out @ h)), head,
                                     tbe_jax.SparseLookup(core, opt, params, st, idx, off, w))
            return res.params, res.opt_state
        return step

    step, ref_step = make_step(sharded, traces), make_step(emb, [])
    rng = np.random.default_rng(15)
    for _ in range(3):
        idx, off, w = local_batches(rng, emb, N_DEV, 3, 30)
        gi, go, gw, _ = global_batch(emb, idx, off, w)
        params, st = step(params, st, opt, idx, off, w)
        ref_params, ref_st = ref_step(ref_params, ref_st, opt, gi, go, gw)
        # The float64 model of the same step (the sum of tanh's gradient, row-wise Adagrad on every row).
        batch = [N_DEV * 3] * emb.num_features
        out = testing.numpy_pooled(tab64, FMAP, batch, gi, go, gw, "mean", False)
        g_out = (1.0 - np.tanh(out @ h64) ** 2)[:, None] * h64[None, :]
        d_tables, _ = testing.numpy_pooled_vjp(tab64, FMAP, batch, gi, go, gw, g_out, "mean", False)
        for t, d in enumerate(d_tables):
            mom64[t] = mom64[t] + (d * d).mean(1)
            tab64[t] = tab64[t] - lr * d / (np.sqrt(mom64[t]) + eps)[:, None]
    assert len(traces) == 1
    # Every table to fp32 rounding, against the unsharded step and the float64 model.
    got, want = sharded.get_tables(params), emb.get_tables(ref_params)
    assert_tables(got, want)
    assert_tables(got, tab64)
    assert_tables(want, tab64)
    assert_tables(sharded.get_momentum(st), emb.get_momentum(ref_st))
    assert_tables(sharded.get_momentum(st), mom64)
    assert_replicas_identical(sharded, params, st)


def test_update_exchanges_no_table_sized_array():
    """The update's collectives on the replicated tables are sized by the local batch's ids: no `[E, D]` psum."""
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(5000, 8), tbe_jax.TableSpec(40, 8)], impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", {0: "data", 1: "table"})
    params = sharded.init(jax.random.key(0))
    opt = tbe_jax.SGD(0.1)
    st = sharded.init_opt_state(params, opt)
    rng = np.random.default_rng(16)
    idx, off, w = local_batches(rng, emb, N_DEV, 3, 16)
    idx, off, psw = sharded._args(idx, off, None)
    routed = shard_programs.route_for_update(sharded, idx, off, psw)
    g = sharded._place(jnp.ones((N_DEV * 3, 16), jnp.float32), jax.sharding.PartitionSpec("data"))
    hlo = shard_programs.update.lower(sharded, params, st, opt, routed, g).as_text()
    assert "all_gather" in hlo or "all-gather" in hlo
    collectives = "".join(l for l in hlo.splitlines() if "all_reduce" in l or "all-reduce" in l
                          or "all_gather" in l or "all-gather" in l)
    assert "5000" not in collectives and "5040" not in collectives, collectives


def test_stochastic_rounding_keeps_replicas_identical():
    """bf16 tables with stochastic rounding: the rounding's per-row seed is the buffer row, the same on every device
    (replicated copies first in each buffer), so the copies stay bitwise identical; the tables agree with the
    unsharded ones to bf16 rounding."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, weights_dtype=jnp.bfloat16, impl="xla")
    opt = tbe_jax.SGD(0.3, stochastic_rounding=True)
    sharded = tbe_jax.shard(emb, mesh(), "data", {0: "table", 1: "data", 2: "row", 3: "data", 4: "table"})
    ref_params = emb.init(jax.random.key(17))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    st, ref_st = sharded.init_opt_state(params, opt), emb.init_opt_state(ref_params, opt)
    rng = np.random.default_rng(17)
    for _ in range(2):
        idx, off, w = local_batches(rng, emb, N_DEV, 3, 30)
        gi, go, gw, _ = global_batch(emb, idx, off, w)
        g = rng.normal(size=(N_DEV * 3, sum(emb.feature_dims))).astype(np.float32)
        params, st = sharded.apply_gradients(params, st, opt, idx, off, g, w)
        ref_params, ref_st = emb.apply_gradients(ref_params, ref_st, opt, gi, go, g, gw)
    assert_replicas_identical(sharded, params, st)
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params), 2e-2)
