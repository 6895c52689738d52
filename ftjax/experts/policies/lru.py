"""``lru``: global least recently used (FreeToken's expert cache; DESIGN.md 1.1)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ftjax.experts.policies.base import INT32_MAX, CachePolicy


@dataclasses.dataclass(frozen=True)
class LRU(CachePolicy):
    """Evict the slot used least recently, across all layers (one pool shared by every layer).

    One int32 key ``[S]``: ``last_use`` (-1 for a free slot, so free slots come first), INT32_MAX for a
    protected slot. No history beyond ``last_use``; no parameters.
    """

    description = "evict the least recently used expert of any layer (global LRU, FreeToken)"

    def order_keys(self, table, layer, protected, num_experts):
        del layer, num_experts
        return (jnp.where(protected, INT32_MAX, table.last_use),)
