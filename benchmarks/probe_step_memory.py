"""Memory of a compiled training step at MLPerf DLRMv2's table sizes, without allocating the tables.

    python -m benchmarks probe_step_memory [--batch-size 65536] [--emb-dtype float32] [--max-rows N]

Compiles (abstract arguments, `jax.ShapeDtypeStruct`) (1) `tbe_jax.train_step` over the 26 tables alone with a
trivial loss and (2) the demo's DCNv2 `train_step`, both donating the tables and their state, and prints XLA's
memory analysis (arguments, outputs, aliased, temporaries) and every HLO instruction other than the kernels'
custom calls that makes a table-shaped value (a copy of a table). `--max-rows` caps each table's rows (to see
whether something depends on the size).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp


def _report(name: str, compiled, shapes: list[str]) -> None:
    ma = compiled.memory_analysis()
    gib = {k: round(getattr(ma, k) / 2**30, 3) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                          "alias_size_in_bytes", "temp_size_in_bytes")}
    print(f"{name}: {gib}", flush=True)
    offenders = []
    for line in compiled.as_text().splitlines():
        line = line.strip()
        if " = " not in line or not any(s in line.split(" = ")[1][:80] for s in shapes):
            continue
        if any(f" {op}(" in line for op in ("parameter", "get-tuple-element", "tuple", "bitcast", "custom-call")):
            continue
        offenders.append(line[:240])
    print(f"  {len(offenders)} table-shaped instructions besides the kernels:")
    for line in offenders[:25]:
        print("   ", line)


def main(argv=None) -> None:
    from examples.dlrm import data as data_lib
    from examples.dlrm import train
    from examples.dlrm.model import DLRM, DLRMConfig

    import tbe_jax

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--emb-dtype", default="float32")
    ap.add_argument("--max-rows", type=int, default=0)
    ap.add_argument("--skip-lib", action="store_true")
    args = ap.parse_args(argv)

    data_cfg = data_lib.DataConfig.preset("mlperf", fixed_bags=True)
    rows = data_cfg.table_rows if not args.max_rows else tuple(min(r, args.max_rows) for r in data_cfg.table_rows)
    config = DLRMConfig.preset("mlperf", rows, model="dcnv2", weights_dtype=args.emb_dtype)
    model = DLRM(config)
    built = train.build(model, train.DCNV2_SIZES["mlperf"].lr, train.DCNV2_SIZES["mlperf"].emb_lr, None,
                        "rowwise_adagrad", dense_opt="adagrad")
    key = jax.random.key(0)
    dense, dense_opt, emb_p, emb_s = jax.eval_shape(built.init, key)
    emb = model.emb_unsharded
    shapes = [f"[{sum(rows)},", f"[{sum(rows)}]"]
    b = args.batch_size
    n = b * sum(data_cfg.bag_sizes)
    batch = {"dense": jax.ShapeDtypeStruct((b, 13), jnp.float32),
             "indices": jax.ShapeDtypeStruct((n,), jnp.int32),
             "offsets": jax.ShapeDtypeStruct((len(rows) * b + 1,), jnp.int32),
             "labels": jax.ShapeDtypeStruct((b,), jnp.float32)}
    print(f"tables {sum(rows):,} rows, {args.emb_dtype}; batch {b}, {n:,} ids; params "
          f"{ {k: v.shape for k, v in emb_p.items()} }", flush=True)

    if not args.skip_lib:
        def lib_step(p, s, opt, idx, off):
            res = tbe_jax.train_step(lambda _, out: jnp.sum(out.astype(jnp.float32) ** 2), None,
                                     tbe_jax.SparseLookup(emb, opt, p, s, idx, off))
            return res.params, res.opt_state

        c = jax.jit(lib_step, donate_argnums=(0, 1)).lower(emb_p, emb_s, built.emb_opt, batch["indices"],
                                                            batch["offsets"]).compile()
        _report("tbe_jax.train_step alone", c, shapes)
    c = built.train_step.lower(dense, emb_p, emb_s, dense_opt, built.emb_opt, batch).compile()
    _report("demo dcnv2 train_step", c, shapes)


if __name__ == "__main__":
    main()
