"""Layerwise KV offload with prefix reuse (DESIGN.md 1.4): correctness on the CPU.

On the CPU backend ``device_put`` between memory kinds is an identity, so these tests check the
logic and the exactness of reuse, not the movement (that is ``experiments/bench_kv_reuse.py``).

"Same math" reference: a request that reuses ``r`` tokens runs its suffix as one call at start
``r`` against a cache whose rows [0, r) were loaded from the store, where an earlier request's
call had written them. The reference replays those calls with the plain ``model.forward`` (no
hook, resident experts): the earlier request's call, then the suffix call at start ``r``, with the
same padded lengths. Where the math is the same, logits and KV must be bit-identical; against a
recompute with other call shapes (different matmul shapes, expert formulation) and against
transformers they agree to the oracle tolerance of test_oracle.py.

Most tests use one fixture, mode and set of lengths, so compiled programs are shared.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli_helpers import CliResult, run_generate
from conftest import fixture_path, load_fixture
from ftjax import Engine
from ftjax import model as model_lib
from ftjax.config import EngineConfig, KVOffloadConfig
from ftjax.experts.state import init_expert_state
from ftjax.experts import offload
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.layerwise import LayerwiseKV, bucket_chunks, load_prefix_only
from ftjax.kv.prefix_cache import PrefixCache
from ftjax.runtime.plan import bucket

C = 16  # tokens per chunk in these tests
S = 384  # cache length
HOST_KINDS = {"pinned_host", "unpinned_host"}


def _tol(x: np.ndarray) -> float:
    return 2e-5 * float(np.abs(x).max()) + 1e-5


def _engine(name: str, mode: str = "resident") -> Engine:
    model, _ = load_fixture(name)
    return Engine(model, EngineConfig(mode, num_slots=None if mode == "resident" else model.cfg.num_experts,
                                      max_seq_len=S))


def _entry_bytes(model) -> int:
    cfg = model.cfg
    return cfg.num_layers * 2 * C * cfg.num_kv_heads * cfg.head_dim * 4


def _manager(model, chunks: float = 100, **kw) -> PrefixCache:
    return PrefixCache(HostKVStore(int(chunks * _entry_bytes(model))),
                       KVOffloadConfig(chunk_tokens=C, prefill_chunk=kw.pop("prefill_chunk", 256), **kw))


@functools.lru_cache(maxsize=None)
def _plain_fn(cfg):
    def f(params, cache, state, tokens, start, valid):
        return model_lib.forward(params, cfg, tokens, start, valid, cache,
                                 offload.make_expert_fn("resident", cfg.num_experts), state)
    return jax.jit(f)


def _reference(model, prompt, calls):
    """Plain forward as the calls ``(a, b)``: tokens prompt[a:b] at start a, padded to ``bucket``,
    in order, on one cache. Returns (logits [V] of the last call's last token, cache k, v numpy)."""
    cfg = model.cfg
    state = init_expert_state("resident", cfg.num_layers, cfg.num_experts, 0, model.banks,
                              model.params["embed"].dtype)
    cache = model_lib.init_kv_cache(cfg, 1, S, model.params["embed"].dtype)
    f = _plain_fn(cfg)
    for a, b in calls:
        toks = np.zeros((1, bucket(b - a)), np.int32)
        toks[0, : b - a] = prompt[a:b]
        out = f(model.params, cache, state, jnp.asarray(toks), jnp.asarray([a], jnp.int32),
                jnp.asarray([b - a], jnp.int32))
        cache = out.cache
    return np.asarray(out.logits[0]), np.asarray(cache.k), np.asarray(cache.v)


def _prefill(engine, mgr, prompt):
    """One request's prefill through the manager; returns (logits [V], cache k, v numpy, record)."""
    cache = engine.new_cache(1)
    req = mgr.begin(engine, [prompt])
    logits, cache, _, _ = engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    return np.asarray(logits[0]), np.asarray(cache.k), np.asarray(cache.v), req.record()


def _stored(mgr, engine, prompt) -> list[np.ndarray]:
    keys = mgr.keys(engine, prompt)
    return [np.asarray(a) for a in mgr.store.get([k for k in keys if k in mgr.store])]


def _long_prompt(name="qwen3_moe_fp32"):
    return load_fixture(name)[1]["long_prompt_ids"].tolist()


# ------------------------------------------------------------------ reuse == recompute
@pytest.mark.parametrize("name,mode,load", [
    ("qwen3_moe_fp32", "resident", "prefetch"),
    ("olmoe_fp32", "cached", "xs"),
    ("mixtral_fp32", "cached", "all_first"),
])
def test_reused_prefix_logits_equal_recompute(name, mode, load):
    model, exp = load_fixture(name)
    prompt = exp["long_prompt_ids"].tolist()[:150]
    engine, mgr = _engine(name, mode), _manager(model, load=load)
    _, k1, v1, rec1 = _prefill(engine, mgr, prompt[:96])  # an earlier request stores 6 chunks
    assert rec1["reused_tokens"] == 0 and rec1["chunks_stored"] == 6
    logits, k, v, rec = _prefill(engine, mgr, prompt)
    assert rec["hit_chunks"] == 6 and rec["reused_tokens"] == 96 and rec["prefill_calls"] == 1
    assert rec["bytes_loaded"] == 6 * _entry_bytes(model)
    # same math: bit-identical logits and KV rows
    ref_logits, ref_k, ref_v = _reference(model, prompt, [(0, 96), (96, 150)])
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_array_equal(k[:, :, :150], ref_k[:, :, :150])
    np.testing.assert_array_equal(v[:, :, :150], ref_v[:, :, :150])


def test_generate_with_reuse_matches_transformers_with_bucket_padding():
    """18 hit chunks are passed as 20 (bucket padding: 2 duplicates write stale rows past the
    prefix); the suffix, then 16 greedy decode steps, must still match transformers."""
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()
    assert bucket_chunks(18) == 20 and bucket_chunks(7) == 7 and bucket_chunks(62) == 64
    engine, mgr = _engine("qwen3_moe_fp32", "cached"), _manager(model)
    engine.generate([prompt[:288]], 1, kv_manager=mgr)
    res = engine.generate([prompt], 16, keep_logits=True, kv_manager=mgr)
    assert res.kv["hit_chunks"] == 18 and res.kv["prefix_chunks_passed"] == 20
    assert res.kv["bytes_padding"] == 2 * _entry_bytes(model)
    assert res.generated_ids[0] == exp["long_generated_ids"].tolist()
    want = exp["long_step_logits"]
    np.testing.assert_allclose(res.step_logits[:, 0], want, rtol=0, atol=_tol(want))


# ------------------------------------------------------------------ KV store round trip
def test_stored_then_retrieved_kv_equals_in_place_every_layer():
    model, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()[:100]
    engine = _engine("qwen3_moe_fp32")
    for route in ("scan", "after"):
        mgr = _manager(model, store_route=route)
        _, k, v, rec = _prefill(engine, mgr, prompt)  # 6 full chunks; the last 4 tokens are not stored
        assert rec["chunks_stored"] == 6
        entries = _stored(mgr, engine, prompt)
        assert len(entries) == 6 and len(mgr.store) == 6
        for i, e in enumerate(entries):
            assert e.shape == (model.cfg.num_layers, 2, C, model.cfg.num_kv_heads, model.cfg.head_dim)
            rows = slice(i * C, (i + 1) * C)
            np.testing.assert_array_equal(e[:, 0], k[:, 0, rows])  # every layer, K
            np.testing.assert_array_equal(e[:, 1], v[:, 0, rows])  # every layer, V
        assert all(a.sharding.memory_kind in HOST_KINDS for a in mgr.store.get(mgr.store.keys_lru()))
        # retrieved: each load variant writes exactly the stored rows into a fresh cache
        for load in ("prefetch", "xs", "all_first"):
            mgr.config = dataclasses.replace(mgr.config, load=load)
            _, k2, v2, rec2 = _prefill(engine, mgr, prompt + [7, 8])
            assert rec2["reused_tokens"] == 96
            np.testing.assert_array_equal(k2[:, :, :96], k[:, :, :96])
            np.testing.assert_array_equal(v2[:, :, :96], v[:, :, :96])


def test_load_prefix_only_writes_rows_of_every_layer():
    rng = np.random.default_rng(0)
    L, hkv, hd = 3, 2, 4
    chunks = [jax.device_put(rng.standard_normal((L, 2, C, hkv, hd)).astype(np.float32),
                             HostKVStore(0).sharding) for _ in range(3)]
    for variant in ("prefetch", "xs"):
        ck = jnp.full((L, 1, 64, hkv, hd), 7.0)
        ck2, cv2 = jax.jit(functools.partial(load_prefix_only, variant=variant))(ck, ck + 1, tuple(chunks))
        ck2, cv2 = np.asarray(ck2), np.asarray(cv2)
        for i, c in enumerate(chunks):
            np.testing.assert_array_equal(ck2[:, 0, i * C:(i + 1) * C], np.asarray(c)[:, 0])
            np.testing.assert_array_equal(cv2[:, 0, i * C:(i + 1) * C], np.asarray(c)[:, 1])
        assert (ck2[:, 0, 3 * C:] == 7.0).all() and (cv2[:, 0, 3 * C:] == 8.0).all()
    with pytest.raises(ValueError, match="unknown layerwise variant"):
        LayerwiseKV(tuple(chunks), "bogus")


# ------------------------------------------------------------------ hit / miss cases
def test_partial_hits_after_eviction():
    model, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()
    other = [(t * 7 + 3) % 384 for t in prompt]
    engine = _engine("qwen3_moe_fp32")
    mgr = _manager(model, chunks=6)
    _prefill(engine, mgr, prompt[:96])  # 6 chunks, stored last-first: chunk 5 is the LRU entry
    # (a) a later chunk evicted: 2 chunks of another prompt evict chunks 5 and 4
    _prefill(engine, mgr, other[:32])
    assert mgr.store.stats.chunks_evicted == 2
    logits, _, _, rec = _prefill(engine, mgr, prompt[:150])
    assert rec["hit_chunks"] == 4 and rec["reused_tokens"] == 64
    np.testing.assert_array_equal(logits, _reference(model, prompt, [(0, 96), (64, 150)])[0])
    # (b) a middle chunk evicted: make chunks 3..5 recent, then pressure evicts chunk 2 first
    mgr2 = _manager(model, chunks=6)
    _prefill(engine, mgr2, prompt[:96])
    keys = mgr2.keys(engine, prompt[:96])
    assert mgr2.store.lookup(keys[3:]) == keys[3:]
    _prefill(engine, mgr2, other[:16])
    assert keys[2] not in mgr2.store and all(k in mgr2.store for k in keys[:2] + keys[3:])
    logits, _, _, rec = _prefill(engine, mgr2, prompt[:100])
    assert rec["hit_chunks"] == 2 and rec["reused_tokens"] == 32
    np.testing.assert_array_equal(logits, _reference(model, prompt, [(0, 96), (32, 100)])[0])


def test_total_miss_short_prompt_and_multi_call_equal_plain_engine():
    model, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()[:100]
    engine = _engine("qwen3_moe_fp32")
    mgr = _manager(model)
    plains = []
    for p, stored in ((prompt, 6), (prompt[:10], 0)):
        res = engine.generate([p], 6, keep_logits=True, kv_manager=mgr)
        plains.append(plain := engine.generate([p], 6, keep_logits=True))
        assert res.kv["reused_tokens"] == 0 and res.kv["chunks_stored"] == stored
        assert res.generated_ids == plain.generated_ids  # one call of the same shape: same math
        np.testing.assert_array_equal(res.step_logits, plain.step_logits)
    short = engine.generate([prompt[:10]], 2, kv_manager=mgr)  # shorter than a chunk: no key, no hit
    assert short.kv["full_chunks"] == 0 and short.kv["hit_chunks"] == 0
    m = mgr.metrics()
    assert m["chunks_hit"] == 0 and m["chunks_stored"] == 6 and m["requests"] == 3
    # a miss split into calls of 32 tokens: same ids, logits within the oracle tolerance
    split, plain = _manager(model, prefill_chunk=32), plains[0]
    res = engine.generate([prompt], 6, keep_logits=True, kv_manager=split)
    assert res.kv["prefill_calls"] == 4 and res.kv["chunks_stored"] == 6
    assert res.generated_ids == plain.generated_ids
    np.testing.assert_allclose(res.step_logits, plain.step_logits, rtol=0, atol=_tol(plain.step_logits))
    assert mgr.store.stats.num_pinned == 0
    with pytest.raises(ValueError, match="batch 1"):
        mgr.begin(engine, [prompt, prompt])
    with pytest.raises(ValueError, match="multiple of the KV chunk"):
        PrefixCache(HostKVStore(0), KVOffloadConfig(chunk_tokens=16, prefill_chunk=40))
    with pytest.raises(ValueError, match="unknown KV load"):
        PrefixCache(HostKVStore(0), KVOffloadConfig(load="bogus"))


def test_full_hit_recomputes_only_the_last_token():
    model, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()[:96]  # exactly 6 chunks
    engine = _engine("qwen3_moe_fp32")
    mgr = _manager(model)
    first = engine.generate([prompt], 6, kv_manager=mgr)
    again = engine.generate([prompt], 6, keep_logits=True, kv_manager=mgr)
    assert again.kv["hit_chunks"] == 6 and again.kv["reused_tokens"] == 95 and again.kv["prefill_calls"] == 1
    assert again.kv["chunks_stored"] == 0 and mgr.metrics()["chunks_stored"] == 6
    assert again.generated_ids == first.generated_ids
    np.testing.assert_array_equal(again.step_logits[0, 0], _reference(model, prompt, [(0, 96), (95, 96)])[0])
    assert engine.generate([prompt + [5, 6]], 6, kv_manager=mgr).kv["reused_tokens"] == 96


def test_eviction_under_pressure_keeps_whole_chunks_and_a_prefix():
    model, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()
    engine = _engine("qwen3_moe_fp32")
    mgr = _manager(model, chunks=3.5)  # room for 3 chunks
    _, k, v, rec = _prefill(engine, mgr, prompt[:96])
    s = mgr.store.stats
    # stored last chunk first: 5, 4, 3, then 2, 1, 0 evict them: a contiguous prefix survives
    assert (s.chunks_stored, s.chunks_evicted, s.num_entries) == (6, 3, 3)
    keys = mgr.keys(engine, prompt[:96])
    assert set(mgr.store.keys_lru()) == set(keys[:3])
    for i, e in enumerate(_stored(mgr, engine, prompt[:96])):  # whole chunks, every layer exact
        assert e.shape[0] == model.cfg.num_layers
        np.testing.assert_array_equal(e[:, 0], k[:, 0, i * C:(i + 1) * C])
        np.testing.assert_array_equal(e[:, 1], v[:, 0, i * C:(i + 1) * C])
    # the next request pins its 3 hit chunks: its new chunks cannot evict them, so they are skipped
    logits, _, _, rec = _prefill(engine, mgr, prompt[:110])
    assert rec["reused_tokens"] == 48 and rec["chunks_stored"] == 0 and rec["chunks_skipped"] == 3
    assert set(mgr.store.keys_lru()) == set(keys[:3]) and mgr.store.stats.num_pinned == 0
    np.testing.assert_array_equal(logits, _reference(model, prompt, [(0, 96), (48, 110)])[0])
    assert mgr.metrics()["chunks_skipped"] == 3


def test_capacity_smaller_than_one_chunk_skips_every_store():
    model, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()[:100]
    engine = _engine("qwen3_moe_fp32")
    mgr = PrefixCache(HostKVStore(_entry_bytes(model) - 1), KVOffloadConfig(chunk_tokens=C))
    plain = engine.generate([prompt], 6)
    for _ in range(2):
        res = engine.generate([prompt], 6, kv_manager=mgr)
        assert res.generated_ids == plain.generated_ids and res.kv["reused_tokens"] == 0
    m = mgr.metrics()
    assert (m["chunks_stored"], m["chunks_skipped"], m["num_entries"], m["chunks_hit"]) == (0, 12, 0, 0)


def test_second_model_identity_never_hits_first_models_chunks():
    qwen, _ = load_fixture("qwen3_moe_fp32")
    prompt = _long_prompt()[:100]
    store = HostKVStore(100 * _entry_bytes(qwen))
    mgr = PrefixCache(store, KVOffloadConfig(chunk_tokens=C, prefill_chunk=256))
    e_qwen, e_mix = _engine("qwen3_moe_fp32"), _engine("mixtral_fp32")  # same chunk shape and dtype
    assert mgr.identity(e_qwen) != mgr.identity(e_mix)
    e_qwen.generate([prompt], 1, kv_manager=mgr)
    res = e_mix.generate([prompt], 1, kv_manager=mgr)
    assert res.kv["hit_chunks"] == 0 and res.kv["chunks_stored"] == 6 and len(store) == 12
    assert e_qwen.generate([prompt], 1, kv_manager=mgr).kv["hit_chunks"] == 6
    # same weights in bfloat16: another identity, and an incompatible entry dtype: no hit, no store
    bf16, _ = load_fixture("qwen3_moe_fp32", "bfloat16")
    e_bf16 = Engine(bf16, EngineConfig("resident", max_seq_len=S))
    assert mgr.identity(e_bf16) != mgr.identity(e_qwen)
    res = e_bf16.generate([prompt], 1, kv_manager=mgr)
    assert res.kv["hit_chunks"] == 0 and res.kv["chunks_skipped"] == 6 and len(store) == 12


def test_checkpoint_rewritten_at_the_same_path_never_hits_the_old_weights_chunks(tmp_path):
    """Chunk keys name the weights' content, not their path: a checkpoint rewritten in place
    (same shapes, same size, even the old mtime put back) gets new keys, so a kept store serves none
    of the old model's K/V and the logits are a fresh recompute's; the old bytes back: hits again."""
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from ftjax.checkpoint import load_checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture_path("qwen3_moe_fp32"), ckpt)
    path = ckpt / "model.safetensors"
    original = path.read_bytes()
    prompt = _long_prompt()[:40]  # 2 full chunks of C = 16
    a = load_checkpoint(str(ckpt), progress=False)
    mgr = _manager(a)
    run = lambda model, **kw: Engine(model, EngineConfig("resident", max_seq_len=S)).generate(  # noqa: E731
        [prompt], 2, keep_logits=True, **kw)
    first = run(a, kv_manager=mgr)
    assert first.kv["chunks_stored"] == 2
    # other weights at the same path: every tensor plus noise, same dtypes and shapes (so the same size)
    with safe_open(str(path), "np") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    rng = np.random.default_rng(0)
    tensors = {k: (t + rng.normal(0, 0.1, t.shape)).astype(t.dtype) for k, t in tensors.items()}
    st = os.stat(path)
    save_file(tensors, str(path), metadata=meta)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(path.read_bytes()) == len(original)
    b = load_checkpoint(str(ckpt), progress=False)
    assert b.name == a.name and b.fingerprint != a.fingerprint
    got = run(b, kv_manager=mgr)
    assert got.kv["hit_chunks"] == 0 and got.kv["reused_tokens"] == 0
    fresh = run(b)
    np.testing.assert_array_equal(got.step_logits, fresh.step_logits)
    assert np.abs(fresh.step_logits - first.step_logits).max() > 0.1  # the old K/V would have been wrong
    # the same weights again (the old bytes back at the path): the old chunks hit
    path.write_bytes(original)
    c = load_checkpoint(str(ckpt), progress=False)
    assert c.fingerprint == a.fingerprint
    again = run(c, kv_manager=mgr)
    assert again.kv["hit_chunks"] == 2 and again.generated_ids == first.generated_ids
    assert np.abs(again.step_logits - first.step_logits).max() < _tol(first.step_logits)


