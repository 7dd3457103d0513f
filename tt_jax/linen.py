"""Flax Linen layer over `tt_jax.TTEmbeddingBag`.

`TTEmbeddingBag` is an `nn.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(available as `layer.tt`, also on an unbound module). It is `tbe_jax.linen`'s layer
over a tensor-train core (the same base class, collection and `train_step`, re-exported
here) and trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are one parameter,
   `"embedding"`, in the `"params"` collection, holding the functional core's params
   dict (`{"cores": ((G_0, G_1, G_2), ...)}`: per table group, its stacked cores
   `[P_t, r, q_t, r']`, `tt_jax.params`; `layer.tt.get_cores` gives them per table).
   `jax.grad` gives their exact gradient (the prefix-sharing backward of `tt_jax`) and
   any optax optimizer consumes it:

   >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, tt_jax
   >>> from tt_jax.linen import TTEmbeddingBag
   >>> specs = [tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> class Model(nn.Module):
   ...     optimizer: tt_jax.RowwiseAdagrad | None = None
   ...     @nn.compact
   ...     def __call__(self, indices, offsets):
   ...         pooled = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=self.optimizer,
   ...                                 name="embed")(indices, offsets)
   ...         return nn.Dense(1)(pooled)[:, 0]
   >>> model = Model()
   >>> params = model.init(jax.random.key(0), indices, offsets)["params"]
   >>> jax.tree.map(jnp.shape, params["embed"]["embedding"]["cores"][1])
   ((8, 1, 2, 2), (7, 2, 2, 1))
   >>> tx = optax.adam(0.05)
   >>> opt_state = tx.init(params)
   >>> @jax.jit
   ... def dense_step(params, opt_state):
   ...     def loss_fn(params):
   ...         return jnp.mean((model.apply({"params": params}, indices, offsets) - labels) ** 2)
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
   `tt_jax.SGD(...)`, `tt_jax.Adam(...)` or the other Adam-family optimizers). The cores
   and the optimizer state live in the collection `FUSED_COLLECTION = "tbe_fused"`
   (`{"embedding": {"cores": ...}, "opt_state": RowwiseAdagradState(...)}` under the
   layer's path), and `train_step(loss_fn, variables, *args)` trains them: the dense
   gradient for optax, and each layer's optimizer applied to the core slices the batch
   touched (once per slice, with the gradient of the layer's output:
   `tt_jax.TTEmbeddingBag.apply_gradients`):

   >>> model = Model(optimizer=tt_jax.RowwiseAdagrad(learning_rate=0.2))
   >>> variables = model.init(jax.random.key(0), indices, offsets)
   >>> sorted(variables["tbe_fused"]["embed"])
   ['embedding', 'opt_state']
   >>> opt_state = tx.init(variables["params"])     # no Adam moments for the cores
   >>> def loss_fn(variables, indices, offsets):
   ...     return jnp.mean((model.apply(variables, indices, offsets) - labels) ** 2)
   >>> @jax.jit
   ... def sparse_step(variables, opt_state, indices, offsets):
   ...     loss, grads, variables = tt_jax.linen.train_step(loss_fn, variables, indices, offsets)
   ...     updates, opt_state = tx.update(grads, opt_state, variables["params"])
   ...     variables = {**variables, "params": optax.apply_updates(variables["params"], updates)}
   ...     return variables, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     variables, opt_state, loss = sparse_step(variables, opt_state, indices, offsets)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> core = TTEmbeddingBag(specs, pooling="mean", impl="xla").tt   # what Model's layer wraps
   >>> [m.shape for m in core.get_momentum(variables["tbe_fused"]["embed"]["opt_state"])[0]]
   [(5,), (5,), (5,)]

   The rules of `tbe_jax.linen`'s sparse path apply (one call per layer per loss,
   directly in the loss; a disconnected output does not move its cores).

The functional core: `layer.tt` is the wrapped `tt_jax.TTEmbeddingBag`, so
`layer.tt.get_cores(variables["params"]["embedding"])` (or
`variables["tbe_fused"]["embedding"]` in sparse mode) gives the per-table cores,
`layer.tt.full_table(...)` the materialised tables, and
`layer.tt.get_momentum(...["opt_state"])` the Adagrad accumulators
(`layer.tt.get_state(..., "momentum1")` / `"momentum2"`: Adam's moments).

Sharding: `TTEmbeddingBag(specs, ..., optimizer=..., mesh=mesh, axis_name="data")` runs the
tables data parallel over a mesh axis (`tt_jax.shard`: every device holds all the cores,
replicated, and looks up its own local batch): `layer.tt` is then the
`ShardedTTEmbeddingBag`, `"embedding"` and `"opt_state"` hold its replicated cores and
state (the same format and values as unsharded), and the layer takes each device's
local batch (`indices [n, N]`, `offsets [n, F*b+1]`) and returns the global batch's
`[n*b, sum D]`; `train_step` runs the sharded sparse update (equal to the unsharded
update on the global batch). See `TTEmbeddingBag`'s arguments. Here every device of a
mesh looks up the two bags above, so the global batch is n copies of them:

>>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
>>> n = mesh.shape["data"]
>>> layer = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=tt_jax.SGD(0.1), mesh=mesh,
...                        axis_name="data", name="embed")
>>> local_indices, local_offsets = jnp.tile(indices, (n, 1)), jnp.tile(offsets, (n, 1))   # [n, N], [n, F*b+1]
>>> variables = layer.init(jax.random.key(0), local_indices, local_offsets)
>>> tt_params = variables["tbe_fused"]["embedding"]
>>> out = layer.apply(variables, local_indices, local_offsets)
>>> out.shape == (n * 2, 12)
True
>>> bool(jnp.allclose(out, jnp.tile(layer.tt.emb(tt_params, indices, offsets), (n, 1))))
True
>>> def embed_loss(variables, indices, offsets):
...     return jnp.sum(layer.apply(variables, indices, offsets) ** 2)
>>> step = jax.jit(lambda v, i, o: tt_jax.linen.train_step(embed_loss, v, i, o))
>>> loss, _, variables = step(variables, local_indices, local_offsets)
>>> int(variables["tbe_fused"]["opt_state"].count)
1
"""

