"""The host tier's prefetch (`tbe_jax.host_cache`): a batch's missing rows of the cached tables brought into
their sets' victim slots (LRU or LFU), the evicted changed rows (and states) written back to host memory first;
work proportional to the batch, never to the tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, inputs, memory, preprocess
from tbe_jax.cache_layout import CACHE, NEVER, STATE_ROWS
from tbe_jax.cache_route import batch_facts
from tbe_jax.kernels.copy_rows import copy_rows, gather_rows

# -- prefetch ---------------------------------------------------------------------------------------------------------
def set_hash(rows):
    """A row's set hash (rows within their table): a multiplicative hash, so neighbouring ids spread over sets."""
    return (rows.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)) >> jnp.uint32(7)


def run_lengths(srt, first, limit):
    """Per position of the sorted `srt`: where `first` (a run's first position), the run's length, counting no
    value `>= limit` (those sort last); 0 elsewhere. One reverse scan for the next run's start (a segment sum
    over sorted runs is a scatter-add whose adds collide on each run's slot)."""
    n = srt.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    start = jax.lax.cummin(jnp.where(first | (srt >= limit), pos, n), reverse=True)  # next start at or after p
    after = jnp.concatenate([start[1:], jnp.full((1,), n, jnp.int32)])  # ... strictly after p
    return jnp.where(first, after - pos, 0)


def stable_pick(keys, rank):
    """Per row of `keys` `[m, w]`: the column of its `rank`-th smallest key, ties in column order (column `rank`
    of a stable argsort of the row), from the w x w compares of the row: no sort. Written as w element-wise
    steps over `[m, w]` (one loop fusion): the same compares as a `[m, w, w]` reduce, which XLA's GPU emitter ran
    at 1.25 ms on an H100 for the benchmark's 164k x 16 (its largest XLA kernel of the cached step)."""
    w = keys.shape[1]
    col = jnp.arange(w, dtype=jnp.int32)[None, :]
    place = jnp.zeros(keys.shape, jnp.int32)  # each column's place in the stable order
    for j in range(w):  # column j before column i: a smaller key, or an equal one in an earlier column
        kj = keys[:, j : j + 1]
        place = place + ((kj < keys) | ((kj == keys) & (j < col))).astype(jnp.int32)
    pick = jnp.zeros(keys.shape[:1], jnp.int32)  # the one column whose place is `rank`
    for i in range(w):
        pick = pick + jnp.where(place[:, i] == rank, i, 0)
    return pick


def fill_order(miss, uses, tick):
    """Each miss's place in the prefetch's fill list (`n` where not a miss) and the count of misses. When there
    are more misses than the fill cap, the list's head is what gets filled, so: rows looked up more than once in
    this batch first, then the others; each group in row order, rotated to start at a pseudo-random row of the
    group every prefetch (`tick`). Without the rotation the cap always cut the same end of the row order, so the
    last tables' rows were never cached at all (a 1.05-Zipf model of 8 tables kept 4 of its caches empty)."""
    n = miss.shape[0]
    spin = (jnp.asarray(tick).astype(jnp.uint32) * jnp.uint32(0x9E3779B1)) >> jnp.uint32(1)
    place, base, count = jnp.full((n,), n, jnp.int32), jnp.int32(0), jnp.int32(0)
    for group in (miss & (uses > 1), miss & (uses <= 1)):
        size = jnp.sum(group, dtype=jnp.int32)
        at = jnp.cumsum(group.astype(jnp.int32)) - 1  # place in row order
        shift = (spin % jnp.maximum(size, 1).astype(jnp.uint32)).astype(jnp.int32)
        place = jnp.where(group, base + (at - shift + size) % jnp.maximum(size, 1), place)
        base, count = base + size, count + size
    return place, count


