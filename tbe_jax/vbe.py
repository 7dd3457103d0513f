"""Variable batch size per feature with the sizes as device values (traced under `jit`).

`TableBatchedEmbedding` takes `batch_size_per_feature` in two forms:

- a static tuple of ints `(B_0, ..., B_{F-1})`: `offsets` has `sum B_f + 1`
  entries and the output is flat (feature f's `[B_f, D_f]` block row-major).
  Every new tuple is a new shape: a new compilation.
- `VariableBatchSizes(sizes, max_batch_size)` (or `batch_size_per_feature=sizes,
  max_batch_size=M` on every call): `sizes` is an int array `[F]`, traced under
  `jit`, `M` a static bound. `offsets` keeps one static length `L` (any `L >=
  sum B_f + 1`; feature f's bags are `offsets[s_f : s_f + B_f + 1]` with `s_f =
  B_0 + ... + B_{f-1}`, entries past `sum B_f` are ignored) and the output is
  `[M, sum D]` as in the fixed-batch form: feature f's columns hold its `B_f`
  pooled rows, then zeros. A pipeline whose sizes change from batch to batch
  compiles once.

The second form is carried out by rewriting `offsets` into the fixed-batch form of
batch `M` (bag `b >= B_f` of feature f becomes an empty bag): `F * M + 1` int32
gathered on the device, then the usual kernels. Its cost over the static form is
the output of `M * sum D` values instead of `sum B_f * D_f` (the empty bags are
written as zeros, and their gradients read and dropped) and `F * M` programs'
bookkeeping. Sizes outside `[0, M]`, or summing past `L - 1`, are clamped (the
last features lose bags); `bounds_check="warning"` counts each clamped size as a
repaired offset and `"fatal"` raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_pytree_node_class
class VariableBatchSizes:
    """Per-feature batch sizes as a device array (`sizes`, `[F]` int) under a static `max_batch_size`."""

    def __init__(self, sizes, max_batch_size: int):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, (int, np.integer)) \
                or max_batch_size < 0:
            raise ValueError(f"max_batch_size must be a static int >= 0, got {max_batch_size!r}")
        self.sizes = sizes
        self.max_batch_size = int(max_batch_size)

    def tree_flatten(self):
        return (self.sizes,), self.max_batch_size

    @classmethod
    def tree_unflatten(cls, max_batch_size, children):
        obj = object.__new__(cls)
        obj.sizes, obj.max_batch_size = children[0], max_batch_size
        return obj

    def __repr__(self):
        return f"VariableBatchSizes(sizes={self.sizes!r}, max_batch_size={self.max_batch_size})"


def resolve(batch_size_per_feature, max_batch_size):
    """The one object the embedding passes around: None, a static tuple, or `VariableBatchSizes`."""
    if max_batch_size is not None:
        if isinstance(batch_size_per_feature, VariableBatchSizes):
            raise ValueError("pass max_batch_size either in VariableBatchSizes or as a keyword, not both")
        if batch_size_per_feature is None:
            raise ValueError("max_batch_size needs batch_size_per_feature (the per-feature sizes, an int array)")
        return VariableBatchSizes(batch_size_per_feature, max_batch_size)
    if batch_size_per_feature is None or isinstance(batch_size_per_feature, VariableBatchSizes):
        return batch_size_per_feature
    if isinstance(batch_size_per_feature, jax.core.Tracer):
        raise ValueError(
            "batch_size_per_feature is traced: pass max_batch_size=M (a static bound on every size) as well; "
            "the output is then [M, sum D] with each feature's rows past its size zero")
    return batch_size_per_feature


def check_sizes(vb: VariableBatchSizes, num_features: int):
    sizes = jnp.asarray(vb.sizes)
    if sizes.shape != (num_features,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(
            f"VariableBatchSizes.sizes must be an int array of shape ({num_features},) (one size per feature), "
            f"got {sizes.dtype}{list(sizes.shape)}")
    return sizes


def expand_offsets(offsets: jax.Array, sizes: jax.Array, max_batch: int):
    """`(offsets in the fixed-batch form of batch max_batch, number of clamped sizes)`.

    `offsets`: `[L]`, feature f's bags at `[s_f, s_f + B_f]`; returns `[F * max_batch + 1]`
    where bag `b` of feature `f` is entry `f * max_batch + b`, empty for `b >= B_f`.
    """
    last = offsets.shape[0] - 1
    s = sizes.astype(jnp.int32)
    sc = jnp.clip(s, 0, max_batch)
    start = jnp.cumsum(sc) - sc
    sc = jnp.clip(sc, 0, jnp.maximum(last - start, 0))  # bags that do not fit in offsets are dropped
    start = jnp.cumsum(sc) - sc
    b = jnp.arange(max_batch, dtype=jnp.int32)
    pos = start[:, None] + jnp.minimum(b[None, :], sc[:, None])  # <= last
    expanded = jnp.concatenate([offsets[pos.reshape(-1)], offsets[jnp.sum(sc)][None]])
    return expanded, jnp.sum(sc != s).astype(jnp.int32)
