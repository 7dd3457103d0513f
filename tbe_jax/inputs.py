"""The lookup inputs' pipeline: checks, conversions and the bounds mode's repairs, before any lookup.

Shared by every core (static checks: shapes, dtypes, Python values, except `check_host_ids` on NumPy arrays of
an eager call):

- `as_array`, `id_array`, `widen_ids`: ids and offsets as arrays of a dtype the paths handle;
- `check_weights`: `per_sample_weights` floating point and shaped like the ids;
- `narrow_ids`: int64 ids to int32 without wrapping (an id outside int32 becomes the bad id -2), for
  `TableBatchedEmbedding`, `tbe_jax.sharding` and `tt_jax` alike;
- `static_sizes`: a static `batch_size_per_feature`.

`TableBatchedEmbedding`'s pipeline, in the order a call runs it: `prepare` (the checks above, array batch
sizes expanded by `expand`, the feature plan), then the bounds mode (`check_fatal`, or the "warning" repair),
then `narrow` (the kernels' dtypes); `validated` is the three in a row, for the update.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from tbe_jax import bounds, vbe

_INT32_MAX = 2**31 - 1


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


def narrow_ids(x):
    """int32 ids: an id outside the int32 range becomes -2 (a bad id: skipped, and counted where counts are
    kept), never another row. NumPy arrays stay NumPy (narrowed on the host, exactly); unsigned ids have no
    negative values to refuse."""
    dt = np.dtype(x.dtype)
    if dt == np.int32 or dt.itemsize < 4:
        return x.astype(np.int32)
    xp = np if isinstance(x, np.ndarray) else jnp
    bad = x > _INT32_MAX
    if np.issubdtype(dt, np.signedinteger):
        bad = bad | (x < -1)
    return xp.where(bad, np.int32(-2), x.astype(np.int32))


def check_weights(per_sample_weights, indices) -> None:
    """`per_sample_weights` (an array, or None) floating point and shaped like `indices`."""
    if per_sample_weights is None:
        return
    if not jnp.issubdtype(per_sample_weights.dtype, jnp.floating):
        raise TypeError(f"per_sample_weights must be floating point, got {per_sample_weights.dtype}")
    if per_sample_weights.shape != indices.shape:
        raise ValueError(
            f"per_sample_weights has shape {per_sample_weights.shape}; it must match indices {indices.shape}"
        )


def is_concrete(*xs) -> bool:
    """No tracer among `xs` (an eager call, or one whose values the host can read)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


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


# -- TableBatchedEmbedding's pipeline -------------------------------------------------------------


def expand(emb, offsets, batch_size_per_feature):
    """Array batch sizes: `(offsets in the fixed-batch form, clamped-size count)`; else `(offsets, None)`."""
    if not isinstance(batch_size_per_feature, vbe.VariableBatchSizes):
        return offsets, None
    if emb.pooling == "none":
        raise ValueError("batch_size_per_feature only applies to pooled lookups (pooling='none' has no bags "
                         "to pad)")
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be a 1-D array of at least one entry, got shape {offsets.shape}")
    sizes = vbe.check_sizes(batch_size_per_feature, emb.num_features)
    return vbe.expand_offsets(offsets, sizes, batch_size_per_feature.max_batch_size)


def prepare(emb, params, indices, offsets, per_sample_weights, batch_size_per_feature):
    """`emb`'s argument checks: returns (plan, indices, offsets, per_sample_weights, size_fix) as arrays, ids and
    offsets of narrow integer types widened to int32.

    Array batch sizes are applied here (`offsets` comes back in the fixed-batch
    form); `size_fix` counts the sizes clamped then (None without array sizes).
    """
    indices = as_array("indices", indices)
    offsets = as_array("offsets", offsets)
    if per_sample_weights is not None:
        per_sample_weights = jnp.asarray(per_sample_weights)
    indices, offsets = id_array("indices", indices), id_array("offsets", offsets)
    check_weights(per_sample_weights, indices)
    emb.check_params(params)
    offsets, size_fix = expand(emb, offsets, batch_size_per_feature)
    if size_fix is not None:
        if emb.bounds_check == "fatal":
            _check_sizes_fatal(size_fix)
        batch_size_per_feature = None
    plan = emb.plan_for(offsets.shape[0], batch_size_per_feature)
    if indices.shape[0] >= 2**31:
        raise ValueError(f"len(indices)={indices.shape[0]} must stay below 2**31")
    return plan, indices, offsets, per_sample_weights, size_fix


def _check_sizes_fatal(size_fix):
    msg = ("bounds_check='fatal': batch_size_per_feature holds {n} size(s) outside [0, max_batch_size] or "
           "past the end of offsets")
    if is_concrete(size_fix):
        if int(size_fix):
            raise ValueError(msg.format(n=int(size_fix)))
    else:
        checkify.check(size_fix == 0, msg, n=size_fix)


def check_fatal(emb, plan, indices, offsets):
    """`bounds_check="fatal"`: raises for bad inputs (concrete) or adds checkify checks (traced); returns the
    `offsets` to use."""
    if is_concrete(indices, offsets):
        bounds.check_concrete(plan, np.asarray(indices), np.asarray(offsets),
                              [t.label(i) for i, t in enumerate(emb.tables)])
        return offsets
    return bounds.check_traced(plan, indices, offsets)


def narrow(indices, offsets, per_sample_weights):
    """int32 ids (`narrow_ids`) and offsets, fp32 weights (the kernels' types)."""
    indices = narrow_ids(indices)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.astype(jnp.float32)
    return indices, offsets.astype(jnp.int32), per_sample_weights


def validated(emb, params, indices, offsets, per_sample_weights, batch_size_per_feature):
    """(plan, int32 indices, offsets, fp32 weights) after the bounds mode's checks and repairs."""
    plan, indices, offsets, per_sample_weights, _ = prepare(
        emb, params, indices, offsets, per_sample_weights, batch_size_per_feature)
    if emb.bounds_check == "fatal":
        offsets = check_fatal(emb, plan, indices, offsets)
    elif emb.bounds_check == "warning":
        offsets, _ = bounds.repair_offsets(offsets, indices.shape[0])
    return (plan,) + narrow(indices, offsets, per_sample_weights)


def add_size_fix(report, size_fix):
    """`report` with the clamped batch sizes (`expand`'s count, or None) added to its repaired offsets."""
    if size_fix is None:
        return report
    return bounds.BoundsReport(report.invalid_indices, report.repaired_offsets + size_fix)
