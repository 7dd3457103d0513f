"""`tt_jax.Adam` (and the rest of the Adam family) on TT cores: lazy, element-wise, per touched slice.

Oracle: a float64 NumPy model of FBGEMM's lazy Adam on core slices (`tt_jax.optim`'s formulas), fed by
test_tt_grad's float64 core gradients (per lookup, straight from the TT chain rule). Both backward paths:
the XLA one (gather, formula, scatter) and the Pallas one (dense core gradients, the update kept to the
plans' touched mask; interpret mode on CPU). Each step checks the cores and every state slot against the
model, the untouched slices and their moments bitwise unchanged, and which slices moved. Small shapes, and
one jitted step per (path, optimizer class) shared by every case (the hyperparameters are traced leaves):
interpret mode compiles slowly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
import tt_jax
from conftest import learning_rate_f64
from test_tt_grad import as_f64, make_emb, make_inputs, make_params, numpy_core_grads
from tt_jax import backward, optim
from tt_jax import params as tt_params

# TA and TB share (q, ranks): one stacked table group, its touched slices split by table; TC (T = 2) is read
# by no feature in the Adam test (never touched) and by two features in the family test.
TA = tt_jax.TTSpec(55, 8, p_shapes=(3, 4, 5), q_shapes=(2, 2, 2), ranks=(2, 3))
TB = tt_jax.TTSpec(40, 8, p_shapes=(4, 3, 4), q_shapes=(2, 2, 2), ranks=(2, 3))
TC = tt_jax.TTSpec(30, 4, p_shapes=(6, 6), q_shapes=(2, 2), ranks=(2,))
BATCH, BAG_LEN = 3, 4
ADAM_SETUP = ((TA, TB, TC), (0, 1))
FAMILY_SETUP = ((TC,), (0, 0))


@functools.lru_cache(maxsize=None)
def stepper(impl, setup):
    """(emb, jitted step): `step(params, states, opts, ...)` runs `apply_gradients` once per optimizer of the
    lists `opts` (several optimizers in one program: one compile). One trace per tuple of optimizer classes:
    the hyperparameter values are traced leaves."""
    specs, ftm = setup
    emb = make_emb(list(specs), impl, feature_table_map=ftm, pooling="mean", config=dict(chunk=2))

    def step(params, states, opts, i, o, g, w):
        return [emb.apply_gradients(p, s, opt, i, o, g, w) for p, s, opt in zip(params, states, opts)]

    return emb, jax.jit(step)


# -- the float64 model ------------------------------------------------------------------------------


def model_rule(opt, count, w, slots, g):
    """One slice's step in float64: (w, slots). `count`: the state's count before the step. The
    hyperparameters are the float32 values the optimizer passes (b2 = 0.999 in float32 is 1 - 0.00099999,
    a 1e-5 relative change of 1 - b2)."""
    kind = opt.rule().kind

    def f32(x):
        return float(np.float32(x))

    lr, eps, wd = f32(learning_rate_f64(opt, count)), f32(opt.eps), f32(opt.weight_decay)
    if kind == "rowwise_adagrad":
        mode = opt.weight_decay_mode
        gg = g + wd * w if mode == "l2" else g
        m = slots[0] + np.mean(gg * gg)
        if mode == "decoupled":
            return (1.0 - lr * wd) * w - lr * g / (np.sqrt(m) + eps), (m,)
        return w - lr * gg / (np.sqrt(m) + eps), (m,)
    b1, b2, t = f32(opt.b1), f32(opt.b2), count + 1
    m1 = b1 * slots[0] + (1.0 - b1) * g
    m2 = b2 * slots[1] + (1.0 - b2) * (np.mean(g * g) if kind.startswith("partial") else g * g)
    r = (m1 / (1.0 - b1**t)) / (np.sqrt(m2 / (1.0 - b2**t)) + eps) + wd * w
    if kind.endswith("lamb"):
        w_norm, r_norm = np.linalg.norm(w), np.linalg.norm(r)
        r = r * (w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0)
    return w - lr * r, (m1, m2)


def model_step(opt, count, cores, slots, grads, touched):
    """Float64 lazy step on TT cores (nested lists per table, per core): only the touched slices move."""
    cores = [[c.copy() for c in cs] for cs in cores]
    slots = [[[m.copy() for m in ms] for ms in slot] for slot in slots]
    for tab, cs in enumerate(cores):
        for k, c in enumerate(cs):
            for d in touched[tab][k]:
                c[d], new = model_rule(opt, count, c[d], tuple(s[tab][k][d] for s in slots), grads[tab][k][d])
                for s, x, rowwise in zip(slots, new, opt.rule().slot_rowwise):
                    if not rowwise:  # element-wise moments are stored in the state dtype (rounded to nearest)
                        x = np.asarray(x).astype(jnp.dtype(getattr(opt, "state_dtype", "float32"))).astype(np.float64)
                    s[tab][k][d] = x
    return cores, slots


def state_fields(state):
    return [f for f in state._fields if f != "count"]


def hit_mask(touched, n):
    hit = np.zeros(n, bool)
    hit[sorted(touched)] = True
    return hit


def check_against_model(emb, before, after, want_before, want, touched, *, rtol, rel=2e-7):
    """Device tensors (per table per core) against the float64 model: `after` (from `before`) against `want`
    (from `want_before`), each tensor within `rtol` of the model's largest change of it (Adam's step is
    about lr per element, whatever the gradient's scale) plus `rel` of its largest value (the storage's
    rounding); the slices outside `touched` bitwise equal to `before`; a slice moved exactly where the
    model moved it."""
    for tab in range(len(emb.specs)):
        for k in range(len(after[tab])):
            a, b = np.asarray(after[tab][k]), np.asarray(before[tab][k])
            w, w0 = want[tab][k], want_before[tab][k]
            assert a.dtype == b.dtype and a.shape == b.shape == w.shape, (tab, k)
            a64 = a.astype(np.float64)
            step = np.abs(w - w0).max(initial=0.0)
            err = np.abs(a64 - w).max(initial=0.0)
            assert err <= rtol * step + rel * np.abs(w).max(initial=0.0), (tab, k, err, step)
            axes = tuple(range(1, a.ndim))
            hit = hit_mask(touched[tab][k], a.shape[0])
            np.testing.assert_array_equal(a[~hit], b[~hit], err_msg=f"untouched slices moved: {tab, k}")
            np.testing.assert_array_equal(np.any(a != b, axis=axes), np.any(w != w0, axis=axes),
                                          err_msg=f"moved slices: {tab, k}")


def run_steps(impl, setup, opts, counts, rng, *, steps=3, zero_feature=1):
    """`steps` steps of each optimizer of `opts` (in lockstep, one program; states starting at `counts`),
    from the same cores and batches, against the model. Step 3 repeats step 1's batch with a zero output
    gradient for feature `zero_feature`. Returns emb and per optimizer its final state and, per step, the
    model's (touched slices, gradients, slots before, slots after)."""
    emb, step = stepper(impl, setup)
    params0 = make_params(emb, rng)
    params = [params0] * len(opts)
    states = [emb.init_opt_state(params0, o)._replace(count=jnp.asarray(c, jnp.int32)) for o, c in zip(opts, counts)]
    fields = [state_fields(s) for s in states]
    models = [(as_f64(emb.get_cores(params0)), [as_f64(emb.get_state(s, f)) for f in fs])
              for s, fs in zip(states, fields)]
    batches, histories = [], [[] for _ in opts]
    col0 = np.concatenate([[0], np.cumsum([emb.specs[t].embedding_dim for t in emb.feature_table_map])])
    for it in range(steps):
        if it == 2:  # step 1's batch again, feature `zero_feature`'s output gradient exactly 0
            idx, off, psw, g = batches[0]
            g = g.copy()
            g[:, col0[zero_feature] : col0[zero_feature + 1]] = 0.0
        else:
            idx, off, psw, g = make_inputs(rng, emb, BATCH, bag_len=BAG_LEN, alpha=1.4, weighted=True)
            off[[1, 4][it] + 1] = off[[1, 4][it]]  # an empty bag (N fixed: one compile for every step)
        batches.append((idx, off, psw, g))
        out = step(params, states, list(opts), idx, off, g, psw)
        for j, (opt, (new_p, new_s)) in enumerate(zip(opts, out)):
            cores64, slots64 = models[j]
            assert type(new_s) is opt.state_type and int(new_s.count) == counts[j] + it + 1
            grads, touched = numpy_core_grads(emb, emb.set_cores(None, cores64), idx, off, psw, g, BATCH)
            new64, new_slots64 = model_step(opt, counts[j] + it, cores64, slots64, grads, touched)
            check_against_model(emb, emb.get_cores(params[j]), emb.get_cores(new_p), cores64, new64, touched,
                                rtol=2e-4)
            for f, want_s, old_s, rowwise in zip(fields[j], new_slots64, slots64, opt.rule().slot_rowwise):
                got, old = emb.get_state(new_s, f), emb.get_state(states[j], f)
                dt = jnp.float32 if rowwise else jnp.dtype(getattr(opt, "state_dtype", "float32"))
                assert all(x.dtype == dt for xs in got for x in xs), (f, dt)
                check_against_model(emb, old, got, old_s, want_s, touched, rtol=1e-5,
                                    rel=1e-6 if dt == jnp.float32 else 2.0**-8)
            histories[j].append((touched, grads, slots64, new_slots64))
            models[j] = (new64, new_slots64)
        params, states = [p for p, _ in out], [s for _, s in out]
    return emb, states, histories


