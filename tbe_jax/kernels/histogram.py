"""Small-table histogram forward: counts x table on tensor cores (seed: FBTriton).

For a feature whose table is tiny (E <= 64) and whose bags are long, gathering
rows one by one re-reads the same few rows hundreds of times. Instead a program
takes `bags` bags (16 by default), counts how often each of the table's rows
occurs among the first 256 ids of each bag (`counts[bags, E]`), and computes
`counts @ table` with one tensor-core dot; ids past the 256th go through the
scalar gather path.

Counting (`HistogramConfig.counting`; per-id instruction counts above `count_tiles`):

- 2 (default): a step loads a 2-D `[bags, C]` id tile (each bag's C ids one
  contiguous run), compares each id with every row and adds the 0/1 hits into a
  deferred `[bags, C, E_padded]` int32 accumulator, summed over C once at the end
  (the compare scheme of the kernel before d4971a7, 0.153 ms on smalltable).
- 3: the same tile; an int32 word holds four 8-bit counters, row `16 * byte +
  word`: per id one compare per word (16) instead of per row (64), adding
  `1 << 8 * byte`; unpacked at the end, and `counts @ table` is one dot per byte.
- 4: the same tile flattened to K = bags * C positions (position p is id `p % C`
  of bag `p // C`), its fp16 one-hot `O[p, e] = (id_p == e)` added to `counts`
  on tensor cores as `S @ O`, `S[b, p] = (p // C == b)` the constant
  bag-membership matrix: no per-id adds.
- 1: as 4, but each step gathers the K ids as one flat vector (`count_ids`, which
  the backward also uses); 0: the flat gather with compare-and-add into a
  `[K, E_padded]` accumulator, reduced once at the end by `S @ hits`.

`lookahead` keeps the id tiles of the next steps in flight while one is counted;
`align` rounds each bag's window start down to a vector multiple (see
`HistogramConfig`).

Exactness: counts are integers <= 256, exact in fp16, and the table is fp16, so
every product is exact in the fp32 accumulator: the result equals the generic
path's up to fp32 rounding of the sum order. (FBTriton's fp16 high/low split is
only needed where an fp32 operand meets the tensor cores, as in the backward's
`counts^T @ dout`, see `histogram_backward`; here both operands are exactly fp16.)

Eligibility is static (see `eligible`): E <= 64, 64 <= D <= 128, the table's
`bag_size_hint >= 64`, fp16 weights, fp32 output, unweighted, no VBE.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import pallas_call, pl, plgpu
from tbe_jax.kernels import programs  # the program map and feature table are shared with the generic kernel
from tbe_jax.kernels.programs import META_COLS, NUM_ROWS, OUT_BASE, OUT_STRIDE, ROW_OFFSET, feature_table
from tbe_jax.specs import FeaturePlan, StorageLayout, TableSpec, next_pow2

BAGS = 16  # default bags per program
HEAD = 256  # ids per bag counted into the histogram; the rest take the gather path
MAX_ROWS, MIN_DIM, MAX_DIM, MIN_BAG = 64, 64, 128, 64
WORDS = 16  # counting=3: int32 words per bag slot, each holding E_padded / 16 8-bit counters


def _pow2_floor(v: int) -> int:
    return 1 << (int(v).bit_length() - 1)


def _pow2(v) -> bool:
    return isinstance(v, (int, np.integer)) and v >= 1 and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class HistogramConfig:
    """Knobs of the histogram kernels (forward, and the backward in `histogram_backward`).

    Forward attributes:
      bags: bags per program (the M of the counts dot; a power of 2 >= 16).
      ids_per_step: C, ids per bag per counting step: a step's tile is
        `bags x C` ids. A power of 2 <= 256, or 0 (default) for the mode's own
        choice (`ids_per_step_for`): modes 0, 1, 4: 16; mode 2: the `[bags, C, E_padded]`
        compare tile at 8192 elements (C = 8 for E_padded = 64, bags = 16); mode 3:
        the `[bags, C, 16]` packed tile at 2048 elements (C = 8 for bags = 16; with
        one warp, C = 8 measured 0.070 ms on the H200 `smalltable` against 0.091 for
        C = 16 at 2 warps and 0.115 for C = 32 at 4 warps,
        `benchmarks/results/histsweep2-20261129-1808-*`).
      counting: how a step's ids become counts (see the module docstring):
        3 (default; the fastest on the H200 `smalltable` sweeps: 0.115 ms vs 0.134 for
        mode 2 at 4 warps, `benchmarks/results/forward-20261129-155208-*`; 0.070 vs
        0.190 at 1 warp, `histsweep3-20261129-1817-*`), see below;
        2 2-D `[bags, C]` id tile (each bag's C ids contiguous), compare
        and int32 add into a deferred `[bags, C, E_padded]` accumulator, summed
        over C once at the end (the scheme of the 0.153 ms kernel);
        3 the same 2-D tile, compare on the id's word (`id % 16`) and add the
        id's byte (`1 << 8 * (id // 16)`) into a deferred `[bags, C, 16]` int32
        accumulator of four 8-bit counters per element (needs C >= 2);
        4 the same 2-D tile, flattened, one-hot `[bags * C, E_padded]` and `S @ O`
        on tensor cores every step;
        1 flat `[bags * C]` id gather, one-hot and `S @ O` (tensor cores);
        0 flat id gather, compare-and-add into a `[bags * C, E]` accumulator.
      half_compare: build the one-hot (modes 1, 4) by comparing ids and row numbers as fp16
        (exact: rows < 64, and no id >= 64 rounds below 64) instead of int32.
      lookahead: steps of ids loaded ahead of the one being counted (0: none; each
        step's load then waits a full memory latency). Bytes in flight per
        program: `(lookahead + 1) * bags * C * 4`.
      align: modes 2-4: each bag's id window starts at its first id rounded down
        to a multiple of `align` (a power of 2, clamped to C; 1: off), hinted with
        `pl.multiple_of`, so the per-bag loads can be `align`-wide vectors; the ids
        before the bag's start are masked after the load, and the last < `align`
        ids of each bag's head come in one extra narrow tile.
      tail_unroll: ids per bag loaded together on the gather path (ids >= 256).
      num_warps, num_stages: launch knobs of the forward kernel (one warp: a program
        is a short latency-bound chain, and more resident programs hide more of it).

    Backward attributes (`histogram_backward`, `apply_gradients`, `jax.grad`,
    the fused path):
      grad_programs: programs of the gradient kernel; each sums `counts^T @ dout`
        over a contiguous range of tiles and writes one fp32 `[E, D]` partial.
      grad_bags, grad_ids_per_step, grad_lookahead, grad_num_warps: its tile,
        id lookahead and warps. The one-hot of a step is `grad_bags * grad_ids_per_step`
        x E; 32 x 64 asks about 274 KB of shared memory on an H200 (limit 227 KB) and
        fails to compile with RESOURCE_EXHAUSTED (the default 16 x 16 fits).
      update_partials, update_num_warps: partials summed per step by the
        reduction/update kernel (one program per table row), and its warps.
    """

    bags: int = BAGS
    ids_per_step: int = 0
    counting: int = 3
    half_compare: bool = True
    lookahead: int = 3
    align: int = 1
    tail_unroll: int = 4
    num_warps: int = 1
    num_stages: int = 1
    grad_programs: int = 264  # 2 per SM on an H200 (132 SMs)
    grad_bags: int = BAGS
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
        if not (self.ids_per_step == 0 or _pow2(self.ids_per_step) and self.ids_per_step <= HEAD):
            raise ValueError(f"HistogramConfig.ids_per_step={self.ids_per_step!r} must be 0 (auto) or a power of 2 "
                             f"<= {HEAD}")
        if not _pow2(self.grad_ids_per_step) or self.grad_ids_per_step > HEAD:
            raise ValueError(f"HistogramConfig.grad_ids_per_step={self.grad_ids_per_step!r} must be a power of 2 "
                             f"<= {HEAD}")
        for name in ("num_warps", "grad_num_warps", "update_partials", "update_num_warps", "align"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"HistogramConfig.{name}={getattr(self, name)!r} must be a power of 2")
        for name, low in (("tail_unroll", 1), ("num_stages", 1), ("grad_programs", 1), ("lookahead", 0),
                          ("grad_lookahead", 0)):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"HistogramConfig.{name}={v!r} must be an int >= {low}")
        if self.counting not in (0, 1, 2, 3, 4):
            raise ValueError(f"HistogramConfig.counting={self.counting!r} must be 0 (flat compare), 1 (flat tensor "
                             "cores), 2 (tile compare), 3 (tile packed compare) or 4 (tile tensor cores)")
        if self.counting == 3 and self.ids_per_step == 1:
            raise ValueError("HistogramConfig.ids_per_step=1 with counting=3: a packed 8-bit counter would reach "
                             f"{HEAD}; use C >= 2")
        # 0/1 from a command line (bench --hist-configs) are fine for the flags.
        object.__setattr__(self, "counting", int(self.counting))
        object.__setattr__(self, "half_compare", bool(self.half_compare))

    def ids_per_step_for(self, rows_padded: int) -> int:
        """C of the forward for a table of E_padded = `rows_padded` (resolves `ids_per_step=0`)."""
        if self.ids_per_step:
            return self.ids_per_step
        if self.counting == 2:  # the [bags, C, E_padded] int32 compare tile at 8192 elements
            return _pow2_floor(max(1, 8192 // (self.bags * rows_padded)))
        if self.counting == 3:  # the [bags, C, 16] packed tile at 2048 elements (64 registers a thread at 1 warp)
            return max(2, _pow2_floor(max(1, 2048 // (self.bags * WORDS))))
        return 16


def eligible(table: TableSpec, weights_dtype, output_dtype) -> bool:
    """Static part of the eligibility (per-call: unweighted and no VBE)."""
    hint = table.bag_size_hint
    return (
        table.num_embeddings <= MAX_ROWS
        and MIN_DIM <= table.embedding_dim <= MAX_DIM
        and hint is not None
        and hint >= MIN_BAG
        and jnp.dtype(weights_dtype) == jnp.float16
        and jnp.dtype(output_dtype) == jnp.float32
    )


@dataclasses.dataclass(frozen=True)
class _Branch:
    buffer: int
    seg: programs.Segment
    dim: int
    block_dim: int
    rows_padded: int  # >= 16: a tensor-core dot needs K >= 16


def rows_padded(num_rows: int) -> int:
    """E_padded: the one-hot's width (a power of 2 >= 16, a dot's minimum)."""
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


# -- tile helpers shared with the backward ---------------------------------------------
# A counting step covers C ids of each of `bags` bags as one flat vector of K = bags * C
# positions: position p is id (k0 + p % C) of bag p // C. Loading the positions' bag
# starts once per program (from `offsets`, L1-resident) makes every step's id load a
# single [K] gather with no per-step index arithmetic beyond one add.


def tile_positions(offsets_ref, first, nbags, *, bags: int, c: int):
    """(bag of p [K], slot p % C [K], its bag's first id [K], its bag's length [K]); 0 for padding bags."""
    p = jnp.arange(bags * c, dtype=jnp.int32)
    pb, pc = p // c, p % c
    ok = pb < nbags
    p_start = plgpu.load(offsets_ref.at[first + pb], mask=ok, other=0)
    p_len = plgpu.load(offsets_ref.at[first + pb + 1], mask=ok, other=0) - p_start
    return pb, pc, p_start, jnp.where(ok, p_len, 0)


def load_ids(indices_ref, p_start, pc, limit, k0):
    """Ids k0 + p % C of each position's bag, -1 where that is at or past `limit` ([K])."""
    k = k0 + pc
    return plgpu.load(indices_ref.at[p_start + k], mask=k < limit, other=-1)


def one_hot(ids, e, *, half: bool, rows_first: bool = False):
    """fp16 0/1 `[K, E_padded]` (`[E_padded, K]` with `rows_first`): id_p == e.

    `half` compares in fp16: exact for e < 2048, and rounding is monotonic, so no
    id outside [0, E_padded) compares equal to a row. -1 (padding) matches nothing.
    """
    if half:
        ids, e = ids.astype(jnp.float16), e.astype(jnp.float16)
    if rows_first:
        return (e[:, None] == ids[None, :]).astype(jnp.float16)
    return (ids[:, None] == e[None, :]).astype(jnp.float16)


def count_ids(indices_ref, p_start, pc, limit, k0, n_steps, membership, n_bad, *, c, rows, counting=1,
              half=True, lookahead=1, rows_first=False):
    """Counts of ids k0 .. k0 + n_steps * C - 1 (below `limit`) of each bag, fp32 and exact.

    `membership` is S `[bags, K]` (or S^T `[K, bags]` with `rows_first`); the
    result is `[bags, E_padded]` (or `[E_padded, bags]`). Also returns the
    bad-id count (`n_bad(ids)` summed over the steps).
    """
    e = jnp.arange(rows, dtype=jnp.int32)
    if counting == 1:
        shape = (rows, membership.shape[1]) if rows_first else (membership.shape[0], rows)
        init = jnp.zeros(shape, jnp.float32)

        def add(acc, ids):
            o = one_hot(ids, e, half=half, rows_first=rows_first)
            pair = (o, membership) if rows_first else (membership, o)
            return acc + jnp.dot(*pair, preferred_element_type=jnp.float32)
    else:  # compare-and-add per (position, row); one dot reduces over each bag's positions at the end
        if rows_first:
            raise ValueError("counting=0 gives [bags, E] counts only")
        init = jnp.zeros((membership.shape[1], rows), jnp.int32)
        add = lambda acc, ids: acc + (ids[:, None] == e[None, :]).astype(jnp.int32)  # noqa: E731

    def ids_at(i):
        return load_ids(indices_ref, p_start, pc, limit, k0 + i * c)

    if lookahead:
        # Software pipelining by hand: the ids of the next `lookahead` steps are in flight
        # (masked off past the limit) while this step's ids are counted.
        def step(i, carry):
            acc, bad, queue = carry[0], carry[1], carry[2:]
            nxt = ids_at(i + lookahead)
            return (add(acc, queue[0]), bad + n_bad(queue[0])) + queue[1:] + (nxt,)

        init = (init, jnp.int32(0)) + tuple(ids_at(j) for j in range(lookahead))
        acc, bad = jax.lax.fori_loop(0, n_steps, step, init)[:2]
    else:
        def step(i, carry):
            acc, bad = carry
            ids = ids_at(i)
            return add(acc, ids), bad + n_bad(ids)

        acc, bad = jax.lax.fori_loop(0, n_steps, step, (init, jnp.int32(0)))
    if counting == 0:  # hits per position <= HEAD / C: exact in fp16
        acc = jnp.dot(membership, acc.astype(jnp.float16), preferred_element_type=jnp.float32)
    return acc, bad


# -- 2-D tile counting (modes 2, 3, 4) -------------------------------------------------
# A step loads a [bags, C] tile: row b is C consecutive ids of bag b (positions
# base_b + i * C + j), so each bag's ids are one contiguous run (coalesced, and
# vectorizable where `align` makes base_b a known multiple). Instruction counts per id
# (E_padded = 64, SASS-level estimates, per-step loop overhead amortized):
#   mode 2: 64 x (compare, select, add) = ~192, + ~2 to broadcast the id over the rows.
#   mode 3: ~8 per id (word = id & 15; shift = ((id >> 4) & 3) << 3; inc = 1 << shift;
#           valid = 0 <= id < E_padded; select) + 16 x (compare, select, add) = ~56.
#           For E_padded = 16/32 mode 3 still does 16 words: ~56 vs mode 2's ~48/~96.
#   mode 4: ~1 (fp16 convert) + 64 x (compare, select to fp16) = ~129 on the vector units,
#           + the one-hot's trip to the dot-operand layout (~128 bytes of shared memory
#           stored and loaded per id) + 0.5 mma.m16n8k16 per id (1024 MACs: S is
#           [bags, bags * C], 1/bags of it non-zero); no per-id adds.
#   (flat modes, `count_ids`: mode 1 as mode 4 plus ~3 per id of gather index arithmetic
#   and a scalar 4-byte load per id; mode 0 as mode 2 plus the same gather overhead.)
# With align > 1 every mode adds ~3 per id (position, compare, select) to mask the ids
# loaded before the bag's start.


def _hits(ids, rows_vec):
    """#{j : ids[b, j] == rows_vec[r]} as int32 [bags, len(rows_vec)] (-1 matches nothing)."""
    return jnp.sum((ids[:, :, None] == rows_vec[None, None, :]).astype(jnp.int32), axis=1)


def count_tiles(indices_ref, lo, hi, n_bad, *, bags: int, c: int, rows: int, counting: int, half: bool,
                lookahead: int, align: int):
    """Counts of the ids at positions [lo_b, hi_b) of each bag b (`lo`, `hi`: [bags] int32).

    Returns (chunks, bad): `chunks` is a list of (first row, counts [bags, width]) whose
    column r counts row `first + r` (exact integers, int32 or fp32); `bad` the bad-id count.
    """
    j = jnp.arange(c, dtype=jnp.int32)
    a = min(align, c)
    if a > 1:  # windows start at a multiple of `a`: vector loads; ids before lo are masked after the load
        base = pl.multiple_of(lo & -a, (a,))
        lim = pl.multiple_of(hi & -a, (a,))
    else:
        base, lim = lo, hi
    n_steps = (jnp.max(lim - base) + c - 1) // c

    def load(i):  # raw tile; nothing here may wait on the load (it stays in flight `lookahead` steps)
        pos = base[:, None] + (i * c + j)[None, :]
        return plgpu.load(indices_ref.at[pos], mask=pos < lim[:, None], other=-1)

    def valid(i, raw):
        if a == 1:
            return raw
        pos = base[:, None] + (i * c + j)[None, :]
        return jnp.where(pos >= lo[:, None], raw, -1)

    e = jnp.arange(rows, dtype=jnp.int32)
    w = jnp.arange(WORDS, dtype=jnp.int32)
    if counting == 2:
        init = jnp.zeros((bags, c, rows), jnp.int32)

        def add(acc, ids):
            return acc + (ids[:, :, None] == e[None, None, :]).astype(jnp.int32)
    elif counting == 3:
        init = jnp.zeros((bags, c, WORDS), jnp.int32)

        def add(acc, ids):
            # Row id = 16 * byte + word: 8-bit counter `byte` of word `word`. A counter of slot
            # (b, j) sees ids j, j + C, ... of its bag: <= HEAD / C <= 128, no carry.
            ok = (ids >= 0) & (ids < rows)
            inc = jnp.where(ok, jnp.left_shift(jnp.int32(1), ((ids >> 4) & 3) << 3), 0)
            word = ids & (WORDS - 1)
            return acc + jnp.where(word[:, :, None] == w[None, None, :], inc[:, :, None], 0)
    elif counting == 4:
        g = jnp.arange(bags, dtype=jnp.int32)
        p = jnp.arange(bags * c, dtype=jnp.int32)
        membership = (g[:, None] == (p // c)[None, :]).astype(jnp.float16)  # S [bags, bags * C]
        init = jnp.zeros((bags, rows), jnp.float32)

        def add(acc, ids):
            o = one_hot(ids.reshape(bags * c), e, half=half)  # row-major: position b * C + j
            return acc + jnp.dot(membership, o, preferred_element_type=jnp.float32)
    else:
        raise ValueError(f"count_tiles: counting={counting!r} is not a tile mode")

    def consume(i, state, raw):
        acc, bad = state
        ids = valid(i, raw)
        return add(acc, ids), bad + n_bad(ids)

    state = (init, jnp.int32(0))
    if lookahead:
        def step(i, carry):
            nxt = load(i + lookahead)
            return (consume(i, carry[0], carry[1]),) + carry[2:] + (nxt,)

        carry = (state,) + tuple(load(k) for k in range(lookahead))
        acc, bad = jax.lax.fori_loop(0, n_steps, step, carry)[0]
    else:
        acc, bad = jax.lax.fori_loop(0, n_steps, lambda i, st: consume(i, st, load(i)), state)

    extra = None
    if a > 1:  # the last (hi - lim) < a ids of each bag's window, one narrow masked tile
        pos = lim[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]
        extra = plgpu.load(indices_ref.at[pos], mask=(pos < hi[:, None]) & (pos >= lo[:, None]), other=-1)
        bad = bad + n_bad(extra)

    if counting == 3:
        chunks = []
        for byte in range(rows // WORDS):  # unpack before summing over C: a bag's count may reach 256
            cnt = jnp.sum((acc >> (8 * byte)) & 255, axis=1)
            if extra is not None:
                cnt = cnt + _hits(extra, WORDS * byte + w)
            chunks.append((WORDS * byte, cnt))
        return chunks, bad
    cnt = jnp.sum(acc, axis=1) if counting == 2 else acc
    if extra is not None:
        cnt = cnt + _hits(extra, e).astype(cnt.dtype)
    return [(0, cnt)], bad


def _hist_branch(
    pid, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, w_ref, out_ref, bad_ref, counts_ref,
    *, br: _Branch, cfg: HistogramConfig, pooling: str, check_upper: bool,
):
    def meta(ref, cols, row, col):
        return plgpu.load(ref.at[cols * row + col])

    bags = cfg.bags
    f, first, nbags, b0 = programs.locate(br.seg, pid - br.seg.prog_start, flist_ref, prefix_ref)
    g = jnp.arange(bags, dtype=jnp.int32)
    bag_ok = g < nbags
    start = plgpu.load(offsets_ref.at[first + g], mask=bag_ok, other=0)
    end = plgpu.load(offsets_ref.at[first + g + 1], mask=bag_ok, other=0)
    num_rows = meta(feat_ref, META_COLS, f, NUM_ROWS)
    row_offset = meta(feat_ref, META_COLS, f, ROW_OFFSET)
    out_base = meta(feat_ref, META_COLS, f, OUT_BASE)
    out_stride = meta(feat_ref, META_COLS, f, OUT_STRIDE)
    length = end - start

    def n_bad(ids):
        if bad_ref is None:
            return jnp.int32(0)
        return jnp.sum((ids != -1) & ((ids < 0) | (ids >= num_rows)), dtype=jnp.int32)

    # 1. Histogram of the first HEAD ids of each bag: counts[b, e] = #{j < HEAD : id_bj == e}.
    c = cfg.ids_per_step_for(br.rows_padded)
    if cfg.counting >= 2:  # 2-D [bags, C] tiles
        chunks, bad = count_tiles(indices_ref, start, start + jnp.minimum(length, HEAD), n_bad, bags=bags, c=c,
                                  rows=br.rows_padded, counting=cfg.counting, half=cfg.half_compare,
                                  lookahead=cfg.lookahead, align=cfg.align)
    else:  # flat [bags * C] id vector; the reduction over a bag's ids done by S @ (one-hot or hits)
        pb, pc, p_start, p_len = tile_positions(offsets_ref, first, nbags, bags=bags, c=c)
        membership = (g[:, None] == pb[None, :]).astype(jnp.float16)  # S [bags, K], once per program
        head = jnp.minimum(p_len, HEAD)
        counts, bad = count_ids(indices_ref, p_start, pc, head, 0, (jnp.max(head) + c - 1) // c, membership,
                                n_bad, c=c, rows=br.rows_padded, counting=cfg.counting, half=cfg.half_compare,
                                lookahead=cfg.lookahead)
        chunks = [(0, counts)]

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

    # 3. Ids past HEAD: the scalar gather path, unrolled.
    u_n = cfg.tail_unroll
    n_tail = (jnp.max(length - HEAD) + u_n - 1) // u_n

    def tail(it, carry):
        acc, bad = carry
        for u in range(u_n):
            k = HEAD + it * u_n + u
            live = k < length
            idx = plgpu.load(indices_ref.at[start + k], mask=live, other=-1)
            ok = idx >= 0
            if check_upper:
                ok = ok & (idx < num_rows)
            x = plgpu.load(w_ref.at[(row_offset + idx)[:, None], cols[None, :]],
                           mask=ok[:, None] & col_ok[None, :], other=0)
            acc = acc + x.astype(jnp.float32)
            bad = bad + n_bad(idx)
        return acc, bad

    acc, bad = jax.lax.fori_loop(0, jnp.maximum(n_tail, 0), tail, (acc, bad))
    if pooling == "mean":
        acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
    bag = b0 + g
    ptr = (out_base + bag * out_stride)[:, None] + cols[None, :]
    plgpu.store(out_ref.at[ptr], acc.astype(out_ref.dtype), mask=bag_ok[:, None] & col_ok[None, :])
    if bad_ref is not None:
        plgpu.store(bad_ref.at[pid], bad)
    if counts_ref is not None:
        rows = pid * bags + g
        for r0, cnt in chunks:
            e = r0 + jnp.arange(cnt.shape[1], dtype=jnp.int32)
            plgpu.store(counts_ref.at[rows[:, None], e[None, :]], cnt.astype(jnp.int32))


def _hist_kernel(*refs, branches, n_buffers, pooling, check_upper, count_invalid, save_counts, cfg, aliased):
    flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref = refs[:5]
    w_refs = refs[5 : 5 + n_buffers]
    rest = list(refs[5 + n_buffers :])
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
                counts_ref, br=br, cfg=cfg, pooling=pooling, check_upper=check_upper,
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
):
    """Writes the histogram features' columns into `out_flat` (aliased, no copy).

    With `out_flat=None` (every feature takes this path) the output is fresh.

    Returns `out_flat`, plus the number of skipped bad ids (`count_invalid`) and
    the per-bag counts `[programs * bags, E_padded]` int32 (`save_counts`; row
    `p * bags + b` is bag b of program p, in `histogram_programs` order), each when asked.
    """
    cfg = config or HistogramConfig()
    used, branches, pm, feat_meta = _schedule(layout, plan, tuple(features), cfg.bags)
    n_prog = pm.num_programs
    out_shape = [jax.ShapeDtypeStruct((plan.out_size,), jnp.float32)]
    if count_invalid:
        out_shape.append(jax.ShapeDtypeStruct((n_prog,), jnp.int32))
    if save_counts:
        rows = max(b.rows_padded for b in branches)
        out_shape.append(jax.ShapeDtypeStruct((n_prog * cfg.bags, rows), jnp.int32))
    kernel = functools.partial(
        _hist_kernel, branches=branches, n_buffers=len(used), pooling=pooling, check_upper=check_upper,
        count_invalid=count_invalid, save_counts=save_counts, cfg=cfg, aliased=out_flat is not None,
    )
    args = [*programs.operands(pm), jnp.asarray(feat_meta.reshape(-1)), offsets, indices]
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
        out.append(jnp.sum(res[1]))
    if save_counts:
        out.append(res[-1])
    return out[0] if len(out) == 1 else tuple(out)


def histogram_programs(plan: FeaturePlan, features, bags: int = BAGS) -> np.ndarray:
    """(feature, bag) of each row of the saved counts; bag -1 for padding rows."""
    out = []
    pm = programs.build(plan.bag_base, plan.batch, [(feats, b) for _, feats, b in _groups(plan, features, bags)])
    for f, _, count, b0 in programs.rows(pm).tolist():
        out.extend((f, b0 + i if i < count else -1) for i in range(bags))
    return np.asarray(out, np.int32).reshape(-1, 2)
