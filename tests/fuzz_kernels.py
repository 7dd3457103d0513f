"""Randomized cross-check of the Pallas kernels against the XLA path (a developer tool, not collected by pytest).

    python tests/fuzz_kernels.py forward --seed 1000 --cases 30
    python tests/fuzz_kernels.py quant --seed 5000 --cases 30
    python tests/fuzz_kernels.py backward --seed 9000 --cases 30

Each case draws a model and a batch (1-4 tables of 1..1000 rows and dims 1..300, shared tables, VBE with empty
features, bags of 0..70 ids, Zipf or uniform ids, some bad ids, offsets that start or end out of range (and, with
`bounds_check="warning"`, decrease), sum or mean, per-sample weights) and a random `ForwardConfig` (tile,
unroll, bag groups, prefetch, max bags, warps, the wide-rows rule; some `bag_size_hint`s), runs the kernels (in
interpret mode on a CPU, compiled on a GPU) and `impl="xla"` on it, and prints every case whose outputs (or
report counts, or, for `backward`, updated tables after one `apply_gradients` step of a random optimizer)
differ by more than the storage type's tolerance. `forward`: fp32 / fp16 / bf16 tables; `quant`: `tbe_jax.quantize`
to each weight type, fp32 or fp16 output; `backward`: the seven optimizers on fp32 / fp16 tables, with the
counting-rank sort on or off. The process exits 1 if any case failed. Compiled programs are dropped every 10
cases, so one process can run hundreds of cases (200 a mode tried).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

ON_CPU = "--gpu" not in sys.argv
if ON_CPU:  # the cheap CPU compile the suite uses (tests/conftest.py)
    os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                               "--xla_cpu_use_fusion_emitters=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tbe_jax  # noqa: E402
from tbe_jax import testing  # noqa: E402

DIMS = [1, 2, 3, 4, 7, 8, 13, 16, 24, 31, 32, 48, 64, 96, 100, 128, 160, 192, 256, 257, 300]
OPTIMIZERS = ["SGD", "RowwiseAdagrad", "Adagrad", "Adam", "PartialRowwiseAdam", "Lamb", "PartialRowwiseLamb"]


def draw(rng, seed: int):
    t = int(rng.integers(1, 5))
    dims = [int(rng.choice(DIMS)) for _ in range(t)]
    rows = [int(rng.choice([1, 2, 5, 17, 64, 300, 1000])) for _ in range(t)]
    fmap = [int(rng.integers(0, t)) for _ in range(int(rng.integers(1, 5)))]
    vbe = bool(rng.random() < 0.3)
    batch = [int(rng.integers(0, 9)) for _ in fmap] if vbe else [int(rng.integers(1, 40))] * len(fmap)
    cfg = tbe_jax.ForwardConfig(tile_elems=int(rng.choice([32, 64, 128, 256, 512])), unroll=int(rng.integers(1, 5)),
                                bag_groups=int(rng.choice([1, 1, 2, 4])), prefetch=bool(rng.random() < 0.8),
                                max_bags=int(rng.choice([4, 64])),
                                # its own stream, so that the seeds drawn before it was added draw the same cases
                                # (0: None, the default rule)
                                num_warps=int(np.random.default_rng([seed, 1]).choice([0, 1, 2, 4])) or None)
    # half the cases make the wide-rows rule (`ForwardConfig.wide_bags`) reachable at these small batches: the
    # default warps, no least bag count, any mean (its own stream too)
    wide = np.random.default_rng([seed, 2])
    if wide.random() < 0.5:
        cfg = dataclasses.replace(cfg, num_warps=None, wide_bags=int(wide.choice([2, 4])), wide_min_bags=0,
                                  wide_max_mean=float(wide.choice([3.0, 100.0])))
    # a quarter of them split the launch every one or two buffers (`segment_buffers`), or keep it whole up to
    # some program count (`merge_programs`; its own stream)
    seg = np.random.default_rng([seed, 3])
    if seg.random() < 0.25:
        cfg = dataclasses.replace(cfg, segment_buffers=int(seg.choice([1, 2])),
                                  merge_programs=int(seg.choice([0, 4, 1 << 20])))
    hints = [int(rng.choice([1, 2])) if rng.random() < 0.2 else None for _ in range(t)]
    return dict(dims=dims, rows=rows, fmap=fmap, vbe=vbe, batch=batch, cfg=cfg, hints=hints,
                bag_len=(0, int(rng.choice([0, 1, 2, 5, 20, 70]))), pooling=str(rng.choice(["sum", "mean"])),
                weighted=bool(rng.random() < 0.4), alpha=float(rng.choice([1.0, 1.2])))


def run_case(mode: str, seed: int, interpret: bool):
    """(relative error, tolerance, counts equal) of one drawn case."""
    rng = np.random.default_rng(seed)
    c = draw(rng, seed)
    dims = c["dims"]
    if mode == "quant":
        wt = str(rng.choice(["int8", "int4", "int2", "fp8", "float16", "float32"]))
        step = {"int4": 2, "int2": 4}.get(wt, 1)  # FBGEMM's rows: whole bytes
        dims = [max(step, d - d % step) for d in dims]
    specs = [tbe_jax.TableSpec(e, d, bag_size_hint=h) for e, d, h in zip(c["rows"], dims, c["hints"])]
    idx, off, psw = testing.make_batch(rng, [c["rows"][t] for t in c["fmap"]], c["batch"], c["bag_len"],
                                       weighted=c["weighted"], alpha=c["alpha"])
    if len(idx) and rng.random() < 0.3:
        k = rng.integers(0, len(idx), size=max(1, len(idx) // 10))
        idx[k] = rng.choice([-5, 10**6], size=k.shape)
    bounds = str(rng.choice(["warning", "ignore"]))
    if len(off) > 2 and rng.random() < 0.3:  # offsets off the rules (`tbe_jax.bounds`)
        kind = int(rng.integers(0, 3 if bounds == "warning" else 2))
        if kind == 0:  # a first entry below 0 or past 0 (never decreasing: the same clamped bags everywhere)
            off[0] = int(rng.choice([-3, min(2, int(off[1]))]))
        elif kind == 1:  # a last entry past len(indices)
            off[-1] = len(idx) + int(rng.integers(1, 5))
        else:  # a decreasing entry ("warning" repairs it by the running maximum on every impl)
            off[int(rng.integers(1, len(off) - 1))] = int(rng.integers(0, len(idx) + 1))
    bpf = tuple(c["batch"]) if c["vbe"] else None
    kw = dict(feature_table_map=c["fmap"], pooling=c["pooling"], bounds_check=bounds)
    kern = dict(impl="pallas", interpret=interpret)
    counts_equal = True
    if mode == "forward":
        wd = str(rng.choice(["float32", "float16", "bfloat16"]))
        emb = tbe_jax.TableBatchedEmbedding(specs, weights_dtype=wd, kernel_config=c["cfg"], **kern, **kw)
        ref = tbe_jax.TableBatchedEmbedding(specs, weights_dtype=wd, impl="xla", **kw)
        params = emb.init(jax.random.key(seed))
        out, rep = emb.forward_with_report(params, idx, off, psw, batch_size_per_feature=bpf)
        want, rep_ref = ref.forward_with_report(params, idx, off, psw, batch_size_per_feature=bpf)
        counts_equal = tuple(map(int, rep)) == tuple(map(int, rep_ref))
        tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[wd]
    elif mode == "quant":
        od = jnp.dtype(str(rng.choice(["float32", "float16"])))
        emb = tbe_jax.TableBatchedEmbedding(specs, **kw)
        params = emb.init(jax.random.key(seed))
        q, qp = tbe_jax.quantize(emb, params, wt, output_dtype=od, kernel_config=c["cfg"], **kern)
        q_ref, _ = tbe_jax.quantize(emb, params, wt, output_dtype=od, impl="xla")
        out, rep = q.forward_with_report(qp, idx, off, psw, batch_size_per_feature=bpf)
        want, rep_ref = q_ref.forward_with_report(qp, idx, off, psw, batch_size_per_feature=bpf)
        counts_equal = tuple(map(int, rep)) == tuple(map(int, rep_ref))
        tol = 2e-3 if od == jnp.float16 else 1e-5
    else:
        wd = str(rng.choice(["float32", "float16"]))
        opt = getattr(tbe_jax, str(rng.choice(OPTIMIZERS)))(learning_rate=0.1)
        bcfg = tbe_jax.BackwardConfig(rank_sort_max=int(rng.choice([0, 24576])),
                                      small_block=int(rng.choice([1, 8])) if rng.random() < 0.5 else None)
        # half the cases make long runs of many chunks at these small batches (drawn from a stream of their own,
        # so the rest of each seed's case, tables and batch, is what it was before)
        runs = np.random.default_rng([seed, 3])
        if runs.random() < 0.5:
            bcfg = dataclasses.replace(bcfg, small_run_max=2, long_run=int(runs.choice([3, 4, 16])),
                                       long_block=int(runs.choice([1, 2, 8])),
                                       long_num_warps=int(runs.choice([0, 1, 2, 4])) or None)
            if bcfg.long_run == 16:  # runs of 2C..15 chunked in C (drawn last: the draws above stay as they were)
                bcfg = dataclasses.replace(bcfg, split_chunk=int(runs.choice([0, 2, 3, 5])))
            # narrow rows' wider steps (a stream of its own again: the draws above stay as they were)
            steps = np.random.default_rng([seed, 4])
            if steps.random() < 0.5:
                bcfg = dataclasses.replace(bcfg, step_width=int(steps.choice([16, 64, 256])))
        if np.random.default_rng([seed, 5]).random() < 0.25:  # the run-length pass with fills (the default writes none)
            bcfg = dataclasses.replace(bcfg, rle_fill=True)
        emb = tbe_jax.TableBatchedEmbedding(specs, weights_dtype=wd, backward_config=bcfg, **kern, **kw)
        ref = tbe_jax.TableBatchedEmbedding(specs, weights_dtype=wd, impl="xla", **kw)
        params = emb.init(jax.random.key(seed))
        state = emb.init_opt_state(params, opt)
        shape = ref(params, idx, off, psw, batch_size_per_feature=bpf).shape
        grad = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        got, _ = emb.apply_gradients(params, state, opt, idx, off, grad, psw, batch_size_per_feature=bpf)
        exp, _ = ref.apply_gradients(params, state, opt, idx, off, grad, psw, batch_size_per_feature=bpf)
        out = np.concatenate([np.ravel(t) for t in emb.get_tables(got)])
        want = np.concatenate([np.ravel(t) for t in ref.get_tables(exp)])
        tol = {"float32": 2e-5, "float16": 2e-3}[wd]
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    if out.shape != want.shape:
        return np.inf, tol, counts_equal
    err = np.abs(out - want).max() / max(np.abs(want).max(), 1e-6) if want.size else 0.0
    return float(err), tol, counts_equal


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("forward", "quant", "backward"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--gpu", action="store_true", help="run the kernels compiled (on a GPU)")
    args = ap.parse_args(argv)
    failed = 0
    for k, seed in enumerate(range(args.seed, args.seed + args.cases)):
        if k and k % 10 == 0:
            # Each compiled XLA:CPU program holds memory mappings of its JIT code until freed: one process
            # compiling every case passes `vm.max_map_count` (65,530) after ~40-60 backward cases and aborts
            # inside LLVM ("Cannot allocate memory"), as the suite did before `conftest._release_compiled_programs`.
            jax.clear_caches()
            gc.collect()
        try:
            err, tol, counts_equal = run_case(args.mode, seed, interpret=not args.gpu)
            if err > tol or not counts_equal:
                failed += 1
                print(f"FAIL {args.mode} seed {seed}: error {err:.3g} (tolerance {tol}), counts equal {counts_equal}")
        except Exception as exc:  # noqa: BLE001 (a case that raises is a failure to report, not to stop on)
            failed += 1
            print(f"ERROR {args.mode} seed {seed}: {type(exc).__name__}: {str(exc)[:300]}")
    print(f"{args.mode}: {args.cases - failed} of {args.cases} cases agree (seeds {args.seed}..{args.seed + args.cases - 1})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
