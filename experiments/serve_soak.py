r"""Soak test of the HTTP server: many requests against one server process, its memory watched throughout.

  PYTHONPATH=. python3 experiments/serve_soak.py --out_dir=$OUT                         # the demo model, 1,000 requests
  .venv/bin/python experiments/serve_soak.py --checkpoint=tests/fixtures/qwen3_moe_fp32 --requests=1000 \
      --max_seq_len=64 --max_tokens=4 --out_dir=experiments/results/serve                        # CPU, about a minute

The server (``ftjax.serve.server.create_app`` over the scheduler, uvicorn in a thread of this process) is built
from ``ftjax.serve``'s flags (the model, expert-cache, quantization and KV flags of ``ftjax.engine_flags``,
``--max_batch``, ``--max_waiting``). ``--concurrency`` client threads then send ``--requests`` completions
(prompts of random token ids, 1 to ``--max_tokens`` new tokens, greedy) through one ``httpx.Client``: most
plain, every ``--stream_every``-th streamed, every ``--disconnect_every``-th streamed and dropped after its
first chunk (the server cancels it), every ``--invalid_every``-th malformed (a 400).

Every ``--sample_every`` requests (and before the first, after a warm-up) it records the process's resident
memory (``VmRSS``), Python's allocated blocks, the number of live objects of the server's per-request types
(``_Job``, ``_Route``, ``Item``, ``asyncio.Queue``) and of all gc-tracked objects, the server's tracked
requests and the scheduler's running / waiting counts. The JSON (``write_json``) holds these ``samples``,
the status counts, latency spreads (seconds) by kind, ``growth``: the last sample less the first (after the
warm-up), and ``steady_growth_per_request``: the slope from the end of the first interval on (programs first
met in the first interval are compiled by then), where a leak shows. The run fails (exit 1) when requests are
still tracked at the end or a request got an unexpected status.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import os
import sys
import threading
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import common  # noqa: E402
from ftjax import engine_flags  # noqa: E402

FLAGS = flags.FLAGS
engine_flags.define_flags()
flags.DEFINE_integer("requests", 1000, "Requests to send.", lower_bound=1)
flags.DEFINE_integer("concurrency", 8, "Client threads sending at once.", lower_bound=1)
flags.DEFINE_integer("max_batch", 4, "The engine's batch rows (ftjax.serve --max_batch).", lower_bound=1)
flags.DEFINE_integer("max_waiting", 64, "Requests that may wait for a row (ftjax.serve --max_waiting).", lower_bound=1)
flags.DEFINE_integer("max_seq_len", 128, "Tokens per row (prompt + generation).", lower_bound=8)
flags.DEFINE_integer("prompt_tokens", 24, "Prompts have 1 to this many random token ids.", lower_bound=1)
flags.DEFINE_integer("max_tokens", 4, "Requests ask for 1 to this many new tokens.", lower_bound=1)
flags.DEFINE_integer("stream_every", 5, "Every n-th request is streamed (0: none).", lower_bound=0)
flags.DEFINE_integer("disconnect_every", 25, "Every n-th request is streamed and dropped after its first chunk "
                     "(0: none).", lower_bound=0)
flags.DEFINE_integer("invalid_every", 50, "Every n-th request is malformed (0: none).", lower_bound=0)
flags.DEFINE_integer("sample_every", 100, "Requests between two memory samples.", lower_bound=1)
flags.DEFINE_string("out_dir", "experiments/results/serve", "Where the JSON goes.")
flags.DEFINE_string("name", None, "Result file name (default serve_soak_<model>_<requests>req_<device>_<date>.json).")
flags.DEFINE_string("note", None, "A line kept in the JSON (what the run had on top of its commit, say).")

#: Per-request types whose live instances are counted: the server's, and the scheduler's records (it keeps
#: the RequestStats of its most recent finished requests, a bounded number).
PER_REQUEST_TYPES = ("_Job", "_Route", "Item", "TokenEvent", "RequestStats")



def _display_name(path: str) -> str:
    """A checkpoint path as results record it: relative to the repository when inside it (the demo
    model: ftjax/assets/...), else its last component, so that no machine's paths are written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else os.path.basename(os.path.normpath(path))

