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
