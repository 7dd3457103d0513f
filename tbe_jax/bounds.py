"""Input validation and repair for the four `bounds_check` modes.

- `"ignore"` (the default): ids outside `[0, E_t)` contribute nothing to the
  forward and update nothing in the backward, silently, with identical results on
  every `impl` and device (one compare per id in the kernels; measured on the
  H200 in benchmarks/NOTES.md). Malformed offsets are not repaired (undefined).
- `"none"`: no upper-bound check in the forward kernels: an id >= E_t reads
  another table's row or past the buffer (undefined behaviour, fastest). Negative
  ids, the pruned-row marker -1 included, are still skipped; the backward and the
  XLA path skip every id outside `[0, E_t)` as in `"ignore"`.
- `"warning"`: a small XLA pass repairs `offsets` by clamping (first entry 0,
  non-decreasing, at most `len(indices)`); ids outside `[0, E_t)` contribute
  nothing (-1, a pruned row, is skipped silently and not counted). The counts of
  repaired offsets and invalid ids are reported through `warnings.warn` from a
  `jax.debug.callback` (works under `jit`, no host sync in the step) and can be
  read as device values with `TableBatchedEmbedding.bounds_report(...)` (or the
  `report` of `tbe_jax.train_step`).
- `"fatal"`: a `ValueError` naming the feature, the bag and the bad value. With
  concrete inputs it is raised at once; under `jit` the check is a
  `jax.experimental.checkify.check`, so wrap the jitted function with
  `checkify.checkify` and call `err.throw()` (a plain `jit` refuses to trace it
  and says so).
"""

from __future__ import annotations

import functools
from typing import NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from tbe_jax.reference import bag_feature, position_features
from tbe_jax.specs import FeaturePlan

PRUNED = -1


class BoundsReport(NamedTuple):
    """What `bounds_check="warning"` repaired in one call (device scalars)."""

    invalid_indices: jax.Array  # int32 []: ids outside [0, E) other than -1
    repaired_offsets: jax.Array  # int32 []: entries of offsets changed by clamping


