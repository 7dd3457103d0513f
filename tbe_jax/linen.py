"""Flax Linen layer over `tbe_jax.TableBatchedEmbedding`, and the sparse training step.

`TableBatchedEmbed` is an `nn.Module` wrapping one functional `TableBatchedEmbedding`
(available as `layer.tbe`, also on an unbound module). It trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The tables are one parameter,
   `"embedding"`, in the `"params"` collection, holding the functional core's params
   dict (`{"d8": [rows, 8], ...}`, one buffer per distinct embedding dim, see
   `layer.tbe.layout`). `jax.grad` over the params gives the exact, dense gradient of the
   tables and any optax optimizer consumes it:

   >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, tbe_jax
   >>> from tbe_jax.linen import TableBatchedEmbed
   >>> tables = [tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> class Model(nn.Module):
   ...     optimizer: tbe_jax.Optimizer | None = None
   ...     @nn.compact
   ...     def __call__(self, indices, offsets):
   ...         pooled = TableBatchedEmbed(tables, pooling="mean", impl="xla", optimizer=self.optimizer,
   ...                                    name="embed")(indices, offsets)
   ...         return nn.Dense(1)(pooled)[:, 0]
   >>> model = Model()
   >>> params = model.init(jax.random.key(0), indices, offsets)["params"]
   >>> jax.tree.map(jnp.shape, params["embed"])
   {'embedding': {'d4': (50, 4), 'd8': (100, 8)}}
   >>> tx = optax.adam(0.05)
   >>> opt_state = tx.init(params)
   >>> @jax.jit
   ... def dense_step(params, opt_state):
   ...     def loss_fn(params):
   ...         return jnp.mean((model.apply({"params": params}, indices, offsets) - labels) ** 2)
   ...     loss, grads = jax.value_and_grad(loss_fn)(params)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     return optax.apply_updates(params, updates), opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, opt_state, loss = dense_step(params, opt_state)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True

2. **Sparse optimizer** (`optimizer=` any of `tbe_jax.optim`: `SGD`, `RowwiseAdagrad`, `Adagrad`, `Adam`,
   `PartialRowwiseAdam`, `Lamb`, `PartialRowwiseLamb`).
   The tables are not parameters: they and the optimizer state live in the collection
   `FUSED_COLLECTION = "tbe_fused"`, as `{"embedding": {"d8": ...}, "opt_state":
   RowwiseAdagradState(...)}` under the layer's path. `train_step(loss_fn, variables,
   *args)` runs `loss_fn(variables, *args)` (which calls `model.apply`), differentiates
   it with respect to `variables["params"]` and to each sparse layer's output, applies
   the layer's optimizer to the rows the batch looked up (once per row, with the
   gradient summed over the batch: `TableBatchedEmbedding.apply_gradients`), and
   returns the loss, the dense gradient (for any optax optimizer) and the variables
   with the new tables and state:

   >>> model = Model(optimizer=tbe_jax.RowwiseAdagrad(learning_rate=0.5))
   >>> variables = model.init(jax.random.key(0), indices, offsets)
   >>> sorted(variables["tbe_fused"]["embed"])
   ['embedding', 'opt_state']
   >>> opt_state = tx.init(variables["params"])     # no Adam moments for the tables
   >>> def loss_fn(variables, indices, offsets):
   ...     return jnp.mean((model.apply(variables, indices, offsets) - labels) ** 2)
   >>> @jax.jit
   ... def sparse_step(variables, opt_state, indices, offsets):
   ...     loss, grads, variables = tbe_jax.linen.train_step(loss_fn, variables, indices, offsets)
   ...     updates, opt_state = tx.update(grads, opt_state, variables["params"])
   ...     variables = {**variables, "params": optax.apply_updates(variables["params"], updates)}
   ...     return variables, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     variables, opt_state, loss = sparse_step(variables, opt_state, indices, offsets)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> core = TableBatchedEmbed(tables, pooling="mean", impl="xla").tbe   # what Model's layer wraps
   >>> [m.shape for m in core.get_momentum(variables["tbe_fused"]["embed"]["opt_state"])]
   [(100,), (50,)]

   Rules of the sparse path: call each sparse layer at most once per loss (a second
   call raises `ValueError`), directly in the loss (not inside a nested `jit`/`vmap`/
   `remat`). A layer whose output does not reach the loss gets a zero gradient: its
   rows do not move. Differentiating the `"tbe_fused"` collection yourself raises a
   `TypeError`. Donate `variables` to the jitted step (`donate_argnums`) so the tables
   are updated without a copy on the kernel path. A learning rate that is a float is
   part of the model (a new value recompiles); pass `jnp.asarray(lr)` through the
   model's attributes, or an optax schedule (it reads the state's step count), to
   change it without recompiling.

The functional core: `layer.tbe` is the wrapped `TableBatchedEmbedding`, so
`layer.tbe.get_tables(variables["params"]["embed"]["embedding"])` (or
`variables["tbe_fused"]["embed"]["embedding"]` in sparse mode) gives the per-table
`[E_t, D_t]` arrays and `layer.tbe.get_momentum(...["opt_state"])` the row-wise
accumulators. `tt_jax.linen.TTEmbeddingBag` is the same layer over a tensor-train
core; one `train_step` serves models holding both.

Sharding: `TableBatchedEmbed(tables, ..., mesh=mesh, axis_name="data", sharding_plan=...)`
spreads the tables over a mesh axis (`tbe_jax.shard`): `layer.tbe` is then the
`ShardedTableBatchedEmbedding`, `"embedding"` (and `"opt_state"`) hold its sharded
params (and state), and the layer takes each device's local batch (`indices [n, N]`,
`offsets [n, F*b+1]`) and returns the global batch's `[n*b, sum D]`; `train_step`
runs the sharded sparse update. See `TableBatchedEmbed`'s arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax.numpy as jnp

try:
    import flax.linen as nn
    from flax.core import FrozenDict, freeze, unfreeze
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tbe_jax.linen needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax.layers_common import (
    as_tuple, cached_core, check_ids, check_optimizer, check_options, layer_name, opt_init, shard_core, sparse_lookup,
    sparse_value_and_grad,
)
from tbe_jax.kernels.forward import ForwardConfig
from tbe_jax.kernels.histogram import HistogramConfig
from tbe_jax.optim import Optimizer
from tbe_jax.sharding import ShardedTableBatchedEmbedding
from tbe_jax.specs import TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

FUSED_COLLECTION = "tbe_fused"

__all__ = ["FUSED_COLLECTION", "StepResult", "TableBatchedEmbed", "train_step"]


class StepResult(NamedTuple):
    """What `train_step` returns."""

    loss: Any  # the loss, or (loss, aux) with has_aux=True (as jax.value_and_grad)
    grads: Any  # gradient of the loss with respect to variables["params"]
    variables: Any  # the variables with the sparse layers' new tables and optimizer state


def train_step(loss_fn: Callable, variables, *args, has_aux: bool = False, optimizer=None,
               with_report: bool = False) -> StepResult:
    """One training step of a Linen model holding sparse-mode embedding layers.

    Args:
      loss_fn: `loss_fn(variables, *args) -> loss` (or `(loss, aux)` with `has_aux`);
        it calls `model.apply(variables, ...)`. It must call each sparse layer at most
        once, and be a pure function of its arguments (it is traced twice).
      variables: the model's variables (`model.init`'s result): `"params"` is
        differentiated, `FUSED_COLLECTION` holds the sparse layers' tables and state.
      *args: passed to `loss_fn` (not differentiated).
      has_aux: as in `jax.value_and_grad`.
      optimizer: this step's optimizer for the sparse layers, in place of the ones they were built with: an
        optimizer of `tbe_jax.optim` (every layer) or a dict from a layer's path ("embed", "tower/embed") to
        one; each of the layer's kind. Given as an argument of the jitted step, its hyperparameters are
        values: a new learning rate does not recompile (a layer's own optimizer is part of the model).
      with_report: also return `{layer path: tbe_jax.StepReport}` (device counts of invalid ids and
        non-finite output gradients), as `(StepResult, reports)`.

    Returns:
      `StepResult(loss, grads, variables)`: the loss (or `(loss, aux)`), the gradient
      with respect to `variables["params"]` for your optax optimizer (`{}` when the
      model has no `"params"`), and `variables` with every sparse layer that
      `loss_fn` called updated by its optimizer (the rows its batch looked up, once,
      with the gradient of its output), the rest as given. Jittable; donate
      `variables` for in-place table updates.
    """
    frozen = isinstance(variables, FrozenDict)
    variables = unfreeze(variables) if frozen else dict(variables)
    has_params = "params" in variables

    def fn(params):
        return loss_fn({**variables, "params": params} if has_params else variables, *args)

    value, grads, updates = sparse_value_and_grad(fn, variables.get("params", {}), has_aux=has_aux,
                                                  optimizer=optimizer)
    if updates:
        fused = _copy_tree(variables.get(FUSED_COLLECTION, {}))
        for u in updates:
            kind, path = u.key
            if kind != "linen":
                raise TypeError(f"tbe_jax.linen.train_step ran a sparse layer of another framework ({kind})")
            node = fused
            for name in path:
                node = node.setdefault(name, {})
            node["embedding"], node["opt_state"] = u.params, u.opt_state
        variables[FUSED_COLLECTION] = fused
    result = StepResult(value, grads, freeze(variables) if frozen else variables)
    return (result, {layer_name(u.key): u.report for u in updates}) if with_report else result


def _copy_tree(tree):
    """Nested dicts copied (leaves shared), so writing into the copy leaves the caller's variables alone."""
    if isinstance(tree, (dict, FrozenDict)):
        return {k: _copy_tree(v) for k, v in tree.items()}
    return tree


class SparseEmbedBase(nn.Module):
    """The Linen layer, generic over its functional core (subclassed by `TableBatchedEmbed` and
    `tt_jax.linen.TTEmbeddingBag`).

    A subclass declares the fields (its core's options and `optimizer`) and defines
    `_build_core()` (the core, cached; a sharded one, `layers_common.shard_core`, for a layer
    built with a mesh), `_init_params(key)` and `__call__` (decorated
    with `nn.compact`), which calls `self._embed(indices, offsets, per_sample_weights,
    options)`. Variables: `"params"/"embedding"` (true-gradient mode) or
    `FUSED_COLLECTION/"embedding"` and `FUSED_COLLECTION/"opt_state"` (sparse mode).
    """

    _MAKERS = ("tbe_jax.RowwiseAdagrad(...), tbe_jax.SGD, tbe_jax.Adagrad, tbe_jax.Adam, tbe_jax.PartialRowwiseAdam, "
               "tbe_jax.Lamb or tbe_jax.PartialRowwiseLamb")  # named in the error for a bad optimizer

    def __post_init__(self):
        # Builds the core: bad options fail here, with the core's messages.
        check_optimizer(self.optimizer, self._build_core(), self._MAKERS)
        super().__post_init__()

    def _build_core(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _init_params(self, key):
        return self._build_core().init(key)

    def _embed(self, indices, offsets, per_sample_weights, options: dict):
        check_ids(indices, offsets)
        core = self._build_core()
        check_options(core, options)
        if self.optimizer is None:
            params = self.param("embedding", self._init_params)
            return core(params, indices, offsets, per_sample_weights, **options)
        tables = self.variable(FUSED_COLLECTION, "embedding", lambda: self._init_params(self.make_rng("params")))
        state = self.variable(FUSED_COLLECTION, "opt_state", lambda: opt_init(core, self.optimizer, tables.value))
        path = tuple(self.scope.path)
        return sparse_lookup(("linen", path), core, self.optimizer, tables.value, state.value,
                             indices, offsets, per_sample_weights, options)


class TableBatchedEmbed(SparseEmbedBase):
    """Table-batched embedding bags as a Linen module.

    Args (the options of `tbe_jax.TableBatchedEmbedding`, `tables` positional, the
    rest keyword-only):
      tables: the `TableSpec`s.
      feature_table_map, pooling, weights_dtype, output_dtype, bounds_check, impl,
        interpret, kernel_config, use_histogram, histogram_config, backward_config, pad_rows:
        forwarded to `TableBatchedEmbedding` when not None (None: the core's default;
        `bounds_check`'s is "ignore").
      optimizer: None (true-gradient mode: the tables are the parameter
        `"embedding"` in `"params"`), or any optimizer of `tbe_jax.optim`
        (`RowwiseAdagrad(...)`, `SGD`, `Adam`, ...; sparse mode: the tables, `"embedding"`, and the optimizer
        state, `"opt_state"`, live in the `"tbe_fused"` collection; train with
        `tbe_jax.linen.train_step`, see the module docstring).
      mesh, axis_name, sharding_plan, capacity: shard the tables over the devices of
        `mesh`'s axis `axis_name` (default None: unsharded, the layer as before). The
        layer's core is then `tbe_jax.shard(TableBatchedEmbedding(...), mesh,
        axis_name, sharding_plan, capacity=capacity)` (see
        `tbe_jax.ShardedTableBatchedEmbedding`; `sharding_plan` None is the planner, a
        dict `{table: "table" | "row" | "column" | "data" | ("table", device)}` fixes
        some tables, a `ShardingPlan` all); its params (`"embedding"`) and optimizer
        state are the sharded core's, drawn by its `init` and placed on the mesh
        (each device draws its own shards: the values differ from the unsharded
        layer's; copy tables in with `layer.tbe.set_tables(None, tables)`). Inputs are
        then per device: `indices [n, N]`, `offsets [n, F*b+1]` (row k: device k's
        local batch of b samples), per-sample weights `[n, N]`; the output is the
        global batch's `[n*b, sum D]` (device k's samples at rows `k*b ...`), sharded
        over the axis. No lookup options (`batch_size_per_feature`, `max_batch_size`).
        Train in sparse mode with `train_step`, under `jax.jit`, on a mesh whose axis is
        `jax.sharding.AxisType.Auto` (with an explicit axis, jax asks the loss to state
        how its batch reductions are sharded). True-gradient mode works too (the
        gradient of `"embedding"` is sharded like it), except for replicated
        (`"data"`) tables, whose copies `jax.grad` cannot keep equal (`ValueError`).

    Call: `layer(indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None, max_batch_size=None)`,
    with the functional core's input format and output (`[B, sum_f D_f]` for pooled
    lookups; with a mesh, the per-device format above). Indices and offsets must be
    integer arrays (else `ValueError`).

    Parameters: `"embedding"` is exactly the functional core's params dict, so
    `layer.tbe(variables["params"]["embedding"], indices, offsets)` equals
    `layer.apply(variables, indices, offsets)`, and a core's params are copied in with
    `{"params": {"embedding": emb_params}}`. They are initialised by
    `layer.tbe.init(key)` (uniform in `[-1/sqrt(E), 1/sqrt(E)]`) with the key Linen
    hands to the parameter's initialiser (derived from the `"params"` rng and the
    module path, as for any Linen parameter).

    Example:
      >>> import jax, jax.numpy as jnp, tbe_jax
      >>> from tbe_jax.linen import TableBatchedEmbed
      >>> layer = TableBatchedEmbed([tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)], impl="xla")
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> variables = layer.init(jax.random.key(0), indices, offsets)
      >>> layer.apply(variables, indices, offsets).shape
      (2, 12)
      >>> [t.shape for t in layer.tbe.get_tables(variables["params"]["embedding"])]
      [(100, 8), (50, 4)]
    """

    tables: Sequence[TableSpec]
    _: dataclasses.KW_ONLY
    feature_table_map: Sequence[int] | None = None
    pooling: str = "sum"
    weights_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    bounds_check: str | None = None
    impl: str = "auto"
    interpret: bool = False
    kernel_config: ForwardConfig | None = None
    use_histogram: bool = True
    histogram_config: HistogramConfig | None = None
    backward_config: Any = None
    pad_rows: bool = True
    optimizer: Optimizer | None = None
    mesh: Any = None
    axis_name: str = "data"
    sharding_plan: Any = None
    capacity: int | tuple[int, ...] | None = None  # an int, or per-feature id counts (tbe_jax.shard)

    def _build_core(self) -> TableBatchedEmbedding | ShardedTableBatchedEmbedding:
        core = cached_core(TableBatchedEmbedding, as_tuple(self.tables), dict(
            feature_table_map=as_tuple(self.feature_table_map), pooling=self.pooling, weights_dtype=self.weights_dtype,
            output_dtype=self.output_dtype, bounds_check=self.bounds_check, impl=self.impl,
            interpret=bool(self.interpret), kernel_config=self.kernel_config, use_histogram=bool(self.use_histogram),
            histogram_config=self.histogram_config, backward_config=self.backward_config,
            pad_rows=bool(self.pad_rows)))
        return shard_core(core, self.mesh, self.axis_name, self.sharding_plan, self.capacity)

    @property
    def tbe(self) -> TableBatchedEmbedding | ShardedTableBatchedEmbedding:
        """The wrapped functional `TableBatchedEmbedding` (immutable, hashable); with a mesh, the
        `ShardedTableBatchedEmbedding` over it (the same methods: `get_tables`, `set_tables`,
        `get_momentum`, ...; `.emb` is the unsharded core)."""
        return self._build_core()

    @nn.compact
    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        options = {} if batch_size_per_feature is None else {"batch_size_per_feature": batch_size_per_feature}
        if max_batch_size is not None:
            options["max_batch_size"] = max_batch_size
        return self._embed(indices, offsets, per_sample_weights, options)
