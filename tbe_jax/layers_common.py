"""What the framework layers (tbe_jax and tt_jax; Linen, NNX, Haiku) share.

- Input and option checks (`check_ids`, `check_optimizer`, `check_options`), core
  construction (`build_core`, `cached_core`, `as_tuple`; `shard_core`: the core spread
  over a mesh by its own `shard`, `tbe_jax.shard` / `tt_jax.shard`), the optimizer
  state's creation (`opt_init`: placed on the mesh for a sharded core) and leaf naming
  (`leaf_names`). A core is used only through `tbe_jax.core.SparseCore`'s methods.
- The sparse-mode training step, framework-independent. A layer built with an
  `optimizer` keeps its tables and optimizer state out of the differentiated
  parameters and looks up through `sparse_lookup`. Outside a training step that
  is the plain forward (differentiating the tables raises: they are not
  parameters). Inside one, a thread-local *recorder* is active: the layer reports
  an entry (the core, optimizer, tables, state and the lookup's inputs) and
  returns `out + tap`, where `tap` is a zeros array the recorder supplies for this
  entry. `sparse_value_and_grad` (and `SparseStep`, its parts) runs the user's
  loss twice: under `jax.eval_shape` to discover the entries' output shapes, then
  under `value_and_grad` with respect to the dense parameters and the taps; a
  tap's gradient is exactly its lookup's output gradient, which goes to the
  core's sparse update (`step_update`, i.e. `apply_gradients`). Entries are
  matched by call order, which is the same in both traces of one function.

Rules the recorder enforces: each sparse layer is called at most once per step
(two calls would update a row twice, with two partial gradients: `ValueError`),
and directly in the loss's trace, not inside an inner transformation (`jit`,
`vmap`, `scan`, `remat`) of it (its values would be that transformation's
tracers: `ValueError`). A sparse layer whose output does not reach the loss gets a
zero output gradient, hence a zero update (its rows do not move; only the
optimizer's step count advances).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.core import is_sharded
from tbe_jax.optim import Optimizer
from tbe_jax.train import StepReport

try:
    from jax.extend.core import get_opaque_trace_state as _trace_state
except ImportError:  # pragma: no cover - older jax
    from jax.core import get_opaque_trace_state as _trace_state


# -- checks and construction -------------------------------------------------------------------


def check_ids(indices, offsets) -> None:
    """Integer ids only (the layers' contract): a TypeError naming the dtype otherwise (as the functional API's)."""
    for name, x in (("indices", indices), ("offsets", offsets)):
        dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"{name} must hold integers (int32, or int64 with jax x64), got dtype {dtype}")


def check_optimizer(optimizer, core, makers: str) -> None:
    """A layer's `optimizer`: None or an optimizer of `tbe_jax.optim` that `core` supports (else TypeError;
    a core's own refusals are ValueErrors)."""
    if optimizer is None:
        _check_true_gradient(core)
        return
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a sparse optimizer of tbe_jax.optim ({makers}), "
                        f"got {type(optimizer).__name__}")
    core.check_optimizer(optimizer)  # e.g. TTEmbeddingBag: the optimizers its cores support


def as_tuple(x):
    """A layer field that is a sequence (tables, feature_table_map: a list, an array) as a tuple of its items as
    given, for the core's memo cache; anything else (None, one spec, a string) as is. The core checks the
    items: an entry 1.7 or True is refused there, not truncated to an int here."""
    if x is None or isinstance(x, (str, bytes)) or not hasattr(x, "__iter__") or hasattr(x, "items"):
        return x
    return tuple(x)


def build_core(core_cls, first, options: dict):
    """`core_cls(first, **options)` with the None-valued options left out (the core picks its defaults)."""
    return core_cls(first, **{k: v for k, v in options.items() if v is not None})


