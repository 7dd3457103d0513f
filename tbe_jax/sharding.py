"""Tables sharded over the devices of a mesh: `tbe_jax.shard(emb, mesh, axis_name)`.

Each table gets one strategy (`ShardedTableBatchedEmbedding.plan`):

- `"table"`: the whole table on one device (its owner);
- `"row"`: rows split in `ceil(E / n)` blocks, block j on device j;
- `"column"`: columns split in `ceil(D / n)` blocks, block j on device j;
- `"data"`: a full copy on every device (data parallel).

How a step runs (inside one `shard_map` over `axis_name`; XLA collectives, NCCL on GPUs):

1. Ids to their owners. Each device looks at its local batch and, per destination
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
   once per touched row with the whole global batch's gradient. Replicated tables
   see every device's ids and gradients, so their copies stay identical.

Column-wise tables need an optimizer without row statistics (SGD, Adagrad, Adam):
row-wise Adagrad, the partial row-wise Adams and the LAMBs reduce over a whole
row, which no column block sees; `init_opt_state` refuses that combination.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tbe_jax import bounds, optim, reference
from tbe_jax.shard_plan import STRATEGIES, ShardingPlan, ShardLayout, as_int, plan_sharding
from tbe_jax.specs import TableSpec, checked_tables
from tbe_jax.inputs import widen_ids
from tbe_jax import tbe as tbe_module
from tbe_jax.tbe import TableBatchedEmbedding, blocked_draw, init_rows

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
            [TableSpec(r, w) for r, w in zip(lay.pool_rows, lay.widths)],
            feature_table_map=[lay.widths.index(w) for w in lay.slot_width] or [0],
            pooling="none" if emb.pooling == "none" else "sum",
            weights_dtype=emb.weights_dtype,
            output_dtype=emb.output_dtype if emb.pooling == "none" else jnp.float32,
            bounds_check="ignore", impl=emb.impl, interpret=emb.interpret, kernel_config=emb.kernel_config,
            use_histogram=False, backward_config=emb.backward_config,
            # Unpadded: the shards' buffers are built here, at the pieces' widths (`ShardLayout.widths`).
            pad_rows=False,
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

    # -- placement helpers --------------------------------------------------------
    def _sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def _buffer_keys(self):
        return [self.local.layout.key(g) for g in range(len(self.local.layout.dims))]

    def _rows_of(self, c: int) -> int:
        """Rows of width class c's buffer per device."""
        return self.layout.pool_rows[c]

    def _smap(self, f, in_specs, out_specs):
        # Kernels in interpret mode trip an interpreter limitation on varying-axes types inside shard_map
        # (jax evaluates the kernel body with mixed varying / non-varying values); compiled kernels and the
        # XLA path run under shard_map's default checks.
        check = not (self.local.interpret and self.local._use_kernel())
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)

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
        return _sharded_init(self, key, tbe_module.INIT_BLOCK)

    def set_tables(self, params, tables: Sequence) -> dict:
        """Params holding `tables` (one `[E_t, D_t]` array per table, as `emb.set_tables` takes), each device
        given only its shards (built on the host, then placed)."""
        del params
        emb, lay = self.emb, self.layout
        host = []
        for arr in checked_tables(emb.tables, tables):
            host.append(np.asarray(jax.device_get(arr)).astype(emb.weights_dtype))
        out = {}
        for c, w in enumerate(lay.widths):
            blocks = np.zeros((self.num_devices, lay.pool_rows[c], w), emb.weights_dtype)
            for p in lay.pieces:
                if p.cols == w:
                    r = lay.pool_row[p]
                    blocks[p.device, r : r + p.rows] = host[p.table][p.row0 : p.row0 + p.rows,
                                                                      p.col0 : p.col0 + p.cols]
            out[self.local.layout.key(c)] = self._from_blocks(blocks.reshape(-1, w))
        return out

    def _from_blocks(self, arr: np.ndarray) -> jax.Array:
        sh = self._sharding(P(self.axis_name))
        return jax.make_array_from_callback(arr.shape, sh, lambda idx: arr[idx])

    def get_tables(self, params) -> list[jax.Array]:
        """Per table, its full `[E_t, D_t]` array (gathered from its shards)."""
        self._check_params(params)
        return list(_gather_tables(self, params, None))

    def get_state(self, opt_state, name: str) -> list[jax.Array]:
        """Per table, its slice of the optimizer state's field `name` (as `emb.get_state`)."""
        fields = [f for f in getattr(opt_state, "_fields", ()) if f != "count"]
        if name not in fields:
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: its state fields are {fields}, "
                             f"not {name!r}")
        self._check_state_field(getattr(opt_state, name), name)
        return list(_gather_tables(self, getattr(opt_state, name), name))

    def _check_state_field(self, tree, name):
        """A sharded state field: one array per storage buffer, `[n * rows]` (row-wise) or `[n * rows, D]`,
        as `init_opt_state` builds it (a state of `emb` or of another mesh has other buffers or rows)."""
        keys = self._buffer_keys()
        if not isinstance(tree, Mapping) or set(tree) != set(keys):
            raise ValueError(f"opt_state.{name} must hold this sharded embedding's buffers {keys} (build the state "
                             f"with init_opt_state, or convert emb's with from_unsharded), got "
                             + (f"{sorted(tree)}" if isinstance(tree, Mapping) else type(tree).__name__))
        for c, w in enumerate(self.layout.widths):
            key = self.local.layout.key(c)
            rows = self.num_devices * self.layout.pool_rows[c]
            shape = tuple(getattr(tree[key], "shape", ()))
            if shape not in ((rows,), (rows, w)):
                raise ValueError(f"opt_state.{name}[{key!r}] must be [{rows}] or [{rows}, {w}] (this mesh's "
                                 f"shards), got {list(shape)}: build the state with init_opt_state, or convert "
                                 "emb's with from_unsharded")

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
        rowwise = next(iter(getattr(opt_state, name).values())).ndim == 1
        for t, (spec, v) in enumerate(zip(self.emb.tables, values)):
            want = (spec.num_embeddings,) + (() if rowwise else (spec.embedding_dim,))
            if tuple(np.shape(v)) != want:
                raise ValueError(f"values[{t}] ({spec.label(t)}) must have shape {want} (as get_state returns "
                                 f"for {name!r}), got {tuple(np.shape(v))}")
        return opt_state._replace(**{name: self._fill_state(None, values)})

    # -- checkpoints: the unsharded format, the same on every mesh ------------------------
    def to_unsharded(self, params, opt_state=None):
        """`(emb_params, emb_opt_state)` in `emb`'s own format (its storage buffers), gathered from the
        shards: what to save (e.g. with orbax), since it does not depend on the mesh. `opt_state` None gives
        None. The tables pass through the host (every table is materialised whole, as `get_tables` does)."""
        emb = self.emb
        emb_params = emb.set_tables(None, self.get_tables(params))
        if opt_state is None:
            return emb_params, None
        fields = {}
        for name in (f for f in opt_state._fields if f != "count"):
            fields[name] = emb._pack(self.get_state(opt_state, name))
        return emb_params, opt_state._replace(count=jnp.asarray(jax.device_get(opt_state.count)), **fields)

    def from_unsharded(self, emb_params, emb_opt_state=None):
        """`(params, opt_state)` on this mesh from `emb`'s format (`to_unsharded`'s output, possibly saved on
        a mesh of another size)."""
        emb = self.emb
        emb._check_params(emb_params)
        params = self.set_tables(None, emb.get_tables(emb_params))
        if emb_opt_state is None:
            return params, None
        if not hasattr(emb_opt_state, "_fields") or "count" not in emb_opt_state._fields:
            raise TypeError(f"emb_opt_state must be an optimizer state of emb (emb.init_opt_state's, or "
                            f"to_unsharded's), got {type(emb_opt_state).__name__}")
        for name in (f for f in emb_opt_state._fields if f != "count"):
            tree = getattr(emb_opt_state, name)
            ok = isinstance(tree, Mapping) and set(tree) == set(emb_params)
            for key in (tree if ok else ()):
                shape, (rows, d) = tuple(getattr(tree[key], "shape", ())), emb_params[key].shape
                ok = ok and shape in ((rows,), (rows, d))
            if not ok:
                raise ValueError(f"emb_opt_state.{name} does not match emb's params (one [rows] or [rows, D] array "
                                 f"per buffer {sorted(emb_params)}): pass emb's state (emb.init_opt_state's, or "
                                 "to_unsharded's), not a sharded one")
        new = {}
        for name in (f for f in emb_opt_state._fields if f != "count"):
            new[name] = self._fill_state(getattr(emb_opt_state, name),
                                         [a for a in emb.get_state(emb_opt_state, name)])
        count = self._from_replicated(jnp.asarray(jax.device_get(emb_opt_state.count)))
        return params, emb_opt_state._replace(count=count, **new)

    def _from_replicated(self, x):
        arr = np.asarray(x)
        return jax.make_array_from_callback(arr.shape, self._sharding(P()), lambda idx: arr[idx])

    def _fill_state(self, emb_field, per_table):
        lay = self.layout
        host = [np.asarray(jax.device_get(v)) for v in per_table]
        rowwise = host[0].ndim == 1
        dtype = host[0].dtype
        out = {}
        for c, w in enumerate(lay.widths):
            shape = (self.num_devices, lay.pool_rows[c]) + (() if rowwise else (w,))
            blocks = np.zeros(shape, dtype)
            for p in lay.pieces:
                if p.cols == w:
                    r = lay.pool_row[p]
                    v = host[p.table][p.row0 : p.row0 + p.rows]
                    blocks[p.device, r : r + p.rows] = v if rowwise else v[:, p.col0 : p.col0 + p.cols]
            out[self.local.layout.key(c)] = self._from_blocks(blocks.reshape((-1,) + shape[2:]))
        return out

    def _check_params(self, params):
        if not isinstance(params, dict) or set(params) != set(self._buffer_keys()):
            raise ValueError(f"params must be the dict this sharded embedding's init/set_tables return (buffers "
                             f"{self._buffer_keys()}), got {type(params).__name__}"
                             + (f" with {sorted(params)}" if isinstance(params, dict) else ""))
        for c, w in enumerate(self.layout.widths):
            key = self.local.layout.key(c)
            shape = (self.num_devices * self.layout.pool_rows[c], w)
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

    def init_opt_state(self, params, opt):
        """`opt`'s state for the shards, sharded like the params (the step count replicated)."""
        self._check_opt(opt)
        self._check_params(params)
        return _sharded_opt_init(self, opt, params)

    def _check_opt(self, opt):
        self.emb._check_opt(opt)
        rule = opt.rule()
        if "column" in self.plan.strategies and (any(rule.slot_rowwise) or isinstance(
                opt, (optim.Lamb, optim.PartialRowwiseLamb))):
            cols = [t for t, s in enumerate(self.plan.strategies) if s == "column"]
            raise ValueError(
                f"{type(opt).__name__} reduces over whole rows (a row-wise accumulator or a trust ratio), which a "
                f"column block does not see; tables {cols} are sharded by columns: shard them by rows or tables, "
                "or train them with SGD, Adagrad or Adam")

    def _state_specs(self, opt_state):
        ax = self.axis_name
        return jax.tree_util.tree_map(lambda x: P(ax) if getattr(x, "ndim", 0) >= 1 else P(), opt_state)

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
        if per_sample_weights is not None and not jnp.issubdtype(per_sample_weights.dtype, jnp.floating):
            raise TypeError(f"per_sample_weights must be floating point, got {per_sample_weights.dtype}")
        if per_sample_weights is not None and per_sample_weights.shape != indices.shape:
            raise ValueError(f"per_sample_weights has shape {per_sample_weights.shape}; it must match indices "
                             f"{indices.shape}")

    def __call__(self, params, indices, offsets, per_sample_weights=None):
        """The pooled lookup of the global batch: `[n*b, sum D]` (or `[n*N, D]` for `pooling="none"`)."""
        out, report = self.forward_with_report(params, indices, offsets, per_sample_weights)
        _warn_report(report, self._warns())
        return out

    def forward_with_report(self, params, indices, offsets, per_sample_weights=None):
        """`(out, BoundsReport)`: the lookup, and the ids dropped past a capacity / repaired (device values)."""
        out, report, _ = _forward(self, params, *self._args(indices, offsets, per_sample_weights), False)
        return out, report

    def _args(self, indices, offsets, per_sample_weights):
        indices, offsets = jnp.asarray(indices), jnp.asarray(offsets)
        if per_sample_weights is not None:
            per_sample_weights = jnp.asarray(per_sample_weights)
        self._check_inputs(indices, offsets, per_sample_weights)
        indices, offsets = widen_ids("indices", indices), widen_ids("offsets", offsets)
        spec = P(self.axis_name)
        if indices.dtype != jnp.int32:  # int64 ids (x64): an id past int32 must not wrap into a valid one
            indices = jnp.where((indices < -1) | (indices >= 2**31), -2, indices).astype(jnp.int32)
        indices = self._place(indices, spec)
        offsets = self._place(offsets.astype(jnp.int32), spec)
        if per_sample_weights is not None:
            per_sample_weights = self._place(per_sample_weights.astype(jnp.float32), spec)
        return indices, offsets, per_sample_weights

    # -- optimizer step ----------------------------------------------------------------
    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None):
        """One optimizer step on the looked-up rows of the global batch: `(params, opt_state)`, as
        `emb.apply_gradients` on the global batch (each touched row once, with the whole batch's gradient)."""
        self._check_opt(opt)
        self._check_params(params)
        opt.check_state(opt_state, params)  # the global shapes: a state of emb or of another mesh is refused here
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
        routed = _route_for_update(self, idx, off, psw)
        return _update(self, params, opt_state, opt, routed, grad_output)

    # -- tbe_jax.train_step -------------------------------------------------------------
    def _step_forward(self, params, indices, offsets, per_sample_weights=None, **options):
        if options:
            raise ValueError(f"a sharded embedding takes no lookup options, got {sorted(options)}")
        idx, off, psw = self._args(indices, offsets, per_sample_weights)
        out, report, routed = _forward(self, params, idx, off, psw, True)
        _warn_report(report, self._warns())
        return out, (routed, report)

    def _step_update(self, params, opt_state, opt, residuals, grad_output):
        routed, report = residuals
        self._check_opt(opt)
        self._check_params(params)
        opt.check_state(opt_state, params)
        grad_output = self._place(grad_output, P(self.axis_name))
        params, opt_state = _update(self, params, opt_state, opt, routed, grad_output)
        return params, opt_state, report.invalid_indices




