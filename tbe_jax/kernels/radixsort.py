"""A stable LSD radix sort of int32 keys with payloads in Pallas: no XLA sort, so no CUB custom call.

Why not XLA's sort past the counting-rank sort's reach (`kernels.ranksort`): on the H200 XLA sorts these arrays with
CUB's radix sort, a custom call that XLA cannot capture in the step's CUDA graph. The step then runs as separate
launches around it, and that call alone costs ~70 us of host time: a backward step of 31k-1.8M lookups took
130-180 us of host time per call against 37 us with the Pallas sort (`benchmarks/results/enqueue-gap-*.json`),
so its enqueued time was 2-3.7x its device time. Here every launch is a plain kernel or an XLA fusion: the whole
step stays one graph.

Keys below `2**key_bits` are sorted `radix_bits` bits at a time, least significant digit first. One pass:
1. Digit counts (`_count_kernel`): block b of `block` consecutive positions counts each digit value r:
   `counts[r, b]` (digit-major).
2. Offsets: the exclusive prefix sum of `counts` flattened digit-major (one XLA scan): `offs[r, b]` = the keys
   with a smaller digit, plus the keys of digit r in earlier blocks.
3. Scatter (`_scatter_kernel`): key i of block b with digit r goes to `offs[r, b]` plus the number of keys of
   digit r before it in its block (a prefix sum down the block's one-hot `[block, radix]` matrix), with its
   payloads. Blocks and positions within a block keep their order, so each pass is stable, hence the sort.

Every output slot is written exactly once per pass: no atomics, no initialisation, the same result run to run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax._pallas import pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2

RADIX_BITS = 4
BLOCK = 256
# Up to this many entries (digits x blocks, padded) each scatter program sums the counts matrix itself for its
# offsets; past it one XLA scan per pass computes them (a launch more, for large inputs).
SCAN_MAX = 8192


def _digits(key_ref, n, block, shift, radix):
    j = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    ok = j < n
    k = plgpu.load(key_ref.at[j], mask=ok, other=0)
    d = jnp.where(ok, jnp.right_shift(k, shift) & (radix - 1), -1)  # masked lanes match no digit
    onehot = (d[:, None] == jnp.arange(radix, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    return j, ok, k, onehot


def _count_kernel(key_ref, cnt_in_ref, cnt_ref, *, n, block, shift, radix, n_blocks):
    del cnt_in_ref  # aliased: the zeroed counts buffer (slice 0 is written here)
    _, _, _, onehot = _digits(key_ref, n, block, shift, radix)
    r = jnp.arange(radix, dtype=jnp.int32)
    plgpu.store(cnt_ref.at[r * n_blocks + pl.program_id(0)], jnp.sum(onehot, axis=0))


def _scatter_kernel(key_ref, *refs, n, n_payload, block, shift, radix, n_blocks, n_blocks_p2, base_at, scan,
                    next_at, scratch, interpret):
    pay_refs, cnt_ref, rest = refs[:n_payload], refs[n_payload], list(refs[n_payload + 1:])
    offs_ref = None if scan else rest.pop(0)
    out_key_ref, out_refs = rest[0], rest[1:1 + n_payload]
    cnt_out_ref = rest[1 + n_payload] if next_at is not None else None
    pid = pl.program_id(0)
    j, ok, k, onehot = _digits(key_ref, n, block, shift, radix)
    r = jnp.arange(radix, dtype=jnp.int32)
    if scan:  # this block's offsets from the whole counts matrix (small: at most SCAN_MAX entries)
        b = jnp.arange(n_blocks_p2, dtype=jnp.int32)
        c = plgpu.load(cnt_ref.at[base_at + r[:, None] * n_blocks + b[None, :]], mask=(b < n_blocks)[None, :],
                       other=0)
        tot = jnp.sum(c, axis=1)
        base = jnp.cumsum(tot) - tot + jnp.sum(jnp.where((b < pid)[None, :], c, 0), axis=1)
    else:
        base = plgpu.load(offs_ref.at[r * n_blocks + pid])
    before = jnp.cumsum(onehot, axis=0) - onehot  # keys of the same digit earlier in the block
    dest = jnp.sum(jnp.where(onehot > 0, before + base[None, :], 0), axis=1)
    # Lanes past the end get distinct out-of-range (masked) slots: interpret mode's masked store writes every
    # lane's old value back, which at a slot shared with a live lane could undo that lane's store.
    dest = jnp.where(ok, dest, j)
    plgpu.store(out_key_ref.at[dest], k, mask=ok)
    for src, dst in zip(pay_refs, out_refs):
        plgpu.store(dst.at[dest], plgpu.load(src.at[j], mask=ok), mask=ok)
    if cnt_out_ref is not None:  # the next pass's digit counts, per block of the order written here
        d_next = jnp.right_shift(k, shift + _bits(radix)) & (radix - 1)
        slot = jnp.where(ok, next_at + d_next * n_blocks + dest // block, scratch)  # (interpret: no masked atomics)
        if interpret:  # interpret mode's vector atomic drops repeated indices' adds: one lane at a time
            jax.lax.fori_loop(0, block, lambda i, c: (plgpu.atomic_add(cnt_out_ref, slot[i], jnp.int32(1)), c)[1],
                              jnp.int32(0))
        else:
            plgpu.atomic_add(cnt_out_ref, slot, jnp.ones((block,), jnp.int32))


def _bits(radix: int) -> int:
    return radix.bit_length() - 1


def passes(key_bits: int, radix_bits: int = RADIX_BITS) -> int:
    return max(1, -(-key_bits // radix_bits))


def radix_sort(keys: jax.Array, *payloads: jax.Array, key_bits: int, radix_bits: int = RADIX_BITS,
               block: int = BLOCK, scan_max: int = SCAN_MAX, interpret: bool = False):
    """`(sorted keys, *payloads in that order)`: `jax.lax.sort((keys, *payloads), num_keys=1, is_stable=True)`
    for `keys` `[N]` int32 in `[0, 2**key_bits)` (others: undefined order, never out-of-bounds writes).

    Each payload `[N]` of a 32-bit dtype. `ceil(key_bits / radix_bits)` scatter launches after one count launch
    (and one XLA scan per pass when the counts matrix exceeds `scan_max` entries).
    """
    n = keys.shape[0]
    if keys.dtype != jnp.int32:
        raise TypeError(f"radix_sort: keys must be int32, got {keys.dtype}")
    for p in payloads:
        if p.shape != keys.shape:
            raise ValueError(f"radix_sort: payload shape {p.shape} must match keys {keys.shape}")
    if not 1 <= key_bits <= 31 or not 1 <= radix_bits <= 8:
        raise ValueError(f"radix_sort: key_bits={key_bits} must be in [1, 31] and radix_bits={radix_bits} in [1, 8]")
    if block < 16 or block & (block - 1):
        raise ValueError(f"radix_sort: block={block} must be a power of 2 >= 16")
    if n == 0:
        return (keys, *payloads)
    radix = 1 << radix_bits
    n_blocks = pl.cdiv(n, block)
    n_blocks_p2 = next_pow2(n_blocks)
    scan = radix * n_blocks_p2 <= scan_max
    n_pass = passes(key_bits, radix_bits)
    per = radix * n_blocks  # one pass's counts: [radix, n_blocks] digit-major
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    i32 = jnp.int32
    cnt = jnp.zeros((n_pass * per + 1,), i32)  # + a scratch slot for the masked lanes' atomics
    cnt = pallas_call(
        functools.partial(_count_kernel, n=n, block=block, shift=0, radix=radix, n_blocks=n_blocks),
        out_shape=jax.ShapeDtypeStruct(cnt.shape, i32), grid=(n_blocks,), input_output_aliases={1: 0},
        compiler_params=params, interpret=interpret, name="tbe_radix_counts",
    )(keys, cnt)
    out = (keys, *payloads)
    for p in range(n_pass):
        has_next = p + 1 < n_pass
        args = [*out, cnt]
        if not scan:
            c = cnt[p * per:(p + 1) * per]
            args.append(jnp.cumsum(c) - c)
        shapes = [jax.ShapeDtypeStruct((n,), x.dtype) for x in out]
        if has_next:
            shapes.append(jax.ShapeDtypeStruct(cnt.shape, i32))
        res = pallas_call(
            functools.partial(_scatter_kernel, n=n, n_payload=len(payloads), block=block, shift=p * radix_bits,
                              radix=radix, n_blocks=n_blocks, n_blocks_p2=n_blocks_p2, base_at=p * per, scan=scan,
                              next_at=(p + 1) * per if has_next else None, scratch=n_pass * per,
                              interpret=interpret),
            out_shape=shapes, grid=(n_blocks,),
            input_output_aliases={len(out): len(out)} if has_next else {},
            compiler_params=params, interpret=interpret, name="tbe_radix_scatter",
        )(*args)
        out = tuple(res[:len(out)])
        if has_next:
            cnt = res[len(out)]
    return out
