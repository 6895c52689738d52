"""Where expert weights come from: the one expert function plugged into ``ftjax.model.forward``.

Three modes share one code path (FreeToken-style expert offload; DESIGN.md 1.1):

* ``resident``: the whole bank ([L*E, ...]) is on the device and *is* the pool; slot = flat id.
* ``cached``: a pool of S slots on the device and a global slot table shared by all layers, both
  carried through the layer scan. Misses are copied from the host banks (memory kind
  ``pinned_host``) with ``jax.device_put`` inside the jitted step (``ftjax.experts.fetch``), or,
  under a cpu / adaptive miss policy, partly computed on the CPU (``ftjax.experts.miss_policy``,
  a strategy inside the same function).
* ``on_demand``: the same, but the table is emptied before every layer, so nothing is reused
  between steps or layers: every routed expert is fetched (the no-cache baseline).

Long prefills stream whole layers through two E-slot buffers instead
(:func:`make_stream_expert_fn`, DESIGN.md 1.3). :func:`step_expert_fn` picks the function of a
step from its static options. The expert arithmetic is ``experts_from_pool`` in every mode; only
slot numbers differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.config import EXPERT_MODES
from ftjax.experts import miss_policy, prefetch as prefetch_lib
from ftjax.experts.compute import experts_from_layer, experts_from_pool
from ftjax.experts.fetch import fetch_experts, fetch_layer
from ftjax.experts.slot_table import LayerLookup, forget_slots, lookup_layer, reset_table
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.kernels import slot_lookup
from ftjax.seams import LayerRouting, LayerStats

MODES = EXPERT_MODES


def routed_mask(ids: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """bool [E]: experts routed by at least one valid token. ids: int32 [N, k]; valid: bool [N]."""
    return jnp.zeros((num_experts,), jnp.bool_).at[ids].max(jnp.broadcast_to(valid[:, None], ids.shape))


#: Up to this many (token, expert) pairs :func:`routed_count` compares pairs instead of scattering.
PAIRWISE_MAX_PAIRS = 64


def routed_count(ids: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """int32 []: distinct experts routed by at least one valid token, ``sum(routed_mask(...))``.
    ids: int32 [N, k] in [0, E); valid: bool [N]. A decode step's few pairs (at most
    :data:`PAIRWISE_MAX_PAIRS`) are compared pairwise (a valid pair counts unless an earlier valid
    pair routed the same expert): elementwise work XLA fuses into one kernel, where the mask's
    scatter was two per layer of the resident decode step (H200 trace)."""
    if ids.size > PAIRWISE_MAX_PAIRS:
        return jnp.sum(routed_mask(ids, valid, num_experts), dtype=jnp.int32)
    flat = ids.reshape(-1)
    ok = jnp.broadcast_to(valid[:, None], ids.shape).reshape(-1)
    order = jnp.arange(flat.size)
    seen = (flat[:, None] == flat[None, :]) & ok[None, :] & (order[None, :] < order[:, None])
    return jnp.sum(ok & ~jnp.any(seen, axis=1), dtype=jnp.int32)


def trace_ids(r: LayerRouting) -> jax.Array:
    """The routed ids of a layer's stats (``LayerStats.routed_ids``): int32 [N, k], -1 for padding tokens."""
    return jnp.where(r.valid[:, None], r.ids, -1)


