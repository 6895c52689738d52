"""Pieces every layer kind uses: RMSNorm, rotary embedding, dense projections.

Weights are ``[in, out]``. A dense weight may arrive as a :class:`StackedWeight` (the whole stack of
its kind's layers and an index) where a decode kernel reads it in place (``ftjax.kernels.dense_decode``);
:func:`project` and :func:`norm_project` take either.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ftjax.kernels import dense_decode, registry


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled by ``w`` in the input dtype (as transformers does).
    x: [..., K]; w: [K]."""
    with jax.named_scope("norm"):  # names the ops for profiles (experiments/profile_step.py)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return w * y.astype(x.dtype)


def rms_norm_offset(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with zero-centred weights (Qwen3.5 / Qwen3-Next): the float32 normalised x times
    ``1 + w`` in float32, then cast to x's dtype (transformers' ``Qwen3_5MoeRMSNorm``)."""
    with jax.named_scope("norm"):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def norm_fn(norm_offset: bool) -> Callable[[jax.Array, jax.Array, float], jax.Array]:
    """The family's RMSNorm: zero-centred weights where ``norm_offset`` (``ModelConfig.norm_offset``)."""
    return rms_norm_offset if norm_offset else rms_norm


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split layout (GPT-NeoX / Llama style).

    x: [B, T, H, hd]; positions: int32 [B, T]. cos/sin are computed in float32.
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


class StackedWeight(NamedTuple):
    """Layer ``layer`` (int32 []) of a dense weight ``w`` [L_kind, K, N] stacked over its kind's layers,
    not sliced: what a decode step hands a layer in place of ``w[layer]`` where the dense decode
    kernel runs, so that :func:`project` reads the layer's matrix in place instead of XLA copying
    the slice out of the scan's xs first."""

    w: jax.Array
    layer: jax.Array


def layer_weight(w: jax.Array | StackedWeight) -> jax.Array:
    """The layer's own array of a weight that may be a :class:`StackedWeight` (sliced at its layer)."""
    return w.w[w.layer] if isinstance(w, StackedWeight) else w


def project(x: jax.Array, w: jax.Array | StackedWeight) -> jax.Array:
    """``x @ w`` for a dense weight: x [..., K], w [K, N] -> [..., N] in the promoted dtype.

    w may be a :class:`StackedWeight` (``w.w [L, K, N]``, ``w.layer``): where the kernel config
    selects ``dense_decode`` for these operands the kernel computes ``x @ w.w[w.layer]`` reading the
    stacked weight in place; otherwise the layer's matrix is sliced and the product below runs on it.

    Fewer rows than ``KernelConfig.min_dot_rows`` (4 on a GPU) are padded with zero rows and sliced
    back: XLA's ``dot-strength-reduction`` pass turns a one-row product into multiply + reduce
    fusions that ran at ~20% of the HBM bandwidth on the H200, where a 4-row GEMM reads the same
    weights at full speed (docs/PROFILE.md). Each row's result is the same product.
    """
    if isinstance(w, StackedWeight):
        y = dense_decode.maybe(x, w.w, w.layer)
        if y is not None:
            return y
        w = w.w[w.layer]
    m = registry.active().dot_rows()
    rows = math.prod(x.shape[:-1])  # not x.size // K: K may be 0 (then x @ w is zeros)
    if rows >= m:
        return x @ w
    padded = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, m - rows), (0, 0)))
    return (padded @ w)[:rows].reshape(*x.shape[:-1], w.shape[-1])


def norm_project_in_one_launch(h: jax.Array, norm_w: jax.Array | StackedWeight, ws: tuple, eps: float,
                               offset: bool = False, write_x: bool = False, sum_parts: bool = True):
    """:func:`norm_project` as one ``norm_dense_decode`` launch (``dense_decode.maybe_norm``), where every weight
    is a :class:`StackedWeight` of one layer and the kernel config selects the kernel for this norm; else None.
    With ``sum_parts`` False the products are the kernel's unsummed K-split parts [parts, rows, sum N_i] (the
    router kernel sums them itself)."""
    if not (all(isinstance(w, StackedWeight) for w in ws) and len({id(w.layer) for w in ws}) == 1):
        return None
    g = norm_w.w if isinstance(norm_w, StackedWeight) else norm_w
    # a layer kind's weights index the kind's layers, the norm all layers: the kernel reads each at its own
    at = norm_w.layer if isinstance(norm_w, StackedWeight) and norm_w.layer is not ws[0].layer else None
    return dense_decode.maybe_norm(h, g, eps, [w.w for w in ws], ws[0].layer, write_x, sum_parts=sum_parts,
                                   offset=offset, norm_layer=at)


def norm_project(h: jax.Array, norm_w: jax.Array | StackedWeight, ws: tuple, eps: float, offset: bool = False,
                 write_x: bool = False):
    """``rms_norm(h)`` (``rms_norm_offset`` where ``offset``) and its products with ``ws`` ([..., N_i]
    each), and the normalised rows when ``write_x`` (else None). Where every weight is a
    :class:`StackedWeight` of one layer and the kernel config selects ``norm_dense_decode`` for this norm
    (decode steps; a zero-centred one only where ``dense_decode.norm_auto`` or its name says), one kernel launch
    does all of it; otherwise the norm and :func:`project` per weight. h: [..., K]; norm_w: [K], or a
    :class:`StackedWeight` of the norm weights [L, K] (the kernel reads the layer's row in place)."""
    got = norm_project_in_one_launch(h, norm_w, ws, eps, offset, write_x)
    if got is not None:
        return got
    x = norm_fn(offset)(h, layer_weight(norm_w), eps)
    return [project(x, w) for w in ws], (x if write_x else None)
