"""A sharded embedding's arrays to and from per-table form, on the host: `tbe_jax.shard`'s checkpoints.

Sharded buffers depend on the mesh (its size and the plan); `to_unsharded` gives the embedding's own format
(`emb`'s storage buffers and optimizer state: the same on every mesh, what to save) and `from_unsharded` places
it on a mesh. `scatter_tables` / `gather_tables` (the sharded `set_tables` / `get_tables`) and `fill_state` (a
state field) build and read the shards from per-table arrays. Every table passes through the host whole.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tbe_jax import memory
from tbe_jax.cache_layout import CACHE, STATE_ROWS
from tbe_jax.specs import checked_tables


def to_unsharded(s, params, opt_state=None):
    """`(emb_params, emb_opt_state)` in `emb`'s own format (its storage buffers), gathered from the
    shards: what to save (e.g. with orbax), since it does not depend on the mesh. `opt_state` None gives
    None. The tables pass through the host (every table is materialised whole, as `get_tables` does)."""
    emb = s.emb
    emb_params = emb.set_tables(None, s.get_tables(params))
    if opt_state is None:
        return emb_params, None
    fields = {}
    for name in (f for f in opt_state._fields if f != "count"):
        fields[name] = _pack(emb, s.get_state(opt_state, name))
    return emb_params, opt_state._replace(count=jnp.asarray(jax.device_get(opt_state.count)), **fields)


def _pack(emb, values) -> dict:
    """A state field of `emb` from one array per table; for a `HostCachedEmbedding`, every state in the host
    parts (its caches are empty in `set_tables`'s params: no cache slot holds a state)."""
    if not hasattr(emb, "inner"):
        return emb.pack(values)
    inner = emb.inner_values(values)
    return {**emb.inner.pack(inner), STATE_ROWS: jnp.full((emb.cache_layout.total_slots,), -1, jnp.int32)}


def from_unsharded(s, emb_params, emb_opt_state=None):
    """`(params, opt_state)` on this mesh from `emb`'s format (`to_unsharded`'s output, possibly saved on
    a mesh of another size)."""
    emb = s.emb
    emb.check_params(emb_params)
    params = s.set_tables(None, emb.get_tables(emb_params))
    if emb_opt_state is None:
        return params, None
    if not hasattr(emb_opt_state, "_fields") or "count" not in emb_opt_state._fields:
        raise TypeError(f"emb_opt_state must be an optimizer state of emb (emb.init_opt_state's, or "
                        f"to_unsharded's), got {type(emb_opt_state).__name__}")
    buffers = {k: v for k, v in emb_params.items() if k != CACHE}
    want = set(buffers) | ({STATE_ROWS} if hasattr(emb, "inner") else set())
    for name in (f for f in emb_opt_state._fields if f != "count"):
        tree = getattr(emb_opt_state, name)
        ok = isinstance(tree, Mapping) and set(tree) == want
        for key in (set(tree) & set(buffers) if ok else ()):
            shape, (rows, d) = tuple(getattr(tree[key], "shape", ())), buffers[key].shape
            ok = ok and shape in ((rows,), (rows, d))
        if not ok:
            raise ValueError(f"emb_opt_state.{name} does not match emb's params (one [rows] or [rows, D] array "
                             f"per buffer {sorted(emb_params)}): pass emb's state (emb.init_opt_state's, or "
                             "to_unsharded's), not a sharded one")
    new = {}
    for name in (f for f in emb_opt_state._fields if f != "count"):
        new[name] = fill_state(s, getattr(emb_opt_state, name),
                                     [a for a in emb.get_state(emb_opt_state, name)])
    count = _replicated(s, jnp.asarray(jax.device_get(emb_opt_state.count)))
    return params, emb_opt_state._replace(count=count, **new)


def scatter_tables(s, tables: Sequence) -> dict:
    """Sharded params holding `tables` (one `[E_t, D_t]` array per table, as `emb.set_tables` takes), each
    device given only its shards (built on the host, then placed; cached pools' caches empty)."""
    emb, lay = s.emb, s.layout
    host = []
    for arr in checked_tables(emb.tables, tables):
        host.append(np.asarray(jax.device_get(arr)).astype(emb.weights_dtype))
    pools = []
    for c, w in enumerate(lay.widths):
        blocks = np.zeros((s.num_devices, lay.pool_rows[c], w), emb.weights_dtype)
        for p in lay.pieces:
            if lay.piece_pool[p] == c:
                r = lay.pool_row[p]
                blocks[p.device, r : r + p.rows] = host[p.table][p.row0 : p.row0 + p.rows,
                                                                  p.col0 : p.col0 + p.cols]
        pools.append(blocks)
    out = _storage(s, pools, emb.weights_dtype)
    if s.cached:
        out[CACHE] = {k: _from_blocks(s, np.tile(np.asarray(v), s.num_devices) if v.ndim else
                                      np.full((s.num_devices,), np.asarray(v)))
                      for k, v in s.local.empty_cache().items()}
    return out


def fill_state(s, emb_field, per_table):
    """A sharded optimizer state field from one array per table (`[E_t]` row-wise, or `[E_t, D_t]`)."""
    lay = s.layout
    host = [np.asarray(jax.device_get(v)) for v in per_table]
    rowwise = host[0].ndim == 1
    dtype = host[0].dtype
    pools = []
    for c, w in enumerate(lay.widths):
        shape = (s.num_devices, lay.pool_rows[c]) + (() if rowwise else (w,))
        blocks = np.zeros(shape, dtype)
        for p in lay.pieces:
            if lay.piece_pool[p] == c:
                r = lay.pool_row[p]
                v = host[p.table][p.row0 : p.row0 + p.rows]
                blocks[p.device, r : r + p.rows] = v if rowwise else v[:, p.col0 : p.col0 + p.cols]
        pools.append(blocks)
    out = _storage(s, pools, dtype)
    if s.cached:  # every state in the host parts: no cache slot holds one
        out[STATE_ROWS] = empty_state_rows(s)
    return out


def empty_state_rows(s) -> jax.Array:
    """A state slot's `"cache_rows"` with no cache slot holding a state, on every device."""
    return _from_blocks(s, np.full((s.num_devices * s.local.cache_layout.total_slots,), -1, np.int32))


def _storage(s, pools, dtype) -> dict:
    """The owners' buffers (or a state field's arrays) from every device's pools (`pools[c]`: `[n, rows, ...]`),
    cache parts zero, each buffer in host memory where its tables are."""
    lay = s.storage.layout
    out = {}
    for g, parts in enumerate(s.storage_parts()):
        tail = () if pools[0].ndim == 2 else (lay.dims[g],)  # a row-wise state field, or rows
        xs = [pools[c] if c >= 0 else np.zeros((s.num_devices, -c) + tail, dtype) for c in parts]
        blocks = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=1)
        out[lay.key(g)] = _from_blocks(s, blocks.reshape((-1,) + tail), lay.on_host(g))
    return out


