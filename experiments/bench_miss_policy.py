r"""Decode tokens/s with cache misses fetched, computed on the CPU, or split by the calibrated q*.

  PYTHONPATH=. python3 experiments/bench_miss_policy.py --out_dir=$OUT            # GPU (H200)
  .venv/bin/python experiments/bench_miss_policy.py --preset=tiny --steps=8 --out_dir=/tmp/bench_smoke  # CPU smoke
  PYTHONPATH=. python3 experiments/bench_miss_policy.py --budgets_gb=8 --impls=native_async \
      --cpu_drivers=callback,host --out_dir=$OUT  # the CPU's share through callbacks vs the host-split driver

One process: builds random weights at the preset's real shape (host banks in pinned host memory),
calibrates every CPU mechanism (``ftjax.calibrate``: copy alone, CPU alone, both at once, timed on
the engine's own per-layer code), then for each VRAM budget decodes with ``--miss_policy`` fetch,
cpu and adaptive (the fastest calibrated mechanism first; the other mechanisms after, while the time
budget lasts), batch 1, sampled at ``--temperature`` with one seed. Writes ONE JSON
(``bench_miss_policy-<device>.json`` in ``--out_dir``; rewritten after every run so that a crash or
hang still leaves what was measured) with device, jax version, date, the calibration profile, and
per budget x policy x mechanism: decode tokens/s (mean, and from the median step time with its
p10/p90 spread), TTFT, hit rate, fetched / CPU-computed misses, the split histogram, the split
model's predicted expert time per token, and the logits' difference from the fetch run (CPU and
GPU arithmetic may round differently). Prints a table last.

Each run's engine gets its miss policy as ``EngineConfig.miss`` (``MissPolicyConfig``: the policy, the
mechanism, its calibrated thread count and, for adaptive, the calibrated split model) and the kernel
config of the kernel flags (``--kernels``, ... as ``ftjax.generate``; ``EngineConfig.kernels``); each
run records ``engine`` (``Engine.describe()``).

DESIGN.md 1.2 (FreeToken): report fetch-only, cpu-only and adaptive side by side; a mis-calibrated
split was slower than pure fetching in the field.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import re
import sys
import time
import traceback

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import common  # noqa: E402
from ftjax.config import CPU_DRIVERS, MISS_POLICIES  # noqa: E402
from ftjax.experts.cpu_experts import IMPLS  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16", "float16"], "Weights / compute dtype.")
flags.DEFINE_list("budgets_gb", ["8", "24"], "Device budgets in GB (1e9 bytes).")
flags.DEFINE_list("small_model_slot_fractions", ["0.25", "0.5"],
                  "When the whole pool fits a budget (small presets), use these fractions of it as slots instead.")
flags.DEFINE_integer("batch", 1, "Sequences decoded together.")
flags.DEFINE_integer("prompt_len", 16, "Random prompt tokens.")
flags.DEFINE_integer("steps", 32, "Generated tokens per run (tokens/s is over steps - 1 decode steps).")
flags.DEFINE_list("impls", ["callback_async", "callback", "compute_on"], "CPU mechanisms to calibrate and run.")
flags.DEFINE_list("policies", ["fetch", "cpu", "adaptive"], "Miss policies.")
flags.DEFINE_list("cpu_drivers", ["callback"], "How the decode step reaches the CPU (MissPolicyConfig.cpu_driver): "
                  "callback and/or host (ftjax.runtime.host_split; mechanisms with a host kernel only). Each "
                  "mechanism is calibrated and run once per driver, named <impl>@host for the host driver.")
flags.DEFINE_integer("cpu_threads", 0, "Host-kernel threads; 0 = sweep in calibration and take the fastest.")
flags.DEFINE_boolean("quick_calibration", False, "Fewer calibration points.")
flags.DEFINE_boolean("pure_qstar", True, "Also run adaptive with the plain q* rule of DESIGN.md 1.2 (the alone "
                     "bandwidths, no fixed costs, full overlap), to show what that calibration would give.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (same seed in every run). Random weights make greedy "
                   "decode repeat one token, which repeats the routing and inflates the hit rate; 0 = greedy.")
flags.DEFINE_integer("seed", 0, "Weights, prompt and sampling seed.")
flags.DEFINE_float("time_budget_s", 330.0, "Skip further runs after this many seconds (the JSON says which).")
flags.DEFINE_string("out_dir", "experiments/results/miss_policy", "Where the JSON goes.")
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_preset()
common.check_numbers("budgets_gb", float, low=0)
common.check_numbers("small_model_slot_fractions", float, low=0, high=1)
common.check_names("impls", IMPLS)
common.check_names("policies", MISS_POLICIES)
flags.register_validator("batch", lambda v: v >= 1, "must be >= 1")
flags.register_validator("prompt_len", lambda v: v >= 1, "must be >= 1")
flags.register_validator("cpu_threads", lambda v: v >= 0, "must be >= 0")
flags.register_validator("temperature", lambda v: v >= 0, "must be >= 0")


def _host_mem_available_gb() -> float | None:
    """MemAvailable from /proc/meminfo in GB (1e9 bytes); None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


