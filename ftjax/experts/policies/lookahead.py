"""``lookahead``: Belady's choice for the cyclic layer order of decode, LRU within a layer."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ftjax.experts.policies.base import CachePolicy


@dataclasses.dataclass(frozen=True)
class Lookahead(CachePolicy):
    """Evict the slot whose layer comes up *last* in the layer cycle, the least recently used first
    within a layer.

    Decode visits layers 0..L-1 every step, so a slot of layer j is next needed after
    ``(j - layer) mod L`` lookups (a full cycle, L, for the current layer's unrouted experts); evicting
    the farthest is Belady's MIN (Belady 1966) for that cyclic order. It matters when S is smaller
    than one step's working set (L x distinct experts per layer): there plain LRU always evicts exactly
    the experts the next layers need and its hit rate collapses to zero.

    Keys, int32 ``[S]`` each: ``-(L + 1)`` for a free slot, ``L + 1`` for a protected one, else
    ``-distance`` in ``[-L, -1]``; then ``last_use``. No history; no parameters.
    """

    description = ("evict the layer that comes up last in the layer cycle, LRU within it "
                   "(avoids LRU's collapse when one step's experts do not fit)")

    def order_keys(self, table, layer, protected, num_experts):
        num_layers = table.num_flat_ids // num_experts
        ids = table.id_of_slot
        distance = jnp.mod(ids // num_experts - layer, num_layers)
        distance = jnp.where(distance == 0, num_layers, distance)
        primary = jnp.where(ids < 0, -(num_layers + 1), jnp.where(protected, num_layers + 1, -distance))
        return primary, table.last_use
