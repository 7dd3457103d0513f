"""Haiku layer over `tt_jax.TTEmbeddingBag` (needs dm-haiku).

`TTEmbeddingBag` is an `hk.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(`layer.tt`). It is `tbe_jax.haiku`'s layer over a tensor-train core (the same base
class, state naming, helpers and `train_step`, re-exported here) and trains in one of
two ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are parameters named
   after their path in the functional core's params dict (`"cores_0_1"`: table group 0,
   core 1; the tables sharing q_shapes and ranks stacked, `tt_jax.params`). `jax.grad`
   gives their exact gradient; any optax optimizer applies it.
   `core_params(params["<module name>"], emb)` reassembles the core's params dict and
   `module_params(tt_params)` goes the other way:

   >>> import jax, jax.numpy as jnp, optax, haiku as hk, tt_jax
   >>> from tt_jax.haiku import TTEmbeddingBag
   >>> specs = [tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> def forward(indices, offsets, optimizer=None):
   ...     pooled = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=optimizer,
   ...                             name="embed")(indices, offsets)
   ...     return hk.Linear(1)(pooled)[:, 0]
   >>> model = hk.without_apply_rng(hk.transform(forward))
   >>> params = model.init(jax.random.key(0), indices, offsets)
   >>> sorted(params["embed"])
   ['cores_0_0', 'cores_0_1', 'cores_0_2', 'cores_1_0', 'cores_1_1']
   >>> tx = optax.adam(0.05)
   >>> opt_state = tx.init(params)
   >>> @jax.jit
   ... def dense_step(params, opt_state):
   ...     def loss_fn(params):
   ...         return jnp.mean((model.apply(params, indices, offsets) - labels) ** 2)
   ...     loss, grads = jax.value_and_grad(loss_fn)(params)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     return optax.apply_updates(params, updates), opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, opt_state, loss = dense_step(params, opt_state)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True

2. **Sparse optimizer** (`optimizer=tt_jax.RowwiseAdagrad(...)`, `tt_jax.Adagrad(...)`,
   `tt_jax.SGD(...)`, `tt_jax.Adam(...)` or the other Adam-family optimizers). Cores and
   optimizer state are Haiku *state* (use `hk.transform_with_state`), named
   `"fused_cores_0_1"`, ... (cores) and `"fused_momentum_cores_0_1"`, `"fused_count"`
   (the state's leaves).
   `train_step(loss_fn, params, state, *args)` applies each layer's optimizer to the
   core slices its batch touched (once per slice, with the gradient of its output:
   `tt_jax.TTEmbeddingBag.apply_gradients`) and returns the loss, the dense gradient
   and the new state:

   >>> model = hk.without_apply_rng(hk.transform_with_state(forward))
   >>> adagrad = tt_jax.RowwiseAdagrad(learning_rate=0.2)
   >>> params, state = model.init(jax.random.key(0), indices, offsets, adagrad)
   >>> sorted(state["embed"])[:3]
   ['fused_cores_0_0', 'fused_cores_0_1', 'fused_cores_0_2']
   >>> opt_state = tx.init(params)                 # only the dense layer's params
   >>> def loss_fn(params, state, indices, offsets):
   ...     pred, _ = model.apply(params, state, indices, offsets, adagrad)
   ...     return jnp.mean((pred - labels) ** 2)
   >>> @jax.jit
   ... def sparse_step(params, state, opt_state, indices, offsets):
   ...     loss, grads, state = tt_jax.haiku.train_step(loss_fn, params, state, indices, offsets)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     return optax.apply_updates(params, updates), state, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, state, opt_state, loss = sparse_step(params, state, opt_state, indices, offsets)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> emb = tt_jax.TTEmbeddingBag(specs, pooling="mean", impl="xla")   # the layer's core, outside
   >>> tt_params = tt_jax.haiku.fused_params(state["embed"], emb)
   >>> [[c.shape for c in cores] for cores in emb.get_cores(tt_params)]
   [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)], [(8, 1, 2, 2), (7, 2, 2, 1)]]

   The rules of `tbe_jax.haiku`'s sparse path apply (one call per layer per loss,
   directly in the loss; a disconnected output does not move its cores).

The functional core: `layer.tt` (inside a transform) or, outside, a
`tt_jax.TTEmbeddingBag` built with the same options: its params are
`core_params(params["<module name>"], emb)` (true-gradient mode) or
`fused_params(state["<module name>"], emb)` (sparse mode), and
`fused_opt_state(state["<module name>"], emb, optimizer)` rebuilds the optimizer state;
`module_params` and `module_state` build a layer's entries from a core's params.

Sharding: `TTEmbeddingBag(specs, ..., optimizer=..., mesh=mesh, axis_name="data")` runs
the tables data parallel over a mesh axis (`tt_jax.shard`: every device holds all the
cores, replicated, and looks up its own local batch): `layer.tt` is then the
`ShardedTTEmbeddingBag`, the layer's state holds its replicated cores and optimizer
state (the same names, format and values as unsharded: the helpers above take the
unsharded core or the sharded one), and the layer takes each device's local batch
(`indices [n, N]`, `offsets [n, F*b+1]`) and returns the global batch's `[n*b, sum D]`;
`train_step` runs the sharded sparse update (equal to the unsharded update on the global
batch). See `TTEmbeddingBag`'s arguments. Here every device of a mesh looks up the two
bags above, so the global batch is n copies of them:

>>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
>>> n = mesh.shape["data"]
>>> sgd = tt_jax.SGD(0.1)
>>> sharded = hk.without_apply_rng(hk.transform_with_state(lambda i, o: TTEmbeddingBag(
...     specs, pooling="mean", impl="xla", optimizer=sgd, mesh=mesh, axis_name="data", name="embed")(i, o)))
>>> local_indices, local_offsets = jnp.tile(indices, (n, 1)), jnp.tile(offsets, (n, 1))   # [n, N], [n, F*b+1]
>>> params, state = sharded.init(jax.random.key(0), local_indices, local_offsets)
>>> out, _ = sharded.apply(params, state, local_indices, local_offsets)
>>> out.shape == (n * 2, 12)
True
>>> tt_params = tt_jax.haiku.fused_params(state["embed"], emb)   # emb: the unsharded core, as above
>>> bool(jnp.allclose(out, jnp.tile(emb(tt_params, indices, offsets), (n, 1))))
True
>>> def embed_loss(params, state, indices, offsets):
...     return jnp.sum(sharded.apply(params, state, indices, offsets)[0] ** 2)
>>> step = jax.jit(lambda p, s, i, o: tt_jax.haiku.train_step(embed_loss, p, s, i, o))
>>> loss, _, state = step(params, state, local_indices, local_offsets)
>>> int(tt_jax.haiku.fused_opt_state(state["embed"], emb, sgd).count)
1
"""

