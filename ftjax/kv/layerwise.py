"""Layerwise KV load/store inside the prefill layer scan (DESIGN.md 1.4, after LMCache).

:class:`LayerwiseKV` implements the ``ftjax.seams.KVHook`` seam of the decoder (``model.forward``):

* **Rows.** One call serves any set of batch rows (:class:`HookRow`: the row, how many of the
  prefix's chunk arrays are its own, how many new chunks it emits; static, so one program per set
  used). The prefix argument is every served row's chunks, in the rows' order; each row's chunks
  go into its own cache row and each row's new chunks are read from its own cache row, so rows
  prefilled together each reuse and store exactly what they would alone.

* **Load (retrieve).** The reused prefix arrives as a tuple of chunk arrays, each
  ``[L, 2, C, Hkv, hd]`` (axis 1: K, V) in host memory (``pinned_host``), exactly as
  :class:`ftjax.kv.host_store.HostKVStore` holds them; they are never concatenated on the host
  (that would be host math). For each layer, every chunk's ``[2, C, Hkv, hd]`` slice is moved to
  the device with ``jax.device_put(..., jax.memory.Space.Device)`` right after the slice (the
  only operation ever applied to host data; DESIGN.md section 2), a row's ``n`` device slices are
  concatenated on the device and written into cache rows ``[0, n*C)`` of that batch row with one
  ``dynamic_update_slice`` per K and V. Two variants (``variant``):

  - ``"prefetch"``: layer ``l + 1``'s slices are copied while layer ``l`` computes: the copy
    is issued in iteration ``l`` (``dynamic_index_in_dim(chunk, l + 1)`` + ``device_put``) and
    carried to iteration ``l + 1`` (the scan carries one layer of prefix KV per row, ``[2, n*C,
    Hkv, hd]`` on the device). Layer 0 is fetched before the scan. The last iteration re-fetches
    layer ``L - 1`` (clamped index; ``1/L`` extra bytes) so the trip count and shapes stay fixed.
  - ``"xs"``: the chunk arrays are scan ``xs`` (the JAX docs' host-offloading
    parameter-streaming pattern); iteration ``l`` copies its own layer's slices.

  Both are the same program whether the prefix hits or misses (``n = 0`` is a static empty
  tuple): no per-request control flow, no yield protocol to get wrong (LMCache's bugs).
  The same code with *device* chunk arrays is the "load all layers first" ablation: the arrays
  are moved to the device before the call, and the in-scan ``device_put`` is a no-op.

* **Store.** A row with ``store_chunks = m > 0``: its call's first ``m * C`` tokens form ``m`` new
  full chunks (the caller guarantees that row's call starts on a chunk boundary and
  ``start + m*C <= S_max``). After the layer has written this call's K/V, each layer emits ``m``
  arrays ``[2, C, Hkv, hd]`` per storing row, sliced from the updated cache rows (so they are
  exactly what the cache holds, and the K/V computation keeps its only consumer, the cache write:
  XLA fuses it as in the hook-free program and the math stays bit-identical), as scan outputs
  moved to host memory inside the body (``jax.device_put(..., jax.memory.Space.Host)``) when
  ``store_to_host``; the scan stacks them into arrays ``[L, 2, C, Hkv, hd]``, the rows' chunks one
  after another in the rows' order, ready for ``HostKVStore.put``. With ``store_to_host=False``
  they stay on the device and the caller moves them after the step.

Models with Gated DeltaNet layers (Qwen3.5): an entry is ``(kv, conv, rec)``, the KV of the attention
layers and the Gated DeltaNet layers' conv and recurrent state (by block, ``[G, Nl, ...]``) at
the chunk's end. The prefix is then a tuple of such entries; each row's last one's state (the state
where its reused prefix ends; padding repeats that chunk) is copied to the device and written into
that row's linear states before the first layer (:meth:`LayerwiseKV.load_state`; ~63 MB per chunk for
the 35B-A3B). When storing, :meth:`state_points` tells the layers which rows' new chunks end where and
:meth:`state_output` moves their states to host memory inside the scan body, beside the KV.

Prefix padding: to bound recompiles the caller may pass more chunk arrays than were hit for a row
(:func:`bucket_chunks`), repeating its last hit chunk. The padded rows ``[n_hit*C, n_pad*C)``
then hold stale data that is harmless: every row below the prompt length is rewritten by this
call's (or a later call's) own K/V before any query can see it (attention is causal by
absolute position, and the call's own write comes after the prefix write in the layer body),
and rows at or beyond the prompt length are invisible until decode writes them. The caller
must keep ``n_pad * C <= S_max`` (a clamped ``dynamic_update_slice`` would overwrite real rows).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp

__all__ = ["VARIANTS", "HookRow", "KVStep", "LayerwiseKV", "bucket_chunks", "load_prefix_only"]

VARIANTS = ("prefetch", "xs")


@dataclasses.dataclass(frozen=True)
class HookRow:
    """One batch row the KV hook serves in a call (hashable, static).

    row: the batch row; prefix_chunks: how many of the prefix argument's chunk arrays are this row's
    (written into its cache rows ``[0, prefix_chunks * C)``; 0: it loads none); store_chunks: ``m`` new
    full chunks it emits (its call's tokens ``[0, m*C)``; 0: none).
    """

    row: int
    prefix_chunks: int = 0
    store_chunks: int = 0


@dataclasses.dataclass(frozen=True)
class KVStep:
    """The KV hook's static options in one jitted step (hashable: part of the step's identity).

    variant: one of :data:`VARIANTS`; chunk_tokens: ``C``; store_to_host: place the emitted chunks in host
    memory inside the scan body; rows: the :class:`HookRow` of every batch row it serves, in the order of
    their chunks in the prefix argument and in ``ForwardOut.kv_out``.
    """

    variant: str
    chunk_tokens: int
    store_to_host: bool
    rows: tuple[HookRow, ...] = (HookRow(0),)

    @property
    def store_chunks(self) -> int:
        """New chunks the call emits, over all its rows."""
        return sum(r.store_chunks for r in self.rows)

    def hook(self, prefix: Sequence[jax.Array], variant: str | None = None,
             store_to_host: bool | None = None) -> "LayerwiseKV":
        """The hook for these options and the step's ``prefix`` chunk arrays (``variant`` and
        ``store_to_host`` replace the options' own when given: a driver's)."""
        return LayerwiseKV(prefix, variant or self.variant, chunk_tokens=self.chunk_tokens,
                           store_to_host=self.store_to_host if store_to_host is None else store_to_host,
                           rows=self.rows)


def bucket_chunks(n: int) -> int:
    """Padded chunk count for ``n`` hit chunks: ``n`` rounded up to a multiple of
    ``max(1, 2**(floor(log2 n) - 2))`` (exact up to 7; four buckets per octave above, so at most
    25% extra bytes are copied; e.g. 62 -> 64). ``n <= 0`` gives 0."""
    if n <= 0:
        return 0
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def split_runs(items: Sequence, counts: Sequence[int]) -> list[tuple]:
    """``items`` cut into consecutive runs of ``counts[i]`` items each (what each batch row owns of a call's
    chunks, the rows' runs one after another): a tuple per count, empty for 0."""
    ends = list(itertools.accumulate(counts))
    return [tuple(items[end - n:end]) for n, end in zip(counts, ends)]


class LayerwiseKV:
    """The KV hook of ``model.forward`` (see the module docstring).

    Args:
      prefix: tuple of chunk arrays, each ``[L, 2, C, Hkv, hd]`` in the cache dtype, in host memory
        (layerwise load) or device memory (load-all-first ablation): every served row's, in the order of
        ``rows``. Empty: no prefix (or, on the layer-pipelined driver, each layer's slices arrive as the
        layer's ``xs``). A hybrid model's chunks are ``(kv, conv, rec)`` tuples (see the module docstring).
      variant: ``"prefetch"`` or ``"xs"``.
      store_chunks: ``m``, new full chunks to emit from ``row`` (the call's tokens ``[0, m*C)``, i.e. cache
        rows ``[start, start + m*C)``, which must lie below S_max); 0: none. With ``rows``: ignored.
      chunk_tokens: ``C``.
      store_to_host: place the emitted chunks in host memory inside the scan body.
      row: the one batch row (a Python int, static) the whole prefix is written into and the new chunks
        read from. With ``rows``: ignored.
      rows: the :class:`HookRow` of each served row (several rows in one call); default one row,
        ``HookRow(row, len(prefix), store_chunks)``.
    Raises:
      ValueError: unknown variant, chunk arrays of different shapes, a bad layout, a negative or repeated
        row, or a prefix whose length is not the rows' chunks.
    """

    def __init__(self, prefix: Sequence[jax.Array], variant: str = "prefetch", store_chunks: int = 0,
                 chunk_tokens: int = 256, store_to_host: bool = True, row: int = 0,
                 rows: Sequence[HookRow] | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"unknown layerwise variant {variant!r}; expected one of {VARIANTS}")
        prefix = tuple(prefix)
        rows = tuple(rows) if rows is not None else (HookRow(int(row), len(prefix), int(store_chunks)),)
        if any(int(r.row) < 0 for r in rows):
            raise ValueError(f"the KV hook's rows must be >= 0, got {[r.row for r in rows]}")
        if len({r.row for r in rows}) != len(rows):
            raise ValueError(f"the KV hook's rows must differ, got {[r.row for r in rows]}")
        self.rows = rows
        self.prefix = tuple(c[0] if isinstance(c, tuple) else c for c in prefix)
        if self.prefix and len(self.prefix) != self.num_chunks:
            raise ValueError(f"{len(self.prefix)} prefix chunks, but the rows own {self.num_chunks}")
        # per row with a prefix: the linear states of its last chunk (a hybrid model's), else ()
        self.state = tuple((row, tuple(chunks[-1][1:])) for row, chunks in self._by_row(prefix)
                           if prefix and isinstance(prefix[0], tuple))
        shapes = {tuple(c.shape) for c in self.prefix}
        if len(shapes) > 1:
            raise ValueError(f"prefix chunks must share one shape, got {sorted(shapes)}")
        if self.prefix and (len(self.prefix[0].shape) != 5 or self.prefix[0].shape[1] != 2):
            raise ValueError(f"prefix chunk must be [L, 2, C, Hkv, hd], got {self.prefix[0].shape}")
        self.variant = variant
        self.chunk_tokens, self.store_to_host = int(chunk_tokens), bool(store_to_host)
        self.num_layers = self.prefix[0].shape[0] if self.prefix else 0

    @property
    def num_chunks(self) -> int:
        """Chunk arrays of the prefix, over all rows."""
        return sum(r.prefix_chunks for r in self.rows)

    @property
    def store_chunks(self) -> int:
        """New chunks emitted per layer, over all rows."""
        return sum(r.store_chunks for r in self.rows)

    def _by_row(self, parts: Sequence) -> list[tuple[int, tuple]]:
        """(row, its parts) of each row with a prefix, ``parts`` one per chunk array in the rows' order."""
        runs = split_runs(parts, [r.prefix_chunks for r in self.rows])
        return [(r.row, run) for r, run in zip(self.rows, runs) if r.prefix_chunks]

    # ---- KVHook ---------------------------------------------------------------------------
    def scan_xs(self) -> Any:
        return self.prefix if (self.prefix and self.variant == "xs") else None

    def init_carry(self) -> Any:
        if not self.prefix or self.variant != "prefetch":
            return None
        with jax.named_scope("kv_prefix_load"):
            return self._fetch_layer(jnp.int32(0))

    def before_attention(self, ck, cv, layer, xs, carry):
        if not self.prefix and not xs:  # xs without a prefix: the layer's slices handed over by a driver
            return ck, cv, carry
        with jax.named_scope("kv_prefix_load"):
            return self._load(ck, cv, layer, xs, carry)

    def _load(self, ck, cv, layer, xs, carry):
        """Writes this layer's prefix rows of every served row; prefetch: issues the next layer's copy."""
        if self.variant == "xs":
            if len(xs) != self.num_chunks:
                raise ValueError(f"{len(xs)} prefix slices for a layer, but the rows own {self.num_chunks} chunks")
            bufs = [self._concat([_to_device(s) for s in parts]) for _, parts in self._by_row(xs)]
        else:
            bufs = carry
            carry = self._fetch_layer(jnp.minimum(layer + 1, self.num_layers - 1))
        for (row, _), buf in zip(self._by_row(range(self.num_chunks)), bufs):
            ck = self._write(ck, buf[0], layer, row)
            cv = self._write(cv, buf[1], layer, row)
        return ck, cv, carry

    def layer_output(self, ck, cv, layer, start):
        c = self.chunk_tokens
        if self.store_chunks == 0:
            return None
        m = max(r.store_chunks for r in self.rows)
        if m * c > ck.shape[2]:
            raise ValueError(f"store_chunks {m} x {c} tokens exceed the cache length {ck.shape[2]}")
        with jax.named_scope("kv_store"):
            return self._emit(ck, cv, layer, start)

    def _emit(self, ck, cv, layer, start):
        """The call's new chunks of this layer, each storing row's m in the rows' order, sliced from the
        updated caches: a tuple of [2, C, Hkv, hd]."""
        c = self.chunk_tokens
        z = jnp.zeros((), jnp.int32)
        out = []
        for r in self.rows:
            for j in range(r.store_chunks):
                idx = (layer.astype(jnp.int32), jnp.int32(r.row), start[r.row].astype(jnp.int32) + j * c, z, z)
                size = (1, 1, c) + ck.shape[3:]
                kv = jnp.concatenate([jax.lax.dynamic_slice(ck, idx, size),
                                      jax.lax.dynamic_slice(cv, idx, size)], axis=1)[0]  # [2, C, Hkv, hd]
                out.append(jax.device_put(kv, jax.memory.Space.Host) if self.store_to_host else kv)
        return tuple(out)

    # ---- linear-layer state (hybrid models) ----------------------------------------------------
    def state_points(self) -> tuple[tuple[int, int], ...]:
        """(row, call-relative token count) where each new chunk ends (its state is stored), in the order of
        the emitted chunks."""
        return tuple((r.row, (j + 1) * self.chunk_tokens) for r in self.rows for j in range(r.store_chunks))

    def state_output(self, states: Any) -> Any:
        """The linear states at the state points, moved to host memory (when ``store_to_host``)."""
        if not self.store_to_host:
            return states
        with jax.named_scope("kv_store"):
            return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), states)

    def load_state(self, cache):
        """``cache`` (``ftjax.seams.KVCache``) with each served row's linear states set to its reused prefix's
        stored state (copied to the device here); unchanged without a stored state."""
        if not self.state:
            return cache
        with jax.named_scope("kv_prefix_state_load"):
            conv, rec = cache.conv, cache.rec
            for row, state in self.state:
                s_conv, s_rec = (_to_device(a) for a in state)
                s_conv = s_conv.reshape((-1,) + s_conv.shape[2:])  # [G, Nl, ...] -> [L_lin, ...]
                s_rec = s_rec.reshape((-1,) + s_rec.shape[2:])
                conv = conv.at[:, row].set(s_conv.astype(conv.dtype))
                rec = rec.at[:, row].set(s_rec.astype(rec.dtype))
            return cache._replace(conv=conv, rec=rec)

    # ---- helpers --------------------------------------------------------------------------
    def _fetch_layer(self, layer: jax.Array) -> list[jax.Array]:
        """Device copy of one layer of the prefix, one array [2, n*C, Hkv, hd] per row with a prefix. Each
        host slice goes straight into ``device_put``; the concatenation happens on the device."""
        return [self._concat([_to_device(jax.lax.dynamic_index_in_dim(c, layer, keepdims=False)) for c in chunks])
                for _, chunks in self._by_row(self.prefix)]

    @staticmethod
    def _concat(parts: list[jax.Array]) -> jax.Array:
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    @staticmethod
    def _write(cache: jax.Array, rows: jax.Array, layer: jax.Array, row: int = 0) -> jax.Array:
        """cache [L, B, S, Hkv, hd]; rows [n*C, Hkv, hd] -> cache[layer, row, :n*C] = rows."""
        if rows.shape[0] > cache.shape[2]:
            raise ValueError(f"prefix of {rows.shape[0]} rows exceeds the cache length {cache.shape[2]}")
        if row >= cache.shape[1]:
            raise ValueError(f"the KV hook's row {row} is outside the cache's batch of {cache.shape[1]}")
        z = jnp.zeros((), jnp.int32)
        return jax.lax.dynamic_update_slice(cache, rows[None, None].astype(cache.dtype),
                                            (layer.astype(jnp.int32), jnp.int32(row), z, z, z))


def load_prefix_only(ck: jax.Array, cv: jax.Array, prefix: Sequence[jax.Array],
                     variant: str = "prefetch") -> tuple[jax.Array, jax.Array]:
    """Runs only the hook's loads through a layer scan (no model math): writes the prefix into
    cache rows [0, n*C) of every layer. For tests and for measuring the in-scan copy bandwidth
    (``experiments/bench_kv_reuse.py``). Jit it with the caches donated.

    ck, cv: [L, B, S, Hkv, hd]; prefix: as for :class:`LayerwiseKV`. Returns the new caches.
    """
    hook = LayerwiseKV(prefix, variant)

    def body(carry, xs):
        ck, cv, hc = carry
        l, hx = xs
        ck, cv, hc = hook.before_attention(ck, cv, l, hx, hc)
        return (ck, cv, hc), None

    layers = jnp.arange(ck.shape[0], dtype=jnp.int32)
    (ck, cv, _), _ = jax.lax.scan(body, (ck, cv, hook.init_carry()), (layers, hook.scan_xs()))
    return ck, cv
