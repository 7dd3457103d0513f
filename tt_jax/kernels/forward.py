"""Fused FlowTT forward: prefix-shared TT rows, then pooled bags (two Pallas-Triton launches per table group).

1. `tt_rows` (the FlowTT kernel). Per work item of `prefix.build_flow` (a prefix
   group, or a chunk of at most `chunk` of its distinct rows), the program
   computes the prefix product C = G1[i1] G2[i2] ... G_{T-1}[i_{T-1}] once, in
   registers, then every distinct row of the item as C @ G_T[i_T], and stores
   it to a `[cap, D]` buffer of distinct rows. No intermediate goes to memory, except in a forward for
   differentiation (T = 3): each item's prefix product, kept for the backward (`FlowPlan.prefix_c`).

   Tiles (every dot dimension padded to a power of two >= 16 with masked loads):
   - T = 2: C = G1[i1] as `[q1, r1]`, loaded.
   - T >= 3: C2 = X @ Y with X `[q1 q2, q2 r1]`, X[(j1, j2), (j, a)] =
     G1[i1, 0, j1, a] if j == j2 else 0, and Y `[q2 r1, r2]`, Y[(j, a), b] =
     G2[i2, a, j, b]: one tensor-core dot gives C2 `[q1 q2, r2]` directly in the
     row-major (j1, j2) layout (no register reshape; the zero blocks cost
     q2 x the useful FLOPs, which are negligible next to the loads).
   - T = 4: C3 is kept as q3 tiles C2 @ G3[i3][:, j3, :] (`[q1 q2, r3]` each),
     again avoiding a reshape.
   Row stage: `tile_rows` distinct rows at once: G `[r_{T-1}, S q_T]`,
   G[b, (s, j)] = G_T[i_T(s), b, j, 0], and R = C @ G is `[q1..q_{T-1}, S q_T]`,
   stored with row (s) and column (J q_T + j) addresses. The first S rows are
   loaded together with the prefix's core slices (one memory latency for both).

   Schedules (`TTKernelConfig.schedule`): "queue" (persistent programs; each
   takes item `pid` first, then the next one from an atomic counter, claimed
   before the current item is processed so the atomic's latency is hidden:
   dynamic load balancing at chunk granularity, FlowTT 3.4), "static" (persistent
   programs, item t on program t mod P) and "grid" (one program per item slot,
   the baseline: the grid is the static bound `cap`, most programs exit at once).

2. `tt_pool`: bag-parallel pooling of the distinct rows through the lookup ->
   distinct-row map (`inverse`); a program owns `pool_bags` bags of one feature
   and gathers one row per bag per step; per-sample weights, mean as a scale;
   it writes its feature's columns of the `[B, sum D]` output in place, so table
   groups chain through input/output aliasing.

Interpret mode (CPU): the "queue" schedule uses a `fori_loop` over the static
item bound with predication (an atomic inside `while_loop` does not run there);
dots run at HIGHEST precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import pallas_call, pl, plgpu
from tbe_jax.kernels.programs import bag_extent
from tbe_jax.specs import next_pow2
from tt_jax import prefix

_SCHEDULES = ("queue", "static", "grid")
PRECISIONS = {  # TTKernelConfig.precision -> the fp32 dot algorithm on the GPU
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
}
_INT32_MAX = 2**31 - 1
# Columns of the pooling kernel's per-feature table: the feature's index, its first output column.
_FEAT_COLS = 2


@dataclasses.dataclass(frozen=True)
class TTKernelConfig:
    """Knobs of the fused TT forward.

    Attributes:
      schedule: "static" (default: persistent programs, round-robin items),
        "queue" (persistent programs + atomic work counter: FlowTT's work
        stealing) or "grid" (one program per item slot). On the H200 "static"
        was faster than "queue" in every measured run (workload a at every B
        from 2048 to 131072, meta-240/480/788: 8-15%; benchmarks/results/
        tt-20261129-150311-*, tt-2026112915*), hence the default.
      chunk: most distinct rows per work item (0: whole prefix groups, which
        can be p_T rows long). Items are the unit of load balancing; each item
        recomputes its prefix product.
      tile_rows: distinct rows per row-stage dot (a power of 2).
      prefix_reuse: False gives the "unique only" ablation: every distinct row
        is its own item and recomputes its prefix product.
      num_programs: persistent programs ("queue", "static"); None: the
        device's SM count times `programs_per_sm` (capped by the item bound).
      programs_per_sm: see `num_programs`.
      num_warps, num_stages: Triton launch knobs of the rows kernel.
        Defaults (2 warps, `tile_rows` 8, 32 programs per SM) from the H200 sweep on
        workload a (`benchmarks/results/tt-20261201-0403*`, `-0404*`): forward 0.645 ->
        0.488 ms at B = 32768 and 0.350 -> 0.280 at B = 4096 against the earlier (4, 16,
        16); 1 or 8 warps, `tile_rows` 4 or 32, 2 stages were slower.
      precision: fp32 dot algorithm on the GPU: "tf32x3" (three TF32 tensor-core
        passes, about fp32 accuracy), "ieee" (fp32 FMA, no tensor cores), "bf16x3"
        (three bf16 passes, ~1e-5 relative error), "bf16x6" (six bf16 passes) or
        "tf32" (one pass, ~1e-3 relative error). On the H200, training step of
        workload a at B 32768 (kernels, ms) and the max error relative to the
        largest value (forward / core gradients) against fp32 at HIGHEST:
        tf32x3 1.78 (4e-7 / 9e-6), bf16x3 1.63 (7e-6 / 1.4e-5), bf16x6 2.58
        (3e-7 / 8e-6), tf32 1.24 (4e-4 / 1e-3)
        (benchmarks/results/tt-precision-20261201-1235-*). Interpret mode always
        uses HIGHEST.
      pool_bags, pool_unroll, pool_warps: pooling kernel: bags per program,
        steps whose loads are issued together, warps.
      backward: the backward of `TTEmbeddingBag` on this path (`jax.grad`,
        `apply_gradients`, `tbe_jax.train_step`): "pallas" (`tt_jax.kernels.backward`,
        deterministic) or "xla" (`tt_jax.backward`).
      bwd_lookup_tile: sorted lookups per program of the backward's per-row
        gradient sum (a power of 2 >= 16).
      bwd_member_tile: sorted members (prefix groups or distinct rows) per
        program of the per-slice core-gradient sums (a power of 2 >= 16).
      bwd_rows: distinct rows per step of the backward's per-group kernel.
      bwd_num_warps: warps per program of the backward kernels.
      bwd_group_kernel: the backward's per-group kernel for T = 3: "tiles3" (the forward's
        `[q1 q2, r2]` prefix tile: 6 dots per group + 2 per step of rows) or "general" (the
        any-T kernel, `[q1, r]` tiles per middle digit). T = 2 and 4 always use "general".
    """

    schedule: str = "static"
    chunk: int = 64
    tile_rows: int = 8
    prefix_reuse: bool = True
    num_programs: int | None = None
    programs_per_sm: int = 32
    num_warps: int = 2
    num_stages: int = 1
    precision: str = "tf32x3"
    pool_bags: int = 8
    pool_unroll: int = 4
    pool_warps: int = 1
    backward: str = "pallas"
    bwd_lookup_tile: int = 64
    bwd_member_tile: int = 32
    bwd_rows: int = 8
    bwd_num_warps: int = 2
    bwd_group_kernel: str = "tiles3"

    def __post_init__(self):
        if self.bwd_group_kernel not in ("tiles3", "general"):
            raise ValueError("TTKernelConfig.bwd_group_kernel must be 'tiles3' or 'general', "
                             f"got {self.bwd_group_kernel!r}")
        if self.backward not in ("pallas", "xla"):
            raise ValueError(f"TTKernelConfig.backward must be 'pallas' or 'xla', got {self.backward!r}")
        for name in ("bwd_lookup_tile", "bwd_member_tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"TTKernelConfig.{name} must be a power of 2 >= 16, got {v!r}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"TTKernelConfig.schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TTKernelConfig.precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise ValueError(f"TTKernelConfig.chunk must be an int >= 0, got {self.chunk!r}")
        for name in ("tile_rows", "programs_per_sm", "num_warps", "num_stages", "pool_bags", "pool_unroll",
                     "pool_warps", "bwd_rows", "bwd_num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TTKernelConfig.{name} must be a positive int, got {v!r}")
        for name in ("tile_rows", "num_warps", "pool_bags", "pool_warps", "bwd_rows", "bwd_num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"TTKernelConfig.{name} must be a power of 2, got {v}")
        if self.num_programs is not None and (not isinstance(self.num_programs, int) or self.num_programs < 1):
            raise ValueError(f"TTKernelConfig.num_programs must be None or a positive int, got {self.num_programs!r}")

    @staticmethod
    def get_default() -> "TTKernelConfig":
        return TTKernelConfig()

    def programs(self, max_items: int) -> int:
        if self.schedule == "grid":
            return max_items
        p = self.num_programs
        if p is None:
            p = _sm_count() * self.programs_per_sm
        return max(1, min(p, max_items))


def _sm_count() -> int:
    dev = jax.devices()[0]
    n = getattr(dev, "core_count", None)
    return int(n) if isinstance(n, int) and n > 0 else (132 if dev.platform == "gpu" else 2)


def dot_pad(x: int) -> int:
    """Next power of 2, at least 16 (Triton's smallest dot dimension)."""
    return max(16, next_pow2(x))


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static tile geometry of one table group (see the module docstring)."""

    t: int  # cores
    q: tuple[int, ...]
    r: tuple[int, ...]  # full ranks (1, r1, .., 1)
    dim: int
    rows_m: int  # padded rows of C: q1 (T = 2) or q1 q2
    rows_valid: int
    k_x: int  # padded q2 r1 (T >= 3)
    r_pad: tuple[int, ...]  # padded r_t, t = 0..T
    sub_rows: int  # S: distinct rows per row-stage dot
    q_last_pad: int
    n_cols: int  # S * q_last_pad (>= 16)
    list_size: int  # q3 for T = 4, else 1
    wide: bool = False  # 64-bit address arithmetic (a buffer of 2**31 elements or more)

    @property
    def addr(self):
        return jnp.int64 if self.wide else jnp.int32

    @staticmethod
    def make(layout: prefix.StackedTables, tile_rows: int) -> "Tiles":
        q, r, t = layout.q_shapes, layout.full_ranks, layout.num_cores
        rows_valid = q[0] if t == 2 else q[0] * q[1]
        qlp = next_pow2(q[-1])
        sub = max(tile_rows, 16 // qlp)
        return Tiles(t, q, r, layout.dim, dot_pad(rows_valid), rows_valid, dot_pad(q[1] * r[1]) if t >= 3 else 0,
                     tuple(dot_pad(x) for x in r), sub, qlp, sub * qlp, q[2] if t == 4 else 1)


def masked_store(ref, addr, val, mask, interpret):
    """Masked store. Interpret mode scatters masked lanes too (writing back the old value), so there a
    masked lane that aliases a live one could undo its write: send masked lanes past the end (dropped)."""
    if interpret:
        addr = jnp.where(mask, addr, ref.shape[0])
    plgpu.store(ref.at[addr], val, mask=mask)


# TF32x3 dots can be written as three explicit one-pass TF32 dots on operands split in the kernel (`manual=True`;
# the same arithmetic as the dot algorithm's own passes). Triton's TF32x3 keeps all six operand halves live: the
# backward's group kernel needed 255 registers and spilled, 228 without spills written this way; measured on the
# H200 (x3-20261201-1705-*): tt_bwd_groups 0.767 -> 0.731 ms. The forward's rows kernel (255 -> 168 registers)
# got slower with it (0.281 -> 0.290 ms), so the forward keeps the dot algorithm (manual=False).
_TF32_HI = np.uint32(0xFFFFE000)  # TF32 keeps fp32's sign, exponent and top 10 mantissa bits


def tf32_split(x):
    """(hi, lo): x's TF32 bits and the exact fp32 remainder."""
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & _TF32_HI, jnp.float32)
    return hi, x - hi


