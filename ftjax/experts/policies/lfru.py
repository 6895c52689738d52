"""``lfru``: LRFU, least recently / frequently used (Lee et al. 2001, IEEE Trans. Computers 50(12)).

Every flat id has a combined recency-frequency value CRF(t) = sum over its past references t_i of
2^(-lambda (t - t_i)), with lambda = 1 / (half_life_tokens * L) per clock tick (one (step, layer)
lookup), so a reference counts half after ``half_life_tokens`` decode steps. lambda -> 0 gives LFU
(``lfu.py``), a large lambda LRU. The table keeps, per flat id, ``log2 CRF`` at its last reference
(``crf_log2``, float32 ``[L*E]``) and that reference's clock (``crf_time``, int32 ``[L*E]``); the
value now is ``crf_log2 - lambda * (clock - crf_time)``, so nothing grows with the clock (no overflow
over long decodes). A reference (hit or fill) sets ``crf_log2 = log2(1 + 2^(value now))``,
``crf_time = clock``. An evicted id keeps its history (a re-fetched expert resumes its CRF);
``slot_table.forget_slots`` and ``reset_table`` clear it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ftjax.experts.policies.base import CachePolicy, slot_groups

LFRU_HALF_LIFE_TOKENS = 4.0
"""Default LRFU half-life, in decode steps (tokens), as in experiments/policy_study.py (whose
results, experiments/results/policy/policy_study.json, were measured with it)."""


def lfru_lambda(num_layers: int, half_life_tokens: float = LFRU_HALF_LIFE_TOKENS) -> float:
    """LRFU decay per clock tick (one (step, layer) lookup): ``1 / (half_life_tokens * L)``.

    ``half_life_tokens = inf`` gives 0 (no decay: LFU). Raises ValueError unless ``half_life_tokens > 0``.
    """
    if not half_life_tokens > 0:
        raise ValueError(f"half_life_tokens must be > 0, got {half_life_tokens}")
    return 1.0 / (float(half_life_tokens) * num_layers)


def crf_now(table, flat_ids: jax.Array, lam: float) -> jax.Array:
    """float32, shape of ``flat_ids`` (valid ids): log2 CRF at the table's clock (``-inf``: no history)."""
    age = (table.clock - table.crf_time[flat_ids]).astype(jnp.float32)
    return table.crf_log2[flat_ids] - jnp.float32(lam) * age


def crf_order_keys(table, protected: jax.Array, lam: float) -> tuple[jax.Array, ...]:
    """Keys ``[S]`` of the smallest-CRF-first order with decay ``lam`` per tick: free slots, then the
    evictable ones by (log2 CRF now, float32; ``last_use``; flat id), then the protected ones."""
    ids = table.id_of_slot
    value = jnp.where((ids < 0) | protected, 0.0, crf_now(table, jnp.maximum(ids, 0), lam))
    return slot_groups(table, protected), value, table.last_use, ids


def crf_reference(table, layer: jax.Array, routed: jax.Array, num_experts: int, lam: float):
    """The table after every routed flat id of ``layer`` is referenced at ``table.clock``:
    ``CRF = 1 + decayed CRF`` (``crf_log2``, ``crf_time`` updated; nothing else)."""
    base = layer * num_experts
    lam = jnp.float32(lam)
    old_log2 = jax.lax.dynamic_slice(table.crf_log2, (base,), (num_experts,))
    old_time = jax.lax.dynamic_slice(table.crf_time, (base,), (num_experts,))
    ref = jnp.logaddexp2(old_log2 - lam * (table.clock - old_time).astype(jnp.float32), jnp.float32(0.0))
    return table.replace(
        crf_log2=jax.lax.dynamic_update_slice(table.crf_log2, jnp.where(routed, ref, old_log2), (base,)),
        crf_time=jax.lax.dynamic_update_slice(table.crf_time, jnp.where(routed, table.clock, old_time), (base,)))


@dataclasses.dataclass(frozen=True)
class LFRU(CachePolicy):
    """Evict the smallest CRF now; ties to the least recently used, then the lowest flat id.

    Parameter ``half_life_tokens`` (float, decode steps, > 0; default :data:`LFRU_HALF_LIFE_TOKENS`):
    small is LRU-like, large LFU-like. Raises ValueError unless > 0.
    """

    half_life_tokens: float = LFRU_HALF_LIFE_TOKENS
    description = ("LRFU: evict the smallest recency-frequency value (uses decay with a half-life, "
                   f"default {LFRU_HALF_LIFE_TOKENS:g} tokens)")

    def __post_init__(self):
        lfru_lambda(1, self.half_life_tokens)  # validates

    def _lam(self, table, num_experts: int) -> float:
        return lfru_lambda(table.num_flat_ids // num_experts, self.half_life_tokens)

    def order_keys(self, table, layer, protected, num_experts):
        del layer
        return crf_order_keys(table, protected, self._lam(table, num_experts))

    def on_reference(self, table, layer, routed, num_experts):
        return crf_reference(table, layer, routed, num_experts, self._lam(table, num_experts))
