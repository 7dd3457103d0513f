"""Haiku layer over `tt_jax.TTEmbeddingBag` (needs dm-haiku).

`TTEmbeddingBag` is an `hk.Module` wrapping one functional `tt_jax.TTEmbeddingBag`
(`layer.tt`). It mirrors `tbe_jax.haiku.TableBatchedEmbed` and trains in one of two
ways:

1. **True gradient** (default, `optimizer=None`). The TT cores are parameters named
   after their path in the functional core's params dict (`"cores_0_1"`: table 0,
   core 1). `jax.grad` gives their exact gradient; any optax optimizer applies it.
   `core_params(params["<module name>"], emb)` reassembles the core's params dict and
   `module_params(tt_params)` goes the other way:

   >>> import jax, jax.numpy as jnp, optax, haiku as hk, tt_jax
   >>> from tt_jax.haiku import TTEmbeddingBag
   >>> specs = [tt_jax.TTSpec(100, 8, ranks=(4, 4)), tt_jax.TTSpec(50, 4, ranks=(2,))]
   >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
   >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
   >>> labels = jnp.array([1.0, -1.0])
   >>> def forward(indices, offsets, optimizer=None):
   ...     pooled = TTEmbeddingBag(specs, pooling="mean", impl="xla", optimizer=optimizer,
   ...                             name="embed")(indices, offsets)
   ...     return hk.Linear(1)(pooled)[:, 0]
   >>> model = hk.without_apply_rng(hk.transform(forward))
   >>> params = model.init(jax.random.key(0), indices, offsets)
   >>> sorted(params["embed"])
   ['cores_0_0', 'cores_0_1', 'cores_0_2', 'cores_1_0', 'cores_1_1']
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

2. **Fused optimizer** (`optimizer=tt_jax.rowwise_adagrad(...)`, `tt_jax.adagrad(...)`
   or `tt_jax.sgd(...)`). The layer calls `TTEmbeddingBag.fused_lookup`, whose backward
   applies the optimizer to the touched core slices and returns, as the "gradients" of
   the cores and of the optimizer state, their **updated values**. So the cores leave
   the parameters: cores and optimizer state are Haiku *state* (`hk.get_state`; use
   `hk.transform_with_state`), named `"fused_cores_0_1"`, ... (cores) and
   `"fused_momentum_0_1"`, ... (the state's leaves): the `FUSED_PREFIX` of
   `tbe_jax.haiku`, so its `is_fused` and `drop_fused` (re-exported here) pick out
   fused TBE and TT layers alike. A training step differentiates the loss with respect
   to the params and to the fused state; the fused state's gradient **is** its next
   value:

   >>> model = hk.without_apply_rng(hk.transform_with_state(forward))
   >>> adagrad = tt_jax.rowwise_adagrad(learning_rate=0.2)
   >>> params, state = model.init(jax.random.key(0), indices, offsets, adagrad)
   >>> sorted(state["embed"])[:3]
   ['fused_cores_0_0', 'fused_cores_0_1', 'fused_cores_0_2']
   >>> opt_state = tx.init(params)                 # only the dense layer's params
   >>> @jax.jit
   ... def fused_step(params, state, opt_state):
   ...     fused, other = hk.data_structures.partition(tt_jax.haiku.is_fused, state)
   ...     def loss_fn(params, fused):
   ...         pred, new_other = model.apply(params, hk.data_structures.merge(fused, other), indices, offsets,
   ...                                       adagrad)
   ...         return jnp.mean((pred - labels) ** 2), new_other
   ...     (loss, other), (grads, fused) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, fused)
   ...     updates, opt_state = tx.update(grads, opt_state, params)
   ...     state = hk.data_structures.merge(fused, tt_jax.haiku.drop_fused(other))
   ...     return optax.apply_updates(params, updates), state, opt_state, loss
   >>> losses = []
   >>> for _ in range(20):
   ...     params, state, opt_state, loss = fused_step(params, state, opt_state)
   ...     losses.append(float(loss))
   >>> losses[-1] < losses[0] / 2
   True
   >>> emb = tt_jax.TTEmbeddingBag(specs, pooling="mean", impl="xla")   # the layer's core, outside
   >>> tt_params = tt_jax.haiku.fused_params(state["embed"], emb)
   >>> [[c.shape for c in cores] for cores in emb.get_cores(tt_params)]
   [[(5, 1, 2, 4), (5, 4, 2, 4), (5, 4, 2, 1)], [(8, 1, 2, 2), (7, 2, 2, 1)]]

   Rules of the fused path (those of `fused_lookup`): call each fused layer once per
   loss and let its output reach the loss (a fused layer whose output does not
   influence the loss gets a zero "gradient", i.e. zeroed cores); per-sample weights
   are constants.

The functional core: `layer.tt` (inside a transform) or, outside, a
`tt_jax.TTEmbeddingBag` built with the same options: its params are
`core_params(params["<module name>"], emb)` (true-gradient mode) or
`fused_params(state["<module name>"], emb)` (fused mode), and
`fused_opt_state(state["<module name>"], emb, optimizer)` rebuilds the optimizer state;
`module_params` and `module_state` build a layer's entries from a core's params.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

try:
    import haiku as hk
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tt_jax.haiku needs dm-haiku: pip install 'tbe-jax[haiku]' (or pip install dm-haiku)"
    ) from e

from tbe_jax._layers import check_ids, check_optimizer
from tbe_jax.haiku import FUSED_PREFIX, drop_fused, is_fused
from tt_jax.kernels.forward import TTKernelConfig
from tt_jax.optim import FusedOptimizer
from tt_jax.specs import TTSpec
from tt_jax.tt import TTEmbeddingBag as _TTCore

__all__ = [
    "FUSED_PREFIX", "TTEmbeddingBag", "core_params", "drop_fused", "fused_opt_state", "fused_params", "is_fused",
    "module_params", "module_state",
]
_MAKERS = "tt_jax.rowwise_adagrad(...), tt_jax.adagrad(...) or tt_jax.sgd(...)"  # in the error for a bad optimizer


def _param_shapes(emb: _TTCore) -> dict:
    """The core's params dict as ShapeDtypeStructs (`{"cores": per table, per core}`)."""
    return {"cores": tuple(tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in spec.core_shapes())
                           for spec in emb.specs)}


