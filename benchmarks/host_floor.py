"""Issue 40: the bus floor of a `"host_cached"` training step, before any kernel runs (METHOD: count bytes first).

For `host_cache`'s model (T tables of E rows, D dims, B bags of L ids a table, Zipf(alpha) ids: P(rank r) ~
(r + 1)^-alpha, as `tbe_jax.testing.sample_ids` draws them), the best a cache of `lf * E` rows a table can do
for independent draws is to hold each table's most likely rows (no policy beats it in expectation). What it
leaves:

- lookups that miss (`1 - hit`), and the distinct rows behind them in one batch (each crosses the bus at least
  once a step, host -> HBM, to be looked up; its updated value and state cross back, now or at its eviction:
  in steady state as many rows leave a full cache as enter it);
- so at least `rows * (row + state bytes)` each way a step. At the bus's rate (`--bus-gbs`, what
  `probe_copy_rows` measured for rows in host order) that is a time no design goes under: added to the all-HBM
  step if the copies run between the step's kernels, or `max(step, bus)` if they run beside them.

    python -m benchmarks host_floor --all-hbm-ms 0.669 0.567   # one all-HBM step per alpha, measured
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import common


def floor(rows: int, draws: int, alpha: float, lf: float) -> dict:
    """One table: the best static cache's lookup hit rate and the expected distinct missed rows of a batch of
    `draws` ids."""
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    k = int(lf * rows)
    tail = p[k:]
    return {"hit": float(1.0 - tail.sum()), "missed_lookups": float(tail.sum() * draws),
            "missed_rows": float(-np.expm1(draws * np.log1p(-tail)).sum()),
            "distinct_rows": float(-np.expm1(draws * np.log1p(-p)).sum())}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks host_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--row-bytes", type=int, default=2, help="bytes of a row's element (fp16: 2)")
    ap.add_argument("--state-bytes", type=int, default=4, help="a row's optimizer state (row-wise Adagrad: 4)")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--bag", type=int, default=20)
    ap.add_argument("--alphas", type=float, nargs="*", default=[1.05, 1.2])
    ap.add_argument("--load-factors", type=float, nargs="*", default=[0.2, 0.05])
    ap.add_argument("--bus-gbs", type=float, default=50.0,
                    help="GB/s each way for rows in host order (probe_copy_rows, H100: 45-51)")
    ap.add_argument("--all-hbm-ms", type=float, nargs="*", default=[],
                    help="the all-HBM step's ms, one per alpha (a measured result), for the ratios")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    draws = args.batch * args.bag
    row_b = args.dim * args.row_bytes + args.state_bytes
    results = []
    for i, alpha in enumerate(args.alphas):
        step = args.all_hbm_ms[i] if i < len(args.all_hbm_ms) else None
        for lf in args.load_factors:
            f = floor(args.rows, draws, alpha, lf)
            rows = f["missed_rows"] * args.tables
            mb = rows * row_b / 1e6
            bus_ms = mb / 1e3 / args.bus_gbs * 1e3
            r = {"alpha": alpha, "load_factor": lf, "best_lookup_hit": f["hit"],
                 "missed_lookups_per_step": f["missed_lookups"] * args.tables, "missed_rows_per_step": rows,
                 "distinct_rows_per_step": f["distinct_rows"] * args.tables, "bus_mb_each_way": mb,
                 "bus_ms": bus_ms}
            if step:
                r.update(all_hbm_ms=step, floor_serial_x=(step + bus_ms) / step,
                         floor_overlapped_x=max(step, bus_ms) / step)
            results.append(r)
            print(f"alpha {alpha} lf {lf}: best lookup hit {f['hit']:.4f}, missed rows {rows / 1e3:.0f}k a step "
                  f"({mb:.1f} MB each way, {bus_ms:.3f} ms at {args.bus_gbs:g} GB/s)" +
                  (f"; floor {r['floor_serial_x']:.2f}x the all-HBM step in series, "
                   f"{r['floor_overlapped_x']:.2f}x overlapped" if step else ""), flush=True)
    print("saved", common.save("host-floor", {"meta": common.meta(), "config": vars(args), "results": results},
                               args.out))


if __name__ == "__main__":
    main()
