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

from ftjax import model as model_lib
from ftjax.checkpoint import LoadedModel
from ftjax.experts import miss_policy, offload
from ftjax.sampling import sample

MIN_BUCKET = 16


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
                "bytes_h2d": m * expert_bytes}


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "all_logits", "miss"), donate_argnames=("cache", "state"))
def _forward_step(params, host_gate_up, host_down, cache, state, tokens, start, valid_len, *, cfg, mode,
                  all_logits=False, miss=None):
    if miss is None:  # fetch every miss (or resident)
        expert_fn = offload.make_expert_fn(mode, cfg.num_experts, host_gate_up, host_down)
    else:  # cpu / adaptive miss policy (DESIGN.md 1.2)
        expert_fn = miss_policy.make_expert_fn(miss, mode, cfg.num_experts, host_gate_up, host_down)
    return model_lib.forward(params, cfg, tokens, start, valid_len, cache, expert_fn, state, all_logits)


_sample = jax.jit(sample, static_argnames=("temperature", "top_p"))

# Compiled steps shared by all engines, keyed by config, mode and argument shapes/dtypes/memory kinds.
_COMPILED: dict[tuple, Any] = {}


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
    spent compiling in this call (not part of the timings); routing: int32 [steps][L, N, k] when traced.
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


class Engine:
    """Runs a :class:`LoadedModel` with one of the expert modes.

    Args:
      model: weights (device params + host expert banks).
      experts_mode: "resident" | "cached" | "on_demand" (``ftjax.experts.offload``).
      num_slots: S, slots of the device pool (cached / on_demand); must be in [E, L*E].
      max_seq_len: KV cache length in tokens (prompt + generated), <= max_position_embeddings.
      batch: sequences decoded together.
      miss: a ``miss_policy.MissRuntime`` (fetch / cpu / adaptive misses); None = fetch.
    Raises:
      ValueError: bad mode, slots out of range, max_seq_len beyond the model's positions, or a
        cpu / adaptive miss policy with resident experts.
    """

    def __init__(self, model: LoadedModel, experts_mode: str = "resident", num_slots: int | None = None,
                 max_seq_len: int = 512, batch: int = 1, miss: miss_policy.MissRuntime | None = None):
        cfg = model.cfg
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        if experts_mode == "resident":
            num_slots = cfg.num_layers * cfg.num_experts
        elif num_slots is None:
            raise ValueError(f"experts mode {experts_mode!r} needs num_slots")
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

    # ---- one forward call --------------------------------------------------------------------
    def _step(self, tokens: np.ndarray, start: np.ndarray, valid_len: np.ndarray, cache, all_logits=False):
        args = (self.model.params, self.model.host_gate_up, self.model.host_down, cache, self.state,
                jnp.asarray(tokens, jnp.int32), jnp.asarray(start, jnp.int32), jnp.asarray(valid_len, jnp.int32))
        out = self._executable(args, all_logits)(*args)
        self.state = out.expert_state
        return out

    def new_cache(self, batch: int) -> model_lib.KVCache:
        return model_lib.init_kv_cache(self.cfg, batch, self.max_seq_len, self.dtype)

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Raises ValueError for empty prompts, ids outside [0, V) or sequences longer than the cache."""
        v = self.cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= int(t) < v]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {v})")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + {max_new_tokens} new exceed max_seq_len "
                                 f"{self.max_seq_len} (model max {self.cfg.max_position_embeddings})")

    def prefill(self, prompts: Sequence[Sequence[int]], cache, all_logits: bool = False):
        """Prefills a batch of prompts (right-padded to a bucket). Returns (logits, cache, lengths)."""
        lengths = np.array([len(p) for p in prompts], np.int32)
        t = bucket(int(lengths.max()))
        tokens = np.zeros((len(prompts), t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        out = self._step(tokens, np.zeros(len(prompts), np.int32), lengths, cache, all_logits)
        self.counters["prefill"].add(out.layer_stats)
        self.miss.add("prefill", out.layer_stats)
        return out.logits, out.cache, lengths, out.layer_stats

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, keep_logits: bool = False,
                 trace_routing: bool = False) -> GenerationResult:
        """Prefill + decode ``max_new_tokens`` tokens for each prompt.

        TTFT is measured from the prefill's dispatch to the first sampled token being ready;
        decode time from then to the last token. Compilation is excluded and reported apart.
        """
        self.check_prompts(prompts, max_new_tokens)
        b = len(prompts)
        compile_before = self.compile_s
        cache = self.new_cache(b)
        key = jax.random.key(seed)
        routing = [] if trace_routing else None
        # Compile both programs before the clock starts.
        self._ensure_compiled(prompts, cache)
        t0 = time.perf_counter()
        logits, cache, lengths, stats = self.prefill(prompts, cache)
        key, sub = jax.random.split(key)
        tok = _sample(logits, sub, temperature, top_p)
        tok.block_until_ready()
        ttft = time.perf_counter() - t0
        if trace_routing:
            routing.append(np.asarray(stats.routed_ids))
        toks, all_logits, decode_stats = [tok], [logits] if keep_logits else None, []
        pos = lengths.copy()
        for _ in range(max_new_tokens - 1):
            out = self._step(tok[:, None], pos, np.ones(b, np.int32), cache)
            cache = out.cache
            key, sub = jax.random.split(key)
            tok = _sample(out.logits, sub, temperature, top_p)
            toks.append(tok)
            decode_stats.append(out.layer_stats)
            if keep_logits:
                all_logits.append(out.logits)
            pos = pos + 1
        jax.block_until_ready(toks)
        decode_s = time.perf_counter() - t0 - ttft
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
            compile_s=self.compile_s - compile_before, routing=routing)

    def _executable(self, args, all_logits: bool = False):
        """The compiled step for these arguments (compiled once per shape; time added to compile_s)."""
        miss = self.miss.jit_config
        key = _compile_key(args, cfg=self.cfg, mode=self.mode, all_logits=all_logits, miss=miss)
        if key not in _COMPILED:
            t0 = time.perf_counter()
            _COMPILED[key] = _forward_step.lower(*args, cfg=self.cfg, mode=self.mode,
                                                 all_logits=all_logits, miss=miss).compile()
            self.compile_s += time.perf_counter() - t0
        return _COMPILED[key]

    def _ensure_compiled(self, prompts, cache) -> None:
        b, t = len(prompts), bucket(max(len(p) for p in prompts))
        for shape in ((b, t), (b, 1)):
            args = (self.model.params, self.model.host_gate_up, self.model.host_down, cache, self.state,
                    jnp.zeros(shape, jnp.int32), jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.int32))
            self._executable(args)

    def expert_cache_metrics(self) -> dict:
        """The ``expert_cache`` metrics object: slots, hits, misses, hit rates, H2D bytes."""
        eb = self.model.expert_bytes
        total = ExpertCounters(self.counters["prefill"].hits + self.counters["decode"].hits,
                               self.counters["prefill"].misses + self.counters["decode"].misses)
        m = {"mode": self.mode, "slots": self.num_slots, "expert_bytes": eb,
             **total.summary(eb),
             "prefill": self.counters["prefill"].summary(eb), "decode": self.counters["decode"].summary(eb)}
        return self.miss.metrics(m, eb, min(self.cfg.num_experts, self.batch * self.cfg.top_k))
