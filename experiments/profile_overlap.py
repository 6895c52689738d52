r"""Proof on the timeline (issue 12, item 5): does each layer's host copy run while compute runs?

Traces (``jax.profiler``, perfetto JSON) one streamed prefill chunk and one prefix-reuse prefill
(layerwise KV load) of the qwen3-30b-a3b preset, then reduces each trace to a small summary: the
GPU's copy intervals (host-to-device memcpy events) and compute intervals (kernels), merged; per
copy burst (one layer's copies: events closer than ``--gap_ms``) its start, end, bytes-free length
and the fraction of it that overlaps compute; and over the whole call the fraction of copy time
that overlaps compute. Writes ``profile_overlap_<preset>.json`` (summary only; the raw traces stay
in ``--trace_dir``). Both engines run with the kernel config of the kernel flags (``--kernels``, ... as
``ftjax.generate``; ``EngineConfig.kernels``); each run records its engine's config (``engine``).

  PYTHONPATH=. python3 experiments/profile_overlap.py --out_dir=$OUT          # on the GPU
  PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/profile_overlap.py --preset=tiny --dtype=float32 \
      --tokens=256 --slots=64 --prefix_tokens=256 --suffix_tokens=16 --out_dir=/tmp/po   # CPU smoke
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from experiments import common  # noqa: E402
from experiments.timeline import summarize_trace, trace_events  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.config import EngineConfig, KVOffloadConfig  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3-30b-a3b", "Model shape (random weights).")
flags.DEFINE_string("dtype", "bfloat16", "Compute and bank dtype.")
flags.DEFINE_integer("tokens", 8192, "Prompt tokens of the streamed chunk.")
flags.DEFINE_integer("slots", 300, "Expert slots of the cached engine.")
flags.DEFINE_integer("prefix_tokens", 15872, "Reused prefix of the KV-reuse prefill (multiple of 256).")
flags.DEFINE_integer("suffix_tokens", 256, "New tokens after the reused prefix.")
flags.DEFINE_float("gap_ms", 0.5, "Copy events closer than this form one burst (one layer's copies).")
flags.DEFINE_string("trace_dir", None, "Where the raw traces go (default: a temporary folder).")
flags.DEFINE_list("runs", ["stream", "kv_reuse"], "Which prefills to trace.")
flags.DEFINE_string("out_dir", "experiments/results/overlap", "Where the JSON goes.")
common.define_kernel_flags()  # the kernel config of both engines (EngineConfig.kernels)
common.check_preset()
common.check_names("runs", ("stream", "kv_reuse"))
common.check_choice("dtype", ("float32", "bfloat16", "float16"))
for _name in ("tokens", "slots", "suffix_tokens"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("prefix_tokens", lambda v: v >= 256 and v % 256 == 0, "must be a positive multiple of 256")
flags.register_validator("gap_ms", lambda v: v >= 0, "must be >= 0")


def _trace(fn, log_dir: str) -> list[dict]:
    return trace_events(lambda: jax.block_until_ready(fn()), log_dir)[1]


def main(argv):
    del argv
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype)
    trace_root = FLAGS.trace_dir or tempfile.mkdtemp(prefix="ftjax_trace_")
    rng = np.random.default_rng(0)
    out = {"B_P": bp, "layer_expert_bytes": cfg.num_experts * model.expert_bytes, "runs": {}}
    if "stream" in FLAGS.runs:
        prompt = rng.integers(0, cfg.vocab_size, FLAGS.tokens).tolist()
        # the pipelined driver by name: the overlap it profiles is that driver's (auto would run float32 on the scan)
        eng = Engine(model, EngineConfig("cached", num_slots=FLAGS.slots, max_seq_len=FLAGS.tokens + 128,
                                         prefill="stream", prefill_chunk=FLAGS.tokens, prefill_driver="pipelined",
                                         kernels=common.kernel_config()))
        eng.generate([prompt], 1)  # compile and warm up
        cache = eng.new_cache(1)
        events = _trace(lambda: eng.prefill([prompt], cache)[0], os.path.join(trace_root, "stream"))
        out["runs"]["stream"] = {"driver_calls": dict(eng.prefill_driver_calls), "tokens": FLAGS.tokens,
                                 "copy_path": eng.stream_copy_path, "engine": eng.describe(),
                                 **summarize_trace(events, FLAGS.gap_ms * 1e3)}
        del eng, cache
    if "kv_reuse" in FLAGS.runs:
        from ftjax.kv.host_store import HostKVStore
        from ftjax.kv.prefix_cache import PrefixCache
        n = FLAGS.prefix_tokens + FLAGS.suffix_tokens
        prompt = rng.integers(0, cfg.vocab_size, n).tolist()
        # the pipelined driver, forced: under "auto" a prefix-only call stays on the scan (docs/OVERLAP.md)
        eng = Engine(model, EngineConfig("resident", max_seq_len=n + 256, prefill_chunk=8192,
                                         prefill_driver="pipelined", kernels=common.kernel_config()))
        mgr = PrefixCache(HostKVStore(int(8e9)), KVOffloadConfig(chunk_tokens=256, prefill_chunk=8192))
        eng.generate([prompt[: FLAGS.prefix_tokens]], 1, kv_manager=mgr)  # stores the prefix
        eng.generate([prompt], 1, kv_manager=mgr)  # compiles the reuse programs
        cache = eng.new_cache(1)
        req = eng.prepare_prefill([prompt], cache, mgr)
        events = _trace(lambda: eng.prefill([prompt], cache, kv_manager=mgr, request=req)[0],
                        os.path.join(trace_root, "kv_reuse"))
        out["runs"]["kv_reuse"] = {"driver_calls": dict(eng.prefill_driver_calls), "reused_tokens": req.reused_tokens,
                                   "engine": eng.describe(), **summarize_trace(events, FLAGS.gap_ms * 1e3)}
    for name, r in out["runs"].items():
        print(name, {k: v for k, v in r.items() if k not in ("bursts", "top_gpu_events_s", "engine")}, flush=True)
    print("wrote", common.write_json(FLAGS.out_dir, f"profile_overlap_{FLAGS.preset}.json", out))


if __name__ == "__main__":
    common.run(main)
