"""FBGEMM's quantized inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`, fbgemm_gpu 1.6.0): our row format
checked against it byte for byte, and its forward kernel timed.

`--check` (correctness, minutes): per weight type (float32, float16, fp8, int8, int4, int2) and dim (odd ones
where the TBE takes them), a random float32 table (1000 rows of mixed scales) quantized
- by FBGEMM's own tooling: `fbgemm_gpu.tbe.utils.quantize.quantize_embs` on the CUDA tensor, then the TBE's
  `assign_embedding_weights`, read back as whole padded rows (`split_embedding_weights(split_scale_shifts=False)`).
  Where FBGEMM's quantize op refuses the dim (int4: D % 4, int2: D % 8) or pads it (int8 on CUDA: D % 4), the row is
  padded with copies of its last value (min, max and so every other value's code unchanged) and the payload cut
  back to D; the result records which route each case took;
- by `tbe_jax.quant_format.quantize_rows` on JAX's default device and on the CPU;
and compared (differing bytes, first differing (row, byte)). Also FBGEMM's CPU quantize op against ours with its
epsilon (`int8_epsilon=1e-8`), and tables of NaN / inf / constant rows (bytes only). Then a forward of that TBE
(sum pooling, fp16 and fp32 output) on random bags (empty ones included) against our float64 reference (the bags'
sums of the float64 dequantized rows of our bytes): max abs error, relative error, and the share of the error
bound `tbe_jax/quant_format.py`'s docstring derives (FBGEMM's per-value fp16 rounding for integer rows, float32
accumulation, fp16 output rounding) that the worst element uses. A last probe checks the docstring's claim that
integer rows whose fp16 scale is >= 128 come out non-finite from FBGEMM's forward.

`--time` (FBGEMM's forward, the bar for our quantized kernel): int8 and int4 (and fp16 for reference) tables on the
anchors' workload shapes (`--workloads`, presets of `tbe_jax.testing` and `dims<lo>-<hi>/<step>` mixed-dim models)
at the workload's own batch size and at `--batch-sizes` (1, 16, 128, 1024), plus the first `--shards N` shards of
the sweep's distribution (benchmarks/sweep.py, at their own batch sizes and bag lengths). Per case: the summed CUDA
kernel time per call (torch.profiler CUDA events, as FBGEMM's benchmarks report it; `kernel_ms`), CUDA-event time
of calls back to back (`events_ms`), and the latency of one call including host dispatch (wall time of a call and
a synchronize, median after warm-up; `latency_ms`). Tables filled with FBGEMM's `fill_random_weights`; ids as the
anchors draw them; bounds check NONE; sum pooling; `--output-dtype` (float32, as the anchors).

Needs torch and fbgemm_gpu on PYTHONPATH (../shared/fbgemm/README.md, `prepare.sh --inference`); both are imported
only inside the functions that use them, so the suite list and the pure parts (workloads, the float64 reference,
the bound) import without them.

  python -m benchmarks fbgemm_quant --check --out benchmarks/results/fbgemm-quant-check-....json
  python -m benchmarks fbgemm_quant --time [--shards 20] --out benchmarks/results/fbgemm-quant-time-....json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

WEIGHT_TYPES = ("float32", "float16", "fp8", "int8", "int4", "int2")
CHECK_DIMS = {"float32": (13, 64, 128), "float16": (13, 64, 128), "fp8": (13, 64, 128), "int8": (13, 64, 128),
              "int4": (6, 14, 64, 128), "int2": (4, 12, 64, 128)}
# What FBGEMM's quantize ops need of D (else quantize_embs + the assignment fail): int8's CUDA op pads its payload
# to a multiple of 4, the N-bit ops refuse D not a multiple of 2 * values per byte.
OP_MULTIPLE = {"int8": 4, "int4": 4, "int2": 8}
WORKLOADS = "base,zipf,large,mixed,dims8-192/8"
BATCH_SIZES = "1,16,128,1024"
U16, U24 = 2.0 ** -11, 2.0 ** -24  # half an ulp of fp16 (relative) and the float32 unit roundoff


# -- pure parts (no torch) ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One timed forward: tables (rows, dim, mean bag length) at batch size B."""
    name: str
    B: int
    rows: tuple[int, ...]
    dims: tuple[int, ...]
    bags: tuple[float, ...]
    alpha: float = 1.0
    weighted: bool = False
    shard: object = None  # a sweep Shard: its own inputs (benchmarks/sweep.py::batch)


