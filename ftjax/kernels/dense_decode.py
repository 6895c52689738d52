"""Dense decode projection: ``x @ w[layer]`` for a few rows, reading the layer's matrix straight
from the weight stacked over layers, with no sliced copy of it.

Why: the decoder's layer scan (``ftjax.model.forward``) slices each layer's dense weights (wq, wk,
wv, wo, router; ``params["layers"]`` stacked ``[L, ...]``) out of the scan's xs. In the H200
profile of a batch-1 resident decode step, XLA materialised those slices as device-to-device
copies before each GEMM (or, with cuBLAS, concatenated wq/wk/wv every step): ~1.4 ms per step in
``memcpy`` / concat kernels, for weights that are only read once. Here one Pallas kernel reads the
stacked weight ``w [L, K, N]`` in place, at the layer index it reads inside the kernel (as
:mod:`ftjax.kernels.moe_decode` reads the slot pool at a slot id), so the only HBM traffic is the
one pass over the layer's matrix that the product needs.

Kernel: grid (N / block_n, k_split). Program (j, part) owns output columns
``[j*block_n, (j+1)*block_n)`` and the input rows ``part``-th share of K; it steps over its rows
``block_k`` at a time, loads the ``[block_k, block_n]`` weight tile once and, for each of the M
(<= 16) rows of x, accumulates ``sum(x[m, rows, None] * tile, axis=0)`` in float32. With
``k_split == 1`` it writes the result in the output dtype; otherwise each part writes float32
partial sums ``[k_split, M, N]`` that are added up in float32 outside the kernel and then cast
(so a split changes only the float32 summation order). Tiles come from the engine's kernel config
(``KernelConfig.tiles``, entry ``dense_decode``: block_k, block_n, num_warps, k_split; :func:`tiles`),
else the module defaults: block_k 64, block_n 128, Triton's default warps (block_k 128 and 8 warps for one-row
calls of K >= 1024: :data:`ONE_ROW_TILES`), and k_split
:func:`auto_k_split` (the smallest power of two giving at least :data:`MIN_PROGRAMS` programs:
8 for wq [2048, 4096] of qwen3-30b-a3b, 16 for wo [4096, 2048], 32 for wk / wv [2048, 512] and the
router [2048, 128], whose K allows no more).

GEMV form: broadcast-multiply + column reductions, one x row at a time against the shared weight
tile, not ``dot``. Decode at batch 1 is bandwidth-bound (each weight element is used M times), so
the multiply unit hardly matters; Triton's ``dot`` needs 16 rows (x would be padded with zero
rows) and on the GPU runs float32 operands as TF32 whatever the matmul precision says, while the
float32 oracle runs need full float32 (``common.dot_dtype_ok``). The per-row form is exact float32
arithmetic in every dtype and keeps the register tile at ``block_k * block_n`` whatever M is. Its
cost grows with M (M FMAs per weight element on the CUDA cores), so at 16 rows it nears the
compute bound; a ``dot`` variant for bf16 at 8-16 rows is left to measurement.

Backend choice: generic Pallas primitives only (whole-array refs indexed with ``pl.ds``, the layer
id read from a ref, ``lax.fori_loop``), so the kernel runs on the CPU in interpret mode
(``interpret=True``; the tests) and lowers on the GPU through Pallas' Triton backend (the default
GPU lowering of a ``pallas_call`` without Mosaic GPU compiler params in jax 0.11.2; deprecated but
shipped), as the other decode kernels do (``ftjax.kernels.common`` says more). Mosaic GPU's
TMA / warpgroup-matmul model wants 64-row tiles; this is a 1-to-16-row GEMV. Idea: the batched
GEMV ("skinny GEMM") decode kernels of LLM runtimes, here combined with the slot-id addressing of
the fused-MoE kernels (vLLM / SGLang): the weight chosen by an index inside the kernel instead of
a gathered copy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import common, registry

#: Default tiles (input rows per step, output columns per program); k_split 0 = :func:`auto_k_split`.
BLOCK_K, BLOCK_N, K_SPLIT = 64, 128, 0
#: Programs :func:`auto_k_split` aims for (an H200 has 132 SMs; more programs keep more loads in flight).
MIN_PROGRAMS = 256
#: Largest k_split :func:`auto_k_split` picks.
MAX_K_SPLIT = 32
#: Most rows the kernel takes (beyond that the GEMM of XLA / cuBLAS is the better tool).
MAX_ROWS = 16
#: Weight dtypes for which ``use="auto"`` runs both kernels (:func:`dense_decode` and
#: :func:`norm_dense_decode`) on a GPU (:func:`auto_for`): the 16-bit ones, where they were measured
#: faster (docs/PROFILE.md). Float32 programs keep XLA's GEMMs, as ``decode_gemm`` does (the float32
#: oracle runs on the GPU were settled on them).
AUTO_DTYPES = ("bfloat16", "float16")
WEIGHT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def auto_for(dtype) -> bool:
    """Whether ``use="auto"`` picks the kernels for weights of ``dtype`` on a GPU
    (:data:`AUTO_DTYPES`; ``registry.mode``'s ``auto``)."""
    return jnp.dtype(dtype).name in AUTO_DTYPES


def supported(x: jax.Array, w: jax.Array, block_k: int = BLOCK_K, block_n: int = BLOCK_N, k_split: int = 1) -> bool:
    """True when the kernel handles these operands: x [M, K] float with 1 <= M <= :data:`MAX_ROWS`,
    w [L, K, N] of a dtype in :data:`WEIGHT_DTYPES` with L >= 1, power-of-two tiles
    (``min(block_k, K)``, ``min(block_n, N)``) dividing N and, times k_split, K. Other shapes are
    not padded: the caller falls back to its jnp path (``x @ w[layer]``)."""
    if x.ndim != 2 or w.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating) or k_split < 1:
        return False
    if w.dtype not in [jnp.dtype(d) for d in WEIGHT_DTYPES]:
        return False
    (m, k), (nl, kw, n) = x.shape, w.shape
    if not (1 <= m <= MAX_ROWS) or nl < 1 or kw != k or k < 1 or n < 1:
        return False
    bk, bn = min(block_k, k), min(block_n, n)
    return common.pow2(bk) and common.pow2(bn) and k % (bk * k_split) == 0 and n % bn == 0


