"""Flax NNX layer over `tbe_jax.TableBatchedEmbedding`.

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
   >>> def loss_fn(model):
   ...     return jnp.mean((model(indices, offsets) - labels) ** 2)
   >>> @nnx.jit
   ... def train_step(model, optimizer):
   ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(train_step(model, optimizer)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True

2. **Fused row-wise Adagrad** (`optimizer=tbe_jax.rowwise_adagrad(...)` or
   `tbe_jax.sgd(...)`). The layer calls `TableBatchedEmbedding.fused_lookup`, whose
   backward applies the optimizer to the looked-up rows and returns, as the
   "gradients" of the tables and of the optimizer state, their **updated values**.
   Tables and optimizer state are then held as `Fused` variables (an `nnx.Variable`
   type that is not an `nnx.Param`, so `nnx.Optimizer(..., wrt=nnx.Param)` leaves them
   alone): `layer.embedding` (same keys as above) and `layer.opt_state` (the state's
   leaves, e.g. `"momentum_d8"`). A training step differentiates with respect to
   `DIFF_FILTER` (`nnx.Param` or `Fused`) and hands the result to `apply_fused`,
   which writes the new tables and state into the model and returns the ordinary
   gradients for the optimizer:

   >>> model = Model(tbe_jax.rowwise_adagrad(learning_rate=0.5), rngs=nnx.Rngs(0))
   >>> optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)   # dense layers only
   >>> @nnx.jit
   ... def fused_step(model, optimizer):
   ...     diff = nnx.DiffState(0, tbe_jax.nnx.DIFF_FILTER)
   ...     loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
   ...     grads = tbe_jax.nnx.apply_fused(model, grads)   # new tables + state assigned
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(fused_step(model, optimizer)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True
   >>> [m.shape for m in model.embed.tbe.get_momentum(model.embed.get_opt_state())]
   [(100,), (50,)]

   Rules of the fused path (those of `fused_lookup`): call each fused layer once per
   loss, and let its output reach the loss (a fused layer whose output does not
   influence the loss gets a zero "gradient", i.e. zeroed tables); per-sample weights
   are constants.

The functional core: `layer.tbe` is the wrapped `TableBatchedEmbedding`;
`layer.get_params()` returns its params dict (either mode), so
`layer.tbe.get_tables(layer.get_params())` gives the per-table `[E_t, D_t]` arrays and
`layer.tbe(layer.get_params(), indices, offsets)` equals `layer(indices, offsets)`;
`layer.set_params(emb_params)` copies a core's params in.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tbe_jax.nnx needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax._layers import check_ids, check_optimizer
from tbe_jax.kernels.forward import ForwardConfig
from tbe_jax.kernels.histogram import HistogramConfig
from tbe_jax.optim import FusedOptimizer
from tbe_jax.specs import TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

__all__ = ["DIFF_FILTER", "Fused", "TableBatchedEmbed", "apply_fused"]
_MAKERS = "tbe_jax.rowwise_adagrad(...) or tbe_jax.sgd(...)"  # in the error for a bad optimizer


class Fused(nnx.Variable):
    """Tables and optimizer state of a `TableBatchedEmbed` trained by the fused path.

    Their gradient under `nnx.grad` is their next value (see `apply_fused`).
    """


# Differentiate a model holding fused layers with respect to this filter.
DIFF_FILTER = nnx.Any(nnx.Param, Fused)


def apply_fused(model: nnx.Module, grads: nnx.State) -> nnx.State:
    """Assign the fused layers' new tables and state; return the remaining gradients.

    `grads` comes from `nnx.grad(..., argnums=nnx.DiffState(0, DIFF_FILTER))(model)`.
    Its `Fused` entries are the updated values computed inside the fused lookups'
    backward: they are written into `model` (in place). The rest (the `nnx.Param`
    gradients) is returned for `nnx.Optimizer.update`.
    """
    fused, rest = nnx.split_state(grads, Fused, ...)
    nnx.update(model, fused)
    return rest


class TableBatchedEmbed(nnx.Module):
    """Table-batched embedding bags as an NNX module.

    Args (the options of `tbe_jax.TableBatchedEmbedding`, `tables` positional, the
    rest keyword-only):
      tables: the `TableSpec`s.
      feature_table_map, pooling, weights_dtype, output_dtype, bounds_check, impl,
        interpret, kernel_config, use_histogram, histogram_config, backward_config:
        forwarded to `TableBatchedEmbedding` (backward_config only when not None).
      optimizer: None (true-gradient mode: the tables are `nnx.Param`s), or
        `tbe_jax.rowwise_adagrad(...)` / `tbe_jax.sgd(...)` (fused mode: tables and
        optimizer state are `Fused` variables; see the module docstring).
      rngs: `nnx.Rngs`; the tables are `layer.tbe.init(rngs.params())` (uniform in
        `[-1/sqrt(E), 1/sqrt(E)]`), the same values as the functional core given that key.

    Attributes:
      tbe: the wrapped `TableBatchedEmbedding` (static).
      embedding: `nnx.Dict` of one variable per storage buffer ("d8", ...): `nnx.Param`,
        or `Fused` in fused mode.
      opt_state: fused mode only: `nnx.Dict` of `Fused` variables, one per leaf of the
        optimizer state (`"momentum_d8"`, ...); `get_opt_state()` reassembles it.

    Call: `layer(indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None)`,
    with the functional core's input format and output. Indices and offsets must be
    integer arrays (else `ValueError`).

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
        rngs: nnx.Rngs,
    ):
        check_optimizer(optimizer, FusedOptimizer, _MAKERS)
        # backward_config is passed only when set (a core without that option still builds).
        extra = {} if backward_config is None else {"backward_config": backward_config}
        self.tbe = TableBatchedEmbedding(
            tables, feature_table_map=feature_table_map, pooling=pooling, weights_dtype=weights_dtype,
            output_dtype=output_dtype, bounds_check=bounds_check, impl=impl, interpret=interpret,
            kernel_config=kernel_config, use_histogram=use_histogram, histogram_config=histogram_config, **extra,
        )
        self.optimizer = optimizer
        params = self.tbe.init(rngs.params())
        var = nnx.Param if optimizer is None else Fused
        self.embedding = nnx.Dict({k: var(v) for k, v in params.items()})
        if optimizer is not None:
            leaves, self._opt_treedef = jax.tree_util.tree_flatten_with_path(optimizer.init(params))
            self._opt_names = tuple(jax.tree_util.keystr(p, simple=True, separator="_") for p, _ in leaves)
            self.opt_state = nnx.Dict({n: Fused(v) for n, (_, v) in zip(self._opt_names, leaves)})

    def get_params(self) -> dict:
        """The functional core's params dict (`{"d8": array, ...}`) held by this layer."""
        return {k: v[...] for k, v in self.embedding.items()}

    def set_params(self, params: dict) -> None:
        """Copy a functional core's params (from `layer.tbe.init`/`set_tables`) into the layer."""
        if set(params) != set(self.embedding.keys()):
            raise ValueError(f"params have buffers {sorted(params)}; this layer has {sorted(self.embedding.keys())}")
        for k, v in params.items():
            if tuple(v.shape) != tuple(self.embedding[k].shape) or v.dtype != self.embedding[k].dtype:
                raise ValueError(
                    f"params[{k!r}] must be {self.embedding[k].dtype}{list(self.embedding[k].shape)}, "
                    f"got {v.dtype}{list(v.shape)}"
                )
            self.embedding[k][...] = v

    def get_opt_state(self):
        """Fused mode: the optimizer state as the core expects it (e.g. `RowwiseAdagradState`)."""
        if self.optimizer is None:
            raise ValueError("this layer has no fused optimizer (optimizer=None): it holds no optimizer state")
        return jax.tree_util.tree_unflatten(self._opt_treedef, [self.opt_state[n][...] for n in self._opt_names])

    def __call__(self, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None):
        check_ids(indices, offsets)
        params = self.get_params()
        if self.optimizer is None:
            return self.tbe(params, indices, offsets, per_sample_weights,
                            batch_size_per_feature=batch_size_per_feature)
        return self.tbe.fused_lookup(params, self.get_opt_state(), self.optimizer, indices, offsets,
                                     per_sample_weights, batch_size_per_feature=batch_size_per_feature)
