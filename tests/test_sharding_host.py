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
from test_sharding import FMAP, N_DEV, TABLES, assert_tables, global_batch, local_batches, mesh, run_case

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


# -- "host_cached": each owner caches its own pieces ---------------------------------------------------------------
def with_cached(tables, where, host=()):
    return [tbe_jax.TableSpec(t.num_embeddings, t.embedding_dim, name=t.name,
                              location="host_cached" if i in where else "host" if i in host else "device")
            for i, t in enumerate(tables)]


CACHED = with_cached(TABLES, {1, 3}, host={0})  # D 16 and 12 behind caches, table 0 in host memory uncached
CACHED_PLAN = {0: "table", 1: "row", 2: "data", 3: ("table", 1), 4: ("table", N_DEV - 1)}
XLA = "auto" if ON_GPU else "xla"  # on a GPU host tables need the kernels (XLA's ops cannot read host memory)


def train_cached(sharded, emb, opt, steps, seed, *, prefetch="state", ahead=False, b=3, cap=40):
    """`steps` steps of `sharded` (prefetching as told) against `emb` (all tables on the device) on the global
    batch: outputs, tables and states at the end to fp32 rounding (a bag may mix cached and uncached rows; an
    owner sums a row's gradient in the routed batch's order, as every sharded update does: tests/test_sharding.py).
    Returns params, state and the stats of each prefetch."""
    n = sharded.num_devices
    rng = np.random.default_rng(seed)
    ref_params = emb.init(jax.random.key(seed))
    params = sharded.set_tables(None, emb.get_tables(ref_params))
    st, ref_st = sharded.init_opt_state(params, opt), emb.init_opt_state(ref_params, opt)
    batches = [local_batches(rng, emb, n, b, cap) for _ in range(steps + 1)]
    stats = []

    def fetch(p, s, k):
        idx, off, _ = batches[k]
        if prefetch == "state":
            p, s = sharded.prefetch(p, idx, off, opt_state=s)
        else:
            p = sharded.prefetch(p, idx, off)
        stats.append({k: int(v) for k, v in sharded.cache_stats(p).items()})
        return p, s

    if prefetch and ahead:
        params, st = fetch(params, st, 0)
    for k in range(steps):
        if prefetch:
            params, st = fetch(params, st, k + 1 if ahead else k)
        idx, off, w = batches[k]
        gi, go, gw, _ = global_batch(emb, idx, off, w)
        out = np.asarray(sharded(params, idx, off, w))
        np.testing.assert_allclose(out, np.asarray(emb(ref_params, gi, go, gw)), rtol=1e-5, atol=1e-6)
        g = rng.normal(size=out.shape).astype(np.float32)
        params, st = sharded.apply_gradients(params, st, opt, idx, off, g, w)
        ref_params, ref_st = emb.apply_gradients(ref_params, ref_st, opt, gi, go, g, gw)
    assert_tables(sharded.get_tables(params), emb.get_tables(ref_params))
    for name in (f for f in st._fields if f != "count"):
        assert_tables(sharded.get_state(st, name), emb.get_state(ref_st, name))
    return params, st, stats


@multi
@pytest.mark.parametrize("prefetch,ahead", [("state", False), ("state", True), ("params", False), (None, False)],
                         ids=["with-state", "one-ahead", "params-only", "no-prefetch"])
def test_cached_tables_train_as_the_all_device_model(prefetch, ahead):
    """Four steps with caches of 4-8 slots a pool (sets of 4 ways, every miss admitted: evictions of trained rows), every
    way of prefetching: outputs, tables and states the all-device model's (to fp32 rounding, as any sharded
    model's)."""
    kw = dict(feature_table_map=FMAP, impl=XLA)
    sharded = tbe_jax.shard(tbe_jax.TableBatchedEmbedding(CACHED, cache_load_factor=0.05, cache_ways=4,
                                                          cache_admit_age=0, **kw), mesh(), "data", CACHED_PLAN)
    assert sharded.cached and (16, "host_cached") in sharded.layout.pool_keys
    _, _, stats = train_cached(sharded, tbe_jax.TableBatchedEmbedding(TABLES, **kw), tbe_jax.RowwiseAdagrad(0.2),
                               steps=4, seed=31, prefetch=prefetch, ahead=ahead)
    if prefetch:
        assert sum(s["fills"] for s in stats) > 0 and all(s["requested"] >= s["hits"] + s["fills"] for s in stats)
    if prefetch == "state":  # trained rows evicted (without the state a trained row leaves the cache in its step)
        assert sum(s["writebacks"] for s in stats) > 0


