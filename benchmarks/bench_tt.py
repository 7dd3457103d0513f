"""TT embedding-bag baselines (XLA) on the anchors' single-table workload.

Variants, all plain XLA (the fused FlowTT kernel does not exist yet):
- per_index:    contract the core chain for every lookup (TT-Rec style; tt_jax's reference path)
- unique_only:  contract once per distinct row, gather back (EcoRec-style dedup)
- prefix_reuse: contract each distinct prefix once, then each distinct row's last core (unfused FlowTT idea)
- dense:        a dense [N, D] fp32 table of the same shape through tbe_jax, for scale
Forward, and forward+backward (gradient of the cores through jax.grad), timed like bench_forward.py
(enqueued calls over rotating input sets, one block, median). Workload (a) of the TT issue:
N = 10M as 200x200x250, D = 32 as 2x4x4, ranks (32, 32), L = 20, Zipf(1.1) ids.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import tbe_jax  # noqa: E402
import tt_jax  # noqa: E402
from tbe_jax import testing  # noqa: E402
from tt_jax import prefix, reference  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_forward import time_calls  # noqa: E402


def variants(spec, batch):
    def pool(rows_fn):
        def f(cores, idx, off):
            n = idx.shape[0]
            bag = jnp.cumsum(jnp.zeros(n, jnp.int32).at[off[1:-1]].add(1, mode="drop"))
            return jax.ops.segment_sum(rows_fn(cores, idx), bag, num_segments=batch, indices_are_sorted=True)
        return f

    def per_index(cores, idx):
        return reference.rows(cores, spec.p_shapes, idx)

    def unique_only(cores, idx):
        uniq, inv = jnp.unique(idx, size=idx.shape[0], fill_value=0, return_inverse=True)
        return reference.rows(cores, spec.p_shapes, uniq)[inv.reshape(-1)]

    def prefix_reuse(cores, idx):
        plan = prefix.build(idx, jnp.ones(idx.shape, bool), spec)
        return prefix.rows_by_prefix(cores, spec, plan)[plan.inverse]

    return {"per_index": pool(per_index), "unique_only": pool(unique_only), "prefix_reuse": pool(prefix_reuse)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4096,32768")
    ap.add_argument("--p", default="200,200,250")
    ap.add_argument("--q", default="2,4,4")
    ap.add_argument("--ranks", default="32,32")
    ap.add_argument("-L", type=int, default=20)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    p = tuple(int(x) for x in args.p.split(","))
    q = tuple(int(x) for x in args.q.split(","))
    spec = tt_jax.TTSpec(int(np.prod(p)), int(np.prod(q)), p_shapes=p, q_shapes=q,
                         ranks=tuple(int(r) for r in args.ranks.split(",")))
    emb = tt_jax.TTEmbeddingBag(spec)
    cores = emb.get_cores(emb.init(jax.random.key(0)))[0]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rng = np.random.default_rng(batch)
        perm = np.random.default_rng(1).permutation(spec.num_embeddings)
        sets = [testing.make_batch(rng, [spec.num_embeddings], [batch], args.L, alpha=args.alpha, perms=[perm])
                for _ in range(args.sets)]
        dev = [(jnp.asarray(i), jnp.asarray(o)) for i, o, _ in sets]
        ids0 = sets[0][0]
        row = {"B": batch, "distinct_rows": int(len(np.unique(ids0))),
               "distinct_prefixes": int(len(np.unique(ids0 // p[-1]))), "variants": {}}
        ref = None
        for name, fn in variants(spec, batch).items():
            fwd = jax.jit(fn)
            out = np.asarray(fwd(cores, *dev[0]), np.float64)
            ref = out if ref is None else ref
            g = jax.jit(jax.grad(lambda c, i, o, fn=fn: jnp.sum(fn(c, i, o) ** 2)))
            row["variants"][name] = {
                "fwd_ms": time_calls(fwd, [(cores,) + d for d in dev], args.iters, args.reps),
                "fwd_bwd_ms": time_calls(g, [(cores,) + d for d in dev], args.iters, args.reps),
                "max_rel_err_vs_per_index": float(np.abs(out - ref).max() / np.abs(ref).max()),
            }
        dense = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(spec.num_embeddings, spec.embedding_dim)])
        dparams = dense.init(jax.random.key(1))
        dfwd = jax.jit(lambda pr, i, o: dense(pr, i, o))
        row["dense_tbe_fwd_ms"] = time_calls(dfwd, [(dparams,) + d for d in dev], args.iters, args.reps)
        del dparams
        rows.append(row)
        print(f"B={batch}: " + ", ".join(f"{k} fwd {v['fwd_ms']:.3f} / fwd+bwd {v['fwd_bwd_ms']:.3f} ms"
                                         for k, v in row["variants"].items())
              + f", dense fwd {row['dense_tbe_fwd_ms']:.3f} ms; distinct rows {row['distinct_rows']}, "
              f"prefixes {row['distinct_prefixes']}", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "spec": repr(spec),
            "L": args.L, "alpha": args.alpha}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tt-baselines-{datetime.datetime.now():%Y%m%d-%H%M%S}-"
                                  f"{meta['device'].replace(' ', '_')}.json")
    with open(path, "w") as fh:
        json.dump({"meta": meta, "results": rows}, fh, indent=1)
    print("saved", path)


if __name__ == "__main__":
    main()
