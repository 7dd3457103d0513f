"""JAX's own enqueued-over-device ratio: calls that are not ours, timed as the sweep times ours.

Issue 35 asks that a jitted call's enqueued time (calls back to back, blocked once) be within 1.1x of its device
time (the profiler's kernel time) wherever the device time is at least 50 us. This probe measures that ratio for
programs that contain none of our code, at device times from ~25 us to ~0.8 ms:
- `xla`: one XLA fusion, `x * a + b` over a float32 array (bandwidth-bound, one kernel);
- `xla3`: three dependent fusions of the same total bytes (a program of a few kernels);
- `pallas`: one Pallas-Triton kernel copying the array (a custom-call thunk, as our kernels are).
Per case: `device_ms` (kernel time per call), `span_ms` (first kernel's start to the last one's end, per call: the
GPU's idle gaps between calls show as span > device), `enqueued_ms` (the sweep's `common.enqueued_ms`), `host_us`
(`common.host_us`), and `gap_us`, enqueued minus device per call (what a call costs beyond its kernels).

    python -m benchmarks probe_enqueue_floor --out benchmarks/results/probe-enqueue-floor-<date>-<gpu>.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from benchmarks import common, enqueue_gap


def _pallas_copy(x):
    from tbe_jax.pallas_compat import pallas_call, pl, plgpu

    block = 4096

    def kernel(x_ref, o_ref):
        i = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
        ok = i < x_ref.shape[0]
        plgpu.store(o_ref.at[i], plgpu.load(x_ref.at[i], mask=ok, other=0.0) * 2.0 + 1.0, mask=ok)

    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(pl.cdiv(x.shape[0], block),),
                       compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=common.interpret(),
                       name="probe_copy")(x)


def _cases():
    def xla(x):
        return x * 1.5 + 0.5

    def xla3(x):
        y = x * 1.5 + 0.5
        y = jax.lax.optimization_barrier(y)
        y = y * 0.5 - 1.0
        y = jax.lax.optimization_barrier(y)
        return y + x

    return {"xla": xla, "xla3": xla3, "pallas": _pallas_copy}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_enqueue_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="8,16,32,64,128,256,512", help="array sizes (MiB of float32 read per call)")
    ap.add_argument("--cases", default="xla,xla3,pallas")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cases = _cases()
    rows = []
    for name in args.cases.split(","):
        fn = jax.jit(cases[name])
        for mib in (int(m) for m in args.mib.split(",")):
            n = mib * 2**20 // 4
            xs = [jax.random.normal(jax.random.key(k), (n,), jnp.float32) for k in range(2)]

            def run(k, fn=fn, xs=xs):
                return fn(xs[k % 2])

            jax.block_until_ready([run(k) for k in range(3)])
            dev, span, _ = enqueue_gap.profile_calls(run, args.iters)
            enq = common.enqueued_ms(run, args.iters, args.reps)
            host = common.host_us(run, 20)
            row = {"case": name, "mib": mib, "device_ms": round(dev, 5), "span_ms": round(span, 5),
                   "enqueued_ms": round(enq, 5),
                   "host_us": round(host, 2), "ratio": round(enq / max(dev, 1e-9), 3), "gap_us": round((enq - dev) * 1e3, 1)}
            rows.append(row)
            print(f"{name:>7} {mib:>4} MiB  device {dev:.4f} ms  span {span:.4f}  enqueued {enq:.4f}  "
                  f"ratio {enq / max(dev, 1e-9):.3f}  "
                  f"gap {row['gap_us']:.1f} us  host {host:.1f} us", flush=True)
            del xs
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind, "iters": args.iters, "reps": args.reps, "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
        print("saved", args.out)


if __name__ == "__main__":
    main()
