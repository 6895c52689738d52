"""Expert parallelism over the devices of one host: each device holds its own share of every layer's
experts and computes their contributions; the outputs are summed across devices (docs/MULTI_GPU.md).

Layout (``N`` devices in a one-axis ``jax.sharding.Mesh`` named :data:`EXPERT_AXIS`; E divisible by N;
``El = E / N``): expert ``e`` of every layer is owned by device ``e // El`` (contiguous blocks). A block
is one contiguous slice of a layer's host bank rows ``[l*E + d*El, l*E + (d+1)*El)``, so the share of a
layer that a device streams over its own link is one copy, not El strided ones. The resident pool is the
bank viewed as [L, E, ...] and sharded on its expert axis (``P(None, "expert")``): device d holds
[L, El, ...], read inside ``shard_map`` as a local pool of L*El slots (local slot ``l * El + j`` for
expert ``d*El + j`` of layer l).

At batch 1 (and in this first version at every batch) the tokens are replicated: every device sees the
layer's whole routing (x [N, D], ids, weights), keeps the (token, expert) pairs of its own experts (the
others get weight 0 and a valid local expert id, so no out-of-range read happens) and the per-device
outputs are summed with ``psum``. The sum is of the same terms as one device's, in another order: logits
agree to float32 rounding, not bit for bit.

Everything else (non-expert weights, KV cache, routing, stats) is replicated; the step is one SPMD
program over the mesh (``jax.jit`` of the same ``forward_step``), so no hand-made transport is involved.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ftjax import memory
from ftjax.config import check_slots
from ftjax.experts import offload
from ftjax.experts.compute import experts_from_pool
from ftjax.experts.fetch import fetch_experts
from ftjax.experts.slot_table import init_slot_table, lookup_layer, reset_table
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.seams import LayerRouting, LayerStats

#: The mesh axis the experts are split over.
EXPERT_AXIS = "expert"


@functools.cache
def expert_mesh(devices: int) -> Mesh:
    """The one-axis mesh (:data:`EXPERT_AXIS`) over the first ``devices`` devices of this host.
    Raises:
      ValueError: more devices than present."""
    present = jax.devices()
    if devices > len(present):
        raise ValueError(f"devices={devices} exceeds the {len(present)} device(s) present")
    return Mesh(np.array(present[:devices]), (EXPERT_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (non-expert weights, KV cache, tokens)."""
    return NamedSharding(mesh, P())


