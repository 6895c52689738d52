"""The layer-pipelined prefill driver (``ftjax.runtime.drivers.PipelinedDriver`` and its host copies,
``ftjax.runtime.transfers``; issue 12) runs the same layer function
as the scan, so every prefill it runs is bit-identical to the scan's: logits, KV cache, expert
counters and stored KV chunks. On the CPU the host copies are identities; the overlap itself is
measured on the GPU (``experiments/bench_prefill.py``, ``experiments/profile_overlap.py``)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_fixture
from ftjax import Engine, memory
from ftjax import config as config_lib
from ftjax.config import EngineConfig, KVOffloadConfig
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.prefix_cache import PrefixCache
from ftjax.runtime import drivers, transfers
from ftjax.runtime import plan as plan_lib
from ftjax.runtime.planner import F32_SCAN_NOTE, plan_run
from ftjax.runtime.transfers import ExpertLayerSource, host_view

S = 384
C = 16


def _prefill(model, prompt, driver, mode="cached", **kw):
    slots = None if mode == "resident" else 2 * model.cfg.num_experts
    eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=S, prefill_chunk=64, prefill_driver=driver,
                                     **kw))
    logits, cache, _, stats = eng.prefill([prompt], eng.new_cache(1), all_logits=True)
    return np.asarray(logits)[0, : len(prompt)], np.asarray(cache.k), np.asarray(cache.v), eng


def _pipelined_cases():
    """Every prefill mode on qwen3_moe_fp32 and every fixture streamed by default; the other pairs slow."""
    modes = [("cached", {"prefill": "stream"}), ("cached", {"prefill": "stream", "prefill_overlap": False}),
             ("cached", {"prefill": "on_demand"}), ("resident", {})]
    for name in ("qwen3_moe_fp32", "qwen3_moe_bf16", "olmoe_fp32", "mixtral_fp32"):
        for i, (mode, kw) in enumerate(modes):
            default = name == "qwen3_moe_fp32" or i == 0
            yield pytest.param(name, mode, kw, id=f"{mode}-kw{i}-{name}", marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("name,mode,kw", list(_pipelined_cases()))
def test_pipelined_prefill_bit_identical_to_scan(name, mode, kw):
    model, exp = load_fixture(name)
    prompt = exp["long_prompt_ids"].tolist()
    want, wk, wv, ref = _prefill(model, prompt, "scan", mode, **kw)
    got, gk, gv, eng = _prefill(model, prompt, "pipelined", mode, **kw)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gk, wk)
    np.testing.assert_array_equal(gv, wv)
    g, r = eng.counters["prefill"], ref.counters["prefill"]
    np.testing.assert_array_equal(np.asarray(g.misses), np.asarray(r.misses))
    np.testing.assert_array_equal(np.asarray(g.hits), np.asarray(r.hits))
    if kw.get("prefill") == "stream":
        # every layer's E experts once per chunk; the scan's clamped prefetch of one extra layer is gone
        n_calls = -(-len(prompt) // 64)
        assert g.extra_copies == 0 and r.extra_copies == (n_calls * model.cfg.num_experts if
                                                          kw.get("prefill_overlap", True) else 0)
        assert int(np.asarray(g.fetched).sum()) == n_calls * model.cfg.num_layers * model.cfg.num_experts


def test_pipelined_stream_keeps_the_slot_cache_and_decodes_the_same_tokens():
    """Streaming through the driver's own buffers leaves the slot cache as it was (the scan
    borrows and forgets 2E slots); the generated tokens equal the resident run's."""
    model, exp = load_fixture("olmoe_fp32")
    prompt = exp["long_prompt_ids"].tolist()
    e = model.cfg.num_experts
    ref = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_chunk=128)).generate(
        [prompt], 24, keep_logits=True)
    eng = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=S, prefill="stream", prefill_chunk=128,
                                     prefill_driver="pipelined"))
    eng.generate([prompt[:5]], 3)  # a short request fills some slots by on-demand loading
    filled = eng.resident_experts_per_layer()
    assert sum(filled) > 0
    got = eng.generate([prompt], 24, keep_logits=True)
    assert got.generated_ids == ref.generated_ids
    np.testing.assert_array_equal(got.step_logits[0], ref.step_logits[0])


