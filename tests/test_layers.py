"""The Flax (Linen, NNX) and Haiku TBE layers against the functional core and `tbe_jax.train_step`.

True-gradient mode: outputs and gradients equal the core's. Sparse mode: each framework's
`train_step` equals the functional `tbe_jax.train_step` on the same inputs (tables, optimizer
state, loss, dense gradients), under `jit`, with a learning-rate schedule that compiles once;
a disconnected output leaves the tables unchanged; a second call of a sparse layer raises.
The XLA path mostly; one short step per framework on the kernels (interpret mode on CPU,
compiled on GPU: conftest.KERNEL_KW).

The model harness (`sparse_runner`) is generic over the layer and shared with
test_tt_layers.py.
"""

import dataclasses
import doctest
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tbe_jax
from tbe_jax import testing
from conftest import KERNEL_KW, layer_build, layer_call, specs

FRAMEWORKS = ["linen", "nnx", "haiku"]
TABLES = specs([20, 12, 9], [8, 4, 8])  # buffers d8 (tables 0 and 2) and d4
FMAP = (0, 1, 2, 1)                     # table 1 shared by two features
ROWS = (20, 12, 9, 12)
BATCH = 3
OUT_DIM = 24                            # 8 + 4 + 8 + 4


def module(package, framework):
    """The layer module, or a clean skip when its framework is not installed."""
    pytest.importorskip("haiku" if framework == "haiku" else "flax")
    return pytest.importorskip(f"{package}.{framework}")


def make_batch(rng, rows, weighted, batch=BATCH):
    idx, off, psw = testing.make_batch(rng, list(rows), [batch] * len(rows), (0, 5), weighted=weighted)
    y = rng.standard_normal(batch).astype(np.float32)
    return jnp.asarray(idx), jnp.asarray(off), (None if psw is None else jnp.asarray(psw)), jnp.asarray(y)


def make_head(rng, dim):
    return {"kernel": jnp.asarray(rng.standard_normal((dim, 1)).astype(np.float32) / np.sqrt(dim)),
            "bias": jnp.asarray(rng.standard_normal(1).astype(np.float32))}


def close(got, want, err_msg="", rtol=1e-6, atol=1e-7):
    assert jax.tree.structure(got) == jax.tree.structure(want), err_msg
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=err_msg)


def head_loss(head, pooled, y):
    return jnp.mean(((pooled @ head["kernel"] + head["bias"])[:, 0] - y) ** 2)


def functional_steps(core, opt, tables, state, head, batch, steps):
    """The reference: `steps` jitted `tbe_jax.train_step`s (the head fixed): (losses, grads, tables, state)."""
    idx, off, psw, y = batch
    step = jax.jit(lambda t, s: tbe_jax.train_step(lambda h, pooled: head_loss(h, pooled, y), head,
                                                   tbe_jax.SparseLookup(core, opt, t, s, idx, off, psw)))
    losses = []
    for _ in range(steps):
        res = step(tables, state)
        tables, state = res.params, res.opt_state
        losses.append(res.loss)
    return losses, res.grads, tables, state


# -- the model harness: a sparse layer and a linear head, one framework each -----------------------


