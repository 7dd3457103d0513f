"""Where a TT training step's time goes: each stage of `tbe_jax.train_step` on a TT table timed alone (GPU).

Stages (workload a by default, one table group): the plan (sort, unique, groups, items), the forward
kernels, and the Pallas backward's pieces: per-lookup sources, the per-row gradient sum (`d_rows`),
the per-group kernel, per core the member sort (`_runs`) and the per-slice sums, and the dense optimizer
update. Each is jitted on its own inputs (computed once), timed as bench_forward (enqueue many, block
once, median). The sum of the parts can exceed the step: XLA fuses and overlaps inside one program.

  python -m benchmarks profile_tt --batches 32768 --out benchmarks/results/profile-tt-<stamp>.json
  python -m benchmarks profile_tt --workload meta-240 --batches 4096
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import tbe_jax
import tt_jax
from tt_jax import optim, prefix, workloads
from tt_jax.backward import feature_col0
from tt_jax.kernels import backward as kb
from tt_jax.kernels import forward as kf
from tt_jax.kernels import groups, segsum

from benchmarks.common import time_calls
from benchmarks.bench_tt import config_fields, numpy_cores


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks profile_tt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="a", choices=sorted(workloads.PRESETS))
    ap.add_argument("--batches", default="32768")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=[], help="TTKernelConfig variants as JSON objects (one profile each)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    interpret = not on_gpu
    wl = workloads.PRESETS[args.workload]()
    specs = list(wl.specs)
    ftm = tuple(range(len(specs)))
    all_res = []
    cfgs = [("default", kf.TTKernelConfig())]
    for c in args.configs:
        cfgs.append((c, kf.TTKernelConfig(**config_fields(c))))
    all_cores = numpy_cores(specs)
    for batch in [int(b) for b in args.batches.split(",")]:
        rng = np.random.default_rng(batch)
        perms = [np.random.default_rng(1).permutation(s.num_embeddings) for s in specs] if wl.exact_zipf else None
        i_np, o_np = wl.make_batch(rng, batch, perms=perms)
        idx, off = jnp.asarray(i_np), jnp.asarray(o_np)
        total = sum(s.embedding_dim for s in specs)
        g_out = jnp.asarray(np.random.default_rng(2).normal(size=(batch, total)), jnp.float32)
        for cname, cfg in cfgs:
            res = {"B": batch, "config": cname}

            def t(name, f, *a):
                res[name] = time_calls(jax.jit(f), [a], args.iters, args.reps)

            (layout, feats), = prefix.stack_tables(specs, ftm)
            build = lambda i, o: prefix.build_flow(layout, i, o, features=feats, feature_table_map=ftm,  # noqa: E731
                                                   batch=batch, chunk=cfg.chunk, prefix_reuse=cfg.prefix_reuse)
            t("plan", build, idx, off)
            plan = jax.jit(build)(idx, off)
            emb = tt_jax.TTEmbeddingBag(specs, impl="pallas", interpret=interpret, config=cfg)
            t("forward_total", lambda c, i, o: emb({"cores": c}, i, o), all_cores, idx, off)
            stacked = [c.reshape(-1) for c in all_cores[0]]  # the one group's buffers, as the params hold them
            t("fwd_rows_kernel", lambda s, p: kf.tt_rows(s, p, layout, config=cfg.forward_config,
                                                         interpret=interpret), stacked, plan)
            bcfg = cfg.backward_config
            col0 = feature_col0(specs, ftm)
            t("bwd_total_dense_grads", lambda c, p, o, g: kb.dense_core_grads(
                c, specs, ftm, [p], o, None, g, batch=batch, pooling="sum", want_psw=False, config=cfg,
                interpret=interpret), all_cores, plan, off, g_out)
            srcs = lambda p, o: kb.lookup_sources(p, o, None, batch=batch, col0=col0, total=total,  # noqa: E731
                                                   pooling="sum")
            t("bwd_lookup_sources", srcs, plan, off)
            src, _, _ = jax.jit(srcs)(plan, off)
            cap = plan.row_suffix.shape[0]
            dim = layout.dim

            def drows(p, s, g):
                return segsum.segment_sum("lookups", p.sorted_row, p.row_start, data={"src": s, "g": g.reshape(-1)},
                                          out_slots=cap, e_a=1, e_b=dim, tile=bcfg.lookup_tile, config=bcfg,
                                          interpret=interpret)
            t("bwd_d_rows", drows, plan, src, g_out)
            d_rows = jax.jit(drows)(plan, src, g_out)
            n_groups = max(1, min(cap, layout.prefix_base[-1]))
            gp = lambda s, p, d: groups.group_pass(layout, s, p, d, n_groups, p.group_meta,  # noqa: E731
                                                   p.num_groups, None, config=bcfg, interpret=interpret)
            t("bwd_group_pass", gp, stacked, plan, d_rows)
            nc = layout.num_cores
            p_stacked = [layout.core_base[k][-1] for k in range(nc)]
            meta = plan.group_meta[: n_groups * (nc + 1)].reshape(n_groups, nc + 1)
            live_g = jnp.arange(n_groups, dtype=jnp.int32) < plan.num_groups
            for k in range(nc - 1):
                t(f"bwd_sort_core{k}",
                  lambda m, lv, k=k: segsum.sorted_runs(m[:, 1 + k], lv, min(n_groups, p_stacked[k])), meta, live_g)
            live_u = jnp.arange(cap, dtype=jnp.int32) < plan.num_rows
            bufs = jax.jit(gp)(stacked, plan, d_rows)
            t(f"bwd_sort_core{nc - 1}", lambda rs, lv: segsum.sorted_runs(rs, lv, min(cap, p_stacked[-1])),
              bufs["row_slice"], live_u)
            grads, _ = jax.jit(lambda c, p, o, g: kb.dense_core_grads(
                c, specs, ftm, [p], o, None, g, batch=batch, pooling="sum", want_psw=False, config=cfg,
                interpret=interpret))(all_cores, plan, off, g_out)
            opt = optim.Adagrad(0.01)
            mom = [jnp.zeros(c.shape, jnp.float32) for c in all_cores[0]]
            t("optimizer_dense_adagrad",
              lambda cs, ms, gs, opt: [optim.update_dense(opt.rule(), opt.hyperparameters(jnp.int32(0)), c, m, g)
                                       for c, m, g in zip(cs, ms, gs)],
              list(all_cores[0]), mom, list(grads[0]), opt)

            def step(c, opt, i, o):
                params = {"cores": c}
                res = tbe_jax.train_step(lambda _, out: 0.5 * jnp.sum(out**2), None, tbe_jax.SparseLookup(
                    emb, opt, params, emb.init_opt_state(params, opt), i, o))
                return res.params, res.opt_state
            t("train_step_adagrad", step, all_cores, opt, idx, off)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
            all_res.append(res)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                       "workload": args.workload, "results": all_res}, fh, indent=1)


if __name__ == "__main__":
    main()
