"""Issue 40: the row copies of the host tier's prefetch, alone (`tbe_jax.kernels.copy_rows`), device time per copy.

Session 33 measured the cached step 1.5 ms slower with ~77k more evicted rows written back a step (~20 MB: ~13
GB/s, slower than the fills). This times each copy the prefetch makes, on its own, at the sizes of the
benchmark's model (`python -m benchmarks host_cache`): `--count` random rows of a `--rows` x `--dim` fp16 table and of
its row-wise fp32 state, between a pinned host buffer and an HBM one, in both directions:

- "fill": host -> HBM (a miss's row into its cache slot), sources in random order and sorted (the prefetch's
  order: its misses come in row order);
- "write-back": HBM -> host (an evicted changed row to its host row), destinations in random order and sorted;
- "stage": HBM -> HBM (the changed victims' rows staged before the fill);

- "..., fresh sorted rows": cycling `--fresh` different row sets over the iterations (a step's rows change
  every step; the GPU's translations of the host pages then do not stay warm);
- "..., rows and state, ...": what a row-wise Adagrad prefetch launches since session 35, the rows and their
  4-byte states in one kernel (the states alone took ~0.12 ms per direction, latency-bound);

with the fraction `--live` of the `--count` pairs live (the others -1, as in the prefetch, whose copies run over
the fill cap's pairs whatever the misses). Reports ms per copy and GB/s of the live rows.

    python -m benchmarks probe_copy_rows --rows 8000000 --count 162000 --live 0.5

Session 34 (H100): at 8M host rows, random rows crossed at 16 GB/s and sorted ones at 45, both directions; at 1M
rows (256 MB) both orders ran at 51 (`results/probe-copy-rows-20261205-*`).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from tbe_jax import memory
from tbe_jax.kernels.copy_rows import copy_rows


def _case(name, make_dst, src, dst_rows, src_rows, iters, interpret, more=(), **kw):
    """Times `copy_rows` into a fresh buffer from `make_dst()` (donated, so written in place); with `more`
    (further `(dst_rows, src_rows)` pairs), cycling the row sets over the iterations."""
    row_sets = [(dst_rows, src_rows), *more]
    dst = make_dst()
    on_host = memory.on_host(dst[0] if isinstance(dst, tuple) else dst)

    @functools.partial(jax.jit, donate_argnums=0)
    def f(d, s, dr, sr):
        out = copy_rows(d, s, dr, sr, kernel=True, interpret=interpret, **kw)
        if not on_host:
            return out
        # a host buffer written in place stays there
        return tuple(map(memory.keep_on_host, out)) if isinstance(out, tuple) else memory.keep_on_host(out)

    box = [f(dst, src, dst_rows, src_rows)]
    jax.block_until_ready(box)

    def run(i):
        box[0] = f(box[0], src, *row_sets[(i + 1) % len(row_sets)])
        return box[0]

    ms, kernels = common.device_ms(run, iters, top=3)
    del box
    return _report(name, ms, kernels, int(jnp.sum((dst_rows >= 0) & (src_rows >= 0))), src)


def _report(name, ms, kernels, live, like):
    """A case's line and record: `live` rows of `like`'s row size (`like`: an array or a tuple of arrays sharing
    the rows) moved in `ms`."""
    row_bytes = sum(int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
                    for a in (like if isinstance(like, tuple) else (like,)))
    gbps = live * row_bytes / (ms * 1e6) if ms else 0.0
    print(f"{name:44s} {ms:8.4f} ms  {live:7d} live rows of {row_bytes:4d} B  {gbps:7.1f} GB/s", flush=True)
    return {"case": name, "ms": ms, "live_rows": live, "row_bytes": row_bytes, "gbps": gbps, "kernels": kernels}


def _row_sets(rng, args, sets):
    """`sets` draws of (fill_dst, fill_src, wb_dst, wb_src): fills from and write-backs to disjoint host rows
    (each sorted, as the prefetch orders them), into / from distinct cache slots and stage rows."""
    n = args.count
    out = []
    for _ in range(sets):
        live = rng.random(n) < args.live
        both = rng.choice(args.rows, 2 * n, replace=False)
        fill_src = np.sort(np.where(live, both[:n], args.rows))
        fill_src = np.where(fill_src < args.rows, fill_src, -1)
        fill_dst = np.where(fill_src >= 0, rng.choice(args.cache_rows, n, replace=False), -1)
        wb_dst = np.sort(np.where(live, both[n:], args.rows))
        wb_dst = np.where(wb_dst < args.rows, wb_dst, -1)
        wb_src = np.arange(n)
        out.append(tuple(jnp.asarray(a.astype(np.int32)) for a in (fill_dst, fill_src, wb_dst, wb_src)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks probe_copy_rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8_000_000,
                    help="rows of the host buffer (the host_cache benchmark's 8 x 1M: the copies' speed depends on it)")
    ap.add_argument("--cache-rows", type=int, default=1_600_000, help="rows of the HBM buffer")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--count", type=int, default=162_000, help="pairs per copy (the prefetch's fill cap)")
    ap.add_argument("--live", type=float, default=0.5, help="the fraction of the pairs that copy")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fresh", type=int, default=8, help="row sets cycled by the fresh-rows cases")
    ap.add_argument("--block-elems", type=int, default=4096, help="copy_rows' block_elems (values a program copies)")
    ap.add_argument("--num-warps", type=int, default=4, help="copy_rows' num_warps")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    interpret = common.interpret()
    kw = dict(block_elems=args.block_elems, num_warps=args.num_warps)
    rng = np.random.default_rng(0)
    n = args.count
    live = rng.random(n) < args.live
    host_rows = np.where(live, rng.choice(args.rows, n, replace=False), -1).astype(np.int32)
    cache_rows = np.where(live, rng.choice(args.cache_rows, n, replace=False), -1).astype(np.int32)
    order = np.argsort(np.where(live, host_rows, args.rows), kind="stable")
    hr, cr = jnp.asarray(host_rows), jnp.asarray(cache_rows)
    hr_sorted = jnp.asarray(host_rows[order])
    cases = []
    arange = jnp.arange(n, dtype=jnp.int32)
    for width, dtype, what in ((args.dim, jnp.float16, "rows"), (None, jnp.float32, "row-wise state")):
        shape = (lambda r: (r, width)) if width else (lambda r: (r,))  # noqa: E731
        host = memory.host_full(shape(args.rows), dtype, 1)  # the host part (a fill's source)
        cache = jnp.ones(shape(args.cache_rows), dtype)  # the cache part (the stage's source)
        stage = jnp.ones(shape(n), dtype)  # the staged rows (a write-back's source)
        new_host = lambda: memory.host_full(shape(args.rows), dtype)  # noqa: E731
        cases += [
            _case(f"fill ({what})", lambda: jnp.zeros(shape(args.cache_rows), dtype), host, cr, hr, args.iters,
                  interpret, **kw),
            _case(f"fill, sorted rows ({what})", lambda: jnp.zeros(shape(args.cache_rows), dtype), host,
                  jnp.asarray(cache_rows[order]), hr_sorted, args.iters, interpret, **kw),
            _case(f"stage ({what})", lambda: jnp.zeros(shape(n), dtype), cache, arange, cr, args.iters, interpret,
                  **kw),
            _case(f"write-back ({what})", new_host, stage, hr, arange, args.iters, interpret, **kw),
            _case(f"write-back, sorted rows ({what})", new_host, stage, hr_sorted, jnp.asarray(order.astype(np.int32)),
                  args.iters, interpret, **kw),
        ]
        sets = _row_sets(rng, args, args.fresh)
        # a new row set every iteration (`--fresh` of them cycled), as a prefetch sees
        cases += [
            _case(f"fill, fresh sorted rows ({what})", lambda: jnp.zeros(shape(args.cache_rows), dtype), host,
                  sets[0][0], sets[0][1], args.iters, interpret, more=[r[:2] for r in sets[1:]], **kw),
            _case(f"write-back, fresh sorted rows ({what})", new_host, stage, sets[0][2], sets[0][3], args.iters,
                  interpret, more=[r[2:] for r in sets[1:]], **kw),
        ]
        del host, cache, stage
    # what a row-wise Adagrad prefetch launches: the rows and their states in one kernel, each direction
    sets = _row_sets(rng, args, args.fresh)
    kinds = ((args.dim,), jnp.float16), ((), jnp.float32)
    host = tuple(memory.host_full((args.rows,) + s, dt, 1) for s, dt in kinds)
    stage = tuple(jnp.ones((n,) + s, dt) for s, dt in kinds)
    cases += [
        _case("fill, rows and state, fresh sorted rows", lambda: tuple(jnp.zeros((args.cache_rows,) + s, dt)
                                                                       for s, dt in kinds),
              host, sets[0][0], sets[0][1], args.iters, interpret, more=[r[:2] for r in sets[1:]], **kw),
        _case("write-back, rows and state, fresh sorted rows", lambda: tuple(memory.host_full((args.rows,) + s, dt)
                                                                             for s, dt in kinds),
              stage, sets[0][2], sets[0][3], args.iters, interpret, more=[r[2:] for r in sets[1:]], **kw),
    ]
    print("saved", common.save("probe-copy-rows", {"meta": common.meta(), "config": vars(args), "cases": cases},
                               args.out))


if __name__ == "__main__":
    main()