def sparse_runner(framework, package, make_layer, dim, tables, state, head, *, mode="use"):
    """A model `pred = head(layer(idx, off, psw))` holding `tables`/`state`/`head`, trained by the
    framework's `train_step` in a jitted step (the head is not updated).

    `make_layer(**framework_kw)` builds the sparse layer. `mode`: "use" (the output feeds the
    head), "ignore" (computed, not used), "twice" (the layer called twice).
    Returns `(step, read, traces)`: `step(batch) -> (loss, head_grads)`; `read() -> (tables,
    opt_state)`; `traces[0]` counts the step's traces (compilations).
    """
    mod = module(package, framework)
    traces = [0]

    def combine(layer, idx, off, psw):
        pooled = layer(idx, off, psw)
        if mode == "twice":
            pooled = pooled + layer(idx, off, psw)
        return jnp.ones(pooled.shape) if mode == "ignore" else pooled

    if framework == "linen":
        import flax.linen as nn

        class Model(nn.Module):
            @nn.compact
            def __call__(self, idx, off, psw):
                return nn.Dense(1, name="head")(combine(make_layer(name="embed"), idx, off, psw))[:, 0]

        model = Model()
        box = {"v": {"params": {"head": dict(head)}, mod.FUSED_COLLECTION: {"embed": {"embedding": tables,
                                                                                       "opt_state": state}}}}

        def loss_fn(v, idx, off, psw, y):
            return jnp.mean((model.apply(v, idx, off, psw) - y) ** 2)

        @jax.jit
        def jstep(v, batch):
            traces[0] += 1
            return mod.train_step(loss_fn, v, *batch)

        def step(batch):
            loss, grads, box["v"] = jstep(box["v"], batch)
            return loss, grads["head"]

        def read():
            entry = box["v"][mod.FUSED_COLLECTION]["embed"]
            return entry["embedding"], entry["opt_state"]

        return step, read, traces

    if framework == "nnx":
        from flax import nnx

        class Model(nnx.Module):
            def __init__(self):
                self.embed = make_layer(rngs=nnx.Rngs(0))
                self.head = nnx.Linear(dim, 1, rngs=nnx.Rngs(1))

            def __call__(self, idx, off, psw):
                return self.head(combine(self.embed, idx, off, psw))[:, 0]

        model = Model()
        model.embed.set_params(tables)
        model.embed.set_opt_state(state)
        model.head.kernel[...] = head["kernel"]
        model.head.bias[...] = head["bias"]

        def loss_fn(m, idx, off, psw, y):
            return jnp.mean((m(idx, off, psw) - y) ** 2)

        @nnx.jit
        def jstep(m, batch):
            traces[0] += 1
            return mod.train_step(loss_fn, m, *batch)

        def step(batch):
            loss, grads = jstep(model, batch)
            return loss, {"kernel": grads["head"]["kernel"][...], "bias": grads["head"]["bias"][...]}

        return step, lambda: (model.embed.get_params(), model.embed.get_opt_state()), traces

    import haiku as hk

    def forward(idx, off, psw):
        return hk.Linear(1, name="head")(combine(make_layer(name="embed"), idx, off, psw))[:, 0]

    f = hk.without_apply_rng(hk.transform_with_state(forward))
    box = {"p": {"head": {"w": head["kernel"], "b": head["bias"]}}, "s": {"embed": mod.module_state(tables, state)}}

    def loss_fn(p, s, idx, off, psw, y):
        return jnp.mean((f.apply(p, s, idx, off, psw)[0] - y) ** 2)

    @jax.jit
    def jstep(p, s, batch):
        traces[0] += 1
        return mod.train_step(loss_fn, p, s, *batch)

    def step(batch):
        loss, grads, box["s"] = jstep(box["p"], box["s"], batch)
        return loss, {"kernel": grads["head"]["w"], "bias": grads["head"]["b"]}

    # The layer's core and optimizer (a module is built inside a transform), to read its state back.
    core, opt = hk.transform(lambda: (lambda m: (m._core, m.optimizer))(make_layer(name="embed"))).apply({}, None)

    def read():
        entry = box["s"]["embed"]
        return mod.fused_params(entry, core), mod.fused_opt_state(entry, core, opt)

    return step, read, traces


def tbe_layer(framework, opt, **kw):
    mod = module("tbe_jax", framework)
    return lambda **fkw: mod.TableBatchedEmbed(TABLES, optimizer=opt, **kw, **fkw)


# -- true-gradient mode ------------------------------------------------------------------------------


def _with_out(f, cot):
    """f(*args) -> out  becomes  g(*args) -> (sum(out * cot), out), for value_and_grad(has_aux=True)."""
    def g(*args):
        out = f(*args)
        return jnp.sum(out * cot), out
    return g


def test_true_gradient_matches_core(rng):
    # Every framework's output and gradients (tables, per-sample weights) equal the core's.
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    emb = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    params = emb.init(jax.random.key(int(rng.integers(1 << 30))))
    idx, off, psw, _ = make_batch(rng, ROWS, weighted=True)
    cot = jnp.asarray(rng.standard_normal((BATCH, OUT_DIM)).astype(np.float32))

    def grads(apply):
        return jax.jit(jax.value_and_grad(_with_out(apply, cot), (0, 1), has_aux=True))(params, psw)

    (_, want_out), want = grads(lambda p, w: emb(p, idx, off, w))
    for framework in FRAMEWORKS:
        mod = module("tbe_jax", framework)
        if framework == "nnx":
            from flax import nnx

            layer = mod.TableBatchedEmbed(TABLES, rngs=nnx.Rngs(0), **kw)
            layer.set_params(params)
            step = nnx.jit(nnx.value_and_grad(_with_out(lambda m, w: m(idx, off, w), cot), argnums=(0, 1),
                                              has_aux=True))
            (_, out), (g_layer, g_psw) = step(layer, psw)
            got = ({k: v[...] for k, v in g_layer["embedding"].items()}, g_psw)
        elif framework == "linen":
            layer = mod.TableBatchedEmbed(TABLES, **kw)
            (_, out), got = grads(lambda p, w: layer.apply({"params": {"embedding": p}}, idx, off, w))
        else:
            import haiku as hk

            model = hk.without_apply_rng(hk.transform(lambda w: mod.TableBatchedEmbed(TABLES, **kw)(idx, off, w)))
            (_, out), got = grads(lambda p, w: model.apply({"table_batched_embed": p}, w))
        close(out, want_out, framework)
        close(got, want, framework)