@pytest.mark.parametrize("route,copy", [("scan", "put"), ("after", "put"), ("scan", "in_program")])
def test_pipelined_prefix_reuse_equals_scan(route, copy, monkeypatch):
    """A request that reuses a stored prefix (loaded layer by layer by the driver) gives the same
    logits and cache as the scan driver, and the chunks it stores are the same bytes; with
    ``EngineConfig.prefix_copy="in_program"`` only layer 0's slices are put from Python, the other
    layers' are copied by the previous layer's program."""
    puts = []
    real_put = transfers.PrefixLayerSource.put
    monkeypatch.setattr(transfers.PrefixLayerSource, "put", lambda self, l: puts.append(l) or real_put(self, l))
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()[:98]
    cfg = model.cfg
    entry = cfg.num_layers * 2 * C * cfg.num_kv_heads * cfg.head_dim * 4
    runs = {}
    for driver in ("scan", "pipelined"):
        mgr = PrefixCache(HostKVStore(100 * entry), KVOffloadConfig(chunk_tokens=C, store_route=route))
        eng = Engine(model, EngineConfig("cached", num_slots=2 * cfg.num_experts, max_seq_len=S,
                                         prefill_driver=driver, prefix_copy=copy))
        first = eng.generate([prompt[:64]], 1, kv_manager=mgr)
        res = eng.generate([prompt], 4, keep_logits=True, kv_manager=mgr)
        assert first.kv["chunks_stored"] == 4 and res.kv["reused_tokens"] == 64
        keys = mgr.keys(eng, prompt)
        runs[driver] = (res.step_logits, [np.asarray(a) for a in mgr.store.get([k for k in keys if k in mgr.store])])
    np.testing.assert_array_equal(runs["pipelined"][0], runs["scan"][0])
    assert puts == ([0] if copy == "in_program" else list(range(model.cfg.num_layers)))  # the one reuse call
    assert len(runs["pipelined"][1]) == len(runs["scan"][1]) == 6
    for a, b in zip(runs["pipelined"][1], runs["scan"][1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("copy_layers,overlap", [(2, True), (4, True), (3, True), (2, False)])
def test_grouped_prefix_puts_equal_scan(copy_layers, overlap, monkeypatch):
    """``EngineConfig.prefix_copy_layers``: one put moves the prefix rows of a group of layers (the
    largest divisor of L = 4 not above the value: 3 -> 2), a group ahead with overlap; the logits
    and the chunks stored equal the scan driver's; each group is put once, as arrays
    [G, 2, C, Hkv, hd]."""
    from ftjax.checkpoint import random_model
    from ftjax.config import preset

    model = random_model(preset("tiny"), "float32")
    cfg = model.cfg
    assert cfg.num_layers == 4
    groups = []
    real = transfers.PrefixLayerSource._put_group

    def spy(self, g):
        out = real(self, g)
        groups.append((g, out[0].shape[0]))
        return out

    monkeypatch.setattr(transfers.PrefixLayerSource, "_put_group", spy)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 90).tolist()
    runs = {}
    for driver in ("scan", "pipelined"):
        mgr = PrefixCache(HostKVStore(1 << 26), KVOffloadConfig(chunk_tokens=C))
        eng = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver=driver, prefill_overlap=overlap,
                                         prefix_copy_layers=copy_layers))
        eng.generate([prompt[:64]], 1, kv_manager=mgr)
        groups.clear()
        res = eng.generate([prompt], 3, keep_logits=True, kv_manager=mgr)
        assert res.kv["reused_tokens"] == 64
        keys = [k for k in mgr.keys(eng, prompt) if k in mgr.store]
        runs[driver] = (res.step_logits, [np.asarray(a) for a in mgr.store.get(keys)], list(groups))
    g = 2 if copy_layers in (2, 3) else 4
    assert eng.prefix_copy_rows() == g and eng.describe()["prefix_copy_layers_resolved"] == g
    np.testing.assert_array_equal(runs["pipelined"][0], runs["scan"][0])
    assert len(runs["pipelined"][1]) == len(runs["scan"][1]) == 5
    for a, b in zip(runs["pipelined"][1], runs["scan"][1]):
        np.testing.assert_array_equal(a, b)
    assert runs["scan"][2] == []  # the scan copies inside its program
    assert runs["pipelined"][2] == [(i, g) for i in range(cfg.num_layers // g)]  # each group once, in order


def test_grouped_prefix_puts_hold_at_most_two_groups(monkeypatch):
    """With overlap, group g+1's put is issued once group g has started (a group ahead: it copies
    while group g computes), not while the last layer of group g-1 still waits for its dispatch:
    at most two groups' device copies exist at any put (PrefixLayerSource's docstring,
    docs/OVERLAP.md). 6 layers in groups of 2: three groups, so a third one would show. The logits
    stay the scan's."""
    import dataclasses
    import weakref

    from ftjax.checkpoint import random_model
    from ftjax.config import preset

    model = random_model(dataclasses.replace(preset("tiny"), num_layers=6), "float32")
    cfg = model.cfg
    events, alive = [], []
    real_put, real_index = transfers.PrefixLayerSource._put_group, drivers.layer_idx

    def put_spy(self, g):
        out = real_put(self, g)
        alive.append(weakref.ref(out[0]))
        events.append(("put", g, sum(r() is not None for r in alive)))
        return out

    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 90).tolist()
    logits = {}
    for driver in ("scan", "pipelined"):
        mgr = PrefixCache(HostKVStore(1 << 26), KVOffloadConfig(chunk_tokens=C))
        eng = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver=driver, prefix_copy_layers=2))
        eng.generate([prompt[:64]], 1, kv_manager=mgr)
        cache = eng.new_cache(1)
        req = eng.prepare_prefill([prompt], cache, mgr)
        with monkeypatch.context() as m:
            m.setattr(transfers.PrefixLayerSource, "_put_group", put_spy)
            # the driver makes layer l's index just before it dispatches the layer's program
            m.setattr(drivers, "layer_idx", lambda st, l: events.append(("layer", l)) or real_index(st, l))
            logits[driver] = np.asarray(eng.prefill([prompt], cache, kv_manager=mgr, request=req)[0])
        assert req.reused_tokens == 64
    np.testing.assert_array_equal(logits["pipelined"], logits["scan"])
    assert eng.prefix_copy_rows() == 2
    puts = [e for e in events if e[0] == "put"]
    assert [g for _, g, _ in puts] == [0, 1, 2]  # each group once, in order
    assert max(n for _, _, n in puts) <= 2, events  # never three groups on the device
    order = [e[:2] for e in events]
    for g in (1, 2):  # still a group ahead: put before the first layer of the group before it runs
        assert order.index(("put", g)) < order.index(("layer", 2 * (g - 1))), events

