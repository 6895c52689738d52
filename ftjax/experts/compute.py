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

from ftjax.kernels.grouped_matmul import grouped_matmul, mgpu_supported

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

    Grouped, with the Mosaic GPU kernel: rows are grouped by *slot* over the whole pool (G = S
    groups, most empty), so the pool is the kernel's weight operand as it is and no copy of the
    layer's E experts (1.2 GB for qwen3-30b-a3b) is made. Elsewhere (ragged_dot, CPU): the layer's
    experts are gathered in expert order, so every pool size gives bit-identical results.
    """
    slots = slot_of_expert[ids]
    if ids.size <= GATHER_MAX_PAIRS:
        return experts_gather(x, slots, weights, gate_up, down)
    if mgpu_supported(x, gate_up):
        return experts_grouped(x, jnp.maximum(slots, 0), weights, gate_up, down)
    safe = jnp.maximum(slot_of_expert, 0)
    return experts_grouped(x, ids, weights, gate_up[safe], down[safe])
