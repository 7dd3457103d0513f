"""Sorted-run backward with the sparse optimizer (apply_gradients, and tbe_jax.train_step around it).

Kernels run compiled on a GPU and in interpret mode on CPU (conftest.KERNEL_KW);
both are checked against the jnp reference and a float64 NumPy model.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import runs as runs_lib
from tbe_jax import dispatch, testing
from conftest import KERNEL_KW, ON_GPU, assert_close, assert_runs_equal, model_step_f64, specs, tables_f64

CFG = tbe_jax.BackwardConfig()  # the defaults: run classes, segments, block sizes
XLA_RUNS = tbe_jax.BackwardConfig(rle_kernel=False, rank_sort_max=0, narrow_sort_keys=False)  # build_runs in XLA ops




def _touched(fmap, num_rows, batch, idx, off):
    hit = [np.zeros(e, bool) for e in num_rows]
    base = 0
    for f, t in enumerate(fmap):
        lo, hi = off[base], off[base + batch[f]]
        ids = idx[lo:hi]
        hit[t][ids[(ids >= 0) & (ids < num_rows[t])]] = True
        base += batch[f]
    return hit


def _same_shape_batch(rng, num_rows, batch, off, weighted):
    """A fresh batch shaped like the one of offsets `off`: new ids (and weights), each feature's bag
    lengths shuffled among its bags. The same N keeps the jitted step to one compile per test."""
    lengths, ids, base = [], [], 0
    for e, b in zip(num_rows, batch):
        ln = rng.permutation(np.diff(off[base : base + b + 1]))
        lengths.append(ln)
        ids.append(rng.integers(0, e, int(ln.sum())))
        base += b
    new_off = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)
    idx = np.concatenate(ids).astype(np.int32)
    psw = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32) if weighted else None
    return idx, new_off, psw


def _check_step(rng, tables, fmap, batch, bag_len, opt, *, pooling="sum", wdtype="float32", weighted=False,
                vbe=False, steps=2, empty_bag=False, pad_rows=True, backward_config=None):
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype,
                                        pad_rows=pad_rows, backward_config=backward_config, **KERNEL_KW)
    ref = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype,
                                        impl="xla", pad_rows=pad_rows)
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    state = emb.init_opt_state(params, opt)
    ref_params, ref_state = params, state
    num_rows = [t.num_embeddings for t in tables]
    tabs = tables_f64(emb, params)
    adagrad = isinstance(opt, tbe_jax.RowwiseAdagrad)
    mom = [np.asarray(m, np.float64) for m in emb.get_momentum(state)] if adagrad else None
    bpf = tuple(batch) if vbe else None
    step = jax.jit(lambda p, s, i, o, g, w: emb.apply_gradients(p, s, opt, i, o, g, w, batch_size_per_feature=bpf))
    for k in range(steps):
        if k == 0:
            idx, off, psw = testing.make_batch(rng, [num_rows[t] for t in fmap], batch, bag_len, weighted=weighted)
        else:
            idx, off, psw = _same_shape_batch(rng, [num_rows[t] for t in fmap], batch, off, weighted)
        if empty_bag:  # the first bag gives its lookups to the second
            off[1] = off[0]
        out_shape = jax.eval_shape(lambda p: ref(p, idx, off, psw, batch_size_per_feature=bpf), params).shape
        g = rng.standard_normal(out_shape).astype(np.float32)
        before = [np.asarray(t) for t in emb.get_tables(params)]
        params, state = step(params, state, idx, off, g, psw)
        ref_params, ref_state = ref.apply_gradients(ref_params, ref_state, opt, idx, off, g, psw,
                                                    batch_size_per_feature=bpf)
        if pooling == "none":
            grads = [np.zeros_like(t) for t in tabs]
            feat = np.searchsorted(off[np.cumsum([0] + list(batch))], np.arange(len(idx)), side="right") - 1
            for p in range(len(idx)):
                s = 1.0 if psw is None else psw[p]
                grads[fmap[feat[p]]][idx[p]] += s * g[p]
        else:
            grads, _ = testing.numpy_pooled_vjp(tabs, fmap, batch, idx, off, psw, g, pooling, vbe)
        hit = _touched(fmap, num_rows, batch, idx, off)
        tabs, mom = model_step_f64(tabs, mom, hit, grads, opt)
    # fp16/bf16 tables are rounded on every store; the model is not: a few ulp apart after 2 steps.
    tol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}[wdtype]
    for got, want, got_ref in zip(emb.get_tables(params), tabs, emb.get_tables(ref_params)):
        assert_close(got, want, tol)
        assert_close(got_ref, want, tol)
    if mom is not None:
        for got, want in zip(emb.get_momentum(state), mom):
            assert_close(got, want, 1e-5)
    return emb, params, state, hit, before


# Each optimizer with the weighted bags (the pooling/weighting gradient path is shared by every update rule and
# runs with each rule elsewhere: row-wise Adagrad, sum, unweighted in test_untouched_rows_bitwise_unchanged; SGD,
# mean, unweighted in test_train_step_equals_apply_gradients[sgd-kernel] and test_one_row_hit_by_every_lookup;
# the other pairs with the other optimizers in test_optimizers.py, on these tables and batch).
@pytest.mark.parametrize("opt,pooling,weighted", [
    (tbe_jax.RowwiseAdagrad(0.05, 1e-3), "mean", True), (tbe_jax.SGD(0.05), "sum", True)],
    ids=["adagrad-mean-w", "sgd-sum-w"])
def test_update_matches_model(rng, opt, pooling, weighted):
    tables = specs([17, 6, 40], [5, 16, 16])  # E=6: many repeats; two buffers (d5, d16)
    _check_step(rng, tables, [0, 1, 2, 1], [4] * 4, (0, 12), opt, pooling=pooling, weighted=weighted)


def test_many_dims_width_classes(rng):
    # Six dims in three width classes, two of them holding several buffers ({4, 3}: two segments of
    # one row parity each; {40, 64, 48}: one segment): a segment is one launch per kernel kind whose
    # gather is masked per run to its dim and whose row update branches per buffer; small-run blocks
    # span buffers of a segment. Small E
    # (repeats), mid runs (d40, d48, d3), long runs of >= 256 lookups (d64, 2 rows), a table read by
    # two features, weighted mean pooling and an empty bag. Kept small: interpret mode is slow.
    tables = specs([5, 4, 2, 4, 5, 3], [4, 40, 64, 3, 48, 8])
    fmap = [0, 1, 2, 3, 4, 5, 1]
    bag_len = [(0, 6), (10, 30), (300, 400), (12, 24), (10, 30), (0, 6), (0, 6)]
    _check_step(rng, tables, fmap, [2] * len(fmap), bag_len, tbe_jax.RowwiseAdagrad(0.05, 1e-3), pooling="mean",
                weighted=True, steps=1, empty_bag=True)


def test_width_class_split_into_segments(rng):
    # Ten odd dims of one width class (33..51 -> 64) and one of another, stored unpadded: the class is
    # served by two segments (8 + 2 buffers, BackwardConfig.segment_buffers) of the same launches, next to a
    # third segment; small-run blocks straddle buffers (E 3-4), a mid run (E 1) and an empty bag.
    from tbe_jax.kernels import backward as bwd

    dims = list(range(33, 53, 2)) + [8]
    tables = specs([3, 4, 3, 4, 3, 4, 3, 4, 1, 3, 4], dims)
    layout = tbe_jax.TableBatchedEmbedding(tables, pad_rows=False).layout
    assert [len(s.buffers) for s in bwd.run_segments(layout, CFG)] == [1, CFG.segment_buffers, 2]
    # Padded (the default), the fp32 rows of 33..51 are stored 36..52 wide: parity 8 (40, 48) and 4.
    layout = tbe_jax.TableBatchedEmbedding(tables).layout
    assert layout.strides == (36, 36, 40, 40, 44, 44, 48, 48, 52, 52, 8)
    assert [len(s.buffers) for s in bwd.run_segments(layout, CFG)] == [1, 4, 6]
    fmap = list(range(len(dims)))
    _check_step(rng, tables, fmap, [2] * len(fmap), (0, 8), tbe_jax.RowwiseAdagrad(0.05, 1e-3), steps=1,
                empty_bag=True, pad_rows=False)


def test_width_class_split_by_row_parity(rng):
    # One width class (w64) holding dims of three row parities (runs.row_parity: 8 for 40/48/64, 4 for
    # 36/44, 2 for 34): one segment per parity, each of equally aligned rows, in key order; the keys of a
    # parity are contiguous (width_classes orders them), so blocks and tasks stay within a segment's range.
    from tbe_jax import runs as runs_mod
    from tbe_jax.kernels import backward as bwd

    dims = [40, 36, 48, 44, 34, 64]
    tables = specs([4, 3, 4, 3, 4, 1], dims)
    layout = tbe_jax.TableBatchedEmbedding(tables, pad_rows=False).layout
    segs = bwd.run_segments(layout, CFG)
    assert [seg.dims for seg in segs] == [(40, 48, 64), (36, 44), (34,)]
    assert all(len({runs_mod.row_parity(d) for d in seg.dims}) == 1 for seg in segs)
    assert [seg.bases[0] for seg in segs] == sorted(seg.bases[0] for seg in segs)
    _check_step(rng, tables, list(range(len(dims))), [2] * len(dims), (0, 8), tbe_jax.RowwiseAdagrad(0.05, 1e-3),
                steps=1, empty_bag=True, pad_rows=False)


def test_narrow_segments_share_a_launch(rng):
    # Seven dims of widths 8, 16 and 32 in five segments (w16 and w32 each split by row parity, the w32 ones holding
    # two buffers each), next to a w64 table: the narrow five are one small-run launch (BackwardConfig.merge_width), its
    # programs split between them by program id, and small E gives runs of every kind in each.
    from tbe_jax.kernels import backward as bwd

    dims = [6, 12, 16, 20, 24, 28, 32, 40]
    tables = specs([3, 4, 3, 4, 3, 1, 4, 3], dims)
    segs = bwd.run_segments(tbe_jax.TableBatchedEmbedding(tables).layout, CFG)
    assert [seg.dims for seg in segs] == [(6,), (16,), (12,), (24, 32), (20, 28), (40,)]
    assert [len(g) for g in bwd.small_launches(segs, tbe_jax.BackwardConfig().merge_width)] == [5, 1]
    _check_step(rng, tables, list(range(len(dims))), [2] * len(dims), (0, 12), tbe_jax.RowwiseAdagrad(0.05, 1e-3),
                steps=1, empty_bag=True)


def test_segments_cover_the_key_space_in_order():
    # For random dim mixes: every buffer in exactly one segment; a segment holds one width class and one row
    # parity, at most `segment_buffers` buffers, whose keys are contiguous; segments follow each other in key order.
    from tbe_jax import runs as runs_mod
    from tbe_jax.kernels import backward as bwd
    from tbe_jax.specs import next_pow2

    gen = np.random.default_rng(7)
    for _ in range(20):
        dims = sorted(set(int(d) for d in gen.integers(1, 300, gen.integers(1, 40))))
        gen.shuffle(dims)
        layout = tbe_jax.TableBatchedEmbedding(specs([3] * len(dims), dims),
                                               weights_dtype=("float32", "float16")[gen.integers(2)]).layout
        segs = bwd.run_segments(layout, CFG)
        assert sorted(g for seg in segs for g in seg.buffers) == list(range(len(dims)))
        key = 0
        for seg in segs:
            assert len(seg.buffers) <= CFG.segment_buffers
            assert {next_pow2(d) for d in seg.dims} == {seg.width}
            assert len({runs_mod.row_parity(d) for d in seg.strides}) == 1
            for base, end in zip(seg.bases, seg.ends):
                assert base == key
                key = end
        assert key == int(runs_mod.group_bases(layout)[-1])


def test_padded_rows_layout_and_round_trip():
    # fp16 dims 4 mod 8 from 36 up, and odd fp32 dims from 25 up, are stored padded to 16 bytes (at most
    # 1/8 more memory); smaller such dims are not. The padding is invisible through the per-table API.
    from tbe_jax.specs import padded_dim

    assert [padded_dim(d, 2) for d in (4, 12, 20, 28, 36, 44, 68, 124, 37, 128)] == [
        4, 12, 20, 28, 40, 48, 72, 128, 40, 128]
    assert [padded_dim(d, 4) for d in (6, 17, 25, 33, 34, 36, 127)] == [6, 17, 28, 36, 36, 36, 128]
    tables = specs([30, 20, 10, 9], [36, 12, 68, 36])
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype="float16", **KERNEL_KW)
    flat = tbe_jax.TableBatchedEmbedding(tables, weights_dtype="float16", pad_rows=False, **KERNEL_KW)
    assert emb.layout.strides == (40, 12, 72) and flat.layout.strides == flat.layout.dims == (36, 12, 68)
    assert emb != flat
    params = emb.init(jax.random.key(3))
    assert {k: v.shape for k, v in params.items()} == {"d36": (39, 40), "d12": (20, 12), "d68": (10, 72)}
    assert not np.asarray(params["d36"][:, 36:]).any() and not np.asarray(params["d68"][:, 68:]).any()
    # The same draw as unpadded storage, and the same tables back.
    for a, b in zip(emb.get_tables(params), flat.get_tables(flat.init(jax.random.key(3)))):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = emb.set_tables(None, emb.get_tables(params))
    for k in params:
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(params[k]))
    with pytest.raises(ValueError, match=r"float16\[39, 40\].*stored padded to 40.*pad_rows=False"):
        emb.apply_gradients(flat.init(jax.random.key(0)), None, tbe_jax.SGD(0.1), jnp.zeros(4, jnp.int32),
                            jnp.zeros(5, jnp.int32), jnp.zeros((1, 152)))


@pytest.mark.parametrize("make_opt,check_grad", [
    (lambda: tbe_jax.RowwiseAdagrad(0.05, 1e-3), True),
    (lambda: tbe_jax.Adam(0.05, weight_decay=0.01), False),
    (lambda: tbe_jax.Adagrad(0.2, initial_accumulator_value=0.1), False)], ids=["rowwise", "adam", "adagrad"])
def test_padded_rows_match_unpadded(rng, make_opt, check_grad, request):
    # Padded fp16 buffers (36 -> 40, 68 -> 72, 124 -> 128) next to unpadded ones (12, 64), several buffers per
    # segment, mean pooling and duplicates (the E <= 64 tables of D 64..128 take the histogram kernels, the others
    # the sorted runs): the kernels' forward, gradient (`jax.grad`, once: it does not depend on the optimizer) and
    # fused step on padded storage equal the XLA reference on unpadded storage, for row-wise and element-wise
    # optimizer state (Adagrad's accumulators start non-zero, in the padding too), and the padding stays zero.
    # SGD's rule is the others' without state (test_optimizers.py covers it on every path).
    if not ON_GPU and "adagrad" in request.node.name and "rowwise" not in request.node.name:
        # ~40 s in interpret mode; Adam's variant covers the padded element-wise state there (two slots, the
        # same kernel code per slot), and this one runs compiled.
        pytest.skip("Adagrad's variant: compiled only (interpret mode: Adam's covers element-wise state)")
    opt = make_opt()
    dims = [36, 12, 68, 124, 64, 36, 76]
    tables = specs([7, 9, 5, 6, 8, 3, 4], dims)
    fmap = [0, 1, 2, 3, 4, 5, 6, 0]
    kw = dict(feature_table_map=fmap, weights_dtype="float16", pooling="mean")
    emb = tbe_jax.TableBatchedEmbedding(tables, **kw, **KERNEL_KW)
    ref = tbe_jax.TableBatchedEmbedding(tables, **kw, impl="xla", pad_rows=False)
    assert emb.layout.padded and not ref.layout.padded
    params = emb.init(jax.random.key(1))
    ref_params = ref.set_tables(None, emb.get_tables(params))
    state, ref_state = emb.init_opt_state(params, opt), ref.init_opt_state(ref_params, opt)
    num_rows = [tables[t].num_embeddings for t in fmap]
    step = jax.jit(lambda p, s, i, o, g: emb.apply_gradients(p, s, opt, i, o, g))
    for k in range(2):  # one shape for both batches (padded): one compilation of each program
        idx, off, _ = testing.make_batch(rng, num_rows, [3] * len(fmap), (0, 9), pad_to=3 * 9 * len(fmap))
        out = emb(params, idx, off)
        want = ref(ref_params, idx, off)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
        g = rng.standard_normal(out.shape).astype(np.float32)
        if k == 0 and check_grad:  # jax.grad: the true gradient, padded like the params (zero padding)
            # Jitted: one program each instead of one per operation (interpret mode's cost is compilation).
            dense = jax.jit(jax.grad(lambda p: jnp.vdot(emb(p, idx, off), g)))(params)
            want_dense = jax.jit(jax.grad(lambda p: jnp.vdot(ref(p, idx, off), g)))(ref_params)
            assert {k2: v.shape for k2, v in dense.items()} == {k2: v.shape for k2, v in params.items()}
            for gi in range(len(emb.layout.dims)):
                key = emb.layout.key(gi)
                got = np.asarray(dense[key], np.float32)
                assert not got[:, emb.layout.dims[gi]:].any()
                np.testing.assert_allclose(got[:, : emb.layout.dims[gi]], np.asarray(want_dense[key], np.float32),
                                           rtol=2e-3, atol=1e-3)
        params, state = step(params, state, idx, off, g)
        ref_params, ref_state = ref.apply_gradients(ref_params, ref_state, opt, idx, off, g)
    for got, want in zip(emb.get_tables(params), ref.get_tables(ref_params)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-3, atol=2e-3)
    for name in (f for f in state._fields if f != "count"):
        for got, want in zip(emb.get_state(state, name), ref.get_state(ref_state, name)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    for gi in range(len(emb.layout.dims)):
        key, d = emb.layout.key(gi), emb.layout.dims[gi]
        assert not np.asarray(params[key][:, d:]).any(), key


# bfloat16 tables with row-wise Adagrad on these tables and batch: test_optimizers.py::test_low_precision_tables
# [rowwise-l2-bfloat16] (and every optimizer family member on fp16/bf16 there).
@pytest.mark.parametrize("wdtype", ["float16"])
def test_low_precision_tables(rng, wdtype):
    tables = specs([20, 30], [8, 24])
    _check_step(rng, tables, [0, 1], [5, 5], (0, 10), tbe_jax.RowwiseAdagrad(0.1, 0.1), wdtype=wdtype)


def test_long_runs_split_into_chunks(rng):
    # Rows hit hundreds of times (runs >= 256 lookups, up to 3 chunks) next to short runs and mid runs; the chunk
    # tasks found by the kernel (backward.chunk_task) in the mid runs' launch.
    tables = specs([3, 500], [8, 8])
    _check_step(rng, tables, [0, 1], [3, 3], (200, 300), tbe_jax.RowwiseAdagrad(0.05, 1e-2), steps=1)


def test_vbe_and_sequence(rng):
    tables = specs([20, 30], [8, 8])
    opt = tbe_jax.RowwiseAdagrad(0.1, 1e-3, initial_accumulator_value=0.5)
    _check_step(rng, tables, [0, 1], [3, 6], (0, 7), opt, vbe=True, weighted=True)
    _check_step(rng, tables, [0, 1], [3, 3], (0, 7), opt, pooling="none", weighted=True)


def test_untouched_rows_bitwise_unchanged(rng):
    tables = specs([100, 50], [16, 8])
    emb, params, state, hit, before = _check_step(
        rng, tables, [0, 1], [3, 3], (1, 4), tbe_jax.RowwiseAdagrad(0.1, 1e-3), steps=1)
    for t, (got, was) in enumerate(zip(emb.get_tables(params), before)):
        np.testing.assert_array_equal(np.asarray(got)[~hit[t]], was[~hit[t]])
        assert not np.array_equal(np.asarray(got)[hit[t]], was[hit[t]])
    for t, m in enumerate(emb.get_momentum(state)):
        assert np.all(np.asarray(m)[~hit[t]] == 0.0) and np.all(np.asarray(m)[hit[t]] > 0.0)


def test_invalid_ids_are_skipped(rng):
    tables = specs([10, 10], [8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, bounds_check="warning", **KERNEL_KW)
    ref = tbe_jax.TableBatchedEmbedding(tables, bounds_check="warning", impl="xla")
    params = emb.init(jax.random.key(0))
    opt = tbe_jax.SGD(0.1)
    idx = np.array([1, 12, -1, 3, 9, -4], np.int32)
    off = np.array([0, 3, 3, 5, 6], np.int32)
    g = rng.standard_normal((2, 16)).astype(np.float32)
    got, _ = emb.apply_gradients(params, opt.init(params), opt, idx, off, g)
    want, _ = ref.apply_gradients(params, opt.init(params), opt, idx, off, g)
    for a, b in zip(emb.get_tables(got), emb.get_tables(want)):
        assert_close(a, b, 1e-6)


def test_runs_preprocessing(rng):
    tables = specs([7, 700], [4, 4])
    emb = tbe_jax.TableBatchedEmbedding(tables)
    idx, off, _ = testing.make_batch(rng, [7, 700], [6, 6], (0, 120))
    idx[5] = -1
    plan = emb.plan_for(len(off))
    # Jitted: one compile instead of one per jnp op (build_runs is jittable by design).
    r = jax.jit(functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="sum", config=XLA_RUNS))(
        jnp.asarray(idx), jnp.asarray(off), None)
    f = np.repeat([0, 1], [off[6] - off[0], off[12] - off[6]])
    keys = np.where(idx >= 0, idx + np.where(f == 1, 7, 0), -1)
    uniq, counts = np.unique(keys[keys >= 0], return_counts=True)
    nr = int(r.num_runs)
    assert nr == len(uniq)
    np.testing.assert_array_equal(np.asarray(r.run_key)[:nr], uniq)
    np.testing.assert_array_equal(np.diff(np.asarray(r.run_start)[: nr + 1]), counts)
    n_small, n_mid, n_long, n_chunks = (int(c) for c in r.counts)
    small, lg = CFG.small_run_max, CFG.long_run
    assert n_small == np.sum(counts <= small) and n_long == np.sum(counts >= lg)
    assert n_mid == np.sum((counts > small) & (counts < lg))
    assert n_chunks == np.sum(-(-counts[counts >= lg] // lg))


@pytest.mark.parametrize("split", [0, 64])
def test_chunk_tasks(rng, split):
    # The long runs' chunk tasks (`long_run` lookups each, the last one partial), in key order: for each task its long
    # run and its first sorted lookup; against NumPy on rows hit ~100 to ~700 times, next to short runs. With
    # `split_chunk` 64, runs of 128 to 255 lookups are chunked too, in chunks of 64.
    tables = specs([3, 8, 700], [4, 4, 4])
    emb = tbe_jax.TableBatchedEmbedding(tables)
    idx, off, _ = testing.make_batch(rng, [3, 8, 700], [6, 6, 6], (100, 300))
    plan = emb.plan_for(len(off))
    cfg = dataclasses.replace(XLA_RUNS, split_chunk=split)
    r = jax.jit(functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="sum", config=cfg))(
        jnp.asarray(idx), jnp.asarray(off), None)
    nr, n_long, total = int(r.num_runs), int(r.counts[2]), int(r.counts[3])
    run_start, long = np.asarray(r.run_start), np.asarray(r.long)
    lengths = np.diff(run_start[: nr + 1])
    lg = CFG.long_run
    want_long = np.flatnonzero(lengths >= (2 * split if split else lg))
    assert n_long == len(want_long) > 0 and np.any(lengths[want_long] > lg)
    if split:
        assert np.any((lengths >= 2 * split) & (lengths < lg))  # runs chunked only with split_chunk
    size = np.where(lengths >= lg, lg, split or lg)
    np.testing.assert_array_equal(long[:n_long], want_long)
    want_run, want_first = [], []
    for li, run in enumerate(want_long):
        for c in range(-(-lengths[run] // size[run])):
            want_run.append(li)
            want_first.append(run_start[run] + c * size[run])
    assert total == len(want_run)
    np.testing.assert_array_equal(np.asarray(r.long_chunk0)[: n_long + 1],
                                  np.concatenate([[0], np.cumsum(-(-lengths[want_long] // size[want_long]))]))
    n = len(idx)
    # The XLA ops (runs.chunk_tasks: backward.task_ranges without the run-length pass's edges) ...
    chunk_run, chunk_first = jax.jit(functools.partial(runs_lib.chunk_tasks, n=n, long_run=lg, split_chunk=split))(
        r.run_start, r.long, r.long_chunk0)
    np.testing.assert_array_equal(np.asarray(chunk_run)[:total], want_run)
    np.testing.assert_array_equal(np.asarray(chunk_first)[:total], want_first)
    # ... and the chunk kernel's binary search (backward.chunk_task), run over every task.
    from tbe_jax.pallas_compat import pallas_call, plgpu
    from tbe_jax.kernels import backward as bwd

    def kernel(chunk0_ref, long_ref, start_ref, run_ref, first_ref):
        def one(t, c):
            li, first = bwd.chunk_task(chunk0_ref, long_ref, start_ref, t, chunk0_ref.shape[0], lg, split)
            plgpu.store(run_ref.at[t], li)
            plgpu.store(first_ref.at[t], first)
            return c

        jax.lax.fori_loop(0, total, one, 0)

    got_run, got_first = pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((total,), jnp.int32)] * 2, grid=(1,), interpret=True,
    )(r.long_chunk0, r.long, r.run_start)
    np.testing.assert_array_equal(np.asarray(got_run), want_long[want_run])
    np.testing.assert_array_equal(np.asarray(got_first), want_first)


@pytest.mark.parametrize("fill", [True, False], ids=["fill", "no_fill"])
def test_task_ranges_from_rle_edges(rng, fill):
    # The segments' task ranges from the run-length pass's edges (rle.encode(bounds=...)) equal the XLA
    # compare-and-count over the run and task lists: seven segments (widths 8 to 256, two parities in w64), small
    # E so every segment has mid and long runs (rows hit 256+ times: chunk tasks), and a table no lookup reads.
    # Without `rle_fill` the lists' slots past their counts are undefined: the count masks them itself.
    from tbe_jax.kernels import backward as bwd

    cfg = dataclasses.replace(CFG, rle_fill=fill)

    dims = [4, 8, 36, 40, 100, 250, 64, 12]
    tables = specs([2, 3, 2, 40, 3, 2, 5, 9], dims)
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=[0, 1, 2, 3, 4, 5, 6], pad_rows=False,
                                        backward_config=cfg, **KERNEL_KW)
    assert len(bwd.run_segments(emb.layout, cfg)) == 7
    idx, off, _ = testing.make_batch(rng, [2, 3, 2, 40, 3, 2, 5], [4] * 7, (100, 300))
    plan = emb.plan_for(len(off))
    r = jax.jit(lambda i, o: dispatch.sorted_runs(emb, plan, i, o, None))(jnp.asarray(idx), jnp.asarray(off))
    assert r.seg_edges is not None and r.seg_edges.shape == (6, 3) and int(r.counts[2]) > 0
    n = len(idx)
    got = np.asarray(bwd.task_ranges(r, emb.layout, n, cfg))  # the table `build_runs` made (rle.long_chunks)
    edges = np.asarray(bwd.task_ranges(r._replace(ranges=None), emb.layout, n, cfg))
    want = np.asarray(bwd.task_ranges(r._replace(seg_edges=None, ranges=None), emb.layout, n, cfg))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(edges, want)
    assert got[:, 1].max() == int(r.num_runs) and (got[:, 4:6] > got[:, 4:6].min()).any()


def _sorted_keys(rng, lengths, n_invalid, total):
    """Sorted keys with runs of the given lengths (distinct random rows) and an invalid tail."""
    rows = np.sort(rng.choice(total, size=len(lengths), replace=False))
    return np.concatenate([np.repeat(rows, lengths), np.full(n_invalid, total)]).astype(np.int32)


@pytest.mark.parametrize("fill", [True, False], ids=["fill", "no_fill"])
@pytest.mark.parametrize("case", ["boundaries", "one_row", "all_invalid", "block_multiple", "random"])
def test_rle_kernel_matches_xla_ops(rng, case, fill):
    """kernels.rle.encode against the XLA ops of build_runs and a NumPy model: runs of
    length 1, S, S + 1, L - 1, L, L + 1 (`small_run_max`, `long_run`), runs across the kernel's
    block boundary, a single row hit by every lookup, no valid lookup, N a multiple of
    the block (run_start[N] written by the extra program). Without `fill`, the slots up to each count (and
    run_start[num_runs], the last run's end) are those of the filled form."""
    from tbe_jax.kernels import rle

    total = 5000
    s, lg, block = CFG.small_run_max, CFG.long_run, CFG.rle_block
    if case == "boundaries":
        skey = _sorted_keys(rng, [1, s, s + 1, lg - 1, lg, lg + 1, 1, 700, 2, 1, s + 1], 37, total)
    elif case == "one_row":
        skey = _sorted_keys(rng, [3000], 0, total)
    elif case == "all_invalid":
        skey = np.full(300, total, np.int32)
    elif case == "block_multiple":
        lengths = rng.integers(1, 20, size=400)
        skey = _sorted_keys(rng, lengths, 0, total)[: 2 * block]
        skey = np.concatenate([skey, np.full(2 * block - len(skey), total, np.int32)])
    else:
        lengths = rng.geometric(0.05, size=150)
        skey = _sorted_keys(rng, lengths, int(rng.integers(0, 50)), total)
    n = len(skey)
    n_big_max = n // (s + 1) + 1
    # NumPy model
    valid = skey < total
    starts = np.flatnonzero(valid & np.concatenate([[True], skey[1:] != skey[:-1]]))
    nv = int(valid.sum())
    lens = np.diff(np.append(starts, nv))
    want_start = np.full(n + 1, nv)
    want_start[: len(starts)] = starts
    want_key = np.full(n, total)
    want_key[: len(starts)] = skey[starts]
    # The mid (S < length < L) and long (>= L) lists straight from the write pass; with `bounds`, the runs
    # of each kind below each bound: bounds below every key, at a run's key, inside the gap between two runs, at the
    # run crossing the block boundary, past the last valid key, and `total`.
    n_long_max = n // lg + 1
    keys = skey[starts]
    cands = [1, total, int(rng.integers(1, total))]
    if len(keys):
        cands += [int(keys[0]), int(keys[-1]) + 1, int(keys[len(keys) // 2]), int(keys[len(keys) // 2]) + 1]
        cross = skey[min(block, n - 1)]
        cands += [int(cross)] if cross < total else []
    bounds = tuple(sorted({b for b in cands if 0 < b <= total}))
    run_start, run_key, num_runs, n_valid, mid, n_mid, long, n_long, edges = jax.jit(functools.partial(
        rle.encode, total=total, small=s, n_big_max=n_big_max, long=lg, n_long_max=n_long_max, bounds=bounds,
        block=block, scan_chunk=CFG.scan_chunk, fill=fill, interpret=KERNEL_KW["interpret"]))(jnp.asarray(skey))
    kinds = [np.ones(len(keys), bool), (lens > s) & (lens < lg), lens >= lg]
    want_edges = [[int(np.sum(kind & (keys < b))) for kind in kinds] for b in bounds]
    np.testing.assert_array_equal(np.asarray(edges).reshape(len(bounds), 3), want_edges)
    ends = (None, None) if fill else (len(starts) + 1, len(starts))  # the defined prefixes without `fill`
    np.testing.assert_array_equal(np.asarray(run_start)[: ends[0]], want_start[: ends[0]])
    np.testing.assert_array_equal(np.asarray(run_key)[: ends[1]], want_key[: ends[1]])
    assert int(num_runs) == len(starts) and int(n_valid) == nv
    for got, count, want_runs, size in ((mid, n_mid, np.flatnonzero((lens > s) & (lens < lg)), n_big_max),
                                        (long, n_long, np.flatnonzero(lens >= lg), n_long_max)):
        want = np.full(size, n)
        want[: len(want_runs)] = want_runs
        assert int(count) == len(want_runs)
        m = None if fill else len(want_runs)
        np.testing.assert_array_equal(np.asarray(got)[:m], want[:m])


@pytest.mark.parametrize("dtype,total", [("uint8", 255), ("uint8", 97), ("uint16", 65535), ("uint16", 300)])
def test_rle_kernel_reads_narrow_keys(rng, dtype, total):
    """kernels.rle.encode on the narrow keys of XLA's sort (`runs.sort_key_dtype`, read and zero-extended in the
    kernels: no widening pass) gives every output bitwise as the same keys in int32 do: the invalid key `total` at
    the dtype's maximum (255, 65535) and below it, runs of S, S + 1 and L lookups, one across the block boundary,
    keys 0 and total - 1, with segment bounds."""
    from tbe_jax.kernels import rle

    s, lg, block = CFG.small_run_max, CFG.long_run, CFG.rle_block
    lengths = [1, s, s + 1, lg, 2, block + 3, 1, lg + 1, 3]
    rows = np.sort(rng.choice(np.arange(1, total - 1), size=len(lengths) - 2, replace=False))
    rows = np.concatenate([[0], rows, [total - 1]])  # the smallest and largest valid keys
    skey = np.concatenate([np.repeat(rows, lengths), np.full(41, total)]).astype(np.int32)
    n = len(skey)
    bounds = tuple(sorted({1, int(rows[3]), int(rows[4]) + 1, total - 1, total}))
    fn = jax.jit(functools.partial(
        rle.encode, total=total, small=s, n_big_max=n // (s + 1) + 1, long=lg, n_long_max=n // lg + 1,
        bounds=bounds, block=block, scan_chunk=CFG.scan_chunk, interpret=KERNEL_KW["interpret"]))
    want, got = fn(jnp.asarray(skey)), fn(jnp.asarray(skey.astype(dtype)))
    assert int(want[2]) == len(rows) and int(want[3]) == n - 41  # runs, valid lookups
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.dtype == jnp.int32, i
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(i))
    with pytest.raises(ValueError, match="unsigned dtype holding"):
        fn(jnp.asarray(skey.astype("int16")))
    if dtype == "uint8":
        with pytest.raises(ValueError, match="unsigned dtype holding"):
            jax.jit(functools.partial(rle.encode, total=256, small=s, n_big_max=n, long=lg, n_long_max=n,
                                      block=block, scan_chunk=CFG.scan_chunk))(jnp.asarray(skey.astype(dtype)))


@pytest.mark.parametrize("rows,width", [(1, 1), (2500, 3), (1024, 2), (3000, 4)])
def test_exclusive_scan(rng, rows, width):
    """kernels.scan.exclusive_scan (the per-block prefix sums of the rle and TT plan passes): one chunk, several
    chunks with a partial last one, exactly one chunk; a width padded to a power of two (3) and not; against
    NumPy."""
    from tbe_jax.kernels import scan

    counts = rng.integers(0, 1000, size=(rows, width)).astype(np.int32)
    base, tot = jax.jit(functools.partial(scan.exclusive_scan, width=width, chunk=1024,
                                          interpret=KERNEL_KW["interpret"], kernel=True))(
        jnp.asarray(counts.reshape(-1)))
    np.testing.assert_array_equal(np.asarray(base).reshape(rows, width), np.cumsum(counts, axis=0) - counts)
    assert [int(t[0]) for t in tot] == counts.sum(axis=0).tolist()


@pytest.mark.parametrize("case", ["sum", "mean-weighted", "mean-clamped", "vbe", "sequence", "dropped"])
def test_lookup_keys_kernel(rng, case):
    """kernels.keys (each lookup's bag by a binary search in offsets) against the XLA ops of runs.lookup_keys
    (the offsets' histogram and prefix sum): keys, output offsets and scales equal, over two programs (N > block)
    with a partial last one, ids out of range, empty bags, positions before the first bag and past the last.
    mean-clamped: offsets starting below 0 and ending past N (the default mode's input), so a mean scale is 1 over
    the clamped length (`preprocess.bag_lengths`, `kernels.programs.bag_extent`), not the raw difference."""
    rows = [7, 700, 3, 50]
    dims = [8] * 4 if case == "sequence" else [4, 8, 4, 16]
    emb = tbe_jax.TableBatchedEmbedding(specs(rows, dims), pooling="none" if case == "sequence" else "sum")
    batch = [9, 0, 300, 4] if case == "vbe" else [5] * 4  # vbe: a block spanning hundreds of bags, mostly empty
    lens = (0, 8) if case == "sequence" else [(100, 400), (100, 400), (0, 1), (60, 90)]
    idx, off, w = testing.make_batch(rng, rows, batch, lens, weighted=case == "mean-weighted")
    idx[[3, 40, 41]] = [-1, 700, -7]
    off[0] = 2  # positions 0, 1 in no bag
    off[len(off) // 2] = off[len(off) // 2 - 1]  # an empty bag
    idx = np.concatenate([idx, rng.integers(0, 3, 37).astype(np.int32)])  # padding past offsets[-1]
    if case == "mean-clamped":  # first and last bags partly outside [0, N]: no position before or past the bags
        off[0], off[-1] = -5, len(idx) + 9
    plan = emb.plan_for(len(off), batch if case == "vbe" else None)
    if case == "dropped":
        plan = runs_lib.without_features(plan, [1])
    if case != "sequence":
        assert len(idx) > CFG.keys_block
    kw = dict(pooling="mean" if case.startswith("mean") else "sum", sequence=case == "sequence")
    args = (jnp.asarray(idx), jnp.asarray(off), None if w is None else jnp.asarray(np.concatenate([w, w[:37]])))
    want = jax.jit(lambda *a: runs_lib.lookup_keys(emb.layout, plan, *a, **kw))(*args)
    got = jax.jit(lambda *a: runs_lib.lookup_keys(emb.layout, plan, *a, kernel=True, interpret=KERNEL_KW["interpret"],
                                                  **kw))(*args)
    for name, x, y in zip(("key", "src", "scale"), got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    assert int(np.sum(np.asarray(got[0]) < int(runs_lib.group_bases(emb.layout)[-1]))) > 0


def test_runs_rle_kernel_equals_xla_path(rng):
    """build_runs with and without the RLE kernel: every field equal."""
    tables = specs([7, 700, 3], [4, 4, 4])
    emb = tbe_jax.TableBatchedEmbedding(tables)
    idx, off, _ = testing.make_batch(rng, [7, 700, 3], [5, 5, 5], (0, 300))
    idx[4] = -1
    plan = emb.plan_for(len(off))
    args = (jnp.asarray(idx), jnp.asarray(off), None)
    # Jitted: one compile each instead of one per jnp op (build_runs is jittable by design).
    a = jax.jit(functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="sum",
                                  config=tbe_jax.BackwardConfig(rank_sort_max=0, narrow_sort_keys=False),
                                  interpret=KERNEL_KW["interpret"]))(*args)
    b = jax.jit(functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="sum", config=XLA_RUNS))(*args)
    assert_runs_equal(a, b)


@pytest.mark.parametrize("n,key_range", [(1, 5), (31, 3), (33, 1), (300, 10**9), (700, 40), (1100, 2**31 - 2)])
def test_rank_sort_matches_lax_sort(rng, n, key_range):
    """The counting-rank sort is XLA's stable sort: every key and payload, on crowded and spread keys, at sizes
    around its blocks and chunks (one partial block, several, a partial last chunk, the merge pass)."""
    from tbe_jax.kernels.ranksort import rank_sort

    key = jnp.asarray(rng.integers(0, key_range, n).astype(np.int32))
    pos, w = jnp.arange(n, dtype=jnp.int32), jnp.asarray(rng.random(n).astype(np.float32))
    want = jax.lax.sort((key, pos, w), num_keys=1, is_stable=True)
    # Blocks of (i, j, chunk, merge, wide): the defaults (one chunk up to 2048), small ones (the merge pass from 65),
    # and the wide merge (all chunks searched at once) at 16 keys a program (up to 18 chunks: 32 columns) and at 64
    # (up to 8 chunks; the serial merge past its 512-key tile).
    for blocks in ((16, 256, 2048, 256, 0), (8, 32, 64, 32, 0), (8, 32, 64, 32, 16), (8, 32, 64, 32, 64)):
        kw = dict(zip(("block_i", "block_j", "chunk", "merge_block", "wide_block"), blocks))
        got = jax.jit(functools.partial(rank_sort, interpret=KERNEL_KW["interpret"], **kw))(key, pos, w)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("weighted", [False, True], ids=["unit", "weighted"])
def test_runs_rank_sort_equals_xla_sort(rng, weighted):
    """build_runs through the counting-rank sort and through XLA's: every field equal; the rank sort is taken up to
    `rank_sort_max` lookups inclusive, XLA's sort past it."""
    tables = specs([7, 700, 3], [4, 4, 4])
    emb = tbe_jax.TableBatchedEmbedding(tables)
    idx, off, psw = testing.make_batch(rng, [7, 700, 3], [5, 5, 5], (0, 120), weighted=weighted)
    idx[4] = -1
    n = len(idx)
    plan = emb.plan_for(len(off))
    args = (jnp.asarray(idx), jnp.asarray(off), None if psw is None else jnp.asarray(psw))
    interp = KERNEL_KW["interpret"]

    def build(limit, chunk=2048, wide=0):
        cfg = tbe_jax.BackwardConfig(rank_sort_max=limit, rank_sort_interpret=True, rank_sort_chunk=chunk,
                                     narrow_sort_keys=False, rank_sort_wide_block=wide)
        fn = functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="mean" if weighted else "sum",
                               config=cfg, interpret=interp)
        return jax.jit(fn)(*args), str(jax.make_jaxpr(fn)(*args))

    (want, want_jaxpr), (got, got_jaxpr), (past, past_jaxpr) = build(0), build(n), build(n - 1)
    merged, merged_jaxpr = build(n, 256)  # several chunks: the merge pass
    wide, _ = build(n, 256, 32)  # the merge pass searching all chunks at once
    assert n > 256 and "tbe_rank_sort_merge" in merged_jaxpr and "tbe_rank_sort_merge" not in got_jaxpr
    assert "tbe_rank_sort" in got_jaxpr and "tbe_rank_sort" not in want_jaxpr + past_jaxpr
    for runs in (got, merged, wide):
        assert_runs_equal(runs, want)


@pytest.mark.parametrize("rows,dtype,weighted", [
    ([7, 248], "uint8", False), ([7, 249], "uint16", True), ([3, 700], "uint16", False),
    ([100, 65435], "uint16", True), ([100, 65436], "int32", False)],
    ids=["u8-at-255", "u16-at-256-weighted", "u16", "u16-at-65535-weighted", "i32-at-65536"])
def test_narrow_sort_keys_equal_int32_keys(rng, rows, dtype, weighted):
    """XLA's sort on the narrowest key dtype (`BackwardConfig.narrow_sort_keys`) gives every field of the runs
    bitwise as int32 keys do, at both sides of each dtype's limit (the invalid ids' key `total` included)."""
    emb = tbe_jax.TableBatchedEmbedding(specs(rows, [4, 4]))
    total = sum(rows)
    assert jnp.dtype(runs_lib.sort_key_dtype(total)) == jnp.dtype(dtype)
    idx, off, psw = testing.make_batch(rng, rows, [5, 5], (0, 60), weighted=weighted)
    idx[3], idx[-1] = -1, rows[1]  # a pruned id and one past the last table's end: both take the key `total`
    idx[5] = rows[1] - 1  # the largest valid key
    plan = emb.plan_for(len(off))
    args = (jnp.asarray(idx), jnp.asarray(off), None if psw is None else jnp.asarray(psw))

    def build(narrow):
        fn = functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="mean" if weighted else "sum",
                               interpret=KERNEL_KW["interpret"],
                               config=tbe_jax.BackwardConfig(rank_sort_max=0, narrow_sort_keys=narrow))
        return jax.jit(fn)(*args), str(jax.make_jaxpr(fn)(*args))

    (want, _), (got, got_jaxpr) = build(False), build(True)
    if dtype != "int32":
        assert f"{'u8' if dtype == 'uint8' else 'u16'}[" in got_jaxpr
    assert_runs_equal(got, want)


@pytest.mark.parametrize("opt,pooling,weighted", [
    pytest.param(tbe_jax.RowwiseAdagrad(0.05, 1e-3), "sum", False, marks=pytest.mark.skipif(
        not ON_GPU, reason="compiled only; interpret mode covers the rank-sorted backward in [sgd-mean-w] and "
        "test_backward_config_variants[rank_sort] (row-wise Adagrad), the rule in "
        "test_update_matches_model[adagrad-mean-w]")),
    (tbe_jax.SGD(0.05), "mean", True)],
    ids=["adagrad-sum", "sgd-mean-w"])
def test_rank_sorted_update_matches_model(rng, opt, pooling, weighted):
    # The backward with its lookups sorted by the counting-rank kernel, against the float64 model and the reference.
    tables = specs([17, 6, 40], [5, 16, 16])
    # ~380 lookups, chunks of 256: the merge pass too
    _check_step(rng, tables, [0, 1, 2, 1], [16] * 4, (0, 12), opt, pooling=pooling, weighted=weighted,
                backward_config=tbe_jax.BackwardConfig(rank_sort_max=1 << 20, rank_sort_interpret=True,
                                                       rank_sort_chunk=256))


def test_errors():
    emb = tbe_jax.TableBatchedEmbedding(specs([10], [4]), impl="xla")
    params = emb.init(jax.random.key(0))
    idx = np.array([1], np.int32)
    off = np.array([0, 1], np.int32)
    sgd_state = tbe_jax.SGD().init(params)
    with pytest.raises(TypeError, match="opt must be"):
        emb.apply_gradients(params, sgd_state, "adam", idx, off, np.zeros((1, 4), np.float32))
    with pytest.raises(TypeError, match="needs a RowwiseAdagradState"):
        emb.apply_gradients(params, sgd_state, tbe_jax.RowwiseAdagrad(), idx, off, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="grad_output has shape"):
        emb.apply_gradients(params, sgd_state, tbe_jax.SGD(), idx, off, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="learning_rate"):
        tbe_jax.RowwiseAdagrad(learning_rate=0.0)



@pytest.mark.parametrize("impl", ["xla", "kernel"])
@pytest.mark.parametrize("make_opt", [lambda: tbe_jax.RowwiseAdagrad(0.1, 1e-3), lambda: tbe_jax.SGD(0.1)],
                         ids=["adagrad", "sgd"])
def test_train_step_equals_apply_gradients(rng, impl, make_opt):
    # A model step through tbe_jax.train_step: the tables and state after it equal apply_gradients with the
    # gradient of the loss with respect to the pooled output; the dense layer's gradient is exact.
    opt = make_opt()
    if not ON_GPU and impl == "kernel" and isinstance(opt, tbe_jax.RowwiseAdagrad):
        # ~10 s in interpret mode: [sgd-kernel] runs the same train_step through the kernels; row-wise Adagrad's
        # fused update inside train_step: test_sort_in_forward_matches, test_histogram.py::
        # test_backward_update_matches_model[sum-adagrad] (bitwise apply_gradients), [adagrad-xla] here.
        pytest.skip("row-wise Adagrad kernel variant: compiled only (interpret mode: [sgd-kernel], "
                    "test_sort_in_forward_matches)")
    tables = specs([30, 12], [8, 8])
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(tables, pooling="mean", **kw)
    params = emb.init(jax.random.key(7))
    state = emb.init_opt_state(params, opt)
    dense = jnp.asarray(rng.standard_normal((16, 3)).astype(np.float32))
    idx, off, _ = testing.make_batch(rng, [30, 12], [6, 6], (0, 8))
    target = jnp.asarray(rng.standard_normal((6, 3)).astype(np.float32))

    def head(dense, pooled):
        return jnp.mean((pooled @ dense - target) ** 2)

    @jax.jit
    def step(dense, params, state, opt):
        return tbe_jax.train_step(head, dense, tbe_jax.SparseLookup(emb, opt, params, state, idx, off))

    res = step(dense, params, state, opt)
    # The pooled output from the XLA path (kernel case: no separate interpret-mode forward program on CPU).
    pooled = (emb if impl == "xla" else tbe_jax.TableBatchedEmbedding(tables, pooling="mean", impl="xla"))(
        params, idx, off)
    g_pooled = jax.grad(head, argnums=1)(dense, pooled)
    want_params, want_state = emb.apply_gradients(params, state, opt, idx, off, g_pooled)
    assert jax.tree.structure(res.opt_state) == jax.tree.structure(want_state) == jax.tree.structure(state)
    for key in params:
        assert_close(res.params[key], want_params[key], 1e-6)
    if isinstance(opt, tbe_jax.RowwiseAdagrad):
        for a, b in zip(emb.get_momentum(res.opt_state), emb.get_momentum(want_state)):
            assert_close(a, b, 1e-6)
    assert int(res.opt_state.count) == int(want_state.count) == 1
    assert_close(res.grads, jax.grad(head)(dense, pooled), 1e-6)
    assert_close(res.outputs, pooled, 1e-6)
    assert_close(res.loss, head(dense, pooled), 1e-6)
    assert int(res.report.invalid_indices) == 0 and int(res.report.nonfinite_grads) == 0


_RUN_LENGTHS = [1, 8, 9, 255, 256, 257, 10_000]
_RUN_LENGTHS_PADDED = 10_064  # every case's indices padded to this length: one compiled kernel step for all


@functools.partial(jax.jit, static_argnums=0)
def _apply_step(emb, opt, params, state, idx, off, g):
    return emb.apply_gradients(params, state, opt, idx, off, g)


@pytest.mark.parametrize("length", _RUN_LENGTHS)
def test_run_lengths(rng, length):
    # One row hit exactly `length` times (every class boundary: small <= 8 < mid < 256 <= long),
    # spread over bags and mixed with singleton runs of other rows; fp32 so the check is tight.
    assert (CFG.small_run_max, CFG.long_run) == (8, 256)  # the lengths above sit on these boundaries
    tables = specs([50, 40], [16, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    ref = tbe_jax.TableBatchedEmbedding(tables, impl="xla")
    params = emb.init(jax.random.key(length))
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-3)
    state = emb.init_opt_state(params, opt)
    batch = 8
    hot = np.full(length, 7, np.int32)
    others = rng.permutation(np.delete(np.arange(50), 7))[:20].astype(np.int32)
    ids0 = rng.permutation(np.concatenate([hot, others]))
    cuts = np.sort(rng.integers(0, len(ids0) + 1, batch - 1))
    ids1 = rng.integers(0, 40, 30).astype(np.int32)
    cuts1 = np.sort(rng.integers(0, 31, batch - 1))
    idx = np.concatenate([ids0, ids1])
    off = np.concatenate([[0], cuts, [len(ids0)], len(ids0) + cuts1, [len(idx)]]).astype(np.int32)
    g = rng.standard_normal((batch, 24)).astype(np.float32)
    # The kernels get the indices padded past offsets[-1] with valid-looking ids (ignored: see
    # test_api.py::test_padded_batches_share_one_compiled_step), so that every length shares one
    # compiled step; the XLA reference gets the batch unpadded.
    padded = np.concatenate([idx, rng.integers(0, 40, _RUN_LENGTHS_PADDED - len(idx))]).astype(np.int32)
    got_p, got_s = _apply_step(emb, opt, params, state, padded, off, g)
    want_p, want_s = ref.apply_gradients(params, state, opt, idx, off, g)
    for a, b in zip(emb.get_tables(got_p), emb.get_tables(want_p)):
        assert_close(a, b, 2e-5 * max(1.0, np.sqrt(length) / 8))
    for a, b in zip(emb.get_momentum(got_s), emb.get_momentum(want_s)):
        assert_close(a, b, 2e-5 * max(1.0, np.sqrt(length) / 8))


def test_one_row_hit_by_every_lookup(rng):
    tables = specs([30], [16])
    emb = tbe_jax.TableBatchedEmbedding(tables, pooling="mean", **KERNEL_KW)
    ref = tbe_jax.TableBatchedEmbedding(tables, pooling="mean", impl="xla")
    params = emb.init(jax.random.key(3))
    opt = tbe_jax.SGD(0.1)
    idx = np.full(600, 4, np.int32)
    off = np.array([0, 0, 100, 350, 600], np.int32)  # an empty bag first
    g = rng.standard_normal((4, 16)).astype(np.float32)
    got, _ = emb.apply_gradients(params, opt.init(params), opt, idx, off, g)
    want, _ = ref.apply_gradients(params, opt.init(params), opt, idx, off, g)
    assert_close(emb.get_tables(got)[0], emb.get_tables(want)[0], 5e-5)
    before = np.asarray(emb.get_tables(params)[0])
    after = np.asarray(emb.get_tables(got)[0])
    np.testing.assert_array_equal(np.delete(after, 4, 0), np.delete(before, 4, 0))


def test_bitwise_reproducible(rng):
    # No float atomics and a stable sort: the same inputs give the same bits, and so
    # do other program counts (each row's sum has one fixed order).
    tables = specs([6, 300], [16, 16])
    opt = tbe_jax.RowwiseAdagrad(0.1, 1e-3)
    idx, off, psw = testing.make_batch(rng, [6, 300], [8, 8], (0, 90), weighted=True)
    g = rng.standard_normal((8, 32)).astype(np.float32)
    outs = []
    # One jitted step, the embedding a static argument: the two equal configurations run one executable twice.
    step = jax.jit(lambda e, p, s: e.apply_gradients(p, s, opt, idx, off, g, psw), static_argnums=0)
    big = 4096 if ON_GPU else 16  # a program count set in the config is used as given, in interpret mode too
    for programs in (big, big, 3):
        emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, **KERNEL_KW,
                                            backward_config=tbe_jax.BackwardConfig(programs=programs,
                                                                                   small_programs=programs))
        params = emb.init(jax.random.key(0))
        state = emb.init_opt_state(params, opt)
        p, s = step(emb, params, state)
        outs.append([np.asarray(x) for x in jax.tree_util.tree_leaves((p, s))])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def test_sort_in_forward_matches(rng):
    # train_step with the sort/RLE in the lookup's forward (reused by the update) equals the default.
    tables = specs([20, 9], [8, 8])
    idx, off, psw = testing.make_batch(rng, [20, 9], [5, 5], (0, 12), weighted=True)
    opt = tbe_jax.RowwiseAdagrad(0.1, 1e-3)
    results = []
    for sif in (False, True):
        emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW,
                                            backward_config=tbe_jax.BackwardConfig(sort_in_forward=sif))
        params = emb.init(jax.random.key(1))
        state = emb.init_opt_state(params, opt)
        lookup = lambda p, s: tbe_jax.SparseLookup(emb, opt, p, s, idx, off, psw)  # noqa: E731
        res = jax.jit(lambda p, s: tbe_jax.train_step(lambda _, out: jnp.sum(jnp.sin(out)), None, lookup(p, s)))(
            params, state)
        results.append((res.params, res.opt_state, res.loss))
    assert np.any(np.asarray(results[0][1].momentum["d8"]) > 0)  # the step did something
    for a, b in zip(jax.tree_util.tree_leaves(results[0]), jax.tree_util.tree_leaves(results[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled HLO of the GPU kernels")
def test_train_step_copies_no_table():
    # The donated training step (tbe_jax.train_step) must update tables and accumulators in place:
    # in the compiled HLO, nothing but the kernels' custom calls produces a
    # table-shaped value (no copy, no elementwise pass over the table).
    emb = tbe_jax.TableBatchedEmbedding(specs([100_003], [64]), weights_dtype=jnp.float16, impl="pallas")
    opt = tbe_jax.RowwiseAdagrad(0.1)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    idx = jnp.arange(64, dtype=jnp.int32)
    off = jnp.array([0, 20, 64], jnp.int32)

    def step(carry, opt, idx, off):
        p, s = carry
        res = tbe_jax.train_step(lambda _, out: jnp.sum(out.astype(jnp.float32) ** 2), None,
                                 tbe_jax.SparseLookup(emb, opt, p, s, idx, off))
        return res.params, res.opt_state

    text = jax.jit(step, donate_argnums=0).lower((params, state), opt, idx, off).compile().as_text()
    assert "input_output_alias" in text
    offenders = []
    for line in text.splitlines():
        line = line.strip()
        if ("f16[100003,64]" not in line and "f32[100003]" not in line) or " = " not in line:
            continue
        if any(f" {op}(" in line for op in ("parameter", "get-tuple-element", "tuple", "bitcast", "custom-call")):
            continue
        offenders.append(line[:160])
    assert not offenders, offenders


@pytest.mark.parametrize("impl", ["xla", "kernel"])
@pytest.mark.parametrize("wdtype,mant", [("float16", 10), ("bfloat16", 7)])
def test_stochastic_rounding_is_unbiased(impl, wdtype, mant):
    # Every row at 1.0 gets an update of 0.3 ulp: round-to-nearest drops it, stochastic
    # rounding moves 30% of the values up one ulp (mean exact to sampling noise).
    if not ON_GPU and impl == "kernel" and wdtype == "bfloat16":
        # ~10 s in interpret mode. The kernels' row update calls the reference's rounding function
        # (rounding.stochastic_round): [float16-10-kernel] covers the kernel path, [bfloat16-7-xla] the bf16 rounding.
        pytest.skip("bf16 kernel variant: compiled only (interpret mode: [float16-10-kernel] and [bfloat16-7-xla])")
    rows, dim = 256, 16
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(specs([rows], [dim]), weights_dtype=wdtype, **kw)
    params = emb.set_tables(None, [jnp.ones((rows, dim), wdtype)])
    ulp = 2.0 ** -mant
    idx = np.arange(rows, dtype=np.int32)
    off = np.arange(rows + 1, dtype=np.int32)  # one row per bag
    g = -np.ones((rows, dim), np.float32)  # row-wise Adagrad step = lr * g / |g|: +lr everywhere
    for sr in (False, True):
        opt = tbe_jax.RowwiseAdagrad(learning_rate=0.3 * ulp, eps=0.0, stochastic_rounding=sr)
        new, _ = emb.apply_gradients(params, emb.init_opt_state(params, opt), opt, idx, off, g)
        w = np.asarray(emb.get_tables(new)[0], np.float64)
        assert set(np.unique(w)) <= {1.0, 1.0 + ulp}
        if not sr:
            assert np.all(w == 1.0)
        else:
            up = np.mean(w > 1.0)
            assert abs(up - 0.3) < 5 * np.sqrt(0.21 / w.size), up
            assert len(np.unique((w > 1.0).sum(axis=1))) > 3  # not one decision per row


@functools.partial(jax.jit, static_argnums=0)
def _apply_step_w(emb, opt, params, state, idx, off, g, psw):
    return emb.apply_gradients(params, state, opt, idx, off, g, psw)


@pytest.mark.parametrize("cfg", [dict(prefetch=True), dict(lookups_per_step=2),
                                 dict(rank_sort_max=1 << 20, rank_sort_interpret=True),
                                 dict(rank_sort_max=0), dict(rank_sort_max=0, narrow_sort_keys=False),
                                 dict(rle_fill=True), dict(rle_fill=True, rank_sort_max=0)],
                         ids=["prefetch", "lookups_per_step2", "rank_sort", "xla_sort", "xla_sort_int32_keys",
                              "fill", "fill_xla_sort"])
def test_backward_config_variants(rng, cfg):
    # The optional kernel variants give the default path's result (runs of every class, weighted, mean).
    tables = specs([3, 300], [8, 16])
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-2)
    # Random bag lengths with fixed totals per feature (900 lookups of 3 rows: long runs; 600 of 300
    # rows: small and mid runs): the variants' default-config step is one compiled program.
    lengths = np.concatenate([rng.multinomial(900, [0.25] * 4), rng.multinomial(600, [0.25] * 4)])
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = np.concatenate([rng.integers(0, 3, 900), rng.integers(0, 300, 600)]).astype(np.int32)
    psw = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    g = rng.standard_normal((4, 24)).astype(np.float32)
    outs = []
    for bcfg in (tbe_jax.BackwardConfig(), tbe_jax.BackwardConfig(**cfg)):
        emb = tbe_jax.TableBatchedEmbedding(tables, pooling="mean", backward_config=bcfg, **KERNEL_KW)
        params = emb.init(jax.random.key(2))
        p, s = _apply_step_w(emb, opt, params, emb.init_opt_state(params, opt), idx, off, g, psw)
        outs.append(jax.tree_util.tree_leaves((p, s)))
    for a, b in zip(*outs):
        assert_close(a, b, 1e-6)


def test_backward_config_errors():
    with pytest.raises(ValueError, match="small_block=24 must be a power of two"):
        tbe_jax.BackwardConfig(small_block=24)
    with pytest.raises(ValueError, match="num_warps=0 must be >= 1"):
        tbe_jax.BackwardConfig(num_warps=0)
    with pytest.raises(ValueError, match="small_programs=0 must be >= 1"):
        tbe_jax.BackwardConfig(small_programs=0)
    with pytest.raises(ValueError, match="rank_sort_max"):
        tbe_jax.BackwardConfig(rank_sort_max=-1)
    with pytest.raises(ValueError, match="rank_sort_chunk"):
        tbe_jax.BackwardConfig(rank_sort_chunk=1000)
    for removed in ("keys_kernel", "keys_bags", "small_unroll"):  # experiments measured slower, removed
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{removed}'"):
            tbe_jax.BackwardConfig(**{removed: 1})
    with pytest.raises(TypeError, match="backward_config must be a tbe_jax.BackwardConfig"):
        tbe_jax.TableBatchedEmbedding(specs([10], [4]), backward_config={"programs": 8})
    a = tbe_jax.TableBatchedEmbedding(specs([10], [4]), backward_config=tbe_jax.BackwardConfig(programs=8))
    b = tbe_jax.TableBatchedEmbedding(specs([10], [4]))
    assert a != b and hash(a) != hash(b)  # a static jit argument: configs must not collide


def test_stochastic_rounding_leaves_fp32_tables_exact(rng):
    tables = specs([20], [8])
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla")
    params = emb.init(jax.random.key(0))
    idx, off, _ = testing.make_batch(rng, [20], [4], (1, 6))
    g = rng.standard_normal((4, 8)).astype(np.float32)
    outs = []
    for sr in (False, True):
        opt = tbe_jax.SGD(0.1, stochastic_rounding=sr)
        outs.append(np.asarray(emb.apply_gradients(params, opt.init(params), opt, idx, off, g)[0]["d8"]))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("split", [0, 64])
@pytest.mark.parametrize("case", ["none", "one", "few", "many"])
def test_long_chunks_kernel_matches_xla_ops(rng, case, split):
    """kernels.rle.long_chunks (one program over the long runs) against its XLA ops, bitwise: no long run, one,
    a few of every length class around `long_run` and `2 * split_chunk`, and more long runs than one step of the
    kernel takes (`chunk` 4 here); slots past the long runs hold the chunk total; the counts; the task ranges of
    three segments and of one."""
    from tbe_jax.kernels import rle

    lg = CFG.long_run
    lengths = {"none": [3, 1, 9], "one": [2, 700, 5], "few": [1, 128, 129, 255, lg, lg + 1, 2 * lg, 3, 2 * lg + 7],
               "many": list(rng.integers(128, 600, size=11)) + [1, 2]}[case]
    lengths = rng.permutation(np.asarray(lengths))
    chunked = 2 * split if split else lg
    n = int(np.sum(lengths)) + 5
    run_start = np.full(n + 1, n - 5, np.int32)
    run_start[: len(lengths)] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    long_runs = np.flatnonzero(lengths >= chunked).astype(np.int32)
    n_long_max = n // chunked + 1
    long = np.full(n_long_max, -7, np.int32)  # past the count: undefined (no `rle_fill`), never read
    long[: len(long_runs)] = long_runs
    n_mid = int(np.sum((lengths > CFG.small_run_max) & (lengths < chunked)))
    # Three segments: the runs, mid runs and long runs below two cut points of the run list (the first may be 0).
    cuts = sorted(rng.integers(0, len(lengths) + 1, size=2))
    is_mid = (lengths > CFG.small_run_max) & (lengths < chunked)
    edges = np.asarray([[c, np.sum(is_mid[:c]), np.sum(lengths[:c] >= chunked)] for c in cuts], np.int32)
    args = (jnp.asarray(run_start), jnp.asarray(long), jnp.int32(len(lengths)), jnp.int32(n_mid),
            jnp.int32(len(long_runs)), jnp.asarray(edges.reshape(-1)))
    kw = dict(long_run=lg, split_chunk=split, chunk=4, interpret=KERNEL_KW["interpret"])
    got = jax.jit(functools.partial(rle.long_chunks, kernel=True, **kw))(*args)
    want = jax.jit(functools.partial(rle.long_chunks, kernel=False, **kw))(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    size = np.where((lengths >= lg) | (split == 0), lg, split)
    tasks = np.where(lengths >= chunked, -(-lengths // size), 0)
    assert int(got[1][3]) == tasks.sum() and int(got[0][-1]) == tasks.sum()
    np.testing.assert_array_equal(np.asarray(got[0])[1 : len(long_runs) + 1], np.cumsum(tasks[long_runs]))
    assert list(np.asarray(got[1])[:3]) == [len(lengths) - n_mid - len(long_runs), n_mid, len(long_runs)]
    one = jax.jit(functools.partial(rle.long_chunks, kernel=True, **kw))(*args[:5])  # one segment: no edges
    np.testing.assert_array_equal(np.asarray(one[2]), [[0, len(lengths), 0, n_mid, 0, tasks.sum(), 0,
                                                        len(long_runs)]])
    assert got[2].shape == (3, 8) and int(got[2][1, 4]) == tasks[long_runs][: edges[0, 2]].sum()
