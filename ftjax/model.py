"""The MoE decoder as pure functions over a params pytree.

Params (all on the device; L layers stacked on the leading axis so the decoder runs as one
``jax.lax.scan``):

  embed       [V, D]
  lm_head     [D, V]            absent when the config ties it to ``embed``
  final_norm  [D]
  layers:
    attn_norm [L, D]            mlp_norm [L, D]
    wq [L, D, Hq*hd]  wk [L, D, Hkv*hd]  wv [L, D, Hkv*hd]  wo [L, Hq*hd, D]
    q_norm, k_norm              [L, hd] (per_head) or [L, Hq*hd] / [L, Hkv*hd] (full); absent for none
    router    [L, D, E]

The routed experts are not in ``params``: the decoder calls an *expert function* (see
``ftjax.experts.offload``) that owns where expert weights live. This is the seam where offload
plugs in without touching the math.

KV cache: ``k`` and ``v`` of shape [L, B, S_max, Hkv, hd]. A forward call writes the K/V of its
tokens at positions ``start[b] + t`` and attends causally by absolute position, so one function
serves prefill (T tokens), prefix-reuse prefill (start > 0) and decode (T = 1).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig

Params = dict[str, Any]


class KVCache(NamedTuple):
    """Device KV cache. k, v: [L, B, S_max, Hkv, hd], compute dtype."""

    k: jax.Array
    v: jax.Array


def init_kv_cache(cfg: ModelConfig, batch: int, max_seq_len: int, dtype) -> KVCache:
    """Zeros of shape [L, batch, max_seq_len, Hkv, hd]."""
    shape = (cfg.num_layers, batch, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled by ``w`` in the input dtype (as transformers does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split layout (GPT-NeoX / Llama style).

    x: [B, T, H, hd]; positions: int32 [B, T]. cos/sin are computed in float32.
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


# Queries per attention block: bounds the float32 score tensor of long prefills to
# [B, Hq, ATTN_BLOCK, S] instead of [B, Hq, T, S].
ATTN_BLOCK = 512


def _attention_block(q, k, v, q_pos):
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    visible = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, hq, hd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
    """Causal grouped-query attention over a whole cache row.

    q: [B, T, Hq, hd]; k, v: [B, S, Hkv, hd]; q_pos: int32 [B, T] absolute positions.
    Key j is visible to query (b, t) iff j <= q_pos[b, t]; positions above that hold stale data.
    Scores and softmax in float32; queries in blocks of ATTN_BLOCK. Returns [B, T, Hq, hd] in
    q's dtype.
    """
    t = q.shape[1]
    if t <= ATTN_BLOCK:
        return _attention_block(q, k, v, q_pos)
    outs = [_attention_block(q[:, i:i + ATTN_BLOCK], k, v, q_pos[:, i:i + ATTN_BLOCK])
            for i in range(0, t, ATTN_BLOCK)]
    return jnp.concatenate(outs, axis=1)


def route(cfg: ModelConfig, x: jax.Array, w_router: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k router.

    x: [N, D]; w_router: [D, E]. Returns (expert ids int32 [N, k], weights [N, k] in x's dtype).
    Probabilities in float32; renormalised over the top k when ``cfg.norm_topk_prob``.
    """
    logits = (x @ w_router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    w, ids = jax.lax.top_k(probs, cfg.top_k)
    if cfg.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), w.astype(x.dtype)


class LayerRouting(NamedTuple):
    """What one layer's router chose, handed to the expert function.

    x: normed MLP input [N, D]; ids: int32 [N, k] expert ids in [0, E); weights: [N, k];
    valid: bool [N], False for padding tokens (their output is discarded and they must not
    cause expert loads).
    """

    x: jax.Array
    ids: jax.Array
    weights: jax.Array
    valid: jax.Array


# expert_fn(state, layer, routing) -> (y [N, D], new state, per-layer stats pytree)
ExpertFn = Callable[[Any, jax.Array, LayerRouting], tuple[jax.Array, Any, Any]]


def _qk(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array):
    b, t, _ = x.shape
    hd = cfg.head_dim
    q, k, v = x @ lp["wq"], x @ lp["wk"], x @ lp["wv"]
    if cfg.qk_norm == "full":
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = q.reshape(b, t, cfg.num_heads, hd)
    k = k.reshape(b, t, cfg.num_kv_heads, hd)
    v = v.reshape(b, t, cfg.num_kv_heads, hd)
    if cfg.qk_norm == "per_head":
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


class ForwardOut(NamedTuple):
    """logits: float32 [B, V] (last valid token) or [B, T, V] (all); cache; expert state; stats
    stacked over layers (leading axis L)."""

    logits: jax.Array
    cache: KVCache
    expert_state: Any
    layer_stats: Any


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, valid_len: jax.Array,
            cache: KVCache, expert_fn: ExpertFn, expert_state: Any, all_logits: bool = False) -> ForwardOut:
    """Runs T tokens of B sequences through the decoder (one ``lax.scan`` over layers).

    Args:
      tokens: int32 [B, T], right-padded; token t of sequence b sits at position start[b] + t.
      start: int32 [B], tokens already in the cache for each sequence (0 for a fresh prefill).
      valid_len: int32 [B], real tokens in this call (the rest is padding), >= 1.
      cache: KV cache, updated in place at positions [start, start + T).
      expert_fn / expert_state: where expert weights come from (see ``ftjax.experts.offload``);
        the state (slot pools, LRU table) is carried through the scan.
      all_logits: return logits of every position instead of the last valid one.
    """
    b, t = tokens.shape
    dtype = params["embed"].dtype
    h = params["embed"][tokens]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < valid_len[:, None]
    bidx = jnp.arange(b)[:, None]

    def layer(carry, xs):
        h, ck, cv, state = carry
        lp, l = xs
        with jax.named_scope("attention"):
            x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
            q, k, v = _qk(cfg, lp, x, positions)
            ck = ck.at[l, bidx, positions].set(k.astype(ck.dtype), mode="drop")
            cv = cv.at[l, bidx, positions].set(v.astype(cv.dtype), mode="drop")
            o = attention(q, ck[l], cv[l], positions)
            h = h + o.reshape(b, t, -1) @ lp["wo"]
        with jax.named_scope("moe"):
            x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps).reshape(b * t, -1)
            ids, w = route(cfg, x, lp["router"])
            y, state, stats = expert_fn(state, l, LayerRouting(x, ids, w, valid.reshape(-1)))
            h = h + y.reshape(b, t, -1).astype(dtype)
        return (h, ck, cv, state), stats

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (h, ck, cv, expert_state), stats = jax.lax.scan(
        layer, (h, cache.k, cache.v, expert_state), (params["layers"], layer_ids))
    if not all_logits:
        h = h[jnp.arange(b), valid_len - 1]
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = (h @ head).astype(jnp.float32)
    return ForwardOut(logits, KVCache(ck, cv), expert_state, stats)
