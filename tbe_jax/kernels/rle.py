"""Run-length encoding of the sorted lookup keys in two Pallas passes.

`runs.build_runs` needs, from the sorted keys: the first sorted lookup of every
run, each run's key, the number of runs and of valid lookups, and the lists of
mid and long runs. In XLA ops that is a chain of ~15 small kernels (two
prefix sums, two scatters, concatenations, gathers), each a pass over N lookups
and a launch; on the H200 they took ~0.2 ms of a 0.7 ms backward
(`benchmarks/results/archive/trace-backward-*`). Here:

1. `_count_kernel`: per block of `block` sorted lookups (`BackwardConfig.rle_block`), count run starts
   (key differs from the previous one and is valid), starts of runs longer
   than `small` (the key `small` places further is the same), split
   into mid runs (shorter than `long`) and long runs (the key `long - 1` places
   further is the same), and valid lookups (`BackwardConfig.small_run_max`, `long_run`).
2. An exclusive prefix sum over the block counts (N / block values; `scan.exclusive_scan`, one program).
3. `_write_kernel`: per block, the in-block exclusive prefix sums give each start
   its run slot and each listed start its slot in its list; scatter the
   run's first lookup, its key, and the run index. With `fill`, slots past the counts get
   the fill values (`n_valid`, `total`, N), so every output element is written
   exactly once (scatter slots and fill slots are disjoint): no initialisation,
   no atomics, and the result is the same run to run. Without, only `run_start[num_runs]` (the last run's end)
   is written past the counts: on N lookups in few runs the fills are ~8 N of the pass's bytes, and no kernel
   reads past the counts.

With `bounds` (static keys, ascending: where the backward's segments of buffers
begin), the write pass also gives, per bound b, how many runs, mid runs and long
runs have keys below b: the slots of the first sorted lookup whose key is b or
more (position N if none), written by the one program holding it. The backward's
task ranges then need no pass over the runs per segment (`backward.task_ranges`).

4. `long_chunks`: one program over the long runs (their lengths from `run_start`) writes each one's first chunk
   task (a prefix sum of their chunk counts), the run counts and, from the edges, the segments' task ranges: what
   XLA's ops did in five launches (a select, a cumsum's two reduce-window fusions, two concatenations).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.kernels.scan import exclusive_scan


def _key(skey_ref, at, mask, other=None):
    """`skey_ref[at]` as int32 where `mask`, else `other` (None: a value equal to no valid key). Narrow unsigned keys
    (`runs.sort_key_dtype`) are loaded as they are and widened here (zero-extended), so no pass over N widens them
    before the kernels; their "no key" is the dtype's maximum (at least `total`: `encode` checks), not -1."""
    if skey_ref.dtype == jnp.int32:
        return plgpu.load(skey_ref.at[at], mask=mask, other=-1 if other is None else other)
    fill = jnp.iinfo(skey_ref.dtype).max if other is None else other
    return plgpu.load(skey_ref.at[at], mask=mask, other=jnp.asarray(fill, skey_ref.dtype)).astype(jnp.int32)


def _flags(skey_ref, pid, *, n, total, small, long, block):
    """Per sorted lookup of the block: (position, key, valid, run start, per list whether it starts a run of it).
    Lists: the runs longer than `small` and shorter than `long`, and those of `long` or more."""
    j = pid * block + jnp.arange(block, dtype=jnp.int32)
    live = j < n
    k = _key(skey_ref, j, live, total)
    prev = _key(skey_ref, j - 1, live & (j > 0))
    far = _key(skey_ref, j + small, j + small < n)
    valid = k < total
    start = valid & (k != prev)
    big = start & (far == k)
    is_long = start & (_key(skey_ref, j + long - 1, j + long - 1 < n) == k)
    lists = (big & ~is_long, is_long)
    i32 = jnp.int32
    return j, k, valid.astype(i32), start.astype(i32), tuple(x.astype(i32) for x in lists)


def _count_kernel(skey_ref, counts_ref, *, n, total, small, long, block):
    pid = pl.program_id(0)
    _, _, valid, start, lists = _flags(skey_ref, pid, n=n, total=total, small=small, long=long, block=block)
    sums = [jnp.sum(x) for x in (start, *lists, valid)]  # the scan's columns
    lane = jnp.arange(4, dtype=jnp.int32)
    c = sums[-1]
    for i in reversed(range(len(sums) - 1)):
        c = jnp.where(lane == i, sums[i], c)
    plgpu.store(counts_ref.at[pid * len(sums) + lane], c, mask=lane < len(sums))