def test_weights_fingerprint_follows_content_and_format_not_layout():
    """One fingerprint for the single-file and the sharded fixture (same tensors), another for the
    bfloat16 file; random weights: by seed and config; a hand-built model: from its arrays."""
    from ftjax.checkpoint import model_fingerprint, random_fingerprint
    from ftjax.config import preset
    single, sharded, bf16 = (load_fixture(n)[0] for n in ("qwen3_moe_fp32", "qwen3_moe_sharded", "qwen3_moe_bf16"))
    assert single.fingerprint == sharded.fingerprint != bf16.fingerprint
    assert single.fingerprint.startswith("sha256-tensors-v1:")
    tiny = preset("tiny")
    fp = random_fingerprint(tiny, "float32", 0, 0.5)
    assert fp == random_fingerprint(tiny, "float32", 0, 0.5)  # random_model's: test_random_models_with_...
    others = {random_fingerprint(tiny, "float32", 1, 0.5), random_fingerprint(tiny, "bfloat16", 0, 0.5),
              random_fingerprint(tiny, "float32", 0, 0.25),
              random_fingerprint(dataclasses.replace(tiny, rope_theta=20000.0), "float32", 0, 0.5)}
    assert len(others) == 4 and fp not in others
    by_hand = dataclasses.replace(single, fingerprint="")
    assert model_fingerprint(by_hand).startswith("arrays:") and by_hand.fingerprint == model_fingerprint(by_hand)
    scaled = dataclasses.replace(single, fingerprint="", params={**single.params, "final_norm": single.params[
        "final_norm"] * 2})
    assert model_fingerprint(scaled) != model_fingerprint(by_hand)


