"""Which kernel path pays, and what a jitted call costs the host.

`--sweep`: the histogram path (counts x table) against the generic path (row
gathers; sorted runs in the backward) on single small tables over bag lengths,
table sizes and batch sizes: forward (`emb(...)`) and the fused row-wise Adagrad
step (`apply_gradients`, donated), each timed enqueued (calls back to back, one
block, median of `--reps`). This is the evidence for the static rule that sends
small tables to the histogram path without a `bag_size_hint`.

`--dispatch`: for presets built from default `TableSpec`s (no `bag_size_hint`),
the forward's enqueued ms per call, the host time per call (enqueue only, no
block), and the device time from a profiler trace (sum of kernel events per
call), so the launch overhead is visible; then the same for the fused row-wise
Adagrad step (`apply_gradients`, donated); ratios to FBGEMM's kernel times.

Results go to benchmarks/results/paths-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from benchmarks import common
from benchmarks.common import FBGEMM_BWD_KERNEL_MS, FBGEMM_FWD_KERNEL_MS, device_events, time_calls, time_chain
from tbe_jax import testing


def _sets(num_rows, batch, bag_len, n_sets, dim, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_sets):
        idx, off, _ = testing.make_batch(rng, [num_rows], [batch], bag_len)
        g = rng.standard_normal((batch, dim), dtype=np.float32)
        out.append((jnp.asarray(idx), jnp.asarray(off), jnp.asarray(g)))
    return out


def sweep_one(num_rows, dim, batch, bag_len, args):
    sets = _sets(num_rows, batch, bag_len, args.sets, dim)
    opt = tbe_jax.RowwiseAdagrad(0.1, 0.1)
    row = {"E": num_rows, "D": dim, "B": batch, "L": bag_len}
    ref = None
    for name, hint, use_hist in (("histogram", 1 << 20, True), ("generic", None, False)):
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(num_rows, dim, bag_size_hint=hint)],
                                            weights_dtype=jnp.float16, use_histogram=use_hist,
                                            interpret=common.interpret())
        assert emb.plan() == (name,), (name, emb.plan())
        params = emb.init(jax.random.key(0))
        fwd = jax.jit(lambda p, i, o, emb=emb: emb(p, i, o))
        out = np.asarray(fwd(params, *sets[0][:2]), np.float64)
        if ref is None:
            ref = out
        else:
            row["fwd_max_rel_err"] = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        row[f"{name}_fwd_ms"] = time_calls(fwd, [(params,) + s[:2] for s in sets], args.iters, args.reps)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(carry, i, o, g, emb=emb):
            p, st = carry
            return emb.apply_gradients(p, st, opt, i, o, g)

        carry = (params, emb.init_opt_state(params, opt))
        row[f"{name}_bwd_ms"], _ = time_chain(step, carry, list(sets), args.iters, args.reps, warmups=2)
    row["fwd_hist_speedup"] = row["generic_fwd_ms"] / row["histogram_fwd_ms"]
    row["bwd_hist_speedup"] = row["generic_bwd_ms"] / row["histogram_bwd_ms"]
    print(json.dumps(row), flush=True)
    return row


def _device_ms(fn, carry_or_args, iters, chain):
    """Device time per call from a profiler trace: the sum of the kernel events."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            if chain:
                step, carry, arg_sets = carry_or_args
                for i in range(iters):
                    carry = step(carry, *arg_sets[i % len(arg_sets)])
                jax.block_until_ready(carry)
            else:
                out = None
                for i in range(iters):
                    out = fn(*carry_or_args[i % len(carry_or_args)])
                jax.block_until_ready(out)
        ev = device_events(d)
    per = {}
    for e in ev:
        per[e["name"]] = per.get(e["name"], 0.0) + e["dur"] / 1e3 / iters
    return sum(per.values()), per, (carry if chain else None)


def host_ms(fn, arg_sets, iters, reps):
    """Median host ms per call: `iters` calls enqueued without blocking in between (block after)."""
    samples = []
    for _ in range(reps):
        jax.block_until_ready(fn(*arg_sets[0]))
        t0 = time.perf_counter()
        outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(iters)]
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
        jax.block_until_ready(outs)
    return statistics.median(samples)


