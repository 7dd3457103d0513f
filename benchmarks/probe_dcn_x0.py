"""How the DCNv2 step builds x0 = [h, pooled], and what each way costs on the device (issue 38).

Session 28's HLO of the MLPerf-size step (B 65536) showed x0 built twice: `input_concatenate_fusion` (0.42 ms, the
gemm operand) and the same concatenation again for the split-K gemm of V_0's gradient (0.42 ms). This probe runs
the dense part of the step alone (bottom MLP, 3 cross layers of rank 512, top MLP, BCE; the gradient of the dense
params and of the pooled embeddings, which a step hands to the TBE backward) with the pooled embeddings made by an
opaque producer standing in for the TBE kernel, in four ways:

  concat   x0 = concatenate([h, pooled])                  (the demo today)
  barrier  x0 = optimization_barrier(concatenate(...))    (x0 materialized once; every consumer reads it)
  wide     the producer writes [B, (F+1)*D] with D zero leading columns (a TBE output with a leading
           feature of empty bags), x0 = wide.at[:, :D].set(h)   (in place: no concatenation at all)
  split    x0 never formed: each cross layer and the top MLP's first layer on the two column blocks
           (h's D columns and the pooled ones: x @ V = x_h @ V[:D] + x_p @ V[D:], and so on)

All four compute the same numbers (checked here against `concat`). Device ms per step (profiler) and the
optimized HLO's fusions that write an array of `B * (F+1)*D` floats (x0's size, in any shape) are printed and saved.

    python -m benchmarks probe_dcn_x0 --batch-sizes 65536,16384 --out results.json
"""

from __future__ import annotations

import argparse
import re
import time


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_dcn_x0")
    ap.add_argument("--batch-sizes", default="65536,16384")
    ap.add_argument("--features", type=int, default=26)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--modes", default="concat,barrier,wide,split")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="CPU smoke size: narrow MLPs")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import device_ms, meta, save
    from examples.dlrm import dcn
    from examples.dlrm.model import bce, mlp

    f, d = args.features, args.dim
    width = (f + 1) * d
    bottom, top, rank = ((512, 256, d), (1024, 1024, 512, 256, 1), args.rank)
    if args.small:
        bottom, top, rank = (32, d), (64, 32, 1), 32
    prec = "tensorfloat32"
    key = jax.random.PRNGKey(0)
    mlps = dcn.init_mlps(key, (13, *bottom), (width, *top))
    dense = {"bottom": mlps[0], "top": mlps[1], "cross": dcn.init_cross(jax.random.fold_in(key, 1), width, rank, 3)}
    for layer in dense["cross"]:  # non-zero biases, so that a wrong column order would show
        layer["b"] = jax.random.normal(jax.random.fold_in(key, 2), layer["b"].shape) * 0.1

    def logits(params, dense_x, x0_of_h):
        h = mlp(params["bottom"], dense_x, final_relu=True, precision=prec)
        x = dcn.cross_net(params["cross"], x0_of_h(h), precision=prec)
        return mlp(params["top"], x, final_relu=False, precision=prec)[:, 0]

    def split_logits(params, dense_x, pooled):
        h = mlp(params["bottom"], dense_x, final_relu=True, precision=prec)
        xh, xp = h, pooled
        for layer in params["cross"]:
            v, u, bias = layer["v"], layer["u"], layer["b"]
            t = jnp.dot(xh, v[:d], precision=prec) + jnp.dot(xp, v[d:], precision=prec)
            xh = h * (jnp.dot(t, u[:, :d], precision=prec) + bias[:d]) + xh
            xp = pooled * (jnp.dot(t, u[:, d:], precision=prec) + bias[d:]) + xp
        first, rest = params["top"][0], params["top"][1:]
        z = jnp.dot(xh, first["w"][:d], precision=prec) + jnp.dot(xp, first["w"][d:], precision=prec) + first["b"]
        z = jax.nn.relu(z)
        return mlp(rest, z, final_relu=False, precision=prec)[:, 0]

    def make_step(mode):
        def step(params, dense_x, labels, raw):
            # The TBE kernel's stand-in: an opaque producer of the pooled embeddings, materialized.
            if mode == "wide":
                out = jax.lax.optimization_barrier(jnp.pad(jnp.sin(raw), ((0, 0), (d, 0))))
                x0_of = lambda o: lambda h: o.at[:, :d].set(h)  # noqa: E731
            else:
                out = jax.lax.optimization_barrier(jnp.sin(raw))
                if mode == "concat":
                    x0_of = lambda o: lambda h: jnp.concatenate([h, o], axis=1)  # noqa: E731
                else:
                    barrier = jax.lax.optimization_barrier
                    x0_of = lambda o: lambda h: barrier(jnp.concatenate([h, o], axis=1))  # noqa: E731

            def loss(p, o):
                if mode == "split":
                    return bce(split_logits(p, dense_x, o), labels)
                return bce(logits(p, dense_x, x0_of(o)), labels)

            value, (g_dense, g_out) = jax.value_and_grad(loss, argnums=(0, 1))(params, out)
            if mode == "wide":
                g_out = g_out[:, d:]
            # The TBE backward's stand-in: reads the pooled gradient once.
            return value, g_dense, jnp.sum(g_out, axis=0)
        return jax.jit(step)

    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, b), 3)
        dense_x = jax.random.normal(k1, (b, 13), jnp.float32)
        labels = (jax.random.uniform(k2, (b,)) < 0.3).astype(jnp.float32)
        raw = jax.random.normal(k3, (b, f * d), jnp.float32) * 0.05
        ref = None
        for mode in args.modes.split(","):
            fn = make_step(mode)
            compiled = fn.lower(dense, dense_x, labels, raw).compile()
            hlo = compiled.as_text()
            wide_writes = sorted({f"{name} f32[{dims}]" for name, dims in
                                  re.findall(r"(\S+) = f32\[([0-9,]+)\]\S* fusion\(", hlo)
                                  if int(np.prod([int(x) for x in dims.split(",")])) == b * width})
            res = jax.block_until_ready(fn(dense, dense_x, labels, raw))
            if ref is None:
                ref = res
            err = max(float(jnp.max(jnp.abs(a - r)) / (jnp.max(jnp.abs(r)) + 1e-30))
                      for a, r in zip(jax.tree.leaves(res), jax.tree.leaves(ref)))
            ms = min(device_ms(lambda i: fn(dense, dense_x, labels, raw), args.iters)[0] for _ in range(args.rounds))
            _, top_names = device_ms(lambda i: fn(dense, dense_x, labels, raw), args.iters, top=12)
            row = {"batch_size": b, "mode": mode, "device_ms": round(ms, 4), "max_rel_err_vs_first": err,
                   "x0_wide_fusions": wide_writes, "top_kernels_ms": {k: round(v, 4) for k, v in top_names.items()}}
            rows.append(row)
            print(f"B {b} {mode:8s} {ms:.4f} ms  err {err:.1e}  x0-size fusions: {len(wide_writes)} "
                  f"{wide_writes}", flush=True)
    payload = {"meta": meta(bench="probe_dcn_x0", features=f, dim=d, rank=rank, small=args.small,
                            iters=args.iters, rounds=args.rounds, when=time.strftime("%Y-%m-%d %H:%M")),
               "rows": rows}
    if args.out:
        print("saved", save("probe-dcn-x0", payload, args.out))
    return payload


if __name__ == "__main__":
    main()
