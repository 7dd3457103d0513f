"""Where a jitted call's enqueued time exceeds its device time: one quiet process, chosen sweep shards.

For each shard (by sweep name: s099, dlrmv2, ...) and each of the forward and the update step, measured alone in
this process (nothing else compiling or running on the host):
- `host_us`: the host time of one call, timed call by call without blocking;
- `enqueued_ms`: wall time per call of calls enqueued back to back, blocked once;
- `device_ms`: summed GPU activity per call (the profiler), and `span_ms`: first activity's start to the last
  one's end over the calls, per call (idle gaps on the GPU show as span > device);
- `host_events`: the host-side events per call under the profiler (PjRt's execute, XLA's thunks, graph launches).
`--xla-flags` repeats everything per XLA_FLAGS value in a fresh process.

  python -m benchmarks enqueue_gap --shards s099,s080,s184 --out benchmarks/results/enqueue-gap-....json
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


def profile_calls(run, iters: int):
    """(device busy ms per call, span ms per call, {host event: us per call}) of `iters` calls."""
    import jax
    from jax._src.lib import _profile_data, _profiler

    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    out = None
    for i in range(iters):
        out = run(i)
    jax.block_until_ready(out)
    data = _profile_data.ProfileData.from_serialized_xspace(session.stop())
    busy, t_lo, t_hi = 0.0, None, None
    host = collections.defaultdict(float)
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            lines = [ln for ln in plane.lines if "Stream" in ln.name] or list(plane.lines)
            for ln in lines:
                for e in ln.events:
                    busy += e.duration_ns
                    t_lo = e.start_ns if t_lo is None else min(t_lo, e.start_ns)
                    t_hi = e.start_ns + e.duration_ns if t_hi is None else max(t_hi, e.start_ns + e.duration_ns)
        elif plane.name.startswith("/host:CPU"):
            for ln in plane.lines:
                if ln.name == "python":
                    continue
                for e in ln.events:
                    host[e.name] += e.duration_ns / 1e3 / iters
    span = (t_hi - t_lo) / 1e6 / iters if t_lo is not None else 0.0
    top = {k: round(host[k], 2) for k in sorted(host, key=host.get, reverse=True)[:20]}
    return busy / 1e6 / iters, span, top


def probe(names: list[str], iters: int, seed: int = 20261202) -> dict:
    import jax
    import jax.numpy as jnp

    import tbe_jax
    from benchmarks import sweep
    from benchmarks.common import enqueued_ms, host_us

    drawn = {s.name: s for s in sweep.draw_shards(240, seed)}
    drawn.update(sweep.named_shards())
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind, "shards": {}}
    for name in names:
        shard = drawn[name]
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d in zip(shard.rows, shard.dims)],
                                            weights_dtype=jnp.dtype(shard.weights_dtype), output_dtype=jnp.float32)
        opt = jax.device_put(tbe_jax.RowwiseAdagrad(learning_rate=sweep.LR, eps=sweep.EPS))
        inputs = [tuple(None if x is None else jax.device_put(x) for x in sweep.batch(shard, k)) for k in range(2)]
        params = emb.init(jax.random.key(0))
        state = emb.init_opt_state(params, opt)
        fwd = jax.jit(lambda p, i, o, w: emb(p, i, o, w))

        def step(carry, opt, i, o, w, g):
            return emb.apply_gradients(carry[0], carry[1], opt, i, o, g, w)

        bwd = jax.jit(step, donate_argnums=(0,))
        carry = [(params, state)]

        def run_fwd(k):
            i, o, w, _ = inputs[k % 2]
            return fwd(carry[0][0], i, o, w)

        def run_bwd(k):
            i, o, w, g = inputs[k % 2]
            carry[0] = bwd(carry[0], opt, i, o, w, g)
            return carry[0]

        out = {**shard.params()}
        for kind, run in (("fwd", run_fwd), ("bwd", run_bwd)):
            for k in range(4):
                jax.block_until_ready(run(k))
            r = {"host_us": round(host_us(run, 20), 2), "enqueued_ms": round(enqueued_ms(run, iters, 5), 4)}
            dev, span, ev = profile_calls(run, iters)
            r.update(device_ms=round(dev, 4), span_ms=round(span, 4), host_events=ev)
            out[kind] = r
            print(f"{name} {kind}: host {r['host_us']:.1f} us, enqueued {r['enqueued_ms']:.4f} ms, device "
                  f"{r['device_ms']:.4f}, span {r['span_ms']:.4f}", flush=True)
            print("   ", json.dumps(dict(list(ev.items())[:8])), flush=True)
        res["shards"][name] = out
        jax.block_until_ready(carry[0])
        del carry, params, state, inputs
    return res


def diagnose(names: list[str], trace_dir: str) -> dict:
    """Which part of an update call's host time depends on the shard: the same step timed with a zero-work
    batch of the same shapes (every bag empty), without donation, with Python-float hyperparameters; a cProfile
    of the calls (Python frames only appear when jit's C++ fast path is missed); a Perfetto trace per shard."""
    import cProfile
    import io
    import pstats

    import jax
    import jax.numpy as jnp

    import tbe_jax
    from benchmarks import sweep
    from benchmarks.common import host_us

    drawn = {s.name: s for s in sweep.draw_shards(240, 20261202)}
    out = {}
    for name in names:
        shard = drawn[name]
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d in zip(shard.rows, shard.dims)],
                                            weights_dtype=jnp.dtype(shard.weights_dtype), output_dtype=jnp.float32)
        opt = jax.device_put(tbe_jax.RowwiseAdagrad(learning_rate=sweep.LR, eps=sweep.EPS))
        i, o, w, g = (None if x is None else jax.device_put(x) for x in sweep.batch(shard, 0))
        zero_o = jnp.zeros_like(o)
        params = emb.init(jax.random.key(0))
        state = emb.init_opt_state(params, opt)

        def step(carry, opt, i, o, w, g):
            return emb.apply_gradients(carry[0], carry[1], opt, i, o, g, w)

        donated, plain = jax.jit(step, donate_argnums=(0,)), jax.jit(step)
        carry = [(params, state)]

        def run(fn, offs, o_pt=opt):
            def r(k):
                carry[0] = fn(carry[0], o_pt, i, offs, w, g)
                return carry[0]
            return r

        res = {}
        variants = {"donated": run(donated, o), "zero batch": run(donated, zero_o), "no donation": run(plain, o),
                    "python-float opt": run(donated, o, tbe_jax.RowwiseAdagrad(learning_rate=sweep.LR, eps=sweep.EPS))}
        for vname, r in variants.items():
            for k in range(3):
                jax.block_until_ready(r(k))
            res[vname] = round(host_us(r, 20), 2)
        r = variants["donated"]
        prof = cProfile.Profile()
        prof.enable()
        for k in range(50):
            r(k)
        jax.block_until_ready(carry[0])
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        res["cprofile"] = buf.getvalue()[-4000:]
        hlo = donated.lower(carry[0], opt, i, o, w, g).compile().as_text()
        res["hlo_ops"] = {k: hlo.count(k) for k in ("custom-call(", "fusion(", "sort(", "while(", "copy(",
                                                    "conditional(")}
        if trace_dir:
            with jax.profiler.trace(os.path.join(trace_dir, name), create_perfetto_trace=True):
                for k in range(10):
                    r(k)
                jax.block_until_ready(carry[0])
        print(name, json.dumps({k: v for k, v in res.items() if k != "cprofile"}), flush=True)
        print(res["cprofile"], flush=True)
        out[name] = res
        jax.block_until_ready(carry[0])
        del carry, params, state
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default="s099,s080,s114,s184,s019")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=20261202, help="the sweep's seed the shard names refer to")
    ap.add_argument("--xla-flags", nargs="*", default=[])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--diagnose", default="", help="write diagnose()'s result for --shards to this JSON")
    ap.add_argument("--trace-dir", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    names = args.shards.split(",")
    if args.diagnose:
        with open(args.diagnose, "w") as fh:
            json.dump(diagnose(names, args.trace_dir), fh, indent=1)
        return
    if args.child:
        print("@@" + json.dumps(probe(names, args.iters, args.seed)))
        return
    runs = []
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    for flags in [os.environ.get("XLA_FLAGS", "")] + args.xla_flags:
        env = dict(os.environ, XLA_FLAGS=flags, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        print(f"== XLA_FLAGS={flags!r}", flush=True)
        cmd = [sys.executable, "-m", "benchmarks.enqueue_gap", "--child", "--shards", args.shards,
               "--iters", str(args.iters), "--seed", str(args.seed)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("@@")) + "\n")
        if proc.returncode:
            sys.stdout.write(proc.stderr[-3000:])
            continue
        runs += [json.loads(ln[2:]) for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "runs": runs}
    path = args.out or os.path.join(root, "benchmarks", "results",
                                    f"enqueue-gap-{datetime.datetime.now():%Y%m%d-%H%M}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print("saved", path)


if __name__ == "__main__":
    main()
