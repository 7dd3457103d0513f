"""Flax NNX layer over `tt_jax.TTEmbeddingBag`.

`TTEmbeddingBag` is an `nnx.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(the static attribute `layer.tt`). It mirrors `tbe_jax.nnx.TableBatchedEmbed` and
trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are `nnx.Param`s, one
   per core, in `layer.embedding` (an `nnx.Dict` keyed by the core's path in the
   functional params dict: `"cores_0_1"` is table 0's core 1). `nnx.grad` gives their
   exact gradient and `nnx.Optimizer` with any optax transformation applies it:

   >>> import jax, jax.numpy as jnp, optax, tt_jax
   >>> from flax import nnx
   >>> from tt_jax.nnx import TTEmbeddingBag
   >>> specs = [tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> class Model(nnx.Module):
   ...     def __init__(self, optimizer=None, *, rngs):
   ...         self.embed = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=optimizer, rngs=rngs)
   ...         self.head = nnx.Linear(12, 1, rngs=rngs)
   ...     def __call__(self, indices, offsets):
   ...         return self.head(self.embed(indices, offsets))[:, 0]
   >>> model = Model(rngs=nnx.Rngs(0))
   >>> sorted(model.embed.embedding.keys())
   ['cores_0_0', 'cores_0_1', 'cores_0_2', 'cores_1_0', 'cores_1_1']
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

2. **Fused optimizer** (`optimizer=tt_jax.rowwise_adagrad(...)`, `tt_jax.adagrad(...)`
   or `tt_jax.sgd(...)`). The layer calls `TTEmbeddingBag.fused_lookup`, whose backward
   applies the optimizer to the touched core slices and returns, as the "gradients" of
   the cores and of the optimizer state, their **updated values**. Cores and optimizer
   state are then held as `Fused` variables (`tbe_jax.nnx.Fused`, the variable type of
   tbe_jax's fused layers, not an `nnx.Param`, so `nnx.Optimizer(..., wrt=nnx.Param)`
   leaves them alone): `layer.embedding` (same keys as above) and `layer.opt_state`
   (the state's leaves, e.g. `"momentum_0_1"`). A training step differentiates with
   respect to `DIFF_FILTER` (`nnx.Param` or `Fused`) and hands the result to
   `apply_fused`, which writes the new cores and state into the model and returns the
   ordinary gradients; the same step serves models that also hold fused TBE layers:

   >>> model = Model(tt_jax.rowwise_adagrad(learning_rate=0.2), rngs=nnx.Rngs(0))
   >>> optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)   # dense layers only
   >>> @nnx.jit
   ... def fused_step(model, optimizer):
   ...     diff = nnx.DiffState(0, tt_jax.nnx.DIFF_FILTER)
   ...     loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
   ...     grads = tt_jax.nnx.apply_fused(model, grads)   # new cores + state assigned
   ...     optimizer.update(model, grads)
   ...     return loss
   >>> losses = [float(fused_step(model, optimizer)) for _ in range(20)]
   >>> losses[-1] < losses[0] / 2
   True
   >>> [m.shape for m in model.embed.tt.get_momentum(model.embed.get_opt_state())[0]]
   [(5,), (5,), (5,)]

   Rules of the fused path (those of `fused_lookup`): call each fused layer once per
   loss and let its output reach the loss (a fused layer whose output does not
   influence the loss gets a zero "gradient", i.e. zeroed cores); per-sample weights
   are constants.

The functional core: `layer.tt` is the wrapped `tt_jax.TTEmbeddingBag`;
`layer.get_params()` returns its params dict (either mode), so
`layer.tt(layer.get_params(), indices, offsets)` equals `layer(indices, offsets)` and
`layer.tt.full_table(layer.get_params())` gives the tables; `layer.set_params(params)`
copies a core's params in (`get_opt_state`/`set_opt_state` likewise for the state).
"""

from __future__ import annotations

from typing import Sequence

import jax

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tt_jax.nnx needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax._layers import check_ids, check_optimizer
from tbe_jax.nnx import DIFF_FILTER, Fused, apply_fused
from tt_jax.kernels.forward import TTKernelConfig
from tt_jax.optim import FusedOptimizer
from tt_jax.specs import TTSpec
from tt_jax.tt import TTEmbeddingBag as _TTCore

__all__ = ["DIFF_FILTER", "Fused", "TTEmbeddingBag", "apply_fused"]
_MAKERS = "tt_jax.rowwise_adagrad(...), tt_jax.adagrad(...) or tt_jax.sgd(...)"  # in the error for a bad optimizer


