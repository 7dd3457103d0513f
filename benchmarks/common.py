"""Shared code of the benchmark suites: timing, workloads, configs given as JSON, saving results.

Timing:
- `device_ms(run, iters)`: the summed duration of the GPU's activity (kernels, memcpys, memsets on every stream)
  per call of `run(i)`, from an in-memory profiler session (no trace on disk), with the per-name breakdown;
- `enqueued_ms(run, iters, reps)` / `time_calls(fn, arg_sets, iters, reps)`: wall time per call of calls enqueued
  back to back and blocked once (host dispatch hidden unless it exceeds the device time), median of `reps`;
- `time_chain(step, carry, arg_sets, iters, reps)`: the same for steps whose carry (tables, state) is donated;
- `host_us(run, calls)`: host time of one call, timed call by call without blocking;
- `profile(step, carry, sets, iters)`: GPU (or host) time per kernel name per step from a profiler trace on disk,
  with calls per step.
Workloads: `workload(name)` (presets, `dims<lo>-<hi>/<step>`, `many<T>x<dims>`, `tiny` for a CPU smoke run),
`make_sets(wl, n)` (input sets, with an output gradient each), `tables(wl)`.
Configs: `configs(items, cls)` turns JSON objects (`'{"unroll": 8}'`, `{}` or `default`: the defaults) into config
objects (`tbe_jax.ForwardConfig`, `BackwardConfig`, `HistogramConfig`, `tt_jax`'s `TTKernelConfig`).
Results: `meta()` (date, GPU name, versions, host) and `save(kind, payload, out)`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import glob
import gzip
import json
import os
import platform
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LR, EPS = 0.1, 0.1  # the anchors' row-wise Adagrad

# benchmarks/ANCHORS.md (H200, 2026-11-29): FBGEMM's CUDA TBE "kernels" times per preset, and the anchors' own XLA
# baseline (ms).
FBGEMM_FWD_KERNEL_MS = {
    "base": 0.187, "zipf": 0.125, "weighted": 0.157, "large": 0.849, "fp32": 0.146, "smalltable": 0.218,
}
FBGEMM_BWD_KERNEL_MS = {
    "base": 1.538, "zipf": 0.986, "weighted": 1.423, "large": 7.497, "fp32": 0.902, "smalltable": 0.820,
}
ANCHOR_XLA_FWD_MS = {
    "base": 0.449, "zipf": 0.316, "weighted": 0.371, "large": 1.327, "fp32": 0.436, "smalltable": 0.639,
}
ANCHOR_XLA_BWD_MS = {
    "base": 2.286, "zipf": 3.634, "weighted": 3.728, "large": 19.155, "fp32": 4.027, "smalltable": 2.431,
}

# -- timing -------------------------------------------------------------------------------------------------------


def _stream_events(xspace: bytes):
    """(name, duration ns) of every event on the device planes' stream lines."""
    from jax._src.lib import _profile_data

    data = _profile_data.ProfileData.from_serialized_xspace(xspace)
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        streams = [ln for ln in lines if "Stream" in ln.name] or lines
        for ln in streams:
            out.extend((e.name, e.duration_ns) for e in ln.events)
    return out


def device_ms(run, iters: int, top: int = 0):
    """(ms of device activity per call, {name: ms per call} of the `top` largest names)."""
    from jax._src.lib import _profiler

    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    out = None
    try:
        for i in range(iters):
            out = run(i)
        jax.block_until_ready(out)
    finally:
        events = _stream_events(session.stop())
    per = collections.defaultdict(float)
    for name, ns in events:
        per[name] += ns / 1e6 / iters
    total = sum(per.values())
    names = dict(sorted(per.items(), key=lambda kv: -kv[1])[:top]) if top else {}
    return total, names


