"""A decode layer's router after its logits GEMV in one Pallas launch: the K-split partial logits summed,
softmax, top-k and the top-k renormalisation (``model.top_k_route`` on ``model.norm_project``'s logits,
same arithmetic). ``auto`` selects it on a GPU since 2026-12-07 (:data:`AUTO`), or the kernel config names it.

Why: in the H200 trace of a resident batch-1 decode step the router was four
kernels per layer after the norm + router GEMV kernel (``dense_decode.norm_dense_decode``): the float32
sum of its K-split parts fused into a softmax (1.6 us), the top-k as a sort of the E probabilities
(3.2 us), a slice, and the gather that renormalises the k weights, with a gap before each: ~7 us of
48 x ~100 us per layer, in the resident and the cached step alike.

Kernel: one program per token row. It sums the row's partial logits over the K splits in float32,
rounds them to the projection's dtype as the jnp path does (``norm_dense_decode``'s summed output),
computes the softmax in float32 (``exp(x - max) / sum``, as ``jax.nn.softmax``), takes the k largest
probabilities one at a time (ties to the lowest expert id as ``lax.top_k`` on the CPU, and NaN the largest as
``lax.top_k``: ids stay in [0, E)), renormalises them when
the model does (``norm_topk_prob``) and casts the weights. The float32 sums run in another order than
XLA's fused reduce, so a logit can differ by one ulp of its dtype from the jnp path, and tied
probabilities (frequent with bf16 logits) may be ordered differently from XLA's GPU top-k (:data:`AUTO`);
both expert modes run this same kernel, so cached and resident stay bit-identical.

Backend: generic Pallas primitives for the Triton backend (``ftjax.kernels.common``); interpret mode
on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import common, registry

#: Most K-split parts and experts a program holds ([parts, E] float32 in registers).
MAX_PARTS_X_EXPERTS = 64 * 256


def supported(parts: int, num_experts: int, top_k: int, rows: int) -> bool:
    """True for powers of two parts, E and k with k <= E, parts x E <= :data:`MAX_PARTS_X_EXPERTS`, and
    1 to 64 token rows (a decode step)."""
    return (common.pow2(parts) and common.pow2(num_experts) and common.pow2(top_k) and top_k <= num_experts
            and parts * num_experts <= MAX_PARTS_X_EXPERTS and 1 <= rows <= 64)


def _kernel(parts_ref, ids_ref, w_ref, *, k: int, e: int, norm: bool, logits_dtype):
    f32 = jnp.float32
    logits = jnp.sum(parts_ref[...].astype(f32), axis=0).astype(logits_dtype).astype(f32)  # [E]
    unnormalized = jnp.exp(logits - jnp.max(logits))
    probs = unnormalized / jnp.sum(unnormalized)
    iota_e = lax.broadcasted_iota(jnp.int32, (e,), 0)
    iota_k = lax.broadcasted_iota(jnp.int32, (k,), 0)
    # NaN probabilities (a NaN or +inf logit, or all -inf) rank as the largest, as in ``lax.top_k``: as +inf here
    # (a probability is at most 1), else max / == would find no expert and write id E
    ids, w, left = jnp.zeros((k,), jnp.int32), jnp.zeros((k,), f32), jnp.where(probs != probs, jnp.inf, probs)
    for j in range(k):  # k is small (2 to 8): unrolled
        top = jnp.max(left)
        at = jnp.min(jnp.where(left == top, iota_e, e))  # ties to the lowest id
        ids = jnp.where(iota_k == j, at, ids)
        w = jnp.where(iota_k == j, jnp.where(top == jnp.inf, jnp.nan, top), w)
        left = jnp.where(iota_e == at, -jnp.inf, left)
    if norm:
        w = w / jnp.sum(w)
    ids_ref[...] = ids
    w_ref[...] = w.astype(w_ref.dtype)


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "logits_dtype", "dtype", "interpret",
                                             "num_warps"))
def route_decode(parts: jax.Array, *, top_k: int, norm_topk_prob: bool, logits_dtype, dtype,
                 interpret: bool = False, num_warps: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The router of a decode layer from its partial logits (Qwen3-MoE / OLMoE / Mixtral top-k routing).

    parts: [P, N, E] partial router logits (``dense_decode.norm_dense_decode(..., sum_parts=False)``: float32
    K-split sums, or P = 1 in the projection's dtype); top_k: k; norm_topk_prob: whether the k weights are
    renormalised to sum to 1; logits_dtype: the dtype the summed logits are rounded to (the projection's
    output dtype on the jnp path); dtype: the weights' dtype.

    Returns (ids int32 [N, k] in descending probability, weights [N, k] in ``dtype``), as
    ``model.top_k_route(cfg, sum(parts).astype(logits_dtype), dtype)``.

    Raises:
      ValueError: parts not 3-d, or sizes :func:`supported` rejects.
    """
    if parts.ndim != 3:
        raise ValueError(f"route_decode: parts must be [P, N, E], got shape {parts.shape}")
    p, n, e = parts.shape
    k = int(top_k)
    if not supported(p, e, k, n):
        raise ValueError(f"route_decode: unsupported sizes (parts={p}, rows={n}, E={e}, k={k}); expected powers "
                         f"of two with k <= E, parts x E <= {MAX_PARTS_X_EXPERTS}, 1 to 64 rows")
    kernel = functools.partial(_kernel, k=k, e=e, norm=bool(norm_topk_prob), logits_dtype=jnp.dtype(logits_dtype))
    return pl.pallas_call(
        kernel, grid=(n,),
        in_specs=[pl.BlockSpec((p, None, e), lambda i: (0, i, 0))],
        out_specs=(pl.BlockSpec((None, k), lambda i: (i, 0)), pl.BlockSpec((None, k), lambda i: (i, 0))),
        out_shape=(jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), jnp.dtype(dtype))),
        interpret=interpret, compiler_params=common.triton_params(interpret, num_warps), name="route_decode",
    )(parts)


