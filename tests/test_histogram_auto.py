"""The histogram path without hints: small tables get it where it pays, decided per batch on the device.

A table with E <= 64 and 64 <= D <= 128 (fp16 weights, fp32 output) always takes the
histogram backward; its forward follows `bag_size_hint`, and without one ("auto")
both forward kernels run and read one per-feature choice (`histogram.long_bags`) computed from the
batch's bag lengths. Runs compiled on a GPU and in interpret mode on CPU (conftest.KERNEL_KW).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from tbe_jax.kernels import histogram
from tbe_jax.specs import FeaturePlan
from conftest import KERNEL_KW, assert_close, model_step_f64, tables_f64, tolerance


def _emb(tables, **kw):
    kw.setdefault("weights_dtype", "float16")
    return tbe_jax.TableBatchedEmbedding(tables, **kw, **KERNEL_KW)


def test_plan_without_hints():
    small, hinted, short = (tbe_jax.TableSpec(16, 64), tbe_jax.TableSpec(16, 64, bag_size_hint=128),
                            tbe_jax.TableSpec(16, 64, bag_size_hint=4))
    big, narrow = tbe_jax.TableSpec(1000, 64), tbe_jax.TableSpec(16, 32)
    emb = _emb([small, hinted, short, big, narrow])
    assert emb.plan() == ("auto", "histogram", "generic", "generic", "generic")
    assert emb.plan(backward=True) == ("histogram", "histogram", "histogram", "generic", "generic")
    assert emb.plan(weighted=True) == ("generic",) * 5
    assert emb.plan(vbe=True, backward=True) == ("generic",) * 5
    assert _emb([small], use_histogram=False).plan(backward=True) == ("generic",)
    assert _emb([small], weights_dtype="float32").plan() == ("generic",)


def test_long_bags_mask():
    # Features of 4 bags: mean lengths 64 (long), 63.75 (short), 100 (long), 0 (empty: short).
    lengths = [[64] * 4, [64, 64, 64, 63], [100, 100, 50, 150], [0] * 4]
    off = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)
    tables = [tbe_jax.TableSpec(8, 64)] * 4
    emb = _emb(tables)
    plan = emb.plan_for(len(off))
    assert isinstance(plan, FeaturePlan)
    got = jax.jit(lambda o: histogram.long_bags(plan, o, [0, 1, 2, 3]))(jnp.asarray(off))
    np.testing.assert_array_equal(np.asarray(got), [1, 0, 1, 0])
    got = histogram.long_bags(plan, jnp.asarray(off), [1, 2])  # features left out stay 0
    np.testing.assert_array_equal(np.asarray(got), [0, 0, 1, 0])


def _batch(rng, rows, lengths_per_feature, pad_to=None):
    """FBGEMM-format inputs with the given bag lengths per feature, ids padded to `pad_to`."""
    lengths = np.concatenate(lengths_per_feature)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = np.concatenate([rng.integers(0, e, int(sum(l))) for e, l in zip(rows, lengths_per_feature)])
    ids = ids.astype(np.int32)
    if pad_to is not None:
        ids = np.concatenate([ids, np.full(pad_to - len(ids), -1, np.int32)])
    return ids, off


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_auto_forward_takes_either_path_in_one_compile(rng, pooling):
    """One jitted forward, batches whose bag lengths send the auto features either way (and a mix):
    each result equals the float64 model. Features: an auto table read twice, a big (generic) table,
    and a hinted histogram table."""
    tables = [tbe_jax.TableSpec(20, 64), tbe_jax.TableSpec(300, 64), tbe_jax.TableSpec(9, 128, bag_size_hint=96)]
    fmap = [0, 1, 0, 2]
    emb = _emb(tables, feature_table_map=fmap, pooling=pooling)
    assert emb.plan() == ("auto", "generic", "auto", "histogram")
    params = emb.init(jax.random.key(3))
    rows = [tables[t].num_embeddings for t in fmap]
    b = 5
    traces = []

    @jax.jit
    def fwd(p, i, o):
        traces.append(1)
        return emb(p, i, o)

    cases = {  # per feature: b bag lengths
        "long": [[70, 64, 90, 0, 120], [3] * b, [80, 64, 66, 70, 65], [1, 2, 3, 4, 5]],
        "short": [[1, 0, 5, 9, 2], [3] * b, [63, 0, 1, 2, 3], [100] * b],
        "mixed": [[70, 64, 90, 300, 120], [3] * b, [1, 2, 3, 4, 5], [0] * b],
    }
    pad = max(int(sum(map(sum, c))) for c in cases.values())
    for name, lengths in cases.items():
        idx, off = _batch(rng, rows, [np.asarray(l) for l in lengths], pad)
        out = fwd(params, jnp.asarray(idx), jnp.asarray(off))
        n = int(off[-1])
        model = testing.numpy_pooled(tables_f64(emb, params), fmap, [b] * 4, idx[:n], off, None, pooling, False)
        assert_close(out, model, tolerance("float32", 300))
    assert len(traces) == 1


def test_auto_forward_counts_bad_ids_once_on_either_path(rng):
    """Warning mode, an auto feature holding bad ids: whichever kernel is live for it counts them (the other
    one's programs for that feature have no bags and read nothing), and the good ids give the model's sums."""
    tables = [tbe_jax.TableSpec(20, 64), tbe_jax.TableSpec(300, 64)]
    emb = _emb(tables, bounds_check="warning")
    assert emb.plan() == ("auto", "generic")
    params = emb.init(jax.random.key(4))
    fwd = jax.jit(emb.forward_with_report)
    b = 4
    for lengths in ([[70, 64, 90, 80], [3] * b], [[1, 0, 5, 2], [3] * b]):
        idx, off = _batch(rng, [20, 300], [np.asarray(l) for l in lengths])
        bad = rng.choice(int(off[b]), size=3, replace=False)
        idx[bad] = [20, -2, 1000]
        out, rep = fwd(params, jnp.asarray(idx), jnp.asarray(off))
        assert int(rep.invalid_indices) == 3 and int(rep.repaired_offsets) == 0
        model = testing.numpy_pooled(tables_f64(emb, params), [0, 1], [b, b], idx, off, None, "sum", False)
        assert_close(out, model, tolerance("float32", 100))


def test_auto_tables_train_with_the_histogram_backward(rng):
    """No hints: the small table's backward takes the histogram kernels (no sort) and two
    row-wise Adagrad steps equal the float64 model, for long and for short bags."""
    tables = [tbe_jax.TableSpec(12, 64), tbe_jax.TableSpec(200, 64)]
    emb = _emb(tables)
    assert emb.plan(backward=True) == ("histogram", "generic")
    opt = tbe_jax.RowwiseAdagrad(0.1, 0.1)
    params = emb.init(jax.random.key(5))
    state = emb.init_opt_state(params, opt)
    step = jax.jit(lambda p, s, i, o, g: emb.apply_gradients(p, s, opt, i, o, g))
    w64 = tables_f64(emb, params)
    m64 = [np.zeros(t.num_embeddings) for t in tables]
    b = 6
    for lengths in ([[80, 64, 70, 0, 65, 100], [2] * b], [[1, 2, 0, 3, 5, 1], [4] * b]):
        idx, off = _batch(rng, [12, 200], [np.asarray(l) for l in lengths])
        g = rng.standard_normal((b, 128)).astype(np.float32)
        params, state = step(params, state, jnp.asarray(idx), jnp.asarray(off), jnp.asarray(g))
        grads, _ = testing.numpy_pooled_vjp(w64, [0, 1], [b, b], idx, off, None, g, "sum", False)
        n0 = int(off[b])
        hit = [np.isin(np.arange(12), idx[:n0]), np.isin(np.arange(200), idx[n0:])]
        w64, m64 = model_step_f64(w64, m64, hit, grads, opt)
        got = tables_f64(emb, params)
        for t in range(2):
            assert_close(got[t], w64[t], 2e-3)
        np.testing.assert_allclose(np.asarray(emb.get_momentum(state)[0]), m64[0], rtol=2e-3, atol=1e-6)


def test_auto_lowers_to_both_forward_kernels_and_no_sort_for_small_tables():
    """Lowered for CUDA: the auto forward has the generic and the histogram kernel (no conditional),
    and a model of small tables only trains without a sort."""
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(64, 128)], weights_dtype="float16")
    emb.uses_kernel = lambda: True  # lowered for CUDA on any machine: the kernel path, not run
    params = jax.eval_shape(emb.init, jax.random.key(0))
    i = jax.ShapeDtypeStruct((4096,), jnp.int32)
    o = jax.ShapeDtypeStruct((33,), jnp.int32)
    text = jax.jit(lambda p, i, o: emb(p, i, o)).trace(params, i, o).lower(lowering_platforms=("cuda",)).as_text()
    assert "tbe_pooled_forward" in text and "tbe_histogram_forward" in text
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    # The choice is made once (one small fusion on the device) and both kernels read that one `[F]` value.
    calls = [c.split(", ") for c in re.findall(r"custom_call @[^(]*triton[^(]*\(([^)]*)\)", text)]
    assert len(calls) == 2
    shared = set(calls[0]) & set(calls[1])
    assert len([v for v in shared if not v.startswith(("%arg", "%c"))]) == 1, calls
    opt = tbe_jax.RowwiseAdagrad(0.1, 0.1)
    state = jax.eval_shape(lambda p: emb.init_opt_state(p, opt), params)
    g = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    text = jax.jit(lambda p, s, i, o, g: emb.apply_gradients(p, s, opt, i, o, g)).trace(
        params, state, i, o, g).lower(lowering_platforms=("cuda",)).as_text()
    assert "tbe_histogram" in text and "stablehlo.sort" not in text
