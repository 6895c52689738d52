r"""Generate text with an MoE model whose experts live in host memory.

  python -m ftjax.generate                                   # built-in demo model, expert cache on
  python -m ftjax.generate --checkpoint=DIR --prompt="Hello" --max_new_tokens=32
  python -m ftjax.generate --preset=qwen3-30b-a3b --vram_budget_gb=8 --prompt_len=512

Prints the memory plan, the text (or ids), TTFT, prefill and decode tokens/s and the expert-cache
hit rate and host-to-device bytes. Errors (bad files, bad flags, ids outside the vocabulary)
print one line and exit with status 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint directory (config.json + safetensors). "
                    "Absent: the built-in deterministic demo model (random weights, preset 'tiny').")
flags.DEFINE_string("preset", None, "Random weights at a preset's real shape instead of a checkpoint "
                    "(qwen3-30b-a3b, olmoe-1b-7b, mixtral-8x7b, tiny).")
flags.DEFINE_string("prompt", None, "Prompt text (needs tokenizer.json in the checkpoint).")
flags.DEFINE_list("prompt_ids", None, "Prompt token ids, comma separated.")
flags.DEFINE_integer("prompt_len", None, "With --preset: a random prompt of this many tokens.")
flags.DEFINE_integer("batch", 1, "Decode this many copies of the prompt together.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per sequence.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
flags.DEFINE_integer("seed", 0, "Sampling / random-weight seed.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Compute dtype; default the checkpoint's.")
flags.DEFINE_integer("max_seq_len", None, "KV cache length; default prompt + new tokens rounded up to 128.")
flags.DEFINE_enum("experts", "auto", ["auto", "resident", "cached", "on_demand"],
                  "Where experts live: auto = resident if the pool fits the budget, else cached.")
flags.DEFINE_integer("expert_slots", None, "Device expert slots S (E <= S <= L*E).")
flags.DEFINE_float("vram_budget_gb", None, "Device memory budget in GB (1e9 bytes) to plan slots from.")
flags.DEFINE_string("metrics_json", None, "Write metrics (ids, TTFT, tokens/s, expert_cache) to this file.")
flags.DEFINE_string("logits_npy", None, "Write float32 [steps, vocab] logits of every generated step.")
flags.DEFINE_string("trace_routing", None, "Write routed expert ids per step and layer (.npz).")
flags.DEFINE_boolean("progress", True, "Show a progress bar while loading.")
flags.DEFINE_enum("miss_policy", "fetch", ["fetch", "cpu", "adaptive"],
                  "Expert-cache misses: copy them to the device (fetch), compute them on the host CPU (cpu), "
                  "or split each layer's misses by the calibrated q* rule (adaptive). DESIGN.md 1.2.")
flags.DEFINE_enum("cpu_expert_impl", "callback_async",
                  ["callback", "callback_async", "compute_on", "compute_on_static"],
                  "How misses are computed on the CPU (ftjax.experts.cpu_experts).")
flags.DEFINE_integer("cpu_threads", 0, "Host-kernel threads of the callback mechanisms; 0 = the profile's or "
                     "half the cores.")
flags.DEFINE_string("calibration_profile", None, "Calibration profile JSON (ftjax.calibrate); default "
                    "~/.cache/ftjax/calibration.json. Adaptive calibrates quickly and adds to it when missing.")
flags.DEFINE_integer("fixed_fetch", None, "Adaptive: fetch min(N, misses) per layer instead of the calibrated split.")


class UserError(Exception):
    """Bad input: printed as one line, exit status 1."""


def _atomic_write(path: str, write) -> None:
    """Writes through a temporary file in the same folder, then renames: no half-written files."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load_model():
    from ftjax.checkpoint import load_checkpoint, random_model
    from ftjax.config import preset
    if FLAGS.checkpoint and FLAGS.preset:
        raise UserError("give --checkpoint or --preset, not both")
    if FLAGS.checkpoint:
        return load_checkpoint(FLAGS.checkpoint, FLAGS.dtype, progress=FLAGS.progress)
    return random_model(preset(FLAGS.preset or "tiny"), FLAGS.dtype, seed=FLAGS.seed)


