"""Checks of the lookup inputs (ids, offsets, static batch sizes) shared by `TableBatchedEmbedding` and
`tbe_jax.sharding`: static (shapes, dtypes, Python values), except `check_host_ids` on NumPy arrays of an eager call."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np


def as_array(name: str, x) -> jax.Array:
    """`x` as a JAX array (None refused by name; NumPy int64 ids checked by `check_host_ids`)."""
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    check_host_ids(name, x)
    return jnp.asarray(x)


def check_host_ids(name: str, x) -> None:
    """NumPy 64-bit ids with jax x64 off: `jnp.asarray` would wrap a value past int32 into a valid-looking
    one (2**32 + 3 -> 3) before any bounds check sees it. Checked on the host, where the array already is
    (eager calls only: under jit the conversion happened at the jit boundary)."""
    if not (isinstance(x, np.ndarray) and x.dtype.kind in "iu" and x.dtype.itemsize == 8 and x.size):
        return
    if jax.dtypes.canonicalize_dtype(x.dtype).itemsize == 8:  # x64 on: kept as int64, checked later
        return
    lo, hi = int(x.min()), int(x.max())
    if lo < -(2**31) or hi >= 2**31:
        bad = lo if lo < -(2**31) else hi
        raise ValueError(
            f"{name} holds {bad}, outside int32, and jax_enable_x64 is off: JAX would wrap it into int32 "
            "(possibly onto a valid id). Enable x64 (jax.config.update('jax_enable_x64', True)) to pass int64 "
            "ids, or map them into int32 first")


def id_array(name: str, x) -> jax.Array:
    """`indices` / `offsets` checked (1-D, integer) and in a dtype the paths handle (`widen_ids`)."""
    if getattr(x, "ndim", None) != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers (int32, or int64 with x64), got {x.dtype}")
    return widen_ids(name, x)


def widen_ids(name: str, x) -> jax.Array:
    """Integer `indices` / `offsets` (`name`) in a dtype the paths handle: integer types narrower than 32 bits
    are widened to int32 (exact); unsigned 32/64-bit ids are refused (they have no -1, and a narrowing to int32
    would wrap them). Shared with `tbe_jax.sharding`."""
    if jnp.dtype(x.dtype).itemsize < 4:
        return x.astype(jnp.int32)
    if name == "indices" and jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        raise TypeError(f"indices must be a signed integer type (int32, or int64 with x64), got {x.dtype}: "
                        "cast ids that fit into int32 with .astype(int32)")
    return x


def static_sizes(batch_size_per_feature) -> tuple[int, ...]:
    """A static `batch_size_per_feature` as a tuple of Python ints (no silent truncation of floats)."""
    if isinstance(batch_size_per_feature, (str, bytes, Mapping)) or not hasattr(batch_size_per_feature, "__iter__"):
        raise TypeError(
            "batch_size_per_feature must be a sequence of ints (one batch size per feature), or an int array "
            f"with max_batch_size=M; got {batch_size_per_feature!r}")
    out = []
    for b in batch_size_per_feature:
        if isinstance(b, jax.core.Tracer):
            raise ValueError("batch_size_per_feature holds traced values: pass them as an int array with "
                             "max_batch_size=M (a static bound on every size)")
        kind = np.dtype(b.dtype).kind if hasattr(b, "dtype") else None
        if isinstance(b, bool) or kind not in (None, "i", "u"):
            raise TypeError(f"batch_size_per_feature must hold ints, got {b!r} in {tuple(batch_size_per_feature)!r}")
        try:
            out.append(operator.index(b))
        except TypeError:
            raise TypeError(
                f"batch_size_per_feature must hold ints, got {b!r} in {tuple(batch_size_per_feature)!r}") from None
    return tuple(out)
