"""The GPU scripts under experiments/ run end to end on the CPU at the tiny preset.

They are what reproduces the committed figures, so they must not rot between GPU sessions. Each
test runs the script's documented CPU smoke command and checks the JSON it wrote: the metadata
anyone comparing runs needs, no failed run, and values that hold on the CPU backend (every offload
path bit-identical to resident, hit and split counters consistent).

Most run the script's ``main`` in this process as its command line would (tests/cli_helpers.py:
the script's own flag namespace, its working directory and environment, empty compile caches
before and after, as in a process of its own). A child process is kept where one is needed:
scripts that compute misses with the CPU-callback mechanisms (synchronous CPU dispatch must be
set before JAX starts), and the HLO check that counts the engine's compiled programs.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from cli_helpers import CliResult, import_app, run_module_app
from conftest import drop_compiled_programs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_script(script: str, *args: str, env_extra: dict | None = None) -> CliResult:
    """``experiments/{script}.py *args`` (cwd: the repository) in this process, between empty
    compile caches as in a process of its own."""
    drop_compiled_programs()
    try:
        return run_module_app(f"experiments.{script}", args, program=str(ROOT / "experiments" / f"{script}.py"),
                              cwd=str(ROOT), env=env_extra)
    finally:
        drop_compiled_programs()


def _run(script: str, out_dir: pathlib.Path, *flags: str, env_extra: dict | None = None,
         process: bool = False) -> dict:
    """The script's JSON from one run; ``process``: in a child process (``python experiments/...``)."""
    if process:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **(env_extra or {}))
        proc = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"), f"--out_dir={out_dir}",
                               *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    else:
        proc = _run_script(script, f"--out_dir={out_dir}", *flags, env_extra=env_extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(out_dir.glob(f"{script}*.json"))
    assert len(files) == 1, f"expected one JSON from {script}, got {files}"
    return json.loads(files[0].read_text())


def _meta(d: dict) -> dict:
    """The one result writer's provenance: meta (with the git commit) and the script's flags."""
    assert d["meta"]["git_commit"] and d["flags"]["out_dir"], (d["meta"], d.get("flags"))
    return d["meta"]


@pytest.mark.slow
def test_bench_decode_smoke(tmp_path):
    # one-row projections padded to 2 rows (the GPU default is 4, the CPU's 0): the engine runs the
    # padded path end to end, and the result records the setting
    d = _run("bench_decode", tmp_path, "--preset=tiny", "--dtype=float32", "--steps=8", "--prompt_len=32",
             "--vram_budget_gb=1.02", "--min_dot_rows=2")
    assert _meta(d)["device"] and _meta(d)["jax"]
    assert all(r["engine"]["kernels"]["min_dot_rows"] == 2 for r in d["results"])
    rows = {(r["mode"], r["batch"]): r for r in d["results"]}
    assert set(rows) == {(m, b) for m in ("cached", "on_demand", "resident") for b in (1, 4)}
    for (mode, _), r in rows.items():
        assert "error" not in r and r["decode_tokens_per_s"] > 0
        assert r["decode_tokens_per_s_median_tpot"] == pytest.approx(r["batch"] / r["tpot_s"]["median"])
        slow = r["slowest_steps_ms"]  # [step index, ms], slowest first; the slowest is the max
        assert len(slow) == 3 and slow[0][1] == pytest.approx(r["tpot_s"]["max"] * 1e3, abs=1e-3)
        assert slow[0][1] >= slow[1][1] >= slow[2][1] and all(0 <= i < 8 for i, _ in slow)
        if mode == "resident":
            assert r["hit_rate_decode"] == 1.0
        elif mode == "on_demand":
            assert r["hit_rate_decode"] == 0.0 and r["h2d_bytes_per_step"] > 0
        else:
            assert 0.0 < r["hit_rate_decode"] < 1.0
        if mode != "resident":  # time / (resident step + miss bytes / B_P), from the same run
            bound = rows[("resident", r["batch"])]["tpot_s"]["median"] + r["h2d_bytes_per_step"] / (
                d["B_P"]["h2d_GBps"]["median"] * 1e9)
            assert r["ratio_to_bound"] == pytest.approx(r["tpot_s"]["median"] / bound)


@pytest.mark.slow
def test_bench_decode_expert_dtypes_smoke(tmp_path):
    d = _run("bench_decode", tmp_path, "--preset=tiny", "--dtype=float32", "--steps=4", "--prompt_len=16",
             "--vram_budget_gb=1.02", "--batches=1", "--modes=resident,cached",
             "--expert_dtypes=bfloat16,int8,int4,fp8")
    rows = {(r["expert_dtype"], r["mode"]): r for r in d["results"]}
    assert set(rows) == {(f, m) for f in ("bfloat16", "int8", "int4", "fp8") for m in ("resident", "cached")}
    eb = {f: rows[(f, "cached")]["expert_bytes"] for f in ("bfloat16", "int8", "int4", "fp8")}
    assert eb["bfloat16"] > max(eb["int8"], eb["fp8"]) and min(eb["int8"], eb["fp8"]) > eb["int4"]
    for (fmt, mode), r in rows.items():
        assert "error" not in r and r["decode_tokens_per_s"] > 0, r
        assert r["h2d_bytes_per_step"] * 4 == pytest.approx(r["misses_per_step"] * 4 * r["expert_bytes"])
        assert d["memory_plans"][f"{fmt}/b1/1.02gb"]["expert_bytes"] == r["expert_bytes"]
        assert r["speedup_vs_first_format"] > 0
        ref = rows[("bfloat16", mode)]
        assert r["speedup_vs_first_format_median_tpot"] == pytest.approx(
            ref["tpot_s"]["median"] / r["tpot_s"]["median"])


@pytest.mark.slow  # an experiment's smoke run (README: the slow selection)
def test_bench_decode_sweeps_budgets_in_one_process(tmp_path):
    """--vram_budgets_gb: one process builds the model once and writes one JSON with a row per budget, in the
    order given, each with the slots its plan gives (growing with the budget), and one resident row at the
    budget its plan needs; no engine keeps device memory past its setting."""
    from ftjax.config import preset
    from ftjax.runtime.planner import GB, plan_memory
    proc = _run_script("bench_decode", f"--out_dir={tmp_path}", "--preset=tiny", "--dtype=float32", "--steps=2",
                       "--prompt_len=8", "--batches=1", "--modes=cached,resident", "--vram_budgets_gb=1.015,1.01",
                       "--temperature=1.0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" built in ") == 1, proc.stdout[-3000:]
    d = json.loads((tmp_path / "bench_decode_tiny.json").read_text())
    assert "partial" not in d and d["budgets_gb"] == [1.015, 1.01] and d["flags"]["temperature"] == 1.0
    rows = d["results"]
    assert [(r["mode"], r["budget_gb"]) for r in rows] == [("cached", 1.015), ("cached", 1.01), ("resident", 1.018)]
    cfg = preset("tiny")  # prompt 8 + 3 new tokens: a KV cache of 128
    want = {b: plan_memory(cfg, 4, budget_bytes=int(b * GB), max_seq_len=128).slots for b in (1.01, 1.015)}
    assert cfg.num_experts <= want[1.01] < want[1.015] < cfg.num_layers * cfg.num_experts  # 26 < 52 < 64
    full = plan_memory(cfg, 4, slots=cfg.num_layers * cfg.num_experts, max_seq_len=128)
    assert math.ceil(full.budget_bytes / 1e6) / 1e3 == 1.018
    for r in rows:
        assert "error" not in r and r["decode_tokens_per_s"] > 0 and r["expert_dtype"] == "dense", r
        assert r["slots"] == r["engine"]["num_slots"] == want.get(r["budget_gb"], full.slots), r
        key = "resident" if r["mode"] == "resident" else f"{r['budget_gb']:g}gb"
        assert d["memory_plans"][f"dense/b1/{key}"]["slots"] == r["slots"]
        assert r["device_bytes_after"] == rows[0]["device_bytes_after"] > 0  # each engine's memory freed


@pytest.mark.parametrize("args,message", [
    (["--vram_budgets_gb=8,-1"], "expected budgets > 0 GB, got -1"),
    (["--vram_budgets_gb=8,12,8.0"], "budget 8.0 given twice"),
    (["--vram_budgets_gb=8,lots"], "expected budgets in GB (numbers > 0), got 8,lots"),
    (["--vram_budget_gb=0"], "expected a budget > 0 GB, got 0"),
    (["--vram_budget_gb=8", "--vram_budgets_gb=8,12"], "give --vram_budget_gb (one budget) or --vram_budgets_gb "
                                                        "(several), not both"),
    (["--cache_policies=lru,fifo"], "unknown 'fifo'; expected some of "),
    (["--expert_dtypes=bfloat16,int3"], "--expert_dtypes: each must be one of "),
], ids=["negative", "twice", "not-a-number", "zero", "both-flags", "policy", "format"])
def test_bench_decode_refuses_bad_lists_when_parsing(tmp_path, args, message):
    """A bad entry of a list flag stops bench_decode with one line when the flags are parsed (and absl's hint
    to ask for --help), nothing built."""
    proc = _run_script("bench_decode", f"--out_dir={tmp_path}", "--preset=tiny", "--dtype=float32", *args)
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("Pass --helpshort or --helpfull")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("FATAL Flags parsing error: ") and message in lines[0], lines[0]
    assert " built in " not in proc.stdout and not list(tmp_path.glob("*.json"))


def test_bench_decode_refuses_a_budget_below_the_minimum_before_building(tmp_path):
    """Every budget of a sweep is planned before the model is built: one below the plan's minimum stops the run
    at once, with one line naming it, the format and the batch, and the minimum budget."""
    from experiments import common
    r = run_module_app("experiments.bench_decode", [f"--out_dir={tmp_path}", "--preset=tiny", "--dtype=float32",
                                                    "--modes=cached", "--vram_budgets_gb=1.01,1.005"],
                       program=str(ROOT / "experiments" / "bench_decode.py"), cwd=str(ROOT), wrap=common.guard)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: --vram_budgets_gb: 1.005 GB (dense, batch 1): VRAM budget 1.005 GB leaves ")
    assert "the minimum budget is 1.01 GB" in lines[0], lines[0]
    assert " built in " not in r.stdout and not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_bench_prefill_smoke(tmp_path):
    d = _run("bench_prefill", tmp_path, "--preset=tiny", "--dtype=float32", "--lengths=64,256", "--prefill_chunk=128",
             "--vram_budget_gb=1.02", "--variants=stream,stream_no_overlap,stream_scan,stream_warm,stream_warm_no_d2d,"
             "resident", "--warm_decode_tokens=4")
    assert d["logits_max_abs_diff_vs_resident"] == {"stream": 0.0, "stream_no_overlap": 0.0, "stream_scan": 0.0,
                                                    "stream_warm": 0.0, "stream_warm_no_d2d": 0.0, "resident": 0.0}
    assert d["logits_max_abs_diff_d2d_on_vs_off"] == {"dense": 0.0}
    for r in d["results"]:
        assert "error" not in r, r
        assert r["streamed"] == r["variant"].startswith("stream")
        assert (r["h2d_bytes"] > 0) == (r["variant"] != "resident")
        assert (r["d2d_bytes"] > 0) == (r["variant"] == "stream_warm")
        assert r["expert_dtype"] == "dense" and r["pool_bytes"] == d["pool_bytes"] == 4 * 16 * 3 * 128 * 128 * 4
    for n in (64, 256):  # the same expert bytes reach the streamed layers, D2D or over PCIe
        on, off = ({r["variant"]: r for r in d["results"] if r["tokens"] == n}[v] for v in ("stream_warm",
                                                                                         "stream_warm_no_d2d"))
        assert on["h2d_bytes"] + on["d2d_bytes"] == off["h2d_bytes"] and "d2d_speedup" in on
    sys.path.insert(0, str(ROOT / "experiments"))
    import plots
    assert plots.plot(str(tmp_path / "bench_prefill_tiny.json"), str(tmp_path / "p.png"))


@pytest.mark.parametrize("flag", ["--repeats=0", "--warmups=-1"])
def test_bench_prefill_refuses_no_timed_call(tmp_path, flag):
    """No timed call (--repeats=0, or a negative --warmups eating one) is refused when the flags
    are parsed, before any model is built: it used to measure for minutes, then write rows with
    an empty ``ttft_s`` (NaN throughput) and die in the bound computation (KeyError 'median')."""
    proc = _run_script("bench_prefill", f"--out_dir={tmp_path}", "--preset=tiny", "--dtype=float32", "--lengths=64",
                       "--prefill_chunk=128", "--vram_budget_gb=1.02", "--variants=resident", flag)
    assert proc.returncode != 0
    assert "Flags parsing error" in proc.stderr and flag.split("=")[0] in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_bench_prefill_expert_dtypes_smoke(tmp_path):
    """Per format: its own pool bytes (quantized weights + float32 scales), its own copy bound
    from them and its own resident time; a quantized stream computes what its resident run does."""
    from ftjax.experts import quant
    d = _run("bench_prefill", tmp_path, "--preset=tiny", "--dtype=float32", "--lengths=256", "--prefill_chunk=128",
             "--vram_budget_gb=1.02", "--variants=stream,resident", "--repeats=1", "--expert_dtypes=bfloat16,int8")
    rows = {(r["expert_dtype"], r["variant"]): r for r in d["results"]}
    assert set(rows) == {(f, v) for f in ("bfloat16", "int8") for v in ("stream", "resident")}
    bp = d["B_P"]["h2d_GBps"]["median"] * 1e9
    for (fmt, variant), r in rows.items():
        assert "error" not in r, r
        assert r["expert_bytes"] == quant.expert_bytes("dense" if fmt == "bfloat16" else fmt, 128, 128, 2)
        assert r["pool_bytes"] == 4 * 16 * r["expert_bytes"] == d["pool_bytes_by_format"][fmt]
        assert r["h2d_bytes"] % r["expert_bytes"] == 0 and (r["h2d_bytes"] > 0) == (variant == "stream")
        if variant == "stream":
            assert r["copy_bound_s"] == pytest.approx(r["chunks"] * r["pool_bytes"] / bp)
            res = rows[(fmt, "resident")]["ttft_s"]["median"]
            assert r["bound_s"] == pytest.approx(max(r["copy_bound_s"], res))
            assert r["ratio_to_bound"] == pytest.approx(r["ttft_s"]["median"] / r["bound_s"])
    # int8: 1 byte per weight plus its scales, still well under half of bf16's 2 bytes
    assert 3 * 128 * 128 < rows[("int8", "stream")]["expert_bytes"] < rows[("bfloat16", "stream")]["expert_bytes"] / 1.5
    assert rows[("int8", "stream")]["copy_bound_s"] < rows[("bfloat16", "stream")]["copy_bound_s"]
    assert d["logits_max_abs_diff_vs_resident_by_format"]["int8"]["stream"] == 0.0
    assert d["logits_max_abs_diff_vs_resident"] == d["logits_max_abs_diff_vs_resident_by_format"]["bfloat16"]
    assert d["memory_plans"]["int8/256/scan"]["expert_bytes"] == rows[("int8", "stream")]["expert_bytes"]
    sys.path.insert(0, str(ROOT / "experiments"))
    import plots
    assert plots.plot(str(tmp_path / "bench_prefill_tiny.json"), str(tmp_path / "p.png"))


@pytest.mark.slow
def test_bench_kv_reuse_smoke(tmp_path):
    d = _run("bench_kv_reuse", tmp_path, "--preset=tiny", "--dtype=float32", "--prefix_tokens=192",
             "--suffix_tokens=64", "--chunk_tokens=32", "--prefill_chunk=128", "--expert_slots=32",
             "--kv_host_gb=0.1", "--h2d_mb=16", "--loads=prefetch,xs,all_first,pipelined",
             "--prefix_copies=put,in_program", "--prefix_copy_layers=1,2")
    assert _meta(d)["device"] and _meta(d)["jax"]
    assert d["loads_skipped"] == {} and d["probes"]["pipelined"]["ok"] and d["probes"]["pipelined_in_program"]["ok"]
    assert d["chunk_bytes"] == d["chunk_kv_bytes"] == 4 * 2 * 32 * 2 * 32 * 4 and d["chunk_state_bytes"] == 0
    for r in d["results"]:
        assert "error" not in r, r
        assert r["store_request"]["chunks_stored"] == 192 // 32
        assert r["loads_measured"] == ["prefetch", "xs", "all_first", "pipelined", "pipelined_g2",
                                       "pipelined_in_program"]
        assert r["pipelined"]["prefix_copy"] == "put" and r["pipelined_in_program"]["prefix_copy"] == "in_program"
        # each copy ran on an engine of its own, whose config the row records
        for load, copy, rows in (("pipelined", "put", 1), ("pipelined_g2", "put", 2),
                                 ("pipelined_in_program", "in_program", 1)):
            assert r[load]["engine"]["prefix_copy"] == copy and r[load]["engine"]["prefill_driver"] == "pipelined"
            assert r[load]["prefix_copy_layers"] == r[load]["engine"]["prefix_copy_layers_resolved"] == rows
        for load in r["loads_measured"]:
            assert r[load]["reused_tokens"] == 192 and r[load]["hit_chunks"] == 192 // 32
            assert r[load]["bytes_loaded"] == 6 * d["chunk_bytes"]
            assert r[load]["first_token_equals_recompute"] and r[load]["check_reused_tokens"] == 192
        # the layer-pipelined driver ran the pipelined load's calls (one per request), the scan the others'
        for load in ("pipelined", "pipelined_g2", "pipelined_in_program"):
            assert r[load]["driver_calls"] == {"scan": 0, "pipelined": 3}
        assert r["prefetch"]["driver_calls"] == {"scan": 3, "pipelined": 0}
        for load in ("pipelined", "pipelined_g2", "pipelined_in_program"):
            assert isinstance(r[load]["hidden_fraction"], float) and r[load]["speedup_vs_recompute"] > 0


@pytest.mark.slow
def test_bench_kv_reuse_hybrid_smoke(tmp_path):
    """The hybrid family: K/V in 1 layer of 4 and the linear layers' state in every stored chunk;
    the in-scan copy alone and the pipelined driver are skipped with their reasons."""
    from ftjax.config import preset
    cfg = preset("tiny-hybrid")
    d = _run("bench_kv_reuse", tmp_path, "--preset=tiny-hybrid", "--dtype=float32", "--prefix_tokens=192",
             "--suffix_tokens=64", "--chunk_tokens=64", "--prefill_chunk=128", "--expert_slots=32",
             "--kv_host_gb=0.1", "--h2d_mb=16", "--noprobe", "--modes=cached", "--reps=2",
             "--loads=prefetch,all_first,pipelined")
    _meta(d)
    assert d["model_type"] == "qwen3_5_moe" and "layer kind" in d["loads_skipped"]["pipelined"]
    assert "block scan" in d["in_scan_copy_only"]["skipped"]
    kv = cfg.num_attention_layers * 2 * 64 * cfg.num_kv_heads * cfg.head_dim * 4  # one full-attention layer
    state = cfg.linear_state_bytes(1, 4)
    assert (d["chunk_kv_bytes"], d["chunk_state_bytes"], d["chunk_bytes"]) == (kv, state, kv + state) == (
        32768, 58368, 91136)
    assert d["prefix_bytes"] == 3 * (kv + state) and d["layerwise_copy_bytes"] == 3 * kv + state
    (r,) = d["results"]
    assert "error" not in r and "pipelined" not in r and "partial" not in r, r  # the mode's last write is whole
    assert r["chunk_layout"]["bytes_expected"] == kv + state and r["chunk_layout"]["kv_shape"] == [1, 2, 64, 2, 32]
    assert r["store_request"]["chunks_stored"] == 3 and r["recompute"]["prefill_calls"] == 2
    for load in ("prefetch", "all_first"):
        x = r[load]
        assert x["reused_tokens"] == 192 and x["hit_chunks"] == 3 and x["bytes_loaded"] == 3 * (kv + state)
        assert x["first_token_equals_recompute"] and x["first_token"] == r["recompute"]["first_token"]
        assert x["max_abs_logit_diff_vs_recompute"] < 1e-4 * x["max_abs_logit_recompute"]
        assert x["speedup_vs_recompute"] > 0
    assert isinstance(r["prefetch"]["hidden_fraction"], float) and r["all_first"]["load_s"]["median"] > 0


@pytest.mark.slow
def test_bench_kv_reuse_writes_partial_rows_and_survives_a_failed_pipelined_engine(tmp_path, monkeypatch):
    """``run_mode``'s progress: the JSON is rewritten after the recompute and after each load with
    the mode's row marked ``partial``; the pipelined load's engine failing to build is recorded in
    ``load_errors`` and ends the mode's loads; the last write holds the whole row, unmarked."""
    b = import_app("experiments.bench_kv_reuse")
    writes, real_write, real_engine = [], b.write_json, b.Engine

    def write_json(out_dir, name, payload):
        writes.append([dict(r) for r in payload["results"]])
        return real_write(out_dir, name, payload)

    def engine(model, config):
        if config.prefill_driver == "pipelined":
            raise RuntimeError("no pipelined engine here")
        return real_engine(model, config)

    monkeypatch.setattr(b, "write_json", write_json)
    monkeypatch.setattr(b, "Engine", engine)
    proc = _run_script("bench_kv_reuse", f"--out_dir={tmp_path}", "--preset=tiny", "--dtype=float32",
                       "--prefix_tokens=192", "--suffix_tokens=64", "--chunk_tokens=32", "--prefill_chunk=128",
                       "--expert_slots=32", "--kv_host_gb=0.1", "--h2d_mb=16", "--noprobe", "--modes=cached",
                       "--reps=1", "--loads=pipelined,prefetch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    writes = json.loads(json.dumps(writes, default=str))  # as the child process printed them
    loads = ("recompute", "prefetch", "load_errors")
    seen = [([k for k in loads if k in r], r.get("partial")) for (r,) in writes]
    partial = "the mode had not finished"
    assert seen[:3] == [(["recompute"], partial), (["recompute", "prefetch"], partial),
                        (["recompute", "prefetch", "load_errors"], partial)]
    assert seen[3:] and all(x == (list(loads), None) for x in seen[3:]), seen  # pipelined last, then the mode's row
    (r,) = json.loads((tmp_path / "bench_kv_reuse_tiny.json").read_text())["results"]
    assert r["load_errors"] == {"pipelined_g4": "RuntimeError: no pipelined engine here"} and "partial" not in r
    assert r["prefetch"]["reused_tokens"] == 192 and r["prefetch"]["first_token_equals_recompute"]
    assert r["prefetch"]["speedup_vs_recompute"] > 0 and r["compile_s"] > 0 and "pipelined_g4" not in r


@pytest.mark.slow
def test_bench_serve_smoke(tmp_path):
    """The three parts at tiny sizes, experts cached: every request finished with its tokens, no timed call
    compiled (the warm-ups ran the same shapes), the concurrency levels with and without scheduler decode blocks,
    prefix reuse hit in the reuse run only, the HTTP path timed."""
    d = _run("bench_serve", tmp_path, "--preset=tiny", "--dtype=float32", "--modes=cached", "--concurrency=1,2",
             "--decode_blocks=1,4",
             "--requests=3", "--prompt_tokens=16", "--max_tokens=3", "--context_tokens=64", "--users=2", "--rounds=2",
             "--question_tokens=8", "--answer_tokens=3", "--kv_chunk_tokens=32", "--server_requests=2", "--noprogress")
    assert _meta(d)["device"] and "partial" not in d and d["parts_run"] == ["concurrency", "multiround",
                                                                           "server_overhead"]
    conc = d["parts"]["concurrency"]["modes"]["cached"]
    assert "error" not in conc and conc["slots"] == 32
    assert [(x["decode_block"], x["concurrency"]) for x in conc["levels"]] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for x in conc["levels"]:
        assert x["finished"] == x["requests"] == 3 and x["finish_reasons"] == {"length": 3} and not x["errors"]
        assert x["tokens"] == 3 * 3 and x["prompt_tokens"] == 3 * 16 and x["compile_s"] == 0.0
        assert x["tokens_per_s"] == pytest.approx(9 / x["wall_s"]) and x["requests_per_s"] > 0
        assert x["ttft_s"]["n"] == x["tpot_s"]["n"] == 3 and x["itl_s"]["n"] == 3 * 2
        assert 0 < x["ttft_s"]["p10"] <= x["ttft_s"]["median"] <= x["ttft_s"]["p90"]
        calls = x["engine_calls"]
        assert calls["failed"] == 0
        if x["decode_block"] == 1:  # one engine call per step
            assert calls["decode"] > 0 and calls["decode_block"] == 0 and sum(calls.values()) == x["steps"]
        else:  # each request's 2 decode steps in one block
            assert calls["decode"] == 0 and calls["decode_block"] > 0 and x["steps"] > sum(calls.values())
        ec = x["expert_cache"]
        assert 0 < ec["hit_rate"] < 1 and ec["bytes_h2d"] == ec["prefill_bytes_h2d"] + ec["decode_bytes_h2d"] > 0
        assert x["h2d_bytes_per_token"] == pytest.approx(ec["bytes_h2d"] / 9)
    for c1, c2 in (conc["levels"][:2], conc["levels"][2:]):
        assert c1["speedup_vs_c1"] == 1.0 and c2["speedup_vs_c1"] == pytest.approx(c2["tokens_per_s"]
                                                                                   / c1["tokens_per_s"])
    assert conc["speedup_at_4_by_decode_block"] == {} and conc["speedup_at_4"] is None  # no level 4 here
    mr = d["parts"]["multiround"]["modes"]["cached"]
    assert "error" not in mr and set(mr["runs"]) == {"no_reuse", "reuse"}
    for name, run in mr["runs"].items():
        assert run["finished"] == 4 and run["finish_reasons"] == {"length": 4} and run["tokens"] == 2 * 2 * 3
        assert run["compile_s"] == 0.0 and run["kv_reuse"] == (name == "reuse")
        # round 2: the context, question 1, answer 1 (generated), question 2
        assert [x["prompt_tokens"] for x in run["rounds"]] == [[72, 72], [83, 83]]
        assert all(x["ttft_s"]["n"] == 2 and x["ttft_s"]["median"] > 0 for x in run["rounds"])
    assert mr["runs"]["no_reuse"]["cached_tokens"] == 0 and "kv" not in mr["runs"]["no_reuse"]
    reuse = mr["runs"]["reuse"]
    assert [x["cached_tokens"] for x in reuse["rounds"]] == [[0, 0], [64, 64]]  # round 1's 2 chunks of 32 each
    assert reuse["kv"]["chunks_hit"] == 4 and reuse["kv"]["chunks_stored"] == 4 and reuse["cached_tokens"] == 128
    assert all(t > 0 for t in mr["ttft_s_by_round"]["reuse"]) and mr["speedup_after_first_round"] > 0
    assert mr["speedup_by_round"][1] == pytest.approx(mr["ttft_s_by_round"]["no_reuse"][1]
                                                      / mr["ttft_s_by_round"]["reuse"][1])
    assert mr["kv_store_bytes_needed"] == 2 * 2 * mr["kv_chunk_bytes"] == 2 * 2 * 4 * 2 * 32 * 2 * 32 * 4
    so = d["parts"]["server_overhead"]["modes"]["cached"]
    assert "error" not in so and so["tokenizer"] == "ids as text (<id>)"
    assert so["direct"]["tokens"] == so["http"]["tokens"] == so["http"]["chunks"] == [3, 3]
    assert so["direct"]["compile_s"] == so["http"]["compile_s"] == 0.0
    assert so["tpot_ratio"] > 0 and so["tpot_ratio"] == pytest.approx(so["http"]["tpot_s"]["median"]
                                                                      / so["direct"]["tpot_s"]["median"])
    assert len(d["results"]) == 2 * 2 + 2 * 2 + 2
    sys.path.insert(0, str(ROOT / "experiments"))
    import plots
    import results_index
    (path,) = tmp_path.glob("bench_serve_tiny_*.json")
    assert plots.plot(str(path), str(tmp_path / "p.png"))
    assert "multi-round TTFT" in results_index.row(str(path), path.name, results_index._scripts())["headline"]


@pytest.mark.slow
def test_bench_miss_policy_smoke(tmp_path):
    # a child process: the CPU-callback runs need synchronous CPU dispatch set before JAX starts
    d = _run("bench_miss_policy", tmp_path, "--preset=tiny", "--steps=6", "--impls=compute_on", "--budgets_gb=8",
             "--temperature=0", process=True)
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


@pytest.mark.slow
def test_bench_miss_policy_host_driver_smoke(tmp_path, monkeypatch):
    """The host-split driver's runs (``--cpu_drivers=host``: the mechanism named ``<impl>@host``, calibrated on
    the host step), in this process: no callback runs, so no synchronous dispatch is needed. float32: the
    CPU-only run's logits equal the fetch run's (the XLA:CPU kernel, the device's expression). The script's hang
    timer (faulthandler, exit=True) ends with the run: left set, it ended this test process minutes later."""
    import faulthandler
    timers = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda *a, **kw: timers.append("set"))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: timers.append("cancelled"))
    d = _run("bench_miss_policy", tmp_path, "--preset=tiny", "--dtype=float32", "--steps=4", "--impls=callback",
             "--cpu_drivers=host", "--budgets_gb=8", "--temperature=0", "--nopure_qstar", "--quick_calibration")
    assert set(d["calibration"]["entry"]["impls"]) == {"callback@host"} and d["impl_order"] == ["callback@host"]
    runs = {r["policy"]: r for r in d["runs"]}
    assert set(runs) == {"fetch", "cpu", "adaptive"} and all("error" not in r for r in runs.values())
    assert runs["cpu"]["impl"] == "callback@host" and runs["cpu"]["engine"]["miss"]["cpu_driver"] == "host"
    assert runs["cpu"]["fetched_decode"] == 0 and runs["cpu"]["cpu_decode"] == runs["cpu"]["misses_decode"] > 0
    assert runs["cpu"]["max_abs_logit_diff_vs_fetch"] == 0.0
    assert timers == ["set", "cancelled"]


@pytest.mark.slow
def test_bench_cpu_experts_smoke(tmp_path):
    """Tiny experts (D=64, F=32) in a bank of a few hundred: every mechanism measured (or recorded as
    unavailable: torch, a C compiler) with the bytes it read counted per call, outputs equal to the
    float64 reference within bf16 rounding, the re-fit of the split on the new mechanism, and the
    modelled slower links. A child process: the re-fit's callbacks need synchronous CPU dispatch."""
    from ftjax.experts import quant
    d = _run("bench_cpu_experts", tmp_path, "--hidden=64", "--ffn=32", "--bank_gb=0.004", "--dram_gb=0.05",
             "--threads=1,2", "--ks=1,2", "--refit_rows=16", "--repeats=2", "--copies=on", "--h2d_mb=8",
             process=True)
    assert _meta(d)["device"] and _meta(d)["jax"] and d["accelerator"] is False and not d["errors"]
    assert not d["skipped"] and d["shape"] == {"hidden": 64, "ffn": 32} and d["copies"] is True
    for part in ("alone", "during_h2d"):  # --copies=on: host -> "device" copies on the CPU backend too
        assert [r["threads"] for r in d["dram"][part]] == [1, 2] and all(r["GBps"] > 0 for r in d["dram"][part])
    assert d["dram"]["h2d"]["bytes"] == 8 << 20 and d["dram_all_threads_GBps"]["alone"] > 0
    rows = {(r["format"], r["mechanism"]): r for r in d["ffn"]}
    assert set(rows) == {(f, m) for f in ("bfloat16", "int8", "int4") for m in (
        "numpy_rows", "native_omp", "torch", "xla_per_expert", "xla_one_jit", "xla_one_jit_xnnpack", "xla_one_jit_f32")}
    for (fmt, mech), r in rows.items():
        assert "error" not in r, r
        if "unavailable" in r:
            assert mech in ("torch", "native_omp"), r
            continue
        eb = quant.expert_bytes(quant.bank_format(fmt), 64, 32)
        assert r["expert_bytes"] == eb == d["banks"][fmt]["expert_bytes"]
        assert sorted((p["tokens"], p["k"]) for p in r["points"]) == [(1, 1), (1, 2), (4, 1), (4, 2)]
        for p in r["points"]:
            assert p["bytes"] == p["k"] * eb and p["s"]["median"] > 0 and p["s"]["n"] == 2
            assert p["GBps"] == pytest.approx(p["bytes"] / p["s"]["median"] / 1e9)
        assert set(r["fits"]) == {"1", "4"} and all(math.isfinite(f["alpha_s"]) for f in r["fits"].values())
        assert set(r["max_rel_err"]) == {"1", "4"} and max(r["max_rel_err"].values()) <= d["rel_tol"], r
    assert rows[("bfloat16", "numpy_rows")]["info"]["threads"] == d["mechanism_threads"] == os.cpu_count()
    measured = {k for k, r in rows.items() if "unavailable" not in r}
    during = {(r["format"], r["mechanism"]): r for r in d["ffn_during_h2d"]}
    assert set(during) == measured and all(r["k"] == 2 and r["GBps"] > 0 for r in during.values())
    impls = d["refit"]["impls"]
    compiler = bool(shutil.which("cc") or shutil.which("gcc"))  # the native kernel's build
    assert set(impls) == {"native_async", "numpy_rows_async", "callback_async"}
    assert all(v["ok"] for k, v in impls.items() if k != "native_async")
    assert impls["native_async"]["ok"] == compiler, impls["native_async"]
    assert impls["numpy_rows_async"]["mechanism"]["kernel"] == "rows"
    if compiler:  # the package's kernel, built once into the test run's cache (tests/conftest.py)
        assert impls["native_async"]["mechanism"]["kernel"] == "native"
        info = rows[("bfloat16", "native_omp")]["info"]
        assert info["openmp"] and info["library"].startswith("expert_ffn-") and "-O3" in info["flags"]
    assert {r["impl"] for r in d["refit_vs_kernel"]} == {"numpy_rows_async", "callback_async"} | (
        {"native_async"} if compiler else set())
    for fmt, v in d["links"]["formats"].items():
        assert [r["link"] for r in v["links"]] == ["measured", "25 GB/s", "12 GB/s"]
        assert [round(r["link_GBps"], 6) for r in v["links"][1:]] == [25.0, 12.0]
        for r in v["links"]:
            assert [g["misses"] for g in r["per_layer"]] == list(range(1, 9))
            assert all(g["gain"] >= 1 - 1e-9 and 0 <= g["fetch"] <= g["misses"] for g in r["per_layer"])
            assert r["fetch_cap_F_of_M"][1:] == [g["fetch"] for g in r["per_layer"]]
            pt = r["per_token_zero_hits"]
            assert pt["fetch_only_s"] == pytest.approx(48 * r["per_layer"][-1]["fetch_only_s"])


@pytest.mark.slow
def test_bench_miss_copy_smoke(tmp_path):
    """Every variant on both id kinds at both layer counts: no error, the pools of the one-copy loop, the
    bytes of layers x misses x one expert, rates > 0 with their ratios to the references; the compiled
    programs' structure (a group > 1 adds one conditional; the static fetch has no loop of its own)."""
    d = _run("bench_miss_copy", tmp_path, "--preset=tiny", "--bank_experts=64", "--slots=32", "--layers_per_call=2",
             "--decode_layers=4", "--repeats=2", "--groups=1,2,4",
             "--variants=static,coalesce,put_then_slice,direct,kernel", "--kernel_blocks=16")
    assert _meta(d)["device"] and _meta(d)["jax"] and d["b_p"]["h2d_GBps"]["median"] > 0
    shape = d["shape"]
    misses, expert = shape["misses"], shape["expert_bytes"]
    assert misses == 4 and expert == (128 * 256 + 128 * 128) * 2 and shape["layer_counts"] == [2, 4]  # tiny, bf16
    rows = {(r["variant"], r["ids"], r["layers"]): r for r in d["rows"]}
    for n in (2, 4):  # the slot-copy kernel (and its grid of 16 blocks per miss) needs a GPU: each row says why
        for variant in ("kernel", "kernel@16"):
            assert "SlotCopyUnavailable" in rows.pop((variant, "random", n))["error"]
    variants = {"group1", "group2", "group4", "static", "coalesce", "put_then_slice", "direct"}
    want = {(v, "random", n) for v in variants for n in (2, 4)} | {
        (v, "runs", n) for v in ("group1", "group4", "coalesce") for n in (2, 4)}
    assert set(rows) == want and {r["graphs"] for r in d["rows"]} == {"off"}  # command buffers: GPU only
    for (variant, _, layers), r in rows.items():
        assert "error" not in r, r
        assert r["bytes"] == layers * misses * expert
        assert r["GBps"]["median"] > 0 and r["us_per_miss"] > 0 and r["ratio_to_contig"] > 0
        assert r["same_pools_as_group1"] is True
        assert r["hlo"]["conditional"] == (variant in ("group2", "group4")) + 2 * (variant == "coalesce"), variant
    for n in (2, 4):
        ref = d["references"][str(n)]
        assert ref["contig_put"]["bytes"] == ref["expert_puts"]["bytes"] == n * misses * expert
        assert ref["contig_put"]["GBps"]["median"] > 0 and ref["expert_puts"]["GBps"]["median"] > 0
        assert rows[("static", "random", n)]["hlo"]["while"] < rows[("group1", "random", n)]["hlo"]["while"]
    assert {(b["layers"], b["graphs"]) for b in d["best"]} == {(2, "off"), (4, "off")}
    sys.path.insert(0, str(ROOT / "experiments"))
    import plots
    import results_index
    (path,) = tmp_path.glob("bench_miss_copy_tiny.json")
    plots.plot(str(path), str(tmp_path / "p.png"))  # draws or skips, never fails
    headline = results_index.row(str(path), path.name, results_index._scripts())["headline"]
    assert headline.startswith("misses of 4 layers, graphs off: ") and "x the pinned copy (one copy per" in headline


@pytest.mark.slow
def test_ab_slot_table_smoke(tmp_path):
    """Every slot table implementation on a small warmed table, for every registered cache policy (the
    default): outputs identical to 'sort', timed, and the compiled scan body counted (the reference has the
    sort and the scatters, 'rank' neither sort)."""
    from ftjax.experts.slot_table import POLICIES
    d = _run("ab_slot_table", tmp_path, "--num_layers=4", "--num_experts=8", "--num_slots=20", "--top_k=3",
             "--repeats=2", "--warmup=1", "--hit_rates=0.9,0.3")
    assert _meta(d)["device"] and d["all_identical_to_sort"] and not d["mismatches"]
    rows = {(r["case"], r["policy"], r["impl"]): r for r in d["results"]}
    for case in ("hit0.9", "hit0.3"):
        assert rows[(case, "-", "noop")]["us_per_layer"] > 0
        for policy in POLICIES:
            for impl in ("sort", "lexsort", "top_k", "rank"):
                r = rows[(case, policy, impl)]
                assert r["identical_to_sort"] and r["us_per_layer"] > 0 and 0 < r["hit_rate"] <= 1
    ops = d["hlo_body_ops"]
    assert ops["lru/sort"]["by_kind"].get("sort", 0) >= 1 and ops["lru/sort"]["by_kind"]["fusion:scatter"] >= 2
    assert "sort" not in ops["lru/rank"]["by_kind"] and ops["lru/rank"]["total"] < ops["lru/sort"]["total"]


@pytest.mark.slow
def test_check_oracle_gpu_smoke(tmp_path):
    """Every expert mode of the oracle script passes on the CPU (one fixture, the short prompt)."""
    d = _run("check_oracle_gpu", tmp_path, "--smoke", process=True)  # miss_cpu: synchronous CPU dispatch
    assert _meta(d)["device"] and _meta(d)["jax"]
    assert d["precision"]["float32"] == "highest" and d["prompts"] == ["short"]
    f32 = [r for r in d["results"] if r["dtype"] == "float32"]
    assert {r["mode"] for r in f32} == {"resident", "cached_S=E", "cached_S=2E", "on_demand", "stream_S=2E",
                                        "miss_fetch", "miss_cpu", "miss_adaptive"}
    for r in f32:
        assert "error" not in r and r["ok"] and r["ids_equal"] and r["ids_agree"] == r["steps"] == 16, r
        assert 0 < r["max_abs_err"] <= r["tol"] < 1e-3
        assert r["generated_ids"] == r["expected_ids"]
        assert (r["misses"] > 0) == (r["mode"] != "resident")
    # the CPU backend's arithmetic is the same in every mode: one error value for all of them
    assert len({r["max_abs_err"] for r in f32}) == 1
    cpu = {r["mode"]: r["cpu_computed"] for r in f32}
    assert cpu["miss_cpu"] > 0 and cpu["miss_adaptive"] > 0 and cpu["miss_fetch"] == cpu["cached_S=E"] == 0
    assert d["summary"]["float32_failed"] == [] and d["summary"]["float32_cases"] == 8
    (bf,) = [r for r in d["results"] if r["dtype"] == "bfloat16"]
    assert bf["mode"] == "resident" and "ok" not in bf  # reported, not asserted
    assert bf["generated_ids"][0] == bf["expected_ids"][0] and 1e-3 < bf["max_abs_err"] < 0.1 * bf["max_abs_logit"]


@pytest.mark.slow
def test_check_reuse_gpu_smoke(tmp_path):
    """The reuse check at tiny-hybrid size (15 chunks of 64 stored in calls of 512 + 448, passed as
    16): on the CPU the reuse is bit-identical to the recompute cut where it cuts (bfloat16 too:
    tests/test_hybrid_reuse_scale.py), and the stored entries equal the recomputed state; the planted
    stale state moves the logits in the slow-decay case."""
    d = _run("check_reuse_gpu", tmp_path, "--preset=tiny-hybrid", "--num_layers=0", "--prefix_tokens=960",
             "--prompt_tokens=1024", "--chunk_tokens=64", "--prefill_chunk=512", "--expert_slots=40",
             "--cases=preset_float32,preset_float32_slow", "--other_cuts=before")
    assert _meta(d)["device"] and "partial" not in d
    rows = {r["case"]: r for r in d["results"]}
    assert set(rows) == {"preset_float32", "preset_float32_slow"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["reuse_request"]["prefix_chunks_passed"] == 16 and r["reuse_request"]["reused_tokens"] == 960
        assert r["calls"]["store"] == [0, 512] and r["calls"]["cut_recompute"] == [0, 512, 960]
        assert r["vs_cut_recompute"]["max_abs_diff"] == 0 and r["cut_recompute_repeat"]["max_abs_diff"] == 0
        assert r["vs_recompute"]["max_abs_diff"] == r["cut_recompute_vs_recompute"]["max_abs_diff"]
        assert [s["end"] for s in r["stored_state"]] == [512, 960]
        assert all(s["kv_max_abs_diff"] == s["conv_max_abs_diff"] == s["rec_max_abs_diff"] == 0
                   for s in r["stored_state"])
    assert rows["preset_float32"]["vs_recompute"]["max_abs_diff"] < 1e-4
    assert rows["preset_float32_slow"]["control_stale_state"]["max_abs_diff"] > 0.05
    assert d["summary"]["verdict"].startswith("(b)")


def test_check_reuse_gpu_keeps_the_stages_of_a_case_that_fails(tmp_path, monkeypatch):
    """A case that raises after some stages (an out-of-memory in a later prefill) keeps in the JSON what
    those stages wrote, beside the error (a time-limit kill keeps it too: the last progress write)."""
    def check_case(name, model, prompt, *args, progress, **kw):
        row = {"case": name, "dtype": "float32", "vs_recompute": {"max_abs_diff": 0.25}}
        progress(dict(row, partial="the case had not finished (last stage: recompute)"))
        raise RuntimeError("RESOURCE_EXHAUSTED in the cut recompute")

    monkeypatch.setattr(import_app("experiments.check_reuse_gpu"), "check_case", check_case)
    proc = _run_script("check_reuse_gpu", f"--out_dir={tmp_path}", "--cases=qwen3_moe_fp32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads((tmp_path / "check_reuse_gpu.json").read_text())
    (row,) = d["results"]
    assert "RESOURCE_EXHAUSTED" in row["error"] and row["vs_recompute"] == {"max_abs_diff": 0.25}, row
    assert "last stage: recompute" in row["partial"] and d["summary"]["cases"]["qwen3_moe_fp32"].startswith("error")


def test_check_oracle_gpu_exits_nonzero_on_a_float32_failure(tmp_path):
    """A float32 case outside the tolerance fails the run (exit 1, case named): a copy of the
    fixture whose expected logit at one step is moved by 1e-3 (the tolerance there is 1.7e-4)."""
    import numpy as np
    fx = tmp_path / "fixtures" / "qwen3_moe_fp32"
    shutil.copytree(ROOT / "tests" / "fixtures" / "qwen3_moe_fp32", fx)
    with np.load(fx / "expected.npz") as z:
        exp = {k: z[k] for k in z.files}
    exp["short_step_logits"][3, 5] += 1e-3
    np.savez(fx / "expected.npz", **exp)
    proc = _run_script("check_oracle_gpu", f"--out_dir={tmp_path}", f"--fixtures_dir={tmp_path / 'fixtures'}",
                       "--smoke", "--modes=resident", "--bf16_modes=")
    assert proc.returncode == 1 and "FAILED float32 cases: qwen3_moe_fp32/short/resident" in proc.stderr, proc.stderr
    d = json.loads((tmp_path / "check_oracle_gpu.json").read_text())
    (r,) = d["results"]
    assert r["ids_equal"] and not r["ok"] and 9e-4 < r["max_abs_err"] < 1.1e-3 and r["tol"] < 2e-4


@pytest.mark.slow
def test_plan_vs_peak_smoke(tmp_path):
    """The CPU path: plans as generate makes them (workspace measured on the compiled steps),
    engines run, no memory_stats (null, no failure)."""
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    from ftjax.runtime.planner import plan_memory, plan_run
    cfg = preset("tiny")
    # budgets that leave 24 (no streaming) and 40 (streaming) slots at the measured workspace
    _, probe = plan_run(random_model(cfg, "bfloat16"), EngineConfig("cached", num_slots=32, max_seq_len=384),
                        [[1] * 256], budget_bytes=10**9)
    fixed = probe.planned_bytes - probe.all_slots_bytes
    budgets = [round((fixed + s * probe.expert_bytes) / 1e9, 6) for s in (24, 40)]
    d = _run("plan_vs_peak", tmp_path, "--preset=tiny", f"--budgets_gb={budgets[0]},{budgets[1]}", "--lengths=200,256",
             "--steps=2")
    assert _meta(d)["device"] and _meta(d)["backend"] == "cpu"
    assert d["child_errors"] == [] and d["skipped"] == [] and d["plan_below_peak"] == []
    assert d["builds"][0]["peak_after_build"] is None and d["builds"][0]["pool_bytes"] == 4 * 16 * 3 * 128 * 128 * 2
    rows = {(r["budget_gb"], r["prompt_len"]): r for r in d["results"]}
    assert list(rows) == [(budgets[0], 200), (budgets[0], 256), (budgets[1], 200), (budgets[1], 256)]  # run order
    for (budget, n), r in rows.items():
        assert "error" not in r and "plan_error" not in r, r
        p = r["plan"]
        assert r["max_seq_len"] == {200: 256, 256: 384}[n]  # prompt + 3 new tokens, rounded up to 128
        assert p["workspace_temp_bytes"] > 0 and p["layer_gather_bytes"] == 0  # measured: the gather is in it
        want = plan_memory(cfg, 2, budget_bytes=int(budget * 1e9), max_seq_len=r["max_seq_len"],
                           workspace_bytes=p["workspace_temp_bytes"])
        assert p == want.as_dict() and r["mode"] == "cached" and 16 <= p["slots"] < 64
        assert r["planned_bytes"] == (p["non_expert_bytes"] + p["kv_cache_bytes"] + p["workspace_bytes"]
                                      + p["slots"] * p["expert_bytes"]) <= budget * 1e9
        assert r["peak_after_compile"] is None and r["peak_after_run"] is None and r["verdict"] is None
        assert "peak_bytes" not in r and r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0
        # streaming whole layers needs 2E = 32 slots
        assert r["streamed_prefill"] == (budget == budgets[1])


@pytest.mark.slow
def test_plots_draw_every_committed_result(tmp_path):
    """experiments/plots.py draws a PNG for each committed benchmark JSON (each has run rows with a
    known metric), with one panel per metric found, and refuses a file that is not a JSON object."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import plots
    files = [pathlib.Path(p) for p in plots.result_files() if os.path.basename(p).startswith("bench_")]
    assert len({f.parent.name for f in files}) >= 7  # in the figure folders (decode_by_budget, prefill, ...)
    for f in files:
        out = plots.plot(str(f), str(tmp_path / (f.stem + ".png")))
        assert out and pathlib.Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f
        assert plots.rows_of(json.loads(f.read_text()))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert plots.main(["plots", str(bad)]) == 1
    assert plots.main(["plots", "--help"]) == 0  # the docstring, not a file named --help


def test_profile_overlap_summary_of_a_hand_made_trace():
    """The timeline reduction: GPU events only, memcpy H2D vs kernels, bursts split by gaps."""
    sys.path.insert(0, str(ROOT))
    from experiments.timeline import summarize_trace
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "MemcpyH2D", "ts": 0, "dur": 100},
              {"ph": "X", "pid": 1, "tid": 2, "name": "fusion_1", "ts": 50, "dur": 100},
              {"ph": "X", "pid": 1, "tid": 1, "name": "MemcpyH2D", "ts": 1000, "dur": 100},
              {"ph": "X", "pid": 1, "tid": 2, "name": "MemcpyD2D", "ts": 1050, "dur": 10},
              {"ph": "X", "pid": 2, "tid": 1, "name": "MemcpyH2D", "ts": 0, "dur": 5000}]  # host: ignored
    r = summarize_trace(events, gap_us=500)
    assert r["gpu_processes"] == ["/device:GPU:0"]
    assert r["copy_s"] == pytest.approx(200e-6) and r["compute_s"] == pytest.approx(110e-6)
    assert r["copy_overlapped_fraction"] == pytest.approx(60 / 200)  # 50 us of burst 1, 10 us of burst 2
    assert [b["overlapped_fraction"] for b in r["bursts"]] == pytest.approx([0.5, 0.1])
    assert r["span_s"] == pytest.approx(1100e-6)


@pytest.mark.slow
def test_profile_overlap_smoke(tmp_path):
    d = _run("profile_overlap", tmp_path, "--preset=tiny", "--dtype=float32", "--tokens=256", "--slots=64",
             "--prefix_tokens=256", "--suffix_tokens=16")
    _meta(d)
    assert set(d["runs"]) == {"stream", "kv_reuse"}
    assert d["runs"]["kv_reuse"]["reused_tokens"] == 256
    assert sum(d["runs"]["stream"]["driver_calls"].values()) == 2  # the warm-up prefill and the traced one


@pytest.mark.slow
def test_profile_step_smoke(tmp_path):
    """Every run profiled on the CPU backend (host events per HLO instruction): the categories
    account for the busy time, the named blocks all show up, bytes and floor as documented."""
    d = _run("profile_step", tmp_path, "--preset=tiny", "--dtype=float32", "--vram_budget_gb=1.02", "--prompt_len=32",
             "--prefill_tokens=256", "--warm_steps=2", "--timed_steps=3", "--pipelined_steps=4", "--trace_steps=2",
             "--hbm_gb=0.0625")
    _meta(d)
    assert d["hbm"]["GBps"] > 0 and d["hbm"]["bytes"] == 2 * 2**26
    runs = {(r["run"], r["batch"]): r for r in d["runs"]}
    assert set(runs) == {("cached_decode", 1), ("cached_decode", 4), ("resident_decode", 1), ("resident_decode", 4),
                         ("resident_prefill", 1)}
    eb = 3 * 128 * 128 * 4  # one tiny float32 expert
    for key, r in runs.items():
        assert "error" not in r, r
        p, cats, b = r["profile"], r["profile"]["categories"], r["bytes"]
        assert p["source"] == "host" and p["steps"] == r["traced_steps"] == (1 if key[0] == "resident_prefill" else 2)
        assert 0 < r["step_s"]["min"] <= r["step_s"]["median"] <= r["step_s"]["max"]
        assert sum(c["s"] for c in cats.values()) == pytest.approx(p["busy_s"], rel=1e-6)
        assert p["busy_s"] + p["gap_s"] == pytest.approx(p["span_s"])
        assert 0 < p["busy_s"] <= p["span_s"] <= p["window_s"]
        for c in ("attention", "router", "experts", "norm", "head"):  # classified from the named scopes
            assert cats[c]["s"] > 0 and cats[c]["count"] > 0, (key, c)
        assert cats["slot_table"]["count"] > 0  # the routed-expert mask, in every mode
        assert (cats["h2d_copy"]["count"] > 0) == (key[0] == "cached_decode")  # the fetch loop
        assert b["hbm_total"] == sum(b["hbm"].values()) and b["h2d_link"] == b["hbm"]["h2d_copy"]
        assert b["hbm"]["experts"] == r["routing"]["distinct_experts_per_step"] * eb
        assert b["h2d_link"] == r["routing"]["fetched_experts_per_step"] * eb
        assert r["floor"]["hbm_s"] == pytest.approx(b["hbm_total"] / (d["hbm"]["GBps"] * 1e9))
        assert r["floor"]["s"] == max(r["floor"]["hbm_s"], r["floor"]["h2d_s"])
        assert r["ratio_to_floor"] == pytest.approx(r["step_s"]["median"] / r["floor"]["s"])
        if key[0] != "resident_prefill":  # 4 steps back to back: a positive mean, each step its own result
            assert r["pipelined_steps"] == 4 and 0 < r["pipelined_step_s"] < 4 * r["step_s"]["max"]
        assert cats["experts"]["bytes"] == b["hbm"]["experts"] and r["flops"] > 0 and r["xla_cost"]["flops"] > 0
    assert runs[("resident_decode", 1)]["routing"]["distinct_experts_per_step"] == 4 * 4  # L layers x top-k
    assert runs[("resident_decode", 4)]["routing"]["fetched_experts_per_step"] == 0
    assert runs[("resident_prefill", 1)]["tokens"] == 256
    for b in (1, 4):
        r = runs[("resident_decode", b)]
        assert d["targets"][f"resident_b{b}_pipelined_over_floor"] == pytest.approx(
            r["pipelined_step_s"] / r["floor"]["s"])
    sys.path.insert(0, str(ROOT / "experiments"))
    import plots
    assert plots.plot(str(tmp_path / "profile_step_tiny.json"), str(tmp_path / "p.png"))


@pytest.mark.slow
def test_profile_step_hybrid_by_layer_kind(tmp_path):
    """A hybrid's profile (issue 32: where the time goes by layer kind): the Gated DeltaNet mixers in their own
    category, with their weights and the recurrent and conv states (read and written once a step) as its bytes;
    ``--layers`` names the file and a cut above the preset's layers is refused."""
    import numpy as np

    from ftjax.config import preset
    from ftjax.layers import gated_deltanet
    flags = ("--preset=tiny-hybrid", "--dtype=bfloat16", "--prompt_len=16", "--prefill_tokens=64", "--warm_steps=1",
             "--timed_steps=2", "--pipelined_steps=2", "--trace_steps=1", "--hbm_gb=0.0625", "--batches=2",
             "--runs=resident_decode,resident_prefill")
    d = _run("profile_step", tmp_path, *flags, "--layers=4")
    assert d["file"] == "profile_step_tiny-hybrid_4l.json"
    cfg = preset("tiny-hybrid")
    n_lin = cfg.num_layers - cfg.num_attention_layers
    weights = n_lin * sum(int(np.prod(s)) for k, s in gated_deltanet.param_shapes(cfg).items() if k != "norm") * 2
    for r in d["runs"]:
        cats, rows = r["profile"]["categories"], r["batch"]
        assert cats["linear_attention"]["s"] > 0 and cats["linear_attention"]["count"] > 0, r["run"]
        conv, rec = gated_deltanet.state_shapes(cfg, n_lin, rows)
        # read and written: the conv state in bf16, the recurrent state in float32
        assert r["bytes"]["hbm"]["linear_attention"] == weights + 2 * (2 * np.prod(conv) + 4 * np.prod(rec))
    bad = _run_script("profile_step", f"--out_dir={tmp_path / 'bad'}", *flags, "--layers=5")
    assert bad.returncode == 1 and "--layers=5: tiny-hybrid has 4 layers" in bad.stderr
    assert not (tmp_path / "bad").exists()


_KV_REUSE_HLO_OF_EACH_COPY = """
import numpy as np
from experiments import bench_kv_reuse as b
from ftjax.checkpoint import random_model
from ftjax.config import EngineConfig, KVOffloadConfig, preset
from ftjax import Engine
from ftjax.runtime.programs import compiled_programs
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.prefix_cache import PrefixCache

model = random_model(preset("tiny"), "float32")
prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, 100).tolist()
for copy in ("put", "in_program"):
    mgr = PrefixCache(HostKVStore(1 << 26), KVOffloadConfig(chunk_tokens=32))
    eng = Engine(model, EngineConfig("resident", max_seq_len=256, prefill_driver="pipelined", prefix_copy=copy))
    eng.generate([prompt[:64]], 1, kv_manager=mgr)
    assert eng.generate([prompt], 1, kv_manager=mgr).kv["reused_tokens"] == 64
    rows = eng.prefix_copy_rows() if copy == "put" else rows  # put: the default copy groups (4 layers)
assert rows == 4
progs = [(s["opts"].prefix_next, len(sig), exe) for _, s, sig, exe in compiled_programs("layer_program")
         if s["opts"].has_prefix and s["opts"].step.mode == "resident"]
put = [exe for nxt, _, exe in progs if not nxt]
in_program = sorted([(n, exe) for nxt, n, exe in progs if nxt], key=lambda x: -x[0])
assert len(put) == 1 and len(in_program) == 2 and in_program[0][0] > in_program[1][0]
assert b.reuse_executables("resident", "pipelined", "put", rows) == put
assert b.reuse_executables("resident", "pipelined", rows=rows) == put
assert b.reuse_executables("resident", "pipelined", "put") == []  # no put program of 1-layer groups ran
got = b.reuse_executables("resident", "pipelined", "in_program")
assert got == [exe for _, exe in in_program]
# the program with the next layer's slices has more host-memory (S(5)) arguments than put's
ops = {k: b.hlo_ops(v[0].as_text())["host_memory_space_S(5)"] for k, v in (("put", put), ("in", got))}
assert ops["in"] > ops["put"], ops
print("OK", ops)
"""


@pytest.mark.slow
def test_bench_kv_reuse_hlo_of_each_prefix_copy():
    """``reuse_executables`` of the pipelined load picks the layer program of the row's prefix copy:
    the ``pipelined_in_program`` row's ``hlo_ops`` (and HLO file) are those of a program that copies
    the next layer's slices (host-memory arguments), not the ``put`` program compiled before it.
    In a child process: importing the bench defines its absl flags, which would clash with
    ``ftjax.generate``'s in this one."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _KV_REUSE_HLO_OF_EACH_COPY], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_bench_gated_delta_conv_and_decode_smoke(tmp_path):
    """bench_gated_delta's conv and decode stages at a cut layer (2 value heads, dk = dv = 32; the kernels
    interpreted): a row per variant, none failed, the kernels within float32 rounding of the XLA form."""
    d = _run("bench_gated_delta", tmp_path, "--tokens=64", "--value_heads=2", "--key_heads=1", "--head_dim=32",
             "--model_layers=0", "--repeats=1", "--stages=conv,decode", "--conv_tiles=16:64", "--step_tiles=16:4",
             "--decode_steps=2")
    _meta(d)
    assert [r["variant"] for r in d["conv"]] == ["xla", "causal_conv 16:64"]
    assert [r["variant"] for r in d["decode"]] == ["B=1 xla", "B=1 gated_delta_step 16:4", "B=4 xla",
                                                   "B=4 gated_delta_step 16:4"]
    for r in d["conv"] + d["decode"]:
        assert "error" not in r and r["s"]["median"] > 0, r
        assert all(v < 1e-5 for k, v in r.items() if k.startswith("err")), r
    assert d["conv"][0]["err_out"] == 0 and d["decode"][2]["s_per_step"] == d["decode"][2]["s"]["median"] / 2


@pytest.mark.slow
def test_probe_hybrid_batch_decode_smoke(tmp_path):
    """The hybrid batch-decode probe at the tiny-hybrid shape: a row per batch, each row's tokens the
    requested count, and the first row of a batch of 2 the same greedy tokens as the batch of 1."""
    d = _run("probe_hybrid_batch_decode", tmp_path, "--preset=tiny-hybrid", "--dtype=float32", "--layers=4",
             "--batches=1,2", "--steps=4", "--block=2")
    _meta(d)
    assert [r["batch"] for r in d["rows"]] == [1, 2]
    assert [len(t) for r in d["rows"] for t in r["tokens"]] == [4, 4, 4]
    assert d["rows"][1]["tokens"][0] == d["rows"][0]["tokens"][0] and d["rows"][1]["decode_tokens_per_s"] > 0
    # where the compile time went: each program compiled with its lowering and XLA seconds (CPU: no kernels)
    names = [n for n, _, _ in d["rows"][0]["compile_log"]]
    assert "forward_step" in names and "decode_block" in names and d["rows"][0]["kernels_applied"] == []


@pytest.mark.parametrize("args,message", [
    (["--presets=tiny,nope"], "unknown preset 'nope'"),
    (["--configs=0:128:64:4:1"], "--configs: each must be"),
    (["--triton_configs=64:128:64:4"], "--triton_configs: each must be"),
], ids=["preset", "zero-tile", "four-fields"])
def test_bench_grouped_matmul_refuses_bad_flags_when_parsing(tmp_path, args, message):
    proc = _run_script("bench_grouped_matmul", f"--out_dir={tmp_path}", *args)
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("Pass --helpshort or --helpfull")]
    assert proc.returncode == 1 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not list(tmp_path.glob("*.json"))


def test_bench_grouped_matmul_smoke(tmp_path):
    """bench_grouped_matmul's pieces at the tiny preset on the CPU (no tiles stage there): every piece timed,
    the group sizes those of tokens * top-k rows over the experts."""
    d = _run("bench_grouped_matmul", tmp_path, "--presets=tiny", "--tokens=64", "--repeats=1")
    _meta(d)
    res = d["presets"]["tiny"]
    pieces = res["pieces"]
    assert {"sort", "gather_in", "gmm_gate_up", "swiglu", "gmm_down", "gather_out_sum", "whole"} <= set(pieces)
    assert all(pieces[p]["ms"] > 0 for p in ("sort", "gmm_gate_up", "whole")), pieces
    assert res["shape"]["rows"] == 64 * 4 and pieces["group_rows"]["mean"] == 64 * 4 / 16
    assert "tiles" not in res and d["partial"] is False
    assert [r["case"] for r in d["rows"]][:2] == ["sort", "gather_in"] and all(r["preset"] == "tiny" for r in d["rows"])


@pytest.mark.slow
def test_bench_decode_loop_smoke(tmp_path):
    """Both loop forms at batch 1 with an EOS that stops the generate mid-block, the fixed form's engine first and
    alone: the same tokens, both stopped at the same length before the last step, rates > 0, and the index's
    headline."""
    d = _run("bench_decode_loop", tmp_path, "--preset=tiny", "--layers=2", "--steps=30", "--prompt_len=8",
             "--repeats=1", "--decode_block=8", "--eos_at=12", "--forms=fixed,dynamic", "--noalternate")
    assert _meta(d)["device"]
    dyn, fix = d["rows"]
    assert (dyn["form"], fix["form"]) == ("dynamic", "fixed") and fix["same_tokens_as_dynamic"] is True
    assert (fix["run_order"], dyn["run_order"]) == (0, 1)
    assert dyn["eos_ids"] == fix["eos_ids"] and len(fix["eos_ids"]) == 1
    assert dyn["generated"] == fix["generated"] and 12 < fix["generated"][0] <= 31
    assert dyn["tokens_per_s"]["median"] > 0 and fix["over_dynamic"] > 0
    sys.path.insert(0, str(ROOT / "experiments"))
    import results_index
    (path,) = tmp_path.glob("bench_decode_loop_tiny.json")
    headline = results_index.row(str(path), path.name, results_index._scripts())["headline"]
    assert headline.startswith("b1 fixed ") and "x dynamic (EOS after" in headline


@pytest.mark.slow
def test_bench_decode_loop_times_kernel_configs_side_by_side(tmp_path):
    """Repeated --kernels with one form: an engine per config, timed in turn; the later config's row is given against
    the first's (its rate ratio, its tokens), and the index's headline names both."""
    d = _run("bench_decode_loop", tmp_path, "--preset=tiny", "--layers=2", "--steps=12", "--prompt_len=8",
             "--repeats=1", "--decode_block=4", "--forms=fixed", "--kernels=auto", "--kernels=xla")
    first, other = d["rows"]
    assert [(r["kernels"], r["form"]) for r in d["rows"]] == [("auto", "fixed"), ("xla", "fixed")]
    assert "over_dynamic" not in other and "over_first_kernels" not in first
    assert other["same_tokens_as_first_kernels"] is True  # on the CPU auto runs the references too
    assert other["over_first_kernels"] == pytest.approx(other["tokens_per_s"]["median"]
                                                        / first["tokens_per_s"]["median"])
    sys.path.insert(0, str(ROOT / "experiments"))
    import results_index
    (path,) = tmp_path.glob("bench_decode_loop_tiny.json")
    headline = results_index.row(str(path), path.name, results_index._scripts())["headline"]
    assert headline.startswith("b1 fixed xla ") and headline.endswith("x auto")


def test_a_given_commit_is_recorded_as_given(monkeypatch):
    """``$FTJAX_GIT_COMMIT`` names the commit of a tree copied without its git metadata (a GPU machine's copy):
    every result's ``meta.git_commit`` takes it; unset, the checkout's own commit."""
    from ftjax import provenance
    monkeypatch.delenv("FTJAX_GIT_COMMIT", raising=False)
    own = provenance.git_commit()
    assert own is None or len(own.split("+")[0]) == 40
    monkeypatch.setenv("FTJAX_GIT_COMMIT", " d2e22f3 ")
    assert provenance.git_commit() == "d2e22f3" and provenance.run_meta()["git_commit"] == "d2e22f3"


def test_the_cards_are_read_from_nvidia_smi_and_left_out_without_it(monkeypatch):
    """``gpu_identity`` asks nvidia-smi about the cards ``CUDA_VISIBLE_DEVICES`` names and parses its rows (one per
    card) into UUID, driver and bus id; a failing or missing nvidia-smi gives None, and a CPU run's meta has no
    ``gpus``."""
    import subprocess

    from ftjax import provenance
    out = "GPU-1a2b, 580.159.04, 00000000:1B:00.0\nGPU-3c4d, 580.159.04, 00000000:2C:00.0\n"
    asked = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: asked.append(cmd) or subprocess.CompletedProcess(cmd, 0,
                                                                                                            out, ""))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    provenance.gpu_identity()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert asked[0][-1] == "--id=1,3"  # the cards this process sees, not every card of the host
    assert provenance.gpu_identity() == [
        {"uuid": "GPU-1a2b", "driver_version": "580.159.04", "pci.bus_id": "00000000:1B:00.0"},
        {"uuid": "GPU-3c4d", "driver_version": "580.159.04", "pci.bus_id": "00000000:2C:00.0"}]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 9, "", "no devices"))
    assert provenance.gpu_identity() is None

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(subprocess, "run", missing)
    assert provenance.gpu_identity() is None
    monkeypatch.setenv("FTJAX_GIT_COMMIT", "d2e22f3")  # run_meta would ask git otherwise (subprocess is patched)
    assert "gpus" not in provenance.run_meta()


def test_probe_copy_stream_smoke(tmp_path):
    """XLA's copy on the CPU: the nine variants run with no copy of the whole buffer (the read of the layer before's
    row is ordered before the copy), the annotated variants compute what their serial ones do and keep the annotation
    in the program text, with no stream of their own on the CPU; the slot-copy kernel is skipped with its reason."""
    d = _run("probe_copy_stream", tmp_path, "--expert_mb=0.1", "--compute_mb=0.5", "--layers=3", "--copies=2",
             "--bank_experts=8", "--pool_experts=5", "--repeats=2", "--b_p_mib=8")
    assert d["skipped"] == {"kernel": "the slot-copy kernel needs a GPU backend, not cpu",
                            "graphs=on": "command buffers are XLA:GPU's"}
    rows = {r["variant"]: r for r in d["rows"]}
    assert list(rows) == ["empty", "copy", "compute", "serial", "stream1", "serial_pool", "stream1_pool", "compute_on1",
                          "stream1_compute"]
    assert {r["graphs"] for r in d["rows"]} == {"off"}
    assert all("error" not in r and r["ms_per_layer"]["median"] > 0 for r in d["rows"]), d["rows"]
    assert all(r["buffer_copies"] == 0 and r["operation_queue_ids"] == [] for r in d["rows"]), d["rows"]
    for v in ("stream1", "stream1_pool"):
        assert rows[v]["annotated"] and not rows[v.replace("stream1", "serial")]["annotated"]
        assert rows[v]["same_result_as_serial"] is True and rows[v]["max_abs_diff_vs_serial"] == [0.0, 0.0]
    assert rows["compute_on1"]["annotated"] and rows["stream1_compute"]["annotated"]
    # the compute's fusion may change at the call boundary: the buffer is the same, the activations within rounding
    buf_diff, act_diff = rows["stream1_compute"]["max_abs_diff_vs_serial"]
    assert buf_diff == 0.0 and act_diff < 1e-2
    assert d["shape"]["expert_bytes"] == 49152 * 2 and d["shape"]["compute_mats"] == 1  # 0.1 MB in 4096-wide rows
    (o,) = d["overlap"]
    assert o["copy_ms"] == pytest.approx(rows["copy"]["ms_per_layer"]["median"] - o["empty_ms"])


def test_probe_copy_stream_rows_and_copies():
    """Each layer reads a row the layer before wrote and this layer does not (a pool of 5 rows and 2 copies: a ring
    of 4); a whole-buffer copy in HLO text is counted, a copy of another shape is not."""
    probe = import_app("experiments.probe_copy_stream")
    ids, slots, read = (a.tolist() for a in probe.layer_slots(5, copies=2, layers=3, bank_experts=8))
    assert slots == [[0, 1], [2, 3], [0, 1]] and read == [2, 0, 2]
    assert read[0] not in slots[0] and all(read[l] in slots[l - 1] and read[l] not in slots[l] for l in range(1, 3))
    assert all(0 <= i < 8 for row in ids for i in row)
    text = ("  %copy.3 = bf16[5,4096]{1,0} copy(bf16[5,4096]{1,0} %p)\n  %copy.4 = bf16[2,4096]{1,0} copy(%r)\n"
            "  %fusion.2 = bf16[5,4096]{1,0} fusion(%p), kind=kLoop\n")
    assert probe.buffer_copies(text, (5, 4096)) == 1


def test_decode_speed_compares_tokens_over_the_steps_both_ran():
    """A cached row's tokens against the resident row's: equal over the shorter run is no difference (the cached rows
    run fewer steps), the first differing index over every row is reported, and another batch is refused."""
    first = import_app("experiments.bench_decode_speed")._first_difference
    want = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert first([[1, 2, 3], [6, 7, 8]], want) is None
    assert first([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], want) is None
    assert first([[1, 2, 3], [6, 0, 8]], want) == 1
    assert first([[1, 2, 0], [6, 7, 8, 0]], want) == 2
    assert first([[9], [6]], want) == 0
    with pytest.raises(ValueError, match="tokens of 1 rows compared with 2 rows"):
        first([[1, 2]], want)


def _hlo_line(name, shape, op, tiles=None, algorithm=None):
    """One instruction of an XLA:GPU dump: a Triton fusion with ``tiles`` output tiles, or a cuBLAS GEMM."""
    meta = f'metadata={{op_name="jit(decode_block)/{op}" stack_frame_id=1}}'
    if algorithm is not None:
        return (f'  %{name} = ({shape}, s8[64]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", '
                f'{meta}, backend_config={{"gemm_backend_config":{{"alpha_real":1,'
                f'"selected_algorithm":"{algorithm}"}}}}')
    return (f'  %{name} = {shape} fusion(%a), kind=kCustom, calls=%f, {meta}, backend_config={{"fusion_backend_config"'
            f':{{"block_level_fusion_config":{{"num_warps":"1","output_tiles":[{{"sizes":["1","{tiles}"]}}]}},'
            f'"kind":"__triton"}},"operation_queue_id":"0"}}')


def test_hlo_tiling_names_the_ops_two_programs_build_otherwise():
    """Another tile, another cuBLAS algorithm, another count of one op's fusions and an op fused elsewhere are each
    reported by op name and shape; ops built alike are not; a tuple's first shape is the op's."""
    tiling = import_app("experiments.hlo_tiling")
    a = tiling.tilings("\n".join([_hlo_line("r", "f32[4,16]{1,0}", "norm/reduce_sum", tiles=4),
                                  _hlo_line("s", "f32[1,128]{1,0}", "router/div", tiles=128),
                                  _hlo_line("h", "bf16[151936]{0}", "dot_general", algorithm=0),
                                  _hlo_line("x", "bf16[8]{0}", "add", tiles=8),
                                  _hlo_line("m", "bf16[8]{0}", "moe/add", tiles=8),
                                  "  %add.1 = f32[4]{0} add(%p, %q)"]))
    b = tiling.tilings("\n".join([_hlo_line("r.1", "f32[4,16]{1,0}", "norm/reduce_sum", tiles=16),
                                  _hlo_line("s.1", "f32[1,128]{1,0}", "router/div", tiles=128),
                                  _hlo_line("h.1", "bf16[151936]{0}", "dot_general", algorithm=5),
                                  _hlo_line("m.1", "bf16[8]{0}", "moe/add", tiles=8),
                                  _hlo_line("m.2", "bf16[8]{0}", "moe/add", tiles=8),
                                  _hlo_line("y", "s32[]", "stats/reduce_sum", tiles=1)]))
    assert [t["name"] for t in a] == ["r", "s", "h", "x", "m"] and a[2]["shape"] == "bf16[151936]{0}"
    assert a[2]["kind"] == "__cublas$lt$matmul" and a[2]["config"] == "algorithm 0"
    assert a[0]["config"] == '{"num_warps":"1","output_tiles":[{"sizes":["1","4"]}]}'
    diff = tiling.differences(a, b)
    assert [(d["op_name"].split("/", 1)[1], d["first"], d["second"]) for d in diff["ops"]] == [
        ("dot_general", [["__cublas$lt$matmul", "algorithm 0", 1]], [["__cublas$lt$matmul", "algorithm 5", 1]]),
        ("moe/add", [["__triton", a[4]["config"], 1]], [["__triton", a[4]["config"], 2]]),
        ("norm/reduce_sum", [["__triton", a[0]["config"], 1]], [["__triton", b[0]["config"], 1]])]
    assert [(d["op_name"].split("/", 1)[1], d["shape"]) for d in diff["only_first"]] == [("add", "bf16[8]{0}")]
    assert [d["op_name"].split("/", 1)[1] for d in diff["only_second"]] == ["stats/reduce_sum"]
    assert tiling.differences(a, a) == {"ops": [], "only_first": [], "only_second": []}


def test_hlo_tiling_compares_the_layer_scan_with_the_per_layer_programs():
    """Across programs (--across): an op of the scan body and the same op of a per-layer program compare without
    their prefixes, an op the scan builds once per layer of its block counts as built once, and a config one side
    alone uses is reported."""
    tiling = import_app("experiments.hlo_tiling")
    assert tiling.layer_op("jit(forward_step)/while/body/eval_jaxpr/moe/add") == "moe/add"
    # XLA:CPU names its optimized module otherwise than XLA:GPU: the module name is the same
    assert tiling.module_of("module_0044.jit_layer_program.cpu_after_optimizations.txt") == (44, "jit_layer_program")
    assert tiling.layer_op("jit(layer_program)/gated_deltanet/while/body/eval_jaxpr/dot_general") == \
        "gated_deltanet/while/body/eval_jaxpr/dot_general"  # a loop inside the layer keeps its name
    scan = tiling.tilings("\n".join([_hlo_line(f"m{i}", "f32[8]{0}", "while/body/eval_jaxpr/moe/add", tiles=8)
                                      for i in range(3)] +
                                     [_hlo_line("n", "f32[4,16]{1,0}", "while/body/eval_jaxpr/norm/reduce_sum",
                                                tiles=4)]))
    layers = tiling.tilings("\n".join([_hlo_line("m", "f32[8]{0}", "moe/add", tiles=8),
                                        _hlo_line("n", "f32[4,16]{1,0}", "norm/reduce_sum", tiles=16)]))
    diff = tiling.differences_across(scan, layers)
    assert [(d["op_name"], d["first"][0][2], d["second"][0][2]) for d in diff["ops"]] == [("norm/reduce_sum", 1, 1)]
    assert diff["ops"][0]["first"][0][1] != diff["ops"][0]["second"][0][1]  # 4 against 16 tiles
    assert diff["only_first"] == diff["only_second"] == []  # moe/add: three layers of the body, one program: alike


def test_hlo_tiling_reads_a_committed_gpu_program():
    """On a real XLA:GPU decode block (H100, 2026-12-06, committed under experiments/results/hlo/) the parser finds its
    one cuBLAS GEMM (the head, with its algorithm) and its six Triton fusions with their tiles, each named by its op."""
    tiling = import_app("experiments.hlo_tiling")
    name = "decode_block_resident_b1_qwen3-30b-a3b_16l_h100_2026-12-06.hlo.txt"
    text = (ROOT / "experiments" / "results" / "hlo" / name).read_text()
    got = tiling.tilings(text)
    kinds = [t["kind"] for t in got]
    assert kinds.count("__cublas$lt$matmul") == 1 and kinds.count("__triton") == 6 and len(got) == 7
    head = next(t for t in got if t["kind"] == "__cublas$lt$matmul")
    assert head["shape"] == "bf16[151936]{0}" and head["config"] == "algorithm 0"
    assert head["op_name"].endswith("jit(forward_step)/dot_general")
    assert all(t["op_name"].startswith("jit(decode_block)/") for t in got)
    assert all(t["config"].startswith('{"group_size"') and '"output_tiles"' in t["config"] for t in got
               if t["kind"] == "__triton")


def test_hlo_tiling_pairs_the_programs_of_one_name_in_compile_order(tmp_path):
    """The script reads a dump's programs by module number, compares only programs of one module name (and names a
    program it compared with none), and writes its JSON with the run's meta."""
    dump = tmp_path / "dump"
    dump.mkdir()
    files = {"module_0100.jit_decode_block.sm_9.0a_gpu_after_optimizations.txt": 4,
             "module_0020.jit_decode_block.after_optimizations.txt": 16,
             "module_0050.jit_forward_step.sm_9.0a_gpu_after_optimizations.txt": 4,
             "module_0070.jit_layer_program.sm_9.0a_gpu_after_optimizations.txt": 16}
    for name, tiles in files.items():
        (dump / name).write_text(_hlo_line("r", "f32[4,16]{1,0}", "norm/reduce_sum", tiles=tiles))
    r = _run_script("hlo_tiling", str(dump), f"--out={tmp_path / 'out' / 't.json'}",
                    "--across=jit_forward_step,jit_layer_program")
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "out" / "t.json").read_text())
    assert [p["module"] for p in got["programs"]] == ["jit_decode_block", "jit_forward_step", "jit_layer_program",
                                                      "jit_decode_block"]
    # the pair of one name, then the scan program against the layer programs together (--across)
    assert [(d["first"][:11], d["second"][:11] if isinstance(d["second"], str) else [f[:11] for f in d["second"]],
             len(d["ops"])) for d in got["differences"]] == [("module_0020", "module_0100", 1),
                                                             ("module_0050", ["module_0070"], 1)]
    assert got["meta"]["jax"] and got["dump"] == "dump" and "1 ops built otherwise" in r.stdout
    assert "no other of its module name): ['module_0050.jit_forward_step" in r.stderr


