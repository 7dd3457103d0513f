"""`tbe_jax.shard` over several processes: 2 CPU processes (`jax.distributed.initialize`, gloo collectives)
with 2 devices each, against the same 4-device mesh in this one process.

The processes run tests/multiprocess_worker.py (a mixed "table" / "row" / "data" / "column" plan, Adagrad,
2 steps: one through the eager API, one with forward and update in one `jax.jit`; inputs made global
arrays per process). This process runs the worker's `run` on its own 4 fake CPU devices
(tests/conftest.py): the same programs, so the lookups must be equal bit for bit, and the tables and
accumulators agree to 1e-6. The unsharded `emb` on the global batch is checked too.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import multiprocess_worker as W
from test_sharding import assert_tables, global_batch

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or len(jax.devices()) < W.N_DEV,
    reason=f"the single-process reference runs on {W.N_DEV} CPU devices (tests/conftest.py's fake ones); "
           f"this process has {jax.default_backend()} x {len(jax.devices())}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env() -> dict:
    """This process's environment with 2 CPU devices per process instead of 4. conftest.py's other XLA
    flags (cheap LLVM pipeline) stay: the workers then compile exactly what the reference compiles."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={W.N_DEV // W.NUM_PROCESSES}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TBE_JAX_TEST_JIT_CACHE", None)  # conftest's cache is not set up in the workers
    return env


def _tail(path: Path, n=4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    lines = [ln for ln in text.splitlines() if not ln.startswith("[Gloo]")]
    return "\n".join(lines)[-n:]


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    env = _worker_env()
    procs, logs = [], []
    t0 = time.time()
    for pid in range(W.NUM_PROCESSES):
        log = tmp_path / f"process{pid}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "multiprocess_worker.py"), str(pid), str(port), str(tmp_path)],
                env=env, cwd=HERE.parent, stdout=f, stderr=subprocess.STDOUT))
    try:
        # The reference while the workers run (both compile first; 3 compilers share the cores).
        ref = W.run(jax.make_mesh((W.N_DEV,), ("data",), devices=jax.devices()[: W.N_DEV],
                                  axis_types=(jax.sharding.AxisType.Auto,)))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, TIMEOUT_S - (time.time() - t0))))
            except subprocess.TimeoutExpired:
                codes.append(f"timed out after {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(f"--- process {i}: exit {c}\n{_tail(log)}" for i, (c, log) in enumerate(zip(codes, logs)))
    assert codes == [0] * W.NUM_PROCESSES, f"worker processes failed:\n{report}"
    path = tmp_path / "results.npz"
    assert path.exists(), f"process 0 wrote no results:\n{report}"
    got = dict(np.load(path))

    assert set(got) == set(ref), (sorted(got), sorted(ref))
    emb, opt, tables = W.build()
    inputs = W.step_inputs(emb)
    for s in range(W.STEPS):  # the same program on the same devices' data: bit for bit
        np.testing.assert_array_equal(got[f"out{s}"], ref[f"out{s}"], err_msg=f"step {s}'s lookup")
    np.testing.assert_array_equal(got["out0_numpy_inputs"], got["out0"])
    for name in ref:
        if name.startswith(("table", "momentum")):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert int(got["count"]) == int(ref["count"]) == W.STEPS

    # and both against the unsharded embedding on the global batch
    ref_params = emb.set_tables(None, tables)
    ref_st = emb.init_opt_state(ref_params, opt)
    for s, (idx, off, w, g) in enumerate(inputs):
        gi, go, gw, _ = global_batch(emb, idx, off, w)
        np.testing.assert_allclose(got[f"out{s}"], np.asarray(emb(ref_params, gi, go, gw)), rtol=1e-5, atol=1e-6)
        ref_params, ref_st = emb.apply_gradients(ref_params, ref_st, opt, gi, go, g, gw)
        assert_tables([got[f"table{t}_step{s}"] for t in range(len(W.TABLES))], emb.get_tables(ref_params))
    assert_tables([got[f"momentum{t}"] for t in range(len(W.TABLES))], emb.get_momentum(ref_st))
