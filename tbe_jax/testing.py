"""Workloads and a float64 NumPy model, shared by tests, benchmarks and the demo.

Workloads follow the anchors' recipe (FBGEMM's benchmark knobs): `T` tables of
`E` rows and dim `D`, batch `B`, bag size `L`; ids uniform when `alpha <= 1`,
else Zipf(alpha) ranks mapped through a fixed random permutation of the rows;
per-sample weights uniform in [0.5, 1.5).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    T: int
    E: int
    D: int
    B: int
    L: int
    alpha: float = 1.0
    weighted: bool = False
    weights_dtype: str = "float16"
    output_dtype: str = "float32"
    # Extra (count, E, D, L) table groups after the T uniform ones (mixed workloads).
    extra: tuple = ()
    # Mixed dims (FBGEMM's --mixed): the T uniform tables take these dims round-robin instead of D.
    dims: tuple = ()

    def features(self) -> list[tuple[int, int, int]]:
        """Per feature (one table each): (E, D, L)."""
        dims = self.dims or (self.D,)
        out = [(self.E, dims[t % len(dims)], self.L) for t in range(self.T)]
        for count, e, d, l in self.extra:
            out += [(e, d, l)] * count
        return out

    def bytes_moved(self) -> int:
        """FBGEMM's forward bandwidth formula: output writes plus row reads."""
        wbytes = 4 if self.weights_dtype == "float32" else 2
        return sum(4 * self.B * d + wbytes * self.B * d * l for _, d, l in self.features())


# The six reference workloads FBGEMM was measured on (benchmarks/ANCHORS.md).
PRESETS = {
    "base": Workload("base", 32, 100_000, 128, 4096, 20, 1.0),
    "zipf": Workload("zipf", 32, 100_000, 128, 4096, 20, 1.15),
    "weighted": Workload("weighted", 32, 100_000, 128, 4096, 20, 1.15, weighted=True),
    "large": Workload("large", 8, 4_000_000, 128, 65536, 20, 1.0),
    "fp32": Workload("fp32", 32, 100_000, 128, 4096, 20, 1.15, weights_dtype="float32"),
    "smalltable": Workload("smalltable", 1, 64, 128, 65536, 128, 1.0),
    # Not an anchor: the smalltable feature among the 32 base tables (one batch size).
    "mixed": Workload("mixed", 32, 100_000, 128, 4096, 20, 1.0, extra=((1, 64, 128, 128),)),
}


def many_tables(num_tables: int, num_dims: int = 24, batch: int = 2048, alpha: float = 1.0, seed: int = 0,
                name: str | None = None) -> Workload:
    """A model of `num_tables` features (one table each) over `num_dims` distinct dims, drawn once from `seed`:
    the dims are distinct multiples of 4 in [4, 256], each table takes one of them at random (every dim at least
    once), rows log-uniform in [1e3, 1e6], a fixed bag size per feature uniform in [1, 40]. Not an anchor: a shape
    kept apart from the presets (hundreds of tables, tens of dims, tables small enough to repeat rows)."""
    rng = np.random.default_rng(seed)
    dims = rng.choice(np.arange(4, 257, 4), size=num_dims, replace=False)
    pick = np.concatenate([np.arange(num_dims), rng.integers(0, num_dims, max(num_tables - num_dims, 0))])
    pick = rng.permutation(pick[:num_tables])
    rows = np.exp(rng.uniform(np.log(1e3), np.log(1e6), num_tables)).astype(np.int64)
    lens = rng.integers(1, 41, num_tables)
    extra = tuple((1, int(e), int(dims[k]), int(l)) for e, k, l in zip(rows, pick, lens))
    return Workload(name or f"many{num_tables}x{num_dims}", 0, 0, 0, batch, 0, alpha, extra=extra)


