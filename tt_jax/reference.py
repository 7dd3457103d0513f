"""Pure-jnp TT embedding bag: the semantics the FlowTT kernels must match.

Per lookup (TT-Rec style "per-index chain"): split the row id into mixed-radix
digits, gather one slice of each core and contract the chain; then pool the
rows into bags exactly as `tbe_jax` does (sum or mean, per-sample weights,
FBGEMM's feature-major offsets). Also the `impl="xla"` path of `TTEmbeddingBag`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.preprocess import bag_lengths


def digits(ids: jax.Array, p_shapes) -> list[jax.Array]:
    """Mixed-radix digits of `ids`, first (most significant) first."""
    out = []
    rest = ids
    for p in reversed(p_shapes):
        out.append(rest % p)
        rest = rest // p
    return out[::-1]


def rows(cores, p_shapes, ids: jax.Array) -> jax.Array:
    """`[len(ids), D]` materialised rows for ids (must be valid)."""
    ds = digits(ids, p_shapes)
    acc = cores[0][ds[0]][:, 0]  # [n, q1, r1]
    for t in range(1, len(cores)):
        g = cores[t][ds[t]]  # [n, r, q, r']
        acc = jnp.einsum("nar,nrbs->nabs", acc, g, precision=jax.lax.Precision.HIGHEST)
        acc = acc.reshape(acc.shape[0], -1, acc.shape[-1])
    return acc[..., 0]


FULL_TABLE_WORKSPACE = 256 << 20  # bytes of intermediates `full_table` may hold at once


def row_workspace_bytes(spec) -> int:
    """fp32 bytes of `rows`' intermediates per row (the largest stage: the chain so far and one core slice)."""
    r, q = spec.full_ranks, spec.q_shapes
    worst, cols = 0, 1
    for t in range(spec.num_cores):
        slice_ = r[t] * q[t] * r[t + 1]
        cols *= q[t]
        worst = max(worst, cols * r[t + 1] + slice_ + (cols // q[t]) * r[t])
    return 4 * worst


def full_table(cores, spec, workspace_bytes: int = FULL_TABLE_WORKSPACE) -> jax.Array:
    """The `[N, D]` table, materialised in row chunks so the intermediates stay within `workspace_bytes`
    (the output itself is N x D): a 10M-row table does not need the chain's `[N, r, q, r']` at once."""
    n = spec.num_embeddings
    chunk = max(1, int(workspace_bytes) // row_workspace_bytes(spec))
    if chunk >= n:
        return rows(cores, spec.p_shapes, jnp.arange(n, dtype=jnp.int32))
    steps = -(-n // chunk)
    out = jnp.zeros((n, spec.embedding_dim), jnp.result_type(*cores))

    def body(i, out):
        start = jnp.minimum(i * chunk, n - chunk)  # the last chunk overlaps the one before: same values
        ids = start + jnp.arange(chunk, dtype=jnp.int32)
        return jax.lax.dynamic_update_slice(out, rows(cores, spec.p_shapes, ids).astype(out.dtype), (start, 0))

    return jax.lax.fori_loop(0, steps, body, out)


def pooled(all_cores, specs, indices, offsets, per_sample_weights, *, pooling: str, batch: int):
    """`[B, sum D]` pooled TT lookups; feature f reads table f; invalid ids contribute nothing."""
    n = indices.shape[0]
    nf = len(specs)
    pos = jnp.arange(n, dtype=jnp.int32)
    bag = jnp.clip(jnp.searchsorted(offsets, pos, side="right").astype(jnp.int32) - 1, 0, nf * batch - 1)
    feat = bag // batch
    in_bag = (pos >= offsets[0]) & (pos < offsets[-1])
    lengths = bag_lengths(offsets, n)  # clamped to [0, n] as the kernels do
    scale = in_bag.astype(jnp.float32)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights.astype(jnp.float32)
    if pooling == "mean":
        scale = scale / jnp.maximum(lengths, 1.0)[bag]
    blocks = []
    for f, (spec, cores) in enumerate(zip(specs, all_cores)):
        ok = in_bag & (feat == f) & (indices >= 0) & (indices < spec.num_embeddings)
        x = rows(cores, spec.p_shapes, jnp.where(ok, indices, 0)) * jnp.where(ok, scale, 0.0)[:, None]
        pooled_f = jax.ops.segment_sum(x, bag, num_segments=nf * batch, indices_are_sorted=True)
        blocks.append(pooled_f[f * batch : (f + 1) * batch])
    return jnp.concatenate(blocks, axis=1)


def numpy_rows(cores, spec) -> np.ndarray:
    """Float64 NumPy model of the full table, straight from the TT formula."""
    cores = [np.asarray(c, np.float64) for c in cores]
    out = np.zeros((spec.num_embeddings, spec.embedding_dim))
    for i in range(spec.num_embeddings):
        ds = [int(d) for d in digits(np.int64(i), spec.p_shapes)]
        acc = cores[0][ds[0]][0]  # [q1, r1]
        for t in range(1, len(cores)):
            acc = np.einsum("ar,rbs->abs", acc, cores[t][ds[t]]).reshape(-1, cores[t].shape[-1])
        out[i] = acc[:, 0]
    return out
