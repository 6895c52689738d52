r"""The held figures of one ftjax tree, measured with the API every tree since 2026-11-30 shares, so that
two commits can be compared in one run on one machine (``experiments/ab_commits_gpu.sh`` runs it for a
base tree and the working tree and writes both into one JSON).

Figures (qwen3-30b-a3b shape, random bf16 weights, batch 1, greedy; one process per tree):

* ``decode_resident``: median TPOT of a resident decode after a 512-token prompt;
* ``decode_cached_lookahead``: tokens/s and median TPOT with 280 slots (the 8 GB plan) and the lookahead
  policy;
* ``prefill_stream`` / ``prefill_resident``: TTFT of an 8192-token prompt streamed with 306 slots (the
  9 GB plan) / resident (median of the repeats after a warm-up);
* ``hybrid_prefill_<driver>``: TTFT of an 8192-token prompt streamed through the qwen3.5-35b-a3b shape cut
  to ``--hybrid_layers`` layers, on each driver the tree runs it on (a tree that refuses a driver records
  the refusal).

CPU smoke run (seconds)::

  python experiments/ab_commits.py --preset=tiny --hybrid_preset=tiny-hybrid --hybrid_layers=4 \
      --prompt_len=24 --prefill_tokens=128 --decode_steps=4 --slots_8gb=16 --slots_9gb=32 --out=/tmp/ab.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape of the decode and prefill figures.")
flags.DEFINE_string("hybrid_preset", "qwen3.5-35b-a3b", "Model shape of the hybrid figures.")
flags.DEFINE_integer("hybrid_layers", 16, "Layers the hybrid shape is cut to (a multiple of its block).", lower_bound=1)
flags.DEFINE_list("measure", ["decode_resident", "decode_cached_lookahead", "prefill_stream", "prefill_resident",
                              "hybrid_prefill"], "Figures to measure.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens before decoding.", lower_bound=1)
flags.DEFINE_integer("decode_steps", 64, "Decode steps timed (after 8 untimed).", lower_bound=1)
flags.DEFINE_integer("prefill_tokens", 8192, "Prompt tokens of the prefill figures.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Timed prefills after one warm-up.", lower_bound=1)
flags.DEFINE_integer("slots_8gb", 280, "Expert slots of the 8 GB plan (qwen3-30b-a3b, bf16).", lower_bound=1)
flags.DEFINE_integer("slots_9gb", 306, "Expert slots of the 9 GB plan (qwen3-30b-a3b, bf16).", lower_bound=1)
flags.DEFINE_string("label", "tree", "Name of this tree in the output.")
flags.DEFINE_string("commit", None, "The tree's commit (recorded; default: git's, where the tree is a checkout).")
flags.DEFINE_string("out", None, "JSON file to write.")

MEASURES = ("decode_resident", "decode_cached_lookahead", "prefill_stream", "prefill_resident", "hybrid_prefill")


def _engine_cls():
    try:
        from ftjax import Engine
    except ImportError:  # trees before the runtime package
        from ftjax.engine import Engine
    return Engine


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _decode(model, config, steps: int) -> dict:
    engine = _engine_cls()(model, config)
    prompt = _prompt(model.cfg.vocab_size, FLAGS.prompt_len)
    res = engine.generate([prompt], 8 + steps + 1, time_steps=True)
    step_s = res.step_s[8:]
    ordered = sorted(step_s)
    return {"tpot_ms_median": 1e3 * statistics.median(step_s), "tpot_ms_p10": 1e3 * ordered[len(step_s) // 10],
            "tpot_ms_p90": 1e3 * ordered[(9 * len(step_s)) // 10], "tokens_per_s": 1.0 / statistics.median(step_s),
            "hit_rate": res.expert_cache["hit_rate"], "compile_s": res.compile_s}


def _prefill(model, config, tokens: int) -> dict:
    engine = _engine_cls()(model, config)
    prompt = _prompt(model.cfg.vocab_size, tokens, seed=1)
    ttft = [engine.generate([prompt], 1).ttft_s for _ in range(1 + FLAGS.repeats)][1:]
    calls = getattr(engine, "prefill_driver_calls", None)
    return {"ttft_s_median": statistics.median(ttft), "ttft_s": ttft, "driver_calls": dict(calls or {}),
            "compile_s": engine.compile_s}


def run() -> dict:
    import jax

    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    unknown = [m for m in FLAGS.measure if m not in MEASURES]
    if unknown:
        raise app.UsageError(f"--measure: unknown {unknown}; expected from {MEASURES}")
    out = {"label": FLAGS.label, "commit": FLAGS.commit, "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "figures": {}}
    figs = out["figures"]
    qwen = [m for m in FLAGS.measure if m != "hybrid_prefill"]
    if qwen:
        t0 = time.perf_counter()
        model = random_model(preset(FLAGS.preset), "bfloat16")
        out["build_s"] = time.perf_counter() - t0
        seq = FLAGS.prompt_len + FLAGS.decode_steps + 16
        if "decode_resident" in qwen:
            figs["decode_resident"] = _decode(model, EngineConfig("resident", max_seq_len=seq), FLAGS.decode_steps)
        if "decode_cached_lookahead" in qwen:
            figs["decode_cached_lookahead"] = _decode(model, EngineConfig(
                "cached", num_slots=FLAGS.slots_8gb, max_seq_len=seq, cache_policy="lookahead"), FLAGS.decode_steps)
        long = FLAGS.prefill_tokens + 16
        if "prefill_stream" in qwen:
            figs["prefill_stream"] = _prefill(model, EngineConfig(
                "cached", num_slots=FLAGS.slots_9gb, max_seq_len=long, prefill="stream",
                prefill_chunk=FLAGS.prefill_tokens), FLAGS.prefill_tokens)
        if "prefill_resident" in qwen:
            figs["prefill_resident"] = _prefill(model, EngineConfig("resident", max_seq_len=long,
                                                                     prefill_chunk=FLAGS.prefill_tokens),
                                                FLAGS.prefill_tokens)
        del model
    if "hybrid_prefill" in FLAGS.measure:
        cfg = preset(FLAGS.hybrid_preset)
        cfg = dataclasses.replace(cfg, num_layers=FLAGS.hybrid_layers,
                                  layer_types=cfg.layer_types[:FLAGS.hybrid_layers])
        model = random_model(cfg, "bfloat16")
        e = cfg.num_experts
        for driver in ("scan", "pipelined"):
            config = EngineConfig("cached", num_slots=2 * e, max_seq_len=FLAGS.prefill_tokens + 16, prefill="stream",
                                  prefill_chunk=FLAGS.prefill_tokens, prefill_driver=driver)
            try:
                figs[f"hybrid_prefill_{driver}"] = _prefill(model, config, FLAGS.prefill_tokens)
            except ValueError as err:  # a tree whose hybrid family runs on the scan only refuses "pipelined"
                figs[f"hybrid_prefill_{driver}"] = {"refused": str(err)}
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.out and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.out))):
        raise app.UsageError(f"--out={FLAGS.out}: its folder does not exist")
    if FLAGS.commit is None:
        from ftjax.provenance import git_commit
        FLAGS.commit = git_commit()
    result = run()
    text = json.dumps(result, indent=1)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)


def guarded_main(argv):
    """``main`` where bad input (``app.UsageError``) prints one ``error: ...`` line and exits with status 1,
    as ``experiments.common.run`` does: this script imports nothing of the tree but the ``ftjax`` it
    measures (an older tree's, under ``PYTHONPATH``), so not ``experiments.common`` either. A ``ValueError``
    (a tree refusing a configuration) prints ``ab_commits: error: ...``, status 1."""
    try:
        return main(argv)
    except app.UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except ValueError as e:
        print(f"ab_commits: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    app.run(guarded_main)