def _warn_report(report, enabled):
    if enabled:
        bounds.warn_if_repaired(report, package="tbe_jax.shard")


# -- the routed step -----------------------------------------------------------------------


def _local_plan(s: ShardedTableBatchedEmbedding, num_offsets: int):
    return s.emb.plan_for(num_offsets)


def _route(s: ShardedTableBatchedEmbedding, idx, off, psw, scale_mean: bool):
    """On one device: the ids for each destination. Returns (ids [n, cap], lens [n, NS, b], starts [n, NS],
    weights [n, cap] or None, dropped, invalid, repaired)."""
    emb, lay, n = s.emb, s.layout, s.num_devices
    num = idx.shape[0]
    nf = emb.num_features
    b = (off.shape[0] - 1) // nf
    plan = _local_plan(s, off.shape[0])
    repaired = jnp.int32(0)
    if emb.bounds_check == "warning":
        off, repaired = bounds.repair_offsets(off, num)
    bag, feat = reference.position_features(plan, off, num)
    pos = jnp.arange(num, dtype=jnp.int32)
    in_bag = (pos >= off[0]) & (pos < off[-1])
    e_t = jnp.asarray(np.asarray([emb.tables[t].num_embeddings for t in emb.feature_table_map], np.int32))[feat]
    ok_id = in_bag & (idx >= 0) & (idx < e_t)
    invalid = jnp.sum(in_bag & ~ok_id, dtype=jnp.int32)
    q = jnp.asarray(lay.slot_of)[:, feat]  # [n, num]
    qc = jnp.maximum(q, 0)
    r0 = jnp.take_along_axis(jnp.asarray(lay.slot_row0), qc, axis=1)
    nr = jnp.take_along_axis(jnp.asarray(lay.slot_rows), qc, axis=1)
    pr = jnp.take_along_axis(jnp.asarray(lay.slot_prow), qc, axis=1)
    keep = ok_id[None, :] & (q >= 0) & (idx[None, :] >= r0) & (idx[None, :] < r0 + nr)
    cap = num if s.capacity is None else min(s.capacity, num)
    csum = jnp.cumsum(keep, axis=1, dtype=jnp.int32)
    slot_pos = csum - 1
    keep_cap = keep & (slot_pos < cap)
    dropped = jnp.sum(keep & ~keep_cap, dtype=jnp.int32)
    rows = idx[None, :] - r0 + pr
    dst = jnp.where(keep_cap, slot_pos, cap)
    jj = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, num))
    ids = jnp.zeros((n, cap), jnp.int32).at[jj, dst].set(rows, mode="drop")
    # Bag lengths per destination slot: kept ids before each bag boundary.
    kept_before = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), jnp.cumsum(keep_cap, axis=1, dtype=jnp.int32)],
                                  axis=1)  # [n, num + 1]
    sf = jnp.asarray(lay.slot_feat)  # [n, NS]
    used = sf >= 0
    bnd = jnp.maximum(sf, 0)[:, :, None] * b + jnp.arange(b + 1, dtype=jnp.int32)[None, None, :]  # [n, NS, b+1]
    at = jnp.clip(off[bnd], 0, num)
    kb = jnp.take_along_axis(kept_before, at.reshape(n, -1), axis=1).reshape(at.shape)
    kb = jnp.where(used[:, :, None], kb, 0)
    lens = kb[:, :, 1:] - kb[:, :, :-1]
    starts = kb[:, :, 0]
    w = None
    if psw is not None or (scale_mean and emb.pooling == "mean"):
        wv = jnp.ones((num,), jnp.float32) if psw is None else psw.astype(jnp.float32)
        if scale_mean and emb.pooling == "mean":
            length = (off[1:] - off[:-1]).astype(jnp.float32)
            coef = 1.0 / jnp.maximum(length, 1.0)
            wv = coef[bag] * wv
        w = jnp.zeros((n, cap), jnp.float32).at[jj, dst].set(jnp.broadcast_to(wv, (n, num)), mode="drop")
    return ids, lens, starts, w, dropped, invalid, repaired, (keep_cap, dst)


