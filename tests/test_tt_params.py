"""tt_jax's params layout (`tt_jax.params`): each table group's cores stored stacked, one buffer per core.

The storage changed, not the arithmetic: lookups equal the per-table reference bitwise, an optimizer step on
the stacked buffers equals the per-table step of earlier releases, no step concatenates cores, and the
per-table accessors and the migration from the per-table layout (`set_cores`, `stack_opt_state`) work.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
import tt_jax
from conftest import ON_GPU, jaxpr_eqns
from tt_jax import backward, optim, prefix, reference
from tt_jax import params as params_lib
from tt_jax.kernels import backward as kernel_backward
from tt_jax.kernels.forward import pooled_forward

# Tables 0, 1 and 3 share (q_shapes, ranks): one group; 2 and 4 another; 5 is alone (and read by no feature).
SPECS = (
    tt_jax.TTSpec(60, 8, p_shapes=(3, 4, 5), q_shapes=(2, 2, 2), ranks=(3, 2)),
    tt_jax.TTSpec(24, 8, p_shapes=(2, 3, 4), q_shapes=(2, 2, 2), ranks=(3, 2)),
    tt_jax.TTSpec(30, 4, p_shapes=(5, 6), q_shapes=(2, 2), ranks=(2,)),
    tt_jax.TTSpec(40, 8, p_shapes=(2, 4, 5), q_shapes=(2, 2, 2), ranks=(3, 2)),
    tt_jax.TTSpec(12, 4, p_shapes=(3, 4), q_shapes=(2, 2), ranks=(2,)),
    tt_jax.TTSpec(16, 4, p_shapes=(4, 4), q_shapes=(2, 2), ranks=(3,)),
)
FTM = (0, 1, 2, 3, 0, 4)
B = 4


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 4, size=len(FTM) * B)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    idx = np.concatenate([rng.integers(-1, SPECS[t].num_embeddings + 2, size=int(lens[f * B:(f + 1) * B].sum()))
                          for f, t in enumerate(FTM)]).astype(np.int32)  # bad ids too
    psw = rng.normal(size=idx.shape).astype(np.float32)
    g = rng.normal(size=(B, sum(SPECS[t].embedding_dim for t in FTM))).astype(np.float32)
    return idx, off, psw, g


def _emb(impl="xla", specs=SPECS, ftm=FTM):
    return tt_jax.TTEmbeddingBag(list(specs), feature_table_map=ftm, impl=impl, interpret=True)


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_layout_and_accessors_round_trip():
    emb = _emb()
    params = emb.init(jax.random.key(0))
    groups = prefix.core_groups(SPECS)
    assert [g.tables for g in groups] == [(0, 1, 3), (2, 4), (5,)]
    assert jax.tree.map(jnp.shape, params["cores"]) == (
        ((7, 1, 2, 3), (11, 3, 2, 2), (14, 2, 2, 1)), ((8, 1, 2, 2), (10, 2, 2, 1)), ((4, 1, 2, 3), (4, 3, 2, 1)))
    tables = emb.get_cores(params)
    assert [[c.shape for c in cs] for cs in tables] == [list(s.core_shapes()) for s in SPECS]
    # The buffers are the tables' cores stacked along p, in the group's table order (`core_base`).
    for g, layout in enumerate(groups):
        for t, buf in enumerate(params["cores"][g]):
            want = np.concatenate([np.asarray(tables[k][t]) for k in layout.tables])
            assert _bits_equal(buf, want)
            np.testing.assert_array_equal(np.asarray(prefix.stack_cores(layout, tables)[t]), want.reshape(-1))
    # set_cores(get_cores(p)) is p; get_cores(set_cores(c)) is c.
    back = emb.set_cores(None, tables)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(_bits_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    rng = np.random.default_rng(1)
    mine = [[rng.normal(size=s).astype(np.float32) for s in spec.core_shapes()] for spec in SPECS]
    got = emb.get_cores(emb.set_cores(None, mine))
    assert all(_bits_equal(a, b) for cs, ms in zip(got, mine) for a, b in zip(cs, ms))
    # full_table reads the per-table view.
    for tab, spec in zip(emb.full_table(params), SPECS):
        assert tab.shape == (spec.num_embeddings, spec.embedding_dim)


def test_init_draws_the_per_table_values():
    # The stacking happens after the draw: the cores are the per-table layout's for the same key.
    key = jax.random.key(7)
    for init in ("approx-normal", "approx-uniform"):
        got = _emb().get_cores(_emb().init(key, init=init))
        for i, spec in enumerate(SPECS):
            sigma = ((1.0 / math.sqrt(3 * spec.num_embeddings)) ** 2 / math.prod(spec.ranks)) ** (
                1.0 / (2 * spec.num_cores))
            for t, shape in enumerate(spec.core_shapes()):
                k = jax.random.fold_in(jax.random.fold_in(key, i), t)
                if init == "approx-normal":
                    want = sigma * jax.random.normal(k, shape, jnp.float32)
                else:
                    a = sigma * math.sqrt(3.0)
                    want = jax.random.uniform(k, shape, jnp.float32, -a, a)
                assert _bits_equal(got[i][t], want), (init, i, t)


def test_per_table_params_are_refused_with_the_conversion():
    emb = _emb()
    params = emb.init(jax.random.key(0))
    old = {"cores": tuple(tuple(cs) for cs in emb.get_cores(params))}  # the layout of earlier releases
    idx, off, _, _ = _batch()
    for call in (lambda p: emb(p, idx, off), emb.get_cores, emb.full_table,
                 lambda p: emb.init_opt_state(p, tt_jax.SGD(0.1))):
        with pytest.raises(ValueError, match=r"params\['cores'\] holds per-table cores \(6 tables\).*3 table "
                                             r"group\(s\) \[\(0, 1, 3\), \(2, 4\), \(5,\)\].*emb.set_cores\(None, "):
            call(old)
    with pytest.raises(ValueError, match="holds per-table cores"):
        emb.shard(jax.make_mesh((1,), ("data",))).check_params(old)
    converted = emb.set_cores(None, old["cores"])
    assert all(_bits_equal(a, b) for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(params)))
    # Where every table is alone in its group, the two layouts are the same: old params are valid as they are.
    solo = _emb(specs=(SPECS[0], SPECS[2], SPECS[5]), ftm=(0, 1, 2))
    solo.check_params({"cores": tuple(tuple(cs) for cs in solo.get_cores(solo.init(jax.random.key(0))))})
    # Other wrong structures name the groups.
    with pytest.raises(ValueError, match=r"must hold the stacked cores of 3 table group\(s\).*got 2"):
        emb({"cores": params["cores"][:2]}, idx, off)
    with pytest.raises(ValueError, match=r"params\['cores'\]\[0\] must have shapes \[\(7, 1, 2, 3\), \(11, 3, 2, 2\), "
                                         r"\(14, 2, 2, 1\)\] \(tables \(0, 1, 3\) stacked along p\)"):
        emb({"cores": (params["cores"][1],) + params["cores"][1:]}, idx, off)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_optimizer_state_stacked_like_the_cores(kind):
    emb = _emb()
    params = emb.init(jax.random.key(0))
    opt = {"sgd": tt_jax.SGD(0.1), "rowwise_adagrad": tt_jax.RowwiseAdagrad(0.1), "adam": tt_jax.Adam(0.1)}[kind]
    state = emb.init_opt_state(params, opt)
    idx, off, psw, g = _batch()
    state = emb.apply_gradients(params, state, opt, idx, off, g, psw)[1]
    fields = [f for f in state._fields if f != "count"]
    for f in fields:
        per_table = emb.get_state(state, f)
        for k, spec in enumerate(SPECS):
            for t, shape in enumerate(spec.core_shapes()):
                assert per_table[k][t].shape in (shape, shape[:1])
        # An old-layout state ({"cores": per table, per core}) converts to this one.
        old = state._replace(**{x: {"cores": tuple(map(tuple, emb.get_state(state, x)))} for x in fields})
        back = emb.stack_opt_state(old)
        assert jax.tree.structure(back) == jax.tree.structure(state)
        assert all(_bits_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)))
    if not fields:
        assert emb.stack_opt_state(state) == state


# -- the same numbers as the per-table layout ------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_equals_the_per_table_reference_bitwise(weighted):
    idx, off, psw, _ = _batch()
    w = psw if weighted else None
    emb = _emb("xla")
    params = emb.init(jax.random.key(0), std=0.3)
    tables = emb.get_cores(params)
    got = jax.jit(lambda p: emb(p, idx, off, w))(params)
    want = jax.jit(lambda c: reference.pooled([c[t] for t in FTM], [SPECS[t] for t in FTM], jnp.asarray(idx),
                                              jnp.asarray(off), w, pooling="sum", batch=B))(tables)
    if jax.default_backend() == "cpu":
        assert _bits_equal(got, want)
    else:  # two XLA GPU programs may contract the weighted multiply-adds into FMAs differently (an ulp apart)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-7)
    # The kernels read the buffers as they are: the same bytes as the per-table cores concatenated.
    pal = _emb("pallas")
    got = jax.jit(lambda p: pal(p, idx, off, w))(params)
    flat = [prefix.stack_cores(layout, tables) for layout in prefix.core_groups(SPECS)]
    want = jax.jit(lambda c: pooled_forward(c, SPECS, FTM, jnp.asarray(idx), jnp.asarray(off), w, batch=B,
                                            pooling="sum", config=pal.config, interpret=True).out)(flat)
    assert _bits_equal(got, want)
    np.testing.assert_allclose(np.asarray(got), np.asarray(emb(params, idx, off, w)), rtol=1e-5, atol=1e-6)


def _per_table_step(emb, opt, params, state, idx, off, psw, g):
    """The step of the per-table layout: the same gradients, then one update per table per core."""
    o_i, w, batch = jnp.asarray(off), jnp.asarray(psw), B  # int32 and float32 already: as the step takes them
    plans = emb.flow_plans(batch, jnp.asarray(idx), o_i)
    rule, hyper = opt.rule(), opt.hyperparameters(state.count)
    cores = params["cores"]
    slots = [params_lib.unstack(SPECS, s["cores"]) for s in opt.slots(state)]
    tables = params_lib.unstack(SPECS, cores)
    groups = prefix.core_groups(SPECS)
    if emb.pallas_backward:
        dense, _ = kernel_backward.dense_core_grads(cores, SPECS, FTM, plans, o_i, w, jnp.asarray(g), batch=batch,
                                                    pooling="sum", want_psw=False, config=emb.config, interpret=True)
        touched = (backward.touched_slices(SPECS, FTM, plans) if optim.needs_touched_mask(rule) else None)
    else:
        sparse = backward.touched_core_grads(cores, SPECS, FTM, plans, o_i, w, jnp.asarray(g), batch=batch,
                                             pooling="sum")
    new = [list(cs) for cs in tables]
    new_slots = [[list(cs) for cs in s] for s in slots]
    for gi, layout in enumerate(groups):
        for i, k in enumerate(layout.tables):
            for t in range(layout.num_cores):
                b0, b1 = layout.core_base[t][i], layout.core_base[t][i + 1]
                s = tuple(sl[k][t] for sl in slots)
                if emb.pallas_backward:
                    if dense[gi][t] is None:
                        continue
                    mask = None if touched is None else touched[gi][t][b0:b1]
                    c, s = optim.update_dense(rule, hyper, tables[k][t], s, dense[gi][t][b0:b1], mask)
                else:
                    if sparse[gi][t] is None:
                        continue
                    ids, gr = sparse[gi][t]
                    local = jnp.where((ids >= b0) & (ids < b1), ids - b0, b1 - b0)
                    c, s = optim.update_slices(rule, hyper, tables[k][t], s, local, gr)
                new[k][t] = c
                for j, x in enumerate(s):
                    new_slots[j][k][t] = x
    return new, new_slots


OPTS = {
    "sgd": tt_jax.SGD(0.1), "adagrad": tt_jax.Adagrad(0.1), "rowwise_adagrad": tt_jax.RowwiseAdagrad(0.1),
    "rowwise_adagrad_wd": tt_jax.RowwiseAdagrad(0.1, weight_decay=0.01, weight_decay_mode="decoupled"),
    "adam": tt_jax.Adam(0.01, weight_decay=0.01), "partial_rowwise_lamb": tt_jax.PartialRowwiseLamb(0.01),
}


# Each optimizer on one impl, SGD (the bitwise case) on both: the stacking is the same code for every rule.
# In interpret mode (CPU) the Pallas stacking runs in [sgd-pallas]; the other Pallas variants are compiled only.
_RULE_ON_PALLAS = {
    "rowwise_adagrad": "test_tt_grad.py::test_apply_gradients_matches_numpy[rowwise-pallas]",
    "adam": "test_tt_adam.py::test_family_matches_float64_model[pallas]"}
@pytest.mark.parametrize("kind,impl", [
    ("sgd", "xla"), ("sgd", "pallas"), ("adagrad", "xla"),
    *[pytest.param(k, "pallas", marks=pytest.mark.skipif(not ON_GPU, reason=(
        f"compiled only; interpret mode covers the Pallas stacking in [sgd-pallas], this rule on the Pallas "
        f"path in {_RULE_ON_PALLAS[k]}"))) for k in ("rowwise_adagrad", "adam")],
    ("rowwise_adagrad_wd", "xla"), ("partial_rowwise_lamb", "xla")])
def test_update_equals_the_per_table_update(kind, impl):
    emb, opt = _emb(impl), OPTS[kind]
    params = emb.init(jax.random.key(0), std=0.3)
    state = emb.init_opt_state(params, opt)
    idx, off, psw, g = _batch(1)
    params, state = emb.apply_gradients(params, state, opt, idx, off, g, psw)  # moments not all zero
    idx, off, psw, g = _batch(2)
    got_p, got_s = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g, psw))(params, state)
    want_p, want_s = jax.jit(lambda p, s: _per_table_step(emb, opt, p, s, idx, off, psw, g))(params, state)
    got = emb.get_cores(got_p), [emb.get_state(got_s, f) for f in got_s._fields if f != "count"]
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves((want_p, want_s))))
    assert len(leaves) == sum(s.num_cores for s in SPECS) * (1 + len(got[1]))
    if opt.rule().kind == "sgd" and not ON_GPU:
        # (Compiled for the GPU, XLA contracts SGD's `w - lr * g` into an FMA in one program and not the
        # other too: the tolerance below there.)
        assert all(_bits_equal(a, b) for a, b in leaves)
    else:
        # The same jnp ops on the same values, but XLA's CPU compiler contracts a multiply-add (`m + g * g`,
        # `b1 m + (1 - b1) g`) into an FMA or not, on one product or the other, depending on the program around
        # it (the per-table program slices the buffers, the stacked one does not): an ulp apart in a few
        # elements, more after the update's cancellation. The forward and the gradients are bitwise the same.
        for a, b in leaves:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert sum(_bits_equal(a, b) for a, b in leaves) >= len(leaves) // 2
    # The untouched core of table 5 (no feature reads it) did not move.
    assert _bits_equal(got_p["cores"][2][0], params["cores"][2][0])


# -- no concatenation of the cores in a step -------------------------------------------------------------------


def _core_concats(fn, *args, sizes):
    """The float `concatenate`s in `fn`'s jaxpr whose output has a stacked core's size."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e for e in jaxpr_eqns(jaxpr) if e.primitive.name == "concatenate"
            and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating) and e.outvars[0].aval.size in sizes]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_no_core_concatenation_in_the_step(impl):
    emb = _emb(impl)
    opt = tt_jax.Adam(0.01)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    idx, off, psw, g = _batch()
    sizes = {buf.size for cs, layout in zip(params["cores"], prefix.core_groups(SPECS)) if len(layout.tables) > 1
             for buf in cs}

    def grad_step(p, s):  # the true-gradient path: jax.grad through the lookup, then the sparse update
        d = jax.grad(lambda q: jnp.sum(emb(q, idx, off, psw) * g))(p)
        return emb.apply_gradients(jax.tree.map(lambda a, b: a - 0.1 * b, p, d), s, opt, idx, off, g, psw)

    def train_step(p, s):
        res = tbe_jax.train_step(lambda dense, out: jnp.sum(out * g), {},
                                 tbe_jax.SparseLookup(emb, opt, p, s, idx, off, psw))
        return res.params, res.opt_state

    for fn in (grad_step, train_step):
        assert not _core_concats(jax.jit(fn), params, state, sizes=sizes), fn.__name__
    # The check sees one: the per-table layout's stacking, as the steps did before.
    stacked_on_the_fly = jax.jit(lambda p: [prefix.stack_cores(layout, emb.get_cores(p))
                                            for layout in prefix.core_groups(SPECS)])
    assert len(_core_concats(stacked_on_the_fly, params, sizes=sizes)) == 5