def expert_sharding(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """An [L, E, ...] array split on its expert axis (axis 1) over the mesh."""
    return NamedSharding(mesh, P(None, EXPERT_AXIS), memory_kind=memory_kind)


def _split_rows(arrays: tuple, num_layers: int, sharding: NamedSharding) -> tuple:
    """Each [L*E, ...] host array viewed as [L, E, ...] and placed split on the expert axis (``sharding``):
    device d gets its [L, El, ...] share, copied from its own rows. The array is read once through a numpy
    view (on a GPU host: one host copy of it, freed after), so no device ever holds the whole bank."""
    out = []
    for a in arrays:
        host = np.asarray(a)
        view = host.reshape((num_layers, host.shape[0] // num_layers) + host.shape[1:])
        out.append(jax.make_array_from_callback(view.shape, sharding, lambda idx, v=view: v[idx]))
    return tuple(out)


def shard_banks(arrays: tuple, num_layers: int, mesh: Mesh) -> tuple:
    """The resident pools of the banks' arrays (weights and scales, each [L*E, ...]): [L, E, ...] in device
    memory, split on the expert axis (:func:`_split_rows`)."""
    return _split_rows(arrays, num_layers, expert_sharding(mesh))


def host_memory_kind(mesh: Mesh) -> str:
    """The host memory kind the split host banks live in: ``pinned_host`` where the mesh's devices have it,
    else ``unpinned_host``."""
    return "pinned_host" if "pinned_host" in memory.memory_kinds(mesh.devices.flat[0]) else "unpinned_host"


def shard_host_banks(banks: ExpertBanks, num_layers: int, mesh: Mesh) -> ExpertBanks:
    """The host banks as the offloading modes read them over the mesh: each [L*E, ...] array viewed as
    [L, E, ...] and split on the expert axis in host memory (:func:`host_memory_kind`): device d's share
    [L, El, ...] is what it copies its misses from, over its own link."""
    gu, dn, *scales = _split_rows((banks.gate_up, banks.down, *(banks.scales or ())), num_layers,
                                  expert_sharding(mesh, host_memory_kind(mesh)))
    return ExpertBanks(gu, dn, tuple(scales) or None, banks.fmt)


def sharded_zeros(shape: tuple, dtype, sharding: NamedSharding) -> jax.Array:
    """Zeros of ``shape`` and ``dtype`` made in place with ``sharding`` (each device its own block)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def split_tables(num_layers: int, num_experts: int, num_slots: int, devices: int):
    """Empty slot tables, one per device (``init_slot_table(L, E / N, S / N)``), stacked on a leading [N] axis
    split over the mesh: device d's table maps its local flat ids ``layer * E/N + j`` (expert d*E/N + j) to
    its own S / N slots.
    Raises:
      ValueError: slots that do not split (:func:`check_slots`)."""
    per = check_slots(num_slots, num_layers, num_experts, devices)
    table = init_slot_table(num_layers, num_experts // devices, per)
    split = NamedSharding(expert_mesh(devices), P(EXPERT_AXIS))
    return jax.tree.map(lambda a: jax.device_put(np.stack([np.asarray(a)] * devices), split), table)


def init_split_state(mode: str, num_layers: int, num_experts: int, num_slots: int, banks: ExpertBanks,
                     devices: int) -> ExpertState:
    """The expert state of an experts mode split over ``devices`` devices (module docstring).

    resident: the banks' pools [L, E, ...] split on the expert axis (:func:`shard_banks`), no table.
    cached / on_demand: each device a pool of S / N slots (pools [S, ...] split on axis 0, device d's slots
    [d*S/N, (d+1)*S/N)) and its own slot table of (L, E / N, S / N), the tables stacked on a leading [N]
    axis split over the devices; the recency of the cpu / adaptive miss policies is not kept (they run on
    one device).
    Raises:
      ValueError: slots that do not split (:func:`check_slots`)."""
    mesh = expert_mesh(devices)
    if mode == "resident":
        gu, dn, *scales = shard_banks((banks.gate_up, banks.down, *(banks.scales or ())), num_layers, mesh)
        return ExpertState(gu, dn, None, scales=tuple(scales) or None, fmt=banks.fmt)
    split = NamedSharding(mesh, P(EXPERT_AXIS))
    pool = lambda a: sharded_zeros((num_slots,) + a.shape[1:], a.dtype, split)  # noqa: E731
    tables = split_tables(num_layers, num_experts, num_slots, devices)
    scales = None if banks.scales is None else tuple(pool(s) for s in banks.scales)
    return ExpertState(pool(banks.gate_up), pool(banks.down), tables, None, scales, banks.fmt)


def resident_per_layer(slot_of: np.ndarray, num_layers: int, num_experts: int) -> list[int]:
    """Experts of each layer in the split slot cache: slot_of int32 [N, L*El] (the stacked tables') -> [L]."""
    n = slot_of.shape[0]
    return (slot_of.reshape(n, num_layers, num_experts // n) >= 0).sum(axis=(0, 2)).tolist()


def _local_routing(ids: jax.Array, weights: jax.Array, experts_per_device: int):
    """This device's view of a layer's routing inside ``shard_map``: (local expert ids int32 [N, k] in
    [0, El), the pairs of other devices' experts given id 0; weights [N, k] with those pairs' set to 0;
    bool [N, k], the pairs of this device's experts)."""
    d = jax.lax.axis_index(EXPERT_AXIS)
    local = ids - d * experts_per_device
    mine = (local >= 0) & (local < experts_per_device)
    return jnp.where(mine, local, 0), jnp.where(mine, weights, jnp.zeros_like(weights)), mine


def _resident_local(el: int):
    def local(state, banks, layer, r, mine):
        del banks, mine
        flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731 - [L, El, ...] -> the pool [L*El, ...]
        slot_of_expert = layer * el + jnp.arange(el, dtype=jnp.int32)
        y = experts_from_pool(r.x, r.ids, r.weights, slot_of_expert, flat(state.gate_up), flat(state.down),
                              tuple(flat(s) for s in state.scales or ()) or None, state.fmt)
        return y, state, jnp.int32(0), jnp.int32(0)
    return local


def _cached_local(mode: str, el: int, policy: str, skip: bool):
    def local(state, banks, layer, r, mine):
        routed = jnp.zeros((el,), jnp.bool_).at[r.ids].max(mine & r.valid[:, None])
        table = reset_table(state.table) if mode == "on_demand" else state.table
        look = lookup_layer(table, layer, routed, el, policy, skip_if_all_hit=skip)
        state = fetch_experts(banks, state.replace(table=look.table), layer * el + look.miss_experts,
                              look.miss_slots, look.n_miss)
        # a pair of another device's expert reads some slot of this pool (weight 0): never slot -1
        pair_slots = jnp.maximum(look.slot_of_expert[r.ids], 0)
        y = experts_from_pool(r.x, r.ids, r.weights, look.slot_of_expert, state.gate_up, state.down, state.scales,
                              state.fmt, pair_slots)
        return y, state, look.n_hit, look.n_miss
    return local


def _stream_local(el: int, num_layers: int, overlap: bool):
    def local(state, banks, layer, r, mine):
        del mine
        y, state, _ = offload.make_stream_expert_fn(el, num_layers, banks, overlap)(state, layer, r)
        return y, state, jnp.int32(0), jnp.int32(el)
    return local


def _state_spec(state: ExpertState) -> P:
    """The split of every leaf of an expert state: resident pools [L, E, ...] on axis 1; slot pools and stacked
    tables on axis 0."""
    return P(None, EXPERT_AXIS) if state.table is None else P(EXPERT_AXIS)


def _unstack(state: ExpertState) -> ExpertState:
    """A device's own table inside ``shard_map`` (its [1, ...] slice of the stacked tables, squeezed)."""
    return state if state.table is None else state.replace(table=jax.tree.map(lambda a: a[0], state.table))


def _stack(state: ExpertState) -> ExpertState:
    return state if state.table is None else state.replace(table=jax.tree.map(lambda a: a[None], state.table))


def _split_expert_fn(mesh: Mesh, num_experts: int, banks: ExpertBanks | None, local, stats_fn):
    """The expert function (``ftjax.seams.ExpertFn``) of a per-device ``local`` function run under
    ``shard_map``: each device gets its own expert state, host bank share and local view of the routing
    (:func:`_local_routing`), returns (y, state, hits, misses); y and the counts are summed over the devices.
    ``stats_fn(hits, misses, routing)`` makes the layer's ``LayerStats``."""
    el = num_experts // mesh.shape[EXPERT_AXIS]

    def expert_fn(state: ExpertState, layer: jax.Array, r: LayerRouting):
        def body(state, banks, layer, x, ids, weights, valid):
            l_ids, l_w, mine = _local_routing(ids, weights, el)
            y, state, hits, misses = local(_unstack(state), banks, layer, LayerRouting(x, l_ids, l_w, valid), mine)
            counts = jax.lax.psum(jnp.stack([hits, misses]), EXPERT_AXIS)
            return jax.lax.psum(y, EXPERT_AXIS), _stack(state), counts

        spec = _state_spec(state)
        # the Pallas kernels' outputs carry no varying-axes marking, so check_vma would refuse the body (the
        # psums above make y and the counts replicated, which is all out_specs P() asks)
        fn = jax.shard_map(body, mesh=mesh, out_specs=(P(), spec, P()),
                           in_specs=(spec, P(None, EXPERT_AXIS), P(), P(), P(), P(), P()), check_vma=False)
        y, state, counts = fn(state, banks, layer, r.x, r.ids, r.weights, r.valid)
        return y, state, stats_fn(counts[0], counts[1], r)

    return expert_fn


def make_split_expert_fn(mode: str, num_experts: int, num_layers: int, devices: int, banks: ExpertBanks | None,
                         policy: str = "lru", cheap_conds: bool = False, stream: bool = False, overlap: bool = True):
    """The expert function of experts ``mode`` (or of a streamed prefill call, ``stream``) split over
    ``devices`` devices, each computing its own experts' pairs of the replicated tokens (module docstring).

    banks: the host banks split by :func:`shard_host_banks` (None for resident). Per device, as one device
    runs it over its E / N experts: resident reads its [L, El, ...] pools; cached / on_demand look up its own
    slot table (``policy``; the all-hit fast path under ``cheap_conds`` when a layer routes fewer pairs than
    E) and copy its own misses from its own bank share into its own pool; a streamed call copies each layer's
    E / N experts of its share, one slice per layer, through two buffers of E / N of its own slots
    (``ftjax.experts.offload.make_stream_expert_fn``). Stats: hits and misses summed over devices; a
    resident layer's hits are its distinct routed experts (as on one device).
    Raises:
      ValueError: host banks missing for an offloading mode."""
    mesh = expert_mesh(devices)
    el = num_experts // devices
    if mode != "resident" and banks is None:
        raise ValueError(f"experts mode {mode!r} needs the host expert banks")

    def stats(hits, misses, r):
        return LayerStats.fetch_only(hits, misses, offload.trace_ids(r))

    if stream:
        return _split_expert_fn(mesh, num_experts, banks, _stream_local(el, num_layers, overlap), stats)
    if mode == "resident":
        def resident_stats(hits, misses, r):
            return stats(offload.routed_count(r.ids, r.valid, num_experts), misses, r)
        return _split_expert_fn(mesh, num_experts, banks, _resident_local(el), resident_stats)

    def expert_fn(state, layer, r):
        skip = cheap_conds and mode == "cached" and r.ids.size < num_experts
        return _split_expert_fn(mesh, num_experts, banks, _cached_local(mode, el, policy, skip), stats)(
            state, layer, r)
    return expert_fn


def split_stream_prologue(banks: ExpertBanks, state: ExpertState, num_experts: int, overlap: bool,
                          devices: int) -> ExpertState:
    """``ftjax.experts.offload.stream_prologue`` on every device: its table forgets its 2E/N borrowed slots and
    (with overlap) its share of layer 0 is copied into its buffer 0."""
    mesh = expert_mesh(devices)
    el = num_experts // devices

    def body(state, banks):
        return _stack(offload.stream_prologue(banks, _unstack(state), el, overlap))

    spec = P(EXPERT_AXIS)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, P(None, EXPERT_AXIS)), out_specs=spec)(state, banks)


def step_expert_fn(num_layers: int, num_experts: int, mode: str, banks: ExpertBanks | None, state: ExpertState,
                   devices: int, stream: bool = False, overlap: bool = True, policy: str = "lru",
                   cheap_conds: bool = False):
    """``ftjax.experts.offload.step_expert_fn`` over ``devices`` devices: (state, expert function) of one jitted
    step, inside the jit (a streamed call's prologue run on every device first). The fetch miss policy only."""
    if stream:
        state = split_stream_prologue(banks, state, num_experts, overlap, devices)
    return state, make_split_expert_fn(mode, num_experts, num_layers, devices, banks, policy, cheap_conds, stream,
                                       overlap)
