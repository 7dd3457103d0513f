"""Bad input: every bounds_check mode, wrong dtypes, wrong offsets length."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, assert_close, specs, tables_f64

TABLES = specs([10, 20], [8, 16])


def _emb(mode, **kw):
    return tbe_jax.TableBatchedEmbedding(TABLES, bounds_check=mode, **kw)


def _bad_batch():
    # feature 0 (E=10): bag 0 = [1, 12(bad), -1(pruned)], bag 1 = [3]
    # feature 1 (E=20): bag 0 = [19, -5(bad)], bag 1 = [20(bad), 0]
    idx = np.array([1, 12, -1, 3, 19, -5, 20, 0], np.int32)
    off = np.array([0, 3, 4, 6, 8], np.int32)
    return idx, off


def _clean(idx, f_rows):
    keep = idx.copy()
    for p, e in f_rows:
        keep[p] = -1
    return keep


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_warning_skips_invalid_ids_and_reports(impl):
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = _emb("warning", **kw)
    params = emb.init(jax.random.key(0))
    idx, off = _bad_batch()
    with pytest.warns(RuntimeWarning, match="3 index"):
        out = emb(params, idx, off)
        jax.block_until_ready(out)
        jax.effects_barrier()
    model = testing.numpy_pooled(tables_f64(emb, params), [0, 1], [2, 2], idx, off, None, "sum", False)
    assert_close(out, model, 1e-6)
    rep = emb.bounds_report(idx, off)
    assert int(rep.invalid_indices) == 3 and int(rep.repaired_offsets) == 0


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_warning_repairs_offsets_by_clamping(impl):
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = _emb("warning", **kw)
    params = emb.init(jax.random.key(0))
    idx = np.array([1, 2, 3, 4, 5, 6], np.int32)
    off = np.array([2, 4, 3, 9, 5], np.int32)  # first not 0, decreasing, past len(indices)
    fixed = np.array([0, 4, 4, 6, 6], np.int32)
    with pytest.warns(RuntimeWarning, match="4 offsets"):
        out = emb(params, idx, off)
        jax.block_until_ready(out)
        jax.effects_barrier()
    model = testing.numpy_pooled(tables_f64(emb, params), [0, 1], [2, 2], idx, fixed, None, "sum", False)
    assert_close(out, model, 1e-6)
    assert int(emb.bounds_report(idx, off).repaired_offsets) == 4


def test_warning_clean_input_is_silent():
    emb = _emb("warning", impl="xla")
    params = emb.init(jax.random.key(0))
    idx = np.array([1, -1, 3, 19, 0], np.int32)  # -1 is a pruned row: skipped, not reported
    off = np.array([0, 2, 3, 4, 5], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        jax.block_until_ready(emb(params, idx, off))
        jax.effects_barrier()


def test_fatal_eager_names_feature_bag_and_value():
    emb = _emb("fatal", impl="xla")
    params = emb.init(jax.random.key(0))
    idx, off = _bad_batch()
    with pytest.raises(ValueError, match=r"feature 0 \(table 0 \('t0'\)\), bag 0: index 12"):
        emb(params, idx, off)
    idx2 = np.array([1, 2, 3, 4, 5, 6], np.int32)
    with pytest.raises(ValueError, match=r"offsets\[2\]=3 .*feature 0.*bag 1"):
        emb(params, idx2, np.array([0, 4, 3, 5, 6], np.int32))


def test_fatal_under_jit_through_checkify():
    emb = _emb("fatal", **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    idx, off = _bad_batch()
    f = jax.jit(checkify.checkify(lambda p, i, o: emb(p, i, o)))
    err, _ = f(params, idx, off)
    with pytest.raises(Exception, match=r"feature 0, bag 0: index 12"):
        err.throw()
    good = np.where(idx >= 10, 0, np.abs(idx)).astype(np.int32)
    err, out = f(params, good, off)
    err.throw()  # clean input: no error
    # The other order, and under jax.grad of the output: the same errors.
    g = jax.jit(checkify.checkify(jax.grad(lambda p, i, o: jnp.sum(emb(p, i, o)))))
    err, _ = g(params, idx, off)
    with pytest.raises(Exception, match=r"feature 0, bag 0: index 12"):
        err.throw()
    err, _ = checkify.checkify(jax.jit(lambda p, i, o: emb(p, i, o)))(params, idx, off)
    with pytest.raises(Exception, match=r"feature 0, bag 0: index 12"):
        err.throw()
    # A plain jit: our message, naming both ways out (not JAX's "not functionalized").
    with pytest.raises(ValueError, match=r"bounds_check='fatal' under jax.jit .*checkify.checkify.*'warning'"):
        jax.jit(lambda p, i, o: emb(p, i, o))(params, idx, off)


def test_none_mode_skips_pruned_rows():
    emb = _emb("none", **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    idx = np.array([1, -1, 3, 19, 0], np.int32)
    off = np.array([0, 2, 3, 4, 5], np.int32)
    model = testing.numpy_pooled(tables_f64(emb, params), [0, 1], [2, 2], idx, off, None, "sum", False)
    assert_close(emb(params, idx, off), model, 1e-6)


def test_wrong_dtypes_and_shapes():
    emb = _emb("none", impl="xla")
    params = emb.init(jax.random.key(0))
    idx = np.array([1, 2], np.int32)
    off = np.array([0, 1, 1, 2, 2], np.int32)
    with pytest.raises(TypeError, match="indices must hold integers"):
        emb(params, idx.astype(np.float32), off)
    with pytest.raises(TypeError, match="offsets must hold integers"):
        emb(params, idx, off.astype(np.float32))
    with pytest.raises(ValueError, match="expected F\\*B\\+1"):
        emb(params, idx, off[:-1])
    with pytest.raises(ValueError, match="1-D"):
        emb(params, idx.reshape(1, 2), off)
    with pytest.raises(ValueError, match="per_sample_weights has shape"):
        emb(params, idx, off, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="per_sample_weights must be floating"):
        emb(params, idx, off, np.ones(2, np.int32))
    with pytest.raises(ValueError, match="batch_size_per_feature"):
        emb(params, idx, off, batch_size_per_feature=(1, 1))
    bad = dict(params)
    bad["d8"] = bad["d8"].astype(jnp.float16)
    with pytest.raises(ValueError, match="params\\['d8'\\] must be float32"):
        emb(params=bad, indices=idx, offsets=off)


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_forward_with_report_is_silent_and_counts(impl):
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = _emb("warning", **kw)
    params = emb.init(jax.random.key(0))
    idx, off = _bad_batch()
    off = off.copy()
    off[0] = 1  # one repaired offset too
    with warnings.catch_warnings():
        # Only our RuntimeWarning: jax 0.11+ itself warns (DeprecationWarning) on Triton lowering.
        warnings.simplefilter("error", RuntimeWarning)
        out, rep = jax.jit(lambda p, i, o: emb.forward_with_report(p, i, o))(params, idx, off)
        jax.effects_barrier()
    assert int(rep.invalid_indices) == 3 and int(rep.repaired_offsets) == 1
    with pytest.warns(RuntimeWarning, match="3 index"):  # the plain call does warn
        plain = np.asarray(emb(params, idx, off))
        jax.effects_barrier()
    np.testing.assert_allclose(np.asarray(out), plain, rtol=1e-6)
    # The default mode counts the same, silently, and repairs nothing: bag 0 starts at offsets[0] = 1 (the model
    # on the same offsets); "none" counts alike.
    for mode in ("none", "ignore"):  # ("none" reads the ids past a table: its output is not the model's)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            quiet, rep = _emb(mode, **kw).forward_with_report(params, idx, off)
            jax.effects_barrier()
        assert int(rep.invalid_indices) == 3 and int(rep.repaired_offsets) == 1, mode
    model = testing.numpy_pooled(tables_f64(emb, params), [0, 1], [2, 2], idx, off, None, "sum", False)
    assert_close(quiet, model, 1e-6)
    # The training step's report counts the invalid ids in the default mode too (issue 36 item 3).
    quiet_emb, opt = _emb("ignore", **kw), tbe_jax.SGD(0.1)
    res = jax.jit(lambda p, s: tbe_jax.train_step(lambda _, o: jnp.sum(o), None, tbe_jax.SparseLookup(
        quiet_emb, opt, p, s, idx, off)))(params, quiet_emb.init_opt_state(params, opt))
    assert int(res.report.invalid_indices) == 3


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_default_mode_clamps_offsets_the_same_everywhere(impl, pooling):
    # Offsets that never decrease but start below 0 and end past len(indices) (the kernels used to read the ids past
    # the end): in the default mode every impl, the lookup and the update use the clamped bags, read nothing past
    # `indices`, and count the two malformed entries; decreasing offsets are memory-safe and counted. Mean pooling
    # divides by the clamped bag's length everywhere (the XLA path and the update divided by the raw offsets
    # difference until 2026-12-04: bag 0 here by 5, not 2, on the XLA forward and on both impls' updates; compiled,
    # the sorted-run update's keys kernel until 2026-12-05, which interpret mode checks in test_backward's
    # test_lookup_keys_kernel[mean-clamped]: here interpret mode takes runs.lookup_keys' XLA arm).
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = _emb("ignore", pooling=pooling, **kw)
    params = emb.init(jax.random.key(0))
    idx = np.array([1, 2, 3, 4, 5, 6], np.int32)
    off = np.array([-3, 2, 4, 4, 9], np.int32)
    clamped = np.array([0, 2, 4, 4, 6], np.int32)
    assert int(tbe_jax.bounds.count_malformed(jnp.asarray(off), len(idx))) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # silent in this mode
        out, rep = jax.jit(emb.forward_with_report)(params, idx, off)
        jax.effects_barrier()
    model = testing.numpy_pooled(tables_f64(emb, params), [0, 1], [2, 2], idx, clamped, None, pooling, False)
    assert_close(out, model, 1e-6)
    assert int(rep.repaired_offsets) == 2 and int(rep.invalid_indices) == 0
    opt = tbe_jax.RowwiseAdagrad(0.1)
    state = emb.init_opt_state(params, opt)
    g = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    got = emb.apply_gradients(params, state, opt, idx, off, g)
    want = emb.apply_gradients(params, state, opt, idx, clamped, g)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    res = jax.jit(lambda p, s: tbe_jax.train_step(lambda _, o: jnp.sum(o * g), None,
                                                  tbe_jax.SparseLookup(emb, opt, p, s, idx, off)))(params, state)
    for a, b in zip(jax.tree_util.tree_leaves((res.params, res.opt_state)), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)  # another program
    assert int(res.report.invalid_indices) == 0
    # Decreasing offsets: undefined bags, but finite, nothing read past the end, and counted.
    dec = np.array([0, 4, 2, 5, 7], np.int32)
    out, rep = emb.forward_with_report(params, idx, dec)
    assert np.all(np.isfinite(np.asarray(out))) and int(rep.repaired_offsets) == 2


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_counts_without_ids_or_bags(impl):
    # A batch where no kernel runs (no ids; or no bags) still counts its malformed offsets entries, the same on
    # every impl (the kernel path reported 0 until session 45: found by tests/fuzz_kernels.py).
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    none = np.zeros(0, np.int32)
    for mode, off, want in (("ignore", [0, 0, 0, 0, 3], 1), ("ignore", [-3, 0, 0, 0, 0], 1),
                            ("ignore", [0, 0, 2, 0, 0], 2), ("warning", [0, 0, 2, 0, 0], 1),
                            ("ignore", [0, 0, 0, 0, 0], 0)):
        emb = _emb(mode, **kw)
        params = emb.init(jax.random.key(0))
        out, rep = emb.forward_with_report(params, none, np.asarray(off, np.int32))
        assert not np.any(np.asarray(out)) and int(rep.invalid_indices) == 0
        assert int(rep.repaired_offsets) == want, (mode, off)
    emb = _emb("ignore", **kw)  # every feature's batch empty (VBE), ids present
    params = emb.init(jax.random.key(0))
    out, rep = emb.forward_with_report(params, np.array([1, 2], np.int32), np.array([2], np.int32),
                                       batch_size_per_feature=(0, 0))
    assert np.asarray(out).size == 0 and int(rep.repaired_offsets) == 1


def test_none_mode_reads_nothing_outside_indices():
    # "none" repairs nothing, but the kernels clamp each bag to the ids that exist: offsets past the end read no
    # memory past `indices` (here: the same result as the bags cut at len(indices)).
    emb = _emb("none", **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    idx = np.array([1, 2, 3, 4, 5, 6], np.int32)
    off = np.array([0, 2, 3, 5, 40], np.int32)
    cut = np.array([0, 2, 3, 5, 6], np.int32)
    np.testing.assert_array_equal(np.asarray(emb(params, idx, off)), np.asarray(emb(params, idx, cut)))
    _, rep = emb.forward_with_report(params, idx, off)
    assert int(rep.repaired_offsets) == 1  # counted, not repaired