def enqueued_ms(run, iters: int, reps: int) -> float:
    """Median over `reps` of the wall time per call of `iters` calls enqueued back to back, blocked once."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = run(i)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def host_us(run, calls: int, groups: int = 5) -> float:
    """Median host time (us) of one call, timed call by call without blocking (groups of `calls`, blocked
    between groups so the device queue stays short): what dispatch costs when the device keeps up."""
    samples = []
    for _ in range(groups):
        out = None
        for i in range(calls):
            t0 = time.perf_counter_ns()
            out = run(i)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        jax.block_until_ready(out)
    return statistics.median(samples)


def time_calls(fn, arg_sets, iters: int, reps: int) -> float:
    """Median ms per call of `fn(*arg_sets[i % len])`, `iters` calls enqueued back to back, blocked once (after
    one warm-up call per set)."""
    for a in arg_sets:  # warm-up / compile
        jax.block_until_ready(fn(*a))
    return enqueued_ms(lambda i: fn(*arg_sets[i % len(arg_sets)]), iters, reps)


def time_chain(step, carry, arg_sets, iters: int, reps: int, warmups: int = 1):
    """(median ms per step, last carry); `step(carry, *args) -> carry` with the carry donated. `warmups` rounds
    over the argument sets first (2 when the first call's carry is placed differently from the step's output)."""
    for _ in range(warmups):  # compile + warm-up
        for a in arg_sets:
            carry = step(carry, *a)
    jax.block_until_ready(carry)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(iters):
            carry = step(carry, *arg_sets[i % len(arg_sets)])
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples), carry


def _trace_events(log_dir: str, device: bool) -> list[dict]:
    """The complete ('X') events of a `jax.profiler.trace` directory's device processes (or host ones)."""
    (path,) = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path, "rb") as fh:
        events = json.load(fh)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {pid for pid, n in names.items() if "GPU" in n or "/device:" in n}
    if device and not dev:
        print("no device process in the trace; processes:", sorted(names.values()))
    return [e for e in events if e.get("ph") == "X" and (e.get("pid") in dev) == device and "dur" in e]


def device_events(log_dir: str) -> list[dict]:
    return _trace_events(log_dir, True)


def host_events(log_dir: str) -> list[dict]:
    return _trace_events(log_dir, False)


_SCOPE = re.compile(r"tbe_[a-z_]+(?:/copies)?")


_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = .*?op_name=\"([^\"]*)\"")


def hlo_scopes(hlo_text: str) -> dict:
    """{kernel name: the library's scope} from a compiled program's HLO (`compiled.as_text()`): each top-level
    instruction whose op name holds a `tbe_...` scope, under the name a profile gives its kernel (the
    instruction's name with dots as underscores: `%input_scatter_fusion.4` runs as `input_scatter_fusion_4`)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_INSTR.match(line)
        if m:
            scope = _SCOPE.search(m.group(2))
            if scope:
                out.setdefault(m.group(1).replace(".", "_"), scope.group(0))
    return out


def profile(step, carry, sets, iters: int, host: bool = False, keep: list | None = None) -> dict:
    """{kernel name: {"ms": per step, "calls_per_step"}}, largest first, of `iters` steps `carry = step(carry,
    *sets[i % len])` traced after one warm-up round (device events; `host=True`: host events). `keep`: a list
    the final carry is appended to (for a carry that is donated)."""
    for a in sets:  # compile + warm-up
        carry = step(carry, *a)
    jax.block_until_ready(carry)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(iters):
                carry = step(carry, *sets[i % len(sets)])
            jax.block_until_ready(carry)
        events = host_events(d) if host else device_events(d)
    if keep is not None:
        keep.append(carry)
    per = collections.defaultdict(float)
    count = collections.Counter()
    for e in events:
        per[e["name"]] += e["dur"] / 1e3 / iters
        count[e["name"]] += 1
    return {k: {"ms": per[k], "calls_per_step": count[k] / iters} for k in sorted(per, key=per.get, reverse=True)}


def print_kernels(kernels: dict, top: int):
    """The `top` kernels of `profile`'s result: ms per step, calls per step, name."""
    for k, v in list(kernels.items())[:top]:
        print(f"  {v['ms']:7.4f} ms  x{v['calls_per_step']:.0f}  {k[:110]}")


# -- workloads ----------------------------------------------------------------------------------------------------


