"""Issue 40 probe 6: why a jitted prefetch + step of the host tier took 1.17 s (`host-cache-20261205-NVIDIA_H100`),
and which reads of a pinned host array block its later donation.

Part A: a pinned host array is donated to an identity program after each way of reading it (NumPy view, device_get,
`memory.rows`, an orbax save): OK or the error. Part B: a model of `--tables` host_cached tables (`--rows` x 128 fp16, load factor
0.2, B 16384, 20 ids a bag, Zipf 1.05); the prefetch alone, the step alone and both in one program, each jitted and
donated: the compiled program's instructions on the host buffer's shape (a copy of it would show there) and its
time; then the prefetch traced without the in-program host placement of its write-back (`memory.keep_on_host`
replaced by the identity) and the host buffers placed by `out_shardings` instead.

    python -m benchmarks.probe_host_cache_cost --rows 2000000 --tables 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
from benchmarks import common
from tbe_jax import memory


def _donate(x):
    try:
        y = jax.jit(lambda a: a, donate_argnums=0)(x)
        jax.block_until_ready(y)
        return "OK", y
    except Exception as e:  # noqa: BLE001
        return "FAIL " + str(e).replace("\n", " ")[:160], None


def part_a():
    def fresh():
        return jax.device_put(np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8), memory.host_sharding())

    x = fresh()
    print("A fresh device_put(numpy) ->", _donate(x)[0], flush=True)
    x = fresh()
    v = np.asarray(x)
    del v
    gc.collect()
    print("A after np.asarray(x), view deleted ->", _donate(x)[0], flush=True)
    x = fresh()
    jax.device_get(x)
    gc.collect()
    print("A after jax.device_get(x) discarded ->", _donate(x)[0], flush=True)
    x = fresh()
    r = memory.rows(x, 5, 100)
    ok = np.array_equal(r, np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8)[5:105])
    print("A after memory.rows(x) (equal:", ok, ") ->", _donate(x)[0], flush=True)
    try:  # a checkpoint between steps: does orbax leave a view on the array (then the next step cannot donate it)?
        import tempfile

        import orbax.checkpoint as ocp

        x = fresh()
        with tempfile.TemporaryDirectory() as d:
            ckpt = ocp.StandardCheckpointer()
            ckpt.save(d + "/c", {"x": x})
            ckpt.wait_until_finished()
        gc.collect()
        print("A after an orbax save ->", _donate(x)[0], flush=True)
    except ImportError:
        print("A orbax not installed", flush=True)
    x = fresh()
    y = jax.jit(lambda a: a, out_shardings=memory.host_sharding())(x)
    print("A identity jit (no donation) aliases:", y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer(), flush=True)


@contextlib.contextmanager
def _no_keep_on_host():
    saved = memory.keep_on_host
    memory.keep_on_host = lambda x: x
    try:
        yield
    finally:
        memory.keep_on_host = saved


def _hlo_lines(compiled, rows):
    txt = compiled.as_text()
    keys = (f"[{rows},", f"[{rows}]")
    out = [ln.strip()[:220] for ln in txt.splitlines() if any(k in ln for k in keys)
           and not ln.strip().startswith(("ROOT tuple", "tuple"))]
    return out


def _time(f, carry, batches, iters):
    n = len(batches)
    for k in range(2):
        carry = f(*carry, *batches[k % n])
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    for k in range(iters):
        carry = f(*carry, *batches[k % n])
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) * 1e3 / iters, carry


def part_b(args):
    from benchmarks.host_cache import batch_sets

    ns = types.SimpleNamespace(rows=args.rows, tables=args.tables, batch=args.batch, bag=20, dim=128)
    sets = batch_sets(ns, 1.05, 4)
    specs = [tbe_jax.TableSpec(args.rows, 128, location="host_cached") for _ in range(args.tables)]
    emb = tbe_jax.TableBatchedEmbedding(specs, weights_dtype=jnp.float16, cache_load_factor=0.2)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=1e-8)
    t0 = time.perf_counter()
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    jax.block_until_ready((params, state))
    print(f"B init {time.perf_counter() - t0:.1f} s; buffers",
          {k: (v.shape, v.sharding.memory_kind) for k, v in params.items() if k != "cache"}, flush=True)
    host_rows = args.rows * args.tables

    def pre(p, s, i, o, g):
        return emb.prefetch(p, i, o, opt_state=s)

    def step(p, s, i, o, g):
        r = tbe_jax.train_step(lambda _, out: jnp.sum(out * g), None, tbe_jax.SparseLookup(emb, opt, p, s, i, o))
        return r.params, r.opt_state

    def both(p, s, i, o, g):
        p, s = emb.prefetch(p, i, o, opt_state=s)
        return step(p, s, i, o, g)

    carry = (params, state)
    for name, f, ctx, outs in (("prefetch", pre, contextlib.nullcontext, False),
                               ("prefetch, no in-program placement", pre, _no_keep_on_host, True),
                               ("step", step, contextlib.nullcontext, False),
                               ("prefetch + step", both, contextlib.nullcontext, False)):
        try:
            kw = {}
            if outs:
                kw["out_shardings"] = jax.tree.map(lambda a: a.sharding, carry)
            with ctx():
                jf = jax.jit(f, donate_argnums=(0, 1), **kw)
                t0 = time.perf_counter()
                compiled = jf.lower(*carry, *sets[0]).compile()
                print(f"B {name}: compiled in {time.perf_counter() - t0:.1f} s; instructions on "
                      f"[{host_rows}, ...]:", flush=True)
                for ln in _hlo_lines(compiled, host_rows):
                    print("     ", ln, flush=True)
                ms, carry = _time(jf, carry, sets, args.iters)
            st = [int(v) for v in emb.cache_stats(carry[0]).values()]
            print(f"B {name}: {ms:.3f} ms per call (stats {st})", flush=True)
            if args.profile and not outs:
                box = [carry]

                def run(i, jf=jf):
                    box[0] = jf(*box[0], *sets[i % len(sets)])
                    return box[0]

                total, names = common.device_ms(run, args.iters, top=10)
                carry = box[0]
                print(f"B {name}: device {total:.3f} ms per call; largest:", flush=True)
                for k, v in names.items():
                    print(f"      {v:.4f} ms  {k[:100]}", flush=True)
        except Exception as e:  # noqa: BLE001
            tb = "".join(traceback.format_tb(e.__traceback__)[-4:]).replace("\n", " | ")[-600:]
            print(f"B {name}: FAIL {type(e).__name__}: {str(e)[:400]} at {tb}", flush=True)
            return
    t0 = time.perf_counter()
    tabs = emb.get_tables(carry[0])
    print(f"B get_tables: {time.perf_counter() - t0:.2f} s for {sum(t.nbytes for t in tabs) / 1e9:.2f} GB; "
          f"then a prefetch:", _donate(carry[0][emb.inner.layout.key(0) + "_host"])[0]
          if emb.inner.layout.key(0) + "_host" in carry[0] else "", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--profile", action="store_true", help="each program's largest kernels (device time)")
    args = ap.parse_args(argv)
    print(jax.devices(), jax.__version__, flush=True)
    if memory.host_memory():
        part_a()
    part_b(args)


if __name__ == "__main__":
    main()
