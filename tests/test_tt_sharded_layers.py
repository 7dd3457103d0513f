"""The Flax (Linen, NNX) and Haiku TT layers built with a mesh, against the unsharded TT layers.

A TT layer built with `mesh=...` wraps `tt_jax.shard(core, mesh, axis_name, sharding_plan)` (data
parallel, cores replicated): it takes each device's local batch (`indices [n, N]`, `offsets
[n, F*b+1]`) and returns the global batch's `[n*b, sum D]`. Per framework: the sharded layer draws
the unsharded layer's cores (replicated on the mesh); a model (the layer and a dense head) gives the
unsharded model's predictions on the global batch, and two jitted steps of the framework's
`train_step` (sparse mode; the head trained by SGD, data parallel) give its losses, dense gradients,
cores and optimizer state. True-gradient mode (`optimizer=None`, Linen): two optax SGD steps on
`jax.grad` through the sharded layer equal the unsharded layer's on the global batch. Strategies other
than "data" and a plan without a mesh are refused when the layer is built.

CPU: 4 fake devices (tests/conftest.py); the XLA path; small shapes (every program is a compile).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tbe_jax
import tt_jax
from tbe_jax import testing
from conftest import layer_build

N_DEV = min(4, len(jax.devices()))
pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

# One stacked table group (same q_shapes and ranks), two cores each: small programs. Table 0 is read by
# features 0 and 2 (shared core slices).
SPECS = (tt_jax.TTSpec(30, 4, p_shapes=(6, 6), q_shapes=(2, 2), ranks=(3,)),
         tt_jax.TTSpec(19, 4, p_shapes=(5, 4), q_shapes=(2, 2), ranks=(3,)))
FMAP = (0, 1, 0)
OUT_DIM = 12
B = 2                                   # samples per device
CAP = 3 * len(FMAP) * B                 # ids per device (bags of 0..3 ids)
KW = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
LR = 0.1                                # the head's SGD
FRAMEWORKS = ["linen", "nnx", "haiku"]


def module(framework):
    pytest.importorskip("haiku" if framework == "haiku" else "flax")
    return pytest.importorskip(f"tt_jax.{framework}")


def auto_mesh(n=N_DEV):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))


def local_batches(rng, n=N_DEV, b=B, cap=CAP):
    """Per device: ids [cap] (padding past offsets[-1]), offsets [F*b+1], weights [cap]; labels [n*b]."""
    nf = len(FMAP)
    idx = np.zeros((n, cap), np.int32)
    off = np.zeros((n, nf * b + 1), np.int32)
    for k in range(n):
        off[k, 1:] = np.cumsum(rng.integers(0, 4, size=nf * b))
        for f in range(nf):
            a, z = off[k, f * b], off[k, (f + 1) * b]
            idx[k, a:z] = rng.integers(0, SPECS[FMAP[f]].num_embeddings, size=z - a)
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    y = rng.standard_normal(n * b).astype(np.float32)
    return idx, off, w, y


def global_batch(idx, off, w, y):
    """The same samples as one batch in the unsharded format (device k's sample i is sample k*b + i), padded to a
    fixed size (the steps compile once)."""
    gi, go, gw, _ = testing.stack_batches(idx, off, w, num_features=len(FMAP), pad_to=idx.size + 1)
    return gi, go, gw, y


def close(a, b, rtol=1e-5, atol=1e-6, msg=""):
    assert jax.tree.structure(a) == jax.tree.structure(b), msg
    for x, z in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=rtol, atol=atol, err_msg=msg)


# -- one model per framework: pred = head(embed(idx, off, psw)), trained by the framework's train_step -----


def linen_model(opt, **shard_kw):
    import flax.linen as nn

    mod = module("linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, idx, off, psw):
            pooled = mod.TTEmbeddingBag(SPECS, optimizer=opt, name="embed", **KW, **shard_kw)(idx, off, psw)
            return nn.Dense(1, name="head")(pooled)[:, 0]

    model = Model()
    box = {}

    def init(batch):
        box["v"] = model.init(jax.random.key(0), *batch[:3])
        return box["v"]["tbe_fused"]["embed"]["embedding"], box["v"]["params"]["head"]

    def load(cores, state, head):
        box["v"] = {"params": {"head": head}, "tbe_fused": {"embed": {"embedding": cores, "opt_state": state}}}

    def loss_fn(v, idx, off, psw, y):
        return jnp.mean((model.apply(v, idx, off, psw) - y) ** 2)

    @jax.jit
    def jstep(v, batch):
        loss, grads, v = mod.train_step(loss_fn, v, *batch)
        v = {**v, "params": jax.tree.map(lambda p, g: p - LR * g, v["params"], grads)}
        return loss, grads["head"], v

    def step(batch):
        loss, grads, box["v"] = jstep(box["v"], batch)
        return loss, grads

    def read():
        e = box["v"]["tbe_fused"]["embed"]
        return e["embedding"], e["opt_state"], box["v"]["params"]["head"]

    return init, load, lambda batch: model.apply(box["v"], *batch[:3]), step, read


def nnx_model(opt, **shard_kw):
    from flax import nnx

    mod = module("nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = mod.TTEmbeddingBag(SPECS, optimizer=opt, rngs=rngs, **KW, **shard_kw)
            self.head = nnx.Linear(OUT_DIM, 1, rngs=rngs)

        def __call__(self, idx, off, psw):
            return self.head(self.embed(idx, off, psw))[:, 0]

    box = {}

    def init(batch):
        box["m"] = Model(nnx.Rngs(0))
        return box["m"].embed.get_params(), {"kernel": box["m"].head.kernel[...], "bias": box["m"].head.bias[...]}

    def load(cores, state, head):
        m = box["m"]
        m.embed.set_params(cores)
        m.embed.set_opt_state(state)
        m.head.kernel[...], m.head.bias[...] = head["kernel"], head["bias"]

    def loss_fn(m, idx, off, psw, y):
        return jnp.mean((m(idx, off, psw) - y) ** 2)

    @nnx.jit
    def jstep(m, batch):
        loss, grads = mod.train_step(loss_fn, m, *batch)
        g = {"kernel": grads["head"]["kernel"][...], "bias": grads["head"]["bias"][...]}
        m.head.kernel[...] = m.head.kernel[...] - LR * g["kernel"]
        m.head.bias[...] = m.head.bias[...] - LR * g["bias"]
        return loss, g

    def read():
        m = box["m"]
        return m.embed.get_params(), m.embed.get_opt_state(), {"kernel": m.head.kernel[...],
                                                                "bias": m.head.bias[...]}

    return init, load, lambda batch: box["m"](*batch[:3]), lambda batch: jstep(box["m"], batch), read


def haiku_model(opt, **shard_kw):
    hk = pytest.importorskip("haiku")
    mod = module("haiku")

    def forward(idx, off, psw):
        pooled = mod.TTEmbeddingBag(SPECS, optimizer=opt, name="embed", **KW, **shard_kw)(idx, off, psw)
        return hk.Linear(1, name="head")(pooled)[:, 0]

    f = hk.without_apply_rng(hk.transform_with_state(forward))
    core = tt_jax.TTEmbeddingBag(SPECS, **KW)  # outside the transform: the unsharded core reads either state
    box = {}

    def init(batch):
        box["p"], box["s"] = f.init(jax.random.key(0), *batch[:3])
        return mod.fused_params(box["s"]["embed"], core), box["p"]["head"]

    def load(cores, state, head):
        box["p"], box["s"] = {"head": head}, {"embed": mod.module_state(cores, state)}

    def loss_fn(p, s, idx, off, psw, y):
        return jnp.mean((f.apply(p, s, idx, off, psw)[0] - y) ** 2)

    @jax.jit
    def jstep(p, s, batch):
        loss, grads, s = mod.train_step(loss_fn, p, s, *batch)
        return loss, grads["head"], jax.tree.map(lambda a, g: a - LR * g, p, grads), s

    def step(batch):
        loss, grads, box["p"], box["s"] = jstep(box["p"], box["s"], batch)
        return loss, grads

    def read():
        e = box["s"]["embed"]
        return mod.fused_params(e, core), mod.fused_opt_state(e, core, opt), box["p"]["head"]

    return init, load, lambda batch: f.apply(box["p"], box["s"], *batch[:3])[0], step, read


MODELS = {"linen": linen_model, "nnx": nnx_model, "haiku": haiku_model}
OPTS = {"linen": lambda: tt_jax.RowwiseAdagrad(0.3, eps=1e-3), "nnx": lambda: tt_jax.SGD(0.3),
        "haiku": lambda: tt_jax.Adagrad(0.3, eps=1e-3)}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sharded_layer_matches_unsharded(framework):
    module(framework)
    rng = np.random.default_rng({"linen": 1, "nnx": 2, "haiku": 3}[framework])
    opt = OPTS[framework]()
    mesh = auto_mesh()
    emb = tt_jax.TTEmbeddingBag(SPECS, **KW)
    batches = [local_batches(rng) for _ in range(2)]
    gbatches = [global_batch(*b) for b in batches]

    ref = MODELS[framework](opt)
    got = MODELS[framework](opt, mesh=mesh, axis_name="data", sharding_plan={0: "data"})
    cores, head = ref[0](gbatches[0])
    s_cores, _ = got[0](batches[0])  # the sharded layer's own init: the same draw, replicated on the mesh
    close(s_cores, cores, rtol=0, atol=0, msg=framework)
    for v in jax.tree.leaves(s_cores):
        assert v.sharding.is_fully_replicated and len(v.sharding.device_set) == N_DEV
    # Both models from the same sizeable cores (the default init's are tiny), fresh state and head.
    cores = emb.init(jax.random.key(7), std=0.3)
    ref[1](cores, opt.init(cores), head)
    sharded = tt_jax.shard(emb, mesh, "data")
    s_cores, s_state = sharded.from_unsharded(cores, opt.init(cores))
    # The dense head replicated on the mesh (data parallel), as the step's output has it: one compile.
    got[1](s_cores, s_state, jax.device_put(head, NamedSharding(mesh, P())))

    # Forward: the global batch's predictions.
    close(got[2](batches[0]), ref[2](gbatches[0]), msg=framework)
    # Two training steps: losses, dense gradients, cores, optimizer state, head.
    for b, gb in zip(batches, gbatches):
        loss, grads = got[3](tuple(jnp.asarray(x) for x in b))
        want_loss, want_grads = ref[3](tuple(jnp.asarray(x) for x in gb))
        close(loss, want_loss, msg=framework)
        close(grads, want_grads, msg=framework)
    c, st, h = got[4]()
    want_c, want_st, want_h = ref[4]()
    close(c, want_c, msg=framework)
    assert type(st) is type(want_st)
    close(st, want_st, msg=framework)
    assert int(st.count) == 2
    close(h, want_h, msg=framework)
    assert all(v.sharding.is_fully_replicated for v in jax.tree.leaves((c, st)))
    assert not np.allclose(np.asarray(c["cores"][0][0]), np.asarray(cores["cores"][0][0]))  # it trained


def _build(framework, **kw):
    mod = module(framework)
    return layer_build(framework, mod.TTEmbeddingBag, SPECS, **KW, **kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_plans_and_errors(framework):
    """Strategy "data" (a dict, a sequence or the default) builds the data-parallel core; any other strategy
    raises `tt_jax.sharding.plan_sharding`'s error; a plan without a mesh and lookup inputs in the unsharded
    format are refused. True-gradient mode builds (`test_linen_true_gradient_matches_unsharded`)."""
    mod = module(framework)
    mesh = auto_mesh()
    opt = tt_jax.SGD(0.1)
    if framework == "linen":  # the core on an unbound module
        for plan in (None, {1: "data"}, ["data", "data"]):
            core = mod.TTEmbeddingBag(SPECS, optimizer=opt, mesh=mesh, sharding_plan=plan, **KW).tt
            assert isinstance(core, tt_jax.ShardedTTEmbeddingBag)
            assert core.strategies == ("data", "data") and core.num_devices == N_DEV
            assert core.emb == tt_jax.TTEmbeddingBag(SPECS, **KW)
    with pytest.raises(NotImplementedError, match="strategy 'row' is not supported for TT tables"):
        _build(framework, optimizer=opt, mesh=mesh, sharding_plan={0: "row"})
    with pytest.raises(NotImplementedError, match="strategy 'table' is not supported for TT tables"):
        _build(framework, optimizer=opt, mesh=mesh, sharding_plan=["data", "table"])
    with pytest.raises(ValueError, match="strategy must be one of"):
        _build(framework, optimizer=opt, mesh=mesh, sharding_plan={1: "rows"})
    with pytest.raises(ValueError, match="not a table index"):
        _build(framework, optimizer=opt, mesh=mesh, sharding_plan={2: "data"})
    with pytest.raises(ValueError, match="give the layer a mesh"):
        _build(framework, optimizer=opt, sharding_plan={0: "data"})
    with pytest.raises(ValueError, match="is not an axis of the mesh"):
        _build(framework, optimizer=opt, mesh=mesh, axis_name="model")
    _build(framework, mesh=mesh)  # true-gradient mode on a mesh: built (no longer refused)
    if framework == "nnx":  # flat (unsharded-format) inputs: the sharded core's shape check
        from flax import nnx

        layer = mod.TTEmbeddingBag(SPECS, optimizer=opt, mesh=mesh, rngs=nnx.Rngs(0), **KW)
        with pytest.raises(ValueError, match="one row per device"):
            layer(jnp.zeros((4,), jnp.int32), jnp.zeros((7,), jnp.int32))


def test_linen_true_gradient_matches_unsharded():
    """True-gradient mode on a mesh (`optimizer=None`): `jax.value_and_grad` through the sharded layer w.r.t.
    the replicated cores and the head, and two jitted optax SGD steps on it, equal the unsharded layer's on
    the global batch (the cores' gradient is the devices' shares summed over the axis)."""
    import flax.linen as nn

    optax = pytest.importorskip("optax")
    mod = module("linen")
    rng = np.random.default_rng(4)
    mesh = auto_mesh()

    def make(**shard_kw):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, idx, off, psw):
                pooled = mod.TTEmbeddingBag(SPECS, name="embed", **KW, **shard_kw)(idx, off, psw)
                return nn.Dense(1, name="head")(pooled)[:, 0]

        return Model()

    ref, got = make(), make(mesh=mesh, axis_name="data")
    batches = [local_batches(rng) for _ in range(2)]
    gbatches = [global_batch(*b) for b in batches]
    params = ref.init(jax.random.key(0), *gbatches[0][:3])["params"]
    s_params = got.init(jax.random.key(0), *batches[0][:3])["params"]
    close(s_params["embed"], params["embed"], rtol=0, atol=0)  # the same draw, replicated on the mesh
    assert all(v.sharding.is_fully_replicated and len(v.sharding.device_set) == N_DEV
               for v in jax.tree.leaves(s_params["embed"]))
    # Both from the same sizeable cores (the default init's are tiny); the sharded copy replicated on the mesh.
    emb = tt_jax.TTEmbeddingBag(SPECS, **KW)
    params = {**params, "embed": {"embedding": emb.init(jax.random.key(7), std=0.3)}}
    s_params = jax.device_put(params, NamedSharding(mesh, P()))
    tx = optax.sgd(0.3)

    def stepper(model):
        @jax.jit
        def step(params, opt_state, batch):
            def loss_fn(p):
                idx, off, psw, y = batch
                return jnp.mean((model.apply({"params": p}, idx, off, psw) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads

        return step

    step_ref, step_got = stepper(ref), stepper(got)
    state, s_state = tx.init(params), tx.init(s_params)
    for b, gb in zip(batches, gbatches):
        s_params, s_state, loss, grads = step_got(s_params, s_state, tuple(jnp.asarray(x) for x in b))
        params, state, want_loss, want_grads = step_ref(params, state, tuple(jnp.asarray(x) for x in gb))
        close(loss, want_loss, msg="loss")
        close(grads, want_grads, msg="grads")
        close(s_params, params, msg="params")
    assert all(v.sharding.is_fully_replicated for v in jax.tree.leaves(s_params["embed"]))
    assert not np.allclose(np.asarray(s_params["embed"]["embedding"]["cores"][0][0]),
                           np.asarray(emb.init(jax.random.key(7), std=0.3)["cores"][0][0]))  # it trained
