"""`tt_pool`: bag-parallel pooling of a table group's distinct rows (the `tt_pool` launch).

A program owns `pool_bags` bags of one feature and gathers one row per bag per step through the lookup ->
distinct-row map (`inverse`); per-sample weights, mean as a scale. It writes its feature's columns of the
`[B, sum D]` output in place, so table groups chain through input/output aliasing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.kernels.programs import bag_extent
from tbe_jax.specs import next_pow2
from tt_jax.kernels.config import TTForwardConfig
from tt_jax.kernels.tiles import INT32_MAX, masked_store

# Columns of the pooling kernel's per-feature table: the feature's index, its first output column.
_FEAT_COLS = 2


def _pool_kernel(feat_ref, offsets_ref, inverse_ref, *refs, weighted, bags, progs_per_feature, batch, dim,
                 block_dim, unroll, mean, out_stride, wide, interpret):
    # inputs: per-feature table [Fg * 2], offsets [F*B+1], inverse [N], (psw [N]), rows [cap * D],
    #         (previous output, aliased); output: out [B * sum D]
    psw_ref = refs[0] if weighted else None
    rows_ref = refs[int(weighted)]
    out_ref = refs[-1]
    adt = jnp.int64 if wide else jnp.int32
    pid = pl.program_id(0)
    k = pid // progs_per_feature  # programs are feature-major, `bags` consecutive bags each
    b0 = (pid - k * progs_per_feature) * bags
    f = plgpu.load(feat_ref.at[_FEAT_COLS * k])
    col0 = plgpu.load(feat_ref.at[_FEAT_COLS * k + 1])
    first = f * batch + b0
    g = jnp.arange(bags, dtype=jnp.int32)
    bag_ok = b0 + g < batch
    start, length, _ = bag_extent(offsets_ref, first + g, bag_ok, inverse_ref.shape[0])
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    col_ok = cols < dim

    def body(it, acc):
        for u in range(unroll):
            k = it * unroll + u
            live = k < length
            row = plgpu.load(inverse_ref.at[start + k], mask=live, other=-1)
            ok = (row >= 0)[:, None] & col_ok[None, :]
            x = plgpu.load(rows_ref.at[(row.astype(adt) * dim)[:, None] + cols[None, :]], mask=ok, other=0.0)
            if psw_ref is not None:
                x = x * plgpu.load(psw_ref.at[start + k], mask=live, other=0.0)[:, None]
            acc = acc + x
        return acc

    n_iter = (jnp.max(length) + unroll - 1) // unroll
    acc = jax.lax.fori_loop(0, n_iter, body, jnp.zeros((bags, block_dim), jnp.float32))
    if mean:
        acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
    ptr = ((b0 + g).astype(adt) * out_stride + col0)[:, None] + cols[None, :]
    masked_store(out_ref, ptr, acc, bag_ok[:, None] & col_ok[None, :], interpret)


def tt_pool(
    rows: jax.Array,  # [cap * D] distinct rows of one table group
    inverse: jax.Array,  # [N] int32
    offsets: jax.Array,  # [F * B + 1] int32
    per_sample_weights: jax.Array | None,
    previous: jax.Array | None,  # [B * sum D] output of the previous group (updated in place), or None
    *,
    features: tuple[int, ...],
    col0: tuple[int, ...],  # per feature (all F), its first output column
    dim: int,
    batch: int,
    total_dim: int,
    pooling: str,
    config: TTForwardConfig,
    interpret: bool,
) -> jax.Array:
    """Writes the `features`' columns of the flat `[B * total_dim]` pooled output."""
    wide = config.force_int64_addressing or max(batch * total_dim, rows.shape[0]) >= INT32_MAX
    bags = max(1, min(config.pool_bags, next_pow2(batch)))
    per_feature = -(-batch // bags)
    feat = jnp.asarray(np.asarray([(f, col0[f]) for f in features], np.int32).reshape(-1))
    weighted = per_sample_weights is not None
    kernel = functools.partial(
        _pool_kernel, weighted=weighted, bags=bags, progs_per_feature=per_feature, batch=batch, dim=dim,
        block_dim=next_pow2(dim), unroll=config.pool_unroll, mean=pooling == "mean", out_stride=total_dim,
        wide=wide, interpret=interpret,
    )
    args = [feat, offsets, inverse] + ([per_sample_weights] if weighted else []) + [rows]
    aliases = {}
    if previous is not None:
        aliases = {len(args): 0}
        args.append(previous)
    call = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch * total_dim,), jnp.float32),
        grid=(len(features) * per_feature,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.pool_warps, num_stages=1),
        interpret=interpret,
        name="tt_pool",
    )
    with jax.enable_x64(wide):
        return call(*args)
