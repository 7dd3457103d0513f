"""`TTEmbeddingBag`: TT-compressed embedding tables with tbe_jax's input format."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from tt_jax import backward, optim, reference
from tt_jax.kernels import backward as kernel_backward
from tt_jax.kernels.forward import TTKernelConfig, flow_plans, pooled_forward
from tt_jax.specs import TTSpec

_INITS = ("approx-normal", "approx-uniform")


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

    Ids outside `[0, N)` contribute nothing. `offsets` are not validated (no
    bounds_check option yet): they must start at 0, never decrease and end at
    most at `len(indices)`.

    The Pallas path (FlowTT): the lookups of each group of tables sharing
    (q_shapes, ranks) are sorted and deduplicated, grouped by prefix (the first
    T-1 digits), and one kernel computes each prefix's core product once and
    every distinct row from it; a second kernel pools the rows into bags. See
    `tt_jax.kernels.forward` and `tt_jax.prefix.build_flow`.

    Training: `jax.grad` through `emb(params, ...)` gives exact core (and
    per-sample-weight) gradients; `apply_gradients` applies `tt_jax.SGD`,
    `Adagrad` or `RowwiseAdagrad` to the touched core slices only;
    `fused_lookup` runs that step inside the lookup's backward
    (`tt_jax.sgd(...)` etc., as `tbe_jax`). See `tt_jax.optim`.

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> emb = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(1000, 16, ranks=(8, 8)))
      >>> params = emb.init(jax.random.key(0))
      >>> emb(params, jnp.array([3, 999, 5], jnp.int32), jnp.array([0, 2, 3], jnp.int32)).shape
      (2, 16)
    """

    def __init__(self, specs, *, feature_table_map: Sequence[int] | None = None, pooling: str = "sum",
                 impl: str = "auto", interpret: bool = False, config: TTKernelConfig | None = None):
        specs = (specs,) if isinstance(specs, TTSpec) else tuple(specs)
        if not specs or not all(isinstance(s, TTSpec) for s in specs):
            raise TypeError("specs must be a TTSpec or a non-empty list of TTSpec")
        ftm = tuple(range(len(specs))) if feature_table_map is None else tuple(int(t) for t in feature_table_map)
        if not ftm or any(not 0 <= t < len(specs) for t in ftm):
            raise ValueError(f"feature_table_map={feature_table_map} must name tables in [0, {len(specs)})")
        if config is not None and not isinstance(config, TTKernelConfig):
            raise TypeError(f"config must be a TTKernelConfig or None, got {type(config).__name__}")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if impl not in ("auto", "xla", "pallas"):
            raise ValueError(f"impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
        self.specs = specs
        self.feature_table_map = ftm
        self.pooling = pooling
        self.impl = impl
        self.interpret = bool(interpret)
        self.config = config if config is not None else TTKernelConfig.get_default()

    def _key(self):
        return (self.specs, self.feature_table_map, self.pooling, self.impl, self.interpret, self.config)

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
        """Per table, its cores in the logical layout `[p_t, r_{t-1}, q_t, r_t]` (float32)."""
        return [list(c) for c in params["cores"]]

    def set_cores(self, params: dict | None, cores: Sequence[Sequence[jax.Array]]) -> dict:
        if len(cores) != len(self.specs):
            raise ValueError(f"expected cores for {len(self.specs)} tables, got {len(cores)}")
        out = []
        for i, (spec, cs) in enumerate(zip(self.specs, cores)):
            shapes = spec.core_shapes()
            if len(cs) != len(shapes):
                raise ValueError(f"table {i}: expected {len(shapes)} cores, got {len(cs)}")
            for t, (c, shape) in enumerate(zip(cs, shapes)):
                if tuple(c.shape) != shape:
                    raise ValueError(f"table {i} core {t} must have shape {shape}, got {tuple(c.shape)}")
            out.append(tuple(jnp.asarray(c, jnp.float32) for c in cs))
        return {"cores": tuple(out)}

    def full_table(self, params: dict) -> list[jax.Array]:
        """Per table, the materialised `[N, D]` table."""
        return [reference.full_table(c, s) for c, s in zip(params["cores"], self.specs)]

    # -- forward -----------------------------------------------------------------
    def _prepare(self, indices, offsets, per_sample_weights):
        """Checked int32 inputs: (indices, offsets, per_sample_weights, batch, total_dim)."""
        indices = jnp.asarray(indices)
        offsets = jnp.asarray(offsets)
        for name, x in (("indices", indices), ("offsets", offsets)):
            if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must be a 1-D integer array, got {x.dtype}{list(x.shape)}")
        nf = len(self.feature_table_map)
        if (offsets.shape[0] - 1) % nf or offsets.shape[0] < 1:
            raise ValueError(f"offsets has {offsets.shape[0]} entries; expected F*B+1 with F={nf} features")
        if per_sample_weights is not None:
            per_sample_weights = jnp.asarray(per_sample_weights, jnp.float32)
            if per_sample_weights.shape != indices.shape:
                raise ValueError("per_sample_weights must match indices in shape")
        batch = (offsets.shape[0] - 1) // nf
        total_dim = sum(self.specs[t].embedding_dim for t in self.feature_table_map)
        return indices.astype(jnp.int32), offsets.astype(jnp.int32), per_sample_weights, batch, total_dim

    def __call__(self, params, indices, offsets, per_sample_weights=None):
        """`[B, sum D]` pooled lookups; input format as `tbe_jax.TableBatchedEmbedding`.

        Differentiable with respect to `params` and `per_sample_weights` (exact gradients from the
        prefix-sharing backward `tt_jax.backward`, which reuses this forward's sort).
        """
        indices, offsets, per_sample_weights, batch, total_dim = self._prepare(indices, offsets, per_sample_weights)
        if indices.shape[0] == 0 or batch == 0:
            return jnp.zeros((batch, total_dim), jnp.float32)
        self._check_backend()
        return _pooled(self, batch, params["cores"], indices, offsets, per_sample_weights)

    @property
    def pallas_backward(self) -> bool:
        """Whether the backward (gradients and optimizer steps) runs the Pallas kernels."""
        return self.resolved_impl == "pallas" and self.config.backward == "pallas"

    def _check_backend(self):
        if self.resolved_impl == "pallas" and not self.interpret and jax.default_backend() != "gpu":
            raise NotImplementedError(
                "impl='pallas' compiles Triton kernels and needs a GPU; on "
                f"{jax.default_backend()} pass interpret=True or use impl='xla' (or 'auto')"
            )

    def _plans(self, batch, indices, offsets):
        """Per table group of `prefix.stack_tables`, the `FlowPlan` of this batch."""
        return flow_plans(self.specs, self.feature_table_map, indices, offsets, batch=batch, config=self.config)

    def _forward(self, batch, all_cores, indices, offsets, per_sample_weights, *, with_plans):
        """(output, plans or None). Pallas: the fused kernels on the plans (kept for the backward); XLA: the
        per-index chain, plus the plans when the backward will need them."""
        if self.resolved_impl == "xla":
            ftm = self.feature_table_map
            out = reference.pooled([all_cores[t] for t in ftm], [self.specs[t] for t in ftm], indices, offsets,
                                   per_sample_weights, pooling=self.pooling, batch=batch)
            return out, (self._plans(batch, indices, offsets) if with_plans else None)
        return pooled_forward(all_cores, self.specs, self.feature_table_map, indices, offsets, per_sample_weights,
                              batch=batch, pooling=self.pooling, config=self.config, interpret=self.interpret,
                              return_plans=True)

    # -- training ----------------------------------------------------------------
    def init_opt_state(self, params: dict, opt):
        """State of `opt` (`tt_jax.SGD`, `Adagrad` or `RowwiseAdagrad`): `SGDState()`, or per table per core
        its accumulators (`[p_t, r, q, r']` element-wise, `[p_t]` row-wise), fp32."""
        return optim.init_state(opt, params)

    def get_momentum(self, opt_state) -> list[list[jax.Array]]:
        """Per table, per core, its Adagrad accumulators."""
        if not isinstance(opt_state, (optim.AdagradState, optim.RowwiseAdagradState)):
            raise ValueError(f"opt_state is a {type(opt_state).__name__}: it holds no accumulators")
        return [list(m) for m in opt_state.momentum]

    def apply_gradients(self, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights=None):
        """One optimizer step on the core slices this batch touches: returns `(params, opt_state)`.

        `grad_output` is the gradient of the loss with respect to `emb(params, indices, offsets, ...)`.
        Every touched slice `G_t[i]` gets its exact batch gradient and one `opt` update (see
        `tt_jax.optim`); the other slices and their state are returned bitwise unchanged. The update is a
        scatter to the touched slices (XLA backward) or a dense pass over each core with zero gradients on
        the untouched slices (Pallas backward): donate `params` and `opt_state` under `jax.jit` for an
        in-place update. `per_sample_weights` are constants here.
        """
        optim.check_opt(opt)
        optim.check_state(opt, opt_state, params)
        indices, offsets, per_sample_weights, batch, total_dim = self._prepare(indices, offsets, per_sample_weights)
        grad_output = jnp.asarray(grad_output)
        if tuple(grad_output.shape) != (batch, total_dim):
            raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}; this batch's output is "
                             f"{(batch, total_dim)}")
        if indices.shape[0] == 0 or batch == 0:
            return params, opt_state
        self._check_backend()
        plans = self._plans(batch, indices, offsets)
        return _apply(self, batch, opt, params, opt_state, plans, offsets, per_sample_weights, grad_output)

    def fused_lookup(self, params, opt_state, tx, indices, offsets, per_sample_weights=None):
        """A lookup whose backward applies `tx` to the touched core slices (the fused path).

        The forward is `emb(params, indices, offsets, ...)`. Under `jax.grad` (or `jax.vjp`), the
        cotangents returned for `params` and `opt_state` are their **updated values** (as
        `apply_gradients` with this lookup's output gradient): take them as the new params and state.
        Differentiate with respect to both; use the params in one fused lookup per loss (two would add
        their "updates"). `per_sample_weights` are constants on this path (their gradient is zero).

        Args:
          tx: `tt_jax.sgd(...)`, `tt_jax.adagrad(...)` or `tt_jax.rowwise_adagrad(...)`.
          opt_state: `tx.init(params)`.
        """
        if not isinstance(tx, optim.FusedOptimizer):
            raise TypeError("tx must come from tt_jax.sgd(...), tt_jax.adagrad(...) or tt_jax.rowwise_adagrad(...)")
        optim.check_state(tx.opt, opt_state, params)
        indices, offsets, per_sample_weights, batch, total_dim = self._prepare(indices, offsets, per_sample_weights)
        if indices.shape[0] == 0 or batch == 0:
            return _fused_empty(params, opt_state, batch, total_dim)
        self._check_backend()
        return _fused_lookup(self, batch, tx.opt, params, opt_state, per_sample_weights, indices, offsets)


