"""Flax NNX layer over `tbe_jax.TableBatchedEmbedding`, and the sparse training step.

`TableBatchedEmbed` is an `nnx.Module` wrapping one functional `TableBatchedEmbedding`
(the static attribute `layer.tbe`). It trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The tables are `nnx.Param`s, one per
   storage buffer of the functional core, in `layer.embedding` (an `nnx.Dict` keyed
   like the core's params: `"d8"`, `"d128"`, ...; see `layer.tbe.layout`).
   `nnx.grad` gives their exact, dense gradient and `nnx.Optimizer` with any optax
   transformation applies it:

   >>> import jax, jax.numpy as jnp, optax, tbe_jax
   >>> from flax import nnx
   >>> from tbe_jax.nnx import TableBatchedEmbed
   >>> tables = [tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> class Model(nnx.Module):
   ...     def __init__(self, optimizer=None, *, rngs):
   ...         self.embed = TableBatchedEmbed(tables, pooling="mean", impl="xla", optimizer=optimizer, rngs=rngs)
   ...         self.head = nnx.Linear(12, 1, rngs=rngs)
   ...     def __call__(self, indices, offsets):
   ...         return self.head(self.embed(indices, offsets))[:, 0]
   >>> model = Model(rngs=nnx.Rngs(0))
   >>> optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
   >>> def loss_fn(model, indices, offsets):
   ...     return jnp.mean((model(indices, offsets) - labels) ** 2)
   >>> @nnx.jit
   ... def dense_step(model, optimizer):
   ...     loss, grads = nnx.value_and_grad(loss_fn)(model, indices, offsets)
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(dense_step(model, optimizer)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True

2. **Sparse optimizer** (`optimizer=` any of `tbe_jax.optim`: `SGD`, `RowwiseAdagrad`, `Adagrad`, `Adam`,
   `PartialRowwiseAdam`, `Lamb`, `PartialRowwiseLamb`).
   Tables and optimizer state are `Fused` variables (an `nnx.Variable` type that is
   not an `nnx.Param`, so `nnx.Optimizer(..., wrt=nnx.Param)` leaves them alone):
   `layer.embedding` (same keys as above) and `layer.opt_state` (the state's leaves,
   e.g. `"momentum_d8"`, `"count"`). `train_step(loss_fn, model, *args)` runs
   `loss_fn(model, *args)`, differentiates it with respect to the model's
   `nnx.Param`s and to each sparse layer's output, applies the layer's optimizer to
   the rows the batch looked up (once per row, with the gradient summed over the
   batch: `TableBatchedEmbedding.apply_gradients`), writes the new tables and state
   into the model, and returns the loss and the dense gradients for `nnx.Optimizer`:

   >>> model = Model(tbe_jax.RowwiseAdagrad(learning_rate=0.5), rngs=nnx.Rngs(0))
   >>> optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)   # dense layers only
   >>> @nnx.jit
   ... def sparse_step(model, optimizer, indices, offsets):
   ...     loss, grads = tbe_jax.nnx.train_step(loss_fn, model, indices, offsets)   # tables updated
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(sparse_step(model, optimizer, indices, offsets)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True
   >>> [m.shape for m in model.embed.tbe.get_momentum(model.embed.get_opt_state())]
   [(100,), (50,)]

   Rules of the sparse path: call each sparse layer at most once per loss (a second
   call raises `ValueError`), directly in the loss (not inside a nested `nnx.jit`/
   `vmap`/`remat`). A layer whose output does not reach the loss gets a zero
   gradient: its rows do not move. Differentiating the `Fused` variables yourself
   raises a `TypeError`. A float learning rate is static (a new value recompiles); a
   `jnp` scalar is data and an optax schedule reads the state's step count: neither
   recompiles.

The functional core: `layer.tbe` is the wrapped `TableBatchedEmbedding`;
`layer.get_params()` returns its params dict (either mode), so
`layer.tbe.get_tables(layer.get_params())` gives the per-table `[E_t, D_t]` arrays and
`layer.tbe(layer.get_params(), indices, offsets)` equals `layer(indices, offsets)`;
`layer.set_params(emb_params)` copies a core's params in (`get_opt_state` /
`set_opt_state` likewise for the optimizer state). `tt_jax.nnx.TTEmbeddingBag` is the
same layer over a tensor-train core; one `train_step` serves models holding both.

Sharding: `TableBatchedEmbed(tables, ..., mesh=mesh, axis_name="data", sharding_plan=...,
rngs=...)` spreads the tables over a mesh axis (`tbe_jax.shard`): `layer.tbe` is then the
`ShardedTableBatchedEmbedding`, the layer's variables hold its sharded params (and
state), and the layer takes each device's local batch (`indices [n, N]`, `offsets
[n, F*b+1]`) and returns the global batch's `[n*b, sum D]`; `train_step` runs the
sharded sparse update. See `TableBatchedEmbed`'s arguments.
"""

