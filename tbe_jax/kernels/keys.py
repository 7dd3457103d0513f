"""Per-lookup sort keys and output offsets of the sorted-run backward, in one Pallas pass over the lookups.

`runs.lookup_keys` gives each lookup p its linear key (its row in the key space, or `total` when invalid), the flat
offset of its bag's pooled output row, and its scale. In XLA ops (a histogram of the offsets, its prefix sum for
each lookup's bag, the keys and offsets) that took ~0.045 ms in seven kernels for the 2.6M lookups of the `base`
preset on the H200 (`benchmarks/results/archive/keys18-backward-20261201-2303`). Here each program takes `block`
consecutive positions (`BackwardConfig.keys_block`), finds their bags by binary search in `offsets`, then their
features (a division for one batch size, else a search in the features' first bags), and writes the key, the offset
and the scale. The search has two levels: a two-lane search over all offsets for the block's first and last
positions, then each lane's search between those two counts (a few steps: a block spans few bags). One level, every
lane searching all offsets (~18 dependent steps on the whole block's registers), took 0.044 ms; two levels take
0.026 ms, and the backward step went 0.743 -> 0.725 ms on `base`, 0.547 -> 0.530 on `zipf`
(`keys18b-backward-20261201-2321`).

The bags follow the histogram form's definition (`preprocess.position_features`: `searchsorted(offsets, p,
"right") - 1`, clipped to the bags); the two agree on every partition of the positions, that is on non-decreasing
offsets (`bounds_check="warning"` repairs other offsets; with "ignore" they are undefined input).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.kernels.programs import const


def _count_le(ref, x, lo, hi, steps):
    """Per lane, #{k : ref[k] <= x} for a non-decreasing `ref`, known to lie in [lo, hi] (a binary search of
    `steps` >= bit_length(hi - lo) halvings; lanes that have converged load nothing)."""
    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        live = lo < hi
        le = plgpu.load(ref.at[mid], mask=live, other=0) <= x
        return jnp.where(live & le, mid + 1, lo), jnp.where(live & ~le, mid, hi)

    # A loop, not unrolled: the kernel's text (in the HLO) then does not grow with the batch size.
    return jax.lax.fori_loop(0, steps, step, (lo, hi))[0]


def _bit_length(x):
    """bit_length of a non-negative int32 scalar (0 for 0)."""
    return jnp.sum((x >> jnp.arange(32, dtype=jnp.int32)) > 0).astype(jnp.int32)


def _keys_kernel(idx_ref, off_ref, feat_ref, first_bag_ref, *refs, n, num_bags, num_features, batch, total,
                 sequence_stride, mean, weighted, block):
    # feat_ref: [5, F] int32 rows: key of row 0, rows, output base, output stride, first bag
    w_ref = refs[0] if weighted else None
    key_ref, src_ref, *scale_ref = refs[1:] if weighted else refs
    p = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    live = p < n
    idx = plgpu.load(idx_ref.at[p], mask=live, other=-1)
    # Each position's count of offsets <= p, in two levels: the counts of the block's first and last positions
    # (a two-lane search over all offsets), then every lane's search between them (a few steps: the block spans
    # few bags), so the long dependent chain runs on two lanes and not on the whole block's registers.
    ends = jnp.minimum(pl.program_id(0) * block + jnp.arange(2, dtype=jnp.int32) * (block - 1), n - 1)
    zeros, size = jnp.zeros((2,), jnp.int32), jnp.full((2,), num_bags + 1, jnp.int32)
    c = _count_le(off_ref, ends, zeros, size, int(num_bags + 1).bit_length())
    c_lo, c_hi = jnp.min(c), jnp.max(c)  # the block's first and last positions' counts
    lo = jnp.full(p.shape, c_lo, jnp.int32)
    count = _count_le(off_ref, p, lo, jnp.full(p.shape, c_hi, jnp.int32), _bit_length(c_hi - c_lo))
    bag = jnp.clip(count - 1, 0, max(num_bags - 1, 0))
    if batch:  # one batch size: a division
        feat = jnp.minimum(bag // batch, num_features - 1)
    else:  # the features whose first bag is <= bag, less one
        feat = _count_le(first_bag_ref, bag, jnp.zeros_like(bag), jnp.full(bag.shape, num_features, jnp.int32),
                         int(num_features).bit_length())
        feat = jnp.maximum(feat - 1, 0)

    def per_feature(row):
        return plgpu.load(feat_ref.at[row * num_features + feat])

    first = plgpu.load(off_ref.at[jnp.int32(0)])
    last = plgpu.load(off_ref.at[jnp.int32(num_bags)])
    valid = live & (p >= first) & (p < last) & (idx >= 0) & (idx < per_feature(1))
    plgpu.store(key_ref.at[p], jnp.where(valid, per_feature(0) + idx, total).astype(key_ref.dtype), mask=live)
    if sequence_stride:
        src = p * sequence_stride
    else:
        src = per_feature(2) + (bag - per_feature(4)) * per_feature(3)
    plgpu.store(src_ref.at[p], src, mask=live)
    if scale_ref:
        scale = valid.astype(jnp.float32)
        if mean:  # 1 over the bag's length clamped to [0, n], as kernels.programs.bag_extent (the forward) clamps
            start = jnp.clip(plgpu.load(off_ref.at[bag], mask=live, other=0), 0, n)
            end = jnp.clip(plgpu.load(off_ref.at[bag + 1], mask=live, other=1), start, n)
            scale = scale / jnp.maximum(end - start, 1).astype(jnp.float32)
        if weighted:
            scale = scale * plgpu.load(w_ref.at[p], mask=live, other=0.0)
        plgpu.store(scale_ref[0].at[p], scale, mask=live)


def lookup_keys(feature_table: np.ndarray, first_bags: np.ndarray, indices, offsets, per_sample_weights, *,
                batch: int, total: int, sequence_stride: int, mean: bool, want_scale: bool, interpret: bool,
                block: int, key_dtype=jnp.int32):
    """(key, src, scale or None) per lookup, as `runs.lookup_keys` defines them.

    `feature_table`: [5, F] int32 per feature: key of its table's row 0, its rows (0: no valid lookup), its
    output base, its output stride, its first bag; `first_bags`: [F] its first bags (ascending), read when
    `batch` is 0 (several batch sizes); `sequence_stride`: for sequence lookups (`pooling="none"`) the output
    row of position p is `p * sequence_stride`. `block`: positions per program (a power of 2). `key_dtype`: the
    keys' dtype (an unsigned one holds `total`)."""
    n = indices.shape[0]
    num_bags = offsets.shape[0] - 1
    num_features = feature_table.shape[1]
    weighted = per_sample_weights is not None
    outs = [jax.ShapeDtypeStruct((n,), key_dtype), jax.ShapeDtypeStruct((n,), jnp.int32)] + [jax.ShapeDtypeStruct((n,), jnp.float32)] * want_scale
    args = [indices, offsets, const(feature_table), const(first_bags)]
    if weighted:
        args.append(per_sample_weights.astype(jnp.float32))
    res = pallas_call(
        functools.partial(_keys_kernel, n=n, num_bags=num_bags, num_features=num_features, batch=batch, total=total,
                          sequence_stride=sequence_stride, mean=mean, weighted=weighted, block=block),
        out_shape=outs, grid=(pl.cdiv(n, block),),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="tbe_lookup_keys",
    )(*args)
    return res[0], res[1], (res[2] if want_scale else None)
