"""The host tier's staged rows (`tbe_jax.host_cache`): the rows a step serves from host memory, copied to HBM once.

A lookup of a cached table whose row is not in the cache (not prefetched, past the fill cap, no free way, or its
state still in host memory) is served by the table's host part. Its kernels used to read such rows in place over
the bus, the forward's reads in the batch's order: random 256-byte rows cross PCIe at 16-34 GB/s, against 45-51
GB/s for the same rows in host-row order (`probe_copy_rows`, H100). So the step now stages them:

1. the batch's distinct host-served rows are sorted per *stage* (one per embedding dim of the cached tables:
   their host parts share the dim's host buffer), each lookup's id becomes its row's rank there;
2. `gather_rows` copies those rows (in host-row order) into a fresh HBM array, the stage (`"d{D}_stage"`);
3. the lookups and the update run on `emb.staged`, the inner embedding whose second block reads the stages
   (all in HBM): no kernel of the step reads host memory at random;
4. in training, the stage's updated rows, with their optimizer states (gathered by the update), go back to
   their host rows in host-row order (`copy_rows`), before anything else reads the host buffer.

The bytes over the bus are those of the update before (each distinct row read and written once, with its state),
without the forward's random reads. A stage holds at most `min(lookups, rows of its tables)` rows: a step's
scratch, never a copy of a table. Results are unchanged: the staged rows are the host rows, updated by the same
kernels with the same states.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import memory
from tbe_jax.kernels.copy_rows import copy_rows, gather_rows
from tbe_jax.specs import StorageLayout, TableSpec


def staged_embedding(inner, cl, outer_features: int):
    """`inner` (the cached model's inner embedding) with its second-block features (those after the first
    `outer_features`, which read the cached tables' host parts) reading a stage table of their dim instead: one
    table per dim at row 0 of a `"stage"` buffer (`StorageLayout`), its ids the stage ranks. A host buffer that
    then no feature reads (one holding only host parts) is left out with its tables: no kernel of a step takes
    it, so none writes it in place (XLA would copy it whole to keep the stage's read of it ordered). The other
    buffers keep their rows, so the two embeddings share params (`keys_of`), plus the stages."""
    lay = inner.layout
    dims = stage_dims(inner, cl)
    fmap = inner.feature_table_map[:outer_features]
    read = {lay.table_group[t] for t in fmap}
    kept_groups = [g for g in range(len(lay.dims)) if not lay.on_host(g) or g in read]
    kept = [t for t in range(len(inner.tables)) if lay.table_group[t] in kept_groups]
    new_t = {t: i for i, t in enumerate(kept)}
    stage_tables = tuple(TableSpec(max(1, sum(inner.tables[h].num_embeddings for h in cl.host_part
                                              if inner.tables[h].embedding_dim == d)), d) for d in dims)
    fmap = tuple(new_t[t] for t in fmap) + tuple(len(kept) + dims.index(inner.tables[t].embedding_dim)
                                                 for t in inner.feature_table_map[outer_features:])
    host_stride = {inner.tables[h].embedding_dim: lay.strides[lay.table_group[h]] for h in cl.host_part}
    g0 = len(kept_groups)
    staged = copy.copy(inner)
    staged.__dict__.pop("_hash", None)  # a new identity: its tables and feature map differ
    staged.tables = tuple(inner.tables[t] for t in kept) + stage_tables
    staged.feature_table_map = fmap
    staged.layout = StorageLayout(
        tuple(lay.dims[g] for g in kept_groups) + dims,
        tuple(lay.group_rows[g] for g in kept_groups) + tuple(t.num_embeddings for t in stage_tables),
        tuple(kept_groups.index(lay.table_group[t]) for t in kept) + tuple(range(g0, g0 + len(dims))),
        tuple(lay.table_row_offset[t] for t in kept) + (0,) * len(dims),
        tuple(lay.strides[g] for g in kept_groups) + tuple(host_stride[d] for d in dims),
        tuple(lay.locations[g] for g in kept_groups) + ("stage",) * len(dims))
    return staged


def keys_of(staged) -> frozenset:
    """The buffers (params keys) the staged embedding takes."""
    return frozenset(staged.layout.key(g) for g in range(len(staged.layout.dims)))


def stage_dims(inner, cl) -> tuple[int, ...]:
    """The stages: the cached tables' embedding dims, in order of first appearance."""
    return tuple(dict.fromkeys(inner.tables[h].embedding_dim for h in cl.host_part))


def ranks(emb, served, cic, indices):
    """Each lookup's stage id (`-1` where `served` is off) and per stage its rows: `(ids, rows)`, `rows[s]` the
    stage's distinct host-buffer rows ascending, `-1` padded to the stage's static size. `served`: lookups of
    cached tables left to host memory; `cic`: each lookup's cached table (its place in the CacheLayout)."""
    cl, lay = emb.cache_layout, emb.inner.layout
    n = indices.shape[0]
    dims = stage_dims(emb.inner, cl)
    dim_of = [emb.inner.tables[h].embedding_dim for h in cl.host_part]
    h_off = jnp.asarray(np.asarray([lay.table_row_offset[h] for h in cl.host_part], np.int32))
    stage_of = jnp.asarray(np.asarray([dims.index(d) for d in dim_of], np.int32))[cic]
    hrow = h_off[cic] + indices  # the row in its dim's host buffer
    never = jnp.iinfo(jnp.int32).max
    ids, rows = jnp.full((n,), -1, jnp.int32), []
    for s, d in enumerate(dims):
        size = stage_size(emb, s, n)
        mine = served & (stage_of == s)
        key, pos = jax.lax.sort((jnp.where(mine, hrow, never), jnp.arange(n, dtype=jnp.int32)), num_keys=1)
        live = key < never
        first = live & (key != jnp.concatenate([jnp.full((1,), -1, key.dtype), key[:-1]]))
        rank = jnp.cumsum(first.astype(jnp.int32)) - 1
        ids = ids.at[pos].set(jnp.where(live, rank, ids[pos]), unique_indices=True)
        rows.append(jnp.full((size,), -1, jnp.int32).at[jnp.where(first, rank, size)].set(key, mode="drop"))
    return ids, tuple(rows)


def stage_size(emb, s: int, n: int) -> int:
    """Stage `s`'s static rows for a batch of `n` lookups: at most one per lookup and one per row of its tables."""
    cl = emb.cache_layout
    d = stage_dims(emb.inner, cl)[s]
    rows = sum(r for h, r in zip(cl.host_part, cl.rows) if emb.inner.tables[h].embedding_dim == d)
    return max(1, min(n, rows))


def keys(emb):
    """Per stage: (its host buffer's key, its stage buffer's key)."""
    lay, cl = emb.inner.layout, emb.cache_layout
    host = {emb.inner.tables[h].embedding_dim: lay.key(lay.table_group[h]) for h in cl.host_part}
    return tuple((host[d], f"d{d}_stage") for d in stage_dims(emb.inner, cl))


def only(emb, tree) -> dict:
    """`tree` (params or a slot's dict, with its stages) restricted to the staged embedding's buffers."""
    mine = keys_of(emb.staged)
    return {k: v for k, v in tree.items() if k in mine}


def gather(emb, trees, rows, name):
    """Each tree of `trees` (params, or an optimizer slot's dict) with its stages added: stage s's rows of its
    host buffer (`rows[s]`), one launch per stage for every tree together."""
    out = [dict(t) for t in trees]
    kernel = emb.uses_kernel()
    for (kh, ks), r in zip(keys(emb), rows):
        got = gather_rows(tuple(t[kh] for t in trees), r, kernel=kernel, interpret=emb.interpret, name=name)
        for t, g in zip(out, got):
            t[ks] = g
    return out


def write_back(emb, trees, rows):
    """Each tree of `trees` without its stages, their rows written to their host rows first (one launch per stage
    for every tree together, in host-row order); the host buffers stay in host memory."""
    out = [dict(t) for t in trees]
    kernel = emb.uses_kernel()
    for (kh, ks), r in zip(keys(emb), rows):
        host = copy_rows(tuple(t[kh] for t in out), tuple(t.pop(ks) for t in out), r,
                         jnp.arange(r.shape[0], dtype=jnp.int32), kernel=kernel, interpret=emb.interpret,
                         name="stage_back")
        for t, h in zip(out, host):
            t[kh] = memory.keep_on_host(h)
    return out
