"""Run-length encoding of the sorted lookup keys in two Pallas passes.

`runs.build_runs` needs, from the sorted keys: the first sorted lookup of every
run, each run's key, the number of runs and of valid lookups, and the list of
runs longer than `SMALL`. In XLA ops that is a chain of ~15 small kernels (two
prefix sums, two scatters, concatenations, gathers), each a pass over N lookups
and a launch; on the H200 they took ~0.2 ms of a 0.7 ms backward
(`benchmarks/results/trace-backward-*`). Here:

1. `_count_kernel`: per block of `BLOCK` sorted lookups, count run starts
   (key differs from the previous one and is valid), long starts (the key
   `SMALL` places further is the same: the run has more than `SMALL` lookups)
   and valid lookups.
2. An exclusive prefix sum over the block counts (N / BLOCK values; `scan.exclusive_scan`, one program).
3. `_write_kernel`: per block, the in-block exclusive prefix sums give each start
   its run slot and each long start its slot in the long list; scatter the
   run's first lookup, its key, and the run index. Slots past the counts get
   the fill values (`n_valid`, `total`, N), so every output element is written
   exactly once (scatter slots and fill slots are disjoint): no initialisation,
   no atomics, and the result is the same run to run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax._pallas import pallas_call, pl, plgpu
from tbe_jax.kernels.scan import exclusive_scan

BLOCK = 1024


def _flags(skey_ref, pid, *, n, total, small):
    j = pid * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    live = j < n
    k = plgpu.load(skey_ref.at[j], mask=live, other=total)
    prev = plgpu.load(skey_ref.at[j - 1], mask=live & (j > 0), other=-1)
    far = plgpu.load(skey_ref.at[j + small], mask=j + small < n, other=-1)
    valid = k < total
    start = valid & (k != prev)
    long = start & (far == k)
    return j, k, valid.astype(jnp.int32), start.astype(jnp.int32), long.astype(jnp.int32)


def _count_kernel(skey_ref, counts_ref, *, n, total, small):
    pid = pl.program_id(0)
    _, _, valid, start, long = _flags(skey_ref, pid, n=n, total=total, small=small)
    lane = jnp.arange(4, dtype=jnp.int32)
    c = jnp.where(lane == 0, jnp.sum(start), jnp.where(lane == 1, jnp.sum(long), jnp.sum(valid)))
    plgpu.store(counts_ref.at[pid * 3 + lane], c, mask=lane < 3)


def _write_kernel(skey_ref, base_ref, runs_ref, big_count_ref, valid_ref, run_start_ref, run_key_ref, big_ref, *, n,
                  total, small, n_big_max):
    pid = pl.program_id(0)
    j, k, _, start, long = _flags(skey_ref, pid, n=n, total=total, small=small)
    zero = jnp.int32(0)
    num_runs, n_big, n_valid = (plgpu.load(r.at[zero]) for r in (runs_ref, big_count_ref, valid_ref))
    slot = plgpu.load(base_ref.at[pid * 3]) + jnp.cumsum(start) - start
    bslot = plgpu.load(base_ref.at[pid * 3 + 1]) + jnp.cumsum(long) - long
    is_start, is_long = start > 0, long > 0
    plgpu.store(run_start_ref.at[slot], j, mask=is_start)
    plgpu.store(run_key_ref.at[slot], k, mask=is_start)
    plgpu.store(big_ref.at[bslot], slot, mask=is_long)
    # Fill the slots past the counts (each index j is this program's to fill).
    plgpu.store(run_start_ref.at[j], jnp.full_like(j, n_valid), mask=(j >= num_runs) & (j <= n))
    plgpu.store(run_key_ref.at[j], jnp.full_like(j, total), mask=(j >= num_runs) & (j < n))
    plgpu.store(big_ref.at[j], jnp.full_like(j, n), mask=(j >= n_big) & (j < n_big_max))


def encode(skey: jax.Array, *, total: int, small: int, n_big_max: int, interpret: bool = False):
    """Runs of the sorted keys `skey` ([N] int32, invalid keys == `total`, sorted last).

    Returns (run_start [N + 1], run_key [N], num_runs, n_valid, big [n_big_max], n_big):
    run r spans sorted lookups [run_start[r], run_start[r + 1]); run_start past
    the last run is n_valid, run_key is `total`; `big` lists, in key order, the
    runs longer than `small` lookups, padded with N. Matches the XLA ops of
    `runs.build_runs` exactly (tested).
    """
    n = skey.shape[0]
    if n_big_max > n:
        raise ValueError(f"n_big_max={n_big_max} must be <= N={n}")
    grid = n // BLOCK + 1  # the last block also covers run_start[N]
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    kw = dict(n=n, total=total, small=small)
    counts = pallas_call(
        functools.partial(_count_kernel, **kw),
        out_shape=jax.ShapeDtypeStruct((grid * 3,), jnp.int32), grid=(grid,),
        compiler_params=params, interpret=interpret, name="tbe_runs_count",
    )(skey)
    # Each block's first run / long run (and the totals): one single-program scan, not XLA's cumsum and sums.
    base, tot = exclusive_scan(counts, 3, interpret=interpret)
    run_start, run_key, big = pallas_call(
        functools.partial(_write_kernel, n_big_max=n_big_max, **kw),
        out_shape=[jax.ShapeDtypeStruct((n + 1,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32),
                   jax.ShapeDtypeStruct((n_big_max,), jnp.int32)],
        grid=(grid,), compiler_params=params, interpret=interpret, name="tbe_runs_write",
    )(skey, base, *tot)
    num_runs, n_big, n_valid = (x.reshape(()) for x in tot)
    return run_start, run_key, num_runs, n_valid, big, n_big
