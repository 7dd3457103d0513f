"""Shared helpers of the sharded-layer tests (tests/test_sharded_layers.py: TBE layers, tests/test_tt_sharded_layers.py:
TT layers): the mesh, the per-device and global batches, a tree comparison, and one model per framework (Linen, NNX,
Haiku): pred = head(embed(idx, off, psw)), trained by the framework's `train_step` (sparse mode; the head by SGD).

Not a test module (no `test_` prefix); the tests import it as a sibling module, as they import `conftest`.
What differs between the TBE and TT tests comes in as arguments: the framework's layer module, a function that
builds the embedding layer, the layer's output width, the table specs, and the Haiku model's core.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbe_jax import testing

N_DEV = min(4, len(jax.devices()))
B = 2                                                  # samples per device
LR = 0.1                                               # the head's SGD


def auto_mesh(n=N_DEV):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))


def local_batches(rng, tables, fmap, n=N_DEV, b=B, cap=None):
    """Per device: ids [cap] (padding past offsets[-1]), offsets [F*b+1], weights [cap]; labels [n*b].

    `tables`: the specs (anything with `num_embeddings`), read by feature f as `tables[fmap[f]]`; `cap`: ids per
    device, by default 3*F*b (bags of 0..3 ids)."""
    nf = len(fmap)
    cap = 3 * nf * b if cap is None else cap
    idx = np.zeros((n, cap), np.int32)
    off = np.zeros((n, nf * b + 1), np.int32)
    for k in range(n):
        off[k, 1:] = np.cumsum(rng.integers(0, 4, size=nf * b))
        for f in range(nf):
            a, z = off[k, f * b], off[k, (f + 1) * b]
            idx[k, a:z] = rng.integers(0, tables[fmap[f]].num_embeddings, size=z - a)
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    y = rng.standard_normal(n * b).astype(np.float32)
    return idx, off, w, y


def global_batch(idx, off, w, y, num_features):
    """The same samples as one batch in the unsharded format (device k's sample i is sample k*b + i), padded to a
    fixed size (the steps compile once)."""
    gi, go, gw, _ = testing.stack_batches(idx, off, w, num_features=num_features, pad_to=idx.size + 1)
    return gi, go, gw, y


def close(a, b, rtol=1e-5, atol=1e-6, msg=""):
    assert jax.tree.structure(a) == jax.tree.structure(b), msg
    for x, z in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=rtol, atol=atol, err_msg=msg)



def compare_forward_and_steps(got, ref, batches, gbatches, msg):
    """The sharded model `got` against the unsharded `ref` (builders' tuples): predictions on the first
    batch, then one training step per batch (losses and dense gradients); returns both models' final
    (embedding params, optimizer state, head)."""
    close(got[2](batches[0]), ref[2](gbatches[0]), msg=msg)
    for b, gb in zip(batches, gbatches):
        loss, grads = got[3](tuple(jnp.asarray(x) for x in b))
        want_loss, want_grads = ref[3](tuple(jnp.asarray(x) for x in gb))
        close(loss, want_loss, msg=msg)
        close(grads, want_grads, msg=msg)
    return got[4](), ref[4]()

# -- one model per framework: pred = head(embed(idx, off, psw)), trained by the framework's train_step -----
#
# `mod`: the framework's layer module (`tbe_jax.linen`, `tt_jax.nnx`, ...); `layer(mod, opt, **kw)`: the embedding
# layer with optimizer `opt` (None: true-gradient mode), `kw` being the framework's naming argument (`name=` or
# `rngs=`) and the sharding arguments (`mesh=`, `sharding_plan=`, ...; none: the unsharded layer). Each builder
# returns (init, load, predict, step, read): init(batch) -> (embedding params, head); load(params, opt_state, head);
# predict(batch) -> [n]; step(batch) -> (loss, head grads), one jitted train_step and SGD on the head;
# read() -> (embedding params, opt_state, head).


def linen_net(mod, layer, opt, **shard_kw):
    """The Linen model (a module instance), e.g. for an optax training loop in true-gradient mode (`opt=None`)."""
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, idx, off, psw):
            pooled = layer(mod, opt, name="embed", **shard_kw)(idx, off, psw)
            return nn.Dense(1, name="head")(pooled)[:, 0]

    return Model()


def linen_model(mod, layer, opt, **shard_kw):
    model = linen_net(mod, layer, opt, **shard_kw)
    box = {}

    def init(batch):
        box["v"] = model.init(jax.random.key(0), *batch[:3])
        return box["v"]["tbe_fused"]["embed"]["embedding"], box["v"]["params"]["head"]

    def load(params, state, head):
        box["v"] = {"params": {"head": head}, "tbe_fused": {"embed": {"embedding": params, "opt_state": state}}}

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


def nnx_model(mod, layer, opt, out_dim, **shard_kw):
    """`out_dim`: the layer's output width (the head's input)."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = layer(mod, opt, rngs=rngs, **shard_kw)
            self.head = nnx.Linear(out_dim, 1, rngs=rngs)

        def __call__(self, idx, off, psw):
            return self.head(self.embed(idx, off, psw))[:, 0]

    box = {}

    def init(batch):
        box["m"] = Model(nnx.Rngs(0))
        return box["m"].embed.get_params(), {"kernel": box["m"].head.kernel[...], "bias": box["m"].head.bias[...]}

    def load(params, state, head):
        m = box["m"]
        m.embed.set_params(params)
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


def haiku_model(mod, layer, opt, core, **shard_kw):
    """`core`: the core (built outside the transform) that `mod.fused_params` / `mod.fused_opt_state` read the
    layer's state with."""
    hk = pytest.importorskip("haiku")

    def forward(idx, off, psw):
        pooled = layer(mod, opt, name="embed", **shard_kw)(idx, off, psw)
        return hk.Linear(1, name="head")(pooled)[:, 0]

    f = hk.without_apply_rng(hk.transform_with_state(forward))
    box = {}

    def init(batch):
        box["p"], box["s"] = f.init(jax.random.key(0), *batch[:3])
        return mod.fused_params(box["s"]["embed"], core), box["p"]["head"]

    def load(params, state, head):
        box["p"], box["s"] = {"head": head}, {"embed": mod.module_state(params, state)}

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


def model_builders(module, layer, out_dim, haiku_core):
    """{"linen", "nnx", "haiku"} -> builder(opt, **shard_kw) -> (init, load, predict, step, read).

    `module(framework)`: the framework's layer module (imported when a model is built); `layer(mod, opt, **kw)`:
    the embedding layer; `out_dim`: its output width; `haiku_core(**shard_kw)`: the core the Haiku model reads
    its state with."""
    return {
        "linen": lambda opt, **shard_kw: linen_model(module("linen"), layer, opt, **shard_kw),
        "nnx": lambda opt, **shard_kw: nnx_model(module("nnx"), layer, opt, out_dim, **shard_kw),
        "haiku": lambda opt, **shard_kw: haiku_model(module("haiku"), layer, opt, haiku_core(**shard_kw),
                                                     **shard_kw),
    }
