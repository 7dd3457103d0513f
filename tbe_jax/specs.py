"""Static descriptions of tables and of how they are stored.

Everything here is hashable and built from Python ints, so a
`TableBatchedEmbedding` can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Sequence

import numpy as np


LOCATIONS = ("device", "host", "host_cached")


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table: `num_embeddings` rows of `embedding_dim` values.

    Args:
      num_embeddings: rows in the table (E), at least 1.
      embedding_dim: values per row (D), at least 1.
      name: optional label, used in error messages.
      bag_size_hint: optional typical bag length of the features reading this
        table (a multi-hot size fixed by the data, as MLPerf DLRMv2's). Never needed
        for correctness; it changes only the forward's schedule. At most 2: the
        features get programs of `ForwardConfig.short_bag_groups` sub-groups of bags
        (one-id bags pay a program's fixed cost once per more bags: MLPerf DLRMv2's
        tables' forward 1.1x -> 1.37x FBGEMM's on an H200, docs/kernels.md). Small
        tables (E <= 64, 64 <= D <= 128; see `TableBatchedEmbedding.plan`): >= 64 fixes
        the histogram kernel, smaller the generic one; without a hint that choice is
        made on the device for each batch from the bag lengths.
      location: where the table's rows live. "device" (default): in the GPU's memory. "host": in pinned host
        memory, read and written in place by the kernels over the bus (no copy, no cache; for tables larger
        than the GPU's memory, at the bus's speed). "host_cached": in pinned host memory with its hot rows in
        an HBM cache of `cache_load_factor * E` rows (`TableBatchedEmbedding`'s `cache_load_factor`,
        `cache_policy`; filled by `emb.prefetch`). Results never depend on it: see `docs/host_memory.md`.
        On a CPU, "host" rows are an ordinary second buffer.
    """

    num_embeddings: int
    embedding_dim: int
    name: str | None = None
    bag_size_hint: int | None = None
    location: str = "device"

    def __post_init__(self):
        for field in ("num_embeddings", "embedding_dim"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"TableSpec.{field} must be a positive int, got {v!r}")
            object.__setattr__(self, field, int(v))
        if self.bag_size_hint is not None and (
            isinstance(self.bag_size_hint, bool)
            or not isinstance(self.bag_size_hint, (int, np.integer)) or self.bag_size_hint < 0
        ):
            raise ValueError(
                f"TableSpec.bag_size_hint must be None or an int >= 0, got {self.bag_size_hint!r}"
            )
        if self.location not in LOCATIONS:
            raise ValueError(f"TableSpec.location must be one of {LOCATIONS}, got {self.location!r}")

    def label(self, t: int) -> str:
        return f"table {t}" + (f" ({self.name!r})" if self.name else "")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_dim(dim: int, itemsize: int) -> int:
    """The stored row length of tables of `dim` values of `itemsize` bytes: `dim` rounded up to a
    multiple of 16 bytes when that wastes at most 1/8 of the row, else `dim`.

    A row whose byte length is a multiple of 16 (and whose buffer starts 16-byte aligned) is moved
    with 16-byte vector instructions; other rows with 8- or 4-byte ones. On the H200 the backward's
    update of fp16 rows of dims = 4 mod 8 took 1.3x the time of the next dim's aligned rows
    (0.166 against 0.128 ms for the dims 68..124 of the dims 4..128 model,
    benchmarks/results/archive/narrow64-backward-20261201-2328). Small dims (fp16 D = 4, 12, 20, 28) stay
    unpadded: padding them would cost 14-100% more memory.
    """
    vec = max(1, 16 // int(itemsize))
    up = -(-int(dim) // vec) * vec
    return up if (up - dim) * 8 <= dim else int(dim)


@dataclasses.dataclass(frozen=True)
class StorageLayout:
    """Where each table lives in the parameter pytree.

    Tables of equal `embedding_dim` are stacked row-wise into one 2-D buffer
    `[sum of their E, stride]`, so a kernel specialised for that D reads rows at
    `buffer[row_offset[t] + id]` with a compile-time row stride. One buffer per
    distinct D, named `"d{D}"`. `stride` is D, or D rounded up to 16 bytes where
    that costs at most 1/8 more memory (`padded_dim`; e.g. fp16 D = 36, 44, ..., 124),
    so that rows move with 16-byte vector instructions. Columns past D are padding:
    nothing reads them into a result (`get_tables` drops them, `set_tables` and
    `init` write zeros there, optimizers keep them zero), so their values never
    matter. `TableBatchedEmbedding(..., pad_rows=False)` stores every buffer unpadded.

    Tables in host memory (`TableSpec.location="host"`) get buffers of their own, one per D, named
    `"d{D}_host"` (`locations[g] == "host"`); "host_cached" tables are split before a layout is built
    (`tbe_jax.host_cache`), so a layout holds only "device" and "host" buffers.
    """

    dims: tuple[int, ...]  # D per buffer, in order of first appearance
    group_rows: tuple[int, ...]  # rows in each buffer
    table_group: tuple[int, ...]  # per table: its buffer
    table_row_offset: tuple[int, ...]  # per table: first row in its buffer
    strides: tuple[int, ...] = ()  # per buffer: its stored row length (>= its dim); () means the dims
    locations: tuple[str, ...] = ()  # per buffer: "device" or "host"; () means all "device"

    def __post_init__(self):
        if not self.strides:
            object.__setattr__(self, "strides", tuple(self.dims))
        if not self.locations:
            object.__setattr__(self, "locations", ("device",) * len(self.dims))
        if len(self.locations) != len(self.dims) or not set(self.locations) <= {"device", "host"}:
            raise ValueError(f"locations {self.locations} must give 'device' or 'host' per buffer")
        if len(self.strides) != len(self.dims) or any(s < d for s, d in zip(self.strides, self.dims)):
            raise ValueError(f"strides {self.strides} must give one stored row length >= each dim {self.dims}")

    @staticmethod
    def build(tables: Sequence[TableSpec], itemsize: int | None = None) -> "StorageLayout":
        """The layout of `tables`; with `itemsize` (the weights' bytes per value), rows padded as
        `padded_dim` says, else unpadded."""
        classes: list[tuple[int, str]] = []
        rows: list[int] = []
        tgroup, toff = [], []
        for t in tables:
            if t.location == "host_cached":
                raise ValueError("a StorageLayout holds 'device' and 'host' tables; split 'host_cached' ones "
                                 "first (tbe_jax.host_cache)")
            c = (t.embedding_dim, t.location)
            if c not in classes:
                classes.append(c)
                rows.append(0)
            g = classes.index(c)
            tgroup.append(g)
            toff.append(rows[g])
            rows[g] += t.num_embeddings
        dims = [d for d, _ in classes]
        for g, r in enumerate(rows):
            if r >= 2**31:
                raise ValueError(
                    f"tables of embedding_dim={dims[g]} hold {r} rows together; the int32 "
                    "row index of one storage buffer must stay below 2**31"
                )
        strides = tuple(padded_dim(d, itemsize) if itemsize else d for d in dims)
        return StorageLayout(tuple(dims), tuple(rows), tuple(tgroup), tuple(toff), strides,
                             tuple(loc for _, loc in classes))

    def key(self, g: int) -> str:
        return f"d{self.dims[g]}" + ("_host" if self.locations[g] == "host" else "")

    def on_host(self, g: int) -> bool:
        """Buffer `g` lives in host memory (its tables' `location="host"`)."""
        return self.locations[g] == "host"

    @property
    def padded(self) -> bool:
        return self.strides != self.dims

    def shape(self, g: int) -> tuple[int, int]:
        """The shape of buffer `g`: `[rows, stride]`."""
        return (self.group_rows[g], self.strides[g])

    def pad(self, g: int, x):
        """`x` (`[..., dims[g]]`) with zero columns appended up to buffer `g`'s stride."""
        extra = self.strides[g] - self.dims[g]
        if not extra:
            return x
        import jax.numpy as jnp  # this module's dataclasses stay importable without jax

        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])

    def unpad(self, g: int, x):
        """The first `dims[g]` columns of `x` (`[..., stride]`): the values without the padding."""
        return x if self.strides[g] == self.dims[g] else x[..., : self.dims[g]]


