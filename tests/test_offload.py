"""Expert offload never changes the math (DESIGN.md 1.1 invariant).

Cached and on-demand runs read expert weights from device slots filled from host memory; the
arithmetic is the same as the resident model's, so logits must be *bit-identical* for every
slot count, including the smallest legal cache (S = E), over long greedy decodes where a stale
or misplaced slot would show.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import FIXTURE_NAMES, HYBRID_FIXTURE_NAMES, load_fixture
from ftjax import Engine
from ftjax.config import EngineConfig, MissPolicyConfig
from ftjax.kernels.registry import KernelConfig
from ftjax.runtime import programs
from ftjax.runtime.planner import plan_memory

STEPS = 48  # enough for S = E to evict and refetch every expert several times over


@pytest.fixture(scope="module")
def resident_runs():
    return {}


# 384: the cache length most modules run the fixtures at, so their programs come from the compile cache
def _decode(model, mode, slots, prompt, steps=STEPS, max_seq_len=384):
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=max_seq_len))
    res = engine.generate([prompt], max_new_tokens=steps, keep_logits=True)
    return res, engine


def _resident(cache, name):
    if name not in cache:
        model, exp = load_fixture(name)
        cache[name] = _decode(model, "resident", None, exp["short_prompt_ids"].tolist())[0]
    return cache[name]


def _slot_cases():
    """Every family at S = E (the smallest cache: it must evict) and qwen3_moe_fp32 at L*E (everything fits) by
    default; every other (family, size) pair in the slow selection (E + 1 slots run by default in
    test_cache_policy_bit_identical)."""
    for name in FIXTURE_NAMES + HYBRID_FIXTURE_NAMES:
        for rule in ("E", "E+1", "2E", "L*E"):
            default = rule == "E" or (name == "qwen3_moe_fp32" and rule == "L*E")
            yield pytest.param(name, rule, marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("fixture_name,slots_rule", list(_slot_cases()))
def test_cached_decode_bit_identical(fixture_name, slots_rule, resident_runs):
    model, exp = load_fixture(fixture_name)
    e, le = model.cfg.num_experts, model.cfg.num_layers * model.cfg.num_experts
    slots = {"E": e, "E+1": e + 1, "2E": 2 * e, "L*E": le}[slots_rule]
    want = _resident(resident_runs, fixture_name)
    got, engine = _decode(model, "cached", slots, exp["short_prompt_ids"].tolist())
    assert got.generated_ids == want.generated_ids
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = engine.expert_cache_metrics()
    assert m["slots"] == slots
    if slots == le:  # everything fits: decode misses each expert at most once, then only hits
        assert m["decode"]["misses"] <= le
    if slots == e:  # the smallest cache must really evict and refetch
        assert m["misses"] > le
    assert m["decode"]["bytes_h2d"] == m["decode"]["misses"] * model.expert_bytes


def test_on_demand_bit_identical_and_never_hits(resident_runs):
    model, exp = load_fixture("qwen3_moe_fp32")
    want = _resident(resident_runs, "qwen3_moe_fp32")
    got, engine = _decode(model, "on_demand", model.cfg.num_experts, exp["short_prompt_ids"].tolist())
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = engine.expert_cache_metrics()
    assert m["hits"] == 0 and m["misses"] > 0


def test_long_prompt_grouped_prefill_cached_equals_resident():
    """300-token prompt: the grouped (ragged_dot) expert path, with the smallest cache."""
    model, exp = load_fixture("olmoe_fp32")
    prompt = exp["long_prompt_ids"].tolist()
    want = _decode(model, "resident", None, prompt, steps=24)[0]
    got = _decode(model, "cached", model.cfg.num_experts, prompt, steps=24)[0]
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert got.generated_ids[0][:16] == exp["long_generated_ids"].tolist()


@pytest.mark.slow  # by default: tests/test_serve_scheduler.py's batched requests of other lengths equal each alone
def test_batch_of_different_lengths_matches_single():
    model, exp = load_fixture("qwen3_moe_fp32")
    base = exp["long_prompt_ids"].tolist()
    prompts = [base[:5], base[10:27], base[40:80], base[100:200]]
    engine = Engine(model, EngineConfig("cached", num_slots=model.cfg.num_experts + 3, max_seq_len=256, batch=4))
    batched = engine.generate(prompts, max_new_tokens=20).generated_ids
    for p, ids in zip(prompts, batched):
        alone = Engine(model, EngineConfig("cached", num_slots=model.cfg.num_experts + 3,
                                           max_seq_len=256)).generate([p], 20)
        assert alone.generated_ids[0] == ids


def test_trace_routing_shapes_and_counts():
    model, exp = load_fixture("mixtral_fp32")
    engine = Engine(model, EngineConfig("cached", num_slots=model.cfg.num_experts, max_seq_len=64))
    prompt = exp["short_prompt_ids"].tolist()
    res = engine.generate([prompt], max_new_tokens=5, trace_routing=True)
    cfg = model.cfg
    assert len(res.routing) == 5
    assert res.routing[1].shape == (cfg.num_layers, 1, cfg.top_k)
    # padding tokens of the prefill bucket are marked -1, real ones are valid expert ids
    first = res.routing[0]
    assert (first[:, : len(prompt)] >= 0).all() and (first[:, len(prompt):] == -1).all()
    # a decode step's distinct experts are exactly its hits + misses
    m = engine.expert_cache_metrics()["decode"]
    distinct = sum(len(set(r[l, 0].tolist())) for r in res.routing[1:] for l in range(cfg.num_layers))
    assert m["hits"] + m["misses"] == distinct


def test_plan_memory_budget_and_errors():
    model, _ = load_fixture("qwen3_moe_fp32")
    cfg = model.cfg
    eb = cfg.expert_bytes(4)
    plan = plan_memory(cfg, 4, slots=cfg.num_experts)
    # every part is counted, the grouped prefill's copy of one layer's experts included
    assert plan.layer_gather_bytes == cfg.num_experts * eb
    assert plan.budget_bytes == (plan.non_expert_bytes + plan.kv_cache_bytes + plan.workspace_bytes
                                 + plan.layer_gather_bytes + plan.slots * eb)
    # the same budget gives back the same slots; one byte less gives one slot fewer
    again = plan_memory(cfg, 4, budget_bytes=plan.budget_bytes + 2 * eb)
    assert again.slots == cfg.num_experts + 2
    assert plan_memory(cfg, 4, budget_bytes=10**12).slots == cfg.num_layers * cfg.num_experts
    with pytest.raises(ValueError, match="minimum budget"):
        plan_memory(cfg, 4, budget_bytes=plan.budget_bytes - 1)
    with pytest.raises(ValueError, match="out of range"):
        plan_memory(cfg, 4, slots=cfg.num_experts - 1)
    with pytest.raises(ValueError, match="exactly one"):
        plan_memory(cfg, 4)
    # the pipelined driver: two full-layer buffers outside the pool instead of the gather; E slots stream
    piped = plan_memory(cfg, 4, slots=cfg.num_experts, pipelined=True)
    assert piped.layer_gather_bytes == 2 * cfg.num_experts * eb and piped.prefill_double_buffer
    assert piped.planned_bytes == plan.planned_bytes + cfg.num_experts * eb
    assert "stream buffers (2 x" in piped.describe() and not plan.prefill_double_buffer
    # every expert in a slot: nothing to stream on either driver, in the JSON as in the printed plan
    for whole_plan in (plan_memory(cfg, 4, budget_bytes=10**12, pipelined=p) for p in (False, True)):
        assert not whole_plan.prefill_double_buffer and "double buffer: not needed" in whole_plan.describe()


# every registered policy is exact end to end by default in tests/test_policy_registry.py (the tiny preset); here on a
# transformers fixture, mixtral's cases in the slow selection
@pytest.mark.parametrize("policy", ["lookahead", "lfru"])
@pytest.mark.parametrize("name", ["qwen3_moe_fp32", pytest.param("mixtral_fp32", marks=pytest.mark.slow)])
def test_cache_policy_bit_identical(name, policy, resident_runs):
    model, exp = load_fixture(name)
    want = _resident(resident_runs, name)
    e = model.cfg.num_experts
    engine = Engine(model, EngineConfig("cached", num_slots=e + 1, max_seq_len=256, cache_policy=policy))
    got = engine.generate([exp["short_prompt_ids"].tolist()], max_new_tokens=STEPS, keep_logits=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = engine.expert_cache_metrics()
    assert m["policy"] == policy and m["misses"] > 0  # the tiny cache really evicts


@pytest.mark.parametrize("policy", ["fetch", "adaptive"])
def test_reset_expert_cache_makes_a_repeat_cold(policy):
    """After ``reset_expert_cache`` a repeated request misses exactly as the first did (same
    counters, same logits); without it the warm cache hits. Adaptive also forgets recency."""
    model, exp = load_fixture("qwen3_moe_fp32")
    cfg = model.cfg
    prompt = exp["short_prompt_ids"].tolist()
    miss = MissPolicyConfig()
    if policy == "adaptive":
        miss = MissPolicyConfig("adaptive", cpu_impl="compute_on", fixed_fetch=1)
    # room for every expert, and no streaming (it re-copies whole layers): a repeat can hit
    eng = Engine(model, EngineConfig("cached", num_slots=cfg.num_layers * cfg.num_experts, max_seq_len=64,
                                     prefill="on_demand", miss=miss))

    def run():
        before = eng.expert_cache_metrics()
        res = eng.generate([prompt], max_new_tokens=4, keep_logits=True)
        after = eng.expert_cache_metrics()
        return res, {k: after[k] - before[k] for k in ("hits", "misses")}

    first, c1 = run()
    warm, c2 = run()
    assert c2["hits"] > c1["hits"]  # the warm cache serves part of the repeat
    eng.reset_expert_cache()
    if policy == "adaptive":
        assert int(eng.state.last_routed.max()) == -1
    cold, c3 = run()
    assert c3 == c1 and c1["misses"] > 0
    np.testing.assert_array_equal(cold.step_logits, first.step_logits)
    np.testing.assert_array_equal(warm.step_logits, first.step_logits)
    Engine(model, EngineConfig("resident", max_seq_len=64)).reset_expert_cache()  # no table: a no-op



def test_a_failed_step_leaves_the_engine_usable(monkeypatch):
    """A step that raises after consuming its donated expert state (as a device OOM can) must not
    leave the engine holding deleted buffers: it starts again from an empty cache, and the next
    request gives the same logits as before."""
    import jax
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["short_prompt_ids"].tolist()
    eng = Engine(model, EngineConfig("cached", num_slots=model.cfg.num_experts, max_seq_len=64))
    want = eng.generate([prompt], 8, keep_logits=True)
    compiled = eng.programs.compile

    def failing(fn, args, compiler_options=(), **static):
        compiled(fn, args, compiler_options=compiler_options, **static)

        def run(*a):
            for x in jax.tree.leaves(a[3]):  # the expert state, donated to the step
                x.delete()
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while running the step (simulated)")
        return run

    monkeypatch.setattr(eng.programs, "compile", failing)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        eng.generate([prompt], 8)
    monkeypatch.undo()
    assert eng.failed_steps == 1
    assert not any(x.is_deleted() for x in jax.tree.leaves(eng.state))
    assert eng.resident_experts_per_layer() == [0] * model.cfg.num_layers  # a fresh, empty cache
    got = eng.generate([prompt], 8, keep_logits=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)


def test_generation_stops_at_eos_per_sequence():
    """Each sequence stops after its first EOS id (kept, and nothing after it); the batch stops
    when all did; a sequence that never meets EOS runs to max_new_tokens ("length")."""
    model, exp = load_fixture("qwen3_moe_fp32")
    short, long_ = exp["short_prompt_ids"].tolist(), exp["long_prompt_ids"].tolist()[:40]
    eng = Engine(model, EngineConfig("cached", num_slots=model.cfg.num_experts, max_seq_len=96, batch=2))
    free = eng.generate([short, long_], 12)
    assert free.stop_reasons == ["length", "length"]
    a, b = free.generated_ids
    eos = next(t for t in a[2:] if t not in b and a.index(t) >= 2)  # an id only sequence 0 generates
    got = eng.generate([short, long_], 12, eos_ids=[eos])
    cut = a.index(eos) + 1
    assert got.generated_ids == [a[:cut], b] and got.stop_reasons == ["eos", "length"]
    both = eng.generate([short, short], 12, eos_ids=[eos], keep_logits=True, trace_routing=True, time_steps=True)
    assert both.generated_ids == [a[:cut], a[:cut]] and both.stop_reasons == ["eos", "eos"]  # decoding ended early
    # nothing of the step run after the EOS (the check reads one token late) is kept
    assert both.step_logits.shape[0] == len(both.routing) == len(both.step_s) + 1 == cut
    assert model.eos_token_ids == (2,)  # the fixture's generation_config.json


def test_cache_contents_and_per_request_figures():
    """The metrics say what the slot cache holds per layer, and each request's own hits, misses
    and H2D bytes, which add up to the engine's totals."""
    model, exp = load_fixture("qwen3_moe_fp32")
    cfg = model.cfg
    eng = Engine(model, EngineConfig("cached", num_slots=cfg.num_experts + 2, max_seq_len=96))
    r1 = eng.generate([exp["short_prompt_ids"].tolist()], 6)
    r2 = eng.generate([exp["long_prompt_ids"].tolist()[:30]], 6)
    m = eng.expert_cache_metrics()
    for key in ("hits", "misses", "bytes_h2d", "fetched"):
        assert r1.expert_cache[key] + r2.expert_cache[key] == m[key] and r1.expert_cache[key] >= 0
    assert r1.expert_cache["misses"] > 0
    held = m["resident_per_layer"]
    assert len(held) == cfg.num_layers and sum(held) == cfg.num_experts + 2  # every slot holds one expert
    table = np.asarray(eng.state.table.slot_of).reshape(cfg.num_layers, cfg.num_experts)
    assert held == (table >= 0).sum(axis=1).tolist()


