"""The trained model (``ftjax/assets/stdlib_moe``, made by experiments/train_moe.py) against
transformers: ``expected.npz`` written beside it by scripts/make_trained_expected.py.

Tolerance as the fixtures' (tests/test_oracle.py): |ours - transformers| <= 2e-5 * max|logit| +
1e-5, float32 on both sides (bfloat16 weights upcast). ``FTJAX_TRAINED_CKPT`` points the tests at
another trained checkpoint directory (e.g. a smoke run with its own expected.npz). The module is
skipped while the directory or its expected.npz is absent (before the GPU-trained artefact is
committed).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ftjax.checkpoint import load_checkpoint
from ftjax.config import EngineConfig
from ftjax import Engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.environ.get("FTJAX_TRAINED_CKPT", os.path.join(REPO, "ftjax", "assets", "stdlib_moe"))
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(CKPT, "expected.npz")),
                                reason=f"{CKPT}/expected.npz absent (train with experiments/train_moe.py, then "
                                       f"scripts/make_trained_expected.py)")


@pytest.fixture(scope="module")
def trained():
    model = load_checkpoint(CKPT, "float32", progress=False)
    with np.load(os.path.join(CKPT, "expected.npz")) as z:
        exp = {k: z[k] for k in z.files}
    return model, exp


def _tol(expected: np.ndarray) -> float:
    return 2e-5 * float(np.abs(expected).max()) + 1e-5


def test_tokenizer_matches(trained):
    model, exp = trained
    ids = [1] + model.tokenizer.encode(str(exp["prompt_text"]), add_special_tokens=False).ids
    assert ids == exp["prompt_ids"].tolist()


def test_prompt_logits_all_positions(trained):
    model, exp = trained
    prompt = exp["prompt_ids"].tolist()
    engine = Engine(model, EngineConfig("resident", max_seq_len=len(prompt) + 32))
    logits, *_ = engine.prefill([prompt], engine.new_cache(1), all_logits=True)
    got = np.asarray(logits)[0, : len(prompt)]
    np.testing.assert_allclose(got, exp["prompt_logits"], rtol=0, atol=_tol(exp["prompt_logits"]))


def test_greedy_with_expert_cache_smaller_than_pool(trained):
    """The demo's path: cached experts, S = 2E slots of L*E, greedy ids and every step's logits."""
    model, exp = trained
    prompt = exp["prompt_ids"].tolist()
    cfg = model.cfg
    engine = Engine(model, EngineConfig("cached", num_slots=2 * cfg.num_experts, max_seq_len=len(prompt) + 32))
    res = engine.generate([prompt], max_new_tokens=16, keep_logits=True)
    assert res.generated_ids[0] == exp["generated_ids"].tolist()
    np.testing.assert_allclose(res.step_logits[:, 0], exp["step_logits"], rtol=0, atol=_tol(exp["step_logits"]))


def test_prompt_routing_matches(trained):
    model, exp = trained
    prompt = exp["prompt_ids"].tolist()
    engine = Engine(model, EngineConfig("resident", max_seq_len=len(prompt) + 32))
    _, _, _, stats = engine.prefill([prompt], engine.new_cache(1))
    ids = np.sort(np.concatenate([np.asarray(s.routed_ids) for s in stats], axis=1)[:, : len(prompt)], axis=-1)
    want = np.sort(exp["prompt_router_topk"], axis=-1)
    assert ids.shape == want.shape
    assert (ids == want).mean() == 1.0
