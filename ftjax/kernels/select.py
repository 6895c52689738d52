"""Which implementation each kernel-backed op uses, decided at trace time.

The environment variable ``FTJAX_KERNELS`` (read when a function is traced, like
``FTJAX_GROUPED_MATMUL`` in :mod:`ftjax.kernels.grouped_matmul`):

* ``auto`` (default): the Pallas kernel on a GPU where it supports the operands, the XLA (jnp)
  reference everywhere else. On the CPU every op therefore keeps its jnp code, so the exactness
  tests of the model are unchanged.
* ``xla``: the jnp reference everywhere.
* ``interpret``: every kernel in Pallas interpret mode (any backend; CPU tests of the wiring).
* a comma list of kernel names (:data:`KERNELS`, e.g. ``moe_decode,decode_attention``): only those
  kernels, on the GPU compiled and elsewhere interpreted; the others use the reference.

A jitted function keeps the choice made when it was traced: after changing the variable call
``jax.clear_caches()`` (and clear the engine's compiled programs) before tracing again.

Pallas backends in jax 0.11.2 (read from ``jax/_src/pallas/pallas_call.py`` and its backends):

* ``pallas_call(..., interpret=True)`` evaluates the kernel's jaxpr with ordinary JAX ops
  (``hlo_interpreter``) on any backend: kernels written with generic primitives (BlockSpecs or
  whole-array refs, ``pl.ds`` indexing, ``lax.fori_loop``, ``jnp.dot`` / ``dot_general``) run on
  the CPU. Strided ``pl.ds`` does not discharge there (the int4 kernel avoids it).
* On a GPU, a ``pallas_call`` without compiler params (or with the Triton ``CompilerParams``)
  lowers through the Triton backend: deprecated (a warning at each lowering) but shipped; no
  scalar prefetch, no dynamic grid; offsets become 64-bit for arrays over 4 GiB. It lowers on a
  machine without a GPU under an abstract H200 device (``jax.sharding.AbstractDevice`` in a
  ``use_abstract_mesh``), which ``tests/test_kernels.py`` uses to check each kernel's lowering.
* Mosaic GPU (``plgpu.CompilerParams`` / ``plgpu.kernel``; the Hopper kernels shipped under
  ``jax.experimental.pallas.ops.gpu.*_mgpu``) is the maintained GPU backend. Its own interpret
  mode (``InterpretGPUParams``) exists, but the shipped attention kernel asserts a CUDA runtime at
  trace time, so it neither interprets nor lowers here.

The decode kernels (one to 64 rows, weights or keys chosen by data) are written with generic
primitives for the Triton backend; prefill can also use the shipped Mosaic GPU attention
(``ftjax.kernels.flash_prefill``).
"""

from __future__ import annotations

import os

import jax

#: The kernel-backed ops: fused MoE decode (:mod:`ftjax.kernels.moe_decode`), decode attention
#: over the filled length (:mod:`ftjax.kernels.decode_attention`), flash attention for prefill
#: (:mod:`ftjax.kernels.flash_prefill`), the decode step's dense projections read from the weights
#: stacked over layers (:mod:`ftjax.kernels.dense_decode`), and the same kernel with the RMSNorm before
#: them in one launch (``norm_dense_decode``, in that module: the input norm + wq/wk/wv, the MoE norm +
#: router; selected alone, the other projections take the sliced weights), and the decode attention's
#: prologue (:mod:`ftjax.kernels.rope_cache`: q/k norms, RoPE, the K/V cache write; with ``decode_attention`` and
#: ``dense_decode`` or ``norm_dense_decode``, whose stacked weights it needs)
#: and its epilogue (``merge_dense_decode`` in :mod:`ftjax.kernels.dense_decode`: the key splits' merge in the
#: prologue of the wo product; after ``rope_cache``; by name only, not under ``auto``), and the cached mode's LRU
#: slot-table lookup of a decode layer (:mod:`ftjax.kernels.slot_lookup`), and a decode layer's router after its
#: logits product (:mod:`ftjax.kernels.route_decode`: softmax, top-k; with ``norm_dense_decode``, whose partial
#: logits it reads; by name only so far).
KERNELS = ("moe_decode", "decode_attention", "flash_prefill", "dense_decode", "norm_dense_decode", "rope_cache",
           "merge_dense_decode", "slot_lookup", "route_decode")
