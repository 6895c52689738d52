#!/usr/bin/env bash
# Issue 13's whole GPU check in one run (~8 minutes on an H200): every target of the issue, each
# figure beside its baseline in the same process where the issue asks for a ratio. Writes under $OUT
# (unset: each JSON in its script's --out_dir default, a folder of experiments/results/, the log in experiments/results):
#   profile_step_<preset>.json    resident and cached (24 GB) decode, batch 1 and 4, one process: its
#                                 "targets" hold resident step / HBM floor and cached / (resident + misses / B_P)
#   bench_decode_<preset>.json    decode tokens/s at 8 GB with --cache_policy=lookahead, batch 1
#   check_identity_gpu.json       resident vs cached logits bit for bit (bf16 fixtures)
#   check_kernels_gpu.json        the decode attention's prologue / epilogue kernels and the slot lookup vs their jnp paths, and the
#                                 16-layer resident 8192-token prefill (XLA vs the flash kernels)
# and one log of all four scripts, check_issue13_gpu.log (one log rather than one per script keeps the output to
# five files). Usage (from the repository root):
#   bash experiments/check_issue13_gpu.sh
# The decode steps run with GEMM autotuning off (DECODE_XLA_FLAGS; the 2026-12-02 decode tables used it), the prefill
# with XLA's defaults: autotuning off made the 8192-token prefill 3.9x slower (0.363 s vs 0.092 s, 2026-12-02).
# KERNEL_ARGS (e.g. "--kernels=xla" or "--kernel_tiles=moe_decode:64/64/4/4") go to the three scripts whose engines
# run with the kernel flags' KernelConfig (check_kernels_gpu sets its own configs); nothing reads FTJAX_* variables.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-experiments/results}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
decode_flags="${DECODE_XLA_FLAGS:---xla_gpu_autotune_level=0}"
step() {  # name timeout_s xla_flags script args...
  local name=$1 limit=$2 flags=$3; shift 3
  echo "== $name"
  local log="$TMPDIR_LOGS/$name.log"
  XLA_FLAGS="$flags" timeout "$limit" python3 "$@" ${OUT:+--out_dir="$OUT"} > "$log" 2>&1
  local rc=$?
  { echo "== $name rc=$rc"; cat "$log"; } >> "$out/check_issue13_gpu.log"
  echo "$name rc=$rc"
  grep -v -E "^[IWE][0-9]{4} " "$log" | tail -4
}
TMPDIR_LOGS=$(mktemp -d)
: > "$out/check_issue13_gpu.log"
kernel_args=(${KERNEL_ARGS:-})
step profile_step 240 "$decode_flags" experiments/profile_step.py --prefill_repeats=0 --runs=resident_decode,cached_decode \
  --batches=1,4 ${kernel_args[@]+"${kernel_args[@]}"}
step bench_decode 130 "$decode_flags" experiments/bench_decode.py --modes=cached --cache_policies=lookahead --batches=1 \
  --steps=64 --vram_budget_gb=8 ${kernel_args[@]+"${kernel_args[@]}"}
step check_identity_gpu 80 "$decode_flags" experiments/check_identity_gpu.py --variants=cached_S=E,cached_S=2E \
  ${kernel_args[@]+"${kernel_args[@]}"}
step check_kernels_gpu 150 "${XLA_FLAGS:-}" experiments/check_kernels_gpu.py --sections=rope_cache,slot_lookup,e2e_prefill \
  --time_budget_s=140
