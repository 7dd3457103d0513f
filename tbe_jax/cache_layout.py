"""Static facts of the host tier's cache (`tbe_jax.host_cache`): the names in params and opt-state, the cached
tables' sets and slots (`CacheLayout`), and how a model's tables split into an inner embedding's tables."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

CACHE = "cache"  # params' key of the cache directory
STATE_ROWS = "cache_rows"  # each optimizer slot's key of the rows its cache states belong to
# `params["cache"]["stats"]`: the last prefetch's counts: distinct cached rows requested, those already cached,
# rows filled, rows written back; the batch's lookups of cached tables, those whose row was already cached, and
# those left to host memory (their row neither cached nor filled)
STATS = ("requested", "hits", "fills", "writebacks", "lookups", "lookup_hits", "host_lookups")
NEVER = np.int32(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static facts of the cached tables: per cached table (in table order) its rows, slots and sets, the bases of
    each in the concatenated row / slot / set spaces, and its two parts among the inner embedding's tables."""

    tables: tuple[int, ...]
    rows: tuple[int, ...]
    slots: tuple[int, ...]
    ways: int
    cache_part: tuple[int, ...]
    host_part: tuple[int, ...]

    @property
    def sets(self) -> tuple[int, ...]:
        return tuple(c // self.ways for c in self.slots)

    def base(self, name: str) -> np.ndarray:
        sizes = {"rows": self.rows, "slots": self.slots, "sets": self.sets}[name]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def total_rows(self) -> int:
        return int(sum(self.rows))

    @property
    def total_slots(self) -> int:
        return int(sum(self.slots))


def cache_slots(rows: int, load_factor: float, ways: int) -> int:
    """C_t: `cache_load_factor * E_t` rounded up to whole sets of `ways` slots (at least one set)."""
    return ways * max(1, math.ceil(math.ceil(load_factor * rows) / ways))


def split_tables(tables, load_factor: float, ways: int):
    """(inner tables, CacheLayout, per outer table its inner table): a cached table becomes its cache part (a
    device table of C_t rows) and its host part (a host table of E_t rows), in that order."""
    inner, of, cached, rows, slots, cpart, hpart = [], [], [], [], [], [], []
    for t, spec in enumerate(tables):
        if spec.location != "host_cached":
            of.append(len(inner))
            inner.append(spec)
            continue
        c = cache_slots(spec.num_embeddings, load_factor, ways)
        of.append(len(inner))
        cached.append(t), rows.append(spec.num_embeddings), slots.append(c)
        cpart.append(len(inner))
        inner.append(dataclasses.replace(spec, num_embeddings=c, location="device", bag_size_hint=None))
        hpart.append(len(inner))
        inner.append(dataclasses.replace(spec, location="host", bag_size_hint=None))
    return tuple(inner), CacheLayout(tuple(cached), tuple(rows), tuple(slots), ways, tuple(cpart), tuple(hpart)), \
        tuple(of)


def checked_cache_options(load_factor, policy, ways, max_fills, admit_age):
    """`TableBatchedEmbedding`'s cache arguments, checked: (load_factor as a float, policy, ways, max_fills,
    admit_age)."""
    if isinstance(load_factor, bool) or not isinstance(load_factor, (int, float)) or not 0 < load_factor <= 1:
        raise ValueError(f"cache_load_factor must be a number in (0, 1], got {load_factor!r}")
    if policy not in ("lru", "lfu"):
        raise ValueError(f"cache_policy must be 'lru' or 'lfu', got {policy!r}")
    if isinstance(ways, bool) or not isinstance(ways, int) or ways < 1:
        raise ValueError(f"cache_ways must be a positive int, got {ways!r}")
    if max_fills is not None and (isinstance(max_fills, bool) or not isinstance(max_fills, int) or max_fills < 1):
        raise ValueError(f"cache_max_fills must be None or a positive int, got {max_fills!r}")
    if isinstance(admit_age, bool) or not isinstance(admit_age, int) or admit_age < 0:
        raise ValueError(f"cache_admit_age must be an int >= 0, got {admit_age!r}")
    return float(load_factor), policy, ways, max_fills, admit_age
