"""Issue 40: the host tier's cache behaviour (hit rates, fills, which tables hold rows) on a scaled-down model, on
any backend (the XLA path: a CPU will do). Speed is not measured here; `host_cache` does that on a GPU.

The benchmark model's shape (`host_cache`: tables of Zipf ids, a prefetch of the next batch inside every training
step) at a size a CPU runs in seconds: `--tables` tables of `--rows` x 16, B `--batch`, `--bag` ids a bag,
`--sets` batches cycled over `--steps` steps (as many sets as steps: a new batch every step). Reports, after
`--warmup` steps (default `--sets`), the mean of the cache's
per-prefetch counts (`emb.cache_stats`), the lookup hit rate, and each table's cached rows at the end.

    python -m benchmarks cache_hits --alphas 1.05 1.2 --load-factors 0.2 0.05 --label after
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common


def run(args, alpha: float, lf: float, age: int | None) -> dict:
    import tbe_jax
    from tbe_jax import testing

    t, r = args.tables, args.rows
    specs = [tbe_jax.TableSpec(r, 16, location="host_cached") for _ in range(t)]
    lookups = t * args.batch * args.bag
    cap = max(1, int(args.fill_fraction * lookups)) if args.fill_fraction else None
    kw = {} if age is None else {"cache_admit_age": age}
    emb = tbe_jax.TableBatchedEmbedding(specs, cache_load_factor=lf, cache_max_fills=cap, impl="xla", **kw)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)
    rng = np.random.default_rng(0)
    perms = [np.random.default_rng(1000 + k).permutation(r) for k in range(t)]
    sets = []
    for _ in range(args.sets):
        idx, off, _ = testing.make_batch(rng, [r] * t, [args.batch] * t, [args.bag] * t, alpha=alpha,
                                         weighted=False, perms=perms)
        sets.append((jnp.asarray(idx), jnp.asarray(off)))
    g = jnp.ones((args.batch, t * 16), jnp.float32)

    @jax.jit
    def step(p, s, i, o, ni, no):
        p, s = emb.prefetch(p, ni, no, opt_state=s)
        res = tbe_jax.train_step(lambda _, out: jnp.sum(out * g), None, tbe_jax.SparseLookup(emb, opt, p, s, i, o))
        return res.params, res.opt_state

    params, state = emb.prefetch(params, *sets[0], opt_state=state)
    stats = []
    for k in range(args.steps):
        params, state = step(params, state, *sets[k % len(sets)], *sets[(k + 1) % len(sets)])
        stats.append([int(v) for v in emb.cache_stats(params).values()])
    names = list(emb.cache_stats(params))
    warm = args.warmup if args.warmup is not None else args.sets
    mean = dict(zip(names, np.asarray(stats[warm:], np.float64).mean(axis=0).round(1).tolist()))
    cached = np.asarray(params["cache"]["slot_of_row"]) >= 0
    return {"alpha": alpha, "load_factor": lf, "admit_age": emb.cache_admit_age,
            "fill_cap": cap or max(1024, lookups // 16), **mean,
            "lookup_hit_rate": mean["lookup_hits"] / max(mean["lookups"], 1),
            "cached_rows_per_table": [int(cached[k * r:(k + 1) * r].sum()) for k in range(t)]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks cache_hits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--bag", type=int, default=20)
    ap.add_argument("--sets", type=int, default=12)
    ap.add_argument("--steps", type=int, default=36)
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the means (default --sets)")
    ap.add_argument("--alphas", type=float, nargs="*", default=[1.05, 1.2])
    ap.add_argument("--load-factors", type=float, nargs="*", default=[0.2, 0.05])
    ap.add_argument("--fill-fraction", type=float, default=0.0,
                    help="cache_max_fills as a share of a step's lookups (default: the library's, 1/16)")
    ap.add_argument("--admit-ages", type=int, nargs="*", default=None,
                    help="cache_admit_age values to compare (default: the library's)")
    ap.add_argument("--label", default="", help="a word for the run (e.g. before / after a change)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cases = []
    for alpha, lf, age in itertools.product(args.alphas, args.load_factors, args.admit_ages or [None]):
        c = run(args, alpha, lf, age)
        cases.append(c)
        print(f"alpha {alpha} lf {lf} admit age {c['admit_age']}: lookup hit rate {c['lookup_hit_rate']:.3f}, "
              f"fills {c['fills']:.0f} (cap {c['fill_cap']}), write-backs {c['writebacks']:.0f}; cached rows per "
              f"table {c['cached_rows_per_table']}", flush=True)
    print("saved", common.save("cache-hits" + (f"-{args.label}" if args.label else ""),
                               {"meta": common.meta(), "config": vars(args), "cases": cases}, args.out))


if __name__ == "__main__":
    main()
