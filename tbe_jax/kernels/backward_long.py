"""The mid-run, chunk and long-run kernels of the sorted-run backward.

- mid runs (`BackwardConfig.small_run_max` < length < `BackwardConfig.long_run`, L): one task owns the run, gathers
  its lookups' output-gradient rows K at a time, accumulates them in fp32 registers and updates the row with a plain
  store.
- long runs (>= L; with `BackwardConfig.split_chunk` C, also runs of 2C to L - 1 lookups, in chunks of C): a chunk
  task writes one fp32 partial sum per chunk of L lookups to a workspace (the mid and
  chunk tasks share one launch, `mid_chunk_kernel`); then `long_kernel` sums each long run's partials in chunk order
  and updates its row. A row hit a million times becomes thousands of parallel chunk tasks instead of one serial
  program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import plgpu
from tbe_jax.kernels.backward_tasks import cols_below, gather_sum, list_kernel_tasks
from tbe_jax.kernels.row_update import segment_states, row_update
from tbe_jax.runs import chunk_length


def mid_chunk_kernel(rng_ref, hyper_ref, mid_ref, long_chunk0_ref, long_ref, run_start_ref, run_key_ref,
                      src_ref, scale_ref, g_ref, *refs, opt, segs, k, programs, scaled, prefetch, align, long_run,
                      split_chunk=0):
    """The mid-run tasks, then the chunk tasks, on the same persistent programs: one launch (two cost ~6 us more
    per step, even with no task). `refs`: the buffers' state (inputs, aliased outputs), then the chunk partials'
    workspace. `long_run`, `split_chunk`: the chunk lengths (`BackwardConfig`, `runs.chunk_length`). `k`: rows
    gathered a step, per segment (`BackwardConfig.steps_at`)."""
    _mid_tasks(rng_ref, hyper_ref, mid_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref,
               segment_states(refs[:-1], opt, segs), opt=opt, segs=segs, k=k, programs=programs, scaled=scaled,
               prefetch=prefetch, align=align)
    _chunk_partials(rng_ref, long_chunk0_ref, long_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref,
                    refs[-1], segs=segs, k=k, programs=programs, scaled=scaled, prefetch=prefetch, align=align,
                    long_run=long_run, split_chunk=split_chunk)


def _mid_tasks(rng_ref, hyper_ref, mid_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref, states, *,
               opt, segs, k, programs, scaled, prefetch, align):
    def body(c, t):
        seg = segs[c]
        cols = jnp.arange(seg.width, dtype=jnp.int32)
        r = plgpu.load(mid_ref.at[t])
        first = plgpu.load(run_start_ref.at[r])
        end = plgpu.load(run_start_ref.at[r + 1])
        key = plgpu.load(run_key_ref.at[r])
        col_ok = cols < seg.dims[0] if seg.single else cols_below(cols, seg.dim_of(key), align)
        acc = gather_sum(src_ref, scale_ref, g_ref, first, end, k=k[c], cols=cols, col_ok=col_ok, scaled=scaled,
                          prefetch=prefetch, align=align)
        _update_key_row(opt, hyper_ref, seg, states[c], key, acc, cols)

    list_kernel_tasks(rng_ref, segs, 2, programs, body)


def _update_key_row(opt, hyper_ref, seg, state, key, acc, cols):
    """The row update of one run (linear key `key`, summed gradient `acc` `[1, width]`), in the branch of
    the segment's buffer that holds the key."""
    def update(i):
        w_in, s_in, w_out, s_out = state[i]
        row = key - seg.bases[i] + jnp.zeros((1,), jnp.int32)
        row_update(opt, hyper_ref, w_in, w_out, s_in, s_out, row, jnp.ones((1,), jnp.bool_), acc, cols,
                   cols < seg.dims[i], seg.dims[i], seg.strides[i])

    seg.per_buffer(key, update)


