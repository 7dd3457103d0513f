"""Variable batch size per feature with the sizes as a (traced) array under a static maximum.

Checked against the static-tuple form on the same batch (forward, the optimizer
step, `train_step`), for the XLA path and the kernels (interpret mode on CPU,
compiled on a GPU); one compilation across batches whose sizes differ; the
documented clamping of bad sizes in each bounds mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, assert_close, specs

TABLES = specs([30, 11, 25], [8, 5, 16])
FMAP = [0, 1, 2, 0]
MAX_B = 6


def _emb(impl, **kw):
    extra = KERNEL_KW if impl == "pallas" else dict(impl="xla")
    return tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, **extra, **kw)


def _batch(rng, sizes, capacity=None, weighted=False):
    """Compact inputs for `sizes`, offsets padded to F*MAX_B+1 entries and ids to a fixed capacity."""
    idx, off, psw = testing.make_batch(rng, [TABLES[t].num_embeddings for t in FMAP], sizes, (0, 7),
                                       weighted=weighted)
    n_off = len(FMAP) * MAX_B + 1
    off_pad = np.concatenate([off, np.full(n_off - len(off), off[-1], np.int32)])
    cap = capacity or len(idx) + 5
    idx_pad = np.concatenate([idx, rng.integers(0, 5, cap - len(idx)).astype(np.int32)])  # padding past off[-1]
    psw_pad = None if psw is None else np.concatenate([psw, np.ones(cap - len(psw), np.float32)])
    return (idx, off, psw), (idx_pad, off_pad, psw_pad)


def _blocks(emb, flat_static, sizes):
    """The static form's flat output as per-feature [B_f, D_f] blocks."""
    out, pos = [], 0
    for b, d in zip(sizes, emb.feature_dims):
        out.append(np.asarray(flat_static[pos: pos + b * d]).reshape(b, d))
        pos += b * d
    return out


def _columns(emb):
    c = np.concatenate([[0], np.cumsum(emb.feature_dims)])
    return [slice(int(c[f]), int(c[f + 1])) for f in range(len(emb.feature_dims))]


@pytest.mark.parametrize("impl,pooling,weighted", [("xla", "mean", False), ("pallas", "sum", True)])
def test_forward_matches_static_form(rng, impl, pooling, weighted):
    emb = _emb(impl, pooling=pooling)
    params = emb.init(jax.random.key(0))
    sizes = (3, 0, 6, 2)
    (idx, off, psw), (idx_p, off_p, psw_p) = _batch(rng, sizes, weighted=weighted)
    static = emb(params, idx, off, psw, batch_size_per_feature=sizes)
    out = jax.jit(lambda p, i, o, w, s: emb(p, i, o, w, batch_size_per_feature=s, max_batch_size=MAX_B))(
        params, idx_p, off_p, psw_p, jnp.asarray(sizes, jnp.int32))
    assert out.shape == (MAX_B, sum(emb.feature_dims))
    for f, (blk, cols) in enumerate(zip(_blocks(emb, static, sizes), _columns(emb))):
        if sizes[f]:
            assert_close(out[: sizes[f], cols], blk, 1e-6)  # XLA may order a sum differently for another shape
        np.testing.assert_array_equal(np.asarray(out[sizes[f]:, cols]), 0)
    # the same through the VariableBatchSizes object
    out2 = emb(params, idx_p, off_p, psw_p,
               batch_size_per_feature=tbe_jax.VariableBatchSizes(jnp.asarray(sizes), MAX_B))
    assert_close(out2, out, 1e-6)  # another compiled program: XLA may order sums differently


@pytest.mark.parametrize("impl,opt", [("xla", tbe_jax.SGD(0.05)), ("pallas", tbe_jax.RowwiseAdagrad(0.1, eps=0.01))])
def test_step_matches_static_form(rng, impl, opt):
    emb = _emb(impl)
    params = emb.init(jax.random.key(1))
    state = emb.init_opt_state(params, opt)
    sizes = (5, 2, 0, 6)
    (idx, off, _), (idx_p, off_p, _) = _batch(rng, sizes)
    g = rng.normal(size=(MAX_B, sum(emb.feature_dims))).astype(np.float32)  # rows past B_f: ignored
    g_static = np.concatenate([g[: b, cols].reshape(-1) for b, cols in zip(sizes, _columns(emb))])
    p_s, s_s = emb.apply_gradients(params, state, opt, idx, off, g_static, batch_size_per_feature=sizes)
    step = jax.jit(lambda p, st, i, o, gg, s: emb.apply_gradients(p, st, opt, i, o, gg, batch_size_per_feature=s,
                                                                  max_batch_size=MAX_B))
    p_v, s_v = step(params, state, idx_p, off_p, g, jnp.asarray(sizes, jnp.int32))
    for a, b in zip(emb.get_tables(p_v), emb.get_tables(p_s)):
        assert_close(a, b, 1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(s_v), jax.tree_util.tree_leaves(s_s)):
        assert_close(a, b, 1e-6)


