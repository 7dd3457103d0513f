"""Shard-shape sweep: this library's TBE against FBGEMM's CUDA TBE on hundreds of drawn shard shapes.

The distribution is the one FBTriton's evaluation is read against (production shard shapes), as issue 35 gives it:
T (tables) in {1, 2, 4, ..., 64}; B in {512, ..., 32768}; rows per table log-uniform in 50..5M; D per table in
{8, 16, 32, 48, 64, 96, 128, 160, 192, 256} (half the shards one D for all tables); mean bag length per table
log-uniform in 1..150, bag lengths uniform in 0..2L; ids uniform or Zipf(1.05..1.2) ranks hashed over the table;
30% weighted; 15% fp32 tables, else fp16; shards over ~6 GB of tables and state or ~12M lookups redrawn. Sum
pooling, fp32 output, exact row-wise Adagrad (lr 0.1, eps 0.1, stochastic rounding), no bounds check on FBGEMM's
side (`BoundsCheckMode.NONE`), our default `bounds_check="ignore"`.

Per shard and direction (forward; backward = the fused update; both):
- FBGEMM: the summed GPU time of its kernels per call (torch profiler; its "bwd" is (fwd+bwd) - fwd, as FBGEMM's
  benchmarks report it), and CUDA-event time per call.
- ours: the device time per call (JAX's profiler: every kernel, copy and XLA fusion of the jitted call) and the
  enqueued wall time per call (calls back to back, blocked once; host dispatch shows where it exceeds the device
  time). Backward: a donated `apply_gradients` step; forward: a jitted lookup.

Processes: the GPU is shared by several worker processes (our JAX workers and one FBGEMM worker), which set up and
compile in parallel but time one at a time (a file lock), so no two measurements overlap on the GPU. The compiled
programs are compiled ahead of time outside the lock and called as compiled executables. Each worker runs on its
own share of the host's CPUs (`--cpus`): the enqueued time is host time, and another worker's compile threads on
the same cores would be counted in it (session 52: one shard's update enqueued 0.30 ms in one run, 1.30 ms in the
next, at the same device time). Each row records the host's one-minute load average when its timing began.

Usage (on the GPU machine; FBGEMM from `../shared/fbgemm`):
  python -m benchmarks sweep --shapes 240 --seed 20261202 --out benchmarks/results/sweep-....json
  python -m benchmarks sweep ... --only fbgemm   # or ours; --merge a.json b.json merges two runs' shard results
Sharing the lock, the two sides reached 115-175 of 248 shards in 490 s (FBGEMM's one worker waits behind our four);
each side alone in its own call reaches all of them (`run_gpu.sh sweep-ours`, then `sweep-fbgemm` on the same
lease, which merges the two).
The summary (top-level "summary") gives, per direction, the median and minimum of FBGEMM time / our device time,
the share of shards at or above 1.0x and 1.2x, and the 10 worst shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fcntl
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

DIMS = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
MAX_BYTES = 6e9
MAX_LOOKUPS = 12e6
LR, EPS = 0.1, 0.1
HASH = 0x9E3779B1  # odd multiplier of the id hash


@dataclasses.dataclass(frozen=True)
class Shard:
    name: str
    B: int
    rows: tuple[int, ...]  # per table (one feature per table)
    dims: tuple[int, ...]
    bags: tuple[float, ...]  # mean bag length per table
    alpha: float  # <= 1: uniform ids, else Zipf(alpha) ranks hashed over the table
    weighted: bool
    weights_dtype: str  # "float16" | "float32"
    fixed_bags: bool = False  # bag lengths exactly `bags` (multi-hot sizes) instead of uniform in 0..2L
    seed: int = 0
    hinted: bool = False  # our side: each table's `bag_size_hint` = its bag size (FBGEMM takes no hints)

    @property
    def T(self) -> int:
        return len(self.rows)

    def lookups(self) -> float:
        return self.B * sum(self.bags)

    def table_bytes(self) -> float:
        wb = 4 if self.weights_dtype == "float32" else 2
        return sum(e * (d * wb + 4) for e, d in zip(self.rows, self.dims))

    def params(self) -> dict:
        return {"T": self.T, "B": self.B, "rows": list(self.rows), "dims": list(self.dims),
                "bags": [round(x, 2) for x in self.bags], "alpha": self.alpha, "weighted": self.weighted,
                "weights_dtype": self.weights_dtype, "lookups": int(self.lookups()),
                "table_gb": round(self.table_bytes() / 1e9, 3)}


def draw(rng: np.random.Generator, index: int, seed: int) -> Shard:
    """One shard of the distribution (redrawn until it fits the caps)."""
    while True:
        t = 1 << int(rng.integers(0, 7))
        b = 1 << int(rng.integers(9, 16))
        rows = tuple(int(x) for x in np.exp(rng.uniform(np.log(50), np.log(5e6), t)))
        if rng.random() < 0.5:
            dims = (int(rng.choice(DIMS)),) * t
        else:
            dims = tuple(int(x) for x in rng.choice(DIMS, t))
        bags = tuple(float(x) for x in np.exp(rng.uniform(0.0, np.log(150), t)))
        alpha = 1.0 if rng.random() < 0.5 else float(rng.uniform(1.05, 1.2))
        weighted = bool(rng.random() < 0.3)
        wd = "float32" if rng.random() < 0.15 else "float16"
        s = Shard(f"s{index:03d}", b, rows, dims, bags, round(alpha, 3), weighted, wd, seed=seed * 1000 + index)
        if s.table_bytes() <= MAX_BYTES and s.lookups() <= MAX_LOOKUPS:
            return s


def draw_shards(n: int, seed: int) -> list[Shard]:
    rng = np.random.default_rng(seed)
    return [draw(rng, i, seed) for i in range(n)]


# The tables of MLPerf's DLRMv2 (DCNv2, Criteo 1TB multi-hot): 26 tables of D 128, B 8192, multi-hot sizes.
DLRM_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
             155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
DLRM_HOTS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


def named_shards() -> dict[str, Shard]:
    """The anchors' presets and the DLRMv2 tables as shards (the presets' fixed bag length L)."""
    def preset(name, t, e, d, b, l, alpha=1.0, weighted=False, wd="float16"):
        return Shard(name, b, (e,) * t, (d,) * t, (float(l),) * t, alpha, weighted, wd, fixed_bags=True, seed=t * 7)

    out = {
        "base": preset("base", 32, 100_000, 128, 4096, 20),
        "zipf": preset("zipf", 32, 100_000, 128, 4096, 20, 1.15),
        "weighted": preset("weighted", 32, 100_000, 128, 4096, 20, 1.15, True),
        "fp32": preset("fp32", 32, 100_000, 128, 4096, 20, 1.15, wd="float32"),
        "smalltable": preset("smalltable", 1, 64, 128, 65536, 128),
        "large": preset("large", 8, 4_000_000, 128, 65536, 20),
    }
    out["dlrmv2"] = Shard("dlrmv2", 8192, DLRM_ROWS, (128,) * 26, tuple(float(h) for h in DLRM_HOTS), 1.05, False,
                          "float16", fixed_bags=True, seed=26)
    # The same batches with the multi-hot sizes (fixed by the dataset) given as the tables' `bag_size_hint`s, as
    # the DLRM demo's DCNv2 model gives them.
    out["dlrmv2-hinted"] = dataclasses.replace(out["dlrmv2"], name="dlrmv2-hinted", hinted=True)
    return out


def zipf_ranks(rng: np.random.Generator, e: int, alpha: float, n: int) -> np.ndarray:
    """`n` ranks in [0, e) with P(rank r) ~ (r + 1)^-alpha: the continuous power law's inverse CDF, floored."""
    a = 1.0 - alpha
    x = ((e + 1.0) ** a - 1.0) * rng.random(n) + 1.0
    return np.clip(np.floor(x ** (1.0 / a)) - 1, 0, e - 1).astype(np.int64)


