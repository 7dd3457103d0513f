"""The XLA path's fused update (`impl="xla"`, the CPU default): work proportional to the batch, not the tables.

`reference.apply_gradients` defines the update (every looked-up row gets the optimizer's rule once, on the sum of
its lookups' gradients; every other row and its state stay bitwise unchanged), but computes it densely over whole
buffers: a step cost 230 ms at 4M rows where a scatter of the touched rows costs 0.2. Here, per storage buffer:

1. the buffer's lookups sorted by row (stable, so each row's contributions keep their batch order);
2. one slot per distinct row (`N` slots at most: static shapes), its gradient the sorted segment sum of its lookups;
3. those rows and their optimizer state gathered, updated by the same `optim.apply_rule` (and the same
   stochastic rounding, seeded by the row's id), and scattered back with unique indices.

Each row sums its lookups in batch order as the dense form does (on the CPU: deterministic; on a GPU XLA's
scatter-add may sum them in any order, as the dense form's does). The result is the dense one's up to the
rounding of two differently fused programs (tested). Under `jit` with the tables donated, XLA updates the buffers
in place: no copy of a table either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tbe_jax import preprocess
from tbe_jax.specs import FeaturePlan, StorageLayout


def touched_rows(rows: jax.Array, live: jax.Array, num_rows: int):
    """The distinct rows of `rows[live]`: `(slot of each lookup, row of each slot, live slots)`.

    Slots are in increasing row order; `rows` has `N` entries, so there are at most `N` live slots; the others
    hold the sentinel row `num_rows` (out of range: dropped by the scatter). A lookup that is not live gets a
    slot whose row is the sentinel.
    """
    n = rows.shape[0]
    key = jnp.where(live, rows, num_rows).astype(jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    skey, spos = jax.lax.sort((key, pos), num_keys=1, is_stable=True)
    first = jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]]) if n else jnp.zeros((0,), bool)
    run = jnp.cumsum(first.astype(jnp.int32)) - 1  # the slot of each sorted lookup
    slot_row = jnp.full((n,), num_rows, jnp.int32).at[jnp.where(first, run, n)].set(skey, mode="drop")
    slot = jnp.zeros((n,), jnp.int32).at[spos].set(run, unique_indices=True)
    return slot, slot_row, slot_row < num_rows


def apply_gradients(buffers, slots, layout: StorageLayout, plan: FeaturePlan, indices, offsets, per_sample_weights,
                    g_out, rule, hyper, *, pooling: str, row_reduce=None):
    """`reference.apply_gradients`'s result, touching only the looked-up rows (same arguments).

    `row_reduce`: None, or a function `(g, lookups, slot) -> (reduce, dim)` for buffer `g` (its lookups' mask
    `[N]` and each lookup's slot `[N]`, as `touched_rows` gives): `reduce` (or None) is `optim.apply_rule`'s
    `row_reduce` for the buffer's slots, and also totals each row's count of non-finite gradient values
    (`skip_nonfinite`); `dim` the slots' row lengths (`[N]`, or None for the buffer's width). A column-sharded
    table's shards pass one that sums their partial row statistics (`tbe_jax.shard_programs.update`).
    """
    bag, feat, coef, scale = preprocess.lookup_coefficients(plan, indices, offsets, per_sample_weights, pooling)
    valid = coef > 0
    slots = tuple(slots or ())
    new_w, new_s = dict(buffers), tuple(dict(s) for s in slots)
    for g, m, grad_rows, rows in preprocess.group_lookups(layout, plan, indices, bag, feat, valid, g_out, pooling):
        key = layout.key(g)
        w = buffers[key]
        num_rows = w.shape[0]
        slot, slot_row, hit = touched_rows(rows, m, num_rows)
        # Each slot's gradient: its lookups' contributions, summed in batch order (the sort was stable).
        # (A dead lookup's slot is the sentinel's, never written back; its contribution is 0 anyway.)
        contrib = jnp.where(m[:, None], grad_rows * scale[:, None], 0.0)
        grad = jax.ops.segment_sum(contrib, slot, num_segments=rows.shape[0])
        grad = layout.pad(g, grad)
        reduce, dim = row_reduce(g, m, slot) if row_reduce is not None else (None, None)
        new_w[key], new = update_rows(layout, g, w, tuple(src[key] for src in slots), slot_row, hit, grad, rule,
                                      hyper, dim=dim, reduce=reduce)
        for out, x in zip(new_s, new):
            out[key] = x
    return new_w, new_s


def update_rows(layout: StorageLayout, g: int, w, states, slot_row, hit, grad, rule, hyper, *, dim=None, reduce=None):
    """Buffer `g` (`w`, its optimizer state arrays `states`) after `rule` on its rows `slot_row` where `hit`, each
    with gradient `grad` (`[slots, stride]` fp32, one slot per distinct row; the others hold a row past the buffer).
    `dim`, `reduce`: as `apply_gradients`'s `row_reduce` gives them. Returns `(w, states)`: the rows not hit,
    bitwise unchanged. (Also `tbe_jax.shard_programs`' update of the replicated tables, from the devices'
    combined gradient rows.)"""
    from tbe_jax.optim import apply_rule
    from tbe_jax.rounding import stochastic_round

    num_rows = w.shape[0]
    if rule.skip_nonfinite and reduce is None:
        hit = hit & jnp.all(jnp.isfinite(grad), axis=1)
    elif rule.skip_nonfinite:  # the whole row's count: every shard of a row skips it, or none does
        bad = reduce(jnp.sum(~jnp.isfinite(grad), axis=1).astype(jnp.float32))[0]
        hit = hit & (bad == 0)
    dest = jnp.where(hit, slot_row, num_rows)  # rows to write (the rest dropped)

    def gather(x):
        return jnp.take(x, slot_row, axis=0, mode="fill", fill_value=0)

    def values(x):  # a padded buffer's padding columns read as zeros, as the kernels' masked loads give
        x = x.astype(jnp.float32)
        if x.ndim == 1 or layout.strides[g] == layout.dims[g]:
            return x
        return jnp.where(jnp.arange(x.shape[1]) < layout.dims[g], x, 0.0)

    old = tuple(gather(x) for x in states)
    upd, new, salts = apply_rule(rule, values(gather(w)), tuple(values(x) for x in old), grad, hyper,
                                 dim=layout.dims[g] if dim is None else dim, row_reduce=reduce)
    out = tuple(src.at[dest].set(x.astype(src.dtype), mode="drop", unique_indices=True)
                for x, src in zip(new, states))
    if rule.stochastic_rounding and w.dtype in (jnp.float16, jnp.bfloat16):
        rr = jnp.broadcast_to(slot_row[:, None], grad.shape)
        cc = jax.lax.broadcasted_iota(jnp.int32, grad.shape, 1)
        upd = stochastic_round(upd, w.dtype, rr, cc, *salts)
    return w.at[dest].set(upd.astype(w.dtype), mode="drop", unique_indices=True), out
