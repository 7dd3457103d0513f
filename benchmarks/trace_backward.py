"""Per-kernel GPU time of the TBE backward step (`apply_gradients`), from a profiler trace.

Runs `--iters` donated `apply_gradients` steps (or, with --fwd-bwd, training steps
through `tbe_jax.train_step`) under `jax.profiler.trace`, reads the
trace's JSON (`plugins/profile/*/*.trace.json.gz`) and sums the device events by
kernel name: ms per step for each kernel (XLA fusions, CUB sort passes, the
Pallas kernels), sorted by time. Saves JSON with --out.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import tbe_jax  # noqa: E402
from tbe_jax import testing  # noqa: E402
from bench_backward import EPS, LR, make_sets, sparse_train_step, with_opt  # noqa: E402


def _events(log_dir: str, device: bool) -> list[dict]:
    """The complete ('X') events of the trace's device processes (or, `device=False`, of its host ones)."""
    (path,) = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path, "rb") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {pid for pid, n in names.items() if "GPU" in n or "/device:" in n}
    if device and not dev:
        print("no device process in the trace; processes:", sorted(names.values()))
    return [e for e in events if e.get("ph") == "X" and (e.get("pid") in dev) == device and "dur" in e]


def device_events(log_dir: str) -> list[dict]:
    return _events(log_dir, True)


def host_events(log_dir: str) -> list[dict]:
    return _events(log_dir, False)


def fresh_carry(emb, opt):
    """(tables, optimizer state) as a step's first carry."""
    params = emb.init(jax.random.key(0))
    return params, emb.init_opt_state(params, opt)


def profile(step, carry, sets, iters, host=False):
    for a in sets:  # compile + warm-up
        carry = step(carry, *a)
    jax.block_until_ready(carry)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(iters):
                carry = step(carry, *sets[i % len(sets)])
            jax.block_until_ready(carry)
        events = host_events(d) if host else device_events(d)
    per = collections.defaultdict(float)
    count = collections.Counter()
    for e in events:
        per[e["name"]] += e["dur"] / 1e3 / iters
        count[e["name"]] += 1
    return {k: {"ms": per[k], "calls_per_step": count[k] / iters} for k in sorted(per, key=per.get, reverse=True)}


def set_private(spec: str, modules) -> None:
    """`--private K=V,...`: set each module constant K (an int) of the first of `modules` that has it, before
    anything compiles."""
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        mod = next((m for m in modules if hasattr(m, k)), None)
        if mod is None:
            raise SystemExit(f"none of {[m.__name__ for m in modules]} has {k}")
        setattr(mod, k, type(getattr(mod, k))(int(v)))


workload = testing.workload


def backward_modules():
    """The modules whose upper-case constants `--private` and `--variants` may set."""
    from tbe_jax import _pallas, runs
    from tbe_jax.kernels import backward as bwd_kernels, backward_config, backward_long, backward_plan, rle, scan
    # The defining modules before `backward`, which re-exports some of their constants (SEGMENT_BUFFERS, ...).
    return (backward_plan, backward_config, backward_long, bwd_kernels, _pallas, runs, scan, rle)


class Variants:
    """`--variants` items: 'k=v,K=V' sets BackwardConfig fields (lower case) and module constants (upper case);
    `pad_rows=0` builds the embedding with unpadded storage (`TableBatchedEmbedding(pad_rows=False)`)."""

    def __init__(self, modules, base: str = ""):
        self.modules, self.base = modules, base
        self.defaults = {m: {k: getattr(m, k) for k in dir(m) if k.isupper()} for m in modules}

    def apply(self, variant: str) -> tbe_jax.BackwardConfig:
        """Restore every constant, set `base` + `variant`'s, and return their BackwardConfig."""
        for m, consts in self.defaults.items():
            for k, v in consts.items():
                setattr(m, k, v)
        items = [p for p in (self.base + "," + variant).split(",") if p]
        self.pad_rows = all(p != "pad_rows=0" for p in items)
        items = [p for p in items if not p.startswith("pad_rows=")]
        set_private(",".join(p for p in items if p.split("=")[0].isupper()), self.modules)
        return tbe_jax.BackwardConfig(**{k: int(v) for k, v in (p.split("=") for p in items
                                                               if not p.split("=")[0].isupper())})


def print_kernels(kernels: dict, top: int):
    """The `top` kernels of `profile`'s result: ms per step, calls per step, name."""
    for k, v in list(kernels.items())[:top]:
        print(f"  {v['ms']:7.4f} ms  x{v['calls_per_step']:.0f}  {k[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="base,zipf,fp32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fwd-bwd", action="store_true")
    ap.add_argument("--forward", action="store_true", help="trace the forward (the lookup) alone")
    ap.add_argument("--config", default="", help="BackwardConfig overrides, e.g. small_block=16,num_warps=2")
    ap.add_argument("--dims", default="",
                    help="';'-separated mixed-dim models (lo-hi/step, cycled over base's 32 tables), traced after the presets")
    ap.add_argument("--private", default="",
                    help="A/B of module constants of tbe_jax.kernels.backward*, tbe_jax._pallas or tbe_jax.runs, "
                         "e.g. SEGMENT_BUFFERS=16 (BackwardConfig fields, e.g. narrow_block=16: --config)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="A/Bs in one process: each 'k=v,K=V' sets BackwardConfig fields (lower case) and module "
                         "constants (upper case) on top of --config/--private; every workload is traced once per "
                         "variant, variants interleaved per workload ('' is the base)")
    ap.add_argument("--host", action="store_true",
                    help="also trace the host side: the host events per step (XLA's thunks, jax's dispatch), by name")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    modules = backward_modules()
    set_private(args.private, modules)
    configs = Variants(modules, args.config)
    variants = args.variants or [""]
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "config": args.config,
           "private": args.private, "variants": variants, "presets": {}}
    workloads = [workload(n) for n in filter(None, args.presets.split(","))]
    workloads += [workload(f"dims{spec}") for spec in filter(None, args.dims.split(";"))]
    for wl, (vi, variant) in ((wl, v) for wl in workloads for v in enumerate(variants)):
        name = wl.name if len(variants) == 1 else f"{wl.name}[{vi}:{variant}]"
        cfg = configs.apply(variant)
        feats = wl.features()
        sets = make_sets(wl, 2)
        tables = [tbe_jax.TableSpec(e, d, bag_size_hint=l) for e, d, l in feats]
        emb = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", weights_dtype=wl.weights_dtype,
                                            output_dtype=wl.output_dtype, backward_config=cfg,
                                            pad_rows=configs.pad_rows)
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
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
