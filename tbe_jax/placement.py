"""Where each table should live under an HBM budget: `plan_locations` (issue 40's planner, one device).

The HBM a table costs by location (weights, optimizer state, cache directory):
- "device": `E * (row + state)` bytes;
- "host_cached": its cache, `C * (row + state)` with `C = cache_slots(E)`, plus the directory (`slot_of_row`, 4
  bytes a row, and 20 bytes a slot);
- "host": nothing.

In host memory (`host_bytes`), a "host" or "host_cached" table takes all of its rows and state, `E * (row +
state)` (pinned: the host's RAM, and XLA's pinned-host allocator, 64 GB unless `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`
says more); a "device" one nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tbe_jax.cache_layout import cache_slots
from tbe_jax.specs import TableSpec, padded_dim


def state_bytes_per_row(optimizer, dim: int) -> int:
    """Bytes of `optimizer`'s state per row of `dim` values (fp32 slots: 4 a row-wise slot, 4 * dim an
    element-wise one; none for SGD or None)."""
    if optimizer is None:
        return 0
    rule = optimizer.rule()
    return sum(4 if rowwise else 4 * dim for rowwise in rule.slot_rowwise)


def _row_bytes(spec: TableSpec, itemsize: int, optimizer) -> int:
    """A stored row and its optimizer state, in bytes."""
    return padded_dim(spec.embedding_dim, itemsize) * itemsize + state_bytes_per_row(optimizer, spec.embedding_dim)


def hbm_bytes(spec: TableSpec, location: str, *, itemsize: int, optimizer=None, cache_load_factor: float = 0.2,
              cache_ways: int = 16) -> int:
    """The HBM `spec` takes at `location` (see the module doc)."""
    row = _row_bytes(spec, itemsize, optimizer)
    if location == "device":
        return spec.num_embeddings * row
    if location == "host_cached":
        c = cache_slots(spec.num_embeddings, cache_load_factor, cache_ways)
        return c * (row + 20) + 4 * spec.num_embeddings
    return 0


def host_bytes(spec: TableSpec, location: str, *, itemsize: int, optimizer=None) -> int:
    """The pinned host memory `spec` takes at `location` (see the module doc)."""
    return 0 if location == "device" else spec.num_embeddings * _row_bytes(spec, itemsize, optimizer)


def plan_locations(tables: Sequence[TableSpec], hbm_budget: int, *, weights_dtype="float32", optimizer=None,
                   lookups: Sequence[float] | None = None, cache_load_factor: float = 0.2,
                   cache_ways: int = 16, host_budget: int | None = None) -> list[TableSpec]:
    """`tables` with a `location` each so that together they take at most `hbm_budget` bytes of HBM.

    Tables stay on the device while they fit. Over budget, the coldest bytes move first: tables in increasing
    order of `lookups[t] / bytes` (expected lookups per step, e.g. ids per sample; without `lookups`, the largest
    tables first) become "host_cached"; if every one of them cached is still over budget, they become "host" in
    the same order. Raises ValueError if even that does not fit (the budget is below the tables left on the
    device, which is then zero). `host_budget`: bytes of pinned host memory the tables may take (`host_bytes`);
    a plan over it raises ValueError instead of failing at `init` (the 183 GB model of `docs/host_memory.md` took
    92 GB of an H200 host's 125 GB). The given `location`s are ignored; the result is deterministic.
    """
    itemsize = np.dtype(weights_dtype).itemsize
    n = len(tables)
    if lookups is not None and len(lookups) != n:
        raise ValueError(f"lookups must give one number per table ({n}), got {len(lookups)}")
    kw = dict(itemsize=itemsize, optimizer=optimizer, cache_load_factor=cache_load_factor, cache_ways=cache_ways)
    dev = [hbm_bytes(t, "device", **kw) for t in tables]
    heat = [(lookups[i] if lookups is not None else 1.0) / max(dev[i], 1) for i in range(n)]
    order = sorted(range(n), key=lambda i: (heat[i], -dev[i], i))
    loc = ["device"] * n
    total = sum(dev)
    for stage in ("host_cached", "host"):
        for i in order:
            if total <= hbm_budget:
                break
            total += hbm_bytes(tables[i], stage, **kw) - hbm_bytes(tables[i], loc[i], **kw)
            loc[i] = stage
    if total > hbm_budget:
        raise ValueError(f"the tables need {total} bytes of HBM even all in host memory; the budget is {hbm_budget}")
    if host_budget is not None:
        host = sum(host_bytes(t, l, itemsize=itemsize, optimizer=optimizer) for t, l in zip(tables, loc))
        if host > host_budget:
            raise ValueError(f"under {hbm_budget} bytes of HBM the tables need {host} bytes of host memory; the "
                             f"host budget is {host_budget}")
    return [dataclasses.replace(t, location=l) for t, l in zip(tables, loc)]
