"""Tests for ftjax.experts.slot_table (global expert slot cache, DESIGN.md 1.1).

Every registered eviction policy (``ftjax.experts.policies.names()``: the tests are parametrized over
the registry, so a new policy module is tested with no edit here) keeps the table's invariants on
random routing streams, and every ``ORDER_IMPLS`` implementation gives it bit-identical lookups. The
policies this file knows (:data:`REF_KEYS`) are also checked call by call against an independent,
plain-Python, dict-based cache with the same policy (hits refresh; misses in ascending expert id take
the non-hit slots in the policy's order, free slots first, ties to the lowest slot index; clock += 1
per call).
"""

from __future__ import annotations

import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftjax.experts import policies, slot_table  # noqa: E402
from ftjax.kernels import registry  # noqa: E402
from ftjax.experts.slot_table import (  # noqa: E402
    LFRU_HALF_LIFE_TOKENS,
    ORDER_IMPLS,
    LayerLookup,
    SlotTable,
    eviction_order,
    forget_slots,
    init_resident_table,
    init_slot_table,
    lookup_layer,
    lookup_layer_no_reuse,
    reset_table,
)

# One compiled program per shape: layer is passed as an int32 array, so it is traced.
_lookup = jax.jit(lookup_layer, static_argnums=(3, 4))
_lookup_hl = jax.jit(lookup_layer, static_argnums=(3, 4, 5))  # half-life given
_lookup_impl = jax.jit(lookup_layer, static_argnames=("num_experts", "policy", "half_life_tokens", "impl"))
_lookup_no_reuse = jax.jit(lookup_layer_no_reuse, static_argnums=3)


