"""Input validation and repair for the four `bounds_check` modes.

In every mode the kernels read only ids inside `indices` (each bag's extent is
clamped to `[0, len(indices))` where it is loaded), whatever `offsets` holds.

- `"ignore"` (the default): ids outside `[0, E_t)` contribute nothing to the
  forward and update nothing in the backward, silently, with identical results
  on every `impl` and device. `offsets` is not repaired: offsets that never
  decrease but start past 0 or end past `len(indices)` give the same clamped
  bags on every impl, lookup and update (ids outside `[offsets[0],
  min(offsets[-1], N))` belong to no bag); offsets that decrease give
  undefined bags (memory-safe). Both kinds are counted in the call's report
  (`forward_with_report`, `bounds_report`, `train_step`'s `StepReport`): the
  pooled kernels count them as they load them, at no extra pass.
- `"none"`: no upper-bound check in the forward kernels: an id >= E_t reads
  another table's row or past the buffer (undefined behaviour, fastest).
  Negative ids, the pruned-row marker -1 included, are still skipped; the
  backward and the XLA path skip every id outside `[0, E_t)` as in
  `"ignore"`. Offsets and ids are counted as in `"ignore"`.
- `"warning"`: a small XLA pass repairs `offsets` (first entry 0, clamped to
  `[0, len(indices)]`, then its running maximum: a valid partition; valid
  offsets are unchanged) and ids outside `[0, E_t)` contribute nothing. The
  counts of invalid ids and of repaired offsets entries are reported through
  `warnings.warn` from a `jax.debug.callback` (works under `jit`, no host sync
  in the step: it sits behind a device-side `lax.cond`) and in the report.
- `"fatal"`: a `ValueError` naming the feature, the bag and the bad value. With
  concrete inputs it is raised at once; under `jit` the check is a
  `jax.experimental.checkify.check`, so wrap the jitted function with
  `checkify.checkify` and call `err.throw()` (a plain `jit` fails with a
  message saying so).

`-1` (a pruned row) is skipped silently in every mode and never counted.
"""

from __future__ import annotations

import functools
from typing import NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from tbe_jax.preprocess import bag_feature, in_bags, position_features
from tbe_jax.specs import FeaturePlan

PRUNED = -1


class BoundsReport(NamedTuple):
    """What one call skipped and repaired (device scalars; zeros in "fatal" mode, which raises instead)."""

    invalid_indices: jax.Array  # int32 []: ids outside [0, E) other than -1 (skipped, except in "none" mode)
    # int32 []: "warning": entries of offsets changed by its repair; "ignore"/"none": malformed entries (the first
    # if not 0, any other that decreases or leaves [0, N]), counted, not repaired
    repaired_offsets: jax.Array


def repair_offsets(offsets: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Clamp offsets to a valid partition of `[0, n)`: returns (repaired, count of changed entries).

    First entry 0, every entry clamped to `[0, n]`, then the running maximum (`lax.cummax`: on the H200
    0.005-0.04 ms for 513-2M entries, `benchmarks/results/probe-repair-*`: why only "warning" pays for it).
    """
    if offsets.shape[0] == 0:
        return offsets, jnp.int32(0)
    fixed = jnp.clip(offsets, 0, n).at[0].set(0)
    fixed = jax.lax.cummax(fixed).astype(offsets.dtype)
    return fixed, jnp.sum(fixed != offsets).astype(jnp.int32)


def _invalid_ids(plan: FeaturePlan, indices, offsets):
    n = indices.shape[0]
    _, feat = position_features(plan, offsets, n)
    num_rows = jnp.asarray(np.asarray(plan.num_rows), dtype=indices.dtype)[feat]
    return in_bags(offsets, n) & (indices != PRUNED) & ((indices < 0) | (indices >= num_rows))


def count_malformed(offsets: jax.Array, n: int) -> jax.Array:
    """Entries of `offsets` that are malformed: the first if not 0, any other that decreases or leaves `[0, n]`
    (what the pooled kernels count per bag, `kernels.programs.bag_extent`): an int32 scalar."""
    bad = (offsets[1:] < offsets[:-1]) | (offsets[1:] < 0) | (offsets[1:] > n)
    return (jnp.sum(bad) + (offsets[0] != 0)).astype(jnp.int32)


def count_invalid(plan: FeaturePlan, indices, offsets) -> jax.Array:
    """How many ids inside a bag are outside their table's `[0, E)` (other than -1): an int32 scalar."""
    if indices.shape[0] == 0:
        return jnp.int32(0)
    return jnp.sum(_invalid_ids(plan, indices, offsets)).astype(jnp.int32)


def report(plan: FeaturePlan, indices, offsets) -> tuple[jax.Array, BoundsReport]:
    """Repair offsets and count what is invalid; returns (offsets, report)."""
    fixed, n_fixed = repair_offsets(offsets, indices.shape[0])
    return fixed, BoundsReport(count_invalid(plan, indices, fixed), n_fixed)


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


# -- "fatal" under a trace -------------------------------------------------------------------------------------
# checkify's checks cannot be lowered unless `checkify.checkify` functionalized them first, and JAX's own error
# then ("Cannot abstractly evaluate a checkify.check which was not functionalized") names neither this library nor
# the way out. `check_traced` passes `offsets` through an identity primitive whose checkify rule is the identity
# (checkify removes it along with the checks) and whose lowering raises the error below: a plain `jit` of a
# fatal-mode call fails with it, before JAX's. Registered through jax internals (`jax._src.checkify`), present
# from jax 0.10.2 to 0.12.
FATAL_UNDER_JIT = (
    "bounds_check='fatal' under jax.jit checks on the device with jax.experimental.checkify: wrap the jitted "
    "function, jax.jit(checkify.checkify(f)) (or checkify.checkify(jax.jit(f))), and call err.throw() on the "
    "error it returns; or use bounds_check='warning' (ids skipped and offsets repaired, counted and warned) or "
    "the default 'ignore' with forward_with_report / train_step's report (counted on the device)")


def _make_guard():
    from jax._src import checkify as checkify_internal
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive("tbe_jax_fatal_guard")
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda x: x)

    def lowering(ctx, x):
        raise ValueError(FATAL_UNDER_JIT)

    mlir.register_lowering(prim, lowering)
    batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), dims[0])
    ad.primitive_jvps[prim] = lambda primals, tangents: (prim.bind(*primals), tangents[0])

    def check_rule(*args, **params):  # (error, enabled_errors, x) in jax 0.10; 0.11 passes one more argument
        error = next(a for a in args if isinstance(a, checkify_internal.Error))
        return error, args[-1]

    checkify_internal.error_checks[prim] = check_rule
    return prim


_GUARD = _make_guard()


def check_traced(plan: FeaturePlan, indices, offsets):
    """The same checks as `check_concrete`, as checkify checks (for use under jit); returns `offsets` (use it:
    under a plain `jit` its lowering raises `FATAL_UNDER_JIT`)."""
    offsets = _GUARD.bind(offsets)
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
        return offsets
    bad = _invalid_ids(plan, indices, offsets)
    p = jnp.argmax(bad).astype(jnp.int32)
    bag, feat = position_features(plan, offsets, n)
    num_rows = jnp.asarray(np.asarray(plan.num_rows, np.int32))
    checkify.check(
        ~jnp.any(bad),
        "bounds_check='fatal': feature {f}, bag {b}: index {v} (indices[{p}]) is outside [0, {e})",
        f=feat[p], b=bag[p] - bag_base[feat[p]], v=indices[p], p=p, e=num_rows[feat[p]],
    )
    return offsets