def _check_true_gradient(core) -> None:
    """True-gradient mode on a sharded TBE core: replicated ("data") tables are refused. The forward reads a
    replicated table from one copy, so `jax.grad` gives the whole batch's gradient to that copy and none to
    the others, and a dense optimizer would let the copies drift apart (the sparse path updates every copy).
    A sharded TT core (`tt_jax.shard`: every table replicated) is accepted: its forward sums the devices'
    cotangents of the replicated cores over the mesh axis, so `jax.grad` gives every copy the global batch's
    gradient (see `tt_jax.sharding`)."""
    from tbe_jax.sharding import ShardedTableBatchedEmbedding

    if isinstance(core, ShardedTableBatchedEmbedding) and "data" in core.strategies:
        rep = [t for t, st in enumerate(core.strategies) if st == "data"]
        raise ValueError(
            f"tables {rep} are replicated (strategy \"data\"): a sharded layer in true-gradient mode "
            "(optimizer=None) cannot keep their copies equal under jax.grad. Shard them by tables, rows or "
            "columns (sharding_plan), or give the layer a sparse optimizer")


def check_options(core, options: dict) -> None:
    """A sharded core takes no lookup options (`batch_size_per_feature`, `max_batch_size`): ValueError."""
    if options and is_sharded(core):
        raise ValueError(f"a sharded layer (built with a mesh) takes no lookup options, got {sorted(options)}: "
                         "give every device a local batch of b samples per feature")


def _tag(x):
    """A hashable, type-exact form of a layer's option (a sharding plan, a capacity, a core's arguments) for
    the memo caches: 1, 1.0, True and np.int64(1) stay apart (a cache hit must not pass a float or a bool off
    as an int the core would have refused), a list becomes a tuple; `_untag` gives the value back (a list as
    a tuple). Raises TypeError where a leaf is unhashable."""
    if x is not None and hasattr(x, "items") and not isinstance(x, type):
        return "dict", tuple(sorted(((_tag(k), _tag(v)) for k, v in x.items()), key=repr))
    if isinstance(x, (list, tuple)):
        return "seq", tuple(_tag(v) for v in x)
    hash(x)
    return type(x), x


def _untag(t):
    kind, x = t
    if kind == "dict":
        return {_untag(k): _untag(v) for k, v in x}
    if kind == "seq":
        return tuple(_untag(v) for v in x)
    return x


def _tags(*args):
    """`_tag` of each argument, or None where one of them cannot be hashed (the caller then builds unmemoised,
    and the core's own checks name what is wrong)."""
    try:
        return tuple(_tag(a) for a in args)
    except TypeError:
        return None


@functools.lru_cache(maxsize=64)
def _cached_shard(core, mesh, axis_name, plan_tag, capacity_tag):
    return _shard(core, mesh, axis_name, _untag(plan_tag), _untag(capacity_tag))


def _shard(core, mesh, axis_name, plan, capacity):
    return core.shard(mesh, axis_name, plan, capacity=capacity)  # `tbe_jax.core.ShardableCore`


def shard_core(core, mesh, axis_name: str = "data", plan=None, capacity=None):
    """A layer's core: `core` itself when `mesh` is None, else `tbe_jax.shard(core, mesh, axis_name, plan,
    capacity=capacity)` (`tt_jax.shard` for a TT core), memoised (Linen rebuilds its core on every access;
    equal arguments give the same object). A plan or capacity without a mesh is a ValueError."""
    if mesh is None:
        if plan is not None or capacity is not None:
            raise ValueError("sharding_plan and capacity shard the tables over a mesh: give the layer a mesh too")
        return core
    from tbe_jax.tbe import TableBatchedEmbedding

    if isinstance(plan, (list, tuple)) and not isinstance(core, TableBatchedEmbedding):
        plan = dict(enumerate(plan))  # tt_jax.shard's one strategy per table, as a (hashable) dict
    if capacity is not None and not isinstance(capacity, (str, bytes)) and np.ndim(capacity) > 0:
        capacity = tuple(capacity)  # per-feature counts (see tbe_jax.shard): a list or an array, as a tuple
    tags = _tags(plan, capacity)
    if tags is None or not _hashable(core, mesh, axis_name):
        return _shard(core, mesh, axis_name, plan, capacity)
    return _cached_shard(core, mesh, axis_name, *tags)


