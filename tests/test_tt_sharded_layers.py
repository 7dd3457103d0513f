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

The models, batches and helpers: tests/sharded_layer_models.py (shared with tests/test_sharded_layers.py).

CPU: 4 fake devices (tests/conftest.py); the XLA path; small shapes (every program is a compile).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sharded_layer_models as M
import tt_jax
from conftest import layer_build
from sharded_layer_models import N_DEV, auto_mesh, close

pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

# One stacked table group (same q_shapes and ranks), two cores each: small programs. Table 0 is read by
# features 0 and 2 (shared core slices).
SPECS = (tt_jax.TTSpec(30, 4, p_shapes=(6, 6), q_shapes=(2, 2), ranks=(3,)),
         tt_jax.TTSpec(19, 4, p_shapes=(5, 4), q_shapes=(2, 2), ranks=(3,)))
FMAP = (0, 1, 0)
OUT_DIM = 12
KW = dict(feature_table_map=FMAP, pooling="mean", impl="xla")
FRAMEWORKS = ["linen", "nnx", "haiku"]


def module(framework):
    pytest.importorskip("haiku" if framework == "haiku" else "flax")
    return pytest.importorskip(f"tt_jax.{framework}")


local_batches = partial(M.local_batches, tables=SPECS, fmap=FMAP)
global_batch = partial(M.global_batch, num_features=len(FMAP))


# -- one model per framework (tests/sharded_layer_models.py), the layer TTEmbeddingBag ---------------------


def _layer(mod, opt, **kw):
    return mod.TTEmbeddingBag(SPECS, optimizer=opt, **KW, **kw)


# Haiku: the unsharded core (outside the transform) reads either layer's state.
MODELS = M.model_builders(module, _layer, OUT_DIM, lambda **shard_kw: tt_jax.TTEmbeddingBag(SPECS, **KW))
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

    # Forward (the global batch's predictions) and two training steps (losses, dense gradients); then
    # cores, optimizer state, head.
    (c, st, h), (want_c, want_st, want_h) = M.compare_forward_and_steps(got, ref, batches, gbatches, framework)
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
    optax = pytest.importorskip("optax")
    mod = module("linen")
    rng = np.random.default_rng(4)
    mesh = auto_mesh()

    ref, got = M.linen_net(mod, _layer, None), M.linen_net(mod, _layer, None, mesh=mesh, axis_name="data")
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
