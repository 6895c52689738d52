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
(so a split changes only the float32 summation order). Tiles come from
``FTJAX_DENSE_DECODE_TILES="block_k,block_n,num_warps,k_split"`` (trace time; :func:`tiles`),
else the module defaults: block_k 64, block_n 128, Triton's default warps, and k_split
:func:`auto_k_split` (the smallest power of two giving at least :data:`MIN_PROGRAMS` programs:
8 for wq [2048, 4096] of qwen3-30b-a3b, 16 for wo [4096, 2048], 32 for wk / wv [2048, 512] and the
router [2048, 128], whose K allows no more).

GEMV form: broadcast-multiply + column reductions, one x row at a time against the shared weight
tile, not ``dot``. Decode at batch 1 is bandwidth-bound (each weight element is used M times), so
the multiply unit hardly matters; Triton's ``dot`` needs 16 rows (x would be padded with zero
rows) and on the GPU runs float32 operands as TF32 whatever the matmul precision says, while the
float32 oracle runs need full float32 (``select.dot_dtype_ok``). The per-row form is exact float32
arithmetic in every dtype and keeps the register tile at ``block_k * block_n`` whatever M is. Its
cost grows with M (M FMAs per weight element on the CUDA cores), so at 16 rows it nears the
compute bound; a ``dot`` variant for bf16 at 8-16 rows is left to measurement.

Backend choice: generic Pallas primitives only (whole-array refs indexed with ``pl.ds``, the layer
id read from a ref, ``lax.fori_loop``), so the kernel runs on the CPU in interpret mode
(``interpret=True``; the tests) and lowers on the GPU through Pallas' Triton backend (the default
GPU lowering of a ``pallas_call`` without Mosaic GPU compiler params in jax 0.11.2; deprecated but
shipped), as the other decode kernels do (``ftjax.kernels.select`` says more). Mosaic GPU's
TMA / warpgroup-matmul model wants 64-row tiles; this is a 1-to-16-row GEMV. Idea: the batched
GEMV ("skinny GEMM") decode kernels of LLM runtimes, here combined with the slot-id addressing of
the fused-MoE kernels (vLLM / SGLang): the weight chosen by an index inside the kernel instead of
a gathered copy.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import select