def _examples(total: int) -> int:
    """Hypothesis examples per registered policy: ``total`` shared among them (at least 10 each), so the
    time of a test parametrized over the registry grows little with it (compiles are the cost)."""
    return max(10, total // len(policies.names()))

_forget = jax.jit(forget_slots)
_reset = jax.jit(reset_table)


# --------------------------------------------------------------------------------------------
# Independent reference
# --------------------------------------------------------------------------------------------
class RefLRU:
    """Dict-based global cache over (layer, expert) with the documented tie-breaks.

    policy "lru": misses take the least recently used non-hit slots (free first).
    policy "lookahead": free slots first, then the slot whose layer is farthest ahead in the layer
    cycle ((owner - layer) mod L, 0 counting as L), then least recently used, then lowest index.
    policy "lfru": free slots first (lowest index), then the smallest CRF (float64, kept as
    log2 CRF + lambda * last reference), then least recently used, then lowest flat id.
    policy "lfu": free slots first, then the fewest references (an int count), then least recently
    used, then lowest flat id.
    Each flat id's history (CRF, count) survives its eviction; forget / reset clear it.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, policy: str = "lru",
                 half_life_tokens: float = LFRU_HALF_LIFE_TOKENS):
        self.L, self.E, self.S, self.policy = num_layers, num_experts, num_slots, policy
        self.where: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot
        self.holder: dict[int, tuple[int, int]] = {}  # slot -> (layer, expert)
        self.used: dict[int, int] = {}  # slot -> clock of last use (absent: never / free)
        self.clock = 0
        self.lam = 1.0 / (half_life_tokens * num_layers)
        self.crf: dict[int, tuple[float, int]] = {}  # flat id -> (log2 CRF + lam * t_last, t_last)
        self.count: dict[int, int] = {}  # flat id -> references (lfu)

    def lookup(self, layer: int, routed_experts: list[int]):
        routed_experts = sorted(set(routed_experts))
        hits = [e for e in routed_experts if (layer, e) in self.where]
        misses = [e for e in routed_experts if (layer, e) not in self.where]
        hit_slots = {self.where[(layer, e)] for e in hits}
        for s in hit_slots:
            self.used[s] = self.clock
        def distance(s):
            if s not in self.holder:
                return self.L + 1  # free: first
            d = (self.holder[s][0] - layer) % self.L
            return d if d else self.L

        def history_key(history):
            def key(s):
                if s not in self.holder:
                    return (0, 0.0, -1, -1, s)
                fid = self.holder[s][0] * self.E + self.holder[s][1]
                return (1, history(fid), self.used.get(s, -1), fid, s)
            return key

        key = {"lru": lambda s: (self.used.get(s, -1), s),
               "lookahead": lambda s: (-distance(s), self.used.get(s, -1), s),
               "lfru": history_key(lambda fid: self.crf[fid][0]),
               "lfu": history_key(lambda fid: self.count[fid])}[self.policy]
        candidates = sorted((s for s in range(self.S) if s not in hit_slots), key=key)
        miss_slots, evicted = [], []
        for e, s in zip(misses, candidates):
            old = self.holder.get(s)
            evicted.append(-1 if old is None else old[0] * self.E + old[1])
            if old is not None:
                del self.where[old]
            self.holder[s] = (layer, e)
            self.where[(layer, e)] = s
            self.used[s] = self.clock
            miss_slots.append(s)
        assert len(miss_slots) == len(misses), "reference ran out of slots"
        for e in routed_experts:  # LRFU: every reference adds 2^(lam * t) to 2^(lam * t) CRF(t)
            fid = layer * self.E + e
            old = self.crf.get(fid, (-math.inf, -1))[0]
            self.crf[fid] = (float(np.logaddexp2(self.lam * self.clock, old)), self.clock)
            self.count[fid] = self.count.get(fid, 0) + 1
        self.clock += 1
        return dict(
            hits=hits,
            misses=misses,
            miss_slots=miss_slots,
            evicted=evicted,
            slot_of_expert=[self.where.get((layer, e), -1) for e in range(self.E)],
        )

    def forget(self, slots):
        for s in slots:
            if 0 <= s < self.S:
                old = self.holder.pop(s, None)
                if old is not None:
                    del self.where[old]
                    self.crf.pop(old[0] * self.E + old[1], None)
                    self.count.pop(old[0] * self.E + old[1], None)
                self.used.pop(s, None)

    def reset(self):
        self.where.clear()
        self.holder.clear()
        self.used.clear()
        self.crf.clear()
        self.count.clear()

    def history(self):
        """(log2 CRF at the last reference float64 [L*E] (-inf: none; lfu: log2 count), its clock int
        [L*E] (-1))."""
        log2 = np.full(self.L * self.E, -np.inf)
        when = np.full(self.L * self.E, -1, np.int64)
        for fid, (v, t) in self.crf.items():
            log2[fid] = np.log2(self.count[fid]) if self.policy == "lfu" else v - self.lam * t
            when[fid] = t
        return log2, when

    def arrays(self):
        slot_of = np.full(self.L * self.E, -1, np.int32)
        id_of_slot = np.full(self.S, -1, np.int32)
        last_use = np.full(self.S, -1, np.int32)
        for (l, e), s in self.where.items():
            slot_of[l * self.E + e] = s
            id_of_slot[s] = l * self.E + e
        for s, c in self.used.items():
            last_use[s] = c
        return slot_of, id_of_slot, last_use, self.clock


#: The policies RefLRU implements independently, and whether they keep a CRF history in the table.
REF_KEYS = {"lru": False, "lookahead": False, "lfru": True, "lfu": True}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _np_table(t: SlotTable):
    return (
        np.asarray(t.slot_of),
        np.asarray(t.id_of_slot),
        np.asarray(t.last_use),
        int(t.clock),
    )


def assert_table_equals_ref(t: SlotTable, ref: RefLRU):
    slot_of, id_of_slot, last_use, clock = _np_table(t)
    r_slot_of, r_id, r_last, r_clock = ref.arrays()
    np.testing.assert_array_equal(slot_of, r_slot_of, err_msg="slot_of")
    np.testing.assert_array_equal(id_of_slot, r_id, err_msg="id_of_slot")
    np.testing.assert_array_equal(last_use, r_last, err_msg="last_use")
    assert clock == r_clock


def assert_table_invariants(t: SlotTable):
    slot_of, id_of_slot, last_use, _ = _np_table(t)
    for a in (t.slot_of, t.id_of_slot, t.last_use, t.clock):
        assert a.dtype == jnp.int32
    S, LE = id_of_slot.shape[0], slot_of.shape[0]
    assert ((slot_of >= -1) & (slot_of < S)).all()
    assert ((id_of_slot >= -1) & (id_of_slot < LE)).all()
    # mutually inverse
    for fid in np.nonzero(slot_of >= 0)[0]:
        assert id_of_slot[slot_of[fid]] == fid
    for s in np.nonzero(id_of_slot >= 0)[0]:
        assert slot_of[id_of_slot[s]] == s
    assert (slot_of >= 0).sum() == (id_of_slot >= 0).sum()
    # free slots are never "used"
    assert (last_use[id_of_slot < 0] == -1).all()


def check_lookup(out: LayerLookup, before: SlotTable, layer: int, routed: np.ndarray, E: int):
    """Invariants of one lookup_layer call that do not need the reference."""
    t = out.table
    assert_table_invariants(t)
    slot_of_b, _, _, clock_b = _np_table(before)
    slot_of, id_of_slot, last_use, clock = _np_table(t)
    soe = np.asarray(out.slot_of_expert)
    assert soe.dtype == np.int32 and soe.shape == (E,)
    assert clock == clock_b + 1
    routed_ids = np.nonzero(routed)[0]
    base = layer * E
    # every routed expert is resident, slot_of_expert gives its slot, and it is "used now"
    for e in routed_ids:
        assert slot_of[base + e] >= 0
        assert soe[e] == slot_of[base + e]
        assert id_of_slot[soe[e]] == base + e
        assert last_use[soe[e]] == clock_b
    # non-routed: slot if resident else -1
    np.testing.assert_array_equal(soe, slot_of[base : base + E])
    # no two routed experts share a slot
    assert len(set(soe[routed_ids].tolist())) == len(routed_ids)
    # hits were not evicted and did not move
    was_resident = slot_of_b[base : base + E] >= 0
    hit_ids = [e for e in routed_ids if was_resident[e]]
    for e in hit_ids:
        assert soe[e] == slot_of_b[base + e]
    n_hit, n_miss = int(out.n_hit), int(out.n_miss)
    assert n_hit == len(hit_ids)
    assert n_hit + n_miss == int(routed.sum())
    # miss list: ascending expert ids, padded with -1, slots distinct and padded with -1
    me, ms = np.asarray(out.miss_experts), np.asarray(out.miss_slots)
    assert me.shape == ms.shape == (E,)
    assert (me[n_miss:] == -1).all() and (ms[n_miss:] == -1).all()
    assert (np.asarray(out.evicted_ids)[n_miss:] == -1).all()
    assert list(me[:n_miss]) == [e for e in routed_ids if not was_resident[e]]
    assert (np.diff(me[:n_miss]) > 0).all()
    np.testing.assert_array_equal(ms[:n_miss], soe[me[:n_miss]])
    # only miss slots changed owner
    changed = np.nonzero(np.asarray(before.id_of_slot) != id_of_slot)[0]
    assert set(changed.tolist()) <= set(ms[:n_miss].tolist())
    # free slots are taken before anything is evicted (every policy), and then something is
    n_free = int((np.asarray(before.id_of_slot) < 0).sum())
    ev = np.asarray(out.evicted_ids)[:n_miss]
    assert (ev[:n_free] == -1).all() and (ev[n_free:] >= 0).all(), (n_free, ev)


def check_against_ref(out: LayerLookup, r: dict, E: int):
    n_miss = len(r["misses"])
    assert int(out.n_hit) == len(r["hits"])
    assert int(out.n_miss) == n_miss
    np.testing.assert_array_equal(np.asarray(out.slot_of_expert), r["slot_of_expert"])
    np.testing.assert_array_equal(
        np.asarray(out.miss_experts), r["misses"] + [-1] * (E - n_miss)
    )
    np.testing.assert_array_equal(
        np.asarray(out.miss_slots), r["miss_slots"] + [-1] * (E - n_miss)
    )
    np.testing.assert_array_equal(
        np.asarray(out.evicted_ids), r["evicted"] + [-1] * (E - n_miss)
    )


def _mask(bits: int, E: int) -> np.ndarray:
    return np.array([(bits >> e) & 1 for e in range(E)], dtype=bool)


# --------------------------------------------------------------------------------------------
# Property test: random routing streams against the reference
# --------------------------------------------------------------------------------------------
_STREAM_SHAPES = [(1, 2, 2), (2, 3, 3), (2, 4, 8), (3, 5, 9), (4, 8, 19)]


@st.composite
def streams(draw):
    # a few fixed shapes (S = E, S = L*E, in between): each new shape compiles the lookups again, and the
    # compiles, not the examples, are the cost; the routing and the events vary freely
    L, E, S = draw(st.sampled_from(_STREAM_SHAPES))
    steps = draw(st.integers(1, 30))
    full = (1 << E) - 1
    mask = st.one_of(st.just(0), st.just(full), st.integers(0, full))
    routing = draw(st.lists(st.lists(mask, min_size=L, max_size=L), min_size=steps, max_size=steps))
    # between steps, occasionally forget some slots (prefill borrowing) or reset everything
    events = draw(
        st.lists(
            st.one_of(
                st.just(None),
                st.just("reset"),
                st.lists(st.integers(-1, S - 1), min_size=1, max_size=E),
            ),
            min_size=steps,
            max_size=steps,
        )
    )
    return L, E, S, routing, events


@pytest.mark.parametrize("policy", policies.names())
@settings(
    max_examples=_examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(streams())
def test_matches_reference(policy, stream):
    """Call by call, forget / reset between steps included: every registered policy keeps the table's
    invariants and fills free slots before evicting; the policies of REF_KEYS also give the reference's
    slots, misses and evictions, and its CRF history (lfru, lfu)."""
    _replay_against_reference(stream, policy)


def assert_history_equals_ref(t: SlotTable, ref: RefLRU):
    """LRFU fields: the reference clocks exactly, log2 CRF to float32 rounding."""
    log2, when = ref.history()
    np.testing.assert_array_equal(np.asarray(t.crf_time), when, err_msg="crf_time")
    got = np.asarray(t.crf_log2)
    assert t.crf_log2.dtype == jnp.float32 and t.crf_time.dtype == jnp.int32
    np.testing.assert_array_equal(np.isinf(got), np.isinf(log2), err_msg="crf_log2 history")
    np.testing.assert_allclose(got[~np.isinf(got)], log2[~np.isinf(log2)], rtol=1e-5, atol=1e-5)


def _replay_against_reference(stream, policy):
    """Replay ``stream`` through the table (and RefLRU, for the policies of REF_KEYS), checking each call."""
    L, E, S, routing, events = stream
    table = init_slot_table(L, E, S)
    ref = RefLRU(L, E, S, policy) if policy in REF_KEYS else None

    def check_ref(t):
        if ref is not None:
            assert_table_equals_ref(t, ref)
            if REF_KEYS[policy]:
                assert_history_equals_ref(t, ref)

    check_ref(table)
    for step, masks in enumerate(routing):
        ev = events[step]
        if ev == "reset":
            table = _reset(table)
            if ref is not None:
                ref.reset()
        elif ev is not None:
            table = _forget(table, jnp.asarray(ev, jnp.int32))
            if ref is not None:
                ref.forget(ev)
        if ev is not None:
            assert_table_invariants(table)
            check_ref(table)
        for layer in range(L):
            routed = _mask(masks[layer], E)
            out = _lookup(table, jnp.int32(layer), jnp.asarray(routed), E, policy)
            check_lookup(out, table, layer, routed, E)
            if ref is not None:
                check_against_ref(out, ref.lookup(layer, np.nonzero(routed)[0].tolist()), E)
            check_ref(out.table)
            table = out.table


@st.composite
def topk_traces(draw):
    """ids int32 [B, T, L, k] as policy_study traces them (k distinct experts per (token, layer))."""
    L = draw(st.integers(1, 4))
    E = draw(st.integers(2, 8))
    k = draw(st.integers(1, E))
    S = draw(st.integers(E, L * E))
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, 24))
    perms = st.permutations(list(range(E))).map(lambda p: p[:k])
    ids = draw(st.lists(perms, min_size=B * T * L, max_size=B * T * L))
    return np.asarray(ids, np.int32).reshape(B, T, L, k), E, S


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(topk_traces(), st.sampled_from([LFRU_HALF_LIFE_TOKENS, 1.0, 2.5, 50.0]))
def test_lfru_half_lives_match_reference(trace, half_life):
    """lfru with other half-lives than the default, on top-k traces as policy_study replays them
    (streams start cold: reset_table between them, the clock runs on): every lookup and the CRF
    history equal the reference's (float64)."""
    ids, E, S = trace
    B, T, L, k = ids.shape
    table = init_slot_table(L, E, S)
    ref = RefLRU(L, E, S, "lfru", half_life)
    for b in range(B):
        table = _reset(table)
        ref.reset()
        for t in range(T):
            for layer in range(L):
                routed = np.zeros(E, bool)
                routed[ids[b, t, layer]] = True
                out = _lookup_hl(table, jnp.int32(layer), jnp.asarray(routed), E, "lfru", half_life)
                check_against_ref(out, ref.lookup(layer, ids[b, t, layer].tolist()), E)
                table = out.table
        assert_history_equals_ref(table, ref)
    assert_table_equals_ref(table, ref)


def _hit_rate(policy: str, L: int, E: int, S: int, steps: list[list[np.ndarray]]) -> float:
    table, hits, total = init_slot_table(L, E, S), 0, 0
    for masks in steps:
        for layer, routed in enumerate(masks):
            out = _lookup(table, jnp.int32(layer), jnp.asarray(routed), E, policy)
            hits, total, table = hits + int(out.n_hit), total + int(routed.sum()), out.table
    return hits / total


def test_lookahead_beats_lru_when_a_step_does_not_fit():
    """The same experts every step, S smaller than one step's working set (L*k): LRU evicts
    exactly what the next layers need (hit rate 0); lookahead keeps all but one layer's worth."""
    L, E, k = 6, 8, 2
    S = L * k - 2
    step = [np.isin(np.arange(E), [l % E, (l + 3) % E]) for l in range(L)]
    lru = _hit_rate("lru", L, E, S, [step] * 20)
    ahead = _hit_rate("lookahead", L, E, S, [step] * 20)
    assert lru == 0.0
    # steady state: S - k slots keep their experts across steps -> (S - k) / (L*k) of accesses hit
    assert ahead > 0.6


def test_unknown_policy_raises_on_every_path():
    """An unknown name raises ValueError naming it and the registered policies: lookup_layer (eager,
    jitted, every impl), eviction_order and the order keys of the fused impls; never a silent default."""
    table, routed, protected = init_slot_table(2, 4, 4), jnp.ones(4, bool), jnp.zeros(4, bool)
    calls = [lambda: lookup_layer(table, 0, routed, 4, "mru"),
             lambda: _lookup(table, jnp.int32(0), routed, 4, "mru"),
             lambda: eviction_order(table, jnp.int32(0), protected, 4, "mru"),
             lambda: slot_table._order_keys(table, jnp.int32(0), protected, 4, "mru")]
    calls += [lambda impl=impl: lookup_layer(table, 0, routed, 4, "mru", impl=impl) for impl in ORDER_IMPLS]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError, match="unknown cache policy 'mru'") as ei:
            call()
        assert str(policies.names()) in str(ei.value), i
    with pytest.raises(ValueError, match="half_life_tokens must be > 0"):
        lookup_layer(table, 0, routed, 4, "lfru", half_life_tokens=0.0)


