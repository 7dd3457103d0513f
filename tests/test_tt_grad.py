"""TT training: core gradients of the prefix-sharing backward and the optimizers on core slices.

Oracles: a float64 NumPy model straight from the TT chain rule (per lookup, left and right partial
products, no prefix sharing) and `jax.grad` of the jnp reference (`reference.pooled`). The Pallas
forward and backward run compiled on a GPU and in interpret mode on CPU (`KERNEL_KW`); `PALLAS_CFG`
uses the smallest backward tiles so that small batches have rows and slices cut by tile edges.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
import tt_jax
from conftest import KERNEL_KW, ON_GPU, assert_close, learning_rate_f64
from tbe_jax import testing
from tt_jax import reference
from tt_jax.kernels.forward import TTKernelConfig

# N is never a product of p; T3 and T3B share (q, ranks), so they are stacked into one group.
T2 = tt_jax.TTSpec(97, 8, p_shapes=(10, 10), q_shapes=(2, 4), ranks=(3,))
T3 = tt_jax.TTSpec(200, 12, p_shapes=(4, 5, 11), q_shapes=(2, 3, 2), ranks=(3, 4))
T3B = tt_jax.TTSpec(150, 12, p_shapes=(3, 6, 9), q_shapes=(2, 3, 2), ranks=(3, 4))
T4 = tt_jax.TTSpec(350, 16, p_shapes=(3, 4, 5, 6), q_shapes=(2, 2, 2, 2), ranks=(2, 4, 3))
TOL = 1e-5  # fp32 sums of a few hundred terms, relative to the largest gradient entry
PALLAS_CFG = dict(bwd_lookup_tile=16, bwd_member_tile=16, num_programs=2)


def make_emb(specs, impl, **kw):
    """An embedding on the XLA path or on the Pallas kernels (forward and backward, interpret mode on CPU)."""
    config = TTKernelConfig(**kw.pop("config", {}), **(PALLAS_CFG if impl == "pallas" else {}))
    extra = KERNEL_KW if impl == "pallas" else dict(impl="xla")
    return tt_jax.TTEmbeddingBag(specs, config=config, **extra, **kw)


def make_params(emb, rng, std=0.3):
    cores = []
    for spec in emb.specs:
        sigma = (std**2 / math.prod(spec.ranks)) ** (1.0 / (2 * spec.num_cores))
        cores.append([rng.uniform(-1.7 * sigma, 1.7 * sigma, s).astype(np.float32) for s in spec.core_shapes()])
    return emb.set_cores(None, cores)


def make_inputs(rng, emb, batch, bag_len=(0, 12), alpha=1.3, weighted=False):
    """Skewed ids, some out of range, and a bag with one id repeated."""
    specs = [emb.specs[t] for t in emb.feature_table_map]
    idx, off, psw = testing.make_batch(rng, [s.num_embeddings for s in specs], [batch] * len(specs), bag_len,
                                       alpha=alpha, weighted=weighted)
    idx[[1, 7]] = [-2, 100_000]
    bag = int(np.argmax(np.diff(off)))
    idx[off[bag] : off[bag] + 3] = idx[off[bag]]  # duplicates within a bag
    g = rng.normal(size=(batch, sum(s.embedding_dim for s in specs))).astype(np.float32)
    return idx, off, psw, g


def digits(i, p):
    out = []
    for x in reversed(p):
        out.append(i % x)
        i //= x
    return out[::-1]


def numpy_core_grads(emb, params, idx, off, psw, g, batch):
    """Float64 per-table per-core gradients: for each lookup, dG_k[i_k] += s * L_k^T dY R_k^T (left/right
    partial products of the chain); also the touched slices per table per core."""
    cores = [[np.asarray(c, np.float64) for c in cs] for cs in emb.get_cores(params)]
    grads = [[np.zeros_like(c) for c in cs] for cs in cores]
    touched = [[set() for _ in cs] for cs in cores]
    dims = [emb.specs[t].embedding_dim for t in emb.feature_table_map]
    col0 = np.concatenate([[0], np.cumsum(dims)])
    for bag in range(len(off) - 1):
        f, b = divmod(bag, batch)
        tab = emb.feature_table_map[f]
        spec = emb.specs[tab]
        lo, hi = int(off[bag]), int(off[bag + 1])
        coef = 1.0 / (hi - lo) if emb.pooling == "mean" and hi > lo else 1.0
        dy = np.asarray(g[b, col0[f] : col0[f + 1]], np.float64)
        for pos in range(lo, hi):
            i = int(idx[pos])
            if not 0 <= i < spec.num_embeddings:
                continue
            s = coef * (1.0 if psw is None else float(psw[pos]))
            sl = [cores[tab][k][d] for k, d in enumerate(digits(i, spec.p_shapes))]  # [r, q, r']
            nc = len(sl)
            left = [np.ones((1, 1))]
            for k in range(nc - 1):
                left.append(np.einsum("La,ajb->Ljb", left[-1], sl[k]).reshape(-1, sl[k].shape[2]))
            right = [np.ones((1, 1))] * nc
            for k in range(nc - 1, 0, -1):
                right[k - 1] = np.einsum("ajb,bR->ajR", sl[k], right[k]).reshape(sl[k].shape[0], -1)
            for k, d in enumerate(digits(i, spec.p_shapes)):
                dy3 = dy.reshape(left[k].shape[0], sl[k].shape[1], right[k].shape[1])
                grads[tab][k][d] += s * np.einsum("La,LjR,bR->ajb", left[k], dy3, right[k])
                touched[tab][k].add(d)
    return grads, touched


def reference_vjp(emb, params, idx, off, psw, g, batch):
    ftm = emb.feature_table_map

    def f(cores, w):
        out = reference.pooled([cores[t] for t in ftm], [emb.specs[t] for t in ftm], jnp.asarray(idx),
                               jnp.asarray(off), w, pooling=emb.pooling, batch=batch)
        return jnp.sum(out * g)

    # Jitted: one compile instead of one per op of the eager reference and its transpose.
    return jax.jit(jax.grad(f, argnums=(0, 1)))(emb.get_cores(params), None if psw is None else jnp.asarray(psw))


def check_grads(emb, params, idx, off, psw, g, batch, *, again=False):
    """The gradients of `sum(emb(...) * g)` against both oracles: `(d_params, d_psw)`. `again`: computed a
    second time by the same compiled programs, and bitwise equal."""
    w = None if psw is None else jnp.asarray(psw)
    loss = jax.jit(lambda p, w: jnp.sum(emb(p, idx, off, w) * g))
    d_params, d_psw = jax.grad(loss, argnums=(0, 1))(params, w)
    if again:
        for a, b in zip(jax.tree.leaves((d_params, d_psw)), jax.tree.leaves(jax.grad(loss, argnums=(0, 1))(params, w))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want, _ = numpy_core_grads(emb, params, idx, off, psw, g, batch)
    ref_cores, ref_psw = reference_vjp(emb, params, idx, off, psw, g, batch)
    for tab, (got_t, want_t, ref_t) in enumerate(zip(emb.get_cores(d_params), want, ref_cores)):
        for k, (a, b, c) in enumerate(zip(got_t, want_t, ref_t)):
            assert a.shape == b.shape and a.dtype == jnp.float32, (tab, k)
            assert_close(a, b, TOL)
            assert_close(a, c, TOL)
    if psw is not None:
        full = [reference.numpy_rows(c, s) for c, s in zip(emb.get_cores(params), emb.specs)]
        nf = len(emb.feature_table_map)
        _, want_psw = testing.numpy_pooled_vjp(full, list(emb.feature_table_map), [batch] * nf, idx, off, psw, g,
                                               emb.pooling, False)
        assert_close(d_psw, want_psw, TOL)
        assert_close(d_psw, ref_psw, TOL)
    return d_params, d_psw


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("specs,ftm,pooling,weighted", [((T2, T3, T3B, T4), (0, 1, 2, 3, 1), "sum", True),
                                                       ((T4, T2), (0, 1), "mean", False)], ids=["sum-weighted", "mean"])
def test_grads_match_float64_and_reference(rng, specs, ftm, pooling, weighted, impl):
    # T = 2, 3 (two stacked tables, one read by two features), 4; items of at most 3 rows, so prefix groups
    # span several items; skewed ids, so hot rows span several lookup tiles of the Pallas backward.
    if not ON_GPU and impl == "pallas" and pooling == "mean":
        # Interpret mode: the Pallas gradients against both oracles in [sum-weighted-pallas] (T = 2, 3, 4); mean
        # pooling (a per-bag scale, the same for every T) through the Pallas backward against the float64 model in
        # test_pallas_backward_hot_row_and_prefix and test_apply_gradients_matches_numpy[*-pallas] (T = 3, 4).
        pytest.skip("compiled only (interpret mode: [sum-weighted-pallas]; mean pooling on the Pallas path: "
                    "test_pallas_backward_hot_row_and_prefix, test_apply_gradients_matches_numpy[*-pallas])")
    emb = make_emb(specs, impl, feature_table_map=ftm, pooling=pooling, config=dict(chunk=3))
    params = make_params(emb, rng)
    idx, off, psw, g = make_inputs(rng, emb, 5, weighted=weighted)
    got = check_grads(emb, params, idx, off, psw, g, 5)
    if impl == "pallas" and weighted:
        # Both backwards on the same plans (the Pallas forward's), T = 2, 3 (stacked), 4: the XLA backward
        # gives the Pallas backward's table and per-sample-weight gradients to rounding.
        xla_bwd = make_emb(specs, impl, feature_table_map=ftm, pooling=pooling, config=dict(chunk=3, backward="xla"))
        loss = jax.jit(lambda p, w: jnp.sum(xla_bwd(p, idx, off, w) * g))
        want = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(psw))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close(a, b, 2e-6)


@pytest.mark.parametrize("config", [TTKernelConfig(chunk=2), TTKernelConfig(chunk=0),
                                    TTKernelConfig(prefix_reuse=False)], ids=["chunk2", "whole-groups", "unique-only"])
def test_one_hot_prefix(rng, config):
    # Every lookup shares the prefix (i1, i2) = (2, 3): one group, whose prefix slices get every lookup's gradient.
    spec = tt_jax.TTSpec(24 * 20 - 5, 8, p_shapes=(4, 5, 24), q_shapes=(2, 2, 2), ranks=(4, 4))
    emb = tt_jax.TTEmbeddingBag(spec, pooling="mean", impl="xla", config=config)
    params = make_params(emb, rng)
    idx = (13 * 24 + rng.integers(0, 24, 60)).astype(np.int32)
    off = np.array([0, 0, 20, 21, 60], np.int32)
    g = rng.normal(size=(4, 8)).astype(np.float32)
    d = check_grads(emb, params, idx, off, None, g, 4)[0]["cores"][0]
    assert np.count_nonzero(np.abs(np.asarray(d[0])).sum((1, 2, 3))) == 1
    assert np.count_nonzero(np.abs(np.asarray(d[1])).sum((1, 2, 3))) == 1


def test_grads_through_pallas_forward_xla_backward(rng):
    # The fused forward (interpret mode on CPU) saves its plans; the XLA backward runs on them.
    emb = tt_jax.TTEmbeddingBag([T2, T3, T4], pooling="mean",
                                config=TTKernelConfig(chunk=3, num_programs=2, backward="xla"), **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw, g = make_inputs(rng, emb, 4, bag_len=(0, 8), weighted=True)
    check_grads(emb, params, idx, off, psw, g, 4)


def test_pallas_backward_hot_row_and_prefix(rng):
    # One prefix group holds every lookup; one row takes 45 of the 70 lookups (three lookup tiles of 16, so
    # its sum crosses two tile edges), one last-core slice most of the rows; mean pooling, weighted, an
    # empty bag. Gradients as the oracles, and bitwise equal to themselves over two runs.
    spec = tt_jax.TTSpec(24 * 20 - 5, 8, p_shapes=(4, 5, 24), q_shapes=(2, 2, 2), ranks=(4, 4))
    emb = make_emb(spec, "pallas", pooling="mean", config=dict(chunk=2))
    params = make_params(emb, rng)
    idx = (13 * 24 + rng.integers(0, 24, 70)).astype(np.int32)
    idx[rng.permutation(70)[:45]] = 13 * 24 + 7
    off = np.array([0, 0, 20, 21, 70], np.int32)
    psw = rng.uniform(0.5, 1.5, 70).astype(np.float32)
    g = rng.normal(size=(4, 8)).astype(np.float32)
    d = check_grads(emb, params, idx, off, psw, g, 4, again=True)[0]["cores"][0]  # again: bitwise the same
    assert np.count_nonzero(np.abs(np.asarray(d[0])).sum((1, 2, 3))) == 1
    assert np.count_nonzero(np.abs(np.asarray(d[1])).sum((1, 2, 3))) == 1


# The Pallas backward against the XLA backward on the same plans: test_grads_match_float64_and_reference
# [sum-weighted-pallas] (sharing its Pallas program).


# -- optimizers ---------------------------------------------------------------------


def numpy_step(opt, cores, state, grads, touched, count=0):
    """Float64 model of one step: (cores, state) as nested lists (`count`: the state's count before it)."""
    lr = learning_rate_f64(opt, count)
    eps = float(getattr(opt, "eps", 0.0))
    cores = [[c.copy() for c in cs] for cs in cores]
    state = None if state is None else [[m.copy() for m in ms] for ms in state]
    for tab, cs in enumerate(cores):
        for k, c in enumerate(cs):
            for d in touched[tab][k]:
                gd = grads[tab][k][d]
                if isinstance(opt, tt_jax.SGD):
                    c[d] -= lr * gd
                    continue
                m = state[tab][k]
                m[d] += gd * gd if isinstance(opt, tt_jax.Adagrad) else np.mean(gd * gd)
                c[d] -= lr * gd / (np.sqrt(m[d]) + eps)
    return cores, state


def as_f64(tree):
    return [[np.asarray(x, np.float64) for x in xs] for xs in tree]


OPTS = [tt_jax.SGD(0.5), tt_jax.Adagrad(0.05, eps=1e-6, initial_accumulator_value=0.01),
        tt_jax.RowwiseAdagrad(0.05, eps=1e-6, initial_accumulator_value=0.01)]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("opt", OPTS, ids=["sgd", "adagrad", "rowwise"])
def test_apply_gradients_matches_numpy(rng, opt, impl):
    # Two steps (the state carries over); T3/T3B stacked (the touched slices split by table), T4 and T2;
    # features sharing a table; the last table is read by no feature (left unchanged). The Pallas backward
    # updates whole cores from dense gradients: untouched slices must still come back bitwise unchanged.
    specs = [T3, T3B, T4, T2]
    emb = make_emb(specs, impl, feature_table_map=(0, 1, 0, 2), pooling="mean", config=dict(chunk=4))
    params = make_params(emb, rng)
    state = emb.init_opt_state(params, opt)
    step = jax.jit(lambda p, s, i, o, g, w: emb.apply_gradients(p, s, opt, i, o, g, w))
    cores64 = as_f64(emb.get_cores(params))
    state64 = None if isinstance(opt, tt_jax.SGD) else as_f64(emb.get_momentum(state))
    for it in range(2):
        idx, off, psw, g = make_inputs(rng, emb, 4, bag_len=5, alpha=1.5, weighted=True)
        off[1 + it] = off[it]  # an empty bag (N fixed: one compile for both steps)
        before, before_state = emb.get_cores(params), state
        params, state = step(params, state, idx, off, g, psw)
        grads, touched = numpy_core_grads(emb, emb.set_cores(None, cores64), idx, off, psw, g, 4)
        cores64, state64 = numpy_step(opt, cores64, state64, grads, touched)
        after = emb.get_cores(params)
        for tab in range(len(specs)):
            for k in range(len(after[tab])):
                a, b, want = np.asarray(after[tab][k]), np.asarray(before[tab][k]), cores64[tab][k]
                assert a.dtype == np.float32 and a.shape == b.shape
                assert_close(a, want, 2e-6)
                hit = np.zeros(a.shape[0], bool)
                hit[sorted(touched[tab][k])] = True
                np.testing.assert_array_equal(a[~hit], b[~hit])  # untouched slices: bitwise unchanged
                moved = np.any(a != b, axis=tuple(range(1, a.ndim)))
                np.testing.assert_array_equal(moved, hit)  # and every touched slice was updated
        if state64 is not None:
            new_m, old_m = emb.get_momentum(state), emb.get_momentum(before_state)
            for tab in range(len(specs)):
                for k in range(len(new_m[tab])):
                    a, b = np.asarray(new_m[tab][k]), np.asarray(old_m[tab][k])
                    assert a.dtype == np.float32 and a.shape == b.shape
                    assert_close(a, state64[tab][k], 2e-6)
                    hit = np.zeros(a.shape[0], bool)
                    hit[sorted(touched[tab][k])] = True
                    np.testing.assert_array_equal(a[~hit], b[~hit])
                    assert np.all(np.any(a[hit] != b[hit], axis=tuple(range(1, a.ndim))))
    assert sum(len(s) for s in touched[3]) == 0  # T2 is read by no feature: never touched


_OPTS = {"sgd": tt_jax.SGD(0.5), "adagrad": tt_jax.Adagrad(0.05, 1e-6, 0.01),
         "rowwise": tt_jax.RowwiseAdagrad(0.05, 1e-6, 0.01)}


def tt_train_step(emb, params, state, opt, idx, off, g, psw=None):
    """A jitted `tbe_jax.train_step` whose loss is `sum(out * g)` (so the output gradient is `g`)."""
    step = jax.jit(lambda p, s, opt: tbe_jax.train_step(
        lambda _, out: jnp.sum(out * g), None, tbe_jax.SparseLookup(emb, opt, p, s, idx, off, psw)))
    return step(params, state, opt)


@pytest.mark.parametrize("opt,impl", [(_OPTS[k], "xla") for k in _OPTS] + [pytest.param(
    _OPTS["adagrad"], "pallas", marks=pytest.mark.skipif(not ON_GPU, reason=(
        "compiled only; interpret mode covers train_step on the Pallas path against apply_gradients (2e-6) in "
        "test_train_step_through_pallas_forward (both group kernels), Adagrad's Pallas update in "
        "test_apply_gradients_matches_numpy[adagrad-pallas]")))],
                         ids=[f"{k}-xla" for k in _OPTS] + ["adagrad-pallas"])
def test_train_step_equals_apply_gradients(rng, opt, impl):
    # XLA: its GPU scatter-add sums in an unspecified order, so the two programs can differ by an ulp or so
    # (1.3e-6 relative seen on an H200). Pallas: the same deterministic kernels in both programs; compiled, 1e-7.
    # In interpret mode (CPU) the kernels are XLA ops inlined into two different programs, which the CPU compiler
    # (the suite's flags, tests/conftest.py) may round differently by a few ulp (6.8e-7 relative seen).
    emb = make_emb([T4], impl, feature_table_map=(0, 0), config=dict(chunk=2))
    rtol = 1e-5 if impl == "xla" else (1e-7 if ON_GPU else 2e-6)
    params = make_params(emb, rng)
    state = emb.init_opt_state(params, opt)
    idx, off, psw, g = make_inputs(rng, emb, 3, weighted=True)
    res = tt_train_step(emb, params, state, opt, idx, off, g, psw)
    want_p, want_s = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g, psw))(params, state)
    assert jax.tree.structure(res.opt_state) == jax.tree.structure(want_s) == jax.tree.structure(state)
    assert int(res.opt_state.count) == int(want_s.count) == 1
    for a, b in zip(jax.tree.leaves((res.params, res.opt_state)), jax.tree.leaves((want_p, want_s))):
        # XLA: an element that is a small difference of larger sums keeps the sums' absolute rounding (seen on an
        # H200: 6e-8 on 0.0036, 1.6e-5 relative), so its absolute tolerance scales with the array.
        atol = 1e-9 if impl == "pallas" else 1e-6 * float(np.max(np.abs(np.asarray(b)), initial=0.0))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=max(atol, 1e-9))
    assert any(np.any(np.asarray(a) != np.asarray(b))
               for a, b in zip(jax.tree.leaves(res.params), jax.tree.leaves(params)))  # the step did something
    assert_close(res.outputs, emb(params, idx, off, psw), 1e-6)  # two XLA programs: ulps apart on a GPU


