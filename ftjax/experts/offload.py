"""Where expert weights come from: the expert functions plugged into ``ftjax.model.forward``.

Three modes share one code path (FreeToken-style expert offload; DESIGN.md 1.1):

* ``resident``: the whole bank ([L*E, ...]) is on the device and *is* the pool; slot = flat id.
* ``cached``: a pool of S slots on the device and a global LRU :class:`SlotTable` shared by all
  layers, both carried through the layer scan. Misses are copied from the host banks
  (memory kind ``pinned_host``) with ``jax.device_put`` inside the jitted step.
* ``on_demand``: the same, but the table is emptied before every layer, so nothing is reused
  between steps or layers: every routed expert is fetched (the no-cache baseline).

The expert arithmetic is ``experts_from_pool`` in every mode; only slot numbers differ.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from ftjax.experts.compute import experts_from_pool
from ftjax.experts.slot_table import SlotTable, forget_slots, init_slot_table, lookup_layer, reset_table
from ftjax.model import LayerRouting

MODES = ("resident", "cached", "on_demand")


@flax.struct.dataclass
class ExpertState:
    """Device state carried through the layer scan.

    gate_up: [S, D, 2F] and down: [S, F, D] slot pools (compute dtype), table: the LRU table
    (``None`` in resident mode, where the pool is the bank itself).
    """

    gate_up: jax.Array
    down: jax.Array
    table: SlotTable | None


class LayerStats(NamedTuple):
    """Per-layer counters of one forward call (stacked over layers by the scan).

    hits, misses: int32 [] distinct routed experts found resident / copied from host.
    routed_ids: int32 [N, k] routed expert ids, -1 for padding tokens (for routing traces).
    """

    hits: jax.Array
    misses: jax.Array
    routed_ids: jax.Array


def routed_mask(ids: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """bool [E]: experts routed by at least one valid token. ids: int32 [N, k]; valid: bool [N]."""
    return jnp.zeros((num_experts,), jnp.bool_).at[ids].max(jnp.broadcast_to(valid[:, None], ids.shape))


def fetch_experts(host_gate_up: jax.Array, host_down: jax.Array, state: ExpertState,
                  flat_ids: jax.Array, slots: jax.Array, count: jax.Array) -> ExpertState:
    """Copies ``count`` experts from the host banks into pool slots (H2D over PCIe).

    host_gate_up: [L*E, D, 2F], host_down: [L*E, F, D] in host memory; flat_ids, slots: int32 [M],
    the first ``count`` entries valid. Each copy is a dynamic slice of the host bank followed
    immediately by ``jax.device_put`` to device memory (the pattern that lowers to a real DMA;
    DESIGN.md section 2), then written into its slot.
    """

    def one(i, pools):
        gu, dn = pools
        fid, slot = flat_ids[i], slots[i]
        w_gu = jax.device_put(jax.lax.dynamic_index_in_dim(host_gate_up, fid, keepdims=False),
                              jax.memory.Space.Device)
        w_dn = jax.device_put(jax.lax.dynamic_index_in_dim(host_down, fid, keepdims=False),
                              jax.memory.Space.Device)
        gu = jax.lax.dynamic_update_index_in_dim(gu, w_gu.astype(gu.dtype), slot, 0)
        dn = jax.lax.dynamic_update_index_in_dim(dn, w_dn.astype(dn.dtype), slot, 0)
        return gu, dn

    gu, dn = jax.lax.fori_loop(0, count, one, (state.gate_up, state.down))
    return state.replace(gate_up=gu, down=dn)


def make_expert_fn(mode: str, num_experts: int, host_gate_up: jax.Array | None = None,
                   host_down: jax.Array | None = None, policy: str = "lru"):
    """Builds the expert function for ``ftjax.model.forward``.

    Call it inside the jitted step, with the host banks being arguments of that jit (memory kind
    ``pinned_host``), so the copies are part of the compiled program. ``policy``: the slot cache's
    eviction policy (``ftjax.experts.slot_table.POLICIES``).

    Raises:
      ValueError: unknown mode, or host banks missing for an offloading mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown experts mode {mode!r}; expected one of {MODES}")
    if mode != "resident" and (host_gate_up is None or host_down is None):
        raise ValueError(f"experts mode {mode!r} needs the host expert banks")
    e = num_experts

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        routed = routed_mask(r.ids, r.valid, e)
        trace_ids = jnp.where(r.valid[:, None], r.ids, -1)
        if mode == "resident":
            slot_of_expert = layer * e + jnp.arange(e, dtype=jnp.int32)
            stats = LayerStats(jnp.sum(routed, dtype=jnp.int32), jnp.int32(0), trace_ids)
        else:
            table = reset_table(state.table) if mode == "on_demand" else state.table
            look = lookup_layer(table, layer, routed, e, policy)
            state = state.replace(table=look.table)
            state = fetch_experts(host_gate_up, host_down, state, layer * e + look.miss_experts,
                                  look.miss_slots, look.n_miss)
            slot_of_expert = look.slot_of_expert
            stats = LayerStats(look.n_hit, look.n_miss, trace_ids)
        y = experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, state.gate_up, state.down)
        return y, state, stats

    return expert_fn


