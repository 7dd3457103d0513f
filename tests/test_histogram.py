"""Small-table histogram path: eligibility, dispatch, and exactness.

Runs compiled on a GPU and in interpret mode on CPU (conftest.KERNEL_KW).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import dispatch, testing
from tbe_jax.kernels import histogram
from conftest import KERNEL_KW, ON_GPU, assert_close, model_step_f64, tables_f64, tolerance


def _emb(tables, **kw):
    kw.setdefault("weights_dtype", "float16")
    return tbe_jax.TableBatchedEmbedding(tables, **kw, **KERNEL_KW)


def _check(rng, tables, batch, bag_len, *, expect, pooling="sum", fmap=None, alpha=1.0):
    fmap = list(range(len(tables))) if fmap is None else fmap
    emb = _emb(tables, feature_table_map=fmap, pooling=pooling)
    assert emb.plan() == expect
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, _ = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], batch, bag_len,
                                     alpha=alpha)
    out = emb(params, idx, off)
    generic = _emb(tables, feature_table_map=fmap, pooling=pooling, use_histogram=False)
    assert set(generic.plan()) == {"generic"}
    out_generic = generic(params, idx, off)
    model = testing.numpy_pooled(tables_f64(emb, params), fmap, batch, idx, off, None, pooling, False)
    max_len = int(np.diff(off).max())
    tol = tolerance("float32", max_len)  # fp32 rounding: products are exact
    assert_close(out, model, tol)
    assert_close(out, out_generic, tol)
    return emb, params, idx, off


# Every E and every D, paired (not the full product: interpret mode is slow on CPU).
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 128), (16, 100), (33, 128), (64, 64), (64, 100)])
def test_table_sizes_and_dims(rng, rows, dim):
    t = tbe_jax.TableSpec(rows, dim, bag_size_hint=128)
    _check(rng, [t], [19], (0, 300), expect=("histogram",))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_long_short_and_empty_bags(rng, pooling):
    # Bags from 0 to 1000 ids (crossing the 256-id histogram head), heavy duplicates (E=5).
    t = tbe_jax.TableSpec(5, 128, bag_size_hint=64)
    emb = _emb([t], pooling=pooling)
    params = emb.init(jax.random.key(1))
    lengths = np.array([0, 1, 63, 255, 256, 257, 1000, 511, 0, 64, 3, 700, 256, 2, 999, 5, 17])
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = rng.integers(0, 5, int(off[-1])).astype(np.int32)
    out = emb(params, idx, off)
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [len(lengths)], idx, off, None, pooling, False)
    assert_close(out, model, tolerance("float32", 1000))
    assert not np.any(np.asarray(out)[lengths == 0])


def test_mixed_batch_and_limits(rng):
    # One small table among ordinary ones, and one just outside each limit.
    tables = [
        tbe_jax.TableSpec(64, 128, bag_size_hint=100),  # eligible
        tbe_jax.TableSpec(500, 128),  # ordinary
        tbe_jax.TableSpec(65, 128, bag_size_hint=100),  # E = 65
        tbe_jax.TableSpec(40, 63, bag_size_hint=100),  # D = 63
        tbe_jax.TableSpec(40, 129, bag_size_hint=100),  # D = 129
        tbe_jax.TableSpec(40, 64, bag_size_hint=63),  # hint = 63
        tbe_jax.TableSpec(40, 64),  # no hint
        tbe_jax.TableSpec(10, 64, bag_size_hint=64),  # eligible
    ]
    expect = ("histogram", "generic", "generic", "generic", "generic", "generic", "auto", "histogram",
              "histogram")
    _check(rng, tables, [9] * 9, (0, 300), expect=expect, fmap=[0, 1, 2, 3, 4, 5, 6, 7, 0])


def test_ineligible_dtypes_weighted_and_vbe_plan_generic(rng):
    t = [tbe_jax.TableSpec(32, 64, bag_size_hint=128)]
    assert _emb(t).plan() == ("histogram",)
    assert _emb(t, weights_dtype="float32").plan() == ("generic",)
    assert _emb(t, weights_dtype="bfloat16").plan() == ("generic",)
    assert _emb(t, output_dtype="float16").plan() == ("generic",)
    assert _emb(t).plan(weighted=True) == ("generic",)
    assert _emb(t).plan(vbe=True) == ("generic",)
    assert _emb(t, use_histogram=False).plan() == ("generic",)
    # A weighted call on an eligible feature takes the generic path and is right.
    emb = _emb(t)
    params = emb.init(jax.random.key(0))
    idx, off, psw = testing.make_batch(rng, [32], [5], (0, 300), weighted=True)
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [5], idx, off, psw, "sum", False)
    assert_close(emb(params, idx, off, psw), model, tolerance("float16", 300))
    out = emb(params, idx, off, batch_size_per_feature=(5,))
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [5], idx, off, None, "sum", True)
    assert_close(out, model, tolerance("float16", 300))


@pytest.mark.parametrize("tile", ["default", "bags32_c2"])
def test_bad_ids_warning_mode(rng, tile):
    t = [tbe_jax.TableSpec(20, 64, bag_size_hint=128)]
    emb = _emb(t, bounds_check="warning", histogram_config=histogram.HistogramConfig(**_TILES[tile]))
    params = emb.init(jax.random.key(0))
    idx = rng.integers(0, 20, 700).astype(np.int32)
    idx[[3, 300, 600]] = [20, -7, 25]  # bad in the head and in the tail
    idx[10] = -1  # pruned: skipped, not counted
    off = np.array([0, 350, 700], np.int32)
    with pytest.warns(RuntimeWarning, match="3 index"):
        out = emb(params, idx, off)
        jax.block_until_ready(out)
        jax.effects_barrier()
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [2], idx, off, None, "sum", False)
    assert_close(out, model, tolerance("float32", 350))


def test_saved_counts_match_numpy(rng):
    t = tbe_jax.TableSpec(30, 64, bag_size_hint=64)
    emb = _emb([t])
    params = emb.init(jax.random.key(0))
    batch = 20
    idx, off, _ = testing.make_batch(rng, [30], [batch], (0, 400))
    plan = emb.plan_for(len(off))
    out, counts = histogram.histogram_forward(
        None, params, emb.layout, plan, [0], jnp.asarray(idx), jnp.asarray(off),
        pooling="sum", check_upper=False, interpret=KERNEL_KW["interpret"], save_counts=True)
    rows = histogram.histogram_programs(plan, [0])
    counts = np.asarray(counts)
    for r, (f, b) in enumerate(rows):
        if b < 0:
            continue
        ids = idx[off[b] : off[b + 1]][: histogram.HistogramConfig().head]
        np.testing.assert_array_equal(counts[r, :30], np.bincount(ids, minlength=30))


@pytest.mark.parametrize("cfg", [dict(lookahead=0), dict(bags=32, ids_per_step=64, lookahead=3)],
                         ids=["no_lookahead", "bags32_c64"])
def test_config_variants_match_model(rng, cfg):
    t = tbe_jax.TableSpec(40, 64, bag_size_hint=64)
    emb = _emb([t], histogram_config=histogram.HistogramConfig(**cfg))
    params = emb.init(jax.random.key(5))
    idx, off, _ = testing.make_batch(rng, [40], [21], (0, 300))
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [21], idx, off, None, "sum", False)
    assert_close(emb(params, idx, off), model, tolerance("float32", 300))


# The packed counting with its tile and pipelining knobs: bags of 0..600 ids (head and tail), E and D
# across the limits (E_padded 16, 64, 64: one to four packed bytes).
_TILES = {
    "default": dict(),
    "bags32_c2": dict(bags=32, ids_per_step=2, lookahead=3),
    "c64_no_lookahead": dict(ids_per_step=64, lookahead=0),
}


# Each tile on one of three (E, D) shapes, in turn (the product is slow in interpret mode).
@pytest.mark.parametrize("tile,rows,dim", [(m, *[(1, 64), (33, 100), (64, 128)][i % 3]) for i, m in enumerate(_TILES)])
def test_tiles_match_model(rng, tile, rows, dim):
    t = tbe_jax.TableSpec(rows, dim, bag_size_hint=64)
    emb = _emb([t], histogram_config=histogram.HistogramConfig(**_TILES[tile]))
    assert emb.plan() == ("histogram",)
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, _ = testing.make_batch(rng, [rows], [18], (0, 600))
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [18], idx, off, None, "sum", False)
    assert_close(emb(params, idx, off), model, tolerance("float32", 600))


@pytest.mark.parametrize("tile", ["default", "bags32_c2"])
def test_saved_counts_all_one_row(rng, tile):
    # Heavy single-row bags: a bag's count of one row reaches 256 (the top byte of a word,
    # 128 per 8-bit counter at C = 2, must neither carry nor sign-extend).
    cfg = histogram.HistogramConfig(**_TILES[tile])
    t = tbe_jax.TableSpec(64, 64, bag_size_hint=64)
    emb = _emb([t], histogram_config=cfg)
    params = emb.init(jax.random.key(0))
    lengths = np.array([600, 256, 255, 3, 0, 300, 257, 1, 130, 600, 77])
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    fill = [63, 48, 0, 15, 1, 63, 47, 62, 16, 31, 5]
    idx = np.concatenate([np.full(n, v) for n, v in zip(lengths, fill)]).astype(np.int32)
    idx[off[9]:off[10]:7] = rng.integers(0, 64, len(idx[off[9]:off[10]:7]))  # bag 9 mixed
    plan = emb.plan_for(len(off))
    out, counts = histogram.histogram_forward(
        None, params, emb.layout, plan, [0], jnp.asarray(idx), jnp.asarray(off), pooling="sum",
        check_upper=False, interpret=KERNEL_KW["interpret"], config=cfg, save_counts=True)
    counts = np.asarray(counts)
    for r, (f, b) in enumerate(histogram.histogram_programs(plan, [0], cfg.bags)):
        if b >= 0:
            ids = idx[off[b] : off[b + 1]][: cfg.head]
            np.testing.assert_array_equal(counts[r], np.bincount(ids, minlength=64))
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [len(lengths)], idx, off, None, "sum", False)
    assert_close(np.asarray(out).reshape(model.shape), model, tolerance("float32", 600))


def test_config_errors():
    with pytest.raises(ValueError, match="bags=8 must be a power of 2 >= 16"):
        histogram.HistogramConfig(bags=8)
    with pytest.raises(ValueError, match="ids_per_step=512"):
        histogram.HistogramConfig(ids_per_step=512)
    with pytest.raises(ValueError, match="ids_per_step=1: a packed 8-bit counter would reach 256"):
        histogram.HistogramConfig(ids_per_step=1)
    with pytest.raises(ValueError, match="grad_ids_per_step=0"):
        histogram.HistogramConfig(grad_ids_per_step=0)
    assert histogram.HistogramConfig().resolved_ids_per_step() == 8  # [16, C, 16] at 2048 elements
    assert histogram.HistogramConfig(bags=64).resolved_ids_per_step() == 2  # and never below 2 (8-bit counters)
    assert histogram.HistogramConfig(bags=256).resolved_ids_per_step() == 2
    assert histogram.HistogramConfig(ids_per_step=32).resolved_ids_per_step() == 32
    with pytest.raises(ValueError, match="lookahead=-1"):
        histogram.HistogramConfig(lookahead=-1)
    # grad_programs: a value the caller set is kept; None derives it from the device's SMs (CPU: 2 "SMs").
    from tbe_jax.pallas_compat import sm_count
    assert histogram.HistogramConfig(grad_programs=7).resolved_grad_programs() == 7
    assert histogram.HistogramConfig().resolved_grad_programs() == 2 * sm_count()
    assert histogram.HistogramConfig().resolved_grad_programs(interpret=True) == 3
    assert histogram.HistogramConfig(grad_programs=7).resolved_grad_programs(interpret=True) == 7
    # The backward's persistent programs: the same rule (8192 / 4096 on a 132-SM GPU, scaled by SMs; 16 interpreted).
    cfg = tbe_jax.BackwardConfig()
    assert cfg.resolved_programs(True) == (16, 16)
    assert cfg.resolved_programs(False) == (round(8192 * sm_count() / 132), round(4096 * sm_count() / 132))
    assert tbe_jax.BackwardConfig(programs=5, small_programs=40).resolved_programs(True) == (5, 40)
    assert histogram.HistogramConfig(grad_programs_per_sm=3).resolved_grad_programs() == 3 * sm_count()
    if jax.default_backend() == "cpu":
        assert sm_count() == 2
    with pytest.raises(ValueError, match="grad_programs=0"):
        histogram.HistogramConfig(grad_programs=0)
    for removed in ("counting", "half_compare", "align"):  # experiments measured slower, removed
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{removed}'"):
            histogram.HistogramConfig(**{removed: 1})


# -- backward: counts^T x dout, then the optimizer -----------------------------------



def _touched(tables, fmap, batch, idx, off):
    hit = [np.zeros(t.num_embeddings, bool) for t in tables]
    for f, t in enumerate(fmap):
        ids = idx[off[f * batch] : off[(f + 1) * batch]]
        hit[t][ids[(ids >= 0) & (ids < tables[t].num_embeddings)]] = True
    return hit


# A histogram table shared by two features, a histogram table of E=1, a generic table
# and a table just outside the limits (E=65): the backward splits per table.
_BWD_TABLES = [tbe_jax.TableSpec(33, 100, bag_size_hint=64), tbe_jax.TableSpec(300, 64),
               tbe_jax.TableSpec(1, 64, bag_size_hint=200), tbe_jax.TableSpec(65, 64, bag_size_hint=64)]
_BWD_FMAP = [0, 1, 0, 2, 3]


# Each pooling and each optimizer once (the pooling acts in the gradient kernel, the optimizer in the update
# kernel: the other two pairings re-check the same paths).
@pytest.mark.parametrize("pooling,opt", [
    ("sum", tbe_jax.RowwiseAdagrad(0.05, 1e-3, initial_accumulator_value=0.25)),
    pytest.param("mean", tbe_jax.SGD(0.05), marks=pytest.mark.skipif(
        not ON_GPU, reason="compiled only; interpret mode covers mean pooling in the histogram gradient kernel in "
        "test_backward_gradient_is_fp32_accurate and test_backward.py::test_padded_rows_match_unpadded, the update "
        "kernel without optimizer slots in test_dense_grad (the true-gradient mode), SGD's rule in "
        "test_backward.py::test_update_matches_model[sgd-sum-w]"))],
    ids=["sum-adagrad", "mean-sgd"])
def test_backward_update_matches_model(rng, opt, pooling):
    tables, fmap, batch = _BWD_TABLES, _BWD_FMAP, 18
    emb = _emb(tables, feature_table_map=fmap, pooling=pooling)
    assert emb.plan() == ("histogram", "generic", "histogram", "histogram", "generic")
    ref = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, pooling=pooling, weights_dtype="float16",
                                        impl="xla")
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    state = emb.init_opt_state(params, opt)
    # Bag lengths 0..600: the backward counts them in rounds of 256.
    idx, off, _ = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], [batch] * 5, (0, 600))
    g = rng.standard_normal((batch, sum(emb.feature_dims))).astype(np.float32)
    step = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g))
    p1, s1 = step(params, state)
    p2, s2 = step(params, state)
    for a, b in zip(jax.tree_util.tree_leaves((p1, s1)), jax.tree_util.tree_leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise reproducible
    if pooling == "sum":  # tbe_jax.train_step (forward, dL/dout, this update) equals apply_gradients, bitwise
        train = jax.jit(lambda p, s: tbe_jax.train_step(lambda _, out: jnp.sum(out * g), None,
                                                        tbe_jax.SparseLookup(emb, opt, p, s, idx, off)))
        res = train(params, state)
        for a, b in zip(jax.tree_util.tree_leaves((res.params, res.opt_state)), jax.tree_util.tree_leaves((p1, s1))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref_p, ref_s = ref.apply_gradients(params, state, opt, idx, off, g)

    tabs = tables_f64(emb, params)
    adagrad = isinstance(opt, tbe_jax.RowwiseAdagrad)
    mom = [np.asarray(m, np.float64) for m in emb.get_momentum(state)] if adagrad else None
    grads, _ = testing.numpy_pooled_vjp(tabs, fmap, [batch] * 5, idx, off, None, g, pooling, False)
    hit = _touched(tables, fmap, batch, idx, off)
    want, want_m = model_step_f64(tabs, mom, hit, grads, opt)
    before = [np.asarray(t) for t in emb.get_tables(params)]
    for t, (got, w, r, was) in enumerate(zip(emb.get_tables(p1), want, emb.get_tables(ref_p), before)):
        assert_close(got, w, 2e-3)  # one fp16 rounding of the stored row
        assert_close(got, r, 2e-3)
        np.testing.assert_array_equal(np.asarray(got)[~hit[t]], was[~hit[t]])
        # No touched row may differ from the model by more than the fp16 rounding of its value.
        np.testing.assert_allclose(np.asarray(got, np.float64)[hit[t]], w[hit[t]], rtol=1e-3, atol=1e-3)
    if adagrad:
        for t, (got, w) in enumerate(zip(emb.get_momentum(s1), want_m)):
            assert_close(got, w, 1e-5)
            np.testing.assert_array_equal(np.asarray(got)[~hit[t]], np.asarray(emb.get_momentum(state)[t])[~hit[t]])


def test_backward_gradient_is_fp32_accurate(rng):
    # The kernels on an fp32 zero buffer store counts^T x dout unrounded: it must equal the
    # float64 gradient to fp32 rounding, with heavy duplicates (E=3, counts up to 1000 per bag)
    # and mixed-magnitude output gradients (the hi/mid/lo split).
    from tbe_jax.kernels import histogram_backward

    tables = [tbe_jax.TableSpec(3, 128, bag_size_hint=64), tbe_jax.TableSpec(64, 128, bag_size_hint=64)]
    emb = _emb(tables)
    batch = 20
    lengths = rng.integers(0, 1001, 2 * batch)
    lengths[[0, 5, 25]] = [0, 1000, 256]
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = np.concatenate([rng.integers(0, 3, off[batch]), rng.integers(0, 64, off[-1] - off[batch])]).astype(np.int32)
    g = (rng.standard_normal((batch, 256)) * 10.0 ** rng.integers(-3, 4, (batch, 256))).astype(np.float32)
    plan = emb.plan_for(len(off))
    zeros = {"d128": jnp.zeros((67, 128), jnp.float32)}
    for pooling in ("sum", "mean"):
        got, _ = histogram_backward.histogram_update(
            zeros, None, emb.layout, plan, [0, 1], jnp.asarray(idx), jnp.asarray(off), jnp.asarray(g), None,
            pooling=pooling, config=histogram.HistogramConfig(), interpret=KERNEL_KW["interpret"])
        want, _ = testing.numpy_pooled_vjp([np.zeros((3, 128)), np.zeros((64, 128))], [0, 1], [batch] * 2, idx, off,
                                           None, g, pooling, False)
        got = np.asarray(got["d128"], np.float64)
        for t, (lo, hi) in enumerate([(0, 3), (3, 67)]):
            np.testing.assert_allclose(got[lo:hi], want[t], rtol=2e-6, atol=2e-6 * np.abs(want[t]).max())


@pytest.mark.parametrize("cfg", [dict(grad_bags=32, grad_ids_per_step=16, grad_lookahead=0, update_partials=1),
                                 dict(grad_programs=1, grad_ids_per_step=4)],
                         ids=["tiles", "one_program"])
def test_backward_config_variants(rng, cfg):
    tables = [tbe_jax.TableSpec(20, 64, bag_size_hint=64)]
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-3)
    idx, off, _ = testing.make_batch(rng, [20], [40], (0, 300))
    g = rng.standard_normal((40, 64)).astype(np.float32)
    outs = []
    for hcfg in (histogram.HistogramConfig(), histogram.HistogramConfig(**cfg)):
        emb = _emb(tables, histogram_config=hcfg)
        params = emb.init(jax.random.key(2))
        p, s = emb.apply_gradients(params, emb.init_opt_state(params, opt), opt, idx, off, g)
        outs.append(jax.tree_util.tree_leaves((p, s)))
    for a, b in zip(*outs):
        assert_close(a, b, 1e-6)


def test_dense_grad(rng):
    # jax.grad's dense table gradient (histogram tables from counts^T x dout, the rest from the
    # sorted runs) equals jax.grad of the XLA reference. (tbe_jax.train_step equals apply_gradients on
    # these tables: test_backward_update_matches_model[sum-adagrad], which compiles the update anyway.)
    tables, fmap, batch = _BWD_TABLES, _BWD_FMAP, 10
    emb = _emb(tables, feature_table_map=fmap)
    ref = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, weights_dtype="float16", impl="xla")
    params = emb.init(jax.random.key(3))
    idx, off, _ = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], [batch] * 5, (0, 300))
    g = rng.standard_normal((batch, sum(emb.feature_dims))).astype(np.float32)

    def loss(e):
        return lambda p: jnp.sum(e(p, idx, off) * g)

    got = jax.jit(jax.grad(loss(emb)))(params)
    want = jax.jit(jax.grad(loss(ref)))(params)  # jitted: one compile, not one per op of the reference
    model, _ = testing.numpy_pooled_vjp(tables_f64(emb, params), fmap, [batch] * 5, idx, off, None, g, "sum", False)
    for a, b, m in zip(emb.get_tables(got), emb.get_tables(want), model):
        assert_close(a, m, 1e-3)  # the gradient is stored in fp16 (the table's dtype)
        assert_close(a, b, 1e-3)


def test_histogram_lookups_form_no_runs(rng):
    # The histogram features' lookups get the sentinel key: the sorted-run backward never sees
    # their tables; with only histogram features there are no runs at all.
    tables = [tbe_jax.TableSpec(16, 64, bag_size_hint=64), tbe_jax.TableSpec(100, 64)]
    emb = _emb(tables)
    idx, off, _ = testing.make_batch(rng, [16, 100], [6, 6], (1, 40))
    plan = emb.plan_for(len(off))
    runs = dispatch.sorted_runs(emb, plan, jnp.asarray(idx), jnp.asarray(off), None)
    n = int(runs.num_runs)
    keys = np.asarray(runs.run_key)[:n]
    assert np.all(keys >= 16) and n == len(np.unique(idx[off[6]:]))
    solo = _emb(tables[:1])
    assert dispatch.sorted_runs(solo, solo.plan_for(7), jnp.asarray(idx[: off[6]]), jnp.asarray(off[:7]), None) is None


# -- the backward over many tables: one grad and one update launch in all ---------------

# Histogram tables of E from 1 to 64 (rows_padded 16, 32, 64) and dims 64 and 128 (two buffers,
# four kernel classes), one of them read by three features (the most tiles: two partial slots in
# interpret mode, the others one), plus a generic table in the d64 buffer.
_MANY_TABLES = [tbe_jax.TableSpec(5, 64, bag_size_hint=64), tbe_jax.TableSpec(20, 128, bag_size_hint=64),
                tbe_jax.TableSpec(300, 64), tbe_jax.TableSpec(33, 64, bag_size_hint=100),
                tbe_jax.TableSpec(64, 128, bag_size_hint=64), tbe_jax.TableSpec(1, 64, bag_size_hint=64)]
_MANY_FMAP = [0, 1, 2, 3, 1, 4, 1, 5]


def test_backward_many_tables_matches_xla(rng):
    tables, fmap, batch = _MANY_TABLES, _MANY_FMAP, 20
    emb = _emb(tables, feature_table_map=fmap)
    assert emb.plan() == ("histogram", "histogram", "generic") + ("histogram",) * 5
    ref = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, weights_dtype="float16", impl="xla")
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-3, initial_accumulator_value=0.25)
    params = emb.init(jax.random.key(7))
    state = emb.init_opt_state(params, opt)
    idx, off, _ = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], [batch] * len(fmap), (0, 300))
    hit = _touched(tables, fmap, batch, idx, off)
    step = jax.jit(lambda e, p, s, g: e.apply_gradients(p, s, opt, idx, off, g), static_argnums=0)
    got, want = (params, state), (params, state)
    for _ in range(3):  # the same ids, a new output gradient each step
        g = rng.standard_normal((batch, sum(emb.feature_dims))).astype(np.float32)
        got, want = step(emb, *got, g), step(ref, *want, g)
        for t, (a, b, was) in enumerate(zip(emb.get_tables(got[0]), emb.get_tables(want[0]),
                                            emb.get_tables(params))):
            assert_close(a, b, 3e-3)  # fp16 rounding of the stored rows, step after step
            np.testing.assert_array_equal(np.asarray(a)[~hit[t]], np.asarray(was)[~hit[t]])
        for t, (a, b) in enumerate(zip(emb.get_momentum(got[1]), emb.get_momentum(want[1]))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
            assert np.all(np.asarray(a)[~hit[t]] == 0.25)


def _step_custom_calls(num_tables: int) -> dict:
    """Kernel launches (custom calls by name) in an apply_gradients step lowered for CUDA, on this machine."""
    import re

    tables = [tbe_jax.TableSpec(1 + (7 * i) % 64, (64, 128)[i % 2], bag_size_hint=64) for i in range(num_tables)]
    tables.append(tbe_jax.TableSpec(500, 64))
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, impl="pallas")
    emb.uses_kernel = lambda: True  # the kernel path, lowered for CUDA (not compiled, not run)
    assert emb.plan() == ("histogram",) * num_tables + ("generic",)
    batch, n = 64, emb.num_features
    params = {emb.layout.key(g): jax.ShapeDtypeStruct((emb.layout.group_rows[g], d), jnp.float16)
              for g, d in enumerate(emb.layout.dims)}
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01)
    state = jax.eval_shape(lambda p: emb.init_opt_state(p, opt), params)
    args = (params, state, opt, jax.ShapeDtypeStruct((n * batch * 8,), jnp.int32),
            jax.ShapeDtypeStruct((n * batch + 1,), jnp.int32),
            jax.ShapeDtypeStruct((batch, sum(emb.feature_dims)), jnp.float32))
    text = jax.jit(lambda p, s, o, i, off, g: emb.apply_gradients(p, s, o, i, off, g)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if re.search(r"stablehlo\.custom_call", line)]
    return {name: sum(name in line for line in calls) for name in ("tbe_histogram_grad", "tbe_histogram_update")}


def test_backward_launches_do_not_grow_with_tables():
    # Two sizes suffice (each lowering costs seconds): 40 tables hold the 2-table model's and every E and D class.
    counts = {n: _step_custom_calls(n) for n in (2, 40)}
    assert counts[2] == counts[40] == {"tbe_histogram_grad": 1, "tbe_histogram_update": 1}, counts