def test_engine_refuses_more_prompts_than_its_batch_and_no_new_tokens():
    model, exp = load_fixture("qwen3_moe_fp32")
    eng = Engine(model, EngineConfig(max_seq_len=64))  # batch 1
    p = exp["short_prompt_ids"].tolist()
    with pytest.raises(ValueError, match="2 prompts exceed the engine's batch 1"):
        eng.generate([p, p], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        eng.generate([p], 0)


def test_plan_for_a_budget_that_fits_everything_is_resident_even_with_prefill_stream():
    """A budget that holds the whole pool plans a resident run, and a resident run has nothing to
    stream (prefill=stream then prefills as auto), instead of refusing the combination."""
    from ftjax.runtime.planner import plan_run

    def plan_engine(model, budget, prompts, config, mode="auto"):
        return plan_run(model, config, prompts, budget_bytes=budget, mode=mode)

    model, exp = load_fixture("qwen3_moe_fp32")
    cfg = model.cfg
    base = EngineConfig("cached", num_slots=2 * cfg.num_experts, max_seq_len=64, prefill="stream")
    config, plan = plan_engine(model, 10**10, [exp["short_prompt_ids"].tolist()], base)
    assert config.experts == "resident" and config.prefill == "auto" and plan.fits_resident
    assert "prefill double buffer: not needed (every expert has a slot)" in plan.describe()
    assert plan.workspace_temp_bytes is not None and plan.planned_bytes <= 10**10
    budget = plan.planned_bytes - plan.all_slots_bytes + 10 * plan.expert_bytes  # 10 slots: E < 10 < 2E
    with pytest.raises(ValueError, match="prefill=stream on the layer scan needs at least 2E=16 slots"):
        plan_engine(model, budget, [exp["short_prompt_ids"].tolist()], base)
    small, plan2 = plan_engine(model, budget, [exp["short_prompt_ids"].tolist()],
                               dataclasses.replace(base, prefill="auto"))
    assert small.experts == "cached" and small.num_slots == 10 and plan2.slots == 10
    # resident asked for with a budget that holds 10 of the pool's experts: refused, naming the budget it needs
    need = (plan2.planned_bytes - plan2.layer_gather_bytes + (plan2.pool_slots - 10) * plan2.expert_bytes) / 1e9
    with pytest.raises(ValueError, match=rf"experts mode 'resident' keeps all {plan2.pool_slots} experts .* "
                                         rf"leaves room for 10; give at least {need:.3f} GB"):
        plan_engine(model, budget, [exp["short_prompt_ids"].tolist()], dataclasses.replace(base, prefill="auto"),
                    mode="resident")
    full, _ = plan_engine(model, 10**10, [exp["short_prompt_ids"].tolist()], base, mode="resident")
    assert full.experts == "resident"


def test_plan_falls_back_to_the_scan_driver_when_the_pipelined_buffers_do_not_fit(monkeypatch):
    """Where streamed calls would run on the layer-pipelined driver (``prefill_driver`` "auto" on a GPU:
    ``EngineConfig.pipelines_streams`` is patched to say so, since on the CPU auto is the scan) and its two
    full-layer buffers leave fewer than E slots, the plan is the scan driver's: its slots are what the budget
    leaves after the scan's measured workspace, the config names the scan, the plan says why. The pipelined
    driver asked for (or prefill=stream) at that budget is refused, naming its buffers."""
    from ftjax.runtime.planner import BudgetTooSmall, plan_run

    model, exp = load_fixture("qwen3_moe_fp32")
    # the float32 fixture keeps "auto" on a GPU too (its resolution to the scan is test_layer_pipeline's)
    monkeypatch.setattr(EngineConfig, "for_compute_dtype", lambda self, dtype: self)
    e, eb = model.cfg.num_experts, model.expert_bytes
    prompts = [exp["short_prompt_ids"].tolist()]
    base = EngineConfig("cached", num_slots=2 * e, max_seq_len=64)
    # each driver's fixed bytes (weights, KV, the workspace measured on its programs; the pipelined driver's
    # buffers) from a budget that holds everything
    (_, scan), (_, piped) = (plan_run(model, dataclasses.replace(base, prefill_driver=d), prompts, budget_bytes=10**10)
                             for d in ("scan", "pipelined"))
    fixed, fixed_piped = (p.planned_bytes - p.all_slots_bytes for p in (scan, piped))
    buffers = 2 * e * eb
    assert scan.driver == "scan" and scan.layer_gather_bytes == 0 and scan.driver_note is None
    assert piped.driver == "pipelined" and piped.layer_gather_bytes == buffers
    with monkeypatch.context() as m:
        m.setattr(EngineConfig, "pipelines_streams", lambda self: self.prefill_driver != "scan")  # a GPU's auto
        for slots in (2 * e, e + 1):  # with and without room for the scan's 2E borrowed slots
            budget = fixed + slots * eb
            # the auto probe on the CPU compiles the scan's programs: the pipelined plan is its workspace plus
            # the buffers; asked for, the pipelined driver's own programs
            left, left_piped = (budget - fixed - buffers) // eb, (budget - fixed_piped) // eb
            assert max(left, left_piped) < e  # neither pipelined plan fits
            config, plan = plan_run(model, base, prompts, budget_bytes=budget)
            assert config.prefill_driver == "scan" and config.experts == "cached"
            assert config.num_slots == plan.slots == slots and not plan.pipelined and plan.driver == "scan"
            assert plan.prefill_double_buffer == (slots >= 2 * e) and plan.planned_bytes <= budget
            assert plan.workspace_temp_bytes == scan.workspace_temp_bytes  # measured again, on the scan's programs
            assert plan.driver_note == (f"pipelined buffers do not fit: their {buffers / 1e9:.3f} GB would leave "
                                        f"{max(left, 0)} slots, E={e} needed")
            text = plan.describe()
            assert f"prefill driver scan ({plan.driver_note}); prefill double buffer: " in text
            assert (f"yes ({2 * e} slots borrowed" if slots >= 2 * e else f"no (it needs {2 * e} slots") in text
            assert plan.as_dict()["driver"] == "scan"
            with pytest.raises(BudgetTooSmall, match=rf"leaves {max(left_piped, 0)} expert slots.* the pipelined "
                                                     rf"prefill driver's two full-layer buffers"):
                plan_run(model, dataclasses.replace(base, prefill_driver="pipelined"), prompts, budget_bytes=budget)
            with pytest.raises(BudgetTooSmall, match="the pipelined prefill driver's two full-layer buffers"):
                plan_run(model, dataclasses.replace(base, prefill="stream"), prompts, budget_bytes=budget)
        # a budget that holds the buffers and E slots keeps the pipelined driver
        config, plan = plan_run(model, base, prompts, budget_bytes=fixed + buffers + e * eb)
        assert config.prefill_driver == "auto" and plan.pipelined and plan.slots == e and plan.driver_note is None
    # unpatched, the CPU's auto is the scan: the budget of 2E slots plans it without a note
    config, plan = plan_run(model, base, prompts, budget_bytes=fixed + 2 * e * eb)
    assert config.prefill_driver == "auto" and plan.slots == 2 * e and plan.driver_note is None


def test_decode_gemm_cublas_keeps_logits():
    """The plumbing of ``KernelConfig.decode_gemm``: "cublas" compiles its own decode program with
    :data:`CUBLAS_DECODE_OPTIONS` (told apart by ``compiled_programs``), with the same logits. XLA:CPU
    compiles the same program either way; cuBLAS's numerics are a GPU check (check_oracle_gpu)."""
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["short_prompt_ids"].tolist()
    runs = {}
    for gemm in ("xla", "cublas"):
        eng = Engine(model, EngineConfig("cached", num_slots=12, max_seq_len=64,
                                         kernels=KernelConfig(decode_gemm=gemm)))
        runs[gemm] = eng.generate([prompt], max_new_tokens=4, keep_logits=True)
        assert eng.describe()["decode_compiler_options"] == dict(programs.decode_compiler_options(gemm, 1, "float32"))
    def is_decode(sig):  # the tokens int32 [1, 1] among the argument leaves
        return any(shape == (1, 1) and dtype == np.int32 for shape, dtype, _ in sig)
    with_options = [(name, sig) for name, static, sig, _ in programs.compiled_programs()
                    if static["compiler_options"] == dict(programs.CUBLAS_DECODE_OPTIONS)]
    # the cublas engine's decode programs only: its decode block (and no prefill program)
    assert {name for name, _ in with_options} == {"decode_block"}
    assert all(is_decode(sig) for _, sig in with_options)
    np.testing.assert_allclose(runs["cublas"].step_logits, runs["xla"].step_logits, rtol=1e-6, atol=1e-6)
    assert runs["cublas"].generated_ids == runs["xla"].generated_ids


def test_compiled_key_normalises_compiler_options():
    """A dict and pairs in any order name one program; other values another."""
    import jax
    import jax.numpy as jnp
    model, _ = load_fixture("qwen3_moe_fp32")
    eng = Engine(model, EngineConfig("resident", max_seq_len=64))
    fn = jax.jit(lambda x: x * 2)
    x = jnp.ones(3)
    compile = eng.programs.compile
    a = compile(fn, (x,), compiler_options={"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "x"})
    pairs = (("xla_disable_hlo_passes", "x"), ("xla_gpu_enable_triton_gemm", False))
    b = compile(fn, (x,), compiler_options=pairs)
    c = compile(fn, (x,), compiler_options={"xla_gpu_enable_triton_gemm": True, "xla_disable_hlo_passes": "x"})
    assert a is b and c is not a
    assert sum(1 for name, *_ in programs.compiled_programs() if name == fn.__name__) == 2


def test_decode_step_skips_the_eviction_order_behind_a_cond_prefill_does_not():
    """``ftjax.experts.offload`` asks the slot table for its all-hit fast path (a cond around the
    candidate slots) only where a layer routes fewer (token, expert) pairs than E: a cached decode
    step; a prefill call with more pairs, resident steps and on_demand steps (a reset table: every
    routed expert misses, the cond could only cost) have no such cond; nor a program whose conds would
    send their predicate to the host (``StepOptions.cheap_conds`` False: a GPU program that is not a
    command buffer with CONDITIONAL; the call's plan, ``engine.planner.plan``, sets it True on the CPU). (The fast
    path's results are the full update's: tests/test_slot_table.py, and the cached = resident tests above.)"""
    import dataclasses

    from ftjax.checkpoint import random_model
    from ftjax.config import preset
    from ftjax.runtime.step import forward_step

    cfg = preset("tiny")
    prefill_tokens = -(-cfg.num_experts // cfg.top_k) + 1  # N * k > E
    for mode, tokens, cheap, want in (("cached", 1, None, True), ("cached", prefill_tokens, None, False),
                                      ("resident", 1, None, False), ("on_demand", 1, None, False),
                                      ("cached", 1, False, False)):
        slots = None if mode == "resident" else cfg.num_experts
        config = EngineConfig(mode, num_slots=slots, max_seq_len=32, prefill="on_demand")
        eng = Engine(random_model(cfg, "float32"), config)
        args = (eng.model.params, eng.model.banks, eng.new_cache(1), eng.state, np.zeros((1, tokens), np.int32),
                np.zeros(1, np.int32), np.full(1, tokens, np.int32), ())
        opts = eng.planner.plan(1, tokens, tokens).opts
        assert opts.cheap_conds  # on the CPU
        if cheap is not None:
            opts = dataclasses.replace(opts, cheap_conds=cheap)
        text = forward_step.lower(*args, cfg=eng.cfg, opts=opts).as_text()
        assert ("stablehlo.case" in text) == want, (mode, tokens, cheap)


def test_call_options_cheap_conds_follow_the_command_buffers(monkeypatch):
    """On a GPU a call's conds are cheap only in a program compiled as a command buffer with
    CONDITIONAL: a cached decode step under ``KernelConfig.decode_graphs`` auto / on; not with "off", not a
    prefill call, not a resident step under auto. On the CPU always."""
    import jax
    from ftjax.checkpoint import random_model
    from ftjax.config import preset

    model = random_model(preset("tiny"), "bfloat16")
    cases = (("cached", "auto", 1, True), ("cached", "on", 1, True), ("cached", "off", 1, False),
             ("cached", "auto", 16, False), ("resident", "auto", 1, False), ("resident", "on", 1, True))
    for mode, graphs, tokens, want in cases:
        slots = None if mode == "resident" else model.cfg.num_experts
        eng = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=32,
                                         kernels=KernelConfig(decode_graphs=graphs)))
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        plan = eng.planner.plan(1, tokens, tokens)
        monkeypatch.undo()
        assert plan.opts.cheap_conds == want, (mode, graphs, tokens)
        assert ("xla_gpu_enable_command_buffer" in dict(plan.compiler_options)) == want
        assert eng.planner.plan(1, tokens, tokens).opts.cheap_conds  # the CPU
    # a miss policy whose split fetches every miss of the call compiles the fetch program: graphs under auto;
    # one that computes misses on the CPU (host compute in the step) does not
    e, k = model.cfg.num_experts, model.cfg.top_k
    for fixed, want in ((e, True), (0, False)):
        miss = MissPolicyConfig("adaptive", cpu_impl="compute_on", fixed_fetch=fixed)
        eng = Engine(model, EngineConfig("cached", num_slots=e, max_seq_len=32, miss=miss))
        assert eng.miss.config.fetches_all(k, e) == want
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        plan = eng.planner.plan(1, 1, 1)
        monkeypatch.undo()
        options = plan.compiler_options
        assert plan.opts.cheap_conds == want and ("xla_gpu_enable_command_buffer" in dict(options)) == want, fixed
    # the host-split driver's per-layer programs (a split that uses the CPU): command buffers under "on" only
    for graphs, want in (("on", True), ("auto", False)):
        miss = MissPolicyConfig("adaptive", "callback", fixed_fetch=0, cpu_driver="host")
        eng = Engine(model, EngineConfig("cached", num_slots=e, max_seq_len=32, miss=miss,
                                         kernels=KernelConfig(decode_graphs=graphs)))
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        plan = eng.planner.plan(1, 1, 1)
        monkeypatch.undo()
        assert plan.driver == "host_split" and ("xla_gpu_enable_command_buffer" in dict(plan.compiler_options)) == want


def test_routed_count_equals_the_mask_sum():
    """offload.routed_count: the pairwise count of decode-sized routings (repeats, padding tokens,
    every token invalid) equals the routed mask's sum; larger routings take the mask."""
    import jax.numpy as jnp

    from ftjax.experts.offload import PAIRWISE_MAX_PAIRS, routed_count, routed_mask

    rng = np.random.default_rng(0)
    for n, k, e in ((1, 8, 128), (4, 8, 16), (8, 8, 8), (3, 2, 4), (16, 8, 128)):
        for _ in range(20):
            ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
            valid = jnp.asarray(rng.random(n) < 0.7)
            want = int(jnp.sum(routed_mask(ids, valid, e)))
            assert int(routed_count(ids, valid, e)) == want, (n, k, e)
        assert int(routed_count(ids, jnp.zeros(n, bool), e)) == 0
    ids = jnp.asarray([[3, 3], [3, 1]], jnp.int32)
    assert int(routed_count(ids, jnp.asarray([True, True]), 4)) == 2
    assert int(routed_count(ids, jnp.asarray([False, True]), 4)) == 2  # the second token alone routes 3 and 1
    assert int(routed_count(ids[:1], jnp.asarray([True]), 4)) == 1
    assert 16 * 8 > PAIRWISE_MAX_PAIRS  # the last case above went through the mask
