"""Pure-`jnp` reference of the TBE forward: the semantics every kernel must match.

It is also the `impl="xla"` path (the CPU default), so it is written to be
reasonably fast under XLA: one gather and one sorted segment-sum per storage
buffer. Inputs reaching these functions are already validated (see `bounds.py`):
`offsets` is non-decreasing, starts at 0 and ends at most at `len(indices)`.
Ids outside `[0, E)` contribute nothing here (the semantics of the default
`bounds_check="ignore"` and of the checked modes; with `bounds_check="none"` the
forward kernels leave such ids undefined).

The per-lookup facts these build on (each lookup's bag, feature, validity and
weight) are `tbe_jax.preprocess`'s, which the kernel path shares; they stay
importable from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.preprocess import (  # noqa: F401  (`reference.<name>` keeps working)
    bag_feature,
    bag_lengths,
    group_lookups,
    lookup_coefficients,
    output_rows,
    position_features,
    valid_lookups,
)
from tbe_jax.specs import FeaturePlan, StorageLayout


def pooled_forward(
    buffers: dict,
    layout: StorageLayout,
    plan: FeaturePlan,
    indices: jax.Array,
    offsets: jax.Array,
    per_sample_weights: jax.Array | None,
    *,
    pooling: str,
    output_dtype,
    load=None,
) -> jax.Array:
    """Pooled ("sum" or "mean") lookup; `[B, sum D]` or, with VBE, flat.

    Vectorised over features: per storage buffer one gather and one segment-sum
    into that buffer's features' pooled rows (laid out buffer-major), then one
    gather that puts every value in its place of the output. The traced program
    has a fixed number of ops per buffer, whatever the number of features.

    `load(g, rows)`: the float32 `[N, layout.dims[g]]` values of rows `rows` of
    buffer g; None: `buffers`' rows, unpadded (the quantized TBE passes its
    dequantizing gather, `kernels.quant_rows.take_rows`).
    """
    n = indices.shape[0]
    nf = plan.num_features
    bag, feat = position_features(plan, offsets, n)
    valid = valid_lookups(plan, indices, offsets, feat)
    scale = valid.astype(jnp.float32)
    if per_sample_weights is not None:  # masked: a NaN weight on padding contributes nothing
        scale = jnp.where(valid, per_sample_weights.astype(jnp.float32), 0.0)
    lengths = bag_lengths(offsets, n)  # clamped to [0, n] as the kernels do
    row_offset = jnp.asarray(np.asarray(plan.row_offset, np.int32))
    group = np.asarray(plan.group, np.int32)
    batch = np.asarray(plan.batch, np.int64)
    dims = np.asarray(plan.dim, np.int64)
    bag_base = np.asarray(plan.bag_base, np.int64)
    # Per feature: its rank among its buffer's features, the first pooled row of its
    # bags in its buffer's block, and its first value in the buffer-major output.
    rank = np.zeros(nf, np.int64)
    seg_base = np.zeros(nf, np.int64)
    major_base = np.zeros(nf, np.int64)
    blocks, offset = [], 0
    for g, d in enumerate(layout.dims):
        feats = np.flatnonzero(group == g)
        if feats.size == 0:
            continue
        rank[feats] = np.arange(feats.size)
        seg_base[feats] = np.concatenate([[0], np.cumsum(batch[feats])[:-1]])
        major_base[feats] = offset + seg_base[feats] * d
        nseg = int(batch[feats].sum())
        offset += nseg * d
        in_group = jnp.asarray(group == g)[feat]
        rows = jnp.where(valid & in_group, row_offset[feat] + indices.astype(jnp.int32), 0)
        live = (valid & in_group)[:, None]
        if load is None:
            vals = layout.unpad(g, jnp.take(buffers[layout.key(g)], rows, axis=0)).astype(jnp.float32)
        else:
            vals = load(g, rows)
        x = jnp.where(live, vals * scale[:, None], 0.0)
        local = bag - jnp.asarray(bag_base.astype(np.int32))[feat]
        seg = jnp.where(in_group, jnp.asarray(seg_base.astype(np.int32))[feat] + local, nseg)
        pooled = jax.ops.segment_sum(x, seg, num_segments=nseg)  # [nseg, d]: the buffer's bags, feature-major
        if pooling == "mean":
            # The global bag of each pooled row: feature (searchsorted over the buffer's segment bases) + bag.
            s_idx = jnp.arange(nseg, dtype=jnp.int32)
            k = jnp.searchsorted(jnp.asarray(seg_base[feats].astype(np.int32)), s_idx, side="right",
                                 method="scan_unrolled") - 1
            gbag = jnp.asarray(bag_base[feats].astype(np.int32))[k] + s_idx - jnp.asarray(
                seg_base[feats].astype(np.int32))[k]
            pooled = pooled / jnp.maximum(lengths[gbag], 1.0)[:, None]
        blocks.append(pooled.reshape(-1))
    major = jnp.concatenate(blocks) if blocks else jnp.zeros((0,), jnp.float32)
    # Where each output value sits in `major` (computed on the device from per-feature facts).
    if plan.vbe:
        p = jnp.arange(plan.out_size, dtype=jnp.int32)
        starts = jnp.asarray(np.asarray(plan.out_base, np.int32))
        f = jnp.searchsorted(starts, p, side="right", method="scan_unrolled") - 1
        src = jnp.asarray(major_base.astype(np.int32))[f] + p - starts[f]
        out = major[src] if plan.out_size else jnp.zeros((0,), jnp.float32)
    else:
        b_total = plan.batch[0] if plan.batch else 0
        width = int(dims.sum())
        c = jnp.arange(width, dtype=jnp.int32)
        col_base = jnp.asarray(np.asarray(plan.out_base, np.int32))
        f = jnp.searchsorted(col_base, c, side="right", method="scan_unrolled") - 1
        j = c - col_base[f]
        d_f = jnp.asarray(dims.astype(np.int32))[f]
        # value (b, c) sits at major_base[f] + b * D_f + j (a feature's block is [B, D_f], row-major)
        src = (jnp.asarray(major_base.astype(np.int32))[f] + j)[None, :] + jnp.arange(b_total, dtype=jnp.int32)[
            :, None] * d_f[None, :]
        out = major[src] if b_total and width else jnp.zeros((b_total, width), jnp.float32)
    return out.astype(output_dtype)


def sequence_forward(
    buffers: dict,
    layout: StorageLayout,
    plan: FeaturePlan,
    indices: jax.Array,
    offsets: jax.Array,
    per_sample_weights: jax.Array | None,
    *,
    output_dtype,
) -> jax.Array:
    """`pooling="none"`: one row per index, `[len(indices), D]` (all tables one D; one buffer per location)."""
    n = indices.shape[0]
    _, feat = position_features(plan, offsets, n)
    valid = valid_lookups(plan, indices, offsets, feat)
    row_offset = jnp.asarray(np.asarray(plan.row_offset, np.int32))
    rows = jnp.where(valid, row_offset[feat] + indices.astype(jnp.int32), 0)
    group = jnp.asarray(np.asarray(plan.group, np.int32))[feat]
    x = jnp.zeros((n, layout.dims[0]), jnp.float32)
    for g in range(len(layout.dims)):
        vals = layout.unpad(g, jnp.take(buffers[layout.key(g)], rows, axis=0, mode="clip")).astype(jnp.float32)
        x = jnp.where((group == g)[:, None], vals, x)
    scale = valid.astype(jnp.float32)
    if per_sample_weights is not None:
        scale = jnp.where(valid, per_sample_weights.astype(jnp.float32), 0.0)
    return jnp.where(valid[:, None], x * scale[:, None], 0.0).astype(output_dtype)


def pooled_backward(
    buffers: dict,
    layout: StorageLayout,
    plan: FeaturePlan,
    indices: jax.Array,
    offsets: jax.Array,
    per_sample_weights: jax.Array | None,
    g_out: jax.Array,
    *,
    pooling: str,
    keep_fp32: bool = False,
):
    """VJP of `pooled_forward` (or, with pooling="none", of `sequence_forward`).

    Returns `(d_buffers, d_per_sample_weights)`: the dense table gradient
    `dW[row] = sum over the row's lookups of scale * g[bag, feature's columns]`
    (scale: the per-sample weight, and 1/len for mean pooling), accumulated in fp32
    and cast to each buffer's dtype; and `d w_p = scale_p/w_p * <W[row_p], g[bag_p]>`.
    With `keep_fp32`, returns `(fp32 d_buffers, per-buffer [R] "row was looked up" masks)`.
    """
    bag, feat, coef, scale = lookup_coefficients(plan, indices, offsets, per_sample_weights, pooling)
    valid = coef > 0  # coef is 1 or 1/len(bag) for valid lookups, 0 otherwise
    d_buffers, touched = {}, {}
    for g, m, grad_rows, rows in group_lookups(layout, plan, indices, bag, feat, valid, g_out, pooling):
        key = layout.key(g)
        w = buffers[key]
        contrib = jnp.where(m[:, None], grad_rows * scale[:, None], 0.0)
        d_buffers[key] = jnp.zeros(w.shape, jnp.float32).at[rows].add(layout.pad(g, contrib))
        touched[key] = jnp.zeros((w.shape[0],), jnp.int32).at[rows].add(m.astype(jnp.int32)) > 0
    if keep_fp32:
        return d_buffers, touched
    d_buffers = {k: v.astype(buffers[k].dtype) for k, v in d_buffers.items()}
    if per_sample_weights is None:
        return d_buffers, None
    return d_buffers, per_sample_weight_grad(buffers, layout, plan, indices, offsets, per_sample_weights, g_out,
                                             pooling=pooling)


def per_sample_weight_grad(buffers, layout, plan, indices, offsets, per_sample_weights, g_out, *, pooling: str):
    """`d w_p = coef_p * <W[row_p], g[bag_p, feature's columns]>` (the second half of `pooled_backward`).

    Work proportional to the batch, not the tables.
    """
    bag, feat, coef, _ = lookup_coefficients(plan, indices, offsets, per_sample_weights, pooling)
    d_psw = jnp.zeros((indices.shape[0],), jnp.float32)
    for g, _, grad_rows, rows in group_lookups(layout, plan, indices, bag, feat, coef > 0, g_out, pooling):
        x = layout.unpad(g, jnp.take(buffers[layout.key(g)], rows, axis=0)).astype(jnp.float32)
        d_psw = d_psw + jnp.where(coef > 0, jnp.sum(x * grad_rows, axis=1) * coef, 0.0)
    return d_psw


def apply_gradients(buffers, slots, layout, plan, indices, offsets, per_sample_weights, g_out, rule, hyper, *,
                    pooling: str):
    """Reference fused update: `rule` (a `tbe_jax.optim.KernelRule`) applied once to every row looked up.

    `slots`: the optimizer state's slots (`Optimizer.slots(state)`: a tuple of dicts
    shaped like `buffers`, empty for SGD); `hyper`: the step's
    `Optimizer.hyperparameters` (fp32). Dense (work proportional to the tables): the
    semantics the kernels must match. Returns (buffers, slots) with untouched rows
    and their state bitwise unchanged; with `rule.skip_nonfinite`, rows whose
    gradient is not finite are unchanged too.
    """
    from tbe_jax.optim import apply_rule
    from tbe_jax.rounding import stochastic_round

    grads, touched = pooled_backward(buffers, layout, plan, indices, offsets, per_sample_weights, g_out,
                                     pooling=pooling, keep_fp32=True)
    slots = tuple(slots or ())
    new_w, new_s = {}, tuple({} for _ in slots)
    for gi in range(len(layout.dims)):
        key = layout.key(gi)
        w = buffers[key]
        g = grads[key]
        hit = touched[key]
        if rule.skip_nonfinite:
            hit = hit & jnp.all(jnp.isfinite(g), axis=1)
        old = tuple(s[key] for s in slots)

        def values(x):  # a padded buffer's padding columns read as zeros, as the kernels' masked loads give
            x = x.astype(jnp.float32)
            if x.ndim == 1 or layout.strides[gi] == layout.dims[gi]:
                return x
            return jnp.where(jnp.arange(x.shape[1]) < layout.dims[gi], x, 0.0)

        upd, new, salts = apply_rule(rule, values(w), tuple(values(x) for x in old), g, hyper, dim=layout.dims[gi])
        for out, x, o in zip(new_s, new, old):
            out[key] = jnp.where(hit.reshape(hit.shape + (1,) * (o.ndim - 1)), x.astype(o.dtype), o)
        if rule.stochastic_rounding and w.dtype in (jnp.float16, jnp.bfloat16):
            rows = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0)
            cols = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
            upd = stochastic_round(upd, w.dtype, rows, cols, *salts)
        new_w[key] = jnp.where(hit[:, None], upd.astype(w.dtype), w)
    return new_w, new_s
