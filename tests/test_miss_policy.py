"""Cache misses computed on the CPU and the q* split (DESIGN.md 1.2).

Tolerance: on the CPU backend the logits of every miss policy must be *bit-identical* to the
resident model's. The host kernel (XLA:CPU via a callback, or XLA's host computation via
compute_on) evaluates the same SwiGLU expression on the same backend as the device path, and the
CPU outputs replace the device's per-(token, k) outputs *before* the one weighted sum, so no
summation order changes; measured: max |diff| = 0.0 for float32 and bfloat16 fixtures. On a GPU
the CPU's and the GPU's dot products may round differently (bf16 outputs, f32 accumulation in a
different order); experiments/bench_miss_policy.py reports that difference.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bank_helpers import random_banks
from cli_helpers import run_generate
from conftest import load_fixture, needs_c_compiler, oracle_tol
from ftjax import memory
from ftjax import Engine
from ftjax.config import EngineConfig, MissPolicyConfig
from ftjax.experts import cpu_experts, cpu_rows, miss_policy, offload, quant
from ftjax.experts.state import init_expert_state
from ftjax.experts.miss_split import (SplitModel, best_fetch_count, brute_force_fetch_count, fixed_split_table,
                                      most_recent_misses, qstar, split_cost, split_gain, split_table, with_link)
from ftjax.seams import LayerRouting

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 32


# ---------------------------------------------------------------------------------------------
# The split rule
# ---------------------------------------------------------------------------------------------
def test_qstar_values_and_design_formula():
    # B_P = 50, B_H = 10: F* = 8 * 50 / 60 = 6.67; F = 7 gives max(7/50, 1/10) = 0.14 < F = 6's 0.2
    assert qstar(8, 50.0, 10.0) == 7
    assert qstar(0, 50.0, 10.0) == 0
    assert qstar(8, 1.0, 1.0) == 4                    # equal bandwidths: half and half
    assert qstar(8, 1.0, 1e-9) == 8                   # a useless CPU: fetch everything
    assert qstar(8, 1e-9, 1.0) == 0                   # a useless link: CPU everything
    for m in range(1, 40):
        for bp, bh in ((52.7, 7.8), (31.0, 25.8), (3.0, 11.0)):
            f = qstar(m, bp, bh)
            fstar = m * bp / (bp + bh)
            assert math.floor(fstar) <= f <= math.ceil(fstar)


@settings(max_examples=300, deadline=None)
@given(m=st.integers(0, 64), beta_p=st.floats(1e-5, 1e-2), beta_h=st.floats(1e-5, 1e-2),
       alpha_p=st.one_of(st.just(0.0), st.floats(0, 5e-3)), alpha_h=st.one_of(st.just(0.0), st.floats(0, 5e-3)),
       overlap=st.one_of(st.just(1.0), st.just(0.0), st.floats(0, 1)))
def test_closed_form_equals_brute_force(m, beta_p, beta_h, alpha_p, alpha_h, overlap):
    model = SplitModel(beta_p, beta_h, alpha_p, alpha_h, overlap)
    f = best_fetch_count(m, model)
    costs = sorted(split_cost(g, m, model) for g in range(m + 1))
    assert split_cost(f, m, model) <= costs[0] * (1 + 1e-9)          # the closed form is optimal
    if len(costs) == 1 or costs[1] > costs[0] * (1 + 1e-6):           # a unique minimiser: the same F
        assert f == brute_force_fetch_count(m, model)


def test_closed_form_equals_brute_force_exact_costs_with_ties():
    """Costs that are exact in binary floating point, so ties are real and the tie rule shows."""
    for bp in (1.0, 2.0, 3.0, 0.5):
        for bh in (1.0, 2.0, 4.0, 0.25):
            for ap in (0.0, 1.0, 2.5):
                for ah in (0.0, 0.5, 3.0):
                    for ov in (0.0, 0.5, 1.0):
                        model = SplitModel(bp, bh, ap, ah, ov)
                        for m in range(0, 13):
                            assert best_fetch_count(m, model) == brute_force_fetch_count(m, model), (model, m)


def test_serial_overlap_picks_an_end_and_fixed_costs_matter():
    # overlap 0: cost is a + c, linear in F apart from the fixed costs: one side gets everything
    serial = SplitModel(beta_p=1.0, beta_h=2.0, overlap=0.0)
    assert split_table(serial, 6) == (0, 1, 2, 3, 4, 5, 6)
    # a large fixed cost of the copy loop makes a single miss cheaper on the CPU
    lat = SplitModel(beta_p=0.2, beta_h=1.0, alpha_p=1.5, alpha_h=0.0, overlap=1.0)
    assert best_fetch_count(1, lat) == 0 and best_fetch_count(8, lat) > 0
    assert fixed_split_table(2, 5) == (0, 1, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="beta"):
        SplitModel(0.0, 1.0)
    with pytest.raises(ValueError, match="overlap"):
        SplitModel(1.0, 1.0, overlap=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        fixed_split_table(-1, 3)
    for bad in (math.nan, math.inf, True, "fast"):
        with pytest.raises(ValueError, match="finite number"):
            SplitModel(1.0, 1.0, alpha_h=bad)
    # costs that overflow to inf still give an integer split (not None)
    huge = SplitModel(beta_p=1e307, beta_h=1e307, alpha_p=1.7e308, alpha_h=1.7e308)
    assert split_table(huge, 4) == (0, 1, 2, 3, 4)
    # a near-flat serial piece: the closed form reaches the minimum cost (F = 0 or 1 are ties)
    flat = SplitModel(beta_p=1 + 6e-8, beta_h=1.0, overlap=0.0)
    f = best_fetch_count(100, flat)
    assert split_cost(f, 100, flat) <= split_cost(0, 100, flat) * (1 + 1e-9) and f == 1


def test_slower_link_model_and_split_gain():
    """A slower link (PCIe 4.0 x8 ~12 GB/s) makes fetching dearer: more misses go to the CPU, and the
    split's gain over fetching every miss grows; the CPU side, fixed costs and overlap are kept."""
    b = 9_437_184                                          # one qwen3-30b-a3b bf16 expert
    fast = SplitModel.from_bandwidths(b, 50e9, 30e9, alpha_p=1e-5, alpha_h=1e-4, overlap=0.9)
    slow = with_link(fast, b, 12e9)
    assert slow.beta_p == pytest.approx(b / 12e9) and slow.beta_h == fast.beta_h
    assert (slow.alpha_p, slow.alpha_h, slow.overlap) == (fast.alpha_p, fast.alpha_h, fast.overlap)
    g_fast, g_slow = split_gain(8, fast), split_gain(8, slow)
    for g, m in ((g_fast, fast), (g_slow, slow)):
        assert g["misses"] == 8 and g["fetch"] == best_fetch_count(8, m)
        assert g["fetch_only_s"] == pytest.approx(m.alpha_p + 8 * m.beta_p)
        assert g["cpu_only_s"] == pytest.approx(m.alpha_h + 8 * m.beta_h)
        assert g["split_s"] == pytest.approx(split_cost(g["fetch"], 8, m))
        assert g["gain"] == pytest.approx(g["fetch_only_s"] / g["split_s"]) and g["gain"] >= 1.0
    assert g_slow["fetch"] < g_fast["fetch"] < 8 and g_slow["gain"] > g_fast["gain"] > 1.0
    # the plain q* rule at 12 GB/s vs a 30 GB/s CPU: F* = 8 * 12 / 42 = 2.3; F = 2 costs max(2/12, 6/30) = 0.2 s
    # per 1e9 bytes, F = 3 max(3/12, 5/30) = 0.25: fetch 2, gain (8/12) / 0.2 = 3.33
    plain = with_link(SplitModel.from_bandwidths(1, 50.0, 30.0), 1, 12.0)
    g = split_gain(8, plain)
    assert g["fetch"] == 2 and g["gain"] == pytest.approx((8 / 12) / (6 / 30))
    assert split_gain(0, plain)["gain"] == 1.0
    useless_cpu = SplitModel.from_bandwidths(b, 12e9, 1e6)
    assert split_gain(8, useless_cpu) == {**split_gain(8, useless_cpu), "fetch": 8, "gain": 1.0}
    with pytest.raises(ValueError, match="> 0"):
        with_link(fast, b, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        split_gain(-1, fast)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_most_recent_misses(data):
    e = 12
    miss = np.array(data.draw(st.lists(st.booleans(), min_size=e, max_size=e)))
    last = np.array(data.draw(st.lists(st.integers(-1, 5), min_size=e, max_size=e)), np.int32)
    n = data.draw(st.integers(0, int(miss.sum())))
    got = np.asarray(jax.jit(most_recent_misses)(jnp.asarray(miss), jnp.asarray(last), jnp.int32(n)))
    order = sorted(np.flatnonzero(miss), key=lambda i: (-last[i], i))  # newest first, ties: lower id
    want = np.zeros(e, bool)
    want[order[:n]] = True
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Mechanisms
# ---------------------------------------------------------------------------------------------
def test_host_bank_view_is_zero_copy_and_kernel_matches_ffn():
    model, _ = load_fixture("qwen3_moe_fp32")
    view = cpu_experts.host_bank_view(model.host_gate_up)
    assert view.array.ctypes.data == model.host_gate_up.unsafe_buffer_pointer()
    assert not view.array.flags.writeable
    np.testing.assert_array_equal(view.array, np.asarray(model.host_gate_up))
    assert not cpu_experts._readable_mapping(8, 4096)  # page 0 is never mapped
    k = cpu_experts.get_kernel(model.host_gate_up, model.host_down, threads=2)
    assert k is cpu_experts.get_kernel(model.host_gate_up, model.host_down, threads=2)  # memoised
    assert k.zero_copy
    x = np.random.default_rng(0).normal(size=(3, model.cfg.hidden_size)).astype(np.float32)
    ids = np.array([5, 0, 17, -1], np.int32)
    y = k.compute(x, ids, 3)                       # called directly (no outer jit running)
    assert y.shape == (4, 3, model.cfg.hidden_size)
    for j in range(3):
        want = cpu_experts._ffn(x, np.asarray(model.host_gate_up)[ids[j]], np.asarray(model.host_down)[ids[j]])
        np.testing.assert_allclose(y[j], np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not y[3].any()                          # rows past count are zeros


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4", "float32", "fp8"])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_row_split_kernel_equals_the_reference_ffn(fmt, threads):
    """``numpy_rows_async``'s kernel: every expert cut into row blocks over the threads (1, 3 or 8
    threads and 1 to 5 experts: blocks of 16 to 256 rows, int4's 64-row scale groups, fp8's 128 x 128
    blocks) equals ``cpu_experts._ffn`` on the dequantized weights up to rounding: float32 summation
    order (float32 banks), and the reference's rounding of its intermediates to bf16 (16-bit x)."""
    d, f = 256, 128
    gu, dn, scales, tag = random_banks(fmt, 12, d, f)
    view = lambda a: cpu_experts.HostBankView(a, None, "numpy")  # noqa: E731
    k = cpu_rows.RowSplitKernel(view(gu), view(dn), threads, None if scales is None else tuple(map(view, scales)),
                                tag)
    try:
        assert k.threads == threads and (k.hidden, k.ffn) == (d, f)
        xdt = np.float32 if fmt == "float32" else np.dtype(jnp.bfloat16)
        x = (np.random.default_rng(1).standard_normal((3, d))).astype(xdt)
        for count in (1, 2, 5):
            ids = np.array([7, 0, 11, 3, 5, -1][:count] + [-1] * (6 - count), np.int32)
            y = k.compute(x, ids, count)
            assert y.shape == (6, 3, d) and y.dtype == x.dtype
            assert not y[count:].astype(np.float32).any()           # rows past count are zeros
            for j in range(count):
                sc = () if scales is None else (scales[0][ids[j]], scales[1][ids[j]])
                want = np.asarray(cpu_experts._ffn(jnp.asarray(x, jnp.float32), gu[ids[j]], dn[ids[j]], *sc,
                                                   fmt=tag), np.float32)
                got = y[j].astype(np.float32)
                tol = 1e-5 if fmt == "float32" else 1e-2  # bf16 outputs: 2**-8 relative
                assert np.abs(got - want).max() <= tol * np.abs(want).max(), (fmt, threads, count, j)
        # asynchronous use: two calls in flight, collected in either order
        t1, t2 = k.submit(x, np.array([1, 2], np.int32), 2), k.submit(x, np.array([4], np.int32), 1)
        np.testing.assert_array_equal(k.result(t2), k.compute(x, np.array([4], np.int32), 1))
        np.testing.assert_array_equal(k.result(t1), k.compute(x, np.array([1, 2], np.int32), 2))
    finally:
        k.close()


@pytest.mark.parametrize("fmt,d,f", [("int4", 80, 96), ("int4", 96, 40), ("fp8", 200, 136), ("fp8", 320, 64)])
@pytest.mark.parametrize("threads", [1, 3])
def test_row_split_kernel_partial_scale_groups(fmt, d, f, threads):
    """An input width that is not a multiple of the format's scale group (int4: 64 rows, fp8: 128) ends in a
    partial group: a row block over it applies each group's scale to that group's rows only (80 = 64 + 16,
    200 = 128 + 72, 320 = 2 x 128 + 64)."""
    gu, dn, scales, tag = random_banks(fmt, 4, d, f)
    view = lambda a: cpu_experts.HostBankView(a, None, "numpy")  # noqa: E731
    k = cpu_rows.RowSplitKernel(view(gu), view(dn), threads, tuple(map(view, scales)), tag)
    try:
        x = np.random.default_rng(1).standard_normal((2, d)).astype(np.float32)
        ids = np.array([3, 0, -1], np.int32)
        y = k.compute(x, ids, 2)
        for j in range(2):
            want = np.asarray(cpu_experts._ffn(jnp.asarray(x), gu[ids[j]], dn[ids[j]], scales[0][ids[j]],
                                               scales[1][ids[j]], fmt=tag), np.float32)
            np.testing.assert_allclose(y[j], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    finally:
        k.close()


@pytest.mark.parametrize("kind", ["xla", "rows", pytest.param("native", marks=needs_c_compiler)])
def test_host_kernel_tickets_stay_int32(kind):
    """The asynchronous mechanisms carry a ticket through the step as an int32 (``CpuExperts.launch``): the
    tickets of a long-running process wrap within [0, 2**31) instead of overflowing it after 2**31 calls."""
    gu, dn, _, tag = random_banks("float32", 2, 32, 16)
    view = lambda a: cpu_experts.HostBankView(a, None, "numpy")  # noqa: E731
    k = cpu_experts.kernel_class(kind)(view(gu), view(dn), 1, None, tag)
    try:
        k._tickets = itertools.count(2**31 - 1)  # as after 2**31 - 1 calls
        x = np.ones((1, 32), np.float32)
        t1, t2 = (k.submit(x, np.array([i], np.int32), 1) for i in (0, 1))
        assert 0 <= t1 < 2**31 and 0 <= t2 < 2**31 and t1 != t2
        np.int32(t1), np.int32(t2)  # what launch's io_callback returns
        np.testing.assert_array_equal(k.result(t2), k.compute(x, np.array([1], np.int32), 1))
        np.testing.assert_array_equal(k.result(t1), k.compute(x, np.array([0], np.int32), 1))
    finally:
        k.close()


def test_row_blocks_and_kernel_choice():
    assert cpu_rows.row_blocks(2048, 16, 16) == [(i, i + 128) for i in range(0, 2048, 128)]
    assert cpu_rows.row_blocks(768, 16, 64) == [(i, i + 64) for i in range(0, 768, 64)]   # 12 int4 groups
    assert cpu_rows.row_blocks(100, 3, 16) == [(0, 48), (48, 96), (96, 100)]
    assert cpu_rows.row_blocks(32, 1, 16) == [(0, 32)]
    with pytest.raises(ValueError, match=">= 1"):
        cpu_rows.row_blocks(32, 0, 16)
    assert cpu_experts.KERNEL_KIND["numpy_rows_async"] == "rows" and "numpy_rows_async" in cpu_experts.ASYNC_IMPLS
    assert cpu_experts.kernel_class("rows") is cpu_rows.RowSplitKernel
    assert cpu_experts.default_threads("rows") == (os.cpu_count() or 2)
    with pytest.raises(ValueError, match="unknown host kernel kind"):
        cpu_experts.kernel_class("torch")
    model, _ = load_fixture("qwen3_moe_fp32")
    k = cpu_experts.get_kernel(model.host_gate_up, model.host_down, threads=2, kind="rows")
    assert isinstance(k, cpu_rows.RowSplitKernel) and k.gate_up.how == "pointer"
    assert k is cpu_experts.get_kernel(model.host_gate_up, model.host_down, threads=2, kind="rows")
    assert k is not cpu_experts.get_kernel(model.host_gate_up, model.host_down, threads=2)  # the XLA kernel


def test_callback_refused_on_async_cpu_client_and_compute_on_needs_host_typed_banks():
    model, _ = load_fixture("qwen3_moe_fp32")
    assert jax.config.read("jax_cpu_enable_async_dispatch")  # pytest's process: JAX defaults
    for impl in cpu_experts.CALLBACK_IMPLS:
        with pytest.raises(ValueError, match="deadlock"):
            cpu_experts.make_cpu_experts(impl, model.host_gate_up, model.host_down)
    with pytest.raises(ValueError, match="unknown CPU expert mechanism"):
        cpu_experts.make_cpu_experts("torch", model.host_gate_up, model.host_down)
    # jit(out_shardings=pinned_host) arrays are traced as device memory (jax 0.11.2)
    bank = jax.jit(lambda: jnp.arange(24.0).reshape(2, 3, 4), out_shardings=memory.host_sharding())()
    assert bank.sharding.memory_kind == "pinned_host" and not cpu_experts.is_host_typed(bank)
    with pytest.raises(ValueError, match="ensure_host_typed"):
        cpu_experts.make_cpu_experts("compute_on", bank, bank)
    fixed = cpu_experts.ensure_host_typed(bank)
    assert cpu_experts.is_host_typed(fixed) and fixed.sharding.memory_kind == "pinned_host"
    assert bank.is_deleted()
    np.testing.assert_array_equal(np.asarray(fixed), np.arange(24.0).reshape(2, 3, 4))
    assert cpu_experts.ensure_host_typed(fixed) is fixed


# ---------------------------------------------------------------------------------------------
# The expert function: which misses go where, and what the LRU table sees
# ---------------------------------------------------------------------------------------------
def test_expert_fn_fetches_most_recent_misses_and_cpu_misses_stay_out_of_the_table():
    model, _ = load_fixture("qwen3_moe_fp32")  # L=3, E=8
    cfg = model.cfg
    e, slots = cfg.num_experts, cfg.num_experts + 2
    cpu = cpu_experts.make_cpu_experts("compute_on", model.host_gate_up, model.host_down)
    rt = miss_policy.build_runtime("adaptive", e, cpu, fixed_fetch=2)
    state = init_expert_state("cached", cfg.num_layers, e, slots, model.banks, jnp.float32,
                              track_recency=rt.track_recency)
    layer = 1
    # expert 0 resident (slot 3); experts 2, 4, 5, 7 missing with recencies 9, 11, -1, 11
    table = state.table
    table = table.replace(slot_of=table.slot_of.at[layer * e + 0].set(3),
                          id_of_slot=table.id_of_slot.at[3].set(layer * e),
                          last_use=table.last_use.at[3].set(5), clock=jnp.int32(20))
    last = state.last_routed.at[layer * e + jnp.array([2, 4, 7])].set(jnp.array([9, 11, 11]))
    gu_pool = state.gate_up.at[3].set(jnp.asarray(np.asarray(model.host_gate_up)[layer * e]))
    dn_pool = state.down.at[3].set(jnp.asarray(np.asarray(model.host_down)[layer * e]))
    state = state.replace(table=table, gate_up=gu_pool, down=dn_pool, last_routed=last)
    ids = jnp.array([[0, 2], [4, 5], [7, 0]], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (3, cfg.hidden_size))
    w = jnp.full((3, 2), 0.5)
    fn = jax.jit(offload.make_expert_fn("cached", e, model.banks, miss=rt.config))
    y, new, stats = fn(state, jnp.int32(layer), LayerRouting(x, ids, w, jnp.ones(3, bool)))
    assert (int(stats.hits), int(stats.misses), int(stats.fetched), int(stats.cpu)) == (1, 4, 2, 2)
    slot_of = np.asarray(new.table.slot_of)[layer * e: (layer + 1) * e]
    # the two most recent misses (4 and 7, clock 11) were fetched; 2 and 5 went to the CPU
    assert slot_of[0] == 3 and slot_of[4] >= 0 and slot_of[7] >= 0
    assert slot_of[2] == -1 and slot_of[5] == -1
    assert int(new.table.clock) == 21
    lr = np.asarray(new.last_routed)[layer * e: (layer + 1) * e]
    np.testing.assert_array_equal(lr[[0, 2, 4, 5, 7]], [20] * 5)        # every routed expert, now
    # the output equals the resident FFN of the routed experts
    gu, dn = np.asarray(model.host_gate_up), np.asarray(model.host_down)
    want = np.zeros((3, cfg.hidden_size), np.float32)
    for n in range(3):
        for k in range(2):
            fid = layer * e + int(ids[n, k])
            want[n] += 0.5 * np.asarray(cpu_experts._ffn(x[n:n + 1], gu[fid], dn[fid]))[0]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# End to end: every policy equals the resident model, bit for bit
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    model, exp = load_fixture("qwen3_moe_fp32")
    prompt = exp["short_prompt_ids"].tolist()
    want = Engine(model, EngineConfig("resident", max_seq_len=384)).generate([prompt], STEPS, keep_logits=True)
    return model, prompt, want, {}


def _run(qwen, name, miss: MissPolicyConfig, slots=None, trace=False):
    """One cached decode of the fixture, memoised by name across the tests of this module."""
    model, prompt, _, runs = qwen
    if name not in runs:
        cfg = model.cfg
        eng = Engine(model, EngineConfig("cached", num_slots=slots or cfg.num_experts, max_seq_len=384, miss=miss))
        runs[name] = (eng.generate([prompt], STEPS, keep_logits=True, trace_routing=trace), eng)
    return runs[name]


def _policy(model, policy, impl="compute_on", **kw) -> MissPolicyConfig:
    return MissPolicyConfig(policy, cpu_impl=impl, **kw)


def test_cpu_only_equals_resident_and_never_touches_the_table(qwen):
    model, _, want, _ = qwen
    cfg = model.cfg
    got, eng = _run(qwen, "cpu", _policy(model, "cpu"), trace=True)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = eng.expert_cache_metrics()
    assert m["miss_policy"] == "cpu" and m["fetched"] == 0 and m["bytes_h2d"] == 0
    assert m["cpu_computed"] == m["misses"] > 0
    # the prompt (16-token bucket x top-2 <= 64 pairs) is a gather call too: nothing ever got a slot
    table = eng.state.table
    assert (np.asarray(table.slot_of) == -1).all() and (np.asarray(table.id_of_slot) == -1).all()
    assert m["hits"] == 0
    # last_routed: the clock (call * L + layer) of each flat id's last routing by a real token
    e, nl = cfg.num_experts, cfg.num_layers
    ref = np.full(nl * e, -1)
    for step, r in enumerate(got.routing):
        for layer in range(nl):
            for i in np.unique(r[layer]):
                if i >= 0:
                    ref[layer * e + i] = step * nl + layer
    np.testing.assert_array_equal(np.asarray(eng.state.last_routed), ref)


def test_fixed_split_zero_equals_cpu_only_and_split_all_equals_fetch(qwen):
    model, _, want, _ = qwen
    cfg = model.cfg
    cpu_only, e_cpu = _run(qwen, "cpu", _policy(model, "cpu"), trace=True)
    zero, e_zero = _run(qwen, "fixed0", _policy(model, "adaptive", fixed_fetch=0))
    np.testing.assert_array_equal(zero.step_logits, cpu_only.step_logits)
    mz, mc = e_zero.expert_cache_metrics(), e_cpu.expert_cache_metrics()
    for key in ("hits", "misses", "fetched", "cpu_computed"):
        assert mz[key] == mc[key]
    # fetching every miss through this path reproduces the fetch policy's LRU table exactly
    slots = cfg.num_experts + 1
    fetch, e_fetch = _run(qwen, "fetch", MissPolicyConfig(), slots=slots)
    every, e_every = _run(qwen, "fixedE", _policy(model, "adaptive", fixed_fetch=cfg.num_experts), slots=slots)
    np.testing.assert_array_equal(every.step_logits, want.step_logits)
    np.testing.assert_array_equal(fetch.step_logits, want.step_logits)
    mf, me = e_fetch.expert_cache_metrics(), e_every.expert_cache_metrics()
    assert mf["miss_policy"] == "fetch" and mf["cpu_computed"] == 0 and mf["fetched"] == mf["misses"]
    for key in ("hits", "misses", "fetched", "bytes_h2d"):
        assert me[key] == mf[key]
    assert me["cpu_computed"] == 0
    for f in ("slot_of", "id_of_slot", "last_use", "clock"):
        np.testing.assert_array_equal(getattr(e_every.state.table, f), getattr(e_fetch.state.table, f))


def test_adaptive_model_split_smallest_cache_equals_resident(qwen):
    model, _, want, _ = qwen
    cfg = model.cfg
    # one miss goes to the CPU, two are split one-one (F* = 1 for M = 2)
    split = SplitModel(beta_p=1.0, beta_h=1.0, alpha_p=0.5)
    got, eng = _run(qwen, "model", _policy(model, "adaptive", "compute_on_static", split_model=split))
    rt = eng.miss
    assert rt.split_for(2) == [0, 0, 1]
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m = eng.expert_cache_metrics()
    assert m["fetched"] > 0 and m["cpu_computed"] > 0 and m["fetched"] + m["cpu_computed"] == m["misses"]
    assert m["bytes_h2d"] == m["fetched"] * model.expert_bytes
    table = rt.split_for(cfg.num_experts)
    assert all(f == table[mm] for h in m["split_histogram"] for mm, f in [(h["misses"], h["fetched"])])
    assert {(1, 0), (2, 1)} <= {(h["misses"], h["fetched"]) for h in m["split_histogram"]}
    assert m["split"] == {"rule": "model", "table": [0, 0, 1], "model": split.as_dict()}
    assert m["decode"]["fetched"] + m["prefill"]["fetched"] == m["fetched"]


def test_generate_cli_adaptive_callback_async_bit_identical(qwen, tmp_path):
    """The default mechanism (callback_async, which needs synchronous CPU dispatch set before JAX
    starts: its own process) through the CLI: quick calibration, profile, metrics, exact logits."""
    model, prompt, want, _ = qwen
    prof, metrics, logits = tmp_path / "prof.json", tmp_path / "m.json", tmp_path / "l.npy"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "ftjax.generate", "--noprogress", f"--checkpoint={model.name}",
                        f"--prompt_ids={','.join(map(str, prompt))}", f"--max_new_tokens={STEPS}",
                        f"--expert_slots={model.cfg.num_experts}", "--max_seq_len=384", "--miss_policy=adaptive",
                        "--cpu_expert_impl=callback_async", "--cpu_threads=2", f"--calibration_profile={prof}",
                        f"--metrics_json={metrics}", f"--logits_npy={logits}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "quick calibration" in r.stdout and "split F(M)" in r.stdout and "computed on the CPU" in r.stdout
    np.testing.assert_array_equal(np.load(logits), want.step_logits[:, 0])
    ec = json.loads(metrics.read_text())["expert_cache"]
    assert ec["miss_policy"] == "adaptive" and ec["split"]["rule"] == "model"
    assert ec["fetched"] + ec["cpu_computed"] == ec["misses"] > 0
    assert ec["cpu_expert_impl"]["impl"] == "callback_async" and ec["cpu_expert_impl"]["bank_view"] == "pointer"
    cal = ec["calibration"]
    assert cal["calibrated_now"] and cal["key"] == "cpu|float32|D64|F32|T1" and cal["path"] == str(prof)
    stored = json.loads(prof.read_text())["entries"][cal["key"]]["impls"]["callback_async"]
    assert stored["ok"] and ec["split"]["table"] == stored["split_table"]


@pytest.mark.parametrize("impl,kernel", [("numpy_rows_async", "rows"),
                                         pytest.param("native_async", "native", marks=needs_c_compiler)])
@pytest.mark.parametrize("expert_dtype", [None, pytest.param("int4", marks=pytest.mark.slow)])
def test_generate_cli_all_core_cpu_misses_match_resident(qwen, tmp_path, expert_dtype, impl, kernel):
    """The all-core CPU kernels computing misses in a cached decode (its own process: synchronous CPU
    dispatch): ``numpy_rows_async`` (row blocks, numpy) and ``native_async`` (the C/OpenMP kernel,
    ``ftjax.experts.cpu_native``, built into the test run's cache: tests/conftest.py). The same greedy tokens
    as the resident model, logits within the oracle tolerance (float32 accumulation in another order than
    XLA's, so not bit for bit), with a split that sends misses both ways. int4: against the resident model
    with the same quantized banks."""
    model, prompt, want, _ = qwen
    ref = want.step_logits[:, 0]
    if expert_dtype is not None:
        qmodel = dataclasses.replace(model, banks=quant.quantize_banks(model.banks, expert_dtype))
        ref = Engine(qmodel, EngineConfig("resident", max_seq_len=384)).generate(
            [prompt], STEPS, keep_logits=True).step_logits[:, 0]
    metrics, logits = tmp_path / "m.json", tmp_path / "l.npy"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "ftjax.generate", "--noprogress", f"--checkpoint={model.name}",
                        f"--prompt_ids={','.join(map(str, prompt))}", f"--max_new_tokens={STEPS}",
                        f"--expert_slots={model.cfg.num_experts}", "--max_seq_len=384", "--miss_policy=adaptive",
                        "--fixed_fetch=1", f"--cpu_expert_impl={impl}", "--cpu_threads=3",
                        f"--metrics_json={metrics}", f"--logits_npy={logits}"]
                       + ([f"--expert_dtype={expert_dtype}"] if expert_dtype else []),
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(logits)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=oracle_tol(ref))
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))   # the same greedy tokens
    ec = json.loads(metrics.read_text())["expert_cache"]
    got_impl = ec["cpu_expert_impl"]
    assert {k: got_impl[k] for k in ("impl", "threads", "bank_view", "zero_copy_rows", "kernel")} == {
        "impl": impl, "threads": 3, "bank_view": "pointer", "zero_copy_rows": True, "kernel": kernel}
    if kernel == "native":
        assert got_impl["openmp"] is True
        assert got_impl["library"].startswith("expert_ffn-") and got_impl["library"].endswith(".so")
    assert ec["cpu_computed"] > 0 and ec["fetched"] > 0 and ec["fetched"] + ec["cpu_computed"] == ec["misses"]