def selected(rows: int, num_experts: int, top_k: int) -> bool:
    """Whether the kernel config selects ``route_decode`` for a decode call of ``rows`` token rows (``registry.mode``;
    under ``auto`` on a GPU: :data:`AUTO`), before its partial logits exist (their parts count unknown: one)."""
    return registry.mode("route_decode", supported(1, num_experts, top_k, rows), auto=AUTO, record=False) != "xla"


def maybe(parts: jax.Array, logits_dtype, top_k: int, norm_topk_prob: bool, dtype):
    """:func:`route_decode` of ``parts`` [P, rows, E] when the kernel config selects it for these sizes, else None
    (the caller runs ``model.top_k_route``). dtype: the weights' dtype. Returns (ids int32 [rows, k], weights
    [rows, k])."""
    p, rows, e = parts.shape
    how = registry.mode("route_decode", supported(p, e, top_k, rows), auto=AUTO)
    if how == "xla":
        return None
    return route_decode(parts, top_k=top_k, norm_topk_prob=norm_topk_prob, logits_dtype=logits_dtype, dtype=dtype,
                        interpret=how == "interpret")


#: Whether ``use="auto"`` runs the kernel on a GPU (where ``norm_dense_decode`` makes the logits: 16-bit models). Yes
#: since 2026-12-07: under the fixed decode loop (the block device-bound) it took resident decode, in one process
#: each and in both orders (H100, ``bench_decode_loop.py --forms=fixed``,
#: ``decode_speed/bench_decode_loop_*_16l-kernels-ab*_h100_2026-12-07.json``), from 590.8 / 592.6 to 610.2 / 615.5
#: tok/s on the 16-layer qwen3-30b-a3b cut (1.033-1.039x; batch 4 1261.2 -> 1277.5, 1.013x) and from 436.5 / 437.4 to
#: 466.2 / 466.5 on qwen3.5-35b-a3b's (1.066-1.068x); cached = resident bit for bit with it (12/12 on the GPU). On
#: 2026-12-02, while the block waited on the host each step, it measured within the spread (docs/PROFILE.md). Its
#: ties go to the lowest expert id where XLA's GPU top-k may order them otherwise, so greedy tokens of random bf16
#: weights can differ from the jnp router's (both are top-k of the same probabilities).
AUTO = True


registry.register(registry.Kernel(
    "route_decode", "ftjax.layers.moe.top_k_route",
    "a decode step's router after norm_dense_decode's partial logits (sum, softmax, top-k, renormalisation); "
    "auto: GPU, where norm_dense_decode runs (AUTO)", auto=AUTO, needs=("norm_dense_decode",)))