def _flatten(tree, prefix: str = "") -> tuple[list[str], list, object]:
    """(names, leaves, treedef): one name per leaf, `prefix` + its path joined by "_" ("cores_0_1")."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [prefix + jax.tree_util.keystr(p, simple=True, separator="_") for p, _ in leaves]
    return names, [v for _, v in leaves], treedef


def _gather(module_entry, spec_tree, prefix: str):
    names, _, treedef = _flatten(spec_tree, prefix)
    missing = [n for n in names if n not in module_entry]
    if missing:
        raise ValueError(f"the layer's entry has no {missing}; it has {sorted(module_entry)}")
    return jax.tree_util.tree_unflatten(treedef, [module_entry[n] for n in names])


def core_params(module_params, emb: _TTCore) -> dict:
    """True-gradient mode: the core's params dict from a layer's parameters (`params["<module name>"]`)."""
    return _gather(module_params, _param_shapes(emb), "")


def fused_params(module_state, emb: _TTCore) -> dict:
    """Fused mode: the core's params dict from a layer's state entry (`state["<module name>"]`)."""
    return _gather(module_state, _param_shapes(emb), FUSED_PREFIX)


def fused_opt_state(module_state, emb: _TTCore, optimizer: FusedOptimizer):
    """Fused mode: the optimizer state (e.g. `tt_jax.RowwiseAdagradState`) from a layer's state entry."""
    return _gather(module_state, jax.eval_shape(optimizer.init, _param_shapes(emb)), FUSED_PREFIX)


def module_params(params: dict) -> dict:
    """True-gradient mode: a layer's parameter entry (`{"cores_0_0": ..., ...}`) holding the core's `params`."""
    names, leaves, _ = _flatten(params)
    return dict(zip(names, leaves))


