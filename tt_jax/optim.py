"""Optimizers on TT cores: SGD, Adagrad, row-wise Adagrad and the Adam family, per core slice.

The optimizers are `tbe_jax.optim`'s (one family for both packages: `tt_jax.Adam is tbe_jax.Adam`), with
the same hyperparameters as values (floats, scalar arrays or schedules), the same states (their slots
shaped like `params`, and the step `count`) and the same non-finite policy (`skip_nonfinite`: a slice
whose gradient is not finite is left unchanged, with its state). On a TT core the *row* of the
`tbe_jax.optim` formulas is a core slice.

A *slice* of core t is `G_t[i]`, the `[r_{t-1}, q_t, r_t]` block of one digit value i. A slice is *touched*
by a batch when some valid lookup of the batch has digit i_t = i (whatever its gradient: a lookup with
per-sample weight 0, or whose bag's output gradient is 0, touches its slices). For every touched slice,
`g` is its exact gradient summed over the whole batch (`tt_jax.backward`); then, once per slice per step,
in fp32:

    SGD:                G -= lr * g
    Adagrad:            m += g**2                  (element-wise, m has the core's shape)
                        G -= lr * g / (sqrt(m) + eps)
    row-wise Adagrad:   m += mean(g**2 over the slice)   (one accumulator per slice: m is [p_t])
                        G -= lr * g / (sqrt(m) + eps)
        (weight_decay_mode "l2" / "decoupled" as in `tbe_jax.optim`, with the slice as the row)
    Adam:               m1 = b1 m1 + (1 - b1) g;  m2 = b2 m2 + (1 - b2) g**2   (element-wise, the core's shape)
                        G -= lr * ((m1 / (1 - b1**t)) / (sqrt(m2 / (1 - b2**t)) + eps) + wd * G)
    partial row-wise Adam: as Adam with one m2 per slice ([p_t]): m2 = b2 m2 + (1 - b2) mean(g**2 over the slice)
    LAMB:               r as Adam's; G -= lr * (||G|| / ||r||) * r   (norms over the slice; ratio 1 if either is 0)
    partial row-wise LAMB: LAMB with partial row-wise Adam's m2

(`t = count + 1`, the global step: `state.count` counts every `apply_gradients`, whichever slices it
touched.) Slices the batch does not touch are left bitwise unchanged, and so is their state: the Adam
family is *lazy*, as FBGEMM's is (an untouched slice's moments do not decay and it does not move, while
the bias correction uses the global count); a touched slice whose summed gradient is exactly 0 still
steps (its moments decay; with Adam it moves by its first moment and its weight decay). FBTT-Embedding's
Adagrad instead updates every slice of a dense gradient; its zero-gradient slices then do not move
either, so the two agree on values. The Adam family's element-wise moments may be stored in float16 or
bfloat16 (`state_dtype`; computed in fp32, stored rounded to nearest).

On the XLA backward the update is a gather of the touched slices, the formula, and a scatter back
(`update_slices`): the float work is `O(touched slices)` per core, not `O(p_t)`. The Pallas backward gives
dense core-shaped gradients (zero on untouched slices) and the update runs over the whole core
(`update_dense`, O(p_t) per core). For SGD, Adagrad and row-wise Adagrad without weight decay a zero
gradient leaves a slice and its state bitwise unchanged, so the dense pass needs nothing else; for the
others (`needs_touched_mask`) it keeps the slices outside the batch's touched mask
(`tt_jax.backward.touched_slices`, read off the forward's plans: O(lookups) per core, no host sync).
Under `jax.jit`, donate the cores and the state (`donate_argnums`) so XLA updates them in place instead
of copying them first.

Example (Adam on one table; `get_state` reads the moments per table, per core):
  >>> import jax, jax.numpy as jnp, tt_jax
  >>> emb = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(60, 8, ranks=(2, 2)), impl="xla")
  >>> params = emb.init(jax.random.key(0), std=0.3)
  >>> opt = tt_jax.Adam(learning_rate=0.01)
  >>> state = emb.init_opt_state(params, opt)
  >>> idx, off = jnp.array([3, 59, 3], jnp.int32), jnp.array([0, 2, 3], jnp.int32)
  >>> params, state = emb.apply_gradients(params, state, opt, idx, off, jnp.ones((2, 8)))
  >>> int(state.count), [m.shape for m in emb.get_state(state, "momentum2")[0]]
  (1, [(4, 1, 2, 2), (4, 2, 2, 2), (4, 2, 2, 1)])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tbe_jax.optim import (  # noqa: F401  (the shared family, re-exported)
    SGD, Adagrad, AdagradState, Adam, AdamState, KernelRule, Lamb, Optimizer, PartialRowwiseAdam,
    PartialRowwiseLamb, RowwiseAdagrad, RowwiseAdagradState, SGDState, apply_rule,
)


_TT_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")
_SUPPORTED = ("tt_jax.SGD, Adagrad, RowwiseAdagrad, Adam, PartialRowwiseAdam, Lamb or PartialRowwiseLamb "
              "(the optimizers of tbe_jax.optim)")


def check_opt(opt):
    if not isinstance(opt, Optimizer):
        raise TypeError(f"opt must be a tbe_jax/tt_jax optimizer ({_SUPPORTED}), got {type(opt).__name__}")
    if opt.rule().kind not in _TT_KINDS:
        raise TypeError(f"tt_jax cores do not support {type(opt).__name__}; use {_SUPPORTED}")


def needs_touched_mask(rule: KernelRule) -> bool:
    """Whether a zero gradient can move a slice or its state under `rule` (then the dense update of the
    Pallas backward needs the batch's touched mask): every kind but SGD, Adagrad and row-wise Adagrad
    without weight decay (Adam's moments decay and its step is `m1`'s; weight decay moves the weights)."""
    if rule.kind in ("sgd", "adagrad"):
        return False
    if rule.kind == "rowwise_adagrad":
        return rule.weight_decay_mode != "none"
    return True


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


def update_slices(rule: KernelRule, hyper, core: jax.Array, slots: tuple, ids: jax.Array, grads: jax.Array):
    """One step on the slices `ids` of one core: returns (core, slots).

    Args:
      rule, hyper: the optimizer's `rule()` and its step's `hyperparameters(count)`.
      core: `[p, r, q, r']` float32.
      slots: the core's state slots, a tuple (`Optimizer.slots` order; empty for SGD): each `[p, r, q, r']`
        (element-wise; fp32, or the Adam family's `state_dtype`) or `[p]` (one value per slice, fp32).
      ids: `[W]` int32 distinct slice ids; entries >= p are padding (no update).
      grads: `[W, r, q, r']` their batch-summed gradients.
    """
    p = core.shape[0]
    safe = jnp.minimum(ids, p - 1)
    g = grads.astype(jnp.float32)
    w = core[safe].astype(jnp.float32)
    old = tuple(s[safe].astype(jnp.float32) for s in slots)
    new_w, new_s, _ = apply_rule(rule, w, old, g, hyper, row_axes=tuple(range(1, g.ndim)))
    if rule.skip_nonfinite:
        ok = _finite_slices(g)
        ids = jnp.where(ok, ids, p)  # dropped by the scatters below
    core = core.at[ids].set(new_w.astype(core.dtype), mode="drop")
    slots = tuple(s.at[ids].set(n.astype(s.dtype), mode="drop") for s, n in zip(slots, new_s))
    return core, slots


def update_dense(rule: KernelRule, hyper, core: jax.Array, slots: tuple, grads: jax.Array,
                 touched: jax.Array | None = None):
    """One step on every touched slice of one core from its dense batch gradient: returns (core, slots).

    The Pallas backward's form: `grads` has the core's shape, zeros on the slices the batch does not touch.
    `touched`: `[p]` bool, the batch's touched slices (`tt_jax.backward.touched_slices`); the other slices
    and their state come back bitwise unchanged. It is required when `needs_touched_mask(rule)`; without
    it (SGD, Adagrad, row-wise Adagrad without weight decay) a zero gradient is the identity: SGD computes
    `w - lr * 0 = w`; Adagrad `m + 0 = m` (m >= 0, so never -0.0) and `w - lr * 0 / (sqrt(m) + eps) = w`
    (eps > 0: no 0/0); row-wise Adagrad `m + mean(0) = m`, then the same. The work is O(core size) (cores
    are small: O(p) slices).
    """
    if touched is None and needs_touched_mask(rule):
        raise ValueError(f"update_dense: a {rule.kind!r} step (weight_decay_mode={rule.weight_decay_mode!r}) "
                         "moves zero-gradient slices; pass the batch's touched mask")
    g = grads.astype(jnp.float32)
    old = tuple(s.astype(jnp.float32) for s in slots)
    new_w, new_s, _ = apply_rule(rule, core.astype(jnp.float32), old, g, hyper, row_axes=tuple(range(1, g.ndim)))
    ok = touched
    if rule.skip_nonfinite:
        fin = _finite_slices(g)
        ok = fin if ok is None else ok & fin
    new_s = tuple(n.astype(s.dtype) for n, s in zip(new_s, slots))
    new_w = new_w.astype(core.dtype)
    if ok is not None:
        new_w = _keep(ok, new_w, core)
        new_s = tuple(_keep(ok, n, s) for n, s in zip(new_s, slots))
    return new_w, new_s
