"""Continuous batching (``ftjax.serve.scheduler``) on the tiny preset: random weights, float32, the CPU.

The claim: batching changes when a request's tokens are computed, never what they are. Under greedy
decoding every request's tokens equal the same request run alone (``Engine.generate``, batch 1), and its
logits agree within float32 rounding (the calls' shapes differ: 1e-5 of the largest |logit|), for
several arrival patterns (all at once, staggered, admitted while others decode: a prefill call and a decode
call a step, or one mixed call with ``mixed_calls=True``), batch sizes 1-3, prefill chunks of 4 and 16
tokens, and the experts resident, cached with S = E slots, or with 2E slots, where prefill calls of 4 tokens
or more stream whole layers. In bfloat16 a request decoded while another prefills is bit for bit itself
alone (a case that the mixed call flips), and a decode step leaves a prefilling row's state as it was. No
engine call compiles: a request's admission compiles what its calls need, mixed calls included. A prefix
reused on row 1 is bit-identical to recomputing the same calls with the plain decoder (the engine's calls
replayed through ``model.forward`` at the same batch, the stored rows copied in where the hook loads them; as
tests/test_kv_offload.py proves it for row 0). The hybrid family's reuse on row 1 (its linear states
written into that row) is tested in tests/test_hybrid.py.

Programs are shared: every engine uses the same shapes (prefill buckets of 16 tokens, S = 64).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_path, load_fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftjax import Engine, HostKVStore, PrefixCache
from ftjax import model as model_lib
from ftjax.checkpoint import load_tokenizer, random_model
from ftjax.config import EngineConfig, KVOffloadConfig, preset
from ftjax.experts import offload
from ftjax.experts.state import init_expert_state
from ftjax.kv.layerwise import HookRow
from ftjax.runtime.step import RowSampling
from ftjax.sampling import SamplingDefaults
from ftjax.serve import QueueFull, SamplingParams, Scheduler
from ftjax.serve import text as text_lib
from ftjax.serve.text import StopChecker

S = 64  # cache length
C = 16  # tokens per stored KV chunk
N = 5   # tokens per request
_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(0, 512, n).tolist() for n in (6, 3, 9)]
SHARED = _rng.integers(0, 512, 2 * C).tolist()  # a prefix of two full chunks


@functools.lru_cache(maxsize=None)
def _model():
    return random_model(preset("tiny"), "float32")


def _engine(mode: str = "resident", batch: int = 2, chunk: int = 16, model=None, block: int = 1,
            driver: str = "auto") -> Engine:
    """An engine for these tests; ``block``: its ``decode_block``, the scheduler's default (1: the one-step path,
    whose every call ``_drive`` sees; the decode-block tests are at the end); ``driver``: its prefill driver."""
    model = model or _model()
    e = model.cfg.num_experts
    slots = {"resident": None, "cached": e, "stream": 2 * e}[mode]
    # "stream": 2E slots, prefill "auto": a call streams whole layers when it has >= E / top_k = 4 tokens, so
    # whether a chunk streams can depend on the decoding rows that join it (precompile(mixed=True) covers it)
    return Engine(model, EngineConfig("resident" if mode == "resident" else "cached", num_slots=slots, max_seq_len=S,
                                      batch=batch, prefill_chunk=chunk, decode_block=block, prefill_driver=driver))


@functools.lru_cache(maxsize=None)
def _alone(prompt: tuple, n: int = N):
    """(tokens, logits float32 [n, V]) of ``prompt`` run alone: Engine.generate, batch 1, greedy."""
    res = _engine(batch=1).generate([list(prompt)], n, keep_logits=True)
    return res.generated_ids[0], res.step_logits[:, 0]


def _drive(sched: Scheduler, arrivals: dict, limit: int = 200):
    """Runs ``sched`` until it has no work, submitting ``arrivals`` {step: [(id, prompt, params)]} before that
    step; checks that no engine call compiles. Returns (events by id, the logits each request was sampled
    from, by id)."""
    eng = sched.engine
    events, logits = collections.defaultdict(list), collections.defaultdict(list)
    advance = eng.advance
    compiling = []  # the kinds of the engine calls that compiled (an assert in here would become an error event)

    def capture(*args, **kw):
        compiled = eng.compile_s
        adv = advance(*args, **kw)
        if eng.compile_s != compiled:
            compiling.append(adv.kind)
        lg = np.asarray(adv.logits)
        for i in adv.rows:
            if sched._rows[i] is not None:
                logits[sched._rows[i].id].append(lg[i])
        return adv

    eng.advance = capture
    try:
        step = 0
        while step <= max(arrivals, default=0) or sched.has_work():
            for rid, prompt, params in arrivals.get(step, ()):
                sched.submit(prompt, params, rid)
            for ev in sched.step():
                events[ev.request_id].append(ev)
            step += 1
            assert step < limit
    finally:
        del eng.advance
    assert not compiling, f"engine calls compiled: {compiling}"  # admission compiled them all (mixed ones too)
    return events, logits


def _tokens(evs) -> list[int]:
    return [e.token_id for e in evs if e.token_id is not None]


def _assert_alone(events, logits, rid, prompt, n=N):
    want, want_logits = _alone(tuple(prompt), n)
    assert _tokens(events[rid]) == want, rid
    assert events[rid][-1].finished and events[rid][-1].finish_reason == "length"
    got = np.stack(logits[rid])
    # run-ahead: the step dispatched before the last token was read ran too (its token dropped)
    assert len(got) in (n, n + 1), len(got)
    np.testing.assert_allclose(got[:n], want_logits, rtol=0, atol=1e-5 * float(np.abs(want_logits).max()))


PATTERNS = {"together": (0, 0, 0), "staggered": (0, 1, 2), "while_decoding": (0, 4, 6)}


_slow = pytest.mark.slow  # resident at batch 2 and at chunks of 16 with batch 3: between the cases that run by default


@pytest.mark.parametrize("mode,batch,chunk,mixed", [
    ("resident", 1, 16, False), pytest.param("resident", 2, 4, False, marks=_slow),
    pytest.param("resident", 2, 16, False, marks=_slow), ("resident", 3, 4, False),
    pytest.param("resident", 3, 16, False, marks=_slow), ("cached", 3, 4, False), ("stream", 2, 4, False),
    ("resident", 3, 4, True), ("stream", 2, 4, True)])
def test_greedy_tokens_and_logits_equal_each_request_alone(mode, batch, chunk, mixed):
    eng = _engine(mode, batch, chunk)
    sched = Scheduler(eng, mixed_calls=mixed)
    for name, steps in PATTERNS.items():
        arrivals = collections.defaultdict(list)
        for j, step in enumerate(steps):
            arrivals[step].append((f"{name}{j}", PROMPTS[j], SamplingParams(max_tokens=N)))
        before = sched.metrics()
        events, logits = _drive(sched, arrivals)
        for j in range(3):
            _assert_alone(events, logits, f"{name}{j}", PROMPTS[j])
        m = sched.metrics()
        if batch > 1 and name == "while_decoding":  # admitted while another decodes: a mixed call, or not
            assert (m["engine_calls_mixed"] > before["engine_calls_mixed"]) == mixed
    assert m["requests_finished_length"] == 9 and m["tokens_generated"] == 9 * N and m["requests_running"] == 0
    if mode == "stream":  # some prefill calls streamed whole layers (one extra layer copied per call)
        assert m["expert_cache_extra_copies"] > 0
    if mode == "cached":
        assert m["expert_cache_misses"] > 0 and m["expert_cache_bytes_h2d"] > 0


def test_admission_compiles_the_mixed_call_that_streams():
    """On 2E slots a prefill call streams whole layers from E / top_k = 4 tokens: a 3-token prompt alone does
    not, but admitted while another row decodes, its call has 4 tokens and streams. Admission compiled that
    program too (``_drive`` checks that no engine call compiles; batch 3: programs no other test made)."""
    e = _model().cfg.num_experts
    sched = Scheduler(_engine("stream", 3, 4), mixed_calls=True)
    y = PROMPTS[1][::-1]
    events, logits = _drive(sched, {0: [("x", PROMPTS[1], SamplingParams(max_tokens=N))],
                                    2: [("y", y, SamplingParams(max_tokens=N))]})
    m = sched.metrics()
    assert m["engine_calls_mixed"] == 1 and m["expert_cache_extra_copies"] == e  # one streamed call: the mixed one
    _assert_alone(events, logits, "x", PROMPTS[1])
    _assert_alone(events, logits, "y", y)


# ---- a decoding row's token from the decode program while another row prefills ------------------------------
def test_bfloat16_request_decoded_while_another_prefills_is_bit_identical_to_it_alone():
    """bfloat16, where the prefill program rounds differently from the decode program: A decodes while B's
    24-token prompt prefills in 6 chunks of 4. Each step runs B's chunk in a prefill call (A idle) and A's token
    in the decode program (B idle), so A's tokens and logits are bit for bit those of A alone in the same
    scheduler. The case was found by search (the tiny preset at seed 2, prompts of ``default_rng(110)``; 1 in
    900 such trials): with ``mixed_calls=True`` A's 7th token takes B's prefill call and flips (a near-tie one
    bfloat16 step apart)."""
    model = random_model(preset("tiny"), "bfloat16", seed=2)
    rng = np.random.default_rng(110)
    a, b = rng.integers(0, 512, 3).tolist(), rng.integers(0, 512, 24).tolist()
    sched = Scheduler(_engine("resident", 2, 4, model=model))
    alone, alone_logits = _drive(sched, {0: [("A", a, SamplingParams(max_tokens=8))]})
    before = sched.metrics()
    events, logits = _drive(sched, {0: [("A", a, SamplingParams(max_tokens=8))],
                                    1: [("B", b, SamplingParams(max_tokens=1))]})
    assert _tokens(events["A"]) == _tokens(alone["A"])
    np.testing.assert_array_equal(np.stack(logits["A"][:8]), np.stack(alone_logits["A"][:8]))
    m = sched.metrics()
    assert m["engine_calls_prefill"] - before["engine_calls_prefill"] == 1 + 6  # A's prompt, then B's 6 chunks
    assert m["engine_calls_mixed"] == 0 and m["engine_calls_decode"] - before["engine_calls_decode"] >= 7


@pytest.mark.parametrize("name,mode", [("tiny", "cached"), ("qwen3_5_moe_fp32", "resident")])
def test_decode_step_leaves_a_prefilling_row_as_it_was(name, mode):
    """``Engine.advance(tokens, mixed=False)`` while row 1 prefills a 15-token prompt (4 chunks of 4): each
    decode step of row 0 leaves row 1 bit for bit as it was -- its K/V rows except the one position its next
    chunk writes first, the Gated DeltaNet layers' conv and recurrent states (the hybrid fixture), its position
    and pending calls -- and routes none of its token (cached experts: no slot lookup, no LRU use, no stats).
    Each request's greedy tokens and logits are then bit for bit those of the request alone in its row of the
    same engine (the same programs)."""
    model = _model() if name == "tiny" else load_fixture(name)[0]
    v = model.cfg.vocab_size
    a, b, n = [t % v for t in PROMPTS[1]], [t % v for t in PROMPTS[2] + PROMPTS[0]], 8
    eng = _engine(mode, 2, 4, model=model)

    def take(adv, out):
        for i in adv.rows:
            lg = np.asarray(adv.logits)[i]
            out.setdefault(i, ([], []))[0].append(int(lg.argmax()))
            out[i][1].append(lg)

    def last(out):
        return np.array([[out[i][0][-1] if i in out else 0] for i in range(2)], np.int32)

    got = {}
    eng.open_rows(2)
    eng.admit(a, n)
    eng.precompile()
    take(eng.advance(), got)
    eng.admit(b, n)
    eng.precompile()
    while eng.prefilling():
        row, cache = eng.rows[1], jax.tree.map(lambda x: np.asarray(x)[:, 1].copy(), eng.cache)
        pos, pending = row.pos, list(row.pending)
        adv = eng.advance(last(got), mixed=False)
        assert adv.kind == "decode" and adv.rows == [0]
        after = jax.tree.map(lambda x: np.asarray(x)[:, 1], eng.cache)
        kept = np.arange(S) != pending[0].start  # the position its next chunk writes before anything reads it
        for k in ("k", "v"):
            np.testing.assert_array_equal(getattr(after, k)[:, kept], getattr(cache, k)[:, kept])
        assert (cache.conv is not None) == (name != "tiny")
        if cache.conv is not None:
            np.testing.assert_array_equal(after.conv, cache.conv)
            np.testing.assert_array_equal(after.rec, cache.rec)
        assert (row.pos, list(row.pending)) == (pos, pending) and eng.rows[0].pos == len(a) + len(got[0][0])
        routed = np.asarray(adv.stats.routed_ids).reshape(model.cfg.num_layers, 2, -1)
        assert (routed[:, 1] == -1).all() and (routed[:, 0] >= 0).all()
        take(adv, got)
        take(eng.advance(), got)  # row 1's next chunk, row 0 idle
    while len(got[1][0]) < n:
        take(eng.advance(last(got)), got)
    for i, p in enumerate((a, b)):  # each alone in its row of the same engine
        eng.open_rows(2)
        if i:
            eng.admit([0])
        assert eng.admit(p, n) == i
        if i:
            eng.release(0)
        solo = {}
        while len(solo.get(i, ((),))[0]) < n:
            take(eng.advance(last(solo) if solo else None), solo)
        assert got[i][0][:n] == solo[i][0][:n], i
        np.testing.assert_array_equal(np.stack(got[i][1][:n]), np.stack(solo[i][1][:n]))


def test_advance_refuses_a_decode_step_without_a_decoding_row():
    eng = _engine("resident", 2, 4)
    eng.open_rows(2)
    eng.admit(PROMPTS[0], N)
    with pytest.raises(ValueError, match="a decode step needs a row done prefilling"):
        eng.advance(np.zeros((2, 1), np.int32), mixed=False)
    assert eng.rows[0].pos == 0 and len(eng.rows[0].pending) == 2  # nothing ran
    while eng.prefilling():
        eng.advance()
    eng.admit(PROMPTS[1], N)  # row 1 prefills, row 0 decodes: tokens of another shape are refused, nothing run
    pos = eng.rows[0].pos
    with pytest.raises(ValueError, match=r"tokens must be int32 \[2, 1\]"):
        eng.advance(np.zeros((2, 3), np.int32), mixed=False)
    assert eng.rows[0].pos == pos and eng.advance(np.zeros((2, 1), np.int32), mixed=False).rows == [0]


# ---- prefix reuse on any row ------------------------------------------------------------------------
def _kv_manager(**kw) -> PrefixCache:
    return PrefixCache(HostKVStore(10**8), KVOffloadConfig(chunk_tokens=C, prefill_chunk=C, **kw))


@functools.lru_cache(maxsize=None)
def _plain_forward(cfg):
    def f(params, cache, state, tokens, start, valid):
        return model_lib.forward(params, cfg, tokens, start, valid, cache,
                                 offload.make_expert_fn("resident", cfg.num_experts), state)
    return jax.jit(f)


def _record_calls(eng: Engine) -> list:
    """Records every call ``eng`` runs (``eng._run``; ``del eng._run`` to stop): (tokens, start, valid, the KV
    hook's options, the prefix's chunks on the host, the logits)."""
    calls, run = [], eng._run

    def record(plan, tokens, start, valid, cache, prefix=()):
        out = run(plan, tokens, start, valid, cache, prefix)
        calls.append((np.array(tokens), np.array(start), np.array(valid), plan.opts.kv,
                      [np.asarray(c) for c in prefix], np.asarray(out.logits)))
        return out

    eng._run = record
    return calls


def _replay(calls: list, batch: int):
    """Replays ``calls`` (:func:`_record_calls`) through the plain decoder (no hook) at the same batch from a
    fresh cache, each hooked row's reused chunks copied into its own row where the hook loads them; every
    valid row's logits must be bit-identical to the engine's. Returns the cache after each call."""
    model = _model()
    cfg = model.cfg
    state = init_expert_state("resident", cfg.num_layers, cfg.num_experts, 0, model.banks, jnp.float32)
    cache = model_lib.init_kv_cache(cfg, batch, S, jnp.float32)
    caches = []
    for tokens, start, valid, kv, prefix, got in calls:
        if prefix:
            k, v = np.array(cache.k), np.array(cache.v)
            n = 0
            for part in kv.rows:
                if part.prefix_chunks:
                    chunks = np.concatenate(prefix[n:n + part.prefix_chunks], axis=2)  # [L, 2, n*C, Hkv, hd]
                    k[:, part.row, :chunks.shape[2]], v[:, part.row, :chunks.shape[2]] = chunks[:, 0], chunks[:, 1]
                    n += part.prefix_chunks
            cache = cache._replace(k=jnp.asarray(k), v=jnp.asarray(v))
        out = _plain_forward(cfg)(model.params, cache, state, jnp.asarray(tokens), jnp.asarray(start),
                                  jnp.asarray(valid))
        cache = out.cache
        caches.append(cache)
        for i in np.flatnonzero(valid):
            np.testing.assert_array_equal(got[i], np.asarray(out.logits)[i])
    return caches


@pytest.mark.parametrize("mixed", [False, True])
def test_prefix_reuse_on_row_1_is_bit_identical_to_recompute(mixed):
    eng, mgr = _engine("resident", 2, C), _kv_manager()
    sched = Scheduler(eng, kv_manager=mgr, mixed_calls=mixed)
    calls = _record_calls(eng)
    p = SHARED + [7, 8]
    b = SHARED + PROMPTS[0][:5]
    events, logits = _drive(sched, {0: [("P", p, SamplingParams(max_tokens=2))],
                                    4: [("A", PROMPTS[1], SamplingParams(max_tokens=N))],
                                    5: [("B", b, SamplingParams(max_tokens=3))]})
    del eng._run
    assert sched.stats("B").cached_tokens == 2 * C and sched.stats("P").cached_tokens == 0
    assert mgr.metrics()["chunks_hit"] == 2 and sched.metrics()["kv_chunks_stored"] == 2
    assert all(mgr.store.pin_count(k) == 0 for k in mgr.keys(eng, p)[:2])  # unpinned when prefill ended
    hook_calls = [c for c in calls if c[4]]
    assert len(hook_calls) == 1 and hook_calls[0][3].rows == (HookRow(1, 2, 0),)
    assert hook_calls[0][2].tolist() == [int(mixed), 5]  # row 0 decodes in the hook's call (mixed), or idles
    # every call replayed through the plain decoder at batch 2; the loaded rows copied into row 1 first
    cache = _replay(calls, 2)[-1]
    np.testing.assert_array_equal(np.asarray(eng.cache.k)[:, 1, :len(b) + 2], np.asarray(cache.k)[:, 1, :len(b) + 2])
    assert _tokens(events["B"]) == _alone(tuple(b), 3)[0]


@pytest.mark.parametrize("driver", ["scan", "pipelined"])
def test_requests_storing_and_reusing_kv_prefill_together(driver):
    """With the KV store on, three requests arriving together are prefilled in the same calls (as many calls as
    the longest prompt has chunks, not one request per call): in round 1 each row stores its own new full
    chunks, in round 2 (the round-1 prompts extended) each loads its own reused prefix and stores its new
    chunk, all rows in one call. Each request's tokens equal its run alone and its logits agree within
    float32 rounding; every call is bit-identical to the plain decoder with the reused rows copied in; the
    chunks stored are the ones each row would store alone, bit for bit what the cache holds; no pin lingers.
    On the layer scan and on the layer-pipelined driver (each layer's prefix slices split among the rows)."""
    eng, mgr = _engine("resident", 3, C, driver=driver), _kv_manager()
    sched = Scheduler(eng, kv_manager=mgr)
    rng = np.random.default_rng(7)
    first = [rng.integers(0, 512, n).tolist() for n in (2 * C + 3, C + 5, 2 * C + 9)]  # 3, 2, 3 calls of C
    second = [p + rng.integers(0, 512, C + 2).tolist() for p in first]  # 2 calls each, after the reused chunks
    stored, hit = 0, 0
    for name, prompts, reused, new in (("r1", first, (0, 0, 0), (2, 1, 2)), ("r2", second, (2, 1, 2), (1, 1, 1))):
        calls = _record_calls(eng)
        before = sched.metrics()
        events, logits = _drive(sched, {0: [(f"{name}{j}", p, SamplingParams(max_tokens=N))
                                            for j, p in enumerate(prompts)]})
        del eng._run
        m = sched.metrics()
        prefill_calls = [c for c in calls if c[0].shape[1] > 1]
        assert len(prefill_calls) == m["engine_calls_prefill"] + m["engine_calls_mixed"] - (
            before["engine_calls_prefill"] + before["engine_calls_mixed"]) == (3 if name == "r1" else 2)
        head = prefill_calls[0]
        assert head[2].tolist() == [C, C, C]  # every row's first chunk in one call
        assert head[3].rows == tuple(HookRow(j, n, 1) for j, n in enumerate(reused))
        assert len(head[4]) == sum(reused)
        for j, p in enumerate(prompts):
            _assert_alone(events, logits, f"{name}{j}", p)
            assert sched.stats(f"{name}{j}").cached_tokens == reused[j] * C
        stored, hit = stored + sum(new), hit + sum(reused)
        assert m["kv_chunks_stored"] == mgr.metrics()["chunks_stored"] == stored and m["kv_chunks_hit"] == hit
        assert mgr.store.stats.num_pinned == 0
        caches = _replay(calls, 3)
        n_stored = 0
        for (tokens, start, valid, kv, prefix, got), cache in zip(calls, caches):  # stored: the cache rows, bit for bit
            for part in kv.rows if kv is not None else ():
                keys = mgr.keys(eng, prompts[part.row])  # row j holds request j
                for ci in range(start[part.row] // C, start[part.row] // C + part.store_chunks):
                    chunk = np.asarray(mgr.store.get([keys[ci]])[0])
                    np.testing.assert_array_equal(chunk[:, 0], np.asarray(cache.k)[:, part.row, ci * C:(ci + 1) * C])
                    np.testing.assert_array_equal(chunk[:, 1], np.asarray(cache.v)[:, part.row, ci * C:(ci + 1) * C])
                    n_stored += 1
        assert n_stored == sum(new)
    assert eng.prefill_driver_calls[driver] == 3 + 2  # every prefill call ran on the driver asked for


def _stored_prefix(sched: Scheduler) -> None:
    """Runs a request that stores SHARED's two chunks."""
    _drive(sched, {0: [("store", SHARED + [1], SamplingParams(max_tokens=1))]})


def test_cancel_frees_the_row_and_the_pins():
    eng, mgr = _engine("resident", 2, C), _kv_manager()
    sched = Scheduler(eng, kv_manager=mgr)
    _stored_prefix(sched)
    keys = mgr.keys(eng, SHARED)
    a, b = SHARED + PROMPTS[1], SHARED + PROMPTS[2] + PROMPTS[0] + PROMPTS[1][:2]  # B: 17 tokens after the reuse
    sched.submit(a, SamplingParams(max_tokens=N), "A")
    sched.submit(b, SamplingParams(max_tokens=N), "B")
    sched.submit(PROMPTS[2], SamplingParams(max_tokens=N), "W")  # waits: both rows busy
    assert [mgr.store.pin_count(k) for k in keys] == [0, 0]
    first = sched.step()  # both admitted, pinned and prefilled in one call; A's prefill ends, B's has a call left
    assert [e.request_id for e in first] == ["A"] and eng.rows[1].pos == 3 * C and eng.rows[1].prefilling
    assert [mgr.store.pin_count(k) for k in keys] == [1, 1]  # A's prefill ended (unpinned), B's pins held
    sched.cancel("B")
    assert eng.rows[1] is None and sched.running == 1 and [mgr.store.pin_count(k) for k in keys] == [0, 0]
    sched.cancel("W")  # a waiting request
    assert sched.waiting == 0
    sched.cancel("nobody")  # unknown: nothing
    events, logits = _drive(sched, {0: [("C", PROMPTS[0], SamplingParams(max_tokens=N))]})
    ends = {rid: evs[-1] for rid, evs in events.items()}
    assert ends["B"].finish_reason == "cancelled" and ends["B"].token_id is None and ends["B"].finished
    assert ends["W"].finish_reason == "cancelled" and sched.stats("W").completion_tokens == 0
    assert _tokens(first + events["A"]) == _alone(tuple(a))[0]
    _assert_alone(events, logits, "C", PROMPTS[0])
    sched.cancel("A")  # finished: nothing
    # a running request cancelled while decoding
    sched.submit(PROMPTS[1], SamplingParams(max_tokens=N), "D")
    got = sched.step() + sched.step()  # the prefill's token; the decode step runs ahead, its token unread
    assert [e.token_id is not None for e in got] == [True] and sched.has_work()
    sched.cancel("D")
    assert sched.running == 0 and sched.step()[0].finish_reason == "cancelled" and not sched.has_work()
    assert sched.stats("D").completion_tokens == 1 and sched.metrics()["requests_finished_cancelled"] == 3


def test_failures_end_their_requests_and_release_the_pins():
    eng, mgr = _engine("resident", 2, C), _kv_manager()
    sched = Scheduler(eng, kv_manager=mgr)
    _stored_prefix(sched)
    keys = mgr.keys(eng, SHARED)
    # the shared call fails: every running request ends with an error, pins released, fresh rows
    sched.submit(PROMPTS[1], SamplingParams(max_tokens=N), "A")
    sched.step()
    sched.submit(SHARED + PROMPTS[0][:3], SamplingParams(max_tokens=N), "B")

    def boom(*args, **kw):
        raise RuntimeError("device fell over")

    eng._run = boom
    events = sched.step()
    del eng._run
    assert sorted((e.request_id, e.finish_reason, e.token_id) for e in events) == [("A", "error", None),
                                                                                  ("B", "error", None)]
    assert "device fell over" in events[0].error and sched.running == 0
    assert [mgr.store.pin_count(k) for k in keys] == [0, 0] and sched.metrics()["engine_calls_failed"] == 1
    # one request's own work fails (storing its new chunks; its stop strings): it alone ends
    store_new = mgr._store_new

    def failing_store(req, outs):
        if req.keys:  # a request with full chunks to store
            raise OSError("store full of bees")
        return store_new(req, outs)

    def detok(ids):
        raise UnicodeError("cannot decode")

    sched.detokenize, mgr._store_new = detok, failing_store
    new = _rng.integers(0, 512, C + 2).tolist()  # a full new chunk to store
    events, logits = _drive(sched, {0: [("S", new, SamplingParams(max_tokens=N)),
                                        ("T", PROMPTS[2], SamplingParams(max_tokens=N, stop=("x",)))]})
    mgr._store_new = store_new
    assert events["S"][-1].finish_reason == "error" and "bees" in events["S"][-1].error
    assert events["T"][-1].finish_reason == "error" and "cannot decode" in events["T"][-1].error
    assert mgr.store.stats.num_pinned == 0
    events, logits = _drive(sched, {0: [("U", PROMPTS[0], SamplingParams(max_tokens=N))]})  # still usable
    _assert_alone(events, logits, "U", PROMPTS[0])


# ---- sampling -----------------------------------------------------------------------------------------
def test_seeds_reproduce_in_any_batch_and_top_k_1_is_greedy():
    sched = Scheduler(_engine("resident", 3, 4))
    sampled = SamplingParams(max_tokens=N, temperature=1.0, top_p=0.95, top_k=40, seed=7)
    alone, _ = _drive(sched, {0: [("x", PROMPTS[0], sampled)]})
    events, _ = _drive(sched, {0: [("a", PROMPTS[2], dataclasses.replace(sampled, seed=1))],
                               1: [("x", PROMPTS[0], sampled), ("y", PROMPTS[0], sampled)],
                               2: [("z", PROMPTS[0], dataclasses.replace(sampled, seed=8))]})
    assert _tokens(events["x"]) == _tokens(events["y"]) == _tokens(alone["x"])
    assert _tokens(events["z"]) != _tokens(events["x"])
    assert _tokens(alone["x"]) != _alone(tuple(PROMPTS[0]))[0]  # it did sample
    greedy, _ = _drive(sched, {0: [("k", PROMPTS[0], SamplingParams(max_tokens=N, temperature=1.0, top_k=1, seed=3,
                                                                      logprobs=True))]})
    assert _tokens(greedy["k"]) == _alone(tuple(PROMPTS[0]))[0]
    logprobs = [e.logprob for e in greedy["k"]]
    want = jax.nn.log_softmax(jnp.asarray(_alone(tuple(PROMPTS[0]))[1]), axis=-1)
    np.testing.assert_allclose(logprobs, [float(want[i, t]) for i, t in enumerate(_tokens(greedy["k"]))], atol=1e-4)
    assert all(e.logprob is None for e in events["x"])


def test_run_ahead_feeds_the_device_tokens_and_changes_no_token():
    """Run-ahead dispatches decode steps fed with the tokens sampled on the device (not read back first), and
    every request's tokens and stop reasons equal those of a scheduler that reads each step's tokens before
    the next, its logprobs within float32 rounding (sampled and greedy requests, staggered arrivals, a stop id,
    a queue)."""
    stop = _alone(tuple(PROMPTS[1]))[0][2]  # greedy B stops on its third token
    arrivals = {0: [("a", PROMPTS[0], SamplingParams(max_tokens=N, temperature=1.0, seed=3, logprobs=True)),
                    ("b", PROMPTS[1], SamplingParams(max_tokens=N, stop_token_ids=(stop,)))],
                2: [("c", PROMPTS[2], SamplingParams(max_tokens=N + 2, temperature=0.7, top_k=5, seed=4))],
                3: [("d", PROMPTS[0], SamplingParams(max_tokens=2))]}
    out = {}
    for ahead in (False, True):
        sched = Scheduler(_engine("resident", 2, 4), run_ahead=ahead)
        advance, fed = sched.engine.advance, []

        def spy(tokens=None, **kw):
            fed.append(isinstance(tokens, jax.Array))
            return advance(tokens, **kw)

        sched.engine.advance = spy
        events, _ = _drive(sched, arrivals)
        out[ahead] = {rid: [(e.token_id, e.finish_reason, e.logprob) for e in evs] for rid, evs in events.items()}
        assert any(fed) == ahead and sched.running == 0 and not sched.has_work()
    # tokens and stop reasons equal; logprobs within float32 rounding (the two runs' programs differ: one
    # takes its tokens from the host, one from the device)
    strip = lambda o: {rid: [e[:2] for e in evs] for rid, evs in o.items()}  # noqa: E731
    assert strip(out[True]) == strip(out[False])
    np.testing.assert_allclose([e[2] for e in out[True]["a"]], [e[2] for e in out[False]["a"]], rtol=1e-6)
    assert out[True]["b"][-1][:2] == (stop, "stop") and len(out[True]["c"]) == N + 2


def test_run_ahead_reads_each_step_only_after_dispatching_the_next():
    """With run-ahead, nothing of a decode step is read on the host before the next step is dispatched: its
    expert stats are counted when its tokens are read (counting them at dispatch waits for the step, and the
    device would never run ahead), and every decode step is counted once (the one run ahead past the last
    token too: it moved the slot table)."""
    eng = _engine("cached", 1, 16)
    sched = Scheduler(eng)
    advance, add, log = eng.advance, eng.counters["decode"].add, []

    def spy_advance(tokens=None, **kw):
        adv = advance(tokens, **kw)
        log.append(("advance", adv.kind, adv.stats))  # the objects kept: compared by identity
        return adv

    def spy_add(stats):
        log.append(("add", None, stats))
        return add(stats)

    eng.advance, eng.counters["decode"].add = spy_advance, spy_add
    sched.submit(PROMPTS[0], SamplingParams(max_tokens=N))
    while sched.has_work():
        sched.step()
    adds = [i for i, e in enumerate(log) if e[0] == "add"]
    decodes = [i for i, e in enumerate(log) if e[1] == "decode"]
    assert len(adds) == len(decodes) >= N - 1
    assert {id(log[i][2]) for i in adds} == {id(log[i][2]) for i in decodes}  # each step once
    for i in adds[:-1]:  # every step's stats but the last are read after the next step's dispatch
        latest = max(j for j in decodes if j < i)
        assert log[i][2] is not log[latest][2], [e[:2] for e in log]


def test_generation_config_defaults_applied_and_overridden():
    greedy = _alone(tuple(PROMPTS[0]))[0]
    model = dataclasses.replace(_model(), sampling_defaults=SamplingDefaults(do_sample=True, temperature=1.0, top_k=1))
    sched = Scheduler(_engine("resident", 2, 4, model=model))
    events, _ = _drive(sched, {0: [("default", PROMPTS[0], SamplingParams(max_tokens=N, seed=5)),  # top_k 1: greedy
                                   ("override", PROMPTS[0], SamplingParams(max_tokens=N, seed=5, top_k=0))]})
    assert _tokens(events["default"]) == greedy and _tokens(events["override"]) != greedy
    model = dataclasses.replace(_model(), sampling_defaults=SamplingDefaults(do_sample=False, temperature=3.0))
    sched = Scheduler(_engine("resident", 2, 4, model=model))
    events, _ = _drive(sched, {0: [("default", PROMPTS[0], SamplingParams(max_tokens=N, seed=5)),  # do_sample false
                                   ("override", PROMPTS[0], SamplingParams(max_tokens=N, seed=5, temperature=3.0))]})
    assert _tokens(events["default"]) == greedy and _tokens(events["override"]) != greedy
    r = SamplingDefaults(do_sample=True, temperature=0.6, top_p=0.95, top_k=20).resolve(top_k=0)
    assert (r.temperature, r.top_p, r.top_k) == (0.6, 0.95, 0)
    assert r.from_checkpoint == ("do_sample", "temperature", "top_p") and r.overridden == ("top_k",)
    assert "overridden: top_k" in r.describe()
    assert SamplingDefaults().resolve().describe().startswith("sampling: greedy (no sampling defaults")


def test_stop_tokens_stop_strings_and_submit_errors():
    eng = _engine("resident", 2, 4)
    want = _alone(tuple(PROMPTS[0]))[0]
    with pytest.raises(ValueError, match="detokenize"):
        Scheduler(eng).submit([1], SamplingParams(stop=("a",)))
    sched = Scheduler(eng, max_waiting=2, detokenize=lambda ids: "".join(f"<{t}>" for t in ids))
    events, _ = _drive(sched, {0: [("t", PROMPTS[0], SamplingParams(max_tokens=N, stop_token_ids=(want[1],))),
                                   ("s", PROMPTS[0], SamplingParams(max_tokens=N, stop=(f"<{want[2]}>",)))]})
    assert _tokens(events["t"]) == want[:want.index(want[1]) + 1] and events["t"][-1].finish_reason == "stop"
    assert _tokens(events["s"]) == want[:want.index(want[2]) + 1] and events["s"][-1].finish_reason == "stop"
    for prompt, params, match in [
            ([], SamplingParams(), "empty"), ([1, 512], SamplingParams(), "outside the vocabulary"),
            ([1.5], SamplingParams(), "integers"), ([1] * 60, SamplingParams(max_tokens=5), "exceeds the context"),
            ([1], SamplingParams(max_tokens=0), "max_tokens"), ([1], SamplingParams(temperature=-1.0), "temperature"),
            ([1], SamplingParams(top_p=0.0), "top_p"), ([1], SamplingParams(top_k=-1), "top_k"),
            ([1], SamplingParams(seed=-1), "seed"), ([1], SamplingParams(stop=("",)), "stop")]:
        with pytest.raises(ValueError, match=match):
            sched.submit(prompt, params)
    sched.submit([1, 2], SamplingParams(max_tokens=1), "q")
    with pytest.raises(ValueError, match="already in use"):
        sched.submit([1, 2], SamplingParams(), "q")
    # a burst between two steps: the free rows take their share at the next step, max_waiting (2) more wait
    rows = sched.max_batch
    for _ in range(rows + 2 - 1):  # "q" was the first
        sched.submit([1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFull, match=f"{rows + 2} requests already wait for {rows} free rows"):
        sched.submit([1, 2], SamplingParams())
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(eng, max_batch=3)



# ---- stop strings: bounded work per token, the old answers -------------------------------------------------
@functools.lru_cache(maxsize=None)
def _fixture_tokenizer():
    """The byte-level tokenizer of the ``qwen3_moe_fp32`` fixture (384 tokens: multi-byte characters are split
    across byte tokens)."""
    return load_tokenizer(fixture_path("qwen3_moe_fp32"))


def _old_stop_index(detokenize, ids: list[int], stop) -> int | None:
    """The token at which the scheduler's former check ended a request: the first i with a stop string in
    ``detokenize(ids[:i + 1])`` (the whole completion decoded and searched at every token); None if none."""
    for i in range(len(ids)):
        text = detokenize(ids[:i + 1])
        if any(s in text for s in stop):
            return i
    return None


def test_stop_strings_end_requests_at_the_token_the_whole_text_check_did():
    """The scheduler's stop strings end every request at the same token as decoding and searching the whole
    completion at each token (its former check): a stop string that ends with a multi-byte character (xé: é is
    two byte tokens), one that begins with one (你a: 你 is three), one of ASCII over three tokens, one never
    found; with and without run-ahead, four requests in two rows. The detokenizer is the fixture's byte-level
    tokenizer on the tiny model's ids (mod its 384 tokens: stray bytes decode to U+FFFD), with the ids at some
    positions of the free-running (sampled) completions mapped to the stop strings' tokens."""
    tok = _fixture_tokenizer()
    vocab = tok.get_vocab_size()
    planted: dict[int, int] = {}
    detok = lambda ids: tok.decode([planted.get(t, t % vocab) for t in ids])  # noqa: E731
    sched = Scheduler(_engine("resident", 2, 4), detokenize=detok)
    n = 40
    params = {rid: SamplingParams(max_tokens=n, temperature=1.0, seed=seed)
              for rid, seed in (("e", 11), ("ni", 12), ("ascii", 13), ("none", 14))}
    free, _ = _drive(sched, {0: [(rid, PROMPTS[j % 3], p) for j, (rid, p) in enumerate(params.items())]})
    ids = {rid: _tokens(free[rid]) for rid in params}
    assert all(len(v) == n for v in ids.values())
    # plant the pieces' bytes at positions 20.. of each completion (ids seen nowhere else planted)
    pieces = {"e": ["x", "é"], "ni": ["你", "a"], "ascii": ["q", ".", "z"]}
    for rid, chars in pieces.items():
        piece = [t for c in chars for t in tok.encode(c).ids]
        k = next(k for k in range(20, n - len(piece)) if len(set(ids[rid][k:k + len(piece)])) == len(piece)
                 and not set(ids[rid][k:k + len(piece)]) & set(planted))
        planted.update(zip(ids[rid][k:k + len(piece)], piece))
    # xé ends with a multi-byte character (found once its second byte comes), 你a begins with one
    stops = {rid: ("".join(chars), "\u2603\u2603") for rid, chars in pieces.items()}
    stops["none"] = ("\u2603never",)
    want = {rid: _old_stop_index(detok, ids[rid], stops[rid]) for rid in params}
    assert want["none"] is None
    for rid in ("e", "ni", "ascii"):  # found before the end, spanning tokens (not in the last token's text)
        assert want[rid] is not None and want[rid] < n - 1
        assert not any(s in detok(ids[rid][want[rid]:want[rid] + 1]) for s in stops[rid]), (rid, stops[rid])
    for run_ahead in (True, False):
        sched.run_ahead = run_ahead
        arrivals = {0: [(rid, PROMPTS[j % 3], dataclasses.replace(p, stop=stops[rid]))
                        for j, (rid, p) in enumerate(params.items())]}
        events, _ = _drive(sched, arrivals)
        for rid in params:
            got = _tokens(events[rid])
            if want[rid] is None:
                assert got == ids[rid] and events[rid][-1].finish_reason == "length"
            else:
                assert got == ids[rid][:want[rid] + 1], (rid, stops[rid])
                assert events[rid][-1].finish_reason == "stop"


@st.composite
def _stop_cases(draw):
    """(ids, stop strings, window): ids of the fixture tokenizer (text with multi-byte characters, encoded, some
    ids replaced by random ones: stray bytes), stop strings cut from their text (so many are found, some
    beginning with a multi-byte character or with U+FFFD) or drawn from an alphabet of its characters."""
    tok = _fixture_tokenizer()
    text = draw(st.text(st.sampled_from(list("ab c.é你好🙂\n")), min_size=1, max_size=40))
    ids = tok.encode(text).ids
    ids = [draw(st.integers(0, tok.get_vocab_size() - 1)) if draw(st.integers(0, 9)) == 0 else t for t in ids]
    ids += draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=8))
    full = tok.decode(ids)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if full and draw(st.booleans()):
            i = draw(st.integers(0, len(full) - 1))
            stops.append(full[i:i + draw(st.integers(1, 5))])
        else:
            stops.append(draw(st.text(st.sampled_from(list("ab c.é你好🙂\n\ufffd")), min_size=1, max_size=4)))
    return ids, stops, draw(st.sampled_from([1, 2, 3, 16]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stop_cases())
def test_stop_checker_equals_searching_the_whole_text(case):
    """StopChecker (the scheduler's stop-string check) answers, token after token until it finds one, what
    searching the whole decoded text answers, for random ids of the byte-level fixture tokenizer (characters
    split across tokens, stray bytes) and stop strings that span tokens or begin with a multi-byte character,
    with decode windows of 1 to 16 ids."""
    ids, stops, window = case
    tok = _fixture_tokenizer()
    checker = StopChecker(tok.decode, stops, window=window)
    for i, t in enumerate(ids):
        want = any(s in tok.decode(ids[:i + 1]) for s in stops)
        assert checker.add(t) == want, (ids[:i + 1], stops, window)
        if want:
            break


def test_stop_checks_decode_and_search_a_bounded_window_per_token(monkeypatch):
    """Per token, the scheduler's stop check decodes at most 3 * WINDOW ids (the window, and the next window's
    start when it moves on) and searches a tail of the text of at most WINDOW tokens and the longest stop
    string, however long the completion: the ids decoded and the text searched at each step stay below a
    constant as the generation grows (the former check decoded and searched the whole completion)."""
    window = 4
    monkeypatch.setattr(text_lib, "WINDOW", window)
    calls: list[int] = []  # ids per decode call, since the last step
    searched: list[int] = []  # characters of the text the stop strings were searched in, since the last step
    add = text_lib.IncrementalDecoder.add

    def spy_add(self, token_id):
        tail, base = add(self, token_id)
        searched.append(len(tail))
        return tail, base

    monkeypatch.setattr(text_lib.IncrementalDecoder, "add", spy_add)
    detok = lambda ids: (calls.append(len(ids)), "".join(f"<{t}>" for t in ids))[1]  # noqa: E731
    sched = Scheduler(_engine("resident", 2, 4), detokenize=detok)
    n = S - len(PROMPTS[1])
    stop = "<never>"
    sched.submit(PROMPTS[1], SamplingParams(max_tokens=n, temperature=1.0, seed=5, stop=(stop,)), "long")
    per_step, tails, tokens = [], [], []
    while sched.has_work():
        calls.clear()
        searched.clear()
        tokens += [e.token_id for e in sched.step() if e.token_id is not None]
        per_step.append(sum(calls))
        tails += searched
    assert len(tokens) == n
    text = "".join(f"<{t}>" for t in tokens)
    assert max(per_step) <= 3 * window < n, per_step
    # each token's text is at most 5 characters ("<511>"): a window of tokens and a stop string's worth
    assert len(tails) == n and max(tails) <= 5 * 2 * window + len(stop) < len(text), tails


# ---- decode blocks ----------------------------------------------------------------------------------
K = 4  # decode steps per block (every block test: one program, batch 3)
_DETOK = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731


def _events(sched: Scheduler, arrivals: dict) -> dict:
    """{id: [(token, finish_reason)]} of ``_drive``."""
    events, _ = _drive(sched, arrivals)
    return {rid: [(e.token_id, e.finish_reason) for e in evs] for rid, evs in events.items()}


def test_decode_blocks_give_the_one_step_tokens_and_greedy_ones_equal_each_request_alone():
    """Blocks of K steps against the one-step path (decode_block=1, run-ahead), on the same staggered arrivals:
    greedy rows and rows sampled with their own seeds, temperatures, top-p and top-k in one batch (the block's
    draw is per row), requests admitted between blocks and one waiting for a row, max_tokens 7, 9, 6, 3, 5 (no
    multiple of K). Every request's tokens, finish reasons and usage are equal, each token counted once; the
    greedy ones are the request's tokens run alone; logprobs agree within float32 rounding."""
    sampled = SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=5, logprobs=True)
    arrivals = {0: [("g0", PROMPTS[0], SamplingParams(max_tokens=7)), ("s0", PROMPTS[1], sampled)],
                3: [("g1", PROMPTS[2], SamplingParams(max_tokens=6))],
                4: [("s1", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=2)),
                    ("g2", PROMPTS[1], SamplingParams(max_tokens=5))]}
    out, metrics, logprobs, stats = {}, {}, {}, {}
    for block in (1, K):
        sched = Scheduler(_engine("resident", 3, 4, block=K), decode_block=block)
        events, _ = _drive(sched, arrivals)
        out[block] = {rid: [(e.token_id, e.finish_reason) for e in evs] for rid, evs in events.items()}
        logprobs[block] = [e.logprob for e in events["s0"]]
        metrics[block] = sched.metrics()
        stats[block] = {rid: dataclasses.astuple(sched.stats(rid))[:3] for rid in out[block]}
        assert all(len(sched.stats(rid).tpot_s) == stats[block][rid][1] - 1 for rid in out[block])
    assert out[K] == out[1] and stats[K] == stats[1]
    np.testing.assert_allclose(logprobs[K], logprobs[1], rtol=1e-6)
    for rid, prompt, n in (("g0", PROMPTS[0], 7), ("g1", PROMPTS[2], 6), ("g2", PROMPTS[1], 5)):
        assert [t for t, _ in out[K][rid]] == _alone(tuple(prompt), 9)[0][:n], rid
        assert out[K][rid][-1][1] == "length"
    assert [t for t, _ in out[K]["s0"]] != _alone(tuple(PROMPTS[1]), 9)[0]  # it did sample
    assert metrics[K]["tokens_generated"] == metrics[1]["tokens_generated"] == 7 + 9 + 6 + 3 + 5
    # one-step decode calls only beside an admission's prefill calls (blocks run while no row prefills)
    assert metrics[K]["engine_calls_decode_block"] > 0
    assert 0 < metrics[K]["engine_calls_decode"] <= metrics[K]["engine_calls_prefill"]
    assert metrics[1]["engine_calls_decode_block"] == 0 and metrics[1]["engine_calls_decode"] > 0
    assert metrics[K]["engine_calls_decode_block"] < metrics[1]["engine_calls_decode"]  # several steps a program