def test_a_prefix_group_whose_alias_fell_back_runs_its_own_program(monkeypatch):
    """A pinned alias arrives on the device as unsigned integers; a piece whose alias could not be
    made (``pinned_alias`` None: the numpy view, path "mixed") arrives in its real dtype. The
    driver looks the layer program up once per argument structure (the lengths of the argument
    groups), so a later group with the other dtypes was handed the first group's program, which
    refused its arguments (TypeError) and failed the request. Simulated on the CPU: the aliases
    of each chunk's first group work, the others fall back. The logits stay the scan's."""
    from ftjax.checkpoint import random_model
    from ftjax.config import preset

    model = random_model(preset("tiny"), "float32")
    starts, real_view = set(), transfers.host_view

    def view_spy(x):
        view = real_view(x)
        starts.add(view.ctypes.data)
        return view

    def alias(view):  # a host array of the unsigned dtype over the bytes, as a GPU alias is
        if view.ctypes.data not in starts:
            return None
        return jax.device_put(np.ascontiguousarray(view).view(transfers._UINT[view.dtype.itemsize]),
                              memory.host_sharding())

    prompt = np.random.default_rng(3).integers(0, model.cfg.vocab_size, 90).tolist()
    logits = {}
    for driver in ("scan", "pipelined"):
        mgr = PrefixCache(HostKVStore(1 << 26), KVOffloadConfig(chunk_tokens=C))
        eng = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver=driver, prefix_copy_layers=2))
        with monkeypatch.context() as m:
            m.setattr(transfers, "host_view", view_spy)
            m.setattr(transfers, "pinned_alias", alias)
            eng.generate([prompt[:64]], 1, kv_manager=mgr)
            res = eng.generate([prompt], 3, keep_logits=True, kv_manager=mgr)
        assert res.kv["reused_tokens"] == 64
        logits[driver] = res.step_logits
    paths = {e[1].path for e in transfers._CHUNK_PIECES.values() if e[1].rows == 2}
    assert "mixed" in paths  # the situation simulated: aliases for some groups only
    np.testing.assert_array_equal(logits["pipelined"], logits["scan"])


def test_copy_group_layers():
    assert [transfers.copy_group_layers(48, n) for n in (1, 4, 5, 7, 8, 100)] == [1, 4, 4, 6, 8, 48]
    assert transfers.copy_group_layers(3, 2) == 1
    with pytest.raises(ValueError, match="prefix_copy_layers must be >= 1, got 0"):
        transfers.copy_group_layers(48, 0)
    with pytest.raises(ValueError, match="prefix_copy_layers must be an integer >= 1, got 0"):
        EngineConfig(prefix_copy_layers=0)


def test_prefix_copy_setting():
    """``EngineConfig.prefix_copy``: "put" by default; another value than put / in_program is
    refused when the config is made, naming the field, also where it would not be used (no overlap);
    the driver copies in its programs only for a prefix with overlap (the serial ablation puts): its
    layer programs' options (``LayerOptions.prefix_next``)."""
    import types

    assert EngineConfig().prefix_copy == "put"
    assert EngineConfig(prefix_copy="in_program").prefix_copy == "in_program"

    def nxt(has_prefix, overlap, copy):
        ctx = types.SimpleNamespace(config=EngineConfig(prefill_overlap=overlap, prefix_copy=copy))
        plan = types.SimpleNamespace(opts=None, d2d=False)
        args = types.SimpleNamespace(prefix=(object(),) if has_prefix else (), state=None)
        return drivers.PipelinedDriver()._opts(ctx, plan, args, "attention").prefix_next

    assert nxt(True, True, "in_program")
    assert not nxt(True, False, "in_program") and not nxt(False, True, "in_program") and not nxt(True, True, "put")
    for bad in ("dma", "in-program", None):
        with pytest.raises(ValueError, match=f"unknown prefix_copy {bad!r}; expected one of put, in_program"):
            EngineConfig(prefix_copy=bad)
    with pytest.raises(ValueError, match="prefix_copy 'dma'; expected one of put, in_program"):
        EngineConfig(prefill_overlap=False, prefix_copy="dma")


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_copy_is_resolved_once_per_engine(overlap, monkeypatch):
    """The prefix copy is the engine's (``EngineConfig.prefix_copy``), fixed when it is built: a
    wrong value fails at ``EngineConfig``, before any engine or request exists, also where the
    setting would not be used (overlap off falls back to put); the former environment variable
    changes nothing (no program is compiled inside the timed prefill); an engine with
    "in_program" reuses the chunks stored by one with "put" (the same store)."""
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()[:80]
    cfg = model.cfg
    mgr = PrefixCache(HostKVStore(1 << 24), KVOffloadConfig(chunk_tokens=C))
    with pytest.raises(ValueError, match="unknown prefix_copy 'in-program'; expected one of put, in_program"):
        EngineConfig("resident", max_seq_len=S, prefill_driver="pipelined", prefill_overlap=overlap,
                     prefix_copy="in-program")
    eng = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver="pipelined", prefill_overlap=overlap))
    assert eng.generate([prompt[:64]], 1, kv_manager=mgr).kv["chunks_stored"] == 4
    cache = eng.new_cache(1)
    req = eng.prepare_prefill([prompt], cache, mgr)
    before = eng.compile_s
    # set between the compile and the timed call, a variable of the old name is no setting: the
    # prefill runs the programs prepare_prefill compiled
    monkeypatch.setenv("FTJAX_PREFIX_COPY", "in_program")
    eng.prefill([prompt], cache, kv_manager=mgr, request=req)
    assert eng.compile_s == before and req.reused_tokens == 64
    eng2 = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver="pipelined", prefill_overlap=overlap,
                                      prefix_copy="in_program"))
    res = eng2.generate([prompt], 1, kv_manager=mgr)
    # the request before stored all 5 chunks of the prompt; its last token is computed again
    assert res.kv["reused_tokens"] == len(prompt) - 1 and cfg.num_layers > 1


