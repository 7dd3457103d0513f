"""Issue 40 probe 2: a compiled Pallas-Triton kernel gathering rows from, and scattering rows into, a pinned_host
table (zero-copy over PCIe), against the same kernel on a device table.

    python -m benchmarks.probe_host_kernels E D

Run on the H200 (jax 0.11.2) with E=4194304 D=128: `results/archive/host-memory-probes-20261204-NVIDIA_H200.log`. In that
run the repeated scatter failed with "Donation requested for buffer with external reference": the check before it
held a NumPy view of the host table (`np.asarray(jax.device_get(x))` of a pinned_host array is zero-copy); it now
copies and drops the view. On the CPU (interpret mode) a Pallas kernel cannot read host-memory operands, so the
host table is a device array there.
"""
import functools, inspect, sys, time
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
dev = jax.devices()[0]
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
DEVS = SingleDeviceSharding(dev, memory_kind="device")
interp = dev.platform == "cpu"
from jax.experimental.compute_on import compute_on
print("compute_on signature", inspect.signature(compute_on), flush=True)
E, D, BR = int(sys.argv[1]), int(sys.argv[2]), 32
N_SCATTER = min(65536, E // 2)
def t(f, *a, n=10):
    jax.block_until_ready(f(*a)); t0 = time.perf_counter()
    for _ in range(n): r = f(*a)
    jax.block_until_ready(r); return (time.perf_counter() - t0) / n * 1e3
def gather_kernel(idx_ref, x_ref, o_ref):
    i = pl.program_id(0) * BR + jnp.arange(BR)
    rows = plgpu.load(idx_ref.at[i])
    cols = jnp.arange(D)
    v = plgpu.load(x_ref.at[rows[:, None], cols[None, :]])
    plgpu.store(o_ref.at[i[:, None], cols[None, :]], v)
def gather(x, idx):
    n = idx.shape[0]
    return pl.pallas_call(gather_kernel, out_shape=jax.ShapeDtypeStruct((n, D), x.dtype), grid=(n // BR,),
                          interpret=interp)(idx, x)
def scatter_kernel(idx_ref, v_ref, x_ref, o_ref):
    i = pl.program_id(0) * BR + jnp.arange(BR)
    rows = plgpu.load(idx_ref.at[i])
    cols = jnp.arange(D)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], plgpu.load(v_ref.at[i[:, None], cols[None, :]]))
def scatter(x, idx, v):
    return pl.pallas_call(scatter_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(idx.shape[0] // BR,),
                          input_output_aliases={2: 0}, interpret=interp)(idx, v, x)
xn = (np.arange(E, dtype=np.float32)[:, None] + np.zeros((1, D), np.float32)).astype(np.float16) if E <= 2**20 else np.ones((E, D), np.float16)
xd = jax.device_put(xn, DEVS); xh = xd if interp else jax.device_put(xn, HOST)
g = jax.jit(gather)
for n in (65536, 1048576):
    idx_np = np.random.default_rng(0).integers(0, E, n).astype(np.int32); idx = jnp.asarray(idx_np)
    y = g(xh, idx)
    ok = np.array_equal(np.asarray(y), xn[idx_np])
    mh, md = t(g, xh, idx), t(g, xd, idx)
    print(f"pallas gather rows {n}: host-table ok={ok} {mh:.3f} ms ({n*D*2/mh/1e6:.1f} GB/s), device-table {md:.3f} ms ({n*D*2/md/1e6:.1f} GB/s), out {y.sharding.memory_kind}", flush=True)
s = jax.jit(scatter, donate_argnums=0, out_shardings=None if interp else HOST)
n = N_SCATTER
idx_np = np.random.default_rng(1).choice(E, n, replace=False).astype(np.int32); idx = jnp.asarray(idx_np)
v = jnp.full((n, D), 3, jnp.float16)
xh2 = s(xh, idx, v)
print("pallas scatter into host table: out", xh2.sharding.memory_kind, "donated", xh.is_deleted(), flush=True)
got = np.array(jax.device_get(xh2), copy=True)
want = xn.copy(); want[idx_np] = 3
print("scatter ok", np.array_equal(got, want), flush=True)
del got
x3 = xh2; ts = []
for k in range(5):
    t0 = time.perf_counter(); x3 = s(x3, idx, v); x3.block_until_ready(); ts.append((time.perf_counter() - t0) * 1e3)
print("pallas scatter 65536 rows into host ms", [round(a, 3) for a in ts], flush=True)
# the in-place scatter without out_shardings: where does XLA put the aliased output?
s2 = jax.jit(scatter, donate_argnums=0)
x4 = s2(x3, idx, v)
print("scatter without out_shardings: out", x4.sharding.memory_kind, flush=True)
x3 = x4 if x4.sharding.memory_kind == "pinned_host" else jax.device_put(x4, HOST)
del x4
# compute_on host gather: 0.10 spells it as a context manager, 0.11 as a function transform with keywords
try:
    params = inspect.signature(compute_on).parameters
    take = lambda x, i: x.at[i].get(mode="promise_in_bounds")
    if "out_memory_spaces" in params:
        host_take = compute_on(take, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    else:
        def host_take(x, i):
            with compute_on("device_host"):
                return take(x, i)

    @jax.jit
    def f(x, i):
        return jax.device_put(host_take(x, jax.device_put(i, HOST)), DEVS)

    y = f(x3, idx)
    print("compute_on gather ok", y.sharding.memory_kind, "ms", round(t(f, x3, idx, n=3), 3), "rows", idx.shape[0],
          flush=True)
except Exception as e:  # noqa: BLE001
    print("compute_on failed", type(e).__name__, str(e)[:300], flush=True)
