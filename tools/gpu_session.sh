#!/usr/bin/env bash
# The H200 runs that close the open issues, in calls that each fit a 10-minute device
# command.  Logs and JSON go under ${OUT:-/tmp/flashgen-gpu}; the last lines printed are
# the summary lines to paste.
#
#   tools/gpu_session.sh tests      # pytest -m gpu, both kernel families, without session 5's
#                                   # new tests (`tests2`) and the persistent ones (`branches`)
#   tools/gpu_session.sh tests2     # session 5's new GPU tests (row/column terms, h_kv, user specs)
#   tools/gpu_session.sh branches   # the persistent schedulers' tests and off/on bench, the
#                                   # row/column-term benches (document_mask: Hopper forward,
#                                   # FA2-class forward and backward), ~9 min
#   tools/gpu_session.sh measure    # compute-sanitizer (4 tools, every spec, fwd + bwd),
#                                   # flashgen bench --quick, the gallery, ~8 min
#   tools/gpu_session.sh fa2        # the FA2-class forward against FA2 and cuDNN (issue 4), the
#                                   # Hopper backward at d256 against FA2 / cuDNN
#   tools/gpu_session.sh atomic     # the atomic-dQ backward's GPU tests (FLASHGEN_ATOMIC_DQ=1)
#   tools/gpu_session.sh profile    # ncu of the gallery masks' Hopper forwards side by side
#
# FLASHGEN_PERSISTENT and other FLASHGEN_* settings pass through to every step.
# Needs a CUDA GPU, torch, CuPy, triton, nvcc and compute-sanitizer (the lent H200 has
# them; lark comes from ../shared/tools/device-prep.sh's wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/flashgen-gpu}
mkdir -p "$out"
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/flashgen-cache} PYTHONUNBUFFERED=1

summary() { grep -E "$2" "$out/$1" | tail -n "${3:-1}" | sed "s|^|$1: |"; }

case "${1:-}" in
tests)
    # the suite as of session 4 plus its pending items (the >2**31 backward, the score_mod fold)
    timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=15 \
        --ignore tests/gpu/test_sanitizer.py --ignore tests/gpu/test_persistent_gpu.py \
        --ignore tests/gpu/test_user_specs_gpu.py -k "not row_and_column_terms" \
        > "$out/gpu.log" 2>&1
    summary gpu.log "passed|failed"
    ;;
tests2)
    # session 5's new GPU tests: user specs (float masks, dsplit 4, GQA index warning, h_kv),
    # the FA2-class row/column-term backward (both paths) and the Hopper/FA2 forward terms
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rf --durations=15 \
        tests/gpu/test_user_specs_gpu.py tests/gpu/test_docmask.py \
        tests/gpu/test_mask_sparsity.py -k "row_and_column_terms or user or kv_head or float" \
        > "$out/gpu2.log" 2>&1
    FLASHGEN_ATOMIC_DQ=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/gpu/test_mask_sparsity.py -k row_and_column_terms > "$out/gpu2_atomic.log" 2>&1
    summary gpu2.log "passed|failed"
    summary gpu2_atomic.log "passed|failed"
    ;;
branches)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_persistent_gpu.py \
        > "$out/gpu_persistent.log" 2>&1
    timeout 140 python3 tools/persistent_bench.py --json "$out/persistent_bench.json" \
        > "$out/persistent_bench.log" 2>&1
    timeout 80 python3 tools/rowcol_bench.py --json "$out/rowcol_bench.json" \
        > "$out/rowcol_bench.log" 2>&1
    timeout 100 python3 tools/rowcol80_bench.py --atomic --json "$out/rowcol80_bench.json" \
        > "$out/rowcol80_bench.log" 2>&1
    summary gpu_persistent.log "passed|failed"
    tail -n 20 "$out/persistent_bench.log"
    tail -n 8 "$out/rowcol_bench.log"
    tail -n 12 "$out/rowcol80_bench.log"
    ;;
measure)
    # forward and backward kernels of every spec under the 4 tools (~2x the forward-only time)
    timeout 180 python3 tools/sanitize.py --jobs 16 --timeout 170 --json "$out/sanitize.json" \
        > "$out/sanitize.log" 2>&1
    timeout 220 python3 -m flashgen bench --quick --budget-s 200 --out "$out/bench" \
        > "$out/bench.log" 2>&1
    timeout 90 python3 tools/gallery.py --budget 70 --out "$out/gallery.md" \
        --json "$out/gallery.json" > "$out/gallery.log" 2>&1
    summary sanitize.log "clean|dirty|fail" 1
    tail -n 6 "$out/bench.log"
    grep -E "speedup|wrote" "$out/gallery.log"
    ;;
fa2)
    FLASHGEN_KERNEL_FAMILY=fa2 timeout 150 python3 -m flashgen bench --fwd-only --no-variants \
        --no-memory --seqlen 4096,8192,16384 --dtype bf16,fp16 --impl flashgen,sdpa_flash,sdpa_cudnn \
        --budget-s 130 --out "$out/bench_fa2" > "$out/bench_fa2.log" 2>&1
    timeout 120 python3 tools/bwd_bench.py --skip-tests --skip-sanitizer --dims 256 \
        --json "$out/bwd_bench_d256.json" > "$out/bwd_bench_d256.log" 2>&1
    tail -n 6 "$out/bench_fa2.log"
    tail -n 12 "$out/bwd_bench_d256.log"
    ;;
profile)
    timeout 300 ncu --kernel-name regex:fwd_sm_90 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --csv --page details \
        --metrics smsp__inst_executed_pipe_fp64.sum,smsp__inst_executed.sum,gpu__time_duration.sum \
        python3 tools/profile_masks.py > "$out/ncu_masks.csv" 2> "$out/ncu_masks.err"
    grep -E '"(Duration|Executed Instructions|Issue Slots Busy|No Eligible|Warp Cycles Per Issued Instruction|Registers Per Thread|smsp__inst_executed_pipe_fp64.sum)"' \
        "$out/ncu_masks.csv" | cut -d, -f5,12- | head -40
    ;;
atomic)
    # the atomic-dQ backward's GPU tests (skipped by the default run; they compile many units)
    FLASHGEN_ATOMIC_DQ=1 timeout 540 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/gpu/test_backward_kernels.py tests/gpu/test_varlen_gpu.py \
        tests/gpu/test_mask_sparsity.py -k "backward or atomic" > "$out/gpu_atomic.log" 2>&1
    summary gpu_atomic.log "passed|failed"
    ;;
*)
    echo "usage: $0 tests|tests2|branches|measure|fa2|atomic|profile" >&2
    exit 2
    ;;
esac
