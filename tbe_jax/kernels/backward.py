"""Sorted-run backward with the optimizer fused in (seed: FBTriton backward): `fused_update`.

Input: the runs of `tbe_jax.runs.build_runs` (one run per distinct table row in
the batch, its lookups contiguous in key order) and the output gradient. The
small-run kernel is launched once per segment of a width class `next_pow2(D)` (at
most `BackwardConfig.segment_buffers` storage buffers of one row alignment, `runs.row_parity`;
`runs.width_classes` orders the key space class by class and parity by parity, so
each segment's keys, runs and tasks are contiguous; the narrow segments, of width
`BackwardConfig.merge_width` or less, share one launch whose programs are split between them); the mid-run
and chunk tasks share one launch and the long-run kernel is another, each branching per segment. Each
segment's code is compiled for its tile width: the gradient gather-and-sum is one
code path masked to each run's dim, and only the row update branches per storage
buffer (its weights' row stride a compile-time constant). Per segment:

- small runs (<= `BackwardConfig.small_run_max` lookups, S; most runs, typically of length 1 or 2): a task
  takes a block of runs and walks their lookups in lockstep, gathering a
  [block, D] tile of output-gradient rows per step, then updates the block's
  rows with plain stores. Blocking turns a chain of dependent loads per run
  into wide independent loads (the per-run version was latency-bound).
- mid runs (S < length < `BackwardConfig.long_run`, L): one task owns the run, gathers its lookups'
  output-gradient rows `K` at a time, accumulates them in fp32 registers and
  applies the update with a plain store: it owns the row, nothing races.
- long runs (>= L): a first kernel writes one fp32 partial sum per chunk of
  L lookups to a workspace; a second kernel sums each long run's partials and
  applies the update. A row hit a million times becomes thousands of parallel
  chunk tasks instead of one serial program.

Programs are persistent: a fixed grid walks the device-resident task lists with
a stride (trip counts come from device counts; no host sync, no atomics). The
tables and the optimizer state are updated in place (input/output aliasing):
rows not in the batch are never touched. Each row's gradient is summed in a
fixed order (its lookups in batch order; chunk partials in chunk order), so
results are bitwise reproducible run to run: there is no nondeterministic mode.

Modules: `backward_config` (`BackwardConfig`), `backward_plan` (segments, task ranges), `backward_tasks` (the
persistent task walk, the gradient gather), `row_update` (the optimizer on a tile), `backward_small` and
`backward_long` (the kernels); this module launches them (`fused_update`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, plgpu, row_align
from tbe_jax.kernels.backward_config import BackwardConfig
from tbe_jax.kernels.backward_long import chunk_task, long_kernel, mid_chunk_kernel
from tbe_jax.kernels.backward_plan import (multi_block, RunSegment, run_segments, small_launches, task_ranges,
                                           segment_bounds)
from tbe_jax.kernels.backward_small import small_kernel
from tbe_jax.kernels.row_update import row_update, state_refs, state_width
from tbe_jax.optim import NUM_HYPER
from tbe_jax.runs import Runs
from tbe_jax.specs import StorageLayout

__all__ = [
    "fused_update",
    # re-exported from their modules (the names this module held before the split)
    "BackwardConfig", "row_update", "segment_bounds", "state_refs",
    "state_width", "RunSegment", "chunk_task", "run_segments", "small_launches", "task_ranges",
]


def fused_update(
    buffers: dict,
    slots: tuple,
    layout: StorageLayout,
    runs: Runs,
    g_out: jax.Array,
    opt,
    hyper: jax.Array | None = None,
    *,
    config: BackwardConfig,
    interpret: bool,
):
    """Apply `opt` (a `tbe_jax.optim.KernelRule`) to every row in `runs` with its aggregated gradient;
    returns (buffers, slots). `slots`: the optimizer state's slots (a tuple of dicts shaped like
    `buffers`; empty for SGD); `hyper`: the step's `Optimizer.hyperparameters`, fp32.

    `opt=None` is the true-gradient mode: `buffers` must be zeros, and each row in
    the batch receives its aggregated gradient (cast to the buffer's dtype).

    `runs` must come from `runs.build_runs` with this `config` (its `small_run_max`, `long_run` and
    `segment_buffers` shape them; list sizes that do not match raise a ValueError).
    """
    if hyper is None:
        hyper = jnp.zeros((NUM_HYPER,), jnp.float32)
    n = runs.src.shape[0]
    small, long_run = config.small_run_max, config.long_run
    if runs.mid.shape[0] != n // (small + 1) + 1 or runs.long.shape[0] != n // config.chunked_min + 1:
        raise ValueError(f"fused_update: runs with {runs.mid.shape[0]} mid and {runs.long.shape[0]} long slots were "
                         f"not built with small_run_max={small}, long_run={long_run}, "
                         f"split_chunk={config.mid_chunk} (this config's)")
    ranges = task_ranges(runs, layout, n, config)
    g_flat = g_out.reshape(-1)
    n_slots = opt.num_slots if opt is not None else 0
    new_w, new_s = dict(buffers), tuple(dict(x) for x in (slots or ())[:n_slots])
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)
    # Element-wise state (Adagrad, the Adam family) triples or more the bytes of each row update: fewer
    # runs per task and more warps per program keep more of those loads in flight (BackwardConfig).
    elementwise = opt is not None and not all(opt.slot_rowwise)
    small_warps = config.small_num_warps or (4 if elementwise else 2)
    blk = config.small_block or (4 if elementwise else 8)
    # Interpret mode runs programs one after another: the default there is few programs, which keeps CPU tests
    # fast and makes each program walk several tasks (the strided loop is tested).
    max_programs, max_small = config.resolved_programs(interpret)
    # Unweighted sum pooling: every lookup in a run has scale 1 (invalid ones are in no
    # run), so the runs carry no scales and the kernels skip those loads.
    scaled = runs.scale is not None
    common = [runs.src, runs.scale if scaled else jnp.ones((1,), jnp.float32), g_flat]
    max_chunks = config.max_chunks(n)  # chunk task slots (`runs.chunk_tasks`)
    # Every launch gets the full program count (scaling a class's programs by its share of the
    # tables measured slower: dims-20261130-164044).
    # The mid/chunk launch walks the mid runs and the chunk tasks; the long-run launch walks the chunked runs' list
    # (`runs.long`, half the chunk slots or fewer): programs past its length would only check and exit.
    p_mid = max(1, min(max_programs, runs.mid.shape[0]))
    p_chunk = max(1, min(max_programs, max_chunks))
    p_long = max(1, min(max_programs, runs.long.shape[0]))

    keys = [layout.key(g) for g in range(len(layout.dims))]
    prefetch = bool(config.prefetch if config.prefetch is not None else all(
        jnp.dtype(new_w[key].dtype).itemsize == 4 for key in keys))
    rng = ranges.reshape(-1)

    # Segments: at most one width class per power of two, split every `segment_buffers` buffers. The
    # mid-run and chunk tasks (one launch) and the long runs (one) branch per segment (their work is
    # often small: a launch per segment cost ~6 us even when it found nothing to do, on the H200).
    # The small-run kernel does most of the work and is one launch per segment: one launch for all
    # segments measured slower (dims-trace-20261201-0907-onelaunch vs -0914-segments).
    segs = run_segments(layout, config)
    buffers = [g for seg in segs for g in seg.buffers]

    def aliased(kernel, name, grid, args, buffers=buffers, compiler_params=params, extra=()):
        """Launch `kernel` with the state of `buffers` aliased in place; `extra`: more outputs (shapes) after the
        state's, returned."""
        state = [x for g in buffers for x in [new_w[keys[g]]] + [d[keys[g]] for d in new_s]]
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state] + list(extra)
        args = list(args) + state
        out = pallas_call(
            kernel, out_shape=shapes, grid=(grid,),
            input_output_aliases={len(args) - len(state) + i: i for i in range(len(state))},
            compiler_params=compiler_params,
            interpret=interpret, name=name,
        )(*args)
        per = 1 + n_slots
        for i, g in enumerate(buffers):
            new_w[keys[g]] = out[per * i]
            for j, d in enumerate(new_s):
                d[keys[g]] = out[per * i + 1 + j]
        return out[len(state):]

    segs = tuple(segs)
    align = row_align(layout.dims, 4)
    def small_launch(seg):  # (block, warps, programs) of a segment's small runs
        s_blk, s_warps, s_programs = blk, small_warps, max_small
        if not seg.single and not elementwise:  # several buffers: the width rule (`multi_block`)
            s_blk = config.small_block or multi_block(seg)
            s_programs = max_small if interpret and config.small_programs is None else 2 * max_small
        if (config.narrow_block and seg.width <= config.merge_width and not elementwise
                and config.small_block is None):
            s_blk = config.narrow_block
        return s_blk, s_warps, max(1, min(s_programs, -(-n // s_blk)))

    for group in small_launches(segs, config.merge_width):
        blocks, warps, programs = zip(*map(small_launch, group))
        widths = sorted({seg.width for seg in group})
        aliased(functools.partial(small_kernel, opt=opt, segs=group, blocks=blocks, programs=programs,
                                  scaled=scaled, align=align, small=small),
                f"tbe_backward_small_runs_w{widths[0]}" + (f"-{widths[-1]}" if len(widths) > 1 else ""),
                sum(programs), [rng, hyper, runs.run_start, runs.run_key] + common,
                [g for seg in group for g in seg.buffers],
                plgpu.CompilerParams(num_warps=max(warps), num_stages=1))
    p_mc = max(p_mid, p_chunk)
    # One mid/chunk launch and one long-run launch per memory kind (device segments, then host ones: each kind's
    # segments are contiguous in key order, `runs.width_classes`); a device-only model has one of each.
    for loc in dict.fromkeys(seg.location for seg in segs):
        mine = tuple(seg for seg in segs if seg.location == loc)
        bufs = [g for seg in mine for g in seg.buffers]
        part_shape = jax.ShapeDtypeStruct((max_chunks, max(seg.width for seg in mine)), jnp.float32)
        # rows gathered / partials summed a step, per segment (`BackwardConfig.step_width`)
        ks = tuple(config.steps_at(config.lookups_per_step, seg.width) for seg in mine)
        blocks = tuple(config.steps_at(config.long_block, seg.width) for seg in mine)
        part, = aliased(functools.partial(mid_chunk_kernel, opt=opt, segs=mine, k=ks, programs=p_mc, scaled=scaled,
                                          prefetch=prefetch, align=align, long_run=long_run,
                                          split_chunk=config.mid_chunk),
                        "tbe_backward_mid_runs_chunks", p_mc,
                        [rng, hyper, runs.mid, runs.long_chunk0, runs.long, runs.run_start, runs.run_key] + common,
                        bufs, extra=[part_shape])
        aliased(functools.partial(long_kernel, opt=opt, segs=mine, programs=p_long, block=blocks),
                "tbe_backward_long_runs", p_long, [rng, hyper, runs.long, runs.long_chunk0, runs.run_key, part],
                bufs, plgpu.CompilerParams(num_warps=config.long_num_warps or config.num_warps, num_stages=1))
    return new_w, new_s
