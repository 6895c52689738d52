"""Grouped (ragged) matrix multiply for MoE experts: rows sorted by expert, one weight per group.

``jax.lax.ragged_dot`` is the reference and the CPU path, but on the H200 with jax 0.11.2 it ran
at 5 TFLOP/s (DESIGN.md section 3), which would make 8192-token prefill compute-bound. On GPUs the
Mosaic GPU Pallas kernel shipped with JAX (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``,
measured 233 TFLOP/s on the same shapes) is used instead when the shapes fit its tiles.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

# Tile shape of the Mosaic GPU kernel (DESIGN.md section 3: 128x128x64, 4 stages).
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 4


def mgpu_supported(lhs: jax.Array, rhs: jax.Array) -> bool:
    """True when the Mosaic GPU kernel can run these operands on the current backend:
    a GPU, 16-bit float operands of one dtype, K % 64 == 0 and N % 128 == 0."""
    if jax.default_backend() != "gpu" or lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    k, n = rhs.shape[1], rhs.shape[2]
    return k % BLOCK_K == 0 and n % BLOCK_N == 0


@functools.cache
def _mgpu_kernel():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return functools.partial(ragged_dot_mgpu.ragged_dot, block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
                             max_concurrent_steps=STAGES, grid_block_n=1)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, impl: str | None = None) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g(r)], rows of lhs grouped contiguously by group.

    lhs: [M, K]; rhs: [G, K, N]; group_sizes: int32 [G] with sum == M. Returns [M, N] in lhs's dtype.
    impl: "auto" (Mosaic GPU kernel where supported, else ragged_dot), "mgpu", or "xla";
      default: the environment variable FTJAX_GROUPED_MATMUL, else "auto" (read at trace time).
    Raises:
      ValueError: unknown impl, or "mgpu" asked for where it cannot run.
    """
    impl = impl or os.environ.get("FTJAX_GROUPED_MATMUL", "auto")
    if impl not in ("auto", "mgpu", "xla"):
        raise ValueError(f"unknown grouped matmul impl {impl!r}")
    use_mgpu = impl == "mgpu" or (impl == "auto" and mgpu_supported(lhs, rhs))
    if use_mgpu:
        if not mgpu_supported(lhs, rhs):
            raise ValueError(f"mgpu grouped matmul cannot run here (backend {jax.default_backend()}, "
                             f"dtype {lhs.dtype}, K={rhs.shape[1]}, N={rhs.shape[2]})")
        return _mgpu_kernel()(lhs, rhs, group_sizes=group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
