"""Where the backward's time goes: preprocessing pieces and each kernel class, on one preset.

Times (enqueue-many, block once, median) the XLA pieces of `tbe_jax.runs.build_runs`
and the backward kernels one class at a time (other classes' counts zeroed).
Prints a table; with --out, saves JSON.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from tbe_jax import dispatch, preprocess, runs as runs_lib
from tbe_jax.kernels import backward as bwd
from benchmarks import common
from benchmarks.common import make_sets, time_calls


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks profile_backward", description=__doc__)
    ap.add_argument("--presets", default="base,zipf")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    allres = {}
    for name in args.presets.split(","):
        wl = common.workload(name)
        sets = make_sets(wl, 2)
        feats = wl.features()
        tables = [tbe_jax.TableSpec(e, d) for e, d, _ in feats]
        emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=wl.weights_dtype, impl="pallas")
        idx, off, psw, g = sets[0]
        plan = emb.plan_for(off.shape[0])
        n = idx.shape[0]
        res = {}
        t = lambda f, *a: time_calls(jax.jit(f), [a], args.iters, args.reps)  # noqa: E731
        res["cumsum_n"] = t(lambda x: jnp.cumsum(x), idx)
        res["searchsorted_bag"] = t(lambda o: jnp.searchsorted(o, jnp.arange(n, dtype=jnp.int32), side="right"), off)
        res["scatter_cumsum_bag"] = t(
            lambda o: jnp.cumsum(jnp.zeros(n, jnp.int32).at[o[1:-1]].add(1, mode="drop")), off)
        res["position_features"] = t(lambda o: preprocess.position_features(plan, o, n), off)
        res["lookup_coefficients"] = t(
            lambda i, o: preprocess.lookup_coefficients(plan, i, o, None, "sum"), idx, off)
        res["sort_stable"] = t(lambda k: jax.lax.sort((k, jnp.arange(n, dtype=jnp.int32)), num_keys=1,
                                                      is_stable=True), idx)
        res["sort_unstable"] = t(lambda k: jax.lax.sort((k, jnp.arange(n, dtype=jnp.int32)), num_keys=1), idx)
        res["compact_n"] = t(lambda k: runs_lib.compact_indices(k % 3 == 0, n, n), idx)
        res["build_runs"] = t(lambda i, o: dispatch.sorted_runs(emb, plan, i, o, None), idx, off)
        runs = jax.jit(lambda i, o: dispatch.sorted_runs(emb, plan, i, o, None))(idx, off)
        res["task_ranges"] = t(lambda r: bwd.task_ranges(r, emb.layout, n, emb.backward_config), runs)
        params = emb.init(jax.random.key(0))
        opt = tbe_jax.RowwiseAdagrad(0.1, 0.1)
        mom = emb.init_opt_state(params, opt).momentum
        cfg = tbe_jax.BackwardConfig()

        def upd(p, m, r, g):
            return bwd.fused_update(p, m, emb.layout, r, g, opt, config=cfg, interpret=False)

        res["kernels_all"] = t(upd, params, mom, runs, g)
        counts = np.asarray(runs.counts)
        res["counts"] = counts.tolist()
        # The small-run kernel always walks all runs; zeroing the mid/long/chunk counts leaves it alone.
        for cname, keep in (("small_only", ()), ("small_mid", (1,)), ("small_long", (2, 3))):
            c = np.zeros(4, np.int32)
            for k in keep:
                c[k] = counts[k]
            res[f"kernels_{cname}"] = t(upd, params, mom, runs._replace(counts=jnp.asarray(c)), g)
        allres[name] = res
        print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}),
              flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(allres, fh, indent=1)


if __name__ == "__main__":
    main()