from __future__ import annotations

import inspect
from typing import Callable

import jax
import jax.numpy as jnp

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tbe_jax.nnx needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax.layers_common import (
    TBE_OPTIONS, LayerOptions, SparseStep, check_ids, check_optimizer, check_options, layer_name, leaf_names,
    opt_init, sparse_lookup,
)

__all__ = ["Fused", "Quantized", "QuantizedEmbed", "TableBatchedEmbed", "train_step"]

class Fused(nnx.Variable):
    """Tables and optimizer state of a sparse-mode layer (not an `nnx.Param`: not differentiated;
    `train_step` updates them)."""


def train_step(loss_fn: Callable, model: nnx.Module, *args, has_aux: bool = False, wrt=nnx.Param,
               optimizer=None, with_report: bool = False):
    """One training step of an NNX model holding sparse-mode embedding layers.

    Args:
      loss_fn: `loss_fn(model, *args) -> loss` (or `(loss, aux)` with `has_aux`). It
        must call each sparse layer at most once, and be a pure function of the model
        and its arguments (it is traced twice; state updates of the second trace, e.g.
        batch statistics or RNG counts, are kept, as with `nnx.value_and_grad`).
      model: the model; updated in place.
      *args: passed to `loss_fn` (not differentiated).
      has_aux: as in `nnx.value_and_grad`.
      wrt: the filter of the differentiated variables (default `nnx.Param`).
      optimizer: this step's optimizer for the sparse layers, in place of the ones they were built with: an
        optimizer of `tbe_jax.optim` (every layer) or a dict from a layer's path ("embed", "tower/embed") to
        one; each of the layer's kind. Given as an argument of the jitted step, its hyperparameters are
        values: a new learning rate does not recompile (a layer's own optimizer is part of the model).
      with_report: also return `{layer path: tbe_jax.StepReport}` (device counts of invalid ids and
        non-finite output gradients), as `(loss, grads, reports)`.

    Returns:
      `(loss, grads)`, as `nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt),
      has_aux=has_aux)(model, *args)` gives it: hand `grads` to
      `nnx.Optimizer.update(model, grads)`. Every sparse layer that `loss_fn` called
      has been updated in `model` by its optimizer (the rows its batch looked up,
      once, with the gradient of its output). Works inside `nnx.jit`.
    """
    # A layer reports its id (each trace runs on a copy of the model); the step keys it by its path.
    paths = {}

    def resolve(key):
        kind, ident = key
        if kind != "nnx" or ident not in paths:
            raise TypeError(f"tbe_jax.nnx.train_step ran a sparse layer that is not part of the model ({kind})")
        return kind, paths[ident]

    def with_paths(m):
        paths.clear()
        paths.update(_sparse_layers(m, by_id=True))
        return loss_fn(m, *args)

    step = SparseStep(has_aux, resolve, optimizer)
    graphdef, diff, rest = nnx.split(model, wrt, ...)
    taps = step.discover(lambda d: with_paths(nnx.merge(graphdef, d, rest)), diff)
    (loss, packed), (grads, tap_grads) = nnx.value_and_grad(
        step.wrap(with_paths), argnums=(nnx.DiffState(0, wrt), 1), has_aux=True)(model, taps)
    value, updates = step.finish(loss, packed, tap_grads)
    if updates:
        layers = _sparse_layers(model, by_id=False)
        for u in updates:
            layer = layers[u.key[1]]
            layer.set_params(u.params)
            layer.set_opt_state(u.opt_state)
    if with_report:
        return value, grads, {layer_name(u.key): u.report for u in updates}
    return value, grads


def _sparse_layers(model, *, by_id: bool) -> dict:
    """The model's sparse-mode layers: {id: path} (by_id) or {path: layer}."""
    found = [(path, node) for path, node in nnx.iter_graph(model)
             if isinstance(node, SparseEmbedBase) and node.optimizer is not None]
    return {id(node): tuple(path) for path, node in found} if by_id else {tuple(path): node for path, node in found}


def _replace(var, value) -> None:
    """Set a variable's value without reading the old one (it may have been donated: the eager `prefetch`)."""
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # flax < 0.11
        var.value = value


