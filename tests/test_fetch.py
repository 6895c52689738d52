"""``fetch_experts`` copies misses in groups (``group`` copies per loop iteration, issue 33 item 2): whatever the
group, it writes exactly the pools that the loop of one copy per iteration wrote, for random flat ids and slots,
no miss, every miss, scales beside the weights, and a device's [L, El, ...] share of the banks (expert
parallelism)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax import memory
from ftjax.experts import fetch
from ftjax.experts.state import ExpertBanks, ExpertState

L, E, S, D, F = 3, 8, 10, 4, 3  # layers, experts per layer, slots, hidden, expert ffn
M = E  # misses a layer can have


def _loop_reference(banks: ExpertBanks, state: ExpertState, flat_ids, slots, count) -> ExpertState:
    """The fetch as it was before groups: one copy per iteration of a ``fori_loop``."""
    src = fetch._bank_arrays(banks)

    def one(i, pools):
        fid, slot = flat_ids[i], slots[i]
        return tuple(jax.lax.dynamic_update_index_in_dim(p, fetch._bank_row(b, p, fid).astype(p.dtype), slot, 0)
                     for b, p in zip(src, pools))

    return fetch._with_pools(state, jax.lax.fori_loop(0, count, one, fetch._pool_arrays(state)))


def _setup(split: bool, scales: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    lead = (L, E) if split else (L * E,)
    arrays = [rng.standard_normal(lead + shape).astype(np.float32) for shape in ((D, 2 * F), (F, D))]
    sc = tuple(rng.standard_normal(lead + (2, 1)).astype(np.float32) for _ in range(2)) if scales else None
    banks = ExpertBanks(memory.to_host(arrays[0]), memory.to_host(arrays[1]),
                        None if sc is None else tuple(memory.to_host(s) for s in sc), "int8" if scales else "dense")
    pools = [jnp.asarray(rng.standard_normal((S,) + a.shape[len(lead):]).astype(np.float32)) for a in arrays]
    pool_sc = None if sc is None else tuple(jnp.asarray(rng.standard_normal((S, 2, 1)).astype(np.float32))
                                            for _ in sc)
    return banks, ExpertState(pools[0], pools[1], None, scales=pool_sc, fmt=banks.fmt), rng


def _cases(rng, n: int = 12):
    """(flat ids [M], slots [M], count): distinct ids of one layer and distinct slots, the tail past count junk;
    counts 0 and M always among them."""
    out = []
    for k in range(n):
        layer = int(rng.integers(L))
        ids = layer * E + rng.permutation(E)[:M]
        sl = rng.permutation(S)[:M]
        count = (0, M)[k] if k < 2 else int(rng.integers(0, M + 1))
        junk = rng.integers(-5, L * E + 5, M)
        ids = np.where(np.arange(M) < count, ids, junk).astype(np.int32)
        sl = np.where(np.arange(M) < count, sl, junk % S).astype(np.int32)
        out.append((ids, sl, np.int32(count)))
    return out


def _leaves(state: ExpertState):
    return [np.asarray(x) for x in (state.gate_up, state.down, *(state.scales or ()))]


@pytest.mark.parametrize("split,scales", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("group", [1, 3, 8, 64])
def test_grouped_fetch_writes_the_pools_of_the_one_copy_loop(group, split, scales):
    banks, state, rng = _setup(split, scales, seed=group)
    want_fn = jax.jit(_loop_reference)
    got_fn = jax.jit(lambda b, s, i, sl, c: fetch.fetch_experts(b, s, i, sl, c, group=group))
    for ids, sl, count in _cases(rng):
        want = want_fn(banks, state, ids, sl, count)
        got = got_fn(banks, state, ids, sl, count)
        for w, g in zip(_leaves(want), _leaves(got)):
            np.testing.assert_array_equal(g, w)
        if count:  # the copies landed: slot sl[0] holds expert ids[0]
            row = np.asarray(banks.gate_up).reshape((L * E, D, 2 * F))[ids[0]]
            np.testing.assert_array_equal(np.asarray(got.gate_up)[sl[0]], row)
        else:
            for w, g in zip(_leaves(state), _leaves(got)):
                np.testing.assert_array_equal(g, w)


def test_a_repeated_slot_keeps_the_later_copy_as_the_loop_does():
    banks, state, _ = _setup(False, False)
    ids = np.arange(M, dtype=np.int32)
    sl = np.full((M,), 2, np.int32)
    for group in (1, 4, 8):
        got = fetch.fetch_experts(banks, state, ids, sl, np.int32(5), group=group)
        np.testing.assert_array_equal(np.asarray(got.gate_up)[2], np.asarray(banks.gate_up)[4])


def test_group_below_one_is_refused():
    banks, state, _ = _setup(False, False)
    with pytest.raises(ValueError, match="group must be >= 1, got 0"):
        fetch.fetch_experts(banks, state, np.zeros((M,), np.int32), np.zeros((M,), np.int32), np.int32(1), group=0)


# ---- in the engine (KernelConfig.fetch_group; the CPU's default is 1) -------------------------------------------
def _engine_run(model, mode: str, slots, group, devices: int = 1, steps: int = 12, prefill: str = "on_demand"):
    from ftjax import Engine
    from ftjax.config import EngineConfig
    from ftjax.kernels.registry import KernelConfig
    engine = Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=64, prefill=prefill, devices=devices,
                                        kernels=KernelConfig(fetch_group=group)))
    res = engine.generate([list(range(3, 23))], max_new_tokens=steps, keep_logits=True)
    keys = [dict(k[1])["opts"] for k in engine.programs.keys if k[0] == "forward_step"]
    assert keys and all(getattr(o, "step", o).kernels.fetch_group == group for o in keys)
    return res, engine


@pytest.fixture(scope="module")
def tiny_model():
    from ftjax.checkpoint import random_model
    from ftjax.config import preset
    return random_model(preset("tiny"), "float32", seed=0)


@pytest.mark.parametrize("mode", ["cached", pytest.param("on_demand", marks=pytest.mark.slow)])
def test_grouped_fetch_in_the_engine_is_bit_identical_to_resident(tiny_model, mode):
    """Prefill through the slot table (every routed expert of a 20-token prompt) and decode at the smallest cache
    (S = E: every step evicts and refetches), misses copied up to 8 per iteration: the resident logits exactly."""
    e = tiny_model.cfg.num_experts
    want, _ = _engine_run(tiny_model, "resident", None, None)
    got, engine = _engine_run(tiny_model, mode, e, 8)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert got.generated_ids == want.generated_ids
    assert engine.expert_cache_metrics()["decode"]["misses"] > 0


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS, tests/conftest.py)")
def test_grouped_fetch_under_expert_parallelism_is_the_one_copy_loop(tiny_model):
    """Two devices, each copying its own misses from its [L, E/2, ...] share of the banks: the logits of a fetch of
    up to 3 copies per iteration are those of one copy per iteration, bit for bit."""
    e = tiny_model.cfg.num_experts
    want, _ = _engine_run(tiny_model, "cached", e, 1, devices=2)
    got, _ = _engine_run(tiny_model, "cached", e, 3, devices=2)
    np.testing.assert_array_equal(got.step_logits, want.step_logits)
    assert got.generated_ids == want.generated_ids
