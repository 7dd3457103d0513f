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
import inspect
from typing import Any, Callable, NamedTuple

try:
    import flax.linen as nn
    from flax.core import FrozenDict, freeze, unfreeze
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tbe_jax.linen needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax.layers_common import (
    TBE_OPTIONS, LayerOptions, check_ids, check_optimizer, check_options, layer_name, opt_init, sparse_lookup,
    sparse_value_and_grad,
)

FUSED_COLLECTION = "tbe_fused"

__all__ = ["FUSED_COLLECTION", "QUANT_COLLECTION", "QuantizedEmbed", "StepResult", "TableBatchedEmbed",
           "quantize_layer", "train_step"]


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
    """The Linen layer, generic over its functional core: a subclass names the core's `LayerOptions`
    (its class attribute `_OPTIONS = TBE_OPTIONS`), which become its dataclass fields
    (the first positional, the rest keyword-only) and the attribute giving its core (`tbe`, `tt`; built
    from the fields, memoised; a sharded one, `layers_common.shard_core`, for a layer built with a mesh).
    Variables: `"params"/"embedding"` (true-gradient mode) or `FUSED_COLLECTION/"embedding"` and
    `FUSED_COLLECTION/"opt_state"` (sparse mode).
    """

    def __init_subclass__(cls, **kwargs):
        options: LayerOptions | None = cls.__dict__.get("_OPTIONS")  # the subclass's core's
        if options is not None:  # the options as dataclass fields, before Linen's dataclass transform
            fields = {}
            for p in options.parameters:
                if p.kind is inspect.Parameter.KEYWORD_ONLY and "_" not in fields:
                    fields["_"] = dataclasses.KW_ONLY
                fields[p.name] = Any if p.annotation is inspect.Parameter.empty else p.annotation
                if p.default is not inspect.Parameter.empty:
                    setattr(cls, p.name, p.default)
            cls.__annotations__ = {**fields, **cls.__dict__.get("__annotations__", {})}
            cls.__doc__ = options.document(cls.__doc__)
        super().__init_subclass__(**kwargs)
        if options is not None:
            setattr(cls, options.attr, options.core_property(lambda self: self._build_core()))

    def __post_init__(self):
        # Builds the core: bad options fail here, with the core's messages.
        check_optimizer(self.optimizer, self._build_core(), self._OPTIONS.makers)
        super().__post_init__()

    def _values(self) -> dict:
        return {n: getattr(self, n) for n in self._OPTIONS.names}

    def _build_core(self):
        return self._OPTIONS.build(self._values())

    def _init_params(self, key):
        return self._OPTIONS.init_params(self._build_core(), self._values(), key)

    @nn.compact
    def __call__(self, indices, offsets, per_sample_weights=None, **options):
        options = self._OPTIONS.lookup_options(options)
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
    """Table-batched embedding bags as a Linen module (over `tbe_jax.TableBatchedEmbedding`, `layer.tbe`).

    Variables: with `optimizer=None` the tables are the parameter `"embedding"` in `"params"`; with a sparse
    optimizer the tables, `"embedding"`, and the optimizer state, `"opt_state"`, live in the `"tbe_fused"`
    collection (train with `tbe_jax.linen.train_step`, see the module docstring). With a mesh, copy tables
    in with `layer.tbe.set_tables(None, tables)`.

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

    _OPTIONS = TBE_OPTIONS


QUANT_COLLECTION = "tbe_quantized"


class QuantizedEmbed(nn.Module):
    """Inference layer over a `tbe_jax.QuantizedTableBatchedEmbedding` (`qemb`): the quantized rows are the
    variable `QUANT_COLLECTION/"qparams"` (not a parameter: nothing trains them). `quantize_layer` makes one
    from a trained `TableBatchedEmbed`; put the qparams it returns at the layer's path in that collection.

    Example:
      >>> import jax, jax.numpy as jnp, tbe_jax
      >>> from tbe_jax.linen import TableBatchedEmbed, quantize_layer
      >>> layer = TableBatchedEmbed([tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)], impl="xla")
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> variables = layer.init(jax.random.key(0), indices, offsets)
      >>> serving, qparams = quantize_layer(layer, variables["params"]["embedding"], "int8")
      >>> out = serving.apply({"tbe_quantized": {"qparams": qparams}}, indices, offsets)
      >>> out.shape, out.dtype
      ((2, 12), dtype('float16'))
    """

    qemb: Any

    @nn.compact
    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        q = self.variable(QUANT_COLLECTION, "qparams", self.qemb.zero_params)
        return self.qemb(q.value, indices, offsets, per_sample_weights, batch_size_per_feature=batch_size_per_feature,
                         max_batch_size=max_batch_size)


def quantize_layer(layer: "TableBatchedEmbed", embedding, weight_dtype, **quantize_options):
    """`(QuantizedEmbed, qparams)`: the serving layer of a trained `TableBatchedEmbed` and its quantized rows.
    `embedding`: the layer's `"embedding"` variable (from `"params"`, or from `"tbe_fused"` in sparse mode);
    `weight_dtype` and `quantize_options` as `tbe_jax.quantize`'s."""
    from tbe_jax.quant import quantize
    from tbe_jax.tbe import TableBatchedEmbedding

    core = layer.tbe
    if not isinstance(core, TableBatchedEmbedding):
        raise TypeError(f"quantize_layer takes an unsharded TableBatchedEmbed; this layer's core is "
                        f"{type(core).__name__}")
    qemb, qparams = quantize(core, unfreeze(embedding) if isinstance(embedding, FrozenDict) else embedding,
                             weight_dtype, **quantize_options)
    return QuantizedEmbed(qemb), qparams