def _from_blocks(s, arr: np.ndarray, host: bool = False) -> jax.Array:
    """A host array of every device's rows (`[n * rows, ...]`, device-major) as an array sharded over the axis;
    with `host`, each device's rows in its pinned host memory (`s.host_sharding()`: never through HBM)."""
    sh = s.host_sharding() if host else NamedSharding(s.mesh, P(s.axis_name))
    return jax.make_array_from_callback(arr.shape, sh, lambda idx: arr[idx])


def host_zeros(s, shape, dtype) -> jax.Array:
    """A zero buffer sharded over the axis in host memory (`s.host_sharding()`), made on the host: each device's
    part placed from a NumPy zero array (whose pages the OS maps only when written)."""
    return _from_blocks(s, np.zeros(shape, dtype), True)


def host_opt_slots(s, opt, params: dict) -> tuple:
    """`opt`'s slot trees for the sharded buffers `params` that live in host memory, made there as
    `memory.host_opt_slots` makes a single device's (on the host, placed by shards; under a trace in the
    program, placed in each device's host memory)."""
    return memory.host_opt_slots(
        opt, params, full=lambda shape, dtype, value: _from_blocks(s, np.full(shape, value, dtype), True),
        put=lambda x: jax.device_put(x, s.host_sharding()))


def _replicated(s, x):
    arr = np.asarray(x)
    return jax.make_array_from_callback(arr.shape, NamedSharding(s.mesh, P()), lambda idx: arr[idx])


