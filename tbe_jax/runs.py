"""Backward preprocessing: invert "which rows did each bag use" into sorted runs.

Jittable with static shapes and no host synchronisation. Every lookup gets a
linear key (the row's index in the concatenation of all storage buffers, taken in
width-class order: see `width_classes`; invalid lookups get the sentinel
`total_rows`), keys are sorted with their positions,
and equal keys form a run: one distinct (table, row) and the lookups that touched
it. Runs fall in three classes (the bounds are `BackwardConfig.small_run_max`, S, and
`BackwardConfig.long_run`, L): small runs (at most S lookups: most
runs, often of length 1) are updated by blocks of consecutive runs in lockstep
(no list: the kernel skips the other runs); mid runs
(S < length < L) one per task; runs of at least L lookups are
split into chunks of L for a two-pass reduction (with `BackwardConfig.split_chunk` C, runs
of 2C to L - 1 lookups too, in chunks of C). All counts stay on the
device; task lists are compacted on the device into statically sized arrays.
The sort is stable, so every run's lookups keep their batch order and the
summation order (hence the result) is the same run to run.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.kernels.backward_config import BackwardConfig, chunk_slots
from tbe_jax.preprocess import lookup_coefficients, output_rows
from tbe_jax.specs import FeaturePlan, StorageLayout, next_pow2


class Runs(NamedTuple):
    """Sorted runs of one batch (device arrays; N = len(indices); S and L: the `BackwardConfig.small_run_max` and
    `long_run` it was built with)."""

    src: jax.Array  # [N] int32: per sorted lookup, flat offset of its bag's output row (column 0)
    scale: jax.Array | None  # [N] f32: per sorted lookup, per-sample weight x 1/len (mean) x valid;
    #                        None when every valid lookup's scale is 1 (unweighted sum pooling or sequence)
    run_start: jax.Array  # [N + 1] int32: first sorted lookup of run r (run r ends at run_start[r+1])
    run_key: jax.Array  # [N] int32: linear row of run r (total_rows past the last run)
    # (with `BackwardConfig.rle_fill` False, run_start past run_start[num_runs], run_key past the runs and the mid
    # and long lists past their counts are undefined: the kernels read below the counts only)
    num_runs: jax.Array  # [] int32
    mid: jax.Array  # [N // (S + 1) + 1] int32: runs of S < length < L, in key order, padded with N
    long: jax.Array  # [N // M + 1] int32: runs of M = `chunked_min` or more (chunked runs), in key order, padded
    # [N // M + 2] int32: first chunk task of each chunked run (the chunk kernel finds each task's long run and
    # first sorted lookup from it: `backward.chunk_task`)
    long_chunk0: jax.Array
    counts: jax.Array  # [4] int32: (small runs, mid runs, long runs, chunk tasks)
    # [len(segment_bounds), 3] int32 or None: per bound, the runs, mid runs and long runs with keys below it
    seg_edges: jax.Array | None = None
    # [len(segment_bounds) + 1, 8] int32 or None: `backward.task_ranges`' table, made with `long_chunk0`
    ranges: jax.Array | None = None


def chunk_length(length, long_run: int, split_chunk: int):
    """The lookups of each chunk of a chunked run of `length` lookups (`BackwardConfig.long_run`, `split_chunk`)."""
    if not split_chunk:
        return long_run
    # int32 operands, not Python ints: Pallas' Triton lowering gave `where(pred, 256, 64)` an i1 result
    return jnp.where(length >= long_run, jnp.int32(long_run), jnp.int32(split_chunk))


def chunk_tasks(run_start, long, long_chunk0, n: int, long_run: int, split_chunk: int = 0):
    """(chunk_run, chunk_first) `[BackwardConfig.max_chunks(n)]`: per chunk task t (below the chunk count
    `long_chunk0[-1]`; the slots past it hold clamped values never read) its index into `long`
    (`searchsorted(long_chunk0, t, "right") - 1`) and its first sorted lookup, in XLA ops. The kernels find
    both themselves (`backward.chunk_task`); this serves `backward.task_ranges` without the run-length pass's edges."""
    max_chunks = chunk_slots(n, long_run, split_chunk)
    n_long_max = long.shape[0]
    t = jnp.arange(max_chunks, dtype=jnp.int32)
    # The long runs whose chunks end at or before t, as a scatter of each run's chunk end and a prefix sum
    # (fixed-size ops, no search loop). The slots past the long runs have no chunk and scatter nothing: they would
    # all add at one index (the chunk total; the whole list on a step without long runs), a chain of atomic adds to
    # one address on a GPU.
    n_chunks = long_chunk0[1:] - long_chunk0[:-1]
    ends = jnp.where(n_chunks > 0, long_chunk0[1:], max_chunks)
    starts = jnp.zeros((max_chunks,), jnp.int32).at[ends].add(1, mode="drop")
    chunk_run = jnp.clip(jnp.cumsum(starts), 0, n_long_max - 1)
    r = jnp.minimum(long[chunk_run], n - 1)
    size = chunk_length(run_start[r + 1] - run_start[r], long_run, split_chunk) if split_chunk else long_run
    chunk_first = run_start[r] + (t - long_chunk0[chunk_run]) * size
    return chunk_run, chunk_first


