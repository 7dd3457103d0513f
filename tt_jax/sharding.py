"""TT tables over the devices of a mesh: `tt_jax.shard(emb, mesh, axis_name)`.

The same API as `tbe_jax.shard` for a `tt_jax.TTEmbeddingBag`: inputs are per device (`indices [n, N]`,
`offsets [n, F*b + 1]`, row k being device k's local batch of b samples in `emb`'s format, both sharded
over `axis_name`), the output is `[n*b, sum D]` (device k's sample i at row `k*b + i`), sharded likewise,
and every result equals `emb` on the global batch (device 0's samples, then device 1's, ...).

Design: data parallel (strategy `"data"` for every table, the only one today). TT cores are small (a table
of millions of rows is a few MB of cores), so every device holds all the cores, replicated (`P()`), with
their optimizer state:

- Forward: each device runs `emb` on its own local batch inside one `jax.shard_map` (no communication);
  the output is sharded over the axis.
- Update (`apply_gradients`, `tbe_jax.train_step`): one `all_gather` brings every device's ids, offsets,
  per-sample weights and output gradient (packed in one int32 buffer) to every device; each device
  rebuilds the global batch in `emb`'s input format (feature-major offsets: feature f's bags of device 0,
  then of device 1, ...; the ids compacted) and runs `emb.apply_gradients` on it. Every device runs the
  same program on the same values, so the replicas stay bitwise identical, and the step is exactly the
  unsharded one on the global batch (each touched core slice updated once, with the whole batch's
  gradient).

Costs, per step and device: the all_gather moves `n` times the local ids (and weights) and the local
output gradient `[b, sum D]`; every device then runs the whole global batch's backward and optimizer step
on its replica (the backward's work is not split, only the forward's). Memory: all cores and their state
on every device. The Pallas backward is deterministic, and so is everything on a CPU; the XLA backward's
float scatter-adds on a GPU need not be, and there identical inputs could leave the replicas a rounding
apart. So in that one case (`sync_replicas=None`, the default; True or False forces it) device 0's updated
cores and state are broadcast after each step (an all-reduce of their bits, zeros from the other devices:
exact), which moves the cores and state once more per step.

True gradient: `jax.grad` (or `value_and_grad`, under `jax.jit`) of a loss through the forward with respect
to the replicated cores is `emb`'s gradient on the global batch, replicated (what a dense optax optimizer
needs; the TT layers' `optimizer=None` mode). Each device's lookup differentiates its own local batch (its
custom VJP, as unsharded) and the devices' shares are summed over the axis by one `psum` in the backward:
with `shard_map`'s type checks on (`check_vma=True`: the XLA path, compiled Pallas kernels) the forward marks
the cores varying over the axis (`lax.pcast(..., to="varying")`), whose transpose is that `psum`; with them off
(`_smap` turns them off for the Pallas kernels in interpret mode, on a CPU, where the interpreter trips on the
varying-axes types) there is no such type, and `shard_map`'s own transpose sums the cotangent of a replicated
input over the axis (the same `psum`). The sum runs over devices rather than over the batch, so the gradient
equals the unsharded one up to float rounding (the order of the additions). The gradient with respect to the
per-sample weights is per device, sharded like them. Costs: one all-reduce of the cores' gradient per step.

Bounds checks: `emb.bounds_check` "ignore", "none" and "warning" behave as unsharded (in "warning" each
device repairs its own offsets, and the counts are summed over the devices before the one warning);
"fatal" is not supported.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tbe_jax import bounds
from tbe_jax.sharding import ShardingPlan
from tt_jax import optim
from tbe_jax.inputs import check_weights, narrow_ids
from tt_jax.tt import TTEmbeddingBag, narrow_offsets

__all__ = ["STRATEGIES", "ShardedTTEmbeddingBag", "ShardingPlan", "plan_sharding", "shard"]

STRATEGIES = ("data",)
_OTHERS = ("table", "row", "column")  # tbe_jax.shard's other strategies: not (yet) for TT tables


def plan_sharding(emb: TTEmbeddingBag, num_devices: int, plan=None) -> ShardingPlan:
    """One strategy per table: `"data"` (cores replicated) for every table.

    `plan`: None, a `ShardingPlan`, one strategy for every table, a sequence of one strategy
    per table, or a dict `{table index: strategy}` (the tables it leaves out get `"data"`).
    """
    n = int(num_devices)
    if n < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    nt = len(emb.specs)
    if isinstance(plan, ShardingPlan):
        strategies = list(plan.strategies)
        if len(strategies) != nt:
            raise ValueError(f"the plan has {len(strategies)} tables; the embedding has {nt}")
        if plan.num_devices != n:
            raise ValueError(f"the plan is for {plan.num_devices} devices; the mesh axis has {n}")
    elif plan is None:
        strategies = ["data"] * nt
    elif isinstance(plan, Mapping):
        strategies = ["data"] * nt
        for key, val in plan.items():
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)) or not 0 <= key < nt:
                raise ValueError(f"plan names table {key!r}: not a table index in [0, {nt})")
            strategies[int(key)] = val
    elif isinstance(plan, str):  # one strategy for every table
        strategies = [plan] * nt
    elif isinstance(plan, Sequence):
        strategies = list(plan)
        if len(strategies) != nt:
            raise ValueError(f"plan has {len(strategies)} strategies; the embedding has {nt} tables")
    else:
        raise TypeError(f"plan must be None, a ShardingPlan, a sequence or a dict, got {type(plan).__name__}")
    for t, s in enumerate(strategies):
        name = s[0] if isinstance(s, (tuple, list)) and s else s
        if name in _OTHERS:
            raise NotImplementedError(
                f"table {t}: strategy {s!r} is not supported for TT tables yet; TT cores are small, so "
                "tt_jax.shard replicates them (strategy 'data')")
        if s not in STRATEGIES:
            raise ValueError(f"table {t}: strategy must be one of {STRATEGIES}, got {s!r}")
    return ShardingPlan(tuple(strategies), (-1,) * nt, n)


def shard(emb: TTEmbeddingBag, mesh: jax.sharding.Mesh, axis_name: str = "data", plan=None, *,
          sync_replicas: bool | None = None) -> "ShardedTTEmbeddingBag":
    """`emb`'s tables over `mesh`'s axis `axis_name`; see `ShardedTTEmbeddingBag` and the module doc."""
    return ShardedTTEmbeddingBag(emb, mesh, axis_name, plan, sync_replicas=sync_replicas)


class ShardedTTEmbeddingBag:
    """A `TTEmbeddingBag` run data parallel over a mesh axis (cores replicated; see the module doc).

    Args:
      emb: the unsharded `TTEmbeddingBag` (tables, features, pooling, impl, config, bounds_check).
      mesh: a `jax.sharding.Mesh`; the batch is split over its axis `axis_name` (n = its size).
      plan: None (every table `"data"`), a `ShardingPlan`, a sequence or a dict of strategies; see
        `plan_sharding`.
      sync_replicas: broadcast device 0's cores and state after each update (exact, costs an all-reduce
        of the cores and state). None: only where the backward may not be deterministic (a GPU with the
        XLA backward, i.e. not `emb.pallas_backward`).

    Params are `emb`'s (`{"cores": per table group, per core}`, the stacked layout of `tt_jax.params`), each
    array replicated on the mesh; the optimizer state likewise. `init`, `set_cores`, `get_cores`, `full_table`,
    `init_opt_state`, `get_state`, `get_momentum` and `stack_opt_state` take and return them as `emb`'s do. The forward is differentiable with
    respect to them: `jax.grad` gives `emb`'s gradient on the global batch, replicated (the devices' shares
    summed over the axis; see the module doc).
    """

    def __init__(self, emb, mesh, axis_name="data", plan=None, *, sync_replicas=None):
        if not isinstance(emb, TTEmbeddingBag):
            raise TypeError(f"emb must be a tt_jax.TTEmbeddingBag, got {type(emb).__name__}")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        if emb.bounds_check == "fatal":
            raise ValueError('a sharded TT embedding supports bounds_check "ignore", "none" and "warning"; '
                             '"fatal" is not supported')
        if sync_replicas is not None and not isinstance(sync_replicas, bool):
            raise TypeError(f"sync_replicas must be None or a bool, got {sync_replicas!r}")
        n = int(mesh.shape[axis_name])
        self.emb = emb
        self.mesh = mesh
        self.axis_name = axis_name
        self.num_devices = n
        self.plan = plan_sharding(emb, n, plan)
        self.sync_replicas = sync_replicas
        # The per-device embedding: emb itself, except that "warning" is handled here (repair and count per
        # device, one warning for the mesh): the local lookups skip bad ids as "ignore" does.
        self.local = emb if emb.bounds_check != "warning" else TTEmbeddingBag(
            emb.specs, feature_table_map=emb.feature_table_map, pooling=emb.pooling, impl=emb.impl,
            interpret=emb.interpret, config=emb.config, bounds_check="ignore")

    # -- identity ----------------------------------------------------------------
    def _key(self):
        return (self.emb, self.mesh, self.axis_name, self.plan, self.sync_replicas)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ShardedTTEmbeddingBag) and self._key() == other._key()

    def __repr__(self):
        return f"ShardedTTEmbeddingBag({len(self.emb.specs)} tables, {self.num_devices} devices, data parallel)"

    @property
    def strategies(self) -> tuple[str, ...]:
        return self.plan.strategies

    @property
    def specs(self):
        return self.emb.specs

    @property
    def feature_table_map(self):
        return self.emb.feature_table_map

    @property
    def _sync(self) -> bool:
        if self.sync_replicas is not None:
            return self.sync_replicas
        return self.num_devices > 1 and jax.default_backend() == "gpu" and not self.emb.pallas_backward

    def uses_kernel(self) -> bool:
        """Whether the per-device lookups run the Pallas kernels (`emb.uses_kernel()`)."""
        return self.emb.uses_kernel()

    def check_optimizer(self, opt) -> None:
        """As `emb.check_optimizer`: every optimizer the TT cores support runs data parallel."""
        self.emb.check_optimizer(opt)

    # -- placement ---------------------------------------------------------------
    def _smap(self, f, in_specs, out_specs):
        # As tbe_jax.shard: the Pallas kernels in interpret mode trip the interpreter on shard_map's
        # varying-axes types; compiled kernels and the XLA path run under the default checks. Either way the
        # replicated cores' cotangent is summed over the axis (see `_varying`).
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=self._check_vma)

    @property
    def _check_vma(self) -> bool:
        return not (self.emb.interpret and self.emb.resolved_impl == "pallas")

    def _explicit(self) -> bool:
        types = getattr(self.mesh, "axis_types", None)
        if not types:
            return False
        return "Explicit" in str(dict(zip(self.mesh.axis_names, types))[self.axis_name])

    def _place(self, x, spec):
        """`x` placed as `spec` on the mesh (under jit: `reshard` on an explicit axis, else a sharding
        constraint; eagerly: a transfer unless it is there already)."""
        sh = NamedSharding(self.mesh, spec)
        if isinstance(x, jax.core.Tracer):
            # An explicit axis needs `reshard`, except to replicate a value that carries no mesh type (drawn or
            # passed in unsharded under jit): there the constraint works without the jit knowing the mesh.
            mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            typed = mesh is not None and not mesh.empty
            if self._explicit() and (typed or any(a is not None for a in spec)):
                return jax.sharding.reshard(x, sh)
            return jax.lax.with_sharding_constraint(x, sh)
        if getattr(x, "sharding", None) == sh:
            return x
        return jax.device_put(x, sh)

    def _replicate(self, tree):
        return jax.tree_util.tree_map(lambda x: self._place(jnp.asarray(x), P()), tree)

    # -- parameters ----------------------------------------------------------------
    def init(self, key: jax.Array, init: str = "approx-normal", std: float | None = None) -> dict:
        """`emb.init(key, init, std)` (the same values), replicated on the mesh."""
        return self._replicate(self.emb.init(key, init, std))

    def set_cores(self, params, cores) -> dict:
        """`emb.set_cores`, replicated on the mesh."""
        return self._replicate(self.emb.set_cores(params, cores))

    def get_cores(self, params) -> list[list[jax.Array]]:
        return self.emb.get_cores(params)

    def full_table(self, params) -> list[jax.Array]:
        return self.emb.full_table(params)

    def init_opt_state(self, params, opt):
        """`emb.init_opt_state(params, opt)`, replicated on the mesh."""
        self.check_params(params)
        return self._replicate(self.emb.init_opt_state(params, opt))

    def get_state(self, opt_state, name: str):
        return self.emb.get_state(opt_state, name)

    def get_momentum(self, opt_state):
        return self.emb.get_momentum(opt_state)

    def stack_opt_state(self, opt_state):
        """`emb.stack_opt_state` (per-table state of earlier releases to the stacked layout), replicated."""
        return self._replicate(self.emb.stack_opt_state(opt_state))

    def to_unsharded(self, params, opt_state=None):
        """`(params, opt_state)` in `emb`'s format (the same arrays: the format does not depend on the mesh)."""
        return params, opt_state

    def from_unsharded(self, emb_params, emb_opt_state=None):
        """`emb`'s params (and optimizer state) replicated on this mesh."""
        self.check_params(emb_params)
        if emb_opt_state is not None and "count" not in getattr(emb_opt_state, "_fields", ()):
            raise TypeError(f"emb_opt_state must be an optimizer state of emb (emb.init_opt_state's), got "
                            f"{type(emb_opt_state).__name__}")
        return self._replicate(emb_params), (None if emb_opt_state is None else self._replicate(emb_opt_state))

    def check_params(self, params) -> None:
        """Raises unless `params` are `emb`'s (`emb.check_params`: `{"cores": per table group, per core}`, the
        stacked layout of `tt_jax.params`)."""
        self.emb.check_params(params)

    # -- inputs --------------------------------------------------------------------
    def _args(self, indices, offsets, per_sample_weights):
        """Checked inputs: int32 (ids narrowed without wrapping, as `emb`), float32 weights, placed over the axis."""
        n = self.num_devices
        indices = indices if isinstance(indices, (jax.Array, np.ndarray)) else jnp.asarray(indices)
        offsets = offsets if isinstance(offsets, (jax.Array, np.ndarray)) else jnp.asarray(offsets)
        for name, x in (("indices", indices), ("offsets", offsets)):
            if x.ndim != 2 or x.shape[0] != n:
                raise ValueError(f"{name} must be [n, ...] with n={n} (one row per device of axis "
                                 f"{self.axis_name!r}), got shape {tuple(x.shape)}")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must hold integers, got {x.dtype}")
        nf = len(self.emb.feature_table_map)
        if offsets.shape[1] < 1 or (offsets.shape[1] - 1) % nf:
            raise ValueError(f"offsets has {offsets.shape[1]} entries per device; expected F*b+1 with F={nf}")
        if per_sample_weights is not None:
            try:
                per_sample_weights = jnp.asarray(per_sample_weights)
            except (TypeError, ValueError) as e:
                raise TypeError(f"per_sample_weights must be a float array: {e}") from None
            check_weights(per_sample_weights, indices)  # as emb: no int / bool / complex
            per_sample_weights = per_sample_weights.astype(jnp.float32)
        spec = P(self.axis_name)
        indices = self._place(jnp.asarray(narrow_ids(indices)), spec)
        offsets = self._place(jnp.asarray(narrow_offsets(offsets)), spec)
        if per_sample_weights is not None:
            per_sample_weights = self._place(per_sample_weights, spec)
        return indices, offsets, per_sample_weights

    def _batch(self, offsets) -> int:
        return (offsets.shape[1] - 1) // len(self.emb.feature_table_map)

    @property
    def _total_dim(self) -> int:
        return sum(self.emb.specs[t].embedding_dim for t in self.emb.feature_table_map)

    def _grad(self, grad_output, b):
        grad_output = jnp.asarray(grad_output)
        want = (self.num_devices * b, self._total_dim)
        if tuple(grad_output.shape) != want:
            raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}; this batch's output is {want}")
        if not jnp.issubdtype(grad_output.dtype, jnp.floating):
            raise TypeError(f"grad_output must be floating point, got {grad_output.dtype}")
        return self._place(grad_output.astype(jnp.float32), P(self.axis_name))

    # -- forward -------------------------------------------------------------------
    def __call__(self, params, indices, offsets, per_sample_weights=None):
        """The pooled lookups of the global batch: `[n*b, sum D]`, sharded over the axis."""
        out, _ = self.forward_with_report(params, indices, offsets, per_sample_weights)
        return out

    def forward_with_report(self, params, indices, offsets, per_sample_weights=None):
        """`(out, tbe_jax.BoundsReport)`: the lookup, and the bad ids / repaired offsets entries summed over
        the devices (counted with `bounds_check="warning"`, zeros otherwise)."""
        return self._lookup(params, *self._args(indices, offsets, per_sample_weights))

    def _lookup(self, params, idx, off, psw):
        self.check_params(params)
        out, rep = _forward(self, self._replicate(params), idx, off, psw)
        if self.emb.bounds_check == "warning":
            bounds.warn_if_repaired(rep, package="tt_jax.shard")
        return out, rep

    # -- optimizer step ------------------------------------------------------------
    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None):
        """One optimizer step: `(params, opt_state)`, equal to `emb.apply_gradients` on the global batch."""
        self.check_optimizer(opt)
        self.check_params(params)
        optim.check_state(opt, opt_state, params)
        idx, off, psw = self._args(indices, offsets, per_sample_weights)
        g = self._grad(grad_output, self._batch(off))
        return _update(self, self._replicate(params), self._replicate(opt_state), opt, idx, off, psw, g)

    # -- tbe_jax.train_step ----------------------------------------------------------
    def step_forward(self, params, indices, offsets, per_sample_weights=None, **options):
        """The lookup of the global batch, and what `step_update` needs of it (the placed inputs, the report)."""
        if options:
            raise ValueError(f"a sharded TT embedding takes no lookup options, got {sorted(options)}")
        idx, off, psw = self._args(indices, offsets, per_sample_weights)
        out, rep = self._lookup(params, idx, off, psw)
        return out, (idx, off, psw, rep)

    def step_update(self, params, opt_state, opt, residuals, grad_output):
        """`apply_gradients` on `step_forward`'s batch: `(params, opt_state, invalid_indices)`."""
        idx, off, psw, rep = residuals
        self.check_optimizer(opt)
        optim.check_state(opt, opt_state, params)
        g = self._grad(grad_output, self._batch(off))
        params, opt_state = _update(self, self._replicate(params), self._replicate(opt_state), opt, idx, off, psw, g)
        return params, opt_state, rep.invalid_indices


