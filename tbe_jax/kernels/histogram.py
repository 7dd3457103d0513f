"""Small-table histogram forward: counts x table on tensor cores (seed: FBTriton).

For a feature whose table is tiny (E <= 64) and whose bags are long, gathering
rows one by one re-reads the same few rows hundreds of times. Instead a program
takes 16 bags, counts how often each of the table's rows occurs among the first
256 ids of each bag (`counts[16, E]`), and computes `counts @ table` with one
tensor-core dot; ids past the 256th go through the scalar gather path.

Exactness: counts are integers <= 256, exact in fp16, and the table is fp16, so
every product is exact in the fp32 accumulator: the result equals the generic
path's up to fp32 rounding of the sum order. (FBTriton's fp16 high/low split is
only needed where an fp32 operand meets the tensor cores, as in the backward's
`counts^T @ dout`; here both operands are exactly fp16.)

Eligibility is static (see `eligible`): E <= 64, 64 <= D <= 128, the table's
`bag_size_hint >= 64`, fp16 weights, fp32 output, unweighted, no VBE.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import pl, plgpu
from tbe_jax.kernels.forward import (  # the program and feature tables are shared with the generic kernel
    _META_COLS, _NUM_ROWS, _OUT_BASE, _OUT_STRIDE, _P_BAG, _P_COUNT, _P_FEATURE, _P_FIRST, _PROG_COLS,
    _ROW_OFFSET, feature_table, program_rows,
)
from tbe_jax.specs import FeaturePlan, StorageLayout, TableSpec, next_pow2

BAGS = 16  # bags per program
HEAD = 256  # ids per bag counted into the histogram; the rest take the gather path
MAX_ROWS, MIN_DIM, MAX_DIM, MIN_BAG = 64, 64, 128, 64



@dataclasses.dataclass(frozen=True)
class HistogramConfig:
    """Knobs of the histogram kernel.

    Attributes:
      hit_elems: elements of the `[16, C, E]` compare tile per counting step
        (C ids per bag per step).
      tail_unroll: ids per bag loaded together on the gather path (ids >= 256).
      num_warps: warps per program.
      deferred_reduce: keep the `[16, C, E]` hits accumulating across steps and
        reduce over C once at the end, instead of reducing every step.
    """

    hit_elems: int = 8192
    tail_unroll: int = 4
    num_warps: int = 4
    deferred_reduce: bool = True

    def ids_per_step(self, rows_padded: int) -> int:
        c = max(1, self.hit_elems // (BAGS * rows_padded))
        return 1 << (c.bit_length() - 1)


def eligible(table: TableSpec, weights_dtype, output_dtype) -> bool:
    """Static part of the eligibility (per-call: unweighted and no VBE)."""
    hint = table.bag_size_hint
    return (
        table.num_embeddings <= MAX_ROWS
        and MIN_DIM <= table.embedding_dim <= MAX_DIM
        and hint is not None
        and hint >= MIN_BAG
        and jnp.dtype(weights_dtype) == jnp.float16
        and jnp.dtype(output_dtype) == jnp.float32
    )


@dataclasses.dataclass(frozen=True)
class _Branch:
    buffer: int
    prog_start: int
    prog_end: int
    dim: int
    block_dim: int
    rows_padded: int  # >= 16: a tensor-core dot needs K >= 16


def _schedule(layout: StorageLayout, plan: FeaturePlan, features):
    progs, branches, used = [], [], []
    for g in sorted({plan.group[f] for f in features}):
        feats = [f for f in features if plan.group[f] == g]
        start = len(progs)
        progs += program_rows(plan, feats, BAGS)
        if len(progs) > start:
            rows = max(16, next_pow2(max(plan.num_rows[f] for f in feats)))
            d = layout.dims[g]
            branches.append(_Branch(len(used), start, len(progs), d, next_pow2(d), rows))
            used.append(g)
    prog_meta = np.asarray(progs, np.int32).reshape(-1, _PROG_COLS)
    return used, tuple(branches), prog_meta, feature_table(plan)


def _hist_branch(
    pid, prog_ref, feat_ref, offsets_ref, indices_ref, w_ref, out_ref, bad_ref, counts_ref,
    *, br: _Branch, cfg: HistogramConfig, pooling: str, check_upper: bool,
):
    def meta(ref, cols, row, col):
        return plgpu.load(ref.at[cols * row + col])

    f = meta(prog_ref, _PROG_COLS, pid, _P_FEATURE)
    first = meta(prog_ref, _PROG_COLS, pid, _P_FIRST)
    nbags = meta(prog_ref, _PROG_COLS, pid, _P_COUNT)
    b0 = meta(prog_ref, _PROG_COLS, pid, _P_BAG)
    g = jnp.arange(BAGS, dtype=jnp.int32)
    bag_ok = g < nbags
    start = plgpu.load(offsets_ref.at[first + g], mask=bag_ok, other=0)
    end = plgpu.load(offsets_ref.at[first + g + 1], mask=bag_ok, other=0)
    num_rows = meta(feat_ref, _META_COLS, f, _NUM_ROWS)
    row_offset = meta(feat_ref, _META_COLS, f, _ROW_OFFSET)
    out_base = meta(feat_ref, _META_COLS, f, _OUT_BASE)
    out_stride = meta(feat_ref, _META_COLS, f, _OUT_STRIDE)
    length = end - start
    head = jnp.minimum(length, HEAD)

    def n_bad(ids):
        if bad_ref is None:
            return jnp.int32(0)
        return jnp.sum((ids != -1) & ((ids < 0) | (ids >= num_rows)), dtype=jnp.int32)

    # 1. Histogram of the first HEAD ids of each bag: counts[b, e] = #{j : id_bj == e}.
    c = cfg.ids_per_step(br.rows_padded)
    e = jnp.arange(br.rows_padded, dtype=jnp.int32)
    j = jnp.arange(c, dtype=jnp.int32)

    def count(i, carry):
        counts, bad = carry
        k = i * c + j
        live = k[None, :] < head[:, None]
        ids = plgpu.load(indices_ref.at[start[:, None] + k[None, :]], mask=live, other=-1)
        hit = (ids[:, :, None] == e[None, None, :]).astype(jnp.int32)
        if not cfg.deferred_reduce:
            hit = jnp.sum(hit, axis=1)
        return counts + hit, bad + n_bad(ids)

    shape = (BAGS, c, br.rows_padded) if cfg.deferred_reduce else (BAGS, br.rows_padded)
    n_steps = (jnp.max(head) + c - 1) // c
    counts, bad = jax.lax.fori_loop(0, n_steps, count, (jnp.zeros(shape, jnp.int32), jnp.int32(0)))
    if cfg.deferred_reduce:
        counts = jnp.sum(counts, axis=1)

    # 2. counts @ table on tensor cores (rows past the table's E are zero).
    cols = jnp.arange(br.block_dim, dtype=jnp.int32)
    col_ok = cols < br.dim
    table = plgpu.load(
        w_ref.at[(row_offset + e)[:, None], cols[None, :]],
        mask=(e < num_rows)[:, None] & col_ok[None, :], other=0,
    )
    acc = jnp.dot(counts.astype(jnp.float16), table, preferred_element_type=jnp.float32)

    # 3. Ids past HEAD: the scalar gather path, unrolled.
    u_n = cfg.tail_unroll
    n_tail = (jnp.max(length - HEAD) + u_n - 1) // u_n

    def tail(it, carry):
        acc, bad = carry
        for u in range(u_n):
            k = HEAD + it * u_n + u
            live = k < length
            idx = plgpu.load(indices_ref.at[start + k], mask=live, other=-1)
            ok = idx >= 0
            if check_upper:
                ok = ok & (idx < num_rows)
            x = plgpu.load(w_ref.at[(row_offset + idx)[:, None], cols[None, :]],
                           mask=ok[:, None] & col_ok[None, :], other=0)
            acc = acc + x.astype(jnp.float32)
            bad = bad + n_bad(idx)
        return acc, bad

    acc, bad = jax.lax.fori_loop(0, jnp.maximum(n_tail, 0), tail, (acc, bad))
    if pooling == "mean":
        acc = acc / jnp.maximum(length, 1).astype(jnp.float32)[:, None]
    bag = b0 + g
    ptr = (out_base + bag * out_stride)[:, None] + cols[None, :]
    plgpu.store(out_ref.at[ptr], acc.astype(out_ref.dtype), mask=bag_ok[:, None] & col_ok[None, :])
    if bad_ref is not None:
        plgpu.store(bad_ref.at[pid], bad)
    if counts_ref is not None:
        rows = pid * BAGS + g
        plgpu.store(counts_ref.at[rows[:, None], e[None, :]], counts)


def _hist_kernel(*refs, branches, n_buffers, pooling, check_upper, count_invalid, save_counts, cfg, aliased):
    prog_ref, feat_ref, offsets_ref, indices_ref = refs[:4]
    w_refs = refs[4 : 4 + n_buffers]
    rest = list(refs[4 + n_buffers :])
    if aliased:
        rest.pop(0)  # the input side of the aliased output buffer
    out_ref = rest.pop(0)
    bad_ref = rest.pop(0) if count_invalid else None
    counts_ref = rest.pop(0) if save_counts else None
    pid = pl.program_id(0)
    for br in branches:
        @pl.when((pid >= br.prog_start) & (pid < br.prog_end))
        def _(br=br):
            _hist_branch(
                pid, prog_ref, feat_ref, offsets_ref, indices_ref, w_refs[br.buffer], out_ref, bad_ref,
                counts_ref, br=br, cfg=cfg, pooling=pooling, check_upper=check_upper,
            )


def histogram_forward(
    out_flat: jax.Array | None,  # pooled output with the other features' columns written, or None
    buffers: dict,
    layout: StorageLayout,
    plan: FeaturePlan,
    features,  # the features taking this path
    indices: jax.Array,
    offsets: jax.Array,
    *,
    pooling: str,
    check_upper: bool,
    interpret: bool,
    config: HistogramConfig | None = None,
    count_invalid: bool = False,
    save_counts: bool = False,
):
    """Writes the histogram features' columns into `out_flat` (aliased, no copy).

    With `out_flat=None` (every feature takes this path) the output is fresh.

    Returns `out_flat`, plus the number of skipped bad ids (`count_invalid`) and
    the per-bag counts `[programs * 16, E_padded]` int32 (`save_counts`; row
    `p * 16 + b` is bag b of program p, in `histogram_programs` order), each when asked.
    """
    cfg = config or HistogramConfig()
    used, branches, prog_meta, feat_meta = _schedule(layout, plan, tuple(features))
    n_prog = prog_meta.shape[0]
    out_shape = [jax.ShapeDtypeStruct((plan.out_size,), jnp.float32)]
    if count_invalid:
        out_shape.append(jax.ShapeDtypeStruct((n_prog,), jnp.int32))
    if save_counts:
        rows = max(b.rows_padded for b in branches)
        out_shape.append(jax.ShapeDtypeStruct((n_prog * BAGS, rows), jnp.int32))
    kernel = functools.partial(
        _hist_kernel, branches=branches, n_buffers=len(used), pooling=pooling, check_upper=check_upper,
        count_invalid=count_invalid, save_counts=save_counts, cfg=cfg, aliased=out_flat is not None,
    )
    args = [jnp.asarray(prog_meta.reshape(-1)), jnp.asarray(feat_meta.reshape(-1)), offsets, indices]
    args += [buffers[layout.key(g)] for g in used]
    if out_flat is not None:
        args.append(out_flat)
    res = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(n_prog,),
        input_output_aliases={len(args) - 1: 0} if out_flat is not None else {},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="tbe_histogram_forward",
    )(*args)
    out = [res[0]]
    if count_invalid:
        out.append(jnp.sum(res[1]))
    if save_counts:
        out.append(res[-1])
    return out[0] if len(out) == 1 else tuple(out)


def histogram_programs(plan: FeaturePlan, features) -> np.ndarray:
    """(feature, bag) of each row of the saved counts; bag -1 for padding rows."""
    out = []
    for g in sorted({plan.group[f] for f in features}):
        for f, _, count, b0 in program_rows(plan, [f for f in features if plan.group[f] == g], BAGS):
            out.extend((f, b0 + i if i < count else -1) for i in range(BAGS))
    return np.asarray(out, np.int32).reshape(-1, 2)
