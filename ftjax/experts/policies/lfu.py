"""``lfu``: least frequently used, counts kept over the whole decode (a "perfect" LFU).

LRFU with lambda = 0 (Lee et al. 2001, IEEE Trans. Computers 50(12)): CRF is then the reference count,
kept as ``log2 count`` in the table's ``crf_log2`` by ``lfru.py``'s update, so an evicted expert keeps
its count and ``slot_table.forget_slots`` / ``reset_table`` clear it. float32 ``log2 count`` tells
counts apart up to about 3e5 references of one expert and stops growing near 7e5 (ties then go to
the least recently used).
"""

from __future__ import annotations

import dataclasses

from ftjax.experts.policies.base import CachePolicy
from ftjax.experts.policies.lfru import crf_order_keys, crf_reference


@dataclasses.dataclass(frozen=True)
class LFU(CachePolicy):
    """Evict the expert referenced least often; ties to the least recently used, then the lowest
    flat id. No parameters."""

    description = "evict the least frequently used expert (counts over the whole decode; ties to LRU)"

    def order_keys(self, table, layer, protected, num_experts):
        del layer, num_experts
        return crf_order_keys(table, protected, 0.0)

    def on_reference(self, table, layer, routed, num_experts):
        return crf_reference(table, layer, routed, num_experts, 0.0)