# -- the programs ------------------------------------------------------------------------------


def _zero_report():
    return bounds.BoundsReport(jnp.int32(0), jnp.int32(0))


def _varying(tree, ax):
    """`tree`'s (replicated, invariant) arrays typed as varying over `ax` inside `shard_map` (no work, no
    communication): `lax.pcast(..., to="varying")`, or `lax.pvary` on a jax without `pcast`.

    Why: each device's lookup differentiates its local batch, so its cotangent for the cores is that device's
    share, typed varying; `shard_map` (with `check_vma=True`) refuses it for an invariant input, and the
    custom VJP's type check fails. Marking the cores varying makes the cotangent's type match, and the
    transpose of the cast is a `psum` over `ax`: the cores' gradient is the sum of the devices' shares, i.e.
    the gradient on the global batch. With `check_vma=False` (the Pallas kernels in interpret mode, see
    `_smap`) there are no such types; there `shard_map`'s own transpose sums the cotangent of a replicated
    input over the axes it is not split on (the same `psum`), and the cast is not needed.
    """
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return jax.tree_util.tree_map(lambda x: pcast(x, (ax,), to="varying"), tree)
    return jax.lax.pvary(tree, (ax,))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(s: ShardedTTEmbeddingBag, params, idx, off, psw):
    ax = s.axis_name
    warn = s.emb.bounds_check == "warning"
    check = s._check_vma

    def body(params, idx, off, psw):
        idx, off = idx[0], off[0]
        psw = None if psw is None else psw[0]
        if check:  # the replicated cores typed varying: their cotangent is summed over the axis (see _varying)
            params = _varying(params, ax)
        rep = _zero_report()
        if warn:
            off, rep = bounds.report(s.emb.feature_plan((off.shape[0] - 1) // len(s.emb.feature_table_map)),
                                     idx, off)
            rep = jax.lax.psum(rep, ax)
        return s.local(params, idx, off, psw), rep

    spec = P(ax)
    f = s._smap(body, (P(), spec, spec, None if psw is None else spec), (spec, P()))
    return f(params, idx, off, psw)


def _gather(s, idx, off, psw, g):
    """Every device's (ids [n, cap], offsets [n, F*b+1], weights [n, cap] or None, grads [n*b, sum D]),
    by one all_gather of an int32 buffer (the floats as bits: exact), typed invariant over the axis."""
    parts = [idx, off] + ([] if psw is None else [jax.lax.bitcast_convert_type(psw, jnp.int32)])
    parts.append(jax.lax.bitcast_convert_type(g, jnp.int32).reshape(-1))
    sizes = [p.shape[0] for p in parts]
    packed = jax.lax.all_gather(jnp.concatenate(parts), s.axis_name, tiled=False, to="invarying")  # [n, L]
    cuts = np.cumsum(sizes)[:-1]
    out = jnp.split(packed, cuts, axis=1)
    ids, offs = out[0], out[1]
    w = None if psw is None else jax.lax.bitcast_convert_type(out[2], jnp.float32)
    gg = jax.lax.bitcast_convert_type(out[-1], jnp.float32).reshape((-1,) + g.shape[1:])
    return ids, offs, w, gg


def _global_batch(ids, offs, w, nf: int):
    """The devices' local batches as one batch in `emb`'s format: offsets feature-major (feature f's bags
    of device 0, then device 1's, ...), ids compacted (positions past the last bag: -1, weight 0)."""
    n, cap = ids.shape
    b = (offs.shape[1] - 1) // nf
    total = n * cap
    if nf * b == 0 or total == 0:
        return jnp.full((total,), -1, jnp.int32), jnp.zeros((n * nf * b + 1,), jnp.int32), (
            None if w is None else jnp.zeros((total,), jnp.float32))
    lens = (offs[:, 1:] - offs[:, :-1]).reshape(n, nf, b)
    glen = jnp.transpose(lens, (1, 0, 2)).reshape(-1)  # bag (f, k, i)
    goff = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(glen, dtype=jnp.int32)])
    starts = jnp.transpose(offs[:, :-1].reshape(n, nf, b), (1, 0, 2)).reshape(-1)  # its first local position
    src_dev = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :, None], (nf, n, b)).reshape(-1)
    nbags = glen.shape[0]
    # Each global position's bag: the number of bag starts after the first at or before it (empty bags
    # add their boundary twice and are skipped).
    marks = jnp.zeros((total,), jnp.int32).at[goff[1:-1]].add(1, mode="drop")
    bag = jnp.clip(jnp.cumsum(marks), 0, nbags - 1)
    p = jnp.arange(total, dtype=jnp.int32)
    live = p < goff[-1]
    k = src_dev[bag]
    src = jnp.clip(starts[bag] + p - goff[bag], 0, cap - 1)
    gids = jnp.where(live, ids[k, src], -1)
    gw = None if w is None else jnp.where(live, w[k, src], 0.0)
    return gids, goff, gw


