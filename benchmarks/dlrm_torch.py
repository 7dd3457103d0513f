"""MLPerf DLRMv2 (DCNv2) training step in torch with FBGEMM's fused TBE: the baseline the JAX model is compared with.

What is compared: one training step of the MLPerf DLRMv2 model as TorchRec runs it on one GPU. Bottom MLP
13-512-256-128 (ReLU after each layer); the 26 sum-pooled embedding bags (dim 128) from ONE FBGEMM
`SplitTableBatchedEmbeddingBagsCodegen` (all tables in HBM, EXACT_ROWWISE_ADAGRAD fused into its backward);
x0 = cat(bottom, pooled) [B, 3456]; DCN v2, 3 low-rank cross layers x' = x0 * (U(V x) + b) + x (rank 512); top MLP
3456-1024-1024-512-256-1 (no ReLU on the logit); BCE-with-logits (mean). The dense part runs in eager torch with
TF32 matmuls (`--matmul bfloat16`: under torch.autocast, bf16 matmuls) and torch.optim.Adagrad (foreach or
fused, whichever is faster here). The JAX side writes the batches
(DIR/meta.json, DIR/batch{k}.npz) so both sides train on the same ids; `--synthetic` draws its own.

How: build + init on the GPU (timed, synchronized); the K batches copied to the GPU once (int64 ids and offsets,
as TorchRec passes them); the tables keep FBGEMM's own init (1.6.0 allocates them with torch.zeros;
`--emb-init torchrec` fills them uniform(+-sqrt(1/rows)) in place, as TorchRec does); `--warmup` steps, then
`--steps` steps cycling the batches, wall-clocked with one synchronize at the end. Then torch.profiler (CUDA
activity) over `--profile-steps` steps: kernel time per step, split by kernel name into the TBE's kernels and the
dense rest (the top-30 name table is written so the split can be checked), and the TBE alone (forward + backward
with a fixed upstream gradient) as a cross-check of that split. Also peak HBM, versions, and the loss over the first
steps (finite, decreasing: printed, not asserted).

Smoke-test modes, NOT the benchmark: `--emb torch` (one nn.EmbeddingBag(mode="sum") per table, dense gradients, a
plain dense Adagrad on the tables instead of FBGEMM's row-wise one), `--device cpu`, `--tiny` (tables of at most
1000 rows; ids taken modulo), `--synthetic` (uniform ids, labels from the dense features). Stand-alone: imports
only torch, numpy, the standard library and fbgemm_gpu.

  python benchmarks/dlrm_torch.py --batches DIR --out FILE.json [--steps 50] [--warmup 10] [--emb-dtype float16]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# MLPerf DLRMv2 (Criteo 1TB multi-hot, rows capped at 40M) for --synthetic; a DIR's meta.json replaces them.
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
               155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
MLPERF_BAGS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
DEFAULT_META = {"model": "dcnv2", "table_rows": MLPERF_ROWS, "embedding_dim": 128, "bag_sizes": MLPERF_BAGS,
                "num_dense": 13, "bottom_mlp": [512, 256, 128], "top_mlp": [1024, 1024, 512, 256, 1],
                "dcn_layers": 3, "dcn_rank": 512, "emb_lr": 0.005, "dense_lr": 0.005, "eps": 1e-8,
                "emb_dtype": "float32", "matmul_precision": "tensorfloat32"}
# Substrings (lower case) of the kernels FBGEMM's TBE launches (forward, bounds check, backward's linearize / sort /
# run-length encode / cumsum, the fused row-wise Adagrad). The dense model launches none of these.
TBE_PATTERNS = ("embedding", "fbgemm", "bounds_check", "linearize", "radix", "cub::", "run_length", "lxu_cache",
                "complete_cumsum", "grad_mean", "unique_ind", "sort")


# -- data ---------------------------------------------------------------------------------------------------------

def synthetic_batch(meta: dict, rng: np.random.Generator, w: np.ndarray) -> dict:
    B, bags, rows = meta["batch_size"], meta["bag_sizes"], meta["table_rows"]
    ids = np.concatenate([rng.integers(0, r, size=B * n, dtype=np.int64) for r, n in zip(rows, bags)])
    lengths = np.repeat(np.asarray(bags, np.int64), B)  # feature-major: bag (f, b) is entry f * B + b
    dense = rng.standard_normal((B, meta["num_dense"]), dtype=np.float32)
    return {"indices": ids.astype(np.int32), "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            "dense": dense, "labels": (dense @ w > 0).astype(np.float32)}  # learnable: the loss should fall


def load(args) -> tuple[dict, list[dict]]:
    if args.synthetic:
        meta = dict(DEFAULT_META, batch_size=args.batch_size, num_batches=args.num_batches)
        if args.tiny:
            meta["table_rows"] = [min(r, 1000) for r in meta["table_rows"]]
        rng = np.random.default_rng(0)
        w = rng.standard_normal(meta["num_dense"]).astype(np.float32)
        return meta, [synthetic_batch(meta, rng, w) for _ in range(meta["num_batches"])]
    if not args.batches:
        sys.exit("give --batches DIR (written by the JAX side) or --synthetic")
    meta = json.load(open(os.path.join(args.batches, "meta.json")))
    if meta.get("model") != "dcnv2":
        sys.exit(f"{args.batches}/meta.json: model is {meta.get('model')!r}, not 'dcnv2'")
    meta = dict(DEFAULT_META, **meta)
    batches = [dict(np.load(os.path.join(args.batches, f"batch{k}.npz"))) for k in range(meta["num_batches"])]
    if args.tiny:  # keep the ids, shrink the tables: id modulo rows
        meta["table_rows"] = [min(r, 1000) for r in meta["table_rows"]]
        for b in batches:
            table = np.repeat(np.arange(len(meta["bag_sizes"])), np.diff(b["offsets"][::meta["batch_size"]]))
            b["indices"] = (b["indices"] % np.asarray(meta["table_rows"])[table]).astype(np.int32)
    return meta, batches


def check_batch(b: dict, meta: dict, k: int) -> None:
    B, T = meta["batch_size"], len(meta["table_rows"])
    want = {"indices": (B * sum(meta["bag_sizes"]),), "offsets": (T * B + 1,), "dense": (B, meta["num_dense"]),
            "labels": (B,)}
    for key, shape in want.items():
        if key not in b or tuple(b[key].shape) != shape:
            sys.exit(f"batch{k}: {key} has shape {None if key not in b else b[key].shape}, meta says {shape}")
    if b["offsets"][0] != 0 or b["offsets"][-1] != len(b["indices"]):
        sys.exit(f"batch{k}: offsets run {b['offsets'][0]}..{b['offsets'][-1]}, indices has {len(b['indices'])}")


def to_device(b: dict, meta: dict, args, device) -> dict:
    """One batch on the device, once: ids/offsets in --index-dtype (TorchRec passes int64)."""
    dt = np.int64 if args.index_dtype == "int64" else np.int32
    out = {"dense": torch.from_numpy(b["dense"]).to(device), "labels": torch.from_numpy(b["labels"]).to(device)}
    idx, off = b["indices"].astype(dt), b["offsets"].astype(dt)
    if args.emb == "fbgemm":
        out["sparse"] = (torch.from_numpy(idx).to(device), torch.from_numpy(off).to(device))
    else:  # per-table (ids, offsets) for nn.EmbeddingBag
        B, per = meta["batch_size"], []
        for f in range(len(meta["table_rows"])):
            s, e = off[f * B], off[(f + 1) * B]
            per.append((torch.from_numpy(idx[s:e].astype(np.int64)).to(device),
                        torch.from_numpy((off[f * B:(f + 1) * B] - s).astype(np.int64)).to(device)))
        out["sparse"] = (per,)
    return out


# -- model --------------------------------------------------------------------------------------------------------

def mlp(sizes: list[int], device, relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b, device=device))
        if relu_last or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseDCNv2(nn.Module):
    """Everything but the embeddings: bottom MLP, DCN v2 low-rank cross layers, top MLP (torch default init)."""

    def __init__(self, meta: dict, device):
        super().__init__()
        d, T, r = meta["embedding_dim"], len(meta["table_rows"]), meta["dcn_rank"]
        if meta["bottom_mlp"][-1] != d:
            raise ValueError(f"bottom MLP ends at {meta['bottom_mlp'][-1]}, embeddings have dim {d}")
        width = d * (T + 1)
        self.bottom = mlp([meta["num_dense"], *meta["bottom_mlp"]], device, relu_last=True)
        self.V = nn.ModuleList(nn.Linear(width, r, bias=False, device=device) for _ in range(meta["dcn_layers"]))
        self.U = nn.ModuleList(nn.Linear(r, width, device=device) for _ in range(meta["dcn_layers"]))
        self.top = mlp([width, *meta["top_mlp"]], device, relu_last=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([self.bottom(dense), pooled], dim=1)
        x = x0
        for V, U in zip(self.V, self.U):
            x = x0 * U(V(x)) + x
        return self.top(x).squeeze(1)


class TorchBags(nn.Module):
    """SMOKE TEST ONLY: one nn.EmbeddingBag(mode="sum") per table (dense gradients), uniform(+-sqrt(1/rows))."""

    def __init__(self, meta: dict, device):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(r, meta["embedding_dim"], mode="sum", device=device)
                                  for r in meta["table_rows"])
        for r, bag in zip(meta["table_rows"], self.bags):
            nn.init.uniform_(bag.weight, -math.sqrt(1 / r), math.sqrt(1 / r))

    def forward(self, per_table):
        return torch.cat([bag(i, o) for bag, (i, o) in zip(self.bags, per_table)], dim=1)


def fbgemm_tbe(meta: dict, args, device):
    """The 26 tables in one FBGEMM training TBE, as TorchRec's fused HBM kernel builds it."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode, EmbeddingLocation,
                                                                           PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
        try:
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice
        except ImportError:  # older layouts define it in the training module
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice
    except Exception as exc:  # noqa: BLE001
        sys.exit(f"--emb fbgemm: cannot import FBGEMM's training TBE: {type(exc).__name__}: {exc}\n"
                 "  (is fbgemm_gpu 1.6.0 on PYTHONPATH? see /work/shared/fbgemm/README.md; `--emb torch` is the "
                 "smoke-test stand-in)")
    prec = {"float32": SparseType.FP32, "float16": SparseType.FP16}[args.emb_dtype]
    specs = [(r, meta["embedding_dim"], EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for r in meta["table_rows"]]
    kw = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=meta["emb_lr"], eps=meta["eps"],
              weights_precision=prec, cache_precision=prec, output_dtype=SparseType.FP32,
              stochastic_rounding=True, pooling_mode=PoolingMode.SUM,
              bounds_check_mode=getattr(BoundsCheckMode, args.bounds_check.upper()), device=device)
    try:
        tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, **kw)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"SplitTableBatchedEmbeddingBagsCodegen({len(specs)} tables, "
                           f"{sum(meta['table_rows']):,} rows, {kw}) failed: {type(exc).__name__}: {exc}") from exc
    if args.emb_init == "torchrec":  # TorchRec's default: uniform(+-sqrt(1/rows)) per table, in place on the device
        for r, w in zip(meta["table_rows"], tbe.split_embedding_weights()):
            w.uniform_(-math.sqrt(1 / r), math.sqrt(1 / r))
        if float(tbe.split_embedding_weights()[0][:4].abs().sum()) == 0.0:
            raise RuntimeError("--emb-init torchrec: split_embedding_weights() gave copies, not views of the TBE's "
                               "weights (the in-place init did not reach the tables)")
    env_bc = os.environ.get("FBGEMM_TBE_BOUNDS_CHECK_MODE")  # FBGEMM lets this override bounds_check_mode
    return tbe, {**{k: str(v) for k, v in kw.items()}, "FBGEMM_TBE_BOUNDS_CHECK_MODE": env_bc}


