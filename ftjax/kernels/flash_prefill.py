"""Flash attention for prefill: causal GQA over a cache row, queries at absolute positions.

The reference, ``ftjax.model.attention``, materialises float32 scores [B, Hq, 512, S_max] per
block of 512 queries and scores every cache position, filled or not. Flash attention (Dao et al.
2022) instead streams K/V blocks through an online softmax and skips the blocks no query of the
tile can see, so neither the score tensor nor the unreachable keys are touched.

Semantics (the reference's): queries of row b sit at positions ``start[b] + t`` (t < T) and see
keys ``j <= start[b] + t`` of the row's cache ``[S_max, Hkv, hd]``; keys above hold stale data.
Two implementations, and the default's choice between them:

* ``pallas``: :func:`flash_attention`, written here with generic Pallas
  primitives, grid (B, Hq, T / block_q): program (b, h, i) holds queries ``[i*bq, (i+1)*bq)`` of
  head h and walks the K/V blocks of KV head ``h // (Hq / Hkv)`` (GQA) up to the last position
  its tile can see, ``start[b] + (i+1)*bq - 1``, masking by position inside the last blocks. Any
  per-row start (chunked and prefix-reuse prefill) and bf16 work. It interprets on the CPU (the
  tests) and lowers through Pallas' Triton backend (deprecated in jax 0.11.2 but shipped; the
  default lowering of a ``pallas_call`` without Mosaic GPU parameters).
* ``mgpu``: the Hopper Mosaic GPU kernel shipped with jax
  (``jax.experimental.pallas.ops.gpu.attention_mgpu.attention``, warp-specialised, TMA + WGMMA).
  Its causal mask aligns query t with key t, so it serves only calls where every row starts at 0
  (chosen at run time by ``lax.cond``; other calls take the reference), and in jax 0.11.2 its
  shared-memory buffers are float16, so bf16 operands are cast to float16 (exact in mantissa) and the
  output cast back; a call with an operand beyond float16's +-65504 takes the reference too. It runs
  on Hopper GPUs only (compute capability 9.x), never on the CPU.
* ``auto`` (the default): ``mgpu`` for the calls it serves on a Hopper GPU where it traces
  (:func:`mgpu_traces`), the ``pallas`` kernel for the others (a chunked or prefix-reuse prefill's later
  calls, operands beyond float16, head dims above 256, other GPUs, the CPU's interpreted runs). Every
  prefill program then compiles both kernels: 8.8 vs 5.9 s for the qwen3 16-layer cut on an H100.
  Measured on an H100 (2026-12-06, ``check_kernels_gpu.py --sections=flash_prefill``, 8192 tokens
  from 0): the Mosaic kernel 1.294 vs 1.649 ms at qwen3's 32 / 4
  heads of 128, 1.185 vs 1.687 ms at qwen3.5's 16 / 2 heads of 256; resident 8192-token TTFT of the 16-layer
  cuts, auto vs pallas: qwen3.5 0.0791 vs 0.0810 s (``bench_gated_delta.py``), qwen3 0.0845 vs 0.0902 s
  (``check_kernels_gpu.py --sections=e2e_prefill``).

``KernelConfig.flash_prefill`` (``auto`` | ``pallas`` | ``mgpu``) picks one where the kernel config
selects the ``flash_prefill`` kernel (``ftjax.kernels.registry``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ftjax.kernels import common, registry
from ftjax.kernels.online_softmax import NEG, fold_block

BLOCK_Q, BLOCK_K = 64, 64


def supported(q: jax.Array, k: jax.Array, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> bool:
    """True for q [B, T, Hq, hd], k [B, S, Hkv, hd] of one float dtype, Hq % Hkv == 0, hd a power of
    two >= 16, T a multiple of the (power-of-two, >= 16) tile min(block_q, T), min(block_k, S) a power of two
    >= 16. S need not be a multiple of the key tile: the last key block's loads are masked at S (a cache of
    ``max_seq_len`` = 8192 + 16 rows once sent every prefill to the jnp reference, 7 ms a layer for an
    8192-token prompt of qwen3.5-35b-a3b)."""
    if q.ndim != 4 or k.ndim != 4 or q.dtype != k.dtype or not jnp.issubdtype(q.dtype, jnp.floating):
        return False
    t, hq, hd = q.shape[1:]
    s, hkv = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return hq % hkv == 0 and pow2(hd) and pow2(bq) and pow2(bk) and t % bq == 0


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, bq, bk, group, scale):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kvh = h // group
    t0 = i * bq
    start = start_ref[b]
    s_max = k_ref.shape[1]
    last = start + t0 + bq  # one past the last position a query of this tile can see
    steps = pl.cdiv(jnp.minimum(last, s_max), bk)
    q = q_ref[b, pl.ds(t0, bq), h, :]
    q_pos = start + t0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)

    def body(j, carry):
        acc, m, l = carry
        j0 = j * bk
        k_pos = j0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        visible = k_pos <= q_pos
        if s_max % bk:  # a partial last block: rows past S are read as zeros and masked out of the scores (a
            # padding query may sit past S, where j <= q_pos alone would let them in)
            inside = (j0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)) < s_max
            kb = plt.load(k_ref.at[b, pl.ds(j0, bk), kvh, :], mask=inside, other=0)
            vb = plt.load(v_ref.at[b, pl.ds(j0, bk), kvh, :], mask=inside, other=0)
            visible = visible & (k_pos < s_max)
        else:
            kb = k_ref[b, pl.ds(j0, bk), kvh, :]
            vb = v_ref[b, pl.ds(j0, bk), kvh, :]
        sc = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        sc = jnp.where(visible, sc, NEG)
        return fold_block(acc, m, l, sc, vb)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, _, l = lax.fori_loop(0, steps, body, init)
    o_ref[b, pl.ds(t0, bq), h, :] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_q", "block_k", "num_warps", "num_stages"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, *, interpret: bool = False,
                    block_q: int = BLOCK_Q, block_k: int = BLOCK_K, num_warps: int | None = None,
                    num_stages: int | None = None) -> jax.Array:
    """Causal GQA flash attention of T queries per row at positions ``start[b] + t``.

    q: [B, T, Hq, hd]; k, v: [B, S_max, Hkv, hd] (one layer's cache rows); start: int32 [B].
    Query t of row b sees keys j <= start[b] + t. Scores scaled by hd**-0.5, softmax in float32.
    Returns [B, T, Hq, hd] in q's dtype. interpret: Pallas interpret mode (CPU); block_q /
    block_k: tile sizes; num_warps / num_stages: Triton compiler parameters on the GPU.
    """
    b, t, hq, hd = q.shape
    s_max, hkv = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s_max)
    params = common.triton_params(interpret, num_warps, num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, bq=bq, bk=bk, group=hq // hkv, scale=hd ** -0.5),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, hq, t // bq),
        interpret=interpret, compiler_params=params, name="flash_prefill",
    )(start.astype(jnp.int32), q, k, v)


def mgpu_block_kv(hd: int) -> int:
    """The Mosaic GPU kernel's key block for head dim ``hd``: 128, or 64 above hd 128, so its shared memory (two
    query blocks of 64 rows plus two pipeline steps of K and V, float16: 2*64*hd*2 + 2*2*block_kv*hd*2 bytes)
    fits the H100 / H200's 227 KiB: hd 256 at 128 needs 320 KiB, at 64 192 KiB (the 2026-11-30 check: hd 128 at
    4 steps asked for 290 KiB and was refused)."""
    return 128 if hd <= 128 else 64


def mgpu_supported(q: jax.Array, k: jax.Array, block_q: int = 64, block_kv: int = 128) -> bool:
    """Shapes the shipped Mosaic GPU kernel takes: T a multiple of 2*block_q and of block_kv, T <= S,
    hd % 64 == 0 and hd <= 256 (above, its buffers overflow shared memory even at :func:`mgpu_block_kv`'s 64),
    16-bit floats."""
    t, hd, s = q.shape[1], q.shape[3], k.shape[1]
    return (q.dtype in (jnp.bfloat16, jnp.float16) and hd % 64 == 0 and hd <= 256 and t % (2 * block_q) == 0
            and t % block_kv == 0 and t <= s)


def mgpu_traces(q: jax.Array, k: jax.Array, v: jax.Array, block_kv: int) -> bool:
    """Whether :func:`mgpu_attention` traces for these operands here. In jax 0.11.2 the kernel asserts that CUDA's
    libraries are loaded (not so on a CPU-only machine lowering for a GPU: ``registry.lowering_for``) and refuses
    causal attention under CUDA runtimes 12.8 to 12.9; ``auto`` then takes the Pallas kernel."""
    try:
        jax.eval_shape(functools.partial(mgpu_attention, block_kv=block_kv), q, k, v)
    except (AssertionError, ValueError, ImportError, NotImplementedError):
        return False
    return True


def mgpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_q: int = 64, block_kv: int = 128,
                   max_concurrent_steps: int = 2) -> jax.Array:
    """jax's Mosaic GPU attention, causal, for rows that all start at position 0: query t sees the
    keys ``k[:, :t + 1]``, scores scaled by hd**-0.5 as :func:`flash_attention`. q: [B, T, Hq, hd]; k, v:
    [B, S >= T, Hkv, hd]. Computed in float16 (the kernel's buffers); returns q's dtype.

    The shipped kernel does not scale its scores (its own reference, ``attention_reference``, neither), so q
    is scaled here, in float32 before the cast; without it the outputs were those of scores hd**0.5 too
    large (max |diff| 5.36 against the reference on an H200, 2026-11-30)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    t, hd = q.shape[1], q.shape[3]
    cfg = attention_mgpu.TuningConfig(block_q=block_q, block_kv=block_kv,
                                      max_concurrent_steps=max_concurrent_steps, causal=True)
    f16 = lambda a: a.astype(jnp.float16)  # noqa: E731
    out = attention_mgpu.attention(f16(q.astype(jnp.float32) * hd ** -0.5), f16(k[:, :t]), f16(v[:, :t]), cfg)
    return out.astype(q.dtype)


#: The largest finite float16: the Mosaic GPU kernel's buffers are float16, so operands beyond it would overflow.
F16_MAX = 65504.0


def mgpu_in_range(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """bool []: whether the operands :func:`mgpu_attention` casts to float16 (q scaled by hd**-0.5, the first T
    rows of k and v) all fit float16's range; where not, the call takes the reference instead of overflowing to
    inf. Reads them once (for an 8192-token qwen3.5 layer: 16 MB of k and v, 64 MB of q)."""
    t, hd = q.shape[1], q.shape[3]
    big = lambda a, s=1.0: jnp.max(jnp.abs(a.astype(jnp.float32))) * s  # noqa: E731
    return jnp.maximum(jnp.maximum(big(q, hd ** -0.5), big(k[:, :t])), big(v[:, :t])) <= F16_MAX


def hopper() -> bool:
    """Whether the Mosaic GPU kernel can run on this machine's GPU (compute capability 9.x: H100, H200). True
    where jax's first device is no GPU (a program lowered for CUDA on the CPU, ``registry.lowering_for``); there
    :func:`mgpu_traces` decides."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return True
    return str(getattr(dev, "compute_capability", "")).startswith("9")


def maybe(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
          reference: Callable[..., jax.Array]) -> jax.Array | None:
    """Flash attention for a prefill call (q_pos int32 [B, T] = start + t) when the kernel config
    selects it for these operands, else None (the caller runs ``reference``). ``reference(q, k, v, q_pos)``:
    the jnp attention, taken by the ``mgpu`` implementation (``KernelConfig.flash_prefill``) for calls with a
    row that does not start at 0 or with operands beyond float16's range (:func:`mgpu_in_range`); ``auto``
    takes the Pallas kernel there instead (module docstring)."""
    impl = registry.active().flash_prefill
    start = q_pos[:, 0]
    bkv = mgpu_block_kv(q.shape[3])

    def mosaic_or(other: Callable[[], jax.Array]) -> jax.Array:  # the Mosaic kernel where it serves, else other
        return lax.cond(jnp.all(start == 0) & mgpu_in_range(q, k, v), lambda: mgpu_attention(q, k, v, block_kv=bkv),
                        other)

    if impl == "mgpu":
        how = registry.mode("flash_prefill", mgpu_supported(q, k, block_kv=bkv))
        if how != "gpu":  # the Mosaic GPU kernel does not interpret on the CPU
            return None
        return mosaic_or(lambda: reference(q, k, v, q_pos))
    how = registry.mode("flash_prefill", supported(q, k) and common.dot_dtype_ok(q.dtype))
    if how == "xla":
        return None
    pallas = lambda: flash_attention(q, k, v, start, interpret=how == "interpret")  # noqa: E731
    if impl == "auto" and how == "gpu" and mgpu_supported(q, k, block_kv=bkv) and hopper() \
            and mgpu_traces(q, k, v, bkv):
        return mosaic_or(pallas)
    return pallas()


registry.register(registry.Kernel(
    "flash_prefill", "ftjax.layers.attention.attention",
    "prefill attention (T > 1) from any start position, 16-bit operands on a GPU (float32 interpreted only); "
    "auto: GPU"))
