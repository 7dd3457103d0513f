"""Issue 40 probe: can the host's CPUs gather a step's missed rows fast enough, and how fast does a contiguous
staging buffer cross the bus with `jax.device_put` (PJRT's transfer stream, beside the compute stream)?

    python -m benchmarks probe_cpu_gather --rows 4000000 --dim 128 --out results/probe-cpu-gather-....json

For each row count (the missed rows of a step: ~59k at alpha 1.2, ~204k at alpha 1.05, lf 0.2; NOTES session 43)
and each thread count: `numpy.take` of random rows of an fp16 table into a preallocated buffer, the ids split
over Python threads (numpy releases the GIL inside `take`), best of `--reps`. Then `jax.device_put` of the gathered
buffer (pageable host memory) to the first device, blocked, and a scatter back (`table[ids] = rows`) on the same
threads. Nothing here runs in a jitted step: it measures the pieces of a design before building it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import time

import numpy as np


def _split(n, parts):
    b = np.linspace(0, n, parts + 1).astype(np.int64)
    return [(int(b[i]), int(b[i + 1])) for i in range(parts)]


def _timed(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--missed", default="59000,204000")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-device", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((args.rows, args.dim), dtype=np.float32).astype(np.float16)
    row_bytes = table.strides[0]
    threads = [t for t in (int(x) for x in args.threads.split(",")) if t <= (os.cpu_count() or 1)]
    result = {"probe": "cpu_gather", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), "rows": args.rows, "dim": args.dim, "row_bytes": row_bytes, "cases": []}
    dev = None
    if not args.no_device:
        import jax
        dev = jax.devices()[0]
        result["device"] = dev.device_kind
        result["jax"] = jax.__version__
    for m in (int(x) for x in args.missed.split(",")):
        ids = np.sort(rng.integers(0, args.rows, m)).astype(np.int64)
        out = np.empty((m, args.dim), table.dtype)
        mb = m * row_bytes / 1e6
        for t in threads:
            parts = _split(m, t)
            with cf.ThreadPoolExecutor(t) as pool:
                def gather():
                    list(pool.map(lambda p: np.take(table, ids[p[0]:p[1]], axis=0, out=out[p[0]:p[1]]), parts))

                def scatter():
                    def one(p):
                        table[ids[p[0]:p[1]]] = out[p[0]:p[1]]
                    list(pool.map(one, parts))
                g = _timed(gather, args.reps)
                s = _timed(scatter, args.reps)
            case = {"missed": m, "mb": round(mb, 2), "threads": t, "gather_ms": round(g, 3),
                    "gather_gbps": round(mb / g, 2), "scatter_ms": round(s, 3), "scatter_gbps": round(mb / s, 2)}
            print(json.dumps(case), flush=True)
            result["cases"].append(case)
        if dev is not None:
            import jax
            jax.device_put(out, dev).block_until_ready()
            p = _timed(lambda: jax.device_put(out, dev).block_until_ready(), args.reps)
            h = float("inf")
            for _ in range(args.reps):  # a fresh array each time: device_get caches its numpy copy
                y = jax.device_put(out, dev)
                y.block_until_ready()
                t0 = time.perf_counter()
                np.asarray(jax.device_get(y))
                h = min(h, (time.perf_counter() - t0) * 1e3)
            case = {"missed": m, "mb": round(mb, 2), "device_put_ms": round(p, 3), "h2d_gbps": round(mb / p, 2),
                    "device_get_ms": round(h, 3), "d2h_gbps": round(mb / h, 2)}
            print(json.dumps(case), flush=True)
            result["cases"].append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
