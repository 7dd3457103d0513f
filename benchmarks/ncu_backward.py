"""A few donated `apply_gradients` steps of one workload, for Nsight Compute (no profiler of our own).

    ncu --clock-control none -k regex:tbe_backward_small_runs -c 8 --section ... \
        python3 -m benchmarks ncu_backward --workload dims4-128/4

`--workload` is a preset name or a mixed-dim model `dimsLO-HI/STEP` (base's tables with those
dims cycled, as `python -m benchmarks trace_backward --dims`). `--config` is a JSON object of BackwardConfig fields.
"""

from __future__ import annotations

import argparse
import functools

import jax

import tbe_jax
from benchmarks import common
from benchmarks.common import EPS, LR, make_sets, with_opt


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks ncu_backward", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="base")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--config", default="", help='BackwardConfig fields as JSON, e.g. \'{"narrow_block": 16}\'')
    args = ap.parse_args(argv)
    wl = common.workload(args.workload)
    sets = make_sets(wl, 1)
    emb = tbe_jax.TableBatchedEmbedding(common.tables(wl), impl="pallas", weights_dtype=wl.weights_dtype,
                                        output_dtype=wl.output_dtype,
                                        backward_config=common.config(args.config, tbe_jax.BackwardConfig),
                                        interpret=common.interpret())
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
