"""Quantized rows dequantized in registers: how the forward kernels and the XLA path read an int32 word buffer.

A storage buffer of the inference TBE (`tbe_jax.quant`) holds FBGEMM IntNBit rows (`tbe_jax.quant_format`) as
little-endian int32 words, `RowFormat.words` per row. Value `j` of a row sits in word `header_words + j //
per_word`, at bit `bits * (j % per_word)`: the lanes of a tile column load that word (the lanes of one word load
one address, so one memory sector), shift and mask their value out of it and convert it to float32:

- int8 / int4 / int2: `q * scale + bias`, with the row's fp16 scale (low half) and bias (high half) of word 0;
- float16: the 16-bit pattern as an fp16 value (widened); fp8: FBGEMM's HFP8 code (`quant_format.hfp8_to_float`);
- float32: the word's bits as a float32.

`load_rows` is the Pallas gather (a `[G, Dp]` float32 tile), `take_rows` the same with `jnp` (the XLA path); both
decode with `decode`, so the kernels and the XLA path compute the same float32 values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tbe_jax import quant_format
from tbe_jax.pallas_compat import plgpu


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


def load_rows(w_ref, rows, ok, cols, fmt: RowFormat, dim: int):
    """The Pallas gather of quantized rows: `[G, Dp]` float32, row `rows[i]` of the word buffer `w_ref` where
    `ok[i]` (zeros elsewhere), column `cols[j]` (`Dp` of them, the first `dim` the row's values).

    Tile columns past `dim` whose word lies inside the row load it (their values are never stored); where a
    tile column's word would pass the row, columns past `dim` are masked off.
    """
    widx = fmt.word_index(cols)
    if fmt.word_index(cols.shape[0] - 1) < fmt.words:
        mask = jnp.broadcast_to(ok[:, None], (ok.shape[0], cols.shape[0]))
    else:
        mask = ok[:, None] & (cols < dim)[None, :]
    word = plgpu.load(w_ref.at[rows[:, None], widx[None, :]], mask=mask, other=0)
    header = None
    if fmt.header_words:  # masked rows read 0: scale 0 and bias 0, so they contribute zeros
        header = plgpu.load(w_ref.at[rows, jnp.zeros_like(rows)], mask=ok, other=0)
    return decode(fmt, word, cols, header)


def take_rows(words, rows, fmt: RowFormat, dim: int):
    """`load_rows` with `jnp` (the XLA path): `[N, dim]` float32 values of rows `rows` (in range) of the word
    buffer `words` (`[R, fmt.words]` int32)."""
    cols = jnp.arange(dim, dtype=jnp.int32)
    picked = jnp.take(words, rows, axis=0)
    header = picked[:, 0] if fmt.header_words else None
    return decode(fmt, jnp.take(picked, fmt.word_index(cols), axis=1), cols, header)