def workload(name: str) -> Workload:
    """A workload by name: a preset of PRESETS; "dims<lo>-<hi>/<step>": `base` with its 32 tables cycling through
    the dims lo, lo + step, ..., hi; "many<T>x<dims>[z]" (optionally "@<seed>"): `many_tables(T, dims)`, with
    Zipf(1.15) ids if it ends in "z"."""
    if name.startswith("dims"):
        span, step = name[4:].split("/")
        lo, hi = map(int, span.split("-"))
        return dataclasses.replace(PRESETS["base"], name=name, dims=tuple(range(lo, hi + 1, int(step))))
    if name.startswith("many"):
        spec, _, seed = name[4:].partition("@")
        zipf = spec.endswith("z")
        t, d = map(int, spec.rstrip("z").split("x"))
        return many_tables(t, d, alpha=1.15 if zipf else 1.0, seed=int(seed or 0), name=name)
    return PRESETS[name]


def sample_ids(rng: np.random.Generator, num_rows: int, n: int, alpha: float, perm=None) -> np.ndarray:
    """`n` ids in `[0, num_rows)`: uniform for alpha <= 1, else permuted Zipf ranks."""
    if alpha <= 1.0:
        return rng.integers(0, num_rows, size=n, dtype=np.int64).astype(np.int32)
    ranks = np.arange(1, num_rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** (-alpha))
    cdf /= cdf[-1]
    r = np.minimum(np.searchsorted(cdf, rng.random(n)), num_rows - 1)
    if perm is None:
        perm = np.random.default_rng(num_rows).permutation(num_rows)
    return perm[r].astype(np.int32)


def make_batch(
    rng: np.random.Generator,
    num_rows: Sequence[int],  # per feature: E of its table
    batch: Sequence[int],  # per feature: B_f
    bag_len,  # int (fixed L), (lo, hi) for uniform lengths in [lo, hi], or a list per feature
    *,
    alpha: float = 1.0,
    weighted: bool = False,
    perms: Sequence[np.ndarray] | None = None,
    pad_to: int | None = None,
):
    """FBGEMM-format inputs: (indices int32 [N], offsets int32 [sum B_f + 1], weights or None).

    `pad_to`: append id 0 (weight 0) past `offsets[-1]` up to that length, so batches of different total
    lengths share one shape (one compilation under `jit`); the padding is not part of any bag.
    """
    lengths, ids = [], []
    for f, (e, b) in enumerate(zip(num_rows, batch)):
        bl = bag_len[f] if isinstance(bag_len, list) else bag_len
        if isinstance(bl, tuple):
            ln = rng.integers(bl[0], bl[1] + 1, size=b)
        else:
            ln = np.full(b, bl)
        lengths.append(ln)
        ids.append(sample_ids(rng, e, int(ln.sum()), alpha, None if perms is None else perms[f]))
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    indices = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
    psw = rng.uniform(0.5, 1.5, size=indices.shape).astype(np.float32) if weighted else None
    if pad_to is not None:
        if pad_to < len(indices):
            raise ValueError(f"pad_to={pad_to} is below the batch's {len(indices)} ids")
        indices = np.pad(indices, (0, pad_to - len(indices)))
        psw = None if psw is None else np.pad(psw, (0, pad_to - len(psw)))
    return indices, offsets, psw


def numpy_pooled(
    tables: Sequence[np.ndarray],
    feature_table_map: Sequence[int],
    batch: Sequence[int],
    indices: np.ndarray,
    offsets: np.ndarray,
    per_sample_weights: np.ndarray | None,
    pooling: str,
    vbe: bool,
) -> np.ndarray:
    """Float64 model of the pooled forward (ids outside [0, E) contribute nothing)."""
    indices = np.asarray(indices, np.int64)
    offsets = np.asarray(offsets, np.int64)
    bag_of_pos = np.searchsorted(offsets, np.arange(len(indices)), side="right") - 1
    scale = np.ones(len(indices)) if per_sample_weights is None else np.asarray(
        per_sample_weights, np.float32).astype(np.float64)
    blocks = []
    base = 0
    for f, t in enumerate(feature_table_map):
        w = np.asarray(tables[t], np.float64)
        lo, hi = offsets[base], offsets[base + batch[f]]
        pos = np.arange(lo, hi)
        ids = indices[pos]
        ok = (ids >= 0) & (ids < w.shape[0])
        pos, ids = pos[ok], ids[ok]
        out = np.zeros((batch[f], w.shape[1]), np.float64)
        np.add.at(out, bag_of_pos[pos] - base, scale[pos, None] * w[ids])
        if pooling == "mean":
            lengths = np.diff(offsets[base : base + batch[f] + 1])
            out /= np.maximum(lengths, 1)[:, None]
        blocks.append(out)
        base += batch[f]
    if vbe:
        return np.concatenate([b.reshape(-1) for b in blocks])
    return np.concatenate(blocks, axis=1)


