"""What a second, always-launched kernel after the forward costs (issue 36 item 2: a candidate design).

The default mode does not repair decreasing offsets (a running maximum needs a pass over all of `offsets` before
the kernels: +7.7% on base, +10% on smalltable, session 24). The candidate: the forward kernel raises a flag where
it sees a bag end below its start (a compare it already makes), and a second kernel, launched on every call, returns at
once unless the flag is set and otherwise redoes the bags from the repaired offsets. Its cost on well-formed input
is one launch that does nothing. This probe times that launch alone: a jitted forward, then the same forward
followed by a no-op Pallas kernel that reads one word (here `offsets[0]`, standing in for the flag) and writes
its (aliased) output only on a value that never occurs, with one program or one per SM, and (`flag<SMs>`) the
same reading a zeroed word that it may write (aliased: XLA zeroes a fresh one every call, as the flag would
be). A second candidate (NOTES, session 60) launches nothing more: each forward program takes a ticket on a
zeroed word and the last one repairs. Its floor: the zeroed word (`flag<SMs>` less `noop<SMs>`) and one
same-address atomic per program of the forward, which the L2 serializes: arms `flagP` and `ticketP` (a kernel of
the forward's own program count reading the zeroed word, then taking a ticket on it: their difference is the
atomics). Device time (profiler) and enqueued time, interleaved rounds, on the named `base` and `smalltable`
shards and the first sweep shards.

    python -m benchmarks probe_fixup --first 8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _noop_after(out, word, programs: int, writable: bool = False, ticket: bool = False):
    """`out` through a Pallas kernel of `programs` programs that each read `word[0]` and write row 0 of `out` only
    if it equals -7 (never here): the launch, its read and the aliasing, no work. `writable`: `word` is aliased
    too (the flag the forward would raise), so XLA hands the kernel a fresh zeroed word on every call. `ticket`
    (with `writable`): each program takes a ticket instead of reading, one `atomic_add` on the word, as the
    last-ticket candidate's programs would (NOTES, session 60): same-address atomics, one a program."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    width = out.shape[1]
    cols = 1 << (width - 1).bit_length()

    def kernel(word_ref, out_in_ref, *outs):
        del out_in_ref
        out_ref = outs[0]
        if ticket:
            flag = plgpu.atomic_add(outs[1], jnp.int32(0), jnp.int32(1))
        else:
            flag = plgpu.load(word_ref.at[jnp.int32(0)])
        idx = jnp.arange(cols)

        @pl.when(flag == -7)
        def _():
            plgpu.store(out_ref.at[jnp.int32(0), idx], jnp.zeros((cols,), out_ref.dtype), mask=idx < width)

    shapes = [jax.ShapeDtypeStruct(out.shape, out.dtype)]
    aliases = {1: 0}
    if writable:
        shapes.append(jax.ShapeDtypeStruct(word.shape, word.dtype))
        aliases[0] = 1
    res = pl.pallas_call(kernel, out_shape=shapes, grid=(programs,), input_output_aliases=aliases,
                         compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
                         interpret=jax.default_backend() != "gpu")(word, out)
    return res[0]


def _forward_programs(emb, params, i, o, w) -> int:
    """The programs of the forward's (first) Pallas launch on this batch, from its traced grid."""
    import jax
    import numpy as np

    from tbe_jax.testing import jaxpr_eqns

    for e in jaxpr_eqns(jax.make_jaxpr(lambda p, i, o, w: emb(p, i, o, w))(params, i, o, w).jaxpr):
        if e.primitive.name == "pallas_call":
            return int(np.prod(e.params["grid_mapping"].grid))
    return 1


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_fixup")
    ap.add_argument("--named", default="base,smalltable", help="named sweep shards (comma-separated; '' for none)")
    ap.add_argument("--first", type=int, default=8, help="the first K shards of the sweep's draw too")
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import tbe_jax
    from benchmarks import sweep
    from benchmarks.common import device_ms, enqueued_ms
    from tbe_jax.pallas_compat import sm_count

    sms = sm_count()
    out = {"meta": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "sms": sms,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "iters": args.iters, "rounds": args.rounds},
           "shards": []}
    named = sweep.named_shards()
    shards = [named[n] for n in args.named.split(",") if n] + sweep.draw_shards(240, args.seed)[: args.first]
    for shard in shards:
        host = sweep.batch(shard, 0)
        i, o, w, _ = (None if x is None else jax.device_put(x) for x in host)
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d in zip(shard.rows, shard.dims)],
                                            weights_dtype=jnp.dtype(shard.weights_dtype), output_dtype=jnp.float32)
        params = emb.init(jax.random.key(0))
        progs = _forward_programs(emb, params, i, o, w)
        zero = lambda: jnp.zeros((1,), jnp.int32)  # noqa: E731
        arms = {
            "plain": jax.jit(lambda p, i, o, w: emb(p, i, o, w)),
            "noop1": jax.jit(lambda p, i, o, w: _noop_after(emb(p, i, o, w), o, 1)),
            f"noop{sms}": jax.jit(lambda p, i, o, w: _noop_after(emb(p, i, o, w), o, sms)),
            f"flag{sms}": jax.jit(lambda p, i, o, w: _noop_after(emb(p, i, o, w), zero(), sms, writable=True)),
            # the forward's own program count: a zeroed word read by each, then a ticket taken by each
            "flagP": jax.jit(lambda p, i, o, w: _noop_after(emb(p, i, o, w), zero(), progs, writable=True)),
            "ticketP": jax.jit(lambda p, i, o, w: _noop_after(emb(p, i, o, w), zero(), progs, writable=True,
                                                              ticket=True)),
        }
        ref = jax.block_until_ready(arms["plain"](params, i, o, w))
        for f in arms.values():
            assert bool(jnp.array_equal(jax.block_until_ready(f(params, i, o, w)), ref))
        dev = {k: [] for k in arms}
        enq = {k: [] for k in arms}
        for _ in range(args.rounds):  # interleaved
            for k, f in arms.items():
                dev[k].append(device_ms(lambda _, f=f: f(params, i, o, w), args.iters)[0])
                enq[k].append(enqueued_ms(lambda _, f=f: f(params, i, o, w), args.iters, 1))
        row = {"shard": shard.name, "T": shard.T, "B": shard.B, "lookups": int(host[0].shape[0]),
               "forward_programs": progs}
        for k in arms:
            row[f"{k}_dev_ms"] = round(min(dev[k]), 5)
            row[f"{k}_enq_ms"] = round(statistics.median(enq[k]), 5)
            row[f"{k}_cost"] = round(row[f"{k}_dev_ms"] / max(row["plain_dev_ms"], 1e-9), 4)
        out["shards"].append(row)
        print(row, flush=True)
    for k in ("noop1", f"noop{sms}", f"flag{sms}", "flagP", "ticketP"):
        xs = [r[f"{k}_cost"] for r in out["shards"]]
        out[f"{k}_cost"] = {"median": statistics.median(xs), "max": max(xs)}
        print(k, out[f"{k}_cost"])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
