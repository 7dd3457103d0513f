"""Issue 40: can a row copy over the bus run beside other work in one jitted program?

The host tier's prefetch runs its copies between the step's kernels, on one stream (docs/host_memory.md, "The
pipeline does not overlap"). JAX can put part of a program on another stream,
`jax.experimental.compute_on.compute_on("gpu_stream:1")`, which XLA honours only with
`xla_gpu_experimental_stream_annotation` set. This times, in one program each:

- "work": HBM-only work standing in for a training step (`--work-iters` gathers and sums over an HBM table);
- "gather": `--count` rows of a `--rows` x `--dim` fp16 pinned host buffer, in host-row order, into a fresh HBM
  buffer (`kernels.copy_rows.gather_rows`, a prefetch's fill without its scatter);
- "write": the same rows written into the host buffer in place (`copy_rows`, a prefetch's write-back);
- "work + gather" and "work + write", the copy plain or under `compute_on("gpu_stream:1")`, each compiled with
  the stream-annotation option off and on.

If "work + gather" on a second stream with the option on takes about max(work, gather) rather than their sum, the
copies can hide behind a step whose buffers they do not share. `--programs N` caps the copy kernels' grid at N
programs: a copy of one program per block fills every SM with warps waiting on the bus, so work on the other
stream could only start as they finish (session 39 saw no overlap, 0.838 ms against 0.378 + 0.419). Each variant runs in its own process (a
refused one can abort it) and prints ms per call (enqueued calls, blocked once) and the result's checksum.

    python -m benchmarks probe_host_overlap --rows 8000000 --count 81000
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from tbe_jax import memory
from tbe_jax.kernels.copy_rows import copy_rows, gather_rows

VARIANTS = ("work", "gather", "write", "work+gather", "work+gather@stream", "work+write", "work+write@stream")


def _side(fn, on_stream: bool, space):
    """`fn` as it runs in the program: plain, or on `"gpu_stream:1"`. jax 0.11's `compute_on` is a function
    transform taking the outputs' memory space (`space`: `jax.memory.Space.Device` or `.Host`); jax 0.10.2 names
    that form `compute_on2` (its `compute_on` is a context manager)."""
    if not on_stream:
        return fn
    from jax.experimental import compute_on as co

    transform = co.compute_on if "out_memory_spaces" in inspect.signature(co.compute_on).parameters else co.compute_on2
    # `fn` itself, not `jax.jit(fn)`: with the jitted function inside, jax 0.11.2 on an H100 refused every
    # variant at run time ("No ExecutionStreamId found for call-start ... only reachable through embedded
    # calls": the annotated call sat inside another call; results/archive/host-stage-ab-20261206-s38-NVIDIA_H100.log)
    return transform(fn, compute_type="gpu_stream:1", out_memory_spaces=space)


def run_variant(args, name: str, annotate: bool) -> dict:
    interpret = common.interpret()
    rng = np.random.default_rng(0)
    host = memory.host_full((args.rows, args.dim), jnp.float16, 1)
    table = jnp.ones((args.table_rows, args.dim), jnp.float16)
    rows = jnp.asarray(np.sort(rng.choice(args.rows, args.count, replace=False)).astype(np.int32))
    ids = jnp.asarray(rng.integers(0, args.table_rows, args.work_ids).astype(np.int32))
    stage = jnp.ones((args.count, args.dim), jnp.float16)

    def work(t, i):
        acc = jnp.zeros((args.dim,), jnp.float32)
        for k in range(args.work_iters):  # independent gathers + sums: HBM-bound, no host buffer
            acc = acc + jnp.sum(t[(i + k) % t.shape[0]].astype(jnp.float32), axis=0)
        return acc

    programs = args.programs or None  # a capped grid leaves SMs to the work beside the copy

    def gather(h, r):
        return gather_rows(h, r, kernel=True, interpret=interpret, name="probe", programs=programs)

    def write(h, s, r):
        return memory.keep_on_host(copy_rows(h, s, r, jnp.arange(r.shape[0], dtype=jnp.int32), kernel=True,
                                             interpret=interpret, name="probe", programs=programs))

    on_stream = name.endswith("@stream")
    kind = name.removesuffix("@stream")
    g, w = _side(gather, on_stream, jax.memory.Space.Device), _side(write, on_stream, jax.memory.Space.Host)
    opts = {"xla_gpu_experimental_stream_annotation": True} if annotate else None
    if kind == "work":
        f, a, donate = (lambda t, i: work(t, i)), (table, ids), ()
    elif kind == "gather":
        f, a, donate = (lambda h, r: gather(h, r)), (host, rows), ()
    elif kind == "write":
        f, a, donate = (lambda h, s, r: write(h, s, r)), (host, stage, rows), (0,)
    elif kind == "work+gather":
        f, a, donate = (lambda t, i, h, r: (work(t, i), g(h, r))), (table, ids, host, rows), ()
    else:  # work+write
        f, a, donate = (lambda t, i, h, s, r: (work(t, i), w(h, s, r))), (table, ids, host, stage, rows), (2,)
    step = jax.jit(f, donate_argnums=donate, compiler_options=opts)
    args_now = list(a)

    def call():
        out = step(*args_now)
        if donate:  # the host buffer written in place comes back; pass it on
            args_now[donate[0]] = out[-1] if isinstance(out, tuple) else out
        return out

    out = call()
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        out = call()
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) * 1e3 / args.iters
    leaves = jax.tree_util.tree_leaves(out)
    check = float(sum(float(jnp.sum(x[:8].astype(jnp.float32))) for x in leaves if not memory.on_host(x)))
    return {"variant": name, "stream_annotation": annotate, "programs": args.programs, "ms": ms, "check": check}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_host_overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8_000_000, help="rows of the pinned host buffer")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--count", type=int, default=81_000, help="rows copied")
    ap.add_argument("--table-rows", type=int, default=4_000_000, help="rows of the HBM table of the work")
    ap.add_argument("--work-ids", type=int, default=1_000_000, help="rows each of the work's gathers reads")
    ap.add_argument("--work-iters", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--programs", type=int, default=0,
                    help="the copy kernels' grid capped at this many programs (0: one per block, all SMs)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset of " + ",".join(VARIANTS))
    ap.add_argument("--annotation", default="0,1", help="the stream-annotation option values to run (0,1)")
    ap.add_argument("--one", default="", help="run this variant (name:0|1) in this process")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.one:
        name, annotate = args.one.rsplit(":", 1)
        print("RESULT " + json.dumps(run_variant(args, name, annotate == "1")), flush=True)
        return
    results = []
    base = list(argv if argv is not None else sys.argv[1:])
    for annotate in (a == "1" for a in args.annotation.split(",")):
        for name in args.variants.split(","):
            cmd = [sys.executable, "-m", "benchmarks", "probe_host_overlap", *base, "--one",
                   f"{name}:{int(annotate)}"]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            r = json.loads(line[7:]) if line else {"variant": name, "stream_annotation": annotate,
                                                   "error": (p.stderr or p.stdout).strip().splitlines()[-3:]}
            results.append(r)
            print(f"{name:20s} annotation {'on ' if annotate else 'off'}  " +
                  (f"{r['ms']:8.3f} ms" if "ms" in r else f"failed: {r['error']}"), flush=True)
    print("saved", common.save("probe-host-overlap", {"meta": common.meta(), "config": vars(args),
                                                      "results": results}, args.out))


if __name__ == "__main__":
    main()
