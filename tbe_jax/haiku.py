"""Haiku layer over `tbe_jax.TableBatchedEmbedding` (needs dm-haiku).

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
   ... def train_step(params, opt_state):
   ...     def loss_fn(params):
   ...         return jnp.mean((model.apply(params, indices, offsets) - labels) ** 2)
   ...     loss, grads = jax.value_and_grad(loss_fn)(params)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     return optax.apply_updates(params, updates), opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, opt_state, loss = train_step(params, opt_state)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True

2. **Fused row-wise Adagrad** (`optimizer=tbe_jax.rowwise_adagrad(...)` or
   `tbe_jax.sgd(...)`). The layer calls `TableBatchedEmbedding.fused_lookup`, whose
   backward applies the optimizer to the looked-up rows and returns, as the
   "gradients" of the tables and of the optimizer state, their **updated values**.
   So the tables leave the parameters: tables and optimizer state are Haiku *state*
   (`hk.get_state`; use `hk.transform_with_state`), named `"fused_d8"`, ... (tables)
   and `"fused_momentum_d8"`, ... (the state's leaves). A training step
   differentiates the loss with respect to the params and to the fused state
   (`hk.data_structures.partition(is_fused, state)` picks it out, should the model
   have other state); the fused state's gradient **is** its next value:

   >>> model = hk.without_apply_rng(hk.transform_with_state(forward))
   >>> adagrad = tbe_jax.rowwise_adagrad(learning_rate=0.5)
   >>> params, state = model.init(jax.random.key(0), indices, offsets, adagrad)
   >>> sorted(state["embed"])
   ['fused_d4', 'fused_d8', 'fused_momentum_d4', 'fused_momentum_d8']
   >>> opt_state = tx.init(params)                 # only the dense layer's params
   >>> @jax.jit
   ... def fused_step(params, state, opt_state):
   ...     fused, other = hk.data_structures.partition(tbe_jax.haiku.is_fused, state)
   ...     def loss_fn(params, fused):
   ...         pred, new_other = model.apply(params, hk.data_structures.merge(fused, other), indices, offsets,
   ...                                       adagrad)
   ...         return jnp.mean((pred - labels) ** 2), new_other
   ...     (loss, other), (grads, fused) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, fused)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     state = hk.data_structures.merge(fused, tbe_jax.haiku.drop_fused(other))
   ...     return optax.apply_updates(params, updates), state, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, state, opt_state, loss = fused_step(params, state, opt_state)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> emb_params = tbe_jax.haiku.fused_params(state["embed"])   # the core's params dict
   >>> sorted(emb_params)
   ['d4', 'd8']

   Rules of the fused path (those of `fused_lookup`): call each fused layer once per
   loss, and let its output reach the loss (a fused layer whose output does not
   influence the loss gets a zero "gradient", i.e. zeroed tables); per-sample weights
   are constants.

The functional core: `layer.tbe` (inside a transform) or, outside, a
`tbe_jax.TableBatchedEmbedding` built with the same options: its params are
`params["<module name>"]` (true-gradient mode) or `fused_params(state["<module name>"])`
(fused mode), and `fused_opt_state(state["<module name>"], emb, optimizer)` rebuilds
the optimizer state.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

try:
    import haiku as hk
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tbe_jax.haiku needs dm-haiku: pip install 'tbe-jax[haiku]' (or pip install dm-haiku)"
    ) from e

from tbe_jax._layers import check_ids, check_optimizer
from tbe_jax.kernels.forward import ForwardConfig
from tbe_jax.kernels.histogram import HistogramConfig
from tbe_jax.optim import FusedOptimizer
from tbe_jax.specs import TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

# Fused-mode state names: tables "fused_<buffer>" ("fused_d8"), optimizer state leaves
# "fused_<leaf path>" ("fused_momentum_d8").
FUSED_PREFIX = "fused_"

__all__ = ["FUSED_PREFIX", "TableBatchedEmbed", "drop_fused", "fused_opt_state", "fused_params", "is_fused"]
_MAKERS = "tbe_jax.rowwise_adagrad(...) or tbe_jax.sgd(...)"  # in the error for a bad optimizer


def is_fused(module_name: str, name: str, value) -> bool:
    """Predicate for `hk.data_structures.partition`: a fused layer's tables or optimizer state."""
    del module_name, value
    return name.startswith(FUSED_PREFIX)


def drop_fused(state):
    """`state` without the fused entries (what to keep of `apply`'s returned state)."""
    return hk.data_structures.filter(lambda m, n, v: not is_fused(m, n, v), state)


def _buffer_shapes(emb: TableBatchedEmbedding) -> dict:
    return {
        emb.layout.key(g): jax.ShapeDtypeStruct((emb.layout.group_rows[g], d), emb.weights_dtype)
        for g, d in enumerate(emb.layout.dims)
    }


