r"""Serving benchmarks (issue 31): throughput under concurrency, multi-round QA with KV prefix reuse, and
the HTTP server's overhead per token.

  PYTHONPATH=. python3 experiments/bench_serve.py --part=concurrency,server_overhead --modes=resident \
      --decode_blocks=1,16 --out=$OUT/bench_serve_qwen3-30b-a3b_resident_h200_$(date -u +%F).json   # GPU (H200), ~6 min
  PYTHONPATH=. python3 experiments/bench_serve.py --part=concurrency --modes=cached --vram_budget_gb=8 \
      --cache_policy=lookahead --max_tokens=32 \
      --out=$OUT/bench_serve_qwen3-30b-a3b_cached-8gb_h200_$(date -u +%F).json           # ~7 min
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=115 PYTHONPATH=. python3 experiments/bench_serve.py --part=multiround \
      --modes=resident --kv_host_gb=12 \
      --out=$OUT/bench_serve_qwen3-30b-a3b_multiround-16k_h200_$(date -u +%F).json       # 16k context, 4 users
  .venv/bin/python experiments/bench_serve.py --preset=tiny --dtype=float32 --modes=cached --concurrency=1,2 \
      --requests=3 --prompt_tokens=16 --max_tokens=3 --context_tokens=64 --users=2 --rounds=2 \
      --question_tokens=8 --answer_tokens=3 --kv_chunk_tokens=32 --server_requests=2 --out_dir=/tmp/bs  # CPU smoke

The model, expert-cache, kernel, miss-policy and KV flags are ``ftjax.generate``'s and ``ftjax.serve``'s
(``ftjax.engine_flags``; default ``--preset=qwen3-30b-a3b``, random weights). Every part runs once per expert
mode of ``--modes`` (offloading modes first: resident needs the whole pool on the device), each with an engine
of its own built as ``ftjax.serve`` builds it (``engine_flags.build_engine``: an offloading mode's slots come
from ``--vram_budget_gb`` or ``--expert_slots``; resident ignores both). Requests are greedy and ignore EOS
(the model's EOS ids are dropped: every request makes its ``max_tokens``). Before each timed run an untimed
warm-up runs requests of the same shapes, so that no timed call compiles (``compile_s`` of each run says so).

``--part=concurrency``: the :class:`~ftjax.serve.scheduler.Scheduler` driven in this process (no HTTP), one
engine of ``max(--concurrency)`` rows, a scheduler of ``max_batch`` = N per level N. Closed loop (``--rate=0``):
N requests always in flight, a new one submitted as one finishes; open loop (``--rate`` > 0): Poisson
arrivals at that many requests per second, at most N running, the others waiting in the scheduler's queue.
Each level runs ``--requests`` requests of ``--prompt_tokens`` random ids and ``--max_tokens`` new tokens, once
per scheduler decode block of ``--decode_blocks`` (``Scheduler(decode_block=k)``: k decode steps per program
while no row prefills; 1: one program per step, with ``--run_ahead``; default: ``--decode_block``'s value), each
level's row tagged with its ``decode_block``. ``--mixed_calls``: the scheduler decodes the running requests in an
admission's prefill calls (``Scheduler(mixed_calls=True)``) rather than in decode calls of their own; closed-loop
requests of equal lengths start and end together, so only an open loop (``--rate``) admits while others decode.
Per level: output tokens/s and requests/s over the level's wall time; TTFT (from submit), TPOT (each request's
mean time between tokens) and ITL (every gap between two tokens) as spreads, from ``RequestStats``; engine
calls by kind (prefill, mixed, one-step decode, decode_block programs) and forward steps
(``Scheduler.metrics``: a block counts the steps it ran); the expert cache's hits, misses, hit rate and H2D
bytes in the level (prefill and decode), H2D bytes per output token; ``speedup_vs_c1``: tokens/s over
concurrency 1's at the same decode block (targets, closed loop: >= 3x at 4 resident, >= 2x cached; an open
loop's tokens/s is its offered load's until the level saturates). ITL inside a decode block is the block's
time divided evenly among its steps (``ftjax.serve.scheduler``).

``--part=multiround``: LMCache's multi-round QA. ``--users`` users, each with its own context of
``--context_tokens`` random ids, then ``--rounds`` rounds of a question of ``--question_tokens`` random ids and
an answer of ``--answer_tokens`` generated tokens; round r's prompt is the context, the questions and answers
of rounds 1..r-1, and question r. The users run concurrently (all in the scheduler, one engine row each); a
user's next round is submitted when its answer ends. Once without KV reuse (no prefix cache: as ``ftjax.serve``
without ``--kv_offload``) and once with it (a ``PrefixCache`` as ``engine_flags.kv_manager`` builds it, over
``--kv_host_gb`` of host memory, chunks of ``--kv_chunk_tokens``; each run and its warm-up have a store of
their own). Per round: TTFT across users (median = the figure) and the prompt tokens reused; per run the KV
store's counters (chunks hit, stored, evicted, bytes loaded); ``speedup_by_round`` (TTFT without / with) and
``speedup_after_first_round`` (TTFT of rounds 2.. pooled, median without / with; target >= 10 at 16k context,
4 users). ``kv_store_bytes_needed`` is what every user's last prompt stores: below ``--kv_host_gb`` nothing
the run reuses is evicted.

``--part=server_overhead``: batch-1 TPOT of one prompt (``--prompt_tokens``, ``--max_tokens``) through the engine
directly (``Scheduler.step`` in a loop, times from ``RequestStats``) and through the HTTP server
(``ftjax.serve.server.create_app`` under uvicorn in a thread of this process, streamed ``/v1/completions``
requests from httpx in a client process of its own, the time between the chunks that carry text),
``--server_requests`` timed requests each way after one warm-up each. The client runs in another process so that
what is measured is the server's cost, not the client's: in this process its parsing of every chunk would compete
with the server's event loop and the scheduler thread for the GIL (results up to 2026-12-03 ran it here, and their
``tpot_ratio`` counts the client's cost too). Its times are CLOCK_MONOTONIC (``time.monotonic_ns``), one clock
for every process. A model without a tokenizer is served with one that writes each id as text (``<id>``), so
that every token is one chunk. ``tpot_ratio``: median per-request mean TPOT over HTTP / directly (target
<= 1.05); ``tpot_ratio_median_gap``: the same from the median gap between two tokens. The multiround and
server_overhead parts' schedulers decode in blocks of ``--decode_block`` steps (as ``ftjax.serve`` does): tokens
then come in bursts of up to that many, so the median gap means something with ``--decode_block=1`` only.

``--part=all`` runs the three (``--part`` also takes a comma list). One JSON (``--out``, default
``<out_dir>/bench_serve_<preset>_<date>.json``): ``meta`` (provenance), ``flags``, ``parts`` (per part and mode,
as above; a failed run has its ``error``), ``targets``, and ``results`` (one flat row per level, round or path,
for ``experiments/plots.py``). It is rewritten (atomically) as each level, run and part ends, marked ``partial``
until the end, so that a run stopped by a time limit keeps what finished. Times in seconds, sizes in bytes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import json
import os
import sys
import threading
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402
from ftjax import engine_flags  # noqa: E402
from ftjax.config import EXPERT_MODES  # noqa: E402

PARTS = ("concurrency", "multiround", "server_overhead")
DEFAULT_PRESET = "qwen3-30b-a3b"
TARGETS = {"concurrency": {"resident": "tokens/s at concurrency 4 >= 3x concurrency 1",
                           "cached": "tokens/s at concurrency 4 >= 2x concurrency 1"},
           "multiround": "TTFT without / with KV reuse >= 10 (rounds after the first; 16k context, 4 users)",
           "server_overhead": "TPOT through HTTP / directly <= 1.05"}
#: Scheduler.metrics() keys that are levels, not counters (not differenced between two snapshots).
GAUGES = ("requests_running", "requests_waiting", "expert_cache_hit_rate", "kv_bytes_in_use")

FLAGS = flags.FLAGS
engine_flags.define_flags()
FLAGS.set_default("preset", DEFAULT_PRESET)
flags.DEFINE_list("part", ["all"], "What to run: all, or some of concurrency, multiround, server_overhead (run in "
                  "that order).")
flags.DEFINE_list("modes", ["resident", "cached"], "Expert modes; every part runs once per mode (--experts is "
                  "ignored). --vram_budget_gb / --expert_slots size the offloading modes' caches.")
flags.DEFINE_list("concurrency", ["1", "4", "16"], "Concurrency levels: requests in flight (closed loop) or "
                  "running at most (--rate > 0).")
flags.DEFINE_integer("requests", 32, "Timed requests per concurrency level.", lower_bound=1)
flags.DEFINE_integer("prompt_tokens", 512, "Prompt tokens of each concurrency and server_overhead request.",
                     lower_bound=1)
flags.DEFINE_integer("max_tokens", 64, "New tokens of each concurrency and server_overhead request.", lower_bound=1)
flags.DEFINE_float("rate", 0.0, "Requests per second of Poisson arrivals (open loop); 0: closed loop, N requests "
                   "always in flight.", lower_bound=0.0)
flags.DEFINE_integer("users", 4, "Multi-round QA: concurrent users.", lower_bound=1)
flags.DEFINE_integer("context_tokens", 16384, "Multi-round QA: each user's context (random ids).", lower_bound=1)
flags.DEFINE_integer("rounds", 4, "Multi-round QA: rounds (question + answer) per user.", lower_bound=1)
flags.DEFINE_integer("question_tokens", 64, "Multi-round QA: tokens of each question (random ids).", lower_bound=1)
flags.DEFINE_integer("answer_tokens", 32, "Multi-round QA: tokens of each answer (generated).", lower_bound=1)
flags.DEFINE_integer("server_requests", 5, "server_overhead: timed batch-1 requests each way (after a warm-up).",
                     lower_bound=1)
flags.DEFINE_boolean("warmup", True, "Run untimed requests of the same shapes before each timed run.")
flags.DEFINE_boolean("run_ahead", True, "The scheduler dispatches the next decode step before reading this step's "
                     "tokens (ftjax.serve's --run_ahead).")
flags.DEFINE_boolean("mixed_calls", False, "The scheduler decodes running requests in the prefill call of an "
                     "admission (one mixed call a step) instead of a decode call of their own (ftjax.serve's "
                     "--mixed_calls).")
flags.DEFINE_list("decode_blocks", [], "Scheduler decode blocks the concurrency part compares "
                  "(Scheduler(decode_block=k): k decode steps per program while no row prefills; 1: one program per "
                  "step, with --run_ahead); empty: --decode_block's value alone.")
flags.DEFINE_string("out_dir", "experiments/results/serve", "Where the JSON goes (without --out).")
flags.DEFINE_string("out", None, "The JSON's path (default <out_dir>/bench_serve_<preset>_<date>.json).")
common.check_names("part", (*PARTS, "all"))
common.check_names("modes", EXPERT_MODES)
common.check_numbers("concurrency", int, low=1)
common.check_numbers("decode_blocks", int, low=1, allow_empty=True)


# ---- engines and schedulers ----------------------------------------------------------------------
@contextlib.contextmanager
def flag_values(**values):
    """The flags ``values`` names hold these values in the body (put back after)."""
    old = {k: FLAGS[k].value for k in values}
    try:
        for k, v in values.items():
            FLAGS[k].value = v
        yield
    finally:
        for k, v in old.items():
            FLAGS[k].value = v


def seq_len(tokens: int, cfg) -> int:
    """``tokens`` rounded up to a multiple of 128 (at most the model's context, and never below ``tokens``).
    Raises:
      ValueError: more tokens than the model's context."""
    if tokens > cfg.max_position_embeddings:
        raise ValueError(f"{tokens} tokens exceed the model's max_position_embeddings {cfg.max_position_embeddings}")
    return min(-(-tokens // 128) * 128, cfg.max_position_embeddings)


def build_engine(model, mode: str, max_seq_len: int, batch: int, probe_tokens: int):
    """An engine as ``ftjax.serve`` builds one (``engine_flags.build_engine``) in experts mode ``mode``, planned on
    ``batch`` prompts of ``probe_tokens``; resident ignores --vram_budget_gb and --expert_slots.
    Returns (engine, memory plan or None)."""
    over = {"experts": mode}
    if mode == "resident":
        over.update(vram_budget_gb=None, expert_slots=None)
    probe = [[0] * max(1, min(probe_tokens, max_seq_len - 1, FLAGS.prefill_chunk))] * batch
    with flag_values(**over):
        return engine_flags.build_engine(model, max_seq_len, probe, batch)


def prefix_cache():
    """A fresh prefix cache as ``engine_flags.kv_manager`` builds it with --kv_offload."""
    with flag_values(kv_offload=True):
        return engine_flags.kv_manager()


def scheduler(engine, batch: int, kv_manager=None, waiting: int = 64, decode_block: int | None = None):
    """A scheduler over ``engine`` as ``ftjax.serve`` builds one; ``decode_block`` None: --decode_block's."""
    from ftjax.serve import Scheduler
    return Scheduler(engine, max_batch=batch, max_waiting=max(64, waiting), kv_manager=kv_manager,
                     run_ahead=FLAGS.run_ahead, decode_block=decode_block or FLAGS.decode_block,
                     mixed_calls=FLAGS.mixed_calls)


def finish(row: dict, engine) -> None:
    """The engine's description after its runs (the kernels that applied) and its compile seconds, in ``row``."""
    row["engine"] = engine.describe()
    row["engine_compile_s"] = engine.compile_s


def snapshot(sched) -> dict:
    """The scheduler's counters, the expert cache's per phase and the engine's compile seconds, now."""
    m = dict(sched.metrics())
    eng = sched.engine
    for phase in ("prefill", "decode"):
        s = eng.counters[phase].summary(eng.model.expert_bytes)
        m.update({f"{phase}_{k}": s[k] for k in ("hits", "misses", "bytes_h2d")})
    m["compile_s"] = eng.compile_s
    return m


def engine_figures(before: dict, after: dict, tokens: int) -> dict:
    """What the engine did between two :func:`snapshot` s: calls by kind, steps, expert cache (hits, misses, hit
    rate, H2D bytes, per phase too), H2D bytes per output token, seconds compiling; the KV store's counters."""
    d = {k: v - before.get(k, 0) for k, v in after.items()
         if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in GAUGES}
    hits, misses = d["expert_cache_hits"], d["expert_cache_misses"]
    dh, dm = d["decode_hits"], d["decode_misses"]
    out = {"engine_calls": {k: int(d[f"engine_calls_{k}"])
                            for k in ("prefill", "mixed", "decode", "decode_block", "failed")},
           "steps": int(d["steps"]),
           "expert_cache": {"hits": int(hits), "misses": int(misses),
                            "hit_rate": hits / (hits + misses) if hits + misses else None,
                            "decode_hit_rate": dh / (dh + dm) if dh + dm else None,
                            "fetched": int(d["expert_cache_fetched"]), "bytes_h2d": int(d["expert_cache_bytes_h2d"]),
                            "prefill_bytes_h2d": int(d["prefill_bytes_h2d"]),
                            "decode_bytes_h2d": int(d["decode_bytes_h2d"])},
           "h2d_bytes_per_token": d["expert_cache_bytes_h2d"] / tokens if tokens else None,
           "compile_s": d["compile_s"]}
    kv = {k[3:]: int(v) for k, v in d.items() if k.startswith("kv_")}
    if kv:
        out["kv"] = kv
    return out


def request_figures(stats: list, wall_s: float) -> dict:
    """Tokens, throughput and latency spreads of finished requests' ``RequestStats``."""
    tokens = sum(s.completion_tokens for s in stats)
    return {"tokens": int(tokens), "prompt_tokens": int(sum(s.prompt_tokens for s in stats)),
            "cached_tokens": int(sum(s.cached_tokens for s in stats)), "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            "requests_per_s": len(stats) / wall_s if wall_s > 0 else None,
            "ttft_s": common.spread([s.ttft_s for s in stats if s.ttft_s is not None]),
            "tpot_s": common.spread([float(np.mean(s.tpot_s)) for s in stats if s.tpot_s]),
            "itl_s": common.spread([x for s in stats for x in s.tpot_s]),
            "queued_s": common.spread([s.queued_s for s in stats])}


class Finished:
    """Final events of a run: reasons counted, errors kept, stats per request id."""

    def __init__(self, sched):
        self.sched, self.reasons, self.errors, self.stats = sched, collections.Counter(), [], {}

    def add(self, ev) -> None:
        self.reasons[ev.finish_reason] += 1
        if ev.error:
            self.errors.append(f"{ev.request_id}: {ev.error}"[:500])
        self.stats[ev.request_id] = self.sched.stats(ev.request_id)

    def as_dict(self) -> dict:
        return {"finished": sum(self.reasons.values()), "finish_reasons": dict(self.reasons), "errors": self.errors[:5]}


def step(sched) -> list:
    """One ``Scheduler.step``; a scheduler with nothing to do while requests are outstanding is a bug here."""
    if not sched.has_work():
        raise RuntimeError("the scheduler has no work but requests are outstanding")
    return sched.step()


# ---- part 1: throughput under concurrency ---------------------------------------------------------
def run_level(sched, prompts: list, level: int, max_tokens: int, rate: float, rng) -> dict:
    """``prompts`` through ``sched``: closed loop with ``level`` in flight, or Poisson arrivals at ``rate``/s."""
    from ftjax.serve import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    n = len(prompts)
    done = Finished(sched)
    lag = []
    submitted = 0

    def submit():
        nonlocal submitted
        sched.submit(prompts[submitted], params, request_id=f"r{submitted}")
        submitted += 1

    before = snapshot(sched)
    t0 = time.perf_counter()
    arrivals = t0 + np.cumsum(rng.exponential(1.0 / rate, n)) if rate else None
    if not rate:
        for _ in range(min(level, n)):
            submit()
    while sum(done.reasons.values()) < n:
        if rate:
            now = time.perf_counter()
            while submitted < n and arrivals[submitted] <= now:
                lag.append(now - arrivals[submitted])
                submit()
            if not sched.has_work():
                if submitted >= n:
                    raise RuntimeError("the scheduler has no work but requests are outstanding")
                time.sleep(max(0.0, arrivals[submitted] - time.perf_counter()))
                continue
        for ev in step(sched):
            if ev.finished:
                done.add(ev)
                if not rate and submitted < n:
                    submit()
    wall = time.perf_counter() - t0
    stats = list(done.stats.values())
    out = {"concurrency": level, "requests": n, **done.as_dict(), **request_figures(stats, wall),
           **engine_figures(before, snapshot(sched), sum(s.completion_tokens for s in stats))}
    if rate:
        out["rate"] = rate
        out["submit_lag_s"] = common.spread(lag)
    return out


def speedups(levels: list) -> None:
    """Sets each level's ``speedup_vs_c1``: its tokens/s over concurrency 1's at the same ``decode_block`` (None
    before that level ran)."""
    for x in levels:
        base = next((y for y in levels if y["concurrency"] == 1 and y.get("decode_block") == x.get("decode_block")
                     and y.get("tokens_per_s")), None)
        x["speedup_vs_c1"] = x["tokens_per_s"] / base["tokens_per_s"] if base and x.get("tokens_per_s") else None


def part_concurrency(model, mode: str, progress) -> dict:
    cfg = model.cfg
    levels = [int(x) for x in FLAGS.concurrency]
    n, p, m = FLAGS.requests, FLAGS.prompt_tokens, FLAGS.max_tokens
    engine, plan = build_engine(model, mode, seq_len(p + m, cfg), max(levels), p)
    rng = np.random.default_rng([FLAGS.seed, 1])
    row = {"mode": mode, "engine": engine.describe(), "slots": engine.num_slots,
           "memory_plan": plan.as_dict() if plan else None, "levels": []}
    blocks = [int(x) for x in FLAGS.decode_blocks] or [FLAGS.decode_block]
    for block in blocks:
        for level in levels:
            sched = scheduler(engine, level, waiting=n, decode_block=block)
            t = time.perf_counter()
            if FLAGS.warmup:  # one wave of the level's shapes (admission compiles the mixed calls too)
                run_level(sched, [rng.integers(0, cfg.vocab_size, p).tolist() for _ in range(level)], level,
                          min(2, m), 0.0, rng)
            warm = time.perf_counter() - t
            prompts = [rng.integers(0, cfg.vocab_size, p).tolist() for _ in range(n)]
            res = dict(run_level(sched, prompts, level, m, FLAGS.rate, rng), warmup_s=warm, decode_block=block)
            row["levels"].append(res)
            speedups(row["levels"])
            print(f"[{mode}] decode block {block}, concurrency {level}: {res['tokens_per_s']:.2f} tok/s "
                  f"({res['requests_per_s']:.3f} req/s), TTFT {res['ttft_s'].get('median', float('nan')):.4f} s, TPOT "
                  f"{res['tpot_s'].get('median', float('nan')):.4f} s, hit rate {res['expert_cache']['hit_rate']}, "
                  f"x{res['speedup_vs_c1'] or float('nan'):.2f} of c1", flush=True)
            del sched
            progress(row)
    at4 = {x["decode_block"]: x["speedup_vs_c1"] for x in row["levels"] if x["concurrency"] == 4}
    row["speedup_at_4"] = at4.get(blocks[-1])  # the last decode block's (--decode_blocks=1,16: with blocks)
    row["speedup_at_4_by_decode_block"] = {str(k): v for k, v in at4.items()}
    finish(row, engine)
    del engine
    gc.collect()
    return row


# ---- part 2: multi-round QA with and without KV reuse -----------------------------------------------
def run_multiround(sched, contexts: list, questions: list) -> dict:
    """Every user's rounds through ``sched`` (users concurrent, a user's rounds in turn)."""
    from ftjax.serve import SamplingParams
    params = SamplingParams(max_tokens=FLAGS.answer_tokens, temperature=0.0, seed=0)
    users, rounds = len(contexts), len(questions[0])
    history = [list(c) for c in contexts]
    next_round = [0] * users
    answers: dict[str, list] = {}
    done = Finished(sched)
    per = [[None] * rounds for _ in range(users)]

    def submit(u):
        r = next_round[u]
        history[u] = history[u] + list(questions[u][r])
        rid = f"u{u}r{r}"
        answers[rid] = []
        sched.submit(history[u], params, request_id=rid)

    before = snapshot(sched)
    t0 = time.perf_counter()
    for u in range(users):
        submit(u)
    while sum(done.reasons.values()) < users * rounds:
        for ev in step(sched):
            if ev.token_id is not None:
                answers[ev.request_id].append(ev.token_id)
            if not ev.finished:
                continue
            done.add(ev)
            u, r = (int(x) for x in ev.request_id[1:].split("r"))
            s = done.stats[ev.request_id]
            per[u][r] = {"ttft_s": s.ttft_s, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                         "completion_tokens": s.completion_tokens, "finish_reason": ev.finish_reason}
            history[u] = history[u] + answers.pop(ev.request_id)
            next_round[u] += 1
            if next_round[u] < rounds:
                submit(u)
    wall = time.perf_counter() - t0
    stats = list(done.stats.values())
    by_round = []
    for r in range(rounds):
        xs = [per[u][r] for u in range(users) if per[u][r] is not None]
        by_round.append({"round": r + 1, "prompt_tokens": [x["prompt_tokens"] for x in xs],
                         "ttft_s": common.spread([x["ttft_s"] for x in xs if x["ttft_s"] is not None]),
                         "cached_tokens": [x["cached_tokens"] for x in xs]})
    return {**done.as_dict(), **request_figures(stats, wall), "rounds": by_round,
            "ttft_s_by_user": [[x["ttft_s"] if x else None for x in row] for row in per],
            **engine_figures(before, snapshot(sched), sum(s.completion_tokens for s in stats))}


def multiround_inputs(rng, cfg) -> tuple[list, list]:
    users, q = FLAGS.users, FLAGS.question_tokens
    contexts = [rng.integers(0, cfg.vocab_size, FLAGS.context_tokens).tolist() for _ in range(users)]
    questions = [[rng.integers(0, cfg.vocab_size, q).tolist() for _ in range(FLAGS.rounds)] for _ in range(users)]
    return contexts, questions


def part_multiround(model, mode: str, progress) -> dict:
    cfg = model.cfg
    users = FLAGS.users
    total = FLAGS.context_tokens + FLAGS.rounds * (FLAGS.question_tokens + FLAGS.answer_tokens)
    engine, plan = build_engine(model, mode, seq_len(total, cfg), users, FLAGS.context_tokens)
    row = {"mode": mode, "engine": engine.describe(), "slots": engine.num_slots,
           "memory_plan": plan.as_dict() if plan else None, "runs": {}}
    probe = prefix_cache()
    last_prompt = total - FLAGS.answer_tokens  # the last round's prompt
    row["kv_store_capacity"] = int(probe.metrics()["capacity_bytes"])
    row["kv_store_bytes_needed"] = users * (last_prompt // probe.chunk_tokens) * probe.entry_bytes(engine)
    row["kv_chunk_bytes"] = probe.entry_bytes(engine)
    del probe
    for name, reuse in (("no_reuse", False), ("reuse", True)):
        t = time.perf_counter()
        if FLAGS.warmup:  # the same workload on other contexts, with a store of its own
            sched = scheduler(engine, users, prefix_cache() if reuse else None)
            run_multiround(sched, *multiround_inputs(np.random.default_rng([FLAGS.seed, 2, 1]), cfg))
            del sched
            gc.collect()
        warm = time.perf_counter() - t
        sched = scheduler(engine, users, prefix_cache() if reuse else None)
        res = dict(run_multiround(sched, *multiround_inputs(np.random.default_rng([FLAGS.seed, 2, 0]), cfg)),
                   kv_reuse=reuse, warmup_s=warm)
        del sched
        gc.collect()
        row["runs"][name] = res
        print(f"[{mode}] multi-round {name}: TTFT by round "
              + ", ".join(f"{x['ttft_s'].get('median', float('nan')):.4f}" for x in res["rounds"])
              + f" s; chunks hit {res.get('kv', {}).get('chunks_hit', 0)}", flush=True)
        progress(row)
    runs = row["runs"]
    med = {k: [x["ttft_s"].get("median") for x in v["rounds"]] for k, v in runs.items()}
    row["ttft_s_by_round"] = med
    row["speedup_by_round"] = [a / b if a and b else None for a, b in zip(med["no_reuse"], med["reuse"])]
    later = {k: [t for user in v["ttft_s_by_user"] for t in user[1:] if t is not None] for k, v in runs.items()}
    row["speedup_after_first_round"] = (float(np.median(later["no_reuse"]) / np.median(later["reuse"]))
                                        if later["no_reuse"] and later["reuse"] else None)
    finish(row, engine)
    del engine
    gc.collect()
    return row


# ---- part 3: the HTTP server's overhead per token ---------------------------------------------------
class IdText:
    """Token ids as text, ``<id>`` each: what the server streams for a model without a tokenizer (every token
    then has text, so that every token is one chunk)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def encode(self, text: str):
        raise ValueError("token-id prompts only")


def direct_requests(sched, prompt: list, n: int) -> list:
    """``n`` batch-1 requests of ``prompt`` through ``sched.step()`` in a loop; their ``RequestStats``."""
    from ftjax.serve import SamplingParams
    params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0, seed=0)
    out = []
    for i in range(n):
        rid = sched.submit(prompt, params, request_id=f"direct{i}")
        done = Finished(sched)
        while not done.reasons:
            for ev in step(sched):
                if ev.finished:
                    done.add(ev)
        if done.errors:
            raise RuntimeError(done.errors[0])
        out.append(done.stats[rid])
    return out


#: The HTTP client, run in a process of its own (``python -c``): argv url, body (JSON), requests; prints one JSON
#: list, per request its start and the arrival of each chunk that carries text (time.monotonic_ns: CLOCK_MONOTONIC,
#: one clock for every process on Linux, unlike time.perf_counter whose epoch is not specified), and the usage.
HTTP_CLIENT = r"""
import json, sys, time
import httpx
url, body, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
out = []
with httpx.Client(timeout=600) as client:
    for _ in range(n):
        times, usage = [], None
        t0 = time.monotonic_ns()
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                sys.exit(f"HTTP {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic_ns()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sys.exit(f"the request failed: {chunk['error']}")
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        out.append({"t0": t0 / 1e9, "times": [t / 1e9 for t in times],
                    "completion_tokens": (usage or {}).get("completion_tokens", len(times))})
print(json.dumps(out))
"""


def http_client(url: str, prompt: list, n: int) -> list:
    """``n`` streamed completions of ``prompt``, one after the other, from a client process of its own (so that
    its parsing does not compete with the server's threads for this process's GIL); per request ``t0`` (its
    start), ``times`` (the arrival of each chunk that carries text; seconds of CLOCK_MONOTONIC) and
    ``completion_tokens`` (the usage's).
    Raises:
      RuntimeError: the client failed (an HTTP error, an error event)."""
    import subprocess
    body = {"prompt": prompt, "max_tokens": FLAGS.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = subprocess.run([sys.executable, "-c", HTTP_CLIENT, url, json.dumps(body), str(n)], capture_output=True,
                       text=True, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"the HTTP client failed: {(r.stderr or r.stdout).strip()[-2000:]}")
    return json.loads(r.stdout)


def http_requests(sched, model, prompt: list, n: int) -> list:
    """``n`` streamed requests of ``prompt`` through the HTTP server over ``sched`` (uvicorn in a thread, the client
    in a process of its own: :func:`http_client`)."""
    import uvicorn

    from ftjax.serve.server import create_app
    app = create_app(sched, model.tokenizer or IdText(), "bench", max_context=sched.engine.max_seq_len,
                     vocab_size=model.cfg.vocab_size)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        return http_client(url, prompt, n)
    finally:
        server.should_exit = True
        thread.join(60)


def part_server_overhead(model, mode: str, progress) -> dict:
    cfg = model.cfg
    p, m, n = FLAGS.prompt_tokens, FLAGS.max_tokens, FLAGS.server_requests
    engine, plan = build_engine(model, mode, seq_len(p + m, cfg), 1, p)
    prompt = np.random.default_rng([FLAGS.seed, 3]).integers(0, cfg.vocab_size, p).tolist()
    sched = scheduler(engine, 1)
    warm = int(FLAGS.warmup)
    before = snapshot(sched)
    direct = direct_requests(sched, prompt, warm + n)[warm:]
    dfig = engine_figures(before, snapshot(sched), 0)
    row = {"mode": mode, "engine": engine.describe(), "slots": engine.num_slots,
           "memory_plan": plan.as_dict() if plan else None, "prompt_tokens": p, "max_tokens": m,
           "tokenizer": "the model's" if model.tokenizer is not None else "ids as text (<id>)",
           "direct": {"ttft_s": common.spread([s.ttft_s for s in direct]),
                      "tpot_s": common.spread([float(np.mean(s.tpot_s)) for s in direct if s.tpot_s]),
                      "itl_s": common.spread([x for s in direct for x in s.tpot_s]),
                      "tokens": [s.completion_tokens for s in direct], "compile_s": dfig["compile_s"]}}
    progress(row)
    before = snapshot(sched)
    http = http_requests(sched, model, prompt, warm + n)[warm:]
    hfig = engine_figures(before, snapshot(sched), 0)
    tpot = [(r["times"][-1] - r["times"][0]) / (r["completion_tokens"] - 1) for r in http
            if len(r["times"]) > 1 and r["completion_tokens"] > 1]
    row["http"] = {"ttft_s": common.spread([r["times"][0] - r["t0"] for r in http if r["times"]]),
                   "tpot_s": common.spread(tpot),
                   "itl_s": common.spread([x for r in http for x in np.diff(r["times"])]),
                   "tokens": [r["completion_tokens"] for r in http], "chunks": [len(r["times"]) for r in http],
                   "compile_s": hfig["compile_s"]}
    d, h = row["direct"], row["http"]
    row["tpot_ratio"] = h["tpot_s"]["median"] / d["tpot_s"]["median"] if d["tpot_s"] and h["tpot_s"] else None
    row["tpot_ratio_median_gap"] = (h["itl_s"]["median"] / d["itl_s"]["median"]
                                    if d["itl_s"] and h["itl_s"] else None)
    finish(row, engine)
    print(f"[{mode}] batch-1 TPOT: direct {d['tpot_s'].get('median', float('nan')) * 1e3:.3f} ms, HTTP "
          f"{h['tpot_s'].get('median', float('nan')) * 1e3:.3f} ms: ratio {row['tpot_ratio']}", flush=True)
    del sched, engine
    gc.collect()
    return row


# ---- the JSON -------------------------------------------------------------------------------------------
def flat_rows(parts: dict) -> list[dict]:
    """One row per level, round and path (``experiments/plots.py``)."""
    rows = []
    for mode, r in (parts.get("concurrency") or {}).get("modes", {}).items():
        for x in r.get("levels", []):
            rows.append({"part": "concurrency", "mode": mode, "case": f"concurrency {x['concurrency']}",
                         "variant": f"decode_block {x.get('decode_block', 1)}",
                         "tokens_per_s": x.get("tokens_per_s"), "ttft_s": x.get("ttft_s"), "tpot_s": x.get("tpot_s"),
                         "hit_rate": x["expert_cache"]["hit_rate"], "speedup_vs_c1": x.get("speedup_vs_c1")})
    for mode, r in (parts.get("multiround") or {}).get("modes", {}).items():
        for name, run in (r.get("runs") or {}).items():
            for x in run["rounds"]:
                rows.append({"part": "multiround", "mode": mode, "variant": name, "case": f"round {x['round']}",
                             "ttft_s": x["ttft_s"]})
    for mode, r in (parts.get("server_overhead") or {}).get("modes", {}).items():
        for path in ("direct", "http"):
            if path in r:
                rows.append({"part": "server_overhead", "mode": mode, "variant": path, "tpot_s": r[path]["tpot_s"],
                             "ttft_s": r[path]["ttft_s"]})
    return rows


def main(argv):
    from absl import app
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from ftjax.experts.cpu_experts import CALLBACK_IMPLS, use_sync_cpu_dispatch
    if FLAGS.miss_policy != "fetch" and FLAGS.cpu_expert_impl in CALLBACK_IMPLS:
        use_sync_cpu_dispatch()  # before JAX starts; the callbacks deadlock on an async CPU client
    if FLAGS.checkpoint and not FLAGS["preset"].present:
        FLAGS.preset = None  # the default preset gives way to a checkpoint
    parts = [p for p in PARTS if p in FLAGS.part or "all" in FLAGS.part]
    try:
        engine_flags.check_flags()
        model = engine_flags.load_model(None, program="bench_serve")
    except (engine_flags.UserError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    if model.eos_token_ids:  # every request makes its max_tokens
        model = dataclasses.replace(model, eos_token_ids=())
    info = common.meta()
    label = FLAGS.preset or os.path.basename(os.path.normpath(str(FLAGS.checkpoint)))
    path = FLAGS.out or os.path.join(FLAGS.out_dir, f"bench_serve_{label}_{info['date'][:10]}.json")
    out_dir, name = os.path.dirname(path) or ".", os.path.basename(path)
    t0 = time.perf_counter()
    results: dict = {}

    def write(partial: str | None = None):
        payload = {"meta": info, "script": "experiments/bench_serve.py", "model": str(model.name),
                   "model_type": model.cfg.model_type, "parts_run": parts, "targets": TARGETS, "parts": results,
                   "results": flat_rows(results), "elapsed_s": time.perf_counter() - t0}
        if partial:
            payload["partial"] = partial
        return common.write_json(out_dir, name, payload)

    fns = {"concurrency": part_concurrency, "multiround": part_multiround, "server_overhead": part_server_overhead}
    settings = {"concurrency": {"loop": "poisson" if FLAGS.rate else "closed", "rate": FLAGS.rate or None,
                                "levels": [int(x) for x in FLAGS.concurrency], "requests": FLAGS.requests,
                                "prompt_tokens": FLAGS.prompt_tokens, "max_tokens": FLAGS.max_tokens,
                                "decode_blocks": [int(x) for x in FLAGS.decode_blocks] or [FLAGS.decode_block]},
                "multiround": {"users": FLAGS.users, "context_tokens": FLAGS.context_tokens, "rounds": FLAGS.rounds,
                               "question_tokens": FLAGS.question_tokens, "answer_tokens": FLAGS.answer_tokens},
                "server_overhead": {"prompt_tokens": FLAGS.prompt_tokens, "max_tokens": FLAGS.max_tokens,
                                    "requests": FLAGS.server_requests}}
    modes = sorted(FLAGS.modes, key=lambda m: m == "resident")  # resident needs the pool: offloading first
    for part in parts:
        results[part] = {**settings[part], "modes": {}}
        for mode in modes:
            def progress(row, part=part, mode=mode):
                results[part]["modes"][mode] = dict(row, partial="the run had not finished")
                write(f"{part} ({mode}) had not finished")
            try:
                results[part]["modes"][mode] = fns[part](model, mode, progress)
            except Exception as e:  # noqa: BLE001 - one failing run must not lose the others
                row = results[part]["modes"].get(mode) or {"mode": mode}
                results[part]["modes"][mode] = dict(row, error=f"{type(e).__name__}: {e}"[:3000])
                print(f"[{mode}] {part} failed: {results[part]['modes'][mode]['error']}", flush=True)
            gc.collect()
            write("the run had not ended")
    print("wrote", write())
    print(common.table([dict(r, ttft_ms=(r.get("ttft_s") or {}).get("median", 0) * 1e3,
                             tpot_ms=(r.get("tpot_s") or {}).get("median", 0) * 1e3) for r in flat_rows(results)],
                       ["part", "mode", "variant", "case", "tokens_per_s", "speedup_vs_c1", "hit_rate", "ttft_ms",
                        "tpot_ms"]))


if __name__ == "__main__":
    common.run(main)
