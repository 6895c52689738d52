r"""Decode tokens/s by GPU memory budget: resident vs cached (per cache policy) vs on_demand, batch 1 and 4, per
expert storage format (--expert_dtypes: bfloat16, int8, int4, fp8, ...: the ftjax.experts.formats registry),
over one budget or a sweep of budgets in one process.

  PYTHONPATH=. python3 experiments/bench_decode.py --out_dir=experiments/results/decode_by_budget
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115 PYTHONPATH=. python3 experiments/bench_decode.py \
      --vram_budgets_gb=7,8,12,16,24 --modes=cached,resident --cache_policies=lru,lookahead --batches=1 --steps=64 \
      --expert_dtypes=bfloat16,int4 --out_dir=$OUT/decode_by_budget                # the decode-by-budget figure
  .venv/bin/python experiments/bench_decode.py --preset=tiny --dtype=float32 --steps=8 --prompt_len=32 \
      --vram_budget_gb=1.02 --out_dir=/tmp/bench_smoke                         # CPU smoke
  .venv/bin/python experiments/bench_decode.py --preset=tiny --dtype=float32 --steps=8 --prompt_len=32 \
      --vram_budgets_gb=1.01,1.015,1.02 --batches=1 --modes=cached,resident --out_dir=/tmp/bench_smoke   # a CPU sweep
  .venv/bin/python experiments/bench_decode.py --preset=tiny --dtype=float32 --steps=4 --prompt_len=16 \
      --vram_budget_gb=1.02 --batches=1 --expert_dtypes=bfloat16,int8,int4,fp8 --out_dir=/tmp/bench_smoke

The random model is built once (30-40 s at qwen3-30b-a3b) and each format quantized once. Then, per format and
batch, for each budget (``--vram_budgets_gb``, in the order given, or the one ``--vram_budget_gb``; GB = 1e9 bytes)
the memory plan sizes the slot cache and each offloading mode (cached once per ``--cache_policies``, on_demand) runs
on an engine of its own, deleted and its device memory collected before the next setting; each row's
``device_bytes_after`` is what was still in use after that (the same after every setting of a format when no
engine keeps anything). resident does not depend on the budget: it runs once per format and batch, after the
budgets, and its row's ``budget_gb`` is the budget its plan needs (the whole pool on the device, rounded up to
1 MB). Every budget is planned before the model is built: one below a plan's minimum stops the run at once with
one ``error:`` line naming it and the minimum. Bad flag values (a budget <= 0, a budget given twice, both budget
flags, an unknown mode, policy or format) stop it when the flags are parsed.

For each setting: a prompt of --prompt_len tokens is prefilled, then --steps tokens are decoded with every step
timed (TPOT). Every engine runs with the kernel config of the kernel flags (``--kernels``, ``--kernel_tiles``,
``--min_dot_rows``, ``--decode_graphs``, ... as ``ftjax.generate``; ``EngineConfig.kernels``), which each row's
``engine`` records. One JSON, ``bench_decode_<preset>.json``, holds a row per setting (``results``: mode, policy,
batch, expert_dtype, budget_gb, slots, decode tokens/s, the median step time and its spread, decode hit rate, H2D
bytes per step, ...; ``memory_plans`` keyed ``<format>/b<batch>/<budget>gb`` and ``<format>/b<batch>/resident``),
and per offloading row
  bound = resident step time + missed bytes per step / B_P
with B_P the pinned_host -> device bandwidth measured in the same run (DESIGN.md 4). Each format's memory plan
sizes the slots by its own bytes per expert, and its bound uses its own resident run and its own bytes.
``experiments/plots.py --kind=line --x=budget_gb --y=decode_tokens_per_s --series=mode,expert_dtype`` draws the
curve (docs/FIGURES.md).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import DTYPES  # noqa: E402
from ftjax.config import EXPERT_MODES, EngineConfig, preset  # noqa: E402
from ftjax.experts import quant  # noqa: E402
from ftjax.experts.slot_table import POLICIES  # noqa: E402
from ftjax.runtime.planner import GB, plan_memory  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_string("dtype", "bfloat16", "Compute and bank dtype.")
#: The budget of a run given neither budget flag (GB).
DEFAULT_BUDGET_GB = 8.0
flags.DEFINE_float("vram_budget_gb", None, "Device budget in GB (1e9 bytes) that sizes the expert cache: one budget "
                   f"(default {DEFAULT_BUDGET_GB:g}); --vram_budgets_gb sweeps several.")
flags.DEFINE_list("vram_budgets_gb", None, "Device budgets in GB (1e9 bytes) swept in this process over one built "
                  "model, e.g. 8,12,16,24: a row per budget and offloading mode (instead of --vram_budget_gb; "
                  "resident, in --modes, runs once).")
flags.DEFINE_list("batches", ["1", "4"], "Batch sizes.")
flags.DEFINE_list("modes", ["resident", "cached", "on_demand"], "Expert modes to compare.")
flags.DEFINE_list("cache_policies", ["lru"], f"Slot eviction policies for mode cached ({', '.join(POLICIES)}).")
common.define_expert_dtypes()
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens.", lower_bound=1)
flags.DEFINE_integer("steps", 128, "Decode steps timed.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature of the decode (0: greedy). Random weights decode "
                   "greedily into one repeated token whose experts then stay cached (hits near 1 above the budget that "
                   "holds one token's experts); sampling at 1.0 keeps the tokens, and so the routing, varied.",
                   lower_bound=0.0)
flags.DEFINE_string("out_dir", "experiments/results/decode_by_budget", "Where the JSON goes.")
flags.DEFINE_string("hlo_dir", None, "If set, write the compiled cached decode step's HLO text here.")
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_names("modes", EXPERT_MODES)
common.check_names("cache_policies", POLICIES)
common.check_names("expert_dtypes", quant.FORMATS)
common.check_numbers("batches", int, low=1)
common.validate("vram_budget_gb", lambda v: None if v is None or v > 0 else f"expected a budget > 0 GB, got {v:g}")
common.check_preset()
common.check_choice("dtype", DTYPES)


def budget_error(values: list[str] | None) -> str | None:
    """Why a ``--vram_budgets_gb`` list is refused, or None when it is good (or unset): each entry a finite number
    > 0 (GB), none given twice, at least one."""
    if values is None:
        return None
    try:
        xs = [float(v) for v in values]
    except ValueError:
        return f"expected budgets in GB (numbers > 0), got {','.join(values)}"
    if not xs:
        return "give at least one budget (GB)"
    bad = [v for v, x in zip(values, xs) if not (math.isfinite(x) and x > 0)]
    if bad:
        return f"expected budgets > 0 GB, got {', '.join(bad)}"
    twice = [v for i, (v, x) in enumerate(zip(values, xs)) if x in xs[:i]]
    return f"budget {', '.join(twice)} given twice" if twice else None


common.validate("vram_budgets_gb", budget_error)
flags.register_multi_flags_validator(
    ["vram_budget_gb", "vram_budgets_gb"], lambda d: d["vram_budget_gb"] is None or d["vram_budgets_gb"] is None,
    "give --vram_budget_gb (one budget) or --vram_budgets_gb (several), not both")


def budgets_gb() -> list[float]:
    """The budgets of the run in GB (1e9 bytes), in the order given: ``--vram_budgets_gb``, else
    [``--vram_budget_gb``] (default :data:`DEFAULT_BUDGET_GB`)."""
    if FLAGS.vram_budgets_gb is not None:
        return [float(v) for v in FLAGS.vram_budgets_gb]
    return [FLAGS.vram_budget_gb if FLAGS.vram_budget_gb is not None else DEFAULT_BUDGET_GB]


def mode_name(mode: str, policy: str) -> str:
    """A row's ``mode``: the experts mode, ``cached-<policy>`` for a cached run whose policy is not lru."""
    return mode if mode != "cached" or policy == "lru" else f"cached-{policy}"


