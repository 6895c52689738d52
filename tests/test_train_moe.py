"""experiments/train_moe.py: the --smoke run trains, exports a checkpoint ftjax loads, and the
exported weights give the training forward's logits through ftjax's inference path; early stopping
exports the parameters of the best held-out loss, which ftjax's own forward reproduces.

One smoke run (a 4-layer, 8-expert model on 24 stdlib files, ~25 s on 2 CPU cores; tests/train_smoke.py)
is shared by every test of the session; one more short run (~20 s) is made to stop by patience.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from experiments import train_moe  # noqa: E402
from ftjax.checkpoint import load_checkpoint, load_tokenizer  # noqa: E402
from ftjax.config import EngineConfig  # noqa: E402
from ftjax import Engine  # noqa: E402
from cli_helpers import run_generate  # noqa: E402
from train_smoke import run_train_moe, smoke_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # a long end-to-end run: .ci/run runs it after the README's test command


@pytest.fixture(scope="module")
def smoke_dir():
    return smoke_checkpoint()


@pytest.fixture(scope="module")
def metrics(smoke_dir):
    with open(os.path.join(smoke_dir, "train_metrics.json")) as f:
        return json.load(f)


# A run that stops by patience: a high learning rate, an evaluation every 2 steps, patience 1.
PATIENCE_FLAGS = ["--steps=40", "--eval_every=2", "--patience=1", "--lr=0.05", "--warmup=1", "--log_every=100"]


@pytest.fixture(scope="module")
def patience_run(tmp_path_factory):
    """(checkpoint dir, train_metrics) of a --smoke run with PATIENCE_FLAGS."""
    out = str(tmp_path_factory.mktemp("train_patience") / "ckpt")
    proc = run_train_moe("--smoke", f"--out_dir={out}", *PATIENCE_FLAGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "train_metrics.json")) as f:
        return out, json.load(f)


def exported_heldout_loss(ckpt_dir: str, metrics: dict) -> float:
    """Mean held-out cross entropy (nats/token) of the exported checkpoint, recomputed through
    ftjax's inference forward (``Engine.prefill`` with all logits, float32 on the bf16 weights)
    on the run's held-out stream, cut into the windows the script evaluates."""
    model = load_checkpoint(ckpt_dir, "float32", progress=False)
    texts, _ = train_moe.load_corpus(metrics["flags"]["max_files"])
    stream = train_moe.encode_stream(model.tokenizer, texts["heldout"])
    seq_len = metrics["flags"]["seq_len"]
    windows = train_moe.eval_windows(stream, seq_len + 1, metrics["flags"]["eval_windows"])
    assert windows.shape[0] * seq_len == metrics["heldout_tokens_evaluated"] > 0
    engine = Engine(model, EngineConfig(max_seq_len=seq_len))
    logits, *_ = engine.prefill([w[:-1].tolist() for w in windows], engine.new_cache(len(windows)), all_logits=True)
    logits = np.asarray(logits, np.float64)
    assert logits.shape == (len(windows), seq_len, model.cfg.vocab_size)
    top = logits.max(-1)
    logz = top + np.log(np.exp(logits - top[..., None]).sum(-1))
    gold = np.take_along_axis(logits, windows[:, 1:, None].astype(np.int64), axis=-1)[..., 0]
    return float(np.mean(logz - gold))


def check_early_stopping_fields(m: dict) -> None:
    """The invariants of the early-stopping fields of one train_metrics.json."""
    flags = m["flags"]
    curve = m["heldout_curve"]
    losses = [e["loss"] for e in curve]
    assert m["stopped_by"] in ("patience", "time_budget_s", "steps")
    assert 0 < m["best_step"] <= m["steps_done"] <= flags["steps"]
    assert m["best_heldout_loss"] == min(losses) == m["heldout_loss"]
    assert [e["step"] for e in curve if e["loss"] == min(losses)][0] == m["best_step"]
    assert m["heldout_perplexity"] == pytest.approx(math.exp(m["best_heldout_loss"]))
    assert m["last_heldout_loss"] == losses[-1] and curve[-1]["step"] == m["steps_done"]
    steps = [e["step"] for e in curve]
    assert steps == sorted(set(steps)) and all(s % flags["eval_every"] == 0 for s in steps[:-1])
    assert m["train_tokens_seen"] == m["steps_done"] * flags["batch"] * flags["seq_len"]
    assert m["epochs"] == pytest.approx(m["train_tokens_seen"] / m["corpus"]["train"]["tokens"])
    best_i = steps.index(m["best_step"])
    if m["stopped_by"] == "steps":
        assert m["steps_done"] == flags["steps"]
    if m["stopped_by"] == "patience":  # the last `patience` evaluations after the best did not improve on it
        assert len(curve) - 1 - best_i == flags["patience"] and m["steps_done"] < flags["steps"]
    else:
        assert len(curve) - 1 - best_i <= flags["patience"]


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