# -- differentiation ------------------------------------------------------------------
# Both paths save the forward's FlowPlans (the one sort of the step) and differentiate with prefix reuse:
# `tt_jax.kernels.backward` (Pallas, deterministic) when `emb.pallas_backward`, else `tt_jax.backward` (XLA).
# The jnp reference's autodiff VJP is the tests' oracle.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pooled(emb, batch, all_cores, indices, offsets, per_sample_weights):
    return emb._forward(batch, all_cores, indices, offsets, per_sample_weights, with_plans=False)[0]


def _pooled_fwd(emb, batch, all_cores, indices, offsets, per_sample_weights):
    out, plans = emb._forward(batch, all_cores, indices, offsets, per_sample_weights, with_plans=True)
    return out, (all_cores, plans, offsets, per_sample_weights)


def _pooled_bwd(emb, batch, res, g):
    all_cores, plans, offsets, per_sample_weights = res
    if emb.pallas_backward:
        d_cores, d_psw = kernel_backward.dense_core_grads(
            all_cores, emb.specs, emb.feature_table_map, plans, offsets, per_sample_weights, g, batch=batch,
            pooling=emb.pooling, want_psw=True, config=emb.config, interpret=emb.interpret)
        d_cores = tuple(tuple(d if d is not None else jnp.zeros(c.shape, jnp.float32) for d, c in zip(ds, cs))
                        for ds, cs in zip(d_cores, all_cores))
        return d_cores, None, None, d_psw
    d_cores, d_psw = backward.pooled_vjp(all_cores, emb.specs, emb.feature_table_map, plans, offsets,
                                         per_sample_weights, g, batch=batch, pooling=emb.pooling)
    return d_cores, None, None, d_psw


