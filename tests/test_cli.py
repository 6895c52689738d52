"""The `python -m ftjax.generate` command end to end, and its errors on bad input.

The demo run is the real command in a child process; the others run its ``main`` in this
process (tests/cli_helpers.py: the same flag parsing, exit status and output)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cli_helpers import CliResult, run_generate
from conftest import fixture_path, load_fixture
from ftjax.checkpoint import CheckpointError, load_checkpoint


def _run(*args: str) -> CliResult:
    """``python -m ftjax.generate --noprogress *args``, run in this process (tests/cli_helpers.py)."""
    return run_generate(*args)


def _run_process(*args: str) -> subprocess.CompletedProcess:
    """The real entry point in a child process: the README's main job, end to end."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "ftjax.generate", "--noprogress", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_generate_fixture_writes_metrics_and_logits(tmp_path):
    _, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["short_prompt_ids"].tolist()
    metrics, logits = tmp_path / "m.json", tmp_path / "l.npy"
    r = _run(f"--checkpoint={fixture_path('qwen3_moe_fp32')}", f"--prompt_ids={','.join(map(str, prompt))}",
             "--dtype=float32", "--temperature=0", "--max_new_tokens=16", "--expert_slots=8",
             f"--metrics_json={metrics}", f"--logits_npy={logits}")
    assert r.returncode == 0, r.stderr
    m = json.loads(metrics.read_text())
    assert m["prompt_ids"] == prompt
    assert m["generated_ids"] == exp["short_generated_ids"].tolist()
    for key in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert m[key] > 0
    ec = m["expert_cache"]
    assert ec["slots"] == 8 and ec["hits"] + ec["misses"] > 0 and 0 <= ec["hit_rate"] <= 1
    assert len(ec["hit_rate_per_layer"]) == 3
    got = np.load(logits)
    assert got.dtype == np.float32 and got.shape == (16, 384)
    assert np.abs(got - exp["short_step_logits"]).max() < 1e-3
    assert "memory plan" in r.stdout and "TTFT" in r.stdout
    assert m["prefill_driver_calls"] == {"scan": 1, "pipelined": 0}  # "auto" on the CPU: the scan


def test_run_stopped_at_eos_records_only_the_emitted_steps(tmp_path):
    """A copy of a fixture whose generation_config.json names the second greedy token and a real
    model's EOS id (151645, outside this vocabulary): the latter is ignored with a warning (the
    checkpoint is not refused), and the run stops after 2 tokens. The decode step run after the EOS
    (decode checks one token late) is in none of the outputs: --logits_npy and --trace_routing have
    2 steps and the expert-cache counters are those of a 2-token run."""
    _, exp = load_fixture("qwen3_moe_fp32")
    prompt, greedy = exp["short_prompt_ids"].tolist(), exp["short_generated_ids"].tolist()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture_path("qwen3_moe_fp32"), ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[1], 151645]}))
    common = (f"--prompt_ids={','.join(map(str, prompt))}", "--dtype=float32", "--expert_slots=8")

    def run(ckpt_dir, name, *args):
        out = {k: tmp_path / f"{name}.{k}" for k in ("json", "npy", "npz")}
        r = _run(f"--checkpoint={ckpt_dir}", *common, *args, f"--metrics_json={out['json']}",
                 f"--logits_npy={out['npy']}", f"--trace_routing={out['npz']}")
        assert r.returncode == 0, r.stderr
        with np.load(out["npz"]) as z:
            routing = {k: z[k] for k in z.files}
        return r, json.loads(out["json"].read_text()), np.load(out["npy"]), routing

    r, m, logits, routing = run(ckpt, "eos", "--max_new_tokens=4")
    assert (f"ftjax.generate: warning: {ckpt}/generation_config.json: 'eos_token_id' id 151645 is outside the "
            f"vocabulary [0, 384)") in r.stderr
    assert m["generated_ids"] == greedy[:2] and m["stop_reasons"] == ["eos"]
    assert logits.shape == (2, 384) and np.abs(logits - exp["short_step_logits"][:2]).max() < 1e-3
    cfg = load_fixture("qwen3_moe_fp32")[0].cfg
    assert sorted(routing) == ["num_experts", "num_layers", "step0", "step1", "top_k"]  # ftjax.routing_trace
    assert [int(routing[k]) for k in ("num_layers", "num_experts", "top_k")] == [cfg.num_layers, cfg.num_experts,
                                                                                 cfg.top_k]
    assert routing["step0"].shape[0] == cfg.num_layers and routing["step1"].shape[2] == cfg.top_k
    # the same two steps run without EOS: the same logits, routing and counters
    _, ref, ref_logits, ref_routing = run(fixture_path("qwen3_moe_fp32"), "ref", "--max_new_tokens=2", "--ignore_eos")
    np.testing.assert_array_equal(logits, ref_logits)
    for k in routing:
        np.testing.assert_array_equal(routing[k], ref_routing[k])
    for phase in ("decode", "prefill"):
        got, want = m["expert_cache"][phase], ref["expert_cache"][phase]
        assert (got["hits"], got["misses"], got["bytes_h2d"]) == (want["hits"], want["misses"], want["bytes_h2d"])
    assert m["expert_cache"]["decode"]["hits"] + m["expert_cache"]["decode"]["misses"] > 0


