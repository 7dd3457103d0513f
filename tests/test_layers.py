"""The Flax (Linen, NNX) and Haiku layers against the functional core and each other.

Parameters are copied across (the core's params dict goes into each framework's
structure), so outputs and gradients must agree exactly. Training steps run under
`jit` with optax (true gradient) and with the fused row-wise Adagrad path; the long
loops use impl="xla", one short loop per layer runs the kernels (interpret mode on CPU,
compiled on GPU: conftest.KERNEL_KW).
"""

import dataclasses
import doctest
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, specs, layer_build, layer_call

FRAMEWORKS = ["linen", "nnx", "haiku"]
TABLES = specs([20, 12, 9], [8, 4, 8])  # buffers d8 (tables 0 and 2) and d4
FMAP = (0, 1, 2, 1)                     # table 1 shared by two features
BATCH = 3
OUT_DIM = 24                            # 8 + 4 + 8 + 4


def _module(framework):
    """The layer module, or a clean skip when its framework is not installed."""
    if framework == "haiku":
        pytest.importorskip("haiku")
    else:
        pytest.importorskip("flax")
    return pytest.importorskip(f"tbe_jax.{framework}")


def _batch(rng, weighted, num_rows=(20, 12, 9, 12), batch=BATCH):
    idx, off, psw = testing.make_batch(rng, list(num_rows), [batch] * len(num_rows), (0, 5), weighted=weighted)
    return jnp.asarray(idx), jnp.asarray(off), (None if psw is None else jnp.asarray(psw))


# -- one adapter per framework --------------------------------------------------------------------
# Each copies the core's params into the framework's own structure and returns, from one jitted
# call (eager dispatch of the lookup is slow on CPU), the output and the gradient of
# sum(out * cot) with respect to the tables (as a core params dict) and, when weighted, to the
# per-sample weights.


def _with_out(f, cot):
    """f(*args) -> out  becomes  g(*args) -> (sum(out * cot), out), for value_and_grad(has_aux=True)."""
    def g(*args):
        out = f(*args)
        return jnp.sum(out * cot), out
    return g


def _out_and_grads(framework, kw, params, idx, off, psw, cot):
    """(out, grads); cot=None: the output alone (grads None)."""
    argnums = (0, 1) if psw is not None else 0
    if framework == "core":
        emb = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
        apply = lambda p, w: emb(p, idx, off, w)
    elif framework == "nnx":
        mod = _module(framework)
        from flax import nnx

        layer = mod.TableBatchedEmbed(TABLES, rngs=nnx.Rngs(0), **kw)
        layer.set_params(params)
        if cot is None:
            return nnx.jit(lambda m, w: m(idx, off, w))(layer, psw), None
        step = nnx.jit(nnx.value_and_grad(_with_out(lambda m, w: m(idx, off, w), cot), argnums=argnums, has_aux=True))
        (_, out), grads = step(layer, psw)
        g_layer = grads[0] if psw is not None else grads
        g_params = {k: v[...] for k, v in g_layer["embedding"].items()}
        return out, ((g_params, grads[1]) if psw is not None else g_params)
    elif framework == "linen":
        layer = _module(framework).TableBatchedEmbed(TABLES, **kw)
        apply = lambda p, w: layer.apply({"params": {"embedding": p}}, idx, off, w)
    else:
        mod = _module(framework)  # skips before the import when Haiku is missing
        import haiku as hk

        model = hk.without_apply_rng(hk.transform(lambda w: mod.TableBatchedEmbed(TABLES, **kw)(idx, off, w)))
        apply = lambda p, w: model.apply({"table_batched_embed": p}, w)
    if cot is None:
        return jax.jit(apply)(params, psw), None
    (_, out), grads = jax.jit(jax.value_and_grad(_with_out(apply, cot), argnums, has_aux=True))(params, psw)
    return out, grads