def dense_adagrad(params, meta: dict, kind: str) -> torch.optim.Optimizer:
    kw = dict(lr=meta["dense_lr"], eps=meta["eps"], initial_accumulator_value=0.0)
    return torch.optim.Adagrad(params, **kw, **({"fused": True} if kind == "fused" else {"foreach": True}))


def pick_dense_opt(model: nn.Module, meta: dict, want: str, device) -> tuple[str, dict]:
    """'auto': time foreach vs fused Adagrad steps on copies of the dense parameters; the faster one wins."""
    if want != "auto":
        return want, {}
    times: dict = {}
    for kind in ("foreach", "fused"):
        copies = [p.detach().clone().requires_grad_() for p in model.parameters()]
        for c in copies:
            c.grad = torch.randn_like(c)
        try:
            opt = dense_adagrad(copies, meta, kind)
            for _ in range(3):
                opt.step()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(20):
                opt.step()
            sync(device)
            times[kind] = round((time.perf_counter() - t0) / 20 * 1e3, 4)
        except Exception as exc:  # noqa: BLE001 (fused may be unsupported here)
            times[kind] = f"{type(exc).__name__}: {exc}"[:300]
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    return min(ok, key=ok.get), {"dense_opt_step_ms": times}


# -- measurement --------------------------------------------------------------------------------------------------

