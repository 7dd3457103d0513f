"""Launch planning of the sorted-run backward: segments of storage buffers and their task ranges.

A width class `next_pow2(D)` (`runs.width_classes`) is split by row alignment (`runs.row_parity`) and into
segments of at most `BackwardConfig.segment_buffers` buffers; each segment is one branch of each backward kernel
(`RunSegment`). `task_ranges` gives every segment its range of the run list and of the mid, chunk and long task
lists; `small_launches` groups the segments into small-run launches (`BackwardConfig.merge_width`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pl
from tbe_jax.kernels import rle
from tbe_jax.kernels.backward_config import BackwardConfig
from tbe_jax.runs import Runs, chunk_tasks, group_bases, row_parity, width_classes
from tbe_jax.specs import StorageLayout

# The measurements behind `BackwardConfig.segment_buffers`, the several-buffer block rule (`multi_block`),
# `merge_width` and `narrow_block`: benchmarks/NOTES.md, "Design notes moved from the kernel docstrings".


@dataclasses.dataclass(frozen=True)
class RunSegment:
    """Storage buffers of one width class `next_pow2(D)` (at most `BackwardConfig.segment_buffers`) that one
    branch of each backward kernel serves.

    The buffers' rows are one contiguous key range (`runs.width_classes` orders the key space
    class by class), so the segment's runs and its mid/chunk/long tasks are contiguous too (row
    `index` of `task_ranges`), and segments follow each other in key order. The branch gathers
    every run's gradient with one code path, `width` columns wide and masked to the run's dim
    (a runtime value when the segment holds several dims), and branches per buffer only for the
    row update (its weights' row stride is a compile-time constant).
    """

    index: int  # row of the task-range table; segments are in key order
    width: int  # the tile width: next_pow2 of each of its dims
    buffers: tuple[int, ...]  # storage buffers (layout indices), in key order
    dims: tuple[int, ...]  # their embedding dims (distinct)
    bases: tuple[int, ...]  # their first keys (ascending)
    ends: tuple[int, ...]  # one past their last keys
    strides: tuple[int, ...]  # their stored row lengths (`StorageLayout.strides`)
    location: str = "device"  # where its buffers live (`StorageLayout.locations`): one kind per segment

    @property
    def single(self) -> bool:
        return len(self.buffers) == 1

    def dim_of(self, key):
        """Embedding dim of the rows with keys `key` (int32 scalar or vector); a Python int if the segment
        has one buffer (the gather masks then compile to constants, as a one-dim model's)."""
        if self.single:
            return self.dims[0]
        dim = jnp.full(key.shape, self.dims[0], jnp.int32)
        for base, d in zip(self.bases[1:], self.dims[1:]):
            dim = jnp.where(key >= base, d, dim)
        return dim

    def holds(self, i, key):
        """Whether `key` is a row of the segment's buffer `i` (for keys of this segment)."""
        return (key >= self.bases[i]) & (key < self.ends[i])

    def per_buffer(self, key, body):
        """`body(i)` in the branch of the buffer `i` holding `key` (a scalar key of this segment)."""
        if self.single:
            body(0)
            return
        for i in range(len(self.buffers)):
            pl.when(self.holds(i, key))(functools.partial(body, i))


def small_launches(segs, merge_width: int) -> list[tuple[RunSegment, ...]]:
    """The segments (ascending width) grouped by small-run launch: each segment of width `merge_width` or less
    joins the launch of the segment before it, if that one's buffers live in the same memory."""
    groups = []
    for seg in segs:
        if groups and seg.width <= merge_width and groups[-1][-1].location == seg.location:
            groups[-1] += (seg,)
        else:
            groups.append((seg,))
    return groups


def multi_block(seg: RunSegment) -> int:
    """Runs per small-run block of a segment with several buffers: about 1024 gradient elements (measured: the
    benchmarks/NOTES.md)."""
    return min(16, max(4, 1024 // seg.width))


def run_segments(layout: StorageLayout, config: BackwardConfig) -> list[RunSegment]:
    """The width classes (`runs.width_classes`, in key order), each split by `runs.row_parity` (buffers whose
    rows are equally aligned), then into segments of at most `config.segment_buffers` buffers.

    One segment per parity: a segment mixing 16-byte-multiple rows with others (fp16 dims 4 mod 8) was slower
    than either kind alone (benchmarks/NOTES.md).
    """
    bases = group_bases(layout)
    segs = []
    for w, gs in width_classes(layout):
        by_parity = {}
        for g in gs:  # width_classes keeps each parity's buffers contiguous
            by_parity.setdefault(row_parity(layout.strides[g]), []).append(g)
        for same in by_parity.values():
            step = config.segment_buffers
            for i in range(0, len(same), step):
                part = tuple(same[i:i + step])
                segs.append(RunSegment(len(segs), w, part, tuple(layout.dims[g] for g in part),
                                     tuple(int(bases[g]) for g in part),
                                     tuple(int(bases[g]) + layout.group_rows[g] for g in part),
                                     tuple(layout.strides[g] for g in part), layout.locations[part[0]]))
    return segs


def segment_bounds(layout: StorageLayout, config: BackwardConfig) -> tuple[int, ...]:
    """The first keys of the segments after the first (`run_segments` order, ascending): where `task_ranges`
    splits the run and task lists (`runs.build_runs(segment_bounds=...)`)."""
    return tuple(seg.bases[0] for seg in run_segments(layout, config)[1:])


def task_ranges(runs: Runs, layout: StorageLayout, n: int, config: BackwardConfig) -> jax.Array:
    """[num_segments, 8] int32: per segment (`run_segments` order) its [lo, hi) in the runs (small-run
    kernel) and in the mid, chunk and long task lists (`runs` built with `config`)."""
    segs = run_segments(layout, config)
    if runs.ranges is not None and runs.ranges.shape[0] == len(segs):  # made by `runs.build_runs` already
        return runs.ranges
    n_mid, n_long, n_chunks = runs.counts[1], runs.counts[2], runs.counts[3]
    one = len(segs) == 1
    if one or (runs.seg_edges is not None and runs.seg_edges.shape[0] == len(segs) - 1):
        # The counts below each segment's first key, from the run-length pass (one segment: none below it)
        return rle.ranges_from_edges(runs.num_runs, n_mid, n_long, runs.long_chunk0,
                                     None if one else runs.seg_edges.reshape(-1))
    bases = jnp.asarray(np.asarray([seg.bases[0] for seg in segs] + [int(group_bases(layout)[-1])], np.int32))
    total = bases[-1]
    key_of = lambda r: jnp.where(r < n, runs.run_key[jnp.minimum(r, n - 1)], total)  # noqa: E731

    def keys(lst, count):
        return jnp.where(jnp.arange(lst.shape[0]) < count, key_of(lst), total)

    long_keys = keys(runs.long, n_long)
    chunk_run = chunk_tasks(runs.run_start, runs.long, runs.long_chunk0, n, config.long_run,
                            config.mid_chunk)[0]
    chunk_keys = jnp.where(jnp.arange(chunk_run.shape[0]) < n_chunks, long_keys[chunk_run], total)

    def bounds(keys):  # searchsorted(keys, bases, "left") as one fused compare-and-count pass: no device
        # while loop, and a program whose size does not depend on len(keys)
        edges = jnp.sum(keys[None, :] < bases[:, None], axis=1, dtype=jnp.int32)
        return edges[:-1], edges[1:]

    # Small runs: the range of all runs in the segment (run_key is sorted; past the runs, total: masked here, as
    # the run-length pass leaves those slots undefined without `rle_fill`).
    run_keys = jnp.where(jnp.arange(runs.run_key.shape[0]) < runs.num_runs, runs.run_key, total)
    parts = [bounds(run_keys), bounds(keys(runs.mid, n_mid)), bounds(chunk_keys), bounds(long_keys)]
    return jnp.stack([e for lo_hi in parts for e in lo_hi], axis=1)
