"""Host time of jitted calls: what a lookup or an update costs the host before the GPU does anything.

Measured on a zero-work batch (every bag empty: the kernels launch and find nothing to do) and on a small real one,
against JAX's own floor (a jitted `x + 1`, and a jitted function of the same arguments doing one small op):
- `host_us`: median wall time of one call timed call by call without blocking (groups of calls, blocked between);
- `enqueued_ms` and `device_ms` (the profiler) per call;
- with `--host-events`, the host-side events per call under the profiler, by name (PjRt's execute, XLA's thunks...).
`--xla-flags` runs the whole probe once more per given XLA_FLAGS value, each in a fresh process.

  python -m benchmarks dispatch --out benchmarks/results/dispatch-....json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys

import numpy as np


def _host_events(run, iters: int, top: int = 25) -> dict:
    import jax
    from jax._src.lib import _profile_data, _profiler

    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    out = None
    for i in range(iters):
        out = run(i)
    jax.block_until_ready(out)
    data = _profile_data.ProfileData.from_serialized_xspace(session.stop())
    per, count = collections.defaultdict(float), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            for e in line.events:
                per[e.name] += e.duration_ns / 1e3 / iters
                count[e.name] += 1
    return {k: {"us": round(per[k], 2), "per_call": count[k] / iters}
            for k in sorted(per, key=per.get, reverse=True)[:top]}


def probe(args) -> dict:
    import jax
    import jax.numpy as jnp

    import tbe_jax
    from benchmarks.common import device_ms, enqueued_ms, host_us

    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind, "cases": {}}
    b, d = args.batch, 64
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(1000, d)], weights_dtype=jnp.float16)
    params = emb.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 1000, b).astype(np.int32))
    batches = {"zero": jnp.zeros((b + 1,), jnp.int32), "real": jnp.arange(b + 1, dtype=jnp.int32)}
    g = jnp.asarray(rng.standard_normal((b, d)).astype(np.float32))
    opt_dev = jax.device_put(tbe_jax.RowwiseAdagrad(learning_rate=0.1, eps=0.1))
    opt_py = tbe_jax.RowwiseAdagrad(learning_rate=0.1, eps=0.1)
    x = jnp.zeros((b,), jnp.int32)

    def case(name, run, events=False):
        jax.block_until_ready(run(0))
        jax.block_until_ready(run(1))
        r = {"host_us": round(host_us(run, 40), 2), "enqueued_ms": round(enqueued_ms(run, 50, 3), 4),
             "device_ms": round(device_ms(run, 20)[0], 4)}
        if events and args.host_events:
            r["host_events"] = _host_events(run, 20)
        res["cases"][name] = r
        print(f"{name:32s} {r['host_us']:8.1f} us host  {r['enqueued_ms']:.4f} ms enqueued  "
              f"{r['device_ms']:.4f} ms device", flush=True)

    f1 = jax.jit(lambda v: v + 1)
    case("floor: jit(x + 1)", lambda i: f1(x))
    f2 = jax.jit(lambda p, i, o: i + o[1:])
    case("floor: same args, one op", lambda i: f2(params, ids, batches["zero"]))
    f4 = jax.jit(lambda p, s, i, o, g: (p, s))
    state = emb.init_opt_state(params, opt_dev)
    case("floor: update's args, identity", lambda i: f4(params, state, ids, batches["zero"], g))
    fwd = jax.jit(lambda p, i, o: emb(p, i, o))
    if args.hlo_dir:  # the optimized programs, to read what runs per call
        with open(os.path.join(args.hlo_dir, "forward.hlo.txt"), "w") as fh:
            fh.write(fwd.lower(params, ids, batches["zero"]).compile().as_text())
    for kind, off in batches.items():
        case(f"forward jit ({kind})", lambda i, off=off: fwd(params, ids, off), events=kind == "zero")
        case(f"forward eager ({kind})", lambda i, off=off: emb(params, ids, off))

    def step(carry, opt, i, o, g):
        return emb.apply_gradients(carry[0], carry[1], opt, i, o, g)

    bwd = jax.jit(step, donate_argnums=(0,))

    def fresh(opt):  # a carry of its own (the steps donate it)
        p = jax.tree_util.tree_map(jnp.copy, params)
        return p, emb.init_opt_state(p, opt)
    for kind, off in batches.items():
        for oname, opt in (("device opt", opt_dev), ("python-float opt", opt_py)):
            carry = [fresh(opt)]

            def run(i, off=off, opt=opt, carry=carry):
                carry[0] = bwd(carry[0], opt, ids, off, g)
                return carry[0]

            case(f"apply_gradients jit ({kind}, {oname})", run, events=kind == "zero" and oname == "device opt")

    def train(carry, opt, i, o, g):
        res = tbe_jax.train_step(lambda _, out: jnp.sum(out * g) + 1e-3 * jnp.sum(out * out), None,
                                 tbe_jax.SparseLookup(emb, opt, carry[0], carry[1], i, o))
        return res.params, res.opt_state

    tstep = jax.jit(train, donate_argnums=(0,))
    for kind, off in batches.items():
        carry = [fresh(opt_dev)]

        def run(i, off=off, carry=carry):
            carry[0] = tstep(carry[0], opt_dev, ids, off, g)
            return carry[0]

        case(f"train_step jit ({kind})", run, events=kind == "zero")
    if args.hlo_dir:
        with open(os.path.join(args.hlo_dir, "apply_gradients.hlo.txt"), "w") as fh:
            fh.write(bwd.lower(fresh(opt_dev), opt_dev, ids, batches["zero"], g).compile().as_text())
    c = res["cases"]
    res["dispatch_us"] = {"forward": c["forward jit (zero)"]["host_us"],
                          "apply_gradients": c["apply_gradients jit (zero, device opt)"]["host_us"],
                          "train_step": c["train_step jit (zero)"]["host_us"],
                          "floor": c["floor: jit(x + 1)"]["host_us"]}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks dispatch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--host-events", action="store_true")
    ap.add_argument("--xla-flags", nargs="*", default=[], help="more XLA_FLAGS variants, each in a fresh process")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--hlo-dir", default="", help="write the optimized HLO of the forward and the update here")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.child:
        print("@@" + json.dumps(probe(args)))
        return
    runs = []
    for flags in [os.environ.get("XLA_FLAGS", "")] + args.xla_flags:
        env = dict(os.environ, XLA_FLAGS=flags, PYTHONUNBUFFERED="1")
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        env["PYTHONPATH"] = root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "benchmarks.dispatch", "--child", "--batch", str(args.batch)]
        cmd += ["--host-events"] if args.host_events else []
        cmd += ["--hlo-dir", args.hlo_dir] if args.hlo_dir and flags == os.environ.get("XLA_FLAGS", "") else []
        print(f"== XLA_FLAGS={flags!r}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write("\n".join(l for l in proc.stdout.splitlines() if not l.startswith("@@")) + "\n")
        if proc.returncode:
            sys.stdout.write(proc.stderr[-3000:])
            continue
        runs += [json.loads(l[2:]) for l in proc.stdout.splitlines() if l.startswith("@@")]
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "runs": runs,
           "dispatch_us": runs[0]["dispatch_us"] if runs else None}
    path = args.out or os.path.join(os.path.dirname(__file__), "results",
                                    f"dispatch-{datetime.datetime.now():%Y%m%d-%H%M}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print("saved", path)


if __name__ == "__main__":
    main()
