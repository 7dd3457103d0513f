"""Per-kernel GPU time of the TBE backward step (`apply_gradients`), from a profiler trace.

Runs `--iters` donated `apply_gradients` steps (or, with --fwd-bwd, training steps
through `tbe_jax.train_step`) under `jax.profiler.trace`, reads the
trace's JSON (`plugins/profile/*/*.trace.json.gz`) and sums the device events by
kernel name: ms per step for each kernel (XLA fusions, CUB sort passes, the
Pallas kernels), sorted by time. Saves JSON with --out.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax

import tbe_jax
from benchmarks import common
from benchmarks.bench_backward import sparse_train_step
from benchmarks.common import EPS, LR, make_sets, print_kernels, profile, with_opt, workload


def fresh_carry(emb, opt):
    """(tables, optimizer state) as a step's first carry."""
    params = emb.init(jax.random.key(0))
    return params, emb.init_opt_state(params, opt)


def variant(base: str, item: str) -> tuple[tbe_jax.BackwardConfig, bool]:
    """(BackwardConfig, pad_rows) of a `--variants` item: a JSON object of BackwardConfig fields over `--config`'s;
    the extra key "pad_rows" (false: unpadded storage, `TableBatchedEmbedding(pad_rows=False)`)."""
    fields = {**(json.loads(base) if base.strip() else {}), **(json.loads(item) if item.strip() else {})}
    pad = bool(fields.pop("pad_rows", True))
    return common.config(json.dumps(fields), tbe_jax.BackwardConfig), pad


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks trace_backward", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="base,zipf,fp32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fwd-bwd", action="store_true")
    ap.add_argument("--forward", action="store_true", help="trace the forward (the lookup) alone")
    ap.add_argument("--config", default="", help='BackwardConfig fields as JSON, e.g. \'{"small_block": 16}\'')
    ap.add_argument("--dims", default="",
                    help="';'-separated mixed-dim models (lo-hi/step, cycled over base's 32 tables), traced after the presets")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="A/Bs in one process: each a JSON object of BackwardConfig fields over --config (and "
                         "\"pad_rows\": false for unpadded storage); every workload is traced once per variant, "
                         "variants interleaved per workload ('' or '{}' is the base)")
    ap.add_argument("--host", action="store_true",
                    help="also trace the host side: the host events per step (XLA's thunks, jax's dispatch), by name")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    variants = args.variants or [""]
    res = {"meta": common.meta(), "config": args.config, "variants": variants, "presets": {}}
    workloads = [workload(n) for n in filter(None, args.presets.split(","))]
    workloads += [workload(f"dims{spec}") for spec in filter(None, args.dims.split(";"))]
    for wl, (vi, variant_text) in ((wl, v) for wl in workloads for v in enumerate(variants)):
        name = wl.name if len(variants) == 1 else f"{wl.name}[{vi}:{variant_text}]"
        cfg, pad_rows = variant(args.config, variant_text)
        sets = make_sets(wl, 2)
        emb = tbe_jax.TableBatchedEmbedding(common.tables(wl), impl="pallas", weights_dtype=wl.weights_dtype,
                                            output_dtype=wl.output_dtype, backward_config=cfg, pad_rows=pad_rows,
                                            interpret=common.interpret())
        opt = tbe_jax.RowwiseAdagrad(learning_rate=LR, eps=EPS)
        if args.forward:
            fwd = jax.jit(lambda p, i, o, s: emb(p, i, o, s))

            def step(carry, opt, i, o, s, g):  # the tables unchanged; the output kept so it is computed
                return carry[0], carry[1], fwd(carry[0], i, o, s)
        elif args.fwd_bwd:
            step = sparse_train_step(emb)
        else:
            @functools.partial(jax.jit, donate_argnums=(0,))
            def step(carry, opt, i, o, s, g):
                return emb.apply_gradients(*carry, opt, i, o, g, s)
        kernels = profile(step, fresh_carry(emb, opt), with_opt(opt, sets), args.iters)

        total = sum(v["ms"] for v in kernels.values())
        res["presets"][name] = {"total_ms": total, "kernels": kernels}
        print(f"== {name}: {total:.3f} ms of device events per step")
        print_kernels(kernels, 25)
        if args.host:
            # fresh tables and state: the traced steps donated the previous ones
            host = profile(step, fresh_carry(emb, opt), with_opt(opt, sets), args.iters, host=True)
            res["presets"][name]["host"] = host
            print(f"   host events per step (top 25 of {len(host)} names; nested events overlap):")
            print_kernels(host, 25)
    if args.out:
        print("saved", common.save("trace-backward", res, args.out))


if __name__ == "__main__":
    main()
