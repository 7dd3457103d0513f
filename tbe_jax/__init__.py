"""tbe_jax: table-batched embeddings for JAX on NVIDIA GPUs (Pallas-Triton kernels)."""

from tbe_jax import pallas_compat  # noqa: F401  (installs the Triton deprecation filter once)
from tbe_jax.bounds import BoundsReport
from tbe_jax.kernels.backward_config import BackwardConfig
from tbe_jax.kernels.forward_config import ForwardConfig
from tbe_jax.kernels.histogram import HistogramConfig
from tbe_jax.optim import (
    SGD, Adagrad, AdagradState, Adam, AdamState, Lamb, Optimizer, PartialRowwiseAdam,
    PartialRowwiseLamb, RowwiseAdagrad, RowwiseAdagradState, SGDState,
)
from tbe_jax.host_cache import HostCachedEmbedding
from tbe_jax.placement import plan_locations
from tbe_jax.quant import QuantizedTableBatchedEmbedding, quantize
from tbe_jax.sharding import ShardedTableBatchedEmbedding, ShardingPlan, plan_sharding, shard
from tbe_jax.specs import TableSpec, hint_bag_sizes
from tbe_jax.tbe import TableBatchedEmbedding
from tbe_jax.train import SparseLookup, StepReport, TrainStepResult, train_step
from tbe_jax.vbe import VariableBatchSizes

__all__ = [
    "Adagrad", "AdagradState", "Adam", "AdamState", "BackwardConfig", "BoundsReport", "ForwardConfig",
    "HistogramConfig", "HostCachedEmbedding", "Lamb", "Optimizer", "PartialRowwiseAdam", "PartialRowwiseLamb", "QuantizedTableBatchedEmbedding", "RowwiseAdagrad", "RowwiseAdagradState", "SGD", "SGDState", "ShardedTableBatchedEmbedding", "ShardingPlan", "SparseLookup",
    "StepReport", "TableBatchedEmbedding", "TableSpec", "TrainStepResult", "VariableBatchSizes", "plan_locations", "plan_sharding",
    "hint_bag_sizes", "quantize", "shard", "train_step",
]
__version__ = "0.2.0"
