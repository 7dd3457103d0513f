"""Fused FlowTT forward: prefix-shared TT rows, then pooled bags (two Pallas-Triton launches per table group).

1. `tt_rows` (the FlowTT kernel). Per work item of `prefix.build_flow` (a prefix
   group, or a chunk of at most `chunk` of its distinct rows), the program
   computes the prefix product C = G1[i1] G2[i2] ... G_{T-1}[i_{T-1}] once, in
   registers, then every distinct row of the item as C @ G_T[i_T], and stores
   it to a `[cap, D]` buffer of distinct rows. No intermediate goes to memory, except in a forward for
   differentiation (T = 3): each item's prefix product, kept for the backward (`FlowPlan.prefix_c`).

   Tiles (every dot dimension padded to a power of two >= 16 with masked loads):
   - T = 2: C = G1[i1] as `[q1, r1]`, loaded.
   - T >= 3: C2 = X @ Y with X `[q1 q2, q2 r1]`, X[(j1, j2), (j, a)] =
     G1[i1, 0, j1, a] if j == j2 else 0, and Y `[q2 r1, r2]`, Y[(j, a), b] =
     G2[i2, a, j, b]: one tensor-core dot gives C2 `[q1 q2, r2]` directly in the
     row-major (j1, j2) layout (no register reshape; the zero blocks cost
     q2 x the useful FLOPs, which are negligible next to the loads).
   - T = 4: C3 is kept as q3 tiles C2 @ G3[i3][:, j3, :] (`[q1 q2, r3]` each),
     again avoiding a reshape.
   Row stage: `tile_rows` distinct rows at once: G `[r_{T-1}, S q_T]`,
   G[b, (s, j)] = G_T[i_T(s), b, j, 0], and R = C @ G is `[q1..q_{T-1}, S q_T]`,
   stored with row (s) and column (J q_T + j) addresses. The first S rows are
   loaded together with the prefix's core slices (one memory latency for both).

   Schedules (`TTForwardConfig.schedule`): "queue" (persistent programs; each
   takes item `pid` first, then the next one from an atomic counter, claimed
   before the current item is processed so the atomic's latency is hidden:
   dynamic load balancing at chunk granularity, FlowTT 3.4), "static" (persistent
   programs, item t on program t mod P) and "grid" (one program per item slot,
   the baseline: the grid is the static bound `cap`, most programs exit at once).

2. `tt_pool`: bag-parallel pooling of the distinct rows through the lookup ->
   distinct-row map (`inverse`); a program owns `pool_bags` bags of one feature
   and gathers one row per bag per step; per-sample weights, mean as a scale;
   it writes its feature's columns of the `[B, sum D]` output in place, so table
   groups chain through input/output aliasing.

Modules: `config` (the knobs), `tiles` (tile geometry and in-kernel helpers), `rows` (`tt_rows`), `prefix_c`
(T = 3's packed prefix products), `pool` (`tt_pool`); this module runs them per table group (`pooled_forward`).

Interpret mode (CPU): the "queue" schedule uses a `fori_loop` over the static
item bound with predication (an atomic inside `while_loop` does not run there);
dots run at HIGHEST precision.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tt_jax import params, prefix
from tt_jax.kernels import plan as plan_kernels
from tt_jax.kernels.config import PRECISIONS, TTBackwardConfig, TTForwardConfig, TTKernelConfig, forward_part
from tt_jax.kernels.pool import tt_pool
from tt_jax.kernels.prefix_c import packed_prefix_products, prefix_c_size
from tt_jax.kernels.rows import tt_rows
from tt_jax.kernels.tiles import Tiles, dot_general, dot_pad, masked_store, tf32_split

__all__ = [
    "TTForwardResult", "flow_plans", "plan_stats", "pooled_forward",
    # re-exported from their modules (the names this module held before the split)
    "PRECISIONS", "TTBackwardConfig", "TTForwardConfig", "TTKernelConfig", "Tiles", "dot_general", "dot_pad",
    "masked_store", "packed_prefix_products", "prefix_c_size", "tf32_split", "tt_pool", "tt_rows",
]


class TTForwardResult(NamedTuple):
    """What `pooled_forward` returns (a pair: `out, plans = pooled_forward(...)` unpacks it)."""

    out: jax.Array  # [B, sum_f D_f] float32
    plans: tuple  # per table group of `config.stack_tables`, its `prefix.FlowPlan` (the backward's residuals)


def flow_plans(specs, feature_table_map: tuple[int, ...], indices, offsets, *, batch: int,
               config: TTKernelConfig | TTForwardConfig, fused: bool = False, interpret: bool = False):
    """Per table group of `config.stack_tables` (in order), the batch's `FlowPlan`: `prefix.build_flow`, or with
    `fused` `tt_jax.kernels.plan.build_flow` (the same plan, its bookkeeping in Pallas passes; `interpret`: in
    interpret mode)."""
    config = forward_part(config)
    out = []
    for layout, feats in config.stack_tables(specs, feature_table_map):
        kw = dict(features=feats, feature_table_map=feature_table_map, batch=batch, chunk=config.chunk,
                  prefix_reuse=config.prefix_reuse)
        if fused:
            out.append(plan_kernels.build_flow(layout, indices, offsets, interpret=interpret, block=config.plan_block,
                                               scan_chunk=config.plan_scan_chunk, **kw))
        else:
            out.append(prefix.build_flow(layout, indices, offsets, **kw))
    return tuple(out)


def plan_stats(plans) -> list[dict]:
    """Per table group, device scalars of its plan: distinct rows, prefix groups, work items."""
    return [{"distinct_rows": p.num_rows, "prefix_groups": p.num_groups, "work_items": p.num_items[0]}
            for p in plans]


def pooled_forward(
    cores,  # the params' stacked cores: per table group of `tt_jax.params`, per core `[P, r, q, r']` (or flat)
    specs,
    feature_table_map: tuple[int, ...],
    indices: jax.Array,  # [N] int32
    offsets: jax.Array,  # [F * B + 1] int32
    per_sample_weights: jax.Array | None,
    *,
    batch: int,
    pooling: str,
    config: TTKernelConfig | TTForwardConfig,
    interpret: bool,
    keep_c: bool = False,
    return_plans: bool = True,
) -> TTForwardResult:
    """`[B, sum_f D_f]` pooled TT lookups (feature f reads table `feature_table_map[f]`) and the plans.

    Per group of tables sharing (q, ranks): `prefix.build_flow`, `tt_rows`, `tt_pool`, the kernels reading the
    group's stacked cores as they are stored (flattened, no copy). Returns
    `TTForwardResult(out, plans)`: the output and the per-group `FlowPlan`s (the backward's residuals;
    `plan_stats(plans)` counts their rows, groups and items). With `keep_c`, the plans of T = 3 groups carry
    each work item's prefix product (`FlowPlan.prefix_c`) for the backward, within
    `TTForwardConfig.prefix_c_max_bytes`. `return_plans` is accepted for the old call form only: the plans
    are always returned, so it must be True.
    """
    if not return_plans:
        raise ValueError("pooled_forward always returns TTForwardResult(out, plans): drop return_plans=False "
                         "and take `.out`")
    if isinstance(config, TTKernelConfig):
        config = config.forward_config
    dims = [specs[t].embedding_dim for t in feature_table_map]
    total = sum(dims)
    col0 = tuple(int(x) for x in np.concatenate([[0], np.cumsum(dims)])[:-1])
    out = None
    # The plans' bookkeeping after the sort in Pallas passes (`tt_jax.kernels.plan`), not `prefix.build_flow`'s
    # ~15 XLA ops (the definition they are tested against).
    plans = list(flow_plans(specs, feature_table_map, indices, offsets, batch=batch, config=config,
                            fused=True, interpret=interpret))
    c_budget = config.prefix_c_max_bytes
    for k, ((layout, feats), plan) in enumerate(zip(config.stack_tables(specs, feature_table_map), plans)):
        group = [jnp.asarray(c, jnp.float32).reshape(-1) for c in params.group_cores(specs, layout, cores)]
        c_size = prefix_c_size(layout, plan.row_suffix.shape[0], config)
        if c_size is not None and 4 * c_size <= c_budget:
            c_budget -= 4 * c_size
            c = packed_prefix_products(group, plan, layout, config=config, interpret=interpret)
            rows = tt_rows(group, plan, layout, config=config, interpret=interpret, c_in=c)
            if keep_c:
                plans[k] = plan = plan._replace(prefix_c=c)
        else:
            rows = tt_rows(group, plan, layout, config=config, interpret=interpret)
        out = tt_pool(rows, plan.inverse, offsets, per_sample_weights, out, features=feats, col0=col0,
                      dim=layout.dim, batch=batch, total_dim=total, pooling=pooling, config=config,
                      interpret=interpret)
    return TTForwardResult(out.reshape(batch, total), tuple(plans))