def test_decode_blocks_run_ahead_give_the_one_step_tokens():
    """Blocks run ahead (each block dispatched, fed on the device, before the one before it is read) against
    blocks read one by one and the one-step path, on staggered arrivals that queue for rows (mixed calls): greedy
    and sampled rows, max_tokens 7, 9, 6, 5 (no multiple of K), a stop string (found on the host after the block:
    the block run ahead of it decodes that row on, its tokens dropped) and a stop id (known on the device: the
    block run ahead of it runs no step). Every request's tokens, finish reasons and usage are equal, the greedy
    ones those of the request run alone; no block compiles; no block is left unread."""
    solo = {j: _alone(tuple(p), 12)[0] for j, p in enumerate(PROMPTS)}
    ks = next(i for i in range(4, 12) if solo[2][i] not in solo[2][:i])  # where the stop string ends "st"
    ke = next(i for i in range(3, 12) if solo[1][i] not in solo[1][:i])  # where the stop id ends "e1"
    sampled = SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=5, logprobs=True)
    arrivals = {0: [("g0", PROMPTS[0], SamplingParams(max_tokens=7)), ("s0", PROMPTS[1], sampled),
                    ("st", PROMPTS[2], SamplingParams(max_tokens=12, stop=(f"<{solo[2][ks]}>",)))],
                3: [("g1", PROMPTS[2], SamplingParams(max_tokens=6))],
                5: [("e1", PROMPTS[1], SamplingParams(max_tokens=12, stop_token_ids=(solo[1][ke],)))],
                6: [("g2", PROMPTS[0], SamplingParams(max_tokens=5))]}
    out, stats, logprobs, ahead, steps = {}, {}, {}, {}, {}
    for block, run_ahead in ((1, True), (K, False), (K, True)):
        sched = Scheduler(_engine("resident", 3, 4, block=K), decode_block=block, run_ahead=run_ahead,
                          detokenize=_DETOK)
        eng, key = sched.engine, (block, run_ahead)
        dispatch, read, ahead[key], steps[key] = eng.dispatch_block, eng.read_block, [], []

        def spy_dispatch(*args, after=None, **kw):
            ahead[key].append(after is not None)  # noqa: B023
            compiled = eng.compile_s  # noqa: B023
            pending = dispatch(*args, after=after, **kw)  # noqa: B023
            assert eng.compile_s == compiled  # noqa: B023 - no block compiles (run ahead or not)
            return pending

        def spy_read(pending):
            res = read(pending)  # noqa: B023
            steps[key].append(res.steps)  # noqa: B023
            return res

        eng.dispatch_block, eng.read_block = spy_dispatch, spy_read
        events, _ = _drive(sched, arrivals)
        out[key] = {rid: [(e.token_id, e.finish_reason) for e in evs] for rid, evs in events.items()}
        logprobs[key] = [e.logprob for e in events["s0"]]
        stats[key] = {rid: dataclasses.astuple(sched.stats(rid))[:3] for rid in out[key]}
        assert not eng._unread and sched.running == 0 and not sched.has_work()
    assert out[(K, True)] == out[(K, False)] == out[(1, True)]
    assert stats[(K, True)] == stats[(K, False)] == stats[(1, True)]
    np.testing.assert_allclose(logprobs[(K, True)], logprobs[(1, True)], rtol=1e-6)
    got = out[(K, True)]
    assert got["st"] == [(t, None) for t in solo[2][:ks]] + [(solo[2][ks], "stop")]
    assert got["e1"] == [(t, None) for t in solo[1][:ke]] + [(solo[1][ke], "stop")]
    for rid, j, n in (("g0", 0, 7), ("g1", 2, 6), ("g2", 0, 5)):
        assert got[rid] == [(t, None) for t in solo[j][:n - 1]] + [(solo[j][n - 1], "length")], rid
    assert any(ahead[(K, True)]) and not any(ahead[(K, False)])  # blocks did run ahead, and only there
    assert 0 in steps[(K, True)]  # the block dispatched after e1's stop id ran no step


