"""What the default mode's offsets repair and id counts cost on the device (issue 36, items 2 and 3).

`bounds_check="ignore"` repairs `offsets` on the device (`tbe_jax.bounds.repair_offsets`: clamp, running maximum)
before the kernels, and the pooled kernels count the ids they skip; `"none"` does neither. This probe times a jitted
forward and a jitted `apply_gradients` of both modes, interleaved, on the named `base` and `smalltable` shards and the
first sweep shards, and the repair alone (`lax.cummax`) at several offsets lengths. (The `lax.associative_scan` form
it replaced, 2.2-6.8x slower, was measured by this probe once: `results/probe-repair-20261203-cummax-*`, NOTES.)

    python -m benchmarks probe_repair --first 24 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_repair")
    ap.add_argument("--first", type=int, default=24)
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import tbe_jax
    from benchmarks import sweep
    from benchmarks.common import device_ms

    out = {"meta": {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "iters": args.iters, "rounds": args.rounds},
           "repair": [], "shards": []}

    # The repair alone.
    for n in (513, 4097, 65537, 524289, 2097153):
        off = jnp.asarray(np.arange(n, dtype=np.int32) * 3)
        fns = {"cummax": jax.jit(lambda o: tbe_jax.bounds.repair_offsets(o, 3 * n)[0])}
        row = {"n": n}
        for name, f in fns.items():
            jax.block_until_ready(f(off))
            row[name + "_ms"] = round(min(device_ms(lambda i: f(off), args.iters)[0] for _ in range(args.rounds)), 5)
        out["repair"].append(row)
        print(row, flush=True)

    named = sweep.named_shards()
    shards = [named["base"], named["smalltable"]] + sweep.draw_shards(240, args.seed)[: args.first]
    for shard in shards:
        host = sweep.batch(shard, 0)
        i, o, w, g = (None if x is None else jax.device_put(x) for x in host)
        row = {"shard": shard.name, "T": len(shard.rows), "B": shard.B, "lookups": int(host[0].shape[0])}
        calls = {}
        for mode in ("none", "ignore"):
            emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d in zip(shard.rows, shard.dims)],
                                                weights_dtype=jnp.dtype(shard.weights_dtype),
                                                output_dtype=jnp.float32, bounds_check=mode)
            opt = tbe_jax.RowwiseAdagrad(0.01)
            params = emb.init(jax.random.key(0))
            state = emb.init_opt_state(params, opt)
            fwd = jax.jit(lambda p, i, o, w, emb=emb: emb(p, i, o, w))
            bwd = jax.jit(lambda p, s, i, o, w, g, emb=emb, opt=opt: emb.apply_gradients(p, s, opt, i, o, g, w))
            jax.block_until_ready(fwd(params, i, o, w))
            jax.block_until_ready(bwd(params, state, i, o, w, g))
            calls[mode] = (fwd, bwd, params, state)
        samples = {f"{m}_{k}": [] for m in calls for k in ("fwd", "bwd")}
        for _ in range(args.rounds):  # interleaved
            for mode, (fwd, bwd, params, state) in calls.items():
                samples[f"{mode}_fwd"].append(device_ms(lambda k: fwd(params, i, o, w), args.iters)[0])
                samples[f"{mode}_bwd"].append(device_ms(lambda k: bwd(params, state, i, o, w, g), args.iters)[0])
        for k, v in samples.items():
            row[k + "_ms"] = round(min(v), 5)
        row["fwd_cost"] = round(row["ignore_fwd_ms"] / max(row["none_fwd_ms"], 1e-9), 3)
        row["bwd_cost"] = round(row["ignore_bwd_ms"] / max(row["none_bwd_ms"], 1e-9), 3)
        out["shards"].append(row)
        print(row, flush=True)
        del calls
    for k in ("fwd_cost", "bwd_cost"):
        xs = [r[k] for r in out["shards"]]
        out[k] = {"median": statistics.median(xs), "max": max(xs)}
    print({k: out[k] for k in ("fwd_cost", "bwd_cost")})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
