"""A 300-feature model against a float64 NumPy model: the forward and one row-wise Adagrad step.

The kernels locate each program's feature on the device (`kernels.programs`) and
serve every storage buffer from one launch per kernel; with 300 features over three
embedding dims (and some features sharing tables) this checks that mapping at a
size where a wrong index would land in another feature's rows.
"""

import jax
import numpy as np
import pytest

import tbe_jax
from conftest import KERNEL_KW, assert_close, model_step_f64, tables_f64

DIMS = (4, 8, 12)  # three buffers: three branches per kernel (interpret-mode compile time)


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_300_features_forward_and_step(rng, impl):
    num_tables, num_features, batch = 240, 300, 2
    rows = rng.integers(3, 40, num_tables)
    tables = [tbe_jax.TableSpec(int(e), DIMS[i % len(DIMS)]) for i, e in enumerate(rows)]
    ftm = [f % num_tables for f in range(num_features)]  # the last 60 features share tables with the first
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=ftm, **kw)
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    lens = rng.integers(0, 4, num_features * batch)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    feat_of_bag = np.repeat(np.arange(num_features), batch)
    ids = np.concatenate([rng.integers(0, rows[ftm[f]], n) for f, n in zip(feat_of_bag, lens)]).astype(np.int32)

    # float64 model of the forward
    w64 = tables_f64(emb, params)
    dims = [tables[t].embedding_dim for t in ftm]
    cols = np.concatenate([[0], np.cumsum(dims)])
    want = np.zeros((batch, cols[-1]))
    for k, (f, n) in enumerate(zip(feat_of_bag, lens)):
        b = k % batch
        for p in range(offsets[k], offsets[k] + n):
            want[b, cols[f]:cols[f + 1]] += w64[ftm[f]][ids[p]]
    out = jax.jit(emb.__call__)(params, ids, offsets)
    assert_close(out, want, 1e-6)

    # one row-wise Adagrad step against the float64 model
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1, eps=0.01)
    state = emb.init_opt_state(params, opt)
    g_out = rng.standard_normal((batch, cols[-1])).astype(np.float32)
    grads = [np.zeros_like(w) for w in w64]
    touched = [np.zeros(len(w), bool) for w in w64]
    for k, (f, n) in enumerate(zip(feat_of_bag, lens)):
        b = k % batch
        for p in range(offsets[k], offsets[k] + n):
            grads[ftm[f]][ids[p]] += g_out[b, cols[f]:cols[f + 1]]
            touched[ftm[f]][ids[p]] = True
    momentum = [np.zeros(len(w)) for w in w64]
    want_t, want_m = model_step_f64(w64, momentum, touched, grads, opt)
    new_p, new_s = jax.jit(emb.apply_gradients)(params, state, opt, ids, offsets, g_out)
    for got, ref in zip(tables_f64(emb, new_p), want_t):
        assert_close(got, ref, 1e-5)
    for got, ref in zip(jax.jit(emb.get_momentum)(new_s), want_m):  # jitted: one compile, not one per table
        assert_close(got, ref, 1e-5)


def test_many_tables_workload():
    """`testing.many_tables` / `testing.workload("many...")`, the benchmarks' models of hundreds of tables: the
    promised shape (tables, distinct dims, ranges), the same model for the same seed, another for another seed, and
    the name forms."""
    from tbe_jax import testing

    wl = testing.workload("many300x24")
    feats = wl.features()
    rows, dims, lens = (np.array(x) for x in zip(*feats))
    assert len(feats) == 300 and len(set(dims.tolist())) == 24
    assert np.all(dims % 4 == 0) and dims.min() >= 4 and dims.max() <= 256
    assert rows.min() >= 1000 and rows.max() <= 1_000_000 and lens.min() >= 1 and lens.max() <= 40
    assert wl.B == 2048 and wl.alpha == 1.0 and wl.name == "many300x24"
    assert testing.workload("many300x24").features() == feats  # deterministic
    assert testing.workload("many300x24@1").features() != feats
    z = testing.workload("many300x24z")
    assert z.alpha > 1.0 and z.features() == feats  # same model, Zipf ids
    small = testing.many_tables(5, 5)  # every dim used at least once, even with as many dims as tables
    assert len(set(d for _, d, _ in small.features())) == 5
    assert testing.workload("dims4-16/4").dims == (4, 8, 12, 16)
    assert testing.workload("base") is testing.PRESETS["base"]
