"""`TableBatchedEmbedding`: many tables, one lookup-and-pool call.

The class holds the configuration, the storage layout and the public API (a `tbe_jax.core.SparseCore`); its
calls run the input pipeline of `tbe_jax.inputs` (checks, bounds mode, int32 narrowing) and the kernel / XLA
dispatch of `tbe_jax.dispatch` (the differentiable lookup and the fused optimizer step). `init`'s blocked draw
(`blocked_draw`, `init_rows`) is shared with `tbe_jax.sharding`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, dispatch, inputs, memory, optim, vbe
from tbe_jax.kernels import backward as bwd_kernels
from tbe_jax.kernels import forward as fwd_kernels
from tbe_jax.kernels import histogram as hist_kernels
from tbe_jax.cache_layout import checked_cache_options
from tbe_jax.inputs import as_array, id_array, static_sizes
from tbe_jax.specs import FeaturePlan, StorageLayout, TableSpec, checked_feature_table_map, checked_tables

_POOLINGS = ("sum", "mean", "none")
_BOUNDS = ("ignore", "none", "warning", "fatal")
_IMPLS = ("auto", "pallas", "xla")
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _float_dtype(name: str, value) -> jnp.dtype:
    try:
        dt = jnp.dtype(value)
    except TypeError:
        dt = None
    if dt not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {value!r}")
    return dt


class TableBatchedEmbedding:
    """Table-batched embedding bags: every feature's lookup and pooling in one call.

    Args:
      tables: the `TableSpec`s.
      feature_table_map: feature f looks up table `feature_table_map[f]`;
        default: feature f reads table f. Several features may share a table.
      pooling: "sum", "mean" (an empty bag gives zeros) or "none" (one row per
        index, in index order; all tables must have one embedding_dim).
      weights_dtype: storage dtype of the tables (float32, float16, bfloat16).
      output_dtype: dtype of the result (float32, float16, bfloat16).
      bounds_check: "ignore" (default: ids outside `[0, E_t)` contribute nothing to
        the output and update nothing, on every `impl` and device, silently),
        "warning" (the same, plus repaired offsets, with counts reported), "fatal"
        (an error naming the feature, bag and id) or "none" (no upper-bound check:
        an id >= E_t is undefined behaviour on the kernels); see `tbe_jax.bounds`.
      impl: "pallas" (the Triton kernels), "xla" (the pure-jnp reference) or
        "auto": the kernels on GPU (or when `interpret=True`), XLA elsewhere.
      interpret: run the Pallas kernels in interpret mode (CPU tests).
      kernel_config: `tbe_jax.ForwardConfig` block sizes; None for defaults.
      use_histogram: let eligible small tables take the histogram path (counts x
        table on tensor cores); see `plan()`. False forces the generic kernel.
      histogram_config: `tbe_jax.HistogramConfig`; None for defaults.
      backward_config: `tbe_jax.BackwardConfig` for the sorted-run backward kernels (`apply_gradients`,
        `tbe_jax.train_step`, `jax.grad`); None for defaults.
      cache_load_factor: tables with `location="host_cached"`: the HBM cache holds about this share of each
        such table's rows (default 0.2, as FBGEMM's); see `tbe_jax.host_cache`.
      cache_policy: which cached row a miss replaces: "lru" (default: the least recently prefetched) or
        "lfu" (the least often used since it was cached).
      cache_ways: slots per cache set (a row may live in any slot of its set; default 16).
      cache_max_fills: at most this many misses get a cache slot per `prefetch` (rows looked up more than once
        first, the rest in turns; the others are read from host memory, and a later prefetch may fill them).
        None (default): 1/16 of the batch's lookups, at least 1024.
      cache_admit_age: a miss looked up once in its batch takes only an empty slot or one unused for this many
        prefetches (default 128; 0: any), so one-off rows do not evict live ones; see `docs/host_memory.md`.
      pad_rows: store the rows of a dim whose byte length is not a multiple of 16 padded to 16 bytes when that
        costs at most 1/8 more memory (default True; e.g. fp16 D = 36, 44, ..., 124), so the kernels move them
        with 16-byte vector instructions. Only the storage buffers' shapes see it (`layout.strides`); `get_tables`,
        `set_tables`, `get_state` and every result are per table, unpadded.

    The object is immutable and hashable: pass it as a static argument to `jit`.

    Example:
      >>> import jax, jax.numpy as jnp, tbe_jax
      >>> emb = tbe_jax.TableBatchedEmbedding(
      ...     [tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)], impl="xla")
      >>> params = emb.init(jax.random.key(0))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> emb(params, indices, offsets).shape
      (2, 12)
    """

    def __new__(cls, tables=(), *args, **kwargs):
        # A model with tables behind an HBM cache is a `HostCachedEmbedding` (the same API, plus `prefetch`).
        if cls is TableBatchedEmbedding and any(getattr(t, "location", None) == "host_cached"
                                                for t in (tables if isinstance(tables, (list, tuple)) else ())):
            from tbe_jax.host_cache import HostCachedEmbedding  # it builds on this module

            cls = HostCachedEmbedding
        return super().__new__(cls)

    def __init__(
        self,
        tables: Sequence[TableSpec],
        *,
        feature_table_map: Sequence[int] | None = None,
        pooling: str = "sum",
        weights_dtype=jnp.float32,
        output_dtype=jnp.float32,
        bounds_check: str = "ignore",
        impl: str = "auto",
        interpret: bool = False,
        kernel_config: fwd_kernels.ForwardConfig | None = None,
        use_histogram: bool = True,
        histogram_config: hist_kernels.HistogramConfig | None = None,
        backward_config: bwd_kernels.BackwardConfig | None = None,
        pad_rows: bool = True,
        cache_load_factor: float = 0.2,
        cache_policy: str = "lru",
        cache_ways: int = 16,
        cache_max_fills: int | None = None,
        cache_admit_age: int = 128,
    ):
        if isinstance(tables, TableSpec):
            raise TypeError("tables must be a sequence of TableSpec (wrap a single table in a list)")
        tables = tuple(tables)
        if not tables:
            raise ValueError("tables must name at least one TableSpec")
        for i, t in enumerate(tables):
            if not isinstance(t, TableSpec):
                raise TypeError(f"tables[{i}] must be a TableSpec, got {type(t).__name__}")
        feature_table_map = checked_feature_table_map(feature_table_map, len(tables))
        for name, value, allowed in (("pooling", pooling, _POOLINGS), ("bounds_check", bounds_check, _BOUNDS),
                                     ("impl", impl, _IMPLS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if pooling == "none" and len({tables[t].embedding_dim for t in feature_table_map}) != 1:
            raise ValueError('pooling="none" needs every looked-up table to have one embedding_dim')
        if kernel_config is not None and not isinstance(kernel_config, fwd_kernels.ForwardConfig):
            raise TypeError("kernel_config must be a tbe_jax.ForwardConfig")
        self.tables = tables
        self.feature_table_map = feature_table_map
        self.pooling = pooling
        self.weights_dtype = _float_dtype("weights_dtype", weights_dtype)
        self.output_dtype = _float_dtype("output_dtype", output_dtype)
        self.bounds_check = bounds_check
        self.impl = impl
        self.interpret = bool(interpret)
        self.kernel_config = kernel_config or fwd_kernels.ForwardConfig.get_default()
        if histogram_config is not None and not isinstance(histogram_config, hist_kernels.HistogramConfig):
            raise TypeError("histogram_config must be a tbe_jax.HistogramConfig")
        self.use_histogram = bool(use_histogram)
        self.histogram_config = histogram_config or hist_kernels.HistogramConfig()
        if backward_config is not None and not isinstance(backward_config, bwd_kernels.BackwardConfig):
            raise TypeError("backward_config must be a tbe_jax.BackwardConfig")
        self.backward_config = backward_config or bwd_kernels.BackwardConfig()
        self.pad_rows = bool(pad_rows)
        (self.cache_load_factor, self.cache_policy, self.cache_ways, self.cache_max_fills,
         self.cache_admit_age) = checked_cache_options(cache_load_factor, cache_policy, cache_ways, cache_max_fills,
                                                       cache_admit_age)
        if impl == "xla" and jax.default_backend() == "gpu" and any(t.location != "device" for t in tables):
            raise ValueError("tables in host memory are read by the Pallas kernels (XLA's ops cannot read host "
                             "memory on a GPU): use impl='auto' or 'pallas'")
        # "host_cached" tables are split into two inner tables (`tbe_jax.host_cache`); here they stand as "host"
        # tables, for the feature plans of the outer batch.
        self.layout = StorageLayout.build(
            [t if t.location != "host_cached" else dataclasses.replace(t, location="host") for t in tables],
            self.weights_dtype.itemsize if self.pad_rows else None)

    # -- identity: hashable, usable as a static jit argument -------------------
    def _key(self):
        return (
            self.tables, self.feature_table_map, self.pooling, self.weights_dtype.name,
            self.output_dtype.name, self.bounds_check, self.impl, self.interpret, self.kernel_config,
            self.use_histogram, self.histogram_config, self.backward_config, self.pad_rows,
            self.cache_load_factor, self.cache_policy, self.cache_ways, self.cache_max_fills, self.cache_admit_age,
        )

    # A static argument of every jitted call: hashed and compared on each call, so the hash is computed once
    # (the object is immutable) and an object equals itself without comparing its fields.
    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._key())
            self.__dict__["_hash"] = h
        return h

    def __eq__(self, other):
        if other is self:
            return True
        return isinstance(other, TableBatchedEmbedding) and hash(self) == hash(other) and self._key() == other._key()

    def __repr__(self):
        dims = sorted({t.embedding_dim for t in self.tables})
        return (
            f"TableBatchedEmbedding({len(self.tables)} tables, {self.num_features} features, "
            f"dims={dims}, pooling={self.pooling!r}, weights_dtype={self.weights_dtype.name}, "
            f"impl={self.impl!r})"
        )

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def feature_dims(self) -> tuple[int, ...]:
        return tuple(self.tables[t].embedding_dim for t in self.feature_table_map)

    def plan(self, *, weighted: bool = False, vbe: bool = False, backward: bool = False) -> tuple[str, ...]:
        """Per feature, the kernel path its forward takes: "histogram", "generic" or "auto".

        A feature can take the small-table histogram path (counts x table) when its
        table has E <= 64 and 64 <= D <= 128, weights are fp16, output fp32, pooling
        is sum or mean, and the call is unweighted and without VBE (pass `weighted=` /
        `vbe=` to see the plan for such calls). Such a feature's backward always
        takes the histogram kernels (`backward=True` shows the backward's plan:
        "histogram" or "generic"). Its forward takes them when the table's
        `bag_size_hint` is >= 64, the generic kernel when the hint is smaller, and
        without a hint ("auto") the choice is made on the device for each batch:
        the histogram kernel when the feature's mean bag length is >= 64 ids (both
        forward kernels are launched; each does nothing for the features the other
        computes, so nothing syncs with the host or recompiles).

        Decided statically. On the XLA path (`impl="xla"`, or "auto" on CPU) no kernel
        runs, but the plan still says what the kernels would do.
        """
        ok = self.use_histogram and self.pooling != "none" and not weighted and not vbe
        out = []
        for t in self.feature_table_map:
            if not (ok and self.tables[t].location == "device"
                    and hist_kernels.eligible(self.tables[t], self.weights_dtype, self.output_dtype)):
                out.append("generic")
            elif backward:
                out.append("histogram")
            else:
                out.append(hist_kernels.forward_mode(self.tables[t]))
        return tuple(out)

    # -- parameters -------------------------------------------------------------
    def init(self, key: jax.Array) -> dict:
        """Tables drawn uniform in `[-1/sqrt(E_t), 1/sqrt(E_t)]` (FBGEMM's default).

        One jitted program per storage buffer, whatever the number of tables: each row's bound comes from its
        table's size (a per-table array, repeated on the device). A buffer of more than `INIT_BLOCK` elements is
        drawn in blocks of rows, each into place (in host memory for a host buffer), so the scratch memory is
        one block's (`blocked_draw`).
        """
        out, lay = {}, self.layout
        for g in range(len(lay.dims)):
            rows = tuple(spec.num_embeddings for t, spec in enumerate(self.tables) if lay.table_group[t] == g)
            out[lay.key(g)] = _init_buffer(jax.random.fold_in(key, g), rows, lay.dims[g], lay.strides[g],
                                           self.weights_dtype.name, lay.on_host(g))
        return out

    def get_tables(self, params: dict) -> list[jax.Array]:
        """Per table, its `[E_t, D_t]` array in `weights_dtype`."""
        self.check_params(params, check_dtype=False)  # also used on gradients / casts of the params
        out = []
        for t, spec in enumerate(self.tables):
            g = self.layout.table_group[t]
            r0 = self.layout.table_row_offset[t]
            out.append(self.layout.unpad(g, memory.rows(params[self.layout.key(g)], r0, spec.num_embeddings)))
        return out

    def set_tables(self, params: dict | None, tables: Sequence[jax.Array]) -> dict:
        """Params holding `tables` (one `[E_t, D_t]` array per table), cast to weights_dtype."""
        return self.pack([jnp.asarray(arr, self.weights_dtype) for arr in checked_tables(self.tables, tables)])

    def pack(self, per_table: Sequence[jax.Array]) -> dict:
        """Storage buffers from one array per table (`[E_t, D_t]`, or `[E_t]` for a row-wise state field):
        stacked per buffer, element-wise ones zero-padded to the buffer's stride. `set_tables` without the
        checks and the cast; also packs an optimizer state's field (`get_state`'s per-table arrays)."""
        groups: list[list] = [[] for _ in self.layout.dims]
        for t, arr in enumerate(per_table):
            groups[self.layout.table_group[t]].append(arr)
        out = {}
        for g, parts in enumerate(groups):
            if self.layout.on_host(g) and inputs.is_concrete(*parts):  # stacked on the host, placed there
                parts = [memory.to_numpy(p) for p in parts]
                buf = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
                extra = self.layout.strides[g] - self.layout.dims[g]
                if buf.ndim == 2 and extra:
                    buf = np.pad(buf, ((0, 0), (0, extra)))
                out[self.layout.key(g)] = memory.to_host(buf)
                continue
            buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
            buf = buf if buf.ndim == 1 else self.layout.pad(g, buf)
            out[self.layout.key(g)] = memory.keep_on_host(buf) if self.layout.on_host(g) else buf
        return out

    # -- forward -----------------------------------------------------------------
    def plan_for(self, num_offsets: int, batch_size_per_feature=None) -> FeaturePlan:
        """The static feature plan for an `offsets` of `num_offsets` entries."""
        nf = self.num_features
        if batch_size_per_feature is None:
            if (num_offsets - 1) % nf or num_offsets < 1:
                raise ValueError(
                    f"offsets has {num_offsets} entries; expected F*B+1 with F={nf} features"
                )
            batch = [(num_offsets - 1) // nf] * nf
            vbe = False
        else:
            batch = list(static_sizes(batch_size_per_feature))
            if len(batch) != nf or any(b < 0 for b in batch):
                raise ValueError(
                    f"batch_size_per_feature must give {nf} non-negative sizes, got {tuple(batch_size_per_feature)}"
                )
            if num_offsets != sum(batch) + 1:
                raise ValueError(
                    f"offsets has {num_offsets} entries; batch_size_per_feature needs sum(B_f)+1={sum(batch) + 1}"
                )
            vbe = True
        return FeaturePlan.build(self.tables, self.layout, self.feature_table_map, batch, vbe)

    def uses_kernel(self) -> bool:
        """Whether lookups and updates run the Pallas kernels (False: the XLA reference path); see `impl`.
        Raises for `impl="pallas"` without a GPU or `interpret=True`."""
        on_gpu = jax.default_backend() == "gpu"
        if self.impl == "auto":
            return self.interpret or on_gpu
        if self.impl == "pallas" and not (on_gpu or self.interpret):
            raise ValueError(
                f"impl='pallas' compiles Triton kernels, which needs a GPU (backend is "
                f"{jax.default_backend()!r}); pass interpret=True to run them on the CPU, or impl='auto'"
            )
        return self.impl == "pallas"

    def bounds_report(self, indices, offsets, *, batch_size_per_feature=None,
                      max_batch_size=None) -> bounds.BoundsReport:
        """Counts of bad ids and of the offsets entries `bounds_check="warning"` would repair (jittable, device
        values; XLA passes, no lookup)."""
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        indices = id_array("indices", as_array("indices", indices))
        offsets = id_array("offsets", as_array("offsets", offsets))
        offsets, size_fix = inputs.expand(self, offsets, bpf)
        plan = self.plan_for(offsets.shape[0], None if size_fix is not None else bpf)
        rep = bounds.report(plan, indices, offsets)[1]
        return inputs.add_size_fix(rep, size_fix)

    def __call__(self, params, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        """Look up and pool.

        Args:
          params: from `init` / `set_tables`.
          indices: `[N]` int32 ids (int64 accepted with jax x64 enabled; integer
            types narrower than 32 bits are widened to int32; unsigned 32/64-bit ids
            are refused, and so are NumPy int64 ids outside int32 while x64 is off,
            which JAX would otherwise wrap into int32).
          offsets: `[F*B+1]` bag boundaries, feature-major (bag b of feature f is
            `indices[offsets[f*B+b]:offsets[f*B+b+1]]`); with VBE, `[sum B_f + 1]`.
            Same integer types as `indices` (unsigned offsets are accepted).
          per_sample_weights: optional `[N]` float weights, one per index.
          batch_size_per_feature: variable batch size per feature (VBE): a static
            tuple of B_f, or (with `max_batch_size`) an int array `[F]` that may be
            traced (see `tbe_jax.vbe`).
          max_batch_size: static bound M on every B_f when the sizes are an array.

        Returns:
          `[B, sum_f D_f]` (feature f's columns contiguous, in feature order); with
          a static VBE tuple a flat array holding each feature's `[B_f, D_f]` block
          row-major; with array sizes `[M, sum_f D_f]` (feature f's rows past B_f
          are zero); with `pooling="none"`, `[N, D]`.
        """
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            return dispatch.jit_forward(*dispatch.eager_args(indices, offsets, per_sample_weights, bpf), params,
                                        emb=self, static_bpf=dispatch.static_bpf(bpf), warn=True)[0]
        return dispatch.forward(self, params, indices, offsets, per_sample_weights, bpf, warn=True)[0]

    def forward_with_report(self, params, indices, offsets, per_sample_weights=None, *,
                            batch_size_per_feature=None, max_batch_size=None):
        """`(out, BoundsReport)`: the lookup, and the ids it skipped and the malformed offsets entries it met.

        Counted in every mode but "fatal" (which raises instead: zeros); in "warning" mode
        `repaired_offsets` counts the entries its repair changed. Unlike `emb(...)` in warning
        mode, this issues no host callback (no synchronisation inside a jitted step): the counts
        stay on the device until you read them. The pooled kernels count as they load: a plain
        `emb(...)` does not, and is the faster call when the counts are not wanted.
        """
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            return dispatch.jit_forward(*dispatch.eager_args(indices, offsets, per_sample_weights, bpf), params,
                                        emb=self, static_bpf=dispatch.static_bpf(bpf), warn=False)
        return dispatch.forward(self, params, indices, offsets, per_sample_weights, bpf, warn=False)

    def _eager(self, *args) -> bool:
        """Called outside any trace: run the call as one jitted program (compiled once per shape) instead of
        op by op. Not in "fatal" mode, whose concrete-input checks raise at once from the host."""
        return self.bounds_check != "fatal" and inputs.is_concrete(*jax.tree_util.tree_leaves(args))

    # -- optimizer step ---------------------------------------------------------------
    def init_opt_state(self, params: dict, opt):
        """The state of `opt` for these tables, per storage buffer like `params`: `SGDState(count)`,
        `RowwiseAdagradState(momentum, count)` (one fp32 value per row), `AdagradState(momentum, count)`
        (one per element) or `AdamState(momentum1, momentum2, count)` (Adam, LAMB and their partial
        row-wise forms); see `tbe_jax.optim`."""
        self.check_optimizer(opt)
        self.check_params(params)
        host = {self.layout.key(g) for g in range(len(self.layout.dims)) if self.layout.on_host(g)}
        state = opt.init({k: v for k, v in params.items() if k not in host})
        if not host:
            return state
        host_slots = memory.host_opt_slots(opt, {k: params[k] for k in host})  # made in host memory
        return opt.state_type(*[{**d, **h} for d, h in zip(opt.slots(state), host_slots)], state.count)

    def get_state(self, opt_state, name: str) -> list[jax.Array]:
        """Per table, its slice of the optimizer state's field `name` (`"momentum"`, `"momentum1"` or
        `"momentum2"`): `[E_t]` for a row-wise field, `[E_t, D_t]` for an element-wise one."""
        fields = [f for f in getattr(opt_state, "_fields", ()) if f != "count"]
        if name not in fields:
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: its state fields are {fields}, "
                             f"not {name!r}")
        tree = getattr(opt_state, name)
        out = []
        for t, spec in enumerate(self.tables):
            g = self.layout.table_group[t]
            buf = tree[self.layout.key(g)]
            r0 = self.layout.table_row_offset[t]
            part = memory.rows(buf, r0, spec.num_embeddings)
            out.append(part if part.ndim == 1 else self.layout.unpad(g, part))
        return out

    def get_momentum(self, opt_state) -> list[jax.Array]:
        """Per table, its Adagrad accumulators (`[E_t]` row-wise, `[E_t, D_t]` element-wise); for an
        `AdamState` use `get_state(opt_state, "momentum1")` / `"momentum2"`."""
        if not isinstance(opt_state, (optim.RowwiseAdagradState, optim.AdagradState)):
            raise ValueError(
                f"opt_state is a {type(opt_state).__name__}: it holds no Adagrad accumulators"
                + (" (use emb.get_state(opt_state, 'momentum1') or 'momentum2')"
                   if isinstance(opt_state, optim.AdamState) else ""))
        return self.get_state(opt_state, "momentum")

    def check_optimizer(self, opt) -> None:
        """Raises TypeError unless `opt` is an optimizer of `tbe_jax.optim` (every one of them applies here)."""
        if not isinstance(opt, optim.Optimizer):
            raise TypeError(
                f"opt must be a tbe_jax optimizer (tbe_jax.RowwiseAdagrad(...), SGD, Adagrad, Adam, "
                f"PartialRowwiseAdam, Lamb or PartialRowwiseLamb), got {type(opt).__name__}")

    def check_params(self, params, check_dtype: bool = True) -> None:
        """Raises unless `params` are this embedding's storage buffers (`init`'s / `set_tables`' dict: its keys,
        shapes and, with `check_dtype`, `weights_dtype`). Static (shapes and dtypes): free under `jit`."""
        if not isinstance(params, dict if check_dtype else Mapping):
            raise TypeError(f"params must be the dict emb.init/set_tables return, got {type(params).__name__}")
        want = {self.layout.key(g) for g in range(len(self.layout.dims))}
        if set(params) != want:
            raise ValueError(f"params hold buffers {sorted(params)}; this embedding's are {sorted(want)} "
                             "(build them with emb.init or emb.set_tables)")
        for g in range(len(self.layout.dims)):
            key = self.layout.key(g)
            shape = self.layout.shape(g)
            if not (hasattr(params[key], "shape") and hasattr(params[key], "dtype")):
                raise TypeError(f"params[{key!r}] must be an array ({self.weights_dtype.name}{list(shape)}), got "
                                f"{type(params[key]).__name__}")
            if tuple(params[key].shape) != shape or (check_dtype and params[key].dtype != self.weights_dtype):
                hint = ""
                if tuple(params[key].shape) == (shape[0], self.layout.dims[g]) != shape:
                    hint = (f" (rows of {self.layout.dims[g]} values are stored padded to {shape[1]}: "
                            "emb.set_tables(None, tables) converts per-table arrays; params saved unpadded load "
                            "into TableBatchedEmbedding(..., pad_rows=False))")
                raise ValueError(
                    f"params[{key!r}] must be {self.weights_dtype.name}{list(shape)}, "
                    f"got {params[key].dtype}{list(params[key].shape)}" + hint
                )

    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None, *,
                        batch_size_per_feature=None, max_batch_size=None, backward_config=None):
        """One optimizer step on the rows looked up by this batch: returns `(params, opt_state)`.

        `grad_output` is the gradient of the loss with respect to this batch's
        output (the shape `emb(...)` returned). Every (table, row) in the batch is
        updated exactly once with `opt` (see `tbe_jax.optim`); other rows are not
        touched. `opt`'s hyperparameters are read at run time (pass `opt` as an
        ordinary argument of a jitted step: a new learning rate, or a schedule's
        next value, does not recompile); `opt_state.count` goes up by one.

        With the Pallas path the tables and the accumulators are updated in place
        (input/output aliasing): donate them (`jax.jit(..., donate_argnums=...)`) so
        XLA need not copy them first. `backward_config` overrides the one given
        to the constructor. `tbe_jax.train_step` wraps the lookup, the loss
        gradient and this step in one call.
        """
        if grad_output is None:
            raise TypeError("grad_output must be an array shaped like this batch's output, got None")
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf):
            self.check_optimizer(opt)
            idx, off, psw, dyn = dispatch.eager_args(indices, offsets, per_sample_weights, bpf)
            return dispatch.jit_apply(idx, off, psw, dyn, params, opt_state, opt, jnp.asarray(grad_output),
                                      emb=self, static_bpf=dispatch.static_bpf(bpf), backward_config=backward_config)
        return dispatch.apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output,
                                        per_sample_weights, bpf, backward_config)

    # -- the training step's halves (tbe_jax.train_step; `tbe_jax.core.SparseCore`) -----------------
    def shard(self, mesh, axis_name: str = "data", plan=None, *, capacity=None, warn_overflow: bool = True,
              comm_dtype=None):
        """These tables spread over `mesh`'s axis `axis_name`: `tbe_jax.shard(self, mesh, axis_name, plan, ...)`
        (a `ShardedTableBatchedEmbedding`)."""
        from tbe_jax.sharding import shard  # tbe_jax.sharding builds on this module

        return shard(self, mesh, axis_name, plan, capacity=capacity, warn_overflow=warn_overflow,
                     comm_dtype=comm_dtype)

    def step_forward(self, params, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                     max_batch_size=None):
        """The lookup, and what `step_update` needs of it: `(out, residuals)` (the batch as checked here, the
        forward's report and, with `BackwardConfig.sort_in_forward` on the kernel path, the batch's sorted runs)."""
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            out, report, idx, off, psw, runs = dispatch.jit_step_forward(
                *dispatch.eager_args(indices, offsets, per_sample_weights, bpf), params, emb=self,
                static_bpf=dispatch.static_bpf(bpf))
        else:
            out, report, idx, off, psw, runs = dispatch.step_forward(self, params, indices, offsets,
                                                                     per_sample_weights, bpf)
        # Array batch sizes are applied to `off` already (the fixed-batch form): the update's plan needs no sizes.
        static = None if isinstance(bpf, vbe.VariableBatchSizes) else bpf
        return out, (idx, off, psw, static, report, runs)

    def step_update(self, params, opt_state, opt, residuals, grad_output):
        """`apply_gradients` on `step_forward`'s batch: `(params, opt_state, invalid_indices)`."""
        return dispatch.step_update(self, params, opt_state, opt, residuals, grad_output)