def chunk_task(long_chunk0_ref, long_ref, run_start_ref, t, size: int, long_run: int, split_chunk: int = 0):
    """(long run, first sorted lookup) of chunk task `t` (below the chunk count): the last `li` with
    `long_chunk0[li] <= t`, by a binary search over its `size` entries (those past the long runs hold the chunk
    count, above t), then the run's first lookup plus its chunk length (`runs.chunk_length`) per chunk before t."""
    def halve(_, lo_hi):  # the answer stays in [lo, hi)
        lo, hi = lo_hi
        mid = (lo + hi) // 2
        below = plgpu.load(long_chunk0_ref.at[mid]) <= t
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    li, _ = jax.lax.fori_loop(0, max(size - 1, 1).bit_length(), halve, (jnp.int32(0), jnp.int32(size)))
    r = plgpu.load(long_ref.at[li])
    start = plgpu.load(run_start_ref.at[r])
    step = chunk_length(plgpu.load(run_start_ref.at[r + 1]) - start, long_run, split_chunk) if split_chunk else long_run
    return r, start + (t - plgpu.load(long_chunk0_ref.at[li])) * step


def _chunk_partials(rng_ref, long_chunk0_ref, long_ref, run_start_ref, run_key_ref, src_ref, scale_ref, g_ref,
                    part_ref, *, segs, k, programs, scaled, prefetch, align, long_run, split_chunk):
    """One chunk of a chunked run per task (found by `chunk_task`; `long_run` lookups, or `split_chunk` in runs
    shorter than `long_run`): its fp32 partial sum (zero past the run's dim) to row `t` of the workspace (the
    first `width` columns of its segment)."""
    def body(c, t):
        seg = segs[c]
        cols = jnp.arange(seg.width, dtype=jnp.int32)
        r, first = chunk_task(long_chunk0_ref, long_ref, run_start_ref, t, long_chunk0_ref.shape[0], long_run,
                              split_chunk)
        if split_chunk:
            run_end = plgpu.load(run_start_ref.at[r + 1])
            step = chunk_length(run_end - plgpu.load(run_start_ref.at[r]), long_run, split_chunk)
            end = jnp.minimum(first + step, run_end)
        else:
            end = jnp.minimum(first + long_run, plgpu.load(run_start_ref.at[r + 1]))
        col_ok = (cols < seg.dims[0] if seg.single
                  else cols_below(cols, seg.dim_of(plgpu.load(run_key_ref.at[r])), align))
        acc = gather_sum(src_ref, scale_ref, g_ref, first, end, k=k[c], cols=cols, col_ok=col_ok, scaled=scaled,
                          prefetch=prefetch, align=align)
        plgpu.store(part_ref.at[(t + jnp.zeros((1,), jnp.int32))[:, None], cols[None, :]], acc)

    list_kernel_tasks(rng_ref, segs, 4, programs, body)


def long_kernel(rng_ref, hyper_ref, long_ref, long_chunk0_ref, run_key_ref, part_ref, *refs, opt, segs, programs,
                block):
    """One long run per task: the sum of its chunk partials, `block[c]` partials a step in segment c (one
    `[block[c], width]` load, summed over its rows, then added in chunk order: a fixed order, so the result is
    deterministic), one row update. A hot row of a Zipf batch has thousands of chunks: one partial a step made its
    task a serial chain of that many loads (0.28 ms of a 0.65 ms update on an H100, a 62-row table read 1.9M
    times)."""
    states = segment_states(refs, opt, segs)

    def body(c, li):
        seg, blk = segs[c], block[c]
        cols = jnp.arange(seg.width, dtype=jnp.int32)
        j = jnp.arange(blk, dtype=jnp.int32)
        c0 = plgpu.load(long_chunk0_ref.at[li])
        c1 = plgpu.load(long_chunk0_ref.at[li + 1])

        def add(i, acc):
            ch = c0 + i * blk + j
            tile = plgpu.load(part_ref.at[ch[:, None], cols[None, :]], mask=(ch < c1)[:, None], other=0.0)
            return acc + jnp.sum(tile, axis=0, keepdims=True)

        acc = jax.lax.fori_loop(0, (c1 - c0 + blk - 1) // blk, add, jnp.zeros((1, seg.width), jnp.float32))
        key = plgpu.load(run_key_ref.at[plgpu.load(long_ref.at[li])])
        _update_key_row(opt, hyper_ref, seg, states[c], key, acc, cols)

    list_kernel_tasks(rng_ref, segs, 6, programs, body)
