"""jax.grad through a lookup: the true gradient of the tables and per-sample weights.

With impl="pallas" the forward and the table gradient run the kernels (compiled on
GPU, interpret mode on CPU): the sorted-run backward stores each looked-up row's
summed gradient into a zero gradient. With impl="xla" both are the jnp reference.
Checked against a float64 model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, ON_GPU, assert_close, specs, tables_f64


def _grads(emb, params, idx, off, psw, g, bpf=None):
    def loss(p, w):
        out = emb(p, idx, off, w, batch_size_per_feature=bpf)
        return jnp.sum(out.astype(jnp.float32) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, psw)


@pytest.mark.parametrize("impl", ["xla", "kernel"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_table_and_weight_gradients(rng, impl, pooling, weighted):
    # E=7: duplicates within bags; d16 and d12 are two buffers of one width class (16) of the backward
    if not ON_GPU and impl == "kernel" and (pooling == "mean") != weighted:
        # Pairwise in interpret mode (as test_forward_kernel.py): [False-sum-kernel] and [True-mean-kernel] run each
        # pooling and each weighting through the kernels; the other two pairs run compiled and on the XLA path.
        pytest.skip("compiled only (interpret mode: [False-sum-kernel] and [True-mean-kernel] cover each pooling "
                    "and weighting)")
    tables = specs([12, 7, 30], [5, 16, 12])
    fmap = [0, 1, 2, 1]
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, pooling=pooling, **kw)
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    batch = [5] * 4
    idx, off, psw = testing.make_batch(rng, [tables[t].num_embeddings for t in fmap], batch, (0, 9),
                                       weighted=True)
    g = rng.standard_normal((5, sum(emb.feature_dims))).astype(np.float32)
    w = jnp.asarray(psw) if weighted else None
    d_params, d_psw = _grads(emb, params, idx, off, w, g)
    d_tables, d_psw_model = testing.numpy_pooled_vjp(
        tables_f64(emb, params), fmap, batch, idx, off, psw if weighted else None, g, pooling, False)
    for got, want in zip(emb.get_tables(d_params), d_tables):
        assert_close(got, want, 1e-5)
    if weighted:
        assert_close(d_psw, d_psw_model, 1e-5)


def test_vbe_and_untouched_rows(rng):
    tables = specs([40, 25], [8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    params = emb.init(jax.random.key(1))
    batch = (6, 3)
    idx, off, _ = testing.make_batch(rng, [40, 25], list(batch), (0, 5))
    g = rng.standard_normal(6 * 8 + 3 * 8).astype(np.float32)
    d_params, _ = _grads(emb, params, idx, off, None, g, bpf=batch)
    d_tables, _ = testing.numpy_pooled_vjp(tables_f64(emb, params), [0, 1], batch, idx, off, None, g, "sum", True)
    got = emb.get_tables(d_params)
    for t in range(2):
        assert_close(got[t], d_tables[t], 1e-5)
        untouched = np.all(d_tables[t] == 0, axis=1)
        assert np.all(np.asarray(got[t])[untouched] == 0)


def test_sequence_gradient(rng):
    tables = specs([20, 30], [8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, pooling="none", **KERNEL_KW)
    params = emb.init(jax.random.key(2))
    idx, off, psw = testing.make_batch(rng, [20, 30], [4, 4], (0, 6), weighted=True)
    g = rng.standard_normal((len(idx), 8)).astype(np.float32)
    d_params, d_psw = _grads(emb, params, idx, off, jnp.asarray(psw), g)
    tabs = tables_f64(emb, params)
    want = [np.zeros_like(t) for t in tabs]
    want_psw = np.zeros(len(idx))
    feat = np.repeat([0, 1], [off[4] - off[0], off[8] - off[4]])
    for p in range(len(idx)):
        want[feat[p]][idx[p]] += psw[p] * g[p]
        want_psw[p] = tabs[feat[p]][idx[p]] @ g[p]
    for got, w in zip(emb.get_tables(d_params), want):
        assert_close(got, w, 1e-5)
    assert_close(d_psw, want_psw, 1e-5)


def test_low_precision_tables_get_gradients_in_their_dtype(rng):
    tables = specs([10], [16])
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.bfloat16, **KERNEL_KW)
    params = emb.init(jax.random.key(3))
    idx = np.array([1, 1, 2], np.int32)
    off = np.array([0, 3], np.int32)
    d_params, _ = _grads(emb, params, idx, off, None, np.ones((1, 16), np.float32))
    assert d_params["d16"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(d_params["d16"], np.float32)[:3, 0], [0, 2, 1])


def test_sgd_training_step_lowers_the_loss(rng):
    # The true-gradient mode with a plain SGD step, jitted: a toy regression.
    tables = specs([50, 50], [8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, pooling="mean", **KERNEL_KW)
    params = emb.init(jax.random.key(4))
    idx, off, _ = testing.make_batch(rng, [50, 50], [16, 16], (1, 6))
    target = rng.standard_normal((16, 16)).astype(np.float32)

    def loss(p):
        return jnp.mean((emb(p, idx, off) - target) ** 2)

    @jax.jit
    def step(p):
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree_util.tree_map(lambda w, d: w - 30.0 * d, p, g), l

    losses = []
    for _ in range(20):
        params, l = step(params)
        losses.append(float(l))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("impl", ["xla", "kernel"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_nan_does_not_leak_through_padding(impl, pooling):
    """A NaN in sample 0's output gradient, padding past offsets[-1] (ids 0, NaN weights) and an invalid id in
    sample 0's bag: only the rows sample 0's valid ids name get NaN, in the forward, jax.grad (tables and
    weights) and apply_gradients without skip_nonfinite; the padding and invalid lookups contribute exactly 0."""
    if not ON_GPU and impl == "kernel" and pooling == "mean":
        # The padding and invalid-id masking is the same kernel code for both poolings ([sum-kernel] in interpret
        # mode); mean pooling's gradient through the kernels: test_table_and_weight_gradients[True-mean-kernel].
        pytest.skip("compiled only (interpret mode: [sum-kernel], [mean-xla], "
                    "test_table_and_weight_gradients[True-mean-kernel])")
    kw = KERNEL_KW if impl == "kernel" else dict(impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(specs([10, 12], [4, 8]), pooling=pooling, **kw)
    params = emb.init(jax.random.key(0))
    idx = np.array([3, 25, 4, 5, 6, 7, 0, 0, 0], np.int32)  # 25: invalid in table 0
    off = np.array([0, 2, 4, 5, 6], np.int32)  # bags: [3, 25] [4, 5] | [6] [7]; then 3 padding slots
    psw = np.array([1, 1, 1, 1, 1, 1, np.nan, np.nan, np.nan], np.float32)
    g = np.zeros((2, 12), np.float32)
    g[0, 0] = np.nan  # sample 0, feature 0
    out = emb(params, idx, off, psw)
    assert np.isfinite(np.asarray(out)).all()
    dp, dw = _grads(emb, params, idx, off, psw, g)
    nan_rows = {k: np.flatnonzero(np.isnan(np.asarray(v)).any(axis=1)).tolist() for k, v in dp.items()}
    assert nan_rows == {"d4": [3], "d8": []}, nan_rows
    dw = np.asarray(dw)
    assert np.isnan(dw[:2]).any() and np.isfinite(dw[2:]).all() and (dw[6:] == 0).all(), dw
    opt = tbe_jax.SGD(0.1, skip_nonfinite=False)
    new, _ = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g, psw))(
        params, emb.init_opt_state(params, opt))
    nan_rows = {k: np.flatnonzero(np.isnan(np.asarray(v)).any(axis=1)).tolist() for k, v in new.items()}
    assert nan_rows == {"d4": [3], "d8": []}, nan_rows