def test_driver_choice(monkeypatch):
    model, _ = load_fixture("qwen3_moe_bf16", "bfloat16")  # 16-bit: float32 resolves auto to the scan on a GPU
    e = model.cfg.num_experts
    host = jax.device_put(jnp.zeros((2, 3)), memory.host_sharding())
    dev = memory.to_device(jnp.zeros((2, 3)))
    auto = Engine(model, EngineConfig("cached", num_slots=2 * e))
    # on the CPU, auto keeps the scan (there is nothing to overlap); on a GPU it pipelines host copies
    assert auto.planner.pipelines(True, ()) == (memory.backend() == "gpu")
    # a prefix-only call pipelines under auto on a GPU only with plan.PIPELINE_PREFIX (grouped puts, docs/OVERLAP.md)
    assert auto.planner.pipelines(False, (host,)) == (memory.backend() == "gpu" and plan_lib.PIPELINE_PREFIX)
    resident = Engine(model, EngineConfig("resident"))
    on_demand = Engine(model, EngineConfig("cached", num_slots=2 * e, prefill="on_demand"))
    with monkeypatch.context() as m:  # the decision on a GPU, whatever runs the tests
        m.setattr(memory, "backend", lambda: "gpu")
        assert auto.planner.pipelines(True, (host,))  # a call that streams pipelines, with its prefix
        # so the chunks an offloading engine stores are prepared for it, a resident one's only with PIPELINE_PREFIX
        assert auto.planner.pipelines_prefix()
        assert resident.planner.pipelines_prefix() == on_demand.planner.pipelines_prefix() == plan_lib.PIPELINE_PREFIX
    if memory.backend() != "gpu":
        assert not auto.planner.pipelines_prefix()  # the CPU: every call on the scan
    forced = Engine(model, EngineConfig("cached", num_slots=2 * e, prefill_driver="pipelined"))
    assert forced.planner.pipelines(False, ()) and forced.planner.pipelines(True, (host,))
    assert not forced.planner.pipelines(False, (dev,))  # a prefix already on the device: the load-all-first ablation
    scan = Engine(model, EngineConfig("cached", num_slots=2 * e, prefill_driver="scan"))
    assert not scan.planner.pipelines(True, (host,))
    with pytest.raises(ValueError, match="prefill driver 'layers'"):
        EngineConfig(prefill_driver="layers")


def test_auto_runs_float32_prefills_on_the_scan_on_a_gpu(monkeypatch):
    """On a GPU the pipelined driver's float32 logits are a few 1e-6 off the scan's (XLA compiles its per-layer
    programs otherwise; docs/OVERLAP.md "Float32 on the pipelined driver"), so ``prefill_driver`` "auto" resolves
    to the scan for a float32 compute dtype there, in the engine and in the memory planner alike; 16-bit dtypes,
    a driver asked for by name, and the CPU keep their config."""
    model, _ = load_fixture("qwen3_moe_fp32")
    e = model.cfg.num_experts
    base = EngineConfig("cached", num_slots=2 * e, max_seq_len=64)
    assert base.for_compute_dtype("float32") == base or memory.backend() == "gpu"  # the CPU: nothing to resolve
    # the config module's view of the backend only: the engine built below still runs on this machine's
    monkeypatch.setattr(config_lib, "memory", types.SimpleNamespace(backend=lambda: "gpu"))
    assert base.for_compute_dtype("float32") == dataclasses.replace(base, prefill_driver="scan")
    assert base.for_compute_dtype("bfloat16") == base and base.for_compute_dtype("float16") == base
    forced = dataclasses.replace(base, prefill_driver="pipelined")
    assert forced.for_compute_dtype("float32") == forced
    assert Engine(model, base).config.prefill_driver == "scan"
    config, plan = plan_run(model, base, [[1, 2, 3]], slots=2 * e, mode="cached")
    assert config.prefill_driver == "scan" and not plan.pipelined  # the scan's buffers planned, not the driver's
    assert plan.driver_note == F32_SCAN_NOTE and F32_SCAN_NOTE in plan.describe()  # the printed plan says why
    # streaming through fewer than 2E slots needs the pipelined driver: asked for by name, or refused with the way out
    with pytest.raises(ValueError, match="prefill_driver='pipelined'"):
        Engine(model, dataclasses.replace(base, num_slots=e, prefill="stream"))


def test_host_view_is_the_array_without_a_copy():
    model, _ = load_fixture("qwen3_moe_bf16")
    banks = model.banks
    view = host_view(banks.gate_up)
    assert view.shape == banks.gate_up.shape and view.dtype == np.dtype(banks.gate_up.dtype)
    np.testing.assert_array_equal(view, np.asarray(banks.gate_up))
    assert view.ctypes.data == banks.gate_up.addressable_data(0).unsafe_buffer_pointer()
    src = ExpertLayerSource(banks, model.cfg.num_experts)
    gu, dn = src.put(1)
    e = model.cfg.num_experts
    np.testing.assert_array_equal(np.asarray(gu), np.asarray(banks.gate_up)[e:2 * e])
    np.testing.assert_array_equal(np.asarray(dn), np.asarray(banks.down)[e:2 * e])
    assert src.layer_bytes == e * model.expert_bytes