def test_generate_text_prompt_prints_text():
    r = _run(f"--checkpoint={fixture_path('mixtral_fp32')}", "--prompt=The quick brown fox", "--max_new_tokens=4")
    assert r.returncode == 0, r.stderr
    assert "text:" in r.stdout


def test_default_demo_runs_with_cache_smaller_than_pool(tmp_path):
    r = _run_process("--max_new_tokens=8", "--nostream_d2d_hits", "--prefix_copy=in_program",
             f"--metrics_json={tmp_path / 'm.json'}")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    plan = m["memory_plan"]
    assert m["experts_mode"] == "cached" and plan["slots"] < plan["pool_slots"]
    assert m["expert_cache"]["bytes_h2d"] > 0
    assert m["engine"]["stream_d2d_hits"] is False and m["engine"]["prefix_copy"] == "in_program"
    for phase in (m["expert_cache"], m["expert_cache"]["prefill"], m["expert_cache"]["decode"]):
        assert phase["d2d_copies"] == phase["bytes_d2d"] == 0


@pytest.mark.parametrize("args,message", [
    (["--checkpoint=/nonexistent/ckpt"], "does not exist"),
    (["--prompt_ids=1,2,99999"], "outside the vocabulary"),
    (["--prompt_ids=1,x"], "must be integers"),
    (["--prompt_len=2040", "--max_new_tokens=16"], "max_position_embeddings"),
    (["--expert_slots=3"], "out of range"),
    (["--expert_slots=0"], "--expert_slots must be at least E, the model's experts per layer, got 0"),
    (["--preset=tiny", "--vram_budget_gb=0.1"], "minimum budget"),
    (["--preset=tiny", "--prompt=hi"], "tokenizer"),  # the trained default model has a tokenizer
    (["--temperature=nan"], "finite --temperature"),
    (["--vram_budget_gb=inf"], "finite number"),
    (["--prompt_len=0"], "--prompt_len must be >= 1"),
    (["--decode_block=0"], "--decode_block must be >= 1"),
    (["--kernels=grouped_matmul_pool"], "needs grouped_matmul_triton selected too"),
    (["--kernels=bogus"], "--kernels: unknown kernel 'bogus'; expected one of "),  # the flag, not the config field
    (["--kernel_tiles=dense_decode:64/128"], "--kernel_tiles: tiles of kernel 'dense_decode'"),
    (["--miss_copy=kernel"], "--miss_copy=kernel: the slot-copy kernel needs a GPU backend, not cpu"),
    (["--seed=99999999999999999999"], "--seed must be in"),
    (["--logits_npy=/nonexistent/l.npy"], "not a writable file path"),
    (["stray"], "unexpected arguments: stray"),
])
def test_bad_input_one_line_error(args, message, tmp_path):
    metrics = tmp_path / "m.json"
    r = _run(*args, f"--metrics_json={metrics}")
    assert r.returncode == 1
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3  # the error, not a usage text
    assert not metrics.exists()  # nothing half-written