class SparseEmbedBase(nnx.Module):
    """The NNX layer, generic over its functional core: a subclass names the core's `LayerOptions`
    (its class attribute `_OPTIONS = TBE_OPTIONS`), which give its `__init__` (the
    options, then `rngs`) and the static attribute holding its core (`tbe`, `tt`).

    Attributes:
      embedding: `nnx.Dict` of one variable per leaf of the core's params (named by
        its path: `"d8"`; `"cores_0_1"`): `nnx.Param`, or `Fused` in sparse mode.
      opt_state: sparse mode only: `nnx.Dict` of `Fused` variables, one per leaf of
        the optimizer state (`"momentum_d8"`, `"count"`, ...); `get_opt_state()` reassembles it.
      optimizer: the sparse optimizer (or None).
    """

    def __init_subclass__(cls, **kwargs):
        options: LayerOptions | None = cls.__dict__.get("_OPTIONS")  # the subclass's core's
        super().__init_subclass__(**kwargs)
        if options is not None:
            cls.__init__ = options.constructor(cls._build, inspect.Parameter(
                "rngs", inspect.Parameter.KEYWORD_ONLY, annotation=nnx.Rngs))
            cls.__doc__ = options.document(cls.__doc__)
            setattr(cls, options.attr, options.core_property(lambda self: self._core))

    def _build(self, values: dict) -> None:
        rngs = values.pop("rngs")
        core = self._OPTIONS.build(values)
        optimizer = values["optimizer"]
        check_optimizer(optimizer, core, self._OPTIONS.makers)  # before drawing the tables
        params = self._OPTIONS.init_params(core, values, rngs.params())
        self._core = core
        self.optimizer = nnx.data(optimizer)  # array hyperparameters are data, floats static
        names, leaves, self._treedef = leaf_names(params)
        self._names = tuple(names)
        var = nnx.Param if optimizer is None else Fused
        self.embedding = nnx.Dict({n: var(v) for n, v in zip(names, leaves)})
        if optimizer is not None:
            names, leaves, self._opt_treedef = leaf_names(opt_init(core, optimizer, params))
            self._opt_names = tuple(names)
            self.opt_state = nnx.Dict({n: Fused(v) for n, v in zip(names, leaves)})

    def get_params(self):
        """The functional core's params (`{"d8": array, ...}`; `{"cores": ...}`) held by this layer."""
        return jax.tree_util.tree_unflatten(self._treedef, [self.embedding[n][...] for n in self._names])

    def set_params(self, params) -> None:
        """Copy a functional core's params (from its `init`, `set_tables` / `set_cores`) into the layer."""
        names, leaves, treedef = leaf_names(params)
        if treedef != self._treedef:
            raise ValueError(f"params have the structure {treedef}; this layer's is {self._treedef}")
        for n, v in zip(names, leaves):
            have = self.embedding[n]
            if tuple(v.shape) != tuple(have.shape) or v.dtype != have.dtype:
                raise ValueError(f"params[{n!r}] must be {have.dtype}{list(have.shape)}, got {v.dtype}{list(v.shape)}")
            _replace(have, v)

    def _check_sparse(self):
        if self.optimizer is None:
            raise ValueError("this layer has no sparse optimizer (optimizer=None): it holds no optimizer state")

    def get_opt_state(self):
        """Sparse mode: the optimizer state as the core expects it (e.g. `RowwiseAdagradState`)."""
        self._check_sparse()
        return jax.tree_util.tree_unflatten(self._opt_treedef, [self.opt_state[n][...] for n in self._opt_names])

    def set_opt_state(self, opt_state) -> None:
        """Sparse mode: copy an optimizer state (from `optimizer.init(params)`) into the layer."""
        self._check_sparse()
        names, leaves, treedef = leaf_names(opt_state)
        if treedef != self._opt_treedef:
            raise ValueError(f"opt_state has the structure {treedef}; this layer's is {self._opt_treedef}")
        for n, v in zip(names, leaves):
            have = self.opt_state[n]
            if tuple(v.shape) != tuple(have.shape) or jnp.dtype(v.dtype) != jnp.dtype(have.dtype):
                raise ValueError(f"opt_state[{n!r}] must be {have.dtype}{list(have.shape)}, "
                                 f"got {v.dtype}{list(v.shape)}")
            _replace(have, v)

    def __call__(self, indices, offsets, per_sample_weights=None, **options):
        options = self._OPTIONS.lookup_options(options)
        check_ids(indices, offsets)
        check_options(self._core, options)
        params = self.get_params()
        if self.optimizer is None:
            return self._core(params, indices, offsets, per_sample_weights, **options)
        return sparse_lookup(("nnx", id(self)), self._core, self.optimizer, params,
                             self.get_opt_state(), indices, offsets, per_sample_weights, options)


