"""Sparse optimizers: one family for `tbe_jax` tables and `tt_jax` cores.

An optimizer here updates only what a batch touched: the table rows it looked up
(`TableBatchedEmbedding.apply_gradients`) or the TT core slices (`TTEmbeddingBag.
apply_gradients`). For every touched row (or slice), `g` is its gradient summed
over the whole batch (per-sample weights and 1/len for mean pooling included);
then, once per row per step, in fp32:

    SGD:               row -= lr * g
    Adagrad:           m += g**2;                 row -= lr * g / (sqrt(m) + eps)   (element-wise m)
    row-wise Adagrad:  m += mean(g**2 over the row); row -= lr * g / (sqrt(m) + eps) (one m per row)
        weight_decay_mode="l2":        g' = g + wd * row replaces g in both lines
        weight_decay_mode="decoupled": row = (1 - lr * wd) * row - lr * g / (sqrt(m) + eps)
    Adam:              m1 = b1 * m1 + (1 - b1) * g;   m2 = b2 * m2 + (1 - b2) * g**2
                       r = (m1 / (1 - b1**t)) / (sqrt(m2 / (1 - b2**t)) + eps) + wd * row
                       row -= lr * r
    partial row-wise Adam: as Adam with one m2 per row, m2 = b2 * m2 + (1 - b2) * mean(g**2 over the row)
    LAMB:              r as Adam's; row -= lr * (||row|| / ||r||) * r   (norms over the row)
    partial row-wise LAMB: LAMB with partial row-wise Adam's m2

(FBGEMM's EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD with its WeightDecayMode
NONE/L2/DECOUPLED, ADAM, PARTIAL_ROWWISE_ADAM, LAMB and PARTIAL_ROWWISE_LAMB.) `t` is
the step number, 1 on the first step (`state.count + 1`). Rows the batch does not
touch, and their state, are left bitwise unchanged: the Adam family is *lazy*, as
FBGEMM's is: an untouched row's moments do not decay and the row does not move,
while the bias correction uses the global step count. LAMB's trust ratio is taken
as 1 where either norm is zero (FBGEMM divides: a zero row would never move, a zero
update would give NaN).

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
`AdagradState(momentum, count)`, `RowwiseAdagradState(momentum, count)`,
`AdamState(momentum1, momentum2, count)` (Adam, LAMB and their partial row-wise
forms), where each state field has the params' tree structure (element-wise: each
leaf's shape; row-wise: `[leaf.shape[0]]`), fp32; the Adam family's element-wise
moments may be kept in float16 or bfloat16 instead (`state_dtype`, FBGEMM's
`optimizer_state_dtypes`: half the state memory and traffic, rounded to nearest).

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
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.rounding import stochastic_round  # noqa: F401  (re-exported: part of this module's API)

__all__ = [
    "Adagrad", "AdagradState", "Adam", "AdamState", "Lamb", "Optimizer", "PartialRowwiseAdam",
    "PartialRowwiseLamb", "RowwiseAdagrad", "RowwiseAdagradState", "SGD", "SGDState", "stochastic_round",
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


class AdamState(NamedTuple):
    """State of `Adam`, `Lamb`, `PartialRowwiseAdam` and `PartialRowwiseLamb`: the first moments (each
    leaf's shape), the second moments (each leaf's shape; `[leaf.shape[0]]` for the partial row-wise
    forms) and the step count (Adam's `t` is `count + 1`)."""

    momentum1: Any  # the params' tree: each leaf's shape, float32 (or the optimizer's state_dtype)
    momentum2: Any  # the params' tree: each leaf's shape, or [leaf.shape[0]] float32 (partial row-wise)
    count: jax.Array  # shape=(), int32


# Per kernel kind, its state slots: True for one value per row, False for one per element.
SLOT_ROWWISE = {
    "sgd": (), "adagrad": (False,), "rowwise_adagrad": (True,), "adam": (False, False), "lamb": (False, False),
    "partial_rowwise_adam": (False, True), "partial_rowwise_lamb": (False, True),
}

# The step's hyperparameter vector (`Optimizer.hyperparameters`, a kernel operand): positions.
H_LR, H_EPS, H_B1, H_B2, H_WD, H_BC1, H_BC2 = range(7)
NUM_HYPER = 8


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """The static part of an optimizer, what a kernel is compiled for (hashable)."""

    kind: str  # a key of SLOT_ROWWISE
    stochastic_rounding: bool
    skip_nonfinite: bool
    weight_decay_mode: str = "none"  # row-wise Adagrad: "none" | "l2" | "decoupled"

    @property
    def slot_rowwise(self) -> tuple[bool, ...]:
        """Per state slot (in the state's field order), whether it holds one value per row."""
        return SLOT_ROWWISE[self.kind]

    @property
    def num_slots(self) -> int:
        return len(self.slot_rowwise)

    @property
    def has_momentum(self) -> bool:
        return self.num_slots > 0


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _device_leaves(values) -> tuple | None:
    """`values` (Python or NumPy numbers) as device arrays, or None when one is not such a number or when a trace
    is active (an array made there would be a tracer, which must not outlive it)."""
    if not all(isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_)) for v in values):
        return None
    out = tuple(jnp.asarray(v) for v in values)
    return None if any(_is_tracer(x) for x in out) else out


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
    if not math.isfinite(v):
        raise ValueError(f"{owner}.{name} must be finite, got {v}")
    ok = v > 0 if positive else v >= 0
    if not ok:
        raise ValueError(f"{owner}.{name} must be {'> 0' if positive else '>= 0'}, got {v}")


