"""FBGEMM's host-memory cache (`EmbeddingLocation.MANAGED_CACHING`) on `benchmarks.host_cache`'s model and batches:
the issue 40 baseline. Not yet run (written in session 32, when no device time was left): check its output before
quoting it.

For each alpha: the same tables (`--tables` x `--rows` x `--dim`, fp16 weights and cache), the same Zipf batches
(the same seeds and generator as `host_cache`), exact row-wise Adagrad; cases "device" (`EmbeddingLocation.DEVICE`)
and "managed_caching" at each `--load-factors` (LRU, FBGEMM's default 32-way sets). A step is
`prefetch(indices, offsets)` (caching only) then `forward(...).backward(g)`, one after the other on the default
stream, as our step runs the next batch's prefetch in the same program. Reported: ms per step (CUDA events, median
of `--reps` runs of `--iters` steps), the summed kernel time per step (torch profiler), the ratio to the device
case, and FBGEMM's cache counters (`gather_uvm_cache_stats`): unique rows requested and missed per step.

FBGEMM's managed tables are CUDA managed memory: keep them well below the GPU's free memory (the default model is
2 GB). Run on the GPU machine with FBGEMM unpacked (`../shared/fbgemm/README.md`):

  python -m benchmarks fbgemm_cache --rows 1000000 --tables 8 --alphas 1.05 1.2 --load-factors 0.2 0.05
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import common
from benchmarks.sweep import torch_event_ms, torch_kernel_ms

STATS = ("calls", "requested", "unique", "unique_misses", "conflict_unique_misses", "conflict_misses")


def _batches(args, alpha):
    """`host_cache.batch_sets`' batches as torch tensors on the GPU (int64 ids and offsets, one gradient)."""
    import torch

    from tbe_jax import testing

    rng = np.random.default_rng(0)
    perms = [np.random.default_rng(1000 + t).permutation(args.rows) for t in range(args.tables)] if alpha > 1 else None
    g = torch.from_numpy(rng.standard_normal((args.batch, args.tables * args.dim), dtype=np.float32)).cuda()
    out = []
    for _ in range(args.sets):
        idx, off, _ = testing.make_batch(rng, [args.rows] * args.tables, [args.batch] * args.tables,
                                         [args.bag] * args.tables, alpha=alpha, weighted=False, perms=perms)
        out.append((torch.from_numpy(idx.astype(np.int64)).cuda(), torch.from_numpy(off.astype(np.int64)).cuda(), g))
    return out


def _module(args, location, load_factor):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode, CacheAlgorithm,
                                                                       ComputeDevice, EmbeddingLocation, PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    loc = EmbeddingLocation.MANAGED_CACHING if location == "managed_caching" else EmbeddingLocation.DEVICE
    specs = [(args.rows, args.dim, loc, ComputeDevice.CUDA) for _ in range(args.tables)]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8,
        weights_precision=SparseType.FP16, cache_precision=SparseType.FP16, output_dtype=SparseType.FP32,
        pooling_mode=PoolingMode.SUM, bounds_check_mode=BoundsCheckMode.NONE, cache_load_factor=load_factor,
        cache_algorithm=CacheAlgorithm.LRU, gather_uvm_cache_stats=location == "managed_caching",
        device=torch.device("cuda"))


def _case(args, location, sets, load_factor):
    import torch

    mod = _module(args, location, load_factor)
    cached = location == "managed_caching"

    def step(k):
        i, o, g = sets[k % len(sets)]
        if cached:
            mod.prefetch(i, o)
        mod(i, o).backward(g)

    for k in range(len(sets)):  # warm-up over every batch, as host_cache does
        step(k)
    torch.cuda.synchronize()
    out = {"location": location, "load_factor": load_factor if cached else None,
           "ms": torch_event_ms(step, args.iters, args.reps), "kernel_ms": torch_kernel_ms(step, args.iters)}
    if cached:
        mod.reset_uvm_cache_stats()
        for k in range(len(sets)):
            step(k)
        torch.cuda.synchronize()
        s = dict(zip(STATS, mod.get_uvm_cache_stats().tolist()))
        calls = max(s["calls"], 1)
        out.update({f"{k}_per_step": v / calls for k, v in s.items() if k != "calls"})
        out["row_hit_rate"] = 1.0 - s["unique_misses"] / max(s["unique"], 1)
    del mod
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks fbgemm_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--bag", type=int, default=20)
    ap.add_argument("--alphas", type=float, nargs="*", default=[1.05, 1.2])
    ap.add_argument("--load-factors", type=float, nargs="*", default=[0.2, 0.05])
    ap.add_argument("--sets", type=int, default=48)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cases = []
    for alpha in args.alphas:
        sets = _batches(args, alpha)
        base = None
        for location, lf in [("device", 0.2)] + [("managed_caching", lf) for lf in args.load_factors]:
            try:
                r = {"alpha": alpha, **_case(args, location, sets, lf)}
            except Exception as e:  # one failing case must not lose the others' numbers
                print(f"alpha {alpha} {location} lf {lf}: failed: {type(e).__name__}: {e}", flush=True)
                cases.append({"alpha": alpha, "location": location, "load_factor": lf, "error": repr(e)})
                continue
            base = r["ms"] if location == "device" else base
            r["vs_device"] = r["ms"] / base if base else None
            cases.append(r)
            hit = f", row hit rate {r['row_hit_rate']:.3f}" if "row_hit_rate" in r else ""
            misses = f", unique misses/step {r['unique_misses_per_step']:.0f}" if "unique_misses_per_step" in r else ""
            print(f"alpha {alpha} {location:16s} lf {lf}: {r['ms']:.3f} ms/step (kernels {r['kernel_ms']:.3f}) "
                  f"x{r['vs_device']:.2f}{hit}{misses}", flush=True)
    meta = common.meta()
    try:
        import fbgemm_gpu

        meta["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "?")
    except ImportError:
        pass
    config = {k: getattr(args, k) for k in ("tables", "rows", "dim", "batch", "bag", "sets", "iters", "reps")}
    print("saved", common.save("fbgemm-cache", {"meta": meta, "config": config, "cases": cases}, args.out))


if __name__ == "__main__":
    main()
