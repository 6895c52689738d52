"""experiments/train_moe.py: the --smoke run trains, exports a checkpoint ftjax loads, and the
exported weights give the training forward's logits through ftjax's inference path.

One smoke run (a 4-layer, 8-expert model on 24 stdlib files, ~25 s on 2 CPU cores; tests/train_smoke.py)
is shared by every test of the session.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from experiments import train_moe  # noqa: E402
from ftjax.checkpoint import load_checkpoint, load_tokenizer  # noqa: E402
from ftjax.engine import Engine  # noqa: E402
from train_smoke import smoke_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def smoke_dir():
    return smoke_checkpoint()


@pytest.fixture(scope="module")
def metrics(smoke_dir):
    with open(os.path.join(smoke_dir, "train_metrics.json")) as f:
        return json.load(f)


def test_outputs_written(smoke_dir):
    names = set(os.listdir(smoke_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "train_metrics.json", "loss.png"} <= names
    with open(os.path.join(smoke_dir, "config.json")) as f:
        c = json.load(f)
    assert c["model_type"] == "qwen3_moe" and c["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (c["num_local_experts"], c["num_experts_per_tok"], c["num_hidden_layers"]) == (8, 2, 4)
    assert c["norm_topk_prob"] is True and c["mlp_only_layers"] == [] and c["decoder_sparse_step"] == 1
    assert c["router_aux_loss_coef"] == 0.01 and c["dtype"] == "bfloat16"
    with open(os.path.join(smoke_dir, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_loss_went_down(metrics):
    first = metrics["loss_curve"][0]["ce"]
    assert abs(first - math.log(320)) < 0.3  # starts near uniform over the 320-token vocabulary
    assert metrics["loss_curve"][-1]["ce"] < first - 1.0
    assert metrics["heldout_loss"] < first - 1.0
    assert metrics["heldout_perplexity"] == pytest.approx(math.exp(metrics["heldout_loss"]))
    assert metrics["steps_done"] == 60 and metrics["stopped_by"] == "steps"


def test_corpus_stats(metrics):
    c = metrics["corpus"]
    assert c["python"] == ".".join(map(str, sys.version_info[:3]))
    assert c["train"]["files"] + c["heldout"]["files"] + c["files_skipped_not_utf8"] == 24
    assert c["heldout"]["files"] >= 1 and c["train"]["tokens"] > 10 * c["heldout"]["tokens"] > 0
    assert c["train"]["bytes"] > c["train"]["tokens"]  # BPE merges: more than one byte per token


def test_heldout_split_is_about_two_percent():
    root, files = train_moe.stdlib_files()
    held = [train_moe.is_heldout(p.relative_to(root).as_posix()) for p in files]
    assert len(files) > 500
    assert 0.01 < np.mean(held) < 0.035
    assert train_moe.is_heldout("os.py") == train_moe.is_heldout("os.py")


def test_tokenizer_roundtrip(smoke_dir):
    tok = load_tokenizer(smoke_dir)
    text = "def f(x):\n    return x + 1  # café\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(s) for s in ("<pad>", "<s>", "</s>")] == [0, 1, 2]


def test_ftjax_loads_and_matches_training_forward(smoke_dir):
    """ftjax's inference forward on the exported bf16 weights (upcast to float32) equals the
    training forward run on the same weights, at every position."""
    model = load_checkpoint(smoke_dir, "float32", progress=False)
    cfg = model.cfg
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.vocab_size) == (4, 8, 2, 320)
    assert cfg.norm_topk_prob and cfg.qk_norm == "per_head"
    prompt = model.tokenizer.encode("import os\n\ndef main(argv):\n    return len(argv)\n").ids
    engine = Engine(model, "resident", max_seq_len=64)
    logits, *_ = engine.prefill([prompt], engine.new_cache(1), all_logits=True)
    got = np.asarray(logits)[0, : len(prompt)]
    assert got.shape == (len(prompt), 320) and np.isfinite(got).all()

    train_params = train_moe.params_from_loaded(model)
    want, aux, ids, hs = train_moe.forward_train(train_params, cfg, jnp.asarray([prompt], jnp.int32))
    want = np.asarray(want)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max() + 1e-5)
    assert ids.shape == (4, len(prompt), 2) and hs.shape == (4, 1, len(prompt), 32) and np.isfinite(float(aux))


def test_generate_default_demo_uses_trained_model(smoke_dir, tmp_path):
    """``python -m ftjax.generate`` with no model flag runs DEFAULT_CHECKPOINT (pointed here at the
    smoke checkpoint) on DEFAULT_PROMPT with an expert cache of 2E slots, and its greedy ids are
    the resident engine's."""
    from ftjax import generate
    metrics = tmp_path / "m.json"
    code = ("import sys; from absl import app; from ftjax import generate; generate.DEFAULT_CHECKPOINT = sys.argv[1]; "
            "app.run(generate.main, argv=['generate', '--noprogress', '--max_new_tokens=8', "
            "'--metrics_json=' + sys.argv[2]])")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, smoke_dir, str(metrics)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(metrics.read_text())
    model = load_checkpoint(smoke_dir, progress=False)
    prompt = model.tokenizer.encode(generate.DEFAULT_PROMPT).ids
    assert m["model"] == smoke_dir and m["prompt_ids"] == prompt
    assert m["experts_mode"] == "cached" and m["memory_plan"]["slots"] == 16 < m["memory_plan"]["pool_slots"] == 32
    want = Engine(model, "resident", max_seq_len=128).generate([prompt], max_new_tokens=8).generated_ids[0]
    assert m["generated_ids"] == want
    assert "prompt: import os\nimport sys" in proc.stdout and "text:" in proc.stdout