def test_policy_instance_and_name_agree():
    """lookup_layer takes a CachePolicy instance (policies.get: hashable, a static jit argument) as the
    same policy as its name; a name gets ``half_life_tokens`` only if the policy takes it."""
    for name in policies.names():
        assert slot_table._policy(name) == policies.get(name) and hash(policies.get(name)) == hash(policies.get(name))
    assert slot_table._policy("lfru", 0.5) == policies.get("lfru", half_life_tokens=0.5) != policies.get("lfru")
    assert slot_table._policy("lru", 0.5) == policies.get("lru")
    # slots hold flat 0 (references at calls 0, 2), 3 (call 3) and 1 (call 4); flat 2 misses at call 5:
    # a short half-life evicts the least recent (flat 0), the default the least referenced (flat 3)
    t = _run_calls("lfru", 2, 2, 3, [(0, [0]), (1, [0]), (0, [0]), (1, [1]), (0, [1])])[-1].table
    routed = jnp.array([True, False])
    for half_life, victim in ((0.5, 0), (LFRU_HALF_LIFE_TOKENS, 3)):
        got = _lookup(t, jnp.int32(1), routed, 2, policies.get("lfru", half_life_tokens=half_life))
        _assert_bit_identical(got, _lookup_hl(t, jnp.int32(1), routed, 2, "lfru", half_life), half_life)
        assert got.evicted_ids.tolist() == [victim, -1], half_life


