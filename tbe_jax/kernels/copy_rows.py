"""Row copies between two buffers, in place: the host tier's write-backs and fills (`tbe_jax.host_cache`).

`copy_rows(dst, src, dst_rows, src_rows)` sets `dst[dst_rows[i]] = src[src_rows[i]]` for every `i` whose two row
ids are >= 0, and leaves every other row of `dst` as it was (`dst` is aliased to the result: donated, nothing is
copied). Either buffer may live in pinned host memory: the kernel then reads or writes its rows over the bus,
which no XLA op can do (`tbe_jax.memory`). Rows are `[R, W]` (table rows, element-wise optimizer state) or `[R]`
(row-wise state). Distinct `dst_rows` (>= 0) are assumed: two copies into one row would race.

`after`: arrays the kernel takes and ignores, so that XLA runs the copy after whatever made them. The host
tier's prefetch orders its write-back into a host part after the fill that read that part, so that XLA need not
copy the whole part to keep the value the fill read (`tbe_jax.cache_prefetch`).

Without the kernels (`kernel=False`: the XLA path on a CPU) the same copy is one gather and one scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2


def copy_block(dst_ref, src_ref, dst_rows_ref, src_rows_ref, b, *, n: int, block: int, width: int | None):
    """Inside a kernel: pairs `[b * block, (b + 1) * block)` of `n`, `dst_ref[dst_rows[i]] = src_ref[src_rows[i]]`
    where both ids are >= 0 (rows `[R, width]`, or `[R]` with `width` None)."""
    i = b * block + jnp.arange(block, dtype=jnp.int32)
    live = i < n
    d = plgpu.load(dst_rows_ref.at[i], mask=live, other=-1)
    s = plgpu.load(src_rows_ref.at[i], mask=live, other=-1)
    ok = (d >= 0) & (s >= 0)
    # Masked lanes point past the end of `dst` (never at a real row: interpret mode stores every lane, writing
    # a masked lane's old value back, which would race with a live lane's store to the same row) and at row 0
    # of `src` (loads are clamped there).
    d = jnp.where(ok, d, dst_ref.shape[0])
    s = jnp.where(ok, s, 0)
    if width is None:
        plgpu.store(dst_ref.at[d], plgpu.load(src_ref.at[s], mask=ok, other=0), mask=ok)
        return
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)
    m = ok[:, None] & (cols < width)[None, :]
    v = plgpu.load(src_ref.at[s[:, None], cols[None, :]], mask=m, other=0)
    plgpu.store(dst_ref.at[d[:, None], cols[None, :]], v, mask=m)


def block_rows(width: int | None, block_elems: int = 4096) -> int:
    """Pairs a program of `copy_block` copies: about `block_elems` values, at most 256 rows, a power of 2."""
    block = max(1, min(256, block_elems // next_pow2(width or 1)))
    return 1 << (block.bit_length() - 1)


def _kernel(dst_rows_ref, src_rows_ref, src_ref, dst_in_ref, *refs, n: int, block: int, width: int | None):
    del dst_in_ref  # aliased to dst_ref
    dst_ref = refs[-1]  # after the `after` operands (ignored)
    copy_block(dst_ref, src_ref, dst_rows_ref, src_rows_ref, pl.program_id(0), n=n, block=block, width=width)


def copy_rows(dst: jax.Array, src: jax.Array, dst_rows: jax.Array, src_rows: jax.Array, *, kernel: bool,
              interpret: bool = False, block_elems: int = 4096, after: tuple = (), name: str = "") -> jax.Array:
    """`dst` with rows `dst_rows[i]` set to `src`'s rows `src_rows[i]` (pairs with a negative id skipped), copied
    after the arrays `after` exist (see the module doc). `name`: a suffix of the kernel's name (a profile then
    tells a fill from a write-back)."""
    if dst.ndim != src.ndim or dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError(f"copy_rows: rows of {src.dtype}{list(src.shape)} do not fit {dst.dtype}{list(dst.shape)}")
    n = dst_rows.shape[0]
    if n == 0 or dst.shape[0] == 0 or src.shape[0] == 0:
        return dst
    dst_rows = dst_rows.astype(jnp.int32)
    src_rows = src_rows.astype(jnp.int32)
    if not kernel:
        ok = (dst_rows >= 0) & (src_rows >= 0)
        vals = src[jnp.clip(src_rows, 0, src.shape[0] - 1)]
        return dst.at[jnp.where(ok, dst_rows, dst.shape[0])].set(vals, mode="drop")
    width = None if dst.ndim == 1 else dst.shape[1]
    block = block_rows(width, block_elems)
    after = tuple(after)
    return pallas_call(
        functools.partial(_kernel, n=n, block=block, width=width),
        out_shape=jax.ShapeDtypeStruct(dst.shape, dst.dtype),
        grid=(pl.cdiv(n, block),),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tbe_copy_rows" + (f"_{name}" if name else ""),
    )(dst_rows, src_rows, src, dst, *after)
