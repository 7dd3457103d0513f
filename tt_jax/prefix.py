"""FlowTT preprocessing (section 3.3): sort, unique, mixed-radix split, prefix groups, work items.

Jittable with static shapes (everything sized by N = len(ids)) and no host sync:
counts stay on the device. The prefix of a row is its first T-1 digits
(`id // p_T`); rows sharing a prefix share the contraction of the first T-1
cores, so it is computed once per prefix group. Long groups are split into work
items of at most `chunk` distinct suffixes so that skewed groups can be spread
over programs.

Two plans: `build` (one table, the unfused XLA `rows_by_prefix` baseline) and
`build_flow` (the fused kernel's: several tables stacked by `StackedTables`,
one int32-key sort, a flat work-item table and the lookup -> distinct-row map;
the fused forward runs its bookkeeping after the sort as Pallas passes,
`tt_jax.kernels.plan.build_flow`, which builds on this module).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tt_jax import reference


class PrefixPlan(NamedTuple):
    uniq: jax.Array  # [N] int32: distinct valid ids, sorted; padded with `num_rows`
    num_uniq: jax.Array  # [] int32
    inverse: jax.Array  # [N] int32: per lookup, its index in `uniq` (N for invalid lookups)
    group_of: jax.Array  # [N] int32: per distinct id, its prefix group
    group_start: jax.Array  # [N + 1] int32: first distinct id of each prefix group
    num_groups: jax.Array  # [] int32
    item_group: jax.Array  # [2N] int32: per work item, its prefix group
    item_first: jax.Array  # [2N] int32: per work item, its first distinct id
    item_count: jax.Array  # [2N] int32: per work item, how many distinct ids (<= chunk)
    num_items: jax.Array  # [] int32


def build(ids: jax.Array, valid: jax.Array, spec, *, chunk: int = 64) -> PrefixPlan:
    """Prefix groups and work items for one table's lookups `ids` (invalid ones masked by `valid`)."""
    n = ids.shape[0]
    fill = spec.num_embeddings
    key = jnp.where(valid, ids, fill).astype(jnp.int32)
    uniq, inverse = jnp.unique(key, size=n, fill_value=fill, return_inverse=True)
    uniq = uniq.astype(jnp.int32)
    inverse = jnp.where(valid, inverse.reshape(-1), n).astype(jnp.int32)
    live = uniq < fill
    num_uniq = jnp.sum(live.astype(jnp.int32))
    prefix = jnp.where(live, uniq // spec.p_shapes[-1], -1)
    is_start = live & jnp.concatenate([jnp.ones((1,), bool), prefix[1:] != prefix[:-1]])
    group_of = (jnp.cumsum(is_start.astype(jnp.int32)) - 1).astype(jnp.int32)
    num_groups = jnp.sum(is_start.astype(jnp.int32))
    starts = jnp.full((n + 1,), 0, jnp.int32).at[jnp.where(is_start, group_of, n + 1)].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")
    group_start = jnp.where(jnp.arange(n + 1) < num_groups, starts, num_uniq)
    # Work items: each group split into ceil(size / chunk) items.
    size = group_start[1:] - group_start[:-1]
    n_items = (size + chunk - 1) // chunk
    item0 = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_items).astype(jnp.int32)])
    max_items = 2 * n
    t = jnp.arange(max_items, dtype=jnp.int32)
    item_group = jnp.clip(jnp.searchsorted(item0, t, side="right").astype(jnp.int32) - 1, 0, n - 1)
    item_first = group_start[item_group] + (t - item0[item_group]) * chunk
    item_count = jnp.clip(group_start[item_group + 1] - item_first, 0, chunk)
    num_items = item0[-1]
    return PrefixPlan(uniq, num_uniq, inverse, group_of, group_start, num_groups, item_group, item_first,
                      item_count, num_items)


