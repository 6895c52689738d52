"""The registry of expert cache policies (ftjax.experts.policies): discovery, lookups and errors, and every
registered policy end to end: a cached engine with a cache smaller than one step's experts gives the
resident engine's logits bit for bit (a policy only picks which slots to reuse, never what is computed)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from ftjax.checkpoint import random_model
from ftjax.config import EngineConfig, preset
from ftjax import Engine
from ftjax.experts import policies, slot_table

PROMPT = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46, 264, 33]
STEPS = 6


def test_registry_is_the_package_modules():
    """One module per policy, named as the policy; POLICIES (read by EngineConfig, the CLI, the studies)
    is the registry; each description is one line and each policy a hashable frozen dataclass."""
    folder = os.path.dirname(policies.__file__)
    modules = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f not in ("__init__.py", "base.py"))
    assert list(policies.names()) == modules and {"lru", "lookahead", "lfru"} <= set(modules)
    assert slot_table.POLICIES == policies.names() == tuple(policies.REGISTRY)
    for name in policies.names():
        p = policies.get(name)
        assert isinstance(p, policies.CachePolicy) and p.name == name and type(p) is policies.policy_class(name)
        assert p.description and "\n" not in p.description and f"{name}: {p.description}" in policies.describe()
        assert hash(p) == hash(policies.get(name)) and p == policies.get(name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.x = 1
    assert policies.get("lfru").params() == {"half_life_tokens": slot_table.LFRU_HALF_LIFE_TOKENS}
    assert policies.get("lru").params() == {} and policies.policy_class("lru").param_names() == ()


def test_unknown_names_and_parameters_raise():
    for call in (lambda: policies.get("mru"), lambda: policies.policy_class("mru"), lambda: policies.resolve("mru")):
        with pytest.raises(ValueError, match=r"unknown cache policy 'mru'; expected one of \(") as ei:
            call()
        assert all(repr(n) in str(ei.value) for n in policies.names())
    with pytest.raises(ValueError, match="takes parameters"):
        policies.get("lru", half_life_tokens=4.0)
    with pytest.raises(ValueError, match="half_life_tokens must be > 0"):
        policies.get("lfru", half_life_tokens=-1.0)
    assert policies.resolve("lru", half_life_tokens=4.0) == policies.get("lru")  # offered, not taken
    assert policies.resolve(policies.get("lfru", half_life_tokens=2.0)).half_life_tokens == 2.0
    with pytest.raises(ValueError, match="cache policy"):
        EngineConfig("cached", num_slots=16, cache_policy="mru")


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset with random float32 weights, and the resident engine's greedy run of PROMPT."""
    model = random_model(preset("tiny"), "float32")
    want = Engine(model, EngineConfig("resident", max_seq_len=64)).generate([PROMPT], STEPS, keep_logits=True)
    return model, want


@pytest.mark.parametrize("policy", policies.names())
def test_every_policy_is_exact_end_to_end(policy, tiny):
    """S = E slots (tiny: L=4, E=16, top-4: a decode step needs up to 16 of its 64 experts) evicts at every
    step, so each policy's choices matter; the logits must still be the resident ones, bit for bit."""
    model, want = tiny
    e = model.cfg.num_experts
    got = Engine(model, EngineConfig("cached", num_slots=e, max_seq_len=64, cache_policy=policy)).generate(
        [PROMPT], STEPS, keep_logits=True)
    assert got.step_logits.shape == want.step_logits.shape == (STEPS, 1, model.cfg.vocab_size)
    assert np.array_equal(got.step_logits, want.step_logits), policy
    assert got.generated_ids == want.generated_ids
    assert got.expert_cache["misses"] > 0 and got.expert_cache["hits"] + got.expert_cache["misses"] > STEPS * 4
