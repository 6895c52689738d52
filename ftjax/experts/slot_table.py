"""Global LRU expert slot table (decode-time expert cache), as pure jittable JAX.

Source of the idea: FreeToken-style *global* LRU expert cache, see
``docs/DESIGN.md`` section 1.1. One pool of ``S`` slots (per weight kind) is shared
by all layers; a slot holds one (layer, expert), addressed by its flat id
``flat_id = layer * E + expert``. The table is a small pytree of int32 arrays that is carried
through the ``jax.lax.scan`` over layers, so every function here:

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
3. ``clock`` advances by one (once per call, even when nothing was routed), so recency is
   global across layers.

``S >= E`` is required (all ``E`` experts of a layer may be routed at once) and is enough:
the candidates exclude only the ``n_hit`` hit slots, leaving ``S - n_hit >= n_miss`` slots.
``S <= L * E`` is also required (more slots than experts is a configuration error; use
:func:`init_resident_table` for the fully resident case).

The clock is int32: it wraps after 2**31 - 1 (step, layer) calls (e.g. ~44.7M decode steps of a
48-layer model), far beyond one serving session.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

__all__ = [
    "SlotTable",
    "LayerLookup",
    "init_slot_table",
    "init_resident_table",
    "lookup_layer",
    "lookup_layer_no_reuse",
    "forget_slots",
    "reset_table",
]

_INT32_MAX = jnp.iinfo(jnp.int32).max


@flax.struct.dataclass
class SlotTable:
    """State of the global LRU expert slot cache (DESIGN.md 1.1). All fields int32.

    Attributes:
      slot_of: int32 ``[L*E]``. Slot holding flat expert id ``layer*E + expert``; ``-1`` if
        that expert is not resident.
      id_of_slot: int32 ``[S]``. Flat id held by each slot; ``-1`` if the slot is free.
        ``slot_of`` and ``id_of_slot`` are mutually inverse on resident ids / used slots.
      last_use: int32 ``[S]``. Clock value of the slot's last use; ``-1`` for a free slot or a
        slot never used since it was filled by :func:`init_resident_table`.
      clock: int32 ``[]``. Advances by one per :func:`lookup_layer` call, i.e. once per
        (step, layer).

    The shapes are static: ``L*E`` and ``S`` come from ``slot_of.shape`` and
    ``id_of_slot.shape``. ``E`` is not stored and is passed to :func:`lookup_layer`.
    """

    slot_of: jax.Array
    id_of_slot: jax.Array
    last_use: jax.Array
    clock: jax.Array

    @property
    def num_slots(self) -> int:
        """Static number of slots ``S``."""
        return self.id_of_slot.shape[0]

    @property
    def num_flat_ids(self) -> int:
        """Static number of flat expert ids ``L*E``."""
        return self.slot_of.shape[0]


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


def init_slot_table(num_layers: int, num_experts: int, num_slots: int) -> SlotTable:
    """Empty table: every slot free, no expert resident, ``clock = 0``.

    Args:
      num_layers: ``L`` (static Python int).
      num_experts: ``E``, routed experts per layer (static Python int).
      num_slots: ``S``, slots in the pool (static Python int), ``E <= S <= L*E``.

    Returns:
      SlotTable with ``slot_of`` int32 ``[L*E]`` all -1, ``id_of_slot`` and ``last_use``
      int32 ``[S]`` all -1, ``clock`` int32 ``[]`` = 0.

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
    )


