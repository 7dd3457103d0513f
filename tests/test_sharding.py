"""`tbe_jax.shard`: tables over a mesh axis, against the unsharded embedding on the global batch.

CPU: 4 fake devices (tests/conftest.py); GPU: the devices present (2 on the 2-GPU machine).
"""

import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import shard_programs, testing
from conftest import KERNEL_KW, ON_GPU

N_DEV = min(4, len(jax.devices()))
pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

TABLES = [tbe_jax.TableSpec(37, 8), tbe_jax.TableSpec(50, 16), tbe_jax.TableSpec(9, 8),
          tbe_jax.TableSpec(103, 12), tbe_jax.TableSpec(20, 16, name="last")]
FMAP = [0, 1, 2, 3, 4, 1]  # table 1 read by two features
MIXED = {0: "table", 1: "row", 2: "data", 3: "column", 4: ("table", N_DEV - 1)}
SEQ_TABLES = [tbe_jax.TableSpec(37, 8), tbe_jax.TableSpec(50, 8), tbe_jax.TableSpec(9, 8)]
SEQ_FMAP = [0, 1, 2, 1]


def mesh(n=N_DEV, auto=False):
    """`jax.make_mesh`'s mesh (explicit axes on jax 0.10+), or one with an automatic axis."""
    if auto:
        return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def local_batches(rng, emb, n, b, cap, max_len=4, bad=True):
    """Per device: ids [cap] (padding past offsets[-1]) and offsets [F*b+1]; some empty bags, duplicates,
    and one id -1 (dropped, as `bounds_check="ignore"` does)."""
    nf = emb.num_features
    idx = np.zeros((n, cap), np.int32)
    off = np.zeros((n, nf * b + 1), np.int32)
    for k in range(n):
        lens = rng.integers(0, max_len, size=nf * b)
        while lens.sum() > cap:
            lens = lens // 2
        off[k, 1:] = np.cumsum(lens)
        for f in range(nf):
            e = emb.tables[emb.feature_table_map[f]].num_embeddings
            a, z = off[k, f * b], off[k, (f + 1) * b]
            idx[k, a:z] = rng.integers(0, e, size=z - a)
        if bad and off[k, -1] > 3:
            idx[k, 3] = -1
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    return idx, off, w


def global_batch(emb, idx, off, w):
    """The same samples as one batch in `emb`'s format (device 0's samples first), and each global
    id position's (device, local position). The ids and weights are padded past offsets[-1] to one length
    for the per-device shapes (n*cap + 1), so the unsharded reference compiles once for every step."""
    return testing.stack_batches(idx, off, w, num_features=emb.num_features, pad_to=np.asarray(idx).size + 1)


def tables_np(tabs):
    return [np.asarray(t, np.float64) for t in tabs]


def assert_tables(a, b, rtol=2e-6):
    for t, (x, y) in enumerate(zip(tables_np(a), tables_np(b))):
        scale = max(np.abs(y).max(), 1e-30)
        assert x.shape == y.shape, (t, x.shape, y.shape)
        assert np.abs(x - y).max() <= rtol * scale, (t, np.abs(x - y).max())


def to_global_grad(emb, g, where, n, cap):
    """A sequence output gradient `[n*cap, D]` (per local id) in the global batch's id order (padded rows: 0)."""
    gg = np.zeros((n * cap + 1, g.shape[1]), np.float32)
    for p, (k, q) in enumerate(where):
        gg[p] = g[k * cap + q]
    return gg


