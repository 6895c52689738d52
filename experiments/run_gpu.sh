#!/usr/bin/env bash
# One GPU check: runs the benchmark scripts named as arguments (default: bench_decode) and writes their
# JSON (and logs) under $OUT when it is set, else each JSON in its script's --out_dir default (the figure's
# folder of experiments/results/) and the logs in experiments/results.
#   bash experiments/run_gpu.sh profile_step                 # where a decode step's time goes (issue 13)
#   BENCH_ARGS="--expert_dtypes=bfloat16,int8" bash experiments/run_gpu.sh bench_prefill
# BENCH_ARGS go to every script named: give it only flags they all take. The kernel choices are flags of every
# script that builds engines (as ftjax.generate's; nothing reads FTJAX_* variables), e.g.
#   BENCH_ARGS="--kernels=xla" bash experiments/run_gpu.sh bench_decode bench_prefill
#   BENCH_ARGS="--kernel_tiles=moe_decode:64/64/4/4 --min_dot_rows=4" bash experiments/run_gpu.sh profile_step
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-experiments/results}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
for bench in "${@:-bench_decode}"; do
  echo "== $bench"
  python3 "experiments/$bench.py" ${OUT:+--out_dir="$OUT"} ${BENCH_ARGS:-} 2>&1 | grep --line-buffered -v -E "libtpu|TPU" | tee "$out/$bench.log"
done
