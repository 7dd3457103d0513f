"""Synthetic click logs with a planted signal, in tbe_jax's (FBGEMM's) input format.

Criteo-shaped: 13 dense features and 26 sparse features whose tables range from
tens of rows to (at the GPU size) a million. Each sparse feature of an example is
a bag of ids: some features are one-hot with missing values (bags of 0 or 1 id),
the others multi-hot with Poisson lengths (empty bags included). Ids are Zipf
skewed: a few rows of each table are very frequent, most are rare.

Labels come from a hidden logistic model that a DLRM can learn:

    logit = bias + x . w                                  (dense features)
          + sum_f sum_{id in bag f} eff_f[id]             (per-row latent effects)
          + sum_{(f,g) in P} <U_f, U_g> + sum_{f in Q} <x V, U_f>   (interactions)
    label ~ Bernoulli(sigmoid(logit))

where `U_f` is the sum over feature f's bag of hidden k-dim row vectors. The
hidden weights, effects and vectors are fixed random draws from the seed; the
scale is set (from a pilot sample) so the hidden logit has a fixed spread and the
bias so that about `ctr` of the labels are clicks.

Everything is NumPy on the host and deterministic: batch `i` of a stream depends
only on (seed, stream, i), so a training run resumed at step k sees the same
batches as a straight run. The Zipf draw uses the inverse CDF of the continuous
power law (O(1) per id, no per-table CDF array), and the rank-to-row map is an
affine bijection `(rank * P + shift) mod E` (P a prime above E), so the frequent
rows are spread over the table without a stored permutation.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26

# Streams of independent random numbers under one seed.
_HIDDEN, _TRAIN, _EVAL, _PILOT = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Shape of the synthetic click log (hashable)."""

    table_rows: tuple[int, ...]  # rows of each sparse feature's table
    bag_mean: tuple[float, ...]  # per feature: 0 < p < 1 for one-hot present with prob p; >= 1 Poisson mean
    num_dense: int = NUM_DENSE
    alpha: float = 1.1  # Zipf exponent of the ids
    latent_dim: int = 4  # k of the hidden row vectors
    logit_std: float = 2.0  # spread of the hidden logit
    ctr: float = 0.25  # target share of clicks

    def __post_init__(self):
        if len(self.table_rows) != len(self.bag_mean):
            raise ValueError("table_rows and bag_mean must have one entry per sparse feature")
        if min(self.table_rows) < 1:
            raise ValueError("every table needs at least one row")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    @property
    def num_sparse(self) -> int:
        return len(self.table_rows)

    @staticmethod
    def preset(size: str) -> "DataConfig":
        """`tiny` (tests), `small` (the CPU default) or `gpu` (10 to 1e6 rows per table)."""
        max_rows = {"tiny": 2_000, "small": 100_000, "gpu": 1_000_000}[size]
        return DataConfig(table_rows=table_sizes(NUM_SPARSE, 10, max_rows), bag_mean=bag_means(NUM_SPARSE))


def table_sizes(n: int, lo: int, hi: int) -> tuple[int, ...]:
    """`n` table sizes spread geometrically over [lo, hi], in a fixed shuffled order."""
    sizes = np.round(np.geomspace(lo, hi, n)).astype(np.int64)
    order = np.random.default_rng(12345).permutation(n)
    return tuple(int(s) for s in sizes[order])


def bag_means(n: int) -> tuple[float, ...]:
    """Per feature: a third one-hot with 5-40% missing, the rest multi-hot with mean lengths 1 to 8."""
    out = []
    for f in range(n):
        if f % 3 == 0:
            out.append(round(0.95 - 0.35 * (f / max(n - 1, 1)), 3))  # present with this probability
        else:
            out.append(float(1 + (7 * f) % 8))  # Poisson mean in 1..8
    return tuple(out)


def _large_prime_above(n: int) -> int:
    """The smallest prime > max(n, 2**20) (trial division; called once per table)."""
    p = max(n, 1 << 20) + 1
    while True:
        if p % 2 and all(p % d for d in range(3, int(p**0.5) + 1, 2)):
            return p
        p += 1


def zipf_ranks(u: np.ndarray, n: np.ndarray, alpha: float) -> np.ndarray:
    """Ranks in [0, n) from uniforms `u` by the continuous power law's inverse CDF (exponent alpha)."""
    n = n.astype(np.float64)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * np.log(n + 1.0))
    else:
        a = 1.0 - alpha
        x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, n.astype(np.int64) - 1).clip(0)


@dataclasses.dataclass
class Batch:
    """One batch. `indices`/`offsets` are the TBE inputs (F*B+1 offsets, feature-major).

    `indices` is padded past `offsets[-1]` to `padded_len` with zeros (positions
    past the last offset belong to no bag), so that batches share one shape and a
    jitted step compiles once. `logit` is the hidden model's logit (for checks).
    """

    dense: np.ndarray  # [B, num_dense] float32
    indices: np.ndarray  # [padded_len] int32
    offsets: np.ndarray  # [F*B + 1] int32
    labels: np.ndarray  # [B] float32 in {0, 1}
    logit: np.ndarray  # [B] float32

    @property
    def num_ids(self) -> int:
        return int(self.offsets[-1])

    def arrays(self) -> dict:
        """The model's inputs as a dict of arrays (what the jitted step takes)."""
        return {"dense": self.dense, "indices": self.indices, "offsets": self.offsets, "labels": self.labels}


