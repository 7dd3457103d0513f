"""Tables in host memory with an HBM row cache: `TableSpec(..., location="host_cached")` (issue 40).

A `TableBatchedEmbedding` holding such tables is a `HostCachedEmbedding`. Each cached table `t` (E_t rows) is
kept twice over, as two tables of an inner `TableBatchedEmbedding` (`emb.inner`, whose kernels do all the work):

- its *host part*: all E_t rows, in pinned host memory (`location="host"`: the kernels read and write its rows
  in place over the bus);
- its *cache part*: C_t = `ways * ceil(cache_load_factor * E_t / ways)` rows in HBM, set-associative (row r may
  live in one of the `ways` slots of set `hash(r) % (C_t / ways)`), with the directory in `params["cache"]`:
  `slot_of_row` (per cached row its slot or -1: 4 bytes per row, in HBM), `row_of_slot`, per slot its policy
  score, the tick of the last prefetch that used it, and two bits (below).

**Results never depend on the cache.** Every lookup of a cached table is routed, on the device, to the part that
holds the row's current value (and its optimizer state): the cache part if the row is cached, else the host
part; the two partial lookups are added. A batch that was not prefetched is therefore served from host memory
(at the bus's speed), never wrongly. Each row's update goes to one part with its summed gradient, so tables and
states equal the all-device model's bit for bit; a pooled output equals it to fp32 rounding when a bag mixes
cached and uncached rows (two partial sums added).

**`emb.prefetch(params, indices, offsets, opt_state=None)`** brings a batch's uncached rows into the cache: for
each miss a victim slot of its set (LRU: the slot used longest ago; LFU: the least used since it was filled;
never a slot used by this batch or by the previous prefetch, so prefetching one batch ahead of the step keeps
the step's rows), the victim's row written back to host memory if a step changed it, the miss's row copied in.
Work and bytes are proportional to the batch's misses, never to the table. With `opt_state` (training) the
optimizer state travels with its rows and both are returned; a slot filled without it holds a row whose state
stayed in host memory (bit `state_ok` off): lookups read it from the cache, but training steps route its
updates to the host part and drop it from the cache (its cache copy was never changed, so nothing is lost).
Without `opt_state` a prefetch evicts only such slots, never a row whose state lives in the cache.

Opt-state layout: the inner embedding's state, plus per optimizer slot a `"cache_rows"` entry (`[C]` int32: the
row whose state each cache slot holds, -1 for none), so `get_state` merges the cache's states without params.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, dispatch, inputs, memory, preprocess, vbe
from tbe_jax.kernels.copy_rows import copy_rows
from tbe_jax.specs import FeaturePlan, StorageLayout, TableSpec, checked_tables
from tbe_jax.tbe import TableBatchedEmbedding

CACHE = "cache"  # params' key of the cache directory
STATE_ROWS = "cache_rows"  # each optimizer slot's key of the rows its cache states belong to
POLICIES = ("lru", "lfu")
_DIR_FIELDS = ("slot_of_row", "row_of_slot", "score", "stamp", "dirty", "state_ok", "tick", "stats")
STATS = ("requested", "hits", "fills", "writebacks")  # `params["cache"]["stats"]`: the last prefetch's counts
_NEVER = np.int32(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static facts of the cached tables: per cached table (in table order) its rows, slots and sets, the bases of
    each in the concatenated row / slot / set spaces, and its two parts among the inner embedding's tables."""

    tables: tuple[int, ...]
    rows: tuple[int, ...]
    slots: tuple[int, ...]
    ways: int
    cache_part: tuple[int, ...]
    host_part: tuple[int, ...]

    @property
    def sets(self) -> tuple[int, ...]:
        return tuple(c // self.ways for c in self.slots)

    def base(self, name: str) -> np.ndarray:
        sizes = {"rows": self.rows, "slots": self.slots, "sets": self.sets}[name]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def total_rows(self) -> int:
        return int(sum(self.rows))

    @property
    def total_slots(self) -> int:
        return int(sum(self.slots))


def cache_slots(rows: int, load_factor: float, ways: int) -> int:
    """C_t: `cache_load_factor * E_t` rounded up to whole sets of `ways` slots (at least one set)."""
    return ways * max(1, math.ceil(math.ceil(load_factor * rows) / ways))


def split_tables(tables, load_factor: float, ways: int):
    """(inner tables, CacheLayout, per outer table its inner table): a cached table becomes its cache part (a
    device table of C_t rows) and its host part (a host table of E_t rows), in that order."""
    inner, of, cached, rows, slots, cpart, hpart = [], [], [], [], [], [], []
    for t, spec in enumerate(tables):
        if spec.location != "host_cached":
            of.append(len(inner))
            inner.append(spec)
            continue
        c = cache_slots(spec.num_embeddings, load_factor, ways)
        of.append(len(inner))
        cached.append(t), rows.append(spec.num_embeddings), slots.append(c)
        cpart.append(len(inner))
        inner.append(dataclasses.replace(spec, num_embeddings=c, location="device", bag_size_hint=None))
        hpart.append(len(inner))
        inner.append(dataclasses.replace(spec, location="host", bag_size_hint=None))
    return tuple(inner), CacheLayout(tuple(cached), tuple(rows), tuple(slots), ways, tuple(cpart), tuple(hpart)), \
        tuple(of)


class HostCachedEmbedding(TableBatchedEmbedding):
    """A `TableBatchedEmbedding` with tables in host memory behind an HBM cache (see the module doc).

    Built by `TableBatchedEmbedding(tables, ...)` when a table has `location="host_cached"`: the same API, plus
    `prefetch` and `cache_stats`. `inner` is the `TableBatchedEmbedding` of its storage (each cached table's cache
    and host parts, the other tables as given); `layout` is `inner.layout` (the buffers of `params`, besides
    `params["cache"]`); `cache_layout` the cached tables' sets and slots.
    """

    def __init__(self, tables, **kwargs):
        super().__init__(tables, **kwargs)
        if self.pooling == "none" and len({t.embedding_dim for t in self.tables}) != 1:
            raise ValueError('pooling="none" needs every table to have one embedding_dim')
        inner_tables, self.cache_layout, inner_of = split_tables(self.tables, self.cache_load_factor,
                                                                self.cache_ways)
        cl = self.cache_layout
        extra = [cl.host_part[cl.tables.index(t)] for t in self.feature_table_map if t in cl.tables]
        fmap = tuple(inner_of[t] for t in self.feature_table_map) + tuple(extra)
        self.cached_features = tuple(f for f, t in enumerate(self.feature_table_map) if t in cl.tables)
        self.inner = TableBatchedEmbedding(
            inner_tables, feature_table_map=fmap, pooling=self.pooling, weights_dtype=self.weights_dtype,
            output_dtype=jnp.float32, bounds_check="ignore", impl=self.impl, interpret=self.interpret,
            kernel_config=self.kernel_config, use_histogram=self.use_histogram,
            histogram_config=self.histogram_config, backward_config=self.backward_config, pad_rows=self.pad_rows)
        self.plan_layout = self.layout  # the outer tables' placeholder layout: FeaturePlans of the outer batch
        self.layout = self.inner.layout

    # -- structure ------------------------------------------------------------------------------------------------
    def plan(self, *, weighted: bool = False, vbe: bool = False, backward: bool = False) -> tuple[str, ...]:
        """Every feature takes the generic kernels (cache and host parts are looked up by them)."""
        return ("generic",) * self.num_features

    def plan_for(self, num_offsets: int, batch_size_per_feature=None) -> FeaturePlan:
        layout, self.layout = self.layout, self.plan_layout
        try:
            return super().plan_for(num_offsets, batch_size_per_feature)
        finally:
            self.layout = layout

    def shard(self, *args, **kwargs):
        raise NotImplementedError("tables with location='host_cached' are not sharded yet: keep them in one "
                                  "TableBatchedEmbedding on one device")

    def _dir_shapes(self) -> dict:
        r, c = self.cache_layout.total_rows, self.cache_layout.total_slots
        return {"slot_of_row": (r,), "row_of_slot": (c,), "score": (c,), "stamp": (c,), "dirty": (c,),
                "state_ok": (c,), "tick": (), "stats": (len(STATS),)}

    def empty_cache(self) -> dict:
        """A directory with every slot empty (what `init` and `set_tables` start from)."""
        shapes = self._dir_shapes()
        out = {k: jnp.zeros(s, jnp.int32) for k, s in shapes.items()}
        out["slot_of_row"] = jnp.full(shapes["slot_of_row"], -1, jnp.int32)
        out["row_of_slot"] = jnp.full(shapes["row_of_slot"], -1, jnp.int32)
        out["stamp"] = jnp.full(shapes["stamp"], -2, jnp.int32)
        return out

    def check_params(self, params, check_dtype: bool = True) -> None:
        if not isinstance(params, dict) or CACHE not in params:
            raise TypeError("params must be the dict emb.init/set_tables return (with its 'cache' directory)")
        self.inner.check_params({k: v for k, v in params.items() if k != CACHE}, check_dtype)
        d = params[CACHE]
        shapes = self._dir_shapes()
        if not isinstance(d, dict) or set(d) != set(shapes):
            raise ValueError(f"params['cache'] must hold {sorted(shapes)} (build params with emb.init)")
        for k, s in shapes.items():
            if tuple(getattr(d[k], "shape", ())) != s or getattr(d[k], "dtype", None) != jnp.int32:
                raise ValueError(f"params['cache'][{k!r}] must be int32{list(s)}")

    # -- parameters -------------------------------------------------------------------------------------------------
    def init(self, key: jax.Array) -> dict:
        """The inner tables drawn as `TableBatchedEmbedding.init` draws (each cached table's host part holds its
        rows; the cache starts empty)."""
        return {**self.inner.init(key), CACHE: self.empty_cache()}

    def _host_tables(self, params) -> dict:
        return {k: v for k, v in params.items() if k != CACHE}

    def get_tables(self, params) -> list:
        """Per table its `[E_t, D_t]` rows: a cached table's host rows with the cache's rows over them."""
        self.check_params(params, check_dtype=False)
        parts = self.inner.get_tables(self._host_tables(params))
        return [self._merged(params[CACHE]["row_of_slot"], parts, t, lambda i: parts[i])
                for t in range(len(self.tables))]

    def _merged(self, slot_rows, parts, t, part):
        """Table t's values: a plain table's inner table, a cached one's host part with its cached rows over it
        (`part(i)`: inner table i's per-row values, rows or a state field)."""
        cl = self.cache_layout
        if t not in cl.tables:
            return part(self._inner_of(t))
        i = cl.tables.index(t)
        base = memory.to_numpy(part(cl.host_part[i])).copy()
        cache = memory.to_numpy(part(cl.cache_part[i]))
        s0, s1 = int(cl.base("slots")[i]), int(cl.base("slots")[i + 1])
        rows = memory.to_numpy(slot_rows)[s0:s1] - int(cl.base("rows")[i])
        live = rows >= 0
        base[rows[live]] = cache[np.flatnonzero(live)]
        return jnp.asarray(base)

    def _inner_of(self, t: int) -> int:
        return split_tables(self.tables[: t + 1], self.cache_load_factor, self.cache_ways)[2][t]

    def set_tables(self, params, tables) -> dict:
        """Params holding `tables` (in their host parts; the cache empty), cast to weights_dtype."""
        tables = checked_tables(self.tables, tables)
        cl = self.cache_layout
        inner = [None] * len(self.inner.tables)
        for t, arr in enumerate(tables):
            if t in cl.tables:
                i = cl.tables.index(t)
                inner[cl.host_part[i]] = np.asarray(memory.to_numpy(arr), self.weights_dtype)
                inner[cl.cache_part[i]] = np.zeros((cl.slots[i], self.tables[t].embedding_dim), self.weights_dtype)
            else:
                inner[self._inner_of(t)] = arr
        return {**self.inner.set_tables(None, inner), CACHE: self.empty_cache()}

    def init_opt_state(self, params, opt):
        """The inner tables' state, each slot with its `"cache_rows"` (no cache slot holds a state yet)."""
        self.check_optimizer(opt)
        self.check_params(params)
        state = self.inner.init_opt_state(self._host_tables(params), opt)
        c = self.cache_layout.total_slots  # one array per slot (a donated state holds no array twice)
        return opt.state_type(*[{**d, STATE_ROWS: jnp.full((c,), -1, jnp.int32)} for d in opt.slots(state)],
                              state.count)

    def _inner_state(self, opt_state):
        fields = getattr(opt_state, "_fields", ())
        slots = [{k: v for k, v in getattr(opt_state, f).items() if k != STATE_ROWS} for f in fields[:-1]]
        return type(opt_state)(*slots, opt_state.count)

    def _outer_state(self, inner_state, like):
        fields = getattr(like, "_fields", ())
        return type(like)(*[{**getattr(inner_state, f), STATE_ROWS: getattr(like, f)[STATE_ROWS]}
                            for f in fields[:-1]], inner_state.count)

    def get_state(self, opt_state, name: str) -> list:
        """Per table its slice of the state field `name`, a cached table's host states with the cache's over
        them."""
        parts = self.inner.get_state(self._inner_state(opt_state), name)
        rows = getattr(opt_state, name)[STATE_ROWS]
        return [self._merged(rows, parts, t, lambda i: parts[i]) for t in range(len(self.tables))]

    def written_buffers(self) -> frozenset:
        """The keys of `params` a prefetch writes: the cache directory and the buffers of the cached tables' two
        parts (the ones to donate)."""
        lay, cl = self.inner.layout, self.cache_layout
        return frozenset([CACHE] + [lay.key(lay.table_group[i]) for i in cl.cache_part + cl.host_part])

    def cache_stats(self, params) -> dict:
        """The last prefetch's counts (device scalars): rows `requested` (distinct cached rows of the batch),
        `hits`, `fills` (rows copied in), `writebacks` (changed rows copied out)."""
        return dict(zip(STATS, params[CACHE]["stats"]))

    # -- lookups ----------------------------------------------------------------------------------------------------
    def __call__(self, params, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        return self._forward(params, indices, offsets, per_sample_weights, batch_size_per_feature, max_batch_size,
                             warn=True)[0]

    def forward_with_report(self, params, indices, offsets, per_sample_weights=None, *,
                            batch_size_per_feature=None, max_batch_size=None):
        return self._forward(params, indices, offsets, per_sample_weights, batch_size_per_feature, max_batch_size,
                             warn=False)

    def _forward(self, params, indices, offsets, psw, bpf, max_batch_size, warn):
        bpf = vbe.resolve(bpf, max_batch_size)
        if self._eager(params, indices, offsets, psw, bpf):
            idx, off, w, dyn = dispatch.eager_args(indices, offsets, psw, bpf)
            return _jit_forward(idx, off, w, dyn, params, emb=self, static_bpf=dispatch.static_bpf(bpf), warn=warn)
        return dispatch.forward(self, params, indices, offsets, psw, bpf, warn, lookup=_lookup)

    def step_forward(self, params, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                     max_batch_size=None):
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            idx, off, w, dyn = dispatch.eager_args(indices, offsets, per_sample_weights, bpf)
            return _jit_step_forward(idx, off, w, dyn, params, emb=self, static_bpf=dispatch.static_bpf(bpf))
        return _step_forward(self, params, indices, offsets, per_sample_weights, bpf)

    def step_update(self, params, opt_state, opt, residuals, grad_output):
        self.check_optimizer(opt)
        inner_res, touched, drop = residuals["inner"], residuals["touched"], residuals["drop"]
        inner_p, inner_s, invalid = self.inner.step_update(
            self._host_tables(params), self._inner_state(opt_state), opt, inner_res,
            _inner_grad(self, residuals["facts"], grad_output, residuals["n"].value))
        d = _after_update(params[CACHE], touched, drop)
        return {**inner_p, CACHE: d}, self._outer_state(inner_s, opt_state), residuals["invalid"]

    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None, *,
                        batch_size_per_feature=None, max_batch_size=None, backward_config=None):
        """As `TableBatchedEmbedding.apply_gradients`: each looked-up row updated once, in the part that holds
        it (cache or host), with its state."""
        if grad_output is None:
            raise TypeError("grad_output must be an array shaped like this batch's output, got None")
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf):
            self.check_optimizer(opt)
            idx, off, w, dyn = dispatch.eager_args(indices, offsets, per_sample_weights, bpf)
            return _jit_apply(idx, off, w, dyn, params, opt_state, opt, jnp.asarray(grad_output), emb=self,
                              static_bpf=dispatch.static_bpf(bpf), backward_config=backward_config)
        return _apply(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf,
                      backward_config)

    def prefetch(self, params, indices, offsets, opt_state=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        """Bring this batch's rows of the cached tables into the HBM cache (see the module doc): returns the
        params, or `(params, opt_state)` when `opt_state` is given (pass it in training: the state then moves
        with its rows). Outside `jit` the arguments are donated (use the returned ones); under `jit`, donate
        them yourself or XLA copies the buffers the prefetch writes."""
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, opt_state, bpf):
            idx, off, _, dyn = dispatch.eager_args(indices, offsets, None, bpf)
            self.check_params(params)
            written = self.written_buffers()
            moved = {k: v for k, v in params.items() if k in written}
            kept = {k: v for k, v in params.items() if k not in written}
            return _jit_prefetch(moved, kept, opt_state, idx, off, dyn, emb=self, static_bpf=dispatch.static_bpf(bpf))
        return _prefetch(self, params, opt_state, indices, offsets, bpf)


