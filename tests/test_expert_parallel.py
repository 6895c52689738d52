"""The experts split over the devices of one host (``EngineConfig.devices``): whole experts per device
(``expert_split="expert"``, ftjax/experts/parallel.py) and every expert split on its FFN width
(``expert_split="tensor"``, ftjax/experts/tensor_parallel.py).

Over N = 2 and 4 forced CPU devices (tests/conftest.py sets ``--xla_force_host_platform_device_count=4``),
each experts mode must give one device's greedy tokens and its logits to float32 rounding: the devices sum
the same expert outputs in another order. The tensor split keeps one device's slot table: its hits and
misses are one device's, exactly. The tiny preset in float32, a prompt long enough that its prefill
takes the grouped expert matmul (and, with 2E slots, streams whole layers), then a few decode steps.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import json
import pathlib

from cli_helpers import run_generate, run_module_app
from ftjax import Engine
from ftjax.checkpoint import random_model
from ftjax.config import EngineConfig, MissPolicyConfig, check_devices, preset
from ftjax.serve.scheduler import SamplingParams, Scheduler

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (XLA_FLAGS, tests/conftest.py)")

PROMPT = list(range(3, 40))  # 37 tokens x top-4 = 148 pairs: the grouped matmul; >= E pairs: streams with 2E slots
NEW = 6
E = 16  # the tiny preset's experts per layer

# (experts mode, slots, prefill): resident; cached at 2E (streamed prefill, cached decode); cached at the smallest
# cache S = E with the routed experts through each device's table in prefill too; on_demand (nothing reused)
CASES = {"resident": ("resident", None, "auto"), "cached_stream": ("cached", 2 * E, "auto"),
         "cached_smallest": ("cached", E, "on_demand"), "on_demand": ("on_demand", 2 * E, "on_demand")}


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), "float32", seed=0)


@pytest.fixture(scope="module")
def one_device(model):
    """The reference of every mode: one device, resident (cached and on_demand runs on one device are
    bit-identical to it: tests/test_offload.py)."""
    return _run(model, "resident", 1)


F = 128  # the tiny preset's expert FFN width


def _run(model, case: str, devices: int, split: str = "expert"):
    mode, slots, prefill = CASES[case]
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=64, prefill=prefill, devices=devices,
                                        expert_split=split))
    return engine, engine.generate([PROMPT], max_new_tokens=NEW, keep_logits=True)


def _params():
    """By default the smallest cache and on_demand (no other default test splits them) on 2 devices, and resident on
    4; the other (mode, devices) pairs are slow (resident on 2 is the split of the 4-device case; the streamed
    prefill on 2 runs by default in test_scheduler_admitting_while_decoding_matches_one_device, tokens only)."""
    for case in CASES:
        for n in (2, 4):
            slow = (case, n) not in (("cached_smallest", 2), ("on_demand", 2), ("resident", 4))
            yield pytest.param(case, n, marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("case,devices", list(_params()))
def test_split_experts_match_one_device(model, one_device, case, devices):
    ref, want = one_device
    engine, got = _run(model, case, devices)
    assert got.generated_ids == want.generated_ids
    np.testing.assert_allclose(got.step_logits, want.step_logits, rtol=1e-5, atol=1e-5)
    # each device counts its own share of a decode layer's routed experts: the sums are one device's
    routed = lambda e: e.expert_cache_metrics()["decode"]["hits"] + e.expert_cache_metrics()["decode"]["misses"]  # noqa
    assert routed(engine) == routed(ref) > 0
    pool = engine.state.gate_up  # each device holds 1/N of the experts (resident) or of the slots
    assert {s.data.shape[0 if case != "resident" else 1] for s in pool.addressable_shards} == \
        {(engine.num_slots if case != "resident" else E) // devices}
    assert len(pool.sharding.device_set) == devices


@pytest.mark.parametrize("case,devices", list(_params()))
def test_tensor_split_matches_one_device(model, one_device, case, devices):
    """Every expert split on F: one device's tokens and logits, one device's hits and misses (its one table,
    replicated), each device holding a 1/N piece of every slot."""
    ref, want = one_device
    engine, got = _run(model, case, devices, "tensor")
    assert got.generated_ids == want.generated_ids
    np.testing.assert_allclose(got.step_logits, want.step_logits, rtol=1e-5, atol=1e-5)
    same, _ = _run(model, case, 1)  # the same mode and slots on one device
    counts = lambda e: {p: (m[p]["hits"], m[p]["misses"]) for m in [e.expert_cache_metrics()]  # noqa: E731
                        for p in ("prefill", "decode")}
    assert counts(engine) == counts(same)
    assert engine.resident_experts_per_layer() == same.resident_experts_per_layer()
    rows = engine.num_slots  # resident: L*E
    assert {s.data.shape for s in engine.state.gate_up.addressable_shards} == {(rows, 128, 2 * F // devices)}
    assert {s.data.shape for s in engine.state.down.addressable_shards} == {(rows, F // devices, 128)}
    if engine.state.table is not None:
        assert engine.state.table.slot_of.sharding.is_fully_replicated
        engine.reset_expert_cache()  # cold again: the same counts once more
        before = counts(engine)
        engine.generate([PROMPT], max_new_tokens=NEW)
        after = counts(engine)
        assert {p: (after[p][0] - before[p][0], after[p][1] - before[p][1]) for p in after} == counts(same)


def test_tensor_split_slots_and_refusals(model):
    """The tensor split's one table takes any S in [E, L*E] (no division by N); N must divide F; dense only."""
    engine = Engine(model, EngineConfig("cached", num_slots=E + 1, max_seq_len=64, devices=2, expert_split="tensor"))
    assert engine.state.table.id_of_slot.shape == (E + 1,)
    with pytest.raises(ValueError, match="must divide the expert FFN width F=128"):
        Engine(model, EngineConfig("resident", max_seq_len=64, devices=3, expert_split="tensor"))
    with pytest.raises(ValueError, match="unknown expert split 'pipeline'"):
        EngineConfig("cached", num_slots=32, devices=2, expert_split="pipeline")
    # a budget buys the same slots in all under either split (a tensor slot is half an expert on each device, the
    # layer gather E halves instead of E/2 wholes), bounded by L*E pieces, not L*E/N experts, per device
    from ftjax.runtime.planner import plan_memory
    cfg, eb = model.cfg, model.expert_bytes
    fixed = plan_memory(cfg, 4, slots=E // 2, max_seq_len=64, devices=2).budget_bytes - E // 2 * eb
    plans = {split: plan_memory(cfg, 4, budget_bytes=fixed + 20 * eb, max_seq_len=64, devices=2, expert_split=split)
             for split in ("expert", "tensor")}
    assert (plans["expert"].slots, plans["expert"].total_slots) == (20, 40)
    assert (plans["tensor"].slots, plans["tensor"].total_slots, plans["tensor"].expert_bytes) == (40, 40, eb // 2)
    assert plan_memory(cfg, 4, slots=64, devices=2, expert_split="tensor").fits_resident
    from ftjax.experts.quant import quantize_banks
    quantized = random_model(preset("tiny"), "float32", seed=0)
    quantized.banks = quantize_banks(quantized.banks, "int8")
    with pytest.raises(ValueError, match="splits dense expert banks only, got format 'int8'"):
        Engine(quantized, EngineConfig("cached", num_slots=32, max_seq_len=64, devices=2, expert_split="tensor"))


def _served(model, devices: int, split: str = "expert", mixed: bool = False) -> dict[int, list[int]]:
    """Two requests through the continuous-batching scheduler, the second admitted while the first decodes (a
    prefill call and a decode call a step, or with ``mixed`` one mixed call; prefill in chunks of 16): the token
    ids of each, by submission order."""
    engine = Engine(model, EngineConfig("cached", num_slots=2 * E, max_seq_len=64, batch=2, prefill_chunk=16,
                                        devices=devices, expert_split=split))
    sched = Scheduler(engine, mixed_calls=mixed)
    ids = [sched.submit(PROMPT[:27], SamplingParams(max_tokens=5))]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for step in range(30):
        if step == 2:
            ids.append(sched.submit(PROMPT[10:20], SamplingParams(max_tokens=5)))
        for ev in sched.step():
            tokens[ids.index(ev.request_id)].append(ev.token_id)
    return tokens


@pytest.mark.parametrize("mixed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_scheduler_admitting_while_decoding_matches_one_device(model, mixed):
    want = _served(model, 1, mixed=mixed)
    assert all(len(t) == 5 for t in want.values())
    assert _served(model, 2, mixed=mixed) == want
    assert _served(model, 2, "tensor", mixed=mixed) == want


def test_refusals(model):
    with pytest.raises(ValueError, match="exceeds the 4 device"):
        check_devices(8, E, available=4)
    with pytest.raises(ValueError, match="must divide the number of experts E=16"):
        Engine(model, EngineConfig("resident", max_seq_len=64, devices=3))
    with pytest.raises(ValueError, match="num_slots=34 must be divisible by devices=4"):
        Engine(model, EngineConfig("cached", num_slots=34, max_seq_len=64, devices=4))
    with pytest.raises(ValueError, match="miss policy 'cpu' runs on one device"):
        EngineConfig("cached", num_slots=32, devices=2, miss=MissPolicyConfig("cpu"))
    with pytest.raises(ValueError, match="prefill_driver 'pipelined'"):
        EngineConfig("cached", num_slots=32, devices=2, prefill_driver="pipelined")


def test_generate_devices_flag_prints_the_per_device_plan(tmp_path):
    metrics = tmp_path / "m.json"
    r = run_generate("--preset=tiny", "--experts=cached", "--expert_slots=32", "--devices=2", "--prompt_len=20",
                     "--max_new_tokens=3", f"--metrics_json={metrics}")
    assert r.returncode == 0, r.stderr
    assert "memory plan, per device (2 devices, each owning 8 experts of every layer" in r.stdout
    assert "slots 16 of 32 experts in the pool" in r.stdout
    r = run_generate("--preset=tiny", "--experts=cached", "--expert_slots=32", "--devices=2", "--expert_split=tensor",
                     "--prompt_len=20", "--max_new_tokens=3")
    assert r.returncode == 0, r.stderr
    assert "memory plan, per device (2 devices, each holding 1/2 of every expert's FFN width" in r.stdout
    assert "slots 32 of 64 experts in the pool" in r.stdout and "(32 x 0.10 MB)" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--devices=3"], "devices=3 must divide the number of experts E=16"),
    (["--devices=8"], "devices=8 exceeds the 4 device(s) present"),
    (["--devices=2", "--kv_offload"], "--kv_offload=True is one device's"),
    (["--devices=3", "--expert_split=tensor"], "devices=3 must divide the expert FFN width F=128"),
    (["--devices=2", "--expert_split=tensor", "--expert_dtype=int4"], "--expert_dtype=int4 is quantized"),
])
def test_generate_devices_refusals(args, message):
    r = run_generate("--preset=tiny", "--max_new_tokens=2", *args)
    assert r.returncode == 1 and message in r.stderr, r.stderr


@pytest.mark.slow
def test_gpu_script_smoke(tmp_path):
    """experiments/check_expert_parallel_gpu.py at the tiny preset on 1 and 2 CPU devices, both splits: it writes
    its JSON, the per-device plans split the experts (or every expert), and the greedy ids agree."""
    root = pathlib.Path(__file__).resolve().parents[1]
    r = run_module_app("experiments.check_expert_parallel_gpu", [
        "--preset=tiny", "--dtype=float32", "--vram_budget_gb=1.012", "--prefill_tokens=64", "--decode_tokens=4",
        "--repeats=1", f"--out_dir={tmp_path}"], program=str(root / "experiments" / "check_expert_parallel_gpu.py"),
        cwd=str(root))
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "check_expert_parallel_gpu.json").read_text())
    assert [(row["devices"], row["expert_split"]) for row in d["rows"]] == [(1, "expert"), (2, "expert"), (2, "tensor")]
    assert d["rows"][1]["memory_plan"]["num_experts"] == E // 2 and d["summary"]["ids_equal"] == [True] * 3
    tensor = d["rows"][2]
    assert tensor["memory_plan"]["num_experts"] == E and tensor["decode"]["cold"]["routed_imbalance"] == 1.0
    assert tensor["decode_slots"] == tensor["memory_plan"]["slots"]  # one table: every device holds S pieces
    assert set(d["summary"]["by_split"]) == {"expert", "tensor"}


