"""Prefill/decode orchestration: jitted steps, sampling, expert-cache accounting, timings.

One jitted program per (phase, shape): ``prefill`` for a prompt bucket of T tokens, ``decode``
for T = 1. The KV cache and the expert state (slot pools + LRU table) are donated to each step,
so they are updated in place rather than copied.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import memory
from ftjax import model as model_lib
from ftjax.checkpoint import LoadedModel
from ftjax.experts import miss_policy, offload
from ftjax.experts.slot_table import POLICIES, reset_table
from ftjax.sampling import sample

MIN_BUCKET = 16


def prompt_error(ids: Sequence[int], vocab_size: int, new_tokens: int, max_len: int, max_len_name: str) -> str | None:
    """What is wrong with one prompt of token ids, or None: empty, an id outside [0, vocab_size),
    or prompt + ``new_tokens`` longer than ``max_len`` (named ``max_len_name`` in the message)."""
    if len(ids) == 0:
        return "empty prompt"
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    if len(ids) + new_tokens > max_len:
        return f"prompt of {len(ids)} tokens + {new_tokens} new exceeds {max_len_name} {max_len}"
    return None


def bucket(n: int) -> int:
    """Padded length for n tokens: the next power of two, at least MIN_BUCKET (bounded recompiles)."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return b


@dataclasses.dataclass
class ExpertCounters:
    """Host-side totals of expert-cache events, per layer (int64 [L])."""

    hits: np.ndarray
    misses: np.ndarray
    extra_copies: int = 0  # experts copied outside a layer (the streaming prologue)

    @classmethod
    def zeros(cls, num_layers: int) -> "ExpertCounters":
        return cls(np.zeros(num_layers, np.int64), np.zeros(num_layers, np.int64))

    def add(self, stats: offload.LayerStats) -> None:
        self.hits += np.asarray(stats.hits, np.int64)
        self.misses += np.asarray(stats.misses, np.int64)

    def summary(self, expert_bytes: int) -> dict:
        h, m = int(self.hits.sum()), int(self.misses.sum())
        per_layer = np.where(self.hits + self.misses > 0, self.hits / np.maximum(self.hits + self.misses, 1), 0.0)
        return {"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0,
                "hit_rate_per_layer": [round(float(x), 6) for x in per_layer],
                "bytes_h2d": (m + self.extra_copies) * expert_bytes}


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "all_logits", "stream", "overlap", "policy", "miss"),
                   donate_argnames=("cache", "state"))
def _forward_step(params, host_gate_up, host_down, cache, state, tokens, start, valid_len, *, cfg, mode,
                  all_logits=False, stream=False, overlap=True, policy="lru", miss=None):
    state, expert_fn = step_expert_fn(cfg, mode, host_gate_up, host_down, state, stream, overlap, policy, miss)
    return model_lib.forward(params, cfg, tokens, start, valid_len, cache, expert_fn, state, all_logits)


def step_expert_fn(cfg, mode, host_gate_up, host_down, state, stream=False, overlap=True, policy="lru", miss=None):
    """(state, expert function) of one jitted step, inside the jit: full-layer streaming for a
    long prefill chunk, else the experts mode with the cache ``policy`` and, when ``miss`` is set
    (a ``miss_policy.MissConfig``), cpu / adaptive handling of misses."""
    if stream:  # full-layer double-buffered prefill (DESIGN.md 1.3): every expert is fetched
        inner = state if miss is None else state.experts  # cpu/adaptive wrap the offload state
        inner = offload.stream_prologue(host_gate_up, host_down, inner, cfg.num_experts, overlap)
        stream_fn = offload.make_stream_expert_fn(cfg.num_experts, cfg.num_layers, host_gate_up, host_down,
                                                  overlap)
        if miss is None:
            state, expert_fn = inner, stream_fn
        else:
            state = state.replace(experts=inner)

            def expert_fn(s, layer, r):
                y, experts, stats = stream_fn(s.experts, layer, r)
                return y, s.replace(experts=experts), stats
    elif miss is None:  # fetch every miss (or resident)
        expert_fn = offload.make_expert_fn(mode, cfg.num_experts, host_gate_up, host_down, policy)
    else:  # cpu / adaptive miss policy (DESIGN.md 1.2)
        expert_fn = miss_policy.make_expert_fn(miss, mode, cfg.num_experts, host_gate_up, host_down, policy)
    return state, expert_fn