def _kernel(layer_ref, x_ref, *refs, bk, split, cols, eps, xn_dtype, write_x, merge, offset=False):
    """cols: per weight (its first column block on grid axis 0, its column blocks, its first output
    column, its column tile: ``min(block_n, N_i)``, so a narrow weight does not shrink the others' tiles).
    eps None: x is used as is; else the rows are RMS-normalised first (refs[0]: the norm
    weight [K]) exactly as ``model.rms_norm``: float32 statistics, cast to x's dtype, times the weight
    in ``xn_dtype``; with ``offset`` as ``layers.common.rms_norm_offset`` (zero-centred weights): the
    float32 normalised rows times ``1 + weight`` in float32, cast to x's dtype (= ``xn_dtype``); write_x: the
    programs of column block 0 also write those rows (the last ref). layer_ref: the weights' layer id, then, where
    it holds two, the stacked norm weight's own row (a layer kind's weights are indexed by the kind's layers,
    the norm by all layers).
    merge (g, hd): x_ref holds decode attention's unmerged splits (o [M, Hkv, n_split, rows, hd]) and
    the first two refs their m, l; the input rows are the splits merged by log-sum-exp as
    ``decode_attention.merge_splits`` does, cast to ``xn_dtype`` (a K block lies within one head)."""
    if merge is not None:
        ms_ref, ls_ref, *refs = refs
    norm = eps is not None
    g_ref = refs[0] if norm else None
    w_refs = refs[int(norm):int(norm) + len(cols)]
    o_ref = refs[int(norm) + len(cols)]
    j, part = pl.program_id(0), pl.program_id(1)
    layer = common.wrap_clamp(layer_ref[0], w_refs[0].shape[0])
    norm_layer = layer if layer_ref.shape[0] == 1 or not norm else common.wrap_clamp(layer_ref[1], g_ref.shape[0])
    m, k = x_ref.shape if merge is None else (x_ref.shape[0], x_ref.shape[1] * merge[0] * merge[1])
    k_steps = k // (bk * split)
    base = part * (k_steps * bk)  # this program's share of the input rows
    f32 = jnp.float32

    if norm:  # every program needs the whole rows' mean square (K elements each: cheap next to the weights)
        def squares(i, acc):
            return tuple(a + jnp.square(x_ref[r, pl.ds(i * bk, bk)].astype(f32)) for r, a in enumerate(acc))
        sums = lax.fori_loop(0, k // bk, squares, (jnp.zeros((bk,), f32),) * m)
        inv = [lax.rsqrt(jnp.sum(s) / k + eps) for s in sums]

    def merged_rows(k0):  # query head k0 // hd, its columns [k0 % hd, + bk), every split folded in
        g, hd = merge
        ns = x_ref.shape[2]
        qh = k0 // hd
        kv, r, d0 = qh // g, qh % g, k0 % hd
        out = []
        for b in range(m):
            mx = ms_ref[b, kv, pl.ds(0, ns), r]
            w = jnp.exp(mx - jnp.max(mx))
            num = jnp.sum(w[:, None] * x_ref[b, kv, pl.ds(0, ns), r, pl.ds(d0, bk)], axis=0)
            out.append((num / jnp.sum(w * ls_ref[b, kv, pl.ds(0, ns), r])).astype(xn_dtype))
        return out

    def rows(k0):  # the m input rows at [k0, k0 + bk), in the dtype the product takes
        if merge is not None:
            return merged_rows(k0)
        if not norm:
            return [x_ref[r, pl.ds(k0, bk)] for r in range(m)]
        g = (g_ref[norm_layer, pl.ds(k0, bk)] if len(g_ref.shape) == 2 else g_ref[pl.ds(k0, bk)]).astype(f32)
        if offset:
            return [(x_ref[r, pl.ds(k0, bk)].astype(f32) * inv[r] * (1.0 + g)).astype(x_ref.dtype).astype(xn_dtype)
                    for r in range(m)]
        return [(g * (x_ref[r, pl.ds(k0, bk)].astype(f32) * inv[r]).astype(x_ref.dtype).astype(f32)).astype(xn_dtype)
                for r in range(m)]

    def product(w_ref, b0, off, bn):
        n0 = (j - b0) * bn

        def body(i, acc):
            k0 = base + i * bk
            tile = w_ref[layer, pl.ds(k0, bk), pl.ds(n0, bn)].astype(f32)  # read once, used by every row
            return tuple(a + jnp.sum(xr.astype(f32)[:, None] * tile, axis=0) for xr, a in zip(rows(k0), acc))

        acc = lax.fori_loop(0, k_steps, body, (jnp.zeros((bn,), f32),) * m)
        for r, a in enumerate(acc):
            if split == 1:
                o_ref[r, pl.ds(off + n0, bn)] = a.astype(o_ref.dtype)
            else:
                o_ref[part, r, pl.ds(off + n0, bn)] = a

    if len(cols) == 1:
        product(w_refs[0], 0, 0, cols[0][3])
    else:  # each column block belongs to one weight
        for w_ref, (b0, nb, off, wbn) in zip(w_refs, cols):
            pl.when((j >= b0) & (j < b0 + nb))(functools.partial(product, w_ref, b0, off, wbn))

    if write_x:
        xo_ref = refs[-1]

        @pl.when(j == 0)
        def _():
            def store(i, c):
                k0 = base + i * bk
                for r, xr in enumerate(rows(k0)):
                    xo_ref[r, pl.ds(k0, bk)] = xr
                return c
            lax.fori_loop(0, k_steps, store, 0)


def normed_dtype(x_dtype, w_dtype, offset: bool) -> jnp.dtype:
    """The dtype of an RMSNorm's output (``layers.common``): x's for a zero-centred norm (``rms_norm_offset``
    casts back to it), else x's promoted with the weight's (``rms_norm`` multiplies by the weight)."""
    return jnp.dtype(x_dtype) if offset else jnp.result_type(w_dtype, x_dtype)


def _call(x, ws, layer, norm_w, eps, write_x, interpret, block_k, block_n, num_warps, k_split, sum_parts=True,
          splits=None, offset=False, norm_layer=None):
    """One kernel launch for ``[x' @ w[layer] for w in ws]`` (x' = x, or RMSNorm(x) when eps is set);
    returns (the products, in ``jnp.result_type(x', w)``, the normalised rows or None). sum_parts
    False: the products are one array of the K-split parts instead (:func:`norm_dense_decode`).
    splits (m, l, g, dtype): x is decode attention's unmerged o, x' its merge (:func:`merge_dense_decode`).
    offset: the norm's weights are zero-centred (``layers.common.rms_norm_offset``; x' in x's dtype).
    norm_layer: the row of a stacked norm weight [L_n, K] where it is not ``layer`` (None: ``layer``)."""
    if splits is None:
        m, k = x.shape
        xn_dtype = x.dtype if eps is None else normed_dtype(x.dtype, norm_w.dtype, offset)
    else:
        m, k = x.shape[0], x.shape[1] * splits[2] * x.shape[4]
        xn_dtype = jnp.dtype(splits[3])
    out_dtype = jnp.result_type(xn_dtype, ws[0].dtype)
    lid = jnp.asarray(layer, jnp.int32).reshape(1)  # wrapped and clamped inside the kernel
    if norm_layer is not None and eps is not None and norm_w.ndim == 2:
        lid = jnp.concatenate([lid, jnp.asarray(norm_layer, jnp.int32).reshape(1)])
    bk = min(block_k, k)
    cols, b0, off = [], 0, 0
    for w in ws:  # each weight its own column tile, min(block_n, N_i)
        bn = min(block_n, w.shape[2])
        cols.append((b0, w.shape[2] // bn, off, bn))
        b0, off = b0 + w.shape[2] // bn, off + w.shape[2]
    params = common.triton_params(interpret, num_warps)
    out_shape = [jax.ShapeDtypeStruct((m, off), out_dtype) if k_split == 1
                 else jax.ShapeDtypeStruct((k_split, m, off), jnp.float32)]
    if write_x:
        out_shape.append(jax.ShapeDtypeStruct((m, k), xn_dtype))
    operands = (lid, x) + (tuple(splits[:2]) if splits else ()) + ((norm_w,) if eps is not None else ()) + tuple(ws)
    merge = None if splits is None else (splits[2], x.shape[4])
    outs = pl.pallas_call(
        functools.partial(_kernel, bk=bk, split=k_split, cols=tuple(cols), eps=eps, xn_dtype=xn_dtype,
                          write_x=write_x, merge=merge, offset=offset),
        out_shape=tuple(out_shape), grid=(b0, k_split), interpret=interpret, compiler_params=params,
        name="norm_dense_decode" if eps is not None else "merge_dense_decode" if splits else "dense_decode",
    )(*operands)
    if not sum_parts:
        return [outs[0] if k_split > 1 else outs[0][None]], (outs[1] if write_x else None)
    y = outs[0] if k_split == 1 else jnp.sum(outs[0], axis=0).astype(out_dtype)
    ys, at = [], 0
    for w in ws:
        ys.append(y[:, at:at + w.shape[2]])
        at += w.shape[2]
    return ys, (outs[1] if write_x else None)


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "block_n", "num_warps", "k_split"))
def dense_decode(x: jax.Array, w: jax.Array, layer: jax.Array, *, interpret: bool = False, block_k: int = BLOCK_K,
                 block_n: int = BLOCK_N, num_warps: int | None = None, k_split: int = 1) -> jax.Array:
    """``x @ w[layer]`` [M, N] in ``jnp.result_type(x, w)``, float32 accumulation, w read in place.

    x: [M, K] float, 1 <= M <= 16; w: [L, K, N] bf16 / f16 / f32 (the weight stacked over layers);
    layer: int32 [] (negative ids wrap and out-of-range ids clamp, as ``w[layer]`` in jnp does).
    interpret: Pallas interpret mode (CPU). block_k / block_n: input rows per step and output
    columns per program (powers of two; capped at K and N); num_warps: Triton's (None: its
    default); k_split: K is split over this many programs whose float32 partial sums are added up
    in float32 outside the kernel before the cast.

    Raises:
      ValueError: operands or tiles that :func:`supported` rejects.
    """
    if not supported(x, w, block_k, block_n, k_split):
        raise ValueError(f"dense_decode: unsupported operands or tiles (x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, "
                         f"block_k={block_k} block_n={block_n} k_split={k_split})")
    (y,), _ = _call(x, (w,), layer, None, None, False, interpret, block_k, block_n, num_warps, k_split)
    return y


def dense_decode_reference(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """The jnp reference of :func:`dense_decode`: ``w[layer]`` sliced, the product accumulated in
    float32 at full precision, cast to ``jnp.result_type(x, w)``. x: [..., K]; w: [L, K, N]."""
    out = jnp.result_type(x.dtype, w.dtype)
    y = jnp.matmul(x.astype(jnp.float32), w[layer].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return y.astype(out)


def _norm_shape_ok(norm_w, x, ws, own_row: bool = False) -> bool:
    """norm_w [K], or stacked [L, K] over the weights' L layers (any count where it is read at its own row)."""
    k = x.shape[-1]
    if not ws:
        return False
    return tuple(norm_w.shape) == (k,) or (norm_w.ndim == 2 and norm_w.shape[1] == k
                                           and (own_row or norm_w.shape[0] == ws[0].shape[0]))


@functools.partial(jax.jit, static_argnames=("eps", "write_x", "interpret", "block_k", "block_n", "num_warps",
                                             "k_split", "sum_parts", "offset"))
def norm_dense_decode(x: jax.Array, norm_w: jax.Array, ws: tuple[jax.Array, ...], layer: jax.Array, *, eps: float,
                      write_x: bool = False, interpret: bool = False, block_k: int = BLOCK_K, block_n: int = BLOCK_N,
                      num_warps: int | None = None, k_split: int = 1, sum_parts: bool = True,
                      offset: bool = False, norm_layer: jax.Array | None = None) -> tuple[list[jax.Array],
                                                                                         jax.Array | None]:
    """RMSNorm of the rows, then their products with several stacked weights, in one launch:
    ``[rms_norm(x) @ w[layer] for w in ws]``.

    What a decoder layer of a decode step starts its attention block (the input norm, then wq, wk,
    wv) and its MoE block (the norm, then the router) with: one kernel instead of a norm's reduce
    and multiply, one launch per weight and one float32 sum per weight (H200 profile, 48 layers,
    batch 1: each of those ~1-3 us kernels costs as much as 2-8 MB of weight reads). Each program
    recomputes the rows' mean square (K elements per row) before its share of the product.

    x: [M, K] float, 1 <= M <= 16; norm_w: [K], or [L, K] stacked over layers (read at ``layer`` in
    the kernel: no per-layer slice copied out of a layer scan's xs first); ws: weights [L, K, N_i]
    of one dtype, L and K;
    layer: int32 []; eps: the norm's epsilon. The normalised rows are ``model.rms_norm``'s:
    float32 x times rsqrt(mean(x^2) + eps), cast to x's dtype, times norm_w, in
    ``jnp.result_type(norm_w, x)`` (the mean's float32 sum in another order, so one bf16 ulp at
    most apart). Returns ([M, N_i] in ``jnp.result_type(x', w)`` per weight, the normalised rows
    [M, K] when ``write_x`` (written by the programs of the first column block), else None).
    Tiles as :func:`dense_decode` (block_n capped at each N_i for its own column blocks; k_split over K).
    sum_parts False: the products come back unsummed, as one array [k_split, M, sum N_i] of float32
    partial sums (k_split > 1) or [1, M, sum N_i] in the products' dtype (the columns of ws in order),
    for a consumer that adds them up itself (``ftjax.kernels.rope_cache``: one XLA kernel less).
    offset: the norm of the Qwen3.5 / Qwen3-Next family (zero-centred weights, ``layers.common.rms_norm_offset``):
    the float32 normalised rows times ``1 + norm_w`` in float32, cast to x's dtype; the products then in
    ``jnp.result_type(x, w)``. What a hybrid decode layer starts its Gated DeltaNet mixer (the norm, then
    w_qkv, w_z, w_b, w_a), its gated attention and its MoE router with.
    norm_layer: int32 [], the row of a stacked norm_w [L_n, K] when it is not ``layer`` (a hybrid layer kind's
    weights are stacked over that kind's layers, its norm over all of them); None: ``layer``.

    Raises:
      ValueError: operands or tiles that :func:`supported_all` rejects, or norm_w neither [K] nor [L, K] (L the
        weights' layer count where ``norm_layer`` is None).
    """
    ws = tuple(ws)
    if not supported_all(x, ws, block_k, block_n, k_split) or \
            not _norm_shape_ok(norm_w, x, ws, own_row=norm_layer is not None):
        raise ValueError(f"norm_dense_decode: unsupported operands or tiles (x {x.shape} {x.dtype}, norm_w "
                         f"{norm_w.shape}, ws {[(w.shape, str(w.dtype)) for w in ws]}, block_k={block_k} "
                         f"block_n={block_n} k_split={k_split})")
    return _call(x, ws, layer, norm_w, eps, write_x, interpret, block_k, block_n, num_warps, k_split, sum_parts,
                 offset=offset, norm_layer=norm_layer)


def norm_dense_decode_reference(x: jax.Array, norm_w: jax.Array, ws, layer: jax.Array, eps: float,
                                offset: bool = False, norm_layer=None) -> tuple[list[jax.Array], jax.Array]:
    """The jnp reference of :func:`norm_dense_decode`: ``model.rms_norm``'s arithmetic (``rms_norm_offset``'s
    where ``offset``), then :func:`dense_decode_reference` per weight; a stacked norm weight [L, K] is read at
    ``layer`` (``norm_layer`` where given). Returns (the products, the normalised rows)."""
    if norm_w.ndim == 2:
        norm_w = norm_w[layer if norm_layer is None else norm_layer]
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    xn = (y * (1.0 + norm_w.astype(jnp.float32))).astype(x.dtype) if offset else norm_w * y.astype(x.dtype)
    return [dense_decode_reference(xn, w, layer) for w in ws], xn


def supported_merge(o: jax.Array, m: jax.Array, l: jax.Array, w: jax.Array, g: int, dtype, block_k: int = BLOCK_K,
                    block_n: int = BLOCK_N, k_split: int = 1) -> bool:
    """:func:`supported` for :func:`merge_dense_decode`: o float32 [B, Hkv, n_split, rows, hd], m and l
    float32 [B, Hkv, n_split, rows], 1 <= g <= rows, n_split a power of two, the K tile
    ``min(block_k, K)`` (K = Hkv * g * hd) dividing hd (a tile lies within one head), and the product
    of [B, K] rows of ``dtype`` with w as :func:`supported` takes it."""
    f32 = jnp.dtype(jnp.float32)
    if getattr(o, "ndim", 0) != 5 or any(a.dtype != f32 for a in (o, m, l)):
        return False
    b, hkv, ns, rows, hd = o.shape
    if m.shape != (b, hkv, ns, rows) or l.shape != m.shape or not (1 <= g <= rows) or not common.pow2(ns):
        return False
    k = hkv * g * hd
    x = jax.ShapeDtypeStruct((b, k), dtype)
    return hd % min(block_k, k) == 0 and supported(x, w, block_k, block_n, k_split)


@functools.partial(jax.jit, static_argnames=("g", "dtype", "interpret", "block_k", "block_n", "num_warps", "k_split"))
def merge_dense_decode(o: jax.Array, m: jax.Array, l: jax.Array, w: jax.Array, layer: jax.Array, *, g: int, dtype,
                       interpret: bool = False, block_k: int = BLOCK_K, block_n: int = BLOCK_N,
                       num_warps: int | None = None, k_split: int = 1) -> jax.Array:
    """Decode attention's output projection with the attention's split merge in its prologue:
    ``decode_attention.merge_splits(o, m, l, g, dtype).reshape(B, -1) @ w[layer]`` in one launch.

    Why: FlashDecoding's merge of the key splits ran as three small XLA kernels per layer between
    the attention kernel and the wo kernel (H200 trace: each ~1-2 us plus a launch gap,
    for ~0.5 MB of float32 partials). Here each program of the wo product merges the heads its K
    rows belong to (exp(m_s - max m), weighted sums over the splits, in float32) before its share of
    the GEMV; the merged rows are never written out.

    o: float32 [B, Hkv, n_split, rows, hd] (unnormalised split outputs; B <= 16); m, l: float32
    [B, Hkv, n_split, rows] (``decode_attention.grouped(..., merged=False)``); w: [L, Hkv * g * hd, N];
    layer: int32 []; g: query heads per KV head (rows >= g; the pad rows are not read); dtype: the
    attention output's dtype (the merge is cast to it before the product, as the model's path does).
    Returns [B, N] in ``jnp.result_type(dtype, w)``. Tiles as :func:`dense_decode`.

    Raises:
      ValueError: operands or tiles that :func:`supported_merge` rejects.
    """
    if not supported_merge(o, m, l, w, g, dtype, block_k, block_n, k_split):
        raise ValueError(f"merge_dense_decode: unsupported operands or tiles (o {o.shape} {o.dtype}, m {m.shape}, "
                         f"l {l.shape}, w {w.shape} {w.dtype}, g={g}, block_k={block_k} block_n={block_n} "
                         f"k_split={k_split})")
    (y,), _ = _call(o, (w,), layer, None, None, False, interpret, block_k, block_n, num_warps, k_split,
                    splits=(m, l, g, dtype))
    return y


def parse_tiles(vals: tuple[int, ...]) -> dict:
    """A ``KernelConfig.tiles`` override of these kernels, (block_k, block_n, num_warps, k_split), as keyword
    arguments (num_warps 0 = Triton's default, k_split 0 = :func:`auto_k_split`).
    Raises:
      ValueError: not four integers, block_k / block_n not powers of two, num_warps neither 0 nor a power
        of two, negative k_split."""
    bk, bn, nw, ks = common.tile_values("dense_decode", vals, (4,), "four integers block_k,block_n,num_warps,k_split")
    if not (common.pow2(bk) and common.pow2(bn)) or min(nw, ks) < 0 or (nw and not common.pow2(nw)):
        raise ValueError(f"tiles of kernel 'dense_decode' {tuple(vals)}: block_k and block_n must be powers of two "
                         ">= 1, num_warps a power of two or 0, k_split >= 0 (0: the default)")
    return {"block_k": bk, "block_n": bn, "num_warps": nw or None, "k_split": ks}


#: Tiles of one-row calls (batch-1 decode) where the kernel config sets none: 128-row steps and 8 warps. On an H100
#: (2026-12-05, the 16-layer qwen3.5-35b-a3b cut, ``profile_step.py``) they took the batch-1 steps run back to back
#: from 2.196 to 2.105 ms, but a 4-row step from 3.835 to 4.048 ms, so only one-row calls take them.
ONE_ROW_TILES = {"block_k": 128, "num_warps": 8}
#: The smallest K that takes :data:`ONE_ROW_TILES` (measured at K 2048 and 4096; a small K would lose K-split parts).
ONE_ROW_MIN_K = 1024


def tiles(rows: int | None = None, k: int | None = None) -> dict:
    """The tiles the model's calls of ``rows`` input rows of width ``k`` use: the active kernel config's
    ``dense_decode`` override (:func:`parse_tiles`; it applies to :func:`norm_dense_decode` and
    :func:`merge_dense_decode` too), else the module defaults, with :data:`ONE_ROW_TILES` for one row of
    K >= :data:`ONE_ROW_MIN_K`."""
    defaults = {"block_k": BLOCK_K, "block_n": BLOCK_N, "num_warps": None, "k_split": K_SPLIT}
    if rows == 1 and (k or 0) >= ONE_ROW_MIN_K:
        defaults.update(ONE_ROW_TILES)
    return registry.tiles("dense_decode", defaults)


def auto_k_split(k: int, n: int, block_k: int, block_n: int) -> int:
    """The smallest power-of-two k_split (at most :data:`MAX_K_SPLIT`) giving at least
    :data:`MIN_PROGRAMS` programs, within what K allows (parts of whole block_k steps); 1 when the
    N blocks alone are enough."""
    programs = n // max(min(block_n, n), 1)
    rows = max(min(block_k, k), 1)
    split = 1
    while programs * split < MIN_PROGRAMS and split < MAX_K_SPLIT and k % (rows * split * 2) == 0:
        split *= 2
    return split


def supported_all(x: jax.Array, ws, block_k: int = BLOCK_K, block_n: int = BLOCK_N, k_split: int = 1) -> bool:
    """:func:`supported` for one launch over several weights ``ws`` (each [L, K, N_i], one L, K and
    dtype), each with its own column tile ``min(block_n, N_i)``."""
    ws = tuple(ws)
    if not ws or any(getattr(w, "ndim", 0) != 3 for w in ws):
        return False
    if len({(w.shape[0], w.shape[1], jnp.dtype(w.dtype)) for w in ws}) != 1:
        return False
    return all(supported(x, w, block_k, block_n, k_split) for w in ws)


def plan(x: jax.Array, w, name: str = "dense_decode", auto: bool | None = None,
         record: bool = True) -> tuple[str, dict]:
    """(mode, tiles) of a model call of ``x @ w[layer]`` with x [..., K] and w [L, K, N] (or a tuple
    of such weights, one launch for all: :func:`norm_dense_decode`): mode "gpu" / "interpret" when
    the kernel config selects kernel ``name`` for these operands (at most :data:`MAX_ROWS` rows;
    ``registry.mode``; under ``auto`` only where ``auto`` says, default :func:`auto_for` the weights' dtype),
    else "xla". record: ``registry.mode``'s (False where the caller checks more before the kernel runs).
    The default k_split is :func:`auto_k_split` of the weights' summed N.

    Raises:
      ValueError: tiles set in the kernel config that do not fit operands the default tiles fit, while the
        kernel is selected.
    """
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    auto = auto_for(ws[0].dtype) if auto is None else auto
    x2 = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    for rows in dict.fromkeys((x2.shape[0], None)):  # a one-row call's tiles, else the defaults where they do not fit
        t = tiles(rows, x.shape[-1])
        if t["k_split"] == 0:
            t["k_split"] = auto_k_split(x.shape[-1], sum(v.shape[-1] for v in ws), t["block_k"], t["block_n"])
        ok = supported_all(x2, ws, t["block_k"], t["block_n"], t["k_split"])
        if ok or registry.tiles_overridden("dense_decode"):
            break
    if not ok and registry.tiles_overridden("dense_decode") and supported_all(x2, ws, BLOCK_K, BLOCK_N, 1) \
            and registry.mode(name, True, auto=auto) != "xla":
        # a tile sweep must not time XLA's GEMMs under the kernel's name
        raise ValueError(f"dense_decode tiles {t} do not fit x {x2.shape} @ w "
                         f"{[tuple(v.shape) for v in ws]} (K must be a multiple of min(block_k, K) * k_split, "
                         "each N of min(block_n, N))")
    return registry.mode(name, ok, auto=auto, record=record), t


def maybe(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array | None:
    """The kernel's ``x @ w[layer]`` ([..., N]) when :func:`plan` selects it, else None (the caller
    runs its jnp path). x: [..., K] with at most 16 rows; w: [L, K, N]; layer: int32 []."""
    how, t = plan(x, w)
    if how == "xla":
        return None
    rows = x.reshape(-1, x.shape[-1])
    y = dense_decode(rows, w, layer, interpret=how == "interpret", **t)
    return y.reshape(*x.shape[:-1], w.shape[-1])


def maybe_norm(x: jax.Array, norm_w: jax.Array, eps: float, ws, layer: jax.Array, write_x: bool = False,
               sum_parts: bool = True, offset: bool = False,
               norm_layer: jax.Array | None = None) -> tuple[list[jax.Array], jax.Array | None] | None:
    """:func:`norm_dense_decode` of a model call when the kernel config selects ``norm_dense_decode``
    for these operands (:func:`plan`; under ``auto``: :func:`auto_for`), else None (the caller
    runs ``model.rms_norm`` and its projections). x: [..., K] with at most 16 rows; norm_w: [K] or [L, K];
    ws: weights [L, K, N_i]; layer: int32 []. Returns ([..., N_i] per weight, the normalised rows
    [..., K] when ``write_x``, else None); with ``sum_parts`` False the products are
    :func:`norm_dense_decode`'s unsummed parts, [parts, rows, sum N_i] (rows = x's rows flattened).
    offset: a zero-centred norm (:func:`norm_dense_decode`), which ``auto`` runs only where :data:`OFFSET_AUTO`;
    norm_layer: the row of a stacked norm_w where it is not ``layer``."""
    auto = norm_auto(ws[0].dtype, offset)
    how, t = plan(x, tuple(ws), "norm_dense_decode", auto=auto, record=False)
    if how == "xla" or not _norm_shape_ok(norm_w, x, tuple(ws), own_row=norm_layer is not None):
        return None
    registry.mode("norm_dense_decode", True, auto=auto)  # recorded as applied only now that it runs
    lead = x.shape[:-1]
    ys, xn = norm_dense_decode(x.reshape(-1, x.shape[-1]), norm_w, tuple(ws), layer, eps=float(eps), write_x=write_x,
                               interpret=how == "interpret", sum_parts=sum_parts, offset=offset,
                               norm_layer=norm_layer, **t)
    if not sum_parts:
        return ys, (None if xn is None else xn.reshape(x.shape))
    return [y.reshape(*lead, y.shape[-1]) for y in ys], (None if xn is None else xn.reshape(x.shape))


#: Whether ``use="auto"`` runs :func:`norm_dense_decode` for a zero-centred norm (``offset``: the Qwen3.5 family's
#: decode layers) on a GPU. Yes: on an H100 (2026-12-05, 0a3c039; the 16-layer qwen3.5-35b-a3b cut, batch 1) it
#: took resident decode from 350.9 to 369.0 tok/s in one process (``bench_gated_delta.py``'s auto vs
#: auto+offset-norms) and from 375.0 to 395.5 / 398.6 tok/s on the side-by-side shape (``bench_decode_speed.py``);
#: its logits are within float32 tolerance of the default path's (tests/test_dense_decode.py).
OFFSET_AUTO = True


def norm_auto(dtype, offset: bool) -> bool:
    """Whether ``use="auto"`` picks ``norm_dense_decode`` on a GPU for weights of ``dtype`` and a norm that is
    zero-centred (``offset``) or not: :func:`auto_for`, and :data:`OFFSET_AUTO` for a zero-centred one."""
    return auto_for(dtype) and (OFFSET_AUTO or not offset)


#: Whether ``use="auto"`` runs :func:`merge_dense_decode` on a GPU (16-bit weights), for calls of at most
#: :data:`MERGE_AUTO_MAX_ROWS` rows. Yes for one row since 2026-12-07: under the fixed decode loop on an H100
#: (``bench_decode_loop.py --kernels=auto --kernels=auto+merge_dense_decode``, one process) it took qwen3-30b-a3b's
#: resident batch-1 decode 1.018-1.036x at 16 layers (6e261d4) and 1.036x at 48 (430961d), but batch 4 0.985x at
#: both, and its cached batch-1 decode at 280 slots was 44.69 tok/s against 44.61 / 44.63 without it (430961d; the
#: 0.6-1.2 ms a cached step it cost on 2026-12-02 was before the fixed loop). Resident and cached programs of one
#: batch take it alike, so cached = resident bit for bit still holds (docs/PROFILE.md).
MERGE_AUTO = True
#: The most rows (decode batch) a call may have for ``auto`` to pick :func:`merge_dense_decode`.
MERGE_AUTO_MAX_ROWS = 1


def merge_auto(dtype, rows: int) -> bool:
    """Whether ``use="auto"`` picks :func:`merge_dense_decode` on a GPU for wo weights of ``dtype`` and a call of
    ``rows`` rows (the decode batch): :func:`auto_for`, :data:`MERGE_AUTO`, at most :data:`MERGE_AUTO_MAX_ROWS`."""
    return MERGE_AUTO and auto_for(dtype) and rows <= MERGE_AUTO_MAX_ROWS


def maybe_merge(o: jax.Array, m: jax.Array, l: jax.Array, g: int, dtype, w: jax.Array,
                layer: jax.Array) -> jax.Array | None:
    """:func:`merge_dense_decode` ([B, N]) of a model call when the kernel config selects
    ``merge_dense_decode`` for these operands (:func:`plan`, the rows [B, Hkv * g * hd] of ``dtype``;
    under ``auto``: :func:`merge_auto`, one row) and :func:`supported_merge` takes them, else None (the
    caller merges with ``decode_attention.merge_splits`` and projects)."""
    x = jax.ShapeDtypeStruct((o.shape[0], o.shape[1] * g * o.shape[4]), dtype)
    auto = merge_auto(w.dtype, o.shape[0])
    how, t = plan(x, w, "merge_dense_decode", auto=auto, record=False)
    t["block_k"] = min(t["block_k"], o.shape[4])  # a K tile within one head (halving keeps k_split's fit)
    if how == "xla" or not supported_merge(o, m, l, w, g, dtype, t["block_k"], t["block_n"], t["k_split"]):
        return None
    registry.mode("merge_dense_decode", True, auto=auto)  # recorded as applied only now that it runs
    return merge_dense_decode(o, m, l, w, layer, g=g, dtype=jnp.dtype(dtype), interpret=how == "interpret", **t)


registry.register(registry.Kernel(
    "dense_decode", "ftjax.kernels.dense_decode.dense_decode_reference",
    "a decode step's dense projections (wq, wk, wv, wo, router) read from weights stacked over layers, "
    f"at most {MAX_ROWS} rows; auto: GPU, 16-bit weights", tiles=parse_tiles))
registry.register(registry.Kernel(
    "norm_dense_decode", "ftjax.kernels.dense_decode.norm_dense_decode_reference",
    "a decode step's RMSNorm and the projections after it (input norm + wq/wk/wv, MoE norm + router, a Gated "
    "DeltaNet layer's norm + its four input projections) in one launch; auto: GPU, 16-bit weights, plain and "
    "zero-centred norms (OFFSET_AUTO)", tiles=parse_tiles))
registry.register(registry.Kernel(
    "merge_dense_decode", "ftjax.kernels.decode_attention.merge_splits then x @ wo[layer]",
    "the wo projection with decode attention's key-split merge in its prologue, after rope_cache; auto: GPU, "
    "16-bit weights, one-row calls (MERGE_AUTO_MAX_ROWS)",
    auto=MERGE_AUTO, needs=("rope_cache", "decode_attention"), tiles=parse_tiles))
