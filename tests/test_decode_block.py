"""Decode blocks (``EngineConfig.decode_block``, ``ftjax.runtime.step.decode_block``): several decode steps in
one program give what the same steps one program each give."""

import numpy as np
import pytest

from ftjax.config import EngineConfig
from ftjax.runtime.engine import Engine
from tests.conftest import load_fixture


def test_blocks_match_single_steps_through_eos_sampling_and_misses():
    """Blocks of 4 over 10 decode steps (two whole blocks and one cut short) against one program per step, on the
    cached engine (its slot table moves every step) with two rows, top-p sampling and EOS ids that stop one row
    by the end of the first block and the other by the second's: the same tokens, stop reasons, logits, routing and
    expert-cache counters."""
    model, _ = load_fixture("qwen3_moe_bf16")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    kw = dict(temperature=0.8, top_p=0.9, seed=3, keep_logits=True, trace_routing=True)
    e = model.cfg.num_experts

    def run(block, eos_ids=()):
        engine = Engine(model, EngineConfig("cached", num_slots=e + 2, batch=2, max_seq_len=64, decode_block=block))
        res = engine.generate(prompts, 11, eos_ids=eos_ids, **kw)
        return res, engine.expert_cache_metrics()

    free, _ = run(1)
    assert [len(g) for g in free.generated_ids] == [11, 11]
    eos = [free.generated_ids[0][3], free.generated_ids[1][6]]  # row 0 stops by block 1's end, row 1 by block 2's
    (one, m1), (four, m4) = run(1, eos), run(4, eos)
    assert one.stop_reasons == ["eos", "eos"] and max(len(g) for g in one.generated_ids) < 11
    assert four.generated_ids == one.generated_ids and four.stop_reasons == one.stop_reasons
    np.testing.assert_array_equal(four.step_logits, one.step_logits)
    assert len(four.routing) == len(one.routing)
    for a, b in zip(four.routing, one.routing):
        np.testing.assert_array_equal(a, b)
    for k in ("hits", "misses", "bytes_h2d", "fetched"):
        assert m4[k] == m1[k], k
    assert m1["misses"] > 0


def test_decode_block_checked():
    with pytest.raises(ValueError, match="decode_block must be an integer >= 1, got 0"):
        EngineConfig(decode_block=0)