# ------------------------------------------------------------------ CLI
def _run_cli(*args: str) -> CliResult:
    """``python -m ftjax.generate --noprogress *args``, run in this process (tests/cli_helpers.py)."""
    return run_generate(*args)


def test_cli_prompts_file_reuses_across_requests(tmp_path):
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()
    text_ids = exp["text_prompt_ids"].tolist()
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\ufeff" + json.dumps({"prompt_ids": prompt[:40]}) + "\n\n"  # a byte-order mark first
                    + json.dumps({"prompt_ids": prompt[:60]}) + "\n" + json.dumps({"prompt": str(exp["text_prompt"])})
                    + "\n", encoding="utf-8")
    metrics = tmp_path / "m.json"
    r = _run_cli(f"--checkpoint={fixture_path('qwen3_moe_fp32')}", f"--prompts_file={reqs}", "--kv_offload",
                 "--kv_chunk_tokens=16", "--max_new_tokens=6", "--expert_slots=8", f"--metrics_json={metrics}")
    assert r.returncode == 0, r.stderr
    m = json.loads(metrics.read_text())
    assert [q["reused_tokens"] for q in m["requests"]] == [0, 32, 0]
    assert [q["prompt_tokens"] for q in m["requests"]] == [40, 60, len(text_ids)]
    assert all(q["ttft_s"] > 0 and len(q["generated_ids"]) == 6 for q in m["requests"])
    kv = m["kv_store"]
    assert (kv["chunks_hit"], kv["chunks_stored"], kv["chunks_evicted"], kv["chunks_skipped"]) == (2, 5, 0, 0)
    assert kv["bytes_loaded"] == 2 * _entry_bytes(model) and kv["bytes_stored"] == 5 * _entry_bytes(model)
    # the same ids as plain runs without reuse (resident experts: the same math as the CLI's cache)
    engine = _engine("qwen3_moe_fp32")
    for q, p in zip(m["requests"], (prompt[:40], prompt[:60], text_ids)):
        assert q["generated_ids"] == engine.generate([p], 6).generated_ids[0]
    assert "request 1: 60 prompt tokens, 32 reused" in r.stdout and "kv store:" in r.stdout