def run_case(emb, plan, opt, steps, seed, b=3, cap=40, weighted=True, ref_emb=None):
    """`emb` sharded by `plan` against `ref_emb` (default `emb`) unsharded on the global batch."""
    n = N_DEV
    rng = np.random.default_rng(seed)
    sharded = tbe_jax.shard(emb, mesh(), "data", plan)
    emb = emb if ref_emb is None else ref_emb
    ref_params = emb.init(jax.random.key(seed))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params), 0)
    st, ref_st = sharded.init_opt_state(params, opt), emb.init_opt_state(ref_params, opt)
    for _ in range(steps):
        idx, off, w = local_batches(rng, emb, n, b, cap)
        gi, go, gw, where = global_batch(emb, idx, off, w)
        psw, gpsw = (w, gw) if weighted else (None, None)
        out = np.asarray(sharded(params, idx, off, psw))
        ref = np.asarray(emb(ref_params, gi, go, gpsw))
        g = rng.normal(size=out.shape).astype(np.float32)
        if emb.pooling == "none":
            rows = [k * cap + q for k, q in where]
            np.testing.assert_allclose(out[rows], ref[: len(rows)], rtol=1e-6, atol=1e-6)
            gg = to_global_grad(emb, g, where, n, cap)
        else:
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
            gg = g
        params, st = sharded.apply_gradients(params, st, opt, idx, off, g, psw)
        ref_params, ref_st = emb.apply_gradients(ref_params, ref_st, opt, gi, go, gg, gpsw)
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params))
    for name in (f for f in st._fields if f != "count"):
        assert_tables(sharded.get_state(st, name), emb.get_state(ref_st, name))
    assert int(st.count) == int(ref_st.count) == steps
    return sharded, params, st


@pytest.mark.parametrize("pooling,opt", [
    ("sum", tbe_jax.SGD(0.3)),
    ("mean", tbe_jax.Adagrad(0.2)),
    ("sum", tbe_jax.Adam(0.05, weight_decay=0.01)),
])
def test_mixed_plan_matches_global_batch(pooling, opt):
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling=pooling, impl="xla")
    sharded, _, _ = run_case(emb, MIXED, opt, steps=2, seed=1)
    assert sharded.plan.strategies == ("table", "row", "data", "column", "table")


def test_padded_rows():
    """Tables stored padded (fp32 D 25 -> 28 and 33 -> 36, `StorageLayout.strides`) shard by table, row and
    column like any other (the shards are stored unpadded), and their Adam state converts both ways."""
    tables = [tbe_jax.TableSpec(37, 25), tbe_jax.TableSpec(50, 33), tbe_jax.TableSpec(20, 8)]
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=[0, 1, 2, 1], impl="xla")
    assert emb.layout.strides == (28, 36, 8)
    sharded, params, st = run_case(emb, {0: "row", 1: "column", 2: "table"}, tbe_jax.Adam(0.05), steps=2, seed=4)
    emb_params, emb_st = sharded.to_unsharded(params, st)
    assert emb_params["d25"].shape == (37, 28) and emb_st.momentum1["d33"].shape == (50, 36)
    assert not np.asarray(emb_params["d33"][:, 33:]).any() and not np.asarray(emb_st.momentum2["d25"][:, 25:]).any()
    p2, s2 = sharded.from_unsharded(emb_params, emb_st)
    assert_tables(sharded.get_tables(p2), sharded.get_tables(params), 0)
    assert_tables(sharded.get_state(s2, "momentum2"), sharded.get_state(st, "momentum2"), 0)


@pytest.mark.parametrize("opt", [tbe_jax.RowwiseAdagrad(0.2, weight_decay=0.01, weight_decay_mode="decoupled"),
                                 tbe_jax.PartialRowwiseLamb(0.05)])
