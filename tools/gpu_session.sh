#!/usr/bin/env bash
# The H200 runs that close the open issues, in calls that each fit a 10-minute device
# command.  Logs and JSON go under ${OUT:-/tmp/flashgen-gpu}; the last lines printed are
# the summary lines to paste.
#
#   tools/gpu_session.sh tests      # pytest -m gpu, both kernel families, without session 5's
#                                   # new tests (`tests2`) and the persistent ones (`branches`)
#   tools/gpu_session.sh tests2     # session 5's new GPU tests (row/column terms, h_kv, user specs)
#   tools/gpu_session.sh branches   # the persistent schedulers' tests and off/on A/B, the
#                                   # row/column-term A/Bs (document_mask: Hopper forward,
#                                   # FA2-class forward and backward), ~9 min
#   tools/gpu_session.sh measure    # compute-sanitizer (4 tools, every spec, fwd + bwd),
#                                   # flashgen bench --quick, the gallery, ~8 min
#   tools/gpu_session.sh fa2        # the FA2-class forward against FA2 and cuDNN (issue 4), the
#                                   # backward at d256, deterministic and not, against FA2 / cuDNN
#   tools/gpu_session.sh atomic     # the atomic-dQ backward's GPU tests (FLASHGEN_ATOMIC_DQ=1)
#   tools/gpu_session.sh profile    # ncu of the gallery masks' Hopper forwards side by side
#
# The A/B steps are `flashgen ab` runs (flashgen/bench/ab.py): its --option names are the
# fields of flashgen.Options (`python3 -m flashgen ab --list-options` prints them), each
# writes ab.json / ab.md under $out.  FLASHGEN_* settings pass through to every step.
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
    # the persistent schedulers against none: document_mask next to FlexAttention, dense
    # causal / non-causal at 16k next to cuDNN (was tools/persistent_bench.py)
    timeout 90 python3 -m flashgen ab document_mask --option persistent=none,static,dynamic,m_major \
        --peers flex --timer do_bench --rounds 3 --out "$out/ab_persistent_doc" \
        > "$out/ab_persistent_doc.log" 2>&1
    timeout 90 python3 -m flashgen ab causal_d128 bidir_d256 gpt2_d64 --shapes 16384 \
        --option persistent=none,static,dynamic,m_major --peers sdpa_cudnn --timer do_bench \
        --rounds 3 --out "$out/ab_persistent_dense" > "$out/ab_persistent_dense.log" 2>&1
    # the mask's tensor reads as row / column terms or per element: the Hopper forward next to
    # FlexAttention, the FA2-class forward and backward, the atomic-dQ backward
    # (was tools/rowcol_bench.py, tools/rowcol80_bench.py --atomic)
    timeout 70 python3 -m flashgen ab document_mask --option side_terms=1,0 --peers flex \
        --out "$out/ab_side_terms" > "$out/ab_side_terms.log" 2>&1
    timeout 90 python3 -m flashgen ab document_mask --option family=fa2 --option side_terms=1,0 \
        --option atomic_dq=0,1 --direction fwd,bwd --deterministic 0 --timer do_bench \
        --out "$out/ab_side_terms_fa2" > "$out/ab_side_terms_fa2.log" 2>&1
    summary gpu_persistent.log "passed|failed"
    tail -n 10 "$out/ab_persistent_doc.log"
    tail -n 24 "$out/ab_persistent_dense.log"
    tail -n 8 "$out/ab_side_terms.log"
    tail -n 16 "$out/ab_side_terms_fa2.log"
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
    # the FA2-class forward against FA2 and cuDNN, both dtypes (gpt2_d64 is fp16)
    timeout 170 python3 -m flashgen ab gpt2_d64 causal_d128 bidir_d256 --option family=fa2 \
        --shapes 4096 8192 16384 --peers sdpa_flash,sdpa_cudnn --timer do_bench --rounds 3 \
        --out "$out/ab_fa2" > "$out/ab_fa2.log" 2>&1
    # the backward at d256: deterministic and not (the Hopper backward on sm_90), FA2, cuDNN
    # (was tools/bwd_bench.py --dims 256)
    timeout 120 python3 -m flashgen ab bidir_d256 --shapes 16384 --deterministic 1,0 \
        --direction bwd,fwd_bwd --peers sdpa_flash,sdpa_cudnn --timer do_bench --rounds 3 \
        --out "$out/ab_bwd_d256" > "$out/ab_bwd_d256.log" 2>&1
    tail -n 30 "$out/ab_fa2.log"
    tail -n 12 "$out/ab_bwd_d256.log"
    ;;
profile)
    timeout 300 ncu --kernel-name regex:fwd_sm_90 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --csv --page details \
        --metrics smsp__inst_executed_pipe_fp64.sum,smsp__inst_executed.sum,gpu__time_duration.sum \
        python3 -m flashgen ab causal_d128 chunked_local prefix_lm mistral_swa document_mask \
        --shapes 2x16x8192 --rounds 0 --no-check --out "$out/ab_profile" \
        > "$out/ncu_masks.csv" 2> "$out/ncu_masks.err"
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