def batch(shard: Shard, which: int):
    """(indices int32 [N], offsets int32 [T*B+1], per-sample weights f32 or None, output gradient f32 [B, sum D]);
    deterministic in (shard.seed, which). Sets differ in ids, weights and gradients, not in bag lengths."""
    shape_rng = np.random.default_rng([shard.seed, 0])  # the bag lengths: the same in every set (one compile)
    rng = np.random.default_rng([shard.seed, 1 + which])
    lens, ids = [], []
    for e, l in zip(shard.rows, shard.bags):
        if shard.fixed_bags:
            ln = np.full(shard.B, int(round(l)), np.int64)
        else:
            ln = shape_rng.integers(0, int(round(2 * l)) + 1, size=shard.B)
        n = int(ln.sum())
        if shard.alpha <= 1.0:
            x = rng.integers(0, e, size=n, dtype=np.int64)
        else:
            # Zipf-like ranks, hashed over the table so that the hot rows scatter.
            x = (zipf_ranks(rng, e, shard.alpha, n) * HASH + shard.seed) % e
        lens.append(ln)
        ids.append(x.astype(np.int32))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lens))]).astype(np.int32)
    indices = np.concatenate(ids)
    psw = rng.uniform(0.5, 1.5, size=indices.shape).astype(np.float32) if shard.weighted else None
    g = (rng.standard_normal((shard.B, sum(shard.dims))) * 0.01).astype(np.float32)
    return indices, offsets, psw, g


