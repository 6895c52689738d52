"""experiments/replay_parallel_tables.py: slot tables split over N devices, replayed on routing.

At N = 1 every variant is one device's LRU slot table (the slot table's own replay gives the same hits);
on a hand-made trace the per-device tables and the global ones give the hits and link balance worked out
by hand; the per-device replay gives the engine's own hits at ``devices=2`` (the tables ftjax builds)."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from cli_helpers import run_module_app  # noqa: E402
from experiments import replay_parallel_tables as rpt  # noqa: E402


def _random_steps(steps: int, layers: int, experts: int, top_k: int, tokens: int = 1, seed: int = 0):
    """Skewed random routing: int32 [L, tokens, top_k] per step (distinct ids per token)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(experts, 0.3), size=layers)  # a few hot experts per layer
    return [np.stack([np.stack([rng.choice(experts, top_k, replace=False, p=p[layer]) for _ in range(tokens)])
                      for layer in range(layers)]).astype(np.int32) for _ in range(steps)]


def test_one_device_is_the_slot_table():
    """N = 1: every variant gives the hits of ftjax's slot table (lookup_layer, lru), step by step."""
    from experiments import replay_policies
    layers, experts = 3, 8
    steps = _random_steps(40, layers, experts, 2, tokens=2)
    runs = [rpt.runs_from_steps(steps)]
    masks = replay_policies.routed_masks(steps, experts)
    for slots in (8, 12, 16):
        want = replay_policies.replay(masks, experts, slots, "lru", skip_first=True)
        for variant in rpt.VARIANTS:
            got = rpt.replay(runs, layers, experts, 1, slots, variant, skip_first=True)
            assert (got["hits"], got["misses"]) == (want["hits"], want["misses"]), (variant, slots)
            assert got["layer_balance"] == got["step_balance"] == 1.0
            assert got["slowest_link_per_step"] == got["misses_per_step"] == got["pieces_per_link_per_step"]


def test_hand_made_trace():
    """L = 2, E = 4, N = 2, S = 4, every step routes experts 0 and 1 (both owned by device 0) in both layers.
    Per device: device 0's 2 slots serve its 4 (layer, expert) ids, so every lookup misses twice on device 0
    (no hit; a layer's misses all on one link: balance 2). A global table of 4 slots holds all four after the
    first step: 8 hits of 12. Its LRU fills slots 0-1 (device 0) for layer 0 and 2-3 (device 1) for layer 1
    (balance 2 per layer, 1 per step); dealt over the devices, each layer puts one miss on each device."""
    steps = [np.array([[[0, 1]], [[1, 0]]], np.int32)] * 3
    runs = [rpt.runs_from_steps(steps)]
    rows = {v: rpt.replay(runs, 2, 4, 2, 4, v) for v in rpt.VARIANTS}
    per = rows["per_device"]
    assert (per["hits"], per["misses"], per["steps"]) == (0, 12, 3)
    assert per["layer_balance"] == per["step_balance"] == 2.0
    assert per["slowest_link_per_step"] == 4.0
    lru = rows["any_device_lru"]
    assert (lru["hits"], lru["misses"]) == (8, 4) and lru["hit_rate"] == pytest.approx(2 / 3)
    assert (lru["layer_balance"], lru["step_balance"]) == (2.0, 1.0)
    bal = rows["any_device_balanced"]
    assert (bal["hits"], bal["misses"], bal["layer_balance"], bal["step_balance"]) == (8, 4, 1.0, 1.0)
    assert bal["slowest_link_per_step"] == pytest.approx(2 / 3)
    tp = rows["tensor_parallel"]  # 4 misses of whole experts, each as 2 pieces of 1/2: one per link
    assert (tp["hits"], tp["misses"], tp["layer_balance"]) == (8, 4, 1.0)
    assert tp["slowest_link_per_step"] == pytest.approx(2 / 3)
    assert tp["pieces_per_link_per_step"] == pytest.approx(4 / 3)
    skipped = rpt.replay(runs, 2, 4, 2, 4, "any_device_lru", skip_first=True)  # the filling step left out
    assert (skipped["hits"], skipped["misses"], skipped["steps"]) == (8, 0, 2)


