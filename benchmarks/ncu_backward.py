"""A few donated `apply_gradients` steps of one workload, for Nsight Compute (no profiler of our own).

    ncu --clock-control none -k regex:tbe_backward_small_runs -c 8 --section ... \
        python3 benchmarks/ncu_backward.py --workload dims4-128/4

`--workload` is a preset name or a mixed-dim model `dimsLO-HI/STEP` (base's tables with those
dims cycled, as `trace_backward.py --dims`). `--private K=V,...` sets module constants of
`tbe_jax.kernels.backward*` or `tbe_jax._pallas` (A/B switches) before anything compiles.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import tbe_jax  # noqa: E402
from bench_backward import EPS, LR, make_sets, with_opt  # noqa: E402
from trace_backward import backward_modules, set_private, workload  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="base")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--private", default="")
    args = ap.parse_args()
    set_private(args.private, backward_modules())
    wl = workload(args.workload)
    sets = make_sets(wl, 1)
    tables = [tbe_jax.TableSpec(e, d, bag_size_hint=l) for e, d, l in wl.features()]
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", weights_dtype=wl.weights_dtype,
                                        output_dtype=wl.output_dtype)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=LR, eps=EPS)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(carry, opt, i, o, s, g):
        return emb.apply_gradients(*carry, opt, i, o, g, s)

    carry = (params, state)
    (a,) = with_opt(opt, sets)
    for _ in range(args.steps):
        carry = step(carry, *a)
    jax.block_until_ready(carry)
    print("done", args.workload)


if __name__ == "__main__":
    main()