def _rss_mb() -> float | None:
    """This process's resident memory in MB (1e6 bytes), from /proc (None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        return None
    return None


def _sample(done: int, server, scheduler) -> dict:
    gc.collect()
    objs = gc.get_objects()
    counts = collections.Counter(type(o).__name__ for o in objs)
    return {"requests_done": done, "rss_mb": _rss_mb(), "allocated_blocks": sys.getallocatedblocks(),
            "gc_objects": len(objs), **{f"live_{t}": counts.get(t, 0) for t in PER_REQUEST_TYPES},
            "live_asyncio_Queue": sum(1 for o in objs if isinstance(o, asyncio.Queue)),
            "tracked": server.worker.tracked, "running": scheduler.running, "waiting": scheduler.waiting}


def _kind(i: int) -> str:
    n = i + 1
    if FLAGS.invalid_every and n % FLAGS.invalid_every == 0:
        return "invalid"
    if FLAGS.disconnect_every and n % FLAGS.disconnect_every == 0:
        return "disconnect"
    if FLAGS.stream_every and n % FLAGS.stream_every == 0:
        return "stream"
    return "plain"


def _one(http, url: str, i: int, vocab: int) -> tuple[str, int, float]:
    """Sends request ``i``; returns (kind, HTTP status, seconds)."""
    import numpy as np
    rng = np.random.default_rng(i)
    kind = _kind(i)
    prompt = rng.integers(3, vocab, int(rng.integers(1, FLAGS.prompt_tokens + 1))).tolist()
    body = {"prompt": prompt, "max_tokens": int(rng.integers(1, FLAGS.max_tokens + 1)), "temperature": 0}
    if kind == "invalid":
        body["max_tokens"] = "many"
    t0 = time.perf_counter()
    if kind in ("stream", "disconnect"):
        body["stream"] = True
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if kind == "disconnect" and line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
            status = r.status_code
    else:
        status = http.post(f"{url}/v1/completions", json=body).status_code
    return kind, status, time.perf_counter() - t0


def run() -> dict:
    import logging

    import httpx
    import uvicorn
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request

    from ftjax.serve.scheduler import Scheduler
    from ftjax.serve.server import create_app
    engine_flags.check_flags()
    model = engine_flags.load_model()
    cfg = model.cfg
    if FLAGS.max_seq_len > cfg.max_position_embeddings or FLAGS.prompt_tokens + FLAGS.max_tokens > FLAGS.max_seq_len:
        raise ValueError(f"need --prompt_tokens + --max_tokens <= --max_seq_len <= {cfg.max_position_embeddings}")
    probe = [[0] * min(FLAGS.max_seq_len - 1, FLAGS.prefill_chunk)] * FLAGS.max_batch
    engine, plan = engine_flags.build_engine(model, FLAGS.max_seq_len, probe, FLAGS.max_batch)
    scheduler = Scheduler(engine, max_batch=FLAGS.max_batch, max_waiting=FLAGS.max_waiting,
                          kv_manager=engine_flags.kv_manager(),
                          detokenize=model.tokenizer.decode if model.tokenizer is not None else None)
    name = os.path.basename(os.path.normpath(str(model.name)))
    app = create_app(scheduler, model.tokenizer, name, max_context=FLAGS.max_seq_len, vocab_size=cfg.vocab_size)
    server = app.state.server
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    statuses, latency = collections.Counter(), collections.defaultdict(list)
    expected = {"plain": 200, "stream": 200, "disconnect": 200, "invalid": 400}
    unexpected = []
    try:
        with httpx.Client(timeout=600) as http, concurrent.futures.ThreadPoolExecutor(FLAGS.concurrency) as pool:
            t_warm = time.perf_counter()  # compiles the programs of every prompt bucket the run can meet
            list(pool.map(lambda i: _one(http, url, 10**6 + i, cfg.vocab_size), range(2 * FLAGS.concurrency)))
            warmup_s = time.perf_counter() - t_warm
            samples = [_sample(0, server, scheduler)]
            t0 = time.perf_counter()
            for start in range(0, FLAGS.requests, FLAGS.sample_every):
                batch = range(start, min(start + FLAGS.sample_every, FLAGS.requests))
                for kind, status, secs in pool.map(lambda i: _one(http, url, i, cfg.vocab_size), batch):
                    statuses[f"{kind}:{status}"] += 1
                    latency[kind].append(secs)
                    if status != expected[kind]:
                        unexpected.append((kind, status))
                deadline = time.monotonic() + 30  # cancelled streams end in the server thread
                while server.worker.tracked and time.monotonic() < deadline:
                    time.sleep(0.01)
                samples.append(_sample(batch[-1] + 1, server, scheduler))
            wall_s = time.perf_counter() - t0
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        uv.should_exit = True
        thread.join(30)
    first, last = samples[0], samples[-1]
    growth = {k: (last[k] - first[k]) if isinstance(last[k], (int, float)) and first[k] is not None else None
              for k in first if k != "requests_done"}
    per_request = {k: v / FLAGS.requests for k, v in growth.items() if v is not None}
    # from the end of the first interval on (programs first met in it compiled by then)
    steady = {k: (last[k] - samples[1][k]) / max(1, last["requests_done"] - samples[1]["requests_done"])
              for k in first if k != "requests_done" and isinstance(last[k], (int, float))
              and samples[1][k] is not None} if len(samples) > 2 else {}
    meta = common.meta()
    out = {"model": _display_name(str(model.name)), "engine": engine.describe(),
           "memory_plan": plan.as_dict() if plan else None,
           "scheduler": {"module": type(scheduler).__module__, "max_batch": FLAGS.max_batch,
                         "max_waiting": FLAGS.max_waiting},
           "requests": FLAGS.requests, "warmup_s": warmup_s, "wall_s": wall_s,
           "requests_per_s": FLAGS.requests / wall_s, "statuses": dict(statuses),
           "unexpected_statuses": unexpected[:20],
           "latency_s": {k: common.spread(v) for k, v in latency.items()}, "samples": samples,
           "growth": growth, "growth_per_request": per_request, "steady_growth_per_request": steady,
           "metrics": {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                       if ln and not ln.startswith("#") and "_bucket" not in ln},
           "note": FLAGS.note, "meta": meta}
    device = str(meta["device"]).lower().replace(" ", "-")
    fname = FLAGS.name or f"serve_soak_{name}_{FLAGS.requests}req_{device}_{meta['date'][:10]}.json"
    path = common.write_json(FLAGS.out_dir, fname, out)
    print(common.table(samples, ["requests_done", "rss_mb", "allocated_blocks", "gc_objects", "live__Job",
                                 "live_asyncio_Queue", "tracked", "running", "waiting"]))
    print(f"{FLAGS.requests} requests in {wall_s:.1f} s ({FLAGS.requests / wall_s:.1f}/s); statuses "
          f"{dict(statuses)}; RSS {growth['rss_mb']:+.1f} MB, gc objects {growth['gc_objects']:+d} after the "
          f"warm-up; tracked at the end: {last['tracked']}")
    print(f"wrote {path}")
    if last["tracked"] or last["running"] or last["waiting"] or unexpected:
        raise RuntimeError(f"requests left tracked ({last['tracked']}), running ({last['running']}) or waiting "
                           f"({last['waiting']}), or unexpected statuses {unexpected[:5]}")
    return out


def main(argv):
    from absl import app
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        run()
    except (engine_flags.UserError, ValueError, RuntimeError) as e:
        raise app.UsageError(str(e)) from None


if __name__ == "__main__":
    common.run(main)
