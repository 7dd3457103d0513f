"""Device time of jitted JAX calls from an in-memory profiler session, and enqueued time.

`device_ms(run, iters)` opens a profiler session (no trace written to disk), calls `run(i)` for i in
range(iters), blocks on the last result, and returns the summed duration of the GPU's activity (kernels, memcpys,
memsets on every stream) per call, with the per-name breakdown. `enqueued_ms` times calls enqueued back to back
and blocked once: host dispatch is hidden unless it exceeds the device time.
"""

from __future__ import annotations

import collections
import statistics
import time

import jax
from jax._src.lib import _profile_data, _profiler


def _stream_events(xspace: bytes):
    """(name, duration ns) of every event on the device planes' stream lines."""
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
