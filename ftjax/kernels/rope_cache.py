"""Decode attention's prologue in one launch: the q/k/v projections' K-split partial sums added
up, the per-head q/k RMSNorm, the rotary embedding, K and V written into the stacked KV cache at
each row's position, and q laid out as :mod:`ftjax.kernels.decode_attention` tiles it.

Why: in the H200 trace of a batch-1 resident decode step a layer ran,
between the fused input-norm + wq/wk/wv kernel (``dense_decode.norm_dense_decode``) and the
decode attention kernel, seven to nine small XLA kernels of 1-2 us plus a launch gap each: the
float32 sum of the projection's K-split partials, the q and k norms, RoPE, two cache writes
(dynamic-update-slice), the attention's zero padding of the query group and the copies of the
layer's q/k norm weights out of the scan's xs. Across 48 layers that was ~0.5 ms of a 6.7 ms step
whose HBM floor is 2.5 ms, for a few KB of data per layer.

Kernel: grid (B, Hkv, rows + 2), rows = the query tile of ``decode_attention`` (the GQA group G =
Hq / Hkv zero-padded to at least 16). Program (b, h, r): r < G rotates query head h*G + r into
``qg[b, h, r]``; G <= r < rows writes that pad row's zeros; r == rows rotates KV head h's key and
writes it into ``k_cache[layer, b, pos]``; r == rows + 1 writes the value into ``v_cache``. Each
head's two halves (the rotate-half layout of ``model.rope``) are loaded and handled as separate
[hd/2] vectors. Arithmetic follows the jnp path (``model._qk``): the partials summed in float32
and cast to the projection's dtype, the norm's statistics in float32 and its product in the
weights' dtype, cos / sin cast to q's dtype, every product and sum rounded to that dtype. The
caches are aliased to the outputs (``input_output_aliases``), so only the written rows move; a
position outside ``[0, S_max)`` (after one wrap of a negative one, as a jnp index does) writes
nothing, as the jnp path's ``mode="drop"`` scatter.

Backend: generic Pallas primitives (whole-array refs, ``pl.ds``, ``pl.when``) for the Triton
backend on the GPU and interpret mode on the CPU, as the other decode kernels
(``ftjax.kernels.common``). Idea: the fused "QK-norm + RoPE + KV-cache write" prologue kernels of
LLM serving runtimes (e.g. vLLM's fused rotary-embedding-and-cache kernels), here for the stacked
cache of a layer scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import common, decode_attention, registry


def supported(qkv: jax.Array, hq: int, hkv: int, hd: int, k_cache: jax.Array, q_dtype) -> bool:
    """True for qkv [S, B, (Hq + 2 Hkv) * hd] float (S >= 1 K-split parts) with Hq % Hkv == 0,
    hd / 2 a power of two >= 8, a cache [L, B, S_max, Hkv, hd] of a float dtype that
    ``decode_attention`` takes with queries of ``q_dtype`` (the normed, rotated q's dtype)."""
    if qkv.ndim != 3 or k_cache.ndim != 5 or not jnp.issubdtype(qkv.dtype, jnp.floating):
        return False
    _, b, n = qkv.shape
    half = hd // 2
    if hq % hkv or hd % 2 or half < 8 or half & (half - 1) or n != (hq + 2 * hkv) * hd:
        return False
    if k_cache.shape[1] != b or k_cache.shape[3:] != (hkv, hd):
        return False
    q = jax.ShapeDtypeStruct((b, 1, hq, hd), q_dtype)
    return decode_attention.supported(q, k_cache)


def query_dtype(q_norm_dtype, dtype) -> jnp.dtype:
    """The normed, rotated q's dtype: ``jnp.result_type(q_norm, dtype)`` as ``model.rms_norm`` gives it,
    or the projection's ``dtype`` for a family without q/k norms (``q_norm_dtype`` None)."""
    return jnp.dtype(dtype) if q_norm_dtype is None else jnp.result_type(q_norm_dtype, dtype)


def query_rows(hq: int, hkv: int) -> int:
    """Rows of the query tile per KV head (``decode_attention.query_rows`` of the GQA group)."""
    return decode_attention.query_rows(hq // hkv)


def _inv_freq(theta: float, hd: int) -> jax.Array:
    """``model.rope``'s frequencies [hd / 2] (float32), evaluated at trace time so that they are a
    constant of the program, not a pow kernel in every layer of a decode step (H200 trace: 1.4 us
    plus a launch gap). They are evaluated by a compiled program of their own on the default device
    (:func:`_program_inv_freq`), as the model's jitted step computes them: there theta is a
    constant of the program, and XLA's ``pow`` of a constant base rounds unlike an eager ``pow``
    (or ``ensure_compile_time_eval``'s op-by-op evaluation) of two arrays: 1 ulp apart in a
    quarter of the frequencies, so float32 angles ``pos * inv_freq`` ~3e-4 apart at position 8000.
    Where nothing can be compiled at trace time (lowering for an abstract device, as the lowering
    tests do) they stay traced ops."""
    try:
        return jnp.asarray(_program_inv_freq(float(theta), hd, registry.backend()))
    except (ValueError, RuntimeError):  # under an abstract device: "Unknown backend: 'gpu' requested"
        return _freqs(theta, hd)


def _freqs(theta: float, hd: int) -> jax.Array:
    """``model.rope``'s expression of the frequencies, op for op (keep the two the same)."""
    return 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))


