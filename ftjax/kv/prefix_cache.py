"""Prefix reuse across requests: chunk keys + host KV store + layerwise prefill (DESIGN.md 1.4).

After LMCache (chunked prefix caching with chained hashes, layerwise retrieve/store), built on
:mod:`ftjax.kv.chunk_keys`, :class:`ftjax.kv.host_store.HostKVStore` and the layer-scan hook
:mod:`ftjax.kv.layerwise`. One request (batch 1) goes through :class:`PrefixCache` as:

1. :meth:`PrefixCache.begin` (before the TTFT clock, but its time is reported as
   ``lookup_s`` and added to TTFT by the engine): chained keys of the prompt's full chunks,
   ``store.lookup`` (longest stored prefix, made most recent), pin the hit chunks, plan the
   prefill calls and compile them (compilation is excluded from timings, as in the engine).
2. :meth:`PrefixCache.prefill` (timed): the first call receives the hit chunks' KV (host
   arrays, loaded layer by layer inside the scan; or, for the ``all_first`` ablation, moved to
   the device first) and computes only the suffix; a long suffix is split into calls of at most
   ``prefill_chunk`` tokens at increasing start offsets. New full chunks leave each call as scan
   outputs (in host memory with ``store_route="scan"``) and are inserted into the store right
   after the calls are dispatched, last chunk first, so that under LRU pressure what survives is
   a contiguous prefix. The hit chunks are unpinned at the end (also on error).

Reuse rules: a trailing partial chunk is never stored; at most ``len(prompt) - 1`` tokens are
reused, so a prompt whose chunks all hit loads them all and recomputes its last token (its K/V
row is rewritten by the same value) to produce logits. Requests run one at a time, batch 1.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import numpy as np

from ftjax import memory
from ftjax import model as model_lib
from ftjax.engine import step_expert_fn
from ftjax.kv.chunk_keys import chunk_keys, model_identity
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.layerwise import LayerwiseKV, bucket_chunks

__all__ = ["LOADS", "STORE_ROUTES", "PrefixCache", "PrefixRequest", "PrefillCall"]

#: How the reused prefix reaches the device: in-scan with the next layer prefetched, in-scan
#: as scan ``xs``, or all layers before the step (the ablation).
LOADS = ("prefetch", "xs", "all_first")
#: Where new chunks go to host memory: inside the scan body ("scan") or after the step ("after").
STORE_ROUTES = ("scan", "after")


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "variant", "store_chunks", "chunk_tokens",
                                             "store_to_host", "policy", "miss"), donate_argnames=("cache", "state"))
def _prefix_step(params, host_gate_up, host_down, cache, state, tokens, start, valid_len, prefix, *, cfg, mode,
                 variant, store_chunks, chunk_tokens, store_to_host, policy="lru", miss=None):
    state, expert_fn = step_expert_fn(cfg, mode, host_gate_up, host_down, state, policy=policy, miss=miss)
    hook = LayerwiseKV(prefix, variant, store_chunks, chunk_tokens, store_to_host)
    return model_lib.forward(params, cfg, tokens, start, valid_len, cache, expert_fn, state, kv_hook=hook)


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """One jitted prefill call of a request.

    start: first position (tokens already in the cache); valid: real tokens; bucket: padded T;
    store_chunks: new-chunk outputs of the call (static m; those past the prompt's last full
    chunk are dropped); first_chunk: chunk index of output 0 (= start // C); with_prefix: the
    call receives the reused prefix.
    """

    start: int
    valid: int
    bucket: int
    store_chunks: int
    first_chunk: int
    with_prefix: bool


@dataclasses.dataclass
class PrefixRequest:
    """State of one request between :meth:`PrefixCache.begin` and :meth:`PrefixCache.prefill`.

    Times in seconds, sizes in bytes. ``prefix_chunks`` is the padded count passed to the step
    (>= ``len(hit)``); ``load_s`` is the host-to-device copy time of the ``all_first`` ablation
    (0 for the layerwise loads, whose copies are inside the step).
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
                "load_s": self.load_s, "bytes_loaded": self.bytes_loaded, "bytes_padding": self.bytes_padding,
                "chunks_stored": self.chunks_stored, "chunks_skipped": self.chunks_skipped}


