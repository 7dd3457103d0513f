"""Synthetic TT embedding workloads for benchmarks and tests.

- `workload_a()`: the anchors' single table (benchmarks/ANCHORS.md, the tensor-train table):
  N = 10M rows as p = (200, 200, 250), D = 32 as q = (2, 4, 4), ranks (32, 32), every bag
  exactly L = 20 lookups, Zipf(1.1) ids through a fixed random permutation of the rows (drawn
  with `tbe_jax.testing.sample_ids`, as the anchors were).
- `meta(num_tables)`: Meta-like multi-table workloads in the spirit of FlowTT's / EcoRec's
  Meta-240, Meta-480 and Meta-788 (`PRESETS["meta-240"]` etc.): that many TT tables (one
  feature each), D = 32 as q = (2, 4, 4), ranks (32, 32), heavy-tailed table sizes and pooling
  factors, Zipf ids. These are a documented synthetic stand-in, NOT Meta's traces: the recipe
  below is ours, chosen to match the published summary statistics we know (the table count,
  D, a mean pooling factor of about 13.6, heavy tails).

`meta` recipe (deterministic in `seed`):
  - table sizes: log-normal, median 300k rows, sigma 1.6 (natural log), clipped to
    [1k, 40M]; p = balanced 3-factor split of N (`suggested_tt_shapes`), so N is rarely a
    product of p;
  - pooling factor L_t per table: log-normal with sigma 1.0, scaled so the mean over tables
    is 13.6, clipped to [1, 128]; a bag's length is Poisson(L_t) (so some bags are empty);
  - ids: Zipf(`alpha`, default 1.05) ranks from the continuous inverse CDF of x**-alpha on
    [1, N+1) (fast for 40M-row tables; close to the discrete law), scattered over the rows by
    an affine bijection `(rank * a + c) mod N` with gcd(a, N) = 1, fixed per table.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tt_jax.specs import TTSpec, suggested_tt_shapes


@dataclasses.dataclass(frozen=True)
class TTWorkload:
    """Tables (feature f reads table f), per-table mean bag length, id skew.

    Attributes:
      name: for reports.
      specs: the TT tables.
      pooling_factors: per table, the mean lookups per bag.
      alpha: Zipf exponent of the ids (<= 1: uniform for the exact sampler).
      fixed_bag_len: every bag has exactly round(pooling factor) lookups (else Poisson).
      exact_zipf: draw ids with `tbe_jax.testing.sample_ids` (exact discrete Zipf through a
        full random permutation: O(N) per table, the anchors' sampler) instead of the fast
        continuous approximation.
    """

    name: str
    specs: tuple[TTSpec, ...]
    pooling_factors: tuple[float, ...]
    alpha: float
    fixed_bag_len: bool = False
    exact_zipf: bool = False

    @property
    def num_tables(self) -> int:
        return len(self.specs)

    def summary(self) -> dict:
        rows = np.asarray([s.num_embeddings for s in self.specs], np.float64)
        return {
            "name": self.name, "tables": self.num_tables, "dims": sorted({s.embedding_dim for s in self.specs}),
            "total_rows": int(rows.sum()), "rows_min": int(rows.min()), "rows_median": float(np.median(rows)),
            "rows_max": int(rows.max()), "mean_pooling_factor": float(np.mean(self.pooling_factors)),
            "alpha": self.alpha, "tt_parameters": int(sum(s.num_parameters() for s in self.specs)),
            "specs": [repr(s) for s in self.specs] if self.num_tables <= 4 else "omitted",
        }

    def make_batch(self, rng: np.random.Generator, batch: int, perms=None):
        """FBGEMM-format inputs for `batch` samples: (indices int32 [N], offsets int32 [T * batch + 1]).

        `perms` (exact_zipf only): per table, the row permutation (default: seeded by the table size).
        """
        lengths, ids = [], []
        for t, (spec, pf) in enumerate(zip(self.specs, self.pooling_factors)):
            ln = np.full(batch, int(round(pf))) if self.fixed_bag_len else rng.poisson(pf, batch)
            lengths.append(ln)
            n = int(ln.sum())
            if self.exact_zipf:
                from tbe_jax.testing import sample_ids

                ids.append(sample_ids(rng, spec.num_embeddings, n, self.alpha, None if perms is None else perms[t]))
            else:
                ids.append(zipf_ids(rng, spec.num_embeddings, n, self.alpha, table_seed=t))
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
        if offsets[-1] >= 2**31:
            raise ValueError(f"{offsets[-1]} lookups do not fit int32 offsets; use a smaller batch")
        return np.concatenate(ids).astype(np.int32), offsets.astype(np.int32)


def zipf_ids(rng: np.random.Generator, num_rows: int, n: int, alpha: float, *, table_seed: int = 0) -> np.ndarray:
    """`n` ids in [0, num_rows): Zipf(alpha) ranks (continuous inverse CDF) through an affine bijection.

    alpha <= 0 gives uniform ids. The bijection `(rank * a + c) mod num_rows` is fixed by
    (num_rows, table_seed), so the hot rows of a table are the same in every batch.
    """
    u = rng.random(n)
    if alpha <= 0:
        return np.minimum((u * num_rows).astype(np.int64), num_rows - 1).astype(np.int32)
    top = float(num_rows) + 1.0
    if abs(alpha - 1.0) < 1e-9:
        x = top**u
    else:
        e = 1.0 - alpha
        x = (1.0 + u * (top**e - 1.0)) ** (1.0 / e)
    rank = np.minimum(np.floor(x).astype(np.int64) - 1, num_rows - 1)
    prng = np.random.default_rng([num_rows, table_seed, 7])
    a = int(prng.integers(1, max(2, num_rows)))
    while math.gcd(a, num_rows) != 1:
        a += 1
    c = int(prng.integers(0, num_rows))
    return ((rank * a + c) % num_rows).astype(np.int32)


def workload_a(p=(200, 200, 250), q=(2, 4, 4), ranks=(32, 32), bag_len: int = 20, alpha: float = 1.1) -> TTWorkload:
    """The anchors' single-table workload (a); the arguments allow scaled-down variants (CPU smoke runs)."""
    spec = TTSpec(math.prod(p), math.prod(q), p_shapes=tuple(p), q_shapes=tuple(q), ranks=tuple(ranks))
    return TTWorkload("a", (spec,), (float(bag_len),), alpha, fixed_bag_len=True, exact_zipf=True)


def meta(num_tables: int, *, seed: int = 0, dim_q=(2, 4, 4), ranks=(32, 32), median_rows: int = 300_000,
         sigma_rows: float = 1.6, min_rows: int = 1_000, max_rows: int = 40_000_000,
         mean_pooling: float = 13.6, alpha: float = 1.05, name: str | None = None) -> TTWorkload:
    """A Meta-like multi-table workload (see the module docstring for the recipe)."""
    rng = np.random.default_rng([seed, num_tables])
    sizes = np.clip(np.exp(rng.normal(math.log(median_rows), sigma_rows, num_tables)), min_rows, max_rows)
    sizes = sizes.astype(np.int64)
    pf = np.exp(rng.normal(0.0, 1.0, num_tables))
    for _ in range(8):  # rescale and clip until the mean settles
        pf = np.clip(pf * mean_pooling / pf.mean(), 1.0, 128.0)
    d = math.prod(dim_q)
    specs = []
    for n in sizes:
        p, _ = suggested_tt_shapes(int(n), d, len(dim_q))
        specs.append(TTSpec(int(n), d, p_shapes=p, q_shapes=tuple(dim_q), ranks=tuple(ranks)))
    return TTWorkload(name or f"meta-{num_tables}", tuple(specs), tuple(float(x) for x in pf), alpha)


PRESETS = {
    "a": workload_a,
    "meta-240": lambda **kw: meta(240, **kw),
    "meta-480": lambda **kw: meta(480, **kw),
    "meta-788": lambda **kw: meta(788, **kw),
}
