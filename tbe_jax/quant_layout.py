"""Where the inference TBE's quantized tables live, and the groups its kernels see.

Storage (the params, `QuantizedTableBatchedEmbedding`'s `qparams`): tables of one weight type and one row
length in int32 words (`quant_format.row_bytes(D, wt) // 4`, FBGEMM's 16-byte padded row) are stacked row-wise
into one int32 buffer `[sum of their E, words]`, named `"{wt}_w{words}"` (e.g. `"int4_w4"`): one buffer per
storage class, as the training TBE's `StorageLayout` stacks float tables of one dim.

Groups (what `FeaturePlan`, the XLA path and `pooling="none"` see): one per (buffer, dim) pair, since a
buffer may hold tables of several dims (int4 rows of D = 8 .. 24 are all 16 bytes). A group has a static dim
and `RowFormat`; its rows are its buffer's. `QuantLayout` offers `StorageLayout`'s fields for the groups
(`dims`, `strides`, `table_group`, `table_row_offset`, `key`), so `FeaturePlan.build` and
`reference.pooled_forward` take it as they take a `StorageLayout`.

The pooled kernel sees the buffers themselves as its groups (`kernel_layout`, `kernel_plan`): one kernel
branch per buffer, shared by the features of every dim stored there (each feature's dim is read at run time;
`kernels.forward._schedule`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tbe_jax import quant_format
from tbe_jax.kernels.quant_rows import RowFormat
from tbe_jax.specs import FeaturePlan, TableSpec


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """The buffers (storage) and groups (kernel branches) of quantized tables; see the module doc."""

    buffer_types: tuple[str, ...]  # per buffer: its weight type
    buffer_words: tuple[int, ...]  # per buffer: int32 words per row
    buffer_rows: tuple[int, ...]  # per buffer: its rows
    table_buffer: tuple[int, ...]  # per table: its buffer
    dims: tuple[int, ...]  # per group: its dim
    group_buffer: tuple[int, ...]  # per group: its buffer
    table_group: tuple[int, ...]  # per table: its group
    table_row_offset: tuple[int, ...]  # per table: its first row in its buffer

    @staticmethod
    def build(tables: Sequence[TableSpec], weight_dtypes: Sequence[str]) -> "QuantLayout":
        """The layout of `tables`, table t stored as `weight_dtypes[t]` (buffers and groups in order of first
        appearance)."""
        classes: list[tuple[str, int]] = []
        groups: list[tuple[int, int]] = []
        rows: list[int] = []
        tbuf, tgroup, toff = [], [], []
        for t, (spec, wt) in enumerate(zip(tables, weight_dtypes)):
            words = quant_format.row_bytes(spec.embedding_dim, wt) // 4
            if (wt, words) not in classes:
                classes.append((wt, words))
                rows.append(0)
            b = classes.index((wt, words))
            if (b, spec.embedding_dim) not in groups:
                groups.append((b, spec.embedding_dim))
            tbuf.append(b)
            tgroup.append(groups.index((b, spec.embedding_dim)))
            toff.append(rows[b])
            rows[b] += spec.num_embeddings
        for b, r in enumerate(rows):
            if r >= 2**31:
                raise ValueError(f"{classes[b][0]} tables of {classes[b][1]} words per row hold {r} rows together; "
                                 "the int32 row index of one buffer must stay below 2**31")
        return QuantLayout(tuple(c[0] for c in classes), tuple(c[1] for c in classes), tuple(rows), tuple(tbuf),
                           tuple(g[1] for g in groups), tuple(g[0] for g in groups), tuple(tgroup), tuple(toff))

    # -- storage ------------------------------------------------------------------------------------------------
    @property
    def num_buffers(self) -> int:
        return len(self.buffer_types)

    def buffer_key(self, b: int) -> str:
        """The name of buffer `b` in the params: `"{weight type}_w{words per row}"`."""
        return f"{self.buffer_types[b]}_w{self.buffer_words[b]}"

    def buffer_shape(self, b: int) -> tuple[int, int]:
        return (self.buffer_rows[b], self.buffer_words[b])

    # -- groups (StorageLayout's interface) ---------------------------------------------------------------------
    def key(self, g: int) -> str:
        """The name of group `g` in `group_buffers`' dict (the buffers as the kernels take them)."""
        return f"g{g}"

    @property
    def strides(self) -> tuple[int, ...]:
        """Per group: its buffer's row length in words (the quantized gather reads `formats`, not this)."""
        return tuple(self.buffer_words[b] for b in self.group_buffer)

    @property
    def formats(self) -> tuple[RowFormat, ...]:
        """Per group: the static format of its rows."""
        return tuple(RowFormat(self.buffer_types[b], self.buffer_words[b]) for b in self.group_buffer)

    def group_buffers(self, params: dict) -> dict:
        """`{key(g): the params' buffer of group g}`: what the XLA path and `pooling="none"` index by group."""
        return {self.key(g): params[self.buffer_key(b)] for g, b in enumerate(self.group_buffer)}

    # -- the pooled kernel's groups: the buffers ---------------------------------------------------------------
    @property
    def kernel_layout(self) -> "BufferGroups":
        """The buffers as groups (`StorageLayout`'s interface), for `kernels.forward.pooled_forward` with
        `kernel_plan`'s plan and the params themselves as its buffers."""
        return BufferGroups(self)

    def kernel_plan(self, plan: FeaturePlan) -> FeaturePlan:
        """`plan` (built on this layout's groups) with each feature's group its buffer (its dim stays
        `plan.dim[f]`)."""
        return dataclasses.replace(plan, group=tuple(self.group_buffer[g] for g in plan.group))


@dataclasses.dataclass(frozen=True)
class BufferGroups:
    """A `QuantLayout`'s buffers as the groups of the pooled kernel: group `b` is buffer `b`, keyed by its name in
    the params; its dim is the largest of its tables' (the kernel reads each feature's at run time)."""

    layout: QuantLayout

    @property
    def dims(self) -> tuple[int, ...]:
        lay = self.layout
        return tuple(max(d for d, gb in zip(lay.dims, lay.group_buffer) if gb == b) for b in range(lay.num_buffers))

    @property
    def strides(self) -> tuple[int, ...]:
        return self.layout.buffer_words

    @property
    def formats(self) -> tuple[RowFormat, ...]:
        return tuple(RowFormat(t, w) for t, w in zip(self.layout.buffer_types, self.layout.buffer_words))

    def key(self, b: int) -> str:
        return self.layout.buffer_key(b)
