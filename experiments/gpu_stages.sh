#!/usr/bin/env bash
# GPU stages for one machine call: each stage runs under a hard time limit (SIGINT, then SIGKILL 15 s later:
# a hang inside XLA never returns to Python, so SIGINT alone does not end it) and writes its JSON and log
# under $OUT (else each script's default folder and /tmp). Stages run in the order named:
#   bash experiments/gpu_stages.sh serve-blocks miss-copy cpu-experts
# decode-b4-probe: the Gated DeltaNet decode stage at B = 4, dumping Python's stacks if it hangs (SIGABRT)
# serve-blocks:    bench_serve, resident, concurrency 1 and 4, decode blocks 1 and 16 (issue 31's 3x target)
# serve-onestep:   bench_serve, resident, the one-step path (decode block 1), 32 requests per level, run-ahead on
#                  then off (the 2026-12-03 setting: is the one-step TPOT back at 8.1-8.6 ms?)
# serve-cached-blocks: bench_serve, cached at 8 GB, concurrency 1 and 4, decode blocks 1 and 16 (issue 31's 2x)
# serve-http-blocks: bench_serve's server overhead (HTTP vs direct) with decode blocks of 16 (needs the serving wheels
#                  in .whl/, carried: experiments/carried_wheels.sh)
# profile-b4:      profile_step, resident decode at batch 1 and 4: where a 4-row step's extra time goes (issue 31's
#                  3x: the experts category against its byte floor)
# multiround:      bench_serve's multi-round QA (4 users x 16k context), with and without KV reuse
# miss-copy:       bench_miss_copy (issue 33, misses at the link's speed)
# cpu-experts:     bench_cpu_experts (issue 33, the CPU as a second link)
# miss-host:       bench_miss_policy at 8 GB, native_async reached through callbacks and through the host-split
#                  driver (issue 33's 48-layer offload and adaptive-split targets)
# miss-host-graphs: the host-split driver with its per-layer programs as CUDA graphs (--decode_graphs=on), beside
#                  fetch-only: does it cut the front / device dispatch phases (0.78 / 0.30 ms a layer on an H100)?
# gdn-model:       bench_gated_delta's 16-layer model stage: resident 8192-token prefill TTFT and compile with the MoE
#                  prefill on the Mosaic kernel (the default before 2026-12-05), on grouped_matmul_triton over a
#                  gathered layer (auto at a733c60), auto (since: reading the pool in place, grouped_matmul_pool) and
#                  with grouped_swiglu_triton named (the one-tile config, before 3373cb2: auto-one-tile; left out
#                  since 2026-12-05) (issue 32's TTFT);
#                  the resident decode with and without the decode block as a CUDA graph (decode_graphs=on) (the
#                  zero-centred norms fused into their projections, auto+offset-norms, are auto since 2026-12-05)
# gmm-tiles:       bench_grouped_matmul: one prefill layer's grouped expert FFN by piece (the default kernels), the
#                  Mosaic GPU grouped matmul at its default and two best tiles of 2026-12-05, and six configs of the
#                  grouped_matmul_triton kernel around its default, at the qwen3.5 (256 x 512) and qwen3 (128 x 768)
#                  expert shapes, and the fused gate-up + SwiGLU kernel against its three-step chain (issue 32's MoE
#                  prefill; is the Triton kernel faster at 128 experts too?)
# gmm-order:       bench_grouped_matmul's Triton configs at both expert shapes with the programs in the two-axis grid
#                  order (group_m 0) and in bands of group_m row tiles (grouped_matmul_triton.GROUP_M: rows and weights
#                  shared in L2 by programs that run together), for the plain matmuls and the fused gate-up + SwiGLU
# gmm-batched:     bench_grouped_matmul at the qwen3.5 expert shape: the Triton kernel's defaults beside XLA's batched
#                  matmul over 256 groups padded to the largest and one dense matmul of the same rows (what cuBLAS
#                  reaches there: is a padded-capacity layout worth building? issue 32's TTFT)
# gdn-model-order: bench_gated_delta's 16-layer model stage (TTFT only): auto (the fused gate-up + SwiGLU kernel auto
#                  since 2026-12-06), without it (auto-unfused), and both expert matmuls at group_m 4, 8, 16 (issue
#                  32's TTFT)
# gdn-rule-bits:   bench_gated_delta's rule stage: the scan kernel with float32 operands (the default) and with 16-bit
#                  q, k and scores (gated_delta.OPERAND_BITS) at one and two pipeline stages, then the solve kernel's
#                  diagonal blocks of 8 and 16 rows (issue 32's Gated DeltaNet prefill)
# gdn-quick:       gdn-model-order's main rows in one model build (3 repeats): TTFT of auto, auto-unfused and both
#                  expert matmuls at group_m 8; resident decode of auto and auto+mixer-kernel (gated_deltanet_decode
#                  named: a decode token's Gated DeltaNet mixer in one launch)
# gdn-solve-form:  bench_gated_delta's 16-layer model TTFT (3 repeats) with the solve kernel's blocked form (auto) and
#                  its masked form (the default before 2026-12-06: 19 masked three-pass [64, 64] dots a chunk), without
#                  the down matmul's pair-order store (auto-gather-out) and with jax's Mosaic GPU attention in prefill
#                  (flash_prefill=mgpu); then its rule stage at the scan kernel's default tiles with each solve form
#                  (blocked: row blocks of 16 or 32) at 4 and 8 warps (issue 32's TTFT)
# gdn-attention:   bench_gated_delta's 16-layer model TTFT (3 repeats) with the Pallas flash prefill in its cache of
#                  8192 + 16 rows (masked last key block: it ran the jnp reference before 2026-12-06), with jax's Mosaic
#                  GPU attention (flash_prefill=mgpu), and the solve kernel's blocked form at 32-row blocks
# flash-auto:      flash_prefill auto (jax's Mosaic GPU attention for prefill calls from 0 on Hopper, the Pallas kernel
#                  for the others; the default since 2026-12-06) against pallas and mgpu: bench_gated_delta's 16-layer
#                  TTFT, check_kernels_gpu's qwen3 16-layer resident prefill (logits against XLA's attention), and
#                  check_reuse_gpu's bf16 case (prefix reuse: the reusing request's calls start past 0 and take the
#                  Pallas kernel; on a GPU the float32 cases take XLA's attention)
# hybrid-compile:  the hybrid engine's compile at batch 1 with the auto kernels, with none (--kernels=xla: the grouped
#                  matmul still jax's Mosaic kernel), and with no Mosaic kernel either (--grouped_matmul=xla): where the
#                  40-44 s compile of a 4-layer cut goes (issue 32's compile time)
# hybrid-stream:   bench_prefill, qwen3.5-35b-a3b (40 layers) at 24 GB, an 8192-token prompt streamed on the
#                  layer-pipelined driver (per layer kind), on the block scan (1.82x its copy bound on 2026-11-30)
#                  and resident (issue 32's streamed-prefill target: <= 1.0x the copy bound)
# decode-loop:     bench_decode_loop: generate's decode blocks with a fixed trip count (KernelConfig.decode_loop fixed;
#                  auto's choice without EOS ids since 2026-12-06) against the loop ending on its data-dependent
#                  predicate, resident, at the qwen3.5-35b-a3b 16-layer cut (batch 1; then with an EOS after 40
#                  tokens), qwen3-30b-a3b at 16 layers (batch 1 and 4) and at 48 layers (batch 1 and 4; issue 33)
# decode-targets:  the decode targets of issues 32 and 33 in one call (under 600 s): hybrid-decode, then decode-loop's
#                  qwen3-30b-a3b rows (16 layers at batch 1 and 4, 48 layers at batch 1 and 4), then issue 33's offload
#                  rows (48 layers, 280 slots, batch 1 and 4, the default miss copy, beside a resident row of the same
#                  run for the cached step's bound; ~330 s in all on an H100, 2026-12-06)
# decode-kernels-ab: bench_decode_loop under the fixed loop, one process per model, one engine at a time (four
#                  resident engines of a 16-layer cut held at once ran out of an H100's memory): auto against auto
#                  without gated_deltanet_decode and / or route_decode (auto since 2026-12-07: 1.017-1.068x on an
#                  H100) at the qwen3.5-35b-a3b 16-layer cut (batch 1), and auto against auto without route_decode
#                  and without merge_dense_decode (auto for one-row calls since 2026-12-07: 1.018-1.036x at batch
#                  1 on an H100) and with it named (so batch 4 takes it too: 0.985x there) at qwen3-30b-a3b's
#                  16-layer cut (batch 1 and 4), and auto without it at the 48-layer cut (batch 1): the same A/B on
#                  another card
# moe-tiles-wide:  bench_decode_speed, resident, qwen3-30b-a3b cut to 16 layers, batch 1 and 4: moe_decode's default
#                  tiles (128 rows a step, 64 columns a program, 8 warps) against wider column strips (128 and 256
#                  columns: 256 and 512 contiguous bytes of each weight row a load, against 128) for both stages and
#                  for the down stage alone (the experts' kernels read ~66% of the H100's HBM peak at batch 1)
# slot-copy:       bench_miss_copy at both expert shapes (qwen3.5-35b-a3b, qwen3-30b-a3b), 16 layers of top-k misses: the
#                  slot-copy kernel (ftjax.experts.slot_copy: every miss of a layer read from the host bank straight
#                  into its slot, one launch; kernel_ptr: the bank passed by address) beside XLA's loop of one copy
#                  per iteration (issue 33 item 2)
# copy-stream:     probe_copy_stream: a layer scan's expert copy (XLA's and the slot-copy kernel's) on gpu_stream:1
#                  (compute_on + xla_gpu_experimental_stream_annotation) beside a stand-in compute, with and without
#                  command buffers, and the kernel on a stream of its own (kernel_async: copy_into_slots_start, joined
#                  at the next layer): does the copy overlap the compute (issue 32's offload decode past its serial
#                  bound)? No on every gpu_stream:1 route (H100, 2026-12-06); kernel_async: yes at 2-8 blocks per miss
#                  (--blocks_per_miss; 2026-12-07), not at the default 64 with several misses a layer
# gpu-tests:       the suite on the GPU (pytest --backend=default) where it has GPU-only cases: tests/test_slot_copy.py
#                  (the slot-copy kernel against numpy); pytest's report as pytest_gpu_<card>_<day>.txt under $OUT
# gpu-tests-prefetch: the same with the slow cases too, for the prefetch: tests/test_slot_copy.py (the kernel's start /
#                  wait, 706e543's stricter case) and tests/test_prefetch.py; its report as
#                  pytest_gpu_prefetch_<card>_<day>.txt
# prefetch-identity: check_identity_gpu, short prompt, cached at S = E without and with the prefetch (prefetch_guesses
#                  2), float32 fixtures in float32 then the bfloat16 ones: is the fp32 hybrid's 1.1e-5 the prefetch's,
#                  or does the plain cached fp32 hybrid differ from resident on a GPU too? JSONs under
#                  $OUT/prefetch-identity-<dtype>
# profile-prefetch: profile_step's cached decode step on issue 32's shape (qwen3.5, 16 layers, 512 slots, batch 1)
#                  without and with --prefetch_guesses=2: where the prefetched step's extra time goes (0.938x the
#                  plain step's tokens/s on an H100, 2026-12-07); JSONs under $OUT/prefetch-0 and prefetch-2
# decode-hlo:      bench_decode_speed's resident batch-1 row of qwen3-30b-a3b cut to 16 layers (blocks of 16) with XLA's
#                  dump on: the decode block's optimized HLO as decode_block_resident_b1_qwen3-30b-a3b_16l_<card>_<day>
#                  .hlo.txt under $OUT (which fusions are the step's ~190 small kernels; issue 33 item 1)
# slot-copy-blocks: bench_miss_copy at both expert shapes, the slot-copy kernel's grid at 16, 32, 64 (the default),
#                  128 and 256 blocks per miss, graphs on (are the misses' 0.93-0.95x of a contiguous copy the grid's?)
# slot-copy-identity: check_identity_gpu with --miss_copy=kernel: cached = resident bit for bit with the kernel
# split-probe:     bench_decode_speed at issue 32's shape (qwen3.5, 16 layers, 512 slots, decode blocks of 16), cached:
#                  plain, with --split_probe (an empty start / wait pair of the slot-copy kernel on its own stream in
#                  every cached layer: what a prefetch on that stream costs the step in split CUDA graphs), and with
#                  --prefetch_guesses=2 (the prefetch itself), each beside its resident row (the bound, the tokens);
#                  whole copies of the pool counted in each decode block
# prefetch-blocks: bench_decode_speed's cached row at issue 32's shape (qwen3.5, 16 layers, 512 slots, decode blocks of
#                  16, 64 steps), without the prefetch, then --prefetch_guesses=2 with its copies at 4 (the default),
#                  16 and 64 thread blocks per miss (--prefetch_blocks): a profile of the default (2026-12-07, H100)
#                  saw its ~1.7 guessed misses a layer copied at ~33 GB/s on the kernel's own stream
# prefetch-kernels: which Pallas kernel the prefetch's inexact GPU tokens need (2026-12-07, H100: exact with
#                  --kernels=xla --miss_copy=xla, not with the default kernels): bench_decode_speed's resident and
#                  cached rows at issue 32's shape with --prefetch_guesses=2 --miss_copy=xla and one kernel group
#                  named at a time (first_token_unlike_resident in each JSON)
# prefetch-norm-kernel: the group prefetch-kernels found (norm_dense_decode,dense_decode: unlike resident from token
#                  9) split: that group with no prefetch (--prefetch_guesses=0), then each of the two alone with it
# prefetch-tiling: the resident and cached decode blocks of the prefetch's tokens run (default kernels, prefetch 2,
#                  then without it) dumped, and experiments/hlo_tiling.py's list of the ops the programs build
#                  otherwise (Triton fusions' tiles, cuBLAS algorithms, ops only one program builds so)
# prefetch-precision: prefetch-tiling with XLA_FLAGS --xla_allow_excess_precision=false (no 16-bit intermediate
#                  kept in float32 inside a fusion): the prefetch's cached programs fuse the token mixers' residual
#                  adds elsewhere than resident does (hlo_tiling, 2026-12-07); are its tokens then the resident ones?
# hybrid-fp32-tiling: the fp32 hybrid fixture's first logits, resident and cached at S = E (4.53e-6 apart on an H100,
#                  2026-12-07), the cached prefill on the pipelined driver (cached_S=E_pipelined; the 24 routed
#                  tokens >= E stream) and on the layer scan (cached_S=E_scan), the forward_step programs dumped and
#                  compared by experiments/hlo_tiling.py: is the difference the pipelined driver's?
# host-ffi:        experiments/probe_host_ffi.py: does a CPU FFI custom call run inside compute_on("device_host") of a
#                  GPU program, does a pinned bank reach it in place, and what fixed cost and GB/s has the C expert
#                  kernel called that way against native_async's two io_callbacks (issue 33: <= 0.2 ms a layer; ~2 min);
#                  a variant that ends the process (its row "no answer", Python's stack in the log by -X faulthandler)
#                  is left out of a second run (--skip, tag _skip-2), and so on up to three runs
# hybrid-fp32-drivers: the fp32 hybrid fixture's first logits cached at S = E on the auto driver (the scan for float32
#                  since 2026-12-07), the pipelined driver and the scan (check_identity_gpu.py's cached_S=E,
#                  cached_S=E_pipelined, cached_S=E_scan), with XLA's GEMM autotuning as it is and
#                  off (--xla_gpu_autotune_level=0: each GEMM's config by its shapes alone, the same in every program):
#                  is the pipelined driver's 4.05e-6 (625eec0, H100) autotuning's choice per program? (3.1e-6 with it
#                  off, 2026-12-07); and with --xla_gpu_exclude_nondeterministic_ops=true: is it atomics? (no:
#                  2.44e-6 there, a751b20; docs/OVERLAP.md "Float32 on the pipelined driver")
# hybrid-fp32-driver-hlo: the fp32 hybrid fixture's first logits, resident (the layer scan) and cached on the pipelined
#                  driver (4.05e-6 to 6.68e-6 apart on H100s, 2026-12-07), the forward_step and layer_program programs
#                  dumped and compared op by op by experiments/hlo_tiling.py --across: which float32 op do the
#                  per-layer programs build otherwise than the scan body? (~60 s)
# gpu-tests-fp32-driver: the tests of the float32 driver choice on a GPU (auto runs float32 prefills on the scan since
#                  2026-12-07): the fp32 hybrid's prefetched and plain cached decode bit-identical to resident, the
#                  pipelined driver against the block scan, the driver choice
# pipelined-initcheck: compute-sanitizer's initcheck on the fp32 hybrid fixture's first logits, cached at S = E, its
#                  prefill on the pipelined driver (4.05e-6 off resident on an H100) and on the scan (bit-identical):
#                  does the pipelined one read device memory nothing wrote (the prefetch-sanitizer run of 2026-12-07
#                  saw XLA's wrapped_slice do so in that driver's layer program)?
# prefetch-sanitizer: the prefetch's cached decode (issue 32's shape, 16 steps) under compute-sanitizer's initcheck
#                  (reads of device memory nothing wrote; with the platform allocator) then racecheck (shared memory
#                  hazards inside a kernel, not races between streams), logs under $OUT: for a machine whose
#                  prefetch-tiling run differs from resident
# slot-copy-decode: bench_decode_speed's cached rows with --miss_copy=xla, then kernel: issue 32's shape (qwen3.5, 16
#                  layers, 512 slots, with its resident row) and issue 33's 48-layer offload row (280 slots, 64 steps)
# decode-loop-order: bench_decode_loop at qwen3-30b-a3b's 48 layers, batch 4, one engine after the other, the fixed
#                  form's first, then the dynamic form's first: is the fixed loop's 0.97-0.98x there the loop or the
#                  order (both 2026-12-06 runs timed the dynamic engine first)?
# hybrid-decode:   bench_decode_speed on the 2026-12-03 side-by-side shape of issue 32: qwen3.5-35b-a3b cut to 16
#                  layers, 512-token prompt, 128 steps, batch 1, decode blocks of 16, resident and cached at 512 slots
#                  (targets: >= 490 and >= 65 tok/s; FreeToken 410 and 59.0)
# profile-hybrid:  profile_step on issue 32's 16-layer qwen3.5-35b-a3b cut, resident: one decode step (batch 1, after a
#                  512-token prompt) and one 8192-token prefill chunk, GPU time by layer kind (Gated DeltaNet mixers
#                  in linear_attention, the gated attention in attention, the MoE in experts) against each one's bytes
# profile-hybrid-cached: profile_step on the same cut, cached at 6 GB (284 slots, a few % decode hits): the misses'
#                  host reads against the rest of the step, one miss per loop iteration (fetch_group 1) and up to 8
# moe-tiles:       the routed experts' decode kernel (moe_decode) at 64-row steps with Triton's warps (the default
#                  before f891701) and 128-row steps with 8 warps (its default for 16-bit pools since): profile_step on
#                  both 16-layer cuts at batch 1 and 4, then bench_decode_speed at 48 layers
# profile-hybrid-nocb: profile-hybrid's decode step with XLA's command buffers off (XLA_FLAGS
#                  --xla_gpu_enable_command_buffer=): slower steps, but every kernel keeps its HLO op in the trace, so
#                  the 1.2 ms of "other" in profile-hybrid's decode (a cuBLAS GEMM, the dense_decode kernels) gets
#                  categories; its JSON under $OUT/no-command-buffers
# hybrid-int4-budget: bench_decode, qwen3.5-35b-a3b with int4 experts at 12 and 24 GB (LRU and lookahead) and
#                  resident (26.16 GB): the int4 points of docs/FIGURES.md's hybrid decode-by-budget figure
# budget-sampled:  bench_decode, qwen3-30b-a3b bf16 at 8, 12, 16, 24 GB (LRU and lookahead) and resident, the decode
#                  sampled at temperature 1 (--temperature=1.0): the by-budget curve without greedy decoding's
#                  repeated token
# hybrid-batch-probe: does the hybrid engine's decode compile at batch 1, 2, 4 (stacks dumped if it hangs)
# ab-prefill:      ab_commits_gpu.sh against the tree in .base (git-ignored, so carried: run(carry=[".base"]); made
#                  with `rm -rf .base && mkdir .base && git archive a733c60 ftjax | tar -x -C .base`): qwen3-30b-a3b's
#                  resident and streamed 8192-token prefill, before and after the Mosaic gate-up's grid_block_n=4
# LIMIT_<run> (seconds, dashes and dots as underscores) overrides a run's limit; a stage's runs are named <stage> or
# <stage>-<part>, as each "== <run> rc=..." line prints (e.g. LIMIT_profile_prefetch_g2). The GPU machine's copy of the tree may
# carry stale git metadata: name the commit the copy holds, FTJAX_GIT_COMMIT=<sha> bash experiments/gpu_stages.sh ...
# (ftjax.provenance records it in every JSON's meta.git_commit and in gpu-tests' report).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-}"; logs=/tmp  # logs stay on the machine: a call brings back at most 8 files; their tails print
source experiments/carried_wheels.sh  # the serve stages' HTTP server and client (uvicorn, httpx, ...)
export PYTHONUNBUFFERED=1
day="$(date -u +%F)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
# file names carry the card that ran them (h100 or h200), whatever kind was asked for
dev="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'h100|h200' | tr A-Z a-z)"
dev="${dev:-gpu}"
run() {  # run LIMIT NAME python-args...
  local lim="$1" name="$2"; shift 2
  local var="LIMIT_${name//[-.]/_}"; lim="${!var:-$lim}"
  local t0=$SECONDS
  timeout -s INT -k 15 "$lim" python3 "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s"; grep -v -E "^[WIE][0-9]{4}|libtpu|TPU" "$logs/$name.log" | tail -n 25
}
tiling() {  # tiling NAME DUMP OUT-FILE [hlo_tiling args]: experiments/hlo_tiling.py on a dump (its JSON under $OUT,
  # its listing a log)
  local name="$1" dump="$2" file="${out:-/tmp}/$3"; shift 3
  python3 experiments/hlo_tiling.py "$dump" --out="$file" "$@" > "$logs/$name.log" 2>&1
  echo "== $name rc=$?"; grep -v " 0 ops built otherwise, 0 only in the first, 0 only in the second" "$logs/$name.log" |
    cut -c1-400 | head -n 40
}
prefetch_tokens() {  # prefetch_tokens LIMIT NAME TAG bench-args...: bench_decode_speed's tokens run at issue 32's
  # shape, resident then cached with 48 cached steps (first_token_unlike_resident in its JSON), tagged 16l-512-slots-TAG
  local lim="$1" name="$2" tag="$3"; shift 3
  run "$lim" "$name" experiments/bench_decode_speed.py --preset=qwen3.5-35b-a3b --layers=16 --slots=512 \
    --modes=resident,cached --batches=1 --decode_blocks=16 --repeats=1 --cached_repeats=1 --cached_steps=48 \
    --trace_steps=0 --tag="16l-512-slots-${tag}_${dev}_$day" ${out:+--out_dir="$out"} "$@"
}
hybrid_decode() {  # hybrid_decode LIMIT: issue 32's decode shape (hybrid-decode, decode-targets)
  run "$1" hybrid-decode experiments/bench_decode_speed.py --preset=qwen3.5-35b-a3b --layers=16 --slots=512 \
    --batches=1 --decode_blocks=16 --repeats=3 --trace_steps=0 --tag="qwen3.5-16l-512-slots_${dev}_$day" \
    ${out:+--out_dir="$out"}
}
qwen3_decode_loops() {  # qwen3_decode_loops LIMIT_16L LIMIT_48L PREFIX: issue 33's rows (decode-loop, decode-targets)
  run "$1" "$3-qwen3-16l" experiments/bench_decode_loop.py --preset=qwen3-30b-a3b --layers=16 --batches=1,4 \
    --tag="16l_${dev}_$day" ${out:+--out_dir="$out"}
  run "$2" "$3-48l" experiments/bench_decode_loop.py --preset=qwen3-30b-a3b --layers=48 --batches=1,4 --noalternate \
    --repeats=3 --tag="48l_${dev}_$day" ${out:+--out_dir="$out"}
}
kernel_copy_rows() {  # kernel_copy_rows LIMIT STAGE TAG bench_miss_copy-args...: both expert shapes, 16 layers of
  # top-k misses from a 512-expert bank, XLA's loop (group1) first (slot-copy, slot-copy-blocks)
  local lim="$1" stage="$2" tag="$3"; shift 3
  for p in qwen3.5-35b-a3b qwen3-30b-a3b; do
    run "$lim" "$stage-$p" experiments/bench_miss_copy.py --preset="$p" --layers_per_call=16 --decode_layers=16 \
      --repeats=5 --groups=1 --notorch --bank_experts=512 "$@" --tag="${tag}_${dev}_$day" ${out:+--out_dir="$out"}
  done
}
# the fp32 hybrid fixture's first logits, resident against cached (hybrid-fp32-tiling, hybrid-fp32-drivers,
# pipelined-initcheck add --variants and --out_dir)
fp32_first_logits=(experiments/check_identity_gpu.py --fixtures=qwen3_5_moe_fp32 --dtype=float32 --prompts=short
                   --steps=1)
