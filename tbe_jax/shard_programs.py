"""The `shard_map` programs of a sharded embedding (`tbe_jax.shard`): each a jitted function of the sharded
embedding `s` (static) and its arrays.

- `forward`: route, look up on the owners (`s.local`), send back (and, for training, the routed batch the
  update reuses);
- `route_for_update`, `update`: the optimizer step (`apply_gradients`, `step_update`) on the owners
  (`_column_update` where the optimizer sums over rows that column-wise tables split: one `psum` of the
  partial row statistics; `_data_update` for the replicated tables: the devices' sparse gradients of their local
  batches, all-gathered and summed in device order, the same update on every copy);
- `sharded_init`, `sharded_opt_init`: each device draws its own shards, and their optimizer state;
- `smap`, `state_specs`: the `shard_map` over `s`'s mesh, and the specs of a sharded optimizer state.

The per-device routing lives in `tbe_jax.shard_route`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tbe_jax import bounds, memory, preprocess, shard_checkpoint, shard_route, sparse_update
from tbe_jax.cache_layout import CACHE, STATE_ROWS
from tbe_jax.kernels.copy_rows import copy_rows
from tbe_jax.tbe import blocked_draw, init_rows


def smap(s, f, in_specs, out_specs):
    """`f` as a `jax.shard_map` over `s`'s mesh."""
    # Kernels in interpret mode trip an interpreter limitation on varying-axes types inside shard_map
    # (jax evaluates the kernel body with mixed varying / non-varying values); compiled kernels and the
    # XLA path run under shard_map's default checks.
    check = not (s.local.interpret and s.uses_kernel())
    return jax.shard_map(f, mesh=s.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)


def state_specs(s, opt_state):
    """The partition specs of a sharded optimizer state: every array split over the axis, the count replicated."""
    ax = s.axis_name
    return jax.tree_util.tree_map(lambda x: P(ax) if getattr(x, "ndim", 0) >= 1 else P(), opt_state)


def _psum(x, s):
    return jax.lax.psum(x, s.axis_name)


@functools.partial(jax.jit, static_argnums=(0, 5))
def forward(s, params, idx, off, psw, want_routed: bool):
    """The global batch's lookup: `(out, BoundsReport, routed)`; `routed` (with `want_routed`) is the owners'
    batch, which `update` reuses (None otherwise)."""
    s.check_params(params)
    ax = s.axis_name
    emb = s.emb
    nf = emb.num_features
    b = (off.shape[1] - 1) // nf
    sequence = emb.pooling == "none"

    def body(params, idx, off, psw):
        idx, off = idx[0], off[0]
        psw = None if psw is None else psw[0]
        if s.direct:  # one device, nothing to route: emb itself on its batch (bitwise emb)
            out, rep = emb.forward_with_report(params, idx, off, psw)
            rep = bounds.BoundsReport(_psum(rep.invalid_indices, s), _psum(rep.repaired_offsets, s))
            return out, rep, ({"ids": idx, "off": off, "w": psw} if want_routed else None)
        # Training (want_routed) with mean pooling: the ids travel once, with weights scaled by 1/len(bag) at the
        # source; the owners' sums are then the means (no division on the way back), and the same routed batch
        # serves the update. A forward alone keeps the weightless ids and divides at the source.
        scaled = want_routed and emb.pooling == "mean"
        routed, data = None, None
        if s.layout.num_slots:
            routed = shard_route.routed_local(s, idx, off, psw, scaled)
            (m_ids, m_off, m_w), back, sent, (dropped, invalid, repaired), _ = routed
            out_l = s.local(s.local_tree(params), m_ids, m_off, m_w)
            if sequence:
                out = shard_route.sequence_back(s, out_l, back, sent, idx.shape[0])
            else:
                out = shard_route.assemble(s, out_l, off, b, divide=not scaled)
        else:  # every table replicated: nothing to route
            out = jnp.zeros((idx.shape[0], emb.feature_dims[0]) if sequence else (b, s.layout.out_width),
                            emb.output_dtype)
        if s.local_data is not None:  # replicated tables: this device's own samples, from its own copy
            data, d_invalid, d_repaired = shard_route.data_batch(s, idx, off, psw)
            out = _data_lookup(s, params, data, out)
            if routed is None:
                dropped, invalid, repaired = jnp.int32(0), d_invalid, d_repaired
        rep = bounds.BoundsReport(_psum(invalid + dropped, s), _psum(repaired, s))
        return out, rep, (_pack_routed(routed, data) if want_routed else None)

    spec = P(ax)
    routed_spec = None if not want_routed else _routed_specs(s, psw is not None)
    f = smap(s, body, (jax.tree_util.tree_map(lambda _: spec, params), spec, spec, None if psw is None else spec),
                (spec, P(), routed_spec))
    return f(params, idx, off, psw)


