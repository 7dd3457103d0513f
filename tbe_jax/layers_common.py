"""What the framework layers (tbe_jax and tt_jax; Linen, NNX, Haiku) share.

- The layers' options (`LayerOptions`): read once from the core class's constructor (and its `init` and
  `__call__`), so the six layers declare no core argument: each framework turns one `LayerOptions` into
  its own constructor (Linen: dataclass fields; NNX and Haiku: `__init__`'s signature) and docstring.
- Input and option checks (`check_ids`, `check_optimizer`, `check_options`), core construction (`build_core`,
  `cached_core`; `shard_core`: the core spread over a mesh by its own `shard`), the optimizer state's creation
  (`opt_init`: placed on the mesh for a sharded core) and leaf naming (`leaf_names`). A core is used only
  through `tbe_jax.core.SparseCore`'s methods.
- The sparse-mode training step, framework-independent. A layer built with an `optimizer` keeps its tables and
  optimizer state out of the differentiated parameters and looks up through `sparse_lookup`. Outside a training
  step that is the plain forward (differentiating the tables raises: they are not parameters). Inside one, a
  thread-local *recorder* is active: the layer reports an entry (the core, optimizer, tables, state and the
  lookup's inputs) and returns `out + tap`, where `tap` is a zeros array the recorder supplies for this entry.
  `sparse_value_and_grad` (and `SparseStep`, its parts) runs the user's loss twice: under `jax.eval_shape` to
  discover the entries' output shapes, then under `value_and_grad` with respect to the dense parameters and the
  taps; a tap's gradient is exactly its lookup's output gradient, which goes to the core's sparse update
  (`step_update`, i.e. `apply_gradients`). Entries are matched by call order (the same in both traces).

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
import inspect
import textwrap
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.core import is_sharded
from tbe_jax.optim import Optimizer
from tbe_jax.tbe import TableBatchedEmbedding
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


def build_core(core_cls, first, options: dict):
    """`core_cls(first, **options)` with the None-valued options left out (the core picks its defaults)."""
    return core_cls(first, **{k: v for k, v in options.items() if v is not None})


def _check_true_gradient(core) -> None:
    """True-gradient mode on a sharded TBE core: replicated ("data") tables are refused. Each device reads its
    own copy for its own samples, so `jax.grad` gives each copy its local batch's gradient only, and a dense
    optimizer would let the copies drift apart (the sparse path combines the devices' gradients).
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
    as an int the core would have refused), a list or a numpy array becomes a tuple (of its items as given); `_untag` gives the value back (a list as
    a tuple). Raises TypeError where a leaf is unhashable."""
    if x is not None and hasattr(x, "items") and not isinstance(x, type):
        return "dict", tuple(sorted(((_tag(k), _tag(v)) for k, v in x.items()), key=repr))
    if isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim > 0):
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
    """A sparse layer's optimizer state for `params`: the core's `init_opt_state` (a sharded core's is sharded
    like the params; tables in host memory keep their state there, a cache's has its rows)."""
    return core.init_opt_state(params, opt)


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


# -- the layers' options: their core's, read from its constructor ----------------------------------

_KW = inspect.Parameter.KEYWORD_ONLY
_DEFAULT_TO_CORE = ("bounds_check",)  # core options a layer leaves None by default: the core picks
_OPTIMIZERS = ("RowwiseAdagrad(...)", "SGD", "Adagrad", "Adam", "PartialRowwiseAdam", "Lamb", "PartialRowwiseLamb")
# The layers' own options, after their core's (`capacity` only where the core's `shard` routes ids).
_LAYER_PARAMETERS = (
    inspect.Parameter("optimizer", _KW, default=None, annotation=Optimizer | None),
    inspect.Parameter("mesh", _KW, default=None, annotation=Any),
    inspect.Parameter("axis_name", _KW, default="data", annotation=str),
    inspect.Parameter("sharding_plan", _KW, default=None, annotation=Any),
    inspect.Parameter("capacity", _KW, default=None, annotation=int | tuple[int, ...] | None),
)


def _parameters(fn) -> list[inspect.Parameter]:
    """`fn`'s parameters but its first (`self`), with their annotations evaluated where they can be."""
    try:
        sig = inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate stays a string
        sig = inspect.signature(fn)
    return list(sig.parameters.values())[1:]


def _optional(annotation):
    return f"{annotation} | None" if isinstance(annotation, str) else annotation | None


class LayerOptions:
    """The options of the layers over one functional core, read from the core class (one per core).

    Args:
      core_cls: the core (`tbe_jax.TableBatchedEmbedding`, `tt_jax.TTEmbeddingBag`).
      attr: the layers' attribute that gives their core (`"tbe"`, `"tt"`).
      package: the package whose optimizers the layers take (`"tbe_jax"`), named in their errors.
      capacity: whether the layers take `capacity` (a sharded core's routed-id budget).
      init: the layers' names for the arguments of `core_cls.init` after its key
        (`{"initializer": "init"}`); their defaults are `init`'s.
      doc: what the layer's own options do (sharding, init), written once for the three frameworks.

    `parameters`: the core's first argument, positional (`tables`, `specs`); then keyword-only every
    keyword-only argument of `core_cls.__init__`, with its annotation and default (except `bounds_check`,
    whose default is None: the core's own), `optimizer`, `mesh`, `axis_name`, `sharding_plan` (`capacity`)
    and the `init` arguments. A layer's call takes the keyword-only arguments of `core_cls.__call__`
    (`lookup_names`). Each framework turns these into its constructor (Linen: the module's dataclass
    fields; NNX, Haiku: `constructor`'s `__init__`) and its docstring (`document`).
    """

    def __init__(self, core_cls, *, attr: str, package: str, capacity: bool = False, init=None, doc: str = ""):
        self.core_cls, self.attr, self.package = core_cls, attr, package
        first, *rest = _parameters(core_cls.__init__)
        self.first = first.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
        core = [p for p in rest if p.kind is _KW]
        self.core_defaults = {p.name: p.default for p in core if p.name in _DEFAULT_TO_CORE}
        core = [p.replace(default=None, annotation=_optional(p.annotation)) if p.name in _DEFAULT_TO_CORE else p
                for p in core]
        self.core_names = tuple(p.name for p in core)
        layer = [p for p in _LAYER_PARAMETERS if capacity or p.name != "capacity"]
        init_params = {p.name: p for p in _parameters(core_cls.init)[1:]}
        self.init = dict(init or {})  # layer name -> the core's init argument
        layer += [init_params[c].replace(name=n, kind=_KW) for n, c in self.init.items()]
        self.parameters = (self.first, *core, *layer)
        self.names = tuple(p.name for p in self.parameters)
        self.lookup_names = tuple(p.name for p in _parameters(core_cls.__call__) if p.kind is _KW)
        self.makers = ", ".join(f"{package}.{o}" for o in _OPTIMIZERS[:-1]) + f" or {package}.{_OPTIMIZERS[-1]}"
        self.doc = doc

    def build(self, values: dict):
        """The layer's core from its option `values` (every name of `parameters`): the core, memoised
        (`cached_core`), sharded by `shard_core` when `values["mesh"]` is not None."""
        core = cached_core(self.core_cls, values[self.first.name], {n: values[n] for n in self.core_names})
        return shard_core(core, values["mesh"], values["axis_name"], values["sharding_plan"], values.get("capacity"))

    def core_property(self, fget: Callable) -> property:
        """The layers' attribute `attr` (`layer.tbe`, `layer.tt`): `fget(layer)`, the layer's core."""
        return property(fget, doc=f"The wrapped functional `{self.core_cls.__name__}` (immutable, hashable); with "
                        "a mesh, the sharded core over it (the same methods; `.emb` is the unsharded core).")

    def init_params(self, core, values: dict, key):
        """The layer's initial params: `core.init(key, ...)` with the layer's `init` options."""
        return core.init(key, **{c: values[n] for n, c in self.init.items()})

    def lookup_options(self, options: dict) -> dict:
        """A call's keyword options: the core's lookup options (TypeError for another name), None ones left out."""
        unknown = sorted(set(options) - set(self.lookup_names))
        if unknown:
            raise TypeError(f"the layer's call got unexpected keyword arguments {unknown}; it takes "
                            f"{list(self.lookup_names) or 'none'}")
        return {k: v for k, v in options.items() if v is not None}

    def constructor(self, body: Callable, *extra: inspect.Parameter) -> Callable:
        """An `__init__` whose signature is `parameters` then the framework's `extra` ones (`rngs`, `name`):
        it binds its arguments as Python would (a TypeError for a missing, unknown or extra positional one)
        and calls `body(self, values)` with every option's value (defaults filled in)."""
        sig = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                 *self.parameters, *extra])

        def __init__(self, *args, **kwargs):
            try:
                bound = sig.bind(self, *args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{type(self).__name__}: {e}") from None
            bound.apply_defaults()
            body(self, {k: v for k, v in bound.arguments.items() if k != "self"})

        __init__.__signature__ = sig
        return __init__

    def document(self, doc: str | None) -> str:
        """A layer's docstring: its framework's text (`doc`), then the options' (written here, once)."""
        core = f"{self.core_cls.__module__.split('.')[0]}.{self.core_cls.__name__}"
        defaults = "; ".join(f"`{n}`'s layer default is None: the core's {d!r}" for n, d in self.core_defaults.items())
        items = [
            (self.first.name, "the core's first argument (positional)."),
            (", ".join(self.core_names), "keyword-only, like every option below: the core's, with its defaults (see "
             f"its docstring); None leaves an option to the core's default ({defaults})."),
            ("optimizer", f"None (true-gradient mode: the tables are parameters, differentiated), or an optimizer of "
             f"`{self.package}.optim` ({self.makers}; sparse mode: the tables and the optimizer state are variables "
             "that are not differentiated, updated by the framework's `train_step`; the module docstring says "
             "where each lives)."),
        ]
        call = ", ".join(["indices", "offsets", "per_sample_weights=None"]
                         + (["*"] + [f"{n}=None" for n in self.lookup_names] if self.lookup_names else []))
        return "\n".join([
            inspect.cleandoc(doc or ""), "",
            f"Options (read from `{core}`'s constructor; the same for the Linen, NNX and Haiku layers):",
            *(textwrap.fill(f"{h}: {b}", 110, initial_indent="  ", subsequent_indent="    ") for h, b in items),
            textwrap.indent(textwrap.dedent(self.doc).strip("\n"), "  "), "",
            textwrap.fill(f"Call: `layer({call})`, with the core's input format and output (with a mesh, the "
                          "per-device format above). Indices and offsets must be integer arrays (else `TypeError`).",
                          110)])


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


TBE_OPTIONS = LayerOptions(TableBatchedEmbedding, attr="tbe", package="tbe_jax", capacity=True, doc="""
    mesh, axis_name, sharding_plan, capacity: shard the tables over the devices of `mesh`'s axis
      `axis_name` (default None: unsharded). The layer's core is then `tbe_jax.shard(TableBatchedEmbedding(
      ...), mesh, axis_name, sharding_plan, capacity=capacity)` (see `tbe_jax.ShardedTableBatchedEmbedding`;
      `sharding_plan` None is the planner, a dict `{table: "table" | "row" | "column" | "data" | ("table",
      device)}` fixes some tables, a `ShardingPlan` all; `capacity` an int or per-feature id counts). The
      layer's tables and optimizer state are the sharded core's, drawn by its `init` and placed on the mesh
      (each device draws its own shards: the values differ from the unsharded layer's). Inputs are then per
      device: `indices [n, N]`, `offsets [n, F*b+1]` (row k: device k's local batch of b samples),
      per-sample weights `[n, N]`; the output is the global batch's `[n*b, sum D]` (device k's samples at
      rows `k*b ...`), sharded over the axis. No lookup options (`batch_size_per_feature`,
      `max_batch_size`). Train in sparse mode with `train_step` under `jit`, on a mesh whose axis is
      `jax.sharding.AxisType.Auto` (with an explicit axis, jax asks the loss to state how its batch
      reductions are sharded). True-gradient mode works too (the gradient is sharded like the tables),
      except for replicated (`"data"`) tables, whose copies `jax.grad` cannot keep equal (`ValueError`).
    """)
