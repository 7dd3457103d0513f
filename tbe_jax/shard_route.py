"""The routing of a sharded step, per device: ids to their owners, pooled rows and gradients back.

Pure functions of one device's values and of the placement (`s.layout`, a `tbe_jax.shard_plan.ShardLayout`):
inside the step's `shard_map` (`tbe_jax.shard_programs`) each runs on one device's local arrays, and the only
collective is the `all_to_all` of `all_to_all`, issued when the mesh axis has more than one device. So on one device
(`s.num_devices == 1`) they run without a mesh, and their outputs can be checked against the placement by hand.

- `route`: a device's ids, per destination (its shards' rows, packed in feature order, with each bag's length);
- `merge`: on an owner, the ids received from every device as one batch of `s.local`'s format (with column-wise
  tables, each id's column key: the same on every device holding a block of its table);
- `routed_local`: the two, with the exchange between them;
- `assemble` (pooled) / `sequence_back` (`pooling="none"`): the owners' rows back to the devices they came from;
- `route_grads` / `sequence_grads`: a device's output gradient to the owners, the way its ids went;
- `data_batch`: a device's lookups of replicated (`"data"`) tables, which are not routed (its own samples, from
  its own copy).

`s` is the `ShardedTableBatchedEmbedding` (read: `emb`, `layout`, `num_devices`, `axis_name`, `capacity`,
`comm_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, preprocess


def _local_plan(s, num_offsets: int):
    return s.emb.plan_for(num_offsets)


def route(s, idx, off, psw, scale_mean: bool):
    """On one device: the ids for each destination. Returns (ids [n, cap], lens [n, NS, b], starts [n, NS],
    weights [n, cap] or None, dropped, invalid, repaired, sent, ranks). `ranks` (None unless the plan has
    column-wise tables): per destination and slot, the valid ids of this device before the slot's feature
    (what `merge` needs for the column keys)."""
    emb, lay, n = s.emb, s.layout, s.num_devices
    num = idx.shape[0]
    nf = emb.num_features
    b = (off.shape[0] - 1) // nf
    plan = _local_plan(s, off.shape[0])
    repaired = jnp.int32(0)
    if emb.bounds_check == "warning":
        off, repaired = bounds.repair_offsets(off, num)
    bag, feat = preprocess.position_features(plan, off, num)
    pos = jnp.arange(num, dtype=jnp.int32)
    in_bag = (pos >= off[0]) & (pos < off[-1])
    e_t = jnp.asarray(np.asarray([emb.tables[t].num_embeddings for t in emb.feature_table_map], np.int32))[feat]
    ok_id = in_bag & (idx >= 0) & (idx < e_t)
    invalid = jnp.sum(in_bag & ~ok_id, dtype=jnp.int32)
    q = jnp.asarray(lay.slot_of)[:, feat]  # [n, num]
    qc = jnp.maximum(q, 0)
    r0 = jnp.take_along_axis(jnp.asarray(lay.slot_row0), qc, axis=1)
    nr = jnp.take_along_axis(jnp.asarray(lay.slot_rows), qc, axis=1)
    pr = jnp.take_along_axis(jnp.asarray(lay.slot_prow), qc, axis=1)
    keep = ok_id[None, :] & (q >= 0) & (idx[None, :] >= r0) & (idx[None, :] < r0 + nr)
    cap = num if s.capacity is None else min(s.capacity, num)
    csum = jnp.cumsum(keep, axis=1, dtype=jnp.int32)
    slot_pos = csum - 1
    keep_cap = keep & (slot_pos < cap)
    dropped = jnp.sum(keep & ~keep_cap, dtype=jnp.int32)
    rows = idx[None, :] - r0 + pr
    dst = jnp.where(keep_cap, slot_pos, cap)
    jj = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, num))
    ids = jnp.zeros((n, cap), jnp.int32).at[jj, dst].set(rows, mode="drop")
    # Bag lengths per destination slot: kept ids before each bag boundary.
    kept_before = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), jnp.cumsum(keep_cap, axis=1, dtype=jnp.int32)],
                                  axis=1)  # [n, num + 1]
    sf = jnp.asarray(lay.slot_feat)  # [n, NS]
    used = sf >= 0
    bnd = jnp.maximum(sf, 0)[:, :, None] * b + jnp.arange(b + 1, dtype=jnp.int32)[None, None, :]  # [n, NS, b+1]
    at = jnp.clip(off[bnd], 0, num)
    kb = jnp.take_along_axis(kept_before, at.reshape(n, -1), axis=1).reshape(at.shape)
    kb = jnp.where(used[:, :, None], kb, 0)
    lens = kb[:, :, 1:] - kb[:, :, :-1]
    starts = kb[:, :, 0]
    ranks = None
    if lay.has_column:
        ok_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ok_id, dtype=jnp.int32)])
        ranks = jnp.where(used, ok_before[at[:, :, 0]], 0)
    w = None
    if psw is not None or (scale_mean and emb.pooling == "mean"):
        wv = jnp.ones((num,), jnp.float32) if psw is None else psw.astype(jnp.float32)
        if scale_mean and emb.pooling == "mean":
            length = (off[1:] - off[:-1]).astype(jnp.float32)
            coef = 1.0 / jnp.maximum(length, 1.0)
            wv = coef[bag] * wv
        w = jnp.zeros((n, cap), jnp.float32).at[jj, dst].set(jnp.broadcast_to(wv, (n, num)), mode="drop")
    return ids, lens, starts, w, dropped, invalid, repaired, (keep_cap, dst), ranks


def merge(s, ids, lens, starts, w, ranks=None, num=0):
    """On an owner: the ids received from every device as one batch of n*b samples in `s.local`'s format.

    Returns `(ids, offsets, weights, (k, src, live), key)`. `key` (None without `ranks`, `route`'s as received;
    `num` is the senders' ids per device): per merged id, `k * num` plus its rank among its sender k's valid ids,
    in `[0, n * num)` (`n * num` past the batch). A column-wise table's ids reach every device holding a block of
    it, in the same order, so their keys agree on all of them (`tbe_jax.shard_programs._column_update` sums row
    statistics at them); the other ids' keys are unused."""
    n = s.num_devices
    ns = s.layout.num_slots
    cap = ids.shape[1]
    b = lens.shape[2]
    seg_len = jnp.sum(lens, axis=2)  # [n(src), NS]
    flat = jnp.transpose(lens, (1, 0, 2)).reshape(-1)  # bag (q, k, i)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(flat, dtype=jnp.int32)])
    seg_dst = offsets[:-1].reshape(ns, n, b)[:, :, 0].reshape(-1)  # segment (q, k) start
    seg_src = jnp.transpose(starts, (1, 0)).reshape(-1)
    seg_k = jnp.tile(jnp.arange(n, dtype=jnp.int32), ns)
    total = n * cap
    p = jnp.arange(total, dtype=jnp.int32)
    # segment of each position: the last segment starting at or before it (a count of segment starts and a
    # prefix sum; empty segments share their start with the next one, which then wins)
    starts_hist = jnp.zeros((total + 1,), jnp.int32).at[jnp.clip(seg_dst, 0, total)].add(1)
    seg = jnp.clip(jnp.cumsum(starts_hist[:total]) - 1, 0, max(ns * n - 1, 0))
    k = seg_k[seg]
    src = jnp.clip(seg_src[seg] + p - seg_dst[seg], 0, cap - 1)
    live = p < offsets[-1]
    merged_ids = jnp.where(live, ids[k, src], 0)
    merged_w = None if w is None else jnp.where(live, w[k, src], 0.0)
    del seg_len
    key = None
    if ranks is not None:
        # A column-wise table's ids reach every device holding its columns, each from its sender in the same order:
        # the id's rank among its sender's valid ids, offset by the sender, names it on all of them alike.
        q = seg // n
        key = jnp.where(live, k * num + ranks[k, q] + p - seg_dst[seg], n * num)
    return merged_ids, offsets, merged_w, (k, src, live), key


def all_to_all(x, axis_name):
    """The step's one collective: `x` split along its first axis, part j to device j (tiled=False)."""
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=False)


