"""The host tier (issue 40): a training step with tables in host memory, against the same model in HBM.

For each case: `--tables` tables of `--rows` rows x `--dim` (fp16 by default), batch `--batch`, `--bag` ids per bag,
Zipf ids (alpha in `--alphas`, ranks permuted per table), row-wise Adagrad, a step that is `tbe_jax.train_step`
on batch k (loss sum(out * g)); the host_cached step also prefetches batch k+1 (with the optimizer state) in the
same jitted program, as a pipeline one batch ahead would. Cases: "device" (all HBM), "host" (no cache: every row
over the bus), "host_cached" at each `--load-factors` and policy, "planned" (`tbe_jax.plan_locations` under
`--hbm-budget-gb`: a model larger than HBM). Reported per case: ms per step (enqueued, median of `--reps` runs of
`--iters` steps, donated; `--sets` batches, one gradient), lookups/s and ns per lookup against the "device" case's
(run at `--baseline-rows` when the model does not fit), the hit rates (of the distinct cached rows requested, and
of the lookups: FBGEMM's), fills and write-backs per step and the bytes they move over the bus, HBM in use and
the process's resident host memory. `--fresh-batches`: a new batch every step, drawn on the device inside the
step (`device_ids`), for the cache's steady state (cycled sets repeat their rows; session 34's 183 GB run, with 16
sets, never left the cache's filling phase).

  python -m benchmarks host_cache --rows 4000000 --tables 8 --batch 16384
  python -m benchmarks host_cache --tables 16 --rows 44000000 --locations device planned --baseline-rows 4000000 \
      --hbm-budget-gb 120 --alphas 1.05 --load-factors 0.2 --fresh-batches --warmup-steps 400
      # ~180 GB of tables and state on an H200
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common


def batch_sets(args, alpha, n_sets, seed=0):
    """`n_sets` batches (ids, offsets, and one output gradient shared by all); with `--fresh-batches` only the
    gradient (ids and offsets None: the step draws them)."""
    from tbe_jax import testing

    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal((args.batch, args.tables * args.dim), dtype=np.float32))
    if args.fresh_batches:
        return [(None, None, g)]
    perms = [np.random.default_rng(1000 + t).permutation(args.rows) for t in range(args.tables)] if alpha > 1 else None
    out = []
    for _ in range(n_sets):
        idx, off, _ = testing.make_batch(rng, [args.rows] * args.tables, [args.batch] * args.tables,
                                         [args.bag] * args.tables, alpha=alpha, weighted=False, perms=perms)
        out.append((jnp.asarray(idx), jnp.asarray(off), g))
    return out


def device_ids(key, k, *, tables: int, rows: int, n: int, alpha: float):
    """Batch `k`'s ids, `n` per table (tables in order), drawn on the device (`--fresh-batches`): every step a new
    batch at no host cost. Uniform for alpha <= 1; else ranks of a continuous power law of exponent alpha on [1,
    rows + 1) (the discrete Zipf's tail; its first few ranks a little lighter), spread over the table by a
    multiplicative hash salted per table (not a permutation: a few ranks share a row)."""
    u = jax.random.uniform(jax.random.fold_in(key, k), (tables, n), jnp.float32)
    if alpha <= 1.0:
        return jnp.minimum((u * rows).astype(jnp.int32), rows - 1).reshape(-1)
    p = 1.0 - alpha
    x = (1.0 + u * (float(rows + 1) ** p - 1.0)) ** (1.0 / p)
    rank = jnp.clip(jnp.floor(x).astype(jnp.int32) - 1, 0, rows - 1).astype(jnp.uint32)
    salt = jnp.arange(tables, dtype=jnp.uint32)[:, None] * jnp.uint32(0x85EBCA6B)
    h = rank * jnp.uint32(0x9E3779B1) + salt
    return (h % jnp.uint32(rows)).astype(jnp.int32).reshape(-1)


def _memory() -> dict:
    """GB of HBM in use (and its peak) on the first device, and of this process's resident host memory."""
    stats = jax.devices()[0].memory_stats() or {}
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"hbm_gb": stats.get("bytes_in_use", 0) / 1e9, "hbm_peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9,
            "host_rss_gb": rss / 1e9}


