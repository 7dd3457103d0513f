"""tt_jax: tensor-train compressed embedding tables (FlowTT-style).

- `TTSpec`, `TTEmbeddingBag`: specs, initialisation, core access, the materialised table and pooled
  lookups in tbe_jax's input format (`impl="xla"`: the pure-jnp per-index chain; `impl="pallas"`: the
  fused FlowTT forward, `tt_jax.kernels.forward`, on the prefix plan of `tt_jax.prefix.build_flow`), with
  tbe_jax's `bounds_check` modes. The params hold each table group's cores stacked, one buffer per core
  (`tt_jax.params`); `get_cores` / `set_cores` convert from and to per-table cores.
- Training: exact core gradients under `jax.grad` from a prefix-sharing backward that reuses the
  forward's plan (`tt_jax.kernels.backward`, Pallas, deterministic; `tt_jax.backward` on the XLA path);
  optimizers on the touched core slices (`SGD`, `Adagrad`, `RowwiseAdagrad`, `Adam`, `PartialRowwiseAdam`,
  `Lamb`, `PartialRowwiseLamb`: the optimizers of `tbe_jax.optim`, re-exported; lazy, as FBGEMM's) via
  `TTEmbeddingBag.apply_gradients` or `tbe_jax.train_step`.
- `shard(emb, mesh, axis_name)`: data parallel over a mesh axis (cores replicated, the global batch's
  update on every device; `tt_jax.sharding`), with `tbe_jax.shard`'s API.
"""

from tt_jax.optim import (
    SGD,
    Adagrad,
    AdagradState,
    Adam,
    AdamState,
    Lamb,
    PartialRowwiseAdam,
    PartialRowwiseLamb,
    RowwiseAdagrad,
    RowwiseAdagradState,
    SGDState,
)
from tt_jax.sharding import ShardedTTEmbeddingBag, shard
from tt_jax.specs import TTSpec, suggested_tt_shapes
from tt_jax.tt import TTEmbeddingBag

__all__ = [
    "Adagrad",
    "AdagradState",
    "Adam",
    "AdamState",
    "Lamb",
    "PartialRowwiseAdam",
    "PartialRowwiseLamb",
    "RowwiseAdagrad",
    "RowwiseAdagradState",
    "SGD",
    "SGDState",
    "ShardedTTEmbeddingBag",
    "TTEmbeddingBag",
    "TTSpec",
    "shard",
    "suggested_tt_shapes",
]
