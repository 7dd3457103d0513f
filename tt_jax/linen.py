"""Flax Linen layer over `tt_jax.TTEmbeddingBag`.

`TTEmbeddingBag` is an `nn.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(available as `layer.tt`, also on an unbound module). It is `tbe_jax.linen`'s layer
over a tensor-train core (the same base class, collection and `train_step`, re-exported
here) and trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are one parameter,
   `"embedding"`, in the `"params"` collection, holding the functional core's params
   dict (`{"cores": ((G_0, G_1, G_2), ...)}`: per table, its cores `[p_t, r, q_t, r']`).
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

import dataclasses
from typing import Any, Sequence

try:
    import flax.linen as nn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tt_jax.linen needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax.layers_common import as_tuple, cached_core, shard_core
from tbe_jax.linen import FUSED_COLLECTION, SparseEmbedBase, StepResult, train_step
from tbe_jax.optim import Optimizer
from tt_jax.kernels.forward import TTKernelConfig
from tt_jax.sharding import ShardedTTEmbeddingBag
from tt_jax.specs import TTSpec
from tt_jax.tt import TTEmbeddingBag as _TTCore

__all__ = ["FUSED_COLLECTION", "StepResult", "TTEmbeddingBag", "train_step"]


class TTEmbeddingBag(SparseEmbedBase):
    """Tensor-train embedding bags as a Linen module.

    Args (the options of `tt_jax.TTEmbeddingBag`, `specs` positional, the rest
    keyword-only):
      specs: one `TTSpec` or a sequence of them.
      feature_table_map, pooling, impl, interpret, config, bounds_check: forwarded to
        `tt_jax.TTEmbeddingBag` when not None (None: the core's default).
      initializer, init_std: the core's `init(key, init=initializer, std=init_std)`
        ("approx-normal" or "approx-uniform"; std None: FBGEMM's table scale).
      optimizer: None (true-gradient mode: the cores are the parameter `"embedding"`
        in `"params"`), or `tt_jax.RowwiseAdagrad(...)` / `tt_jax.Adagrad(...)` /
        `tt_jax.SGD(...)` / `tt_jax.Adam(...)` (or `PartialRowwiseAdam`, `Lamb`,
        `PartialRowwiseLamb`) (sparse mode: the cores, `"embedding"`, and the optimizer
        state, `"opt_state"`, live in the `"tbe_fused"` collection; train with
        `train_step`, see the module docstring).
      mesh, axis_name, sharding_plan: run the tables over the devices of `mesh`'s axis
        `axis_name` (default None: unsharded, the layer as before). The layer's core is
        then `tt_jax.shard(tt_jax.TTEmbeddingBag(...), mesh, axis_name, sharding_plan)`
        (see `tt_jax.ShardedTTEmbeddingBag`): data parallel, every table's cores and
        optimizer state replicated on every device. `sharding_plan`: None, a dict
        `{table: "data"}`, a sequence of one strategy per table or a `ShardingPlan`;
        `"data"` is the only strategy for TT tables (another one, e.g. `"row"`, raises
        `tt_jax.sharding.plan_sharding`'s error when the layer is built). The cores are
        drawn as unsharded (`layer.tt.init`: the same values) and placed on the mesh.
        Inputs are then per device: `indices [n, N]`, `offsets [n, F*b+1]` (row k:
        device k's local batch of b samples), per-sample weights `[n, N]`; the output is
        the global batch's `[n*b, sum D]` (device k's samples at rows `k*b ...`), sharded
        over the axis. Both modes: true gradient (`optimizer=None`: `jax.grad` through
        the layer gives the replicated cores the unsharded gradient on the global batch,
        the devices' shares summed over the axis; any optax optimizer consumes it) and
        sparse (train with `train_step`), under `jax.jit`, on a mesh whose axis is
        `jax.sharding.AxisType.Auto`. There is no `capacity` (no ids are routed).

    Call: `layer(indices, offsets, per_sample_weights=None)`, with the functional
    core's input format (FBGEMM's: flat ids, feature-major offsets of length F*B+1)
    and output `[B, sum_f D_f]` (with a mesh, the per-device format above). Indices and
    offsets must be integer arrays (else `ValueError`).

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

    specs: TTSpec | Sequence[TTSpec]
    _: dataclasses.KW_ONLY
    feature_table_map: Sequence[int] | None = None
    pooling: str = "sum"
    impl: str = "auto"
    interpret: bool = False
    config: TTKernelConfig | None = None
    bounds_check: str | None = None
    initializer: str = "approx-normal"
    init_std: float | None = None
    optimizer: Optimizer | None = None
    mesh: Any = None
    axis_name: str = "data"
    sharding_plan: Any = None

    _MAKERS = ("tt_jax.RowwiseAdagrad(...), tt_jax.SGD, tt_jax.Adagrad, tt_jax.Adam, tt_jax.PartialRowwiseAdam, "
               "tt_jax.Lamb or tt_jax.PartialRowwiseLamb")

    def _build_core(self) -> _TTCore | ShardedTTEmbeddingBag:
        specs = (self.specs,) if isinstance(self.specs, TTSpec) else tuple(self.specs)
        fmap = as_tuple(self.feature_table_map)
        core = cached_core(_TTCore, specs, dict(feature_table_map=fmap, pooling=self.pooling, impl=self.impl,
                                                interpret=bool(self.interpret), config=self.config,
                                                bounds_check=self.bounds_check))
        return shard_core(core, self.mesh, self.axis_name, self.sharding_plan)

    def _init_params(self, key):
        return self._build_core().init(key, self.initializer, self.init_std)

    @property
    def tt(self) -> _TTCore | ShardedTTEmbeddingBag:
        """The wrapped functional `tt_jax.TTEmbeddingBag` (immutable, hashable); with a mesh, the
        `ShardedTTEmbeddingBag` over it (the same methods: `get_cores`, `set_cores`, `full_table`,
        `get_momentum`, ...; `.emb` is the unsharded core)."""
        return self._build_core()

    @nn.compact
    def __call__(self, indices, offsets, per_sample_weights=None):
        return self._embed(indices, offsets, per_sample_weights, {})
