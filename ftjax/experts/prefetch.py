"""A cached decode layer's experts guessed before its token mixer and copied beside it
(``EngineConfig.prefetch_guesses``).

Why (issue 32's offload decode past its serial bound; docs/PROFILE.md "Open"): a cached step copies a layer's misses
only once its router has run, so the copies and the layer's other kernels run in series. A layer's experts can be
guessed earlier: its router applied to the layer's *input* (before the token mixer), normed by its own MoE norm,
finds most of the experts the router will pick from the mixer's output (the residual stream changes little in one
layer; on the benchmarks' random weights at qwen3-30b-a3b's shape the router on the layer before's output found
87.5% with k guesses: ``policy/policy_study_random_qwen3-30b-a3b_4l.json``). So, per cached decode layer:

1. :class:`Starter`, then :func:`start`: the top ``guesses`` experts per valid token; those not cached get slots from
   the slot table (the lookup the layer's own routed experts get: the engine's policy, the slot lookup kernel where it
   applies; so the guesses become the most recent entries) and are copied. On a GPU with the slot-copy kernel the
   copies run on the kernel's own stream (``slot_copy.copy_into_slots_start``, ``KernelConfig.prefetch_blocks``
   blocks per miss, few so the mixer's kernels keep their SMs) while the token mixer runs; elsewhere they are copied
   at once in the step's stream (the same pools, so the same results).
2. The token mixer.
3. :func:`join` at the start of the expert function: XLA's stream waits for the copies (``slot_copy.wait_slots``);
   the layer's lookup then finds the right guesses cached, and copies the rest as before.

The weights in every slot are the banks' rows, so the logits should be those of the same step without a prefetch:
bit-identical on the CPU (tests/test_prefetch.py) and, on an H100 (2026-12-07), for the GPU test's fixtures in bf16
and qwen3's in fp32 (the fp32 hybrid's 4.5e-6 to 1e-5 are its cached prefill's, with or without a prefetch). But at
issue 32's 16-layer qwen3.5-35b-a3b shape (512 slots, bf16) the prefetched decode's tokens left the resident ones at
step 34 of 64 where the plain cached decode kept all 64 (``decode_speed/bench_decode_speed_qwen3.5-35b-a3b_16l-512-
slots-tokens-prefetch-*_h100_2026-12-07.json``): on a GPU it is not exact. With the same code and flags one H100 kept
the resident tokens in three runs and another left them at step 34, as 7a2fc08's run had; no particular Pallas
kernel is needed. XLA builds the token mixers' residual adds otherwise in the prefetch's cached programs than in the
resident ones: a candidate for a rounding difference under its default excess precision, not confirmed
(docs/PROFILE.md "Open"; ``experiments/gpu_stages.sh prefetch-precision`` tests it). Only what moves over the link
should change: a wrong guess is an extra copy.
:func:`stats` counts a layer's misses as every expert it copied (guesses included) and its hits as the routed experts
it did not copy, so ``bytes_h2d`` stays every byte copied; the prefetch's own copies and the right guesses among them
are counted apart too (the metrics' ``prefetch_copies``, ``prefetch_used``, ``routed_hit_rate`` and
``lookup_hit_rate``: ``ftjax.experts.state.ExpertCounters.summary``).

Not command-buffer compatible on a GPU: XLA runs the two calls outside its CUDA graphs, splitting the step's graph
(``experiments/bench_decode_speed.py --split_probe`` measures that cost alone: 0.987x of the plain step). Measured
(H100, 2026-12-07, qwen3.5's 16-layer shape at 512 slots, G = 2): 0.936-0.951x of the plain cached step at 4 to 64
blocks per miss (``KernelConfig.prefetch_blocks``), the copied bytes +1%; a profile finds its copies no slower than the
step's own but not overlapped (docs/PROFILE.md "Open"). Experimental, off by default.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ftjax.experts import fetch, slot_copy
from ftjax.experts.slot_table import LayerLookup
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.kernels import registry
from ftjax.seams import LayerStats

#: Tokens of a call (rows x tokens per row, padding included) above which no prefetch is started (a decode step has
#: one per row; a prefill chunk's guesses would name most of the layer's experts).
MAX_TOKENS = 16


class Pending(NamedTuple):
    """A layer's started prefetch: flat ids and slots int32 [E] (the first ``count`` valid), count int32 [], and
    copied bool [E], the layer's experts whose copies it started."""

    flat: jax.Array
    slots: jax.Array
    count: jax.Array
    copied: jax.Array


def asynchronous(banks: ExpertBanks, state: ExpertState) -> bool:
    """Whether the copies run on the slot-copy kernel's own stream (the kernel applies to these banks, as
    ``fetch.uses_slot_kernel`` decides), else in the step's stream (:func:`fetch.fetch_experts`)."""
    return fetch.uses_slot_kernel(fetch._bank_arrays(banks), fetch._pool_arrays(state))


