"""The host-split driver (``ftjax.runtime.host_split``, ``MissPolicyConfig.cpu_driver = "host"``): a call whose
split computes misses on the CPU runs layer by layer from Python, the host kernel called between a layer's
programs instead of through callbacks inside one program.

What must hold: the same split as the in-program path (the same hits, misses, fetches and CPU experts, the same
slot table and recency afterwards), and logits bit-identical to the resident model's with the XLA:CPU host
kernel ("callback"), which evaluates the device's expression on the same backend (tests/test_miss_policy.py
says why that is exact). These run in the test process: the host driver calls no callback, so the CPU client's
asynchronous dispatch is no obstacle (the in-program comparison uses ``compute_on``, which needs none either).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from cli_helpers import run_generate, run_module_app
from conftest import load_fixture
from ftjax import Engine
from ftjax.config import EngineConfig, MissPolicyConfig
from ftjax.serve.scheduler import SamplingParams, Scheduler

STEPS = 12


@pytest.fixture(scope="module")
def qwen():
    model, exp = load_fixture("qwen3_moe_fp32")  # L=3, E=8, top-2
    prompt = exp["short_prompt_ids"].tolist()
    want = Engine(model, EngineConfig("resident", max_seq_len=384)).generate([prompt], STEPS, keep_logits=True,
                                                                            trace_routing=True)
    return model, prompt, want


def _run_calibrate(*args: str):
    return run_module_app("ftjax.calibrate", args, define=lambda m: setattr(m, "FLAGS", m._flags()))


def _engine(model, miss: MissPolicyConfig, batch: int = 1) -> Engine:
    return Engine(model, EngineConfig("cached", num_slots=model.cfg.num_experts, max_seq_len=384, batch=batch,
                                      miss=miss))


@pytest.mark.parametrize("policy,fixed", [("cpu", None), ("adaptive", 1)])
def test_host_driver_splits_as_the_program_does_and_equals_resident(qwen, policy, fixed):
    model, prompt, want = qwen
    host = _engine(model, MissPolicyConfig(policy, "callback", fixed_fetch=fixed, cpu_driver="host"))
    inside = _engine(model, MissPolicyConfig(policy, "compute_on", fixed_fetch=fixed))
    got = host.generate([prompt], STEPS, keep_logits=True, trace_routing=True)
    ref = inside.generate([prompt], STEPS, keep_logits=True)
    assert host.planner.plan(1, 1, 1).driver == "host_split" and inside.planner.plan(1, 1, 1).driver == "scan"
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    np.testing.assert_array_equal(got.step_logits, ref.step_logits)
    for a, b in zip(got.routing, want.routing):
        np.testing.assert_array_equal(a, b)
    mh, mi = host.expert_cache_metrics(), inside.expert_cache_metrics()
    for key in ("hits", "misses", "fetched", "cpu_computed", "bytes_h2d"):
        assert mh[key] == mi[key], key
    assert mh["cpu_computed"] > 0 and (mh["fetched"] > 0) == (policy == "adaptive")
    for f in ("slot_of", "id_of_slot", "last_use", "clock"):
        np.testing.assert_array_equal(getattr(host.state.table, f), getattr(inside.state.table, f))
    np.testing.assert_array_equal(host.state.last_routed, inside.state.last_routed)
    # the 16-token prompt bucket routes <= GATHER_MAX_PAIRS pairs: the prefill call split on the host too
    assert host.prefill_driver_calls["host_split"] == 1
    # the host's time by phase: every call (the prefill and STEPS - 1 decode steps) and layer counted
    times = mh["host_split"]
    assert times["calls"] == STEPS and times["layers"] == STEPS * model.cfg.num_layers, times
    assert set(times["per_layer_ms"]) == {"front", "device", "read", "cpu"}
    assert times["seconds"]["cpu"] > 0 and sum(times["seconds"].values()) <= times["call_s"], times
    assert "host_split" not in mi  # the in-program split keeps no host phases


def test_host_driver_head_runs_under_the_steps_matmul_precision(qwen):
    """The host-split driver's head program is traced under the call's options (HIGHEST for a float32 model), as the
    layer scan's head is."""
    from conftest import head_programs_precision
    model, prompt, _ = qwen
    eng = _engine(model, MissPolicyConfig("cpu", "callback", cpu_driver="host"))
    eng.generate([prompt], 2)
    assert eng.prefill_driver_calls["host_split"] == 1
    heads = head_programs_precision(eng)  # the prefill's and, where it splits, the decode's
    assert heads and set(heads) == {("highest", True)}, heads