@pytest.mark.parametrize("pooling,weighted,impl", [
    ("sum", False, "xla"), ("mean", True, "xla"), ("sum", True, "kernel"),
])
def test_matches_functional_core(rng, pooling, weighted, impl):
    # Outputs and gradients on the XLA path; the kernel case compares outputs only (interpret
    # mode is slow to compile; the kernels' backward runs in the fused training tests).
    kw = dict(feature_table_map=FMAP, pooling=pooling, **(KERNEL_KW if impl == "kernel" else dict(impl="xla")))
    params = tbe_jax.TableBatchedEmbedding(TABLES, **kw).init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, psw = _batch(rng, weighted)
    cot = None if impl == "kernel" else jnp.asarray(rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32))
    want_out, want = _out_and_grads("core", kw, params, idx, off, psw, cot)
    skipped = []
    for framework in FRAMEWORKS:
        try:
            out, got = _out_and_grads(framework, kw, params, idx, off, psw, cot)
        except pytest.skip.Exception:
            skipped.append(framework)
            continue
        # Same math, separately compiled programs: XLA on a GPU may fuse them differently (1 ulp).
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-7, err_msg=framework)
        assert jax.tree.structure(got) == jax.tree.structure(want), framework
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7, err_msg=framework)
    if skipped:
        pytest.skip(f"not installed: {skipped}")


# -- the fused path: the "gradients" are the updated tables and optimizer state -----------------------


def _fused_grads(framework, kw, tx, params, state, idx, off, psw, cot):
    """One jitted grad through the layer's fused path: (new core params, new optimizer state)."""
    mod = _module(framework)
    loss = lambda out: jnp.sum(out * cot)
    if framework == "linen":
        layer = mod.TableBatchedEmbed(TABLES, optimizer=tx, **kw)
        g = jax.jit(jax.grad(lambda fused: loss(layer.apply({mod.FUSED_COLLECTION: fused}, idx, off, psw))))(
            {"embedding": params, "opt_state": state})
        return g["embedding"], g["opt_state"]
    if framework == "nnx":
        from flax import nnx

        layer = mod.TableBatchedEmbed(TABLES, optimizer=tx, rngs=nnx.Rngs(0), **kw)
        layer.set_params(params)
        for name, leaf in zip(layer._opt_names, jax.tree.leaves(state)):
            layer.opt_state[name][...] = leaf

        @nnx.jit
        def step(layer):
            grads = nnx.grad(lambda m: loss(m(idx, off, psw)), argnums=nnx.DiffState(0, mod.DIFF_FILTER))(layer)
            return mod.apply_fused(layer, grads)

        rest = step(layer)
        assert not jax.tree.leaves(rest)  # nothing but the fused variables was differentiable
        return layer.get_params(), layer.get_opt_state()
    import haiku as hk

    emb = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    model = hk.without_apply_rng(hk.transform_with_state(
        lambda: mod.TableBatchedEmbed(TABLES, optimizer=tx, **kw)(idx, off, psw)))
    names = {**{mod.FUSED_PREFIX + k: v for k, v in params.items()},
             **{mod.FUSED_PREFIX + "momentum_" + k: v for k, v in state.momentum.items()}}
    shapes = jax.eval_shape(model.init, jax.random.key(0))[1]
    assert sorted(shapes["table_batched_embed"]) == sorted(names)
    g = jax.jit(jax.grad(lambda s: loss(model.apply({}, s)[0])))({"table_batched_embed": names})
    g = g["table_batched_embed"]
    return mod.fused_params(g), mod.fused_opt_state(g, emb, tx)


def test_fused_gradients_match_core(rng):
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    tx = tbe_jax.rowwise_adagrad(learning_rate=0.1, eps=1e-3)
    params = emb.init(jax.random.key(3))
    state = tx.init(params)
    idx, off, psw = _batch(rng, weighted=True)
    cot = jnp.asarray(rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32))
    want_p, want_s = jax.jit(jax.grad(lambda p, s: jnp.sum(emb.fused_lookup(p, s, tx, idx, off, psw) * cot),
                                      argnums=(0, 1)))(params, state)
    assert np.any(np.asarray(want_s.momentum["d8"]) > 0)  # the step did something
    skipped = []
    for framework in FRAMEWORKS:
        try:
            got_p, got_s = _fused_grads(framework, kw, tx, params, state, idx, off, psw, cot)
        except pytest.skip.Exception:
            skipped.append(framework)
            continue
        assert sorted(got_p) == sorted(want_p) == ["d4", "d8"], framework
        for k in want_p:
            np.testing.assert_allclose(np.asarray(got_p[k]), np.asarray(want_p[k]), rtol=1e-6, atol=1e-7,
                                       err_msg=framework)
            np.testing.assert_allclose(np.asarray(got_s.momentum[k]), np.asarray(want_s.momentum[k]), rtol=1e-6,
                                       err_msg=framework)
    if skipped:
        pytest.skip(f"not installed: {skipped}")


# -- training through each layer -------------------------------------------------------------------
# A toy regression: a fixed batch, pooled embeddings -> linear head -> MSE against random targets.