def _flatten(tree) -> tuple[tuple[str, ...], list, object]:
    """(names, leaves, treedef): one name per leaf, its path joined by "_" ("cores_0_1", "momentum_0_1")."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = tuple(jax.tree_util.keystr(p, simple=True, separator="_") for p, _ in leaves)
    return names, [v for _, v in leaves], treedef


class TTEmbeddingBag(nnx.Module):
    """Tensor-train embedding bags as an NNX module.

    Args (the options of `tt_jax.TTEmbeddingBag`, `specs` positional, the rest
    keyword-only):
      specs: one `TTSpec` or a sequence of them.
      feature_table_map, pooling, impl, interpret, config: forwarded to
        `tt_jax.TTEmbeddingBag`.
      initializer, init_std: the core's `init(key, init=initializer, std=init_std)`.
      optimizer: None (true-gradient mode: the cores are `nnx.Param`s), or
        `tt_jax.rowwise_adagrad(...)` / `tt_jax.adagrad(...)` / `tt_jax.sgd(...)`
        (fused mode: cores and optimizer state are `Fused` variables; see the module
        docstring).
      rngs: `nnx.Rngs`; the cores are `layer.tt.init(rngs.params(), ...)`, the same
        values as the functional core given that key.

    Attributes:
      tt: the wrapped `tt_jax.TTEmbeddingBag` (static).
      embedding: `nnx.Dict` of one variable per core ("cores_<table>_<core>"):
        `nnx.Param`, or `Fused` in fused mode.
      opt_state: fused mode only: `nnx.Dict` of `Fused` variables, one per leaf of the
        optimizer state (`"momentum_0_1"`, ...; none for SGD); `get_opt_state()`
        reassembles it.

    Call: `layer(indices, offsets, per_sample_weights=None)`, with the functional
    core's input format and output. Indices and offsets must be integer arrays (else
    `ValueError`).

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> from flax import nnx
      >>> from tt_jax.nnx import TTEmbeddingBag
      >>> layer = TTEmbeddingBag(tt_jax.TTSpec(100, 8, ranks=(4, 4)), impl="xla", rngs=nnx.Rngs(0))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 3, 5], jnp.int32)
      >>> nnx.jit(lambda layer, i, o: layer(i, o))(layer, indices, offsets).shape
      (2, 8)
      >>> [[c.shape for c in cores] for cores in layer.tt.get_cores(layer.get_params())]
      [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)]]
    """

    def __init__(
        self,
        specs: TTSpec | Sequence[TTSpec],
        *,
        feature_table_map: Sequence[int] | None = None,
        pooling: str = "sum",
        impl: str = "auto",
        interpret: bool = False,
        config: TTKernelConfig | None = None,
        initializer: str = "approx-normal",
        init_std: float | None = None,
        optimizer: FusedOptimizer | None = None,
        rngs: nnx.Rngs,
    ):
        check_optimizer(optimizer, FusedOptimizer, _MAKERS)
        self.tt = _TTCore(specs, feature_table_map=feature_table_map, pooling=pooling, impl=impl,
                          interpret=interpret, config=config)
        self.optimizer = optimizer
        params = self.tt.init(rngs.params(), initializer, init_std)
        names, leaves, self._treedef = _flatten(params)
        self._names = names
        var = nnx.Param if optimizer is None else Fused
        self.embedding = nnx.Dict({n: var(v) for n, v in zip(names, leaves)})
        if optimizer is not None:
            self._opt_names, leaves, self._opt_treedef = _flatten(optimizer.init(params))
            self.opt_state = nnx.Dict({n: Fused(v) for n, v in zip(self._opt_names, leaves)})

    def get_params(self) -> dict:
        """The functional core's params dict (`{"cores": ((G_0, G_1, ...), ...)}`) held by this layer."""
        return jax.tree_util.tree_unflatten(self._treedef, [self.embedding[n][...] for n in self._names])

    def set_params(self, params: dict) -> None:
        """Copy a functional core's params (from `layer.tt.init`/`set_cores`) into the layer."""
        names, leaves, treedef = _flatten(params)
        if treedef != self._treedef:
            raise ValueError(f"params have the structure {treedef}; this layer's is {self._treedef}")
        for n, v in zip(names, leaves):
            have = self.embedding[n]
            if tuple(v.shape) != tuple(have.shape) or v.dtype != have.dtype:
                raise ValueError(f"params {n} must be {have.dtype}{list(have.shape)}, got {v.dtype}{list(v.shape)}")
            have[...] = v

    def get_opt_state(self):
        """Fused mode: the optimizer state as the core expects it (e.g. `tt_jax.RowwiseAdagradState`)."""
        if self.optimizer is None:
            raise ValueError("this layer has no fused optimizer (optimizer=None): it holds no optimizer state")
        return jax.tree_util.tree_unflatten(self._opt_treedef, [self.opt_state[n][...] for n in self._opt_names])

    def set_opt_state(self, opt_state) -> None:
        """Fused mode: copy an optimizer state (from `optimizer.init(params)`) into the layer."""
        if self.optimizer is None:
            raise ValueError("this layer has no fused optimizer (optimizer=None): it holds no optimizer state")
        names, leaves, treedef = _flatten(opt_state)
        if treedef != self._opt_treedef:
            raise ValueError(f"opt_state has the structure {treedef}; this layer's is {self._opt_treedef}")
        for n, v in zip(names, leaves):
            if tuple(v.shape) != tuple(self.opt_state[n].shape):
                raise ValueError(f"opt_state {n} must have shape {tuple(self.opt_state[n].shape)}, got {v.shape}")
            self.opt_state[n][...] = v

    def __call__(self, indices, offsets, per_sample_weights=None):
        check_ids(indices, offsets)
        params = self.get_params()
        if self.optimizer is None:
            return self.tt(params, indices, offsets, per_sample_weights)
        return self.tt.fused_lookup(params, self.get_opt_state(), self.optimizer, indices, offsets,
                                    per_sample_weights)