@pytest.mark.slow
def test_host_driver_hybrid_batch_of_two_equals_resident():
    """Gated DeltaNet and attention layers (the layer pattern's kinds meet in the front programs), two rows of
    different lengths decoded together."""
    model, exp = load_fixture("qwen3_5_moe_fp32")
    p = exp["short_prompt_ids"].tolist()
    prompts = [p, p[:5]]
    want = Engine(model, EngineConfig("resident", max_seq_len=384, batch=2)).generate(prompts, 6, keep_logits=True)
    eng = _engine(model, MissPolicyConfig("adaptive", "callback", fixed_fetch=1, cpu_driver="host"), batch=2)
    got = eng.generate(prompts, 6, keep_logits=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert got.generated_ids == want.generated_ids
    m = eng.expert_cache_metrics()
    assert m["cpu_computed"] > 0 and m["fetched"] > 0 and m["fetched"] + m["cpu_computed"] == m["misses"]


def test_host_driver_serves_requests_one_step_per_call(qwen):
    """Decode blocks are layer-scan programs: under the host driver the scheduler decodes a step per call (a
    block asked for by name is refused), and two requests served together, one arriving late, get the tokens
    each gets alone."""
    model, prompt, want = qwen
    eng = _engine(model, MissPolicyConfig("cpu", "callback", cpu_driver="host"), batch=2)
    assert not eng.blocks_decode(2)
    with pytest.raises(ValueError, match="host-split driver.*decode_block=1"):
        Scheduler(eng, decode_block=4)
    sched = Scheduler(eng)
    assert sched.decode_block == 1
    other = prompt[3:]
    alone = Engine(model, EngineConfig("resident", max_seq_len=384)).generate([other], 5).generated_ids[0]
    sched.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0), "A")
    tokens, step = {"A": [], "B": []}, 0
    while sched.has_work():
        if step == 2:
            sched.submit(other, SamplingParams(max_tokens=5, temperature=0.0), "B")
        for ev in sched.step():
            if ev.token_id is not None:
                tokens[ev.request_id].append(ev.token_id)
        step += 1
        assert step < 100
    assert tokens == {"A": want.generated_ids[0][:6], "B": alone}
    # a fetch-only split at this size keeps the scan (and its blocks)
    fetch_all = _engine(model, MissPolicyConfig("adaptive", "callback", fixed_fetch=8, cpu_driver="host"))
    assert fetch_all.blocks_decode(1) and fetch_all.planner.plan(1, 1, 1).driver == "scan"


def test_host_driver_needs_a_host_kernel():
    with pytest.raises(ValueError, match="cpu_driver 'host'.*'compute_on' has none"):
        MissPolicyConfig("cpu", "compute_on", cpu_driver="host")
    with pytest.raises(ValueError, match="cpu driver"):
        MissPolicyConfig("cpu", "callback", cpu_driver="thread")


def test_adaptive_host_driver_calibrates_its_own_entry(qwen, tmp_path):
    """The split of the host driver is fitted on the host step's costs: a profile entry ``<impl>@host`` next
    to the in-program one, calibrated on first use."""
    model, prompt, want = qwen
    prof = tmp_path / "prof.json"
    eng = _engine(model, MissPolicyConfig("adaptive", "callback", cpu_driver="host", calibration_profile=str(prof)))
    cal = eng.miss.calibration
    assert cal["calibrated_now"] and set(cal["entry"]["impls"]) == {"callback@host"}
    stored = json.loads(prof.read_text())["entries"][cal["key"]]["impls"]["callback@host"]
    assert stored["ok"] and stored["cpu"]["beta_s"] > 0 and eng.miss.split_for(2) == stored["split_table"]
    got = eng.generate([prompt], 4, keep_logits=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits[:4])


