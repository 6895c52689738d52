"""The step profile's trace reduction (``experiments.timeline``: classify_op, hlo_op_names,
step_breakdown) on hand-made traces and HLO text; the script's CPU smoke run is in
tests/test_experiments.py."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.timeline import CATEGORIES, classify_op, hlo_op_names, step_breakdown  # noqa: E402

BODY = "jit(_forward_step)/while/body/eval_jaxpr"


@pytest.mark.parametrize("name, op_name, want", [
    ("MemcpyH2D", "", "h2d_copy"),
    ("Memcpy HtoD (Pinned -> Device)", f"{BODY}/attention/mul", "h2d_copy"),  # copies by name first
    ("MemcpyD2H", "", "loop"),  # the while loop's predicate read back
    ("Memset 3", "", "other"),
    ("fusion_3", f"{BODY}/attention/norm/rsqrt", "norm"),  # the innermost named scope wins
    ("fusion_4", f"{BODY}/attention/dot_general", "attention"),
    ("decode_attention", f"{BODY}/attention/pallas_call", "attention"),
    ("fusion_5", f"{BODY}/moe/router/top_k", "router"),
    ("sort_1", f"{BODY}/moe/slot_lookup/sort", "slot_table"),
    ("moe_decode_gate_up", f"{BODY}/moe/experts/pallas_call", "experts"),
    ("dynamic_update_slice", f"{BODY}/moe/expert_fetch/while/body/dynamic_update_slice", "h2d_copy"),
    ("loop_add_fusion", f"{BODY}/moe/add", "other"),  # the MoE block's residual add
    ("loop_dynamic_slice_fusion", "jit(_forward_step)/while/body/jit(dynamic_index_in_dim)/dynamic_slice", "loop"),
    ("loop_compare_fusion", "jit(_forward_step)/while/cond/lt", "loop"),
    ("input_reduce_fusion", "jit(_forward_step)/norm/reduce_sum", "norm"),  # the final norm
    ("gemm_fusion_dot", "jit(_forward_step)/dot_general", "head"),  # LM head: outside the loop
    ("moe_decode_down", "", "experts"),  # no HLO name: the Pallas kernels by their names
    ("flash_prefill", "", "attention"),
    ("fusion_9", f"{BODY}/gated_deltanet/dot_general", "linear_attention"),  # a hybrid's Gated DeltaNet mixer
    ("gated_delta_step", "", "linear_attention"),
    ("causal_conv", "", "linear_attention"),
    ("nvjet_sm90_tst_128x160", "", "other"),
])
def test_classify_op(name, op_name, want):
    assert classify_op(name, op_name) == want


HLO = f"""HloModule jit__forward_step, entry_computation_layout={{(f32[4]{{0}})->f32[4]{{0}}}}

%fused_computation (param_0: f32[4]) -> f32[4] {{
  %param_0 = f32[4]{{0}} parameter(0)
  ROOT %negate.1 = f32[4]{{0}} negate(%param_0), metadata={{op_name="{BODY}/moe/experts/neg" stack_frame_id=3}}
}}

ENTRY %main.1 (p0: f32[4], p1: f32[4,4]) -> f32[4] {{
  %p0 = f32[4]{{0}} parameter(0), metadata={{op_name="x"}}
  %p1 = f32[4,4]{{1,0}} parameter(1), metadata={{op_name="w"}}
  %mul_fusion.3 = f32[4]{{0}} fusion(%p0), kind=kLoop, calls=%fused_computation
  %rsqrt.2 = f32[4]{{0}} rsqrt(%p0), metadata={{op_name="{BODY}/attention/norm/rsqrt"}}
  %dot.39 = f32[4]{{0}} dot(%rsqrt.2, %p1), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  %copy.7 = f32[4]{{0}} copy(%rsqrt.2)
  %add.5 = f32[4]{{0}} add(%dot.39, %mul_fusion.3), metadata={{op_name="{BODY}/attention/norm/add"}}
  ROOT %wrapped_scatter = f32[4]{{0}} add(%add.5, %copy.7), metadata={{op_name="{BODY}/moe/slot_lookup/scatter-max"}}
}}
"""


def test_every_named_scope_of_ftjax_has_a_category():
    """A ``jax.named_scope`` added to ftjax without an entry in ``timeline.SCOPE_CATEGORY`` would put its kernels in
    the enclosing scope's category (or in loop / other) without a word."""
    import re

    from experiments.timeline import SCOPE_CATEGORY
    root = pathlib.Path(__file__).resolve().parents[1] / "ftjax"
    scopes = {m for f in root.rglob("*.py") for m in re.findall(r'named_scope\("([a-z_]+)"\)', f.read_text())}
    assert {"expert_fetch", "prefetch_lookup", "prefetch_wait"} <= scopes  # the scan finds them
    assert sorted(scopes - set(SCOPE_CATEGORY)) == []
    assert set(SCOPE_CATEGORY.values()) <= set(CATEGORIES)