def test_long_decode_tiny_cache_never_serves_stale_slot():
    """S == E, many steps, every layer heavily routed: a stale slot would show up here."""
    L, E = 4, 8
    S = E
    rng = np.random.default_rng(0)
    table = init_slot_table(L, E, S)
    ref = RefLRU(L, E, S)
    for _ in range(60):
        for layer in range(L):
            routed = rng.random(E) < 0.6
            out = _lookup(table, jnp.int32(layer), jnp.asarray(routed), E)
            r = ref.lookup(layer, np.nonzero(routed)[0].tolist())
            check_lookup(out, table, layer, routed, E)
            check_against_ref(out, r, E)
            table = out.table
    assert_table_equals_ref(table, ref)


# --------------------------------------------------------------------------------------------
# Hand-checked examples (they pin the policy, independently of the reference)
# --------------------------------------------------------------------------------------------
def test_hand_example_lru_and_tie_breaks():
    L, E, S = 2, 2, 3
    t = init_slot_table(L, E, S)
    # call 0 (clock 0): layer 0 routes both experts -> free slots 0, 1 in ascending order
    o = _lookup(t, jnp.int32(0), jnp.array([True, True]), E)
    assert o.miss_experts.tolist() == [0, 1] and o.miss_slots.tolist() == [0, 1]
    assert o.table.id_of_slot.tolist() == [0, 1, -1]
    assert o.table.last_use.tolist() == [0, 0, -1]
    # call 1 (clock 1): layer 1 routes expert 1 (flat 3) -> the free slot 2
    o = _lookup(o.table, jnp.int32(1), jnp.array([False, True]), E)
    assert o.miss_slots.tolist() == [2, -1] and o.evicted_ids.tolist() == [-1, -1]
    assert o.table.id_of_slot.tolist() == [0, 1, 3]
    # call 2 (clock 2): layer 0 routes expert 1 -> hit slot 1, refreshed
    o = _lookup(o.table, jnp.int32(0), jnp.array([False, True]), E)
    assert int(o.n_hit) == 1 and int(o.n_miss) == 0
    assert o.table.last_use.tolist() == [0, 2, 1]
    # call 3 (clock 3): layer 1 routes both -> expert 1 hits slot 2; expert 0 (flat 2)
    # evicts the LRU slot 0 (flat 0, last_use 0)
    o = _lookup(o.table, jnp.int32(1), jnp.array([True, True]), E)
    assert o.miss_experts.tolist() == [0, -1] and o.miss_slots.tolist() == [0, -1]
    assert o.evicted_ids.tolist() == [0, -1]
    assert o.table.id_of_slot.tolist() == [2, 1, 3]
    assert o.table.slot_of.tolist() == [-1, 1, 0, 2]
    assert o.table.last_use.tolist() == [3, 2, 3]
    assert o.slot_of_expert.tolist() == [0, 2]
    assert int(o.table.clock) == 4
    # call 4: nothing routed, clock still advances, nothing else changes
    o2 = _lookup(o.table, jnp.int32(0), jnp.zeros(E, bool), E)
    assert int(o2.table.clock) == 5 and int(o2.n_hit) == 0 and int(o2.n_miss) == 0
    assert o2.slot_of_expert.tolist() == [-1, 1]
    np.testing.assert_array_equal(o2.table.id_of_slot, o.table.id_of_slot)
    np.testing.assert_array_equal(o2.table.last_use, o.table.last_use)


def test_equal_last_use_ties_go_to_lowest_slot():
    L, E, S = 3, 2, 4
    t = init_slot_table(L, E, S)
    t = _lookup(t, jnp.int32(0), jnp.array([True, True]), E).table  # slots 0,1 at clock 0
    t = _lookup(t, jnp.int32(1), jnp.array([True, True]), E).table  # slots 2,3 at clock 1
    o = _lookup(t, jnp.int32(2), jnp.array([False, True]), E)  # ties 0/1 -> slot 0
    assert o.miss_slots.tolist() == [0, -1] and o.evicted_ids.tolist() == [0, -1]
    o = _lookup(o.table, jnp.int32(0), jnp.array([True, True]), E)
    # flat 0 was evicted; flat 1 hits slot 1; flat 0 takes LRU among {0,2,3} \ {} = slot 2
    assert o.miss_experts.tolist() == [0, -1]
    assert o.miss_slots.tolist() == [2, -1]
    assert o.slot_of_expert.tolist() == [2, 1]


def test_all_routed_with_s_equal_e_every_layer_misses_everything():
    L, E = 3, 4
    t = init_slot_table(L, E, E)
    for step in range(3):
        for layer in range(L):
            o = _lookup(t, jnp.int32(layer), jnp.ones(E, bool), E)
            assert int(o.n_miss) == E and int(o.n_hit) == 0
            assert sorted(o.slot_of_expert.tolist()) == list(range(E))
            assert o.miss_experts.tolist() == list(range(E))
            assert_table_invariants(o.table)
            t = o.table
    # same layer twice in a row: all hits
    o = _lookup(t, jnp.int32(L - 1), jnp.ones(E, bool), E)
    assert int(o.n_hit) == E and int(o.n_miss) == 0
    np.testing.assert_array_equal(o.table.id_of_slot, t.id_of_slot)


