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

Generic Pallas primitives: interpreted on the CPU (the tests), lowered through Triton on a GPU. Measured
(``experiments/bench_gated_delta.py --stages=decode``, docs/HYBRID.md) barely faster than XLA's, so ``auto`` does
not pick it: named only. ``auto`` does pick ``gated_deltanet_decode`` below, the whole mixer of a decode token in
one launch, for 16-bit models on a GPU since 2026-12-07 (:data:`MIXER_AUTO`); on 2026-12-06 (H100, 732bed9,
``experiments/results/gated_delta/bench_gated_delta_qwen3.5-35b-a3b_quick_h100_2026-12-06.json``) it had measured
no faster (367.5 against 364.9 tok/s), while the decode block still waited on the host every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ftjax.kernels import common, dense_decode, registry

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


def _l2norm(x, eps):
    """``ftjax.layers.gated_deltanet.l2_normalize`` of one head's vector inside a kernel: x * rsqrt(sum(x^2) + eps),
    float32."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x) + eps)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_in, o_ref, s_ref, *, rep, bv, scale, eps):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * bv, bv)

    q = _l2norm(q_ref[b, h // rep, :], eps) * scale  # [dk]
    k = _l2norm(k_ref[b, h // rep, :], eps)[:, None]  # [dk, 1]
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
    "(a power of two >= 16); auto: not picked (named only): measured barely faster than XLA's (H200, 2026-12-04: "
    "21.4 vs 23.9 us a chained step, docs/HYBRID.md)",
    auto=False, tiles=common.block_and_warps("gated_delta_step", "block_v", NUM_WARPS)))


# ---- the whole mixer of one decode token -------------------------------------------------------------------
#: Triton's warps of ``gated_deltanet_decode`` (``KernelConfig.tiles``: ``gated_deltanet_decode=(num_warps,)``): a
#: program holds one head's whole state [dk, dv] (64 KiB float32 at dk = dv = 128), 64 registers a thread at 8 warps.
MIXER_WARPS = 8


def mixer_supported(key_heads: int, value_heads: int, dk: int, dv: int, conv_dim: int, taps: int) -> bool:
    """Shapes ``gated_deltanet_decode`` takes: dk and dv powers of two >= 16, the value heads a multiple of the key
    heads, the conv channels laid out as q, k (key heads x dk each) then v (value heads x dv), and a conv of at
    least 2 taps (a state of at least one row)."""
    return common.pow2(dk) and dk >= 16 and common.pow2(dv) and dv >= 16 and key_heads >= 1 and taps >= 2 \
        and value_heads % key_heads == 0 and conv_dim == 2 * key_heads * dk + value_heads * dv


def _mixer_kernel(layers_ref, vlen_ref, qkv_ref, z_ref, b_ref, a_ref, conv_ref, convw_ref, alog_ref, dtb_ref,
                  normw_ref, rec_in, y_ref, conv_out, rec_ref, *, rep, hk, dk, dv, taps, scale, l2_eps, norm_eps):
    bi, h = pl.program_id(0), pl.program_id(1)
    cache_l, conv_l, alog_l, dtb_l, norm_l = (layers_ref[i] for i in range(5))
    live = vlen_ref[bi] > 0  # an idle row (no token this call): state kept, output unused
    kh = h // rep
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def conv(first: int | jax.Array, n: int, owner):
        """silu(causal conv) of channels [first, first + n) in the input dtype, as ``causal_conv``; the new state's
        rows written where ``owner`` (one program per channel)."""
        cols = pl.ds(first, n)
        x = qkv_ref[bi, cols]
        xs = [conv_ref[cache_l, bi, i, cols].astype(x.dtype) for i in range(taps - 1)] + [x]
        acc = 0
        for i in range(taps):  # the reference's order of the sum
            acc = acc + f32(xs[i]) * f32(convw_ref[conv_l, i, cols])

        @pl.when(owner)
        def _():
            for i in range(taps - 1):  # the window slides by the row's one token, or not at all
                conv_out[bi, i, cols] = jnp.where(live, xs[i + 1], xs[i]).astype(conv_out.dtype)

        return jax.nn.silu(acc).astype(x.dtype)

    owns_key = h % rep == 0
    q = conv(kh * dk, dk, owns_key)
    k = conv(hk * dk + kh * dk, dk, owns_key)
    v = conv(2 * hk * dk + h * dv, dv, True)

    q = _l2norm(q, l2_eps) * scale
    k = _l2norm(k, l2_eps)[:, None]  # [dk, 1]
    b_in = b_ref[bi, h]
    # sigmoid in float32 rounded to b's dtype (the mixer's dtype; Triton has no bf16 division)
    beta = jnp.where(live, f32(jax.nn.sigmoid(f32(b_in)).astype(b_in.dtype)), 0.0)
    g = -jnp.exp(f32(alog_ref[alog_l, h])) * jax.nn.softplus(f32(a_ref[bi, h]) + f32(dtb_ref[dtb_l, h]))
    g = jnp.where(live, g, 0.0)
    s = rec_in[cache_l, bi, h] * jnp.exp(g)  # [dk, dv]
    delta = (f32(v) - jnp.sum(s * k, axis=0)) * beta
    s = s + k * delta[None, :]
    rec_ref[cache_l, bi, h] = s
    o32 = f32(jnp.sum(s * q[:, None], axis=0).astype(y_ref.dtype))
    # the output norm (layers.gated_deltanet.gated_rms_norm)
    y = o32 * lax.rsqrt(jnp.mean(o32 * o32) + norm_eps)
    y = f32(normw_ref[norm_l, :] * y.astype(y_ref.dtype))
    z = f32(z_ref[bi, pl.ds(h * dv, dv)])
    y_ref[bi, pl.ds(h * dv, dv)] = (y * jax.nn.silu(z)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("key_heads", "eps", "interpret", "num_warps"))
def mixer_step(qkv: jax.Array, z: jax.Array, b_in: jax.Array, a_in: jax.Array, valid_len: jax.Array,
               conv_cache: jax.Array, rec_cache: jax.Array, cache_layer: jax.Array, conv_w: jax.Array,
               a_log: jax.Array, dt_bias: jax.Array, norm_w: jax.Array, weight_layers: jax.Array, *, key_heads: int,
               eps: float, interpret: bool = False, num_warps: int | None = MIXER_WARPS):
    """One decode token of the Gated DeltaNet mixer between its input and output projections, in one launch: the
    causal conv with its state, the gates, the q / k L2 norms, the gated delta rule and the gated output norm
    (``ftjax.layers.gated_deltanet.mixer`` at T = 1; Yang et al., "Gated Delta Networks", 2024).

    qkv: [B, C] the conv's input (C = 2*Hk*dk + Hv*dv); z: [B, Hv*dv]; b_in, a_in: [B, Hv] (the projections'
    outputs, one dtype: the output's); valid_len: int32 [B], 1 for a row with a token, 0 for an idle row (its
    states kept); conv_cache: [L, B, K-1, C] and rec_cache: float32 [L, B, Hv, dk, dv], the kind's stacked states,
    read at layer ``cache_layer`` (int32 []); conv_w: [Lw, K, C], a_log, dt_bias: [Lw, Hv], norm_w: [Lw, dv], each
    read at its row of ``weight_layers`` (int32 [4]: conv_w, a_log, dt_bias, norm_w; 0 for an unstacked weight
    given with a leading axis of 1). Returns (y [B, Hv*dv] in qkv's dtype, the layer's new conv state [B, K-1, C]
    in conv_cache's dtype, rec_cache with the layer's states updated: aliased to rec_cache, so with the cache
    donated the states are written in place). Each program (row, value head) reads its key head's conv channels
    itself (no repeat); the first value head of a key head writes that key head's new conv state.

    Raises:
      ValueError: shapes :func:`mixer_supported` rejects (the message names them).
    """
    bsz, c = qkv.shape
    _, _, hv, dk, dv = rec_cache.shape
    taps = conv_w.shape[1]
    if not mixer_supported(key_heads, hv, dk, dv, c, taps) or conv_cache.shape[1:] != (bsz, taps - 1, c):
        raise ValueError(f"gated_deltanet_decode kernel: unsupported shapes (qkv {qkv.shape}, conv_cache "
                         f"{conv_cache.shape}, rec_cache {rec_cache.shape}, conv_w {conv_w.shape}, key heads "
                         f"{key_heads}); expected power-of-two dk and dv >= 16, C = 2*Hk*dk + Hv*dv, K >= 2, "
                         f"conv_cache [L, B, K-1, C]")
    layers = jnp.concatenate([jnp.reshape(cache_layer, (1,)), weight_layers]).astype(jnp.int32)
    sd = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_mixer_kernel, rep=hv // key_heads, hk=key_heads, dk=dk, dv=dv, taps=taps,
                          scale=dk ** -0.5, l2_eps=EPS, norm_eps=eps),
        out_shape=(sd((bsz, hv * dv), qkv.dtype), sd((bsz, taps - 1, c), conv_cache.dtype),
                   sd(rec_cache.shape, jnp.float32)),
        grid=(bsz, hv), input_output_aliases={11: 2}, interpret=interpret,
        compiler_params=common.triton_params(interpret, num_warps), name="gated_deltanet_decode",
    )(layers, valid_len.astype(jnp.int32), qkv, z, b_in, a_in, conv_cache, conv_w, a_log, dt_bias, norm_w,
      rec_cache)


#: Whether ``use="auto"`` runs ``gated_deltanet_decode`` on a GPU for a model computing in 16 bits (float32 models keep
#: XLA's mixer, as the dense decode kernels do). Yes since 2026-12-07: under the fixed decode loop, where a decode
#: block is device-bound, the 16-layer qwen3.5-35b-a3b cut decoded 444.0 against 436.5 tok/s with it (1.017x) and
#: 475.9 / 474.8 against 466.2 / 466.5 with route_decode beside it (1.018-1.021x), in one process each, both orders
#: (H100, ``bench_decode_loop.py --forms=fixed``, ``decode_speed/bench_decode_loop_qwen3.5-35b-a3b_16l-kernels-ab*``);
#: cached = resident bit for bit with it on the GPU (12/12, ``checks/check_identity_gpu_mixer-route_h100_*``). Before
#: the fixed loop (2026-12-06) it measured no faster: the block then waited on the host each step.
MIXER_AUTO = True


def mixer_mode(key_heads: int, value_heads: int, dk: int, dv: int, conv_dim: int, taps: int,
               rec_dtype, dtype=jnp.bfloat16) -> tuple[str, dict]:
    """How ``gated_deltanet_decode`` runs for these shapes under the active kernel config ("xla": it does not), and
    its tiles. dtype: the mixer's input (the projections') dtype; ``auto`` picks the kernel where it picks the dense
    decode kernels (``dense_decode.auto_for``: 16-bit) and :data:`MIXER_AUTO`."""
    tiles = registry.tiles("gated_deltanet_decode", {"num_warps": MIXER_WARPS})
    ok = rec_dtype == jnp.float32 and mixer_supported(key_heads, value_heads, dk, dv, conv_dim, taps)
    return registry.mode("gated_deltanet_decode", ok, auto=MIXER_AUTO and dense_decode.auto_for(dtype)), tiles


def _warps(vals: tuple[int, ...]) -> dict:
    (warps,) = common.tile_values("gated_deltanet_decode", vals, (1,), "(num_warps,)")
    if not common.pow2(warps):
        raise ValueError(f"tiles of kernel 'gated_deltanet_decode': num_warps must be a power of two, got {vals}")
    return {"num_warps": warps}


registry.register(registry.Kernel(
    "gated_deltanet_decode", "ftjax.layers.gated_deltanet.mixer (T = 1)",
    "Gated DeltaNet decode (T = 1): the mixer between its projections in one launch (conv and its state, gates, "
    "q / k norms, the recurrent step with the float32 state updated in place in the stacked cache, the gated "
    "output norm); power-of-two dk and dv, K >= 2; auto: GPU, 16-bit models (MIXER_AUTO: 1.017-1.021x decode "
    "under the fixed loop, H100, 2026-12-07)",
    auto=MIXER_AUTO, tiles=_warps))
