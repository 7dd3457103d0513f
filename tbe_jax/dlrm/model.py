"""A DLRM-style click model over one `TableBatchedEmbedding`.

    dense x [B, 13] --bottom MLP--> h [B, D]
    sparse bags     --TBE (sum)---> e_1..e_F [B, D] each (one lookup call for all 26 features)
    z = [h, e_1, ..., e_F]           [B, F+1, D]
    interaction: h and the dot products <z_i, z_j> for i < j   [B, D + (F+1)F/2]
    top MLP -> logit [B];  loss: binary cross-entropy with logits

The dense parameters are a plain pytree (`{"bottom": [...], "top": [...]}` of
`{"w", "b"}` layers) for optax; the tables are the TBE's params (`{"d{D}": [rows, D]}`),
trained by the fused row-wise Adagrad inside `jax.grad` (see `tbe_jax.dlrm.train`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tbe_jax


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

    @staticmethod
    def preset(size: str, table_rows, impl: str = "auto") -> "DLRMConfig":
        """Layer sizes for `tiny` / `small` (CPU) and `gpu` (DLRM's Criteo shapes, D=128)."""
        table_rows = tuple(int(e) for e in table_rows)
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


def mlp(layers, x, *, final_relu: bool):
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1 or final_relu:
            x = jax.nn.relu(x)
    return x


def pair_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The (i, j) pairs with i < j of n vectors, in row-major order (static)."""
    return np.triu_indices(n, k=1)


def dot_interaction(bottom: jax.Array, pooled: jax.Array) -> jax.Array:
    """DLRM's dot interaction.

    Args:
      bottom: `[B, D]` bottom-MLP output.
      pooled: `[B, F*D]` pooled embeddings (the TBE output: feature f in columns f*D:(f+1)*D).

    Returns:
      `[B, D + (F+1)F/2]`: `bottom`, then `<z_i, z_j>` for i < j over z = [bottom, e_1..e_F].
    """
    b, d = bottom.shape
    z = jnp.concatenate([bottom[:, None, :], pooled.reshape(b, -1, d)], axis=1)  # [B, F+1, D]
    gram = jnp.einsum("bid,bjd->bij", z, z)
    i, j = pair_indices(z.shape[1])
    return jnp.concatenate([bottom, gram[:, i, j]], axis=1)


class DLRM:
    """The model: `init`, `logits` (from pooled embeddings), `forward` (plain lookup), `loss`."""

    def __init__(self, config: DLRMConfig, *, interpret: bool = False):
        self.config = config
        specs = [tbe_jax.TableSpec(e, config.embedding_dim, name=f"C{f + 1}") for f, e in enumerate(config.table_rows)]
        self.emb = tbe_jax.TableBatchedEmbedding(specs, pooling="sum", weights_dtype=config.weights_dtype,
                                                 impl=config.impl, interpret=interpret)

    # DLRM is a static argument of the jitted steps: hash and compare by configuration.
    def __hash__(self):
        return hash((self.config, self.emb))

    def __eq__(self, other):
        return isinstance(other, DLRM) and (self.config, self.emb) == (other.config, other.emb)

    @property
    def num_features(self) -> int:
        return len(self.config.table_rows)

    @property
    def interaction_dim(self) -> int:
        n = self.num_features + 1
        return self.config.embedding_dim + n * (n - 1) // 2

    def init(self, key) -> tuple[dict, dict]:
        """(dense_params, emb_params)."""
        c = self.config
        k_dense, k_emb = jax.random.split(key)
        bottom, top = _init_mlps(k_dense, (c.num_dense, *c.bottom_mlp, c.embedding_dim),
                                 (self.interaction_dim, *c.top_mlp, 1))
        dense = {"bottom": bottom, "top": top}
        return dense, self.init_tables(k_emb)

    def init_tables(self, key) -> dict:
        """The TBE's params, rows of table t uniform in [-1/sqrt(E_t), 1/sqrt(E_t)] (FBGEMM's default, as
        `emb.init`), drawn with one random call for all tables (quicker to compile than one per table)."""
        rows = np.asarray(self.config.table_rows)
        bound = np.repeat(1.0 / np.sqrt(rows), rows).astype(np.float32)
        u = jax.random.uniform(key, (int(rows.sum()), self.config.embedding_dim), jnp.float32, -1.0, 1.0)
        u = u * bound[:, None]
        cuts = np.cumsum(rows)[:-1]
        return self.emb.set_tables(None, jnp.split(u, cuts))

    def logits(self, dense_params, dense_x, pooled) -> jax.Array:
        """`[B]` logits from dense features and the TBE's pooled output `[B, F*D]`."""
        h = mlp(dense_params["bottom"], dense_x, final_relu=True)
        x = dot_interaction(h, pooled.astype(h.dtype))
        return mlp(dense_params["top"], x, final_relu=False)[:, 0]

    def forward(self, dense_params, emb_params, batch) -> jax.Array:
        """Logits with a plain lookup (evaluation)."""
        pooled = self.emb(emb_params, batch["indices"], batch["offsets"])
        return self.logits(dense_params, batch["dense"], pooled)

    def fused_loss(self, dense_params, emb_params, emb_state, tx, batch) -> jax.Array:
        """Mean BCE with the fused lookup: under `jax.grad` w.r.t. (emb_params, emb_state)
        the "gradients" are the tables and state after `tx`'s step (see `fused_lookup`)."""
        pooled = self.emb.fused_lookup(emb_params, emb_state, tx, batch["indices"], batch["offsets"])
        return bce(self.logits(dense_params, batch["dense"], pooled), batch["labels"])


def bce(logits, labels) -> jax.Array:
    """Mean binary cross-entropy of `labels` in {0, 1} under `sigmoid(logits)`."""
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