def init_resident_table(num_layers: int, num_experts: int) -> SlotTable:
    """Fully resident table ('resident' mode): ``S = L*E`` and slot ``i`` holds flat id ``i``.

    ``slot_of`` and ``id_of_slot`` are both ``arange(L*E)`` (int32), ``last_use`` is all -1
    (never used), ``clock = 0``. :func:`lookup_layer` on it never misses, and
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
    )


POLICIES = ("lru", "lookahead")


def eviction_order(table: SlotTable, layer: jax.Array, protected: jax.Array, num_experts: int,
                   policy: str = "lru") -> jax.Array:
    """int32 [S]: slots in the order they are given to misses (free slots first, protected last).

    ``lru``: least recently used first (FreeToken's global LRU; DESIGN.md 1.1).
    ``lookahead``: the slot whose layer comes up *last* in the layer cycle first, LRU within a
    layer. Decode visits layers 0..L-1 every step, so a slot of layer j is next needed after
    (j - layer) mod L layers (a full cycle, L, for the current layer's unrouted experts); evicting
    the farthest is Belady's choice for that cyclic order. It matters when S is smaller than one
    step's working set (L x distinct experts per layer): there plain LRU always evicts exactly
    the experts the next layers need and its hit rate collapses to zero.
    Ties break by lowest slot index (stable sorts).
    """
    if policy == "lru":
        key = jnp.where(protected, _INT32_MAX, table.last_use)
        return jnp.argsort(key, stable=True).astype(jnp.int32)
    if policy != "lookahead":
        raise ValueError(f"unknown cache policy {policy!r}; expected one of {POLICIES}")
    num_layers = table.num_flat_ids // num_experts
    owner = table.id_of_slot // num_experts
    distance = jnp.mod(owner - layer, num_layers)
    distance = jnp.where(distance == 0, num_layers, distance)
    free = table.id_of_slot < 0
    primary = jnp.where(free, -(num_layers + 1), jnp.where(protected, num_layers + 1, -distance))
    by_recency = jnp.argsort(table.last_use, stable=True)
    return by_recency[jnp.argsort(primary[by_recency], stable=True)].astype(jnp.int32)


def lookup_layer(
    table: SlotTable, layer: jax.Array | int, routed: jax.Array, num_experts: int, policy: str = "lru"
) -> LayerLookup:
    """Look up (and fill) the slots of one layer's routed experts; advance the clock.

    Args:
      table: current :class:`SlotTable` (``S = table.num_slots``, ``S >= num_experts``).
      layer: int32 scalar, may be traced (e.g. the ``lax.scan`` index), ``0 <= layer < L``.
      routed: bool ``[E]`` (any integer/bool dtype accepted, nonzero = routed). True for each
        expert of this layer routed by any token of the current step (already deduplicated).
      num_experts: ``E`` (static Python int).
      policy: which non-hit slots misses take, ``"lru"`` or ``"lookahead"`` (:func:`eviction_order`).

    Returns:
      :class:`LayerLookup`. See the module docstring for the exact policy (hits refresh,
      misses in ascending expert id take the LRU non-hit slots, ties to the lowest slot index,
      ``clock += 1``).

    Fixed shapes, no Python branches on values: safe under ``jax.jit`` and ``lax.scan``.
    """
    E = int(num_experts)
    S = table.num_slots
    LE = table.num_flat_ids
    if S < E:
        raise ValueError(f"num_slots={S} < num_experts={E}: the table cannot serve a layer")
    if LE % E != 0:
        raise ValueError(f"table has {LE} flat ids, not a multiple of num_experts={E}")
    routed = jnp.asarray(routed)
    if routed.shape != (E,):
        raise ValueError(f"routed must have shape ({E},), got {routed.shape}")
    routed = routed.astype(jnp.bool_)
    layer = jnp.asarray(layer, jnp.int32)
    clock = table.clock

    experts = jnp.arange(E, dtype=jnp.int32)
    base = layer * E
    cur_slot = jax.lax.dynamic_slice(table.slot_of, (base,), (E,))  # [E]
    resident = cur_slot >= 0
    hit = routed & resident
    miss = routed & ~resident
    n_hit = hit.sum(dtype=jnp.int32)
    n_miss = miss.sum(dtype=jnp.int32)

    # Slots holding a hit of this step are protected from eviction.
    hit_slot_idx = jnp.where(hit, cur_slot, S)                      # S = dropped
    protected = jnp.zeros((S,), jnp.bool_).at[hit_slot_idx].set(True, mode="drop")

    order = eviction_order(table, layer, protected, E, policy)
    cand = order[:E]                                                # [E], S >= E

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

    new_table = SlotTable(
        slot_of=slot_of, id_of_slot=id_of_slot, last_use=last_use, clock=clock + 1
    )
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


def forget_slots(table: SlotTable, slots: jax.Array) -> SlotTable:
    """Mark ``slots`` free: ``id_of_slot = -1``, ``last_use = -1``, ``slot_of[old id] = -1``.

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
    return table.replace(slot_of=slot_of, id_of_slot=id_of_slot, last_use=last_use)


def reset_table(table: SlotTable) -> SlotTable:
    """Free every slot (nothing resident), keep ``clock``. Same shapes and dtypes."""
    return table.replace(
        slot_of=jnp.full_like(table.slot_of, -1),
        id_of_slot=jnp.full_like(table.id_of_slot, -1),
        last_use=jnp.full_like(table.last_use, -1),
    )


def lookup_layer_no_reuse(
    table: SlotTable, layer: jax.Array | int, routed: jax.Array, num_experts: int
) -> LayerLookup:
    """'on_demand' mode (no reuse between steps or layers): :func:`reset_table`, then
    :func:`lookup_layer`. Every routed expert misses; misses take slots ``0..n_miss-1`` in
    ascending expert id order. Same signature and outputs as :func:`lookup_layer`.
    """
    return lookup_layer(reset_table(table), layer, routed, num_experts)