class TableBatchedEmbed(SparseEmbedBase):
    """Table-batched embedding bags as an NNX module (over `tbe_jax.TableBatchedEmbedding`, `layer.tbe`).

    Variables: with `optimizer=None` the tables are `nnx.Param`s; with a sparse optimizer tables and
    optimizer state are `Fused` variables, trained by `tbe_jax.nnx.train_step` (see the module docstring).
    `rngs`: `nnx.Rngs`; the tables are `layer.tbe.init(rngs.params())` (uniform in `[-1/sqrt(E), 1/sqrt(E)]`),
    the same values as the functional core given that key. With a mesh, copy tables in with
    `layer.set_params(layer.tbe.set_tables(None, tables))`.

    Attributes:
      tbe: the wrapped `TableBatchedEmbedding` (static); with a mesh, the `ShardedTableBatchedEmbedding`.
      embedding, opt_state: one variable per storage buffer ("d8", ...) and per leaf of the optimizer state
        (`"momentum_d8"`, `"count"`, ...); see `SparseEmbedBase`.

    Example:
      >>> import jax, jax.numpy as jnp, tbe_jax
      >>> from flax import nnx
      >>> from tbe_jax.nnx import TableBatchedEmbed
      >>> layer = TableBatchedEmbed([tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)], impl="xla",
      ...                           rngs=nnx.Rngs(0))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> layer(indices, offsets).shape
      (2, 12)
      >>> [t.shape for t in layer.tbe.get_tables(layer.get_params())]
      [(100, 8), (50, 4)]
    """

    _OPTIONS = TBE_OPTIONS

    def prefetch(self, indices, offsets, **options) -> None:
        """Tables with `location="host_cached"`: bring this batch's rows of them into the HBM cache (with their
        optimizer state in sparse mode), as `TableBatchedEmbedding.prefetch` does; call it before the batch's
        step (it may run one batch ahead), inside a jitted function or outside one. Options:
        `batch_size_per_feature`, `max_batch_size`."""
        if not hasattr(self._core, "prefetch") or getattr(self._core, "cached", True) is False:  # (sharded: .cached)
            raise TypeError("prefetch: this layer has no table with location='host_cached'")
        params = self.get_params()
        if self.optimizer is None:
            self.set_params(self._core.prefetch(params, indices, offsets, **options))
            return
        params, state = self._core.prefetch(params, indices, offsets, opt_state=self.get_opt_state(), **options)
        self.set_params(params)
        self.set_opt_state(state)


class Quantized(nnx.Variable):
    """Quantized rows of an inference layer (not an `nnx.Param`: nothing trains them)."""


class QuantizedEmbed(nnx.Module):
    """Inference layer over a `tbe_jax.QuantizedTableBatchedEmbedding` (`layer.qemb`), its rows in
    `layer.qparams` (an `nnx.Dict` of `Quantized` variables, one per word buffer). `QuantizedEmbed.from_layer`
    makes one from a trained `TableBatchedEmbed`.

    Example:
      >>> import jax.numpy as jnp, flax.nnx as nnx, tbe_jax
      >>> from tbe_jax.nnx import QuantizedEmbed, TableBatchedEmbed
      >>> layer = TableBatchedEmbed([tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)], impl="xla",
      ...                           rngs=nnx.Rngs(0))
      >>> serving = QuantizedEmbed.from_layer(layer, "int4")
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> serving(indices, offsets).shape
      (2, 12)
    """

    def __init__(self, qemb, qparams=None):
        self.qemb = qemb
        qparams = qemb.zero_params() if qparams is None else qparams
        qemb.check_params(qparams)
        self.qparams = nnx.Dict({k: Quantized(v) for k, v in qparams.items()})

    @classmethod
    def from_layer(cls, layer: "TableBatchedEmbed", weight_dtype, **quantize_options) -> "QuantizedEmbed":
        """The serving layer of a trained `TableBatchedEmbed` (its current tables quantized: `tbe_jax.quantize`,
        `weight_dtype` and `quantize_options` as there)."""
        from tbe_jax.quant import quantize
        from tbe_jax.tbe import TableBatchedEmbedding

        if not isinstance(layer.tbe, TableBatchedEmbedding):
            raise TypeError(f"from_layer takes an unsharded TableBatchedEmbed; this layer's core is "
                            f"{type(layer.tbe).__name__}")
        return cls(*quantize(layer.tbe, layer.get_params(), weight_dtype, **quantize_options))

    def get_qparams(self) -> dict:
        return {k: v[...] for k, v in self.qparams.items()}

    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        return self.qemb(self.get_qparams(), indices, offsets, per_sample_weights,
                         batch_size_per_feature=batch_size_per_feature, max_batch_size=max_batch_size)
