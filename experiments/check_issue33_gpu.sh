#!/usr/bin/env bash
# Issue 33's decode-speed check on one GPU machine, one stage per call (each fits a 10-minute command); JSON
# and log under $OUT (else experiments/results/decode_speed).
#   bash experiments/check_issue33_gpu.sh 16    # the side-by-side shape cut to 16 layers
#   bash experiments/check_issue33_gpu.sh 48    # the whole 48 layers (cached rows generate 64 tokens)
# BENCH_ARGS go to bench_decode_speed.py; TAG (optional) goes into the JSON's name.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-experiments/results/decode_speed}"; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
lim="${STAGE_LIMIT_S:-570}"; tag="${TAG:+-$TAG}"
case "${1:?stage: 16 | 48}" in
  16) args=(--layers=16 --tag="16l${tag}_h200_$(date -u +%F)") ;;
  48) args=(--layers=48 --cached_steps=64 --tag="48l${tag}_h200_$(date -u +%F)") ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
timeout -s INT "$lim" python3 experiments/bench_decode_speed.py --out_dir="$out" "${args[@]}" ${BENCH_ARGS:-} 2>&1 \
  | grep --line-buffered -v -E "libtpu|TPU|profiler.py" > "$out/check_issue33_$1${tag}.log"
echo "rc=${PIPESTATUS[0]}"; tail -n 30 "$out/check_issue33_$1${tag}.log"
