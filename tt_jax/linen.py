"""Flax Linen layer over `tt_jax.TTEmbeddingBag`.

`TTEmbeddingBag` is an `nn.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(available as `layer.tt`, also on an unbound module). It mirrors
`tbe_jax.linen.TableBatchedEmbed` and trains in one of two ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are one parameter,
   `"embedding"`, in the `"params"` collection, holding the functional core's params
   dict (`{"cores": ((G_0, G_1, G_2), ...)}`: per table, its cores `[p_t, r, q_t, r']`).
   `jax.grad` gives their exact gradient (the prefix-sharing backward of `tt_jax`) and
   any optax optimizer consumes it:

   >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, tt_jax
   >>> from tt_jax.linen import TTEmbeddingBag
   >>> specs = [tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> class Model(nn.Module):
   ...     optimizer: tt_jax.FusedOptimizer | None = None
   ...     @nn.compact
   ...     def __call__(self, indices, offsets):
   ...         pooled = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=self.optimizer,
   ...                                 name="embed")(indices, offsets)
   ...         return nn.Dense(1)(pooled)[:, 0]
   >>> model = Model()
   >>> params = model.init(jax.random.key(0), indices, offsets)["params"]
   >>> jax.tree.map(jnp.shape, params["embed"]["embedding"]["cores"][1])
   ((8, 1, 2, 2), (7, 2, 2, 1))
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

2. **Fused optimizer** (`optimizer=tt_jax.rowwise_adagrad(...)`, `tt_jax.adagrad(...)`
   or `tt_jax.sgd(...)`). The layer calls `TTEmbeddingBag.fused_lookup`, whose backward
   applies the optimizer to the touched core slices and returns, as the "gradients" of
   the cores and of the optimizer state, their **updated values**. So the cores leave
   `"params"`: they and the optimizer state live in the collection
   `FUSED_COLLECTION = "tbe_fused"` (the same collection as `tbe_jax.linen`'s fused
   layers, so one training step serves a model holding both), as
   `{"embedding": {"cores": ...}, "opt_state": RowwiseAdagradState(...)}` under the
   layer's path. A training step differentiates the loss with respect to both
   `"params"` and `"tbe_fused"`; the gradient of `"tbe_fused"` **is** its next value
   (assign it, do not feed it to optax), and the dense layers train with optax:

   >>> model = Model(optimizer=tt_jax.rowwise_adagrad(learning_rate=0.2))
   >>> variables = model.init(jax.random.key(0), indices, offsets)
   >>> params, fused = variables["params"], variables["tbe_fused"]
   >>> sorted(fused["embed"])
   ['embedding', 'opt_state']
   >>> opt_state = tx.init(params)                 # no Adam moments for the cores
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
   >>> core = TTEmbeddingBag(specs, pooling="mean", impl="xla").tt   # what Model's layer wraps
   >>> [m.shape for m in core.get_momentum(fused["embed"]["opt_state"])[0]]   # one per core slice
   [(5,), (5,), (5,)]

   Rules of the fused path (those of `fused_lookup`): call each fused layer once per
   loss and let its output reach the loss (a fused layer whose output does not
   influence the loss gets a zero "gradient", i.e. zeroed cores); per-sample weights
   are constants. Donate `fused` to the jitted step (`donate_argnums`) so the touched
   slices are updated in place.

The functional core: `layer.tt` is the wrapped `tt_jax.TTEmbeddingBag`, so
`layer.tt.get_cores(variables["params"]["embedding"])` (or
`variables["tbe_fused"]["embedding"]` in fused mode) gives the per-table cores,
`layer.tt.full_table(...)` the materialised tables, and
`layer.tt.get_momentum(fused["opt_state"])` the Adagrad accumulators.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence


try:
    import flax.linen as nn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tt_jax.linen needs Flax: pip install 'tbe-jax[flax]' (or pip install flax)") from e

from tbe_jax._layers import check_ids, check_optimizer
from tbe_jax.linen import FUSED_COLLECTION
from tt_jax.kernels.forward import TTKernelConfig
from tt_jax.optim import FusedOptimizer
from tt_jax.specs import TTSpec
from tt_jax.tt import TTEmbeddingBag as _TTCore

__all__ = ["FUSED_COLLECTION", "TTEmbeddingBag"]
_MAKERS = "tt_jax.rowwise_adagrad(...), tt_jax.adagrad(...) or tt_jax.sgd(...)"  # in the error for a bad optimizer


@functools.lru_cache(maxsize=256)
def _core(specs, feature_table_map, pooling, impl, interpret, config) -> _TTCore:
    return _TTCore(specs, feature_table_map=feature_table_map, pooling=pooling, impl=impl, interpret=interpret,
                   config=config)


class TTEmbeddingBag(nn.Module):
    """Tensor-train embedding bags as a Linen module.

    Args (the options of `tt_jax.TTEmbeddingBag`, `specs` positional, the rest
    keyword-only):
      specs: one `TTSpec` or a sequence of them.
      feature_table_map, pooling, impl, interpret, config: forwarded to
        `tt_jax.TTEmbeddingBag`.
      initializer, init_std: the core's `init(key, init=initializer, std=init_std)`
        ("approx-normal" or "approx-uniform"; std None: FBGEMM's table scale).
      optimizer: None (true-gradient mode: the cores are the parameter `"embedding"`
        in `"params"`), or `tt_jax.rowwise_adagrad(...)` / `tt_jax.adagrad(...)` /
        `tt_jax.sgd(...)` (fused mode: the cores, `"embedding"`, and the optimizer
        state, `"opt_state"`, live in the `"tbe_fused"` collection, whose gradient is
        its next value; see the module docstring for the training step).

    Call: `layer(indices, offsets, per_sample_weights=None)`, with the functional
    core's input format (FBGEMM's: flat ids, feature-major offsets of length F*B+1)
    and output `[B, sum_f D_f]`. Indices and offsets must be integer arrays (else
    `ValueError`).

    Parameters: `"embedding"` is exactly the functional core's params dict, so
    `layer.tt(variables["params"]["embedding"], indices, offsets)` equals
    `layer.apply(variables, indices, offsets)`, and a core's params are copied in with
    `{"params": {"embedding": tt_params}}`. They are initialised by `layer.tt.init` with
    the key Linen hands to the parameter's initialiser (from the `"params"` rng and the
    module path).

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> from tt_jax.linen import TTEmbeddingBag
      >>> layer = TTEmbeddingBag([tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))],
      ...                        impl="xla")
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
      >>> variables = jax.jit(layer.init)(jax.random.key(0), indices, offsets)
      >>> jax.jit(layer.apply)(variables, indices, offsets).shape
      (2, 12)
      >>> [[c.shape for c in cores] for cores in layer.tt.get_cores(variables["params"]["embedding"])]
      [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)], [(8, 1, 2, 2), (7, 2, 2, 1)]]
    """

    specs: TTSpec | Sequence[TTSpec]
    _: dataclasses.KW_ONLY
    feature_table_map: Sequence[int] | None = None
    pooling: str = "sum"
    impl: str = "auto"
    interpret: bool = False
    config: TTKernelConfig | None = None
    initializer: str = "approx-normal"
    init_std: float | None = None
    optimizer: FusedOptimizer | None = None

    def __post_init__(self):
        check_optimizer(self.optimizer, FusedOptimizer, _MAKERS)
        self.tt  # noqa: B018  (builds the core: bad options fail here, with the core's messages)
        super().__post_init__()

    @property
    def tt(self) -> _TTCore:
        """The wrapped functional `tt_jax.TTEmbeddingBag` (immutable, hashable)."""
        specs = (self.specs,) if isinstance(self.specs, TTSpec) else tuple(self.specs)
        fmap = None if self.feature_table_map is None else tuple(int(t) for t in self.feature_table_map)
        return _core(specs, fmap, self.pooling, self.impl, bool(self.interpret), self.config)

    def _init_params(self, key):
        return self.tt.init(key, self.initializer, self.init_std)

    @nn.compact
    def __call__(self, indices, offsets, per_sample_weights=None):
        check_ids(indices, offsets)
        emb = self.tt
        if self.optimizer is None:
            params = self.param("embedding", self._init_params)
            return emb(params, indices, offsets, per_sample_weights)
        cores = self.variable(FUSED_COLLECTION, "embedding", lambda: self._init_params(self.make_rng("params")))
        state = self.variable(FUSED_COLLECTION, "opt_state", lambda: self.optimizer.init(cores.value))
        return emb.fused_lookup(cores.value, state.value, self.optimizer, indices, offsets, per_sample_weights)