def dot_general(a, b, dims, precision, *, manual: bool = False):
    """`lax.dot_general` with fp32 accumulation; with `manual`, a TF32x3 dot as three explicit TF32 passes (small
    terms first; an infinite operand's NaN low parts dropped, as Triton's TF32x3 does)."""
    if not (manual and precision == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
        return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    one = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    (a_hi, a_lo), (b_hi, b_lo) = tf32_split(a), tf32_split(b)
    small = (jax.lax.dot_general(a_lo, b_hi, dims, precision=one, preferred_element_type=jnp.float32)
             + jax.lax.dot_general(a_hi, b_lo, dims, precision=one, preferred_element_type=jnp.float32))
    small = jnp.where(jnp.isnan(small), 0.0, small)
    return small + jax.lax.dot_general(a_hi, b_hi, dims, precision=one, preferred_element_type=jnp.float32)


def _dot(a, b, precision):
    return dot_general(a, b, (((1,), (0,)), ((), ())), precision)


def prefix_loads(core_refs, digits, tl: Tiles):
    """The core slices of the prefix product, as dot operands (see the module docstring)."""
    q, r = tl.q, tl.r
    if tl.t == 2:
        jj = jnp.arange(tl.rows_m, dtype=jnp.int32)[:, None]
        aa = jnp.arange(tl.r_pad[1], dtype=jnp.int32)[None, :]
        ok = (jj < q[0]) & (aa < r[1])
        addr = digits[0].astype(tl.addr) * (q[0] * r[1]) + jj * r[1] + aa
        return [plgpu.load(core_refs[0].at[addr], mask=ok, other=0.0)]
    jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
    kk = jnp.arange(tl.k_x, dtype=jnp.int32)
    j1, j2 = jj // q[1], jj % q[1]
    jk, ak = kk // r[1], kk % r[1]
    k_ok = kk < q[1] * r[1]
    x_ok = (jj < tl.rows_valid)[:, None] & k_ok[None, :] & (j2[:, None] == jk[None, :])
    x_addr = digits[0].astype(tl.addr) * (q[0] * r[1]) + (j1 * r[1])[:, None] + ak[None, :]
    bb = jnp.arange(tl.r_pad[2], dtype=jnp.int32)
    y_ok = k_ok[:, None] & (bb < r[2])[None, :]
    y_addr = (digits[1].astype(tl.addr) * (r[1] * q[1] * r[2]) + (ak * (q[1] * r[2]) + jk * r[2])[:, None]
              + bb[None, :])
    y = plgpu.load(core_refs[1].at[y_addr], mask=y_ok, other=0.0)
    ops = [plgpu.load(core_refs[0].at[x_addr], mask=x_ok, other=0.0), y]
    if tl.t == 4:
        cc = jnp.arange(tl.r_pad[3], dtype=jnp.int32)
        g_ok = (bb < r[2])[:, None] & (cc < r[3])[None, :]
        for j3 in range(q[2]):
            addr = (digits[2].astype(tl.addr) * (r[2] * q[2] * r[3]) + (bb * (q[2] * r[3]))[:, None] + (j3 * r[3])
                    + cc[None, :])
            ops.append(plgpu.load(core_refs[2].at[addr], mask=g_ok, other=0.0))
    return ops


def _prefix_product(ops, tl: Tiles, precision):
    """The prefix product as a list of `[rows_m, r_pad[T-1]]` tiles (one per T=4 digit j3)."""
    if tl.t == 2:
        return ops
    c2 = _dot(ops[0], ops[1], precision)  # [rows_m, r_pad[2]]
    if tl.t == 3:
        return [c2]
    return [_dot(c2, g3, precision) for g3 in ops[2:]]


def load_suffixes(suffix_ref, first, count, c, tl: Tiles):
    """Rows c*S .. c*S+S-1 of an item: per column (s, j), its row's last digit and the masks."""
    col = jnp.arange(tl.n_cols, dtype=jnp.int32)
    lane = c * tl.sub_rows + col // tl.q_last_pad  # row of the item, per column
    jt = col % tl.q_last_pad
    lane_ok = lane < count
    col_ok = lane_ok & (jt < tl.q[-1])
    suffix = plgpu.load(suffix_ref.at[first + lane], mask=lane_ok, other=0)
    return suffix, lane, jt, col_ok


def load_last(core_last_ref, last_base, suffix, jt, col_ok, tl: Tiles):
    """The rows' last-core slices G `[r_{T-1}, S q_T]`, G[b, (s, j)] = G_T[i_T(s), b, j, 0]."""
    q_last, r_last = tl.q[-1], tl.r[-2]
    bb = jnp.arange(tl.r_pad[-2], dtype=jnp.int32)
    addr = ((last_base + suffix).astype(tl.addr) * (r_last * q_last) + jt)[None, :] + (bb * q_last)[:, None]
    return plgpu.load(core_last_ref.at[addr], mask=(bb < r_last)[:, None] & col_ok[None, :], other=0.0)


def _store_rows(out_ref, tiles, g, lane, jt, col_ok, first, tl: Tiles, precision, interpret):
    """R = C @ G per prefix tile, stored to the distinct rows `first + lane` (column J q_T + j of each)."""
    jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
    mask = (jj < tl.rows_valid)[:, None] & col_ok[None, :]
    row_base = ((first + lane).astype(tl.addr) * tl.dim + jt)[None, :]
    for jl, tile in enumerate(tiles):
        out = _dot(tile, g, precision)  # [rows_m, n_cols]
        d = (jj * tl.list_size + jl) * tl.q[-1]
        masked_store(out_ref, row_base + d[:, None], out, mask, interpret)


def _rows_kernel(meta_ref, nitems_ref, suffix_ref, *refs, tl: Tiles, schedule, programs, max_items, precision,
                 load_c, interpret):
    # inputs: meta_ref [(cap+1) * (T+1)], nitems_ref [1], suffix_ref [cap], T flat cores, (load_c) C per item,
    #         (queue) counter [1] aliased; outputs: rows [cap * D], (queue) counter [1]
    core_refs = refs[: tl.t]
    c_in = refs[tl.t] if load_c else None
    outs = refs[tl.t + load_c + (schedule == "queue"):]
    out_ref = outs[0]
    counter_ref = refs[-1] if schedule == "queue" else None
    cols = tl.t + 1
    pid = pl.program_id(0)
    num_items = plgpu.load(nitems_ref.at[pid * 0])

    def load_meta(t):
        """(first row, row count, last-core base, prefix digits...) of item t (any valid item past the end)."""
        base = jnp.minimum(t, max_items - 1) * cols
        first = plgpu.load(meta_ref.at[base])
        count = plgpu.load(meta_ref.at[base + cols]) - first
        last_base = plgpu.load(meta_ref.at[base + tl.t])
        return (t, first, count, last_base) + tuple(plgpu.load(meta_ref.at[base + 1 + k]) for k in range(tl.t - 1))

    def do_item(meta, prefetch=None):
        """One item. Program order is issue order on a GPU: this item's loads first, then `prefetch()` (the
        next item's metadata, whose latency then overlaps them), then the dependent loads and the dots."""
        item, first, count, last_base, *digits = meta
        suffix, lane, jt, col_ok = load_suffixes(suffix_ref, first, count, 0, tl)  # the first S rows (peeled)
        jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
        bb = jnp.arange(tl.r_pad[2], dtype=jnp.int32) if tl.t == 3 else None
        if load_c:  # T = 3: the item's C `[q1 q2, r2]`, computed by `packed_prefix_products`
            c_addr = item.astype(tl.addr) * (tl.rows_valid * tl.r[2]) + (jj * tl.r[2])[:, None] + bb[None, :]
            ops = [plgpu.load(c_in.at[c_addr], mask=(jj < tl.rows_valid)[:, None] & (bb < tl.r[2])[None, :],
                              other=0.0)]
        else:
            ops = prefix_loads(core_refs, digits, tl)
        nxt = prefetch() if prefetch is not None else None
        g = load_last(core_refs[-1], last_base, suffix, jt, col_ok, tl)
        tiles = ops if load_c else _prefix_product(ops, tl, precision)
        _store_rows(out_ref, tiles, g, lane, jt, col_ok, first, tl, precision, interpret)

        def sub(c, carry):
            suffix, lane, jt, col_ok = load_suffixes(suffix_ref, first, count, c, tl)
            g = load_last(core_refs[-1], last_base, suffix, jt, col_ok, tl)
            _store_rows(out_ref, tiles, g, lane, jt, col_ok, first, tl, precision, interpret)
            return carry

        jax.lax.fori_loop(1, (count + tl.sub_rows - 1) // tl.sub_rows, sub, jnp.int32(0))
        return nxt

    if schedule == "grid":
        @pl.when(pid < num_items)
        def _():
            do_item(load_meta(pid))
    elif schedule == "static":
        n_mine = jnp.maximum(num_items - pid + programs - 1, 0) // programs

        def step(i, meta):
            return do_item(meta, lambda: load_meta(pid + (i + 1) * programs))

        jax.lax.fori_loop(0, n_mine, step, load_meta(pid))
    elif not interpret:
        # Item pid first, then the next unclaimed one: programs + counter (starts at 0). The claim is issued
        # first and the claimed item's metadata is loaded during this item, so both latencies are hidden.
        def body(meta):
            nxt = programs + plgpu.atomic_add(counter_ref, jnp.int32(0), jnp.int32(1))
            return do_item(meta, lambda: load_meta(nxt))

        jax.lax.while_loop(lambda meta: meta[0] < num_items, body, load_meta(pid))
    else:
        # Same claims, as a fori_loop over the static bound (one item per step at most).
        def step(i, t):
            nxt = programs + plgpu.atomic_add(counter_ref, jnp.int32(0), jnp.int32(1))

            @pl.when(t < num_items)
            def _():
                do_item(load_meta(t))

            return jnp.where(t < num_items, nxt, t)

        jax.lax.fori_loop(0, max_items, step, pid)


def tt_rows(
    cores: list[jax.Array],  # per core, the group's stacked cores (flat fp32)
    plan: prefix.FlowPlan,
    layout: prefix.StackedTables,
    *,
    config: TTKernelConfig,
    interpret: bool,
    c_in: jax.Array | None = None,
):
    """`[cap * D]` distinct rows (row u at `u * D`; rows >= plan.num_rows are not written). With `c_in` (T = 3
    with prefix reuse: each work item's prefix product from `packed_prefix_products`, `FlowPlan.prefix_c`'s
    layout), C is loaded, not computed."""
    cap = plan.row_suffix.shape[0]
    tl = Tiles.make(layout, config.tile_rows)
    c_size = prefix_c_size(layout, cap, config) if c_in is not None else None
    if c_in is not None and c_size is None:
        raise ValueError("tt_rows(c_in=...) needs T = 3 cores and prefix reuse")
    wide = max([cap * tl.dim, c_size or 0] + [c.shape[0] for c in cores]) >= _INT32_MAX
    tl = dataclasses.replace(tl, wide=wide)
    programs = config.programs(cap)
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    kernel = functools.partial(
        _rows_kernel, tl=tl, schedule=config.schedule, programs=programs, max_items=cap, precision=precision,
        load_c=c_in is not None, interpret=interpret,
    )
    args = [plan.item_meta, plan.num_items, plan.row_suffix, *cores] + ([c_in] if c_in is not None else [])
    out_shape = [jax.ShapeDtypeStruct((cap * tl.dim,), jnp.float32)]
    aliases = {}
    if config.schedule == "queue":
        aliases = {len(args): len(out_shape)}
        args.append(jnp.zeros((1,), jnp.int32))
        out_shape.append(jax.ShapeDtypeStruct((1,), jnp.int32))
    call = pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(programs,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="tt_prefix_rows",
    )
    with jax.enable_x64(wide):  # int64 exists inside the kernel only; operands keep their int32 dtypes
        res = call(*args)
    return res[0]


# For T = 3 with prefix reuse, the forward computes each work item's prefix product C `[q1 q2, r2]` in
# `packed_prefix_products` (the items sharing a middle-core slice packed into one dot) and the rows kernel loads it.
# Measured on the H200, workload a, B 32768 (packedc-20261201-1903-*, then an A/B switch): tt_prefix_rows 0.290 ->
# 0.084 ms plus tt_prefix_packed 0.039 and one more sort (~0.03); the forward 0.508 -> 0.432 ms (bench_tt); with
# the backward's packed dP1, the training step 1.394 -> 1.031 ms of kernels. That sort is gone since the plan sorts
# T = 3 lookups by (i2, i1, i3) (reorder-fwd-{2,1}-20261201-2108: forward 0.304 -> 0.274 ms of kernels).
# A forward run for differentiation keeps C in its plan (`FlowPlan.prefix_c`: 1 KB per item on workload a, ~51 MB
# at B 32768) and the backward's group kernel loads it instead of recomputing it (keepc-20261201-1736-*, before the
# packing: tt_bwd_groups 0.611 -> 0.450 ms, the step 1.611 -> 1.434 ms enqueued). `apply_gradients` without a
# forward, T = 2 or 4, and `prefix_reuse=False` recompute C in the kernels.
# The C buffers of one forward together take at most this many bytes: C is ~8x a row's size per work item, and its
# buffer is sized by a static bound on the items (groups + rows / chunk), so on many-table workloads it would be
# gigabytes; past the budget a table group's kernels compute C themselves, item by item.
PREFIX_C_MAX_BYTES = 256 << 20


def prefix_c_size(layout: prefix.StackedTables, cap: int, config: TTKernelConfig) -> int | None:
    """Elements of `FlowPlan.prefix_c` (one `[q1 q2, r2]` tile per work item), or None where it is not kept
    (T != 3, or no prefix reuse: one item per row)."""
    bound = prefix.item_bound(layout, cap, config.chunk, config.prefix_reuse)
    if layout.num_cores != 3 or bound is None:
        return None
    q, r = layout.q_shapes, layout.full_ranks
    return bound * q[0] * q[1] * r[2]


def _packed_prefix_kernel(meta_ref, *refs, q, r, pack, q1p, k_p, n_p, wide, ordered, precision, interpret):
    """`pack` work items per program, taken in `order` (items sorted by their middle-core slice i2; `ordered`:
    in index order, which is sorted by i2 when the plan sorted by (i2, i1, i3), so no order operand): per run of
    equal i2 in the window (usually one), one dot A @ B with A `[(slot, j1), a]` = G1[i1(slot), j1, a] and B
    `[a, (j2, b)]` = G2[i2, a, j2, b]. Row (slot, j1) of the result is C[(j1, j2), b] of the slot's item for all
    (j2, b): contiguous at item * q1 q2 r2 + j1 q2 r2 in `prefix_c`'s row-major layout, so no reshape."""
    order_ref = None if ordered else refs[0]
    nitems_ref, core0_ref, core1_ref, c_ref = refs[1 - ordered:]
    num_items = plgpu.load(nitems_ref.at[pl.program_id(0) * 0])
    addr = jnp.int64 if wide else jnp.int32
    _, j1, item, has = i2_window(order_ref, num_items, pack, q1p)
    live = has & (j1 < q[0])
    i1 = plgpu.load(meta_ref.at[item * 4 + 1], mask=live, other=0)
    i2 = plgpu.load(meta_ref.at[item * 4 + 2], mask=live, other=0)
    aa = jnp.arange(k_p, dtype=jnp.int32)
    cc = jnp.arange(n_p, dtype=jnp.int32)
    a_ok, c_ok = aa < r[1], cc < q[1] * r[2]
    x = plgpu.load(core0_ref.at[(i1.astype(addr) * (q[0] * r[1]) + j1 * r[1])[:, None] + aa[None, :]],
                   mask=live[:, None] & a_ok[None, :], other=0.0)  # [rows_m, k_p]
    out = (item.astype(addr) * (q[0] * q[1] * r[2]) + j1 * (q[1] * r[2]))[:, None] + cc[None, :]

    def run(cur, mine):
        y = plgpu.load(core1_ref.at[cur.astype(addr) * (r[1] * q[1] * r[2]) + (aa * (q[1] * r[2]))[:, None]
                                    + cc[None, :]], mask=a_ok[:, None] & c_ok[None, :], other=0.0)  # [k_p, n_p]
        c = _dot(x, y, precision)  # [rows_m, n_p]
        masked_store(c_ref, out, c, mine[:, None] & c_ok[None, :], interpret)

    for_each_i2_run(i2, live, run)


def i2_window(order_ref, count, pack: int, q1p: int):
    """Rows (slot, j1) of a program's window of `pack` members taken in `order` (sorted by middle slice i2; None:
    in index order): (row index, j1, member per row, whether the slot holds a member)."""
    mm = jnp.arange(pack * q1p, dtype=jnp.int32)
    slot, j1 = mm // q1p, mm % q1p
    pos = pl.program_id(0) * pack + slot
    has = pos < count
    member = jnp.where(has, pos, 0) if order_ref is None else plgpu.load(order_ref.at[pos], mask=has, other=0)
    return mm, j1, member, has


def for_each_i2_run(i2, live, fn):
    """`fn(cur, mine)` once per run of equal i2 among the `live` rows of a window sorted by i2 (usually one run;
    `mine`: the run's rows). A while loop: the next run starts at the first live row with a larger i2."""
    rows_m = i2.shape[0]
    mm = jnp.arange(rows_m, dtype=jnp.int32)

    def run(start):
        cur = jnp.sum(jnp.where(mm == start, i2, 0))
        fn(cur, live & (i2 == cur))
        return jnp.min(jnp.where(live & (i2 > cur), mm, rows_m))

    jax.lax.while_loop(lambda start: start < rows_m, run, jnp.min(jnp.where(live, mm, rows_m)))


def packed_prefix_products(cores: list[jax.Array], plan: prefix.FlowPlan, layout: prefix.StackedTables, *,
                           config: TTKernelConfig, interpret: bool) -> jax.Array:
    """`FlowPlan.prefix_c` for T = 3 with prefix reuse: each work item's C `[q1 q2, r2]` (row-major), from dots
    that pack the items sharing G2[i2] (8 items per 16-row dot when q1 = 2, where the rows kernel's own dot uses 2
    of its 16 rows per item and a block-diagonal operand 4x too long). The plan's items come sorted by i2
    (`StackedTables.prefix_digits` (1, 0)); where they do not (the (i1, i2, i3) order, kept for key ranges near
    2**31), one XLA sort orders them."""
    cap = plan.row_suffix.shape[0]
    size = prefix_c_size(layout, cap, config)
    if size is None:
        raise ValueError("packed_prefix_products needs T = 3 cores and prefix reuse")
    q, r = layout.q_shapes, layout.full_ranks
    bound = size // (q[0] * q[1] * r[2])
    q1p = next_pow2(q[0])
    pack = max(1, 16 // q1p)
    ordered = layout.prefix_digits[0] == 1
    order = []
    if not ordered:
        live = jnp.arange(bound, dtype=jnp.int32) < plan.num_items[0]
        key = jnp.where(live, plan.item_meta.reshape(cap + 1, 4)[:bound, 2], _INT32_MAX)
        order = [jax.lax.sort((key, jnp.arange(bound, dtype=jnp.int32)), num_keys=1, is_stable=True)[1]]
    wide = max([size] + [c.shape[0] for c in cores[:2]]) >= _INT32_MAX
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    kernel = functools.partial(_packed_prefix_kernel, q=q, r=r, pack=pack, q1p=q1p, k_p=dot_pad(r[1]),
                               n_p=dot_pad(q[1] * r[2]), wide=wide, ordered=ordered, precision=precision,
                               interpret=interpret)
    call = pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((size,), jnp.float32), grid=(-(-bound // pack),),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1), interpret=interpret,
        name="tt_prefix_packed")
    with jax.enable_x64(wide):
        return call(plan.item_meta, *order, plan.num_items, cores[0], cores[1])


def _pool_kernel(feat_ref, offsets_ref, inverse_ref, *refs, weighted, bags, progs_per_feature, batch, dim,
                 block_dim, unroll, mean, out_stride, wide, interpret):
    # inputs: per-feature table [Fg * 2], offsets [F*B+1], inverse [N], (psw [N]), rows [cap * D],
    #         (previous output, aliased); output: out [B * sum D]
    psw_ref = refs[0] if weighted else None
    rows_ref = refs[int(weighted)]
    out_ref = refs[-1]
    adt = jnp.int64 if wide else jnp.int32
    pid = pl.program_id(0)
    k = pid // progs_per_feature  # programs are feature-major, `bags` consecutive bags each
    b0 = (pid - k * progs_per_feature) * bags
    f = plgpu.load(feat_ref.at[_FEAT_COLS * k])
    col0 = plgpu.load(feat_ref.at[_FEAT_COLS * k + 1])
    first = f * batch + b0
    g = jnp.arange(bags, dtype=jnp.int32)
    bag_ok = b0 + g < batch
    start, length, _ = bag_extent(offsets_ref, first + g, bag_ok, inverse_ref.shape[0])
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    col_ok = cols < dim

    def body(it, acc):
        for u in range(unroll):
            k = it * unroll + u
            live = k < length
            row = plgpu.load(inverse_ref.at[start + k], mask=live, other=-1)
            ok = (row >= 0)[:, None] & col_ok[None, :]
            x = plgpu.load(rows_ref.at[(row.astype(adt) * dim)[:, None] + cols[None, :]], mask=ok, other=0.0)
            if psw_ref is not None:
                x = x * plgpu.load(psw_ref.at[start + k], mask=live, other=0.0)[:, None]
            acc = acc + x
        return acc

    n_iter = (jnp.max(length) + unroll - 1) // unroll
    acc = jax.lax.fori_loop(0, n_iter, body, jnp.zeros((bags, block_dim), jnp.float32))
    if mean:
        acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
    ptr = ((b0 + g).astype(adt) * out_stride + col0)[:, None] + cols[None, :]
    masked_store(out_ref, ptr, acc, bag_ok[:, None] & col_ok[None, :], interpret)


def tt_pool(
    rows: jax.Array,  # [cap * D] distinct rows of one table group
    inverse: jax.Array,  # [N] int32
    offsets: jax.Array,  # [F * B + 1] int32
    per_sample_weights: jax.Array | None,
    previous: jax.Array | None,  # [B * sum D] output of the previous group (updated in place), or None
    *,
    features: tuple[int, ...],
    col0: tuple[int, ...],  # per feature (all F), its first output column
    dim: int,
    batch: int,
    total_dim: int,
    pooling: str,
    config: TTKernelConfig,
    interpret: bool,
) -> jax.Array:
    """Writes the `features`' columns of the flat `[B * total_dim]` pooled output."""
    wide = max(batch * total_dim, rows.shape[0]) >= _INT32_MAX
    bags = max(1, min(config.pool_bags, next_pow2(batch)))
    per_feature = -(-batch // bags)
    feat = jnp.asarray(np.asarray([(f, col0[f]) for f in features], np.int32).reshape(-1))
    weighted = per_sample_weights is not None
    kernel = functools.partial(
        _pool_kernel, weighted=weighted, bags=bags, progs_per_feature=per_feature, batch=batch, dim=dim,
        block_dim=next_pow2(dim), unroll=config.pool_unroll, mean=pooling == "mean", out_stride=total_dim,
        wide=wide, interpret=interpret,
    )
    args = [feat, offsets, inverse] + ([per_sample_weights] if weighted else []) + [rows]
    aliases = {}
    if previous is not None:
        aliases = {len(args): 0}
        args.append(previous)
    call = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch * total_dim,), jnp.float32),
        grid=(len(features) * per_feature,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.pool_warps, num_stages=1),
        interpret=interpret,
        name="tt_pool",
    )
    with jax.enable_x64(wide):
        return call(*args)


def flow_plans(specs, feature_table_map: tuple[int, ...], indices, offsets, *, batch: int, config: TTKernelConfig,
               fused: bool = False, interpret: bool = False):
    """Per table group of `prefix.stack_tables` (in order), the batch's `FlowPlan` (`fused`: see
    `prefix.build_flow`)."""
    return tuple(
        prefix.build_flow(layout, indices, offsets, features=feats, feature_table_map=feature_table_map,
                          batch=batch, chunk=config.chunk, prefix_reuse=config.prefix_reuse, fused=fused,
                          interpret=interpret)
        for layout, feats in prefix.stack_tables(specs, feature_table_map)
    )


def pooled_forward(
    all_cores,  # per table, its cores in the logical layout
    specs,
    feature_table_map: tuple[int, ...],
    indices: jax.Array,  # [N] int32
    offsets: jax.Array,  # [F * B + 1] int32
    per_sample_weights: jax.Array | None,
    *,
    batch: int,
    pooling: str,
    config: TTKernelConfig,
    interpret: bool,
    return_stats: bool = False,
    return_plans: bool = False,
    keep_c: bool = False,
):
    """`[B, sum_f D_f]` pooled TT lookups (feature f reads table `feature_table_map[f]`).

    Per group of tables sharing (q, ranks): `prefix.build_flow`, `tt_rows`,
    `tt_pool`. With `return_stats`, also a dict of device scalars per group
    (distinct rows, prefix groups, work items); with `return_plans`, also the
    tuple of per-group `FlowPlan`s (the backward's residuals): `out`,
    `(out, stats)`, `(out, plans)` or `(out, stats, plans)`. With `keep_c` (and return_plans), the plans of
    T = 3 groups carry each work item's prefix product (`FlowPlan.prefix_c`) for the backward.
    """
    dims = [specs[t].embedding_dim for t in feature_table_map]
    total = sum(dims)
    col0 = tuple(int(x) for x in np.concatenate([[0], np.cumsum(dims)])[:-1])
    out, stats = None, []
    # The plans' bookkeeping after the sort in Pallas passes (`tt_jax.kernels.plan`), not `prefix.build_flow`'s
    # ~15 XLA ops (the definition they are tested against).
    plans = list(flow_plans(specs, feature_table_map, indices, offsets, batch=batch, config=config,
                            fused=True, interpret=interpret))
    c_budget = PREFIX_C_MAX_BYTES
    keep = return_plans and keep_c
    for k, ((layout, feats), plan) in enumerate(zip(prefix.stack_tables(specs, feature_table_map), plans)):
        cores = prefix.stack_cores(layout, all_cores)
        c_size = prefix_c_size(layout, plan.row_suffix.shape[0], config)
        if c_size is not None and 4 * c_size <= c_budget:
            c_budget -= 4 * c_size
            c = packed_prefix_products(cores, plan, layout, config=config, interpret=interpret)
            rows = tt_rows(cores, plan, layout, config=config, interpret=interpret, c_in=c)
            if keep:
                plans[k] = plan = plan._replace(prefix_c=c)
        else:
            rows = tt_rows(cores, plan, layout, config=config, interpret=interpret)
        out = tt_pool(rows, plan.inverse, offsets, per_sample_weights, out, features=feats, col0=col0,
                      dim=layout.dim, batch=batch, total_dim=total, pooling=pooling, config=config,
                      interpret=interpret)
        stats.append({"distinct_rows": plan.num_rows, "prefix_groups": plan.num_groups,
                      "work_items": plan.num_items[0]})
    out = (out.reshape(batch, total),) + ((stats,) if return_stats else ()) + ((tuple(plans),) if return_plans else ())
    return out if len(out) > 1 else out[0]
