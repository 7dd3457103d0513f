"""What tt_jax's framework layers (`tt_jax.linen`, `tt_jax.nnx`, `tt_jax.haiku`) share: their options,
`TT_OPTIONS`, read from `tt_jax.TTEmbeddingBag`'s constructor (see `tbe_jax.layers_common.LayerOptions`)."""

from __future__ import annotations

from tbe_jax.layers_common import LayerOptions
from tt_jax.tt import TTEmbeddingBag

__all__ = ["TT_OPTIONS"]

TT_OPTIONS = LayerOptions(TTEmbeddingBag, attr="tt", package="tt_jax", init={"initializer": "init", "init_std": "std"},
                          doc="""
    initializer, init_std: the core's `init(key, init=initializer, std=init_std)` ("approx-normal" or
      "approx-uniform"; std None: FBGEMM's table scale).
    mesh, axis_name, sharding_plan: run the tables over the devices of `mesh`'s axis `axis_name` (default
      None: unsharded). The layer's core is then `tt_jax.shard(tt_jax.TTEmbeddingBag(...), mesh, axis_name,
      sharding_plan)` (see `tt_jax.ShardedTTEmbeddingBag`): data parallel, every table's cores and optimizer
      state replicated on every device. `sharding_plan`: None, a dict `{table: "data"}`, a sequence of one
      strategy per table or a `ShardingPlan`; `"data"` is the only strategy for TT tables (another one, e.g.
      `"row"`, raises `tt_jax.sharding.plan_sharding`'s error when the layer is built). The cores are drawn
      as unsharded (the same values) and placed on the mesh. Inputs are then per device: `indices [n, N]`,
      `offsets [n, F*b+1]` (row k: device k's local batch of b samples), per-sample weights `[n, N]`; the
      output is the global batch's `[n*b, sum D]` (device k's samples at rows `k*b ...`), sharded over the
      axis. Both modes: true gradient (`optimizer=None`: the gradient through the layer gives the replicated
      cores the unsharded gradient on the global batch, the devices' shares summed over the axis; any optax
      optimizer consumes it) and sparse (train with `train_step`), under `jit`, on a mesh whose axis is
      `jax.sharding.AxisType.Auto`. There is no `capacity` (no ids are routed).
    """)
