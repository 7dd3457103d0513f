"""TBE backward benchmark: the sorted-run backward with row-wise Adagrad on the looked-up rows.

For each preset (tbe_jax.testing.PRESETS, the anchors' workloads):
- "bwd": `emb.apply_gradients` alone (linearise, sort, run-length encode, the
  short/long-run kernels, the row-wise Adagrad update), on donated tables.
- "fwd+bwd": a training step through `tbe_jax.train_step` (forward kernel, the
  gradient of the loss with respect to the lookup's output, then the backward
  above; with `BackwardConfig.sort_in_forward` the sort runs in the forward and
  the update reuses it); "bwd (step)" is that minus the forward, which is how the
  anchors derive FBGEMM's "bwd". The optimizer is an ordinary argument of the
  jitted step (its hyperparameters are run-time values).
- the XLA baseline of the anchors, in the same process: forward (take +
  segment_sum), `jax.vjp` to a dense gradient, a dense row-wise Adagrad over
  every row.
Timing (launch overhead excluded, as the anchors' "kernels" column): after
warm-up, `--iters` steps enqueued back to back, each feeding the updated tables
and state to the next (donated), rotating over `--sets` input sets, block once;
median of `--reps`. Optimizer as the anchors: lr 0.1, eps 0.1.

`--scaling` adds the flat-with-E run: fixed lookups, table rows growing 100x;
the training step must not grow with E (no per-step work proportional to tables).

Results go to benchmarks/results/backward-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from benchmarks import common
from benchmarks.bench_forward import xla_baseline  # the same baseline
from benchmarks.common import (EPS, FBGEMM_BWD_KERNEL_MS, FBGEMM_FWD_KERNEL_MS, LR, make_sets, time_calls,
                               time_chain, with_opt)
from tbe_jax import dispatch, testing


def _loss(out, g):
    """sum(out * g) plus a small quadratic term, so the output gradient depends on the forward.

    With sum(out * g) alone the gradient is g whatever the forward computes, and XLA
    removes the forward kernel from a step that only returns gradients (an earlier run
    of this script timed such steps: its "fwd+bwd" equalled its "bwd").
    """
    return jnp.sum(out * g) + 5e-4 * jnp.sum(out * out)


def sparse_train_step(emb):
    """A jitted training step through `tbe_jax.train_step`: `step((tables, state), opt, indices, offsets,
    per_sample_weights, g) -> (tables, state)`, the carry donated, the optimizer an ordinary argument."""

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(carry, opt, i, o, s, g):
        params, state = carry
        res = tbe_jax.train_step(lambda _, out: _loss(out, g), None,
                                 tbe_jax.SparseLookup(emb, opt, params, state, i, o, s))
        return res.params, res.opt_state

    return step


def xla_step(carry, indices, offsets, psw, g, *, fwd):
    """XLA baseline training step: forward, vjp to a dense gradient, dense row-wise Adagrad."""
    w, m = carry
    # The gradient in fp32 (an fp16 scatter-add of Zipf ids serialises on atomics).
    _, vjp = jax.vjp(lambda w32: fwd(w32, indices, offsets, psw), w.astype(jnp.float32))
    (dw,) = vjp(g)
    m = m + jnp.mean(dw * dw, axis=1)
    w = (w.astype(jnp.float32) - LR * dw / (jnp.sqrt(m)[:, None] + EPS)).astype(w.dtype)
    return w, m


def unique_rows(wl, sets):
    """Distinct (table, row) pairs per batch, averaged: the floor's row count (sorted on the device)."""
    feats = wl.features()
    row0 = jnp.asarray(np.concatenate([[0], np.cumsum([e for e, _, _ in feats])[:-1]]).astype(np.int32))

    dims = jnp.asarray(np.asarray([d for _, d, _ in feats], np.int32))

    @jax.jit
    def count(idx, off):
        feat = jnp.minimum(jnp.searchsorted(off[:: wl.B], jnp.arange(idx.shape[0]), side="right",
                                            method="scan_unrolled") - 1, len(feats) - 1)
        k, f = jax.lax.sort((row0[feat] + idx, feat), num_keys=1)
        first = jnp.concatenate([jnp.ones((1,), bool), k[1:] != k[:-1]])
        return jnp.sum(first), jnp.sum(jnp.where(first, dims[f], 0))

    counts = [tuple(int(c) for c in count(idx, off)) for idx, off, _, _ in sets]
    return float(np.mean([c[0] for c in counts])), float(np.mean([c[1] for c in counts]))