def _data_lookup(s, params, data, out):
    """`out` (this device's output) with the replicated features' lookups of its local batch put in."""
    out_d = s.local_data(s.storage_tree(params), data["d_ids"], data["d_off"], data["d_w"])
    if s.emb.pooling == "none":  # per id: back to the ids' positions in the local batch
        num = out.shape[0]
        live = jnp.arange(num, dtype=jnp.int32) < data["d_off"][-1]
        return out.at[jnp.where(live, data["d_pos"], num)].set(out_d.astype(out.dtype), mode="drop")
    return out.at[:, jnp.asarray(s.layout.data_cols)].set(out_d.astype(out.dtype))


def _pack_routed(routed, data=None):
    out = {}
    if routed is not None:
        (m_ids, m_off, m_w), back, sent, _, key = routed
        k, src, live = back
        keep_cap, dst = sent
        out = {"ids": m_ids, "off": m_off, "w": m_w, "k": k, "src": src, "live": live, "keep": keep_cap, "dst": dst}
        if key is not None:
            out["key"] = key
    if data is not None:
        out.update(data)
    return out


def _routed_specs(s, weighted):
    spec = P(s.axis_name)
    if s.direct:
        return {"ids": spec, "off": spec, "w": spec if weighted else None}
    w = spec if (weighted or s.emb.pooling == "mean") else None
    out = {}
    if s.layout.num_slots:
        out = {"ids": spec, "off": spec, "w": w, "k": spec, "src": spec, "live": spec, "keep": spec, "dst": spec}
    if s.layout.has_column:
        out["key"] = spec
    if s.local_data is not None:
        out.update({"d_ids": spec, "d_off": spec, "d_w": spec if weighted else None, "d_pos": spec})
    return out


@functools.partial(jax.jit, static_argnums=(0,))
def route_for_update(s, idx, off, psw):
    """The owners' batch for `update` when no forward routed it (`apply_gradients`)."""
    spec = P(s.axis_name)

    def body(idx, off, psw):
        if s.direct:
            return {"ids": idx[0], "off": off[0], "w": None if psw is None else psw[0]}
        psw0 = None if psw is None else psw[0]
        routed = shard_route.routed_local(s, idx[0], off[0], psw0, True) if s.layout.num_slots else None
        data = None if s.local_data is None else shard_route.data_batch(s, idx[0], off[0], psw0)[0]
        return _pack_routed(routed, data)

    f = smap(s, body, (spec, spec, None if psw is None else spec), _routed_specs(s, psw is not None))
    return f(idx, off, psw)


@functools.partial(jax.jit, static_argnums=(0,))
def update(s, params, opt_state, opt, routed, grad_output):
    """The optimizer step on the owners, from the routed batch and the output gradient: `(params, opt_state)`."""
    ax = s.axis_name
    emb = s.emb
    sequence = emb.pooling == "none"
    pspec = jax.tree_util.tree_map(lambda _: P(ax), params)
    sspec = state_specs(s, opt_state)
    rspec = jax.tree_util.tree_map(lambda _: P(ax), routed)

    def body(params, opt_state, opt, routed, g):
        r = routed
        if s.direct:
            return emb.apply_gradients(params, opt_state, opt, r["ids"], r["off"], g, r["w"])
        if not s.layout.num_slots:  # every table replicated
            new_p, new_s = params, opt.next_state(opt_state, opt.slots(opt_state))
            return _data_update(s, new_p, new_s, opt, opt_state.count, r, g)
        if sequence:
            g_l = shard_route.sequence_grads(s, g, r)
        else:
            g_l = shard_route.route_grads(s, g)
        if sums_rows(s, opt):
            new_p, new_s = _column_update(s, params, opt_state, opt, r, g_l)
        else:
            new_p, new_s = s.local.apply_gradients(s.local_tree(params), opt_state, opt, r["ids"], r["off"], g_l,
                                                   r["w"])
            new_p = s.global_tree(new_p)
        if s.local_data is not None:  # the replicated tables' rows: no routed id reads them
            new_p, new_s = _data_update(s, new_p, new_s, opt, opt_state.count, r, g)
        return new_p, new_s

    f = smap(s, body, (pspec, sspec, P(), rspec, P(ax)), (pspec, sspec))
    return f(params, opt_state, opt, routed, grad_output)