# -- sparse mode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("framework,opt_name", [
    ("linen", "rowwise_adagrad"), ("nnx", "rowwise_adagrad"), ("haiku", "rowwise_adagrad"), ("linen", "sgd"),
])
def test_sparse_step_matches_functional(rng, framework, opt_name):
    # Three jitted steps with a learning-rate schedule: one compilation; tables, optimizer state,
    # loss and dense gradient equal tbe_jax.train_step's.
    kw = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
    core = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    schedule = optax.linear_schedule(0.1, 0.4, 3)
    opt = tbe_jax.RowwiseAdagrad(schedule, eps=1e-3) if opt_name == "rowwise_adagrad" else tbe_jax.SGD(schedule)
    tables = core.init(jax.random.key(1))
    state = opt.init(tables)
    head = make_head(rng, OUT_DIM)
    batch = make_batch(rng, ROWS, weighted=True)
    step, read, traces = sparse_runner(framework, "tbe_jax", tbe_layer(framework, opt, **kw), OUT_DIM,
                                       tables, state, head)
    losses = [step(batch) for _ in range(3)]
    assert traces[0] == 1  # a schedule reads the state's count: no recompilation
    want_losses, want_grads, want_t, want_s = functional_steps(core, opt, tables, state, head, batch, 3)
    got_t, got_s = read()
    close(got_t, want_t, framework)
    close(got_s, want_s, framework)
    assert int(got_s.count) == 3
    close([l for l, _ in losses], want_losses, framework)
    close(losses[-1][1], want_grads, framework)
    assert not np.array_equal(np.asarray(got_t["d8"]), np.asarray(tables["d8"]))  # it trained


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_step_optimizer_is_a_value_and_reports(rng, framework):
    """`train_step(..., optimizer=opt)` with `opt` a jitted argument: four Python-float learning rates, one
    compilation, each step equal to the functional `tbe_jax.train_step` at that rate; `with_report=True` gives
    each layer's StepReport (here: NaN labels make every output gradient non-finite on the last step)."""
    mod = module("tbe_jax", framework)
    kw = dict(feature_table_map=FMAP, impl="xla")
    core = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    tables = core.init(jax.random.key(4))
    state = tbe_jax.RowwiseAdagrad(0.1).init(tables)
    idx, off, _, y = make_batch(rng, ROWS, False)
    traces = [0]
    if framework == "linen":
        layer = mod.TableBatchedEmbed(TABLES, optimizer=tbe_jax.RowwiseAdagrad(0.1), **kw)
        v = {mod.FUSED_COLLECTION: {"embedding": tables, "opt_state": state}}

        @jax.jit
        def step(v, opt, y):
            traces[0] += 1
            res, rep = mod.train_step(lambda v: jnp.mean((layer.apply(v, idx, off).sum(1) - y) ** 2), v,
                                      optimizer=opt, with_report=True)
            return res.variables, rep

        def run(opt, y):
            nonlocal v
            v, rep = step(v, opt, y)
            return v[mod.FUSED_COLLECTION]["embedding"], rep
    elif framework == "nnx":
        from flax import nnx

        layer = mod.TableBatchedEmbed(TABLES, optimizer=tbe_jax.RowwiseAdagrad(0.1), rngs=nnx.Rngs(0), **kw)
        layer.set_params(tables)
        layer.set_opt_state(state)

        @nnx.jit
        def step(m, opt, y):
            traces[0] += 1
            _, _, rep = mod.train_step(lambda m: jnp.mean((m(idx, off).sum(1) - y) ** 2), m, optimizer=opt,
                                       with_report=True)
            return rep

        def run(opt, y):
            rep = step(layer, opt, y)
            return layer.get_params(), rep
    else:
        import haiku as hk

        f = hk.without_apply_rng(hk.transform_with_state(
            lambda: mod.TableBatchedEmbed(TABLES, optimizer=tbe_jax.RowwiseAdagrad(0.1), name="embed", **kw)(
                idx, off)))
        box = {"s": {"embed": mod.module_state(tables, state)}}

        @jax.jit
        def step(s, opt, y):
            traces[0] += 1
            res, rep = mod.train_step(lambda p, s: jnp.mean((f.apply(p, s)[0].sum(1) - y) ** 2), {}, s,
                                      optimizer=opt, with_report=True)
            return res.state, rep

        def run(opt, y):
            box["s"], rep = step(box["s"], opt, y)
            return mod.fused_params(box["s"]["embed"], core), rep
    want_t, want_s = tables, state
    for lr in (0.3, 0.05, 0.7, 0.2):
        opt = tbe_jax.RowwiseAdagrad(lr)
        got, rep = run(opt, y)
        res = tbe_jax.train_step(lambda d, pooled: jnp.mean((pooled.sum(1) - y) ** 2), {},
                                 tbe_jax.SparseLookup(core, opt, want_t, want_s, idx, off))
        want_t, want_s = res.params, res.opt_state
        # The same XLA ops fused in two programs: on the GPU an entry may differ by an ulp (1.2e-7 seen at 0.0138).
        close(got, want_t, framework, rtol=1e-5, atol=1e-6)
    assert traces[0] == 1
    (name, report), = rep.items()
    assert name == ("embed" if framework == "haiku" else "")  # the model's root layer: the empty path
    assert int(report.nonfinite_grads) == 0
    _, rep = run(tbe_jax.RowwiseAdagrad(0.1), jnp.full_like(y, jnp.nan))
    assert int(rep[name].nonfinite_grads) == BATCH * OUT_DIM
    with pytest.raises(TypeError, match="must be a RowwiseAdagrad"):
        run(tbe_jax.SGD(0.1), y)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sparse_step_on_kernels(rng, framework):
    # One step through the forward and sorted-run backward kernels equals the XLA reference's
    # (one table: interpret mode compiles slowly).
    opt = tbe_jax.RowwiseAdagrad(0.2, eps=1e-3)
    core = tbe_jax.TableBatchedEmbedding(TABLES[:1], impl="xla")
    tables = core.init(jax.random.key(2))
    state = opt.init(tables)
    head = make_head(rng, 8)
    batch = make_batch(rng, ROWS[:1], weighted=False)
    mod = module("tbe_jax", framework)
    make_layer = lambda **fkw: mod.TableBatchedEmbed(TABLES[:1], optimizer=opt, **KERNEL_KW, **fkw)  # noqa: E731
    step, read, _ = sparse_runner(framework, "tbe_jax", make_layer, 8, tables, state, head)
    loss, _ = step(batch)
    want_losses, _, want_t, want_s = functional_steps(core, opt, tables, state, head, batch, 1)
    got_t, got_s = read()
    close(got_t, want_t, framework, rtol=1e-5, atol=1e-6)
    close(got_s, want_s, framework, rtol=1e-5, atol=1e-6)
    close(loss, want_losses[0], framework, rtol=1e-5)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_disconnected_output_leaves_tables_unchanged(rng, framework):
    opt = tbe_jax.RowwiseAdagrad(0.5)
    core = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    tables = core.init(jax.random.key(3))
    state = opt.init(tables)
    step, read, _ = sparse_runner(framework, "tbe_jax", tbe_layer(framework, opt, feature_table_map=FMAP,
                                                                  impl="xla"),
                                  OUT_DIM, tables, state, make_head(rng, OUT_DIM), mode="ignore")
    _, grads = step(make_batch(rng, ROWS, weighted=False))
    assert np.any(np.asarray(grads["kernel"]) != 0)  # the dense part trained
    got_t, got_s = read()
    for k in tables:
        np.testing.assert_array_equal(np.asarray(got_t[k]), np.asarray(tables[k]))
        np.testing.assert_array_equal(np.asarray(got_s.momentum[k]), np.asarray(state.momentum[k]))
    assert int(got_s.count) == 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_second_call_raises(rng, framework):
    opt = tbe_jax.SGD(0.1)
    core = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    tables = core.init(jax.random.key(0))
    step, _, _ = sparse_runner(framework, "tbe_jax", tbe_layer(framework, opt, feature_table_map=FMAP, impl="xla"),
                               OUT_DIM, tables, opt.init(tables), make_head(rng, OUT_DIM), mode="twice")
    with pytest.raises(ValueError, match="called twice in one training step"):
        step(make_batch(rng, ROWS, weighted=False))


