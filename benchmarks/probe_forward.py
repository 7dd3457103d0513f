"""Probe: forward kernel configs (`tbe_jax.ForwardConfig`) on chosen sweep shards, device time per call.

  python -m benchmarks probe_forward --shards s212,s161,fp32 --out results/probe-forward-....json
Shards are the sweep's (`benchmarks.sweep`, same seed) or its named ones; each variant is a ForwardConfig
override given as JSON (`--variants '{"fp32_accumulation": "twosum"}' ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import jax
import jax.numpy as jnp

import tbe_jax
from benchmarks import sweep
from benchmarks.common import device_ms

DEFAULT_VARIANTS = ['{}', '{"fp32_accumulation": "twosum"}', '{"fp32_accumulation": "fp64"}',
                    '{"tile_elems": 512}', '{"unroll": 8}', '{"num_warps": 2, "tile_elems": 512}',
                    '{"fp32_accumulation": "fp64", "unroll": 8}', '{"fp32_accumulation": "twosum", "unroll": 8}']


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", default="s212,s161,s207,s024,s038,s051,s075,s007,fp32")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--shapes", type=int, default=240)
    ap.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    ap.add_argument("--layouts", default="as-drawn",
                    help="comma list: as-drawn; sorted (tables by mean bag length, longest first); "
                         "hinted (each table's bag_size_hint = its mean bag length: static paths, no 'auto')")
    ap.add_argument("--top", type=int, default=0, help="also each variant's N largest kernels (device ms a call)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    pool = {s.name: s for s in sweep.draw_shards(args.shapes, args.seed)}
    pool.update(sweep.named_shards())
    rows = []
    todo = [(name, lay) for name in args.shards.split(",") for lay in args.layouts.split(",")]
    for name, lay in todo:
        s = pool[name]
        if lay == "sorted":
            order = sorted(range(s.T), key=lambda t: -s.bags[t])
            s = dataclasses.replace(s, rows=tuple(s.rows[t] for t in order), dims=tuple(s.dims[t] for t in order),
                                    bags=tuple(s.bags[t] for t in order))
        hints = [max(1, round(b)) if lay == "hinted" else None for b in s.bags]
        i, o, w, _ = sweep.batch(s, 0)
        i, o = jnp.asarray(i), jnp.asarray(o)
        w = None if w is None else jnp.asarray(w)
        row = {"shard": name, "layout": lay, **s.params()}
        params = None
        for v in args.variants:
            cfg = tbe_jax.ForwardConfig(**json.loads(v))
            emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d, bag_size_hint=h)
                                                 for e, d, h in zip(s.rows, s.dims, hints)],
                                                weights_dtype=jnp.dtype(s.weights_dtype), kernel_config=cfg)
            if params is None:
                params = emb.init(jax.random.key(0))
            f = jax.jit(lambda p, i, o, w, emb=emb: emb(p, i, o, w))
            jax.block_until_ready(f(params, i, o, w))
            ms, names = device_ms(lambda k: f(params, i, o, w), 20, top=args.top)
            row[v] = round(ms, 4)
            if args.top:
                row[v + " kernels"] = {k: round(t, 4) for k, t in names.items()}
                print(v, row[v + " kernels"], flush=True)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ["shard", "layout", "T", "B", "lookups"] + args.variants}), flush=True)
        del params
        if args.out:  # after every row: a run cut short keeps what it measured
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
                       "device": jax.devices()[0].device_kind, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