# -- locking: workers time one at a time ------------------------------------------------------------------------


class GpuLock:
    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self.fh = open(self.path, "a")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


# -- our worker ----------------------------------------------------------------------------------------------------


def _ours(shard: Shard, lock: GpuLock, iters: int, reps: int, sets: int = 2, impl: str = "pallas",
          kernel_config: str = "") -> dict:
    import jax
    import jax.numpy as jnp
    import tbe_jax
    from benchmarks.common import config, device_ms, enqueued_ms

    t_setup = time.perf_counter()
    hints = [max(1, round(b)) if shard.hinted else None for b in shard.bags]
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d, bag_size_hint=h)
                                         for e, d, h in zip(shard.rows, shard.dims, hints)],
                                        weights_dtype=jnp.dtype(shard.weights_dtype), output_dtype=jnp.float32,
                                        impl=impl, kernel_config=config(kernel_config, tbe_jax.ForwardConfig))
    opt = jax.device_put(tbe_jax.RowwiseAdagrad(learning_rate=LR, eps=EPS))  # (two scalars: no contention)
    host = [batch(shard, k) for k in range(sets)]

    def step(carry, opt, i, o, w, g):
        return emb.apply_gradients(carry[0], carry[1], opt, i, o, g, w)

    def init(key, opt):
        params = emb.init(key)
        return params, emb.init_opt_state(params, opt)

    # Compiled outside the lock on abstract arguments (no GPU work), called as compiled executables: the init
    # too (its compile was most of the time a worker held the lock: 367 of ~480 s on 240 shards of an H100
    # sweep). Everything that runs on the GPU (the tables' init, the inputs' transfer, the first calls) waits
    # for the lock: another worker's setup would otherwise share the GPU with a measurement and inflate its
    # enqueued time.
    t0 = time.perf_counter()
    spec = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    i0, o0, w0, g0 = map(spec, host[0])
    key_s = jax.eval_shape(lambda: jax.random.key(0))
    params_s, state_s = jax.eval_shape(init, key_s, opt)
    init_c = jax.jit(init).lower(key_s, opt).compile()
    fwd = jax.jit(lambda p, i, o, w: emb(p, i, o, w)).lower(params_s, i0, o0, w0).compile()
    bwd = jax.jit(step, donate_argnums=(0,)).lower((params_s, state_s), opt, i0, o0, w0, g0).compile()
    compile_s = time.perf_counter() - t0
    res = {"compile_s": round(compile_s, 2)}
    with lock:
        res["loadavg"] = round(os.getloadavg()[0], 2)
        t0 = time.perf_counter()
        inputs = [tuple(None if x is None else jax.device_put(x) for x in b) for b in host]
        params, state = init_c(jax.random.key(shard.seed), opt)
        jax.block_until_ready((params, state, inputs))
        res["setup_s"] = round(time.perf_counter() - t_setup, 2)
        for i, o, w, g in inputs:
            jax.block_until_ready(fwd(params, i, o, w))
        res["first_call_s"] = round(time.perf_counter() - t0, 3)

        def run_fwd(k):
            i, o, w, _ = inputs[k % sets]
            return fwd(params, i, o, w)

        res["fwd_enq"] = enqueued_ms(run_fwd, iters, reps)
        res["fwd_dev"], res["fwd_kernels"] = device_ms(run_fwd, iters, top=6)
        carry = [(params, state)]

        def run_bwd(k):
            i, o, w, g = inputs[k % sets]
            carry[0] = bwd(carry[0], opt, i, o, w, g)
            return carry[0]

        for k in range(2 * sets):  # warm-up (the first carry is placed differently from the step's outputs)
            run_bwd(k)
        jax.block_until_ready(carry[0])
        res["bwd_enq"] = enqueued_ms(run_bwd, iters, reps)
        res["bwd_dev"], res["bwd_kernels"] = device_ms(run_bwd, iters, top=8)
        jax.block_until_ready(carry[0])
        del carry, params, state, inputs
    return res


