"""Which bags a program owns: found on the device, from per-feature facts only.

The bag-parallel kernels (the pooled forward, the histogram forward and its
gradient pass, the backward's per-lookup keys) give each program `bags`
consecutive bags of one feature. Programs are laid out segment by segment (a
segment: a list of features sharing one kernel branch, e.g. one storage buffer),
feature by feature, `ceil(B_f / bags)` programs per feature.

Nothing here grows with the batch: a kernel gets two small int32 operands,
`flist` (per feature of each segment: feature id, first bag in `offsets`, bag
count) and `prefix` (per segment, the running count of programs per feature), and
each program locates itself with `locate`: a division when every feature of the
segment has the same batch size (the usual case), else a binary search over the
segment's prefix (a static number of steps, log2 of its feature count).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import plgpu

FLIST_COLS = 3  # feature, first bag (its entry in offsets), number of bags
# Columns of the per-feature table (`feature_table`) the kernels read a feature's facts from.
NUM_ROWS, ROW_OFFSET, OUT_BASE, OUT_STRIDE = range(4)
META_COLS = 4
DIM = 4  # the table with `dims`: the feature's dim (a kernel branch serving features of several dims)


def feature_table(plan, dims: bool = False) -> np.ndarray:
    """Per feature of a `FeaturePlan`: (E, first row in its buffer, output base, output stride), `[F, 4]` int32;
    with `dims`, its dim too (column `DIM`), `[F, META_COLS + 1]`."""
    cols = [plan.num_rows, plan.row_offset, plan.out_base, plan.out_stride] + ([plan.dim] if dims else [])
    return np.stack(cols, axis=1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Segment:
    prog_start: int
    prog_end: int
    bags: int  # bags per program
    feat_base: int  # first row of the segment in `flist`
    num_feats: int
    ppf: int  # programs per feature if every feature of the segment has one batch size, else 0
    prefix_base: int  # the segment's first entry in `prefix`
    # With `ppf`, when the segment's features are consecutive (feature `feat0 + i`) and so are their bags
    # (feature i's first bag is `base0 + i * batch0`): a program finds its feature and first bag by arithmetic,
    # and its offsets load need not wait for a load of `flist`. Else -1.
    feat0: int = -1
    base0: int = -1
    batch0: int = -1


class ProgramMap(NamedTuple):
    segments: tuple[Segment, ...]
    flist: np.ndarray  # [sum num_feats, FLIST_COLS] int32
    prefix: np.ndarray  # [sum (num_feats + 1)] int32

    @property
    def num_programs(self) -> int:
        return self.segments[-1].prog_end if self.segments else 0


def build(bag_base: Sequence[int], batch: Sequence[int], groups) -> ProgramMap:
    """The map for `groups`: a list of `(features, bags per program)`, one segment each.

    Empty segments (no bags) are dropped.
    """
    segs, flist, prefix = [], [], []
    start = 0
    for feats, bags in groups:
        feats = list(feats)
        counts = [-(-batch[f] // bags) for f in feats]
        n = sum(counts)
        if n == 0:
            continue
        sizes = {batch[f] for f in feats}
        ppf = counts[0] if len(sizes) == 1 else 0
        b = batch[feats[0]]
        affine = ppf and all(f == feats[0] + i and bag_base[f] == bag_base[feats[0]] + i * b
                             for i, f in enumerate(feats))
        arith = (feats[0], bag_base[feats[0]], b) if affine else (-1, -1, -1)
        segs.append(Segment(start, start + n, bags, len(flist), len(feats), ppf, len(prefix), *arith))
        flist += [(f, bag_base[f], batch[f]) for f in feats]
        prefix += np.concatenate([[0], np.cumsum(counts)]).tolist()
        start += n
    flist_arr = np.asarray(flist, np.int32).reshape(-1, FLIST_COLS)
    prefix_arr = np.asarray(prefix or [0], np.int32)
    return ProgramMap(tuple(segs), flist_arr, prefix_arr)


def locate(seg: Segment, q, flist_ref, prefix_ref, live=None):
    """Program `q` of segment `seg` (0-based within it): (feature, first bag in offsets, bags, b0).

    `b0` is the program's first bag within its feature; `bags` counts the bags that
    exist (fewer than `seg.bags` at the end of a feature). Every index is a traced
    int32 (interpret mode rejects Python ints as ref indices). `live`: None, or `(live_ref, take)`: the
    kernel was given a `[F]` 0/1 operand decided on the device, and a feature whose entry is not `take` gets
    no bags (its programs still run, and do nothing: the other kernel owns its output columns).
    """
    if seg.feat0 >= 0:
        # Arithmetic: the map's bag count (no `flist` load: the fp32 preset's forward 0.1176 -> 0.1132 ms on
        # an H100, `benchmarks/results/forward-ab-20261207-s56-NVIDIA_H100.json`); `live`'s entry is loaded in
        # parallel with the offsets loads that follow (`bag_extent` loads without waiting for the count).
        i = q // seg.ppf
        b0 = (q - i * seg.ppf) * seg.bags
        f = seg.feat0 + i
        return f, seg.base0 + i * seg.batch0 + b0, _take(live, f, seg.batch0 - b0, seg.bags), b0
    if seg.ppf:
        i = q // seg.ppf
        within = q - i * seg.ppf
    else:  # the last feature whose first program is <= q
        i = jnp.int32(0)
        step = 1 << max(seg.num_feats - 1, 0).bit_length()
        while step:
            cand = i + step
            ok = cand < seg.num_feats
            first_prog = plgpu.load(prefix_ref.at[seg.prefix_base + jnp.minimum(cand, seg.num_feats)])
            i = jnp.where(ok & (first_prog <= q), cand, i)
            step //= 2
        within = q - plgpu.load(prefix_ref.at[seg.prefix_base + i])
    row = FLIST_COLS * (seg.feat_base + i)
    f = plgpu.load(flist_ref.at[row])
    bag_base = plgpu.load(flist_ref.at[row + 1])
    batch = plgpu.load(flist_ref.at[row + 2])
    b0 = within * seg.bags
    return f, bag_base + b0, _take(live, f, batch - b0, seg.bags), b0


def _take(live, f, left, bags: int):
    """The program's bag count: `min(bags, left)`, or 0 where `live` gives its feature to the other kernel."""
    n = jnp.minimum(bags, left)
    if live is None:
        return n
    live_ref, take = live
    return jnp.where(plgpu.load(live_ref.at[f]) == take, n, 0)


