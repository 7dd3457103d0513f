"""`TTEmbeddingBag`: TT-compressed embedding tables with tbe_jax's input format."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds
from tbe_jax.inputs import check_weights, narrow_ids
from tbe_jax.specs import FeaturePlan
from tt_jax import backward, optim, reference
from tt_jax import params as params_lib
from tt_jax.kernels import backward as kernel_backward
from tt_jax.kernels.forward import TTKernelConfig, flow_plans, pooled_forward
from tt_jax.specs import TTSpec, int_tuple

_INITS = ("approx-normal", "approx-uniform")
_BOUNDS = ("ignore", "none", "warning", "fatal")
_INT32_MAX = 2**31 - 1


class TTEmbeddingBag:
    """Pooled lookups into tensor-train tables (features read tables by `feature_table_map`; feature-major offsets).

    Args:
      specs: one `TTSpec` or a list of tables.
      feature_table_map: per feature, the table it reads (default: feature f
        reads table f). Features sharing a table share its distinct rows.
      pooling: "sum" or "mean" (an empty bag gives zeros).
      impl: "pallas" (the fused FlowTT kernel, `tt_jax.kernels.forward`),
        "xla" (the pure-jnp per-index chain) or "auto" (pallas on a GPU, xla
        otherwise). Both are differentiable with prefix reuse on the forward's
        FlowPlans (on the xla path the plans are built in the forward pass of
        `jax.grad`): "pallas" uses the deterministic Pallas backward
        (`tt_jax.kernels.backward`, unless `config.backward == "xla"`), "xla"
        the XLA one (`tt_jax.backward`).
      interpret: run the Pallas kernels in interpret mode (CPU).
      config: `TTKernelConfig` of the Pallas path (None: its default).
      bounds_check: what to do with bad inputs, as `tbe_jax` (see below):
        "ignore" (default), "none", "warning" or "fatal".

    Bad inputs. An id is bad when it lies outside `[0, N_t)` (N_t: the rows of
    the table its feature reads; ids in `[N_t, prod(p_shapes))`, whose digits
    would name valid core slices, are bad too). -1 marks a pruned row: it is
    skipped silently in every mode (never counted, never an error). `offsets`
    are malformed unless they start at 0, never decrease and end at most at
    `len(indices)`. int64 ids (jax x64) are narrowed to int32 in every mode
    without wrapping: an id outside the int32 range becomes a bad id (-2),
    never another row. Per `bounds_check`:

    - "ignore": bad ids contribute nothing to the output and get no gradient
      and no optimizer update, on both impls. Silent, jittable, no host
      synchronisation. Offsets are not repaired; the pooling kernel reads no
      id outside `indices` whatever they hold, and non-decreasing offsets
      whose ends leave `[0, len(indices)]` give the same clamped bags on both
      impls, lookup and update; offsets that decrease give undefined bags.
    - "none": nothing is checked. Negative ids (-1 included) contribute
      nothing; ids >= N_t are undefined behaviour (today the TT planner drops
      them, as "ignore": the sort needs the check anyway, so "none" saves
      nothing here); malformed offsets give undefined bags (the pooling
      kernel still reads no id outside `indices`).
    - "warning": bad ids are skipped as in "ignore", and offsets are repaired
      (`tbe_jax.bounds.repair_offsets`: first entry 0, clamped to
      `[0, len(indices)]`, running maximum); the counts of bad ids (other
      than -1) and of repaired offsets entries are reported by `warnings.warn`
      (RuntimeWarning) from a `jax.debug.callback` behind a `lax.cond` (works
      under `jit`; a clean batch issues no callback). Lookups warn (`emb(...)`,
      a training step's forward); `apply_gradients` repairs and skips silently.
    - "fatal": a `ValueError` naming the feature, the bag and the bad value.
      With concrete inputs it is raised at once; under `jit` it is a
      `jax.experimental.checkify.check`: wrap the jitted function with
      `checkify.checkify` and call `err.throw()` (a plain `jit` refuses to
      trace it).

    The Pallas path (FlowTT): the lookups of each group of tables sharing
    (q_shapes, ranks) are sorted and deduplicated, grouped by prefix (the first
    T-1 digits), and one kernel computes each prefix's core product once and
    every distinct row from it; a second kernel pools the rows into bags. See
    `tt_jax.kernels.forward` and `tt_jax.prefix.build_flow`.

    Training: `jax.grad` through `emb(params, ...)` gives exact core (and
    per-sample-weight) gradients; `apply_gradients` applies `tt_jax.SGD`,
    `Adagrad`, `RowwiseAdagrad`, `Adam`, `PartialRowwiseAdam`, `Lamb` or
    `PartialRowwiseLamb` to the touched core slices only (lazily: untouched
    slices and their state stay put); `tbe_jax.train_step` runs the lookup, the
    loss gradient and that step in one call. See `tt_jax.optim`.

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> emb = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(1000, 16, ranks=(8, 8)))
      >>> params = emb.init(jax.random.key(0))
      >>> emb(params, jnp.array([3, 999, 5], jnp.int32), jnp.array([0, 2, 3], jnp.int32)).shape
      (2, 16)
    """

    def __init__(self, specs, *, feature_table_map: Sequence[int] | None = None, pooling: str = "sum",
                 impl: str = "auto", interpret: bool = False, config: TTKernelConfig | None = None,
                 bounds_check: str = "ignore"):
        specs = (specs,) if isinstance(specs, TTSpec) else tuple(specs)
        if not specs or not all(isinstance(s, TTSpec) for s in specs):
            raise TypeError("specs must be a TTSpec or a non-empty list of TTSpec")
        ftm = (tuple(range(len(specs))) if feature_table_map is None
               else int_tuple("feature_table_map", feature_table_map))
        if not ftm or any(not 0 <= t < len(specs) for t in ftm):
            raise ValueError(f"feature_table_map={feature_table_map} must name tables in [0, {len(specs)})")
        if config is not None and not isinstance(config, TTKernelConfig):
            raise TypeError(f"config must be a TTKernelConfig or None, got {type(config).__name__}")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if impl not in ("auto", "xla", "pallas"):
            raise ValueError(f"impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
        if bounds_check not in _BOUNDS:
            raise ValueError(f"bounds_check must be one of {_BOUNDS}, got {bounds_check!r}")
        if not isinstance(interpret, (bool, np.bool_)):
            raise TypeError(f"interpret must be a bool, got {interpret!r}")
        self.specs = specs
        self.feature_table_map = ftm
        self.pooling = pooling
        self.impl = impl
        self.interpret = bool(interpret)
        self.config = config if config is not None else TTKernelConfig.get_default()
        self.bounds_check = bounds_check

    def _key(self):
        return (self.specs, self.feature_table_map, self.pooling, self.impl, self.interpret, self.config,
                self.bounds_check)

    @property
    def resolved_impl(self) -> str:
        """The path `__call__` takes: "auto" is "pallas" on a GPU (or in interpret mode), else "xla"."""
        if self.impl != "auto":
            return self.impl
        return "pallas" if self.interpret or jax.default_backend() == "gpu" else "xla"

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, TTEmbeddingBag) and self._key() == other._key()

    # -- parameters -------------------------------------------------------------
    def init(self, key: jax.Array, init: str = "approx-normal", std: float | None = None) -> dict:
        """Random cores whose materialised table has entries of standard deviation `std`.

        Default `std`: that of FBGEMM's uniform(-1/sqrt(N), 1/sqrt(N)) table init.
        An entry is a sum of prod(ranks) products of T core entries, so each core
        gets standard deviation (std**2 / prod(ranks)) ** (1 / (2T)); "approx-normal"
        draws the cores from a normal, "approx-uniform" from a uniform law.
        """
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        if std is not None and not _finite_non_negative(std):
            raise ValueError(f"std must be None or a finite number >= 0, got {std!r}")
        tables = []
        for i, spec in enumerate(self.specs):
            target = std if std is not None else 1.0 / math.sqrt(3 * spec.num_embeddings)
            sigma = (target**2 / math.prod(spec.ranks)) ** (1.0 / (2 * spec.num_cores))
            cores = []
            for t, shape in enumerate(spec.core_shapes()):
                k = jax.random.fold_in(jax.random.fold_in(key, i), t)
                if init == "approx-normal":
                    cores.append(sigma * jax.random.normal(k, shape, jnp.float32))
                else:
                    a = sigma * math.sqrt(3.0)
                    cores.append(jax.random.uniform(k, shape, jnp.float32, -a, a))
            tables.append(cores)
        return self.set_cores(None, tables)

    def get_cores(self, params: dict) -> list[list[jax.Array]]:
        """Per table, its cores in the logical layout `[p_t, r_{t-1}, q_t, r_t]` (float32): slices of the params'
        stacked buffers (`tt_jax.params`)."""
        self.check_params(params)
        return params_lib.unstack(self.specs, params["cores"])

    def set_cores(self, params: dict | None, cores: Sequence[Sequence[jax.Array]]) -> dict:
        """Params from per-table cores (`cores[table][core]`, `[p_t, r_{t-1}, q_t, r_t]`, converted to float32):
        `{"cores": per table group, per core}`, each group's cores stacked along p (`tt_jax.params`). `params` is
        not read (None is fine). Also converts per-table params of earlier releases:
        `emb.set_cores(None, old_params["cores"])`."""
        return params_lib.tables_to_params(self.specs, cores)

    def full_table(self, params: dict) -> list[jax.Array]:
        """Per table, the materialised `[N, D]` table."""
        return [reference.full_table(c, s) for c, s in zip(self.get_cores(params), self.specs)]

    def check_params(self, params) -> None:
        """Raise unless `params` are `{"cores": per table group, per core}` of this embedding's specs (the stacked
        layout of `tt_jax.params`; static: shapes and dtypes only, so free under `jit`): cores of another spec
        would otherwise be read with this spec's digits. Per-table cores of earlier releases (where the layouts
        differ) get an error that says to convert them with `set_cores`."""
        params_lib.check(self.specs, params)

    # -- forward -----------------------------------------------------------------
    def _prepare(self, indices, offsets, per_sample_weights, *, warn: bool = True):
        """Checked int32 inputs: (indices, offsets, per_sample_weights, batch, total_dim).

        Applies `bounds_check` (see the class docstring); `warn`: issue the "warning" mode's report.
        """
        indices = _as_array(indices)
        offsets = _as_array(offsets)
        for name, x in (("indices", indices), ("offsets", offsets)):
            if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must be a 1-D integer array, got {x.dtype}{list(x.shape)}")
        nf = len(self.feature_table_map)
        if (offsets.shape[0] - 1) % nf or offsets.shape[0] < 1:
            raise ValueError(f"offsets has {offsets.shape[0]} entries; expected F*B+1 with F={nf} features")
        if per_sample_weights is not None:
            try:
                per_sample_weights = _as_array(per_sample_weights)
            except (TypeError, ValueError) as e:
                raise TypeError(f"per_sample_weights must be a float array: {e}") from None
            check_weights(per_sample_weights, indices)
            per_sample_weights = jnp.asarray(per_sample_weights, jnp.float32)
        batch = (offsets.shape[0] - 1) // nf
        total_dim = sum(self.specs[t].embedding_dim for t in self.feature_table_map)
        indices, offsets = self._check_bounds(indices, offsets, batch, warn)
        return indices, offsets, per_sample_weights, batch, total_dim

    def feature_plan(self, batch: int) -> FeaturePlan:
        """The `tbe_jax.specs.FeaturePlan` facts `tbe_jax.bounds` reads (tables, rows, bags), for this batch."""
        ftm = self.feature_table_map
        nf = len(ftm)
        dims = [self.specs[t].embedding_dim for t in ftm]
        return FeaturePlan(
            table=ftm, dim=tuple(dims), group=(0,) * nf, row_offset=(0,) * nf,
            # ids are int32 and the planner's sort sentinel is 2**31 - 1: rows from there on are unreachable
            num_rows=tuple(min(self.specs[t].num_embeddings, _INT32_MAX) for t in ftm),
            batch=(batch,) * nf, bag_base=tuple(f * batch for f in range(nf)),
            out_base=tuple(int(c) for c in np.concatenate([[0], np.cumsum(dims)[:-1]])),
            out_stride=(sum(dims),) * nf, vbe=False, out_size=batch * sum(dims),
        )

    def _check_bounds(self, indices, offsets, batch: int, warn: bool):
        """`bounds_check` on the raw inputs: int32 (indices, offsets) with bad ids never wrapped into valid ones.

        Every mode narrows: an id outside the int32 range becomes -2 (bad, skipped by the planner and the
        reference as every id outside `[0, N_t)`: no further masking is needed). "warning" repairs the offsets.
        """
        mode = self.bounds_check
        plan = self.feature_plan(batch) if mode in ("warning", "fatal") else None
        if mode == "fatal":
            if not isinstance(indices, jax.core.Tracer) and not isinstance(offsets, jax.core.Tracer):
                bounds.check_concrete(plan, np.asarray(indices), np.asarray(offsets),
                                      [f"table {t}" for t in range(len(self.specs))])
            else:  # signed ids are checked as given (the message names the value); unsigned ones narrowed
                signed = jnp.issubdtype(indices.dtype, jnp.signedinteger)
                offsets = bounds.check_traced(plan, jnp.asarray(indices if signed else narrow_ids(indices)),
                                              jnp.asarray(offsets))
        indices = jnp.asarray(narrow_ids(indices))
        offsets = jnp.asarray(narrow_offsets(offsets))
        if mode == "warning":
            offsets, rep = bounds.report(plan, indices, offsets)
            if warn:
                bounds.warn_if_repaired(rep, package="tt_jax")
        return indices, offsets

    def __call__(self, params, indices, offsets, per_sample_weights=None):
        """`[B, sum D]` pooled lookups; input format as `tbe_jax.TableBatchedEmbedding`.

        Differentiable with respect to `params` and `per_sample_weights` (exact gradients from the
        prefix-sharing backward `tt_jax.backward`, which reuses this forward's sort).
        """
        self.check_params(params)
        indices, offsets, per_sample_weights, batch, total_dim = self._prepare(indices, offsets, per_sample_weights)
        if indices.shape[0] == 0 or batch == 0:
            return jnp.zeros((batch, total_dim), jnp.float32)
        self._check_backend()
        if _is_concrete(params, indices, offsets, per_sample_weights):  # eager: one program, not op by op
            return _jit_pooled(params["cores"], indices, offsets, per_sample_weights, emb=self, batch=batch)
        return _pooled(self, batch, params["cores"], indices, offsets, per_sample_weights)

    @property
    def pallas_backward(self) -> bool:
        """Whether the backward (gradients and optimizer steps) runs the Pallas kernels."""
        return self.resolved_impl == "pallas" and self.config.backward == "pallas"

    def uses_kernel(self) -> bool:
        """Whether lookups run the Pallas kernels (False: the XLA path); see `resolved_impl`."""
        return self.resolved_impl == "pallas"

    def check_optimizer(self, opt) -> None:
        """Raises TypeError unless `opt` is an optimizer of `tbe_jax.optim` whose rule the TT cores support."""
        optim.check_opt(opt)

    def _check_backend(self):
        if self.resolved_impl == "pallas" and not self.interpret and jax.default_backend() != "gpu":
            raise NotImplementedError(
                "impl='pallas' compiles Triton kernels and needs a GPU; on "
                f"{jax.default_backend()} pass interpret=True or use impl='xla' (or 'auto')"
            )

    def flow_plans(self, batch, indices, offsets):
        """Per table group (`TTForwardConfig.stack_tables`), the `FlowPlan` of this batch (validated int32 inputs
        of `batch` samples per feature): the sort the forward and the backward share."""
        return flow_plans(self.specs, self.feature_table_map, indices, offsets, batch=batch, config=self.config)

    # -- training ----------------------------------------------------------------
    def init_opt_state(self, params: dict, opt):
        """State of `opt` (`tt_jax.SGD`, `Adagrad`, `RowwiseAdagrad`, `Adam`, `PartialRowwiseAdam`, `Lamb` or
        `PartialRowwiseLamb`, the optimizers of `tbe_jax.optim`): `SGDState(count)`,
        `AdagradState(momentum, count)` / `RowwiseAdagradState(momentum, count)` or
        `AdamState(momentum1, momentum2, count)`, each field but the count shaped like `params`
        (`{"cores": per table group, per core}`, stacked as the cores: `[P, r, q, r']` element-wise, `[P]` per
        slice; fp32, or the Adam family's `state_dtype` for its element-wise moments). Read them per table with
        `get_state`."""
        self.check_params(params)
        return optim.init_state(opt, params)

    def get_state(self, opt_state, name: str) -> list[list[jax.Array]]:
        """Per table, per core, the optimizer state's field `name` (`"momentum"`; `"momentum1"` or
        `"momentum2"` for the Adam family): `[p_t, r, q, r']` element-wise, `[p_t]` per slice."""
        fields = [f for f in getattr(opt_state, "_fields", ()) if f != "count"]
        if name not in fields:
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: its state fields are {fields}, "
                             f"not {name!r}")
        return params_lib.unstack(self.specs, getattr(opt_state, name)["cores"])

    def stack_opt_state(self, opt_state):
        """`opt_state` with every state field converted from per-table slots (`{"cores": per table, per core}`,
        the layout of earlier releases) to the stacked layout of the params (`tt_jax.params`); the count is kept.
        The optimizer-state counterpart of `set_cores(None, old_params["cores"])`."""
        fields = [f for f in getattr(opt_state, "_fields", ()) if f != "count"]
        if "count" not in getattr(opt_state, "_fields", ()):
            raise TypeError(f"opt_state must be an optimizer state (a NamedTuple with a count), got "
                            f"{type(opt_state).__name__}")
        new = {}
        for f in fields:
            per_table = getattr(opt_state, f)["cores"]
            if len(per_table) != len(self.specs):
                raise ValueError(f"opt_state.{f}['cores'] must hold per-table state for {len(self.specs)} tables, "
                                 f"got {len(per_table)}")
            new[f] = dict(getattr(opt_state, f), cores=params_lib.stack(self.specs, per_table))
        return opt_state._replace(**new)

    def get_momentum(self, opt_state) -> list[list[jax.Array]]:
        """Per table, per core, its Adagrad accumulators (`get_state(opt_state, "momentum")`); for an
        `AdamState` use `get_state(opt_state, "momentum1")` / `"momentum2"`."""
        if not isinstance(opt_state, (optim.AdagradState, optim.RowwiseAdagradState)):
            raise ValueError(
                f"opt_state is a {type(opt_state).__name__}: it holds no accumulators"
                + (" (use emb.get_state(opt_state, 'momentum1') or 'momentum2')"
                   if isinstance(opt_state, optim.AdamState) else ""))
        return self.get_state(opt_state, "momentum")

    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None):
        """One optimizer step on the core slices this batch touches: returns `(params, opt_state)`.

        `grad_output` is the gradient of the loss with respect to `emb(params, indices, offsets, ...)`.
        Every touched slice `G_t[i]` gets its exact batch gradient and one `opt` update (see
        `tt_jax.optim`); the other slices and their state are returned bitwise unchanged. `opt`'s
        hyperparameters are read at run time (a new learning rate or a schedule's next value does not
        recompile) and `opt_state.count` goes up by one. The update is a scatter to the touched slices
        (XLA backward) or a dense pass over each core that keeps the untouched slices (Pallas backward;
        see `tt_jax.optim`): donate `params` and `opt_state` under `jax.jit` for an in-place update.
        `per_sample_weights` are constants here. `tbe_jax.train_step` wraps the lookup, the loss
        gradient and this step in one call (and reuses the forward's plan).
        """
        self.check_optimizer(opt)
        self.check_params(params)
        optim.check_state(opt, opt_state, params)
        indices, offsets, per_sample_weights, batch, total_dim = self._prepare(indices, offsets, per_sample_weights,
                                                                               warn=False)
        self._check_grad_output(grad_output, batch, total_dim)
        if indices.shape[0] == 0 or batch == 0:
            return params, opt.next_state(opt_state, opt.slots(opt_state))
        self._check_backend()
        if _is_concrete(params, opt_state, opt, indices, offsets, per_sample_weights, grad_output):
            return _jit_apply(opt, params, opt_state, indices, offsets, per_sample_weights, jnp.asarray(grad_output),
                              emb=self, batch=batch)
        plans = self.flow_plans(batch, indices, offsets)
        return _apply(self, batch, opt, params, opt_state, plans, offsets, per_sample_weights, grad_output)

    @staticmethod
    def _check_grad_output(grad_output, batch, total_dim):
        grad_output = jnp.asarray(grad_output)
        if tuple(grad_output.shape) != (batch, total_dim):
            raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}; this batch's output is "
                             f"{(batch, total_dim)}")
        if not jnp.issubdtype(grad_output.dtype, jnp.floating):
            raise TypeError(f"grad_output must be floating point, got {grad_output.dtype}")

    # -- the training step's halves (tbe_jax.train_step; `tbe_jax.core.SparseCore`) -----------------
    def shard(self, mesh, axis_name: str = "data", plan=None, *, capacity=None, sync_replicas=None):
        """These tables run data parallel over `mesh`'s axis `axis_name`: `tt_jax.shard(self, mesh, axis_name,
        plan, sync_replicas=...)`. `capacity` (`tbe_jax.shard`'s budget of routed ids) must stay None."""
        from tt_jax.sharding import shard  # tt_jax.sharding builds on this module

        if capacity is not None:
            raise ValueError("capacity applies to tbe_jax.shard's routed ids; a TT core is data parallel "
                             "(leave capacity None)")
        return shard(self, mesh, axis_name, plan, sync_replicas=sync_replicas)

    def step_forward(self, params, indices, offsets, per_sample_weights=None):
        """The lookup, and what `step_update` needs of it (the forward's plans: one sort per step)."""
        self.check_params(params)
        indices, offsets, per_sample_weights, batch, total_dim = self._prepare(indices, offsets, per_sample_weights)
        if indices.shape[0] == 0 or batch == 0:
            return jnp.zeros((batch, total_dim), jnp.float32), (batch, total_dim, None, offsets, per_sample_weights)
        self._check_backend()
        out, plans = _forward(self, batch, params["cores"], indices, offsets, per_sample_weights, with_plans=True)
        return out, (batch, total_dim, plans, offsets, per_sample_weights)

    def step_update(self, params, opt_state, opt, residuals, grad_output):
        """`apply_gradients` on `step_forward`'s batch, from its plans: `(params, opt_state, 0)` (the TT
        planner skips bad ids without counting them here)."""
        batch, total_dim, plans, offsets, per_sample_weights = residuals
        self.check_optimizer(opt)
        self.check_params(params)
        optim.check_state(opt, opt_state, params)
        self._check_grad_output(grad_output, batch, total_dim)
        if plans is None:
            return params, opt.next_state(opt_state, opt.slots(opt_state)), jnp.int32(0)
        params, opt_state = _apply(self, batch, opt, params, opt_state, plans, offsets, per_sample_weights,
                                   grad_output)
        return params, opt_state, jnp.int32(0)


# -- input validation -----------------------------------------------------------------


def _finite_non_negative(x) -> bool:
    """Whether `x` is a real number (a Python or NumPy scalar, or a concrete 0-d array; no bool, no string),
    finite and >= 0."""
    if isinstance(x, (bool, np.bool_, str, bytes)) or np.ndim(x) != 0:
        return False
    try:
        v = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(v) and v >= 0


def _as_array(x):
    """NumPy and JAX arrays as given (64-bit host ids are narrowed on the host, exactly); others via jnp."""
    return x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)


def narrow_offsets(x):
    """int32 offsets, clamped into the int32 range (a malformed entry stays malformed)."""
    dt = np.dtype(x.dtype)
    if dt == np.int32 or dt.itemsize < 4:
        return x.astype(np.int32)
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.clip(x, -1 if np.issubdtype(dt, np.signedinteger) else 0, _INT32_MAX).astype(np.int32)


def _forward(emb, batch, cores, indices, offsets, per_sample_weights, *, with_plans):
    """(output, plans or None) from the params' stacked `cores`. Pallas: the fused kernels on the plans (kept
    for the backward); XLA: the per-index chain (on the tables' slices), plus the plans when the backward will
    need them."""
    if emb.resolved_impl == "xla":
        ftm = emb.feature_table_map
        tables = params_lib.unstack(emb.specs, cores)
        out = reference.pooled([tables[t] for t in ftm], [emb.specs[t] for t in ftm], indices, offsets,
                               per_sample_weights, pooling=emb.pooling, batch=batch)
        return out, (emb.flow_plans(batch, indices, offsets) if with_plans else None)
    return pooled_forward(cores, emb.specs, emb.feature_table_map, indices, offsets, per_sample_weights,
                          batch=batch, pooling=emb.pooling, config=emb.config, interpret=emb.interpret,
                          return_plans=True, keep_c=with_plans)


# -- differentiation ------------------------------------------------------------------
# Both paths save the forward's FlowPlans (the one sort of the step) and differentiate with prefix reuse:
# `tt_jax.kernels.backward` (Pallas, deterministic) when `emb.pallas_backward`, else `tt_jax.backward` (XLA).
# The jnp reference's autodiff VJP is the tests' oracle.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pooled(emb, batch, cores, indices, offsets, per_sample_weights):
    return _forward(emb, batch, cores, indices, offsets, per_sample_weights, with_plans=False)[0]


def _pooled_fwd(emb, batch, cores, indices, offsets, per_sample_weights):
    out, plans = _forward(emb, batch, cores, indices, offsets, per_sample_weights, with_plans=True)
    return out, (cores, plans, offsets, per_sample_weights)


def _pooled_bwd(emb, batch, res, g):
    cores, plans, offsets, per_sample_weights = res
    if emb.pallas_backward:
        d_cores, d_psw = kernel_backward.dense_core_grads(
            cores, emb.specs, emb.feature_table_map, plans, offsets, per_sample_weights, g, batch=batch,
            pooling=emb.pooling, want_psw=True, config=emb.config, interpret=emb.interpret)
        d_cores = tuple(tuple(d if d is not None else jnp.zeros(c.shape, jnp.float32) for d, c in zip(ds, cs))
                        for ds, cs in zip(d_cores, cores))
        return d_cores, None, None, d_psw
    d_cores, d_psw = backward.pooled_vjp(cores, emb.specs, emb.feature_table_map, plans, offsets,
                                         per_sample_weights, g, batch=batch, pooling=emb.pooling)
    return d_cores, None, None, d_psw


_pooled.defvjp(_pooled_fwd, _pooled_bwd)


def _apply(emb, batch, opt, params, opt_state, plans, offsets, per_sample_weights, grad_output):
    """The optimizer step from the plans: (params, opt_state). One update per (table group, core) of the stacked
    params (`tt_jax.params`): every table of a group at once."""
    all_cores = params["cores"]  # per table group, per core
    rule, hyper = opt.rule(), opt.hyperparameters(opt_state.count)
    old_slots = opt.slots(opt_state)  # a tuple of trees {"cores": per table group, per core}
    slots = [s["cores"] for s in old_slots]
    if emb.pallas_backward:
        grads, _ = kernel_backward.dense_core_grads(
            all_cores, emb.specs, emb.feature_table_map, plans, offsets, per_sample_weights, grad_output,
            batch=batch, pooling=emb.pooling, want_psw=False, config=emb.config, interpret=emb.interpret)
        # A zero gradient moves an Adam slice (and a weight-decayed one): then only the touched slices step.
        touched = (backward.touched_slices(emb.specs, emb.feature_table_map, plans)
                   if optim.needs_touched_mask(rule) else None)

        def update(k, t, core, s, g):
            return optim.update_dense(rule, hyper, core, s, g, None if touched is None else touched[k][t])
    else:
        grads = backward.touched_core_grads(all_cores, emb.specs, emb.feature_table_map, plans, offsets,
                                            per_sample_weights, grad_output, batch=batch, pooling=emb.pooling)

        def update(k, t, core, s, g):
            return optim.update_slices(rule, hyper, core, s, *g)
    new_cores, new_slots = [], [[] for _ in slots]
    for k, cores in enumerate(all_cores):  # k: the table group
        cs, ss = [], [[] for _ in slots]
        for t, core in enumerate(cores):
            s = tuple(slot[k][t] for slot in slots)
            if grads[k][t] is not None:
                core, s = update(k, t, core, s, grads[k][t])
            cs.append(core)
            for j, x in enumerate(s):
                ss[j].append(x)
        new_cores.append(tuple(cs))
        for j in range(len(slots)):
            new_slots[j].append(tuple(ss[j]))
    new_params = dict(params, cores=tuple(new_cores))
    new_slots = tuple(dict(old, cores=tuple(per_group)) for old, per_group in zip(old_slots, new_slots))
    return new_params, opt.next_state(opt_state, new_slots)


def _is_concrete(*trees) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(trees))


# Eager calls (outside jit) run as one jitted program each (compiled once per shape) instead of op by op.
@functools.partial(jax.jit, static_argnames=("emb", "batch"))
def _jit_pooled(all_cores, indices, offsets, per_sample_weights, *, emb, batch):
    return _pooled(emb, batch, all_cores, indices, offsets, per_sample_weights)


@functools.partial(jax.jit, static_argnames=("emb", "batch"))
def _jit_apply(opt, params, opt_state, indices, offsets, per_sample_weights, grad_output, *, emb, batch):
    plans = emb.flow_plans(batch, indices, offsets)
    return _apply(emb, batch, opt, params, opt_state, plans, offsets, per_sample_weights, grad_output)
