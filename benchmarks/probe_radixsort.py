"""Probe: the Pallas LSD radix sort (`kernels.radixsort`) against XLA's sort (CUB on the GPU) and the counting-rank
sort, on (key, payload, payload) arrays as the backward sorts them: device time per call (profiler), host time of
one jitted call (timed call by call, unblocked), and that each gives XLA's arrays.

  python -m benchmarks.probe_radixsort --out benchmarks/results/radixsort-....json
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.devtime import device_ms, host_us
from tbe_jax.kernels.radixsort import radix_sort
from tbe_jax.kernels.ranksort import rank_sort


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--sizes", default="24576,49152,98304,196608,393216,786432,1572864")
    ap.add_argument("--bits", default="14,20,25,28", help="keys drawn in [0, 2**bits)")
    ap.add_argument("--variants", default="4:256,5:256,6:256,4:512,5:128",
                    help="radix_bits:block of the radix sort")
    ap.add_argument("--zipf", action="store_true", help="also keys with a hot tail (half the keys in 100 values)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    xla = jax.jit(lambda k, a, b: jax.lax.sort((k, a, b), num_keys=1, is_stable=True))
    for n in map(int, args.sizes.split(",")):
        for bits in map(int, args.bits.split(",")):
            for hot in ((False, True) if args.zipf else (False,)):
                k = rng.integers(0, 2**bits, n).astype(np.int32)
                if hot:
                    k[: n // 2] = rng.integers(0, 100, n // 2)
                    rng.shuffle(k)
                k = jnp.asarray(k)
                a = jnp.arange(n, dtype=jnp.int32)
                b = jnp.asarray(rng.standard_normal(n).astype(np.float32))
                ref = xla(k, a, b)
                row = {"n": n, "key_bits": bits, "hot": hot,
                       "xla_ms": round(device_ms(lambda i: xla(k, a, b), 20)[0], 4),
                       "xla_host_us": round(host_us(lambda i: xla(k, a, b), 20), 1)}
                fns = {}
                for v in args.variants.split(","):
                    rb, blk = map(int, v.split(":"))
                    fns[f"radix{rb}_b{blk}"] = jax.jit(
                        lambda k, a, b, rb=rb, blk=blk: radix_sort(k, a, b, key_bits=bits, radix_bits=rb, block=blk))
                if n <= 65536:
                    fns["rank"] = jax.jit(lambda k, a, b: rank_sort(k, a, b))
                for name, f in fns.items():
                    got = f(k, a, b)
                    row[f"{name}_ok"] = all(bool((x == y).all()) for x, y in zip(got, ref))
                    row[f"{name}_ms"] = round(device_ms(lambda i, f=f: f(k, a, b), 20)[0], 4)
                    row[f"{name}_host_us"] = round(host_us(lambda i, f=f: f(k, a, b), 20), 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
                               "device": jax.devices()[0].device_kind, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