def test_has_aux_and_nested_transform():
    # has_aux returns (loss, aux) as jax.value_and_grad does; a sparse layer called inside a
    # transformation nested in the loss (here a jit) raises instead of leaking its tracers.
    mod = module("tbe_jax", "linen")
    opt = tbe_jax.SGD(0.5)
    layer = mod.TableBatchedEmbed(TABLES[:1], optimizer=opt, impl="xla")
    tables = layer.tbe.init(jax.random.key(0))
    v = {mod.FUSED_COLLECTION: {"embedding": tables, "opt_state": opt.init(tables)}}
    idx, off = jnp.array([1, 2, 2], jnp.int32), jnp.array([0, 2, 3], jnp.int32)

    def loss_fn(v):
        out = layer.apply(v, idx, off)
        return jnp.sum(out), out

    (loss, out), grads, new_v = jax.jit(lambda v: mod.train_step(loss_fn, v, has_aux=True))(v)
    assert grads == {} and out.shape == (2, 8)
    close(loss, jnp.sum(out))
    want, _ = layer.tbe.apply_gradients(tables, opt.init(tables), opt, idx, off, jnp.ones((2, 8)))
    close(new_v[mod.FUSED_COLLECTION]["embedding"], want)
    with pytest.raises(ValueError, match="inside a transformation"):
        mod.train_step(lambda v: jnp.sum(jax.jit(layer.apply)(v, idx, off)), v)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_differentiating_sparse_tables_raises(framework):
    # The old fused-gradient recipe (grad with respect to the tables) fails loudly, not silently.
    mod = module("tbe_jax", framework)
    opt = tbe_jax.RowwiseAdagrad(0.1)
    idx = jnp.array([0, 1, 2, 3], jnp.int32)
    off = jnp.array([0, 1, 2, 3, 4], jnp.int32)
    core = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla", feature_table_map=FMAP)
    tables = core.init(jax.random.key(0))
    with pytest.raises(TypeError, match="train_step"):
        if framework == "linen":
            layer = mod.TableBatchedEmbed(TABLES, optimizer=opt, impl="xla", feature_table_map=FMAP)
            state = opt.init(tables)
            jax.grad(lambda t: jnp.sum(layer.apply({mod.FUSED_COLLECTION: {"embedding": t, "opt_state": state}},
                                                   idx, off)))(tables)
        elif framework == "nnx":
            from flax import nnx

            layer = mod.TableBatchedEmbed(TABLES, optimizer=opt, impl="xla", feature_table_map=FMAP,
                                          rngs=nnx.Rngs(0))
            tables = nnx.All(mod.Fused, nnx.PathContains("embedding"))
            nnx.grad(lambda m: jnp.sum(m(idx, off)), argnums=nnx.DiffState(0, tables))(layer)
        else:
            import haiku as hk

            f = hk.without_apply_rng(hk.transform_with_state(
                lambda: mod.TableBatchedEmbed(TABLES, optimizer=opt, impl="xla", feature_table_map=FMAP)(idx, off)))
            state = mod.module_state({}, opt.init(tables))
            jax.grad(lambda t: jnp.sum(f.apply({}, {"table_batched_embed": {**state, **mod.module_state(t, {})}})[0]))(
                tables)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("package", ["tbe_jax", "tt_jax"])