@pytest.mark.parametrize("extra", [dict(bwd_group_kernel="tiles3"), dict(bwd_group_kernel="general")],
                         ids=["tiles3", "general"])
def test_train_step_through_pallas_forward(rng, extra):
    # The Pallas path end to end against the XLA one (T = 3: both per-group backward kernels).
    opt = tt_jax.RowwiseAdagrad(0.05, 1e-6)
    specs = [T3]
    kernel = make_emb(specs, "pallas", config=dict(chunk=3, **extra))
    xla = tt_jax.TTEmbeddingBag(specs, config=TTKernelConfig(chunk=3), impl="xla")
    params = make_params(kernel, rng)
    state = kernel.init_opt_state(params, opt)
    idx, off, _, g = make_inputs(rng, kernel, 4, bag_len=(2, 6))
    res = tt_train_step(kernel, params, state, opt, idx, off, g)
    want = xla.apply_gradients(params, state, opt, idx, off, g)
    for a, b in zip(jax.tree.leaves((res.params, res.opt_state)), jax.tree.leaves(want)):
        assert_close(a, b, 2e-6)


def test_kept_and_packed_prefix_products(rng):
    # For T = 3 with prefix reuse the forward computes each work item's prefix product C in the packed kernel (items
    # sharing G2[i2] in one dot; here windows of 8 hold several i2 runs), and a forward run for differentiation keeps
    # it for the backward's group kernel, which then runs per work item (never for T = 2 or 4, nor without prefix
    # reuse, nor past `prefix_c_max_bytes`; there the kernels compute C item by item, and dP1's packed pass takes
    # groups instead of items). C against float64 item by item and the items' order by i2 (the plan's sort order)
    # on T = 2, 3 with two stacked tables, 4, groups cut into items of 3 rows: the model whose gradients, with C
    # kept, test_grads_match_float64_and_reference[sum-weighted-pallas] checks against float64.
    from tt_jax import prefix

    specs, ftm = (T2, T3, T3B, T4), (0, 1, 2, 3, 1)
    emb = make_emb(specs, "pallas", feature_table_map=ftm, pooling="sum", config=dict(chunk=3))
    params = make_params(emb, rng)
    idx, off, psw, _ = make_inputs(rng, emb, 4, weighted=True)
    out, (_, _, plans, _, _) = emb.step_forward(params, idx, off, psw)
    assert [p.prefix_c is not None for p in plans] == [False, True, False]  # T = 2, 3 (stacked), 4
    layout = prefix.stack_tables(emb.specs, emb.feature_table_map)[1][0]
    q, r = layout.q_shapes, layout.full_ranks
    g1, g2 = (np.asarray(c, np.float64) for c in prefix.stack_cores(layout, emb.get_cores(params))[:2])
    n_items = int(plans[1].num_items[0])
    assert n_items > 8
    meta = np.asarray(plans[1].item_meta).reshape(-1, 4)[:n_items]  # first row, stacked i1, stacked i2, last base
    want = np.einsum("nja,nakb->njkb", g1.reshape(-1, q[0], r[1])[meta[:, 1]],
                     g2.reshape(-1, r[1], q[1], r[2])[meta[:, 2]]).reshape(-1)
    assert_close(np.asarray(plans[1].prefix_c)[: want.size], want, 1e-6)
    # The plan sorts by (table, i2, i1, i3): the items come ordered by stacked i2, the packed kernels' order.
    assert layout.prefix_digits == (1, 0) and np.all(np.diff(meta[:, 2]) >= 0)

    # Past the budget: nothing kept, the rows kernel computes C itself (the same output). The backward without C
    # (groups as the packed dP1's members) runs in every `apply_gradients` test.
    small = make_emb(specs, "pallas", feature_table_map=ftm, pooling="sum",
                     config=dict(chunk=3, prefix_c_max_bytes=4 * want.size - 1))
    out2, (_, _, plans, _, _) = small.step_forward(params, idx, off, psw)
    assert plans[1].prefix_c is None
    assert_close(out2, out, 1e-6)
    unique = make_emb([T3], "pallas", config=dict(prefix_reuse=False))
    _, (_, _, plans, _, _) = unique.step_forward(make_params(unique, rng), idx[:20], np.array([0, 20], np.int32))
    assert plans[0].prefix_c is None


