"""Continuous batching: requests join and leave the engine's batch rows between steps (issue 31).

A :class:`Scheduler` drives one :class:`ftjax.Engine` through its request API (``open_rows`` /
``admit`` / ``advance`` / ``release``; after jax-llm-examples' ``serving_loop.py``: ``add_request``,
``serving_step``). Each :meth:`Scheduler.step`:

1. admits waiting requests, first come first served, into free rows (``Engine.admit``; with a
   ``kv_manager`` each looks up and pins its stored prefix, in whatever row it gets);
2. runs the engine: when some rows prefill, one prefill call of the next chunk of every prefilling row
   (``Engine.advance()``: the decoding rows idle) and one decode step of every decoding row
   (``Engine.advance(tokens, mixed=False)``: the decode program, the prefilling rows idle); a decode step
   (or block) when no row prefills. Rows that reuse a stored prefix or store new KV chunks prefill in the
   same call as the others, each loading and storing its own (``ftjax.kv.layerwise.HookRow``), so
   requests arriving together prefill together. A running request's time per token while another is
   admitted is therefore one prefill-chunk call (``EngineConfig.prefill_chunk`` bounds it) plus one decode
   step. ``mixed_calls=True`` runs both in one *mixed* call instead (``Engine.advance(tokens)``: the
   decoding rows take their token in the prefill program): one call fewer per admission chunk, so that
   time is one prefill-chunk call, at the cost of the guarantee below in bfloat16;
3. samples the rows that have a next-token distribution, each with its own parameters and PRNG key
   (``ftjax.sampling.sample_rows``: a request's tokens depend on its seed, not on the batch around it);
4. ends the requests that stopped (EOS or ``stop_token_ids``, a stop string, ``max_tokens``) and frees
   their rows.

Decode blocks (``decode_block`` k > 1, default ``EngineConfig.decode_block``): when no row prefills (a step
admits waiting requests into free rows first, so every row then decodes and a request still waiting has no
free row to take), a step runs one program of up to k decode steps (``Engine.dispatch_block`` /
``read_block``, ``ftjax.runtime.step.decode_block``): each step's token is fed straight back on the device
and each row is drawn with its own key and parameters exactly as the one-step path draws it, so the fixed
cost of a step (dispatch, the sampler's own program, the host round trip) is paid once a block. The block
is capped at the fewest tokens any row may still generate (``max_tokens``), so no row runs past its limit
or its context, and it ends early on the device once every row has sampled one of its stop ids (EOS,
``stop_token_ids``). After the block the host hands out its tokens in order and applies what only it can
check -- stop strings, ``max_tokens``, cancellations (a client that disconnected while the block ran):
a row's tokens after its stop are dropped, so a request ends with the same tokens, finish_reason and
usage counts as on the one-step path (greedy: bit-identical tokens; sampled: the same keys, the same
draws). What changes is when tokens come out: streaming is bursty (up to k tokens at once); a request
that arrives while a block runs, or that waits for a row freed by a stop inside a block, is admitted
after the block (its TTFT grows by at most k decode steps); a stopped row keeps decoding to the block's
end (those tokens dropped). Per-token times inside a block (``RequestStats.tpot_s``, the TPOT histogram)
are the block's wall time (from its dispatch, or from the read of the block before it, whichever is later)
divided evenly among its steps. A block is one shared engine call: if it fails,
every running request fails, as with a one-step call. k = 1 runs one program per decode step. Rows with
more stop ids than the compiled program's columns (a power of two >= 4) compile another program on first use.

Run-ahead (``run_ahead=True``, the default): while every running request decodes and no waiting request
could take a free row, a step dispatches the next decode step (k = 1) or block (k > 1), fed with the tokens,
keys and (a block) positions the previous one left *on the device*, before it reads that previous one's
tokens on the host. The host's work of a step (reading tokens, stop checks, events, the next call's
dispatch) then overlaps the device's work of the next, as in vLLM's asynchronous scheduling. The tokens are
the same (the same logits, keys and parameters); each comes out one step (or block) later than without
run-ahead. One step: a request's row runs one step past its last token (the step already dispatched when
that token is read), whose token is dropped; that step stays inside the request's context (its input is the
last token, at position prompt + max_tokens - 1). Blocks: a block run ahead runs no step when a row sampled
one of its stop ids in the block before it (``Engine.dispatch_block(after=...)``: the device knows, so the
row is freed for a waiting request without a wasted block); a request that reaches its ``max_tokens`` in the
block before sits the block out (idle), and the block is capped at the fewest tokens any other request may
still generate, so no row runs past its limit or context; no block runs ahead when a waiting request could
take a free row or the row such a request frees. A stop only the host sees (a stop string, a cancellation)
is applied when the block is read, and that row's tokens in the block already run ahead are dropped.

Under greedy decoding a request's tokens are those of the same request run alone, for any arrival pattern,
batch size, chunk size and expert mode (tests, float32: its logits agree within float32 rounding, the calls'
shapes differing); the expert cache stays one global cache shared by the rows (DESIGN.md 1.1). A decoding
row's token always comes from the decode program of the scheduler's batch, whatever the other rows do: rows
still prefilling idle in it, their state left as it was (``Engine.advance``). So in bfloat16 too, a request
decoded while other requests' prompts prefill gets bit for bit the tokens and logits of its run alone in the
same scheduler (tests), where every miss is fetched (miss policy ``fetch``, the default): under the ``cpu`` and
``adaptive`` policies a miss computed on the CPU rounds otherwise than the same expert cached on the device,
and other requests change which of a request's experts are cached (on the CPU backend the CPU path's
``numpy_rows_async`` flipped 3 of 60 greedy trials; ``callback_async`` 0 of 10, 2026-12-05). Decode blocks
(``decode_block`` > 1) add an assumption this checks only on the CPU: a request alone decodes in the block
program but beside an admission in the one-step program, equal on the CPU backend (tests) and not yet compared
on a GPU. What bfloat16 rounding can still move is a prompt's prefill: its chunk may share a
call of a wider bucket with another row's chunk (requests arriving together), and a run alone at another
batch size runs other shapes; either can flip a near-tie (on the demo model, a 5-token prompt arriving with
a 40-token one, ``prefill_chunk`` 64, against it alone: 5 of 30 trials; batch 1 against 2: 3 of 30,
2026-12-05). With ``mixed_calls=True`` a decoding row also takes its token in the prefill program's shapes
while another request's prompt prefills, whose bfloat16 rounding can flip a near-tie against its solo run
(a test has a case; 1 of 30 trials on the demo model, 16 tokens decoded beside 120 prefilling in chunks of
16, 2026-12-05).

Failures: an exception from the shared engine call ends every running request with an "error" event
(the call consumed the batch's KV cache) and the scheduler opens fresh rows and goes on; an exception in
one request's own work (storing its new KV chunks, checking its stop strings, admitting it) ends that
request alone. Pins of the prefix cache are released when a request's prefill ends, when it is cancelled
and when it fails.

Not thread-safe: call it from one thread (the HTTP server's loop).
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import time
import uuid
from typing import Callable, Sequence

import jax
import numpy as np

from ftjax import memory
from ftjax.runtime.plan import prompt_error
from ftjax.runtime.step import RowSampling, sample_rows_next
from ftjax.sampling import GREEDY_BELOW, ParamError, ResolvedSampling
from ftjax.serve.text import StopChecker

#: finished requests whose :class:`RequestStats` :meth:`Scheduler.stats` keeps (the most recent)
STATS_KEPT = 1024
FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's generation parameters (checked by :meth:`Scheduler.submit`).

    max_tokens: tokens to generate, >= 1. temperature (>= 0; 0: greedy), top_p (in (0, 1]), top_k (>= 0;
    0: no limit): None takes the checkpoint's ``generation_config.json`` default
    (``LoadedModel.sampling_defaults``; greedy when it gives none). seed: the request's PRNG seed, an int
    in [0, 2**64) (None: a random one); the same seed and parameters give the same tokens in any batch.
    stop_token_ids: ids that end the request, besides the checkpoint's EOS ids. stop: strings that end it
    once the decoded completion contains one (needs ``Scheduler(detokenize=...)``). logprobs: report each
    token's log-probability (``TokenEvent.logprob``).
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False


class QueueFull(RuntimeError):
    """:meth:`Scheduler.submit` with ``max_waiting`` requests already waiting."""


@dataclasses.dataclass
class TokenEvent:
    """One output of :meth:`Scheduler.step` (or the final event of a :meth:`Scheduler.cancel`).

    token_id: the generated token; None on a final event without one ("cancelled", "error").
    finished: the request's last event. finish_reason: "stop" (the token is an EOS / stop token id, or
    the completion now contains a stop string: the token is reported, a server leaves the stop text out),
    "length" (``max_tokens`` reached), "cancelled", "error" (``error`` says what failed), None while it
    runs. logprob: the token's log-probability under the model's distribution (``log_softmax`` of the
    logits, before temperature, top-k and top-p) when the request asked for it.
    """

    request_id: str
    token_id: int | None
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprob: float | None = None


@dataclasses.dataclass
class RequestStats:
    """A finished request's figures (:meth:`Scheduler.stats`). Times in seconds.

    prompt_tokens, completion_tokens; cached_tokens: prompt tokens reused from the prefix cache.
    queued_s: from submit to admission into a row (to the end, for a request that never got one);
    ttft_s: from submit to its first token (None without one); tpot_s: the time between each two
    consecutive tokens (completion_tokens - 1 entries).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queued_s: float
    ttft_s: float | None
    tpot_s: list[float]


