"""Helpers shared by the Pallas kernels (no kernel of its own).

Pallas backends in jax 0.11.2 (read from ``jax/_src/pallas/pallas_call.py`` and its backends):

* ``pallas_call(..., interpret=True)`` evaluates the kernel's jaxpr with ordinary JAX ops on any
  backend: kernels written with generic primitives (whole-array refs, ``pl.ds`` indexing,
  ``lax.fori_loop``, ``jnp.dot``) run on the CPU. Strided ``pl.ds`` does not discharge there.
* On a GPU, a ``pallas_call`` without compiler params (or with the Triton ``CompilerParams``)
  lowers through the Triton backend: deprecated but shipped; no scalar prefetch, no dynamic grid;
  offsets become 64-bit for arrays over 4 GiB. It lowers on a machine without a GPU under an
  abstract H200 device (``jax.sharding.AbstractDevice``), which the kernel tests use.
* Mosaic GPU (``plgpu.CompilerParams``; the Hopper kernels shipped under
  ``jax.experimental.pallas.ops.gpu.*_mgpu``) is the maintained GPU backend; the shipped attention
  kernel asserts a CUDA runtime at trace time, so it neither interprets nor lowers without a GPU.

The decode kernels (one to 64 rows, weights or keys chosen by data) are written with generic
primitives for the Triton backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.kernels import registry


def dot_dtype_ok(dtype) -> bool:
    """Whether a kernel built on ``dot`` may take operands of ``dtype`` here: anywhere for 16-bit
    floats; float32 only off the GPU (interpret mode). On the GPU the Triton backend would run a
    float32 dot as TF32 whatever ``jax.default_matmul_precision`` says, and the float32 oracle
    runs need full float32, so float32 attention keeps the XLA path."""
    return jnp.dtype(dtype).itemsize == 2 or registry.backend() != "gpu"


def pow2(n: int) -> bool:
    """Whether the Python int n is a power of two (>= 1): the block and size rule of the Triton kernels."""
    return n >= 1 and not n & (n - 1)


def wrap_clamp(i: jax.Array, n: int) -> jax.Array:
    """An index as a jnp gather reads it: negative ids wrap once (``i + n``), then out-of-range
    ids clamp to ``[0, n)``. The decode kernels apply it to the int32 scalar they read from a ref
    (a layer or slot id) instead of to the array before the call, which would be one more tiny
    XLA kernel per layer of a decode step."""
    return jnp.clip(jnp.where(i < 0, i + n, i), 0, n - 1)


def silu_mul(g: jax.Array, u: jax.Array, dtype) -> jax.Array:
    """silu(g) * u from float32 accumulators with the unfused reference's roundings (a matmul's output in
    ``dtype``, then SwiGLU in ``dtype``): g, u and silu(g) rounded to ``dtype``. Used inside kernels."""
    g = g.astype(dtype).astype(jnp.float32)
    u = u.astype(dtype).astype(jnp.float32)
    s = (g / (1.0 + jnp.exp(-g))).astype(dtype).astype(jnp.float32)
    return (s * u).astype(dtype)


def triton_params(interpret: bool, num_warps: int | None = None, num_stages: int | None = None):
    """The ``compiler_params`` of a decode / prefill kernel's ``pallas_call``: None in interpret mode,
    else the Triton backend's ``CompilerParams`` (None fields: Triton's defaults). Imported here, at
    trace time, so the CPU-only paths never load the Triton module."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def block_and_warps(name: str, key: str, default_warps: int, minimum: int = 16):
    """The tile parser of a kernel whose tiles are ``(key,)`` or ``(key, num_warps)``: ``key`` a power of two
    >= ``minimum``, ``num_warps`` a power of two (``default_warps`` when left out). Returns ``vals -> {key,
    num_warps}``. The parser raises ValueError naming the kernel and the values."""
    def parse(vals: tuple[int, ...]) -> dict:
        size, *rest = tile_values(name, vals, (1, 2), f"({key},) or ({key}, num_warps)")
        if not (pow2(size) and size >= minimum) or (rest and not pow2(rest[0])):
            raise ValueError(f"tiles of kernel {name!r}: {key} must be a power of two >= {minimum} and num_warps a "
                             f"power of two, got {vals}")
        return {key: size, "num_warps": rest[0] if rest else default_warps}
    return parse


def tile_values(name: str, vals: tuple[int, ...], counts: tuple[int, ...], expected: str) -> tuple[int, ...]:
    """``vals`` checked to hold one of ``counts`` integers (``expected`` says what they are).
    Raises:
      ValueError: another count (the message names the kernel and the values)."""
    if len(vals) not in counts or not all(isinstance(v, int) for v in vals):
        raise ValueError(f"tiles of kernel {name!r}: expected {expected}, got {tuple(vals)}")
    return tuple(vals)
