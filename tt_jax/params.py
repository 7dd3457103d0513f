"""The params layout of `tt_jax.TTEmbeddingBag`: each table group's cores stored stacked, one buffer per core.

    params = {"cores": cores},   cores[g][t]: float32 [P_gt, r_{t-1}, q_t, r_t]

The groups are `prefix.core_groups(specs)`: the tables sharing (q_shapes, ranks), in the order of their first
table, each group's tables in id order (`groups[g].tables`). Core t of group g stacks core t of its tables along
p: the i-th table of the group owns the slices `groups[g].core_base[t][i] : core_base[t][i + 1]`, so P_gt is the
sum of their p_t. These are the bytes the FlowTT kernels read (flattened: `prefix.stack_cores`), so a lookup or a
backward reads the params with no concatenation, and the optimizer updates each (group, core) buffer in one op.

A group of one table holds that table's cores as they are: where no two tables share (q_shapes, ranks), the
params are the per-table layout of earlier releases (`{"cores": per table, per core}`), unchanged. Otherwise
convert per-table cores once with `TTEmbeddingBag.set_cores(None, per_table)` (and an optimizer state with
`TTEmbeddingBag.stack_opt_state`); `get_cores` gives the per-table view back (slices of the buffers).

The optimizer state's slots have the params' structure: element-wise slots a core's shape, row-wise ones
`[P_gt]` (one value per stacked slice).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tt_jax import prefix

__all__ = ["check", "group_cores", "group_index", "groups", "stack", "stacked_shapes", "tables_to_params",
           "unstack"]

_CONVERT = "convert per-table cores with params = emb.set_cores(None, per_table_cores)"


def groups(specs) -> tuple[prefix.StackedTables, ...]:
    """The params' table groups (`prefix.core_groups`)."""
    return _groups(tuple(specs))


@functools.lru_cache(maxsize=256)
def _groups(specs):
    return prefix.core_groups(specs)


def stacked_shapes(specs) -> list[list[tuple[int, int, int, int]]]:
    """Per group, per core, the shape of its stacked buffer `[P_gt, r_{t-1}, q_t, r_t]`."""
    out = []
    for layout in groups(specs):
        r, q = layout.full_ranks, layout.q_shapes
        out.append([(layout.core_base[t][-1], r[t], q[t], r[t + 1]) for t in range(layout.num_cores)])
    return out


def stack(specs, per_table) -> tuple[tuple[jax.Array, ...], ...]:
    """Per group, per core, its tables' arrays (`per_table[table][core]`: cores, or state of the cores' shapes
    or `[p_t]`) concatenated along axis 0, in the group's table order (a group of one table: its arrays)."""
    out = []
    for layout in groups(specs):
        cores = []
        for t in range(layout.num_cores):
            parts = [per_table[k][t] for k in layout.tables]
            cores.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
        out.append(tuple(cores))
    return tuple(out)


def unstack(specs, stacked) -> list[list[jax.Array]]:
    """Per table, per core, its slices of the stacked buffers (`stacked[group][core]`: cores, gradients, masks or
    state, stacked along axis 0; a None buffer gives None slices): `stack`'s inverse."""
    out: list = [None] * len(specs)
    for layout, bufs in zip(groups(specs), stacked):
        for i, k in enumerate(layout.tables):
            if len(layout.tables) == 1:
                out[k] = list(bufs)
            else:
                out[k] = [None if b is None else b[layout.core_base[t][i] : layout.core_base[t][i + 1]]
                          for t, b in enumerate(bufs)]
    return out


def group_index(specs, layout: prefix.StackedTables) -> int:
    """The index in `groups(specs)` of `layout`, a group of `prefix.stack_tables(specs, ...)`: the group of the
    same tables (whatever its sort limits)."""
    return [g.tables for g in groups(specs)].index(layout.tables)


def group_cores(specs, layout: prefix.StackedTables, cores):
    """The stacked cores (per core) of `layout`, a group of `prefix.stack_tables(specs, ...)`, in the params'
    `cores` (per group of `groups(specs)`, per core)."""
    return cores[group_index(specs, layout)]