def _exchange_ids(s, ids, lens, starts, w, ranks=None):
    """One all_to_all for ids, bag lengths, segment starts (and the column keys' ranks, and weights as int32 bits)."""
    n = s.num_devices
    cap = ids.shape[1]
    parts = [ids, lens.reshape(n, -1), starts] + ([] if ranks is None else [ranks])
    if w is not None:
        parts.append(jax.lax.bitcast_convert_type(w, jnp.int32))
    packed = jnp.concatenate(parts, axis=1)
    if n > 1:
        packed = all_to_all(packed, s.axis_name)
    ns, b = lens.shape[1], lens.shape[2]
    ids_r = packed[:, :cap]
    lens_r = packed[:, cap : cap + ns * b].reshape(n, ns, b)
    at = cap + ns * b + ns
    starts_r = packed[:, cap + ns * b : at]
    ranks_r = None
    if ranks is not None:
        ranks_r, at = packed[:, at : at + ns], at + ns
    w_r = None
    if w is not None:
        w_r = jax.lax.bitcast_convert_type(packed[:, at:], jnp.float32)
    return ids_r, lens_r, starts_r, w_r, ranks_r


def routed_local(s, idx, off, psw, scale_mean):
    """Route and merge on one device: the owner-side batch (ids, offsets, weights) plus what the
    sequence path needs to send rows back, and the report counts."""
    ids, lens, starts, w, dropped, invalid, repaired, sent, ranks = route(s, idx, off, psw, scale_mean)
    ids_r, lens_r, starts_r, w_r, ranks_r = _exchange_ids(s, ids, lens, starts, w, ranks)
    m_ids, m_off, m_w, back, key = merge(s, ids_r, lens_r, starts_r, w_r, ranks_r, idx.shape[0])
    return (m_ids, m_off, m_w), back, sent, (dropped, invalid, repaired), key