def test_checkpoint_errors(tmp_path):
    src = fixture_path("qwen3_moe_fp32")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    os.remove(dst / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(str(dst), progress=False)
    (dst / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot open safetensors"):
        load_checkpoint(str(dst), progress=False)
    # a config whose sizes disagree with the tensors: shape mismatch names the tensor
    shutil.copy(os.path.join(src, "model.safetensors"), dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight' has shape \(32, 64\), expected \(48, 64\)"):
        load_checkpoint(str(dst), progress=False)
    # a missing tensor
    cfg["moe_intermediate_size"] = 32
    cfg["num_local_experts"] = 9
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        load_checkpoint(str(dst), progress=False)


def test_sharded_checkpoint_same_weights_as_single():
    single, _ = load_fixture("qwen3_moe_fp32")
    sharded, _ = load_fixture("qwen3_moe_sharded")
    np.testing.assert_array_equal(np.asarray(single.host_gate_up), np.asarray(sharded.host_gate_up))
    np.testing.assert_array_equal(np.asarray(single.params["lm_head"]), np.asarray(sharded.params["lm_head"]))
    assert sharded.host_gate_up.sharding.memory_kind in ("pinned_host", "unpinned_host")


def test_on_demand_run_reports_no_cache_instead_of_a_zero_hit_rate():
    r = _run("--preset=tiny", "--experts=on_demand", "--max_new_tokens=3", "--prompt_len=8")
    assert r.returncode == 0, r.stderr
    assert "experts on demand (no cache kept between steps)" in r.stdout and "hit rate" not in r.stdout


def test_help_exits_zero_and_flag_errors_stay_one(monkeypatch):
    """absl's ``app.run`` exits with 1 after printing the usage for ``--help``; ``ftjax.absl_app.run`` (every CLI's
    and experiment script's entry point) makes that 0, and leaves every other status as it was."""
    from absl import app
    from ftjax import absl_app
    assert absl_app.asks_for_help(["prog", "--help"]) and absl_app.asks_for_help(["prog", "--x=1", "--helpfull"])
    assert absl_app.asks_for_help(["prog", "-?"]) and absl_app.asks_for_help(["prog", "--helpshort=true"])
    assert not absl_app.asks_for_help(["prog", "--help=false"]) and not absl_app.asks_for_help(["prog", "--", "--help"])
    assert not absl_app.asks_for_help(["--help"])  # the program's own name is not a flag
    codes = []

    def fake_run(main, argv=None, **kw):
        codes.append(list(argv))
        raise SystemExit(1)

    monkeypatch.setattr(app, "run", fake_run)
    with pytest.raises(SystemExit) as e:
        absl_app.run(lambda argv: None, ["prog", "--helpshort"])
    assert e.value.code == 0 and codes == [["prog", "--helpshort"]]
    with pytest.raises(SystemExit) as e:  # a bad flag, or main exiting 1: unchanged
        absl_app.run(lambda argv: None, ["prog", "--bogus=1"])
    assert e.value.code == 1


def test_the_demo_checkpoint_is_recognised_however_its_path_is_spelled(tmp_path):
    """The demo model's built-in prompt follows the model, not the spelling of --checkpoint: a relative path (as the
    README writes it) and a link name it too; another folder does not."""
    from ftjax import generate
    demo = generate.DEFAULT_CHECKPOINT
    link = tmp_path / "demo"
    link.symlink_to(demo)
    assert generate.is_demo_checkpoint(demo) and generate.is_demo_checkpoint(str(link))
    assert generate.is_demo_checkpoint(os.path.relpath(demo))
    assert not generate.is_demo_checkpoint(str(tmp_path)) and not generate.is_demo_checkpoint("preset:tiny")
