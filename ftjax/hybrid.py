"""The hybrid decoder of the Qwen3.5 / Qwen3.6 MoE family (transformers ``qwen3_5_moe``): Gated
DeltaNet layers and gated full-attention layers in a repeating pattern, every layer an MoE with
top-k routed experts plus one always-on shared expert.

Source: transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (the oracle of the tests);
the delta rule itself is :mod:`ftjax.gated_deltanet`.

**One scan over blocks.** ``layer_types`` repeats a short pattern (3 ``linear_attention`` then 1
``full_attention`` in the published models); the decoder scans over the G = L / P blocks of
that pattern (P layers each), and the block body runs its P layers unrolled. Chosen over one
layer body serving both kinds because the two kinds have different weights and state: a shared
body would need the weights of both kinds in every layer (the 35B-A3B would carry ~1.2 G unused
parameters) or a ``lax.cond`` with dynamic indexing into per-kind stacks, where the carried KV
cache would have to flow through both branches. With blocks every array keeps a static shape
and role (maxtext's ``Qwen3NextScannableBlock`` does the same).

Params ``params["layers"]`` (block layout; G blocks, P layers per block of which Na are full
attention and Nl Gated DeltaNet; matrices [in, out]):

  attn_norm, mlp_norm [G, P, D]        zero-centred RMSNorm weights (scale 1 + w)
  router [G, P, D, E]
  shared_gate_up [G, P, D, 2Fs]         shared expert gate_proj.T | up_proj.T
  shared_down [G, P, Fs, D]             shared_gate [G, P, D, 1] (sigmoid gate of the shared expert)
  attn:   wq [G, Na, D, Hq*2*hd]        per head: hd query columns, then hd gate columns
          wk, wv [G, Na, D, Hkv*hd]     wo [G, Na, Hq*hd, D]     q_norm, k_norm [G, Na, hd]
  linear: w_qkv [G, Nl, D, 2*Hk*dk + Hv*dv]   w_z [G, Nl, D, Hv*dv]   w_b, w_a [G, Nl, D, Hv]
          conv [G, Nl, K, 2*Hk*dk + Hv*dv]    dt_bias, A_log [G, Nl, Hv]
          norm [G, Nl, dv] (gated RMSNorm, plain weights)        w_out [G, Nl, Hv*dv, D]

State per sequence (``ftjax.model.KVCache``): K/V of the Na*G full-attention layers only, and per
DeltaNet layer the conv state (last K-1 conv inputs) and the recurrent state [Hv, dk, dv] in
float32, both by block [G, Nl, B, ...]; they are scan ``xs`` sliced per block and come back as
scan outputs (each block touches only its own). Routed experts go through the same
``expert_fn`` seam as the other families (every offload mode, policy and miss policy); the
shared expert stays on the device with the other non-expert weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ftjax import gated_deltanet as gdn
from ftjax.config import ModelConfig
from ftjax.model import (ExpertFn, ForwardOut, KVCache, KVHook, LayerCarry, LayerInputs, LayerRouting, Params,
                         attention, embed_inputs, final_logits, project, rms_norm_offset, rope, route)


def _counts(cfg: ModelConfig) -> tuple[int, int, int]:
    pattern = cfg.block_pattern
    return len(pattern), pattern.count("full_attention"), pattern.count("linear_attention")


def layer_kind_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shapes of one layer's parameters by part: "common" (every layer), "attn", "linear"."""
    d, hd, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    hv, cd, fs = cfg.linear_num_value_heads, cfg.linear_conv_dim, cfg.shared_expert_ffn
    return {
        "common": {"attn_norm": (d,), "mlp_norm": (d,), "router": (d, e), "shared_gate_up": (d, 2 * fs),
                   "shared_down": (fs, d), "shared_gate": (d, 1)},
        "attn": {"wq": (d, 2 * q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "q_norm": (hd,), "k_norm": (hd,)},
        "linear": {"w_qkv": (d, cd), "w_z": (d, vd), "w_b": (d, hv), "w_a": (d, hv),
                   "conv": (cfg.linear_conv_kernel, cd), "dt_bias": (hv,), "A_log": (hv,),
                   "norm": (cfg.linear_value_head_dim,), "w_out": (vd, d)},
    }


def block_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """``params["layers"]`` shapes in the block layout of the module docstring."""
    g = cfg.num_blocks
    p, na, nl = _counts(cfg)
    parts = layer_kind_shapes(cfg)
    shapes: dict[str, Any] = {k: (g, p) + v for k, v in parts["common"].items()}
    shapes["attn"] = {k: (g, na) + v for k, v in parts["attn"].items()}
    shapes["linear"] = {k: (g, nl) + v for k, v in parts["linear"].items()}
    return shapes


def block_position(cfg: ModelConfig, layer: int) -> tuple[int, int, str, int]:
    """Where layer ``layer`` sits: (block, position in block, kind, index among its kind's layers
    of the block)."""
    pattern = cfg.block_pattern
    blk, i = divmod(layer, len(pattern))
    kind = pattern[i]
    return blk, i, kind, pattern[:i].count(kind)


def linear_state_shapes(cfg: ModelConfig, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the conv state [G, Nl, B, K-1, conv_dim] and recurrent state [G, Nl, B, Hv, dk, dv]."""
    g, (_, _, nl) = cfg.num_blocks, _counts(cfg)
    return ((g, nl, batch, cfg.linear_conv_kernel - 1, cfg.linear_conv_dim),
            (g, nl, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


# ---- the two token mixers ----------------------------------------------------------------------
def gated_attention_qkv(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array):
    """Queries, keys, values and the output gate of a gated attention layer.

    x: [B, T, D] normed input; positions int32 [B, T]. q/k get a per-head zero-centred RMSNorm,
    then RoPE on their first ``cfg.rotary_dim`` dims (the multimodal rope sections of the config
    reduce to this for text, where all three position grids are equal). Returns q [B, T, Hq, hd],
    k, v [B, T, Hkv, hd], gate [B, T, Hq*hd].
    """
    b, t, _ = x.shape
    hd, rd, eps = cfg.head_dim, cfg.rotary_dim, cfg.rms_norm_eps
    qg = project(x, lp["wq"]).reshape(b, t, cfg.num_heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, -1)
    q = rms_norm_offset(q, lp["q_norm"], eps)
    k = rms_norm_offset(project(x, lp["wk"]).reshape(b, t, cfg.num_kv_heads, hd), lp["k_norm"], eps)
    v = project(x, lp["wv"]).reshape(b, t, cfg.num_kv_heads, hd)

    def partial_rope(a):
        return jnp.concatenate([rope(a[..., :rd], positions, cfg.rope_theta), a[..., rd:]], axis=-1)

    return partial_rope(q), partial_rope(k), v, gate


def gated_rms_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float, dtype) -> jax.Array:
    """The DeltaNet output norm: RMSNorm of o (float32) times w in ``dtype``, times silu(z) in
    float32, cast to ``dtype`` (transformers' ``Qwen3_5MoeRMSNormGated``). o, z: [..., dv]."""
    o32 = o.astype(jnp.float32)
    y = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    y = (w * y.astype(dtype)).astype(jnp.float32)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)


def gated_deltanet(cfg: ModelConfig, lp: Params, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
                   valid: jax.Array, state_points: tuple[int, ...] = ()):
    """One Gated DeltaNet token mixer.

    x: [B, T, D] normed input (right-padded); conv_state [B, K-1, conv_dim]; rec_state float32
    [B, Hv, dk, dv]; valid: bool [B, T]. T = 1 runs the recurrent form (decode), longer calls the
    chunked form. state_points: call-relative token counts (multiples of
    ``gated_deltanet.DELTA_CHUNK``) at which batch row 0's state is wanted (prefix reuse stores
    it with each new KV chunk).
    Returns (y [B, T, D], conv state, recurrent state, a tuple over the state points of (conv
    [K-1, conv_dim], rec [Hv, dk, dv]), or None when there are none).
    """
    b, t, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    valid_len = jnp.sum(valid, axis=1, dtype=jnp.int32)
    qkv_in = project(x, lp["w_qkv"])
    z = project(x, lp["w_z"]).reshape(b, t, hv, dv)
    qkv, new_conv = gdn.causal_conv(qkv_in, lp["conv"], conv_state, valid_len)
    q = qkv[..., :hk * dk].reshape(b, t, hk, dk)
    k = qkv[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
    v = qkv[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(project(x, lp["w_b"]))
    g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        project(x, lp["w_a"]).astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    beta = jnp.where(valid[..., None], beta, 0)  # padding leaves the state exactly as it is
    g = jnp.where(valid[..., None], g, 0.0)
    q = gdn.l2_normalize(jnp.repeat(q, hv // hk, axis=2))
    k = gdn.l2_normalize(jnp.repeat(k, hv // hk, axis=2))
    points = None
    if t == 1:
        o, rec = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, rec_state)
    else:
        o, rec, ends = gdn.chunked_gated_delta_rule(q, k, v, g, beta, rec_state, chunk_states=bool(state_points))
        if state_points:
            conv_in = jnp.concatenate([conv_state.astype(qkv_in.dtype), qkv_in], axis=1)[0]
            km1 = cfg.linear_conv_kernel - 1
            points = tuple((conv_in[p:p + km1], ends[p // gdn.DELTA_CHUNK - 1, 0]) for p in state_points)
    y = gated_rms_norm(o.astype(x.dtype), z, lp["norm"], cfg.rms_norm_eps, x.dtype)
    return project(y.reshape(b, t, hv * dv), lp["w_out"]), new_conv, rec, points


def shared_expert(lp: Params, x: jax.Array) -> jax.Array:
    """The always-on expert, scaled by its sigmoid gate. x: [N, D] -> [N, D]."""
    fs = lp["shared_down"].shape[0]
    gu = project(x, lp["shared_gate_up"])
    y = project(jax.nn.silu(gu[:, :fs]) * gu[:, fs:], lp["shared_down"])
    return jax.nn.sigmoid(project(x, lp["shared_gate"])) * y


# ---- one block ---------------------------------------------------------------------------------
def _take(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


def decoder_block(cfg: ModelConfig, lp: Params, block: jax.Array, carry: LayerCarry, inputs: LayerInputs,
                  expert_fn: ExpertFn, kv_hook: KVHook | None, hook_xs: Any, conv: jax.Array, rec: jax.Array,
                  state_points: tuple[int, ...] = ()):
    """The P layers of block ``block`` (int32 []), unrolled.

    lp: the block's slice of ``params["layers"]``; conv [Nl, B, K-1, conv_dim], rec [Nl, B, Hv, dk,
    dv]: the block's linear states. The KV hook (prefix reuse) sees attention layer ``block * Na +
    j`` (the KV cache's index). Returns (new carry, (expert stats stacked [P, ...], the hook's
    output of the block's attention layer or None, conv, rec, a tuple over the state points of
    (conv [Nl, K-1, conv_dim], rec [Nl, Hv, dk, dv]) or None)).
    """
    h, ck, cv, state, hc = carry.h, carry.k, carry.v, carry.expert_state, carry.hook
    b, t, _ = h.shape
    p, na, nl = _counts(cfg)
    eps, positions = cfg.rms_norm_eps, inputs.positions
    stats, hook_out, convs, recs, points = [], None, [], [], []
    for i, kind in enumerate(cfg.block_pattern):
        j = cfg.block_pattern[:i].count(kind)
        layer = block * p + i
        x = rms_norm_offset(h, lp["attn_norm"][i], eps)
        if kind == "full_attention":
            with jax.named_scope("attention"):
                ap, a = _take(lp["attn"], j), block * na + j
                if kv_hook is not None:
                    ck, cv, hc = kv_hook.before_attention(ck, cv, a, hook_xs, hc)
                q, k, v, gate = gated_attention_qkv(cfg, ap, x, positions)
                ck = ck.at[a, inputs.bidx, positions].set(k.astype(ck.dtype), mode="drop")
                cv = cv.at[a, inputs.bidx, positions].set(v.astype(cv.dtype), mode="drop")
                if kv_hook is not None:
                    hook_out = kv_hook.layer_output(ck, cv, a, inputs.start)
                o = attention(q, ck[a], cv[a], positions).reshape(b, t, -1)
                h = h + project(o * jax.nn.sigmoid(gate), ap["wo"])
        else:
            with jax.named_scope("gated_deltanet"):
                y, c_new, r_new, pts = gated_deltanet(cfg, _take(lp["linear"], j), x, conv[j], rec[j], inputs.valid,
                                                      state_points)
                convs.append(c_new)
                recs.append(r_new)
                points.append(pts)
                h = h + y
        with jax.named_scope("moe"):
            x = rms_norm_offset(h, lp["mlp_norm"][i], eps).reshape(b * t, -1)
            ids, w = route(cfg, x, lp["router"][i])
            y, state, st = expert_fn(state, layer, LayerRouting(x, ids, w, inputs.valid.reshape(-1)))
            with jax.named_scope("shared_expert"):
                shared = {k: lp[k][i] for k in ("shared_gate_up", "shared_down", "shared_gate")}
                y = y.astype(h.dtype) + shared_expert(shared, x)
            h = h + y.reshape(b, t, -1).astype(h.dtype)
            stats.append(st)
    stats = jax.tree.map(lambda *a: jnp.stack(a), *stats)
    pts = None
    if state_points:  # per state point: the block's linear layers stacked [Nl, ...]
        pts = tuple(tuple(jnp.stack([layer_pts[m][part] for layer_pts in points]) for part in (0, 1))
                    for m in range(len(state_points)))
        if kv_hook is not None:
            pts = kv_hook.state_output(pts)
    carry = LayerCarry(h, ck, cv, state, hc)
    return carry, (stats, hook_out, jnp.stack(convs), jnp.stack(recs), pts)


def forward_blocks(params: Params, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, valid_len: jax.Array,
                   cache: KVCache, expert_fn: ExpertFn, expert_state: Any, all_logits: bool = False,
                   kv_hook: KVHook | None = None) -> ForwardOut:
    """``ftjax.model.forward`` of a hybrid family: one ``lax.scan`` over the G blocks.

    Same arguments and result as ``model.forward``; the cache carries the linear states too.
    With a KV hook that stores new chunks (prefix reuse), ``kv_out`` is a tuple over the m new
    chunks of (KV [L_att, 2, C, Hkv, hd], conv [G, Nl, K-1, conv_dim], rec [G, Nl, Hv, dk, dv]):
    each chunk's KV and the linear states at its end. A hook whose prefix carries a state
    (``kv_hook.state_xs()``) writes each block's slice into batch row 0's linear states at the
    start of that block.
    Expert stats are stacked over the L layers, as for the other families.

    Raises:
      ValueError: a KV hook with more than one attention layer per block (not supported).
    """
    h, inputs = embed_inputs(params, tokens, start, valid_len)
    p, na, nl = _counts(cfg)
    conv, rec = cache.conv, cache.rec
    state_points: tuple[int, ...] = ()
    if kv_hook is not None:
        if na != 1:
            raise ValueError(f"prefix reuse of a hybrid model needs one full-attention layer per block, got {na}")
        state_points = kv_hook.state_points()

    def body(carry, xs):
        lp, blk, hx, conv_b, rec_b, state_b = xs
        if kv_hook is not None:
            conv_b, rec_b = kv_hook.load_state(conv_b, rec_b, state_b)
        return decoder_block(cfg, lp, blk, carry, inputs, expert_fn, kv_hook, hx, conv_b, rec_b, state_points)

    hook_xs = kv_hook.scan_xs() if kv_hook is not None else None
    state_xs = kv_hook.state_xs() if kv_hook is not None else None
    carry = LayerCarry(h, cache.k, cache.v, expert_state, kv_hook.init_carry() if kv_hook is not None else None)
    blocks = jnp.arange(cfg.num_blocks, dtype=jnp.int32)
    carry, (stats, hook_out, conv, rec, pts) = jax.lax.scan(body, carry, (params["layers"], blocks, hook_xs, conv,
                                                                          rec, state_xs))
    stats = jax.tree.map(lambda a: a.reshape((cfg.num_layers,) + a.shape[2:]), stats)
    kv_out = None
    if hook_out is not None:
        kv_out = tuple((hook_out[m], pts[m][0], pts[m][1]) for m in range(len(hook_out)))
    logits = final_logits(params, cfg, carry.h, valid_len, all_logits)
    return ForwardOut(logits, KVCache(carry.k, carry.v, conv, rec), carry.expert_state, stats, kv_out)