def workload(name: str):
    """A preset (`tbe_jax.testing.PRESETS`), a model spec `tbe_jax.testing.workload` knows, or `tiny` (a CPU smoke
    run in interpret mode)."""
    from tbe_jax import testing

    if name == "tiny":
        return testing.Workload("tiny", 2, 300, 16, 16, 4, 1.15, weighted=True)
    return testing.workload(name)


def tables(wl, hints: bool = True):
    """One `TableSpec` per feature of `wl` (the bag-size hint its L: small tables may take the histogram path)."""
    import tbe_jax

    return [tbe_jax.TableSpec(e, d, bag_size_hint=l if hints else None) for e, d, l in wl.features()]


def make_sets(wl, n_sets: int, seed: int = 0, grad: bool = True, device: bool = True):
    """`n_sets` input sets of workload `wl`: (indices, offsets, per-sample weights or None[, output gradient
    float32 [B, sum D]]), as device arrays (or NumPy with `device=False`). Zipf ids are permuted per table."""
    from tbe_jax import testing

    rng = np.random.default_rng(seed)
    feats = wl.features()
    nf = len(feats)
    perms = [np.random.default_rng(1000 + t).permutation(e) for t, (e, _, _) in enumerate(feats)] \
        if wl.alpha > 1 else None
    sets = []
    for _ in range(n_sets):
        s = testing.make_batch(rng, [e for e, _, _ in feats], [wl.B] * nf, [l for _, _, l in feats],
                               alpha=wl.alpha, weighted=wl.weighted, perms=perms)
        if grad:
            s = tuple(s) + (rng.standard_normal((wl.B, sum(d for _, d, _ in feats)), dtype=np.float32),)
        sets.append(tuple(jnp.asarray(x) if device and x is not None else x for x in s))
    return sets


def with_opt(opt, sets):
    """The input sets with the optimizer first (a jitted step's arguments after its carry)."""
    return [(opt,) + tuple(s) for s in sets]


def interpret() -> bool:
    """Pallas in interpret mode off the GPU (a CPU run is a smoke test of the script, not a measurement)."""
    return jax.default_backend() != "gpu"


@jax.jit
def rel_err(a, b):
    """max |a - b| / max |b| in float32, on the device."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)


# -- configs ------------------------------------------------------------------------------------------------------


def config(text: str, cls):
    """One config object of class `cls` from a JSON object of its fields (`{}`, '' or 'default': the defaults)."""
    text = (text or "").strip()
    fields = {} if text in ("", "default") else json.loads(text)
    if not isinstance(fields, dict):
        raise SystemExit(f"a config is a JSON object of {cls.__name__} fields, got {text!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise SystemExit(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(names)}")
    return cls(**fields)


def configs(items, cls) -> dict:
    """{item: config} for each JSON item (see `config`), in order; no items: {'default': cls()}."""
    items = list(items or [])
    return {it: config(it, cls) for it in items} if items else {"default": cls()}


# -- results ------------------------------------------------------------------------------------------------------


def meta(**extra) -> dict:
    """What a saved result needs to be read later: date (UTC), the device, versions, the host."""
    dev = jax.devices()[0]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
           "num_devices": len(jax.devices()), "host": platform.node(), "python": platform.python_version(),
           "jax": jax.__version__}
    try:
        import jaxlib

        out["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        out["jaxlib"] = None
    for mod in ("triton", "torch", "fbgemm_gpu"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent, or fails to import without a GPU)
            pass
    out.update(extra)
    return out


def gpu_tag() -> str:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev)).replace(" ", "_")
    n = len(jax.devices())
    return kind if jax.default_backend() != "gpu" or n == 1 else f"{n}x{kind}"


def save(kind: str, payload: dict, out: str = "", tag: str = "") -> str:
    """Write `payload` (with a "meta" key added if it has none) as JSON: to `out` if it ends in .json, else to
    `<out or benchmarks/results>/<kind>-<UTC stamp>[-tag]-<gpu>.json`. Returns the path."""
    payload = payload if "meta" in payload else {"meta": meta(), **payload}
    if out.endswith(".json"):
        path = out
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    else:
        d = out or RESULTS
        os.makedirs(d, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        path = os.path.join(d, f"{kind}-{stamp}{'-' + tag if tag else ''}-{gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    return path
