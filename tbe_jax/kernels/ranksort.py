"""A stable sort of an int32 key array with payloads by counting ranks: one or two Pallas launches, no XLA sort.

XLA's GPU sort of a small array (below its radix-sort threshold, ~22k 32-bit keys on Hopper) is a bitonic network
of several launches, and inside the backward (two or three operands) it costs 0.04-0.09 ms on the H200 however few
keys there are; past the threshold CUB's radix sort still costs ~0.035 ms and a memset. Here each key's place in the
stable order is its rank, counted:

    rank(i) = #{j : key[j] < key[i]} + #{j < i : key[j] == key[i]}

(a total order on (key, position): ranks are distinct, and the result is the stable sort's).

1. Chunk ranks (`_chunk_kernel`): the positions are cut into chunks of `chunk` consecutive positions; each program
   takes `block_i` keys and counts, against every key of its chunk (`block_j` at a time, one compare and one add
   per pair, summed element-wise and reduced once), its rank within the chunk. One chunk (N <= chunk): these are
   the ranks, and the keys and payloads are scattered to them: one launch.
2. Merge ranks (`_merge_kernel`, several chunks): the chunk-sorted keys are sorted runs, and a key's rank is its
   rank in its own chunk plus, per other chunk, a binary search: the keys <= it in earlier chunks (their positions
   are all smaller), the keys < it in later ones. Then keys and payloads (gathered through the saved positions) go
   to their ranks. `_wide_merge_kernel` (`BackwardConfig.rank_sort_wide_block`, while its tile holds at most
   `rank_sort_wide_tile` keys) runs a key's searches in all other chunks at once instead of one chunk after another.

Every output slot is written exactly once: no atomics, no initialisation, the same result run to run. The work is
N * chunk compares plus N * (N / chunk) * log2(chunk) search steps; `BackwardConfig.rank_sort_max` says up to which
N the backward takes it (`benchmarks/results/ranksort-*.json`). Keys must be below 2**31 - 1 (the value past the end).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu

_FAR = 2**31 - 1  # the key of positions past the end: above every key, counted by neither test


def _chunk_kernel(key_ref, *refs, n, n_payload, block_i, block_j, chunk, final):
    pay_refs, out_key_ref, out_refs = refs[:n_payload], refs[n_payload], refs[n_payload + 1:]
    pid = pl.program_id(0)
    i = pid * block_i + jnp.arange(block_i, dtype=jnp.int32)
    ok_i = i < n
    ki = plgpu.load(key_ref.at[i], mask=ok_i, other=0)

    def keys(t):
        j = t * block_j + jnp.arange(block_j, dtype=jnp.int32)
        return j, plgpu.load(key_ref.at[j], mask=j < n, other=_FAR)

    # Blocks of j before the one holding this program's keys hold only earlier positions (count key <= ki), those
    # after it only later ones (count key < ki): one compare and one add per pair. Only the diagonal block compares
    # positions.
    def before(t, acc):
        return acc + (keys(t)[1][None, :] <= ki[:, None]).astype(jnp.int32)

    def after(t, acc):
        return acc + (keys(t)[1][None, :] < ki[:, None]).astype(jnp.int32)

    first = pid * block_i // chunk * chunk  # the chunk's first position
    t_first, t0 = first // block_j, pid * block_i // block_j
    t_end = jnp.minimum(first + chunk, n + block_j - 1) // block_j
    acc = jnp.zeros((block_i, block_j), jnp.int32)
    acc = jax.lax.fori_loop(t_first, t0, before, acc)
    j, kj = keys(t0)
    diag = (kj[None, :] < ki[:, None]) | ((kj[None, :] == ki[:, None]) & (j[None, :] < i[:, None]))
    acc = jax.lax.fori_loop(t0 + 1, t_end, after, acc + diag.astype(jnp.int32))
    rank = first + jnp.sum(acc, axis=1)
    # Lanes past the end get distinct (out-of-range, masked) slots: interpret mode's masked store writes every
    # lane's old value back, which at a slot shared with a live lane could undo that lane's store.
    rank = jnp.where(ok_i, rank, i)
    plgpu.store(out_key_ref.at[rank], ki, mask=ok_i)
    if final:
        for src, dst in zip(pay_refs, out_refs):
            plgpu.store(dst.at[rank], plgpu.load(src.at[i], mask=ok_i), mask=ok_i)
    else:  # the positions, for the merge pass to gather the payloads through
        plgpu.store(out_refs[0].at[rank], i, mask=ok_i)


def _merge_kernel(ckey_ref, cpos_ref, *refs, n, n_payload, chunk, block):
    pay_refs, out_key_ref, out_pay_refs = refs[:n_payload], refs[n_payload], refs[n_payload + 1:]
    q = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    ok = q < n
    k = plgpu.load(ckey_ref.at[q], mask=ok, other=0)
    c = pl.program_id(0) * block // chunk  # the program's chunk (block divides chunk)
    steps = chunk.bit_length()

    def count(b, total):
        lo0 = b * chunk
        hi0 = jnp.minimum(lo0 + chunk, n)

        def halve(_, bounds):
            lo, hi = bounds
            mid = (lo + hi) // 2
            live = lo < hi
            v = plgpu.load(ckey_ref.at[mid], mask=live, other=0)
            below = jnp.where(b < c, v <= k, v < k)
            return jnp.where(live & below, mid + 1, lo), jnp.where(live & ~below, mid, hi)

        lo, _ = jax.lax.fori_loop(0, steps, halve, (jnp.full(k.shape, lo0, jnp.int32),
                                                     jnp.full(k.shape, hi0, jnp.int32)))
        return total + jnp.where(b == c, q - lo0, lo - lo0)

    rank = jax.lax.fori_loop(0, pl.cdiv(n, chunk), count, jnp.zeros(k.shape, jnp.int32))
    rank = jnp.where(ok, rank, q)  # distinct slots for the masked lanes (see `_chunk_kernel`)
    pos = plgpu.load(cpos_ref.at[q], mask=ok, other=0)
    plgpu.store(out_key_ref.at[rank], k, mask=ok)
    for src, dst in zip(pay_refs, out_pay_refs):
        plgpu.store(dst.at[rank], plgpu.load(src.at[pos], mask=ok), mask=ok)


def _wide_merge_kernel(ckey_ref, cpos_ref, *refs, n, n_payload, chunk, block, chunks_p2):
    """`_merge_kernel` with the other chunks searched at once: `[block, chunks_p2]` bounds, one gather of that shape
    a halving step, so a key's searches are `log2(chunk)` dependent loads instead of that many per chunk."""
    pay_refs, out_key_ref, out_pay_refs = refs[:n_payload], refs[n_payload], refs[n_payload + 1:]
    q = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    ok = q < n
    k = plgpu.load(ckey_ref.at[q], mask=ok, other=0)[:, None]
    c = pl.program_id(0) * block // chunk  # the program's chunk (block divides chunk)
    b = jnp.arange(chunks_p2, dtype=jnp.int32)[None, :]
    lo0 = b * chunk  # chunks past the last (b * chunk >= n) are empty: hi0 = n <= lo0, nothing is searched
    hi0 = jnp.minimum(lo0 + chunk, n)
    earlier, other = b < c, b != c

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        live = (lo < hi) & other
        v = plgpu.load(ckey_ref.at[mid], mask=live, other=0)
        below = jnp.where(earlier, v <= k, v < k)
        return jnp.where(live & below, mid + 1, lo), jnp.where(live & ~below, mid, hi)

    shape = (block, chunks_p2)
    lo, _ = jax.lax.fori_loop(0, chunk.bit_length(), halve,
                              (jnp.broadcast_to(lo0, shape), jnp.broadcast_to(hi0, shape)))
    rank = jnp.sum(jnp.where(other, lo - lo0, 0), axis=1) + q - c * chunk
    rank = jnp.where(ok, rank, q)  # distinct slots for the masked lanes (see `_chunk_kernel`)
    pos = plgpu.load(cpos_ref.at[q], mask=ok, other=0)
    plgpu.store(out_key_ref.at[rank], k[:, 0], mask=ok)
    for src, dst in zip(pay_refs, out_pay_refs):
        plgpu.store(dst.at[rank], plgpu.load(src.at[pos], mask=ok), mask=ok)


