"""`tt_jax.kernels.plan.build_flow`: the plan's bookkeeping in Pallas passes gives exactly the XLA bookkeeping's
plan, `prefix.build_flow`'s (interpret mode here; compiled on a GPU)."""

import jax
import numpy as np
import pytest

import tt_jax
from conftest import ON_GPU
from tbe_jax import testing
from tt_jax import prefix
from tt_jax.kernels import plan as plan_kernels

T2 = tt_jax.TTSpec(97, 8, p_shapes=(10, 10), q_shapes=(2, 4), ranks=(3,))
T3 = tt_jax.TTSpec(200, 12, p_shapes=(4, 5, 11), q_shapes=(2, 3, 2), ranks=(3, 4))
T3B = tt_jax.TTSpec(150, 12, p_shapes=(3, 6, 9), q_shapes=(2, 3, 2), ranks=(3, 4))
T4 = tt_jax.TTSpec(350, 16, p_shapes=(3, 4, 5, 6), q_shapes=(2, 2, 2, 2), ranks=(2, 4, 3))


def plans(specs, ftm, batch, bag_len, rng, limits=None, **kw):
    layout, feats = prefix.stack_tables(specs, ftm, **(limits or {}))[0]
    idx, off, _ = testing.make_batch(rng, [specs[t].num_embeddings for t in ftm], [batch] * len(ftm), bag_len,
                                     alpha=1.2)
    idx[[0, 3, 8]] = [-1, 10**6, idx[2]]  # out of range both ways, a duplicate
    common = dict(features=feats, feature_table_map=ftm, batch=batch, **kw)
    return [jax.jit(lambda i, o: prefix.build_flow(layout, i, o, **common))(idx, off),
            jax.jit(lambda i, o: plan_kernels.build_flow(layout, i, o, interpret=not ON_GPU, **common))(idx, off)]


@pytest.mark.parametrize("specs,ftm,batch,bag_len,kw", [
    ((T3,), (0, 0), 60, (0, 30), dict(chunk=3)),  # one table, > 2 blocks of lookups, empty bags
    ((T3, T3B), (1, 0, 1), 20, (0, 12), dict(chunk=0)),  # stacked tables, whole groups
    ((T4,), (0,), 30, (1, 9), dict(prefix_reuse=False)),  # T = 4, one item per row
    ((T2, T2), (0, 1), 16, (0, 6), dict(chunk=2)),  # T = 2, stacked
], ids=["t3-chunk3", "stacked-whole-groups", "t4-unique", "t2-stacked"])
def test_fused_bookkeeping_equals_xla(rng, specs, ftm, batch, bag_len, kw):
    want, got = plans(specs, ftm, batch, bag_len, rng, **kw)
    for name, a, b in zip(want._fields, want, got):
        if a is None:
            assert b is None, name
            continue
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
    assert int(want.num_rows) > 0 and int(want.num_items[0]) > 0


def test_fused_bookkeeping_two_key_sort(rng):
    # Stacked tables too large for one packed int32 key sort (table, id) pairs: the same bookkeeping.
    assert not prefix.stack_tables((T3, T3B), (0, 1), packed_limit=0)[0][0].packed
    want, got = plans((T3, T3B), (0, 1), 12, (0, 8), rng, limits=dict(packed_limit=0), chunk=4)
    for name, a, b in zip(want._fields, want, got):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
