"""TT embedding-bag forward: the fused FlowTT Pallas kernel against XLA baselines.

Workloads (`tt_jax.workloads`):
- a (default): one table, N = 10M as 200x200x250, D = 32 as 2x4x4, ranks (32, 32), L = 20,
  Zipf(1.1) ids (the anchors' TT workload; the bar is B = 32768 forward <= 0.75 ms).
- meta-240 / meta-480 / meta-788: Meta-like multi-table workloads (synthetic, see workloads.py).

Variants (`--variants`, comma-separated):
- per_index:    XLA, contract the core chain for every lookup (TT-Rec style; tt_jax's reference
                path). The speedup column is relative to it. Multi-table: in blocks of
                `--lookup-block` lookups (lax.map) so the gathered core slices fit in memory.
- unique_only:  XLA, once per distinct row, gathered back (EcoRec-style dedup)           [a only]
- prefix_reuse: XLA, each distinct prefix once, then each row's last core (unfused FlowTT) [a only]
- dense:        a dense [N, D] fp32 table of the same shape through tbe_jax, for scale     [a only]
- pallas:             the fused kernel, `--schedule` (default static) and the config flags below
- pallas_static:      ... with schedule="static" (persistent, round-robin items; the default)
- pallas_queue:       ... with schedule="queue" (persistent, atomic work counter: work stealing)
- pallas_grid:        ... with schedule="grid" (one program per item slot: the static baseline)
- pallas_unique_only: ... with prefix_reuse=False (ablation: every distinct row recomputes its prefix)
- pallas_whole_groups: ... with chunk=0 (items are whole prefix groups: no splitting of hot prefixes)
- pallas_ieee:        ... with precision="ieee" (fp32 FMA dots instead of TF32x3 tensor cores)
- pallas_bwd_xla:     ... with backward="xla" (the XLA backward on the kernel's plans; --bwd compares the two)
- pallas_plan:        preprocessing only (sort, unique, prefix groups, work items, inverse map)
- pallas_plan_rows:   preprocessing + the rows kernel (no pooling): with pallas_plan, the breakdown
- train_sgd / train_adagrad / train_rowwise: one training step, `tbe_jax.train_step` with the loss
                      0.5*sum(out**2): the forward (its plans kept), the output gradient, then
                      `apply_gradients` on those plans: the Pallas prefix-reuse backward
                      (`tt_jax.kernels.backward`) with the optimizer (SGD, element-wise Adagrad, row-wise
                      Adagrad) applied densely over each core (zero gradient on untouched slices); the
                      optimizer's state is a fresh one each call. "fwd_ms" of these is the whole step; with
                      pallas_plan and pallas the breakdown is plan / forward / backward+optimizer.
- pallas{...}:        one per `--configs` entry (JSON): the base config with those fields replaced (a sweep)

Timing as bench_forward.py: `--iters` calls enqueued back to back over `--sets` rotating input
sets, one block, median of `--reps` (launch overhead excluded). Forward for every variant;
forward+backward (jax.grad of the cores) for the XLA variants, `pallas` (the Pallas backward) and
`pallas_bwd_xla` (the XLA backward) with `--bwd` (default on for workload a). Memory: the compiled
executable's arguments + outputs + temporaries (`memory_analysis`), and the device's `peak_bytes_in_use`
after the variant (cumulative over the process, so order matters; null on CPU).

Results: benchmarks/results/tt-<stamp>-<gpu>.json. Without a GPU the run is a smoke test: tiny
shapes, interpret mode, one timed call (checks the script, not performance).

Examples:
  python -m benchmarks tt                                        # workload a, B = 4096, 32768
  python -m benchmarks tt --batches 2048,8192,32768,131072 --variants per_index,pallas,pallas_static
  python -m benchmarks tt --workload meta-240 --batches 1024,4096 --no-bwd
  python -m benchmarks tt --batches 32768 --variants per_index,pallas --no-bwd \
      --configs '{"chunk": 32, "tile_rows": 8}' '{"num_warps": 2}' '{"programs_per_sm": 8}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
import tt_jax
from benchmarks import common
from benchmarks.common import time_calls
from tt_jax import params as tt_params
from tt_jax import prefix, reference, workloads
from tt_jax.kernels import forward as tt_kernels

XLA_VARIANTS = ("per_index", "unique_only", "prefix_reuse", "dense")
PALLAS_VARIANTS = ("pallas", "pallas_static", "pallas_queue", "pallas_grid", "pallas_unique_only",
                   "pallas_whole_groups", "pallas_ieee", "pallas_bwd_xla", "pallas_plan", "pallas_plan_rows",
                   "train_sgd", "train_adagrad", "train_rowwise")
TRAIN_VARIANTS = ("train_sgd", "train_adagrad", "train_rowwise")
SINGLE_TABLE_ONLY = ("unique_only", "prefix_reuse", "dense")


def _bag_ids(off, n):
    """Bag of each position: +1 at every bag start, prefix-summed (positions past the end: last bag)."""
    return jnp.cumsum(jnp.zeros(n, jnp.int32).at[off[1:-1]].add(1, mode="drop"))


def xla_single_table(spec, batch):
    """The anchors' XLA baselines for one table, one feature: fn(all_cores, idx, off) -> [B, D]."""

    def pool(rows_fn):
        def f(all_cores, idx, off):
            cores = all_cores[0]
            return jax.ops.segment_sum(rows_fn(cores, idx), _bag_ids(off, idx.shape[0]), num_segments=batch,
                                       indices_are_sorted=True)
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