def _merge(s: ShardedTableBatchedEmbedding, ids, lens, starts, w):
    """On an owner: the ids received from every device as one batch of n*b samples in `s.local`'s format."""
    n = s.num_devices
    ns = s.layout.num_slots
    cap = ids.shape[1]
    b = lens.shape[2]
    seg_len = jnp.sum(lens, axis=2)  # [n(src), NS]
    flat = jnp.transpose(lens, (1, 0, 2)).reshape(-1)  # bag (q, k, i)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(flat, dtype=jnp.int32)])
    seg_dst = offsets[:-1].reshape(ns, n, b)[:, :, 0].reshape(-1)  # segment (q, k) start
    seg_src = jnp.transpose(starts, (1, 0)).reshape(-1)
    seg_k = jnp.tile(jnp.arange(n, dtype=jnp.int32), ns)
    total = n * cap
    p = jnp.arange(total, dtype=jnp.int32)
    # segment of each position: the last segment starting at or before it (a count of segment starts and a
    # prefix sum; empty segments share their start with the next one, which then wins)
    starts_hist = jnp.zeros((total + 1,), jnp.int32).at[jnp.clip(seg_dst, 0, total)].add(1)
    seg = jnp.clip(jnp.cumsum(starts_hist[:total]) - 1, 0, max(ns * n - 1, 0))
    k = seg_k[seg]
    src = jnp.clip(seg_src[seg] + p - seg_dst[seg], 0, cap - 1)
    live = p < offsets[-1]
    merged_ids = jnp.where(live, ids[k, src], 0)
    merged_w = None if w is None else jnp.where(live, w[k, src], 0.0)
    del seg_len
    return merged_ids, offsets, merged_w, (k, src, live)