def workload_cases(names, batch_sizes) -> list[Case]:
    """Per workload name: the workload at its own batch size, then at each of `batch_sizes` (deduplicated)."""
    from tbe_jax import testing

    out = []
    for name in names:
        wl = testing.workload(name)
        feats = wl.features()
        for b in dict.fromkeys([wl.B, *batch_sizes]):
            out.append(Case(f"{name}@B{b}", int(b), tuple(e for e, _, _ in feats), tuple(d for _, d, _ in feats),
                            tuple(float(l) for _, _, l in feats), wl.alpha, wl.weighted))
    return out


def shard_cases(n: int, seed: int) -> list[Case]:
    """The first `n` shards the sweep draws from `seed` (benchmarks/sweep.py::draw_shards)."""
    from benchmarks import sweep

    return [Case(s.name, s.B, s.rows, s.dims, s.bags, s.alpha, s.weighted, shard=s)
            for s in sweep.draw_shards(n, seed)]


def case_inputs(case: Case, which: int):
    """(indices int32, offsets int32 [T*B+1], per-sample weights or None), deterministic in (case, which)."""
    if case.shard is not None:
        from benchmarks import sweep

        i, o, w, _ = sweep.batch(case.shard, which)
        return i, o, w
    from tbe_jax import testing

    rng = np.random.default_rng([len(case.rows), case.B, which])
    perms = [np.random.default_rng(1000 + t).permutation(e) for t, e in enumerate(case.rows)] \
        if case.alpha > 1 else None
    return testing.make_batch(rng, list(case.rows), [case.B] * len(case.rows), [int(l) for l in case.bags],
                              alpha=case.alpha, weighted=case.weighted, perms=perms)


def check_dims_ok(wt: str, d: int) -> bool:
    """Whether FBGEMM's quantize op + assignment take dim `d` as is (else the padded route)."""
    return d % OP_MULTIPLE.get(wt, 1) == 0


def random_table(rng: np.random.Generator, e: int, d: int, spread=(-4.0, 1.0)) -> np.ndarray:
    """float32 rows offset + scale * N(0, 1), scale 10^U(spread) per row (int2's fp16 scale stays below 128)."""
    scale = 10.0 ** rng.uniform(*spread, size=(e, 1))
    offset = rng.standard_normal((e, 1)) * scale * rng.uniform(0, 3, size=(e, 1))
    return (offset + scale * rng.standard_normal((e, d))).astype(np.float32)


