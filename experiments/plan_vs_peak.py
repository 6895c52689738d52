r"""The memory planner against the device: planned bytes vs peak device memory actually used.

  PYTHONPATH=. .venv/bin/python experiments/plan_vs_peak.py --out_dir=experiments/results/checks          # GPU
  PYTHONPATH=. .venv/bin/python experiments/plan_vs_peak.py --isolate --out_dir=experiments/results/checks  # exact
  PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/plan_vs_peak.py --preset=tiny \
      --budgets_gb=1.02,8 --lengths=64,256 --steps=2 --out_dir=/tmp/pvp                             # CPU smoke

GPU runtime (estimate, not measured: the lead runs it): ~4-6 min for the default cases; the
qwen3-30b-a3b child builds its 58 GB random pool in pinned host memory once (~20-40 s, needs
~60 GB of the host's 128 GiB), then compiles two programs per case (~15-30 s each at 8192
tokens). --time_budget_s (default 330) stops starting new cases after that long; the skipped
ones are listed. --isolate (one child process per case, exact peaks) costs one pool build per
case: ~2 min more. CPU smoke: ~30 s.

Cases: each --presets (default qwen3-30b-a3b, olmoe-1b-7b) x --budgets_gb (8, 24) x --lengths
(512, 8192, 16384 prompt tokens; a length beyond the preset's positions is clipped to the
longest prompt that fits, e.g. olmoe's 4096, and run once). Each case builds the engine as
``python -m ftjax.generate --preset=P --vram_budget_gb=B --prompt_len=N`` does (batch 1, random
bf16 weights, max_seq_len = prompt + new tokens rounded up to 128, ``plan_memory`` from the
budget, resident if the pool fits else cached, default prefill options), then runs one prefill
and --steps decode steps (greedy). Recorded per case: the plan (``MemoryPlan.as_dict()``;
``planned_bytes`` = its parts summed: non-expert weights + KV + workspace + layer gather + slots;
a budget the planner refuses is recorded as ``plan_error``), and the device's
``memory_stats()["peak_bytes_in_use"]`` (bytes) after compiling and after running.

Peaks per process: XLA's allocator peak cannot be reset, so each preset runs in its own child
process (XLA_PYTHON_CLIENT_PREALLOCATE=false), cases in increasing (budget, length) order. A
reading that rose during a case is that case's exact peak (``peak_exact``); one that did not
bounds it from above (an earlier case, or building the random pool, set it). Verdict per case:
``ok`` (peak, or its bound, <= planned), ``PLAN_BELOW_PEAK`` (an exact peak above the plan:
the fault the issue names), ``inconclusive`` (a bound above the plan; rerun with --isolate), or
None where the backend has no memory_stats (CPU). The peak counts XLA's allocator only
(buffers, temporaries, compile-time autotuning scratch); the CUDA context and kernels' code
(a few hundred MB) are outside it and outside the plan.

Every engine (the planner's probe too) runs with the kernel config of the kernel flags (``--kernels``,
``--kernel_tiles``, ... as ``ftjax.generate``; ``EngineConfig.kernels``), passed on to the children;
each row records its engine's config (``engine``).

Output: one JSON, ``plan_vs_peak.json``: ``meta`` (of the first child), flags, rows, the flagged
cases. Sizes in bytes (GB = 1e9).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("presets", ["qwen3-30b-a3b", "olmoe-1b-7b"], "Model shapes (random weights).")
flags.DEFINE_string("preset", None, "One preset instead of --presets (e.g. tiny for the CPU smoke run).")
flags.DEFINE_list("budgets_gb", ["8", "24"], "VRAM budgets in GB (1e9 bytes).")
flags.DEFINE_list("lengths", ["512", "8192", "16384"], "Prompt lengths in tokens.")
flags.DEFINE_string("dtype", "bfloat16", "Weight, compute and KV dtype.")
flags.DEFINE_integer("steps", 4, "Decode steps after the prefill.")
flags.DEFINE_boolean("isolate", False, "One child process per case (exact peaks; one pool build per case).")
flags.DEFINE_float("time_budget_s", 330.0, "Start no new case after this many seconds (whole run).")
flags.DEFINE_integer("seed", 0, "Prompt and weight seed.")
flags.DEFINE_string("child", None, "Internal: run these cases (JSON) in this process, one JSON line each.")
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_preset("presets")
common.check_preset("preset")
common.check_numbers("budgets_gb", float, low=0)
common.check_numbers("lengths", int, low=1)
common.check_choice("dtype", ("float32", "bfloat16", "float16"))
flags.register_validator("steps", lambda v: v >= 1, "must be >= 1")


# ---- one case, in the child ------------------------------------------------------------------
def peak_bytes() -> int | None:
    """peak_bytes_in_use of the default device, or None where memory_stats is absent (CPU)."""
    from ftjax import memory
    stats = memory.default_device().memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def in_use_bytes() -> int | None:
    from ftjax import memory
    stats = memory.default_device().memory_stats()
    return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None


def prompt_len_for(cfg, requested: int, steps: int) -> int:
    """``requested`` clipped so that prompt + steps + 1 new tokens fit max_position_embeddings."""
    return min(requested, cfg.max_position_embeddings - (steps + 1))


def plan_case(model, budget_gb: float, prompt: list[int], steps: int):
    """(EngineConfig, MemoryPlan, max_seq_len) as ``ftjax.generate`` chooses them for
    ``--vram_budget_gb=budget_gb`` and this prompt with ``--max_new_tokens=steps+1`` (batch 1):
    ``ftjax.runtime.planner.plan_run``, the workspace measured on the compiled steps.
    Raises ValueError where the planner refuses the budget."""
    from ftjax.config import EngineConfig
    from ftjax.runtime.planner import GB, plan_run
    cfg = model.cfg
    need = len(prompt) + steps + 1
    max_seq_len = min(-(-need // 128) * 128, cfg.max_position_embeddings)
    base = EngineConfig("cached", num_slots=min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts),
                        max_seq_len=max_seq_len, kernels=common.kernel_config())
    config, plan = plan_run(model, base, [prompt], budget_bytes=int(budget_gb * GB), mode="auto")
    return config, plan, max_seq_len


def run_engine(model, config, prompt: list[int], steps: int) -> dict:
    """The one place the engine is built and run (adapt here when the Engine API changes): with the
    planned ``config``, as ``ftjax.generate`` builds it (default prefill options, LRU, fetch misses).
    Compiles first (the peak after compiling is read apart: XLA:GPU's autotuning allocates scratch),
    then one prefill and ``steps`` decode steps."""
    from ftjax import Engine
    engine = Engine(model, config)
    engine.prepare_prefill([prompt], engine.new_cache(1))  # generate() would compile here too
    out = {"peak_after_compile": peak_bytes()}
    res = engine.generate([prompt], steps + 1)
    out.update(peak_after_run=peak_bytes(), ttft_s=res.ttft_s, decode_tokens_per_s=res.decode_tokens_per_s,
               compile_s=res.compile_s, streamed_prefill=engine.planner.streams(len(prompt)),
               hit_rate=engine.expert_cache_metrics()["hit_rate"], engine=engine.describe())
    del engine, res
    gc.collect()
    return out


def verdict(planned: int, peak: int | None, exact: bool) -> str | None:
    if peak is None:
        return None
    if peak <= planned:
        return "ok"
    return "PLAN_BELOW_PEAK" if exact else "inconclusive"


def run_case(model, preset_name: str, budget_gb: float, requested_len: int, steps: int, rng) -> dict:
    """One (budget, prompt length) case of the preset ``preset_name``: the row of the JSON."""
    cfg = model.cfg
    n = prompt_len_for(cfg, requested_len, steps)
    row = {"preset": preset_name, "budget_gb": budget_gb, "requested_prompt_len": requested_len,
           "prompt_len": n, "steps": steps}
    prompt = rng.integers(0, cfg.vocab_size, n).tolist()
    try:
        config, plan, max_seq_len = plan_case(model, budget_gb, prompt, steps)
    except ValueError as e:
        row["plan_error"] = str(e)
        return row
    planned = plan.planned_bytes
    row.update(mode=config.experts, max_seq_len=max_seq_len, plan=plan.as_dict(), planned_bytes=planned)
    before = peak_bytes()
    row["peak_before"], row["in_use_before"] = before, in_use_bytes()
    t0 = time.perf_counter()
    try:
        row.update(run_engine(model, config, prompt, steps))
    except Exception as e:  # noqa: BLE001 -- an out-of-memory or other failure is the finding
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["peak_after_run"] = peak_bytes()
    row["wall_s"] = time.perf_counter() - t0
    peak = row.get("peak_after_run")
    if peak is not None:
        row["peak_bytes"] = peak
        row["peak_exact"] = peak > before
        row["peak_set_by"] = ("run" if peak > (row.get("peak_after_compile") or before) else
                              "compile" if peak > before else "earlier")
        row["peak_minus_planned"] = peak - planned
        row["peak_over_planned"] = peak / planned
    row["verdict"] = verdict(planned, peak, bool(row.get("peak_exact")))
    return row


def child_main(spec: dict) -> None:
    """Builds the preset's random model once and runs ``spec["cases"]`` ([budget_gb, length]
    pairs) in order, printing one JSON line each (``{"meta": ...}`` first)."""
    from ftjax.checkpoint import random_model
    from ftjax.config import preset
    print(json.dumps({"meta": common.meta()}), flush=True)
    cfg = preset(spec["preset"])
    t0 = time.perf_counter()
    model = random_model(cfg, FLAGS.dtype, seed=FLAGS.seed)
    model.host_down.block_until_ready()
    print(json.dumps({"build": {"preset": spec["preset"], "build_s": time.perf_counter() - t0,
                                "peak_after_build": peak_bytes(), "in_use_after_build": in_use_bytes(),
                                "pool_bytes": model.expert_bytes * cfg.num_layers * cfg.num_experts}}), flush=True)
    rng = np.random.default_rng(FLAGS.seed)
    for budget, length in spec["cases"]:
        if time.time() > spec["deadline"]:
            print(json.dumps({"skipped": [spec["preset"], budget, length]}), flush=True)
            continue
        print(json.dumps({"row": run_case(model, spec["preset"], budget, length, FLAGS.steps, rng)}), flush=True)


# ---- the parent: children, JSON --------------------------------------------------------------
def run_child(preset_name: str, cases: list, deadline: float) -> list[dict]:
    """Runs a child process for ``cases``; returns its JSON lines (a crash is recorded)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    spec = json.dumps({"preset": preset_name, "cases": cases, "deadline": deadline})
    args = [sys.executable, os.path.abspath(__file__), f"--child={spec}", f"--dtype={FLAGS.dtype}",
            f"--steps={FLAGS.steps}", f"--seed={FLAGS.seed}", *common.kernel_flag_args()]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=max(60.0, deadline - time.time() + 600))
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0:
        lines.append({"child_error": {"preset": preset_name, "cases": cases, "returncode": p.returncode,
                                      "stderr_tail": p.stderr[-3000:]}})
    return lines


