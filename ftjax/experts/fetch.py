"""Host-to-device copies of expert weights inside the jitted step (FreeToken; DESIGN.md 1.1, 1.3).

Every copy is a slice of a host bank followed immediately by ``jax.device_put`` to device
memory, the one operation applied to host data (DESIGN.md section 2: other math on host
operands turns into slow host compute). A quantized format's scales travel with their weights
(the pools store what the banks store; ``ftjax.experts.quant``). A layer's misses are copied up to
``registry.FETCH_GROUP`` per loop iteration, every host read of an iteration issued before its slot
writes (issue 33, item 2: misses at the link's speed; ``experiments/bench_miss_copy.py``), or, on a GPU where it
builds (``KernelConfig.miss_copy``), all of a layer's misses by one kernel that writes them straight into their
slots (``ftjax.experts.slot_copy``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.experts import slot_copy
from ftjax.experts.state import ExpertBanks, ExpertState
from ftjax.kernels import registry


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


def group_sizes(group: int) -> list[int]:
    """The copies an iteration of :func:`fetch_experts` may make: ``group`` and every power of two below it
    (8: [1, 2, 4, 8]; 6: [1, 2, 4, 6]; 1: [1])."""
    return sorted({1 << i for i in range(group.bit_length()) if 1 << i < group} | {group})


def _copy_lanes(src: tuple, pools: tuple, flat_ids: jax.Array, slots: jax.Array, lanes: list) -> tuple:
    """Copies the misses at positions ``lanes`` (int32 scalars, in order) of ``flat_ids`` / ``slots`` into their
    slots. Every host read of the group is issued before the first slot write, so that XLA may keep the
    group's reads in flight together; the slots are written in lane order (a later lane wins a repeated slot,
    as one copy per iteration would)."""
    rows = [tuple(_bank_row(b, p, flat_ids[i]).astype(p.dtype) for b, p in zip(src, pools)) for i in lanes]
    for i, row in zip(lanes, rows):
        pools = tuple(jax.lax.dynamic_update_index_in_dim(p, r, slots[i], 0) for p, r in zip(pools, row))
    return pools


def fetch_experts(banks: ExpertBanks, state: ExpertState, flat_ids: jax.Array, slots: jax.Array,
                  count: jax.Array, group: int | None = None) -> ExpertState:
    """Copies ``count`` experts (weights and scales) from the host banks into pool slots (H2D).

    flat_ids, slots: int32 [M], the first ``count`` entries valid (flat ids of the banks: ``layer * E +
    expert``, or ``layer * El + local expert`` for a device's [L, El, ...] share; slots of the pools);
    count: int32 [] in [0, M]. Each copy is a dynamic index of a host bank (one expert: gate_up [D, 2F],
    down [F, D] and their scales), moved to the device and written into its slot; entries past ``count``
    are never read.

    group: the most copies per loop iteration (static, >= 1; at most M are used; None: the active kernel
    config's, ``KernelConfig.miss_group()``: ``registry.FETCH_GROUP``). An iteration copies
    ``group`` misses while that many are left, then the largest power of two that is left (a ``lax.switch``
    over :func:`group_sizes`), so a layer takes ``count // group + popcount(count % group)`` iterations and
    no byte crosses the link that is not a miss (8 misses, group 8: one iteration; 7: three). A layer
    without misses costs one loop check, as before. ``group=1`` is the loop of one copy per iteration.
    Why (issue 33, item 2): one copy per iteration left the link idle for the loop control and the slot
    writes between copies (on the H200 an iteration took ~210 us for one 9.44 MB expert whose two host
    reads took ~191 us: the copies at 96% of B_P, the loop at 88%; docs/PROFILE.md); FreeToken moves a
    step's misses at ~51 GB/s. ``experiments/bench_miss_copy.py`` measures each group size against the
    pinned copy rate. The pools written are the same for every ``group``.
    On a GPU, ``KernelConfig.miss_copy`` may pick the slot-copy kernel instead (:func:`uses_slot_kernel`): one
    launch per bank and layer writes every miss straight into its slot, no loop; ``group`` is then unused.
    Raises:
      ValueError: ``group`` < 1, or ``miss_copy="kernel"`` where the kernel cannot apply (split banks, rows that
        differ from the pool's).
      slot_copy.SlotCopyUnavailable: ``miss_copy="kernel"`` where the kernel cannot build or run.
    """
    group = registry.active().miss_group() if group is None else group
    if group < 1:
        raise ValueError(f"fetch_experts: group must be >= 1, got {group}")
    src = _bank_arrays(banks)
    flat_ids, slots = jnp.asarray(flat_ids), jnp.asarray(slots)
    g = max(1, min(group, flat_ids.shape[0]))
    with jax.named_scope("expert_fetch"):
        if uses_slot_kernel(src, _pool_arrays(state)):
            pools = tuple(slot_copy.copy_into_slots(b, p, flat_ids, slots, count)
                          for b, p in zip(src, _pool_arrays(state)))
        elif g == 1:
            pools = _one_per_iteration(src, _pool_arrays(state), flat_ids, slots, count)
        else:
            pools = _grouped(src, _pool_arrays(state), flat_ids, slots, count, g)
    return _with_pools(state, pools)


def uses_slot_kernel(src: tuple, pools: tuple) -> bool:
    """Whether :func:`fetch_experts` copies these banks' misses with the slot-copy kernel
    (``KernelConfig.miss_copy``, :data:`registry.MISS_COPIES`): "xla" never; "auto" on a GPU where the kernel
    builds and every bank is whole (not a device's split share) with its pool's row shape and dtype; "kernel"
    wherever those hold.
    Raises:
      ValueError: "kernel" with split banks or rows that differ from the pool's.
      slot_copy.SlotCopyUnavailable: "kernel" where the kernel cannot build or run (not a GPU, no nvcc)."""
    choice = registry.active().miss_copy
    if miss_copy_mode(choice) == "xla":
        if choice == "auto" and registry.backend() == "gpu" == jax.default_backend():  # a GPU run, not a lowering
            slot_copy.warn_once(slot_copy.unavailable())
        return False
    if not all(not _split(b, p) and b.shape[1:] == p.shape[1:] and b.dtype == p.dtype for b, p in zip(src, pools)):
        if choice == "kernel":
            raise ValueError("KernelConfig.miss_copy: the slot-copy kernel needs whole banks whose rows match their "
                             "pools' (not a device's split share, no dtype conversion); use auto or xla")
        return False
    if choice == "kernel":
        slot_copy.register()  # raises with the reason
    return True


def miss_copy_choice(choice: str, devices: int) -> str:
    """``KernelConfig.miss_copy`` for experts on ``devices`` devices: "auto" split over several devices is "xla"
    (the slot-copy kernel was measured on one device only), any other choice itself."""
    return "xla" if choice == "auto" and devices > 1 else choice


def miss_copy_mode(choice: str = "auto", devices: int = 1) -> str:
    """How misses are copied on this machine under ``KernelConfig.miss_copy`` = ``choice`` for whole banks on
    ``devices`` devices: "kernel" (the slot-copy kernel) or "xla" (XLA's loop), as :func:`uses_slot_kernel`
    decides at trace time (``ftjax.calibrate`` keys its profiles by it)."""
    choice = miss_copy_choice(choice, devices)
    if choice == "xla" or (choice == "auto" and registry.backend() != "gpu"):
        return "xla"
    return "kernel" if choice == "kernel" or slot_copy.unavailable() is None else "xla"


def _one_per_iteration(src: tuple, pools: tuple, flat_ids: jax.Array, slots: jax.Array, count) -> tuple:
    """:func:`fetch_experts`' loop with group 1: one copy per iteration (the fetch as it was before groups)."""
    return jax.lax.fori_loop(0, count, lambda i, p: _copy_lanes(src, p, flat_ids, slots, [i]), pools)


def _grouped(src: tuple, pools: tuple, flat_ids: jax.Array, slots: jax.Array, count, g: int) -> tuple:
    """:func:`fetch_experts`' loop of up to ``g`` >= 2 copies per iteration: ``g`` while that many are left,
    then the largest power of two left; the iteration's copy count picks a branch of a ``lax.switch``."""
    sizes = group_sizes(g)  # sizes[i] = 2**i below g, sizes[-1] = g
    count = jnp.asarray(count, jnp.int32)

    def block(_, carry):
        pools, done = carry
        left = count - done
        pick = jnp.where(left >= g, len(sizes) - 1, 31 - jax.lax.clz(jnp.maximum(left, 1)))
        branches = [lambda p, n=n: _copy_lanes(src, p, flat_ids, slots, [done + t for t in range(n)])
                    for n in sizes]
        return jax.lax.switch(pick, branches, pools), done + jnp.asarray(sizes, jnp.int32)[pick]

    trips = count // g + jax.lax.population_count(count % g)
    # done starts as count * 0, of count's type: under shard_map a device's own (varying) count
    return jax.lax.fori_loop(0, trips, block, (pools, count * 0))[0]


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