def test_generate_cli_host_driver(qwen, tmp_path):
    """``--cpu_miss_driver=host`` through the CLI, in this process (no callback, so no synchronous dispatch)."""
    model, prompt, want = qwen
    metrics, logits = tmp_path / "m.json", tmp_path / "l.npy"
    r = run_generate(f"--checkpoint={model.name}", f"--prompt_ids={','.join(map(str, prompt))}",
                     f"--max_new_tokens={STEPS}", f"--expert_slots={model.cfg.num_experts}", "--max_seq_len=384",
                     "--miss_policy=cpu", "--cpu_expert_impl=callback", "--cpu_miss_driver=host", "--decode_block=4",
                     f"--metrics_json={metrics}", f"--logits_npy={logits}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--decode_block=4 applies only where every miss is fetched" in r.stdout
    np.testing.assert_array_equal(np.load(logits), want.step_logits[:, 0])
    ec = json.loads(metrics.read_text())["expert_cache"]
    assert ec["cpu_computed"] == ec["misses"] > 0 and ec["fetched"] == 0
    prof = tmp_path / "prof.json"
    for run in range(2):  # the second run reads the "callback@host" entry the first calibrated
        r = run_generate(f"--checkpoint={model.name}", "--prompt_ids=1,2,3", "--max_new_tokens=3",
                         f"--expert_slots={model.cfg.num_experts}", "--max_seq_len=384", "--miss_policy=adaptive",
                         "--cpu_expert_impl=callback", "--cpu_miss_driver=host", f"--calibration_profile={prof}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("(calibrated now)" in r.stdout) == (run == 0) and "callback@host: copy" in r.stdout
    r = run_generate("--miss_policy=cpu", "--cpu_expert_impl=compute_on", "--cpu_miss_driver=host",
                     "--max_new_tokens=2", "--prompt_ids=1,2,3")
    assert r.returncode == 1 and "cpu_driver 'host'" in r.stderr and "Traceback" not in r.stderr


def test_a_call_that_streams_whole_layers_keeps_the_scan(qwen):
    """With 2E slots a prefill call of >= E / k tokens streams whole layers (every expert fetched): the split has
    nothing to do there, so it stays on the scan, and the host driver's counters and table equal the in-program
    split's."""
    model, prompt, want = qwen
    e = model.cfg.num_experts
    engines = [Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=384, miss=miss)) for miss in (
        MissPolicyConfig("adaptive", "callback", fixed_fetch=1, cpu_driver="host"),
        MissPolicyConfig("adaptive", "compute_on", fixed_fetch=1))]
    plan = engines[0].planner.plan(1, 16, 16)
    assert plan.driver == "scan" and plan.opts.stream
    host, inside = (eng.generate([prompt], 6, keep_logits=True) for eng in engines)
    np.testing.assert_array_equal(host.step_logits, want.step_logits[:6])
    mh, mi = (eng.expert_cache_metrics() for eng in engines)
    assert all(mh[k] == mi[k] for k in ("hits", "misses", "fetched", "cpu_computed", "bytes_h2d"))
    for f in ("slot_of", "id_of_slot", "last_use"):
        np.testing.assert_array_equal(getattr(engines[0].state.table, f), getattr(engines[1].state.table, f))


def test_an_interrupt_inside_a_host_split_call_leaves_the_engine_usable(qwen):
    """Ctrl-C lands inside the host driver's Python loop over layers after the expert state was donated: the
    engine rebuilds its state (an empty cache) and the next run is right."""
    model, prompt, want = qwen
    eng = _engine(model, MissPolicyConfig("cpu", "callback", cpu_driver="host"))
    kernel = eng.miss.config.cpu.kernel
    real, calls = kernel.compute, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a)

    kernel.compute = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.generate([prompt], 4)
    finally:
        del kernel.compute
    assert eng.failed_steps == 1 and not any(x.is_deleted() for x in jax.tree.leaves(eng.state))
    got = eng.generate([prompt], 4, keep_logits=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits[:4])


def test_calibrate_cli_host_driver_takes_the_mechanisms_with_a_host_kernel(tmp_path):
    """``python -m ftjax.calibrate --drivers=host`` (in this process: nothing calls a callback) calibrates the
    mechanisms that have a host kernel, says which it leaves out, and refuses a list with none."""
    prof = tmp_path / "p.json"
    r = _run_calibrate("--preset=tiny", "--quick", "--bank_rows=8", f"--profile={prof}", "--drivers=host,host",
                       "--impls=callback,compute_on")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compute_on has no host kernel: left out of --drivers=host" in r.stdout
    assert r.stdout.count("callback@host: copy") == 1
    (entry,) = json.loads(prof.read_text())["entries"].values()
    assert set(entry["impls"]) == {"callback@host"} and entry["impls"]["callback@host"]["ok"]
    r = _run_calibrate("--preset=tiny", "--quick", f"--profile={prof}", "--drivers=host", "--impls=compute_on")
    assert r.returncode == 1 and "none of --impls ['compute_on'] has one" in r.stderr and "Traceback" not in r.stderr


def test_quantized_banks_calibrate_their_own_entry(qwen, tmp_path):
    """An adaptive split over int8 banks is fitted on int8 copies and the kernel's int8 decoding (the weights
    and scales of ``ExpertBanks``), in a profile entry of its own: a dense entry of the same shape is not taken
    for it. The logits equal the resident model's over the same banks."""
    from ftjax.experts import quant
    model, prompt, _ = qwen
    q = dataclasses.replace(model, banks=quant.quantize_banks(model.banks, "int8"))
    want = Engine(q, EngineConfig("resident", max_seq_len=384)).generate([prompt], 4, keep_logits=True)
    prof = str(tmp_path / "p.json")
    dense = _engine(model, MissPolicyConfig("adaptive", "callback", cpu_driver="host", calibration_profile=prof))
    eng = _engine(q, MissPolicyConfig("adaptive", "callback", cpu_driver="host", calibration_profile=prof))
    cal = eng.miss.calibration
    assert cal["calibrated_now"] and cal["key"] == dense.miss.calibration["key"] + "|int8"
    assert cal["entry"]["format"]["bank_format"] == "int8"
    assert cal["entry"]["format"]["expert_bytes"] == q.banks.expert_bytes < model.banks.expert_bytes
    assert cal["entry"]["impls"]["callback@host"]["ok"]
    got = eng.generate([prompt], 4, keep_logits=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
