"""Tests for the host KV prefix store and its chained chunk keys (DESIGN.md 1.4)."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ftjax.kv.chunk_keys import KEY_BYTES, chunk_keys, model_identity
from ftjax.kv.host_store import HostKVStore
from ftjax.memory import host_sharding

CFG = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 2, "rope_theta": 10000.0}
IDENT = model_identity(CFG, "float32")
C = 4  # chunk tokens in the tests
SHAPE = (2, 2, C, 1, 2)  # [L, 2, chunk, kv_heads, head_dim]
ENTRY = int(np.prod(SHAPE)) * 4  # float32 bytes per entry = 128
HOST_KINDS = {"pinned_host", "unpinned_host"}


def kv(seed: int, shape=SHAPE, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def k(i: int) -> bytes:
    return hashlib.sha256(f"key{i}".encode()).digest()


# ---------------------------------------------------------------------------- keys
class TestChunkKeys:
    def test_chain_definition(self):
        toks = list(range(10))
        keys = chunk_keys(toks, C, IDENT)
        assert len(keys) == 2 and all(len(x) == KEY_BYTES for x in keys)
        k0 = hashlib.sha256(IDENT + np.arange(0, 4, dtype="<i4").tobytes()).digest()
        k1 = hashlib.sha256(k0 + IDENT + np.arange(4, 8, dtype="<i4").tobytes()).digest()
        assert keys == [k0, k1]

    def test_same_prefix_same_keys(self):
        a = list(range(100, 112)) + [1, 2, 3]
        b = list(range(100, 112)) + [7, 7, 7, 7, 7]
        ka, kb = chunk_keys(a, C, IDENT), chunk_keys(b, C, IDENT)
        assert ka == kb[:3] and len(ka) == 3 and len(kb) == 4
        # numpy input gives the same keys as a list
        assert chunk_keys(np.asarray(a, dtype=np.int64), C, IDENT) == ka
        assert chunk_keys(np.asarray(a, dtype=np.int32), C, IDENT) == ka

    def test_differ_from_first_differing_chunk(self):
        a = list(range(16))
        b = list(a)
        b[5] = 999  # chunk 1
        ka, kb = chunk_keys(a, C, IDENT), chunk_keys(b, C, IDENT)
        assert ka[0] == kb[0]
        assert all(x != y for x, y in zip(ka[1:], kb[1:]))
        # chained: chunks 2.. identical in tokens but different because of chunk 1
        assert a[8:] == b[8:] and ka[2] != kb[2]

    def test_partial_chunk_gets_no_key(self):
        assert chunk_keys([1, 2, 3], C, IDENT) == []
        assert chunk_keys([], C, IDENT) == []
        assert len(chunk_keys(list(range(7)), C, IDENT)) == 1
        assert len(chunk_keys(list(range(8)), C, IDENT)) == 2
        assert chunk_keys(list(range(7)), C, IDENT) == chunk_keys(list(range(4)), C, IDENT)

    def test_identity_disjoint(self):
        toks = list(range(32))
        other_dtype = model_identity(CFG, "bfloat16")
        other_cfg = model_identity({**CFG, "num_layers": 3}, "float32")
        assert len({IDENT, other_dtype, other_cfg}) == 3
        ks = [set(chunk_keys(toks, C, i)) for i in (IDENT, other_dtype, other_cfg)]
        assert not (ks[0] & ks[1]) and not (ks[0] & ks[2]) and not (ks[1] & ks[2])

    def test_identity_stable(self):
        shuffled = dict(reversed(list(CFG.items())))
        assert model_identity(shuffled, "float32") == IDENT
        assert model_identity(CFG, jnp.float32) == IDENT
        assert model_identity({"n": np.int64(3)}, "float32") == model_identity({"n": 3}, "float32")
        # pinned value: sorted JSON digest must not drift between runs/versions silently
        payload = json.dumps({"config": {"a": 1}, "dtype": "float32"}, sort_keys=True, separators=(",", ":"))
        assert model_identity({"a": 1}, "float32") == hashlib.sha256(
            b"ftjax.kv.model_identity.v1\x00" + payload.encode()
        ).digest()

    def test_errors(self):
        for bad in (0, -1):
            with pytest.raises(ValueError):
                chunk_keys([1, 2, 3, 4], bad, IDENT)
        with pytest.raises(ValueError):
            chunk_keys([[1, 2], [3, 4]], 2, IDENT)
        with pytest.raises(ValueError):
            chunk_keys([2**31, 0], 2, IDENT)
        with pytest.raises(ValueError):
            chunk_keys([1.5, 2.0], 2, IDENT)
        with pytest.raises(TypeError):
            chunk_keys([1, 2], 2, "not-bytes")
        with pytest.raises(TypeError):
            model_identity({"x": object()}, "float32")

    @settings(max_examples=100, deadline=None)
    @given(
        a=st.lists(st.integers(0, 2**31 - 1), max_size=40),
        b=st.lists(st.integers(0, 2**31 - 1), max_size=40),
        c=st.integers(1, 8),
    )
    def test_keys_equal_iff_prefix_equal(self, a, b, c):
        ka, kb = chunk_keys(a, c, IDENT), chunk_keys(b, c, IDENT)
        assert len(ka) == len(a) // c
        for i in range(min(len(ka), len(kb))):
            assert (ka[i] == kb[i]) == (a[: (i + 1) * c] == b[: (i + 1) * c])


# ---------------------------------------------------------------------------- store
class TestHostStore:
    def test_host_memory_and_exact(self):
        store = HostKVStore(10 * ENTRY)
        assert store.memory_kind in HOST_KINDS
        x = kv(1)
        assert store.put(k(0), x)
        (got,) = store.get([k(0)])
        assert isinstance(got, jax.Array)
        assert got.sharding.memory_kind in HOST_KINDS
        assert got.dtype == x.dtype and got.shape == SHAPE
        np.testing.assert_array_equal(np.asarray(got), x)
        # bf16 from a device array, bit exact
        store2 = HostKVStore(10 * ENTRY)
        y = jnp.asarray(kv(2)).astype(jnp.bfloat16)
        assert store2.put(k(0), y)
        (got2,) = store2.get([k(0)])
        assert got2.sharding.memory_kind in HOST_KINDS and got2.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got2).view(np.uint16), np.asarray(y).view(np.uint16))
        # stored copy survives deletion of the caller's array
        y.delete()
        np.testing.assert_array_equal(np.asarray(store2.get([k(0)])[0]).shape, SHAPE)

    def test_peek_reads_an_entry_without_counting_or_touching(self):
        store = HostKVStore(10 * ENTRY)
        keys = [k(0), k(1)]
        for i, key in enumerate(keys):
            store.put(key, kv(i))
        before = store.stats
        np.testing.assert_array_equal(np.asarray(store.peek(k(0))), kv(0))
        assert store.peek(k(9)) is None
        assert store.stats == before and store.keys_lru() == keys  # no load counted, LRU order kept

    def test_host_sharding_fallback(self):
        assert host_sharding("pinned_host").memory_kind in HOST_KINDS
        default = jax.devices()[0].default_memory().kind
        assert host_sharding("no_such_kind").memory_kind == default
        assert host_sharding(None).memory_kind == default
        assert HostKVStore(0, memory_kind=None).memory_kind == default

    def test_full_partial_total_miss(self):
        store = HostKVStore(10 * ENTRY)
        keys = [k(i) for i in range(4)]
        for i, key in enumerate(keys):
            assert store.put(key, kv(i))
        assert store.lookup(keys) == keys
        s = store.stats
        assert (s.chunks_hit, s.chunks_missed) == (4, 0)
        # longer request: prefix stops at the first unknown key
        assert store.lookup(keys + [k(99)]) == keys
        assert store.stats.chunks_missed == 1
        # total miss
        assert store.lookup([k(50), k(0)]) == []
        s = store.stats
        assert (s.chunks_hit, s.chunks_missed, s.lookups) == (8, 3, 3)
        arrs = store.get(keys)
        for i, a in enumerate(arrs):
            np.testing.assert_array_equal(np.asarray(a), kv(i))
        assert store.stats.bytes_loaded == 4 * ENTRY
        store.record_loaded(10)
        assert store.stats.bytes_loaded == 4 * ENTRY + 10
        with pytest.raises(KeyError):
            store.get([k(77)])

    def test_partial_hit_middle_evicted(self):
        # capacity 4; order puts so chunk 1 is the LRU victim of the next put
        store = HostKVStore(4 * ENTRY)
        keys = [k(i) for i in range(4)]
        for i in (1, 0, 2, 3):
            assert store.put(keys[i], kv(i))
        assert store.put(k(10), kv(10))  # evicts keys[1]
        assert keys[1] not in store and len(store) == 4
        assert store.lookup(keys) == [keys[0]]
        s = store.stats
        assert (s.chunks_hit, s.chunks_missed, s.chunks_evicted) == (1, 3, 1)

    def test_lookup_touches_in_reverse(self):
        store = HostKVStore(3 * ENTRY)
        keys = [k(i) for i in range(3)]
        for i, key in enumerate(keys):
            store.put(key, kv(i))
        assert store.keys_lru() == keys
        store.lookup(keys)
        # first chunk most recent, last chunk least recent
        assert store.keys_lru() == keys[::-1]
        # pressure evicts the prefix from its tail: remaining stays a contiguous prefix
        store.put(k(10), kv(10))
        assert store.lookup(keys) == keys[:2]
        # the lookup above made k(10) the LRU entry, so it goes next, not the prefix
        assert store.keys_lru() == [k(10), keys[1], keys[0]]
        store.put(k(11), kv(11))
        assert k(10) not in store and store.lookup(keys) == keys[:2]

    def test_lru_whole_chunk_eviction(self):
        store = HostKVStore(3 * ENTRY + ENTRY // 2)  # room for 3 entries, not 4
        keys = [k(i) for i in range(5)]
        for i in range(3):
            assert store.put(keys[i], kv(i))
        assert store.lookup([keys[0]]) == [keys[0]]  # keys[0] now MRU, keys[1] LRU
        assert store.put(keys[3], kv(3))
        assert store.keys_lru() == [keys[2], keys[0], keys[3]]
        assert store.put(keys[4], kv(4))
        assert store.keys_lru() == [keys[0], keys[3], keys[4]]
        s = store.stats
        assert s.chunks_evicted == 2 and s.num_entries == 3
        assert s.bytes_in_use == 3 * ENTRY <= s.capacity_bytes
        # whole entries survive with all layers and exact contents
        for i in (0, 3, 4):
            (a,) = store.get([keys[i]])
            assert a.shape == SHAPE
            np.testing.assert_array_equal(np.asarray(a), kv(i))

    def test_capacity_smaller_than_chunk(self):
        for cap in (0, ENTRY - 1):
            store = HostKVStore(cap)
            assert store.put(k(0), kv(0)) is False
            assert store.put(k(1), kv(1)) is False
            s = store.stats
            assert (s.stores_skipped, s.chunks_stored, s.num_entries, s.bytes_in_use) == (2, 0, 0, 0)
            assert store.lookup([k(0)]) == []

    def test_pinned_never_evicted(self):
        store = HostKVStore(2 * ENTRY)
        store.put(k(0), kv(0))
        store.put(k(1), kv(1))
        store.pin([k(0), k(1)])
        assert store.stats.bytes_pinned == 2 * ENTRY
        assert store.put(k(2), kv(2)) is False  # skipped, nothing evicted
        s = store.stats
        assert (s.stores_skipped, s.chunks_evicted, s.num_entries) == (1, 0, 2)
        store.unpin([k(1)])
        assert store.put(k(2), kv(2)) is True  # k(1) is the only evictable one
        assert k(0) in store and k(1) not in store and k(2) in store
        # ref counting: pinned twice needs two unpins
        store.pin([k(0)])
        store.unpin([k(0)])
        assert store.pin_count(k(0)) == 1
        assert store.put(k(3), kv(3)) is True  # evicts k(2), not the pinned k(0)
        assert k(0) in store and k(2) not in store
        store.unpin([k(0)])
        with pytest.raises(ValueError):
            store.unpin([k(0)])  # double unpin is a bug, not silent
        with pytest.raises(KeyError):
            store.pin([k(0), k(99)])
        assert store.pin_count(k(0)) == 0  # all-or-nothing

    def test_in_use_context(self):
        store = HostKVStore(ENTRY)
        store.put(k(0), kv(0))
        with store.in_use([k(0)]) as ks:
            assert ks == [k(0)] and store.pin_count(k(0)) == 1
            assert store.put(k(1), kv(1)) is False
        assert store.pin_count(k(0)) == 0
        with pytest.raises(RuntimeError):
            with store.in_use([k(0)]):
                raise RuntimeError("boom")
        assert store.pin_count(k(0)) == 0
        assert store.put(k(1), kv(1)) is True and k(0) not in store

    def test_reput_refreshes(self):
        store = HostKVStore(2 * ENTRY)
        store.put(k(0), kv(0))
        store.put(k(1), kv(1))
        assert store.put(k(0), kv(123)) is True  # refresh only, contents unchanged
        np.testing.assert_array_equal(np.asarray(store.get([k(0)])[0]), kv(0))
        s = store.stats
        assert (s.chunks_stored, s.bytes_stored, s.bytes_in_use) == (2, 2 * ENTRY, 2 * ENTRY)
        store.put(k(2), kv(2))  # evicts k(1), the LRU after the refresh
        assert k(0) in store and k(1) not in store

    def test_validation(self):
        with pytest.raises(ValueError):
            HostKVStore(-1)
        store = HostKVStore(10 * ENTRY)
        with pytest.raises(ValueError, match=r"\[L, 2, chunk_tokens, num_kv_heads, head_dim\].*\(2, 2, 4, 2\)"):
            store.put(k(0), np.zeros((2, 2, 4, 2), np.float32))
        with pytest.raises(ValueError):
            store.put(k(0), np.zeros((2, 3, 4, 1, 2), np.float32))
        assert store.put(k(0), kv(0))
        assert store.entry_shape == SHAPE and store.entry_dtype == np.float32
        with pytest.raises(ValueError, match="mismatch"):
            store.put(k(1), kv(1, shape=(2, 2, 8, 1, 2)))
        with pytest.raises(ValueError, match="mismatch"):
            store.put(k(1), kv(1, dtype=np.float16))
        with pytest.raises(TypeError):
            store.put("str-key", kv(1))
        s = store.stats
        assert (s.chunks_stored, s.stores_skipped, s.num_entries) == (1, 0, 1)

    def test_stats_dict_json(self):
        store = HostKVStore(2 * ENTRY)
        store.put(k(0), kv(0))
        store.lookup([k(0), k(1)])
        d = json.loads(json.dumps(store.stats_dict()))
        for name in (
            "chunks_hit", "chunks_missed", "chunks_stored", "chunks_evicted", "stores_skipped",
            "bytes_stored", "bytes_loaded", "bytes_in_use", "capacity_bytes", "num_entries",
        ):
            assert name in d
        assert d["chunks_hit"] == 1 and d["chunks_missed"] == 1 and d["hit_rate"] == 0.5
        assert d["capacity_bytes"] == 2 * ENTRY and d["bytes_in_use"] == ENTRY


# ------------------------------------------------------------------ model-based test
class LRUModel:
    """Reference: byte-capacity LRU of whole entries with pins, all-or-nothing eviction."""

    def __init__(self, cap: int):
        self.cap = cap
        self.d: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.pins: dict[bytes, int] = {}

    def used(self) -> int:
        return sum(v.nbytes for v in self.d.values())

    def put(self, key, val) -> bool:
        if key in self.d:
            self.d.move_to_end(key)
            return True
        need = self.used() + val.nbytes - self.cap
        victims, freed = [], 0
        for kk, v in self.d.items():
            if freed >= need:
                break
            if self.pins.get(kk, 0) == 0:
                victims.append(kk)
                freed += v.nbytes
        if val.nbytes > self.cap or freed < need:
            return False
        for kk in victims:
            del self.d[kk]
        self.d[key] = val
        return True

    def lookup(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.d:
            n += 1
        for kk in reversed(keys[:n]):
            self.d.move_to_end(kk)
        return keys[:n]


KEYS = [k(i) for i in range(8)]


class StoreMachine(RuleBasedStateMachine):
    @initialize(cap_entries=st.integers(0, 6), extra=st.integers(0, ENTRY - 1))
    def init(self, cap_entries, extra):
        cap = cap_entries * ENTRY + extra
        self.store = HostKVStore(cap)
        self.model = LRUModel(cap)
        self.puts = self.skips = 0

    @rule(i=st.integers(0, len(KEYS) - 1), seed=st.integers(0, 2**16))
    def put(self, i, seed):
        val = kv(seed)
        expect = self.model.put(KEYS[i], val)
        assert self.store.put(KEYS[i], val) == expect
        self.skips += not expect

    @rule(idx=st.lists(st.integers(0, len(KEYS) - 1), max_size=6))
    def lookup(self, idx):
        keys = [KEYS[i] for i in idx]
        assert self.store.lookup(keys) == self.model.lookup(keys)

    @rule(i=st.integers(0, len(KEYS) - 1))
    def pin(self, i):
        if KEYS[i] in self.model.d:
            self.store.pin([KEYS[i]])
            self.model.pins[KEYS[i]] = self.model.pins.get(KEYS[i], 0) + 1
        else:
            with pytest.raises(KeyError):
                self.store.pin([KEYS[i]])

    @precondition(lambda self: any(self.model.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(kk for kk, c in self.model.pins.items() if c)))
        self.store.unpin([key])
        self.model.pins[key] -= 1

    @invariant()
    def consistent(self):
        s = self.store.stats
        assert s.bytes_in_use <= s.capacity_bytes
        assert s.bytes_in_use == self.model.used()
        assert s.stores_skipped == self.skips
        assert self.store.keys_lru() == list(self.model.d)
        for kk, c in self.model.pins.items():
            assert self.store.pin_count(kk) == c
            if c:
                assert kk in self.store  # pinned never evicted
        got = self.store.get(list(self.model.d))
        for a, (kk, v) in zip(got, self.model.d.items()):
            assert a.shape == SHAPE
            np.testing.assert_array_equal(np.asarray(a), v)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
