"""Probe: the counting-rank sort (`kernels.ranksort`) against XLA's sort of (key, position) on small arrays.

Device time per call (profiler) for N from 1k to 128k and several chunk sizes (1048576: one chunk, no merge pass), keys spread (0..1e6) or crowded (0..100); checks that both
give the same arrays.   python -m benchmarks probe_ranksort --out results/ranksort-....json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_ms
from tbe_jax.kernels.backward_config import BackwardConfig
from tbe_jax.kernels.ranksort import rank_sort


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--sizes", default="1024,4096,8192,16384,24576,32768,49152,65536,98304,131072")
    ap.add_argument("--ranges", default="1000000,100", help="keys drawn in [0, range)")
    ap.add_argument("--chunks", default="1024,2048,4096,1048576")
    ap.add_argument("--wide", default="0", help="rank_sort_wide_block values (0: the serial merge), at each chunk")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    xla = jax.jit(lambda k, p: jax.lax.sort((k, p), num_keys=1, is_stable=True))
    cfg = BackwardConfig()
    blocks = dict(block_i=cfg.rank_sort_block_i, block_j=cfg.rank_sort_block_j, merge_block=cfg.rank_sort_merge_block)
    for n in map(int, args.sizes.split(",")):
        for hi in map(int, args.ranges.split(",")):
            k = jnp.asarray(rng.integers(0, hi, n).astype(np.int32))
            p = jnp.arange(n, dtype=jnp.int32)
            ref = xla(k, p)
            row = {"n": n, "key_range": hi, "xla_ms": round(device_ms(lambda i: xla(k, p), 20)[0], 4)}
            for chunk in args.chunks.split(","):
                chunk = int(chunk)
                if n > 16384 and chunk >= n:
                    continue
                for wide in map(int, args.wide.split(",")):
                    if wide and (chunk >= n or chunk % wide):
                        continue
                    f = jax.jit(lambda k, p, chunk=chunk, wide=wide: rank_sort(k, p, chunk=chunk, wide_block=wide,
                                                                               **blocks))
                    got = f(k, p)
                    tag = f"rank_c{chunk}" + (f"_w{wide}" if wide else "")
                    row[f"{tag}_ok"] = all(bool((a == b).all()) for a, b in zip(got, ref))
                    row[f"{tag}_ms"] = round(device_ms(lambda i: f(k, p), 20)[0], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind, "rows": rows}
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