def opt_init(core, opt, params):
    """A sparse layer's optimizer state for `params`: `opt.init(params)`, or for a sharded core its
    `init_opt_state` (the state sharded like the params, on the mesh)."""
    if is_sharded(core):
        return core.init_opt_state(params, opt)
    return opt.init(params)


@functools.lru_cache(maxsize=256)
def _cached_core(core_cls, first_tag, options_tag):
    return build_core(core_cls, _untag(first_tag), _untag(options_tag))


def _hashable(*args) -> bool:
    try:
        hash(args)
    except TypeError:
        return False
    return True


def cached_core(core_cls, first, options: dict):
    """`build_core`, memoised on hashable arguments (Linen rebuilds its layer's core on every access; equal
    arguments of the same types give the same object); other arguments are built unmemoised (the core's own
    checks then name what is wrong with them)."""
    tags = _tags(first, options)
    if tags is None:
        return build_core(core_cls, first, options)
    return _cached_core(core_cls, *tags)


def leaf_names(tree, prefix: str = "") -> tuple[list[str], list, Any]:
    """(names, leaves, treedef): one name per leaf, `prefix` + its path joined by "_" ("d8", "momentum_d8")."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [prefix + jax.tree_util.keystr(p, simple=True, separator="_") for p, _ in leaves]
    return names, [v for _, v in leaves], treedef


def param_spec(core):
    """The core's params pytree as `jax.ShapeDtypeStruct`s (its `init`'s, traced only)."""
    return jax.eval_shape(lambda: core.init(jax.random.key(0)))


# -- sparse mode: the recorder ---------------------------------------------------------------------

_LOCAL = threading.local()

_GRAD_OF_TABLES = (
    "the tables (or optimizer state) of a sparse-mode embedding layer (built with optimizer=...) were "
    "differentiated: they are not parameters, and their gradient is not their update. Train such layers "
    "with the step helper of their framework: tbe_jax.linen.train_step, tbe_jax.nnx.train_step or "
    "tbe_jax.haiku.train_step (see the layer module's docstring); differentiate only the dense parameters.")


_NOT_IN_STEP = (
    "sparse-mode embedding layer {name!r} (built with optimizer=...) was called under jax.grad / value_and_grad "
    "(nnx.grad, ...) outside its framework's training step: its tables are not parameters, so that gradient "
    "would leave them untrained, silently. Train with {helper}(loss_fn, ...), which differentiates the dense "
    "parameters and applies the layer's fused update; or build the layer with optimizer=None to train its "
    "tables with jax.grad and optax.")

_HELPERS = {"linen": "tbe_jax.linen.train_step", "nnx": "tbe_jax.nnx.train_step", "haiku": "tbe_jax.haiku.train_step"}


def _differentiating() -> bool:
    """Whether the current trace is an autodiff one (jax.grad, value_and_grad, jvp, linearize): read from JAX's
    trace context (no public API says it). False where JAX's internals differ (the check is then skipped)."""
    try:
        from jax._src import core as jcore
        from jax._src.interpreters import ad
    except ImportError:  # pragma: no cover
        return False
    trace = getattr(getattr(jcore, "trace_ctx", None), "trace", None)
    kinds = tuple(k for k in (getattr(ad, "JVPTrace", None), getattr(ad, "LinearizeTrace", None)) if k is not None)
    return bool(kinds) and isinstance(trace, kinds)


@jax.custom_vjp
def _frozen(tree):
    return tree


def _frozen_fwd(tree):
    raise TypeError(_GRAD_OF_TABLES)


_frozen.defvjp(_frozen_fwd, lambda res, g: None)


class _Entry(NamedTuple):
    key: Any  # identifies the layer in a step (a second call raises); the helper writes back to it
    core: Any
    opt: Any
    tables: Any
    opt_state: Any
    residuals: Any  # the core's step_forward residuals
    out: jax.ShapeDtypeStruct