def _prompt_ids(model) -> list[int]:
    import numpy as np
    given = [x for x in (FLAGS.prompt, FLAGS.prompt_ids, FLAGS.prompt_len) if x is not None]
    if len(given) > 1:
        raise UserError("give only one of --prompt, --prompt_ids, --prompt_len")
    if FLAGS.prompt is not None:
        if model.tokenizer is None:
            raise UserError("--prompt needs a tokenizer.json in the checkpoint; use --prompt_ids")
        ids = model.tokenizer.encode(FLAGS.prompt).ids
        if not ids:
            raise UserError("--prompt encodes to no tokens")
        return ids
    if FLAGS.prompt_ids is not None:
        try:
            return [int(x) for x in FLAGS.prompt_ids]
        except ValueError:
            raise UserError(f"--prompt_ids must be integers, got {','.join(FLAGS.prompt_ids)}") from None
    n = FLAGS.prompt_len or 16
    return np.random.default_rng(FLAGS.seed).integers(0, model.cfg.vocab_size, n).tolist()


def _plan(model, batch: int, max_seq_len: int):
    """Chooses the experts mode and slot count; returns (mode, plan or None)."""
    import numpy as np
    from ftjax.checkpoint import DTYPES
    from ftjax.experts.planner import GB, plan_memory
    cfg = model.cfg
    itemsize = np.dtype(DTYPES[model.dtype]).itemsize
    mode = FLAGS.experts
    if FLAGS.expert_slots is not None and FLAGS.vram_budget_gb is not None:
        raise UserError("give --expert_slots or --vram_budget_gb, not both")
    if FLAGS.expert_slots is None and FLAGS.vram_budget_gb is None:
        if mode == "resident" or (mode == "auto" and FLAGS.checkpoint):
            return "resident", None
        # Demo default: a cache of 2E slots, smaller than the pool, so the mechanism shows.
        slots = min(2 * cfg.num_experts, cfg.num_layers * cfg.num_experts)
        plan = plan_memory(cfg, itemsize, slots=slots, batch=batch, max_seq_len=max_seq_len)
    elif FLAGS.expert_slots is not None:
        plan = plan_memory(cfg, itemsize, slots=FLAGS.expert_slots, batch=batch, max_seq_len=max_seq_len)
    else:
        plan = plan_memory(cfg, itemsize, budget_bytes=int(FLAGS.vram_budget_gb * GB), batch=batch,
                           max_seq_len=max_seq_len)
    if mode == "auto":
        mode = "resident" if plan.fits_resident else "cached"
    return mode, plan


def _miss_runtime(model, mode: str, batch: int):
    """The engine's miss runtime for --miss_policy (None: fetch every miss)."""
    if FLAGS.miss_policy == "fetch":
        return None
    if mode == "resident":
        print(f"note: all experts are resident, so there are no misses; --miss_policy={FLAGS.miss_policy} ignored")
        return None
    from ftjax import calibrate
    from ftjax.experts import cpu_experts, miss_policy
    impl, threads = FLAGS.cpu_expert_impl, FLAGS.cpu_threads or None
    if impl not in cpu_experts.CALLBACK_IMPLS:  # compute_on reads the banks in-graph: they must be host-typed
        model.host_gate_up = cpu_experts.ensure_host_typed(model.host_gate_up)
        model.host_down = cpu_experts.ensure_host_typed(model.host_down)
    calibration = split_model = None
    path = FLAGS.calibration_profile or calibrate.default_profile_path()
    key = calibrate.profile_key(calibrate.device_name(), calibrate.expert_format(model.cfg, model.dtype))
    entry, fresh = calibrate.get_entry(path, key), False
    if FLAGS.miss_policy == "adaptive" and FLAGS.fixed_fetch is None:
        entry, key, path, fresh = calibrate.profile_for(model, impl, batch, path, threads)
        split_model = calibrate.split_model_from(entry["impls"][impl])
    if entry is not None and impl in entry.get("impls", {}):
        threads = threads or entry["impls"][impl].get("mechanism", {}).get("threads")
        print(f"calibration profile: {path} [{key}]{' (calibrated now)' if fresh else ''}")
        if not fresh:
            print(calibrate.describe_impl(impl, entry["impls"][impl]))
        calibration = {"path": path, "key": key, "calibrated_now": fresh, "entry": entry}
    cpu = cpu_experts.make_cpu_experts(impl, model.host_gate_up, model.host_down, threads)
    return miss_policy.build_runtime(FLAGS.miss_policy, model.cfg.num_layers, model.cfg.num_experts, cpu,
                                     split_model=split_model, fixed_fetch=FLAGS.fixed_fetch,
                                     calibration=calibration)