from __future__ import annotations

try:
    import haiku as hk  # noqa: F401  (a clear error when dm-haiku is missing)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tt_jax.haiku needs dm-haiku: pip install 'tbe-jax[haiku]' (or pip install dm-haiku)"
    ) from e

from tbe_jax.haiku import (
    FUSED_PREFIX, SparseEmbedBase, StepResult, core_params, fused_opt_state, fused_params, is_fused, module_params,
    module_state, train_step,
)
from tt_jax.layers_common import TT_OPTIONS

__all__ = [
    "FUSED_PREFIX", "StepResult", "TTEmbeddingBag", "core_params", "fused_opt_state", "fused_params", "is_fused",
    "module_params", "module_state", "train_step",
]


class TTEmbeddingBag(SparseEmbedBase):
    """Tensor-train embedding bags as a Haiku module (over `tt_jax.TTEmbeddingBag`, `layer.tt`).

    Variables: with `optimizer=None` the cores are parameters "cores_0_0", ...; with a sparse optimizer
    cores and optimizer state are state entries "fused_cores_0_0", ..., trained by `train_step` (see the
    module docstring). `name`: the module name (default "tt_embedding_bag"). With a mesh, the state holds
    the replicated cores and their optimizer state under the same names; outside the transform, the
    unsharded `tt_jax.TTEmbeddingBag` reads and writes them (`fused_params`, `fused_opt_state`,
    `module_state`).

    Initialisation: the cores are `layer.tt.init(hk.next_rng_key(), ...)`, drawn once at
    init: the same values as the functional core given that key.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk, tt_jax
      >>> from tt_jax.haiku import TTEmbeddingBag
      >>> spec = tt_jax.TTSpec(100, 8, ranks=(4, 4))
      >>> f = hk.without_apply_rng(hk.transform(lambda i, o: TTEmbeddingBag(spec, impl="xla")(i, o)))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 3, 5], jnp.int32)
      >>> params = jax.jit(f.init)(jax.random.key(0), indices, offsets)
      >>> jax.jit(f.apply)(params, indices, offsets).shape
      (2, 8)
      >>> emb = tt_jax.TTEmbeddingBag(spec, impl="xla")   # the same core, outside the transform
      >>> tt_params = tt_jax.haiku.core_params(params["tt_embedding_bag"], emb)
      >>> [[c.shape for c in cores] for cores in emb.get_cores(tt_params)]
      [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)]]
    """

    _OPTIONS = TT_OPTIONS