def test_hlo_op_names():
    names = hlo_op_names(HLO)
    assert names["rsqrt.2"] == f"{BODY}/attention/norm/rsqrt"
    assert names["mul_fusion.3"] == names["mul_fusion_3"] == f"{BODY}/moe/experts/neg"  # a fusion: its root's
    # no metadata: the first user's name; a matmul never belongs to a norm: the scope around it
    assert names["dot.39"] == f"{BODY}/attention/dot_general"
    assert names["copy.7"] == f"{BODY}/moe/slot_lookup/scatter-max"  # not a matmul: the user's name as it is
    assert hlo_op_names("no metadata here") == {}


def test_an_async_fusion_is_keyed_by_its_kernel_name():
    """XLA names the kernel of an async fusion (a host-memory read of the miss loop) after the called
    computation: ``wrapped_dynamic-slice_computation.1`` runs as ``wrapped_dynamic_slice_1``, which must
    take the fetch's scope (h2d), not fall to "other"."""
    from experiments.timeline import classify_op
    fetch = f"{BODY}/moe/expert_fetch/while/body/jit(dynamic_index_in_dim)/dynamic_slice"
    text = "\n".join([
        "%wrapped_dynamic-slice_computation.1 (p0: bf16[8,4], p1: s32[]) -> bf16[1,4] {",
        "  %p0 = bf16[8,4]{1,0:S(5)} parameter(0)",
        "  %p1 = s32[] parameter(1)",
        "  ROOT %ds = bf16[1,4]{1,0} dynamic-slice(%p0, %p1, %p1), dynamic_slice_sizes={1,4}",
        "}",
        "",
        "ENTRY %main (a: bf16[8,4], i: s32[]) -> bf16[1,4] {",
        "  %a = bf16[8,4]{1,0:S(5)} parameter(0)",
        "  %i = s32[] parameter(1)",
        f'  %dynamic-slice-start.2 = ((bf16[8,4]{{1,0:S(5)}}, s32[]), bf16[1,4]{{1,0}}, u32[]) fusion-start(%a, %i), '
        f'kind=kLoop, calls=%wrapped_dynamic-slice_computation.1, metadata={{op_name="{fetch}"}}',
        f'  ROOT %dynamic-slice-done.2 = bf16[1,4]{{1,0}} fusion-done(%dynamic-slice-start.2), '
        f'metadata={{op_name="{fetch}"}}',
        "}"])
    names = hlo_op_names(text)
    assert names["wrapped_dynamic_slice_1"] == fetch
    assert classify_op("wrapped_dynamic_slice_1", names["wrapped_dynamic_slice_1"]) == "h2d_copy"


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


GPU_TRACE = [
    _meta(1, "/device:GPU:0"), _meta(2, "/host:CPU"), _meta(1, "Stream #13(Compute)", 10),
    _meta(1, "Stream #14(MemcpyH2D)", 11), _meta(1, "XLA Ops", 12),
    _x(2, 1, "profile_step#0", 0, 1000), _x(2, 1, "profile_step#1", 1000, 1000),
    # step 0: norm, attention, an idle 100 us, the MoE kernel with a copy overlapping its last 50 us
    _x(1, 10, "fusion_1", 100, 100, hlo_op="fusion.1", hlo_module="jit__forward_step"),
    _x(1, 10, "decode_attention", 200, 200, hlo_op="custom-call.2", hlo_module="jit__forward_step"),
    _x(1, 10, "moe_decode_gate_up", 500, 100),  # no hlo_op (e.g. inside a command buffer): by its name
    _x(1, 11, "MemcpyH2D", 550, 100),
    _x(1, 12, "fusion_1", 100, 500, hlo_op="fusion.1"),  # a derived row repeating the kernels: left out
    # step 1: the loop counter, the predicate copy, the router matmul; another program's kernel
    _x(1, 10, "loop_add_fusion", 1100, 50, hlo_op="loop_add_fusion", hlo_module="jit__forward_step"),
    _x(1, 11, "MemcpyD2H", 1150, 10),
    _x(1, 10, "nvjet_sm90_gemm", 1160, 40, hlo_op="custom-call.7", hlo_module="jit__forward_step"),
    _x(1, 10, "fusion_1", 1200, 30, hlo_op="fusion.1", hlo_module="jit__next_token"),
    _x(1, 10, "fusion_1", 5000, 10, hlo_op="fusion.1"),  # outside every step
]
GPU_NAMES = {"fusion.1": f"{BODY}/attention/norm/mul", "custom-call.2": f"{BODY}/attention/pallas_call",
             "loop_add_fusion": "jit(_forward_step)/while/body/add", "custom-call.7": f"{BODY}/moe/router/dot_general"}


