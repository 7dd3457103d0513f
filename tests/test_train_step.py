"""`tbe_jax.train_step`: what it refuses."""

import jax
import jax.numpy as jnp
import pytest

import tbe_jax


def test_train_step_refuses_one_table_in_two_lookups():
    """Two lookups of the same tables in one step would each update from the old values: refused."""
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(10, 4)], impl="xla")
    opt = tbe_jax.SGD(0.1)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    idx, off = jnp.array([1, 2], jnp.int32), jnp.array([0, 2], jnp.int32)
    lk = tbe_jax.SparseLookup(emb, opt, params, state, idx, off)
    with pytest.raises(ValueError, match="share tables"):
        tbe_jax.train_step(lambda d, outs: outs["a"].sum() + outs["b"].sum(), None, {"a": lk, "b": lk})
