"""The cached decode's prefetch (``EngineConfig.prefetch_guesses``, ``ftjax.experts.prefetch``): a layer's guessed
experts copied before its token mixer never change the math, the guesses are found cached by the layer's lookup, and
the stats count every copy. On the CPU the copies run in the step's stream; on a GPU with the slot-copy kernel
(``pytest --backend=default -n 0 tests/test_prefetch.py``) on the kernel's own stream, joined before the lookup."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_fixture
from ftjax import Engine, memory
from ftjax.config import EngineConfig, MissPolicyConfig
from ftjax.experts import offload, prefetch
from ftjax.experts.state import ExpertBanks, init_expert_state
from ftjax.seams import LayerRouting

STEPS = 24


def _decode(model, prompt, **kw):
    engine = Engine(model, EngineConfig(max_seq_len=128, **kw))
    return engine.generate([prompt], max_new_tokens=STEPS, keep_logits=True), engine


@pytest.mark.parametrize("name, guesses", [("qwen3_moe_fp32", 2), ("qwen3_5_moe_fp32", 2)])
def test_prefetch_keeps_the_logits_bit_identical(name, guesses):
    """The smallest cache (S = E, where the guesses evict what the layer before used): the same greedy tokens and
    logits as resident; every decode copy counted in bytes_h2d; the guesses change what is copied (wrong guesses
    are extra misses; right ones are copied before the lookup, so no more hits are counted than without them)."""
    model, exp = load_fixture(name)
    prompt = exp["short_prompt_ids"].tolist()
    e = model.cfg.num_experts
    want, _ = _decode(model, prompt, experts="resident")
    plain, plain_engine = _decode(model, prompt, experts="cached", num_slots=e)
    got, engine = _decode(model, prompt, experts="cached", num_slots=e, prefetch_guesses=guesses)
    assert got.generated_ids == want.generated_ids
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    m, m0 = engine.expert_cache_metrics()["decode"], plain_engine.expert_cache_metrics()["decode"]
    assert m["bytes_h2d"] == m["misses"] * model.expert_bytes > 0
    assert m["misses"] > m0["misses"] and m["hits"] <= m0["hits"], (m, m0)


def _tiny_banks(layers=2, e=4, d=8, f=4):
    rng = np.random.default_rng(0)
    gu = rng.standard_normal((layers * e, d, 2 * f)).astype(np.float32)
    dn = rng.standard_normal((layers * e, f, d)).astype(np.float32)
    return ExpertBanks(memory.to_host(gu), memory.to_host(dn)), gu, dn


def test_a_layer_finds_its_guesses_cached_and_counts_every_copy():
    """Layer 1 guesses experts {0, 2}; the router then picks {2, 3}: 2 was copied by the prefetch (a hit of the
    lookup, but counted as a miss: copied for this layer), 0 was a wrong guess (a copy counted as a miss), 3 is
    copied by the lookup. The pool holds the banks' rows where the table says."""
    banks, gu, dn = _tiny_banks()
    state = init_expert_state("cached", 2, 4, 6, banks, jnp.float32)
    fn = offload.make_expert_fn("cached", 4, banks, prefetch=2)
    assert fn.prefetch.guesses == 2 and fn.prefetch.applies((1, 1, 8)) and not fn.prefetch.applies((1, 64, 8))
    layer = jnp.int32(1)
    state = fn.prefetch(state, layer, jnp.array([True, False, True, False]))
    assert isinstance(state.prefetch, prefetch.Pending) and int(state.prefetch.count) == 2
    r = LayerRouting(jnp.ones((1, 8), jnp.float32), jnp.array([[2, 3]], jnp.int32), jnp.full((1, 2), 0.5),
                     jnp.array([True]))
    y, state, stats = fn(state, layer, r)
    assert state.prefetch is None
    assert (int(stats.hits), int(stats.misses), int(stats.fetched)) == (0, 3, 3)
    slot_of = np.asarray(state.table.slot_of)
    for expert in (0, 2, 3):
        flat = 4 + expert
        np.testing.assert_array_equal(np.asarray(state.gate_up[slot_of[flat]]), gu[flat])
        np.testing.assert_array_equal(np.asarray(state.down[slot_of[flat]]), dn[flat])
    # the next step's layer 1 routes {2, 3} again: both cached before the layer began, nothing guessed: two hits
    _, _, stats = fn(state, layer, r)
    assert (int(stats.hits), int(stats.misses)) == (2, 0)


def test_prefetch_outside_the_cached_fetch_policy_is_refused():
    with pytest.raises(ValueError, match=r"prefetch_guesses=2 needs experts 'cached', the fetch miss policy and one "
                                         r"device, got experts 'resident'"):
        EngineConfig(prefetch_guesses=2)
    with pytest.raises(ValueError, match=r"got experts 'cached', miss policy 'cpu'"):
        EngineConfig(experts="cached", num_slots=8, prefetch_guesses=2, miss=MissPolicyConfig("cpu"))
    with pytest.raises(ValueError, match=r"prefetch_guesses must be an integer >= 0, got -1"):
        EngineConfig(prefetch_guesses=-1)
    banks, _, _ = _tiny_banks()
    with pytest.raises(ValueError, match=r"prefetch=2 needs experts mode cached and the fetch miss policy, got "
                                         r"'on_demand'"):
        offload.make_expert_fn("on_demand", 4, banks, prefetch=2)
