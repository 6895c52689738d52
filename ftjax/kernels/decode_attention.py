"""Decode attention over the filled part of the KV cache only (split-K, FlashDecoding style).

The reference, ``ftjax.model.attention`` with T = 1, scores every one of the ``S_max`` cache
positions of the row and masks the unfilled ones: at S_max 8192 and 600 filled tokens it reads
~14x the bytes it needs. This kernel reads only positions ``[0, length)`` of each row.

Grid (B, Hkv, n_split). Program (b, h, s) takes the G = Hq / Hkv query heads that share KV head h
(GQA) as the rows of one tile ([G padded to 16, hd]: ``dot`` on the GPU wants 16 rows) and walks
its share of the filled positions, ``chunk = ceil(ceil(length / n_split) / block_k) * block_k``
keys starting at ``s * chunk``, in blocks of ``block_k`` with an online softmax in float32 (running
max m, running sum l, unnormalised output; FlashAttention, Dao et al. 2022). Splitting the keys
over ``n_split`` programs keeps the GPU busy at batch 1, where B * Hkv is only 4 programs
(FlashDecoding, Dao et al. 2023); the split results are merged by their log-sum-exp, in jnp
(:func:`merge_splits`) or in the prologue of the wo product (``dense_decode.merge_dense_decode``).
Splits are sized by the filled length, not by S_max, so every split does work and none reads an
unfilled position. The cache is passed whole ([L, B, S_max, Hkv, hd]) with the layer index, so
the layer's slice is never copied out of the scan carry.

Backend choice: generic Pallas primitives only (whole-array refs, ``pl.ds`` at a position read
from a ref, ``lax.fori_loop`` with a data-dependent trip count, ``dot_general``): interpretable on the
CPU, lowered on the GPU by Pallas' Triton backend (the default for a ``pallas_call`` without
Mosaic GPU parameters in jax 0.11.2, deprecated but shipped; jax's own Triton-style
``decode_attention`` op is built the same way). Mosaic GPU's warpgroup matmul needs 64-row
tiles, 8x more than the 8 query heads of one KV head here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import common, registry
from ftjax.kernels.online_softmax import NEG, fold_block

BLOCK_K, N_SPLIT = 64, 16
#: Rows of the query tile (the GQA group is zero-padded to this).
MIN_ROWS = 16


def supported(q: jax.Array, k_cache: jax.Array, block_k: int = BLOCK_K) -> bool:
    """True for q [B, 1, Hq, hd] and a cache [L, B, S, Hkv, hd] of one float dtype with Hq % Hkv ==
    0, hd a power of two >= 16, block_k a power of two >= 16 dividing S."""
    if q.ndim != 4 or q.shape[1] != 1 or k_cache.ndim != 5 or q.dtype != k_cache.dtype:
        return False
    hq, hd = q.shape[2], q.shape[3]
    s, hkv = k_cache.shape[2], k_cache.shape[3]
    bk = min(block_k, s)
    return (hq % hkv == 0 and hd >= 16 and hd & (hd - 1) == 0 and bk >= 16 and bk & (bk - 1) == 0
            and s % bk == 0 and jnp.issubdtype(q.dtype, jnp.floating))


def query_rows(g: int) -> int:
    """Rows of the query tile of a KV head's g query heads: :data:`MIN_ROWS`, or g's next power of two."""
    return max(MIN_ROWS, pl.next_power_of_2(g))


def _kernel(len_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, bk, n_split, scale, offset):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = common.wrap_clamp(layer_ref[0], k_ref.shape[0])  # as a jnp index: negative ids wrap, others clamp
    length = jnp.clip(len_ref[b] + offset, 1, k_ref.shape[2])  # here, not as one more XLA kernel per layer
    chunk = pl.cdiv(pl.cdiv(length, n_split), bk) * bk
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, length)
    steps = pl.cdiv(jnp.maximum(hi - lo, 0), bk)
    q = q_ref[b, h, :, :]
    rows = q.shape[0]

    def body(i, carry):
        acc, m, l = carry
        j0 = lo + i * bk
        kb = k_ref[layer, b, pl.ds(j0, bk), h, :]
        vb = v_ref[layer, b, pl.ds(j0, bk), h, :]
        sc = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        visible = (j0 + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)) < hi
        sc = jnp.where(visible, sc, NEG)
        return fold_block(acc, m, l, sc, vb)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, steps, body, init)
    o_ref[b, h, s, :, :] = acc
    m_ref[b, h, s, :] = m
    l_ref[b, h, s, :] = l


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, lengths: jax.Array,
                     *, offset: int = 0, interpret: bool = False, block_k: int = BLOCK_K, n_split: int = N_SPLIT,
                     num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """GQA attention of one query per row over the first ``lengths[b]`` cache positions.

    q: [B, 1, Hq, hd]; k_cache, v_cache: [L, B, S_max, Hkv, hd] (the whole stacked cache, or
    [B, S_max, Hkv, hd] for one layer); layer: int32 [] layer index; lengths: int32 [B], filled
    positions of each row less ``offset`` (static; the model passes the query positions and 1),
    1 <= lengths + offset <= S_max (clipped to that range). Scores scaled by
    hd**-0.5, softmax in float32. Returns [B, 1, Hq, hd] in q's dtype. interpret: Pallas interpret
    mode (CPU). block_k: keys per step; n_split: programs per (row, KV head); num_warps /
    num_stages: Triton compiler parameters on the GPU.
    """
    if k_cache.ndim == 4:
        k_cache, v_cache = k_cache[None], v_cache[None]
    b, _, hq, hd = q.shape
    hkv = k_cache.shape[3]
    g = hq // hkv
    rows = query_rows(g)
    qg = jnp.pad(q.reshape(b, hkv, g, hd), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    return grouped(qg, k_cache, v_cache, layer, lengths, g=g, offset=offset, interpret=interpret, block_k=block_k,
                   n_split=n_split, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("g", "interpret", "block_k", "n_split", "num_warps", "num_stages",
                                             "offset", "merged"))
def grouped(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, lengths: jax.Array, *, g: int,
            offset: int = 0, interpret: bool = False, block_k: int = BLOCK_K, n_split: int = N_SPLIT,
            num_warps: int | None = None, num_stages: int | None = None, merged: bool = True):
    """:func:`decode_attention` of queries already in the kernel's tile layout: qg [B, Hkv, rows, hd]
    (row r < g of KV head h is query head h * g + r; rows a power of two >= 16, the pad rows any
    value: their outputs are dropped), as ``ftjax.kernels.rope_cache`` writes them; k_cache,
    v_cache [L, B, S_max, Hkv, hd]. Other arguments and the result [B, 1, Hkv * g, hd] as
    :func:`decode_attention`. merged False: the splits' results (o [B, Hkv, n_split, rows, hd],
    m, l [B, Hkv, n_split, rows], float32) unmerged, for a consumer that merges them itself
    (:func:`merge_splits`; ``ftjax.kernels.dense_decode.merge_dense_decode``)."""
    b, hkv, rows, hd = qg.shape
    s_max = k_cache.shape[2]
    bk = min(block_k, s_max)
    lengths = lengths.astype(jnp.int32)  # + offset, clipped to [1, S_max] inside the kernel
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    params = common.triton_params(interpret, num_warps, num_stages)
    f32 = jnp.float32
    out_shape = (jax.ShapeDtypeStruct((b, hkv, n_split, rows, hd), f32),
                 jax.ShapeDtypeStruct((b, hkv, n_split, rows), f32), jax.ShapeDtypeStruct((b, hkv, n_split, rows), f32))
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, bk=bk, n_split=n_split, scale=hd ** -0.5, offset=offset), out_shape=out_shape,
        grid=(b, hkv, n_split), interpret=interpret, compiler_params=params, name="decode_attention",
    )(lengths, layer, qg, k_cache, v_cache)
    if not merged:
        return o, m, l
    return merge_splits(o, m, l, g, qg.dtype)


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array, g: int, dtype) -> jax.Array:
    """The attention output [B, 1, Hkv * g, hd] in ``dtype`` from the kernel's per-split results
    (o float32 [B, Hkv, n_split, rows, hd]: unnormalised outputs; m, l [B, Hkv, n_split, rows]:
    running max and sum) merged by their log-sum-exp: ``sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s``
    with M the largest m_s (FlashDecoding's reduction)."""
    b, hkv, _, _, hd = o.shape
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    out = jnp.sum(w[..., None] * o, axis=2) / jnp.sum(w * l, axis=2)[..., None]
    return out[:, :, :g].reshape(b, 1, hkv * g, hd).astype(dtype)


def maybe(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, q_pos: jax.Array) -> jax.Array | None:
    """The kernel's output for a decode call (T = 1; q_pos int32 [B, 1]) when the kernel config
    selects it for these operands (``registry.mode``), else None."""
    how = registry.mode("decode_attention", supported(q, k_cache) and common.dot_dtype_ok(q.dtype))
    if how == "xla":
        return None
    return decode_attention(q, k_cache, v_cache, layer, q_pos.reshape(-1), offset=1, interpret=how == "interpret")


registry.register(registry.Kernel(
    "decode_attention", "ftjax.layers.attention.attention",
    "decode attention (T = 1) over the filled cache positions only, 16-bit operands on a GPU; auto: GPU"))
