"""tbe_jax: table-batched embeddings for JAX on NVIDIA GPUs (Pallas-Triton kernels)."""

from tbe_jax import _pallas  # noqa: F401  (installs the Triton deprecation filter once)
from tbe_jax.bounds import BoundsReport
from tbe_jax.kernels.backward import BackwardConfig
from tbe_jax.kernels.forward import ForwardConfig
from tbe_jax.kernels.histogram import HistogramConfig
from tbe_jax.optim import (
    SGD, FusedOptimizer, RowwiseAdagrad, RowwiseAdagradState, SGDState, rowwise_adagrad, sgd,
)
from tbe_jax.specs import TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

__all__ = [
    "BackwardConfig", "BoundsReport", "ForwardConfig", "FusedOptimizer", "HistogramConfig", "RowwiseAdagrad",
    "RowwiseAdagradState", "SGD", "SGDState", "TableBatchedEmbedding", "TableSpec", "rowwise_adagrad", "sgd",
]
__version__ = "0.1.0"