def row_parity(dim: int) -> int:
    """The largest power of two dividing `dim`, capped at 8: rows of dims with equal parity are equally aligned
    in any weights dtype (fp16 rows are 16-byte multiples at parity 8, fp32 rows at 4 and 8). Each width class's
    buffers are ordered by it (`width_classes`), so the backward serves buffers of one alignment per launch."""
    return min(dim & -dim, 8)


def width_classes(layout: StorageLayout) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The storage buffers grouped by width class `next_pow2(D)`: `((width, buffers), ...)`,
    widths ascending; each class's buffers by `row_parity` of their stored row length (`layout.strides`,
    descending), then in layout order. Buffers in host memory (`layout.locations`) form classes of their own,
    after every device class (a kernel launch never aliases host and device buffers together: XLA refuses to
    return such a launch's device outputs, error E1200).

    The key space concatenates the buffers in this order (`group_bases`), so every
    class's rows, hence its runs and its mid/long task lists, form one contiguous
    range, and so do the rows of its buffers of one parity: the backward serves each
    (class, parity) with one launch per kernel kind.
    """
    out = []
    for loc in ("device", "host"):  # buffers in host memory after the device's: each launch serves one kind
        mine = [g for g in range(len(layout.dims)) if layout.locations[g] == loc]
        for w in sorted({next_pow2(layout.dims[g]) for g in mine}):
            out.append((w, tuple(sorted((g for g in mine if next_pow2(layout.dims[g]) == w),
                                        key=lambda g: -row_parity(layout.strides[g])))))
    return tuple(out)


def group_bases(layout: StorageLayout) -> np.ndarray:
    """First linear key of each storage buffer (indexed by buffer, as `layout.dims`), and the
    total (sentinel) last. The buffers are laid out in `width_classes` order, so these bases
    ascend in buffer order only within a class."""
    bases = np.zeros(len(layout.dims) + 1, np.int64)
    total = 0
    for _, buffers in width_classes(layout):
        for g in buffers:
            bases[g] = total
            total += layout.group_rows[g]
    bases[-1] = total
    return bases


def class_bases(layout: StorageLayout) -> np.ndarray:
    """First linear key of each width class (`width_classes` order), and the total last."""
    bases = group_bases(layout)
    return np.asarray([bases[buffers[0]] for _, buffers in width_classes(layout)] + [bases[-1]], np.int64)


def compact_indices(mask: jax.Array, size: int, fill: int) -> tuple[jax.Array, jax.Array]:
    """Indices where `mask` holds, in order, padded to `size` with `fill`; and their count."""
    n = mask.shape[0]
    slot = jnp.cumsum(mask.astype(jnp.int32)) - 1
    dest = jnp.where(mask, slot, size)
    out = jnp.full((size,), fill, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return out, jnp.sum(mask.astype(jnp.int32))


def feature_keys(layout: StorageLayout, plan: FeaturePlan) -> np.ndarray:
    """Per feature, the linear key of its table's row 0."""
    bases = group_bases(layout)
    return np.asarray([bases[plan.group[f]] + plan.row_offset[f] for f in range(plan.num_features)], np.int64)


def without_features(plan: FeaturePlan, features) -> FeaturePlan:
    """`plan` with no valid lookup in `features` (their tables seen as empty).

    Their lookups get the sentinel key, sort to the end and form no runs: how the
    histogram features (whose tables the histogram backward updates) are kept out
    of the sorted-run backward.
    """
    drop = set(features)
    return dataclasses.replace(
        plan, num_rows=tuple(0 if f in drop else r for f, r in enumerate(plan.num_rows)))


def lookup_keys(layout: StorageLayout, plan: FeaturePlan, indices, offsets, per_sample_weights, *, pooling: str,
                sequence: bool = False, kernel: bool = False, interpret: bool = False, want_scale: bool = True,
                key_dtype=jnp.int32, config: BackwardConfig | None = None):
    """Per lookup: (linear key or `total` if invalid, flat offset of its output row, scale); jnp.

    `kernel`: computed by the one Pallas pass of `kernels.keys` (same values; blocks of `config.keys_block`
    lookups, None: the default config's); its scale is None unless `want_scale`. `key_dtype`: the keys' dtype
    (`sort_key_dtype`)."""
    n = indices.shape[0]
    total = int(group_bases(layout)[-1])
    if kernel:
        from tbe_jax.kernels import keys as keys_kernel

        table = np.stack([feature_keys(layout, plan), np.asarray(plan.num_rows), np.asarray(plan.out_base),
                          np.asarray(plan.out_stride), np.asarray(plan.bag_base)])
        if table.size and (table.max() >= 2**31 or table.min() < 0):
            raise ValueError("lookup_keys: per-feature keys and offsets must fit in int32")
        one_batch = len(set(plan.batch)) == 1 and plan.batch[0] > 0
        return keys_kernel.lookup_keys(
            table, np.asarray(plan.bag_base), indices, offsets, per_sample_weights,
            batch=plan.batch[0] if one_batch else 0, total=total, sequence_stride=layout.dims[0] if sequence else 0,
            mean=pooling == "mean", want_scale=want_scale, interpret=interpret, key_dtype=key_dtype,
            block=(config or BackwardConfig()).keys_block)
    bag, feat, coef, scale = lookup_coefficients(plan, indices, offsets, per_sample_weights, pooling)
    valid = coef > 0  # coef is 1 or 1/len(bag) for valid lookups, 0 otherwise
    key = jnp.where(valid, jnp.asarray(feature_keys(layout, plan).astype(np.int32))[feat] + indices, total)
    key = key.astype(key_dtype)
    src = jnp.arange(n, dtype=jnp.int32) * layout.dims[0] if sequence else output_rows(plan, bag, feat)
    return key, src, scale


def sort_key_dtype(total: int):
    """The narrowest unsigned dtype holding every key `0..total` (`total` marks invalid lookups), int32 past
    uint16: XLA's radix sort makes one pass per key byte."""
    if total <= np.iinfo(np.uint8).max:
        return jnp.uint8
    if total <= np.iinfo(np.uint16).max:
        return jnp.uint16
    return jnp.int32


def build_runs(
    layout: StorageLayout, plan: FeaturePlan, indices, offsets, per_sample_weights, *, pooling: str,
    config: BackwardConfig, sequence: bool = False, interpret: bool = False, segment_bounds: tuple[int, ...] = (),
) -> Runs:
    """Sort the batch's lookups into runs (see module doc). Inputs validated, int32.

    From `config`: `rle_kernel`: find the runs and the mid and long run lists with the two Pallas passes of
    `kernels.rle` instead of XLA ops (same result); batches of at most `rank_sort_limit(interpret)` lookups are
    sorted by the counting-rank kernels (`kernels.ranksort`), others by XLA's sort; with `narrow_sort_keys` XLA's
    sort takes the keys in the narrowest dtype that holds them (`sort_key_dtype`), which the run-length kernels
    read as they are (the XLA ops widen them to int32 first); `small_run_max` and `chunked_min` (`long_run`, or
    twice `split_chunk`) bound the run classes; the preprocessing kernels' block sizes.
    `segment_bounds` (static keys, ascending): with the kernels, the runs' `seg_edges` counts the runs below each
    (`rle.encode(bounds=...)`).
    """
    n = indices.shape[0]
    bases = group_bases(layout)
    total = int(bases[-1])
    if total >= 2**31 - 1:
        raise ValueError(f"{total} rows in all tables: the int32 sort key needs fewer than 2**31 - 1")
    unit = per_sample_weights is None and (sequence or pooling == "sum")
    # The Pallas pass where the kernels are compiled; in interpret mode XLA's ops (the same values): the interpreted
    # pass would add CPU compile time to every backward test, and `test_lookup_keys_kernel` runs it there.
    small, chunked, rle_kernel = config.small_run_max, config.chunked_min, config.rle_kernel
    rank = 0 < n <= config.rank_sort_limit(interpret)
    key_dtype = sort_key_dtype(total) if config.narrow_sort_keys and not rank else jnp.int32
    key, src, scale = lookup_keys(layout, plan, indices, offsets, per_sample_weights, pooling=pooling,
                                  sequence=sequence, kernel=rle_kernel and not interpret,
                                  interpret=interpret, want_scale=not unit, key_dtype=key_dtype, config=config)
    if rank:  # one launch, payloads scattered to their places (no gathers)
        from tbe_jax.kernels.ranksort import rank_sort

        skey, ssrc, *rest = rank_sort(key, src, *(() if unit else (scale,)), interpret=interpret,
                                      block_i=config.rank_sort_block_i, block_j=config.rank_sort_block_j,
                                      chunk=config.rank_sort_chunk, merge_block=config.rank_sort_merge_block,
                                      wide_block=config.rank_sort_wide_block,
                                      wide_tile=config.rank_sort_wide_tile)
        sscale = rest[0] if rest else None
    elif unit:
        # No scale to carry: sort the output offsets themselves (the stable sort keeps
        # batch order within a run), saving the gather `src[sorted positions]`.
        skey, ssrc = jax.lax.sort((key, src), num_keys=1, is_stable=True)
        sscale = None
    else:
        skey, spos = jax.lax.sort((key, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
        ssrc, sscale = src[spos], scale[spos]
    if not rle_kernel:  # the kernels read narrow keys as they are (no widening pass over N)
        skey = skey.astype(jnp.int32)
    # Small runs need no list: the small-run kernel walks all runs in blocks and
    # skips the others. Only runs longer than `small` (at most n / (small + 1)) are
    # compacted over n; the mid/long split then works on that short list.
    n_big_max = n // (small + 1) + 1
    n_long_max = n // chunked + 1
    from tbe_jax.kernels import rle

    seg_edges = None
    if rle_kernel:  # the mid and long lists (and the segments' edges) straight from the kernel's write pass
        bounds = tuple(segment_bounds)
        run_start, run_key, num_runs, n_valid, mid, n_mid, long, n_long, *edges = rle.encode(
            skey, total=total, small=small, n_big_max=n_big_max, long=chunked, n_long_max=n_long_max,
            bounds=bounds, block=config.rle_block, scan_chunk=config.scan_chunk, fill=config.rle_fill,
            interpret=interpret)
        seg_edges = edges[0].reshape(len(bounds), 3) if bounds else None
    else:
        is_start = jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]]) & (skey < total)
        starts, num_runs = compact_indices(is_start, n, n)
        n_valid = jnp.sum((skey < total).astype(jnp.int32))
        run_start = jnp.concatenate([starts, jnp.full((1,), n, jnp.int32)])
        run_start = jnp.where(jnp.arange(n + 1) < num_runs, run_start, n_valid)
        run_len = run_start[1:] - run_start[:-1]
        run_key = jnp.where(jnp.arange(n) < num_runs, skey[jnp.minimum(run_start[:-1], n - 1)], total)
        live = jnp.arange(n) < num_runs
        big, n_big = compact_indices(live & (run_len > small), n_big_max, n)
        big_len = jnp.where(jnp.arange(n_big_max) < n_big, run_len[jnp.minimum(big, n - 1)], 0)
        mid_at, n_mid = compact_indices((big_len > small) & (big_len < chunked), n_big_max, n_big_max - 1)
        mid = jnp.where(jnp.arange(n_big_max) < n_mid, big[mid_at], n)
        long_at, n_long = compact_indices(big_len >= chunked, n_long_max, n_big_max - 1)
        long = jnp.where(jnp.arange(n_long_max) < n_long, big[long_at], n)
    # Each long run's first chunk task and the counts: one program after the run-length kernels (their XLA ops
    # otherwise: the same integers)
    long_chunk0, counts, ranges = rle.long_chunks(
        run_start, long, num_runs, n_mid, n_long, None if seg_edges is None else seg_edges.reshape(-1),
        long_run=config.long_run, split_chunk=config.mid_chunk, chunk=config.scan_chunk, interpret=interpret,
        kernel=None if rle_kernel else False)
    if not rle_kernel and segment_bounds:  # no edges without the run-length kernels: `task_ranges` counts them
        ranges = None
    return Runs(ssrc, sscale, run_start, run_key, num_runs, mid, long, long_chunk0, counts, seg_edges, ranges)
