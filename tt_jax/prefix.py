"""FlowTT preprocessing (section 3.3): sort, unique, mixed-radix split, prefix groups, work items.

Jittable with static shapes (everything sized by N = len(ids)) and no host sync:
counts stay on the device. The prefix of a row is its first T-1 digits
(`id // p_T`); rows sharing a prefix share the contraction of the first T-1
cores, so it is computed once per prefix group. Long groups are split into work
items of at most `chunk` distinct suffixes so that skewed groups can be spread
over programs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

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