def test_plain_grad_of_a_sparse_model_raises(framework, package):
    """A model with a sparse-mode layer differentiated with the framework's plain gradient (only its dense
    parameters: the tables would silently not train) raises at trace time, naming the step helper."""
    mod = module(package, framework)
    rng = np.random.default_rng(0)
    opt = tbe_jax.RowwiseAdagrad(0.1)
    if package == "tbe_jax":
        make = lambda **kw: mod.TableBatchedEmbed(TABLES, optimizer=opt, impl="xla", feature_table_map=FMAP, **kw)
        rows, dim = ROWS, OUT_DIM
    else:
        import tt_jax
        spec = tt_jax.TTSpec(60, 8, ranks=(3, 4))
        make = lambda **kw: mod.TTEmbeddingBag([spec], optimizer=opt, impl="xla", **kw)
        rows, dim = (60,), 8
    idx, off, _, y = make_batch(rng, rows, False)
    head = make_head(rng, dim)
    helper = f"tbe_jax.{framework}.train_step"
    with pytest.raises(TypeError, match=rf"outside its framework's training step.*{re.escape(helper)}"):
        if framework == "linen":
            layer = make()
            v = layer.init(jax.random.key(0), idx, off)
            jax.jit(jax.grad(lambda h: head_loss(h, layer.apply(v, idx, off), y)))(head)
        elif framework == "nnx":
            from flax import nnx

            class Model(nnx.Module):
                def __init__(self):
                    self.embed = make(rngs=nnx.Rngs(0))
                    self.head = nnx.Linear(dim, 1, rngs=nnx.Rngs(1))

                def __call__(self, idx, off):
                    return self.head(self.embed(idx, off))[:, 0]

            nnx.jit(nnx.value_and_grad(lambda m: jnp.mean((m(idx, off) - y) ** 2)))(Model())
        else:
            import haiku as hk

            f = hk.without_apply_rng(hk.transform_with_state(lambda: make()(idx, off)))
            p, s = f.init(jax.random.key(0))
            jax.grad(lambda h: head_loss(h, f.apply(p, s)[0], y))(head)