def make_expert_fn(mode: str, num_experts: int, banks: ExpertBanks | None = None, policy: str = "lru",
                   miss: miss_policy.MissConfig | None = None, cheap_conds: bool = False, prefetch: int = 0):
    """Builds the expert function (``ftjax.model.ExpertFn``) of an experts mode.

    Call it inside the jitted step, with the host banks an argument of that jit (memory kind
    ``pinned_host``), so the copies are part of the compiled program.

    Args:
      mode: one of :data:`MODES`.
      num_experts: E.
      banks: the host expert banks (needed by cached / on_demand).
      policy: the slot table's eviction policy (``ftjax.experts.slot_table.POLICIES``). With ``lru``, every
        miss fetched and the kernel config selecting ``slot_lookup``, a cached decode layer's lookup is one
        launch of ``ftjax.kernels.slot_lookup`` (same table, misses and slots as ``lookup_layer``).
      miss: the miss policy (None or fetch: every miss is fetched). cpu / adaptive need
        ``state.last_routed``.
      cheap_conds: a ``lax.cond`` in this program costs no host round trip (the CPU, or a GPU program
        run as a command buffer with CONDITIONAL: ``EngineConfig.decode_graphs``). Then a cached layer
        that routes fewer (token, expert) pairs than E takes the slot table's all-hit fast path
        (``lookup_layer(skip_if_all_hit=True)``; same results).
      prefetch: G > 0 (cached mode, fetch miss policy): the function gets a ``prefetch`` attribute
        (``ftjax.experts.prefetch.Starter``) that starts copying G guessed experts per token before each layer's
        token mixer, and joins them before its lookup (``ftjax.experts.prefetch``; the same weights in the slots).
        0: none.
    Raises:
      ValueError: unknown mode, host banks missing for an offloading mode, a cpu / adaptive
        miss policy with resident experts, or a prefetch outside the cached mode's fetch policy.
    """
    if mode not in MODES:
        raise ValueError(f"unknown experts mode {mode!r}; expected one of {MODES}")
    if mode != "resident" and banks is None:
        raise ValueError(f"experts mode {mode!r} needs the host expert banks")
    if miss is not None and miss.policy != "fetch" and mode == "resident":
        raise ValueError(f"miss policy {miss.policy!r} needs experts mode cached or on_demand, got {mode!r}")
    if prefetch and (mode != "cached" or (miss is not None and miss.policy != "fetch")):
        raise ValueError(f"prefetch={prefetch} needs experts mode cached and the fetch miss policy, got {mode!r}"
                         f"{'' if miss is None else f' and {miss.policy!r}'}")
    e = num_experts

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        if mode == "resident":
            with jax.named_scope("slot_lookup"):
                hits = routed_count(r.ids, r.valid, e)
            slot_of_expert = layer * e + jnp.arange(e, dtype=jnp.int32)
            stats = LayerStats.fetch_only(hits, jnp.int32(0), trace_ids(r))
            return experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, state.gate_up, state.down, state.scales,
                                     state.fmt), state, stats
        if mode == "cached" and (miss is None or miss.fetches_all(r.ids.size, e)):
            with jax.named_scope("slot_lookup"):
                got = _kernel_lookup(state, layer, r.ids, r.valid, e, policy)
            if got is not None:  # one launch for the lookup (ftjax.kernels.slot_lookup); same results
                look, flat_miss, pair_slots = got
                return _fetch_and_compute(banks, state.replace(table=look.table), layer, look, r, e, flat_miss,
                                          pair_slots)
        routed, table, recency = layer_routing(mode, state, layer, r, e)
        if miss is not None and not miss.fetches_all(r.ids.size, e):
            y, state, stats = miss_policy.split_layer(miss, banks, state, table, layer, routed, r, policy)
            return y, state.replace(last_routed=recency), stats
        with jax.named_scope("slot_lookup"):
            # few (token, expert) pairs (a cached decode step): most layers hit everything, skip their eviction
            # order; never on_demand, whose table was just reset (every routed expert misses: the cond would only
            # cost), nor where a cond's predicate would go to the host (cheap_conds False)
            skip = cheap_conds and mode == "cached" and r.ids.size < e
            look = lookup_layer(table, layer, routed, e, policy, skip_if_all_hit=skip)
        return _fetch_and_compute(banks, state.replace(table=look.table, last_routed=recency), layer, look, r, e)

    if not prefetch:
        return expert_fn
    layer_fn = expert_fn

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):  # noqa: F811 - the prefetch around it
        state, pending = prefetch_lib.join(banks, state, r.x)
        y, state, stats = layer_fn(state, layer, r)
        return y, state, prefetch_lib.stats(stats, pending, routed_mask(r.ids, r.valid, e))

    def guess_lookup(state: ExpertState, layer: jax.Array, ids: jax.Array, valid: jax.Array) -> LayerLookup:
        """The slot table's lookup of the guesses ids int32 [N, G] of valid tokens, as the layer's own (above)."""
        got = _kernel_lookup(state, layer, ids, valid, e, policy)
        if got is not None:
            return got[0]
        return lookup_layer(state.table, layer, routed_mask(ids, valid, e), e, policy)
    expert_fn.prefetch = prefetch_lib.Starter(banks, prefetch, guess_lookup)
    return expert_fn


