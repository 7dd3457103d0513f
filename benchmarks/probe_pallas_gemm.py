"""Can a Pallas TF32 matmul carry the DCNv2 cross layer's elementwise work at cuBLAS's speed? (issue 38)

The MLPerf DCNv2 step on an H200 runs the same cuBLAS TF32 gemms as torch (~22 ms at B 65536) and ~9 ms of XLA's
fused elementwise passes over `[B, 3456]` fp32 arrays (0.9 GB each); 1.3x torch's examples/s needs ~1.7 ms less
(benchmarks/NOTES.md, sessions 27-28 and 49). What is left is moving the cross layers' passes into the gemms:
the z gemm `z = h @ U + b` writing `y = x0 * z + x` beside z saves one 0.9 GB pass a layer, but only if our
matmul is within a few % of cuBLAS on these shapes. This probe measures that first, device time (profiler):

  xv       x [B, W] @ V [W, r]                       jnp.dot (XLA: cuBLAS) against the Pallas kernel
  hu       h [B, r] @ U [r, W]                       the same
  hu_epi   z = h @ U + b, y = x0 * z + x             XLA (the dot and one fusion) against one Pallas kernel
                                                     writing z and y

Both sides take fp32 operands and multiply in TF32 (`precision="tensorfloat32"` for XLA; Triton's default input
precision for fp32 dots). Each Pallas case runs the tile configurations of `--configs` (bm, bn, bk, warps, stages)
and reports the best. Outputs are checked against XLA's (TF32 on both sides: a relative tolerance of 1e-2).

    python -m benchmarks probe_pallas_gemm --batch-size 65536 --out results.json
    python -m benchmarks probe_pallas_gemm --small        (CPU, interpret mode: a correctness smoke run)
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu

# Spill-free on sm_90a (Triton 3.6, ptxas; checked offline): 128 x 128 tiles need 8 warps (4 spill), 256-wide
# tiles spill at 8. All of them compile to wgmma (HGMMA) fed by cp.async (LDGSTS).
_DEFAULT_CONFIGS = "128,128,32,8,3;128,128,32,8,4;128,128,64,8,3;64,128,32,4,4;128,64,32,4,3"


def _mm_kernel(*refs, bk: int, k_steps: int, epilogue: bool):
    if epilogue:
        a_ref, b_ref, bias_ref, x0_ref, x_ref, z_ref, y_ref = refs
    else:
        a_ref, b_ref, z_ref = refs
    bm, bn = a_ref.shape[0], b_ref.shape[1]

    def body(i, acc):
        a = a_ref[:, pl.ds(i * bk, bk)]
        b = b_ref[pl.ds(i * bk, bk), :]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), jnp.float32))
    if not epilogue:
        z_ref[...] = acc
        return
    z = acc + bias_ref[...][None, :]
    z_ref[...] = z
    y_ref[...] = x0_ref[...] * z + x_ref[...]


def pallas_matmul(a, b, cfg, *, bias=None, x0=None, x=None, interpret=False):
    """`a @ b` (TF32 on a GPU) with tiles `cfg = (bm, bn, bk, warps, stages)`; with `bias`, `x0`, `x` also the
    cross layer's `y = x0 * (a @ b + bias) + x`: returns `(z, y)`."""
    bm, bn, bk, warps, stages = cfg
    m, k = a.shape
    n = b.shape[1]
    if m % bm or n % bn or k % bk:
        raise ValueError(f"shape ({m}, {k}) x ({k}, {n}) is not a multiple of the tiles {cfg[:3]}")
    epilogue = bias is not None
    in_specs = [pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))]
    operands = [a, b]
    out_specs = [pl.BlockSpec((bm, bn), lambda i, j: (i, j))]
    out_shape = [jax.ShapeDtypeStruct((m, n), jnp.float32)]
    if epilogue:
        in_specs += [pl.BlockSpec((bn,), lambda i, j: (j,)), pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                     pl.BlockSpec((bm, bn), lambda i, j: (i, j))]
        operands += [bias, x0, x]
        out_specs.append(pl.BlockSpec((bm, bn), lambda i, j: (i, j)))
        out_shape.append(jax.ShapeDtypeStruct((m, n), jnp.float32))
    kw = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=stages)}
    out = pallas_call(
        functools.partial(_mm_kernel, bk=bk, k_steps=k // bk, epilogue=epilogue),
        out_shape=tuple(out_shape), grid=(m // bm, n // bn), in_specs=in_specs, out_specs=tuple(out_specs),
        interpret=interpret, name="probe_matmul_epilogue" if epilogue else "probe_matmul", **kw,
    )(*operands)
    return out if epilogue else out[0]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_pallas_gemm")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--width", type=int, default=3456, help="x0's width, (F+1)*D: 27 * 128 for MLPerf")
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--cases", default="xv,hu,hu_epi")
    ap.add_argument("--configs", default=_DEFAULT_CONFIGS, help="bm,bn,bk,warps,stages;...")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="CPU smoke size, kernels in interpret mode")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    from benchmarks.common import device_ms, meta, save

    interpret = args.small or jax.devices()[0].platform != "gpu"
    b, w, r = (256, 128, 64) if args.small else (args.batch_size, args.width, args.rank)
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    if args.small:
        configs = [(64, 64, 32, 4, 1)]
    prec = "tensorfloat32"
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    x = jax.random.normal(keys[0], (b, w), jnp.float32)
    x0 = jax.random.normal(keys[1], (b, w), jnp.float32)
    h = jax.random.normal(keys[2], (b, r), jnp.float32)
    v = jax.random.normal(keys[3], (w, r), jnp.float32) * (2.0 / (w + r)) ** 0.5
    u = jax.random.normal(keys[4], (r, w), jnp.float32) * (2.0 / (w + r)) ** 0.5
    bias = jax.random.normal(keys[5], (w,), jnp.float32) * 0.1

    @jax.jit
    def xla_dot(a, bb):
        return jnp.dot(a, bb, precision=prec)

    @jax.jit
    def xla_epilogue(a, bb, c, p, q):
        z = jnp.dot(a, bb, precision=prec) + c
        return z, p * z + q

    cases = {"xv": (xla_dot, (x, v), {}), "hu": (xla_dot, (h, u), {}),
             "hu_epi": (xla_epilogue, (h, u, bias, x0, x), {"epi": True})}
    rows = []
    for name in args.cases.split(","):
        xla, operands, opts = cases[name]
        want = jax.block_until_ready(xla(*operands))
        row = {"case": name, "shape": [list(o.shape) for o in operands[:2]]}
        if not interpret:
            row["xla_ms"] = round(min(device_ms(lambda i: xla(*operands), args.iters)[0] for _ in range(2)), 4)
        best = None
        for cfg in configs:
            if opts.get("epi"):
                fn = jax.jit(lambda a, bb, c, p, q, cfg=cfg: pallas_matmul(a, bb, cfg, bias=c, x0=p, x=q,
                                                                          interpret=interpret))
            else:
                fn = jax.jit(lambda a, bb, cfg=cfg: pallas_matmul(a, bb, cfg, interpret=interpret))
            try:
                got = jax.block_until_ready(fn(*operands))
            except Exception as exc:  # noqa: BLE001 (a config the compiler refuses is reported, not fatal)
                row.setdefault("refused", {})[str(cfg)] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            err = max(float(jnp.max(jnp.abs(g - t)) / (jnp.max(jnp.abs(t)) + 1e-30))
                      for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            entry = {"config": list(cfg), "max_rel_err": err}
            if not interpret:
                entry["ms"] = round(min(device_ms(lambda i: fn(*operands), args.iters)[0] for _ in range(2)), 4)
                if best is None or entry["ms"] < best["ms"]:
                    best = entry
            row.setdefault("pallas", []).append(entry)
            if err > 1e-2:
                row.setdefault("wrong", []).append(list(cfg))
        if best is not None:
            row["pallas_best"] = best
            row["xla_over_pallas"] = round(row["xla_ms"] / best["ms"], 3)
        rows.append(row)
        errs = [e["max_rel_err"] for e in row.get("pallas", [])]
        row["max_rel_err"] = max(errs) if errs else None
        print(name, {k: v for k, v in row.items() if k not in ("pallas",)}, flush=True)
    payload = {"meta": meta(bench="probe_pallas_gemm", batch_size=b, width=w, rank=r, interpret=interpret,
                            iters=args.iters, when=time.strftime("%Y-%m-%d %H:%M")), "rows": rows}
    if args.out:
        print("saved", save("probe-pallas-gemm", payload, args.out))
    return payload


if __name__ == "__main__":
    main()