#: On a GPU the pipelined driver's float32 programs are not the scan's bit for bit (H100, 2026-12-07, 0003351: this
#: test's logits 3.4e-5 apart; docs/OVERLAP.md, "Float32 on the pipelined driver"), which is why auto runs float32
#: prefills on the scan there.
FLOAT32_PIPELINED_ON_GPU = pytest.mark.xfail(memory.backend() == "gpu", strict=True,
                                             reason="XLA:GPU compiles the per-layer programs' float32 math otherwise "
                                                    "than the scan's (a few 1e-6 to 1e-5 apart)")


@FLOAT32_PIPELINED_ON_GPU
def test_hybrid_family_on_the_pipelined_driver_equals_its_block_scan():
    """qwen3_5_moe scans blocks of two layer kinds. On the CPU auto keeps the block scan. The pipelined
    driver, which runs every layer kind, gives the block scan's logits and state (K/V and the Gated
    DeltaNet layers' conv and recurrent states) bit for bit, over two prefill calls (the states carried
    from the first call into the second)."""
    model, exp = load_fixture("qwen3_5_moe_fp32")
    e = model.cfg.num_experts
    prompt = exp["long_prompt_ids"].tolist()[:100]
    eng = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=S, prefill="stream", prefill_chunk=64))
    # auto: the scan, on the CPU and (for float32, EngineConfig.for_compute_dtype) on a GPU
    assert not eng.planner.pipelines(True)
    want, want_cache = eng.prefill([prompt], eng.new_cache(1), all_logits=True)[:2]
    assert eng.prefill_driver_calls == {"scan": 2, "pipelined": 0}
    piped = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=S, prefill="stream", prefill_chunk=64,
                                       prefill_driver="pipelined"))
    got, got_cache = piped.prefill([prompt], piped.new_cache(1), all_logits=True)[:2]
    assert piped.prefill_driver_calls == {"scan": 0, "pipelined": 2}
    assert np.asarray(got).shape == (1, len(prompt), model.cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for name in ("k", "v", "conv", "rec"):
        np.testing.assert_array_equal(np.asarray(getattr(got_cache, name)), np.asarray(getattr(want_cache, name)),
                                      err_msg=name)


def test_load_all_first_prefix_with_fewer_than_2e_slots_loads_on_demand():
    """A reused prefix already on the device runs on the scan, which borrows 2E slots to stream: with
    only E slots the call loads its experts on demand instead (and prefill='stream' is refused)."""
    model, exp = load_fixture("qwen3_moe_fp32")
    cfg = model.cfg
    prompt = exp["long_prompt_ids"].tolist()[:98]
    entry = cfg.num_layers * 2 * C * cfg.num_kv_heads * cfg.head_dim * 4
    logits = {}
    for mode, slots, prefill in [("resident", None, "auto"), ("cached", cfg.num_experts, "auto")]:
        mgr = PrefixCache(HostKVStore(100 * entry), KVOffloadConfig(chunk_tokens=C, load="all_first"))
        eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=S, prefill=prefill,
                                         prefill_driver="pipelined"))
        eng.generate([prompt[:64]], 1, kv_manager=mgr)
        res = eng.generate([prompt], 3, keep_logits=True, kv_manager=mgr)
        assert res.kv["reused_tokens"] == 64
        logits[mode] = res.step_logits
    np.testing.assert_array_equal(logits["cached"], logits["resident"])
    eng = Engine(model, EngineConfig("cached", num_slots=cfg.num_experts, max_seq_len=S, prefill="stream",
                                     prefill_driver="pipelined"))
    with pytest.raises(ValueError, match="borrows 2E"):
        eng.planner.plan(1, 64, 64, prefix=(memory.to_device(jnp.zeros((2, 2))),))


def test_serial_ablation_copies_each_layer_once_and_timed_prefill_compiles_nothing(monkeypatch):
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()[:100]
    e = model.cfg.num_experts
    for overlap in (True, False):
        eng = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=S, prefill="stream",
                                         prefill_overlap=overlap, prefill_driver="pipelined"))
        cache = eng.new_cache(1)
        eng.prepare_prefill([prompt], cache)
        copied = []
        src = eng._expert_source()
        real_put = type(src).put
        monkeypatch.setattr(type(src), "put", lambda self, l: copied.append(l) or real_put(self, l))
        before = eng.compile_s
        eng.prefill([prompt], cache)
        assert eng.compile_s == before  # every program of the call, _stack included, compiled ahead
        assert copied == list(range(model.cfg.num_layers)), (overlap, copied)
        monkeypatch.undo()


def test_prefix_chunk_pieces_die_with_their_chunk():
    import gc
    chunk = jax.device_put(jnp.ones((4, 2, C, 2, 8)), memory.host_sharding())
    src = transfers.PrefixLayerSource([chunk, chunk])
    np.testing.assert_array_equal(np.asarray(src.put(3)[0]), np.ones((1, 2, C, 2, 8)))
    key = (id(chunk), 1)  # (chunk, layers per piece)
    assert key in transfers._CHUNK_PIECES
    del src, chunk
    gc.collect()
    assert key not in transfers._CHUNK_PIECES