def test_balanced_deals_misses_evenly():
    """Cold global tables, one lookup of 6 misses over 2 devices of 4 slots: the LRU fills 4 slots of device 0
    and 2 of device 1; dealt, 3 and 3 (each device's free slots in order)."""
    ids = np.arange(6)
    lru = rpt.LruTable(16, 4, devices=2)
    assert lru.lookup(ids).tolist() == [4, 2]
    bal = rpt.LruTable(16, 4, devices=2, balanced=True)
    assert bal.lookup(ids).tolist() == [3, 3]
    assert bal.slot_of[:6].tolist() == [0, 4, 1, 5, 2, 6]
    assert bal.lookup(np.array([0, 6, 7])).tolist() == [1, 1]  # 0 hits; 2 misses, one per device


def test_batched_streams_and_refusals():
    ids = np.zeros((5, 3, 2, 2), np.int32)  # 5 streams, 3 tokens, 2 layers, top-2
    ids[..., 1] = np.arange(5)[:, None, None] + 1
    runs = rpt.runs_from_streams(ids, 2)  # streams 0-1 and 2-3; stream 4 dropped
    assert len(runs) == 2 and len(runs[0]) == 3
    assert runs[1][0][0].tolist() == [0, 3, 4]
    with pytest.raises(rpt.ReplayInputError, match="decode_batch=6"):
        rpt.runs_from_streams(ids, 6)
    with pytest.raises(rpt.ReplayInputError, match="must divide"):
        rpt.replay(runs, 2, 8, 3, 9, "per_device")
    with pytest.raises(rpt.ReplayInputError, match="slots=4"):
        rpt.replay(runs, 2, 8, 2, 4, "per_device")
    with pytest.raises(rpt.ReplayInputError, match="slots=18"):
        rpt.replay(runs, 2, 8, 2, 18, "per_device")
    with pytest.raises(rpt.ReplayInputError, match="unknown variant"):
        rpt.replay(runs, 2, 8, 2, 8, "global")


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS, tests/conftest.py)")
@pytest.mark.parametrize("slots", [16, 32])
def test_per_device_replay_is_the_engine(slots):
    """The engine at devices=2, every call through the tables (S = E and 2E, prefill on demand): its hits and
    misses are the per-device replay of its own routing."""
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    model = random_model(preset("tiny"), "float32", seed=0)
    engine = Engine(model, EngineConfig("cached", num_slots=slots, max_seq_len=64, prefill="on_demand", devices=2))
    res = engine.generate([list(range(3, 20))], max_new_tokens=8, trace_routing=True)
    cfg = model.cfg
    got = rpt.replay([rpt.runs_from_steps([np.asarray(r) for r in res.routing])], cfg.num_layers, cfg.num_experts,
                     2, slots, "per_device")
    assert (got["hits"], got["misses"]) == (res.expert_cache["hits"], res.expert_cache["misses"])
    assert got["misses"] > 0 and (slots == 16 or got["hits"] > 0)


def test_script(tmp_path):
    trace = tmp_path / "trace.npz"
    steps = _random_steps(12, 4, 8, 2)
    np.savez(trace, **{f"step{i}": s for i, s in enumerate(steps)}, num_layers=np.int64(4), num_experts=np.int64(8),
             top_k=np.int64(2))
    out = tmp_path / "tables.json"
    proc = run_module_app("experiments.replay_parallel_tables", [f"--trace={trace}", "--devices=1,2", f"--out={out}"],
                          program=os.path.join(REPO, "experiments", "replay_parallel_tables.py"),
                          define=lambda m: m.define_flags())
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [(r["devices"], r["slots"]) for r in res["rows"][::len(rpt.VARIANTS)]] == \
        [(n, s) for s in (8, 16, 32) for n in (1, 2)]
    assert res["num_experts"] == 8 and all(r["steps"] == 11 for r in res["rows"])
    proc = run_module_app("experiments.replay_parallel_tables", [f"--trace={trace}", "--devices=3"],
                          program=os.path.join(REPO, "experiments", "replay_parallel_tables.py"),
                          define=lambda m: m.define_flags())
    assert proc.returncode == 1 and "devices=3 must divide" in proc.stderr