def test_fixed_trip_loop_gives_the_dynamic_loops_block_bit_for_bit():
    """``KernelConfig.decode_loop`` "fixed" (every block runs ``decode_block`` iterations, those past the limit or
    after every row stopped idle) against "dynamic" (the loop ends there), on the hybrid fixture (Gated DeltaNet
    state carried from step to step) cached under LFRU (whose decay reads the table's clock) with misses: 10 decode
    steps in blocks of 4 (a last block of 2), EOS stopping one row in block 1 and the other in block 2. The same
    tokens, logits, routing and counters, and what a later generate starts from: the same Gated DeltaNet states,
    expert state (pools, slot table with its clock, whose ticks LFRU's decay reads) and K/V at every position
    written; and the compiled fixed block has the trip count XLA knows."""
    import jax

    from ftjax.kernels.registry import KernelConfig
    from ftjax.runtime import programs
    model, _ = load_fixture("qwen3_5_moe_bf16", "bfloat16")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    kw = dict(temperature=0.8, top_p=0.9, seed=3, keep_logits=True, trace_routing=True)
    e = model.cfg.num_experts

    def run(loop, eos_ids=()):
        engine = Engine(model, EngineConfig("cached", num_slots=e + 2, cache_policy="lfru", batch=2, max_seq_len=64,
                                            decode_block=4, kernels=KernelConfig(decode_loop=loop)))
        first = engine.generate(prompts, 11, eos_ids=eos_ids, **kw)
        return first, engine

    free, _ = run("dynamic", (-1, -1))  # stop ids no token matches, as many as below: the same programs
    eos = [free.generated_ids[0][2], free.generated_ids[1][6]]
    (dyn, ed), (fix, ef) = run("dynamic", eos), run("fixed", eos)
    assert dyn.stop_reasons == ["eos", "eos"] and 2 < len(dyn.generated_ids[0]) < len(dyn.generated_ids[1]) < 11
    for row, ids in enumerate(dyn.generated_ids):  # K/V at the positions the row wrote (its last token's is not)
        n = len(prompts[row]) + len(ids) - 1
        np.testing.assert_array_equal(np.asarray(ef.cache.k)[:, row, :n], np.asarray(ed.cache.k)[:, row, :n])
    assert fix.generated_ids == dyn.generated_ids and fix.stop_reasons == dyn.stop_reasons
    np.testing.assert_array_equal(fix.step_logits, dyn.step_logits)
    for x, y in zip(fix.routing, dyn.routing, strict=True):
        np.testing.assert_array_equal(x, y)
    md, mf = ed.expert_cache_metrics(), ef.expert_cache_metrics()
    for k in ("hits", "misses", "bytes_h2d", "fetched", "resident_per_layer"):
        assert mf[k] == md[k], k
    assert md["misses"] > 0
    for name in ("conv", "rec"):
        np.testing.assert_array_equal(np.asarray(getattr(ef.cache, name)), np.asarray(getattr(ed.cache, name)))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ef.state), jax.tree.leaves(ed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    # what the fixed loop is for: XLA knows the block loop's trip count (no predicate read back each step)
    trips = {}
    for _, opts, _, exe in programs.compiled_programs("decode_block"):
        entry = exe.as_text().split("\nENTRY ", 1)[1]
        trips[opts["fixed"]] = [line for line in entry.splitlines() if " while(" in line]
    assert len(trips[True]) == len(trips[False]) == 1
    assert '"known_trip_count":{"n":"4"}' in trips[True][0] and "known_trip_count" not in trips[False][0]


def test_fixed_trip_loop_keeps_the_on_demand_table():
    """on_demand resets its slot table at each layer call: an idle iteration of the fixed loop must not, so the
    experts a layer holds after a generate whose last block is short are the dynamic loop's."""
    from ftjax.kernels.registry import KernelConfig
    model, _ = load_fixture("qwen3_moe_bf16")
    e = model.cfg.num_experts
    held = {}
    for loop in ("dynamic", "fixed"):
        engine = Engine(model, EngineConfig("on_demand", num_slots=e, max_seq_len=32, decode_block=4,
                                            kernels=KernelConfig(decode_loop=loop)))
        engine.generate([[1, 2, 3, 4, 5]], 6)  # 5 decode steps: a block of 4, then one of 1 (3 idle iterations)
        held[loop] = engine.expert_cache_metrics()["resident_per_layer"]
    assert held["fixed"] == held["dynamic"] and sum(held["dynamic"]) > 0


def test_decode_loop_auto_is_fixed_only_for_full_blocks_without_eos_ids_on_a_gpu():
    """``KernelConfig.decode_loop`` "auto" runs the fixed loop only on a GPU (where a loop's predicate is read back
    to the host) and only where no iteration would idle: a full block of a generate without EOS ids (a shorter
    last block, or an EOS, would spend the rest of the block); on the CPU it is dynamic. The engine compiles
    exactly the forms a generate's blocks take; unknown values are refused."""
    from ftjax.kernels import registry
    from ftjax.kernels.registry import KernelConfig
    from ftjax.runtime.step import fixed_loop
    assert KernelConfig().decode_loop == "auto"
    gpu = dict(platform="gpu")
    assert fixed_loop("auto", has_eos=False, full=True, **gpu)
    assert not fixed_loop("auto", has_eos=False, full=False, **gpu)
    assert not fixed_loop("auto", has_eos=True, full=True, **gpu)
    assert not fixed_loop("auto", has_eos=False, full=True, platform="cpu")
    with registry.lowering_for("cpu"):  # the platform when none is given: the backend choices are made for
        assert not fixed_loop("auto", has_eos=False, full=True)
    assert fixed_loop("fixed", has_eos=True, full=False) and not fixed_loop("dynamic", has_eos=False, full=True, **gpu)
    model, _ = load_fixture("qwen3_moe_bf16")
    engine = Engine(model, EngineConfig("resident", max_seq_len=64, decode_block=4))
    with registry.lowering_for("cpu"):
        assert engine._block_loops(8, has_eos=False) == engine._block_loops(10, has_eos=False) == {False}
    with registry.lowering_for("gpu"):  # the choices a GPU would make
        assert engine._block_loops(8, has_eos=False) == {True} and engine._block_loops(3, has_eos=False) == {False}
        assert engine._block_loops(10, has_eos=False) == {True, False}
        assert engine._block_loops(8, has_eos=True) == {False}
    with pytest.raises(ValueError, match="unknown decode_loop 'fast'"):
        fixed_loop("fast", has_eos=False)
    with pytest.raises(ValueError, match="decode_loop"):
        KernelConfig(decode_loop="fast")