def run() -> dict:
    """Runs the command; returns the metrics dict."""
    import numpy as np
    from ftjax.engine import Engine
    if FLAGS.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    if FLAGS.batch < 1:
        raise UserError(f"--batch must be >= 1, got {FLAGS.batch}")
    if not 0.0 < FLAGS.top_p <= 1.0 or FLAGS.temperature < 0:
        raise UserError("need 0 < --top_p <= 1 and --temperature >= 0")
    if FLAGS.fixed_fetch is not None and (FLAGS.miss_policy != "adaptive" or FLAGS.fixed_fetch < 0):
        raise UserError("--fixed_fetch needs --miss_policy=adaptive and a value >= 0")
    model = _load_model()
    cfg = model.cfg
    prompt = _prompt_ids(model)
    need = len(prompt) + FLAGS.max_new_tokens
    max_seq_len = FLAGS.max_seq_len or min(-(-need // 128) * 128, cfg.max_position_embeddings)
    if need > cfg.max_position_embeddings:
        raise UserError(f"prompt of {len(prompt)} tokens + {FLAGS.max_new_tokens} new exceeds the model's "
                        f"max_position_embeddings {cfg.max_position_embeddings}")
    mode, plan = _plan(model, FLAGS.batch, max_seq_len)
    print(f"model: {model.name} ({cfg.model_type}, L={cfg.num_layers}, E={cfg.num_experts}, "
          f"top-k={cfg.top_k}, {model.dtype}); experts: {mode}")
    if plan is not None:
        print(plan.describe())
    miss = _miss_runtime(model, mode, FLAGS.batch)
    if miss is not None:
        print(miss.describe(min(cfg.num_experts, FLAGS.batch * cfg.top_k)))
    engine = Engine(model, mode, plan.slots if plan else None, max_seq_len=max_seq_len, batch=FLAGS.batch,
                    miss=miss)
    res = engine.generate([prompt] * FLAGS.batch, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_p,
                          FLAGS.seed, keep_logits=bool(FLAGS.logits_npy), trace_routing=bool(FLAGS.trace_routing))
    gen = res.generated_ids[0]
    if model.tokenizer is not None:
        print("text:", model.tokenizer.decode(gen))
    print("generated ids:", ",".join(map(str, gen)))
    ec = engine.expert_cache_metrics()
    print(f"TTFT {res.ttft_s * 1e3:.1f} ms | prefill {res.prefill_tokens_per_s:.1f} tokens/s | "
          f"decode {res.decode_tokens_per_s:.2f} tokens/s | compile {res.compile_s:.1f} s (excluded)")
    print(f"expert cache: {ec['slots']} slots, hit rate {ec['hit_rate']:.3f} "
          f"(decode {ec['decode']['hit_rate']:.3f}), {ec['misses']} misses, "
          f"{ec['bytes_h2d'] / 1e6:.1f} MB host-to-device")
    if miss is not None:
        print(f"misses: {ec['fetched']} fetched, {ec['cpu_computed']} computed on the CPU "
              f"({ec['miss_policy']}, split {ec['split']['rule']})")
    metrics = {"model": model.name, "config": cfg.identity(), "dtype": model.dtype, "experts_mode": mode,
               "memory_plan": plan.as_dict() if plan else None, "prompt_ids": prompt,
               "generated_ids": gen, "batch_generated_ids": res.generated_ids, "ttft_s": res.ttft_s,
               "decode_s": res.decode_s, "prefill_tokens_per_s": res.prefill_tokens_per_s,
               "decode_tokens_per_s": res.decode_tokens_per_s, "compile_s": res.compile_s, "expert_cache": ec}
    if FLAGS.logits_npy:
        logits = res.step_logits[:, 0, :].astype(np.float32)  # [steps, vocab] of sequence 0
        _atomic_write(FLAGS.logits_npy, lambda f: np.save(f, logits))
    if FLAGS.trace_routing:
        routing = {f"step{i}": r for i, r in enumerate(res.routing)}
        _atomic_write(FLAGS.trace_routing, lambda f: np.savez_compressed(f, **routing))
        metrics["trace_routing"] = FLAGS.trace_routing
    if FLAGS.metrics_json:
        _atomic_write(FLAGS.metrics_json, lambda f: f.write(json.dumps(metrics, indent=1).encode()))
    return metrics


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from ftjax.experts.cpu_experts import CALLBACK_IMPLS, HostViewError, use_sync_cpu_dispatch
    if FLAGS.miss_policy != "fetch" and FLAGS.cpu_expert_impl in CALLBACK_IMPLS:
        use_sync_cpu_dispatch()  # before JAX starts; the callbacks deadlock on an async CPU client
    from ftjax.checkpoint import CheckpointError
    from ftjax.config import ConfigError
    try:
        run()
    except (UserError, ConfigError, CheckpointError, ValueError, HostViewError) as e:
        print(f"ftjax.generate: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
