"""`python -m benchmarks <suite> [args]`: run one benchmark suite (`python -m benchmarks <suite> --help` for its
options). Results go to `benchmarks/results/` unless `--out` says otherwise; shared timing, workloads and result
saving are in `benchmarks/common.py`. A/B runs pass config objects as JSON (`--configs '{}' '{"unroll": 8}'`).

Measurements (meant for an H200; on a CPU most run as smoke tests in interpret mode, with `--presets tiny` or
`--impl xla`):
  presets      forward then backward on the anchors' presets (`make bench`)
  forward      the forward on the presets: ours, the XLA baseline, torch, FBGEMM's anchors (bench_forward.py)
  backward     apply_gradients and train_step on the presets, the XLA baseline (bench_backward.py)
  optimizers   each fused optimizer's backward step on base and zipf against FBGEMM (bench_optimizers.py)
  dims         the backward and forward against the embedding dim, mixed-dim models (bench_dims.py)
  features     init, compile and step cost against the feature count (bench_features.py)
  paths        the histogram path against the generic one; dispatch on default TableSpecs (bench_paths.py)
  tt           TT embedding-bag forward and training steps against XLA baselines (bench_tt.py)
  sharding     sharded training steps over the GPUs of one host (bench_sharding.py)
  sweep        hundreds of drawn shard shapes against FBGEMM (sweep.py)
  fbgemm_smoke FBGEMM loads and computes right on the GPU machine (seconds; run it right after unpacking)
  fbgemm_quant FBGEMM's quantized inference TBE: our row bytes and its forward checked (--check), its forward
               kernel timed on int8 / int4 / fp16 tables (--time) (fbgemm_quant.py)
  bench_quant  our quantized inference TBE on fbgemm_quant's cases, with the ratios to its --time JSON
               (bench_quant.py)
  dispatch     host time of jitted calls (dispatch.py)
  cpu_update   the XLA path's update on the CPU as tables grow (cpu_update.py)
  host_cache   training steps with tables in host memory (host, host_cached, planned) against all-HBM (host_cache.py)
  fbgemm_cache FBGEMM's MANAGED_CACHING on host_cache's model and batches (fbgemm_cache.py)
  host_floor   the bus floor of host_cache's cached step: the best cache's misses, bytes each way (host_floor.py)
  dlrm_model   the DLRM demo's whole model (DCNv2 at MLPerf size): build, init, step, split, memory (dlrm_model.py)
  dlrm_compare ours against torch + FBGEMM (benchmarks/dlrm_torch.py) on the same batches, from saved results
Traces and probes (per-kernel time, one question each):
  trace_backward  per-kernel GPU time of the backward / training step (trace_backward.py)
  trace_tt        per-kernel GPU time of a TT training step (trace_tt.py)
  profile_backward, profile_tt  the steps' pieces timed alone
  probe_forward   ForwardConfig variants on chosen sweep shards, device time
  probe_backward  BackwardConfig variants on chosen sweep shards, device time of the row-wise Adagrad update
  probe_step_width  which compiled backward cases fail with `BackwardConfig.step_width` (a process per case)
  probe_step_memory  XLA memory analysis of the compiled DCNv2 step at MLPerf sizes (tables not allocated)
  probe_repair    the default mode's offsets repair and id counts
  probe_fixup     the floor of issue 36 item 2's two repair designs (a no-op launch, a zeroed word, tickets)
  probe_dcn_x0    the DCNv2 step's dense part with x0 = [h, pooled] built three ways (concat, barrier, in place)
  probe_pallas_gemm  a Pallas TF32 matmul (and the cross layer's epilogue) against XLA's cuBLAS gemm (issue 38)
  probe_copy_rows  the host tier's row copies alone (fills, stages, write-backs), device time and GB/s
  probe_host_overlap  a bus copy beside HBM work in one program, on one stream or two (compute_on)
  probe_cpu_gather  the host's CPUs gathering and scattering a step's missed rows; device_put of the staging buffer
  probe_shard_host  a table in pinned host memory inside shard_map (one GPU mesh): the step runs, stays in host memory
  cache_hits       the host tier's hit rates and fills on a scaled-down model (any backend, no timing)
  probe_ranksort  the counting-rank sort against XLA's sort
  enqueue_gap     where enqueued time exceeds device time, on chosen sweep shards
  probe_enqueue_floor  enqueued over device time of programs without our code (XLA fusions, a Pallas copy)
  kernel_resources  registers, spills and SASS of the kernels: backward, --forward, --quant, --tt (no GPU; triton)
  aot_hlo         the launches of a jitted call (sweep shards, the DCNv2 step) compiled for an H100/H200 here (no GPU)
  ncu_backward    a few backward steps to run under Nsight Compute
  triton_hist     Triton's tl.histogram against our histogram kernel (needs jax_triton)
Reports:
  table        the README's performance table from the saved sweep summary (`--write README.md`)
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "presets": "benchmarks.presets",
    "forward": "benchmarks.bench_forward",
    "backward": "benchmarks.bench_backward",
    "optimizers": "benchmarks.bench_optimizers",
    "dims": "benchmarks.bench_dims",
    "features": "benchmarks.bench_features",
    "paths": "benchmarks.bench_paths",
    "tt": "benchmarks.bench_tt",
    "sharding": "benchmarks.bench_sharding",
    "sweep": "benchmarks.sweep",
    "fbgemm_smoke": "benchmarks.fbgemm_smoke",
    "fbgemm_quant": "benchmarks.fbgemm_quant",
    "bench_quant": "benchmarks.bench_quant",
    "dispatch": "benchmarks.dispatch",
    "probe_enqueue_floor": "benchmarks.probe_enqueue_floor",
    "cpu_update": "benchmarks.cpu_update",
    "host_cache": "benchmarks.host_cache",
    "fbgemm_cache": "benchmarks.fbgemm_cache",
    "host_floor": "benchmarks.host_floor",
    "probe_copy_rows": "benchmarks.probe_copy_rows",
    "probe_host_overlap": "benchmarks.probe_host_overlap",
    "probe_cpu_gather": "benchmarks.probe_cpu_gather",
    "probe_shard_host": "benchmarks.probe_shard_host",
    "cache_hits": "benchmarks.cache_hits",
    "dlrm_model": "benchmarks.dlrm_model",
    "dlrm_compare": "benchmarks.dlrm_compare",
    "trace_backward": "benchmarks.trace_backward",
    "trace_tt": "benchmarks.trace_tt",
    "profile_backward": "benchmarks.profile_backward",
    "profile_tt": "benchmarks.profile_tt",
    "probe_forward": "benchmarks.probe_forward",
    "probe_backward": "benchmarks.probe_backward",
    "probe_step_width": "benchmarks.probe_step_width",
    "probe_step_memory": "benchmarks.probe_step_memory",
    "aot_hlo": "benchmarks.aot_hlo",
    "probe_repair": "benchmarks.probe_repair",
    "probe_fixup": "benchmarks.probe_fixup",
    "probe_dcn_x0": "benchmarks.probe_dcn_x0",
    "probe_pallas_gemm": "benchmarks.probe_pallas_gemm",
    "probe_ranksort": "benchmarks.probe_ranksort",
    "enqueue_gap": "benchmarks.enqueue_gap",
    "kernel_resources": "benchmarks.kernel_resources",
    "ncu_backward": "benchmarks.ncu_backward",
    "triton_hist": "benchmarks.probe_triton_histogram",
    "table": "benchmarks.table",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUITES:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown suite {argv[0]!r}")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module = importlib.import_module(SUITES[argv[0]])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
