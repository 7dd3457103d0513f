"""`TTEmbeddingBag`: TT-compressed embedding tables with tbe_jax's input format."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from tt_jax import reference
from tt_jax.kernels.forward import TTKernelConfig, pooled_forward
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
        otherwise). Under `jax.grad` the pallas forward is paired with the
        XLA path's VJP (recomputed; no fused backward yet).
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
    def __call__(self, params, indices, offsets, per_sample_weights=None):
        """`[B, sum D]` pooled lookups; input format as `tbe_jax.TableBatchedEmbedding`."""
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
        if indices.shape[0] == 0 or batch == 0:
            return jnp.zeros((batch, total_dim), jnp.float32)
        indices = indices.astype(jnp.int32)
        offsets = offsets.astype(jnp.int32)
        if self.resolved_impl == "xla":
            return _xla_pooled(self, params["cores"], indices, offsets, per_sample_weights, batch)
        if not self.interpret and jax.default_backend() != "gpu":
            raise NotImplementedError(
                "impl='pallas' compiles Triton kernels and needs a GPU; on "
                f"{jax.default_backend()} pass interpret=True or use impl='xla' (or 'auto')"
            )
        if per_sample_weights is None:
            return _pallas_pooled(self, batch, params["cores"], indices, offsets)
        return _pallas_pooled_weighted(self, batch, params["cores"], indices, offsets, per_sample_weights)


def _xla_pooled(emb: TTEmbeddingBag, all_cores, indices, offsets, per_sample_weights, batch):
    ftm = emb.feature_table_map
    return reference.pooled([all_cores[t] for t in ftm], [emb.specs[t] for t in ftm], indices, offsets,
                            per_sample_weights, pooling=emb.pooling, batch=batch)


def _pallas_forward(emb: TTEmbeddingBag, batch, all_cores, indices, offsets, per_sample_weights):
    return pooled_forward(all_cores, emb.specs, emb.feature_table_map, indices, offsets, per_sample_weights,
                          batch=batch, pooling=emb.pooling, config=emb.config, interpret=emb.interpret)


# The fused forward with the XLA path's VJP (cores and per-sample weights get gradients; ids do not).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pallas_pooled(emb, batch, all_cores, indices, offsets):
    return _pallas_forward(emb, batch, all_cores, indices, offsets, None)


def _pallas_pooled_fwd(emb, batch, all_cores, indices, offsets):
    return _pallas_forward(emb, batch, all_cores, indices, offsets, None), (all_cores, indices, offsets)


def _pallas_pooled_bwd(emb, batch, res, g):
    all_cores, indices, offsets = res
    _, vjp = jax.vjp(lambda c: _xla_pooled(emb, c, indices, offsets, None, batch), all_cores)
    return vjp(g) + (None, None)


_pallas_pooled.defvjp(_pallas_pooled_fwd, _pallas_pooled_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pallas_pooled_weighted(emb, batch, all_cores, indices, offsets, per_sample_weights):
    return _pallas_forward(emb, batch, all_cores, indices, offsets, per_sample_weights)


def _pallas_pooled_weighted_fwd(emb, batch, all_cores, indices, offsets, per_sample_weights):
    out = _pallas_forward(emb, batch, all_cores, indices, offsets, per_sample_weights)
    return out, (all_cores, indices, offsets, per_sample_weights)


def _pallas_pooled_weighted_bwd(emb, batch, res, g):
    all_cores, indices, offsets, psw = res
    _, vjp = jax.vjp(lambda c, w: _xla_pooled(emb, c, indices, offsets, w, batch), all_cores, psw)
    d_cores, d_psw = vjp(g)
    return d_cores, None, None, d_psw


_pallas_pooled_weighted.defvjp(_pallas_pooled_weighted_fwd, _pallas_pooled_weighted_bwd)
