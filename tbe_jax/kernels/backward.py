"""Sorted-run backward with the optimizer fused in (seed: FBTriton backward).

Input: the runs of `tbe_jax.runs.build_runs` (one run per distinct table row in
the batch, its lookups contiguous in key order) and the output gradient. The
small-run kernel is launched once per segment of a width class `next_pow2(D)` (at
most SEGMENT_BUFFERS storage buffers of one row alignment, `runs.row_parity`;
`runs.width_classes` orders the key space class by class and parity by parity, so
each segment's keys, runs and tasks are contiguous; the narrow segments, of width
`BackwardConfig.merge_width` or less, share one launch whose programs are split between them); the mid-run
and chunk tasks share one launch and the long-run kernel is another, each branching per segment. Each
segment's code is compiled for its tile width: the gradient gather-and-sum is one
code path masked to each run's dim, and only the row update branches per storage
buffer (its weights' row stride a compile-time constant). Per segment:

- small runs (<= SMALL lookups; most runs, typically of length 1 or 2): a task
  takes a block of runs and walks their lookups in lockstep, gathering a
  [block, D] tile of output-gradient rows per step, then updates the block's
  rows with plain stores. Blocking turns a chain of dependent loads per run
  into wide independent loads (the per-run version was latency-bound).
- mid runs (SMALL < length < LONG): one task owns the run, gathers its lookups'
  output-gradient rows `K` at a time, accumulates them in fp32 registers and
  applies the update with a plain store: it owns the row, nothing races.
- long runs (>= LONG): a first kernel writes one fp32 partial sum per chunk of
  LONG lookups to a workspace; a second kernel sums each long run's partials and
  applies the update. A row hit a million times becomes thousands of parallel
  chunk tasks instead of one serial program.

Programs are persistent: a fixed grid walks the device-resident task lists with
a stride (trip counts come from device counts; no host sync, no atomics). The
tables and the optimizer state are updated in place (input/output aliasing):
rows not in the batch are never touched. Each row's gradient is summed in a
fixed order (its lookups in batch order; chunk partials in chunk order), so
results are bitwise reproducible run to run: there is no nondeterministic mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import aligned, pallas_call, pl, plgpu, row_align
from tbe_jax.optim import NUM_HYPER, apply_rule, stochastic_round
from tbe_jax.runs import LONG, SMALL, Runs, chunk_tasks, group_bases, row_parity, width_classes
from tbe_jax.specs import StorageLayout


# The counting-rank sort's default reach (`BackwardConfig.rank_sort_max`): where it stops beating XLA's sort of
# (key, position) on the H200 (`benchmarks/results/ranksort-20261202*.json`).
RANK_SORT_MAX = 24576


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Knobs of the backward kernels.

    Attributes:
      small_block: small runs (<= runs.SMALL lookups) updated together by one task.
        None (default): 8 for SGD and row-wise optimizers, 4 for optimizers with
        element-wise state (Adagrad, Adam, LAMB and their partial row-wise forms).
      small_num_warps: warps per program of the small-run kernel. None (default): 2
        for SGD and row-wise optimizers, 4 with element-wise state. Measured on the
        H200: (8 runs, 2 warps) against the session-4 default (32 runs, 4 warps): fp32
        0.748 vs 0.872 ms, base 1.009 vs 1.202, zipf 0.779 vs 0.839
        (`benchmarks/results/bwdsweep2-20261129-1808-*`, `bwdsweep3-20261129-1817-*`);
        with element-wise state (4 runs, 4 warps) against (8, 2) on `base`: Adagrad
        1.188 vs 1.50 ms, Adam 1.798 vs 1.95 (`optimizers-20261130-1911*`,
        `optimizers-20261130-1914*`). Models with several embedding dims per width
        class `next_pow2(D)` (SGD and row-wise state) take about 1024 gradient
        elements per task there instead: 16 runs at width 64, 8 at 128, 4 at 256
        (the comment after `SEGMENT_BUFFERS` in this module says what it measured).
      lookups_per_step: output-gradient rows gathered together (K) by the mid-run
        and chunk kernels.
      programs: persistent programs of the mid-run, chunk and long-run kernels
        (capped by the task count bound). 8192 against 4096 on the H200: fp32 -3.7%,
        zipf -1.6%, weighted -4.4%, base +1.1% (`bwdsweep5/6-20261129-*`).
      small_programs: persistent programs of the small-run kernel (twice as many for
        the width classes holding several embedding dims, with SGD or row-wise state).
      num_warps: warps per program of the mid-run, chunk and long-run kernels.
      sort_in_forward: `tbe_jax.train_step` only: build the runs (sort, run-length
        encoding) in the step's forward half and keep them as residuals for the
        update, instead of building them in the update.
      prefetch: the mid-run and chunk kernels load step i+1's source offsets
        while step i's gradient rows arrive (software pipelining). None (default):
        on for tables with 4-byte rows elements (fp32), off for fp16/bf16: measured
        on the H200, it saved 4% on `fp32` and cost 3-4% on the fp16 `base` and
        `weighted` presets (benchmarks/NOTES.md).
      rle_kernel: run-length encode the sorted keys with the two Pallas passes of
        `kernels.rle` (run starts, keys, the long-run list) instead of ~15 XLA ops
        (on the H200: 8-11% off the whole backward on fp32, zipf, base, weighted,
        `benchmarks/results/bwdsweep5-20261129-1832-*`).
      rank_sort_max: batches of at most this many lookups are sorted by the counting-rank kernels
        (`kernels.ranksort`: one launch up to `rank_sort_chunk` lookups, a merge pass past it) instead of
        XLA's sort, whose small-array form costs ~0.04-0.09 ms in several launches inside the backward. None (default): `RANK_SORT_MAX` with compiled kernels, 0 (XLA's sort)
        in interpret mode, where the interpreted kernel only adds CPU compile time; 0: never.
      rank_sort_chunk: positions the counting-rank sort ranks by direct comparison; larger batches take its merge
        pass (binary searches in the other chunks). A multiple of 256.
      merge_width: segments of this tile width or less (the narrow ones) share one small-run launch with the
        segment before them (each keeps its own programs). 0: one launch per segment.
      narrow_block: runs per small-run block of those narrow segments (SGD or row-wise state, `small_block`
        None). 0: the rules of `small_block`.
    """

    small_block: int | None = None
    small_num_warps: int | None = None
    lookups_per_step: int = 8
    programs: int = 8192
    small_programs: int = 4096
    num_warps: int = 1
    sort_in_forward: bool = False
    prefetch: bool | None = None
    rle_kernel: bool = True
    rank_sort_max: int | None = None
    rank_sort_chunk: int = 2048
    merge_width: int = 32
    narrow_block: int = 32

    def rank_sort_limit(self, interpret: bool) -> int:
        """The largest batch (lookups) sorted by the counting-rank kernel."""
        if self.rank_sort_max is not None:
            return self.rank_sort_max
        return 0 if interpret else RANK_SORT_MAX

    def __post_init__(self):
        if self.rank_sort_max is not None and (not isinstance(self.rank_sort_max, int) or self.rank_sort_max < 0):
            raise ValueError(f"BackwardConfig.rank_sort_max={self.rank_sort_max!r} must be None or an int >= 0")
        if not isinstance(self.rank_sort_chunk, int) or self.rank_sort_chunk < 256 or self.rank_sort_chunk % 256:
            raise ValueError(f"BackwardConfig.rank_sort_chunk={self.rank_sort_chunk!r} must be a multiple of 256")
        for name in ("merge_width", "narrow_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"BackwardConfig.{name}={v!r} must be an int >= 0")
        for name in ("small_block", "lookups_per_step"):
            v = getattr(self, name)
            if v is None and name == "small_block":
                continue
            if v < 1 or v & (v - 1):
                raise ValueError(f"BackwardConfig.{name}={v} must be a power of two")
        for name in ("small_num_warps", "num_warps", "programs", "small_programs"):
            if name == "small_num_warps" and self.small_num_warps is None:
                continue
            if getattr(self, name) < 1:
                raise ValueError(f"BackwardConfig.{name}={getattr(self, name)} must be >= 1")


def row_update(rule, hyper_ref, w_in_ref, w_out_ref, s_in, s_out, row, row_ok, acc, cols, col_ok, dim,
               stride=None):
    """Apply `rule` to rows `row` ([R] int32, where `row_ok`) with gradients `acc` ([R, Dp] f32).

    `s_in`/`s_out`: the refs of the optimizer state's slots (`rule.slot_rowwise` says
    which hold one value per row). `hyper_ref` holds the step's
    `Optimizer.hyperparameters` (an operand: changing them never recompiles). The
    formulas are `tbe_jax.optim.apply_rule`'s, on the tile: its padding columns (past
    `dim`) load as zeros, so the per-row sums see only the row. `rule=None` is the
    true-gradient mode: `acc` is stored as the row's gradient. With
    `rule.skip_nonfinite`, a row whose gradient holds a NaN or an infinity is not
    written (its weights and state stay as they were).

    `stride` (a Python int, > `dim`): the buffer's padded row length (`StorageLayout.strides`). Rows
    then load and store up to it, so a 16-byte-multiple row moves in 16-byte vectors; the padding
    columns are read as zeros (as `reference.apply_gradients` reads them) and written with what the
    rule makes of zeros.
    """
    rows = row[:, None]
    io_ok = col_ok if stride is None or stride <= dim else cols < stride
    if rule is None:  # `acc` is zero past `dim`
        mask = row_ok[:, None] & io_ok[None, :]
        plgpu.store(w_out_ref.at[rows, cols[None, :]], acc.astype(w_out_ref.dtype), mask=mask)
        return
    if rule.skip_nonfinite:
        bad = jnp.sum(jnp.where(jnp.abs(acc) < jnp.inf, 0, 1), axis=1)  # NaN fails the compare too
        row_ok = row_ok & (bad == 0)
    mask = row_ok[:, None] & io_ok[None, :]

    def values(x):  # the padding columns as zeros
        x = x.astype(jnp.float32)
        return x if io_ok is col_ok else jnp.where(col_ok[None, :], x, 0.0)

    hyper = tuple(plgpu.load(hyper_ref.at[jnp.int32(i)]) for i in range(NUM_HYPER))
    w0 = values(plgpu.load(w_in_ref.at[rows, cols[None, :]], mask=mask, other=0))
    slots = []
    for ref, rowwise in zip(s_in, rule.slot_rowwise):
        if rowwise:
            slots.append(plgpu.load(ref.at[row], mask=row_ok, other=0).astype(jnp.float32))
        else:
            slots.append(values(plgpu.load(ref.at[rows, cols[None, :]], mask=mask, other=0)))
    w, new, salts = apply_rule(rule, w0, tuple(slots), acc, hyper, dim=dim)
    for ref, x, rowwise in zip(s_out, new, rule.slot_rowwise):
        if rowwise:
            plgpu.store(ref.at[row], x.astype(ref.dtype), mask=row_ok)
        else:
            plgpu.store(ref.at[rows, cols[None, :]], x.astype(ref.dtype), mask=mask)
    if rule.stochastic_rounding and w_out_ref.dtype in (jnp.float16, jnp.bfloat16):
        w = stochastic_round(w, w_out_ref.dtype, jnp.broadcast_to(rows, acc.shape),
                             jnp.broadcast_to(cols[None, :], acc.shape), *salts)
    plgpu.store(w_out_ref.at[rows, cols[None, :]], w.astype(w_out_ref.dtype), mask=mask)


def _cols_below(cols, dim, align):
    """The column mask `cols < dim` for runtime dims (multiples of `align`), computed on column blocks of
    `align` so the mask is visibly constant over each vector of the gather."""
    if align == 1:
        return cols < dim
    a = jnp.int32(align)
    return jax.lax.div(cols, jnp.full(cols.shape, a)) < jax.lax.div(dim, jnp.full(dim.shape, a))


def _gather_sum(src_ref, scale_ref, g_ref, first, end, *, k, cols, col_ok, scaled, prefetch, align):
    """sum over sorted lookups [first, end) of scale * g[src + cols], fp32 [1, Dp] (scale 1 unless `scaled`).

    With `prefetch`, software-pipelined: step i's gradient rows load while step
    i + 1's source offsets (and scales) are already in flight, so a step costs one
    memory latency instead of two dependent ones.
    """
    j = jnp.arange(k, dtype=jnp.int32)

    def indices(i):
        jj = first + i * k + j
        live = jj < end
        src = aligned(plgpu.load(src_ref.at[jj], mask=live, other=0), align)
        sc = plgpu.load(scale_ref.at[jj], mask=live, other=0.0) if scaled else jnp.zeros((k,), jnp.float32)
        return src, sc, live

    def add(acc, src, sc, live):
        rows = plgpu.load(g_ref.at[src[:, None] + cols[None, :]], mask=live[:, None] & col_ok[None, :], other=0)
        rows = rows.astype(jnp.float32)
        if scaled:
            rows = rows * sc[:, None]
        return acc + jnp.sum(rows, axis=0, keepdims=True)

    n = jnp.maximum((end - first + k - 1) // k, 0)
    zeros = jnp.zeros((1, cols.shape[0]), jnp.float32)
    if not prefetch:
        return jax.lax.fori_loop(0, n, lambda i, acc: add(acc, *indices(i)), zeros)

    def step(i, carry):
        nxt = indices(i + 1)  # issued before this step's dependent row loads
        return (add(*carry),) + nxt

    return jax.lax.fori_loop(0, n, step, (zeros,) + indices(0))[0]


def _strided_tasks(lo, hi, programs, body, pid=None):
    """Program p (`pid`, by default the program id) handles tasks lo + p, lo + p + programs, ... below hi."""
    pid = pl.program_id(0) if pid is None else pid
    n = jnp.maximum(hi - lo - pid + programs - 1, 0) // programs
    jax.lax.fori_loop(0, n, lambda i, c: (body(lo + pid + i * programs), c)[1], jnp.int32(0))


# Buffers per segment: a width class with more buffers is split into segments (branches of
# the launches) of at most this many. Measured on the H200 (`dims4-128/4`: a class of 16
# buffers): one 16-buffer segment 0.475 ms of small-run kernel, two of 8 0.378 ms, four of 4
# 0.365 ms (benchmarks/results/dims-trace-20261201-*).
SEGMENT_BUFFERS = 8
# Segments with several buffers (row-wise state or SGD, `small_block` left at None) take blocks of about 1024
# gradient elements, clamp(1024 // width, 4, 16) runs (w64: 16, w128: 8, w256: 4), and launch twice
# `small_programs` programs (`_multi_block`). Measured on the H200 against block 8 and 4096 programs, in one process
# (benchmarks/results/multisweep*-20261201-*): dims 4..128 / 8..192 / 16..256 0.918 / 0.884 / 1.054 ->
# 0.868 / 0.815 / 0.998 ms of device time per step (w64 segments -7 to -25%, w256 -9 to -13%); on models not
# used to pick it (widthrule-heldout-20261201-*): 12..252 1.305 -> 1.168, 40..160 0.926 -> 0.874, 6..96 (step 6,
# rows 4-byte aligned) 0.894 -> 0.907 ms.
# Scaling that budget by the rows' vector width (1024 elements for 16-byte row vectors, 512 for 8-byte ones) cut
# the unaligned segments' registers (72 -> 40 on dims 4..128's w128) but not their time: 4..128 +0.8%, 6..96 -1.5%,
# 12..252 +1.4%, aligned models unchanged (vecblock-20261201-1700-*); removed.
# One warp per program for these segments was tried and not adopted: on dims 4..128 it took w128 0.367 -> 0.327
# ms, but cost up to +22% on other models, also under a rule for rows that are not 16-byte multiples
# (multisweep4-, warprule-20261201-*).
# `BackwardConfig.merge_width` (32): segments of this width or less (the narrow ones) share one small-run launch with
# the segments before them (each keeps its own programs: the grid is split by program id). On mixed-dim models each narrow segment alone was a
# launch of ~8-16 us (dims 4..128: w4, w8, w16 x2, w32 x2 took 66 us of 0.44 ms of small-run kernels,
# vecblock-20261201-1700-*). Measured in one process against 0 (one launch per segment; keys18-backward-20261201-2303):
# dims 4..128 0.753 -> 0.746 ms per step, 8..192 0.776 -> 0.772, one-dim presets unchanged.
# `BackwardConfig.narrow_block` (32): runs per small-run block of the narrow segments (SGD or row-wise state,
# `small_block` left at None): a [32, width] tile is at most 1024 elements, as the width rule's. Against the rules above (block 8,
# or 16 for several buffers), in one process on the H200 (benchmarks/results/keys18b-backward-20261201-2321):
# the narrow launch of dims 4..128 0.0596 -> 0.0472 ms (step 0.722 -> 0.708), of 8..192 0.0534 -> 0.0395 ms (step
# 0.744 -> 0.731); block 16 took 0.0497 / 0.0457. 0: the rules above.


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Storage buffers of one width class `next_pow2(D)` (at most SEGMENT_BUFFERS of them) that one
    branch of each backward kernel serves.

    The buffers' rows are one contiguous key range (`runs.width_classes` orders the key space
    class by class), so the segment's runs and its mid/chunk/long tasks are contiguous too (row
    `index` of `_task_ranges`), and segments follow each other in key order. The branch gathers
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


