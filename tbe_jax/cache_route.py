"""The host tier's lookups (`tbe_jax.host_cache`): each lookup of a cached table routed to the inner table that
holds its row (the cache part or the host part), the inner lookup or update, the outer result; and the cache
directory's bits after an update."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, dispatch, inputs, preprocess
from tbe_jax.cache_layout import CACHE
from tbe_jax.specs import FeaturePlan

# -- routing: each lookup of a cached table to its cache part or its host part ----------------------------------------
@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Facts:
    """Static facts of one batch shape: the outer plan, the cached features, the inner batch sizes (a pytree with
    no leaves: it rides in the training step's residuals)."""

    plan: FeaturePlan
    cached: tuple[int, ...]  # outer features of cached tables
    ci_: tuple[int, ...]  # per outer feature: its cached table's position in the CacheLayout, or -1
    inner_bpf: tuple[int, ...] | None  # static inner batch sizes (VBE), or None

    @property
    def ci(self) -> np.ndarray:
        return np.asarray(self.ci_, np.int32)

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, aux, children):
        return aux

    @property
    def width(self) -> int:
        return int(sum(self.plan.dim)) if not self.plan.vbe else self.plan.out_size


def batch_facts(emb, plan: FeaturePlan) -> Facts:
    cl = emb.cache_layout
    ci = tuple(cl.tables.index(t) if t in cl.tables else -1 for t in plan.table)
    cached = tuple(f for f, c in enumerate(ci) if c >= 0)
    inner_bpf = tuple(plan.batch) + tuple(plan.batch[f] for f in cached) if plan.vbe else None
    return Facts(plan, cached, ci, inner_bpf)


def route(emb, facts: Facts, directory, indices, offsets, per_sample_weights, training: bool):
    """The inner batch: `(ids, offsets, weights, src, use_cache, slot, crow, is_cached)`.

    Inner positions `[0, offsets[-1])` are the outer ones (cached features' ids replaced by their cache slot,
    -1 where the row is served by the host part); then the cached features' bags again, packed, with their ids
    for the host part (-1 where the cache serves them). `src`: the outer position behind each inner one (-1:
    padding). Offsets here are repaired (non-decreasing, within `[0, N]`)."""
    plan, cl = facts.plan, emb.cache_layout
    n = indices.shape[0]
    feat = preprocess.position_feature(plan, offsets, n)  # offsets repaired by the caller
    valid = preprocess.valid_lookups(plan, indices, offsets, feat)
    ci = jnp.asarray(facts.ci)[feat]
    is_c = valid & (ci >= 0)
    cic = jnp.maximum(ci, 0)
    crow = jnp.asarray(cl.base("rows")[:-1].astype(np.int32))[cic] + jnp.where(is_c, indices, 0)
    slot = jnp.where(is_c, directory["slot_of_row"][jnp.where(is_c, crow, 0)], -1)
    use_cache = is_c & (slot >= 0)
    if training:  # a row whose state stayed in host memory is trained there (and dropped from the cache)
        use_cache = use_cache & (directory["state_ok"][jnp.maximum(slot, 0)] > 0)
    local_slot = slot - jnp.asarray(cl.base("slots")[:-1].astype(np.int32))[cic]
    cached_f = jnp.asarray(facts.ci >= 0)[feat]
    id_cache = jnp.where(cached_f, jnp.where(use_cache, local_slot, -1), indices)
    id_host = jnp.where(is_c & ~use_cache, indices, -1)

    # the second block: the cached features' bags, packed after offsets[-1]
    j = len(facts.cached)
    # static per cached feature: its first bag and bag count; per second-block bag: its bag and its feature's rank
    first_bag = np.asarray([plan.bag_base[f] for f in facts.cached], np.int32)
    nbags = np.asarray([plan.batch[f] for f in facts.cached], np.int32)
    bag_of = np.concatenate([np.arange(b, b + k, dtype=np.int32) for b, k in zip(first_bag, nbags)] +
                            [np.zeros((0,), np.int32)])
    rank_of = np.repeat(np.arange(j, dtype=np.int32), nbags)
    starts = offsets[jnp.asarray(first_bag)].astype(jnp.int32)  # one gather each, whatever the feature count
    ends = offsets[jnp.asarray(first_bag + nbags)].astype(jnp.int32)
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ends - starts)])
    base2 = offsets[-1].astype(jnp.int32)
    p = jnp.arange(2 * n, dtype=jnp.int32)
    q = p - base2
    if j <= 64:  # each position's cached feature: compares against the features' ends, or a sorted search
        k = jnp.sum(q[:, None] >= cum[None, 1:], axis=1, dtype=jnp.int32) if j else jnp.zeros_like(q)
    else:
        k = jnp.searchsorted(cum[1:], q, side="right", method="sort").astype(jnp.int32)
    kc = jnp.minimum(k, max(j - 1, 0))
    second = (q >= 0) & (q < cum[-1]) if j else jnp.zeros_like(q, bool)
    src2 = (starts[kc].astype(jnp.int32) + q - cum[kc]) if j else q
    src = jnp.where(p < base2, p, jnp.where(second, src2, -1))
    srcc = jnp.clip(src, 0, max(n - 1, 0))
    ids = jnp.where(src < 0, -1, jnp.where(p < base2, id_cache[srcc], id_host[srcc])) if n else indices
    rank = jnp.asarray(rank_of)
    second_off = offsets[jnp.asarray(bag_of)].astype(jnp.int32) - starts[rank] + base2 + cum[rank]
    inner_off = jnp.concatenate([offsets[:-1].astype(jnp.int32), second_off, (base2 + cum[-1])[None]])
    psw = None
    if per_sample_weights is not None and n:
        psw = jnp.where(src >= 0, per_sample_weights[srcc], 0.0)
    return ids, inner_off, psw, src, use_cache, slot, crow, is_c