# -- routing: each lookup of a cached table to its cache part or its host part ----------------------------------------
@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class _Facts:
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


def _facts(emb: HostCachedEmbedding, plan: FeaturePlan) -> _Facts:
    cl = emb.cache_layout
    ci = tuple(cl.tables.index(t) if t in cl.tables else -1 for t in plan.table)
    cached = tuple(f for f, c in enumerate(ci) if c >= 0)
    inner_bpf = tuple(plan.batch) + tuple(plan.batch[f] for f in cached) if plan.vbe else None
    return _Facts(plan, cached, ci, inner_bpf)


def _route(emb, facts: _Facts, directory, indices, offsets, per_sample_weights, training: bool):
    """The inner batch: `(ids, offsets, weights, src, use_cache, slot, crow, is_cached)`.

    Inner positions `[0, offsets[-1])` are the outer ones (cached features' ids replaced by their cache slot,
    -1 where the row is served by the host part); then the cached features' bags again, packed, with their ids
    for the host part (-1 where the cache serves them). `src`: the outer position behind each inner one (-1:
    padding). Offsets here are repaired (non-decreasing, within `[0, N]`)."""
    plan, cl = facts.plan, emb.cache_layout
    n = indices.shape[0]
    _, feat = preprocess.position_features(plan, offsets, n)
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
    starts = jnp.stack([offsets[plan.bag_base[f]] for f in facts.cached]) if j else jnp.zeros((0,), offsets.dtype)
    ends = jnp.stack([offsets[plan.bag_base[f] + plan.batch[f]] for f in facts.cached]) if j else starts
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((ends - starts).astype(jnp.int32))])
    base2 = offsets[-1].astype(jnp.int32)
    p = jnp.arange(2 * n, dtype=jnp.int32)
    q = p - base2
    k = jnp.sum(q[:, None] >= cum[None, 1:], axis=1, dtype=jnp.int32) if j else jnp.zeros_like(q)
    kc = jnp.minimum(k, max(j - 1, 0))
    second = (q >= 0) & (q < cum[-1]) if j else jnp.zeros_like(q, bool)
    src2 = (starts[kc].astype(jnp.int32) + q - cum[kc]) if j else q
    src = jnp.where(p < base2, p, jnp.where(second, src2, -1))
    srcc = jnp.clip(src, 0, max(n - 1, 0))
    ids = jnp.where(src < 0, -1, jnp.where(p < base2, id_cache[srcc], id_host[srcc])) if n else indices
    pieces = [offsets[:-1].astype(jnp.int32)]
    for i, f in enumerate(facts.cached):
        b0 = plan.bag_base[f]
        pieces.append(offsets[b0 : b0 + plan.batch[f]].astype(jnp.int32) - starts[i].astype(jnp.int32) + base2
                      + cum[i])
    pieces.append((base2 + cum[-1])[None])
    inner_off = jnp.concatenate(pieces)
    psw = None
    if per_sample_weights is not None and n:
        psw = jnp.where(src >= 0, per_sample_weights[srcc], 0.0)
    return ids, inner_off, psw, src, use_cache, slot, crow, is_c


