#!/usr/bin/env bash
# The H200 runs that close the open issues, in two calls that each fit a 10-minute device
# command.  Logs and JSON go under ${OUT:-/tmp/flashgen-gpu}; the last lines printed are
# the summary lines to paste.
#
#   tools/gpu_session.sh validate   # pytest -m gpu (both kernel families, both backward
#                                   # paths' GPU tests) and compute-sanitizer, every spec
#   tools/gpu_session.sh measure    # FA2-class sweep, Hopper sweep, gallery, bench --quick
#
# Needs a CUDA GPU, torch, CuPy, triton, nvcc and compute-sanitizer (the lent H200 has
# them; lark comes from ../shared/tools/device-prep.sh's wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/flashgen-gpu}
mkdir -p "$out"
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/flashgen-cache} PYTHONUNBUFFERED=1

summary() { grep -E "$2" "$out/$1" | tail -n "${3:-1}" | sed "s|^|$1: |"; }

case "${1:-}" in
validate)
    timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
        --deselect tests/gpu/test_sanitizer.py > "$out/gpu.log" 2>&1
    FLASHGEN_ATOMIC_DQ=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/gpu/test_backward_kernels.py tests/gpu/test_varlen_gpu.py -k "backward or atomic" \
        > "$out/gpu_atomic.log" 2>&1
    timeout 150 python3 tools/sanitize.py --jobs 16 --timeout 140 --json "$out/sanitize.json" \
        > "$out/sanitize.log" 2>&1
    summary gpu.log "passed|failed"
    summary gpu_atomic.log "passed|failed"
    summary sanitize.log "clean|dirty|fail" 1
    ;;
measure)
    timeout 280 python3 tools/perf_sweep.py --json "$out/perf_sweep.json" > "$out/perf_sweep.log" 2>&1
    timeout 80 python3 tools/hopper_sweep.py --json "$out/hopper_sweep.json" > "$out/hopper.log" 2>&1
    timeout 90 python3 tools/gallery.py --budget 60 --out "$out/gallery.md" \
        --json "$out/gallery.json" > "$out/gallery.log" 2>&1
    timeout 130 python3 -m flashgen bench --quick --no-memory --no-variants --out "$out/bench" \
        > "$out/bench.log" 2>&1
    tail -n 25 "$out/perf_sweep.log"
    grep TFLOP "$out/hopper.log"
    grep -E "speedup|wrote" "$out/gallery.log"
    tail -n 8 "$out/bench.log"
    ;;
*)
    echo "usage: $0 validate|measure" >&2
    exit 2
    ;;
esac