def test_per_sample_weights_from_dense_params(rng):
    # Weights computed by the model from a dense parameter: its gradient flows through the lookup,
    # and the sparse update (which reads the weights after the gradient) runs under jit.
    mod = module("tbe_jax", "linen")
    import flax.linen as nn

    kw = dict(feature_table_map=FMAP, impl="xla")
    opt = tbe_jax.RowwiseAdagrad(0.3)
    core = tbe_jax.TableBatchedEmbedding(TABLES, **kw)
    idx, off, psw, y = make_batch(rng, ROWS, weighted=True)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, idx, off, psw):
            scale = self.param("scale", nn.initializers.ones, ())
            return jnp.sum(mod.TableBatchedEmbed(TABLES, optimizer=opt, name="embed", **kw)(idx, off, psw * scale),
                           axis=1)

    model = Model()
    v = model.init(jax.random.key(0), idx, off, psw)
    v = {"params": {"scale": jnp.float32(1.5)}, **{k: x for k, x in v.items() if k != "params"}}
    loss_fn = lambda v: jnp.mean((model.apply(v, idx, off, psw) - y) ** 2)  # noqa: E731
    (loss, grads, new_v) = jax.jit(lambda v: mod.train_step(loss_fn, v))(v)
    tables = v[mod.FUSED_COLLECTION]["embed"]["embedding"]
    state = v[mod.FUSED_COLLECTION]["embed"]["opt_state"]
    # The tables' update: the functional step with the weights the model computed; the dense
    # gradient: the true gradient through the lookup (the tables fixed).
    want = jax.jit(lambda: tbe_jax.train_step(
        lambda _, pooled: jnp.mean((jnp.sum(pooled, axis=1) - y) ** 2), None,
        tbe_jax.SparseLookup(core, opt, tables, state, idx, off, psw * 1.5)))()
    want_g = jax.jit(jax.grad(lambda s: jnp.mean((jnp.sum(core(tables, idx, off, psw * s), axis=1) - y) ** 2)))(
        jnp.float32(1.5))
    close(loss, want.loss)
    close(grads["scale"], want_g, rtol=1e-5)
    assert float(jnp.abs(grads["scale"])) > 0
    close(new_v[mod.FUSED_COLLECTION]["embed"]["embedding"], want.params)
    close(new_v[mod.FUSED_COLLECTION]["embed"]["opt_state"], want.opt_state)