def rows_by_prefix(cores, spec, plan: PrefixPlan) -> jax.Array:
    """`[N, D]` rows of `plan.uniq`, each prefix product computed once (unfused, XLA)."""
    n = plan.uniq.shape[0]
    first_ids = plan.uniq[jnp.minimum(plan.group_start[:-1], n - 1)]  # one id per group (padding: garbage)
    ds = reference.digits(jnp.minimum(first_ids, spec.num_embeddings - 1), spec.p_shapes)
    acc = cores[0][ds[0]][:, 0]  # [G, q1, r1]
    for t in range(1, len(cores) - 1):
        acc = jnp.einsum("nar,nrbs->nabs", acc, cores[t][ds[t]], precision=jax.lax.Precision.HIGHEST)
        acc = acc.reshape(acc.shape[0], -1, acc.shape[-1])  # [G, q1..qt, r_t]
    last = reference.digits(jnp.minimum(plan.uniq, spec.num_embeddings - 1), spec.p_shapes)[-1]
    c = acc[jnp.minimum(plan.group_of, n - 1)]  # [N, q1..q_{T-1}, r]
    g = cores[-1][last][..., 0]  # [N, r, q_T]
    out = jnp.einsum("nar,nrb->nab", c, g, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(n, -1)


# -----------------------------------------------------------------------------
# The fused kernel's plan: several tables, one sort, items in a flat table.
# -----------------------------------------------------------------------------

SENTINEL = 2**31 - 1  # sort key of lookups that produce no row (sorts last; `tt_jax.kernels.plan` reads it too)


@dataclasses.dataclass(frozen=True)
class StackedTables:
    """Tables sharing `q_shapes` and `ranks`: one sort, one kernel launch.

    Their cores are stacked along the p axis (core t of table k starts at row
    `core_base[t][k]` of the stacked core t), so a work item names core rows,
    never tables. A lookup's sort key is `key_base[k] + key` with `key` its id's
    digits in `prefix_digits` order, then the last digit (one int32 key, so XLA
    can use its fast key-value sort); when the keys reach 2**31 (`packed`
    False) two int32 keys (table, key) are sorted instead, more slowly. Prefix
    groups are numbered globally: table k's prefix P (= key // p_T, the prefix
    digits in `prefix_digits` order) is `prefix_base[k] + P`.

    Attributes:
      tables: the global table ids of the group, in stacking order.
      specs: their specs.
      packed_limit: the one packed int32 key is sorted while every key stays below this (default and most
        2**31 - 1, the int32 format's limit; `TTForwardConfig.packed_key_limit`, lowered by tests to run the
        two-key sort on small tables).
      reorder_limit: T = 3 reorders the digits only while every table's p1 p2 p3 stays below this (default and
        most 2**31 - 1; `TTForwardConfig.reorder_key_limit`, lowered by tests to run the plain order).
    """

    tables: tuple[int, ...]
    specs: tuple
    packed_limit: int = SENTINEL
    reorder_limit: int = SENTINEL

    def __post_init__(self):
        for name in ("packed_limit", "reorder_limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v <= SENTINEL:
                raise ValueError(f"StackedTables.{name} must be an int in [0, 2**31 - 1], got {v!r}")
        s0 = self.specs[0]
        for s in self.specs[1:]:
            if s.q_shapes != s0.q_shapes or s.ranks != s0.ranks:
                raise ValueError(f"stacked tables need equal q_shapes and ranks, got {s0} and {s}")

    @property
    def num_cores(self) -> int:
        return self.specs[0].num_cores

    @property
    def q_shapes(self) -> tuple[int, ...]:
        return self.specs[0].q_shapes

    @property
    def full_ranks(self) -> tuple[int, ...]:
        return self.specs[0].full_ranks

    @property
    def dim(self) -> int:
        return self.specs[0].embedding_dim

    @property
    def prefix_base(self) -> tuple[int, ...]:
        counts = [math.prod(s.p_shapes[:-1]) for s in self.specs]
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(counts)]))

    @property
    def core_base(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(x) for x in np.concatenate([[0], np.cumsum([s.p_shapes[t] for s in self.specs])]))
                     for t in range(self.num_cores))

    @property
    def prefix_digits(self) -> tuple[int, ...]:
        """The cores whose digits form a row's prefix, most significant first: the order in which `build_flow` sorts
        (then by the last digit). T = 3 sorts by (i2, i1): the work items then come out ordered by their middle-core
        slice, the order the packed kernels (`packed_prefix_products`, the backward's dP1 and middle-core sum) take
        them in, with no second sort. Other T: (i1, ..., i_{T-1})."""
        t = self.num_cores
        spans = [math.prod(s.p_shapes) for s in self.specs]
        # Not where the larger key range (p1 p2 p3 per table instead of N) would cost the one-key sort.
        loses_packing = sum(s.num_embeddings for s in self.specs) < self.packed_limit <= sum(spans)
        if t == 3 and max(spans) < self.reorder_limit and not loses_packing:
            return (1, 0)
        return tuple(range(t - 1))

    @property
    def reordered(self) -> bool:
        """Whether the sort key reorders the id's digits (`prefix_digits` is not (0, 1, ..., T-2))."""
        return self.prefix_digits != tuple(range(self.num_cores - 1))

    def key_spans(self) -> tuple[int, ...]:
        """Per table, the range of its sort keys (the id with its digits in `prefix_digits` order, then the last):
        the table's row count, or p1 p2 p3 when the digits are reordered (the keys of ids < N then skip values)."""
        if self.reordered:
            return tuple(math.prod(s.p_shapes) for s in self.specs)
        return tuple(s.num_embeddings for s in self.specs)

    @property
    def key_base(self) -> tuple[int, ...]:
        """Table k's sort keys start at `key_base[k]` (one int32 key for all tables when `packed`)."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.key_spans())]))

    @property
    def packed(self) -> bool:
        return self.key_base[-1] < self.packed_limit

    @property
    def total_rows(self) -> int:
        return sum(s.num_embeddings for s in self.specs)


def stack_tables(specs, feature_table_map, *, packed_limit: int = SENTINEL, reorder_limit: int = SENTINEL
                 ) -> list[tuple[StackedTables, tuple[int, ...]]]:
    """Tables grouped by (q_shapes, ranks), each with the features that read it (in feature order).
    `packed_limit`, `reorder_limit`: the groups' sort rule (`StackedTables`; `TTForwardConfig.packed_key_limit`,
    `reorder_key_limit`)."""
    groups: dict = {}
    for t, s in enumerate(specs):
        groups.setdefault((s.q_shapes, s.ranks), []).append(t)
    out = []
    for tables in groups.values():
        feats = tuple(f for f, t in enumerate(feature_table_map) if t in tables)
        if feats:
            out.append((StackedTables(tuple(tables), tuple(specs[t] for t in tables), packed_limit=packed_limit,
                                      reorder_limit=reorder_limit), feats))
    return out


def core_groups(specs) -> tuple[StackedTables, ...]:
    """The groups the params store their cores by (`tt_jax.params`): every table, grouped by (q_shapes, ranks)
    as `stack_tables` groups them, in the same order (a group of `stack_tables(specs, ftm)` has the `tables` of
    one of these, those no feature reads left out; its sort limits may differ), with the default sort limits."""
    return tuple(layout for layout, _ in stack_tables(specs, tuple(range(len(specs)))))


def stack_cores(layout: StackedTables, all_cores) -> list[jax.Array]:
    """Per core, the group's cores (`all_cores`: per table, its cores) stacked along p, flattened
    (`[sum p_t * r * q * r']`): the bytes of the params' stacked buffers (`tt_jax.params`), which the kernels
    read as they are; what the forward and backward built on every step before the params were stored stacked."""
    out = []
    for t in range(layout.num_cores):
        parts = [jnp.asarray(all_cores[k][t], jnp.float32).reshape(-1) for k in layout.tables]
        out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    return out


class FlowPlan(NamedTuple):
    """Device-resident work for one `StackedTables` (all sizes static; counts are device scalars).

    A work item is a run of at most `chunk` distinct rows sharing one prefix
    (the first T-1 digits); the kernel computes the prefix product once per item.
    `item_meta` is flat, `item_cols` int32 per item, row-major:
    [first distinct row, stacked row of digit 1 in core 1, ..., of digit T-1 in
    core T-1, base of the table's rows in the stacked last core]. Row
    `num_items` (and every later row) has first = num_rows, so an item's row
    count is `first[t + 1] - first[t]`. Distinct rows, groups and items are
    numbered in sort-key order (by table, then the digits in
    `StackedTables.prefix_digits` order, then the last digit).
    """

    item_meta: jax.Array  # [(cap + 1) * item_cols] int32
    num_items: jax.Array  # [1] int32
    row_suffix: jax.Array  # [cap] int32: per distinct row, its last digit (valid below num_rows)
    num_rows: jax.Array  # [] int32: distinct rows U
    num_groups: jax.Array  # [] int32: distinct prefixes
    inverse: jax.Array  # [N] int32: per lookup, its distinct row; -1 if it produces none
    # For the backward (appended; XLA drops them from a forward-only program):
    perm: jax.Array  # [N] int32: lookup positions sorted by row (those producing no row last)
    sorted_row: jax.Array  # [N] int32: distinct row of each sorted position (N for the dropped tail)
    row_start: jax.Array  # [cap + 1] int32: first sorted position of each distinct row (valid lookups past U)
    group_meta: jax.Array  # [(cap + 1) * item_cols] int32: as item_meta, one item per whole prefix group
    # Set by a forward run for differentiation (`tt_jax.kernels.forward.pooled_forward(keep_c=True)`, T = 3):
    # per work item its prefix product `[q1 q2, r2]`, so the backward's group kernel need not recompute it.
    prefix_c: jax.Array | None = None  # [item_bound * q1 q2 * r2] fp32


def sort_key(layout: StackedTables, ids, p_shapes):
    """Per id, its digits in `layout.prefix_digits` order, then the last digit, as one int32 (`p_shapes`: per core
    its radix, ints or per-lookup arrays). The id itself when the digits keep their order."""
    if not layout.reordered:
        return ids
    order = layout.prefix_digits
    digits, rest = [], ids
    for p in reversed(p_shapes):  # least significant first
        digits.append(rest % p)
        rest = rest // p
    digits = digits[::-1]
    key = digits[order[0]]
    for c in order[1:]:
        key = key * p_shapes[c] + digits[c]
    return key * p_shapes[-1] + digits[-1]


def item_bound(layout: "StackedTables", cap: int, chunk: int, prefix_reuse: bool) -> int | None:
    """Static bound on the work items of `build_flow` (None without prefix reuse: one item per row)."""
    if not prefix_reuse:
        return None
    groups = min(cap, layout.prefix_base[-1])
    return max(1, min(cap, groups + (-(-cap // chunk) if chunk else 0)))


def item_cols(layout: StackedTables) -> int:
    return layout.num_cores + 1


def capacity(layout: StackedTables, n: int) -> int:
    """Static bound on distinct rows (and work items) among `n` lookups."""
    return max(1, min(n, layout.total_rows))


def _table_const(values):
    """Per local table a value -> an int32 array to gather from."""
    return jnp.asarray(np.asarray(values, np.int32))


def _feature_of(offsets, n, nf, batch):
    """Feature of each of `n` positions: +1 at every feature's first offset, prefix-summed."""
    starts = offsets[batch : nf * batch : batch]
    feat = jnp.cumsum(jnp.zeros((n,), jnp.int32).at[starts].add(1, mode="drop"))
    return jnp.minimum(feat, nf - 1)


class SortedLookups(NamedTuple):
    """The sort of `build_flow` (`sort_lookups`): what its bookkeeping, XLA or Pallas (`tt_jax.kernels.plan`),
    starts from."""

    key: jax.Array  # [N] int32, sorted: the primary key (`SENTINEL` for lookups that produce no row)
    key2: jax.Array | None  # [N] int32: the table key of the two-key sort (whose primary key is the local table)
    tab: jax.Array | None  # [N] int32: with one packed key over stacked tables, each sorted lookup's local table
    perm: jax.Array  # [N] int32: the lookup positions in sorted order


def sort_lookups(
    layout: StackedTables,
    indices: jax.Array,  # [N] int32
    offsets: jax.Array,  # [F * B + 1] int32, all features
    *,
    features: tuple[int, ...],
    feature_table_map: tuple[int, ...],
    batch: int,
) -> SortedLookups:
    """`build_flow`'s sort (arguments as there): one int32 key per lookup (its table's `key_base` plus
    `sort_key`), or two (local table, key) where the group's keys reach `layout.packed_limit`."""
    n = indices.shape[0]
    nf = len(feature_table_map)
    ids = indices.astype(jnp.int32)
    offsets = offsets.astype(jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    live = (pos >= offsets[0]) & (pos < offsets[-1])
    local_of_table = {t: k for k, t in enumerate(layout.tables)}
    local = [local_of_table.get(feature_table_map[f], -1) if f in features else -1 for f in range(nf)]
    specs = layout.specs

    # Per sorted lookup a primary key (`SENTINEL` for lookups that produce no row), a second key or None, and its
    # local table or None (one table, or the two-key sort where the primary key is the table).
    key2 = tab = None
    if len(specs) == 1:
        # One table: the key is the id (its digits reordered, `sort_key`); prefix and last digit follow by division.
        if nf == 1:
            lt_ok = True
        else:
            lt_ok = jnp.asarray(np.asarray([x >= 0 for x in local]))[_feature_of(offsets, n, nf, batch)]
        valid = live & lt_ok & (ids >= 0) & (ids < specs[0].num_embeddings)
        key = sort_key(layout, ids, specs[0].p_shapes)
        key1, perm = jax.lax.sort((jnp.where(valid, key, SENTINEL), pos), num_keys=1)
    else:
        lt = _table_const(local)[_feature_of(offsets, n, nf, batch)]
        safe = jnp.maximum(lt, 0)
        valid = live & (lt >= 0) & (ids >= 0) & (ids < _table_const([s.num_embeddings for s in specs])[safe])
        tkey = sort_key(layout, ids, [_table_const([s.p_shapes[c] for s in specs])[safe] for c in range(len(
            specs[0].p_shapes))])
        if layout.packed:
            key_base = _table_const(layout.key_base[:-1])
            key1, perm = jax.lax.sort((jnp.where(valid, key_base[safe] + tkey, SENTINEL), pos), num_keys=1)
            tab = jnp.where(key1 != SENTINEL, safe[perm], 0)
        else:
            key1, key2, perm = jax.lax.sort(
                (jnp.where(valid, lt, SENTINEL), jnp.where(valid, tkey, SENTINEL), pos), num_keys=2)
    return SortedLookups(key1, key2, tab, perm)


def build_flow(
    layout: StackedTables,
    indices: jax.Array,  # [N] int32
    offsets: jax.Array,  # [F * B + 1] int32, all features
    *,
    features: tuple[int, ...],  # the features that read the group's tables
    feature_table_map: tuple[int, ...],  # per feature (all F), its global table
    batch: int,
    chunk: int = 64,
    prefix_reuse: bool = True,
) -> FlowPlan:
    """Sort, unique, prefix groups, work items and the lookup -> distinct row map (FlowTT 3.3).

    Jittable, no host sync. Lookups of other groups' features, outside
    `[offsets[0], offsets[-1])`, or with ids outside `[0, N_table)` produce no
    row (`inverse` -1). `chunk` caps the distinct rows of an item (0: whole
    prefix groups); with `prefix_reuse` False every distinct row is its own item
    (the "unique only" ablation: the kernel recomputes each row's prefix). The sort is `sort_lookups`; the
    bookkeeping after it here is ~15 XLA ops, the definition that `tt_jax.kernels.plan.build_flow` (the same
    plan, that bookkeeping in three Pallas passes: the fused forward's) is tested against.
    """
    n = indices.shape[0]
    cap = capacity(layout, n)
    specs = layout.specs
    pos = jnp.arange(n, dtype=jnp.int32)

    key1, key2, tab, perm = sort_lookups(layout, indices, offsets, features=features,
                                         feature_table_map=feature_table_map, batch=batch)
    valid_s = key1 != SENTINEL
    same_row = key1[1:] == key1[:-1]
    if len(specs) == 1:
        t_s, id_s, pt, pre_base = None, key1, specs[0].p_shapes[-1], 0
    else:
        if key2 is None:
            t_s, id_s = tab, key1 - _table_const(layout.key_base[:-1])[tab]
        else:
            t_s, id_s = jnp.where(valid_s, key1, 0), key2
            same_row = same_row & (key2[1:] == key2[:-1])
        pt = _table_const([s.p_shapes[-1] for s in specs])[t_s]
        pre_base = _table_const(layout.prefix_base[:-1])[t_s]
    pre_s = pre_base + id_s // pt
    suf_s = id_s % pt
    first = jnp.ones((1,), bool)
    new_row = valid_s & jnp.concatenate([first, ~same_row])
    new_grp = new_row & jnp.concatenate([first, pre_s[1:] != pre_s[:-1]])
    uid = jnp.cumsum(new_row.astype(jnp.int32)) - 1
    num_rows = jnp.sum(new_row.astype(jnp.int32))
    if not prefix_reuse:
        new_item = new_row
    elif chunk:
        # An item starts at every group start and at every distinct row numbered a multiple of chunk, so it has
        # at most `chunk` rows of one group (no per-group rank needed: one scan fewer than aligning to groups).
        new_item = new_grp | (new_row & (uid % chunk == 0))
    else:
        new_item = new_grp
    inverse = jnp.zeros((n,), jnp.int32).at[perm].set(jnp.where(valid_s, uid, -1), unique_indices=True)
    row_suffix = jnp.zeros((cap,), jnp.int32).at[jnp.where(new_row, uid, cap)].set(suf_s, mode="drop")
    num_valid = jnp.sum(valid_s.astype(jnp.int32))
    row_start = jnp.full((cap + 1,), num_valid, jnp.int32).at[jnp.where(new_row, uid, cap + 1)].set(
        pos, mode="drop")
    sorted_row = jnp.where(valid_s, uid, n)
    k_s = None if len(specs) == 1 else t_s
    item_meta, num_items = _meta_table(layout, new_item, pre_s, k_s, uid, num_rows, cap)
    group_meta = item_meta if new_item is new_grp else _meta_table(layout, new_grp, pre_s, k_s, uid, num_rows, cap)[0]
    return FlowPlan(item_meta, num_items.reshape(1), row_suffix, num_rows,
                    jnp.sum(new_grp.astype(jnp.int32)), inverse, perm, sorted_row, row_start, group_meta)


def _meta_table(layout: StackedTables, new_item, pre_s, t_s, uid, num_rows, cap):
    """The flat item table of `FlowPlan.item_meta` for items starting where `new_item` (sorted lookups)."""
    specs = layout.specs

    iid = jnp.cumsum(new_item.astype(jnp.int32)) - 1
    num_items = jnp.sum(new_item.astype(jnp.int32))
    islot = jnp.where(new_item, iid, cap + 1)
    item_first = jnp.full((cap + 1,), num_rows, jnp.int32).at[islot].set(uid, mode="drop")
    item_pre = jnp.zeros((cap,), jnp.int32).at[islot].set(pre_s, mode="drop")
    # Decode each item's prefix into stacked core rows (digits first-most-significant).
    if t_s is None:
        k = None
        rest = item_pre
    else:
        k = jnp.zeros((cap,), jnp.int32).at[islot].set(t_s, mode="drop")  # the item's local table
        rest = item_pre - _table_const(layout.prefix_base[:-1])[k]
    t_cores = layout.num_cores
    cols = [None] * (t_cores - 1)
    for t in reversed(layout.prefix_digits):  # least significant first
        radix = [s.p_shapes[t] for s in specs]
        r = radix[0] if k is None else _table_const(radix)[k]
        base = 0 if k is None else _table_const(layout.core_base[t][:-1])[k]
        cols[t] = base + rest % r
        rest = rest // r
    last_base = jnp.zeros((cap,), jnp.int32) if k is None else _table_const(layout.core_base[-1][:-1])[k]
    meta = jnp.stack([item_first[:-1]] + cols + [last_base], axis=1)
    sentinel = jnp.concatenate([item_first[-1:], jnp.zeros((t_cores,), jnp.int32)])
    return jnp.concatenate([meta.reshape(-1), sentinel]), num_items
