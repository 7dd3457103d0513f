"""Public contract: construction, hashing, storage round trip, impl selection; modules use each other's public names."""

import ast
import pathlib

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


def test_init_in_blocks(monkeypatch):
    """`init` draws a buffer larger than `tbe.INIT_BLOCK` elements block by block into its place: each table's rows
    within +-1/sqrt(E_t) of its own E (tables sharing a buffer and a block), every block its own draw (the last one
    overlapping the one before), the same result for the same key, and a buffer of one block drawn as before. The
    scratch memory of a large buffer's init is that of a block, not of the buffer (XLA's memory analysis)."""
    from tbe_jax import tbe

    rows, dims = [10, 400, 5, 7, 300], [4, 8, 4, 3, 8]
    emb = tbe_jax.TableBatchedEmbedding(specs(rows, dims), weights_dtype="float32")
    whole = emb.get_tables(emb.init(jax.random.key(3)))
    monkeypatch.setattr(tbe, "INIT_BLOCK", 64)  # d8: 700 rows in blocks of 8 (88 blocks); d4, d3: one block
    got = [np.asarray(t) for t in emb.get_tables(emb.init(jax.random.key(3)))]
    for t, e in zip(got, rows):
        assert np.abs(t).max() <= 1 / np.sqrt(e) and np.abs(t).max() > 0.5 / np.sqrt(e)
    d8 = np.concatenate([got[1], got[4]]) * np.sqrt(np.repeat([400, 300], [400, 300]))[:, None]
    blocks = d8[:696].reshape(87, 8, 8)
    assert not np.any(np.all(np.isclose(blocks[1:], blocks[:-1]), axis=(1, 2)))  # no block repeats the one before
    assert np.abs(np.mean(d8)) < 0.05 and abs(np.std(d8) - 1 / np.sqrt(3)) < 0.02  # uniform in [-1, 1]
    for k in (0, 2, 3):  # one-block buffers: the same draw as without blocks
        np.testing.assert_array_equal(got[k], np.asarray(whole[k]))
    again = emb.get_tables(emb.init(jax.random.key(3)))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(got, again))
    monkeypatch.undo()
    shape = (4_000_000, 128, 128, "float16", tbe.INIT_BLOCK // 128)
    compiled = tbe._init_draw.trace(jax.random.key(0), jax.ShapeDtypeStruct((4,), jnp.int32),
                                    jax.ShapeDtypeStruct((4,), jnp.float32), *shape).lower().compile()
    mem = compiled.memory_analysis()
    assert mem.output_size_in_bytes == 4_000_000 * 128 * 2 and mem.temp_size_in_bytes < 0.5e9


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


# -- the training API: tbe_jax.train_step, optimizers as values, state checks ------------------------------

import optax  # noqa: E402

import tt_jax  # noqa: E402
from conftest import ON_GPU, assert_close, model_step_f64, tables_f64  # noqa: E402
from tbe_jax import testing  # noqa: E402
from test_tt_grad import T2, T3, as_f64, make_inputs, make_params, numpy_core_grads, numpy_step  # noqa: E402

_TBE_KW = {"xla": dict(impl="xla"), "kernel": KERNEL_KW}


def _touched(fmap, num_rows, batch, idx, off):
    """Per table, the rows the batch looks up (valid ids inside the offsets)."""
    hit = [np.zeros(e, bool) for e in num_rows]
    base = 0
    for f, t in enumerate(fmap):
        ids = idx[off[base] : off[base + batch[f]]]
        hit[t][ids[(ids >= 0) & (ids < num_rows[t])]] = True
        base += batch[f]
    return hit


def _loss_dot(g):
    """A loss_fn whose gradient with respect to the lookup's output is `g` (no dense parameters)."""
    return lambda _, out: jnp.sum(out * g)


def _tbe(impl, rows=(30, 12), dims=(8, 8), **kw):
    return tbe_jax.TableBatchedEmbedding(specs(list(rows), list(dims)), **_TBE_KW[impl], **kw)


def test_removed_api_is_gone():
    # 0.2.0 (CHANGELOG.md): the raising stubs and aliases of the removed fused-gradient path are gone.
    for owner, name in [(tbe_jax.TableBatchedEmbedding, "fused_lookup"), (tt_jax.TTEmbeddingBag, "fused_lookup"),
                        (tbe_jax, "FusedOptimizer"), (tt_jax, "FusedOptimizer"), (tbe_jax, "rowwise_adagrad"),
                        (tbe_jax, "sgd"), (tbe_jax, "adagrad"), (tt_jax, "rowwise_adagrad"),
                        (tbe_jax.sharding, "ShardReport")]:
        assert not hasattr(owner, name), name
    assert tbe_jax.__version__ == "0.2.0"


@pytest.mark.parametrize("kind", ["tbe-xla", "tbe-kernel", "tt-xla"])
def test_output_not_reaching_the_loss_leaves_tables_unchanged(rng, kind):
    # Two lookups; only "used" reaches the loss: "unused" gets a zero output gradient, so its tables and
    # accumulators come back bitwise unchanged while its count advances (the old fused path zeroed them).
    if kind == "tt-xla":
        emb = tt_jax.TTEmbeddingBag([T3], feature_table_map=(0, 0), impl="xla")
        params = {"used": make_params(emb, rng), "unused": make_params(emb, rng)}
        opt = tt_jax.RowwiseAdagrad(0.1, initial_accumulator_value=0.25)
        idx, off, _, _ = make_inputs(rng, emb, 4, bag_len=(1, 5))
    else:
        emb = _tbe(kind.split("-")[1], pooling="mean")
        params = {"used": emb.init(jax.random.key(1)), "unused": emb.init(jax.random.key(2))}
        opt = tbe_jax.RowwiseAdagrad(0.1, initial_accumulator_value=0.25)
        idx, off, _ = testing.make_batch(rng, [30, 12], [4, 4], (1, 5))
    states = {k: emb.init_opt_state(p, opt) for k, p in params.items()}
    width = jax.eval_shape(emb.__call__, params["used"], idx, off).shape[1]
    dense = jnp.asarray(rng.standard_normal(width).astype(np.float32))

    def loss_fn(dense, outputs):
        return jnp.sum(outputs["used"] @ dense) + jnp.sum(dense**2)

    @jax.jit
    def step(dense, params, states, opt):
        return tbe_jax.train_step(loss_fn, dense, {
            k: tbe_jax.SparseLookup(emb, opt, params[k], states[k], idx, off) for k in params})

    res = step(dense, params, states, opt)
    for a, b in zip(jax.tree.leaves((params["unused"], states["unused"].momentum)),
                    jax.tree.leaves((res.params["unused"], res.opt_state["unused"].momentum))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(res.opt_state["unused"].count) == int(res.opt_state["used"].count) == 1
    assert any(np.any(np.asarray(a) != np.asarray(b))  # the used tables did train
               for a, b in zip(jax.tree.leaves(params["used"]), jax.tree.leaves(res.params["used"])))
    assert_close(res.grads, jnp.sum(res.outputs["used"], axis=0) + 2 * dense, 1e-5)

    if kind == "tbe-kernel":
        return
    # One lookup whose output the loss ignores: the same.
    one = jax.jit(lambda p, s, opt: tbe_jax.train_step(lambda d, out: jnp.sum(d**2), dense,
                                                       tbe_jax.SparseLookup(emb, opt, p, s, idx, off)))
    res = one(params["used"], states["used"], opt)
    for a, b in zip(jax.tree.leaves((params["used"], states["used"].momentum)),
                    jax.tree.leaves((res.params, res.opt_state.momentum))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(res.opt_state.count) == 1 and int(res.report.nonfinite_grads) == 0


def test_gradient_clipping_cannot_touch_tables(rng):
    # optax.clip_by_global_norm transforms res.grads, the dense gradient only: a TBE and a TT lookup in one
    # step update their tables from the true output gradient, with or without clipping.
    emb = _tbe("xla", pooling="mean")
    tt = tt_jax.TTEmbeddingBag([T3], impl="xla")
    idx, off, _ = testing.make_batch(rng, [30, 12], [4, 4], (1, 5))
    tidx, toff, _, _ = make_inputs(rng, tt, 4, bag_len=(2, 5))
    opt = {"tbe": tbe_jax.RowwiseAdagrad(0.2, 1e-3), "tt": tt_jax.Adagrad(0.05, 1e-6)}
    params = {"tbe": emb.init(jax.random.key(3)), "tt": make_params(tt, rng)}
    states = {"tbe": emb.init_opt_state(params["tbe"], opt["tbe"]), "tt": tt.init_opt_state(params["tt"], opt["tt"])}
    dense = {"w": jnp.asarray(rng.standard_normal((28, 1)).astype(np.float32))}
    target = jnp.asarray(rng.standard_normal((4, 1)).astype(np.float32))

    def loss_fn(dense, outputs):
        x = jnp.concatenate([outputs["tbe"], outputs["tt"]], axis=1)
        return jnp.mean((x @ dense["w"] - target) ** 2)

    def step(dense, params, states, opt, clip):
        res = tbe_jax.train_step(loss_fn, dense, {
            "tbe": tbe_jax.SparseLookup(emb, opt["tbe"], params["tbe"], states["tbe"], idx, off),
            "tt": tbe_jax.SparseLookup(tt, opt["tt"], params["tt"], states["tt"], tidx, toff)})
        tx = optax.chain(optax.clip_by_global_norm(1e-4), optax.sgd(0.1)) if clip else optax.sgd(0.1)
        updates, _ = tx.update(res.grads, tx.init(dense), dense)
        return optax.apply_updates(dense, updates), res.params, res.opt_state, res.grads

    step = jax.jit(step, static_argnums=4)
    d_clip, p_clip, s_clip, grads = step(dense, params, states, opt, True)
    d_free, p_free, s_free, _ = step(dense, params, states, opt, False)
    assert float(optax.tree.norm(grads)) > 1e-3  # the clipping did act on the dense update
    assert not np.allclose(np.asarray(d_clip["w"]), np.asarray(d_free["w"]))
    for a, b in zip(jax.tree.leaves((p_clip, s_clip)), jax.tree.leaves((p_free, s_free))):
        if ON_GPU:  # two programs: XLA's GPU scatter-adds (the TT update) sum in an unspecified order
            assert_close(a, b, 1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... and equal apply_gradients with the unclipped output gradient.
    @jax.jit
    def reference(dense, params, states, opt):
        out = {"tbe": emb(params["tbe"], idx, off), "tt": tt(params["tt"], tidx, toff)}
        g_out = jax.grad(loss_fn, argnums=1)(dense, out)
        return {"tbe": emb.apply_gradients(params["tbe"], states["tbe"], opt["tbe"], idx, off, g_out["tbe"]),
                "tt": tt.apply_gradients(params["tt"], states["tt"], opt["tt"], tidx, toff, g_out["tt"])}

    want = reference(dense, params, states, opt)
    for k in ("tbe", "tt"):
        for a, b in zip(jax.tree.leaves((p_clip[k], s_clip[k])), jax.tree.leaves(want[k])):
            assert_close(a, b, 1e-5)


_LINEAR = optax.linear_schedule(0.2, 0.02, 3)
_WARMUP = optax.warmup_cosine_decay_schedule(0.0, 0.3, warmup_steps=2, decay_steps=4, end_value=0.01)


@pytest.mark.parametrize("kind,make_opt", [
    ("tbe-xla", lambda: tbe_jax.RowwiseAdagrad(_LINEAR, 1e-3)),
    ("tbe-xla", lambda: tbe_jax.SGD(_WARMUP)),
    ("tbe-kernel", lambda: tbe_jax.RowwiseAdagrad(_WARMUP, 1e-3, initial_accumulator_value=0.1)),
    pytest.param("tbe-kernel", lambda: tbe_jax.SGD(_LINEAR), marks=pytest.mark.skipif(not ON_GPU, reason=(
        "compiled only; interpret mode: the step's learning rate enters the kernels as an operand, the same for "
        "every rule, in [tbe-kernel-rowwise-warmup]; SGD with a schedule in [tbe-xla-sgd-warmup]"))),
    ("tt-xla", lambda: tt_jax.RowwiseAdagrad(_WARMUP, 1e-6, initial_accumulator_value=0.01)),
    ("tt-xla", lambda: tt_jax.Adagrad(_LINEAR, 1e-6, initial_accumulator_value=0.01)),
], ids=["tbe-xla-rowwise-linear", "tbe-xla-sgd-warmup", "tbe-kernel-rowwise-warmup", "tbe-kernel-sgd-linear",
        "tt-xla-rowwise-warmup", "tt-xla-adagrad-linear"])
def test_learning_rate_schedule_compiles_once_and_matches_float64(rng, kind, make_opt):
    # 4 steps of one jitted train_step taking the optimizer as an ordinary argument: one compile; step k
    # uses schedule(k) (the first schedule(0)), against a float64 NumPy model step by step.
    opt = make_opt()
    batch = 4
    if kind == "tt-xla":
        emb = tt_jax.TTEmbeddingBag([T3, T2], feature_table_map=(0, 1, 0), pooling="mean", impl="xla")
        params = make_params(emb, rng)
        cores64 = as_f64(emb.get_cores(params))
    else:
        emb = _tbe(kind.split("-")[1], rows=(30, 12, 7), dims=(8, 16, 8), feature_table_map=[0, 1, 2, 1],
                   pooling="mean")
        params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
        fmap, num_rows = list(emb.feature_table_map), [t.num_embeddings for t in emb.tables]
        tabs = tables_f64(emb, params)
    state = emb.init_opt_state(params, opt)
    has_m = not isinstance(opt, tbe_jax.SGD)
    mom = [np.asarray(m, np.float64) for m in emb.get_momentum(state)] if has_m and kind != "tt-xla" else None
    mom = as_f64(emb.get_momentum(state)) if has_m and kind == "tt-xla" else mom

    @jax.jit
    def step(params, state, opt, idx, off, g):
        res = tbe_jax.train_step(_loss_dot(g), None, tbe_jax.SparseLookup(emb, opt, params, state, idx, off))
        return res.params, res.opt_state

    for k in range(4):
        if kind == "tt-xla":
            idx, off, _, g = make_inputs(rng, emb, batch, bag_len=4, alpha=1.5)  # N fixed: one shape
        else:
            idx, off, _ = testing.make_batch(rng, [num_rows[t] for t in fmap], [batch] * 4, 3, alpha=1.2)
            g = rng.standard_normal((batch, sum(emb.feature_dims))).astype(np.float32)
        before = params
        params, state = step(params, state, opt, idx, off, g)
        assert int(state.count) == k + 1
        if kind == "tt-xla":
            grads, touched = numpy_core_grads(emb, emb.set_cores(None, cores64), idx, off, None, g, batch)
            cores64, mom = numpy_step(opt, cores64, mom, grads, touched, count=k)
            for got_t, want_t in zip(emb.get_cores(params), cores64):
                for a, b in zip(got_t, want_t):
                    assert_close(a, b, 2e-6)
            if mom is not None:
                for got_t, want_t in zip(emb.get_momentum(state), mom):
                    for a, b in zip(got_t, want_t):
                        assert_close(a, b, 2e-6)
        else:
            grads, _ = testing.numpy_pooled_vjp(tabs, fmap, [batch] * 4, idx, off, None, g, "mean", False)
            tabs, mom = model_step_f64(tabs, mom, _touched(fmap, num_rows, [batch] * 4, idx, off), grads, opt,
                                       count=k)
            for a, b in zip(emb.get_tables(params), tabs):
                assert_close(a, b, 2e-5)
            if mom is not None:
                for a, b in zip(emb.get_momentum(state), mom):
                    assert_close(a, b, 1e-5)
        if k == 0 and opt.learning_rate is _WARMUP and isinstance(opt, tbe_jax.SGD):
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)):  # schedule(0) = 0: no move
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert step._cache_size() == 1


def test_traced_learning_rate_and_new_values_do_not_recompile(rng):
    emb = _tbe("xla")
    tt = tt_jax.TTEmbeddingBag([T3], impl="xla")
    params, tparams = emb.init(jax.random.key(4)), make_params(tt, rng)
    idx, off, _ = testing.make_batch(rng, [30, 12], [4, 4], (1, 5))
    tidx, toff, _, tg = make_inputs(rng, tt, 4, bag_len=(2, 5))
    g = rng.standard_normal((4, 16)).astype(np.float32)
    state = emb.init_opt_state(params, tbe_jax.RowwiseAdagrad())
    tstate = tt.init_opt_state(tparams, tt_jax.RowwiseAdagrad())
    # The learning rate as a traced jnp scalar argument, the optimizer built inside the jitted function.
    traced = jax.jit(lambda p, s, lr: emb.apply_gradients(p, s, tbe_jax.RowwiseAdagrad(lr, 1e-3), idx, off, g))
    traced_tt = jax.jit(lambda p, s, lr: tt.apply_gradients(p, s, tt_jax.RowwiseAdagrad(lr, 1e-6), tidx, toff, tg))
    # The optimizer (float learning rate) as an ordinary argument, through train_step.
    as_arg = jax.jit(lambda p, s, opt: tbe_jax.train_step(_loss_dot(g), None,
                                                          tbe_jax.SparseLookup(emb, opt, p, s, idx, off)))
    tt_as_arg = jax.jit(lambda p, s, opt: tt.apply_gradients(p, s, opt, tidx, toff, tg))
    tabs = tables_f64(emb, params)
    grads, _ = testing.numpy_pooled_vjp(tabs, [0, 1], [4, 4], idx, off, None, g, "sum", False)
    hit = _touched([0, 1], [30, 12], [4, 4], idx, off)
    for lr in (0.1, 0.35, 0.02):
        opt = tbe_jax.RowwiseAdagrad(lr, 1e-3)
        want, want_m = model_step_f64(tabs, [np.zeros(30), np.zeros(12)], hit, grads, opt)
        p1, s1 = traced(params, state, jnp.float32(lr))
        res = as_arg(params, state, opt)
        for p, s in ((p1, s1), (res.params, res.opt_state)):
            for a, b in zip(emb.get_tables(p), want):
                assert_close(a, b, 2e-5)
            for a, b in zip(emb.get_momentum(s), want_m):
                assert_close(a, b, 1e-5)
        tp, _ = traced_tt(tparams, tstate, jnp.float32(lr))
        tp_want, _ = tt_as_arg(tparams, tstate, tt_jax.RowwiseAdagrad(lr, 1e-6))
        for a, b in zip(jax.tree.leaves(tp), jax.tree.leaves(tp_want)):
            assert_close(a, b, 1e-6)
        assert not np.array_equal(np.asarray(tp["cores"][0][0]), np.asarray(tparams["cores"][0][0]))
    assert traced._cache_size() == traced_tt._cache_size() == as_arg._cache_size() == tt_as_arg._cache_size() == 1


@pytest.mark.parametrize("kind", ["tbe", "tt"])
def test_wrong_optimizer_state_is_refused(rng, kind):
    if kind == "tbe":
        emb = _tbe("xla")
        params = emb.init(jax.random.key(5))
        idx, off = np.array([1, 2, 3], np.int32), np.array([0, 2, 3], np.int32)
    else:
        emb = tt_jax.TTEmbeddingBag([T3], impl="xla")
        params = make_params(emb, rng)
        idx, off = np.array([1, 2, 3], np.int32), np.array([0, 2, 3], np.int32)
    g = np.ones(emb(params, idx, off).shape, np.float32)
    opt = tbe_jax.RowwiseAdagrad(0.1)
    good = emb.init_opt_state(params, opt)
    m = good.momentum
    bad = {
        "type": (tbe_jax.SGDState(good.count), TypeError, "SGDState; RowwiseAdagrad needs a RowwiseAdagradState"
                                                          ".*init_opt_state"),
        "tuple": ((m, good.count), TypeError, "needs a RowwiseAdagradState"),
        "element-wise state": (tbe_jax.AdagradState(m, good.count), TypeError, "needs a RowwiseAdagradState"),
        "shape": (good._replace(momentum=jax.tree.map(lambda x: x[:-1], m)), ValueError,
                  r"holds a float32\[\d+\] where the params need float32\[\d+\].*init_opt_state"),
        "dtype": (good._replace(momentum=jax.tree.map(lambda x: x.astype(jnp.bfloat16), m)), ValueError,
                  r"holds a bfloat16\[\d+\] where the params need float32"),
        "no count": (good._replace(count=None), ValueError, "does not match the params' structure"),
        "count dtype": (good._replace(count=jnp.float32(0)), ValueError, r"holds a float32\[\] where the params "
                                                                         r"need int32\[\]"),
    }
    if kind == "tt":  # the momentum of the old TT layout (per table, per core, without "cores")
        bad["old layout"] = (good._replace(momentum=m["cores"]), ValueError, "does not match the params' structure")
    with pytest.raises(TypeError):
        tbe_jax.RowwiseAdagradState(m)  # a state without a count cannot even be built
    step = jax.jit(lambda p, s: tbe_jax.train_step(_loss_dot(g), None,
                                                   tbe_jax.SparseLookup(emb, opt, p, s, idx, off)))
    for name, (state, exc, match) in bad.items():
        with pytest.raises(exc, match=match):
            emb.apply_gradients(params, state, opt, idx, off, g)
        with pytest.raises(exc, match=match):
            step(params, state)
    emb.apply_gradients(params, good, opt, idx, off, g)  # the right one passes


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_nonfinite_output_gradient_skips_its_rows(rng, impl):
    emb = _tbe(impl, rows=(30, 12), dims=(8, 8))
    params = emb.init(jax.random.key(6))
    idx, off, _ = testing.make_batch(rng, [30, 12], [4, 4], (1, 5))
    g = rng.standard_normal((4, 16)).astype(np.float32)
    g[0, 1], g[2, 12], g[2, 13] = np.nan, np.inf, -np.inf  # feature 0 bag 0; feature 1 bag 2
    tabs = tables_f64(emb, params)
    grads, _ = testing.numpy_pooled_vjp(tabs, [0, 1], [4, 4], idx, off, None, g, "sum", False)
    hit = _touched([0, 1], [30, 12], [4, 4], idx, off)
    finite = [np.all(np.isfinite(gr), axis=1) for gr in grads]
    bad_rows = [h & ~f for h, f in zip(hit, finite)]
    good_rows = [h & f for h, f in zip(hit, finite)]
    assert all(b.any() for b in bad_rows) and all(r.any() for r in good_rows)
    step = jax.jit(lambda p, s, opt: tbe_jax.train_step(_loss_dot(g), None,
                                                        tbe_jax.SparseLookup(emb, opt, p, s, idx, off)))
    opt = tbe_jax.RowwiseAdagrad(0.1, 1e-3, initial_accumulator_value=0.5)
    state = emb.init_opt_state(params, opt)
    res = step(params, state, opt)
    assert int(res.report.nonfinite_grads) == 3
    want, want_m = model_step_f64(tabs, [np.full(30, 0.5), np.full(12, 0.5)], good_rows, grads, opt)
    for t, (a, w, m, wm, was) in enumerate(zip(emb.get_tables(res.params), want, emb.get_momentum(res.opt_state),
                                               want_m, emb.get_tables(params))):
        assert_close(a, w, 2e-5)  # finite everywhere; rows with a finite gradient updated as the model
        assert_close(m, wm, 1e-5)
        np.testing.assert_array_equal(np.asarray(a)[bad_rows[t]], np.asarray(was)[bad_rows[t]])
        np.testing.assert_array_equal(np.asarray(m)[bad_rows[t]], 0.5)
        assert np.all(np.any(np.asarray(a)[good_rows[t]] != np.asarray(was)[good_rows[t]], axis=1))
    if impl == "xla":  # SGD skips them too
        sgd = tbe_jax.SGD(0.1)
        res = step(params, sgd.init(params), sgd)
        want, _ = model_step_f64(tabs, None, good_rows, grads, sgd)
        for a, w in zip(emb.get_tables(res.params), want):
            assert_close(a, w, 2e-5)
    # Without the skip the rows turn NaN.
    raw = tbe_jax.RowwiseAdagrad(0.1, 1e-3, initial_accumulator_value=0.5, skip_nonfinite=False)
    res = step(params, state, raw)
    assert int(res.report.nonfinite_grads) == 3
    for t, (a, m, was) in enumerate(zip(emb.get_tables(res.params), emb.get_momentum(res.opt_state),
                                        emb.get_tables(params))):
        a, m = np.asarray(a), np.asarray(m)
        assert np.all(np.any(np.isnan(a[bad_rows[t]]), axis=1)) and not np.any(np.isfinite(m[bad_rows[t]]))
        assert np.all(np.isfinite(a[~bad_rows[t]])) and np.all(np.isfinite(m[~bad_rows[t]]))
        np.testing.assert_array_equal(a[~hit[t]], np.asarray(was)[~hit[t]])


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_padded_batches_share_one_compiled_step(rng, impl):
    # indices padded past offsets[-1] (with valid-looking ids) to one length: one compile for batches of
    # several real lengths, each step equal to the unpadded batch's.
    emb = _tbe(impl, pooling="mean")
    opt = tbe_jax.RowwiseAdagrad(0.1, 1e-3)
    params = emb.init(jax.random.key(8))
    state = emb.init_opt_state(params, opt)
    tabs, mom = tables_f64(emb, params), [np.zeros(30), np.zeros(12)]
    g = rng.standard_normal((4, 16)).astype(np.float32)
    step = jax.jit(lambda p, s, opt, i, o: tbe_jax.train_step(_loss_dot(g), None,
                                                              tbe_jax.SparseLookup(emb, opt, p, s, i, o)))
    padded_len, lengths = 64, []
    for bag_len in ((0, 2), (1, 7), (3, 7)):
        idx, off, _ = testing.make_batch(rng, [30, 12], [4, 4], bag_len)
        n = len(idx)
        lengths.append(n)
        pad = rng.integers(0, 12, padded_len).astype(np.int32)  # valid ids: they must be ignored
        pad[:n] = idx
        res = step(params, state, opt, pad, off)
        assert_close(res.outputs, testing.numpy_pooled(tabs, [0, 1], [4, 4], idx, off, None, "mean", False), 1e-6)
        grads, _ = testing.numpy_pooled_vjp(tabs, [0, 1], [4, 4], idx, off, None, g, "mean", False)
        tabs, mom = model_step_f64(tabs, mom, _touched([0, 1], [30, 12], [4, 4], idx, off), grads, opt)
        for a, b in zip(emb.get_tables(res.params), tabs):
            assert_close(a, b, 2e-5)
        for a, b in zip(emb.get_momentum(res.opt_state), mom):
            assert_close(a, b, 1e-5)
        assert int(res.opt_state.count) == len(lengths)
        params, state = res.params, res.opt_state
    assert len(set(lengths)) == 3 and max(lengths) <= padded_len
    assert step._cache_size() == 1


# -- the library's modules reach each other through public names only ------------------------------------------

_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Public API despite the underscore (NamedTuple's), and JAX's internals, which a few checks must read (`jax._src`).
_ALLOWED_ATTRS = {"_replace", "_fields", "_asdict", "_make", "_src"}
# (importing file, private module) pairs let through the check below: none (tt_jax's kernels reach tbe_jax's
# Pallas import through the public `tbe_jax.pallas_compat`).
_ALLOWED_MODULES: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _members(tree) -> set:
    """Private names the file defines as class members (methods, class attributes, `self._x = ...`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(item.name)
                for t in item.targets if isinstance(item, ast.Assign) else []:
                    if isinstance(t, ast.Name):
                        out.add(t.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
    return {n for n in out if _private(n)}


def _reaches(rel: str, source: str) -> list[str]:
    """Where the file `rel` (its text: `source`) uses a private name of another module: `obj._x` (unless `_x` is a member of a class of this
    file, e.g. `other._key()` in `__eq__`), `getattr(obj, "_x")`, `from m import _x`, or a private module of
    another package."""
    package = rel.split("/")[0]
    tree = ast.parse(source, rel)
    members = _members(tree)
    found = []
    for node in ast.walk(tree):
        at = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in _ALLOWED_ATTRS:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and node.attr not in members:
                found.append(f"{at}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
              and node.func.id in ("getattr", "hasattr", "setattr") and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
            if isinstance(name, str) and _private(name) and name not in _ALLOWED_ATTRS | members:
                found.append(f"{at}: {node.func.id}(..., {name!r})")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
            modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for mod in modules:
                parts = mod.split(".")
                if (parts[:2] != ["jax", "_src"] and parts[0] != package and any(map(_private, parts))
                        and (rel, mod) not in _ALLOWED_MODULES):
                    found.append(f"{at}: imports {mod}")
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[:2] != ["jax", "_src"]:
                # `from tbe_jax import _x` (a package's own private module) is the package's business
                own_module = node.module == package
                found += [f"{at}: from {node.module} import {a.name}" for a in node.names
                          if _private(a.name) and not own_module]
    return found


def test_modules_use_each_others_public_names():
    """No module of tbe_jax, tt_jax or examples reaches into another module's private names (a leading underscore
    means: used only in its own file); what cores offer each other is `tbe_jax.core.SparseCore`."""
    files = [p for pkg in ("tbe_jax", "tt_jax", "examples") for p in sorted((_ROOT / pkg).rglob("*.py"))]
    assert len(files) > 40
    found = [hit for p in files for hit in _reaches(p.relative_to(_ROOT).as_posix(), p.read_text())]
    assert not found, "\n".join(found)


def test_reach_check_sees_private_use():
    """The check above flags each form it looks for, and lets a class's own members and NamedTuple's API pass."""
    src = ("from tbe_jax.tbe import _init_draw\nfrom tt_jax import _x\n\n\nclass A:\n    def _own(self):\n"
           "        return other._own(), s._replace(a=1), emb._use(), getattr(emb, '_check')\n")
    found = [f.split(": ", 1)[1] for f in _reaches("tbe_jax/probe.py", src)]
    assert sorted(found) == sorted(["from tbe_jax.tbe import _init_draw", "from tt_jax import _x", "._use",
                                    "getattr(..., '_check')"])


def test_cores_implement_the_interface():
    """Every core (unsharded and sharded, TBE and TT) is a `tbe_jax.core.SparseCore`; the unsharded ones shard."""
    import tt_jax
    from tbe_jax.core import ShardableCore, SparseCore, is_sharded

    emb = tbe_jax.TableBatchedEmbedding(specs([10], [4]), impl="xla")
    tt = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(100, 8, ranks=(4, 4)), impl="xla")
    mesh = jax.make_mesh((1,), ("data",))
    for core in (emb, tt):
        assert isinstance(core, ShardableCore) and not is_sharded(core)
        sharded = core.shard(mesh, "data")
        assert isinstance(sharded, SparseCore) and is_sharded(sharded)
        assert not sharded.uses_kernel() and not core.uses_kernel()
    with pytest.raises(ValueError, match="capacity applies to tbe_jax.shard"):
        tt.shard(mesh, "data", capacity=4)


def test_no_library_file_over_600_lines():
    """One job per file (issue 37): no module of tbe_jax or tt_jax passes 600 lines."""
    root = pathlib.Path(__file__).resolve().parents[1]
    long = {str(p.relative_to(root)): n for p in sorted(root.glob("t*_jax/**/*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_every_exported_name_exists():
    """`from m import *` works: every name in a public module's `__all__` exists."""
    import importlib

    mods = ["tbe_jax", "tbe_jax.optim", "tbe_jax.core", "tbe_jax.sharding", "tbe_jax.train", "tbe_jax.linen",
            "tbe_jax.nnx", "tbe_jax.haiku", "tt_jax"]
    missing = {m: [n for n in importlib.import_module(m).__all__ if not hasattr(importlib.import_module(m), n)]
               for m in mods}
    assert not any(missing.values()), missing