def host_array(x) -> np.ndarray:
    """A sharded array's value on the host (as the checkpoints read it)."""
    return _host(x)


def _host(x) -> np.ndarray:
    """A global array's value on the host (every process gets all of it)."""
    if memory.on_host(x):  # pinned host shards: read through a device copy (a NumPy view would block donation)
        if not x.is_fully_addressable:
            raise NotImplementedError("reading tables in host memory sharded over several processes")
        out = np.empty(x.shape, x.dtype)
        for sh in x.addressable_shards:
            part = sh.data
            if not isinstance(part.sharding, jax.sharding.SingleDeviceSharding):
                # a mesh of one device gives its shard the mesh's sharding, whose explicit axis the read's kernel
                # refuses ("sharded ref can only be indexed by slices"): the same rows as a one-device array
                part = jax.device_put(part, memory.host_sharding(sh.device))
            out[sh.index] = memory.to_numpy(part)
        return out
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_tables(s, tree, name):
    """Per table, its full array assembled on the host from the shards in `tree` (params, or a state
    field), returned as a jax array on the default device."""
    lay, emb = s.layout, s.emb
    pools = pool_blocks(s, tree, name)
    out = []
    for t, spec in enumerate(emb.tables):
        mine = [p for p in lay.pieces if p.table == t]
        if s.plan.strategies[t] == "data":
            mine = [p for p in mine if p.device == 0]
        parts = []
        for p in mine:
            r = lay.pool_row[p]
            parts.append(pools[lay.piece_pool[p]][p.device, r : r + p.rows])
        if s.plan.strategies[t] == "column" and parts[0].ndim == 2:
            full = np.concatenate(parts, axis=1)
        elif s.plan.strategies[t] == "column":  # a row-wise state field of a column-wise table: one copy
            full = parts[0]
        else:
            full = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        out.append(jnp.asarray(full))
    return tuple(out)


def pool_blocks(s, tree, name) -> list:
    """Per pool c, every device's rows of it from `tree` (params, or the state field `name`), on the host:
    `[n, rows, ...]`. A cached pool's rows are its host part's with the cache's rows (or states) over them."""
    st, lay, n = s.storage.layout, s.layout, s.num_devices
    host = {k: _host(v) for k, v in tree.items() if k not in (CACHE, STATE_ROWS)}

    def table_block(ti):  # the storage table ti's rows on every device
        g = st.table_group[ti]
        buf = host[st.key(g)]
        buf = buf.reshape((n, st.group_rows[g]) + buf.shape[1:])
        r0 = st.table_row_offset[ti]
        return buf[:, r0 : r0 + s.storage.tables[ti].num_embeddings]

    out = []
    for c in range(len(lay.pool_keys)):
        base = table_block(s.pool_table[c])
        cl = s.local.cache_layout if s.cached else None
        if cl is not None and c in cl.tables:
            i = cl.tables.index(c)
            base = base.copy()
            cache = table_block(cl.cache_part[i])
            slot_rows = _host(tree[CACHE]["row_of_slot"] if name is None else tree[STATE_ROWS]).reshape(n, -1)
            s0, s1 = int(cl.base("slots")[i]), int(cl.base("slots")[i + 1])
            rows = slot_rows[:, s0:s1] - int(cl.base("rows")[i])
            for j in range(n):
                live = np.flatnonzero(rows[j] >= 0)
                base[j, rows[j][live]] = cache[j, live]
        out.append(base)
    return out