# -- Adam: both backward paths ----------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_adam_matches_float64_model(rng, impl):
    # Lazy Adam over 3 steps: stacked tables (TA, TB), a table read by no feature (TC), duplicates, bad ids,
    # an empty bag, mean pooling and per-sample weights. Case 2: weight decay, other betas, and a state
    # whose count starts at 5 (the bias correction uses the global step t = count + 1). One compile: the
    # cases run one after the other through the same program.
    cases = [(tt_jax.Adam(0.05, eps=1e-3), 0),
             (tt_jax.Adam(0.02, b1=0.8, b2=0.99, eps=1e-4, weight_decay=0.1), 5)]
    for opt, count0 in cases:
        emb, _, (history,) = run_steps(impl, ADAM_SETUP, [opt], [count0], rng)
        assert all(not s for s in history[0][0][2])  # TC: read by no feature, never touched
        # Step 3: TB (read by feature 1 only) got exactly zero gradients on the slices it touched. They
        # still step: the moments decay (m1 = b1 m1, m2 = b2 m2: checked against the model above) and, as
        # they carry step 1's first moment, the slices move (the model says which; checked above).
        touched, grads, old_slots, new_slots = history[2]
        stepped = 0
        for k, ids in enumerate(touched[1]):
            assert ids
            for d in ids:
                assert not np.any(grads[1][k][d])
                np.testing.assert_allclose(new_slots[0][1][k][d], np.float32(opt.b1) * old_slots[0][1][k][d])
                stepped += int(np.any(old_slots[0][1][k][d]))
        assert stepped > 0
        # Slices holding a first moment that a later step does not touch: they stayed put (a dense pass over
        # their zero gradient would have moved them).
        held = set()
        for it in (1, 2):
            for tab in (0, 1):
                for k in range(3):
                    held |= {(tab, k, d) for d in set().union(*(history[j][0][tab][k] for j in range(it)))
                             - history[it][0][tab][k] if np.any(history[it][2][0][tab][k][d])}
        assert held