def _leaf_names(tree) -> tuple[list[str], list, object]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [FUSED_PREFIX + jax.tree_util.keystr(p, simple=True, separator="_") for p, _ in leaves]
    return names, [v for _, v in leaves], treedef


def fused_params(module_state) -> dict:
    """A fused layer's tables, from its state entry (`state["<module name>"]`), as the core's params dict."""
    out = {}
    for name, value in module_state.items():
        key = name[len(FUSED_PREFIX):]
        if name.startswith(FUSED_PREFIX) and key[:1] == "d" and key[1:].isdigit():
            out[key] = value
    return out


def fused_opt_state(module_state, emb: TableBatchedEmbedding, optimizer: FusedOptimizer):
    """A fused layer's optimizer state (e.g. `RowwiseAdagradState`), from its state entry."""
    spec = jax.eval_shape(optimizer.init, _buffer_shapes(emb))
    names, _, treedef = _leaf_names(spec)
    return jax.tree_util.tree_unflatten(treedef, [module_state[n] for n in names])


class TableBatchedEmbed(hk.Module):
    """Table-batched embedding bags as a Haiku module.

    Args (the options of `tbe_jax.TableBatchedEmbedding`, `tables` positional, the
    rest keyword-only):
      tables: the `TableSpec`s.
      feature_table_map, pooling, weights_dtype, output_dtype, bounds_check, impl,
        interpret, kernel_config, use_histogram, histogram_config, backward_config:
        forwarded to `TableBatchedEmbedding` (backward_config only when not None).
      optimizer: None (true-gradient mode: the tables are parameters "d8", ...), or
        `tbe_jax.rowwise_adagrad(...)` / `tbe_jax.sgd(...)` (fused mode: tables and
        optimizer state are state entries "fused_d8", "fused_momentum_d8", ...; see the
        module docstring for the training step).
      name: the module name (default "table_batched_embed").

    Call: `layer(indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None)`,
    with the functional core's input format and output. Indices and offsets must be
    integer arrays (else `ValueError`).

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

    def __init__(
        self,
        tables: Sequence[TableSpec],
        *,
        feature_table_map: Sequence[int] | None = None,
        pooling: str = "sum",
        weights_dtype=jnp.float32,
        output_dtype=jnp.float32,
        bounds_check: str = "none",
        impl: str = "auto",
        interpret: bool = False,
        kernel_config: ForwardConfig | None = None,
        use_histogram: bool = True,
        histogram_config: HistogramConfig | None = None,
        backward_config=None,
        optimizer: FusedOptimizer | None = None,
        name: str | None = None,
    ):
        super().__init__(name=name)
        check_optimizer(optimizer, FusedOptimizer, _MAKERS)
        # backward_config is passed only when set (a core without that option still builds).
        extra = {} if backward_config is None else {"backward_config": backward_config}
        self.tbe = TableBatchedEmbedding(
            tables, feature_table_map=feature_table_map, pooling=pooling, weights_dtype=weights_dtype,
            output_dtype=output_dtype, bounds_check=bounds_check, impl=impl, interpret=interpret,
            kernel_config=kernel_config, use_histogram=use_histogram, histogram_config=histogram_config, **extra,
        )
        self.optimizer = optimizer

    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None):
        check_ids(indices, offsets)
        emb = self.tbe
        shapes = _buffer_shapes(emb)
        # Draw every table from one key, as emb.init does, and only at init time.
        init = emb.init(hk.next_rng_key()) if hk.running_init() else None

        def initial(value_of):
            return lambda shape, dtype: value_of()

        if self.optimizer is None:
            params = {
                k: hk.get_parameter(k, s.shape, s.dtype, init=initial(lambda k=k: init[k]))
                for k, s in shapes.items()
            }
            return emb(params, indices, offsets, per_sample_weights, batch_size_per_feature=batch_size_per_feature)

        params = {
            k: hk.get_state(FUSED_PREFIX + k, s.shape, s.dtype, init=initial(lambda k=k: init[k]))
            for k, s in shapes.items()
        }
        spec = jax.eval_shape(self.optimizer.init, shapes)
        names, leaf_specs, treedef = _leaf_names(spec)
        init_leaves = _leaf_names(self.optimizer.init(init))[1] if init is not None else None
        leaves = [
            hk.get_state(n, s.shape, s.dtype, init=initial(lambda i=i: init_leaves[i]))
            for i, (n, s) in enumerate(zip(names, leaf_specs))
        ]
        opt_state = jax.tree_util.tree_unflatten(treedef, leaves)
        return emb.fused_lookup(params, opt_state, self.optimizer, indices, offsets, per_sample_weights,
                                batch_size_per_feature=batch_size_per_feature)