def _pool_bounds(s, c: int):
    """Pool c's draw on each device: `(starts [n, m], bounds [n, m], shared)`: per device its pieces' first rows
    (then the padding's, then past the pool), their tables' `1/sqrt(E)`, and the replicated tables' rows (at the
    head of the pool, drawn alike on every device)."""
    lay, emb, n = s.layout, s.emb, s.num_devices
    mp = max([sum(1 for p in lay.pieces if lay.piece_pool[p] == c and p.device == j) for j in range(n)] + [1])
    starts = np.full((n, mp + 1), lay.pool_rows[c], np.int32)
    bnd = np.zeros((n, mp + 1), np.float32)
    for j in range(n):
        mine = sorted((p for p in lay.pieces if lay.piece_pool[p] == c and p.device == j), key=lambda p: lay.pool_row[p])
        for i, p in enumerate(mine):
            starts[j, i] = lay.pool_row[p]
            bnd[j, i] = 1.0 / math.sqrt(emb.tables[p.table].num_embeddings)
        starts[j, len(mine)] = sum(p.rows for p in mine)  # padding rows from here: bound 0
        starts[j, len(mine) + 1 :] = lay.pool_rows[c] + 1
    shared = sum(p.rows for p in lay.pieces
                 if lay.piece_pool[p] == c and p.device == 0 and s.plan.strategies[p.table] == "data")
    return starts, bnd, shared


HOST_INIT_ON_DEVICE_BYTES = 1 << 30  # host buffers of at most this many bytes per device are drawn in HBM