def _run_calls(policy: str, L: int, E: int, S: int, calls: list[tuple[int, list[int]]]):
    """Look up ``calls`` [(layer, routed experts)] from an empty table; returns the outputs."""
    t, outs = init_slot_table(L, E, S), []
    for layer, experts in calls:
        o = _lookup(t, jnp.int32(layer), jnp.asarray(np.isin(np.arange(E), experts)), E, policy)
        outs.append(o)
        t = o.table
    return outs


def test_hand_example_lfru_keeps_the_frequent_expert_lru_evicts():
    """L=2, E=2, S=3, lambda = 1/(4*2) per call. Flat 0 is referenced at calls 0, 2, 4; flat 2 at
    1, 5; flat 3 at 3, 5. At call 6 flat 1 misses with every slot full: LRU evicts the least
    recent, flat 0 (last use 4); LRFU the smallest CRF(6): flat 2 (2^-5/8 + 2^-1/8 = 1.565) before
    flat 3 (2^-3/8 + 2^-1/8 = 1.688) and flat 0 (2^-6/8 + 2^-4/8 + 2^-2/8 = 2.143). At call 8 flat 0
    comes back: an LRFU hit, an LRU miss."""
    L, E, S = 2, 2, 3
    calls = [(0, [0]), (1, [0]), (0, [0]), (1, [1]), (0, [0]), (1, [0, 1]), (0, [1]), (1, []), (0, [0])]
    lru, lfru = _run_calls("lru", L, E, S, calls), _run_calls("lfru", L, E, S, calls)
    for outs in (lru, lfru):  # identical up to call 5: slots 0, 1, 2 hold flat 0, 2, 3
        assert outs[5].table.id_of_slot.tolist() == [0, 2, 3]
        assert outs[5].table.last_use.tolist() == [4, 5, 5]
    assert lru[6].evicted_ids.tolist() == [0, -1] and lru[6].miss_slots.tolist() == [0, -1]
    assert lfru[6].evicted_ids.tolist() == [2, -1] and lfru[6].miss_slots.tolist() == [1, -1]
    assert lru[6].table.id_of_slot.tolist() == [1, 2, 3]
    assert lfru[6].table.id_of_slot.tolist() == [0, 1, 3]
    assert (int(lru[8].n_hit), int(lru[8].n_miss)) == (0, 1)
    assert (int(lfru[8].n_hit), int(lfru[8].n_miss)) == (1, 0)
    # the history after call 6: log2 CRF at each id's last reference, and that clock
    t = lfru[6].table
    want = [math.log2(1 + 2 ** -0.25 + 2 ** -0.5), 0.0, math.log2(1 + 2 ** -0.5), math.log2(1 + 2 ** -0.25)]
    np.testing.assert_allclose(np.asarray(t.crf_log2), want, rtol=1e-6)
    assert t.crf_time.tolist() == [4, 6, 5, 5]
    # lru never touches the LRFU fields
    assert (np.asarray(lru[8].table.crf_log2) == -np.inf).all() and (np.asarray(lru[8].table.crf_time) == -1).all()
    # the half-life is a static parameter: very long, LRFU ~ LFU (flat 0 has 3 references: kept);
    # very short, LRFU = LRU (the most recent reference dominates every older sum)
    for half_life, victim in ((1e6, 2), (0.05, 0)):
        t = lfru[5].table
        o = _lookup_hl(t, jnp.int32(0), jnp.array([False, True]), E, "lfru", half_life)
        assert o.evicted_ids.tolist() == [victim, -1], half_life


def test_hand_example_lfu_keeps_the_frequent_expert_lru_and_lfru_evict():
    """L=2, E=2, S=3. Flat 0 is referenced at calls 0, 2, 4 (3 times), flat 2 at 5, 9 and flat 3 at 7, 9.
    At call 10 flat 1 misses with every slot full: LRU evicts the least recent, flat 0 (last use 4), and
    so does LRFU (half-life 4 tokens = 8 calls: its old references have decayed); LFU evicts the fewest
    references, flat 2 (2, tied with flat 3 and the same last use 9: the lowest flat id), and keeps
    flat 0 (3), so at call 12 flat 0 is an LFU hit and a miss of the two others. Counts are kept as
    log2 count (LRFU with lambda 0)."""
    L, E, S = 2, 2, 3
    calls = [(0, [0]), (1, []), (0, [0]), (1, []), (0, [0]), (1, [0]), (0, []), (1, [1]), (0, []), (1, [0, 1]),
             (0, [1]), (1, []), (0, [0])]
    outs = {p: _run_calls(p, L, E, S, calls) for p in ("lru", "lfru", "lfu")}
    for p, victim in (("lru", 0), ("lfru", 0), ("lfu", 2)):
        assert outs[p][9].table.id_of_slot.tolist() == [0, 2, 3], p
        assert outs[p][10].evicted_ids.tolist() == [victim, -1], p
        assert (int(outs[p][12].n_hit), int(outs[p][12].n_miss)) == ((1, 0) if p == "lfu" else (0, 1)), p
    t = outs["lfu"][12].table
    np.testing.assert_allclose(np.asarray(t.crf_log2), [2.0, 0.0, 1.0, 1.0], rtol=1e-6)  # log2 of 4, 1, 2, 2
    assert t.crf_time.tolist() == [12, 10, 9, 9]


def test_lfru_forget_and_reset_clear_the_history():
    L, E, S = 2, 3, 4
    outs = _run_calls("lfru", L, E, S, [(0, [0, 1]), (1, [2]), (0, [0])])  # flat 0 twice, 1 and 5 once
    t = outs[-1].table
    assert t.id_of_slot.tolist() == [0, 1, 5, -1]
    assert t.crf_time.tolist() == [2, 0, -1, -1, -1, 1]
    np.testing.assert_allclose(np.asarray(t.crf_log2)[[0, 1, 5]], [math.log2(1 + 2 ** -0.25), 0.0, 0.0],
                               rtol=1e-6)
    f = _forget(t, jnp.array([0, 3, -1], jnp.int32))  # slot 0 holds flat 0; slot 3 is free
    assert f.id_of_slot.tolist() == [-1, 1, 5, -1]
    assert f.crf_time.tolist() == [-1, 0, -1, -1, -1, 1]
    log2 = np.asarray(f.crf_log2)
    assert log2[0] == -np.inf and log2[1] == 0.0 and log2[5] == 0.0
    assert_table_invariants(f)
    # flat 0 comes back as a first reference (CRF 1), not resuming its two references
    o = _lookup(f, jnp.int32(0), jnp.array([True, False, False]), E, "lfru")
    assert int(o.n_miss) == 1 and float(o.table.crf_log2[0]) == 0.0 and int(o.table.crf_time[0]) == 3
    r = _reset(o.table)
    assert (np.asarray(r.crf_log2) == -np.inf).all() and (np.asarray(r.crf_time) == -1).all()
    assert r.crf_log2.dtype == jnp.float32 and int(r.clock) == 4
    for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(init_slot_table(L, E, S).replace(clock=jnp.int32(4)))):
        np.testing.assert_array_equal(a, b)


