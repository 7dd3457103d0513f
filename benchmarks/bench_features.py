"""Many-feature models: init, compile and step cost against the feature count.

One table per feature, E log-uniform in [100, 200k], D cycling through
{16, 32, 48, 64, 96, 128}, fp16 tables, B samples, 1..30 ids per bag (uniform).
Per feature count: construct + `init` wall time, trace + compile time of the
forward and of the optimizer step (row-wise Adagrad, `apply_gradients`), the
lowered HLO text size, and the forward and step times (enqueued back to back,
blocked once, median of reps) with the step's cost per lookup. The `base`
preset's step cost per lookup is measured in the same process for the ratio.

Results go to benchmarks/results/features-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from benchmarks import common
from benchmarks.common import time_calls  # the same timing

DIMS = (16, 32, 48, 64, 96, 128)


def model_tables(num_features: int, seed: int = 0, dims=DIMS):
    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(100), np.log(200_000), num_features)).astype(int)
    return [tbe_jax.TableSpec(int(e), dims[i % len(dims)]) for i, e in enumerate(rows)]


def make_batch(tables, batch: int, seed: int, max_len: int = 30):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, len(tables) * batch)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows = np.repeat(np.asarray([t.num_embeddings for t in tables]), batch)
    ids = (rng.random(int(lens.sum())) * np.repeat(rows, lens)).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(offsets)


def measure(tables, batch, args, seed=0):
    row = {"features": len(tables), "batch": batch, "dims": sorted({t.embedding_dim for t in tables})}
    t0 = time.perf_counter()
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, interpret=common.interpret())
    params = emb.init(jax.random.key(seed))
    jax.block_until_ready(params)
    row["construct_init_s"] = time.perf_counter() - t0
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=0.1)
    state = emb.init_opt_state(params, opt)
    indices, offsets = make_batch(tables, batch, seed)
    row["lookups"] = int(indices.shape[0])
    grad = jax.random.normal(jax.random.key(1), (batch, sum(emb.feature_dims)), jnp.float32)

    fwd = jax.jit(lambda p, i, o: emb(p, i, o))
    t0 = time.perf_counter()
    lowered = fwd.trace(params, indices, offsets).lower()
    row["forward_hlo_bytes"] = len(lowered.as_text())
    compiled_fwd = lowered.compile()
    row["forward_compile_s"] = time.perf_counter() - t0

    step = jax.jit(lambda p, s, o, i, off, g: emb.apply_gradients(p, s, o, i, off, g), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    lowered = step.trace(params, state, opt, indices, offsets, grad).lower()
    row["step_hlo_bytes"] = len(lowered.as_text())
    compiled_step = lowered.compile()
    row["step_compile_s"] = time.perf_counter() - t0

    row["forward_ms"] = time_calls(compiled_fwd, [(params, indices, offsets)], args.iters, args.reps)
    carry = [params, state]

    def one_step():
        carry[0], carry[1] = compiled_step(carry[0], carry[1], opt, indices, offsets, grad)
        return carry[0]

    row["step_ms"] = time_calls(one_step, [()], args.iters, args.reps)
    row["step_ns_per_lookup"] = row["step_ms"] * 1e6 / row["lookups"]
    row["forward_ns_per_lookup"] = row["forward_ms"] * 1e6 / row["lookups"]
    t0 = time.perf_counter()
    train = train_step_fn(emb).trace(carry[0], carry[1], opt, indices, offsets, grad).lower().compile()
    row["train_compile_s"] = time.perf_counter() - t0

    def one_train():
        carry[0], carry[1] = train(carry[0], carry[1], opt, indices, offsets, grad)
        return carry[0]

    row["train_ms"] = time_calls(one_train, [()], args.iters, args.reps)
    row["train_ns_per_lookup"] = row["train_ms"] * 1e6 / row["lookups"]
    return row


def train_step_fn(emb):
    """The whole training step through `tbe_jax.train_step`: lookup, a loss gradient, the fused update."""
    def step(p, s, opt, i, off, g):
        # out * out: the loss's gradient needs the forward (with <out, g> alone XLA drops the lookup)
        res = tbe_jax.train_step(lambda _, out: jnp.vdot(out, g) + 5e-4 * jnp.vdot(out, out), None,
                                 tbe_jax.SparseLookup(emb, opt, p, s, i, off))
        return res.params, res.opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def base_preset(args):
    wl = common.workload(args.base)
    tables = [tbe_jax.TableSpec(wl.E, wl.D) for _ in range(wl.T)]
    rng = np.random.default_rng(0)
    lens = np.full(wl.T * wl.B, wl.L)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    indices = jnp.asarray(rng.integers(0, wl.E, int(lens.sum())).astype(np.int32))
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, interpret=common.interpret())
    params = emb.init(jax.random.key(0))
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=0.1)
    state = emb.init_opt_state(params, opt)
    grad = jax.random.normal(jax.random.key(1), (wl.B, wl.T * wl.D), jnp.float32)
    step = jax.jit(lambda p, s, o, i, off, g: emb.apply_gradients(p, s, o, i, off, g), donate_argnums=(0, 1))
    carry = [params, state]

    def one_step():
        carry[0], carry[1] = step(carry[0], carry[1], opt, indices, offsets, grad)
        return carry[0]

    ms = time_calls(one_step, [()], args.iters, args.reps)
    train = train_step_fn(emb)

    def one_train():
        carry[0], carry[1] = train(carry[0], carry[1], opt, indices, offsets, grad)
        return carry[0]

    tms = time_calls(one_train, [()], args.iters, args.reps)
    n = int(indices.shape[0])
    return {"step_ms": ms, "lookups": n, "step_ns_per_lookup": ms * 1e6 / n, "train_ms": tms,
            "train_ns_per_lookup": tms * 1e6 / n}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks features", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", default="26,200,1000")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--many-dims", default="32:24,256:24",
                    help="extra models 'features:distinct dims' (dims 8, 16, ... step 8), '' for none")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", default="base", help="the reference preset (a CPU smoke run: tiny)")
    ap.add_argument("--out", default="", help="a directory (default benchmarks/results) or a .json path")
    args = ap.parse_args(argv)
    meta = common.meta(timing="enqueue --iters calls, block once, median of --reps; compile = trace + lower + compile")
    base = base_preset(args)
    print(f"base preset: apply_gradients {base['step_ms']:.3f} ms, {base['step_ns_per_lookup']:.3f} ns/lookup; "
          f"train_step {base['train_ms']:.3f} ms, {base['train_ns_per_lookup']:.3f} ns/lookup", flush=True)
    rows = []
    models = [(int(x), DIMS) for x in args.features.split(",") if x]
    for item in (x for x in args.many_dims.split(",") if x):
        f, nd = (int(v) for v in item.split(":"))
        models.append((f, tuple(8 * (k + 1) for k in range(nd))))
    for f, dims in models:
        r = measure(model_tables(f, dims=dims), args.batch, args)
        r["step_cost_vs_base"] = r["step_ns_per_lookup"] / base["step_ns_per_lookup"]
        r["train_cost_vs_base"] = r["train_ns_per_lookup"] / base["train_ns_per_lookup"]
        rows.append(r)
        print(f"F={f:5d} ({len(r['dims'])} dims) init {r['construct_init_s']:.2f} s | fwd compile {r['forward_compile_s']:.2f} s, HLO "
              f"{r['forward_hlo_bytes'] / 1e6:.2f} MB, {r['forward_ms']:.3f} ms | step compile "
              f"{r['step_compile_s']:.2f} s, HLO {r['step_hlo_bytes'] / 1e6:.2f} MB, {r['step_ms']:.3f} ms, "
              f"{r['step_ns_per_lookup']:.3f} ns/lookup ({r['step_cost_vs_base']:.2f}x base) | train step "
              f"compile {r['train_compile_s']:.2f} s, {r['train_ms']:.3f} ms, {r['train_ns_per_lookup']:.3f} ns/lookup "
              f"({r['train_cost_vs_base']:.2f}x base) | "
              f"{r['lookups']} lookups", flush=True)
    path = common.save("features", {"meta": meta, "base": base, "results": rows}, args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
