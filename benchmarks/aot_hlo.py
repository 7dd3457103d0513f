"""What a jitted call launches on an H100 / H200, read here without a GPU (XLA's deviceless GPU compile).

JAX compiles for a CUDA target described by a `gpu_device_info` proto when the CUDA PJRT plugin is importable,
even where no GPU is (jax 0.10.2 with `jax-cuda13-plugin` / `jax-cuda13-pjrt` 0.10.2, `--no-deps`). The
optimized program's entry computation then lists every launch of a call in order: our Pallas kernels (Triton
custom calls, by kernel name), XLA's fusions, copies, sorts and collectives. This tool prints them, each XLA op
with the bytes its operands and result span and that many bytes' time at the card's bandwidth (a floor, loose
for fusions that read part of an operand), for the sweep's forward and `apply_gradients` (`benchmarks.sweep`,
same seed), those through `tbe_jax.shard` on several GPUs of one host (`--devices`), or the DCNv2 step
(`examples.dlrm`, MLPerf sizes).

Not ground truth: without a device XLA cannot autotune, so gemms become Triton gemm fusions (cuBLAS on a GPU),
and its sorts fall back from CUB to XLA's own sort kernel (a GPU compile uses CUB). Launch counts of our
kernels and XLA's elementwise fusions match what runs (checked against session 55's profile of the auto
histogram forward: 2 `loop_multiply_fusion`s there and here). Use it to count and compare, not to time.

    pip install --no-deps --target /tmp/cudaplug jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2
    PYTHONPATH=/tmp/cudaplug:. python -m benchmarks aot_hlo --shards s118,dlrmv2 --what fwd,bwd
    PYTHONPATH=/tmp/cudaplug:. python -m benchmarks aot_hlo --dcnv2 16384 --emb-dtype float16
    PYTHONPATH=/tmp/cudaplug:. python -m benchmarks aot_hlo --shards base --devices 4 --plan '"row"'
"""

from __future__ import annotations

import argparse
import json
import os
import re

# Set before jax starts: no GPU is looked for, the plugin loads without its CUDA version checks.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

TARGETS = {  # (SMs, HBM bytes/s, memory bytes, name); sm_90, 50 MiB L2, 1.98 GHz on both
    "h100": (132, 3.35e12, 84_929_347_584, "NVIDIA H100 80GB HBM3"),
    "h200": (132, 4.8e12, 150_754_820_096, "NVIDIA H200"),
}
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LAUNCH_OPS = ("fusion", "custom-call", "sort", "copy", "gather", "scatter", "while", "conditional", "all-to-all-start",
               "all-gather-start", "all-reduce-start", "reduce-scatter-start", "collective-permute-start")


def target_config(name: str) -> str:
    sms, bw, mem, desc = TARGETS[name]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {sms} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(bw)} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {mem}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{desc}"
"""


def mesh(target: str, devices: int = 1):
    """A mesh of `devices` GPUs of one host (axis "data") on the deviceless CUDA topology."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                        topology=f"1x1x{devices}")
    return topologies.make_mesh(topo, (devices,), ("data",))


def sharding(target: str):
    """A one-device sharding on the deviceless CUDA topology: give it to every abstract argument."""
    import jax

    return jax.sharding.NamedSharding(mesh(target), jax.sharding.PartitionSpec())


def as_on_gpu(target: str) -> None:
    """Make this process trace what a GPU of `target` would: the kernel path (`uses_kernel`, which asks the
    backend, here the CPU's) and the target's SM count where launch sizes derive from it (the CPU counts 2)."""
    import tbe_jax
    from tbe_jax.kernels import backward_config, forward_config, histogram

    tbe_jax.TableBatchedEmbedding.uses_kernel = lambda self: True
    sms = TARGETS[target][0]
    for mod in (backward_config, forward_config, histogram):
        mod.sm_count = lambda: sms


def abstract(tree, shard):
    import jax

    return jax.tree.map(lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard),
                        tree, is_leaf=lambda x: x is None)


def _bytes(shape_text: str) -> int:
    total = 0
    for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
        if dt in _DTYPE_BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _DTYPE_BYTES[dt]
    return total