def _merge(emb, facts: _Facts, out, src, n):
    """The outer output from the inner one: the cached features' two partial lookups added."""
    plan = facts.plan
    if emb.pooling == "none":
        return jax.ops.segment_sum(out, jnp.where(src >= 0, src, n), num_segments=n + 1)[:n]
    dst = _extra_columns(emb, facts)
    if plan.vbe:
        size = plan.out_size
        return out[:size].at[dst].add(out[size:])
    w = int(sum(plan.dim))
    return out[:, :w].at[:, dst].add(out[:, w:])


def _extra_columns(emb, facts: _Facts) -> np.ndarray:
    """Where the inner output's extra (host-part) values go in the outer output: flat positions (VBE) or
    columns."""
    plan = facts.plan
    if plan.vbe:
        return np.concatenate([np.arange(plan.out_base[f], plan.out_base[f] + plan.batch[f] * plan.dim[f])
                               for f in facts.cached]).astype(np.int32)
    return np.concatenate([np.arange(plan.out_base[f], plan.out_base[f] + plan.dim[f])
                           for f in facts.cached]).astype(np.int32)


def _inner_grad(emb, facts, g, n):
    """The inner output's gradient: the outer one, the cached features' part repeated for their host parts
    (`pooling="none"`: per inner position, its source position's row; `facts` is then a `_NoneFacts`)."""
    g = jnp.asarray(g)
    want = dispatch.out_shape(emb, (facts.facts if isinstance(facts, _NoneFacts) else facts).plan, n)
    if tuple(g.shape) != want:
        raise ValueError(f"grad_output has shape {tuple(g.shape)}; this batch's output is {want}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"grad_output must be floating point, got {g.dtype}")
    if isinstance(facts, _NoneFacts):
        src = facts.src
        return jnp.where((src >= 0)[:, None], g[jnp.clip(src, 0, max(g.shape[0] - 1, 0))], 0.0)
    dst = _extra_columns(emb, facts)
    if facts.plan.vbe:
        return jnp.concatenate([g, g[dst]])
    return jnp.concatenate([g, g[:, dst]], axis=1)


def _lookup(emb, plan, count, params, per_sample_weights, indices, offsets):
    """`dispatch.forward`'s lookup: route, look up the inner tables, merge; `(out, [2] counts)`."""
    out, counts, _ = _routed_lookup(emb, plan, count, params, per_sample_weights, indices, offsets, training=False)
    return out, counts


def _routed_lookup(emb, plan, count, params, per_sample_weights, indices, offsets, *, training):
    n = indices.shape[0]
    offsets, _ = bounds.repair_offsets(offsets, n)  # the inner batch is built from a partition of [0, N)
    counts = jnp.zeros((2,), jnp.int32)
    if count:
        counts = jnp.stack([bounds.count_invalid(plan, indices, offsets), jnp.int32(0)])
    facts = _facts(emb, plan)
    ids, off, psw, src, use_cache, slot, crow, is_c = _route(emb, facts, params[CACHE], indices, offsets,
                                                            per_sample_weights, training)
    inner_params = emb._host_tables(params)
    routed = (facts, ids, off, psw, src, use_cache, slot, crow, is_c, inner_params)
    if training:
        out, inner_res = emb.inner.step_forward(inner_params, ids, off, psw, batch_size_per_feature=facts.inner_bpf)
    else:
        out, inner_res = emb.inner(inner_params, ids, off, psw, batch_size_per_feature=facts.inner_bpf), None
    out = _merge(emb, facts, out, src, n).astype(emb.output_dtype)
    return out, counts, (routed, inner_res)


def _step_forward(emb, params, indices, offsets, per_sample_weights, bpf):
    saved = []

    def lookup(e, plan, count, p, w, i, o):
        out, counts, extra = _routed_lookup(e, plan, count, p, w, i, o, training=True)
        saved.append(extra)
        return out, counts

    out, report = dispatch.forward(emb, params, indices, offsets, per_sample_weights, bpf, False, lookup=lookup)
    (facts, ids, off, psw, src, use_cache, slot, crow, is_c, _), inner_res = saved[0]
    c = emb.cache_layout.total_slots
    touched = jnp.where(use_cache, slot, c)  # cache slots this step updates (marked dirty)
    drop = jnp.where(is_c & (slot >= 0) & ~use_cache, slot, c)  # cached rows trained in host memory
    res = {"inner": inner_res, "facts": facts, "touched": touched, "drop": drop, "invalid": report.invalid_indices,
           "n": _Static(indices.shape[0])}
    if emb.pooling == "none":
        res["facts"] = _NoneFacts(facts, src)
    return out, res


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class _Static:
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
class _NoneFacts:
    """`pooling="none"`: the static facts and the inner positions' sources (for the gradient)."""

    facts: _Facts
    src: jax.Array

    def tree_flatten(self):
        return (self.src,), self.facts

    @classmethod
    def tree_unflatten(cls, facts, children):
        return cls(facts, *children)


def _apply(emb, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf, backward_config):
    """`apply_gradients`: the batch routed as a training step routes it, the inner embedding's update, the
    directory's bits."""
    emb.check_optimizer(opt)
    plan, indices, offsets, psw = inputs.validated(emb, params, indices, offsets, per_sample_weights, bpf)
    n = indices.shape[0]
    offsets, _ = bounds.repair_offsets(offsets, n)
    facts = _facts(emb, plan)
    ids, off, ipsw, src, use_cache, slot, _, is_c = _route(emb, facts, params[CACHE], indices, offsets, psw, True)
    g = _inner_grad(emb, _NoneFacts(facts, src) if emb.pooling == "none" else facts, grad_output, n)
    inner_p, inner_s = emb.inner.apply_gradients(emb._host_tables(params), emb._inner_state(opt_state), opt, ids,
                                                 off, g, ipsw, batch_size_per_feature=facts.inner_bpf,
                                                 backward_config=backward_config)
    c = emb.cache_layout.total_slots
    d = _after_update(params[CACHE], jnp.where(use_cache, slot, c), jnp.where(is_c & (slot >= 0) & ~use_cache, slot, c))
    return {**inner_p, CACHE: d}, emb._outer_state(inner_s, opt_state)


def _after_update(directory, touched, drop):
    d = dict(directory)
    c = d["row_of_slot"].shape[0]
    d["dirty"] = d["dirty"].at[touched].set(1, mode="drop")
    gone = d["row_of_slot"][jnp.clip(drop, 0, c - 1)]
    gone = jnp.where(drop < c, gone, d["slot_of_row"].shape[0])
    d["slot_of_row"] = d["slot_of_row"].at[gone].set(-1, mode="drop")
    d["row_of_slot"] = d["row_of_slot"].at[drop].set(-1, mode="drop")
    return d


# -- prefetch ---------------------------------------------------------------------------------------------------------
def _hash(rows):
    """A row's set hash (rows within their table): a multiplicative hash, so neighbouring ids spread over sets."""
    return (rows.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)) >> jnp.uint32(7)


