"""The Flax (Linen, NNX) and Haiku TT layers against the functional `tt_jax.TTEmbeddingBag`.

The same layers as tbe_jax's over a tensor-train core (one base class per framework): true
gradients equal the core's; the sparse `train_step` equals the functional `tbe_jax.train_step`
(under `jit`, a schedule compiling once); a model holding a TBE and a TT sparse layer trains
both in one step. The model harness is test_layers.py's. The XLA path mostly; one short step
per framework runs the FlowTT kernels (interpret mode on CPU, compiled on GPU).
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
from conftest import KERNEL_KW, ON_GPU, layer_build, layer_call
from test_layers import close, functional_steps, head_loss, make_batch, make_head, module, sparse_runner

FRAMEWORKS = ["linen", "nnx", "haiku"]
# Small on purpose (XLA compiles the TT chain slowly on CPU): a three-core and a two-core table.
SPECS = [tt_jax.TTSpec(60, 8, ranks=(3, 4)), tt_jax.TTSpec(40, 4, ranks=(2,))]
FMAP = (0, 1, 1)  # table 1 shared by two features
ROWS = (60, 40, 40)
BATCH = 3
OUT_DIM = 16  # 8 + 4 + 4


def _params(core, seed):
    """Core params with entries of order 0.3 (the default init's are tiny: exact checks want sizeable values)."""
    return core.init(jax.random.key(seed), std=0.3)


def tt_layer(framework, opt, **kw):
    mod = module("tt_jax", framework)
    return lambda **fkw: mod.TTEmbeddingBag(SPECS, optimizer=opt, **kw, **fkw)


def _with_out(f, cot):
    """f(*args) -> out  becomes  g(*args) -> (sum(out * cot), out), for value_and_grad(has_aux=True)."""
    def g(*args):
        out = f(*args)
        return jnp.sum(out * cot), out
    return g


def test_true_gradient_matches_core(rng):
    # Every framework's output and gradients (cores, per-sample weights) equal the core's.
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    emb = tt_jax.TTEmbeddingBag(SPECS, **kw)
    params = _params(emb, int(rng.integers(1 << 30)))
    idx, off, psw, _ = make_batch(rng, ROWS, weighted=True)
    cot = jnp.asarray(rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32))

    def grads(apply, p):
        return jax.jit(jax.value_and_grad(_with_out(apply, cot), (0, 1), has_aux=True))(p, psw)

    (_, want_out), want = grads(lambda p, w: emb(p, idx, off, w), params)
    assert float(jnp.abs(want_out).max()) > 1e-2 and float(jnp.abs(want[1]).max()) > 1e-3  # not zeros
    for framework in FRAMEWORKS:
        mod = module("tt_jax", framework)
        if framework == "nnx":
            from flax import nnx

            layer = mod.TTEmbeddingBag(SPECS, rngs=nnx.Rngs(0), **kw)
            layer.set_params(params)
            step = nnx.jit(nnx.value_and_grad(_with_out(lambda m, w: m(idx, off, w), cot), argnums=(0, 1),
                                              has_aux=True))
            (_, out), (g_layer, g_psw) = step(layer, psw)
            holder = mod.TTEmbeddingBag(SPECS, rngs=nnx.Rngs(1), **kw)  # reads the gradient State as core params
            nnx.update(holder, g_layer)
            got = (holder.get_params(), g_psw)
        elif framework == "linen":
            layer = mod.TTEmbeddingBag(SPECS, **kw)
            assert layer.tt == emb
            (_, out), got = grads(lambda p, w: layer.apply({"params": {"embedding": p}}, idx, off, w), params)
        else:
            import haiku as hk

            model = hk.without_apply_rng(hk.transform(lambda w: mod.TTEmbeddingBag(SPECS, **kw)(idx, off, w)))
            (_, out), got = grads(lambda p, w: model.apply({"tt_embedding_bag": mod.module_params(p)}, w), params)
        close(out, want_out, framework)
        close(got, want, framework)


