"""The routed-expert FFN, computed from a pool of expert weights indexed by slot.

Both formulations read weights from a *pool*: ``gate_up`` [S, D, 2F] (gate columns first, then
up) and ``down`` [S, F, D]. The resident model is the special case where the pool is the whole
bank (S = L*E, slot = flat id), so offload changes only which slot a weight sits in, never the
arithmetic: resident and cached runs are bit-identical. Pools may hold quantized weights
(``ftjax.experts.quant``): each formulation dequantizes only the experts it reads, just before
its matmuls; dense weights pass through unchanged.

* ``gather``: each (token, k) pair reads its expert's weights. Cheap when N*k is small (decode).
  On GPUs a fused Pallas kernel reads them from the pool in place (``ftjax.kernels.moe_decode``);
  the jnp reference gathers them into a temporary first.
* ``grouped``: tokens sorted by expert and multiplied group by group against the layer's E
  experts (``ftjax.kernels.grouped_matmul``: on GPUs a Pallas Triton kernel for 256 experts or more, the
  Mosaic GPU kernel for fewer; ``ragged_dot`` else), gathered from the pool first or, where
  ``grouped_matmul_pool`` runs (auto beside the Triton kernel), read in place through a slot table. For
  prefill, where N*k >> E.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.experts import quant
from ftjax.kernels import moe_decode
from ftjax.kernels.grouped_matmul import grouped_matmul, grouped_swiglu, pool_grouping

# Use the gather formulation up to this many (token, expert) pairs per layer.
GATHER_MAX_PAIRS = 64


def _swiglu(h: jax.Array) -> jax.Array:
    f = h.shape[-1] // 2
    return jax.nn.silu(h[..., :f]) * h[..., f:]


def _rows(pool: jax.Array, scales: tuple | None, which: int, idx: jax.Array, fmt: str, dtype) -> jax.Array:
    """The weights of pool rows ``idx`` (any index shape), dequantized to ``dtype``: only these
    rows, never the whole pool. which: 0 = gate_up, 1 = down (selects the scales and parts)."""
    s = None if scales is None else scales[which][idx]
    return quant.dequantize_expert(fmt, ("gate_up", "down")[which], pool[idx], s, dtype)


def gather_outputs(x: jax.Array, slots: jax.Array, gate_up: jax.Array, down: jax.Array,
                   scales: tuple | None = None, fmt: str = "dense") -> jax.Array:
    """Per-(token, k) expert outputs [N, k, D]. x: [N, D]; slots: int32 [N, k].

    Where the kernel config selects it (``ftjax.kernels.registry``; default: on GPUs), the fused
    Pallas kernel ``ftjax.kernels.moe_decode`` reads each pair's weights from the pool in place;
    otherwise (the reference, and the CPU default) each pair gathers (and dequantizes) its
    expert's weights from the pool. Every expert mode calls this one function, so cached and
    resident runs stay bit-identical either way.
    """
    y = moe_decode.maybe_pairs(x, slots, gate_up, down, scales, fmt)
    return gather_outputs_reference(x, slots, gate_up, down, scales, fmt) if y is None else y


def gather_outputs_reference(x: jax.Array, slots: jax.Array, gate_up: jax.Array, down: jax.Array,
                             scales: tuple | None = None, fmt: str = "dense") -> jax.Array:
    """:func:`gather_outputs` in jnp (the kernel's reference): each pair gathers (and
    dequantizes) its expert's weights into a temporary [N, k, D, 2F], then two einsums."""
    h = jnp.einsum("nd,nkdf->nkf", x, _rows(gate_up, scales, 0, slots, fmt, x.dtype))
    return jnp.einsum("nkf,nkfd->nkd", _swiglu(h), _rows(down, scales, 1, slots, fmt, x.dtype))


def experts_gather(x: jax.Array, slots: jax.Array, weights: jax.Array, gate_up: jax.Array,
                   down: jax.Array, scales: tuple | None = None, fmt: str = "dense") -> jax.Array:
    """Per-pair gather formulation.

    x: [N, D]; slots: int32 [N, k] pool slots; weights: [N, k]; gate_up: [S, D, 2F]; down: [S, F, D]
    (stored in format ``fmt`` with pool ``scales``; ``ftjax.experts.quant``). Returns [N, D] in
    x's dtype: sum_k weights[n, k] * FFN_{slots[n, k]}(x[n]). Only the N*k gathered experts are
    dequantized.
    """
    y = gather_outputs(x, slots, gate_up, down, scales, fmt)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)).astype(x.dtype)


