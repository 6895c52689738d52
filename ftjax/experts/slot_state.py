"""The state of the global expert slot table (DESIGN.md 1.1), apart from the functions that use it, so that
the slot table (``ftjax.experts.slot_table``) and its eviction policies (``ftjax.experts.policies``) both
build on it without importing each other."""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class SlotTable:
    """State of the global expert slot cache (DESIGN.md 1.1). All fields int32 but ``crf_log2``.

    Attributes:
      slot_of: int32 ``[L*E]``. Slot holding flat expert id ``layer*E + expert``; ``-1`` if
        that expert is not resident.
      id_of_slot: int32 ``[S]``. Flat id held by each slot; ``-1`` if the slot is free.
        ``slot_of`` and ``id_of_slot`` are mutually inverse on resident ids / used slots.
      last_use: int32 ``[S]``. Clock value of the slot's last use; ``-1`` for a free slot or a
        slot never used since it was filled by :func:`init_resident_table`.
      clock: int32 ``[]``. Advances by one per :func:`lookup_layer` call, i.e. once per
        (step, layer).
      crf_log2: float32 ``[L*E]``. ``lfru`` / ``lfu`` only: log2 of each flat id's CRF at its last
        reference; ``-inf`` if never referenced (or cleared). Untouched by the other policies.
      crf_time: int32 ``[L*E]``. ``lfru`` / ``lfu`` only: clock of each flat id's last reference;
        ``-1`` if never referenced (or cleared).

    The shapes are static: ``L*E`` and ``S`` come from ``slot_of.shape`` and
    ``id_of_slot.shape``. ``E`` is not stored and is passed to :func:`lookup_layer`.
    """

    slot_of: jax.Array
    id_of_slot: jax.Array
    last_use: jax.Array
    clock: jax.Array
    crf_log2: jax.Array
    crf_time: jax.Array

    @property
    def num_slots(self) -> int:
        """Static number of slots ``S``."""
        return self.id_of_slot.shape[0]

    @property
    def num_flat_ids(self) -> int:
        """Static number of flat expert ids ``L*E``."""
        return self.slot_of.shape[0]
