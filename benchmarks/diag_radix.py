"""Diagnosis (compiled, on the GPU): which primitive of the radix sort's one-count-launch form goes wrong.

  python -m benchmarks.diag_radix
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import pallas_call, pl, plgpu
from tbe_jax.kernels import radixsort as rs


def _atomic_vec(x_ref, o_ref, *, block, m):
    del x_ref
    idx = jnp.arange(block, dtype=jnp.int32) % m
    plgpu.atomic_add(o_ref, idx, jnp.ones((block,), jnp.int32))


def _atomic_at(x_ref, o_ref, *, block, m):
    del x_ref
    idx = jnp.arange(block, dtype=jnp.int32) % m
    plgpu.atomic_add(o_ref, (idx,), jnp.ones((block,), jnp.int32))


def _gather2d(x_ref, o_ref, *, r, nb, nbp):
    a = jnp.arange(r, dtype=jnp.int32)
    b = jnp.arange(nbp, dtype=jnp.int32)
    c = plgpu.load(x_ref.at[a[:, None] * nb + b[None, :]], mask=(b < nb)[None, :], other=0)
    tot = jnp.sum(c, axis=1)
    plgpu.store(o_ref.at[a], jnp.cumsum(tot) - tot)


def main():
    out = {}
    for name, k in (("atomic_vec", _atomic_vec), ("atomic_tuple", _atomic_at)):
        try:
            f = jax.jit(lambda z, k=k: pallas_call(functools.partial(k, block=256, m=7),
                                                   out_shape=jax.ShapeDtypeStruct((8,), jnp.int32), grid=(4,),
                                                   input_output_aliases={0: 0})(z))
            got = np.asarray(f(jnp.zeros((8,), jnp.int32)))
            want = np.bincount(np.arange(256) % 7, minlength=8) * 4
            out[name] = {"ok": bool((got == want).all()), "got": got.tolist(), "want": want.tolist()}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": repr(e)[:400]}
    r, nb, nbp = 16, 37, 64
    x = jnp.arange(r * nb, dtype=jnp.int32) % 5
    try:
        got = np.asarray(jax.jit(lambda x: pallas_call(functools.partial(_gather2d, r=r, nb=nb, nbp=nbp),
                                                       out_shape=jax.ShapeDtypeStruct((r,), jnp.int32),
                                                       grid=(1,))(x))(x))
        tot = np.asarray(x).reshape(r, nb).sum(1)
        want = np.cumsum(tot) - tot
        out["gather2d"] = {"ok": bool((got == want).all()), "got": got.tolist(), "want": want.tolist()}
    except Exception as e:  # noqa: BLE001
        out["gather2d"] = {"error": repr(e)[:400]}
    print(json.dumps(out, indent=1), flush=True)
    rng = np.random.default_rng(0)
    for n in (100, 3000, 50000, 300000):
        for bits in (8, 14, 24):
            for scan_max in (0,):
                for rb in (4, 8):
                    k = jnp.asarray(rng.integers(0, 2**bits, n).astype(np.int32))
                    a = jnp.arange(n, dtype=jnp.int32)
                    ref = jax.lax.sort((k, a), num_keys=1, is_stable=True)
                    try:
                        got = jax.jit(lambda k, a: rs.radix_sort(k, a, key_bits=bits, radix_bits=rb))(k, a)
                        ok = all(bool((x == y).all()) for x, y in zip(got, ref))
                        out[f"sort n{n} b{bits} scan{scan_max} r{rb}"] = ok
                        print(f"sort n{n} b{bits} scan{scan_max} r{rb}", ok, flush=True)
                    except Exception as e:  # noqa: BLE001
                        out[f"sort n{n} b{bits} scan{scan_max} r{rb}"] = repr(e)[:300]
                        print(json.dumps(out, indent=1), flush=True)
                        return
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
