"""The safe training step: lookups, the loss gradient, then the sparse updates.

`train_step` runs each embedding's lookup, takes the gradient of the loss with
respect to the dense parameters and to the pooled outputs (never to the tables),
and hands each output gradient to its embedding's `apply_gradients`. So:

- an output that does not reach the loss gets a zero gradient: its rows step with
  `g = 0` (weights unchanged; only the step count advances);
- gradient transforms (`optax.clip_by_global_norm`, a data-parallel `pmean`,
  accumulation) see only `grads`, the dense parameters' gradient;
- the tables never pass through `jax.grad`, so nothing can be double-counted.

Works for `tbe_jax.TableBatchedEmbedding` and `tt_jax.TTEmbeddingBag` alike, sharded or not (any
`tbe_jax.core.SparseCore`: its `step_forward` / `step_update`), with any number of lookups.

Example:
  >>> import jax, jax.numpy as jnp, optax, tbe_jax
  >>> emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(100, 8), tbe_jax.TableSpec(50, 4)], impl="xla")
  >>> opt = tbe_jax.RowwiseAdagrad(learning_rate=0.5)
  >>> tables = emb.init(jax.random.key(0)); table_state = emb.init_opt_state(tables, opt)
  >>> head = {"w": jnp.zeros((12,)), "b": jnp.zeros(())}
  >>> adam = optax.adam(0.05); head_state = adam.init(head)
  >>> indices = jnp.array([1, 2, 3, 7, 7], jnp.int32)   # 2 features x B=2 bags
  >>> offsets = jnp.array([0, 2, 3, 3, 5], jnp.int32)
  >>> labels = jnp.array([1.0, -1.0])
  >>> def loss_fn(head, pooled):
  ...     return jnp.mean((pooled @ head["w"] + head["b"] - labels) ** 2)
  >>> @jax.jit
  ... def step(head, head_state, tables, table_state, opt):
  ...     res = tbe_jax.train_step(loss_fn, head, tbe_jax.SparseLookup(
  ...         emb, opt, tables, table_state, indices, offsets))
  ...     updates, head_state = adam.update(res.grads, head_state, head)
  ...     return optax.apply_updates(head, updates), head_state, res.params, res.opt_state, res.loss
  >>> losses = []
  >>> for _ in range(20):
  ...     head, head_state, tables, table_state, loss = step(head, head_state, tables, table_state, opt)
  ...     losses.append(float(loss))
  >>> losses[-1] < losses[0] / 2
  True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from tbe_jax.core import SparseCore

__all__ = ["SparseLookup", "StepReport", "TrainStepResult", "train_step"]


class SparseLookup(NamedTuple):
    """One embedding lookup of a training step, with what its update needs.

    `emb` is a `TableBatchedEmbedding` or a `TTEmbeddingBag`; `opt` an optimizer of
    `tbe_jax.optim` (`RowwiseAdagrad`, `SGD`, ...); `params` and `opt_state` its
    tables and optimizer state; the rest is the lookup's input as `emb(...)` takes it.
    `options` are extra keyword arguments of the lookup (e.g.
    `{"batch_size_per_feature": (...)}`).
    """

    emb: Any
    opt: Any
    params: Any
    opt_state: Any
    indices: Any
    offsets: Any
    per_sample_weights: Any = None
    options: Any = None


class StepReport(NamedTuple):
    """Device-side counts of one lookup's step (int32 scalars; no host sync)."""

    invalid_indices: jax.Array  # ids skipped as outside their table (counted in every bounds_check mode but "fatal")
    nonfinite_grads: jax.Array  # NaN/inf values in the output gradient (their rows were skipped by default)


class TrainStepResult(NamedTuple):
    """What `train_step` returns. For a dict of lookups, `params`, `opt_state`, `outputs` and `report`
    are dicts with the same keys; for one `SparseLookup`, the values themselves."""

    loss: jax.Array
    aux: Any  # loss_fn's auxiliary output (has_aux=True), else None
    grads: Any  # gradient of the loss with respect to dense_params
    params: Any  # the embeddings' tables after the step
    opt_state: Any  # their optimizer states after the step
    outputs: Any  # the lookups' outputs (pooled embeddings) the loss saw
    report: Any  # StepReport per lookup


def train_step(loss_fn: Callable, dense_params, lookups, *, has_aux: bool = False) -> TrainStepResult:
    """One training step: lookups, loss gradient, sparse updates (see the module doc).

    Args:
      loss_fn: `loss_fn(dense_params, outputs) -> loss` (or `(loss, aux)` with
        `has_aux`), where `outputs` is the lookup's output array for one
        `SparseLookup`, or a dict of them for a dict of lookups.
      dense_params: any pytree, differentiated (give `None` or `{}` if there is none).
      lookups: a `SparseLookup` or a dict of them.
      has_aux: as in `jax.value_and_grad`.

    Returns:
      `TrainStepResult`: the loss, the dense gradient for your optax optimizer, and
      each embedding's new tables and state (donate the old ones to the jitted step).
    """
    single = isinstance(lookups, SparseLookup)
    if not single and not isinstance(lookups, Mapping):
        raise TypeError(f"lookups must be a tbe_jax.SparseLookup or a dict of them (name -> SparseLookup), "
                        f"got {type(lookups).__name__}")
    items = {None: lookups} if single else dict(lookups)
    for k, lk in items.items():
        if not isinstance(lk, SparseLookup):
            raise TypeError(f"lookups[{k!r}] must be a tbe_jax.SparseLookup, got {type(lk).__name__}")
        if not isinstance(lk.emb, SparseCore):
            raise TypeError(f"SparseLookup.emb must be a TableBatchedEmbedding or TTEmbeddingBag, "
                            f"got {type(lk.emb).__name__}")
    seen = {}
    for k, lk in items.items():  # each table in one lookup per step: two would each update from the old values
        for leaf in jax.tree_util.tree_leaves(lk.params):
            if id(leaf) in seen and seen[id(leaf)] != k:
                raise ValueError(
                    f"lookups {seen[id(leaf)]!r} and {k!r} share tables: a step must look each table up once "
                    "(look one table up for several features with the embedding's feature_table_map)")
            seen[id(leaf)] = k
    outputs, residuals = {}, {}
    for k, lk in items.items():
        outputs[k], residuals[k] = lk.emb.step_forward(lk.params, lk.indices, lk.offsets, lk.per_sample_weights,
                                                        **(lk.options or {}))
    arg = outputs[None] if single else outputs
    value, (grads, g_out) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux)(dense_params, arg)
    loss, aux = value if has_aux else (value, None)
    g_out = {None: g_out} if single else g_out
    params, states, reports = {}, {}, {}
    for k, lk in items.items():
        g = g_out[k]
        params[k], states[k], invalid = lk.emb.step_update(lk.params, lk.opt_state, lk.opt, residuals[k], g)
        nonfinite = jnp.sum(~jnp.isfinite(g), dtype=jnp.int32)
        reports[k] = StepReport(jnp.asarray(invalid, jnp.int32), nonfinite)
    if single:
        return TrainStepResult(loss, aux, grads, params[None], states[None], outputs[None], reports[None])
    return TrainStepResult(loss, aux, grads, params, states, outputs, reports)
