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

`ClickLogGenerator` is NumPy on the host and deterministic: batch `i` of a stream
depends only on (seed, stream, i), so a training run resumed at step k sees the same
batches as a straight run. The Zipf draw uses the inverse CDF of the continuous
power law (O(1) per id, no per-table CDF array), and the rank-to-row map is an
affine bijection `(rank * P + shift) mod E` (P a prime above E), so the frequent
rows are spread over the table without a stored permutation.

Fixed bag sizes (`DataConfig.bag_sizes`, MLPerf DLRMv2's multi-hot Criteo: `DataConfig.fixed`, the
`mlperf` preset and `preset(size, fixed_bags=True)`): every bag of feature f holds exactly `bag_sizes[f]`
ids, so a batch holds exactly `B * sum(bag_sizes)` ids (no padding, static offsets). For tables of up to
4e7 rows the hidden model is bounded (`DataConfig.hidden_ranks` K, 2**16 in those presets): only each
table's K most frequent Zipf ranks have a hidden row (looked up by rank, before the rank-to-row map), the
rarer rows have none, so it holds `sum(min(E_t, K))` rows (645,486 at MLPerf's sizes) instead of one per
table row. (At alpha 1.1 the top 2**16 ranks take ~80% of a 4e7-row table's lookups, so the signal stays
learnable.) The calibration pilot is then 16384 examples: an MLPerf-sized generator builds in ~1.5 s.

`DeviceClickLog` draws the same kind of batches on the device, inside jitted code
(`draw`), from the host generator's hidden model (its hidden rows, weights, pairs,
rank-to-row maps, logit scale and bias, copied to the device once): the same feature
cardinalities, bag-length distributions, Zipf ids and label model, other random
numbers (jax.random instead of NumPy). Batch `i` of a stream is drawn from the key
`fold_in(fold_in(key(seed), stream), i)`, so it too depends only on (seed, stream, i).
Every batch has one static shape: the ids are packed into a fixed capacity (the host
generator's `padded_len`) and zero-padded past `offsets[-1]`; the bag lengths come from
per-feature inverse-CDF tables (no data-dependent loops: nothing waits on the host).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26

# Streams of independent random numbers under one seed.
_HIDDEN, _TRAIN, _EVAL, _PILOT = 0, 1, 2, 3

# MLPerf DLRMv2 (DCNv2, multi-hot Criteo 1TB): rows per table and the fixed bag size of each feature.
MLPERF_TABLE_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
                     11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
MLPERF_BAG_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
HIDDEN_RANKS = 1 << 16  # the fixed-bag presets' hidden_ranks


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
    # Fixed bag sizes: every bag of feature f holds exactly bag_sizes[f] ids (MLPerf DLRMv2's multi-hot
    # Criteo); bag_mean must then equal them (`DataConfig.fixed`). None: the random lengths of bag_mean.
    bag_sizes: tuple[int, ...] | None = None
    # K > 0: only the K most frequent ranks of each table carry a hidden row (the rarer rows none), so the
    # hidden model takes sum(min(E_t, K)) rows whatever the tables' size. 0: every row has one.
    hidden_ranks: int = 0

    def __post_init__(self):
        if len(self.table_rows) != len(self.bag_mean):
            raise ValueError("table_rows and bag_mean must have one entry per sparse feature")
        if self.bag_sizes is not None:
            if len(self.bag_sizes) != len(self.table_rows) or min(self.bag_sizes) < 1:
                raise ValueError(f"bag_sizes={self.bag_sizes} needs one size >= 1 per sparse feature")
            if tuple(float(x) for x in self.bag_sizes) != tuple(float(x) for x in self.bag_mean):
                raise ValueError("with bag_sizes, bag_mean must equal them (use DataConfig.fixed)")
        if self.hidden_ranks < 0:
            raise ValueError(f"hidden_ranks={self.hidden_ranks} must be >= 0")
        if min(self.table_rows) < 1:
            raise ValueError("every table needs at least one row")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    @property
    def num_sparse(self) -> int:
        return len(self.table_rows)

    @staticmethod
    def fixed(table_rows, bag_sizes, **kwargs) -> "DataConfig":
        """A config with fixed bag sizes (`bag_mean` set to them)."""
        sizes = tuple(int(x) for x in bag_sizes)
        return DataConfig(tuple(int(e) for e in table_rows), tuple(float(x) for x in sizes), bag_sizes=sizes,
                          **kwargs)

    @staticmethod
    def preset(size: str, fixed_bags: bool = False) -> "DataConfig":
        """`tiny` (tests), `small` (the CPU default), `gpu` (10 to 1e6 rows per table) or `mlperf` (MLPerf
        DLRMv2's 26 tables, 3 to 4e7 rows, 204,184,588 in all, and its fixed multi-hot bag sizes).

        `fixed_bags` (always at `mlperf`): MLPerf's fixed bag sizes, tables of MLPerf's sizes capped at the
        size's largest table (2000 rows at `tiny`), and hidden effects on each table's 2**16 most frequent
        ranks only (`hidden_ranks`)."""
        if size == "mlperf":
            return DataConfig.fixed(MLPERF_TABLE_ROWS, MLPERF_BAG_SIZES, hidden_ranks=HIDDEN_RANKS)
        max_rows = {"tiny": 2_000, "small": 100_000, "gpu": 1_000_000}[size]
        if fixed_bags:
            return DataConfig.fixed(tuple(min(e, max_rows) for e in MLPERF_TABLE_ROWS), MLPERF_BAG_SIZES,
                                    hidden_ranks=HIDDEN_RANKS)
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
        # Hidden rows per table: one per row, or (hidden_ranks K) one per rank below K, by rank.
        self.hidden_count = self.rows if not cfg.hidden_ranks else np.minimum(self.rows, cfg.hidden_ranks)
        self.hidden_base = np.concatenate([[0], np.cumsum(self.hidden_count)[:-1]]).astype(np.int64)
        total = int(self.hidden_count.sum())
        feat_of_row = np.repeat(np.arange(f), self.hidden_count)
        # Scale the effects so each feature's bag sum has variance ~ strength^2.
        per_bag = np.where(self.one_hot, 1.0, self.bag_mean)
        # One row per hidden row: [effect, k latent values] (one gather per id when sampling).
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
        if cfg.bag_sizes is not None:  # fixed sizes: exactly the batch's ids, no padding
            self.padded_len = batch_size * int(sum(cfg.bag_sizes))

        # Calibrate the hidden logit: scale to logit_std, bias to the target click rate (fixed bag sizes:
        # from 16384 examples whatever the batch size, so that an MLPerf-sized generator builds in seconds).
        pilot_n = max(4096, batch_size) if cfg.bag_sizes is None else 16384
        pilot = self._draw(np.random.default_rng([self.seed, _PILOT]), pilot_n)
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
        if cfg.bag_sizes is not None:
            lengths = np.repeat(np.asarray(cfg.bag_sizes, np.int64)[:, None], b, axis=1)
        else:
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
        if cfg.hidden_ranks:  # by rank: ranks >= K have none
            count = self.hidden_count[feat]
            vals = self.hidden_rows[self.hidden_base[feat] + np.minimum(ranks, count - 1)]
            vals = np.where((ranks < count)[:, None], vals, np.float32(0))
        else:
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
        if self.config.bag_sizes is not None:
            pad = n  # (= padded_len)
        indices = np.zeros(pad, np.int32)
        indices[:n] = ids
        return Batch(dense, indices, offsets, labels, logit)

    def batches(self, start: int, stop: int, stream: str = "train") -> Iterator[Batch]:
        for i in range(start, stop):
            yield self.batch(i, stream)


# -- on the device ---------------------------------------------------------------------

_STREAMS = {"train": _TRAIN, "eval": _EVAL}


def length_cdf(bag_mean) -> np.ndarray:
    """`[F, K]` float32: per feature, the CDF of its bag length at 0..K-1 (a one-hot feature present
    with probability p: `[1-p, 1, 1, ...]`; a multi-hot one: Poisson(mean)), K where every row has
    reached 1.0 in float32. A bag's length is the number of entries of its row a uniform u in [0, 1)
    is >= to (inverse CDF; the Poisson tails past float32's resolution, below ~1e-7, are cut): at most
    K - 1."""
    rows = []
    for m in np.asarray(bag_mean, np.float64):
        if m < 1.0:
            rows.append(np.array([1.0 - m, 1.0]))
            continue
        pmf = [np.exp(-m)]
        while np.float32(np.sum(pmf)) < 1.0:
            pmf.append(pmf[-1] * m / len(pmf))
        rows.append(np.cumsum(pmf))
    k = max(len(r) for r in rows)
    out = np.ones((len(rows), k), np.float32)
    for f, r in enumerate(rows):
        out[f, : len(r)] = np.minimum(r, 1.0)
    return out


def mulmod(a, b, m, bits: int):
    """`(a * b) mod m` elementwise for `0 <= a, b < m < 2**bits` (bits <= 30), without 64-bit integers.

    Up to 20 bits: the quotient estimated in float32 (off by at most 1), the remainder
    `a*b - q*m` in wrapping int32 arithmetic (exact: it lies in [-m, 2m)) and corrected once
    each way. Above: Horner over chunks of `b` of `31 - bits` bits in uint32 (every partial
    result stays below 2**32)."""
    if not 1 <= bits <= 30:
        raise ValueError(f"mulmod needs moduli below 2**30, got {bits} bits")
    if bits <= 20:
        a, b, m = (jnp.asarray(x).astype(jnp.int32) for x in (a, b, m))
        q = jnp.floor(a.astype(jnp.float32) * b.astype(jnp.float32) / m.astype(jnp.float32)).astype(jnp.int32)
        r = a * b - q * m  # int32 products wrap: the difference is exact modulo 2**32
        r = jnp.where(r < 0, r + m, r)
        return jnp.where(r >= m, r - m, r)
    c = 31 - bits
    a, b, m = (jnp.asarray(x).astype(jnp.uint32) for x in (a, b, m))
    r = jnp.zeros_like(a)
    for j in reversed(range(-(-bits // c))):
        chunk = (b >> jnp.uint32(j * c)) & jnp.uint32((1 << c) - 1)
        r = jax.lax.rem(r * jnp.uint32(1 << c) + a * chunk, m)
    return r.astype(jnp.int32)


def bag_sums(values, offsets, max_len, batch_size: int):
    """Per bag, the sum of `values` `[N, d]` (packed bag after bag, feature-major: F*B bags) over
    positions `offsets[j] .. offsets[j+1] - 1`: `[F, B, d]` (0 for empty bags), feature f's bags
    holding at most `max_len[f]` ids (static). Each bag's sum is a masked sum over its slots:
    deterministic (no scatter-add, no scan) and formed from its own ids only. The features are
    grouped by their maximum length rounded up to a power of two (at most the longest): a few
    groups, each one gather and one sum."""
    n = values.shape[0]
    f, b = len(max_len), int(batch_size)
    lengths = jnp.diff(offsets).reshape(f, b)
    starts = offsets[:-1].reshape(f, b)
    top = max(int(x) for x in max_len)
    width = [min(1 << max(int(x) - 1, 0).bit_length(), top) for x in max_len]
    parts, order = [], []
    for m in sorted(set(width)):
        feats = np.asarray([g for g in range(f) if width[g] == m], np.int64)
        slot = jnp.arange(max(m, 1), dtype=offsets.dtype)
        idx = jnp.clip(starts[feats][..., None] + slot, 0, n - 1)  # [G, B, m]
        mask = slot < lengths[feats][..., None]
        parts.append(jnp.sum(jnp.where(mask[..., None], values[idx], 0.0), axis=2))
        order.extend(feats.tolist())
    return jnp.concatenate(parts)[np.argsort(np.asarray(order))]


def gather_segments(values, starts, counts, cap: int):
    """The segments `values[starts[s] : starts[s] + counts[s]]` one after another, zero-padded (or cut)
    to `cap` entries (on the device; S = len(starts) is static)."""
    ends = jnp.cumsum(counts)
    q = jnp.arange(cap, dtype=ends.dtype)
    seg = jnp.minimum(jnp.sum(q[:, None] >= ends[None, :], axis=1), len(starts) - 1)
    src = starts[seg] + q - (ends[seg] - counts[seg])
    src = jnp.clip(src, 0, values.shape[0] - 1)
    return jnp.where(q < ends[-1], values[src], jnp.zeros((), values.dtype))


def select_features(indices, offsets, batch_size: int, features, cap: int):
    """On the device, `examples.dlrm.model.split_features`: the ids and offsets of `features` alone (in
    that order), the ids zero-padded to `cap` (bags past `cap` ids are cut, which the host version
    instead gives a larger shape). Returns (indices `[cap]` int32, offsets `[len(features)*B + 1]`)."""
    feats = np.asarray(features, np.int64)
    f = (offsets.shape[0] - 1) // batch_size
    lengths = jnp.diff(offsets).reshape(f, batch_size)[feats]
    out_off = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.minimum(jnp.cumsum(lengths.reshape(-1)), cap)])
    starts = offsets[feats * batch_size]
    counts = offsets[(feats + 1) * batch_size] - starts
    return gather_segments(indices, starts, counts, cap).astype(jnp.int32), out_off.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What `draw` compiles in (hashable): it depends on the data's shape only, not on the seed."""

    config: DataConfig
    batch_size: int
    cap: int


def draw(config: DataConfig, params: dict, key, batch_size: int, cap: int) -> dict:
    """One batch of `batch_size` examples drawn on the device (traceable; call it inside `jax.jit`).

    `params` is `DeviceClickLog.params` (the hidden model). Returns {"dense" `[B, num_dense]` f32,
    "indices" `[cap]` int32 (zero past offsets[-1]), "offsets" `[F*B + 1]` int32, "labels" `[B]` f32,
    "logit" `[B]` f32 (the hidden model's)}.

    The same steps as `ClickLogGenerator`: bag lengths (Bernoulli / Poisson, by inverse CDF; or the
    config's fixed `bag_sizes`, then `cap` must hold the batch's ids and no bag is ever cut),
    ids by the Zipf inverse CDF mapped to rows by `(rank * P + shift) mod E`, the per-bag sums of the
    hidden rows (`bag_sums`), the logit and a Bernoulli label. A batch with more than `cap` ids
    (the capacity is mean + 8 standard deviations + 64) keeps its first `cap`: the bags past them are
    cut (emptied), consistently in the ids, the offsets and the labels.
    """
    cfg = config
    f, b = cfg.num_sparse, int(batch_size)
    rows = np.asarray(cfg.table_rows, np.int64)
    bits = max(int(rows.max() - 1).bit_length(), 1)
    fixed = cfg.bag_sizes is not None
    if fixed and cap < b * sum(cfg.bag_sizes):
        raise ValueError(f"cap={cap} is below the {b * sum(cfg.bag_sizes)} ids of a fixed-size batch")
    # One uniform draw for everything (each random call is another copy of the threefry hash to compile).
    sizes = (b * cfg.num_dense, 0 if fixed else f * b, cap, b)
    u = jax.random.uniform(key, (sum(sizes),), jnp.float32)
    u_dense, u_len, u_ids, u_lab = jnp.split(u, np.cumsum(sizes)[:-1])
    # Dense features: standard normal by the inverse normal CDF (u + 2**-24 is in (0, 1), symmetric).
    dense = jax.scipy.special.ndtri(u_dense + jnp.float32(2.0**-24)).reshape(b, cfg.num_dense)

    pos = jnp.arange(cap, dtype=jnp.int32)
    if fixed:
        # Fixed sizes: bag (g, j) is ids B*start[g] + j*size[g] ... + size[g] - 1 (static offsets, computed).
        size_np = np.asarray(cfg.bag_sizes, np.int64)
        start_np = np.concatenate([[0], np.cumsum(size_np)])  # [F + 1]
        max_len = tuple(int(x) for x in size_np)
        bag = jnp.arange(f * b + 1, dtype=jnp.int32)
        g = jnp.minimum(bag // b, f - 1)
        offsets = (jnp.asarray(b * start_np[:-1], jnp.int32)[g] + (bag - g * b) * jnp.asarray(size_np, jnp.int32)[g])
        valid = pos < int(b * start_np[-1])
        feat = jnp.sum(pos[:, None] >= jnp.asarray(b * start_np[1:-1], jnp.int32)[None, :], axis=1)
    else:
        # Bag lengths: a uniform per bag through the feature's length CDF.
        cdf_np = length_cdf(cfg.bag_mean)
        max_len = tuple(int(np.argmax(r >= 1.0)) for r in cdf_np)  # the longest bag of each feature
        cdf = jnp.asarray(cdf_np)
        lengths = jnp.sum(u_len.reshape(f, b)[:, :, None] >= cdf[:, None, :], axis=2, dtype=jnp.int32)
        offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.minimum(jnp.cumsum(lengths.reshape(-1)), cap)])
        # Ids: position p < offsets[-1] belongs to feature `feat` (bounds offsets[(g+1)*B]).
        valid = pos < offsets[-1]
        feat = jnp.minimum(jnp.sum(pos[:, None] >= offsets[b::b][None, :], axis=1), f - 1)
    n = jnp.asarray(rows.astype(np.float64), jnp.float32)[feat]
    if abs(cfg.alpha - 1.0) < 1e-9:
        x = jnp.exp(u_ids * jnp.asarray(np.log(rows + 1.0), jnp.float32)[feat])
    else:
        a = 1.0 - cfg.alpha
        c = jnp.asarray((rows + 1.0) ** a - 1.0, jnp.float32)[feat]
        x = jnp.exp(jnp.log1p(u_ids * c) / a)
    rank = jnp.clip(jnp.floor(x) - 1.0, 0.0, n - 1.0).astype(jnp.int32)
    rows_i = jnp.asarray(rows, jnp.int32)[feat]
    prime_mod = np.asarray([_large_prime_above(int(e)) % int(e) for e in rows], np.int64)
    ids = mulmod(rank, jnp.asarray(prime_mod, jnp.int32)[feat], rows_i, bits) + params["shift"][feat]
    ids = jnp.where(ids >= rows_i, ids - rows_i, ids)  # (rank * P + shift) mod E, shift < E
    ids = jnp.where(valid, ids, 0)

    # Hidden logit (as ClickLogGenerator._draw), then the label.
    if cfg.hidden_ranks:  # hidden rows by rank, ranks >= K none
        count_np = np.minimum(rows, cfg.hidden_ranks)
        count = jnp.asarray(count_np, jnp.int32)[feat]
        base = jnp.asarray(np.concatenate([[0], np.cumsum(count_np)[:-1]]), jnp.int32)[feat]
        vals = params["hidden_rows"][base + jnp.minimum(rank, count - 1)]
        vals = jnp.where((valid & (rank < count))[:, None], vals, 0.0)
    else:
        row_base = jnp.asarray(np.concatenate([[0], np.cumsum(rows)[:-1]]), jnp.int32)
        vals = jnp.where(valid[:, None], params["hidden_rows"][row_base[feat] + ids], 0.0)
    if fixed:  # each feature's bags are [B, size] consecutive ids
        sums = jnp.stack([vals[b * int(start_np[g]) : b * int(start_np[g + 1])].reshape(b, max_len[g], -1).sum(1)
                          for g in range(f)])
    else:
        sums = bag_sums(vals, offsets, max_len, b)  # [F, B, 1 + k]
    u_bag = sums[..., 1:]
    hi = jax.lax.Precision.HIGHEST
    raw = jnp.dot(dense, params["w_dense"], precision=hi) + sums[..., 0].sum(axis=0)
    raw = raw + jnp.sum(u_bag[params["pair_p"]] * u_bag[params["pair_q"]], axis=(0, 2))
    xv = jnp.dot(dense, params["v_dense"], precision=hi)
    raw = raw + jnp.sum(xv[None] * u_bag[params["dense_pairs"]], axis=(0, 2))
    logit = raw * params["scale"] + params["bias"]
    labels = (u_lab < jax.nn.sigmoid(logit)).astype(jnp.float32)
    return {"dense": dense, "indices": ids, "offsets": offsets, "labels": labels, "logit": logit}


@functools.partial(jax.jit, static_argnums=0)
def _draw_jit(static: _Static, params, key, i):
    return draw(static.config, params, jax.random.fold_in(key, i), static.batch_size, static.cap)


class DeviceClickLog:
    """A `ClickLogGenerator`'s hidden model on the device, and batches drawn there (see `draw`).

    Args:
      gen: the host generator (its seed, batch size, hidden model and `padded_len`).
      sharding: where to put the hidden model (default: the default device); replicated over a mesh
        (`NamedSharding(mesh, P())`) for a sharded draw.

    `batch(i, stream)` is one jitted call: batch `i` of the "train" or "eval" stream, drawn from
    `fold_in(stream_key(stream), i)`, `stream_key(s) = fold_in(key(seed), s)`. The compiled code depends
    on the data's shape (config, batch size, capacity), not on the seed: the seed's hidden model is in
    `params` (hidden rows, dense weights, interaction pairs, rank-to-row shifts, logit scale and bias).
    """

    def __init__(self, gen: ClickLogGenerator, sharding=None):
        self.config = gen.config
        self.batch_size = gen.batch_size
        self.seed = gen.seed
        self.padded_len = gen.padded_len
        pairs = np.asarray(gen.pairs, np.int32).reshape(-1, 2)
        params = {
            "hidden_rows": np.asarray(gen.hidden_rows, np.float32),
            "w_dense": np.asarray(gen.w_dense, np.float32),
            "v_dense": np.asarray(gen.v_dense, np.float32),
            "pair_p": pairs[:, 0].copy(), "pair_q": pairs[:, 1].copy(),
            "dense_pairs": np.asarray(gen.dense_pairs, np.int32),
            "shift": np.asarray(gen.shift, np.int32),
            "scale": np.float32(gen.scale), "bias": np.float32(gen.bias),
        }
        self.params = jax.device_put(params, sharding)

    def stream_key(self, stream: str = "train"):
        """The key of a stream; batch i's key is `jax.random.fold_in(stream_key, i)`."""
        return jax.random.fold_in(jax.random.key(self.seed), _STREAMS[stream])

    def batch(self, i, stream: str = "train", batch_size: int | None = None, cap: int | None = None) -> dict:
        """Batch `i` of a stream (device arrays, see `draw`), by default of the generator's batch size
        and capacity (`padded_len`)."""
        static = _Static(self.config, self.batch_size if batch_size is None else int(batch_size),
                         self.padded_len if cap is None else int(cap))
        return _draw_jit(static, self.params, self.stream_key(stream), jnp.int32(i))
