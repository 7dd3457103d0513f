"""Issue 40 probe 1: what JAX lets a jitted program do with pinned_host arrays (each probe in its own process).

    python -m benchmarks.probe_host_memory E D [probe,probe,...]

Run on the H200 (jax 0.11.2) with E=4194304 D=128: `results/archive/host-memory-probes-20261204-NVIDIA_H200.log`.
The `compute_on` probes use the 0.10 spelling `compute_on("device_host")`; 0.11 requires keywords
(`compute_type=`, `out_memory_spaces=`), so they failed there (recorded in the log)."""
import json, subprocess, sys, time

PRE = r'''
import time, json, sys, functools
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
dev = jax.devices()[0]
print("platform", dev.platform, "memories", [m.kind for m in dev.addressable_memories()], "default", dev.default_memory().kind, flush=True)
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
DEV = SingleDeviceSharding(dev, memory_kind="device")
E, D = int(sys.argv[1]), int(sys.argv[2])
def t(f, *a, n=10):
    jax.block_until_ready(f(*a)); t0 = time.perf_counter()
    for _ in range(n): r = f(*a)
    jax.block_until_ready(r); return (time.perf_counter() - t0) / n * 1e3
'''
PROBES = {
"alloc": r'''
x = jax.device_put(np.ones((E, D), np.float16), HOST)
print("alloc ok", x.sharding.memory_kind, x.nbytes / 2**30, "GiB")
''',
"alloc_jit_zeros": r'''
f = jax.jit(lambda: jnp.zeros((E, D), jnp.float16), out_shardings=HOST)
x = f(); x.block_until_ready(); print("zeros on host via jit ok", x.sharding.memory_kind)
''',
"take_in_jit": r'''
x = jax.device_put(np.arange(E * D, dtype=np.float32).reshape(E, D) % 7, HOST)
idx = jnp.asarray(np.random.default_rng(0).integers(0, E, 65536), jnp.int32)
f = jax.jit(lambda x, i: jnp.take(x, i, axis=0))
y = f(x, idx); print("take(host) ->", y.sharding.memory_kind, "ms", t(f, x, idx))
print(f.lower(x, idx).as_text()[:1500])
''',
"device_put_in_jit_slice": r'''
x = jax.device_put(np.ones((E, D), np.float32), HOST)
idx = jnp.asarray(np.random.default_rng(0).integers(0, E, 65536), jnp.int32)
f = jax.jit(lambda x, i: jax.device_put(x, jax.memory.Space.Device if hasattr(jax, "memory") else DEV)[i])
y = f(x, idx); print("device_put(whole) then take ok ms", t(f, x, idx))
''',
"compute_on_host_gather": r'''
from jax.experimental.compute_on import compute_on
x = jax.device_put(np.arange(E * D, dtype=np.float32).reshape(E, D) % 7, HOST)
idx_np = np.random.default_rng(0).integers(0, E, 65536).astype(np.int32)
idx_h = jnp.asarray(idx_np)  # device ids (as a directory lookup makes them), moved to the host inside the program
@jax.jit
def f(x, i):
    i = jax.device_put(i, HOST)
    with compute_on("device_host"):
        rows = x.at[i].get(mode="promise_in_bounds")
    return jax.device_put(rows, DEV)
print(f.lower(x, idx_h).compile().as_text()[-2500:])
y = f(x, idx_h)
ok = np.array_equal(np.asarray(y), np.asarray(x)[idx_np])
print("compute_on host gather ok", ok, y.sharding.memory_kind, "ms", t(f, x, idx_h))
''',
"compute_on_host_scatter_donate": r'''
from jax.experimental.compute_on import compute_on
x = jax.device_put(np.zeros((E, D), np.float32), HOST)
idx_np = np.random.default_rng(1).choice(E, 65536, replace=False).astype(np.int32)
idx_h = jax.device_put(idx_np, HOST)
rows = jnp.ones((65536, D), jnp.float32)
@functools.partial(jax.jit, donate_argnums=0, out_shardings=HOST)
def f(x, i, r):
    r = jax.device_put(r, HOST)
    with compute_on("device_host"):
        return x.at[i].set(r)
x2 = f(x, idx_h, rows)
print("host scatter ok", x2.sharding.memory_kind, float(np.asarray(x2).sum()) == 65536 * D)
print("donated:", x.is_deleted())
x3 = x2
ms = []
for k in range(5):
    t0 = time.perf_counter(); x3 = f(x3, idx_h, rows); x3.block_until_ready(); ms.append((time.perf_counter() - t0) * 1e3)
print("host scatter ms", ms)
''',
"callback_gather": r'''
xn = (np.arange(E * D, dtype=np.float32).reshape(E, D) % 7).astype(np.float16)
idx = jnp.asarray(np.random.default_rng(0).integers(0, E, 65536), jnp.int32)
def host_take(i):
    return xn[np.asarray(i)]
@jax.jit
def f(i):
    return jax.pure_callback(host_take, jax.ShapeDtypeStruct((i.shape[0], D), jnp.float16), i)
y = f(idx); print("pure_callback gather ok", np.array_equal(np.asarray(y), xn[np.asarray(idx)]), "ms", t(f, idx))
''',
"compute_on_gather_f16_sizes": r'''
from jax.experimental.compute_on import compute_on
x = jax.device_put(np.ones((E, D), np.float16), HOST)
@jax.jit
def f(x, i):
    i = jax.device_put(i, HOST)
    with compute_on("device_host"):
        rows = x.at[i].get(mode="promise_in_bounds")
    return jax.device_put(rows, DEV)
for n in (1024, 16384, 131072, 1048576):
    idx = jnp.asarray(np.random.default_rng(0).integers(0, E, n), jnp.int32)
    ms = t(f, x, idx, n=5)
    print("rows", n, "ms", round(ms, 3), "GB/s", round(n * D * 2 / ms / 1e6, 2), flush=True)
''',
"h2d_bandwidth": r'''
n = 1 << 28
a = jax.device_put(np.ones(n, np.uint8), HOST)
f = jax.jit(lambda a: jax.device_put(a, DEV))
print("h2d GB/s", n / t(f, a) / 1e6)
b = jax.device_put(np.ones(n, np.uint8), DEV)
g = jax.jit(lambda b: jax.device_put(b, HOST))
print("d2h GB/s", n / t(g, b) / 1e6)
''',
"pallas_reads_host": r'''
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
x = jax.device_put(np.ones((E, D), np.float32), HOST)
def k(x_ref, o_ref):
    o_ref[...] = x_ref[0:16, :] * 2
f = jax.jit(lambda x: pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((16, D), jnp.float32))(x))
y = f(x); print("pallas on host array ->", y.sharding.memory_kind, float(np.asarray(y).sum()))
txt = f.lower(x).compile().as_text()
print("copies in HLO:", txt.count("copy-start"), txt.count("MoveToDevice"), txt.count("memory_space=5") if txt else None)
print([l for l in txt.splitlines() if "S(5)" in l][:5])
''',
}
E, D = sys.argv[1], sys.argv[2]
names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(PROBES)
for name in names:
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-c", PRE + PROBES[name], E, D], capture_output=True, text=True, timeout=90)
        out = (r.stdout + ("\n" + "\n".join(r.stderr.strip().splitlines()[-4:]) if r.returncode else "")).strip()
        print(f"=== {name} rc={r.returncode} {time.time() - t0:.1f}s\n{out}\n", flush=True)
    except subprocess.TimeoutExpired:
        print(f"=== {name} TIMEOUT", flush=True)