def test_touched_slices_from_plans(rng):
    # The Pallas update's mask equals the slices of the valid lookups (bad ids, an empty bag, stacked
    # tables, a table no feature reads), from the plans alone.
    emb, _ = stepper("xla", ADAM_SETUP)
    idx, off, psw, g = make_inputs(rng, emb, BATCH, bag_len=BAG_LEN, weighted=True)
    off[2] = off[1]
    _, touched = numpy_core_grads(emb, make_params(emb, rng), idx, off, psw, g, BATCH)
    masks = jax.jit(lambda i, o: backward.touched_slices(emb.specs, emb.feature_table_map,
                                                         emb.flow_plans(BATCH, i, o)))(idx, off)
    masks = tt_params.unstack(emb.specs, masks)  # per table group, stacked -> per table
    for tab, spec in enumerate(emb.specs):
        for k, p in enumerate(spec.p_shapes):
            if tab == 2:
                assert masks[tab][k] is None
            else:
                np.testing.assert_array_equal(np.asarray(masks[tab][k]), hit_mask(touched[tab][k], p))
    with pytest.raises(ValueError, match="touched mask"):
        optim.update_dense(tt_jax.Adam().rule(), None, jnp.zeros((2, 1, 2, 1)), (), jnp.zeros((2, 1, 2, 1)))


# -- the rest of the family, and row-wise Adagrad's weight decay --------------------------------------


FAMILY = {
    "adam-bf16-state": tt_jax.Adam(0.05, eps=1e-3, weight_decay=0.05, state_dtype="bfloat16"),
    "partial_rowwise_adam": tt_jax.PartialRowwiseAdam(0.05, eps=1e-3, weight_decay=0.05),
    "lamb": tt_jax.Lamb(0.05, b1=0.8, eps=1e-3, weight_decay=0.05),
    "partial_rowwise_lamb": tt_jax.PartialRowwiseLamb(0.05, eps=1e-3, weight_decay=0.05),
    # A zero gradient moves a decoupled-weight-decay slice too: the Pallas update needs the mask here as well.
    "rowwise_adagrad-decoupled": tt_jax.RowwiseAdagrad(0.05, eps=1e-3, weight_decay=0.1,
                                                       weight_decay_mode="decoupled"),
}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_family_matches_float64_model(rng, impl):
    # One T = 2 table read by two features; 3 steps from count 2, every optimizer of FAMILY in one program:
    # per-slice second moments ([p_t]), LAMB's trust ratio over the slice, bfloat16 element-wise moments
    # (the model rounds what it stores as the state does), row-wise Adagrad's decoupled weight decay.
    opts = list(FAMILY.values())
    emb, states, _ = run_steps(impl, FAMILY_SETUP, opts, [2] * len(opts), rng)
    for name, state in zip(FAMILY, states):
        last = emb.get_state(state, state_fields(state)[-1])[0]
        rowwise = name.startswith(("partial", "rowwise"))
        assert [x.shape for x in last] == ([(p,) for p in TC.p_shapes] if rowwise else TC.core_shapes()), name