def _small_launches(segs, merge_width: int) -> list[tuple[_Segment, ...]]:
    """The segments (ascending width) grouped by small-run launch: each segment of width `merge_width` or less
    joins the launch of the segment before it."""
    groups = []
    for seg in segs:
        if groups and seg.width <= merge_width:
            groups[-1] += (seg,)
        else:
            groups.append((seg,))
    return groups


def _multi_block(seg: _Segment) -> int:
    """Runs per small-run block of a segment with several buffers: about 1024 gradient elements (measured: the
    comment after `SEGMENT_BUFFERS`)."""
    return min(16, max(4, 1024 // seg.width))


def state_width(opt) -> int:
    """Arrays per storage buffer that an update kernel aliases: the weights and the state's slots."""
    return 1 + (opt.num_slots if opt is not None else 0)


def _segment_states(refs, opt, segs):
    """Per segment, per buffer, its (w_in, slots_in, w_out, slots_out) refs; `refs` holds every
    buffer's inputs in segment order, then the aliased outputs in the same order."""
    n_state = state_width(opt)
    total = n_state * sum(len(seg.buffers) for seg in segs)
    ins, outs = refs[:total], refs[total:]
    out, i = [], 0
    for seg in segs:
        per = []
        for _ in seg.buffers:
            per.append(state_refs(ins[i:i + n_state] + outs[i:i + n_state], opt))
            i += n_state
        out.append(per)
    return out


def _range(rng_ref, seg: _Segment, col: int):
    """(lo, hi) of column pair `col` of the segment's row of the task-range table (scalars)."""
    return (plgpu.load(rng_ref.at[jnp.int32(8 * seg.index + col)]),
            plgpu.load(rng_ref.at[jnp.int32(8 * seg.index + col + 1)]))


def _by_segment(segs, t, bounds, body):
    """`body(c, t)` in the branch of the segment `c` with `bounds[c] <= t < bounds[c + 1]`."""
    if len(segs) == 1:
        body(0, t)
        return
    for c in range(len(segs)):
        pl.when((t >= bounds[c]) & (t < bounds[c + 1]))(functools.partial(body, c, t))


def _list_kernel_tasks(rng_ref, segs, col, programs, body):
    """Walk one task list (column pair `col`: mid runs, chunks or long runs) over every segment: the
    segments' ranges of the list follow each other, so the tasks are one range."""
    bounds = [_range(rng_ref, seg, col)[0] for seg in segs] + [_range(rng_ref, segs[-1], col)[1]]
    _strided_tasks(bounds[0], bounds[-1], programs, lambda t: _by_segment(segs, t, bounds, body))


def _small_kernel(rng_ref, hyper_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref, *refs,
                  opt, segs, blocks, programs, scaled, align):
    """The small-run kernel of one launch: segment `segs[c]` (blocks of `blocks[c]` runs) on `programs[c]`
    programs of its own; with several segments (`BackwardConfig.merge_width`) the grid is split between them by program
    id, so each program runs one segment's code."""
    states = _segment_states(refs, opt, segs)
    kw = dict(rng_ref=rng_ref, hyper_ref=hyper_ref, run_start_ref=run_start_ref, run_key_ref=run_key_ref,
              src_ref=src_ref, scale_ref=scale_ref, g_ref=g_ref, opt=opt, scaled=scaled, align=align)
    if len(segs) == 1:
        _small_segment(state=states[0], seg=segs[0], block=blocks[0], programs=programs[0], pid=None, **kw)
        return
    pid, start = pl.program_id(0), 0
    for state, seg, block, p in zip(states, segs, blocks, programs):
        pl.when((pid >= start) & (pid < start + p))(functools.partial(
            _small_segment, state=state, seg=seg, block=block, programs=p, pid=pid - start, **kw))
        start += p


def _small_segment(*, rng_ref, hyper_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref, state, opt, seg,
                   block, programs, pid, scaled, align):
    """Blocks of `block` consecutive runs of the segment `seg`; the small ones (<= SMALL lookups)
    are gathered in lockstep and updated, one row each; the others are left to the mid/long kernels.

    A block's lanes may belong to several buffers of the segment: the gather serves them all
    (each lane masked to its run's dim), then each buffer present in the block updates its
    lanes in its own branch. Each loop step takes one lookup of every run of the block.
    """
    lane = jnp.arange(block, dtype=jnp.int32)
    lo, hi = _range(rng_ref, seg, 0)
    cols = jnp.arange(seg.width, dtype=jnp.int32)

    def task(t):
        r0 = lo + t * block
        r = r0 + lane
        ok = r < hi
        first = plgpu.load(run_start_ref.at[r], mask=ok, other=0)
        length = plgpu.load(run_start_ref.at[r + 1], mask=ok, other=0) - first
        ok = ok & (length <= SMALL)
        length = jnp.where(ok, length, 0)
        key = plgpu.load(run_key_ref.at[r], mask=ok, other=0)
        if not seg.single:
            # Keys ascend within the segment and each buffer's keys are contiguous: the buffers present
            # in the block lie between those of its first and last runs (two scalar loads instead of a
            # cross-lane reduction per buffer). Loaded here, before the gather, not where they are used:
            # issued after it, they add a memory round trip to every block (dims 4..128: 0.424 -> 0.331 ms
            # of w128 small-run kernels, benchmarks/results/preload-20261201-1223-*).
            k0 = plgpu.load(run_key_ref.at[r0])
            k1 = plgpu.load(run_key_ref.at[jnp.minimum(r0 + block, hi) - 1])
        dim = seg.dim_of(key)
        col_ok = (cols < dim)[None, :] if seg.single else _cols_below(cols[None, :], dim[:, None], align)

        def step(i, acc):
            live = i < length
            jj = first + i
            src = aligned(plgpu.load(src_ref.at[jj], mask=live, other=0), align)
            g = plgpu.load(g_ref.at[src[:, None] + cols[None, :]], mask=live[:, None] & col_ok,
                           other=0).astype(jnp.float32)
            if scaled:
                g = g * plgpu.load(scale_ref.at[jj], mask=live, other=0.0)[:, None]
            return acc + g

        acc = jax.lax.fori_loop(0, jnp.max(length), step, jnp.zeros((block, seg.width), jnp.float32))

        def update(i, mine):
            w_in, s_in, w_out, s_out = state[i]
            # Masked lanes point one past the buffer: never stored on a GPU, and dropped
            # (not written back over a live row) by interpret mode's masked store.
            row = jnp.where(mine, key - seg.bases[i], w_out.shape[0])
            row_update(opt, hyper_ref, w_in, w_out, s_in, s_out, row, mine, acc, cols, cols < seg.dims[i],
                       seg.dims[i], seg.strides[i])

        if seg.single:
            update(0, ok)
            return
        for i in range(len(seg.buffers)):
            pl.when((k0 < seg.ends[i]) & (k1 >= seg.bases[i]))(
                functools.partial(update, i, ok & seg.holds(i, key)))

    _strided_tasks(0, (hi - lo + block - 1) // block, programs, task, pid)


def _mid_chunk_kernel(rng_ref, hyper_ref, mid_ref, long_chunk0_ref, long_ref, run_start_ref, run_key_ref,
                      src_ref, scale_ref, g_ref, *refs, opt, segs, k, programs, scaled, prefetch, align):
    """The mid-run tasks, then the chunk tasks, on the same persistent programs: one launch (two cost ~6 us more
    per step, even with no task). `refs`: the buffers' state (inputs, aliased outputs), then the chunk partials'
    workspace."""
    _mid_tasks(rng_ref, hyper_ref, mid_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref,
               _segment_states(refs[:-1], opt, segs), opt=opt, segs=segs, k=k, programs=programs, scaled=scaled,
               prefetch=prefetch, align=align)
    _chunk_partials(rng_ref, long_chunk0_ref, long_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref,
                    refs[-1], segs=segs, k=k, programs=programs, scaled=scaled, prefetch=prefetch, align=align)


def _mid_tasks(rng_ref, hyper_ref, mid_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref, states, *,
               opt, segs, k, programs, scaled, prefetch, align):
    def body(c, t):
        seg = segs[c]
        cols = jnp.arange(seg.width, dtype=jnp.int32)
        r = plgpu.load(mid_ref.at[t])
        first = plgpu.load(run_start_ref.at[r])
        end = plgpu.load(run_start_ref.at[r + 1])
        key = plgpu.load(run_key_ref.at[r])
        col_ok = cols < seg.dims[0] if seg.single else _cols_below(cols, seg.dim_of(key), align)
        acc = _gather_sum(src_ref, scale_ref, g_ref, first, end, k=k, cols=cols, col_ok=col_ok, scaled=scaled,
                          prefetch=prefetch, align=align)
        _update_key_row(opt, hyper_ref, seg, states[c], key, acc, cols)

    _list_kernel_tasks(rng_ref, segs, 2, programs, body)


def _update_key_row(opt, hyper_ref, seg, state, key, acc, cols):
    """The row update of one run (linear key `key`, summed gradient `acc` `[1, width]`), in the branch of
    the segment's buffer that holds the key."""
    def update(i):
        w_in, s_in, w_out, s_out = state[i]
        row = key - seg.bases[i] + jnp.zeros((1,), jnp.int32)
        row_update(opt, hyper_ref, w_in, w_out, s_in, s_out, row, jnp.ones((1,), jnp.bool_), acc, cols,
                   cols < seg.dims[i], seg.dims[i], seg.strides[i])

    seg.per_buffer(key, update)


def _chunk_task(long_chunk0_ref, long_ref, run_start_ref, t, size: int):
    """(long run, first sorted lookup) of chunk task `t` (below the chunk count): the last `li` with
    `long_chunk0[li] <= t`, by a binary search over its `size` entries (those past the long runs hold the chunk
    count, above t), then the run's first lookup plus `LONG` per chunk before t."""
    def halve(_, lo_hi):  # the answer stays in [lo, hi)
        lo, hi = lo_hi
        mid = (lo + hi) // 2
        below = plgpu.load(long_chunk0_ref.at[mid]) <= t
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    li, _ = jax.lax.fori_loop(0, max(size - 1, 1).bit_length(), halve, (jnp.int32(0), jnp.int32(size)))
    r = plgpu.load(long_ref.at[li])
    return r, plgpu.load(run_start_ref.at[r]) + (t - plgpu.load(long_chunk0_ref.at[li])) * LONG


def _chunk_partials(rng_ref, long_chunk0_ref, long_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref,
                    part_ref, *, segs, k, programs, scaled, prefetch, align):
    """One LONG-lookup chunk of a long run per task (found by `_chunk_task`): its fp32 partial sum (zero past the
    run's dim) to row `t` of the workspace (the first `width` columns of its segment)."""
    def body(c, t):
        seg = segs[c]
        cols = jnp.arange(seg.width, dtype=jnp.int32)
        r, first = _chunk_task(long_chunk0_ref, long_ref, run_start_ref, t, long_chunk0_ref.shape[0])
        end = jnp.minimum(first + LONG, plgpu.load(run_start_ref.at[r + 1]))
        col_ok = (cols < seg.dims[0] if seg.single
                  else _cols_below(cols, seg.dim_of(plgpu.load(run_key_ref.at[r])), align))
        acc = _gather_sum(src_ref, scale_ref, g_ref, first, end, k=k, cols=cols, col_ok=col_ok, scaled=scaled,
                          prefetch=prefetch, align=align)
        plgpu.store(part_ref.at[(t + jnp.zeros((1,), jnp.int32))[:, None], cols[None, :]], acc)

    _list_kernel_tasks(rng_ref, segs, 4, programs, body)


def _long_kernel(rng_ref, hyper_ref, long_ref, long_chunk0_ref, run_key_ref, part_ref, *refs, opt, segs, programs):
    """One long run per task: the sum of its chunk partials (in chunk order), one row update."""
    states = _segment_states(refs, opt, segs)

    def body(c, li):
        seg = segs[c]
        cols = jnp.arange(seg.width, dtype=jnp.int32)
        c0 = plgpu.load(long_chunk0_ref.at[li])
        c1 = plgpu.load(long_chunk0_ref.at[li + 1])

        def add(ch, acc):
            return acc + plgpu.load(part_ref.at[(ch + jnp.zeros((1,), jnp.int32))[:, None], cols[None, :]])

        acc = jax.lax.fori_loop(c0, c1, add, jnp.zeros((1, seg.width), jnp.float32))
        key = plgpu.load(run_key_ref.at[plgpu.load(long_ref.at[li])])
        _update_key_row(opt, hyper_ref, seg, states[c], key, acc, cols)

    _list_kernel_tasks(rng_ref, segs, 6, programs, body)


def state_refs(refs, opt):
    """(w_in, slots_in, w_out, slots_out) from one buffer's `2 * state_width(opt)` refs (its inputs, then
    its aliased outputs); the slot tuples are empty for SGD and the true-gradient mode."""
    n = state_width(opt)
    ins, outs = refs[:n], refs[n:]
    return ins[0], tuple(ins[1:]), outs[0], tuple(outs[1:])


def _segments(layout: StorageLayout) -> list[_Segment]:
    """The width classes (`runs.width_classes`, in key order), each split by `runs.row_parity` (buffers whose
    rows are equally aligned), then into segments of at most SEGMENT_BUFFERS buffers.

    One segment per parity: a segment mixing 16-byte-multiple rows with others (fp16 dims 4 mod 8) was slower
    than either kind alone, per table of the w128 class on the H200: 0.0256 ms mixed (dims 4..128), 0.0158
    aligned (8..192, 40..160), 0.0204 unaligned (12..252) (benchmarks/results/multisweep2-,
    widthrule-heldout-20261201-*); split: 4..128 0.869 -> 0.795 ms per step (parity-20261201-1531-*). In the mixed
    kernel the unaligned branches converted the gradient tile's layout through shared memory and it needed 80
    registers, against 56 and 72 for the two halves alone (benchmarks/kernel_resources.py).
    """
    bases = group_bases(layout)
    segs = []
    for w, gs in width_classes(layout):
        by_parity = {}
        for g in gs:  # width_classes keeps each parity's buffers contiguous
            by_parity.setdefault(row_parity(layout.strides[g]), []).append(g)
        for same in by_parity.values():
            for i in range(0, len(same), SEGMENT_BUFFERS):
                part = tuple(same[i:i + SEGMENT_BUFFERS])
                segs.append(_Segment(len(segs), w, part, tuple(layout.dims[g] for g in part),
                                     tuple(int(bases[g]) for g in part),
                                     tuple(int(bases[g]) + layout.group_rows[g] for g in part),
                                     tuple(layout.strides[g] for g in part)))
    return segs


def segment_bounds(layout: StorageLayout) -> tuple[int, ...]:
    """The first keys of the segments after the first (`_segments` order, ascending): where `_task_ranges`
    splits the run and task lists (`runs.build_runs(segment_bounds=...)`)."""
    return tuple(seg.bases[0] for seg in _segments(layout)[1:])


def _task_ranges(runs: Runs, layout: StorageLayout, n: int) -> jax.Array:
    """[num_segments, 8] int32: per segment (`_segments` order) its [lo, hi) in the runs (small-run
    kernel) and in the mid, chunk and long task lists."""
    segs = _segments(layout)
    n_mid, n_long, n_chunks = runs.counts[1], runs.counts[2], runs.counts[3]
    one = len(segs) == 1
    if one or (runs.seg_edges is not None and runs.seg_edges.shape[0] == len(segs) - 1):
        # The counts below each segment's first key, from the run-length pass (one segment: none below it, all
        # below the end); a long run's chunks are contiguous in the chunk list, so the chunk bounds are the long
        # bounds' first chunks.
        zero = jnp.zeros((1, 3), jnp.int32)
        last = jnp.stack([runs.num_runs, n_mid, n_long]).astype(jnp.int32)[None, :]
        edges = jnp.concatenate([zero] + ([] if one else [runs.seg_edges]) + [last], axis=0)
        chunk = runs.long_chunk0[edges[:, 2]]
        cols = [edges[:, 0], edges[:, 1], chunk, edges[:, 2]]
        return jnp.stack([e for c in cols for e in (c[:-1], c[1:])], axis=1)
    bases = jnp.asarray(np.asarray([seg.bases[0] for seg in segs] + [int(group_bases(layout)[-1])], np.int32))
    total = bases[-1]
    key_of = lambda r: jnp.where(r < n, runs.run_key[jnp.minimum(r, n - 1)], total)  # noqa: E731

    def keys(lst, count):
        return jnp.where(jnp.arange(lst.shape[0]) < count, key_of(lst), total)

    long_keys = keys(runs.long, n_long)
    chunk_run = chunk_tasks(runs.run_start, runs.long, runs.long_chunk0, n)[0]
    chunk_keys = jnp.where(jnp.arange(chunk_run.shape[0]) < n_chunks, long_keys[chunk_run], total)

    def bounds(keys):  # searchsorted(keys, bases, "left") as one fused compare-and-count pass: no device
        # while loop, and a program whose size does not depend on len(keys)
        edges = jnp.sum(keys[None, :] < bases[:, None], axis=1, dtype=jnp.int32)
        return edges[:-1], edges[1:]

    # Small runs: the range of all runs in the segment (run_key is sorted, padded with total).
    parts = [bounds(runs.run_key), bounds(keys(runs.mid, n_mid)), bounds(chunk_keys), bounds(long_keys)]
    return jnp.stack([e for lo_hi in parts for e in lo_hi], axis=1)


def fused_update(
    buffers: dict,
    slots: tuple,
    layout: StorageLayout,
    runs: Runs,
    g_out: jax.Array,
    opt,
    hyper: jax.Array | None = None,
    *,
    config: BackwardConfig,
    interpret: bool,
):
    """Apply `opt` (a `tbe_jax.optim.KernelRule`) to every row in `runs` with its aggregated gradient;
    returns (buffers, slots). `slots`: the optimizer state's slots (a tuple of dicts shaped like
    `buffers`; empty for SGD); `hyper`: the step's `Optimizer.hyperparameters`, fp32.

    `opt=None` is the true-gradient mode: `buffers` must be zeros, and each row in
    the batch receives its aggregated gradient (cast to the buffer's dtype).
    """
    if hyper is None:
        hyper = jnp.zeros((NUM_HYPER,), jnp.float32)
    n = runs.src.shape[0]
    ranges = _task_ranges(runs, layout, n)
    g_flat = g_out.reshape(-1)
    n_slots = opt.num_slots if opt is not None else 0
    new_w, new_s = dict(buffers), tuple(dict(x) for x in (slots or ())[:n_slots])
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)
    # Element-wise state (Adagrad, the Adam family) triples or more the bytes of each row update: fewer
    # runs per task and more warps per program keep more of those loads in flight (BackwardConfig).
    elementwise = opt is not None and not all(opt.slot_rowwise)
    small_warps = config.small_num_warps or (4 if elementwise else 2)
    k = config.lookups_per_step
    blk = config.small_block or (4 if elementwise else 8)
    # Interpret mode runs programs one after another: few programs keep CPU tests
    # fast and make each program walk several tasks (the strided loop is tested).
    max_programs = min(config.programs, 16) if interpret else config.programs
    max_small = min(config.small_programs, 16) if interpret else config.small_programs
    # Unweighted sum pooling: every lookup in a run has scale 1 (invalid ones are in no
    # run), so the runs carry no scales and the kernels skip those loads.
    scaled = runs.scale is not None
    common = [runs.src, runs.scale if scaled else jnp.ones((1,), jnp.float32), g_flat]
    max_chunks = 2 * n // LONG + 1  # chunk task slots (`runs.chunk_tasks`)
    # Every launch gets the full program count (scaling a class's programs by its share of the
    # tables measured slower: dims-20261130-164044).
    p_mid = max(1, min(max_programs, runs.mid.shape[0]))
    p_long = max(1, min(max_programs, max_chunks))

    keys = [layout.key(g) for g in range(len(layout.dims))]
    prefetch = bool(config.prefetch if config.prefetch is not None else all(
        jnp.dtype(new_w[key].dtype).itemsize == 4 for key in keys))
    rng = ranges.reshape(-1)

    # Segments: at most one width class per power of two, split every SEGMENT_BUFFERS buffers. The
    # mid-run and chunk tasks (one launch) and the long runs (one) branch per segment (their work is
    # often small: a launch per segment cost ~6 us even when it found nothing to do, on the H200).
    # The small-run kernel does most of the work and is one launch per segment: one launch for all
    # segments measured slower (dims-trace-20261201-0907-onelaunch vs -0914-segments).
    segs = _segments(layout)
    buffers = [g for seg in segs for g in seg.buffers]
    width = max(seg.width for seg in segs)

    def aliased(kernel, name, grid, args, buffers=buffers, compiler_params=params, extra=()):
        """Launch `kernel` with the state of `buffers` aliased in place; `extra`: more outputs (shapes) after the
        state's, returned."""
        state = [x for g in buffers for x in [new_w[keys[g]]] + [d[keys[g]] for d in new_s]]
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state] + list(extra)
        args = list(args) + state
        out = pallas_call(
            kernel, out_shape=shapes, grid=(grid,),
            input_output_aliases={len(args) - len(state) + i: i for i in range(len(state))},
            compiler_params=compiler_params,
            interpret=interpret, name=name,
        )(*args)
        per = 1 + n_slots
        for i, g in enumerate(buffers):
            new_w[keys[g]] = out[per * i]
            for j, d in enumerate(new_s):
                d[keys[g]] = out[per * i + 1 + j]
        return out[len(state):]

    segs = tuple(segs)
    align = row_align(layout.dims, 4)
    def small_launch(seg):  # (block, warps, programs) of a segment's small runs
        s_blk, s_warps, s_programs = blk, small_warps, max_small
        if not seg.single and not elementwise:  # several buffers: the width rule (`_multi_block`)
            s_blk = config.small_block or _multi_block(seg)
            s_programs = max_small if interpret else 2 * max_small
        if (config.narrow_block and seg.width <= config.merge_width and not elementwise
                and config.small_block is None):
            s_blk = config.narrow_block
        return s_blk, s_warps, max(1, min(s_programs, -(-n // s_blk)))

    for group in _small_launches(segs, config.merge_width):
        blocks, warps, programs = zip(*map(small_launch, group))
        widths = sorted({seg.width for seg in group})
        aliased(functools.partial(_small_kernel, opt=opt, segs=group, blocks=blocks, programs=programs,
                                  scaled=scaled, align=align),
                f"tbe_backward_small_runs_w{widths[0]}" + (f"-{widths[-1]}" if len(widths) > 1 else ""),
                sum(programs), [rng, hyper, runs.run_start, runs.run_key] + common,
                [g for seg in group for g in seg.buffers],
                plgpu.CompilerParams(num_warps=max(warps), num_stages=1))
    part_shape = jax.ShapeDtypeStruct((max_chunks, width), jnp.float32)
    p_mc = max(p_mid, p_long)
    part, = aliased(functools.partial(_mid_chunk_kernel, opt=opt, segs=segs, k=k, programs=p_mc, scaled=scaled,
                                      prefetch=prefetch, align=align),
                    "tbe_backward_mid_runs_chunks", p_mc,
                    [rng, hyper, runs.mid, runs.long_chunk0, runs.long, runs.run_start, runs.run_key] + common,
                    extra=[part_shape])
    aliased(functools.partial(_long_kernel, opt=opt, segs=segs, programs=p_long),
            "tbe_backward_long_runs", p_long, [rng, hyper, runs.long, runs.long_chunk0, runs.run_key, part])
    return new_w, new_s