def test_empty_batch_and_errors(rng):
    emb = tt_jax.TTEmbeddingBag([T3], impl="xla")
    params = make_params(emb, rng)
    opt = tt_jax.RowwiseAdagrad(0.1)
    state = emb.init_opt_state(params, opt)
    assert [m.shape for m in emb.get_momentum(state)[0]] == [(4,), (5,), (11,)]
    assert [m.shape for m in emb.get_momentum(emb.init_opt_state(params, tt_jax.Adagrad()))[0]] == \
        T3.core_shapes()
    empty = (np.zeros((0,), np.int32), np.zeros((3,), np.int32))
    p2, s2 = emb.apply_gradients(params, state, opt, *empty, np.ones((2, 12), np.float32))
    assert p2 is params and s2.momentum is state.momentum and int(s2.count) == 1  # nothing touched; one step
    sgd = tt_jax.SGD(0.1)
    res = tbe_jax.train_step(lambda _, out: jnp.sum(out), None,
                             tbe_jax.SparseLookup(emb, sgd, params, emb.init_opt_state(params, sgd), *empty))
    assert res.outputs.shape == (2, 12) and int(res.opt_state.count) == 1
    for a, b in zip(jax.tree.leaves(res.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    idx, off = np.array([1, 2], np.int32), np.array([0, 2], np.int32)
    with pytest.raises(ValueError, match="grad_output has shape"):
        emb.apply_gradients(params, state, opt, idx, off, np.ones((2, 12), np.float32))
    with pytest.raises(TypeError, match="needs a AdagradState"):
        emb.apply_gradients(params, state, tt_jax.Adagrad(), idx, off, np.ones((1, 12), np.float32))
    with pytest.raises(TypeError, match="needs a SGDState"):
        emb.apply_gradients(params, state, sgd, idx, off, np.ones((1, 12), np.float32))
    with pytest.raises(TypeError, match="opt must be"):
        emb.apply_gradients(params, state, "adam", idx, off, np.ones((1, 12), np.float32))
    with pytest.raises(ValueError, match="eps must be > 0"):
        tt_jax.Adagrad(eps=0.0)
    with pytest.raises(ValueError, match="learning_rate"):
        tt_jax.SGD(-1.0)
    with pytest.raises(ValueError, match="holds no accumulators"):
        emb.get_momentum(tt_jax.SGDState(jnp.zeros((), jnp.int32)))


def test_training_doctests():
    # The optimizer family is tbe_jax.optim's (tested in test_docs); the shared training step's example.
    import doctest

    import tbe_jax.train
    from tt_jax import optim

    assert tt_jax.RowwiseAdagrad is tbe_jax.RowwiseAdagrad and optim.SGD is tbe_jax.SGD
    results = [doctest.testmod(m, optionflags=doctest.ELLIPSIS) for m in (optim, tbe_jax.train)]
    assert sum(r.attempted for r in results) > 0 and sum(r.failed for r in results) == 0


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="TF32 dot algorithms exist on GPUs only")
@pytest.mark.parametrize("exact", ["a", "b"])
def test_two_pass_dot_with_a_01_operand(rng, exact):
    # The group kernel's selection and fold dots (one operand 0/1) take two TF32 passes instead of TF32x3's
    # three: as accurate as TF32x3 against float64.
    from tt_jax.kernels.tiles import dot_exact01

    sel = (rng.random((16, 128)) < 0.3).astype(np.float32)
    x = rng.standard_normal((128, 32)).astype(np.float32) * np.float32(1e3)
    a, b = (sel, x) if exact == "a" else (x.T.copy(), sel.T.copy())
    want = a.astype(np.float64) @ b.astype(np.float64)
    x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    got = jax.jit(lambda p, q: dot_exact01(p, q, 1, 0, x3, exact=exact))(a, b)
    ref = jax.jit(lambda p, q: jax.lax.dot(p, q, precision=x3, preferred_element_type=jnp.float32))(a, b)
    scale = np.abs(want).max()
    assert np.abs(np.asarray(got) - want).max() <= max(2 * np.abs(np.asarray(ref) - want).max(), 1e-6 * scale)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="TF32 dot algorithms exist on GPUs only")
def test_manual_tf32x3_dot_matches_the_algorithm(rng):
    # dot_general(manual=True) (the backward kernels' dots): TF32x3 as three explicit one-pass TF32 dots, as
    # accurate as the dot algorithm against float64; an infinite operand gives inf, not NaN.
    from tt_jax.kernels import tiles as kf

    a = rng.standard_normal((16, 128)).astype(np.float32) * np.float32(1e3)
    b = rng.standard_normal((128, 32)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    dims = (((1,), (0,)), ((), ()))
    got = np.asarray(jax.jit(lambda p, q: kf.dot_general(p, q, dims, x3, manual=True))(a, b))
    ref = np.asarray(jax.jit(lambda p, q: jax.lax.dot_general(p, q, dims, precision=x3,
                                                              preferred_element_type=jnp.float32))(a, b))
    assert np.abs(got - want).max() <= max(2 * np.abs(ref - want).max(), 1e-6 * np.abs(want).max())
    a[0, 0] = np.inf
    b[:, 0] = np.abs(b[:, 0]) + 1
    out = np.asarray(jax.jit(lambda p, q: kf.dot_general(p, q, dims, x3, manual=True))(a, b))
    assert out[0, 0] == np.inf
