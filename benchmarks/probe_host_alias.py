"""Issue 40 probe 3: where a jitted program puts the aliased output of a Pallas scatter into a pinned_host buffer
when the caller's `jit` names no `out_shardings` (the situation inside a user's training step), and what an
in-program `jax.device_put(..., pinned_host)` annotation does to it.

    python -m benchmarks.probe_host_alias E D

For each variant: the output's memory kind, whether the input was donated, whether the result is exact, and the
time of a repeated call (an in-place scatter of 65,536 rows costs ~0.5 ms; a whole-table copy costs E*D*2 bytes at
~50 GB/s).
"""
import sys, time
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

dev = jax.devices()[0]
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
DEVS = SingleDeviceSharding(dev, memory_kind="device")
interp = dev.platform == "cpu"
E, D, BR = int(sys.argv[1]), int(sys.argv[2]), 32
ONLY = int(sys.argv[3]) if len(sys.argv) > 3 else None  # one variant per process (a failed one can abort it)
if ONLY is None:
    import subprocess
    for k in range(1, 7):
        subprocess.run([sys.executable, "-m", "benchmarks.probe_host_alias", sys.argv[1], sys.argv[2], str(k)])
    sys.exit(0)
N = min(65536, E // 2)


def scatter_kernel(idx_ref, v_ref, x_ref, o_ref):
    i = pl.program_id(0) * BR + jnp.arange(BR)
    rows = plgpu.load(idx_ref.at[i])
    cols = jnp.arange(D)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], plgpu.load(v_ref.at[i[:, None], cols[None, :]]))


def scatter(x, idx, v):
    return pl.pallas_call(scatter_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(idx.shape[0] // BR,),
                          input_output_aliases={2: 0}, interpret=interp)(idx, v, x)


def gather_kernel(idx_ref, x_ref, o_ref):
    i = pl.program_id(0) * BR + jnp.arange(BR)
    rows = plgpu.load(idx_ref.at[i])
    cols = jnp.arange(D)
    plgpu.store(o_ref.at[i[:, None], cols[None, :]], plgpu.load(x_ref.at[rows[:, None], cols[None, :]]))


def gather(x, idx):
    return pl.pallas_call(gather_kernel, out_shape=jax.ShapeDtypeStruct((idx.shape[0], D), x.dtype),
                          grid=(idx.shape[0] // BR,), interpret=interp)(idx, x)


rng = np.random.default_rng(0)
idx_np = rng.choice(E, N, replace=False).astype(np.int32)
idx = jnp.asarray(idx_np)
xn = np.ones((E, D), np.float16)


def fresh():
    return jax.device_put(xn, DEVS if interp else HOST)


_count = [0]


def report(name, f, pytree_in):
    _count[0] += 1
    if _count[0] != ONLY:
        return
    try:
        x = fresh()
        args = pytree_in(x)
        t0 = time.perf_counter()
        out = f(*args)
        jax.block_until_ready(out)
        first = (time.perf_counter() - t0) * 1e3
        h = out["h"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out
        kind = h.sharding.memory_kind
        got = np.array(jax.device_get(h[idx[:4]] if kind == "device" else jax.device_put(h, DEVS)[idx[:4]]))
        ok = bool((got == 3).all())
        donated = x.is_deleted()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = f(*args_with(out, args))
            jax.block_until_ready(out)
            ts.append(round((time.perf_counter() - t0) * 1e3, 3))
        print(f"{name}: out {kind} donated {donated} ok {ok} first {first:.1f} ms, repeat ms {ts}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


def args_with(out, args):
    if isinstance(out, dict):
        return (out,) + tuple(args[1:])
    if isinstance(out, tuple):
        return (out[0],) + tuple(args[1:])
    return (out,) + tuple(args[1:])


v = jnp.full((N, D), 3, jnp.float16)
if ONLY == 1:
    print("platform", dev.platform, "jax", jax.__version__, "E", E, "D", D, "rows scattered", N, flush=True)
# 1. no out_shardings, donated
report("scatter, no out_shardings", jax.jit(scatter, donate_argnums=0), lambda x: (x, idx, v))
# 2. in-program annotation to pinned_host
report("scatter + device_put(HOST) in program",
       jax.jit(lambda x, i, w: jax.device_put(scatter(x, i, w), HOST), donate_argnums=0), lambda x: (x, idx, v))
# 3. a pytree: host leaf scattered, device leaf computed, no out_shardings
dleaf = jnp.zeros((1024, D), jnp.float32)
report("pytree {h: scatter, d: d+1}, no out_shardings",
       jax.jit(lambda p, i, w: {"h": scatter(p["h"], i, w), "d": p["d"] + 1}, donate_argnums=0),
       lambda x: ({"h": x, "d": dleaf}, idx, v))
# 4. identity of a host array (no kernel)
report("identity, no out_shardings", jax.jit(lambda x, i, w: x, donate_argnums=0), lambda x: (x, idx, v))
# 5. gather from host then scatter into host in one program (the prefetch's write-back + fill)
report("gather+scatter in one program, device_put(HOST)",
       jax.jit(lambda x, i, w: (jax.device_put(scatter(x, i, gather(x, i[::-1]) * 0 + w), HOST), gather(x, i)),
               donate_argnums=0), lambda x: (x, idx, v))
# 6. memory space API
if ONLY == 6:
    print("jax.memory.Space:", [s for s in dir(getattr(jax, "memory", None)) if not s.startswith("_")]
      if hasattr(jax, "memory") else None, flush=True)
try:
    f = jax.jit(lambda x, i, w: jax.device_put(scatter(x, i, w), jax.memory.Space.Host), donate_argnums=0)
    report("scatter + device_put(jax.memory.Space.Host)", f, lambda x: (x, idx, v))
except Exception as e:  # noqa: BLE001
    print("Space.Host failed", type(e).__name__, str(e)[:300], flush=True)