def test_decode_block_stops_mid_block_where_the_one_step_path_stops():
    """A stop string met at a block's second step, a stop id (EOS) at a block's first step, max_tokens 6 (not a
    multiple of K): each request ends with the tokens, finish reason and usage of the one-step path (the block's
    tokens after its stop are dropped). A request alone whose stop id comes at its block's second step ends that
    block on the device after two steps, not K."""
    solo = [_alone(tuple(p), 12)[0] for p in PROMPTS]
    arrivals = {0: [("str", PROMPTS[0], SamplingParams(max_tokens=12, stop=(f"<{solo[0][7]}>",))),
                    ("eos", PROMPTS[1], SamplingParams(max_tokens=12, stop_token_ids=(solo[1][5],))),
                    ("len", PROMPTS[2], SamplingParams(max_tokens=6))]}
    one = _events(Scheduler(_engine("resident", 3, 4, block=K), decode_block=1, detokenize=_DETOK), arrivals)
    sched = Scheduler(_engine("resident", 3, 4, block=K), detokenize=_DETOK)
    got = _events(sched, arrivals)
    assert got == one
    assert got["str"] == [(t, None) for t in solo[0][:7]] + [(solo[0][7], "stop")]
    assert got["eos"] == [(t, None) for t in solo[1][:5]] + [(solo[1][5], "stop")]
    assert got["len"] == [(t, None) for t in solo[2][:5]] + [(solo[2][5], "length")]
    assert [sched.stats(r).completion_tokens for r in ("str", "eos", "len")] == [8, 6, 6]
    assert sched.metrics()["tokens_generated"] == 20
    # alone: prefill (1 step), a block of K (tokens 1-4), then tokens 5 and 6: the stop id ends the block
    before = sched.metrics()["steps"]
    got = _events(sched, {0: [("e2", PROMPTS[1], SamplingParams(max_tokens=12, stop_token_ids=(solo[1][6],)))]})
    assert got["e2"] == [(t, None) for t in solo[1][:6]] + [(solo[1][6], "stop")]
    assert sched.metrics()["steps"] - before == 1 + K + 2