_pooled.defvjp(_pooled_fwd, _pooled_bwd)


def _apply(emb, batch, opt, params, opt_state, plans, offsets, per_sample_weights, grad_output):
    """The optimizer step from the plans: (params, opt_state)."""
    all_cores = params["cores"]
    momentum = None if isinstance(opt, optim.SGD) else opt_state.momentum
    if emb.pallas_backward:
        grads, _ = kernel_backward.dense_core_grads(
            all_cores, emb.specs, emb.feature_table_map, plans, offsets, per_sample_weights, grad_output,
            batch=batch, pooling=emb.pooling, want_psw=False, config=emb.config, interpret=emb.interpret)

        def update(core, m, g):
            return optim.update_dense(opt, core, m, g)
    else:
        grads = backward.touched_core_grads(all_cores, emb.specs, emb.feature_table_map, plans, offsets,
                                            per_sample_weights, grad_output, batch=batch, pooling=emb.pooling)

        def update(core, m, g):
            return optim.update_slices(opt, core, m, *g)
    new_cores, new_mom = [], []
    for k, cores in enumerate(all_cores):
        cs, ms = [], []
        for t, core in enumerate(cores):
            m = None if momentum is None else momentum[k][t]
            if grads[k][t] is not None:
                core, m = update(core, m, grads[k][t])
            cs.append(core)
            ms.append(m)
        new_cores.append(tuple(cs))
        new_mom.append(tuple(ms))
    new_params = dict(params, cores=tuple(new_cores))
    if momentum is None:
        return new_params, opt_state
    return new_params, type(opt_state)(tuple(new_mom))


