"""Quantized rows dequantized in registers: how the forward kernels and the XLA path read an int32 word buffer.

A storage buffer of the inference TBE (`tbe_jax.quant`) holds FBGEMM IntNBit rows (`tbe_jax.quant_format`) as
little-endian int32 words, `RowFormat.words` per row. Value `j` of a row sits in word `header_words + j //
per_word`, at bit `bits * (j % per_word)`; a value is shifted and masked out of its word and converted to float32:

- int8 / int4 / int2: `q * scale + bias`, with the row's fp16 scale (low half) and bias (high half) of word 0;
- float16: the 16-bit pattern as an fp16 value (widened); fp8: FBGEMM's HFP8 code (`quant_format.hfp8_to_float`);
- float32: the word's bits as a float32.

`load_packed` is the Pallas gather the kernels use: each lane loads one word and unpacks its values with constant
shifts into `per_word` tiles (value `c * per_word + k` in tile `k`, column `c`), which `interleave` puts back in
value order (once per bag, before the store); `take_rows` is the same gather
with `jnp` (the XLA path), in value order. Both decode a value by the same float32 operations, so the kernels
and the XLA path compute the same values. The pooled kernel reads integer rows with `load_words` and `codes_of` instead: the
codes, scales and biases apart, so that it sums `q * scale` with one fused multiply-add per value and the
biases once per row (a bag's sum rounds differently from the sum of decoded values, within float32 rounding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tbe_jax import quant_format
from tbe_jax.pallas_compat import plgpu
from tbe_jax.specs import next_pow2


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """The static format of one buffer's rows: its weight type and its row length in int32 words."""

    weight_dtype: str
    words: int  # int32 words per stored row (`quant_format.row_bytes(D, weight_dtype) // 4`)

    def __post_init__(self):
        quant_format.check_weight_dtype(self.weight_dtype)
        if isinstance(self.words, bool) or not isinstance(self.words, int) or self.words < 1:
            raise ValueError(f"RowFormat.words must be a positive int, got {self.words!r}")

    @property
    def bits(self) -> int:
        """Bits per value."""
        return quant_format.bits(self.weight_dtype)

    @property
    def per_word(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    @property
    def header_words(self) -> int:
        """Words before the first value (the scale and bias of an integer row)."""
        return quant_format.header_bytes(self.weight_dtype) // 4

    @property
    def row_bytes(self) -> int:
        return 4 * self.words

    def max_dim(self) -> int:
        """The most values a row of this length holds."""
        return (self.words - self.header_words) * self.per_word

    def word_index(self, cols):
        """The word holding each column's value (`cols`: int32 columns, or a Python int)."""
        idx = cols >> (self.per_word.bit_length() - 1) if self.per_word > 1 else cols
        return idx + self.header_words if self.header_words else idx


def fp16_bits_to_float(h):
    """int32 holding fp16 bit patterns in their low 16 bits -> float32 (exact)."""
    return jax.lax.bitcast_convert_type((h & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def decode(fmt: RowFormat, word, cols, header=None):
    """Float32 values of the columns `cols` (`[C]` int32) of rows whose value words are `word` (`[R, C]` int32,
    column c's word of each row); `header`: the rows' word 0 (`[R]` int32), integer rows only."""
    if fmt.bits == 32:
        return jax.lax.bitcast_convert_type(word, jnp.float32)
    q = word
    if fmt.per_word > 1:
        q = q >> ((cols & (fmt.per_word - 1)) * fmt.bits)[None, :]
    q = q & ((1 << fmt.bits) - 1)
    if fmt.weight_dtype == "float16":
        return fp16_bits_to_float(q)
    if fmt.weight_dtype == "fp8":
        return quant_format.hfp8_to_float(q)
    scale = fp16_bits_to_float(header)
    bias = fp16_bits_to_float(header >> 16)
    return q.astype(jnp.float32) * scale[:, None] + bias[:, None]


def value_words(fmt: RowFormat, dim: int) -> int:
    """Words holding the `dim` values of a row (after its header)."""
    return -(-dim // fmt.per_word)


def tile_words(fmt: RowFormat, dim: int) -> int:
    """The word columns of `load_packed`'s tiles: `next_pow2(value_words)`, at least 2 (Triton 3.6 crashes, a
    segfault while compiling, on `interleave`'s join of `[1, 1]` tiles: a program of one bag of rows one word
    long; the H200, `benchmarks/NOTES.md`)."""
    return max(2, next_pow2(value_words(fmt, dim)))


def load_packed(w_ref, rows, ok, wcols, fmt: RowFormat, dim: int):
    """The Pallas gather of quantized rows, one load per word: `fmt.per_word` float32 tiles `[G, Wp]`, tile `k`
    column `c` the value `c * per_word + k` of row `rows[i]` of `w_ref` where `ok[i]` (zeros elsewhere);
    `wcols`: the `Wp` value-word columns (`arange`, `Wp >= value_words(fmt, dim)`).

    Each lane loads one word and unpacks its `per_word` values with constant shifts: an int4 row of 128
    values is 16 loads, not the 128 of a lane per value (8 lanes loading each address), so the loads, their
    address arithmetic and the shifts (constants here) drop by `per_word`. The caller sums tile
    by tile and puts the sums in value order with `interleave` before its store.
    """
    nw = value_words(fmt, dim)
    if wcols.shape[0] + fmt.header_words <= fmt.words:  # every tile word lies inside the row
        mask = jnp.broadcast_to(ok[:, None], (ok.shape[0], wcols.shape[0]))
    else:
        mask = ok[:, None] & (wcols < nw)[None, :]
    cols = wcols + fmt.header_words if fmt.header_words else wcols
    word = plgpu.load(w_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)
    scale = bias = None
    if fmt.header_words:  # masked rows read 0: scale 0 and bias 0, so they contribute zeros
        header = plgpu.load(w_ref.at[rows, jnp.zeros_like(rows)], mask=ok, other=0)
        scale = fp16_bits_to_float(header)[:, None]
        bias = fp16_bits_to_float(header >> 16)[:, None]
    tiles = []
    for k in range(fmt.per_word):
        q = word >> (k * fmt.bits) if k else word
        q = q & ((1 << fmt.bits) - 1) if fmt.bits < 32 else q
        if fmt.bits == 32:
            tiles.append(jax.lax.bitcast_convert_type(q, jnp.float32))
        elif fmt.weight_dtype == "float16":
            tiles.append(fp16_bits_to_float(q))
        elif fmt.weight_dtype == "fp8":
            tiles.append(quant_format.hfp8_to_float(q))
        else:
            tiles.append(q.astype(jnp.float32) * scale + bias)
    return tiles


def word_pieces(fmt: RowFormat, dim: int, bags: int, threads: int = 32) -> tuple[tuple[int, int], ...]:
    """The value words of a row of `dim` values as tiles of power-of-two widths: `((start, width), ...)`, for a
    kernel that gathers `bags` rows a step with `threads` threads.

    One tile of `tile_words` lanes, or two where they take fewer lanes: the largest power of two within the
    value words, then a tile for the rest, if that tile is at least 4 words wide (int8 D = 24 as 4 + 2 words ran
    0.88x one 8-word tile on an H100), still gives every thread a word (`bags * width >= threads`; a smaller one
    is replicated across threads, costs what a full one would, and gets a layout of its own, converted through
    shared memory), and if the step gathers at least 4 bags (with 2, one tile's loop is already as short as two
    tiles'; offline SASS counts in `benchmarks/NOTES.md`, session 42). int8 D = 96 (24 words, 4 bags) loads 16 + 8
    lanes instead of 32: a quarter of the lanes were idle, and the kernel is bound by its instructions (H100,
    session 43: 1.14x on D = 96 alone, 1.29-1.31x on sweep shards of D = 96 tables, 1.06x at D = 48). Words past
    the row's end are masked as in one tile."""
    nw = value_words(fmt, dim)
    full = tile_words(fmt, dim)
    hi = 1 << (nw.bit_length() - 1)
    if hi == nw or nw <= 2:
        return ((0, full),)
    lo = max(2, next_pow2(nw - hi))
    if hi + lo >= full or lo < 4 or bags * lo < threads or bags < 4:
        return ((0, full),)
    return ((0, hi), (hi, lo))


def load_header(w_ref, rows, ok):
    """Inside a kernel: word 0 of integer rows `rows` of `w_ref` (their fp16 scale and bias, `scale_bias`),
    `[G]` int32, 0 where `ok` is False."""
    return plgpu.load(w_ref.at[rows, jnp.zeros_like(rows)], mask=ok, other=0)


def scale_bias(header):
    """The float32 scale and bias of integer rows from their word 0 (`load_header`): a zero word gives zeros."""
    return fp16_bits_to_float(header), fp16_bits_to_float(header >> 16)


def load_words(w_ref, rows, ok, wcols, fmt: RowFormat, dim: int, start: int = 0):
    """The int32 value words `wcols` (`start + arange(width)`, `start` static) of rows `rows` of `w_ref`:
    `[G, width]`, zeros where `ok` is False or past the row's value words (when the tile reaches past the row)."""
    nw = value_words(fmt, dim)
    if start + wcols.shape[0] + fmt.header_words <= fmt.words:  # every tile word lies inside the row
        mask = jnp.broadcast_to(ok[:, None], (ok.shape[0], wcols.shape[0]))
    else:
        mask = ok[:, None] & (wcols < nw)[None, :]
    return plgpu.load(w_ref.at[rows[:, None], (wcols + fmt.header_words)[None, :]], mask=mask, other=0)


def codes_of(word, fmt: RowFormat):
    """Integer rows' (int8 / int4 / int2) value words (`load_words`) as `per_word` float32 tiles of their codes,
    the rows' scale and bias not applied: tile `k` column `c` the code of the word's value `k` (int4 / int2: `q *
    2**(k * bits)`, the code masked where it lies in its word, one AND and no shift; `code_scale` undoes the power
    of two). A pooling kernel then sums `q * scale` (one fused multiply-add per value) and the rows' biases
    (`load_header`, `scale_bias`) apart, one add per row: a bag's sum is `sum(q * scale) + sum(bias)`."""
    codes, m = [], (1 << fmt.bits) - 1
    for k in range(fmt.per_word):
        if fmt.bits == 8:  # a byte shifted down: one byte-selecting conversion (I2F.U8) per value
            codes.append(((word >> (8 * k) if k else word) & m).astype(jnp.float32))
            continue
        # int4 / int2: the code masked in place (one AND), `q * 2**s`, exact in float32 (<= 4 significant bits)
        c = m << (k * fmt.bits)
        q = word & (c - (1 << 32) if c >= 1 << 31 else c)  # the mask as an int32 constant
        codes.append(jax.lax.bitcast_convert_type(q, jnp.uint32).astype(jnp.float32))
    return codes


def code_scale(fmt: RowFormat, k: int) -> float:
    """The power of two undoing `codes_of`' tile `k` (int4 / int2 codes are `q * 2**(k * bits)`; int8's are
    `q`): a sum of `code * scale` terms times it is the sum of `q * scale` terms, exactly (scaling by a power of
    two commutes with rounding)."""
    return 1.0 if fmt.bits == 8 else 2.0 ** -(k * fmt.bits)


def interleave(tiles):
    """`load_packed`'s tiles (or sums of them), `P` (a power of 2) of `[G, W]`, as one `[G, W * P]` tile in value
    order: column `c * P + k` is tile `k`'s column `c`.

    A tree of two-way stacks along a new last axis (Triton's `tt.join`: the pair lands in one thread's
    registers) and one reshape, so the output store is a contiguous row as the float path's. By induction:
    the stack of the interleaved even and odd tiles holds tile `2m + j` (m: its place among the evens or
    odds, j: 0 even, 1 odd) at `(c * P/2 + m) * 2 + j = c * P + k`.
    """
    def tree(ts):
        if len(ts) == 1:
            return ts[0]
        return jnp.stack([tree(ts[0::2]), tree(ts[1::2])], axis=-1)

    g, w = tiles[0].shape
    return tree(list(tiles)).reshape(g, w * len(tiles))


def take_rows(words, rows, fmt: RowFormat, dim: int):
    """`load_rows` with `jnp` (the XLA path): `[N, dim]` float32 values of rows `rows` (in range) of the word
    buffer `words` (`[R, fmt.words]` int32)."""
    cols = jnp.arange(dim, dtype=jnp.int32)
    picked = jnp.take(words, rows, axis=0)
    header = picked[:, 0] if fmt.header_words else None
    return decode(fmt, jnp.take(picked, fmt.word_index(cols), axis=1), cols, header)