@pytest.mark.parametrize("run_ahead", [False, True])
def test_decode_block_cancel_and_failure_end_their_requests_after_the_block(run_ahead):
    """A request cancelled while a block runs (the cancel lands before the block's tokens are handed out) gets
    none of that block's tokens (nor those of the block already dispatched after it, with run-ahead) and ends
    "cancelled", its row freed; the other row goes on with its own tokens. A block that raises ends every
    running request with an error and the scheduler goes on serving."""
    with pytest.raises(ValueError, match="decode_block must be an integer >= 1"):
        Scheduler(_engine("resident", 3, 4, block=K), decode_block=0)
    sched = Scheduler(_engine("resident", 3, 4, block=K), run_ahead=run_ahead)
    eng = sched.engine
    solo = [_alone(tuple(p), 12)[0] for p in PROMPTS]
    read, calls = eng.read_block, []

    def cancel_in_second(*args, **kw):
        out = read(*args, **kw)
        calls.append(out.steps)
        if len(calls) == 2:
            sched.cancel("c")
            assert eng.rows[0] is not None and sched.running == 1  # c's row (1) is free at once
        return out

    eng.read_block = cancel_in_second
    got = _events(sched, {0: [("o", PROMPTS[0], SamplingParams(max_tokens=9)),
                              ("c", PROMPTS[2], SamplingParams(max_tokens=12))]})
    assert got["c"] == [(t, None) for t in solo[2][:1 + K]] + [(None, "cancelled")]  # the prefill's, block 1's
    assert got["o"] == [(t, None) for t in solo[0][:8]] + [(solo[0][8], "length")]
    assert sched.stats("c").completion_tokens == 1 + K and sched.metrics()["tokens_generated"] == 9 + 1 + K

    def boom(*args, **kw):
        raise RuntimeError("block fell over")

    del eng.read_block
    eng.dispatch_block = boom
    got = _events(sched, {0: [("f", PROMPTS[0], SamplingParams(max_tokens=9))]})
    assert got["f"] == [(solo[0][0], None), (None, "error")] and sched.running == 0
    del eng.dispatch_block
    got = _events(sched, {0: [("ok", PROMPTS[1], SamplingParams(max_tokens=6))]})
    assert [t for t, _ in got["ok"]] == solo[1][:6]


