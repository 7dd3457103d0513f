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

RADIX_BITS = 4
BLOCK = 256


def _digits(key_ref, n, block, shift, radix):
    j = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    ok = j < n
    k = plgpu.load(key_ref.at[j], mask=ok, other=0)
    d = jnp.where(ok, jnp.right_shift(k, shift) & (radix - 1), -1)  # masked lanes match no digit
    onehot = (d[:, None] == jnp.arange(radix, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    return j, ok, k, onehot


def _count_kernel(key_ref, cnt_ref, *, n, block, shift, radix, n_blocks):
    _, _, _, onehot = _digits(key_ref, n, block, shift, radix)
    r = jnp.arange(radix, dtype=jnp.int32)
    plgpu.store(cnt_ref.at[r * n_blocks + pl.program_id(0)], jnp.sum(onehot, axis=0))


def _scatter_kernel(key_ref, *refs, n, n_payload, block, shift, radix, n_blocks):
    pay_refs, offs_ref = refs[:n_payload], refs[n_payload]
    out_key_ref, out_refs = refs[n_payload + 1], refs[n_payload + 2:]
    j, ok, k, onehot = _digits(key_ref, n, block, shift, radix)
    r = jnp.arange(radix, dtype=jnp.int32)
    base = plgpu.load(offs_ref.at[r * n_blocks + pl.program_id(0)])
    before = jnp.cumsum(onehot, axis=0) - onehot  # keys of the same digit earlier in the block
    dest = jnp.sum(jnp.where(onehot > 0, before + base[None, :], 0), axis=1)
    # Lanes past the end get distinct out-of-range (masked) slots: interpret mode's masked store writes every
    # lane's old value back, which at a slot shared with a live lane could undo that lane's store.
    dest = jnp.where(ok, dest, j)
    plgpu.store(out_key_ref.at[dest], k, mask=ok)
    for src, dst in zip(pay_refs, out_refs):
        plgpu.store(dst.at[dest], plgpu.load(src.at[j], mask=ok), mask=ok)


def _bits(radix: int) -> int:
    return radix.bit_length() - 1


def passes(key_bits: int, radix_bits: int = RADIX_BITS) -> int:
    return max(1, -(-key_bits // radix_bits))


def radix_sort(keys: jax.Array, *payloads: jax.Array, key_bits: int, radix_bits: int = RADIX_BITS,
               block: int = BLOCK, interpret: bool = False):
    """`(sorted keys, *payloads in that order)`: `jax.lax.sort((keys, *payloads), num_keys=1, is_stable=True)`
    for `keys` `[N]` int32 in `[0, 2**key_bits)` (others: undefined order, never out-of-bounds writes).

    Each payload `[N]` of a 32-bit dtype. Per pass (`ceil(key_bits / radix_bits)` of them): a count launch, one
    XLA scan of the counts and a scatter launch.
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
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    kw = dict(n=n, block=block, radix=radix, n_blocks=n_blocks)
    out = (keys, *payloads)
    for p in range(passes(key_bits, radix_bits)):
        shift = p * radix_bits
        counts = pallas_call(
            functools.partial(_count_kernel, shift=shift, **kw),
            out_shape=jax.ShapeDtypeStruct((radix * n_blocks,), jnp.int32), grid=(n_blocks,),
            compiler_params=params, interpret=interpret, name="tbe_radix_counts",
        )(out[0])
        offsets = jnp.cumsum(counts) - counts
        out = tuple(pallas_call(
            functools.partial(_scatter_kernel, n_payload=len(payloads), shift=shift, **kw),
            out_shape=[jax.ShapeDtypeStruct((n,), x.dtype) for x in out], grid=(n_blocks,),
            compiler_params=params, interpret=interpret, name="tbe_radix_scatter",
        )(*out, offsets))
    return out