@dataclasses.dataclass(frozen=True)
class FeaturePlan:
    """Static per-feature facts for one batch shape (fixed B, or VBE sizes).

    Feature f reads table `table[f]` (dim `dim[f]`, stored in buffer `group[f]`
    from row `row_offset[f]`); its bags are `offsets[bag_base[f] : bag_base[f] +
    batch[f] + 1]`; its pooled row for bag b starts at flat output element
    `out_base[f] + b * out_stride[f]`.
    """

    table: tuple[int, ...]
    dim: tuple[int, ...]
    group: tuple[int, ...]
    row_offset: tuple[int, ...]
    num_rows: tuple[int, ...]
    batch: tuple[int, ...]
    bag_base: tuple[int, ...]
    out_base: tuple[int, ...]
    out_stride: tuple[int, ...]
    vbe: bool
    out_size: int

    @property
    def num_features(self) -> int:
        return len(self.table)

    @property
    def num_bags(self) -> int:
        return sum(self.batch)

    @staticmethod
    def build(
        tables: Sequence[TableSpec],
        layout: StorageLayout,
        feature_table_map: Sequence[int],
        batch: Sequence[int],
        vbe: bool,
    ) -> "FeaturePlan":
        dim = [tables[t].embedding_dim for t in feature_table_map]
        bag_base = np.concatenate([[0], np.cumsum(batch)[:-1]]).astype(int).tolist()
        if vbe:
            sizes = [b * d for b, d in zip(batch, dim)]
            out_base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
            out_stride = list(dim)
            out_size = int(sum(sizes))
        else:
            out_base = np.concatenate([[0], np.cumsum(dim)[:-1]]).astype(int).tolist()
            out_stride = [int(sum(dim))] * len(dim)
            out_size = int(batch[0] * sum(dim)) if batch else 0
        if out_size >= 2**31:
            raise ValueError(f"pooled output of {out_size} elements must stay below 2**31")
        return FeaturePlan(
            table=tuple(int(t) for t in feature_table_map),
            dim=tuple(dim),
            group=tuple(layout.table_group[t] for t in feature_table_map),
            row_offset=tuple(layout.table_row_offset[t] for t in feature_table_map),
            num_rows=tuple(tables[t].num_embeddings for t in feature_table_map),
            batch=tuple(int(b) for b in batch),
            bag_base=tuple(int(b) for b in bag_base),
            out_base=tuple(int(b) for b in out_base),
            out_stride=tuple(int(s) for s in out_stride),
            vbe=bool(vbe),
            out_size=out_size,
        )


