"""The Flax (Linen, NNX) and Haiku TBE layers built with a mesh, against the unsharded layers.

A layer built with `mesh=...` wraps `tbe_jax.shard(core, mesh, axis_name, sharding_plan)`: it
takes each device's local batch (`indices [n, N]`, `offsets [n, F*b+1]`) and returns the global
batch's `[n*b, sum D]`. Per framework: a model (the layer and a dense head) with a mixed plan
(row-, table-, column-wise and replicated tables) gives the unsharded model's predictions on the
global batch, and two jitted steps of the framework's `train_step` (sparse mode; the head
trained by SGD, data parallel) give its losses, dense gradients, tables and optimizer state.
True-gradient mode (Linen): output and gradient of the tables equal the unsharded layer's.

CPU: 4 fake devices (tests/conftest.py); the XLA path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import testing
from jax.sharding import NamedSharding, PartitionSpec as P

N_DEV = min(4, len(jax.devices()))
pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

TABLES = [tbe_jax.TableSpec(37, 8, name="a"), tbe_jax.TableSpec(50, 4), tbe_jax.TableSpec(9, 8),
          tbe_jax.TableSpec(29, 8)]
FMAP = (0, 1, 2, 3, 1)                                 # table 1 read by two features
OUT_DIM = 8 + 4 + 8 + 8 + 4
PLAN = {"a": "row", 1: "table", 2: "data", 3: "column"}
B = 2                                                  # samples per device
CAP = 3 * len(FMAP) * B                                # ids per device (bags of 0..3 ids)
KW = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
LR = 0.1                                               # the head's SGD


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
            idx[k, a:z] = rng.integers(0, TABLES[FMAP[f]].num_embeddings, size=z - a)
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    y = rng.standard_normal(n * b).astype(np.float32)
    return idx, off, w, y


def global_batch(idx, off, w, y):
    """The same samples as one batch in the unsharded format (device k's sample i is sample k*b + i), padded to a
    fixed size (the steps compile once)."""
    gi, go, gw, _ = testing.stack_batches(idx, off, w, num_features=len(FMAP), pad_to=idx.shape[0] * idx.shape[1] + 1)
    return gi, go, gw, y


def close(a, b, rtol=1e-5, atol=1e-6, msg=""):
    assert jax.tree.structure(a) == jax.tree.structure(b), msg
    for x, z in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=rtol, atol=atol, err_msg=msg)


# -- one model per framework: pred = head(embed(idx, off, psw)), trained by the framework's train_step -----


def linen_model(opt, **shard_kw):
    import flax.linen as nn
    from tbe_jax import linen as mod

    class Model(nn.Module):
        @nn.compact
        def __call__(self, idx, off, psw):
            pooled = mod.TableBatchedEmbed(TABLES, optimizer=opt, name="embed", **KW, **shard_kw)(idx, off, psw)
            return nn.Dense(1, name="head")(pooled)[:, 0]

    model = Model()
    box = {}

    def init(batch):
        box["v"] = model.init(jax.random.key(0), *batch[:3])
        return box["v"]["tbe_fused"]["embed"]["embedding"], box["v"]["params"]["head"]

    def load(tables, state, head):
        box["v"] = {"params": {"head": head}, "tbe_fused": {"embed": {"embedding": tables, "opt_state": state}}}

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

    def predict(batch):
        return model.apply(box["v"], *batch[:3])

    def read():
        e = box["v"]["tbe_fused"]["embed"]
        return e["embedding"], e["opt_state"], box["v"]["params"]["head"]

    return init, load, predict, step, read


def nnx_model(opt, **shard_kw):
    from flax import nnx
    from tbe_jax import nnx as mod

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = mod.TableBatchedEmbed(TABLES, optimizer=opt, rngs=rngs, **KW, **shard_kw)
            self.head = nnx.Linear(OUT_DIM, 1, rngs=rngs)

        def __call__(self, idx, off, psw):
            return self.head(self.embed(idx, off, psw))[:, 0]

    box = {}

    def init(batch):
        box["m"] = Model(nnx.Rngs(0))
        return box["m"].embed.get_params(), {"kernel": box["m"].head.kernel[...], "bias": box["m"].head.bias[...]}

    def load(tables, state, head):
        m = box["m"]
        m.embed.set_params(tables)
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
    from tbe_jax import haiku as mod

    def forward(idx, off, psw):
        pooled = mod.TableBatchedEmbed(TABLES, optimizer=opt, name="embed", **KW, **shard_kw)(idx, off, psw)
        return hk.Linear(1, name="head")(pooled)[:, 0]

    f = hk.without_apply_rng(hk.transform_with_state(forward))
    core = tbe_jax.TableBatchedEmbedding(TABLES, **KW)
    if shard_kw:  # the layer's core, outside the transform
        core = tbe_jax.shard(core, shard_kw["mesh"], "data", shard_kw["sharding_plan"])
    box = {}

    def init(batch):
        box["p"], box["s"] = f.init(jax.random.key(0), *batch[:3])
        return mod.fused_params(box["s"]["embed"], core), box["p"]["head"]

    def load(tables, state, head):
        box["p"], box["s"] = {"head": head}, {"embed": mod.module_state(tables, state)}

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


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_sharded_layer_matches_unsharded(framework):
    pytest.importorskip("haiku" if framework == "haiku" else "flax")
    rng = np.random.default_rng({"linen": 1, "nnx": 2, "haiku": 3}[framework])
    opt = tbe_jax.Adagrad(0.3)  # element-wise: column-wise tables allowed
    mesh = auto_mesh()
    emb = tbe_jax.TableBatchedEmbedding(TABLES, **KW)
    sharded = tbe_jax.shard(emb, mesh, "data", PLAN)
    batches = [local_batches(rng) for _ in range(2)]
    gbatches = [global_batch(*b) for b in batches]

    ref = MODELS[framework](opt)
    got = MODELS[framework](opt, mesh=mesh, sharding_plan=PLAN)
    tables, head = ref[0](gbatches[0])
    s_tables, _ = got[0](batches[0])  # the sharded layer's own init: drawn on the mesh
    assert set(s_tables) == set(sharded.init(jax.random.key(0)))
    for v in jax.tree.leaves(s_tables):
        assert v.sharding.spec == P("data") and len(v.sharding.device_set) == N_DEV
    # Both models from the same tables, fresh optimizer state and head.
    ref[1](tables, opt.init(tables), head)
    s_params = sharded.set_tables(None, emb.get_tables(tables))
    # The dense head replicated on the mesh (data parallel), as the step's output has it: one compile.
    got[1](s_params, sharded.init_opt_state(s_params, opt), jax.device_put(head, NamedSharding(mesh, P())))

    # Forward: the global batch's predictions.
    close(got[2](batches[0]), ref[2](gbatches[0]), msg=framework)
    # Two training steps: losses, dense gradients, tables, optimizer state, head.
    for b, gb in zip(batches, gbatches):
        loss, grads = got[3](tuple(jnp.asarray(x) for x in b))
        want_loss, want_grads = ref[3](tuple(jnp.asarray(x) for x in gb))
        close(loss, want_loss, msg=framework)
        close(grads, want_grads, msg=framework)
    t, st, h = got[4]()
    want_t, want_st, want_h = ref[4]()
    close(sharded.get_tables(t), emb.get_tables(want_t), msg=framework)
    close(sharded.get_state(st, "momentum"), emb.get_state(want_st, "momentum"), msg=framework)
    assert int(st.count) == 2
    close(h, want_h, msg=framework)
    assert not np.allclose(np.asarray(sharded.get_tables(t)[0]), np.asarray(emb.get_tables(tables)[0]))


def test_linen_true_gradient_and_errors():
    """True-gradient mode: output and gradient of the tables (sharded like them) equal the unsharded
    layer's; replicated tables, lookup options and a plan without a mesh are refused."""
    pytest.importorskip("flax")
    from tbe_jax.linen import TableBatchedEmbed

    rng = np.random.default_rng(4)
    mesh = auto_mesh()
    plan = {0: "row", 1: "table", 2: "column", 3: ("table", N_DEV - 1)}
    layer = TableBatchedEmbed(TABLES, mesh=mesh, sharding_plan=plan, **KW)
    ref_layer = TableBatchedEmbed(TABLES, **KW)
    idx, off, w, _ = local_batches(rng)
    gi, go, gw, _ = global_batch(idx, off, w, None)
    ref_params = ref_layer.init(jax.random.key(1), gi, go, gw)["params"]["embedding"]
    params = layer.tbe.set_tables(None, ref_layer.tbe.get_tables(ref_params))
    assert layer.tbe.emb == ref_layer.tbe
    cot = jnp.asarray(rng.standard_normal((N_DEV * B, OUT_DIM)).astype(np.float32))

    def value_and_grad(lyr, p, *batch):
        return jax.jit(jax.value_and_grad(
            lambda p: jnp.sum(lyr.apply({"params": {"embedding": p}}, *batch) * cot)))(p)

    loss, grads = value_and_grad(layer, params, idx, off, w)
    want_loss, want_grads = value_and_grad(ref_layer, ref_params, gi, go, gw)
    close(loss, want_loss)
    close(layer.tbe.get_tables(grads), ref_layer.tbe.get_tables(want_grads))
    assert all(g.sharding.spec == P("data") for g in jax.tree.leaves(grads))

    with pytest.raises(ValueError, match="replicated"):
        TableBatchedEmbed(TABLES, mesh=mesh, sharding_plan=PLAN, **KW)
    with pytest.raises(ValueError, match="column block"):  # row statistics on a column-wise table
        TableBatchedEmbed(TABLES, mesh=mesh, sharding_plan=PLAN, optimizer=tbe_jax.RowwiseAdagrad(0.1), **KW)
    with pytest.raises(ValueError, match="give the layer a mesh"):
        TableBatchedEmbed(TABLES, sharding_plan=PLAN, **KW)
    with pytest.raises(ValueError, match="no lookup options"):
        layer.apply({"params": {"embedding": params}}, idx, off, max_batch_size=4)
