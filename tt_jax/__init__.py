"""tt_jax: tensor-train compressed embedding tables (FlowTT-style).

Today: the specs, initialisation, core access, the materialised table and the
pure-jnp pooled lookup (`impl="xla"`). The fused prefix-sharing Pallas kernel,
its preprocessing and the training path are not written yet.
"""

from tt_jax.specs import TTSpec, suggested_tt_shapes
from tt_jax.tt import TTEmbeddingBag

__all__ = ["TTEmbeddingBag", "TTSpec", "suggested_tt_shapes"]