# -- FBGEMM worker ----------------------------------------------------------------------------------------------


def _fbgemm_module(shard: Shard):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode, ComputeDevice,
                                                                       EmbeddingLocation, PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    prec = SparseType.FP32 if shard.weights_dtype == "float32" else SparseType.FP16
    specs = [(e, d, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for e, d in zip(shard.rows, shard.dims)]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
        weights_precision=prec, cache_precision=prec, output_dtype=SparseType.FP32, stochastic_rounding=True,
        pooling_mode=PoolingMode.SUM, bounds_check_mode=BoundsCheckMode.NONE, device=torch.device("cuda"))


def torch_kernel_ms(run, iters: int) -> float:
    """Summed CUDA activity per call (torch profiler), as FBGEMM's benchmarks report kernel time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(iters):
            run(k)
        torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total_us += e.time_range.elapsed_us()
    if total_us == 0.0:  # another torch's event layout: the CUDA self time of the averages
        total_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    return total_us / 1e3 / iters


def torch_event_ms(run, iters: int, reps: int) -> float:
    """Median over `reps` of the CUDA-event time per call of `iters` calls of `run(k)` (torch)."""
    import torch

    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for k in range(iters):
            run(k)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _fbgemm(shard: Shard, lock: GpuLock, iters: int, reps: int, sets: int = 2) -> dict:
    import torch

    host = [batch(shard, k) for k in range(sets)]
    lock.__enter__()  # all of FBGEMM's setup is GPU work (allocation, init): under the lock, as ours is
    try:
        t0 = time.perf_counter()
        mod = _fbgemm_module(shard)
        inputs = [(torch.from_numpy(i.astype(np.int64)).cuda(), torch.from_numpy(o.astype(np.int64)).cuda(),
                   None if w is None else torch.from_numpy(w).cuda(), torch.from_numpy(g).cuda())
                  for i, o, w, g in host]
        torch.cuda.synchronize()
        res = {"setup_s": round(time.perf_counter() - t0, 2)}
        _fbgemm_measure(mod, inputs, res, iters, reps, sets)
    finally:
        lock.__exit__(None, None, None)
    del mod, inputs
    torch.cuda.empty_cache()
    return res


def _fbgemm_measure(mod, inputs, res, iters, reps, sets):
    import torch

    def run_fwd(k):
        i, o, w, _ = inputs[k % sets]
        with torch.no_grad():
            return mod(i, o, w)

    def run_fwdbwd(k):
        i, o, w, g = inputs[k % sets]
        mod(i, o, w).backward(g)

    for k in range(2 * sets):
        run_fwd(k)
        run_fwdbwd(k)
    torch.cuda.synchronize()
    res["fwd_kernel"] = torch_kernel_ms(run_fwd, iters)
    res["fwdbwd_kernel"] = torch_kernel_ms(run_fwdbwd, iters)
    res["fwd_events"] = torch_event_ms(run_fwd, iters, reps)
    res["fwdbwd_events"] = torch_event_ms(run_fwdbwd, iters, reps)
    res["bwd_kernel"] = res["fwdbwd_kernel"] - res["fwd_kernel"]


def worker(args) -> None:
    """Measure the shards assigned to this worker; one JSON line per shard to `args.results`."""
    shards = [Shard(**{**d, "rows": tuple(d["rows"]), "dims": tuple(d["dims"]), "bags": tuple(d["bags"])})
              for d in json.load(open(args.shard_file))]
    mine = shards[args.index :: args.of]
    if args.cpus:  # before jax starts its thread pools (sized by the CPUs this process may use)
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    lock = GpuLock(args.lock)
    if args.worker == "ours":
        import jax

        measure = functools.partial(_ours, impl=args.impl, kernel_config=args.kernel_config)
    else:
        measure = _fbgemm
    for s in mine:
        t0 = time.perf_counter()
        try:
            r = measure(s, lock, args.iters, args.reps)
        except Exception as exc:  # noqa: BLE001 (a failing shard is recorded, the sweep goes on)
            r = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
        r["wall_s"] = round(time.perf_counter() - t0, 2)
        with open(args.results, "a") as fh:
            fh.write(json.dumps({"shard": s.name, "side": args.worker, **r}) + "\n")
        brief = {k: v for k, v in r.items() if "kernels" not in k and k != "trace"}
        print(f"[{args.worker}{args.index}] {s.name} {json.dumps(brief)}", flush=True)


# -- driver ---------------------------------------------------------------------------------------------------------


def cpu_shares(cpus: list[int], n: int) -> list[list[int]]:
    """`cpus` cut into `n` disjoint, contiguous shares as even as they go (each at least one CPU; with fewer CPUs
    than shares, shares repeat them)."""
    if len(cpus) < n:
        return [[cpus[k % len(cpus)]] for k in range(n)]
    cuts = [round(k * len(cpus) / n) for k in range(n + 1)]
    return [cpus[cuts[k]:cuts[k + 1]] for k in range(n)]


def _spawn(kind: str, index: int, of: int, shard_file: str, tmp: str, results: str, args,
           cpus: list[int]) -> subprocess.Popen:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env["PYTHONPATH"] = root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "benchmarks.sweep", "--worker", kind, "--index", str(index), "--of", str(of),
           "--shard-file", shard_file, "--lock", os.path.join(tmp, "gpu.lock"), "--results", results,
           "--iters", str(args.iters), "--reps", str(args.reps), "--impl", args.impl,
           "--kernel-config", args.kernel_config, "--cpus", ",".join(map(str, cpus))]
    return subprocess.Popen(cmd, env=env)


def run_shards(shards: list[Shard], args, tmp: str, tag: str, ours: list[Shard] | None = None) -> list[dict]:
    """Measure `shards` (FBGEMM) and `ours` (default: the same) in worker processes sharing one GPU lock."""
    results = os.path.join(tmp, f"results-{tag}.jsonl")
    plan = []  # (side, worker index, workers of that side, shard file)
    for side, todo in (("ours", shards if ours is None else ours), ("fbgemm", shards)):
        if args.only not in ("", side) or not todo:
            continue
        shard_file = os.path.join(tmp, f"shards-{tag}-{side}.json")
        with open(shard_file, "w") as fh:
            json.dump([dataclasses.asdict(s) for s in todo], fh)
        n = min(args.workers if side == "ours" else args.fbgemm_workers, len(todo))
        plan += [(side, k, n, shard_file) for k in range(n)]
    shares = cpu_shares(sorted(os.sched_getaffinity(0)), max(1, len(plan)))
    procs = [_spawn(side, k, n, f, tmp, results, args, cpus) for (side, k, n, f), cpus in zip(plan, shares)]
    deadline = time.time() + args.budget_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    if not os.path.exists(results):
        return []
    return [json.loads(line) for line in open(results)]


def row_bytes(shard: Shard) -> int:
    """Bytes of the table rows one forward gathers (each lookup's D elements; the bag lengths exactly as `batch`
    draws them): the forward's floor of memory traffic, for its GB/s."""
    shape_rng = np.random.default_rng([shard.seed, 0])
    wb = 4 if shard.weights_dtype == "float32" else 2
    total = 0
    for d, l in zip(shard.dims, shard.bags):
        n = shard.B * int(round(l)) if shard.fixed_bags else int(
            shape_rng.integers(0, int(round(2 * l)) + 1, size=shard.B).sum())
        total += n * d * wb
    return total


