"""The Gated DeltaNet layer's short causal convolution (depthwise, SiLU) as one Pallas kernel.

``ftjax.layers.gated_deltanet.causal_conv`` runs over a call's tokens (the prompt of a prefill call,
one token in decode), continuing from the conv state (the K - 1 inputs before the call: what prefix
reuse stores per chunk and chunked prefill carries between calls), and returns the new state (the
K - 1 inputs up to each row's last real token). In XLA that is a concatenation of the state and the
call's inputs, K shifted multiply-adds and the SiLU (one or two fusions), and a per-row dynamic slice
for the state.

Kernel: program (b, j, i) writes rows ``[i*bt, (i+1)*bt)`` and channels ``[j*bc, (j+1)*bc)`` of row b's
output; tap ``m`` reads the inputs ``K - 1 - m`` positions back, from x where that position is >= 0 and
from the conv state before it (two masked loads, so the state is never concatenated in front of x);
the programs of the first time tile also write the channels' new state. Sums in float32 in the
reference's tap order, SiLU, the result in x's dtype; the state comes out in x's dtype as well (the
reference casts the state to x's dtype before the concatenation). The depthwise conv with the state in
and out is flash-linear-attention's / the ``causal-conv1d`` package's ``causal_conv1d_fn`` with
``initial_states`` and ``final_states_out``; this is a Pallas rewrite of the same computation.

Generic Pallas primitives plus the Triton backend's masked ``load`` / ``store`` (any T and channel
count): interpreted on the CPU (the tests), lowered through Triton on a GPU. Not yet measured on a GPU
(``experiments/bench_gated_delta.py --stages=conv``), so ``auto`` does not pick it: named only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ftjax.kernels import common, registry

#: Tokens and channels per program, Triton's warps (``KernelConfig.tiles``: ``causal_conv=(block_t,
#: block_c)`` or ``(block_t, block_c, num_warps)``); the tiles shrink to the call's T and channels
#: (rounded up to a power of two). Not tuned: the first GPU run picks them.
BLOCK_T = 64
BLOCK_C = 128
NUM_WARPS = 4
#: ``use="auto"`` picks the kernel for calls of at least this many tokens (prefill chunks): measured 2.1x
#: faster than XLA over an 8192-token prompt on an H200 (2026-12-04); the decode token's T = 1 is not measured.
AUTO_MIN_TOKENS = 64


def supported(taps: int, block_t: int = BLOCK_T, block_c: int = BLOCK_C) -> bool:
    """Shapes the kernel takes: at least 2 taps (a state of K - 1 >= 1 inputs), power-of-two tiles,
    ``block_t`` >= K - 1 (only the first time tile reads the state); any T and channel count (the
    edges are masked)."""
    return taps >= 2 and common.pow2(block_t) and common.pow2(block_c) and block_t >= taps - 1


def _kernel(len_ref, x_ref, w_ref, s_ref, o_ref, new_ref, *, t_len, c_len, taps, bt, bc, k_pad):
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chans = pl.ds(j * bc, bc)
    cols = j * bc + lax.broadcasted_iota(jnp.int32, (1, bc), 1)
    col_ok = cols < c_len
    rows = i * bt + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    dtype = x_ref.dtype

    def gathered(pos):
        """The conv inputs at positions pos [n, 1] (-(K-1) <= pos < T) in x's dtype: x from position 0 on,
        the state before it. Element-indexed loads (clamped, masked): no block starts before row 0."""
        in_x = pos >= 0
        at = jnp.minimum(cols, c_len - 1)
        xv = plt.load(x_ref.at[b, jnp.clip(pos, 0, t_len - 1), at], mask=in_x & col_ok, other=0)
        sv = plt.load(s_ref.at[b, jnp.clip(pos + taps - 1, 0, taps - 2), at], mask=~in_x & col_ok, other=0)
        return jnp.where(in_x, xv, sv.astype(dtype))

    def conv(tap_inputs):  # tap_inputs(m): [bt, bc], the inputs K - 1 - m positions before each row
        acc = 0  # the reference's sum: tap 0 (the oldest input) first
        for m in range(taps):
            w = plt.load(w_ref.at[pl.ds(m, 1), chans], mask=col_ok, other=0).astype(jnp.float32)  # [1, bc]
            acc = acc + tap_inputs(m).astype(jnp.float32) * w
        plt.store(o_ref.at[b, pl.ds(i * bt, bt), chans], jax.nn.silu(acc).astype(o_ref.dtype),
                  mask=(rows < t_len) & col_ok)

    @pl.when(i == 0)
    def _():  # the first tile reads the state and writes the new one (valid_len clamped as dynamic_slice clamps)
        conv(lambda m: gathered(rows - (taps - 1 - m)))
        r = lax.broadcasted_iota(jnp.int32, (k_pad, 1), 0)
        n = jnp.clip(len_ref[b], 0, t_len)
        plt.store(new_ref.at[b, pl.ds(0, k_pad), chans], gathered(n - (taps - 1) + r).astype(new_ref.dtype),
                  mask=(r < taps - 1) & col_ok)

    if t_len <= bt:  # one time tile
        return

    @pl.when(i > 0)
    def _():  # every other tile: block loads of x alone (i * bt >= K - 1)
        conv(lambda m: plt.load(x_ref.at[b, pl.ds(i * bt - (taps - 1 - m), bt), chans],
                                mask=(rows - (taps - 1 - m) < t_len) & col_ok, other=0))


@functools.partial(jax.jit, static_argnames=("interpret", "block_t", "block_c", "num_warps"))
def causal_conv(x: jax.Array, weight: jax.Array, conv_state: jax.Array, valid_len: jax.Array, *,
                interpret: bool = False, block_t: int = BLOCK_T, block_c: int = BLOCK_C,
                num_warps: int | None = NUM_WARPS):
    """``ftjax.layers.gated_deltanet.causal_conv`` in one launch (module docstring).

    x: [B, T, C] the call's conv inputs (right-padded); weight: [K, C] (tap K-1 multiplies the current
    token); conv_state: [B, K-1, C] the K-1 inputs before the call; valid_len: int32 [B] real tokens per
    row (clamped to [0, T]). Returns (silu(conv) [B, T, C] in x's dtype, the new state [B, K-1, C] in
    x's dtype: the K-1 inputs before position valid_len). interpret: Pallas interpret mode (CPU);
    block_t, block_c: the tokens and channels of one program (powers of two; shrunk to T and C rounded
    up to a power of two); num_warps: Triton's.

    Raises:
      ValueError: fewer than 2 taps, tiles that are not powers of two, or shapes that disagree (the
        message names the operand, expected vs got).
    """
    bsz, t, c = x.shape
    taps = weight.shape[0]
    if not supported(taps, block_t, block_c):
        raise ValueError(f"causal_conv kernel: expected >= 2 taps and power-of-two tiles, block_t >= taps - 1, "
                         f"got {taps} taps, "
                         f"block_t={block_t}, block_c={block_c}")
    for name, got, want in (("weight", weight.shape, (taps, c)), ("conv_state", conv_state.shape, (bsz, taps - 1, c)),
                            ("valid_len", valid_len.shape, (bsz,))):
        if got != want:
            raise ValueError(f"causal_conv kernel: {name} expected shape {want}, got {got}")
    bt, bc = min(block_t, pl.next_power_of_2(t)), min(block_c, pl.next_power_of_2(c))
    sd = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_kernel, t_len=t, c_len=c, taps=taps, bt=bt, bc=bc, k_pad=pl.next_power_of_2(taps - 1)),
        out_shape=(sd((bsz, t, c), x.dtype), sd((bsz, taps - 1, c), x.dtype)),
        grid=(bsz, pl.cdiv(c, bc), pl.cdiv(t, bt)), interpret=interpret,
        compiler_params=common.triton_params(interpret, num_warps), name="causal_conv",
    )(valid_len.astype(jnp.int32), x, weight, conv_state)


def maybe(x, weight, conv_state, valid_len):
    """:func:`causal_conv` where the kernel config selects ``causal_conv`` for these operands, else None
    (the caller runs the reference)."""
    tiles = registry.tiles("causal_conv", {"block_t": BLOCK_T, "block_c": BLOCK_C, "num_warps": NUM_WARPS})
    how = registry.mode("causal_conv", x.ndim == 3 and supported(weight.shape[0], tiles["block_t"], tiles["block_c"]),
                        auto=x.ndim == 3 and x.shape[1] >= AUTO_MIN_TOKENS)
    if how == "xla":
        return None
    return causal_conv(x, weight, conv_state, valid_len, interpret=how == "interpret", **tiles)


def _tiles(vals: tuple[int, ...]) -> dict:
    bt, bc, *rest = common.tile_values("causal_conv", vals, (2, 3),
                                       "(block_t, block_c) or (block_t, block_c, num_warps)")
    if not all(common.pow2(v) for v in (bt, bc, *rest)):
        raise ValueError(f"tiles of kernel 'causal_conv': block_t, block_c and num_warps must be powers of two, "
                         f"got {vals}")
    return {"block_t": bt, "block_c": bc, "num_warps": rest[0] if rest else NUM_WARPS}


registry.register(registry.Kernel(
    "causal_conv", "ftjax.layers.gated_deltanet.causal_conv",
    "Gated DeltaNet conv (prefill and decode): the depthwise causal conv with SiLU over a call's tokens, the "
    "conv state in and out, K >= 2 taps, any T and channel count; auto: calls of >= 64 tokens (prefill; "
    "0.30 vs 0.62 ms for XLA over 8192 tokens on an H200); the decode token runs XLA",
    auto=True, tiles=_tiles))
