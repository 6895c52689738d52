"""The slot-table lookup kernel (ftjax.kernels.slot_lookup) against ``slot_table.lookup_layer``
(``policy="lru"``) in Pallas interpret mode on the CPU: every output and the updated table bit for
bit over random decode sequences with evictions; its wiring into the cached expert mode (same
greedy decode, logits and cache counters as the jnp lookup); its lowering for CUDA.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts import slot_table as st
from ftjax.experts.offload import routed_mask
from ftjax.kernels import slot_lookup as sl
from ftjax.kernels.registry import KernelConfig

NAMES = ("slot_of", "id_of_slot", "last_use", "slot_of_expert", "miss_experts", "miss_slots", "evicted_ids",
         "n_miss", "n_hit", "flat_miss", "pair_slots")


def _reference(table, layer, ids, valid, e):
    ref = st.lookup_layer(table, layer, routed_mask(ids, valid, e), e, "lru")
    flat = jnp.where(ref.miss_experts >= 0, layer * e + ref.miss_experts, -1)  # what the cached layer fetches
    return ref, (ref.table.slot_of, ref.table.id_of_slot, ref.table.last_use, ref.slot_of_expert, ref.miss_experts,
                 ref.miss_slots, ref.evicted_ids, ref.n_miss, ref.n_hit, flat, ref.slot_of_expert[ids])


@pytest.mark.parametrize("layers,e,s,n,k", [(3, 16, 37, 2, 4), (2, 8, 8, 1, 2), (6, 16, 64, 3, 5), (3, 32, 40, 1, 8)])
def test_lookup_matches_lookup_layer_over_a_random_decode(layers, e, s, n, k):
    """60 lookups of random layers and routings (some padding tokens, repeated experts) from an
    empty table: free slots fill first, then LRU evictions, including experts of the layer itself."""
    rng = np.random.default_rng(e * s + n)
    table = st.init_slot_table(layers, e, s)
    misses = evictions = 0
    for step in range(60):
        layer = int(rng.integers(0, layers))
        ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
        valid = jnp.asarray(rng.random(n) < 0.85)
        ref, want = _reference(table, layer, ids, valid, e)
        got = sl.lookup_lru(ids, valid, table.slot_of, table.id_of_slot, table.last_use, table.clock,
                            jnp.int32(layer), num_experts=e, interpret=True)
        assert len(got) == len(want) == len(NAMES)
        for name, a, b in zip(NAMES, got, want):
            assert a.dtype == jnp.int32 and a.shape == b.shape, name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {step}: {name}")
        misses += int(ref.n_miss)
        evictions += int(jnp.sum(ref.evicted_ids >= 0))
        table = ref.table
    assert misses > s and evictions > 0  # the sequence exercised fills and evictions


def test_supported_and_errors():
    assert sl.supported(128, 1975, 8) and sl.supported(16, 16, 15)
    assert not sl.supported(128, 1975, 128)  # a prefill-sized layer keeps the jnp path
    assert not sl.supported(12, 100, 4)  # E not a power of two
    assert not sl.supported(16, 8, 4)  # fewer slots than experts
    assert not sl.supported(16, sl.MAX_SLOTS + 1, 4)
    t = st.init_slot_table(2, 16, 20)
    with pytest.raises(ValueError, match="slot_lookup: unsupported sizes"):
        sl.lookup_lru(jnp.zeros((4, 4), jnp.int32), jnp.ones(4, bool), t.slot_of, t.id_of_slot, t.last_use, t.clock,
                      jnp.int32(0), num_experts=16, interpret=True)  # 16 pairs: not fewer than E


def _generate(kernels, slots=20):
    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset

    cfg = dataclasses.replace(preset("tiny"), num_layers=3)
    eng = Engine(random_model(cfg, "float32"), EngineConfig("cached", num_slots=slots, max_seq_len=64, prefill_chunk=16,
                                                            kernels=KernelConfig(use=kernels)))
    return eng.generate([list(range(1, 20))], max_new_tokens=6, keep_logits=True)


def test_cached_decode_with_the_kernel_is_the_jnp_lookups(monkeypatch):
    """A tiny model's cached greedy decode (20 slots for 3 x 16 experts: misses and evictions every
    step) with ``KernelConfig(use="slot_lookup")``: the decode steps' lookups run in the kernel (the
    prefill's 19 tokens route more pairs than E and keep the jnp path); ids, logits and the expert
    cache's counters equal the jnp lookup's."""
    from ftjax.runtime import programs

    ref = _generate("xla")
    programs.clear()  # the spy sees only the calls of a fresh trace
    calls = []
    real = sl.lookup_lru

    def spy(ids, valid, *args, **kw):
        calls.append(ids.shape)
        return real(ids, valid, *args, **kw)

    monkeypatch.setattr(sl, "lookup_lru", spy)
    got = _generate("slot_lookup")
    assert calls and set(calls) == {(1, 4)}  # decode layers: one token, top-4
    assert got.generated_ids == ref.generated_ids
    np.testing.assert_array_equal(got.step_logits, ref.step_logits)
    assert got.expert_cache == ref.expert_cache
    assert ref.expert_cache["misses"] > 0


def test_slot_lookup_lowers_for_cuda_with_the_table_aliased():
    """qwen3-30b-a3b at 24 GB (48 x 128 experts, 1975 slots), batch 1: one Triton call whose outputs
    alias the three table arrays."""
    from test_kernels import _lower_cuda

    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    txt = _lower_cuda(lambda ids, v, so, io, lu, c, l: sl.lookup_lru(ids, v, so, io, lu, c, l, num_experts=128),
                      sd((1, 8), i32), sd((1,), jnp.bool_), sd((6144,), i32), sd((1975,), i32), sd((1975,), i32),
                      sd((), i32), sd((), i32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert "output_operand_aliases" in txt
