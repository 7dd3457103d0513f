"""Sharded training steps over the GPUs of one host (`tbe_jax.shard`), against one GPU.

Weak scaling (`--weak`): each GPU holds the `base` preset's tables (32 tables x 100k rows x 128, fp16)
and a local batch of `--local-batch` samples (20 ids per bag, one feature per table). The sharded
step is `tbe_jax.train_step` (lookup, a loss, the fused row-wise Adagrad update) under `jit` with the
tables and state donated, per plan (`--plans`: "table", "row"). The 1-GPU references run in the same
process on device 0:
  - "share": one GPU's share of the sharded step: 32 tables and the lookups they serve (the global
    batch, n x local batch);
  - "base": the base preset as is (32 tables, batch = local batch).
The collectives alone (the same all_to_all shapes: ids out, pooled rows back, gradients out) are
timed apart as "comm". `--locations device,host_cached` also times the tables in host memory behind each
device's HBM cache (`--cache-load-factor`; the step prefetches its own batch on the owners first, as the
one-GPU `host_cache` benchmark does) or read over the bus ("host"); `--alpha` > 1 draws Zipf ids (a cache
needs skew to hit).

Big model (`--big`): `--big-tables` tables of `--big-rows` rows x 128 fp16 (default 16 x 50M: 205 GB)
plus row-wise Adagrad state, which no single H200 holds, trained across the GPUs; tables start at zero
(drawn values would need a host copy of the tables). Reports step time, memory per GPU and lookups/s.

Timing: `--iters` steps enqueued back to back, block once, median of `--reps`.
Results: benchmarks/results/sharding-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import tbe_jax
from benchmarks import common
from benchmarks.common import profile, time_chain
from tbe_jax import testing
from tbe_jax.shard_route import all_to_all as _a2a

LR, EPS = 0.01, 1e-8


def timed(fn, carry, args, iters, reps):
    # twice over the sets: the carry comes back with the step's own shardings after the first call
    return time_chain(fn, carry, args, iters, reps, warmups=2)


def local_inputs(rng, num_tables, rows, b, bag, alpha, n):
    """Per device: FBGEMM-format ids and offsets for `num_tables` features of batch b, stacked [n, ...]."""
    idx, off = [], []
    for _ in range(n):
        i, o, _ = testing.make_batch(rng, [rows] * num_tables, [b] * num_tables, bag, alpha=alpha)
        idx.append(i)
        off.append(o)
    return np.stack(idx), np.stack(off)


def global_inputs(idx, off, num_tables, b):
    """The stacked local batches as one batch (device 0's samples first), for the 1-GPU share."""
    n = idx.shape[0]
    gi, go = [], [0]
    for f in range(num_tables):
        for k in range(n):
            a, z = off[k, f * b], off[k, (f + 1) * b]
            gi.append(idx[k, a:z])
            go.extend((off[k, f * b + 1 : (f + 1) * b + 1] - a + go[-1]).tolist())
    return np.concatenate(gi).astype(np.int32), np.asarray(go, np.int32)


def train_fn(emb, opt, prefetch: bool = False):
    """`carry=(params, state) -> carry`: one train_step with a fixed output gradient (loss = <out, g>); with
    `prefetch` (tables behind a cache), the batch's rows prefetched first."""

    def step(carry, idx, off, g):
        params, state, acc = carry  # the loss is accumulated: the forward must run
        if prefetch:
            params, state = emb.prefetch(params, idx, off, opt_state=state)
        res = tbe_jax.train_step(lambda _, out: jnp.vdot(out, g), None,
                                 tbe_jax.SparseLookup(emb, opt, params, state, idx, off))
        return res.params, res.opt_state, acc + res.loss + res.report.invalid_indices

    return jax.jit(step, donate_argnums=(0,))


def weak(args, n, rng, results):
    wl = testing.PRESETS["base"]
    t_per, rows, dim, bag, b = args.tables_per_gpu or wl.T, args.rows or wl.E, wl.D, wl.L, args.local_batch
    alpha = wl.alpha if args.alpha is None else args.alpha
    opt = tbe_jax.RowwiseAdagrad(LR, EPS)
    kw = dict(weights_dtype=jnp.float16, output_dtype=jnp.float32, impl=args.impl)
    tables = [tbe_jax.TableSpec(rows, dim) for _ in range(t_per * n)]
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sets = [local_inputs(rng, t_per * n, rows, b, bag, alpha, n) for _ in range(args.sets)]
    out = {"tables_per_gpu": t_per, "rows": rows, "dim": dim, "bag": bag, "local_batch": b, "n": n, "alpha": alpha,
           "cache_load_factor": args.cache_load_factor}
    lookups = t_per * n * b * bag * n
    cases = [(p, c, cd, loc) for loc in args.locations.split(",") for p in args.plans.split(",")
             for c in args.capacity_fracs.split(",") for cd in args.comm_dtypes.split(",")]
    # "feature": per-feature counts (the most ids any device has for each feature, over the sets), from which
    # tbe_jax.shard sizes each destination exactly for the plan (see its `capacity`)
    counts = [int(max(o[k, (f + 1) * b] - o[k, f * b] for _, o in sets for k in range(n)))
              for f in range(len(tables))]
    for plan_name, frac, comm, loc in cases:
        emb = tbe_jax.TableBatchedEmbedding([dataclasses.replace(t, location=loc) for t in tables],
                                            cache_load_factor=args.cache_load_factor, **kw)
        per_feature = frac == "feature"
        frac = 0.0 if per_feature else float(frac)
        plan = {t: plan_name for t in range(len(tables))} if plan_name in ("row", "column", "data") else None
        if plan_name == "table":
            plan = {t: ("table", t % n) for t in range(len(tables))}
        capacity = counts if per_feature else None if frac >= 1 else int(frac * sets[0][0].shape[1])
        sharded = tbe_jax.shard(emb, mesh, "data", plan, capacity=capacity, warn_overflow=False,
                                comm_dtype=None if comm == "none" else comm)
        case = (f"{plan_name}@feature_capacity" if per_feature else plan_name if frac >= 1
                else f"{plan_name}@capacity{frac}")
        if comm != "none":
            case += f"@comm_{comm}"
        if loc != "device":
            case += f"@{loc}"
        params = sharded.init(jax.random.key(0))
        state = sharded.init_opt_state(params, opt)
        spec = NamedSharding(mesh, P("data"))
        g = jax.device_put(jnp.full((n * b, sum(emb.feature_dims)), 1e-3, jnp.float32), spec)
        dev_sets = [(jax.device_put(i, spec), jax.device_put(o, spec), g) for i, o in sets]
        fwd = jax.jit(lambda p, i, o: sharded.forward_with_report(p, i, o)[1].invalid_indices)
        dropped = int(fwd(params, *dev_sets[0][:2]))
        step = train_fn(sharded, opt, prefetch=sharded.cached)
        ms, carry = timed(step, (params, state, jnp.float32(0)), dev_sets, args.iters, args.reps)
        stats = ({k: float(v) for k, v in sharded.cache_stats(carry[0]).items()} if sharded.cached else None)
        if args.profile:  # GPU time per kernel name, summed over the devices, per step
            prof = profile(step, carry, dev_sets, args.iters)
            out[case + "_profile_top"] = dict(list(prof.items())[:25])
            print(case, "profile", json.dumps(out[case + "_profile_top"])[:3000], flush=True)
        params, state, _ = carry
        # the collectives alone, same shapes
        lay = sharded.layout
        cap = sharded.capacity or sets[0][0].shape[1]
        width_ids = cap + lay.num_slots * b + lay.num_slots

        def comm(x, y):
            def body(x, y):
                x = _a2a(x[0], "data")[None]
                y1 = _a2a(y, "data")
                y2 = _a2a(y1 * 0.5, "data")
                return x, y2
            return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data")))(x, y)

        xs = jax.device_put(jnp.zeros((n, n, width_ids), jnp.int32), spec)
        ys = jax.device_put(jnp.zeros((n * n, b, lay.width), jnp.float32), spec)
        comm_j = jax.jit(lambda c: comm(*c))
        comm_ms, _ = timed(lambda c: comm_j(c), (xs, ys), [()], args.iters, args.reps)
        del params, state
        out[case] = {"step_ms": ms, "comm_ms": comm_ms, "lookups_per_s": lookups / ms * 1e3,
                     "capacity": sharded.capacity if per_feature else capacity,
                     "dropped_ids_first_batch": dropped,
                          "plan": {s: sharded.plan.strategies.count(s) for s in set(sharded.plan.strategies)}}
        if stats is not None:
            out[case]["cache_stats"] = stats
        print(case, out[case], flush=True)
    # 1-GPU references on device 0
    dev0 = jax.devices()[0]
    share = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(rows, dim) for _ in range(t_per)], **kw)
    for name, batch, inputs in (
        ("share", n * b, [global_inputs(*local_inputs(rng, t_per, rows, b, bag, alpha, n), t_per, b)
                          for _ in range(args.sets)]),
        ("base", b, [local_inputs(rng, t_per, rows, b, bag, alpha, 1) for _ in range(args.sets)]),
    ):
        if name == "base":
            inputs = [(i[0], o[0]) for i, o in inputs]
        params = jax.device_put(share.init(jax.random.key(1)), dev0)
        state = share.init_opt_state(params, opt)
        g = jax.device_put(jnp.full((batch, t_per * dim), 1e-3, jnp.float32), dev0)
        dev_sets = [(jax.device_put(i, dev0), jax.device_put(o, dev0), g) for i, o in inputs]
        ms, carry = timed(train_fn(share, opt), (params, state, jnp.float32(0)), dev_sets, args.iters, args.reps)
        out[f"one_gpu_{name}_ms"] = ms
        if args.profile and name == "share":
            prof = profile(train_fn(share, opt), carry, dev_sets, args.iters)
            out["share_profile_top"] = dict(list(prof.items())[:25])
        print(name, ms, flush=True)
    for key, val in out.items():
        if isinstance(val, dict) and "step_ms" in val:
            val["vs_one_gpu_share"] = val["step_ms"] / out["one_gpu_share_ms"]
    results["weak"] = out


