"""Quantized routed-expert weights: storage formats, quantize at load, dequantize in the expert FFN.

One concept, block-wise symmetric scales. A weight matrix is stored as ``[in, out]`` (the layout of
the banks: gate_up ``[D, 2F]``, down ``[F, D]``), cut into blocks of ``bi`` input rows x ``bo``
output columns, each block with one float32 scale: ``w ~= decode(q) * scale[block]``. Scales of
one matrix have shape ``[ceil(in / bi), ceil(out / bo)]`` (a partial block at the edge is a block
too). The fused gate_up matrix is two matrices side by side (``parts=2``): each half has its own
blocks, so its scales are ``[ceil(D / bi), 2 * ceil(F / bo)]``, gate blocks first.

=========  ======================  =========================  ===================================
format     stored weight            block (bi x bo)            decode(q)
=========  ======================  =========================  ===================================
dense      compute dtype (or bf16)  none (no scales)           identity (cast to compute dtype)
int8       int8 in [-127, 127]      in x 1 (per out channel)   q
int4       uint8, 2 per byte        INT4_GROUP x 1             nibble - 8, nibble in [1, 15]
fp8        float8_e4m3fn            128 x 128                  q (as float32)
=========  ======================  =========================  ===================================

Scales: ``amax(|w| over the block) * float32(1 / qmax)`` with qmax 127 (int8), 7 (int4), 448 (fp8, the largest
finite e4m3fn). int8 / int4 round to nearest (half to even); fp8 casts ``w / scale`` to e4m3fn
(round to nearest even). A block of zeros has scale 0 and decodes to zeros. int4 packs two
values per byte along the output axis: byte ``j`` of a row holds columns ``2j`` (low nibble)
and ``2j + 1`` (high nibble), each as ``q + 8``.

fp8 is the layout of the official fp8 Qwen3 MoE checkpoints (``quantization_config =
{"quant_method": "fp8", "weight_block_size": [128, 128]}``): a tensor ``*.weight`` [out, in]
in float8_e4m3fn and ``*.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)], dequantized
as ``w_fp8 * scale_inv`` per block. In the banks' ``[in, out]`` layout both are transposed.

Dequantization happens inside the expert computation on the weights a call reads (the gathered
k experts of a decode step, the layer's E experts of a grouped prefill), never on a whole pool:
``dequantize`` is what ``ftjax.experts.compute`` calls; dense is the format whose dequant is the
identity. See docs/QUANTIZATION.md for the byte counts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

#: ``--expert_dtype`` choices. "bfloat16" keeps the banks dense (stored in bfloat16).
FORMATS = ("bfloat16", "int8", "int4", "fp8")
#: Formats with scales.
QUANT_FORMATS = ("int8", "int4", "fp8")
#: int4 group size along the input dimension (one float32 scale per 64 inputs of an output column).
INT4_GROUP = 64
#: fp8 block shape (input rows x output columns), that of the official fp8 checkpoints.
FP8_BLOCK = (128, 128)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": FP8_MAX}
STORAGE = {"int8": np.dtype(np.int8), "int4": np.dtype(np.uint8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
#: parts of each bank's matrix along the output axis: gate_up = gate | up, down = one matrix.
PARTS = {"gate_up": 2, "down": 1}


def bank_format(expert_dtype: str) -> str:
    """The ``ExpertBanks.fmt`` of an ``--expert_dtype`` value ("bfloat16" -> "dense")."""
    if expert_dtype not in FORMATS + ("dense",):
        raise ValueError(f"unknown expert dtype {expert_dtype!r}; expected one of {FORMATS}")
    return "dense" if expert_dtype in ("bfloat16", "dense") else expert_dtype


def block(fmt: str, in_dim: int) -> tuple[int, int]:
    """(bi, bo) of a quantized format for a matrix with ``in_dim`` inputs."""
    if fmt == "int8":
        return in_dim, 1
    if fmt == "int4":
        return INT4_GROUP, 1
    if fmt == "fp8":
        return FP8_BLOCK
    raise ValueError(f"format {fmt!r} has no blocks")


def scale_shape(fmt: str, in_dim: int, out_dim: int, parts: int = 1) -> tuple[int, int]:
    """Shape of one matrix's scales: [ceil(in/bi), parts * ceil(out/parts/bo)]."""
    bi, bo = block(fmt, in_dim)
    return math.ceil(in_dim / bi), parts * math.ceil(out_dim // parts / bo)


def stored_shape(fmt: str, in_dim: int, out_dim: int) -> tuple[int, int]:
    """Shape of one stored matrix (int4 packs two columns per byte)."""
    return (in_dim, out_dim // 2) if fmt == "int4" else (in_dim, out_dim)


def expert_bytes(fmt: str, hidden: int, ffn: int, itemsize: int = 2) -> int:
    """Bytes of one expert (gate, up, down and scales) as stored in format ``fmt`` (dense:
    ``itemsize`` bytes per weight). The formula ``ExpertBanks.expert_bytes`` must equal."""
    d, f = hidden, ffn
    if fmt == "dense":
        return 3 * d * f * itemsize
    w = 3 * d * f // 2 if fmt == "int4" else 3 * d * f
    s = math.prod(scale_shape(fmt, d, 2 * f, 2)) + math.prod(scale_shape(fmt, f, d, 1))
    return w + 4 * s


# --------------------------------------------------------------------------------------------
# Scales: block maxima and their expansion to the matrix
# --------------------------------------------------------------------------------------------
def expand_scales(s: jax.Array, in_dim: int, out_dim: int, bi: int, bo: int, parts: int) -> jax.Array:
    """Scales [..., nbi, parts * nbo] -> [..., in, out] (each weight's own scale).

    Broadcasts, reshapes and slices only (no gather: it fuses into the multiply, and it runs in
    host computations too, where an index constant would sit in device memory)."""
    *lead, nbi, nb = s.shape
    if nbi > 1 or bi < in_dim:
        s = jnp.broadcast_to(s[..., :, None, :], (*lead, nbi, bi, nb)).reshape(*lead, nbi * bi, nb)[..., :in_dim, :]
    else:
        s = jnp.broadcast_to(s, (*lead, in_dim, nb))
    if bo == 1:  # one scale per column
        return s
    per, nbo = out_dim // parts, nb // parts
    s = s.reshape(*lead, in_dim, parts, nbo, 1)
    s = jnp.broadcast_to(s, (*lead, in_dim, parts, nbo, bo)).reshape(*lead, in_dim, parts, nbo * bo)[..., :per]
    return s.reshape(*lead, in_dim, out_dim)


def block_amax(w: jax.Array, bi: int, bo: int, parts: int) -> jax.Array:
    """max |w| of each block: w [..., in, out] -> [..., ceil(in/bi), parts * ceil(out/parts/bo)]."""
    *lead, n_in, n_out = w.shape
    per = n_out // parts
    nbi, nbo = math.ceil(n_in / bi), math.ceil(per / bo)
    a = jnp.abs(w).reshape(*lead, n_in, parts, per)
    pad = [(0, 0)] * len(lead) + [(0, nbi * bi - n_in), (0, 0), (0, nbo * bo - per)]
    a = jnp.pad(a, pad)
    a = a.reshape(*lead, nbi, bi, parts, nbo, bo).max(axis=(-4, -1))
    return a.reshape(*lead, nbi, parts * nbo)


# --------------------------------------------------------------------------------------------
# Quantize / dequantize one stack of matrices
# --------------------------------------------------------------------------------------------
def _pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-7, 7], [..., out] -> uint8 [..., out/2] (q + 8, low nibble = even column)."""
    u = (q + 8).astype(jnp.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_int4(p: jax.Array) -> jax.Array:
    """uint8 [..., out/2] -> float32 [..., out] in [-8, 7]."""
    lo = (p & 0xF).astype(jnp.int8) - 8
    hi = (p >> 4).astype(jnp.int8) - 8
    return jnp.stack([lo, hi], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],)).astype(jnp.float32)


def decode(fmt: str, q: jax.Array) -> jax.Array:
    """Stored values as float32 before scaling ([..., in, out])."""
    if fmt == "int4":
        return _unpack_int4(q)
    return q.astype(jnp.float32)


def quantize(fmt: str, w: jax.Array, parts: int = 1) -> tuple[jax.Array, jax.Array]:
    """Quantizes matrices w [..., in, out] (any float dtype; computed in float32).

    Returns (q [..., in, out] in the storage dtype ([..., in, out/2] uint8 for int4), scales
    float32 [..., nbi, nbo]). ``parts``: equal parts along out with their own blocks (gate_up: 2).
    """
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"cannot quantize to {fmt!r}; expected one of {QUANT_FORMATS}")
    *_, n_in, n_out = w.shape
    if n_out % parts or (fmt == "int4" and (n_out // parts) % 2):
        raise ValueError(f"{fmt}: output width {n_out} does not split into {parts} part(s) of even width")
    bi, bo = block(fmt, n_in)
    w = w.astype(jnp.float32)
    # amax * (1 / qmax) rather than amax / qmax: XLA may rewrite a division by a constant into that
    # product inside a jit but not outside one; written as the product it is the same everywhere.
    s = block_amax(w, bi, bo, parts) * jnp.float32(1.0 / QMAX[fmt])
    full = expand_scales(s, n_in, n_out, bi, bo, parts)
    r = w / jnp.where(full > 0, full, jnp.float32(1))
    if fmt == "fp8":
        return r.astype(jnp.float8_e4m3fn), s
    qmax = QMAX[fmt]
    q = jnp.clip(jnp.round(r), -qmax, qmax)
    return (q.astype(jnp.int8) if fmt == "int8" else _pack_int4(q.astype(jnp.int8))), s


def dequantize(fmt: str, q: jax.Array, s: jax.Array | None, dtype, parts: int = 1) -> jax.Array:
    """Weights [..., in, out] in ``dtype`` from stored ``q`` and scales ``s``
    (``decode(q) * scale`` in float32, then cast). dense: ``q`` cast to ``dtype`` (identity when
    it is already in it)."""
    if fmt == "dense":
        return q.astype(dtype)
    v = decode(fmt, q)
    n_in, n_out = v.shape[-2:]
    bi, bo = block(fmt, n_in)
    return (v * expand_scales(s, n_in, n_out, bi, bo, parts)).astype(dtype)


def dequantize_expert(fmt: str, which: str, q: jax.Array, s: jax.Array | None, dtype) -> jax.Array:
    """:func:`dequantize` of a bank's rows; which: "gate_up" | "down" (sets the parts)."""
    return dequantize(fmt, q, s, dtype, PARTS[which])


# --------------------------------------------------------------------------------------------
# Banks
# --------------------------------------------------------------------------------------------
def _rows_per_step(n: int, row_bytes: int, limit: int = 1 << 30) -> int:
    """The largest divisor of n whose rows take at most ``limit`` bytes (at least 1)."""
    best = 1
    for c in range(1, n + 1):
        if n % c == 0 and c * row_bytes <= limit:
            best = c
    return best


def map_bank_rows(fn, arrays: tuple, rows_per_step: int | None = None):
    """Applies ``fn`` (device arrays -> tuple of arrays, row-wise) to host banks a chunk of rows at
    a time: each chunk is sliced from host memory and moved to the device, ``fn`` runs there, its
    outputs go back to host memory as scan outputs (DESIGN.md section 2), so the device holds one
    chunk. Returns the outputs, [N, ...] each, in host memory (``pinned_host`` where it exists)."""
    n = arrays[0].shape[0]
    row_bytes = sum(a.size // n * a.dtype.itemsize for a in arrays) * 4
    c = rows_per_step or _rows_per_step(n, row_bytes)

    def run(*banks):
        def body(_, i):
            xs = [jax.device_put(jax.lax.dynamic_slice_in_dim(b, i * c, c), jax.memory.Space.Device) for b in banks]
            return None, tuple(jax.device_put(y, jax.memory.Space.Host) for y in fn(*xs))
        _, ys = jax.lax.scan(body, None, jnp.arange(n // c))
        return tuple(y.reshape((n,) + y.shape[2:]) for y in ys)

    # no out_shardings: the scan outputs' own host placement makes arrays that JAX also *traces* as
    # host memory (out_shardings=pinned_host alone does not; ``cpu_experts.ensure_host_typed``),
    # which the compute_on CPU-expert mechanisms need
    return jax.jit(run)(*arrays)


def quantize_banks(banks, fmt: str, rows_per_step: int | None = None):
    """The expert banks in format ``fmt`` (a :data:`FORMATS` value or "dense"), quantized from
    dense banks (bf16 / fp32) by round-to-nearest, in host memory.

    "bfloat16" / "dense": dense banks stored in bfloat16 / unchanged. Quantizing banks that are
    already quantized is refused unless the format is the same (then they are returned as is).

    Raises:
      ValueError: unknown format, or a quantized source in another format.
    """
    from ftjax.experts.state import ExpertBanks
    target = bank_format(fmt)
    if banks.fmt != "dense":
        if target == banks.fmt and fmt != "bfloat16":
            return banks
        raise ValueError(f"expert banks are already {banks.fmt}; cannot convert them to {fmt}")
    if target == "dense":
        if fmt == "dense" or banks.gate_up.dtype == jnp.bfloat16:
            return banks
        gu, dn = map_bank_rows(lambda a, b: (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)),
                               (banks.gate_up, banks.down), rows_per_step)
        return ExpertBanks(gu, dn)

    def q(gu, dn):
        qg, sg = quantize(target, gu, PARTS["gate_up"])
        qd, sd = quantize(target, dn, PARTS["down"])
        return qg, qd, sg, sd

    qg, qd, sg, sd = map_bank_rows(q, (banks.gate_up, banks.down), rows_per_step)
    return ExpertBanks(qg, qd, (sg, sd), target)


def dequantize_banks_np(banks) -> tuple[np.ndarray, np.ndarray]:
    """Float32 numpy copies of the dequantized banks (tests, accuracy reports; small models)."""
    gu, dn = np.asarray(banks.gate_up), np.asarray(banks.down)
    if banks.fmt == "dense":
        return gu.astype(np.float32), dn.astype(np.float32)
    sg, sd = (np.asarray(s) for s in banks.scales)
    return (np.asarray(dequantize(banks.fmt, gu, sg, jnp.float32, 2)),
            np.asarray(dequantize(banks.fmt, dn, sd, jnp.float32, 1)))