def test_expert_split_traces_with_the_gpus_kernels():
    """Experts split over 2 devices, each holding 256 a layer: with the kernel choices a GPU makes
    (``registry.lowering_for("gpu")``) the prefill (Triton grouped matmul reading the pool in place) and the
    decode block (the MoE decode kernel) trace inside the split's ``shard_map``; only traced, nothing lowered
    or run. The Pallas kernels' outputs carry no varying-axes marking, which shard_map's check refused."""
    import dataclasses

    from experiments import common
    from ftjax.kernels import registry
    from ftjax.kernels.registry import KernelConfig
    cfg = dataclasses.replace(preset("tiny"), num_experts=512, num_layers=1, dtype="bfloat16")
    kernels = KernelConfig(tiles={"grouped_matmul_triton": (64, 64, 64, 4, 1)})
    eng = Engine(random_model(cfg, "bfloat16"), EngineConfig("resident", max_seq_len=80, prefill_chunk=64,
                                                             decode_block=4, devices=2, kernels=kernels))
    eng.open_rows(1)
    eng.admit(list(range(1, 65)), 4)

    def precompile():
        eng.precompile(decode=False)
        eng.precompile_block(4, eos_width=1)
    progs = common.capture_programs(precompile)
    jax.clear_caches()
    try:
        with registry.lowering_for("gpu"), registry.recording() as applied:
            for fn, args, static in progs:
                fn.trace(*args, **static)
    finally:
        jax.clear_caches()  # these traces hold GPU kernels
    assert {"grouped_matmul_triton", "grouped_matmul_pool", "moe_decode"} <= applied