def xla_per_index_multi(specs, batch, block):
    """Per-lookup chain over many tables of one (q, ranks) group, `block` lookups at a time."""
    (layout, _), = prefix.stack_tables(specs, tuple(range(len(specs))))
    nf = len(specs)
    t_cores = layout.num_cores
    r = layout.full_ranks
    q = layout.q_shapes

    def const(v):
        return jnp.asarray(np.asarray(v, np.int32))

    def rows_block(stacked, lt, ids):
        rest, digs = ids, []
        for t in reversed(range(t_cores)):
            radix = const([s.p_shapes[t] for s in specs])[lt]
            digs.append(rest % radix)
            rest = rest // radix
        digs = digs[::-1]
        acc = None
        for t in range(t_cores):
            g = stacked[t].reshape(-1, r[t], q[t], r[t + 1])[const(layout.core_base[t][:-1])[lt] + digs[t]]
            if acc is None:
                acc = g[:, 0]  # [n, q1, r1]
            else:
                acc = jnp.einsum("nar,nrbs->nabs", acc, g, precision=jax.lax.Precision.HIGHEST)
                acc = acc.reshape(acc.shape[0], -1, acc.shape[-1])
        return acc[..., 0]

    def f(all_cores, idx, off):
        n = idx.shape[0]
        stacked = all_cores[0]  # the group's stacked cores, as the params hold them
        bag = _bag_ids(off, n)
        lt = jnp.minimum(bag // batch, nf - 1)
        pos = jnp.arange(n, dtype=jnp.int32)
        valid = (pos < off[-1]) & (idx >= 0) & (idx < const([s.num_embeddings for s in specs])[lt])
        ids = jnp.where(valid, idx, 0)
        pad = (-n) % block
        lt_b = jnp.pad(lt, (0, pad)).reshape(-1, block)
        ids_b = jnp.pad(ids, (0, pad)).reshape(-1, block)
        rows = jax.lax.map(lambda a: rows_block(stacked, a[0], a[1]), (lt_b, ids_b)).reshape(-1, layout.dim)[:n]
        rows = rows * valid[:, None].astype(rows.dtype)
        pooled = jax.ops.segment_sum(rows, bag, num_segments=nf * batch, indices_are_sorted=True)
        return pooled.reshape(nf, batch, -1).transpose(1, 0, 2).reshape(batch, -1)

    return f


def numpy_cores(specs, seed: int = 0):
    """The params' stacked cores (`params["cores"]`, per table group per core: `tt_jax.params`) of per-table cores
    drawn with NumPy (normal, at the init's scale: each table's rows then have the variance of a uniform
    +-1/sqrt(E)); one jax sampler compile per distinct core shape is slow for hundreds of tables."""
    rng = np.random.default_rng(seed)
    sig = [(1.0 / (3 * s.num_embeddings) / np.prod(s.ranks)) ** (1.0 / (2 * s.num_cores)) for s in specs]
    return tt_params.stack(specs, [[np.asarray(rng.normal(0, sg, shape), np.float32) for shape in s.core_shapes()]
                                   for s, sg in zip(specs, sig)])


def config_fields(entry: str) -> dict:
    """A TTKernelConfig variant's fields from a JSON object (`'{"chunk": 32, "precision": "tf32"}'`), the names
    checked against the config's."""
    common.config(entry, tt_kernels.TTKernelConfig)
    return {} if entry.strip() in ("", "default") else json.loads(entry)


def pallas_variant(name, specs, batch, base: tt_kernels.TTKernelConfig, interpret):
    """fn(all_cores, idx, off) for a fused-kernel variant (or a part of its pipeline)."""
    cfg = {
        "pallas": base,
        "pallas_static": dataclasses.replace(base, schedule="static"),
        "pallas_queue": dataclasses.replace(base, schedule="queue"),
        "pallas_grid": dataclasses.replace(base, schedule="grid"),
        "pallas_unique_only": dataclasses.replace(base, prefix_reuse=False),
        "pallas_whole_groups": dataclasses.replace(base, chunk=0),
        "pallas_ieee": dataclasses.replace(base, precision="ieee"),
        "pallas_bwd_xla": dataclasses.replace(base, backward="xla"),
    }.get(name, base)
    ftm = tuple(range(len(specs)))
    if name in TRAIN_VARIANTS:
        opt = {"train_sgd": tt_jax.SGD(0.01), "train_adagrad": tt_jax.Adagrad(0.01),
               "train_rowwise": tt_jax.RowwiseAdagrad(0.01)}[name]
        emb = tt_jax.TTEmbeddingBag(specs, impl="pallas", interpret=interpret, config=cfg)

        def step(all_cores, idx, off):
            params = {"cores": all_cores}
            res = tbe_jax.train_step(lambda _, out: 0.5 * jnp.sum(out**2), None, tbe_jax.SparseLookup(
                emb, opt, params, emb.init_opt_state(params, opt), idx, off))
            return res.params["cores"], res.opt_state
        return step, cfg
    if name in ("pallas_plan", "pallas_plan_rows"):
        def part(all_cores, idx, off):
            outs = []
            for layout, feats in prefix.stack_tables(specs, ftm):
                plan = prefix.build_flow(layout, idx, off, features=feats, feature_table_map=ftm, batch=batch,
                                         chunk=cfg.chunk, prefix_reuse=cfg.prefix_reuse)
                if name == "pallas_plan":
                    outs.append(plan)
                else:
                    cores = [c.reshape(-1) for c in tt_params.group_cores(specs, layout, all_cores)]
                    outs.append(tt_kernels.tt_rows(cores, plan, layout, config=cfg, interpret=interpret))
            return outs
        return part, cfg
    emb = tt_jax.TTEmbeddingBag(specs, impl="pallas", interpret=interpret, config=cfg)
    return (lambda all_cores, idx, off: emb({"cores": all_cores}, idx, off)), cfg


def memory_of(fn, args):
    """Bytes of arguments + outputs + temporaries of the compiled executable (None if unavailable)."""
    try:
        ma = jax.jit(fn).lower(*args).compile().memory_analysis()
        if ma is None:
            return None
        return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                   - getattr(ma, "alias_size_in_bytes", 0))
    except Exception:  # noqa: BLE001 - best effort
        return None


