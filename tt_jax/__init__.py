"""tt_jax: tensor-train compressed embedding tables (FlowTT-style kernels).

Not implemented yet: this package is a placeholder so the distribution's layout
is final. See the project's issues for the planned `TTEmbeddingBag`.
"""

__all__: list[str] = []
