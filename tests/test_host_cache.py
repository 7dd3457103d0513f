"""Tables in host memory (`location="host"`) and behind an HBM cache (`location="host_cached"`, issue 40).

Every check is against the all-device model: the same tables with `location="device"`, given the same tables,
batches and output gradients. Tables and optimizer states must be bitwise equal after every step, whatever was
prefetched (the cache changes speed only); pooled outputs equal to fp32 rounding (a bag mixing cached and
uncached rows is summed in two parts). On a CPU the host buffers are ordinary arrays (`tbe_jax.memory`); the
kernels run in interpret mode where `impl` says "pallas".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import host_cache, memory

ON_GPU = jax.default_backend() == "gpu"
XLA = "auto" if ON_GPU else "xla"  # on a GPU host tables need the kernels (XLA's ops cannot read host memory)
ROWS = (50, 30, 40, 64)
DIMS = (8, 4, 8, 12)
LOCS = ("host_cached", "device", "host", "host_cached")
FMAP = (0, 1, 2, 0, 3)


def _specs(locations=LOCS):
    return [tbe_jax.TableSpec(e, d, name=f"t{i}", location=loc)
            for i, (e, d, loc) in enumerate(zip(ROWS, DIMS, locations))]


def _pair(impl=XLA, pooling="sum", policy="lru", load_factor=0.3, ways=4, **kw):
    """(the embedding under test, the all-device one)."""
    common = dict(feature_table_map=FMAP, impl=impl, interpret=impl == "pallas" and not ON_GPU, pooling=pooling, **kw)
    emb = tbe_jax.TableBatchedEmbedding(_specs(), cache_load_factor=load_factor, cache_policy=policy,
                                        cache_ways=ways, **common)
    ref = tbe_jax.TableBatchedEmbedding(_specs(("device",) * 4), **common)
    return emb, ref


def _batch(rng, b=5, max_len=5, weighted=False, pad=3, hot=None):
    """A random batch (feature-major offsets, `pad` padding ids past the bags, then -1s up to one length for
    every batch of these `b` and `max_len`, so that eager calls reuse their compiled programs); `hot` draws ids
    from the first `hot` rows of each table."""
    lens = rng.integers(0, max_len, len(FMAP) * b)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = []
    for f, t in enumerate(FMAP):
        hi = ROWS[t] if hot is None else min(hot, ROWS[t])
        ids.append(rng.integers(0, hi, lens[f * b:(f + 1) * b].sum()))
    n = len(FMAP) * b * (max_len - 1) + pad
    ids = np.concatenate(ids + [rng.integers(0, 3, pad), np.full(n - pad - off[-1], -1)]).astype(np.int32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, ids.shape[0]).astype(np.float32)) if weighted else None
    return jnp.asarray(ids), jnp.asarray(off), w


def _same(emb, ref, params, rparams, state=None, rstate=None):
    for t, (a, b) in enumerate(zip(emb.get_tables(params), ref.get_tables(rparams))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"table {t}")
    if state is not None:
        name = state._fields[0]
        for t, (a, b) in enumerate(zip(emb.get_state(state, name), ref.get_state(rstate, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"state of table {t}")


def _train(emb, ref, opt, steps, *, prefetch="state", seed=0, weighted=False, ahead=False, hot=None):
    """`steps` optimizer steps on both; `prefetch`: "state" (with the optimizer state), "params" (without) or
    None; `ahead`: prefetch batch k+1 before step k. Returns the last params and the cache stats seen."""
    rng = np.random.default_rng(seed)
    params = emb.init(jax.random.key(seed))
    rparams = ref.set_tables(None, emb.get_tables(params))
    state, rstate = emb.init_opt_state(params, opt), ref.init_opt_state(rparams, opt)
    batches = [_batch(rng, weighted=weighted, hot=hot) for _ in range(steps + 1)]

    def fetch(p, s, k):
        if prefetch == "state":
            return emb.prefetch(p, batches[k][0], batches[k][1], opt_state=s)
        if prefetch == "params":
            return emb.prefetch(p, batches[k][0], batches[k][1]), s
        return p, s

    stats = []
    if ahead:
        params, state = fetch(params, state, 0)
    for k in range(steps):
        params, state = fetch(params, state, k + 1 if ahead else k)
        stats.append([int(v) for v in emb.cache_stats(params).values()])
        idx, off, w = batches[k]
        out, rout = emb(params, idx, off, w), ref(rparams, idx, off, w)
        np.testing.assert_allclose(np.asarray(out), np.asarray(rout), rtol=1e-6, atol=1e-6)
        g = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32))
        params, state = emb.apply_gradients(params, state, opt, idx, off, g, w)
        rparams, rstate = ref.apply_gradients(rparams, rstate, opt, idx, off, g, w)
        _same(emb, ref, params, rparams, state if len(state._fields) > 1 else None, rstate)
    return params, stats


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("prefetch", ["state", "params", None])
def test_training_matches_the_all_device_model(policy, prefetch):
    emb, ref = _pair(policy=policy)
    _, stats = _train(emb, ref, tbe_jax.RowwiseAdagrad(learning_rate=0.1), 6, prefetch=prefetch, hot=20)
    fills = sum(s[2] for s in stats)
    assert (fills > 0) == (prefetch is not None)


def test_evictions_write_back_changed_rows_and_states():
    # a cache of one 4-way set per table, batches over 20 rows: every prefetch evicts rows trained before
    emb, ref = _pair(load_factor=0.01)
    _, stats = _train(emb, ref, tbe_jax.Adam(learning_rate=0.05), 8, hot=20)
    assert sum(s[3] for s in stats) > 0  # rows written back to host memory
    assert all(s[2] <= 2 * 4 for s in stats)  # at most the two cached tables' 4 slots each


def test_fills_capped_per_prefetch():
    # cache_max_fills=3: at most 3 rows filled per prefetch (the rest read from host memory), the same training
    emb, ref = _pair(load_factor=0.5, cache_max_fills=3)
    _, stats = _train(emb, ref, tbe_jax.RowwiseAdagrad(learning_rate=0.1), 4, hot=25)
    assert all(s[2] <= 3 for s in stats) and sum(s[2] for s in stats) > 0
    assert all(s[0] > 3 for s in stats)  # more distinct rows requested than the cap
    with pytest.raises(ValueError, match="cache_max_fills"):
        _pair(cache_max_fills=0)


def test_fill_cap_serves_every_table():
    # Over the fill cap, which misses get a slot rotates from one prefetch to the next (rows looked up more
    # than once first): the cap once cut the same end of the row order every time, and the last tables of a
    # model were never cached at all.
    specs = [tbe_jax.TableSpec(400, 4, location="host_cached") for _ in range(4)]
    emb = tbe_jax.TableBatchedEmbedding(specs, impl=XLA, cache_load_factor=0.25, cache_ways=4, cache_max_fills=40)
    params = emb.init(jax.random.key(0))
    rng = np.random.default_rng(3)
    for _ in range(6):  # 64 distinct-ish rows a table a batch: over 200 misses against the cap of 40
        idx = jnp.asarray(rng.integers(0, 400, 4 * 64).astype(np.int32))
        params = emb.prefetch(params, idx, jnp.arange(0, 4 * 64 + 1, 8, dtype=jnp.int32))
        assert int(emb.cache_stats(params)["fills"]) <= 40
    cached = np.asarray(params["cache"]["slot_of_row"]) >= 0
    assert all(cached[t * 400:(t + 1) * 400].sum() > 0 for t in range(4)), cached.reshape(4, 400).sum(axis=1)


@pytest.mark.parametrize("age,want", [(32, [4, 0, 0, 2]), (1, [4, 0, 4, 0]), (0, [4, 0, 4, 0])])
def test_one_off_rows_do_not_evict_live_rows(age, want):
    # One set of 4 ways. Prefetches: 4 rows looked up twice (fill the set), a one-off row (the set is the previous
    # prefetch's: locked), 4 one-off rows, 2 rows looked up twice. The one-off rows take the live rows' slots only
    # if those were unused for `cache_admit_age` prefetches; rows looked up twice always may (once unlocked).
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(64, 4, location="host_cached")], impl=XLA,
                                        cache_load_factor=4 / 64, cache_ways=4, cache_admit_age=age)
    params = emb.init(jax.random.key(0))
    fills = []
    for rows in ([1, 1, 2, 2, 3, 3, 4, 4], [20], [10, 11, 12, 13], [30, 30, 31, 31]):
        params = emb.prefetch(params, jnp.asarray(rows, jnp.int32), jnp.asarray([0, len(rows)], jnp.int32))
        fills.append(int(emb.cache_stats(params)["fills"]))
    assert fills == want
    with pytest.raises(ValueError, match="cache_admit_age"):
        tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(64, 4, location="host_cached")], cache_admit_age=-1)


def test_stats_count_the_lookups_left_to_host_memory():
    # `host_lookups`: the batch's lookups whose row is in neither the cache before the prefetch nor its fills,
    # checked against the directory after the prefetch (Zipf-like ids over a cache far smaller than them).
    specs = [tbe_jax.TableSpec(300, 4, location="host_cached"), tbe_jax.TableSpec(50, 4),
             tbe_jax.TableSpec(200, 4, location="host_cached")]
    emb = tbe_jax.TableBatchedEmbedding(specs, impl=XLA, cache_load_factor=0.1, cache_ways=4, cache_max_fills=12)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    rng = np.random.default_rng(5)
    base = {0: 0, 2: 300}  # each cached table's first row in the directory's row space
    for _ in range(4):
        ids = [np.minimum(rng.zipf(1.3, 60) - 1, e - 1) for e in (300, 50, 200)]
        offsets = jnp.asarray(np.arange(0, 181, 6), jnp.int32)  # 10 bags of 6 per table
        params, state = emb.prefetch(params, jnp.asarray(np.concatenate(ids).astype(np.int32)), offsets,
                                     opt_state=state)
        st = {k: int(v) for k, v in emb.cache_stats(params).items()}
        slot_of_row = np.asarray(params["cache"]["slot_of_row"])
        left = sum(int((slot_of_row[base[t] + ids[t]] < 0).sum()) for t in (0, 2))
        assert st["lookups"] == 120 and st["host_lookups"] == left
        assert 0 < st["host_lookups"] <= st["lookups"] - st["lookup_hits"]


def test_fill_order_puts_repeated_rows_first_and_rotates():
    from tbe_jax.cache_prefetch import fill_order

    miss = jnp.asarray([1, 0, 1, 1, 1, 0, 1, 1], bool)
    uses = jnp.asarray([1, 5, 2, 1, 3, 1, 1, 1], jnp.int32)
    seen = set()
    for tick in range(6):
        place, count = fill_order(miss, uses, jnp.int32(tick))
        place = np.asarray(place)
        assert int(count) == 6 and sorted(place[np.asarray(miss)]) == list(range(6))
        assert set(place[[2, 4]]) == {0, 1}  # the two misses looked up more than once come first
        assert all(place[~np.asarray(miss)] == 8)
        seen.add(int(np.argmin(np.where(place >= 2, place, 99))))  # the first of the rest this time
    assert len(seen) > 1  # the rest's start rotates with the tick


def test_prefetch_one_batch_ahead():
    emb, ref = _pair(load_factor=0.5)
    _, stats = _train(emb, ref, tbe_jax.RowwiseAdagrad(learning_rate=0.1), 5, ahead=True, hot=25)
    assert sum(s[1] for s in stats) > 0  # later batches hit rows prefetched for earlier ones


@pytest.mark.parametrize("pooling,weighted", [("mean", False), ("sum", True)])
def test_pooling_and_weights(pooling, weighted):
    emb, ref = _pair(pooling=pooling)
    _train(emb, ref, tbe_jax.SGD(learning_rate=0.1), 3, weighted=weighted)


def test_kernels_in_interpret_mode():
    emb, ref = _pair(impl="pallas", load_factor=0.1, cache_admit_age=0)  # any miss may evict: write-backs
    _, stats = _train(emb, ref, tbe_jax.RowwiseAdagrad(learning_rate=0.1), 3, hot=20)
    assert sum(s[3] for s in stats) > 0  # the copy kernels' write-backs ran (in host row order)


def test_train_step_and_sequence_pooling():
    emb = tbe_jax.TableBatchedEmbedding([dataclasses.replace(s, embedding_dim=8) for s in _specs()],
                                        feature_table_map=FMAP, pooling="none", impl=XLA, cache_load_factor=0.5,
                                        cache_ways=4)
    ref = tbe_jax.TableBatchedEmbedding([dataclasses.replace(s, location="device") for s in emb.tables],
                                        feature_table_map=FMAP, pooling="none", impl=XLA)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    rng = np.random.default_rng(3)
    params = emb.init(jax.random.key(1))
    rparams = ref.set_tables(None, emb.get_tables(params))
    state, rstate = emb.init_opt_state(params, opt), ref.init_opt_state(rparams, opt)

    @functools.partial(jax.jit, static_argnums=0)
    def step(e, p, s, idx, off):
        res = tbe_jax.train_step(lambda _, out: jnp.sum(jnp.sin(out)), None,
                                 tbe_jax.SparseLookup(e, opt, p, s, idx, off))
        return res.params, res.opt_state, res.outputs

    for k in range(3):
        idx, off, _ = _batch(rng, hot=20)
        params, state = emb.prefetch(params, idx, off, opt_state=state)
        params, state, out = step(emb, params, state, idx, off)
        rparams, rstate, rout = step(ref, rparams, rstate, idx, off)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(rout))
        _same(emb, ref, params, rparams, state, rstate)


def test_variable_batch_sizes():
    emb, ref = _pair(load_factor=0.5)
    rng = np.random.default_rng(5)
    sizes = (3, 1, 4, 2, 5)
    lens = rng.integers(0, 4, sum(sizes))
    off = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    base = np.concatenate([[0], np.cumsum(sizes)])
    idx = jnp.asarray(np.concatenate([rng.integers(0, ROWS[t], lens[base[f]:base[f + 1]].sum())
                                      for f, t in enumerate(FMAP)]).astype(np.int32))
    params = emb.init(jax.random.key(2))
    rparams = ref.set_tables(None, emb.get_tables(params))
    params = emb.prefetch(params, idx, off, batch_size_per_feature=sizes)
    out = emb(params, idx, off, batch_size_per_feature=sizes)
    rout = ref(rparams, idx, off, batch_size_per_feature=sizes)
    np.testing.assert_allclose(np.asarray(out), np.asarray(rout), rtol=1e-6, atol=1e-6)
    opt = tbe_jax.SGD(learning_rate=0.5)
    g = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32))
    params, _ = emb.apply_gradients(params, emb.init_opt_state(params, opt), opt, idx, off, g,
                                    batch_size_per_feature=sizes)
    rparams, _ = ref.apply_gradients(rparams, ref.init_opt_state(rparams, opt), opt, idx, off, g,
                                     batch_size_per_feature=sizes)
    _same(emb, ref, params, rparams)


def test_layout_and_directory():
    emb, _ = _pair(load_factor=0.3, ways=4)
    assert isinstance(emb, host_cache.HostCachedEmbedding) and isinstance(emb, tbe_jax.TableBatchedEmbedding)
    cl = emb.cache_layout
    assert cl.tables == (0, 3) and cl.slots == (16, 20)  # 0.3 * 50 -> 15 -> 4 sets; 0.3 * 64 -> 20 -> 5 sets
    keys = sorted(emb.init(jax.random.key(0)))
    assert keys == ["cache", "d12", "d12_host", "d4", "d8", "d8_host"]
    assert hash(emb) != hash(_pair(load_factor=0.5)[0]) and emb == _pair(load_factor=0.3, ways=4)[0]
    # an unprefetched batch is served from host memory: no slot filled, the same result
    params = emb.init(jax.random.key(0))
    assert int(jnp.max(params["cache"]["slot_of_row"])) == -1


def test_host_location_without_cache():
    specs = [tbe_jax.TableSpec(40, 8, location="host"), tbe_jax.TableSpec(30, 8)]
    emb = tbe_jax.TableBatchedEmbedding(specs, impl="pallas", interpret=not ON_GPU)
    assert type(emb) is tbe_jax.TableBatchedEmbedding
    assert [emb.layout.key(g) for g in range(2)] == ["d8_host", "d8"]
    ref = tbe_jax.TableBatchedEmbedding([dataclasses.replace(s, location="device") for s in specs], impl="pallas",
                                        interpret=not ON_GPU)
    params = emb.init(jax.random.key(0))
    rparams = ref.set_tables(None, emb.get_tables(params))
    idx = jnp.asarray([1, 5, 39, 0, 29, 7], jnp.int32)
    off = jnp.asarray([0, 2, 3, 5, 6], jnp.int32)
    np.testing.assert_array_equal(np.asarray(emb(params, idx, off)), np.asarray(ref(rparams, idx, off)))
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    g = jnp.ones((2, 16), jnp.float32)
    p, s = emb.apply_gradients(params, emb.init_opt_state(params, opt), opt, idx, off, g)
    rp, rs = ref.apply_gradients(rparams, ref.init_opt_state(rparams, opt), opt, idx, off, g)
    _same(emb, ref, p, rp, s, rs)


def test_bad_cache_options_are_refused():
    with pytest.raises(ValueError, match="cache_load_factor"):
        tbe_jax.TableBatchedEmbedding(_specs(), cache_load_factor=0)
    with pytest.raises(ValueError, match="cache_policy"):
        tbe_jax.TableBatchedEmbedding(_specs(), cache_policy="fifo")
    with pytest.raises(ValueError, match="location"):
        tbe_jax.TableSpec(10, 4, location="disk")
    emb, _ = _pair()
    with pytest.raises(TypeError, match="mesh"):  # sharding is tested in tests/test_sharding_host.py
        emb.shard(None)
    params = emb.init(jax.random.key(0))
    with pytest.raises(ValueError, match="cache"):
        emb.check_params({k: v for k, v in params.items() if k != "cache"} | {"cache": {}})


def test_checkpoint_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    emb, ref = _pair(load_factor=0.5)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    rng = np.random.default_rng(7)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    idx, off, _ = _batch(rng, hot=20)
    params, state = emb.prefetch(params, idx, off, opt_state=state)
    g = jnp.ones(emb(params, idx, off).shape, jnp.float32)
    params, state = emb.apply_gradients(params, state, opt, idx, off, g)
    # closed on leaving (an open checkpointer keeps threads that outlive the test)
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "c", {"p": params, "s": state})
        ck.wait_until_finished()
        back = ck.restore(tmp_path / "c", jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"p": params, "s": state}))
    for a, b in zip(emb.get_tables(back["p"]), emb.get_tables(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(emb.get_momentum(back["s"]), emb.get_momentum(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not ON_GPU, reason="pinned host memory is a GPU backend's (on a CPU the host buffers are plain)")
def test_host_buffers_stay_in_pinned_host_memory_under_jit():
    emb, _ = _pair(load_factor=0.5)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    host = {k for k in params if k.endswith("_host")}
    assert host and all(params[k].sharding.memory_kind == "pinned_host" for k in host)
    assert all(state.momentum[k].sharding.memory_kind == "pinned_host" for k in host)
    rng = np.random.default_rng(0)
    idx, off, _ = _batch(rng, hot=20)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, g):
        p, s = emb.prefetch(p, idx, off, opt_state=s)
        return emb.apply_gradients(p, s, opt, idx, off, g)

    g = jnp.ones(emb(params, idx, off).shape, jnp.float32)
    params, state = step(params, state, g)
    kinds = {k: params[k].sharding.memory_kind for k in host}
    assert all(v == "pinned_host" for v in kinds.values()), kinds
    assert all(state.momentum[k].sharding.memory_kind == "pinned_host" for k in host)
    # reading the tables and states back leaves the buffers donatable (a NumPy view of a pinned host array,
    # which jaxlib keeps on the array, would make the next donation fail)
    emb.get_tables(params), emb.get_momentum(state)
    params, state = step(params, state, g)
    params, state = emb.prefetch(params, idx, off, opt_state=state)  # the eager prefetch donates too


def test_plan_locations_moves_the_coldest_bytes_first():
    specs = [tbe_jax.TableSpec(1000, 16, name="hot"), tbe_jax.TableSpec(100_000, 16, name="big"),
             tbe_jax.TableSpec(50_000, 16, name="mid"), tbe_jax.TableSpec(10, 16, name="tiny")]
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    row = 16 * 2 + 4
    dev = [s.num_embeddings * row for s in specs]
    got = tbe_jax.plan_locations(specs, sum(dev), weights_dtype="float16", optimizer=opt)
    assert [s.location for s in got] == ["device"] * 4  # everything fits
    got = tbe_jax.plan_locations(specs, sum(dev) - 1, weights_dtype="float16", optimizer=opt)
    assert [s.location for s in got] == ["device", "host_cached", "device", "device"]  # the largest goes first
    # lookups make "mid" the coldest per byte: it goes before "big"
    got = tbe_jax.plan_locations(specs, sum(dev) - 1, weights_dtype="float16", optimizer=opt,
                                 lookups=[10, 100, 1, 1])
    assert [s.location for s in got] == ["device", "device", "host_cached", "device"]
    got = tbe_jax.plan_locations(specs, 0, weights_dtype="float16", optimizer=opt)
    assert [s.location for s in got] == ["host"] * 4
    budget = 400_000
    got = tbe_jax.plan_locations(specs, budget, weights_dtype="float16", optimizer=opt)
    used = sum(tbe_jax.placement.hbm_bytes(s, s.location, itemsize=2, optimizer=opt) for s in got)
    assert used <= budget and "host_cached" in [s.location for s in got]
    emb = tbe_jax.TableBatchedEmbedding(got, weights_dtype=jnp.float16, impl=XLA)  # a model built from the plan
    assert emb.init(jax.random.key(0))["cache"]["slot_of_row"].shape[0] > 0
    # a host budget: the plan's host bytes (every row and state of the tables off the device) must fit it
    host = sum(tbe_jax.placement.host_bytes(s, s.location, itemsize=2, optimizer=opt) for s in got)
    assert host == sum(d for d, s in zip(dev, got) if s.location != "device")
    assert tbe_jax.plan_locations(specs, budget, weights_dtype="float16", optimizer=opt, host_budget=host) == got
    with pytest.raises(ValueError, match="host budget"):
        tbe_jax.plan_locations(specs, budget, weights_dtype="float16", optimizer=opt, host_budget=host - 1)


def test_linen_layer_with_host_tables_trains_as_the_all_device_one():
    nn = pytest.importorskip("flax.linen")
    from tbe_jax.linen import FUSED_COLLECTION, TableBatchedEmbed
    from tbe_jax.linen import train_step as linen_step

    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.2)

    def model(specs):
        class M(nn.Module):
            @nn.compact
            def __call__(self, idx, off):
                return TableBatchedEmbed(specs, feature_table_map=FMAP, impl=XLA, optimizer=opt,
                                         cache_load_factor=0.5, cache_ways=4, name="embed")(idx, off)
        return M()

    m, r = model(_specs()), model(_specs(("device",) * 4))
    rng = np.random.default_rng(11)
    idx, off, _ = _batch(rng, hot=20)
    v = m.init(jax.random.key(0), idx, off)
    core, rcore = TableBatchedEmbed(_specs(), feature_table_map=FMAP, impl=XLA, cache_load_factor=0.5,
                                    cache_ways=4).tbe, TableBatchedEmbed(_specs(("device",) * 4),
                                                                         feature_table_map=FMAP, impl=XLA).tbe
    rv = r.init(jax.random.key(0), idx, off)
    rv[FUSED_COLLECTION]["embed"]["embedding"] = rcore.set_tables(
        None, core.get_tables(v[FUSED_COLLECTION]["embed"]["embedding"]))
    # the layer's tables prefetched through its core (with the state): then trained by the helper
    fused = v[FUSED_COLLECTION]["embed"]
    fused["embedding"], fused["opt_state"] = core.prefetch(fused["embedding"], idx, off, opt_state=fused["opt_state"])
    for vv, mm in ((v, m), (rv, r)):
        res = linen_step(lambda var, i, o, mm=mm: jnp.sum(jnp.tanh(mm.apply(var, i, o))), vv, idx, off)
        vv.update(res.variables)
    for a, b in zip(core.get_tables(v[FUSED_COLLECTION]["embed"]["embedding"]),
                    rcore.get_tables(rv[FUSED_COLLECTION]["embed"]["embedding"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_many_features_of_cached_tables():
    # 70 features reading cached tables: the sorted search that places the second block's positions
    specs = [tbe_jax.TableSpec(40, 4, location="host_cached"), tbe_jax.TableSpec(30, 4)]
    fmap = [i % 2 for i in range(140)]
    emb = tbe_jax.TableBatchedEmbedding(specs, feature_table_map=fmap, impl=XLA, cache_load_factor=0.5,
                                        cache_ways=4)
    ref = tbe_jax.TableBatchedEmbedding([dataclasses.replace(s, location="device") for s in specs],
                                        feature_table_map=fmap, impl=XLA)
    rng = np.random.default_rng(2)
    lens = rng.integers(0, 3, 140 * 2)
    off = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    idx = jnp.asarray(rng.integers(0, 30, int(lens.sum())).astype(np.int32))
    params = emb.init(jax.random.key(0))
    rparams = ref.set_tables(None, emb.get_tables(params))
    params = emb.prefetch(params, idx, off)
    np.testing.assert_allclose(np.asarray(emb(params, idx, off)), np.asarray(ref(rparams, idx, off)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("width", [None, 5, 16])
def test_copy_rows_kernel(width, programs):
    # the kernel against the XLA copy: skipped pairs (a negative id on either side), rows of any width, and the
    # `after` operands taking no part in the result; with `programs`, a grid of 3 looping over the blocks (8 of
    # them at width 16, 1 at width None: one program per block then)
    rng = np.random.default_rng(width or 0)
    shape = lambda r: (r,) if width is None else (r, width)  # noqa: E731
    dst = jnp.asarray(rng.standard_normal(shape(40)).astype(np.float32))
    src = jnp.asarray(rng.standard_normal(shape(30)).astype(np.float32))
    dst_rows = rng.permutation(40)[:300 // 10].astype(np.int32)
    src_rows = rng.integers(0, 30, dst_rows.shape[0]).astype(np.int32)
    dst_rows[::7], src_rows[3::5] = -1, -1
    want = np.asarray(dst).copy()
    ok = (dst_rows >= 0) & (src_rows >= 0)
    want[dst_rows[ok]] = np.asarray(src)[src_rows[ok]]
    from tbe_jax.kernels.copy_rows import copy_rows, gather_rows
    for kernel in (False, True):
        got = copy_rows(dst, src, jnp.asarray(dst_rows), jnp.asarray(src_rows), kernel=kernel,
                        interpret=kernel and not ON_GPU, block_elems=64, after=(src * 2, jnp.ones(3)),
                        programs=programs)
        np.testing.assert_array_equal(np.asarray(got), want)
        staged = gather_rows(src, jnp.asarray(src_rows), kernel=kernel, interpret=kernel and not ON_GPU,
                             block_elems=64, programs=programs)
        np.testing.assert_array_equal(np.asarray(staged)[src_rows >= 0], np.asarray(src)[src_rows[src_rows >= 0]])


def test_copy_rows_programs_must_be_positive():
    from tbe_jax.kernels.copy_rows import copy_rows

    x = jnp.zeros((4, 2), jnp.float32)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="programs must be None or a positive int"):
            copy_rows(x, x, jnp.arange(4), jnp.arange(4), kernel=True, interpret=not ON_GPU, programs=bad)


def test_gather_and_copy_rows_kernels_on_many_arrays():
    # A table's rows and states (three arrays of different widths and dtypes) moved with one set of row ids, as
    # a prefetch does: the stage (`gather_rows`: its skipped rows are unspecified, not compared), the fill and
    # the write-back, against NumPy, with the kernels and without; more pairs than one block holds.
    from tbe_jax.kernels.copy_rows import copy_rows, gather_rows

    rng = np.random.default_rng(7)
    c_n, h_n, m = 50, 120, 37
    kinds = (((9,), np.float16), ((), np.float32), ((3,), np.int32))
    draw = lambda r, s, dt: (rng.standard_normal((r,) + s) * 50).astype(dt)  # noqa: E731
    cache = tuple(draw(c_n, s, dt) for s, dt in kinds)
    host = tuple(draw(h_n, s, dt) for s, dt in kinds)
    fill_src = np.sort(rng.permutation(h_n)[:m]).astype(np.int32)  # misses, in row order
    fill_dst = rng.permutation(c_n)[:m].astype(np.int32)
    wb_dst = np.sort(rng.permutation(h_n)[:m]).astype(np.int32)
    stage_src = rng.integers(0, c_n, m).astype(np.int32)
    fill_src[::5], wb_dst[2::6], stage_src[::4] = -1, -1, -1
    wb_dst[::4] = -1  # a stage row that was not staged is not written back
    stage_np = tuple(a[np.maximum(stage_src, 0)] for a in cache)
    want_c, want_h = tuple(a.copy() for a in cache), tuple(a.copy() for a in host)
    live, wlive = fill_src >= 0, wb_dst >= 0
    for wc, wh, h, st in zip(want_c, want_h, host, stage_np):
        wc[fill_dst[live]] = h[fill_src[live]]
        wh[wb_dst[wlive]] = st[wlive]
    j = lambda t: tuple(jnp.asarray(a) for a in t)  # noqa: E731
    for kernel in (False, True):
        kw = dict(kernel=kernel, interpret=kernel and not ON_GPU, block_elems=64)
        stage = gather_rows(j(cache), jnp.asarray(stage_src), **kw)
        for got, want in zip(stage, stage_np):
            np.testing.assert_array_equal(np.asarray(got)[stage_src >= 0], want[stage_src >= 0])
        c = copy_rows(j(cache), j(host), jnp.asarray(fill_dst), jnp.asarray(fill_src), after=stage, **kw)
        h = copy_rows(j(host), stage, jnp.asarray(wb_dst), jnp.arange(m, dtype=jnp.int32), after=c, **kw)
        assert isinstance(c, tuple) and isinstance(h, tuple)
        for got, want in zip(c + h, want_c + want_h):
            np.testing.assert_array_equal(np.asarray(got), want)
        one = gather_rows(jnp.asarray(cache[1]), jnp.asarray(stage_src), **kw)  # one array in, one out
        np.testing.assert_array_equal(np.asarray(one)[stage_src >= 0], stage_np[1][stage_src >= 0])


@pytest.mark.parametrize("opt", [tbe_jax.Adagrad(learning_rate=0.1, initial_accumulator_value=0.25),
                                 tbe_jax.RowwiseAdagrad(learning_rate=0.1, initial_accumulator_value=0.5)])
def test_host_buffers_init_in_place_like_device_ones(monkeypatch, opt):
    # A host buffer larger than one init block is made in host memory and drawn block by block into place
    # (`memory.host_blocks`: it may not fit the GPU), with the device buffer's values; its optimizer state is made
    # in host memory too, with the optimizer's start value.
    from tbe_jax import tbe as tbe_module

    monkeypatch.setattr(tbe_module, "INIT_BLOCK", 64)  # the d8 buffers (90 rows): blocks of 8 rows, 12 of them
    written = []
    monkeypatch.setattr(memory, "write_rows", lambda buf, vals, r0, f=memory.write_rows: written.append(int(r0))
                        or f(buf, vals, r0))
    locs = ("host", "host", "device")
    specs = [tbe_jax.TableSpec(e, d, location=loc) for e, d, loc in zip((50, 40, 30), (8, 8, 4), locs)]
    emb = tbe_jax.TableBatchedEmbedding(specs, impl=XLA)
    ref = tbe_jax.TableBatchedEmbedding([dataclasses.replace(s, location="device") for s in specs], impl=XLA)
    params, rparams = emb.init(jax.random.key(4)), ref.init(jax.random.key(4))
    assert params["d8_host"].shape == (90, 8) and written == [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 82]
    for a, b in zip(emb.get_tables(params), ref.get_tables(rparams)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state, rstate = emb.init_opt_state(params, opt), ref.init_opt_state(rparams, opt)
    assert sorted(state.momentum) == sorted(params)
    assert state.momentum["d8_host"].shape == rstate.momentum["d8"].shape
    for a, b in zip(emb.get_momentum(state), ref.get_momentum(rstate)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(np.asarray(emb.get_momentum(state)[0]).min()) == opt.initial_accumulator_value
    if ON_GPU:
        assert params["d8_host"].sharding.memory_kind == "pinned_host"
        assert state.momentum["d8_host"].sharding.memory_kind == "pinned_host"


def test_nnx_layer_prefetches_and_trains_as_the_all_device_one():
    nnx = pytest.importorskip("flax.nnx")
    from tbe_jax.nnx import TableBatchedEmbed
    from tbe_jax.nnx import train_step as nnx_step

    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.2)
    layer = TableBatchedEmbed(_specs(), feature_table_map=FMAP, impl=XLA, optimizer=opt, cache_load_factor=0.5,
                              cache_ways=4, rngs=nnx.Rngs(0))
    ref = TableBatchedEmbed(_specs(("device",) * 4), feature_table_map=FMAP, impl=XLA, optimizer=opt,
                            rngs=nnx.Rngs(0))
    ref.set_params(ref.tbe.set_tables(None, layer.tbe.get_tables(layer.get_params())))

    @nnx.jit
    def step(m, idx, off):
        m.prefetch(idx, off)  # inside the jitted step, before the lookup
        return nnx_step(lambda mm, i, o: jnp.sum(jnp.tanh(mm(i, o))), m, idx, off)[0]

    rng = np.random.default_rng(12)
    for k in range(3):
        idx, off, _ = _batch(rng, hot=20)
        if k == 1:  # and eagerly, outside a jitted function
            layer.prefetch(idx, off)
        step(layer, idx, off)
        nnx_step(lambda mm, i, o: jnp.sum(jnp.tanh(mm(i, o))), ref, idx, off)
    assert sum(int(v) for v in layer.tbe.cache_stats(layer.get_params()).values()) > 0
    for a, b in zip(layer.tbe.get_tables(layer.get_params()), ref.tbe.get_tables(ref.get_params())):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    for a, b in zip(layer.tbe.get_momentum(layer.get_opt_state()), ref.tbe.get_momentum(ref.get_opt_state())):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    plain = TableBatchedEmbed(_specs(("device",) * 4), feature_table_map=FMAP, impl=XLA, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="host_cached"):
        plain.prefetch(idx, off)


def test_prefetch_helpers_match_numpy():
    from tbe_jax.cache_prefetch import run_lengths, stable_pick

    rng = np.random.default_rng(5)
    for n, limit in ((1, 5), (7, 3), (200, 40), (64, 1)):
        v = np.sort(np.where(rng.random(n) < 0.2, limit, rng.integers(0, limit, n))).astype(np.int32)
        first = (v != np.concatenate([[-1], v[:-1]])) & (v < limit)
        want = np.zeros(n, np.int32)
        vals, starts, counts = np.unique(v, return_index=True, return_counts=True)
        want[starts[vals < limit]] = counts[vals < limit]
        np.testing.assert_array_equal(np.asarray(run_lengths(jnp.asarray(v), jnp.asarray(first), limit)), want)
    for w in (16, 4, 1):
        keys = rng.integers(0, 4, (300, w)).astype(np.int32)  # many ties
        keys[:5] = np.iinfo(np.int32).max
        keys[5:9] = np.iinfo(np.int32).min
        rank = rng.integers(0, w, 300).astype(np.int32)
        want = np.take_along_axis(np.argsort(keys, axis=1, kind="stable"), rank[:, None], axis=1)[:, 0]
        np.testing.assert_array_equal(np.asarray(stable_pick(jnp.asarray(keys), jnp.asarray(rank))), want)


@pytest.mark.parametrize("dst", [[5, 6, 7, 8], [0, 1, 2, 5, 6, 9], list(range(0, 40, 2))])  # 1, 3 and 20 runs
def test_merge_helpers_equal_the_scatter(dst):
    from tbe_jax.cache_route import _add_at, _gather_runs

    rng = np.random.default_rng(len(dst))
    dst = np.asarray(dst, np.int32)
    for axis, shape in ((0, (40,)), (1, (3, 40))):
        base = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        extra = jnp.asarray(rng.standard_normal(shape[:axis] + (len(dst),)).astype(np.float32))
        idx = (slice(None),) * axis + (dst,)
        np.testing.assert_array_equal(np.asarray(_add_at(base, dst, extra, axis)),
                                      np.asarray(base.at[idx].add(extra)))
        np.testing.assert_array_equal(np.asarray(_gather_runs(base, dst, axis)),
                                      np.asarray(jnp.concatenate([base, jnp.take(base, dst, axis=axis)], axis)))


@pytest.mark.parametrize("bounds_check,impl", [("ignore", XLA), ("warning", XLA), ("warning", "pallas")])
def test_bad_ids_and_offsets_as_the_all_device_model(bounds_check, impl):
    """Out-of-range ids (negative, >= E) are dropped, and in "warning" mode malformed offsets (past N, decreasing)
    repaired, as the all-device model does: same outputs, tables, states and counts, prefetch included."""
    emb, ref = _pair(impl=impl, load_factor=0.2, bounds_check=bounds_check)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    rng = np.random.default_rng(11)
    params = emb.init(jax.random.key(2))
    rparams = ref.set_tables(None, emb.get_tables(params))
    state, rstate = emb.init_opt_state(params, opt), ref.init_opt_state(rparams, opt)
    for k in range(3):
        idx, off, _ = _batch(rng, hot=20)
        idx = np.asarray(idx).copy()
        idx[rng.choice(int(off[-1]), 4, replace=False)] = [-1, 64, -7, 1000]  # in bags; every table has < 64 rows
        off = np.asarray(off).copy()
        if bounds_check == "warning":  # a decreasing entry and an end past the ids
            off[3], off[-1] = off[5] + 1, idx.shape[0] + 4
        idx, off = jnp.asarray(idx), jnp.asarray(off)
        params, state = emb.prefetch(params, idx, off, opt_state=state)
        (out, rep), (rout, rrep) = emb.forward_with_report(params, idx, off), ref.forward_with_report(rparams, idx,
                                                                                                      off)
        np.testing.assert_allclose(np.asarray(out), np.asarray(rout), rtol=1e-6, atol=1e-6)
        assert int(rep.invalid_indices) == int(rrep.invalid_indices) > 0
        if bounds_check == "warning":
            assert int(rep.repaired_offsets) == int(rrep.repaired_offsets) > 0
        g = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32))
        params, state = emb.apply_gradients(params, state, opt, idx, off, g)
        rparams, rstate = ref.apply_gradients(rparams, rstate, opt, idx, off, g)
        _same(emb, ref, params, rparams, state, rstate)
