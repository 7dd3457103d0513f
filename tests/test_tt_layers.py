"""The Flax (Linen, NNX) and Haiku TT layers against the functional `tt_jax.TTEmbeddingBag`.

Parameters are copied across (the core's params dict goes into each framework's
structure), so outputs and gradients must agree exactly. Training under `jit` with optax
(true gradient) and with the fused row-wise Adagrad is in each module's docstring, run
here; those use impl="xla", and one short fused loop runs the FlowTT kernel (interpret
mode on CPU, compiled on GPU: conftest.KERNEL_KW).
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
import tt_jax
from conftest import KERNEL_KW, layer_build, layer_call
from tbe_jax import testing

FRAMEWORKS = ["linen", "nnx", "haiku"]
# Tables 0 and 2 share (q_shapes, ranks) and are stacked into one kernel group; table 1 has two cores.
SPECS = [tt_jax.TTSpec(60, 8, ranks=(3, 4)), tt_jax.TTSpec(40, 4, ranks=(2,)), tt_jax.TTSpec(30, 8, ranks=(3, 4))]
FMAP = (0, 1, 2, 1)  # table 1 shared by two features
ROWS = (60, 40, 30, 40)
BATCH = 3
OUT_DIM = 24  # 8 + 4 + 8 + 4


def _module(framework):
    """The layer module, or a clean skip when its framework is not installed."""
    pytest.importorskip("haiku" if framework == "haiku" else "flax")
    return pytest.importorskip(f"tt_jax.{framework}")


def _batch(rng, weighted):
    idx, off, psw = testing.make_batch(rng, list(ROWS), [BATCH] * len(ROWS), (0, 5), weighted=weighted)
    return jnp.asarray(idx), jnp.asarray(off), (None if psw is None else jnp.asarray(psw))


def _params(kw, seed):
    """Core params with entries of order 0.3 (the default init's are tiny: exact checks want sizeable values)."""
    return tt_jax.TTEmbeddingBag(SPECS, **kw).init(jax.random.key(seed), std=0.3)


def _close(got, want, err_msg, rtol=1e-6, atol=1e-7):
    assert jax.tree.structure(got) == jax.tree.structure(want), err_msg
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=err_msg)


# -- one adapter per framework --------------------------------------------------------------------
# Each copies the core's params into the framework's own structure and returns, from one jitted
# call, the output and the gradients of sum(out * cot) with respect to the cores (as a core params
# dict) and to the per-sample weights.


def _with_out(f, cot):
    """f(*args) -> out  becomes  g(*args) -> (sum(out * cot), out), for value_and_grad(has_aux=True)."""
    def g(*args):
        out = f(*args)
        return jnp.sum(out * cot), out
    return g


def _out_and_grads(framework, kw, params, idx, off, psw, cot):
    """(out, (d params, d per_sample_weights))."""
    emb = tt_jax.TTEmbeddingBag(SPECS, **kw)
    if framework == "core":
        apply = lambda p, w: emb(p, idx, off, w)
    elif framework == "nnx":
        mod = _module(framework)
        from flax import nnx

        layer = mod.TTEmbeddingBag(SPECS, rngs=nnx.Rngs(0), **kw)
        layer.set_params(params)
        step = nnx.jit(nnx.value_and_grad(_with_out(lambda m, w: m(idx, off, w), cot), argnums=(0, 1), has_aux=True))
        (_, out), (g_layer, g_psw) = step(layer, psw)
        holder = mod.TTEmbeddingBag(SPECS, rngs=nnx.Rngs(1), **kw)  # reads the gradient State as core params
        nnx.update(holder, g_layer)
        return out, (holder.get_params(), g_psw)
    elif framework == "linen":
        layer = _module(framework).TTEmbeddingBag(SPECS, **kw)
        assert layer.tt == emb
        apply = lambda p, w: layer.apply({"params": {"embedding": p}}, idx, off, w)
    else:
        mod = _module(framework)  # skips before the import when Haiku is missing
        import haiku as hk

        model = hk.without_apply_rng(hk.transform(lambda w: mod.TTEmbeddingBag(SPECS, **kw)(idx, off, w)))
        # Differentiated with respect to the core's params dict p, spread into the layer's names.
        apply = lambda p, w: model.apply({"tt_embedding_bag": mod.module_params(p)}, w)
    (_, out), grads = jax.jit(jax.value_and_grad(_with_out(apply, cot), (0, 1), has_aux=True))(params, psw)
    return out, grads