def _ratio(fb, ours):
    return fb / ours if fb and ours and fb > 0 and ours > 0 else None


def summarize(shards: dict[str, dict], rows: list[dict], shards_by_name: dict | None = None) -> list[dict]:
    """Per shard both sides' numbers and the ratios (FBGEMM time / ours: > 1 is faster than FBGEMM)."""
    by = {}
    for r in rows:
        by.setdefault(r["shard"], {})[r["side"]] = r
    table = []
    for name, params in shards.items():
        o, f = by.get(name, {}).get("ours"), by.get(name, {}).get("fbgemm")
        entry = {"shard": name, **params, "ours": o, "fbgemm": f}
        if shards_by_name and name in shards_by_name:  # the forward's gathered row bytes per ms of device time
            gb = row_bytes(shards_by_name[name]) / 1e9
            entry["fwd_row_gb"] = round(gb, 4)
            entry["fwd_gbps"] = {side: round(gb / (r[key] / 1e3), 1) for side, r, key in
                                 (("ours", o, "fwd_dev"), ("fbgemm", f, "fwd_kernel"))
                                 if r and "error" not in r and r.get(key)}
        if o and f and "error" not in o and "error" not in f:
            entry["ratio"] = {
                "fwd": _ratio(f["fwd_kernel"], o["fwd_dev"]),
                "bwd": _ratio(f["bwd_kernel"], o["bwd_dev"]),
                "fwdbwd": _ratio(f["fwdbwd_kernel"], o["fwd_dev"] + o["bwd_dev"]),
                "fwd_enqueued": _ratio(f["fwd_kernel"], o["fwd_enq"]),
                "bwd_enqueued": _ratio(f["bwd_kernel"], o["bwd_enq"]),
            }
        table.append(entry)
    return table