def device_peak():
    try:
        stats = jax.devices()[0].memory_stats()
        return None if stats is None else int(stats.get("peak_bytes_in_use", 0)) or None
    except Exception:  # noqa: BLE001
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks tt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="a", choices=sorted(workloads.PRESETS))
    ap.add_argument("--batches", default=None, help="comma-separated B (default 4096,32768; smoke: 64)")
    ap.add_argument("--p", default="200,200,250", help="workload a: row factorisation")
    ap.add_argument("--q", default="2,4,4", help="workload a: column factorisation")
    ap.add_argument("--ranks", default="32,32", help="workload a: TT ranks")
    ap.add_argument("-L", type=int, default=20, help="workload a: bag size")
    ap.add_argument("--alpha", type=float, default=None, help="Zipf exponent (default: the workload's)")
    ap.add_argument("--variants", default=None, help="comma-separated (default: all that apply)")
    ap.add_argument("--bwd", action=argparse.BooleanOptionalAction, default=None,
                    help="also time forward+backward (default: on for workload a)")
    ap.add_argument("--lookup-block", type=int, default=65536, help="multi-table per_index: lookups per block")
    # The fused kernel's base config (TTKernelConfig).
    ap.add_argument("--schedule", default="static", choices=["queue", "static", "grid"])
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--tile-rows", type=int, default=None)
    ap.add_argument("--num-programs", type=int, default=None)
    ap.add_argument("--programs-per-sm", type=int, default=None)
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--precision", default=None, choices=["tf32x3", "ieee", "tf32"])
    ap.add_argument("--pool-bags", type=int, default=None)
    ap.add_argument("--pool-unroll", type=int, default=None)
    ap.add_argument("--pool-warps", type=int, default=None)
    ap.add_argument("--configs", nargs="*", default=[],
                    help="extra fused-kernel variants, each a JSON object of TTKernelConfig fields over the base config")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--smoke", action=argparse.BooleanOptionalAction, default=None,
                    help="tiny shapes in interpret mode (default: on without a GPU)")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    smoke = (not on_gpu) if args.smoke is None else args.smoke
    interpret = not on_gpu
    if smoke:
        args.iters, args.reps, args.sets = 1, 1, 1

    # Workload.
    if args.workload == "a":
        p = (20, 20, 25) if smoke else tuple(int(x) for x in args.p.split(","))
        wl = workloads.workload_a(p=p, q=tuple(int(x) for x in args.q.split(",")),
                                  ranks=tuple(int(x) for x in args.ranks.split(",")), bag_len=args.L,
                                  alpha=1.1 if args.alpha is None else args.alpha)
    else:
        kw = {} if args.alpha is None else {"alpha": args.alpha}
        if smoke:
            kw.update(median_rows=3000, max_rows=20_000)
        wl = workloads.meta(int(args.workload.split("-")[1]) if not smoke else 6, name=args.workload, **kw)
    specs = wl.specs
    single = len(specs) == 1
    batches = [int(b) for b in (args.batches or ("64" if smoke else "4096,32768")).split(",")]
    bwd = (args.workload == "a") if args.bwd is None else args.bwd
    if args.variants:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in names if v not in XLA_VARIANTS + PALLAS_VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; choose from {XLA_VARIANTS + PALLAS_VARIANTS}")
    else:
        names = [v for v in XLA_VARIANTS + PALLAS_VARIANTS if single or v not in SINGLE_TABLE_ONLY]
    names = [v for v in names if single or v not in SINGLE_TABLE_ONLY]
    overrides = {k: getattr(args, k) for k in ("chunk", "tile_rows", "num_programs", "programs_per_sm", "num_warps",
                                               "precision", "pool_bags", "pool_unroll", "pool_warps")
                 if getattr(args, k) is not None}
    if smoke and "num_programs" not in overrides:
        overrides["num_programs"] = 4
    base = tt_kernels.TTKernelConfig(schedule=args.schedule, **overrides)
    sweep = {}
    for entry in args.configs:
        sweep["pallas" + entry] = dataclasses.replace(base, **config_fields(entry))
    names += list(sweep)

    emb = tt_jax.TTEmbeddingBag(specs, impl="xla")
    if smoke or len(specs) == 1:
        all_cores = emb.init(jax.random.key(0))["cores"]
    else:  # hundreds of tables
        all_cores = numpy_cores(specs)
    rows_out = []
    for batch in batches:
        rng = np.random.default_rng(batch)
        perms = [np.random.default_rng(1).permutation(s.num_embeddings) for s in specs] if wl.exact_zipf else None
        sets = [wl.make_batch(rng, batch, perms=perms) for _ in range(args.sets)]
        dev = [(jnp.asarray(i), jnp.asarray(o)) for i, o in sets]
        arg_sets = [(all_cores,) + d for d in dev]
        row = {"B": batch, "lookups": int(len(sets[0][0])), "variants": {}}
        # Plan statistics of the first input set (device scalars of the default config).
        try:
            stats = jax.jit(lambda c, i, o: tt_kernels.plan_stats(tt_kernels.pooled_forward(
                c, specs, tuple(range(len(specs))), i, o, None, batch=batch, pooling="sum", config=base,
                interpret=interpret).plans))(*arg_sets[0])
            row["plan"] = [{k: int(v) for k, v in s.items()} for s in stats]
        except Exception as e:  # noqa: BLE001
            row["plan"] = {"error": repr(e)[:300]}
        fns = {}
        if single:
            fns.update(xla_single_table(specs[0], batch))
        else:
            fns["per_index"] = xla_per_index_multi(specs, batch, args.lookup_block)
        ref = None
        for name in names:
            res = {}
            try:
                if name == "dense":
                    dense = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(specs[0].num_embeddings,
                                                                             specs[0].embedding_dim)])
                    dparams = dense.init(jax.random.key(1))
                    dfwd = jax.jit(lambda pr, i, o: dense(pr, i, o))
                    res["fwd_ms"] = time_calls(dfwd, [(dparams,) + d for d in dev], args.iters, args.reps)
                    res["memory_bytes"] = memory_of(lambda pr, i, o: dense(pr, i, o), (dparams,) + dev[0])
                    del dparams
                else:
                    if name in PALLAS_VARIANTS or name in sweep:
                        fn, cfg = pallas_variant("pallas" if name in sweep else name, specs, batch,
                                                 sweep.get(name, base), interpret)
                        res["config"] = dataclasses.asdict(cfg)
                    else:
                        fn = fns[name]
                    fwd = jax.jit(fn)
                    res["fwd_ms"] = time_calls(fwd, arg_sets, args.iters, args.reps)
                    res["memory_bytes"] = memory_of(fn, arg_sets[0])
                    if name not in ("pallas_plan", "pallas_plan_rows") + TRAIN_VARIANTS:
                        out = np.asarray(fwd(*arg_sets[0]), np.float64)
                        ref = out if ref is None else ref
                        res["max_rel_err_vs_first"] = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
                    if bwd and name in ("per_index", "unique_only", "prefix_reuse", "pallas", "pallas_bwd_xla"):
                        g = jax.jit(jax.grad(lambda c, i, o, fn=fn: jnp.sum(fn(c, i, o) ** 2)))
                        res["fwd_bwd_ms"] = time_calls(g, arg_sets, args.iters, args.reps)
            except Exception as e:  # noqa: BLE001 - record and go on (e.g. out of memory at large B)
                res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                traceback.print_exc(limit=2)
            res["device_peak_bytes_after"] = device_peak()
            row["variants"][name] = res
            msg = res.get("error") or (f"fwd {res['fwd_ms']:.3f} ms"
                                       + (f", fwd+bwd {res['fwd_bwd_ms']:.3f} ms" if "fwd_bwd_ms" in res else ""))
            print(f"B={batch} {name}: {msg}", flush=True)
        base_ms = row["variants"].get("per_index", {}).get("fwd_ms")
        for res in row["variants"].values():
            if base_ms and "fwd_ms" in res:
                res["speedup_vs_per_index"] = base_ms / res["fwd_ms"]
        rows_out.append(row)
        print(f"B={batch}: plan {row['plan']}", flush=True)
        print("  " + ", ".join(f"{k} {v['fwd_ms']:.3f} ms" + (f" ({v['speedup_vs_per_index']:.1f}x)"
                                                               if "speedup_vs_per_index" in v else "")
                               for k, v in row["variants"].items() if "fwd_ms" in v), flush=True)

    meta = common.meta(
        smoke_interpret=bool(smoke and interpret), workload=wl.summary(), base_config=dataclasses.asdict(base),
        timing=f"{args.iters} enqueued calls over {args.sets} input sets, one block, median of {args.reps}",
        args=vars(args))
    print("saved", common.save("tt", {"meta": meta, "results": rows_out}, args.out, "" if on_gpu else "smoke"))



if __name__ == "__main__":
    main()
