"""Hybrid prefix reuse in the configuration of the H200 bench run, scaled down (chunks of 64).

``bench_kv_reuse.py --preset=qwen3.5-35b-a3b --modes=cached --loads=xs`` stored 62 chunks of 256
from a request prefilled in calls of 8192 + 7680 (the second call padded to its 8192 bucket), and a
16,128-token request reused them, the 62 hit chunks passed as 64 (``bucket_chunks``; 64 * 256 =
max_seq_len 16384, so the padding rows fill the cache to its end), on a "cached" engine whose
prefill calls stream whole layers (S >= 2E), with the layerwise load "xs" and the in-scan store
route. tests/test_hybrid.py's reuse test covers none of that (one store call, 3 chunks, no
padding, a cache with room to spare, no streaming). Here, at C = 64, prefill calls of 512 and
max_seq_len 1024: request A stores 15 chunks in calls of 512 + 448 (bucket 512); request B (992
tokens) reuses them, passed as 16 chunks = the whole cache, and decodes into the padding rows;
request C shares only 10 chunks with A, so its reused prefix ends inside A's second call. Each
must be bit-identical (prefill and decode logits) to a plain prefill cut at the same tokens, in
float32 and bfloat16, for the random tiny-hybrid preset (one block) and the transformers-made
fixtures (two blocks).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from conftest import load_fixture
from ftjax.checkpoint import random_model
from ftjax.config import EngineConfig, KVOffloadConfig, preset
from ftjax import Engine
from ftjax.runtime.plan import PrefillCall, bucket
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.prefix_cache import PrefixCache

pytestmark = pytest.mark.slow  # a long end-to-end run: .ci/run runs it after the README's test command

C, PREFILL, MAX_LEN = 64, 512, 1024


def _model(name: str):
    if name.startswith("tiny-hybrid"):
        dtype = name.rsplit(":", 1)[1]
        return random_model(preset("tiny-hybrid"), dtype, seed=3)
    fixture, dtype = name.split(":")
    return load_fixture(fixture, dtype)[0]


def _with_calls(engine: Engine, calls: list[PrefillCall]):
    """Makes the engine's next plain (no prefix reuse) rows prefill through ``calls`` instead of its
    own chunks (the engine's ``_row`` patched; undo with ``del engine._row``)."""
    own = engine._row
    engine._row = lambda prompt, kv_manager=None: dataclasses.replace(own(prompt, kv_manager),
                                                                      pending=collections.deque(calls))


def _cut_generate(engine: Engine, prompt: list[int], starts: list[int], steps: int, buckets=None):
    """generate() with the prefill's calls starting at ``starts`` (padded to ``buckets``, default
    the engine's): the recompute a reuse must equal."""
    bounds = starts + [len(prompt)]
    buckets = buckets or [bucket(e - s) for s, e in zip(bounds, bounds[1:])]
    calls = [PrefillCall(s, (e - s,), t) for s, e, t in zip(bounds, bounds[1:], buckets)]
    _with_calls(engine, calls)
    before = sum(engine.prefill_driver_calls.values())
    try:
        res = engine.generate([prompt], steps, keep_logits=True)
    finally:
        del engine._row
    assert sum(engine.prefill_driver_calls.values()) - before == len(calls)  # the prefill ran as cut
    return res


@pytest.mark.parametrize("name", ["tiny-hybrid:float32", "tiny-hybrid:bfloat16", "qwen3_5_moe_fp32:float32",
                                  "qwen3_5_moe_bf16:bfloat16"])
def test_reuse_of_a_two_call_store_padded_to_the_cache_end_is_exact(name):
    model = _model(name)
    e = model.cfg.num_experts
    engine = Engine(model, EngineConfig("cached", num_slots=2 * e + 1, max_seq_len=MAX_LEN))
    mgr = PrefixCache(HostKVStore(10 ** 8), KVOffloadConfig(chunk_tokens=C, load="xs", store_route="scan",
                                                            prefill_chunk=PREFILL))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.cfg.vocab_size, 992).tolist()

    first = engine.generate([prompt[:960]], 1, kv_manager=mgr)  # A: 15 chunks, calls 512 + 448
    assert first.kv["prefill_calls"] == 2 and first.kv["chunks_stored"] == 15

    # B: all 15 chunks hit, passed as 16 (the cache's 1024 rows); the 32 new tokens stream (S >= 2E)
    assert engine.planner.streams(32)
    got = engine.generate([prompt], 24, kv_manager=mgr, keep_logits=True)
    assert (got.kv["hit_chunks"], got.kv["reused_tokens"], got.kv["prefix_chunks_passed"]) == (15, 960, 16)
    assert got.kv["bytes_padding"] == mgr.entry_bytes(engine)
    want = _cut_generate(engine, prompt, [0, PREFILL, 960], 24)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert got.generated_ids == want.generated_ids

    # C: shares 10 chunks with A: the reused prefix ends inside A's second call; 3 new chunks stored.
    # Its tokens [512, 640) were computed inside A's call of 448 tokens padded to 512: a recompute
    # is bit-identical when its call over them has that shape (valid 128, padded to 512)
    other = prompt[:640] + rng.integers(0, model.cfg.vocab_size, 200).tolist()
    got = engine.generate([other], 4, kv_manager=mgr, keep_logits=True)
    assert (got.kv["hit_chunks"], got.kv["reused_tokens"], got.kv["chunks_stored"]) == (10, 640, 3)
    want = _cut_generate(engine, other, [0, PREFILL, 640], 4, buckets=[PREFILL, PREFILL, 256])
    np.testing.assert_array_equal(got.step_logits, want.step_logits)

    # the stored entries at the end of A's two calls are what a plain prefill cut there leaves
    keys = mgr.keys(engine, prompt[:960])
    for end in (PREFILL, 960):
        kv, conv, rec = (np.asarray(a) for a in mgr.store.peek(keys[end // C - 1]))
        bounds = [0, PREFILL, end][: 2 if end == PREFILL else 3]
        _with_calls(engine, [PrefillCall(s, (t - s,), bucket(t - s)) for s, t in zip(bounds, bounds[1:])])
        try:
            _, cache, _, _ = engine.prefill([prompt[:end]], engine.new_cache(1))
        finally:
            del engine._row
        # the entry keeps the DeltaNet states by block [G, Nl, ...]; the cache stacks them [L_lin, B, ...]
        np.testing.assert_array_equal(conv, np.asarray(cache.conv)[:, 0].reshape(conv.shape))
        np.testing.assert_array_equal(rec, np.asarray(cache.rec)[:, 0].reshape(rec.shape))
        np.testing.assert_array_equal(kv[:, 0], np.asarray(cache.k)[:, 0, end - C:end])
        np.testing.assert_array_equal(kv[:, 1], np.asarray(cache.v)[:, 0, end - C:end])