def test_row_statistics_optimizers(opt):
    """Row-wise accumulators and trust ratios: fine on table-, row-wise and replicated tables."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    run_case(emb, {0: "row", 1: "table", 2: "data", 3: "row", 4: "table"}, opt, steps=2, seed=2)


def test_sequence_lookups():
    emb = tbe_jax.TableBatchedEmbedding(SEQ_TABLES, feature_table_map=SEQ_FMAP, pooling="none", impl="xla")
    run_case(emb, {0: "table", 1: "row", 2: "data"}, tbe_jax.RowwiseAdagrad(0.1), steps=2, seed=3)


def test_kernels_match():
    """The Pallas kernels inside shard_map (compiled on GPU, interpret mode on CPU): row-wise Adagrad. The
    reference is the unsharded XLA path (the unsharded kernels are checked against it elsewhere; on CPU two
    fewer interpret-mode programs to compile)."""
    kw = dict(feature_table_map=[0, 1, 2, 3, 1])
    emb = tbe_jax.TableBatchedEmbedding(TABLES[:4], **kw, **KERNEL_KW)
    run_case(emb, {0: "table", 1: "row", 2: "data", 3: "table"}, tbe_jax.RowwiseAdagrad(0.2), steps=1, seed=4,
             b=2, cap=24, ref_emb=tbe_jax.TableBatchedEmbedding(TABLES[:4], **kw, impl="xla"))


def test_mesh_of_one_is_emb_bitwise():
    # The kernels on GPU (XLA's GPU scatter-add sums in no fixed order, even between two runs of emb).
    kw = KERNEL_KW if ON_GPU else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling="mean", **kw)
    sharded = tbe_jax.shard(emb, mesh(1), "data")
    rng = np.random.default_rng(5)
    idx, off, w = local_batches(rng, emb, 1, 4, 50)
    ref_params = emb.init(jax.random.key(0))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    opt = tbe_jax.RowwiseAdagrad(0.1)
    out = sharded(params, idx, off, w)
    ref = emb(ref_params, idx[0], off[0], w[0])
    assert np.array_equal(np.asarray(out), np.asarray(ref))
    g = rng.normal(size=out.shape).astype(np.float32)
    p1, s1 = sharded.apply_gradients(params, sharded.init_opt_state(params, opt), opt, idx, off, g, w)
    p2, s2 = emb.apply_gradients(ref_params, emb.init_opt_state(ref_params, opt), opt, idx[0], off[0], g, w[0])
    for a, c in zip(sharded.get_tables(p1), emb.get_tables(p2)):
        assert np.array_equal(np.asarray(a), np.asarray(c))
    for a, c in zip(sharded.get_momentum(s1), emb.get_momentum(s2)):
        assert np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("block", [None, 256], ids=["one-draw", "blocks"])
def test_params_are_sharded_and_init(block, monkeypatch):
    """Each device holds only its shards; `init` draws every table in +-1/sqrt(E) on its owners, also block by
    block (`tbe.INIT_BLOCK` elements, here 16 rows of 16; the pools hold ~1000-1500 rows)."""
    from tbe_jax import tbe as tbe_module

    if block:
        monkeypatch.setattr(tbe_module, "INIT_BLOCK", block)
    big = [tbe_jax.TableSpec(4000, 16), tbe_jax.TableSpec(300, 16), tbe_jax.TableSpec(200, 16),
           tbe_jax.TableSpec(101, 16), tbe_jax.TableSpec(50, 8)]
    emb = tbe_jax.TableBatchedEmbedding(big, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data")
    assert sharded.plan.strategies[0] == "row"  # larger than its fair share of memory
    assert set(sharded.plan.strategies[1:]) == {"table"}
    params = sharded.init(jax.random.key(3))
    total = 0
    for key, arr in params.items():
        shards = arr.addressable_shards
        assert len(shards) == N_DEV and len({s.data.shape for s in shards}) == 1
        assert tuple(arr.sharding.spec)[0] == "data" and not any(tuple(arr.sharding.spec)[1:])
        total += shards[0].data.shape[0] * N_DEV
        assert shards[0].data.shape[0] < arr.shape[0]
    assert total < 2 * sum(t.num_embeddings for t in big)  # no full copy per device
    for spec, tab in zip(big, sharded.get_tables(params)):
        tab = np.asarray(tab)
        bound = 1 / np.sqrt(spec.num_embeddings)
        assert np.abs(tab).max() <= bound and np.abs(tab).max() > 0.5 * bound
        assert np.unique(tab).size > tab.size // 2


def test_planner_and_errors():
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    plan = tbe_jax.plan_sharding(emb, 4, {"last": "data", 1: ("table", 2)})
    assert plan.strategies[4] == "data" and plan.owners[1] == 2
    # table 3 holds 45% of all table memory: more than a fair share (1/4) -> row-wise
    assert plan.strategies == ("table", "table", "table", "row", "data")
    with pytest.raises(ValueError, match="strategy|one of"):
        tbe_jax.plan_sharding(emb, 4, {0: "diagonal"})
    with pytest.raises(ValueError, match="not a TableSpec.name"):
        tbe_jax.plan_sharding(emb, 4, {"nope": "row"})
    sharded = tbe_jax.shard(emb, mesh(), "data", {3: "column"})
    params = sharded.init(jax.random.key(0))
    # row statistics on a column-wise table: allowed (summed across its blocks, tests/test_sharding_rowwise.py)
    st = sharded.init_opt_state(params, tbe_jax.RowwiseAdagrad(0.1))
    assert sharded.get_momentum(st)[3].shape == (103,)
    with pytest.raises(ValueError, match="axis_name"):
        tbe_jax.shard(emb, mesh(), "model")
    with pytest.raises(ValueError, match="one row per device"):
        sharded(params, np.zeros((1, 8), np.int32), np.zeros((1, 7), np.int32))
    with pytest.raises(ValueError, match="b >= 1"):
        sharded(params, np.zeros((N_DEV, 8), np.int32), np.zeros((N_DEV, 1), np.int32))
    with pytest.raises(ValueError, match="room for at least one id"):
        sharded(params, np.zeros((N_DEV, 0), np.int32), np.zeros((N_DEV, 7), np.int32))
    with pytest.raises(ValueError, match="params"):
        sharded(emb.init(jax.random.key(0)), np.zeros((N_DEV, 8), np.int32), np.zeros((N_DEV, 7), np.int32))


def test_capacity_overflow_is_reported():
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    rng = np.random.default_rng(6)
    idx, off, w = local_batches(rng, emb, N_DEV, 3, 40, bad=False)
    full = tbe_jax.shard(emb, mesh(), "data", MIXED)
    params = full.set_tables(None, emb.get_tables(emb.init(jax.random.key(1))))
    want = np.asarray(full(params, idx, off))
    out, rep = full.forward_with_report(params, idx, off)
    assert int(rep.invalid_indices) == 0
    roomy = tbe_jax.shard(emb, mesh(), "data", MIXED, capacity=40)
    # the same ids either way (the XLA path on a GPU sums a segment in no fixed order: not bitwise there)
    np.testing.assert_allclose(np.asarray(roomy(params, idx, off)), want, rtol=1e-6, atol=1e-7)
    tight = tbe_jax.shard(emb, mesh(), "data", MIXED, capacity=2)
    out, rep = tight.forward_with_report(params, idx, off)
    assert int(rep.invalid_indices) > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(tight(params, idx, off))
        jax.effects_barrier()
    assert any("tbe_jax.shard" in str(c.message) for c in caught), [str(c.message) for c in caught]


def test_capacity_from_feature_counts():
    # capacity as per-feature counts: the placement's exact worst case (table-wise: each device receives only
    # its tables' features), no id dropped while the batches keep to the counts; counts too small are reported.
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    rng = np.random.default_rng(8)
    b, max_len = 3, 4
    idx, off, w = local_batches(rng, emb, N_DEV, b, 40, max_len=max_len, bad=False)
    plan = {t: ("table", t % N_DEV) for t in range(len(TABLES))}
    per_feature = [b * (max_len - 1)] * emb.num_features  # local_batches draws bags of 0 .. max_len - 1 ids
    full = tbe_jax.shard(emb, mesh(), "data", plan)
    counted = tbe_jax.shard(emb, mesh(), "data", plan, capacity=per_feature)
    load = [sum(per_feature[f] for f, t in enumerate(FMAP) if t % N_DEV == j) for j in range(N_DEV)]
    assert counted.capacity == max(load) < emb.num_features * b * (max_len - 1)
    params = full.set_tables(None, emb.get_tables(emb.init(jax.random.key(2))))
    out, rep = counted.forward_with_report(params, idx, off, w)
    assert int(rep.invalid_indices) == 0
    np.testing.assert_allclose(np.asarray(out), np.asarray(full(params, idx, off, w)), rtol=1e-6, atol=1e-7)
    short = tbe_jax.shard(emb, mesh(), "data", plan, capacity=[1] * emb.num_features)
    _, rep = short.forward_with_report(params, idx, off, w)
    assert int(rep.invalid_indices) > 0
    for bad in ([1] * (emb.num_features - 1), [-1] * emb.num_features, [1.5] * emb.num_features):
        with pytest.raises(ValueError, match="one int >= 0 per feature"):
            tbe_jax.shard(emb, mesh(), "data", plan, capacity=bad)


def test_train_step_under_jit_and_checkpoint_to_other_meshes(tmp_path):
    """`tbe_jax.train_step` with a sharded lookup, jitted, for 3 batches (one compile); the state saved
    with orbax from this mesh restores onto meshes of 1 and 2 devices. An automatic mesh axis: with an
    explicit one, jax asks the loss itself to say how its batch reductions are sharded."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(auto=True), "data", {0: "row", 1: "table", 2: "data", 3: "column", 4: "row"})
    opt = tbe_jax.Adam(0.05)
    params = sharded.init(jax.random.key(7))
    st = sharded.init_opt_state(params, opt)
    ref_params, ref_st = sharded.to_unsharded(params, st)
    head = jnp.linspace(-1.0, 1.0, sum(emb.feature_dims))
    traces = []

    def loss_fn(h, out):
        return jnp.mean(jnp.tanh(out @ h))

    @jax.jit
    def step(params, st, opt, idx, off):
        traces.append(1)
        res = tbe_jax.train_step(loss_fn, head, tbe_jax.SparseLookup(sharded, opt, params, st, idx, off))
        return res.params, res.opt_state, res.loss

    @jax.jit
    def ref_step(params, st, opt, idx, off):
        res = tbe_jax.train_step(loss_fn, head, tbe_jax.SparseLookup(emb, opt, params, st, idx, off))
        return res.params, res.opt_state, res.loss

    rng = np.random.default_rng(8)
    for _ in range(3):
        idx, off, w = local_batches(rng, emb, N_DEV, 3, 40)
        gi, go, _, _ = global_batch(emb, idx, off, w)
        params, st, loss = step(params, st, opt, idx, off)
        ref_params, ref_st, ref_loss = ref_step(ref_params, ref_st, opt, gi, go)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert len(traces) == 1
    # The loss's batch mean sums in another order on 4 devices; Adam's normalised steps carry that.
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params), 2e-5)
    assert_tables(sharded.get_state(st, "momentum2"), emb.get_state(ref_st, "momentum2"), 2e-5)

    import orbax.checkpoint as ocp
    saved = sharded.to_unsharded(params, st)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, {"params": saved[0], "state": saved[1]})
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path, {"params": saved[0], "state": saved[1]})
    for n in (1, 2):
        other = tbe_jax.shard(emb, mesh(n), "data")
        p2, s2 = other.from_unsharded(restored["params"], restored["state"])
        assert_tables(other.get_tables(p2), sharded.get_tables(params), 0)
        for name in ("momentum1", "momentum2"):
            assert_tables(other.get_state(s2, name), sharded.get_state(st, name), 0)
        assert int(s2.count) == 3


