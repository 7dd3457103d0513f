"""Registers, spills and SASS size of the Pallas kernels (backward; forward, quantized forward; TT), without a GPU.

Lowers `apply_gradients` (row-wise Adagrad) for CUDA on this machine (`lowering_platforms=("cuda",)`), captures the
Triton IR of every `pallas_call` as Pallas builds it, and compiles each with the `triton` package's compiler for
sm_90a (H100/H200). Prints per kernel: registers per thread, spill stores/loads (bytes), and the SASS instruction
count (from the bundled `cuobjdump`). Registers bound how many programs an SM holds (65,536 per SM); spills turn
register traffic into local-memory traffic. The Triton here is the PyPI one, not the one jaxlib links into XLA, so
counts can differ a little from what runs on the GPU; use it to compare variants, not as ground truth.

  pip install --target /tmp/tsite triton==3.6.0          (not a project dependency; the tool reads PYTHONPATH)
  PYTHONPATH=/tmp/tsite python -m benchmarks kernel_resources --dims "4-128/4" --variants '{"merge_width": 0}' '{}'
  PYTHONPATH=/tmp/tsite python -m benchmarks kernel_resources --quant int8,int4,int2 --presets base
  PYTHONPATH=/tmp/tsite python -m benchmarks kernel_resources --forward --presets fp32 \
      --forward-configs '{}' '{"unroll": 8}'

`loop_sass` is the size of the kernel's largest loop body: the instructions a warp issues per iteration, the
measure to compare for an issue-bound loop (the quantized forward: `--quant`). Registers decide occupancy too: a
one-warp forward program at 64 registers leaves 32 programs an SM, at 72 only 28 (session 44: the walk's branch
cost the fp32 preset 4% that way without ever being taken).

The dims / variants syntax is `python -m benchmarks trace_backward`'s (variants: JSON objects of BackwardConfig
fields).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

import tbe_jax
from benchmarks import common
from benchmarks.trace_backward import variant as backward_variant


def capture_triton_ir(fn, *args) -> list[tuple[str, str, int, int]]:
    """(kernel name, Triton IR text, num_warps, num_stages) of every pallas_call in `fn(*args)` lowered for
    CUDA."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def spy(jaxpr, grid_mapping, *a, **kw):
        res = orig(jaxpr, grid_mapping, *a, **kw)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering's, both set before this call
        warps, stages = caller.get("num_warps", 4), caller.get("num_stages", 1)
        captured.append((jaxpr.debug_info.func_name, res.module.operation.get_asm(enable_debug_info=False),
                         int(warps), int(stages)))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = spy
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    return captured