def plan_budget(cfg, itemsize: int, budget_gb: float, batch: int, max_seq_len: int, expert_bytes: int, label: str):
    """The memory plan (``ftjax.runtime.planner.MemoryPlan``) of one budget of ``budget_gb`` GB (1e9 bytes) for
    ``batch`` sequences of ``max_seq_len`` tokens and experts of ``expert_bytes`` bytes (format ``label``).

    Raises:
      app.UsageError: the budget leaves fewer than E slots; the message names the budget flag, the format
        and the batch, and gives the minimum budget."""
    try:
        return plan_memory(cfg, itemsize, budget_bytes=int(budget_gb * GB), batch=batch, max_seq_len=max_seq_len,
                           expert_bytes=expert_bytes, kernels=common.kernel_config())
    except ValueError as e:  # the budget does not fit this batch / format
        flag = "vram_budgets_gb" if FLAGS.vram_budgets_gb is not None else "vram_budget_gb"
        raise app.UsageError(f"--{flag}: {budget_gb:g} GB ({label}, batch {batch}): {e}") from None


def stored_expert_bytes(cfg, fmt: str | None, itemsize: int) -> int:
    """Bytes of one expert of ``cfg`` as format ``fmt`` stores it (None: the banks as built, ``itemsize`` bytes
    per weight; the dense format "bfloat16" stores 2), what ``ExpertBanks.expert_bytes`` gives after
    ``quant.quantize_banks``: known before the banks are built."""
    if fmt is None:
        return cfg.expert_bytes(itemsize)
    return quant.expert_bytes(fmt, cfg.hidden_size, cfg.expert_ffn, 2)