@dataclasses.dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    sampling: ResolvedSampling
    key: np.ndarray  # uint32 [2]: the request's PRNG key (threefry key data), split at every token
    stop_ids: frozenset
    t_submit: float
    row: int | None = None
    t_admit: float | None = None
    t_last: float | None = None
    ttft: float | None = None
    tpot: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    stop_check: StopChecker | None = None  # with stop strings: the completion's text, checked token by token


@dataclasses.dataclass(eq=False)
class _Dispatched:
    """Work dispatched to the device for some requests: ``reqs``, (request, the row it held) pairs."""
    reqs: list

    def live(self) -> bool:
        """Whether a request it was dispatched for still holds its row."""
        return any(r.row == row for r, row in self.reqs)


@dataclasses.dataclass(eq=False)
class _Sampled(_Dispatched):
    """One dispatched draw: the results on the device: tokens int32 [B], next keys uint32 [B, 2], logprobs
    float32 [B]; and the decode step's expert stats (``LayerStats``, on the device; None after a prefill call,
    which the engine counts itself), counted when the tokens are read: read at dispatch, they would make the
    host wait for the step it just dispatched and run-ahead would hide nothing."""
    tokens: object
    keys: object
    logprobs: object
    stats: object = None


@dataclasses.dataclass(eq=False)
class _Block(_Dispatched):
    """One decode block dispatched: the engine's handle (``Engine.dispatch_block``), the steps asked for, and
    when it was dispatched (``time.perf_counter``)."""
    pending: object
    limit: int
    t0: float


