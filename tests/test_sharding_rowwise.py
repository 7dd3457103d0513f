"""`tbe_jax.shard` with column-wise tables and optimizers that reduce over whole rows (row-wise Adagrad, the partial
row-wise Adams, the LAMBs): each column shard sums its part of a row's statistic and the parts are added across
the shards (`tbe_jax.shard_programs._column_update`), so the update equals the unsharded one.

Tolerances: a row's statistic is a sum over its columns; sharded, it is a sum of per-shard partial sums (another
order of the same fp32 additions), so tables and states agree to ~1e-6 relative, not bitwise (the element-wise
optimizers' column tests in tests/test_sharding.py are bitwise). What must be bitwise: the copies of a row-wise
state that every column shard of a table keeps.

CPU: 4 fake devices (tests/conftest.py); GPU: the devices present.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from conftest import KERNEL_KW
from test_sharding import N_DEV, TABLES, FMAP, assert_tables, global_batch, local_batches, mesh, run_case

pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

# Three tables by columns (D 8, 16 and 12: blocks of 2, 4 and 3 on 4 devices; table 1 read by two features),
# beside a replicated and a table-wise one.
PLAN = {0: "column", 1: "column", 2: "data", 3: "column", 4: "table"}


def column_copies_identical(sharded, st):
    """Every column shard of a table holds the same row-wise state (bitwise): returns how many were compared."""
    lay = sharded.layout
    compared = 0
    for name in (f for f in st._fields if f != "count"):
        tree = getattr(st, name)
        host = {k: np.asarray(jax.device_get(v)) for k, v in tree.items()}
        if next(iter(host.values())).ndim != 1:
            continue
        for t, strategy in enumerate(sharded.strategies):
            if strategy != "column":
                continue
            copies = []
            for p in (p for p in lay.pieces if p.table == t):
                c = lay.piece_pool[p]
                r = p.device * lay.pool_rows[c] + lay.pool_row[p]
                copies.append(host[sharded.local.layout.key(c)][r : r + p.rows])
            for x in copies[1:]:
                assert np.array_equal(x, copies[0]), (name, t)
            compared += len(copies)
    return compared


@pytest.mark.parametrize("opt", [
    tbe_jax.RowwiseAdagrad(0.2, weight_decay=0.01, weight_decay_mode="l2"),
    tbe_jax.PartialRowwiseAdam(0.05, weight_decay=0.01),
    tbe_jax.Lamb(0.05),
    tbe_jax.PartialRowwiseLamb(0.05, weight_decay=0.01),
], ids=lambda o: type(o).__name__)
def test_column_wise_row_statistics_match_unsharded(opt):
    """Three column-wise tables beside a replicated and a table-wise one, two steps (duplicates, empty bags and an
    invalid id in every batch): tables and states equal the unsharded update's; the row-wise state stays identical
    on every column shard and survives a checkpoint round trip (to_unsharded / from_unsharded) bitwise."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    sharded, params, st = run_case(emb, PLAN, opt, steps=2, seed=11)
    rowwise = any(opt.rule().slot_rowwise)
    assert column_copies_identical(sharded, st) == (3 * N_DEV if rowwise else 0)
    emb_params, emb_st = sharded.to_unsharded(params, st)
    p2, s2 = sharded.from_unsharded(emb_params, emb_st)
    assert_tables(sharded.get_tables(p2), sharded.get_tables(params), 0)
    for name in (f for f in st._fields if f != "count"):
        assert_tables(sharded.get_state(s2, name), sharded.get_state(st, name), 0)
        for k in getattr(st, name):
            assert np.array_equal(np.asarray(getattr(s2, name)[k]), np.asarray(getattr(st, name)[k])), (name, k)