def assemble(s, out_l, off, b, divide: bool = True):
    """Owner-side pooled rows `[n*b, W]` back to their devices: `[b, sum D]` on each (mean pooling: divided by
    the bag lengths unless `divide` is False, where the routed weights carried 1/len)."""
    n, lay, emb = s.num_devices, s.layout, s.emb
    parts = out_l.reshape(n, b, lay.width)
    if s.comm_dtype is not None:
        parts = parts.astype(s.comm_dtype)
    if n > 1:
        parts = all_to_all(parts, s.axis_name)  # [n(owner), b, W]
    parts = parts.astype(jnp.float32)
    # Per output column: its feature, and on each owner the slot column holding it (if any).
    x = jnp.arange(lay.out_width, dtype=jnp.int32)
    fcol = jnp.asarray(lay.feature_col)
    feat = jnp.searchsorted(fcol, x, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    d = x - fcol[feat]
    q = jnp.asarray(lay.slot_of)[:, feat]  # [n, sum D]
    qc = jnp.maximum(q, 0)
    col0 = jnp.take_along_axis(jnp.asarray(lay.slot_col0), qc, axis=1)
    ncols = jnp.take_along_axis(jnp.asarray(lay.slot_ncols), qc, axis=1)
    contrib = (q >= 0) & (d >= col0) & (d < col0 + ncols)
    local_col = jnp.asarray(np.asarray(lay.slot_col, np.int32))[qc] + d - col0
    # One gather per contribution depth straight from [owner, sample, column] (no transpose), summed in
    # owner order (row-wise tables: every owner's partial sum).
    rank = jnp.cumsum(contrib, axis=0, dtype=jnp.int32)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    out = None
    for r in range(lay.depth):
        sel = contrib & (rank == r + 1)
        owner = jnp.argmax(sel, axis=0).astype(jnp.int32)
        col = jnp.take_along_axis(local_col, owner[None, :], axis=0)[0]
        val = jnp.where(jnp.any(sel, axis=0)[None, :], parts[owner[None, :], rows, col[None, :]], 0.0)
        out = val if out is None else out + val
    if emb.pooling == "mean" and divide:
        nf = emb.num_features
        length = (off[1:] - off[:-1]).reshape(nf, b)
        out = out / jnp.maximum(length, 1).astype(jnp.float32).T[:, feat]
    return out.astype(emb.output_dtype)


def route_grads(s, g):
    """A device's `[b, sum D]` output gradient to the owners: `[n*b, W]` on each owner (source-major)."""
    n, lay = s.num_devices, s.layout
    g = g.astype(jnp.float32)
    b = g.shape[0]
    # Per destination and slot column: the column of this device's output it carries (unused slots: zero).
    w = jnp.arange(lay.width, dtype=jnp.int32)
    slot_col = jnp.asarray(np.asarray(lay.slot_col, np.int32))
    wq = jnp.searchsorted(slot_col, w, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    f = jnp.asarray(lay.slot_feat)[:, wq]  # [n, W]
    cols = jnp.asarray(lay.feature_col)[jnp.maximum(f, 0)] + jnp.asarray(lay.slot_col0)[:, wq] + (w - slot_col[wq])
    send = g[jnp.arange(b, dtype=jnp.int32)[None, :, None], cols[:, None, :]]  # [n(dst), b, W], no transpose
    send = jnp.where((f >= 0)[:, None, :], send, 0.0)
    if s.comm_dtype is not None:
        send = send.astype(s.comm_dtype)
    if n > 1:
        send = all_to_all(send, s.axis_name)  # [n(src), b, W]
    return send.reshape(n * b, lay.width).astype(jnp.float32)


def sequence_back(s, out_l, back, sent, num):
    """Owner-side per-id rows `[n*cap, D]` back to the devices and positions they came from."""
    n = s.num_devices
    k, src, live = back
    keep_cap, dst = sent
    cap = out_l.shape[0] // n
    d = out_l.shape[1]
    buf = jnp.zeros((n, cap + 1, d), out_l.dtype).at[jnp.where(live, k, 0), jnp.where(live, src, cap)].set(
        out_l, mode="drop")[:, :cap]
    if n > 1:
        buf = all_to_all(buf, s.axis_name)  # [n(owner), cap, D]
    first = jnp.argmax(keep_cap, axis=0)  # the owner that served each id
    any_ = jnp.any(keep_cap, axis=0)
    pos = jnp.take_along_axis(dst, first[None], axis=0)[0]
    rows = buf[first, jnp.clip(pos, 0, cap - 1)]
    return jnp.where(any_[:, None], rows, 0).astype(s.emb.output_dtype)


def sequence_grads(s, g, r):
    """A device's per-id output gradient `[cap, D]` to the owners, in their merged order."""
    n = s.num_devices
    keep, dst = r["keep"], r["dst"]
    cap = keep.shape[1]
    d = g.shape[1]
    g = g.astype(jnp.float32)
    jj = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], keep.shape)
    send = jnp.zeros((n, cap + 1, d), jnp.float32).at[jj, jnp.where(keep, dst, cap)].set(
        jnp.broadcast_to(g[None], (n, cap, d)), mode="drop")[:, :cap]
    if n > 1:
        send = all_to_all(send, s.axis_name)  # [n(src), cap, D]
    k, src, live = r["k"], r["src"], r["live"]
    return jnp.where(live[:, None], send[k, src], 0.0)


