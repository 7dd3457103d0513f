"""The fused optimizers of `tbe_jax.optim` on tbe_jax tables: Adagrad, row-wise Adagrad with weight decay,
Adam, partial row-wise Adam, LAMB and partial row-wise LAMB.

Each is checked over several steps against a float64 NumPy model written from FBGEMM's formulas (lazy:
only the rows a batch touches step, their moments too; the bias correction uses the global step count),
through the kernels (compiled on a GPU, interpret mode on CPU: the sorted-run backward and the histogram
backward) and the XLA reference. Untouched rows and their state must come back bitwise unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, ON_GPU, assert_close, specs, tables_f64


def _compiled_only(*values, covered: str):
    """A parametrize case run compiled only (on a GPU); `covered`: where interpret mode (CPU) checks its path."""
    why = f"compiled only; interpret mode: {covered}"
    return pytest.param(*values, marks=pytest.mark.skipif(not ON_GPU, reason=why))


def model_update(opt, w, slots, g, t):
    """One step of `opt` on float64 rows `w` [R, D] with summed gradients `g`; `slots` the rows' state
    ([R] row-wise, [R, D] element-wise); `t` the step number (1 on the first step). FBGEMM's formulas,
    with the hyperparameters as the fp32 values the kernels receive (fp32 b2 = 0.999 is 0.99900001)."""
    kind = opt.rule().kind

    def hp(name):
        return float(np.float32(getattr(opt, name, 0.0)))

    lr, eps = hp("learning_rate"), hp("eps")
    if kind == "sgd":
        return w - lr * g, []
    if kind == "adagrad":
        m = slots[0] + g * g
        return w - lr * g / (np.sqrt(m) + eps), [m]
    if kind == "rowwise_adagrad":
        wd, mode = hp("weight_decay"), opt.weight_decay_mode
        gg = g + wd * w if mode == "l2" else g
        m = slots[0] + np.mean(gg * gg, axis=1)
        mult = (lr / (np.sqrt(m) + eps))[:, None]
        if mode == "decoupled":
            return (1 - lr * wd) * w - mult * g, [m]
        return w - mult * gg, [m]
    b1, b2, wd = hp("b1"), hp("b2"), hp("weight_decay")
    m1 = b1 * slots[0] + (1 - b1) * g
    if kind.startswith("partial"):
        m2 = b2 * slots[1] + (1 - b2) * np.mean(g * g, axis=1)
        v_hat = (m2 / (1 - b2 ** t))[:, None]
    else:
        m2 = b2 * slots[1] + (1 - b2) * g * g
        v_hat = m2 / (1 - b2 ** t)
    r = m1 / (1 - b1 ** t) / (np.sqrt(v_hat) + eps) + wd * w
    if kind.endswith("adam"):
        return w - lr * r, [m1, m2]
    wn, rn = np.linalg.norm(w, axis=1), np.linalg.norm(r, axis=1)
    ratio = np.where((wn > 0) & (rn > 0), wn / np.where(rn > 0, rn, 1), 1.0)
    return w - lr * ratio[:, None] * r, [m1, m2]


def touched(fmap, num_rows, batch, idx, off):
    hit = [np.zeros(e, bool) for e in num_rows]
    base = 0
    for f, t in enumerate(fmap):
        ids = idx[off[base]:off[base + batch]]
        hit[t][ids[(ids >= 0) & (ids < num_rows[t])]] = True
        base += batch
    return hit


def state_tables(emb, state, opt):
    """Per slot name, per table: its state as float64."""
    return {n: [np.asarray(x, np.float64) for x in emb.get_state(state, n)] for n in opt._SLOTS}


def run_and_check(rng, tables, fmap, batch, bag_len, opt, *, steps=3, pooling="sum", weighted=False,
                  wdtype="float32", tol=None, state_tol=None, histogram=None, empty_bag=True):
    emb = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype,
                                        **KERNEL_KW)
    ref = tbe_jax.TableBatchedEmbedding(tables, feature_table_map=fmap, pooling=pooling, weights_dtype=wdtype,
                                        impl="xla")
    if histogram is not None:
        assert emb.plan() == histogram
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    state = emb.init_opt_state(params, opt)
    ref_params, ref_state = params, state
    num_rows = [t.num_embeddings for t in tables]
    tabs = tables_f64(emb, params)
    slots = state_tables(emb, state, opt)
    names = list(slots)
    step = jax.jit(lambda p, s, o, i, off, g, w: emb.apply_gradients(p, s, o, i, off, g, w))
    # Every step's ids (and weights) padded past offsets[-1] to one length, with valid-looking ids that must be
    # ignored: one compiled program per test for the kernels and one for the reference, not one per step.
    padded_len = batch * len(fmap) * (bag_len[1] if isinstance(bag_len, tuple) else bag_len)
    for t in range(1, steps + 1):
        idx, off, psw = testing.make_batch(rng, [num_rows[f] for f in fmap], [batch] * len(fmap), bag_len,
                                           weighted=weighted)
        if empty_bag:
            off[1] = off[0]
        g = rng.standard_normal((batch, sum(emb.feature_dims))).astype(np.float32)
        pad_idx = rng.integers(0, min(num_rows), padded_len).astype(np.int32)
        pad_idx[:len(idx)] = idx
        pad_psw = None if psw is None else rng.uniform(0.5, 1.5, padded_len).astype(np.float32)
        if psw is not None:
            pad_psw[:len(psw)] = psw
        before = (emb.get_tables(params), {n: emb.get_state(state, n) for n in names})
        params, state = step(params, state, opt, pad_idx, off, g, pad_psw)
        ref_params, ref_state = ref.apply_gradients(ref_params, ref_state, opt, pad_idx, off, g, pad_psw)
        grads, _ = testing.numpy_pooled_vjp(tabs, fmap, [batch] * len(fmap), idx, off, psw, g, pooling, False)
        hit = touched(fmap, num_rows, batch, idx, off)
        for k, h in enumerate(hit):
            new_w, new_s = model_update(opt, tabs[k][h], [slots[n][k][h] for n in names], grads[k][h], t)
            tabs[k][h] = new_w
            for n, x in zip(names, new_s):
                slots[n][k][h] = x
        assert int(state.count) == t
        # Untouched rows and their state: bitwise what they were.
        for k, h in enumerate(hit):
            np.testing.assert_array_equal(np.asarray(emb.get_tables(params)[k])[~h], np.asarray(before[0][k])[~h])
            for n in names:
                np.testing.assert_array_equal(np.asarray(emb.get_state(state, n)[k])[~h],
                                              np.asarray(before[1][n][k])[~h])
    tol = tol or {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}[wdtype]
    for got, want, got_ref in zip(emb.get_tables(params), tabs, emb.get_tables(ref_params)):
        assert_close(got, want, tol)
        assert_close(got_ref, want, tol)
    for n in names:
        for got, want, got_ref in zip(emb.get_state(state, n), slots[n], ref.get_state(ref_state, n)):
            assert_close(got, want, state_tol or 1e-5)
            assert_close(got_ref, want, state_tol or 1e-5)
    return emb, params, state, ref_params, ref_state


OPTIMIZERS = {
    "adagrad": tbe_jax.Adagrad(0.05, eps=1e-3, initial_accumulator_value=0.1),
    "rowwise-l2": tbe_jax.RowwiseAdagrad(0.05, 1e-3, weight_decay=0.1, weight_decay_mode="l2"),
    "rowwise-decoupled": tbe_jax.RowwiseAdagrad(0.05, 1e-3, weight_decay=0.1, weight_decay_mode="decoupled"),
    "adam": tbe_jax.Adam(0.02, b1=0.8, b2=0.95, eps=1e-4, weight_decay=0.01),
    "partial-adam": tbe_jax.PartialRowwiseAdam(0.02, eps=1e-4),
    "lamb": tbe_jax.Lamb(0.02, weight_decay=0.01),
    "partial-lamb": tbe_jax.PartialRowwiseLamb(0.02, b1=0.5, weight_decay=0.02),
}

# Small E (many duplicates), two storage buffers (d5, d16), an odd dim, a table read by two features, an
# empty bag; pooling and weighting vary by optimizer so every combination appears.
_CASES = [("adagrad", "sum", True), ("rowwise-l2", "mean", False), ("rowwise-decoupled", "sum", False),
          ("adam", "mean", True), ("partial-adam", "sum", False), ("lamb", "sum", True),
          ("partial-lamb", "mean", False)]


@pytest.mark.parametrize("name,pooling,weighted", _CASES, ids=[c[0] for c in _CASES])
def test_matches_float64_model(rng, name, pooling, weighted):
    tables = specs([17, 6, 40], [5, 16, 16])
    run_and_check(rng, tables, [0, 1, 2, 1], 4, (0, 12), OPTIMIZERS[name], pooling=pooling, weighted=weighted)


@pytest.mark.parametrize("name", ["adam", _compiled_only("partial-lamb", covered=(
    "the several-buffer width class in [adam] (element-wise slots, fp16), row-wise slots there in "
    "test_backward.py::test_many_dims_width_classes, the rule in test_matches_float64_model[partial-lamb]"))])
def test_width_class_of_several_buffers(rng, name):
    # Dims 5, 6 and 7 are three storage buffers of one width class (8): the backward applies the rule once
    # per tile with per-buffer masked loads and stores (element-wise and row-wise slots, fp16 tables with
    # stochastic rounding, blocks of runs spanning buffers).
    tables = specs([17, 6, 40], [5, 6, 7])
    run_and_check(rng, tables, [0, 1, 2, 1], 4, (0, 12), OPTIMIZERS[name], steps=2, wdtype="float16")


@pytest.mark.parametrize("name", ["adam", _compiled_only("partial-lamb", covered=(
    "the long-run update in [adam] (element-wise slots), row-wise slots there in "
    "test_backward.py::test_long_runs_split_into_chunks, the rule in test_matches_float64_model[partial-lamb]"))])
def test_long_runs(rng, name):
    # Rows hit hundreds of times (runs >= BackwardConfig.long_run: chunk partials, then the long-run update).
    tables = specs([3, 200], [8, 24])
    run_and_check(rng, tables, [0, 1], 3, (200, 300), OPTIMIZERS[name], steps=2, empty_bag=False)


@pytest.mark.parametrize("name", [
    "adam",
    _compiled_only("lamb", covered="the histogram update with element-wise slots in [adam] (the same row_update "
                   "code), LAMB's rule in test_matches_float64_model[lamb]"),
    _compiled_only("rowwise-decoupled", covered="the histogram update with a row-wise slot in "
                   "test_histogram.py::test_backward_update_matches_model[sum-adagrad], decoupled weight decay in "
                   "test_matches_float64_model[rowwise-decoupled]")])
def test_histogram_backward(rng, name):
    # Small tables with a bag-size hint take the histogram forward and backward (no sort).
    # (Eligible: E <= 64, 64 <= D <= 128, fp16 weights, unweighted.)
    tables = [tbe_jax.TableSpec(33, 72, bag_size_hint=64), tbe_jax.TableSpec(300, 16),
              tbe_jax.TableSpec(9, 64, bag_size_hint=64)]
    run_and_check(rng, tables, [0, 1, 2], 6, (0, 80), OPTIMIZERS[name], steps=2, wdtype="float16",
                  histogram=("histogram", "generic", "histogram"))


@pytest.mark.parametrize("wdtype,state_dtype,sr", [
    ("float16", "float32", True), ("bfloat16", "bfloat16", False),
    _compiled_only("float32", "float16", False, covered=(
        "fp32 tables in test_matches_float64_model, moments stored in a 16-bit dtype (the same store code) in "
        "[bfloat16-bfloat16-False]"))])
def test_table_and_state_dtypes(rng, wdtype, state_dtype, sr):
    opt = tbe_jax.Adam(0.02, eps=1e-3, state_dtype=state_dtype, stochastic_rounding=sr)
    tables = specs([20, 30], [8, 24])
    tol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}[wdtype]
    state_tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[state_dtype]
    if state_dtype != "float32":  # rounded moments move the update by about their rounding
        tol = max(tol, 20 * state_tol)
    emb, params, state, ref_params, ref_state = run_and_check(
        rng, tables, [0, 1], 5, (0, 10), opt, wdtype=wdtype, tol=tol, state_tol=state_tol, steps=2)
    assert {x.dtype for x in jax.tree.leaves(state.momentum1)} == {jnp.dtype(state_dtype)}
    assert {x.dtype for x in jax.tree.leaves(state.momentum2)} == {jnp.dtype(state_dtype)}
    # The kernels and the reference round the same fp32 values the same way (stochastic rounding is a
    # hash of the values): a step apart by at most an ulp of the storage type.
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(a, b)  # the step count
            continue
        assert_close(a, b, {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}[jnp.dtype(a.dtype).name])


def _low_precision_case(name, wdtype):
    if (name, wdtype) in (("adagrad", "float16"), ("rowwise-l2", "bfloat16")):
        return name, wdtype
    kept = "adagrad-float16" if wdtype == "float16" else "rowwise-l2-bfloat16"
    return _compiled_only(name, wdtype, covered=(
        f"the {wdtype} row load and store (the same row_update code for every rule) in "
        f"test_low_precision_tables[{kept}] and test_table_and_state_dtypes, the rule in "
        f"test_matches_float64_model[{name}]"))


@pytest.mark.parametrize("name,wdtype", [_low_precision_case(*c) for c in [
    ("adagrad", "float16"), ("partial-adam", "float16"), ("lamb", "float16"), ("rowwise-l2", "bfloat16"),
    ("partial-lamb", "bfloat16")]])
def test_low_precision_tables(rng, name, wdtype):
    # Every optimizer on fp16/bf16 tables (Adam: test_table_and_state_dtypes): fp32 arithmetic, one
    # rounding of the stored row per step.
    run_and_check(rng, specs([20, 30], [8, 24]), [0, 1], 5, (0, 10), OPTIMIZERS[name], wdtype=wdtype, steps=2)


def test_bias_correction_uses_the_global_step(rng):
    # A row first touched at step 3 gets t = 3 in its bias correction (FBGEMM's lazy Adam), not 1.
    emb = tbe_jax.TableBatchedEmbedding(specs([4], [4]), impl="xla")
    opt = tbe_jax.Adam(0.1, eps=1e-8)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    w0 = np.asarray(emb.get_tables(params)[0], np.float64)
    g = np.ones((1, 4), np.float32)
    for i in (0, 0, 1):  # row 1 first touched on step 3
        params, state = emb.apply_gradients(params, state, opt, np.array([i], np.int32), np.array([0, 1], np.int32), g)
    want, _ = model_update(opt, w0[1:2], [np.zeros((1, 4)), np.zeros((1, 4))], np.ones((1, 4)), 3)
    assert_close(emb.get_tables(params)[0][1:2], want, 1e-6)
    m2 = np.asarray(emb.get_state(state, "momentum2")[0])
    np.testing.assert_allclose(m2[1], 1 - 0.999, rtol=2e-5)  # one decay, not three (1 - b2 in fp32)
    np.testing.assert_allclose(m2[0], 1 - 0.999 ** 2, rtol=2e-5)


def test_state_shapes_accessors_and_errors():
    emb = tbe_jax.TableBatchedEmbedding(specs([7, 5], [4, 8]), impl="xla")
    params = emb.init(jax.random.key(0))
    st = emb.init_opt_state(params, tbe_jax.PartialRowwiseAdam())
    assert isinstance(st, tbe_jax.AdamState)
    assert [x.shape for x in emb.get_state(st, "momentum1")] == [(7, 4), (5, 8)]
    assert [x.shape for x in emb.get_state(st, "momentum2")] == [(7,), (5,)]
    assert [x.shape for x in emb.get_momentum(emb.init_opt_state(params, tbe_jax.Adagrad()))] == [(7, 4), (5, 8)]
    with pytest.raises(ValueError, match="momentum1"):
        emb.get_momentum(st)
    with pytest.raises(ValueError, match="state fields"):
        emb.get_state(st, "momentum")
    # A partial row-wise state is not an Adam state (m2's shape differs): a clear error.
    with pytest.raises(ValueError, match="init_opt_state"):
        emb.apply_gradients(params, st, tbe_jax.Adam(), np.zeros(1, np.int32), np.array([0, 1], np.int32),
                            np.zeros((1, 12), np.float32))
    for bad in (dict(b1=1.0), dict(b2=-0.1), dict(eps=0.0), dict(state_dtype="int8"), dict(weight_decay=-1.0)):
        with pytest.raises(ValueError):
            tbe_jax.Lamb(**bad)
    with pytest.raises(ValueError, match="weight_decay_mode"):
        tbe_jax.RowwiseAdagrad(weight_decay_mode="l1")


def test_hyperparameters_are_operands():
    # A new learning rate, betas or weight decay do not recompile a jitted step (pytree leaves).
    emb = tbe_jax.TableBatchedEmbedding(specs([7], [4]), impl="xla")
    params = emb.init(jax.random.key(0))
    traces = []

    @jax.jit
    def step(p, s, opt):
        traces.append(1)
        return emb.apply_gradients(p, s, opt, jnp.array([1, 2], jnp.int32), jnp.array([0, 2], jnp.int32),
                                   jnp.ones((1, 4)))

    state = emb.init_opt_state(params, tbe_jax.Adam())
    for opt in (tbe_jax.Adam(0.1), tbe_jax.Adam(0.2, b1=0.5, b2=0.9, weight_decay=0.1)):
        params, state = step(params, state, opt)
    assert len(traces) == 1


def test_orbax_checkpoint_holds_adam_state(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    emb = tbe_jax.TableBatchedEmbedding(specs([7, 5], [4, 8]), impl="xla")
    opt = tbe_jax.PartialRowwiseLamb(0.1)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    params, state = emb.apply_gradients(params, state, opt, np.array([1, 3], np.int32), np.array([0, 1, 2], np.int32),
                                        np.ones((1, 12), np.float32))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "c", {"params": params, "opt_state": state})
    ckpt.wait_until_finished()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"params": params, "opt_state": state})
    back = ckpt.restore(tmp_path / "c", target)
    assert isinstance(back["opt_state"], tbe_jax.AdamState)
    for a, b in zip(jax.tree.leaves({"params": params, "opt_state": state}), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not ON_GPU, reason="compiled only; interpret mode covers train_step == apply_gradients in "
                    "test_backward.py::test_train_step_equals_apply_gradients[sgd-kernel] and this rule's kernel "
                    "update in test_matches_float64_model[partial-lamb]")
def test_train_step_with_adam_matches_apply_gradients(rng):
    # tbe_jax.train_step (forward kernel, output gradient, fused update) gives apply_gradients' result.
    tables = specs([30, 20], [8, 16])
    emb = tbe_jax.TableBatchedEmbedding(tables, **KERNEL_KW)
    opt = tbe_jax.PartialRowwiseLamb(0.05, weight_decay=0.01)
    params = emb.init(jax.random.key(1))
    state = emb.init_opt_state(params, opt)
    idx, off, _ = testing.make_batch(rng, [30, 20], [3, 3], (0, 6))
    target = rng.standard_normal((3, 24)).astype(np.float32)

    @jax.jit
    def step(p, s, opt):
        res = tbe_jax.train_step(lambda _, out: jnp.sum((out - target) ** 2), None,
                                 tbe_jax.SparseLookup(emb, opt, p, s, idx, off))
        return res.params, res.opt_state, res.outputs

    got_p, got_s, out = step(params, state, opt)
    g = 2 * (np.asarray(out) - target)  # the step's own forward: no separate forward program to compile
    want_p, want_s = emb.apply_gradients(params, state, opt, idx, off, g)
    for a, b in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_layers_train_with_adam(framework):
    # Each framework's sparse layer takes an Adam-family optimizer: state leaves named after the state's
    # fields, and the loss goes down.
    if framework == "haiku":
        pytest.importorskip("haiku")
    import importlib

    mod = importlib.import_module(f"tbe_jax.{framework}")
    tables = specs([40, 30], [8, 8])
    opt = tbe_jax.Adam(0.05)
    rng = np.random.default_rng(0)
    idx, off, _ = testing.make_batch(rng, [40, 30], [4, 4], (1, 5))
    labels = jnp.asarray(rng.standard_normal((4, 16)).astype(np.float32))
    if framework == "linen":
        layer = mod.TableBatchedEmbed(tables, optimizer=opt, impl="xla")
        variables = layer.init(jax.random.key(0), idx, off)
        assert isinstance(variables["tbe_fused"]["opt_state"], tbe_jax.AdamState)

        @jax.jit
        def step(v):
            loss, _, v = mod.train_step(lambda v: jnp.mean((layer.apply(v, idx, off) - labels) ** 2), v)
            return v, loss

        losses = []
        for _ in range(10):
            variables, loss = step(variables)
            losses.append(float(loss))
    elif framework == "nnx":
        from flax import nnx

        layer = mod.TableBatchedEmbed(tables, optimizer=opt, impl="xla", rngs=nnx.Rngs(0))
        assert "momentum2_d8" in layer.opt_state

        @nnx.jit
        def step(layer):
            loss, _ = mod.train_step(lambda m: jnp.mean((m(idx, off) - labels) ** 2), layer)
            return loss

        losses = [float(step(layer)) for _ in range(10)]
        assert isinstance(layer.get_opt_state(), tbe_jax.AdamState)
    else:
        import haiku as hk

        f = hk.transform_with_state(
            lambda: mod.TableBatchedEmbed(tables, optimizer=opt, impl="xla")(idx, off))
        params, state = f.init(jax.random.key(0))
        assert any("momentum1" in k for s in state.values() for k in s)

        @jax.jit
        def step(params, state):
            def loss_fn(params, state):
                out, _ = f.apply(params, state, None)
                return jnp.mean((out - labels) ** 2)
            loss, _, state = mod.train_step(loss_fn, params, state)
            return state, loss

        losses = []
        for _ in range(10):
            state, loss = step(params, state)
            losses.append(float(loss))
    assert losses[-1] < losses[0] / 2, losses


def test_number_hyperparameters_pass_as_device_arrays():
    """An optimizer of Python or NumPy numbers flattens to device arrays made once per instance (a jitted call would
    copy each number to the device on every call), with the numbers' dtypes and weak types: the same program as
    with the numbers (one compile for both), never a tracer kept from a trace, remade after a donation."""
    opt = tbe_jax.Adam(0.05, b1=np.float32(0.8))
    leaves = jax.tree_util.tree_leaves(opt)
    assert all(isinstance(x, jax.Array) for x in leaves) and jax.tree_util.tree_leaves(opt)[0] is leaves[0]
    assert [x.weak_type for x in leaves[:2]] == [True, False] and float(leaves[0]) == float(np.float32(0.05))
    assert isinstance(opt.learning_rate, float)  # the fields themselves keep what was given

    @jax.jit
    def inside(x):  # flattened under a trace: the numbers as they are, nothing cached
        fresh = tbe_jax.SGD(0.5)
        y = x + jax.tree_util.tree_leaves(fresh)[0]
        assert "_device_leaves" not in fresh.__dict__
        return y
    assert float(inside(1.0)) == 1.5

    f = jax.jit(lambda o, x: o.learning_rate * x)
    assert float(f(opt, 2.0)) == pytest.approx(0.1)
    assert float(f(tbe_jax.Adam(0.05, b1=np.float32(0.8)), 2.0)) == pytest.approx(0.1)
    assert f._cache_size() == 1

    g = jax.jit(lambda o: o, donate_argnums=0)
    g(opt)  # its device leaves donated (deleted on backends that donate): remade at the next flatten
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(opt))
    assert float(f(opt, 2.0)) == pytest.approx(0.1)