def test_matches_functional_core(rng):
    # Outputs and gradients on the XLA path, mean pooling, weighted (the kernel path is the same
    # option forwarded: it runs in test_fused_training_on_kernel; interpret mode is slow to compile).
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    params = _params(kw, int(rng.integers(1 << 30)))
    idx, off, psw = _batch(rng, weighted=True)
    cot = jnp.asarray(rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32))
    want_out, want = _out_and_grads("core", kw, params, idx, off, psw, cot)
    assert float(jnp.abs(want_out).max()) > 1e-2 and float(jnp.abs(want[1]).max()) > 1e-3  # not zeros
    skipped = []
    for framework in FRAMEWORKS:
        try:
            out, got = _out_and_grads(framework, kw, params, idx, off, psw, cot)
        except pytest.skip.Exception:
            skipped.append(framework)
            continue
        # Same math, separately compiled programs: XLA on a GPU may fuse them differently (1 ulp).
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-7, err_msg=framework)
        _close(got, want, framework)
    if skipped:
        pytest.skip(f"not installed: {skipped}")


# -- the fused path: the "gradients" are the updated cores and optimizer state -------------------------


def _fused_grads(framework, kw, tx, params, state, idx, off, psw, cot):
    """One jitted grad through the layer's fused path: (new core params, new optimizer state)."""
    mod = _module(framework)
    loss = lambda out: jnp.sum(out * cot)
    if framework == "linen":
        layer = mod.TTEmbeddingBag(SPECS, optimizer=tx, **kw)
        g = jax.jit(jax.grad(lambda fused: loss(layer.apply({mod.FUSED_COLLECTION: fused}, idx, off, psw))))(
            {"embedding": params, "opt_state": state})
        return g["embedding"], g["opt_state"]
    if framework == "nnx":
        from flax import nnx

        layer = mod.TTEmbeddingBag(SPECS, optimizer=tx, rngs=nnx.Rngs(0), **kw)
        layer.set_params(params)
        layer.set_opt_state(state)

        @nnx.jit
        def step(layer):
            grads = nnx.grad(lambda m: loss(m(idx, off, psw)), argnums=nnx.DiffState(0, mod.DIFF_FILTER))(layer)
            return mod.apply_fused(layer, grads)

        rest = step(layer)
        assert not jax.tree.leaves(rest)  # nothing but the fused variables was differentiable
        return layer.get_params(), layer.get_opt_state()
    import haiku as hk

    emb = tt_jax.TTEmbeddingBag(SPECS, **kw)
    model = hk.without_apply_rng(hk.transform_with_state(
        lambda: mod.TTEmbeddingBag(SPECS, optimizer=tx, **kw)(idx, off, psw)))
    entry = mod.module_state(params, state)
    shapes = jax.eval_shape(model.init, jax.random.key(0))[1]
    assert sorted(shapes["tt_embedding_bag"]) == sorted(entry)
    g = jax.jit(jax.grad(lambda s: loss(model.apply({}, s)[0])))({"tt_embedding_bag": entry})
    g = g["tt_embedding_bag"]
    return mod.fused_params(g, emb), mod.fused_opt_state(g, emb, tx)


def test_fused_gradients_match_core(rng):
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    emb = tt_jax.TTEmbeddingBag(SPECS, **kw)
    tx = tt_jax.rowwise_adagrad(learning_rate=0.1, eps=1e-3)
    params = _params(kw, 3)
    state = tx.init(params)
    idx, off, psw = _batch(rng, weighted=True)
    cot = jnp.asarray(rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32))
    want_p, want_s = jax.jit(jax.grad(lambda p, s: jnp.sum(emb.fused_lookup(p, s, tx, idx, off, psw) * cot),
                                      argnums=(0, 1)))(params, state)
    assert np.any(np.asarray(want_s.momentum[0][1]) > 0)  # the step did something
    assert not np.array_equal(np.asarray(want_p["cores"][0][1]), np.asarray(params["cores"][0][1]))
    skipped = []
    for framework in FRAMEWORKS:
        try:
            got_p, got_s = _fused_grads(framework, kw, tx, params, state, idx, off, psw, cot)
        except pytest.skip.Exception:
            skipped.append(framework)
            continue
        assert type(got_s) is type(want_s), framework
        _close(got_p, want_p, framework)
        _close(got_s, want_s, framework)
    if skipped:
        pytest.skip(f"not installed: {skipped}")


