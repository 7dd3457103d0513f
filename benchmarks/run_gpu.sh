#!/usr/bin/env bash
# One device-machine command for a session's GPU work: install, then the stages named
# as arguments, each under its own time limit, results under $OUT (or ./gpu-out).
#   bash benchmarks/run_gpu.sh tests profile      (one device call: at most 10 minutes each, so split
#   bash benchmarks/run_gpu.sh backward           the stages over calls made back to back while the
#   bash benchmarks/run_gpu.sh tt dlrm            machine is warm; each stage has its own time limit)
# Stages:
#   tests     the whole suite compiled (4 workers)              -> tests.log
#   backward  bench_backward.py, all presets + scaling run      -> backward-*.json, backward.log
#   profile   profile_backward.py on base and zipf              -> profile.json
#   forward   bench_forward.py, all presets                     -> forward-*.json, forward.log
#   tt        bench_tt.py workload a, B 2048..131072, forward -> tt-*.json, tt.log
#   ttab      workload a at B 32768: every variant (the ablation)   -> ttab.log
#   ttmeta    meta-240/480/788 at B 4096: forward and ablation -> ttmeta.log
#   ttrain    TT training steps (SGD, Adagrad, row-wise) at B 32768 -> ttrain.log
#   ttprofile profile_tt.py at B 32768 (two group kernels)  -> profile-tt-a.json
#   ttmetatrain profile_tt.py on meta-240 and meta-788, B 4096 -> profile-tt-meta-*.json
#   bwdsweep  backward configs on smalltable, mixed, fp32    -> bwdsweep.log
#   ttmetab   meta-240/480/788 forward at B 8192..32768 (per-index and ours) -> ttmetab.log
#   ttbwdsweep backward-kernel knobs of the TT training step on workload a, B 32768 -> ttbwdsweep.log
#   ttmeta788 meta-788 forward at B 32768 alone (per-index and ours)   -> ttmeta788.log
#   ttmetatrain2 profile_tt.py on meta-480 and meta-788, B 4096 -> profile-tt-meta-*.json
#   ttbwdsweep2 more backward knobs (after bwd_num_warps=2 became the default)  -> ttbwdsweep2.log
#   tttests   the TT test files compiled (8 workers)                -> tttests.log
#   ttmetatrain240 profile_tt.py on meta-240, B 4096             -> profile-tt-meta-240.json
#   fixcheck  the two tests that failed compiled in this session's first run -> fixcheck.log
#   ttfwdsweep forward knobs never swept (num_warps, tile_rows) on a and meta-240 -> ttfwdsweep.log
#   tttrace   trace_tt.py: the TT training step per kernel, default and precision=tf32 -> tt-trace.json, tttrace.log
#   bwdsweep2 TBE backward launch knobs on fp32 (the one backward bar still missed), base, zipf -> bwdsweep2.log
#   histsweep2 histogram forward at fewer warps (2, 1; never swept below 4) on smalltable, mixed -> histsweep2.log
#   histsweep3 histogram forward around the one-warp default (C, lookahead, bags) -> histsweep3.log
#   bwdsweep3 TBE backward around small_block=16 (block 8, warps, K, prefetch)    -> bwdsweep3.log
#   bwdsweep4 TBE backward persistent programs (2048, 8192) and prefetch at the new defaults -> bwdsweep4.log
#   bwdtests  test_backward, test_grad, test_layers compiled                   -> bwdtests.log
#   bwdsweep5 the Pallas run-length encoding (rle_kernel) against the XLA ops      -> bwdsweep5.log
#   bwdsweep6 persistent programs of the mid/chunk kernels apart from the small-run kernel's -> bwdsweep6.log
#   trace     per-kernel device time of the backward step (profiler trace) on base, zipf, fp32 -> trace.log
#   testsfast the whole suite compiled, 8 workers            -> tests.log
#   dlrm      the DLRM demo at GPU size, 300 steps              -> dlrm.log
#   check20   the whole suite compiled; backward traces (with host events) on base, zipf, many300x24, two mixed-dim models
#   (exact01, multisweep, multisweep2, parity, fusedplan, scan, split, merge20: A/Bs of switches since removed, their
#             default arms kept: benchmarks/NOTES.md, end of sessions 22-23)
#   final20   traces of held-out-like models (many tables, tens of dims); bench_backward --device-opt on anchors + mixed
#   many20    bench_backward --bwd-only on many300x24 (enqueued, against the byte-scaled FBGEMM estimate)
#   check21   the whole suite compiled (blocked init); bench_features (construct + init, compiles, at 26..1000 features)
#   dims      bench_dims.py: backward/forward against D, mixed-dim models    -> dims-*.json, dims.log
#   bwdall    bench_backward.py on every preset and mixed, no scaling run      -> backward-*.json, bwdall.log
#   optim     bench_optimizers.py: each fused optimizer's backward step on base and zipf -> optimizers-*.json, optim.log
#   opttests  test_optimizers, test_backward, test_histogram compiled (8 workers)       -> opttests.log
#   ncubwd    Nsight Compute on the small-run kernel: base, dims4-128/4, large -> ncu-*.txt
#   preload   trace_backward.py A/B of backward.PRELOAD (rows loaded before the gather) on presets and mixed dims -> preload-*.json
#   hoist     trace_backward.py A/B: HOIST_HYPER, SEGMENT_BUFFERS 4/16 on base, fp32 and mixed dims -> hoist-*.json
#   ttprec    trace_tt.py with --accuracy: the dot precisions tf32x3 (default), bf16x3, bf16x6, tf32 -> ttprec.json, ttprec.log
#   bwdtests2 test_backward.py compiled (8 workers)                                  -> bwdtests2.log
#   tttests2  test_tt_grad.py, test_tt_kernel.py compiled (8 workers)          -> tttests2.log
#   x2tests   (2-GPU kind) the sharded test files compiled on the GPUs present  -> x2tests.log
#   x2weak    (2-GPU kind) bench_sharding.py --weak, table and row plans, default and per-feature capacity -> sharding-*.json, x2weak.log
#   bwdopt    test_backward.py, test_optimizers.py compiled (8 workers)              -> bwdopt.log
#   dimsreadme bench_dims.py --single 64,128 and the three mixed models (the README's numbers) -> dims-*.json, dims.log
#   multisweep3 dims 4..128 under the width rule: SEGMENT_BUFFERS 16 -> multisweep3.json, .log
#   warprule  A/B of a one-warp rule (since removed: WARP_RULE) on mixed-dim models -> warprule.json, .log
#   (vectests, vecblock, x3tests, x3, x3cfg, dp1: the A/Bs of 2026-12-01 17:00-17:20, on switches since removed or adopted)
#   ttfinal   the TT test files compiled; trace_tt.py with accuracy (precisions, group-kernel knobs); bench_tt.py
#             forward and training steps at B 4096, 32768 -> tttests3.log, ttfinal.json, .log, tt-*.json, tttrain.log
#   (keepc, packedc: the A/Bs of forward.KEEP_C, forward.PACKED_C and backward.PACKED_DP1, 2026-12-01; all three
#             adopted and the switches removed: one path)
#   planblock trace_tt.py at B 4096 and 32768: plan.BLOCK 1024, 512, 256
#             -> planblock-*.json, planblock.log
#   ttcheck   the TT test files compiled; trace_tt.py (step with accuracy, forward alone) at B 4096, 32768; bench_tt.py
#             forward and training steps -> ttchecktests.log, ttcheck-step.json, ttcheck-fwd.json, ttcheck.log, tttrain.log
#   reorder   the TT test files compiled; trace_tt.py forward and step A/B of the (i2, i1, i3) sort order (default) against
#             (i1, i2, i3) (prefix._REORDER_LIMIT=0); bench_tt.py -> reordertests.log, reorder-{fwd,step}-{1,2}.json,
#             reorder.log, tt-*.json, tttrain.log
#   final17   session 17's final numbers: trace_tt.py step with accuracy, bench_tt.py, bench_backward.py --no-xla, bench_dims.py
#             --single "" -> final17-step.json, final17.log, tt-*.json, tttrain.log, backward-*.json, backward.log, dims-*.json, dims.log
#   meta17    the TT test files compiled; bench_tt.py on meta-240 (240 stacked tables) at B 4096, forward and Adagrad step, with
#             the (i2, i1, i3) sort order and without it (_REORDER_LIMIT=0) -> meta17tests.log, tt-*.json, meta17.log
#   ttfwd     trace_tt.py --forward at B 4096 and 32768 (the forward's kernels alone) -> ttfwd.json, ttfwd.log
#   plancoal  test_tt_plan.py and test_tt_kernel.py compiled; trace_tt.py --forward and the step at B 32768 (the plan's
#             table rows stored whole) -> plancoaltests.log, plancoal-fwd.json, plancoal-step.json, plancoal.log
#   keys18    the backward's test files compiled; trace_backward.py A/B of the narrow segments' shared small-run launch
#             (backward.MERGE_WIDTH) on base, zipf, dims 4..128 and 8..192 -> keys18tests.log, keys18-backward.json,
#             keys18.log
#   keys18b   the two-level search of the lookup-keys pass: its tests compiled; trace_backward.py A/B of the narrow
#             segments' block (NARROW_BLOCK 16, 32) -> keys18btests.log,
#             keys18b-backward.json, keys18b.log
#   final18a  the whole suite compiled (8 workers); trace_backward.py A/B of NARROW_BLOCK 64 against the default on the three
#             mixed models -> final18tests.log, narrow64-backward.json, narrow64.log
#   final18b  bench_backward.py --no-xla on every preset; bench_dims.py on the three mixed models -> backward-*.json,
#             backward.log, dims-*.json, dims.log
#   host18    trace_backward.py --host on base and dims 4..128 (host events per step); bench_dims on D 128 and 4..128 with
#             XLA's command buffers (CUDA graphs) at their default and off -> host18.json, host18.log, dims-*.json
#   hyper18   bench_dims.py on D 128 and 4..128, the optimizer's hyperparameters as Python floats / device arrays
#             (--device-opt), twice each, alternating -> dims-*.json
#   check19   (for the next session) the whole suite compiled on session 18's final tree (the chunk-scatter change never
#             ran compiled); trace_backward.py on base, zipf, dims 4..128, 8..192, to set against keys18b-/narrow64-*
#             -> check19tests.log, check19-backward.json, check19.log
#   pad19     (session 19) the whole suite compiled with padded rows (StorageLayout.strides); trace_backward on
#             dims 4..128, 8..192, 12..252 with and without padding (pad_rows=0), base; bench_dims on the mixed
#             models, padded and not -> pad19tests.log, pad19-backward.json, pad19.log, dims-*.json, dims.log
#   edges19   (session 19) the backward's tests compiled; the forward traced padded / unpadded
#             -> edges19tests.log, padfwd19.json, padfwd19.log
#   final19   (session 19) the test files that run the backward, compiled, on the session's final tree (SIGINT at
#             235 s: pytest then prints what ran) -> final19tests.log
#   features  bench_features.py at 26/200/1000 features and the many-dims models -> features-*.json, features.log
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m pip install --no-deps -q -e . >/dev/null 2>&1 || echo "pip install -e . failed"
# Packages the device image lacks (dm-haiku, jmp, nbclient...) travel as wheels in .whl/ (git-ignored; pass
# carry=[".whl"]). Fetch them here first with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl dm-haiku==0.0.17 jmp==0.0.4
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for stage in "$@"; do
  echo "== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests) timeout 300 python3 -m pytest -q -n 4 -p no:benchmark tests 2>&1 | tail -40 > "$OUT/tests.log";
           tail -5 "$OUT/tests.log" ;;
    backward) timeout 420 python3 benchmarks/bench_backward.py --scaling --iters 10 --reps 3 --out "$OUT" \
                2>&1 | grep -v Warning | tee "$OUT/backward.log" ;;
    profile) timeout 120 python3 benchmarks/profile_backward.py --presets base,zipf --out "$OUT/profile.json" ;;
    forward) timeout 300 python3 benchmarks/bench_forward.py --out "$OUT" 2>&1 | tee "$OUT/forward.log" | tail -12 ;;
    tt) timeout 240 python3 benchmarks/bench_tt.py --batches 2048,4096,8192,16384,32768,65536,131072 --no-bwd \
          --variants per_index,pallas_plan,pallas,pallas_queue --out "$OUT" \
          2>&1 | grep -v Warning | tee "$OUT/tt.log" | grep "^  " ;;
    ttab) timeout 200 python3 benchmarks/bench_tt.py --batches 32768 --bwd \
          --variants per_index,unique_only,prefix_reuse,dense,pallas,pallas_queue,pallas_grid,pallas_unique_only,pallas_whole_groups,pallas_plan,pallas_plan_rows,train_adagrad \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/ttab.log" | grep "^  " ;;
    ttmeta) for w in meta-240 meta-480 meta-788; do
          timeout 120 python3 benchmarks/bench_tt.py --workload $w --batches 4096 --iters 3 --reps 2 --sets 1 --no-bwd \
            --variants per_index,pallas_plan,pallas_plan_rows,pallas,pallas_queue,pallas_grid,pallas_unique_only \
            --out "$OUT" 2>&1 | grep -v Warning | tee -a "$OUT/ttmeta.log" | grep "^  "; done ;;
    ttrain) timeout 80 python3 benchmarks/bench_tt.py --batches 32768 --bwd \
          --variants per_index,pallas,train_sgd,train_adagrad,train_rowwise --out "$OUT" \
          2>&1 | grep -v Warning | tee "$OUT/ttrain.log" | grep "^  " ;;
    ttprofile) timeout 60 python3 benchmarks/profile_tt.py --batches 32768 --configs bwd_group_kernel=general \
          --out "$OUT/profile-tt-a.json" 2>&1 | grep -v Warning | tee "$OUT/ttprofile.log" ;;
    ttmetatrain) for w in meta-240 meta-788; do
          timeout 100 python3 benchmarks/profile_tt.py --workload $w --batches 4096 --iters 2 --reps 1 \
            --out "$OUT/profile-tt-$w.json" 2>&1 | grep -v Warning | tee -a "$OUT/ttmetatrain.log"; done ;;
    bwdsweep) timeout 80 python3 benchmarks/bench_backward.py --presets smalltable,mixed,fp32 --iters 10 --reps 3 \
          --configs "default;prefetch=0;lookups_per_step=16" --out "$OUT" \
          2>&1 | grep -v Warning | tee "$OUT/bwdsweep.log" | tail -8 ;;
    testsfast) timeout 400 python3 -m pytest -v -n 8 -p no:benchmark tests > "$OUT/tests.log" 2>&1;
           grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -12 ;;  # -v: a cut run still names its failures
    ttmetab) for w in meta-240 meta-480 meta-788; do
          timeout 150 python3 benchmarks/bench_tt.py --workload $w --batches 8192,16384,32768 --iters 3 --reps 2 --sets 1 \
            --no-bwd --variants per_index,pallas --out "$OUT" 2>&1 | grep -v Warning | tee -a "$OUT/ttmetab.log" \
            | grep "^  "; done ;;
    ttbwdsweep) timeout 200 python3 benchmarks/profile_tt.py --batches 32768 --iters 10 --reps 3 --configs \
          bwd_rows=4 bwd_rows=16 bwd_num_warps=2 bwd_num_warps=8 bwd_member_tile=64 bwd_lookup_tile=128 \
          --out "$OUT/profile-tt-bwdsweep.json" 2>&1 | grep -v Warning | tee "$OUT/ttbwdsweep.log" | grep train_step ;;
    ttmeta788) timeout 240 python3 benchmarks/bench_tt.py --workload meta-788 --batches 32768 --iters 3 --reps 2 --sets 1 \
          --no-bwd --variants per_index,pallas --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/ttmeta788.log" | grep "^  " ;;
    ttmetatrain2) for w in meta-480 meta-788; do
          timeout 150 python3 benchmarks/profile_tt.py --workload $w --batches 4096 --iters 2 --reps 1 \
            --out "$OUT/profile-tt-$w.json" 2>&1 | grep -v Warning | tee -a "$OUT/ttmetatrain.log"; done ;;
    ttbwdsweep2) timeout 100 python3 benchmarks/profile_tt.py --batches 32768 --iters 10 --reps 3 --configs \
          bwd_num_warps=1 bwd_rows=4 bwd_rows=16 \
          --out "$OUT/profile-tt-bwdsweep2.json" 2>&1 | grep -v Warning | tee "$OUT/ttbwdsweep2.log" | grep train_step ;;
    tttests) timeout 150 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_grad.py tests/test_tt_kernel.py \
          tests/test_tt_layers.py > "$OUT/tttests.log" 2>&1; tail -3 "$OUT/tttests.log" ;;
    ttmetatrain240) timeout 100 python3 benchmarks/profile_tt.py --workload meta-240 --batches 4096 --iters 2 --reps 1 \
            --out "$OUT/profile-tt-meta-240.json" 2>&1 | grep -v Warning | tee -a "$OUT/ttmetatrain.log" ;;
    tttrace) timeout 120 python3 benchmarks/trace_tt.py --batches 32768 --configs precision=tf32 \
          --out "$OUT/tt-trace.json" 2>&1 | grep -v Warning | tee "$OUT/tttrace.log" | grep "==" ;;
    ttfwdsweep) timeout 120 python3 benchmarks/bench_tt.py --batches 4096,32768 --no-bwd --variants pallas \
          --configs num_warps=2 tile_rows=8 tile_rows=8,num_warps=2 num_warps=8 --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/ttfwdsweep.log" | grep "^  ";
        timeout 120 python3 benchmarks/bench_tt.py --workload meta-240 --batches 4096 --iters 3 --reps 2 --sets 1 \
          --no-bwd --variants pallas --configs num_warps=2 tile_rows=8 tile_rows=4 tile_rows=8,num_warps=2 --out "$OUT" \
          2>&1 | grep -v Warning | tee -a "$OUT/ttfwdsweep.log" | grep "^  " ;;
    bwdsweep2) timeout 150 python3 benchmarks/bench_backward.py --presets fp32,base,zipf --iters 10 --reps 3 \
          --configs "default;num_warps=2;small_num_warps=2;small_block=16;small_block=16,small_num_warps=2;lookups_per_step=4" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bwdsweep2.log" | tail -12 ;;
    histsweep2) timeout 100 python3 benchmarks/bench_forward.py --presets smalltable,mixed --no-torch --iters 20 --reps 3 \
          --hist-configs "default;num_warps=2;num_warps=2,ids_per_step=16;num_warps=2,ids_per_step=16,lookahead=3;num_warps=1,ids_per_step=8;num_warps=2,lookahead=3" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/histsweep2.log" | tail -8 ;;
    histsweep3) timeout 150 python3 benchmarks/bench_forward.py --presets smalltable,mixed --no-torch --iters 20 --reps 3 \
          --hist-configs "default;ids_per_step=4;ids_per_step=16;lookahead=1;lookahead=3;lookahead=4;bags=32;num_warps=2" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/histsweep3.log" | tail -8 ;;
    bwdsweep3) timeout 220 python3 benchmarks/bench_backward.py --presets fp32,base,zipf --iters 10 --reps 3 \
          --configs "default;small_block=8;small_block=8,small_num_warps=2;small_num_warps=8;num_warps=2;lookups_per_step=16;prefetch=1;prefetch=0" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bwdsweep3.log" | tail -12 ;;
    bwdsweep4) timeout 150 python3 benchmarks/bench_backward.py --presets fp32,zipf,base --iters 10 --reps 3 \
          --configs "default;programs=2048;programs=8192;prefetch=1" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bwdsweep4.log" | tail -12 ;;
    bwdtests) timeout 250 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_grad.py \
          tests/test_layers.py > "$OUT/bwdtests.log" 2>&1; tail -3 "$OUT/bwdtests.log" ;;
    bwdsweep5) timeout 200 python3 benchmarks/bench_backward.py --presets fp32,zipf,base,weighted --iters 10 --reps 3 \
          --configs "default;rle_kernel=0;programs=8192" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bwdsweep5.log" | tail -12 ;;
    bwdsweep6) timeout 200 python3 benchmarks/bench_backward.py --presets fp32,zipf,base --iters 10 --reps 3 \
          --configs "default;programs=8192;programs=16384;small_programs=2048" \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bwdsweep6.log" | tail -12 ;;
    trace) timeout 150 python3 benchmarks/trace_backward.py --presets base,zipf,fp32 --out "$OUT/trace-backward.json" \
          2>&1 | grep -v Warning | tee "$OUT/trace.log" ;
        timeout 60 python3 benchmarks/trace_backward.py --presets fp32 --fwd-bwd --out "$OUT/trace-fwdbwd.json" \
          2>&1 | grep -v Warning | tee -a "$OUT/trace.log" ;;
    fixcheck) timeout 200 python3 -m pytest -q -p no:benchmark "tests/test_histogram.py::test_backward_config_variants" \
          "tests/test_dlrm.py::test_tt_checkpoint_resume_is_bit_exact" 2>&1 | tail -15 | tee "$OUT/fixcheck.log" | tail -3 ;;
    bwdopt) timeout 280 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_optimizers.py \
          > "$OUT/bwdopt.log" 2>&1; tail -3 "$OUT/bwdopt.log" ;;
    dimsreadme) timeout 280 python3 benchmarks/bench_dims.py --single 64,128 --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/dims.log" ;;
    multisweep3) timeout 200 python3 benchmarks/trace_backward.py --presets "" --dims "4-128/4" \
          --variants "" SEGMENT_BUFFERS=16 "" \
          --out "$OUT/multisweep3.json" 2>&1 | grep -E "^==|small_runs" | tee "$OUT/multisweep3.log" ;;
    warprule) timeout 280 python3 benchmarks/trace_backward.py --presets "" --dims "12-252/8;6-96/6;40-160/8;4-128/4" \
          --variants WARP_RULE=0 WARP_RULE=1 --out "$OUT/warprule.json" 2>&1 | grep -E "^==|small_runs" \
          | tee "$OUT/warprule.log" ;;
    ttfinal) timeout 200 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_plan.py tests/test_tt_grad.py tests/test_tt_kernel.py \
          > "$OUT/tttests3.log" 2>&1; tail -2 "$OUT/tttests3.log"
        timeout 260 python3 benchmarks/trace_tt.py --batches 32768 --top 6 --accuracy \
          --configs precision=bf16x3 precision=tf32 bwd_rows=16 bwd_num_warps=4 \
          --out "$OUT/ttfinal.json" 2>&1 | grep -v Warning | tee "$OUT/ttfinal.log" | grep -A2 "=="
        timeout 200 python3 benchmarks/bench_tt.py --batches 4096,32768 --bwd \
          --variants pallas,train_sgd,train_adagrad,train_rowwise --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/tttrain.log" | tail -12 ;;
    planblock) i=0; for v in BLOCK=1024 BLOCK=512 BLOCK=256; do
          i=$((i+1)); timeout 80 python3 benchmarks/trace_tt.py --batches 4096,32768 --top 8 --private "$v" \
            --out "$OUT/planblock-$i.json" 2>&1 | grep -v Warning | tee -a "$OUT/planblock.log" | grep -A2 "=="; done ;;
    ttcheck) timeout 200 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_plan.py tests/test_tt_grad.py tests/test_tt_kernel.py \
          > "$OUT/ttchecktests.log" 2>&1; tail -2 "$OUT/ttchecktests.log"
        timeout 100 python3 benchmarks/trace_tt.py --batches 4096,32768 --top 12 --accuracy --out "$OUT/ttcheck-step.json" \
          2>&1 | grep -v Warning | tee "$OUT/ttcheck.log" | grep -A3 "=="
        timeout 100 python3 benchmarks/trace_tt.py --forward --batches 4096,32768 --top 40 --out "$OUT/ttcheck-fwd.json" \
          2>&1 | grep -v Warning | tee -a "$OUT/ttcheck.log" | grep -A3 "=="
        timeout 200 python3 benchmarks/bench_tt.py --batches 4096,32768 --bwd \
          --variants pallas,train_sgd,train_adagrad,train_rowwise --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/tttrain.log" | tail -12 ;;
    reorder) timeout 200 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_plan.py tests/test_tt_grad.py tests/test_tt_kernel.py \
          > "$OUT/reordertests.log" 2>&1; tail -2 "$OUT/reordertests.log"
        i=0; for v in "" _REORDER_LIMIT=0; do i=$((i+1))
          timeout 80 python3 benchmarks/trace_tt.py --forward --batches 4096,32768 --top 30 --private "$v" \
            --out "$OUT/reorder-fwd-$i.json" 2>&1 | grep -v "Warning\|^E1201\|^  %\|^This isn\|^If you\|^Constant\|^The op\|^$" \
            | tee -a "$OUT/reorder.log" | grep -A2 "=="
          timeout 80 python3 benchmarks/trace_tt.py --batches 4096,32768 --top 30 --private "$v" \
            --out "$OUT/reorder-step-$i.json" 2>&1 | grep -v "Warning\|^E1201\|^  %\|^This isn\|^If you\|^Constant\|^The op\|^$" \
            | tee -a "$OUT/reorder.log" | grep -A2 "=="; done
        timeout 150 python3 benchmarks/bench_tt.py --batches 4096,32768 --bwd \
          --variants pallas,train_sgd,train_adagrad,train_rowwise --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/tttrain.log" | tail -3 ;;
    final17) timeout 80 python3 benchmarks/trace_tt.py --batches 4096,32768 --top 30 --accuracy \
          --out "$OUT/final17-step.json" 2>&1 | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/final17.log" | grep -A1 "=="
        timeout 120 python3 benchmarks/bench_tt.py --batches 4096,32768 --bwd \
          --variants pallas,train_sgd,train_adagrad,train_rowwise --out "$OUT" 2>&1 | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" \
          | tee "$OUT/tttrain.log" | grep "^  pallas"
        timeout 200 python3 benchmarks/bench_backward.py --no-xla --iters 10 --reps 3 --out "$OUT" 2>&1 | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" \
          | tee "$OUT/backward.log" | tail -8
        timeout 150 python3 benchmarks/bench_dims.py --single "" --out "$OUT" 2>&1 | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/dims.log" | tail -6 ;;
    meta17) timeout 200 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_plan.py tests/test_tt_grad.py tests/test_tt_kernel.py \
          > "$OUT/meta17tests.log" 2>&1; tail -1 "$OUT/meta17tests.log"
        for v in "" _REORDER_LIMIT=0; do timeout 130 python3 benchmarks/bench_tt.py --workload meta-240 --batches 4096 \
          --iters 3 --reps 2 --sets 1 --bwd --variants pallas,train_adagrad --private "$v" --out "$OUT" 2>&1 | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" \
          | tee -a "$OUT/meta17.log" | grep "^  "; done ;;
    keys18) timeout 170 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_optimizers.py \
          tests/test_grad.py tests/test_vbe.py tests/test_structure.py > "$OUT/keys18tests.log" 2>&1
        tail -1 "$OUT/keys18tests.log"
        timeout 330 python3 benchmarks/trace_backward.py --presets base,zipf --dims "4-128/4;8-192/8" \
          --variants "" MERGE_WIDTH=0 --out "$OUT/keys18-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/keys18.log" | grep "==" ;;
    keys18b) timeout 100 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_structure.py \
          -k "lookup_keys or narrow or many_dims or grow or bitwise" > "$OUT/keys18btests.log" 2>&1
        tail -1 "$OUT/keys18btests.log"
        timeout 330 python3 benchmarks/trace_backward.py --presets base,zipf --dims "4-128/4;8-192/8" \
          --variants "" NARROW_BLOCK=16 NARROW_BLOCK=32 --out "$OUT/keys18b-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/keys18b.log" | grep "==" ;;
    final18a) timeout 400 python3 -m pytest -q -n 8 -p no:benchmark tests > "$OUT/final18tests.log" 2>&1
        tail -1 "$OUT/final18tests.log"
        timeout 170 python3 benchmarks/trace_backward.py --presets "" --dims "4-128/4;8-192/8;16-256/16" \
          --variants "" NARROW_BLOCK=64 --out "$OUT/narrow64-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/narrow64.log" | grep "==" ;;
    final18b) timeout 300 python3 benchmarks/bench_backward.py --no-xla --iters 10 --reps 3 --out "$OUT" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/backward.log" | tail -8
        timeout 200 python3 benchmarks/bench_dims.py --single "" --out "$OUT" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/dims.log" | tail -6 ;;
    host18) timeout 150 python3 benchmarks/trace_backward.py --presets base --dims "4-128/4" --host --iters 10 \
          --out "$OUT/host18.json" 2>&1 | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" \
          | tee "$OUT/host18.log" | tail -60
        for cb in default off; do
          if [ $cb = off ]; then export XLA_FLAGS="--xla_gpu_enable_command_buffer="; fi
          echo "== command buffers $cb"
          timeout 100 python3 benchmarks/bench_dims.py --single 128 --mixed "4-128/4" --out "$OUT" 2>&1 \
            | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | grep "dims"
        done; unset XLA_FLAGS ;;
    hyper18) for v in "" --device-opt "" --device-opt; do echo "== $v"
          timeout 100 python3 benchmarks/bench_dims.py --single 128 --mixed "4-128/4" $v --out "$OUT" 2>&1 \
            | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | grep "dims"; done ;;
    check19) timeout 400 python3 -m pytest -q -n 8 -p no:benchmark tests > "$OUT/check19tests.log" 2>&1
        tail -1 "$OUT/check19tests.log"
        timeout 170 python3 benchmarks/trace_backward.py --presets base,zipf --dims "4-128/4;8-192/8" \
          --out "$OUT/check19-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/check19.log" | grep -A12 "==" ;;
    pad19) timeout 330 python3 -m pytest -q -n 8 -p no:benchmark tests > "$OUT/pad19tests.log" 2>&1
        tail -1 "$OUT/pad19tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/pad19tests.log" | head -20
        timeout 150 python3 benchmarks/trace_backward.py --presets base --dims "4-128/4;8-192/8;12-252/8" \
          --variants "" "pad_rows=0" --out "$OUT/pad19-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/pad19.log" | grep "=="
        for np in "" "--no-pad"; do timeout 100 python3 benchmarks/bench_dims.py --single "" --mixed "4-128/4;8-192/8" \
          --device-opt $np --out "$OUT" 2>&1 | grep -v Warning | tee -a "$OUT/dims.log" | grep "^dims"; done ;;
    edges19) timeout 200 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_train_step.py \
          tests/test_optimizers.py tests/test_histogram.py tests/test_forward_kernel.py > "$OUT/edges19tests.log" 2>&1
        tail -1 "$OUT/edges19tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/edges19tests.log" | head -20
        timeout 120 python3 benchmarks/trace_backward.py --forward --presets base --dims "4-128/4;12-252/8" \
          --variants "" "pad_rows=0" --out "$OUT/padfwd19.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/padfwd19.log" | grep -A3 "==" ;;
    final19) timeout -s INT 235 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_train_step.py \
          tests/test_vbe.py tests/test_grad.py tests/test_many_features.py tests/test_histogram.py tests/test_layers.py \
          tests/test_optimizers.py > "$OUT/final19tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed|Interrupted" "$OUT/final19tests.log" | tail -20 ;;
    ttfwd) timeout 120 python3 benchmarks/trace_tt.py --forward --batches 4096,32768 --top 40 --private "${TTFWD_PRIVATE:-}" \
          --out "$OUT/ttfwd.json" 2>&1 | grep -v Warning | tee "$OUT/ttfwd.log" | grep -A40 "== B 32768" ;;
    plancoal) timeout 150 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_plan.py tests/test_tt_kernel.py \
          > "$OUT/plancoaltests.log" 2>&1; tail -1 "$OUT/plancoaltests.log"
        timeout 80 python3 benchmarks/trace_tt.py --forward --batches 4096,32768 --top 12 --out "$OUT/plancoal-fwd.json" \
          2>&1 | grep -v Warning | tee "$OUT/plancoal.log" | grep -A4 "=="
        timeout 80 python3 benchmarks/trace_tt.py --batches 32768 --top 12 --out "$OUT/plancoal-step.json" \
          2>&1 | grep -v Warning | tee -a "$OUT/plancoal.log" | grep -A12 "==" ;;
    dims) timeout 240 python3 benchmarks/bench_dims.py --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/dims.log" ;;
    bwdall) timeout 330 python3 benchmarks/bench_backward.py --presets base,zipf,weighted,large,fp32,smalltable,mixed \
          --iters 10 --reps 3 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bwdall.log" | tail -14 ;;
    optim) timeout 330 python3 benchmarks/bench_optimizers.py --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/optim.log" | tail -24 ;;
    opttests) timeout 300 python3 -m pytest -v -n 8 -p no:benchmark tests/test_optimizers.py tests/test_backward.py \
          tests/test_histogram.py > "$OUT/opttests.log" 2>&1; grep -E "FAILED|ERROR|passed|failed" "$OUT/opttests.log" | tail -12 ;;
    features) timeout 280 python3 benchmarks/bench_features.py --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/features.log" | tail -12 ;;
    dlrm) timeout 150 python3 -m examples.dlrm.train --size gpu --steps 300 --no-progress 2>&1 \
            | tee "$OUT/dlrm.log" | tail -4 ;;
    ncubwd) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
        SECS="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section InstructionStats --section SchedulerStats"
        for spec in "base 1 " "dims4-128/4 7 " "dims4-128/4 32 SEGMENT_BUFFERS=1" "large 1 "; do
          set -- $spec ""; tag=$(echo "$1-$3" | tr '/=' '__')
          XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 150 "$NCU" --clock-control none -k regex:tbe_backward_small_runs -c "$2" $SECS \
            python3 benchmarks/ncu_backward.py --workload "$1" --steps 1 --private "${3:-}" > "$OUT/ncu-$tag.txt" 2>&1
          echo "$tag rc=$? $(grep -c 'Duration' "$OUT/ncu-$tag.txt") kernels"
        done ;;
    preload) for v in 0 1; do
          timeout 200 python3 benchmarks/trace_backward.py --presets base,zipf,fp32,weighted,large \
            --dims "4-128/4;8-192/8;16-256/16" --private PRELOAD=$v --out "$OUT/preload-$v.json" 2>&1 \
            | grep "^==" | tee -a "$OUT/preload.log"; done ;;
    hoist) for v in HOIST_HYPER=0 HOIST_HYPER=1 SEGMENT_BUFFERS=16 SEGMENT_BUFFERS=4; do
          timeout 120 python3 benchmarks/trace_backward.py --presets base,fp32 \
            --dims "4-128/4;8-192/8;16-256/16" --private $v --out "$OUT/hoist-$v.json" 2>&1 \
            | grep "^==" | sed "s/^/$v /" | tee -a "$OUT/hoist.log"; done ;;
    ttprec) timeout 200 python3 benchmarks/trace_tt.py --batches 32768 --accuracy --top 6 \
          --configs precision=bf16x3 precision=bf16x6 precision=tf32 --out "$OUT/ttprec.json" 2>&1 | grep -v Warning \
          | tee "$OUT/ttprec.log" | grep "==" ;;
    bwdtests2) timeout 200 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py > "$OUT/bwdtests2.log" 2>&1;
          tail -3 "$OUT/bwdtests2.log" ;;
    tttests2) timeout 240 python3 -m pytest -q -n 8 -p no:benchmark tests/test_tt_grad.py tests/test_tt_kernel.py \
          > "$OUT/tttests2.log" 2>&1; tail -3 "$OUT/tttests2.log" ;;
    check20) timeout -s INT 360 python3 -m pytest -q -n 8 -p no:benchmark tests > "$OUT/check20tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed|Interrupted" "$OUT/check20tests.log" | tail -20
        timeout -s INT 210 python3 benchmarks/trace_backward.py --presets base,zipf,dims4-128/4,dims8-192/8,many300x24 \
          --host --out "$OUT/check20-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/check20.log" | grep -A14 "==" ;;
    final20) timeout -s INT 150 python3 benchmarks/trace_backward.py --presets many300x24z,many500x40@1,dims12-252/8,dims16-256/16 \
          --out "$OUT/final20-backward.json" 2>&1 \
          | grep -v "Warning\\|^E1201\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^The op\\|^$" | tee "$OUT/final20.log" | grep "=="
        timeout -s INT 380 python3 benchmarks/bench_backward.py --no-xla --device-opt \
          --presets base,zipf,weighted,fp32,smalltable,dims4-128/4,dims8-192/8,many300x24,large --out "$OUT" 2>&1 \
          | grep -v Warning | tee "$OUT/final20-bench.log" | tail -14 ;;
    many20) timeout -s INT 140 python3 benchmarks/bench_backward.py --no-xla --device-opt --bwd-only --presets many300x24 \
          --iters 10 --reps 3 --sets 2 --out "$OUT" 2>&1 | grep -v "Warning\\|^E1202\\|^  %\\|^This isn\\|^If you\\|^Constant\\|^$" \
          | tee "$OUT/many20.log" | tail -6 ;;
    check21) timeout -s INT 330 python3 -m pytest -q -n 8 -p no:benchmark tests > "$OUT/check21tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed|Interrupted" "$OUT/check21tests.log" | tail -20
        timeout -s INT 230 python3 benchmarks/bench_features.py --out "$OUT" 2>&1 | grep -v Warning \
          | tee "$OUT/check21-features.log" | tail -8 ;;
    x2tests) timeout 400 python3 -m pytest -q -n 4 -p no:benchmark tests/test_sharding.py tests/test_tt_sharding.py \
          tests/test_sharded_layers.py tests/test_tt_sharded_layers.py tests/test_dlrm_sharded.py \
          tests/test_sharded_input_errors.py > "$OUT/x2tests.log" 2>&1; tail -3 "$OUT/x2tests.log" ;;
    x2weak) timeout 400 python3 benchmarks/bench_sharding.py --weak --capacity-fracs 1,feature --out "$OUT" 2>&1 \
          | grep -v Warning | tee "$OUT/x2weak.log" | tail -8 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