def repair_offsets(offsets: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Clamp offsets to a valid partition of `[0, n)`: returns (repaired, count)."""
    first = jnp.zeros((1,), offsets.dtype)
    fixed = jnp.concatenate([first, jnp.maximum(offsets[1:], 0)])
    # An explicit parallel scan: O(log n) fused steps on every backend.
    fixed = jnp.minimum(jax.lax.associative_scan(jnp.maximum, fixed), n).astype(offsets.dtype)
    return fixed, jnp.sum(fixed != offsets).astype(jnp.int32)


def _invalid_ids(plan: FeaturePlan, indices, offsets):
    n = indices.shape[0]
    _, feat = position_features(plan, offsets, n)
    pos = jnp.arange(n, dtype=offsets.dtype)
    num_rows = jnp.asarray(np.asarray(plan.num_rows), dtype=indices.dtype)[feat]
    in_bag = (pos >= offsets[0]) & (pos < offsets[-1])
    return in_bag & (indices != PRUNED) & ((indices < 0) | (indices >= num_rows))


def report(plan: FeaturePlan, indices, offsets) -> tuple[jax.Array, BoundsReport]:
    """Repair offsets and count what is invalid; returns (offsets, report)."""
    fixed, n_fixed = repair_offsets(offsets, indices.shape[0])
    bad = _invalid_ids(plan, indices, fixed)
    return fixed, BoundsReport(jnp.sum(bad).astype(jnp.int32), n_fixed)


def _warn(invalid_indices, repaired_offsets, *, package="tbe_jax"):
    if int(invalid_indices) or int(repaired_offsets):
        warnings.warn(
            f"{package} bounds_check='warning': {int(invalid_indices)} index(es) outside their "
            f"table were skipped and {int(repaired_offsets)} offsets entr(ies) were clamped",
            RuntimeWarning,
            stacklevel=2,
        )


def warn_if_repaired(rep: BoundsReport, package: str = "tbe_jax") -> None:
    """Warn from the host, only when something was repaired (`package` names the caller in the message).

    The callback sits behind a `lax.cond`, so a clean batch costs a predicate
    read, not a host callback.
    """
    jax.lax.cond(
        (rep.invalid_indices > 0) | (rep.repaired_offsets > 0),
        lambda r: jax.debug.callback(functools.partial(_warn, package=package), r.invalid_indices,
                                     r.repaired_offsets),
        lambda r: None,
        rep,
    )


def _describe_feature(plan: FeaturePlan, f: int, table_labels) -> str:
    return f"feature {f} ({table_labels[plan.table[f]]})"


def _bag_of(plan: FeaturePlan, global_bag: int) -> tuple[int, int]:
    f = int(np.searchsorted(np.asarray(plan.bag_base), global_bag, side="right") - 1)
    return f, global_bag - plan.bag_base[f]


def check_concrete(plan: FeaturePlan, indices: np.ndarray, offsets: np.ndarray, table_labels) -> None:
    """Raise ValueError for the first bad offset or id (inputs on the host)."""
    n = len(indices)
    prev = 0
    for i, o in enumerate(offsets.tolist()):
        bad = (i == 0 and o != 0) or o < prev or o > n
        if bad:
            f, b = _bag_of(plan, min(max(i - 1, 0), plan.num_bags - 1))
            raise ValueError(
                f"bounds_check='fatal': offsets[{i}]={o} is invalid for "
                f"{_describe_feature(plan, f, table_labels)}, bag {b}: offsets must start at 0, "
                f"never decrease, and stay <= len(indices)={n}"
            )
        prev = o
    if n == 0 or plan.num_bags == 0:
        return
    bag = np.clip(np.searchsorted(offsets, np.arange(n), side="right") - 1, 0, plan.num_bags - 1)
    feat = np.searchsorted(np.asarray(plan.bag_base), bag, side="right") - 1
    num_rows = np.asarray(plan.num_rows)[feat]
    in_bag = np.arange(n) < offsets[-1]
    bad = in_bag & (indices != PRUNED) & ((indices < 0) | (indices >= num_rows))
    if bad.any():
        p = int(np.argmax(bad))
        f, b = _bag_of(plan, int(bag[p]))
        raise ValueError(
            f"bounds_check='fatal': {_describe_feature(plan, f, table_labels)}, bag {b}: "
            f"index {int(indices[p])} (indices[{p}]) is outside [0, {plan.num_rows[f]})"
        )


def check_traced(plan: FeaturePlan, indices, offsets) -> None:
    """The same checks as `check_concrete`, as checkify checks (for use under jit)."""
    n = indices.shape[0]
    fixed, n_fixed = repair_offsets(offsets, n)
    first_bad = jnp.argmax(fixed != offsets).astype(jnp.int32)
    gbag = jnp.clip(first_bad - 1, 0, max(plan.num_bags - 1, 0))
    bag_base = jnp.asarray(np.asarray(plan.bag_base, np.int32))
    f = bag_feature(plan, gbag)
    checkify.check(
        n_fixed == 0,
        "bounds_check='fatal': offsets[{i}]={v} is invalid for feature {f}, bag {b}: offsets must "
        "start at 0, never decrease, and stay <= len(indices)",
        i=first_bad, v=offsets[first_bad], f=f, b=gbag - bag_base[f],
    )
    if n == 0 or plan.num_bags == 0:
        return
    bad = _invalid_ids(plan, indices, offsets)
    p = jnp.argmax(bad).astype(jnp.int32)
    bag, feat = position_features(plan, offsets, n)
    num_rows = jnp.asarray(np.asarray(plan.num_rows, np.int32))
    checkify.check(
        ~jnp.any(bad),
        "bounds_check='fatal': feature {f}, bag {b}: index {v} (indices[{p}]) is outside [0, {e})",
        f=feat[p], b=bag[p] - bag_base[feat[p]], v=indices[p], p=p, e=num_rows[feat[p]],
    )
