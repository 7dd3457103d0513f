"""Shared test helpers.

Kernel tests run compiled when a GPU is present and in Pallas interpret mode
otherwise (CPU), with the same test code: `KERNEL_KW` carries the flag.
"""

import importlib.util
import os
import tempfile
import zlib


def _cpu_only() -> bool:
    """No CUDA plugin installed: jax will run on the CPU (decided before jax initialises a backend)."""
    return not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))


# On CPU the Pallas kernels run in interpret mode: each one becomes a large XLA program
# whose compilation dominates the suite's time while its execution is short. Compile with
# LLVM's cheap pipeline there (the same IEEE arithmetic), and without XLA's CPU fusion
# emitters: test_backward.py's XLA compile time 87 -> 54 s, the whole suite ~12 -> ~9 min
# on two cores (2026-12-01). Two programs built around the same interpreted kernel may then
# round a multiply-add differently (a few ulp: test_tt_grad.py::
# test_train_step_equals_apply_gradients takes that into account on the CPU only).
# TBE_JAX_TEST_FULL_OPT=1 keeps XLA's defaults.
if _cpu_only() and os.environ.get("TBE_JAX_TEST_FULL_OPT") != "1":
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
         "--xla_llvm_disable_expensive_passes=true", "--xla_cpu_use_fusion_emitters=false"]).strip()

# Four CPU devices for the sharding tests (tests/test_sharding.py); every other test uses device 0 as
# before. Set before jax initialises its CPU backend; no effect on the GPU.
if _cpu_only() and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()

# Several pytest-xdist workers on one GPU: each would preallocate most of its memory at its first call, and the
# workers that start late fail every test with an allocation error (session 54: 97 of 197 compiled tests, the
# kernels not at fault). Allocate on demand instead, unless the caller chose otherwise.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np
import pytest

import tbe_jax
from tbe_jax.testing import jaxpr_eqns  # noqa: F401  (the tests import it from here)

ON_GPU = jax.default_backend() == "gpu"

KERNEL_KW = dict(impl="pallas", interpret=not ON_GPU)


def tolerance(dtype: str, bag_len: int) -> float:
    """Relative tolerance (to max |ref|) by storage dtype and reduction length."""
    base = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    return base * max(1.0, np.sqrt(bag_len) / 4)


def assert_close(out, ref, rtol):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out))
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(out - ref).max() / scale
    assert err <= rtol, f"max error {err:.3g} relative to max |ref| exceeds {rtol:.3g}"


def tables_f64(emb, params):
    # get_tables jitted: one compile for all tables instead of one eager slice op per table.
    return [np.asarray(t, np.float64) for t in jax.jit(emb.get_tables)(params)]


def learning_rate_f64(opt, count: int = 0) -> float:
    """The learning rate of `opt`'s step number `count` (0: the first step), as a float: a float or a
    scalar array as given, a schedule evaluated at `count` (optax's convention)."""
    lr = opt.learning_rate
    return float(np.asarray(lr(count) if callable(lr) else lr, np.float64))


def model_step_f64(tables, momentum, touched, grads, opt, count: int = 0):
    """Float64 model of one exact row-wise Adagrad / SGD step on the touched rows: (tables, momentum or None).

    `count`: the optimizer state's step count before this step (the schedule's argument)."""
    lr = learning_rate_f64(opt, count)
    new_t, new_m = [], []
    for t, (w, g, hit) in enumerate(zip(tables, grads, touched)):
        w = w.copy()
        if isinstance(opt, tbe_jax.RowwiseAdagrad):
            m = momentum[t].copy()
            m[hit] += np.mean(g[hit] ** 2, axis=1)
            w[hit] -= lr * g[hit] / (np.sqrt(m[hit])[:, None] + float(opt.eps))
            new_m.append(m)
        else:
            w[hit] -= lr * g[hit]
        new_t.append(w)
    return new_t, (new_m if isinstance(opt, tbe_jax.RowwiseAdagrad) else None)


