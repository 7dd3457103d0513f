"""Kernel-side walking of the backward's task lists and the gradient gather (used by every backward kernel).

Programs are persistent: a fixed grid walks a device-resident task list with a stride (`strided_tasks`; trip
counts come from device counts, no host sync, no atomics). The lists of all segments follow each other, so one
walk serves every segment, each task branching to its segment's code (`_by_segment`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import aligned, pl, plgpu

if TYPE_CHECKING:
    from tbe_jax.kernels.backward_plan import RunSegment


def cols_below(cols, dim, align):
    """The column mask `cols < dim` for runtime dims (multiples of `align`), computed on column blocks of
    `align` so the mask is visibly constant over each vector of the gather."""
    if align == 1:
        return cols < dim
    a = jnp.int32(align)
    return jax.lax.div(cols, jnp.full(cols.shape, a)) < jax.lax.div(dim, jnp.full(dim.shape, a))


def gather_sum(src_ref, scale_ref, g_ref, first, end, *, k, cols, col_ok, scaled, prefetch, align):
    """sum over sorted lookups [first, end) of scale * g[src + cols], fp32 [1, Dp] (scale 1 unless `scaled`).

    With `prefetch`, software-pipelined: step i's gradient rows load while step
    i + 1's source offsets (and scales) are already in flight, so a step costs one
    memory latency instead of two dependent ones.
    """
    j = jnp.arange(k, dtype=jnp.int32)

    def indices(i):
        jj = first + i * k + j
        live = jj < end
        src = aligned(plgpu.load(src_ref.at[jj], mask=live, other=0), align)
        sc = plgpu.load(scale_ref.at[jj], mask=live, other=0.0) if scaled else jnp.zeros((k,), jnp.float32)
        return src, sc, live

    def add(acc, src, sc, live):
        rows = plgpu.load(g_ref.at[src[:, None] + cols[None, :]], mask=live[:, None] & col_ok[None, :], other=0)
        rows = rows.astype(jnp.float32)
        if scaled:
            rows = rows * sc[:, None]
        return acc + jnp.sum(rows, axis=0, keepdims=True)

    n = jnp.maximum((end - first + k - 1) // k, 0)
    zeros = jnp.zeros((1, cols.shape[0]), jnp.float32)
    if not prefetch:
        return jax.lax.fori_loop(0, n, lambda i, acc: add(acc, *indices(i)), zeros)

    def step(i, carry):
        nxt = indices(i + 1)  # issued before this step's dependent row loads
        return (add(*carry),) + nxt

    return jax.lax.fori_loop(0, n, step, (zeros,) + indices(0))[0]


def strided_tasks(lo, hi, programs, body, pid=None):
    """Program p (`pid`, by default the program id) handles tasks lo + p, lo + p + programs, ... below hi."""
    pid = pl.program_id(0) if pid is None else pid
    n = jnp.maximum(hi - lo - pid + programs - 1, 0) // programs
    jax.lax.fori_loop(0, n, lambda i, c: (body(lo + pid + i * programs), c)[1], jnp.int32(0))


def task_range(rng_ref, seg: RunSegment, col: int):
    """(lo, hi) of column pair `col` of the segment's row of the task-range table (scalars)."""
    return (plgpu.load(rng_ref.at[jnp.int32(8 * seg.index + col)]),
            plgpu.load(rng_ref.at[jnp.int32(8 * seg.index + col + 1)]))


def _by_segment(segs, t, bounds, body):
    """`body(c, t)` in the branch of the segment `c` with `bounds[c] <= t < bounds[c + 1]`."""
    if len(segs) == 1:
        body(0, t)
        return
    for c in range(len(segs)):
        pl.when((t >= bounds[c]) & (t < bounds[c + 1]))(functools.partial(body, c, t))


def list_kernel_tasks(rng_ref, segs, col, programs, body):
    """Walk one task list (column pair `col`: mid runs, chunks or long runs) over every segment: the
    segments' ranges of the list follow each other, so the tasks are one range."""
    bounds = [task_range(rng_ref, seg, col)[0] for seg in segs] + [task_range(rng_ref, segs[-1], col)[1]]
    strided_tasks(bounds[0], bounds[-1], programs, lambda t: _by_segment(segs, t, bounds, body))