def bag_extent(offsets_ref, bag, ok, n: int):
    """(start, length, malformed) of bags `bag` (where `ok`; 0 elsewhere), clamped to `[0, n)` of `indices`.

    The clamp keeps any offsets from reading ids outside `indices` (memory safety in every `bounds_check`
    mode; two min/max per bag). For offsets that never decrease it is the partition the XLA path and the
    backward use too (ids before `offsets[0]` or past `n` belong to no bag). `malformed`: per bag, 1 where
    its end entry `offsets[bag + 1]` decreases or leaves `[0, n]`, plus 1 at the global bag 0 if
    `offsets[0] != 0`: summed over every bag, the malformed entries of `offsets`, each counted once.
    """
    # Unmasked loads at clamped positions, then `ok` applied: the loads need not wait for `ok` (often a
    # bag count just loaded), so they overlap that load.
    last = offsets_ref.shape[0] - 1
    raw_start = jnp.where(ok, plgpu.load(offsets_ref.at[jnp.clip(bag, 0, last)]), 0)
    raw_end = jnp.where(ok, plgpu.load(offsets_ref.at[jnp.clip(bag + 1, 0, last)]), 0)
    start = jnp.clip(raw_start, 0, n)
    end = jnp.clip(raw_end, start, n)
    bad = (raw_end < raw_start) | (raw_end < 0) | (raw_end > n)
    bad = bad.astype(jnp.int32) + ((bag == 0) & (raw_start != 0)).astype(jnp.int32)
    return start, end - start, jnp.where(ok, bad, 0)


def rows(pm: ProgramMap) -> np.ndarray:
    """The explicit `[programs, 4]` table (feature, first bag, bags, b0), on the host (tests, bookkeeping)."""
    out = []
    for seg in pm.segments:
        for i in range(seg.num_feats):
            f, base, batch = pm.flist[seg.feat_base + i]
            for b0 in range(0, int(batch), seg.bags):
                out.append((int(f), int(base) + b0, min(seg.bags, int(batch) - b0), b0))
    return np.asarray(out, np.int32).reshape(-1, 4)


def _progression(a: np.ndarray) -> bool:
    return a.size <= 2 or bool(np.all(np.diff(a) == a[1] - a[0]))


def const(values) -> jax.Array:
    """A kernel's small int32 table as a device constant that XLA keeps a constant.

    XLA's GPU compiler turns a constant array whose values are an arithmetic progression (one or two values,
    `[0, 128]`, `arange(F) * B`...) into an iota expression, which then runs as a kernel of its own before
    the Pallas call on every step (an extra launch: ~10 us of host time per call on the H200's host,
    `benchmarks/results/archive/dispatch-20261202-before.json`). Kernels read only the entries they know of, so
    such a table gets a tail that breaks the progression.
    """
    a = np.asarray(values, np.int64).reshape(-1)
    while _progression(a):
        a = np.append(a, (a[-1] if a.size else 0) + a.size + 1)
    if a.max() >= 2**31 or a.min() < -(2**31):
        raise ValueError("kernel tables must fit in int32")
    return jnp.asarray(a.astype(np.int32))


def operands(pm: ProgramMap):
    """The two kernel operands (flat int32 device constants): `flist` and `prefix`."""
    return const(pm.flist), const(pm.prefix)