def test_step_breakdown_gpu_trace():
    r = step_breakdown(GPU_TRACE, GPU_NAMES, module="_forward_step")
    assert r["source"] == "gpu" and r["steps"] == 2
    s0, s1 = r["per_step"]
    assert (s0["span_s"], s0["busy_s"], s0["gap_s"]) == pytest.approx((550e-6, 450e-6, 100e-6))
    assert (s0["idle_intervals"], s0["idle_max_s"], s0["window_s"], s0["events"]) == (1, pytest.approx(100e-6),
                                                                                      pytest.approx(1e-3), 4)
    assert (s1["span_s"], s1["busy_s"], s1["gap_s"], s1["events"]) == pytest.approx((100e-6, 100e-6, 0.0, 3))
    cats = r["categories"]
    assert set(cats) == set(CATEGORIES)
    want = {"norm": 50, "attention": 100, "experts": 37.5, "h2d_copy": 37.5, "loop": 30, "router": 20}  # us per step
    for c in CATEGORIES:
        assert cats[c]["s"] == pytest.approx(want.get(c, 0) * 1e-6), c
        assert cats[c]["fraction"] == pytest.approx(cats[c]["s"] / 325e-6)
    # the overlap is split; the summed durations are not
    assert cats["experts"]["kernel_s"] == pytest.approx(50e-6) and cats["h2d_copy"]["count"] == 0.5
    assert sum(c["s"] for c in cats.values()) == pytest.approx(r["busy_s"]) == pytest.approx(275e-6)
    assert r["span_s"] == pytest.approx(r["busy_s"] + r["gap_s"]) and r["gap_fraction"] == pytest.approx(50 / 325)
    assert r["top_ops"]["norm"] == {"fusion_1": pytest.approx(50e-6)}
    # the MoE kernel and the two copies had no HLO name (100 + 100 + 10 us over two steps)
    assert r["unnamed_kernel_s"] == pytest.approx(105e-6) and r["unnamed_count"] == 1.5
    # without the module filter the other program's kernel (named like a step kernel) counts as norm
    assert step_breakdown(GPU_TRACE, GPU_NAMES)["categories"]["norm"]["s"] == pytest.approx(65e-6)


def test_step_breakdown_host_trace_without_windows():
    """The CPU backend: host events that run one HLO instruction each, on several threads; while
    containers and "end:" markers left out; no annotations: the whole trace is one step."""
    events = [_meta(1, "/host:CPU"),
              _x(1, 2, "while.2", 10, 300, hlo_op="while.2", hlo_module="jit__forward_step"),
              _x(1, 2, "dot.39", 20, 100, hlo_op="dot.39", hlo_module="jit__forward_step"),
              _x(1, 2, "end: dot.39", 119, 1),
              _x(1, 3, "wrapped_scatter", 50, 100, hlo_op="wrapped_scatter", hlo_module="jit__forward_step"),
              {"ph": "X", "pid": 1, "tid": 2, "name": "ThunkExecutor::Execute", "ts": 0, "dur": 400}]
    r = step_breakdown(events, hlo_op_names(HLO))
    assert r["source"] == "host" and r["steps"] == 1
    assert r["span_s"] == pytest.approx(130e-6) and r["gap_s"] == pytest.approx(0.0)
    assert r["categories"]["attention"]["s"] == pytest.approx(65e-6)
    assert r["categories"]["slot_table"]["s"] == pytest.approx(65e-6)
    with pytest.raises(ValueError, match="no device event"):
        step_breakdown([_meta(1, "/host:CPU")])