def checked_tables(specs: Sequence["TableSpec"], tables) -> list:
    """`tables` (one `[E_t, D_t]` array per spec, in order, as `get_tables` returns) checked: a sequence (not a
    dict) of the right length, each of real numbers (not complex) and of its spec's shape. Nested lists become
    NumPy arrays; arrays are returned as given (no copy, no cast)."""
    import jax.numpy as jnp

    if isinstance(tables, Mapping) or not isinstance(tables, Sequence) and not hasattr(tables, "__len__"):
        raise TypeError(f"tables must be a sequence of {len(specs)} arrays, one [E_t, D_t] per table in order (as "
                        f"get_tables returns), got {type(tables).__name__}")
    if len(tables) != len(specs):
        raise ValueError(f"expected {len(specs)} tables, got {len(tables)}")
    out = []
    for t, (spec, arr) in enumerate(zip(specs, tables)):
        if not hasattr(arr, "shape"):
            arr = np.asarray(arr)
        dt = getattr(arr, "dtype", None)
        if dt is None or not any(jnp.issubdtype(dt, k) for k in (jnp.floating, jnp.integer, jnp.bool_)):
            raise TypeError(f"{spec.label(t)} must hold real numbers, got dtype {dt}")
        shape = (spec.num_embeddings, spec.embedding_dim)
        if tuple(arr.shape) != shape:
            raise ValueError(f"{spec.label(t)} must have shape {shape}, got {tuple(arr.shape)}")
        out.append(arr)
    return out