def dispatch_one(preset, args):
    """A preset with default `TableSpec`s (no hints: what a user gets): the forward's enqueued ms, host
    ms per call and profiler kernel ms; the fused row-wise Adagrad step's enqueued and kernel ms."""
    wl = testing.PRESETS[preset]
    feats = wl.features()
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(args.sets):
        idx, off, psw = testing.make_batch(rng, [e for e, _, _ in feats], [wl.B] * len(feats),
                                           [l for _, _, l in feats], alpha=wl.alpha, weighted=wl.weighted)
        g = rng.standard_normal((wl.B, sum(d for _, d, _ in feats)), dtype=np.float32)
        sets.append(tuple(None if x is None else jnp.asarray(x) for x in (idx, off, psw, g)))
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d, _ in feats],
                                        weights_dtype=wl.weights_dtype, output_dtype=wl.output_dtype)
    params = emb.init(jax.random.key(0))
    fn = jax.jit(lambda p, i, o, s: emb(p, i, o, s))
    arg_sets = [(params,) + s[:3] for s in sets]
    row = {"preset": preset, "plan": sorted(set(emb.plan(weighted=wl.weighted))),
           "backward_plan": sorted(set(emb.plan(weighted=wl.weighted, backward=True)))}
    row["enqueued_ms"] = time_calls(fn, arg_sets, args.iters, args.reps)
    row["host_ms_per_call"] = host_ms(fn, arg_sets, args.iters, args.reps)
    # JAX's own floor: a jitted one-op function of the same arguments, enqueued the same way.
    row["jax_floor_host_ms_per_call"] = host_ms(jax.jit(lambda p, i, o, s: i[:8] + o[:8]), arg_sets,
                                                args.iters, args.reps)
    row["kernel_ms"], row["kernels"], _ = _device_ms(fn, arg_sets, args.iters, False)
    row["enqueued_over_kernel"] = row["enqueued_ms"] / row["kernel_ms"] if row["kernel_ms"] else None
    fb = FBGEMM_FWD_KERNEL_MS.get(preset)
    if fb:
        row["fwd_vs_fbgemm_enqueued"] = fb / row["enqueued_ms"]
        row["fwd_vs_fbgemm_kernel"] = fb / row["kernel_ms"] if row["kernel_ms"] else None
    if not args.no_backward:
        opt = tbe_jax.RowwiseAdagrad(0.1, 0.1)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(carry, i, o, s, g):
            p, st = carry
            return emb.apply_gradients(p, st, opt, i, o, g, s)

        carry = (params, emb.init_opt_state(params, opt))
        del params, arg_sets
        bsets = [s for s in sets]
        row["bwd_enqueued_ms"], carry = time_chain(step, carry, bsets, args.iters, args.reps, warmups=2)
        row["bwd_kernel_ms"], row["bwd_kernels"], carry = _device_ms(None, (step, carry, bsets), args.iters, True)
        fb = FBGEMM_BWD_KERNEL_MS.get(preset)
        if fb:
            row["bwd_vs_fbgemm_enqueued"] = fb / row["bwd_enqueued_ms"]
            row["bwd_vs_fbgemm_kernel"] = fb / row["bwd_kernel_ms"] if row["bwd_kernel_ms"] else None
        del carry
    print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "bwd_kernels")}), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks paths", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--dispatch", default="", help="comma-separated presets (default TableSpecs: no hints)")
    ap.add_argument("--no-backward", action="store_true", help="--dispatch: the forward only")
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--batches", default="4096,65536")
    ap.add_argument("--bags", default="1,4,16,64,128")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)
    res = {"meta": common.meta(), "gpu": jax.devices()[0].device_kind, "args": vars(args), "sweep": [],
           "dispatch": []}
    if args.sweep:
        for e in map(int, args.rows.split(",")):
            for d in map(int, args.dims.split(",")):
                for b in map(int, args.batches.split(",")):
                    for l in map(int, args.bags.split(",")):
                        res["sweep"].append(sweep_one(e, d, b, l, args))
    for p in filter(None, args.dispatch.split(",")):
        res["dispatch"].append(dispatch_one(p, args))
    print("saved", common.save("paths", res, args.out))


if __name__ == "__main__":
    main()