@functools.lru_cache(maxsize=None)
def _program_inv_freq(theta: float, hd: int, backend: str) -> np.ndarray:
    """:func:`_freqs` run as a compiled program on the default backend (``backend``: its name, a key
    of the cache only), as numpy."""
    return np.asarray(jax.jit(functools.partial(_freqs, theta, hd)).lower().compile()())


def _kernel(pos_ref, layer_ref, inv_ref, qkv_ref, *refs, hq, hkv, hd, eps, dtype, q_dtype, norm):
    if norm:
        qn_ref, kn_ref, _, _, qg_ref, ck_ref, cv_ref = refs
    else:
        qn_ref = kn_ref = None
        _, _, qg_ref, ck_ref, cv_ref = refs
    b, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, rows, half = hq // hkv, qg_ref.shape[2], hd // 2
    f32 = jnp.float32
    n_layers, s_max = ck_ref.shape[0], ck_ref.shape[2]
    layer = common.wrap_clamp(layer_ref[0], n_layers)
    pos = pos_ref[b]
    slot = jnp.where(pos < 0, pos + s_max, pos)  # one wrap, then out of range writes nothing

    def rnd(v, dt):  # round to dt, carried on in float32
        return v.astype(dt).astype(f32)

    def load(c0):  # the head's column halves, the K-split parts summed in float32, in the projection's dtype
        out = []
        for c in (c0, c0 + half):
            acc = qkv_ref[0, b, pl.ds(c, half)].astype(f32)
            for s in range(1, qkv_ref.shape[0]):
                acc = acc + qkv_ref[s, b, pl.ds(c, half)].astype(f32)
            out.append(rnd(acc, dtype))
        return out

    def normed(xs, w_ref):  # model.rms_norm over the head: float32 statistics, product in the weights' dtype
        if w_ref is None:
            return xs
        inv = lax.rsqrt((jnp.sum(xs[0] * xs[0]) + jnp.sum(xs[1] * xs[1])) / hd + eps)
        ws = [(w_ref[layer, pl.ds(c, half)] if len(w_ref.shape) == 2 else w_ref[pl.ds(c, half)]).astype(f32)
              for c in (0, half)]
        return [rnd(w * rnd(x * inv, dtype), q_dtype) for w, x in zip(ws, xs)]

    def rotated(xs):  # model.rope: x * cos + rotate_half(x) * sin, cos / sin cast to x's dtype
        ang = pos.astype(f32) * inv_ref[...]
        cos, sin = rnd(jnp.cos(ang), q_dtype), rnd(jnp.sin(ang), q_dtype)
        a, b_ = xs
        return [rnd(rnd(a * cos, q_dtype) + rnd(-b_ * sin, q_dtype), q_dtype),
                rnd(rnd(b_ * cos, q_dtype) + rnd(a * sin, q_dtype), q_dtype)]

    def store(ref, idx, xs):
        for c, x in zip((0, half), xs):
            ref[idx + (pl.ds(c, half),)] = x.astype(ref.dtype)

    @pl.when(r < g)
    def _():
        store(qg_ref, (b, h, r), rotated(normed(load((h * g + r) * hd), qn_ref)))

    @pl.when((r >= g) & (r < rows))
    def _():
        store(qg_ref, (b, h, r), [jnp.zeros((half,), f32)] * 2)

    in_range = (slot >= 0) & (slot < s_max)

    @pl.when((r == rows) & in_range)
    def _():
        store(ck_ref, (layer, b, slot, h), rotated(normed(load((hq + h) * hd), kn_ref)))

    @pl.when((r == rows + 1) & in_range)
    def _():
        store(cv_ref, (layer, b, slot, h), load((hq + hkv + h) * hd))