#: Default tiles (input rows per step, output columns per program); k_split 0 = :func:`auto_k_split`.
BLOCK_K, BLOCK_N, K_SPLIT = 64, 128, 0
#: Programs :func:`auto_k_split` aims for (an H200 has 132 SMs; more programs keep more loads in flight).
MIN_PROGRAMS = 256
#: Largest k_split :func:`auto_k_split` picks.
MAX_K_SPLIT = 32
#: Most rows the kernel takes (beyond that the GEMM of XLA / cuBLAS is the better tool).
MAX_ROWS = 16
#: Whether ``FTJAX_KERNELS=auto`` runs the kernel on a GPU. Off: on the H200 (session 9,
#: docs/PROFILE.md) it took the resident batch-1 step of qwen3-30b-a3b from 7.53 to 7.06 ms, but the
#: cached step at 24 GB measured 33.0 ms with it against 13.1 ms without (another call, other miss
#: bytes; not traced, so not explained). Opt in with ``FTJAX_KERNELS=...,dense_decode``.
AUTO = False
WEIGHT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _pow2(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


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
    return _pow2(bk) and _pow2(bn) and k % (bk * k_split) == 0 and n % bn == 0


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, bk, bn, split):
    j, part = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    m = x_ref.shape[0]
    n0 = j * bn
    k_steps = x_ref.shape[1] // (bk * split)
    base = part * (k_steps * bk)  # this program's share of the input rows

    def body(i, acc):
        k0 = base + i * bk
        tile = w_ref[layer, pl.ds(k0, bk), pl.ds(n0, bn)].astype(jnp.float32)  # read once, used by every row
        return tuple(a + jnp.sum(x_ref[r, pl.ds(k0, bk)].astype(jnp.float32)[:, None] * tile, axis=0)
                     for r, a in enumerate(acc))

    acc = lax.fori_loop(0, k_steps, body, (jnp.zeros((bn,), jnp.float32),) * m)
    for r, a in enumerate(acc):
        if split == 1:
            o_ref[r, pl.ds(n0, bn)] = a.astype(o_ref.dtype)
        else:
            o_ref[part, r, pl.ds(n0, bn)] = a


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
    (m, k), (nl, _, n) = x.shape, w.shape
    out_dtype = jnp.result_type(x.dtype, w.dtype)
    lid = jnp.asarray(layer, jnp.int32).reshape(1)
    lid = jnp.clip(jnp.where(lid < 0, lid + nl, lid), 0, nl - 1)
    bk, bn = min(block_k, k), min(block_n, n)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        params = pltriton.CompilerParams(num_warps=num_warps)
    out_shape = (jax.ShapeDtypeStruct((m, n), out_dtype) if k_split == 1
                 else jax.ShapeDtypeStruct((k_split, m, n), jnp.float32))
    y = pl.pallas_call(
        functools.partial(_kernel, bk=bk, bn=bn, split=k_split), out_shape=out_shape, grid=(n // bn, k_split),
        interpret=interpret, compiler_params=params, name="dense_decode",
    )(lid, x, w)
    return y if k_split == 1 else jnp.sum(y, axis=0).astype(out_dtype)


def dense_decode_reference(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """The jnp reference of :func:`dense_decode`: ``w[layer]`` sliced, the product accumulated in
    float32 at full precision, cast to ``jnp.result_type(x, w)``. x: [..., K]; w: [L, K, N]."""
    out = jnp.result_type(x.dtype, w.dtype)
    y = jnp.matmul(x.astype(jnp.float32), w[layer].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return y.astype(out)


TILES_ENV = "FTJAX_DENSE_DECODE_TILES"


def tiles() -> dict:
    """The tiles the model's calls use: ``FTJAX_DENSE_DECODE_TILES="block_k,block_n,num_warps,k_split"``
    (read at trace time; num_warps 0 = Triton's default, k_split 0 = :func:`auto_k_split`), else the
    module defaults.

    Raises:
      ValueError: a malformed value (not four integers, block_k / block_n not powers of two,
        num_warps neither 0 nor a power of two, negative k_split).
    """
    vals = select.tile_ints(TILES_ENV, (4,), "four integers block_k,block_n,num_warps,k_split")
    if vals is None:
        return {"block_k": BLOCK_K, "block_n": BLOCK_N, "num_warps": None, "k_split": K_SPLIT}
    bk, bn, nw, ks = vals
    if not (_pow2(bk) and _pow2(bn)) or min(nw, ks) < 0 or (nw and not _pow2(nw)):
        raise ValueError(f"{TILES_ENV}={os.environ[TILES_ENV]!r}: block_k and block_n must be powers of two >= 1, "
                         "num_warps a power of two or 0, k_split >= 0 (0: the default)")
    return {"block_k": bk, "block_n": bn, "num_warps": nw or None, "k_split": ks}


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


def plan(x: jax.Array, w: jax.Array) -> tuple[str, dict]:
    """(mode, tiles) of a model call of ``x @ w[layer]`` with x [..., K] and w [L, K, N]: mode
    "gpu" / "interpret" when ``FTJAX_KERNELS`` selects the kernel for these operands (at most
    :data:`MAX_ROWS` rows; ``select.mode``, off under ``auto``: :data:`AUTO`), else "xla".

    Raises:
      ValueError: a malformed ``FTJAX_DENSE_DECODE_TILES`` or ``FTJAX_KERNELS``; tiles set in the
        variable that do not fit operands the default tiles fit, while the kernel is selected.
    """
    t = tiles()
    x2 = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    if t["k_split"] == 0:
        t["k_split"] = auto_k_split(x.shape[-1], w.shape[-1], t["block_k"], t["block_n"])
    ok = supported(x2, w, t["block_k"], t["block_n"], t["k_split"])
    if not ok and os.environ.get(TILES_ENV, "").strip() and supported(x2, w, BLOCK_K, BLOCK_N, 1) \
            and select.mode("dense_decode", True, auto=AUTO) != "xla":
        # a tile sweep must not time XLA's GEMMs under the kernel's name
        raise ValueError(f"{TILES_ENV}={os.environ[TILES_ENV]!r}: tiles {t} do not fit x {x2.shape} @ w "
                         f"{tuple(w.shape)} (K must be a multiple of min(block_k, K) * k_split, N of "
                         "min(block_n, N))")
    return select.mode("dense_decode", ok, auto=AUTO), t


def maybe(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array | None:
    """The kernel's ``x @ w[layer]`` ([..., N]) when :func:`plan` selects it, else None (the caller
    runs its jnp path). x: [..., K] with at most 16 rows; w: [L, K, N]; layer: int32 []."""
    how, t = plan(x, w)
    if how == "xla":
        return None
    rows = x.reshape(-1, x.shape[-1])
    y = dense_decode(rows, w, layer, interpret=how == "interpret", **t)
    return y.reshape(*x.shape[:-1], w.shape[-1])
