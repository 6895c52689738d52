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