def _prefetch(emb: HostCachedEmbedding, params, opt_state, indices, offsets, bpf):
    emb.check_params(params)
    plan, indices, offsets, _ = inputs.validated(emb, params, indices, offsets, None, bpf)
    n = indices.shape[0]
    d = dict(params[CACHE])
    if n == 0:
        return params if opt_state is None else (params, opt_state)
    offsets, _ = bounds.repair_offsets(offsets, n)
    cl = emb.cache_layout
    r_total, c_total, ways = cl.total_rows, cl.total_slots, cl.ways
    facts = _facts(emb, plan)
    _, feat = preprocess.position_features(plan, offsets, n)
    valid = preprocess.valid_lookups(plan, indices, offsets, feat)
    ci = jnp.asarray(facts.ci)[feat]
    is_c = valid & (ci >= 0)
    row_base = jnp.asarray(cl.base("rows")[:-1].astype(np.int32))
    crow = jnp.where(is_c, row_base[jnp.maximum(ci, 0)] + jnp.where(is_c, indices, 0), r_total)

    # distinct rows: sorted, each at its first position (`first`), with its count of lookups
    srt = jnp.sort(crow)
    prev = jnp.concatenate([jnp.full((1,), -1, srt.dtype), srt[:-1]])
    first = (srt != prev) & (srt < r_total)
    seg = jnp.cumsum(first.astype(jnp.int32)) - 1
    uses = jax.ops.segment_sum((srt < r_total).astype(jnp.int32), jnp.maximum(seg, 0), num_segments=n)
    uses = uses[jnp.maximum(seg, 0)]
    row = jnp.where(first, srt, 0)
    slot = jnp.where(first, d["slot_of_row"][row], -1)
    hit = first & (slot >= 0)
    miss = first & (slot < 0)
    tick = d["tick"] + 1
    hslot = jnp.where(hit, slot, c_total)
    score = d["score"]
    score = score.at[hslot].add(uses, mode="drop") if emb.cache_policy == "lfu" else \
        score.at[hslot].set(tick, mode="drop")
    stamp = d["stamp"].at[hslot].set(tick, mode="drop")

    # each miss: its set, its rank among the batch's misses of that set, the victim way of that rank
    t = jnp.sum(row[:, None] >= jnp.asarray(cl.base("rows")[1:-1].astype(np.int32))[None, :], axis=1,
                dtype=jnp.int32) if len(cl.tables) > 1 else jnp.zeros_like(row)
    local = row - row_base[t]
    sets = jnp.asarray(np.asarray(cl.sets, np.uint32))
    gset = jnp.asarray(cl.base("sets")[:-1].astype(np.int32))[t] + (_hash(local) % sets[t]).astype(jnp.int32)
    key = jnp.where(miss, gset, jnp.int32(_NEVER))
    order = jnp.argsort(key, stable=True)
    ks = key[order]
    pos = jnp.arange(n, dtype=jnp.int32)
    start = jax.lax.cummax(jnp.where(ks != jnp.concatenate([jnp.full((1,), -1, ks.dtype), ks[:-1]]), pos, 0))
    rank = jnp.zeros((n,), jnp.int32).at[order].set(pos - start)
    way_slots = gset[:, None] * ways + jnp.arange(ways, dtype=jnp.int32)[None, :]
    way_slots = jnp.where(miss[:, None], way_slots, 0)
    w_row = d["row_of_slot"][way_slots]
    locked = stamp[way_slots] >= tick - 1  # this batch's hits and the previous prefetch's rows
    if opt_state is None:  # without the states, only slots whose state is in host memory may go
        locked = locked | (d["state_ok"][way_slots] > 0)
    w_key = jnp.where(locked, _NEVER, jnp.where(w_row < 0, jnp.iinfo(jnp.int32).min, score[way_slots]))
    w_order = jnp.argsort(w_key, axis=1, stable=True)
    pick = jnp.take_along_axis(w_order, jnp.minimum(rank, ways - 1)[:, None], axis=1)[:, 0]
    ok = miss & (rank < ways) & (jnp.take_along_axis(w_key, pick[:, None], axis=1)[:, 0] < _NEVER)
    victim = jnp.where(ok, gset * ways + pick, c_total)
    old = jnp.where(ok, d["row_of_slot"][jnp.minimum(victim, c_total - 1)], -1)
    back = ok & (old >= 0) & (d["dirty"][jnp.minimum(victim, c_total - 1)] > 0)

    # rows (and states) out of and into the cache, per inner buffer pair of a cached table's dim
    inner_p = emb._host_tables(params)
    inner_s = None if opt_state is None else emb._inner_state(opt_state)
    inner_p, inner_s = _move(emb, inner_p, inner_s, t, victim, old, back, row, ok)
    stats = jnp.stack([jnp.sum(first, dtype=jnp.int32), jnp.sum(hit, dtype=jnp.int32),
                       jnp.sum(ok, dtype=jnp.int32), jnp.sum(back, dtype=jnp.int32)])

    gone = jnp.where(ok & (old >= 0), old, r_total)
    d["slot_of_row"] = d["slot_of_row"].at[gone].set(-1, mode="drop").at[jnp.where(ok, row, r_total)].set(
        victim, mode="drop")
    d["row_of_slot"] = d["row_of_slot"].at[victim].set(row, mode="drop")
    d["score"] = score.at[victim].set(uses if emb.cache_policy == "lfu" else jnp.broadcast_to(tick, (n,)),
                                      mode="drop")
    d["stamp"] = stamp.at[victim].set(tick, mode="drop")
    d["dirty"] = d["dirty"].at[victim].set(0, mode="drop")
    d["state_ok"] = d["state_ok"].at[victim].set(int(opt_state is not None), mode="drop")
    d["tick"] = tick
    d["stats"] = stats
    params = {**inner_p, CACHE: d}
    if opt_state is None:
        return params
    rows_of = jnp.where(ok, row, -1)
    outer = emb._outer_state(inner_s, opt_state)
    fields = opt_state._fields[:-1]
    outer = type(opt_state)(*[{**getattr(outer, f), STATE_ROWS: getattr(outer, f)[STATE_ROWS].at[victim].set(
        rows_of, mode="drop")} for f in fields], outer.count)
    return params, outer


