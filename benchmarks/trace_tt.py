"""Per-kernel GPU time of a TT training step (`tbe_jax.train_step` on a `TTEmbeddingBag`), from a profiler trace.

The stages of `profile_tt.py` are each jitted alone; this traces the real step (forward plan and kernels,
backward, optimizer in one jitted program, as a user runs it) and sums the device events by kernel name, so
the XLA fusions, the sorts and the Pallas kernels of one step are seen together. Also reports the step's
enqueued time (many steps, one block) next to the sum of its kernel times.

  python -m benchmarks trace_tt --batches 32768 --out benchmarks/results/tt-trace-<stamp>.json
  python -m benchmarks trace_tt --configs '{"bwd_rows": 16}' '{"precision": "tf32"}'
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
import tt_jax
from tt_jax import workloads
from tt_jax.kernels import forward as kf
from benchmarks.bench_tt import config_fields, numpy_cores
from benchmarks import common
from benchmarks.common import print_kernels, profile

OPTS = {"sgd": lambda: tt_jax.SGD(0.01), "adagrad": lambda: tt_jax.Adagrad(0.01),
        "rowwise": lambda: tt_jax.RowwiseAdagrad(0.01)}


def accuracy(emb, params, batch, cores, specs):
    """Relative error of `emb`'s forward and core gradients (of 0.5 sum(out^2)) against the XLA path in fp32
    at HIGHEST precision, on one batch."""
    ref = tt_jax.TTEmbeddingBag(specs, impl="xla")
    idx, off = batch

    def loss_out(e, p):
        out = e(p, idx, off)
        return 0.5 * jnp.sum(out**2), out

    with jax.default_matmul_precision("highest"):
        (_, out_r), g_r = jax.jit(jax.value_and_grad(lambda p: loss_out(ref, p), has_aux=True))(params)
        (_, out_e), g_e = jax.jit(jax.value_and_grad(lambda p: loss_out(emb, p), has_aux=True))(params)

    def rel(a, b):
        return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))

    return {"forward": rel(out_e, out_r),
            "grads": max(rel(a, b) for a, b in zip(jax.tree.leaves(g_e), jax.tree.leaves(g_r)))}


def make_step(emb, opt):
    def step(carry, idx, off):
        params, state = carry
        res = tbe_jax.train_step(lambda _, out: 0.5 * jnp.sum(out**2), None,
                                 tbe_jax.SparseLookup(emb, opt, params, state, idx, off))
        return res.params, res.opt_state
    return jax.jit(step, donate_argnums=(0,))


def make_forward(emb):
    """The forward alone (inference: no plans kept), with a scalar carried so that each call depends on the last."""
    def step(carry, idx, off):
        params, acc = carry
        return params, acc + emb(params, idx, off)[0, 0]
    return jax.jit(step)


def enqueued_ms(step, carry, sets, iters):
    carry = step(carry, *sets[0])
    jax.block_until_ready(carry)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(iters):
            carry = step(carry, *sets[i % len(sets)])
        jax.block_until_ready(carry)
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best, carry


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks trace_tt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="a", choices=sorted(workloads.PRESETS))
    ap.add_argument("--batches", default="32768")
    ap.add_argument("--opt", default="adagrad", choices=sorted(OPTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--configs", nargs="*", default=[], help="TTKernelConfig variants as JSON objects (one trace each)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--forward", action="store_true", help="trace the forward alone instead of the training step")
    ap.add_argument("--accuracy", action="store_true",
                    help="also the forward's and the core gradients' relative error (max abs error / max abs value) "
                         "against impl='xla' at HIGHEST precision")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    wl = workloads.PRESETS[args.workload]()
    specs = list(wl.specs)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "workload": args.workload, "opt": None if args.forward else args.opt, "runs": []}
    cores = numpy_cores(specs)
    for batch in [int(b) for b in args.batches.split(",")]:
        rng = np.random.default_rng(batch)
        perms = [np.random.default_rng(1).permutation(s.num_embeddings) for s in specs] if wl.exact_zipf else None
        sets = [tuple(jnp.asarray(a) for a in wl.make_batch(rng, batch, perms=perms)) for _ in range(2)]
        for entry in ["default"] + list(args.configs):
            cfg = kf.TTKernelConfig() if entry == "default" else kf.TTKernelConfig(**config_fields(entry))
            emb = tt_jax.TTEmbeddingBag(specs, impl="pallas", interpret=not on_gpu, config=cfg)
            opt = OPTS[args.opt]()
            params = {"cores": jax.tree.map(jnp.copy, cores)}
            carry = (params, jnp.zeros((), jnp.float32) if args.forward else emb.init_opt_state(params, opt))
            err = accuracy(emb, params, sets[0], cores, specs) if args.accuracy else None
            step = make_forward(emb) if args.forward else make_step(emb, opt)
            ms, carry = enqueued_ms(step, carry, sets, args.iters)
            kernels = profile(step, carry, sets, args.iters)
            total = sum(v["ms"] for v in kernels.values())
            res["runs"].append({"B": batch, "config": entry, "enqueued_ms": ms, "kernel_ms": total,
                                "lookups": int(sets[0][0].shape[0]), "kernels": kernels, "rel_error": err})
            print(f"== B {batch} {entry}: enqueued {ms:.3f} ms/step, device events {total:.3f} ms/step"
                  + (f", rel. error forward {err['forward']:.2e} core grads {err['grads']:.2e}" if err else ""))
            print_kernels(kernels, args.top)
    if args.out:
        print("saved", common.save("tt-trace", res, args.out))


if __name__ == "__main__":
    main()