def summary(table: list[dict], sample: set[str], dispatch_us=None) -> dict:
    out = {"shapes": 0, "fbgemm_source": "measured", "measure": "device", "dispatch_us": dispatch_us}
    rows = [t for t in table if t["shard"] in sample and t.get("ratio")]
    out["shapes"] = len(rows)
    for key in ("fwd", "bwd", "fwdbwd", "fwd_enqueued", "bwd_enqueued"):
        xs = [t["ratio"][key] for t in rows if t["ratio"][key]]
        if not xs:
            continue
        out[key] = {"median": round(statistics.median(xs), 3), "share_ge_1": round(np.mean([x >= 1 for x in xs]), 3),
                    "share_ge_1_2": round(np.mean([x >= 1.2 for x in xs]), 3), "min": round(min(xs), 3),
                    "worst": [{"shard": t["shard"], "ratio": round(t["ratio"][key], 3),
                               **{k: t[k] for k in ("T", "B", "rows", "dims", "bags", "alpha", "weighted",
                                                    "weights_dtype")}}
                              for t in sorted(rows, key=lambda t: t["ratio"][key] or 1e9)[:10]]}
    # enqueued within 1.1x of device where the device time is >= 50 us
    gaps = []
    for t in rows:
        for d in ("fwd", "bwd"):
            dev, enq = t["ours"][f"{d}_dev"], t["ours"][f"{d}_enq"]
            if dev >= 0.05:
                gaps.append(enq / dev)
    if gaps:
        out["enqueued_over_device"] = {"shapes_ge_50us": len(gaps), "max": round(max(gaps), 3),
                                       "share_le_1_1": round(np.mean([g <= 1.1 for g in gaps]), 3)}
    return out