def layer_routing(mode: str, state: ExpertState, layer: jax.Array, r: LayerRouting, num_experts: int):
    """What a cached / on_demand layer starts from: (routed bool [E], the table to look up -- emptied for
    on_demand --, the recency int32 [L*E] with this layer's routed experts made the most recent at the
    table's clock, or None when the state keeps no recency)."""
    with jax.named_scope("slot_lookup"):
        routed = routed_mask(r.ids, r.valid, num_experts)
    table = reset_table(state.table) if mode == "on_demand" else state.table
    recency = state.last_routed
    if recency is not None:  # every routed expert (hit, fetched or CPU) is now the most recent
        base = layer * num_experts
        last = jax.lax.dynamic_slice(recency, (base,), (num_experts,))
        recency = jax.lax.dynamic_update_slice(recency, jnp.where(routed, table.clock, last), (base,))
    return routed, table, recency


def _kernel_lookup(state: ExpertState, layer: jax.Array, ids: jax.Array, valid: jax.Array, e: int, policy):
    """``lookup_layer(state.table, layer, routed_mask(ids, valid, e), e, "lru")`` through the slot lookup kernel
    (ids int32 [N, k] of tokens valid bool [N]) where it applies: the LRU policy, no recency kept
    (``state.last_routed`` None), and the kernel config selects it for this layer (a decode layer: fewer pairs than
    E); else None. Returns (the :class:`LayerLookup`, the misses' flat ids int32 [E], each pair's slot int32
    [N, k])."""
    if policy != "lru" or state.last_routed is not None:
        return None
    table = state.table
    got = slot_lookup.maybe(ids, valid, table.slot_of, table.id_of_slot, table.last_use, table.clock, layer, e)
    if got is None:
        return None
    (slot_of, id_of_slot, last_use, slot_of_expert, miss_experts, miss_slots, evicted_ids, n_miss, n_hit, flat_miss,
     pair_slots) = got
    table = table.replace(slot_of=slot_of, id_of_slot=id_of_slot, last_use=last_use, clock=table.clock + 1)
    look = LayerLookup(table, slot_of_expert, miss_experts, miss_slots, evicted_ids, n_miss, n_hit)
    return look, flat_miss, pair_slots


def _fetch_and_compute(banks: ExpertBanks, state: ExpertState, layer: jax.Array, look: LayerLookup,
                       r: LayerRouting, e: int, flat_miss: jax.Array | None = None,
                       pair_slots: jax.Array | None = None):
    """The misses of a lookup copied into their slots, then the layer's experts from the pool:
    (y, state, stats) of a cached / on_demand layer. flat_miss (``layer * E + look.miss_experts``) and
    pair_slots (``look.slot_of_expert[r.ids]``): the same values where the slot lookup kernel made them."""
    flat = layer * e + look.miss_experts if flat_miss is None else flat_miss
    state = fetch_experts(banks, state, flat, look.miss_slots, look.n_miss)
    y = experts_from_pool(r.x, r.ids, r.weights, look.slot_of_expert, state.gate_up, state.down, state.scales,
                          state.fmt, pair_slots)
    return y, state, LayerStats.fetch_only(look.n_hit, look.n_miss, trace_ids(r))


def stream_prologue(banks: ExpertBanks, state: ExpertState, num_experts: int, overlap: bool) -> ExpertState:
    """Prepares full-layer streaming: the slot table forgets the 2E borrowed slots [0, 2E), and
    (with overlap) layer 0's experts are copied into buffer 0 before the layer scan starts."""
    state = state.replace(table=forget_slots(state.table, jnp.arange(2 * num_experts, dtype=jnp.int32)))
    if overlap:
        state = fetch_layer(banks, state, 0, 0, num_experts)
    return state