fp32_hlo() {  # fp32_hlo STAGE MODULE_RE VARIANTS OUT-FILE [hlo_tiling args]: fp32_first_logits with the programs whose
  # module names match MODULE_RE dumped, then experiments/hlo_tiling.py on the dump (hybrid-fp32-tiling,
  # hybrid-fp32-driver-hlo)
  local stage="$1" module_re="$2" variants="$3" file="$4"; shift 4
  local dump="/tmp/$stage-dump" d="${out:-/tmp}/$stage"; rm -rf "$dump"; mkdir -p "$d"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=$module_re" \
    run 200 "$stage" "${fp32_first_logits[@]}" --variants="$variants" --out_dir="$d"
  tiling "$stage-tiling" "$dump" "$stage/$file" "$@"
}
sanitizer() {  # sanitizer TOOL NAME LOG LIMIT python-args...: compute-sanitizer's TOOL on a python run (XLA's platform
  # allocator: with its pooled one a buffer reuses bytes an earlier op wrote, and initcheck, which follows which bytes
  # were written, sees each program's own temporaries only then), its log at LOG, the reports counted by kernel; a
  # run that dies under the sanitizer (every one on an H100, 2026-12-07) prints no Python stack even with faulthandler
  local tool="$1" name="$2" log="$3" lim="$4"; shift 4
  local var="LIMIT_${name//[-.]/_}" t0=$SECONDS san
  san="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
  [ -n "$san" ] || { echo "== $name skipped: no compute-sanitizer on PATH or in /usr/local/cuda/bin"; return; }
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout -s INT -k 15 "${!var:-$lim}" "$san" --tool "$tool" --print-limit 200 \
    --log-file "$log" python3 -X faulthandler "$@" > "$logs/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"; grep -v -E "^[WIE][0-9]{4}" "$logs/$name.log" | tail -n 8
  [ -f "$log" ] && { grep -A1 -i -E "uninitiali[sz]ed" "$log" | grep -E "^=+ +at " | sort | uniq -c | head -20
    grep -i -E "race reported|hazard detected" "$log" | sort | uniq -c | head -20
    grep -i -E "(error|racecheck) summary" "$log"; }
}
gpu_pytest() {  # gpu_pytest LIMIT STAGE MARKERS pytest-args...: the suite on the GPU, its report under $OUT
  local lim="$1" stage="$2" markers="$3"; shift 3
  local what="${stage#gpu-tests}"; what="${what#-}"
  local report="${out:-/tmp}/pytest_gpu_${what:+${what}_}${dev}_$day.txt"
  { python3 -c 'import jax; from ftjax.provenance import git_commit; print("git:", git_commit(), "jax:", jax.__version__)'
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1; } > "$report"
  run "$lim" "$stage" -m pytest "$@" --backend=default -q -n 0 -p no:cacheprovider -o addopts="" -m "$markers" -rA \
    --tb=short -W ignore::DeprecationWarning
  grep -v -E "^[WIE][0-9]{4}" "$logs/$stage.log" >> "$report"
}
for stage in "$@"; do
  case "$stage" in
    decode-b4-probe)
      timeout -s ABRT -k 10 "${LIMIT_decode_b4_probe:-40}" python3 -X faulthandler experiments/bench_gated_delta.py \
        --stages=decode --decode_batches=4 --model_layers=0 --repeats=3 --step_tiles=32:4 --tag=b4-probe \
        ${out:+--out_dir="$out"} > "$logs/$stage.log" 2>&1
      echo "== $stage rc=$?"; grep -v -E "^[WI][0-9]{4}" "$logs/$stage.log" | tail -n 40 ;;
    serve-blocks)
      run 190 "$stage" experiments/bench_serve.py --part=concurrency --modes=resident --concurrency=1,4 --requests=8 \
        --decode_blocks=1,16 --out="${out:-experiments/results/serve}/bench_serve_qwen3-30b-a3b_resident_blocks_${dev}_$day.json" ;;
    serve-onestep)
      for ahead in run_ahead norun_ahead; do
        run 200 "$stage-$ahead" experiments/bench_serve.py --part=concurrency --modes=resident --concurrency=1,4 \
          --requests=32 --decode_blocks=1 --"$ahead" \
          --out="${out:-experiments/results/serve}/bench_serve_qwen3-30b-a3b_resident_onestep-${ahead//_/-}_${dev}_$day.json"
      done ;;
    serve-cached-blocks)
      run 380 "$stage" experiments/bench_serve.py --part=concurrency --modes=cached --vram_budget_gb=8 \
        --concurrency=1,4 --requests=8 --decode_blocks=1,16 \
        --out="${out:-experiments/results/serve}/bench_serve_qwen3-30b-a3b_cached-8gb_blocks_${dev}_$day.json" ;;
    serve-http-blocks)
      run 240 "$stage" experiments/bench_serve.py --part=server_overhead --modes=resident --decode_block=16 \
        --out="${out:-experiments/results/serve}/bench_serve_qwen3-30b-a3b_http-blocks_${dev}_$day.json" ;;
    profile-b4)
      run 240 "$stage" experiments/profile_step.py --runs=resident_decode --batches=1,4 --trace_steps=2 \
        ${out:+--out_dir="$out"} ;;
    multiround)
      XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115 run 330 "$stage" experiments/bench_serve.py --part=multiround \
        --modes=resident --kv_host_gb=12 \
        --out="${out:-experiments/results/serve}/bench_serve_qwen3-30b-a3b_multiround-16k_${dev}_$day.json" ;;
    miss-copy) run 170 "$stage" experiments/bench_miss_copy.py --repeats=5 --tag="${dev}_$day" ${out:+--out_dir="$out"} ;;
    cpu-experts) run 165 "$stage" experiments/bench_cpu_experts.py --time_budget_s=140 ${out:+--out_dir="$out"} ;;
    miss-host)
      run 420 "$stage" experiments/bench_miss_policy.py --budgets_gb=8 --impls=native_async --cpu_drivers=callback,host \
        --quick_calibration --nopure_qstar --steps=24 --time_budget_s=300 ${out:+--out_dir="$out"} ;;
    miss-host-graphs)
      run 300 "$stage" experiments/bench_miss_policy.py --budgets_gb=8 --impls=native_async --cpu_drivers=host \
        --decode_graphs=on --policies=fetch,cpu,adaptive --quick_calibration --nopure_qstar --steps=24 \
        --time_budget_s=220 ${out:+--out_dir="$out/host-graphs"} ;;
    gdn-model)
      run 480 "$stage" experiments/bench_gated_delta.py --stages=model --model_deadline_s=420 \
        --model_configs=auto,auto+graphs,auto-gather-moe,auto-mosaic-moe,auto+fused-swiglu \
        --model_decode_configs=auto,auto+graphs \
        --tag=model-moe ${out:+--out_dir="$out"} ;;
    gmm-tiles)
      run 420 "$stage" experiments/bench_grouped_matmul.py --tag="${dev}_$day" ${out:+--out_dir="$out"} \
        --configs=128:128:64:4:1,64:256:64:4:1,128:128:64:4:4 \
        --triton_configs=64:256:64:8:3,128:256:64:8:3,64:256:64:4:4,64:256:128:8:3,128:128:64:4:4,32:256:64:4:3 ;;
    gmm-order)
      run 420 "$stage" experiments/bench_grouped_matmul.py --tag="order_${dev}_$day" ${out:+--out_dir="$out"} \
        --configs= --triton_configs=64:256:64:8:3:0,64:256:64:8:3:4,64:256:64:8:3:8,64:256:64:8:3:16,\