def _case(args, location, alpha, sets, load_factor=0.2, policy="lru"):
    import tbe_jax

    dtype = jnp.dtype(args.dtype)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=1e-8)
    specs = [tbe_jax.TableSpec(args.rows, args.dim, location=location if location != "planned" else "device")
             for _ in range(args.tables)]
    if location == "planned":  # the planner's choice under the HBM budget
        host_gb = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")  # as `allow_large_memory` set it
        specs = tbe_jax.plan_locations(specs, int(args.hbm_budget_gb * 1e9), weights_dtype=dtype, optimizer=opt,
                                       cache_load_factor=load_factor,
                                       host_budget=int(float(host_gb) * 2**30) if host_gb else None)
    lookups = args.batch * args.bag * args.tables
    max_fills = max(1, int(args.fill_fraction * lookups)) if args.fill_fraction else None
    emb = tbe_jax.TableBatchedEmbedding(specs, weights_dtype=dtype, cache_load_factor=load_factor,
                                        cache_policy=policy, cache_max_fills=max_fills, interpret=common.interpret(),
                                        kernel_config=common.config(args.kernel_config, tbe_jax.ForwardConfig),
                                        backward_config=common.config(args.backward_config, tbe_jax.BackwardConfig),
                                        **({"cache_admit_age": args.admit_age} if args.admit_age >= 0 else {}))
    t0 = time.perf_counter()
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    jax.block_until_ready((params, state))
    init_s = time.perf_counter() - t0
    cached = any(t.location == "host_cached" for t in specs)

    def body(params, state, acc, idx, off, g, nidx, noff):
        if cached and nidx is not None:
            params, state = emb.prefetch(params, nidx, noff, opt_state=state)
        res = tbe_jax.train_step(lambda _, out: jnp.sum(out * g), None,
                                 tbe_jax.SparseLookup(emb, opt, params, state, idx, off))
        # the loss is carried: with it unused XLA drops the forward (this loss's gradient does not need it), and
        # the step would time the backward alone (sessions 33-37 did: their numbers have no forward)
        return res.params, res.opt_state, acc + res.loss

    g0, n_ids = sets[0][2], args.batch * args.bag
    if args.fresh_batches:  # batch k and k + 1 drawn in the step from the counter k, carried on the device
        off0 = jnp.arange(args.tables * args.batch + 1, dtype=jnp.int32) * args.bag
        draw = functools.partial(device_ids, jax.random.key(1 + int(alpha * 1000)), tables=args.tables,
                                 rows=args.rows, n=n_ids, alpha=alpha)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, acc, k):
            return (*body(params, state, acc, draw(k), off0, g0, draw(k + 1), off0), k + 1)

        first = (draw(jnp.int32(0)), off0)
        batches = [()]  # the step's arguments after the carry: none
        n = args.warmup_steps or args.sets
    else:
        step = jax.jit(body, donate_argnums=(0, 1))
        first = sets[0][:2]
        batches = [(*sets[k], *sets[(k + 1) % len(sets)][:2]) for k in range(len(sets))]
        n = len(sets)
    if cached:
        params, state = jax.jit(lambda p, s, i, o: emb.prefetch(p, i, o, opt_state=s), donate_argnums=(0, 1))(
            params, state, *first)
    stats = []
    t0 = time.perf_counter()
    acc = jnp.zeros((), jnp.float32)
    carry = (params, state, acc, jnp.int32(0)) if args.fresh_batches else (params, state, acc)
    for k in range(n):  # warm-up (compile, and the cache's fill) over every set, as the timed loop runs them
        carry = step(*carry, *batches[k % len(batches)])
        if cached:
            stats.append([int(v) for v in emb.cache_stats(carry[0]).values()])
    jax.block_until_ready(carry)
    compile_s = time.perf_counter() - t0
    times, enq = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        for i in range(args.iters):
            carry = step(*carry, *batches[i % len(batches)])
        enq.append((time.perf_counter() - t0) * 1e3 / args.iters)  # the host's time to enqueue a step
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - t0) * 1e3 / args.iters)
        if cached and args.fresh_batches:
            stats.append([int(v) for v in emb.cache_stats(carry[0]).values()])
    if cached:
        stats.append([int(v) for v in emb.cache_stats(carry[0]).values()])
    kernels = alone = None
    if args.profile:  # per-kernel device time of the step (the carry is donated: this comes last)
        # the library's scope of each XLA kernel, from the compiled program's op names
        hlo_scope = common.hlo_scopes(step.lower(*carry, *batches[0]).compile().as_text())
        if cached and not args.fresh_batches:  # first the training step alone on the warm cache (no prefetch)
            train = jax.jit(lambda p, s, a, i, o, g, *_: body(p, s, a, i, o, g, None, None), donate_argnums=(0, 1))
            keep = []
            alone = common.profile(lambda c, *a: train(*c, *a), carry, batches, args.profile, keep=keep)
            carry = keep[0]
        kernels = common.profile(lambda c, *a: step(*c, *a), carry, batches, args.profile)
    row_bytes = args.dim * dtype.itemsize + 4  # a row and its row-wise state
    ms = float(np.median(times))
    lookups = args.batch * args.bag * args.tables
    out = {"location": location, "alpha": alpha, "rows": args.rows, "ms": ms, "enqueue_ms": float(np.median(enq)),
           "batches": "fresh (drawn in the step)" if args.fresh_batches else f"{len(sets)} cycled",
           "init_s": round(init_s, 2),
           "warmup_s": round(compile_s, 2), "lookups_per_s": lookups / ms * 1e3, "ns_per_lookup": ms * 1e6 / lookups,
           "locations": [t.location for t in specs],
           "table_gb": args.tables * args.rows * (args.dim * dtype.itemsize + 4) / 1e9, **_memory()}
    if kernels is not None:
        out["device_ms"] = sum(v["ms"] for v in kernels.values())
        out["launches_per_step"] = sum(v["calls_per_step"] for v in kernels.values())
        out["device_ms_by_kind"] = _by_kind(kernels)
        out["kernels"] = kernels
        by = {}
        for name, v in kernels.items():  # the compiled program's scope of each kernel; the row copies by name
            scope = hlo_scope.get(name) or ("tbe_prefetch/copies" if "_rows" in name and name.startswith("tbe_")
                                            else "other")
            by[scope] = by.get(scope, 0.0) + v["ms"]
        out["device_ms_by_scope"] = dict(sorted(by.items(), key=lambda kv: -kv[1]))
    if alone is not None:  # the step without its prefetch: device ms, by kind, and its kernels
        out["step_alone"] = {"device_ms": sum(v["ms"] for v in alone.values()), "by_kind": _by_kind(alone),
                             "kernels": alone}
    if cached:
        # after the cache warmed up: the second half of the steps seen, or with fresh batches the steps after the
        # warm-up (each timed run's last)
        s = np.asarray(stats[n:] if args.fresh_batches else stats[len(stats) // 2:], np.float64)
        req, hits, fills, wb, lookups, lookup_hits, host_lookups = s.mean(axis=0)
        # rows the step reads or updates in host memory: each lookup left there reads its row in the forward;
        # each distinct such row is read and written once more (with its state) by the update
        host_rows = req - hits - fills
        out.update(load_factor=load_factor, policy=policy, hit_rate=float(hits / max(req, 1)),
                   lookup_hit_rate=float(lookup_hits / max(lookups, 1)),
                   requested_per_step=float(req), fills_per_step=float(fills), writebacks_per_step=float(wb),
                   host_lookups_per_step=float(host_lookups), host_rows_per_step=float(host_rows),
                   bus_mb_per_step=float((fills + wb) * row_bytes / 1e6),  # the prefetch's copies
                   step_bus_mb_per_step=float((host_lookups * (row_bytes - 4) + 2 * host_rows * row_bytes) / 1e6),
                   cache_rows=int(emb.cache_layout.total_slots))
    return out


def _by_kind(kernels: dict) -> dict:
    """Device ms per step of the profile's kernels by kind: the row copies, our other Pallas kernels, sorts, the
    rest of XLA's (gathers, scatters, fusions)."""
    out = {"copy_rows": 0.0, "pallas": 0.0, "sort": 0.0, "xla": 0.0}
    for name, v in kernels.items():
        kind = ("copy_rows" if "copy_rows" in name else "sort" if "sort" in name.lower() or "cub::" in name
                else "pallas" if name.startswith(("tbe_", "prefix_scan")) else "xla")
        out[kind] += v["ms"]
    return out


def allow_large_memory() -> dict:
    """XLA's allocators' limits raised, where unset, before the GPU backend starts: HBM to 95% of the card
    (`XLA_PYTHON_CLIENT_MEM_FRACTION`, default 0.75) and pinned host memory to 85% of the host's RAM
    (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, default 64 GB): a model larger than HBM needs both (session 34's first
    two runs of the 183 GB model stopped on them). Returns what it set."""
    want = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
        want["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(int(total_kb * 0.85 / 2**20))
    except (OSError, StopIteration, ValueError):
        pass
    set_now = {k: v for k, v in want.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


def main(argv=None):
    allow_large_memory()
    ap = argparse.ArgumentParser(prog="python -m benchmarks host_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--bag", type=int, default=20)
    ap.add_argument("--alphas", type=float, nargs="*", default=[1.05, 1.2])
    ap.add_argument("--load-factors", type=float, nargs="*", default=[0.2, 0.05])
    ap.add_argument("--policies", nargs="*", default=["lru"])
    ap.add_argument("--locations", nargs="*", default=["device", "host_cached", "host"])
    ap.add_argument("--sets", type=int, default=48)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hbm-budget-gb", type=float, default=60.0,
                    help='location "planned": tbe_jax.plan_locations under this HBM budget')
    ap.add_argument("--baseline-rows", type=int, default=0,
                    help='rows per table of the "device" case (default --rows): a model that fits HBM, compared '
                         "per lookup with a larger one")
    ap.add_argument("--fresh-batches", action="store_true",
                    help="a new batch every step, drawn on the device inside the step (`device_ids`: no host cost, "
                         "no repeats: the cache's steady state), instead of --sets batches cycled")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="with --fresh-batches: steps before timing (default --sets); the cache fills meanwhile")
    ap.add_argument("--fill-fraction", type=float, default=0.0,
                    help="cache_max_fills as a fraction of a step's lookups (default: the library's, 1/16)")
    ap.add_argument("--admit-age", type=int, default=-1,
                    help="cache_admit_age (default: the library's, 128; 0 admits every miss, as FBGEMM's cache)")
    ap.add_argument("--kernel-config", default="", help="a tbe_jax.ForwardConfig as a JSON object of its fields, "
                    "e.g. '{\"bag_groups\": 4}' (fewer, longer forward programs: fewer host rows in flight)")
    ap.add_argument("--backward-config", default="", help="a tbe_jax.BackwardConfig as a JSON object of its fields")
    ap.add_argument("--profile", type=int, default=0,
                    help="also trace this many steps: device ms per step, by kernel and by kind")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cases = []
    for alpha in args.alphas:
        sets = batch_sets(args, alpha, args.sets)
        base = None
        for loc in args.locations:
            variants = [(lf, p) for lf in args.load_factors for p in args.policies] \
                if loc in ("host_cached", "planned") else [(0.2, "lru")]
            for lf, pol in variants:
                if loc == "device" and args.baseline_rows and args.baseline_rows != args.rows:
                    small = argparse.Namespace(**{**vars(args), "rows": args.baseline_rows})
                    r = _case(small, loc, alpha, batch_sets(small, alpha, args.sets), lf, pol)
                else:
                    r = _case(args, loc, alpha, sets, lf, pol)
                if loc == "device":
                    base = r["ns_per_lookup"]
                r["vs_device"] = r["ns_per_lookup"] / base if base else None
                cases.append(r)
                extra = (f" lf {lf} {pol}: hit {r['hit_rate']:.3f} of rows, {r['lookup_hit_rate']:.3f} of lookups, "
                         f"fills {r['fills_per_step']:.0f}, "
                         f"write-backs {r['writebacks_per_step']:.0f}, {r['bus_mb_per_step']:.1f} MB/step; "
                         f"{r['host_lookups_per_step']:.0f} lookups from host memory "
                         f"({r['step_bus_mb_per_step']:.1f} MB/step in the step)"
                         if "hit_rate" in r else "")
                print(f"alpha {alpha} {loc:12s} {r['ms']:8.3f} ms/step  x{r['vs_device'] or 0:.2f} of HBM per lookup"
                      f"{extra}; HBM {r['hbm_gb']:.1f} GB, host RSS {r['host_rss_gb']:.1f} GB", flush=True)
                if "kernels" in r:
                    print(f"  host enqueue {r['enqueue_ms']:.3f} ms/step; {r['launches_per_step']:.0f} launches; "
                          f"device {r['device_ms']:.3f} ms/step: " +
                          ", ".join(f"{k} {v:.3f}" for k, v in r["device_ms_by_kind"].items()), flush=True)
                    print("  by the library's name scopes: " +
                          ", ".join(f"{k} {v:.3f}" for k, v in r["device_ms_by_scope"].items()), flush=True)
                    common.print_kernels(r["kernels"], 14)
                if "step_alone" in r:  # what the prefetch adds: per kernel name, the full step's ms less the step's
                    a = r["step_alone"]
                    print(f"  the training step alone {a['device_ms']:.3f} ms: " +
                          ", ".join(f"{k} {v:.3f}" for k, v in a["by_kind"].items()) + "; the prefetch adds:")
                    more = {k: {"ms": v["ms"] - a["kernels"].get(k, {"ms": 0.0})["ms"],
                                "calls_per_step": v["calls_per_step"] - a["kernels"].get(k, {"calls_per_step": 0})[
                                    "calls_per_step"]} for k, v in r["kernels"].items()}
                    common.print_kernels(dict(sorted(more.items(), key=lambda kv: -kv[1]["ms"])), 30)
                jax.clear_caches()
    config = {k: getattr(args, k) for k in ("tables", "rows", "dim", "dtype", "batch", "bag", "sets", "iters", "reps",
                                            "hbm_budget_gb", "baseline_rows", "fill_fraction", "admit_age",
                                            "kernel_config", "backward_config")}
    path = common.save("host-cache", {"meta": common.meta(), "config": config, "cases": cases}, args.out)
    print("saved", path)


if __name__ == "__main__":
    main()