def _a2a(x, axis_name):
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=False)


def _exchange_ids(s, ids, lens, starts, w):
    """One all_to_all for ids, bag lengths, segment starts (and weights, as int32 bits)."""
    n = s.num_devices
    cap = ids.shape[1]
    parts = [ids, lens.reshape(n, -1), starts]
    if w is not None:
        parts.append(jax.lax.bitcast_convert_type(w, jnp.int32))
    packed = jnp.concatenate(parts, axis=1)
    if n > 1:
        packed = _a2a(packed, s.axis_name)
    ns, b = lens.shape[1], lens.shape[2]
    ids_r = packed[:, :cap]
    lens_r = packed[:, cap : cap + ns * b].reshape(n, ns, b)
    starts_r = packed[:, cap + ns * b : cap + ns * b + ns]
    w_r = None
    if w is not None:
        w_r = jax.lax.bitcast_convert_type(packed[:, cap + ns * b + ns :], jnp.float32)
    return ids_r, lens_r, starts_r, w_r


def _routed_local(s, idx, off, psw, scale_mean):
    """Route and merge on one device: the owner-side batch (ids, offsets, weights) plus what the
    sequence path needs to send rows back, and the report counts."""
    ids, lens, starts, w, dropped, invalid, repaired, sent = _route(s, idx, off, psw, scale_mean)
    ids_r, lens_r, starts_r, w_r = _exchange_ids(s, ids, lens, starts, w)
    m_ids, m_off, m_w, back = _merge(s, ids_r, lens_r, starts_r, w_r)
    return (m_ids, m_off, m_w), back, sent, (dropped, invalid, repaired)