def _meta() -> dict:
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node()}
    try:
        import jax

        meta["jax"] = jax.__version__
        meta["device"] = jax.devices()[0].device_kind
    except Exception:  # noqa: BLE001
        pass
    for mod in ("torch", "fbgemm_gpu", "triton"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            meta[mod] = None
    return meta


def _measure(args, drawn: list[Shard], extra: list[Shard]) -> list[dict]:
    """Run the workers: the shards over MAX_BYTES first, one side at a time (all of the GPU's memory for one
    process), within --big-budget-s; then the rest (the named ones, then the drawn ones), sides in parallel,
    until the deadline."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        deadline = time.time() + args.budget_s
        big = [s for s in extra if s.table_bytes() > MAX_BYTES]
        small = [s for s in extra if s not in big]
        big_deadline = time.time() + min(args.big_budget_s, args.budget_s)
        for s in big:
            for side in ("ours", "fbgemm"):
                left = big_deadline - time.time()
                if args.only in ("", side) and left > 20:
                    rows += run_shards([s], _one(args, side, left), tmp, f"big-{s.name}-{side}")
        ours = drawn[: args.ours_first] + small if args.ours_first else None
        # the named shards (the presets: a few seconds each) before the drawn ones, so a run the budget cuts
        # still has them
        rows += run_shards(small + drawn, _one(args, args.only, deadline - time.time(), args.workers), tmp, "main",
                           ours)
    return rows


def _merged_meta(specs) -> dict:
    """A summary of merged runs: the machine facts of the last run, and what was merged."""
    meta = json.load(open(specs[-1].partition(":")[0]))["meta"] if specs else {}
    keep = ("date", "host", "jax", "device", "torch", "fbgemm_gpu", "triton")
    return {**{k: meta.get(k) for k in keep}, "merged": list(specs),
            "summarized": datetime.datetime.now().isoformat(timespec="seconds")}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=240)
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--named", default="base,zipf,weighted,fp32,smalltable,large,dlrmv2,dlrmv2-hinted",
                    help="named shards measured too (presets, dlrmv2), outside the random sample's summary")
    ap.add_argument("--first", type=int, default=0, help="only the first K drawn shards (0: all)")
    ap.add_argument("--only", choices=("", "ours", "fbgemm"), default="")
    ap.add_argument("--ours-first", type=int, default=0, help="our side measures only the first K drawn shards")
    ap.add_argument("--workers", type=int, default=4, help="our worker processes")
    ap.add_argument("--fbgemm-workers", type=int, default=1,
                    help="FBGEMM's worker processes (more than one with --only fbgemm: its batches are drawn on the "
                         "CPU, one shard after another per worker)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop the workers after this long")
    ap.add_argument("--big-budget-s", type=float, default=200.0, help="of the budget, at most this long for the "
                    "shards over MAX_BYTES (run first, one side at a time)")
    ap.add_argument("--merge", nargs="*", default=[],
                    help="shard results (.json of earlier runs; path:ours or path:fbgemm for one side) to merge in; "
                         "later rows of a (shard, side) replace earlier ones")
    ap.add_argument("--max-total-rows", type=int, default=0,
                    help="measure only the drawn shards with at most this many rows in all tables (0: all); the "
                         "summary still covers every drawn shard (merge the others' rows with --merge)")
    ap.add_argument("--no-run", action="store_true", help="measure nothing: summarize the merged rows")
    ap.add_argument("--skip-measured", action="store_true",
                    help="measure only the shards whose side(s) have no error-free row in the --merge files yet")
    ap.add_argument("--dispatch", default="", help="a dispatch-probe JSON whose dispatch_us goes in the summary")
    ap.add_argument("--out", default="")
    ap.add_argument("--impl", default="pallas", help="our impl (xla: a CPU smoke test of the plumbing)")
    ap.add_argument("--kernel-config", default="", help="our tbe_jax.ForwardConfig as a JSON object of its fields "
                    "(e.g. '{\"unroll\": 2}'; default: the defaults)")
    # worker mode
    ap.add_argument("--worker", choices=("ours", "fbgemm"))
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--of", type=int, default=1)
    ap.add_argument("--shard-file")
    ap.add_argument("--lock")
    ap.add_argument("--cpus", default="", help="worker: the CPUs this worker may run on (comma-separated)")
    ap.add_argument("--results")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the driver's jax (metadata) takes no memory
    if args.worker:
        worker(args)
        return
    drawn = draw_shards(args.shapes, args.seed)
    if args.first:
        drawn = drawn[: args.first]
    named = named_shards()
    extra = [named[n] for n in filter(None, args.named.split(","))]
    rows = []
    for spec in args.merge:  # path, or path:side to take one side's rows only
        path, _, side = spec.partition(":")
        rows += [r for r in json.load(open(path))["rows"] if not side or r["side"] == side]
    if not args.no_run:
        measured = [s for s in drawn if not args.max_total_rows or sum(s.rows) <= args.max_total_rows]
        todo = extra
        if args.skip_measured:  # a later call of the same sweep measures only what the merged rows lack
            sides = [args.only] if args.only else ["ours", "fbgemm"]
            have = {(r["shard"], r["side"]) for r in rows if "error" not in r}
            missing = lambda s: any((s.name, side) not in have for side in sides)  # noqa: E731
            measured, todo = [s for s in measured if missing(s)], [s for s in extra if missing(s)]
        rows += _measure(args, measured, todo)
    # later rows of a (shard, side) replace earlier ones (a merge keeps the newest measurement)
    last = {}
    for r in rows:
        if "error" not in r or (r["shard"], r["side"]) not in last:
            last[(r["shard"], r["side"])] = r
    rows = list(last.values())
    shard_params = {s.name: s.params() for s in drawn + extra}
    table = summarize(shard_params, rows, {s.name: s for s in drawn + extra})
    dispatch = None
    if args.dispatch and os.path.exists(args.dispatch):
        dispatch = json.load(open(args.dispatch)).get("dispatch_us")
    result = {"summary": summary(table, {s.name for s in drawn}, dispatch),
              "named": {t["shard"]: t.get("ratio") for t in table if t["shard"] in named},
              "meta": {**(_merged_meta(args.merge) if args.no_run else _meta()), "seed": args.seed,
                       "shapes_drawn": len(drawn), "iters": args.iters,
                       "reps": args.reps, "kernel_config": args.kernel_config or "default",
                       "distribution": __doc__.split("\n\n")[1]},
              "rows": rows, "table": table}
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"sweep-{datetime.datetime.now():%Y%m%d-%H%M}.json")
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result["summary"], indent=1)[:6000])
    print("named:", json.dumps(result["named"]))
    errors = [r for r in rows if "error" in r]
    print(f"{len(rows)} results, {len(errors)} errors; saved {out}")
    for r in errors[:5]:
        print("ERROR", r["shard"], r["side"], r["error"][:300])


def _one(args, only: str, budget_s: float, workers: int = 1):
    """`args` for one run of workers: sides `only`, stopped after `budget_s`."""
    ns = argparse.Namespace(**vars(args))
    ns.workers, ns.only, ns.budget_s = workers, only, max(1.0, budget_s)
    return ns


if __name__ == "__main__":
    main()