ENV = "FTJAX_KERNELS"


def mode(name: str, supported: bool = True, auto: bool = True) -> str:
    """How op ``name`` runs in the function being traced: "xla", "gpu" or "interpret".

    supported: whether the kernel handles these operands on a GPU (shapes, dtypes); an
    unsupported case falls back to "xla" under ``auto`` and a name list, and stays "interpret"
    under ``interpret`` only when the kernel's own checks pass (the caller passes the same flag).
    auto: whether ``auto`` picks the kernel for these operands on a GPU (False where it was measured
    slower than XLA; a name list still runs it).
    Raises:
      ValueError: unknown kernel name, or an unknown name in the variable.
    """
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected one of {KERNELS}")
    value = os.environ.get(ENV, "auto").strip() or "auto"
    on_gpu = jax.default_backend() == "gpu"
    if value == "xla" or not supported:
        return "xla"
    if value == "interpret":
        return "interpret"
    if value == "auto":
        return "gpu" if on_gpu and auto else "xla"
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in KERNELS]
    if bad:
        raise ValueError(f"{ENV}={value!r}: unknown kernel(s) {bad}; expected auto, xla, interpret or names "
                         f"from {KERNELS}")
    if name not in names:
        return "xla"
    return "gpu" if on_gpu else "interpret"


def dot_dtype_ok(dtype) -> bool:
    """Whether a kernel built on ``dot`` may take operands of ``dtype`` here: anywhere for 16-bit
    floats; float32 only off the GPU (interpret mode). On the GPU the Triton backend would run a
    float32 dot as TF32 whatever ``jax.default_matmul_precision`` says, and the float32 oracle
    runs (DESIGN.md section 3) need full float32, so float32 attention keeps the XLA path."""
    return jax.numpy.dtype(dtype).itemsize == 2 or jax.default_backend() != "gpu"


def tile_ints(env: str, counts: tuple[int, ...], expected: str) -> list[int] | None:
    """The integers of a kernel's tile variable ``env`` (comma separated; read when called, i.e. at
    trace time), or None when it is unset or blank (as ``FTJAX_KERNELS``: the module defaults).

    counts: the numbers of values accepted; expected: what the message says is expected.
    Raises:
      ValueError: not integers, or another count (the message names the variable and its value)."""
    v = os.environ.get(env, "")
    if not v.strip():
        return None
    try:
        vals = [int(a) for a in v.split(",")]
        if len(vals) not in counts:
            raise ValueError
    except ValueError:
        raise ValueError(f"{env}={v!r}: expected {expected}") from None
    return vals


def pow2(n: int) -> bool:
    """Whether the Python int n is a power of two (>= 1): the block and size rule of the Triton kernels."""
    return n >= 1 and not n & (n - 1)


def wrap_clamp(i: jax.Array, n: int) -> jax.Array:
    """An index as a jnp gather reads it: negative ids wrap once (``i + n``), then out-of-range
    ids clamp to ``[0, n)``. The decode kernels apply it to the int32 scalar they read from a ref
    (a layer or slot id) instead of to the array before the call: done outside, it was one more
    tiny XLA kernel per layer of a decode step (H200 trace, ~1.5 us each plus the launch gap)."""
    return jax.numpy.clip(jax.numpy.where(i < 0, i + n, i), 0, n - 1)


def triton_params(interpret: bool, num_warps: int | None = None, num_stages: int | None = None):
    """The ``compiler_params`` of a decode / prefill kernel's ``pallas_call``: None in interpret mode,
    else the Triton backend's ``CompilerParams`` (None fields: Triton's defaults). Imported here, at
    trace time, so the CPU-only paths never load the Triton module."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