def test_targets_same_run_ratios():
    """profile_step.targets: resident step / floor per batch, and the cached step / (resident step +
    the cached step's H2D bytes / B_P) where both runs of a batch finished (a failed run is skipped)."""
    from experiments.timeline import targets

    def row(run, batch, step_s, ratio=None, h2d=0):
        return {"run": run, "batch": batch, "variant": "decode", "profile": {}, "step_s": {"median": step_s},
                "ratio_to_floor": ratio, "bytes": {"h2d_link": h2d}}

    rows = [row("cached_decode", 1, 9.46e-3, 4.1, h2d=15.5e6), row("resident_decode", 1, 7.48e-3, 3.15),
            row("resident_decode", 4, 12.6e-3, 2.25), {"run": "cached_decode", "batch": 4, "error": "OOM"}]
    got = targets(rows, bp_gbps=51.7)
    assert set(got) == {"resident_b1_over_floor", "cached_b1_over_resident_plus_misses", "resident_b4_over_floor"}
    assert got["resident_b1_over_floor"] == 3.15 and got["resident_b4_over_floor"] == 2.25
    assert got["cached_b1_over_resident_plus_misses"] == pytest.approx(9.46e-3 / (7.48e-3 + 15.5e6 / 51.7e9))
    assert targets([], 51.7) == {}


def test_targets_per_timed_step_misses():
    """With the timed steps' own misses recorded, each step is held against its own bound and the
    median of those ratios is the target (a 31 ms step that copied 1 GB is near its bound, not 3x
    off it as against the traced steps' few misses)."""
    from experiments.timeline import targets

    res = {"run": "resident_decode", "batch": 1, "variant": "decode", "profile": {}, "step_s": {"median": 7e-3},
           "ratio_to_floor": 3.0, "bytes": {"h2d_link": 0}}
    steps = [10e-3, 31e-3, 32e-3]
    h2d = [0, 1.0e9, 1.1e9]
    cached = {"run": "cached_decode", "batch": 1, "variant": "decode", "profile": {}, "step_s": {"median": 31e-3},
              "bytes": {"h2d_link": 1e6}, "timed_steps": {"s": steps, "h2d_bytes": h2d}}
    got = targets([res, cached], bp_gbps=50.0)
    want = sorted(t / (7e-3 + b / 50e9) for t, b in zip(steps, h2d))
    assert got["cached_b1_over_resident_plus_misses"] == pytest.approx(want[1])
    assert got["cached_b1_over_resident_plus_misses_p10_p90"][0] == pytest.approx(want[0] + 0.2 * (want[1] - want[0]))
    assert got["cached_b1_over_resident_plus_misses"] < 1.2  # against the traced steps' 1 MB it would be 4.4
    # the steps that copied: 1 GB in 24 ms, 1.1 GB in 25 ms beyond the resident 7 ms (the step without misses
    # does not count)
    assert got["cached_b1_misses_in_step_over_B_P"] == pytest.approx((1.0e9 / 24e-3 + 1.1e9 / 25e-3) / 2 / 50e9)


def test_targets_timed_steps_edge_cases():
    """No timed steps: the traced steps' misses (as rows written before ``timed_steps``); unequal
    lists of step times and H2D bytes: a clear error, not a silently shorter median."""
    from experiments.timeline import targets

    res = {"run": "resident_decode", "batch": 1, "variant": "decode", "profile": {}, "step_s": {"median": 7e-3},
           "ratio_to_floor": 3.0, "bytes": {"h2d_link": 0}}
    cached = {"run": "cached_decode", "batch": 1, "variant": "decode", "profile": {}, "step_s": {"median": 9e-3},
              "bytes": {"h2d_link": 1e8}, "timed_steps": {"s": [], "h2d_bytes": []}}
    got = targets([res, cached], bp_gbps=50.0)
    assert got["cached_b1_over_resident_plus_misses"] == pytest.approx(9e-3 / (7e-3 + 1e8 / 50e9))
    cached["timed_steps"] = {"s": [9e-3, 9e-3], "h2d_bytes": [0]}
    with pytest.raises(ValueError, match="2 timed steps but 1 H2D byte counts"):
        targets([res, cached], bp_gbps=50.0)