def experts_grouped(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array,
                    down: jax.Array, scales: tuple | None = None, fmt: str = "dense",
                    group_slot: jax.Array | None = None) -> jax.Array:
    """Grouped (sorted + ragged_dot) formulation over one layer's experts.

    x: [N, D]; ids: int32 [N, k] group (expert) ids in [0, G); weights: [N, k];
    gate_up: [G, D, 2F] and down: [G, F, D] in format ``fmt`` with ``scales`` ([G, ...] each),
    dequantized here just before the grouped matmul. group_slot: int32 [G] or None: group g's weights are
    row group_slot[g] of a dense pool gate_up [S, D, 2F] / down [S, F, D], read in place
    (``grouped_matmul.pool_grouping``). Returns [N, D] in x's dtype.
    Raises:
      ValueError: group_slot with a quantized format (the pool rows would be read as stored).
    """
    if group_slot is not None and fmt != "dense":
        raise ValueError(f"experts_grouped: group_slot reads dense pool rows in place, got format {fmt!r}")
    n, k = ids.shape
    e = gate_up.shape[0] if group_slot is None else group_slot.shape[0]
    sg, sd = scales if scales is not None else (None, None)
    gate_up = quant.dequantize_expert(fmt, "gate_up", gate_up, sg, x.dtype)
    down = quant.dequantize_expert(fmt, "down", down, sd, x.dtype)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    act = grouped_swiglu(x, order // k, gate_up, group_sizes, group_slot)  # one kernel where named, else None
    if act is None:
        act = _swiglu(grouped_matmul(x[order // k], gate_up, group_sizes, group_slot=group_slot))
    # Back in (token, expert) pair order: row r of the product is pair order[r]. The Triton kernel stores each row
    # there itself (grouped_matmul_scatter); otherwise a gather with the inverse permutation follows, not XLA's
    # scatter of the [N*k, D] rows (~260 GB/s on an H200: 1 ms per layer at 8192 tokens, docs/PROFILE.md).
    y = grouped_matmul(act, down, group_sizes, group_slot=group_slot, row_dest=order.astype(jnp.int32))
    y = y.reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)).astype(x.dtype)


def experts_from_layer(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array,
                       scales: tuple | None = None, fmt: str = "dense") -> jax.Array:
    """Expert FFN of one layer whose E experts sit in expert order in ``gate_up`` [E, D, 2F] and
    ``down`` [E, F, D] (a streamed full-layer buffer): the grouped matmul reads them as they are,
    with no gather copy. ids: int32 [N, k] expert ids. Same arithmetic, and the
    same formulation choice by N*k, as :func:`experts_from_pool` with slot = expert id.
    """
    with jax.named_scope("experts"):  # names the ops for profiles (experiments/profile_step.py)
        if ids.size <= GATHER_MAX_PAIRS:
            return experts_gather(x, ids, weights, gate_up, down, scales, fmt)
        return experts_grouped(x, ids, weights, gate_up, down, scales, fmt)


def experts_from_pool(x: jax.Array, ids: jax.Array, weights: jax.Array, slot_of_expert: jax.Array,
                      gate_up: jax.Array, down: jax.Array, scales: tuple | None = None,
                      fmt: str = "dense", pair_slots: jax.Array | None = None) -> jax.Array:
    """Expert FFN of one layer, weights read from pool slots (format ``fmt``, pool ``scales``).

    slot_of_expert: int32 [E], the pool slot of each of the layer's experts (only routed
    experts need a valid slot). Picks the formulation from the static size N*k. pair_slots:
    ``slot_of_expert[ids]`` int32 [N, k] where the caller has it (the slot lookup kernel makes it), or None.

    Grouped: the layer's E experts are gathered from the pool in expert order (one device copy; a
    quantized format gathers its stored bytes and scales and dequantizes these E experts) and the
    kernel sees E groups whatever the pool size S, so every pool size gives the same operands. Where the
    kernel config names ``grouped_matmul_pool``, or ``auto`` on a GPU picks it (E >= 256:
    :func:`ftjax.kernels.grouped_matmul.pool_grouping`; dense weights), the same E groups read their weights in the
    pool through a slot table instead, with no copy.
    Grouping rows by *slot* over the whole pool (G = S groups, most empty) is what neither does: the Mosaic
    GPU kernel unrolls a loop over its groups (its compile time grew to minutes, docs/MISS_POLICY.md,
    "Open"), and the Triton kernel's tile count grows with G.
    """
    with jax.named_scope("experts"):
        slots = slot_of_expert[ids] if pair_slots is None else pair_slots
        if ids.size <= GATHER_MAX_PAIRS:
            return experts_gather(x, slots, weights, gate_up, down, scales, fmt)
        # an expert without a slot (-1: a padding token's or another device's pair, whose output is weighted 0 or
        # dropped) reads slot 0, on both paths
        safe = jnp.maximum(slot_of_expert, 0)
        if fmt == "dense" and pool_grouping(x, gate_up, down, slot_of_expert.shape[0]):
            return experts_grouped(x, ids, weights, gate_up, down, group_slot=safe)
        layer_scales = None if scales is None else tuple(s[safe] for s in scales)
        return experts_grouped(x, ids, weights, gate_up[safe], down[safe], layer_scales, fmt)