def test_probe_host_ffi_smoke(tmp_path):
    """The host-FFI probe on the CPU: every program gives numpy's result (the expert rows: the C kernel's own, through
    the engine's callbacks and through the handler in a host region), the handlers (built with the system C++
    compiler) are called inside a host-compute region (their targets and the host annotation in the compiled
    program), the bank's adds the bank row a device int32 names, and a second run in the process reuses the
    handlers; without a C++ compiler the handlers' rows are skipped with the reason."""
    import shutil
    small = ("--hidden=64", "--bank_mb=1", "--experts=4", "--ffn=32", "--ks=1,2", "--threads=2", "--pause_s=0")
    d = _run("probe_host_ffi", tmp_path / "first", "--repeats=3", *small)
    rows = {r["variant"]: r for r in d["rows"]}
    assert all(r["ok"] and r["correct"] and r["us"]["n"] == 3 for r in rows.values()), rows
    assert d["bank"] == {"rows": 4096, "bytes": 2**20, "memory_kind": "pinned_host"}
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        assert "host_ffi" in d["skipped"] and not any(v.startswith("host_ffi") or "expert_ffn" in v for v in rows)
        return
    assert "host_ffi" not in d["skipped"] and d["compiler"]
    if "experts" in d["skipped"]:  # a C++ compiler but no C one for the kernel
        assert list(rows) == ["device", "io_callback", "host_jnp", "host_ffi", "host_ffi_bank"]
        return
    # what needs no handler first (a handler that ends the process leaves every row before it)
    assert list(rows) == ["device", "io_callback", "host_jnp", "native_callbacks_k1", "native_callbacks_k2",
                          "host_ffi", "host_ffi_bank", "host_expert_ffn_k1", "host_expert_ffn_k2"]
    for k in (1, 2):
        hlo = rows[f"host_expert_ffn_k{k}"]["hlo"]
        assert hlo["ftjax_probe_expert_ffn"] >= 1 and hlo["_xla_compute_type"] >= 1
        assert rows[f"native_callbacks_k{k}"]["kernel_rel_err"] < 1e-5  # the kernel against a float64 SwiGLU
    assert [f["route"] for f in d["fits"]] == ["native_callbacks", "host_expert_ffn"]
    assert all(f["ks"] == [1, 2] and math.isfinite(f["fixed_us"]) for f in d["fits"])
    assert d["experts"]["expert_bytes"] == 2 * 3 * 64 * 32
    assert rows["host_ffi"]["hlo"]["ftjax_probe_double"] >= 1 and rows["host_ffi"]["hlo"]["_xla_compute_type"] >= 1
    assert rows["host_ffi_bank"]["hlo"]["ftjax_probe_double_add_row"] >= 1
    assert rows["device"]["hlo"]["ftjax_probe_double"] == rows["host_jnp"]["hlo"]["ftjax_probe_double"] == 0
    again = _run("probe_host_ffi", tmp_path / "second", "--repeats=1", "--skip=host_ffi,host_expert_ffn_k*", *small)
    assert again["compiler"] == "registered earlier in this process"
    assert [r["variant"] for r in again["rows"] if r["ok"] and r["correct"]] == [
        "device", "io_callback", "host_jnp", "native_callbacks_k1", "native_callbacks_k2", "host_ffi_bank"]
    assert again["left_out"] == ["host_ffi", "host_expert_ffn_k1", "host_expert_ffn_k2"] and again["skipped"] == {}
    assert again["host_registration"] == {}  # the GPU plugin's host platform: registered only on a GPU


def test_probe_host_ffi_pending_row():
    """A variant's row is saved as pending before its first compile and call: a handler that ends the process there
    leaves its name in the JSON (what an H100 run of 2026-12-07 left none of)."""
    from experiments import probe_host_ffi
    out, saved = {"rows": []}, []

    def boom(*args):
        raise SystemExit("the process ends here")  # stands for a crash inside the first call

    with pytest.raises(SystemExit):
        probe_host_ffi.first_run(out, lambda: saved.append(json.dumps(out)), "host_ffi", boom, (), None)
    assert json.loads(saved[-1])["rows"] == [{"variant": "host_ffi", "ok": False, "error": probe_host_ffi.PENDING}]
