"""Sparse optimizers: one family for `tbe_jax` tables and `tt_jax` cores.

An optimizer here updates only what a batch touched: the table rows it looked up
(`TableBatchedEmbedding.apply_gradients`) or the TT core slices (`TTEmbeddingBag.
apply_gradients`). For every touched row (or slice), `g` is its gradient summed
over the whole batch (per-sample weights and 1/len for mean pooling included);
then, once per row per step, in fp32:

    SGD:               row -= lr * g
    Adagrad:           m += g**2;                 row -= lr * g / (sqrt(m) + eps)   (element-wise m)
    row-wise Adagrad:  m += mean(g**2 over the row); row -= lr * g / (sqrt(m) + eps) (one m per row)

(FBGEMM's EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD.) Rows the batch does
not touch, and their state, are left bitwise unchanged.

Hyperparameters are values, not compile-time constants. `learning_rate` is a
float, a jax scalar (possibly traced), or an optax-style schedule (a function of
the step count); numeric hyperparameters are pytree leaves of the optimizer, so
an optimizer passed to a jitted function as an ordinary argument (not a static
one) never recompiles when its values change. The step count lives in the state
(`state.count`, int32): as in optax, the first step uses `schedule(0)`, and each
`apply_gradients` adds one.

Non-finite gradients: with `skip_nonfinite=True` (the default), a row whose
summed gradient holds a NaN or an infinity is left unchanged, and so is its
state; the count of non-finite values in the output gradient is reported by
`tbe_jax.train_step`. `skip_nonfinite=False` applies the update as computed
(the row and its accumulator then turn NaN for good).

The state is built by `opt.init(params)` (or `emb.init_opt_state(params, opt)`,
which also checks the params) and is a `NamedTuple`: `SGDState(count)`,
`AdagradState(momentum, count)`, `RowwiseAdagradState(momentum, count)`, where
`momentum` has the params' tree structure (element-wise: each leaf's shape;
row-wise: `[leaf.shape[0]]`), fp32.

Example:
  >>> import jax, jax.numpy as jnp, optax, tbe_jax
  >>> emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(10, 4)], impl="xla")
  >>> opt = tbe_jax.RowwiseAdagrad(learning_rate=optax.linear_schedule(0.0, 0.1, 100))
  >>> params = emb.init(jax.random.key(0)); state = emb.init_opt_state(params, opt)
  >>> idx, off = jnp.array([1, 2, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
  >>> step = jax.jit(emb.apply_gradients)   # opt is an ordinary (traced) argument
  >>> params, state = step(params, state, opt, idx, off, jnp.ones((1, 4)))
  >>> int(state.count), [float(m) for m in emb.get_momentum(state)[0][:3]]
  (1, [0.0, 1.0, 4.0])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "Adagrad", "AdagradState", "FusedOptimizer", "Optimizer", "RowwiseAdagrad", "RowwiseAdagradState", "SGD",
    "SGDState", "adagrad", "rowwise_adagrad", "sgd", "stochastic_round",
]

ScalarOrSchedule = Any  # float | jax.Array | Callable[[count], scalar]


class SGDState(NamedTuple):
    """State of `SGD`: the step count."""

    count: jax.Array  # shape=(), int32: steps taken


class AdagradState(NamedTuple):
    """State of `Adagrad`: element-wise accumulators (the params' shapes) and the step count."""

    momentum: Any  # the params' tree: float32, each leaf's shape
    count: jax.Array  # shape=(), int32


class RowwiseAdagradState(NamedTuple):
    """State of `RowwiseAdagrad`: one accumulator per row (per leaf `[leaf.shape[0]]`) and the step count."""

    momentum: Any  # the params' tree: float32 [leaf.shape[0]]
    count: jax.Array  # shape=(), int32


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """The static part of an optimizer, what a kernel is compiled for (hashable)."""

    kind: str  # "sgd" | "adagrad" | "rowwise_adagrad"
    stochastic_rounding: bool
    skip_nonfinite: bool

    @property
    def has_momentum(self) -> bool:
        return self.kind != "sgd"


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_scalar(owner: str, name: str, value, *, positive: bool, allow_schedule: bool = False):
    """Validate a hyperparameter where its value is known (floats); arrays must be scalars."""
    if callable(value):
        if not allow_schedule:
            raise TypeError(f"{owner}.{name} must be a number or a scalar array, got a callable")
        return
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{owner}.{name} must be a number, a scalar array or a schedule, got {value!r}")
    if hasattr(value, "shape"):
        if tuple(value.shape) != ():
            raise ValueError(f"{owner}.{name} must be a scalar, got shape {tuple(value.shape)}")
        if _is_tracer(value) or not hasattr(value, "__float__"):
            return
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}.{name} must be a number, a scalar array or a schedule, got {value!r}") from None
    ok = v > 0 if positive else v >= 0
    if not ok:
        raise ValueError(f"{owner}.{name} must be {'> 0' if positive else '>= 0'}, got {v}")


