"""tt_jax: tensor-train compressed embedding tables (FlowTT-style).

- `TTSpec`, `TTEmbeddingBag`: specs, initialisation, core access, the materialised table and pooled
  lookups in tbe_jax's input format (`impl="xla"`: the pure-jnp per-index chain; `impl="pallas"`: the
  fused FlowTT forward, `tt_jax.kernels.forward`, on the prefix plan of `tt_jax.prefix.build_flow`).
- Training: exact core gradients under `jax.grad` from a prefix-sharing backward that reuses the
  forward's plan (`tt_jax.backward`, XLA); optimizers on the touched core slices (`SGD`, `Adagrad`,
  `RowwiseAdagrad`, via `TTEmbeddingBag.apply_gradients`) and their fused forms (`sgd`, `adagrad`,
  `rowwise_adagrad`, via `TTEmbeddingBag.fused_lookup`); see `tt_jax.optim`. The backward has no
  Pallas kernel yet.
"""

from tt_jax.optim import (
    SGD,
    Adagrad,
    AdagradState,
    FusedOptimizer,
    RowwiseAdagrad,
    RowwiseAdagradState,
    SGDState,
    adagrad,
    rowwise_adagrad,
    sgd,
)
from tt_jax.specs import TTSpec, suggested_tt_shapes
from tt_jax.tt import TTEmbeddingBag

__all__ = [
    "Adagrad",
    "AdagradState",
    "FusedOptimizer",
    "RowwiseAdagrad",
    "RowwiseAdagradState",
    "SGD",
    "SGDState",
    "TTEmbeddingBag",
    "TTSpec",
    "adagrad",
    "rowwise_adagrad",
    "sgd",
    "suggested_tt_shapes",
]
