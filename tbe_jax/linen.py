"""Flax Linen layer over `tbe_jax.TableBatchedEmbedding`.

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
   ...     optimizer: tbe_jax.FusedOptimizer | None = None
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
   ... def train_step(params, opt_state):
   ...     def loss_fn(params):
   ...         return jnp.mean((model.apply({"params": params}, indices, offsets) - labels) ** 2)
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
   "gradients" of the tables and of the optimizer state, their **updated values**. So
   the tables leave `"params"`: they and the optimizer state live in the separate
   collection `FUSED_COLLECTION = "tbe_fused"`, as `{"embedding": {"d8": ...},
   "opt_state": RowwiseAdagradState(...)}` under the layer's path. A training step
   differentiates the loss with respect to both `"params"` and `"tbe_fused"`; the
   gradient of `"tbe_fused"` **is** its next value (assign it, do not feed it to
   optax), and the dense layers train with any optax optimizer as usual:

   >>> model = Model(optimizer=tbe_jax.rowwise_adagrad(learning_rate=0.5))
   >>> variables = model.init(jax.random.key(0), indices, offsets)
   >>> params, fused = variables["params"], variables["tbe_fused"]
   >>> sorted(fused["embed"])
   ['embedding', 'opt_state']
   >>> opt_state = tx.init(params)                 # no Adam moments for the tables
   >>> @jax.jit
   ... def fused_step(params, fused, opt_state):
   ...     def loss_fn(params, fused):
   ...         pred = model.apply({"params": params, "tbe_fused": fused}, indices, offsets)
   ...         return jnp.mean((pred - labels) ** 2)
   ...     loss, (grads, fused) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fused)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     return optax.apply_updates(params, updates), fused, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, fused, opt_state, loss = fused_step(params, fused, opt_state)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> core = TableBatchedEmbed(tables, pooling="mean", impl="xla").tbe   # what Model's layer wraps
   >>> [m.shape for m in core.get_momentum(fused["embed"]["opt_state"])]   # row-wise accumulators
   [(100,), (50,)]

   Rules of the fused path (those of `fused_lookup`): call each fused layer once per
   loss, and let its output reach the loss (a fused layer whose output does not
   influence the loss gets a zero "gradient", i.e. zeroed tables); per-sample weights
   are constants. Donate `fused` to the jitted step (`donate_argnums`) so the tables
   are updated without a copy on the kernel path.

The functional core: `layer.tbe` is the wrapped `TableBatchedEmbedding`, so
`layer.tbe.get_tables(variables["params"]["embed"]["embedding"])` (or
`variables["tbe_fused"]["embed"]["embedding"]` in fused mode) gives the per-table
`[E_t, D_t]` arrays and `layer.tbe.get_momentum(fused["embed"]["opt_state"])` the
row-wise accumulators.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax.numpy as jnp

try:
    import flax.linen as nn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tbe_jax.linen needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax._layers import check_ids, check_optimizer
from tbe_jax.kernels.forward import ForwardConfig
from tbe_jax.kernels.histogram import HistogramConfig
from tbe_jax.optim import FusedOptimizer
from tbe_jax.specs import TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

FUSED_COLLECTION = "tbe_fused"

__all__ = ["FUSED_COLLECTION", "TableBatchedEmbed"]
_MAKERS = "tbe_jax.rowwise_adagrad(...) or tbe_jax.sgd(...)"  # in the error for a bad optimizer


@functools.lru_cache(maxsize=256)
def _core(tables, feature_table_map, pooling, weights_dtype, output_dtype, bounds_check, impl, interpret,
          kernel_config, use_histogram, histogram_config, backward_config) -> TableBatchedEmbedding:
    # backward_config is passed only when set (a core without that option still builds).
    extra = {} if backward_config is None else {"backward_config": backward_config}
    return TableBatchedEmbedding(
        tables, feature_table_map=feature_table_map, pooling=pooling, weights_dtype=weights_dtype,
        output_dtype=output_dtype, bounds_check=bounds_check, impl=impl, interpret=interpret,
        kernel_config=kernel_config, use_histogram=use_histogram, histogram_config=histogram_config, **extra,
    )


class TableBatchedEmbed(nn.Module):
    """Table-batched embedding bags as a Linen module.

    Args (the options of `tbe_jax.TableBatchedEmbedding`, `tables` positional, the
    rest keyword-only):
      tables: the `TableSpec`s.
      feature_table_map, pooling, weights_dtype, output_dtype, bounds_check, impl,
        interpret, kernel_config, use_histogram, histogram_config, backward_config:
        forwarded to `TableBatchedEmbedding` (backward_config only when not None).
      optimizer: None (true-gradient mode: the tables are the parameter
        `"embedding"` in `"params"`), or `tbe_jax.rowwise_adagrad(...)` /
        `tbe_jax.sgd(...)` (fused mode: the tables, `"embedding"`, and the optimizer
        state, `"opt_state"`, live in the `"tbe_fused"` collection, whose gradient is
        its next value; see the module docstring for the training step).

    Call: `layer(indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None)`,
    with the functional core's input format and output (`[B, sum_f D_f]` for pooled
    lookups). Indices and offsets must be integer arrays (else `ValueError`).

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
    bounds_check: str = "none"
    impl: str = "auto"
    interpret: bool = False
    kernel_config: ForwardConfig | None = None
    use_histogram: bool = True
    histogram_config: HistogramConfig | None = None
    backward_config: Any = None
    optimizer: FusedOptimizer | None = None

    def __post_init__(self):
        check_optimizer(self.optimizer, FusedOptimizer, _MAKERS)
        self.tbe  # noqa: B018  (builds the core: bad options fail here, with the core's messages)
        super().__post_init__()

    @property
    def tbe(self) -> TableBatchedEmbedding:
        """The wrapped functional `TableBatchedEmbedding` (immutable, hashable)."""
        fmap = None if self.feature_table_map is None else tuple(self.feature_table_map)
        return _core(
            tuple(self.tables), fmap, self.pooling, self.weights_dtype, self.output_dtype,
            self.bounds_check, self.impl, bool(self.interpret), self.kernel_config, bool(self.use_histogram),
            self.histogram_config, self.backward_config,
        )

    @nn.compact
    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None):
        check_ids(indices, offsets)
        emb = self.tbe
        if self.optimizer is None:
            params = self.param("embedding", emb.init)
            return emb(params, indices, offsets, per_sample_weights, batch_size_per_feature=batch_size_per_feature)
        tables = self.variable(FUSED_COLLECTION, "embedding", lambda: emb.init(self.make_rng("params")))
        state = self.variable(FUSED_COLLECTION, "opt_state", lambda: self.optimizer.init(tables.value))
        return emb.fused_lookup(tables.value, state.value, self.optimizer, indices, offsets, per_sample_weights,
                                batch_size_per_feature=batch_size_per_feature)
