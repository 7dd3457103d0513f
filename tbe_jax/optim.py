"""Optimizers applied inside the TBE backward (fused): exact row-wise Adagrad and SGD.

Semantics (FBGEMM's EXACT_ROWWISE_ADAGRAD and EXACT_SGD): for every (table, row)
that occurs in the batch, `g` is the sum over its occurrences of the scaled
output gradient (per-sample weight, and 1/len for mean pooling); then

    row-wise Adagrad:  m += mean(g**2 over D);  row -= lr * g / (sqrt(m) + eps)
    SGD:               row -= lr * g

once per row per step, in fp32 (rows stored in fp16/bf16 are rounded to nearest
on the store). Rows not in the batch are left bitwise unchanged.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad:
    """Exact row-wise Adagrad: one fp32 accumulator per table row."""

    learning_rate: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"RowwiseAdagrad.learning_rate must be > 0, got {self.learning_rate}")
        if not self.eps >= 0:
            raise ValueError(f"RowwiseAdagrad.eps must be >= 0, got {self.eps}")
        if not self.initial_accumulator_value >= 0:
            raise ValueError(
                f"RowwiseAdagrad.initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}"
            )


@dataclasses.dataclass(frozen=True)
class SGD:
    """Exact SGD on the looked-up rows (no optimizer state)."""

    learning_rate: float = 0.01

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"SGD.learning_rate must be > 0, got {self.learning_rate}")
