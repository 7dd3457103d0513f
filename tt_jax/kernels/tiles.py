"""Tile geometry and in-kernel building blocks shared by the TT kernels (forward, backward, plan).

`Tiles` is a table group's static tile geometry; `prefix_loads` / `load_suffixes` / `load_last` load the
prefix product's core slices and a work item's rows (the layout is described in `tt_jax.kernels.forward`);
the dot helpers fix fp32 accumulation and the TF32 splits; `masked_store` keeps interpret mode's masked
lanes harmless; `i2_window` / `for_each_i2_run` walk a window of members sorted by middle slice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pl, plgpu
from tbe_jax.specs import next_pow2
from tt_jax import prefix

INT32_MAX = 2**31 - 1  # buffers this long or longer need 64-bit addresses in the kernels


def dot_pad(x: int) -> int:
    """Next power of 2, at least 16 (Triton's smallest dot dimension)."""
    return max(16, next_pow2(x))


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static tile geometry of one table group (the tiles of `tt_jax.kernels.forward`'s docstring)."""

    t: int  # cores
    q: tuple[int, ...]
    r: tuple[int, ...]  # full ranks (1, r1, .., 1)
    dim: int
    rows_m: int  # padded rows of C: q1 (T = 2) or q1 q2
    rows_valid: int
    k_x: int  # padded q2 r1 (T >= 3)
    r_pad: tuple[int, ...]  # padded r_t, t = 0..T
    sub_rows: int  # S: distinct rows per row-stage dot
    q_last_pad: int
    n_cols: int  # S * q_last_pad (>= 16)
    list_size: int  # q3 for T = 4, else 1
    wide: bool = False  # 64-bit address arithmetic (a buffer of 2**31 elements or more)

    @property
    def addr(self):
        return jnp.int64 if self.wide else jnp.int32

    @staticmethod
    def make(layout: prefix.StackedTables, tile_rows: int) -> "Tiles":
        q, r, t = layout.q_shapes, layout.full_ranks, layout.num_cores
        rows_valid = q[0] if t == 2 else q[0] * q[1]
        qlp = next_pow2(q[-1])
        sub = max(tile_rows, 16 // qlp)
        return Tiles(t, q, r, layout.dim, dot_pad(rows_valid), rows_valid, dot_pad(q[1] * r[1]) if t >= 3 else 0,
                     tuple(dot_pad(x) for x in r), sub, qlp, sub * qlp, q[2] if t == 4 else 1)


def masked_store(ref, addr, val, mask, interpret):
    """Masked store. Interpret mode scatters masked lanes too (writing back the old value), so there a
    masked lane that aliases a live one could undo its write: send masked lanes past the end (dropped)."""
    if interpret:
        addr = jnp.where(mask, addr, ref.shape[0])
    plgpu.store(ref.at[addr], val, mask=mask)


# TF32x3 as three explicit TF32 passes (`manual=True`): the backward's kernels use it, the forward keeps the
# dot algorithm (register counts and times: benchmarks/NOTES.md, "Design notes moved from the kernel docstrings").
_TF32_HI = np.uint32(0xFFFFE000)  # TF32 keeps fp32's sign, exponent and top 10 mantissa bits


def tf32_split(x):
    """(hi, lo): x's TF32 bits and the exact fp32 remainder."""
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & _TF32_HI, jnp.float32)
    return hi, x - hi


def dot_general(a, b, dims, precision, *, manual: bool = False):
    """`lax.dot_general` with fp32 accumulation; with `manual`, a TF32x3 dot as three explicit TF32 passes (small
    terms first; an infinite operand's NaN low parts dropped, as Triton's TF32x3 does)."""
    if not (manual and precision == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
        return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    one = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    (a_hi, a_lo), (b_hi, b_lo) = tf32_split(a), tf32_split(b)
    small = (jax.lax.dot_general(a_lo, b_hi, dims, precision=one, preferred_element_type=jnp.float32)
             + jax.lax.dot_general(a_hi, b_lo, dims, precision=one, preferred_element_type=jnp.float32))
    small = jnp.where(jnp.isnan(small), 0.0, small)
    return small + jax.lax.dot_general(a_hi, b_hi, dims, precision=one, preferred_element_type=jnp.float32)



def matmul(a, b, precision):
    """`a @ b` (2-D) with fp32 accumulation, the dot algorithm's own passes."""
    return dot_general(a, b, (((1,), (0,)), ((), ())), precision)


def dot_contract(a, b, ca, cb, precision, *, manual: bool = True):
    """Dot contracting dim `ca` of a with dim `cb` of b (2-D), fp32 accumulation (`dot_general`; TF32x3
    as three explicit passes unless `manual=False`)."""
    return dot_general(a, b, (((ca,), (cb,)), ((), ())), precision, manual=manual)


def dot_exact01(a, b, ca, cb, precision, *, exact: str):
    """`dot_contract` where one operand (`exact`: "a" or "b") holds only 0s and 1s (a selection or fold matrix).

    With TF32x3 (three tensor-core passes: x_hi y_hi + x_hi y_lo + x_lo y_hi), the 0/1 operand's TF32
    rounding is exact and its low part is 0, so one pass is wasted: split the other operand x here (x_hi:
    its TF32 bits, x_lo = x - x_hi, exact in fp32) and take two one-pass TF32 dots, with x_lo and with
    x_hi. Same accuracy (x_lo's own TF32 rounding is ~2^-21 of x), one pass fewer, one split fewer.
    """
    if precision != jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3:
        return dot_contract(a, b, ca, cb, precision)
    hi, x_lo = tf32_split(b if exact == "a" else a)
    one = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    lo = dot_contract(a, x_lo, ca, cb, one) if exact == "a" else dot_contract(x_lo, b, ca, cb, one)
    # An infinite x has x_lo = NaN: drop the low part there, as Triton's TF32x3 does, so inf stays inf.
    lo = jnp.where(jnp.isnan(lo), 0.0, lo)
    return lo + (dot_contract(a, hi, ca, cb, one) if exact == "a" else dot_contract(hi, b, ca, cb, one))


def prefix_loads(core_refs, digits, tl: Tiles):
    """The core slices of the prefix product, as dot operands (`tt_jax.kernels.forward`'s docstring)."""
    q, r = tl.q, tl.r
    if tl.t == 2:
        jj = jnp.arange(tl.rows_m, dtype=jnp.int32)[:, None]
        aa = jnp.arange(tl.r_pad[1], dtype=jnp.int32)[None, :]
        ok = (jj < q[0]) & (aa < r[1])
        addr = digits[0].astype(tl.addr) * (q[0] * r[1]) + jj * r[1] + aa
        return [plgpu.load(core_refs[0].at[addr], mask=ok, other=0.0)]
    jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
    kk = jnp.arange(tl.k_x, dtype=jnp.int32)
    j1, j2 = jj // q[1], jj % q[1]
    jk, ak = kk // r[1], kk % r[1]
    k_ok = kk < q[1] * r[1]
    x_ok = (jj < tl.rows_valid)[:, None] & k_ok[None, :] & (j2[:, None] == jk[None, :])
    x_addr = digits[0].astype(tl.addr) * (q[0] * r[1]) + (j1 * r[1])[:, None] + ak[None, :]
    bb = jnp.arange(tl.r_pad[2], dtype=jnp.int32)
    y_ok = k_ok[:, None] & (bb < r[2])[None, :]
    y_addr = (digits[1].astype(tl.addr) * (r[1] * q[1] * r[2]) + (ak * (q[1] * r[2]) + jk * r[2])[:, None]
              + bb[None, :])
    y = plgpu.load(core_refs[1].at[y_addr], mask=y_ok, other=0.0)
    ops = [plgpu.load(core_refs[0].at[x_addr], mask=x_ok, other=0.0), y]
    if tl.t == 4:
        cc = jnp.arange(tl.r_pad[3], dtype=jnp.int32)
        g_ok = (bb < r[2])[:, None] & (cc < r[3])[None, :]
        for j3 in range(q[2]):
            addr = (digits[2].astype(tl.addr) * (r[2] * q[2] * r[3]) + (bb * (q[2] * r[3]))[:, None] + (j3 * r[3])
                    + cc[None, :])
            ops.append(plgpu.load(core_refs[2].at[addr], mask=g_ok, other=0.0))
    return ops



def load_suffixes(suffix_ref, first, count, c, tl: Tiles):
    """Rows c*S .. c*S+S-1 of an item: per column (s, j), its row's last digit and the masks."""
    col = jnp.arange(tl.n_cols, dtype=jnp.int32)
    lane = c * tl.sub_rows + col // tl.q_last_pad  # row of the item, per column
    jt = col % tl.q_last_pad
    lane_ok = lane < count
    col_ok = lane_ok & (jt < tl.q[-1])
    suffix = plgpu.load(suffix_ref.at[first + lane], mask=lane_ok, other=0)
    return suffix, lane, jt, col_ok


def load_last(core_last_ref, last_base, suffix, jt, col_ok, tl: Tiles):
    """The rows' last-core slices G `[r_{T-1}, S q_T]`, G[b, (s, j)] = G_T[i_T(s), b, j, 0]."""
    q_last, r_last = tl.q[-1], tl.r[-2]
    bb = jnp.arange(tl.r_pad[-2], dtype=jnp.int32)
    addr = ((last_base + suffix).astype(tl.addr) * (r_last * q_last) + jt)[None, :] + (bb * q_last)[:, None]
    return plgpu.load(core_last_ref.at[addr], mask=(bb < r_last)[:, None] & col_ok[None, :], other=0.0)



def i2_window(order_ref, count, pack: int, q1p: int):
    """Rows (slot, j1) of a program's window of `pack` members taken in `order` (sorted by middle slice i2; None:
    in index order): (row index, j1, member per row, whether the slot holds a member)."""
    mm = jnp.arange(pack * q1p, dtype=jnp.int32)
    slot, j1 = mm // q1p, mm % q1p
    pos = pl.program_id(0) * pack + slot
    has = pos < count
    member = jnp.where(has, pos, 0) if order_ref is None else plgpu.load(order_ref.at[pos], mask=has, other=0)
    return mm, j1, member, has


def for_each_i2_run(i2, live, fn):
    """`fn(cur, mine)` once per run of equal i2 among the `live` rows of a window sorted by i2 (usually one run;
    `mine`: the run's rows). A while loop: the next run starts at the first live row with a larger i2."""
    rows_m = i2.shape[0]
    mm = jnp.arange(rows_m, dtype=jnp.int32)

    def run(start):
        cur = jnp.sum(jnp.where(mm == start, i2, 0))
        fn(cur, live & (i2 == cur))
        return jnp.min(jnp.where(live & (i2 > cur), mm, rows_m))

    jax.lax.while_loop(lambda start: start < rows_m, run, jnp.min(jnp.where(live, mm, rows_m)))
