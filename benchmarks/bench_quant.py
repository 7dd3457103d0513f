"""Our quantized inference TBE (`tbe_jax.quantize`) timed on the cases `benchmarks/fbgemm_quant.py --time` times
FBGEMM's IntNBit forward on (the same workloads, batch sizes, sweep shards and inputs), and compared with it.

    python -m benchmarks bench_quant [--weight-types int8,int4,float16] [--shards N] [--fbgemm FBGEMM.json]
        --out FILE.json

Per case (sum pooling, float32 output as the anchors, bounds check "none" as FBGEMM's NONE): the device time per
call (`jax.profiler`: the kernels' time, `device_ms`), the wall time per call of calls enqueued back to back
(`enqueued_ms`), the latency of one call including dispatch (a jitted call and `block_until_ready`, median;
`latency_ms`), the int4 byte floor (bytes of the rows looked up + the output at `--hbm-gbs`), and with
`--fbgemm` the ratios FBGEMM kernel ms / ours device ms and FBGEMM latency / ours latency. Tables: each table's
rows drawn by `TableBatchedEmbedding.init` (uniform), quantized by `tbe_jax.quantize`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, fbgemm_quant


def _latency_ms(run, calls: int) -> float:
    samples = []
    for k in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(run(k))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def byte_floor_ms(case, wt: str, indices: np.ndarray, hbm_gbs: float) -> float:
    """ms to read every looked-up row's stored bytes (FBGEMM's row format) and write the fp32 output."""
    from tbe_jax import quant_format

    rb = [quant_format.row_bytes(d, wt) for d in case.dims]
    # lookups per table: the bag lengths' mean times B (the inputs' own counts would need the offsets per table)
    nbytes = sum(r * b * case.B for r, b in zip(rb, case.bags)) + 4 * case.B * sum(case.dims)
    nbytes = nbytes * indices.shape[0] / max(1.0, sum(b * case.B for b in case.bags))
    return nbytes / (hbm_gbs * 1e9) * 1e3


def forward_config(text: str):
    """`tbe_jax.ForwardConfig` from `"field=value,field=value"` (ints, or strings such as `fp32_accumulation=twosum`;
    empty: the default)."""
    import tbe_jax

    fields = dict(kv.split("=") for kv in text.split(",") if kv)
    return tbe_jax.ForwardConfig(**{k: int(v) if v.lstrip("-").isdigit() else v for k, v in fields.items()})


def time_cases(args) -> dict:
    import tbe_jax

    workloads = [w for w in args.workloads.split(",") if w]
    cases = fbgemm_quant.workload_cases(workloads, [int(b) for b in args.batch_sizes.split(",") if b]) \
        + fbgemm_quant.shard_cases(args.shards, args.shard_seed)
    results = []
    configs = args.configs.split(";") if args.configs else [""]
    key = None
    for wt, config, case in ((w, c, k) for w in args.weight_types.split(",") for k in cases for c in configs):
        res = {"case": case.name, "wt": wt, "B": case.B, "T": len(case.rows), "dims": sorted(set(case.dims)),
               "rows": sum(case.rows), "mean_bag": round(float(np.mean(case.bags)), 2)}
        if config:
            res["config"] = config
        try:
            if key != (case.rows, case.dims, wt, config):
                qemb = qparams = None
                specs = [tbe_jax.TableSpec(e, d) for e, d in zip(case.rows, case.dims)]
                emb = tbe_jax.TableBatchedEmbedding(specs, bounds_check="none")
                params = emb.init(jax.random.key(0))
                qemb, qparams = tbe_jax.quantize(emb, params, wt, output_dtype=jnp.float32,
                                                 kernel_config=forward_config(config))
                del params
                key = (case.rows, case.dims, wt, config)
            sets = []
            for k in range(2):
                i, o, w = fbgemm_quant.case_inputs(case, k)
                sets.append((jnp.asarray(i, jnp.int32), jnp.asarray(o, jnp.int32),
                             None if w is None else jnp.asarray(w)))
            fwd = jax.jit(lambda q, i, o, w, qemb=qemb: qemb(q, i, o, w))

            def run(k, fwd=fwd, sets=sets, q=qparams):
                return fwd(q, *sets[k % 2])

            jax.block_until_ready([run(k) for k in range(3)])
            res["device_ms"] = round(common.device_ms(run, args.iters)[0], 5)
            res["enqueued_ms"] = round(common.enqueued_ms(run, args.iters, args.reps), 5)
            res["latency_ms"] = round(_latency_ms(run, args.iters), 5)
            if wt == "int4":
                res["floor_ms"] = round(byte_floor_ms(case, wt, np.asarray(sets[0][0]), args.hbm_gbs), 7)
        except Exception as exc:  # noqa: BLE001
            res["error"] = f"{type(exc).__name__}: {exc}"[:400]
        results.append(res)
        times = (f"device {res['device_ms']:.4f} ms  enqueued {res['enqueued_ms']:.4f}  latency {res['latency_ms']:.4f}"
                 if "error" not in res else res["error"][:200])
        print(f"{wt:>7} {case.name:<22} {config} " + times, flush=True)
    return {"results": results, "output_dtype": "float32", "bounds_check": "none", "pooling": "sum",
            "iters": args.iters, "reps": args.reps, "hbm_gbs": args.hbm_gbs}


def with_fbgemm(ours: dict, fbgemm: dict) -> dict:
    """Ratios per (case, weight type) present on both sides, and their summary per weight type."""
    theirs = {(r["case"], r["wt"]): r for r in fbgemm["results"] if "error" not in r}
    rows = []
    for r in ours["results"]:
        t = theirs.get((r["case"], r["wt"]))
        if t is None or "error" in r:
            continue
        row = {"case": r["case"], "wt": r["wt"], "B": r["B"], "ours_device_ms": r["device_ms"],
               "fbgemm_kernel_ms": t["kernel_ms"], "ratio": t["kernel_ms"] / r["device_ms"],
               "ours_latency_ms": r["latency_ms"], "fbgemm_latency_ms": t["latency_ms"],
               "latency_ratio": t["latency_ms"] / r["latency_ms"]}
        if r.get("floor_ms"):  # (0 where rounding took a B = 1 case's floor below 1e-5 ms)
            row["floor_ratio"] = r["device_ms"] / r["floor_ms"]
        rows.append(row)
    summary = {}
    for wt in sorted({r["wt"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["wt"] == wt]
        summary[wt] = {"cases": len(ratios), "median": statistics.median(ratios), "min": min(ratios),
                       "share_ge_1": sum(x >= 1 for x in ratios) / len(ratios),
                       "share_ge_1.3": sum(x >= 1.3 for x in ratios) / len(ratios),
                       "worst": sorted((round(r["ratio"], 3), r["case"]) for r in rows if r["wt"] == wt)[:5]}
    return {"rows": rows, "summary": summary}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=fbgemm_quant.WORKLOADS)
    ap.add_argument("--batch-sizes", default=fbgemm_quant.BATCH_SIZES)
    ap.add_argument("--weight-types", default="int8,int4,float16")
    ap.add_argument("--shards", type=int, default=0)
    ap.add_argument("--shard-seed", type=int, default=20261202)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hbm-gbs", type=float, default=4000.0, help="the measured HBM copy bandwidth (GB/s)")
    ap.add_argument("--configs", default="", help="ForwardConfig variants to time, e.g. "
                    "'row_tile_bytes=1024;unroll=8,num_warps=2' (';' between variants; empty: the default)")
    ap.add_argument("--fbgemm", default="", help="fbgemm_quant --time's JSON: add the ratios")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    res = {"bench": "bench_quant", "meta": common.meta(), "ours": time_cases(args)}
    if args.fbgemm:
        with open(args.fbgemm) as fh:
            fb = json.load(fh)
        res["fbgemm"] = fb
        res["compare"] = with_fbgemm(res["ours"], fb.get("time", fb))
        for wt, s in res["compare"]["summary"].items():
            print(f"{wt}: median {s['median']:.2f}x FBGEMM over {s['cases']} cases, min {s['min']:.2f}x, "
                  f">=1.3x {100 * s['share_ge_1.3']:.0f}%; worst {s['worst']}", flush=True)
    path = common.save("quant", res, args.out)
    print(f"saved {path}")
    return res


if __name__ == "__main__":
    main()
