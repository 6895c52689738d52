r"""The HTTP server's own cost per streamed token, without a model (issue 31).

  PYTHONPATH=. python3 experiments/profile_server.py --micro --tokens=64 --tokenizer=fixture  # Python work/token
  PYTHONPATH=. python3 experiments/profile_server.py --step_ms=8 --dispatch_ms=0.5         # the server end to end
  PYTHONPATH=. python3 experiments/profile_server.py --profile=loop  # + cProfile (every thread, on Python 3.12)

``ftjax.serve.server.create_app`` serves a stand-in scheduler (:class:`FakeScheduler`: one token per step of
every running request, no engine) under uvicorn in a thread of this process. A step stands for a device step:
``--dispatch_ms`` of Python work holding the GIL (the dispatch of the next step), released ``--releases`` times
in between (as jax releases it in each jitted call's enqueue and in each host-to-device copy), then
``--step_ms`` of sleep, the GIL released (the device computing): the next step's dispatch waits for this one, as
with ``Scheduler(run_ahead=False)``. ``--run_ahead``: as with ``Scheduler(run_ahead=True)``, a step is dispatched
(queued behind the last on the device) before the last one's token is read, so that a late dispatch costs the
device nothing until it is later than a step. The client is another process (``python -c``, httpx), so that
its parsing does not compete with the server for this process's GIL or CPU time. Each request streams
``/v1/completions`` of ``--tokens`` tokens (ids as text, ``<id>`` each, so that every token is one chunk;
``--tokenizer=fixture``: the tiny test fixture's byte-level tokenizer).

Figures, the median over ``--requests`` requests (after one warm-up): ``direct_us_per_token``: the stand-in's
time per step driven alone, in a loop (what ``bench_serve.py``'s direct path measures); ``http_us_per_token``:
the client's time from the first text chunk to the last, per gap; ``ratio``: the two's quotient (the server's
added time per token, as ``bench_serve.py --part=server_overhead``'s ``tpot_ratio``); ``cpu_us_per_token``: this
process's CPU time (user + system, every thread: scheduler thread, event loop, socket writes) per step between
the first token and the last, the stand-in's own dispatch work and sleep included.

``--micro``: no server, no socket: the Python work per token of each side, in microseconds, timed in one
thread: ``handler``: a streamed completion's handler from its queue to the bytes sse-starlette sends
(``follow``: detokenization, stop strings; the chunk's JSON; sse-starlette's encoding of what the handler
yields); ``worker``: the scheduler thread's handling of one step's event (its ``Item``, the metrics, the
hand-over to the event loop). Each over ``--tokens`` tokens of one request, the median of ``--requests``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftjax.serve.scheduler import RequestStats, TokenEvent  # noqa: E402

#: The client: argv url, body (JSON), requests; prints per request the arrival (time.monotonic_ns) of each chunk
#: that carries text.
CLIENT = r"""
import json, sys, time, httpx
url, body, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
out = []
with httpx.Client(timeout=600) as c:
    for _ in range(n):
        times = []
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.monotonic_ns()
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(now)
        out.append(times)