def tables_to_params(specs, cores: Sequence[Sequence]) -> dict:
    """`{"cores": stacked}` from per-table cores (`set_cores`): checked against the specs, converted to float32."""
    if len(cores) != len(specs):
        raise ValueError(f"expected cores for {len(specs)} tables, got {len(cores)}")
    tables = []
    for i, (spec, cs) in enumerate(zip(specs, cores)):
        shapes = spec.core_shapes()
        if len(cs) != len(shapes):
            raise ValueError(f"table {i}: expected {len(shapes)} cores, got {len(cs)}")
        for t, (c, shape) in enumerate(zip(cs, shapes)):
            if tuple(np.shape(c)) != shape:
                raise ValueError(f"table {i} core {t} must have shape {shape}, got {tuple(np.shape(c))}")
            dt = c.dtype if hasattr(c, "dtype") else np.asarray(c).dtype
            if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
                raise TypeError(f"table {i} core {t} must hold real numbers (converted to float32), got {dt}")
        tables.append(tuple(jnp.asarray(c, jnp.float32) for c in cs))
    return {"cores": stack(specs, tables)}


def _shapes_of(cs):
    if not isinstance(cs, (list, tuple)):
        return None
    return [tuple(c.shape) if hasattr(c, "shape") else type(c).__name__ for c in cs]


def _per_table(specs, cores) -> bool:
    """Whether `cores` look like per-table cores (one entry per table, each of its spec's core shapes)."""
    return (isinstance(cores, (list, tuple)) and len(cores) == len(specs)
            and all(_shapes_of(cs) == list(s.core_shapes()) for s, cs in zip(specs, cores)))


def check(specs, params) -> None:
    """Raise unless `params` are `{"cores": per group, per core}` of `specs` (module doc; static: shapes and
    dtypes only). Per-table cores (the layout before the stacking, where it differs) are named as such."""
    try:
        cores = params["cores"]
    except (KeyError, TypeError, IndexError):
        raise TypeError("params must be the dict emb.init/set_cores return ({'cores': per table group, per core}), "
                        f"got {type(params).__name__}") from None
    gs = groups(specs)
    want = stacked_shapes(specs)
    if len(gs) != len(specs) and _per_table(specs, cores):  # (with one table per group the layouts coincide)
        raise ValueError(
            f"params['cores'] holds per-table cores ({len(specs)} tables), the layout before tables sharing "
            f"q_shapes and ranks were stored stacked: this embedding stores {len(gs)} table group(s) "
            f"{[g.tables for g in gs]}, one buffer per group per core; {_CONVERT} (once, e.g. after loading an old "
            "checkpoint; an optimizer state: emb.stack_opt_state(opt_state))")
    if not isinstance(cores, (list, tuple)) or len(cores) != len(gs):
        got = len(cores) if isinstance(cores, (list, tuple)) else type(cores).__name__
        raise ValueError(f"params['cores'] must hold the stacked cores of {len(gs)} table group(s) "
                         f"{[g.tables for g in gs]} (tables grouped by q_shapes and ranks), got {got} "
                         "(build params with emb.init or emb.set_cores)")
    for g, (layout, cs, shapes) in enumerate(zip(gs, cores, want)):
        got = _shapes_of(cs)
        what = (f"table {layout.tables[0]}'s spec" if len(layout.tables) == 1
                else f"tables {layout.tables} stacked along p")
        if got is None:
            raise ValueError(f"params['cores'][{g}] must be a sequence of the group's {len(shapes)} cores (shapes "
                             f"{shapes}: {what}), got {type(cs).__name__}")
        if got != shapes:
            raise ValueError(f"params['cores'][{g}] must have shapes {shapes} ({what}), got {got}")
        for t, c in enumerate(cs):
            if not jnp.issubdtype(c.dtype, jnp.floating):
                raise TypeError(f"params['cores'][{g}][{t}] must be floating point (float32), got {c.dtype}")
