"""FlowTT backward (XLA): exact core gradients of the pooled TT lookup, with prefix reuse.

The backward reuses the forward's preprocessing: the `prefix.FlowPlan` of each table group (sorted
distinct rows, their work items and the lookup -> distinct-row map `inverse`) is a residual of the
forward, so a training step sorts the lookups once. All arrays have static sizes (the plan's capacity
`cap` of distinct rows); counts stay on the device.

Per table group, with dY_b the output gradient of bag b and s_n the scale of lookup n (its per-sample
weight, times 1/len for mean pooling):

1. Aggregate per distinct row: dR[u] = sum over lookups n of row u of s_n dY_{bag(n)} (a segment sum
   through `inverse`; lookups that produce no row are dropped).
2. Prefix groups (the distinct (table, i_1..i_{T-1}) of the batch) are read off the plan's work items
   (an item is a run of one group's rows; consecutive items with equal digits form a group). Per group,
   the prefix products P_1 = G_1[i_1], P_t = P_{t-1} G_t[i_t] (as `[q_1..q_t, r_t]` matrices) are
   computed once; C = P_{T-1}.
3. Per distinct row u of group g, with H_u = G_T[i_T(u)] as `[r_{T-1}, q_T]` and dR_u as
   `[q_1..q_{T-1}, q_T]`: dG_T[i_T(u)] += C_g^T dR_u, and dC_u = dR_u H_u^T is summed per group:
   dC_g = sum_u dC_u (one prefix gradient per group, not per row).
4. Per group, the chain backwards from dP_{T-1} = dC_g: dG_t[i_t] += P_{t-1}^T dP_t (per (j_t) block),
   dP_{t-1} = dP_t G_t[i_t]^T, down to dG_1[i_1] += dP_1.

For T = 3 this is dG3[i_3] += C^T dY, dC = dY G3[i_3]^T, dG2[i_2] += G1[i_1]^T dC, dG1[i_1] += dC G2[i_2]^T.
Per-sample weights get d s_n = coef_n <R[u_n], dY_{bag(n)}>, with the rows R_u = C_g H_u recomputed from
the group products (no row buffer is kept from the forward).

The contributions (a slice id and a `[r_{t-1}, q_t, r_t]` block per group, or per distinct row for the
last core) are then either scattered into dense gradients (`pooled_vjp`, for `jax.grad`) or aggregated
per touched slice (`touched_core_grads`, for the optimizers: float work O(batch), plus an O(p_t) integer
mask per core to number the touched slices without a second sort).

Cores, gradients and touched slices are those of the params' stacked layout (`tt_jax.params`): per table
group (`prefix.core_groups`), per core, one buffer `[P, r_{t-1}, q_t, r_t]` whose slices are numbered as the
plans number them (table k's slice i is `core_base[t][k] + i`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.preprocess import bag_lengths
from tt_jax import params, prefix

_HI = jax.lax.Precision.HIGHEST


class Contribs(NamedTuple):
    """Gradient contributions to one stacked core."""

    ids: jax.Array  # [M] int32: stacked slice id (>= the stacked p: padding)
    vals: jax.Array  # [M, r_{t-1}, q_t, r_t] float32


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=jnp.float32)


def stacked_shapes(layout: prefix.StackedTables) -> list[tuple[int, int, int, int]]:
    r, q = layout.full_ranks, layout.q_shapes
    return [(layout.core_base[t][-1], r[t], q[t], r[t + 1]) for t in range(layout.num_cores)]


def position_bags(offsets, n):
    """Bag of each of `n` positions (clipped to the last bag): the number of bag starts offsets[1..FB-1] at
    or before it, by a histogram and a prefix sum (no binary search: jnp.searchsorted's default is a device
    while loop that syncs with the host on GPU)."""
    nb = offsets.shape[0] - 1
    # Clamped to [0, n] first, as the kernels clamp bags: a negative start would otherwise index from the end.
    bag = jnp.cumsum(jnp.zeros((n,), jnp.int32).at[jnp.clip(offsets[1:-1], 0, n)].add(1, mode="drop"))
    return jnp.minimum(bag, nb - 1)


def lookup_grads(g_out, offsets, n, *, batch, features_col0, dim, pooling):
    """Per lookup: its bag's output gradient in its feature's columns `[n, dim]`, and 1/len (mean) or 1.

    `features_col0`: per feature (all F), its first output column. Positions outside
    `[offsets[0], offsets[-1])` get garbage (their `inverse` is -1, so they are dropped).
    """
    bag = position_bags(offsets, n)
    feat = bag // batch
    total = g_out.shape[1]
    col = jnp.asarray(np.asarray(features_col0, np.int32))[feat]
    idx = ((bag - feat * batch) * total + col)[:, None] + jnp.arange(dim, dtype=jnp.int32)[None, :]
    gy = jnp.take(g_out.reshape(-1).astype(jnp.float32), idx, mode="clip")
    if pooling == "mean":
        coef = 1.0 / jnp.maximum(bag_lengths(offsets, n), 1.0)[bag]
    else:
        coef = jnp.ones((n,), jnp.float32)
    return gy, coef


def group_backward(layout: prefix.StackedTables, stacked_cores, plan: prefix.FlowPlan, d_rows, *,
                   want_rows: bool = False):
    """Steps 2-4 of the module docstring for one table group.

    Args:
      stacked_cores: per core, the group's cores stacked along p (the params' buffers, `tt_jax.params`; flat
        or shaped).
      plan: the forward's `FlowPlan`.
      d_rows: `[cap, D]` aggregated output gradient per distinct row (rows >= plan.num_rows are zero).
      want_rows: also return the `[cap, D]` distinct rows (for the per-sample-weight gradient).

    Returns:
      (per core its `Contribs`, rows or None).
    """
    nc = layout.num_cores
    shapes = stacked_shapes(layout)
    cores = [c.reshape(s) for c, s in zip(stacked_cores, shapes)]
    cap = plan.row_suffix.shape[0]
    n_groups = max(1, min(cap, layout.prefix_base[-1]))  # static bound on the batch's prefix groups
    # -- groups from the work items (items of a group are consecutive and carry its digits) --
    meta = plan.item_meta[: cap * (nc + 1)].reshape(cap, nc + 1)
    item = jnp.arange(cap, dtype=jnp.int32)
    live_item = item < plan.num_items[0]
    first, digits, last_base = meta[:, 0], meta[:, 1:nc], meta[:, nc]
    differs = jnp.any(digits[1:] != digits[:-1], axis=1)
    new_group = live_item & jnp.concatenate([jnp.ones((1,), bool), differs])
    group_of_item = jnp.cumsum(new_group.astype(jnp.int32)) - 1
    num_groups = jnp.sum(new_group.astype(jnp.int32))
    gslot = jnp.where(live_item, group_of_item, n_groups)
    gdig = jnp.zeros((n_groups, nc - 1), jnp.int32).at[gslot].set(digits, mode="drop")
    live_group = jnp.arange(n_groups, dtype=jnp.int32) < num_groups
    # -- rows: their item (a +1 at every item's first row, prefix-summed), group and last-core slice --
    starts = jnp.zeros((cap,), jnp.int32).at[jnp.where(live_item, first, cap)].add(1, mode="drop")
    item_of_row = jnp.clip(jnp.cumsum(starts) - 1, 0, cap - 1)
    row_group = jnp.minimum(group_of_item[item_of_row], n_groups - 1)
    live_row = item < plan.num_rows
    last_id = last_base[item_of_row] + plan.row_suffix
    # -- step 2: prefix products, once per group --
    slices = [cores[t][gdig[:, t]] for t in range(nc - 1)]  # [G, r_{t-1}, q_t, r_t]
    prods = [slices[0][:, 0]]  # P_1: [G, q1, r1]
    for t in range(1, nc - 1):
        p = _einsum("gJa,gajb->gJjb", prods[-1], slices[t])
        prods.append(p.reshape(n_groups, -1, p.shape[-1]))
    c = prods[-1]  # [G, Q, r_{T-1}]
    # -- step 3: per distinct row --
    q_last = layout.q_shapes[-1]
    h = cores[-1][jnp.minimum(last_id, shapes[-1][0] - 1)][..., 0]  # [cap, r_{T-1}, q_T]
    dr = d_rows.reshape(cap, -1, q_last)  # [cap, Q, q_T]
    c_row = c[row_group]  # [cap, Q, r]
    d_last = _einsum("uQr,uQj->urj", c_row, dr)[..., None]
    dc = jax.ops.segment_sum(_einsum("uQj,urj->uQr", dr, h), jnp.where(live_row, row_group, n_groups),
                             num_segments=n_groups, indices_are_sorted=True)
    contribs = [None] * nc
    contribs[-1] = Contribs(jnp.where(live_row, last_id, shapes[-1][0]), d_last)
    # -- step 4: the prefix chain backwards, per group --
    dp = dc
    for t in range(nc - 2, 0, -1):
        prev = prods[t - 1]  # [G, J, a]
        dp4 = dp.reshape(n_groups, prev.shape[1], layout.q_shapes[t], -1)  # [G, J, q_t, b]
        d_slice = _einsum("gJa,gJjb->gajb", prev, dp4)
        dp = _einsum("gJjb,gajb->gJa", dp4, slices[t])
        contribs[t] = Contribs(jnp.where(live_group, gdig[:, t], shapes[t][0]), d_slice)
    contribs[0] = Contribs(jnp.where(live_group, gdig[:, 0], shapes[0][0]), dp[:, None])
    rows = _einsum("uQr,urj->uQj", c_row, h).reshape(cap, -1) if want_rows else None
    return contribs, rows


def _groups(specs, feature_table_map, plans):
    # The default sort limits: this backward reads the layouts' geometry only (core bases, shapes), never the sort
    # rule the plans were built under (the plans carry the decoded core rows).
    groups = prefix.stack_tables(specs, feature_table_map)
    if len(groups) != len(plans):
        raise ValueError(f"{len(plans)} plans for {len(groups)} table groups")
    return groups


def feature_col0(specs, feature_table_map):
    """Per feature (all F), its first column in the `[B, sum D]` pooled output."""
    dims = [specs[t].embedding_dim for t in feature_table_map]
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(dims)])[:-1])


def _group_inputs(layout, plan, cores, offsets, psw, g_out, *, batch, col0, pooling, want_rows):
    """Step 1 and `group_backward` (`cores`: the group's stacked cores): (contribs, rows or None, per-lookup gy,
    coef)."""
    n = plan.inverse.shape[0]
    cap = plan.row_suffix.shape[0]
    gy, coef = lookup_grads(g_out, offsets, n, batch=batch, features_col0=col0, dim=layout.dim, pooling=pooling)
    scale = coef if psw is None else coef * psw.astype(jnp.float32)
    inv = plan.inverse
    d_rows = jnp.zeros((cap, layout.dim), jnp.float32).at[jnp.where(inv >= 0, inv, cap)].add(
        gy * scale[:, None], mode="drop")
    contribs, rows = group_backward(layout, cores, plan, d_rows, want_rows=want_rows)
    return contribs, rows, gy, coef


def pooled_vjp(cores, specs, feature_table_map, plans, offsets, per_sample_weights, g_out, *, batch: int,
               pooling: str):
    """Dense gradients of the pooled lookup: (per table group per core its stacked `d G_t`, d per_sample_weights
    or None).

    Args:
      cores: the params' stacked cores (per table group of `tt_jax.params`, per core).
      plans: per table group of `prefix.stack_tables(specs, feature_table_map)`, the forward's `FlowPlan`.
      offsets: `[F * B + 1]` int32; g_out: `[B, sum D]`.
    """
    col0 = feature_col0(specs, feature_table_map)
    d_cores = [[None] * len(cs) for cs in cores]
    d_psw = None
    if per_sample_weights is not None:
        d_psw = jnp.zeros(per_sample_weights.shape, jnp.float32)
    for (layout, _), plan in zip(_groups(specs, feature_table_map, plans), plans):
        g = params.group_index(specs, layout)
        contribs, rows, gy, coef = _group_inputs(
            layout, plan, cores[g], offsets, per_sample_weights, g_out, batch=batch, col0=col0, pooling=pooling,
            want_rows=per_sample_weights is not None)
        d_cores[g] = [jnp.zeros(shape, jnp.float32).at[ids].add(vals, mode="drop")
                      for shape, (ids, vals) in zip(stacked_shapes(layout), contribs)]
        if d_psw is not None:
            inv = plan.inverse
            dot = jnp.sum(rows[jnp.maximum(inv, 0)] * gy, axis=1)
            d_psw = d_psw + jnp.where(inv >= 0, coef * dot, 0.0)
    d_cores = tuple(tuple(d if d is not None else jnp.zeros(c.shape, jnp.float32) for d, c in zip(ds, cs))
                    for ds, cs in zip(d_cores, cores))
    return d_cores, d_psw


def _aggregate(contribs: Contribs, num_slices: int):
    """Sum contributions per distinct touched slice of a stacked core.

    The touched slices are numbered through an O(num_slices) integer mask and its prefix sum (ascending
    slice order, no sort); the float work is O(contributions). Returns `(ids [W], grads [W, ...])` in the
    stacked slice numbering, padding ids = num_slices.
    """
    ids, vals = contribs
    m = ids.shape[0]
    k_slots = max(1, min(num_slices, m))
    touched = jnp.zeros((num_slices,), jnp.int32).at[ids].set(1, mode="drop")
    csum = jnp.cumsum(touched)
    rank = csum - 1
    slot = jnp.where(ids < num_slices, rank[jnp.minimum(ids, num_slices - 1)], k_slots)
    grads = jnp.zeros((k_slots,) + vals.shape[1:], jnp.float32).at[slot].add(vals, mode="drop")
    slot_ids = jnp.full((k_slots,), num_slices, jnp.int32).at[jnp.where(touched > 0, rank, k_slots)].set(
        jnp.arange(num_slices, dtype=jnp.int32), mode="drop")
    return slot_ids, grads


def touched_core_grads(cores, specs, feature_table_map, plans, offsets, per_sample_weights, g_out, *,
                       batch: int, pooling: str):
    """Per table group per core (the params' stacked `cores`), `(ids, grads)` of the stacked slices this batch
    touches (padding ids = the stacked P), or None for a group no feature reads. Each touched slice appears
    once, with its gradient summed over the batch."""
    col0 = feature_col0(specs, feature_table_map)
    out = [[None] * len(cs) for cs in cores]
    for (layout, _), plan in zip(_groups(specs, feature_table_map, plans), plans):
        g = params.group_index(specs, layout)
        contribs, _, _, _ = _group_inputs(layout, plan, cores[g], offsets, per_sample_weights, g_out, batch=batch,
                                          col0=col0, pooling=pooling, want_rows=False)
        out[g] = [_aggregate(c, shape[0]) for shape, c in zip(stacked_shapes(layout), contribs)]
    return out


def touched_slices(specs, feature_table_map, plans):
    """Per table group per core, a `[P]` bool mask of the stacked slices this batch touches (slice i of table k's
    core t is touched when some valid lookup of table k has digit i_t = i, whatever its gradient), or None for a
    group no feature reads.

    Read off the forward's plans, no host sync: the first T-1 digits of each prefix group
    (`plan.group_meta`) and the last digit of each distinct row (`plan.row_suffix`), so O(lookups) integer
    work plus an O(p_t) mask per core. The same slices as `touched_core_grads` numbers.
    """
    all_groups = params.groups(specs)
    out = [[None] * g.num_cores for g in all_groups]
    for (layout, _), plan in zip(_groups(specs, feature_table_map, plans), plans):
        nc = layout.num_cores
        cap = plan.row_suffix.shape[0]
        meta = plan.group_meta[: cap * (nc + 1)].reshape(cap, nc + 1)
        live_group = jnp.arange(cap, dtype=jnp.int32) < plan.num_groups
        p_stacked = [layout.core_base[t][-1] for t in range(nc)]
        masks = [jnp.zeros((p_stacked[t],), bool).at[jnp.where(live_group, meta[:, 1 + t], p_stacked[t])].set(
            True, mode="drop") for t in range(nc - 1)]
        # Distinct rows: their group (a +1 at every group's first row, prefix-summed) gives the base of their
        # table in the stacked last core.
        starts = jnp.zeros((cap,), jnp.int32).at[jnp.where(live_group, meta[:, 0], cap)].add(1, mode="drop")
        group_of_row = jnp.clip(jnp.cumsum(starts) - 1, 0, cap - 1)
        live_row = jnp.arange(cap, dtype=jnp.int32) < plan.num_rows
        last_id = meta[:, nc][group_of_row] + plan.row_suffix
        masks.append(jnp.zeros((p_stacked[-1],), bool).at[jnp.where(live_row, last_id, p_stacked[-1])].set(
            True, mode="drop"))
        out[params.group_index(specs, layout)] = masks
    return out