def _psum(x, s):
    return jax.lax.psum(x, s.axis_name)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _forward(s: ShardedTableBatchedEmbedding, params, idx, off, psw, want_routed: bool):
    s._check_params(params)
    ax = s.axis_name
    emb, n = s.emb, s.num_devices
    nf = emb.num_features
    b = (off.shape[1] - 1) // nf
    sequence = emb.pooling == "none"

    def body(params, idx, off, psw):
        idx, off = idx[0], off[0]
        psw = None if psw is None else psw[0]
        if n == 1:  # nothing to route: emb itself on the one device's batch (bitwise emb)
            out, rep = emb.forward_with_report(params, idx, off, psw)
            rep = bounds.BoundsReport(_psum(rep.invalid_indices, s), _psum(rep.repaired_offsets, s))
            return out, rep, ({"ids": idx, "off": off, "w": psw} if want_routed else None)
        # Training (want_routed) with mean pooling: the ids travel once, with weights scaled by 1/len(bag) at the
        # source; the owners' sums are then the means (no division on the way back), and the same routed batch
        # serves the update. A forward alone keeps the weightless ids and divides at the source.
        scaled = want_routed and emb.pooling == "mean"
        routed = _routed_local(s, idx, off, psw, scaled)
        (m_ids, m_off, m_w), back, sent, (dropped, invalid, repaired) = routed
        out_l = s.local(params, m_ids, m_off, m_w)
        if sequence:
            out = _sequence_back(s, out_l, back, sent, idx.shape[0])
        else:
            out = _assemble(s, out_l, off, b, divide=not scaled)
        rep = bounds.BoundsReport(_psum(invalid + dropped, s), _psum(repaired, s))
        return out, rep, (_pack_routed(routed) if want_routed else None)

    spec = P(ax)
    routed_spec = None if not want_routed else _routed_specs(s, psw is not None)
    f = s._smap(body, (jax.tree_util.tree_map(lambda _: spec, params), spec, spec, None if psw is None else spec),
                (spec, P(), routed_spec))
    return f(params, idx, off, psw)