def test_cli_prompts_file_bad_input(tmp_path):
    from ftjax.generate import UserError, _read_prompts_file
    model, _ = load_fixture("qwen3_moe_fp32")
    path = tmp_path / "bad.jsonl"
    cases = [
        ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 2\n', "bad.jsonl:2: malformed JSON"),
        ('{"text": "hi"}\n', "bad.jsonl:1: expected an object with exactly one of"),
        ('{"prompt_ids": [1], "prompt": "x"}\n', "bad.jsonl:1: expected an object with exactly one of"),
        ('\n{"prompt_ids": [1, 384]}\n', "bad.jsonl:2: token id 384 outside the vocabulary [0, 384)"),
        ('{"prompt_ids": [1, "2"]}\n', "bad.jsonl:1: 'prompt_ids' must be a list of integers"),
        ('{"prompt_ids": []}\n', "bad.jsonl:1: empty prompt"),
        ('[1, 2]\n', "bad.jsonl:1: expected an object"),
        ('{"prompt_ids": [' + ",".join(["5"] * 1020) + ']}\n', "bad.jsonl:1: prompt of 1020 tokens + 8 new"),
        ("\n\n", "no requests"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(UserError, match=None) as e:
            _read_prompts_file(str(path), model, 8)
        assert message in str(e.value), (text, str(e.value))
    path.write_bytes(b'{"prompt_ids": [1]}\n{"prompt": "caf\xe9"}\n')  # latin-1, not UTF-8
    with pytest.raises(UserError, match=r"bad.jsonl:2: not UTF-8 \(invalid continuation byte at byte 15\)"):
        _read_prompts_file(str(path), model, 8)
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [' + ",".join(["5"] * 30) + ']}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: prompt of 30 tokens \+ 8 new exceeds --max_seq_len 32"):
        _read_prompts_file(str(path), model, 8, max_seq_len=32)
    assert len(_read_prompts_file(str(path), model, 8, max_seq_len=38)[1]) == 30
    path.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [1, 2]}\r\n\r\n{"prompt_ids": [3]}\r\n')  # BOM, CRLF lines
    assert _read_prompts_file(str(path), model, 8) == [[1, 2], [3]]
    path.write_text('{"prompt": "hello"}\n')
    random_model = dataclasses.replace(model, tokenizer=None)
    with pytest.raises(UserError, match="bad.jsonl:1: 'prompt' needs a tokenizer"):
        _read_prompts_file(str(path), random_model, 8)
    # end to end: one line on stderr, exit 1, no metrics file
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 99999]}\n')
    metrics = tmp_path / "m.json"
    r = _run_cli(f"--checkpoint={fixture_path('qwen3_moe_fp32')}", f"--prompts_file={path}", "--kv_offload",
                 f"--metrics_json={metrics}")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{path}:2: token id 99999 outside the vocabulary" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not metrics.exists()
    assert "request 0" not in r.stdout  # every line is checked before the first request runs
    # the file's syntax is checked before the model is loaded (a typo costs no load)
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 2\n')
    r = _run_cli("--checkpoint=/nonexistent/ckpt", f"--prompts_file={path}", f"--metrics_json={metrics}")
    assert r.returncode == 1 and f"{path}:2: malformed JSON" in r.stderr and not metrics.exists()