def cases_for(preset_name: str) -> list[list]:
    """[budget_gb, requested length] pairs in run order; lengths that clip to the same prompt run once."""
    from ftjax.config import preset
    cfg = preset(preset_name)
    out, seen = [], set()
    for b in sorted(float(x) for x in FLAGS.budgets_gb):
        for n in sorted(int(x) for x in FLAGS.lengths):
            key = (b, prompt_len_for(cfg, n, FLAGS.steps))
            if key not in seen:
                seen.add(key)
                out.append([b, n])
    return out


def main(argv):
    del argv
    if FLAGS.child:
        child_main(json.loads(FLAGS.child))
        return
    t0 = time.perf_counter()
    deadline = time.time() + FLAGS.time_budget_s
    presets = [FLAGS.preset] if FLAGS.preset else FLAGS.presets
    info, builds, rows, skipped, errors = None, [], [], [], []
    for name in presets:
        cases = cases_for(name)
        groups = [[c] for c in cases] if FLAGS.isolate else [cases]
        for group in groups:
            n_before = len(rows)
            for line in run_child(name, group, deadline):
                info = info or line.get("meta")
                builds += [line["build"]] if "build" in line else []
                rows += [line["row"]] if "row" in line else []
                skipped += [line["skipped"]] if "skipped" in line else []
                errors += [line["child_error"]] if "child_error" in line else []
            for r in rows[n_before:]:
                print({k: r.get(k) for k in ("preset", "budget_gb", "prompt_len", "mode", "planned_bytes",
                                             "peak_bytes", "peak_exact", "verdict", "plan_error", "error")},
                      flush=True)
    flagged = [r for r in rows if r.get("verdict") == "PLAN_BELOW_PEAK" or "error" in r]
    payload = {"meta": info, "script": "experiments/plan_vs_peak.py",
               "flags": {k: FLAGS[k].value for k in ("presets", "preset", "budgets_gb", "lengths", "dtype", "steps",
                                                      "isolate", "time_budget_s", "seed") + common.KERNEL_FLAGS},
               "builds": builds, "results": rows, "skipped": skipped, "child_errors": errors,
               "plan_below_peak": [f"{r['preset']}/{r['budget_gb']}GB/{r['prompt_len']}" for r in flagged],
               "wall_s": time.perf_counter() - t0}
    path = common.write_json(FLAGS.out_dir, "plan_vs_peak.json", payload)
    gb = lambda v: None if v is None else v / 1e9  # noqa: E731
    print(common.table([dict(r, planned_GB=gb(r.get("planned_bytes")), peak_GB=gb(r.get("peak_bytes"))) for r in rows],
                       ["preset", "budget_gb", "prompt_len", "mode", "planned_GB", "peak_GB", "peak_exact", "verdict"]))
    if flagged:
        print("plan below the peak (or failed):", ", ".join(payload["plan_below_peak"]))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
