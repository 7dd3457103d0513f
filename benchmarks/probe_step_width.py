"""Probe: does any compiled backward case fail with `BackwardConfig.step_width`? (Session 54: with 128 as the
default, 97 of 197 backward tests failed compiled on an H100 with a jax runtime error whose text was cut, while
20 probe shards and 20 fuzz cases with it ran and agreed. That pytest run had 8 workers without
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, each preallocating most of the GPU's memory: the likely cause. In interpret
mode, every load's and store's index checked against its ref's shape, the failing test's case reads nothing out
of bounds.)

  python -m benchmarks probe_step_width --out probe-step-width-diag.json

Each case (the failing test's tables and batch, then one factor changed at a time: prefetch, weights, pooling,
dtype, widths, `step_width`) runs in a process of its own (a GPU fault poisons the process), compiled, against
the XLA path's update; the JSON keeps each case's status and the first lines of its error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

CASES = [
    dict(name="test_case", dims=[8, 16], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=128),
    dict(name="step_width_0", dims=[8, 16], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=0),
    dict(name="no_prefetch", dims=[8, 16], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=128,
         prefetch=False),
    dict(name="unweighted_sum", dims=[8, 16], rows=[3, 300], pooling="sum", weighted=False, dtype="float32", sw=128),
    dict(name="unweighted_sum_0", dims=[8, 16], rows=[3, 300], pooling="sum", weighted=False, dtype="float32",
         sw=0),
    dict(name="fp16", dims=[8, 16], rows=[3, 300], pooling="mean", weighted=True, dtype="float16", sw=128),
    dict(name="dim8", dims=[8, 8], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=128),
    dict(name="dim16", dims=[16, 16], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=128),
    dict(name="dim4", dims=[4, 4], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=128),
    dict(name="sw32", dims=[8, 16], rows=[3, 300], pooling="mean", weighted=True, dtype="float32", sw=32),
    dict(name="no_long_runs", dims=[8, 16], rows=[300, 300], pooling="mean", weighted=True, dtype="float32",
         sw=128),
]


def run_case(case: dict) -> None:
    import jax
    import numpy as np

    import tbe_jax

    rng = np.random.default_rng(0)
    tables = [tbe_jax.TableSpec(r, d) for r, d in zip(case["rows"], case["dims"])]
    lengths = np.concatenate([rng.multinomial(900, [0.25] * 4), rng.multinomial(600, [0.25] * 4)])
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = np.concatenate([rng.integers(0, case["rows"][0], 900),
                          rng.integers(0, case["rows"][1], 600)]).astype(np.int32)
    psw = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32) if case["weighted"] else None
    g = rng.standard_normal((4, sum(case["dims"]))).astype(np.float32)
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-2)
    cfg = tbe_jax.BackwardConfig(step_width=case["sw"], prefetch=case.get("prefetch"))
    kw = dict(pooling=case["pooling"], weights_dtype=case["dtype"], pad_rows=False)
    emb = tbe_jax.TableBatchedEmbedding(tables, backward_config=cfg, impl="pallas",
                                        interpret=jax.default_backend() != "gpu", **kw)
    ref = tbe_jax.TableBatchedEmbedding(tables, impl="xla", **kw)
    params = ref.init(jax.random.key(2))
    state = ref.init_opt_state(params, opt)
    got = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g, psw))(params, state)
    want = ref.apply_gradients(params, state, opt, idx, off, g, psw)
    err = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
              for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    print(json.dumps({"max_abs_err": err}))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_step_width", description=__doc__)
    ap.add_argument("--case", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.case >= 0:
        run_case(CASES[args.case])
        return
    rows = []
    for i, case in enumerate(CASES):
        try:
            p = subprocess.run([sys.executable, "-m", "benchmarks", "probe_step_width", "--case", str(i)],
                               capture_output=True, text=True, timeout=args.timeout)
            ok = p.returncode == 0
            tail = p.stdout.strip().splitlines()[-1:] if ok else [
                ln for ln in p.stderr.splitlines() if "Warning" not in ln][-30:]
        except subprocess.TimeoutExpired:
            ok, tail = False, ["timeout"]
        rows.append({**case, "ok": ok, "tail": tail})
        print(json.dumps({"name": case["name"], "ok": ok, "tail": tail[-3:]}), flush=True)
        if args.out:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": rows},
                      open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