def test_lfru_history_is_bounded_over_a_long_decode():
    """log2 CRF is stored relative to each id's last reference: it stays below log2 of the
    geometric bound 1 / (1 - 2^-lambda) however long the decode (no growth with the clock)."""
    L, E, S, steps = 4, 8, 10, 2000
    rng = np.random.default_rng(3)
    routed = jnp.asarray(rng.random((steps, L, E)) < 0.4)

    @jax.jit
    def run(table, routed):
        def step(t, r):
            def body(t, xs):
                return lookup_layer(t, xs[0], xs[1], E, "lfru").table, None
            return jax.lax.scan(body, t, (jnp.arange(L, dtype=jnp.int32), r))[0], None
        return jax.lax.scan(step, table, routed)[0]

    t = run(init_slot_table(L, E, S), routed)
    log2 = np.asarray(t.crf_log2)
    lam = 1.0 / (LFRU_HALF_LIFE_TOKENS * L)
    assert int(t.clock) == steps * L and np.isfinite(log2).all()
    assert (log2 >= 0).all() and (log2 <= math.log2(1 / (1 - 2 ** -lam)) + 1e-4).all()
    assert_table_invariants(t)


# --------------------------------------------------------------------------------------------
# init, forget, reset, resident, no-reuse
# --------------------------------------------------------------------------------------------
def test_init_shapes_and_dtypes():
    t = init_slot_table(3, 4, 5)
    assert t.slot_of.shape == (12,) and t.id_of_slot.shape == (5,) and t.last_use.shape == (5,)
    assert t.clock.shape == ()
    for a in (t.slot_of, t.id_of_slot, t.last_use, t.clock):
        assert a.dtype == jnp.int32
    assert (np.asarray(t.slot_of) == -1).all() and (np.asarray(t.id_of_slot) == -1).all()
    assert int(t.clock) == 0
    assert t.num_slots == 5 and t.num_flat_ids == 12
    init_slot_table(3, 4, 4)  # S == E ok
    init_slot_table(3, 4, 12)  # S == L*E ok


def test_init_too_few_slots_raises_helpful_error():
    with pytest.raises(ValueError) as ei:
        init_slot_table(48, 128, 100)
    msg = str(ei.value)
    assert "num_slots=100" in msg and "128" in msg and str(48 * 128) in msg


def test_init_too_many_slots_raises():
    with pytest.raises(ValueError) as ei:
        init_slot_table(2, 4, 9)
    msg = str(ei.value)
    assert "num_slots=9" in msg and "8" in msg and "4" in msg


def test_init_rejects_nonpositive_sizes():
    with pytest.raises(ValueError):
        init_slot_table(0, 4, 4)
    with pytest.raises(ValueError):
        init_resident_table(2, 0)


def test_lookup_rejects_bad_routed_shape():
    with pytest.raises(ValueError):
        lookup_layer(init_slot_table(2, 4, 4), 0, jnp.ones(3, bool), 4)


def test_forget_slots():
    L, E, S = 2, 3, 5
    t = init_slot_table(L, E, S)
    t = _lookup(t, jnp.int32(0), jnp.array([True, True, True]), E).table  # slots 0,1,2
    t = _lookup(t, jnp.int32(1), jnp.array([True, False, True]), E).table  # slots 3,4
    assert t.id_of_slot.tolist() == [0, 1, 2, 3, 5]
    t2 = _forget(t, jnp.array([1, -1, 4, 1], jnp.int32))  # -1 ignored, duplicate fine
    assert t2.id_of_slot.tolist() == [0, -1, 2, 3, -1]
    assert t2.last_use.tolist() == [0, -1, 0, 1, -1]
    assert t2.slot_of.tolist() == [0, -1, 2, 3, -1, -1]
    assert int(t2.clock) == int(t.clock)
    assert_table_invariants(t2)
    # freed slots are reused first (last_use -1), lowest index first
    o = _lookup(t2, jnp.int32(1), jnp.array([False, True, False]), E)
    assert o.miss_slots.tolist() == [1, -1, -1] and o.evicted_ids.tolist() == [-1, -1, -1]
    # forgetting free slots / all -1 is a no-op
    t3 = _forget(t2, jnp.array([-1, 1, 4], jnp.int32))
    for a, b in zip(jax.tree.leaves(t3), jax.tree.leaves(t2)):
        np.testing.assert_array_equal(a, b)


def test_reset_table_and_no_reuse():
    L, E, S = 2, 3, 4
    t = init_slot_table(L, E, S)
    t = _lookup(t, jnp.int32(0), jnp.array([True, True, False]), E).table
    r = _reset(t)
    assert (np.asarray(r.slot_of) == -1).all()
    assert (np.asarray(r.id_of_slot) == -1).all()
    assert (np.asarray(r.last_use) == -1).all()
    assert int(r.clock) == int(t.clock) == 1
    # no reuse: the same routing misses again every time, slots 0..n-1
    for _ in range(3):
        o = _lookup_no_reuse(t, jnp.int32(0), jnp.array([True, False, True]), E)
        assert int(o.n_hit) == 0 and int(o.n_miss) == 2
        assert o.miss_slots.tolist() == [0, 1, -1]
        assert o.slot_of_expert.tolist() == [0, -1, 1]
        assert_table_invariants(o.table)
        t = o.table


def test_resident_table_never_misses():
    L, E = 3, 4
    t = init_resident_table(L, E)
    np.testing.assert_array_equal(t.slot_of, np.arange(L * E))
    np.testing.assert_array_equal(t.id_of_slot, np.arange(L * E))
    assert t.slot_of.dtype == jnp.int32 and t.id_of_slot.dtype == jnp.int32
    assert_table_invariants(t)
    rng = np.random.default_rng(1)
    for _ in range(5):
        for layer in range(L):
            routed = rng.random(E) < 0.5
            o = _lookup(t, jnp.int32(layer), jnp.asarray(routed), E)
            assert int(o.n_miss) == 0 and int(o.n_hit) == routed.sum()
            np.testing.assert_array_equal(o.slot_of_expert, layer * E + np.arange(E))
            t = o.table
    np.testing.assert_array_equal(t.slot_of, np.arange(L * E))