class _Recorder:
    def __init__(self, taps=None, keys=None, resolve=None):
        self.taps = taps  # None: the discovery pass (no taps yet)
        self.keys = keys  # the discovery pass's keys, in call order
        self.resolve = resolve  # the layer's key -> a key stable across the two traces (NNX: its path)
        self.entries: list[_Entry] = []
        self.trace = _trace_state()

    def lookup(self, key, core, opt, tables, opt_state, indices, offsets, per_sample_weights, options):
        if self.resolve is not None:
            key = self.resolve(key)
        name = layer_name(key)
        if _trace_state() != self.trace:
            raise ValueError(
                f"sparse-mode layer {name!r} was called inside a transformation (jit, vmap, scan, remat, ...) "
                "nested in the loss of a training step: call it directly in the loss function (jit the whole "
                "step instead)")
        if any(e.key == key for e in self.entries):
            raise ValueError(
                f"sparse-mode layer {name!r} was called twice in one training step: each of its rows must be "
                "updated once per step, with the gradient summed over the step. Make one call (concatenate the "
                "bags, or look a table up from several features with feature_table_map), or use separate layers")
        i = len(self.entries)
        if self.keys is not None and (i >= len(self.keys) or self.keys[i] != key):
            raise RuntimeError("the loss function called its sparse-mode layers differently on its two traces "
                               "(it must be a pure function of its arguments)")
        out, residuals = core.step_forward(tables, indices, offsets, per_sample_weights, **(options or {}))
        self.entries.append(_Entry(key, core, opt, tables, opt_state, residuals,
                                   jax.ShapeDtypeStruct(out.shape, out.dtype)))
        if self.taps is None:
            return out
        return out + self.taps[i]


@contextlib.contextmanager
def _recording(recorder: _Recorder):
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(recorder)
    try:
        yield recorder
    finally:
        stack.pop()


def _current() -> _Recorder | None:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def sparse_lookup(key, core, opt, tables, opt_state, indices, offsets, per_sample_weights=None,
                  options: dict | None = None):
    """A sparse-mode layer's lookup: the forward, reported to the active training step if any.

    `key` = `(framework, name)` identifies the layer within one step (Linen: its
    module path; Haiku: its module name; NNX: its `id`, which the step resolves to
    its path in the model); the framework's step helper writes the layer's new
    tables and state back to it.
    """
    recorder = _current()
    if recorder is None:
        if _differentiating():
            name = f"(an {key[0]} layer)" if isinstance(key[1], int) else layer_name(key)
            raise TypeError(_NOT_IN_STEP.format(name=name, helper=_HELPERS.get(key[0], "the layer's train_step")))
        return core(_frozen(tables), indices, offsets, per_sample_weights, **(options or {}))
    return recorder.lookup(key, core, opt, tables, opt_state, indices, offsets, per_sample_weights,
                           options)


