"""A forward check (`make check-demo`; `make demo` trains the DLRM of `examples/dlrm`): a multi-table TBE on a
synthetic batch.

Builds tables of very different sizes and dims, looks up and pools a synthetic
FBGEMM-format batch, checks the result against the float64 NumPy model and the
pure-jnp reference, and prints timings. On a GPU it runs the Pallas kernel; on
a CPU the XLA path (what `impl="auto"` picks there), plus the same Pallas kernel
in interpret mode on a slice of the batch to show it agrees.

    python -m tbe_jax.demo [--batch 512] [--bag 20] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from tbe_jax import testing

TABLES = [  # (rows, dim): a small recommender's sparse features
    (1_000_000, 64), (200_000, 128), (50_000, 32), (10_000, 100), (1_000, 16), (64, 128), (5, 8),
    (300_000, 64),
]


def _time(fn, args, iters):
    jax.block_until_ready(fn(*args))  # compile
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3 / iters


def _rel_err(out, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--bag", type=int, default=20, help="mean bag length (lengths vary 0..2x)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--weights-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    print(f"tbe_jax {tbe_jax.__version__} | jax {jax.__version__} | backend {backend} ({jax.devices()[0].device_kind})")
    specs = [tbe_jax.TableSpec(e, d, name=f"sparse_{i}") for i, (e, d) in enumerate(TABLES)]
    fmap = list(range(len(specs))) + [0, 1]  # two extra features share the two largest tables
    emb = tbe_jax.TableBatchedEmbedding(specs, feature_table_map=fmap, pooling="sum",
                                        weights_dtype=args.weights_dtype)
    ref_emb = tbe_jax.TableBatchedEmbedding(specs, feature_table_map=fmap, weights_dtype=args.weights_dtype,
                                            impl="xla")
    params = emb.init(jax.random.key(0))
    nbytes = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in params.values())
    print(f"{len(specs)} tables, {len(fmap)} features, dims {sorted(set(emb.feature_dims))}, "
          f"{nbytes / 2**20:.1f} MiB of {args.weights_dtype} weights in {len(params)} buffers")

    rng = np.random.default_rng(0)
    batch = [args.batch] * len(fmap)
    rows = [specs[t].num_embeddings for t in fmap]
    idx, off, psw = testing.make_batch(rng, rows, batch, (0, 2 * args.bag), alpha=1.1, weighted=True)
    print(f"batch: B={args.batch}, {len(idx)} ids, bag lengths 0..{2 * args.bag}, Zipf(1.1) ids, weighted")

    fwd = jax.jit(lambda p, i, o, w: emb(p, i, o, w))
    ref_fwd = jax.jit(lambda p, i, o, w: ref_emb(p, i, o, w))
    dev = [jnp.asarray(x) for x in (idx, off, psw)]
    out = fwd(params, *dev)
    tables64 = [np.asarray(t, np.float64) for t in emb.get_tables(params)]
    model = testing.numpy_pooled(tables64, fmap, batch, idx, off, psw, "sum", False)
    print(f"output {tuple(out.shape)} {out.dtype}; max error vs float64 model {_rel_err(out, model):.2e}, "
          f"vs jnp reference {_rel_err(out, ref_fwd(params, *dev)):.2e}")

    path = "Pallas kernel" if emb.uses_kernel() else "XLA path (impl='auto' on CPU)"
    ms = _time(fwd, (params, *dev), args.iters)
    ref_ms = _time(ref_fwd, (params, *dev), args.iters)
    ids_per_feature = np.diff(off[:: args.batch])
    wbytes = 4 if args.weights_dtype == "float32" else 2
    gb = 4 * args.batch * sum(emb.feature_dims) + wbytes * float(ids_per_feature @ np.asarray(emb.feature_dims))
    print(f"{path}: {ms:.3f} ms/call ({gb / ms / 1e6:.1f} GB/s) | jnp reference: {ref_ms:.3f} ms/call")

    if not emb.uses_kernel():
        # Show the kernel itself on this machine: interpret mode, first 8 bags of each feature.
        small = [8] * len(fmap)
        sidx, soff, spsw = testing.make_batch(rng, rows, small, (0, 2 * args.bag), alpha=1.1, weighted=True)
        kern = tbe_jax.TableBatchedEmbedding(specs, feature_table_map=fmap, weights_dtype=args.weights_dtype,
                                             impl="pallas", interpret=True)
        t0 = time.perf_counter()
        kout = kern(params, sidx, soff, spsw)
        jax.block_until_ready(kout)
        kmodel = testing.numpy_pooled(tables64, fmap, small, sidx, soff, spsw, "sum", False)
        print(f"Pallas kernel in interpret mode (B=8): max error vs float64 model {_rel_err(kout, kmodel):.2e} "
              f"({time.perf_counter() - t0:.1f} s, interpret mode is for checking, not speed)")


if __name__ == "__main__":
    main()