def test_stored_chunks_get_their_layer_pieces_when_prefix_loads_pipeline():
    """With prefix loads on the pipelined driver, the chunks a request stores get every layer's piece
    made as they are stored (timed as prepare_s), so a later reuse makes none inside its TTFT; on
    the scan nothing is prepared."""
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()[:70]
    cfg = model.cfg
    entry = cfg.num_layers * 2 * C * cfg.num_kv_heads * cfg.head_dim * 4
    for driver in ("pipelined", "scan"):
        mgr = PrefixCache(HostKVStore(100 * entry), KVOffloadConfig(chunk_tokens=C))
        eng = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver=driver))
        assert eng.planner.pipelines_prefix() == (driver == "pipelined")
        eng.generate([prompt], 1, kv_manager=mgr)
        stored = [mgr.store.peek(k) for k in mgr.keys(eng, prompt)]
        assert len(stored) == 4 and all(a is not None for a in stored)
        g = eng.prefix_copy_rows()  # the pieces are those of the engine's copy groups
        entries = [transfers._CHUNK_PIECES.get((id(a), g)) for a in stored]
        if driver == "pipelined":
            assert mgr.requests[-1]["prepare_s"] > 0
            for a, entry_ in zip(stored, entries):
                assert entry_ is not None and entry_[0]() is a
                assert sorted(entry_[1]._alias) == [(0, i) for i in range(cfg.num_layers // g)]
        else:
            assert mgr.requests[-1]["prepare_s"] == 0 and entries == [None] * 4


def test_miss_blocks_cover_the_misses_with_aligned_powers_of_two():
    rng = np.random.default_rng(0)
    cases = [np.full(8, -1), np.arange(8), np.array([0, -1, -1, -1, 4, -1, -1, 7]), np.full(6, -1),
             np.full(128, -1)] + [np.where(rng.random(n) < p, 1, -1) for n in (6, 8, 128) for p in (0.1, 0.5, 0.9)]
    for slots in cases:
        covered = np.zeros(len(slots), bool)
        for off, size in transfers.miss_blocks(slots):
            assert size & (size - 1) == 0 and off % size == 0
            assert not covered[off:off + size].any()
            covered[off:off + size] = True
        np.testing.assert_array_equal(covered, slots < 0)
    assert transfers.miss_blocks(np.full(8, -1)) == [(0, 8)]
    assert transfers.miss_blocks(np.full(6, -1)) == [(0, 4), (4, 2)]
    assert transfers.miss_blocks(np.arange(8)) == []
    assert transfers.miss_blocks(np.array([0, -1, -1, -1, 4, -1, -1, 7])) == [(1, 1), (2, 2), (5, 1), (6, 1)]
    with pytest.raises(ValueError, match="stream_d2d_hits must be True or False"):
        EngineConfig(stream_d2d_hits="yes")


def _table(eng) -> dict:
    t, st = eng.state.table, eng.state
    arrays = {"slot_of": t.slot_of, "id_of_slot": t.id_of_slot, "last_use": t.last_use, "clock": t.clock,
              "crf_log2": t.crf_log2, "crf_time": t.crf_time, "gate_up": st.gate_up, "down": st.down}
    arrays.update({f"scales{i}": s for i, s in enumerate(st.scales or ())})
    return {k: np.asarray(v) for k, v in arrays.items()}


@pytest.mark.parametrize("name,expert_dtype,slots,overlap", [
    ("olmoe_fp32", None, 19, True), ("olmoe_fp32", None, 19, False),
    pytest.param("qwen3_moe_bf16", None, 24, True, marks=pytest.mark.slow),
    pytest.param("qwen3_moe_fp32", "int8", 19, True, marks=pytest.mark.slow)])
def test_stream_d2d_hits_same_logits_pcie_bytes_only_and_slot_cache_kept(name, expert_dtype, slots, overlap):
    """A streamed pipelined prefill after a warm-up (some experts in the slot cache): with
    stream_d2d_hits the cached experts of every streamed layer are copied device to device; the
    logits equal those of stream_d2d_hits off and of the resident model bit for bit; bytes_h2d
    counts only the PCIe experts, bytes_d2d the rest, d2d per layer equals the layer's cached
    experts (read from the slot table) per call; the call leaves the slot cache as it was."""
    from conftest import fixture_path
    from ftjax.checkpoint import load_checkpoint
    model, exp = load_fixture(name)
    if expert_dtype is not None:
        model = load_checkpoint(fixture_path(name), "float32", progress=False, expert_dtype=expert_dtype)
    cfg = model.cfg
    e, nl, eb = cfg.num_experts, cfg.num_layers, model.expert_bytes
    prompt = exp["long_prompt_ids"].tolist()
    ref = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_chunk=64))
    want = np.asarray(ref.prefill([prompt], ref.new_cache(1), all_logits=True)[0])
    got = {}
    for d2d in (True, False):
        eng = Engine(model, EngineConfig("cached", num_slots=slots, max_seq_len=S, prefill_chunk=64,
                                         prefill_overlap=overlap, prefill_driver="pipelined", stream_d2d_hits=d2d))
        eng.generate([prompt[:3]], 8)  # 6 (token, expert) pairs < E: loaded on demand, into the cache
        calls = eng.plan_prefill([prompt])
        assert all(eng.planner.streams(c.tokens) for c in calls)
        table = _table(eng)
        cached = (table["slot_of"].reshape(nl, e) >= 0).sum(axis=1)  # independently of the driver
        assert cached.sum() > 0 and (cached < e).any()
        cache = eng.new_cache(1)
        eng.prepare_prefill([prompt], cache)
        compile_s = eng.compile_s
        blocks = dict(eng._expert_source()._blocks)
        eng.prefill([prompt], cache)
        assert eng.compile_s == compile_s  # the D2D programs too were compiled by prepare_prefill
        assert eng._expert_source()._blocks == blocks  # and the block pieces made there
        before = eng.counters["prefill"].copy()
        logits, _, _, stats = eng.prefill([prompt], eng.new_cache(1), all_logits=True)
        got[d2d] = np.asarray(logits)
        after = _table(eng)
        for k, v in table.items():  # neither call changed the slot cache
            np.testing.assert_array_equal(after[k], v, err_msg=k)
        c = eng.counters["prefill"] - before
        m = c.summary(eb)
        streamed = len(calls) * nl * e
        if d2d:
            np.testing.assert_array_equal(c.d2d, len(calls) * cached)
            np.testing.assert_array_equal(c.hits, c.d2d)
            np.testing.assert_array_equal(c.fetched, len(calls) * (e - cached))
            assert m["d2d_copies"] == len(calls) * int(cached.sum()) > 0
            assert [int(x) for x in np.asarray(stats[0].d2d)] == cached.tolist()
        else:
            assert m["d2d_copies"] == 0 and m["hits"] == 0 and stats[0].d2d is None
        assert m["bytes_h2d"] + m["bytes_d2d"] == streamed * eb
        assert m["bytes_h2d"] == int(c.fetched.sum()) * eb
        metrics = eng.expert_cache_metrics()
        assert {"d2d_copies", "bytes_d2d"} <= set(metrics) and {"d2d_copies", "bytes_d2d"} <= set(metrics["prefill"])
    np.testing.assert_array_equal(got[True], got[False])
    np.testing.assert_array_equal(got[True], want)


