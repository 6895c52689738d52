"""Host-to-device copies of expert weights inside the jitted step (FreeToken; DESIGN.md 1.1, 1.3).

Every copy is a slice of a host bank followed immediately by ``jax.device_put`` to device
memory, the one operation applied to host data (DESIGN.md section 2: other math on host
operands turns into slow host compute).
"""

from __future__ import annotations

import jax

from ftjax.experts.state import ExpertBanks, ExpertState


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def fetch_experts(banks: ExpertBanks, state: ExpertState, flat_ids: jax.Array, slots: jax.Array,
                  count: jax.Array) -> ExpertState:
    """Copies ``count`` experts from the host banks into pool slots (H2D over PCIe).

    flat_ids, slots: int32 [M], the first ``count`` entries valid; count: int32 []. Each copy is
    a dynamic index of the host bank, moved to the device and written into its slot.
    """

    def one(i, pools):
        gu, dn = pools
        fid, slot = flat_ids[i], slots[i]
        w_gu = _to_device(jax.lax.dynamic_index_in_dim(banks.gate_up, fid, keepdims=False))
        w_dn = _to_device(jax.lax.dynamic_index_in_dim(banks.down, fid, keepdims=False))
        gu = jax.lax.dynamic_update_index_in_dim(gu, w_gu.astype(gu.dtype), slot, 0)
        dn = jax.lax.dynamic_update_index_in_dim(dn, w_dn.astype(dn.dtype), slot, 0)
        return gu, dn

    with jax.named_scope("expert_fetch"):
        gu, dn = jax.lax.fori_loop(0, count, one, (state.gate_up, state.down))
    return state.replace(gate_up=gu, down=dn)


def fetch_layer(banks: ExpertBanks, state: ExpertState, layer: jax.Array, buffer: jax.Array | int,
                num_experts: int) -> ExpertState:
    """Copies all E experts of ``layer`` (one contiguous slice of each host bank) into the
    streaming buffer ``buffer`` (pool slots [buffer*E, (buffer+1)*E))."""
    e = num_experts
    with jax.named_scope("stream_prefetch"):
        gu = _to_device(jax.lax.dynamic_slice_in_dim(banks.gate_up, layer * e, e))
        dn = _to_device(jax.lax.dynamic_slice_in_dim(banks.down, layer * e, e))
        return state.replace(
            gate_up=jax.lax.dynamic_update_slice_in_dim(state.gate_up, gu.astype(state.gate_up.dtype), buffer * e, 0),
            down=jax.lax.dynamic_update_slice_in_dim(state.down, dn.astype(state.down.dtype), buffer * e, 0))
