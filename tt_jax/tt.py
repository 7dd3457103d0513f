"""`TTEmbeddingBag`: TT-compressed embedding tables with tbe_jax's input format."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from tt_jax import reference
from tt_jax.specs import TTSpec

_INITS = ("approx-normal", "approx-uniform")


class TTEmbeddingBag:
    """Pooled lookups into tensor-train tables (one feature per table, feature-major offsets).

    Args:
      specs: one `TTSpec` or a list (feature f reads table f).
      pooling: "sum" or "mean" (an empty bag gives zeros).
      impl: "xla" (the pure-jnp per-index chain) or "auto". The fused FlowTT
        Pallas kernel is not written yet: "auto" runs the XLA path everywhere
        and "pallas" raises.
      interpret: reserved for the Pallas kernel (interpret mode on CPU).

    Ids outside `[0, N)` contribute nothing. `offsets` are not validated (no
    bounds_check option yet): they must start at 0, never decrease and end at
    most at `len(indices)`.

    Example:
      >>> import jax, jax.numpy as jnp, tt_jax
      >>> emb = tt_jax.TTEmbeddingBag(tt_jax.TTSpec(1000, 16, ranks=(8, 8)))
      >>> params = emb.init(jax.random.key(0))
      >>> emb(params, jnp.array([3, 999, 5], jnp.int32), jnp.array([0, 2, 3], jnp.int32)).shape
      (2, 16)
    """

    def __init__(self, specs, *, pooling: str = "sum", impl: str = "auto", interpret: bool = False):
        specs = (specs,) if isinstance(specs, TTSpec) else tuple(specs)
        if not specs or not all(isinstance(s, TTSpec) for s in specs):
            raise TypeError("specs must be a TTSpec or a non-empty list of TTSpec")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if impl not in ("auto", "xla", "pallas"):
            raise ValueError(f"impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
        self.specs = specs
        self.pooling = pooling
        self.impl = impl
        self.interpret = bool(interpret)

    def _key(self):
        return (self.specs, self.pooling, self.impl, self.interpret)

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
        nf = len(self.specs)
        if (offsets.shape[0] - 1) % nf or offsets.shape[0] < 1:
            raise ValueError(f"offsets has {offsets.shape[0]} entries; expected F*B+1 with F={nf} tables")
        if per_sample_weights is not None:
            per_sample_weights = jnp.asarray(per_sample_weights)
            if per_sample_weights.shape != indices.shape:
                raise ValueError("per_sample_weights must match indices in shape")
        if self.impl == "pallas":
            raise NotImplementedError(
                "the fused FlowTT Pallas kernel is not written yet; use impl='xla' (or 'auto')"
            )
        batch = (offsets.shape[0] - 1) // nf
        if indices.shape[0] == 0:
            return jnp.zeros((batch, sum(s.embedding_dim for s in self.specs)), jnp.float32)
        return reference.pooled(
            params["cores"], self.specs, indices.astype(jnp.int32), offsets.astype(jnp.int32),
            per_sample_weights, pooling=self.pooling, batch=batch,
        )