def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_ms(run, n: int, device) -> dict[str, float]:
    """Summed device time per kernel name per call of run(k) (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    sync(device)
    with profile(activities=acts) as prof:
        for k in range(n):
            run(k)
        sync(device)
    want = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == want and (device.type == "cuda" or e.cpu_parent is None):  # CPU: top-level ops only
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us()
    if not per:  # another torch's event layout: the device self time of the averages
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
            if t:
                per[e.key] = per.get(e.key, 0.0) + t
    return {name: us / 1e3 / n for name, us in per.items()}


def is_tbe(name: str) -> bool:
    low = name.lower()
    return any(p in low for p in TBE_PATTERNS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", help="DIR with meta.json and batch{k}.npz (from the JAX side)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--emb-dtype", choices=["float32", "float16"], default=None,
                   help="TBE weights_precision (default: meta's emb_dtype)")
    p.add_argument("--emb", choices=["fbgemm", "torch"], default="fbgemm",
                   help="fbgemm: the benchmark. torch: SMOKE TEST ONLY (nn.EmbeddingBag + dense Adagrad)")
    p.add_argument("--emb-init", choices=["fbgemm", "torchrec"], default="fbgemm",
                   help="fbgemm: the TBE's own init (zeros); torchrec: uniform(+-sqrt(1/rows)) per table")
    p.add_argument("--bounds-check", choices=["warning", "fatal", "ignore", "none"], default="warning",
                   help="FBGEMM bounds_check_mode (default: FBGEMM's own, WARNING)")
    p.add_argument("--index-dtype", choices=["int64", "int32"], default="int64",
                   help="dtype of ids/offsets handed to the TBE (TorchRec: int64)")
    p.add_argument("--matmul", choices=["tensorfloat32", "bfloat16", "float32"], default=None,
                   help="the dense matmuls: TF32, bf16 (torch.autocast around the dense model: bf16 operands, fp32 "
                        "sums, bf16 results) or fp32 (default: meta's matmul_precision, as the JAX side ran)")
    p.add_argument("--dense-opt", choices=["auto", "foreach", "fused"], default="auto",
                   help="torch.optim.Adagrad implementation; auto times both and keeps the faster")
    p.add_argument("--synthetic", action="store_true", help="draw uniform ids instead of reading --batches")
    p.add_argument("--batch-size", type=int, default=65536, help="--synthetic only")
    p.add_argument("--num-batches", type=int, default=4, help="--synthetic only")
    p.add_argument("--tiny", action="store_true", help="SMOKE TEST ONLY: tables of at most 1000 rows")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (SMOKE TEST ONLY, --emb torch)")
    args = p.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch (use --device cpu --emb torch for a smoke test)")
    if args.emb == "fbgemm" and device.type != "cuda":
        sys.exit("--emb fbgemm needs --device cuda")
    meta, host = load(args)
    args.emb_dtype = args.emb_dtype or meta["emb_dtype"]
    # meta's name as `dlrm_compare` pairs it ("default": XLA's on a GPU, TF32); kept here: this file stands alone
    mp = meta.get("matmul_precision") or "tensorfloat32"
    args.matmul = args.matmul or {"bf16": "bfloat16", "default": "tensorfloat32"}.get(mp, mp)
    if args.matmul not in ("tensorfloat32", "bfloat16", "float32"):
        sys.exit(f"matmul precision {args.matmul!r}: pass --matmul tensorfloat32, bfloat16 or float32")
    torch.backends.cuda.matmul.allow_tf32 = args.matmul == "tensorfloat32"
    torch.backends.cudnn.allow_tf32 = args.matmul == "tensorfloat32"
    # bf16: the dense model under autocast (its matmuls take bf16 operands and return bf16, the elementwise work
    # promotes back to fp32 where a parameter or the fp32 pooled embeddings meet it); the TBE and the loss outside
    dense_ctx = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.matmul == "bfloat16"
                 else contextlib.nullcontext)
    if args.emb == "torch" and args.emb_dtype != "float32":
        sys.exit("--emb torch supports float32 tables only")
    for k, b in enumerate(host):
        check_batch(b, meta, k)
    B, T, D = meta["batch_size"], len(meta["table_rows"]), meta["embedding_dim"]
    gib = sum(meta["table_rows"]) * D * (4 if args.emb_dtype == "float32" else 2) / 2**30
    print(f"DLRMv2 torch: B={B}, {T} tables, {sum(meta['table_rows']):,} rows ({gib:.1f} GiB {args.emb_dtype}), "
          f"emb={args.emb}, device={device}", flush=True)

    # build + init, all on the device
    sync(device)
    t0 = time.perf_counter()
    if args.emb == "fbgemm":
        emb, tbe_args = fbgemm_tbe(meta, args, device)
    else:
        emb, tbe_args = TorchBags(meta, device), {"SMOKE TEST": "nn.EmbeddingBag per table, dense Adagrad"}
    model = DenseDCNv2(meta, device)
    sync(device)
    t_emb_dense = time.perf_counter() - t0
    opt_kind, opt_probe = pick_dense_opt(model, meta, args.dense_opt, device)
    t1 = time.perf_counter()
    opts = [dense_adagrad(model.parameters(), meta, opt_kind)]
    if args.emb == "torch":
        opts.append(torch.optim.Adagrad(emb.parameters(), lr=meta["emb_lr"], eps=meta["eps"],
                                        initial_accumulator_value=0.0, foreach=True))
    sync(device)
    build_init_s = t_emb_dense + time.perf_counter() - t1  # the optimizer probe is left out
    mem_after_build = torch.cuda.memory_allocated() if device.type == "cuda" else None
    batches = [to_device(b, meta, args, device) for b in host]
    del host
    sync(device)

    def step(k: int) -> torch.Tensor:
        b = batches[k % len(batches)]
        for o in opts:
            o.zero_grad(set_to_none=True)
        pooled = emb(*b["sparse"])
        with dense_ctx():
            logits = model(b["dense"], pooled)
        loss = F.binary_cross_entropy_with_logits(logits.float(), b["labels"])
        loss.backward()  # FBGEMM's row-wise Adagrad runs here, inside the TBE's backward
        for o in opts:
            o.step()
        return loss.detach()

    with torch.no_grad():
        out0 = emb(*batches[0]["sparse"])
    if tuple(out0.shape) != (B, T * D) or not bool(torch.isfinite(out0).all()):
        raise RuntimeError(f"embedding forward gave shape {tuple(out0.shape)} (want {(B, T * D)}), "
                           f"finite={bool(torch.isfinite(out0).all())}")
    del out0

    losses = [step(k) for k in range(args.warmup)]
    sync(device)
    t0 = time.perf_counter()
    losses += [step(args.warmup + k) for k in range(args.steps)]
    sync(device)
    step_ms = (time.perf_counter() - t0) / max(args.steps, 1) * 1e3
    peak_alloc = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    peak_reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else None
    losses = [float(v) for v in torch.stack(losses).cpu()]

    # kernel time: the whole step, then the TBE alone (forward + backward with a fixed upstream gradient)
    per = kernel_ms(step, args.profile_steps, device)
    g = torch.full((B, T * D), 1e-4, device=device)
    alone = kernel_ms(lambda k: emb(*batches[k % len(batches)]["sparse"]).backward(g), args.profile_steps, device)
    total = sum(per.values())
    tbe_ms = sum(v for n, v in per.items() if is_tbe(n))
    table = [{"kernel": n[:240], "ms_per_step": round(v, 4), "class": "tbe" if is_tbe(n) else "dense"}
             for n, v in sorted(per.items(), key=lambda kv: -kv[1])[:30]]

    fb_version = None
    if args.emb == "fbgemm":
        import fbgemm_gpu
        fb_version = getattr(fbgemm_gpu, "__version__", None)
        for dist in ("fbgemm_gpu", "fbgemm-gpu"):
            try:
                fb_version = fb_version or importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    res = {
        "bench": "dlrm_torch", "model": "dcnv2",
        "smoke_test": args.emb != "fbgemm" or device.type != "cuda" or args.tiny,
        "emb": args.emb if args.emb == "fbgemm" else "torch (SMOKE TEST ONLY: nn.EmbeddingBag, dense Adagrad)",
        "data": "synthetic (uniform ids)" if args.synthetic else os.path.abspath(args.batches),
        "batch_size": B, "num_batches": len(batches), "table_rows": meta["table_rows"], "bag_sizes": meta["bag_sizes"],
        "emb_dtype": args.emb_dtype, "emb_init": args.emb_init if args.emb == "fbgemm" else "uniform(+-sqrt(1/rows))",
        "index_dtype": args.index_dtype, "tbe_args": tbe_args, "table_gib": round(gib, 2),
        "matmul": args.matmul,
        "tf32": {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                 "float32_matmul_precision": torch.get_float32_matmul_precision()},
        "dense_optimizer": {"class": "torch.optim.Adagrad", "impl": opt_kind, "lr": meta["dense_lr"],
                            "eps": meta["eps"], "initial_accumulator_value": 0.0, **opt_probe},
        "emb_optimizer": {"kind": "EXACT_ROWWISE_ADAGRAD (FBGEMM, fused into backward)" if args.emb == "fbgemm"
                          else "torch.optim.Adagrad on dense table gradients (smoke test)",
                          "lr": meta["emb_lr"], "eps": meta["eps"]},
        "build_init_s": round(build_init_s, 3), "warmup": args.warmup, "steps": args.steps,
        "step_ms": round(step_ms, 4), "examples_per_s": round(B / step_ms * 1e3, 1),
        "profile_steps": args.profile_steps,
        "kernel_ms_per_step": round(total, 4), "tbe_kernel_ms_per_step": round(tbe_ms, 4),
        "dense_kernel_ms_per_step": round(total - tbe_ms, 4),
        "tbe_alone_kernel_ms": round(sum(alone.values()), 4),
        "tbe_alone_names_not_matched": {n[:240]: round(v, 4) for n, v in alone.items() if not is_tbe(n)},
        "device_share": round(total / step_ms, 4), "tbe_patterns": TBE_PATTERNS,
        "top_kernels": table,
        "hbm": {"after_build_bytes": mem_after_build, "max_allocated_bytes": peak_alloc,
                "max_reserved_bytes": peak_reserved},
        "losses": [round(v, 6) for v in losses], "loss_finite": all(math.isfinite(v) for v in losses),
        "loss_decreased": losses[-1] < losses[0] if losses else None,
        "env": {"torch": torch.__version__, "cuda": torch.version.cuda, "fbgemm_gpu": fb_version,
                "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                "python": platform.python_version(), "numpy": np.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"build+init {build_init_s:.2f} s | step {step_ms:.3f} ms, {res['examples_per_s']:,.0f} ex/s | kernels "
          f"{total:.3f} ms/step (TBE {tbe_ms:.3f}, dense {total - tbe_ms:.3f}; "
          f"TBE alone {res['tbe_alone_kernel_ms']:.3f}) | device share {res['device_share']:.2f} | "
          f"dense Adagrad {opt_kind}")
    if peak_alloc is not None:
        print(f"HBM: after build {mem_after_build / 2**30:.2f} GiB, peak allocated {peak_alloc / 2**30:.2f} GiB, "
              f"reserved {peak_reserved / 2**30:.2f} GiB")
    shown = losses[:10] + (["..."] + losses[-3:] if len(losses) > 13 else losses[10:])
    print("loss:", " ".join(v if isinstance(v, str) else f"{v:.4f}" for v in shown),
          f"(finite={res['loss_finite']}, decreased={res['loss_decreased']})")
    if res["tbe_alone_names_not_matched"]:
        print("TBE-alone kernels not matched by TBE_PATTERNS:", list(res["tbe_alone_names_not_matched"])[:8])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