def launches(hlo_text: str, bandwidth: float) -> list[dict]:
    """The entry computation's launches in order: op, name (a kernel's name for Triton calls), result shape,
    bytes of operands + result, and those bytes' time at `bandwidth` (us)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    shapes, out = {}, []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) (\S+)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op not in _LAUNCH_OPS:
            continue
        args = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        kernel = re.search(r'name="([^"]+)"', line) if op == "custom-call" else None
        # (a kernel's operands say nothing of what it reads: tables it updates in place, rows it gathers)
        nbytes = 0 if kernel else _bytes(shape) + sum(_bytes(shapes.get(a, "")) for a in dict.fromkeys(args))
        out.append({"op": op, "name": kernel.group(1) if kernel else name, "shape": shape[:60],
                    "bytes": nbytes, "floor_us": round(nbytes / bandwidth * 1e6, 2)})
    return out


def _sweep_calls(names, seed: int, shapes: int, what, shard):
    import jax
    import jax.numpy as jnp

    import tbe_jax
    from benchmarks import sweep

    pool = {s.name: s for s in sweep.draw_shards(shapes, seed)}
    pool.update(sweep.named_shards())
    for name in names:
        s = pool[name]
        hints = [max(1, round(b)) if s.hinted else None for b in s.bags]
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d, bag_size_hint=h)
                                             for e, d, h in zip(s.rows, s.dims, hints)],
                                            weights_dtype=jnp.dtype(s.weights_dtype), output_dtype=jnp.float32)
        opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=1e-8)
        i, o, w, g = abstract(sweep.batch(s, 0), shard)

        def init(key, emb=emb):
            params = emb.init(key)
            return params, emb.init_opt_state(params, opt)

        params, state = abstract(jax.eval_shape(init, jax.random.key(0)), shard)
        if "fwd" in what:
            yield name, "fwd", jax.jit(lambda p, i, o, w, emb=emb: emb(p, i, o, w)).lower(params, i, o, w)
        if "bwd" in what:
            step = lambda c, i, o, w, g, emb=emb: emb.apply_gradients(c[0], c[1], opt, i, o, g, w)  # noqa: E731
            yield name, "bwd", jax.jit(step, donate_argnums=(0,)).lower((params, state), i, o, w, g)


def _sharded_calls(names, seed: int, shapes: int, what, target: str, devices: int, plan):
    """The sweep shards' lookup and `apply_gradients` through `tbe_jax.shard` over `devices` GPUs (`plan`: None
    for the planner, else `shard`'s plan argument), each device's batch the shard's B / devices samples."""
    import jax
    import jax.numpy as jnp

    import tbe_jax
    from benchmarks import sweep

    m = mesh(target, devices)
    rep = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("data"))
    pool = {s.name: s for s in sweep.draw_shards(shapes, seed)}
    pool.update(sweep.named_shards())
    # The sharded embedding's buffers and states are `[devices * rows, ...]`, split over the axis (`eval_shape`
    # gives no sharding); the step count is replicated.
    on_mesh = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split if x.ndim else rep)  # noqa: E731
    for name in names:
        s = pool[name]
        emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(e, d) for e, d in zip(s.rows, s.dims)],
                                            weights_dtype=jnp.dtype(s.weights_dtype), output_dtype=jnp.float32)
        sharded = tbe_jax.shard(emb, m, "data", plan)
        opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=1e-8)
        params = jax.eval_shape(sharded.init, jax.random.key(0))
        state = jax.eval_shape(lambda p: sharded.init_opt_state(p, opt), params)
        params, state = jax.tree.map(on_mesh, (params, state))
        b = s.B // devices
        n_ids = -(-sweep.batch(s, 0)[0].shape[0] // devices)
        i = jax.ShapeDtypeStruct((devices, n_ids), jnp.int32, sharding=split)
        o = jax.ShapeDtypeStruct((devices, s.T * b + 1), jnp.int32, sharding=split)
        g = jax.ShapeDtypeStruct((devices * b, sum(s.dims)), jnp.float32, sharding=split)
        tag = f"{name}-x{devices}"
        if "fwd" in what:
            yield tag, "fwd", jax.jit(lambda p, i, o, sh=sharded: sh(p, i, o)).lower(params, i, o)
        if "bwd" in what:
            step = lambda p, st, i, o, g, sh=sharded: sh.apply_gradients(p, st, opt, i, o, g)  # noqa: E731
            yield tag, "bwd", jax.jit(step, donate_argnums=(0, 1)).lower(params, state, i, o, g)


def _dcnv2_call(batch_size: int, emb_dtype: str, shard):
    import jax
    import jax.numpy as jnp

    from examples.dlrm import train
    from examples.dlrm.model import DLRM

    data_cfg, config = train.configs("mlperf", "dcnv2", emb_dtype=emb_dtype)
    model = DLRM(config)
    sizes = train.DCNV2_SIZES["mlperf"]
    built = train.build(model, sizes.lr, sizes.emb_lr, None, "rowwise_adagrad", dense_opt="adagrad")
    dense, dense_opt, emb_p, emb_s = abstract(jax.eval_shape(built.init, jax.random.key(0)), shard)
    b, n = batch_size, batch_size * sum(data_cfg.bag_sizes)
    batch = abstract({"dense": jnp.zeros((b, 13), jnp.float32), "indices": jnp.zeros((n,), jnp.int32),
                      "offsets": jnp.zeros((len(config.table_rows) * b + 1,), jnp.int32),
                      "labels": jnp.zeros((b,), jnp.float32)}, shard)

    def step(d, e, es, o, bt):
        return built.train_step(d, e, es, o, built.emb_opt, bt)

    yield f"dcnv2-b{b}-{emb_dtype}", "step", jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(
        dense, emb_p, emb_s, dense_opt, batch)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="h200")
    ap.add_argument("--shards", default="", help="sweep shards (seed --seed) or named ones, comma-separated")
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--shapes", type=int, default=240)
    ap.add_argument("--what", default="fwd,bwd")
    ap.add_argument("--dcnv2", type=int, default=0, help="the DCNv2 step at this batch size instead")
    ap.add_argument("--emb-dtype", default="float32")
    ap.add_argument("--devices", type=int, default=1, help="> 1: the shards through tbe_jax.shard on that many GPUs")
    ap.add_argument("--plan", default="", help="with --devices: shard's plan as JSON ({table index: strategy} or "
                                               "one strategy), default the planner")
    ap.add_argument("--top", type=int, default=0, help="print only the N launches of largest byte floor")
    ap.add_argument("--hlo-dir", default="", help="also write each optimized program's text here")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    shard = sharding(args.target)
    as_on_gpu(args.target)
    bw = TARGETS[args.target][1]
    if args.dcnv2:
        calls = _dcnv2_call(args.dcnv2, args.emb_dtype, shard)
    elif args.devices > 1:
        plan = json.loads(args.plan) if args.plan else None
        plan = {int(k): v for k, v in plan.items()} if isinstance(plan, dict) else plan
        calls = _sharded_calls(args.shards.split(","), args.seed, args.shapes, args.what.split(","), args.target,
                               args.devices, plan)
    else:
        calls = _sweep_calls(args.shards.split(","), args.seed, args.shapes, args.what.split(","), shard)
    rows = []
    for name, what, lowered in calls:
        text = lowered.compile().as_text()
        if args.hlo_dir:
            with open(os.path.join(args.hlo_dir, f"{name}-{what}.hlo.txt"), "w") as fh:
                fh.write(text)
        ls = launches(text, bw)
        ours = [x for x in ls if x["op"] == "custom-call"]
        coll = [x["op"][: -len("-start")] for x in ls if x["op"].endswith("-start")]
        row = {"call": name, "what": what, "launches": len(ls), "kernels": len(ours),
               "xla": len(ls) - len(ours), "collectives": sorted(coll),
               "floor_us": round(sum(x["floor_us"] for x in ls), 1), "list": ls}
        rows.append(row)
        print(f"== {name} {what}: {row['launches']} launches ({row['kernels']} ours, {row['xla']} XLA"
              f"{', collectives ' + ' '.join(coll) if coll else ''}), XLA ops' byte floor {row['floor_us']} us at "
              f"{bw / 1e12:.2f} TB/s", flush=True)
        shown = sorted(ls, key=lambda x: -x["bytes"])[: args.top] if args.top else ls
        for x in shown:
            print(f"  {x['op']:12s} {x['name'][:44]:44s} {x['shape']:40s} {x['floor_us']:9.2f} us")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"target": args.target, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