def numpy_pooled_vjp(
    tables: Sequence[np.ndarray],
    feature_table_map: Sequence[int],
    batch: Sequence[int],
    indices: np.ndarray,
    offsets: np.ndarray,
    per_sample_weights: np.ndarray | None,
    g_out: np.ndarray,
    pooling: str,
    vbe: bool,
):
    """Float64 model of the pooled VJP: (per-table dW, d per_sample_weights)."""
    tables = [np.asarray(t, np.float64) for t in tables]
    d_tables = [np.zeros_like(t) for t in tables]
    d_psw = np.zeros(len(indices))
    g = np.asarray(g_out, np.float64)
    dims = [tables[t].shape[1] for t in feature_table_map]
    if vbe:
        sizes = np.cumsum([0] + [b * d for b, d in zip(batch, dims)])
        blocks = [g.reshape(-1)[sizes[f] : sizes[f + 1]].reshape(batch[f], dims[f]) for f in range(len(dims))]
    else:
        cols = np.cumsum([0] + dims)
        blocks = [g[:, cols[f] : cols[f + 1]] for f in range(len(dims))]
    bag = 0
    for f, t in enumerate(feature_table_map):
        for b in range(batch[f]):
            lo, hi = int(offsets[bag]), int(offsets[bag + 1])
            bag += 1
            coef = 1.0 / (hi - lo) if pooling == "mean" and hi > lo else 1.0
            for p in range(lo, hi):
                i = int(indices[p])
                if not 0 <= i < tables[t].shape[0]:
                    continue
                s = 1.0 if per_sample_weights is None else float(per_sample_weights[p])
                d_tables[t][i] += coef * s * blocks[f][b]
                d_psw[p] = coef * float(tables[t][i] @ blocks[f][b])
    return d_tables, d_psw


def stack_batches(indices, offsets, weights=None, *, num_features: int, pad_to: int | None = None):
    """Per-device batches (`indices [n, N]`, `offsets [n, F*b+1]`, the sharded input format) as one batch in
    the unsharded format: feature f's bags of device 0, then of device 1, ... (device k's sample i is global
    sample `k*b + i`). Returns `(ids, offsets, weights or None, where)`, `where[p] = (k, local position)` of
    global id p; `pad_to` pads ids and weights with zeros to that length."""
    indices, offsets = np.asarray(indices), np.asarray(offsets)
    n = indices.shape[0]
    b = (offsets.shape[1] - 1) // num_features
    gi, go, gw, where = [], [0], [], []
    for f in range(num_features):
        for k in range(n):
            for i in range(b):
                a, z = int(offsets[k, f * b + i]), int(offsets[k, f * b + i + 1])
                gi += list(indices[k, a:z])
                if weights is not None:
                    gw += list(np.asarray(weights)[k, a:z])
                where += [(k, p) for p in range(a, z)]
                go.append(len(gi))
    pad = 0 if pad_to is None else pad_to - len(gi)
    ids = np.array(gi + [0] * pad, np.int32)
    w = None if weights is None else np.array(gw + [0] * pad, np.float32)
    return ids, np.array(go, np.int32), w, where


def jaxpr_eqns(jaxpr):
    """Every equation of `jaxpr`, those of nested jaxprs (jit, custom_vjp, shard_map, cond, while and pallas bodies)
    included: for structural checks of a traced program (its launches, its collectives)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)