class SparseUpdate(NamedTuple):
    """One sparse layer's step: where to write (`key`), its new tables and state, and its report."""

    key: Any
    params: Any
    opt_state: Any
    report: StepReport


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class SparseStep:
    """The parts of one sparse training step, for helpers that differentiate in their own way (NNX).

    `taps = step.discover(fn, *args)`; `g = step.wrap(fn)`, differentiated as
    `value_and_grad(g, argnums=(<dense>, len(args)), has_aux=True)(*args, taps)`,
    gives `((loss, packed), (grads, tap_grads))`; `step.finish(loss, packed,
    tap_grads)` returns `(value, [SparseUpdate, ...])`.
    """

    def __init__(self, has_aux: bool = False, resolve: Callable | None = None, optimizer=None):
        self.has_aux = has_aux
        self.resolve = resolve
        self.optimizer = optimizer  # the step's override of the layers' optimizers (see `step_optimizer`)
        self.keys: list | None = None
        self._static: list | None = None

    def discover(self, fn: Callable, *args) -> list[jax.Array]:
        entries = []

        def run(*args):
            # The recorder is built inside the trace: it records the trace's state.
            with _recording(_Recorder(resolve=self.resolve)) as rec:
                value = fn(*args)
            entries.extend(rec.entries)
            return value

        jax.eval_shape(run, *args)
        self.keys = [e.key for e in entries]
        return [jnp.zeros(e.out.shape, e.out.dtype) for e in entries]

    def wrap(self, fn: Callable) -> Callable:
        def wrapped(*args):
            *args, taps = args
            with _recording(_Recorder(taps, self.keys, self.resolve)) as rec:
                value = fn(*args)
            if len(rec.entries) != len(taps):
                raise RuntimeError("the loss function called its sparse-mode layers differently on its two "
                                   "traces (it must be a pure function of its arguments)")
            loss, aux = value if self.has_aux else (value, None)
            # The entries' arrays leave the differentiated function as auxiliary outputs, so they are
            # values of the step's level even where they depend on the dense parameters (per-sample
            # weights computed by the model).
            static, packed = [], []
            for e in rec.entries:
                leaves, treedef = jax.tree_util.tree_flatten((e.tables, e.opt_state, e.opt, e.residuals))
                static.append((e.key, e.core, treedef, [None if _is_array(x) else x for x in leaves]))
                packed.append([x for x in leaves if _is_array(x)])
            self._static = static
            return loss, (aux, packed)

        return wrapped

    def finish(self, loss, packed, tap_grads) -> tuple[Any, list[SparseUpdate]]:
        aux, arrays = packed
        updates = []
        for (key, core, treedef, leaves), dyn, g in zip(self._static, arrays, tap_grads):
            it = iter(dyn)
            leaves = [next(it) if x is None else x for x in leaves]
            tables, opt_state, opt, residuals = jax.tree_util.tree_unflatten(treedef, leaves)
            opt = step_optimizer(self.optimizer, key, opt)
            params, opt_state, invalid = core.step_update(tables, opt_state, opt, residuals, g)
            report = StepReport(jnp.asarray(invalid, jnp.int32), jnp.sum(~jnp.isfinite(g), dtype=jnp.int32))
            updates.append(SparseUpdate(key, params, opt_state, report))
        return ((loss, aux) if self.has_aux else loss), updates


def layer_name(key) -> str:
    """A sparse layer's name in a step: its path joined by "/" (Linen, NNX) or its module name (Haiku)."""
    return "/".join(map(str, key[1])) if isinstance(key[1], tuple) else str(key[1])


def step_optimizer(override, key, default):
    """The optimizer a step applies to the layer `key`: `override` (an `Optimizer` for every layer, or a dict
    from layer names to optimizers) where it names one, else the layer's own `default`. Passed as a value
    (a jitted step's argument), its hyperparameters are traced: a new learning rate does not recompile."""
    if override is None:
        return default
    if isinstance(override, Optimizer):
        opt = override
    elif isinstance(override, dict):
        opt = override.get(layer_name(key), default)
    else:
        raise TypeError(f"optimizer must be a tbe_jax.optim optimizer or a dict of them by layer name, got "
                        f"{type(override).__name__}")
    if opt is not default and (not isinstance(opt, Optimizer) or opt.rule().kind != default.rule().kind):
        raise TypeError(f"the step's optimizer for layer {layer_name(key)!r} must be a {type(default).__name__} "
                        f"like the layer's (its state has that layout), got {type(opt).__name__}")
    return opt


def sparse_value_and_grad(fn: Callable, dense, *, has_aux: bool = False, optimizer=None):
    """`fn(dense) -> loss` (or `(loss, aux)`) with sparse-mode layers inside: one step.

    Returns `(value, grads, updates)`: `value` as `jax.value_and_grad` gives it,
    `grads` the gradient with respect to `dense`, and one `SparseUpdate` per sparse
    layer called (in call order), whose new tables and state the caller writes back.
    """
    step = SparseStep(has_aux, optimizer=optimizer)
    taps = step.discover(fn, dense)
    (loss, packed), (grads, tap_grads) = jax.value_and_grad(step.wrap(fn), argnums=(0, 1), has_aux=True)(
        dense, taps)
    value, updates = step.finish(loss, packed, tap_grads)
    return value, grads, updates
