"""Does Triton's `tl.histogram` (which Pallas does not expose) count ids faster than our Pallas kernel?

The histogram forward of one small table (`smalltable`: 64 rows, D 128 fp16, B 65536, L 128 by
default): counts[bags, E] @ table. Three kernels on the same inputs:
- "pallas": the library's histogram forward (packed 8-bit counters, `tbe_jax.kernels.histogram`);
- "tl_group": a `jax_triton` kernel, `tl.histogram` over `bags x E` bins of a `[bags, C]` id tile;
- "tl_bag": a `jax_triton` kernel, one `tl.histogram` of E bins per bag (fewer bins: fewer ballots).
Each is checked against the XLA reference and timed two ways: enqueued (calls back to back, one
block) and device time from a profiler trace. Results: benchmarks/results/triton-hist-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from tbe_jax import testing
from benchmarks.common import device_events, time_calls

import jax_triton as jt
import triton
import triton.language as tl


@triton.jit
def _group_kernel(offsets_ptr, indices_ptr, table_ptr, out_ptr, NUM_BAGS: tl.constexpr, E: tl.constexpr,
                  EP: tl.constexpr, D: tl.constexpr, BAGS: tl.constexpr, C: tl.constexpr):
    pid = tl.program_id(0)
    b = pid * BAGS + tl.arange(0, BAGS)
    ok = b < NUM_BAGS
    start = tl.load(offsets_ptr + b, mask=ok, other=0)
    end = tl.load(offsets_ptr + b + 1, mask=ok, other=0)
    ln = end - start
    mx = tl.max(ln, axis=0)
    cnt = tl.zeros([BAGS * EP], dtype=tl.int32)
    slot = tl.arange(0, BAGS)[:, None] * EP
    for k in range(0, mx, C):
        pos = k + tl.arange(0, C)[None, :]
        live = pos < ln[:, None]
        ids = tl.load(indices_ptr + start[:, None] + pos, mask=live, other=0)
        live = live & (ids >= 0) & (ids < E)
        cnt += tl.histogram(tl.reshape(slot + ids, [BAGS * C]), BAGS * EP, mask=tl.reshape(live, [BAGS * C]))
    c2 = tl.reshape(cnt, [BAGS, EP])
    r = tl.arange(0, EP)
    cols = tl.arange(0, D)
    tab = tl.load(table_ptr + r[:, None] * D + cols[None, :], mask=(r < E)[:, None], other=0.0)
    acc = tl.dot((c2 & 2047).to(tl.float16), tab)
    if tl.max(tl.max(c2, axis=1), axis=0) >= 2048:  # counts over 2047: the high part, exact in fp16 too
        acc += 2048.0 * tl.dot((c2 >> 11).to(tl.float16), tab)
    tl.store(out_ptr + b[:, None] * D + cols[None, :], acc, mask=ok[:, None])


@triton.jit
def _bag_kernel(offsets_ptr, indices_ptr, table_ptr, out_ptr, NUM_BAGS: tl.constexpr, E: tl.constexpr,
                EP: tl.constexpr, D: tl.constexpr, BAGS: tl.constexpr, C: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BAGS)
    cnt = tl.zeros([BAGS, EP], dtype=tl.int32)
    for j in tl.static_range(BAGS):
        bag = pid * BAGS + j
        s = tl.load(offsets_ptr + bag, mask=bag < NUM_BAGS, other=0)
        e = tl.load(offsets_ptr + bag + 1, mask=bag < NUM_BAGS, other=0)
        h = tl.zeros([EP], dtype=tl.int32)
        for k in range(s, e, C):
            pos = k + tl.arange(0, C)
            live = pos < e
            ids = tl.load(indices_ptr + pos, mask=live, other=0)
            h += tl.histogram(ids, EP, mask=live & (ids >= 0) & (ids < E))
        cnt = tl.where(rows[:, None] == j, h[None, :], cnt)
    b = pid * BAGS + rows
    ok = b < NUM_BAGS
    r = tl.arange(0, EP)
    cols = tl.arange(0, D)
    tab = tl.load(table_ptr + r[:, None] * D + cols[None, :], mask=(r < E)[:, None], other=0.0)
    acc = tl.dot((cnt & 2047).to(tl.float16), tab)
    if tl.max(tl.max(cnt, axis=1), axis=0) >= 2048:
        acc += 2048.0 * tl.dot((cnt >> 11).to(tl.float16), tab)
    tl.store(out_ptr + b[:, None] * D + cols[None, :], acc, mask=ok[:, None])


def triton_forward(kernel, table, indices, offsets, *, bags, c, num_warps):
    e, d = table.shape
    nb = offsets.shape[0] - 1
    return jt.triton_call(
        offsets, indices, table, kernel=kernel, out_shape=jax.ShapeDtypeStruct((nb, d), jnp.float32),
        grid=(-(-nb // bags),), num_warps=num_warps, num_stages=1,
        NUM_BAGS=nb, E=e, EP=max(32, 1 << (e - 1).bit_length()), D=d, BAGS=bags, C=c)


def device_ms(fn, args, iters):
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
        ev = device_events(d)
    return sum(e["dur"] for e in ev) / 1e3 / iters


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("-E", type=int, default=64)
    ap.add_argument("-D", type=int, default=128)
    ap.add_argument("-B", type=int, default=65536)
    ap.add_argument("--bags-lens", default="128,16,4")
    ap.add_argument("--variants", default="tl_group:16:8:1,tl_group:16:16:2,tl_bag:16:128:1,tl_bag:16:64:2,tl_bag:8:128:1")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    res = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "triton": triton.__version__,
           "jax_triton": jt.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "args": vars(args), "rows": []}
    rng = np.random.default_rng(0)
    for L in map(int, args.bags_lens.split(",")):
        idx, off, _ = testing.make_batch(rng, [args.E], [args.B], L)
        idx, off = jnp.asarray(idx), jnp.asarray(off)
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(args.E, args.D, bag_size_hint=1 << 20)],
                                            weights_dtype=jnp.float16)
        params = emb.init(jax.random.key(0))
        table = params[emb.layout.key(0)]
        ref = np.asarray(tbe_jax.TableBatchedEmbedding(
            [tbe_jax.TableSpec(args.E, args.D)], weights_dtype=jnp.float16, impl="xla")(params, idx, off), np.float64)
        row = {"L": L, "variants": {}}
        fns = {"pallas": (jax.jit(lambda p, i, o: emb(p, i, o)), (params, idx, off))}
        for v in args.variants.split(","):
            name, bags, c, warps = v.split(":")
            kern = _group_kernel if name == "tl_group" else _bag_kernel
            fns[v] = (jax.jit(lambda t, i, o, kern=kern, bags=int(bags), c=int(c), w=int(warps):
                              triton_forward(kern, t, i, o, bags=bags, c=c, num_warps=w)), (table, idx, off))
        for name, (fn, a) in fns.items():
            try:
                out = np.asarray(fn(*a), np.float64)
                err = float(np.abs(out - ref).max() / np.abs(ref).max())
                row["variants"][name] = {"max_rel_err": err, "enqueued_ms": time_calls(fn, [a], args.iters, 3),
                                         "device_ms": device_ms(fn, a, args.iters)}
            except Exception as ex:  # a variant that does not compile is reported, not fatal
                row["variants"][name] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
            print(L, name, row["variants"][name], flush=True)
        res["rows"].append(row)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"triton-hist-{stamp}-{res['gpu'].replace(' ', '_')}.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    print("saved", path)


if __name__ == "__main__":
    main()