def test_other_mesh_buffers_refused_with_the_way_out():
    """Sharded buffers of a 4-device mesh given to the same plan on 2 devices (what restoring a checkpoint of
    the sharded arrays onto another mesh gives): refused, naming to_unsharded/from_unsharded."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    four, two = tbe_jax.shard(emb, mesh(4), "data", {0: "row"}), tbe_jax.shard(emb, mesh(2), "data", {0: "row"})
    params = four.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"another mesh.*to_unsharded\(params, opt_state\).*from_unsharded"):
        two.init_opt_state(params, tbe_jax.SGD(0.1))
    # the right params with an optimizer state of the other mesh: the step names the way out too
    opt = tbe_jax.RowwiseAdagrad(0.1)
    st4, p2 = four.init_opt_state(params, opt), two.init(jax.random.key(0))
    idx, off, _ = local_batches(np.random.default_rng(0), emb, 2, 3, 20)
    g = np.ones((6, sum(emb.feature_dims)), np.float32)
    for call in (lambda: two.apply_gradients(p2, st4, opt, idx, off, g),
                 lambda: two.step_update(p2, st4, opt, two.step_forward(p2, idx, off)[1], g)):
        with pytest.raises(ValueError, match=r"another mesh.*strict=False.*to_unsharded\(params, opt_state\)"):
            call()


# The refused restore leaves orbax's read coroutines unawaited; collected later, they were reported as
# unraisable-exception warnings under whichever test ran then: collected here, inside this test, and ignored.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_orbax_restore_of_sharded_arrays_onto_another_mesh_is_refused(tmp_path):
    """The sharded arrays themselves saved with orbax (not `to_unsharded`'s) and restored onto a mesh of 2: with
    their saved shapes they are refused by the sharded calls (pointing to to_unsharded / from_unsharded); with the
    new mesh's shapes orbax refuses unless `strict=False`, whose padded or cut rows no check can tell from a
    right state (docs/sharding.md says so)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    four, two = tbe_jax.shard(emb, mesh(4), "data", {0: "row"}), tbe_jax.shard(emb, mesh(2), "data", {0: "row"})
    opt = tbe_jax.RowwiseAdagrad(0.1)
    params = four.init(jax.random.key(0))
    st = four.init_opt_state(params, opt)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "sharded", {"params": params, "state": st})
    on_two = jax.sharding.NamedSharding(two.mesh, jax.sharding.PartitionSpec("data"))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_two if x.ndim else
                                                         jax.sharding.NamedSharding(two.mesh, jax.sharding.PartitionSpec())),
                          {"params": params, "state": st})
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "sharded", target)
    idx, off, _ = local_batches(np.random.default_rng(0), emb, 2, 3, 20)
    with pytest.raises(ValueError, match=r"another mesh.*to_unsharded\(params, opt_state\).*from_unsharded"):
        two(restored["params"], idx, off)
    with pytest.raises(ValueError, match=r"another mesh.*to_unsharded\(params, opt_state\).*from_unsharded"):
        two.apply_gradients(restored["params"], restored["state"], opt, idx, off,
                            np.ones((6, sum(emb.feature_dims)), np.float32))
    p2 = two.init(jax.random.key(0))
    shapes_of_two = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), p2)
    with ocp.StandardCheckpointer() as ckpt, pytest.raises(ValueError, match="strict=False"):
        ckpt.restore(tmp_path / "sharded", {"params": shapes_of_two, "state": target["state"]})
    gc.collect()