def fill_cap(emb, n: int) -> int:
    """How many of a batch's misses (`n` lookups) a prefetch may fill: `emb.cache_max_fills`, by default 1/16 of
    the lookups (at least 1024); never more than the lookups or the cache's slots. Static."""
    cap = emb.cache_max_fills or max(1024, n // 16)
    return max(1, min(cap, n, emb.cache_layout.total_slots))


def prefetch_impl(emb, params, opt_state, indices, offsets, bpf):
    """`HostCachedEmbedding.prefetch`'s program, under the name scope "tbe_prefetch" (a profile's XLA ops then
    name it in their `tf_op`)."""
    with jax.named_scope("tbe_prefetch"):
        return _prefetch(emb, params, opt_state, indices, offsets, bpf)


def _prefetch(emb, params, opt_state, indices, offsets, bpf):
    emb.check_params(params)
    plan, indices, offsets, _ = inputs.validated(emb, params, indices, offsets, None, bpf)
    n = indices.shape[0]
    d = dict(params[CACHE])
    if n == 0:
        return params if opt_state is None else (params, opt_state)
    offsets, _ = bounds.repair_offsets(offsets, n)
    cl = emb.cache_layout
    r_total, c_total, ways = cl.total_rows, cl.total_slots, cl.ways
    facts = batch_facts(emb, plan)
    feat = preprocess.position_feature(plan, offsets, n)  # offsets repaired above
    valid = preprocess.valid_lookups(plan, indices, offsets, feat)
    ci = jnp.asarray(facts.ci)[feat]
    is_c = valid & (ci >= 0)
    row_base = jnp.asarray(cl.base("rows")[:-1].astype(np.int32))
    crow = jnp.where(is_c, row_base[jnp.maximum(ci, 0)] + jnp.where(is_c, indices, 0), r_total)

    # distinct rows: sorted, each at its first position (`first`), with its count of lookups
    srt = jnp.sort(crow)
    prev = jnp.concatenate([jnp.full((1,), -1, srt.dtype), srt[:-1]])
    first = (srt != prev) & (srt < r_total)
    uses = run_lengths(srt, first, r_total)
    row = jnp.where(first, srt, 0)
    slot = jnp.where(first, d["slot_of_row"][row], -1)
    hit = first & (slot >= 0)
    miss = first & (slot < 0)
    requested, hits = jnp.sum(first, dtype=jnp.int32), jnp.sum(hit, dtype=jnp.int32)
    lookups = jnp.sum(jnp.where(first, uses, 0), dtype=jnp.int32)
    lookup_hits = jnp.sum(jnp.where(hit, uses, 0), dtype=jnp.int32)
    tick = d["tick"] + 1
    hslot = jnp.where(hit, slot, c_total)
    stamp = d["stamp"].at[hslot].set(tick, mode="drop")
    lfu = emb.cache_policy == "lfu"
    if lfu:  # lookups since the fill, saturating (a hot row stays hot, never wraps)
        score = d["score"]
        hot = score[jnp.minimum(hslot, c_total - 1)]
        score = score.at[hslot].set(hot + jnp.minimum(uses, NEVER - 1 - hot), mode="drop")
    else:  # LRU ranks a filled slot by its last use: its stamp (one scatter over the batch, not two)
        score = stamp

    # the misses, compacted: at most `m` go on (`fill_cap`); the rest stay in host memory this step
    m = fill_cap(emb, n)
    mpos, n_miss = fill_order(miss, uses, tick)
    src = jnp.zeros((m,), jnp.int32).at[jnp.where(mpos < m, mpos, m)].set(jnp.arange(n, dtype=jnp.int32),
                                                                        mode="drop")
    miss = jnp.arange(m, dtype=jnp.int32) < n_miss
    row, uses, n = jnp.where(miss, row[src], 0), uses[src], m

    # each miss: its set, its rank among the batch's misses of that set, the victim way of that rank
    t = jnp.sum(row[:, None] >= jnp.asarray(cl.base("rows")[1:-1].astype(np.int32))[None, :], axis=1,
                dtype=jnp.int32) if len(cl.tables) > 1 else jnp.zeros_like(row)
    local = row - row_base[t]
    sets = jnp.asarray(np.asarray(cl.sets, np.uint32))
    gset = jnp.asarray(cl.base("sets")[:-1].astype(np.int32))[t] + (set_hash(local) % sets[t]).astype(jnp.int32)
    key = jnp.where(miss, gset, jnp.int32(NEVER))
    order = jnp.argsort(key, stable=True)
    ks = key[order]
    pos = jnp.arange(n, dtype=jnp.int32)
    start = jax.lax.cummax(jnp.where(ks != jnp.concatenate([jnp.full((1,), -1, ks.dtype), ks[:-1]]), pos, 0))
    rank = jnp.zeros((n,), jnp.int32).at[order].set(pos - start)
    way_slots = gset[:, None] * ways + jnp.arange(ways, dtype=jnp.int32)[None, :]
    way_slots = jnp.where(miss[:, None], way_slots, 0)
    w_row = d["row_of_slot"][way_slots]
    locked = stamp[way_slots] >= tick - 1  # this batch's hits and the previous prefetch's rows
    if opt_state is None:  # without the states, only slots whose state is in host memory may go
        locked = locked | (d["state_ok"][way_slots] > 0)
    w_key = jnp.where(locked, NEVER, jnp.where(w_row < 0, jnp.iinfo(jnp.int32).min, score[way_slots]))
    w_key = jax.lax.optimization_barrier(w_key)  # made once (fused into `stable_pick`, its gathers would run w times)
    pick = stable_pick(w_key, jnp.minimum(rank, ways - 1))
    ok = miss & (rank < ways) & (jnp.take_along_axis(w_key, pick[:, None], axis=1)[:, 0] < NEVER)
    if emb.cache_admit_age:  # a one-off row takes an empty slot or a stale one, never a live row's
        picked = jnp.minimum(gset * ways + pick, c_total - 1)
        stale = (d["row_of_slot"][picked] < 0) | (stamp[picked] < tick - emb.cache_admit_age)
        ok = ok & ((uses > 1) | stale)
    victim = jnp.where(ok, gset * ways + pick, c_total)
    old = jnp.where(ok, d["row_of_slot"][jnp.minimum(victim, c_total - 1)], -1)
    back = ok & (old >= 0) & (d["dirty"][jnp.minimum(victim, c_total - 1)] > 0)

    # rows (and states) out of and into the cache, per inner buffer pair of a cached table's dim
    inner_p = emb.inner_params(params)
    inner_s = None if opt_state is None else emb.inner_state(opt_state)
    with jax.named_scope("copies"):
        inner_p, inner_s = move_rows(emb, inner_p, inner_s, t, victim, old, back, row, ok)
    filled_lookups = jnp.sum(jnp.where(ok, uses, 0), dtype=jnp.int32)
    stats = jnp.stack([requested, hits, jnp.sum(ok, dtype=jnp.int32), jnp.sum(back, dtype=jnp.int32), lookups,
                       lookup_hits, lookups - lookup_hits - filled_lookups])

    gone = jnp.where(ok & (old >= 0), old, r_total)
    d["slot_of_row"] = d["slot_of_row"].at[gone].set(-1, mode="drop").at[jnp.where(ok, row, r_total)].set(
        victim, mode="drop")
    d["row_of_slot"] = d["row_of_slot"].at[victim].set(row, mode="drop")
    if lfu:  # LRU's `score` stays as it is (unused: it ranks by `stamp`)
        d["score"] = score.at[victim].set(uses, mode="drop")
    d["stamp"] = stamp.at[victim].set(tick, mode="drop")
    d["dirty"] = d["dirty"].at[victim].set(0, mode="drop")
    d["state_ok"] = d["state_ok"].at[victim].set(int(opt_state is not None), mode="drop")
    d["tick"] = tick
    d["stats"] = stats
    params = {**inner_p, CACHE: d}
    if opt_state is None:
        return params
    rows_of = jnp.where(ok, row, -1)
    outer = emb.outer_state(inner_s, opt_state)
    fields = opt_state._fields[:-1]
    outer = type(opt_state)(*[{**getattr(outer, f), STATE_ROWS: getattr(outer, f)[STATE_ROWS].at[victim].set(
        rows_of, mode="drop")} for f in fields], outer.count)
    return params, outer


def move_rows(emb, inner_p, inner_s, t, victim, old, back, row, ok):
    """Write the evicted changed rows (`back`: slot `victim` -> host row `old`) and fill the misses (host row `row`
    -> slot `victim`, where `ok`), with their states when `inner_s` is given: per pair of inner buffers (the cache
    parts and the host parts of one dim), three launches for the rows and states together (a stage, a fill,
    a write-back). `t`: each miss's cached table."""
    cl, lay = emb.cache_layout, emb.inner.layout
    kernel = emb.uses_kernel()
    slot_fields = () if inner_s is None else inner_s._fields[:-1]
    slots = {f: dict(getattr(inner_s, f)) for f in slot_fields}
    pairs = [(lay.table_group[c], lay.table_group[h]) for c, h in zip(cl.cache_part, cl.host_part)]
    c_off = np.asarray([lay.table_row_offset[c] - int(b) for c, b in zip(cl.cache_part, cl.base("slots"))], np.int32)
    h_off = np.asarray([lay.table_row_offset[h] - int(b) for h, b in zip(cl.host_part, cl.base("rows"))], np.int32)
    c_rows_all = victim + jnp.asarray(c_off)[t]  # the victim slot's row in its cache buffer
    h_old = old + jnp.asarray(h_off)[t]  # the evicted row's row in its host buffer
    h_new = row + jnp.asarray(h_off)[t]  # the miss's row in its host buffer
    for pair in sorted(set(pairs)):
        mine = jnp.asarray(np.asarray([p == pair for p in pairs]))[t] & ok
        c_rows = jnp.where(mine, c_rows_all, -1)
        wb_dst = jnp.where(mine & back, h_old, -1)
        fill_src = jnp.where(mine, h_new, -1)  # a few ascending runs (`fill_order`)
        # The write-backs in host row order: each block of the copy then writes nearby host rows. Random rows of
        # a 2 GB pinned buffer went over the bus at 16 GB/s, sorted ones at 44 (`probe_copy_rows`, H100).
        wb_dst, wb_src = jax.lax.sort((jnp.where(wb_dst >= 0, wb_dst, jnp.iinfo(jnp.int32).max), c_rows),
                                      num_keys=1)
        wb_dst = jnp.where(wb_dst < jnp.iinfo(jnp.int32).max, wb_dst, -1)
        kc, kh = lay.key(pair[0]), lay.key(pair[1])
        trees = [inner_p] + [slots[f] for f in slot_fields]
        # A table's rows and its states share the row ids: one launch copies them all. The changed victims' rows
        # are staged in HBM, the misses fill their slots, then the staged rows go to the host part. Each copy
        # takes what the previous one made (`after`), so XLA keeps this order and writes each buffer in place: a
        # write-back first would leave the fill's read of the host part unordered against a step's later
        # in-place update of it in the same program, and XLA copied the whole host part to keep the value read
        # (2 GB: 465 ms a step, `probe_host_cache_cost`). The fill and the write-back cannot share a launch:
        # XLA refuses a kernel whose outputs lie in both memories (E1200, session 35).
        cache, host = tuple(tree[kc] for tree in trees), tuple(tree[kh] for tree in trees)
        stage = gather_rows(cache, jnp.where(wb_dst >= 0, wb_src, -1), kernel=kernel, interpret=emb.interpret,
                            name="stage")
        cache = copy_rows(cache, host, c_rows, fill_src, kernel=kernel, interpret=emb.interpret, after=stage,
                          name="fill")
        host = copy_rows(host, stage, wb_dst, jnp.arange(wb_dst.shape[0], dtype=jnp.int32), kernel=kernel,
                         interpret=emb.interpret, after=cache, name="write_back")
        for tree, c, h in zip(trees, cache, host):
            tree[kc], tree[kh] = c, memory.keep_on_host(h)
    if inner_s is not None:
        inner_s = type(inner_s)(*[slots[f] for f in slot_fields], inner_s.count)
    return inner_p, inner_s