def _eos_width(n: int) -> int:
    """Stop-id columns of a decode block for rows of up to ``n`` stop ids: a power of two, at least 4 (few
    compiled programs whatever the requests' ``stop_token_ids``)."""
    return max(4, 1 << max(n - 1, 0).bit_length())


def _key_data(seed: int) -> np.ndarray:
    """uint32 [2]: the threefry key of ``seed`` in [0, 2**64) (``jax.random.key(seed)`` for seed < 2**32)."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


class Scheduler:
    """Continuous batching over ``engine`` (module docstring).

    Args:
      engine: an :class:`ftjax.Engine`; the scheduler owns its rows (``open_rows``) from now on.
      max_batch: rows to run at once, in [1, ``EngineConfig.batch``] (default: the engine's batch).
      max_waiting: most requests waiting for a row (>= 1), beyond those the free rows take at the next step;
        :meth:`submit` raises :class:`QueueFull` beyond.
      kv_manager: a ``ftjax.kv.prefix_cache.PrefixCache``: every request reuses stored prompt prefixes and
        stores its new full chunks.
      detokenize: ``Callable[[list[int]], str]`` for stop strings: the text of a request's completion ids.
        It is called with windows of them (``ftjax.serve.text.StopChecker``), so it must decode ids the way
        a tokenizer does: the text of a list is that of its pieces, up to a character split between them.
      run_ahead: dispatch the next decode step or block before reading this one's tokens (module docstring);
        False: every step reads its tokens before the next is dispatched.
      decode_block: decode steps per program in steady decode (module docstring), >= 1; default the
        engine's ``EngineConfig.decode_block`` (1 where its decode steps run on the host-split driver);
        1: one program per decode step.
      mixed_calls: while some rows prefill, decode the others in the prefill call (one mixed call a step)
        instead of a decode call of their own (module docstring): one call fewer per admission chunk, but
        bfloat16 tokens may then differ from the request's alone.
    Raises:
      ValueError: max_batch, max_waiting or decode_block out of range; decode_block > 1 given for an engine whose
        decode steps run on the host-split driver.
    """

    def __init__(self, engine, *, max_batch: int | None = None, max_waiting: int = 64, kv_manager=None,
                 detokenize: Callable[[list[int]], str] | None = None, run_ahead: bool = True,
                 decode_block: int | None = None, mixed_calls: bool = False):
        n = engine.batch if max_batch is None else max_batch
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= engine.batch:
            raise ValueError(f"max_batch must be in [1, {engine.batch}] (EngineConfig.batch), got {max_batch!r}")
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, numbers.Integral) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        k = engine.config.decode_block if decode_block is None else decode_block
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"decode_block must be an integer >= 1 (decode steps per program), got {decode_block!r}")
        if k > 1 and not engine.blocks_decode(n):
            if decode_block is not None:
                raise ValueError(f"decode_block {k}: this engine decodes on the host-split driver "
                                 f"(MissPolicyConfig.cpu_driver 'host'), one step per call; use decode_block=1")
            k = 1  # the engine's default: its decode steps run one host step per layer, not in blocks
        self.decode_block = int(k)
        self.engine, self.kv_manager, self.detokenize = engine, kv_manager, detokenize
        self.max_batch, self.max_waiting = int(n), int(max_waiting)
        self._defaults = engine.model.sampling_defaults
        self._eos = frozenset(int(t) for t in engine.model.eos_token_ids)
        self._queue: collections.deque[_Request] = collections.deque()
        self._rows: list[_Request | None] = [None] * self.max_batch
        self._active: dict[str, _Request] = {}
        self._events: list[TokenEvent] = []  # final events of cancels, handed out by the next step
        self._stats: collections.OrderedDict[str, RequestStats] = collections.OrderedDict()
        self._counts = collections.Counter()
        self.run_ahead = bool(run_ahead)
        self.mixed_calls = bool(mixed_calls)
        self._ahead: _Sampled | _Block | None = None  # a decode step or block dispatched, its tokens not read yet
        self._block_read_at = 0.0  # when the last decode block's tokens were read (its successor's time starts)
        engine.open_rows(self.max_batch)
        self._warm_sampler()
        if self.decode_block > 1:  # the block program of the checkpoint's stop ids (most requests')
            engine.precompile_block(self.decode_block, _eos_width(len(self._eos)))

    # ---- state -----------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        """Requests holding a row."""
        return sum(r is not None for r in self._rows)

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return len(self._queue)

    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do: requests waiting or running, or events to hand out."""
        return bool(self._queue or self.running or self._events or self._ahead is not None)

    def stats(self, request_id: str) -> RequestStats | None:
        """The figures of a finished request (the last :data:`STATS_KEPT`); None for one unknown, forgotten
        or not finished."""
        return self._stats.get(request_id)

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queues a request; returns its id (``request_id``, or a new unique one). Nothing runs until
        :meth:`step`.

        Raises:
          ParamError: (a ValueError naming the field) a bad prompt (empty, an id that is not an int in [0, V)),
            prompt + ``max_tokens`` beyond the context (``EngineConfig.max_seq_len``), bad parameters, stop
            strings without ``detokenize``.
          ValueError: params not a SamplingParams, or an id already in use by a waiting or running request.
          QueueFull: ``max_waiting`` requests already wait beyond the rows free for the next step.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = list(prompt_ids)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
            raise ParamError("prompt", "prompt token ids must be integers")
        mt = params.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, numbers.Integral) or mt < 1:
            raise ParamError("max_tokens", f"max_tokens must be an integer >= 1, got {mt!r}")
        cfg = self.engine.cfg
        problem = prompt_error(ids, cfg.vocab_size, int(mt), self.engine.max_seq_len, "the context (max_seq_len)")
        if problem:
            raise ParamError("prompt", problem)
        sampling = self._defaults.resolve(params.temperature, params.top_p, params.top_k)
        seed = params.seed
        if seed is None:
            seed = int(np.random.default_rng().integers(0, 2**63))
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
            raise ParamError("seed", f"seed must be an integer in [0, 2**64), got {params.seed!r}")
        stop_ids = list(params.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in stop_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be integers >= 0, got {params.stop_token_ids!r}")
        if isinstance(params.stop, str) or any(not isinstance(s, str) or not s for s in params.stop):
            raise ParamError("stop", f"stop must be a tuple of non-empty strings, got {params.stop!r}")
        if params.stop and self.detokenize is None:
            raise ParamError("stop", "stop strings need Scheduler(detokenize=...)")
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already in use")
        free = self._rows.count(None)  # a burst submitted between two steps fills the free rows first
        if len(self._queue) >= self.max_waiting + free:
            raise QueueFull(f"{len(self._queue)} requests already wait for {free} free rows "
                            f"(max_waiting={self.max_waiting})")
        req = _Request(rid, [int(t) for t in ids], params, sampling, _key_data(int(seed)),
                       self._eos | {int(t) for t in stop_ids}, time.perf_counter())
        if params.stop:
            req.stop_check = StopChecker(self.detokenize, params.stop)
        self._queue.append(req)
        self._active[rid] = req
        self._counts["requests_submitted"] += 1
        return rid

    def cancel(self, request_id: str) -> None:
        """Ends a waiting or running request: its row and its prefix-cache pins are freed now, and the next
        :meth:`step` hands out its final "cancelled" event. An unknown or finished request: nothing."""
        req = self._active.get(request_id)
        if req is None:
            return
        if req.row is None:
            self._queue.remove(req)
        self._end(req, "cancelled", self._events)

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Admits waiting requests into free rows, runs the engine (one call, or a prefill call and a decode
        call while some rows prefill), samples and stops (module docstring). Returns the events of this step
        ([] when idle): per running request with a new token, one event (a decode block: one per token of the
        block, in order); final events of requests that ended. With run-ahead, a decode step's (or block's)
        tokens come out of the step after the one that dispatched it."""
        events, self._events = self._events, []
        if isinstance(self._ahead, _Block):
            ahead, self._ahead = self._ahead, None
            plan = self._block_ahead(ahead)
            if plan is not None:
                self._ahead = self._dispatch_block(events, *plan, after=ahead)
            self._read_block(ahead, events)
            if self._ahead is not None and not self._ahead.live():  # every request in it ended
                self.engine.discard_block(self._ahead.pending)
                self._ahead = None
            if plan is not None:
                return events
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            if self._can_run_ahead(ahead):
                self._ahead = self._decode(events, ahead)
                self._read(ahead, events)
                if self._ahead is not None and not self._ahead.live():
                    self._count(self._ahead)  # every request in it ended: nothing of it is wanted but its stats
                    self._ahead = None
                return events
            self._read(ahead, events)
        self._admit(events)
        if not self.running:
            return events
        eng = self.engine
        if not eng.prefilling() and self.decode_block > 1:
            self._decode_block(events)
            return events
        if not eng.prefilling():
            sampled = self._decode(events)
            if sampled is not None:
                if self.run_ahead:
                    self._ahead = sampled
                else:
                    self._read(sampled, events)
            return events
        decoding = [r for r in self._rows if r is not None and r.tokens]
        if self.mixed_calls or not decoding:
            sampled = self._prefill(events, self._last_tokens(decoding) if decoding else None)
            if sampled is not None:
                self._read(sampled, events)
            return events
        # the decode step first: its tokens are read while the device runs the prefill call
        decoded = self._decode(events)
        sampled = self._prefill(events) if eng.prefilling() else None
        for s in (decoded, sampled):
            if s is not None:
                self._read(s, events)
        return events

    def _prefill(self, events: list[TokenEvent], tokens: np.ndarray | None = None) -> "_Sampled | None":
        """Dispatches the next prefill call of the prefilling rows (with ``tokens``, int32 [B, 1]: a mixed call,
        every decoding row taking its last token in it) and the draw of the rows it gives a distribution. None
        if the call failed (every running request ended) or gave no row one."""
        try:
            adv = self.engine.advance(tokens)
        except Exception as err:  # noqa: BLE001 - the shared call: its rows fail, the scheduler goes on
            self._fail_running(events, err)
            return None
        self._counts[f"engine_calls_{adv.kind}"] += 1
        self._counts["steps"] += 1
        reqs = [self._rows[i] for i in adv.rows if self._rows[i] is not None]
        for i, msg in adv.failed.items():
            if self._rows[i] is not None:
                self._end(self._rows[i], "error", events, msg)
        return self._dispatch_sample(adv.logits, [r for r in reqs if r.row is not None], events)

    def _can_run_ahead(self, ahead: "_Sampled") -> bool:
        """Whether the next call may be dispatched before ``ahead``'s tokens are read: every running request
        decodes and no waiting request could take a free row (admission reads the tokens first)."""
        if not self.run_ahead or self.decode_block > 1 or not ahead.live() or self.engine.prefilling():
            return False
        return not (self._queue and None in self._rows)

    def _decode(self, events: list[TokenEvent], ahead: "_Sampled | None" = None) -> "_Sampled | None":
        """Dispatches one decode step of every decoding row (rows still prefilling idle in it) and its draw; the
        last tokens and keys come from ``ahead`` (on the device, not read) or else from the requests (the
        host). None if the call failed (its requests ended)."""
        eng = self.engine
        reqs = [r for r in self._rows if r is not None and r.tokens]
        if ahead is not None:
            tokens, keys = ahead.tokens[:, None], ahead.keys
        else:
            tokens, keys = self._last_tokens(reqs), None
        try:
            adv = eng.advance(tokens, mixed=False)
        except Exception as err:  # noqa: BLE001 - the shared call: its rows fail, the scheduler goes on
            self._fail_running(events, err)
            return None
        self._counts["engine_calls_decode"] += 1
        self._counts["steps"] += 1
        sampled = self._dispatch_sample(adv.logits, reqs, events, keys, adv.stats)
        if sampled is None:
            self._count_stats(adv.stats)
        return sampled

    def _count_stats(self, stats) -> None:
        """Adds a decode step's expert stats to the engine's counters (reads them: waits for the step)."""
        try:
            self.engine.counters["decode"].add(stats)
        except Exception:  # noqa: BLE001 - the step failed on the device: its rows fail where its tokens are read
            pass

    def _count(self, sampled: "_Sampled") -> None:
        """Counts ``sampled``'s decode stats once (:class:`_Sampled`)."""
        if sampled.stats is not None:
            stats, sampled.stats = sampled.stats, None
            self._count_stats(stats)

    def _decode_block(self, events: list[TokenEvent]) -> None:
        """Dispatches one decode block of every running row (module docstring); with run-ahead it is read by the
        next step, else its tokens are handed out now."""
        reqs = [r for r in self._rows if r is not None]
        limit = min(self.decode_block, min(r.params.max_tokens - len(r.tokens) for r in reqs))
        blk = self._dispatch_block(events, reqs, limit)
        if blk is None:
            return
        if self.run_ahead:
            self._ahead = blk
        else:
            self._read_block(blk, events)

    def _block_ahead(self, ahead: _Block) -> tuple[list, int] | None:
        """(requests, limit) of the block to dispatch before ``ahead``'s tokens are read, or None to read them
        first: without run-ahead, when no request of ``ahead`` still runs, when a waiting request could take a
        free row or one that ``ahead`` ends (its ``max_tokens``), or when every running request ends in
        ``ahead``. A request that reaches its ``max_tokens`` in ``ahead`` sits the block out (idle) and the
        block is capped at the fewest tokens any other may still generate after ``ahead``, so that no row runs
        past its limit or its context."""
        if not self.run_ahead or not ahead.live() or self.engine.prefilling():
            return None
        running = [r for r in self._rows if r is not None]
        ran = {id(r) for r, row in ahead.reqs if r.row == row}
        left = {id(r): r.params.max_tokens - len(r.tokens) - (ahead.limit if id(r) in ran else 0) for r in running}
        reqs = [r for r in running if left[id(r)] > 0]
        if not reqs or (self._queue and (None in self._rows or len(reqs) < len(running))):
            return None
        return reqs, min(self.decode_block, min(left[id(r)] for r in reqs))

    def _dispatch_block(self, events: list[TokenEvent], reqs: list[_Request], limit: int,
                        after: _Block | None = None) -> _Block | None:
        """Dispatches a decode block of ``reqs`` (their rows; the others idle) of up to ``limit`` steps, fed from
        the host or, with ``after``, on the device from that block not read yet. None if the call failed (every
        running request ended)."""
        eng = self.engine
        b, v = self.max_batch, eng.cfg.vocab_size
        keys, temp = np.zeros((b, 2), np.uint32), np.zeros(b, np.float32)
        top_p, top_k = np.ones(b, np.float32), np.zeros(b, np.int32)
        stops = {r.row: sorted(t for t in r.stop_ids if t < v) for r in reqs}  # ids >= V are never sampled
        eos = np.full((b, _eos_width(max(map(len, stops.values())))), -1, np.int32)
        for r in reqs:
            keys[r.row] = r.key
            temp[r.row], top_p[r.row], top_k[r.row] = r.sampling.temperature, r.sampling.top_p, r.sampling.top_k
            eos[r.row, :len(stops[r.row])] = stops[r.row]
        t0 = time.perf_counter()
        try:
            pending = eng.dispatch_block(None if after else self._last_tokens(reqs),
                                         RowSampling(keys, temp, top_p, top_k), limit, eos, self.decode_block,
                                         rows=[r.row for r in reqs], after=after.pending if after else None)
        except Exception as err:  # noqa: BLE001 - the shared call: its rows fail, the scheduler goes on
            self._fail_running(events, err)
            return None
        self._counts["engine_calls_decode_block"] += 1
        return _Block([(r, r.row) for r in reqs], pending, limit, t0)

    def _read_block(self, blk: _Block, events: list[TokenEvent]) -> None:
        """Reads a decode block's tokens (waiting for it) and hands each request still in the row it ran for its
        tokens in order, up to its stop (the block's later tokens of that row are dropped)."""
        eng = self.engine
        try:
            out = eng.read_block(blk.pending)
            for st in out.stats:
                eng.counters["decode"].add(st)
        except Exception as err:  # noqa: BLE001 - the block failed on the device: its rows fail
            if blk.live():
                self._fail_running(events, err)
            return
        n = out.steps
        self._counts["steps"] += n
        now = time.perf_counter()
        start = max(blk.t0, self._block_read_at)  # a block run ahead starts once the one before it is done
        self._block_read_at = now
        per_token = (now - start) / max(n, 1)  # the block's wall time, divided evenly
        for r, row in blk.reqs:
            for j in range(n):
                if r.row != row:
                    break  # it ended at an earlier token of the block (a stop), or was cancelled meanwhile
                try:
                    events.append(self._take(r, int(out.tokens[row, j]), out.keys[row], float(out.logprobs[row, j]),
                                             start + (j + 1) * per_token))
                except Exception as err:  # noqa: BLE001 - this request's own work
                    self._end(r, "error", events, f"{type(err).__name__}: {err}")

    def _last_tokens(self, reqs: list[_Request]) -> np.ndarray:
        """int32 [max_batch, 1]: each of ``reqs``' last token in its row (0 elsewhere), from the host."""
        tokens = np.zeros((self.max_batch, 1), np.int32)
        for r in reqs:
            tokens[r.row, 0] = r.tokens[-1]
        return tokens

    def _dispatch_sample(self, logits, reqs: list[_Request], events: list[TokenEvent], keys=None, stats=None):
        """Dispatches one draw for the rows of ``reqs`` (others drawn greedily and ignored); its results stay
        on the device (:class:`_Sampled`, with the decode step's ``stats``). ``keys``: the rows' keys on the
        device (uint32 [B, 2]), else the requests' own. None if ``reqs`` is empty or the draw could not be
        dispatched (they end)."""
        if not reqs:
            return None
        b = self.max_batch
        temp, top_p, top_k = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.int32)
        if keys is None:
            keys = np.zeros((b, 2), np.uint32)
            for r in reqs:
                keys[r.row] = r.key
        for r in reqs:
            temp[r.row], top_p[r.row], top_k[r.row] = r.sampling.temperature, r.sampling.top_p, r.sampling.top_k
        try:
            out = sample_rows_next(logits, keys, temp, top_p, top_k, all_greedy=bool(np.all(temp < GREEDY_BELOW)))
        except Exception as err:  # noqa: BLE001 - one draw for these rows: they fail together
            for r in reqs:
                self._end(r, "error", events, f"sampling failed: {type(err).__name__}: {err}")
            return None
        return _Sampled([(r, r.row) for r in reqs], *out, stats=stats)

    def _read(self, sampled: "_Sampled", events: list[TokenEvent]) -> None:
        """Reads a draw's tokens on the host (waiting for its step) and hands each request still in the row it
        was drawn for its token (ending the requests that stop)."""
        try:  # one wait, the three copies together
            toks, keys, logprobs = jax.device_get((sampled.tokens, sampled.keys, sampled.logprobs))
        except Exception as err:  # noqa: BLE001 - the step failed on the device: its rows fail
            if sampled.live():
                self._fail_running(events, err)
            self._ahead = None
            return
        self._count(sampled)
        now = time.perf_counter()
        for r, row in sampled.reqs:
            if r.row != row:
                continue  # ended (cancelled, failed) since the draw was dispatched
            try:
                events.append(self._take(r, int(toks[row]), keys[row], float(logprobs[row]), now))
            except Exception as err:  # noqa: BLE001 - this request's own work
                self._end(r, "error", events, f"{type(err).__name__}: {err}")

    def _admit(self, events: list[TokenEvent]) -> None:
        """Moves waiting requests into free rows; compiles what their calls need (with ``mixed_calls``, the
        mixed calls too)."""
        admitted = False
        while self._queue and None in self._rows:
            req = self._queue.popleft()
            try:
                row = self.engine.admit(req.prompt, req.params.max_tokens, self.kv_manager)
            except Exception as err:  # noqa: BLE001 - this request's own admission (its prefix lookup, say)
                self._end(req, "error", events, f"admission failed: {type(err).__name__}: {err}")
                continue
            req.row, req.t_admit = row, time.perf_counter()
            self._rows[row] = req
            kv = self.engine.rows[row].kv_request
            req.cached_tokens = kv.reused_tokens if kv is not None else 0
            admitted = True
        if admitted:
            try:
                self.engine.precompile(mixed=self.mixed_calls)
            except Exception as err:  # noqa: BLE001 - the rows' programs: every running request fails
                self._fail_running(events, err)

    def _take(self, req: _Request, token: int, key: np.ndarray, logprob: float, now: float) -> TokenEvent:
        """Records ``req``'s new token, ready at ``now``; ``key``: the request's key after it (after a decode
        block's last draw for every token of the block: only the last one's is used again). Returns its event
        (ending the request when it stops)."""
        if req.tokens:
            req.tpot.append(now - req.t_last)
        else:
            req.ttft = now - req.t_submit
        req.t_last, req.key = now, key
        req.tokens.append(token)
        self._counts["tokens_generated"] += 1
        reason = None
        if token in req.stop_ids or (req.stop_check is not None and self._stop_string(req)):
            reason = "stop"
        elif len(req.tokens) >= req.params.max_tokens:
            reason = "length"
        event = TokenEvent(req.id, token, reason is not None, reason,
                           logprob=logprob if req.params.logprobs else None)
        if reason is not None:
            self._end(req, reason)
        return event

    def _stop_string(self, req: _Request) -> bool:
        """Whether the decoded completion (with its new token, the last of ``req.tokens``) contains one of the
        request's stop strings. Bounded work per token, whatever the completion's length: a window of its ids
        is decoded and the text that can hold a new stop string searched (``ftjax.serve.text.StopChecker``)."""
        return req.stop_check.add(req.tokens[-1])

    # ---- ending requests ---------------------------------------------------------------------------
    def _end(self, req: _Request, reason: str, events: list[TokenEvent] | None = None, error: str | None = None):
        """Ends ``req``: frees its row (and pins), keeps its stats; appends a final event without a token to
        ``events`` when given (cancel, error)."""
        if req.row is not None:
            row, req.row = req.row, None
            self._rows[row] = None
            try:
                self.engine.release(row)
            except Exception as err:  # noqa: BLE001 - the row is free either way; say why its pins may linger
                error = error or f"release failed: {type(err).__name__}: {err}"
        self._active.pop(req.id, None)
        now = time.perf_counter()
        queued = (req.t_admit if req.t_admit is not None else now) - req.t_submit
        self._stats[req.id] = RequestStats(len(req.prompt), len(req.tokens), req.cached_tokens, queued, req.ttft,
                                           list(req.tpot))
        while len(self._stats) > STATS_KEPT:
            self._stats.popitem(last=False)
        self._counts[f"requests_finished_{reason}"] += 1
        self._counts["prompt_tokens"] += len(req.prompt)
        self._counts["cached_tokens"] += req.cached_tokens
        if events is not None:
            events.append(TokenEvent(req.id, None, True, reason, error=error))

    def _fail_running(self, events: list[TokenEvent], err: BaseException) -> None:
        """A shared call failed: every running request ends with an error, and the engine gets fresh rows
        (the failed call consumed the KV cache)."""
        self._counts["engine_calls_failed"] += 1
        msg = f"engine call failed: {type(err).__name__}: {err}"[:1000]
        for req in [r for r in self._rows if r is not None]:
            self._end(req, "error", events, msg)
        self.engine.open_rows(self.max_batch)

    # ---- metrics -----------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters for a /metrics route, a flat dict of numbers: requests submitted / running / waiting /
        finished (in all and by reason), prompt, cached and generated tokens, steps (forward steps: one per
        call, a decode block counts the steps it ran) and engine calls by kind (prefill: prefill calls of the
        prefilling rows alone, mixed: prefill calls the decoding rows took a token in, decode: one-step
        decode programs, also those of the decoding rows while others prefill, decode_block: decode-block
        programs, failed); the expert cache's hits, misses, hit rate, fetched, H2D bytes and
        extra copies (``Engine.counters``, since the engine was built); with a prefix cache its chunks hit,
        missed, stored, evicted and skipped, bytes loaded and stored."""
        c = self._counts
        m = {"requests_submitted": c["requests_submitted"], "requests_running": self.running,
             "requests_waiting": self.waiting,
             "requests_finished": sum(c[f"requests_finished_{r}"] for r in FINISH_REASONS),
             **{f"requests_finished_{r}": c[f"requests_finished_{r}"] for r in FINISH_REASONS},
             "prompt_tokens": c["prompt_tokens"], "cached_tokens": c["cached_tokens"],
             "tokens_generated": c["tokens_generated"], "steps": c["steps"],
             **{f"engine_calls_{k}": c[f"engine_calls_{k}"]
                for k in ("prefill", "mixed", "decode", "decode_block", "failed")}}
        eng = self.engine
        total = eng.counters["prefill"] + eng.counters["decode"]
        ec = total.summary(eng.model.expert_bytes)
        m.update({f"expert_cache_{k}": ec[k] for k in ("hits", "misses", "hit_rate", "fetched", "cpu_computed",
                                                         "bytes_h2d", "d2d_copies", "bytes_d2d",
                                                         "routed_hit_rate", "lookup_hit_rate", "prefetch_copies",
                                                         "prefetch_used")})
        m["expert_cache_extra_copies"] = int(total.extra_copies)
        if self.kv_manager is not None:
            kv = self.kv_manager.metrics()
            m.update({f"kv_{k}": kv[k] for k in ("chunks_hit", "chunks_missed", "chunks_stored", "chunks_evicted",
                                                 "chunks_skipped", "bytes_loaded", "bytes_stored", "bytes_in_use")})
        return m

    # ---- compile outside the first request's time ------------------------------------------------------
    def _warm_sampler(self) -> None:
        """Compiles the row sampler for this batch (committed device logits, as the engine returns them)."""
        b, v = self.max_batch, self.engine.cfg.vocab_size
        logits = memory.to_device(np.zeros((b, v), np.float32))
        for all_greedy in (True, False):  # the one-step draw's two programs (_dispatch_sample)
            out = sample_rows_next(logits, np.zeros((b, 2), np.uint32), np.zeros(b, np.float32),
                                   np.ones(b, np.float32), np.zeros(b, np.int32), all_greedy=all_greedy)
            np.asarray(out[0])