def test_mean_pooling_training_forward_routes_the_ids_once():
    """The training forward with mean pooling: one all_to_all for the ids (their weights scaled by 1/len(bag) where
    the bag lives) and one for the pooled rows; the plain forward the same two."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling="mean", impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", MIXED)
    params = sharded.init(jax.random.key(0))
    idx, off, w = local_batches(np.random.default_rng(0), emb, N_DEV, 3, 20)
    for train in (True, False):
        text = str(jax.make_jaxpr(lambda p, i, o: shard_programs.forward(sharded, p, i, o, None, train))(
            params, *sharded._args(idx, off, None)[:2]))
        assert text.count("all_to_all") == 2, (train, text.count("all_to_all"))


def test_comm_dtype_bfloat16():
    """Pooled rows and gradients travelling in bf16: close to emb (bf16 rounding), tables still updated."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    rng = np.random.default_rng(9)
    idx, off, w = local_batches(rng, emb, N_DEV, 3, 40)
    gi, go, gw, _ = global_batch(emb, idx, off, w)
    sharded = tbe_jax.shard(emb, mesh(), "data", MIXED, comm_dtype=jnp.bfloat16)
    ref_params = emb.init(jax.random.key(2))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    out = np.asarray(sharded(params, idx, off, w))
    ref = np.asarray(emb(ref_params, gi, go, gw))
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-3)
    opt = tbe_jax.SGD(0.5)
    g = rng.normal(size=out.shape).astype(np.float32)
    p1, _ = sharded.apply_gradients(params, sharded.init_opt_state(params, opt), opt, idx, off, g, w)
    p2, _ = emb.apply_gradients(ref_params, emb.init_opt_state(ref_params, opt), opt, gi, go, g, gw)
    assert_tables(sharded.get_tables(p1), emb.get_tables(p2), 2e-2)
    with pytest.raises(ValueError, match="comm_dtype"):
        tbe_jax.shard(emb, mesh(), "data", comm_dtype=jnp.int8)