def checked_feature_table_map(feature_table_map, num_tables: int) -> tuple[int, ...]:
    """`TableBatchedEmbedding`'s `feature_table_map` checked: None (one feature per table), else a non-empty
    sequence of int table indices in `[0, num_tables)`, as a tuple of ints."""
    import operator

    if feature_table_map is None:
        return tuple(range(num_tables))
    if isinstance(feature_table_map, (str, bytes)):
        raise TypeError(f"feature_table_map must be a sequence of table indices, got {feature_table_map!r}")
    fmap = []
    for f, t in enumerate(feature_table_map):
        try:
            if isinstance(t, (bool, np.bool_)):
                raise TypeError
            fmap.append(operator.index(t))
        except TypeError:
            raise TypeError(f"feature_table_map[{f}] must be an int table index, got {t!r}") from None
    if not fmap:
        raise ValueError("feature_table_map must name at least one table")
    for f, t in enumerate(fmap):
        if not 0 <= t < num_tables:
            raise ValueError(f"feature_table_map[{f}]={t} is not a table index in [0, {num_tables})")
    return tuple(fmap)


def hint_bag_sizes(tables: Sequence[TableSpec], offsets, feature_table_map=None,
                   batch_size_per_feature=None) -> list[TableSpec]:
    """`tables` with each table's `bag_size_hint` set from a sample batch: the mean bag length of the features
    that read it in `offsets` (FBGEMM's layout, feature-major, as `TableBatchedEmbedding` takes it), rounded half
    up. Tables no feature reads, and those of features without bags in the sample, keep their hint.

    For models whose bag lengths are not fixed by the data (with fixed multi-hot sizes, give the sizes): one call
    on a representative batch, outside `jit` (it reads the offsets' values), before building the embedding.
    Hints change only how the forward is scheduled (`TableSpec.bag_size_hint`), not what it computes.

      >>> import numpy as np, tbe_jax
      >>> tables = [tbe_jax.TableSpec(1000, 16), tbe_jax.TableSpec(50, 64)]
      >>> offsets = np.array([0, 1, 2, 2, 3, 23, 43, 63, 83])   # B = 4: one id per bag, then 20 per bag
      >>> [t.bag_size_hint for t in tbe_jax.hint_bag_sizes(tables, offsets)]
      [1, 20]
    """
    import jax

    if isinstance(offsets, jax.core.Tracer):
        raise TypeError("hint_bag_sizes reads a sample batch's offsets: call it outside jit, on concrete values")
    tables = list(tables)
    fmap = checked_feature_table_map(feature_table_map, len(tables))
    off = np.asarray(offsets)
    if off.ndim != 1 or off.size < 1 or not np.issubdtype(off.dtype, np.integer):
        raise ValueError(f"offsets must be a 1-D integer array, got shape {off.shape} and dtype {off.dtype}")
    off = off.astype(np.int64)
    bags = off.size - 1
    if batch_size_per_feature is None:
        if bags % len(fmap):
            raise ValueError(f"offsets has {bags} bags, not a multiple of the {len(fmap)} features "
                             "(variable batch sizes: pass batch_size_per_feature)")
        bpf = [bags // len(fmap)] * len(fmap)
    else:
        bpf = [int(b) for b in batch_size_per_feature]
        if len(bpf) != len(fmap) or min(bpf) < 0 or sum(bpf) != bags:
            raise ValueError(f"batch_size_per_feature {bpf} must give {len(fmap)} features' bag counts summing to "
                             f"the {bags} bags of offsets")
    if np.any(np.diff(off) < 0):
        raise ValueError("offsets must be non-decreasing")
    starts = np.concatenate([[0], np.cumsum(bpf)])
    ids, count = np.zeros(len(tables), np.int64), np.zeros(len(tables), np.int64)
    for f, t in enumerate(fmap):
        ids[t] += off[starts[f + 1]] - off[starts[f]]
        count[t] += bpf[f]
    return [dataclasses.replace(spec, bag_size_hint=int(np.floor(ids[t] / count[t] + 0.5))) if count[t] else spec
            for t, spec in enumerate(tables)]