def _fetch_layer(host_gate_up, host_down, state: ExpertState, layer, buffer, num_experts: int) -> ExpertState:
    """Copies all E experts of ``layer`` (one contiguous slice of each host bank) into the
    prefill buffer ``buffer`` (slots [buffer*E, (buffer+1)*E))."""
    e = num_experts
    gu = jax.device_put(jax.lax.dynamic_slice_in_dim(host_gate_up, layer * e, e), jax.memory.Space.Device)
    dn = jax.device_put(jax.lax.dynamic_slice_in_dim(host_down, layer * e, e), jax.memory.Space.Device)
    return state.replace(
        gate_up=jax.lax.dynamic_update_slice_in_dim(state.gate_up, gu.astype(state.gate_up.dtype), buffer * e, 0),
        down=jax.lax.dynamic_update_slice_in_dim(state.down, dn.astype(state.down.dtype), buffer * e, 0))


def stream_prologue(host_gate_up, host_down, state: ExpertState, num_experts: int, overlap: bool) -> ExpertState:
    """Prepares full-layer streaming: the LRU table forgets the 2E borrowed slots [0, 2E), and
    (with overlap) layer 0's experts are copied into buffer 0 before the layer scan starts."""
    table = forget_slots(state.table, jnp.arange(2 * num_experts, dtype=jnp.int32))
    state = state.replace(table=table)
    if overlap:
        state = _fetch_layer(host_gate_up, host_down, state, 0, 0, num_experts)
    return state


def make_stream_expert_fn(num_experts: int, num_layers: int, host_gate_up: jax.Array, host_down: jax.Array,
                          overlap: bool = True):
    """Expert function for long prefills: whole layers streamed through two buffers of E slots
    borrowed from the pool (FreeToken's full-layer double buffering; DESIGN.md 1.3).

    With ``overlap``, layer l computes from buffer l % 2 while layer l+1's experts are copied
    into the other buffer (issued before layer l's expert compute; the copy of the last layer is
    clamped to L-1, one wasted layer copy per call). Without it (the ablation), each layer copies
    its own experts and then computes, strictly in series. Needs ``stream_prologue`` first.
    Stats count every copied expert as a miss (hits 0).
    """
    e, n_layers = num_experts, num_layers

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        buf = layer % 2
        if overlap:
            slot_of_expert = buf * e + jnp.arange(e, dtype=jnp.int32)
            # Compute reads the pool as it is now (buffer l % 2 holds layer l); the prefetch
            # writes buffer (l+1) % 2, so the two are independent and the copy can run early.
            y = experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, state.gate_up, state.down)
            state = _fetch_layer(host_gate_up, host_down, state, jnp.minimum(layer + 1, n_layers - 1), 1 - buf, e)
        else:
            state = _fetch_layer(host_gate_up, host_down, state, layer, buf, e)
            slot_of_expert = buf * e + jnp.arange(e, dtype=jnp.int32)
            y = experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, state.gate_up, state.down)
        stats = LayerStats(jnp.int32(0), jnp.int32(e), jnp.where(r.valid[:, None], r.ids, -1))
        return y, state, stats

    return expert_fn


def init_expert_state(mode: str, num_layers: int, num_experts: int, num_slots: int,
                      host_gate_up: jax.Array, host_down: jax.Array, dtype) -> ExpertState:
    """Allocates the device side of a mode.

    resident: copies the whole banks to the device (L*E slots). cached / on_demand: zero pools of
    ``num_slots`` slots and an empty table.

    Raises:
      ValueError: num_slots outside [E, L*E] for the offloading modes (from init_slot_table).
    """
    if mode == "resident":
        dev = jax.memory.Space.Device
        return ExpertState(jax.device_put(host_gate_up, dev).astype(dtype),
                           jax.device_put(host_down, dev).astype(dtype), None)
    table = init_slot_table(num_layers, num_experts, num_slots)
    gu = jnp.zeros((num_slots,) + host_gate_up.shape[1:], dtype)
    dn = jnp.zeros((num_slots,) + host_down.shape[1:], dtype)
    return ExpertState(gu, dn, table)
