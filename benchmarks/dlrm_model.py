"""The DLRM demo's whole model, timed: `python -m benchmarks dlrm_model --model dcnv2 --size mlperf --batch-size 65536
--emb-dtype float32 --steps 30 [--dump DIR --dump-batches 4] --out FILE.json`.

It builds the demo's model (`examples.dlrm.train.build`, the data drawn on the device by `train.DeviceData`),
timing the construction (model, data, jitted functions) and the initialisation of the tables and optimizer state
on the device (`jax.block_until_ready`, compile included), then measures:

- `full_step`: `--steps` training steps with each batch drawn on the device just before it (as the demo trains):
  wall ms per step after the first, examples/s; the device step (`train.measure_device_step`: pre-drawn batches,
  enqueued back to back, blocked once) and the device share = device step / wall step;
- `split`: the full jitted step against the embeddings alone (lookups + `apply_gradients` with a fixed output
  gradient: `train.measure_emb_share`), and with `--trace` (default on a GPU) a `jax.profiler` trace of a few
  steps summed by kernel name: our Pallas kernels (`tbe_*`, `prefix_scan`), matmuls (cuBLAS/CUTLASS gemms), the
  rest (XLA fusions, sorts, copies);
- `peak_bytes`: the device's peak memory (`memory_stats()`, None where not reported), after init and at the end.

`--dump DIR` writes the first `--dump-batches` K training batches for another framework (the torch side):
`DIR/meta.json` (model, table_rows, embedding_dim, bag_sizes, num_dense, batch_size, num_batches, bottom_mlp,
top_mlp (full widths, input excluded), dcn_layers, dcn_rank, emb_lr, dense_lr, eps, emb_dtype, matmul_precision)
and `DIR/batch{k}.npz` with `indices` int32 `[B * sum(bag_sizes)]` (no padding), `offsets` int32 `[26*B + 1]`
(feature-major, FBGEMM's format: bag (f, b) is `indices[offsets[f*B+b] : offsets[f*B+b+1]]`), `dense` float32
`[B, 13]`, `labels` float32 `[B]`. The same K batches are then timed through the step (cycled over `--steps`
steps, on the device already), `dumped_step`, so both frameworks run on identical ids.

Tables of 16 GiB or more (`train.IN_PLACE_BYTES`, the mlperf size) are timed in place: every measurement
continues training the one state (a copy of 97 GiB of tables would not fit).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import time

import jax
import numpy as np

from benchmarks import common


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks dlrm_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("dlrm", "dcnv2"), default="dcnv2")
    ap.add_argument("--size", default="mlperf", help="the demo's --size (tiny, small, gpu, mlperf)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the size's")
    ap.add_argument("--emb-dtype", choices=("float32", "float16"), default="float32")
    ap.add_argument("--matmul-precision", default=None,
                    help="default: the model's (dcnv2: tensorfloat32); bfloat16: bf16 operands, fp32 sums")
    ap.add_argument("--steps", type=int, default=30, help="timed training steps (after one that compiles)")
    ap.add_argument("--lr", type=float, default=None, help="dense learning rate (default: the demo's)")
    ap.add_argument("--emb-lr", type=float, default=None, help="tables' row-wise Adagrad lr (default: the demo's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", choices=("auto", "xla", "pallas"), default="auto")
    ap.add_argument("--dump", default=None, help="write the first --dump-batches training batches here")
    ap.add_argument("--dump-batches", type=int, default=4)
    ap.add_argument("--trace", choices=("auto", "on", "off"), default="auto",
                    help="profile a few steps by kernel name (auto: on a GPU)")
    ap.add_argument("--no-split", action="store_true", help="skip (b), the embeddings-vs-dense split")
    ap.add_argument("--out", default="", help="a .json file, or a directory (default benchmarks/results)")
    return ap.parse_args(argv)


def kernel_class(name: str) -> str:
    """"ours" (our Pallas kernels), "sort" (XLA's CUB radix sort: in these models only the TBE backward sorts;
    the torch side counts FBGEMM's sorts in its TBE part by the same patterns), "gemm" (cuBLAS / CUTLASS matmuls,
    cuBLAS's `nvjet_*` kernels included)
    or "other" (XLA fusions, copies; the TBE's few small int32 index fusions among them)."""
    low = name.lower()
    if "tbe_" in low or "prefix_scan" in low:
        return "ours"
    if any(k in low for k in ("radix", "cub::", "sort")):
        return "sort"
    if any(k in low for k in ("gemm", "cutlass", "xmma", "cublas", "matmul", "nvjet")):  # nvjet: cuBLAS's bf16
        return "gemm"
    return "other"


def dump_batches(path: str, arrays: list[dict], meta: dict) -> None:
    """`path/meta.json` and `path/batch{k}.npz` (the module doc's format) from device batches."""
    os.makedirs(path, exist_ok=True)
    for k, a in enumerate(arrays):
        off = np.asarray(a["offsets"], np.int32)
        np.savez(os.path.join(path, f"batch{k}.npz"), indices=np.asarray(a["indices"], np.int32)[: int(off[-1])],
                 offsets=off, dense=np.asarray(a["dense"], np.float32), labels=np.asarray(a["labels"], np.float32))
    with open(os.path.join(path, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)


def main(argv=None) -> dict:
    from examples.dlrm import data as data_lib
    from examples.dlrm import train
    from examples.dlrm.checkpoint import TrainState
    from examples.dlrm.model import DLRM

    args = _parse(argv)
    if args.size == "mlperf":  # before anything starts jax's GPU backend
        train.allow_most_device_memory()
    sizes = (train.DCNV2_SIZES if args.model == "dcnv2" else train.SIZES)[args.size]
    b = args.batch_size or sizes.batch_size
    lr = sizes.lr if args.lr is None else args.lr
    emb_lr = sizes.emb_lr if args.emb_lr is None else args.emb_lr
    dense_opt = "adagrad" if args.model == "dcnv2" else "adam"
    log = lambda *a: print(*a, flush=True)  # noqa: E731

    # Build (model objects, data, jitted functions), then init on the device.
    t0 = time.perf_counter()
    data_cfg, config = train.configs(args.size, args.model, impl=args.impl, emb_dtype=args.emb_dtype,
                                     matmul_precision=args.matmul_precision)
    model = DLRM(config)
    built = train.build(model, lr, emb_lr, None, "rowwise_adagrad", dense_opt=dense_opt)
    gen = data_lib.ClickLogGenerator(data_cfg, b, seed=args.seed)
    dd = train.DeviceData(gen, model)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(TrainState(0, *built.init(jax.random.key(args.seed))))
    init_s = time.perf_counter() - t0
    peak_init = train.peak_memory()
    mem = model.table_bytes()
    in_place = mem["total"] >= train.IN_PLACE_BYTES
    emb = model.emb_unsharded
    log(f"dlrm_model: {args.model} size={args.size} batch {b} tables {args.emb_dtype} ({mem['total'] / 2**30:.2f} GiB, "
        f"{sum(config.table_rows):,} rows) matmuls {config.matmul_precision} | TBE: "
        f"{'Pallas kernels' if emb.uses_kernel() else 'XLA path'} | build {build_s:.2f} s, init {init_s:.2f} s, "
        f"peak {'n/a' if peak_init is None else f'{peak_init / 2**30:.2f} GiB'}")

    res = {"meta": common.meta(model=args.model, size=args.size, batch_size=b, emb_dtype=args.emb_dtype,
                               config=dataclasses.asdict(config), dense_opt=dense_opt, lr=lr, emb_lr=emb_lr,
                               ids_per_batch=int(gen.padded_len), table_bytes=mem["total"], in_place=in_place,
                               kernels=emb.uses_kernel()),
           "build_s": build_s, "init_s": init_s, "peak_bytes_after_init": peak_init}

    # (a) The demo's step, each batch drawn on the device just before it.
    def step(st, batch):
        dense, emb_p, es, opt, loss = built.train_step(st.dense_params, st.emb_params, st.emb_state,
                                                       st.dense_opt_state, built.emb_opt, batch)
        return TrainState(st.step + 1, dense, opt, emb_p, es), loss

    losses = []
    t_warm = None
    for i in range(args.steps + 1):
        batch = dd.batch(i)
        batch.pop("logit")
        state, loss = step(state, batch)
        losses.append(loss)
        if i == 0:
            jax.block_until_ready(loss)
            t_warm = time.perf_counter()
            first_s = t_warm - t0 - init_s
    jax.block_until_ready(state)
    wall_ms = (time.perf_counter() - t_warm) * 1e3 / max(args.steps, 1)
    k_dev = max(2, min(args.steps, 10))
    dev_batches = list(dd.train_batches(args.steps + 1, args.steps + 1 + k_dev))
    if in_place:
        dev_ms, state = train.measure_device_step(built, state, dev_batches, in_place=True)
    else:
        dev_ms = train.measure_device_step(built, state, dev_batches)
    res["full_step"] = {"wall_ms": wall_ms, "examples_per_s": b * 1e3 / wall_ms, "device_ms": dev_ms,
                        "device_share": dev_ms / wall_ms, "first_step_s": first_s,
                        "loss_first": float(losses[0]), "loss_last": float(losses[-1])}
    log(f"(a) full step, data drawn on the device: {wall_ms:.2f} ms wall, {b * 1e3 / wall_ms:,.0f} examples/s; "
        f"device step {dev_ms:.2f} ms (share {dev_ms / wall_ms:.2f}); loss {float(losses[0]):.4f} -> "
        f"{float(losses[-1]):.4f}")

    # (b) Embeddings vs dense.
    if not args.no_split:
        reps = 10 if jax.default_backend() == "gpu" else 2
        m = train.measure_emb_share(model, built, state, dev_batches[0], reps, in_place=in_place)
        state = m.pop("state", state)
        res["split"] = {"step_ms": m["step_ms"], "emb_ms": m["emb_ms"], "emb_share": m["share"],
                        "dense_ms_estimate": m["step_ms"] - m["emb_ms"]}
        log(f"(b) one batch: full step {m['step_ms']:.2f} ms, embeddings alone {m['emb_ms']:.2f} ms "
            f"({100 * m['share']:.0f}%), the rest ~{m['step_ms'] - m['emb_ms']:.2f} ms")
    if not args.no_split and (args.trace == "on" or (args.trace == "auto" and jax.default_backend() == "gpu")):
        sets = [(bt,) for bt in dev_batches[:2]]
        kernels = common.profile(lambda st, bt: step(st, bt)[0], state, sets, 3)
        state = None  # (the profile's carry consumed it; the trace's steps went on training)
        by_class = collections.defaultdict(float)
        for name, v in kernels.items():
            by_class[kernel_class(name)] += v["ms"]
        res["split"]["trace_ms"] = dict(by_class)
        res["split"]["trace_top"] = dict(list(kernels.items())[:25])
        log("    trace (ms per step): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_class.items())))
        common.print_kernels(kernels, 12)

    # Dumped batches: written for the torch side, then timed (cycled) through the same step.
    if args.dump:
        kb = max(1, args.dump_batches)
        arrays = [dd.batch(i) for i in range(kb)]  # the first K training batches (stream "train", i = 0..K-1)
        meta = {"model": args.model, "table_rows": [int(e) for e in config.table_rows],
                "embedding_dim": config.embedding_dim,
                "bag_sizes": None if data_cfg.bag_sizes is None else [int(s) for s in data_cfg.bag_sizes],
                "num_dense": data_cfg.num_dense, "batch_size": b, "num_batches": kb,
                "bottom_mlp": [*config.bottom_mlp, config.embedding_dim], "top_mlp": [*config.top_mlp, 1],
                "dcn_layers": config.dcn_layers, "dcn_rank": config.dcn_rank, "emb_lr": emb_lr, "dense_lr": lr,
                "eps": 1e-8, "emb_dtype": args.emb_dtype, "matmul_precision": config.matmul_precision}
        dump_batches(args.dump, arrays, meta)
        for a in arrays:
            a.pop("logit")
        if state is None:
            state = jax.block_until_ready(TrainState(0, *built.init(jax.random.key(args.seed))))
        cycled = [arrays[i % kb] for i in range(max(args.steps, kb))]
        if in_place:
            dump_ms, state = train.measure_device_step(built, state, cycled, in_place=True)
        else:
            dump_ms = train.measure_device_step(built, state, cycled)
        res["dumped_step"] = {"dir": args.dump, "num_batches": kb, "device_ms": dump_ms,
                              "examples_per_s": b * 1e3 / dump_ms}
        log(f"dumped {kb} batches to {args.dump}; the step on them (cycled, on the device): {dump_ms:.2f} ms, "
            f"{b * 1e3 / dump_ms:,.0f} examples/s")

    res["peak_bytes"] = peak = train.peak_memory()
    path = common.save("dlrm_model", res, args.out, tag=f"{args.model}-{args.size}-b{b}-{args.emb_dtype}")
    log(f"peak device memory {'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}; saved {path}")
    res["path"] = path
    return res


if __name__ == "__main__":
    main()
