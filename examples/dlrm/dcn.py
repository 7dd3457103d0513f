"""DCN v2's low-rank cross network, the interaction of MLPerf's DLRMv2 (`DLRMConfig(interaction="dcn")`).

    x0 = [h, e_1, ..., e_F]            [B, W], W = (F+1)*D (the bottom-MLP output, then the pooled embeddings)
    x_{l+1} = x0 * (U_l (V_l^T x_l) + b_l) + x_l      l = 0 .. L-1
      V_l: [W, r], U_l: [r, W], b_l: [W]   (row vectors: x_l @ V_l @ U_l + b_l)

then the top MLP on x_L. MLPerf's reference (torchrec's `LowRankCrossNet`, 3 layers of rank 512 over
W = 27 * 128 = 3456) calls U_l "W_l"; the parameters here are `{"v": [W, r], "u": [r, W], "b": [W]}` per
layer. Init as torchrec's: V and U Xavier normal (std sqrt(2 / (fan_in + fan_out))), b zero; the MLPs
of the dcnv2 model as torch's `nn.Linear` (which MLPerf's reference uses): W and b uniform in
+-1/sqrt(fan_in) (`init_mlps`; the final logit's bias then starts near 0, not ~N(0, 1) as DLRM's init).

Every matmul takes an explicit `precision` (`jax.lax.Precision` or its name: "tensorfloat32", "float32",
"highest", ...; a `jax.lax.DotAlgorithmPreset` for "bfloat16"; None: XLA's default for the backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def precision_of(name: str):
    """`DLRMConfig.matmul_precision` as the `precision=` argument: "default" is None (the backend's default);
    "bfloat16" (or "bf16") is `DotAlgorithmPreset.BF16_BF16_F32`: operands rounded to bf16, products summed and
    returned in fp32 (jax's own name "bfloat16" is an alias of `Precision.DEFAULT`, which an fp32 matmul on a GPU
    runs as TF32, not bf16); anything else is passed by name ("tensorfloat32", "float32", "highest", ...)."""
    if name == "default":
        return None
    if name in ("bfloat16", "bf16"):
        return jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    return name


def init_mlps(key, *all_widths) -> list[list[dict]]:
    """Dense layers `widths[0] -> widths[1] -> ...` for each `widths`, `{"w": [in, out], "b": [out]}` each,
    torch's `nn.Linear` init (W, b uniform in +-1/sqrt(in)), one random draw for everything."""
    shapes = [(n_in, n_out) for widths in all_widths for n_in, n_out in zip(widths[:-1], widths[1:])]
    total = sum(n_in * n_out + n_out for n_in, n_out in shapes)
    flat = jax.random.uniform(key, (total,), jnp.float32, -1.0, 1.0)
    layers, start = [], 0
    for n_in, n_out in shapes:
        bound = 1.0 / np.sqrt(n_in)
        w = flat[start : start + n_in * n_out].reshape(n_in, n_out) * bound
        b = flat[start + n_in * n_out : start + n_in * n_out + n_out] * bound
        layers.append({"w": w, "b": b})
        start += n_in * n_out + n_out
    out, i = [], 0
    for widths in all_widths:
        out.append(layers[i : i + len(widths) - 1])
        i += len(widths) - 1
    return out


def init_cross(key, width: int, rank: int, num_layers: int) -> list[dict]:
    """`num_layers` cross layers over `width` features of rank `rank`: V, U Xavier normal, b zero (one draw)."""
    std = np.sqrt(2.0 / (width + rank))
    n = width * rank
    flat = jax.random.normal(key, (num_layers * 2 * n,), jnp.float32) * std
    out = []
    for layer in range(num_layers):
        base = 2 * n * layer
        out.append({"v": flat[base : base + n].reshape(width, rank),
                    "u": flat[base + n : base + 2 * n].reshape(rank, width),
                    "b": jnp.zeros((width,), jnp.float32)})
    return out


def cross_layer(x0, x, layer: dict, *, precision=None):
    """One low-rank cross layer: `x0 * ((x @ V) @ U + b) + x` (`[B, W]`)."""
    h = jnp.dot(x, layer["v"], precision=precision)
    return x0 * (jnp.dot(h, layer["u"], precision=precision) + layer["b"]) + x


def cross_net(layers, x0, *, precision=None):
    """The cross network: `x_L` from `x_0 = x0` (`[B, W]`)."""
    x = x0
    for layer in layers:
        x = cross_layer(x0, x, layer, precision=precision)
    return x