def test_stream_d2d_hits_with_every_expert_cached():
    """A full slot cache: every streamed layer is gathered from the pool, nothing over PCIe."""
    model, exp = load_fixture("mixtral_fp32")
    cfg = model.cfg
    e, nl = cfg.num_experts, cfg.num_layers
    prompt = exp["long_prompt_ids"].tolist()[:128]
    ref = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_chunk=64))
    want = np.asarray(ref.prefill([prompt], ref.new_cache(1), all_logits=True)[0])
    eng = Engine(model, EngineConfig("cached", num_slots=nl * e, max_seq_len=S, prefill_chunk=64,
                                     prefill_driver="pipelined"))
    eng.generate([prompt[:3]], 40)  # on demand, then decode: every expert routed at least once
    assert eng.resident_experts_per_layer() == [e] * nl
    before = eng.counters["prefill"].copy()
    got = np.asarray(eng.prefill([prompt], eng.new_cache(1), all_logits=True)[0])
    np.testing.assert_array_equal(got, want)
    m = (eng.counters["prefill"] - before).summary(model.expert_bytes)
    assert m["bytes_h2d"] == 0 and m["d2d_copies"] == 2 * nl * e and m["hit_rate"] == 1.0


def _not_yet_written(shape, value):
    """A host-memory array of ``value`` whose producing work is still running when this returns: a
    chain of matmuls (~1 s on a CPU core) feeds it, and the host copy waits for that chain."""
    x = jnp.eye(768, dtype=jnp.float32)
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 40, lambda i, a: a @ x, x))
    one = slow(x)[0, 0]  # exactly 1, known only once the chain has run
    return jax.device_put(jnp.full(shape, value, jnp.float32) * one, memory.host_sharding())


def test_prefix_and_expert_copies_wait_for_arrays_still_being_written():
    """host_view takes a buffer's pointer without waiting for the work that writes it, so a copy read
    through it straight away saw stale bytes (seen as garbage from PrefixLayerSource.put in a loaded
    test run). The sources wait for their arrays before their first copy."""
    chunk = _not_yet_written((4, 2, C, 2, 8), 3.25)
    src = transfers.PrefixLayerSource([chunk])
    np.testing.assert_array_equal(np.asarray(src.put(2)[0]), np.full((1, 2, C, 2, 8), 3.25, np.float32))
    e, d, f = 4, 8, 16
    gate_up, down = _not_yet_written((2 * e, d, 2 * f), 1.5), _not_yet_written((2 * e, f, d), -2.0)
    from ftjax.experts.state import ExpertBanks
    got = ExpertLayerSource(ExpertBanks(gate_up, down), e).put(1)
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.float32), np.full((e, d, 2 * f), 1.5, np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]).view(np.float32), np.full((e, f, d), -2.0, np.float32))


def test_a_dead_chunks_finalizer_leaves_a_new_chunk_with_its_id_alone():
    """_CHUNK_PIECES is keyed by (id(chunk), rows): a finalizer drops only the entry it was made for, never
    the entry of a later chunk that got the same id."""
    import weakref
    chunk = jax.device_put(jnp.ones((2, 2, C, 2, 8)), memory.host_sharding())
    pieces = transfers._chunk_pieces(chunk)
    key = (id(chunk), 1)
    stale = weakref.ref(_Weak())  # a reference of another (dead) object, as a dead chunk's finalizer holds
    transfers._drop_chunk_pieces(key, stale)
    assert transfers._CHUNK_PIECES[key][1] is pieces and transfers._chunk_pieces(chunk) is pieces
    del chunk
    import gc
    gc.collect()
    assert key not in transfers._CHUNK_PIECES


class _Weak:
    pass


