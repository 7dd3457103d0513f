"""The FlowPlan's bookkeeping after the sort in three Pallas passes (`prefix.build_flow(fused=True)`).

After `build_flow`'s one sort, XLA derives the distinct rows, prefix groups and work items with two prefix sums
over the lookups, a prefix sum per item table, ~8 scatters and two concatenations: ~15 small kernels, each a pass
over the N lookups and a launch. Here, from the per-lookup flags of the sorted order (a new row / a new group, its
prefix, last digit and table; one XLA fusion computes them):

1. `_count_kernel`: per block of `BLOCK` sorted lookups, the new rows, new groups and valid lookups.
2. `_items_kernel`: per block, with its first row number (an exclusive prefix sum over the block counts, XLA, N /
   BLOCK values), each lookup's row number and so the new work items (an item starts at each group and at each
   `chunk`-th row), counted per block.
3. `_write_kernel`: per block, the row, group and item numbers; scatters the lookup -> row map, the rows' last
   digits and first lookups, and the item and group tables (first row, decoded prefix digits, last-core base).
   Slots past the counts get the fill values, each slot by the block whose index range holds it, so every output
   element is written exactly once: no initialisation, no atomics, the same result run to run.

Matches the XLA bookkeeping of `prefix.build_flow` exactly (tests/test_tt_plan.py). The sort stays in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2
from tt_jax.kernels.forward import masked_store

BLOCK = 1024


def _block(pid, n):
    j = pid * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    return j, j < n


def _load(ref, j, live, other=0):
    return plgpu.load(ref.at[j], mask=live, other=other)


def _count_kernel(new_row_ref, new_grp_ref, valid_ref, counts_ref, *, n):
    pid = pl.program_id(0)
    j, live = _block(pid, n)
    lane = jnp.arange(4, dtype=jnp.int32)
    rows, grps, valid = (jnp.sum(_load(r, j, live)) for r in (new_row_ref, new_grp_ref, valid_ref))
    plgpu.store(counts_ref.at[pid * 4 + lane], jnp.where(lane == 0, rows, jnp.where(lane == 1, grps,
                                                                                    jnp.where(lane == 2, valid, 0))))


def _item_flags(new_row, new_grp, uid, *, chunk, prefix_reuse):
    """The new work items (as `build_flow`): every row without prefix reuse; else every group start and, with
    `chunk`, every row numbered a multiple of chunk."""
    if not prefix_reuse:
        return new_row
    if chunk:
        return jnp.where((new_grp > 0) | ((new_row > 0) & (uid % chunk == 0)), 1, 0)
    return new_grp


def _items_kernel(new_row_ref, new_grp_ref, base_ref, counts_ref, *, n, chunk, prefix_reuse):
    pid = pl.program_id(0)
    j, live = _block(pid, n)
    new_row, new_grp = _load(new_row_ref, j, live), _load(new_grp_ref, j, live)
    uid = plgpu.load(base_ref.at[pid * 4]) + jnp.cumsum(new_row) - 1
    new_item = _item_flags(new_row, new_grp, uid, chunk=chunk, prefix_reuse=prefix_reuse)
    plgpu.store(counts_ref.at[pid], jnp.sum(new_item))


def _write_kernel(new_row_ref, new_grp_ref, valid_ref, pre_ref, suf_ref, tab_ref, perm_ref, base_ref, ibase_ref,
                  tot_ref, consts_ref, inverse_ref, row_suffix_ref, row_start_ref, sorted_row_ref, item_meta_ref,
                  *group_meta_refs, n, cap, chunk, prefix_reuse, t_cores, n_tables, interpret):
    pid = pl.program_id(0)
    j, live = _block(pid, n)
    new_row, new_grp, valid = (_load(r, j, live) for r in (new_row_ref, new_grp_ref, valid_ref))
    pre, suf, tab, perm = (_load(r, j, live) for r in (pre_ref, suf_ref, tab_ref, perm_ref))
    num_rows = plgpu.load(tot_ref.at[jnp.int32(0)])
    num_groups = plgpu.load(tot_ref.at[jnp.int32(1)])
    num_valid = plgpu.load(tot_ref.at[jnp.int32(2)])
    num_items = plgpu.load(tot_ref.at[jnp.int32(3)])
    uid = plgpu.load(base_ref.at[pid * 4]) + jnp.cumsum(new_row) - 1
    gid = plgpu.load(base_ref.at[pid * 4 + 1]) + jnp.cumsum(new_grp) - 1
    new_item = _item_flags(new_row, new_grp, uid, chunk=chunk, prefix_reuse=prefix_reuse)
    iid = plgpu.load(ibase_ref.at[pid]) + jnp.cumsum(new_item) - 1
    ok = valid > 0

    def store(ref, idx, val, mask):
        masked_store(ref, idx, val, mask, interpret)

    store(inverse_ref, perm, jnp.where(ok, uid, -1), live)
    store(sorted_row_ref, j, jnp.where(ok, uid, n), live)
    is_row = live & (new_row > 0)
    store(row_suffix_ref, uid, suf, is_row)
    store(row_start_ref, uid, j, is_row)
    store(row_suffix_ref, j, jnp.zeros_like(j), (j >= num_rows) & (j < cap))
    store(row_start_ref, j, jnp.full_like(j, 0) + num_valid, (j >= num_rows) & (j <= cap))

    # The item table's columns for a lookup starting an item: decoded as `_meta_table` does (consts: per table,
    # its prefix base, then per core t < T-1 its radix p_t and stacked base, then its last core's base).
    t = jnp.where(ok, tab, 0)

    def const(row):
        return plgpu.load(consts_ref.at[row * n_tables + t])

    rest = pre - const(0)
    cols = [None] * (t_cores - 1)
    for c in reversed(range(t_cores - 1)):
        radix = const(1 + 2 * c)
        cols[c] = const(2 + 2 * c) + rest % radix
        rest = rest // radix
    last_base = const(2 * t_cores - 1)
    # Each table row (first row, prefix digits, last-core base) is stored whole: one [BLOCK, 2^k] store whose lanes
    # are consecutive addresses, instead of one strided store per column (the fill rows are most of the writes).
    # SASS stores 170 -> 74; on the H200, workload a, B 32768: tt_plan_write 0.045 -> 0.026 ms (ttfwd-20261201-1932,
    # plancoal-fwd-20261201-1944).
    width = t_cores + 1
    col = jnp.arange(next_pow2(width), dtype=jnp.int32)[None, :]
    in_row = col < width
    start_vals = jnp.where(col == 0, uid[:, None], jnp.where(col == t_cores, last_base[:, None], 0))
    for c in range(t_cores - 1):
        start_vals = jnp.where(col == 1 + c, cols[c][:, None], start_vals)
    fill_vals = jnp.where(col == 0, num_rows, 0) + jnp.zeros_like(j)[:, None]

    def table(ref, slot, starts, count):
        starts = live & (starts > 0)
        store(ref, slot[:, None] * width + col, start_vals, starts[:, None] & in_row)
        fill = (j >= count) & (j <= cap)  # rows past the count: (num_rows, 0, ..., 0); row cap is the sentinel
        store(ref, j[:, None] * width + col, fill_vals, fill[:, None] & in_row)

    table(item_meta_ref, iid, new_item, num_items)
    if group_meta_refs:
        table(group_meta_refs[0], gid, new_grp, num_groups)


def _consts(layout) -> np.ndarray:
    """Per local table: prefix base; per core t < T-1 its radix and stacked base; the last core's stacked base."""
    specs, t_cores = layout.specs, layout.num_cores
    rows = [list(layout.prefix_base[:-1])]
    for c in range(t_cores - 1):
        rows.append([s.p_shapes[c] for s in specs])
        rows.append(list(layout.core_base[c][:-1]))
    rows.append(list(layout.core_base[-1][:-1]))
    return np.asarray(rows, np.int32).reshape(-1)