def _move(emb, inner_p, inner_s, t, victim, old, back, row, ok):
    """Write the evicted changed rows (`back`: slot `victim` -> host row `old`) and fill the misses (host row `row`
    -> slot `victim`, where `ok`), with their states when `inner_s` is given: per pair of inner buffers (the cache
    parts and the host parts of one dim), one copy out and one copy in per array. `t`: each miss's cached
    table."""
    cl, lay = emb.cache_layout, emb.inner.layout
    kernel = emb.uses_kernel()
    slot_fields = () if inner_s is None else inner_s._fields[:-1]
    slots = {f: dict(getattr(inner_s, f)) for f in slot_fields}
    pairs = [(lay.table_group[c], lay.table_group[h]) for c, h in zip(cl.cache_part, cl.host_part)]
    c_off = np.asarray([lay.table_row_offset[c] - int(b) for c, b in zip(cl.cache_part, cl.base("slots"))], np.int32)
    h_off = np.asarray([lay.table_row_offset[h] - int(b) for h, b in zip(cl.host_part, cl.base("rows"))], np.int32)
    c_rows_all = victim + jnp.asarray(c_off)[t]  # the victim slot's row in its cache buffer
    h_old = old + jnp.asarray(h_off)[t]  # the evicted row's row in its host buffer
    h_new = row + jnp.asarray(h_off)[t]  # the miss's row in its host buffer
    for pair in sorted(set(pairs)):
        mine = jnp.asarray(np.asarray([p == pair for p in pairs]))[t] & ok
        c_rows = jnp.where(mine, c_rows_all, -1)
        wb_dst = jnp.where(mine & back, h_old, -1)
        fill_src = jnp.where(mine, h_new, -1)
        kc, kh = lay.key(pair[0]), lay.key(pair[1])
        for tree in [inner_p] + [slots[f] for f in slot_fields]:
            tree[kh] = copy_rows(tree[kh], tree[kc], wb_dst, c_rows, kernel=kernel, interpret=emb.interpret)
            tree[kc] = copy_rows(tree[kc], tree[kh], c_rows, fill_src, kernel=kernel, interpret=emb.interpret)
    if inner_s is not None:
        inner_s = type(inner_s)(*[slots[f] for f in slot_fields], inner_s.count)
    return inner_p, inner_s


# -- eager calls: one jitted program each -------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("emb", "static_bpf", "warn"))
def _jit_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, emb, static_bpf, warn):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return dispatch.forward(emb, params, indices, offsets, per_sample_weights, bpf, warn, lookup=_lookup)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf"))
def _jit_step_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, emb, static_bpf):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return _step_forward(emb, params, indices, offsets, per_sample_weights, bpf)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf", "backward_config"))
def _jit_apply(indices, offsets, per_sample_weights, dyn_bpf, params, opt_state, opt, grad_output, *, emb,
               static_bpf, backward_config):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return _apply(emb, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf,
                  backward_config)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf"), donate_argnums=(0, 2))
def _jit_prefetch(moved, kept, opt_state, indices, offsets, dyn_bpf, *, emb, static_bpf):
    """The eager prefetch: the buffers it writes (`moved`) and the optimizer state donated, the others not."""
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return _prefetch(emb, {**moved, **kept}, opt_state, indices, offsets, bpf)
