"""Optimizers on TT cores: SGD, element-wise Adagrad (FBTT-Embedding's) and row-wise Adagrad per core slice.

A *slice* of core t is `G_t[i]`, the `[r_{t-1}, q_t, r_t]` block of one digit value i. A slice is *touched*
by a batch when some valid lookup of the batch has digit i_t = i. For every touched slice, `g` is its exact
gradient summed over the whole batch (`tt_jax.backward`); then, once per slice per step, in fp32:

    SGD:                G -= lr * g
    Adagrad:            m += g**2                  (element-wise, m has the core's shape)
                        G -= lr * g / (sqrt(m) + eps)
    row-wise Adagrad:   m += mean(g**2 over the slice)   (one accumulator per slice: m is [p_t])
                        G -= lr * g / (sqrt(m) + eps)

Slices the batch does not touch are left bitwise unchanged, and so is their state (FBTT-Embedding's
Adagrad instead updates every slice of a dense gradient; its zero-gradient slices then do not move either,
so the two agree on values).

On the XLA backward the update is a gather of the touched slices, the formula, and a scatter back
(`update_slices`): the float work is `O(touched slices)` per core, not `O(p_t)`. The Pallas backward gives
dense core-shaped gradients (zero on untouched slices) and the update runs over the whole core
(`update_dense`, O(p_t) per core; a zero gradient leaves a slice and its state bitwise unchanged).
Under `jax.jit`, donate the cores and the state (`donate_argnums`) so XLA updates them in place instead
of copying them first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


def _check_lr(name, lr):
    if not lr > 0:
        raise ValueError(f"{name}.learning_rate must be > 0, got {lr}")


def _check_adagrad(name, eps, initial_accumulator_value):
    if not eps > 0:
        raise ValueError(f"{name}.eps must be > 0 (a zero gradient over a zero accumulator is 0/0), got {eps}")
    if not initial_accumulator_value >= 0:
        raise ValueError(f"{name}.initial_accumulator_value must be >= 0, got {initial_accumulator_value}")


@dataclasses.dataclass(frozen=True)
class SGD:
    """SGD on the touched core slices: `G -= learning_rate * g` (no state)."""

    learning_rate: float = 0.01

    def __post_init__(self):
        _check_lr("SGD", self.learning_rate)


@dataclasses.dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad on the touched core slices (FBTT-Embedding's): one fp32 accumulator per core entry."""

    learning_rate: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self):
        _check_lr("Adagrad", self.learning_rate)
        _check_adagrad("Adagrad", self.eps, self.initial_accumulator_value)


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad:
    """Row-wise Adagrad on the touched core slices: one fp32 accumulator per slice `G_t[i]`."""

    learning_rate: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self):
        _check_lr("RowwiseAdagrad", self.learning_rate)
        _check_adagrad("RowwiseAdagrad", self.eps, self.initial_accumulator_value)


OPTIMIZERS = (SGD, Adagrad, RowwiseAdagrad)


class SGDState(NamedTuple):
    """State of `sgd`: none."""


class AdagradState(NamedTuple):
    """State of `adagrad`: element-wise accumulators, laid out as `params["cores"]`."""

    momentum: tuple  # per table, per core: [p_t, r_{t-1}, q_t, r_t] float32


class RowwiseAdagradState(NamedTuple):
    """State of `rowwise_adagrad`: one accumulator per core slice."""

    momentum: tuple  # per table, per core: [p_t] float32


def check_opt(opt):
    if not isinstance(opt, OPTIMIZERS):
        raise TypeError(f"opt must be tt_jax.SGD, tt_jax.Adagrad or tt_jax.RowwiseAdagrad, got {type(opt).__name__}")


def init_state(opt, params: dict):
    """The optimizer state of `opt` for `params` (`{"cores": per table, per core}`)."""
    check_opt(opt)
    cores = params["cores"]
    if isinstance(opt, SGD):
        return SGDState()
    v = opt.initial_accumulator_value
    if isinstance(opt, Adagrad):
        return AdagradState(tuple(tuple(jnp.full(c.shape, v, jnp.float32) for c in cs) for cs in cores))
    return RowwiseAdagradState(tuple(tuple(jnp.full((c.shape[0],), v, jnp.float32) for c in cs) for cs in cores))


def check_state(opt, state, params: dict):
    """Raise unless `state` is `opt`'s state for `params` (type and shapes)."""
    want = {SGD: SGDState, Adagrad: AdagradState, RowwiseAdagrad: RowwiseAdagradState}[type(opt)]
    if not isinstance(state, want):
        raise ValueError(f"opt_state is a {type(state).__name__}; {type(opt).__name__} needs {want.__name__}: "
                         "build it with emb.init_opt_state(params, opt)")
    if want is SGDState:
        return
    shapes = [[tuple(c.shape) if want is AdagradState else (c.shape[0],) for c in cs] for cs in params["cores"]]
    got = [[tuple(m.shape) for m in ms] for ms in state.momentum]
    if got != shapes:
        raise ValueError(f"opt_state accumulators have shapes {got}, expected {shapes}")


