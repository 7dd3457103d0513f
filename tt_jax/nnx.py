"""Flax NNX layer over `tt_jax.TTEmbeddingBag`.

`TTEmbeddingBag` is an `nnx.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(the static attribute `layer.tt`). It is `tbe_jax.nnx`'s layer over a tensor-train core
(the same base class, `Fused` variable type and `train_step`, re-exported here) and
trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are `nnx.Param`s, one
   per core, in `layer.embedding` (an `nnx.Dict` keyed by the core's path in the
   functional params dict: `"cores_0_1"` is table group 0's core 1, the cores of the
   tables sharing q_shapes and ranks stacked, `tt_jax.params`). `nnx.grad` gives their
   exact gradient and `nnx.Optimizer` with any optax transformation applies it:

   >>> import jax, jax.numpy as jnp, optax, tt_jax
   >>> from flax import nnx
   >>> from tt_jax.nnx import TTEmbeddingBag
   >>> specs = [tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> class Model(nnx.Module):
   ...     def __init__(self, optimizer=None, *, rngs):
   ...         self.embed = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=optimizer, rngs=rngs)
   ...         self.head = nnx.Linear(12, 1, rngs=rngs)
   ...     def __call__(self, indices, offsets):
   ...         return self.head(self.embed(indices, offsets))[:, 0]
   >>> model = Model(rngs=nnx.Rngs(0))
   >>> sorted(model.embed.embedding.keys())
   ['cores_0_0', 'cores_0_1', 'cores_0_2', 'cores_1_0', 'cores_1_1']
   >>> optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
   >>> def loss_fn(model, indices, offsets):
   ...     return jnp.mean((model(indices, offsets) - labels) ** 2)
   >>> @nnx.jit
   ... def dense_step(model, optimizer):
   ...     loss, grads = nnx.value_and_grad(loss_fn)(model, indices, offsets)
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(dense_step(model, optimizer)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True

2. **Sparse optimizer** (`optimizer=tt_jax.RowwiseAdagrad(...)`, `tt_jax.Adagrad(...)`,
   `tt_jax.SGD(...)`, `tt_jax.Adam(...)` or the other Adam-family optimizers). Cores and
   optimizer state are `Fused` variables (not `nnx.Param`s, so `nnx.Optimizer(...,
   wrt=nnx.Param)` leaves them alone):
   `layer.embedding` (same keys as above) and `layer.opt_state` (the state's leaves,
   e.g. `"momentum_cores_0_1"`, `"count"`). `train_step(loss_fn, model, *args)` applies
   each layer's optimizer to the core slices its batch touched (once per slice, with
   the gradient of its output: `tt_jax.TTEmbeddingBag.apply_gradients`), writes the new
   cores and state into the model, and returns the loss and the dense gradients:

   >>> model = Model(tt_jax.RowwiseAdagrad(learning_rate=0.2), rngs=nnx.Rngs(0))
   >>> optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)   # dense layers only
   >>> @nnx.jit
   ... def sparse_step(model, optimizer, indices, offsets):
   ...     loss, grads = tt_jax.nnx.train_step(loss_fn, model, indices, offsets)   # cores updated
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(sparse_step(model, optimizer, indices, offsets)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True
   >>> [m.shape for m in model.embed.tt.get_momentum(model.embed.get_opt_state())[0]]
   [(5,), (5,), (5,)]

   The rules of `tbe_jax.nnx`'s sparse path apply (one call per layer per loss,
   directly in the loss; a disconnected output does not move its cores).

The functional core: `layer.tt` is the wrapped `tt_jax.TTEmbeddingBag`;
`layer.get_params()` returns its params dict (either mode), so
`layer.tt(layer.get_params(), indices, offsets)` equals `layer(indices, offsets)` and
`layer.tt.full_table(layer.get_params())` gives the tables; `layer.set_params(params)`
copies a core's params in (`get_opt_state`/`set_opt_state` likewise for the state).

Sharding: `TTEmbeddingBag(specs, ..., optimizer=..., mesh=mesh, axis_name="data", rngs=...)`
runs the tables data parallel over a mesh axis (`tt_jax.shard`: every device holds all
the cores, replicated, and looks up its own local batch): `layer.tt` is then the
`ShardedTTEmbeddingBag`, the layer's variables hold its replicated cores and state (the
same format and values as unsharded), and the layer takes each device's local batch
(`indices [n, N]`, `offsets [n, F*b+1]`) and returns the global batch's `[n*b, sum D]`;
`train_step` runs the sharded sparse update (equal to the unsharded update on the global
batch). See `TTEmbeddingBag`'s arguments. Here every device of a mesh looks up the two
bags above, so the global batch is n copies of them:

>>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
>>> n = mesh.shape["data"]
>>> layer = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=tt_jax.SGD(0.1), mesh=mesh,
...                        axis_name="data", rngs=nnx.Rngs(0))
>>> local_indices, local_offsets = jnp.tile(indices, (n, 1)), jnp.tile(offsets, (n, 1))   # [n, N], [n, F*b+1]
>>> out = layer(local_indices, local_offsets)
>>> out.shape == (n * 2, 12)
True
>>> bool(jnp.allclose(out, jnp.tile(layer.tt.emb(layer.get_params(), indices, offsets), (n, 1))))
True
>>> @nnx.jit
... def step(layer, indices, offsets):
...     return tt_jax.nnx.train_step(lambda m, i, o: jnp.sum(m(i, o) ** 2), layer, indices, offsets)
>>> loss, _ = step(layer, local_indices, local_offsets)
>>> int(layer.get_opt_state().count)
1
"""

from __future__ import annotations

try:
    from flax import nnx  # noqa: F401  (a clear error when Flax is missing)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tt_jax.nnx needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax.nnx import Fused, SparseEmbedBase, train_step
from tt_jax.layers_common import TT_OPTIONS

__all__ = ["Fused", "TTEmbeddingBag", "train_step"]


class TTEmbeddingBag(SparseEmbedBase):
    """Tensor-train embedding bags as an NNX module (over `tt_jax.TTEmbeddingBag`, `layer.tt`).

    Variables: with `optimizer=None` the cores are `nnx.Param`s; with a sparse optimizer cores and optimizer
    state are `Fused` variables, trained by `train_step` (see the module docstring). `rngs`: `nnx.Rngs`; the
    cores are `layer.tt.init(rngs.params(), ...)`, the same values as the functional core given that key
    (with a mesh too: replicated).

    Attributes:
      tt: the wrapped `tt_jax.TTEmbeddingBag` (static); with a mesh, the `ShardedTTEmbeddingBag`.
      embedding, opt_state: one variable per core ("cores_<table>_<core>") and per leaf of the optimizer
        state; see `SparseEmbedBase`.

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> from flax import nnx
      >>> from tt_jax.nnx import TTEmbeddingBag
      >>> layer = TTEmbeddingBag(tt_jax.TTSpec(100, 8, ranks=(4, 4)), impl="xla", rngs=nnx.Rngs(0))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 3, 5], jnp.int32)
      >>> nnx.jit(lambda layer, i, o: layer(i, o))(layer, indices, offsets).shape
      (2, 8)
      >>> [[c.shape for c in cores] for cores in layer.tt.get_cores(layer.get_params())]
      [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)]]
    """

    _OPTIONS = TT_OPTIONS
