#!/usr/bin/env bash
# One device-machine command for a session's GPU work: install, then the stages named as arguments, each under its
# own time limit (a device call runs at most 10 minutes: split the stages over calls made back to back while the
# machine is warm). Results and logs go to $OUT (default ./gpu-out); each stage uses `python -m benchmarks <suite>`.
#   bash benchmarks/run_gpu.sh tests
#   bash benchmarks/run_gpu.sh presets optimizers
#   bash benchmarks/run_gpu.sh sharding          (on a machine with 2+ GPUs)
# Stages (limit):
#   tests      (520 s) the whole suite compiled, 12 workers, -v so a cut run still names its failures -> tests.log
#   presets    (570 s) forward then backward on the anchors' presets (make bench) -> forward-*.json,
#              backward-*.json, presets.log
#   sweep      (570 s) `dispatch` (host us of a jitted call on a zero-work batch, for the summary's dispatch_us), then
#              240 drawn shard shapes of seed 20261207 against FBGEMM (FBGEMM from ../shared/fbgemm; budget 490 s)
#              -> sweep.json, sweep.log; then `python -m benchmarks table --sweep $OUT/sweep.json`
#   sweep-ours (570 s) the same sweep, our side alone (no FBGEMM needed: any call of a lease; the lock is ours alone,
#              so all 248 shards should fit where the shared run reached 115-175), six workers of 2-3 CPUs each
#              (the run is compile-bound: ~4-7 s of compile a shard against ~0.7 s under the lock, session 59)
#              -> sweep-ours.json (and /tmp/sweep-ours.json; a second sweep-ours on the lease measures only the
#              shards the first missed)
#   sweep-fbgemm (~300 s, FBGEMM unpacked first, on the lease that ran sweep-ours) `dispatch`, FBGEMM's side alone
#              (3 workers) -> sweep-fbgemm.json, then both merged -> sweep.json, sweep.log
#   fbgemm-smoke (~20 s; FBGEMM unpacked first) FBGEMM's training TBE against float64 (forward and row-wise
#              Adagrad update) and its int8 inference forward: the first check of `fbgemm_chunks.sh`'s sm_90a-only pack
#   dispatch   (40 s) `dispatch` alone -> dispatch.json (and /tmp/dispatch.json for sweep-one)
#   sweep-one  (535 s, FBGEMM unpacked first) both sides in one call, our six workers and FBGEMM's two sharing the
#              lock (session 58's split run: FBGEMM's 248 shards held the lock 218 s, ours ~0.7 s a shard, our
#              compiles ~280 s over six workers), with `dispatch`'s /tmp/dispatch.json -> sweep.json, sweep.log
#   optimizers (330 s) each fused optimizer's backward step on base and zipf -> optimizers-*.json, optimizers.log
#   tt         (300 s) TT forward and training steps, workload a, B 4096 and 32768 -> tt-*.json, tt.log
#   dlrm       (150 s) the DLRM demo at GPU size, 300 steps -> dlrm.log
#   features   (280 s) init, compile and step cost at 26..1000 features and the many-dims models -> features-*.json,
#              features.log
#   dcnv2      (per run 280 s) the MLPerf DLRMv2 (DCNv2) model at MLPerf's table sizes, ours: for each B:DTYPE[:MM]
#              of $DCNV2_RUNS (default "65536:float32 16384:float32"; MM the matmuls, tensorfloat32 (default) or
#              bfloat16) `python -m benchmarks dlrm_model`, the batches dumped to /tmp/dlrmv2_b$B for the torch side
#              -> dlrm_model-b$B-$DTYPE-$MM.json, dcnv2.log
#   dcnv2-torch (per run 280 s) the same model in torch + FBGEMM (FBGEMM unpacked first, ../shared/fbgemm) on
#              those dumped batches, same $DCNV2_RUNS -> dlrm_torch-b$B-$DTYPE-$MM.json, dcnv2.log
#   quant      (560 s) our quantized inference TBE ($QUANT_TYPES, default int8,int4 rows) on
#              fbgemm_quant's cases and the first $QUANT_SHARDS (default 10) sweep shards -> bench-quant.json,
#              quant.log (int8 + int4: ~340 s on an H100, mostly compiles; 300 s cut it, session 42)
#   quant-fbgemm (420 s; FBGEMM with --inference unpacked first) FBGEMM's IntNBit TBE: our rows' bytes and its
#              forward (--check), then its forward timed on the same cases -> fbgemm-quant-{check,time}.json;
#              then `python -m benchmarks bench_quant`'s ratios from the two files (`bench_quant.with_fbgemm`)
#   host       (560 s) the host tier: its test file compiled (320 s: two runs of 140 and 290 s were cut), then `host_cache` (device / host_cached at lf 0.2 and
#              0.05, alphas 1.05 and 1.2) -> host-tests.log, host-cache-*.json, host.log
#   host-bench (~100 s) `host`'s benchmark part alone (to pair with FBGEMM's chunk calls) -> host-cache-*.json, host.log
#   host-tests (400 s) `host`'s test file alone, its tests spread over 6 workers (`--dist load`: the whole file
#              ran in 80 s so, against >400 s on one worker) -> host-tests.log
#   host-shard (200 s) the host tier's sharding tests (one GPU: the mesh-of-one ones) with the host test file,
#              6 workers -> host-shard.log
#   host-quick (~180 s) the overlap probe's decisive variants (one process each, 60 s in all) then the by-scope
#              profile at alpha 1.2, lf 0.2 (the step alone, then with its prefetch) -> host-overlap.log, host-cache-*.json
#   host-profile (300 s) the host_cached step at alpha 1.2, lf 0.2, 48 batches, with its per-kernel profile over the
#              same batches (device ms by kind, host enqueue time, launches; the training step alone first: what
#              the prefetch adds), then each row copy of the prefetch alone (probe_copy_rows: fills, stages,
#              write-backs; 48 row sets cycled, as the step's 48 batches) -> host-cache-*.json, probe-copy-rows-*.json,
#              host-profile.log
#   host-fills (2 x 200 s) the host_cached step at alpha 1.05 and 1.2, lf 0.2, with the fill cap at 1/16 (the
#              default) and 1/8 of the lookups -> host-cache-*.json, host-fills.log
#   host-overlap (400 s) a bus copy (gather from / write to pinned host rows) beside HBM work in one program, on one
#              stream or on a second one (compute_on "gpu_stream:1"), XLA's stream annotation off and on
#              -> probe-host-overlap-*.json, host-overlap.log
#   host-overlap-grid (~300 s) the overlap probe's copies with their grid capped at 16 and 64 programs (and
#              uncapped), on a second stream beside the HBM work: does a copy that leaves SMs free overlap?
#              -> probe-host-overlap-*.json, host-overlap-grid.log
#   quant-ab   (~400 s) the quantized forward on this tree and on ab_old/ (e.g. `git archive REF tbe_jax
#              benchmarks tests | tar -x -C ab_old`), same cases ($QA_WORKLOADS, default the presets' and
#              dims8-192/8; $QA_TYPES, default int4,int8); ab_old's quant tests compiled first when it has tests/
#              -> quant-ab-*.json, quant-ab.log
#   forward-ab (~60 s a round) the forward's device time on sweep shards ($FA_SHARDS of seed $FA_SEED, default
#              20261207, or named ones) on this tree, then on ab_old/ (made as for host-ab), $FA_ROUNDS rounds
#              (default 1) -> forward-ab-{this,old}K.json, forward-ab.log
#   launches   (~400 s) session 63's two launch cuts, compiled and timed against ab_old/ (25fff7f: `git archive 25fff7f
#              tbe_jax benchmarks tests | tar -x -C ab_old`, carry=["ab_old"]): the histogram-auto, rle and task-range
#              tests compiled, 12 backward fuzz cases, then probe_backward ($LB_SHARDS) and probe_forward ($LF_SHARDS)
#              on this tree and on ab_old/ -> launches.log, launches-{bwd,fwd}-{this,old}.json
#   host-ab    (~170 s) host_cache at lf 0.2 (device, host_cached; alpha 1.05, 1.2) on this tree, then on ab_old/ (a
#              copy of another commit, made here first: `git archive REF tbe_jax benchmarks | tar -x -C ab_old`,
#              then `rm -rf ab_old/benchmarks/results`; git-ignored: pass carry=["ab_old"]) -> host-ab.log, 2 JSONs
#   persistent (~250 s) the forward's persistent grid (sessions 57-58): its tests compiled (test_forward_kernel.py -k
#              "max_programs or persistent or mixed_dims or bag_groups or short_bag"), then probe_forward with the
#              rule off (`persistent_max_mean` 0), the default (10 ids and 1280 values a bag) and values alone (ids
#              up to 1000) on the 15 shards whose launch the values bound alone changes (DLRMv2, hinted and not,
#              and 13 of seed 20261207's; the default changes 9 of them) -> persistent-tests.log,
#              probe-persistent-rule.json
#   fixup      (~370 s) `probe_fixup` (issue 36 item 2's candidates: what an always-launched no-op kernel after the
#              forward costs on base, smalltable and 4 small shards, one program and one per SM; a zeroed word and
#              one same-address atomic per forward program, the last-ticket candidate) -> probe-fixup.json,
#              then test_forward_kernel.py and test_bounds.py compiled (the persistent default's whole files)
#              -> fixup.log
#   kernel-tests (400 s) the forward kernel's and the quantized forward's test files compiled, 12 workers, -v
#              ($KT_K: a -k expression, e.g. "two_tiles") -> kernel-tests.log (whole files: >230 s, session 43)
#   warps-fp32 (~80 s) one warp, the default rule and two warps on fp32 tables (probe_forward, seed 20261203): the
#              8 weighted fp32 shards (s036 s068 s069 s078 s183 s199 s213 s215) and 5 unweighted ones (the fp32
#              preset, s040, s046, s103, s113); the rule (`ForwardConfig.num_warps=None`, session 48) gives two
#              warps to weighted fp32 launches with tiles <= 128 columns -> probe-warps-fp32.json, warps-fp32.log
#   fp32-unweighted (~60 s) the unweighted fp32 shards below 1.2x FBGEMM on seed 20261203 (the fp32 preset 1.17x,
#              s113, s165, s046) and two at 1.27-1.28x (s082, s144): default, two warps, unroll 2, both (issue 35's
#              fp32 bar; a rule must hold beyond the preset) -> probe-fp32-unweighted.json, fp32-unweighted.log
#   wide-check (~200 s) the forward kernel's and bounds test files compiled (the `wide_bags` launch tests among them),
#              then 20 fuzz cases of the forward compiled (half of them reach the wide-rows rule) -> wide-check.log
#   merge      (~450 s) `ForwardConfig.merge_programs` (opt-in, session 62: more than `segment_buffers` buffers
#              kept in one launch when it runs few programs): its tests and 24 forward fuzz cases compiled, then
#              probe_forward always merging (up to 16 buffers) against the default on 14 ten-dim shards of seed
#              20261207 (two launches today; small and large) -> merge.log, probe-merge.json
#   quant-code (~120 s) int4 dims8-192/8 (7 branches, 5288 SASS) against base (664) at B 16 and 128 and their own,
#              `unroll` 4 / 2 / 1 (the code's size): does dims8-192/8's B 128 loss (0.84x FBGEMM) track the code's
#              size? -> quant-code.json, quant-code.log
#   merge-quant (~300 s) the same for the quantized forward: int8 and int4 on the mixed-dims models at B 16, 128,
#              1024 and their own -> quant-merge-ab.json, merge-quant.log
#   wide-rows  (~80 s) rows wider than 128 (one bag a one-warp program): `ForwardConfig.wide_bags` 1 (off), the
#              default (two bags on two warps a program for short bags) and 4, on the D > 128 single-dim shards of three
#              seeds: the short-bag ones at the forward's worst (0.67-1.01x FBGEMM) and long-bag ones
#              -> probe-wide-rows-SEED.json (session 50 ran it first with '{}', two warps, two warps + tile 512)
#   occupancy  (~60 s) the wide-rows idea at D <= 128: the same work a thread, twice / four times the bags and warps a
#              program (tile_elems 512 / 1024 with 2 / 4 warps) on DLRMv2's tables (issue 35's unhinted 1.2x bar),
#              the presets and three seed-20261207 shards -> probe-occupancy.json
#   wide-rows-bwd (~120 s) the backward (row-wise Adagrad update) of seed 20261207's worst backward shards (s083,
#              s193, s164: D > 128 with short bags; s098, s063, s108) and wide long-bag ones with the mid-run, chunk
#              and long-run kernels at 1 (default), 2 and 4 warps (`probe_backward`) -> probe-wide-rows-bwd.json
#   long-block (~330 s) the backward test files compiled (`long_block` among them), then `BackwardConfig.long_block`
#              1 (one chunk partial a step, as before session 51) against the default 8 and two warps on
#              seed 20261207's long-run shards, and two warps on its D > 128 shards with few mid-run tasks
#              -> long-block-tests.log, probe-long-block.json, probe-bwd-warps-wide.json
#   backward-tests (~300 s) the backward's test files compiled (test_backward.py, test_optimizers.py, test_grad.py)
#              and 40 backward fuzz cases on the defaults (session 53 moved `split_chunk` and the rank sort's merge,
#              session 54 `step_width`: run it first on a tree with new defaults) -> backward-tests.log
#   backward-fuzz (~130 s) backward-tests' 40 fuzz cases alone (seeds 931000-931039) -> backward-fuzz.log
#   rle-fill   (~250 s) `BackwardConfig.rle_fill` (default False since session 55: the run-length write pass
#              writes no fills past the counts): its tests compiled, 30 fuzz cases (a quarter of them with fills),
#              then `probe_backward` without and with the fills on the big small-table updates where the fills
#              were most of the pass's bytes and on controls -> rle-fill.log, probe-rle-fill.json
#   step-width (~90 s) `probe_step_width`: the failing-looking test's case and one factor changed at a time, each
#              compiled in a process of its own against the XLA path -> probe-step-width-diag.json, step-width.log
#   narrow-ab  (~480 s; ab_old/ = the commit before the run-length passes read narrow keys, made here first:
#              `git archive REF tbe_jax benchmarks | tar -x -C ab_old`; carry=["ab_old"]) the backward's tests of
#              those passes and of `step_width` compiled, 20 fuzz cases, then `probe_backward` with
#              `BackwardConfig.step_width` 0 / 128 on narrow-row shards ($SW_SHARDS) and the default update of
#              ab_old/ on the narrow-key shards ($RLE_SHARDS: sorted by XLA with u8 / u16 keys; this tree's '{}'
#              column is the other arm) -> narrow-tests.log, probe-step-width.json, probe-rle-old.json
#   long-warps (~150 s) the long-run kernel's warps alone (`BackwardConfig.long_num_warps` 2 and 4, with `long_block`
#              8 and 16), and shorter chunks (`long_run` 128, 64: a mid run of up to 255 lookups is one task's
#              serial chain of 32 steps) and 16 lookups a step (`lookups_per_step`) on seed 20261207's shards
#              with hot long runs (s108, s013, s040, s218) and on others (zipf, fp32, dlrmv2, s083, s098, s164)
#              -> probe-long-warps.json
#   sort-enqueue (~90 s) device and enqueued time of updates just past the counting-rank sort (24576 to 65536
#              lookups, seed 20261207's backward shards of 2.2-2.8x enqueued over device: XLA's CUB sort thunk
#              breaks the step's CUDA graph) with `rank_sort_max` 24576 (default), 65536 and 131072
#              -> probe-sort-enqueue.json
#   pallas-gemm (~90 s) a Pallas TF32 matmul (5 tile configs) against XLA's cuBLAS gemm on the DCNv2 cross layer's
#              shapes at B 65536, and the z gemm with the layer's elementwise epilogue (issue 38's one lever left)
#              -> probe-pallas-gemm.json, pallas-gemm.log
#   cpu-gather (~60 s) the host's threads gathering / scattering a step's missed rows, device_put of the staging
#              buffer (issue 40's untried overlap design) -> probe-cpu-gather.json, cpu-gather.log
#   host-admit (~200 s) the host_cached step at lf 0.2 (alpha 1.2, 1.05) with cache_admit_age 0 (every miss
#              admitted, as FBGEMM) and 16, against host-bench's default 128 -> host-cache-*.json, host-admit.log
#   host-fbgemm (300 s; FBGEMM unpacked first) FBGEMM's MANAGED_CACHING on the same model -> fbgemm-cache-*.json
#   host-big   (560 s) a model larger than HBM (16 x 44M x 128 fp16 + state, the planner under $HBM_BUDGET_GB,
#              default 120: an H200; host_cache raises XLA's HBM and pinned-host limits itself) against the
#              all-HBM model at 4M rows per table -> host-cache-*.json, host-big.log;
#              on an H100 (80 GB HBM, 128 GB host RAM): HOST_BIG_ROWS=22000000 HBM_BUDGET_GB=55 (~92 GB)
#   sharding   (400 s; 2+ GPUs) the sharded test files compiled, then weak scaling (table and row plans, default and
#              per-feature capacity) -> sharding-tests.log, sharding-*.json, sharding.log
#   sharding-host (300 s; 2+ GPUs) weak scaling with the tables in host memory behind each device's cache (table and
#              row plans, Zipf 1.2 ids, lf 0.2) beside the same plans in HBM -> sharding-*.json, sharding-host.log
# Older stages (A/Bs of switches since removed, one-off traces) are in this file's git history.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m pip install --no-deps -q -e . >/dev/null 2>&1 || echo "pip install -e . failed"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout for scripts too (no network: the editable install fails)
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
    tests) timeout 520 python3 -m pytest -v -n 12 -p no:benchmark tests > "$OUT/tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -12 ;;
    presets) timeout 570 python3 -m benchmarks presets --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/presets.log" \
        | grep "^|" ;;
    sweep) timeout 40 python3 -m benchmarks dispatch --out "$OUT/dispatch.json" 2>&1 | grep -v Warning > "$OUT/sweep.log"
        timeout 530 python3 -m benchmarks sweep --shapes 240 --seed 20261207 --budget-s 490 --big-budget-s 170 \
          --dispatch "$OUT/dispatch.json" --out "$OUT/sweep.json" 2>&1 | grep -v Warning >> "$OUT/sweep.log"
        tail -3 "$OUT/sweep.log"
        [ -f "$OUT/sweep.json" ] && python3 -m benchmarks table --sweep "$OUT/sweep.json" ;;
    sweep-ours) more=(); [ -f /tmp/sweep-ours.json ] && more=(--merge /tmp/sweep-ours.json:ours --skip-measured)
        timeout 565 python3 -m benchmarks sweep --shapes 240 --seed 20261207 --only ours --workers 6 \
          --budget-s 530 --big-budget-s 120 "${more[@]}" --out "$OUT/sweep-ours.json" 2>&1 \
          | grep -v Warning > "$OUT/sweep-ours.log"
        tail -3 "$OUT/sweep-ours.log"; cp "$OUT/sweep-ours.json" /tmp/sweep-ours.json ;;
    fbgemm-smoke) timeout 120 python3 -m benchmarks fbgemm_smoke 2>&1 | grep -v Warning | tail -4 ;;
    dispatch) timeout 40 python3 -m benchmarks dispatch --out "$OUT/dispatch.json" 2>&1 | grep -v Warning \
          > "$OUT/dispatch.log"; cp "$OUT/dispatch.json" /tmp/dispatch.json; tail -4 "$OUT/dispatch.log" ;;
    sweep-one) d=(); [ -f /tmp/dispatch.json ] && d=(--dispatch /tmp/dispatch.json)
        timeout 535 python3 -m benchmarks sweep --shapes 240 --seed 20261207 --workers 6 --fbgemm-workers 2 \
          --budget-s 500 --big-budget-s 120 "${d[@]}" --out "$OUT/sweep.json" 2>&1 | grep -v Warning > "$OUT/sweep.log"
        tail -3 "$OUT/sweep.log"
        [ -f "$OUT/sweep.json" ] && python3 -m benchmarks table --sweep "$OUT/sweep.json" ;;
    sweep-fbgemm) timeout 40 python3 -m benchmarks dispatch --out "$OUT/dispatch.json" 2>&1 | grep -v Warning \
          > "$OUT/sweep.log"
        timeout 420 python3 -m benchmarks sweep --shapes 240 --seed 20261207 --only fbgemm --fbgemm-workers 3 \
          --budget-s 380 --big-budget-s 80 --out "$OUT/sweep-fbgemm.json" 2>&1 | grep -v Warning >> "$OUT/sweep.log"
        timeout 60 python3 -m benchmarks sweep --shapes 240 --seed 20261207 --no-run --dispatch "$OUT/dispatch.json" \
          --merge /tmp/sweep-ours.json:ours "$OUT/sweep-fbgemm.json:fbgemm" --out "$OUT/sweep.json" 2>&1 \
          | grep -v Warning >> "$OUT/sweep.log"
        tail -3 "$OUT/sweep.log"
        [ -f "$OUT/sweep.json" ] && python3 -m benchmarks table --sweep "$OUT/sweep.json" ;;
    optimizers) timeout 330 python3 -m benchmarks optimizers --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/optimizers.log" | tail -24 ;;
    tt) timeout 300 python3 -m benchmarks tt --batches 4096,32768 --bwd \
          --variants per_index,pallas,train_sgd,train_adagrad,train_rowwise --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/tt.log" | grep "^  " ;;
    dlrm) timeout 150 python3 -m examples.dlrm.train --size gpu --steps 300 --no-progress 2>&1 \
        | tee "$OUT/dlrm.log" | tail -4 ;;
    features) timeout 280 python3 -m benchmarks features --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/features.log" | tail -12 ;;
    host) timeout 320 python3 -m pytest -v -n 12 -p no:benchmark tests/test_host_cache.py > "$OUT/host-tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/host-tests.log" | tail -6
        timeout 240 python3 -m benchmarks host_cache --rows 1000000 --tables 8 --locations device host_cached \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/host.log" ;;
    host-bench) timeout 240 python3 -m benchmarks host_cache --rows 1000000 --tables 8 --locations device host_cached \
          --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/host.log" ;;
    host-tests) timeout 400 python3 -m pytest -v -n 6 --dist load -p no:benchmark tests/test_host_cache.py \
          > "$OUT/host-tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/host-tests.log" | tail -6 ;;
    host-shard) timeout 200 python3 -m pytest -v -n 6 --dist load -p no:benchmark tests/test_sharding_host.py \
          tests/test_sharded_input_errors.py tests/test_dlrm_sharded.py tests/test_host_cache.py > "$OUT/host-shard.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/host-shard.log" | tail -8 ;;
    host-quick) t0=$(date +%s)
        for v in work:0 gather:0 work+gather:0 work+gather@stream:1 work+gather@stream:0 write:0 work+write@stream:1; do
          [ $(( $(date +%s) - t0 )) -gt 60 ] && break
          timeout 30 python3 -m benchmarks probe_host_overlap --rows 2000000 --one "$v" 2>&1 | grep -E "RESULT|Error" | tail -2
        done | tee "$OUT/host-overlap.log"
        timeout 110 python3 -m benchmarks host_cache --rows 1000000 --tables 8 --locations host_cached --alphas 1.2 \
          --load-factors 0.2 --profile 12 --out "$OUT" 2>&1 | grep -v Warning | tail -5 ;;
    host-profile) timeout 300 python3 -m benchmarks host_cache --rows 1000000 --tables 8 --locations device host_cached \
          --alphas 1.2 --load-factors 0.2 --profile 24 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/host-profile.log"
        timeout 150 python3 -m benchmarks probe_copy_rows --fresh 48 --out "$OUT" 2>&1 | grep -v Warning \
          | tee -a "$OUT/host-profile.log" ;;
    host-fills) for ff in 0.0625 0.125; do timeout 200 python3 -m benchmarks host_cache --rows 1000000 --tables 8 \
          --locations host_cached --alphas 1.05 1.2 --load-factors 0.2 --fill-fraction $ff --out "$OUT" 2>&1 \
          | grep -v Warning | tee -a "$OUT/host-fills.log"; done ;;
    host-overlap) timeout 400 python3 -m benchmarks probe_host_overlap --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/host-overlap.log" ;;
    host-overlap-grid) for p in 0 16 64; do v="gather,write,work+gather@stream,work+write@stream"
          [ "$p" = 0 ] && v="work,$v"
          timeout 130 python3 -m benchmarks probe_host_overlap --programs $p --variants "$v" --annotation 1 \
            --out "$OUT" 2>&1 | grep -v Warning | sed "s/^/programs $p  /" | tee -a "$OUT/host-overlap-grid.log"; done ;;
    quant-ab) o=$(cd "$OUT" && pwd)
        QA="python3 -m benchmarks bench_quant --workloads ${QA_WORKLOADS:-base,zipf,large,mixed,dims8-192/8} \
          --batch-sizes 1024 --weight-types ${QA_TYPES:-int4,int8} --iters 30 --reps 3 --hbm-gbs 3000"
        if [ -d ab_old/tests ]; then (cd ab_old && timeout 200 python3 -m pytest -q -n 8 -p no:benchmark \
          tests/test_quant.py tests/test_quant_layers.py 2>&1 | tail -3 | tee "$o/quant-ab-tests.log"); fi
        echo "-- this tree"; timeout 190 $QA --out "$o/quant-ab-this.json" 2>&1 | grep -v Warning | tee "$o/quant-ab.log"
        echo "-- ab_old/"; (cd ab_old && timeout 190 $QA --out "$o/quant-ab-old.json" 2>&1 | grep -v Warning \
          | tee -a "$o/quant-ab.log") ;;
    forward-ab) o=$(cd "$OUT" && pwd)
        FA="python3 -m benchmarks probe_forward --seed ${FA_SEED:-20261207} --shards ${FA_SHARDS:-dlrmv2,base} --variants {}"
        for k in $(seq "${FA_ROUNDS:-1}"); do
          echo "-- this tree ($k)"; timeout 150 $FA --out "$o/forward-ab-this$k.json" 2>&1 | grep -v Warning \
            | cut -c1-160 | tee -a "$o/forward-ab.log"
          echo "-- ab_old/ ($k)"; (cd ab_old && timeout 150 $FA --out "$o/forward-ab-old$k.json" 2>&1 | grep -v Warning \
            | cut -c1-160 | tee -a "$o/forward-ab.log")
        done ;;
    launches) o=$(cd "$OUT" && pwd)
        timeout 150 python3 -m pytest -q -n 8 -p no:benchmark tests/test_histogram_auto.py tests/test_histogram.py \
          "tests/test_backward.py" -k "auto or long_chunks or task_ranges or rle or runs or chunk_tasks or histogram" \
          > "$o/launches.log" 2>&1; tail -2 "$o/launches.log"
        timeout 120 python3 tests/fuzz_kernels.py backward --gpu --seed 963000 --cases 12 2>&1 | grep -v Warning \
          | tee -a "$o/launches.log" | tail -1
        LB="python3 -m benchmarks probe_backward --seed 20261207 --variants {} \
          --shards ${LB_SHARDS:-s118,s130,s164,s083,s098,s193,s132,zipf,base,dlrmv2-hinted,smalltable}"
        LF="python3 -m benchmarks probe_forward --seed 20261207 --variants {} \
          --shards ${LF_SHARDS:-s045,s110,s118,s021,s201,smalltable,dlrmv2,fp32}"
        for side in this old; do d=.; [ $side = old ] && d=ab_old
          echo "-- $side" | tee -a "$o/launches.log"
          (cd $d && timeout 110 $LB --out "$o/launches-bwd-$side.json" 2>&1 | grep -v Warning | cut -c1-160 \
            | tee -a "$o/launches.log"; timeout 80 $LF --out "$o/launches-fwd-$side.json" 2>&1 | grep -v Warning \
            | cut -c1-160 | tee -a "$o/launches.log"); done ;;
    host-ab) o=$(cd "$OUT" && pwd)
        HB="python3 -m benchmarks host_cache --rows 1000000 --tables 8 --locations device host_cached \
          --load-factors 0.2 --out $o"
        echo "-- this tree"; timeout 150 $HB 2>&1 | grep -v Warning | tee "$o/host-ab.log"
        echo "-- ab_old/"; (cd ab_old && timeout 150 $HB 2>&1 | grep -v Warning | tee -a "$o/host-ab.log") ;;
    persistent) timeout 150 python3 -m pytest -v -n 12 -p no:benchmark tests/test_forward_kernel.py \
          -k "max_programs or persistent or mixed_dims or bag_groups or short_bag" > "$OUT/persistent-tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/persistent-tests.log" | tail -6
        timeout 200 python3 -m benchmarks probe_forward --seed 20261207 \
          --shards dlrmv2,dlrmv2-hinted,s001,s008,s041,s066,s069,s077,s110,s112,s114,s115,s130,s144,s149 \
          --variants '{"persistent_max_mean": 0}' '{}' '{"persistent_max_mean": 1000}' \
          --out "$OUT/probe-persistent-rule.json" 2>&1 \
          | grep --line-buffered shard | cut -c1-250 ;;
    fixup) timeout 130 python3 -m benchmarks probe_fixup --first 4 --out "$OUT/probe-fixup.json" 2>&1 \
          | grep -v Warning > "$OUT/fixup.log"; tail -3 "$OUT/fixup.log" | cut -c1-300
        timeout 240 python3 -m pytest -q -n 12 -p no:benchmark tests/test_forward_kernel.py tests/test_bounds.py -rfE \
          >> "$OUT/fixup.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/fixup.log" | tail -6 ;;
    kernel-tests) timeout 400 python3 -m pytest -v -n 12 -p no:benchmark tests/test_forward_kernel.py tests/test_quant.py \
          ${KT_K:+-k "$KT_K"} > "$OUT/kernel-tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel-tests.log" | tail -12 ;;
    warps-fp32) timeout 200 python3 -m benchmarks probe_forward --seed 20261203 \
          --shards s036,s068,s069,s078,s183,s199,s213,s215,fp32,s040,s046,s103,s113 \
          --variants '{"num_warps": 1}' '{}' '{"num_warps": 2}' --out "$OUT/probe-warps-fp32.json" 2>&1 \
          | grep --line-buffered -v Warning | tee "$OUT/warps-fp32.log" | cut -c1-200 ;;
    fp32-unweighted) timeout 200 python3 -m benchmarks probe_forward --seed 20261203 \
          --shards fp32,s113,s165,s046,s082,s144 \
          --variants '{}' '{"num_warps": 2}' '{"unroll": 2}' '{"num_warps": 2, "unroll": 2}' \
          --out "$OUT/probe-fp32-unweighted.json" 2>&1 | grep --line-buffered -v Warning \
          | tee "$OUT/fp32-unweighted.log" | cut -c1-200 ;;
    wide-check) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -v -n 8 -p no:benchmark \
          tests/test_forward_kernel.py tests/test_bounds.py > "$OUT/wide-check.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/wide-check.log" | tail -8
        timeout 90 python3 tests/fuzz_kernels.py forward --gpu --seed 860000 --cases 20 2>&1 | grep -v Warning \
          | tail -3 | tee -a "$OUT/wide-check.log" ;;
    merge) timeout 150 python3 -m pytest -q -p no:benchmark tests/test_forward_kernel.py \
          -k "small_launch or more_buffers" > "$OUT/merge.log" 2>&1; tail -2 "$OUT/merge.log"
        timeout 150 python3 tests/fuzz_kernels.py forward --gpu --seed 960000 --cases 24 2>&1 | grep -v Warning \
          | tee -a "$OUT/merge.log" | tail -1
        timeout 260 python3 -m benchmarks probe_forward --seed 20261207 \
          --shards s078,s159,s198,s021,s201,s186,s202,s056,s088,s136,s034,s199,s055,s230 \
          --variants '{}' '{"merge_programs": 1048576}' --out "$OUT/probe-merge.json" 2>&1 \
          | grep --line-buffered -v Warning | tee -a "$OUT/merge.log" | cut -c1-200 ;;
    quant-code) timeout 200 python3 -m benchmarks bench_quant --weight-types int4 --workloads "dims8-192/8,base" \
          --batch-sizes 16,128 --iters 30 --reps 3 --configs ";unroll=2;unroll=1" --out "$OUT/quant-code.json" 2>&1 \
          | grep -v Warning | tee "$OUT/quant-code.log" | tail -20 ;;
    merge-quant) timeout 300 python3 -m benchmarks bench_quant --weight-types int8,int4 --workloads "dims8-192/8,mixed" \
          --batch-sizes 16,128,1024 --iters 30 --reps 3 --configs ";merge_programs=1048576" \
          --out "$OUT/quant-merge-ab.json" 2>&1 | grep -v Warning | tee "$OUT/merge-quant.log" | tail -40 ;;
    wide-rows) v=('{"wide_bags": 1}' '{}' '{"wide_bags": 4}')
        for sd in 20261207:s083,s193,s109,s040,s218,s003,s013,s157,s130 20261203:s081,s097,s037,s068,s213,s013,s046,s056,s157 \
                  20261202:s117,s042,s084,s104,s179,s136,s166,s055; do
          timeout 180 python3 -m benchmarks probe_forward --seed "${sd%%:*}" --shards "${sd#*:}" --variants "${v[@]}" \
            --out "$OUT/probe-wide-rows-${sd%%:*}.json" 2>&1 | grep --line-buffered -v Warning \
            | tee -a "$OUT/wide-rows.log" | cut -c1-220; done ;;
    occupancy) timeout 200 python3 -m benchmarks probe_forward --seed 20261207 \
          --shards dlrmv2,base,zipf,fp32,smalltable,s083,s171,s118 \
          --variants '{}' '{"num_warps": 2, "tile_elems": 512}' '{"num_warps": 4, "tile_elems": 1024}' \
          --out "$OUT/probe-occupancy.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/occupancy.log" \
          | cut -c1-220 ;;
    long-block) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -n 8 -p no:benchmark \
          tests/test_backward.py tests/test_tuning_fields.py > "$OUT/long-block-tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/long-block-tests.log" | tail -8
        timeout 200 python3 -m benchmarks probe_backward --seed 20261207 \
          --shards s108,s013,s063,s157,zipf,fp32,s040,s218,s083,s098,s164,dlrmv2 \
          --variants '{"long_block": 1}' '{}' '{"num_warps": 2}' --out "$OUT/probe-long-block.json" 2>&1 \
          | grep --line-buffered -v Warning | cut -c1-220
        timeout 150 python3 -m benchmarks probe_backward --seed 20261207 \
          --shards s042,s071,s097,s109,s115,s120,s132,s148,s160,s174,s193,s203,s224,s038 \
          --variants '{}' '{"num_warps": 2}' --out "$OUT/probe-bwd-warps-wide.json" 2>&1 \
          | grep --line-buffered -v Warning | cut -c1-220
        timeout 45 python3 tests/fuzz_kernels.py backward --gpu --seed 880000 --cases 8 2>&1 | grep -v Warning \
          | tail -2 ;;
    long-warps) timeout 200 python3 -m benchmarks probe_backward --seed 20261207 \
          --shards s108,s013,s040,s218,zipf,fp32,dlrmv2,s083,s098,s164 --variants '{}' '{"long_num_warps": 2}' \
          '{"long_num_warps": 4}' '{"long_num_warps": 4, "long_block": 16}' '{"long_run": 128}' '{"long_run": 64}' \
          '{"lookups_per_step": 16}' \
          --out "$OUT/probe-long-warps.json" 2>&1 \
          | grep --line-buffered -v Warning | cut -c1-260 ;;
    narrow-ab) o=$(cd "$OUT" && pwd)
        timeout 150 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_tuning_fields.py \
          -k "narrow or rle or step_width or long_block or split_chunk" > "$o/narrow-tests.log" 2>&1
        tail -2 "$o/narrow-tests.log"
        timeout 100 python3 tests/fuzz_kernels.py backward --gpu --seed 933000 --cases 20 2>&1 | grep -v Warning \
          | tail -1 | tee -a "$o/narrow-tests.log"
        PB="python3 -m benchmarks probe_backward --seed 20261207"
        timeout 250 $PB --shards "${SW_SHARDS:-s096,s000,s037,s138,s136,s016,s024,s115,s129,s119,s106,s192,s143,s135,s064,s036,s123,s063,s164,zipf}" \
          --variants '{}' '{"step_width": 128}' --out "$o/probe-step-width.json" 2>&1 | grep -v Warning | tail -25
        (cd ab_old && timeout 100 $PB --shards "${RLE_SHARDS:-s096,s000,s129,s064,s036,s123,s143,s063,zipf}" \
          --variants '{}' --out "$o/probe-rle-old.json" 2>&1 | grep -v Warning | tail -14) ;;
    rle-fill) timeout 120 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py \
          -k "rle or task_ranges or config_variants or narrow" > "$OUT/rle-fill.log" 2>&1; tail -2 "$OUT/rle-fill.log"
        timeout 100 python3 tests/fuzz_kernels.py backward --gpu --seed 935000 --cases 30 2>&1 | grep -E "cases|FAIL|ERROR" \
          | tail -2 | tee -a "$OUT/rle-fill.log"
        timeout 240 python3 -m benchmarks probe_backward --seed 20261207 \
          --shards "${RF_SHARDS:-s096,s000,s143,s129,s064,s036,s123,s063,s042,s037,s083,zipf,base}" \
          --variants '{}' '{"rle_fill": true}' --out "$OUT/probe-rle-fill.json" 2>&1 | grep -v Warning | tail -14 ;;
    step-width) timeout 200 python3 -m benchmarks probe_step_width --out "$OUT/probe-step-width-diag.json" 2>&1 \
          | grep -v Warning | tee "$OUT/step-width.log" ;;
    backward-tests) timeout 330 python3 -m pytest -q -n 8 -p no:benchmark tests/test_backward.py tests/test_optimizers.py \
          tests/test_grad.py > "$OUT/backward-tests.log" 2>&1; tail -3 "$OUT/backward-tests.log"
        timeout 150 python3 tests/fuzz_kernels.py backward --gpu --seed 931000 --cases 40 2>&1 | grep -E "cases|FAIL|ERROR" \
          | tail -2 | tee -a "$OUT/backward-tests.log" ;;
    backward-fuzz) timeout 200 python3 tests/fuzz_kernels.py backward --gpu --seed 931000 --cases 40 2>&1 \
          | grep -E "cases|FAIL|ERROR" | tail -3 | tee "$OUT/backward-fuzz.log" ;;
    sort-enqueue) timeout 200 python3 -m benchmarks probe_backward --seed 20261207 --enqueued \
          --shards s193,s138,s024,s016,s071,s179,s037,s203 \
          --variants '{}' '{"rank_sort_max": 65536}' '{"rank_sort_max": 131072}' --out "$OUT/probe-sort-enqueue.json" \
          2>&1 | grep --line-buffered -v Warning | cut -c1-260 ;;
    wide-rows-bwd) timeout 240 python3 -m benchmarks probe_backward --seed 20261207 \
          --shards s083,s193,s164,s098,s063,s108,s003,s157,s013 --variants '{}' '{"num_warps": 2}' '{"num_warps": 4}' \
          --out "$OUT/probe-wide-rows-bwd.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/wide-rows-bwd.log" \
          | cut -c1-220 ;;
    pallas-gemm) timeout 240 python3 -m benchmarks probe_pallas_gemm --batch-size 65536 \
          --out "$OUT/probe-pallas-gemm.json" 2>&1 | grep --line-buffered -v Warning | tee "$OUT/pallas-gemm.log" \
          | cut -c1-300 ;;
    cpu-gather) timeout 120 python3 -m benchmarks probe_cpu_gather --out "$OUT/probe-cpu-gather.json" 2>&1 \
          | grep -v Warning | tee "$OUT/cpu-gather.log" | tail -14 ;;
    host-admit) for age in 0 16; do timeout 120 python3 -m benchmarks host_cache --rows 1000000 --tables 8 \
          --locations host_cached --alphas 1.2 1.05 --load-factors 0.2 --admit-age $age --out "$OUT" 2>&1 \
          | grep -v Warning | tee -a "$OUT/host-admit.log"; done ;;
    host-fbgemm) timeout 300 python3 -m benchmarks fbgemm_cache --rows 1000000 --tables 8 --out "$OUT" 2>&1 \
        | grep -v Warning | tee "$OUT/host-fbgemm.log" ;;
    host-big) timeout 560 python3 -m benchmarks host_cache --tables 16 --rows "${HOST_BIG_ROWS:-44000000}" \
          --locations device planned \
          --baseline-rows 4000000 --hbm-budget-gb "${HBM_BUDGET_GB:-120}" --alphas 1.05 --load-factors 0.2 \
          --fresh-batches --warmup-steps 400 --iters 16 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/host-big.log" ;;
    sharding) n=$(nvidia-smi -L | wc -l)
        if [ "$n" -lt 2 ]; then echo "sharding needs 2+ GPUs, found $n"; continue; fi
        timeout 200 python3 -m pytest -q -n 4 -p no:benchmark tests/test_sharding.py tests/test_tt_sharding.py \
          tests/test_sharded_layers.py tests/test_tt_sharded_layers.py tests/test_dlrm_sharded.py \
          tests/test_sharded_input_errors.py tests/test_sharding_host.py > "$OUT/sharding-tests.log" 2>&1
        tail -3 "$OUT/sharding-tests.log"
        timeout 200 python3 -m benchmarks sharding --weak --capacity-fracs 1,feature --out "$OUT" 2>&1 \
          | grep -v Warning | tee "$OUT/sharding.log" | tail -8 ;;
    dcnv2) for run in ${DCNV2_RUNS:-65536:float32 16384:float32}; do IFS=: read -r b dt mp <<< "$run"; mp=${mp:-tensorfloat32}
          dump=""; [ -f /tmp/dlrmv2_b$b/meta.json ] || dump="--dump /tmp/dlrmv2_b$b --dump-batches 4"
          timeout 280 python3 -m benchmarks dlrm_model --model dcnv2 --size mlperf --batch-size "$b" --emb-dtype "$dt" \
            --matmul-precision "$mp" --steps 30 $dump --out "$OUT/dlrm_model-b$b-$dt-$mp.json" 2>&1 \
            | grep -v Warning >> "$OUT/dcnv2.log"
          tail -4 "$OUT/dcnv2.log"; done ;;
    dcnv2-torch) for run in ${DCNV2_RUNS:-65536:float32 16384:float32}; do IFS=: read -r b dt mp <<< "$run"
          mp=${mp:-tensorfloat32}
          timeout 280 python3 benchmarks/dlrm_torch.py --batches /tmp/dlrmv2_b$b --emb-dtype "$dt" --emb-init torchrec \
            --matmul "$mp" --out "$OUT/dlrm_torch-b$b-$dt-$mp.json" 2>&1 | grep -v Warning >> "$OUT/dcnv2.log"
          tail -4 "$OUT/dcnv2.log"; done ;;
    quant) timeout 560 python3 -m benchmarks bench_quant --shards "${QUANT_SHARDS:-10}" --out "$OUT/bench-quant.json" \
          --weight-types "${QUANT_TYPES:-int8,int4}" \
          2>&1 | grep -v Warning > "$OUT/quant.log"; tail -5 "$OUT/quant.log" ;;
    quant-fbgemm) timeout 150 python3 -m benchmarks fbgemm_quant --check --out "$OUT/fbgemm-quant-check.json" \
          2>&1 | grep -v Warning > "$OUT/quant-fbgemm.log"
        timeout 270 python3 -m benchmarks fbgemm_quant --time --shards "${QUANT_SHARDS:-10}" \
          --out "$OUT/fbgemm-quant-time.json" 2>&1 | grep -v Warning >> "$OUT/quant-fbgemm.log"; tail -5 "$OUT/quant-fbgemm.log" ;;
    sharding-host) n=$(nvidia-smi -L | wc -l)
        if [ "$n" -lt 2 ]; then echo "sharding-host needs 2+ GPUs, found $n"; continue; fi
        timeout 300 python3 -m benchmarks sharding --weak --locations device,host_cached --alpha 1.2 \
          --cache-load-factor 0.2 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/sharding-host.log" | tail -8 ;;
    *) echo "unknown stage $stage (stages: tests presets fbgemm-smoke sweep sweep-ours sweep-fbgemm optimizers tt dlrm features dcnv2 dcnv2-torch quant quant-fbgemm fixup merge merge-quant quant-code launches host host-bench host-tests host-quick host-profile host-fills host-overlap host-overlap-grid kernel-tests warps-fp32 fp32-unweighted long-block long-warps backward-tests sort-enqueue pallas-gemm cpu-gather quant-ab host-ab host-admit host-fbgemm host-big sharding sharding-host)" ;;
  esac
done
