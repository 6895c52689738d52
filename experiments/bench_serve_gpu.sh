#!/usr/bin/env bash
# The serving benchmarks (experiments/bench_serve.py) on one GPU machine, one stage per call so that each
# fits a 10-minute command; JSON and logs under $OUT (else experiments/results/serve).
#   bash experiments/bench_serve_gpu.sh resident     # concurrency 1,2,4,8 + HTTP server overhead, resident experts
#   bash experiments/bench_serve_gpu.sh cached       # concurrency with an 8 GB expert cache (lookahead policy)
#   bash experiments/bench_serve_gpu.sh multiround   # 4 users x 16k-token contexts, with and without KV reuse
# The serving dependencies come as wheels from .whl/ where the machine has no index (experiments/carried_wheels.sh);
# BENCH_ARGS go to bench_serve.py; TAG (optional)
# goes into the JSON's name, e.g. TAG=norun-ahead BENCH_ARGS=--norun_ahead bash experiments/bench_serve_gpu.sh resident
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-experiments/results/serve}"; mkdir -p "$out"
source experiments/carried_wheels.sh
export PYTHONUNBUFFERED=1
day="$(date -u +%F)"; lim="${STAGE_LIMIT_S:-560}"; tag="${TAG:+_$TAG}"
case "${1:?stage: resident | cached | multiround}" in
  resident) args=(--part=concurrency,server_overhead --modes=resident --out="$out/bench_serve_qwen3-30b-a3b_resident${tag}_h200_$day.json") ;;
  cached) args=(--part=concurrency --modes=cached --vram_budget_gb=8 --cache_policy=lookahead --max_tokens=32
                --out="$out/bench_serve_qwen3-30b-a3b_cached-8gb${tag}_h200_$day.json") ;;
  multiround) export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115
              args=(--part=multiround --modes=resident --kv_host_gb=12 --out="$out/bench_serve_qwen3-30b-a3b_multiround-16k${tag}_h200_$day.json") ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
timeout -s INT "$lim" python3 experiments/bench_serve.py "${args[@]}" ${BENCH_ARGS:-} 2>&1 \
  | grep --line-buffered -v -E "libtpu|TPU" > "$out/bench_serve_$1${tag}.log"
echo "rc=${PIPESTATUS[0]}"; tail -n 40 "$out/bench_serve_$1${tag}.log"