128:256:64:8:3:0,128:256:64:8:3:2,128:256:64:8:3:4,128:256:64:8:3:8,128:128:64:4:3:8,64:256:64:4:4:8,128:256:64:8:4:4 ;;
    gmm-batched)
      run 300 "$stage" experiments/bench_grouped_matmul.py --tag="batched_${dev}_$day" ${out:+--out_dir="$out"} \
        --presets=qwen3.5-35b-a3b --configs= --triton_configs=64:256:64:8:3,128:256:64:8:3 --batched --repeats=5 ;;
    gdn-model-order)
      g=grouped_matmul_triton; f=grouped_swiglu_triton
      run 420 "$stage" experiments/bench_gated_delta.py --stages=model --model_deadline_s=400 --model_decode_steps=0 \
        --model_configs=auto,auto-unfused,auto@$f=64:256:64:8:3:4@$g=128:256:64:8:3:4,\
auto@$f=64:256:64:8:3:8@$g=128:256:64:8:3:8,auto@$f=64:256:64:8:3:16@$g=128:256:64:8:3:16 \
        --tag="model-order_${dev}_$day" ${out:+--out_dir="$out"} ;;
    gdn-rule-bits)
      run 300 "$stage" experiments/bench_gated_delta.py --stages=rule --model_layers=0 \
        --tiles=32:4:1,32:4:1:16,32:4:2:16,32:8:2:16,64:8:2:16,16:4:2:16 --solve_blocks=8,16 \
        --tag="rule-bits_${dev}_$day" ${out:+--out_dir="$out"} ;;
    gdn-quick)
      g=grouped_matmul_triton; f=grouped_swiglu_triton
      run 400 "$stage" experiments/bench_gated_delta.py --stages=model --model_deadline_s=380 --repeats=3 \
        --model_configs=auto,auto+mixer-kernel,auto-unfused,auto@$f=64:256:64:8:3:8@$g=128:256:64:8:3:8 \
        --model_decode_configs=auto,auto+mixer-kernel --tag="quick_${dev}_$day" ${out:+--out_dir="$out"} ;;
    gdn-attention)
      run 200 "$stage" experiments/bench_gated_delta.py --stages=model --model_deadline_s=190 --repeats=3 \
        --model_decode_steps=0 --model_configs=auto,auto+mgpu-attention,auto@gated_delta_solve=32:4:1 \
        --tag="attention_${dev}_$day" ${out:+--out_dir="$out"} ;;
    gdn-solve-form)
      run 300 "$stage-model" experiments/bench_gated_delta.py --stages=model --model_deadline_s=280 --repeats=3 \
        --model_decode_steps=0 --model_configs=auto,auto@gated_delta_solve=16:4:0,auto-gather-out,auto+mgpu-attention \
        --tag="solve-form-model_${dev}_$day" ${out:+--out_dir="$out"}
      run 150 "$stage-rule" experiments/bench_gated_delta.py --stages=rule --model_layers=0 --tiles=32:4:2:16 \
        --solve_blocks=16:4:0,16:4:1,32:4:1,16:8:1 --repeats=5 --tag="solve-form-rule_${dev}_$day" \
        ${out:+--out_dir="$out"} ;;
    flash-auto)
      run 200 "$stage-model" experiments/bench_gated_delta.py --stages=model --model_deadline_s=190 --repeats=3 \
        --model_decode_steps=0 --model_configs=auto,auto+pallas-attention,auto+mgpu-attention \
        --tag="flash-auto_${dev}_$day" ${out:+--out_dir="$out"}
      run 150 "$stage-e2e" experiments/check_kernels_gpu.py --sections=e2e_prefill --time_budget_s=130 \
        ${out:+--out_dir="$out"}
      run 150 "$stage-reuse" experiments/check_reuse_gpu.py --flash_prefill=auto --cases=preset_bfloat16 \
        --time_budget_s=120 ${out:+--out_dir="$out"} ;;
    hybrid-compile)
      for k in auto xla; do
        run 150 "$stage-$k" experiments/probe_hybrid_batch_decode.py --batches=1 --kernels="$k" --tag="compile-$k" \
          ${out:+--out_dir="$out"}
      done
      run 150 "$stage-xla-ragged" experiments/probe_hybrid_batch_decode.py --batches=1 --kernels=xla \
        --grouped_matmul=xla --tag=compile-xla-ragged ${out:+--out_dir="$out"} ;;
    hybrid-stream)
      XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115 run 540 "$stage" experiments/bench_prefill.py --preset=qwen3.5-35b-a3b \
        --vram_budget_gb=24 --lengths=8192 --variants=stream,stream_scan,resident --repeats=3 \
        ${out:+--out_dir="$out"} ;;
    decode-loop)
      run 200 "$stage-16l" experiments/bench_decode_loop.py --preset=qwen3.5-35b-a3b --layers=16 --batches=1 \
        --tag="qwen3.5-16l_${dev}_$day" ${out:+--out_dir="$out"}
      run 200 "$stage-16l-eos" experiments/bench_decode_loop.py --preset=qwen3.5-35b-a3b --layers=16 --batches=1 \
        --eos_at=40 --tag="qwen3.5-16l-eos-40_${dev}_$day" ${out:+--out_dir="$out"}
      qwen3_decode_loops 200 300 "$stage" ;;
    decode-targets)
      hybrid_decode 180
      qwen3_decode_loops 120 150 "$stage"
      run 145 "$stage-48l-offload" experiments/bench_decode_speed.py --preset=qwen3-30b-a3b --layers=48 --slots=280 \
        --modes=resident,cached --batches=1,4 --decode_blocks=16 --repeats=1 --cached_steps=32 --trace_steps=0 \
        --tag="48l-280-slots_${dev}_$day" ${out:+--out_dir="$out"} ;;
    decode-kernels-ab)
      m=gated_deltanet_decode; r=route_decode; w=merge_dense_decode
      run 200 "$stage-hybrid" experiments/bench_decode_loop.py --preset=qwen3.5-35b-a3b --layers=16 --batches=1 \
        --forms=fixed --repeats=5 --noalternate --kernels=auto --kernels=auto-$m --kernels=auto-$r \
        --kernels=auto-$m-$r --tag="16l-kernels-ab_${dev}_$day" ${out:+--out_dir="$out"}
      run 220 "$stage-qwen3" experiments/bench_decode_loop.py --preset=qwen3-30b-a3b --layers=16 --batches=1,4 \
        --forms=fixed --repeats=3 --noalternate --kernels=auto --kernels=auto-$r --kernels=auto-$w --kernels=auto+$w \
        --tag="16l-kernels-ab_${dev}_$day" ${out:+--out_dir="$out"}
      run 170 "$stage-qwen3-48l" experiments/bench_decode_loop.py --preset=qwen3-30b-a3b --layers=48 --batches=1 \
        --forms=fixed --repeats=3 --noalternate --kernels=auto --kernels=auto-$w \
        --tag="48l-kernels-ab_${dev}_$day" ${out:+--out_dir="$out"} ;;
    moe-tiles-wide)
      for t in 128/64/8/0 128/128/8/0 128/256/8/0 128/64/8/0/128/128 128/64/8/0/256/128 128/64/8/0-again; do
        run 100 "$stage-${t//\//x}" experiments/bench_decode_speed.py --layers=16 --modes=resident --batches=1,4 \
          --decode_blocks=16 --repeats=3 --trace_steps=0 --kernel_tiles=moe_decode:"${t%-again}" \
          --tag="16l-moe-tiles-${t//\//x}_${dev}_$day" ${out:+--out_dir="$out"}
      done ;;
    slot-copy) kernel_copy_rows 150 "$stage" slot-kernel --variants=kernel,kernel_ptr --graphs=on,off ;;
    copy-stream) run 150 "$stage" experiments/probe_copy_stream.py --copy=xla,kernel,kernel_async --tag="${dev}_$day" \
      ${out:+--out_dir="$out"} ;;
    gpu-tests) gpu_pytest 240 "$stage" "not slow" tests/test_slot_copy.py ;;
    gpu-tests-prefetch) gpu_pytest 300 "$stage" "slow or not slow" tests/test_slot_copy.py tests/test_prefetch.py ;;
    gpu-tests-fp32-driver) gpu_pytest 240 "$stage" "slow or not slow" tests/test_prefetch.py tests/test_layer_pipeline.py \
      -k "prefetch_keeps_the_logits_bit_identical or driver_choice or float32 or on_the_pipelined_driver_equals" ;;
    prefetch-identity)
      for dt in float32 bfloat16; do
        fx=qwen3_moe_fp32,qwen3_5_moe_fp32; [ "$dt" = bfloat16 ] && fx=qwen3_moe_bf16,qwen3_5_moe_bf16
        d="${out:-experiments/results/checks}/prefetch-identity-$dt"; mkdir -p "$d"
        run 200 "$stage-$dt" experiments/check_identity_gpu.py --fixtures="$fx" --dtype="$dt" --prompts=short \
          --variants=cached_S=E,cached_S=E_prefetch-2 --out_dir="$d"
      done ;;
    profile-prefetch)
      for g in 0 2; do
        d="${out:-experiments/results/profiles}/prefetch-$g"; mkdir -p "$d"
        run 200 "$stage-g$g" experiments/profile_step.py --preset=qwen3.5-35b-a3b --layers=16 --runs=cached_decode \
          --batches=1 --slots=512 --prefetch_guesses="$g" --trace_steps=2 --prefill_repeats=0 --out_dir="$d"
      done ;;
    decode-hlo)
      dump=/tmp/decode-hlo-dump; rm -rf "$dump"
      XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_block" \
        run 200 "$stage" experiments/bench_decode_speed.py --preset=qwen3-30b-a3b --layers=16 --modes=resident \
        --batches=1 --decode_blocks=16 --repeats=1 --trace_steps=0 --out_dir=/tmp/decode-hlo-json
      f="$(ls -S "$dump"/*decode_block*after_optimizations.txt 2>/dev/null | head -1)"
      if [ -n "$f" ]; then cp "$f" "${out:-/tmp}/decode_block_resident_b1_qwen3-30b-a3b_16l_${dev}_$day.hlo.txt"
      else echo "no decode_block dump under $dump"; ls "$dump" | head; fi ;;
    slot-copy-blocks)
      kernel_copy_rows 120 "$stage" slot-kernel-blocks --variants=kernel --kernel_blocks=16,32,128,256 --graphs=on ;;
    slot-copy-identity)
      run 200 "$stage" experiments/check_identity_gpu.py --miss_copy=kernel ${out:+--out_dir="$out"} ;;
    split-probe)
      for v in plain:--nosplit_probe split:--split_probe prefetch-2:--prefetch_guesses=2; do
        name="${v%%:*}"; dump=/tmp/split-probe-dump-$name; rm -rf "$dump"
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_block" \
          run 200 "$stage-$name" experiments/bench_decode_speed.py --preset=qwen3.5-35b-a3b --layers=16 --slots=512 \
          --modes=resident,cached --batches=1 --decode_blocks=16 --repeats=3 --cached_repeats=3 --trace_steps=0 "${v#*:}" \
          --tag="qwen3.5-16l-512-slots-${name}_${dev}_$day" ${out:+--out_dir="$out"}
        # a whole copy of a 512-slot pool would race with an asynchronous copy: count them (anywhere in the program)
        n="$(ls "$dump"/*decode_block*after_optimizations.txt 2>/dev/null | wc -l)"
        echo "$name: whole copies of the 512-slot pools (gate_up, down) in $n decode_block programs:" \
          "$(cat "$dump"/*decode_block*after_optimizations.txt 2>/dev/null | grep -c -E 'bf16\[512,(2048,1024|512,2048)\]\{[^}]*\} copy\(')"
      done ;;
    prefetch-blocks)
      for v in plain:0:4 4:2:4 16:2:16 64:2:64; do
        IFS=: read -r name g b <<< "$v"
        run 120 "$stage-$name" experiments/bench_decode_speed.py --preset=qwen3.5-35b-a3b --layers=16 --slots=512 \
          --modes=cached --batches=1 --decode_blocks=16 --repeats=1 --cached_repeats=1 --cached_steps=64 --trace_steps=0 \
          --prefetch_guesses="$g" --prefetch_blocks="$b" --tag="16l-512-slots-prefetch-blocks-${name}_${dev}_$day" \
          ${out:+--out_dir="$out"}
      done ;;
    prefetch-kernels)
      for k in norm_dense_decode,dense_decode moe_decode gated_delta,gated_delta_solve,causal_conv \
               decode_attention,rope_cache; do
        prefetch_tokens 100 "$stage-${k%%,*}" "tokens-prefetch-2-only-${k//,/-}" --prefetch_guesses=2 --miss_copy=xla \
          --kernels="$k"
      done ;;
    prefetch-norm-kernel)
      for kg in norm_dense_decode,dense_decode:0 norm_dense_decode:2 dense_decode:2; do
        k=${kg%%:*} g=${kg##*:}
        prefetch_tokens 150 "$stage-${k//,/-}-$g" "tokens-prefetch-$g-only-${k//,/-}" --prefetch_guesses="$g" \
          --miss_copy=xla --kernels="$k"
      done ;;
    prefetch-tiling|prefetch-precision)
      extra=""; name=tiling; what=""  # what: the hlo_tiling files' part of the name (the tiling run's: none)
      [ "$stage" = prefetch-precision ] && extra="--xla_allow_excess_precision=false" && name=no-excess-precision \
        && what=no-excess-precision-
      for g in 2 0; do
        dump=/tmp/$stage-dump-$g; rm -rf "$dump"; flags="--xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_block"
        XLA_FLAGS="${XLA_FLAGS:-} $extra --xla_dump_to=$dump $flags" \
          prefetch_tokens 150 "$stage-$g" "$name-prefetch-$g" --prefetch_guesses="$g"
        tiling "$stage-$g-tiling" "$dump" \
          "hlo_tiling_qwen3.5-35b-a3b_16l-512-slots-${what}prefetch-${g}_${dev}_$day.json"
      done ;;
    hybrid-fp32-tiling) fp32_hlo "$stage" forward_step cached_S=E_pipelined,cached_S=E_scan \
      "hlo_tiling_qwen3_5_moe_fp32_first-logits_${dev}_$day.json" ;;
    hybrid-fp32-driver-hlo) fp32_hlo "$stage" "forward_step|layer_program" cached_S=E_pipelined \
      "hlo_tiling_qwen3_5_moe_fp32_pipelined-vs-scan_${dev}_$day.json" --across=jit_forward_step,jit_layer_program ;;
    hybrid-fp32-drivers)
      # default, GEMM autotuning off, and XLA's deterministic implementations of scatter, GEMMs and attention
      # (does the difference come from atomics, or from the two drivers' programs fusing differently?)
      for tune in default 0 det; do
        d="${out:-/tmp}/hybrid-fp32-drivers-autotune-$tune"; mkdir -p "$d"
        # XLA reads an XLA_FLAGS that does not start with "--" as a file of flags (" " aborted a run): set it only
        # with a flag in it
        flags="${XLA_FLAGS:-}"; [ "$tune" = 0 ] && flags="$flags --xla_gpu_autotune_level=0"
        [ "$tune" = det ] && flags="$flags --xla_gpu_exclude_nondeterministic_ops=true"
        args=("${fp32_first_logits[@]}" --variants=cached_S=E,cached_S=E_pipelined,cached_S=E_scan --out_dir="$d")
        if [ -n "${flags// /}" ]; then XLA_FLAGS="${flags# }" run 120 "$stage-autotune-$tune" "${args[@]}"
        else run 120 "$stage-autotune-$tune" "${args[@]}"; fi
      done ;;
    host-ffi)
      skip=""
      for attempt in 1 2 3; do
        tag="${dev}_$day${skip:+_skip-$attempt}"
        json="${out:-experiments/results/miss_policy}/probe_host_ffi_$tag.json"
        rm -f "$json"  # a run that dies before its first save must not leave an earlier run's rows to be read
        run 180 "$stage-$attempt" -X faulthandler experiments/probe_host_ffi.py --tag="$tag" ${skip:+--skip="$skip"} \
          ${out:+--out_dir="$out"}
        grep -E "^F[0-9]{4}|Check failed" "$logs/$stage-$attempt.log" | cut -c1-400 | head -n 3  # XLA's abort, if any
        dead="$(python3 -c 'import json, sys; print(",".join(r["variant"] for r in json.load(open(sys.argv[1]))["rows"]
          if str(r.get("error", "")).startswith("no answer")))' "$json" 2>/dev/null)"
        [ -n "$dead" ] || break
        echo "== $stage: $dead ended the process"; skip="${skip:+$skip,}$dead"
      done ;;
    prefetch-sanitizer)
      for tool in initcheck racecheck; do
        sanitizer "$tool" "$stage-$tool" "${out:-/tmp}/compute_sanitizer_${tool}_prefetch-2_${dev}_$day.txt" 270 \
          experiments/bench_decode_speed.py --preset=qwen3.5-35b-a3b --layers=16 --slots=512 --modes=cached \
          --batches=1 --decode_blocks=16 --repeats=1 --cached_repeats=1 --cached_steps=16 --trace_steps=0 \
          --prefetch_guesses=2 --out_dir=/tmp/prefetch-sanitizer
      done ;;
    pipelined-initcheck)
      for driver in pipelined scan; do
        v=cached_S=E_$driver
        sanitizer initcheck "$stage-$driver" \
          "${out:-/tmp}/compute_sanitizer_initcheck_qwen3_5_moe_fp32_first-logits-${driver}_${dev}_$day.txt" 150 \
          "${fp32_first_logits[@]}" --variants="$v" --out_dir="/tmp/$stage-$driver"
      done ;;
    slot-copy-decode)
      for mc in xla kernel; do
        modes=cached; [ "$mc" = xla ] && modes=resident,cached
        run 200 "$stage-qwen3.5-$mc" experiments/bench_decode_speed.py --preset=qwen3.5-35b-a3b --layers=16 \
          --slots=512 --modes="$modes" --batches=1 --decode_blocks=16 --repeats=3 --trace_steps=0 --miss_copy="$mc" \
          --tag="qwen3.5-16l-512-slots-miss-copy-${mc}_${dev}_$day" ${out:+--out_dir="$out"}
      done
      for mc in xla kernel; do
        run 120 "$stage-qwen3-48l-$mc" experiments/bench_decode_speed.py --preset=qwen3-30b-a3b --layers=48 \
          --slots=280 --modes=cached --batches=1 --decode_blocks=16 --cached_steps=64 --trace_steps=0 \
          --miss_copy="$mc" --tag="48l-280-slots-miss-copy-${mc}_${dev}_$day" ${out:+--out_dir="$out"}
      done ;;
    decode-loop-order)
      for forms in fixed,dynamic dynamic,fixed; do
        run 200 "$stage-${forms%%,*}-first" experiments/bench_decode_loop.py --preset=qwen3-30b-a3b --layers=48 \
          --batches=4 --noalternate --repeats=3 --forms="$forms" --tag="48l-b4-${forms%%,*}-first_${dev}_$day" \
          ${out:+--out_dir="$out"}
      done ;;
    hybrid-decode) hybrid_decode 420 ;;
    profile-hybrid)
      run 420 "$stage" experiments/profile_step.py --preset=qwen3.5-35b-a3b --layers=16 \
        --runs=resident_decode,resident_prefill --batches=1 --trace_steps=2 ${out:+--out_dir="$out"} ;;
    profile-hybrid-cached)
      for g in 1 8; do
        d="${out:-experiments/results/profiles}/fetch-group-$g"; mkdir -p "$d"
        run 200 "$stage-g$g" experiments/profile_step.py --preset=qwen3.5-35b-a3b --layers=16 --runs=cached_decode \
          --batches=1 --vram_budget_gb=6 --trace_steps=2 --prefill_repeats=0 --fetch_group="$g" --out_dir="$d"
      done ;;
    moe-tiles)
      for p in qwen3-30b-a3b qwen3.5-35b-a3b; do
        for t in 64/64/0/0 128/64/8/0; do
          d="${out:-experiments/results/profiles}/moe-tiles-$p-${t//\//x}"; mkdir -p "$d"
          run 120 "$stage-$p-${t//\//x}" experiments/profile_step.py --preset="$p" --layers=16 --runs=resident_decode \
            --batches=1,4 --trace_steps=2 --prefill_repeats=0 --kernel_tiles=moe_decode:"$t" --out_dir="$d"
        done
      done
      for t in 64/64/0/0 128/64/8/0; do
        run 200 "$stage-48l-${t//\//x}" experiments/bench_decode_speed.py --layers=48 --modes=resident --batches=1,4 \
          --decode_blocks=16 --repeats=3 --trace_steps=0 --kernel_tiles=moe_decode:"$t" \
          --tag="48l-moe-tiles-${t//\//x}_${dev}_$day" ${out:+--out_dir="$out"}
      done ;;
    ab-prefill)
      [ -d .base/ftjax ] || { echo "ab-prefill: no .base/ftjax (see the header)" >&2; exit 2; }
      t0=$SECONDS
      OUT="${out:-experiments/results/ab}" timeout -s INT -k 15 "${LIMIT_ab_prefill:-420}" \
        bash experiments/ab_commits_gpu.sh .base a733c60 prefill_resident,prefill_stream > "$logs/$stage.log" 2>&1
      echo "== $stage rc=$? $((SECONDS - t0)) s"; tail -n 25 "$logs/$stage.log" ;;
    profile-hybrid-nocb)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" run 300 "$stage" experiments/profile_step.py \
        --preset=qwen3.5-35b-a3b --layers=16 --runs=resident_decode --batches=1 --trace_steps=2 \
        ${out:+--out_dir="$out/no-command-buffers"} ;;
    hybrid-int4-budget)
      XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115 run 540 "$stage" experiments/bench_decode.py --preset=qwen3.5-35b-a3b \
        --vram_budgets_gb=12,24 --modes=cached,resident --cache_policies=lru,lookahead --batches=1 --steps=48 \
        --expert_dtypes=int4 ${out:+--out_dir="$out"} ;;
    budget-sampled)
      XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115 run 570 "$stage" experiments/bench_decode.py --vram_budgets_gb=8,12,16,24 \
        --modes=cached,resident --cache_policies=lru,lookahead --batches=1 --steps=48 --temperature=1.0 \
        ${out:+--out_dir="$out"} ;;
    hybrid-batch-probe)
      timeout -s ABRT -k 10 "${LIMIT_hybrid_batch_probe:-200}" python3 -X faulthandler \
        experiments/probe_hybrid_batch_decode.py ${out:+--out_dir="$out"} > "$logs/$stage.log" 2>&1
      echo "== $stage rc=$?"; grep -v -E "^[WI][0-9]{4}" "$logs/$stage.log" | tail -n 40 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
