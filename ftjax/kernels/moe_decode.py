"""Fused MoE decode: each routed (token, expert) pair reads its expert's weights straight from the
slot pool by slot id, with no gathered copy of the weights.

The reference is ``ftjax.experts.compute.gather_outputs`` (jnp): it gathers the k experts'
weights of every token into a temporary ``[N, k, D, 2F]`` (a second pass over ~75 MB per layer
of qwen3-30b-a3b at batch 1) and then runs two einsums that XLA lowers, at batch 1, to
elementwise multiply + reduce fusions. Here two Pallas kernels compute the same per-pair outputs
``[P, D]`` (P = N*k pairs) from the pool in place:

1. gate/up: grid (P, F / block_f). Program (p, j) loads slot ``slots[p]`` and, in steps of
   ``block_d`` input rows, accumulates in float32 the gate columns ``[j*bf, (j+1)*bf)`` and the
   matching up columns ``F + ...`` of ``gate_up[slot]`` against token ``p // k``; then
   ``h = silu(gate) * up`` ([P, F], the input dtype).
2. down: grid (P, D / block_f). Program (p, j) accumulates ``h[p] @ down[slot][:, j*bf:(j+1)*bf]``
   over F in steps of ``block_d`` rows (the gate/up tile transposed; ``down_cols`` / ``down_rows``
   set the down tile apart).

With ``d_split > 1`` the gate/up stage also splits the D input rows over that many programs
(grid (P, F / block_f, d_split)) and writes their float32 partial sums of gate and up; outside
the kernel they are added up in float32 and then gated (``common.silu_mul``, the same roundings to the
input dtype as with one part), in every format including int4, so a split changes only the
float32 summation order. (Summing and gating them in the down stage's programs instead, as they
read h, saves that one small XLA kernel per layer but made the down stage 1.8x slower on the
H200; docs/PROFILE.md.) At batch 1 there are only 8 pairs, and more
programs keep more loads in flight. The model's calls take their tiles from the engine's
kernel config (``KernelConfig.tiles``, entry ``moe_decode``: block_d, block_f, num_warps, d_split[,
down_cols, down_rows]; :func:`tiles`), else the module defaults (by format), whose d_split gives the gate/up stage
at least 256 programs (:func:`auto_d_split`: 4 at batch 1 of qwen3-30b-a3b, 1 from batch 4; for int4 too);
``experiments/check_kernels_gpu.py`` sweeps them.

Each weight byte is read once (decode is a batched GEMV, bandwidth-bound: the matrix-vector
products are written as broadcast-multiply + row reductions, not ``dot``, which needs 16 rows).
The weighted sum over k stays in jnp (``experts_gather``) so the CPU-miss path of
``ftjax.experts.miss_policy``, which replaces some pairs' outputs, shares the kernel.

Quantized pools are dequantized inside the kernel (``ftjax.experts.quant`` layouts): ``int8``
multiplies each column's float32 accumulator by its per-column scale at the end; ``fp8``
multiplies each tile's partial sum by its 128x128 block scale (tiles must not straddle blocks).
``int4`` unpacks each byte's two nibbles (even, odd column) and accumulates even and odd
columns apart, with their scales read through a free reshape of the scales ``[..., 2F]`` ->
``[..., F, 2]``, so no interleave is needed. Its loops run over the 64-row scale groups (a
d_split part is whole groups): the row steps of a group (64 / block_d of them) are summed unscaled
and the group's scales read and multiplied once per column (with block_d = 64, the default, a step
is a group).

Backend choice: the kernels use only generic Pallas primitives (whole-array refs indexed with
``pl.ds`` and a slot id read from a ref, ``lax.fori_loop``), so they run on the CPU in interpret
mode (``interpret=True``; the tests) and lower on the GPU through Pallas' Triton backend (the
default GPU lowering of a ``pallas_call`` without Mosaic GPU compiler params in jax 0.11.2; it is
deprecated but still shipped). Mosaic GPU was not used: its TMA / warpgroup-matmul model wants
64-row tiles of a dense operand, while this is a 1-to-64-row GEMV over weights chosen by a
data-dependent slot id; the Triton backend has no scalar prefetch but reads the slot id inside
the kernel and offsets the pool pointer by it (64-bit offsets when a pool exceeds 4 GiB,
as jax's Triton lowering does by itself). Idea: the fused-MoE kernels of vLLM / SGLang
(expert weights addressed by id inside the kernel instead of gathered).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.experts import formats, quant
from ftjax.kernels import common, registry

#: Default tiles (input rows per step, output columns per program); the GPU script sweeps others.
#: d_split 0 = :func:`auto_d_split`.
BLOCK_D, BLOCK_F, D_SPLIT = 64, 64, 0
#: The input rows per step and Triton warps of 16-bit ("dense") pools, whose steps may span more rows than a
#: quantized format's scale group. Measured in the model on an H100 (2026-12-05, 16-layer cuts, resident decode,
#: ``experiments/profile_step.py --kernel_tiles=moe_decode:128/64/8/0`` against the 64-row, 4-warp default):
#: the experts' device time a step at batch 1 0.639 -> 0.576 ms (qwen3-30b-a3b) and 0.567 -> 0.494 ms
#: (qwen3.5-35b-a3b), at batch 4 2.173 -> 1.766 and 1.961 -> 1.366 ms; whole steps 1.636 -> 1.571, 2.222 -> 2.156
#: (batch 1) and 3.449 -> 3.159, 4.396 -> 3.803 ms (batch 4, back to back).
DENSE_BLOCK_D, DENSE_NUM_WARPS = 128, 8
#: Programs of the gate/up stage that :func:`auto_d_split` aims for (an H200 has 132 SMs).
MIN_PROGRAMS = 256
FP8_BLOCK = 128
#: Bank formats the kernels have code for: those whose registry entry says ``fused_decode``
#: (``ftjax.experts.formats``); any other format decodes with the jnp reference.
FORMATS = tuple(f.name for f in formats.all_formats() if f.fused_decode)


def supported(x: jax.Array, gate_up: jax.Array, down: jax.Array, fmt: str, block_d: int = BLOCK_D,
              block_f: int = BLOCK_F, d_split: int = 1, down_cols: int = 0, down_rows: int = 0) -> bool:
    """True when the kernels handle these operands: format in :data:`FORMATS`, float x, power-of-two
    tiles dividing D (times d_split) and F, fp8 tiles inside its 128x128 blocks, int4 row steps inside
    its 64-row groups and each of its d_split parts whole groups. down_cols / down_rows: the down
    stage's tile (0: block_f, block_d; see :func:`moe_decode_pairs`)."""
    d, f = x.shape[-1], down.shape[1]
    if fmt not in FORMATS or not jnp.issubdtype(x.dtype, jnp.floating) or d_split < 1:
        return False
    packed = 2 if fmt == "int4" else 1  # int4: two columns per byte
    if gate_up.shape[1:] != (d, 2 * f // packed) or down.shape[2] != d // packed:
        return False
    tiles = [min(block_d, d), min(block_f, f), min(down_rows or block_d, f), min(down_cols or block_f, d)]
    if (any(t < 1 or t & (t - 1) for t in tiles) or d % (tiles[0] * d_split) or f % tiles[1] or f % tiles[2]
            or d % tiles[3]):
        return False
    if fmt == "fp8":
        return d % FP8_BLOCK == 0 and f % FP8_BLOCK == 0 and all(FP8_BLOCK % t == 0 for t in tiles)
    if fmt == "int4":  # input-row steps inside one scale group, d_split parts of whole groups; output tiles
        g = quant.INT4_GROUP  # of whole column pairs
        return (d % (g * d_split) == 0 and f % g == 0 and g % tiles[0] == 0 and g % tiles[2] == 0
                and tiles[1] >= 2 and tiles[3] >= 2)
    return True


def _gate_up_kernel(slots_ref, x_ref, gu_ref, *rest, k, f, bd, bf, fmt, split):
    s_ref = rest[0] if fmt != "dense" else None
    outs = rest[1:] if fmt != "dense" else rest
    p, j, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = common.wrap_clamp(slots_ref[p], gu_ref.shape[0])
    n = p // k
    f0 = j * bf
    d_steps = x_ref.shape[1] // (bd * split)
    base = part * (d_steps * bd)  # this program's share of the input rows (split > 1)

    def body(i, carry):
        g, u = carry
        d0 = base + i * bd
        xb = x_ref[n, pl.ds(d0, bd)].astype(jnp.float32)[:, None]
        pg = jnp.sum(xb * gu_ref[slot, pl.ds(d0, bd), pl.ds(f0, bf)].astype(jnp.float32), axis=0)
        pu = jnp.sum(xb * gu_ref[slot, pl.ds(d0, bd), pl.ds(f + f0, bf)].astype(jnp.float32), axis=0)
        if fmt == "fp8":  # one block scale per tile: gate blocks first, then up blocks
            r, c = d0 // FP8_BLOCK, f0 // FP8_BLOCK
            pg = pg * s_ref[slot, r, c]
            pu = pu * s_ref[slot, r, f // FP8_BLOCK + c]
        return g + pg, u + pu

    zeros = jnp.zeros((bf,), jnp.float32)
    g, u = lax.fori_loop(0, d_steps, body, (zeros, zeros))
    if fmt == "int8":  # one scale per output column
        g = g * s_ref[slot, 0, pl.ds(f0, bf)]
        u = u * s_ref[slot, 0, pl.ds(f + f0, bf)]
    if split == 1:
        outs[0][p, pl.ds(f0, bf)] = common.silu_mul(g, u, outs[0].dtype)
    else:  # partial sums, added up (and gated) outside
        outs[0][part, p, pl.ds(f0, bf)] = g
        outs[1][part, p, pl.ds(f0, bf)] = u


def _down_kernel(slots_ref, h_ref, dn_ref, *rest, bd, bf, fmt):
    s_ref, y_ref = (rest[0], rest[1]) if fmt != "dense" else (None, rest[0])
    p, j = pl.program_id(0), pl.program_id(1)
    slot = common.wrap_clamp(slots_ref[p], dn_ref.shape[0])
    d0 = j * bd
    f_steps = h_ref.shape[1] // bf

    def body(i, acc):
        f0 = i * bf
        hb = h_ref[p, pl.ds(f0, bf)].astype(jnp.float32)[:, None]
        part = jnp.sum(hb * dn_ref[slot, pl.ds(f0, bf), pl.ds(d0, bd)].astype(jnp.float32), axis=0)
        if fmt == "fp8":
            part = part * s_ref[slot, f0 // FP8_BLOCK, d0 // FP8_BLOCK]
        return acc + part

    acc = lax.fori_loop(0, f_steps, body, jnp.zeros((bd,), jnp.float32))
    if fmt == "int8":
        acc = acc * s_ref[slot, 0, pl.ds(d0, bd)]
    y_ref[p, pl.ds(d0, bd)] = acc.astype(y_ref.dtype)


def _nibbles(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 tile -> (low, high) nibbles as float32 values q - 8 (even, odd columns)."""
    q = q.astype(jnp.int32)
    return ((q & 0xF) - 8).astype(jnp.float32), ((q >> 4) - 8).astype(jnp.float32)


def _gate_up_kernel_int4(slots_ref, x_ref, gu_ref, s_ref, *outs, k, f, bd, bf, split):
    """int4: gu_ref uint8 [S, D, F] (two columns per byte), s_ref [S, D/64, F, 2] (the scales
    [S, D/64, 2F] with each column pair split into (even, odd)). Even and odd columns are
    accumulated apart, so no interleaving (and no strided access) is needed.

    The loop runs over 64-row scale groups (program ``part`` of ``split`` takes groups
    ``[part * D/64/split, (part+1) * D/64/split)``); a group's ``64 / bd`` row steps are summed
    unscaled and multiplied by the group's scales once (one scale read per group and column,
    whatever bd; with bd = 64 a step is a group). Output: split 1: h_ref [P, F/2, 2] (h with its
    column pairs split the same way); split > 1: float32 partial sums of gate and up, each
    [split, P, 2, F/2] (even columns, then odd), added up and gated outside."""
    p, j, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = common.wrap_clamp(slots_ref[p], gu_ref.shape[0])
    n = p // k
    half = bf // 2
    c0 = j * half  # first column pair of the tile
    grp_rows = quant.INT4_GROUP
    groups = x_ref.shape[1] // (grp_rows * split)  # scale groups of this program

    def body(i, carry):
        grp = part * groups + i
        acc = None
        for sub in range(grp_rows // bd):  # the group's row steps, unscaled
            d0 = grp * grp_rows + sub * bd
            xb = x_ref[n, pl.ds(d0, bd)].astype(jnp.float32)[:, None]
            sums = []
            for pair0 in (c0, f // 2 + c0):  # gate, up
                lo, hi = _nibbles(gu_ref[slot, pl.ds(d0, bd), pl.ds(pair0, half)])
                sums += [jnp.sum(xb * lo, axis=0), jnp.sum(xb * hi, axis=0)]
            acc = sums if acc is None else [a + b for a, b in zip(acc, sums)]
        ge, go, ue, uo = acc
        return (carry[0] + ge * s_ref[slot, grp, pl.ds(c0, half), 0],
                carry[1] + go * s_ref[slot, grp, pl.ds(c0, half), 1],
                carry[2] + ue * s_ref[slot, grp, pl.ds(f // 2 + c0, half), 0],
                carry[3] + uo * s_ref[slot, grp, pl.ds(f // 2 + c0, half), 1])

    zeros = jnp.zeros((half,), jnp.float32)
    ge, go, ue, uo = lax.fori_loop(0, groups, body, (zeros,) * 4)
    if split == 1:
        h_ref = outs[0]
        h_ref[p, pl.ds(c0, half), 0] = common.silu_mul(ge, ue, h_ref.dtype)
        h_ref[p, pl.ds(c0, half), 1] = common.silu_mul(go, uo, h_ref.dtype)
    else:  # partial sums, added up (and gated) outside; even and odd columns in contiguous rows
        g_ref, u_ref = outs
        g_ref[part, p, 0, pl.ds(c0, half)] = ge
        g_ref[part, p, 1, pl.ds(c0, half)] = go
        u_ref[part, p, 0, pl.ds(c0, half)] = ue
        u_ref[part, p, 1, pl.ds(c0, half)] = uo


def _down_kernel_int4(slots_ref, h_ref, dn_ref, s_ref, y_ref, *, bd, bf):
    """int4: dn_ref uint8 [S, F, D/2], s_ref [S, F/64, D/2, 2], y_ref [P, D/2, 2]. Like the gate/up
    kernel, the loop runs over 64-row scale groups of F and scales each group's unscaled sum of its
    ``64 / bf`` row steps once."""
    p, j = pl.program_id(0), pl.program_id(1)
    slot = common.wrap_clamp(slots_ref[p], dn_ref.shape[0])
    half = bd // 2
    c0 = j * half
    grp_rows = quant.INT4_GROUP
    groups = h_ref.shape[1] // grp_rows

    def body(grp, carry):
        acc = None
        for sub in range(grp_rows // bf):
            f0 = grp * grp_rows + sub * bf
            hb = h_ref[p, pl.ds(f0, bf)].astype(jnp.float32)[:, None]
            lo, hi = _nibbles(dn_ref[slot, pl.ds(f0, bf), pl.ds(c0, half)])
            sums = (jnp.sum(hb * lo, axis=0), jnp.sum(hb * hi, axis=0))
            acc = sums if acc is None else (acc[0] + sums[0], acc[1] + sums[1])
        return (carry[0] + acc[0] * s_ref[slot, grp, pl.ds(c0, half), 0],
                carry[1] + acc[1] * s_ref[slot, grp, pl.ds(c0, half), 1])

    zeros = jnp.zeros((half,), jnp.float32)
    ye, yo = lax.fori_loop(0, groups, body, (zeros, zeros))
    y_ref[p, pl.ds(c0, half), 0] = ye.astype(y_ref.dtype)
    y_ref[p, pl.ds(c0, half), 1] = yo.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "interpret", "block_d", "block_f", "num_warps", "num_stages",
                                             "d_split", "down_cols", "down_rows"))
def moe_decode_pairs(x: jax.Array, slots: jax.Array, gate_up: jax.Array, down: jax.Array,
                     scales: tuple | None = None, fmt: str = "dense", *, interpret: bool = False,
                     block_d: int = BLOCK_D, block_f: int = BLOCK_F, num_warps: int | None = None,
                     num_stages: int | None = None, d_split: int = 1, down_cols: int = 0,
                     down_rows: int = 0) -> jax.Array:
    """Per-(token, k) expert outputs [N, k, D] in x's dtype, weights read from the pool by slot.

    x: [N, D] float; slots: int32 [N, k] pool slots (negative ids wrap and out-of-range ids clamp,
    as a jnp gather would); gate_up: [S, D, 2F] (gate columns first, then up); down: [S, F, D];
    scales: the pool's (gate_up, down) float32 scales for a quantized ``fmt`` (int8: [S, 1, 2F]
    and [S, 1, D]; fp8: [S, D/128, 2F/128] and [S, F/128, D/128]; int4: uint8 pools [S, D, F] and
    [S, F, D/2] with scales [S, D/64, 2F] and [S, F/64, D]). interpret: run the kernels in
    Pallas interpret mode (CPU). block_d / block_f: the gate/up stage's tile (block_d input rows
    per step, block_f output columns per program; powers of two); down_cols / down_rows: the down
    stage's tile (output columns of D per program, rows of F per step; 0 = block_f / block_d, the
    same tile transposed); num_warps / num_stages: Triton compiler parameters on the GPU (None: its
    defaults), for both stages; d_split: the gate/up stage splits the D input rows over this many
    programs (more parallelism at batch 1; int4: parts of whole 64-row scale groups), whose float32
    partial sums are added up in float32 before the gating, in every format (so a split changes
    only the float32 summation order of gate and up, not where they are rounded to x's dtype).

    Raises:
      ValueError: operands or tiles that :func:`supported` rejects.
    """
    if not supported(x, gate_up, down, fmt, block_d, block_f, d_split, down_cols, down_rows):
        raise ValueError(f"moe_decode: unsupported {fmt} operands or tiles (x {x.shape}, gate_up {gate_up.shape}, "
                         f"down {down.shape}, block_d={block_d} block_f={block_f} d_split={d_split} "
                         f"down_cols={down_cols} down_rows={down_rows})")
    n, k = slots.shape
    d, f = x.shape[1], down.shape[1]
    pairs = n * k
    flat = slots.reshape(-1).astype(jnp.int32)  # wrapped and clamped to the pool inside the kernels
    sg, sd = scales if scales is not None else (None, None)
    extra_g = () if fmt == "dense" else (sg.astype(jnp.float32),)
    extra_d = () if fmt == "dense" else (sd.astype(jnp.float32),)
    params = common.triton_params(interpret, num_warps, num_stages)
    bf1, bd1 = min(block_f, f), min(block_d, d)
    bd2, bf2 = min(down_cols or block_f, d), min(down_rows or block_d, f)
    if fmt == "int4":
        s_pool4 = lambda a: a.astype(jnp.float32).reshape(a.shape[:-1] + (a.shape[-1] // 2, 2))  # noqa: E731
        part4 = jax.ShapeDtypeStruct((d_split, pairs, 2, f // 2), jnp.float32)
        h = pl.pallas_call(
            functools.partial(_gate_up_kernel_int4, k=k, f=f, bd=bd1, bf=bf1, split=d_split),
            out_shape=jax.ShapeDtypeStruct((pairs, f // 2, 2), x.dtype) if d_split == 1 else (part4, part4),
            grid=(pairs, f // bf1, d_split), interpret=interpret, compiler_params=params,
            name="moe_decode_gate_up_int4",
        )(flat, x, gate_up, s_pool4(sg))
        if d_split == 1:
            h = h.reshape(pairs, f)
        else:  # [split, P, 2, F/2] -> [P, F] (columns 2c, 2c + 1 = even, odd of pair c), then as split 1
            g, u = (jnp.swapaxes(jnp.sum(a, axis=0), 1, 2).reshape(pairs, f) for a in h)
            h = common.silu_mul(g, u, x.dtype)
        y = pl.pallas_call(
            functools.partial(_down_kernel_int4, bd=bd2, bf=bf2),
            out_shape=jax.ShapeDtypeStruct((pairs, d // 2, 2), x.dtype), grid=(pairs, d // bd2),
            interpret=interpret, compiler_params=params, name="moe_decode_down_int4",
        )(flat, h, down, s_pool4(sd))
        return y.reshape(n, k, d)
    part = jax.ShapeDtypeStruct((d_split, pairs, f), jnp.float32)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, k=k, f=f, bd=bd1, bf=bf1, fmt=fmt, split=d_split),
        out_shape=jax.ShapeDtypeStruct((pairs, f), x.dtype) if d_split == 1 else (part, part),
        grid=(pairs, f // bf1, d_split), interpret=interpret, compiler_params=params, name="moe_decode_gate_up",
    )(flat, x, gate_up, *extra_g)
    if d_split > 1:
        h = common.silu_mul(jnp.sum(h[0], axis=0), jnp.sum(h[1], axis=0), x.dtype)
    y = pl.pallas_call(
        functools.partial(_down_kernel, bd=bd2, bf=bf2, fmt=fmt),
        out_shape=jax.ShapeDtypeStruct((pairs, d), x.dtype), grid=(pairs, d // bd2),
        interpret=interpret, compiler_params=params, name="moe_decode_down",
    )(flat, h, down, *extra_d)
    return y.reshape(n, k, d)


def parse_tiles(vals: tuple[int, ...]) -> dict:
    """A ``KernelConfig.tiles`` override, (block_d, block_f, num_warps, d_split[, down_cols, down_rows]), as
    keyword arguments (num_warps 0 = Triton's default, d_split 0 = :func:`auto_d_split`, down_cols /
    down_rows 0 or left out = the gate/up tile transposed).
    Raises:
      ValueError: not 4 or 6 integers, block_d or block_f < 1, a negative value."""
    vals = common.tile_values("moe_decode", vals, (4, 6), "block_d,block_f,num_warps,d_split[,down_cols,down_rows]")
    bd, bf, nw, ds, dc, dr = vals + (0,) * (6 - len(vals))
    if bd < 1 or bf < 1 or min(nw, ds, dc, dr) < 0:
        raise ValueError(f"tiles of kernel 'moe_decode' {vals}: block_d and block_f must be >= 1, num_warps, "
                         "d_split, down_cols and down_rows >= 0 (0: the default)")
    return {"block_d": bd, "block_f": bf, "num_warps": nw or None, "d_split": ds, "down_cols": dc, "down_rows": dr}


def tiles(fmt: str = "dense") -> dict:
    """The tiles the model's calls use for a pool of format ``fmt``: the active kernel config's ``moe_decode``
    override (:func:`parse_tiles`), else the module defaults (:data:`DENSE_BLOCK_D` and
    :data:`DENSE_NUM_WARPS` for "dense", :data:`BLOCK_D` and Triton's warps for the quantized formats)."""
    dense = fmt == "dense"
    return registry.tiles("moe_decode", {"block_d": DENSE_BLOCK_D if dense else BLOCK_D, "block_f": BLOCK_F,
                                         "num_warps": DENSE_NUM_WARPS if dense else None, "d_split": D_SPLIT,
                                         "down_cols": 0, "down_rows": 0})


def auto_d_split(pairs: int, d: int, f: int, block_d: int, block_f: int, fmt: str) -> int:
    """The smallest power-of-two d_split (at most 8) that gives the gate/up stage at least
    :data:`MIN_PROGRAMS` programs, within what D allows (parts of whole block_d steps; int4: of
    whole 64-row scale groups); 1 when there are enough."""
    programs = pairs * (f // min(block_f, f))
    rows = min(block_d, d)
    if fmt == "int4":
        rows = max(rows, quant.INT4_GROUP)
    split = 1
    while programs * split < MIN_PROGRAMS and split < 8 and d % (rows * split * 2) == 0:
        split *= 2
    return split


def maybe_pairs(x: jax.Array, slots: jax.Array, gate_up: jax.Array, down: jax.Array, scales: tuple | None,
                fmt: str) -> jax.Array | None:
    """The kernel's per-pair outputs [N, k, D] when the kernel config selects it for these operands
    (``registry.mode``), else None (the caller runs its jnp reference)."""
    t = tiles(fmt)
    if t["d_split"] == 0:
        t["d_split"] = auto_d_split(slots.size, x.shape[-1], down.shape[1], t["block_d"], t["block_f"], fmt)
    ok = supported(x, gate_up, down, fmt, t["block_d"], t["block_f"], t["d_split"], t["down_cols"], t["down_rows"])
    # int4 under auto: XLA, where the kernel was measured slower (docs/QUANTIZATION.md); by name it runs
    how = registry.mode("moe_decode", ok, auto=fmt != "int4")
    if how == "xla":
        return None
    return moe_decode_pairs(x, slots, gate_up, down, scales, fmt, interpret=how == "interpret", **t)


registry.register(registry.Kernel(
    "moe_decode", "ftjax.experts.compute.gather_outputs_reference",
    "a decode step's routed experts read from the slot pool by slot id (at most 64 pairs), dense / int8 / fp8 "
    "pools (int4 by name only); auto: GPU", tiles=parse_tiles))
