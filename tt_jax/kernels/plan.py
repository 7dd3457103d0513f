"""The FlowPlan's bookkeeping after the sort in Pallas passes (`build_flow`, the fused forward's plan).

After `build_flow`'s one sort, XLA would derive the distinct rows, prefix groups and work items with two prefix
sums over the lookups, a prefix sum per item table, ~8 scatters and two concatenations: ~15 small kernels, each a
pass over the N lookups and a launch. Here, from the sort's keys alone (each pass derives a lookup's flags, a new
row / a new group, and its prefix, last digit and table from its key and the previous lookup's: nothing per lookup
is stored between passes):

1. `_count_kernel`: per block of `block` sorted lookups (`TTForwardConfig.plan_block`), the new rows, new groups
   and valid lookups; then `exclusive_scan` (one program) gives each block's first row and group and the totals.
2. `_items_kernel`: per block, each lookup's row number and so the new work items (an item starts at each group
   and at each `chunk`-th row), counted per block; scanned the same way.
3. `_write_kernel`: per block, the row, group and item numbers; scatters the lookup -> row map, the rows' last
   digits and first lookups, and the item and group tables (first row, decoded prefix digits, last-core base).
   Slots past the counts get the fill values, each slot by the block whose index range holds it, so every output
   element is written exactly once: no initialisation, no atomics, the same result run to run.

Matches the XLA bookkeeping of `prefix.build_flow` exactly (tests/test_tt_plan.py). The sort stays in XLA
(`prefix.sort_lookups`, shared by both).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.kernels.scan import exclusive_scan
from tbe_jax.specs import next_pow2
from tt_jax import prefix
from tt_jax.kernels.config import TTForwardConfig
from tt_jax.kernels.tiles import masked_store

_COUNTS = 3  # per block: new rows, new groups, valid lookups


def _block(pid, n, block):
    j = pid * block + jnp.arange(block, dtype=jnp.int32)
    return j, j < n


def _load(ref, j, live, other=0):
    return plgpu.load(ref.at[j], mask=live, other=other)


class _Consts:
    """Per local table: prefix base; per core t < T-1 its radix and stacked base; the last core's stacked base;
    the first sort key; the last core's radix p_T. One table: Python ints (immediates in the kernels); several: a
    small int32 operand gathered per lookup."""

    def __init__(self, layout):
        specs, t_cores = layout.specs, layout.num_cores
        rows = [list(layout.prefix_base[:-1])]
        for c in range(t_cores - 1):
            rows.append([s.p_shapes[c] for s in specs])
            rows.append(list(layout.core_base[c][:-1]))
        rows.append(list(layout.core_base[-1][:-1]))
        rows.append(list(layout.key_base[:-1]))
        rows.append([s.p_shapes[-1] for s in specs])
        self.table = np.asarray(rows, np.int32)
        self.n_tables = len(specs)
        self.t_cores = t_cores

    def prefix_base(self, ref, t):
        return self._get(ref, 0, t)

    def radix(self, ref, c, t):
        return self._get(ref, 1 + 2 * c, t)

    def core_base(self, ref, c, t):
        return self._get(ref, 2 + 2 * c, t)

    def last_base(self, ref, t):
        return self._get(ref, 2 * self.t_cores - 1, t)

    def key_base(self, ref, t):
        return self._get(ref, 2 * self.t_cores, t)

    def p_last(self, ref, t):
        return self._get(ref, 2 * self.t_cores + 1, t)

    def _get(self, ref, row, t):
        if self.n_tables == 1:
            return int(self.table[row, 0])
        return plgpu.load(ref.at[row * self.n_tables + t])


def _fields(keys, consts_ref, j, live, *, consts: _Consts):
    """Per sorted lookup j: (produces a row, its row's key parts, prefix, last digit, local table), from the sort's
    keys (`bookkeeping`'s key, key2, tab) as `prefix.build_flow` derives them."""
    key_ref, key2_ref, tab_ref = keys
    k = _load(key_ref, j, live, prefix.SENTINEL)
    valid = k != prefix.SENTINEL
    if key2_ref is not None:  # two-key sort: (table, table key)
        t = jnp.where(valid, k, 0)
        local = _load(key2_ref, j, live, prefix.SENTINEL)
        row = (k, local)
    elif tab_ref is not None:  # one packed key over stacked tables
        t = _load(tab_ref, j, live)
        local = k - consts.key_base(consts_ref, t)
        row = (k,)
    else:  # one table
        t = jnp.zeros_like(j)
        local = k
        row = (k,)
    p_last = consts.p_last(consts_ref, t)
    return valid, row, consts.prefix_base(consts_ref, t) + local // p_last, local % p_last, t


def _flags(keys, consts_ref, j, live, *, consts: _Consts):
    """(valid, new row, new group) as int32 0/1, prefix, last digit and local table of the sorted lookups j: a
    lookup starts a row (group) where its row key (prefix) differs from the previous lookup's."""
    valid, row, pre, suf, t = _fields(keys, consts_ref, j, live, consts=consts)
    _, prev_row, prev_pre, _, _ = _fields(keys, consts_ref, j - 1, live & (j >= 1), consts=consts)
    first = j == 0
    same = row[0] == prev_row[0]
    for a, b in zip(row[1:], prev_row[1:]):
        same = same & (a == b)
    new_row = valid & (first | ~same)
    new_grp = new_row & (first | (pre != prev_pre))
    i32 = jnp.int32
    return valid.astype(i32), new_row.astype(i32), new_grp.astype(i32), pre, suf, t


def _count_kernel(*refs, n, consts, block):
    *keys, consts_ref, counts_ref = refs
    pid = pl.program_id(0)
    j, live = _block(pid, n, block)
    valid, new_row, new_grp, *_ = _flags(keys, consts_ref, j, live, consts=consts)
    lane = jnp.arange(4, dtype=jnp.int32)
    rows, grps, valid = (jnp.sum(jnp.where(live, x, 0)) for x in (new_row, new_grp, valid))
    plgpu.store(counts_ref.at[pid * _COUNTS + lane], jnp.where(lane == 0, rows, jnp.where(lane == 1, grps, valid)),
                mask=lane < _COUNTS)


def _item_flags(new_row, new_grp, uid, *, chunk, prefix_reuse):
    """The new work items (as `build_flow`): every row without prefix reuse; else every group start and, with
    `chunk`, every row numbered a multiple of chunk."""
    if not prefix_reuse:
        return new_row
    if chunk:
        return jnp.where((new_grp > 0) | ((new_row > 0) & (uid % chunk == 0)), 1, 0)
    return new_grp


def _items_kernel(*refs, n, chunk, prefix_reuse, consts, block):
    *keys, consts_ref, base_ref, counts_ref = refs
    pid = pl.program_id(0)
    j, live = _block(pid, n, block)
    _, new_row, new_grp, *_ = _flags(keys, consts_ref, j, live, consts=consts)
    new_row, new_grp = jnp.where(live, new_row, 0), jnp.where(live, new_grp, 0)
    uid = plgpu.load(base_ref.at[pid * _COUNTS]) + jnp.cumsum(new_row) - 1
    new_item = _item_flags(new_row, new_grp, uid, chunk=chunk, prefix_reuse=prefix_reuse)
    plgpu.store(counts_ref.at[pid], jnp.sum(new_item))


def _write_kernel(*refs, n, cap, chunk, prefix_reuse, t_cores, digits, whole_groups, consts, interpret, block):
    # inputs: the sort's keys (1-3 arrays), consts, perm, base, ibase, num_rows, num_groups, num_valid, num_items;
    # outputs: inverse, row_suffix, row_start, sorted_row, item_meta, (group_meta)
    n_out = 5 if whole_groups else 6
    ins, outs = refs[:-n_out], refs[-n_out:]
    *keys, consts_ref, perm_ref, base_ref, ibase_ref, rows_ref, groups_ref, valid_ref, items_ref = ins
    inverse_ref, row_suffix_ref, row_start_ref, sorted_row_ref, item_meta_ref, *group_meta_refs = outs
    pid = pl.program_id(0)
    j, live = _block(pid, n, block)
    valid, new_row, new_grp, pre, suf, t = _flags(keys, consts_ref, j, live, consts=consts)
    new_row, new_grp = jnp.where(live, new_row, 0), jnp.where(live, new_grp, 0)
    perm = _load(perm_ref, j, live)
    zero = jnp.int32(0)
    num_rows, num_groups, num_valid, num_items = (plgpu.load(r.at[zero]) for r in (rows_ref, groups_ref, valid_ref,
                                                                                   items_ref))
    uid = plgpu.load(base_ref.at[pid * _COUNTS]) + jnp.cumsum(new_row) - 1
    gid = plgpu.load(base_ref.at[pid * _COUNTS + 1]) + jnp.cumsum(new_grp) - 1
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

    # The item table's columns for a lookup starting an item: decoded as `_meta_table` does.
    rest = pre - consts.prefix_base(consts_ref, t)
    cols = [None] * (t_cores - 1)
    for c in reversed(digits):  # the prefix's digits, least significant first
        radix = consts.radix(consts_ref, c, t)
        cols[c] = consts.core_base(consts_ref, c, t) + rest % radix
        rest = rest // radix
    last_base = consts.last_base(consts_ref, t) + jnp.zeros_like(j)
    # Each table row (first row, prefix digits, last-core base) is stored whole: one [block, 2^k] store whose lanes
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


def bookkeeping(layout, key, key2, tab, perm, *, cap: int, chunk: int, prefix_reuse: bool, interpret: bool,
                block: int, scan_chunk: int):
    """`build_flow`'s outputs after the sort, from the sorted keys (`prefix.SortedLookups`: `key`: the primary
    key, `prefix.SENTINEL` for lookups that produce no row; `key2`: the table key of a two-key sort, whose primary
    key is the table; `tab`: with one packed key over stacked tables, each sorted lookup's local table) and
    `perm`: (inverse, row_suffix, row_start,
    sorted_row, item_meta, num_items, group_meta, num_rows, num_groups); group_meta is item_meta when items are
    whole groups. The per-lookup flags (new row, new group), prefix and last digit are derived in each pass from
    the keys (a lookup and the one before it), never stored. `block`: sorted lookups per program, `scan_chunk`: rows
    per step of the block counts' prefix sums (`TTForwardConfig.plan_block`, `plan_scan_chunk`)."""
    n = key.shape[0]
    t_cores = layout.num_cores
    consts = _Consts(layout)
    keys = [x for x in (key, key2, tab) if x is not None]
    has = (True, key2 is not None, tab is not None)

    def with_keys(kernel):  # the kernels take (key, key2, tab) with None for the absent ones
        def wrapped(*refs, **kw):
            it = iter(refs[: len(keys)])
            return kernel(*[next(it) if h else None for h in has], *refs[len(keys):], **kw)
        return wrapped

    grid = n // block + 1  # the last block also covers the fill slots up to cap (<= n)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    i32 = jnp.int32
    const_arr = jnp.asarray(consts.table.reshape(-1))
    counts = pallas_call(
        with_keys(functools.partial(_count_kernel, n=n, consts=consts, block=block)), out_shape=jax.ShapeDtypeStruct(
            (grid * _COUNTS,), i32), grid=(grid,), compiler_params=params, interpret=interpret, name="tt_plan_count",
    )(*keys, const_arr)
    base, (num_rows, num_groups, num_valid) = exclusive_scan(counts, _COUNTS, chunk=scan_chunk, interpret=interpret)
    kw = dict(n=n, chunk=chunk, prefix_reuse=prefix_reuse, consts=consts, block=block)
    icounts = pallas_call(
        with_keys(functools.partial(_items_kernel, **kw)), out_shape=jax.ShapeDtypeStruct((grid,), i32),
        grid=(grid,), compiler_params=params, interpret=interpret, name="tt_plan_items",
    )(*keys, const_arr, base)
    ibase, (num_items,) = exclusive_scan(icounts, 1, chunk=scan_chunk, interpret=interpret)
    whole_groups = prefix_reuse and not chunk
    meta_len = (cap + 1) * (t_cores + 1)
    shapes = [(n,), (cap,), (cap + 1,), (n,), (meta_len,)] + ([] if whole_groups else [(meta_len,)])
    outs = pallas_call(
        with_keys(functools.partial(_write_kernel, cap=cap, t_cores=t_cores, digits=layout.prefix_digits,
                                    whole_groups=whole_groups, interpret=interpret, **kw)),
        out_shape=[jax.ShapeDtypeStruct(s, i32) for s in shapes], grid=(grid,), compiler_params=params,
        interpret=interpret, name="tt_plan_write",
    )(*keys, const_arr, perm, base, ibase, num_rows, num_groups, num_valid, num_items)
    inverse, row_suffix, row_start, sorted_row, item_meta = outs[:5]
    group_meta = item_meta if whole_groups else outs[5]
    return (inverse, row_suffix, row_start, sorted_row, item_meta, num_items.reshape(()), group_meta,
            num_rows.reshape(()), num_groups.reshape(()))


def build_flow(layout, indices, offsets, *, features: tuple[int, ...], feature_table_map: tuple[int, ...],
               batch: int, chunk: int = 64, prefix_reuse: bool = True, interpret: bool = False,
               block: int | None = None, scan_chunk: int | None = None) -> prefix.FlowPlan:
    """`prefix.build_flow` (same arguments, the same plan) with its bookkeeping after the sort
    (`prefix.sort_lookups`) in the Pallas passes of `bookkeeping` instead of ~15 XLA ops: the fused forward's
    plan. `interpret`: Pallas interpret mode; `block`, `scan_chunk`: `TTForwardConfig.plan_block`,
    `plan_scan_chunk` (None: their defaults)."""
    default = TTForwardConfig()
    cap = prefix.capacity(layout, indices.shape[0])
    key, key2, tab, perm = prefix.sort_lookups(layout, indices, offsets, features=features,
                                               feature_table_map=feature_table_map, batch=batch)
    (inverse, row_suffix, row_start, sorted_row, item_meta, num_items, group_meta, num_rows,
     num_groups) = bookkeeping(
        layout, key, key2, tab, perm, cap=cap, chunk=chunk, prefix_reuse=prefix_reuse, interpret=interpret,
        block=default.plan_block if block is None else block,
        scan_chunk=default.plan_scan_chunk if scan_chunk is None else scan_chunk)
    return prefix.FlowPlan(item_meta, num_items.reshape(1), row_suffix, num_rows, num_groups, inverse, perm,
                           sorted_row, row_start, group_meta)
