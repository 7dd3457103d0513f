"""Our DLRMv2 (DCNv2) step against torch + FBGEMM's, from the two benchmarks' JSON files.

    python -m benchmarks dlrm_compare --ours A.json [B.json ...] --torch C.json [D.json ...] [--out FILE.json]

Pairs each `benchmarks.dlrm_model` result with the `benchmarks/dlrm_torch.py` result of the same batch size,
table dtype and matmul precision (both timed on the same dumped batches), prints a markdown table (examples/s,
step ms, embeddings ms, build + init s, peak HBM, ratios) and with `--out` writes the pairs and ratios as one
JSON file.
"""

from __future__ import annotations

import argparse
import json


def _matmul(name) -> str:
    """One name per matmul precision on both sides (torch results before `--matmul` ran TF32)."""
    name = name or "tensorfloat32"
    return {"bf16": "bfloat16", "default": "tensorfloat32"}.get(name, name)


def _key(batch_size, dtype, matmul) -> tuple[int, str, str]:
    return int(batch_size), str(dtype), _matmul(matmul)


def compare(ours: list[dict], torch: list[dict]) -> list[dict]:
    by_key = {_key(t["batch_size"], t["emb_dtype"], t.get("matmul")): t for t in torch}
    rows = []
    for o in ours:
        m = o["meta"]
        mm = _matmul((m.get("config") or {}).get("matmul_precision"))
        t = by_key.get(_key(m["batch_size"], m["emb_dtype"], mm))
        if t is None:
            continue
        dumped = (o.get("dumped_step") or {}).get("device_ms")
        step = dumped or o["full_step"]["wall_ms"]  # the same ids as torch's, else each batch drawn on the device
        emb = o["split"]["emb_ms"]
        tr = o["split"].get("trace_ms") or {}
        # the embedding part inside the step's profile: our kernels and the sort (torch's side counts FBGEMM's
        # kernels and sorts by the same patterns); None for traces classified before "sort" was a class
        emb_in_step = tr["ours"] + tr["sort"] if "sort" in tr else None
        rows.append({
            "batch_size": m["batch_size"], "emb_dtype": m["emb_dtype"], "matmul": mm,
            "ours": {"step_ms_dumped_batches": step, "step_ms_full": o["full_step"]["wall_ms"],
                     "examples_per_s": m["batch_size"] * 1e3 / step,
                     "step_source": "dumped batches" if dumped else "full step (batches drawn on the device)", "device_share": o["full_step"]["device_share"],
                     "emb_ms": emb, "emb_in_step_ms": emb_in_step, "trace_ms": o["split"].get("trace_ms"), "build_init_s": o["build_s"] + o["init_s"],
                     "peak_bytes": o.get("peak_bytes") or o.get("peak_bytes_after_init")},
            "torch_fbgemm": {"step_ms": t["step_ms"], "examples_per_s": t["examples_per_s"],
                             "device_share": t["device_share"], "tbe_ms": t["tbe_alone_kernel_ms"],
                             "tbe_in_step_ms": t["tbe_kernel_ms_per_step"], "dense_ms": t["dense_kernel_ms_per_step"],
                             "build_init_s": t["build_init_s"], "peak_bytes": t["hbm"]["max_allocated_bytes"],
                             "dense_optimizer": t["dense_optimizer"]["impl"]},
            "throughput_ratio": t["step_ms"] / step,
            "embedding_ratio": t["tbe_alone_kernel_ms"] / emb,
            "embedding_in_step_ratio": (t["tbe_kernel_ms_per_step"] / emb_in_step) if emb_in_step else None,
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| batch | tables | matmuls | ours ex/s | torch+FBGEMM ex/s | ratio | ours emb ms | FBGEMM TBE ms | "
             "ratio | "
             "in the step: ours / FBGEMM ms | ratio | build+init s (ours / torch) | peak HBM GiB (ours / torch) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, t = r["ours"], r["torch_fbgemm"]
        peak = lambda b: "n/a" if b is None else f"{b / 2**30:.1f}"  # noqa: E731
        e = o.get("emb_in_step_ms")
        in_step = "n/a" if e is None else f"{e:.2f} / {t['tbe_in_step_ms']:.2f}"
        in_ratio = "n/a" if e is None else f"{r['embedding_in_step_ratio']:.2f}x"
        lines.append(f"| {r['batch_size']} | {r['emb_dtype']} | {r.get('matmul', 'tensorfloat32')} | "
                     f"{o['examples_per_s'] / 1e6:.2f}M | "
                     f"{t['examples_per_s'] / 1e6:.2f}M | {r['throughput_ratio']:.2f}x | {o['emb_ms']:.2f} | "
                     f"{t['tbe_ms']:.2f} | {r['embedding_ratio']:.2f}x | {in_step} | {in_ratio} | "
                     f"{o['build_init_s']:.1f} / "
                     f"{t['build_init_s']:.1f} | {peak(o['peak_bytes'])} / {peak(t['peak_bytes'])} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", nargs="+", required=True)
    ap.add_argument("--torch", nargs="+", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    ours = [json.load(open(p)) for p in args.ours]
    torch = [json.load(open(p)) for p in args.torch]
    rows = compare(ours, torch)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"bench": "dlrm_compare", "note": args.note, "rows": rows,
                       "ours_meta": [o["meta"] for o in ours],
                       "torch_env": [t["env"] for t in torch], "ours_raw": ours, "torch_raw": torch}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