# Elements drawn at a time by `init`: a larger buffer is drawn block by block into its place, so init's scratch
# memory is one block's (XLA keeps a draw's random bits and fp32 values: 8.2 GB for a 1 GB fp16 buffer on a CPU).
INIT_BLOCK = 1 << 24


def _init_buffer(key, rows: tuple, dim: int, stride: int, dtype: str, host: bool = False):
    """One storage buffer: rows of table t uniform in +-1/sqrt(E_t), its padding columns (past `dim`) zero. A
    buffer of at most INIT_BLOCK elements is one draw (the values are those of the unpadded buffer's draw), a
    larger one blocks of rows, block i from `fold_in(key, i)`; `host`: placed in host memory (a large one written
    there block by block, never whole in the GPU's memory). The per-table arrays are arguments, not constants,
    so XLA does not constant-fold a buffer-sized row -> table map at compile time."""
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int32))
    bounds = jnp.asarray((1.0 / np.sqrt(np.asarray(rows, np.float64))).astype(np.float32))
    block = max(1, INIT_BLOCK // max(dim, 1))
    if host and sum(rows) > block:
        return memory.host_blocks((sum(rows), stride), dtype, block, key,
                                  lambda k, r0: _init_block(k, starts, bounds, r0, block, dim, stride, dtype))
    buf = _init_draw(key, starts, bounds, sum(rows), dim, stride, dtype, block)
    return memory.to_host(buf) if host else buf


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _init_draw(key, starts, bounds, num_rows: int, dim: int, stride: int, dtype: str, block: int):
    return blocked_draw(key, num_rows, stride, dtype, block,
                        lambda k, r0, n: init_rows(k, starts, bounds, r0, n, dim, stride, dtype))


def blocked_draw(key, num_rows: int, width: int, dtype, block: int, draw):
    """A `[num_rows, width]` array from `draw(key, r0, n)` (rows [r0, r0 + n)): one call if it has at most
    `block` rows, else blocks of `block` rows written into place by a device loop, block i drawn with
    `fold_in(key, i)` (the last block ends at the last row and may redraw rows of the one before). The scratch
    memory is then that of one block's draw. Traced (call it under `jit`)."""
    if num_rows <= block:
        return draw(key, 0, num_rows)

    def one(i, w):
        r0 = jnp.minimum(i * block, num_rows - block)
        return jax.lax.dynamic_update_slice(w, draw(jax.random.fold_in(key, i), r0, block), (r0, jnp.int32(0)))

    # Block 0 outside the loop: the carry then has the draws' type (under `shard_map`, varying over the mesh axis
    # when the key is), not that of a constant zero array.
    w0 = one(0, jnp.zeros((num_rows, width), dtype))
    return jax.lax.fori_loop(1, -(-num_rows // block), one, w0)


def init_rows(key, starts, bounds, r0, n: int, dim: int, stride: int, dtype):
    """Rows [r0, r0 + n) of a buffer whose table t starts at row `starts[t]`: uniform in +-`bounds[t]` of each
    row's table (rows past the last start take the last bound), padded with zeros to `stride` columns."""
    row = r0 + jax.lax.iota(jnp.int32, n)
    table = jnp.clip(jnp.searchsorted(starts, row, side="right", method="scan_unrolled") - 1, 0, starts.shape[0] - 1)
    u = jax.random.uniform(key, (n, dim), jnp.float32, -1.0, 1.0)
    w = (u * bounds[table][:, None]).astype(dtype)
    return w if stride == dim else jnp.pad(w, ((0, 0), (0, stride - dim)))


_init_block = jax.jit(init_rows, static_argnums=(4, 5, 6, 7))  # one block of `blocked_draw`, its start traced