def make_stream_expert_fn(num_experts: int, num_layers: int, banks: ExpertBanks, overlap: bool = True):
    """Expert function for long prefills: whole layers streamed through two buffers of E slots
    borrowed from the pool (FreeToken's full-layer double buffering; DESIGN.md 1.3).

    With ``overlap``, layer l computes from buffer l % 2 while layer l+1's experts are copied
    into the other buffer (issued before layer l's expert compute; the copy of the last layer is
    clamped to L-1, one wasted layer copy per call). Without it (the ablation), each layer copies
    its own experts and then computes, strictly in series. Needs :func:`stream_prologue` first.
    Stats count every copied expert as a fetched miss (hits 0).
    """
    e, n_layers = num_experts, num_layers

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        buf = layer % 2
        slot_of_expert = buf * e + jnp.arange(e, dtype=jnp.int32)
        if overlap:
            # Compute reads the pool as it is now (buffer l % 2 holds layer l); the prefetch
            # writes buffer (l+1) % 2, so the two are independent and the copy can run early.
            y = experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, state.gate_up, state.down, state.scales,
                                  state.fmt)
            state = fetch_layer(banks, state, jnp.minimum(layer + 1, n_layers - 1), 1 - buf, e)
        else:
            state = fetch_layer(banks, state, layer, buf, e)
            y = experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, state.gate_up, state.down, state.scales,
                                  state.fmt)
        return y, state, LayerStats.fetch_only(jnp.int32(0), jnp.int32(e), trace_ids(r))

    return expert_fn


def make_layer_buffer_expert_fn(num_experts: int, buffer: tuple, fmt: str = "dense", d2d_hits: bool = False):
    """Expert function of one streamed layer whose E experts were copied as a whole into device
    arrays ``buffer`` = (gate_up [E, D, 2F], down [E, F, D], *scales) by the layer-pipelined driver
    (``ftjax.runtime.drivers``): computes straight from them (no pool read, no gather copy) and
    leaves the expert state as it is.

    Stats: without ``d2d_hits`` as :func:`make_stream_expert_fn` (E fetched, 0 hits). With it, the
    driver copied every expert of the layer that the slot table maps (``state.table``, which a
    streamed call does not change) device to device from its slot, and the rest over PCIe: hits =
    d2d = those resident experts (int32 []), misses = fetched = E - hits.
    """
    gate_up, down, *scales = buffer

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        y = experts_from_layer(r.x, r.ids, r.weights, gate_up, down, tuple(scales) or None, fmt)
        if not d2d_hits:
            return y, state, LayerStats.fetch_only(jnp.int32(0), jnp.int32(num_experts), trace_ids(r))
        slots = jax.lax.dynamic_slice(state.table.slot_of, (layer * num_experts,), (num_experts,))
        hits = jnp.sum(slots >= 0, dtype=jnp.int32)
        pcie = jnp.int32(num_experts) - hits
        return y, state, LayerStats(hits, pcie, pcie, jnp.int32(0), trace_ids(r), d2d=hits)

    return expert_fn


def step_expert_fn(num_layers: int, num_experts: int, mode: str, banks: ExpertBanks, state: ExpertState,
                   stream: bool = False, overlap: bool = True, policy: str = "lru",
                   miss: miss_policy.MissConfig | None = None, cheap_conds: bool = False, prefetch: int = 0):
    """(state, expert function) of one jitted step, inside the jit: full-layer streaming for a
    long prefill chunk (every expert fetched, whatever the miss policy), else the experts mode
    with the cache ``policy``, the ``miss`` policy, ``cheap_conds`` and ``prefetch`` (:func:`make_expert_fn`)."""
    if stream:
        state = stream_prologue(banks, state, num_experts, overlap)
        return state, make_stream_expert_fn(num_experts, num_layers, banks, overlap)
    return state, make_expert_fn(mode, num_experts, banks, policy, miss, cheap_conds, prefetch)
