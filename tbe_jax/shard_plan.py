"""Where a sharded embedding's tables live: strategies, the planner, and the static layout every device shares.

`plan_sharding` picks a strategy per table (`ShardingPlan`); `ShardLayout` turns a plan into what the routed step in
`tbe_jax.sharding` needs: per device and storage width its pieces (row and column blocks of tables) stacked in
one buffer, the "slots" (a feature read through one of the device's pieces; the same count per width on every
device), and the per-slot facts the senders index by destination. Replicated (`"data"`) tables have no slots
(each device reads its own copy for its own samples); their copies come first in each buffer, at the same rows on
every device (`ShardLayout.data_row0`), so a replicated row has one buffer row, its logical id, everywhere.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Mapping

import numpy as np

from tbe_jax.tbe import TableBatchedEmbedding

__all__ = ["STRATEGIES", "ShardingPlan", "plan_sharding"]

STRATEGIES = ("table", "row", "column", "data")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Per table: its strategy, and for `"table"` its device (`owner`, -1 otherwise)."""

    strategies: tuple[str, ...]
    owners: tuple[int, ...]
    num_devices: int

    def __post_init__(self):
        if len(self.strategies) != len(self.owners):
            raise ValueError("strategies and owners must have one entry per table")
        for t, (s, o) in enumerate(zip(self.strategies, self.owners)):
            if s not in STRATEGIES:
                raise ValueError(f"table {t}: strategy must be one of {STRATEGIES}, got {s!r}")
            if s == "table" and not 0 <= o < self.num_devices:
                raise ValueError(f"table {t}: owner {o} is not a device index in [0, {self.num_devices})")


@dataclasses.dataclass(frozen=True)
class _Piece:
    table: int
    device: int
    row0: int
    rows: int
    col0: int
    cols: int


def as_int(x):
    """`x` as a Python int if it is an integer scalar (an int, a NumPy integer or a 0-d integer array; not a
    bool), else None."""
    if isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.dtype == np.bool_):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def plan_sharding(emb: TableBatchedEmbedding, num_devices: int, plan: Mapping | str | None = None) -> ShardingPlan:
    """Pick a strategy per table (and an owner for table-wise ones).

    `plan` fixes some tables (`{table index or TableSpec.name: strategy}`; a strategy
    may be `("table", device)` to pin the owner); the planner decides the rest. A
    strategy string alone applies to every table; a list gives one per table, in order.

    Cost model (per device; n devices; a table of E rows, D columns, s bytes per
    value, read by features with `bag_size_hint` ids per bag, 1 if unset):

    - memory: `E * D * s` (plus its optimizer state, in proportion) on the owner for
      `"table"`, `1/n` of it on every device for `"row"` / `"column"`, all of it on
      every device for `"data"`;
    - lookups: a table-wise table's lookups all run on its owner; row-wise ones
      spread by id value; column-wise ones run on every device (on `D/n` columns);
      replicated ones on each sample's own device;
    - bytes moved per step per sample: ids `4 * L` to the owner (all devices for
      `"column"`; none for `"data"`), pooled rows `4 * D` back (from every device for
      `"row"`: partial sums); a replicated table's update all-gathers each device's
      touched rows, `4 * (D + 1)` bytes per local id, to every device.

    Rule: a table larger than a fair share of all tables' memory (`total / n`) goes
    `"row"` (it would unbalance memory); every other table goes `"table"`, placed
    largest first on the device with the least load, where load adds the table's
    share of total memory and its share of total lookups (bytes read per step).
    `"column"` and `"data"` are never chosen automatically (`"column"` moves more ids
    than `"table"`; `"data"` costs n copies and an all-gather of gradients); ask for
    them explicitly.

    Tables in host memory (`TableSpec.location` "host" or "host_cached") count apart: their bytes are not HBM's
    (the memory share of a device table is of the device tables' total), their lookups are (each device reads
    its host rows over its own bus), and one larger than a fair share of the host tables' total goes `"row"`,
    which spreads its bus reads over every device. They take `"table"` or `"row"` only.
    """
    n = int(num_devices)
    if n < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    tables = emb.tables
    names = {t.name: i for i, t in enumerate(tables) if t.name}
    fixed: dict[int, tuple[str, int]] = {}
    if isinstance(plan, str):  # one strategy for every table
        plan = {t: plan for t in range(len(tables))}
    elif isinstance(plan, (list, tuple)):  # one strategy per table, in order
        if len(plan) != len(tables):
            raise ValueError(f"plan has {len(plan)} strategies; the embedding has {len(tables)} tables")
        plan = dict(enumerate(plan))
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"plan must be None, a strategy in {STRATEGIES} for every table, a list of one strategy "
                        f"per table, or a dict {{table name or index: strategy}}; got {type(plan).__name__}")
    for key, val in dict(plan or {}).items():
        if isinstance(key, str):
            if key not in names:
                raise ValueError(f"plan names table {key!r}, which is not a TableSpec.name of this embedding")
            t = names[key]
        else:
            t = as_int(key)  # not int(): 1.7 or True would quietly name table 1
            if t is None:
                raise ValueError(f"plan names table {key!r}: a table is named by its int index or its TableSpec.name")
            if not 0 <= t < len(tables):
                raise ValueError(f"plan names table {key!r}: not a table index in [0, {len(tables)})")
        if isinstance(val, (tuple, list)):
            if len(val) != 2 or val[0] != "table":
                raise ValueError(f"plan[{key!r}]: a pair must be ('table', device), got {val!r}")
            d = as_int(val[1])
            if d is None or not 0 <= d < n:
                raise ValueError(f"plan[{key!r}] = {tuple(val)!r}: the device must be an int index in [0, {n}) "
                                 f"(the mesh axis has {n} devices), got {val[1]!r}")
            fixed[t] = ("table", d)
        else:
            if val not in STRATEGIES:
                raise ValueError(f"plan[{key!r}] must be one of {STRATEGIES} or ('table', device), got {val!r}")
            fixed[t] = (val, -1)
    itemsize = emb.weights_dtype.itemsize
    mem = np.array([t.num_embeddings * t.embedding_dim * itemsize for t in tables], np.float64)
    reads = np.zeros(len(tables))
    for f, t in enumerate(emb.feature_table_map):
        reads[t] += (tables[t].bag_size_hint or 1) * tables[t].embedding_dim * itemsize
    strategies = [None] * len(tables)
    owners = [-1] * len(tables)
    load = np.zeros(n)
    on_device = np.array([t.location == "device" for t in tables], bool)
    # per table, the total its memory is a share of: the device tables' or the host tables'
    total_mem = np.where(on_device, max(mem[on_device].sum(), 1.0), max(mem[~on_device].sum(), 1.0))
    total_reads = max(reads.sum(), 1.0)
    cost = np.where(on_device, mem / total_mem, 0.0) + reads / total_reads
    for t, (s, o) in fixed.items():
        strategies[t] = s
        if s == "table":
            if o < 0:
                strategies[t] = None  # placed below, as a free table-wise one
            else:
                owners[t] = o
                load[o] += cost[t]
        elif s in ("row", "column"):
            load += cost[t] / n
        else:
            load += cost[t]
    free = [t for t in range(len(tables)) if strategies[t] is None]
    for t in free:
        if t not in fixed and n > 1 and mem[t] > total_mem[t] / n:
            strategies[t] = "row"
            load += cost[t] / n
    for t in sorted((t for t in free if strategies[t] is None), key=lambda t: (-cost[t], t)):
        j = int(np.argmin(load))
        strategies[t], owners[t] = "table", j
        load[j] += cost[t]
    return ShardingPlan(tuple(strategies), tuple(owners), n)