def special_table(e: int, d: int) -> np.ndarray:
    """Rows of NaN, inf and constants among random ones."""
    w = random_table(np.random.default_rng(e), e, d)
    w[0, d // 2] = np.nan
    w[1, -1] = np.nan
    w[2, 0] = np.inf
    w[3, 1] = -np.inf
    w[4, :] = np.nan
    w[5, :] = 1.0004
    if e > 7:
        w[6, :] = 0.0
        w[7, :] = np.inf
    return w


def bags(rng: np.random.Generator, e: int, b: int, mean_len: int):
    """(indices int32, offsets int32 [b+1]) of `b` bags over `e` rows, lengths uniform in 0..2L, a quarter empty."""
    lens = rng.integers(0, 2 * mean_len + 1, size=b)
    lens[rng.random(b) < 0.25] = 0
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return rng.integers(0, e, size=int(offsets[-1])).astype(np.int32), offsets


def dequantize64(rows: np.ndarray, wt: str, d: int) -> np.ndarray:
    """Our stored rows (uint8 [E, row_bytes]) -> float64 [E, d], exactly: q * scale + bias (fp16 scale and bias),
    HFP8 / fp16 / fp32 values."""
    from tbe_jax import quant_format as qf

    rows = np.ascontiguousarray(rows, np.uint8)
    if wt == "float32":
        return rows[:, :4 * d].copy().view(np.float32).astype(np.float64)
    if wt == "float16":
        return rows[:, :2 * d].copy().view(np.float16).astype(np.float64)
    if wt == "fp8":
        c = rows[:, :d].astype(np.int64)
        e, m = (c >> 3) & 0xF, (c & 7).astype(np.float64)
        mag = np.where(e == 0, m * 2.0 ** -9, 2.0 ** (e - qf.FP8_EXPONENT_BIAS) * (1 + m / 8))
        return np.where(c & 0x80, -mag, mag)
    nb = qf.bits(wt)
    per = 8 // nb
    j = np.arange(d)
    q = (rows[:, 4 + j // per].astype(np.int64) >> (nb * (j % per))) & ((1 << nb) - 1)
    scale = rows[:, 0:2].copy().view(np.float16).astype(np.float64)
    bias = rows[:, 2:4].copy().view(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return q * scale + bias


def pooled(values: np.ndarray, indices: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum pooling of one table's rows `values` [E, D] over the bags `offsets` [B+1] (empty bags: 0)."""
    b = len(offsets) - 1
    seg = np.repeat(np.arange(b), np.diff(offsets))
    out = np.zeros((b, values.shape[1]), values.dtype)
    np.add.at(out, seg, values[indices])
    return out


def fbgemm_error_bound(values: np.ndarray, indices: np.ndarray, offsets: np.ndarray, wt: str,
                       out_fp16: bool) -> np.ndarray:
    """Per output element, how far FBGEMM's pooled forward may lie from the exact sum of `values` (float64 [E, D],
    the exact dequantized rows): integer rows' per-value fp16 rounding max(2^-11 |v|, 2^-25), float32 sequential
    accumulation (L - 1) 2^-24 sum |v|, and for fp16 output max(2^-11 |y|, 2^-25) (quant_format's docstring)."""
    a = np.abs(values)
    per_value = np.maximum(U16 * a, 2.0 ** -25) if wt in ("int8", "int4", "int2") else np.zeros_like(a)
    lens = np.diff(offsets)[:, None].astype(np.float64)
    terms = pooled(per_value, indices, offsets)
    abs_sum = pooled(a + per_value, indices, offsets)
    acc = np.maximum(lens - 1, 0) * U24 * abs_sum * 1.01
    bound = terms + acc
    if out_fp16:
        y = np.abs(pooled(values, indices, offsets)) + bound
        bound = bound + np.maximum(U16 * y, 2.0 ** -25)
    return bound


def compare(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> dict:
    """Errors of FBGEMM's output `got` against the float64 reference `want`."""
    err = np.abs(got.astype(np.float64) - want)
    finite = np.isfinite(err)
    worst = float(err[finite].max()) if finite.any() else None
    ratio = np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.where(err > 0, np.inf, 0))
    return {"max_abs_err": worst, "rel_err": worst / max(float(np.abs(want).max()), 1e-30) if worst is not None
            else None, "nonfinite": int((~finite).sum()), "bound_used": float(ratio[finite].max()) if finite.any()
            else None, "within_bound": bool(finite.all() and (err <= bound).all())}


def byte_diff(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Differing bytes and the first (row, byte) that differs."""
    if ours.shape != theirs.shape:
        return {"equal": False, "shape_ours": list(ours.shape), "shape_fbgemm": list(theirs.shape)}
    bad = np.argwhere(ours != theirs)
    out = {"equal": bad.size == 0, "bytes_differing": int(len(bad)), "rows_differing": int(len(set(bad[:, 0])))}
    if bad.size:
        r, c = (int(x) for x in bad[0])
        out.update(first=[r, c], ours_row=ours[r].tolist(), fbgemm_row=theirs[r].tolist())
    return out


# -- FBGEMM side --------------------------------------------------------------------------------------------------

def _fbgemm():
    try:
        import torch
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode, EmbeddingLocation,
                                                                           PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
        from fbgemm_gpu.tbe.utils.quantize import quantize_embs
    except Exception as exc:  # noqa: BLE001
        sys.exit(f"fbgemm_quant: cannot import torch + FBGEMM's inference TBE: {type(exc).__name__}: {exc}\n"
                 "  (fbgemm_gpu 1.6.0 with fbgemm_gpu_tbe_inference.so on PYTHONPATH: ../shared/fbgemm/README.md)")
    st = {"float32": SparseType.FP32, "float16": SparseType.FP16, "fp8": SparseType.FP8, "int8": SparseType.INT8,
          "int4": SparseType.INT4, "int2": SparseType.INT2}
    return dict(torch=torch, SparseType=SparseType, st=st, BoundsCheckMode=BoundsCheckMode,
                EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode,
                TBE=IntNBitTableBatchedEmbeddingBagsCodegen, quantize_embs=quantize_embs)


def _tbe(fb, tables, wt: str, out_dtype: str):
    """An IntNBit TBE on CUDA, one table per (rows, dim), weights allocated (zeros)."""
    specs = [(f"t{t}", e, d, fb["st"][wt], fb["EmbeddingLocation"].DEVICE) for t, (e, d) in enumerate(tables)]
    tbe = fb["TBE"](specs, pooling_mode=fb["PoolingMode"].SUM, device=fb["torch"].device("cuda"),
                    bounds_check_mode=fb["BoundsCheckMode"].NONE, output_dtype=fb["st"][out_dtype])
    tbe.initialize_weights()
    return tbe


def _fbgemm_quantize(fb, w: np.ndarray, wt: str, device: str):
    """quantize_embs of `w` on `device`: (payload, scale_bias or None, route); the padded route where the op needs
    another D."""
    torch = fb["torch"]
    from tbe_jax import quant_format as qf

    e, d = w.shape
    route = "quantize_embs"
    mult = OP_MULTIPLE.get(wt, 1)
    if d % mult:
        pad = mult - d % mult
        w = np.concatenate([w, np.repeat(w[:, -1:], pad, axis=1)], axis=1)
        route = f"quantize_embs on rows padded with their last value to D={d + pad}, payload cut to D={d}"
    cfg = fb["SparseType"].FP8.default_config() if wt == "fp8" else None
    q, ss = fb["quantize_embs"](torch.from_numpy(w).to(device), fb["st"][wt], cfg)
    payload = q[:, :d * qf.bits(wt) // 8].contiguous()
    return payload, ss, route


def _stored_rows(tbe, payload, ss) -> np.ndarray:
    """assign_embedding_weights, then the TBE's whole padded rows (uint8 [E, row_bytes])."""
    tbe.assign_embedding_weights([(payload, ss)])
    return tbe.split_embedding_weights(split_scale_shifts=False)[0][0].cpu().numpy()


def _ours(w: np.ndarray, wt: str, device=None, **kw) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from tbe_jax import quant_format as qf

    fn = jax.jit(qf.quantize_rows, static_argnums=1, static_argnames="int8_epsilon")
    with jax.default_device(device) if device is not None else contextlib.nullcontext():
        return np.asarray(fn(jnp.asarray(w), wt, **kw))


def check(args) -> dict:
    import jax

    from tbe_jax import quant_format as qf

    fb = _fbgemm()
    torch = fb["torch"]
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(args.seed)
    cases = []
    for wt in WEIGHT_TYPES:
        for d in CHECK_DIMS[wt]:
            w = random_table(rng, args.rows, d)
            res = {"wt": wt, "dim": d, "rows": args.rows, "row_bytes": qf.row_bytes(d, wt)}
            try:
                tbe = _tbe(fb, [(args.rows, d)], wt, "float32")
                payload, ss, res["route"] = _fbgemm_quantize(fb, w, wt, "cuda")
                theirs = _stored_rows(tbe, payload, ss)
                ours = _ours(w, wt)
                res["bytes_vs_ours"] = byte_diff(ours, theirs)
                res["bytes_vs_ours_on_cpu"] = byte_diff(_ours(w, wt, cpu), theirs)
                res["padding_zero"] = bool(not theirs[:, qf.unpadded_row_bytes(d, wt):].any())
                p_cpu, ss_cpu, _ = _fbgemm_quantize(fb, w, wt, "cpu")
                head = [] if ss_cpu is None else [ss_cpu.numpy()]
                theirs_cpu = np.concatenate(head + [p_cpu.numpy()], axis=1)
                ours_cpu = _ours(w, wt, int8_epsilon=qf.INT8_EPSILON_CPU)[:, :qf.unpadded_row_bytes(d, wt)]
                res["cpu_op_bytes_vs_ours_eps1e-8"] = byte_diff(ours_cpu, theirs_cpu)
                values = dequantize64(theirs, wt, d)  # the rows the TBE holds (FBGEMM's bytes)
                idx, off = bags(rng, args.rows, args.bags, args.bag_len)
                ti, to = torch.from_numpy(idx).cuda(), torch.from_numpy(off).cuda()
                for out in ("float16", "float32"):
                    tbe.output_dtype = fb["st"][out].as_int()
                    with torch.no_grad():
                        got = tbe(ti, to).float().cpu().numpy()
                    want = pooled(values, idx, off)
                    res[f"forward_{out}"] = compare(got, want, fbgemm_error_bound(values, idx, off, wt,
                                                                                  out == "float16"))
                del tbe
            except Exception as exc:  # noqa: BLE001
                res["error"] = f"{type(exc).__name__}: {exc}"[:600]
            cases.append(res)
            print(_line(res), flush=True)
    special = []
    for wt in WEIGHT_TYPES:
        for e in (6, 30):  # int8's two CUDA paths (<= 20 rows: a sequential scan)
            d = 8 if wt != "int2" else 16
            w = special_table(e, d)
            res = {"wt": wt, "dim": d, "rows": e}
            try:
                payload, ss, res["route"] = _fbgemm_quantize(fb, w, wt, "cuda")
                theirs = _stored_rows(_tbe(fb, [(e, d)], wt, "float32"), payload, ss)
                res["bytes_vs_ours"] = byte_diff(_ours(w, wt), theirs)
            except Exception as exc:  # noqa: BLE001
                res["error"] = f"{type(exc).__name__}: {exc}"[:600]
            special.append(res)
            print("special", _line(res), flush=True)
    return {"cases": cases, "special_rows": special, "scale_overflow": scale_overflow(fb)}


def scale_overflow(fb) -> dict:
    """FBGEMM's forward of integer rows with fp16 scales around 128 (hmul(scale, 512) overflows at 128)."""
    torch = fb["torch"]
    out = {}
    for wt in ("int8", "int4", "int2"):
        top = {"int8": 255, "int4": 15, "int2": 3}[wt]
        d = 16
        scales = (64.0, 127.9375, 128.0, 256.0)
        w = np.stack([np.linspace(0.0, s * top, d) for s in scales]).astype(np.float32)
        try:
            payload, ss, _ = _fbgemm_quantize(fb, w, wt, "cuda")
            tbe = _tbe(fb, [(len(scales), d)], wt, "float32")
            tbe.assign_embedding_weights([(payload, ss)])
            idx = torch.arange(len(scales), dtype=torch.int32, device="cuda")
            off = torch.arange(len(scales) + 1, dtype=torch.int32, device="cuda")
            with torch.no_grad():
                y = tbe(idx, off).cpu().numpy()
            out[wt] = {str(s): {"finite": bool(np.isfinite(y[k]).all())} for k, s in enumerate(scales)}
        except Exception as exc:  # noqa: BLE001
            out[wt] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    return out


def _line(res: dict) -> str:
    if "error" in res:
        return f"{res['wt']:>7} D={res['dim']:<4} ERROR {res['error'][:200]}"
    b = res["bytes_vs_ours"]
    s = f"{res['wt']:>7} D={res['dim']:<4} bytes {'equal' if b['equal'] else 'DIFFER ' + str(b)[:160]}"
    for out in ("float16", "float32"):
        f = res.get(f"forward_{out}")
        if f and f["max_abs_err"] is not None:
            s += f" | {out} err {f['max_abs_err']:.3g} rel {f['rel_err']:.2g} bound used {f['bound_used']:.2f}" \
                + (f" NONFINITE {f['nonfinite']}" if f["nonfinite"] else "")
        elif f:
            s += f" | {out} all {f['nonfinite']} outputs non-finite"
    return s


def _latency_ms(run, calls: int) -> float:
    torch = sys.modules["torch"]
    samples = []
    for k in range(calls):
        t0 = time.perf_counter()
        run(k)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_cases(args) -> dict:
    from benchmarks import sweep

    fb = _fbgemm()
    torch = fb["torch"]
    cases = workload_cases(args.workloads.split(","), [int(b) for b in args.batch_sizes.split(",") if b]) \
        + shard_cases(args.shards, args.shard_seed)
    results = []
    for wt in args.weight_types.split(","):
        tbe, key = None, None
        for case in cases:
            res = {"case": case.name, "wt": wt, "B": case.B, "T": len(case.rows), "dims": sorted(set(case.dims)),
                   "rows": sum(case.rows), "mean_bag": round(float(np.mean(case.bags)), 2)}
            try:
                if key != (case.rows, case.dims):  # one TBE per table set (batch sizes share it)
                    del tbe
                    torch.cuda.empty_cache()
                    tbe = _tbe(fb, list(zip(case.rows, case.dims)), wt, args.output_dtype)
                    tbe.fill_random_weights()
                    key = (case.rows, case.dims)
                sets = []
                for k in range(2):
                    i, o, w = case_inputs(case, k)
                    sets.append((torch.from_numpy(i.astype(np.int32)).cuda(),
                                 torch.from_numpy(o.astype(np.int32)).cuda(),
                                 None if w is None else torch.from_numpy(w).cuda()))

                def run(k, tbe=tbe, sets=sets):
                    with torch.no_grad():
                        return tbe(*sets[k % 2])

                for k in range(5):
                    run(k)
                torch.cuda.synchronize()
                res["kernel_ms"] = round(sweep.torch_kernel_ms(run, args.iters), 5)
                res["events_ms"] = round(sweep.torch_event_ms(run, args.iters, args.reps), 5)
                res["latency_ms"] = round(_latency_ms(run, args.iters), 5)
            except Exception as exc:  # noqa: BLE001
                res["error"] = f"{type(exc).__name__}: {exc}"[:400]
            results.append(res)
            print(f"{wt:>7} {case.name:<22} " + (f"kernel {res['kernel_ms']:.4f} ms  events {res['events_ms']:.4f}"
                  f"  latency {res['latency_ms']:.4f}" if "error" not in res else res["error"][:200]), flush=True)
        del tbe
        torch.cuda.empty_cache()
    return {"results": results, "output_dtype": args.output_dtype, "bounds_check": "NONE", "pooling": "sum",
            "iters": args.iters, "reps": args.reps}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks fbgemm_quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="bytes and forward against FBGEMM")
    mode.add_argument("--time", action="store_true", help="FBGEMM's IntNBit forward kernel time")
    ap.add_argument("--out", default="", help="a .json file or a directory (default benchmarks/results)")
    ap.add_argument("--rows", type=int, default=1000, help="--check: rows per table")
    ap.add_argument("--bags", type=int, default=512, help="--check: bags per forward")
    ap.add_argument("--bag-len", type=int, default=8, help="--check: mean bag length (uniform 0..2L)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default=WORKLOADS)
    ap.add_argument("--batch-sizes", default=BATCH_SIZES)
    ap.add_argument("--weight-types", default="int8,int4,float16")
    ap.add_argument("--shards", type=int, default=0, help="--time: also the first N sweep shards")
    ap.add_argument("--shard-seed", type=int, default=20261202)
    ap.add_argument("--output-dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch here
    from benchmarks import common

    payload = check(args) if args.check else time_cases(args)
    payload = {"meta": common.meta(mode="check" if args.check else "time"), **payload}
    print("saved", common.save("fbgemm-quant-" + ("check" if args.check else "time"), payload, args.out))


if __name__ == "__main__":
    main()
