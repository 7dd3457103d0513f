"""The Flax (Linen, NNX) and Haiku TBE layers built with a mesh, against the unsharded layers.

A layer built with `mesh=...` wraps `tbe_jax.shard(core, mesh, axis_name, sharding_plan)`: it
takes each device's local batch (`indices [n, N]`, `offsets [n, F*b+1]`) and returns the global
batch's `[n*b, sum D]`. Per framework: a model (the layer and a dense head) with a mixed plan
(row-, table-, column-wise and replicated tables) gives the unsharded model's predictions on the
global batch, and two jitted steps of the framework's `train_step` (sparse mode; the head
trained by SGD, data parallel) give its losses, dense gradients, tables and optimizer state.
True-gradient mode (Linen): output and gradient of the tables equal the unsharded layer's.

The models, batches and helpers: tests/sharded_layer_models.py (shared with tests/test_tt_sharded_layers.py).

CPU: 4 fake devices (tests/conftest.py); the XLA path.
"""

import importlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharded_layer_models as M
import tbe_jax
from jax.sharding import NamedSharding, PartitionSpec as P
from sharded_layer_models import B, N_DEV, auto_mesh, close

pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

TABLES = [tbe_jax.TableSpec(37, 8, name="a"), tbe_jax.TableSpec(50, 4), tbe_jax.TableSpec(9, 8),
          tbe_jax.TableSpec(29, 8)]
FMAP = (0, 1, 2, 3, 1)                                 # table 1 read by two features
OUT_DIM = 8 + 4 + 8 + 8 + 4
PLAN = {"a": "row", 1: "table", 2: "data", 3: "column"}
KW = dict(feature_table_map=FMAP, pooling="mean", impl="xla")

local_batches = partial(M.local_batches, tables=TABLES, fmap=FMAP)
global_batch = partial(M.global_batch, num_features=len(FMAP))


# -- one model per framework (tests/sharded_layer_models.py), the layer TableBatchedEmbed ------------------


def _haiku_core(**shard_kw):
    core = tbe_jax.TableBatchedEmbedding(TABLES, **KW)
    if shard_kw:  # the layer's core, outside the transform
        core = tbe_jax.shard(core, shard_kw["mesh"], "data", shard_kw["sharding_plan"])
    return core


MODELS = M.model_builders(
    lambda framework: importlib.import_module(f"tbe_jax.{framework}"),
    lambda mod, opt, **kw: mod.TableBatchedEmbed(TABLES, optimizer=opt, **KW, **kw), OUT_DIM, _haiku_core)


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

    # Forward (the global batch's predictions) and two training steps (losses, dense gradients); then
    # tables, optimizer state, head.
    (t, st, h), (want_t, want_st, want_h) = M.compare_forward_and_steps(got, ref, batches, gbatches, framework)
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
    # capacity as per-feature id counts (a list) passes through to tbe_jax.shard
    counted = TableBatchedEmbed(TABLES, mesh=mesh, sharding_plan=plan, capacity=[idx.shape[1]] * len(FMAP), **KW)
    assert counted.tbe.feature_capacity == (idx.shape[1],) * len(FMAP)
    close(counted.apply({"params": {"embedding": params}}, idx, off, w),
          layer.apply({"params": {"embedding": params}}, idx, off, w))

    with pytest.raises(ValueError, match="replicated"):
        TableBatchedEmbed(TABLES, mesh=mesh, sharding_plan=PLAN, **KW)
    # row statistics on a column-wise table: summed across its column shards (tests/test_sharding_rowwise.py)
    TableBatchedEmbed(TABLES, mesh=mesh, sharding_plan=PLAN, optimizer=tbe_jax.RowwiseAdagrad(0.1), **KW)
    with pytest.raises(ValueError, match="give the layer a mesh"):
        TableBatchedEmbed(TABLES, sharding_plan=PLAN, **KW)
    with pytest.raises(ValueError, match="no lookup options"):
        layer.apply({"params": {"embedding": params}}, idx, off, max_batch_size=4)