def merge(emb, facts: Facts, out, src, n):
    """The outer output from the inner one: the cached features' two partial lookups added."""
    plan = facts.plan
    if emb.pooling == "none":
        return jax.ops.segment_sum(out, jnp.where(src >= 0, src, n), num_segments=n + 1)[:n]
    dst = extra_columns(emb, facts)
    if plan.vbe:
        size = plan.out_size
        return _add_at(out[:size], dst, out[size:], axis=0)
    w = int(sum(plan.dim))
    return _add_at(out[:, :w], dst, out[:, w:], axis=1)


def _runs(dst: np.ndarray) -> list[tuple[int, int]] | None:
    """`dst` (static, ascending) as maximal runs of consecutive values, [(first value, length)], when there are at
    most 16 of them (slices then); None for more (one scatter or gather keeps the trace small)."""
    cut = np.flatnonzero(np.diff(dst) != 1) + 1
    runs = [(int(r[0]), len(r)) for r in np.split(dst, cut) if len(r)]
    return runs if len(runs) <= 16 else None


def _add_at(base, dst: np.ndarray, extra, axis: int):
    """`base.at[dst].add(extra)` along `axis`, for static ascending `dst`: as slices when `dst` is a few runs of
    consecutive positions (cached features next to each other: one fused pass, no scatter), else the scatter
    (many runs: the trace stays one op whatever the feature count). The same fp32 adds either way."""
    runs = _runs(dst)
    if runs is None:
        return base.at[(slice(None),) * axis + (dst,)].add(extra)
    take = lambda x, a, b: jax.lax.slice_in_dim(x, a, b, axis=axis)  # noqa: E731
    pieces, cur, e = [], 0, 0
    for a, k in runs:
        pieces += [take(base, cur, a), take(base, a, a + k) + take(extra, e, e + k)]
        cur, e = a + k, e + k
    pieces.append(take(base, cur, base.shape[axis]))
    return jnp.concatenate([p for p in pieces if p.shape[axis]], axis=axis)


def _gather_runs(x, dst: np.ndarray, axis: int):
    """`x` with its positions `dst` (static, ascending) appended along `axis`: slices for a few runs, else a
    gather."""
    runs = _runs(dst)
    if runs is None:
        return jnp.concatenate([x, jnp.take(x, jnp.asarray(dst), axis=axis)], axis=axis)
    return jnp.concatenate([x] + [jax.lax.slice_in_dim(x, a, a + k, axis=axis) for a, k in runs], axis=axis)


def extra_columns(emb, facts: Facts) -> np.ndarray:
    """Where the inner output's extra (host-part) values go in the outer output: flat positions (VBE) or
    columns."""
    plan = facts.plan
    if plan.vbe:
        return np.concatenate([np.arange(plan.out_base[f], plan.out_base[f] + plan.batch[f] * plan.dim[f])
                               for f in facts.cached]).astype(np.int32)
    return np.concatenate([np.arange(plan.out_base[f], plan.out_base[f] + plan.dim[f])
                           for f in facts.cached]).astype(np.int32)