def test_nonfinite_gradient_in_one_column_block_skips_the_whole_row():
    """A NaN in one column of a column-wise table's output gradient: the unsharded update skips the rows of that
    bag (`skip_nonfinite`); every column shard skips them too, not only the one that saw the NaN."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES[:2], feature_table_map=[0, 1], impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", {0: "column", 1: "table"})
    opt = tbe_jax.RowwiseAdagrad(0.3)
    rng = np.random.default_rng(3)
    b = 3
    off = np.tile(np.arange(0, 2 * 2 * b + 1, 2, dtype=np.int32), (N_DEV, 1))  # bags of 2 ids
    idx = np.concatenate([rng.integers(8, 37, size=(N_DEV, 2 * b)), rng.integers(0, 50, size=(N_DEV, 2 * b))], 1)
    idx[0, :2] = [5, 6]  # device 0's first bag of feature 0: rows 5 and 6, which no other bag reads
    idx = idx.astype(np.int32)
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    gi, go, gw, _ = global_batch(emb, idx, off, w)
    ref_params = emb.init(jax.random.key(1))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    g = rng.normal(size=(N_DEV * b, sum(emb.feature_dims))).astype(np.float32)
    g[0, 7] = np.nan  # sample 0 of device 0, table 0's last column: on the last column shard only
    params, st = sharded.apply_gradients(params, sharded.init_opt_state(params, opt), opt, idx, off, g, w)
    ref_params, ref_st = emb.apply_gradients(ref_params, emb.init_opt_state(ref_params, opt), opt, gi, go, g, gw)
    got = np.asarray(sharded.get_tables(params)[0])
    before = np.asarray(emb.get_tables(emb.init(jax.random.key(1)))[0])
    assert np.array_equal(got[5:7], before[5:7]) and not np.asarray(sharded.get_momentum(st)[0][5:7]).any()
    assert np.isfinite(got).all() and not np.array_equal(got[8:], before[8:])
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params))
    assert_tables(sharded.get_momentum(st), emb.get_momentum(ref_st))


def test_train_step_column_wise_rowwise_adagrad():
    """`tbe_jax.train_step` (jitted) with a column-wise table and row-wise Adagrad, mean pooling, against the
    unsharded train_step on the global batch."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES[:3], feature_table_map=[0, 1, 2, 1], pooling="mean", impl="xla")
    sharded = tbe_jax.shard(emb, mesh(auto=True), "data", {0: "column", 1: "row", 2: "table"})
    opt = tbe_jax.RowwiseAdagrad(0.5)
    ref_params = emb.init(jax.random.key(2))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    st, ref_st = sharded.init_opt_state(params, opt), emb.init_opt_state(ref_params, opt)
    head = jnp.linspace(-1.0, 1.0, sum(emb.feature_dims))

    def make_step(core):
        @jax.jit
        def step(params, st, opt, idx, off):
            res = tbe_jax.train_step(lambda h, out: jnp.sum(jnp.tanh(out @ h)), head,
                                     tbe_jax.SparseLookup(core, opt, params, st, idx, off))
            return res.params, res.opt_state
        return step

    step, ref_step = make_step(sharded), make_step(emb)
    rng = np.random.default_rng(9)
    for _ in range(2):
        idx, off, w = local_batches(rng, emb, N_DEV, 3, 30)
        gi, go, _, _ = global_batch(emb, idx, off, w)
        params, st = step(params, st, opt, idx, off)
        ref_params, ref_st = ref_step(ref_params, ref_st, opt, gi, go)
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params))
    assert_tables(sharded.get_momentum(st), emb.get_momentum(ref_st))
    assert column_copies_identical(sharded, st) == N_DEV


def test_kernel_lookups_column_wise_rowwise_adagrad():
    """The Pallas lookups (compiled on GPU, interpret mode on CPU) with a column-wise table and row-wise Adagrad:
    the update takes the XLA sparse path on every device (`_column_update`) and still matches the unsharded one."""
    kw = dict(feature_table_map=[0, 1, 0])
    emb = tbe_jax.TableBatchedEmbedding(TABLES[:2], **kw, **KERNEL_KW)
    sharded = tbe_jax.shard(emb, mesh(), "data", {0: "column", 1: "table"})
    assert sharded.uses_kernel()
    run_case(emb, {0: "column", 1: "table"}, tbe_jax.RowwiseAdagrad(0.2), steps=1, seed=4, b=2, cap=16,
             ref_emb=tbe_jax.TableBatchedEmbedding(TABLES[:2], **kw, impl="xla"))
