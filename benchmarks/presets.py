"""The anchors' presets, forward then backward: `python -m benchmarks presets` (what `make bench` runs).

Runs `python -m benchmarks forward` (ours, the XLA baseline, torch where installed, FBGEMM's anchor times) and then
`python -m benchmarks backward` (apply_gradients, the training step, the XLA baseline) on the same presets, each
saving its own result (`forward-<stamp>-<gpu>.json`, `backward-<stamp>-<gpu>.json`). For more options run those
suites directly. On a CPU: `--presets tiny --iters 1 --reps 1 --sets 1` checks the plumbing (interpret mode).
"""

from __future__ import annotations

import argparse

ANCHORS = "base,zipf,weighted,large,fp32,smalltable"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks presets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=ANCHORS)
    ap.add_argument("--iters", type=int, default=None, help="both suites (default: theirs, 50 and 20)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--sets", type=int, default=None)
    ap.add_argument("--only", choices=("", "forward", "backward"), default="")
    ap.add_argument("--no-torch", action="store_true", help="forward: no torch embedding_bag")
    ap.add_argument("--no-xla", action="store_true", help="backward: no XLA baseline")
    ap.add_argument("--scaling", action="store_true", help="backward: also the flat-with-E run")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    common = ["--presets", args.presets] + (["--out", args.out] if args.out else [])
    for k in ("iters", "reps", "sets"):
        if getattr(args, k) is not None:
            common += [f"--{k}", str(getattr(args, k))]
    if args.only in ("", "forward"):
        from benchmarks import bench_forward

        bench_forward.main(common + (["--no-torch"] if args.no_torch else []))
    if args.only in ("", "backward"):
        from benchmarks import bench_backward

        bench_backward.main(common + (["--no-xla"] if args.no_xla else []) + (["--scaling"] if args.scaling else []))


if __name__ == "__main__":
    main()
