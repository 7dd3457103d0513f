"""FlowTT backward in Pallas-Triton: deterministic core gradients with prefix reuse (no float atomics).

The math is `tt_jax.backward`'s (steps 1-4 of its docstring); this module replaces its scatters and segment
sums by reductions over sorted member lists, each summed in a fixed order, so a gradient is bitwise the
same run to run. Per table group (`prefix.StackedTables`), from the forward's `FlowPlan`:

1. `d_rows` (per distinct row u, dR_u = sum of s_n dY_{bag(n)} over its lookups n): a segmented reduction
   over the lookups sorted by row (`plan.perm`, `plan.sorted_row`).
2. `tt_bwd_groups` (`groups`): one program per prefix group (`plan.group_meta`), or, for T = 3 when the
   forward kept each work item's prefix product (`plan.prefix_c`, see `TTForwardConfig.prefix_c_max_bytes`), one
   per work item (a group cut into items is then several members of step 3's sums). The general kernel recomputes the group's prefix
   product as a list of `[q_1, r_{T-1}]` tiles, one per value of the middle digits (j_2 .. j_{T-1}), so the
   chain needs no register reshapes (T = 3: `groups._group_kernel3`, one `[q_1 q_2, r_2]` tile): P_1 = G_1[i_1],
   P_t tiles = P_{t-1} tile @ G_t[i_t][:, j_t, :]. It walks
   the group's distinct rows (`rows_per_step` at a time) with H = G_T[i_T(u)] and the dR tiles X_k:
     dC_k += X_k H^T (the prefix gradient, summed over the group's rows in registers),
     per row: C^T dR_u (its last-core contribution) -> `dlast[u]`, and its last-core slice -> `row_slice[u]`.
   Then the chain backwards: for a middle core t, it stores P_{t-1} and dP_t (the members of that core's
   reduction, below) and dP_{t-1} = sum_j dP_t[., j] G_t[i_t][:, j, :]^T; the first core's contribution
   dP_1 -> `dfirst[g]`.
3. Per core, the contributions are summed per slice (the slice ids of the members are scattered, so the
   members are sorted by slice with a stable XLA sort of small int32 keys: groups, or distinct rows for
   the last core): first and last cores sum dense vectors (`dfirst`, `dlast`); a middle core t sums outer
   products, dG_t[i] = sum over its groups of P_{t-1}^T dP_t (one tensor-core dot per member tile:
   `[r, (member, J)] x [(member, J), (j, r')]`), never materialising the per-group `[r, q, r']` blocks.

The segmented reductions of steps 1 and 3 are `segsum.segment_sum` (two passes, tiles of sorted members; its
docstring says how).

The per-sample-weight gradient (d s_n = coef_n <R_u, dY_{bag(n)}>) is fused into pass 1 of `d_rows`,
with the rows R recomputed by the forward's rows kernel (`rows.tt_rows`).

Outputs are dense core-shaped fp32 gradients (zeros for untouched slices): the optimizers then update the
cores densely (`optim.update_dense`: a zero gradient leaves an SGD/Adagrad slice and its state bitwise
unchanged; Adam and weight decay keep the untouched slices by the plans' touched mask,
`tt_jax.backward.touched_slices`), which is O(core size) per step. Interpret mode (CPU): every dot at HIGHEST precision.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import row_align
from tbe_jax.preprocess import bag_lengths
from tt_jax import params, prefix
from tt_jax.backward import feature_col0, position_bags
from tt_jax.kernels.config import TTBackwardConfig, TTForwardConfig, TTKernelConfig
from tt_jax.kernels.groups import group_pass, packed_dp1
from tt_jax.kernels.rows import tt_rows
from tt_jax.kernels.segsum import segment_sum, sorted_runs

__all__ = ["dense_core_grads", "group_grads", "lookup_sources"]


def lookup_sources(plan, offsets, per_sample_weights, *, batch, col0, total, pooling):
    """Per sorted lookup: its output-gradient offset in the flat `[B * total]` g, scale, and coef."""
    bag = position_bags(offsets, plan.perm.shape[0])[plan.perm]
    feat = bag // batch
    src = (bag - feat * batch) * total + jnp.asarray(np.asarray(col0, np.int32))[feat]
    coef = None
    if pooling == "mean":
        coef = 1.0 / jnp.maximum(bag_lengths(offsets, plan.perm.shape[0]), 1.0)[bag]
    scale = coef
    if per_sample_weights is not None:
        w = per_sample_weights.astype(jnp.float32)[plan.perm]
        scale = w if scale is None else scale * w
    return src, scale, coef


def group_grads(layout: prefix.StackedTables, cores, plan: prefix.FlowPlan, offsets, per_sample_weights, g_out,
                *, batch: int, col0, pooling: str, want_psw: bool, config: TTBackwardConfig,
                forward_config: TTForwardConfig, interpret: bool):
    """One table group: (per core its dense stacked gradient `[sum p_t, r, q, r']`, d_psw `[N]` or None).
    `cores`: per core, the group's stacked cores (the params' buffers, `tt_jax.params`; shaped or flat).
    `forward_config`: the knobs the plan was built with (and the rows kernel's, for the weights' gradient)."""
    nc = layout.num_cores
    q, r = layout.q_shapes, layout.full_ranks
    dim = layout.dim
    cap = plan.row_suffix.shape[0]
    n = plan.perm.shape[0]
    total = g_out.shape[1]
    stacked = [jnp.asarray(c, jnp.float32).reshape(-1) for c in cores]
    # 1. d_rows (and the per-sample-weight gradient).
    src, scale, coef = lookup_sources(plan, offsets, per_sample_weights, batch=batch, col0=col0, total=total,
                                       pooling=pooling)
    data = {"src": src, "g": g_out.reshape(-1).astype(jnp.float32)}
    if scale is not None:
        data["scale"] = scale
    psw_len = None
    if want_psw:
        data["rows"] = tt_rows(stacked, plan, layout, config=forward_config, interpret=interpret)
        data["coef"] = coef if coef is not None else jnp.ones((n,), jnp.float32)
        data["perm"] = plan.perm
        psw_len = n
    res = segment_sum("lookups", plan.sorted_row, plan.row_start, data=data, out_slots=cap, e_a=1, e_b=dim,
                      tile=config.lookup_tile, config=config, interpret=interpret, psw_len=psw_len,
                      align=row_align((total,) + tuple(col0), 4))
    d_rows, d_psw = res if want_psw else (res, None)
    # 2. per prefix group; or, where the forward kept each work item's prefix product (`FlowPlan.prefix_c`), per
    # work item (a group's items are members of the per-slice sums below like whole groups).
    tiles3 = nc == 3 and config.group_kernel == "tiles3"  # its dP1 comes from `packed_dp1`
    use_c = plan.prefix_c is not None and tiles3
    if use_c:
        n_groups = prefix.item_bound(layout, cap, forward_config.chunk, forward_config.prefix_reuse)
        group_meta, num_groups = plan.item_meta, plan.num_items[0]
    else:
        n_groups = max(1, min(cap, layout.prefix_base[-1]))
        group_meta, num_groups = plan.group_meta, plan.num_groups
    meta = group_meta[: n_groups * (nc + 1)].reshape(n_groups, nc + 1)
    live_g = jnp.arange(n_groups, dtype=jnp.int32) < num_groups
    p_stacked = [layout.core_base[t][-1] for t in range(nc)]
    # Groups and items are numbered in sort-key order (table, then the prefix digits in `layout.prefix_digits`
    # order; a table's stacked slices ascend with the table), so the slices of the most significant digit's core are
    # already non-decreasing: no sort for that core (the middle one for T = 3, else the first).
    presorted = layout.prefix_digits[0]
    # The members by middle slice: the middle core's sum below, and `packed_dp1`'s order.
    by_mid = (sorted_runs(meta[:, 2], live_g, min(n_groups, p_stacked[1]), presorted=presorted == 1) if tiles3
              else None)
    bufs = group_pass(layout, stacked, plan, d_rows, n_groups, group_meta, num_groups,
                      plan.prefix_c if use_c else None, config=config, interpret=interpret)
    if tiles3:
        bufs["dfirst"] = packed_dp1(layout, stacked, group_meta, num_groups, None if presorted == 1 else by_mid[0],
                                    bufs["dp1"], n_groups, config=config, interpret=interpret)
    # 3. per core, the sum per slice.
    tile = config.member_tile
    grads = [None] * nc
    for t in range(nc - 1):
        order, run, run_seg, run_start = (by_mid if t == 1 and by_mid is not None else
                                          sorted_runs(meta[:, 1 + t], live_g, min(n_groups, p_stacked[t]),
                                                      presorted=t == presorted))
        if t == 0:
            out = segment_sum("dense", run, run_start, data={"ids": order, "buf": bufs["dfirst"]},
                              out_slots=p_stacked[0], e_a=1, e_b=q[0] * r[1], tile=tile, config=config,
                              interpret=interpret, run_seg=run_seg, zero_out=True)
        else:
            out = segment_sum("outer", run, run_start, data={"ids": order, "p": bufs[f"p{t}"], "dp": bufs[f"dp{t}"]},
                              out_slots=p_stacked[t], e_a=r[t], e_b=q[t] * r[t + 1], tile=tile, config=config,
                              interpret=interpret, run_seg=run_seg, zero_out=True, j_rows=int(np.prod(q[:t])))
        grads[t] = out.reshape(p_stacked[t], r[t], q[t], r[t + 1])
    live_u = jnp.arange(cap, dtype=jnp.int32) < plan.num_rows
    order, run, run_seg, run_start = sorted_runs(bufs["row_slice"], live_u, min(cap, p_stacked[-1]))
    out = segment_sum("dense", run, run_start, data={"ids": order, "buf": bufs["dlast"]}, out_slots=p_stacked[-1],
                      e_a=1, e_b=r[-2] * q[-1], tile=tile, config=config, interpret=interpret, run_seg=run_seg,
                      zero_out=True)
    grads[-1] = out.reshape(p_stacked[-1], r[-2], q[-1], 1)
    return grads, d_psw


def dense_core_grads(cores, specs, feature_table_map, plans, offsets, per_sample_weights, g_out, *, batch: int,
                     pooling: str, want_psw: bool, config: TTKernelConfig, interpret: bool):
    """Dense gradients of the pooled lookup (Pallas) with respect to the params' stacked `cores` (per table group
    of `tt_jax.params`, per core): (per group per core its stacked `d G_t`, or None for a group no feature reads,
    d per_sample_weights or None). Same contract as `tt_jax.backward.pooled_vjp`. `config`: the forward's (the
    plans were built with its `forward_config`) and the backward's knobs."""
    forward_config, backward_config = config.forward_config, config.backward_config
    groups = forward_config.stack_tables(specs, feature_table_map)
    if len(groups) != len(plans):
        raise ValueError(f"{len(plans)} plans for {len(groups)} table groups")
    col0 = feature_col0(specs, feature_table_map)
    d_cores = [[None] * len(cs) for cs in cores]
    want_psw = want_psw and per_sample_weights is not None
    d_psw = None
    for (layout, _), plan in zip(groups, plans):
        g = params.group_index(specs, layout)
        grads, dp = group_grads(layout, cores[g], plan, offsets, per_sample_weights, g_out, batch=batch, col0=col0,
                                pooling=pooling, want_psw=want_psw, config=backward_config,
                                forward_config=forward_config, interpret=interpret)
        d_cores[g] = grads
        if dp is not None:
            d_psw = dp if d_psw is None else d_psw + dp
    return d_cores, d_psw
