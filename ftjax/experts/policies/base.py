"""The interface of an expert slot table eviction policy (:class:`CachePolicy`) and key helpers.

A policy decides which slots the misses of a lookup take, as the lexicographic order of a few sort
keys over the ``S`` slots (ties broken by slot index), and may keep per-expert history in the table
(updated on every reference). ``ftjax.experts.slot_table.lookup_layer`` does the rest (hits, fills,
evictions, the clock) the same way for every policy, in each of its ``ORDER_IMPLS``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ftjax.experts.slot_state import SlotTable

INT32_MAX = int(jnp.iinfo(jnp.int32).max)

#: Values of :func:`slot_groups`, in eviction order.
FREE, EVICTABLE, PROTECTED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """Base of an eviction policy. Subclasses are frozen dataclasses whose fields are the policy's
    parameters (static: an instance is hashable, so it can be a static argument of ``jax.jit``).

    A subclass sets :attr:`description` and implements :meth:`order_keys`; it overrides
    :meth:`on_reference` if it keeps history. Its registered name is its module's name
    (``ftjax/experts/policies/lru.py`` -> ``"lru"``).
    """

    description: ClassVar[str] = ""
    """One line for ``--help`` texts: what the policy evicts first."""

    @property
    def name(self) -> str:
        """The registered name: the last component of the defining module's name."""
        return type(self).__module__.rsplit(".", 1)[-1]

    @classmethod
    def param_names(cls) -> tuple[str, ...]:
        """Names of the policy's parameters (its dataclass fields), in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def params(self) -> dict:
        """The parameters of this instance, ``{name: value}``."""
        return {n: getattr(self, n) for n in self.param_names()}

    def order_keys(self, table: SlotTable, layer: jax.Array, protected: jax.Array,
                   num_experts: int) -> tuple[jax.Array, ...]:
        """Sort keys of the eviction order: misses take the slots in the order lexicographic on the
        keys, then on slot index (ascending; floats in ``lax.sort``'s order: -0 == 0, NaN last).

        Args:
          table: the ``SlotTable`` before the lookup (``S`` slots, ``L*E`` flat ids, ``clock``).
          layer: int32 scalar (may be traced): the layer being looked up.
          protected: bool ``[S]``: slots holding a hit of this lookup; they must sort after every
            other slot (they are never taken, as ``S - n_hit >= n_miss``).
          num_experts: ``E`` (static).

        Returns:
          One or more int32 or float32 arrays ``[S]``. Free slots (``id_of_slot == -1``) must come first
          (tests/test_slot_table.py checks it for every registered policy; :func:`slot_groups` is a first
          key that does it). One int32 key lets ``ORDER_IMPLS`` "top_k" use ``lax.top_k``; more keys cost
          more. Pure and jittable: no Python branch on traced values.
        """
        raise NotImplementedError(f"{type(self).__name__}.order_keys")

    def on_reference(self, table: SlotTable, layer: jax.Array, routed: jax.Array, num_experts: int) -> SlotTable:
        """The table after this lookup references ``routed`` (bool ``[E]``: hits and fills of ``layer``).

        Called with the slots already updated and ``table.clock`` still the clock of this lookup (it
        advances after). Default: no history, the table unchanged. Pure and jittable.
        """
        del layer, routed, num_experts
        return table


def slot_groups(table: SlotTable, protected: jax.Array) -> jax.Array:
    """int32 ``[S]``: :data:`FREE` (0) for a free slot, :data:`PROTECTED` (2) for a protected one,
    else :data:`EVICTABLE` (1): a first key that puts free slots first and protected ones last."""
    free = table.id_of_slot < 0
    return jnp.where(free, FREE, jnp.where(protected, PROTECTED, EVICTABLE)).astype(jnp.int32)
