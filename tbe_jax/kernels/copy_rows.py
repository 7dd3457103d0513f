"""Row copies between buffers, in place: the host tier's fills and write-backs (`tbe_jax.host_cache`).

- `copy_rows(dst, src, dst_rows, src_rows)` sets `dst[dst_rows[i]] = src[src_rows[i]]` for every `i` whose two
  row ids are >= 0 and leaves every other row of `dst` as it was (`dst` is aliased to the result: donated,
  nothing is copied).
- `gather_rows(src, src_rows)`: fresh `[n, ...]` buffers, row `i` = `src[src_rows[i]]` where `src_rows[i] >= 0`
  (the other rows are unspecified: never read them).

Each takes one array or a tuple of arrays (a table's rows and its optimizer states: one set of row ids, one
launch). Any buffer may live in pinned host memory: the kernel then reads or writes its rows over the bus, which
no XLA op can do (`tbe_jax.memory`). A launch's outputs must lie in one memory: XLA refuses a kernel that writes
a host buffer and a device one in place (error E1200), so a fill (into HBM) and a write-back (into host memory)
are two launches. Rows are `[R, W]` (table rows, element-wise optimizer state) or `[R]`
(row-wise state). Distinct destination rows (>= 0) are assumed: two copies into one row would race.

`after`: arrays the kernel takes and ignores, so that XLA runs the copy after whatever made them.

Without the kernels (`kernel=False`: the XLA path on a CPU) each copy is one gather and one scatter per array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2


def block_rows(widths, block_elems: int = 4096) -> int:
    """Pairs a program copies: about `block_elems` values of the widest array (`widths`: each array's row width,
    None for `[R]`), at most 256 rows, a power of 2."""
    widest = max([w or 1 for w in widths] or [1])
    block = max(1, min(256, block_elems // next_pow2(widest)))
    return 1 << (block.bit_length() - 1)


def _pairs(dst_rows_ref, src_rows_ref, b, *, n: int, block: int):
    """Inside a kernel: the ids of pairs `[b * block, (b + 1) * block)` of `n` and which of them copy."""
    i = b * block + jnp.arange(block, dtype=jnp.int32)
    live = i < n
    d = plgpu.load(dst_rows_ref.at[i], mask=live, other=-1)
    s = plgpu.load(src_rows_ref.at[i], mask=live, other=-1)
    return d, s, (d >= 0) & (s >= 0)


def _copy(dst_ref, src_ref, d, s, ok):
    """Inside a kernel: `dst_ref[d[j]] = src_ref[s[j]]` where `ok[j]`."""
    # Masked lanes point past the end of `dst` (never at a real row: interpret mode stores every lane, writing
    # a masked lane's old value back, which would race with a live lane's store to the same row) and at row 0
    # of `src` (loads are clamped there).
    d = jnp.where(ok, d, dst_ref.shape[0])
    s = jnp.where(ok, s, 0)
    if len(dst_ref.shape) == 1:
        plgpu.store(dst_ref.at[d], plgpu.load(src_ref.at[s], mask=ok, other=0), mask=ok)
        return
    width = dst_ref.shape[1]
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)
    m = ok[:, None] & (cols < width)[None, :]
    v = plgpu.load(src_ref.at[s[:, None], cols[None, :]], mask=m, other=0)
    plgpu.store(dst_ref.at[d[:, None], cols[None, :]], v, mask=m)


def _kernel(dst_rows_ref, src_rows_ref, *refs, k: int, n: int, block: int, programs: int | None):
    """Program `b` copies pairs `[b * block, (b + 1) * block)` of `n` for each of the `k` arrays (with
    `programs`, a grid of that many: program `p` takes the blocks `p, p + programs, ...`). Refs after the row
    ids: the `k` sources, the inputs aliased to the outputs and the `after` operands (both ignored), then the
    `k` outputs."""
    def one(b):
        d, s, ok = _pairs(dst_rows_ref, src_rows_ref, b, n=n, block=block)
        for src_ref, dst_ref in zip(refs[:k], refs[len(refs) - k :]):
            _copy(dst_ref, src_ref, d, s, ok)

    pid = pl.program_id(0)
    if programs is None:
        one(pid)
        return
    blocks = -(-n // block)
    jax.lax.fori_loop(0, (blocks - pid + programs - 1) // programs, lambda t, c: (one(pid + t * programs), c)[1],
                      jnp.int32(0))


def _launch(dst_rows, src_rows, src, dst, *, fresh, interpret, block_elems, after, name, num_warps=4,
            programs=None):
    """One kernel copying `src[j]`'s rows into `dst[j]` for every `j`: `dst` written in place (aliased), or made
    fresh (`fresh`: `dst` are `ShapeDtypeStruct`s). `programs`: at most this many programs (each loops over its
    share of the blocks), leaving the rest of the GPU to kernels running beside the copy."""
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be None or a positive int, got {programs!r}")
    n = int(dst_rows.shape[0])
    block = block_rows([None if a.ndim == 1 else a.shape[1] for a in dst], block_elems)
    grid = -(-n // block)
    if programs is not None and programs >= grid:
        programs = None
    aliases = {} if fresh else {2 + len(src) + j: j for j in range(len(dst))}
    operands = [dst_rows, src_rows, *src] + ([] if fresh else list(dst)) + list(after)
    return pallas_call(
        functools.partial(_kernel, k=len(dst), n=n, block=block, programs=programs),
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in dst),
        grid=(grid if programs is None else programs,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*operands)


def _tuple(x):
    return (tuple(x), True) if isinstance(x, (tuple, list)) else ((x,), False)


def _check(dst, src, what):
    if len(dst) != len(src):
        raise ValueError(f"{what}: {len(src)} source arrays for {len(dst)} destinations")
    for a, b in zip(dst, src):
        if a.ndim != b.ndim or a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
            raise ValueError(f"{what}: rows of {b.dtype}{list(b.shape)} do not fit {a.dtype}{list(a.shape)}")


def _xla_copy(dst, src, dst_rows, src_rows):
    ok = (dst_rows >= 0) & (src_rows >= 0)
    at = jnp.where(ok, dst_rows, dst.shape[0])
    return dst.at[at].set(src[jnp.clip(src_rows, 0, src.shape[0] - 1)], mode="drop")


def copy_rows(dst, src, dst_rows: jax.Array, src_rows: jax.Array, *, kernel: bool, interpret: bool = False,
              block_elems: int = 4096, after: tuple = (), name: str = "", num_warps: int = 4,
              programs: int | None = None):
    """`dst` (an array or a tuple) with rows `dst_rows[i]` set to `src`'s rows `src_rows[i]` (pairs with a
    negative id skipped), copied after the arrays `after` exist. `name`: a suffix of the kernel's name (a
    profile then tells the copies apart); `programs`: at most this many programs (None: one per block)."""
    (dst, many), (src, _) = _tuple(dst), _tuple(src)
    _check(dst, src, "copy_rows")
    dst_rows, src_rows = dst_rows.astype(jnp.int32), src_rows.astype(jnp.int32)
    if dst_rows.shape[0] == 0 or any(a.shape[0] == 0 for a in dst + src):
        out = dst
    elif not kernel:
        out = tuple(_xla_copy(a, b, dst_rows, src_rows) for a, b in zip(dst, src))
    else:
        out = _launch(dst_rows, src_rows, src, dst, fresh=False, interpret=interpret, block_elems=block_elems,
                      after=tuple(after), name="tbe_copy_rows" + (f"_{name}" if name else ""), num_warps=num_warps,
                      programs=programs)
    return tuple(out) if many else out[0]


def gather_rows(src, src_rows: jax.Array, *, kernel: bool, interpret: bool = False, block_elems: int = 4096,
                name: str = "", programs: int | None = None):
    """Fresh buffers of `len(src_rows)` rows: row `i` = `src[src_rows[i]]` where `src_rows[i] >= 0`; the other
    rows are unspecified (zeros without the kernels). `programs`: as `copy_rows`'."""
    (src, many) = _tuple(src)
    src_rows = src_rows.astype(jnp.int32)
    n = src_rows.shape[0]
    if n == 0 or any(a.shape[0] == 0 for a in src):  # nothing to read
        out = tuple(jnp.zeros((n,) + a.shape[1:], a.dtype) for a in src)
    elif not kernel:
        out = tuple(_xla_copy(jnp.zeros((n,) + a.shape[1:], a.dtype), a, jnp.arange(n, dtype=jnp.int32), src_rows)
                    for a in src)
    else:
        fresh = tuple(jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype) for a in src)
        out = _launch(jnp.arange(n, dtype=jnp.int32), src_rows, src, fresh, fresh=True, interpret=interpret,
                      block_elems=block_elems, after=(), name="tbe_gather_rows" + (f"_{name}" if name else ""),
                      programs=programs)
    return tuple(out) if many else out[0]