def test_advance_block_refuses_what_it_cannot_run():
    eng = _engine("resident", 3, 4, block=K)
    eng.open_rows(3)
    sampling = RowSampling(np.zeros((3, 2), np.uint32), np.zeros(3, np.float32), np.ones(3, np.float32),
                           np.zeros(3, np.int32))
    eos, tokens = np.full((3, 4), -1, np.int32), np.zeros((3, 1), np.int32)
    with pytest.raises(ValueError, match="no decoding row"):
        eng.advance_block(tokens, sampling, 1, eos)
    eng.admit(PROMPTS[0], 4)
    with pytest.raises(ValueError, match="a row is still prefilling"):
        eng.advance_block(tokens, sampling, 1, eos)
    while eng.prefilling():
        eng.advance()
    with pytest.raises(ValueError, match=r"limit must be in \[1, 4\]"):
        eng.advance_block(tokens, sampling, 5, eos)
    with pytest.raises(ValueError, match=r"eos must be int32 \[3, N >= 1\]"):
        eng.advance_block(tokens, sampling, 1, eos[0])
    eng.rows[0].pos = S - 1  # a block of 2 would write past the cache
    with pytest.raises(ValueError, match="past max_seq_len 64"):
        eng.advance_block(tokens, sampling, 2, eos)