@pytest.mark.parametrize("overlap", [True, False])
def test_stream_d2d_hits_gather_into_the_previous_layers_buffer(overlap, monkeypatch):
    """A layer with hits is assembled in the memory of the layer dispatched before it (donated),
    not in a third full-layer buffer beside the one in use and the PCIe blocks: the planner counts
    two. Logits stay those of the resident model."""
    model, exp = load_fixture("mixtral_fp32")
    cfg = model.cfg
    prompt = exp["long_prompt_ids"].tolist()[:64]
    ref = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_chunk=64))
    want = np.asarray(ref.prefill([prompt], ref.new_cache(1), all_logits=True)[0])
    eng = Engine(model, EngineConfig("cached", num_slots=cfg.num_layers * cfg.num_experts - 3, max_seq_len=S,
                                     prefill_chunk=64, prefill_overlap=overlap, prefill_driver="pipelined"))
    eng.generate([prompt[:3]], 40)  # nearly every expert cached: every layer has hits
    assert all(n > 0 for n in eng.resident_experts_per_layer())
    seen, real = [], transfers.ExpertCopies.ready

    def spy(self, part, layer, state, spare=None):
        pending = isinstance(part, transfers._PendingLayer) and self._fits(spare)
        before = spare[0].unsafe_buffer_pointer() if pending else None
        out = real(self, part, layer, state, spare)
        if pending:
            seen.append((layer, out[0].unsafe_buffer_pointer() == before, spare[0].is_deleted()))
        return out

    monkeypatch.setattr(transfers.ExpertCopies, "ready", spy)
    got = np.asarray(eng.prefill([prompt], eng.new_cache(1), all_logits=True)[0])
    np.testing.assert_array_equal(got, want)
    assert [x[0] for x in seen] == list(range(1, cfg.num_layers)), seen
    assert all(same and gone for _, same, gone in seen), seen


def test_stream_d2d_hits_reads_the_slot_table_once_per_table(monkeypatch):
    """The host copy of the slot table that prepare_prefill read serves the timed prefill, and one
    streamed call's serves the next (the chunks of a long prompt): no device-to-host read that
    waits for the queued work. After a decode step (a new table) it is read again."""
    model, exp = load_fixture("olmoe_fp32")
    prompt = exp["long_prompt_ids"].tolist()
    ref = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_chunk=64))
    want = np.asarray(ref.prefill([prompt], ref.new_cache(1), all_logits=True)[0])
    eng = Engine(model, EngineConfig("cached", num_slots=19, max_seq_len=S, prefill_chunk=64,
                                     prefill_driver="pipelined"))
    eng.generate([prompt[:3]], 8)
    assert len(eng.plan_prefill([prompt])) > 1 and sum(eng.resident_experts_per_layer()) > 0
    reads, real = [], transfers._read_slots
    monkeypatch.setattr(transfers, "_read_slots", lambda a: reads.append(1) or real(a))
    cache = eng.new_cache(1)
    eng.prepare_prefill([prompt], cache)
    assert len(reads) == 1
    eng.prefill([prompt], cache)
    got = np.asarray(eng.prefill([prompt], eng.new_cache(1), all_logits=True)[0])
    assert len(reads) == 1  # neither prefill nor any of its calls read the table again
    np.testing.assert_array_equal(got, want)
    eng.generate([prompt[:3]], 2)  # decode steps make a new table: read again, once
    n = len(reads)
    got = np.asarray(eng.prefill([prompt], eng.new_cache(1), all_logits=True)[0])
    assert len(reads) == n + 1
    np.testing.assert_array_equal(got, want)


def test_a_failing_chunk_preparation_does_not_fail_the_request(monkeypatch):
    """PrefixCache.finish(prepare=...) is best effort like the store: an error is recorded, the
    chunks stay stored and the next request reuses them."""
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["long_prompt_ids"].tolist()[:70]
    cfg = model.cfg
    entry = cfg.num_layers * 2 * C * cfg.num_kv_heads * cfg.head_dim * 4
    mgr = PrefixCache(HostKVStore(100 * entry), KVOffloadConfig(chunk_tokens=C))
    eng = Engine(model, EngineConfig("resident", max_seq_len=S, prefill_driver="pipelined"))

    def broken(chunks, rows=1):
        raise RuntimeError("no aliases today")

    monkeypatch.setattr(transfers, "warm_prefix_chunks", broken)
    first = eng.generate([prompt], 1, kv_manager=mgr)
    assert first.kv["prepare_error"] == "RuntimeError: no aliases today" and first.kv["chunks_stored"] == 4
    monkeypatch.undo()
    again = eng.generate([prompt], 1, kv_manager=mgr)
    assert again.kv["reused_tokens"] == 64 and again.kv["prepare_error"] is None
    assert again.generated_ids == first.generated_ids


def test_pipelined_head_runs_under_the_steps_matmul_precision():
    """The pipelined driver's head program is traced under the call's options, as the scan's head is: a float32
    model's logits product asks for HIGHEST precision (untraced under them it took XLA's default, TF32 on a GPU)."""
    from conftest import head_programs_precision
    model, exp = load_fixture("qwen3_moe_fp32")
    _, _, _, eng = _prefill(model, exp["short_prompt_ids"].tolist(), "pipelined")
    assert eng.precision == "highest" and eng.prefill_driver_calls["pipelined"] == 1
    heads = head_programs_precision(eng)  # the pipelined prefill's
    assert heads and set(heads) == {("highest", True)}, heads
