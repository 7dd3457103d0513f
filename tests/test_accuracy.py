"""fp32 pooling accuracy: the accurate accumulations, and the fp32 default's error bound.

With `ForwardConfig(fp32_accumulation="fp64")` or `"twosum"`, a bag of L=4096 terms of mixed magnitude (and sign,
so the sum cancels) must be within 2 ulp of the float64 result; the default fp32 sums (FBGEMM's CUDA
accumulation) are not, but stay within the recursive-summation bound (L - 1) * eps * sum|x|.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from conftest import KERNEL_KW

L = 4096
D = 32


def _bag(rng):
    mag = 10.0 ** rng.uniform(-3, 3, size=(L, D))
    vals = (mag * rng.choice([-1.0, 1.0], size=(L, D))).astype(np.float32)
    return vals


def _ulp_error(out, vals):
    exact = vals.astype(np.float64).sum(axis=0)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(np.asarray(out, np.float64) - exact) / ulp


def _pool(vals, config):
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(L, D)], kernel_config=config, **KERNEL_KW)
    params = emb.set_tables(None, [jnp.asarray(vals)])
    idx = np.arange(L, dtype=np.int32)
    return emb(params, idx, np.array([0, L], np.int32))[0]


@pytest.mark.parametrize("mode", ["fp64", "twosum"])
def test_fp32_within_2ulp(mode):
    rng = np.random.default_rng(0)
    for _ in range(3):
        vals = _bag(rng)
        err = _ulp_error(_pool(vals, tbe_jax.ForwardConfig(fp32_accumulation=mode)), vals)
        assert err.max() <= 2.0, err.max()


def test_default_sums_in_fp32_within_the_summation_bound():
    assert tbe_jax.ForwardConfig().fp32_accumulation == "fp32"
    rng = np.random.default_rng(0)
    vals = _bag(rng)
    out = np.asarray(_pool(vals, tbe_jax.ForwardConfig()), np.float64)
    exact = vals.astype(np.float64).sum(axis=0)
    bound = (L - 1) * np.finfo(np.float32).eps * np.abs(vals.astype(np.float64)).sum(axis=0)
    assert np.all(np.abs(out - exact) <= bound)
    err = _ulp_error(out, vals)
    assert err.max() > 2.0, err.max()  # what the accurate modes are for