def test_one_compilation_for_changing_sizes(rng):
    emb = _emb("xla")  # the property is the kernels' too: they run on the same fixed-batch offsets
    params = emb.init(jax.random.key(2))
    opt = tbe_jax.RowwiseAdagrad(0.1)
    state = emb.init_opt_state(params, opt)
    traces = []
    cap = 200

    @jax.jit
    def step(p, st, i, o, s):
        traces.append(1)
        res = tbe_jax.train_step(
            lambda _, out: jnp.sum(out ** 2), None,
            tbe_jax.SparseLookup(emb, opt, p, st, i, o,
                                 options={"batch_size_per_feature": s, "max_batch_size": MAX_B}))
        return res.params, res.opt_state, res.loss

    losses = []
    for sizes in [(6, 1, 2, 0), (0, 6, 6, 3), (2, 2, 2, 2)]:
        (idx, off, _), (idx_p, off_p, _) = _batch(rng, sizes, capacity=cap)
        # the same step in the static form, for the expected loss
        static = emb(params, idx, off, batch_size_per_feature=sizes)
        params, state, loss = step(params, state, idx_p, off_p, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(float(loss), float(jnp.sum(static.astype(jnp.float32) ** 2)), rtol=1e-5)
        losses.append(float(loss))
    assert len(traces) == 1


def test_bad_sizes_clamped_reported_and_fatal(rng):
    sizes = (3, 2, 1, 1)
    (idx, off, _), (idx_p, off_p, _) = _batch(rng, sizes)
    bad = jnp.asarray([3, 9, -1, 1], jnp.int32)  # 9 > MAX_B, -1 < 0: two clamped sizes
    emb = _emb("xla")
    params = emb.init(jax.random.key(3))
    # "ignore" (the default): clamped to (3, 6, 0, 1); bags past offsets' end are dropped
    out = emb(params, idx_p, off_p, batch_size_per_feature=bad, max_batch_size=MAX_B)
    assert out.shape == (MAX_B, sum(emb.feature_dims))
    warn = _emb("xla", bounds_check="warning")
    _, rep = warn.forward_with_report(params, idx_p, off_p, batch_size_per_feature=bad, max_batch_size=MAX_B)
    assert int(rep.repaired_offsets) == 2
    rep = warn.bounds_report(idx_p, off_p, batch_size_per_feature=bad, max_batch_size=MAX_B)
    assert int(rep.repaired_offsets) == 2
    with pytest.warns(RuntimeWarning, match="clamped"):
        jax.block_until_ready(warn(params, idx_p, off_p, batch_size_per_feature=bad, max_batch_size=MAX_B))
    fatal = _emb("xla", bounds_check="fatal")
    with pytest.raises(ValueError, match="batch_size_per_feature"):
        fatal(params, idx_p, off_p, batch_size_per_feature=bad, max_batch_size=MAX_B)
    f = checkify.checkify(jax.jit(
        lambda p, i, o, s: fatal(p, i, o, batch_size_per_feature=s, max_batch_size=MAX_B)))
    err, _ = f(params, idx_p, off_p, bad)
    with pytest.raises(Exception, match="batch_size_per_feature"):
        err.throw()
    err, _ = f(params, idx_p, off_p, jnp.asarray(sizes, jnp.int32))
    err.throw()  # valid sizes: no error


def test_sizes_past_the_end_of_offsets(rng):
    """Sizes summing past len(offsets)-1: the last features lose their bags (zeros), nothing is read out of range."""
    emb = _emb("xla")
    params = emb.init(jax.random.key(4))
    sizes = (2, 2, 2, 2)
    (idx, off, _), _ = _batch(rng, sizes)
    short = off[:6]  # room for 5 bags: features 0, 1 whole, feature 2 one bag, feature 3 none
    out = emb(params, idx, short, batch_size_per_feature=jnp.asarray(sizes), max_batch_size=3)
    static = emb(params, idx[: off[5]], off[:6], batch_size_per_feature=(2, 2, 1, 0))
    cols = _columns(emb)
    for f, (blk, b) in enumerate(zip(_blocks(emb, static, (2, 2, 1, 0)), (2, 2, 1, 0))):
        if b:
            assert_close(out[:b, cols[f]], blk, 1e-6)
        np.testing.assert_array_equal(np.asarray(out[b:, cols[f]]), 0)


def test_errors():
    emb = _emb("xla")
    params = emb.init(jax.random.key(5))
    idx, off = jnp.zeros((4,), jnp.int32), jnp.zeros((9,), jnp.int32)
    with pytest.raises(ValueError, match="max_batch_size"):
        jax.jit(lambda s: emb(params, idx, off, batch_size_per_feature=s))(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="shape"):
        emb(params, idx, off, batch_size_per_feature=jnp.ones((3,), jnp.int32), max_batch_size=2)
    with pytest.raises(ValueError, match="max_batch_size"):
        emb(params, idx, off, batch_size_per_feature=jnp.ones((4,), jnp.int32), max_batch_size=-1)