def run_mode(model, mode, slots, batch, max_seq_len, prompts, policy="lru", hlo_tag=""):
    """One setting's row: an engine of ``mode`` (``slots`` expert slots; resident ignores them) and cache ``policy``
    prefills ``prompts`` (``batch`` lists of token ids) and decodes ``--steps`` tokens, every step timed. The engine
    is deleted and collected before this returns. ``hlo_tag``: part of the HLO file's name (``--hlo_dir``)."""
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len, batch=batch,
                                        cache_policy=policy, kernels=common.kernel_config()))
    res = engine.generate(prompts, FLAGS.steps + 1, temperature=FLAGS.temperature, time_steps=True)
    ec = engine.expert_cache_metrics()
    steps = np.array(res.step_s)
    dec = ec["decode"]
    row = {"mode": mode_name(mode, policy), "batch": batch, "policy": policy, "slots": engine.num_slots,
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
        row["decode_hlo"] = dump_decode_hlo(engine, batch, hlo_tag)
    del engine, res
    gc.collect()
    return row


def run_setting(model, label: str, mode: str, policy: str, slots: int, budget_gb: float, batch: int,
                max_seq_len: int, prompts) -> dict:
    """:func:`run_mode`'s row with the setting's format ``label``, bytes per expert and ``budget_gb``, and
    ``device_bytes_after``: the device bytes in use once its engine is gone (``common.device_bytes_in_use``). A
    setting that raises gives a row with its ``error`` instead: one failing setting must not lose the others."""
    try:
        row = run_mode(model, mode, slots, batch, max_seq_len, prompts, policy, hlo_tag=f"{label}_{budget_gb:g}gb")
    except Exception as e:  # record and go on
        row = {"mode": mode_name(mode, policy), "batch": batch, "policy": policy,
               "error": f"{type(e).__name__}: {e}"[:2000]}
    gc.collect()  # after an error the engine lived in the traceback, gone now
    row.update(expert_dtype=label, expert_bytes=model.expert_bytes, budget_gb=budget_gb,
               device_bytes_after=common.device_bytes_in_use())
    return row


def dump_decode_hlo(engine, batch: int, tag: str = "") -> dict:
    """Writes the compiled cached decode step's HLO (of ``engine``'s programs) to
    ``--hlo_dir``/decode_cached_b<batch>[_<tag>].hlo.txt and returns counts of the ops that show whether expert
    copies are asynchronous (copy-start/copy-done) or synchronous."""
    for _, static, shapes, exe in common.engine_programs(engine, "forward_step"):
        if static["opts"].mode == "cached" and (batch, 1) in [s[0] for s in shapes]:
            text = exe.as_text()
            path = os.path.join(FLAGS.hlo_dir, f"decode_cached_b{batch}{'_' + tag if tag else ''}.hlo.txt")
            os.makedirs(FLAGS.hlo_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            return {"path": os.path.basename(path), **common.hlo_ops(text)}
    return {}


def resident_budget_gb(plan) -> float:
    """The budget (GB, 1e9 bytes) a resident plan needs, rounded up to 1 MB: where its row sits on a budget axis."""
    return math.ceil(plan.budget_bytes / 1e6) / 1e3


def same_setting(a: dict, b: dict) -> bool:
    """Whether rows ``a`` and ``b`` are the same mode, batch and budget (resident: any budget, it has one run)."""
    return (a["mode"] == b["mode"] and a["batch"] == b["batch"]
            and (a["mode"] == "resident" or a.get("budget_gb") == b.get("budget_gb")))


def add_bounds(rows: list[dict], bp_gbps: float) -> None:
    """Adds to each offloading row its bound (resident step time of the same format and batch + missed bytes per
    step / B_P, ``bp_gbps`` GB/s) and its ratio to it, and to each row its speed-up over the first format's same
    setting (:func:`same_setting`)."""
    for row in rows:
        res = next((r for r in rows if r["mode"] == "resident" and r["batch"] == row["batch"] and "tpot_s" in r
                    and r["expert_dtype"] == row["expert_dtype"]), None)
        if res is None or "tpot_s" not in row:
            continue
        row["bound_step_s"] = res["tpot_s"]["median"] + row["h2d_bytes_per_step"] / (bp_gbps * 1e9)
        row["ratio_to_bound"] = row["tpot_s"]["median"] / row["bound_step_s"]
    for row in rows:  # speed-up of each format over the first format's same setting
        ref = next((r for r in rows if r["expert_dtype"] == rows[0]["expert_dtype"] and same_setting(r, row)
                    and r.get("decode_tokens_per_s")), None)
        if ref and row.get("decode_tokens_per_s"):
            row["speedup_vs_first_format"] = row["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
            if ref.get("decode_tokens_per_s_median_tpot") and row.get("decode_tokens_per_s_median_tpot"):
                row["speedup_vs_first_format_median_tpot"] = (row["decode_tokens_per_s_median_tpot"]
                                                              / ref["decode_tokens_per_s_median_tpot"])


def main(argv):
    del argv
    cfg = preset(FLAGS.preset)
    itemsize = np.dtype(DTYPES[FLAGS.dtype]).itemsize
    max_seq_len = -(-(FLAGS.prompt_len + FLAGS.steps + 1) // 128) * 128
    budgets = budgets_gb()
    batches = [int(b) for b in FLAGS.batches]
    offloading = [m for m in FLAGS.modes if m != "resident"]
    formats = FLAGS.expert_dtypes or [None]
    for fmt in formats if offloading else []:  # every budget planned before the model is built: a bad one stops now
        for batch in batches:
            for b in budgets:
                plan_budget(cfg, itemsize, b, batch, max_seq_len, stored_expert_bytes(cfg, fmt, itemsize),
                            fmt or "dense")
    info = common.meta()
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype)
    bp_gbps = bp["h2d_GBps"]["median"]
    print(f"{info['device']}: random {FLAGS.preset} built in {build_s:.1f} s; B_P = {bp_gbps:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows, plans = [], {}
    prompts_of = {b: [rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(b)] for b in batches}
    runs = [(m, p) for m in offloading for p in (FLAGS.cache_policies if m == "cached" else ["lru"])]

    def record(row):
        rows.append(row)
        what = (f"{row.get('expert_dtype')} {row.get('budget_gb')} GB {row['mode']} b{row['batch']}: "
                f"{row.get('slots')} slots, ")
        print(what + (f"error {row['error'][:300]}" if "error" in row else
                      f"{row['decode_tokens_per_s']:.2f} tok/s, decode hits {row['hit_rate_decode']:.3f}, "
                      f"compile {row['compile_s']:.1f} s"), flush=True)
        # partial file after every run: a run cut short by a time limit keeps what it measured
        common.write_json(FLAGS.out_dir, f"bench_decode_{FLAGS.preset}.json",
                          {"meta": info, "partial": True, "B_P": bp, "budgets_gb": budgets, "memory_plans": plans,
                           "results": rows})

    for fmt in formats:
        fmodel = model if fmt is None else dataclasses.replace(model, banks=quant.quantize_banks(model.banks, fmt))
        label = fmt or model.banks.fmt
        print(f"experts stored {label}: {fmodel.banks.fmt} {fmodel.banks.gate_up.dtype}, "
              f"{fmodel.expert_bytes / 1e6:.3f} MB per expert", flush=True)
        for batch in batches:
            for b in budgets if runs else []:
                plan = plan_budget(cfg, itemsize, b, batch, max_seq_len, fmodel.expert_bytes, label)
                plans[f"{label}/b{batch}/{b:g}gb"] = plan.as_dict()
                print(plan.describe(), flush=True)
                for mode, policy in runs:
                    record(run_setting(fmodel, label, mode, policy, plan.slots, b, batch, max_seq_len,
                                       prompts_of[batch]))
            if "resident" in FLAGS.modes:  # last: it needs the whole pool on the device
                plan = plan_memory(cfg, itemsize, slots=cfg.num_layers * cfg.num_experts, batch=batch,
                                   max_seq_len=max_seq_len, expert_bytes=fmodel.expert_bytes,
                                   kernels=common.kernel_config())
                plans[f"{label}/b{batch}/resident"] = plan.as_dict()
                record(run_setting(fmodel, label, "resident", "lru", plan.slots, resident_budget_gb(plan), batch,
                                   max_seq_len, prompts_of[batch]))
        del fmodel
        gc.collect()
    add_bounds(rows, bp_gbps)
    payload = {"meta": info, "script": "experiments/bench_decode.py", "expert_dtypes": FLAGS.expert_dtypes,
               "budgets_gb": budgets, "model_build_s": build_s, "B_P": bp, "memory_plans": plans, "results": rows}
    name = f"bench_decode_{FLAGS.preset}.json"
    path = common.write_json(FLAGS.out_dir, name, payload)
    flat = [dict(r, tpot_ms=r["tpot_s"]["median"] * 1e3 if "tpot_s" in r else None,
                 MB_per_step=r.get("h2d_bytes_per_step", 0) / 1e6) for r in rows]
    print(common.table(flat, ["expert_dtype", "budget_gb", "mode", "batch", "slots", "decode_tokens_per_s",
                              "speedup_vs_first_format", "speedup_vs_first_format_median_tpot", "tpot_ms",
                              "hit_rate_decode", "MB_per_step", "achieved_h2d_GBps", "ratio_to_bound"]))
    print("wrote", path)


if __name__ == "__main__":
    common.run(main)
