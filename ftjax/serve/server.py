"""The OpenAI-compatible HTTP server: a FastAPI app driving one :class:`~ftjax.serve.scheduler.Scheduler`.

Routes:

* ``POST /v1/completions`` -- ``prompt`` (text, or a list of token ids), ``max_tokens`` (default 16),
  ``temperature``, ``top_p``, ``top_k`` (an extension), ``seed``, ``stop`` (a string or a list),
  ``stop_token_ids`` (an extension), ``logprobs`` (the sampled tokens' log-probabilities only:
  ``top_logprobs`` is null), ``stream``, ``stream_options.include_usage``;
* ``POST /v1/chat/completions`` -- ``messages`` rendered with the checkpoint's chat template
  (:mod:`ftjax.serve.chat`), the same sampling fields, ``max_tokens`` / ``max_completion_tokens``
  (default: the rest of the context), ``logprobs`` (bool; ``top_logprobs`` must be 0);
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text; :mod:`ftjax.serve.metrics`).

Sampling fields left out reach the scheduler as None (its defaults: the checkpoint's
``generation_config.json``). ``stream: true`` answers with server-sent events in OpenAI's chunk format,
ending with ``data: [DONE]``.
Every answer's ``usage`` has ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV was reused). Non-streamed choices also
carry ``token_ids`` (an extension: the generated ids). OpenAI fields that are accepted but only at their
neutral value: ``n`` (1), ``presence_penalty`` / ``frequency_penalty`` (0), ``logit_bias`` (empty),
``echo`` (false), ``best_of`` (1), ``suffix`` (null), ``top_logprobs`` (0); ``user`` is ignored.

Errors are OpenAI's error objects ``{"error": {"message", "type", "param", "code"}}``:
400 for malformed JSON, an unknown or ill-typed field (the message names it), an unsupported value, an
empty prompt, ids outside the vocabulary or a prompt plus ``max_tokens`` beyond the context (checked
before any work); 404 for another model name; 429 when the scheduler's queue is full; 500 for a request
that failed inside the engine (the server goes on serving the others). A client that disconnects
(mid-stream or while waiting for a non-streamed answer) has its request cancelled: its batch row and its
KV pins are freed.

Threading: the scheduler is not thread-safe, so one background thread (:class:`SchedulerWorker`) owns
it. It drains a thread-safe inbox of commands (submit, cancel, metrics snapshot), calls
``Scheduler.step()`` while there is work, and hands a step's token events to their requests'
``asyncio.Queue`` s with one ``loop.call_soon_threadsafe`` per event loop (one wake-up of the loop per step,
not per token); when idle it waits on an event that every new command sets.

Streamed chunks are built as bytes (``data: <json>\n\n``) from pre-encoded fixed fields and handed to
sse-starlette as such; the JSON is byte for byte what ``json.dumps`` of the chunk's dict gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue as queue_lib
import threading
import time
import uuid
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ftjax.serve.chat import ChatTemplate, ChatTemplateError
from ftjax.serve.metrics import ServerMetrics
from ftjax.serve.scheduler import QueueFull, SamplingParams
from ftjax.serve.text import TextStream

log = logging.getLogger("ftjax.serve")

#: Most stop strings a request may give.
MAX_STOP = 16
#: Seconds between two checks that the client of a non-streamed request is still connected.
DISCONNECT_CHECK_S = 0.5


# ---- request bodies ---------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _only(*fields: str, allowed: tuple, message: str):
    """A validator of OpenAI ``fields`` this server takes but does not implement: any value outside
    ``allowed`` is a 400 naming the field, with ``message``."""
    def check(cls, v):
        if v not in allowed:
            raise ValueError(message)
        return v
    return field_validator(*fields)(classmethod(check))


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingBody(_Strict):
    """The fields completions and chat share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    _one_choice = _only("n", allowed=(1,), message="only n=1 is supported")
    _no_penalty = _only("presence_penalty", "frequency_penalty", allowed=(None, 0), message="not supported (only 0)")
    _no_bias = _only("logit_bias", allowed=(None, {}), message="not supported (only empty)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_SamplingBody):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _no_echo = _only("echo", allowed=(False,), message="not supported (only false)")
    _best_of_one = _only("best_of", allowed=(None, 1), message="not supported (only 1)")
    _no_suffix = _only("suffix", allowed=(None,), message="not supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    _no_top = _only("top_logprobs", allowed=(None, 0),
                    message="not supported (only 0: the sampled tokens' log-probabilities come with logprobs=true)")


# ---- errors ---------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answer: HTTP ``status`` with OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(_error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def _error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _check_text(text: str, param: str) -> None:
    """Refuses text the tokenizer cannot take: a lone surrogate (JSON's ``\\ud800``) is not UTF-8.
    Raises:
      APIError: 400 naming ``param`` and the position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: not valid UTF-8 text (a lone surrogate at character {e.start})",
                       param=param) from None


def _field_path(loc) -> list[str]:
    """A validation error's location without ``body`` and pydantic's union-member tags."""
    out = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part.startswith("function-")):
            continue
        out.append(str(part))
    return out


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors of a request body: one line per field, the field named."""
    lines, params = [], []
    for e in errors:
        path = _field_path(e.get("loc", ()))
        name = ".".join(path)
        kind = e.get("type")
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        if kind == "json_invalid":  # its location is a character position, not a field
            line, path = f"malformed JSON: {e.get('ctx', {}).get('error', msg)}", []
        elif kind == "extra_forbidden":
            line = f"unknown field '{name}'"
        elif kind == "missing":
            line = f"missing field '{name}'"
        elif kind == "model_attributes_type" and not path:
            line = "the request body must be a JSON object"
        elif not path:
            line = f"request body: {msg}"
        else:
            line = f"field '{name}': {msg}"
        if path and path[0] in params:  # a union's other members: one message per field
            continue
        params.append(path[0] if path else None)
        lines.append(line)
    return "; ".join(lines[:4]), (params[0] if params else None)


# ---- the scheduler thread ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Item:
    """One token event as a request's handler sees it.

    token_id: the new token (None on a final event without one); logprob: its log-probability (natural
    log) when asked for; finished / finish_reason: "stop", "length", "cancelled" or "error"; error: the
    message of an "error"; stats: the request's ``RequestStats`` (on the final event, when the scheduler
    has them)."""

    token_id: int | None
    logprob: float | None
    finished: bool
    finish_reason: str | None
    error: str | None = None
    stats: Any = None


@dataclasses.dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(items: list) -> None:
    """Puts each (queue, item) of ``items`` (in the event loop's thread)."""
    for q, item in items:
        q.put_nowait(item)


def _resolve(fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class SchedulerWorker:
    """Owns a scheduler and drives it from one background thread (module docstring).

    Args:
      scheduler: the ``Scheduler`` (or anything with its interface).
      metrics: the server's :class:`~ftjax.serve.metrics.ServerMetrics` (finished requests, tokens and the
        running / waiting gauges are recorded here, in the worker thread).
      idle_s: seconds between checks when idle (a command wakes it at once).
    """

    def __init__(self, scheduler, metrics: ServerMetrics, idle_s: float = 0.5):
        self.scheduler, self.metrics, self.idle_s = scheduler, metrics, idle_s
        self._inbox: queue_lib.SimpleQueue = queue_lib.SimpleQueue()
        self._wake = threading.Event()
        self._routes: dict[str, _Route] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.step_failures = 0  # Scheduler.step() calls that raised
        self.running = self.waiting = 0  # the scheduler's figures after the last step

    # ---- from any thread -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def tracked(self) -> int:
        """Requests with a live route to a handler (submitted, not finished or cancelled)."""
        return len(self._routes)

    def start(self) -> None:
        if self.alive:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ftjax-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the thread after its current step; requests still open end with an "error" event."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Cancels a request (no-op once it finished): the scheduler frees its row and its pins."""
        self._post(("cancel", request_id))

    async def call(self, fn: Callable[[Any], Any]):
        """Runs ``fn(scheduler)`` in the worker thread between two steps; returns its result or raises its
        exception.
        Raises:
          RuntimeError: the worker is not running."""
        if not self.alive or self._stopping:
            raise RuntimeError("the scheduler thread is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(("call", fn, loop, fut))
        return await fut

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Submits a request; returns the queue its :class:`Item` s arrive on.
        Raises:
          QueueFull, ValueError: as ``Scheduler.submit``."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def submit(s):
            rid = s.submit(prompt_ids, params, request_id=request_id)
            if rid != request_id:
                raise RuntimeError(f"the scheduler renamed request {request_id} to {rid}")
            self._routes[rid] = _Route(loop, q)
            return rid

        try:
            await self.call(submit)
        except asyncio.CancelledError:  # the handler went away while the worker submitted
            self.cancel(request_id)
            raise
        return q

    # ---- in the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._drain()
            try:
                busy = self.scheduler.has_work()
            except Exception:
                log.exception("Scheduler.has_work() failed")
                busy = False
            if busy and not self._stopping:
                self._step()
            elif not self._stopping:
                self._wake.wait(self.idle_s)
            self._set_gauges()
        self._drain()
        self._fail_all("the server is shutting down")

    def _set_gauges(self) -> None:
        try:
            self.running, self.waiting = int(self.scheduler.running), int(self.scheduler.waiting)
            self.metrics.running.set(self.running)
            self.metrics.waiting.set(self.waiting)
        except Exception:
            log.exception("reading the scheduler's running / waiting failed")

    def _drain(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue_lib.Empty:
                return
            if command[0] == "call":
                _, fn, loop, fut = command
                try:
                    value, error = fn(self.scheduler), None
                except Exception as e:
                    value, error = None, e
                self._deliver_future(loop, fut, value, error)
            elif command[0] == "cancel":
                self._cancel(command[1])

    @staticmethod
    def _deliver_future(loop, fut, value, error) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(_resolve, fut, value, error)

    def _cancel(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is None:
            return  # finished already
        try:
            self.scheduler.cancel(request_id)
        except Exception:
            log.exception("Scheduler.cancel(%s) failed", request_id)
        self.metrics.finished("cancelled", self._stats(request_id))
        self._hand_out([(route, Item(None, None, True, "cancelled"))])

    def _stats(self, request_id: str):
        try:
            return self.scheduler.stats(request_id)
        except Exception:
            log.exception("Scheduler.stats(%s) failed", request_id)
            return None

    def _step(self) -> None:
        """One ``Scheduler.step``; hands out its events."""
        try:
            events = self.scheduler.step()
        except Exception as e:
            self.step_failures += 1
            log.exception("Scheduler.step() failed; failing the requests in flight")
            self._fail_all(f"the engine step failed: {e!r}")
            time.sleep(0.05)  # a scheduler that keeps failing must not spin the thread
            return
        tokens, out = 0, []
        for ev in events:
            route = self._routes.get(ev.request_id)
            if route is None:
                continue  # cancelled here already, or not submitted through this server
            tokens += ev.token_id is not None
            stats = None
            if ev.finished:
                del self._routes[ev.request_id]
                stats = self._stats(ev.request_id)
                self.metrics.finished(ev.finish_reason, stats)
            out.append((route, Item(ev.token_id, ev.logprob, ev.finished, ev.finish_reason, ev.error, stats)))
        if tokens:
            self.metrics.generation_tokens.inc(tokens)
        self._hand_out(out)

    def _fail_all(self, message: str) -> None:
        out = []
        for rid in list(self._routes):
            route = self._routes.pop(rid)
            try:
                self.scheduler.cancel(rid)
            except Exception:
                log.exception("Scheduler.cancel(%s) failed", rid)
            self.metrics.finished("error", None)
            out.append((route, Item(None, None, True, "error", error=message)))
        self._hand_out(out)

    @staticmethod
    def _hand_out(items: list[tuple[_Route, Item]]) -> None:
        """Puts each item in its route's queue, in order: one ``call_soon_threadsafe`` per event loop for all of
        them (one wake-up of the loop per step, not one per token)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for route, item in items:
            by_loop.setdefault(route.loop, []).append((route.queue, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads
                loop.call_soon_threadsafe(_put_all, items)


# ---- the app ------------------------------------------------------------------------------------------------
def _usage(prompt_tokens: int, completion_tokens: int, stats) -> dict:
    cached = int(stats.cached_tokens) if stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _event(data: str) -> bytes:
    """One server-sent event of one line of ``data`` (no line breaks: JSON from json.dumps has none)."""
    return b"data: " + data.encode() + b"\n\n"


_DONE = _event("[DONE]")


class _Chunks:
    """The streamed chunks of one answer as server-sent events (bytes): the JSON of
    ``{"id", "object", "created", "model", "choices": [choice], "system_fingerprint": null[, "usage"]}``
    exactly as ``json.dumps`` writes that dict (its separators, its key order), with the fixed fields
    encoded once rather than at every token."""

    def __init__(self, rid: str, obj: str, created: int, model: str, include_usage: bool):
        self._head = b'data: {"id": %s, "object": %s, "created": %d, "model": %s, "choices": [' % (
            json.dumps(rid).encode(), json.dumps(obj).encode(), created, json.dumps(model).encode())
        self._tail = b'], "system_fingerprint": null' + (b', "usage": null' if include_usage else b'') + b'}\n\n'

    def choice(self, choice: dict) -> bytes:
        """The chunk of one choice; ``usage`` null when it is included."""
        return self._head + json.dumps(choice).encode() + self._tail

    def usage(self, usage: dict) -> bytes:
        """The last chunk: no choices, the usage."""
        return self._head + b'], "system_fingerprint": null, "usage": ' + json.dumps(usage).encode() + b'}\n\n'


@dataclasses.dataclass
class _Job:
    """One admitted request as its handler follows it."""

    rid: str
    queue: asyncio.Queue
    prompt_ids: list[int]
    text: TextStream
    want_logprobs: bool
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stats: Any = None
    done: bool = False  # no more text: the scheduler finished it, or a stop string ended it here
    scheduler_done: bool = False  # the scheduler sent its final event

    def usage(self) -> dict:
        return _usage(len(self.prompt_ids), len(self.token_ids), self.stats)


class _Server:
    """The routes' shared state and logic (one per app)."""

    def __init__(self, scheduler, tokenizer, model_name: str, chat_template: ChatTemplate | None,
                 max_context: int | None, vocab_size: int | None, default_max_tokens: int):
        self.scheduler, self.tokenizer, self.model_name = scheduler, tokenizer, model_name
        self.chat_template = chat_template or ChatTemplate()
        engine = getattr(scheduler, "engine", None)
        self.max_context = max_context or getattr(engine, "max_seq_len", None)
        self.vocab_size = vocab_size or getattr(getattr(engine, "cfg", None), "vocab_size", None)
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.worker = SchedulerWorker(scheduler, self.metrics)

    # ---- helpers -------------------------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        """400 before any work (counted in ``ftjax_requests_rejected_total{reason="invalid"}``): an empty
        prompt, ids outside the vocabulary, prompt + max_tokens beyond the context."""
        try:
            self._check_prompt(ids, max_tokens, param)
        except APIError:
            self.metrics.rejected.labels("invalid").inc()
            raise

    def _check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        if not ids:
            raise APIError(400, f"the {param} is empty (no tokens)", param=param)
        if self.vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param=param)
        if self.max_context is not None and len(ids) + max_tokens > self.max_context:
            verb = "have" if param == "messages" else "has"
            count = f"{len(ids)} token{'' if len(ids) == 1 else 's'}"
            if len(ids) >= self.max_context:  # whatever max_tokens is (chat's default included), nothing fits
                raise APIError(400, f"the {param} {verb} {count}: the context of {self.max_context} tokens leaves no "
                               f"room for a new token", param=param, code="context_length_exceeded")
            raise APIError(400, f"the {param} {verb} {count}; with max_tokens={max_tokens} that exceeds the "
                           f"context of {self.max_context} tokens", param="max_tokens",
                           code="context_length_exceeded")

    def sampling(self, body: _SamplingBody, max_tokens: int, logprobs: bool) -> SamplingParams:
        top_k = body.top_k if body.top_k not in (None, 0, -1) else None
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=top_k,
                              seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()), stop=body.stops(),
                              logprobs=logprobs)

    async def start(self, prompt_ids: list[int], params: SamplingParams, prefix: str,
                    prompt_field: str = "prompt") -> _Job:
        """Submits a request; a refusal is an APIError naming its field (the scheduler's "prompt" named as the
        route's ``prompt_field``: "messages" for chat)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            q = await self.worker.submit(prompt_ids, params, rid)
        except QueueFull as e:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"the server is busy: {e}", type_="rate_limit_error", code="queue_full") from None
        except ValueError as e:
            self.metrics.rejected.labels("invalid").inc()
            param = getattr(e, "param", "prompt")
            raise APIError(400, str(e), param=prompt_field if param == "prompt" else param) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error") from None
        return _Job(rid, q, prompt_ids, TextStream(self.decode, params.stop), params.logprobs)

    async def follow(self, job: _Job, request: Request | None = None):
        """Yields (new text, token ids, logprobs) per event of ``job`` until it finishes; cancels the request
        when the consumer stops early (a stop string found here, a client gone) or, with ``request``, when
        the client disconnects. Sets ``job``'s finish_reason / error / stats."""
        checked = time.monotonic()
        try:
            while not job.done:
                if request is None:
                    item = await job.queue.get()
                else:  # is the client still there? (every DISCONNECT_CHECK_S, events or not)
                    try:
                        item = await asyncio.wait_for(job.queue.get(), DISCONNECT_CHECK_S)
                    except TimeoutError:
                        item = None
                    if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            return
                    if item is None:
                        continue
                piece, ids, lps = "", [], []
                if item.token_id is not None and not job.text.stopped:
                    piece = job.text.add(item.token_id)
                    ids, lps = [item.token_id], [item.logprob]
                    job.token_ids.append(item.token_id)
                    job.logprobs.append(item.logprob)
                job.scheduler_done = item.finished
                if item.finished or job.text.stopped:
                    job.done = True
                    job.finish_reason = "stop" if job.text.stopped else item.finish_reason
                    job.error = item.error if item.finish_reason == "error" else None
                    job.stats = item.stats if item.finished else None
                    if job.finish_reason == "error" and job.error is None:
                        job.error = "the request failed in the engine"
                    piece += job.text.finish()
                yield piece, ids, lps
        finally:
            if not job.scheduler_done:  # a client gone, or a stop string found before the scheduler saw it
                self.worker.cancel(job.rid)

    def logprobs_completion(self, ids: list[int], lps: list, offset: int) -> dict:
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def logprobs_chat(self, ids: list[int], lps: list) -> dict:
        content = []
        for t, lp in zip(ids, lps):
            s = self.token_text(t)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
        return {"content": content}

    # ---- completions ----------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "a text prompt needs a tokenizer (tokenizer.json in the checkpoint); send token "
                               "ids", param="prompt")
            _check_text(body.prompt, "prompt")
            # off the event loop: a long text takes seconds to tokenize, and other requests must go on meanwhile
            ids = (await run_in_threadpool(self.tokenizer.encode, body.prompt)).ids
        else:
            ids = list(body.prompt)
        max_tokens = body.max_tokens or self.default_max_tokens
        self.check_prompt(ids, max_tokens, "prompt")
        job = await self.start(ids, self.sampling(body, max_tokens, body.logprobs is not None), "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(self._stream_completion(job, include_usage), sep="\n", ping=15)
        ids_out, lps = [], []
        async for _, i, lp in self.follow(job, request):
            ids_out += i
            lps += lp
        if not job.done:
            return Response(status_code=499)  # the client went away; nobody reads this
        if job.finish_reason == "error":
            raise APIError(500, job.error, type_="server_error")
        choice = {"index": 0, "text": job.text.text, "token_ids": job.token_ids,
                  "logprobs": self.logprobs_completion(ids_out, lps, 0) if job.want_logprobs else None,
                  "finish_reason": job.finish_reason}
        return {"id": job.rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": job.usage(), "system_fingerprint": None}

    async def _stream_completion(self, job: _Job, include_usage: bool):
        chunks = _Chunks(job.rid, "text_completion", int(time.time()), self.model_name, include_usage)
        offset = 0
        pending_ids, pending_lps = [], []
        async with contextlib.aclosing(self.follow(job)) as events:
            async for piece, ids, lps in events:
                if job.finish_reason == "error":
                    yield _event(json.dumps(_error_body(job.error, "server_error", code=500)))
                    return
                pending_ids += ids
                pending_lps += lps
                if not piece and not job.done:
                    continue
                lp = self.logprobs_completion(pending_ids, pending_lps, offset) if job.want_logprobs else None
                offset += len(piece)
                pending_ids, pending_lps = [], []
                yield chunks.choice({"index": 0, "text": piece, "logprobs": lp,
                                     "finish_reason": job.finish_reason if job.done else None})
        if include_usage:
            yield chunks.usage(job.usage())
        yield _DONE

    # ---- chat -------------------------------------------------------------------------------------------
    async def chat(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer (tokenizer.json in the checkpoint)", param="messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        for m in messages:
            _check_text(m["content"], "messages")
        try:
            ids = await run_in_threadpool(self.chat_template.encode, self.tokenizer, messages)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # the rest of the context
            max_tokens = max(1, self.max_context - len(ids)) if self.max_context else self.default_max_tokens
        self.check_prompt(ids, max_tokens, "messages")
        job = await self.start(ids, self.sampling(body, max_tokens, body.logprobs), "chatcmpl",
                               "messages")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(self._stream_chat(job, include_usage), sep="\n", ping=15)
        ids_out, lps = [], []
        async for _, i, lp in self.follow(job, request):
            ids_out += i
            lps += lp
        if not job.done:
            return Response(status_code=499)
        if job.finish_reason == "error":
            raise APIError(500, job.error, type_="server_error")
        choice = {"index": 0, "message": {"role": "assistant", "content": job.text.text},
                  "logprobs": self.logprobs_chat(ids_out, lps) if job.want_logprobs else None,
                  "finish_reason": job.finish_reason, "token_ids": job.token_ids}
        return {"id": job.rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": job.usage(), "system_fingerprint": None}

    async def _stream_chat(self, job: _Job, include_usage: bool):
        chunks = _Chunks(job.rid, "chat.completion.chunk", int(time.time()), self.model_name, include_usage)
        yield chunks.choice({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        pending_ids, pending_lps = [], []
        async with contextlib.aclosing(self.follow(job)) as events:
            async for piece, ids, lps in events:
                if job.finish_reason == "error":
                    yield _event(json.dumps(_error_body(job.error, "server_error", code=500)))
                    return
                pending_ids += ids
                pending_lps += lps
                if piece:
                    lp = self.logprobs_chat(pending_ids, pending_lps) if job.want_logprobs else None
                    pending_ids, pending_lps = [], []
                    yield chunks.choice({"index": 0, "delta": {"content": piece}, "logprobs": lp,
                                         "finish_reason": None})
                if job.done:
                    lp = self.logprobs_chat(pending_ids, pending_lps) if job.want_logprobs and pending_ids else None
                    yield chunks.choice({"index": 0, "delta": {}, "logprobs": lp, "finish_reason": job.finish_reason})
        if include_usage:
            yield chunks.usage(job.usage())
        yield _DONE

    # ---- the rest -----------------------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "ftjax", "max_model_len": self.max_context}]}

    async def prometheus(self) -> Response:
        snapshot = running = waiting = None
        try:
            snapshot, running, waiting = await asyncio.wait_for(
                self.worker.call(lambda s: (s.metrics(), s.running, s.waiting)), 30.0)
        except Exception:  # a long step or a failing metrics(): the last figures
            log.exception("Scheduler.metrics() failed or timed out")
        body = self.metrics.exposition(snapshot, running, waiting)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def create_app(scheduler, tokenizer, model_name: str, *, chat_template: ChatTemplate | None = None,
               max_context: int | None = None, vocab_size: int | None = None,
               default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI app serving ``scheduler`` (module docstring: routes, errors, threading).

    Args:
      scheduler: a ``ftjax.serve.scheduler.Scheduler`` (owned by the app's worker thread from startup to
        shutdown: nothing else may call it meanwhile).
      tokenizer: a ``tokenizers.Tokenizer`` (text prompts, chat, text output), or None: token-id prompts
        only, empty text.
      model_name: the name ``/v1/models`` lists and requests may give as ``model``.
      chat_template: how chat messages become a prompt (default: the plain ``role: content`` template).
      max_context: tokens of prompt + generation a request may use (default: the scheduler's engine's
        ``max_seq_len``); vocab_size: prompt ids must be below it (default: the engine model's).
      default_max_tokens: ``max_tokens`` of a completion that gives none (OpenAI's 16).
    Returns:
      The app; its scheduler thread runs between the app's startup and shutdown (``app.state.server``
      holds the state: ``.worker``, ``.metrics``).
    """
    server = _Server(scheduler, tokenizer, model_name, chat_template, max_context, vocab_size, default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.worker.stop)

    app = FastAPI(title="ftjax", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        server.metrics.rejected.labels("invalid").inc()
        message, param = _validation_message(list(exc.errors()))
        return JSONResponse(_error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(_error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(_error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        ok = server.worker.alive
        return JSONResponse({"status": "ok" if ok else "scheduler thread stopped", "running": server.worker.running,
                             "waiting": server.worker.waiting}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return await server.prometheus()

    return app