_sample = jax.jit(sample, static_argnames=("temperature", "top_p"))
# rows of ``new`` where ``mask`` [B] (numpy bool) is set, else of ``old`` ([B, V] logits)
_keep_rows = jax.jit(lambda mask, new, old: jnp.where(mask[:, None], new, old))

# Compiled steps shared by all engines, keyed by step function, static options and argument
# shapes/dtypes/memory kinds.
_COMPILED: dict[tuple, Any] = {}


def compiled_programs(fn_name: str | None = None):
    """Yields (step name, static options dict, argument signatures, compiled executable) of every
    compiled step (e.g. to read its HLO with ``exe.as_text()``); ``fn_name`` filters by step."""
    for key, exe in _COMPILED.items():
        if fn_name is None or key[0] == fn_name:
            yield key[0], dict(key[1]), key[2], exe


def _compile_key(args, **static) -> tuple:
    leaves = jax.tree.leaves(args)
    return (tuple(sorted(static.items())),
            tuple((x.shape, str(x.dtype), getattr(getattr(x, "sharding", None), "memory_kind", None))
                  for x in leaves))


@dataclasses.dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate`.

    generated_ids: int [B][n]; step_logits: float32 [n, B, V] (when kept); ttft_s, decode_s: seconds;
    prefill_tokens_per_s, decode_tokens_per_s: tokens/s summed over the batch; compile_s: seconds
    spent compiling in this call (not part of the timings); routing: int32 [steps][L, N, k] when traced;
    step_s: seconds of each decode step (time per output token, TPOT) when timed step by step.
    """

    prompt_ids: list[list[int]]
    generated_ids: list[list[int]]
    step_logits: np.ndarray | None
    ttft_s: float
    decode_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    compile_s: float
    routing: list[np.ndarray] | None = None
    step_s: list[float] | None = None
    kv: dict | None = None  # prefix-reuse record of the request (``PrefixRequest.record()``)


class Engine:
    """Runs a :class:`LoadedModel` with one of the expert modes.

    Args:
      model: weights (device params + host expert banks).
      experts_mode: "resident" | "cached" | "on_demand" (``ftjax.experts.offload``).
      num_slots: S, slots of the device pool (cached / on_demand); must be in [E, L*E].
      max_seq_len: KV cache length in tokens (prompt + generated), <= max_position_embeddings.
      batch: sequences decoded together.
      prefill: "auto" | "stream" | "on_demand". stream: whole layers through two E-slot buffers
        (needs S >= 2E); on_demand: only the routed experts, through the LRU cache; auto: stream
        when S >= 2E and the chunk has at least E (token, expert) pairs (DESIGN.md 1.3).
      prefill_chunk: prompts longer than this many tokens are prefilled in chunks.
      prefill_overlap: copy layer l+1's experts while layer l computes (False: the ablation).
      cache_policy: slot eviction policy, "lru" or "lookahead" (``slot_table.eviction_order``).
      miss: a ``miss_policy.MissRuntime`` (fetch / cpu / adaptive misses); None = fetch.
    Raises:
      ValueError: bad mode, slots out of range, stream without 2E slots, max_seq_len beyond the
        model's positions, or a cpu / adaptive miss policy with resident experts.
    """

    def __init__(self, model: LoadedModel, experts_mode: str = "resident", num_slots: int | None = None,
                 max_seq_len: int = 512, batch: int = 1, prefill: str = "auto", prefill_chunk: int = 8192,
                 prefill_overlap: bool = True, cache_policy: str = "lru",
                 miss: miss_policy.MissRuntime | None = None):
        cfg = model.cfg
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        if experts_mode not in offload.MODES:
            raise ValueError(f"unknown experts mode {experts_mode!r}; expected one of {offload.MODES}")
        if experts_mode == "resident":
            num_slots = cfg.num_layers * cfg.num_experts
        elif num_slots is None:
            raise ValueError(f"experts mode {experts_mode!r} needs num_slots")
        if prefill not in ("auto", "stream", "on_demand"):
            raise ValueError(f"unknown prefill mode {prefill!r}; expected auto, stream or on_demand")
        if prefill == "stream" and (experts_mode == "resident" or num_slots < 2 * cfg.num_experts):
            raise ValueError(f"prefill=stream needs an offloading experts mode and at least 2E="
                             f"{2 * cfg.num_experts} slots (have {num_slots}, mode {experts_mode})")
        if cache_policy not in POLICIES:
            raise ValueError(f"unknown cache policy {cache_policy!r}; expected one of {POLICIES}")
        self.cache_policy = cache_policy
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_mode, self.prefill_chunk, self.prefill_overlap = prefill, prefill_chunk, prefill_overlap
        self.model, self.cfg, self.mode = model, cfg, experts_mode
        self.num_slots, self.max_seq_len, self.batch = num_slots, max_seq_len, batch
        self.dtype = jnp.dtype(model.params["embed"].dtype)
        self.state = offload.init_expert_state(experts_mode, cfg.num_layers, cfg.num_experts, num_slots,
                                               model.host_gate_up, model.host_down, self.dtype)
        if miss is not None and miss.policy != "fetch" and experts_mode == "resident":
            raise ValueError(f"miss policy {miss.policy!r} needs experts mode cached or on_demand")
        self.miss = miss or miss_policy.build_runtime("fetch", cfg.num_layers, cfg.num_experts)
        self.state = self.miss.init_state(self.state)
        self.counters = {"prefill": ExpertCounters.zeros(cfg.num_layers),
                         "decode": ExpertCounters.zeros(cfg.num_layers)}
        self.compile_s = 0.0

    def reset_expert_cache(self) -> None:
        """Empties the expert cache: every slot freed (nothing resident), as in a new engine.

        For cold-start measurements (each timed request from the same state) without rebuilding
        the engine or recompiling. The slot pools keep their bytes (no copy, no reallocation);
        the hit / miss / split counters keep counting. No-op in resident mode (no table).
        """
        inner = self.state.experts if isinstance(self.state, miss_policy.MissState) else self.state
        if inner.table is None:
            return
        # the miss runtime wraps it as in __init__ (cpu / adaptive: routing recency starts over too)
        self.state = self.miss.init_state(inner.replace(table=reset_table(inner.table)))

    # ---- one forward call --------------------------------------------------------------------
    def _step(self, tokens: np.ndarray, start: np.ndarray, valid_len: np.ndarray, cache, all_logits=False,
              stream=False):
        args = (self.model.params, self.model.host_gate_up, self.model.host_down, cache, self.state,
                jnp.asarray(tokens, jnp.int32), jnp.asarray(start, jnp.int32), jnp.asarray(valid_len, jnp.int32))
        out = self._executable(args, all_logits, stream)(*args)
        self.state = out.expert_state
        return out

    def streams(self, valid_tokens: int) -> bool:
        """Whether a prefill chunk with ``valid_tokens`` real tokens streams whole layers."""
        if self.mode == "resident" or self.prefill_mode == "on_demand":
            return False
        if self.prefill_mode == "stream":
            return True
        e = self.cfg.num_experts
        return self.num_slots >= 2 * e and valid_tokens * self.cfg.top_k >= e

    def new_cache(self, batch: int) -> model_lib.KVCache:
        return model_lib.init_kv_cache(self.cfg, batch, self.max_seq_len, self.dtype)

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Raises ValueError for empty prompts, ids outside [0, V) or sequences longer than the cache."""
        for i, p in enumerate(prompts):
            problem = prompt_error(p, self.cfg.vocab_size, max_new_tokens, self.max_seq_len, "max_seq_len")
            if problem:
                raise ValueError(f"prompt {i}: {problem}")

    def prefill(self, prompts: Sequence[Sequence[int]], cache, all_logits: bool = False):
        """Prefills a batch of prompts, in chunks of at most ``prefill_chunk`` tokens (each chunk
        right-padded to a bucket).

        Returns (logits, cache, lengths, stats): logits float32 [B, V] of each prompt's last token
        ([B, T, V] with all_logits, T the padded length); stats: one LayerStats per chunk.
        """
        b = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        longest = int(lengths.max())
        chunk = min(self.prefill_chunk, longest)
        logits, stats, pieces = None, [], []
        for c in range(0, longest, chunk):
            valid = np.clip(lengths - c, 0, chunk).astype(np.int32)
            t = bucket(int(valid.max()))
            tokens = np.zeros((b, t), np.int32)
            for i, p in enumerate(prompts):
                tokens[i, : valid[i]] = p[c: c + valid[i]]
            stream = self.streams(int(valid.sum()))
            # a sequence already complete has 0 valid tokens here: none of its padding is routed
            out = self._step(tokens, np.full(b, c, np.int32), valid, cache, all_logits, stream)
            cache = out.cache
            self.counters["prefill"].add(out.layer_stats)
            self.miss.add("prefill", out.layer_stats)
            if stream and self.prefill_overlap:
                self.counters["prefill"].extra_copies += self.cfg.num_experts
            stats.append(out.layer_stats)
            if all_logits:
                pieces.append(out.logits[:, : min(chunk, longest - c)])
            elif logits is None:
                logits = out.logits
            else:  # keep each sequence's logits from the chunk its prompt ends in
                logits = _keep_rows((lengths > c) & (lengths <= c + chunk), out.logits, logits)
        if all_logits:
            logits = jnp.concatenate(pieces, axis=1)
        return logits, cache, lengths, stats

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, keep_logits: bool = False,
                 trace_routing: bool = False, time_steps: bool = False, kv_manager=None) -> GenerationResult:
        """Prefill + decode ``max_new_tokens`` tokens for each prompt.

        TTFT is measured from the prefill's dispatch to the first sampled token being ready;
        decode time from then to the last token. Compilation is excluded and reported apart.
        ``time_steps`` waits for every decode step to finish and records its duration (adds one
        host sync per step; without it steps are dispatched asynchronously).
        With ``kv_manager`` (``ftjax.kv.prefix_cache.PrefixCache``, batch 1) the prefill reuses
        stored prefix KV and stores new chunks; its key lookup time is added to TTFT.
        """
        self.check_prompts(prompts, max_new_tokens)
        b = len(prompts)
        compile_before = self.compile_s
        cache = self.new_cache(b)
        key = jax.random.key(seed)
        routing = [] if trace_routing else None
        # Compile both programs before the clock starts.
        self._ensure_compiled(prompts, cache, prefill=kv_manager is None)
        self._warm_sampling(b, temperature, top_p)
        req = kv_manager.begin(self, prompts, cache) if kv_manager is not None else None
        t0 = time.perf_counter()
        if req is None:
            logits, cache, lengths, stats = self.prefill(prompts, cache)
        else:
            logits, cache, lengths, stats = kv_manager.prefill(self, req, cache)
        key, sub = jax.random.split(key)
        tok = _sample(logits, sub, temperature, top_p)
        tok.block_until_ready()
        t_first = time.perf_counter()
        ttft = t_first - t0 + (req.lookup_s if req is not None else 0.0)
        if trace_routing:  # [L, B*T] token axis of every chunk, concatenated
            routing.append(np.concatenate([np.asarray(st.routed_ids) for st in stats], axis=1))
        toks, all_logits, decode_stats = [tok], [logits] if keep_logits else None, []
        pos = lengths.copy()
        step_s = [] if time_steps else None
        for _ in range(max_new_tokens - 1):
            ts = time.perf_counter()
            out = self._step(tok[:, None], pos, np.ones(b, np.int32), cache)
            cache = out.cache
            key, sub = jax.random.split(key)
            tok = _sample(out.logits, sub, temperature, top_p)
            toks.append(tok)
            decode_stats.append(out.layer_stats)
            if keep_logits:
                all_logits.append(out.logits)
            if time_steps:
                tok.block_until_ready()
                step_s.append(time.perf_counter() - ts)
            pos = pos + 1
        jax.block_until_ready(toks)
        decode_s = time.perf_counter() - t_first
        for s in decode_stats:
            self.counters["decode"].add(s)
            self.miss.add("decode", s)
            if trace_routing:
                routing.append(np.asarray(s.routed_ids))
        gen = np.stack([np.asarray(t) for t in toks], axis=1)
        n_dec = b * (max_new_tokens - 1)
        return GenerationResult(
            prompt_ids=[list(map(int, p)) for p in prompts], generated_ids=gen.tolist(),
            step_logits=np.stack([np.asarray(x) for x in all_logits]) if keep_logits else None,
            ttft_s=ttft, decode_s=decode_s, prefill_tokens_per_s=float(lengths.sum()) / ttft,
            decode_tokens_per_s=n_dec / decode_s if n_dec and decode_s > 0 else 0.0,
            compile_s=self.compile_s - compile_before, routing=routing, step_s=step_s,
            kv=req.record() if req is not None else None)

    def compiled(self, fn, args, **static):
        """``fn`` (a jitted step) compiled for these arguments and static options, from the shared
        cache (compiled once per fn, shapes, dtypes, memory kinds and options); compile seconds
        are added to ``compile_s`` so timings can exclude them."""
        key = (fn.__name__,) + _compile_key(args, **static)
        if key not in _COMPILED:
            t0 = time.perf_counter()
            _COMPILED[key] = fn.lower(*args, **static).compile()
            self.compile_s += time.perf_counter() - t0
        return _COMPILED[key]

    def _executable(self, args, all_logits: bool = False, stream: bool = False):
        return self.compiled(_forward_step, args, cfg=self.cfg, mode=self.mode, all_logits=all_logits,
                             stream=stream, overlap=self.prefill_overlap and stream, policy=self.cache_policy,
                             miss=self.miss.jit_config)

    def _ensure_compiled(self, prompts, cache, prefill: bool = True) -> None:
        """Compiles every prefill chunk shape (unless ``prefill`` is False) and the decode step
        before timing starts."""
        b = len(prompts)
        lengths = np.array([len(p) for p in prompts])
        longest = int(lengths.max())
        chunk = min(self.prefill_chunk, longest)
        shapes = {((b, 1), False)}
        for c in range(0, longest, chunk) if prefill else ():
            valid = np.clip(lengths - c, 0, chunk)
            shapes.add(((b, bucket(int(valid.max()))), self.streams(int(valid.sum()))))
        for shape, stream in shapes:
            args = (self.model.params, self.model.host_gate_up, self.model.host_down, cache, self.state,
                    jnp.zeros(shape, jnp.int32), jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.int32))
            self._executable(args, stream=stream)

    def _warm_sampling(self, batch: int, temperature: float, top_p: float) -> None:
        """Compiles the sampler and the key split outside the timed region. The dummy logits are
        committed to device memory like the step's output: an uncommitted argument is another
        jit cache entry, and the real call would compile again inside TTFT."""
        t0 = time.perf_counter()
        key = jax.random.split(jax.random.key(0))[1]
        logits = memory.to_device(np.zeros((batch, self.cfg.vocab_size), np.float32))
        tok = _sample(logits, key, temperature, top_p)
        tok[:, None].block_until_ready()  # the decode step's input reshape, compiled here too
        _keep_rows(np.ones(batch, bool), logits, logits).block_until_ready()  # multi-chunk prefill
        self.compile_s += time.perf_counter() - t0

    def expert_cache_metrics(self) -> dict:
        """The ``expert_cache`` metrics object: slots, hits, misses, hit rates, H2D bytes."""
        eb = self.model.expert_bytes
        total = ExpertCounters(self.counters["prefill"].hits + self.counters["decode"].hits,
                               self.counters["prefill"].misses + self.counters["decode"].misses,
                               self.counters["prefill"].extra_copies + self.counters["decode"].extra_copies)
        m = {"mode": self.mode, "slots": self.num_slots, "policy": self.cache_policy, "expert_bytes": eb,
             **total.summary(eb),
             "prefill": self.counters["prefill"].summary(eb), "decode": self.counters["decode"].summary(eb)}
        m = self.miss.metrics(m, eb, min(self.cfg.num_experts, self.batch * self.cfg.top_k))
        # the miss runtime counts fetched misses; add the streaming prologue's copies back
        extra = total.extra_copies * eb
        m["bytes_h2d"] += extra
        m["prefill"]["bytes_h2d"] += extra
        return m