def fbgemm_ratios(row: dict, wl) -> dict:
    """FBGEMM's anchor times and our ratios to them into `row` (needs `bwd_ms`, `fwd_bwd_ms`); a non-anchor gets
    `fbgemm_estimate` and its ratio instead."""
    fb, ff = FBGEMM_BWD_KERNEL_MS.get(wl.name), FBGEMM_FWD_KERNEL_MS.get(wl.name)
    row["fbgemm_bwd_ms"], row["fbgemm_fwd_ms"] = fb, ff
    if fb:
        row["vs_fbgemm_bwd"] = fb / row["bwd_ms"]
        row["vs_fbgemm_fwd_bwd"] = (fb + ff) / row["fwd_bwd_ms"]
    else:
        row["fbgemm_bwd_est_ms"] = fbgemm_estimate(wl)
        row["vs_fbgemm_bwd_est"] = row["fbgemm_bwd_est_ms"] / row["bwd_ms"]
    return row


def fbgemm_estimate(wl) -> float | None:
    """FBGEMM's backward kernel time on a workload that is not an anchor, scaled from its measured `base` time
    (`zipf` for Zipf ids) by the gradient columns looked up, sum(B * L * D) (its backward is bandwidth-bound on
    `base`). A rough reference only: FBGEMM cannot run here."""
    ref = testing.PRESETS["zipf" if wl.alpha > 1 else "base"]
    cols = lambda w: sum(w.B * l * d for _, d, l in w.features())  # noqa: E731
    return FBGEMM_BWD_KERNEL_MS[ref.name] * cols(wl) / cols(ref)