@multi
def test_cached_tables_with_kernels_and_a_checkpoint():
    """The Pallas kernels (interpret mode on CPU), element-wise Adagrad (a state row per cached row), then a
    checkpoint: `to_unsharded` merges every cache over its host part, `from_unsharded` starts with empty caches,
    and both give the same lookups."""
    kw = dict(feature_table_map=[0, 1, 2, 3, 1])
    tables = with_cached(TABLES[:4], {1, 3})
    sharded = tbe_jax.shard(tbe_jax.TableBatchedEmbedding(tables, cache_load_factor=0.1, cache_ways=4, **kw,
                                                          **KERNEL_KW),
                            mesh(), "data", {0: "table", 1: "row", 2: "data", 3: "table"})
    params, st, _ = train_cached(sharded, tbe_jax.TableBatchedEmbedding(TABLES[:4], **kw, impl="xla"),
                                 tbe_jax.Adagrad(0.2), steps=2, seed=32, b=2, cap=24)
    emb_params, emb_st = sharded.to_unsharded(params, st)
    p2, s2 = sharded.from_unsharded(emb_params, emb_st)
    assert int(np.asarray(p2["cache"]["row_of_slot"]).max()) == -1  # restored caches are empty
    assert_tables(sharded.get_tables(p2), sharded.get_tables(params), 0)
    assert_tables(sharded.get_momentum(s2), sharded.get_momentum(st), 0)
    rng = np.random.default_rng(8)
    idx, off, w = local_batches(rng, sharded.emb, N_DEV, 2, 24)
    np.testing.assert_allclose(np.asarray(sharded(p2, idx, off, w)), np.asarray(sharded(params, idx, off, w)),
                               rtol=1e-6, atol=1e-6)


def test_cached_tables_on_a_mesh_of_one():
    """One device (the test machine's GPU: pinned host memory, compiled kernels): the routed path with the cache
    (not `emb`'s own step: the caches are per pool), init, prefetch, train_step under jit with donation."""
    kw = dict(feature_table_map=FMAP, **(KERNEL_KW if ON_GPU else dict(impl="xla")))
    emb = tbe_jax.TableBatchedEmbedding(CACHED, cache_load_factor=0.2, cache_ways=4, **kw)
    ref = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    sharded = tbe_jax.shard(emb, mesh(1), "data")
    assert sharded.cached and not sharded.direct
    opt = tbe_jax.RowwiseAdagrad(0.1)
    params = sharded.init(jax.random.key(2))
    state = sharded.init_opt_state(params, opt)
    check = sharded.host_keys()
    assert check and all(memory.on_host(params[k]) == memory.host_memory() for k in check)
    rparams = ref.set_tables(None, sharded.get_tables(params))
    rstate = ref.init_opt_state(rparams, opt)
    rng = np.random.default_rng(9)
    batches = [local_batches(rng, emb, 1, 4, 50) for _ in range(3)]
    dense = jnp.ones((sum(emb.feature_dims),), jnp.float32)

    def loss_fn(dense, out):
        return jnp.sum(out * dense) + 0.5 * jnp.sum(out * out)

    @jax.jit
    def step(params, state, idx, off, w, nidx, noff):
        params, state = sharded.prefetch(params, nidx, noff, opt_state=state)
        res = tbe_jax.train_step(loss_fn, dense, tbe_jax.SparseLookup(sharded, opt, params, state, idx, off, w))
        return res.params, res.opt_state

    params, state = sharded.prefetch(params, batches[0][0], batches[0][1], opt_state=state)
    for k in range(2):
        idx, off, w = batches[k]
        params, state = step(params, state, idx, off, w, batches[k + 1][0], batches[k + 1][1])
        res = tbe_jax.train_step(loss_fn, dense, tbe_jax.SparseLookup(ref, opt, rparams, rstate, idx[0], off[0], w[0]))
        rparams, rstate = res.params, res.opt_state
    stats = sharded.cache_stats(params)
    assert int(stats["lookups"]) > 0 and int(stats["requested"]) > 0  # the last prefetch counted its batch
    assert_tables(sharded.get_tables(params), ref.get_tables(rparams))  # the routed batch's order of sums
    assert_tables(sharded.get_momentum(state), ref.get_momentum(rstate))
    assert all(memory.on_host(params[k]) == memory.host_memory() for k in check)


