"""One decode token of the gated delta rule (the Gated DeltaNet layers' T = 1 step) as one Pallas kernel.

``ftjax.layers.gated_deltanet.gated_delta_decode`` takes one token's conv outputs (q, k per key head, v per
value head), its log decay g and write strength beta per value head, and the recurrent state S [dk, dv]
of every (row, value head). Per value head h (key head h // (Hv / Hk)):

    q <- l2norm(q) / sqrt(dk);  k <- l2norm(k)
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", 2024, the gated delta rule; transformers'
``torch_recurrent_gated_delta_rule`` for one token). In XLA that is the heads' repeat, the two L2 norms
and a few fusions over S, each a launch in the decode step of every Gated DeltaNet layer.

Kernel: program (b, h, j) holds columns ``[j*bv, (j+1)*bv)`` of S [dk, bv] in registers, normalises its
key head's q and k itself (no repeat), applies the decay, the delta correction and the output, and writes
S back over its input: the state is aliased to the output (``input_output_aliases``), so its buffer is
reused. Columns of S are independent (the update is linear in each column), so splitting dv is exact.
Every op is elementwise or a reduction over dk (no dot): float32 throughout, the reference's order of
operations, only the reductions' summation order may differ.

Generic Pallas primitives: interpreted on the CPU (the tests), lowered through Triton on a GPU. Not yet
measured on a GPU (``experiments/bench_gated_delta.py --stages=decode``), so ``auto`` does not pick it:
named only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import common, registry

#: Columns of S per program and Triton's warps (``KernelConfig.tiles``: ``gated_delta_step=(block_v,)`` or
#: ``(block_v, num_warps)``). 32: at B = 1 and qwen3.5-35b-a3b's 32 value heads, dv = 128, 128 programs
#: (about one per H200 SM), S's block 16 KiB float32. Not tuned: the first GPU run picks them.
BLOCK_V = 32
NUM_WARPS = 4
#: The L2 norm's epsilon (``ftjax.layers.gated_deltanet.l2_normalize``'s default, FLA's l2norm).
EPS = 1e-6


def supported(key_heads: int, value_heads: int, dk: int, dv: int, block_v: int = BLOCK_V) -> bool:
    """Shapes the kernel takes: dk and the column block min(block_v, dv) powers of two >= 16, dv a
    multiple of the block, the value heads a multiple of the key heads."""
    bv = min(block_v, dv)
    return common.pow2(dk) and dk >= 16 and common.pow2(bv) and bv >= 16 and dv % bv == 0 \
        and key_heads >= 1 and value_heads % key_heads == 0


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_in, o_ref, s_ref, *, rep, bv, scale, eps):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * bv, bv)

    def l2norm(x):  # l2_normalize: x * rsqrt(sum(x^2) + eps), float32
        x = x.astype(jnp.float32)
        return x * lax.rsqrt(jnp.sum(x * x) + eps)

    q = l2norm(q_ref[b, h // rep, :]) * scale  # [dk]
    k = l2norm(k_ref[b, h // rep, :])[:, None]  # [dk, 1]
    s = s_in[b, h, :, cols] * jnp.exp(g_ref[b, h].astype(jnp.float32))  # [dk, bv]
    delta = (v_ref[b, h, cols].astype(jnp.float32) - jnp.sum(s * k, axis=0)) * beta_ref[b, h].astype(jnp.float32)
    s = s + k * delta[None, :]
    o_ref[b, h, cols] = jnp.sum(s * q[:, None], axis=0)
    s_ref[b, h, :, cols] = s


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def decode_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array, *,
                interpret: bool = False, block_v: int = BLOCK_V, num_warps: int | None = NUM_WARPS):
    """``ftjax.layers.gated_deltanet.gated_delta_decode`` in one launch (module docstring).

    q, k: [B, Hk, dk] one token's queries and keys per key head, before the L2 norm (any float dtype);
    v: [B, Hv, dv]; g (log decay, <= 0), beta: [B, Hv]; state: float32 [B, Hv, dk, dv], aliased to the
    new state (its buffer is reused: under ``jit`` with the state donated, updated in place). Returns
    (o float32 [B, Hv, dv], the new state float32 [B, Hv, dk, dv]). interpret: Pallas interpret mode
    (CPU); block_v: columns of S per program; num_warps: Triton's.

    Raises:
      ValueError: shapes :func:`supported` rejects, or operands that disagree (the message names the
        operand, expected vs got).
    """
    bsz, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if not supported(hk, hv, dk, dv, block_v):
        raise ValueError(f"gated_delta_step kernel: unsupported shape (key heads {hk}, value heads {hv}, dk {dk}, "
                         f"dv {dv}, block_v {block_v}); expected dk and min(block_v, dv) powers of two >= 16, "
                         f"dv a multiple of the block, value heads a multiple of key heads")
    for name, got, want in (("q", q.shape, (bsz, hk, dk)), ("v", v.shape, (bsz, hv, dv)), ("g", g.shape, (bsz, hv)),
                            ("beta", beta.shape, (bsz, hv)), ("state", state.shape, (bsz, hv, dk, dv))):
        if got != want:
            raise ValueError(f"gated_delta_step kernel: {name} expected shape {want}, got {got}")
    if state.dtype != jnp.float32:
        raise ValueError(f"gated_delta_step kernel: state expected float32, got {state.dtype}")
    bv = min(block_v, dv)
    sd = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_kernel, rep=hv // hk, bv=bv, scale=dk ** -0.5, eps=EPS),
        out_shape=(sd((bsz, hv, dv), jnp.float32), sd(state.shape, jnp.float32)), grid=(bsz, hv, dv // bv),
        input_output_aliases={5: 1}, interpret=interpret, compiler_params=common.triton_params(interpret, num_warps),
        name="gated_delta_step",
    )(q, k, v, g, beta, state)


def maybe(q, k, v, g, beta, state):
    """:func:`decode_step` where the kernel config selects ``gated_delta_step`` for these operands, else
    None (the caller runs the reference)."""
    tiles = registry.tiles("gated_delta_step", {"block_v": BLOCK_V, "num_warps": NUM_WARPS})
    ok = k.ndim == 3 and v.ndim == 3 and state.dtype == jnp.float32 and \
        supported(k.shape[1], v.shape[1], k.shape[2], v.shape[2], tiles["block_v"])
    how = registry.mode("gated_delta_step", ok)
    if how == "xla":
        return None
    return decode_step(q, k, v, g, beta, state, interpret=how == "interpret", **tiles)


registry.register(registry.Kernel(
    "gated_delta_step", "ftjax.layers.gated_deltanet.gated_delta_decode",
    "Gated DeltaNet decode (T = 1): one token's gated delta rule with the q / k L2 norms and head grouping, "
    "the float32 state updated in place; power-of-two dk, dv a multiple of the column block min(block_v, dv) "
    "(a power of two >= 16); auto: not picked (named only): not yet measured on a GPU",
    auto=False, tiles=common.block_and_warps("gated_delta_step", "block_v", NUM_WARPS)))
