"""Prefix reuse across requests: chunk keys + host KV store + layerwise prefill (DESIGN.md 1.4).

After LMCache (chunked prefix caching with chained hashes, layerwise retrieve/store), built on
:mod:`ftjax.kv.chunk_keys`, :class:`ftjax.kv.host_store.HostKVStore` and the layer-scan hook
:mod:`ftjax.kv.layerwise`. Like vLLM's KV connector, :class:`PrefixCache` only plans and moves
KV: the engine owns the step and runs it. One request (one batch row) goes through it as:

1. :meth:`PrefixCache.begin` (before the TTFT clock, but its time is reported as ``lookup_s``
   and added to TTFT by the engine): chained keys of the prompt's full chunks, ``store.lookup``
   (longest stored prefix, made most recent), pin the hit chunks, plan the prefill calls.
2. The engine's prefill (timed) asks :meth:`load_prefix` for the hit chunks' KV (host arrays,
   loaded layer by layer inside the first call; or, for the ``all_first`` ablation, moved to the
   device first), runs the calls with :meth:`step_options` (the KV hook's static options, with a
   :meth:`hook_row` for every row of the call that loads or stores), each call streaming or not as
   any prefill would, and hands the calls' new-chunk outputs to
   :meth:`finish`, which inserts them into the store, last chunk first, so that under LRU
   pressure what survives is a contiguous prefix, and unpins the hit chunks (also on error).

Reuse rules: a trailing partial chunk is never stored; at most ``len(prompt) - 1`` tokens are
reused, so a prompt whose chunks all hit loads them all and recomputes its last token (its K/V
row is rewritten by the same value) to produce logits. Each request is planned alone; in the engine it
takes any batch row, and the requests prefilling together run their calls in one forward call, each
row loading its own prefix and emitting its own new chunks (``KVStep.rows``: one
``ftjax.kv.layerwise.HookRow`` per row, :meth:`PrefixCache.hook_row`). A request's lookup sees the
chunks stored before it began, not those of requests still running.

Models with Gated DeltaNet layers (``ftjax.layers.gated_deltanet``): each stored chunk also holds the linear
layers' conv and recurrent state at its end, and a request resumes from the state of the last
chunk it reuses. A recurrent state cannot rewind, so only whole chunks are reused (a prompt whose
chunks all hit reuses all but the last one and recomputes that), and the chunk size must be a
multiple of the delta rule's chunk (``gated_deltanet.DELTA_CHUNK``, 64), so that the resumed
computation cuts the sequence where a recompute does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import jax
import numpy as np

from ftjax import memory
from ftjax import model as model_lib
from ftjax.config import KV_LOADS as LOADS
from ftjax.config import KV_STORE_ROUTES as STORE_ROUTES
from ftjax.config import KVOffloadConfig
from ftjax.kv.chunk_keys import chunk_keys, model_identity
from ftjax.kv.host_store import HostKVStore, entry_nbytes
from ftjax.kv.layerwise import HookRow, KVStep, bucket_chunks
from ftjax.layers import gated_deltanet
from ftjax.layers.gated_deltanet import DELTA_CHUNK
from ftjax.runtime.plan import PrefillCall, bucket

__all__ = ["LOADS", "STORE_ROUTES", "PrefixCache", "PrefixRequest"]


@dataclasses.dataclass
class PrefixRequest:
    """State of one request between :meth:`PrefixCache.begin` and :meth:`PrefixCache.finish`.

    Times in seconds, sizes in bytes. ``prefix_chunks`` is the padded count passed to the step
    (>= ``len(hit)``); ``load_s`` is the host-to-device copy time of the ``all_first`` ablation
    (0 for the layerwise loads, whose copies are inside the step); ``prepare_s`` the time
    :meth:`PrefixCache.finish` spent preparing the stored chunks for later loads.
    """

    prompt: list[int]
    keys: list[bytes]
    hit: list[bytes]
    reused_tokens: int
    prefix_chunks: int
    calls: list[PrefillCall]
    load: str
    lookup_s: float = 0.0
    load_s: float = 0.0
    prepare_s: float = 0.0
    prepare_error: str | None = None
    bytes_loaded: int = 0
    bytes_padding: int = 0
    chunks_stored: int = 0
    chunks_skipped: int = 0
    finished: bool = False

    def record(self) -> dict:
        """JSON-ready summary of the request's KV reuse."""
        return {"prompt_tokens": len(self.prompt), "full_chunks": len(self.keys), "hit_chunks": len(self.hit),
                "reused_tokens": self.reused_tokens, "prefix_chunks_passed": self.prefix_chunks,
                "prefill_calls": len(self.calls), "load": self.load, "lookup_s": self.lookup_s,
                "load_s": self.load_s, "prepare_s": self.prepare_s, "prepare_error": self.prepare_error,
                "bytes_loaded": self.bytes_loaded,
                "bytes_padding": self.bytes_padding, "chunks_stored": self.chunks_stored,
                "chunks_skipped": self.chunks_skipped}