def module_state(params: dict, opt_state) -> dict:
    """Fused mode: a layer's state entry (`{"fused_cores_0_0": ..., "fused_momentum_0_0": ...}`)."""
    names, leaves, _ = _flatten(params, FUSED_PREFIX)
    opt_names, opt_leaves, _ = _flatten(opt_state, FUSED_PREFIX)
    return dict(zip(names + opt_names, leaves + opt_leaves))


class TTEmbeddingBag(hk.Module):
    """Tensor-train embedding bags as a Haiku module.

    Args (the options of `tt_jax.TTEmbeddingBag`, `specs` positional, the rest
    keyword-only):
      specs: one `TTSpec` or a sequence of them.
      feature_table_map, pooling, impl, interpret, config: forwarded to
        `tt_jax.TTEmbeddingBag`.
      initializer, init_std: the core's `init(key, init=initializer, std=init_std)`.
      optimizer: None (true-gradient mode: the cores are parameters "cores_0_0", ...),
        or `tt_jax.rowwise_adagrad(...)` / `tt_jax.adagrad(...)` / `tt_jax.sgd(...)`
        (fused mode: cores and optimizer state are state entries "fused_cores_0_0",
        "fused_momentum_0_0", ...; see the module docstring for the training step).
      name: the module name (default "tt_embedding_bag").

    Call: `layer(indices, offsets, per_sample_weights=None)`, with the functional
    core's input format and output. Indices and offsets must be integer arrays (else
    `ValueError`).

    Initialisation: the cores are `layer.tt.init(hk.next_rng_key(), ...)`, drawn once at
    init: the same values as the functional core given that key.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk, tt_jax
      >>> from tt_jax.haiku import TTEmbeddingBag
      >>> spec = tt_jax.TTSpec(100, 8, ranks=(4, 4))
      >>> f = hk.without_apply_rng(hk.transform(lambda i, o: TTEmbeddingBag(spec, impl="xla")(i, o)))
      >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)
      >>> offsets = jnp.array([0, 3, 5], jnp.int32)
      >>> params = jax.jit(f.init)(jax.random.key(0), indices, offsets)
      >>> jax.jit(f.apply)(params, indices, offsets).shape
      (2, 8)
      >>> emb = tt_jax.TTEmbeddingBag(spec, impl="xla")   # the same core, outside the transform
      >>> tt_params = tt_jax.haiku.core_params(params["tt_embedding_bag"], emb)
      >>> [[c.shape for c in cores] for cores in emb.get_cores(tt_params)]
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
        name: str | None = None,
    ):
        super().__init__(name=name)
        check_optimizer(optimizer, FusedOptimizer, _MAKERS)
        self.tt = _TTCore(specs, feature_table_map=feature_table_map, pooling=pooling, impl=impl,
                          interpret=interpret, config=config)
        self.initializer = initializer
        self.init_std = init_std
        self.optimizer = optimizer

    def __call__(self, indices, offsets, per_sample_weights=None):
        check_ids(indices, offsets)
        emb = self.tt
        shapes = _param_shapes(emb)
        # Draw every core from one key, as emb.init does, and only at init time.
        init = emb.init(hk.next_rng_key(), self.initializer, self.init_std) if hk.running_init() else None

        def read(getter, tree, prefix, init_tree):
            names, specs, treedef = _flatten(tree, prefix)
            init_leaves = None if init_tree is None else jax.tree_util.tree_leaves(init_tree)
            leaves = [
                getter(n, s.shape, s.dtype, init=lambda shape, dtype, i=i: init_leaves[i])
                for i, (n, s) in enumerate(zip(names, specs))
            ]
            return jax.tree_util.tree_unflatten(treedef, leaves)

        if self.optimizer is None:
            params = read(hk.get_parameter, shapes, "", init)
            return emb(params, indices, offsets, per_sample_weights)
        params = read(hk.get_state, shapes, FUSED_PREFIX, init)
        opt_spec = jax.eval_shape(self.optimizer.init, shapes)
        opt_state = read(hk.get_state, opt_spec, FUSED_PREFIX,
                         None if init is None else self.optimizer.init(init))
        return emb.fused_lookup(params, opt_state, self.optimizer, indices, offsets, per_sample_weights)
