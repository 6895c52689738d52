r"""Is KV prefix reuse exact on the accelerator? Reuse against a recompute cut where the reuse cuts.

  PYTHONPATH=. python3 experiments/check_reuse_gpu.py --out_dir=$OUT                         # GPU (H200)
  PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python experiments/check_reuse_gpu.py --preset=tiny-hybrid \
      --num_layers=0 --prefix_tokens=3968 --prompt_tokens=4032 --chunk_tokens=64 --prefill_chunk=2048 \
      --expert_slots=40 --out_dir=/tmp/check_reuse                                             # CPU smoke

Why: on an H200 ``bench_kv_reuse.py --preset=qwen3.5-35b-a3b`` (random weights, bf16) found the
first-token logits of a request that reuses 62 stored chunks (15,872 tokens) off a full recompute
of its 16,128 tokens by 2.61 (max |logit| 4.78), the greedy token different; the other family
(qwen3-30b-a3b) 0.075. Either the resumed state / K/V is wrong at that scale (a bug), or rounding
is amplified by a random-weight MoE model in bf16. This script tells them apart.

Each case runs, on one engine in the bench's config (experts "cached" with ``--expert_slots``
slots, at least 2E so that prefill calls stream whole layers on the scan as in the bench; the KV
load ``--load``, store route ``--store_route``, the hit chunk count padded by ``bucket_chunks``,
62 -> 64 = the whole 16,384-row cache):

* ``store``: request A, the first ``--prefix_tokens`` tokens, prefilled in calls of
  ``--prefill_chunk`` (8192 + 7680, the second padded to 8192), storing its full chunks;
* ``reuse``: request B, ``--prompt_tokens`` tokens sharing A's prefix, reusing A's chunks (the hybrid
  family: whole chunks only) and computing the rest (one 256-token call); its last token's logits
  are compared with:

  (i)   ``vs_cut_recompute``: a plain prefill of B (no KV manager, no hook) whose calls start where
        the reuse's calls started: A's call starts below the reused length, then B's (0, 8192,
        15872), each padded as there. The reuse computes exactly this: an exact reuse gives 0
        (bit-identical on the CPU, tests/test_hybrid_reuse_scale.py). On a GPU the programs differ
        (the reuse's calls carry the KV hook, and XLA may fuse them otherwise): ~0 in float32.
  (ii)  ``vs_recompute``: the bench's recompute, the miss path (an empty store) in calls of
        ``--prefill_chunk`` (8192 + 7936): the 256 new tokens are rows 7680.. of an 8192-row call
        there, rows 0.. of a 256-row call in the reuse: other shapes, other kernels, other rounding.
  (iii) ``other_cuts``: plain prefills with other cuts (``--other_cuts``; default "before": the
        reuse's cuts with the last one a chunk earlier, a last call of 512 rows) against the
        recompute. No reuse is involved: this is what cutting elsewhere costs in this dtype. A (ii)
        of that size is rounding, not reuse. ``cut_recompute_vs_recompute`` is the same for (i)'s
        cuts, and ``cut_recompute_repeat`` the cut recompute run twice (run-to-run noise).

  Each comparison also says whether the greedy first tokens agree, and how many (token, layer)
  routing decisions of the computed suffix differ (``routing_flips``, top-k sets that differ, and
  of the last token): a flip moves that token's MoE output by O(1), the way a bf16 rounding
  difference becomes an O(1) logit difference;
* ``control_stale_state`` (hybrid family): (i) for a planted bug, the last reused chunk's entry
  carrying the DeltaNet states of the chunk before it (a state one chunk stale): how far (i) moves
  for a wrong resumed state. With the random weights' fast decay it hardly moves (the 256 new tokens
  forget it), with the ``_slow`` cases' decay it must;
* ``stored_state``: the stored entries against a plain prefill of A cut at A's call starts, at the
  end of each of A's calls (8192, 15872): the K/V rows of every stored chunk up to there and, for
  the hybrid family, the DeltaNet conv and recurrent states of the chunk ending there (expected 0).

Cases (``--cases``, run in order, default all five; those not started after ``--time_budget_s``
are skipped): the fixtures ``qwen3_5_moe_fp32`` and ``qwen3_moe_fp32`` (tests/fixtures, seconds;
``--fixture_*`` sizes: 13 chunks of 64 stored in calls of 512 + 320, passed as 14), then
``preset_bfloat16`` and ``preset_float32``: ``--preset`` with random weights
(``ftjax.checkpoint.random_model``, as the bench) cut to its first ``--num_layers`` layers (8 = two
blocks of three Gated DeltaNet + one attention layer for qwen3.5-35b-a3b, so that the block scan
really loops and block 1 reads its slice of the host-memory state and K/V; the expert pool is 12.9 GB
of host memory in bf16, 25.8 GB in float32, instead of 64 GB; 650 slots on the device are 4.1 /
8.2 GB; one preset model is held at a time), at the bench's token counts; then
``preset_float32_slow``: the same weights with every DeltaNet head's ``A_log`` = ``--slow_a_log``.
The random ``A_log`` ~ 0 forgets about half the recurrent state per token, so the last token's logits
hardly depend on the resumed state 256 tokens earlier; with -5 about a third of it survives 256
tokens, and a wrong resumed state shows in (i) (see ``control_stale_state``). Float32 runs under
matmul precision "highest" (no TF32), bfloat16 under the engine's default (as the bench).
``--num_layers=0 --cases=preset_bfloat16`` runs the whole 40-layer preset as the bench did (a 64 GB
pool in pinned host memory: ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115`` on the H200, docs/HYBRID.md).

Reading it (``summary``): a reuse bug shows as a float32 (i) or ``stored_state`` far above 0;
rounding shows as (i) ~ 0 and (ii) no larger than (iii), with routing flips in bf16.

Every engine runs with the kernel config of the kernel flags (``--kernels``, ``--kernel_tiles``, ... as
``ftjax.generate``; ``EngineConfig.kernels``), recorded in each case's ``engine``.

Output: one JSON, ``check_reuse_gpu.json`` (meta, flags, one row per case with the seconds and
compile seconds of each stage, summary), rewritten after every stage. GPU runtime (estimate, not
measured): ~2-4 min, mostly compilation: per preset dtype 6 programs (the 8192-row call with the
store hook and without, the 256-row call with the 64-chunk prefix and without, the 512-row call of
(iii), decode; the slow case reuses float32's), the fixtures' in about a second each; the runs take
seconds. One risk: docs/HYBRID.md (the 2026-11-30 run) saw the full preset's reuse program (256 rows, 64
chunks) still compiling after ~390 s; the log prints each stage's compile seconds as it goes, and if
that stage is the slow one, ``--prefix_tokens=3840 --prompt_tokens=4096 --prefill_chunk=2048`` (15
chunks stored in 2048 + 1792, passed as 16) tells the same story faster. CPU smoke: ~4 min on 2 cores.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import re
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import Engine  # noqa: E402
from ftjax.checkpoint import load_checkpoint, random_model  # noqa: E402
from ftjax.config import KV_LOADS, KV_STORE_ROUTES, EngineConfig, KVOffloadConfig, preset  # noqa: E402
from ftjax.runtime.engine import Row  # noqa: E402
from ftjax.runtime.plan import PrefillCall, bucket  # noqa: E402
from ftjax.kv.host_store import HostKVStore  # noqa: E402
from ftjax.kv.layerwise import bucket_chunks  # noqa: E402
from ftjax.kv.prefix_cache import PrefixCache  # noqa: E402

FIXTURE_CASES = ("qwen3_5_moe_fp32", "qwen3_moe_fp32")
DEFAULT_CASES = FIXTURE_CASES + ("preset_bfloat16", "preset_float32", "preset_float32_slow")

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", list(DEFAULT_CASES), "Cases: fixture names, preset_<dtype>, preset_<dtype>_slow.")
flags.DEFINE_string("preset", "qwen3.5-35b-a3b", "Model shape of the preset cases (random weights).")
flags.DEFINE_integer("num_layers", 8, "Keep the preset's first this many layers (0: all; the hybrid family: a "
                     "multiple of its block, 4).")
flags.DEFINE_integer("prefix_tokens", 15872, "Preset cases: tokens of the storing request A (a multiple of "
                     "--chunk_tokens).")
flags.DEFINE_integer("prompt_tokens", 16128, "Preset cases: tokens of the reusing request B.")
flags.DEFINE_integer("chunk_tokens", 256, "Preset cases: tokens per stored chunk.")
flags.DEFINE_integer("prefill_chunk", 8192, "Preset cases: most tokens per prefill call.")
flags.DEFINE_integer("expert_slots", 650, "Preset cases: expert slots of the cached engine (the bench's 650; at "
                     "least 2E so that calls stream on the scan; clipped to L*E).")
flags.DEFINE_integer("fixture_prefix_tokens", 832, "Fixture cases: tokens of request A (13 chunks of 64).")
flags.DEFINE_integer("fixture_prompt_tokens", 896, "Fixture cases: tokens of request B.")
flags.DEFINE_integer("fixture_chunk_tokens", 64, "Fixture cases: tokens per stored chunk.")
flags.DEFINE_integer("fixture_prefill_chunk", 512, "Fixture cases: most tokens per prefill call.")
flags.DEFINE_enum("load", "xs", list(KV_LOADS), "KV load of the reuse (the bench's run: xs).")
flags.DEFINE_enum("store_route", "scan", list(KV_STORE_ROUTES), "Store route (the bench's run: scan).")
flags.DEFINE_float("slow_a_log", -5.0, "A_log of every DeltaNet head in the *_slow cases (decay per token "
                   "exp(-exp(A_log) * softplus(...))).")
flags.DEFINE_list("other_cuts", ["before"], "Plain prefills of (iii), with other call cuts than "
                  "the reuse's and the recompute's: 'before' (the reuse's cuts with the last one a chunk earlier), "
                  "'inside' (half a chunk later), 'halves' (calls of half --prefill_chunk).")
flags.DEFINE_boolean("check_states", True, "Compare the stored entries with a cut prefill of A.")
flags.DEFINE_integer("seed", 0, "Weights and prompt seed.")
flags.DEFINE_float("time_budget_s", 240.0, "Skip the cases not yet started once this many seconds have passed (the "
                   "JSON is rewritten after every case).")
flags.DEFINE_string("out_dir", "experiments/results/checks", "Where the JSON goes.")
common.validate("cases", lambda names: next((
    f"unknown case {n!r}; expected {', '.join(FIXTURE_CASES)}, preset_<bfloat16|float32>[_slow]"
    for n in names or () if n not in FIXTURE_CASES and not re.fullmatch(r"preset_(bfloat16|float32)(_slow)?", n)),
    None))
common.define_kernel_flags()  # the kernel config of every engine (EngineConfig.kernels)
common.check_preset()
common.check_names("other_cuts", ("before", "inside", "halves"), allow_empty=True)
common.check_names("cases", FIXTURE_CASES + tuple(f"preset_{d}{s}" for d in ("bfloat16", "float32")
                                                   for s in ("", "_slow")))
for _name in ("prefix_tokens", "prompt_tokens", "chunk_tokens", "prefill_chunk", "expert_slots",
              "fixture_prefix_tokens", "fixture_prompt_tokens", "fixture_chunk_tokens", "fixture_prefill_chunk"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("num_layers", lambda v: v >= 0, "must be >= 0")


# ---- prefills --------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """One prefill: last-token logits (float32 numpy [V]), the final cache, per-call stats and calls."""

    logits: np.ndarray
    cache: object
    stats: list
    calls: list[PrefillCall]
    record: dict | None = None

    def call_starts(self) -> list[int]:
        return [c.start for c in self.calls]


def managed(engine: Engine, mgr: PrefixCache, prompt: list[int]) -> Run:
    """A prefill through a prefix-reuse manager (lookup, reuse, store), as a served request."""
    cache = engine.new_cache(1)
    req = engine.prepare_prefill([prompt], cache, mgr)
    logits, cache, _, stats = engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    return Run(np.asarray(logits[0], np.float32), cache, stats, list(req.calls), req.record())


def cut_prefill(engine: Engine, prompt: list[int], starts, buckets=None) -> Run:
    """A plain prefill (no KV manager, no hook) whose calls start at ``starts`` (ascending, 0
    first), each padded to its entry of ``buckets`` (default: the engine's ``bucket``)."""
    bounds = list(starts) + [len(prompt)]
    if bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"call starts {starts} must ascend from 0 below {len(prompt)}")
    buckets = buckets or [bucket(e - s) for s, e in zip(bounds, bounds[1:])]
    calls = [PrefillCall(s, (e - s,), t) for s, e, t in zip(bounds, bounds[1:], buckets)]
    # a row's calls come from Engine._row (plain chunks of prefill_chunk): this instance's rows get these
    # calls instead, for the compile (prepare_prefill) and the run (prefill)
    engine._row = lambda p, kv_manager=None: Row([int(t) for t in p], collections.deque(calls))
    try:
        cache = engine.new_cache(1)
        engine.prepare_prefill([prompt], cache)
        logits, cache, _, stats = engine.prefill([prompt], cache)
    finally:
        del engine._row
    return Run(np.asarray(logits[0], np.float32), cache, stats, calls)