@pytest.mark.parametrize("bcfg", [dict(rank_sort_max=0), dict(rank_sort_max=1 << 20, rank_sort_chunk=256)],
                         ids=["xla_sort", "rank_sort_merge"])
def test_program_does_not_grow_with_batch(bcfg):
    """The sharded forward and step, lowered for the kernels (CUDA) at two batch sizes: the same program text
    up to the shapes' digits (no constant grows with b). The backward's sort is pinned to one path at both
    sizes (XLA's sort; the counting-rank sort with its merge pass), and the forward to the plain grid (its
    persistent grid starts at a size too): the defaults pick by size."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="pallas",
                                        kernel_config=tbe_jax.ForwardConfig(persistent_max_values=0),
                                        backward_config=tbe_jax.BackwardConfig(**bcfg))
    emb.uses_kernel = lambda: True  # lower the kernels without a GPU
    sharded = tbe_jax.shard(emb, mesh(auto=True), "data", MIXED)
    sharded.local.uses_kernel = lambda: True
    sharded.local_data.uses_kernel = lambda: True  # the replicated tables' local lookups
    params = jax.eval_shape(sharded.init, jax.random.key(0))
    opt = tbe_jax.Adagrad(0.1)  # element-wise: allowed with the column-wise table
    state = jax.eval_shape(lambda p: opt.init(p), params)
    sizes = []
    for b in (64, 1024):
        idx = jax.ShapeDtypeStruct((N_DEV, 8 * b), jnp.int32)
        off = jax.ShapeDtypeStruct((N_DEV, emb.num_features * b + 1), jnp.int32)

        def step(params, state, idx, off):
            res = tbe_jax.train_step(lambda _, out: jnp.sum(out), None,
                                     tbe_jax.SparseLookup(sharded, opt, params, state, idx, off))
            return res.params, res.opt_state, res.loss

        text = jax.jit(step).trace(params, state, idx, off).lower(lowering_platforms=("cuda",)).as_text()
        sizes.append(len(text))
    assert abs(sizes[1] - sizes[0]) < 0.01 * sizes[0], sizes


def test_narrow_and_unsigned_id_types():
    # int16 ids and uint8 offsets are widened to int32 (exact), as the unsharded embedding does; unsigned
    # 32-bit ids are refused (no -1; the int32 narrowing would wrap them).
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", "row")  # one strategy for every table
    assert set(sharded.plan.strategies) == {"row"}
    assert tbe_jax.shard(emb, mesh(), "data", ["row", "table", "data", "column", "row"]).plan.strategies[3] == "column"
    with pytest.raises(ValueError, match="1 strategies; the embedding has 5 tables"):
        tbe_jax.shard(emb, mesh(), "data", ["row"])
    with pytest.raises(TypeError, match="plan must be"):
        tbe_jax.shard(emb, mesh(), "data", 3)
    params = sharded.init(jax.random.key(0))
    idx, off, _ = local_batches(np.random.default_rng(3), emb, N_DEV, 2, 12)
    want = np.asarray(sharded(params, idx, off))
    np.testing.assert_array_equal(np.asarray(sharded(params, idx.astype(np.int16), off.astype(np.uint8))), want)
    with pytest.raises(TypeError, match="signed integer"):
        sharded(params, np.maximum(idx, 0).astype(np.uint32), off)