class Optimizer:
    """Base of the sparse optimizers (`SGD`, `Adagrad`, `RowwiseAdagrad`).

    Subclasses are frozen dataclasses registered as pytrees: the fields listed in
    `_DYNAMIC` (numbers or scalar arrays) are leaves; schedules (callables) and the
    other fields are static.
    """

    _DYNAMIC: tuple[str, ...] = ()
    _KIND: str = ""
    state_type: type = SGDState

    # -- pytree -------------------------------------------------------------------
    def tree_flatten(self):
        fields = [f.name for f in dataclasses.fields(self)]
        dyn = tuple(n for n in self._DYNAMIC if not callable(getattr(self, n)))
        static = tuple((n, getattr(self, n)) for n in fields if n not in dyn)
        return tuple(getattr(self, n) for n in dyn), (dyn, static)

    @classmethod
    def tree_unflatten(cls, aux, children):
        dyn, static = aux
        obj = object.__new__(cls)  # no __post_init__: leaves may be tracers or placeholders
        for n, v in zip(dyn, children):
            object.__setattr__(obj, n, v)
        for n, v in static:
            object.__setattr__(obj, n, v)
        return obj

    # -- what kernels and references read -----------------------------------------
    def rule(self) -> KernelRule:
        return KernelRule(self._KIND, bool(getattr(self, "stochastic_rounding", False)),
                          bool(getattr(self, "skip_nonfinite", True)))

    def learning_rate_at(self, count) -> jax.Array:
        """The learning rate of the step whose count (before the step) is `count`, fp32 scalar."""
        lr = self.learning_rate
        if callable(lr):
            lr = lr(count)
        return jnp.asarray(lr, jnp.float32).reshape(())

    def hyperparameters(self, count) -> jax.Array:
        """`[learning_rate, eps]` of this step as an fp32 array (a kernel operand, not a constant)."""
        eps = getattr(self, "eps", 0.0)
        return jnp.stack([self.learning_rate_at(count), jnp.asarray(eps, jnp.float32).reshape(())])

    # -- state ----------------------------------------------------------------------
    def _momentum_shape(self, shape: tuple) -> tuple:
        return shape  # element-wise; row-wise optimizers keep shape[:1]

    def _momentum_like(self, leaf) -> jax.Array:
        return jnp.full(self._momentum_shape(tuple(leaf.shape)), self.initial_accumulator_value, jnp.float32)

    def init(self, params):
        """The state for `params` (a pytree of arrays: tbe_jax buffers or tt_jax cores)."""
        count = jnp.zeros((), jnp.int32)
        if self.state_type is SGDState:
            return SGDState(count)
        momentum = jax.tree_util.tree_map(self._momentum_like, params)
        return self.state_type(momentum, count)

    def check_state(self, state, params) -> None:
        """Raise a clear `TypeError`/`ValueError` unless `state` is what `init(params)` gives."""
        name = type(self).__name__
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"opt_state is a {type(state).__name__}; {name} needs a {self.state_type.__name__}: "
                "build it with emb.init_opt_state(params, opt)")
        count = jax.ShapeDtypeStruct((), jnp.int32)
        if self.state_type is SGDState:
            want = SGDState(count)
        else:
            want = self.state_type(jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(self._momentum_shape(tuple(x.shape)), jnp.float32), params), count)

        def sig(tree):
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            return treedef, [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]

        try:
            got_sig = sig(state)
        except AttributeError:
            raise TypeError(f"opt_state for {name} must hold arrays") from None
        want_sig = sig(want)
        if got_sig[0] != want_sig[0]:
            raise ValueError(f"opt_state for {name} does not match the params' structure: "
                             f"got {got_sig[0]}, expected {want_sig[0]}")
        for (gs, gd), (ws, wd) in zip(got_sig[1], want_sig[1]):
            if gs != ws or gd != wd:
                raise ValueError(
                    f"opt_state for {name} holds a {gd.name}{list(gs)} where the params need "
                    f"{wd.name}{list(ws)}: build it with emb.init_opt_state(params, opt)")

    def next_state(self, state, momentum):
        """The state after one step, with the new `momentum` (None for SGD)."""
        count = state.count + jnp.ones((), jnp.int32)
        if self.state_type is SGDState:
            return SGDState(count)
        return self.state_type(momentum, count)