def _pack_routed(routed):
    (m_ids, m_off, m_w), back, sent, _ = routed
    k, src, live = back
    keep_cap, dst = sent
    return {"ids": m_ids, "off": m_off, "w": m_w, "k": k, "src": src, "live": live, "keep": keep_cap, "dst": dst}


def _routed_specs(s, weighted):
    spec = P(s.axis_name)
    if s.num_devices == 1:
        return {"ids": spec, "off": spec, "w": spec if weighted else None}
    w = spec if (weighted or s.emb.pooling == "mean") else None
    return {"ids": spec, "off": spec, "w": w, "k": spec, "src": spec, "live": spec, "keep": spec, "dst": spec}


@functools.partial(jax.jit, static_argnums=(0,))
def _route_for_update(s, idx, off, psw):
    spec = P(s.axis_name)

    def body(idx, off, psw):
        if s.num_devices == 1:
            return {"ids": idx[0], "off": off[0], "w": None if psw is None else psw[0]}
        routed = _routed_local(s, idx[0], off[0], None if psw is None else psw[0], True)
        return _pack_routed(routed)

    f = s._smap(body, (spec, spec, None if psw is None else spec), _routed_specs(s, psw is not None))
    return f(idx, off, psw)


@functools.partial(jax.jit, static_argnums=(0,))
def _update(s: ShardedTableBatchedEmbedding, params, opt_state, opt, routed, grad_output):
    ax = s.axis_name
    emb, n = s.emb, s.num_devices
    sequence = emb.pooling == "none"
    pspec = jax.tree_util.tree_map(lambda _: P(ax), params)
    sspec = s._state_specs(opt_state)
    rspec = jax.tree_util.tree_map(lambda _: P(ax), routed)

    def body(params, opt_state, opt, routed, g):
        r = routed
        if n == 1:
            return emb._apply_gradients(params, opt_state, opt, r["ids"], r["off"], g, r["w"], None, None)
        if sequence:
            g_l = _sequence_grads(s, g, r)
        else:
            g_l = _route_grads(s, g)
        return s.local._apply_gradients(params, opt_state, opt, r["ids"], r["off"], g_l, r["w"], None, None)

    f = s._smap(body, (pspec, sspec, P(), rspec, P(ax)), (pspec, sspec))
    return f(params, opt_state, opt, routed, grad_output)


