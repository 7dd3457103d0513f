"""Issue 40 probe 4: the host tier's building blocks on the GPU (jax 0.11): a pinned_host buffer made inside
`jit` (`out_shardings`), an in-program `device_put` to pinned_host of an XLA-computed value, a host array read back
on the host (`jax.device_get`), and an orbax round trip of a pinned_host array.

    python -m benchmarks.probe_host_tier ROWS DIM
"""
import sys, time, tempfile
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

dev = jax.devices()[0]
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
E, D = int(sys.argv[1]), int(sys.argv[2])


def step(name, f):
    try:
        t0 = time.perf_counter()
        r = f()
        print(f"{name}: {r} ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def zeros_host():
    z = jax.jit(lambda: jnp.zeros((E, D), jnp.float16), out_shardings=HOST)()
    jax.block_until_ready(z)
    return z.sharding.memory_kind, [d.memory_stats().get("peak_bytes_in_use") for d in jax.devices()][:1]


step("jit zeros, out_shardings pinned_host", zeros_host)


def put_in_program():
    f = jax.jit(lambda x: jax.device_put(x * 2, HOST))
    y = f(jnp.ones((1024, D), jnp.float32))
    return y.sharding.memory_kind, float(np.asarray(jax.device_get(y))[0, 0])


step("device_put(x * 2, pinned_host) inside jit", put_in_program)


def read_back():
    z = jax.device_put(np.arange(E * 4, dtype=np.float32).reshape(E, 4), HOST)
    a = np.asarray(jax.device_get(z))
    return a.shape, float(a[-1, -1])


step("device_get of a pinned_host array", read_back)


def orbax_round_trip():
    import orbax.checkpoint as ocp
    x = jax.device_put(np.arange(4096 * D, dtype=np.float32).reshape(4096, D), HOST)
    d = tempfile.mkdtemp()
    ck = ocp.StandardCheckpointer()
    ck.save(d + "/c", {"h": x})
    ck.wait_until_finished()
    r = ck.restore(d + "/c", {"h": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=HOST)})
    return r["h"].sharding.memory_kind, bool(np.array_equal(np.asarray(jax.device_get(r["h"])),
                                                         np.asarray(jax.device_get(x))))


step("orbax save/restore pinned_host", orbax_round_trip)
print("jax", jax.__version__, dev.device_kind, flush=True)
