"""ftjax/experts/parallel_cost.py: the link-time model of whole experts per GPU against every expert split on
its FFN width, checked against brute force and against the arithmetic done by hand at qwen3-30b-a3b."""

from __future__ import annotations

import itertools
import math

import pytest

from ftjax.config import preset
from ftjax.experts import parallel_cost as pc

QWEN = preset("qwen3-30b-a3b")
EXPERT = 9_437_184  # bytes of one bf16 expert: 3 * 2048 * 768 * 2


@pytest.mark.parametrize("misses,experts,devices", [(3, 8, 2), (5, 12, 4), (4, 8, 4), (6, 6, 3), (0, 8, 2)])
def test_busiest_owner_is_brute_force(misses, experts, devices):
    block = experts // devices
    subsets = list(itertools.combinations(range(experts), misses))
    want = sum(max(sum(e // block == d for e in c) for d in range(devices)) for c in subsets) / len(subsets)
    assert pc.busiest_owner(misses, experts, devices) == pytest.approx(want, rel=1e-12)


def test_busiest_owner_values():
    assert pc.busiest_owner(2, 4, 2) == pytest.approx(4 / 3)  # 2 of 6 pairs in one block, 4 split
    assert pc.busiest_owner(7, 128, 1) == 7
    assert pc.busiest_owner(128, 128, 4) == 32
    assert pc.busiest_owner(8, 128, 2) == pytest.approx(5.0589, abs=1e-4)  # 8 misses: 1.58x, not 2x
    with pytest.raises(ValueError, match="divisor"):
        pc.busiest_owner(2, 128, 3)
    with pytest.raises(ValueError, match="misses=9"):
        pc.busiest_owner(9, 8, 2)


def test_busiest_link():
    assert pc.busiest_link("one", 8, 128, 1) == (8.0, 8.0)
    assert pc.busiest_link("expert_balanced", 7, 128, 2) == (4.0, 4.0)
    assert pc.busiest_link("tensor", 8, 128, 4) == (2.0, 8.0)  # a quarter of each expert: 8 copies of 1/4
    with pytest.raises(ValueError, match="unknown strategy"):
        pc.busiest_link("pipeline", 8, 128, 2)
    with pytest.raises(ValueError, match="one device"):
        pc.busiest_link("one", 8, 128, 2)


def test_decode_step_by_hand():
    """Every routed expert misses at batch 1: 8 copies per layer, 48 layers."""
    link = pc.LinkModel()
    per_expert = EXPERT / 52e9 + 2 * 5e-6
    assert QWEN.expert_bytes(2) == EXPERT
    one = pc.decode_step_s("one", QWEN, 1, 1, 1.0)
    assert one == pytest.approx(4.7e-3 + 48 * 8 * per_expert)
    reduce = 15e-6 + 2 * 1 / 2 * 2048 * 2 / 300e9
    tensor = pc.decode_step_s("tensor", QWEN, 2, 1, 1.0, link)
    assert tensor == pytest.approx(4.7e-3 + 48 * (8 * (EXPERT / 2 / 52e9 + 2 * 5e-6) + reduce))
    expert = pc.decode_step_s("expert", QWEN, 2, 1, 1.0, link)
    assert expert == pytest.approx(4.7e-3 + 48 * (pc.busiest_owner(8, 128, 2) * per_expert + reduce))
    balanced = pc.decode_step_s("expert_balanced", QWEN, 2, 1, 1.0, link)
    assert balanced == pytest.approx(4.7e-3 + 48 * (4 * per_expert + reduce))
    assert one / expert == pytest.approx(1.507, abs=1e-3)
    assert one / tensor == pytest.approx(1.774, abs=1e-3)
    assert one / balanced == pytest.approx(1.854, abs=1e-3)
    # no hits missed: only the fixed step
    assert pc.decode_step_s("expert", QWEN, 2, 1, 0.0, link) == pytest.approx(4.7e-3 + 48 * reduce)
    # one device: every split is the one-device model
    for s in ("expert", "expert_balanced", "tensor"):
        assert pc.decode_step_s(s, QWEN, 1, 4, 0.5) == pytest.approx(pc.decode_step_s("one", QWEN, 1, 4, 0.5))


def test_decode_binomial_misses():
    """Half the routed experts miss: the expectation over Binomial(8, 1/2) of the copies."""
    free = pc.LinkModel(copy_s=0.0, allreduce_latency_s=0.0, allreduce_Bps=math.inf, other_decode_s=0.0)
    got = pc.decode_step_s("expert", QWEN, 2, 1, 0.5, free)
    want = 48 * sum(math.comb(8, m) / 256 * pc.busiest_owner(m, 128, 2) for m in range(9)) * EXPERT / 52e9
    assert got == pytest.approx(want)
    assert pc.decode_step_s("tensor", QWEN, 4, 1, 0.5, free) == pytest.approx(48 * 4 * EXPERT / 4 / 52e9)


def test_distinct_routed():
    assert pc.distinct_routed(128, 8, 1) == 8
    assert pc.distinct_routed(128, 8, 4) == 29  # 128 * (1 - (15/16)^4) = 29.1
    assert pc.distinct_routed(32, 4, 4) == 13


def test_prefill_is_link_bound_and_even():
    """8192 tokens: a layer's 128 experts (1.21 GB) over 1 or N links; compute 0.62 Tflop = 1.5 ms."""
    one = pc.prefill_layer_s("one", QWEN, 1, 8192)
    assert one == pytest.approx(128 * EXPERT / 52e9 + 2 * 5e-6)
    for n in (2, 4):
        e, t = pc.prefill_layer_s("expert", QWEN, n, 8192), pc.prefill_layer_s("tensor", QWEN, n, 8192)
        assert e == t == pytest.approx(128 * EXPERT / n / 52e9 + 2 * 5e-6 + 15e-6
                                       + 2 * (n - 1) / n * 8192 * 2048 * 2 / 300e9)
    slow_link = pc.LinkModel(link_Bps=1e15)  # compute-bound: the tensor split divides the compute by N
    flops = 8192 * 8 * 6 * 2048 * 768
    assert pc.prefill_layer_s("tensor", QWEN, 2, 8192, slow_link) < pc.prefill_layer_s("expert", QWEN, 2, 8192,
                                                                                          slow_link)
    assert pc.prefill_layer_s("expert", QWEN, 1, 8192, slow_link) == pytest.approx(flops / 400e12)


def test_predictions_rows():
    rows = pc.predictions(QWEN)
    assert len(rows) == 5 * (1 + 2 * 3)
    by = {(r["scenario"], r["strategy"], r["devices"]): r["speedup"] for r in rows}
    assert by[("decode b=1 miss=1", "expert", 2)] == pytest.approx(1.507, abs=1e-3)
    assert by[("decode b=1 miss=1", "tensor", 2)] == pytest.approx(1.774, abs=1e-3)
    assert by[("prefill 8192", "expert", 2)] == by[("prefill 8192", "tensor", 2)] == pytest.approx(1.978, abs=1e-3)
    for scenario in {r["scenario"] for r in rows if r["scenario"].startswith("decode")}:
        for n in (2, 4):  # balanced links beat owners at equal misses; more devices are faster
            assert by[(scenario, "tensor", n)] > by[(scenario, "expert", n)]
            assert by[(scenario, "expert_balanced", n)] > by[(scenario, "expert", n)]
            assert by[(scenario, "expert", 4)] > by[(scenario, "expert", 2)] > 1.0
    with pytest.raises(ValueError, match="divisor"):
        pc.predictions(QWEN, devices=(3,))
