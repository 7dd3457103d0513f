"""Small-table backward: a histogram feature's table gradient as `counts^T @ dout`.

For a feature that takes the histogram forward (see `histogram`), the gradient of
its table is `grad[e, :] = sum_b counts[b, e] * dout[b, :]` (times 1/len for
mean pooling), where `counts[b, e]` is how often row e occurs in bag b. Two
launches in all, whatever the number of tables and storage buffers, no sort:

1. `tbe_histogram_grad`: the tiles (`bags` bags of one feature) of all histogram
   features form one program map, ordered by table, so each table's tiles are
   contiguous. Program p takes a contiguous range of at most `per_program` tiles
   of one table (`per_program = ceil(all tiles / grad_programs)`, so a table
   gets `ceil(its tiles / per_program)` programs and a range never straddles two
   tables). Per-table facts come from one small `[tables, 8]` int32 operand
   (`tabs`: first partial slot and slot count, first tile and tile count, class,
   first update program, first row in its buffer, buffer); a program finds its
   table by a binary search over the first slots (log2(tables) scalar loads).
   The kernel has one static branch per distinct class (the table's
   `rows_padded(E)` and dim), never one per table. Per tile it counts the bag's
   ids on tensor cores (`_count_ids`: `counts^T += one-hot^T @ S^T`, the fp16
   one-hot of a step's ids and S the bag-membership matrix, in rounds of 256
   ids per bag (`histogram.GRAD_ROUND`) so every count is <= 256; the forward counts with packed 8-bit
   counters instead, `histogram._count_packed`), splits the
   tile's fp32 output gradient into three bf16 parts `hi + mid + lo` (exactly:
   3 x 8 significand bits cover fp32's 24; bf16 keeps fp32's exponent range) and
   adds `counts^T @ hi + counts^T @ mid + counts^T @ lo` to an fp32 `[E, D]`
   accumulator: each product of a count (<= 256, exact in bf16) and a part is
   exact, so the result is the fp32 sum up to fp32 rounding. It also sums the
   counts into per-row occurrence counts. One fp32 `[E, D]` partial and one
   `[E]` occurrence vector per program go to workspace slot p (slots use the
   largest class's row stride).
2. `tbe_histogram_update`: one program per (table, row) of all the tables (its
   table found by a binary search over `tabs`' first update programs) sums its
   table's partials (and occurrence counts) in slot order, then applies the
   optimizer to the row if it occurred in the batch (occurrences > 0, not
   gradient != 0), in place, in the branch of its storage buffer (every touched
   buffer is aliased); rows that did not occur are never written. With
   `opt=None` it stores the row's gradient instead (the dense `jax.grad` path,
   into a zero buffer).

For a single table the split into programs, and so every sum, is the one of the
earlier per-table version (two launches per table).

The summation order is fixed by the static schedule, so results are bitwise
reproducible run to run (for one `HistogramConfig`).

Bytes for the smalltable preset (B=65536, L=128, E=64, D=128): ids 33.5 MB and
the output gradient 33.5 MB read once, offsets 0.26 MB; partials 264 x 64 x 128
x 4 B = 8.7 MB at 264 programs (the default on an H200), written and read once. With many
tables there are fewer than `grad_programs + tables` slots in all.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.kernels.row_update import row_update, state_refs, state_width
from tbe_jax.optim import NUM_HYPER
from tbe_jax.kernels import programs
from tbe_jax.kernels.programs import META_COLS, OUT_BASE, OUT_STRIDE, feature_table
from tbe_jax.kernels.histogram import GRAD_ROUND, HistogramConfig, rows_padded
from tbe_jax.specs import FeaturePlan, StorageLayout, next_pow2


# -- counting on tensor cores ------------------------------------------------------------
# A counting step covers C ids of each of `bags` bags as one flat vector of K = bags * C
# positions: position p is id (k0 + p % C) of bag p // C. Loading the positions' bag
# starts once per tile (from `offsets`, L1-resident) makes every step's id load a
# single [K] gather with no per-step index arithmetic beyond one add.


def _tile_positions(offsets_ref, first, nbags, n, *, bags: int, c: int):
    """(bag of p [K], slot p % C [K], its bag's first id [K], its bag's length [K]); 0 for padding bags."""
    p = jnp.arange(bags * c, dtype=jnp.int32)
    pb, pc = p // c, p % c
    ok = pb < nbags
    p_start, p_len, _ = programs.bag_extent(offsets_ref, first + pb, ok, n)
    return pb, pc, p_start, jnp.where(ok, p_len, 0)


def _count_ids(indices_ref, p_start, pc, limit, k0, n_steps, membership_t, *, c, rows, lookahead):
    """Counts `[E_padded, bags]` (fp32, exact) of ids k0 .. k0 + n_steps * C - 1 (below `limit`) of each bag.

    Per step the fp16 one-hot `O^T[e, p] = (id_p == e)` of the K ids, and `counts^T += O^T @ S^T`
    with `membership_t` S^T `[K, bags]`. The compare is in fp16: exact for e < 2048, and rounding is
    monotonic, so no id outside [0, E_padded) compares equal to a row; -1 (padding) matches nothing.
    """
    e = jnp.arange(rows, dtype=jnp.int32).astype(jnp.float16)

    def ids_at(i):  # ids k0 + i * C + p % C of each position's bag, -1 at or past `limit`
        k = k0 + i * c + pc
        return plgpu.load(indices_ref.at[p_start + k], mask=k < limit, other=-1)

    def add(acc, ids):
        o_t = (e[:, None] == ids.astype(jnp.float16)[None, :]).astype(jnp.float16)
        return acc + jnp.dot(o_t, membership_t, preferred_element_type=jnp.float32)

    init = jnp.zeros((rows, membership_t.shape[1]), jnp.float32)
    if not lookahead:
        return jax.lax.fori_loop(0, n_steps, lambda i, acc: add(acc, ids_at(i)), init)

    # Software pipelining by hand: the ids of the next `lookahead` steps are in flight
    # (masked off past the limit) while this step's ids are counted.
    def step(i, carry):
        nxt = ids_at(i + lookahead)  # issued before this step's counting
        return (add(carry[0], carry[1]),) + carry[2:] + (nxt,)

    return jax.lax.fori_loop(0, n_steps, step, (init,) + tuple(ids_at(j) for j in range(lookahead)))[0]


def split3(x):
    """fp32 `x` as bf16 `(hi, mid, lo)` with `hi + mid + lo == x` exactly (normal range)."""
    hi = x.astype(jnp.bfloat16)
    r = x - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    lo = (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


# Columns of the per-table operand (`tabs`, `[tables, T_COLS]` int32) both kernels read.
T_SLOT0, T_NPARTS, T_TILE0, T_NTILES, T_CLASS, T_ROW0, T_ROW_OFFSET, T_BUFFER = range(8)
T_COLS = 8


class _Plan(NamedTuple):
    """The static schedule of one `histogram_update` call (host side; see `_plan`)."""

    pm: programs.ProgramMap  # one segment: every histogram feature, ordered by table
    classes: tuple  # distinct (rows_padded, dim), the grad kernel's branches
    buffers: tuple  # storage buffers touched (layout groups), the update kernel's branches
    tabs: np.ndarray  # [tables, T_COLS] int32
    per_program: int  # tiles per grad program (fewer in a table's last one)
    num_programs: int  # grad programs (= partial slots)
    num_rows: int  # update programs: the tables' rows together
    stride_rows: int  # partial workspace: rows per slot (the largest rows_padded)
    stride_cols: int  # and elements per row (the largest next_pow2(dim))
    q: int  # partials summed per step by the update kernel


def _plan(layout: StorageLayout, plan: FeaturePlan, features, cfg: HistogramConfig, interpret: bool) -> _Plan | None:
    """All tables' tiles in one program map; programs cut each table's tile range into runs of
    `per_program` tiles (never two tables in one program). None if there are no bags.

    Per table (a row of `tabs`): its first partial slot (= grad program) and slot count, its
    first tile and tile count, its class, its first update program, its first row in its buffer,
    its buffer. Nothing here grows with the batch beyond `per_program`, a compile-time constant.
    """
    entries = []  # (its features, tiles, class, buffer)
    for t in sorted({plan.table[f] for f in features}):
        feats = [f for f in features if plan.table[f] == t]
        n_tiles = sum(-(-plan.batch[f] // cfg.grad_bags) for f in feats)
        if n_tiles == 0:
            continue
        grp = plan.group[feats[0]]
        entries.append((feats, n_tiles, (rows_padded(plan.num_rows[feats[0]]), layout.dims[grp]), grp))
    if not entries:
        return None
    pm = programs.build(plan.bag_base, plan.batch, [([f for e in entries for f in e[0]], cfg.grad_bags)])
    classes = tuple(sorted({e[2] for e in entries}))
    buffers = tuple(sorted({e[3] for e in entries}))
    total = sum(e[1] for e in entries)
    # Interpret mode's default is few programs (they run one after another): CPU tests stay fast and each
    # program walks several tiles (the loop is tested).
    budget = min(cfg.resolved_grad_programs(interpret), total)
    per_program = -(-total // budget)  # one table alone: the per-table split of the earlier version
    tabs = []
    slot0 = tile0 = row0 = 0
    for feats, n_tiles, cls, grp in entries:
        n_parts = -(-n_tiles // per_program)
        f0 = feats[0]
        tabs.append((slot0, n_parts, tile0, n_tiles, classes.index(cls), row0, plan.row_offset[f0],
                     buffers.index(grp)))
        slot0, tile0, row0 = slot0 + n_parts, tile0 + n_tiles, row0 + plan.num_rows[f0]
    max_parts = max(row[T_NPARTS] for row in tabs)
    return _Plan(pm, classes, buffers, np.asarray(tabs, np.int32).reshape(-1, T_COLS), per_program, slot0, row0,
                 max(c[0] for c in classes), max(next_pow2(c[1]) for c in classes),
                 min(cfg.update_partials, next_pow2(max_parts)))


def _find_table(tabs_ref, num_tables: int, col: int, q):
    """The last table whose column `col` (a running start: slot or update program) is <= `q`.

    A binary search of log2(tables) scalar loads (as `programs.locate`); 0 with one table.
    """
    t = jnp.int32(0)
    step = 1 << (num_tables - 1).bit_length() if num_tables > 1 else 0
    while step:
        cand = t + step
        ok = cand < num_tables
        start = plgpu.load(tabs_ref.at[T_COLS * jnp.minimum(cand, num_tables - 1) + col])
        t = jnp.where(ok & (start <= q), cand, t)
        step //= 2
    return t


def _grad_branch(pid, lo, hi, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, g_ref, part_ref, occ_ref,
                 *, seg, bags, c, rows, dim, stride_rows, stride_cols, mean, lookahead):
    """Program `pid`: tiles [lo, hi) of one table of class (rows, dim), into partial slot `pid`."""
    block_dim = next_pow2(dim)
    g = jnp.arange(bags, dtype=jnp.int32)
    e = jnp.arange(rows, dtype=jnp.int32)
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    col_ok = cols < dim

    def tile(i, carry):
        acc, occ = carry
        f, first, nbags, b0 = programs.locate(seg, lo + i, flist_ref, prefix_ref)
        out_base = plgpu.load(feat_ref.at[META_COLS * f + OUT_BASE])
        out_stride = plgpu.load(feat_ref.at[META_COLS * f + OUT_STRIDE])
        bag_ok = g < nbags
        length = jnp.where(bag_ok, programs.bag_extent(offsets_ref, first + g, bag_ok, indices_ref.shape[0])[1], 0)
        dout = plgpu.load(g_ref.at[(out_base + (b0 + g) * out_stride)[:, None] + cols[None, :]],
                          mask=bag_ok[:, None] & col_ok[None, :], other=0.0)
        if mean:
            dout = dout * (1.0 / jnp.maximum(length, 1).astype(jnp.float32))[:, None]
        parts = split3(dout)
        pb, pc, p_start, p_len = _tile_positions(offsets_ref, first, nbags, indices_ref.shape[0], bags=bags, c=c)
        membership_t = (pb[:, None] == g[None, :]).astype(jnp.float16)  # S^T [K, bags]
        longest = jnp.max(length)

        def round_(r, carry):
            acc, occ = carry
            k0 = r * GRAD_ROUND
            n_steps = (jnp.minimum(longest - k0, GRAD_ROUND) + c - 1) // c
            counts_t = _count_ids(indices_ref, p_start, pc, jnp.minimum(p_len, k0 + GRAD_ROUND), k0, n_steps,
                                  membership_t, c=c, rows=rows, lookahead=lookahead)
            ct = counts_t.astype(jnp.bfloat16)  # <= GRAD_ROUND = 256: exact
            for part in parts:
                acc = acc + jnp.dot(ct, part, preferred_element_type=jnp.float32)
            return acc, occ + jnp.sum(counts_t, axis=1).astype(jnp.int32)

        return jax.lax.fori_loop(0, (longest + GRAD_ROUND - 1) // GRAD_ROUND, round_, (acc, occ))

    acc, occ = jax.lax.fori_loop(
        0, hi - lo, tile, (jnp.zeros((rows, block_dim), jnp.float32), jnp.zeros((rows,), jnp.int32)))
    plgpu.store(part_ref.at[(pid * stride_rows + e)[:, None] * stride_cols + cols[None, :]], acc)
    plgpu.store(occ_ref.at[pid * stride_rows + e], occ)


def _grad_kernel(tabs_ref, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, g_ref,  # inputs
                 part_ref, occ_ref,  # outputs: [programs * stride_rows * stride_cols] f32, [programs * stride_rows] i32
                 *, classes, num_tables, per_program, **kw):
    pid = pl.program_id(0)
    t = _find_table(tabs_ref, num_tables, T_SLOT0, pid)

    def fact(col):
        return plgpu.load(tabs_ref.at[T_COLS * t + col])

    tile0 = fact(T_TILE0)
    lo = tile0 + (pid - fact(T_SLOT0)) * per_program
    hi = jnp.minimum(lo + per_program, tile0 + fact(T_NTILES))
    cls = fact(T_CLASS)
    refs = (flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, g_ref, part_ref, occ_ref)
    for k, (rows, dim) in enumerate(classes):
        body = functools.partial(_grad_branch, pid, lo, hi, *refs, rows=rows, dim=dim, **kw)
        if len(classes) == 1:
            body()
        else:
            pl.when(cls == k)(body)


def _update_branch(e, slot0, n_parts, row_offset, part_ref, occ_ref, hyper_ref, w_in, s_in, w_out, s_out,
                   *, opt, q, dim, stride, stride_rows, stride_cols):
    """Row `e` of one table: its partials summed in slot order, then the optimizer (or the gradient stored)."""
    block_dim = next_pow2(dim)
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    col_ok = cols < dim
    pq = jnp.arange(q, dtype=jnp.int32)

    def step(i, carry):
        acc, n = carry
        j = i * q + pq
        ok = j < n_parts
        p = slot0 + j
        tile = plgpu.load(part_ref.at[((p * stride_rows + e) * stride_cols)[:, None] + cols[None, :]],
                          mask=ok[:, None] & col_ok[None, :], other=0.0)
        n = n + jnp.sum(plgpu.load(occ_ref.at[p * stride_rows + e], mask=ok, other=0))
        return acc + jnp.sum(tile, axis=0, keepdims=True), n

    acc, n = jax.lax.fori_loop(0, (n_parts + q - 1) // q, step,
                               (jnp.zeros((1, block_dim), jnp.float32), jnp.int32(0)))
    touched = jnp.zeros((1,), jnp.int32) + n > 0
    # Rows not in the batch point one past the buffer: never stored on a GPU, dropped in interpret mode.
    row = jnp.where(touched, row_offset + e, w_out.shape[0])
    row_update(opt, hyper_ref, w_in, w_out, s_in, s_out, row, touched, acc, cols, col_ok, dim, stride)


def _update_kernel(part_ref, occ_ref, hyper_ref, tabs_ref, *refs, opt, dims, strides, num_tables, **kw):
    pid = pl.program_id(0)
    t = _find_table(tabs_ref, num_tables, T_ROW0, pid)

    def fact(col):
        return plgpu.load(tabs_ref.at[T_COLS * t + col])

    e = pid - fact(T_ROW0)
    slot0, n_parts, row_offset, buf = fact(T_SLOT0), fact(T_NPARTS), fact(T_ROW_OFFSET), fact(T_BUFFER)
    n_state = state_width(opt)
    ins, outs = refs[: n_state * len(dims)], refs[n_state * len(dims) :]
    for b, (dim, stride) in enumerate(zip(dims, strides)):
        state = state_refs(ins[b * n_state : (b + 1) * n_state] + outs[b * n_state : (b + 1) * n_state], opt)
        body = functools.partial(_update_branch, e, slot0, n_parts, row_offset, part_ref, occ_ref, hyper_ref,
                                 *state, opt=opt, dim=dim, stride=stride, **kw)
        if len(dims) == 1:
            body()
        else:
            pl.when(buf == b)(body)


def histogram_update(
    buffers: dict,
    slots: tuple,
    layout: StorageLayout,
    plan: FeaturePlan,
    features,  # the features that took the histogram forward
    indices: jax.Array,
    offsets: jax.Array,
    g_out: jax.Array,
    opt,
    hyper: jax.Array | None = None,
    *,
    pooling: str,
    config: HistogramConfig,
    interpret: bool,
):
    """Apply `opt` to the rows of the histogram features' tables; returns (buffers, slots).

    `slots`: the optimizer state's slots (a tuple of dicts shaped like `buffers`), `hyper`
    the step's `Optimizer.hyperparameters`.

    Two launches in all, whatever the number of tables and buffers. Every table
    read by one of `features` must be read by histogram features only
    (eligibility is per table, so this holds for `TableBatchedEmbedding.plan()`).
    `opt=None`: store each occurring row's gradient (cast to the buffer's dtype)
    into `buffers`, which must be zeros there.
    """
    cfg = config
    n_slots = opt.num_slots if opt is not None else 0
    new_w, new_s = dict(buffers), tuple(dict(x) for x in (slots or ())[:n_slots])
    sp = _plan(layout, plan, features, cfg, interpret)
    if sp is None:
        return new_w, new_s
    g_flat = g_out.reshape(-1).astype(jnp.float32)
    feat_meta = programs.const(feature_table(plan))
    if hyper is None:
        hyper = jnp.zeros((NUM_HYPER,), jnp.float32)
    n_prog, sr, sc, n_tab = sp.num_programs, sp.stride_rows, sp.stride_cols, sp.tabs.shape[0]
    tabs = programs.const(sp.tabs)
    part, occ = pallas_call(
        functools.partial(_grad_kernel, classes=sp.classes, num_tables=n_tab, per_program=sp.per_program,
                          seg=sp.pm.segments[0], bags=cfg.grad_bags,
                          c=cfg.grad_ids_per_step, stride_rows=sr, stride_cols=sc, mean=pooling == "mean",
                          lookahead=cfg.grad_lookahead),
        out_shape=(jax.ShapeDtypeStruct((n_prog * sr * sc,), jnp.float32),
                   jax.ShapeDtypeStruct((n_prog * sr,), jnp.int32)),
        grid=(n_prog,),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.grad_num_warps, num_stages=1),
        interpret=interpret, name="tbe_histogram_grad",
    )(tabs, *programs.operands(sp.pm), feat_meta, offsets, indices, g_flat)
    keys = [layout.key(grp) for grp in sp.buffers]
    state = []
    for k in keys:
        state += [new_w[k]] + [d[k] for d in new_s]
    args = [part, occ, hyper, tabs] + state
    state = pallas_call(
        functools.partial(_update_kernel, opt=opt, dims=tuple(layout.dims[grp] for grp in sp.buffers),
                          strides=tuple(layout.strides[grp] for grp in sp.buffers),
                          num_tables=n_tab, q=sp.q, stride_rows=sr, stride_cols=sc),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
        grid=(sp.num_rows,),
        input_output_aliases={4 + i: i for i in range(len(state))},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.update_num_warps, num_stages=1),
        interpret=interpret, name="tbe_histogram_update",
    )(*args)
    n_state = 1 + n_slots
    for i, k in enumerate(keys):
        new_w[k] = state[n_state * i]
        for j, d in enumerate(new_s):
            d[k] = state[n_state * i + 1 + j]
    return new_w, new_s
