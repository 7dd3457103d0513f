"""The small-run kernel of the sorted-run backward (runs of at most `BackwardConfig.small_run_max` lookups; most
runs).

A task takes a block of consecutive runs and walks their lookups in lockstep, gathering a `[block, D]` tile
of output-gradient rows per step, then updates the block's rows with plain stores (each row is owned by
one lane, nothing races). Blocking turns a chain of dependent loads per run into wide independent loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import aligned, pl, plgpu
from tbe_jax.kernels.backward_tasks import cols_below, task_range, strided_tasks
from tbe_jax.kernels.row_update import segment_states, row_update


def small_kernel(rng_ref, hyper_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref, *refs,
                  opt, segs, blocks, programs, scaled, align, small):
    """The small-run kernel of one launch (runs of at most `small` lookups): segment `segs[c]` (blocks of
    `blocks[c]` runs) on `programs[c]`
    programs of its own; with several segments (`BackwardConfig.merge_width`) the grid is split between them by program
    id, so each program runs one segment's code."""
    states = segment_states(refs, opt, segs)
    kw = dict(rng_ref=rng_ref, hyper_ref=hyper_ref, run_start_ref=run_start_ref, run_key_ref=run_key_ref,
              src_ref=src_ref, scale_ref=scale_ref, g_ref=g_ref, opt=opt, scaled=scaled, align=align, small=small)
    if len(segs) == 1:
        _small_segment(state=states[0], seg=segs[0], block=blocks[0], programs=programs[0], pid=None, **kw)
        return
    pid, start = pl.program_id(0), 0
    for state, seg, block, p in zip(states, segs, blocks, programs):
        pl.when((pid >= start) & (pid < start + p))(functools.partial(
            _small_segment, state=state, seg=seg, block=block, programs=p, pid=pid - start, **kw))
        start += p


def _small_segment(*, rng_ref, hyper_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref, state, opt, seg,
                   block, programs, pid, scaled, align, small):
    """Blocks of `block` consecutive runs of the segment `seg`; the small ones (<= `small` lookups)
    are gathered in lockstep and updated, one row each; the others are left to the mid/long kernels.

    A block's lanes may belong to several buffers of the segment: the gather serves them all
    (each lane masked to its run's dim), then each buffer present in the block updates its
    lanes in its own branch. Each loop step takes one lookup of every run of the block.
    """
    lane = jnp.arange(block, dtype=jnp.int32)
    lo, hi = task_range(rng_ref, seg, 0)
    cols = jnp.arange(seg.width, dtype=jnp.int32)

    def task(t):
        r0 = lo + t * block
        r = r0 + lane
        ok = r < hi
        first = plgpu.load(run_start_ref.at[r], mask=ok, other=0)
        length = plgpu.load(run_start_ref.at[r + 1], mask=ok, other=0) - first
        ok = ok & (length <= small)
        length = jnp.where(ok, length, 0)
        key = plgpu.load(run_key_ref.at[r], mask=ok, other=0)
        if not seg.single:
            # Keys ascend within the segment and each buffer's keys are contiguous: the buffers present
            # in the block lie between those of its first and last runs (two scalar loads instead of a
            # cross-lane reduction per buffer). Loaded here, before the gather, not where they are used:
            # issued after it, they add a memory round trip to every block (dims 4..128: 0.424 -> 0.331 ms
            # of w128 small-run kernels, benchmarks/results/archive/preload-20261201-1223-*).
            k0 = plgpu.load(run_key_ref.at[r0])
            k1 = plgpu.load(run_key_ref.at[jnp.minimum(r0 + block, hi) - 1])
        dim = seg.dim_of(key)
        col_ok = (cols < dim)[None, :] if seg.single else cols_below(cols[None, :], dim[:, None], align)

        def step(i, acc):
            live = i < length
            jj = first + i
            src = aligned(plgpu.load(src_ref.at[jj], mask=live, other=0), align)
            g = plgpu.load(g_ref.at[src[:, None] + cols[None, :]], mask=live[:, None] & col_ok,
                           other=0).astype(jnp.float32)
            if scaled:
                g = g * plgpu.load(scale_ref.at[jj], mask=live, other=0.0)[:, None]
            return acc + g

        acc = jax.lax.fori_loop(0, jnp.max(length), step, jnp.zeros((block, seg.width), jnp.float32))

        def update(i, mine):
            w_in, s_in, w_out, s_out = state[i]
            # Masked lanes point one past the buffer: never stored on a GPU, and dropped
            # (not written back over a live row) by interpret mode's masked store.
            row = jnp.where(mine, key - seg.bases[i], w_out.shape[0])
            row_update(opt, hyper_ref, w_in, w_out, s_in, s_out, row, mine, acc, cols, cols < seg.dims[i],
                       seg.dims[i], seg.strides[i])

        if seg.single:
            update(0, ok)
            return
        for i in range(len(seg.buffers)):
            pl.when((k0 < seg.ends[i]) & (k1 >= seg.bases[i]))(
                functools.partial(update, i, ok & seg.holds(i, key)))

    strided_tasks(0, (hi - lo + block - 1) // block, programs, task, pid)