TRAIN_TABLES = specs([30, 16], [8, 8])
TRAIN_B = 8


def _train_batch(rng):
    idx, off, _ = testing.make_batch(rng, [30, 16], [TRAIN_B, TRAIN_B], (1, 4))
    y = rng.standard_normal(TRAIN_B).astype(np.float32)
    return jnp.asarray(idx), jnp.asarray(off), jnp.asarray(y)


def _train(framework, kw, fused, steps, rng):
    """Losses of `steps` jitted training steps: optax Adam on the dense head, and on the
    tables too (true gradient) or row-wise Adagrad fused into the lookup's backward.

    Linen and Haiku initialise by running the model; they do that with impl="xla" (the
    same parameters, without compiling the kernels twice)."""
    mod = _module(framework)
    init_kw = dict(kw, impl="xla", interpret=False)
    idx, off, y = _train_batch(rng)
    tx = optax.adam(0.05)
    emb_tx = tbe_jax.rowwise_adagrad(learning_rate=0.3) if fused else None
    losses = []
    if framework == "linen":
        import flax.linen as nn

        class Model(nn.Module):
            options: tuple

            @nn.compact
            def __call__(self, i, o):
                pooled = mod.TableBatchedEmbed(TRAIN_TABLES, optimizer=emb_tx, name="embed", **dict(self.options))(i, o)
                return nn.Dense(1)(pooled)[:, 0]

        model = Model(tuple(kw.items()))
        # jit: eager lookups are slow on CPU
        variables = jax.jit(Model(tuple(init_kw.items())).init)(jax.random.key(0), idx, off)
        params = variables["params"]
        fused_vars = variables.get(mod.FUSED_COLLECTION, {})
        assert ("embed" in params) != fused  # the tables are params only in true-gradient mode
        opt_state = tx.init(params)

        @jax.jit
        def step(params, fused_vars, opt_state):
            def loss_fn(params, fused_vars):
                pred = model.apply({"params": params, mod.FUSED_COLLECTION: fused_vars}, idx, off)
                return jnp.mean((pred - y) ** 2)

            loss, (g, fused_vars) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fused_vars)
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), fused_vars, opt_state, loss

        for _ in range(steps):
            params, fused_vars, opt_state, loss = step(params, fused_vars, opt_state)
            losses.append(float(loss))
        return losses

    if framework == "nnx":
        from flax import nnx

        class Model(nnx.Module):
            def __init__(self, rngs):
                self.embed = mod.TableBatchedEmbed(TRAIN_TABLES, optimizer=emb_tx, rngs=rngs, **kw)
                self.head = nnx.Linear(16, 1, rngs=rngs)

            def __call__(self, i, o):
                return self.head(self.embed(i, o))[:, 0]

        model = Model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            loss_fn = lambda m: jnp.mean((m(idx, off) - y) ** 2)
            if fused:
                loss, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, mod.DIFF_FILTER))(model)
                g = mod.apply_fused(model, g)
            else:
                loss, g = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, g)
            return loss

        return [float(step(model, optimizer)) for _ in range(steps)]

    import haiku as hk

    def make(options):
        def forward(i, o):
            pooled = mod.TableBatchedEmbed(TRAIN_TABLES, optimizer=emb_tx, name="embed", **options)(i, o)
            return hk.Linear(1)(pooled)[:, 0]

        return hk.without_apply_rng(hk.transform_with_state(forward))

    model = make(kw)
    params, state = jax.jit(make(init_kw).init)(jax.random.key(0), idx, off)
    assert ("embed" in params) != fused
    opt_state = tx.init(params)

    @jax.jit
    def step(params, state, opt_state):
        fused_st, other = hk.data_structures.partition(mod.is_fused, state)

        def loss_fn(params, fused_st):
            pred, _ = model.apply(params, hk.data_structures.merge(fused_st, other), idx, off)
            return jnp.mean((pred - y) ** 2)

        loss, (g, fused_st) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fused_st)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), hk.data_structures.merge(fused_st, other), opt_state, loss

    for _ in range(steps):
        params, state, opt_state, loss = step(params, state, opt_state)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("fused", [False, True], ids=["optax", "fused_adagrad"])
def test_training_lowers_loss(rng, framework, fused):
    losses = _train(framework, dict(impl="xla"), fused, 30, rng)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.3 * losses[0], losses


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fused_training_on_kernels(rng, framework):
    # The forward kernel and the sorted-run backward kernels, through each layer.
    losses = _train(framework, dict(KERNEL_KW), True, 3, rng)
    assert losses[-1] < losses[0], losses