# --------------------------------------------------------------------------------------------
# Inside lax.scan over layers, layer traced
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=2)
def _decode_steps(table, routed_steps, E):
    """routed_steps: bool [steps, L, E]. One scan per step over layers (as in the model)."""
    L = routed_steps.shape[1]

    def layer_body(tbl, xs):
        layer, routed = xs
        out = lookup_layer(tbl, layer, routed, E)
        return out.table, (out.slot_of_expert, out.miss_slots, out.n_hit, out.n_miss)

    def step(tbl, routed_layers):
        return jax.lax.scan(layer_body, tbl, (jnp.arange(L, dtype=jnp.int32), routed_layers))

    return jax.lax.scan(step, table, routed_steps)


def test_inside_lax_scan_over_layers():
    L, E, S, steps = 4, 6, 9, 12
    rng = np.random.default_rng(2)
    routed_steps = rng.random((steps, L, E)) < 0.5
    routed_steps[0] = True  # all routed
    routed_steps[1, 2] = False  # none routed
    final, (soe, miss_slots, n_hit, n_miss) = _decode_steps(
        init_slot_table(L, E, S), jnp.asarray(routed_steps), E
    )
    assert soe.shape == (steps, L, E) and soe.dtype == jnp.int32
    ref = RefLRU(L, E, S)
    for s in range(steps):
        for layer in range(L):
            r = ref.lookup(layer, np.nonzero(routed_steps[s, layer])[0].tolist())
            np.testing.assert_array_equal(soe[s, layer], r["slot_of_expert"])
            n = len(r["misses"])
            np.testing.assert_array_equal(miss_slots[s, layer], r["miss_slots"] + [-1] * (E - n))
            assert int(n_hit[s, layer]) == len(r["hits"]) and int(n_miss[s, layer]) == n
    assert_table_equals_ref(final, ref)
    assert_table_invariants(final)
    assert int(final.clock) == steps * L


# --------------------------------------------------------------------------------------------
# Implementations (slot_table.ORDER_IMPLS): bit-identical to the reference "sort" path
# --------------------------------------------------------------------------------------------
_I32 = np.iinfo(np.int32)
# A few shapes (compiles are the cost): S == E, S == L*E, and S in between, E == 1 included.
_SHAPES = [(1, 1, 1), (2, 3, 3), (3, 2, 6), (3, 4, 7)]  # degenerate, S = E, S = L*E, in between


@st.composite
def valid_tables(draw):
    """A table that keeps SlotTable's invariant (slot_of / id_of_slot mutually inverse) but is
    otherwise arbitrary: any set of resident ids in any slots, free slots, last_use with ties and
    int32 extremes (INT32_MAX ties the protected slots' key), an arbitrary clock, LRFU history with
    ties, -inf, -0.0 and NaN; then 1-3 lookups (layer, routed mask)."""
    L, E, S = draw(st.sampled_from(_SHAPES))
    n_used = draw(st.integers(0, S))
    held = draw(st.permutations(range(L * E)))[:n_used]
    where = draw(st.permutations(range(S)))[:n_used]
    slot_of = np.full(L * E, -1, np.int32)
    id_of_slot = np.full(S, -1, np.int32)
    slot_of[held], id_of_slot[where] = where, held
    pool = [-1, 0, 1, 2, 5, _I32.max - 1, _I32.max, _I32.min]
    last_use = np.asarray(draw(st.lists(st.sampled_from(pool), min_size=S, max_size=S)), np.int32)
    if draw(st.booleans()):
        last_use[id_of_slot < 0] = -1  # as the table keeps it
    clock = draw(st.sampled_from([0, 3, 6, 1000]))
    crf_log2 = draw(st.lists(st.sampled_from([-np.inf, 0.0, -0.0, 0.5, 1.0, np.nan]), min_size=L * E, max_size=L * E))
    crf_time = draw(st.lists(st.sampled_from([-1, 0, 2, clock]), min_size=L * E, max_size=L * E))
    table = SlotTable(slot_of=jnp.asarray(slot_of), id_of_slot=jnp.asarray(id_of_slot),
                      last_use=jnp.asarray(last_use), clock=jnp.int32(clock),
                      crf_log2=jnp.asarray(crf_log2, jnp.float32), crf_time=jnp.asarray(crf_time, jnp.int32))
    calls = draw(st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, (1 << E) - 1)), min_size=1, max_size=3))
    return table, E, [(layer, _mask(bits, E)) for layer, bits in calls]


def _assert_bit_identical(got, want, what):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
        a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)  # bits: -0.0 / NaN payloads too
        np.testing.assert_array_equal(a, b, err_msg=f"{what} leaf {i}")


def _takes_half_life(policy: str) -> bool:
    return "half_life_tokens" in policies.policy_class(policy).param_names()