@pytest.mark.parametrize("framework,opt_name", [("linen", "adagrad"), ("nnx", "rowwise_adagrad"), ("haiku", "sgd")])
def test_sparse_step_matches_functional(rng, framework, opt_name):
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    core = tt_jax.TTEmbeddingBag(SPECS, **kw)
    schedule = optax.linear_schedule(0.05, 0.2, 3)
    opt = {"adagrad": tt_jax.Adagrad(schedule, eps=1e-3), "rowwise_adagrad": tt_jax.RowwiseAdagrad(schedule, eps=1e-3),
           "sgd": tt_jax.SGD(schedule)}[opt_name]
    tables = _params(core, 1)
    state = opt.init(tables)
    head = make_head(rng, OUT_DIM)
    batch = make_batch(rng, ROWS, weighted=True)
    step, read, traces = sparse_runner(framework, "tt_jax", tt_layer(framework, opt, **kw), OUT_DIM,
                                       tables, state, head)
    losses = [step(batch) for _ in range(3)]
    assert traces[0] == 1  # a schedule reads the state's count: no recompilation
    want_losses, want_grads, want_t, want_s = functional_steps(core, opt, tables, state, head, batch, 3)
    got_t, got_s = read()
    assert type(got_s) is type(want_s)
    # On a GPU the two programs (layer and functional) are compiled apart: fusion and FMA contraction may
    # differ in the last bits, which three steps carry to ~3e-6 relative; on the CPU they agree to 1e-6.
    tol = dict(rtol=1e-5, atol=1e-6) if ON_GPU else {}
    close(got_t, want_t, framework, **tol)
    close(got_s, want_s, framework, **tol)
    assert int(got_s.count) == 3
    close([l for l, _ in losses], want_losses, framework, **tol)
    close(losses[-1][1], want_grads, framework, **tol)
    assert not np.array_equal(np.asarray(got_t["cores"][0][1]), np.asarray(tables["cores"][0][1]))  # it trained


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sparse_step_on_kernel(rng, framework):
    # The FlowTT forward kernel and the backward on its plans: one step equals the XLA reference's
    # (one two-core table: interpret mode compiles slowly).
    spec = SPECS[1]
    opt = tt_jax.RowwiseAdagrad(0.1, eps=1e-3)
    core = tt_jax.TTEmbeddingBag(spec, impl="xla")
    tables = _params(core, 2)
    state = opt.init(tables)
    head = make_head(rng, spec.embedding_dim)
    batch = make_batch(rng, ROWS[1:2], weighted=False)
    mod = module("tt_jax", framework)
    make_layer = lambda **fkw: mod.TTEmbeddingBag(spec, optimizer=opt, **KERNEL_KW, **fkw)  # noqa: E731
    step, read, _ = sparse_runner(framework, "tt_jax", make_layer, spec.embedding_dim, tables, state, head)
    loss, _ = step(batch)
    want_losses, _, want_t, want_s = functional_steps(core, opt, tables, state, head, batch, 1)
    got_t, got_s = read()
    close(got_t, want_t, framework, rtol=1e-5, atol=1e-6)
    close(got_s, want_s, framework, rtol=1e-5, atol=1e-6)
    close(loss, want_losses[0], framework, rtol=1e-5)


def test_disconnected_output_and_second_call(rng):
    # Haiku: a disconnected output leaves the cores and accumulators unchanged; NNX: a second
    # call raises (the other frameworks: test_layers.py, the same base classes).
    opt = tt_jax.Adagrad(0.5)
    core = tt_jax.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla")
    tables = _params(core, 3)
    state = opt.init(tables)
    layer = dict(feature_table_map=FMAP, impl="xla")
    step, read, _ = sparse_runner("haiku", "tt_jax", tt_layer("haiku", opt, **layer), OUT_DIM, tables, state,
                                  make_head(rng, OUT_DIM), mode="ignore")
    step(make_batch(rng, ROWS, weighted=False))
    got_t, got_s = read()
    close(got_t, tables, rtol=0, atol=0)
    close(got_s.momentum, state.momentum, rtol=0, atol=0)
    assert int(got_s.count) == 1
    step, _, _ = sparse_runner("nnx", "tt_jax", tt_layer("nnx", opt, **layer), OUT_DIM, tables, state,
                               make_head(rng, OUT_DIM), mode="twice")
    with pytest.raises(ValueError, match="called twice in one training step"):
        step(make_batch(rng, ROWS, weighted=False))


# -- a TBE and a TT sparse layer in one model, one step ----------------------------------------------

MIX_TABLES = [tbe_jax.TableSpec(30, 8)]
MIX_SPECS = [tt_jax.TTSpec(16, 4, ranks=(2,))]


