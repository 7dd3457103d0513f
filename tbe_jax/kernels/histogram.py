"""Small-table histogram forward: counts x table on tensor cores (seed: FBTriton).

For a feature whose table is tiny (E <= 64) and whose bags are long, gathering
rows one by one re-reads the same few rows hundreds of times. Instead a program
takes `bags` bags (16 by default), counts how often each of the table's rows
occurs among the first `head` ids of each bag (256 by default; `counts[bags, E]`),
and computes `counts @ table` with tensor-core dots; ids past them go through the
scalar gather path.

Counting (`_count_packed`): a step loads a 2-D `[bags, C]` id tile (each bag's
C ids one contiguous run). An int32 word holds four 8-bit counters, row
`16 * byte + word`: per id one compare per word (16) instead of per row (64),
adding `1 << 8 * byte` into a deferred `[bags, C, 16]` int32 accumulator;
unpacked and summed over C at the end, and `counts @ table` is one dot per byte.
`lookahead` keeps the id tiles of the next steps in flight while one is counted.
(Other counting schemes -- an int32 compare tile, fp16 one-hots counted on the
tensor cores, flat id gathers -- and aligned per-bag windows measured slower on
the H200 and were removed; see benchmarks/NOTES.md, "Session 10".)

Exactness: counts are integers <= `head` <= 2048, exact in fp16, and the table is fp16, so
every product is exact in the fp32 accumulator: the result equals the generic
path's up to fp32 rounding of the sum order. (FBTriton's fp16 high/low split is
only needed where an fp32 operand meets the tensor cores, as in the backward's
`counts^T @ dout`, see `histogram_backward`; here both operands are exactly fp16.)

Eligibility is static (see `eligible`): E <= 64, 64 <= D <= 128, fp16 weights,
fp32 output, unweighted, no VBE. The backward of an eligible table always takes
the histogram kernels; its forward follows `forward_mode` (the table's
`bag_size_hint`, or without one a choice on the device per batch: one `[F]` 0/1
operand, `long_bags`, read by both forward kernels, so no host sync and no recompile).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pallas_call, pl, plgpu, sm_count
from tbe_jax.kernels import programs  # the program map and feature table are shared with the generic kernel
from tbe_jax.kernels.programs import META_COLS, NUM_ROWS, OUT_BASE, OUT_STRIDE, ROW_OFFSET, feature_table
from tbe_jax.specs import FeaturePlan, StorageLayout, TableSpec, next_pow2

# Ids per bag and round of the backward's counting (`histogram_backward`). Not a knob: it is the largest count exact
# in bf16 (the counts' dtype in its `counts^T @ dout` dots), and a smaller round only adds rounds of dots.
GRAD_ROUND = 256
MAX_ROWS, MIN_DIM, MAX_DIM, MIN_BAG = 64, 64, 128, 64
WORDS = 16  # int32 words per bag slot of the packed counters, each holding E_padded / 16 8-bit counters


def _pow2_floor(v: int) -> int:
    return 1 << (int(v).bit_length() - 1)


def _pow2(v) -> bool:
    return isinstance(v, (int, np.integer)) and v >= 1 and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class HistogramConfig:
    """Knobs of the histogram kernels (forward, and the backward in `histogram_backward`).

    Forward attributes:
      bags: bags per program (the M of the counts dot; a power of 2 >= 16).
      head: ids per bag counted into the histogram (default 256, at most 2048: counts exact in fp16); the bag's
        ids past them take the scalar gather path. A packed 8-bit counter sees ceil(head / C) ids of its bag,
        which must stay <= 255.
      ids_per_step: C, ids per bag per counting step: a step's tile is
        `bags x C` ids. A power of 2 <= `head` (C = 1 only with `head` <= 255, see `head`), or 0 (default) for the
        `[bags, C, 16]` packed tile at 2048 elements (`resolved_ids_per_step`:
        C = 8 for bags = 16; with one warp, C = 8 measured 0.070 ms on the H200
        `smalltable` against 0.091 for C = 16 at 2 warps and 0.115 for C = 32 at
        4 warps, `benchmarks/results/archive/histsweep2-20261129-1808-*`).
      lookahead: steps of ids loaded ahead of the one being counted (0: none; each
        step's load then waits a full memory latency). Bytes in flight per
        program: `(lookahead + 1) * bags * C * 4`.
      tail_unroll: ids per bag loaded together on the gather path (ids past `head`).
      num_warps, num_stages: launch knobs of the forward kernel (one warp: a program
        is a short latency-bound chain, and more resident programs hide more of it).

    Backward attributes (`histogram_backward`: `apply_gradients`, `jax.grad`,
    `tbe_jax.train_step`):
      grad_programs: programs of the gradient kernel; each sums `counts^T @ dout`
        over a contiguous range of tiles and writes one fp32 `[E, D]` partial. None
        (default): `grad_programs_per_sm` per SM of the device (264 on an H200's 132;
        a device without SMs, CPU, counts 2); 3 in interpret mode. A value set here is used as given.
      grad_programs_per_sm: see `grad_programs` (default 2).
      grad_bags, grad_ids_per_step, grad_lookahead, grad_num_warps: its tile,
        id lookahead and warps. The one-hot of a step is `grad_bags * grad_ids_per_step`
        x E; 32 x 64 asks about 274 KB of shared memory on an H200 (limit 227 KB) and
        fails to compile with RESOURCE_EXHAUSTED (the default 16 x 16 fits). `grad_ids_per_step` is a power
        of 2 <= 256 (`GRAD_ROUND`).
      update_partials, update_num_warps: partials summed per step by the
        reduction/update kernel (one program per table row), and its warps.
    """

    bags: int = 16
    head: int = 256
    ids_per_step: int = 0
    lookahead: int = 3
    tail_unroll: int = 4
    num_warps: int = 1
    num_stages: int = 1
    grad_programs: int | None = None
    grad_programs_per_sm: int = 2
    grad_bags: int = 16
    grad_ids_per_step: int = 16
    grad_lookahead: int = 2
    grad_num_warps: int = 4
    update_partials: int = 64
    update_num_warps: int = 4

    def __post_init__(self):
        for name in ("bags", "grad_bags"):
            v = getattr(self, name)
            if not _pow2(v) or v < 16:
                raise ValueError(f"HistogramConfig.{name}={v!r} must be a power of 2 >= 16 (a dot's M)")
        head = self.head
        if not isinstance(head, (int, np.integer)) or isinstance(head, bool) or not 1 <= head <= 2048:
            raise ValueError(f"HistogramConfig.head={head!r} must be an int in [1, 2048] (counts exact in fp16)")
        if not (self.ids_per_step == 0 or _pow2(self.ids_per_step) and self.ids_per_step <= head):
            raise ValueError(f"HistogramConfig.ids_per_step={self.ids_per_step!r} must be 0 (auto) or a power of 2 "
                             f"<= head={head}")
        c = self.resolved_ids_per_step()
        if -(-head // c) > 255:
            raise ValueError(f"HistogramConfig.ids_per_step={self.ids_per_step}: a packed 8-bit counter would reach "
                             f"{-(-head // c)} (ceil(head / C) ids of its bag, head={head}, C={c}); raise C or "
                             "lower head")
        if not _pow2(self.grad_ids_per_step) or self.grad_ids_per_step > GRAD_ROUND:
            raise ValueError(f"HistogramConfig.grad_ids_per_step={self.grad_ids_per_step!r} must be a power of 2 "
                             f"<= {GRAD_ROUND}")
        for name in ("num_warps", "grad_num_warps", "update_partials", "update_num_warps"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"HistogramConfig.{name}={getattr(self, name)!r} must be a power of 2")
        for name, low in (("tail_unroll", 1), ("num_stages", 1), ("grad_programs", 1), ("grad_programs_per_sm", 1),
                          ("lookahead", 0), ("grad_lookahead", 0)):
            v = getattr(self, name)
            if v is None and name == "grad_programs":
                continue
            if not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"HistogramConfig.{name}={v!r} must be an int >= {low}")

    def resolved_grad_programs(self, interpret: bool = False) -> int:
        """Programs of the gradient kernel (resolves `grad_programs=None` from the device's SM count; 3 in
        interpret mode, where programs run one after another)."""
        if self.grad_programs is not None:
            return self.grad_programs
        return 3 if interpret else self.grad_programs_per_sm * sm_count()

    def resolved_ids_per_step(self) -> int:
        """C of the forward (resolves `ids_per_step=0`): the `[bags, C, 16]` packed tile at 2048 elements
        (64 registers a thread at one warp), never below 2."""
        if self.ids_per_step:
            return self.ids_per_step
        return max(2, _pow2_floor(max(1, 2048 // (self.bags * WORDS))))


def eligible(table: TableSpec, weights_dtype, output_dtype) -> bool:
    """Whether a table can take the histogram kernels (per call also: unweighted, no VBE).

    E <= 64, 64 <= D <= 128, fp16 weights, fp32 output. Its backward then always
    takes them: counts^T x dout with no sort measured 1.2-7.4x faster than the
    sorted runs on every table size, dim, batch and bag length tried, bags of 1 to
    128 ids (`benchmarks/bench_paths.py --sweep`, `paths-20261201-024758-*`).
    """
    return (
        table.num_embeddings <= MAX_ROWS
        and MIN_DIM <= table.embedding_dim <= MAX_DIM
        and jnp.dtype(weights_dtype) == jnp.float16
        and jnp.dtype(output_dtype) == jnp.float32
    )


def forward_mode(table: TableSpec) -> str:
    """The forward path of an eligible table: "histogram", "generic" or "auto".

    The forward pays only for long bags (same sweep: 1.4-3.1x the generic kernel at
    64-128 ids per bag and B = 65536, up to 1.7x slower at 4-16), so it follows the
    table's `bag_size_hint` when one is given (>= MIN_BAG: histogram) and otherwise
    is "auto": chosen on the device per batch and feature, histogram when the
    feature's mean bag length is >= MIN_BAG (see `long_bags`).
    """
    hint = table.bag_size_hint
    if hint is None:
        return "auto"
    return "histogram" if hint >= MIN_BAG else "generic"


def long_bags(plan: FeaturePlan, offsets: jax.Array, features) -> jax.Array:
    """`[F]` int32 on the device: 1 for each of `features` whose mean bag length in this batch
    is >= MIN_BAG, else 0 (one tiny fused op on `offsets`, no host sync)."""
    # Dense over all F features (need 0: never long), so that it is one gather-compare fusion (with the caller's
    # fixed choices added), not a scatter of its own; both forward kernels read its `[F]` result.
    feats = set(features)
    starts = np.asarray(plan.bag_base[: plan.num_features], np.int32)
    ends = starts + np.asarray(plan.batch, np.int32)
    need = np.asarray([MIN_BAG * plan.batch[f] if f in feats else 0 for f in range(plan.num_features)], np.int32)
    total = offsets[jnp.asarray(ends)] - offsets[jnp.asarray(starts)]
    return ((total >= jnp.asarray(need)) & jnp.asarray(need > 0)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Branch:
    buffer: int
    seg: programs.Segment
    dim: int
    block_dim: int
    rows_padded: int  # >= 16: a tensor-core dot needs K >= 16


def rows_padded(num_rows: int) -> int:
    """E_padded: the width of the counts (a power of 2 >= 16, a dot's minimum K; the backward's one-hot width)."""
    return max(16, next_pow2(num_rows))


def _groups(plan: FeaturePlan, features, bags: int):
    """One program segment per storage buffer: (buffer, its features, bags per program)."""
    out = []
    for g in sorted({plan.group[f] for f in features}):
        feats = [f for f in features if plan.group[f] == g]
        if sum(plan.batch[f] for f in feats):
            out.append((g, feats, bags))
    return out


def _schedule(layout: StorageLayout, plan: FeaturePlan, features, bags: int):
    groups = _groups(plan, features, bags)
    pm = programs.build(plan.bag_base, plan.batch, [(feats, b) for _, feats, b in groups])
    branches = []
    for pos, ((g, feats, _), seg) in enumerate(zip(groups, pm.segments)):
        d = layout.dims[g]
        branches.append(_Branch(pos, seg, d, next_pow2(d), rows_padded(max(plan.num_rows[f] for f in feats))))
    return [g for g, _, _ in groups], tuple(branches), pm, feature_table(plan)


# -- packed counting --------------------------------------------------------------------
# A step loads a [bags, C] tile: row b is C consecutive ids of bag b (positions
# lo_b + i * C + j), so each bag's ids are one contiguous run (coalesced). Instruction
# counts per id (E_padded = 64, SASS-level estimates, per-step loop overhead amortized):
# ~8 (word = id & 15; shift = ((id >> 4) & 3) << 3; inc = 1 << shift; valid = 0 <= id <
# E_padded; select) + 16 x (compare, select, add) = ~56, against ~192 for one compare per
# row (E_padded = 16/32 still does 16 words: ~56).


def _count_packed(indices_ref, lo, hi, n_bad, *, bags: int, c: int, rows: int, lookahead: int):
    """Counts of the ids at positions [lo_b, hi_b) of each bag b (`lo`, `hi`: [bags] int32).

    Returns (chunks, bad): `chunks` is a list of (first row, counts [bags, 16] int32) whose
    column r counts row `first + r` (exact integers); `bad` the bad-id count (`n_bad(ids)`: elementwise 0/1,
    summed once after the loop).
    """
    j = jnp.arange(c, dtype=jnp.int32)
    n_steps = (jnp.max(hi - lo) + c - 1) // c

    def load(i):  # raw tile; nothing here may wait on the load (it stays in flight `lookahead` steps)
        pos = lo[:, None] + (i * c + j)[None, :]
        return plgpu.load(indices_ref.at[pos], mask=pos < hi[:, None], other=-1)

    w = jnp.arange(WORDS, dtype=jnp.int32)

    def consume(state, ids):
        # Row id = 16 * byte + word: 8-bit counter `byte` of word `word`. A counter of slot
        # (b, j) sees ids j, j + C, ... of its bag: ceil(head / C) <= 255 (`HistogramConfig`), no carry.
        acc, bad = state
        ok = (ids >= 0) & (ids < rows)
        inc = jnp.where(ok, jnp.left_shift(jnp.int32(1), ((ids >> 4) & 3) << 3), 0)
        word = ids & (WORDS - 1)
        return acc + jnp.where(word[:, :, None] == w[None, None, :], inc[:, :, None], 0), bad + n_bad(ids)

    state = (jnp.zeros((bags, c, WORDS), jnp.int32), jnp.zeros((bags, c), jnp.int32))
    if lookahead:
        def step(i, carry):
            nxt = load(i + lookahead)
            return (consume(carry[0], carry[1]),) + carry[2:] + (nxt,)

        carry = (state,) + tuple(load(k) for k in range(lookahead))
        acc, bad = jax.lax.fori_loop(0, n_steps, step, carry)[0]
    else:
        acc, bad = jax.lax.fori_loop(0, n_steps, lambda i, st: consume(st, load(i)), state)
    # Unpack before summing over C: a bag's count may reach `head` (256 by default).
    counts = [(WORDS * byte, jnp.sum((acc >> (8 * byte)) & 255, axis=1)) for byte in range(rows // WORDS)]
    return counts, jnp.sum(bad, dtype=jnp.int32)


def _hist_branch(
    pid, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, w_ref, out_ref, bad_ref, counts_ref,
    *, br: _Branch, cfg: HistogramConfig, pooling: str, check_upper: bool, live,
):
    def meta(ref, cols, row, col):
        return plgpu.load(ref.at[cols * row + col])

    bags = cfg.bags
    f, first, nbags, b0 = programs.locate(br.seg, pid - br.seg.prog_start, flist_ref, prefix_ref, live)

    def body():
        g = jnp.arange(bags, dtype=jnp.int32)
        bag_ok = g < nbags
        start, length, malformed = programs.bag_extent(offsets_ref, first + g, bag_ok, indices_ref.shape[0])
        num_rows = meta(feat_ref, META_COLS, f, NUM_ROWS)
        row_offset = meta(feat_ref, META_COLS, f, ROW_OFFSET)
        out_base = meta(feat_ref, META_COLS, f, OUT_BASE)
        out_stride = meta(feat_ref, META_COLS, f, OUT_STRIDE)

        def n_bad(ids):  # elementwise: summed after the loops, not per step
            if bad_ref is None:
                return jnp.zeros(ids.shape, jnp.int32)
            return ((ids != -1) & ((ids < 0) | (ids >= num_rows))).astype(jnp.int32)

        # 1. Histogram of the first `head` ids of each bag: counts[b, e] = #{j < head : id_bj == e}.
        head = cfg.head
        chunks, bad = _count_packed(indices_ref, start, start + jnp.minimum(length, head), n_bad, bags=bags,
                                    c=cfg.resolved_ids_per_step(), rows=br.rows_padded, lookahead=cfg.lookahead)

        # 2. counts @ table on tensor cores (rows past the table's E are zero), one dot per chunk of rows.
        cols = jnp.arange(br.block_dim, dtype=jnp.int32)
        col_ok = cols < br.dim
        acc = None
        for r0, cnt in chunks:
            e = r0 + jnp.arange(cnt.shape[1], dtype=jnp.int32)
            table = plgpu.load(
                w_ref.at[(row_offset + e)[:, None], cols[None, :]],
                mask=(e < num_rows)[:, None] & col_ok[None, :], other=0,
            )
            part = jnp.dot(cnt.astype(jnp.float16), table, preferred_element_type=jnp.float32)
            acc = part if acc is None else acc + part

        # 3. Ids past `head`: the scalar gather path, unrolled.
        u_n = cfg.tail_unroll
        n_tail = (jnp.max(length - head) + u_n - 1) // u_n

        def tail(it, carry):
            acc, bad = carry
            for u in range(u_n):
                k = head + it * u_n + u
                in_bag = k < length
                idx = plgpu.load(indices_ref.at[start + k], mask=in_bag, other=-1)
                ok = idx >= 0
                if check_upper:
                    ok = ok & (idx < num_rows)
                x = plgpu.load(w_ref.at[(row_offset + idx)[:, None], cols[None, :]],
                               mask=ok[:, None] & col_ok[None, :], other=0)
                acc = acc + x.astype(jnp.float32)
                bad = bad + n_bad(idx)
            return acc, bad

        acc, tail_bad = jax.lax.fori_loop(0, jnp.maximum(n_tail, 0), tail, (acc, jnp.zeros((bags,), jnp.int32)))
        bad = bad + jnp.sum(tail_bad, dtype=jnp.int32)
        if pooling == "mean":
            acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
        bag = b0 + g
        ptr = (out_base + bag * out_stride)[:, None] + cols[None, :]
        plgpu.store(out_ref.at[ptr], acc.astype(out_ref.dtype), mask=bag_ok[:, None] & col_ok[None, :])
        if bad_ref is not None:  # two slots per program: bad ids, malformed offsets entries
            plgpu.store(bad_ref.at[2 * pid], bad)
            plgpu.store(bad_ref.at[2 * pid + 1], jnp.sum(malformed, dtype=jnp.int32))
        if counts_ref is not None:
            rows = pid * bags + g
            for r0, cnt in chunks:
                e = r0 + jnp.arange(cnt.shape[1], dtype=jnp.int32)
                plgpu.store(counts_ref.at[rows[:, None], e[None, :]], cnt.astype(jnp.int32))

    if counts_ref is not None:  # the saved counts need every program's rows
        body()
        return
    # A program with no bags (the end of a feature, or a feature `long_bags` gave to the generic kernel) reads nothing:
    # without this it would still load its table rows and run the dots.
    pl.when(nbags > 0)(body)
    if bad_ref is not None:
        @pl.when(nbags <= 0)
        def _():
            plgpu.store(bad_ref.at[2 * pid], jnp.int32(0))
            plgpu.store(bad_ref.at[2 * pid + 1], jnp.int32(0))


def _hist_kernel(*refs, branches, n_buffers, pooling, check_upper, count_invalid, save_counts, cfg, aliased,
                 take):
    flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref = refs[:5]
    live = None if take is None else (refs[5], take)  # `histogram_forward`'s `long_bags` operand
    k = 5 + (take is not None)
    w_refs = refs[k : k + n_buffers]
    rest = list(refs[k + n_buffers :])
    if aliased:
        rest.pop(0)  # the input side of the aliased output buffer
    out_ref = rest.pop(0)
    bad_ref = rest.pop(0) if count_invalid else None
    counts_ref = rest.pop(0) if save_counts else None
    pid = pl.program_id(0)
    for br in branches:
        @pl.when((pid >= br.seg.prog_start) & (pid < br.seg.prog_end))
        def _(br=br):
            _hist_branch(
                pid, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, w_refs[br.buffer], out_ref, bad_ref,
                counts_ref, br=br, cfg=cfg, pooling=pooling, check_upper=check_upper, live=live,
            )


def histogram_forward(
    out_flat: jax.Array | None,  # pooled output with the other features' columns written, or None
    buffers: dict,
    layout: StorageLayout,
    plan: FeaturePlan,
    features,  # the features taking this path
    indices: jax.Array,
    offsets: jax.Array,
    *,
    pooling: str,
    check_upper: bool,
    interpret: bool,
    config: HistogramConfig | None = None,
    count_invalid: bool = False,
    save_counts: bool = False,
    long_bags=None,
):
    """Writes the histogram features' columns into `out_flat` (aliased, no copy).

    With `out_flat=None` (every feature takes this path) the output is fresh.
    `long_bags` (traced `[F]` 0/1, see `long_bags`): features of `features`
    with `long_bags == 0` are left as they are (the generic kernel, given the same array, wrote them).

    Returns `out_flat`, plus `[2]` counts (`count_invalid`: bad ids skipped, malformed offsets entries) and
    the per-bag counts `[programs * bags, E_padded]` int32 (`save_counts`; row
    `p * bags + b` is bag b of program p, in `histogram_programs` order), each when asked.
    """
    cfg = config or HistogramConfig()
    used, branches, pm, feat_meta = _schedule(layout, plan, tuple(features), cfg.bags)
    n_prog = pm.num_programs
    out_shape = [jax.ShapeDtypeStruct((plan.out_size,), jnp.float32)]
    if count_invalid:
        out_shape.append(jax.ShapeDtypeStruct((2 * n_prog,), jnp.int32))
    if save_counts:
        rows = max(b.rows_padded for b in branches)
        out_shape.append(jax.ShapeDtypeStruct((n_prog * cfg.bags, rows), jnp.int32))
    kernel = functools.partial(
        _hist_kernel, branches=branches, n_buffers=len(used), pooling=pooling, check_upper=check_upper,
        count_invalid=count_invalid, save_counts=save_counts, cfg=cfg, aliased=out_flat is not None,
        take=None if long_bags is None else 1,  # the long-bag features: the generic kernel takes the 0s
    )
    args = [*programs.operands(pm), programs.const(feat_meta), offsets, indices]
    if long_bags is not None:
        args.append(long_bags)
    args += [buffers[layout.key(g)] for g in used]
    if out_flat is not None:
        args.append(out_flat)
    res = pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(n_prog,),
        input_output_aliases={len(args) - 1: 0} if out_flat is not None else {},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="tbe_histogram_forward",
    )(*args)
    out = [res[0]]
    if count_invalid:
        out.append(jnp.sum(res[1].reshape(-1, 2), axis=0, dtype=jnp.int32))
    if save_counts:
        out.append(res[-1])
    return out[0] if len(out) == 1 else tuple(out)


def histogram_programs(plan: FeaturePlan, features, bags: int | None = None) -> np.ndarray:
    """(feature, bag) of each row of the saved counts; bag -1 for padding rows. `bags`: the forward's
    `HistogramConfig.bags` (None: the default config's)."""
    bags = HistogramConfig().bags if bags is None else bags
    out = []
    pm = programs.build(plan.bag_base, plan.batch, [(feats, b) for _, feats, b in _groups(plan, features, bags)])
    for f, _, count, b0 in programs.rows(pm).tolist():
        out.extend((f, b0 + i if i < count else -1) for i in range(bags))
    return np.asarray(out, np.int32).reshape(-1, 2)