def start(banks: ExpertBanks, state: ExpertState, layer: jax.Array, look: LayerLookup) -> ExpertState:
    """The misses of ``look``, the slot table's lookup of layer ``layer``'s guesses (its table already the new one),
    copied into their slots. Returns the state with that table and the pools and :class:`Pending` in
    ``state.prefetch`` (joined by :func:`join`). On the kernel's own stream the returned pools must not be read until
    then."""
    e = look.miss_experts.shape[0]
    valid = jnp.arange(e) < look.n_miss
    flat = jnp.where(valid, layer * e + look.miss_experts, 0).astype(jnp.int32)
    slots = jnp.where(valid, look.miss_slots, 0).astype(jnp.int32)
    copied = jnp.zeros((e,), jnp.bool_).at[jnp.where(valid, look.miss_experts, e)].set(True, mode="drop")
    state = state.replace(table=look.table)
    with jax.named_scope("expert_prefetch"):
        if asynchronous(banks, state):
            blocks = registry.active().prefetch_blocks_per_miss()
            pools = tuple(slot_copy.copy_into_slots_start(b, p, flat, slots, look.n_miss, tag=i,
                                                          blocks_per_miss=blocks)
                          for i, (b, p) in enumerate(zip(fetch._bank_arrays(banks), fetch._pool_arrays(state))))
            state = fetch._with_pools(state, pools)
        else:
            state = fetch.fetch_experts(banks, state, flat, slots, look.n_miss)
    return state.replace(prefetch=Pending(flat, slots, look.n_miss, copied))


class Starter:
    """The expert function's ``prefetch`` attribute, which ``ftjax.model.decoder_layer`` calls before the token mixer
    with the layer's guesses (``ftjax.layers.moe.guess_experts``, ``guesses`` per token): the slot table's lookup of
    the guesses, then :func:`start` on these banks, for calls of at most :data:`MAX_TOKENS` tokens (:meth:`applies`).
    ``lookup``: ``(state, layer, ids int32 [N, G], valid bool [N]) -> LayerLookup``, the lookup of the experts named by
    valid tokens under the engine's cache policy, the one the layer's own lookup runs (``ftjax.experts.offload``: the
    slot lookup kernel where it applies, one launch against the jnp lookup's dozen small kernels)."""

    def __init__(self, banks: ExpertBanks, guesses: int, lookup):
        self.banks, self.guesses, self.lookup = banks, guesses, lookup

    def applies(self, shape: tuple) -> bool:
        """Whether a call whose residual stream has ``shape`` ([B, T, D]) prefetches."""
        return shape[0] * shape[1] <= MAX_TOKENS

    def __call__(self, state: ExpertState, layer: jax.Array, ids: jax.Array, valid: jax.Array) -> ExpertState:
        with jax.named_scope("prefetch_lookup"):
            look = self.lookup(state, layer, ids, valid)
        return start(self.banks, state, layer, look)


def join(banks: ExpertBanks, state: ExpertState, after: jax.Array) -> tuple[ExpertState, Pending | None]:
    """The state once its started copies have landed (XLA's stream waits for the kernel's; nothing to wait for where
    they ran in the step's stream), with ``prefetch`` cleared; and the :class:`Pending` joined, or None. ``after``:
    an array the layer computed since the start (the router's input): the wait is tied to it, so that XLA cannot
    schedule the wait before the token mixer, which would leave the copies nothing to run beside."""
    pending = state.prefetch
    if pending is None:
        return state, None
    state = state.replace(prefetch=None)
    if asynchronous(banks, state):
        with jax.named_scope("prefetch_wait"):
            pools, _ = jax.lax.optimization_barrier((fetch._pool_arrays(state), after))
            pools = tuple(slot_copy.wait_slots(p, pending.flat, pending.slots, pending.count, tag=i)
                          for i, p in enumerate(pools))
        state = fetch._with_pools(state, pools)
    return state, pending


def stats(s: LayerStats, pending: Pending | None, routed: jax.Array) -> LayerStats:
    """A layer's stats with its prefetch counted: misses and fetched + the copies it started, hits - the routed
    experts among them (routed: bool [E]), so misses are every expert the layer copied and hits the routed ones it
    did not copy (cached before it began and not evicted by its guesses); ``prefetched`` the copies it started and
    ``prefetch_used`` the routed ones among them (:class:`ftjax.seams.LayerStats`)."""
    if pending is None:
        return s
    with jax.named_scope("prefetch_stats"):
        used = jnp.sum(pending.copied & routed, dtype=jnp.int32)
    return s._replace(hits=s.hits - used, misses=s.misses + pending.count, fetched=s.fetched + pending.count,
                      prefetched=pending.count, prefetch_used=used)
