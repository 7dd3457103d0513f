"""Haiku layer over `tbe_jax.TableBatchedEmbedding` (needs dm-haiku), and the sparse training step.

`TableBatchedEmbed` is an `hk.Module` wrapping one functional `TableBatchedEmbedding`
(`layer.tbe`). It trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The tables are parameters named
   after the functional core's storage buffers (`"d8"`, `"d128"`, ...; one per
   distinct embedding dim, see `layer.tbe.layout`), so a layer's parameter dict,
   `params["table_batched_embed"]`, *is* the core's params dict. `jax.grad` gives the
   exact, dense gradient; any optax optimizer applies it:

   >>> import jax, jax.numpy as jnp, optax, haiku as hk, tbe_jax
   >>> from tbe_jax.haiku import TableBatchedEmbed
   >>> tables = [tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> def forward(indices, offsets, optimizer=None):
   ...     pooled = TableBatchedEmbed(tables, pooling="mean", impl="xla", optimizer=optimizer,
   ...                                name="embed")(indices, offsets)
   ...     return hk.Linear(1)(pooled)[:, 0]
   >>> model = hk.without_apply_rng(hk.transform(forward))
   >>> params = model.init(jax.random.key(0), indices, offsets)
   >>> jax.tree.map(jnp.shape, params["embed"])
   {'d4': (50, 4), 'd8': (100, 8)}
   >>> tx = optax.adam(0.05)
   >>> opt_state = tx.init(params)
   >>> @jax.jit
   ... def dense_step(params, opt_state):
   ...     def loss_fn(params):
   ...         return jnp.mean((model.apply(params, indices, offsets) - labels) ** 2)
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
   The tables are not parameters: tables and optimizer state are Haiku *state*
   (`hk.get_state`; use `hk.transform_with_state`), named `"fused_d8"`, ... (tables)
   and `"fused_momentum_d8"`, `"fused_count"` (the state's leaves). `train_step(loss_fn,
   params, state, *args)` runs `loss_fn(params, state, *args)` (which calls
   `model.apply(params, state, ...)`), differentiates it with respect to `params` and
   to each sparse layer's output, applies the layer's optimizer to the rows the batch
   looked up (once per row, with the gradient summed over the batch:
   `TableBatchedEmbedding.apply_gradients`), and returns the loss, the dense gradient
   and the state with the new tables and optimizer state:

   >>> model = hk.without_apply_rng(hk.transform_with_state(forward))
   >>> adagrad = tbe_jax.RowwiseAdagrad(learning_rate=0.5)
   >>> params, state = model.init(jax.random.key(0), indices, offsets, adagrad)
   >>> sorted(state["embed"])
   ['fused_count', 'fused_d4', 'fused_d8', 'fused_momentum_d4', 'fused_momentum_d8']
   >>> opt_state = tx.init(params)                 # only the dense layer's params
   >>> def loss_fn(params, state, indices, offsets):
   ...     pred, _ = model.apply(params, state, indices, offsets, adagrad)
   ...     return jnp.mean((pred - labels) ** 2)
   >>> @jax.jit
   ... def sparse_step(params, state, opt_state, indices, offsets):
   ...     loss, grads, state = tbe_jax.haiku.train_step(loss_fn, params, state, indices, offsets)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     return optax.apply_updates(params, updates), state, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, state, opt_state, loss = sparse_step(params, state, opt_state, indices, offsets)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> emb = tbe_jax.TableBatchedEmbedding(tables, pooling="mean", impl="xla")   # the layer's core
   >>> [t.shape for t in emb.get_tables(tbe_jax.haiku.fused_params(state["embed"], emb))]
   [(100, 8), (50, 4)]

   Rules of the sparse path: call each sparse layer at most once per loss (a second
   call raises `ValueError`), directly in the loss (not inside a nested `jit`/`vmap`/
   `hk.remat`). A layer whose output does not reach the loss gets a zero gradient:
   its rows do not move. Differentiating the sparse state yourself raises a
   `TypeError`. Other state (batch statistics, ...) comes back from `train_step` as
   given: return `apply`'s new state through `aux` (`has_aux=True`) and merge it
   under the step's (`hk.data_structures.merge(aux_state, result.state)`).

The functional core: `layer.tbe` (inside a transform) or, outside, a
`tbe_jax.TableBatchedEmbedding` built with the same options: its params are
`params["<module name>"]` (true-gradient mode) or `fused_params(state["<module name>"],
emb)` (sparse mode), and `fused_opt_state(state["<module name>"], emb, optimizer)`
rebuilds the optimizer state; `module_state(params, opt_state)` builds a layer's state
entry from a core's. `tt_jax.haiku.TTEmbeddingBag` is the same layer over a
tensor-train core; one `train_step` serves models holding both.

Sharding: `TableBatchedEmbed(tables, ..., mesh=mesh, axis_name="data", sharding_plan=...)`
spreads the tables over a mesh axis (`tbe_jax.shard`): `layer.tbe` is then the
`ShardedTableBatchedEmbedding`, the layer's parameters (or state) hold its sharded
params (and optimizer state), and the layer takes each device's local batch
(`indices [n, N]`, `offsets [n, F*b+1]`) and returns the global batch's `[n*b, sum D]`;
`train_step` runs the sharded sparse update. See `TableBatchedEmbed`'s arguments.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax

try:
    import haiku as hk
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tbe_jax.haiku needs dm-haiku: pip install 'tbe-jax[haiku]' (or pip install dm-haiku)"
    ) from e

from tbe_jax.layers_common import (
    TBE_OPTIONS, LayerOptions, check_ids, check_optimizer, check_options, layer_name, leaf_names, opt_init,
    param_spec, sparse_lookup, sparse_value_and_grad,
)
from tbe_jax.optim import Optimizer

# Sparse-mode state names: tables "fused_<leaf path>" ("fused_d8", "fused_cores_0_1"),
# optimizer state leaves likewise ("fused_momentum_d8", "fused_count").
FUSED_PREFIX = "fused_"

__all__ = [
    "FUSED_PREFIX", "QuantizedEmbed", "StepResult", "TableBatchedEmbed", "core_params", "fused_opt_state",
    "fused_params", "is_fused", "module_params", "module_state", "quantize_module", "train_step",
]


class StepResult(NamedTuple):
    """What `train_step` returns."""

    loss: Any  # the loss, or (loss, aux) with has_aux=True (as jax.value_and_grad)
    grads: Any  # gradient of the loss with respect to params
    state: Any  # the state with the sparse layers' new tables and optimizer state


def train_step(loss_fn: Callable, params, state, *args, has_aux: bool = False, optimizer=None,
               with_report: bool = False) -> StepResult:
    """One training step of a Haiku model holding sparse-mode embedding layers.

    Args:
      loss_fn: `loss_fn(params, state, *args) -> loss` (or `(loss, aux)` with
        `has_aux`); it calls `transformed.apply(params, state, ...)`. It must call each
        sparse layer at most once, and be a pure function of its arguments (it is
        traced twice).
      params: differentiated.
      state: holds the sparse layers' tables and optimizer state (not differentiated).
      *args: passed to `loss_fn` (not differentiated).
      has_aux: as in `jax.value_and_grad`.
      optimizer: this step's optimizer for the sparse layers, in place of the ones they were built with: an
        optimizer of `tbe_jax.optim` (every layer) or a dict from a layer's module name to one; each of the
        layer's kind. Given as an argument of the jitted step, its hyperparameters are values: a new learning
        rate does not recompile (a layer's own optimizer is part of the model).
      with_report: also return `{module name: tbe_jax.StepReport}` (device counts of invalid ids and
        non-finite output gradients), as `(StepResult, reports)`.

    Returns:
      `StepResult(loss, grads, state)`: the loss (or `(loss, aux)`), the gradient with
      respect to `params` for your optax optimizer, and `state` with every sparse layer
      that `loss_fn` called updated by its optimizer (the rows its batch looked up,
      once, with the gradient of its output); other entries as given. Jittable.
    """
    value, grads, updates = sparse_value_and_grad(lambda p: loss_fn(p, state, *args), params, has_aux=has_aux,
                                                  optimizer=optimizer)
    if updates:
        state = {name: dict(entry) for name, entry in state.items()}
        for u in updates:
            kind, module_name = u.key
            if kind != "haiku":
                raise TypeError(f"tbe_jax.haiku.train_step ran a sparse layer of another framework ({kind})")
            state.setdefault(module_name, {}).update(module_state(u.params, u.opt_state))
    result = StepResult(value, grads, state)
    return (result, {layer_name(u.key): u.report for u in updates}) if with_report else result


def is_fused(module_name: str, name: str, value) -> bool:
    """Predicate for `hk.data_structures.partition`/`filter`: a sparse layer's tables or optimizer state."""
    del module_name, value
    return name.startswith(FUSED_PREFIX)


def _gather(entry, spec_tree, prefix: str):
    names, _, treedef = leaf_names(spec_tree, prefix)
    missing = [n for n in names if n not in entry]
    if missing:
        raise ValueError(f"the layer's entry has no {missing}; it has {sorted(entry)}")
    return jax.tree_util.tree_unflatten(treedef, [entry[n] for n in names])


def core_params(module_params, emb):
    """True-gradient mode: the core's params from a layer's parameters (`params["<module name>"]`)."""
    return _gather(module_params, param_spec(emb), "")


def module_params(params) -> dict:
    """True-gradient mode: a layer's parameter entry holding the core's `params` (`{"d8": ...}`)."""
    names, leaves, _ = leaf_names(params)
    return dict(zip(names, leaves))


def fused_params(module_state, emb):
    """Sparse mode: the core's params from a layer's state entry (`state["<module name>"]`)."""
    return _gather(module_state, param_spec(emb), FUSED_PREFIX)


def fused_opt_state(module_state, emb, optimizer: Optimizer):
    """Sparse mode: the optimizer state (e.g. `RowwiseAdagradState`) from a layer's state entry."""
    return _gather(module_state, jax.eval_shape(optimizer.init, param_spec(emb)), FUSED_PREFIX)


def module_state(params, opt_state) -> dict:
    """Sparse mode: a layer's state entry (`{"fused_d8": ..., "fused_momentum_d8": ..., ...}`)."""
    names, leaves, _ = leaf_names(params, FUSED_PREFIX)
    opt_names, opt_leaves, _ = leaf_names(opt_state, FUSED_PREFIX)
    return dict(zip(names + opt_names, leaves + opt_leaves))


class SparseEmbedBase(hk.Module):
    """The Haiku layer, generic over its functional core: a subclass names the core's `LayerOptions`
    (its class attribute `_OPTIONS = TBE_OPTIONS`), which give its `__init__` (the
    options, then `name`) and the attribute holding its core (`tbe`, `tt`). Parameters (or, in sparse
    mode, `FUSED_PREFIX`-named state) are named after the leaves of the core's params."""

    def __init_subclass__(cls, **kwargs):
        options: LayerOptions | None = cls.__dict__.get("_OPTIONS")  # the subclass's core's
        super().__init_subclass__(**kwargs)
        if options is not None:
            cls.__init__ = options.constructor(cls._build, inspect.Parameter(
                "name", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=str | None))
            cls.__doc__ = options.document(cls.__doc__)
            setattr(cls, options.attr, options.core_property(lambda self: self._core))

    @staticmethod  # not a method: Haiku wraps those, and they need the module constructed
    def _build(self, values: dict) -> None:
        hk.Module.__init__(self, name=values.pop("name"))
        core = self._OPTIONS.build(values)
        check_optimizer(values["optimizer"], core, self._OPTIONS.makers)
        self._core, self._values = core, values
        self.optimizer = values["optimizer"]

    def __call__(self, indices, offsets, per_sample_weights=None, **options):
        options = self._OPTIONS.lookup_options(options)
        check_ids(indices, offsets)
        core = self._core
        check_options(core, options)
        spec = param_spec(core)
        # Draw every table from one key, as the core's init does, and only at init time.
        init = self._OPTIONS.init_params(core, self._values, hk.next_rng_key()) if hk.running_init() else None

        def read(getter, tree, prefix, init_tree):
            names, leaf_specs, treedef = leaf_names(tree, prefix)
            init_leaves = None if init_tree is None else jax.tree_util.tree_leaves(init_tree)
            leaves = [getter(n, s.shape, s.dtype, init=lambda shape, dtype, i=i: init_leaves[i])
                      for i, (n, s) in enumerate(zip(names, leaf_specs))]
            return jax.tree_util.tree_unflatten(treedef, leaves)

        if self.optimizer is None:
            params = read(hk.get_parameter, spec, "", init)
            return core(params, indices, offsets, per_sample_weights, **options)
        tables = read(hk.get_state, spec, FUSED_PREFIX, init)
        opt_spec = jax.eval_shape(self.optimizer.init, spec)
        opt_state = read(hk.get_state, opt_spec, FUSED_PREFIX,
                         None if init is None else opt_init(core, self.optimizer, init))
        return sparse_lookup(("haiku", self.module_name), core, self.optimizer,
                             tables, opt_state, indices, offsets, per_sample_weights, options)


class TableBatchedEmbed(SparseEmbedBase):
    """Table-batched embedding bags as a Haiku module (over `tbe_jax.TableBatchedEmbedding`, `layer.tbe`).

    Variables: with `optimizer=None` the tables are parameters "d8", ...; with a sparse optimizer tables and
    optimizer state are state entries "fused_d8", "fused_momentum_d8", ..., trained by
    `tbe_jax.haiku.train_step` (see the module docstring). `name`: the module name (default
    "table_batched_embed"). With a mesh, outside the transform, build the same sharded core
    (`tbe_jax.shard(emb, mesh, axis_name, sharding_plan)`) for `core_params`, `fused_params`,
    `fused_opt_state`, and to copy tables in (`module_params(sharded.set_tables(None, tables))`, or
    `module_state(...)`).

    Initialisation: the tables are `layer.tbe.init(hk.next_rng_key())` (uniform in
    `[-1/sqrt(E), 1/sqrt(E)]`), drawn once at init: the same values as the functional
    core given that key. A core's params are copied in as
    `{"table_batched_embed": emb_params}` (true-gradient mode).

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk, tbe_jax
      >>> from tbe_jax.haiku import TableBatchedEmbed
      >>> tables = [tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)]
      >>> f = hk.without_apply_rng(hk.transform(lambda i, o: TableBatchedEmbed(tables, impl="xla")(i, o)))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> params = f.init(jax.random.key(0), indices, offsets)
      >>> f.apply(params, indices, offsets).shape
      (2, 12)
      >>> emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla")   # the same core, outside the transform
      >>> [t.shape for t in emb.get_tables(params["table_batched_embed"])]
      [(100, 8), (50, 4)]
    """

    _OPTIONS = TBE_OPTIONS


class QuantizedEmbed(hk.Module):
    """Inference layer over a `tbe_jax.QuantizedTableBatchedEmbedding` (`qemb`): its word buffers are Haiku
    state (`hk.get_state`, named by the buffers: `"int8_w36"`, ...; use `hk.transform_with_state`), zeros at
    init. `quantize_module` turns a trained `TableBatchedEmbed`'s entry into that state.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk, tbe_jax
      >>> from tbe_jax.haiku import QuantizedEmbed, TableBatchedEmbed, quantize_module
      >>> tables = [tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)]
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> train = hk.without_apply_rng(hk.transform(lambda i, o: TableBatchedEmbed(tables, impl="xla",
      ...                                                                          name="embed")(i, o)))
      >>> params = train.init(jax.random.key(0), indices, offsets)
      >>> core = tbe_jax.TableBatchedEmbedding(tables, impl="xla")   # the layer's core (same options)
      >>> qemb, state = quantize_module(core, params["embed"], "int8", name="embed")
      >>> serve = hk.without_apply_rng(hk.transform_with_state(lambda i, o: QuantizedEmbed(qemb, name="embed")(i, o)))
      >>> out, _ = serve.apply({}, state, indices, offsets)
      >>> out.shape
      (2, 12)
    """

    def __init__(self, qemb, name: str | None = None):
        super().__init__(name=name)
        self.qemb = qemb

    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        lay = self.qemb.layout
        qparams = {}
        for b in range(lay.num_buffers):
            key = lay.buffer_key(b)
            qparams[key] = hk.get_state(key, lay.buffer_shape(b), jax.numpy.int32, init=jax.numpy.zeros)
        return self.qemb(qparams, indices, offsets, per_sample_weights, batch_size_per_feature=batch_size_per_feature,
                         max_batch_size=max_batch_size)


def quantize_module(emb, module_entry, weight_dtype, *, name: str, fused: bool = False, **quantize_options):
    """`(qemb, state)`: a trained `TableBatchedEmbed`'s tables quantized (`tbe_jax.quantize`) and the Haiku
    state `{name: {buffer: words}}` a `QuantizedEmbed(qemb, name=name)` reads. `emb`: the layer's core
    (`TableBatchedEmbedding` with the layer's options); `module_entry`: the layer's `params[name]`, or with
    `fused=True` (sparse mode) its `state[name]`."""
    from tbe_jax.quant import quantize

    params = fused_params(module_entry, emb) if fused else core_params(module_entry, emb)
    qemb, qparams = quantize(emb, params, weight_dtype, **quantize_options)
    return qemb, {name: dict(qparams)}
