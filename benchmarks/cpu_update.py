"""The XLA path's training update on the CPU (issue 36's bar): the step time as the table grows, sparse
(`tbe_jax.sparse_update`, what `impl="xla"` runs) against the dense reference update (`reference.apply_gradients`).

  python -m benchmarks cpu_update --out benchmarks/results/cpu-update-<date>.json

One table of E rows, D=32, a batch of B=256 bags of 4 ids (1024 lookups, uniform), jitted with the tables and
state donated (as a training loop does); the median of `--iters` steps, blocked every step. `--tt`: also a
`tt_jax.TTEmbeddingBag` of the same rows (ranks 16, 16; its `apply_gradients` on the XLA path). `--train-step`:
also the whole `tbe_jax.train_step` (the lookup, a loss `sum(out * g) + 5e-4 * sum(out * out)` whose gradient
needs the lookup, and the sparse update, in one jitted step; before session 38 the loss was `sum(out * g)` alone
and XLA dropped the lookup).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from tbe_jax import reference


def _step_fn(emb, opt, dense, train=False):
    if train:
        def train_step(p, s, i, o, g):
            # out * out: the loss's gradient needs the forward (with sum(out * g) alone XLA drops the lookup)
            res = tbe_jax.train_step(lambda _, out: jnp.sum(out * g) + 5e-4 * jnp.sum(out * out), None,
                                     tbe_jax.SparseLookup(emb, opt, p, s, i, o))
            return res.params, res.opt_state
        return train_step
    if not dense:
        return lambda p, s, i, o, g: emb.apply_gradients(p, s, opt, i, o, g)

    def step(p, s, i, o, g):
        plan = emb.plan_for(o.shape[0])
        w, slots = reference.apply_gradients(p, opt.slots(s), emb.layout, plan, i, o, None, g, opt.rule(),
                                             opt.hyperparameters(s.count), pooling=emb.pooling)
        return w, opt.next_state(s, slots)
    return step


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rows", default="100000,1000000,4000000")
    ap.add_argument("--opts", default="sgd,rowwise_adagrad,adam")
    ap.add_argument("--dense-max", type=int, default=4_000_000, help="largest E also run densely")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--tt", action="store_true", help="also the TT table's step")
    ap.add_argument("--train-step", action="store_true", help="also the whole tbe_jax.train_step (lookup + update)")
    args = ap.parse_args(argv)
    opts = {"sgd": tbe_jax.SGD(0.01), "rowwise_adagrad": tbe_jax.RowwiseAdagrad(0.01), "adam": tbe_jax.Adam(0.01)}
    rng = np.random.default_rng(0)
    b, ln, d = 256, 4, 32
    rows = []
    for e in map(int, args.rows.split(",")):
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d)], impl="xla")
        for name in args.opts.split(","):
            opt = opts[name]
            for kind in ("sparse", "dense") + (("train_step",) if args.train_step else ()):
                dense = kind == "dense"
                if dense and e > args.dense_max:
                    continue
                params = emb.init(jax.random.key(0))
                state = emb.init_opt_state(params, opt)
                step = jax.jit(_step_fn(emb, opt, dense, kind == "train_step"), donate_argnums=(0, 1))
                idx = jnp.asarray(rng.integers(0, e, b * ln).astype(np.int32))
                off = jnp.arange(0, b * ln + 1, ln, dtype=jnp.int32)
                g = jnp.asarray(rng.standard_normal((b, d)).astype(np.float32))
                params, state = jax.block_until_ready(step(params, state, idx, off, g))  # compile
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    params, state = jax.block_until_ready(step(params, state, idx, off, g))
                    times.append((time.perf_counter() - t0) * 1e3)
                row = {"rows": e, "dim": d, "batch": b, "lookups": b * ln, "opt": name,
                       "update": kind, "ms": round(statistics.median(times), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.tt:
        import tt_jax

        for e in map(int, args.rows.split(",")):
            emb = tt_jax.TTEmbeddingBag([tt_jax.TTSpec(e, d, ranks=(16, 16))], impl="xla")
            for name in args.opts.split(","):
                opt = opts[name]
                params = emb.init(jax.random.key(0))
                state = emb.init_opt_state(params, opt)
                step = jax.jit(lambda p, s, i, o, g, emb=emb, opt=opt: emb.apply_gradients(p, s, opt, i, o, g),
                               donate_argnums=(0, 1))
                idx = jnp.asarray(rng.integers(0, e, b * ln).astype(np.int32))
                off = jnp.arange(0, b * ln + 1, ln, dtype=jnp.int32)
                g = jnp.asarray(rng.standard_normal((b, d)).astype(np.float32))
                params, state = jax.block_until_ready(step(params, state, idx, off, g))
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    params, state = jax.block_until_ready(step(params, state, idx, off, g))
                    times.append((time.perf_counter() - t0) * 1e3)
                row = {"rows": e, "dim": d, "batch": b, "lookups": b * ln, "opt": name, "update": "tt",
                       "core_values": sum(int(x.size) for x in jax.tree.leaves(params)),
                       "ms": round(statistics.median(times), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for name in args.opts.split(","):
        sp = {r["rows"]: r["ms"] for r in rows if r["opt"] == name and r["update"] == "sparse"}
        lo, hi = min(sp), max(sp)
        summary[name] = {"sparse_ms": sp, f"ratio_{hi}_over_{lo}": round(sp[hi] / sp[lo], 2)}
        ts = {r["rows"]: r["ms"] for r in rows if r["opt"] == name and r["update"] == "train_step"}
        if ts:
            summary[name]["train_step_ms"] = ts
            summary[name][f"train_step_ratio_{hi}_over_{lo}"] = round(ts[hi] / ts[lo], 2)
        tt = {r["rows"]: r["ms"] for r in rows if r["opt"] == name and r["update"] == "tt"}
        if tt:
            summary[name]["tt_ms"] = tt
            summary[name][f"tt_ratio_{hi}_over_{lo}"] = round(tt[hi] / tt[lo], 2)
    print(json.dumps(summary))
    if args.out:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
                   "device": jax.devices()[0].device_kind, "cpu": platform.processor() or platform.machine(),
                   "config": vars(args), "summary": summary, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
