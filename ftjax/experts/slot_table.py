"""Global expert slot table (decode-time expert cache; eviction policies in ``ftjax.experts.policies``), as pure
jittable JAX.

Source of the idea: FreeToken-style *global* LRU expert cache, see
``docs/DESIGN.md`` section 1.1. One pool of ``S`` slots (per weight kind) is shared
by all layers; a slot holds one (layer, expert), addressed by its flat id
``flat_id = layer * E + expert``. The table is a small pytree of fixed-shape arrays (int32, and
one float32 array of CRF history) that is carried through the ``jax.lax.scan`` over layers, so every
function here:

* is pure (returns a new table, never mutates),
* has fixed shapes that depend only on ``(L, E, S)`` and never on routing,
* has no Python control flow on traced values and no host sync, so ``layer`` may be a traced
  int32 scalar (the scan index).

Policy of :func:`lookup_layer` (for one layer of one step):

1. Routed experts that are resident are *hits*: their slot's ``last_use`` becomes ``clock``.
2. Routed experts that are not resident are *misses*. The candidate slots are all slots that
   do **not** hold a hit of this layer's current step, ordered by ``(last_use, slot index)``
   ascending (free slots have ``last_use == -1`` and so come first; ties go to the lowest slot
   index: the order is deterministic). Misses, in ascending expert id order, take the
   candidates in that order. The evicted flat id (if any) becomes non-resident, the missed
   flat id is mapped to the slot, and the slot's ``last_use`` becomes ``clock``.
   That order is ``lru``'s; every registered policy (:data:`POLICIES`, one module each in
   ``ftjax.experts.policies``) gives its own, as sort keys over the slots: :func:`eviction_order`.
3. The policy's update on reference, if any (``lfru`` and ``lfu``: the routed ids' CRF history).
4. ``clock`` advances by one (once per call, even when nothing was routed), so recency is
   global across layers.

Only the first ``E`` candidates are ever taken; ``KernelConfig.slot_order`` picks how they are found (a full
stable sort, the reference; or a counting rank, with fewer kernels and no sort) and how the table is
updated. Every implementation returns bit-identical results.

``S >= E`` is required (all ``E`` experts of a layer may be routed at once) and is enough:
the candidates exclude only the ``n_hit`` hit slots, leaving ``S - n_hit >= n_miss`` slots.
``S <= L * E`` is also required (more slots than experts is a configuration error; use
:func:`init_resident_table` for the fully resident case).

The clock is int32: it wraps after 2**31 - 1 (step, layer) calls (e.g. ~44.7M decode steps of a
48-layer model), far beyond one serving session.

Per-id history (``crf_log2``, ``crf_time``) is kept for the policies that read it (``lfru``: LRFU,
Lee et al. 2001; ``lfu``), with the definitions in ``ftjax/experts/policies/lfru.py``. An evicted id
keeps its history (a re-fetched expert resumes it); :func:`forget_slots` and :func:`reset_table` clear
it. Other policies never read or write these two arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ftjax.experts import policies
from ftjax.experts.slot_state import SlotTable
from ftjax.experts.policies import CachePolicy
from ftjax.experts.policies.lfru import LFRU_HALF_LIFE_TOKENS, lfru_lambda
from ftjax.kernels import registry

__all__ = [
    "SlotTable",
    "LayerLookup",
    "init_slot_table",
    "init_resident_table",
    "lookup_layer",
    "lookup_layer_no_reuse",
    "forget_slots",
    "reset_table",
    "eviction_order",
    "POLICIES",
    "CachePolicy",
    "ORDER_IMPLS",
    "LFRU_HALF_LIFE_TOKENS",
    "lfru_lambda",
]

class LayerLookup(NamedTuple):
    """Result of :func:`lookup_layer` for one layer of one step. ``E`` = experts per layer.

    Attributes:
      table: the updated :class:`SlotTable`.
      slot_of_expert: int32 ``[E]``. For each expert of this layer, its slot *after* the
        update: every routed expert has a valid slot (hit: unchanged; miss: newly assigned);
        a non-routed expert has its slot if still resident, else ``-1`` (a non-routed expert of
        this layer can be evicted by this very call). Routed ids are rewritten to slot ids by
        ``slot_of_expert[expert_ids]``.
      miss_experts: int32 ``[E]``. Expert ids (``0..E-1``, *not* flat ids) that missed, in
        ascending expert id order; the first ``n_miss`` entries are valid, the rest are ``-1``.
      miss_slots: int32 ``[E]``. Slot assigned to each miss, same order as ``miss_experts``
        (the LRU order of the candidate slots); padding ``-1``. Entry ``i`` is the slot into
        which the host bank row ``layer*E + miss_experts[i]`` must be copied.
      evicted_ids: int32 ``[E]``. Flat id evicted from ``miss_slots[i]`` (``-1`` if that slot
        was free, and for padding). Extra output, useful for stats and debugging.
      n_miss: int32 ``[]``. Number of routed experts that were not resident.
      n_hit: int32 ``[]``. Number of routed experts that were already resident.
        ``n_hit + n_miss == routed.sum()``.
    """

    table: SlotTable
    slot_of_expert: jax.Array
    miss_experts: jax.Array
    miss_slots: jax.Array
    evicted_ids: jax.Array
    n_miss: jax.Array
    n_hit: jax.Array


def _check_sizes(num_layers: int, num_experts: int) -> None:
    if num_layers < 1 or num_experts < 1:
        raise ValueError(
            f"num_layers and num_experts must be >= 1, got num_layers={num_layers}, "
            f"num_experts={num_experts}"
        )


def _no_history(total: int) -> dict:
    """LRFU fields of a table with no reference history (``L*E = total``)."""
    return {"crf_log2": jnp.full((total,), -jnp.inf, jnp.float32),
            "crf_time": jnp.full((total,), -1, jnp.int32)}


def init_slot_table(num_layers: int, num_experts: int, num_slots: int) -> SlotTable:
    """Empty table: every slot free, no expert resident, ``clock = 0``.

    Args:
      num_layers: ``L`` (static Python int).
      num_experts: ``E``, routed experts per layer (static Python int).
      num_slots: ``S``, slots in the pool (static Python int), ``E <= S <= L*E``.

    Returns:
      SlotTable with ``slot_of`` int32 ``[L*E]`` all -1, ``id_of_slot`` and ``last_use``
      int32 ``[S]`` all -1, ``clock`` int32 ``[]`` = 0, no LRFU history (``crf_log2`` float32
      ``[L*E]`` all -inf, ``crf_time`` int32 ``[L*E]`` all -1).

    Raises:
      ValueError: if ``num_slots < num_experts`` (all experts of one layer may be routed in one
        step, so fewer slots cannot be correct) or ``num_slots > num_layers * num_experts``.
    """
    _check_sizes(num_layers, num_experts)
    total = num_layers * num_experts
    if num_slots < num_experts:
        raise ValueError(
            f"num_slots={num_slots} is too small: the global expert slot cache needs "
            f"num_slots >= num_experts={num_experts} (the minimum), because every expert of "
            f"one layer can be routed in the same step; the maximum useful value is "
            f"num_layers*num_experts={total} (DESIGN.md 1.1)"
        )
    if num_slots > total:
        raise ValueError(
            f"num_slots={num_slots} is too large: at most num_layers*num_experts={total} "
            f"slots can be used (minimum num_experts={num_experts}); use "
            f"init_resident_table for the fully resident model"
        )
    return SlotTable(
        slot_of=jnp.full((total,), -1, jnp.int32),
        id_of_slot=jnp.full((num_slots,), -1, jnp.int32),
        last_use=jnp.full((num_slots,), -1, jnp.int32),
        clock=jnp.zeros((), jnp.int32),
        **_no_history(total),
    )


def init_resident_table(num_layers: int, num_experts: int) -> SlotTable:
    """Fully resident table ('resident' mode): ``S = L*E`` and slot ``i`` holds flat id ``i``.

    ``slot_of`` and ``id_of_slot`` are both ``arange(L*E)`` (int32), ``last_use`` is all -1
    (never used), ``clock = 0``, no LRFU history. :func:`lookup_layer` on it never misses, and
    ``slot_of_expert == layer*E + arange(E)``.
    """
    _check_sizes(num_layers, num_experts)
    total = num_layers * num_experts
    ids = jnp.arange(total, dtype=jnp.int32)
    return SlotTable(
        slot_of=ids,
        id_of_slot=ids,
        last_use=jnp.full((total,), -1, jnp.int32),
        clock=jnp.zeros((), jnp.int32),
        **_no_history(total),
    )


POLICIES = policies.names()
"""Names of the registered eviction policies (``ftjax.experts.policies``: one module each), sorted."""


def _policy(policy: str | CachePolicy, half_life_tokens: float = LFRU_HALF_LIFE_TOKENS) -> CachePolicy:
    """The policy instance of ``policy`` (a registered name, or an instance, used as is); a name's
    policy gets ``half_life_tokens`` if it takes that parameter (``lfru``). Raises ValueError for an
    unknown name (listing :data:`POLICIES`) or a bad parameter value."""
    return policies.resolve(policy, half_life_tokens=half_life_tokens)


def eviction_order(table: SlotTable, layer: jax.Array, protected: jax.Array, num_experts: int,
                   policy: str | CachePolicy = "lru", half_life_tokens: float = LFRU_HALF_LIFE_TOKENS) -> jax.Array:
    """int32 [S]: slots in the order they are given to misses: lexicographic on the policy's
    ``order_keys``, ties to the lowest slot index (free slots first and protected last under every
    registered policy).

    ``policy``: a name of :data:`POLICIES` or a ``CachePolicy`` instance (the policies' docstrings,
    ``ftjax/experts/policies/*.py``, define the orders). ``half_life_tokens`` (static): passed to a named
    policy that takes it (``lfru``: decode steps after which a reference counts half). ``protected``:
    bool [S], slots holding a hit of this lookup. Raises ValueError for an unknown policy.
    """
    keys = _order_keys(table, layer, protected, num_experts, policy, half_life_tokens)
    # One stable argsort per key, least significant first (the order of the keys, then the slot
    # index): on the CPU, where "sort" is the default, 2.2x faster than one sort of all the keys for
    # lookahead's two and 1.2x for lfru's four (CPU time of a 4096-lookup scan, L=8, E=32, S=48).
    order = jnp.argsort(keys[-1], stable=True)
    for key in reversed(keys[:-1]):
        order = order[jnp.argsort(key[order], stable=True)]
    return order.astype(jnp.int32)


#: Largest S for which ``"auto"`` picks ``"rank"`` on an accelerator: its count grows as S^2 (measured
#: 1.6x faster than the sort at S = 1975; at 4096 it does 4.3x that work), the sorts as S log S.
RANK_MAX_SLOTS = 4096

#: How :func:`lookup_layer` finds the slots misses take and updates the table when its ``impl`` is None: the
#: active kernel config's ``slot_order`` (``KernelConfig.slot_order``; "auto": ``"rank"`` on an accelerator up
#: to :data:`RANK_MAX_SLOTS` slots, ``"top_k"`` above, ``"sort"`` on the CPU). Every implementation returns a
#: bit-identical :class:`LayerLookup` for every policy on every table that keeps :class:`SlotTable`'s
#: invariant (tests/test_slot_table.py); they differ only in kernels and time (``experiments/ab_slot_table.py``;
#: docs/PROFILE.md has the H200 figures).
#: The order implementations of :func:`lookup_layer`:
#:
#: * ``"sort"``: the reference: :func:`eviction_order` (a full stable argsort of the S slots per key of
#:   the policy: one for ``lru``, two for ``lookahead``), then one scatter per table update (seven in all).
#: * ``"lexsort"``: one stable ``lax.sort`` on the policy's keys (slot index last), then the fused
#:   bookkeeping below.
#: * ``"top_k"``: a policy with one int32 key (``lru``): ``lax.top_k`` (only the E first slots are ever
#:   used); several keys (``lookahead``: two, ``lfru`` / ``lfu``: four; no exact single key): as ``"lexsort"``.
#: * ``"rank"``: no sort: each slot's position in the order is counted (one compare-and-count over
#:   [S, S]) and the E first slots are read off those positions ([E, S]).
#:
#: The fused bookkeeping (all but ``"sort"``) derives the hit slots, ``id_of_slot`` and ``last_use``
#: elementwise from each slot's position in the order, and updates ``slot_of`` in one scatter.
ORDER_IMPLS = ("sort", "lexsort", "top_k", "rank")


def _order_keys(table: SlotTable, layer: jax.Array, protected: jax.Array, num_experts: int,
                policy: str | CachePolicy, half_life_tokens: float = LFRU_HALF_LIFE_TOKENS) -> tuple[jax.Array, ...]:
    """The keys [S] of :func:`eviction_order` (the policy's ``order_keys``): its order is lexicographic
    on them, then on slot index. Raises ValueError for an unknown policy."""
    return _policy(policy, half_life_tokens).order_keys(table, layer, protected, num_experts)


def _sort_key_int(key: jax.Array) -> jax.Array:
    """int32 key ordered as ``lax.sort`` orders ``key``: int32 as is; float32 in the sort's total order
    (-0 equal to 0, every NaN equal and after +inf), by its bits with the negatives' magnitude flipped."""
    if key.dtype == jnp.int32:
        return key
    if key.dtype != jnp.float32:
        raise TypeError(f"sort key dtype {key.dtype} not supported")
    x = jnp.where(key == 0, jnp.zeros_like(key), key)
    x = jnp.where(jnp.isnan(x), jnp.full_like(x, jnp.nan), x)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _rank(keys: tuple[jax.Array, ...]) -> jax.Array:
    """int32 [S]: each slot's position in the order lexicographic on ``keys`` [S], then slot index."""
    S = keys[0].shape[0]
    slots = jnp.arange(S, dtype=jnp.int32)
    # The slot index rides in the last key's low bits: (last, slot) has the order of (last >> low,
    # (last's low bits << bits) | slot), both int32 (low + bits = 31). A separate slot-index compare
    # would be an [S, S] array that depends on nothing: XLA hoists such an array out of the layer
    # scan (the CPU compiler does) and reads it back every layer.
    bits = max(1, (S - 1).bit_length())
    low = 31 - bits
    last = _sort_key_int(keys[-1])
    ints = [_sort_key_int(k) for k in keys[:-1]] + [last >> low, ((last & ((1 << low) - 1)) << bits) | slots]
    before = None                                   # [i, j]: slot j comes before slot i
    for k in reversed(ints):
        lt = k[None, :] < k[:, None]
        before = lt if before is None else lt | ((k[None, :] == k[:, None]) & before)
    return before.sum(axis=1, dtype=jnp.int32)


def _candidates(keys: tuple[jax.Array, ...], num_experts: int, impl: str) -> tuple[jax.Array, jax.Array]:
    """(cand int32 [E]: the E first slots of the order, pos int32 [S]: each slot's position in it,
    ``>= E`` for the others) of the order lexicographic on ``keys`` then slot index."""
    E = num_experts
    slots = jnp.arange(keys[0].shape[0], dtype=jnp.int32)
    experts = jnp.arange(E, dtype=jnp.int32)
    if impl == "rank":
        pos = _rank(keys)
        # pos is a permutation of 0..S-1 (S >= E): exactly one slot has pos == p for each p < E
        cand = jnp.sum(jnp.where(pos[None, :] == experts[:, None], slots[None, :], 0), axis=1, dtype=jnp.int32)
        return cand, pos
    if impl == "top_k" and len(keys) == 1:
        # ~k = -1 - k reverses the int32 order without overflow (INT32_MAX -> INT32_MIN); top_k is
        # stable (equal values keep index order): the E smallest keys, ties to the lowest slot
        cand = jax.lax.top_k(~_sort_key_int(keys[0]), E)[1].astype(jnp.int32)
    else:
        # stable sort with the slot index as payload: lexicographic (keys, slot), as eviction_order
        cand = jax.lax.sort((*keys, slots), num_keys=len(keys), is_stable=True)[-1][:E]
    # cand holds distinct slots: each slot matches at most one position
    pos = jnp.min(jnp.where(cand[None, :] == slots[:, None], experts[None, :], E), axis=1)
    return cand, pos


def lookup_layer(
    table: SlotTable, layer: jax.Array | int, routed: jax.Array, num_experts: int, policy: str | CachePolicy = "lru",
    half_life_tokens: float = LFRU_HALF_LIFE_TOKENS, impl: str | None = None, skip_if_all_hit: bool = False,
) -> LayerLookup:
    """Look up (and fill) the slots of one layer's routed experts; advance the clock.

    Args:
      table: current :class:`SlotTable` (``S = table.num_slots``, ``S >= num_experts``).
      layer: int32 scalar, may be traced (e.g. the ``lax.scan`` index), ``0 <= layer < L``.
      routed: bool ``[E]`` (any integer/bool dtype accepted, nonzero = routed). True for each
        expert of this layer routed by any token of the current step (already deduplicated).
      num_experts: ``E`` (static Python int).
      policy: which non-hit slots misses take (:func:`eviction_order`): a name of :data:`POLICIES`, or a
        ``CachePolicy`` instance (static: hashable; e.g. ``ftjax.experts.policies.get("lfru", half_life_tokens=8)``).
      half_life_tokens: static; passed to a named policy that takes it (``lfru``: decode steps after which a
        reference counts half); ignored otherwise.
      impl: static, one of :data:`ORDER_IMPLS`; None (default): the active kernel config's ``slot_order``.
        Every implementation gives the same result; only the kernels differ.
      skip_if_all_hit: static. When no routed expert misses, skip the eviction order (a ``lax.cond``
        on the misses around the candidate slots; the fills they would feed are all masked then), so
        the result is the same as without it. Worth it where most layers hit everything (a decode step of a
        few tokens) and a cond costs no host round trip: on a GPU its predicate goes to the host unless the
        program runs as a command buffer with CONDITIONAL (``EngineConfig.decode_graphs``).
        ``ftjax.experts.offload`` sets it for a layer of the cached mode that routes fewer (token, expert)
        pairs than E, in programs where conds are cheap (``StepOptions.cheap_conds``: the CPU, or such a
        command buffer).

    Returns:
      :class:`LayerLookup`. See the module docstring for the exact policy (hits refresh,
      misses in ascending expert id take the non-hit slots in the policy's order, ties to the lowest
      slot index, the policy's update on reference, ``clock += 1``).

    Raises:
      ValueError: unknown policy or impl, a bad policy parameter, ``S < E``, or ``routed`` not ``[E]``.

    Fixed shapes, no Python branches on values: safe under ``jax.jit`` and ``lax.scan``.
    """
    E = int(num_experts)
    S = table.num_slots
    LE = table.num_flat_ids
    if S < E:
        raise ValueError(f"num_slots={S} < num_experts={E}: the table cannot serve a layer")
    if LE % E != 0:
        raise ValueError(f"table has {LE} flat ids, not a multiple of num_experts={E}")
    pol = _policy(policy, half_life_tokens)
    impl = registry.active().slot_order if impl is None else impl
    if impl == "auto":
        impl = "sort" if registry.backend() == "cpu" else "rank" if S <= RANK_MAX_SLOTS else "top_k"
    if impl not in ORDER_IMPLS:
        raise ValueError(f"unknown slot table impl {impl!r}; expected one of {ORDER_IMPLS}")
    routed = jnp.asarray(routed)
    if routed.shape != (E,):
        raise ValueError(f"routed must have shape ({E},), got {routed.shape}")
    routed = routed.astype(jnp.bool_)
    layer = jnp.asarray(layer, jnp.int32)
    clock = table.clock

    base = layer * E
    cur_slot = jax.lax.dynamic_slice(table.slot_of, (base,), (E,))  # [E]
    resident = cur_slot >= 0
    hit = routed & resident
    miss = routed & ~resident

    update = _update_sorted if impl == "sort" else _update_fused
    slot_of, id_of_slot, last_use, miss_experts, miss_slots, evicted_ids, n_miss, n_hit = update(
        table, layer, routed, cur_slot, hit, miss, E, pol, impl, skip_if_all_hit)

    # every routed expert (hit or fill) is referenced now, at this lookup's clock; then the clock advances
    new_table = pol.on_reference(table.replace(slot_of=slot_of, id_of_slot=id_of_slot, last_use=last_use),
                                 layer, routed, E)
    new_table = new_table.replace(clock=clock + 1)
    slot_of_expert = jax.lax.dynamic_slice(slot_of, (base,), (E,))
    return LayerLookup(
        table=new_table,
        slot_of_expert=slot_of_expert,
        miss_experts=miss_experts,
        miss_slots=miss_slots,
        evicted_ids=evicted_ids,
        n_miss=n_miss,
        n_hit=n_hit,
    )


def _update_sorted(table, layer, routed, cur_slot, hit, miss, E, policy, impl, skip=False):
    """impl "sort" (the reference): the full :func:`eviction_order` and one scatter per update.
    Returns (slot_of, id_of_slot, last_use, miss_experts, miss_slots, evicted_ids, n_miss, n_hit)."""
    del routed, impl
    S, LE, clock = table.num_slots, table.num_flat_ids, table.clock
    n_hit = hit.sum(dtype=jnp.int32)
    n_miss = miss.sum(dtype=jnp.int32)
    experts = jnp.arange(E, dtype=jnp.int32)
    base = layer * E
    # Slots holding a hit of this step are protected from eviction.
    hit_slot_idx = jnp.where(hit, cur_slot, S)                      # S = dropped
    protected = jnp.zeros((S,), jnp.bool_).at[hit_slot_idx].set(True, mode="drop")

    cand = _unless_all_hit(skip, miss, lambda: eviction_order(table, layer, protected, E, policy)[:E],
                           lambda: jnp.zeros((E,), jnp.int32))      # [E], S >= E

    # Compact list of misses in ascending expert id, and their slots.
    rank = jnp.cumsum(miss.astype(jnp.int32)) - 1                   # rank of each miss
    valid = experts < n_miss                                        # first n_miss entries
    miss_experts = (
        jnp.full((E,), -1, jnp.int32).at[jnp.where(miss, rank, E)].set(experts, mode="drop")
    )
    miss_slots = jnp.where(valid, cand, -1)
    evicted_ids = jnp.where(valid, table.id_of_slot[cand], -1)

    # Evict: old ids lose their slot (cannot be hits of this layer: those slots are protected,
    # and cannot be misses of this layer: those were not resident).
    slot_of = table.slot_of.at[jnp.where(evicted_ids >= 0, evicted_ids, LE)].set(
        -1, mode="drop"
    )
    # Map the misses.
    miss_flat = jnp.where(valid, base + miss_experts, LE)
    slot_of = slot_of.at[miss_flat].set(cand, mode="drop")
    fill_idx = jnp.where(valid, cand, S)
    id_of_slot = table.id_of_slot.at[fill_idx].set(base + miss_experts, mode="drop")
    # Recency: hits and new fills are used now.
    last_use = table.last_use.at[hit_slot_idx].set(clock, mode="drop")
    last_use = last_use.at[fill_idx].set(clock, mode="drop")
    return slot_of, id_of_slot, last_use, miss_experts, miss_slots, evicted_ids, n_miss, n_hit


def _unless_all_hit(skip: bool, miss: jax.Array, candidates, no_candidates):
    """``candidates()``, or (with ``skip``) a ``lax.cond`` that returns ``no_candidates()`` instead when
    nothing misses: the candidates are then unused (every fill is masked by ``n_miss`` = 0). Only the
    candidates sit in the cond, so its outputs are fresh arrays, not copies of the carried table."""
    if not skip:
        return candidates()
    return jax.lax.cond(jnp.any(miss), candidates, no_candidates)


def _update_fused(table, layer, routed, cur_slot, hit, miss, E, policy, impl, skip=False):
    """impls "lexsort", "top_k", "rank": the E first slots of the order only, and the updates as
    elementwise selects (one scatter, for ``slot_of``). Same returns as :func:`_update_sorted`."""
    S, LE = table.num_slots, table.num_flat_ids
    experts = jnp.arange(E, dtype=jnp.int32)
    slots = jnp.arange(S, dtype=jnp.int32)
    base = layer * E
    ids = table.id_of_slot
    # Hit slots without a scatter: slot j holds a hit iff its id is base + e, e routed, at slot j.
    # Same set as the scatter of cur_slot[hit]: a resident id's slot holds that id (the invariant).
    e_of = jnp.clip(ids - base, 0, E - 1)
    protected = (ids >= base) & (ids < base + E) & routed[e_of] & (cur_slot[e_of] == slots)
    cand, pos = _unless_all_hit(
        skip, miss, lambda: _candidates(_order_keys(table, layer, protected, E, policy), E, impl),
        lambda: (jnp.zeros((E,), jnp.int32), jnp.full((table.num_slots,), E, jnp.int32)))

    # Misses and hits up to each expert (one [2, E, E] count, no cumsum): a miss's rank among the
    # misses (ascending expert id) is its count - 1; the counts up to E - 1 are n_miss and n_hit.
    upto = jnp.sum(jnp.stack([miss, hit])[:, None, :] & (experts[None, :] <= experts[:, None]), axis=2,
                   dtype=jnp.int32)
    rank, n_miss, n_hit = upto[0] - 1, upto[0, E - 1], upto[1, E - 1]
    valid = experts < n_miss
    one_hot = miss[None, :] & (rank[None, :] == experts[:, None])    # [p, e]: miss e has rank p (no scatter)
    miss_experts = jnp.where(valid, jnp.sum(jnp.where(one_hot, experts[None, :], 0), axis=1, dtype=jnp.int32), -1)
    miss_slots = jnp.where(valid, cand, -1)
    evicted_ids = jnp.where(valid, ids[cand], -1)

    # The slot at position p < n_miss takes miss p: the scatters at cand[:n_miss] as selects on pos;
    # last_use: hits and fills both get the clock (the two scatters wrote the same value).
    filled = pos < n_miss
    id_of_slot = jnp.where(filled, base + miss_experts[jnp.minimum(pos, E - 1)], ids)
    last_use = jnp.where(protected | filled, table.clock, table.last_use)
    # Evict and map in one scatter: evicted ids are resident, misses are not (the invariant): no index is both
    # (and repeated evicted ids all write -1): the order of the two old scatters cannot matter.
    idx = jnp.concatenate([jnp.where(evicted_ids >= 0, evicted_ids, LE), jnp.where(valid, base + miss_experts, LE)])
    val = jnp.concatenate([jnp.full((E,), -1, jnp.int32), cand])
    slot_of = table.slot_of.at[idx].set(val, mode="drop")
    return slot_of, id_of_slot, last_use, miss_experts, miss_slots, evicted_ids, n_miss, n_hit


def forget_slots(table: SlotTable, slots: jax.Array) -> SlotTable:
    """Mark ``slots`` free: ``id_of_slot = -1``, ``last_use = -1``, ``slot_of[old id] = -1``, and
    clear the CRF history (``lfru``, ``lfu``) of the ids they held (``crf_log2 = -inf``, ``crf_time = -1``).

    Used when prefill borrows slots as streaming buffers (DESIGN.md 1.3): the borrowed slots
    must be invalidated first so no stale weights are ever served.

    Args:
      table: :class:`SlotTable`.
      slots: int32 ``[n]`` slot indices; entries ``-1`` (or any value outside ``0..S-1``) are
        ignored; duplicates are fine. May be traced.

    Returns:
      The updated table; ``clock`` unchanged.
    """
    S = table.num_slots
    LE = table.num_flat_ids
    slots = jnp.asarray(slots, jnp.int32).reshape(-1)
    ok = (slots >= 0) & (slots < S)
    idx = jnp.where(ok, slots, S)
    old = jnp.where(ok, table.id_of_slot[jnp.clip(slots, 0, S - 1)], -1)
    slot_of = table.slot_of.at[jnp.where(old >= 0, old, LE)].set(-1, mode="drop")
    id_of_slot = table.id_of_slot.at[idx].set(-1, mode="drop")
    last_use = table.last_use.at[idx].set(-1, mode="drop")
    old_idx = jnp.where(old >= 0, old, LE)
    crf_log2 = table.crf_log2.at[old_idx].set(-jnp.inf, mode="drop")
    crf_time = table.crf_time.at[old_idx].set(-1, mode="drop")
    return table.replace(slot_of=slot_of, id_of_slot=id_of_slot, last_use=last_use,
                         crf_log2=crf_log2, crf_time=crf_time)


def reset_table(table: SlotTable) -> SlotTable:
    """Free every slot (nothing resident), clear the LRFU history, keep ``clock``. Same shapes
    and dtypes."""
    return table.replace(
        slot_of=jnp.full_like(table.slot_of, -1),
        id_of_slot=jnp.full_like(table.id_of_slot, -1),
        last_use=jnp.full_like(table.last_use, -1),
        **_no_history(table.num_flat_ids),
    )


def lookup_layer_no_reuse(
    table: SlotTable, layer: jax.Array | int, routed: jax.Array, num_experts: int
) -> LayerLookup:
    """'on_demand' mode (no reuse between steps or layers): :func:`reset_table`, then
    :func:`lookup_layer`. Every routed expert misses; misses take slots ``0..n_miss-1`` in
    ascending expert id order. Same signature and outputs as :func:`lookup_layer`.
    """
    return lookup_layer(reset_table(table), layer, routed, num_experts)
