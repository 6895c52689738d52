r"""Decode with expert offload: resident vs cached (global LRU) vs on_demand, batch 1 and 4, per
expert storage format (--expert_dtypes: bfloat16, int8, int4, fp8, ...: the ftjax.experts.formats registry).

  PYTHONPATH=. python3 experiments/bench_decode.py --out_dir=experiments/results
  .venv/bin/python experiments/bench_decode.py --preset=tiny --dtype=float32 --steps=8 --prompt_len=32 \
      --vram_budget_gb=1.02 --out_dir=/tmp/bench_smoke                         # CPU smoke
  .venv/bin/python experiments/bench_decode.py --preset=tiny --dtype=float32 --steps=4 --prompt_len=16 \
      --vram_budget_gb=1.02 --batches=1 --expert_dtypes=bfloat16,int8,int4,fp8 --out_dir=/tmp/bench_smoke

For each batch and mode: a prompt of --prompt_len tokens is prefilled, then --steps tokens are
decoded with every step timed (TPOT). Every engine runs with the kernel config of the kernel flags
(``--kernels``, ``--kernel_tiles``, ``--min_dot_rows``, ``--decode_graphs``, ... as ``ftjax.generate``;
``EngineConfig.kernels``), which each row's ``engine`` records. Per mode it reports decode tokens/s,
the median step time and its spread, decode hit rate, H2D bytes per step, and
  bound = resident step time + missed bytes per step / B_P
with B_P the pinned_host -> device bandwidth measured in the same run (DESIGN.md 4). Each format
quantizes the random banks once (round to nearest); its memory plan sizes the slots by its own
bytes per expert, and its bound uses its own resident run and its own bytes.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import DTYPES  # noqa: E402
from ftjax.config import EXPERT_MODES, EngineConfig  # noqa: E402
from ftjax.experts import quant  # noqa: E402
from ftjax.experts.slot_table import POLICIES  # noqa: E402
from ftjax.runtime.planner import GB, plan_memory  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_string("dtype", "bfloat16", "Compute and bank dtype.")
flags.DEFINE_float("vram_budget_gb", 8.0, "Device budget that sizes the expert cache.")
flags.DEFINE_list("batches", ["1", "4"], "Batch sizes.")
flags.DEFINE_list("modes", ["resident", "cached", "on_demand"], "Expert modes to compare.")
flags.DEFINE_list("cache_policies", ["lru"], "Slot eviction policies for mode cached (lru, lookahead).")
common.define_expert_dtypes()
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens.", lower_bound=1)
flags.DEFINE_integer("steps", 128, "Decode steps timed.", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON goes.")
flags.DEFINE_string("hlo_dir", None, "If set, write the compiled cached decode step's HLO text here.")
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_names("modes", EXPERT_MODES)
common.check_names("cache_policies", POLICIES)
common.check_names("expert_dtypes", quant.FORMATS)
common.check_numbers("batches", int, low=1)
common.check_preset()
common.check_choice("dtype", DTYPES)


def run_mode(model, mode, slots, batch, max_seq_len, prompts, policy="lru"):
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len, batch=batch,
                                        cache_policy=policy, kernels=common.kernel_config()))
    res = engine.generate(prompts, FLAGS.steps + 1, time_steps=True)
    ec = engine.expert_cache_metrics()
    steps = np.array(res.step_s)
    dec = ec["decode"]
    row = {"mode": mode if mode != "cached" or policy == "lru" else f"cached-{policy}", "batch": batch,
           "policy": policy, "slots": engine.num_slots,
           "decode_tokens_per_s": res.decode_tokens_per_s, "tpot_s": common.spread(steps),
           "ttft_s": res.ttft_s, "compile_s": res.compile_s, "hit_rate_decode": dec["hit_rate"],
           "hit_rate_prefill": ec["prefill"]["hit_rate"],
           "h2d_bytes_per_step": dec["bytes_h2d"] / FLAGS.steps, "misses_per_step": dec["misses"] / FLAGS.steps,
           "prefill_h2d_bytes": ec["prefill"]["bytes_h2d"], "engine": engine.describe()}
    row["achieved_h2d_GBps"] = row["h2d_bytes_per_step"] / float(np.median(steps)) / 1e9
    # Steady-state rate beside the wall-clock one: a single slow step (seen up to 0.75 s on the H200)
    # drags decode_tokens_per_s; which steps they were says whether it is the first step or a stall.
    row["decode_tokens_per_s_median_tpot"] = batch / float(np.median(steps))
    slow = np.argsort(-steps, kind="stable")[:3]
    row["slowest_steps_ms"] = [[int(i), round(float(steps[i]) * 1e3, 3)] for i in slow]
    if FLAGS.hlo_dir and mode == "cached" and policy == "lru":
        row["decode_hlo"] = dump_decode_hlo(engine, batch)
    del engine, res
    gc.collect()
    return row


def dump_decode_hlo(engine, batch: int) -> dict:
    """Writes the compiled cached decode step's HLO (of ``engine``'s programs) and returns counts of the ops
    that show whether expert copies are asynchronous (copy-start/copy-done) or synchronous."""
    for _, static, shapes, exe in common.engine_programs(engine, "forward_step"):
        if static["opts"].mode == "cached" and (batch, 1) in [s[0] for s in shapes]:
            text = exe.as_text()
            path = os.path.join(FLAGS.hlo_dir, f"decode_cached_b{batch}.hlo.txt")
            os.makedirs(FLAGS.hlo_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            return {"path": os.path.basename(path), **common.hlo_ops(text)}
    return {}


def main(argv):
    del argv
    info = common.meta()
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype)
    bp_gbps = bp["h2d_GBps"]["median"]
    print(f"{info['device']}: random {FLAGS.preset} built in {build_s:.1f} s; B_P = {bp_gbps:.1f} GB/s", flush=True)
    itemsize = np.dtype(DTYPES[FLAGS.dtype]).itemsize
    max_seq_len = -(-(FLAGS.prompt_len + FLAGS.steps + 1) // 128) * 128
    rng = np.random.default_rng(0)
    rows, plans = [], {}
    prompts_of = {b: [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(b)]
                  for b in map(int, FLAGS.batches)}
    for fmt in FLAGS.expert_dtypes or [None]:
        fmodel = model if fmt is None else dataclasses.replace(model, banks=quant.quantize_banks(model.banks, fmt))
        label = fmt or model.banks.fmt
        print(f"experts stored {label}: {fmodel.banks.fmt} {fmodel.banks.gate_up.dtype}, "
              f"{fmodel.expert_bytes / 1e6:.3f} MB per expert", flush=True)
        for batch in map(int, FLAGS.batches):
            try:
                plan = plan_memory(cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB), batch=batch,
                                   max_seq_len=max_seq_len, expert_bytes=fmodel.expert_bytes)
            except ValueError as e:  # the budget does not fit this batch / format
                raise app.UsageError(f"--vram_budget_gb={FLAGS.vram_budget_gb} ({label}, batch {batch}): {e}") from None
            plans[f"{label}/b{batch}"] = plan.as_dict()
            print(plan.describe(), flush=True)
            # offloading modes first: resident needs the whole pool on the device
            runs = [(m, p) for m in sorted(FLAGS.modes, key=lambda m: m == "resident")
                    for p in (FLAGS.cache_policies if m == "cached" else ["lru"])]
            for mode, policy in runs:
                try:
                    row = run_mode(fmodel, mode, plan.slots, batch, max_seq_len, prompts_of[batch], policy)
                except Exception as e:  # record and go on: one failing mode must not lose the others
                    row = {"mode": mode, "batch": batch, "error": f"{type(e).__name__}: {e}"[:2000]}
                row.update(expert_dtype=label, expert_bytes=fmodel.expert_bytes)
                rows.append(row)
                print({k: v for k, v in row.items() if k != "tpot_s"}, flush=True)
                # partial file after every run: a run cut short by a time limit keeps what it measured
                common.write_json(FLAGS.out_dir, f"bench_decode_{FLAGS.preset}.json",
                                  {"meta": info, "partial": True, "B_P": bp, "results": rows})
        del fmodel
        gc.collect()
    # bound and ratio per (format, batch, offloading mode), against resident of the same format and batch
    for row in rows:
        res = next((r for r in rows if r["mode"] == "resident" and r["batch"] == row["batch"] and "tpot_s" in r
                    and r["expert_dtype"] == row["expert_dtype"]), None)
        if res is None or "tpot_s" not in row:
            continue
        row["bound_step_s"] = res["tpot_s"]["median"] + row["h2d_bytes_per_step"] / (bp_gbps * 1e9)
        row["ratio_to_bound"] = row["tpot_s"]["median"] / row["bound_step_s"]
    for row in rows:  # speed-up of each format over the first format's same mode and batch
        ref = next((r for r in rows if r["expert_dtype"] == rows[0]["expert_dtype"] and r["mode"] == row["mode"]
                    and r["batch"] == row["batch"] and r.get("decode_tokens_per_s")), None)
        if ref and row.get("decode_tokens_per_s"):
            row["speedup_vs_first_format"] = row["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
            if ref.get("decode_tokens_per_s_median_tpot") and row.get("decode_tokens_per_s_median_tpot"):
                row["speedup_vs_first_format_median_tpot"] = (row["decode_tokens_per_s_median_tpot"]
                                                              / ref["decode_tokens_per_s_median_tpot"])
    payload = {"meta": info, "script": "experiments/bench_decode.py", "expert_dtypes": FLAGS.expert_dtypes,
               "model_build_s": build_s, "B_P": bp, "memory_plans": plans, "results": rows}
    name = f"bench_decode_{FLAGS.preset}.json"
    path = common.write_json(FLAGS.out_dir, name, payload)
    flat = [dict(r, tpot_ms=r["tpot_s"]["median"] * 1e3 if "tpot_s" in r else None,
                 MB_per_step=r.get("h2d_bytes_per_step", 0) / 1e6) for r in rows]
    print(common.table(flat, ["expert_dtype", "mode", "batch", "decode_tokens_per_s", "speedup_vs_first_format",
                              "speedup_vs_first_format_median_tpot", "tpot_ms", "hit_rate_decode", "MB_per_step",
                              "achieved_h2d_GBps", "ratio_to_bound"]))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
