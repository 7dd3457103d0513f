"""TBE forward benchmark: our kernel vs the XLA baseline, torch and FBGEMM's anchors.

Workloads are the anchors' (tbe_jax.testing.PRESETS) or built from FBGEMM's
knobs (-T -E -D -B -L --alpha --weighted --weights-dtype --output-dtype).

Timing (launch overhead excluded, as the anchors' "kernels" column): after
warm-up, enqueue `--iters` calls rotating among `--sets` input sets, block once,
and divide; repeat `--reps` times and take the median. The XLA baseline and
torch's embedding_bag are timed the same way in the same process.

Bandwidth is FBGEMM's formula: 4*B*sum(D) + weight_bytes*B*sum(D)*L bytes.
Results go to benchmarks/results/forward-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from benchmarks import common
from benchmarks.common import ANCHOR_XLA_FWD_MS, FBGEMM_FWD_KERNEL_MS, time_calls
from tbe_jax import testing


def xla_baseline(w, table_offsets, indices, offsets, psw, num_features, batch):
    """What a JAX user writes today: one take over stacked tables + sorted segment_sum."""
    n = indices.shape[0]
    # Bag id per index: +1 at every bag start, prefix-summed (cheaper than a searchsorted).
    bag = jnp.cumsum(jnp.zeros(n, jnp.int32).at[offsets[1:-1]].add(1, mode="drop"))
    feat = bag // batch
    rows = jnp.take(w, indices + table_offsets[feat], axis=0).astype(jnp.float32)
    if psw is not None:
        rows = rows * psw[:, None]
    pooled = jax.ops.segment_sum(rows, bag, num_segments=num_features * batch, indices_are_sorted=True)
    return pooled.reshape(num_features, batch, -1).transpose(1, 0, 2).reshape(batch, -1)


def torch_time(wl, sets, iters, reps):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    feats = wl.features()
    dt = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[wl.weights_dtype]
    weight = torch.randn(sum(e for e, _, _ in feats), wl.D, device="cuda", dtype=dt)
    table_off = np.concatenate([[0], np.cumsum([e for e, _, _ in feats])[:-1]])
    targs = []
    for idx, off, psw in sets:
        per_feature = np.diff(off[:: wl.B])  # ids per feature
        shifted = idx.astype(np.int64) + np.repeat(table_off, per_feature)
        targs.append((
            torch.from_numpy(shifted).cuda(),
            torch.from_numpy(off[:-1].astype(np.int64)).cuda(),
            torch.from_numpy(psw).to(dt).cuda() if psw is not None else None,
        ))

    def call(i, o, p):
        return torch.nn.functional.embedding_bag(i, weight, o, mode="sum", per_sample_weights=p)

    for a in targs:
        call(*a)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(iters):
            call(*targs[k % len(targs)])
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def run_workload(wl, args, configs, hist_configs):
    feats = wl.features()
    nf = len(feats)
    sets = common.make_sets(wl, args.sets, grad=False, device=False)
    # The bag-size hint is the workload's L: it lets small tables take the histogram path.
    tables = common.tables(wl)
    dev_sets = [tuple(None if x is None else jnp.asarray(x) for x in s) for s in sets]
    row = {"workload": dataclasses.asdict(wl), "bytes": wl.bytes_moved(), "variants": {}}

    base_emb = tbe_jax.TableBatchedEmbedding(
        tables, weights_dtype=wl.weights_dtype, output_dtype=wl.output_dtype, impl="xla")
    params = base_emb.init(jax.random.key(0))
    w = params[base_emb.layout.key(0)]
    table_offsets = jnp.asarray(np.asarray(base_emb.layout.table_row_offset, np.int32))

    # Correctness of every variant on the first set, against the XLA reference path.
    idx0, off0, psw0 = dev_sets[0]
    ref = np.asarray(jax.jit(lambda p, i, o, s: base_emb(p, i, o, s))(params, idx0, off0, psw0), np.float64)

    if len(params) == 1:
        xla_fn = jax.jit(lambda w, i, o, s: xla_baseline(w, table_offsets, i, o, s, nf, wl.B))
        xla_args = w
    else:  # mixed dims: the same take + segment_sum, once per dim (our reference path)
        xla_fn = jax.jit(lambda p, i, o, s: base_emb(p, i, o, s))
        xla_args = params
    xla_out = np.asarray(xla_fn(xla_args, idx0, off0, psw0), np.float64)
    row["xla_max_rel_err"] = float(np.abs(xla_out - ref).max() / np.abs(ref).max())
    row["xla_ms"] = time_calls(xla_fn, [(xla_args,) + s for s in dev_sets], args.iters, args.reps)

    variants = {name: (cfg, True, None, args.bounds_check) for name, cfg in configs.items()}
    if args.compare_bounds:  # the default config under each bounds mode, twice, interleaved (noise check)
        for rnd in (1, 2):
            for mode in ("none", "ignore"):
                variants[f"bounds:{mode}:{rnd}"] = (tbe_jax.ForwardConfig(), True, None, mode)
    probe = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=wl.weights_dtype, output_dtype=wl.output_dtype)
    row["plan"] = sorted(set(probe.plan(weighted=wl.weighted)))
    if "histogram" in row["plan"]:  # the generic kernel alone, in the same run, for the ratio
        variants["generic-only"] = (tbe_jax.ForwardConfig(), False, None, args.bounds_check)
        for name, hcfg in hist_configs.items():
            variants["hist:" + name] = (tbe_jax.ForwardConfig(), True, hcfg, args.bounds_check)
    for name, (cfg, use_hist, hcfg, bounds_check) in variants.items():
        emb = tbe_jax.TableBatchedEmbedding(
            tables, weights_dtype=wl.weights_dtype, output_dtype=wl.output_dtype, impl="pallas",
            bounds_check=bounds_check, kernel_config=cfg, use_histogram=use_hist, histogram_config=hcfg,
            interpret=common.interpret())  # CPU: smoke test only
        if args.with_report:  # warning mode without the host callback: counts returned on device
            fn = jax.jit(lambda p, i, o, s, emb=emb: emb.forward_with_report(p, i, o, s))
        else:
            fn = jax.jit(lambda p, i, o, s, emb=emb: emb(p, i, o, s))
        out = fn(params, idx0, off0, psw0)
        out = np.asarray(out[0] if args.with_report else out, np.float64)
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        ms = time_calls(fn, [(params,) + s for s in dev_sets], args.iters, args.reps)
        row["variants"][name] = {"config": dataclasses.asdict(cfg), "use_histogram": use_hist, "ms": ms,
                                 "bounds_check": bounds_check,
                                 "max_rel_err": err, "GBps": wl.bytes_moved() / ms / 1e6}
    best = min((k for k in row["variants"] if k != "generic-only" and not k.startswith("bounds:")),
               key=lambda k: row["variants"][k]["ms"])
    row["best"] = best
    row["ms"] = row["variants"][best]["ms"]
    row["GBps"] = wl.bytes_moved() / row["ms"] / 1e6
    row["vs_xla"] = row["xla_ms"] / row["ms"]
    if "generic-only" in row["variants"]:
        row["vs_generic"] = row["variants"]["generic-only"]["ms"] / row["ms"]
    fb = FBGEMM_FWD_KERNEL_MS.get(wl.name)
    row["fbgemm_kernel_ms"] = fb
    row["anchor_xla_ms"] = ANCHOR_XLA_FWD_MS.get(wl.name)
    row["vs_fbgemm"] = fb / row["ms"] if fb else None
    if not args.no_torch and len(params) == 1:  # embedding_bag needs one D
        tms = torch_time(wl, sets, args.iters, args.reps)
        row["torch_ms"] = tms
        row["vs_torch"] = tms / row["ms"] if tms else None
    del params, w, dev_sets
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks forward", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(testing.PRESETS), help="comma-separated preset names, or 'custom'")
    ap.add_argument("-T", type=int, default=32)
    ap.add_argument("-E", type=int, default=100_000)
    ap.add_argument("-D", type=int, default=128)
    ap.add_argument("--dims", default="", help="mixed dims, e.g. '32,64,128': the T tables take them round-robin")
    ap.add_argument("-B", type=int, default=4096)
    ap.add_argument("-L", type=int, default=20)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--weighted", action="store_true")
    ap.add_argument("--weights-dtype", default="float16")
    ap.add_argument("--output-dtype", default="float32")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="ForwardConfig variants as JSON objects, e.g. '{}' '{\"unroll\": 8}' (default: the defaults)")
    ap.add_argument("--hist-configs", nargs="*", default=[],
                    help="extra HistogramConfig variants (JSON objects) for presets with histogram features")
    ap.add_argument("--bounds-check", default="ignore", choices=["ignore", "none", "warning", "fatal"])
    ap.add_argument("--compare-bounds", action="store_true",
                    help="also time the default config with bounds_check 'none' and 'ignore' (interleaved, twice)")
    ap.add_argument("--with-report", action="store_true",
                    help="time emb.forward_with_report (no host callback) instead of emb(...)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)

    if args.presets == "custom":
        dims = tuple(int(d) for d in args.dims.split(",") if d)
        wls = [testing.Workload("custom", args.T, args.E, args.D, args.B, args.L, args.alpha, args.weighted,
                                args.weights_dtype, args.output_dtype, dims=dims)]
    else:
        wls = [common.workload(p) for p in args.presets.split(",")]
    configs = common.configs(args.configs, tbe_jax.ForwardConfig)
    hist_configs = common.configs(args.hist_configs, tbe_jax.HistogramConfig) if args.hist_configs else {}
    meta = common.meta(
        timing="enqueue --iters calls rotating over --sets input sets, block once, median of --reps",
        iters=args.iters, reps=args.reps, sets=args.sets, bounds_check=args.bounds_check,
        with_report=args.with_report)
    rows = []
    for wl in wls:
        rows.append(run_workload(wl, args, configs, hist_configs))
        r = rows[-1]
        print(f"{wl.name:11s} ours {r['ms']:.4f} ms ({r['GBps']:.0f} GB/s, {r['best']}) "
              f"xla {r['xla_ms']:.4f} torch {r.get('torch_ms') or float('nan'):.4f} "
              f"fbgemm {r['fbgemm_kernel_ms'] or float('nan'):.3f} | "
              + " ".join(f"{k}:{v['ms']:.4f}" for k, v in r["variants"].items()), flush=True)
    path = common.save("forward", {"meta": meta, "results": rows}, args.out)
    nan = float("nan")
    print("\n| preset | path | ours ms | GB/s | XLA ms | torch ms | FBGEMM kernel ms | vs XLA | vs FBGEMM "
          "| generic-only ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gen = r["variants"].get("generic-only", {}).get("ms", nan)
        print(f"| {r['workload']['name']} | {'+'.join(r['plan'])} | {r['ms']:.3f} | {r['GBps']:.0f} | "
              f"{r['xla_ms']:.3f} | {(r.get('torch_ms') or nan):.3f} | {r['fbgemm_kernel_ms'] or nan:.3f} | "
              f"{r['vs_xla']:.2f}x | {(r['vs_fbgemm'] or nan):.2f}x | {gen:.3f} |")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