class PrefixCache:
    """Plans prefix reuse for an :class:`ftjax.Engine` over a :class:`HostKVStore`.

    Pass it to ``Engine.generate(..., kv_manager=cache)``; one manager (and store) can serve many
    sequential requests of one model. Keys include the model identity (config, compute dtype and
    the weights' content fingerprint), so two models sharing a store never hit each other's chunks.

    Args:
      store: the host KV store (capacity in bytes).
      config: chunk size, load variant, store route, prefill chunk, ... (:class:`KVOffloadConfig`,
        validated there); default: 256-token chunks, layerwise load with the next layer prefetched.
    """

    def __init__(self, store: HostKVStore, config: KVOffloadConfig | None = None):
        self.store, self.config = store, config or KVOffloadConfig()
        self.requests: list[dict] = []
        self.store_errors = 0

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_tokens

    @property
    def load(self) -> str:
        return self.config.load

    # ---- keys -------------------------------------------------------------------------------
    def identity(self, engine) -> bytes:
        """32-byte model identity: config fields, compute (= KV) dtype, the weights' content
        fingerprint (``LoadedModel.fingerprint``: a hash of every tensor as the checkpoint was read,
        or the random generator with its seed; never the path, so a checkpoint rewritten in place
        gets new keys and the same weights elsewhere hit), and the expert format when the experts are
        not stored in the compute dtype (quantized). Recomputed on every call (a hash of a small
        dict): caching it by object id went stale when a model was freed."""
        from ftjax.checkpoint import model_fingerprint
        fields = dict(engine.cfg.identity(), weights=model_fingerprint(engine.model))
        banks = engine.model.banks
        if banks.fmt != "dense" or banks.gate_up.dtype != engine.dtype:  # quantized experts give other KV
            fields["experts"] = f"{banks.fmt}:{banks.gate_up.dtype}"
        return model_identity(fields, engine.dtype.name)

    def keys(self, engine, prompt: Sequence[int]) -> list[bytes]:
        """Chained keys of the prompt's full chunks (a trailing partial chunk has none)."""
        return chunk_keys(np.asarray(prompt, np.int64), self.chunk_tokens, self.identity(engine))

    def entry_bytes(self, engine) -> int:
        """Bytes of one stored chunk: L_att * 2 * C * Hkv * hd * itemsize, plus a hybrid model's
        linear states at the chunk's end."""
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(self._entry_spec(engine)))

    def _entry_spec(self, engine, sharding=None):
        """``jax.ShapeDtypeStruct`` of one stored chunk: the KV array, or for a hybrid model the
        tuple (KV, conv [G, Nl, K-1, cd], rec [G, Nl, Hv, dk, dv] float32)."""
        cfg = engine.cfg
        kv = jax.ShapeDtypeStruct((cfg.num_attention_layers, 2, self.chunk_tokens, cfg.num_kv_heads, cfg.head_dim),
                                  engine.dtype, sharding=sharding)
        if not cfg.is_hybrid:
            return kv
        conv, rec = gated_deltanet.state_shapes(cfg, cfg.num_linear_layers, 1)
        g = model_lib.structure(cfg).num_blocks
        by_block = lambda sh: (g, sh[0] // g) + sh[2:]  # noqa: E731  [L_lin, 1, ...] -> [G, Nl, ...]
        return (kv, jax.ShapeDtypeStruct(by_block(conv), engine.dtype, sharding=sharding),
                jax.ShapeDtypeStruct(by_block(rec), np.float32, sharding=sharding))

    # ---- one request ------------------------------------------------------------------------
    def begin(self, engine, prompts: Sequence[Sequence[int]]) -> PrefixRequest:
        """Keys, lookup, pin and plan for one request (one prompt). The caller must call
        :meth:`finish` afterwards (the engine's prefill does), which unpins the hit chunks.

        Raises:
          ValueError: more than one prompt, or an empty prompt.
        """
        if len(prompts) != 1:
            raise ValueError(f"KV prefix reuse runs one request at a time (batch 1), got {len(prompts)} prompts")
        prompt = [int(t) for t in prompts[0]]
        if not prompt:
            raise ValueError("prompt is empty")
        c = self.chunk_tokens
        if engine.cfg.is_hybrid and c % DELTA_CHUNK:
            raise ValueError(f"KV chunk tokens {c} must be a multiple of {DELTA_CHUNK} for a model with Gated "
                             f"DeltaNet layers (stored states sit on the delta rule's chunk boundaries)")
        t0 = time.perf_counter()
        keys = self.keys(engine, prompt)
        hit = self.store.lookup(keys) if self._compatible(engine) else []
        if engine.cfg.is_hybrid:  # whole chunks only: the recurrent state cannot rewind
            hit = hit[: (len(prompt) - 1) // c]
        self.store.pin(hit)
        n = len(hit)
        reused = min(n * c, len(prompt) - 1)
        padded = n
        if n and self.config.bucket_prefix and bucket_chunks(n) * c <= engine.max_seq_len:
            padded = bucket_chunks(n)
        calls, pos = [], reused
        while pos < len(prompt):
            valid = min(self.config.prefill_chunk, len(prompt) - pos)
            t = bucket(valid)
            # new-chunk outputs: whole chunks of the padded call that lie inside the cache
            store = self.config.store_new and pos % c == 0 and valid >= c
            m = min(t, engine.max_seq_len - pos) // c if store else 0
            calls.append(PrefillCall(pos, (valid,), t, m, pos // c, bool(n) and not calls))
            pos += valid
        return PrefixRequest(prompt, keys, hit, reused, padded, calls, self.load, lookup_s=time.perf_counter() - t0)

    def hook_row(self, req: PrefixRequest, call: PrefillCall, row: int) -> HookRow:
        """The KV hook's part of one of the request's calls run in batch row ``row``: the prefix chunks it loads
        (``req.prefix_chunks`` in its first call when it reuses, else 0) and the new chunks it emits."""
        return HookRow(int(row), req.prefix_chunks if call.with_prefix else 0, call.store_chunks)

    def step_options(self, rows: Sequence[HookRow]) -> KVStep:
        """The KV hook's static options for one call serving ``rows`` (:meth:`hook_row` of each request's call,
        in the order of their chunks in the prefix argument)."""
        variant = "xs" if self.load == "all_first" else self.load
        return KVStep(variant, self.chunk_tokens, self.config.store_route == "scan", tuple(rows))

    def prefix_spec(self, engine, req: PrefixRequest) -> tuple:
        """Shapes (``jax.ShapeDtypeStruct``) of the prefix argument of the request's first call,
        for compiling it ahead of time."""
        sharding = memory.device_sharding() if self.load == "all_first" else self.store.sharding
        return tuple(self._entry_spec(engine, sharding) for _ in range(req.prefix_chunks))

    def load_prefix(self, req: PrefixRequest) -> tuple:
        """The hit chunks' KV for the first call, padded to ``req.prefix_chunks`` arrays
        ``[L, 2, C, Hkv, hd]``: host arrays (layerwise load), or device arrays for ``all_first``
        (the copy timed into ``req.load_s``).

        Raises:
          RuntimeError: the request was already run.
        """
        if req.finished:
            raise RuntimeError("this request's prefill already ran")
        if not req.hit:
            return ()
        prefix = self.store.get(req.hit)
        req.bytes_loaded = sum(entry_nbytes(a) for a in prefix)
        pad = req.prefix_chunks - len(prefix)
        req.bytes_padding = pad * entry_nbytes(prefix[-1])
        prefix = prefix + [prefix[-1]] * pad
        if self.load == "all_first":
            t0 = time.perf_counter()
            prefix = jax.device_put(prefix, memory.device_sharding())
            jax.block_until_ready(prefix)
            req.load_s = time.perf_counter() - t0
        return tuple(prefix)

    def finish(self, req: PrefixRequest, kv_outs: Sequence | None,
               prepare: Callable[[list], float] | None = None) -> None:
        """Ends the request: stores its new full chunks (``kv_outs``: the KV-hook outputs of each
        call, in call order; None when the prefill failed: nothing is stored) and unpins the hit
        chunks. Storing is best effort and never raises for the store. A second call is a no-op
        (the hit chunks were unpinned by the first). prepare: called with the stored entries' KV
        arrays (e.g. ``ftjax.runtime.transfers.warm_prefix_chunks``), returning seconds (``prepare_s``); best
        effort too: an error is recorded (``prepare_error``), not raised, and the chunks stay stored."""
        if req.finished:
            return
        req.finished = True
        try:
            if kv_outs is not None:
                stored = self._store_new(req, kv_outs)
                if prepare is not None and stored:
                    try:
                        req.prepare_s = prepare(stored)
                    except Exception as e:  # noqa: BLE001 - an optimisation: a reuse makes what it needs later
                        req.prepare_error = f"{type(e).__name__}: {e}"[:500]
                self.requests.append(req.record())
        finally:
            self.store.unpin(req.hit)

    # ---- internals --------------------------------------------------------------------------
    def _compatible(self, engine) -> bool:
        """The store's entries (if any) have this model's chunk shape and dtype."""
        shape, dtype = _shape_dtype(self._entry_spec(engine))
        return self.store.entry_shape in (None, shape) and self.store.entry_dtype in (None, dtype)

    def _store_new(self, req: PrefixRequest, kv_outs: Sequence) -> list:
        """Best-effort insert of the new full chunks, last first. Returns the KV arrays of the
        entries now held for them (a hybrid entry's KV part)."""
        items = []
        for call, out in zip(req.calls, kv_outs):
            for j in range(call.store_chunks):
                ci = call.first_chunk + j
                if ci < len(req.keys) and (j + 1) * self.chunk_tokens <= call.valid[0]:
                    items.append((req.keys[ci], out[j]))
        if not items:
            return []
        shape, dtype = _shape_dtype(items[0][1])
        if self.store.entry_shape not in (None, shape) or self.store.entry_dtype not in (None, dtype):
            self.store_errors += len(items)
            req.chunks_skipped += len(items)
            return []
        before = self.store.stats
        stored = [key for key, kv in reversed(items) if self.store.put(key, kv, copy=self.config.store_route != "scan")]
        after = self.store.stats
        req.chunks_stored = after.chunks_stored - before.chunks_stored
        req.chunks_skipped = after.stores_skipped - before.stores_skipped
        entries = [e for e in (self.store.peek(k) for k in stored) if e is not None]
        return [e[0] if isinstance(e, tuple) else e for e in entries]

    # ---- metrics ----------------------------------------------------------------------------
    def metrics(self) -> dict:
        """The ``kv_store`` metrics object (JSON-ready). Sizes in bytes, times in seconds.

        chunks_hit / chunks_missed: from lookups; chunks_stored: new inserts; chunks_evicted:
        LRU evictions; chunks_skipped: inserts skipped for lack of evictable room (or an
        incompatible store); bytes_loaded: hit chunks handed to prefills (padding excluded);
        bytes_padding_copied: extra bytes copied for bucket padding; bytes_stored: inserted.
        """
        s = self.store.stats
        return {**self.config.as_dict(), "memory_kind": self.store.memory_kind,
                "capacity_bytes": s.capacity_bytes, "chunks_hit": s.chunks_hit, "chunks_missed": s.chunks_missed,
                "chunks_stored": s.chunks_stored, "chunks_evicted": s.chunks_evicted,
                "chunks_skipped": s.stores_skipped + self.store_errors, "bytes_loaded": s.bytes_loaded,
                "bytes_padding_copied": sum(r["bytes_padding"] for r in self.requests),
                "bytes_stored": s.bytes_stored, "bytes_in_use": s.bytes_in_use, "num_entries": s.num_entries,
                "requests": len(self.requests), "reused_tokens": sum(r["reused_tokens"] for r in self.requests)}


def _shape_dtype(entry) -> tuple:
    """(shape, dtype) of an entry or its spec as the store records them (tuples for a tuple entry)."""
    if isinstance(entry, tuple):
        return tuple(tuple(a.shape) for a in entry), tuple(np.dtype(a.dtype) for a in entry)
    return tuple(entry.shape), np.dtype(entry.dtype)
