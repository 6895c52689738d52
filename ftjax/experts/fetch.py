"""Host-to-device copies of expert weights inside the jitted step (FreeToken; DESIGN.md 1.1, 1.3).

Every copy is a slice of a host bank followed immediately by ``jax.device_put`` to device
memory, the one operation applied to host data (DESIGN.md section 2: other math on host
operands turns into slow host compute). A quantized format's scales travel with their weights
(the pools store what the banks store; ``ftjax.experts.quant``).
"""

from __future__ import annotations

import jax

from ftjax.experts.state import ExpertBanks, ExpertState


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def _bank_arrays(banks: ExpertBanks) -> tuple:
    """(gate_up, down, *scales) of the banks."""
    return (banks.gate_up, banks.down) + tuple(banks.scales or ())


def _pool_arrays(state: ExpertState) -> tuple:
    return (state.gate_up, state.down) + tuple(state.scales or ())


def _with_pools(state: ExpertState, pools: tuple) -> ExpertState:
    gu, dn, *scales = pools
    return state.replace(gate_up=gu, down=dn, scales=tuple(scales) if scales else None)


def _split(bank: jax.Array, pool: jax.Array) -> bool:
    """Whether ``bank`` is a device's [L, El, ...] share (one axis more than its [S, ...] pool)."""
    return bank.ndim == pool.ndim + 1


def _bank_rows(bank: jax.Array, pool: jax.Array, first: jax.Array, count: int) -> jax.Array:
    """Rows [first, first + count) of a host bank by flat id, on the device: [count, ...] (count <= El for a split
    bank, whose rows must not cross a layer)."""
    if not _split(bank, pool):
        return _to_device(jax.lax.dynamic_slice_in_dim(bank, first, count))
    el = bank.shape[1]
    start = (first // el, first % el) + (0,) * (bank.ndim - 2)
    return _to_device(jax.lax.dynamic_slice(bank, start, (1, count) + bank.shape[2:])).reshape(
        (count,) + bank.shape[2:])


def _bank_row(bank: jax.Array, pool: jax.Array, fid: jax.Array) -> jax.Array:
    """Row ``fid`` (flat id) of a host bank, on the device: [...]."""
    if not _split(bank, pool):
        return _to_device(jax.lax.dynamic_index_in_dim(bank, fid, keepdims=False))
    return _bank_rows(bank, pool, fid, 1)[0]


def fetch_experts(banks: ExpertBanks, state: ExpertState, flat_ids: jax.Array, slots: jax.Array,
                  count: jax.Array) -> ExpertState:
    """Copies ``count`` experts (weights and scales) from the host banks into pool slots (H2D).

    flat_ids, slots: int32 [M], the first ``count`` entries valid; count: int32 []. Each copy is
    a dynamic index of the host bank, moved to the device and written into its slot.
    """
    src = _bank_arrays(banks)

    def one(i, pools):
        fid, slot = flat_ids[i], slots[i]
        return tuple(jax.lax.dynamic_update_index_in_dim(
            p, _bank_row(b, p, fid).astype(p.dtype), slot, 0)
            for b, p in zip(src, pools))

    with jax.named_scope("expert_fetch"):
        pools = jax.lax.fori_loop(0, count, one, _pool_arrays(state))
    return _with_pools(state, pools)


def fetch_layer(banks: ExpertBanks, state: ExpertState, layer: jax.Array, buffer: jax.Array | int,
                num_experts: int) -> ExpertState:
    """Copies all E experts of ``layer`` (one contiguous slice of each host bank, scales too) into
    the streaming buffer ``buffer`` (pool slots [buffer*E, (buffer+1)*E))."""
    e = num_experts
    with jax.named_scope("stream_prefetch"):
        pools = tuple(jax.lax.dynamic_update_slice_in_dim(
            p, _bank_rows(b, p, layer * e, e).astype(p.dtype), buffer * e, 0)
            for b, p in zip(_bank_arrays(banks), _pool_arrays(state)))
        return _with_pools(state, pools)