def bookkeeping(layout, new_row, new_grp, valid, pre, suf, tab, perm, *, cap: int, chunk: int, prefix_reuse: bool,
                interpret: bool):
    """`build_flow`'s outputs after the sort, from the sorted lookups' int32 flags and fields (`tab`: the local
    table, zeros for one table): (inverse, row_suffix, row_start, sorted_row, item_meta, num_items, group_meta,
    num_rows, num_groups); group_meta is item_meta when items are whole groups."""
    n = new_row.shape[0]
    t_cores = layout.num_cores
    grid = n // BLOCK + 1  # the last block also covers the fill slots up to cap (<= n)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    i32 = jnp.int32
    counts = pallas_call(
        functools.partial(_count_kernel, n=n), out_shape=jax.ShapeDtypeStruct((grid * 4,), i32), grid=(grid,),
        compiler_params=params, interpret=interpret, name="tt_plan_count",
    )(new_row, new_grp, valid)
    c = counts.reshape(grid, 4)
    base = (jnp.cumsum(c, axis=0) - c).reshape(-1)
    kw = dict(n=n, chunk=chunk, prefix_reuse=prefix_reuse)
    icounts = pallas_call(
        functools.partial(_items_kernel, **kw), out_shape=jax.ShapeDtypeStruct((grid,), i32), grid=(grid,),
        compiler_params=params, interpret=interpret, name="tt_plan_items",
    )(new_row, new_grp, base)
    ibase = jnp.cumsum(icounts) - icounts
    tot = jnp.concatenate([jnp.sum(c, axis=0)[:3], jnp.sum(icounts)[None]])
    whole_groups = prefix_reuse and not chunk
    meta_len = (cap + 1) * (t_cores + 1)
    shapes = [(n,), (cap,), (cap + 1,), (n,), (meta_len,)] + ([] if whole_groups else [(meta_len,)])
    outs = pallas_call(
        functools.partial(_write_kernel, cap=cap, t_cores=t_cores, n_tables=len(layout.specs), interpret=interpret,
                          **kw),
        out_shape=[jax.ShapeDtypeStruct(s, i32) for s in shapes], grid=(grid,), compiler_params=params,
        interpret=interpret, name="tt_plan_write",
    )(new_row, new_grp, valid, pre, suf, tab, perm, base, ibase, tot, jnp.asarray(_consts(layout)))
    inverse, row_suffix, row_start, sorted_row, item_meta = outs[:5]
    group_meta = item_meta if whole_groups else outs[5]
    return inverse, row_suffix, row_start, sorted_row, item_meta, tot[3], group_meta, tot[0], tot[1]