@pytest.mark.parametrize("policy", policies.names())
@settings(
    max_examples=_examples(48),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(valid_tables(), st.sampled_from([LFRU_HALF_LIFE_TOKENS, 0.05]))
def test_impls_bit_identical_to_sort(policy, case, half_life):
    """Every ORDER_IMPLS entry returns the reference ("sort": full argsort, one scatter per
    update) LayerLookup bit for bit, call after call, on arbitrary valid tables, for every
    registered policy (and two half-lives for those that take one)."""
    half_life = half_life if _takes_half_life(policy) else LFRU_HALF_LIFE_TOKENS  # fewer compiles
    table, E, calls = case
    tables = {impl: table for impl in ORDER_IMPLS}
    for step, (layer, routed) in enumerate(calls):
        outs = {impl: _lookup_impl(t, jnp.int32(layer), jnp.asarray(routed), num_experts=E, policy=policy,
                                   half_life_tokens=half_life, impl=impl) for impl, t in tables.items()}
        for impl in ORDER_IMPLS:
            _assert_bit_identical(outs[impl], outs["sort"], (impl, policy, step))
        tables = {impl: o.table for impl, o in outs.items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_candidates_match_a_stable_lexicographic_sort(data):
    """_candidates on raw keys (int32 extremes and ties; float32 -inf, -0.0 / 0.0, NaN): the E
    first slots and every slot's position agree with numpy's stable lexicographic sort."""
    S = data.draw(st.sampled_from([1, 2, 3, 7, 33]))
    E = data.draw(st.integers(1, S))
    n_keys = data.draw(st.integers(1, 3))
    ints = st.sampled_from([_I32.min, _I32.min + 1, -2, -1, 0, 1, 2, _I32.max - 1, _I32.max])
    floats = st.sampled_from([-np.inf, -1.5, -0.0, 0.0, 1e-30, 2.0, np.inf, np.nan, -np.nan])  # no denormals (FTZ)
    keys = []
    for _ in range(n_keys):
        if data.draw(st.booleans()):
            keys.append(np.asarray(data.draw(st.lists(floats, min_size=S, max_size=S)), np.float32))
        else:
            keys.append(np.asarray(data.draw(st.lists(ints, min_size=S, max_size=S)), np.int32))

    def np_key(k):  # lax.sort's order: -0 == 0, every NaN equal and last
        if k.dtype != np.float32:
            return k.astype(np.float64)
        k = np.where(k == 0, 0.0, k).astype(np.float64)
        return np.where(np.isnan(k), np.inf, np.where(np.isinf(k) & (k > 0), np.finfo(np.float64).max, k))

    order = np.lexsort([np.arange(S)] + [np_key(k) for k in keys[::-1]])
    pos = np.empty(S, np.int64)
    pos[order] = np.arange(S)
    for impl in ORDER_IMPLS[1:]:
        cand, got_pos = slot_table._candidates(tuple(jnp.asarray(k) for k in keys), E, impl)  # eager: no compiles
        np.testing.assert_array_equal(np.asarray(cand), order[:E], err_msg=impl)
        got_pos = np.asarray(got_pos)
        np.testing.assert_array_equal(np.minimum(got_pos, E), np.minimum(pos, E), err_msg=impl)


def test_rank_index_bits_at_power_of_two_slot_counts():
    """_rank packs the slot index into the last key's low bits: S = 2048 (11 bits) and 2049 (12)."""
    rng = np.random.default_rng(5)
    for S in (2048, 2049):
        key = rng.choice(np.array([_I32.min, -1, 0, 7, _I32.max], np.int32), S)
        got = np.asarray(jax.jit(slot_table._rank)((jnp.asarray(key),)))
        want = np.empty(S, np.int64)
        want[np.argsort(key, kind="stable")] = np.arange(S)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("policy", policies.names())
def test_impls_bit_identical_inside_lax_scan(policy):
    """Decode steps (a layer scan per step, layer traced): every impl matches "sort" exactly."""
    L, E, S, steps = 4, 6, 9, 10
    rng = np.random.default_rng(7)
    routed = jnp.asarray(rng.random((steps, L, E)) < 0.4)

    def run(impl):
        def step(t, r):
            def body(t, xs):
                out = lookup_layer(t, xs[0], xs[1], E, policy, impl=impl)
                return out.table, out._replace(table=None)
            return jax.lax.scan(body, t, (jnp.arange(L, dtype=jnp.int32), r))
        return jax.jit(lambda t, r: jax.lax.scan(step, t, r))(init_slot_table(L, E, S), routed)

    want = run("sort")
    for impl in ORDER_IMPLS:
        _assert_bit_identical(run(impl), want, impl)


@pytest.mark.parametrize("policy", policies.names())
def test_skip_if_all_hit_bit_identical_inside_lax_scan(policy):
    """skip_if_all_hit (the decode fast path: a cond that skips the eviction order when nothing
    misses) gives exactly the full update, for every impl, over steps where some layers all hit
    and others miss (both branches taken, checked)."""
    L, E, S, steps = 4, 6, 14, 12
    rng = np.random.default_rng(11)
    # few routed experts per layer and a table of more than half the ids: many all-hit layers
    routed = jnp.asarray(rng.random((steps, L, E)) < np.where(np.arange(steps) < 4, 0.5, 0.15)[:, None, None])

    def run(impl, skip):
        def step(t, r):
            def body(t, xs):
                out = lookup_layer(t, xs[0], xs[1], E, policy, impl=impl, skip_if_all_hit=skip)
                return out.table, out._replace(table=None)
            return jax.lax.scan(body, t, (jnp.arange(L, dtype=jnp.int32), r))
        return jax.jit(lambda t, r: jax.lax.scan(step, t, r))(init_slot_table(L, E, S), routed)

    want = run("sort", False)
    n_miss = np.asarray(want[1].n_miss)
    any_routed = np.asarray(routed).any(axis=2)
    assert (any_routed & (n_miss == 0)).sum() >= 5 and (n_miss > 0).sum() >= 5, "both branches must run"
    for impl in ORDER_IMPLS:
        _assert_bit_identical(run(impl, True), want, f"{impl} with skip_if_all_hit")


def test_order_impl_default_and_unknown_impl(monkeypatch):
    """The default ``KernelConfig.slot_order`` "auto" is the sort on the CPU (rank writes an [S, S] count
    to memory there) and rank on an accelerator (ab_slot_table on the H200); both give the reference's
    result. Another choice in the active kernel config is the impl a lookup without ``impl`` traces."""
    assert registry.KernelConfig().slot_order == "auto" and ORDER_IMPLS[0] == "sort"
    table, routed = init_slot_table(2, 4, 6), jnp.array([1, 0, 1, 1], bool)
    seen = []
    for backend, impl in (("cpu", "sort"), ("gpu", "rank")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        got = lookup_layer(table, 1, routed, 4)
        _assert_bit_identical(got, lookup_layer(table, 1, routed, 4, impl=impl), f"auto on {backend}")
        seen.append(jax.make_jaxpr(lambda t: lookup_layer(t, 1, routed, 4))(table))
    # the two defaults trace different programs: the CPU's has a sort, the accelerator's none
    assert " sort[" in str(seen[0]) and " sort[" not in str(seen[1])
    # above RANK_MAX_SLOTS the accelerator's default is top_k (the count grows as S^2)
    from ftjax.experts import slot_table
    monkeypatch.setattr(slot_table, "RANK_MAX_SLOTS", 5)
    big = jax.make_jaxpr(lambda t: lookup_layer(t, 1, routed, 4))(table)
    assert " top_k[" in str(big)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with registry.using(registry.KernelConfig(slot_order="top_k")):
        chosen = jax.make_jaxpr(lambda t: lookup_layer(t, 1, routed, 4))(table)
    assert " top_k[" in str(chosen) and " sort[" not in str(chosen)
    with pytest.raises(ValueError, match="unknown slot table impl"):
        lookup_layer(init_slot_table(2, 4, 4), 0, jnp.ones(4, bool), 4, impl="bogus")
