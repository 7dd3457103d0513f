"""The backward (and forward) against the embedding dim: is a non-power-of-two D paid for in padded lanes?

`base`-like workload (32 tables of 100k rows, B 4096, 20 uniform ids per bag, fp16
tables, row-wise Adagrad) with every table at one D, then mixed models (32 tables
cycling through tens of distinct D). Reported per run: forward and `apply_gradients`
ms (enqueued back to back, blocked once, median of reps), and the step's cost per
lookup per 128 columns, so a D=136 run can be set against D=128.

FBGEMM cannot run here; `fbgemm_est_ms` scales its measured `base` backward kernel
time (1.538 ms at D=128) by sum(D)/(32*128) (its backward is bandwidth-bound on
this workload) and is only a rough reference.

Results go to benchmarks/results/dims-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from benchmarks import common
from benchmarks.common import time_calls

FBGEMM_BASE_BWD_MS = common.FBGEMM_BWD_KERNEL_MS["base"]


def run(dims, args, seed=0):
    t, e, b, l = args.tables, args.rows, args.batch, 20
    tables = [tbe_jax.TableSpec(e, int(dims[i % len(dims)])) for i in range(t)]
    cfg = common.config(args.config, tbe_jax.BackwardConfig)
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, backward_config=cfg,
                                        pad_rows=not args.no_pad, interpret=common.interpret())
    params = emb.init(jax.random.key(seed))
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=0.1)
    if args.device_opt:  # its hyperparameters on the device once, not three host-to-device copies per step
        opt = jax.device_put(opt)
    state = emb.init_opt_state(params, opt)
    rng = np.random.default_rng(seed)
    offsets = jnp.asarray(np.arange(0, t * b * l + 1, l, dtype=np.int32))
    indices = jnp.asarray(rng.integers(0, e, t * b * l).astype(np.int32))
    sum_d = sum(emb.feature_dims)
    grad = jax.random.normal(jax.random.key(1), (b, sum_d), jnp.float32)
    fwd = jax.jit(lambda p, i, o: emb(p, i, o))
    step = jax.jit(lambda p, s, o, i, off, g: emb.apply_gradients(p, s, o, i, off, g), donate_argnums=(0, 1))
    carry = [params, state]

    def one_step():
        carry[0], carry[1] = step(carry[0], carry[1], opt, indices, offsets, grad)
        return carry[0]

    fwd_ms = time_calls(lambda: fwd(carry[0], indices, offsets), [()], args.iters, args.reps)
    step_ms = time_calls(one_step, [()], args.iters, args.reps)
    n = t * b * l
    est = FBGEMM_BASE_BWD_MS * sum_d / (32 * 128)
    return {"dims": sorted(set(int(d) for d in dims)), "sum_d": sum_d, "forward_ms": fwd_ms, "step_ms": step_ms,
            "step_ns_per_lookup_per_128": step_ms * 1e6 / n * 128 * t / sum_d,
            "fbgemm_est_ms": est, "ratio_vs_fbgemm_est": est / step_ms}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks dims", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--single", default="64,72,96,128,136,192,256")
    ap.add_argument("--mixed", default="8-192/8;4-128/4;16-256/16",
                    help="';'-separated lo-hi/step ranges of D, cycled over the 32 tables")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--tables", type=int, default=32, help="(a CPU smoke run: few tables, rows, a small batch)")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--config", default="", help='BackwardConfig fields as JSON, e.g. \'{"small_block": 4}\'')
    ap.add_argument("--tag", default="", help="appended to the result's file name")
    ap.add_argument("--device-opt", action="store_true",
                    help="pass the optimizer with its hyperparameters as device arrays (jax.device_put) instead of "
                         "Python floats, which each step copies to the device")
    ap.add_argument("--no-pad", action="store_true",
                    help="store the tables unpadded (TableBatchedEmbedding(pad_rows=False)): fp16 rows of dims 4 mod 8 "
                         "then move in 8-byte vectors")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)
    res = []
    configs = [[int(d)] for d in args.single.split(",") if d]
    for spec in filter(None, args.mixed.split(";")):
        rng, step = spec.split("/")
        lo, hi = map(int, rng.split("-"))
        configs.append(list(range(lo, hi + 1, int(step))))
    for dims in configs:
        r = run(dims, args)
        res.append(r)
        print(f"dims {r['dims'][0]}..{r['dims'][-1]} ({len(r['dims'])}) fwd {r['forward_ms']:.3f} ms "
              f"step {r['step_ms']:.3f} ms  per-lookup-per-128 {r['step_ns_per_lookup_per_128']:.3f} ns  "
              f"vs FBGEMM est {r['ratio_vs_fbgemm_est']:.2f}x", flush=True)
    meta = common.meta(timing="enqueue --iters calls, block once, median of --reps", config=args.config,
                       device_opt=args.device_opt, pad_rows=not args.no_pad, tables=args.tables, rows=args.rows)
    tag = "-".join(filter(None, [args.tag, "nopad" if args.no_pad else ""]))
    print("saved", common.save("dims", {"meta": meta, "results": res}, args.out, tag))


if __name__ == "__main__":
    main()
