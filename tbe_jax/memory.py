"""Host memory for the buffers of tables with `TableSpec.location` "host" or "host_cached" (issue 40).

On a GPU such a buffer is a `pinned_host` array: the Pallas kernels take it as an operand and read or write its
rows in place over the bus (zero-copy; `docs/host_memory.md` has the probes behind this). XLA's own ops refuse
host operands, so nothing but those kernels touches it inside a step, and what reads it outside one goes through
the host (`rows`). On a CPU (and in the kernels' interpret mode, which cannot read host operands) the "host"
buffer is an ordinary array: the same programs, a second buffer.
"""

from __future__ import annotations

import jax
import numpy as np

HOST_KIND = "pinned_host"


def host_memory() -> bool:
    """Buffers placed in host memory are real `pinned_host` arrays here (a GPU backend)."""
    return jax.default_backend() == "gpu"


def host_sharding(device=None):
    """The single-device sharding of a pinned host buffer on `device` (default: the first device)."""
    return jax.sharding.SingleDeviceSharding(device or jax.devices()[0], memory_kind=HOST_KIND)


def on_host(x) -> bool:
    """`x` is an array in pinned host memory."""
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None) == HOST_KIND


def to_host(x):
    """`x` (an array or NumPy array) placed in pinned host memory on a GPU backend; on a CPU, as a JAX array.

    Concrete arrays are copied there; under a trace this is the in-program placement of the value (the
    output of the program stays in host memory)."""
    if not host_memory():
        return jax.numpy.asarray(x)
    if on_host(x):
        return x
    return jax.device_put(x, host_sharding())


def keep_on_host(x):
    """Inside a jitted program: the result of a kernel that wrote a host buffer in place, marked to stay in host
    memory (without it XLA refuses to return a host buffer from the program, error E1200, or would move it).
    Outside a GPU backend, `x`."""
    return jax.device_put(x, host_sharding()) if host_memory() else x


def to_numpy(x) -> np.ndarray:
    """A concrete array's values on the host (a pinned host array is read without a device copy)."""
    return np.asarray(jax.device_get(x))


def rows(buf, start: int, count: int):
    """Rows `[start, start + count)` of a storage buffer: a slice of the array, or, for a buffer in host memory,
    a NumPy array of those rows (read on the host: XLA cannot slice a pinned host array, and the rows of a table
    larger than the GPU's memory must not come back through it)."""
    if not on_host(buf):
        return buf[start : start + count]
    return to_numpy(buf)[start : start + count]