class PrefixCache:
    """Ties a :class:`HostKVStore`, chunk keys and an :class:`ftjax.engine.Engine` together.

    Pass it to ``Engine.generate(..., kv_manager=cache)``; one manager (and store) can serve many
    sequential requests of one model. Keys include the model identity (config, compute dtype and
    the weights' source name), so two models sharing a store never hit each other's chunks.

    Args:
      store: the host KV store (capacity in bytes).
      chunk_tokens: C, tokens per chunk (LMCache's default 256).
      load: one of :data:`LOADS` (default ``"prefetch"``: layer l+1 copied while layer l computes).
      store_route: one of :data:`STORE_ROUTES`.
      prefill_chunk: most tokens per prefill call (a multiple of C); longer suffixes take several
        calls at increasing start offsets.
      store_new: insert the request's new full chunks into the store (False: lookup only).
      bucket_prefix: pad the hit-chunk count with :func:`bucket_chunks` to bound recompiles.
    Raises:
      ValueError: bad load / route, chunk_tokens < 1, prefill_chunk not a positive multiple of C.
    """

    def __init__(self, store: HostKVStore, chunk_tokens: int = 256, load: str = "prefetch",
                 store_route: str = "scan", prefill_chunk: int = 8192, store_new: bool = True,
                 bucket_prefix: bool = True):
        if load not in LOADS:
            raise ValueError(f"unknown KV load {load!r}; expected one of {LOADS}")
        if store_route not in STORE_ROUTES:
            raise ValueError(f"unknown KV store route {store_route!r}; expected one of {STORE_ROUTES}")
        if chunk_tokens < 1:
            raise ValueError(f"kv chunk tokens must be >= 1, got {chunk_tokens}")
        if prefill_chunk < chunk_tokens or prefill_chunk % chunk_tokens:
            raise ValueError(f"prefill chunk {prefill_chunk} must be a positive multiple of the KV chunk "
                             f"({chunk_tokens} tokens)")
        self.store, self.chunk_tokens, self.load = store, int(chunk_tokens), load
        self.store_route, self.prefill_chunk = store_route, int(prefill_chunk)
        self.store_new, self.bucket_prefix = store_new, bucket_prefix
        self.requests: list[dict] = []
        self.store_errors = 0

    # ---- keys -------------------------------------------------------------------------------
    def identity(self, engine) -> bytes:
        """32-byte model identity: config fields, compute (= KV) dtype, weights source name
        (a checkpoint path, or the random generator with its seed). Recomputed on every call
        (a hash of a small dict): caching it by object id went stale when a model was freed."""
        fields = dict(engine.cfg.identity(), weights=engine.model.name)
        return model_identity(fields, engine.dtype.name)

    def keys(self, engine, prompt: Sequence[int]) -> list[bytes]:
        """Chained keys of the prompt's full chunks (a trailing partial chunk has none)."""
        return chunk_keys(np.asarray(prompt, np.int64), self.chunk_tokens, self.identity(engine))

    def entry_bytes(self, engine) -> int:
        """Bytes of one stored chunk: L * 2 * C * Hkv * hd * itemsize."""
        cfg = engine.cfg
        return cfg.num_layers * 2 * self.chunk_tokens * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize

    # ---- one request ------------------------------------------------------------------------
    def begin(self, engine, prompts: Sequence[Sequence[int]], cache) -> PrefixRequest:
        """Keys, lookup, pin, plan and compile for one request (batch 1).

        Raises:
          ValueError: more than one prompt, or an empty prompt.
        """
        if len(prompts) != 1:
            raise ValueError(f"KV prefix reuse runs one request at a time (batch 1), got {len(prompts)} prompts")
        prompt = [int(t) for t in prompts[0]]
        if not prompt:
            raise ValueError("prompt is empty")
        t0 = time.perf_counter()
        keys = self.keys(engine, prompt)
        hit = self.store.lookup(keys) if self._compatible(engine) else []
        self.store.pin(hit)
        try:
            c, n = self.chunk_tokens, len(hit)
            reused = min(n * c, len(prompt) - 1)
            padded = n
            if n and self.bucket_prefix and bucket_chunks(n) * c <= engine.max_seq_len:
                padded = bucket_chunks(n)
            calls, pos = [], reused
            while pos < len(prompt):
                valid = min(self.prefill_chunk, len(prompt) - pos)
                t = _bucket(valid)
                # new-chunk outputs: whole chunks of the padded call that lie inside the cache
                m = min(t, engine.max_seq_len - pos) // c if (self.store_new and pos % c == 0 and valid >= c) else 0
                calls.append(PrefillCall(pos, valid, t, m, pos // c, bool(n) and not calls))
                pos += valid
            req = PrefixRequest(prompt, keys, hit, reused, padded, calls, self.load,
                                lookup_s=time.perf_counter() - t0)
            for call in calls:
                self._executable(engine, self._args(engine, req, call, cache, None), call)
        except BaseException:
            self.store.unpin(hit)
            raise
        return req

    def prefill(self, engine, req: PrefixRequest, cache):
        """Runs the request's prefill calls; stores new chunks; unpins the hit chunks.

        Returns (logits float32 [1, V] of the last prompt token, cache, lengths int32 [1], layer
        stats of every call), like ``Engine.prefill``.
        Raises:
          RuntimeError: the request was already run.
        """
        if req.finished:
            raise RuntimeError("this request's prefill already ran")
        req.finished = True
        try:
            prefix = []
            if req.hit:
                prefix = self.store.get(req.hit)
                req.bytes_loaded = sum(a.nbytes for a in prefix)
                pad = req.prefix_chunks - len(prefix)
                req.bytes_padding = pad * prefix[-1].nbytes
                prefix = prefix + [prefix[-1]] * pad
                if self.load == "all_first":
                    t0 = time.perf_counter()
                    prefix = jax.device_put(prefix, memory.device_sharding())
                    jax.block_until_ready(prefix)
                    req.load_s = time.perf_counter() - t0
            outs = []
            for call in req.calls:
                args = self._args(engine, req, call, cache, tuple(prefix) if call.with_prefix else ())
                out = self._executable(engine, args, call)(*args)
                engine.state, cache = out.expert_state, out.cache
                outs.append((call, out))
            self._store_new(engine, req, outs)
        finally:
            self.store.unpin(req.hit)
        for _, out in outs:
            engine.counters["prefill"].add(out.layer_stats)
            engine.miss.add("prefill", out.layer_stats)
        self.requests.append(req.record())
        last = outs[-1][1]
        return last.logits, cache, np.array([len(req.prompt)], np.int32), [out.layer_stats for _, out in outs]

    # ---- internals --------------------------------------------------------------------------
    def _compatible(self, engine) -> bool:
        """The store's entries (if any) have this model's chunk shape and dtype."""
        cfg = engine.cfg
        shape = (cfg.num_layers, 2, self.chunk_tokens, cfg.num_kv_heads, cfg.head_dim)
        return self.store.entry_shape in (None, shape) and self.store.entry_dtype in (None, engine.dtype)

    def _store_new(self, engine, req: PrefixRequest, outs) -> None:
        """Best-effort insert of the new full chunks, last first; never raises for the store."""
        items = []
        for call, out in outs:
            for j in range(call.store_chunks):
                ci = call.first_chunk + j
                if ci < len(req.keys) and (j + 1) * self.chunk_tokens <= call.valid:
                    items.append((req.keys[ci], out.kv_out[j]))
        if not items:
            return
        if not self._compatible(engine):
            self.store_errors += len(items)
            req.chunks_skipped += len(items)
            return
        before = self.store.stats
        for key, kv in reversed(items):
            self.store.put(key, kv, copy=self.store_route != "scan")
        after = self.store.stats
        req.chunks_stored = after.chunks_stored - before.chunks_stored
        req.chunks_skipped = after.stores_skipped - before.stores_skipped

    def _prefix_spec(self, engine, n: int, concrete):
        if concrete is not None:
            return concrete
        cfg = engine.cfg
        shape = (cfg.num_layers, 2, self.chunk_tokens, cfg.num_kv_heads, cfg.head_dim)
        sharding = memory.device_sharding() if self.load == "all_first" else self.store.sharding
        return tuple(jax.ShapeDtypeStruct(shape, engine.dtype, sharding=sharding) for _ in range(n))

    def _args(self, engine, req: PrefixRequest, call: PrefillCall, cache, prefix):
        tokens = np.zeros((1, call.bucket), np.int32)
        tokens[0, :call.valid] = req.prompt[call.start:call.start + call.valid]
        if prefix is None:
            prefix = self._prefix_spec(engine, req.prefix_chunks if call.with_prefix else 0, None)
        m = engine.model
        return (m.params, m.host_gate_up, m.host_down, cache, engine.state, jax.numpy.asarray(tokens),
                jax.numpy.asarray([call.start], jax.numpy.int32), jax.numpy.asarray([call.valid], jax.numpy.int32),
                prefix)

    def _statics(self, engine, call: PrefillCall) -> dict:
        variant = "xs" if self.load == "all_first" else self.load
        return dict(cfg=engine.cfg, mode=engine.mode, variant=variant, store_chunks=call.store_chunks,
                    chunk_tokens=self.chunk_tokens, store_to_host=self.store_route == "scan",
                    policy=engine.cache_policy, miss=engine.miss.jit_config)

    def _executable(self, engine, args, call: PrefillCall):
        return engine.compiled(_prefix_step, args, **self._statics(engine, call))

    # ---- metrics ----------------------------------------------------------------------------
    def metrics(self) -> dict:
        """The ``kv_store`` metrics object (JSON-ready). Sizes in bytes, times in seconds.

        chunks_hit / chunks_missed: from lookups; chunks_stored: new inserts; chunks_evicted:
        LRU evictions; chunks_skipped: inserts skipped for lack of evictable room (or an
        incompatible store); bytes_loaded: hit chunks handed to prefills (padding excluded);
        bytes_padding_copied: extra bytes copied for bucket padding; bytes_stored: inserted.
        """
        s = self.store.stats
        return {"chunk_tokens": self.chunk_tokens, "load": self.load, "store_route": self.store_route,
                "prefill_chunk": self.prefill_chunk, "memory_kind": self.store.memory_kind,
                "capacity_bytes": s.capacity_bytes, "chunks_hit": s.chunks_hit, "chunks_missed": s.chunks_missed,
                "chunks_stored": s.chunks_stored, "chunks_evicted": s.chunks_evicted,
                "chunks_skipped": s.stores_skipped + self.store_errors, "bytes_loaded": s.bytes_loaded,
                "bytes_padding_copied": sum(r["bytes_padding"] for r in self.requests),
                "bytes_stored": s.bytes_stored, "bytes_in_use": s.bytes_in_use, "num_entries": s.num_entries,
                "requests": len(self.requests), "reused_tokens": sum(r["reused_tokens"] for r in self.requests)}


def _bucket(n: int) -> int:
    from ftjax.engine import bucket  # late import: engine imports nothing from here
    return bucket(n)