@pytest.mark.parametrize("framework", ["nnx"])  # Linen and Haiku: the same recorder, see test_layers.py
def test_mixed_tbe_and_tt_model_one_step(rng, framework):
    tt_mod, tbe_mod = module("tt_jax", framework), module("tbe_jax", framework)
    assert tt_mod.train_step is tbe_mod.train_step  # one implementation
    tbe_core = tbe_jax.TableBatchedEmbedding(MIX_TABLES, impl="xla")
    tt_core = tt_jax.TTEmbeddingBag(MIX_SPECS, impl="xla")
    tbe_opt, tt_opt = tbe_jax.RowwiseAdagrad(0.3), tt_jax.Adagrad(0.1)
    tbe_t, tt_t = tbe_core.init(jax.random.key(0)), tt_core.init(jax.random.key(1), std=0.3)
    tbe_s, tt_s = tbe_opt.init(tbe_t), tt_opt.init(tt_t)
    head = make_head(rng, 12)
    idx, off, _, y = make_batch(rng, (16,), weighted=False, batch=4)

    if framework == "nnx":
        from flax import nnx

        class Model(nnx.Module):
            def __init__(self):
                self.tbe = tbe_mod.TableBatchedEmbed(MIX_TABLES, impl="xla", optimizer=tbe_opt, rngs=nnx.Rngs(0))
                self.tt = tt_mod.TTEmbeddingBag(MIX_SPECS, impl="xla", optimizer=tt_opt, rngs=nnx.Rngs(1))
                self.head = nnx.Linear(12, 1, rngs=nnx.Rngs(2))

            def __call__(self, i, o):
                return self.head(jnp.concatenate([self.tbe(i, o), self.tt(i, o)], axis=1))[:, 0]

        model = Model()
        model.tbe.set_params(tbe_t)
        model.tt.set_params(tt_t)
        model.head.kernel[...], model.head.bias[...] = head["kernel"], head["bias"]
        loss, grads = nnx.jit(lambda m: tt_mod.train_step(lambda m: jnp.mean((m(idx, off) - y) ** 2), m))(model)
        grads = {"kernel": grads["head"]["kernel"][...], "bias": grads["head"]["bias"][...]}
        got = (model.tbe.get_params(), model.tbe.get_opt_state(), model.tt.get_params(), model.tt.get_opt_state())
    else:
        import flax.linen as nn

        class Model(nn.Module):
            @nn.compact
            def __call__(self, i, o):
                pooled = [tbe_mod.TableBatchedEmbed(MIX_TABLES, impl="xla", optimizer=tbe_opt, name="tbe")(i, o),
                          tt_mod.TTEmbeddingBag(MIX_SPECS, impl="xla", optimizer=tt_opt, name="tt")(i, o)]
                return nn.Dense(1, name="head")(jnp.concatenate(pooled, axis=1))[:, 0]

        model = Model()
        v = {"params": {"head": head}, "tbe_fused": {"tbe": {"embedding": tbe_t, "opt_state": tbe_s},
                                                      "tt": {"embedding": tt_t, "opt_state": tt_s}}}
        loss, grads, v = jax.jit(lambda v: tt_mod.train_step(
            lambda v: jnp.mean((model.apply(v, idx, off) - y) ** 2), v))(v)
        grads = grads["head"]
        f = v["tbe_fused"]
        got = (f["tbe"]["embedding"], f["tbe"]["opt_state"], f["tt"]["embedding"], f["tt"]["opt_state"])

    want = jax.jit(lambda: tbe_jax.train_step(
        lambda h, outs: head_loss(h, jnp.concatenate([outs["tbe"], outs["tt"]], axis=1), y), head,
        {"tbe": tbe_jax.SparseLookup(tbe_core, tbe_opt, tbe_t, tbe_s, idx, off),
         "tt": tbe_jax.SparseLookup(tt_core, tt_opt, tt_t, tt_s, idx, off)}))()
    close(loss, want.loss)
    close(grads, want.grads)
    close(got, (want.params["tbe"], want.opt_state["tbe"], want.params["tt"], want.opt_state["tt"]), framework)
    assert not np.array_equal(np.asarray(got[0]["d8"]), np.asarray(tbe_t["d8"]))
    assert not np.array_equal(np.asarray(got[2]["cores"][0][0]), np.asarray(tt_t["cores"][0][0]))


# -- construction, validation, docs ------------------------------------------------------------------


def _empty_batch():
    """No lookups (B=0): a layer's init then only draws its variables, with no lookup to run."""
    return jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_init_is_the_cores(framework):
    mod = module("tt_jax", framework)
    emb = tt_jax.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla")
    idx, off = _empty_batch()
    if framework == "linen":
        layer = mod.TTEmbeddingBag(SPECS, feature_table_map=FMAP, impl="xla", initializer="approx-uniform")
        got = jax.jit(layer.init)(jax.random.key(0), idx, off)["params"]["embedding"]
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
    close(got, want, framework, rtol=0, atol=0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("which", ["indices", "offsets"])
def test_float_ids_raise(framework, which):
    mod = module("tt_jax", framework)
    idx = jnp.array([1, 2, 3, 4], jnp.int32)
    off = jnp.array([0, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 4], jnp.int32)
    if which == "indices":
        idx = idx.astype(jnp.float32)
    else:
        off = off.astype(jnp.float32)
    with pytest.raises(TypeError, match=f"{which} must hold integers.*float32"):
        layer_call(framework, mod.TTEmbeddingBag, SPECS, idx, off, feature_table_map=FMAP, impl="xla")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_options_raise(framework):
    mod = module("tt_jax", framework)
    build = lambda *args, **kw: layer_build(framework, mod.TTEmbeddingBag, SPECS, *args, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="pooling"):
        build(pooling="max")
    with pytest.raises(TypeError, match="tt_jax.RowwiseAdagrad"):
        build(optimizer=optax.adam(0.1))
    with pytest.raises(TypeError):
        build(FMAP)  # options are keyword-only
    layer_build(framework, mod.TTEmbeddingBag, SPECS, optimizer=tbe_jax.RowwiseAdagrad(0.1))  # one family


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_core_option_is_forwarded(framework):
    mod = module("tt_jax", framework)
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
    # The module docstrings train both ways (optax; the sparse train_step) and check the loss halves.
    mod = module("tt_jax", framework)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