def _write_kernel(skey_ref, base_ref, *refs, n, total, small, long, block, sizes, bounds, fill):
    # refs: the totals (runs, per list its count, valid), then the outputs: run_start, run_key, one per list, and
    # with `bounds` the edges
    n_lists = len(sizes)
    tot_refs, (run_start_ref, run_key_ref, *list_refs) = refs[: n_lists + 2], refs[n_lists + 2:]
    edges_ref = list_refs.pop() if bounds else None
    width = n_lists + 2
    pid = pl.program_id(0)
    j, k, _, start, lists = _flags(skey_ref, pid, n=n, total=total, small=small, long=long, block=block)
    zero = jnp.int32(0)
    num_runs, *counts, n_valid = (plgpu.load(r.at[zero]) for r in tot_refs)
    slot = plgpu.load(base_ref.at[pid * width]) + jnp.cumsum(start) - start
    is_start = start > 0
    plgpu.store(run_start_ref.at[slot], j, mask=is_start)
    plgpu.store(run_key_ref.at[slot], k, mask=is_start)
    # Fill the slots past the counts (each index j is this program's to fill); without `fill`, the last run's end.
    plgpu.store(run_start_ref.at[j], jnp.full_like(j, n_valid),
                mask=((j >= num_runs) & (j <= n)) if fill else (j == num_runs))
    if fill:
        plgpu.store(run_key_ref.at[j], jnp.full_like(j, total), mask=(j >= num_runs) & (j < n))
    lslots = []
    for i, (ref, flag, count, size) in enumerate(zip(list_refs, lists, counts, sizes)):
        lslot = plgpu.load(base_ref.at[pid * width + 1 + i]) + jnp.cumsum(flag) - flag
        lslots.append(lslot)
        plgpu.store(ref.at[lslot], slot, mask=flag > 0)
        if fill:
            plgpu.store(ref.at[j], jnp.full_like(j, n), mask=(j >= count) & (j < size))
    if bounds:
        _write_edges(skey_ref, edges_ref, pid, j, k, (slot, *lslots), n=n, total=total, bounds=bounds, block=block)


def _write_edges(skey_ref, edges_ref, pid, j, k, slots, *, n, total, bounds, block):
    """Per bound b held by this block: the exclusive run and list slots (`slots`, per lookup) at the first lookup
    whose key is b or more (position n, past the keys, if none; it reads as key `total`), into
    `edges_ref[b * len(slots) + c]`. Keys ascend, so that position is unique: each edge is written once."""
    j0 = pid * block
    first_prev = plgpu.load(skey_ref.at[jnp.maximum(j0 - 1, 0)]).astype(jnp.int32)
    first_prev = jnp.where(j0 > 0, first_prev, -1)
    last = j0 + block - 1
    last_key = jnp.where(last < n, plgpu.load(skey_ref.at[jnp.minimum(last, n - 1)]).astype(jnp.int32), total)
    prev = _key(skey_ref, j - 1, (j > 0) & (j <= n))
    width = len(slots)
    for bi, b in enumerate(bounds):
        def write(bi=bi, b=b):
            at = (j <= n) & (k >= b) & ((prev < b) | (j == 0))
            for c, x in enumerate(slots):
                plgpu.store(edges_ref.at[jnp.int32(bi * width + c)], jnp.sum(jnp.where(at, x, 0)))

        pl.when((first_prev < b) & (last_key >= b))(write)