# -- train_step and a layer -------------------------------------------------------------------------


def test_linen_layer_and_train_step_with_adam(rng):
    # tt_jax.linen's sparse mode with tt_jax.Adam equals the functional `tbe_jax.train_step` step by step,
    # and each train_step (the forward's plans reused for the update) is the float64 model's lazy Adam step
    # from the gradient of the loss with respect to the pooled output.
    from test_layers import head_loss, make_batch, make_head, module, sparse_runner

    framework = "linen"
    mod = module("tt_jax", framework)
    opt = tt_jax.Adam(0.05, eps=1e-3, weight_decay=0.01)
    core = tt_jax.TTEmbeddingBag(TC, impl="xla")
    tables = core.init(jax.random.key(3), std=0.3)
    state = core.init_opt_state(tables, opt)
    head = make_head(rng, TC.embedding_dim)
    batch = make_batch(rng, (TC.num_embeddings,), weighted=True)
    make_layer = lambda **fkw: mod.TTEmbeddingBag(TC, impl="xla", optimizer=opt, **fkw)  # noqa: E731
    step, read, traces = sparse_runner(framework, "tt_jax", make_layer, TC.embedding_dim, tables, state, head)
    losses = [step(batch)[0] for _ in range(3)]
    assert traces[0] == 1
    got_t, got_s = read()
    assert isinstance(got_s, tt_jax.AdamState) and int(got_s.count) == 3
    idx, off, psw, y = batch
    train = jax.jit(lambda t, s: tbe_jax.train_step(lambda h, pooled: head_loss(h, pooled, y), head,
                                                    tbe_jax.SparseLookup(core, opt, t, s, idx, off, psw)))
    idx, off, psw, y = (np.asarray(x) for x in batch)
    t, s = tables, state
    for it in range(3):
        res = train(t, s)
        new_t, new_s = res.params, res.opt_state
        np.testing.assert_allclose(float(res.loss), float(losses[it]), rtol=1e-5)
        # d mean((pooled @ kernel + bias - y)**2) / d pooled
        pooled = np.asarray(core(t, idx, off, psw), np.float64)
        kernel, bias = np.asarray(head["kernel"], np.float64), np.asarray(head["bias"], np.float64)
        g_out = (2.0 / len(y)) * ((pooled @ kernel + bias)[:, 0] - y)[:, None] * kernel[:, 0][None, :]
        grads, touched = numpy_core_grads(core, t, idx, off, psw, g_out, len(y))
        want, want_slots = model_step(opt, it, as_f64(core.get_cores(t)),
                                      [as_f64(core.get_state(s, f)) for f in ("momentum1", "momentum2")],
                                      grads, touched)
        check_against_model(core, core.get_cores(t), core.get_cores(new_t), as_f64(core.get_cores(t)), want,
                            touched, rtol=2e-4)
        for f, w in zip(("momentum1", "momentum2"), want_slots):
            old = core.get_state(s, f)
            check_against_model(core, old, core.get_state(new_s, f), as_f64(old), w, touched, rtol=1e-5, rel=1e-6)
        t, s = new_t, new_s
    for a, b in zip(jax.tree.leaves((got_t, got_s)), jax.tree.leaves((t, s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert float(losses[-1]) < float(losses[0])


def test_exports_and_errors(rng):
    assert tt_jax.Adam is tbe_jax.Adam and tt_jax.AdamState is tbe_jax.AdamState
    assert tt_jax.Lamb is tbe_jax.Lamb and tt_jax.PartialRowwiseAdam is tbe_jax.PartialRowwiseAdam
    emb = tt_jax.TTEmbeddingBag(TC, impl="xla")
    params = make_params(emb, rng)
    state = emb.init_opt_state(params, tt_jax.Adam())
    assert isinstance(state, tt_jax.AdamState)
    assert [m.shape for m in emb.get_state(state, "momentum1")[0]] == TC.core_shapes()
    with pytest.raises(ValueError, match="get_state"):
        emb.get_momentum(state)
    with pytest.raises(ValueError, match="momentum1"):
        emb.get_state(state, "momentum")
    with pytest.raises(TypeError, match="Adam"):
        emb.init_opt_state(params, "adam")