def _empty_batch():
    """No lookups (B=0): a layer's init then only draws its variables, with no lookup to run."""
    return jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32)


def test_fused_sgd_keeps_no_state(rng):
    # SGD: an empty SGDState; the step is G -= lr * g on the touched slices (the core's apply_gradients).
    mod = _module("linen")
    kw = dict(feature_table_map=FMAP, impl="xla")
    emb = tt_jax.TTEmbeddingBag(SPECS, **kw)
    idx, off, _ = _batch(rng, weighted=False)
    tx = tt_jax.sgd(learning_rate=0.5)
    layer = mod.TTEmbeddingBag(SPECS, optimizer=tx, **kw)
    fused = layer.init(jax.random.key(0), *_empty_batch())[mod.FUSED_COLLECTION]
    assert fused["opt_state"] == tt_jax.SGDState()
    fused = {"embedding": _params(kw, 1), "opt_state": fused["opt_state"]}
    new = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply({mod.FUSED_COLLECTION: v}, idx, off))))(fused)
    assert new["opt_state"] == tt_jax.SGDState()
    g_out = jnp.ones((BATCH, OUT_DIM), jnp.float32)
    want, _ = jax.jit(lambda p: emb.apply_gradients(p, tt_jax.SGDState(), tt_jax.SGD(0.5), idx, off, g_out))(
        fused["embedding"])
    _close(new["embedding"], want, "linen sgd")
    assert not np.array_equal(np.asarray(want["cores"][0][0]), np.asarray(fused["embedding"]["cores"][0][0]))


# -- training through each layer -------------------------------------------------------------------
# Each module's docstring trains a TT layer + dense head both ways (optax Adam on the cores; the fused
# row-wise Adagrad) in jitted steps and checks the loss halves: test_docstring_examples runs them.
# Here: the fused path on the kernel, and a model mixing fused TBE and TT layers.

TRAIN_SPECS = [tt_jax.TTSpec(30, 8, ranks=(4, 4)), tt_jax.TTSpec(16, 8, ranks=(4,))]
TRAIN_B = 8


def _train_batch(rng):
    idx, off, _ = testing.make_batch(rng, [30, 16], [TRAIN_B, TRAIN_B], (1, 4))
    y = rng.standard_normal(TRAIN_B).astype(np.float32)
    return jnp.asarray(idx), jnp.asarray(off), jnp.asarray(y)