def _pieces(emb: TableBatchedEmbedding, plan: ShardingPlan) -> list[_Piece]:
    n = plan.num_devices
    out = []
    for t, spec in enumerate(emb.tables):
        s, e, d = plan.strategies[t], spec.num_embeddings, spec.embedding_dim
        if s == "table":
            out.append(_Piece(t, plan.owners[t], 0, e, 0, d))
        elif s == "row":
            r = -(-e // n)
            out += [_Piece(t, j, j * r, min(e, (j + 1) * r) - j * r, 0, d) for j in range(n) if j * r < e]
        elif s == "column":
            c = -(-d // n)
            out += [_Piece(t, j, 0, e, j * c, min(d, (j + 1) * c) - j * c) for j in range(n) if j * c < d]
        else:
            out += [_Piece(t, j, 0, e, 0, d) for j in range(n)]
    return out


class ShardLayout:
    """The static structure every device shares: storage widths, slots, routing and assembly maps."""

    def pool(self, width: int, location: str = "device") -> int:
        """The pool of pieces of `width` columns in `location`."""
        return self.pool_keys.index((width, location))

    def __init__(self, emb: TableBatchedEmbedding, plan: ShardingPlan):
        n = plan.num_devices
        self.n = n
        pieces = _pieces(emb, plan)
        self.pieces = pieces
        # Storage pools: one per (width, location) of the pieces, in order of first appearance. A table in host
        # memory ("host", "host_cached") keeps its location: its pieces go to a pool of that location, which the
        # owners' embedding (`ShardedTableBatchedEmbedding.local`) keeps in host memory (behind an HBM cache for
        # "host_cached"), so no piece of it is ever an HBM buffer.
        keys: list[tuple[int, str]] = []
        for p in pieces:
            k = (p.cols, emb.tables[p.table].location)
            if k not in keys:
                keys.append(k)
        self.pool_keys = tuple(keys)
        self.widths = tuple(w for w, _ in keys)  # per pool its width (a width may have pools in several locations)
        self.locations = tuple(loc for _, loc in keys)  # per pool: "device", "host" or "host_cached"
        self.piece_pool = {p: keys.index((p.cols, emb.tables[p.table].location)) for p in pieces}
        nc = len(keys)
        # Storage: per device and width, its pieces stacked in table order, the replicated ("data") tables' copies
        # first: they sit at the same rows on every device, so a replicated row's buffer row (its logical id among
        # the replicated rows of its width, tables in order) is the same everywhere.
        self.pool_row = {}
        rows_used = np.zeros((n, nc), np.int64)
        for p in sorted(pieces, key=lambda p: plan.strategies[p.table] != "data"):
            c = self.piece_pool[p]
            self.pool_row[p] = int(rows_used[p.device, c])
            rows_used[p.device, c] += p.rows
        self.pool_rows = tuple(max(1, int(rows_used[:, c].max())) for c in range(nc))
        # Slots: per device and width, (feature, piece) pairs in feature order.
        readers: dict[int, list[int]] = {}
        for f, t in enumerate(emb.feature_table_map):
            readers.setdefault(t, []).append(f)
        per = [[[] for _ in range(nc)] for _ in range(n)]
        for p in pieces:
            if plan.strategies[p.table] == "data":  # looked up where its samples are, not routed
                continue
            for f in readers.get(p.table, []):
                per[p.device][self.piece_pool[p]].append((f, p))
        for j in range(n):
            for c in range(nc):
                per[j][c].sort(key=lambda x: x[0])
        self.slots_per_width = tuple(max(len(per[j][c]) for j in range(n)) for c in range(nc))
        ns = sum(self.slots_per_width)
        self.num_slots = ns
        slot_width, slot_pool = [], []
        for c in range(nc):
            slot_width += [self.widths[c]] * self.slots_per_width[c]
            slot_pool += [c] * self.slots_per_width[c]
        self.slot_width = tuple(slot_width)
        self.slot_pool = tuple(slot_pool)  # per slot: its pool (the owners' embedding's table)
        self.slot_col = tuple(int(x) for x in np.concatenate([[0], np.cumsum(slot_width)[:-1]])) if ns else ()
        self.width = int(sum(slot_width))
        nf = emb.num_features
        feat = -np.ones((n, ns), np.int32)
        row0 = np.zeros((n, ns), np.int32)
        rows = np.zeros((n, ns), np.int32)
        prow = np.zeros((n, ns), np.int32)
        slot_of = -np.ones((n, nf), np.int32)
        q0 = np.concatenate([[0], np.cumsum(self.slots_per_width)[:-1]]).astype(int) if nc else []
        self.slot_piece = {}
        for j in range(n):
            for c in range(nc):
                for s, (f, p) in enumerate(per[j][c]):
                    q = q0[c] + s
                    feat[j, q], row0[j, q], rows[j, q], prow[j, q] = f, p.row0, p.rows, self.pool_row[p]
                    slot_of[j, f] = q
                    self.slot_piece[(j, q)] = (f, p)
        self.slot_feat, self.slot_row0, self.slot_rows, self.slot_prow, self.slot_of = feat, row0, rows, prow, slot_of
        # Assembly and gradient routing work from these per-slot / per-feature facts on the device (index maps
        # per output column would be constants growing with sum D).
        col0 = np.zeros((n, ns), np.int32)
        ncols = np.zeros((n, ns), np.int32)
        # Column-wise tables: which slots read one, and its whole rows' length (row statistics sum over it).
        column = np.zeros((n, ns), bool)
        row_dim = np.zeros((n, ns), np.int32)
        depth = 1
        for (j, q), (f, p) in self.slot_piece.items():
            col0[j, q], ncols[j, q] = p.col0, p.cols
            column[j, q] = plan.strategies[p.table] == "column"
            row_dim[j, q] = emb.tables[p.table].embedding_dim
        self.has_column = "column" in plan.strategies
        self.slot_column, self.slot_row_dim = column, row_dim
        # Per width: whether any device stores a column block there (its update then sums row statistics).
        self.width_has_column = tuple(any(self.piece_pool[p] == c and plan.strategies[p.table] == "column"
                                          for p in pieces) for c in range(nc))
        for t, st in enumerate(plan.strategies):
            if st == "row":
                depth = max(depth, sum(1 for p in pieces if p.table == t))
        self.slot_col0, self.slot_ncols, self.depth = col0, ncols, depth
        dims = emb.feature_dims
        self.feature_col = np.concatenate([[0], np.cumsum(dims)[:-1]]).astype(np.int32)
        self.out_width = int(sum(dims))
        # Replicated tables: per table its buffer row (the same on every device), the features reading one (in
        # order) and their output columns.
        self.data_row0 = {}
        for p in pieces:
            if plan.strategies[p.table] == "data":
                r = self.data_row0.setdefault(p.table, self.pool_row[p])
                assert r == self.pool_row[p], "a replicated table must sit at the same rows on every device"
        self.data_features = tuple(f for f, t in enumerate(emb.feature_table_map) if plan.strategies[t] == "data")
        self.data_cols = np.asarray([int(self.feature_col[f]) + i for f in self.data_features
                                     for i in range(dims[f])], np.int32)