def inner_grad(emb, facts, g, n):
    """The inner output's gradient: the outer one, the cached features' part repeated for their host parts
    (`pooling="none"`: per inner position, its source position's row; `facts` is then a `NoneFacts`)."""
    g = jnp.asarray(g)
    want = dispatch.out_shape(emb, (facts.facts if isinstance(facts, NoneFacts) else facts).plan, n)
    if tuple(g.shape) != want:
        raise ValueError(f"grad_output has shape {tuple(g.shape)}; this batch's output is {want}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"grad_output must be floating point, got {g.dtype}")
    if isinstance(facts, NoneFacts):
        src = facts.src
        return jnp.where((src >= 0)[:, None], g[jnp.clip(src, 0, max(g.shape[0] - 1, 0))], 0.0)
    return _gather_runs(g, extra_columns(emb, facts), axis=0 if facts.plan.vbe else 1)


def lookup(emb, plan, count, params, per_sample_weights, indices, offsets):
    """`dispatch.forward`'s lookup: route, look up the inner tables, merge; `(out, [2] counts)`."""
    out, counts, _ = routed_lookup(emb, plan, count, params, per_sample_weights, indices, offsets, training=False)
    return out, counts


def routed_lookup(emb, plan, count, params, per_sample_weights, indices, offsets, *, training):
    n = indices.shape[0]
    offsets, _ = bounds.repair_offsets(offsets, n)  # the inner batch is built from a partition of [0, N)
    counts = jnp.zeros((2,), jnp.int32)
    if count:
        counts = jnp.stack([bounds.count_invalid(plan, indices, offsets), jnp.int32(0)])
    facts = batch_facts(emb, plan)
    with jax.named_scope("tbe_cache_route"):
        ids, off, psw, src, use_cache, slot, crow, is_c = route(emb, facts, params[CACHE], indices, offsets,
                                                                per_sample_weights, training)
    inner_params = emb.inner_params(params)
    routed = (facts, ids, off, psw, src, use_cache, slot, crow, is_c, inner_params)
    if training:
        out, inner_res = emb.inner.step_forward(inner_params, ids, off, psw, batch_size_per_feature=facts.inner_bpf)
    else:
        out, inner_res = emb.inner(inner_params, ids, off, psw, batch_size_per_feature=facts.inner_bpf), None
    with jax.named_scope("tbe_cache_merge"):
        out = merge(emb, facts, out, src, n).astype(emb.output_dtype)
    return out, counts, (routed, inner_res)


def step_forward_impl(emb, params, indices, offsets, per_sample_weights, bpf):
    saved = []

    def lookup(e, plan, count, p, w, i, o):
        out, counts, extra = routed_lookup(e, plan, count, p, w, i, o, training=True)
        saved.append(extra)
        return out, counts

    out, report = dispatch.forward(emb, params, indices, offsets, per_sample_weights, bpf, False, lookup=lookup)
    (facts, ids, off, psw, src, use_cache, slot, crow, is_c, _), inner_res = saved[0]
    c = emb.cache_layout.total_slots
    touched = jnp.where(use_cache, slot, c)  # cache slots this step updates (marked dirty)
    drop = jnp.where(is_c & (slot >= 0) & ~use_cache, slot, c)  # cached rows trained in host memory
    res = {"inner": inner_res, "facts": facts, "touched": touched, "drop": drop, "invalid": report.invalid_indices,
           "n": Static(indices.shape[0])}
    if emb.pooling == "none":
        res["facts"] = NoneFacts(facts, src)
    return out, res


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Static:
    """A Python int in the residuals (a pytree with no leaves)."""

    value: int

    def __index__(self):
        return self.value

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value, children):
        return cls(value)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NoneFacts:
    """`pooling="none"`: the static facts and the inner positions' sources (for the gradient)."""

    facts: Facts
    src: jax.Array

    def tree_flatten(self):
        return (self.src,), self.facts

    @classmethod
    def tree_unflatten(cls, facts, children):
        return cls(facts, *children)


def apply_impl(emb, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf, backward_config):
    """`apply_gradients`: the batch routed as a training step routes it, the inner embedding's update, the
    directory's bits."""
    emb.check_optimizer(opt)
    plan, indices, offsets, psw = inputs.validated(emb, params, indices, offsets, per_sample_weights, bpf)
    n = indices.shape[0]
    offsets, _ = bounds.repair_offsets(offsets, n)
    facts = batch_facts(emb, plan)
    ids, off, ipsw, src, use_cache, slot, _, is_c = route(emb, facts, params[CACHE], indices, offsets, psw, True)
    g = inner_grad(emb, NoneFacts(facts, src) if emb.pooling == "none" else facts, grad_output, n)
    inner_p, inner_s = emb.inner.apply_gradients(emb.inner_params(params), emb.inner_state(opt_state), opt, ids,
                                                 off, g, ipsw, batch_size_per_feature=facts.inner_bpf,
                                                 backward_config=backward_config)
    c = emb.cache_layout.total_slots
    d = after_update(params[CACHE], jnp.where(use_cache, slot, c), jnp.where(is_c & (slot >= 0) & ~use_cache, slot, c))
    return {**inner_p, CACHE: d}, emb.outer_state(inner_s, opt_state)


def after_update(directory, touched, drop):
    with jax.named_scope("tbe_cache_directory"):
        return _after_update(directory, touched, drop)


def _after_update(directory, touched, drop):
    d = dict(directory)
    c = d["row_of_slot"].shape[0]
    d["dirty"] = d["dirty"].at[touched].set(1, mode="drop")
    gone = d["row_of_slot"][jnp.clip(drop, 0, c - 1)]
    gone = jnp.where(drop < c, gone, d["slot_of_row"].shape[0])
    d["slot_of_row"] = d["slot_of_row"].at[gone].set(-1, mode="drop")
    d["row_of_slot"] = d["row_of_slot"].at[drop].set(-1, mode="drop")
    return d