def _fused_empty(params, opt_state, batch, total_dim):
    # No lookups: the output is zeros and the step changes nothing (the cotangents are the inputs).
    @jax.custom_vjp
    def f(p, s):
        return jnp.zeros((batch, total_dim), jnp.float32)

    f.defvjp(lambda p, s: (f(p, s), (p, s)), lambda res, g: res)
    return f(params, opt_state)


# The fused path: the VJP of the lookup *is* the optimizer step (see `fused_lookup`).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_lookup(emb, batch, opt, params, opt_state, per_sample_weights, indices, offsets):
    return emb._forward(batch, params["cores"], indices, offsets, per_sample_weights, with_plans=False)[0]


def _fused_fwd(emb, batch, opt, params, opt_state, per_sample_weights, indices, offsets):
    out, plans = emb._forward(batch, params["cores"], indices, offsets, per_sample_weights, with_plans=True)
    return out, (params, opt_state, plans, offsets, per_sample_weights)


def _fused_bwd(emb, batch, opt, res, g):
    params, opt_state, plans, offsets, per_sample_weights = res
    new_params, new_state = _apply(emb, batch, opt, params, opt_state, plans, offsets, per_sample_weights, g)
    return new_params, new_state, None, None, None


_fused_lookup.defvjp(_fused_fwd, _fused_bwd)
