"""Small-table backward: a histogram feature's table gradient as `counts^T @ dout`.

For a feature that takes the histogram forward (see `histogram`), the gradient of
its table is `grad[e, :] = sum_b counts[b, e] * dout[b, :]` (times 1/len for
mean pooling), where `counts[b, e]` is how often row e occurs in bag b. Two
kernels per table, no sort:

1. `tbe_histogram_grad`: program p takes a contiguous range of `bags`-bag tiles
   of the table's features. Per tile it counts the bag's ids on tensor cores
   exactly as the forward does (`counts^T += one-hot^T @ S^T`, in rounds of 256
   ids per bag so every count is <= 256), splits the tile's fp32 output gradient
   into three bf16 parts `hi + mid + lo` (exactly: 3 x 8 significand bits cover
   fp32's 24; bf16 keeps fp32's exponent range) and adds
   `counts^T @ hi + counts^T @ mid + counts^T @ lo` to an fp32 `[E, D]`
   accumulator: each product of a count (<= 256, exact in bf16) and a part is
   exact, so the result is the fp32 sum up to fp32 rounding. It also sums the
   counts into per-row occurrence counts. One fp32 `[E, D]` partial and one
   `[E]` occurrence vector per program go to a workspace.
2. `tbe_histogram_update`: one program per row sums the partials (and the
   occurrence counts) in program order, then applies the optimizer to the row
   if it occurred in the batch (occurrences > 0, not gradient != 0), in place;
   rows that did not occur are never written. With `opt=None` it stores the
   row's gradient instead (the dense `jax.grad` path, into a zero buffer).

The summation order is fixed by the static schedule, so results are bitwise
reproducible run to run (for one `HistogramConfig`).

Bytes for the smalltable preset (B=65536, L=128, E=64, D=128): ids 33.5 MB and
the output gradient 33.5 MB read once, offsets 0.26 MB; partials 528 x 64 x 128
x 4 B = 8.7 MB at the default 264 programs, written and read once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import pl, plgpu
from tbe_jax.kernels.backward import _row_update, _state_refs
from tbe_jax.kernels import programs
from tbe_jax.kernels.programs import META_COLS, OUT_BASE, OUT_STRIDE, feature_table
from tbe_jax.kernels.histogram import HEAD, HistogramConfig, count_ids, rows_padded, tile_positions
from tbe_jax.specs import FeaturePlan, StorageLayout, next_pow2


def split3(x):
    """fp32 `x` as bf16 `(hi, mid, lo)` with `hi + mid + lo == x` exactly (normal range)."""
    hi = x.astype(jnp.bfloat16)
    r = x - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    lo = (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


def _grad_kernel(flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, g_ref,  # inputs
                 part_ref, occ_ref,  # outputs: [programs * rows * block_dim] f32, [programs * rows] int32
                 *, seg, per_program, bags, c, rows, dim, block_dim, mean, half, lookahead):
    pid = pl.program_id(0)
    g = jnp.arange(bags, dtype=jnp.int32)
    e = jnp.arange(rows, dtype=jnp.int32)
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    col_ok = cols < dim
    no_bad = lambda ids: jnp.int32(0)  # noqa: E731

    def tile(i, carry):
        acc, occ = carry
        n_tiles = seg.prog_end
        t = pid * per_program + i
        live = t < n_tiles
        t = jnp.minimum(t, n_tiles - 1)
        f, first, nbags, b0 = programs.locate(seg, t, flist_ref, prefix_ref)
        nbags = jnp.where(live, nbags, 0)
        out_base = plgpu.load(feat_ref.at[META_COLS * f + OUT_BASE])
        out_stride = plgpu.load(feat_ref.at[META_COLS * f + OUT_STRIDE])
        bag_ok = g < nbags
        length = jnp.where(
            bag_ok,
            plgpu.load(offsets_ref.at[first + g + 1], mask=bag_ok, other=0)
            - plgpu.load(offsets_ref.at[first + g], mask=bag_ok, other=0),
            0,
        )
        dout = plgpu.load(g_ref.at[(out_base + (b0 + g) * out_stride)[:, None] + cols[None, :]],
                          mask=bag_ok[:, None] & col_ok[None, :], other=0.0)
        if mean:
            dout = dout * (1.0 / jnp.maximum(length, 1).astype(jnp.float32))[:, None]
        parts = split3(dout)
        pb, pc, p_start, p_len = tile_positions(offsets_ref, first, nbags, bags=bags, c=c)
        membership_t = (pb[:, None] == g[None, :]).astype(jnp.float16)  # S^T [K, bags]
        longest = jnp.max(length)

        def round_(r, carry):
            acc, occ = carry
            k0 = r * HEAD
            n_steps = (jnp.minimum(longest - k0, HEAD) + c - 1) // c
            counts_t, _ = count_ids(indices_ref, p_start, pc, jnp.minimum(p_len, k0 + HEAD), k0, n_steps,
                                    membership_t, no_bad, c=c, rows=rows, half=half, lookahead=lookahead,
                                    rows_first=True)
            ct = counts_t.astype(jnp.bfloat16)  # <= HEAD = 256: exact
            for part in parts:
                acc = acc + jnp.dot(ct, part, preferred_element_type=jnp.float32)
            return acc, occ + jnp.sum(counts_t, axis=1).astype(jnp.int32)

        return jax.lax.fori_loop(0, (longest + HEAD - 1) // HEAD, round_, (acc, occ))

    acc, occ = jax.lax.fori_loop(
        0, per_program, tile, (jnp.zeros((rows, block_dim), jnp.float32), jnp.zeros((rows,), jnp.int32)))
    plgpu.store(part_ref.at[(pid * rows + e)[:, None] * block_dim + cols[None, :]], acc)
    plgpu.store(occ_ref.at[pid * rows + e], occ)


def _update_kernel(part_ref, occ_ref, hyper_ref, *refs, opt, n_parts, q, rows, dim, block_dim, num_rows, row_offset):
    w_in, m_in, w_out, m_out = _state_refs(refs, opt)
    e = pl.program_id(0)
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    col_ok = cols < dim
    pq = jnp.arange(q, dtype=jnp.int32)

    def step(i, carry):
        acc, n = carry
        p = i * q + pq
        ok = p < n_parts
        tile = plgpu.load(part_ref.at[((p * rows + e) * block_dim)[:, None] + cols[None, :]],
                          mask=ok[:, None] & col_ok[None, :], other=0.0)
        n = n + jnp.sum(plgpu.load(occ_ref.at[p * rows + e], mask=ok, other=0))
        return acc + jnp.sum(tile, axis=0, keepdims=True), n

    acc, n = jax.lax.fori_loop(0, (n_parts + q - 1) // q, step,
                               (jnp.zeros((1, block_dim), jnp.float32), jnp.int32(0)))
    touched = jnp.zeros((1,), jnp.int32) + n > 0
    # Rows not in the batch point one past the buffer: never stored on a GPU, dropped in interpret mode.
    row = jnp.where(touched, row_offset + e, w_out.shape[0])
    _row_update(opt, hyper_ref, w_in, w_out, m_in, m_out, row, touched, acc, cols, col_ok, dim)


def histogram_update(
    buffers: dict,
    momentum: dict | None,
    layout: StorageLayout,
    plan: FeaturePlan,
    features,  # the features that took the histogram forward
    indices: jax.Array,
    offsets: jax.Array,
    g_out: jax.Array,
    opt,
    hyper: jax.Array | None = None,
    *,
    pooling: str,
    config: HistogramConfig,
    interpret: bool,
):
    """Apply `opt` to the rows of the histogram features' tables; returns (buffers, momentum).

    Every table read by one of `features` must be read by histogram features only
    (eligibility is per table, so this holds for `TableBatchedEmbedding.plan()`).
    `opt=None`: store each occurring row's gradient (cast to the buffer's dtype)
    into `buffers`, which must be zeros there.
    """
    cfg = config
    new_w, new_m = dict(buffers), (dict(momentum) if momentum is not None else None)
    g_flat = g_out.reshape(-1).astype(jnp.float32)
    feat_meta = jnp.asarray(feature_table(plan).reshape(-1))
    adagrad = opt is not None and opt.has_momentum
    if hyper is None:
        hyper = jnp.zeros((2,), jnp.float32)
    for t in sorted({plan.table[f] for f in features}):
        feats = [f for f in features if plan.table[f] == t]
        pm = programs.build(plan.bag_base, plan.batch, [(feats, cfg.grad_bags)])
        if not pm.segments:
            continue
        seg = pm.segments[0]
        n_tiles = seg.prog_end
        grp = plan.group[feats[0]]
        key, dim = layout.key(grp), layout.dims[grp]
        num_rows, rows = plan.num_rows[feats[0]], rows_padded(plan.num_rows[feats[0]])
        block_dim = next_pow2(dim)
        # Interpret mode runs programs one after another: few programs keep CPU tests fast and
        # make each program walk several tiles (the loop is tested).
        n_prog = min(cfg.grad_programs, 3 if interpret else cfg.grad_programs, n_tiles)
        per_program = -(-n_tiles // n_prog)
        n_prog = -(-n_tiles // per_program)
        part, occ = pl.pallas_call(
            functools.partial(_grad_kernel, seg=seg, per_program=per_program, bags=cfg.grad_bags,
                              c=cfg.grad_ids_per_step, rows=rows, dim=dim, block_dim=block_dim,
                              mean=pooling == "mean", half=cfg.half_compare,
                              lookahead=cfg.grad_lookahead),
            out_shape=(jax.ShapeDtypeStruct((n_prog * rows * block_dim,), jnp.float32),
                       jax.ShapeDtypeStruct((n_prog * rows,), jnp.int32)),
            grid=(n_prog,),
            compiler_params=plgpu.CompilerParams(num_warps=cfg.grad_num_warps, num_stages=1),
            interpret=interpret, name="tbe_histogram_grad",
        )(*programs.operands(pm), feat_meta, offsets, indices, g_flat)
        state = [new_w[key]] + ([new_m[key]] if adagrad else [])
        args = [part, occ, hyper] + state
        state = pl.pallas_call(
            functools.partial(_update_kernel, opt=opt, n_parts=n_prog,
                              q=min(cfg.update_partials, next_pow2(n_prog)), rows=rows, dim=dim,
                              block_dim=block_dim, num_rows=num_rows, row_offset=plan.row_offset[feats[0]]),
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
            grid=(num_rows,),
            input_output_aliases={3 + i: i for i in range(len(state))},
            compiler_params=plgpu.CompilerParams(num_warps=cfg.update_num_warps, num_stages=1),
            interpret=interpret, name="tbe_histogram_update",
        )(*args)
        new_w[key] = state[0]
        if adagrad:
            new_m[key] = state[1]
    return new_w, new_m