def routing(run: Run, lo: int, hi: int) -> np.ndarray:
    """Routed expert ids of positions [lo, hi), each top-k set sorted: int [L, hi - lo, k]."""
    out = None
    for call, st in zip(run.calls, run.stats):
        a, b = max(lo, call.start), min(hi, call.start + call.valid[0])
        if a >= b:
            continue
        ids = np.sort(np.asarray(st.routed_ids)[:, a - call.start: b - call.start], axis=-1)
        if out is None:
            out = np.full((ids.shape[0], hi - lo, ids.shape[2]), -1, ids.dtype)
        out[:, a - lo: b - lo] = ids
    return out


def compare(got: Run, ref: Run, lo: int, hi: int) -> dict:
    """Last-token logits and the routing of positions [lo, hi) of two prefills of one prompt."""
    diff = np.abs(got.logits - ref.logits)
    ra, rb = routing(got, lo, hi), routing(ref, lo, hi)
    flips = np.any(ra != rb, axis=-1)  # [L, T]
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "max_abs_logit_ref": float(np.abs(ref.logits).max()),
            "first_token": int(np.argmax(got.logits)), "first_token_ref": int(np.argmax(ref.logits)),
            "first_token_equal": int(np.argmax(got.logits)) == int(np.argmax(ref.logits)),
            "routing_flips": int(flips.sum()), "routing_decisions": int(flips.size),
            "routing_flips_last_token": int(flips[:, -1].sum()),
            "routing_flip_layers_last_token": np.nonzero(flips[:, -1])[0].tolist()}