def _assemble(s, out_l, off, b, divide: bool = True):
    """Owner-side pooled rows `[n*b, W]` back to their devices: `[b, sum D]` on each (mean pooling: divided by
    the bag lengths unless `divide` is False, where the routed weights carried 1/len)."""
    n, lay, emb = s.num_devices, s.layout, s.emb
    parts = out_l.reshape(n, b, lay.width)
    if s.comm_dtype is not None:
        parts = parts.astype(s.comm_dtype)
    if n > 1:
        parts = _a2a(parts, s.axis_name)  # [n(owner), b, W]
    parts = parts.astype(jnp.float32)
    # Per output column: its feature, and on each owner the slot column holding it (if any).
    x = jnp.arange(lay.out_width, dtype=jnp.int32)
    fcol = jnp.asarray(lay.feature_col)
    feat = jnp.searchsorted(fcol, x, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    d = x - fcol[feat]
    q = jnp.asarray(lay.slot_of)[:, feat]  # [n, sum D]
    qc = jnp.maximum(q, 0)
    col0 = jnp.take_along_axis(jnp.asarray(lay.slot_col0), qc, axis=1)
    ncols = jnp.take_along_axis(jnp.asarray(lay.slot_ncols), qc, axis=1)
    skip = jnp.take_along_axis(jnp.asarray(lay.slot_skip), qc, axis=1)
    contrib = (q >= 0) & (d >= col0) & (d < col0 + ncols) & ~skip
    local_col = jnp.asarray(np.asarray(lay.slot_col, np.int32))[qc] + d - col0
    # One gather per contribution depth straight from [owner, sample, column] (no transpose), summed in
    # owner order (row-wise tables: every owner's partial sum).
    rank = jnp.cumsum(contrib, axis=0, dtype=jnp.int32)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    out = None
    for r in range(lay.depth):
        sel = contrib & (rank == r + 1)
        owner = jnp.argmax(sel, axis=0).astype(jnp.int32)
        col = jnp.take_along_axis(local_col, owner[None, :], axis=0)[0]
        val = jnp.where(jnp.any(sel, axis=0)[None, :], parts[owner[None, :], rows, col[None, :]], 0.0)
        out = val if out is None else out + val
    if emb.pooling == "mean" and divide:
        nf = emb.num_features
        length = (off[1:] - off[:-1]).reshape(nf, b)
        out = out / jnp.maximum(length, 1).astype(jnp.float32).T[:, feat]
    return out.astype(emb.output_dtype)


def _route_grads(s, g):
    """A device's `[b, sum D]` output gradient to the owners: `[n*b, W]` on each owner (source-major)."""
    n, lay = s.num_devices, s.layout
    g = g.astype(jnp.float32)
    b = g.shape[0]
    # Per destination and slot column: the column of this device's output it carries (unused slots: zero).
    w = jnp.arange(lay.width, dtype=jnp.int32)
    slot_col = jnp.asarray(np.asarray(lay.slot_col, np.int32))
    wq = jnp.searchsorted(slot_col, w, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    f = jnp.asarray(lay.slot_feat)[:, wq]  # [n, W]
    cols = jnp.asarray(lay.feature_col)[jnp.maximum(f, 0)] + jnp.asarray(lay.slot_col0)[:, wq] + (w - slot_col[wq])
    send = g[jnp.arange(b, dtype=jnp.int32)[None, :, None], cols[:, None, :]]  # [n(dst), b, W], no transpose
    send = jnp.where((f >= 0)[:, None, :], send, 0.0)
    if s.comm_dtype is not None:
        send = send.astype(s.comm_dtype)
    if n > 1:
        send = _a2a(send, s.axis_name)  # [n(src), b, W]
    return send.reshape(n * b, lay.width).astype(jnp.float32)


def _sequence_back(s, out_l, back, sent, num):
    """Owner-side per-id rows `[n*cap, D]` back to the devices and positions they came from."""
    n = s.num_devices
    k, src, live = back
    keep_cap, dst = sent
    cap = out_l.shape[0] // n
    d = out_l.shape[1]
    buf = jnp.zeros((n, cap + 1, d), out_l.dtype).at[jnp.where(live, k, 0), jnp.where(live, src, cap)].set(
        out_l, mode="drop")[:, :cap]
    if n > 1:
        buf = _a2a(buf, s.axis_name)  # [n(owner), cap, D]
    first = jnp.argmax(keep_cap, axis=0)  # the first owner that served each id (device 0 for replicated)
    any_ = jnp.any(keep_cap, axis=0)
    pos = jnp.take_along_axis(dst, first[None], axis=0)[0]
    rows = buf[first, jnp.clip(pos, 0, cap - 1)]
    return jnp.where(any_[:, None], rows, 0).astype(s.emb.output_dtype)


def _sequence_grads(s, g, r):
    """A device's per-id output gradient `[cap, D]` to the owners, in their merged order."""
    n = s.num_devices
    keep, dst = r["keep"], r["dst"]
    cap = keep.shape[1]
    d = g.shape[1]
    g = g.astype(jnp.float32)
    jj = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], keep.shape)
    send = jnp.zeros((n, cap + 1, d), jnp.float32).at[jj, jnp.where(keep, dst, cap)].set(
        jnp.broadcast_to(g[None], (n, cap, d)), mode="drop")[:, :cap]
    if n > 1:
        send = _a2a(send, s.axis_name)  # [n(src), cap, D]
    k, src, live = r["k"], r["src"], r["live"]
    return jnp.where(live[:, None], send[k, src], 0.0)


