"""Optimizers applied inside the TBE backward (fused): exact row-wise Adagrad and SGD.

Semantics (FBGEMM's EXACT_ROWWISE_ADAGRAD and EXACT_SGD): for every (table, row)
that occurs in the batch, `g` is the sum over its occurrences of the scaled
output gradient (per-sample weight, and 1/len for mean pooling); then

    row-wise Adagrad:  m += mean(g**2 over D);  row -= lr * g / (sqrt(m) + eps)
    SGD:               row -= lr * g

once per row per step, in fp32 (rows stored in fp16/bf16 are rounded to nearest
on the store). Rows not in the batch are left bitwise unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad:
    """Exact row-wise Adagrad: one fp32 accumulator per table row."""

    learning_rate: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    stochastic_rounding: bool = False  # fp16/bf16 tables: round the stored row stochastically

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"RowwiseAdagrad.learning_rate must be > 0, got {self.learning_rate}")
        if not self.eps >= 0:
            raise ValueError(f"RowwiseAdagrad.eps must be >= 0, got {self.eps}")
        if not self.initial_accumulator_value >= 0:
            raise ValueError(
                f"RowwiseAdagrad.initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}"
            )


@dataclasses.dataclass(frozen=True)
class SGD:
    """Exact SGD on the looked-up rows (no optimizer state)."""

    learning_rate: float = 0.01
    stochastic_rounding: bool = False  # fp16/bf16 tables: round the stored row stochastically

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"SGD.learning_rate must be > 0, got {self.learning_rate}")


class RowwiseAdagradState(NamedTuple):
    """State of `rowwise_adagrad`: the row-wise accumulators."""

    momentum: dict  # per storage buffer ("d{D}"): [rows] float32


class SGDState(NamedTuple):
    """State of `sgd`: none."""


class FusedOptimizer(NamedTuple):
    """An optimizer applied inside the backward of `TableBatchedEmbedding.fused_lookup`.

    optax-style in shape (a factory returning pure functions, state a NamedTuple),
    but with no `update` function: the update runs inside the lookup's backward.
    There, `jax.grad` with respect to the tables and to this state returns their
    *updated values* (the precedent is jax-tpu-embedding's sparse-dense matmul),
    to be taken as the new tables and state.
    """

    init: Callable  # params -> state
    opt: RowwiseAdagrad | SGD


def rowwise_adagrad(learning_rate: float = 0.01, eps: float = 1e-8,
                    initial_accumulator_value: float = 0.0, stochastic_rounding: bool = False) -> FusedOptimizer:
    """Exact row-wise Adagrad fused into the TBE backward.

    Update, per row in the batch with aggregated gradient g (D values):
    `m += mean(g**2)`, `row -= learning_rate * g / (sqrt(m) + eps)`.

    Examples:
      >>> import jax, jax.numpy as jnp, tbe_jax
      >>> emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(10, 4)], impl="xla")
      >>> tx = tbe_jax.rowwise_adagrad(learning_rate=0.1)
      >>> params = emb.init(jax.random.key(0)); state = tx.init(params)
      >>> idx, off = jnp.array([1, 2, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
      >>> loss = lambda p, s: jnp.sum(emb.fused_lookup(p, s, tx, idx, off))
      >>> params, state = jax.grad(loss, argnums=(0, 1))(params, state)   # the updated values
      >>> [float(m) for m in emb.get_momentum(state)[0][:3]]
      [0.0, 1.0, 4.0]
    """
    opt = RowwiseAdagrad(learning_rate, eps, initial_accumulator_value, stochastic_rounding)

    def init(params):
        return RowwiseAdagradState(
            {k: jnp.full((v.shape[0],), initial_accumulator_value, jnp.float32) for k, v in params.items()}
        )

    return FusedOptimizer(init, opt)


def sgd(learning_rate: float = 0.01, stochastic_rounding: bool = False) -> FusedOptimizer:
    """Exact SGD on the looked-up rows, fused into the TBE backward (no state)."""
    return FusedOptimizer(lambda params: SGDState(), SGD(learning_rate, stochastic_rounding))


def stochastic_round(x, dtype, row, col, *salts):
    """`x` (fp32) rounded to `dtype` (float16 or bfloat16) stochastically, as fp32 values.

    Unbiased: each value goes to one of its two `dtype` neighbours with probability
    proportional to closeness, so E[result] = x (no drift when updates are smaller
    than half an ulp, which round-to-nearest would drop). The uniform draw is a hash
    of the row, the column and the bits of `salts` (fp32 arrays that change every
    step: the update's gradient, the old weight, the new accumulator), so it is
    bitwise reproducible and needs no RNG state; with SGD, a row whose gradient and
    weight repeat exactly repeats its rounding decision. Pure jnp on int32/fp32, so
    the same code runs inside the Pallas kernels and in the reference.
    """
    import jax

    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    h = row * jnp.int32(-1640531535) ^ col * jnp.int32(-2048144789)  # 0x9E3779B1, 0x85EBCA6B
    for s in salts:
        h = h ^ jax.lax.bitcast_convert_type(s, jnp.int32)
    for mult in (0x7FEB352D, -2073254261):  # 0x846CA68B
        h = h ^ jax.lax.shift_right_logical(h, jnp.int32(16))
        h = h * jnp.int32(mult)
    h = h ^ jax.lax.shift_right_logical(h, jnp.int32(15))
    finite = jnp.abs(x) < jnp.inf
    if jnp.dtype(dtype) == jnp.bfloat16:  # bf16 is fp32's top half: add 16 random bits, truncate
        y = jax.lax.bitcast_convert_type((bits + (h & 0xFFFF)) & jnp.int32(-65536), jnp.float32)
        return jnp.where(finite, y, x)
    if jnp.dtype(dtype) != jnp.float16:
        raise ValueError(f"stochastic rounding targets float16 or bfloat16, not {jnp.dtype(dtype)}")
    e = jnp.clip(jax.lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF, 127 - 14, 127 + 15)  # biased exponent
    ulp = jax.lax.bitcast_convert_type((e - 10) << 23, jnp.float32)  # fp16 spacing at x: a power of two
    lo = jnp.floor(x / ulp) * ulp
    u = (jax.lax.shift_right_logical(h, jnp.int32(8)) & 0xFFFFFF).astype(jnp.float32) * (1.0 / (1 << 24))
    y = lo + jnp.where(u < (x - lo) / ulp, ulp, 0.0)
    return jnp.where(finite, y, x)