def test_random_models_with_different_seeds_never_share_kv():
    from ftjax.checkpoint import random_fingerprint, random_model
    from ftjax.config import preset
    from ftjax.kv.host_store import HostKVStore
    from ftjax.kv.prefix_cache import PrefixCache
    a, b = random_model(preset("tiny"), seed=0), random_model(preset("tiny"), seed=1)
    cache = PrefixCache(HostKVStore(10**8), KVOffloadConfig(chunk_tokens=16))
    assert cache.identity(Engine(a)) != cache.identity(Engine(b))
    assert a.fingerprint == random_fingerprint(preset("tiny"), a.dtype, 0, 0.5)  # seed and config, not arrays


# ------------------------------------------------------------------ one step for every prefill
@pytest.mark.parametrize("prefill", ["stream", "on_demand", "auto"])
def test_kv_reuse_prefill_honours_the_prefill_mode(prefill):
    """A prefill that reuses a stored prefix runs the engine's own step, so it streams whole
    layers exactly when a plain prefill of the same call would, and its logits stay exact."""
    model, _ = load_fixture("qwen3_moe_fp32")
    cfg = model.cfg
    e, nl = cfg.num_experts, cfg.num_layers
    prompt = _long_prompt()[:98]  # 6 chunks of C = 16 reused, a 2-token suffix computed
    eng = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=S, prefill=prefill))
    mgr = _manager(model)
    eng.generate([prompt[:96]], 1, kv_manager=mgr)
    before = eng.counters["prefill"].copy()
    res = eng.generate([prompt], 4, keep_logits=True, kv_manager=mgr)
    assert res.kv["reused_tokens"] == 96 and res.kv["prefill_calls"] == 1
    resident, ref_mgr = _engine("qwen3_moe_fp32"), _manager(model)  # the same calls, all experts resident
    resident.generate([prompt[:96]], 1, kv_manager=ref_mgr)
    ref = resident.generate([prompt], 4, keep_logits=True, kv_manager=ref_mgr)
    np.testing.assert_array_equal(res.step_logits, ref.step_logits)
    got = eng.counters["prefill"] - before
    # 2 tokens x top-2 = 4 (token, expert) pairs < E = 8: auto does not stream, stream always does
    if prefill == "stream":
        assert int(got.misses.sum()) == nl * e and got.extra_copies == e
    else:
        assert got.extra_copies == 0 and int((got.hits + got.misses).sum()) <= nl * 4


