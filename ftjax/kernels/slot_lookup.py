"""The slot table's LRU lookup of one decode layer in one Pallas launch (``slot_table.lookup_layer``
with ``policy="lru"``, same results); ``use="auto"`` runs it on a GPU.

Why: in the H200 trace of a cached batch-1 decode step each layer spent ~40 us
more than the resident layer, of which the misses' copies are a small part when most experts hit:
the routed mask's scatter, the hit / miss counts, the protected-slot mask over the S slots, the
all-hit ``lax.cond`` (its predicate kernel, a graph conditional node and its two branch kernels:
~11 us of gaps), the rank of the misses, the table's selects and scatter, a few ``memcpy``. With
the cached path's fixed cost at ~2 ms per step against a ~6 ms resident step, the cached target
(step <= 1.15x resident + misses / B_P) cannot be met by faster expert reads.

Kernel: one program. It reads the layer's (token, expert) pairs and the slot of each routed
expert (``slot_of[layer * E + e]``); hits protect their slots; then, for each of the ``n_miss``
misses in ascending expert id, it takes the non-protected, not yet taken slot of smallest
``(last_use, slot index)`` (free slots have ``last_use`` -1 and come first), evicts its flat id,
maps the miss to it (scalar stores into ``slot_of`` and ``id_of_slot``), and finally sets
``last_use`` of the hit and filled slots to the clock. The three table arrays are aliased to the
outputs (``input_output_aliases``): only the touched entries are written. A decode layer has
n_miss <= N * k < E, so the loop is a few reductions over S; prefill calls keep the jnp path.

Backend: generic Pallas primitives plus the Triton backend's masked ``load`` / ``store`` (S need not
be a power of two), as the other decode kernels (``ftjax.kernels.common``); interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ftjax.kernels import common, registry

#: Most slots the kernel holds in one program's registers (four int32 / bool vectors of that size).
MAX_SLOTS = 8192
_INT32_MAX = 2**31 - 1


def supported(num_experts: int, num_slots: int, pairs: int) -> bool:
    """True for E a power of two, E <= S <= :data:`MAX_SLOTS`, and fewer (token, expert) pairs
    than E (a decode layer: at most pairs - 1 misses, each a few reductions over S)."""
    e = num_experts
    return e >= 1 and not e & (e - 1) and e <= num_slots <= MAX_SLOTS and 1 <= pairs < e


def _kernel(layer_ref, clock_ref, ids_ref, valid_ref, slot_in, id_in, lu_in,
            slot_ref, id_ref, lu_ref, soe_ref, me_ref, ms_ref, ev_ref, n_ref, flat_ref, pair_ref, *, e, k, s, s_pad):
    iota_e = lax.broadcasted_iota(jnp.int32, (e,), 0)
    iota_s = lax.broadcasted_iota(jnp.int32, (s_pad,), 0)
    in_s = iota_s < s
    base = layer_ref[0] * e
    clock = clock_ref[0]
    cur = slot_in[pl.ds(base, e)]  # each expert's slot before this call

    def pair(p, carry):  # routed experts and the slots their hits protect
        routed, protected = carry
        ex = ids_ref[p]
        ok = (valid_ref[p // k] != 0) & (ex >= 0) & (ex < e)
        cur_e = slot_in[base + jnp.clip(ex, 0, e - 1)]
        return routed | ((iota_e == ex) & ok), protected | ((iota_s == cur_e) & ok & (cur_e >= 0))

    routed, protected = lax.fori_loop(0, ids_ref.shape[0], pair,
                                      (jnp.zeros((e,), jnp.bool_), jnp.zeros((s_pad,), jnp.bool_)))
    miss = routed & (cur < 0)
    n_miss = jnp.sum(miss.astype(jnp.int32))
    n_hit = jnp.sum((routed & (cur >= 0)).astype(jnp.int32))
    last_use = plt.load(lu_in.at[pl.ds(0, s_pad)], mask=in_s, other=_INT32_MAX)
    excluded = protected | ~in_s

    def fill(i, carry):
        done, taken, cur, me, ms, ev = carry
        ei = jnp.min(jnp.where(miss & ~done, iota_e, e))  # the next miss in ascending expert id
        key = jnp.where(excluded | taken, _INT32_MAX, last_use)
        si = jnp.min(jnp.where(key == jnp.min(key), iota_s, s_pad))  # LRU slot, ties to the lowest index
        old = id_in[si]  # never written before in this call: each slot is taken once

        @pl.when(old >= 0)
        def _():
            slot_ref[old] = jnp.int32(-1)

        slot_ref[base + ei] = si
        id_ref[si] = base + ei
        cur = jnp.where(iota_e == old - base, -1, jnp.where(iota_e == ei, si, cur))  # an evicted expert of this layer
        at = iota_e == i
        return (done | (iota_e == ei), taken | (iota_s == si), cur, jnp.where(at, ei, me), jnp.where(at, si, ms),
                jnp.where(at, old, ev))

    minus = jnp.full((e,), -1, jnp.int32)
    _, taken, cur, me, ms, ev = lax.fori_loop(0, n_miss, fill, (jnp.zeros((e,), jnp.bool_),
                                                               jnp.zeros((s_pad,), jnp.bool_), cur, minus, minus,
                                                               minus))
    plt.store(lu_ref.at[pl.ds(0, s_pad)], jnp.where(protected | taken, clock, last_use), mask=in_s)
    soe_ref[...] = cur
    me_ref[...] = me
    ms_ref[...] = ms
    ev_ref[...] = ev
    n_ref[0] = n_miss
    n_ref[1] = n_hit
    flat_ref[...] = jnp.where(me >= 0, base + me, -1)

    def pair_slot(p, carry):  # slot_of_expert[ids] as the MoE computation gathers it
        ex = common.wrap_clamp(ids_ref[p], e)
        pair_ref[p] = jnp.sum(jnp.where(iota_e == ex, cur, 0))
        return carry

    lax.fori_loop(0, ids_ref.shape[0], pair_slot, 0)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret", "num_warps"))
def lookup_lru(ids: jax.Array, valid: jax.Array, slot_of: jax.Array, id_of_slot: jax.Array, last_use: jax.Array,
               clock: jax.Array, layer: jax.Array, *, num_experts: int, interpret: bool = False,
               num_warps: int | None = None):
    """One decode layer's LRU lookup (``slot_table.lookup_layer(..., policy="lru")`` of the routed
    mask of ``ids`` / ``valid``) in one launch.

    ids: int32 [N, k] expert ids of the layer's (token, expert) pairs (ids outside [0, E) route
    nothing); valid: bool [N] (False: a padding token, routes nothing); slot_of: int32 [L * E];
    id_of_slot, last_use: int32 [S]; clock, layer: int32 [] (0 <= layer < L); num_experts: E.
    The three table arrays are updated in place (aliased to the outputs).

    Returns (slot_of, id_of_slot, last_use, slot_of_expert [E], miss_experts [E], miss_slots [E],
    evicted_ids [E], n_miss [], n_hit []), int32, as ``lookup_layer``'s :class:`LayerLookup`
    (the clock is not advanced here), then two results the cached layer needs next, made here rather
    than by a small XLA kernel each inside the decode step's layer loop: the misses' flat ids
    ``layer * E + miss_experts`` [E] (-1 past n_miss) and each pair's slot ``slot_of_expert[ids]`` [N, k].

    Raises:
      ValueError: sizes :func:`supported` rejects.
    """
    e = int(num_experts)
    n, k = ids.shape
    s = id_of_slot.shape[0]
    if not supported(e, s, n * k) or slot_of.shape[0] % e or last_use.shape != (s,) or valid.shape != (n,):
        raise ValueError(f"slot_lookup: unsupported sizes (E={e}, S={s}, pairs={n * k}, slot_of {slot_of.shape}, "
                         f"last_use {last_use.shape}, valid {valid.shape})")
    s_pad = pl.next_power_of_2(s)
    i32 = jnp.int32
    params = common.triton_params(interpret, num_warps)
    sd = jax.ShapeDtypeStruct
    out_shape = (sd(slot_of.shape, i32), sd((s,), i32), sd((s,), i32)) + (sd((e,), i32),) * 4 + (
        sd((2,), i32), sd((e,), i32), sd((n * k,), i32))
    outs = pl.pallas_call(
        functools.partial(_kernel, e=e, k=k, s=s, s_pad=s_pad), out_shape=out_shape, grid=(1,),
        input_output_aliases={4: 0, 5: 1, 6: 2}, interpret=interpret, compiler_params=params, name="slot_lookup",
    )(jnp.asarray(layer, i32).reshape(1), jnp.asarray(clock, i32).reshape(1), ids.reshape(-1).astype(i32),
      valid.astype(i32), slot_of, id_of_slot, last_use)
    return (*outs[:7], outs[7][0], outs[7][1], outs[8], outs[9].reshape(n, k))


def maybe(ids: jax.Array, valid: jax.Array, slot_of: jax.Array, id_of_slot: jax.Array, last_use: jax.Array,
          clock: jax.Array, layer: jax.Array, num_experts: int):
    """:func:`lookup_lru` when the kernel config selects ``slot_lookup`` for these sizes (``registry.mode``;
    under ``auto`` on a GPU: :data:`AUTO`), else None (the caller runs ``slot_table.lookup_layer``)."""
    how = registry.mode("slot_lookup", supported(num_experts, id_of_slot.shape[0], ids.size), auto=AUTO)
    if how == "xla":
        return None
    return lookup_lru(ids, valid, slot_of, id_of_slot, last_use, clock, layer, num_experts=num_experts,
                      interpret=how == "interpret")


#: Whether ``use="auto"`` runs the kernel on a GPU: yes, measured faster with the same table and misses as
#: ``lookup_layer`` (docs/PROFILE.md).
AUTO = True


registry.register(registry.Kernel(
    "slot_lookup", "ftjax.experts.slot_table.lookup_layer",
    "the cached mode's LRU slot-table lookup of a decode layer (fewer (token, expert) pairs than E, every miss "
    "fetched); auto: GPU", auto=AUTO))