from __future__ import annotations

try:
    import flax.linen as nn  # noqa: F401  (a clear error when Flax is missing)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tt_jax.linen needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax.linen import FUSED_COLLECTION, SparseEmbedBase, StepResult, train_step
from tt_jax.layers_common import TT_OPTIONS

__all__ = ["FUSED_COLLECTION", "StepResult", "TTEmbeddingBag", "train_step"]


class TTEmbeddingBag(SparseEmbedBase):
    """Tensor-train embedding bags as a Linen module (over `tt_jax.TTEmbeddingBag`, `layer.tt`).

    Variables: with `optimizer=None` the cores are the parameter `"embedding"` in `"params"`; with a sparse
    optimizer the cores, `"embedding"`, and the optimizer state, `"opt_state"`, live in the `"tbe_fused"`
    collection (train with `train_step`, see the module docstring).

    Parameters: `"embedding"` is exactly the functional core's params dict, so
    `layer.tt(variables["params"]["embedding"], indices, offsets)` equals
    `layer.apply(variables, indices, offsets)`, and a core's params are copied in with
    `{"params": {"embedding": tt_params}}`. They are initialised by `layer.tt.init` with
    the key Linen hands to the parameter's initialiser (from the `"params"` rng and the
    module path).

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> from tt_jax.linen import TTEmbeddingBag
      >>> layer = TTEmbeddingBag([tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))],
      ...                        impl="xla")
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> variables = jax.jit(layer.init)(jax.random.key(0), indices, offsets)
      >>> jax.jit(layer.apply)(variables, indices, offsets).shape
      (2, 12)
      >>> [[c.shape for c in cores] for cores in layer.tt.get_cores(variables["params"]["embedding"])]
      [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)], [(8, 1, 2, 2), (7, 2, 2, 1)]]
    """

    _OPTIONS = TT_OPTIONS
