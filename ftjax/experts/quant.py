"""Quantized routed-expert weights: the dispatch over the storage-format registry.

The formats themselves (storage dtype, block rule, qmax, quantize / decode, bytes per expert, fused
kernel support) live one per module in ``ftjax.experts.formats``; this module keeps the functions
the rest of ftjax calls, keyed by a format's ``--expert_dtype`` value or ``ExpertBanks.fmt`` tag,
and the bank-level work (quantizing host banks a chunk of rows at a time). Built-in formats:

=========  ======================  =========================  ===================================
format     stored weight            block (bi x bo)            decode(q)
=========  ======================  =========================  ===================================
dense      compute dtype (or bf16)  none (no scales)           identity (cast to compute dtype)
int8       int8 in [-127, 127]      in x 1 (per out channel)   q
int4       uint8, 2 per byte        INT4_GROUP x 1             nibble - 8, nibble in [1, 15]
fp8        float8_e4m3fn            128 x 128                  q (as float32)
=========  ======================  =========================  ===================================

Dequantization happens inside the expert computation on the weights a call reads (the gathered
k experts of a decode step, the layer's E experts of a grouped prefill), never on a whole pool:
``dequantize`` is what ``ftjax.experts.compute`` calls; dense is the format whose dequant is the
identity. See docs/QUANTIZATION.md for the byte counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts import formats
from ftjax.experts.formats import block_amax, expand_scales  # noqa: F401  (public helpers, re-exported)
from ftjax.experts.formats import fp8 as _fp8
from ftjax.experts.formats import int4 as _int4

#: ``--expert_dtype`` choices, from the registry. "bfloat16" keeps the banks dense (stored in bfloat16).
FORMATS = formats.expert_dtypes()
#: Formats with scales.
QUANT_FORMATS = tuple(f.name for f in formats.all_formats() if f.has_scales)
#: Largest decoded magnitude and storage dtype of each format with scales.
QMAX = {f.name: f.qmax for f in formats.all_formats() if f.has_scales}
STORAGE = {f.name: f.storage for f in formats.all_formats() if f.has_scales}
#: int4 group size along the input dimension (one float32 scale per 64 inputs of an output column).
INT4_GROUP = _int4.GROUP
#: fp8 block shape (input rows x output columns), that of the official fp8 checkpoints.
FP8_BLOCK = _fp8.BLOCK
FP8_MAX = _fp8.FORMAT.qmax  # 448
#: parts of each bank's matrix along the output axis: gate_up = gate | up, down = one matrix.
PARTS = {"gate_up": 2, "down": 1}


def bank_format(expert_dtype: str) -> str:
    """The ``ExpertBanks.fmt`` of an ``--expert_dtype`` value or tag ("bfloat16" -> "dense").

    Raises:
      ValueError: an unknown format.
    """
    return formats.get(expert_dtype).name


def block(fmt: str, in_dim: int) -> tuple[int, int]:
    """(bi, bo) of a quantized format for a matrix with ``in_dim`` inputs (ValueError for dense)."""
    return formats.get(fmt).block(in_dim)


def scale_shape(fmt: str, in_dim: int, out_dim: int, parts: int = 1) -> tuple[int, int]:
    """Shape of one matrix's scales: [ceil(in/bi), parts * ceil(out/parts/bo)]."""
    return formats.get(fmt).scale_shape(in_dim, out_dim, parts)


def stored_shape(fmt: str, in_dim: int, out_dim: int) -> tuple[int, int]:
    """Shape of one stored matrix (int4 packs two columns per byte)."""
    return formats.get(fmt).stored_shape(in_dim, out_dim)


def expert_bytes(fmt: str, hidden: int, ffn: int, itemsize: int = 2) -> int:
    """Bytes of one expert (gate, up, down and scales) as stored in format ``fmt`` (dense:
    ``itemsize`` bytes per weight). The formula ``ExpertBanks.expert_bytes`` must equal."""
    return formats.get(fmt).expert_bytes(hidden, ffn, itemsize)


def decode(fmt: str, q: jax.Array) -> jax.Array:
    """Stored values as float32 before scaling ([..., in, out])."""
    return formats.get(fmt).decode(q)


def quantize(fmt: str, w: jax.Array, parts: int = 1) -> tuple[jax.Array, jax.Array]:
    """Quantizes matrices w [..., in, out] (any float dtype; computed in float32).

    Returns (q [..., in, out / pack] in the storage dtype, scales [..., nbi, nbo]). ``parts``:
    equal parts along out with their own blocks (gate_up: 2).

    Raises:
      ValueError: an unknown format or one without scales, or an output width ``parts`` and the
        format's packing do not divide.
    """
    return formats.get(fmt).quantize(w, parts)


def dequantize(fmt: str, q: jax.Array, s: jax.Array | None, dtype, parts: int = 1) -> jax.Array:
    """Weights [..., in, out] in ``dtype`` from stored ``q`` and scales ``s``
    (``decode(q) * scale`` in float32, then cast). dense: ``q`` cast to ``dtype`` (identity when
    it is already in it)."""
    return formats.get(fmt).dequantize(q, s, dtype, parts)


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
    """The expert banks in format ``fmt`` (a :data:`FORMATS` value or a bank tag), quantized from
    dense banks (bf16 / fp32) by round-to-nearest, in host memory.

    "bfloat16": dense banks stored in bfloat16; "dense" (the tag): unchanged. Quantizing banks that
    are already quantized is refused unless the format is the same (then they are returned as is).

    Raises:
      ValueError: unknown format, or a quantized source in another format.
    """
    from ftjax.experts.state import ExpertBanks
    target = formats.get(fmt)
    if formats.get(banks.fmt).has_scales:
        if target.name == banks.fmt:
            return banks
        raise ValueError(f"expert banks are already {banks.fmt}; cannot convert them to {fmt}")
    if not target.has_scales:  # dense: the tag keeps the banks, the --expert_dtype value casts them
        if fmt == target.name or banks.gate_up.dtype == target.storage:
            return banks
        gu, dn = map_bank_rows(lambda a, b: (a.astype(target.storage), b.astype(target.storage)),
                               (banks.gate_up, banks.down), rows_per_step)
        return ExpertBanks(gu, dn)

    def q(gu, dn):
        qg, sg = target.quantize(gu, PARTS["gate_up"])
        qd, sd = target.quantize(dn, PARTS["down"])
        return qg, qd, sg, sd

    qg, qd, sg, sd = map_bank_rows(q, (banks.gate_up, banks.down), rows_per_step)
    return ExpertBanks(qg, qd, (sg, sd), target.name)


def dequantize_banks_np(banks) -> tuple[np.ndarray, np.ndarray]:
    """Float32 numpy copies of the dequantized banks (tests, accuracy reports; small models)."""
    gu, dn = np.asarray(banks.gate_up), np.asarray(banks.down)
    fmt = formats.get(banks.fmt)
    if not fmt.has_scales:
        return gu.astype(np.float32), dn.astype(np.float32)
    sg, sd = (np.asarray(s) for s in banks.scales)
    return (np.asarray(fmt.dequantize(gu, sg, jnp.float32, PARTS["gate_up"])),
            np.asarray(fmt.dequantize(dn, sd, jnp.float32, PARTS["down"])))