# Kept for code written against the earlier API: every optimizer is a FusedOptimizer.
FusedOptimizer = Optimizer


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """Exact SGD on the touched rows: `row -= learning_rate * g` (state: the step count).

    Args:
      learning_rate: a float, a scalar array or a schedule `count -> lr`.
      stochastic_rounding: fp16/bf16 tables: round the stored row stochastically.
      skip_nonfinite: leave a row unchanged when its gradient is not finite.
    """

    learning_rate: ScalarOrSchedule = 0.01
    stochastic_rounding: bool = False
    skip_nonfinite: bool = True

    _DYNAMIC = ("learning_rate",)
    _KIND = "sgd"
    state_type = SGDState

    def __post_init__(self):
        _check_scalar("SGD", "learning_rate", self.learning_rate, positive=True, allow_schedule=True)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad(Optimizer):
    """Exact row-wise Adagrad: one fp32 accumulator per row.

    `m += mean(g**2 over the row)`, `row -= learning_rate * g / (sqrt(m) + eps)`.

    Args:
      learning_rate: a float, a scalar array or a schedule `count -> lr`.
      eps: added to `sqrt(m)`; a float or scalar array.
      initial_accumulator_value: the accumulators' start value (used by `init`).
      stochastic_rounding: fp16/bf16 tables: round the stored row stochastically.
      skip_nonfinite: leave a row (and its accumulator) unchanged when its gradient is not finite.
    """

    learning_rate: ScalarOrSchedule = 0.01
    eps: Any = 1e-8
    initial_accumulator_value: Any = 0.0
    stochastic_rounding: bool = False
    skip_nonfinite: bool = True

    _DYNAMIC = ("learning_rate", "eps", "initial_accumulator_value")
    _KIND = "rowwise_adagrad"
    state_type = RowwiseAdagradState

    def __post_init__(self):
        _check_scalar("RowwiseAdagrad", "learning_rate", self.learning_rate, positive=True, allow_schedule=True)
        _check_scalar("RowwiseAdagrad", "eps", self.eps, positive=False)
        _check_scalar("RowwiseAdagrad", "initial_accumulator_value", self.initial_accumulator_value, positive=False)

    def _momentum_shape(self, shape: tuple) -> tuple:
        return shape[:1]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """Exact element-wise Adagrad: one fp32 accumulator per parameter value.

    `m += g**2`, `row -= learning_rate * g / (sqrt(m) + eps)`. Supported by `tt_jax`
    (its cores); `tbe_jax` tables take `RowwiseAdagrad` or `SGD`.

    Args: as `RowwiseAdagrad` (eps must be > 0: a zero gradient over a zero
    accumulator would be 0/0).
    """

    learning_rate: ScalarOrSchedule = 0.01
    eps: Any = 1e-8
    initial_accumulator_value: Any = 0.0
    stochastic_rounding: bool = False
    skip_nonfinite: bool = True

    _DYNAMIC = ("learning_rate", "eps", "initial_accumulator_value")
    _KIND = "adagrad"
    state_type = AdagradState

    def __post_init__(self):
        _check_scalar("Adagrad", "learning_rate", self.learning_rate, positive=True, allow_schedule=True)
        _check_scalar("Adagrad", "eps", self.eps, positive=True)
        _check_scalar("Adagrad", "initial_accumulator_value", self.initial_accumulator_value, positive=False)



def sgd(learning_rate: ScalarOrSchedule = 0.01, stochastic_rounding: bool = False, **kwargs) -> SGD:
    """`SGD(learning_rate, ...)` (the factory spelling of the same optimizer)."""
    return SGD(learning_rate, stochastic_rounding, **kwargs)


def rowwise_adagrad(learning_rate: ScalarOrSchedule = 0.01, eps=1e-8, initial_accumulator_value=0.0,
                    stochastic_rounding: bool = False, **kwargs) -> RowwiseAdagrad:
    """`RowwiseAdagrad(learning_rate, ...)` (the factory spelling of the same optimizer)."""
    return RowwiseAdagrad(learning_rate, eps, initial_accumulator_value, stochastic_rounding, **kwargs)


def adagrad(learning_rate: ScalarOrSchedule = 0.01, eps=1e-8, initial_accumulator_value=0.0,
            stochastic_rounding: bool = False, **kwargs) -> Adagrad:
    """`Adagrad(learning_rate, ...)` (the factory spelling of the same optimizer)."""
    return Adagrad(learning_rate, eps, initial_accumulator_value, stochastic_rounding, **kwargs)


def apply_rule(rule: KernelRule, w32, m, g, lr, eps, *, row_axes=(1,)):
    """The update of `rule` on fp32 rows: returns (new rows fp32, new accumulator or None, salts).

    `w32`, `g`: `[R, ...]`; `m`: `[R]` (row-wise), `w32`'s shape (element-wise) or None.
    Pure jnp: shared by the references and the Pallas kernels. `salts` are the
    values that seed stochastic rounding.
    """
    salts = (g, w32)
    if rule.kind == "sgd":
        return w32 - lr * g, None, salts
    if rule.kind == "adagrad":
        m = m + g * g
        return w32 - lr * g / (jnp.sqrt(m) + eps), m, salts + (m,)
    m = m + jnp.mean(g * g, axis=row_axes)
    denom = (jnp.sqrt(m) + eps).reshape(m.shape + (1,) * (g.ndim - 1))
    return w32 - lr * g / denom, m, salts + (jnp.broadcast_to(m.reshape(denom.shape), g.shape),)


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