@pytest.fixture
def rng(request):
    # Fresh data for every test, reproducible run to run: seeded from the test's id
    # (crc32, not hash(): Python randomises string hashes per process).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def assert_runs_equal(a, b):
    """Two `runs.Runs` equal in every defined slot: the whole of src, scale, num_runs, long_chunk0, counts and
    seg_edges; run_start up to run_start[num_runs], run_key and the mid and long lists below their counts (the
    run-length pass leaves the slots past them undefined without `BackwardConfig.rle_fill`)."""
    num_runs, counts = int(a.num_runs), np.asarray(a.counts)
    assert int(b.num_runs) == num_runs
    np.testing.assert_array_equal(counts, np.asarray(b.counts), err_msg="counts")
    upto = {"run_start": num_runs + 1, "run_key": num_runs, "mid": int(counts[1]), "long": int(counts[2])}
    for name, x, y in zip(type(a)._fields, a, b):
        if x is None or y is None:
            assert x is None and y is None, name
        else:
            x, y = np.asarray(x), np.asarray(y)
            assert x.shape == y.shape, name
            end = upto.get(name, x.shape[0] if x.ndim else None)
            np.testing.assert_array_equal(x[:end] if x.ndim else x, y[:end] if y.ndim else y, err_msg=name)


def specs(rows, dims):
    return [tbe_jax.TableSpec(e, d, name=f"t{i}") for i, (e, d) in enumerate(zip(rows, dims))]


def layer_build(framework: str, cls, first, *args, **kw):
    """Construct a layer of `framework` ("linen", "nnx", "haiku"); Haiku inside a transform's init."""
    if framework == "haiku":
        import haiku as hk

        return hk.transform(lambda: cls(first, *args, **kw)).init(jax.random.key(0))
    if framework == "nnx":
        from flax import nnx

        kw = dict(kw, rngs=nnx.Rngs(0))
    return cls(first, *args, **kw)


def layer_call(framework: str, cls, first, indices, offsets, **kw):
    """Construct a layer of `framework` and call it once on (indices, offsets)."""
    if framework == "linen":
        return cls(first, **kw).init(jax.random.key(0), indices, offsets)
    if framework == "nnx":
        from flax import nnx

        return cls(first, rngs=nnx.Rngs(0), **kw)(indices, offsets)
    import haiku as hk

    return hk.transform(lambda: cls(first, **kw)(indices, offsets)).init(jax.random.key(0))


_CACHE_ENV = "TBE_JAX_TEST_JIT_CACHE"


def pytest_configure(config):
    # One persistent compilation cache per run, shared by the xdist workers: the controller
    # (or a plain run) makes a fresh directory and hands it to the workers through the
    # environment (they start after this hook). Programs compiled by one test or worker are
    # loaded by the others. TBE_JAX_TEST_JIT_CACHE=0 turns it off.
    if os.environ.get(_CACHE_ENV) == "0":
        return
    if not hasattr(config, "workerinput"):
        os.environ[_CACHE_ENV] = config._tbe_jax_cache = tempfile.mkdtemp(prefix="tbe_jax_test_jit_cache_")
    path = os.environ.get(_CACHE_ENV)
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    path = getattr(config, "_tbe_jax_cache", None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


# The heaviest files first. `make test` runs `--dist loadfile`: xdist hands whole files to its two workers in
# collection order, so a long file collected last can leave one worker running alone for minutes at the end;
# longest first (the rest keep their order) keeps the two workers' ends close. Seconds alone on 2 cores,
# 2026-12-03 (docs/testing.md): backward 229, sharding ~135, tt_grad 117, tt_layers ~93, optimizers 92, histogram
# 80, tt_kernel ~78, tt_params 78, dlrm_sharded ~60, dlrm ~55, forward_kernel 56, api 51, layers ~48.
_HEAVY_FIRST = ("test_backward.py", "test_sharding.py", "test_tt_grad.py", "test_tt_layers.py", "test_optimizers.py",
                "test_histogram.py", "test_tt_kernel.py", "test_tt_params.py", "test_dlrm_sharded.py", "test_dlrm.py",
                "test_forward_kernel.py", "test_api.py", "test_layers.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, the written order


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test file, drop JAX's compiled programs (`jax.clear_caches`).

    Each compiled XLA:CPU program keeps a few memory mappings of JIT code until it is freed; a worker that keeps
    every program of its share of the suite passed the kernel's limit of 65,530 mappings (`vm.max_map_count`)
    and crashed inside XLA (a segfault or abort while compiling or serializing a program, 2026-12-05). Programs
    are shared within a file (`--dist loadfile`), rarely across files; the persistent cache reloads them.
    """
    yield
    jax.clear_caches()
    import gc

    gc.collect()