class ClickLogGenerator:
    """Deterministic synthetic click-log batches (see the module doc).

    Args:
      config: a `DataConfig`.
      batch_size: examples per batch (B).
      seed: fixes the hidden model and every batch.
    """

    def __init__(self, config: DataConfig, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config = config
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        cfg = config
        f = cfg.num_sparse
        self.rows = np.asarray(cfg.table_rows, np.int64)
        self.row_base = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
        self.bag_mean = np.asarray(cfg.bag_mean, np.float64)
        self.one_hot = self.bag_mean < 1.0
        self.prime = np.asarray([_large_prime_above(int(e)) for e in self.rows], np.int64)

        rng = np.random.default_rng([self.seed, _HIDDEN])
        self.shift = rng.integers(0, self.rows)  # per table: where rank 0 lands
        # Per-feature strength: a few features carry no signal at all.
        strength = rng.uniform(0.2, 1.0, f) * (rng.random(f) > 0.15)
        self.w_dense = rng.normal(0.0, 1.0, cfg.num_dense) / np.sqrt(cfg.num_dense)
        total = int(self.rows.sum())
        feat_of_row = np.repeat(np.arange(f), self.rows)
        # Scale the effects so each feature's bag sum has variance ~ strength^2.
        per_bag = np.where(self.one_hot, 1.0, self.bag_mean)
        # One row per table row: [effect, k latent values] (one gather per id when sampling).
        k = cfg.latent_dim
        self.hidden_rows = rng.standard_normal((total, 1 + k), np.float32)
        self.hidden_rows[:, 0] *= (strength / np.sqrt(per_bag)).astype(np.float32)[feat_of_row]
        self.hidden_rows[:, 1:] *= (1.0 / np.sqrt(k * per_bag)).astype(np.float32)[feat_of_row][:, None]
        self.v_dense = (rng.normal(0.0, 1.0, (cfg.num_dense, k)) / np.sqrt(cfg.num_dense)).astype(np.float32)
        feats = rng.permutation(f)
        self.pairs = [(int(feats[2 * i]), int(feats[2 * i + 1])) for i in range(min(4, f // 2))]
        self.dense_pairs = [int(g) for g in feats[8 : 8 + min(4, max(f - 8, 0))]]

        # Fixed padded length: mean + 8 standard deviations of the id count, rounded up.
        var = np.where(self.one_hot, self.bag_mean * (1 - self.bag_mean), self.bag_mean)
        mean_n, sd_n = batch_size * self.bag_mean.sum(), np.sqrt(batch_size * var.sum())
        self.padded_len = int(-(-(mean_n + 8 * sd_n + 64) // 256) * 256)

        # Calibrate the hidden logit: scale to logit_std, bias to the target click rate.
        pilot = self._draw(np.random.default_rng([self.seed, _PILOT]), max(4096, batch_size))
        raw = pilot[-1]
        self.scale = cfg.logit_std / max(float(raw.std()), 1e-12)
        z = raw * self.scale
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection: mean sigmoid(z + b) = ctr
            b = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(z + b)))) > cfg.ctr:
                hi = b
            else:
                lo = b
        self.bias = 0.5 * (lo + hi)

    # -- sampling -------------------------------------------------------------------
    def _draw(self, rng: np.random.Generator, b: int):
        """(dense, lengths [F, B], ids [N], raw logit [B]) for `b` examples."""
        cfg = self.config
        f = cfg.num_sparse
        dense = rng.standard_normal((b, cfg.num_dense), np.float32)
        u = rng.random((f, b))
        lengths = np.where(
            self.one_hot[:, None],
            (u < self.bag_mean[:, None]).astype(np.int64),
            rng.poisson(np.where(self.one_hot, 1.0, self.bag_mean)[:, None], (f, b)),
        )
        counts = lengths.sum(axis=1)
        feat = np.repeat(np.arange(f), counts)
        ranks = zipf_ranks(rng.random(feat.shape[0]), self.rows[feat], cfg.alpha)
        ids = (ranks * self.prime[feat] + self.shift[feat]) % self.rows[feat]
        # Per-bag sums of the hidden rows: differences of a running sum at the bag boundaries.
        vals = self.hidden_rows[self.row_base[feat] + ids]
        csum = np.zeros((vals.shape[0] + 1, vals.shape[1]), np.float64)
        np.cumsum(vals, axis=0, out=csum[1:])
        ends = np.cumsum(lengths.reshape(-1))
        sums = (csum[ends] - csum[ends - lengths.reshape(-1)]).reshape(f, b, -1)
        u_bag = sums[..., 1:]
        raw = dense.astype(np.float64) @ self.w_dense + sums[..., 0].sum(axis=0)
        for p, q in self.pairs:
            raw += np.einsum("bk,bk->b", u_bag[p], u_bag[q])
        xv = dense @ self.v_dense
        for g in self.dense_pairs:
            raw += np.einsum("bk,bk->b", xv, u_bag[g])
        return dense, lengths, ids.astype(np.int32), raw

    def batch(self, i: int, stream: str = "train") -> Batch:
        """Batch `i` of the "train" or "eval" stream (deterministic in seed, stream, i)."""
        s = {"train": _TRAIN, "eval": _EVAL}[stream]
        rng = np.random.default_rng([self.seed, s, int(i)])
        b = self.batch_size
        dense, lengths, ids, raw = self._draw(rng, b)
        logit = (raw * self.scale + self.bias).astype(np.float32)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit.astype(np.float64)))).astype(np.float32)
        offsets = np.zeros(lengths.size + 1, np.int32)
        np.cumsum(lengths.reshape(-1), out=offsets[1:])
        n = ids.shape[0]
        pad = max(self.padded_len, -(-n // 256) * 256)  # a rare oversize batch takes a larger shape
        indices = np.zeros(pad, np.int32)
        indices[:n] = ids
        return Batch(dense, indices, offsets, labels, logit)

    def batches(self, start: int, stop: int, stream: str = "train") -> Iterator[Batch]:
        for i in range(start, stop):
            yield self.batch(i, stream)
