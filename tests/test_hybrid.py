"""The Qwen3.5 / Qwen3.6 MoE family (``qwen3_5_moe``): Gated DeltaNet + gated attention layers,
shared expert. Checked like the other families: logits, greedy ids and routing against
transformers (the oracle), every offload mode bit-identical to resident.

Tolerance: |ours - transformers| <= 5e-5 * max|logit| + 1e-5 on float32 logits, 2.5x the
other families' bound. The chunked delta rule sums in another order than transformers' torch
loop (XLA's batched triangular solve vs ``torch.linalg.solve_triangular``, cumulative decays
over 64-token chunks), over 8 layers: measured worst case 1.6e-4 on logits up to 7.2 (2.2e-5
relative), the size of transformers' own disagreement between its cached decode and a no-cache
recompute of the same tokens (9e-5, manifest diagnostics). A real math error (a norm without
its offset, the gate on the wrong half of q_proj, a wrong decay) moves logits by 1e-2 or more.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_fixture
from ftjax.config import EngineConfig
from ftjax.engine import Engine

HYBRID_FIXTURES = ("qwen3_5_moe_fp32", "qwen3_5_moe_bf16")


def _tol(expected: np.ndarray) -> float:
    return 5e-5 * float(np.abs(expected).max()) + 1e-5


@pytest.fixture(params=HYBRID_FIXTURES)
def name(request):
    return request.param


# ---- against transformers ---------------------------------------------------------------------
def test_fixture_config_is_the_hybrid_family(name):
    model, _ = load_fixture(name)
    cfg = model.cfg
    assert cfg.model_type == "qwen3_5_moe" and cfg.is_hybrid
    assert cfg.block_pattern == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.num_blocks, cfg.num_attention_layers, cfg.num_linear_layers) == (2, 2, 6)
    assert cfg.rotary_dim == 4 and cfg.shared_expert_ffn == 16 and cfg.norm_topk_prob
    assert model.cfg.dtype == ("bfloat16" if name.endswith("bf16") else "float32")


def test_prompt_logits_all_positions(name):
    model, exp = load_fixture(name)
    engine = Engine(model, EngineConfig("resident", max_seq_len=64))
    prompt = exp["short_prompt_ids"].tolist()
    logits, *_ = engine.prefill([prompt], engine.new_cache(1), all_logits=True)
    want = exp["short_prompt_logits"]
    np.testing.assert_allclose(np.asarray(logits)[0, : len(prompt)], want, rtol=0, atol=_tol(want))


@pytest.mark.parametrize("which", ["short", "long"])
def test_greedy_matches_transformers(name, which):
    """The long prompt (300 tokens) runs the chunked delta rule over 5 chunks, then decode runs
    the recurrent form from the state it left."""
    model, exp = load_fixture(name)
    engine = Engine(model, EngineConfig("resident", max_seq_len=384))
    res = engine.generate([exp[f"{which}_prompt_ids"].tolist()], max_new_tokens=16, keep_logits=True)
    assert res.generated_ids[0] == exp[f"{which}_generated_ids"].tolist()
    want = exp[f"{which}_step_logits"]
    np.testing.assert_allclose(res.step_logits[:, 0], want, rtol=0, atol=_tol(want))


def test_long_prompt_routing_matches(name):
    model, exp = load_fixture(name)
    engine = Engine(model, EngineConfig("resident", max_seq_len=384))
    prompt = exp["long_prompt_ids"].tolist()
    _, _, _, stats = engine.prefill([prompt], engine.new_cache(1))
    ids = np.sort(np.asarray(stats[0].routed_ids)[:, : len(prompt)], axis=-1)  # [L, T, k]
    want = np.sort(exp["long_router_topk"], axis=-1)
    assert ids.shape == want.shape == (8, 300, 2)
    assert (ids == want).mean() == 1.0


def test_text_prompt_tokenizer(name):
    model, exp = load_fixture(name)
    assert model.tokenizer.encode(str(exp["text_prompt"])).ids == exp["text_prompt_ids"].tolist()


def test_chunked_prefill_in_pieces_matches_transformers():
    """A prompt prefilled in 64-token calls carries the conv and recurrent state between calls."""
    model, exp = load_fixture("qwen3_5_moe_fp32")
    engine = Engine(model, EngineConfig("resident", max_seq_len=384, prefill_chunk=64))
    res = engine.generate([exp["long_prompt_ids"].tolist()], max_new_tokens=4, keep_logits=True)
    assert res.generated_ids[0] == exp["long_generated_ids"][:4].tolist()
    want = exp["long_step_logits"][:4]
    np.testing.assert_allclose(res.step_logits[:, 0], want, rtol=0, atol=_tol(want))


# ---- every offload mode bit-identical to resident ---------------------------------------------
STEPS = 120


@pytest.fixture(scope="module")
def resident_runs():
    return {}


def _run(model, prompt, steps=STEPS, miss=None, **config):
    engine = Engine(model, EngineConfig(max_seq_len=448, **config), miss=miss)
    return engine.generate([prompt], max_new_tokens=steps, keep_logits=True), engine


def _resident(cache, name, which="short"):
    if (name, which) not in cache:
        model, exp = load_fixture(name)
        cache[name, which] = _run(model, exp[f"{which}_prompt_ids"].tolist())[0]
    return cache[name, which]


@pytest.mark.parametrize("slots_rule", ["E", "E+1", "2E", "L*E"])
def test_cached_decode_bit_identical(name, slots_rule, resident_runs):
    model, exp = load_fixture(name)
    e, le = model.cfg.num_experts, model.cfg.num_layers * model.cfg.num_experts
    slots = {"E": e, "E+1": e + 1, "2E": 2 * e, "L*E": le}[slots_rule]
    want = _resident(resident_runs, name)
    got, engine = _run(model, exp["short_prompt_ids"].tolist(), experts="cached", num_slots=slots)
    assert got.generated_ids == want.generated_ids
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = engine.expert_cache_metrics()
    if slots == e:  # the smallest cache really evicts and refetches
        assert m["misses"] > le


@pytest.mark.parametrize("policy", ["lookahead", "lfru"])
def test_cache_policies_and_on_demand_bit_identical(policy, resident_runs):
    model, exp = load_fixture("qwen3_5_moe_fp32")
    e, prompt = model.cfg.num_experts, exp["short_prompt_ids"].tolist()
    want = _resident(resident_runs, "qwen3_5_moe_fp32")
    got, engine = _run(model, prompt, experts="cached", num_slots=e + 1, cache_policy=policy)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert engine.expert_cache_metrics()["misses"] > 0
    if policy == "lookahead":
        got, engine = _run(model, prompt, experts="on_demand", num_slots=e)
        np.testing.assert_array_equal(got.step_logits, want.step_logits)
        assert engine.expert_cache_metrics()["hits"] == 0


@pytest.mark.parametrize("prefill,overlap", [("stream", True), ("stream", False), ("on_demand", True)])
def test_long_prompt_prefill_modes_bit_identical(prefill, overlap, resident_runs):
    """300-token prompt: whole-layer streaming (both buffers), or on-demand loading, then decode."""
    model, exp = load_fixture("qwen3_5_moe_fp32")
    e = model.cfg.num_experts
    want = _resident(resident_runs, "qwen3_5_moe_fp32", "long")
    got, engine = _run(model, exp["long_prompt_ids"].tolist(), experts="cached", num_slots=2 * e, prefill=prefill,
                       prefill_overlap=overlap)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert got.generated_ids[0][:16] == exp["long_generated_ids"].tolist()
    if prefill == "stream":
        m = engine.expert_cache_metrics()["prefill"]
        assert m["bytes_h2d"] == (model.cfg.num_layers * e + (e if overlap else 0)) * model.expert_bytes


def test_cpu_and_adaptive_misses_bit_identical(resident_runs):
    """Misses computed on the host (the miss-policy strategies of the expert_fn seam)."""
    from ftjax.experts import cpu_experts, miss_policy

    model, exp = load_fixture("qwen3_5_moe_fp32")
    want = _resident(resident_runs, "qwen3_5_moe_fp32")
    cpu = cpu_experts.make_cpu_experts("compute_on", model.host_gate_up, model.host_down)
    for policy, kw in (("cpu", {}), ("adaptive", {"fixed_fetch": 1})):
        miss = miss_policy.build_runtime(policy, model.cfg.num_experts, cpu, **kw)
        got, _ = _run(model, exp["short_prompt_ids"].tolist(), steps=24, miss=miss, experts="cached",
                      num_slots=model.cfg.num_experts)
        np.testing.assert_allclose(got.step_logits, want.step_logits[:24], rtol=0, atol=_tol(want.step_logits))
        assert got.generated_ids[0] == want.generated_ids[0][:24]


def test_batch_of_different_lengths_matches_single():
    """Right padding must leave each sequence's conv and recurrent state exactly as its own
    tokens left them (padding gets beta = 0, decay 1)."""
    model, exp = load_fixture("qwen3_5_moe_fp32")
    base = exp["long_prompt_ids"].tolist()
    prompts = [base[:5], base[10:27], base[40:110], base[100:200]]
    e = model.cfg.num_experts
    engine = Engine(model, EngineConfig("cached", num_slots=e + 3, max_seq_len=256, batch=4))
    batched = engine.generate(prompts, max_new_tokens=12, keep_logits=True)
    for i, p in enumerate(prompts):
        alone = Engine(model, EngineConfig("cached", num_slots=e + 3, max_seq_len=256)).generate(
            [p], 12, keep_logits=True)
        assert alone.generated_ids[0] == batched.generated_ids[i]
        np.testing.assert_allclose(alone.step_logits[:, 0], batched.step_logits[:, i], rtol=0,
                                   atol=_tol(alone.step_logits))


# ---- the preset and the memory planner ---------------------------------------------------------
def test_preset_35b_a3b_shape_and_state_bytes():
    from ftjax.config import preset
    from ftjax.experts.planner import plan_memory

    cfg = preset("qwen3.5-35b-a3b")
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.expert_ffn) == (40, 256, 8, 2048, 512)
    assert (cfg.num_blocks, cfg.num_attention_layers, cfg.num_linear_layers) == (10, 10, 30)
    assert cfg.expert_bytes(2) == 6_291_456 and round(cfg.pool_bytes(2) / 1e9, 1) == 64.4
    assert cfg.rotary_dim == 64 and cfg.linear_conv_dim == 8192
    # state per sequence: K/V of the 10 attention layers only, plus conv (3 x 8192 bf16) and
    # recurrent (32 x 128 x 128 float32) state of the 30 DeltaNet layers
    kv = 2 * 10 * 1000 * 2 * 256 * 2
    linear = 30 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert cfg.kv_cache_bytes(1, 1000, 2) == kv + linear
    plan = plan_memory(cfg, 2, budget_bytes=int(40e9), max_seq_len=1000)
    assert plan.kv_cache_bytes == kv + linear
    assert plan.slots == (int(40e9) - plan.non_expert_bytes - plan.kv_cache_bytes - plan.workspace_bytes
                          - plan.layer_gather_bytes) // cfg.expert_bytes(2)
