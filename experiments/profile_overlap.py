r"""Proof on the timeline (issue 12, item 5): does each layer's host copy run while compute runs?

Traces (``jax.profiler``, perfetto JSON) one streamed prefill chunk and one prefix-reuse prefill
(layerwise KV load) of the qwen3-30b-a3b preset, then reduces each trace to a small summary: the
GPU's copy intervals (host-to-device memcpy events) and compute intervals (kernels), merged; per
copy burst (one layer's copies: events closer than ``--gap_ms``) its start, end, bytes-free length
and the fraction of it that overlaps compute; and over the whole call the fraction of copy time
that overlaps compute. Writes ``profile_overlap_<preset>.json`` (summary only; the raw traces stay
in ``--trace_dir``).

  PYTHONPATH=. python3 experiments/profile_overlap.py --out_dir=$OUT          # on the GPU
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys
import tempfile

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from experiments import common  # noqa: E402
from ftjax.config import EngineConfig, KVOffloadConfig  # noqa: E402
from ftjax.engine import Engine  # noqa: E402

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
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON goes.")

COPY_WORDS = ("memcpyh2d", "memcpyhtod", "copy-start")  # host-to-device copies (D2D / D2H are compute-side)


def _merge(intervals, gap=0.0):
    """Union of [start, end) intervals (sorted, touching or closer than ``gap`` merged)."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _overlap(a, b) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def summarize_trace(events: list[dict], gap_us: float = 500.0) -> dict:
    """Copy vs compute on the GPU timeline of one perfetto/chrome trace.

    events: the trace's ``traceEvents``. GPU events are the complete ("X") events of processes whose
    name mentions a GPU; among them, copies are the host-to-device memcpy events (named ``MemcpyH2D``
    on the H200), every other one is compute (kernels, device-to-device copies). Times in microseconds in, seconds out.
    Returns {copy_s, compute_s, span_s, copy_overlapped_fraction, bursts: [{start_s, end_s, copy_s,
    overlapped_fraction}], top_gpu_events}; bursts are copy intervals merged across gaps < gap_us.
    """
    pname = {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            pname[ev.get("pid")] = str(ev.get("args", {}).get("name", ""))
    gpu_pids = {p for p, n in pname.items() if "gpu" in n.lower()}
    copies, compute, names = [], [], {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("pid") not in gpu_pids or "dur" not in ev:
            continue
        s, d = float(ev["ts"]), float(ev["dur"])
        is_copy = any(w in str(ev.get("name", "")).lower() for w in COPY_WORDS)  # thread names mix both
        (copies if is_copy else compute).append((s, s + d))
        key = ("copy: " if is_copy else "compute: ") + str(ev.get("name", ""))[:60]
        names[key] = names.get(key, 0.0) + d
    cu, ku = _merge(copies), _merge(compute)
    copy_t = sum(e - s for s, e in cu)
    bursts = []
    t0 = min([s for s, _ in cu + ku], default=0.0)
    for s, e in _merge(copies, gap_us):
        inside = [[max(s, a), min(e, b)] for a, b in cu if b > s and a < e]
        busy = sum(b - a for a, b in inside)
        bursts.append({"start_s": (s - t0) / 1e6, "end_s": (e - t0) / 1e6, "copy_s": busy / 1e6,
                       "overlapped_fraction": _overlap(inside, ku) / busy if busy else 0.0})
    span = (max([e for _, e in cu + ku], default=0.0) - t0) / 1e6
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:25])
    return {"gpu_processes": [pname[p] for p in gpu_pids], "copy_s": copy_t / 1e6,
            "compute_s": sum(e - s for s, e in ku) / 1e6, "span_s": span,
            "copy_overlapped_fraction": _overlap(cu, ku) / copy_t if copy_t else 0.0,
            "bursts": bursts, "top_gpu_events_s": {k: v / 1e6 for k, v in top.items()}}


def _trace(fn, log_dir: str) -> list[dict]:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no perfetto trace under {log_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)["traceEvents"]


def main(argv):
    del argv
    cfg, model, build_s, bp = common.build_random_model(FLAGS.preset, FLAGS.dtype)
    trace_root = FLAGS.trace_dir or tempfile.mkdtemp(prefix="ftjax_trace_")
    rng = np.random.default_rng(0)
    out = {"B_P": bp, "layer_expert_bytes": cfg.num_experts * model.expert_bytes, "runs": {}}
    if "stream" in FLAGS.runs:
        prompt = rng.integers(0, cfg.vocab_size, FLAGS.tokens).tolist()
        eng = Engine(model, EngineConfig("cached", num_slots=FLAGS.slots, max_seq_len=FLAGS.tokens + 128,
                                         prefill="stream", prefill_chunk=FLAGS.tokens))
        eng.generate([prompt], 1)  # compile and warm up
        cache = eng.new_cache(1)
        events = _trace(lambda: eng.prefill([prompt], cache)[0], os.path.join(trace_root, "stream"))
        out["runs"]["stream"] = {"driver_calls": dict(eng.prefill_driver_calls), "tokens": FLAGS.tokens,
                                 "copy_path": eng.stream_copy_path,
                                 **summarize_trace(events, FLAGS.gap_ms * 1e3)}
        del eng, cache
    if "kv_reuse" in FLAGS.runs:
        from ftjax.kv.host_store import HostKVStore
        from ftjax.kv.prefix_cache import PrefixCache
        n = FLAGS.prefix_tokens + FLAGS.suffix_tokens
        prompt = rng.integers(0, cfg.vocab_size, n).tolist()
        eng = Engine(model, EngineConfig("resident", max_seq_len=n + 256, prefill_chunk=8192))
        mgr = PrefixCache(HostKVStore(int(8e9)), KVOffloadConfig(chunk_tokens=256, prefill_chunk=8192))
        eng.generate([prompt[: FLAGS.prefix_tokens]], 1, kv_manager=mgr)  # stores the prefix
        eng.generate([prompt], 1, kv_manager=mgr)  # compiles the reuse programs
        cache = eng.new_cache(1)
        req = eng.prepare_prefill([prompt], cache, mgr)
        events = _trace(lambda: eng.prefill([prompt], cache, kv_manager=mgr, request=req)[0],
                        os.path.join(trace_root, "kv_reuse"))
        out["runs"]["kv_reuse"] = {"driver_calls": dict(eng.prefill_driver_calls), "reused_tokens": req.reused_tokens,
                                   **summarize_trace(events, FLAGS.gap_ms * 1e3)}
    for name, r in out["runs"].items():
        print(name, {k: v for k, v in r.items() if k not in ("bursts", "top_gpu_events_s")}, flush=True)
    print("wrote", common.write_json(FLAGS.out_dir, f"profile_overlap_{FLAGS.preset}.json", out))


if __name__ == "__main__":
    app.run(main)
