"""Tensor-train table specs and shape factorisation (FBTT-Embedding convention)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def _factor_near(n: int, parts: int) -> tuple[int, ...]:
    """`parts` integers near n**(1/parts), largest first, whose product is >= n (padding allowed)."""
    base = max(1, round(n ** (1.0 / parts)))
    out = [base] * parts
    while math.prod(out) < n:  # grow the smallest factor until the product covers n
        out[out.index(min(out))] += 1
    return tuple(sorted(out, reverse=True))


def _factor_exact(d: int, parts: int) -> tuple[int, ...]:
    """`parts` integers with product exactly d, as balanced as the prime factors allow."""
    primes, m, f = [], d, 2
    while m > 1:
        while m % f == 0:
            primes.append(f)
            m //= f
        f += 1
    out = [1] * parts
    for p in sorted(primes, reverse=True):
        out[out.index(min(out))] *= p
    return tuple(sorted(out))


def suggested_tt_shapes(num_embeddings: int, embedding_dim: int, tt_dims: int = 3):
    """(p_shapes, q_shapes): balanced factorisations with prod(p) >= N and prod(q) == D."""
    return _factor_near(num_embeddings, tt_dims), _factor_exact(embedding_dim, tt_dims)


def int_tuple(name: str, value) -> tuple[int, ...]:
    """`value` as a tuple of ints: a sequence of integers (no floats, bools or strings, which `int()` would
    silently truncate or reinterpret); `name` names the argument in the errors."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {value!r}")
    out = tuple(value)
    if any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) for x in out):
        raise TypeError(f"{name} must hold ints, got {value!r}")
    return tuple(int(x) for x in out)


@dataclasses.dataclass(frozen=True)
class TTSpec:
    """One TT-compressed table of `num_embeddings` rows and `embedding_dim` columns.

    Core t has logical shape `[p_t, r_{t-1}, q_t, r_t]` with r_0 = r_T = 1; row
    i's digits (i_1..i_T) are mixed-radix in p, first digit most significant;
    column d's digits (j_1..j_T) likewise in q.

    Args:
      p_shapes, q_shapes: the row and column factorisations (None: balanced,
        as FBTT's suggested_tt_shapes). prod(p) >= N (padding), prod(q) == D.
      ranks: the T-1 inner TT ranks.
    """

    num_embeddings: int
    embedding_dim: int
    p_shapes: tuple[int, ...] | None = None
    q_shapes: tuple[int, ...] | None = None
    ranks: tuple[int, ...] = (32, 32)

    def __post_init__(self):
        for name in ("num_embeddings", "embedding_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"TTSpec.{name} must be a positive int, got {v!r}")
        ranks = int_tuple("TTSpec.ranks", self.ranks)
        t = len(ranks) + 1
        if not 2 <= t <= 4:
            raise ValueError(f"TTSpec.ranks={self.ranks}: 1 to 3 inner ranks (T = 2..4 cores) are supported")
        if any(r < 1 for r in ranks):
            raise ValueError(f"TTSpec.ranks must be positive, got {self.ranks}")
        p, q = suggested_tt_shapes(self.num_embeddings, self.embedding_dim, t)
        p = int_tuple("TTSpec.p_shapes", self.p_shapes) if self.p_shapes is not None else p
        q = int_tuple("TTSpec.q_shapes", self.q_shapes) if self.q_shapes is not None else q
        if len(p) != t or len(q) != t:
            raise ValueError(f"TTSpec: p_shapes={p} and q_shapes={q} must each have {t} factors (len(ranks)+1)")
        if any(x < 1 for x in p + q):
            raise ValueError(f"TTSpec: shapes must be positive, got p={p}, q={q}")
        if math.prod(p) < self.num_embeddings:
            raise ValueError(f"TTSpec: prod(p_shapes={p}) = {math.prod(p)} < num_embeddings={self.num_embeddings}")
        if math.prod(q) != self.embedding_dim:
            raise ValueError(f"TTSpec: prod(q_shapes={q}) = {math.prod(q)} != embedding_dim={self.embedding_dim}")
        object.__setattr__(self, "num_embeddings", int(self.num_embeddings))
        object.__setattr__(self, "embedding_dim", int(self.embedding_dim))
        object.__setattr__(self, "p_shapes", p)
        object.__setattr__(self, "q_shapes", q)
        object.__setattr__(self, "ranks", ranks)

    @property
    def num_cores(self) -> int:
        return len(self.p_shapes)

    @property
    def full_ranks(self) -> tuple[int, ...]:
        return (1,) + self.ranks + (1,)

    def core_shapes(self) -> list[tuple[int, int, int, int]]:
        r = self.full_ranks
        return [(self.p_shapes[t], r[t], self.q_shapes[t], r[t + 1]) for t in range(self.num_cores)]

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.core_shapes())
