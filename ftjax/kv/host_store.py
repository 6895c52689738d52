"""Host-memory KV prefix store: LRU over whole all-layer chunks (DESIGN.md section 1.4).

After LMCache's chunked prefix caching with chained hashes: a prompt is cut into chunks
(:mod:`ftjax.kv.chunk_keys`), and the KV of each full chunk is kept in host memory under
its chained key.  This module is the pure-host bookkeeping; the model integration (the
layerwise copy inside the prefill scan) lives elsewhere.

Rules (DESIGN.md 1.4):

* One entry = one chunk with K and V of **all** layers, a single array ``kv`` of shape
  ``[L, 2, chunk_tokens, num_kv_heads, head_dim]`` (axis 1: 0 = K, 1 = V), any dtype.  It
  is stored and evicted as one unit, so the store never holds a chunk with some layers
  missing (LMCache crashed on per-layer eviction).  A hybrid model's entry is a tuple
  ``(kv, *states)``: the KV of its full-attention layers, then its linear layers' conv and
  recurrent state at the chunk's end (``ftjax.layers.gated_deltanet``); the tuple is one unit the same way.
* LRU over chunks; :meth:`HostKVStore.lookup` makes a reused prefix most recent.
* Storing is best effort: when the entry does not fit and nothing (enough) can be
  evicted, :meth:`HostKVStore.put` skips the store and returns ``False``; it never raises
  for lack of room and never stalls.
* Entries used by a running request are pinned (reference counted) and never evicted.

All sizes are in bytes.  The store is thread-safe (one lock around the bookkeeping).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ftjax.memory import host_sharding

__all__ = ["HostKVStore", "KVStoreStats", "entry_nbytes"]

#: Expected layout of one entry, for error messages.
ENTRY_LAYOUT = "[L, 2, chunk_tokens, num_kv_heads, head_dim]"


@dataclasses.dataclass(frozen=True)
class KVStoreStats:
    """Snapshot of :class:`HostKVStore` counters.  Byte counts are bytes.

    Attributes:
      chunks_hit: chunks returned as part of a reused prefix by ``lookup`` (cumulative).
      chunks_missed: requested chunks ``lookup`` could not serve, i.e. ``len(keys) -
        len(prefix)`` per call: the chunk that ended the prefix and every chunk after it
        (later chunks are unusable without it, even if stored).  They must be recomputed.
      lookups: number of ``lookup`` calls.
      chunks_stored: successful new inserts by ``put``.
      chunks_evicted: entries evicted by LRU to make room.
      stores_skipped: ``put`` calls that did not fit and were skipped (returned False).
      bytes_stored: cumulative bytes inserted by ``put``.
      bytes_loaded: cumulative bytes handed out by ``get`` (+ ``record_loaded``).
      bytes_in_use: bytes currently held by entries (always <= capacity_bytes).
      bytes_pinned: bytes of entries currently pinned (pin count > 0).
      capacity_bytes: the byte budget.
      num_entries: entries currently held.
      num_pinned: entries currently pinned.
    """

    chunks_hit: int = 0
    chunks_missed: int = 0
    lookups: int = 0
    chunks_stored: int = 0
    chunks_evicted: int = 0
    stores_skipped: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    bytes_in_use: int = 0
    bytes_pinned: int = 0
    capacity_bytes: int = 0
    num_entries: int = 0
    num_pinned: int = 0

    @property
    def hit_rate(self) -> float:
        """chunks_hit / (chunks_hit + chunks_missed); 0.0 before any lookup."""
        total = self.chunks_hit + self.chunks_missed
        return self.chunks_hit / total if total else 0.0


def entry_nbytes(entry: Any) -> int:
    """Bytes of one entry: its array, or the sum over a ``(kv, *states)`` tuple."""
    return sum(int(np.prod(np.shape(a), dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(entry))


class HostKVStore:
    """LRU store of all-layer KV chunks in host memory, keyed by chained chunk hashes.

    Entries are JAX arrays of shape ``[L, 2, chunk_tokens, num_kv_heads, head_dim]`` placed
    with ``jax.device_put`` in the host memory kind (``pinned_host`` by default; see
    :func:`host_sharding` for the fallback).  The first successful ``put`` fixes the entry
    shape and dtype; later puts must match.

    Typical request flow::

        keys = chunk_keys(prompt, C, ident)
        hit = store.lookup(keys)               # longest stored prefix, made most recent
        with store.in_use(hit):                # pinned: cannot be evicted meanwhile
            kv_chunks = store.get(hit)         # host arrays, copied layerwise to device
            ... prefill the rest ...
        for k, kv in new_chunks: store.put(k, kv)   # best effort, may return False

    Args:
      capacity_bytes: byte budget for all entries (sum of ``kv.nbytes``), >= 0.  0 stores
        nothing (every put is skipped).
      memory_kind: memory kind for entries, ``None`` for the device default.

    Raises:
      ValueError: ``capacity_bytes < 0``.
      TypeError: ``capacity_bytes`` is not an int.
    """

    def __init__(self, capacity_bytes: int, memory_kind: str | None = "pinned_host"):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = int(capacity_bytes)
        self._sharding = host_sharding(memory_kind)
        self._lock = threading.RLock()
        # key -> array; iteration order = LRU order, first = least recently used.
        self._entries: OrderedDict[bytes, jax.Array] = OrderedDict()
        self._pins: dict[bytes, int] = {}
        self._entry_shape: tuple[int, ...] | None = None
        self._entry_dtype: np.dtype | None = None
        self._bytes_in_use = 0
        self._bytes_pinned = 0
        self._c = dict(
            chunks_hit=0,
            chunks_missed=0,
            lookups=0,
            chunks_stored=0,
            chunks_evicted=0,
            stores_skipped=0,
            bytes_stored=0,
            bytes_loaded=0,
        )

    # ------------------------------------------------------------------ properties
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Sharding entries are placed with (host memory kind where available)."""
        return self._sharding

    @property
    def memory_kind(self) -> str | None:
        """Memory kind actually used for entries (after fallback)."""
        return self._sharding.memory_kind

    @property
    def entry_shape(self) -> tuple[int, ...] | None:
        """``(L, 2, chunk_tokens, num_kv_heads, head_dim)`` fixed by the first put, or None."""
        return self._entry_shape

    @property
    def entry_dtype(self) -> np.dtype | None:
        return self._entry_dtype

    @property
    def stats(self) -> KVStoreStats:
        """Consistent snapshot of the counters."""
        with self._lock:
            return KVStoreStats(
                **self._c,
                bytes_in_use=self._bytes_in_use,
                bytes_pinned=self._bytes_pinned,
                capacity_bytes=self._capacity,
                num_entries=len(self._entries),
                num_pinned=len(self._pins),
            )

    def stats_dict(self) -> dict[str, Any]:
        """JSON-ready dict of :attr:`stats` (plus ``hit_rate``)."""
        s = self.stats
        d = dataclasses.asdict(s)
        d["hit_rate"] = s.hit_rate
        return d

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys_lru(self) -> list[bytes]:
        """Keys from least to most recently used (the eviction order, pins aside)."""
        with self._lock:
            return list(self._entries)

    def pin_count(self, key: bytes) -> int:
        return self._pins.get(key, 0)

    # ------------------------------------------------------------------ validation
    def _check_entry(self, kv: Any) -> tuple[Any, Any]:
        """(shape, dtype) of an entry: of its array, or tuples of them for a ``(kv, *states)`` entry."""
        if isinstance(kv, tuple):
            if not kv:
                raise ValueError("KV entry tuple is empty; expected (kv, *states)")
            self._check_kv_array(kv[0])
            shape = tuple(tuple(int(d) for d in np.shape(a)) for a in kv)
            dtype = tuple(np.dtype(a.dtype) for a in kv)
        else:
            shape, dtype = self._check_kv_array(kv)
        if self._entry_shape is not None and (shape != self._entry_shape or dtype != self._entry_dtype):
            raise ValueError(
                f"KV entry shape/dtype mismatch: store holds {self._entry_shape} {self._entry_dtype}, "
                f"got {shape} {dtype}"
            )
        return shape, dtype

    @staticmethod
    def _check_kv_array(kv: Any) -> tuple[tuple[int, ...], np.dtype]:
        shape = tuple(int(d) for d in np.shape(kv))
        if len(shape) != 5:
            raise ValueError(f"KV entry must have shape {ENTRY_LAYOUT} (ndim 5), got shape {shape}")
        if shape[1] != 2:
            raise ValueError(f"KV entry must have shape {ENTRY_LAYOUT} with axis 1 == 2 (K, V), got shape {shape}")
        return shape, np.dtype(kv.dtype if hasattr(kv, "dtype") else np.asarray(kv).dtype)

    # ------------------------------------------------------------------ core ops
    def put(self, key: bytes, kv: Any, *, copy: bool = True) -> bool:
        """Store one chunk's all-layer KV under ``key``; best effort.

        Args:
          key: chunk key from :func:`ftjax.kv.chunk_keys.chunk_keys`.
          kv: array (JAX or numpy) of shape ``[L, 2, chunk_tokens, num_kv_heads, head_dim]``,
            any dtype; copied into host memory with ``jax.device_put``.  Size = ``kv.nbytes``.
          copy: when False and ``kv`` is a JAX array already placed with :attr:`sharding`
            (e.g. a jitted step's output in ``pinned_host``), the store adopts it without a
            host-to-host copy; the caller must then not delete or donate it.

        Returns:
          True if ``key`` is now stored (newly, or already present: then only its recency is
          refreshed and nothing new is stored).  False if it did not fit: larger than the
          capacity, or evicting every unpinned entry would still not make room.  In that
          case nothing is evicted and ``stores_skipped`` is incremented.

        Raises:
          ValueError: ``kv.ndim != 5`` / axis 1 != 2, or shape/dtype differ from the
            entries already stored (the first put fixes them).
          TypeError: ``key`` is not bytes.
        """
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        key = bytes(key)
        if isinstance(kv, tuple):
            kv = tuple(a if hasattr(a, "shape") and hasattr(a, "dtype") else np.asarray(a) for a in kv)
        elif not (hasattr(kv, "shape") and hasattr(kv, "dtype")):
            kv = np.asarray(kv)  # lists etc.; device_put would treat a list as a pytree
        with self._lock:
            shape, dtype = self._check_entry(kv)
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            nbytes = entry_nbytes(kv)
            if not self._make_room(nbytes):
                self._c["stores_skipped"] += 1
                return False
            if not copy and all(isinstance(a, jax.Array) and a.sharding == self._sharding for a in jax.tree.leaves(kv)):
                arr = kv  # adopted (see ``copy``)
            else:
                # may_alias=False: always our own copy, so the caller deleting/donating its
                # array cannot invalidate the stored entry.
                arr = jax.device_put(kv, self._sharding, may_alias=False)
            self._entries[key] = arr
            self._bytes_in_use += nbytes
            self._entry_shape, self._entry_dtype = shape, dtype
            self._c["chunks_stored"] += 1
            self._c["bytes_stored"] += nbytes
            return True

    def _make_room(self, nbytes: int) -> bool:
        """Evict LRU unpinned entries until ``nbytes`` fits; all-or-nothing."""
        if nbytes > self._capacity:
            return False
        need = self._bytes_in_use + nbytes - self._capacity
        if need <= 0:
            return True
        victims: list[bytes] = []
        freed = 0
        for k, a in self._entries.items():  # least recent first
            if k in self._pins:
                continue
            victims.append(k)
            freed += entry_nbytes(a)
            if freed >= need:
                break
        if freed < need:  # pinned entries block it: skip rather than evict for nothing
            return False
        for k in victims:
            a = self._entries.pop(k)
            self._bytes_in_use -= entry_nbytes(a)
            self._c["chunks_evicted"] += 1
        return True

    def lookup(self, keys: Sequence[bytes]) -> list[bytes]:
        """Longest contiguous prefix of ``keys`` that is stored; makes it most recent.

        Stops at the first missing key: a chunk's KV is only usable if every earlier chunk
        is reused too.  The hit keys are touched in *reverse* order, so afterwards the first
        chunk of the prefix is the most recent and the last one the least recent of them.
        Under LRU pressure the prefix then shrinks from its tail (LMCache evicts later
        chunks first): what remains is still a contiguous, reusable prefix.  Touching in
        forward order would evict the first chunk first, which makes every later chunk of
        the prefix unreachable while still occupying memory.

        Counts ``chunks_hit += len(prefix)`` and ``chunks_missed += len(keys) - len(prefix)``.

        Returns:
          ``keys[:n]`` for the largest ``n`` with all of them stored.
        """
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._entries:
                    break
                n += 1
            hit = list(keys[:n])
            for k in reversed(hit):
                self._entries.move_to_end(k)
            self._c["lookups"] += 1
            self._c["chunks_hit"] += n
            self._c["chunks_missed"] += len(keys) - n
            return hit

    def get(self, keys: Iterable[bytes]) -> list[jax.Array]:
        """Host-memory arrays for ``keys`` (in order); counts their bytes in ``bytes_loaded``.

        Does not change recency (``lookup`` does).  Pin the keys (``in_use``) for as long as
        the arrays are being copied if other threads may put concurrently; the returned
        arrays stay valid regardless (eviction only drops the store's reference).

        Raises:
          KeyError: a key is not stored.
        """
        with self._lock:
            out = []
            for k in keys:
                try:
                    out.append(self._entries[k])
                except KeyError:
                    raise KeyError(f"KV chunk {bytes(k).hex()[:16]}... not in store") from None
            self._c["bytes_loaded"] += sum(entry_nbytes(a) for a in out)
            return out

    def peek(self, key: bytes) -> Any:
        """The entry stored under ``key`` (its array, or its ``(kv, *states)`` tuple), or None when
        it is not stored.  Unlike :meth:`get`, changes neither recency nor any counter: for
        inspecting entries (their layout and bytes) without counting a load."""
        with self._lock:
            return self._entries.get(bytes(key))

    def record_loaded(self, nbytes: int) -> None:
        """Add ``nbytes`` to ``bytes_loaded`` (for loads done outside :meth:`get`)."""
        with self._lock:
            self._c["bytes_loaded"] += int(nbytes)

    # ------------------------------------------------------------------ pinning
    def pin(self, keys: Iterable[bytes]) -> None:
        """Increment the pin count of each key; pinned entries are never evicted.

        All-or-nothing: if any key is missing, nothing is pinned.  A key listed twice is
        pinned twice (and needs two unpins).

        Raises:
          KeyError: a key is not stored.
        """
        keys = list(keys)
        with self._lock:
            for k in keys:
                if k not in self._entries:
                    raise KeyError(f"cannot pin KV chunk {bytes(k).hex()[:16]}...: not in store")
            for k in keys:
                c = self._pins.get(k, 0)
                if c == 0:
                    self._bytes_pinned += entry_nbytes(self._entries[k])
                self._pins[k] = c + 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Decrement pin counts; at zero the entry is evictable again.

        All-or-nothing.  Unpinning more often than pinned is a bug (LMCache had double
        unpins) and raises instead of going negative.

        Raises:
          ValueError: a key's pin count would go below zero.
        """
        keys = list(keys)
        with self._lock:
            want: dict[bytes, int] = {}
            for k in keys:
                want[k] = want.get(k, 0) + 1
            for k, n in want.items():
                if self._pins.get(k, 0) < n:
                    raise ValueError(
                        f"unpin of KV chunk {bytes(k).hex()[:16]}... more times than pinned "
                        f"(pinned {self._pins.get(k, 0)}, unpin {n})"
                    )
            for k, n in want.items():
                c = self._pins[k] - n
                if c == 0:
                    del self._pins[k]
                    self._bytes_pinned -= entry_nbytes(self._entries[k])
                else:
                    self._pins[k] = c

    @contextlib.contextmanager
    def in_use(self, keys: Iterable[bytes]) -> Iterator[list[bytes]]:
        """Pin ``keys`` for the duration of the ``with`` block (unpinned even on error)."""
        keys = list(keys)
        self.pin(keys)
        try:
            yield keys
        finally:
            self.unpin(keys)