# -- construction, validation, docs ------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_init_is_the_cores(framework):
    mod = module("tbe_jax", framework)
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    idx = jnp.array([0, 1, 2, 3], jnp.int32)
    off = jnp.array([0, 1, 2, 3, 4], jnp.int32)
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
        assert layer.tbe == emb
    else:
        import haiku as hk

        f = hk.transform(lambda: mod.TableBatchedEmbed(TABLES, feature_table_map=FMAP, impl="xla")(idx, off))
        got = f.init(jax.random.key(5))["table_batched_embed"]
        first_key = hk.transform(lambda: hk.next_rng_key()).apply({}, jax.random.key(5))
        want = emb.init(first_key)
    close(got, want, framework, rtol=0, atol=0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sparse_state_layout(framework):
    # Sparse mode: the tables and the optimizer state where the module docstrings say.
    mod = module("tbe_jax", framework)
    opt = tbe_jax.RowwiseAdagrad(0.1)
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, impl="xla")
    idx, off = jnp.zeros((0,), jnp.int32), jnp.zeros((BATCH * len(FMAP) + 1,), jnp.int32)
    kw = dict(feature_table_map=FMAP, impl="xla", optimizer=opt)
    if framework == "linen":
        v = mod.TableBatchedEmbed(TABLES, **kw).init(jax.random.key(0), idx, off)
        assert "params" not in v
        tables, state = v[mod.FUSED_COLLECTION]["embedding"], v[mod.FUSED_COLLECTION]["opt_state"]
    elif framework == "nnx":
        from flax import nnx

        layer = mod.TableBatchedEmbed(TABLES, rngs=nnx.Rngs(0), **kw)
        assert all(isinstance(v, mod.Fused) for v in layer.embedding.values())
        assert sorted(layer.opt_state.keys()) == ["count", "momentum_d4", "momentum_d8"]
        assert not jax.tree.leaves(nnx.state(layer, nnx.Param))
        tables, state = layer.get_params(), layer.get_opt_state()
    else:
        import haiku as hk

        params, s = hk.transform_with_state(lambda: mod.TableBatchedEmbed(TABLES, **kw)(idx, off)).init(
            jax.random.key(0))
        assert params == {}
        assert sorted(s["table_batched_embed"]) == ["fused_count", "fused_d4", "fused_d8", "fused_momentum_d4",
                                                    "fused_momentum_d8"]
        tables = mod.fused_params(s["table_batched_embed"], emb)
        state = mod.fused_opt_state(s["table_batched_embed"], emb, opt)
    assert jax.tree.map(jnp.shape, tables) == jax.tree.map(jnp.shape, emb.init(jax.random.key(0)))
    assert isinstance(state, tbe_jax.RowwiseAdagradState) and int(state.count) == 0


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("which", ["indices", "offsets"])
def test_float_ids_raise(framework, which):
    mod = module("tbe_jax", framework)
    idx = jnp.array([1, 2, 3, 4], jnp.int32)
    off = jnp.array([0, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 4], jnp.int32)
    if which == "indices":
        idx = idx.astype(jnp.float32)
    else:
        off = off.astype(jnp.float32)
    with pytest.raises(TypeError, match=f"{which} must hold integers.*float32"):
        layer_call(framework, mod.TableBatchedEmbed, TABLES, idx, off, feature_table_map=FMAP, impl="xla")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_options_raise(framework):
    mod = module("tbe_jax", framework)
    build = lambda *args, **kw: layer_build(framework, mod.TableBatchedEmbed, TABLES, *args, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="pooling"):
        build(pooling="max")
    with pytest.raises(TypeError, match="tbe_jax.RowwiseAdagrad"):
        build(optimizer=optax.adam(0.1))
    with pytest.raises(TypeError, match="tbe_jax.Adam"):
        build(optimizer=tbe_jax.SGD)  # a class, not an optimizer
    with pytest.raises(TypeError):
        build(FMAP)  # options are keyword-only


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_core_option_is_forwarded(framework):
    mod = module("tbe_jax", framework)
    core = inspect.signature(tbe_jax.TableBatchedEmbedding.__init__).parameters
    want = {n for n, p in core.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    if framework == "linen":
        fields = {f.name: f for f in dataclasses.fields(mod.TableBatchedEmbed)}
        have = set(fields)
        assert fields["bounds_check"].default is None  # the core's default ("ignore")
    else:
        params = inspect.signature(mod.TableBatchedEmbed.__init__).parameters
        have = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert params["bounds_check"].default is None
    assert want <= have, f"not forwarded: {sorted(want - have)}"


def test_removed_names_are_gone():
    # 0.2.0 (CHANGELOG.md): the explaining stubs of the removed fused-gradient path are gone too.
    for framework, name in (("nnx", "apply_fused"), ("nnx", "DIFF_FILTER"), ("haiku", "drop_fused")):
        with pytest.raises(AttributeError):
            getattr(module("tbe_jax", framework), name)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_docstring_examples(framework):
    # The module docstrings train both ways (optax; the sparse train_step) and check the loss halves.
    mod = module("tbe_jax", framework)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