def test_prefill_api_misuse_is_refused_and_pins_stay_balanced():
    """A request runs once: a second prefill with it is refused without unpinning its chunks again;
    a manager without its request (or the reverse), or other prompts than planned, are refused."""
    model, _ = load_fixture("qwen3_moe_fp32")
    engine, mgr = _engine("qwen3_moe_fp32"), _manager(model)
    prompt = _long_prompt()[:40]
    engine.generate([prompt[:32]], 1, kv_manager=mgr)  # stores 2 chunks
    cache = engine.new_cache(1)
    req = engine.prepare_prefill([prompt], cache, mgr)
    assert len(req.hit) == 2 and all(mgr.store.pin_count(k) == 1 for k in req.hit)
    engine.prefill([prompt], cache, kv_manager=mgr, request=req)
    assert all(mgr.store.pin_count(k) == 0 for k in req.hit)
    with pytest.raises(RuntimeError, match="already ran"):
        engine.prefill([prompt], engine.new_cache(1), kv_manager=mgr, request=req)
    assert all(mgr.store.pin_count(k) == 0 for k in req.hit)
    with pytest.raises(ValueError, match="both kv_manager and the request"):
        engine.prefill([prompt], engine.new_cache(1), kv_manager=mgr)
    req2 = engine.prepare_prefill([prompt], engine.new_cache(1), mgr)
    with pytest.raises(ValueError, match="prompts differ"):
        engine.prefill([prompt[:-1]], engine.new_cache(1), kv_manager=mgr, request=req2)
    mgr.finish(req2, None)
    assert all(mgr.store.pin_count(k) == 0 for k in req2.hit)
