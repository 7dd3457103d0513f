"""Issue 40 probe: a table in pinned host memory inside `jax.shard_map` (what a sharded embedding with
`location="host"` tables needs), on a mesh of the machine's GPUs.

    python -m benchmarks probe_shard_host [--rows E] [--one VARIANT]

Variants (each in its own process: a refused one can abort it):
- `jit`: the single-device step as the library runs it (the baseline);
- `jit-space`: the same, with the in-program host placement written `device_put(x, jax.memory.Space.Host)`
  instead of a `SingleDeviceSharding(..., pinned_host)` (a form that is also valid inside `shard_map`);
- `smap`: the step inside `shard_map` over a one-axis mesh of every GPU, the host buffer a
  `NamedSharding(mesh, P(axis), memory_kind="pinned_host")`, the library unchanged;
- `smap-space`: as `smap`, with the `Space.Host` placement.

Each prints one `RESULT` line: whether it ran, the updated buffer's memory kind, whether the table and the lookup
equal `jit`'s on the same batch (computed in the same process), and ms per step (a whole-table copy of the
`E x 128` fp16 table per step would show as E * 256 bytes at ~50 GB/s).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback

VARIANTS = ("jit", "jit-space", "smap", "smap-space")


def _one(variant: str, rows: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import tbe_jax
    from tbe_jax import memory

    if variant.endswith("-space"):
        memory.keep_on_host = lambda x: jax.device_put(x, jax.memory.Space.Host) if memory.host_memory() else x
    devs = jax.devices()
    n = len(devs)
    mesh = jax.sharding.Mesh(np.array(devs), ("x",))
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(rows, 128, location="host")], weights_dtype=jnp.float16)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.1)
    b, bag = 4096, 8
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, rows, b * bag), jnp.int32)
    off = jnp.asarray(np.arange(b + 1) * bag, jnp.int32)
    g = jnp.asarray(rng.standard_normal((b, 128)), jnp.float32)
    key = emb.layout.key(0)

    def step(params, state, idx, off, g):
        out = emb(params, idx, off)
        params, state = emb.apply_gradients(params, state, opt, idx, off, g)
        return params, state, out

    def fresh():
        params = emb.init(jax.random.key(0))
        return params, emb.init_opt_state(params, opt)

    # the reference: the library's own jitted step, one device
    p0, s0 = fresh()
    ref_p, _, ref_out = jax.jit(step)(p0, s0, idx, off, g)
    ref_tab = np.asarray(emb.get_tables(ref_p)[0], np.float32)
    ref_out = np.asarray(ref_out, np.float32)
    del p0, s0, ref_p

    params, state = fresh()
    if variant.startswith("smap"):
        hs = NamedSharding(mesh, P("x"), memory_kind=memory.HOST_KIND)
        params = {k: jax.device_put(v, hs) for k, v in params.items()}
        state = jax.tree_util.tree_map(
            lambda x: jax.device_put(x, hs) if getattr(x, "ndim", 0) >= 1 and x.shape[0] == rows else x, state)
        pspec = jax.tree_util.tree_map(lambda _: P("x"), params)
        sspec = jax.tree_util.tree_map(lambda x: P("x") if getattr(x, "ndim", 0) >= 1 else P(), state)
        # every device looks up the same batch (replicated operands): a one-device mesh is the case probed
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(pspec, sspec, P(), P(), P()),
                                  out_specs=(pspec, sspec, P()), check_vma=False), donate_argnums=(0, 1))
    else:
        f = jax.jit(step, donate_argnums=(0, 1))
    params, state, out = f(params, state, idx, off, g)
    jax.block_until_ready(params)
    res = {"variant": variant, "devices": n, "ran": True,
           "memory_kind": getattr(params[key].sharding, "memory_kind", None),
           "table_equal": bool(np.array_equal(np.asarray(emb.get_tables(params)[0], np.float32), ref_tab)),
           "out_equal": bool(np.allclose(np.asarray(out, np.float32), ref_out, rtol=1e-3, atol=1e-3))}
    for _ in range(3):
        params, state, out = f(params, state, idx, off, g)
    jax.block_until_ready(params)
    t0, iters = time.perf_counter(), 10
    for _ in range(iters):
        params, state, out = f(params, state, idx, off, g)
    jax.block_until_ready(params)
    res["ms"] = (time.perf_counter() - t0) / iters * 1e3
    res["memory_kind_after"] = getattr(params[key].sharding, "memory_kind", None)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--one", choices=VARIANTS)
    a = ap.parse_args(argv)
    if a.one is None:
        for v in VARIANTS:
            subprocess.run([sys.executable, "-m", "benchmarks", "probe_shard_host", "--rows", str(a.rows), "--one", v],
                           timeout=120, check=False)
        return
    try:
        res = _one(a.one, a.rows)
    except Exception as e:  # the finding is the error: print it and go on to the next variant
        res = {"variant": a.one, "ran": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        traceback.print_exc(limit=3)
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