@multi
def test_nnx_layer_on_a_mesh_prefetches_and_trains_as_the_all_device_one():
    """The NNX layer built with a mesh over "host_cached" tables: `layer.prefetch` inside `nnx.jit` (and once
    eagerly), then its sparse `train_step`, against the all-device layer on the global batch."""
    nnx = pytest.importorskip("flax.nnx")
    from tbe_jax.nnx import TableBatchedEmbed
    from tbe_jax.nnx import train_step as nnx_step

    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.2)
    kw = dict(feature_table_map=FMAP, impl=XLA, optimizer=opt)
    layer = TableBatchedEmbed(CACHED, cache_load_factor=0.2, cache_ways=4, mesh=mesh(), sharding_plan=CACHED_PLAN,
                              rngs=nnx.Rngs(0), **kw)
    ref = TableBatchedEmbed(TABLES, rngs=nnx.Rngs(0), **kw)
    ref.set_params(ref.tbe.set_tables(None, layer.tbe.get_tables(layer.get_params())))

    def loss(m, i, o):
        return jnp.sum(jnp.tanh(m(i, o)))

    @nnx.jit
    def step(m, idx, off):
        m.prefetch(idx, off)  # inside the jitted step, before the lookup
        return nnx_step(loss, m, idx, off)[0]

    rng = np.random.default_rng(13)
    for k in range(3):
        idx, off, _ = local_batches(rng, layer.tbe.emb, N_DEV, 3, 40)
        gi, go, _, _ = global_batch(layer.tbe.emb, idx, off, None)
        if k == 1:  # and eagerly, outside a jitted function
            layer.prefetch(idx, off)
        step(layer, idx, off)
        nnx_step(loss, ref, gi, go)
    assert int(layer.tbe.cache_stats(layer.get_params())["requested"]) > 0
    assert_tables(layer.tbe.get_tables(layer.get_params()), ref.tbe.get_tables(ref.get_params()), 1e-5)
    assert_tables(layer.tbe.get_momentum(layer.get_opt_state()), ref.tbe.get_momentum(ref.get_opt_state()), 1e-5)
    plain = TableBatchedEmbed(TABLES, mesh=mesh(), rngs=nnx.Rngs(0), **kw)
    with pytest.raises(TypeError, match="host_cached"):
        plain.prefetch(idx, off)


@pytest.mark.parametrize("n,block", [(1, 64), pytest.param(N_DEV, None, marks=multi),
                                     pytest.param(N_DEV, 64, marks=multi)], ids=["one-blocks", "one-draw", "blocks"])
def test_host_buffers_init_on_the_host_as_on_the_device(n, block, monkeypatch):
    """`init` fills large host buffers (here: all) block by block without passing them through HBM
    (`_write_pool_block`), with the values the device draw gives (`init` under a trace draws every pool on its
    device: the reference), also with several blocks per pool (`tbe.INIT_BLOCK` elements: 4-8 rows a block). On a
    mesh of one too (one GPU: the block writer compiled, into pinned host memory)."""
    from tbe_jax import shard_programs
    from tbe_jax import tbe as tbe_module

    if block:
        monkeypatch.setattr(tbe_module, "INIT_BLOCK", block)
    monkeypatch.setattr(shard_programs, "HOST_INIT_ON_DEVICE_BYTES", 0)  # every host buffer made on the host
    emb = tbe_jax.TableBatchedEmbedding(CACHED, feature_table_map=FMAP, cache_ways=4,
                                        **(KERNEL_KW if ON_GPU else dict(impl="xla")))
    sharded = tbe_jax.shard(emb, mesh(n), "data", CACHED_PLAN if n > 1 else None)
    params = sharded.init(jax.random.key(5))
    on_device = jax.jit(lambda k: shard_programs.sharded_init(sharded, k, tbe_module.INIT_BLOCK))(jax.random.key(5))
    assert set(params) == set(on_device) and sharded.host_keys() <= set(params)
    assert all(memory.on_host(params[k]) == memory.host_memory() for k in sharded.host_keys())
    for k in sharded.host_keys() | {"d8"}:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(on_device[k]), err_msg=k)
    for spec, tab in zip(CACHED, sharded.get_tables(params)):
        bound = 1 / np.sqrt(spec.num_embeddings)
        assert np.abs(np.asarray(tab)).max() <= bound and np.unique(np.asarray(tab)).size > tab.size // 2


@multi
def test_opt_state_of_host_buffers_under_jit():
    """`init_opt_state` inside `jit` with the optimizer an argument (its hyperparameters traced, as the demo's jitted
    init passes it): the host buffers' states are made in the program, equal to the eager ones."""
    emb = tbe_jax.TableBatchedEmbedding(CACHED, feature_table_map=FMAP, cache_ways=4, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", CACHED_PLAN)
    params = sharded.init(jax.random.key(1))
    opt = tbe_jax.Adagrad(0.1, initial_accumulator_value=0.25)
    got = jax.jit(sharded.init_opt_state)(params, opt)
    want = sharded.init_opt_state(params, opt)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(np.asarray(sharded.get_momentum(got)[1]).min()) == 0.25
