"""A DLRM-style click model over one `TableBatchedEmbedding` (optionally plus TT tables).

    dense x [B, 13] --bottom MLP--> h [B, D]
    sparse bags     --TBE (sum)---> e_1..e_F [B, D] each (one lookup call for all 26 features)
    z = [h, e_1, ..., e_F]           [B, F+1, D]
    interaction: h and the dot products <z_i, z_j> for i < j   [B, D + (F+1)F/2]
    top MLP -> logit [B];  loss: binary cross-entropy with logits

With `DLRMConfig(interaction="dcn")` (the demo's `--model dcnv2`, MLPerf's DLRMv2) the dot interaction
is DCN v2's low-rank cross network (`examples.dlrm.dcn`): x0 = [h, e_1, ..., e_F] `[B, (F+1)*D]`, L cross
layers `x_{l+1} = x0 * (U_l (V_l^T x_l) + b_l) + x_l` of rank r, then the top MLP on x_L; the dense
parameters gain `"cross": [{"v", "u", "b"}, ...]`, and the tables are drawn by `emb.init` (in blocks,
in place: MLPerf's 97 GiB of tables never exist twice). Every dense matmul (MLPs, interaction) takes
`precision=` from `DLRMConfig.matmul_precision` ("default": XLA's own; the dcnv2 presets "tensorfloat32").

The dense parameters are a plain pytree (`{"bottom": [...], "top": [...]}` of
`{"w", "b"}` layers) for optax; the tables are the TBE's params (`{"d{D}": [rows, D]}`),
trained by exact row-wise Adagrad on the looked-up rows: `DLRM.train_step` is one
`tbe_jax.train_step` (the lookups, the gradient of the loss with respect to the dense
parameters and to the pooled outputs, then each embedding's `apply_gradients`; the
tables never pass through `jax.grad`). See `examples.dlrm.train`.

With `DLRMConfig(tt_tables=K)` the K largest tables are tensor-train tables instead
(`tt_jax.TTEmbeddingBag`, ranks `tt_ranks`, shapes from `TTSpec`'s defaults) and the
other features stay in the TBE: a batch is then split on the host (`split_batch`) into
the TBE's ids/offsets and the TT features' `tt_indices`/`tt_offsets`, the two pooled
outputs are put back in feature order, and the embedding params, optimizer states and
optimizers are dicts `{"tbe": ..., "tt": ...}`: the step is one `tbe_jax.train_step` over
a dict of two `SparseLookup`s (the TT cores updated on the touched core slices by their
own optimizer, e.g. `tt_jax.RowwiseAdagrad`).

With `DLRM(config, mesh=mesh)` the TBE's tables are sharded over the mesh's axis
(`tbe_jax.shard` with its default planner; `emb` is then the
`ShardedTableBatchedEmbedding`, `emb_unsharded` the table layout it shards): a batch of
B examples is N local batches of B/N (`shard_batch`: `indices [N, cap]`, `offsets [N,
F*(B/N)+1]`; the dense features and labels stay `[B, ...]`, sharded by rows over the
same axis), the pooled output is `[B, F*D]` in the global batch's order, and the dense
MLPs (replicated parameters) run data parallel under `jit`: XLA partitions them by the
batch and sums their gradients. TT tables combine with a mesh: `tt` is then
`tt_jax.shard`'s `ShardedTTEmbeddingBag` (data parallel, the cores replicated on every
device; `tt_unsharded` the core it runs), whose inputs are per device like the TBE's
(`shard_batch` splits both feature groups: "indices"/"offsets" and
"tt_indices"/"tt_offsets", each `[N, cap]` / `[N, K*(B/N)+1]`) and whose output is
`[B, K*D]` in the same global order: the step is the same `tbe_jax.train_step` over the
two sharded lookups.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tbe_jax
import tt_jax
from examples.dlrm import dcn
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    """Layer sizes (hashable: usable as a static jit argument)."""

    table_rows: tuple[int, ...]
    num_dense: int = 13
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64,)  # hidden widths; a last layer of embedding_dim is added
    top_mlp: tuple[int, ...] = (128, 64)  # hidden widths; a last layer of 1 (the logit) is added
    weights_dtype: str = "float32"
    impl: str = "auto"
    tt_tables: int = 0  # the K largest tables held as TT tables (0: all in the TBE)
    tt_ranks: tuple[int, ...] = (16, 16)  # their inner TT ranks (len + 1 cores)
    interaction: str = "dot"  # "dot" (DLRM) or "dcn" (DCN v2's low-rank cross network: MLPerf's DLRMv2)
    dcn_layers: int = 3  # cross layers ("dcn")
    dcn_rank: int = 512  # their rank ("dcn")
    matmul_precision: str = "default"  # `precision=` of every dense matmul ("default": the backend's)
    host_tables: int = 0  # the K largest TBE tables kept in host memory behind an HBM cache ("host_cached")
    cache_load_factor: float = 0.2  # their caches' share of their rows
    # Per sparse feature, its fixed bag size where the data has one (MLPerf's multi-hot sizes): the tables'
    # `bag_size_hint`s (one- and two-id features then get the forward's grouped schedule). None: no hints.
    bag_size_hints: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.interaction not in ("dot", "dcn"):
            raise ValueError(f"interaction={self.interaction!r} must be 'dot' or 'dcn'")
        if self.bag_size_hints is not None and len(self.bag_size_hints) != len(self.table_rows):
            raise ValueError(f"bag_size_hints has {len(self.bag_size_hints)} entries for {len(self.table_rows)} tables")

    @staticmethod
    def preset(size: str, table_rows, impl: str = "auto", model: str = "dlrm",
               weights_dtype: str = "float32") -> "DLRMConfig":
        """Layer sizes for `tiny` / `small` (CPU) and `gpu` / `mlperf` (DLRM's Criteo shapes, D=128).

        `model="dcnv2"`: MLPerf DLRMv2 (`interaction="dcn"`, TF32 matmuls): at `gpu` / `mlperf` its sizes,
        bottom MLP 13 -> 512 -> 256 -> 128, 3 cross layers of rank 512, top MLP -> 1024 -> 1024 -> 512 ->
        256 -> 1; at `tiny` / `small` the same structure narrower (D 16, rank 32 / 64)."""
        table_rows = tuple(int(e) for e in table_rows)
        if model == "dcnv2":
            kw = dict(impl=impl, weights_dtype=weights_dtype, interaction="dcn", dcn_layers=3,
                      matmul_precision="tensorfloat32")
            if size == "tiny":
                return DLRMConfig(table_rows, embedding_dim=16, bottom_mlp=(32,), top_mlp=(64, 32), dcn_rank=32, **kw)
            if size == "small":
                return DLRMConfig(table_rows, embedding_dim=16, bottom_mlp=(64,), top_mlp=(128, 64), dcn_rank=64,
                                  **kw)
            if size in ("gpu", "mlperf"):
                return DLRMConfig(table_rows, embedding_dim=128, bottom_mlp=(512, 256),
                                  top_mlp=(1024, 1024, 512, 256), dcn_rank=512, **kw)
            raise ValueError(f"unknown size {size!r}")
        if model != "dlrm":
            raise ValueError(f"unknown model {model!r} (dlrm or dcnv2)")
        if weights_dtype != "float32":
            return dataclasses.replace(DLRMConfig.preset(size, table_rows, impl), weights_dtype=weights_dtype)
        if size == "mlperf":
            size = "gpu"
        if size == "tiny":
            return DLRMConfig(table_rows, embedding_dim=8, bottom_mlp=(32,), top_mlp=(64,), impl=impl)
        if size == "small":
            return DLRMConfig(table_rows, embedding_dim=16, bottom_mlp=(64,), top_mlp=(128, 64), impl=impl)
        if size == "gpu":
            return DLRMConfig(table_rows, embedding_dim=128, bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256),
                              impl=impl)
        raise ValueError(f"unknown size {size!r}")


def _init_mlps(key, *all_widths):
    """Dense layers `widths[0] -> widths[1] -> ...` for each `widths`, DLRM's init: W ~ N(0, 2/(in+out)),
    b ~ N(0, 1/out). One random draw for everything (each draw is a separate thing for XLA to compile)."""
    shapes = [[((n_in, n_out), np.sqrt(2.0 / (n_in + n_out))), ((n_out,), np.sqrt(1.0 / n_out))]
              for widths in all_widths for n_in, n_out in zip(widths[:-1], widths[1:])]
    total = sum(int(np.prod(shape)) for layer in shapes for shape, _ in layer)
    flat = jax.random.normal(key, (total,), jnp.float32)
    layers, start = [], 0
    for layer in shapes:
        arrays = []
        for shape, std in layer:
            size = int(np.prod(shape))
            arrays.append(flat[start : start + size].reshape(shape) * std)
            start += size
        layers.append({"w": arrays[0], "b": arrays[1]})
    out, i = [], 0
    for widths in all_widths:
        out.append(layers[i : i + len(widths) - 1])
        i += len(widths) - 1
    return out


def mlp(layers, x, *, final_relu: bool, precision=None):
    for i, layer in enumerate(layers):
        x = jnp.dot(x, layer["w"], precision=precision) + layer["b"]
        if i < len(layers) - 1 or final_relu:
            x = jax.nn.relu(x)
    return x


def pair_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The (i, j) pairs with i < j of n vectors, in row-major order (static)."""
    return np.triu_indices(n, k=1)


def dot_interaction(bottom: jax.Array, pooled: jax.Array, *, precision=None) -> jax.Array:
    """DLRM's dot interaction.

    Args:
      bottom: `[B, D]` bottom-MLP output.
      pooled: `[B, F*D]` pooled embeddings (the TBE output: feature f in columns f*D:(f+1)*D).

    Returns:
      `[B, D + (F+1)F/2]`: `bottom`, then `<z_i, z_j>` for i < j over z = [bottom, e_1..e_F].
    """
    b, d = bottom.shape
    z = jnp.concatenate([bottom[:, None, :], pooled.reshape(b, -1, d)], axis=1)  # [B, F+1, D]
    gram = jnp.einsum("bid,bjd->bij", z, z, precision=precision)
    i, j = pair_indices(z.shape[1])
    return jnp.concatenate([bottom, gram[:, i, j]], axis=1)


def split_features(indices, offsets, batch_size: int, features, padded_len: int):
    """The ids and offsets of `features` alone, FBGEMM format (host NumPy).

    Args:
      indices, offsets: one batch of all F features (feature-major, `F*B+1` offsets).
      batch_size: B.
      features: the features to keep, in the order they take in the output.
      padded_len: the ids are zero-padded to this length (more when they do not fit,
        rounded up to 256), past the last offset, so that batches keep one shape.

    Returns:
      (indices `[>= padded_len]` int32, offsets `[len(features)*B + 1]` int32).
    """
    offsets = np.asarray(offsets, np.int64)
    features = np.asarray(features, np.int64)
    lengths = np.diff(offsets).reshape(-1, batch_size)[features]  # [K, B]
    ids = [np.asarray(indices[offsets[f * batch_size] : offsets[(f + 1) * batch_size]]) for f in features]
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    out_offsets = np.zeros(lengths.size + 1, np.int32)
    np.cumsum(lengths.reshape(-1), out=out_offsets[1:])
    n = ids.shape[0]
    out = np.zeros(max(int(padded_len), -(-n // 256) * 256), np.int32)
    out[:n] = ids
    return out, out_offsets


def split_local(indices, offsets, num_features: int, n: int, cap: int):
    """One batch in FBGEMM format (`F*B+1` feature-major offsets) as `n` local batches of `B/n` examples
    each, in the sharded input format (host NumPy).

    Local batch k holds the examples `k*B/n .. (k+1)*B/n - 1` (every feature's bags of those examples, in
    feature order). Its ids are zero-padded to `cap` (past its last offset, as the generator pads), or to
    the longest local batch rounded up to 256 when one does not fit, so that batches keep one shape.

    Returns:
      (indices `[n, >= cap]` int32, offsets `[n, F*(B/n) + 1]` int32).
    """
    offsets = np.asarray(offsets, np.int64)
    f = int(num_features)
    big_b = (offsets.shape[0] - 1) // f
    if big_b % n:
        raise ValueError(f"batch size {big_b} is not a multiple of the {n} devices")
    b = big_b // n
    lengths = np.diff(offsets).reshape(f, n, b)  # [F, n, b]
    starts = offsets[:-1].reshape(f, n, b)[:, :, 0]  # [F, n]: where (feature, device)'s ids begin
    counts = lengths.sum(axis=2)  # [F, n]
    width = max(int(cap), -(-int(counts.sum(axis=0).max()) // 256) * 256)
    out_idx = np.zeros((n, width), np.int32)
    out_off = np.zeros((n, f * b + 1), np.int32)
    for k in range(n):
        np.cumsum(lengths[:, k, :].reshape(-1), out=out_off[k, 1:])
        pos = np.concatenate([np.arange(starts[g, k], starts[g, k] + counts[g, k]) for g in range(f)])
        out_idx[k, : pos.shape[0]] = np.asarray(indices)[pos]
    return out_idx, out_off


class DLRM:
    """The model: `init`, `logits` (from pooled embeddings), `forward` (plain lookup, evaluation),
    `loss` (from the lookups' outputs) and `train_step` (one `tbe_jax.train_step`).

    Attributes:
      emb: the `TableBatchedEmbedding` (all features, or those not in `tt_features`); with a
        `mesh`, the `ShardedTableBatchedEmbedding` over it.
      emb_unsharded: the `TableBatchedEmbedding` (`emb` itself without a mesh).
      tt: the `tt_jax.TTEmbeddingBag` of the `tt_features` (None when `config.tt_tables` is 0); with a
        `mesh`, the `tt_jax.ShardedTTEmbeddingBag` over it (cores replicated, the batch split).
      tt_unsharded: the `tt_jax.TTEmbeddingBag` (`tt` itself without a mesh; None without TT tables).
      tbe_features, tt_features: which features each holds (ascending feature ids).
      mesh, axis_name: the mesh the tables are sharded over and the batch split over (None: one device).
    """

    def __init__(self, config: DLRMConfig, *, interpret: bool = False, mesh=None, axis_name: str = "data"):
        self.config = config
        rows = config.table_rows
        k = config.tt_tables
        if not 0 <= k < len(rows):
            raise ValueError(f"tt_tables={k} must be in [0, {len(rows)}): at least one table stays in the TBE")
        # The K largest tables (ties: lower feature id first).
        largest = sorted(range(len(rows)), key=lambda f: (-rows[f], f))[:k]
        self.tt_features = tuple(sorted(largest))
        self.tbe_features = tuple(f for f in range(len(rows)) if f not in self.tt_features)
        # The K largest TBE tables in host memory behind an HBM cache (`--host-tables`): prefetched in the step.
        host = set(sorted(self.tbe_features, key=lambda f: (-rows[f], f))[:config.host_tables])
        hints = config.bag_size_hints or (None,) * len(rows)
        specs = [tbe_jax.TableSpec(rows[f], config.embedding_dim, name=f"C{f + 1}", bag_size_hint=hints[f],
                                   location="host_cached" if f in host else "device") for f in self.tbe_features]
        self.emb = tbe_jax.TableBatchedEmbedding(specs, pooling="sum", weights_dtype=config.weights_dtype,
                                                 impl=config.impl, interpret=interpret,
                                                 cache_load_factor=config.cache_load_factor)
        self.emb_unsharded = self.emb
        self.mesh, self.axis_name = mesh, axis_name
        if mesh is not None:
            self.emb = tbe_jax.shard(self.emb, mesh, axis_name)
        self.tt = None
        if k:
            tt_specs = [tt_jax.TTSpec(rows[f], config.embedding_dim, ranks=tuple(config.tt_ranks))
                        for f in self.tt_features]
            self.tt = tt_jax.TTEmbeddingBag(tt_specs, pooling="sum", impl=config.impl, interpret=interpret)
        self.tt_unsharded = self.tt
        if mesh is not None and self.tt is not None:
            self.tt = tt_jax.shard(self.tt, mesh, axis_name)
        # Columns of [TBE features..., TT features...] in feature order (a static permutation).
        self._feature_order = np.argsort(np.asarray(self.tbe_features + self.tt_features))

    # DLRM is a static argument of the jitted steps: hash and compare by configuration.
    def __hash__(self):
        return hash((self.config, self.emb, self.tt))

    def __eq__(self, other):
        return isinstance(other, DLRM) and (self.config, self.emb, self.tt) == (other.config, other.emb, other.tt)

    @property
    def num_features(self) -> int:
        return len(self.config.table_rows)

    @property
    def num_devices(self) -> int:
        """Devices the batch and the tables are split over (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.shape[self.axis_name])

    def sharding(self, spec=None):
        """A `NamedSharding` of the mesh: `spec` None is replicated (the dense parameters), `"batch"` split
        by rows over the axis (a batch's arrays). Only with a mesh."""
        return NamedSharding(self.mesh, P() if spec is None else P(self.axis_name))

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP's input: D + (F+1)F/2 (dot), (F+1)*D (dcn: x0's width)."""
        n = self.num_features + 1
        if self.config.interaction == "dcn":
            return n * self.config.embedding_dim
        return self.config.embedding_dim + n * (n - 1) // 2

    @property
    def precision(self):
        """The `precision=` of the dense matmuls (`config.matmul_precision`; None: the backend's default)."""
        return dcn.precision_of(self.config.matmul_precision)

    def init(self, key) -> tuple[dict, dict]:
        """(dense_params, emb_params); dense_params `{"bottom", "top"}` (dcn: and `"cross"`)."""
        c = self.config
        k_dense, k_emb = jax.random.split(key)
        init_mlps = dcn.init_mlps if c.interaction == "dcn" else _init_mlps  # (dcn: torch's nn.Linear init)
        bottom, top = init_mlps(k_dense, (c.num_dense, *c.bottom_mlp, c.embedding_dim),
                                (self.interaction_dim, *c.top_mlp, 1))
        dense = {"bottom": bottom, "top": top}
        if c.interaction == "dcn":
            dense["cross"] = dcn.init_cross(jax.random.fold_in(k_dense, 1), self.interaction_dim, c.dcn_rank,
                                            c.dcn_layers)
        return dense, self.init_tables(k_emb)

    def init_tables(self, key) -> dict:
        """The TBE's params, rows of table t uniform in [-1/sqrt(E_t), 1/sqrt(E_t)] (FBGEMM's default, as
        `emb.init`), drawn with one random call for all tables (quicker to compile than one per table).

        With TT tables: `{"tbe": <the TBE's params>, "tt": <the TT cores>}`; the TBE tables are the
        all-dense model's (the same draw, TT tables' rows dropped), the cores `tt.init` (entries of that
        same standard deviation) with a key folded from `key`.

        With a mesh: the sharded embedding's `init` (the same distribution, other values: each device
        draws its own shards, so no table is ever whole on one device); the TT cores as without a mesh
        (`tt.init`, the same values), replicated on it.

        With `interaction="dcn"` (or 2**31 table elements or more): `emb.init` (the same distribution,
        other values), which draws a large buffer in blocks into place: peak memory ~1x the tables."""
        c = self.config
        if self.mesh is not None or c.interaction == "dcn" or sum(c.table_rows) * c.embedding_dim >= 2**31:
            tbe = self.emb.init(key)
            return tbe if self.tt is None else {"tbe": tbe, "tt": self.tt.init(jax.random.fold_in(key, 1))}
        rows = np.asarray(self.config.table_rows)
        bound = np.repeat(1.0 / np.sqrt(rows), rows).astype(np.float32)
        u = jax.random.uniform(key, (int(rows.sum()), self.config.embedding_dim), jnp.float32, -1.0, 1.0)
        u = u * bound[:, None]
        cuts = np.cumsum(rows)[:-1]
        tables = jnp.split(u, cuts)
        tbe = self.emb.set_tables(None, [tables[f] for f in self.tbe_features])
        if self.tt is None:
            return tbe
        return {"tbe": tbe, "tt": self.tt.init(jax.random.fold_in(key, 1))}

    def table_bytes(self) -> dict:
        """Bytes of the embedding parameters: {"dense": all tables as dense rows (the all-TBE model),
        "tbe": the TBE's tables, "tt": the TT cores (float32), "total": tbe + tt}."""
        c = self.config
        item = self.emb_unsharded.weights_dtype.itemsize
        dense = sum(c.table_rows) * c.embedding_dim * item
        tbe = sum(c.table_rows[f] for f in self.tbe_features) * c.embedding_dim * item
        tt = 0 if self.tt is None else 4 * sum(s.num_parameters() for s in self.tt.specs)
        return {"dense": dense, "tbe": tbe, "tt": tt, "total": tbe + tt}

    def shard_batch(self, arrays: dict, cap) -> dict:
        """Host side: a generator batch (B examples) as the sharded model's input: "indices" `[N, cap']`
        and "offsets" `[N, F*(B/N)+1]`, device k's local batch the examples `k*B/N .. (k+1)*B/N - 1`
        (`split_local`); "dense" and "labels" as they are (`[B, ...]`, the same example order).

        With TT tables, `cap` is `(TBE cap, TT cap)`: the batch is first split by features (`split_batch`),
        then each part into local batches: "indices"/"offsets" the TBE's features, "tt_indices"/"tt_offsets"
        the TT tables' (`[N, K*(B/N)+1]` offsets)."""
        if self.tt is None:
            out = dict(arrays)
            out["indices"], out["offsets"] = split_local(arrays["indices"], arrays["offsets"], self.num_features,
                                                         self.num_devices, cap)
            return out
        out = self.split_batch(arrays, (0, 0))
        for pre, features, c in (("", self.tbe_features, cap[0]), ("tt_", self.tt_features, cap[1])):
            out[pre + "indices"], out[pre + "offsets"] = split_local(
                out[pre + "indices"], out[pre + "offsets"], len(features), self.num_devices, c)
        return out

    def split_batch(self, arrays: dict, padded_len: tuple[int, int]) -> dict:
        """Host side: a generator batch's arrays as this model's inputs. Without TT tables, unchanged;
        with them, "indices"/"offsets" hold the TBE's features and "tt_indices"/"tt_offsets" the TT
        tables' (each padded to its `padded_len` entry: (TBE, TT))."""
        if self.tt is None:
            return arrays
        b = arrays["dense"].shape[0]
        out = {k: v for k, v in arrays.items() if k not in ("indices", "offsets")}
        out["indices"], out["offsets"] = split_features(arrays["indices"], arrays["offsets"], b, self.tbe_features,
                                                        padded_len[0])
        out["tt_indices"], out["tt_offsets"] = split_features(arrays["indices"], arrays["offsets"], b,
                                                              self.tt_features, padded_len[1])
        return out

    def _merge(self, pooled_tbe, pooled_tt) -> jax.Array:
        """`[B, F*D]` in feature order from the TBE's `[B, S*D]` and the TT tables' `[B, K*D]`."""
        b, d = pooled_tbe.shape[0], self.config.embedding_dim
        z = jnp.concatenate([pooled_tbe.reshape(b, -1, d), pooled_tt.reshape(b, -1, d).astype(pooled_tbe.dtype)], 1)
        return z[:, self._feature_order].reshape(b, -1)

    def pooled(self, emb_params, batch) -> jax.Array:
        """`[B, F*D]` pooled embeddings, plain lookups."""
        if self.tt is None:
            return self.emb(emb_params, batch["indices"], batch["offsets"])
        return self._merge(self.emb(emb_params["tbe"], batch["indices"], batch["offsets"]),
                           self.tt(emb_params["tt"], batch["tt_indices"], batch["tt_offsets"]))

    def sparse_lookups(self, emb_params, emb_state, opt, batch):
        """The embedding lookups of a training step, for `tbe_jax.train_step`: one `tbe_jax.SparseLookup`
        of the TBE, or with TT tables `{"tbe": ..., "tt": ...}` (then `emb_params`, `emb_state` and `opt`
        are dicts of those two keys: a TBE optimizer and a TT one, e.g. two `tbe_jax.RowwiseAdagrad`)."""
        if self.tt is None:
            return tbe_jax.SparseLookup(self.emb, opt, emb_params, emb_state, batch["indices"], batch["offsets"])
        return {
            "tbe": tbe_jax.SparseLookup(self.emb, opt["tbe"], emb_params["tbe"], emb_state["tbe"],
                                        batch["indices"], batch["offsets"]),
            "tt": tbe_jax.SparseLookup(self.tt, opt["tt"], emb_params["tt"], emb_state["tt"],
                                       batch["tt_indices"], batch["tt_offsets"]),
        }

    def merge_outputs(self, outputs) -> jax.Array:
        """`[B, F*D]` in feature order from the lookups' outputs (`TrainStepResult.outputs`: the TBE's
        array, or `{"tbe": ..., "tt": ...}` with TT tables)."""
        if self.tt is None:
            return outputs
        return self._merge(outputs["tbe"], outputs["tt"])

    def split_output_grad(self, g) -> dict:
        """The inverse of `merge_outputs` for a gradient `[B, F*D]` (feature order): the TBE's part, or
        `{"tbe": [B, S*D], "tt": [B, K*D]}` with TT tables."""
        if self.tt is None:
            return g
        b, d = g.shape[0], self.config.embedding_dim
        z = g.reshape(b, -1, d)
        tbe = z[:, np.asarray(self.tbe_features, np.int32)].reshape(b, -1)
        tt = z[:, np.asarray(self.tt_features, np.int32)].reshape(b, -1)
        return {"tbe": tbe, "tt": tt.astype(jnp.float32)}

    def logits(self, dense_params, dense_x, pooled) -> jax.Array:
        """`[B]` logits from dense features and the pooled embeddings `[B, F*D]`."""
        p = self.precision
        h = mlp(dense_params["bottom"], dense_x, final_relu=True, precision=p)
        if self.config.interaction == "dcn":
            x = dcn.cross_net(dense_params["cross"], self.x0(h, pooled), precision=p)
        else:
            x = dot_interaction(h, pooled.astype(h.dtype), precision=p)
        return mlp(dense_params["top"], x, final_relu=False, precision=p)[:, 0]

    @staticmethod
    def x0(bottom, pooled) -> jax.Array:
        """DCN's input `[B, (F+1)*D]`: the bottom-MLP output, then the pooled embeddings (MLPerf's order)."""
        return jnp.concatenate([bottom, pooled.astype(bottom.dtype)], axis=1)

    def forward(self, dense_params, emb_params, batch) -> jax.Array:
        """Logits with a plain lookup (evaluation)."""
        return self.logits(dense_params, batch["dense"], self.pooled(emb_params, batch))

    def loss(self, dense_params, outputs, batch) -> jax.Array:
        """Mean BCE from the lookups' outputs (`merge_outputs`): `tbe_jax.train_step`'s `loss_fn`."""
        return bce(self.logits(dense_params, batch["dense"], self.merge_outputs(outputs)), batch["labels"])

    def train_step(self, dense_params, emb_params, emb_state, opt, batch) -> tbe_jax.TrainStepResult:
        """One `tbe_jax.train_step`: the loss, the dense gradient (for optax) and the embeddings' new
        params and optimizer states (`opt`: the embedding optimizer, or `{"tbe": ..., "tt": ...}`)."""
        loss_fn = functools.partial(self.loss, batch=batch)
        if self.config.host_tables and self.tt is None:  # this batch's rows into the cache (each owner's, sharded)
            emb_params, emb_state = self.emb.prefetch(emb_params, batch["indices"], batch["offsets"],
                                                      opt_state=emb_state)
        return tbe_jax.train_step(loss_fn, dense_params, self.sparse_lookups(emb_params, emb_state, opt, batch))


def bce(logits, labels) -> jax.Array:
    """Mean binary cross-entropy of `labels` in {0, 1} under `sigmoid(logits)`."""
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