def data_batch(s, idx, off, psw):
    """On one device: its local batch's lookups of replicated (`"data"`) tables, as a batch of `s.local_data`'s
    format (no exchange: each device reads its own copy for its own samples).

    Returns `({"d_ids", "d_off", "d_w", "d_pos"}, invalid, repaired)`: the ids of the replicated features' bags, packed in feature order
    (`[N]`, padding past `d_off[-1]`), each as its buffer row (its logical id among the replicated rows of its
    width: the same row on every device, `ShardLayout.data_row0`), an id outside `[0, E_t)` as -1 (dropped by the
    lookup, counted by `route`, still part of its bag's length for mean pooling, as unsharded); the bags' offsets
    (`[F_data * b + 1]`); the per-sample weights (or None) and each packed id's position in the local batch; and the
    replicated features' ids outside `[0, E_t)`, and the offsets repaired (`bounds_check="warning"`)."""
    emb, lay = s.emb, s.layout
    num = idx.shape[0]
    nf = emb.num_features
    b = (off.shape[0] - 1) // nf
    repaired = jnp.int32(0)
    if emb.bounds_check == "warning":
        off, repaired = bounds.repair_offsets(off, num)
    _, feat = preprocess.position_features(_local_plan(s, off.shape[0]), off, num)
    fd = np.asarray(lay.data_features, np.int32)
    is_data = np.zeros((nf,), bool)
    is_data[fd] = True
    row0 = np.zeros((nf,), np.int32)
    for f in fd:
        row0[f] = lay.data_row0[emb.feature_table_map[f]]
    e_t = jnp.asarray(np.asarray([emb.tables[t].num_embeddings for t in emb.feature_table_map], np.int32))[feat]
    pos = jnp.arange(num, dtype=jnp.int32)
    mask = (pos >= off[0]) & (pos < off[-1]) & jnp.asarray(is_data)[feat]
    ok = mask & (idx >= 0) & (idx < e_t)
    rows = jnp.where(ok, idx, 0).astype(jnp.int32) + jnp.asarray(row0)[feat]
    rows = jnp.where(ok, rows, -1)
    dst = jnp.where(mask, jnp.cumsum(mask, dtype=jnp.int32) - 1, num)
    d_ids = jnp.full((num,), -1, jnp.int32).at[dst].set(rows, mode="drop")
    d_pos = jnp.zeros((num,), jnp.int32).at[dst].set(pos, mode="drop")
    kept_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(mask, dtype=jnp.int32)])
    bnd = jnp.concatenate([(jnp.asarray(fd)[:, None] * b + jnp.arange(b, dtype=jnp.int32)[None, :]).reshape(-1),
                           jnp.full((1,), (int(fd[-1]) + 1) * b, jnp.int32)])  # no constant growing with b
    d_off = kept_before[jnp.clip(off[bnd], 0, num)]
    d_w = None if psw is None else jnp.zeros((num,), jnp.float32).at[dst].set(psw.astype(jnp.float32), mode="drop")
    # (and, for a plan of replicated tables only, where `route` does not run, the report's counts)
    invalid = jnp.sum(mask & ~ok, dtype=jnp.int32)
    return {"d_ids": d_ids, "d_off": d_off, "d_w": d_w, "d_pos": d_pos}, invalid, repaired
