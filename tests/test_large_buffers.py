"""Storage buffers past 2**32 bytes (more than 2**31 elements): the kernels' row addressing.

A TBE keeps all tables of one dim in one `[rows, D]` buffer; MLPerf's DLRMv2 tables make a
`[204184588, 128]` one (97 GiB in fp32). An element offset `row * D` of such a buffer is past
int32, so a kernel that addressed it in 32 bits would read and write the wrong rows. These
tests look up and update rows near the end of a buffer of more than 2**31 elements and compare
them with a gather of the same rows (XLA's, 64-bit). GPU only: the buffers are 4 to 9 GB.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from conftest import KERNEL_KW, ON_GPU

pytestmark = pytest.mark.skipif(not ON_GPU, reason="buffers of 4 to 9 GB: GPU only")

BIG = 17_000_000  # rows of D=128: 2.18e9 elements, past 2**31


def _batch(rng, rows, batch, bag):
    """Bags of ids in the last 100k rows of table 0 (with repeats) and anywhere in table 1."""
    ids0 = rng.integers(rows[0] - 100_000, rows[0], (batch, bag))
    ids0[:, 0] = rows[0] - 1  # the very last row in every bag: a long run in the backward
    ids1 = rng.integers(0, rows[1], (batch, bag))
    indices = np.concatenate([ids0.ravel(), ids1.ravel()]).astype(np.int32)
    offsets = (np.arange(2 * batch + 1) * bag).astype(np.int32)
    return indices, offsets, ids0, ids1


@pytest.mark.parametrize("wdtype", ["float32", "float16"])
def test_rows_past_int32_elements_look_up_and_update(rng, wdtype):
    rows, d, batch, bag = (BIG, 1000), 128, 64, 5
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(r, d) for r in rows], weights_dtype=wdtype,
                                        **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    assert params[emb.layout.key(0)].size > 2**31
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1, eps=1e-8)
    state = emb.init_opt_state(params, opt)
    indices, offsets, ids0, ids1 = _batch(rng, rows, batch, bag)
    buf = params[emb.layout.key(0)]
    global_ids = np.concatenate([ids0.ravel(), ids1.ravel() + rows[0]])

    def gather(p, ids):
        return np.asarray(p[emb.layout.key(0)][jnp.asarray(ids)][:, :d], np.float64)

    before = gather(params, global_ids).reshape(2, batch, bag, d)
    out = np.asarray(jax.jit(emb)(params, indices, offsets), np.float64).reshape(batch, 2, d)
    ref = before.sum(axis=2).transpose(1, 0, 2)  # [batch, feature, d]
    scale = np.abs(ref).max()
    tol = 1e-6 if wdtype == "float32" else 2e-3
    assert np.abs(out - ref).max() <= tol * scale

    g = rng.standard_normal((batch, 2 * d)).astype(np.float32)
    step = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, indices, offsets, g), donate_argnums=(0, 1))
    probe = np.array([rows[0] - 100_001, rows[0] - 200_000, 5])  # untouched rows keep their values
    probe_before = gather(params, probe)
    del buf
    params, state = step(params, state)

    # float64 model: each touched row's gradient is the sum of its bags' output gradients
    gs = g.reshape(batch, 2, d)
    uniq, inv = np.unique(global_ids, return_inverse=True)
    grad = np.zeros((len(uniq), d))
    np.add.at(grad, inv, np.repeat(gs.transpose(1, 0, 2).reshape(2 * batch, d), bag, axis=0))
    w0 = np.zeros((len(uniq), d))
    w0[inv] = before.reshape(-1, d)
    m = np.mean(grad**2, axis=1)
    want = w0 - 0.1 * grad / (np.sqrt(m)[:, None] + 1e-8)
    got = gather(params, uniq)
    tol = 1e-5 if wdtype == "float32" else 2e-3
    assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1.0)
    mom = np.asarray(emb.get_momentum(state)[0])[uniq[uniq < rows[0]]]
    np.testing.assert_allclose(mom, m[uniq < rows[0]], rtol=1e-5)
    np.testing.assert_array_equal(gather(params, probe), probe_before)