def _broadcast0(tree, ax):
    """Device 0's values on every device (an all-reduce of their bits, zeros elsewhere: exact)."""
    first = jax.lax.axis_index(ax) == 0

    def one(x):
        x = jnp.asarray(x)
        if x.dtype.itemsize == 4:
            bits = jax.lax.bitcast_convert_type(x, jnp.int32) if x.dtype != jnp.int32 else x
            out = jax.lax.psum(jnp.where(first, bits, 0), ax)
            return jax.lax.bitcast_convert_type(out, x.dtype) if x.dtype != jnp.int32 else out
        if x.dtype.itemsize == 2:
            bits = jax.lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32)
            out = jax.lax.psum(jnp.where(first, bits, 0), ax)
            return jax.lax.bitcast_convert_type(out.astype(jnp.int16), x.dtype)
        return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), ax)

    return jax.tree_util.tree_map(one, tree)


@functools.partial(jax.jit, static_argnums=(0,))
def _update(s: ShardedTTEmbeddingBag, params, opt_state, opt, idx, off, psw, g):
    ax, n = s.axis_name, s.num_devices
    nf = len(s.emb.feature_table_map)

    def body(params, opt_state, opt, idx, off, psw, g):
        idx, off = idx[0], off[0]
        psw = None if psw is None else psw[0]
        if s.emb.bounds_check == "warning":  # repaired per device, silently (as emb.apply_gradients does)
            off, _ = bounds.repair_offsets(off, idx.shape[0])
        ids, offs, w, gg = _gather(s, idx, off, psw, g)
        gids, goff, gw = _global_batch(ids, offs, w, nf)
        params, opt_state = s.local.apply_gradients(params, opt_state, opt, gids, goff, gg, gw)
        if s._sync and n > 1:
            params, opt_state = _broadcast0((params, opt_state), ax)
        return params, opt_state

    spec = P(ax)
    f = s._smap(body, (P(), P(), P(), spec, spec, None if psw is None else spec, spec), (P(), P()))
    return f(params, opt_state, opt, idx, off, psw, g)