def rank_sort(keys: jax.Array, *payloads: jax.Array, block_i: int, block_j: int, chunk: int, merge_block: int,
              wide_block: int = 0, wide_tile: int = 512, interpret: bool = False):
    """`(sorted keys, *payloads in that order)`: `jax.lax.sort((keys, *payloads), num_keys=1, is_stable=True)`.

    `keys`: `[N]` int32 below 2**31 - 1; each payload `[N]` (any 32-bit dtype). `chunk` (a multiple of `block_j`
    and of `merge_block`, itself a multiple of `block_i`): positions ranked by direct comparison; larger inputs
    take the merge pass. The four sizes: `BackwardConfig.rank_sort_*` (`block_i`, `block_j` and `merge_block`
    powers of 2). `wide_block` (`BackwardConfig.rank_sort_wide_block`; a power of 2 dividing `chunk`, or 0): the
    merge pass searches all other chunks at once, `wide_block` keys a program (`_wide_merge_kernel`), while its
    tile, `wide_block` times the chunk count padded to a power of 2, holds at most `wide_tile` keys
    (`BackwardConfig.rank_sort_wide_tile`); serially past that."""
    n = keys.shape[0]
    if keys.dtype != jnp.int32:
        raise TypeError(f"rank_sort: keys must be int32, got {keys.dtype}")
    for p in payloads:
        if p.shape != keys.shape:
            raise ValueError(f"rank_sort: payload shape {p.shape} must match keys {keys.shape}")
    if block_j % block_i or chunk % block_j or chunk % merge_block:
        raise ValueError(f"rank_sort: block_j={block_j} must be a multiple of block_i={block_i}, and chunk={chunk} "
                         f"of block_j and of merge_block={merge_block}")
    if wide_block and (wide_block & (wide_block - 1) or chunk % wide_block):
        raise ValueError(f"rank_sort: wide_block={wide_block} must be 0 or a power of 2 dividing chunk={chunk}")
    if n == 0:
        return (keys, *payloads)
    final = n <= chunk
    i32 = jax.ShapeDtypeStruct((n,), jnp.int32)
    outs = [i32] + ([jax.ShapeDtypeStruct((n,), p.dtype) for p in payloads] if final else [i32])
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    res = pallas_call(
        functools.partial(_chunk_kernel, n=n, n_payload=len(payloads), block_i=block_i, block_j=block_j,
                          chunk=chunk, final=final),
        out_shape=outs, grid=(pl.cdiv(n, block_i),), compiler_params=params, interpret=interpret,
        name="tbe_rank_sort",
    )(keys, *payloads)
    if final:
        return tuple(res)
    ckey, cpos = res
    chunks_p2 = 1 << (pl.cdiv(n, chunk) - 1).bit_length()
    if wide_block and wide_block * chunks_p2 <= wide_tile:
        merge = functools.partial(_wide_merge_kernel, n=n, n_payload=len(payloads), chunk=chunk, block=wide_block,
                                  chunks_p2=chunks_p2)
        merge_block = wide_block
    else:
        merge = functools.partial(_merge_kernel, n=n, n_payload=len(payloads), chunk=chunk, block=merge_block)
    res = pallas_call(
        merge,
        out_shape=[i32] + [jax.ShapeDtypeStruct((n,), p.dtype) for p in payloads],
        grid=(pl.cdiv(n, merge_block),), compiler_params=params, interpret=interpret, name="tbe_rank_sort_merge",
    )(ckey, cpos, *payloads)
    return tuple(res)
