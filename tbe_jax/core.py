"""The sparse-core interface: what the training step, the layers and the sharded wrappers call on an embedding.

A *sparse core* is an immutable, hashable object (a static argument of `jit`) that owns the layout of its
parameters and looks them up. Four classes implement it: `tbe_jax.TableBatchedEmbedding`,
`tt_jax.TTEmbeddingBag` and their sharded forms (`tbe_jax.ShardedTableBatchedEmbedding`,
`tt_jax.ShardedTTEmbeddingBag`). `tbe_jax.train_step`, the Linen / NNX / Haiku layers of both packages
(`tbe_jax.layers_common`) and the sharded wrappers use nothing else of a core:

- `core(params, indices, offsets, per_sample_weights=None, **options)`: the lookup (differentiable with
  respect to `params` and `per_sample_weights`);
- `init(key)`: fresh parameters (a TT core takes its initializer and scale after the key);
- `init_opt_state(params, opt)`: the optimizer state of `opt` for `params`;
- `apply_gradients(params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None)`: one fused
  optimizer step given the gradient of the loss with respect to the lookup's output: `(params, opt_state)`;
- `step_forward(params, indices, offsets, per_sample_weights=None, **options) -> (out, residuals)` and
  `step_update(params, opt_state, opt, residuals, grad_output) -> (params, opt_state, invalid_indices)`: the two
  halves of `apply_gradients` around the loss's gradient, as a training step runs them (the residuals carry what
  the forward already computed, e.g. its sorted ids, so the update does not redo it; `invalid_indices` is the
  forward's count of skipped ids, an int32 device scalar);
- `check_params(params)`: raise unless `params` have this core's structure, shapes and dtypes (static: free
  under `jit`);
- `check_optimizer(opt)`: raise unless this core can apply `opt` (`TypeError` for something that is not an
  optimizer of `tbe_jax.optim`, `ValueError` for one its layout cannot apply);
- `uses_kernel()`: whether the lookups run the Pallas kernels (False: the XLA reference path).

An unsharded core is also a `ShardableCore`: `core.shard(mesh, axis_name, plan, *, capacity=None)` gives its
sharded form (`tbe_jax.shard`, `tt_jax.shard`), which is how the layers shard a core of either package without
knowing which one it is. A sharded core has `mesh` and `num_devices` attributes and takes per-device inputs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

__all__ = ["ShardableCore", "SparseCore", "is_sharded"]


@runtime_checkable
class SparseCore(Protocol):
    """An embedding that `tbe_jax.train_step` and the layers can train (see the module doc)."""

    def __call__(self, params, indices, offsets, per_sample_weights=None, **options) -> jax.Array: ...

    def init(self, key: jax.Array, *args) -> Any: ...

    def init_opt_state(self, params, opt) -> Any: ...

    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output,
                        per_sample_weights=None) -> tuple[Any, Any]: ...

    def step_forward(self, params, indices, offsets, per_sample_weights=None,
                     **options) -> tuple[jax.Array, Any]: ...

    def step_update(self, params, opt_state, opt, residuals, grad_output) -> tuple[Any, Any, jax.Array]: ...

    def check_params(self, params) -> None: ...

    def check_optimizer(self, opt) -> None: ...

    def uses_kernel(self) -> bool: ...


@runtime_checkable
class ShardableCore(SparseCore, Protocol):
    """An unsharded core, which can spread its tables over a mesh axis."""

    def shard(self, mesh: jax.sharding.Mesh, axis_name: str = "data", plan=None, *,
              capacity=None) -> SparseCore: ...


def is_sharded(core) -> bool:
    """A core spread over a mesh (`tbe_jax.shard`'s or `tt_jax.shard`'s object): per-device inputs."""
    return getattr(core, "mesh", None) is not None and hasattr(core, "num_devices")
