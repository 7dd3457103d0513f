"""Optimizers on TT cores: SGD, element-wise Adagrad (FBTT-Embedding's) and row-wise Adagrad per core slice.

The optimizers are `tbe_jax.optim`'s (one family for both packages: `tt_jax.RowwiseAdagrad is
tbe_jax.RowwiseAdagrad`), with the same hyperparameters as values (floats, scalar arrays or schedules),
the same states (`momentum` shaped like `params`, and the step `count`) and the same non-finite policy
(`skip_nonfinite`: a slice whose gradient is not finite is left unchanged, with its state).

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

import jax
import jax.numpy as jnp

from tbe_jax.optim import (  # noqa: F401  (the shared family, re-exported)
    SGD, Adagrad, AdagradState, FusedOptimizer, KernelRule, Optimizer, RowwiseAdagrad, RowwiseAdagradState, SGDState,
    adagrad, apply_rule, rowwise_adagrad, sgd,
)


_TT_KINDS = ("sgd", "adagrad", "rowwise_adagrad")


def check_opt(opt):
    if not isinstance(opt, Optimizer):
        raise TypeError(f"opt must be a tbe_jax/tt_jax optimizer (tt_jax.SGD, tt_jax.Adagrad or "
                        f"tt_jax.RowwiseAdagrad), got {type(opt).__name__}")
    if opt.rule().kind not in _TT_KINDS:
        raise TypeError(f"tt_jax cores do not support {type(opt).__name__}; use tt_jax.SGD, tt_jax.Adagrad or "
                        "tt_jax.RowwiseAdagrad")


def init_state(opt, params: dict):
    """The optimizer state of `opt` for `params` (`{"cores": per table, per core}`)."""
    check_opt(opt)
    return opt.init(params)


def check_state(opt, state, params: dict):
    """Raise unless `state` is `opt`'s state for `params` (type, shapes and dtypes)."""
    opt.check_state(state, params)


def _finite_slices(g):
    return jnp.all(jnp.isfinite(g), axis=tuple(range(1, g.ndim)))


def _keep(ok, new, old):
    return jnp.where(ok.reshape(ok.shape + (1,) * (new.ndim - 1)), new, old)


def update_slices(rule: KernelRule, hyper, core: jax.Array, momentum: jax.Array | None, ids: jax.Array,
                  grads: jax.Array):
    """One step on the slices `ids` of one core: returns (core, momentum).

    Args:
      rule, hyper: the optimizer's `rule()` and its step's `hyperparameters(count)` (`[lr, eps]`).
      core: `[p, r, q, r']` float32.
      momentum: the core's accumulators (`[p, r, q, r']` or `[p]`), None for SGD.
      ids: `[W]` int32 distinct slice ids; entries >= p are padding (no update).
      grads: `[W, r, q, r']` their batch-summed gradients.
    """
    p = core.shape[0]
    safe = jnp.minimum(ids, p - 1)
    g = grads.astype(jnp.float32)
    w = core[safe]
    slots = () if momentum is None else (momentum[safe],)
    new_w, new_s, _ = apply_rule(rule, w, slots, g, hyper, row_axes=tuple(range(1, g.ndim)))
    new_m = new_s[0] if new_s else None
    if rule.skip_nonfinite:
        ok = _finite_slices(g)
        ids = jnp.where(ok, ids, p)  # dropped by the scatter below
    core = core.at[ids].set(new_w.astype(core.dtype), mode="drop")
    if new_m is not None:
        momentum = momentum.at[ids].set(new_m, mode="drop")
    return core, momentum


def update_dense(rule: KernelRule, hyper, core: jax.Array, momentum: jax.Array | None, grads: jax.Array):
    """One step on every slice of one core from its dense batch gradient: returns (core, momentum).

    The Pallas backward's form: `grads` has the core's shape, zeros on the slices the batch does not touch.
    Such a slice, and its state, come back bitwise unchanged: SGD computes `w - lr * 0 = w`; Adagrad
    `m + 0 = m` (m >= 0, so never -0.0) and `w - lr * 0 / (sqrt(m) + eps) = w` (eps > 0: no 0/0); row-wise
    Adagrad `m + mean(0) = m`, then the same. The work is O(core size) (cores are small: O(p) slices).
    """
    g = grads.astype(jnp.float32)
    new_w, new_s, _ = apply_rule(rule, core.astype(jnp.float32), () if momentum is None else (momentum,), g, hyper,
                                 row_axes=tuple(range(1, g.ndim)))
    new_m = new_s[0] if new_s else None
    if rule.skip_nonfinite:
        ok = _finite_slices(g)
        new_w = _keep(ok, new_w, core)
        if new_m is not None:
            new_m = _keep(ok, new_m, momentum)
    return new_w.astype(core.dtype), new_m
