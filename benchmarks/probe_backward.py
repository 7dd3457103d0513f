"""Probe: backward kernel configs (`tbe_jax.BackwardConfig`) on chosen sweep shards, device time per update.

  python -m benchmarks probe_backward --seed 20261207 --shards s083,s098 --variants '{}' '{"num_warps": 2}'
Shards are the sweep's (`benchmarks.sweep`, same seed) or its named ones; each variant is a BackwardConfig override
given as JSON. The update is the sweep's: `apply_gradients` with exact row-wise Adagrad (lr 0.1, eps 0.1) of a
fixed output gradient, the tables and state donated and carried from call to call, device time of the whole
jitted update (the sort and preprocessing included) by the profiler, with its top kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

import tbe_jax
from benchmarks import sweep
from benchmarks.common import device_ms, enqueued_ms


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_backward", description=__doc__)
    ap.add_argument("--shards", default="s083,fp32")
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--shapes", type=int, default=240)
    ap.add_argument("--variants", nargs="*", default=['{}', '{"num_warps": 2}'])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--enqueued", action="store_true",
                    help="also the enqueued ms per call (--iters calls back to back, blocked once; median of 3)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    pool = {s.name: s for s in sweep.draw_shards(args.shapes, args.seed)}
    pool.update(sweep.named_shards())
    opt = jax.device_put(tbe_jax.RowwiseAdagrad(learning_rate=sweep.LR, eps=sweep.EPS))
    rows = []
    for name in args.shards.split(","):
        s = pool[name]
        i, o, w, g = (None if x is None else jnp.asarray(x) for x in sweep.batch(s, 0))
        row = {"shard": name, **s.params(), "kernels": {}}
        for v in args.variants:
            emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d in zip(s.rows, s.dims)],
                                                weights_dtype=jnp.dtype(s.weights_dtype), output_dtype=jnp.float32,
                                                backward_config=tbe_jax.BackwardConfig(**json.loads(v)))
            params = emb.init(jax.random.key(s.seed))
            carry = [(params, emb.init_opt_state(params, opt))]
            step = jax.jit(lambda c, i, o, w, g, emb=emb: emb.apply_gradients(c[0], c[1], opt, i, o, g, w),
                           donate_argnums=(0,))

            def run(k):
                carry[0] = step(carry[0], i, o, w, g)
                return carry[0]

            for k in range(3):
                run(k)
            jax.block_until_ready(carry[0])
            ms, top = device_ms(run, args.iters, top=6)
            row[v] = round(ms, 4)
            row["kernels"][v] = {k: round(t, 4) for k, t in top.items()}
            if args.enqueued:  # wall ms per call of calls enqueued back to back: host-bound where above `ms`
                row.setdefault("enqueued", {})[v] = round(enqueued_ms(run, args.iters, 3), 4)
            del carry, params
        rows.append(row)
        keys = ["shard", "T", "B", "lookups"] + args.variants + (["enqueued"] if args.enqueued else [])
        print(json.dumps({k: row[k] for k in keys}), flush=True)
        if args.out:  # after every row: a run cut short keeps what it measured
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
                       "device": jax.devices()[0].device_kind, "seed": args.seed, "rows": rows},
                      open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