def encode(skey: jax.Array, *, total: int, small: int, n_big_max: int, long: int, n_long_max: int,
           block: int, scan_chunk: int, bounds: tuple[int, ...] = (), fill: bool = True, interpret: bool = False):
    """Runs of the sorted keys `skey` ([N] int32, or the narrow unsigned dtype of `runs.sort_key_dtype(total)`;
    invalid keys == `total`, sorted last).

    Returns (run_start [N + 1], run_key [N], num_runs, n_valid, mid [n_big_max], n_mid, long [n_long_max], n_long):
    run r spans sorted lookups [run_start[r], run_start[r + 1]); run_start past
    the last run is n_valid, run_key is `total`; `mid` lists, in key order, the runs longer than `small` lookups
    and shorter than `long`, `long` those of `long` lookups or more, each padded with N. Matches the XLA ops of
    `runs.build_runs` exactly (tested). `block`: sorted lookups per program, `scan_chunk`: rows per step of the
    block counts' prefix sum (`scan.exclusive_scan`); both powers of 2. Without `fill`, `run_start[num_runs]` is
    n_valid and every slot past that and past the lists' counts is undefined.

    `bounds` (static keys in (0, total], ascending): one more result, `edges`
    `[len(bounds) * 3]`: per bound, the numbers of runs, mid runs and long runs whose keys are below it.
    """
    n = skey.shape[0]
    dt = jnp.dtype(skey.dtype)
    if dt != jnp.int32 and not (jnp.issubdtype(dt, jnp.unsignedinteger) and jnp.iinfo(dt).max >= total):
        raise ValueError(f"sorted keys of dtype {dt}: int32 or an unsigned dtype holding {total}")
    sizes = (n_big_max, n_long_max)
    if max(sizes) > n:
        raise ValueError(f"list sizes {sizes} must be <= N={n}")
    grid = n // block + 1  # the last block also covers run_start[N]
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    kw = dict(n=n, total=total, small=small, long=long, block=block)
    width = len(sizes) + 2
    bounds = tuple(int(b) for b in bounds)
    if bounds and (list(bounds) != sorted(bounds) or bounds[0] <= 0 or bounds[-1] > total):
        raise ValueError(f"bounds {bounds} must ascend within (0, {total}]")
    counts = pallas_call(
        functools.partial(_count_kernel, **kw),
        out_shape=jax.ShapeDtypeStruct((grid * width,), jnp.int32), grid=(grid,),
        compiler_params=params, interpret=interpret, name="tbe_runs_count",
    )(skey)
    # Each block's first run and list slots (and the totals): one single-program scan, not XLA's cumsum and sums.
    base, tot = exclusive_scan(counts, width, chunk=scan_chunk, interpret=interpret)
    outs = pallas_call(
        functools.partial(_write_kernel, sizes=sizes, bounds=bounds, fill=bool(fill), **kw),
        out_shape=[jax.ShapeDtypeStruct((n + 1,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)]
        + [jax.ShapeDtypeStruct((s,), jnp.int32) for s in sizes]
        + ([jax.ShapeDtypeStruct((len(bounds) * (len(sizes) + 1),), jnp.int32)] if bounds else []),
        grid=(grid,), compiler_params=params, interpret=interpret, name="tbe_runs_write",
    )(skey, base, *tot)
    num_runs, *counts, n_valid = (x.reshape(()) for x in tot)
    lists = [x for pair in zip(outs[2 : 2 + len(sizes)], counts) for x in pair]
    return (outs[0], outs[1], num_runs, n_valid, *lists) + ((outs[-1],) if bounds else ())


def _chunks_kernel(run_start_ref, long_ref, num_runs_ref, n_mid_ref, n_long_ref, *refs, n, long_run, split_chunk,
                   chunk, segments):
    edges_ref = refs[0] if segments > 1 else None
    chunk0_ref, counts_ref, ranges_ref = refs[-3:]
    zero = jnp.int32(0)
    n_long = plgpu.load(n_long_ref.at[zero])
    r = jnp.arange(chunk, dtype=jnp.int32)
    # The long-run index of each inner segment edge: its entry of the prefix sum is caught as the loop passes it.
    at = [plgpu.load(edges_ref.at[jnp.int32(3 * s + 2)]) for s in range(segments - 1)]

    def body(i, carry):  # the chunk tasks of the long runs before this step's, the edges' entries
        total, caught = carry
        j = i * chunk + r
        ok = j < n_long
        li = jnp.minimum(plgpu.load(long_ref.at[j], mask=ok, other=0), n - 1)
        length = plgpu.load(run_start_ref.at[li + 1], mask=ok, other=0) - plgpu.load(run_start_ref.at[li],
                                                                                      mask=ok, other=0)
        size = jnp.where(length >= long_run, jnp.int32(long_run), jnp.int32(split_chunk)) if split_chunk \
            else jnp.int32(long_run)
        tasks = jnp.where(ok, (length + size - 1) // size, 0)
        upto = total + jnp.cumsum(tasks)
        plgpu.store(chunk0_ref.at[j + 1], upto, mask=ok)
        caught = tuple(c + jnp.sum(jnp.where(ok & (j + 1 == e), upto, 0)) for c, e in zip(caught, at))
        return total + jnp.sum(tasks), caught

    total, caught = jax.lax.fori_loop(zero, (n_long + chunk - 1) // chunk, body, (zero, (zero,) * len(at)))
    slots = chunk0_ref.shape[0]

    wide = 4 * chunk  # stores only: four times the lanes a step (the slots are ~N / 128: 20k on 2.6M lookups)
    rw = jnp.arange(wide, dtype=jnp.int32)

    def fill(i, carry):  # every slot past the long runs holds the total (the kernels' searches read them)
        j = i * wide + rw
        plgpu.store(chunk0_ref.at[j], jnp.full_like(j, total), mask=(j > n_long) & (j < slots))
        return carry

    jax.lax.fori_loop(n_long // wide, (slots + wide - 1) // wide, fill, zero)
    plgpu.store(chunk0_ref.at[zero], zero)
    num_runs, n_mid = plgpu.load(num_runs_ref.at[zero]), plgpu.load(n_mid_ref.at[zero])
    lane = jnp.arange(4, dtype=jnp.int32)

    def put(ref, base, vals):  # 4 scalars at ref[base : base + 4]
        c = vals[-1]
        for k in reversed(range(3)):
            c = jnp.where(lane == k, vals[k], c)
        plgpu.store(ref.at[base + lane], c)

    put(counts_ref, zero, (num_runs - n_mid - n_long, n_mid, n_long, total))
    # Per segment, [lo, hi) in the runs, the mid runs, the chunk tasks and the long runs (`task_ranges`' rows):
    # between consecutive edges, the first all zero, the last the totals.
    rows = [(zero, zero, zero, zero)]
    for s in range(segments - 1):
        e = [plgpu.load(edges_ref.at[jnp.int32(3 * s + c)]) for c in range(3)]
        rows.append((e[0], e[1], caught[s], e[2]))
    rows.append((num_runs, n_mid, total, n_long))
    for s in range(segments):
        lo, hi = rows[s], rows[s + 1]
        put(ranges_ref, jnp.int32(8 * s), (lo[0], hi[0], lo[1], hi[1]))
        put(ranges_ref, jnp.int32(8 * s + 4), (lo[2], hi[2], lo[3], hi[3]))


def ranges_from_edges(num_runs, n_mid, n_long, long_chunk0, edges=None) -> jax.Array:
    """`[S, 8]` int32, per segment its [lo, hi) in the runs, the mid runs, the chunk tasks and the long runs, in
    XLA ops (`backward.task_ranges`' table): between consecutive rows of the counts below each inner segment
    edge (`edges`, `[(S - 1) * 3]` from `encode(bounds=...)`, None for one segment), after a row of zeros and
    before the totals. A long run's chunks are contiguous in the chunk list, so a segment's chunk bounds are its
    long bounds' first chunks."""
    inner = [] if edges is None else [edges.reshape(-1, 3)]
    rows = jnp.concatenate([jnp.zeros((1, 3), jnp.int32)] + inner
                           + [jnp.stack([num_runs, n_mid, n_long]).astype(jnp.int32)[None, :]], axis=0)
    cols = [rows[:, 0], rows[:, 1], long_chunk0[rows[:, 2]], rows[:, 2]]
    return jnp.stack([e for c in cols for e in (c[:-1], c[1:])], axis=1)


def long_chunks(run_start, long, num_runs, n_mid, n_long, edges=None, *, long_run: int, split_chunk: int,
                chunk: int, interpret: bool = False, kernel: bool | None = None):
    """The long runs' first chunk tasks, the run counts and the segments' task ranges, from `encode`'s outputs
    (its `[]` counts and, for S segments, its `[(S - 1) * 3]` edges; None for one segment).

    Returns (long_chunk0 `[len(long) + 1]`: the exclusive prefix sum over the long runs of each one's chunk tasks,
    `ceil(L / c)` for a run of L lookups in chunks of c (`runs.chunk_length`); every slot past the long runs holds
    the total; counts `[4]`: small, mid and long runs and chunk tasks; ranges `[S, 8]`: per segment its [lo, hi)
    in the runs, the mid runs, the chunk tasks and the long runs, `backward.task_ranges`' table). One program
    walks the `n_long` long runs `chunk` at a time (`BackwardConfig.scan_chunk`), a few microseconds where XLA's
    ops (a select, a cumsum as two reduce-window fusions, three concatenations) are five or six launches. `kernel`
    None: the Pallas program when compiled, XLA's ops (the same integers) in interpret mode, as
    `scan.exclusive_scan`."""
    n = run_start.shape[0] - 1
    segments = 1 if edges is None else edges.shape[0] // 3 + 1
    if kernel is None:
        kernel = not interpret
    if not kernel:
        at = jnp.minimum(long, n - 1)
        length = jnp.where(jnp.arange(long.shape[0]) < n_long, run_start[at + 1] - run_start[at], 0)
        size = jnp.where(length >= long_run, long_run, split_chunk) if split_chunk else long_run
        tasks = (length + size - 1) // size
        chunk0 = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tasks).astype(jnp.int32)])
        counts = jnp.stack([num_runs - n_mid - n_long, n_mid, n_long, chunk0[-1]]).astype(jnp.int32)
        return chunk0, counts, ranges_from_edges(num_runs, n_mid, n_long, chunk0, edges)
    one = lambda x: jnp.reshape(x, (1,)).astype(jnp.int32)  # noqa: E731  (a bitcast of encode's [1] totals)
    chunk0, counts, ranges = pallas_call(
        functools.partial(_chunks_kernel, n=n, long_run=long_run, split_chunk=split_chunk, chunk=chunk,
                          segments=segments),
        out_shape=[jax.ShapeDtypeStruct((long.shape[0] + 1,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
                   jax.ShapeDtypeStruct((8 * segments,), jnp.int32)],
        grid=(1,), compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="tbe_long_chunks",
    )(run_start, long, one(num_runs), one(n_mid), one(n_long), *(() if edges is None else (edges,)))
    return chunk0, counts, ranges.reshape(segments, 8)