def sharded_init(s, key, init_block: int):
    """Every device's shards drawn in place (as `emb.init` draws a table), in blocks of `init_block` elements, into
    the owners' storage (`s.storage_buffers`: a cached pool's rows in its host part, its cache empty). Host
    buffers of more than `HOST_INIT_ON_DEVICE_BYTES` a device never pass through HBM: each is made on the host and
    filled block by block (`_write_pool_block`, the same values as a draw on the device); smaller ones are drawn
    on the device and moved."""
    st = s.storage.layout
    host_bytes = sum(st.group_rows[g] * st.strides[g] for g in range(len(st.dims)) if st.on_host(g)) * \
        s.emb.weights_dtype.itemsize
    if isinstance(key, jax.core.Tracer) or host_bytes <= HOST_INIT_ON_DEVICE_BYTES:
        # every pool drawn on its device, then the host buffers moved to host memory (through HBM once, per
        # device): small host buffers, and under a trace (a layer's init), where a host array cannot be made
        out = _device_init(s, key, init_block, True)
        host = s.host_keys()
        return {k: jax.device_put(v, s.host_sharding()) if k in host and memory.host_memory() else v
                for k, v in out.items()}
    out = _device_init(s, key, init_block, False)
    lay = s.layout
    for g, parts in enumerate(s.storage_parts()):
        if not st.on_host(g):
            continue
        buf = shard_checkpoint.host_zeros(s, (s.num_devices * st.group_rows[g], st.dims[g]), s.emb.weights_dtype)
        at = 0
        for c in parts:  # a host buffer holds pools only (cache parts are in HBM)
            rows, w = lay.pool_rows[c], lay.widths[c]
            block = max(1, init_block // w)
            count = min(rows, block)
            for i in range(1 if rows <= block else -(-rows // block)):
                buf = _write_pool_block(s, buf, key, np.int32(i), c=c, at=at, count=count, block=block)
            at += rows
        out[st.key(g)] = buf
    return out


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _device_init(s, key, init_block: int, host_too: bool):
    """The buffers in HBM (pools drawn block by block inside a device loop, cache parts empty) and the caches'
    directory; host buffers left out, or (`host_too`) drawn here too."""
    lay, emb, n, ax = s.layout, s.emb, s.num_devices, s.axis_name
    drawn = [host_too or loc == "device" for loc in lay.locations]
    pools = []
    for c, w in enumerate(lay.widths):
        starts, bnd, shared = _pool_bounds(s, c) if drawn[c] else (None, None, 0)
        pools.append((jnp.asarray(starts), jnp.asarray(bnd), c, w, shared) if drawn[c] else None)

    def body(key):
        j = jax.lax.axis_index(ax) if n > 1 else 0
        out = []
        for entry in pools:
            if entry is None:
                out.append(None)
                continue
            starts, bnd, c, w, shared = entry
            st, bd = starts[j], bnd[j]  # this device's pieces (then its padding rows: bound 0)

            def draw(k, r0, count, st=st, bd=bd, w=w):  # rows [r0, r0 + count) of this device's pool
                return init_rows(k, st, bd, r0, count, w, w, emb.weights_dtype)

            k = jax.random.fold_in(jax.random.fold_in(key, j), c)
            # a large pool block by block: init's scratch memory that of a block (tbe.INIT_BLOCK), per device
            block = max(1, init_block // w)
            pool = blocked_draw(k, lay.pool_rows[c], w, emb.weights_dtype, block, draw)
            if shared:  # a key of no device's (devices fold in 0..n-1): the same draw on all of them
                kd = jax.random.fold_in(jax.random.fold_in(key, n), c)
                pool = jax.lax.dynamic_update_slice(pool, blocked_draw(kd, shared, w, emb.weights_dtype, block, draw),
                                                    (0, 0))
            out.append(pool)
        return s.global_tree(s.storage_buffers(out))

    shapes = jax.eval_shape(lambda pools: s.global_tree(s.storage_buffers(pools)),
                            [jax.ShapeDtypeStruct((lay.pool_rows[c], w), emb.weights_dtype)
                             if drawn[c] else None for c, w in enumerate(lay.widths)])
    return smap(s, body, P(), jax.tree_util.tree_map(lambda _: P(ax), shapes))(key)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("c", "at", "count", "block"), donate_argnums=(1,))
def _write_pool_block(s, buf, key, i, *, c: int, at: int, count: int, block: int):
    """Block i of pool c (its rows from `at` in the host buffer `buf`, on every device), drawn as `_device_init`'s
    `blocked_draw` draws it (one draw of `count` rows with the pool's key if the pool fits one block, else block i
    with `fold_in(key, i)`, the last block ending at the pool's last row) and written in place."""
    lay, emb, n, ax = s.layout, s.emb, s.num_devices, s.axis_name
    starts, bnd, _ = _pool_bounds(s, c)
    starts, bnd = jnp.asarray(starts), jnp.asarray(bnd)
    rows, w = lay.pool_rows[c], lay.widths[c]

    def body(buf, key, i):
        j = jax.lax.axis_index(ax) if n > 1 else 0
        k = jax.random.fold_in(jax.random.fold_in(key, j), c)
        if rows > block:
            k, r0 = jax.random.fold_in(k, i), jnp.minimum(i * block, rows - block)
        else:
            r0 = jnp.int32(0)
        vals = init_rows(k, starts[j], bnd[j], r0, count, w, w, emb.weights_dtype)
        pos = jnp.arange(count, dtype=jnp.int32)
        buf = copy_rows(buf, vals, at + r0 + pos, pos, kernel=memory.host_memory())
        return memory.keep_on_host(buf)

    return smap(s, body, (P(ax), P(), P()), P(ax))(buf, key, i)


def sharded_opt_init(s, opt, params):
    """`opt`'s state for the shards, each device initialising its own; the state of host buffers made in host
    memory (`shard_checkpoint.host_opt_slots`: never through HBM); with cached pools, each slot's `"cache_rows"`
    (no cache slot holds a state yet)."""
    host = s.host_keys()
    state = _device_opt_init(s, opt, {k: v for k, v in params.items() if k not in host and k != CACHE})
    slots = opt.slots(state)
    if host:
        host_slots = shard_checkpoint.host_opt_slots(s, opt, {k: params[k] for k in host})
        slots = [{**d, **h} for d, h in zip(slots, host_slots)]
    if s.cached:
        slots = [{**d, STATE_ROWS: shard_checkpoint.empty_state_rows(s)} for d in slots]
    return opt.state_type(*slots, state.count)


@functools.partial(jax.jit, static_argnums=(0,))
def _device_opt_init(s, opt, params):
    ax = s.axis_name
    pspec = jax.tree_util.tree_map(lambda _: P(ax), params)
    local_shapes = {k: jax.ShapeDtypeStruct((v.shape[0] // s.num_devices,) + v.shape[1:], v.dtype)
                    for k, v in params.items()}
    sspec = state_specs(s, jax.eval_shape(lambda p: opt.init(p), local_shapes))

    def body(params, opt):
        return opt.init(params)

    return smap(s, body, (pspec, P()), sspec)(params, opt)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1, 4))
def prefetch(s, params, idx, off, opt_state):
    """Each owner prefetches the rows of its cached pools that the global batch looks up: the batch routed as the
    lookup routes it (ids to their owners), then `s.local.prefetch` on each owner's batch. `(params, opt_state)`
    (`opt_state` None: None)."""
    ax = s.axis_name
    spec = P(ax)
    pspec = jax.tree_util.tree_map(lambda _: spec, params)
    sspec = None if opt_state is None else state_specs(s, opt_state)

    def body(params, idx, off, opt_state):
        (m_ids, m_off, _), _, _, _, _ = shard_route.routed_local(s, idx[0], off[0], None, False)
        out = s.local.prefetch(s.local_tree(params), m_ids, m_off, opt_state=opt_state)
        p, st = out if opt_state is not None else (out, None)
        return s.global_tree(p), st

    return smap(s, body, (pspec, spec, spec, sspec), (pspec, sspec))(params, idx, off, opt_state)


def sums_rows(s, opt) -> bool:
    """Whether `opt`'s update reduces over whole rows (a row-wise state slot, or LAMB's trust ratio) while some table
    is sharded by columns: the step then sums the rows' statistics across the column shards (`_column_update`)."""
    rule = opt.rule()
    return s.layout.has_column and (any(rule.slot_rowwise) or rule.kind in ("lamb", "partial_rowwise_lamb"))


def _column_update(s, params, opt_state, opt, r, g):
    """On one device: the owners' update (as `s.local.apply_gradients`) where row statistics span column shards.

    Each statistic the rule sums over a row (`optim.apply_rule`'s `row_reduce`) is, for a column-wise table's row,
    the sum over this device's columns; the shards holding the table's other columns see the same ids (every id
    of a feature reading it, from every device), so they touch the same rows, and each puts its partial sum at the
    row's key: its first lookup's column key (`shard_route.merge`), the same on every shard. One `psum` over the
    axis of a `[statistics, ids of the global batch]` array (zeros elsewhere: devices without the table add
    nothing) gives every shard the whole row's sum; the row length that divides it is the table's. So the shards
    update the row's columns with the statistic of the unsharded update, and keep its row-wise state identical.
    Rows of the other tables keep their own sums. The update runs on the XLA sparse path (`tbe_jax.sparse_update`,
    touched rows only) on every device, also where the lookups run the Pallas kernels: their fused update keeps
    the statistic inside the kernel.
    """
    lay, local, n = s.layout, s.local, s.num_devices
    ids, off, w = r["ids"], r["off"], r["w"]
    if ids.shape[0] == 0:
        return params, opt.next_state(opt_state, opt.slots(opt_state))
    num = r["keep"].shape[1]  # the senders' ids per device: keys are in [0, n * num)
    size = n * num
    plan = local.plan_for(off.shape[0])
    j = jax.lax.axis_index(s.axis_name)
    _, feat = preprocess.position_features(plan, off, ids.shape[0])  # each merged id's slot
    column = jnp.asarray(lay.slot_column)[j][feat]
    row_dim = jnp.asarray(lay.slot_row_dim)[j][feat]
    key = jnp.where(column, r["key"], size)

    def row_reduce(gi, lookups, slot):
        if not lay.width_has_column[gi]:
            return None, None
        ns = slot.shape[0]
        rep = jnp.minimum(jax.ops.segment_min(jnp.where(lookups, key, size), slot, num_segments=ns), size)
        is_col = rep < size
        dim = jax.ops.segment_max(jnp.where(lookups & column, row_dim, 0), slot, num_segments=ns)
        dim = jnp.where(is_col, dim, local.layout.dims[gi]).astype(jnp.float32)

        def reduce(*sums):
            part = jnp.stack(sums)  # [S, slots]
            total = jnp.zeros((len(sums), size), jnp.float32).at[:, rep].set(part, mode="drop")
            total = _psum(total, s)
            got = jnp.take(total, rep, axis=1, mode="fill", fill_value=0)
            return tuple(jnp.where(is_col, got[i], x) for i, x in enumerate(sums))

        return reduce, dim

    new_w, new_s = sparse_update.apply_gradients(
        params, opt.slots(opt_state), local.layout, plan, ids, off, w, g, opt.rule(),
        opt.hyperparameters(opt_state.count), pooling=local.pooling, row_reduce=row_reduce)
    return new_w, opt.next_state(opt_state, new_s)


def _data_update(s, params, opt_state, opt, count, r, g):
    """On one device: the replicated tables' update, the same on every device (`params`, `opt_state`: after the
    routed tables' update; `count`: the step count before it).

    1. This device's sparse gradient: its local batch's lookups of replicated tables (`r`'s `d_*`,
       `shard_route.data_batch`) with its output gradient `g`, summed per touched row (at most one entry per
       lookup: a fixed-size list of `(row, gradient row)` per storage width; unused entries name the row past the
       buffer). Rows are named by their buffer row, which is the row's logical id: a replicated table sits at the
       same rows on every device (`ShardLayout.data_row0`).
    2. One `all_gather` over the axis of every width's list (ids and bits of the gradients, int32): `[n, N, ...]`,
       sized by the local batch's ids, never by the tables.
    3. On every device alike: the distinct rows of the n lists, each row's gradient the sum of the devices'
       entries in device order (one unique-index scatter-add per device, in order: deterministic on any backend),
       then the optimizer's rule on those rows (`sparse_update.update_rows`, the XLA sparse path, also where the
       lookups run the Pallas kernels). Every device computes the same values from the same gathered lists, so the
       copies stay bitwise identical.
    """
    ld, lay, n = s.local_data, s.layout, s.num_devices
    ids, off, w = r["d_ids"], r["d_off"], r["d_w"]
    num = ids.shape[0]
    if s.emb.pooling == "none":  # g: per id of the local batch
        live = jnp.arange(num, dtype=jnp.int32) < off[-1]
        g_d = jnp.where(live[:, None], g.astype(jnp.float32)[r["d_pos"]], 0.0)
    else:
        g_d = g.astype(jnp.float32)[:, jnp.asarray(lay.data_cols)]
    plan = ld.plan_for(off.shape[0])
    bag, feat, coef, scale = preprocess.lookup_coefficients(plan, ids, off, w, ld.pooling)
    widths = sorted({ld.layout.table_group[t] for t in ld.feature_table_map})  # the buffers of replicated tables
    lists = {}
    for gi, m, grad_rows, rows in preprocess.group_lookups(ld.layout, plan, ids, bag, feat, coef > 0, g_d,
                                                          ld.pooling):
        if gi not in widths:
            continue
        slot, slot_row, _ = sparse_update.touched_rows(rows, m, ld.layout.group_rows[gi])
        contrib = jnp.where(m[:, None], grad_rows * scale[:, None], 0.0)
        lists[gi] = (slot_row, jax.ops.segment_sum(contrib, slot, num_segments=num))
    packed = jnp.concatenate([jnp.concatenate([rw[:, None], jax.lax.bitcast_convert_type(gr, jnp.int32)], axis=1)
                              for rw, gr in lists.values()], axis=1)
    packed = jax.lax.all_gather(packed, s.axis_name)  # [n, N, sum (1 + w)]
    rule, hyper = opt.rule(), opt.hyperparameters(count)
    slots = tuple(dict(x) for x in opt.slots(opt_state))
    new_p = dict(params)
    at = 0
    for gi, (_, gr) in lists.items():
        width, rows_r = gr.shape[1], ld.layout.group_rows[gi]
        rows_all = packed[:, :, at]  # [n, N]
        grads_all = jax.lax.bitcast_convert_type(packed[:, :, at + 1 : at + 1 + width], jnp.float32)
        at += 1 + width
        flat = rows_all.reshape(-1)
        slot, slot_row, hit = sparse_update.touched_rows(flat, flat < rows_r, rows_r)
        slot = slot.reshape(n, num)
        total = jnp.zeros((n * num, width), jnp.float32)
        for k in range(n):  # device order; within one device's list every row is distinct
            total = total.at[jnp.where(rows_all[k] < rows_r, slot[k], n * num)].add(grads_all[k], mode="drop")
        key = ld.layout.key(gi)
        new_p[key], new = sparse_update.update_rows(ld.layout, gi, params[key], tuple(x[key] for x in slots),
                                                    slot_row, hit, total, rule, hyper)
        for out, x in zip(slots, new):
            out[key] = x
    return new_p, opt.state_type(*slots, opt_state.count)