def other_cut_sets(store_starts, reused: int, n: int, chunk: int, prefill_chunk: int):
    """(label, call starts) of the plain prefills of ``--other_cuts`` (see its help)."""
    for label in FLAGS.other_cuts:
        if label in ("before", "inside"):
            at = reused - chunk if label == "before" else reused + chunk // 2
            if 0 < at < n:
                yield f"{label}_cut_at_{at}", [s for s in store_starts if s < at] + [at]
        elif label == "halves":
            yield "halves", list(range(0, n, max(16, prefill_chunk // 2)))
        else:
            raise app.UsageError(f"--other_cuts {label!r}: expected before, inside or halves")


def stale_state_store(engine: Engine, mgr: PrefixCache, prompt: list[int], hit: int) -> PrefixCache:
    """A manager over a new store holding the first ``hit`` chunks' entries of ``mgr``'s store (the same
    host arrays), except that the last one carries the DeltaNet states of the chunk before it: the
    bug "resumes from a state one chunk stale", the positive control of (i)."""
    keys = mgr.keys(engine, prompt)[:hit]
    entries = [mgr.store.peek(k) for k in keys]
    store = HostKVStore(mgr.store.capacity_bytes)
    for k, e in zip(keys[:-1], entries[:-1]):
        store.put(k, e, copy=False)
    store.put(keys[-1], (entries[-1][0],) + tuple(entries[-2][1:]), copy=False)
    return PrefixCache(store, mgr.config)


# ---- stored entries ----------------------------------------------------------------------------
def stored_state_check(engine: Engine, mgr: PrefixCache, prompt: list[int], store: Run, ends) -> list[dict]:
    """For each end e (a multiple of C): the stored entries of prompt[:e] against a plain prefill of
    prompt[:e] cut at the storing request's call starts: max |diff| of the K/V rows of every chunk
    up to e and, for the hybrid family, of the conv / recurrent state of the chunk ending at e."""
    c = mgr.chunk_tokens
    keys = mgr.keys(engine, prompt)
    out = []
    for e in ends:
        n = e // c
        entries = [mgr.store.peek(k) for k in keys[:n]]
        row = {"end": e, "chunks": n}
        if any(x is None for x in entries):
            row["error"] = "some entries are not in the store"
            out.append(row)
            continue
        ref = cut_prefill(engine, prompt[:e], [s for s in store.call_starts() if s < e])
        k = np.asarray(ref.cache.k[:, 0, :e], np.float32)  # [L_att, e, Hkv, hd]
        v = np.asarray(ref.cache.v[:, 0, :e], np.float32)
        kv = [np.asarray(x[0] if isinstance(x, tuple) else x, np.float32) for x in entries]
        row["kv_max_abs_diff"] = max(float(max(np.abs(x[:, 0] - k[:, i * c:(i + 1) * c]).max(),
                                               np.abs(x[:, 1] - v[:, i * c:(i + 1) * c]).max()))
                                     for i, x in enumerate(kv))
        row["kv_max_abs"] = float(max(np.abs(k).max(), np.abs(v).max()))
        if isinstance(entries[-1], tuple):
            # stored by block [G, Nl, ...]; the cache stacks the linear layers [L_lin, B, ...]
            _, conv, rec = (np.asarray(a, np.float32).reshape((-1,) + a.shape[2:]) for a in entries[-1])
            ref_conv = np.asarray(ref.cache.conv[:, 0], np.float32)
            ref_rec = np.asarray(ref.cache.rec[:, 0], np.float32)
            row["conv_max_abs_diff"] = float(np.abs(conv - ref_conv).max())
            row["rec_max_abs_diff"] = float(np.abs(rec - ref_rec).max())
            row["rec_max_abs"] = float(np.abs(ref_rec).max())
        out.append(row)
        del ref
    return out


# ---- one case ----------------------------------------------------------------------------------
def check_case(name: str, model, prompt: list[int], prefix_tokens: int, chunk: int, prefill_chunk: int,
               slots: int, progress=lambda row: None) -> dict:
    """Store, reuse and the comparisons of the module docstring, on one cached engine.
    ``progress(row)`` gets the row so far after each stage (a run cut by a time limit keeps it)."""
    cfg = model.cfg
    t0 = time.perf_counter()
    stages: dict = {}

    def stage(label: str, t: float, compile_s: float) -> None:
        stages[label] = {"s": time.perf_counter() - t, "compile_s": compile_s}
        row["stages"] = stages
        print(f"  [{name}] {label}: {stages[label]['s']:.1f} s ({stages[label]['compile_s']:.1f} s compiling)",
              flush=True)
        progress(dict(row, partial=f"the case had not finished (last stage: {label})"))

    n_stored = prefix_tokens // chunk
    max_seq_len = max(-(-(len(prompt) + 1) // 128) * 128, bucket_chunks(n_stored) * chunk)  # as the bench
    slots = max(2 * cfg.num_experts, min(slots, cfg.num_layers * cfg.num_experts))
    engine = Engine(model, EngineConfig("cached", num_slots=slots, max_seq_len=max_seq_len,
                                        prefill_chunk=prefill_chunk, kernels=common.kernel_config()))
    kv_cfg = KVOffloadConfig(chunk_tokens=chunk, load=FLAGS.load, store_route=FLAGS.store_route,
                             prefill_chunk=prefill_chunk)
    entry = PrefixCache(HostKVStore(0), kv_cfg).entry_bytes(engine)
    mgr = PrefixCache(HostKVStore(2 * (n_stored + 4) * entry), kv_cfg)
    row = {"case": name, "model_type": cfg.model_type, "dtype": model.dtype, "num_layers": cfg.num_layers,
           "layer_types": list(cfg.layer_types), "weights": model.name, "prompt_tokens": len(prompt),
           "prefix_tokens": prefix_tokens, "chunk_tokens": chunk, "prefill_chunk": prefill_chunk,
           "max_seq_len": max_seq_len, "entry_bytes": entry, "engine": engine.describe()}
    n = len(prompt)
    t, c0 = time.perf_counter(), engine.compile_s
    store = managed(engine, mgr, prompt[:prefix_tokens])
    row.update(store_request=store.record, calls={"store": store.call_starts()})
    stage("store", t, engine.compile_s - c0)
    t, c0 = time.perf_counter(), engine.compile_s
    reuse = managed(engine, mgr, prompt)
    reused = reuse.record["reused_tokens"]
    row.update(reuse_request=reuse.record, max_abs_logit=float(np.abs(reuse.logits).max()),
               first_token=int(np.argmax(reuse.logits)))
    row["calls"]["reuse"] = reuse.call_starts()
    stage("reuse", t, engine.compile_s - c0)
    t, c0 = time.perf_counter(), engine.compile_s
    recompute = managed(engine, PrefixCache(HostKVStore(0), kv_cfg), prompt)
    row["calls"]["recompute"] = recompute.call_starts()
    row["vs_recompute"] = compare(reuse, recompute, reused, n)
    stage("recompute", t, engine.compile_s - c0)
    t, c0 = time.perf_counter(), engine.compile_s
    # the reuse's calls: the storing request's below the reused length, then its own, each as padded there
    calls = [c for c in store.calls if c.start < reused] + reuse.calls
    cut = cut_prefill(engine, prompt, [c.start for c in calls], [c.bucket for c in calls])
    row["calls"]["cut_recompute"] = cut.call_starts()
    row["vs_cut_recompute"] = compare(reuse, cut, reused, n)
    row["cut_recompute_vs_recompute"] = compare(cut, recompute, reused, n)
    again = cut_prefill(engine, prompt, [c.start for c in calls], [c.bucket for c in calls])
    row["cut_recompute_repeat"] = compare(again, cut, reused, n)  # run-to-run determinism of one program
    stage("cut_recompute", t, engine.compile_s - c0)
    if cfg.is_hybrid and reuse.record["hit_chunks"] >= 2:
        t, c0 = time.perf_counter(), engine.compile_s
        stale = managed(engine, stale_state_store(engine, mgr, prompt, reuse.record["hit_chunks"]), prompt)
        row["control_stale_state"] = compare(stale, cut, reused, n)  # what (i) shows for a state a chunk late
        del stale
        stage("control_stale_state", t, engine.compile_s - c0)
    del reuse, cut, again
    row["other_cuts"] = {}
    for label, starts in other_cut_sets(store.call_starts(), reused, n, chunk, prefill_chunk):
        t, c0 = time.perf_counter(), engine.compile_s
        other = cut_prefill(engine, prompt, starts)
        row["calls"][label] = other.call_starts()
        row["other_cuts"][label] = compare(other, recompute, reused, n)
        del other
        stage(label, t, engine.compile_s - c0)
    del recompute
    if FLAGS.check_states:
        t, c0 = time.perf_counter(), engine.compile_s
        ends = sorted({c.start + c.valid[0] for c in store.calls if (c.start + c.valid[0]) % chunk == 0}
                      | ({reused} if reused % chunk == 0 and reused else set()))
        row["stored_state"] = stored_state_check(engine, mgr, prompt[:prefix_tokens], store,
                                                 [e for e in ends if e <= prefix_tokens])
        stage("stored_state", t, engine.compile_s - c0)
    row["compile_s"] = engine.compile_s
    row["wall_s"] = time.perf_counter() - t0
    del engine, store, mgr
    gc.collect()
    return row


def case_line(row: dict) -> str:
    """The case's figures on a few lines."""
    if "error" in row:
        return f"{row['case']}: ERROR {row['error'][:300]}"
    parts = [f"{row['case']} ({row['dtype']}, {row['num_layers']} layers, {row['prompt_tokens']} tokens, "
             f"reused {row['reuse_request']['reused_tokens']}, passed {row['reuse_request']['prefix_chunks_passed']} "
             f"chunks): max|logit| {row['max_abs_logit']:.3g}, {row['wall_s']:.0f} s"]
    pairs = [(k, row[k]) for k in ("vs_cut_recompute", "vs_recompute", "cut_recompute_vs_recompute",
                                   "cut_recompute_repeat", "control_stale_state") if k in row]
    pairs += [(f"recompute_vs_{k}", v) for k, v in row.get("other_cuts", {}).items()]
    for key, r in pairs:
        same = "=" if r["first_token_equal"] else "!="
        parts.append(f"{key}: max|diff| {r['max_abs_diff']:.3g}, first token {same}, "
                     f"routing flips {r['routing_flips']}/{r['routing_decisions']} "
                     f"(last token: {r['routing_flips_last_token']})")
    for s in row.get("stored_state", []):
        parts.append(f"stored state at {s['end']}: " + (s["error"] if "error" in s else
                     f"K/V {s['kv_max_abs_diff']:.3g}" + (f", conv {s['conv_max_abs_diff']:.3g}, "
                                                          f"rec {s['rec_max_abs_diff']:.3g}" if "rec_max_abs_diff" in s
                                                          else "")))
    return "\n  ".join(parts)


# ---- the cases -------------------------------------------------------------------------------
def cut_preset(name: str, num_layers: int):
    """``name``'s config with its first ``num_layers`` layers (0: all), positions enough for the run."""
    cfg = preset(name)
    if num_layers:
        if cfg.layer_types and num_layers % len(cfg.block_pattern):
            raise app.UsageError(f"--num_layers {num_layers}: not a multiple of the block {cfg.block_pattern}")
        cfg = dataclasses.replace(cfg, num_layers=num_layers,
                                  layer_types=cfg.layer_types[:num_layers] if cfg.layer_types else ())
    longest = max(FLAGS.prompt_tokens + 128, bucket_chunks(FLAGS.prefix_tokens // FLAGS.chunk_tokens)
                  * FLAGS.chunk_tokens)
    return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, longest))


def slow_decay(model, a_log: float):
    """The same model with every DeltaNet head's ``A_log`` set to ``a_log`` (the host banks shared)."""
    params = dict(model.params)
    layers = dict(params["layers"])  # the Gated DeltaNet weights stacked over its layers: A_log [L_lin, Hv]
    layers["A_log"] = jnp.full_like(layers["A_log"], a_log)
    params["layers"] = layers
    return dataclasses.replace(model, params=params, name=f"{model.name}:A_log={a_log}",
                               fingerprint=f"{model.fingerprint}:A_log={a_log}")  # other weights, other KV keys


def run_cases(cases: list[str], progress=lambda rows, partial: None) -> list[dict]:
    """Every case of ``cases`` in order (those not started after ``--time_budget_s`` are skipped);
    ``progress(rows)`` after each."""
    rows: list[dict] = []
    rng = np.random.default_rng(FLAGS.seed)
    built: dict = {}  # dtype -> the preset model (one at a time)
    start = time.perf_counter()
    for name in cases:
        t0 = time.perf_counter()
        last: dict = {}  # the case's row as of its last finished stage (kept if a later stage raises)

        def stage_done(r, last=last):
            last.clear()
            last.update(r)
            progress(rows + [r], True)

        if t0 - start > FLAGS.time_budget_s:
            rows.append({"case": name, "error": f"skipped: time budget {FLAGS.time_budget_s} s spent"})
            print(case_line(rows[-1]), flush=True)
            continue
        try:
            if name in FIXTURE_CASES:
                model = load_checkpoint(os.path.join(common.FIXTURES_DIR, name), "float32", progress=False)
                prompt = rng.integers(0, model.cfg.vocab_size, FLAGS.fixture_prompt_tokens).tolist()
                with jax.default_matmul_precision("highest"):
                    row = check_case(name, model, prompt, FLAGS.fixture_prefix_tokens, FLAGS.fixture_chunk_tokens,
                                     FLAGS.fixture_prefill_chunk, 2 * model.cfg.num_experts + 1,
                                     progress=stage_done)
                del model
            elif name.startswith("preset_"):
                dtype, _, slow = name[len("preset_"):].partition("_")
                if slow not in ("", "slow") or dtype not in ("bfloat16", "float32"):
                    raise ValueError(f"unknown case {name!r}")
                if dtype not in built:
                    built.clear()  # one preset model in memory at a time
                    gc.collect()
                    t = time.perf_counter()
                    built[dtype] = random_model(cut_preset(FLAGS.preset, FLAGS.num_layers), dtype, seed=FLAGS.seed)
                    built[dtype].host_down.block_until_ready()
                    print(f"random {FLAGS.preset} ({FLAGS.num_layers or 'all'} layers, {dtype}) built in "
                          f"{time.perf_counter() - t:.1f} s", flush=True)
                model = built[dtype]
                if slow:
                    if not model.cfg.is_hybrid:
                        raise ValueError(f"{name}: {FLAGS.preset} has no DeltaNet layers")
                    model = slow_decay(model, FLAGS.slow_a_log)
                prompt = np.random.default_rng(FLAGS.seed).integers(0, model.cfg.vocab_size,
                                                                    FLAGS.prompt_tokens).tolist()
                with jax.default_matmul_precision("highest" if dtype == "float32" else None):
                    row = check_case(name, model, prompt, FLAGS.prefix_tokens, FLAGS.chunk_tokens,
                                     FLAGS.prefill_chunk, FLAGS.expert_slots,
                                     progress=stage_done)
                row["preset"] = FLAGS.preset
                if slow:
                    row["a_log"] = FLAGS.slow_a_log
                del model
            else:
                raise ValueError(f"unknown case {name!r}; expected {', '.join(FIXTURE_CASES)}, preset_<dtype>[_slow]")
        except Exception as e:  # noqa: BLE001 -- one failing case must not lose the others
            row = {**last, "case": name, "error": f"{type(e).__name__}: {e}"[:3000], "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(case_line(row), flush=True)
        progress(rows, False)
        gc.collect()
    return rows


def judge(row: dict) -> dict:
    """One case's reading (see the module docstring): the reuse against the cut recompute (exact,
    within the cut recompute's own run-to-run spread, or off by how much), the stored entries, and
    the plain recompute's diff against the spread of recomputes with other cuts."""
    cut, rec, again = row["vs_cut_recompute"], row["vs_recompute"], row["cut_recompute_repeat"]
    scale = max(row["max_abs_logit"], 1e-30)
    states = [s for s in row.get("stored_state", []) if "error" not in s]
    state_rel = max([max(s["kv_max_abs_diff"] / max(s["kv_max_abs"], 1e-30),
                         s.get("rec_max_abs_diff", 0.0) / max(s.get("rec_max_abs", 1.0), 1e-30),
                         s.get("conv_max_abs_diff", 0.0)) for s in states], default=None)
    floor = max([v["max_abs_diff"] for v in row.get("other_cuts", {}).values()], default=None)
    if cut["max_abs_diff"] == 0.0:
        reuse = "exact: bit-identical to the recompute cut at the reused boundary"
    elif cut["max_abs_diff"] <= again["max_abs_diff"]:
        reuse = "within the cut recompute's own run-to-run spread"
    else:
        reuse = (f"differs from the cut recompute by {cut['max_abs_diff']:.3g} "
                 f"({cut['max_abs_diff'] / scale:.2g} relative)")
    return {"reuse": reuse, "reuse_vs_cut_rel": cut["max_abs_diff"] / scale,
            "cut_repeat_rel": again["max_abs_diff"] / scale, "stored_state_max_rel_diff": state_rel,
            "reuse_vs_recompute_rel": rec["max_abs_diff"] / scale,
            "cut_recompute_vs_recompute_rel": row["cut_recompute_vs_recompute"]["max_abs_diff"] / scale,
            "other_cuts_vs_recompute_rel": None if floor is None else floor / scale,
            "reuse_vs_recompute_over_other_cuts": None if not floor else rec["max_abs_diff"] / floor,
            "first_token_equal_recompute": rec["first_token_equal"],
            "control_stale_state_rel": row["control_stale_state"]["max_abs_diff"] / scale
            if "control_stale_state" in row else None}


def verdict(rows: list[dict]) -> dict:
    """Each case's :func:`judge`, and the overall reading: the float32 cases (full precision)
    decide whether the reuse is exact ((i) and the stored state at ~0 relative: 1e-4 allows for
    programs that XLA fuses otherwise); if so, a bfloat16 diff to the plain recompute is the cost of
    cutting elsewhere, amplified by the model, not of the reuse."""
    def one(r):
        if "error" in r:
            return "error: " + r["error"][:200]
        return f"incomplete: {r['partial']}" if "partial" in r else judge(r)

    out: dict = {"cases": {r["case"]: one(r) for r in rows}}
    f32 = {k: v for k, v in out["cases"].items() if isinstance(v, dict) and ("float32" in k or k in FIXTURE_CASES)}
    exact = [v["reuse_vs_cut_rel"] < 1e-4 and (v["stored_state_max_rel_diff"] or 0.0) < 1e-4 for v in f32.values()]
    if not f32:
        out["verdict"] = "no float32 case ran"
    elif all(exact):
        out["verdict"] = ("(b) the reuse is exact in every float32 case (the reuse equals the recompute cut at its "
                          "boundary, the stored entries equal the recomputed state): a diff to the plain recompute is "
                          "the cost of other call cuts (see cut_recompute_vs_recompute and other_cuts)")
    else:
        bad = [k for k, ok in zip(f32, exact) if not ok]
        out["verdict"] = f"(a) suspect a reuse bug: float32 cases {bad} differ from the cut recompute or stored state"
    return out


def main(argv):
    del argv
    if FLAGS.prefix_tokens % FLAGS.chunk_tokens or FLAGS.prompt_tokens <= FLAGS.prefix_tokens:
        raise app.UsageError("--prefix_tokens must be a multiple of --chunk_tokens and below --prompt_tokens")
    list(other_cut_sets([0], FLAGS.chunk_tokens, 4 * FLAGS.chunk_tokens, FLAGS.chunk_tokens, FLAGS.prefill_chunk))
    info = common.meta()
    print(f"{info['device']} ({info['backend']}), jax {info['jax']}: cases {FLAGS.cases}", flush=True)
    t0 = time.perf_counter()

    def write(rows, partial=False):
        payload = {"meta": info, "script": "experiments/check_reuse_gpu.py", "wall_s": time.perf_counter() - t0,
                   "summary": verdict(rows), "results": rows}
        if partial:
            payload["partial"] = "not every case has run yet"
        return common.write_json(FLAGS.out_dir, "check_reuse_gpu.json", payload)

    rows = run_cases(FLAGS.cases, progress=lambda r, partial: write(r, partial=True))
    path = write(rows)
    summary = verdict(rows)
    for case, v in summary["cases"].items():
        print(f"{case}: {v if isinstance(v, str) else v['reuse']}")
    print("verdict:", summary["verdict"])
    print("wrote", path, f"in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    common.run(main)