# -- init and gathers -------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 2))
def _sharded_init(s: ShardedTableBatchedEmbedding, key, init_block: int):
    lay, emb, n, ax = s.layout, s.emb, s.num_devices, s.axis_name
    specs = {}
    tables = {}
    for c, w in enumerate(lay.widths):
        mp = max([sum(1 for p in lay.pieces if p.cols == w and p.device == j) for j in range(n)] + [1])
        starts = np.full((n, mp + 1), lay.pool_rows[c], np.int32)
        bnd = np.zeros((n, mp + 1), np.float32)
        for j in range(n):
            mine = sorted((p for p in lay.pieces if p.cols == w and p.device == j), key=lambda p: lay.pool_row[p])
            for i, p in enumerate(mine):
                starts[j, i] = lay.pool_row[p]
                bnd[j, i] = 1.0 / math.sqrt(emb.tables[p.table].num_embeddings)
            starts[j, len(mine)] = sum(p.rows for p in mine)  # padding rows from here: bound 0
            starts[j, len(mine) + 1 :] = lay.pool_rows[c] + 1
        tables[s.local.layout.key(c)] = (jnp.asarray(starts), jnp.asarray(bnd), c, w)
        specs[s.local.layout.key(c)] = P(ax)

    def body(key):
        j = jax.lax.axis_index(ax) if n > 1 else 0
        out = {}
        for name, (starts, bnd, c, w) in tables.items():
            st, bd = starts[j], bnd[j]  # this device's pieces (then its padding rows: bound 0)

            def draw(k, r0, count, st=st, bd=bd, w=w):  # rows [r0, r0 + count) of this device's pool
                return init_rows(k, st, bd, r0, count, w, w, emb.weights_dtype)

            k = jax.random.fold_in(jax.random.fold_in(key, j), c)
            # a large pool block by block: init's scratch memory that of a block (tbe.INIT_BLOCK), per device
            block = max(1, init_block // w)
            out[name] = blocked_draw(k, lay.pool_rows[c], w, emb.weights_dtype, block, draw)
        return out

    return s._smap(body, P(), specs)(key)


@functools.partial(jax.jit, static_argnums=(0,))
def _sharded_opt_init(s, opt, params):
    ax = s.axis_name
    pspec = jax.tree_util.tree_map(lambda _: P(ax), params)
    local_shapes = {k: jax.ShapeDtypeStruct((v.shape[0] // s.num_devices,) + v.shape[1:], v.dtype)
                    for k, v in params.items()}
    sspec = s._state_specs(jax.eval_shape(lambda p: opt.init(p), local_shapes))

    def body(params, opt):
        return s.local.init_opt_state(params, opt)

    return s._smap(body, (pspec, P()), sspec)(params, opt)


def _host(x) -> np.ndarray:
    """A global array's value on the host (every process gets all of it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _gather_tables(s, tree, name):
    """Per table, its full array assembled on the host from the shards in `tree` (params, or a state
    field), returned as a jax array on the default device."""
    lay, emb = s.layout, s.emb
    host = {k: _host(v) for k, v in tree.items()}
    out = []
    for t, spec in enumerate(emb.tables):
        mine = [p for p in lay.pieces if p.table == t]
        if s.plan.strategies[t] == "data":
            mine = [p for p in mine if p.device == 0]
        parts = []
        for p in mine:
            c = lay.widths.index(p.cols)
            buf = host[s.local.layout.key(c)]
            r = p.device * lay.pool_rows[c] + lay.pool_row[p]
            parts.append(buf[r : r + p.rows])
        if s.plan.strategies[t] == "column" and parts[0].ndim == 2:
            full = np.concatenate(parts, axis=1)
        elif s.plan.strategies[t] == "column":  # a row-wise state field of a column-wise table: one copy
            full = parts[0]
        else:
            full = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        out.append(jnp.asarray(full))
    return tuple(out)
