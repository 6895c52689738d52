"""Storage formats of the routed-expert banks: one module per format, found automatically.

Every module of this package (other than ``_private`` ones) defines ``FORMAT``, an instance of an
:class:`ExpertFormat` subclass; :func:`all_formats` imports them all on first use (``pkgutil``), so
adding a format is one new file here (plus a fused GPU decode kernel in
``ftjax/kernels/moe_decode.py`` only if it wants one; without it the expert FFN dequantizes with the
format's jnp :meth:`ExpertFormat.dequantize`). ``ftjax.experts.quant`` is the thin dispatch the
rest of ftjax calls; ``--expert_dtype`` choices, ``ExpertBanks.fmt`` tags, the fused kernel's
format list and the tests all read this registry.

One concept, block-wise symmetric scales. A weight matrix is stored as ``[in, out]`` (the banks'
layout: gate_up ``[D, 2F]``, down ``[F, D]``), cut into blocks of ``bi`` input rows x ``bo``
output columns, each with one scale: ``w ~= decode(q) * scale[block]``. One matrix's scales have
shape ``[ceil(in / bi), ceil(out / bo)]`` (a partial block at an edge is a block too). A fused
gate_up matrix is ``parts = 2`` matrices side by side (gate | up), each with its own blocks, so its
scales are ``[ceil(D / bi), 2 * ceil(F / bo)]``, gate blocks first. ``pack`` values share one
stored element along the output axis (int4: two per byte), so a stored matrix is ``[in, out / pack]``.
Dense (the ``bfloat16`` choice) is the format without scales, whose dequantization is a cast.
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np


# --------------------------------------------------------------------------------------------
# Scales: block maxima and their expansion to the matrix (shared by every block-wise format)
# --------------------------------------------------------------------------------------------
def expand_scales(s: jax.Array, in_dim: int, out_dim: int, bi: int, bo: int, parts: int) -> jax.Array:
    """Scales [..., nbi, parts * nbo] -> [..., in, out] (each weight's own scale), any dtype.

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


def pack_nibbles(u: jax.Array) -> jax.Array:
    """uint8 values in [0, 15], [..., out] -> uint8 [..., out/2]: byte j holds column 2j in its
    low nibble and column 2j + 1 in its high nibble."""
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(p: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_nibbles`: uint8 [..., out/2] -> uint8 [..., out] in [0, 15]."""
    return jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],))


# --------------------------------------------------------------------------------------------
# The format interface
# --------------------------------------------------------------------------------------------
class ExpertFormat:
    """One storage format of the expert banks (and of the device slot pools, which store the same).

    Subclasses set the class attributes and override :meth:`block`, :meth:`encode` and
    :meth:`decode` (and :meth:`scales_from_amax` / :meth:`scale_values` for scales that are not
    ``amax / qmax`` in float32); the rest (shapes, bytes, quantize, dequantize) follows.

    Attributes:
      name: the ``ExpertBanks.fmt`` tag (static: part of a compiled program's identity).
      expert_dtype: the ``--expert_dtype`` value that selects it (default: ``name``).
      storage: numpy dtype of the stored weights (dense: the dtype "bfloat16" casts to).
      pack: weights per stored element along the output axis (int4: 2 per uint8).
      qmax: the largest magnitude ``decode`` gives a weight the scale is fitted to; None: no scales.
      scale_dtype: numpy dtype of the stored scales.
      fused_decode: True when the fused MoE decode kernel (``ftjax.kernels.moe_decode``) has code
        for this format; False: decode always runs the jnp reference (gather + :meth:`dequantize`).
    """

    name: str = ""
    expert_dtype: str = ""
    storage: np.dtype | None = None
    pack: int = 1
    qmax: float | None = None
    scale_dtype: np.dtype = np.dtype(np.float32)
    fused_decode: bool = False

    def __init__(self):
        self.expert_dtype = self.expert_dtype or self.name

    def __repr__(self) -> str:
        return f"<expert format {self.name!r} (--expert_dtype={self.expert_dtype})>"

    @property
    def has_scales(self) -> bool:
        """False for dense, the one format stored without scales."""
        return self.qmax is not None

    # ---- layout ---------------------------------------------------------------------------
    def block(self, in_dim: int) -> tuple[int, int]:
        """(bi, bo): input rows x output columns sharing one scale, for a matrix of ``in_dim`` inputs.

        Raises:
          ValueError: a format without scales.
        """
        raise ValueError(f"format {self.name!r} has no blocks")

    def scale_shape(self, in_dim: int, out_dim: int, parts: int = 1) -> tuple[int, int]:
        """Shape of one matrix's scales: [ceil(in/bi), parts * ceil(out/parts/bo)]."""
        bi, bo = self.block(in_dim)
        return math.ceil(in_dim / bi), parts * math.ceil(out_dim // parts / bo)

    def stored_shape(self, in_dim: int, out_dim: int) -> tuple[int, int]:
        """Shape of one stored matrix: [in, out / pack]."""
        return in_dim, out_dim // self.pack

    def expert_bytes(self, hidden: int, ffn: int, itemsize: int = 2) -> int:
        """Bytes of one expert (gate, up, down and their scales) as stored; what one H2D copy of a
        miss moves and what ``ExpertBanks.expert_bytes`` measures. ``itemsize``: bytes per weight
        of a format without scales (dense banks keep the compute dtype)."""
        d, f = hidden, ffn
        if not self.has_scales:
            return 3 * d * f * itemsize
        n_scales = math.prod(self.scale_shape(d, 2 * f, 2)) + math.prod(self.scale_shape(f, d, 1))
        return 3 * d * f // self.pack * self.storage.itemsize + n_scales * self.scale_dtype.itemsize

    # ---- values ---------------------------------------------------------------------------
    def scales_from_amax(self, amax: jax.Array) -> jax.Array:
        """Stored scales of blocks whose max |w| is ``amax`` (float32): ``amax * float32(1 / qmax)``
        (the product, not a division: XLA may rewrite a division by a constant into that product
        inside a jit and not outside one; written as the product it is the same everywhere). A
        block of zeros gets scale 0."""
        return amax * jnp.float32(1.0 / self.qmax)

    def scale_values(self, s: jax.Array) -> jax.Array:
        """Stored scales -> the float32 multipliers of :meth:`decode`'s values (same shape)."""
        return s

    def encode(self, r: jax.Array) -> jax.Array:
        """float32 ``w / scale`` [..., in, out] -> stored values [..., in, out / pack] (rounded)."""
        raise NotImplementedError

    def decode(self, q: jax.Array) -> jax.Array:
        """Stored values [..., in, out / pack] -> float32 [..., in, out], before scaling."""
        return q.astype(jnp.float32)

    def quantize(self, w: jax.Array, parts: int = 1) -> tuple[jax.Array, jax.Array]:
        """Quantizes matrices w [..., in, out] (any float dtype; computed in float32), on whatever
        device holds them (the banks are quantized a chunk of rows at a time on the device).

        Returns (q [..., in, out / pack] in :attr:`storage`, scales [..., nbi, nbo] in
        :attr:`scale_dtype`). ``parts``: equal parts along out with their own blocks (gate_up: 2).

        Raises:
          ValueError: a format without scales, or an output width that does not split into
            ``parts`` parts whose widths ``pack`` divides.
        """
        if not self.has_scales:
            raise ValueError(f"cannot quantize to {self.name!r}: it has no scales")
        *_, n_in, n_out = w.shape
        if n_out % parts or (n_out // parts) % self.pack:
            raise ValueError(f"{self.name}: output width {n_out} does not split into {parts} part(s) "
                             f"of a width divisible by {self.pack}")
        bi, bo = self.block(n_in)
        w = w.astype(jnp.float32)
        s = self.scales_from_amax(block_amax(w, bi, bo, parts))
        full = expand_scales(self.scale_values(s), n_in, n_out, bi, bo, parts)
        return self.encode(w / jnp.where(full > 0, full, jnp.float32(1))), s

    def dequantize(self, q: jax.Array, s: jax.Array | None, dtype, parts: int = 1) -> jax.Array:
        """Weights [..., in, out] in ``dtype``: ``decode(q) * scale`` in float32, then cast. The
        jnp reference the expert FFN runs on the rows a call reads (never on a whole pool)."""
        v = self.decode(q)
        n_in, n_out = v.shape[-2:]
        bi, bo = self.block(n_in)
        return (v * expand_scales(self.scale_values(s), n_in, n_out, bi, bo, parts)).astype(dtype)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------
@functools.cache
def all_formats() -> tuple[ExpertFormat, ...]:
    """Every registered format: the ``FORMAT`` of each module of this package, formats without
    scales first, then by name.

    Raises:
      TypeError / ValueError: a module without an ``ExpertFormat`` ``FORMAT``, or two formats that
        share a name.
    """
    found: dict[str, ExpertFormat] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_"):
            continue
        fmt = getattr(importlib.import_module(f"{__name__}.{mod.name}"), "FORMAT", None)
        if not isinstance(fmt, ExpertFormat):
            raise TypeError(f"{__name__}.{mod.name} defines no FORMAT (an ExpertFormat)")
        for key in {fmt.name, fmt.expert_dtype}:
            if key in found:
                raise ValueError(f"expert format name {key!r} is registered twice ({mod.name}, {found[key].name})")
            found[key] = fmt
    return tuple(sorted(set(found.values()), key=lambda f: (f.has_scales, f.name)))


def expert_dtypes() -> tuple[str, ...]:
    """The ``--expert_dtype`` choices, in registry order."""
    return tuple(f.expert_dtype for f in all_formats())


def get(name: str) -> ExpertFormat:
    """The format whose ``expert_dtype`` or ``name`` (the ``ExpertBanks.fmt`` tag) is ``name``.

    Raises:
      ValueError: no such format (the message names it and lists the known ones).
    """
    for fmt in all_formats():
        if name in (fmt.name, fmt.expert_dtype):
            return fmt
    known = ", ".join(sorted({n for f in all_formats() for n in (f.expert_dtype, f.name)}))
    raise ValueError(f"unknown expert format {name!r}; known formats: {known}")
