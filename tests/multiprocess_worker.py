"""One process of the multi-process `tbe_jax.shard` test (tests/test_multiprocess.py).

Run as `python tests/multiprocess_worker.py <process_id> <port> <outdir>` by the test, twice (process 0 and
1), each with `XLA_FLAGS=--xla_force_host_platform_device_count=2` and `JAX_PLATFORMS=cpu`: the two
processes join through `jax.distributed.initialize` (gloo collectives on the CPU), build one mesh of the
4 devices, and train a small embedding with a mixed plan for `STEPS` steps. Process 0 writes what every
process gathered (`results.npz`, see `run`) to `<outdir>`.

Imported by the test (no side effects at import): `build`, `step_inputs`, `run` give the single-process
reference the same embedding, plan, tables and batches.
"""

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import tbe_jax

NUM_PROCESSES = 2
N_DEV = 4  # devices of the global mesh (2 per process)
TABLES = [tbe_jax.TableSpec(37, 8), tbe_jax.TableSpec(50, 16), tbe_jax.TableSpec(9, 8),
          tbe_jax.TableSpec(103, 12), tbe_jax.TableSpec(20, 16, name="last")]
FMAP = [0, 1, 2, 3, 4, 1]  # table 1 read by two features
MIXED = {0: "table", 1: "row", 2: "data", 3: "column", 4: ("table", N_DEV - 1)}
STRATEGIES = ("table", "row", "data", "column", "table")
B, CAP = 3, 40  # samples per device, id slots per device
STEPS = 2  # step 0: the eager API; step 1: forward and update in one jax.jit
SEED = 11


def build():
    """The unsharded embedding, the optimizer, the tables (numpy, from a fixed seed)."""
    emb = tbe_jax.TableBatchedEmbedding(TABLES, feature_table_map=FMAP, pooling="sum", impl="xla")
    rng = np.random.default_rng(SEED)
    tables = [rng.uniform(-1, 1, size=(t.num_embeddings, t.embedding_dim)).astype(np.float32) for t in TABLES]
    return emb, tbe_jax.Adagrad(0.2), tables


def local_batches(rng, emb, n, b, cap, max_len=4):
    """Per device: ids [n, cap] (padding past offsets[-1]), offsets [n, F*b+1], weights [n, cap]; some empty
    bags, duplicates, and one id -1 (dropped). tests/test_sharding.py's helper (not imported from there:
    that would import conftest, which starts jax's backend before `jax.distributed.initialize`)."""
    nf = emb.num_features
    idx = np.zeros((n, cap), np.int32)
    off = np.zeros((n, nf * b + 1), np.int32)
    for k in range(n):
        lens = rng.integers(0, max_len, size=nf * b)
        while lens.sum() > cap:
            lens = lens // 2
        off[k, 1:] = np.cumsum(lens)
        for f in range(nf):
            e = emb.tables[emb.feature_table_map[f]].num_embeddings
            a, z = off[k, f * b], off[k, (f + 1) * b]
            idx[k, a:z] = rng.integers(0, e, size=z - a)
        if off[k, -1] > 3:
            idx[k, 3] = -1
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    return idx, off, w


def step_inputs(emb):
    """Per step: (ids, offsets, weights, output gradient) of the global batch, numpy, the same in every
    process (a fixed seed)."""
    rng = np.random.default_rng(SEED + 1)
    out = []
    for _ in range(STEPS):
        idx, off, w = local_batches(rng, emb, N_DEV, B, CAP)
        g = rng.normal(size=(N_DEV * B, sum(emb.feature_dims))).astype(np.float32)
        out.append((idx, off, w, g))
    return out


def _global(x: np.ndarray, sharding: NamedSharding, local: bool) -> jax.Array:
    """`x` (the whole array, the same in every process) as a global array sharded by rows: from this
    process's rows (`make_array_from_process_local_data`) or per device (`make_array_from_callback`)."""
    if not local:
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
    rows = sorted({r for i in sharding.addressable_devices_indices_map(x.shape).values()
                   for r in range(*i[0].indices(x.shape[0]))})
    assert rows == list(range(rows[0], rows[-1] + 1)), rows  # this process's rows are one block
    return jax.make_array_from_process_local_data(sharding, x[rows[0] : rows[-1] + 1], x.shape)


def run(mesh, gather=np.asarray) -> dict:
    """Set the tables, then per step the forward and `apply_gradients` (step 0 eagerly, step 1 in one jit),
    the inputs global arrays; step 0's lookup also from host numpy inputs. `gather` brings a global array to
    the host (whole). Returns the host results by name: `out{s}` (step s's lookup), `table{t}_step{s}`
    (table t after step s), `momentum{t}` (Adagrad's accumulators at the end), `count`,
    `out0_numpy_inputs`."""
    emb, opt, tables = build()
    sharded = tbe_jax.shard(emb, mesh, "data", MIXED)
    assert sharded.plan.strategies == STRATEGIES, sharded.plan.strategies
    params = sharded.set_tables(None, tables)
    st = sharded.init_opt_state(params, opt)
    spec = NamedSharding(mesh, P("data"))

    @jax.jit
    def jitted_step(params, st, idx, off, w, g):
        out = sharded(params, idx, off, w)
        params, st = sharded.apply_gradients(params, st, opt, idx, off, g, w)
        return out, params, st

    res = {}
    for s, step_np in enumerate(step_inputs(emb)):
        idx, off, w, g = step_np
        idx, off, w = (_global(x, spec, local=False) for x in (idx, off, w))
        g = _global(g, spec, local=True)
        if s == 0:
            # host numpy inputs (the whole batch, the same in every process) give the same lookup
            res["out0_numpy_inputs"] = gather(sharded(params, *step_np[:3]))
            out = sharded(params, idx, off, w)
            params, st = sharded.apply_gradients(params, st, opt, idx, off, g, w)
        else:
            out, params, st = jitted_step(params, st, idx, off, w, g)
        res[f"out{s}"] = gather(out)
        for t, tab in enumerate(sharded.get_tables(params)):
            res[f"table{t}_step{s}"] = np.asarray(tab)
    for t, m in enumerate(sharded.get_momentum(st)):
        res[f"momentum{t}"] = np.asarray(m)
    res["count"] = np.asarray(gather(st.count))
    return res


def main(argv):
    pid, port, outdir = int(argv[1]), int(argv[2]), argv[3]
    t0 = time.time()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=NUM_PROCESSES,
                               process_id=pid, initialization_timeout=120)
    assert jax.process_count() == NUM_PROCESSES and jax.process_index() == pid
    assert len(jax.local_devices()) == N_DEV // NUM_PROCESSES and len(jax.devices()) == N_DEV, jax.devices()
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    from jax.experimental import multihost_utils

    def gather(x):
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    res = run(mesh, gather)
    multihost_utils.sync_global_devices("tbe_jax multiprocess test: done")
    if pid == 0:
        os.makedirs(outdir, exist_ok=True)
        tmp = os.path.join(outdir, "results.tmp.npz")
        np.savez(tmp, **res)
        os.replace(tmp, os.path.join(outdir, "results.npz"))
    print(f"process {pid}: done in {time.time() - t0:.1f} s; devices {jax.devices()}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv)
