"""The routed-expert FFN, computed from a pool of expert weights indexed by slot.

Both formulations read weights from a *pool*: ``gate_up`` [S, D, 2F] (gate columns first, then
up) and ``down`` [S, F, D]. The resident model is the special case where the pool is the whole
bank (S = L*E, slot = flat id), so offload changes only which slot a weight sits in, never the
arithmetic: resident and cached runs are bit-identical.

* ``gather``: each (token, k) pair gathers its expert's weights. Cheap when N*k is small (decode).
* ``grouped``: tokens sorted by expert and multiplied group by group against the layer's E
  experts (``ftjax.kernels.grouped_matmul``: a Mosaic GPU kernel on GPUs, ``ragged_dot`` else).
  For prefill, where N*k >> E.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.kernels.grouped_matmul import grouped_matmul

# Use the gather formulation up to this many (token, expert) pairs per layer.
GATHER_MAX_PAIRS = 64


def _swiglu(h: jax.Array) -> jax.Array:
    f = h.shape[-1] // 2
    return jax.nn.silu(h[..., :f]) * h[..., f:]


def experts_gather(x: jax.Array, slots: jax.Array, weights: jax.Array, gate_up: jax.Array,
                   down: jax.Array) -> jax.Array:
    """Per-pair gather formulation.

    x: [N, D]; slots: int32 [N, k] pool slots; weights: [N, k]; gate_up: [S, D, 2F]; down: [S, F, D].
    Returns [N, D] in x's dtype: sum_k weights[n, k] * FFN_{slots[n, k]}(x[n]).
    """
    h = jnp.einsum("nd,nkdf->nkf", x, gate_up[slots])
    y = jnp.einsum("nkf,nkfd->nkd", _swiglu(h), down[slots])
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)).astype(x.dtype)


def experts_grouped(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array,
                    down: jax.Array) -> jax.Array:
    """Grouped (sorted + ragged_dot) formulation over one layer's experts.

    x: [N, D]; ids: int32 [N, k] group (expert or slot) ids in [0, G); weights: [N, k];
    gate_up: [G, D, 2F] and down: [G, F, D]. Returns [N, D] in x's dtype.
    """
    n, k = ids.shape
    e = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // k]
    h = grouped_matmul(xs, gate_up, group_sizes)
    y = grouped_matmul(_swiglu(h), down, group_sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)).astype(x.dtype)


def experts_from_pool(x: jax.Array, ids: jax.Array, weights: jax.Array, slot_of_expert: jax.Array,
                      gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """Expert FFN of one layer, weights read from pool slots.

    slot_of_expert: int32 [E], the pool slot of each of the layer's experts (only routed
    experts need a valid slot). Picks the formulation from the static size N*k.

    Grouped: the layer's E experts are gathered from the pool in expert order (one device copy,
    1.2 GB for qwen3-30b-a3b, an estimated 0.5 ms of HBM traffic on an H200) and the kernel sees E
    groups whatever the pool size S, so every pool size gives the same operands. Grouping rows by
    *slot* over the whole pool instead (G = S groups, most empty) avoids that copy but costs far
    more: the Mosaic GPU kernel unrolls a loop over its groups. Lowering one kernel call alone took
    1.8 / 16 / 127 s for G = 413 / 2109 / 6144 (this machine's CPU, jax 0.11.2, ``jax.export`` for
    cuda), and on the H200 a 24 GB cached engine (2109 slots) compiled for 160 to 194 s, with a
    10 s TTFT for a 16-token prompt (docs/MISS_POLICY.md, "Open").
    """
    slots = slot_of_expert[ids]
    if ids.size <= GATHER_MAX_PAIRS:
        return experts_gather(x, slots, weights, gate_up, down)
    safe = jnp.maximum(slot_of_expert, 0)
    return experts_grouped(x, ids, weights, gate_up[safe], down[safe])