def test_smoke_early_stopping_fields(metrics):
    assert (metrics["flags"]["eval_every"], metrics["flags"]["patience"]) == (10, 5)
    check_early_stopping_fields(metrics)
    assert [e["step"] for e in metrics["heldout_curve"]] == [10, 20, 30, 40, 50, 60]
    assert metrics["train_tokens_seen"] == 60 * 8 * 64 and 0 < metrics["epochs"] < 1


def test_smoke_export_is_best_heldout(smoke_dir, metrics):
    """The exported checkpoint's held-out loss, through ftjax's forward, is best_heldout_loss."""
    got = exported_heldout_loss(smoke_dir, metrics)
    assert got == pytest.approx(metrics["best_heldout_loss"], rel=1e-3)
    assert got < math.log(320) - 1.0  # a trained model, well below uniform


def test_patience_stops_and_exports_best_not_last(patience_run):
    ckpt, m = patience_run
    check_early_stopping_fields(m)
    assert m["stopped_by"] == "patience"
    assert m["best_step"] < m["steps_done"] < 40
    assert m["last_heldout_loss"] > m["best_heldout_loss"] * (1 + 5e-3)  # the last params are measurably worse
    got = exported_heldout_loss(ckpt, m)
    assert got == pytest.approx(m["best_heldout_loss"], rel=1e-3)
    assert got != pytest.approx(m["last_heldout_loss"], rel=1e-3)
    with open(os.path.join(ckpt, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_lr_schedule_depends_on_step_only():
    peak, warmup, steps = 2e-3, 100, 550
    lrs = [train_moe.lr_at(s, steps, peak, warmup) for s in range(steps + 1)]
    assert lrs[0] == pytest.approx(peak / warmup) and lrs[warmup - 1] == pytest.approx(peak)
    assert lrs[warmup] == pytest.approx(peak) and lrs[steps] == pytest.approx(0.1 * peak)
    assert all(a <= b for a, b in zip(lrs[:warmup], lrs[1:warmup]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))  # cosine falls
    assert lrs[(warmup + steps) // 2] == pytest.approx(0.55 * peak)  # halfway down the cosine


def test_size_defaults_bound_epochs():
    """small's planned run is at most ~12 epochs of a 3.0M-token train split; the safety-net budget is 240 s."""
    small = train_moe.SIZES["small"]
    assert small.steps * small.batch * small.seq_len / 3.0e6 <= 12.1
    assert small.time_budget_s == 240 and small.eval_every == 100


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
    engine = Engine(model, EngineConfig(max_seq_len=64))
    logits, *_ = engine.prefill([prompt], engine.new_cache(1), all_logits=True)
    got = np.asarray(logits)[0, : len(prompt)]
    assert got.shape == (len(prompt), 320) and np.isfinite(got).all()

    train_params = train_moe.params_from_loaded(model)
    want, aux, ids, hs = train_moe.forward_train(train_params, cfg, jnp.asarray([prompt], jnp.int32))
    want = np.asarray(want)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max() + 1e-5)
    assert ids.shape == (4, len(prompt), 2) and hs.shape == (4, 1, len(prompt), 32) and np.isfinite(float(aux))


def test_generate_default_demo_uses_trained_model(smoke_dir, tmp_path, monkeypatch):
    """``python -m ftjax.generate`` with no model flag runs DEFAULT_CHECKPOINT (pointed here at the
    smoke checkpoint) on DEFAULT_PROMPT with an expert cache of 2E slots, and its greedy ids are
    the resident engine's."""
    from ftjax import generate
    metrics = tmp_path / "m.json"
    monkeypatch.setattr(generate, "DEFAULT_CHECKPOINT", smoke_dir)
    proc = run_generate("--max_new_tokens=8", f"--metrics_json={metrics}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(metrics.read_text())
    model = load_checkpoint(smoke_dir, progress=False)
    prompt = model.tokenizer.encode(generate.DEFAULT_PROMPT).ids
    assert m["model"] == smoke_dir and m["prompt_ids"] == prompt
    assert m["experts_mode"] == "cached" and m["memory_plan"]["slots"] == 16 < m["memory_plan"]["pool_slots"] == 32
    want = Engine(model, EngineConfig(max_seq_len=128)).generate([prompt], max_new_tokens=8).generated_ids[0]
    assert m["generated_ids"] == want
    assert "prompt: import os\nimport sys" in proc.stdout and "text:" in proc.stdout