def run_workload(wl, args, bcfgs):
    feats = wl.features()
    nf = len(feats)
    sets = make_sets(wl, args.sets)
    tables = common.tables(wl)
    kw = dict(weights_dtype=wl.weights_dtype, output_dtype=wl.output_dtype)
    interpret = common.interpret()
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", interpret=interpret, **kw)
    ref_emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla", **kw)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=LR, eps=EPS)
    if args.device_opt:  # hyperparameters as device arrays: no host-to-device copies per step (README)
        opt = jax.device_put(opt)
    row = {"workload": dataclasses.asdict(wl), "variants": {}}
    bcfg = next(iter(bcfgs.values()))
    row["unique_rows"], unique_cols = unique_rows(wl, sets)
    wbytes = 4 if wl.weights_dtype == "float32" else 2
    # Floor bytes: read+write each distinct row and its accumulator, read the output gradient once per lookup
    # (L2 may serve repeats), sort keys (approx. 4 passes of 8 B per lookup).
    n_lookups = sum(wl.B * l for _, _, l in feats)
    row["floor_bytes"] = 2 * unique_cols * wbytes + row["unique_rows"] * 8 + wl.B * sum(dd for _, dd, _ in feats) * 4 \
        + n_lookups * 32

    params0 = emb.init(jax.random.key(0))
    state0 = emb.init_opt_state(params0, opt)

    # Correctness on set 0: kernels vs the dense reference update.
    idx0, off0, psw0, g0 = sets[0]
    # The batch as arguments, not closed-over constants: XLA would constant-fold the reference's ops on them
    # (over a minute of compile for 13M lookups, `final20-bench.log`).
    ref_w, ref_m = jax.jit(lambda p, s, i, o, g, w: ref_emb.apply_gradients(p, s, opt, i, o, g, w))(
        params0, state0, idx0, off0, g0, psw0)
    out_w, out_m = jax.jit(lambda p, s, i, o, g, w: emb.apply_gradients(p, s, opt, i, o, g, w,
                                                                        backward_config=bcfg))(
        params0, state0, idx0, off0, g0, psw0)
    # On the device: the large preset's tables are 8 GB.
    rel = common.rel_err
    errs = []
    for k in ref_w:
        errs.append(float(rel(out_w[k], ref_w[k])))
        errs.append(float(rel(out_m.momentum[k], ref_m.momentum[k])))
    row["max_rel_err"] = max(errs)
    del ref_w, ref_m, out_w, out_m

    # Forward alone.
    fwd = jax.jit(lambda p, i, o, s: emb(p, i, o, s))
    row["fwd_ms"] = time_calls(fwd, [(params0,) + s[:3] for s in sets], args.iters, args.reps)

    # Preprocessing alone (linearise, sort, run-length encode, task lists).
    plan = emb.plan_for(off0.shape[0])
    runs_fn = jax.jit(lambda i, o, s: dispatch.sorted_runs(emb, plan, i, o, s))
    row["runs_ms"] = time_calls(runs_fn, [s[:3] for s in sets], args.iters, args.reps)

    # Backward alone: apply_gradients on donated tables/state, per kernel config.
    for cname, cfg in bcfgs.items():
        @functools.partial(jax.jit, donate_argnums=(0,))
        def bwd_step(carry, opt, i, o, s, g, cfg=cfg):
            p, st = carry
            return emb.apply_gradients(p, st, opt, i, o, g, s, backward_config=cfg)

        carry = jax.tree_util.tree_map(jnp.copy, (params0, state0))
        ms, carry = time_chain(bwd_step, carry, with_opt(opt, sets), args.iters, args.reps)
        row["variants"][cname] = {"config": dataclasses.asdict(cfg), "bwd_ms": ms}
        del carry
    best = min(row["variants"], key=lambda k: row["variants"][k]["bwd_ms"])
    row["best"], row["bwd_ms"] = best, row["variants"][best]["bwd_ms"]
    bcfg = bcfgs[best]
    if args.bwd_only:
        row.update(fwd_bwd_ms=float("nan"), fwd_bwd_sort_in_forward_ms=float("nan"))
        return fbgemm_ratios(row, wl)
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", interpret=interpret, backward_config=bcfg, **kw)
    emb_sif = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", interpret=interpret, **kw,
                                            backward_config=dataclasses.replace(bcfg, sort_in_forward=True))

    # A training step through tbe_jax.train_step (forward + output gradient + sparse update), and the same
    # step with the sort/RLE moved into the forward (BackwardConfig.sort_in_forward).
    train_step = sparse_train_step(emb)
    carry = jax.tree_util.tree_map(jnp.copy, (params0, state0))
    row["fwd_bwd_ms"], carry = time_chain(train_step, carry, with_opt(opt, sets), args.iters, args.reps)
    del carry
    row["bwd_step_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
    carry = jax.tree_util.tree_map(jnp.copy, (params0, state0))
    row["fwd_bwd_sort_in_forward_ms"], carry = time_chain(sparse_train_step(emb_sif), carry, with_opt(opt, sets),
                                                          args.iters, args.reps)
    del carry
    if args.hlo_dir:
        text = train_step.lower((params0, state0), opt, *sets[0]).compile().as_text()
        path = os.path.join(args.hlo_dir, f"train_step-{wl.name}.hlo.txt")
        with open(path, "w") as fh:
            fh.write(text)
        row["hlo"] = hlo_table_passes(text, params0)

    # XLA baseline (single dim only, as the anchors).
    if len(params0) == 1 and not args.no_xla:
        key = next(iter(params0))
        table_offsets = jnp.asarray(np.asarray(emb.layout.table_row_offset, np.int32))
        def fwd_x(w, i, o, s):
            return xla_baseline(w, table_offsets, i, o, s, nf, wl.B)

        xfwd = jax.jit(fwd_x)
        row["xla_fwd_ms"] = time_calls(xfwd, [(params0[key],) + s[:3] for s in sets], args.iters, args.reps)
        xstep = jax.jit(functools.partial(xla_step, fwd=fwd_x), donate_argnums=(0,))
        carry = (jnp.copy(params0[key]), jnp.copy(state0.momentum[key]))
        row["xla_fwd_bwd_ms"], carry = time_chain(xstep, carry, sets, max(args.iters // 5, 4), args.reps)
        del carry
        row["xla_bwd_ms"] = row["xla_fwd_bwd_ms"] - row["xla_fwd_ms"]
        row["vs_xla_bwd"] = row["xla_bwd_ms"] / row["bwd_ms"]
        row["vs_xla_fwd_bwd"] = row["xla_fwd_bwd_ms"] / row["fwd_bwd_ms"]
    fbgemm_ratios(row, wl)
    row["floor_ms_at_3.7TBps"] = row["floor_bytes"] / 3.7e9
    del params0, state0
    return row


def hlo_table_passes(text: str, params) -> dict:
    """Count HLO instructions producing a whole-table-shaped value other than the kernels' custom calls."""
    shapes = set()
    for v in params.values():
        dt = {"float16": "f16", "float32": "f32", "bfloat16": "bf16"}[str(v.dtype)]
        shapes.add(f"{dt}[{','.join(map(str, v.shape))}]")
        shapes.add(f"f32[{v.shape[0]}]")  # the accumulators
    hits = {"copy": 0, "fusion": 0, "other": 0, "custom-call": 0}
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if "=" not in s or s.startswith("ROOT tuple") or s.startswith("//"):
            continue
        lhs, rhs = s.split("=", 1)
        rhs = rhs.strip()
        shape = rhs.split(" ", 1)[0].split("{")[0]
        if shape not in shapes:
            continue
        op = rhs.split(" ", 1)[1].split("(", 1)[0] if " " in rhs else ""
        if op in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            continue
        kind = op if op in hits else "other"
        hits[kind] += 1
        if kind != "custom-call":
            lines.append(s[:200])
    return {"counts": hits, "non_kernel_whole_table_ops": lines[:20]}


def scaling_run(args):
    """Fixed lookups (T=4, B=4096, L=20, D=128, fp16), E per table from 1e5 to 1e7."""
    rows = []
    for e in (100_000, 1_000_000, 10_000_000):
        wl = testing.Workload(f"scale-E{e}", 4, e, 128, 4096, 20, 1.15)
        sets = make_sets(wl, args.sets)
        tables = [tbe_jax.TableSpec(e, 128) for _ in range(4)]
        emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, impl="pallas")
        opt = tbe_jax.RowwiseAdagrad(learning_rate=LR, eps=EPS)
        params = emb.init(jax.random.key(0))
        state = emb.init_opt_state(params, opt)

        train_step = sparse_train_step(emb)
        ms, carry = time_chain(train_step, (params, state), with_opt(opt, sets), args.iters, args.reps)
        del carry
        rows.append({"E_per_table": e, "table_bytes": 4 * e * 128 * 2, "fwd_bwd_ms": ms})
        print(f"scaling E={e:>9d}: train step {ms:.4f} ms", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks backward", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="base,zipf,weighted,large,fp32,smalltable",
                    help="comma-separated workloads: presets, dims<lo>-<hi>/<step>, many<T>x<dims>[z] "
                         "(tbe_jax.testing.workload); non-anchors get a byte-scaled FBGEMM estimate")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="BackwardConfig variants as JSON objects, e.g. '{}' '{\"small_block\": 64}' (default: the "
                         "defaults); the fastest one's apply_gradients is the row's bwd_ms")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--scaling", action="store_true", help="also run the flat-with-E scaling run")
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--device-opt", action="store_true",
                    help="pass the optimizer with its hyperparameters as device arrays (jax.device_put) instead of "
                         "Python floats, which each step copies to the device")
    ap.add_argument("--bwd-only", action="store_true",
                    help="time apply_gradients (and the forward, the runs) only: no training-step timings")
    ap.add_argument("--hlo-dir", default="", help="write each train step's compiled HLO here")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)
    bcfgs = common.configs(args.configs, tbe_jax.BackwardConfig)
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    meta = common.meta(
        timing="iters donated steps enqueued back to back over --sets input sets, block once, median of reps",
        iters=args.iters, reps=args.reps, sets=args.sets, optimizer={"lr": LR, "eps": EPS},
        device_opt=args.device_opt)
    rows = []
    out = {"meta": meta, "results": rows}
    path = args.out if args.out.endswith(".json") else None
    for name in args.presets.split(","):
        wl = common.workload(name)
        r = run_workload(wl, args, bcfgs)
        rows.append(r)
        nan = float("nan")
        print(f"{name:11s} bwd {r['bwd_ms']:.4f} ms ({r['best']}; runs {r['runs_ms']:.4f})  fwd {r['fwd_ms']:.4f}  "
              f"fwd+bwd {r['fwd_bwd_ms']:.4f} (sort in fwd {r['fwd_bwd_sort_in_forward_ms']:.4f})  "
              + " ".join(f"[{k}] {v['bwd_ms']:.4f}" for k, v in r["variants"].items()) + "  "
              f"xla bwd {r.get('xla_bwd_ms', nan):.4f}  fbgemm bwd {r['fbgemm_bwd_ms'] or nan:.3f}  "
              f"(est {r.get('fbgemm_bwd_est_ms', nan):.3f}: {r.get('vs_fbgemm_bwd_est', nan):.2f}x)  "
              f"err {r['max_rel_err']:.2e}  uniq {r['unique_rows']:.0f}  hlo {r.get('hlo', {}).get('counts')}",
              flush=True)
        path = common.save("backward", out, path or args.out)  # after every preset: a run cut short keeps it
    if args.scaling:
        out["scaling"] = scaling_run(args)
    path = common.save("backward", out, path or args.out)
    nan = float("nan")
    print("\n| preset | bwd ms | FBGEMM bwd | vs FBGEMM | fwd+bwd ms | FBGEMM fwd+bwd | vs FBGEMM | XLA bwd | vs XLA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:  # non-anchors: FBGEMM's byte-scaled estimate, starred
        fbs = (r["fbgemm_bwd_ms"] or nan) + (r["fbgemm_fwd_ms"] or nan)
        fb = f"{r['fbgemm_bwd_ms']:.3f}" if r["fbgemm_bwd_ms"] else f"{r.get('fbgemm_bwd_est_ms', nan):.3f}*"
        vs = r.get("vs_fbgemm_bwd", r.get("vs_fbgemm_bwd_est", nan))
        print(f"| {r['workload']['name']} | {r['bwd_ms']:.3f} | {fb} | "
              f"{vs:.2f}x | {r['fwd_bwd_ms']:.3f} | {fbs:.3f} | "
              f"{r.get('vs_fbgemm_fwd_bwd', nan):.2f}x | {r.get('xla_bwd_ms', nan):.3f} | "
              f"{r.get('vs_xla_bwd', nan):.2f}x |")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