def update_slices(opt, core: jax.Array, momentum: jax.Array | None, ids: jax.Array, grads: jax.Array):
    """One step on the slices `ids` of one core: returns (core, momentum).

    Args:
      core: `[p, r, q, r']` float32.
      momentum: the core's accumulators (`[p, r, q, r']` or `[p]`), None for SGD.
      ids: `[W]` int32 distinct slice ids; entries >= p are padding (no update).
      grads: `[W, r, q, r']` their batch-summed gradients.
    """
    p = core.shape[0]
    safe = jnp.minimum(ids, p - 1)
    g = grads.astype(jnp.float32)
    w = core[safe]
    if isinstance(opt, SGD):
        new_w, new_m = w - opt.learning_rate * g, None
    elif isinstance(opt, Adagrad):
        new_m = momentum[safe] + g * g
        new_w = w - opt.learning_rate * g / (jnp.sqrt(new_m) + opt.eps)
    else:
        new_m = momentum[safe] + jnp.mean(g * g, axis=tuple(range(1, g.ndim)))
        new_w = w - opt.learning_rate * g / (jnp.sqrt(new_m) + opt.eps).reshape((-1,) + (1,) * (g.ndim - 1))
    core = core.at[ids].set(new_w.astype(core.dtype), mode="drop")
    if new_m is not None:
        momentum = momentum.at[ids].set(new_m, mode="drop")
    return core, momentum


def update_dense(opt, core: jax.Array, momentum: jax.Array | None, grads: jax.Array):
    """One step on every slice of one core from its dense batch gradient: returns (core, momentum).

    The Pallas backward's form: `grads` has the core's shape, zeros on the slices the batch does not touch.
    Such a slice, and its state, come back bitwise unchanged: SGD computes `w - lr * 0 = w`; Adagrad
    `m + 0 = m` (m >= 0, so never -0.0) and `w - lr * 0 / (sqrt(m) + eps) = w` (eps > 0: no 0/0); row-wise
    Adagrad `m + mean(0) = m`, then the same. The work is O(core size) (cores are small: O(p) slices).
    """
    g = grads.astype(jnp.float32)
    if isinstance(opt, SGD):
        return (core - opt.learning_rate * g).astype(core.dtype), None
    if isinstance(opt, Adagrad):
        m = momentum + g * g
        return (core - opt.learning_rate * g / (jnp.sqrt(m) + opt.eps)).astype(core.dtype), m
    m = momentum + jnp.mean(g * g, axis=tuple(range(1, g.ndim)))
    denom = (jnp.sqrt(m) + opt.eps).reshape((-1,) + (1,) * (g.ndim - 1))
    return (core - opt.learning_rate * g / denom).astype(core.dtype), m


class FusedOptimizer(NamedTuple):
    """An optimizer applied inside the backward of `TTEmbeddingBag.fused_lookup` (as `tbe_jax.FusedOptimizer`).

    optax-style in shape (a factory returning pure functions, state a NamedTuple), with no `update`:
    the update runs inside the lookup's backward, where `jax.grad` with respect to the params and this
    state returns their *updated values*, to be taken as the new params and state.
    """

    init: Callable  # params -> state
    opt: SGD | Adagrad | RowwiseAdagrad


def sgd(learning_rate: float = 0.01) -> FusedOptimizer:
    """SGD on the touched core slices, fused into the TT lookup's backward (no state)."""
    opt = SGD(learning_rate)
    return FusedOptimizer(lambda params: init_state(opt, params), opt)


def adagrad(learning_rate: float = 0.01, eps: float = 1e-8, initial_accumulator_value: float = 0.0) -> FusedOptimizer:
    """Element-wise Adagrad (FBTT-Embedding's) on the touched core slices, fused into the lookup's backward.

    Per touched slice with batch gradient g: `m += g**2`, `G -= learning_rate * g / (sqrt(m) + eps)`.
    """
    opt = Adagrad(learning_rate, eps, initial_accumulator_value)
    return FusedOptimizer(lambda params: init_state(opt, params), opt)


def rowwise_adagrad(learning_rate: float = 0.01, eps: float = 1e-8,
                    initial_accumulator_value: float = 0.0) -> FusedOptimizer:
    """Row-wise Adagrad (one accumulator per core slice) on the touched slices, fused into the lookup's backward.

    Per touched slice with batch gradient g: `m += mean(g**2)`, `G -= learning_rate * g / (sqrt(m) + eps)`.

    Examples:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> emb = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(100, 8, ranks=(4, 4)), impl="xla")
      >>> tx = tt_jax.rowwise_adagrad(learning_rate=0.1)
      >>> params = emb.init(jax.random.key(0)); state = tx.init(params)
      >>> idx, off = jnp.array([1, 2, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
      >>> loss = lambda p, s: jnp.sum(emb.fused_lookup(p, s, tx, idx, off))
      >>> params, state = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, state)   # the updated values
      >>> [int(jnp.sum(m > 0)) for m in emb.get_momentum(state)[0]]     # slices touched per core
      [1, 1, 2]
    """
    opt = RowwiseAdagrad(learning_rate, eps, initial_accumulator_value)
    return FusedOptimizer(lambda params: init_state(opt, params), opt)