print(json.dumps(out))
"""


class FakeScheduler:
    """The ``Scheduler`` interface the server uses, without an engine: each step gives every running request
    its next token (ids cycling over [3, 303)); a step: ``dispatch_s`` of Python work in ``releases + 1`` pieces
    (the GIL released between two), then ``step_s`` of sleep (module docstring)."""

    def __init__(self, step_s: float = 0.0, dispatch_s: float = 0.0, releases: int = 0, run_ahead: bool = False):
        self.step_s, self.dispatch_s, self.releases, self.run_ahead = step_s, dispatch_s, releases, run_ahead
        self._device_free = 0.0  # run-ahead: when the device ends the step dispatched last (time.monotonic)
        self._reqs: dict = {}
        self._stats: dict = {}
        self.cpu: list = []  # this process's CPU time (s) at the end of each step
        self.ends: list = []  # time.monotonic() at the end of each step

    running = property(lambda self: len(self._reqs))
    waiting = 0

    def has_work(self):
        return bool(self._reqs)

    def submit(self, prompt_ids, params, request_id=None):
        self._reqs[request_id] = [params.max_tokens, 0, len(prompt_ids)]
        return request_id

    def cancel(self, request_id):
        self._reqs.pop(request_id, None)

    def stats(self, request_id):
        return self._stats.get(request_id)

    def metrics(self):
        return {}

    def step(self):
        for i in range(self.releases + 1):
            if i:
                time.sleep(0)  # the GIL released, as in a jitted call's enqueue
            end = time.perf_counter() + self.dispatch_s / (self.releases + 1)
            while time.perf_counter() < end:  # Python work, the GIL held (but for the interpreter's switches)
                pass
        if self.run_ahead:  # this step queues behind the last; wait for the last one's tokens
            now = time.monotonic()
            reading, self._device_free = self._device_free, max(now, self._device_free) + self.step_s
            if reading > now:
                time.sleep(reading - now)
            elif not reading:  # the first step: nothing dispatched before it
                time.sleep(self.step_s)
                self._device_free = time.monotonic() + self.step_s
        elif self.step_s:
            time.sleep(self.step_s)
        events = []
        for rid, r in list(self._reqs.items()):
            r[1] += 1
            done = r[1] >= r[0]
            events.append(TokenEvent(rid, 3 + r[1] % 300, done, "length" if done else None))
            if done:
                del self._reqs[rid]
                self._stats[rid] = RequestStats(r[2], r[1], 0, 0.0, 0.0, [])
        self.cpu.append(time.process_time())
        self.ends.append(time.monotonic())
        return events


class IdText:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def tokenizer(name: str):
    if name == "ids":
        return IdText()
    from tokenizers import Tokenizer
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return Tokenizer.from_file(os.path.join(root, "tests/fixtures/qwen3_moe_fp32/tokenizer.json"))


def median(xs):
    return sorted(xs)[len(xs) // 2]


def micro(args) -> None:
    """``--micro`` (module docstring)."""
    import asyncio
    import contextlib

    from sse_starlette.event import ensure_bytes

    from ftjax.serve import server as srv
    from ftjax.serve.metrics import ServerMetrics
    from ftjax.serve.scheduler import SamplingParams
    from ftjax.serve.text import TextStream

    n, tok = args.tokens, tokenizer(args.tokenizer)
    ids = [3 + i % 300 for i in range(n)]
    server = srv._Server(FakeScheduler(), tok, "bench", None, 10**9, 10**6, 16)

    async def handler() -> float:
        q = asyncio.Queue()
        for i, t in enumerate(ids):
            q.put_nowait(srv.Item(t, None, i == n - 1, "length" if i == n - 1 else None))
        job = srv._Job("cmpl-" + "0" * 32, q, [1, 2, 3], TextStream(server.decode, ()), False)
        t0 = time.perf_counter()
        async with contextlib.aclosing(server._stream_completion(job, True)) as chunks:
            async for c in chunks:
                ensure_bytes(c, "\n")  # what sse-starlette does with each
        return (time.perf_counter() - t0) / n * 1e6

    def worker() -> float:
        sched = FakeScheduler()
        w = srv.SchedulerWorker(sched, ServerMetrics())
        loop = asyncio.new_event_loop()
        sched.submit([1], SamplingParams(max_tokens=n), "r")
        w._routes["r"] = srv._Route(loop, asyncio.Queue())
        t0 = time.perf_counter()
        for _ in range(n):
            w._step()
        dt = (time.perf_counter() - t0) / n * 1e6
        loop.close()
        return dt

    h = median([asyncio.run(handler()) for _ in range(args.requests)])
    w = median([worker() for _ in range(args.requests)])
    print(json.dumps({"args": vars(args), "handler_us_per_token": h, "worker_us_per_token": w}))


def serve(args) -> None:
    """The server end to end (module docstring)."""
    import uvicorn

    from ftjax.serve.scheduler import SamplingParams
    from ftjax.serve.server import SchedulerWorker, create_app

    def fake():
        return FakeScheduler(args.step_ms / 1e3, args.dispatch_ms / 1e3, args.releases, args.run_ahead)
    alone, direct = fake(), []
    for _ in range(args.requests):  # the stand-in driven alone: the direct path's time per token
        alone.ends.clear()
        alone.submit([1], SamplingParams(max_tokens=args.tokens), "r")
        while alone.has_work():
            alone.step()
        direct.append((alone.ends[-1] - alone.ends[0]) / (len(alone.ends) - 1) * 1e6)
    prof = cProfile.Profile() if args.profile else None
    if args.profile == "scheduler":
        run = SchedulerWorker._run

        def profiled_run(self):
            prof.enable()
            try:
                run(self)
            finally:
                prof.disable()
        SchedulerWorker._run = profiled_run
    sched = fake()
    app = create_app(sched, tokenizer(args.tokenizer), "bench", max_context=10**9, vocab_size=10**6)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))

    def run_server():
        if args.profile == "loop":
            prof.enable()
        server.run()
        if args.profile == "loop":
            prof.disable()
    thread = threading.Thread(target=run_server, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": args.tokens, "temperature": 0, "stream": True})
    cpu = []

    def on_end(original=sched.step):  # each request's steps' CPU times, from its first token to its last
        events = original()
        if any(e.finished for e in events):
            cpu.append((sched.cpu[-1] - sched.cpu[0]) / (len(sched.cpu) - 1) * 1e6)
            sched.cpu.clear()
        return events
    sched.step = on_end
    out = subprocess.run([sys.executable, "-c", CLIENT, url, body, str(args.requests + 1)], capture_output=True,
                         text=True, check=True)
    server.should_exit = True
    thread.join(30)
    http = [(t[-1] - t[0]) / (len(t) - 1) / 1e3 for t in json.loads(out.stdout)[1:]]  # after the warm-up
    d, h = median(direct), median(http)
    print(json.dumps({"args": vars(args), "direct_us_per_token": d, "http_us_per_token": h, "ratio": h / d,
                      "cpu_us_per_token": median(cpu[1:])}))
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(f"---- cProfile of the {args.profile} thread\n" + s.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--step_ms", type=float, default=2.0, help="each step's sleep (the device computing)")
    ap.add_argument("--dispatch_ms", type=float, default=0.0, help="each step's Python work before it sleeps")
    ap.add_argument("--releases", type=int, default=3, help="GIL releases in each step's dispatch work")
    ap.add_argument("--run_ahead", action="store_true", help="a step is dispatched before the last one's tokens are "
                    "read (Scheduler(run_ahead=True))")
    ap.add_argument("--tokenizer", choices=("ids", "fixture"), default="ids")
    ap.add_argument("--micro", action="store_true", help="time the Python work per token without a server")
    ap.add_argument("--profile", choices=("loop", "scheduler"), default=None,
                    help="cProfile from the event loop's thread or the scheduler's (on Python 3.12 it sees every "
                    "thread)")
    args = ap.parse_args()
    micro(args) if args.micro else serve(args)


if __name__ == "__main__":
    main()