def test_fused_training_on_kernel(rng):
    # The FlowTT forward kernel and the backward on its plans, through the NNX layer: a linear head
    # on Adam, the cores on the fused row-wise Adagrad, one jitted step.
    mod = _module("nnx")
    from flax import nnx

    idx, off, y = _train_batch(rng)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = mod.TTEmbeddingBag(TRAIN_SPECS, init_std=0.3, optimizer=tt_jax.rowwise_adagrad(0.1),
                                            rngs=rngs, **KERNEL_KW)
            self.head = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, i, o):
            return self.head(self.embed(i, o))[:, 0]

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss_fn = lambda m: jnp.mean((m(idx, off) - y) ** 2)
        loss, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, mod.DIFF_FILTER))(model)
        optimizer.update(model, mod.apply_fused(model, g))
        return loss

    losses = [float(step(model, optimizer)) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_mixed_tbe_and_tt_model_one_fused_step(rng):
    # A fused TBE layer and a fused TT layer share the fused variable type: one step trains both.
    mod = _module("nnx")
    from flax import nnx

    import tbe_jax.nnx

    assert mod.Fused is tbe_jax.nnx.Fused
    idx, off, y = _train_batch(rng)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.tbe = tbe_jax.nnx.TableBatchedEmbed([tbe_jax.TableSpec(30, 8), tbe_jax.TableSpec(16, 8)],
                                                     impl="xla", optimizer=tbe_jax.rowwise_adagrad(0.3), rngs=rngs)
            self.tt = mod.TTEmbeddingBag(TRAIN_SPECS, impl="xla", init_std=0.3,
                                         optimizer=tt_jax.rowwise_adagrad(0.1), rngs=rngs)

        def __call__(self, i, o):
            return jnp.sum(self.tbe(i, o) * self.tt(i, o), axis=1)

    model = Model(nnx.Rngs(0))
    before_tbe, before_tt = model.tbe.get_params(), model.tt.get_params()

    @nnx.jit
    def step(model):
        loss_fn = lambda m: jnp.mean((m(idx, off) - y) ** 2)
        loss, g = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, mod.DIFF_FILTER))(model)
        assert not jax.tree.leaves(mod.apply_fused(model, g))
        return loss

    losses = [float(step(model)) for _ in range(10)]
    assert losses[-1] < losses[0], losses
    assert not np.array_equal(np.asarray(before_tbe["d8"]), np.asarray(model.tbe.get_params()["d8"]))
    assert not np.array_equal(np.asarray(before_tt["cores"][0][0]), np.asarray(model.tt.get_params()["cores"][0][0]))


# -- initialisation, validation, docs --------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_init_is_the_cores(framework):
    mod = _module(framework)
    emb = tt_jax.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla")
    idx, off = _empty_batch()
    if framework == "linen":
        layer = mod.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla", initializer="approx-uniform")
        got = layer.init(jax.random.key(0), idx, off)["params"]["embedding"]
        assert layer.tt == emb
        # Linen derives the parameter's key from the "params" rng and the module path: check the
        # structure and the law's bound (approx-uniform draws in [-a, a]) rather than the values.
        want = emb.init(jax.random.key(0), "approx-uniform")
        assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert 0 < np.abs(np.asarray(g)).max() <= np.abs(np.asarray(w)).max() * 1.2
        return
    if framework == "nnx":
        from flax import nnx

        layer = mod.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla", init_std=0.2, rngs=nnx.Rngs(5))
        got, want = layer.get_params(), emb.init(nnx.Rngs(5).params(), std=0.2)
    else:
        import haiku as hk

        f = hk.transform(lambda: mod.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla", init_std=0.2)(idx, off))
        got = mod.core_params(f.init(jax.random.key(5))["tt_embedding_bag"], emb)
        first_key = hk.transform(lambda: hk.next_rng_key()).apply({}, jax.random.key(5))
        want = emb.init(first_key, std=0.2)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
        layer_call(framework, mod.TTEmbeddingBag, SPECS, idx, off, **kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_options_raise(framework):
    mod = _module(framework)
    build = lambda *args, **kw: layer_build(framework, mod.TTEmbeddingBag, SPECS, *args, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="pooling"):
        build(pooling="max")
    with pytest.raises(TypeError, match="tt_jax.rowwise_adagrad"):
        build(optimizer=optax.adam(0.1))
    with pytest.raises(TypeError, match="tt_jax.rowwise_adagrad"):
        build(optimizer=tbe_jax.rowwise_adagrad(0.1))  # the TBE's fused optimizer is not the TT's
    with pytest.raises(TypeError):
        build(FMAP)  # options are keyword-only


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_core_option_is_forwarded(framework):
    mod = _module(framework)
    core = inspect.signature(tt_jax.TTEmbeddingBag.__init__).parameters
    want = {n for n, p in core.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if framework == "linen":
        have = {f.name for f in dataclasses.fields(mod.TTEmbeddingBag)}
    else:
        params = inspect.signature(mod.TTEmbeddingBag.__init__).parameters
        have = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert want <= have, f"not forwarded: {sorted(want - have)}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_docstring_examples(framework):
    # The module docstrings train both ways (optax; fused row-wise Adagrad) and check the loss halves.
    mod = _module(framework)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