def compile_report(ir: str, num_warps: int, num_stages: int = 1) -> dict:
    """Compile one Triton IR module for sm_90a: registers, spills, SASS instructions."""
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttir")
        with open(path, "w") as fh:
            fh.write(ir)
        k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                              "num_stages": num_stages})
        out = {}
        ttgir = k.asm.get("ttgir", "")
        out["convert_layout"] = len(re.findall(r"convert_layout", ttgir))
        if os.environ.get("KRES_DUMP"):  # keep the TTGIR of each kernel for reading
            with open(os.path.join(os.environ["KRES_DUMP"], f"{abs(hash(ir))}.ttgir"), "w") as fh:
                fh.write(ttgir)
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as fh:
            fh.write(k.asm["ptx"])
        p = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
        if (m := re.search(r"Used (\d+) registers", p.stderr)):
            out["regs"] = int(m.group(1))
        if (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", p.stderr)):
            out["spill_stores"], out["spill_loads"] = int(m.group(1)), int(m.group(2))
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", os.path.join(d, "k.o")],
                              capture_output=True, text=True).stdout
        out["sass"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
        out["loop_sass"] = loop_instructions(sass)
        out["sass_ldg"] = len(re.findall(r"\bLDG\.", sass))
        out["sass_stg"] = len(re.findall(r"\bSTG\.", sass))
        out["sass_lds_sts"] = len(re.findall(r"\b(?:LDS|STS)\b", sass))
        return out


def loop_instructions(sass: str) -> int:
    """SASS instructions in the kernel's largest loop body (a backward branch's target to the branch): what one
    iteration of the main loop issues per warp (0: no loop)."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    loops = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"\bBRA (0x[0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    return max((sum(lo <= a <= hi for a, _ in ins) for lo, hi in loops), default=0)


def forward_kernels(workload: str, weight_type: str = "", config: tbe_jax.ForwardConfig | None = None):
    """The pooled forward kernel on a workload's tables, lowered for CUDA: the training TBE's (in the workload's
    weights dtype) when `weight_type` is empty, else the quantized inference TBE's (`weight_type`: int8, int4...)."""
    wl = common.workload(workload)
    specs = [tbe_jax.TableSpec(e, d) for e, d, _ in wl.features()]
    config = config or tbe_jax.ForwardConfig()
    if weight_type:
        emb = tbe_jax.QuantizedTableBatchedEmbedding(specs, weight_type, output_dtype=jnp.float32, impl="pallas",
                                                     bounds_check="none", kernel_config=config)
        params = {emb.layout.buffer_key(b): jax.ShapeDtypeStruct(emb.layout.buffer_shape(b), jnp.int32)
                  for b in range(emb.layout.num_buffers)}
    else:
        emb = tbe_jax.TableBatchedEmbedding(specs, impl="pallas", weights_dtype=wl.weights_dtype,
                                            bounds_check="none", kernel_config=config, use_histogram=False)
        params = jax.eval_shape(emb.init, jax.random.key(0))
    emb.uses_kernel = lambda: True  # lowered for CUDA here: the kernel path, not run
    n = sum(wl.B * l for _, _, l in wl.features())
    idx = jax.ShapeDtypeStruct((n,), jnp.int32)
    off = jax.ShapeDtypeStruct((len(specs) * wl.B + 1,), jnp.int32)
    psw = jax.ShapeDtypeStruct((n,), jnp.float32) if wl.weighted else None
    return capture_triton_ir(lambda p, i, o, w: emb(p, i, o, w), params, idx, off, psw)


def report(kernels, match: str) -> dict:
    """`compile_report` of each captured kernel whose name contains `match`, printed as it goes; a kernel met twice
    gets `__1`, `__2`... (as XLA names repeated launches)."""
    out, seen = {}, {}
    for name, ir, warps, stages in kernels:
        if match not in name:
            continue
        seen[name] = seen.get(name, -1) + 1
        label = name + (f"__{seen[name]}" if seen[name] else "")
        try:
            rep = compile_report(ir, warps, stages)
        except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
            rep = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        rep["num_warps"], rep["num_stages"] = warps, stages
        out[label] = rep
        print(f"  {label:40s} " + " ".join(f"{a}={b}" for a, b in rep.items()), flush=True)
    return out


def tt_kernels(workload: str, config: str, opt: str, batch: int):
    """The Pallas kernels of a TT training step (`trace_tt.py`'s step) on a tt_jax workload, lowered for CUDA."""
    import tt_jax
    from benchmarks.bench_tt import config_fields, numpy_cores
    from benchmarks.trace_tt import OPTS, make_step
    from tt_jax import workloads
    from tt_jax.kernels import forward as kf

    wl = workloads.PRESETS[workload]()
    specs = list(wl.specs)
    cfg = kf.TTKernelConfig(**config_fields(config))
    real_backend = jax.default_backend
    jax.default_backend = lambda: "gpu"  # the kernel path, lowered for CUDA here, not run
    try:
        emb = tt_jax.TTEmbeddingBag(specs, impl="pallas", config=cfg)
        o = OPTS[opt]()
        params = {"cores": jax.tree.map(jnp.asarray, numpy_cores(specs))}
        carry = (params, emb.init_opt_state(params, o))
        import numpy as np
        idx, off = (jnp.asarray(a) for a in wl.make_batch(np.random.default_rng(0), batch))
        step = make_step(emb, o)
        return capture_triton_ir(step.__wrapped__ if hasattr(step, "__wrapped__") else step, carry, idx, off)
    finally:
        jax.default_backend = real_backend


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernel_resources", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="")
    ap.add_argument("--dims", default="4-128/4")
    ap.add_argument("--variants", nargs="*", default=[""], help="BackwardConfig variants as JSON objects")
    ap.add_argument("--match", default="small_runs")
    ap.add_argument("--tt", default="", help="a tt_jax workload (e.g. 'a'): report its training step's kernels instead")
    ap.add_argument("--tt-configs", nargs="*", default=[""],
                    help="TTKernelConfig variants as JSON objects, one run each")
    ap.add_argument("--quant", default="", help="weight types (e.g. 'int8,int4,int2'): report the quantized "
                    "forward kernel on --presets instead (default preset base)")
    ap.add_argument("--forward", action="store_true", help="report the training TBE's forward kernel on --presets "
                    "instead (default preset base)")
    ap.add_argument("--forward-configs", nargs="*", default=["{}"],
                    help="with --quant or --forward: ForwardConfig variants as JSON objects")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.quant or args.forward:
        res = {}
        for preset in (args.presets or "base").split(","):
            for wt in args.quant.split(",") if args.quant else [""]:
                for config in args.forward_configs:
                    key = f"{'quant' if wt else 'forward'}-{preset}{'-' + wt if wt else ''}[{config}]"
                    print(f"== {key}")
                    cfg = tbe_jax.ForwardConfig(**json.loads(config or "{}"))
                    res[key] = report(forward_kernels(preset, wt, cfg), "")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1)
        return
    if args.tt:
        res = {}
        for config in args.tt_configs:
            key = f"tt-{args.tt}[{config}]"
            print(f"== {key}")
            res[key] = report(tt_kernels(args.tt, config, "adagrad", 1024), "")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1)
        return
    specs = [p for p in args.presets.split(",") if p] + [f"dims{d}" for d in args.dims.split(";") if d]
    res = {}
    for spec in specs:
        wl = common.workload(spec)
        for variant in args.variants:
            cfg, pad_rows = backward_variant("", variant)
            tables = [tbe_jax.TableSpec(e, d) for e, d, _ in wl.features()]
            emb = tbe_jax.TableBatchedEmbedding(tables, impl="pallas", weights_dtype=wl.weights_dtype,
                                                output_dtype=wl.output_dtype, backward_config=cfg, pad_rows=pad_rows)
            emb.uses_kernel = lambda: True  # lowered for CUDA here: the kernel path, not run
            opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01, eps=0.1)
            params = {emb.layout.key(g): jax.ShapeDtypeStruct((emb.layout.group_rows[g], d), wl.weights_dtype)
                      for g, d in enumerate(emb.layout.dims)}
            state = jax.eval_shape(lambda p: emb.init_opt_state(p, opt), params)
            n = sum(wl.B * l for _, _, l in wl.features())
            idx = jax.ShapeDtypeStruct((n,), jnp.int32)
            off = jax.ShapeDtypeStruct((len(tables) * wl.B + 1,), jnp.int32)
            g = jax.ShapeDtypeStruct((wl.B, sum(d for _, d, _ in wl.features())), jnp.float32)
            psw = jax.ShapeDtypeStruct((n,), jnp.float32) if wl.weighted else None
            kernels = capture_triton_ir(lambda p, s, i, o, gg, w: emb.apply_gradients(p, s, opt, i, o, gg, w),
                                        params, state, idx, off, g, psw)
            key = f"{spec}[{variant}]"
            print(f"== {key}")
            res[key] = report(kernels, args.match)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