def _predicted_expert_s(hist: list[dict], model, policy: str) -> float | None:
    """Seconds of miss traffic the split model predicts for a run's decode split histogram."""
    if model is None:
        return None
    from ftjax.experts.miss_split import split_cost
    return float(sum(h["layers"] * split_cost(h["fetched"], h["misses"], model) for h in hist))


def _logit_diff(ref, got) -> dict:
    """Generated tokens agree up to the first difference; logits up to it have identical inputs."""
    import numpy as np
    ref_ids, got_ids = np.asarray(ref.generated_ids), np.asarray(got.generated_ids)
    same = (ref_ids == got_ids).all(axis=0)
    first = int(np.argmin(same)) if not same.all() else len(same)
    upto = min(first + 1, len(same))
    d = np.abs(ref.step_logits[:upto] - got.step_logits[:upto])
    return {"tokens_match_fetch": first, "max_abs_logit_diff_vs_fetch": float(d.max()),
            "max_abs_logit": float(np.abs(ref.step_logits[:upto]).max())}


def main(argv):
    # A hang (a callback that never returns) must still leave the JSON: dump stacks and exit. The timer ends
    # with the run: a run inside a longer process (the tests run it in theirs) must not end that process later.
    faulthandler.dump_traceback_later(FLAGS.time_budget_s + 150, exit=True, file=sys.__stderr__)
    try:
        _run()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run():
    t_start = time.perf_counter()
    from ftjax.experts import cpu_experts
    cpu_experts.use_sync_cpu_dispatch()  # before JAX starts (only matters on a CPU backend)
    import jax
    import numpy as np

    from ftjax import calibrate
    from ftjax import Engine
    from ftjax.checkpoint import DTYPES, random_model
    from ftjax.config import EngineConfig, MissPolicyConfig, preset
    from ftjax.experts.miss_split import SplitModel
    from ftjax.runtime.planner import GB, plan_memory

    dev = jax.local_devices()[0]
    slug = re.sub(r"[^A-Za-z0-9]+", "_", dev.device_kind).strip("_").lower()
    out_path = os.path.join(FLAGS.out_dir, f"bench_miss_policy-{slug}.json")
    res: dict = {"meta": common.meta(), "bench": "miss_policy", "setup_s": {}, "runs": [], "skipped": [],
                 "notes": []}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        common.write_json(os.path.dirname(out_path) or ".", os.path.basename(out_path), res)

    # ---- model ----------------------------------------------------------------------------
    cfg = preset(FLAGS.preset)
    if FLAGS.steps < 2:
        raise app.UsageError(f"--steps must be >= 2 (tokens/s is over steps - 1 decode steps), got {FLAGS.steps}")
    itemsize = np.dtype(DTYPES[FLAGS.dtype]).itemsize
    max_seq_len = -(-(FLAGS.prompt_len + FLAGS.steps) // 128) * 128
    pool = cfg.num_layers * cfg.num_experts
    budgets = []
    for i, b in enumerate(FLAGS.budgets_gb):
        try:
            plan = plan_memory(cfg, itemsize, budget_bytes=int(float(b) * GB), batch=FLAGS.batch,
                               max_seq_len=max_seq_len, kernels=common.kernel_config())
        except ValueError as e:  # checked before the minute-long model build and calibration
            raise app.UsageError(f"--budgets_gb={b}: {e}") from None
        if plan.fits_resident:
            frac = float(FLAGS.small_model_slot_fractions[min(i, len(FLAGS.small_model_slot_fractions) - 1)])
            budgets.append((float(b), max(cfg.num_experts, int(pool * frac)), f"fraction {frac} (pool fits {b} GB)"))
        else:
            budgets.append((float(b), plan.slots, "budget"))
    t0 = time.perf_counter()
    model = random_model(cfg, FLAGS.dtype, seed=FLAGS.seed)
    jax.block_until_ready((model.host_gate_up, model.host_down))
    res["setup_s"]["model"] = round(time.perf_counter() - t0, 2)
    res["model"] = {"preset": FLAGS.preset, "dtype": FLAGS.dtype, "L": cfg.num_layers, "E": cfg.num_experts,
                    "top_k": cfg.top_k, "expert_bytes": model.expert_bytes, "pool_bytes": cfg.pool_bytes(itemsize),
                    "bank_memory_kind": model.host_gate_up.sharding.memory_kind}
    log(f"model {FLAGS.preset} {FLAGS.dtype}: pool {cfg.pool_bytes(itemsize) / GB:.1f} GB in "
        f"{model.host_gate_up.sharding.memory_kind}, built in {res['setup_s']['model']} s")
    if any(i.startswith("compute_on") for i in FLAGS.impls):
        t0 = time.perf_counter()
        model.banks = model.banks.replace(gate_up=cpu_experts.ensure_host_typed(model.banks.gate_up),
                                          down=cpu_experts.ensure_host_typed(model.banks.down))
        res["setup_s"]["host_typed_banks"] = round(time.perf_counter() - t0, 2)
    save()

    # ---- calibration ----------------------------------------------------------------------
    t0 = time.perf_counter()
    bad = [d for d in FLAGS.cpu_drivers if d not in CPU_DRIVERS]
    if bad or not FLAGS.cpu_drivers:
        raise app.UsageError(f"--cpu_drivers={','.join(FLAGS.cpu_drivers)}: expected some of {CPU_DRIVERS}")
    entry, impls = None, []
    for driver in FLAGS.cpu_drivers:
        names = calibrate.host_driver_impls(FLAGS.impls) if driver == "host" else list(FLAGS.impls)
        if not names:
            res["notes"].append(f"no mechanism of --impls has a host kernel: driver {driver} not run")
            continue
        got = calibrate.calibrate(model.host_gate_up, model.host_down, cfg, FLAGS.dtype, FLAGS.batch, names,
                                  FLAGS.cpu_threads or None, quick=FLAGS.quick_calibration, log=log, driver=driver)
        if entry is None:
            entry = got
        else:
            entry["impls"].update(got["impls"])
        impls += [calibrate.impl_key(i, driver) for i in names]
    if entry is None:  # nothing to calibrate: the entry's shape and limits for the fetch runs
        entry = calibrate.calibrate(model.host_gate_up, model.host_down, cfg, FLAGS.dtype, FLAGS.batch, [], log=log)
    if "compute_on" in impls and not entry["impls"]["compute_on"]["ok"] and "compute_on_static" not in impls:
        log("compute_on failed; calibrating the loop-free fallback compute_on_static")
        extra = calibrate.calibrate(model.host_gate_up, model.host_down, cfg, FLAGS.dtype, FLAGS.batch,
                                    ["compute_on_static"], FLAGS.cpu_threads or None,
                                    quick=FLAGS.quick_calibration, log=log)
        entry["impls"].update(extra["impls"])
        impls.append("compute_on_static")
    res["setup_s"]["calibration"] = round(time.perf_counter() - t0, 2)
    key = calibrate.profile_key(calibrate.device_name(), calibrate.expert_format(cfg, FLAGS.dtype), FLAGS.batch)
    res["calibration"] = {"key": key, "entry": entry}
    ok = [i for i in impls if entry["impls"][i]["ok"]]
    max_m = entry["max_misses"]

    def cpu_only_cost(i):  # predicted seconds per layer when every one of max_m misses goes to the CPU
        c = entry["impls"][i]["cpu"]
        return c["alpha_s"] + max_m * c["beta_s"]

    ok.sort(key=cpu_only_cost)
    res["impl_order"] = ok
    save()
    if not ok:
        res["notes"].append("no CPU mechanism calibrated; only the fetch policy runs")
    log(f"mechanisms by predicted CPU cost: {ok}")

    # ---- runs -----------------------------------------------------------------------------
    rng = np.random.default_rng(FLAGS.seed)
    prompt = rng.integers(0, cfg.vocab_size, FLAGS.prompt_len).tolist()
    prompts = [prompt] * FLAGS.batch
    res["budgets"] = [{"budget_gb": b, "slots": s, "pool_slots": pool, "slots_source": src} for b, s, src in budgets]

    # Order: per budget fetch, then cpu / adaptive with the best mechanism; the others afterwards.
    plan_runs = []
    for b, s, src in budgets:
        for pol in FLAGS.policies:
            if pol == "fetch":
                plan_runs.append((b, s, src, "fetch", None))
            elif ok:
                plan_runs.append((b, s, src, pol, ok[0]))
    if FLAGS.pure_qstar and ok and "adaptive" in FLAGS.policies:
        for b, s, src in budgets:
            plan_runs.append((b, s, src, "adaptive-qstar", ok[0]))
    for b, s, src in budgets:
        for impl in ok[1:]:
            for pol in FLAGS.policies:
                if pol != "fetch":
                    plan_runs.append((b, s, src, pol, impl))
    fetch_ref: dict = {}
    for b, s, src, pol, impl in plan_runs:
        elapsed = time.perf_counter() - t_start
        if elapsed > FLAGS.time_budget_s:
            res["skipped"].append({"budget_gb": b, "policy": pol, "impl": impl,
                                   "why": f"time budget ({elapsed:.0f} s)"})
            continue
        run = {"budget_gb": b, "slots": s, "slots_source": src, "policy": pol, "impl": impl}
        t0 = time.perf_counter()
        eng = None
        try:
            split_model = None
            if pol == "fetch":
                miss = MissPolicyConfig()
            else:
                # the calibrated mechanism: its thread count and, for adaptive, its fitted split model
                th = entry["impls"][impl]["mechanism"].get("threads") or 0
                if pol == "adaptive":
                    split_model = calibrate.split_model_from(entry["impls"][impl])
                elif pol == "adaptive-qstar":
                    fitted = calibrate.split_model_from(entry["impls"][impl])
                    split_model = SplitModel(beta_p=fitted.beta_p, beta_h=fitted.beta_h)
                mech, _, driver = impl.partition("@")
                miss = MissPolicyConfig(pol.split("-")[0], cpu_impl=mech, cpu_threads=th, split_model=split_model,
                                        cpu_driver=driver or "callback")
            eng = Engine(model, EngineConfig("cached", num_slots=s, max_seq_len=max_seq_len, batch=FLAGS.batch,
                                             kernels=common.kernel_config(), miss=miss))
            if pol != "fetch":  # provenance in the metrics, as the runtime built from a profile would have
                eng.miss.calibration = {"key": key}
            if pol == "adaptive-qstar":
                eng.miss.rule = "qstar (alone per-expert costs; no fixed costs; full overlap)"
            run["host_mem_available_gb"] = _host_mem_available_gb()
            out = eng.generate(prompts, FLAGS.steps, temperature=FLAGS.temperature, seed=FLAGS.seed,
                               keep_logits=True, time_steps=True)
            tpot = common.spread(out.step_s)
            ec = eng.expert_cache_metrics()
            dec = ec["decode"]
            n_dec = FLAGS.batch * (FLAGS.steps - 1)
            # the fitted model of the mechanism predicts what the run's split should have cost
            model_for_pred = calibrate.split_model_from(entry["impls"][impl or ok[0]]) if ok else None
            pred = _predicted_expert_s(dec["split_histogram"], model_for_pred, pol)
            run.update({
                "decode_tokens_per_s": out.decode_tokens_per_s, "decode_s_per_token": out.decode_s / max(n_dec, 1),
                "tpot_s": tpot, "tokens_per_s_median_tpot": FLAGS.batch / tpot["median"],
                "engine": eng.describe(),
                "ttft_s": out.ttft_s, "compile_s": out.compile_s, "hit_rate_decode": dec["hit_rate"],
                "hit_rate": ec["hit_rate"], "misses_decode": dec["misses"], "fetched_decode": dec["fetched"],
                "cpu_decode": dec["cpu_computed"], "fetch_fraction_decode": dec["fetch_fraction"],
                "split_rule": ec["split"]["rule"], "split_table": ec["split"]["table"],
                "split_histogram_decode": dec["split_histogram"],
                "predicted_miss_s_per_token": pred / max(n_dec, 1) if pred is not None else None,
                "generated_ids": out.generated_ids[0]})
            if "host_split" in ec:  # where the host-split driver's host time went, ms per layer by phase
                run["host_split"] = ec["host_split"]
                log("    host-split ms per layer: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in ec["host_split"]["per_layer_ms"].items())
                    + f", other {ec['host_split']['other_per_layer_ms']:.3f}")
            if pol == "fetch":
                fetch_ref[b] = out
            elif b in fetch_ref:
                run.update(_logit_diff(fetch_ref[b], out))
            log(f"{b:g} GB ({s} slots) {pol:14s} {impl or '-':16s} {out.decode_tokens_per_s:7.2f} tok/s  "
                f"TPOT median {tpot['median'] * 1e3:.1f} ms (p10 {tpot['p10'] * 1e3:.1f}, "
                f"p90 {tpot['p90'] * 1e3:.1f})  "
                f"hit {dec['hit_rate']:.3f}  fetched {dec['fetched']}  cpu {dec['cpu_computed']}  "
                f"compile {out.compile_s:.1f} s")
        except Exception as e:  # noqa: BLE001 - a failing mechanism is a finding
            run["error"] = f"{type(e).__name__}: {str(e)[:3000]}"
            run["traceback"] = traceback.format_exc()[-4000:]
            log(f"{b:g} GB {pol} {impl}: FAILED {run['error'][:300]}")
        run["wall_s"] = round(time.perf_counter() - t0, 1)
        res["runs"].append(run)
        del eng
        gc.collect()
        save()

    # ---- summary --------------------------------------------------------------------------
    summary = []
    for b, s, _ in budgets:
        rows = [r for r in res["runs"] if r["budget_gb"] == b and "decode_tokens_per_s" in r]
        best = {}
        for pol in ("fetch", "cpu", "adaptive", "adaptive-qstar"):
            cands = [r for r in rows if r["policy"] == pol]
            if cands:
                # compared by the median step time: robust to a few slow steps on a shared host
                top = max(cands, key=lambda r: r["tokens_per_s_median_tpot"])
                best[pol] = {"tokens_per_s_median_tpot": top["tokens_per_s_median_tpot"],
                             "impl": top["impl"], "tpot_s_p10_p90": [top["tpot_s"]["p10"], top["tpot_s"]["p90"]]}
        line = {"budget_gb": b, "slots": s, **best}
        if "adaptive" in best and "fetch" in best:
            single = max(best["fetch"]["tokens_per_s_median_tpot"],
                         best.get("cpu", {}).get("tokens_per_s_median_tpot", 0.0))
            line["adaptive_vs_best_single"] = best["adaptive"]["tokens_per_s_median_tpot"] / single if single else None
        summary.append(line)
    res["summary"] = summary
    save()

    print()
    print(f"device {res['meta']['device']} | jax {res['meta']['jax']} | {FLAGS.preset} {FLAGS.dtype} | "
          f"batch {FLAGS.batch} | {FLAGS.steps} tokens | calibration {key}")
    for i in impls:
        print(calibrate.describe_impl(i, entry["impls"][i]))
    print(f"{'budget':>7} {'slots':>6} {'policy':14} {'mechanism':18} {'tok/s':>8} {'TPOT ms':>8} {'p10-p90':>11} "
          f"{'hit':>6} {'fetched':>8} {'cpu':>6} {'pred ms/tok':>11} {'logit diff':>10}")
    for r in res["runs"]:
        if "error" in r:
            print(f"{r['budget_gb']:>7g} {r['slots']:>6} {r['policy']:14} {str(r['impl']):18} "
                  f"FAILED: {r['error'][:80]}")
            continue
        pred = r["predicted_miss_s_per_token"]
        diff = r.get("max_abs_logit_diff_vs_fetch")
        print(f"{r['budget_gb']:>7g} {r['slots']:>6} {r['policy']:14} {str(r['impl']):18} "
              f"{r['decode_tokens_per_s']:8.2f} {r['tpot_s']['median'] * 1e3:8.1f} "
              f"{r['tpot_s']['p10'] * 1e3:5.1f}-{r['tpot_s']['p90'] * 1e3:<5.1f} {r['hit_rate_decode']:6.3f} "
              f"{r['fetched_decode']:8d} {r['cpu_decode']:6d} {pred * 1e3 if pred is not None else float('nan'):11.1f} "
              f"{diff if diff is not None else float('nan'):10.3g}")
    for s_ in res["skipped"]:
        print(f"skipped: {s_}")
    for line in summary:
        print(f"summary {line}")
    print(f"wrote {out_path} ({res['elapsed_s']} s)")


if __name__ == "__main__":
    common.run(main)
