"""The fused optimizers' backward step against FBGEMM's kernels, per optimizer, on the base and zipf presets.

For each preset and optimizer: `emb.apply_gradients` alone (sort, run-length encoding, the gradient
kernels and the fused update, on donated tables and state), timed as `bench_backward.py` times its
"bwd" (`--iters` steps enqueued back to back, block once, median of `--reps`; launch overhead excluded,
as FBGEMM's "kernels" column), plus a check of the kernels against the XLA reference on one batch.
FBGEMM's times are the anchors' profiler kernel times for the same optimizer on the same GPU kind
(`FBGEMM_BWD_MS`). Row-wise Adagrad runs in the same process as the reference point; Adam has no
FBGEMM number on fp16 tables (its 1.6 release fails there), its bar is 2x our row-wise Adagrad step.

Results go to benchmarks/results/optimizers-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

import tbe_jax
from benchmarks import common
from benchmarks.common import EPS, LR, make_sets, time_chain, with_opt


# FBGEMM 1.6 backward kernel time per fused optimizer (profiler; fwd+bwd minus fwd), H200, 2026-11-30.
FBGEMM_BWD_MS = {
    "base": {"sgd": 1.320, "rowwise_adagrad": 1.539, "adagrad": 1.738, "partial_rowwise_adam": 2.182, "lamb": 3.149},
    "zipf": {"sgd": 0.849, "rowwise_adagrad": 0.986, "adagrad": 1.019, "partial_rowwise_adam": 1.269, "lamb": 1.815},
}

OPTIMIZERS = {
    "sgd": lambda: tbe_jax.SGD(LR),
    "rowwise_adagrad": lambda: tbe_jax.RowwiseAdagrad(LR, EPS),
    "rowwise_adagrad_decoupled": lambda: tbe_jax.RowwiseAdagrad(LR, EPS, weight_decay=1e-4,
                                                                weight_decay_mode="decoupled"),
    "adagrad": lambda: tbe_jax.Adagrad(LR, EPS),
    "adam": lambda: tbe_jax.Adam(0.01, weight_decay=1e-4),
    "partial_rowwise_adam": lambda: tbe_jax.PartialRowwiseAdam(0.01),
    "lamb": lambda: tbe_jax.Lamb(0.01),
    "partial_rowwise_lamb": lambda: tbe_jax.PartialRowwiseLamb(0.01),
    "adam_bf16_state": lambda: tbe_jax.Adam(0.01, state_dtype="bfloat16"),
}


def run(wl, names, args):
    sets = make_sets(wl, args.sets)
    tables = common.tables(wl)
    kw = dict(weights_dtype=wl.weights_dtype, output_dtype=wl.output_dtype)
    cfg = common.config(args.config, tbe_jax.BackwardConfig)
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", backward_config=cfg, interpret=common.interpret(), **kw)
    ref = tbe_jax.TableBatchedEmbedding(tables, impl="xla", **kw)
    params0 = emb.init(jax.random.key(0))
    out = {}
    rel = common.rel_err
    for name in names:
        opt = OPTIMIZERS[name]()
        state0 = emb.init_opt_state(params0, opt)
        idx, off, psw, g = sets[0]
        # The check runs the Adam family at eps 1e-3: at eps 1e-8 the first step's update is about
        # lr * sign(g), so an element whose summed gradient is ~0 flips with the summation order.
        check = dataclasses.replace(opt, eps=1e-3) if hasattr(opt, "b1") else opt
        got = jax.jit(lambda p, s: emb.apply_gradients(p, s, check, idx, off, g, psw))(params0, state0)
        want = jax.jit(lambda p, s: ref.apply_gradients(p, s, check, idx, off, g, psw))(params0, state0)
        err = max(float(rel(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        del got, want

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(carry, opt, i, o, s, g):
            p, st = carry
            return emb.apply_gradients(p, st, opt, i, o, g, s)

        carry = jax.tree_util.tree_map(jnp.copy, (params0, state0))
        ms, carry = time_chain(step, carry, with_opt(opt, sets), args.iters, args.reps)
        del carry, state0
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt.init(params0)))
        row = {"bwd_ms": ms, "max_rel_err_vs_xla": err, "state_bytes": state_bytes}
        fb = FBGEMM_BWD_MS.get(wl.name, {}).get(name)
        if fb:
            row["fbgemm_bwd_ms"], row["vs_fbgemm"] = fb, fb / ms
        out[name] = row
        print(f"  {wl.name:6s} {name:28s} {ms:7.3f} ms  err {err:.1e}"
              + (f"  FBGEMM {fb:.3f} -> {fb / ms:.2f}x" if fb else ""), flush=True)
    if "rowwise_adagrad" in out:
        ref_ms = out["rowwise_adagrad"]["bwd_ms"]
        for row in out.values():
            row["vs_our_rowwise_adagrad"] = row["bwd_ms"] / ref_ms
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks optimizers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="base,zipf")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--config", default="", help='BackwardConfig fields as JSON, e.g. \'{"small_block": 16}\'')
    ap.add_argument("--tag", default="", help="appended to the result's file name")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)
    res = {
        "meta": common.meta(),
        "timing": "apply_gradients, iters donated steps enqueued back to back over --sets input sets, block once, "
                  "median of reps",
        "iters": args.iters, "reps": args.reps, "sets": args.sets, "config": args.config, "presets": {},
    }
    names = args.optimizers.split(",")
    for p in args.presets.split(","):
        res["presets"][p] = run(common.workload(p), names, args)
    print("saved", common.save("optimizers", res, args.out, args.tag))


if __name__ == "__main__":
    main()