class Optimizer:
    """Base of the sparse optimizers (`SGD`, `Adagrad`, `RowwiseAdagrad`, `Adam`, `PartialRowwiseAdam`,
    `Lamb`, `PartialRowwiseLamb`).

    Subclasses are frozen dataclasses registered as pytrees: the fields listed in
    `_DYNAMIC` (numbers or scalar arrays) are leaves; schedules (callables) and the
    other fields are static.
    """

    _DYNAMIC: tuple[str, ...] = ()
    _KIND: str = ""
    _SLOTS: tuple[str, ...] = ()  # the state's fields before `count`
    state_type: type = SGDState

    # -- pytree -------------------------------------------------------------------
    # Flattening runs on every call of a jitted function taking the optimizer (a Python callback of the pytree
    # registry): the split into leaves and static fields is computed once per instance (the object is immutable)
    # and kept beside the fields, so a call pays two attribute reads (~20 us less host time per call measured on
    # the H200's host, `benchmarks/results/archive/dispatch-20261202-*`).
    # Number leaves go out as device arrays made once per instance (`jit` copies a Python number to the device on
    # every call: 198 against 59 us of host time per `apply_gradients` call,
    # `results/archive/dispatch-20261203-s26.json`).
    def tree_flatten(self):
        aux = self.__dict__.get("_tree_aux")
        if aux is None:
            dyn = tuple(n for n in self._DYNAMIC if not callable(getattr(self, n)))
            static = tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in dyn)
            aux = (dyn, static)
            object.__setattr__(self, "_tree_aux", aux)
        leaves = self.__dict__.get("_device_leaves")
        if leaves is None or any(x.is_deleted() for x in leaves):
            leaves = _device_leaves([getattr(self, n) for n in aux[0]])
            if leaves is None:  # not all numbers (arrays, tracers), or inside a trace: the values as they are
                return tuple([getattr(self, n) for n in aux[0]]), aux
            object.__setattr__(self, "_device_leaves", leaves)
        return leaves, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        dyn, static = aux
        obj = object.__new__(cls)  # no __post_init__: leaves may be tracers or placeholders
        for n, v in zip(dyn, children):
            object.__setattr__(obj, n, v)
        for n, v in static:
            object.__setattr__(obj, n, v)
        object.__setattr__(obj, "_tree_aux", aux)
        return obj

    # -- what kernels and references read -----------------------------------------
    def rule(self) -> KernelRule:
        return KernelRule(self._KIND, bool(getattr(self, "stochastic_rounding", False)),
                          bool(getattr(self, "skip_nonfinite", True)),
                          getattr(self, "weight_decay_mode", "none"))

    def learning_rate_at(self, count) -> jax.Array:
        """The learning rate of the step whose count (before the step) is `count`, fp32 scalar."""
        lr = self.learning_rate
        if callable(lr):
            lr = lr(count)
        return jnp.asarray(lr, jnp.float32).reshape(())

    def hyperparameters(self, count) -> jax.Array:
        """This step's hyperparameters as an fp32 `[NUM_HYPER]` array (a kernel operand, not a constant):
        `[learning_rate, eps, b1, b2, weight_decay, 1 - b1**t, 1 - b2**t, 0]` with `t = count + 1`
        (zeros where the optimizer has no such value)."""
        def value(name):
            return jnp.asarray(getattr(self, name, 0.0), jnp.float32).reshape(())

        t = (jnp.asarray(count, jnp.int32) + 1).astype(jnp.float32)
        b1, b2 = value("b1"), value("b2")
        zero = jnp.zeros((), jnp.float32)
        return jnp.stack([self.learning_rate_at(count), value("eps"), b1, b2, value("weight_decay"),
                          1.0 - jnp.power(b1, t), 1.0 - jnp.power(b2, t), zero])

    # -- state ----------------------------------------------------------------------
    def _slot_shape(self, i: int, shape: tuple) -> tuple:
        return shape[:1] if self.rule().slot_rowwise[i] else shape

    def _slot_dtype(self, i: int):
        return jnp.dtype(jnp.float32)

    def _slot_initial(self, i: int):
        return getattr(self, "initial_accumulator_value", 0.0)

    def slots(self, state) -> tuple:
        """The state's slots (its fields before `count`, e.g. `(momentum1, momentum2)`), a tuple of trees."""
        return tuple(getattr(state, n) for n in self._SLOTS)

    def init(self, params):
        """The state for `params` (a pytree of arrays: tbe_jax buffers or tt_jax cores)."""
        count = jnp.zeros((), jnp.int32)
        slots = [jax.tree_util.tree_map(
            lambda leaf, i=i: jnp.full(self._slot_shape(i, tuple(leaf.shape)), self._slot_initial(i),
                                       self._slot_dtype(i)), params) for i in range(len(self._SLOTS))]
        return self.state_type(*slots, count)

    def check_state(self, state, params) -> None:
        """Raise a clear `TypeError`/`ValueError` unless `state` is what `init(params)` gives."""
        name = type(self).__name__
        if not isinstance(state, self.state_type):
            raise TypeError(
                f"opt_state is a {type(state).__name__}; {name} needs a {self.state_type.__name__}: "
                "build it with emb.init_opt_state(params, opt)")
        count = jax.ShapeDtypeStruct((), jnp.int32)
        want = self.state_type(*[jax.tree_util.tree_map(
            lambda x, i=i: jax.ShapeDtypeStruct(self._slot_shape(i, tuple(x.shape)), self._slot_dtype(i)), params)
            for i in range(len(self._SLOTS))], count)

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

    def next_state(self, state, slots=()):
        """The state after one step, with the new `slots` (a tuple of trees, as `slots(state)` gives)."""
        count = state.count + jnp.ones((), jnp.int32)
        return self.state_type(*tuple(slots or ()), count)


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
      weight_decay: a float or scalar array (FBGEMM's `weight_decay`), used as `weight_decay_mode` says.
      weight_decay_mode: `"none"` (weight_decay unused), `"l2"` (`g + weight_decay * row` replaces `g`
        in the accumulator and the update) or `"decoupled"` (`row = (1 - learning_rate * weight_decay) *
        row - learning_rate * g / (sqrt(m) + eps)`): FBGEMM's `WeightDecayMode` NONE, L2, DECOUPLED.
    """

    learning_rate: ScalarOrSchedule = 0.01
    eps: Any = 1e-8
    initial_accumulator_value: Any = 0.0
    stochastic_rounding: bool = False
    skip_nonfinite: bool = True
    weight_decay: Any = 0.0
    weight_decay_mode: str = "none"

    _DYNAMIC = ("learning_rate", "eps", "initial_accumulator_value", "weight_decay")
    _KIND = "rowwise_adagrad"
    _SLOTS = ("momentum",)
    state_type = RowwiseAdagradState

    def __post_init__(self):
        _check_scalar("RowwiseAdagrad", "learning_rate", self.learning_rate, positive=True, allow_schedule=True)
        _check_scalar("RowwiseAdagrad", "eps", self.eps, positive=False)
        _check_scalar("RowwiseAdagrad", "initial_accumulator_value", self.initial_accumulator_value, positive=False)
        _check_scalar("RowwiseAdagrad", "weight_decay", self.weight_decay, positive=False)
        if self.weight_decay_mode not in ("none", "l2", "decoupled"):
            raise ValueError(f"RowwiseAdagrad.weight_decay_mode must be 'none', 'l2' or 'decoupled', "
                             f"got {self.weight_decay_mode!r}")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """Exact element-wise Adagrad (FBGEMM's EXACT_ADAGRAD): one fp32 accumulator per parameter value.

    `m += g**2`, `row -= learning_rate * g / (sqrt(m) + eps)`.

    Args: as `RowwiseAdagrad` without weight decay (eps must be > 0: a zero gradient
    over a zero accumulator would be 0/0).
    """

    learning_rate: ScalarOrSchedule = 0.01
    eps: Any = 1e-8
    initial_accumulator_value: Any = 0.0
    stochastic_rounding: bool = False
    skip_nonfinite: bool = True

    _DYNAMIC = ("learning_rate", "eps", "initial_accumulator_value")
    _KIND = "adagrad"
    _SLOTS = ("momentum",)
    state_type = AdagradState

    def __post_init__(self):
        _check_scalar("Adagrad", "learning_rate", self.learning_rate, positive=True, allow_schedule=True)
        _check_scalar("Adagrad", "eps", self.eps, positive=True)
        _check_scalar("Adagrad", "initial_accumulator_value", self.initial_accumulator_value, positive=False)


_STATE_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class _AdamFamily(Optimizer):
    """What `Adam`, `PartialRowwiseAdam`, `Lamb` and `PartialRowwiseLamb` share (see `tbe_jax.optim`): their
    fields (the same arguments, in this order) and their checks."""

    learning_rate: ScalarOrSchedule = 0.001
    b1: Any = 0.9
    b2: Any = 0.999
    eps: Any = 1e-8
    weight_decay: Any = 0.0
    state_dtype: Any = "float32"
    stochastic_rounding: bool = False
    skip_nonfinite: bool = True

    _DYNAMIC = ("learning_rate", "b1", "b2", "eps", "weight_decay")
    _SLOTS = ("momentum1", "momentum2")
    state_type = AdamState

    def __post_init__(self):
        name = type(self).__name__
        _check_scalar(name, "learning_rate", self.learning_rate, positive=True, allow_schedule=True)
        _check_scalar(name, "eps", self.eps, positive=True)
        _check_scalar(name, "weight_decay", self.weight_decay, positive=False)
        for b in ("b1", "b2"):
            _check_scalar(name, b, getattr(self, b), positive=False)
            v = getattr(self, b)
            if not callable(v) and not _is_tracer(v) and hasattr(v, "__float__") and not float(v) < 1.0:
                raise ValueError(f"{name}.{b} must be in [0, 1), got {float(v)}")
        try:
            dt = jnp.dtype(self.state_dtype)
        except TypeError:
            dt = None
        if dt is None or dt.name not in _STATE_DTYPES:
            raise ValueError(f"{name}.state_dtype must be float32, float16 or bfloat16, got {self.state_dtype!r}")

    def _slot_dtype(self, i: int):
        if self.rule().slot_rowwise[i]:
            return jnp.dtype(jnp.float32)  # one value per row: kept in fp32
        return jnp.dtype(self.state_dtype)

    def _slot_initial(self, i: int):
        return 0.0


_ADAM_ARGS = """
    Args:
      learning_rate: a float, a scalar array or a schedule `count -> lr`.
      b1, b2: the moments' decay rates, in [0, 1).
      eps: added to the square root of the bias-corrected second moment (> 0).
      weight_decay: `weight_decay * row` added to the update direction (FBGEMM's Adam/LAMB).
      state_dtype: storage of the element-wise moments: float32 (default), float16 or
        bfloat16 (FBGEMM's `optimizer_state_dtypes`; rounded to nearest; bfloat16 keeps
        fp32's range, float16 may flush a tiny second moment to zero). Row-wise moments stay fp32.
      stochastic_rounding: fp16/bf16 tables: round the stored row stochastically.
      skip_nonfinite: leave a row (and its moments) unchanged when its gradient is not finite.
"""


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Adam(_AdamFamily):
    __doc__ = """Adam on the touched rows (FBGEMM's ADAM; lazy: untouched rows and their moments stay put).

    `m1 = b1 m1 + (1 - b1) g`, `m2 = b2 m2 + (1 - b2) g**2` (element-wise), `row -= learning_rate *
    ((m1 / (1 - b1**t)) / (sqrt(m2 / (1 - b2**t)) + eps) + weight_decay * row)`, `t = count + 1`.
""" + _ADAM_ARGS

    _KIND = "adam"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PartialRowwiseAdam(_AdamFamily):
    __doc__ = """Adam with one second moment per row (FBGEMM's PARTIAL_ROWWISE_ADAM).

    As `Adam`, but `m2` is `[rows]`: `m2 = b2 m2 + (1 - b2) mean(g**2 over the row)`.
""" + _ADAM_ARGS

    _KIND = "partial_rowwise_adam"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Lamb(_AdamFamily):
    __doc__ = """LAMB (FBGEMM's LAMB): Adam's update direction scaled per row by a trust ratio.

    `r = (m1 / (1 - b1**t)) / (sqrt(m2 / (1 - b2**t)) + eps) + weight_decay * row` (moments as
    `Adam`), `row -= learning_rate * (||row|| / ||r||) * r` with the norms over the row; the ratio is
    1 where either norm is 0.
""" + _ADAM_ARGS

    _KIND = "lamb"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PartialRowwiseLamb(_AdamFamily):
    __doc__ = """LAMB with one second moment per row (FBGEMM's PARTIAL_ROWWISE_LAMB).

    As `Lamb`, with `PartialRowwiseAdam`'s `[rows]` second moment.
""" + _ADAM_ARGS

    _KIND = "partial_rowwise_lamb"


def apply_rule(rule: KernelRule, w32, slots, g, hyper, *, dim=None, row_axes=(1,), row_reduce=None):
    """The update of `rule` on fp32 rows: returns (new rows fp32, new slots (fp32 tuple), salts).

    `w32`, `g`: `[R, ...]` (a row's values along `row_axes`); `slots`: the state's slots
    for these rows as fp32 (`[R]` row-wise, `w32`'s shape element-wise), a tuple (empty
    for SGD); `hyper`: the step's `Optimizer.hyperparameters` (an array or a sequence of
    scalars). `dim`: the row length that means divide by (default: the size of the row
    axes; or one per row, `[R]`); a kernel whose tile is wider than the row passes the true
    length, with zeros in the padding of `w32`, `g` and the slots (the sums then ignore it).
    Pure jnp: shared by the references and the Pallas kernels. `salts` are the values that
    seed stochastic rounding. `row_reduce`: None, or a function of per-row sums (`[R]` each) to
    their totals over whole rows (a tuple; column-sharded tables add the other shards' parts).
    """
    lr, eps = hyper[H_LR], hyper[H_EPS]
    if dim is None:
        dim = 1
        for a in row_axes:
            dim *= g.shape[a]

    def rowsum(*xs):  # one [R] total per x (a tuple for several)
        sums = tuple(jnp.sum(x, axis=row_axes) for x in xs)
        sums = sums if row_reduce is None else tuple(row_reduce(*sums))
        return sums if len(xs) > 1 else sums[0]

    def per_row(r):  # [R] -> broadcastable against [R, ...]
        return r.reshape(r.shape + (1,) * (g.ndim - 1))

    salts = (g, w32)
    kind = rule.kind
    if kind == "sgd":
        return w32 - lr * g, (), salts
    if kind == "adagrad":
        m = slots[0] + g * g
        return w32 - lr * g / (jnp.sqrt(m) + eps), (m,), salts + (m,)
    if kind == "rowwise_adagrad":
        mode = rule.weight_decay_mode
        wd = hyper[H_WD]
        gg = g + wd * w32 if mode == "l2" else g
        m = slots[0] + rowsum(gg * gg) / dim
        if mode == "none":
            w = w32 - lr * g / per_row(jnp.sqrt(m) + eps)
        else:  # FBGEMM's form: correction * row - multiplier * g
            mult = lr / (jnp.sqrt(m) + eps)
            corr = per_row(1.0 - mult * wd) if mode == "l2" else 1.0 - lr * wd
            w = corr * w32 - per_row(mult) * g
        return w, (m,), salts + (jnp.broadcast_to(per_row(m), g.shape),)
    if kind in ("adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb"):
        b1, b2, wd, bc1, bc2 = hyper[H_B1], hyper[H_B2], hyper[H_WD], hyper[H_BC1], hyper[H_BC2]
        m1 = b1 * slots[0] + (1.0 - b1) * g
        if kind.startswith("partial"):
            m2 = b2 * slots[1] + (1.0 - b2) * (rowsum(g * g) / dim)
            v_hat = per_row(m2 / bc2)
            m2_salt = jnp.broadcast_to(per_row(m2), g.shape)
        else:
            m2 = b2 * slots[1] + (1.0 - b2) * (g * g)
            v_hat = m2 / bc2
            m2_salt = m2
        r = (m1 / bc1) / (jnp.sqrt(v_hat) + eps) + wd * w32
        if kind.endswith("adam"):
            w = w32 - lr * r
        else:
            w_sq, r_sq = rowsum(w32 * w32, r * r)
            w_norm, r_norm = jnp.sqrt(w_sq), jnp.sqrt(r_sq)
            ok = (w_norm > 0) & (r_norm > 0)
            ratio = jnp.where(ok, w_norm / jnp.where(ok, r_norm, 1.0), 1.0)
            w = w32 - per_row(lr * ratio) * r
        return w, (m1, m2), salts + (m1, m2_salt)
    raise ValueError(f"unknown optimizer kind {kind!r}")