def test_generate_cli_native_async_without_a_compiler_one_line(tmp_path):
    """``--cpu_expert_impl=native_async`` where no C compiler is on PATH: one line that names what is missing."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PATH=str(tmp_path), FTJAX_NATIVE_CACHE=str(tmp_path / "cache"))
    model, _ = load_fixture("qwen3_moe_fp32")
    r = subprocess.run([sys.executable, "-m", "ftjax.generate", "--noprogress", f"--checkpoint={model.name}",
                        "--prompt_ids=1,2,3", "--max_new_tokens=2", f"--expert_slots={model.cfg.num_experts}",
                        "--max_seq_len=32", "--miss_policy=cpu", "--cpu_expert_impl=native_async"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1 and "no C compiler for the native CPU expert kernel" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_generate_cli_bad_miss_flags_one_line():
    r = run_generate("--miss_policy=cpu", "--fixed_fetch=2")  # in this process: tests/cli_helpers.py
    assert r.returncode == 1 and "--fixed_fetch needs --miss_policy=adaptive" in r.stderr
    assert "Traceback" not in r.stderr


def test_generate_cli_cpu_mechanism_without_cpu_misses_is_noted():
    """A CPU mechanism named while every miss is fetched (the default policy) does nothing: the run says so
    instead of ignoring the flag silently."""
    r = run_generate("--cpu_expert_impl=numpy_rows_async", "--max_new_tokens=2", "--prompt_ids=1,2,3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("--miss_policy=fetch copies every miss, so --cpu_expert_impl / --cpu_threads / --cpu_miss_driver are "
            "ignored") in r.stdout
    r = run_generate("--max_new_tokens=2", "--prompt_ids=1,2,3")
    assert r.returncode == 0 and "are ignored" not in r.stdout