def test_fused_sgd_linen(rng):
    # SGD keeps no optimizer state (an empty SGDState in the collection).
    mod = _module("linen")
    idx, off, _ = _batch(rng, weighted=False)
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    tx = tbe_jax.sgd(learning_rate=0.5)
    layer = mod.TableBatchedEmbed(TABLES, feature_table_map=FMAP, impl="xla", optimizer=tx)
    fused = jax.jit(layer.init)(jax.random.key(0), idx, off)[mod.FUSED_COLLECTION]
    assert fused["opt_state"] == tbe_jax.SGDState()
    new = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply({mod.FUSED_COLLECTION: v}, idx, off))))(fused)
    params = fused["embedding"]
    # SGD on the looked-up rows: row -= lr * (its dense gradient); other rows unchanged.
    grads = jax.jit(jax.grad(lambda p: jnp.sum(emb(p, idx, off))))(params)
    for k in params:
        hit = np.any(np.asarray(grads[k]) != 0, axis=1)
        want = np.where(hit[:, None], np.asarray(params[k]) - 0.5 * np.asarray(grads[k]), np.asarray(params[k]))
        np.testing.assert_allclose(np.asarray(new["embedding"][k]), want, rtol=1e-6, atol=1e-7)
    assert new["opt_state"] == tbe_jax.SGDState()


# -- initialisation, validation, docs --------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_init_is_the_cores(framework):
    mod = _module(framework)
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    idx = jnp.array([0, 1, 2, 3], jnp.int32)
    off = jnp.array([0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4], jnp.int32)
    if framework == "linen":
        layer = mod.TableBatchedEmbed(TABLES, feature_table_map=FMAP, impl="xla")
        got = jax.jit(layer.init)(jax.random.key(0), idx, off)["params"]["embedding"]
        assert layer.tbe == emb
        # Linen derives the parameter's key from the "params" rng and the module path:
        # check the distribution (emb.init's bounds) rather than the values.
        bounds = {"d8": 1 / np.sqrt(9), "d4": 1 / np.sqrt(12)}
        for k, v in got.items():
            assert v.shape == emb.init(jax.random.key(0))[k].shape
            assert 0 < np.abs(np.asarray(v)).max() <= bounds[k]
        return
    if framework == "nnx":
        from flax import nnx

        layer = mod.TableBatchedEmbed(TABLES, feature_table_map=FMAP, impl="xla", rngs=nnx.Rngs(5))
        got, want = layer.get_params(), emb.init(nnx.Rngs(5).params())
    else:
        import haiku as hk

        f = hk.transform(lambda: mod.TableBatchedEmbed(TABLES, feature_table_map=FMAP, impl="xla")(idx, off))
        got = jax.jit(f.init)(jax.random.key(5))["table_batched_embed"]
        first_key = hk.transform(lambda: hk.next_rng_key()).apply({}, jax.random.key(5))
        want = emb.init(first_key)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("which", ["indices", "offsets"])
def test_float_ids_raise(framework, which):
    mod = _module(framework)
    idx = jnp.array([1, 2, 3, 4], jnp.int32)
    off = jnp.array([0, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 4], jnp.int32)
    if which == "indices":
        idx = idx.astype(jnp.float32)
    else:
        off = off.astype(jnp.float32)
    kw = dict(feature_table_map=FMAP, impl="xla")
    with pytest.raises(ValueError, match=f"{which} must hold integer ids.*float32"):
        layer_call(framework, mod.TableBatchedEmbed, TABLES, idx, off, **kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_options_raise(framework):
    mod = _module(framework)
    build = lambda *args, **kw: layer_build(framework, mod.TableBatchedEmbed, TABLES, *args, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="pooling"):
        build(pooling="max")
    with pytest.raises(TypeError, match="rowwise_adagrad"):
        build(optimizer=optax.adam(0.1))
    with pytest.raises(TypeError):
        build(FMAP)  # options are keyword-only


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_core_option_is_forwarded(framework):
    mod = _module(framework)
    core = inspect.signature(tbe_jax.TableBatchedEmbedding.__init__).parameters
    want = {n for n, p in core.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if framework == "linen":
        have = {f.name for f in dataclasses.fields(mod.TableBatchedEmbed)}
    else:
        params = inspect.signature(mod.TableBatchedEmbed.__init__).parameters
        have = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert want <= have, f"not forwarded: {sorted(want - have)}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_docstring_examples(framework):
    mod = _module(framework)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