def big(args, n, rng, results):
    rows, dim, nt, b, bag = args.big_rows, 128, args.big_tables, args.local_batch, 20
    opt = tbe_jax.RowwiseAdagrad(LR, EPS)
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(rows, dim) for _ in range(nt)],
                                        weights_dtype=jnp.float16, output_dtype=jnp.float32, impl=args.impl)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    out = {"tables": nt, "rows": rows, "dim": dim, "table_gb": nt * rows * dim * 2 / 1e9, "local_batch": b,
           "bag": bag, "n": n}
    for plan_name in args.big_plans.split(","):
        plan = {t: ("table", t % n) for t in range(nt)} if plan_name == "table" else {t: "row" for t in range(nt)}
        sharded = tbe_jax.shard(emb, mesh, "data", plan)
        spec = NamedSharding(mesh, P("data"))
        shapes = {sharded.local.layout.key(c): (n * r, w) for c, (r, w) in
                  enumerate(zip(sharded.layout.pool_rows, sharded.layout.widths))}
        params = jax.jit(lambda: {k: jnp.zeros(s, jnp.float16) for k, s in shapes.items()},
                         out_shardings={k: spec for k in shapes})()
        state = sharded.init_opt_state(params, opt)
        sets = [local_inputs(rng, nt, rows, b, bag, 1.0, n) for _ in range(2)]
        g = jax.device_put(jnp.full((n * b, nt * dim), 1e-3, jnp.float32), spec)
        dev_sets = [(jax.device_put(i, spec), jax.device_put(o, spec), g) for i, o in sets]
        fn = train_fn(sharded, opt)
        ma = fn.lower((params, state, jnp.float32(0)), *dev_sets[0]).compile().memory_analysis()
        out[plan_name + "_memory_analysis_gb"] = {k: getattr(ma, k) / 1e9 for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
            if hasattr(ma, k)}
        print(plan_name, "memory analysis", out[plan_name + "_memory_analysis_gb"], flush=True)
        if args.analysis_only:
            continue
        ms, carry = timed(fn, (params, state, jnp.float32(0)), dev_sets, args.iters, args.reps)
        if args.profile:
            prof = profile(fn, carry, dev_sets, 2)
            out[plan_name + "_profile_top"] = dict(list(prof.items())[:12])
            print(plan_name, "profile", {k[:60]: round(v["ms"], 3) for k, v in list(prof.items())[:12]}, flush=True)
            params2 = jax.jit(lambda: {k: jnp.zeros(s, jnp.float16) for k, s in shapes.items()},
                              out_shardings={k: spec for k in shapes})()
            carry = (params2, sharded.init_opt_state(params2, opt), jnp.float32(0))
            hprof = profile(fn, carry, dev_sets, 2, host=True)
            out[plan_name + "_host_profile_top"] = dict(list(hprof.items())[:15])
            print(plan_name, "host profile", {k[:80]: round(v["ms"], 3) for k, v in list(hprof.items())[:15]},
                  flush=True)
            carry = None
        mem = [d.memory_stats() or {} for d in jax.devices()[:n]]
        out[plan_name] = {
            "step_ms": ms, "lookups_per_s": nt * b * bag * n / ms * 1e3,
            "gpu_bytes_in_use_gb": [m.get("bytes_in_use", 0) / 1e9 for m in mem],
            "gpu_peak_gb": [m.get("peak_bytes_in_use", 0) / 1e9 for m in mem],
            "finite": None if carry is None else bool(jnp.isfinite(carry[2])),
        }
        print(plan_name, out[plan_name], flush=True)
        del params, state, carry
    results["big"] = out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks sharding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weak", action="store_true")
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--plans", default="table,row")
    ap.add_argument("--big-plans", default="table,row")
    ap.add_argument("--big-rows-list", default="", help="big: several row counts (comma-separated), one run each")
    ap.add_argument("--local-batch", type=int, default=4096)
    ap.add_argument("--big-tables", type=int, default=16)
    ap.add_argument("--big-rows", type=int, default=50_000_000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--comm-dtypes", default="none", help="weak: pooled-row / gradient comm dtypes, e.g. none,bfloat16")
    ap.add_argument("--profile", action="store_true", help="weak: per-kernel GPU time from a profiler trace")
    ap.add_argument("--analysis-only", action="store_true", help="big: compile and print memory analysis only")
    ap.add_argument("--capacity-fracs", default="1", help="weak: capacity per destination as fractions of the "
                    "local ids (1: the safe default, None), or 'feature' (per-feature counts: tbe_jax.shard's exact "
                    "bound for the plan); e.g. 1,0.5,feature")
    ap.add_argument("--impl", default="pallas", help="xla: a CPU smoke run (with --rows/--tables-per-gpu small)")
    ap.add_argument("--rows", type=int, default=0, help="weak: rows per table (0: the preset's)")
    ap.add_argument("--tables-per-gpu", type=int, default=0, help="weak: tables per GPU (0: the preset's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--locations", default="device", help="weak: the tables' locations to time, e.g. "
                    "device,host_cached (host tables take the table and row plans only)")
    ap.add_argument("--cache-load-factor", type=float, default=0.2)
    ap.add_argument("--alpha", type=float, default=None, help="weak: Zipf exponent of the ids (default: the preset's)")
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)
    n = len(jax.devices())
    rng = np.random.default_rng(0)
    res = {"meta": common.meta(), "device": jax.devices()[0].device_kind, "num_devices": n, "args": vars(args)}
    if args.weak:
        weak(args, n, rng, res)
    if args.big and args.big_rows_list:
        for r in args.big_rows_list.split(","):
            args.big_rows = int(r)
            sub = {}
            big(args, n, rng, sub)
            res[f"big_{r}"] = sub["big"]
    elif args.big:
        big(args, n, rng, res)
    print("saved", common.save("sharding", res, args.out))


if __name__ == "__main__":
    main()
