"""The GPU scripts under experiments/ run end to end on the CPU at the tiny preset.

They are what reproduces the committed figures, so they must not rot between GPU sessions. Each
test runs the script's documented CPU smoke command in a subprocess and checks the JSON it wrote:
the metadata anyone comparing runs needs, no failed run, and values that hold on the CPU backend
(every offload path bit-identical to resident, hit and split counters consistent).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, out_dir: pathlib.Path, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"), f"--out_dir={out_dir}", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(out_dir.glob(f"{script}*.json"))
    assert len(files) == 1, f"expected one JSON from {script}, got {files}"
    return json.loads(files[0].read_text())


def _meta(d: dict) -> dict:
    """The one result writer's provenance: meta (with the git commit) and the script's flags."""
    assert d["meta"]["git_commit"] and d["flags"]["out_dir"], (d["meta"], d.get("flags"))
    return d["meta"]


def test_bench_decode_smoke(tmp_path):
    d = _run("bench_decode", tmp_path, "--preset=tiny", "--dtype=float32", "--steps=8", "--prompt_len=32",
             "--vram_budget_gb=1.02")
    assert _meta(d)["device"] and _meta(d)["jax"]
    rows = {(r["mode"], r["batch"]): r for r in d["results"]}
    assert set(rows) == {(m, b) for m in ("cached", "on_demand", "resident") for b in (1, 4)}
    for (mode, _), r in rows.items():
        assert "error" not in r and r["decode_tokens_per_s"] > 0
        if mode == "resident":
            assert r["hit_rate_decode"] == 1.0
        elif mode == "on_demand":
            assert r["hit_rate_decode"] == 0.0 and r["h2d_bytes_per_step"] > 0
        else:
            assert 0.0 < r["hit_rate_decode"] < 1.0


def test_bench_prefill_smoke(tmp_path):
    d = _run("bench_prefill", tmp_path, "--preset=tiny", "--dtype=float32", "--lengths=64,256", "--prefill_chunk=128",
             "--vram_budget_gb=1.02")
    assert d["logits_max_abs_diff_vs_resident"] == {"stream": 0.0, "stream_no_overlap": 0.0, "on_demand": 0.0,
                                                    "resident": 0.0}
    for r in d["results"]:
        assert "error" not in r, r
        assert r["streamed"] == r["variant"].startswith("stream")
        assert (r["h2d_bytes"] > 0) == (r["variant"] != "resident")


def test_bench_kv_reuse_smoke(tmp_path):
    d = _run("bench_kv_reuse", tmp_path, "--preset=tiny", "--dtype=float32", "--prefix_tokens=192",
             "--suffix_tokens=64", "--chunk_tokens=32", "--prefill_chunk=128", "--expert_slots=32",
             "--kv_host_gb=0.1", "--h2d_mb=16")
    assert _meta(d)["device"] and _meta(d)["jax"]
    for r in d["results"]:
        assert r["store_request"]["chunks_stored"] == 192 // 32
        for load in ("prefetch", "all_first"):
            assert r[load]["reused_tokens"] == 192 and r[load]["hit_chunks"] == 192 // 32
            assert r[load]["bytes_loaded"] > 0


def test_bench_miss_policy_smoke(tmp_path):
    d = _run("bench_miss_policy", tmp_path, "--preset=tiny", "--steps=6", "--impls=compute_on", "--budgets_gb=8",
             "--temperature=0")
    assert _meta(d)["device"] and _meta(d)["jax"] and d["calibration"]["entry"]["impls"]["compute_on"]["ok"]
    runs = {r["policy"]: r for r in d["runs"]}
    assert set(runs) == {"fetch", "cpu", "adaptive", "adaptive-qstar"}
    for pol, r in runs.items():
        assert "error" not in r, r
        assert r["fetched_decode"] + r["cpu_decode"] == r["misses_decode"]
        assert r["tpot_s"]["p10"] <= r["tpot_s"]["median"] <= r["tpot_s"]["p90"]
        if pol != "fetch":  # CPU and device arithmetic are the same XLA:CPU here
            assert r["max_abs_logit_diff_vs_fetch"] == 0.0 and r["tokens_match_fetch"] == 6
    assert runs["fetch"]["cpu_decode"] == 0 and runs["fetch"]["misses_decode"] > 0
    assert runs["cpu"]["fetched_decode"] == 0 and runs["cpu"]["hit_rate_decode"] == 0.0
    assert d["summary"][0]["fetch"]["tokens_per_s_median_tpot"] > 0