@functools.partial(jax.jit, static_argnames=("hq", "hkv", "eps", "theta", "dtype", "interpret", "num_warps"))
def rope_cache(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None, k_cache: jax.Array,
               v_cache: jax.Array, layer: jax.Array, positions: jax.Array, *, hq: int, hkv: int, eps: float,
               theta: float, dtype, interpret: bool = False,
               num_warps: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v of a decode step's layer from its fused projection, ready for ``decode_attention``.

    qkv: [S, B, (Hq + 2 Hkv) * hd] float, the q | k | v projections' columns as S parts whose
    float32 sum, cast to ``dtype``, is the projection (``norm_dense_decode``'s K-split partials,
    or one part); q_norm, k_norm: the per-head RMSNorm weights [hd] or stacked [L, hd] (read at
    ``layer``), both None for a family without q/k norms; k_cache, v_cache: [L, B, S_max, Hkv, hd];
    layer: int32 [] (wrapped and clamped as a jnp index); positions: int32 [B] (or [B, 1]), each
    row's position; eps: the norms' epsilon; theta: RoPE's base.

    Returns (qg, k_cache, v_cache): qg [B, Hkv, rows, hd] (rows = :func:`query_rows`; row r < G of
    KV head h is query head h * G + r, normed and rotated; pad rows zero) in the normed q's dtype
    (``jnp.result_type(q_norm, dtype)``, or ``dtype``); the caches with row ``positions[b]`` of
    layer ``layer`` set to the normed, rotated K and to V (in the caches' dtype; the inputs are
    aliased to these outputs, so donate or drop them).

    Raises:
      ValueError: operands that :func:`supported` rejects, caches of two shapes or dtypes, only
        one of q_norm / k_norm, or norm weights of another shape than [hd] / [L, hd] or of two dtypes.
    """
    hd = k_cache.shape[-1]
    norm = q_norm is not None
    if norm != (k_norm is not None):
        raise ValueError("rope_cache: q_norm and k_norm must both be given or both be None")
    q_dtype = query_dtype(q_norm.dtype if norm else None, dtype)
    if not supported(qkv, hq, hkv, hd, k_cache, q_dtype) or v_cache.shape != k_cache.shape \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"rope_cache: unsupported operands (qkv {qkv.shape} {qkv.dtype}, hq={hq} hkv={hkv}, caches "
                         f"{k_cache.shape} {k_cache.dtype} / {v_cache.shape} {v_cache.dtype}, q dtype {q_dtype})")
    if norm and (any(tuple(w.shape) not in ((hd,), (k_cache.shape[0], hd)) for w in (q_norm, k_norm))
                 or q_norm.dtype != k_norm.dtype):
        raise ValueError(f"rope_cache: q_norm / k_norm must be [hd] or [L, hd] (hd {hd}, L {k_cache.shape[0]}) of "
                         f"one dtype, got {q_norm.shape} {q_norm.dtype} / {k_norm.shape} {k_norm.dtype}")
    b = qkv.shape[1]
    rows = query_rows(hq, hkv)
    inv_freq = _inv_freq(theta, hd)
    pos = jnp.asarray(positions, jnp.int32).reshape(b)
    lid = jnp.asarray(layer, jnp.int32).reshape(1)
    norms = (q_norm, k_norm) if norm else ()
    operands = (pos, lid, inv_freq, qkv) + norms + (k_cache, v_cache)
    params = common.triton_params(interpret, num_warps)
    out_shape = (jax.ShapeDtypeStruct((b, hkv, rows, hd), q_dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    n_in = len(operands)
    return pl.pallas_call(
        functools.partial(_kernel, hq=hq, hkv=hkv, hd=hd, eps=eps, dtype=jnp.dtype(dtype), q_dtype=q_dtype, norm=norm),
        out_shape=out_shape, grid=(b, hkv, rows + 2), input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        interpret=interpret, compiler_params=params, name="rope_cache",
    )(*operands)


registry.register(registry.Kernel(
    "rope_cache", "ftjax.layers.attention.qk (then the cache scatter)",
    "a decode step's attention prologue (plain per-head q/k norms or none, full RoPE, the K/V cache write) where the "
    "q/k/v projections read stacked weights (dense_decode or norm_dense_decode); auto: GPU, 16-bit weights",
    needs=("decode_attention",)))
