"""Tables in host memory with an HBM row cache: `TableSpec(..., location="host_cached")` (issue 40).

A `TableBatchedEmbedding` holding such tables is a `HostCachedEmbedding`. Each cached table `t` (E_t rows) is
kept twice over, as two tables of an inner `TableBatchedEmbedding` (`emb.inner`, whose kernels do all the work):

- its *host part*: all E_t rows, in pinned host memory (`location="host"`: the kernels read and write its rows
  in place over the bus);
- its *cache part*: C_t = `ways * ceil(cache_load_factor * E_t / ways)` rows in HBM, set-associative (row r may
  live in one of the `ways` slots of set `hash(r) % (C_t / ways)`), with the directory in `params["cache"]`:
  `slot_of_row` (per cached row its slot or -1: 4 bytes per row, in HBM), `row_of_slot`, per slot the tick of
  the last prefetch that used it (`stamp`: LRU's rank), its use count since the fill (`score`: LFU's rank; unused
  under LRU), and two bits (below).

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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import dispatch, memory, vbe
from tbe_jax.cache_layout import CACHE, STATE_ROWS, STATS, split_tables
from tbe_jax.cache_prefetch import prefetch_impl
from tbe_jax.cache_route import after_update, apply_impl, inner_grad, lookup, step_forward_impl
from tbe_jax.specs import FeaturePlan, checked_tables
from tbe_jax.tbe import TableBatchedEmbedding


class HostCachedEmbedding(TableBatchedEmbedding):
    """A `TableBatchedEmbedding` with tables in host memory behind an HBM cache (see the module doc).

    Built by `TableBatchedEmbedding(tables, ...)` when a table has `location="host_cached"`: the same API, plus
    `prefetch` and `cache_stats`. `inner` is the `TableBatchedEmbedding` of its storage (each cached table's cache
    and host parts, the other tables as given); `layout` is `inner.layout` (the buffers of `params`, besides
    `params["cache"]`); `cache_layout` the cached tables' sets and slots; `inner_of[t]` table t's inner table
    (a cached table's cache part).
    """

    def __init__(self, tables, **kwargs):
        super().__init__(tables, **kwargs)
        if self.pooling == "none" and len({t.embedding_dim for t in self.tables}) != 1:
            raise ValueError('pooling="none" needs every table to have one embedding_dim')
        inner_tables, self.cache_layout, self.inner_of = split_tables(self.tables, self.cache_load_factor,
                                                                     self.cache_ways)
        cl = self.cache_layout
        extra = [cl.host_part[cl.tables.index(t)] for t in self.feature_table_map if t in cl.tables]
        fmap = tuple(self.inner_of[t] for t in self.feature_table_map) + tuple(extra)
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

    def dir_shapes(self) -> dict:
        """The directory's arrays (`params["cache"]`) and their shapes."""
        r, c = self.cache_layout.total_rows, self.cache_layout.total_slots
        return {"slot_of_row": (r,), "row_of_slot": (c,), "score": (c,), "stamp": (c,), "dirty": (c,),
                "state_ok": (c,), "tick": (), "stats": (len(STATS),)}

    def empty_cache(self) -> dict:
        """A directory with every slot empty (what `init` and `set_tables` start from)."""
        shapes = self.dir_shapes()
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
        shapes = self.dir_shapes()
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

    def inner_params(self, params) -> dict:
        return {k: v for k, v in params.items() if k != CACHE}

    def get_tables(self, params) -> list:
        """Per table its `[E_t, D_t]` rows: a cached table's host rows with the cache's rows over them."""
        self.check_params(params, check_dtype=False)
        parts = self.inner.get_tables(self.inner_params(params))
        return [self._merged(params[CACHE]["row_of_slot"], parts, t) for t in range(len(self.tables))]

    def _merged(self, slot_rows, parts, t):
        """Table t's values: a plain table's inner table, a cached one's host part with its cached rows over it
        (`parts`: per inner table its per-row values, rows or a state field)."""
        cl = self.cache_layout
        if t not in cl.tables:
            return parts[self.inner_of[t]]
        i = cl.tables.index(t)
        base = memory.to_numpy(parts[cl.host_part[i]])
        base = base if base.flags.writeable else base.copy()  # a host buffer's rows come back as a fresh array
        cache = memory.to_numpy(parts[cl.cache_part[i]])
        s0, s1 = int(cl.base("slots")[i]), int(cl.base("slots")[i + 1])
        rows = memory.to_numpy(slot_rows)[s0:s1] - int(cl.base("rows")[i])
        live = rows >= 0
        base[rows[live]] = cache[np.flatnonzero(live)]
        return base

    def set_tables(self, params, tables) -> dict:
        """Params holding `tables` (in their host parts; the cache empty), cast to weights_dtype."""
        inner = self.inner_values(checked_tables(self.tables, tables))
        return {**self.inner.set_tables(None, inner), CACHE: self.empty_cache()}

    def inner_values(self, values) -> list:
        """Per inner table its values, from one array per table (rows, or a state field's): a cached table's in
        its host part, its cache part zeros (an empty cache)."""
        cl = self.cache_layout
        inner = [None] * len(self.inner.tables)
        for t, v in enumerate(values):
            if t in cl.tables:
                i = cl.tables.index(t)
                inner[cl.host_part[i]] = v
                inner[cl.cache_part[i]] = np.zeros((cl.slots[i],) + tuple(v.shape[1:]), v.dtype)
            else:
                inner[self.inner_of[t]] = v
        return inner

    def init_opt_state(self, params, opt):
        """The inner tables' state, each slot with its `"cache_rows"` (no cache slot holds a state yet)."""
        self.check_optimizer(opt)
        self.check_params(params)
        state = self.inner.init_opt_state(self.inner_params(params), opt)
        c = self.cache_layout.total_slots  # one array per slot (a donated state holds no array twice)
        return opt.state_type(*[{**d, STATE_ROWS: jnp.full((c,), -1, jnp.int32)} for d in opt.slots(state)],
                              state.count)

    def inner_state(self, opt_state):
        fields = getattr(opt_state, "_fields", ())
        slots = [{k: v for k, v in getattr(opt_state, f).items() if k != STATE_ROWS} for f in fields[:-1]]
        return type(opt_state)(*slots, opt_state.count)

    def outer_state(self, inner_state, like):
        fields = getattr(like, "_fields", ())
        return type(like)(*[{**getattr(inner_state, f), STATE_ROWS: getattr(like, f)[STATE_ROWS]}
                            for f in fields[:-1]], inner_state.count)

    def get_state(self, opt_state, name: str) -> list:
        """Per table its slice of the state field `name`, a cached table's host states with the cache's over
        them."""
        parts = self.inner.get_state(self.inner_state(opt_state), name)
        rows = getattr(opt_state, name)[STATE_ROWS]
        return [self._merged(rows, parts, t) for t in range(len(self.tables))]

    def written_buffers(self) -> frozenset:
        """The keys of `params` a prefetch writes: the cache directory and the buffers of the cached tables' two
        parts (the ones to donate)."""
        lay, cl = self.inner.layout, self.cache_layout
        return frozenset([CACHE] + [lay.key(lay.table_group[i]) for i in cl.cache_part + cl.host_part])

    def cache_stats(self, params) -> dict:
        """The last prefetch's counts (device scalars): rows `requested` (distinct cached rows of the batch),
        `hits` (of those, the ones already cached), `fills` (rows copied in), `writebacks` (changed rows copied
        out), `lookups` (the batch's lookups of cached tables) and `lookup_hits` (those whose row was already
        cached: `lookup_hits / lookups` is the hit rate FBGEMM reports) and `host_lookups` (those whose row the
        prefetch neither found nor filled: the step reads them from host memory, over the bus)."""
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
        return dispatch.forward(self, params, indices, offsets, psw, bpf, warn, lookup=lookup)

    def step_forward(self, params, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                     max_batch_size=None):
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            idx, off, w, dyn = dispatch.eager_args(indices, offsets, per_sample_weights, bpf)
            return _jit_step_forward(idx, off, w, dyn, params, emb=self, static_bpf=dispatch.static_bpf(bpf))
        return step_forward_impl(self, params, indices, offsets, per_sample_weights, bpf)

    def step_update(self, params, opt_state, opt, residuals, grad_output):
        self.check_optimizer(opt)
        inner_res, touched, drop = residuals["inner"], residuals["touched"], residuals["drop"]
        inner_p, inner_s, invalid = self.inner.step_update(
            self.inner_params(params), self.inner_state(opt_state), opt, inner_res,
            inner_grad(self, residuals["facts"], grad_output, residuals["n"].value))
        d = after_update(params[CACHE], touched, drop)
        return {**inner_p, CACHE: d}, self.outer_state(inner_s, opt_state), residuals["invalid"]

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
        return apply_impl(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf,
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
        return prefetch_impl(self, params, opt_state, indices, offsets, bpf)


# -- eager calls: one jitted program each -------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("emb", "static_bpf", "warn"))
def _jit_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, emb, static_bpf, warn):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return dispatch.forward(emb, params, indices, offsets, per_sample_weights, bpf, warn, lookup=lookup)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf"))
def _jit_step_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, emb, static_bpf):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return step_forward_impl(emb, params, indices, offsets, per_sample_weights, bpf)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf", "backward_config"))
def _jit_apply(indices, offsets, per_sample_weights, dyn_bpf, params, opt_state, opt, grad_output, *, emb,
               static_bpf, backward_config):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return apply_impl(emb, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf,
                  backward_config)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf"), donate_argnums=(0, 2))
def _jit_prefetch(moved, kept, opt_state, indices, offsets, dyn_bpf, *, emb, static_bpf):
    """The eager prefetch: the buffers it writes (`moved`) and the optimizer state donated, the others not."""
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return prefetch_impl(emb, {**moved, **kept}, opt_state, indices, offsets, bpf)
