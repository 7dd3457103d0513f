"""Tables sharded over the devices of a mesh: `tbe_jax.shard(emb, mesh, axis_name)`.

Each table gets one strategy (`ShardedTableBatchedEmbedding.plan`):

- `"table"`: the whole table on one device (its owner);
- `"row"`: rows split in `ceil(E / n)` blocks, block j on device j;
- `"column"`: columns split in `ceil(D / n)` blocks, block j on device j;
- `"data"`: a full copy on every device (data parallel: each device looks up its own samples).

How a step runs (inside one `shard_map` over `axis_name`; XLA collectives, NCCL on GPUs):

1. Ids to their owners (replicated tables: see below). Each device looks at its local batch and, per destination
   device, keeps the ids that destination serves (its table, its row block, its
   columns), translated to rows of the destination's storage, packed in feature
   order, with each bag's length. One `all_to_all` carries ids, lengths (and
   per-sample weights) to the owners. Capacities are static: by default each
   destination gets room for every local id, so nothing can be dropped; a smaller
   `capacity` moves fewer bytes and any id past it is dropped, counted, and warned
   about (`forward_with_report` returns the count). A pipeline that knows the most
   ids each feature can hold per local batch passes those counts as `capacity`,
   and the capacity becomes the placement's exact worst case (on n devices with
   table-wise placement, about 1/n of the ids instead of all of them).
2. The owners look up. Each device runs one local `TableBatchedEmbedding` (the
   same Pallas kernels) over the global batch's ids for its shards: every device
   holds the same number of "slots" (a feature read through one of its shards)
   per storage width, so the program is the same on every device and the storage
   per device is one buffer per width (`[n * rows, D]`, sharded by rows).
3. Pooled rows back. One `all_to_all` returns each sample's pooled rows to its
   device; partial pools of row-wise tables are summed there (owner order: fixed,
   deterministic), column blocks are put side by side, mean pooling divides by
   the bag length last, as the unsharded kernels do.
4. Backward: the output gradient goes the same way as the ids (one `all_to_all`),
   and each owner runs the fused sorted-run backward and optimizer on its shards,
   once per touched row with the whole global batch's gradient.

Replicated (`"data"`) tables are not routed: each device looks them up for its own samples only, in its own copy
(`s.local_data`, over the same buffers; a replicated table sits at the same buffer rows on every device), and
writes those columns of its output itself. In the update each device sums its local batch's gradient per touched
row into a fixed-size list of (row, gradient row) pairs (one entry per local id at most), one `all_gather` over the
axis gives every device all n lists, and every device sums them in device order and applies the optimizer to those
rows (`tbe_jax.shard_programs._data_update`, the XLA sparse path `tbe_jax.sparse_update.update_rows`, also where
the routed tables run the fused kernels). The copies stay bitwise identical (the same program on the same values);
against the unsharded update the sum of per-device sums is another order of the same additions (fp32 rounding).

Column-wise tables take every optimizer. Row-wise Adagrad, the partial row-wise
Adams and the LAMBs reduce over a whole row, which no column block holds: each
block sums its columns' part of the statistic and one `psum` over the axis adds
the parts before the update (`tbe_jax.shard_programs._column_update`; the row-wise
state is kept, identical, on every block of its table). Equal to the unsharded
update to fp32 rounding; that step's update runs on the XLA sparse path on every
device (the fused kernels keep the statistic inside the kernel).

Where the parts live: this module, the class (configuration, checks, the public API: a
`tbe_jax.core.SparseCore`); `tbe_jax.shard_plan`, the placement; `tbe_jax.shard_route`, the per-device
routing of steps 1, 3 and 4 (pure functions of a device's arrays, no mesh needed on one device);
`tbe_jax.shard_programs`, the `shard_map` programs; `tbe_jax.shard_checkpoint`, the conversions to and
from per-table arrays (`to_unsharded`, `from_unsharded`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tbe_jax import bounds, memory, optim, shard_checkpoint, shard_programs
from tbe_jax import tbe as tbe_module
from tbe_jax.cache_layout import CACHE, STATE_ROWS, STATS
from tbe_jax.inputs import check_weights, narrow_ids, widen_ids
from tbe_jax.shard_plan import STRATEGIES, ShardingPlan, ShardLayout, as_int, plan_sharding
from tbe_jax.specs import TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

__all__ = ["STRATEGIES", "ShardedTableBatchedEmbedding", "ShardingPlan", "plan_sharding", "shard"]


def shard(emb: TableBatchedEmbedding, mesh: jax.sharding.Mesh, axis_name: str = "data", plan=None, *,
          capacity: int | Sequence[int] | None = None, warn_overflow: bool = True,
          comm_dtype=None) -> "ShardedTableBatchedEmbedding":
    """`emb`'s tables sharded over `mesh`'s axis `axis_name`; see `ShardedTableBatchedEmbedding`."""
    return ShardedTableBatchedEmbedding(emb, mesh, axis_name, plan, capacity=capacity, warn_overflow=warn_overflow,
                                        comm_dtype=comm_dtype)


class ShardedTableBatchedEmbedding:
    """A `TableBatchedEmbedding` whose tables are spread over the devices of a mesh axis.

    Args:
      emb: the unsharded embedding (tables, features, pooling, dtypes, kernels).
      mesh: a `jax.sharding.Mesh`; `axis_name` names the axis the batch and the
        tables are split over (n = its size).
      plan: None (the planner, `plan_sharding`), a `ShardingPlan`, or a dict
        `{table index or name: "table" | "row" | "column" | "data" | ("table", device)}`
        fixing some tables (the planner places the rest), one strategy for every
        table (e.g. "row"), or a list of one strategy per table.
      capacity: ids each device may send to each other device per step; None (the
        default) is every local id, which can never overflow. Ids past a smaller
        capacity are dropped, counted (`forward_with_report`) and warned about.
        A sequence of F ints instead (`feature_capacity`) says how many ids of each
        feature one device's local batch holds at most (e.g. its samples times its
        longest bag, which a pipeline padding each feature to a fixed length knows):
        the capacity is then the most any device can receive with this plan,
        `max_j sum(feature_capacity[f] for the features device j serves)`, capped
        by the local batch's length. It moves only what the placement can route
        (about 1/n of the ids with table-wise placement, where the default moves them
        all), and it drops nothing while every batch keeps to the counts; a batch
        that does not is counted and warned about as above.

    Inputs are per device: `indices [n, N]`, `offsets [n, F*b + 1]` (row k is device
    k's local batch of b samples in `emb`'s format), both sharded over `axis_name`;
    the output is `[n*b, sum D]` (sample i of device k at row `k*b + i`), sharded
    likewise. Results equal `emb` on the global batch (device 0's samples first).
    """

    def __init__(self, emb, mesh, axis_name="data", plan=None, *, capacity=None, warn_overflow=True,
                 comm_dtype=None):
        if not isinstance(emb, TableBatchedEmbedding):
            raise TypeError(f"emb must be a tbe_jax.TableBatchedEmbedding, got {type(emb).__name__}")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        n = int(mesh.shape[axis_name])
        if not isinstance(plan, ShardingPlan):
            plan = plan_sharding(emb, n, plan)
        if plan.num_devices != n:
            raise ValueError(f"the plan is for {plan.num_devices} devices; mesh axis {axis_name!r} has {n}")
        if len(plan.strategies) != len(emb.tables):
            raise ValueError(f"the plan has {len(plan.strategies)} tables; the embedding has {len(emb.tables)}")
        for t, (spec, st) in enumerate(zip(emb.tables, plan.strategies)):
            if spec.location != "device" and st not in ("table", "row"):
                # a column block's row statistics and a replicated table's update run on XLA's sparse path,
                # whose ops cannot take host operands; only the Pallas kernels read and write host memory
                raise ValueError(f"table {spec.label(t)} has location {spec.location!r}: a table in host memory "
                                 f"is sharded 'table' or 'row', not {st!r}")
        if "column" in plan.strategies and any(t.location == "host_cached" for t in emb.tables):
            # a column-wise step updates the owners' buffers on XLA's sparse path, past the cache's routing
            raise ValueError("a model with 'host_cached' tables shards its tables 'table', 'row' or 'data', not "
                             "'column'")
        if emb.pooling == "none" and "column" in plan.strategies:
            raise ValueError('pooling="none" (sequence lookups) cannot shard tables by columns; use "table", '
                             '"row" or "data"')
        if emb.bounds_check == "fatal":
            raise ValueError('a sharded embedding supports bounds_check "ignore", "none" and "warning" (ids '
                             'outside [0, E) are dropped where they are routed); "fatal" is not supported')
        feature_capacity = None
        if capacity is not None and as_int(capacity) is not None:
            capacity = as_int(capacity)  # an int, a NumPy integer, a 0-d integer array
        elif capacity is not None and (isinstance(capacity, (str, bytes)) or np.ndim(capacity) == 0):
            # a float, a bool, a string: neither an int nor a sequence of per-feature counts
            raise ValueError(f"capacity must be None, an int >= 1 or one int >= 0 per feature, got {capacity!r}")
        if capacity is not None and not isinstance(capacity, int):
            feature_capacity = tuple(capacity)
            if len(feature_capacity) != emb.num_features or any(
                    isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in feature_capacity):
                raise ValueError(f"capacity as a sequence must hold one int >= 0 per feature ({emb.num_features}), "
                                 f"got {capacity!r}")
            feature_capacity = tuple(int(c) for c in feature_capacity)
        elif capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be None, an int >= 1 or one int >= 0 per feature, got {capacity!r}")
        self.emb = emb
        self.mesh = mesh
        self.axis_name = axis_name
        self.num_devices = n
        self.plan = plan
        self.feature_capacity = feature_capacity
        self.capacity = None if capacity is None or feature_capacity is not None else int(capacity)
        self.warn_overflow = bool(warn_overflow)
        if comm_dtype is not None:
            comm_dtype = jnp.dtype(comm_dtype)
            if comm_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
                raise ValueError(f"comm_dtype must be None, float32, bfloat16 or float16, got {comm_dtype}")
        self.comm_dtype = comm_dtype
        self.layout = ShardLayout(emb, plan)
        lay = self.layout
        if feature_capacity is not None:  # the worst case of this placement: every id of a feature its device serves
            serves = lay.slot_of >= 0  # [n, F]
            self.capacity = max(1, int((serves * np.asarray(feature_capacity, np.int64)[None, :]).sum(axis=1).max()))
        self.local = TableBatchedEmbedding(
            [TableSpec(r, w, location=loc) for r, w, loc in zip(lay.pool_rows, lay.widths, lay.locations)],
            feature_table_map=list(lay.slot_pool) or [0],
            pooling="none" if emb.pooling == "none" else "sum",
            weights_dtype=emb.weights_dtype,
            output_dtype=emb.output_dtype if emb.pooling == "none" else jnp.float32,
            bounds_check="ignore", impl=emb.impl, interpret=emb.interpret, kernel_config=emb.kernel_config,
            use_histogram=False, backward_config=emb.backward_config,
            # Unpadded: the shards' buffers are built here, at the pieces' widths (`ShardLayout.widths`).
            pad_rows=False,
            # pools of "host_cached" tables: each device caches its own pieces' hot rows (`local` is then a
            # `HostCachedEmbedding`: `prefetch` routes the batch's ids to their owners and prefetches there)
            cache_load_factor=emb.cache_load_factor, cache_policy=emb.cache_policy, cache_ways=emb.cache_ways,
            cache_max_fills=emb.cache_max_fills, cache_admit_age=emb.cache_admit_age,
        )
        self.cached = hasattr(self.local, "inner")
        # The owners' storage: `local` itself, or for cached pools its inner embedding (per cached pool a cache part
        # in HBM and a host part); `pool_table[c]`: pool c's table in it (a cached pool's host part).
        self.storage = self.local.inner if self.cached else self.local
        if self.cached:
            cl = self.local.cache_layout
            self.pool_table = tuple(cl.host_part[cl.tables.index(c)] if c in cl.tables else self.local.inner_of[c]
                                    for c in range(len(lay.pool_keys)))
        else:
            self.pool_table = tuple(range(len(lay.pool_keys)))
        # The replicated tables' lookups, on each device for its own samples: the same buffers (the same keys), read
        # by the features of "data" tables only (`shard_route.data_batch` gives their ids as rows of their pool).
        self.local_data = None
        if lay.data_features:
            self.local_data = TableBatchedEmbedding(
                list(self.storage.tables),
                feature_table_map=[self.pool_table[lay.pool(emb.feature_dims[f])] for f in lay.data_features],
                pooling=emb.pooling, weights_dtype=emb.weights_dtype,
                output_dtype=emb.output_dtype if emb.pooling == "none" else jnp.float32,
                bounds_check="ignore", impl=emb.impl, interpret=emb.interpret, kernel_config=emb.kernel_config,
                use_histogram=False, backward_config=emb.backward_config, pad_rows=False,
            )

    # -- identity ----------------------------------------------------------------
    def _key(self):
        return (self.emb, self.mesh, self.axis_name, self.plan, self.capacity, self.warn_overflow,
                None if self.comm_dtype is None else self.comm_dtype.name)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ShardedTableBatchedEmbedding) and self._key() == other._key()

    def __repr__(self):
        counts = {s: self.plan.strategies.count(s) for s in STRATEGIES if s in self.plan.strategies}
        return f"ShardedTableBatchedEmbedding({self.emb!r}, {self.num_devices} devices, {counts})"

    @property
    def strategies(self) -> tuple[str, ...]:
        return self.plan.strategies

    def uses_kernel(self) -> bool:
        """Whether the owners' lookups run the Pallas kernels (`local.uses_kernel()`)."""
        return self.local.uses_kernel()

    # -- placement helpers --------------------------------------------------------
    def _sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def host_sharding(self) -> NamedSharding:
        """The sharding of a buffer of host-memory tables: split over the axis, each device's rows in its pinned
        host memory (on a GPU backend; elsewhere an ordinary sharded array, as `tbe_jax.memory` does)."""
        if memory.host_memory():
            return NamedSharding(self.mesh, P(self.axis_name), memory_kind=memory.HOST_KIND)
        return NamedSharding(self.mesh, P(self.axis_name))

    def host_keys(self) -> frozenset:
        """The owners' buffers kept in host memory (pools of "host" tables, host parts of cached pools)."""
        lay = self.storage.layout
        return frozenset(lay.key(g) for g in range(len(lay.dims)) if lay.on_host(g))

    @property
    def direct(self) -> bool:
        """One device and no cache: the step is `emb`'s own (nothing to route; bitwise `emb`). With cached pools
        the owners' caches are per pool, not per table as `emb`'s: the routed path runs, on one device too."""
        return self.num_devices == 1 and not self.cached

    def storage_parts(self) -> tuple:
        """Per buffer of the owners' storage, its tables in order: a pool's index, or for a cache part its row
        count (`-rows`; its rows start at zero and hold no row until a prefetch)."""
        lay = self.storage.layout
        parts = [[] for _ in lay.dims]
        for ti, spec in enumerate(self.storage.tables):
            parts[lay.table_group[ti]].append(self.pool_table.index(ti) if ti in self.pool_table
                                              else -spec.num_embeddings)
        return tuple(tuple(p) for p in parts)

    def storage_buffers(self, pools) -> dict:
        """On one device: the owners' params from each pool's rows (`pools[c]`), cache parts empty (and, with
        cached pools, an empty directory); a buffer with a pool given as None is left out."""
        lay = self.storage.layout
        out = {}
        for g, parts in enumerate(self.storage_parts()):
            if any(c >= 0 and pools[c] is None for c in parts):
                continue
            xs = [pools[c] if c >= 0 else jnp.zeros((-c, lay.dims[g]), self.emb.weights_dtype) for c in parts]
            out[lay.key(g)] = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0)
        if self.cached:
            out[CACHE] = self.local.empty_cache()
        return out

    def local_tree(self, params) -> dict:
        """Inside a `shard_map` body: this device's params as `local` takes them (the directory's step counter,
        `[1]` per device in the sharded params, a scalar)."""
        if not self.cached:
            return params
        return {**params, CACHE: {**params[CACHE], "tick": params[CACHE]["tick"].reshape(())}}

    def global_tree(self, params) -> dict:
        """Inside a `shard_map` body: `local`'s params as one device's part of the sharded params."""
        if not self.cached:
            return params
        return {**params, CACHE: {**params[CACHE], "tick": params[CACHE]["tick"].reshape((1,))}}

    def storage_tree(self, params) -> dict:
        """The buffers alone (no directory): what `storage` and `local_data` take."""
        return {k: v for k, v in params.items() if k != CACHE}

    def _buffer_keys(self):
        return [self.storage.layout.key(g) for g in range(len(self.storage.layout.dims))]

    def _param_keys(self):
        return self._buffer_keys() + ([CACHE] if self.cached else [])

    def _rows_of(self, c: int) -> int:
        """Rows of width class c's buffer per device."""
        return self.layout.pool_rows[c]

    def _place(self, x, spec):
        """`x` placed as `spec` on the mesh (under jit: a sharding constraint, or `reshard` on an explicit
        axis; eagerly: a transfer when it is not there yet)."""
        sh = self._sharding(spec)
        if isinstance(x, jax.core.Tracer):
            if self._explicit():
                return jax.sharding.reshard(x, sh)
            return jax.lax.with_sharding_constraint(x, sh)
        if getattr(x, "sharding", None) == sh:
            return x
        return jax.device_put(x, sh)

    def _explicit(self) -> bool:
        types = getattr(self.mesh, "axis_types", None)
        if not types:
            return False
        t = dict(zip(self.mesh.axis_names, types))[self.axis_name]
        return "Explicit" in str(t)

    # -- parameters --------------------------------------------------------------
    def init(self, key: jax.Array) -> dict:
        """Tables drawn as `emb.init` draws them (uniform in `+-1/sqrt(E_t)` per table), placed on the mesh:
        each device draws its own shards (no table exists whole anywhere). The values differ from
        `emb.init(key)`'s; use `set_tables` to start from given tables."""
        return shard_programs.sharded_init(self, key, tbe_module.INIT_BLOCK)

    def set_tables(self, params, tables: Sequence) -> dict:
        """Params holding `tables` (one `[E_t, D_t]` array per table, as `emb.set_tables` takes), each device
        given only its shards (built on the host, then placed)."""
        del params
        return shard_checkpoint.scatter_tables(self, tables)

    def get_tables(self, params) -> list[jax.Array]:
        """Per table, its full `[E_t, D_t]` array (gathered from its shards)."""
        self.check_params(params)
        return list(shard_checkpoint.gather_tables(self, params, None))

    def get_state(self, opt_state, name: str) -> list[jax.Array]:
        """Per table, its slice of the optimizer state's field `name` (as `emb.get_state`)."""
        fields = [f for f in getattr(opt_state, "_fields", ()) if f != "count"]
        if name not in fields:
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: its state fields are {fields}, "
                             f"not {name!r}")
        self._check_state_field(getattr(opt_state, name), name)
        return list(shard_checkpoint.gather_tables(self, getattr(opt_state, name), name))

    def _check_state_field(self, tree, name):
        """A sharded state field: one array per storage buffer, `[n * rows]` (row-wise) or `[n * rows, D]`,
        as `init_opt_state` builds it (a state of `emb` or of another mesh has other buffers or rows); with cached
        pools also `"cache_rows"`, `[n * slots]`."""
        keys = self._buffer_keys() + ([STATE_ROWS] if self.cached else [])
        if not isinstance(tree, Mapping) or set(tree) != set(keys):
            raise ValueError(f"opt_state.{name} must hold this sharded embedding's buffers {keys} (build the state "
                             f"with init_opt_state, or convert emb's with from_unsharded; a state saved from another "
                             f"mesh or plan: save to_unsharded(params, opt_state) instead), got "
                             + (f"{sorted(tree)}" if isinstance(tree, Mapping) else type(tree).__name__))
        lay = self.storage.layout
        want = {lay.key(g): (self.num_devices * lay.group_rows[g], lay.strides[g]) for g in range(len(lay.dims))}
        if self.cached:
            want[STATE_ROWS] = (self.num_devices * self.local.cache_layout.total_slots,)
        for key, (rows, *w) in want.items():
            shape = tuple(getattr(tree[key], "shape", ()))
            if shape not in ((rows,), (rows, *w)):
                raise ValueError(f"opt_state.{name}[{key!r}] must be [{rows}]" + (f" or [{rows}, {w[0]}]" if w else "")
                                 + f" (this mesh's shards), got {list(shape)}: build the state with init_opt_state, "
                                 "or convert emb's with from_unsharded. Sharded states depend on the mesh and the "
                                 "plan: a checkpoint of another mesh's cannot be restored onto this one (orbax's "
                                 "strict=False would pad or cut the wrong tables' rows); save "
                                 "`to_unsharded(params, opt_state)` and restore it with `from_unsharded`")

    def _check_opt_state(self, opt_state, opt) -> None:
        """`opt.check_state` on the global shapes, after the per-field check that names the way out of a state of
        another mesh (`to_unsharded` / `from_unsharded`)."""
        if isinstance(opt_state, opt.state_type):
            for name in (n for n in opt_state._fields if n != "count"):  # the state slots
                self._check_state_field(getattr(opt_state, name), name)

    def _check_state(self, opt, opt_state, params) -> None:
        """`opt.check_state` on the buffers (a cached model's state: without the slots' `"cache_rows"`)."""
        if self.cached and isinstance(opt_state, opt.state_type):
            opt_state = self.local.inner_state(opt_state)
        opt.check_state(opt_state, self.storage_tree(params))

    def get_momentum(self, opt_state) -> list[jax.Array]:
        """Per table, its Adagrad accumulators (as `emb.get_momentum`)."""
        if not isinstance(opt_state, (optim.RowwiseAdagradState, optim.AdagradState)):
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: it holds no Adagrad accumulators")
        return self.get_state(opt_state, "momentum")

    def set_state(self, opt_state, name: str, values: Sequence):
        """`opt_state` with field `name` holding `values` (per table, shaped as `get_state` returns)."""
        fields = [f for f in getattr(opt_state, "_fields", ()) if f != "count"]
        if name not in fields:
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: its state fields are {fields}, "
                             f"not {name!r}")
        if len(values) != len(self.emb.tables):
            raise ValueError(f"expected {len(self.emb.tables)} arrays, got {len(values)}")
        self._check_state_field(getattr(opt_state, name), name)
        if self.cached:  # the caches hold some rows' states: new values must go where each row lives
            raise NotImplementedError("set_state with 'host_cached' tables: save to_unsharded(params, opt_state), "
                                      "change the state there, and restore it with from_unsharded")
        rowwise = next(iter(getattr(opt_state, name).values())).ndim == 1
        for t, (spec, v) in enumerate(zip(self.emb.tables, values)):
            want = (spec.num_embeddings,) + (() if rowwise else (spec.embedding_dim,))
            if tuple(np.shape(v)) != want:
                raise ValueError(f"values[{t}] ({spec.label(t)}) must have shape {want} (as get_state returns "
                                 f"for {name!r}), got {tuple(np.shape(v))}")
        return opt_state._replace(**{name: shard_checkpoint.fill_state(self, None, values)})

    # -- checkpoints: the unsharded format, the same on every mesh ------------------------
    def to_unsharded(self, params, opt_state=None):
        """`(emb_params, emb_opt_state)` in `emb`'s own format (its storage buffers), gathered from the
        shards: what to save (e.g. with orbax), since it does not depend on the mesh. `opt_state` None gives
        None. The tables pass through the host (every table is materialised whole, as `get_tables` does)."""
        return shard_checkpoint.to_unsharded(self, params, opt_state)

    def from_unsharded(self, emb_params, emb_opt_state=None):
        """`(params, opt_state)` on this mesh from `emb`'s format (`to_unsharded`'s output, possibly saved on
        a mesh of another size)."""
        return shard_checkpoint.from_unsharded(self, emb_params, emb_opt_state)

    def check_params(self, params) -> None:
        """Raises unless `params` are this sharded embedding's buffers (on this mesh, with this plan)."""
        if not isinstance(params, dict) or set(params) != set(self._param_keys()):
            raise ValueError(f"params must be the dict this sharded embedding's init/set_tables return (buffers "
                             f"{self._param_keys()}), got {type(params).__name__}"
                             + (f" with {sorted(params)}" if isinstance(params, dict) else ""))
        lay = self.storage.layout
        for g in range(len(lay.dims)):
            key = lay.key(g)
            shape = (self.num_devices * lay.group_rows[g], lay.strides[g])
            if not (hasattr(params[key], "shape") and hasattr(params[key], "dtype")):
                raise TypeError(f"params[{key!r}] must be an array ({self.emb.weights_dtype.name}{list(shape)}), "
                                f"got {type(params[key]).__name__}")
            if tuple(params[key].shape) != shape or params[key].dtype != self.emb.weights_dtype:
                raise ValueError(
                    f"params[{key!r}] must be {self.emb.weights_dtype.name}{list(shape)}, got "
                    f"{params[key].dtype}{list(params[key].shape)}. Sharded buffers depend on the mesh (its size "
                    f"and the plan): a checkpoint of another mesh's buffers cannot be restored onto this one, not "
                    f"even with orbax's strict=False (which would pad or cut the rows of the wrong tables). Save "
                    f"`to_unsharded(params, opt_state)` (mesh-independent), and restore it with `from_unsharded`")
        if self.cached:
            d, n = params[CACHE], self.num_devices
            shapes = {k: (n * s[0],) if s else (n,) for k, s in self.local.dir_shapes().items()}
            if not isinstance(d, dict) or set(d) != set(shapes):
                raise ValueError(f"params['cache'] must hold {sorted(shapes)} (build params with init or "
                                 "set_tables)")
            for k, s in shapes.items():
                if tuple(getattr(d[k], "shape", ())) != s or getattr(d[k], "dtype", None) != jnp.int32:
                    raise ValueError(f"params['cache'][{k!r}] must be int32{list(s)} (each device's directory of "
                                     "its cached pools, stacked)")

    def init_opt_state(self, params, opt):
        """`opt`'s state for the shards, sharded like the params (the step count replicated)."""
        self.check_optimizer(opt)
        self.check_params(params)
        return shard_programs.sharded_opt_init(self, opt, params)

    def check_optimizer(self, opt) -> None:
        """Raises unless `opt` applies to these shards (as `emb.check_optimizer`: every optimizer does)."""
        self.emb.check_optimizer(opt)

    # -- forward -------------------------------------------------------------------
    def _warns(self) -> bool:
        return (self.capacity is not None and self.warn_overflow) or self.emb.bounds_check == "warning"

    def _check_inputs(self, indices, offsets, per_sample_weights):
        n = self.num_devices
        for name, x in (("indices", indices), ("offsets", offsets)):
            if getattr(x, "ndim", None) != 2 or x.shape[0] != n:
                raise ValueError(f"{name} must be [n, ...] with n={n} (one row per device of axis "
                                 f"{self.axis_name!r}), got shape {getattr(x, 'shape', None)}")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must hold integers, got {x.dtype}")
        nf = self.emb.num_features
        if (offsets.shape[1] - 1) % nf or offsets.shape[1] < nf + 1:
            raise ValueError(f"offsets has {offsets.shape[1]} entries per device; expected F*b+1 with F={nf} "
                             "and b >= 1 samples per device")
        if indices.shape[1] < 1:
            raise ValueError("indices must give every device room for at least one id (pad past offsets[k, -1])")
        check_weights(per_sample_weights, indices)

    def __call__(self, params, indices, offsets, per_sample_weights=None):
        """The pooled lookup of the global batch: `[n*b, sum D]` (or `[n*N, D]` for `pooling="none"`)."""
        out, report = self.forward_with_report(params, indices, offsets, per_sample_weights)
        _warn_report(report, self._warns())
        return out

    def forward_with_report(self, params, indices, offsets, per_sample_weights=None):
        """`(out, BoundsReport)`: the lookup, and the ids dropped past a capacity / repaired (device values)."""
        out, report, _ = shard_programs.forward(self, params, *self._args(indices, offsets, per_sample_weights), False)
        return out, report

    def _args(self, indices, offsets, per_sample_weights):
        indices, offsets = jnp.asarray(indices), jnp.asarray(offsets)
        if per_sample_weights is not None:
            per_sample_weights = jnp.asarray(per_sample_weights)
        self._check_inputs(indices, offsets, per_sample_weights)
        indices, offsets = widen_ids("indices", indices), widen_ids("offsets", offsets)
        spec = P(self.axis_name)
        indices = self._place(narrow_ids(indices), spec)  # int64 ids (x64): one past int32 must not wrap
        offsets = self._place(offsets.astype(jnp.int32), spec)
        if per_sample_weights is not None:
            per_sample_weights = self._place(per_sample_weights.astype(jnp.float32), spec)
        return indices, offsets, per_sample_weights

    # -- optimizer step ----------------------------------------------------------------
    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None):
        """One optimizer step on the looked-up rows of the global batch: `(params, opt_state)`, as
        `emb.apply_gradients` on the global batch (each touched row once, with the whole batch's gradient)."""
        self.check_optimizer(opt)
        self.check_params(params)
        self._check_opt_state(opt_state, opt)
        self._check_state(opt, opt_state, params)  # the global shapes: a state of emb or of another mesh is refused
        idx, off, psw = self._args(indices, offsets, per_sample_weights)
        grad_output = jnp.asarray(grad_output)
        b = (off.shape[1] - 1) // self.emb.num_features
        want = (self.num_devices * idx.shape[1], self.emb.feature_dims[0]) if self.emb.pooling == "none" else (
            self.num_devices * b, self.layout.out_width)
        if tuple(grad_output.shape) != want:
            raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}; this batch's output is {want}")
        if not jnp.issubdtype(grad_output.dtype, jnp.floating):
            raise TypeError(f"grad_output must be floating point, got {grad_output.dtype}")
        grad_output = self._place(grad_output, P(self.axis_name))
        routed = shard_programs.route_for_update(self, idx, off, psw)
        return shard_programs.update(self, params, opt_state, opt, routed, grad_output)

    # -- tables behind an HBM cache ("host_cached") -------------------------------------------
    def prefetch(self, params, indices, offsets, opt_state=None):
        """Bring the global batch's rows of "host_cached" tables into their owners' HBM caches (each device caches
        its own pieces: the batch's ids go to their owners as the lookup sends them, and each owner prefetches
        its part, as `HostCachedEmbedding.prefetch` does on one device). Returns the params, or
        `(params, opt_state)` with `opt_state` (in training: the state moves with its rows). Outside `jit` the
        arguments are donated (use the returned ones); under `jit`, donate them yourself."""
        if not self.cached:
            raise ValueError("prefetch: this sharded embedding has no 'host_cached' tables")
        self.check_params(params)
        idx, off, _ = self._args(indices, offsets, None)
        params, opt_state = shard_programs.prefetch(self, params, idx, off, opt_state)
        return params if opt_state is None else (params, opt_state)

    def cache_stats(self, params) -> dict:
        """The last prefetch's counts (as `HostCachedEmbedding.cache_stats`), summed over the devices."""
        if not self.cached:
            raise ValueError("cache_stats: this sharded embedding has no 'host_cached' tables")
        x = params[CACHE]["stats"]
        if not isinstance(x, jax.core.Tracer):  # concrete: summed on the host
            return dict(zip(STATS, shard_checkpoint.host_array(x).reshape(self.num_devices, -1).sum(axis=0)))
        x = self._place(x, P())  # replicated, then summed per count (a sharded axis cannot be split up)
        return {k: jnp.sum(x[i :: len(STATS)]) for i, k in enumerate(STATS)}

    # -- tbe_jax.train_step -------------------------------------------------------------
    def step_forward(self, params, indices, offsets, per_sample_weights=None, **options):
        """The routed lookup of the global batch, and what `step_update` needs of it (the routed ids)."""
        if options:
            raise ValueError(f"a sharded embedding takes no lookup options, got {sorted(options)}")
        idx, off, psw = self._args(indices, offsets, per_sample_weights)
        out, report, routed = shard_programs.forward(self, params, idx, off, psw, True)
        _warn_report(report, self._warns())
        return out, (routed, report)

    def step_update(self, params, opt_state, opt, residuals, grad_output):
        """The owners' update on `step_forward`'s routed batch: `(params, opt_state, invalid_indices)`."""
        routed, report = residuals
        self.check_optimizer(opt)
        self.check_params(params)
        self._check_opt_state(opt_state, opt)
        self._check_state(opt, opt_state, params)
        grad_output = self._place(grad_output, P(self.axis_name))
        params, opt_state = shard_programs.update(self, params, opt_state, opt, routed, grad_output)
        return params, opt_state, report.invalid_indices


def _warn_report(report, enabled):
    if enabled:
        bounds.warn_if_repaired(report, package="tbe_jax.shard")
