"""Host memory for the buffers of tables with `TableSpec.location` "host" or "host_cached" (issue 40).

On a GPU such a buffer is a `pinned_host` array: the Pallas kernels take it as an operand and read or write its
rows in place over the bus (zero-copy; `docs/host_memory.md` has the probes behind this). XLA's own ops refuse
host operands, so nothing but those kernels touches it inside a step, and what reads it outside one goes through
the host (`rows`). On a CPU (and in the kernels' interpret mode, which cannot read host operands) the "host"
buffer is an ordinary array: the same programs, a second buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
    Outside a GPU backend, `x`.

    The mark names the memory space only (`jax.memory.Space.Host`), not a device: it keeps the value on the device
    that computed it, which is also what a program inside `shard_map` (a sharded embedding's owners) needs."""
    return jax.device_put(x, jax.memory.Space.Host) if host_memory() else x


def to_numpy(x) -> np.ndarray:
    """A concrete array's values on the host, as a NumPy array. Never a view of a pinned host array: jaxlib caches
    the NumPy view of such an array on the array itself, and that view (an external reference) makes every later
    donation of the array fail ("Donation requested for buffer with external reference"), the next prefetch or
    step included. Host buffers are therefore read through a device copy of their rows (`rows`)."""
    if on_host(x):
        return rows(x, 0, x.shape[0])
    return np.asarray(jax.device_get(x))


READ_CHUNK_BYTES = 1 << 28  # rows of a host buffer read per device copy (`rows`): 256 MiB of HBM at a time


def rows(buf, start: int, count: int):
    """Rows `[start, start + count)` of a storage buffer: a slice of the array, or, for a buffer in host memory,
    a NumPy array of those rows, copied by a kernel into HBM `READ_CHUNK_BYTES` at a time and from there to the
    host (XLA cannot slice a pinned host array, the rows of a table larger than the GPU's memory must not come
    back through it at once, and a NumPy view would block the buffer's donation: `to_numpy`)."""
    if not on_host(buf):
        return buf[start : start + count]
    out = np.empty((count,) + tuple(buf.shape[1:]), buf.dtype)
    row_bytes = max(1, buf.dtype.itemsize * int(np.prod(buf.shape[1:], dtype=np.int64)))
    chunk = max(1, min(count, READ_CHUNK_BYTES // row_bytes))
    chunk = 1 << (chunk.bit_length() - 1) if chunk < count else chunk  # few distinct programs
    for s in range(0, count, chunk):
        n = min(chunk, count - s)
        out[s : s + n] = np.asarray(_read_rows(buf, np.int32(start + s), count=chunk))[:n]
    return out


@functools.partial(jax.jit, static_argnames="count")
def _read_rows(buf, start, *, count: int):
    """`count` rows of the host buffer `buf` from row `start` (rows past its end: unspecified), in device memory."""
    from tbe_jax.kernels.copy_rows import gather_rows  # the kernels import this module's neighbours

    ids = start + jnp.arange(count, dtype=jnp.int32)
    return gather_rows(buf, jnp.where(ids < buf.shape[0], ids, -1), kernel=True)


def host_full(shape, dtype, value=0):
    """An array of `value` placed in host memory (pinned, on a GPU backend) without passing through the GPU's
    memory: a NumPy array placed there (`np.zeros` maps no memory until read, and reading maps the zero page)."""
    dtype = jnp.dtype(dtype)
    return to_host(np.zeros(shape, dtype) if value == 0 else np.full(shape, value, dtype))


def host_blocks(shape, dtype, block: int, key, draw):
    """A `[rows, width]` host buffer made block by block, as `tbe.blocked_draw` makes a device one: block i is
    `draw(fold_in(key, i), r0)` (`block` rows from row `r0`, the last block ending at the last row), computed on
    the device and written into place (`write_rows`). The GPU's memory then holds one block at a time."""
    rows = shape[0]
    buf = host_full(shape, dtype)
    for i in range(-(-rows // block)):
        r0 = np.int32(min(i * block, rows - block))
        buf = write_rows(buf, draw(jax.random.fold_in(key, i), r0), r0)
    return buf


def write_rows(buf, vals, start):
    """`buf` (a host buffer, donated) with rows `[start, start + len(vals))` set to `vals`, in place."""
    return _write_rows(buf, vals, np.int32(start))


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buf, vals, start):
    from tbe_jax.kernels.copy_rows import copy_rows

    n = vals.shape[0]
    at = jnp.arange(n, dtype=jnp.int32)
    return keep_on_host(copy_rows(buf, vals.astype(buf.dtype), start + at, at, kernel=host_memory()))


def host_opt_slots(opt, params: dict, *, full=None, put=None) -> tuple:
    """`opt.init(params)`'s slot trees (`opt.slots`) for buffers in host memory, made there: the shapes from
    `jax.eval_shape`, each array's constant starting value from the state of a one-row buffer, made on the host
    by `full(shape, dtype, value)` (default `host_full`), or, when the value is traced (a jitted init), in the
    program and placed by `put` (default `to_host`). A sharded embedding passes its own placements."""
    full, put = full or host_full, put or to_host
    shapes = opt.slots(jax.eval_shape(opt.init, params))
    one = opt.slots(opt.init({k: jnp.zeros((1,) + tuple(v.shape[1:]), v.dtype) for k, v in params.items()}))
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(one)):  # a traced start value
        return tuple({k: put(jnp.full(s.shape, o[k].reshape(-1)[0], s.dtype)) for k, s in tree.items()}
                     for tree, o in zip(shapes, one))
    return tuple({k: full(s.shape, s.dtype, np.asarray(o[k]).reshape(-1)[0]) for k, s in tree.items()}
                 for tree, o in zip(shapes, one))
