"""`python -m benchmarks walk_model`: what `ForwardConfig.walk_max_bags` should save on the sweep's shards, from a
model of the forward's loop (no GPU, no timing).

Per feature of each drawn shard (bag lengths exactly as `sweep.batch` draws them), the float forward's programs of
`G` consecutive bags (`ForwardConfig.bags_per_program`) run `ceil(max(length) / unroll)` iterations by default; with
the walk, a program of `2 <= G <= N` bags runs `sum(max(ceil(length / (G * unroll)), 1)) + ceil(bags / 2)` when that
is fewer (the kernel's rule, `kernels.forward._pool_branch`), each of its iterations issuing ~1.07x the default's
instructions (sm_90a SASS, session 43). The shard's predicted speedup is its iterations times the tile size (`G *
next_pow2(D)`) summed over programs, default over walk: a latency-bound kernel's time follows its iterations, so
this is a guide to which shards to time, not a time.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

WALK_ITERATION_COST = 1.07  # a walk iteration's instructions over the default's (sm_90a SASS, session 43)


def predict(shard, max_bags: int, config) -> float:
    """Default over walk, in iterations times tile elements, for one shard."""
    unroll = config.unroll
    shape_rng = np.random.default_rng([shard.seed, 0])  # as `sweep.batch`
    default = walked = 0.0
    for l, d in zip(shard.bags, shard.dims):
        if shard.fixed_bags:
            lengths = np.full(shard.B, int(round(l)))
        else:
            lengths = shape_rng.integers(0, int(round(2 * l)) + 1, size=shard.B)
        g = config.bags_per_program(d, shard.B)
        tile = g * (1 << (d - 1).bit_length())
        for p in range(0, shard.B, g):
            lp = lengths[p : p + g]
            lanes = max(-(-int(lp.max()) // unroll), 1)
            walk = int(np.maximum(-(-lp // (g * unroll)), 1).sum()) + (len(lp) + 1) // 2
            chosen = WALK_ITERATION_COST * walk if 2 <= g <= max_bags and walk < lanes else lanes
            default += lanes * tile
            walked += chosen * tile
    return default / walked


def main(argv=None):
    import tbe_jax
    from benchmarks import sweep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=240)
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--max-bags", type=int, default=4, help="ForwardConfig.walk_max_bags")
    ap.add_argument("--named", default="", help="comma-separated named shards to add (sweep.named_shards)")
    ap.add_argument("--show", default="", help="comma-separated shard names to print")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    config = tbe_jax.ForwardConfig()
    pred = {s.name: round(predict(s, args.max_bags, config), 3) for s in sweep.draw_shards(args.shards, args.seed)}
    vals = np.array(list(pred.values()))  # the summary is over the drawn shards only
    named = sweep.named_shards()
    for name in filter(None, args.named.split(",")):
        pred[name] = round(predict(named[name], args.max_bags, config), 3)
    summary = {"shards": len(vals), "seed": args.seed, "walk_max_bags": args.max_bags,
               "median": float(np.median(vals)) if len(vals) else None, "share_gt_1_05": float(np.mean(vals > 1.05)) if len(vals) else None,
               "share_gt_1_10": float(np.mean(vals > 1.10)) if len(vals) else None, "max": float(vals.max()) if len(vals) else None,
               "min": float(vals.min()) if len(vals) else None}
    print(json.dumps(summary))
    for name in filter(None, args.show.split(",")):
        print(name, pred.get(name))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"summary": summary, "predicted_speedup": pred, "model": __doc__}, fh, indent=1)
        print("saved", args.out)


if __name__ == "__main__":
    main()
