"""Attention token mixers: grouped-query attention with RoPE over the KV cache, and its gated variant.

Two layer kinds live here:

* ``attention`` (qwen3_moe, olmoe, mixtral): input RMSNorm, q/k/v projections, q/k norms per the
  family (``ModelConfig.qk_norm``), full RoPE, the K/V written into the cache, causal attention by
  absolute position, ``wo``.
* ``gated_attention`` (qwen3_5_moe; transformers ``Qwen3_5MoeAttention``): zero-centred norms, a
  query projection that also gives a per-head output gate, per-head q/k norms, RoPE on the leading
  ``ModelConfig.rotary_dim`` dims, and the attention output scaled by the gate's sigmoid before ``wo``.

Weights of one layer (matrices ``[in, out]``; stacked over the kind's layers in ``params["layers"]``):
``wq [D, Hq*hd]`` (gated: ``[D, Hq*2*hd]``, per head hd query columns then hd gate columns), ``wk``,
``wv [D, Hkv*hd]``, ``wo [Hq*hd, D]``, ``q_norm``, ``k_norm`` ``[hd]`` (per head) or ``[Hq*hd]`` /
``[Hkv*hd]`` (full). The K/V cache is ``KVCache.k`` / ``.v`` ``[L_att, B, S_max, Hkv, hd]``; a layer
writes the K/V of its tokens at positions ``start[b] + t``, so one function serves prefill, prefix-reuse
prefill (start > 0) and decode (T = 1).

Decode steps use the Pallas kernels where the kernel config selects them: ``rope_cache`` (prologue),
``decode_attention``, ``merge_dense_decode``; prefill uses ``flash_prefill``. The jnp functions here are
their references.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig
from ftjax.kernels import common, decode_attention, dense_decode, flash_prefill, registry, rope_cache
from ftjax.layers.common import StackedWeight, layer_weight, norm_fn, norm_project, project, rope
from ftjax.seams import KVCache, KVHook, LayerIndex, LayerInputs

Params = dict[str, Any]

# Queries per attention block: bounds the float32 score tensor of long prefills to
# [B, Hq, ATTN_BLOCK, S] instead of [B, Hq, T, S].
ATTN_BLOCK = 512


def param_shapes(cfg: ModelConfig, gated: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of one attention layer's weights (module docstring), by name."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    s = {"wq": (d, 2 * q if gated else q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}
    if gated or cfg.qk_norm == "per_head":
        s["q_norm"], s["k_norm"] = (hd,), (hd,)
    elif cfg.qk_norm == "full":
        s["q_norm"], s["k_norm"] = (q,), (kv,)
    return s


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


class GroupedQuery(NamedTuple):
    """A decode step's queries as ``ftjax.kernels.rope_cache`` lays them out for the decode
    attention kernel: qg [B, Hkv, rows, hd] (row r < g of KV head h is query head h * g + r);
    g: query heads per KV head; interpret: whether the kernels run in Pallas interpret mode."""

    qg: jax.Array
    g: int
    interpret: bool


class SplitAttention(NamedTuple):
    """Decode attention's per-split results before their merge (``decode_attention.grouped`` with
    ``merged=False``): o float32 [B, Hkv, n_split, rows, hd], m, l float32 [B, Hkv, n_split, rows];
    g: query heads per KV head; dtype: the attention output's dtype."""

    o: jax.Array
    m: jax.Array
    l: jax.Array
    g: int
    dtype: Any


def cached_attention(q: jax.Array | GroupedQuery, ck: jax.Array, cv: jax.Array, layer: jax.Array,
                     q_pos: jax.Array) -> jax.Array | SplitAttention:
    """:func:`attention` of one layer over the stacked cache, through a Pallas kernel where the
    kernel config selects one (default: on GPUs, never on the CPU).

    q: [B, T, Hq, hd]; ck, cv: [L_att, B, S_max, Hkv, hd]; layer: int32 []; q_pos: int32 [B, T].
    Decode (T = 1): ``ftjax.kernels.decode_attention`` reads only the filled positions
    ``[0, q_pos + 1)`` of each row. Prefill: ``ftjax.kernels.flash_prefill``. Otherwise, and as the
    reference, the blocked jnp :func:`attention` over the whole cache row. q may be a
    :class:`GroupedQuery` (``rope_cache``'s layout): then the result is the decode kernel's
    :class:`SplitAttention`, its key splits not merged yet (:func:`attention_output`).
    """
    if isinstance(q, GroupedQuery):
        o, m, l = decode_attention.grouped(q.qg, ck, cv, layer, q_pos.reshape(-1), g=q.g, offset=1,
                                           interpret=q.interpret, merged=False)
        return SplitAttention(o, m, l, q.g, q.qg.dtype)
    if q.shape[1] == 1:
        o = decode_attention.maybe(q, ck, cv, layer, q_pos)
        return attention(q, ck[layer], cv[layer], q_pos) if o is None else o
    k, v = ck[layer], cv[layer]
    o = flash_prefill.maybe(q, k, v, q_pos, attention)
    return attention(q, k, v, q_pos) if o is None else o


def attention_output(o: jax.Array | SplitAttention, wo: jax.Array | StackedWeight) -> jax.Array:
    """The output projection ``o @ wo`` [B, T, D] of o [B, T, Hq, hd] or of a :class:`SplitAttention`
    (T = 1): where the kernel config selects ``merge_dense_decode`` for a stacked wo, one launch
    merges the splits and projects; otherwise the merge (``decode_attention.merge_splits``) and then
    :func:`project`."""
    if isinstance(o, SplitAttention):
        if isinstance(wo, StackedWeight):
            y = dense_decode.maybe_merge(o.o, o.m, o.l, o.g, o.dtype, wo.w, wo.layer)
            if y is not None:
                return y[:, None]
        o = decode_attention.merge_splits(o.o, o.m, o.l, o.g, o.dtype)
    b, t = o.shape[:2]
    return project(o.reshape(b, t, -1), wo)


def qk(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, qkv: list | None = None):
    """q, k (normed where the family norms them, rotated) and v [B, T, H, hd] of the normalised
    attention input x [B, T, D], or of its projections ``qkv`` when the caller made them."""
    b, t, _ = x.shape
    hd = cfg.head_dim
    q, k, v = qkv if qkv is not None else (project(x, lp["wq"]), project(x, lp["wk"]), project(x, lp["wv"]))
    norm = norm_fn(cfg.norm_offset)
    if cfg.qk_norm == "full":
        q = norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = q.reshape(b, t, cfg.num_heads, hd)
    k = k.reshape(b, t, cfg.num_kv_heads, hd)
    v = v.reshape(b, t, cfg.num_kv_heads, hd)
    if cfg.qk_norm == "per_head":
        q = norm(q, layer_weight(lp["q_norm"]), cfg.rms_norm_eps)
        k = norm(k, layer_weight(lp["k_norm"]), cfg.rms_norm_eps)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def gated_qkv(cfg: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
    """Queries, keys, values and the output gate of a gated attention layer.

    h: [B, T, D] the residual stream; positions int32 [B, T]. The input norm and the wq, wk, wv products
    (one launch in a decode step where ``norm_dense_decode`` runs: ``layers.common.norm_project``); q/k get a
    per-head zero-centred RMSNorm, then RoPE on their first ``cfg.rotary_dim`` dims (the multimodal rope
    sections of the config reduce to this for text, where all three position grids are equal). Returns
    q [B, T, Hq, hd], k, v [B, T, Hkv, hd], gate [B, T, Hq*hd].
    """
    b, t, _ = h.shape
    hd, rd, eps = cfg.head_dim, cfg.rotary_dim, cfg.rms_norm_eps
    norm = norm_fn(cfg.norm_offset)
    (qg, kp, vp), _ = norm_project(h, lp["attn_norm"], (lp["wq"], lp["wk"], lp["wv"]), eps, offset=cfg.norm_offset)
    qg = qg.reshape(b, t, cfg.num_heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, -1)
    q = norm(q, layer_weight(lp["q_norm"]), eps)
    k = norm(kp.reshape(b, t, cfg.num_kv_heads, hd), layer_weight(lp["k_norm"]), eps)
    v = vp.reshape(b, t, cfg.num_kv_heads, hd)

    def partial_rope(a):
        return jnp.concatenate([rope(a[..., :rd], positions, cfg.rope_theta), a[..., rd:]], axis=-1)

    return partial_rope(q), partial_rope(k), v, gate


def _rope_cache_inputs(cfg: ModelConfig, lp: Params, h: jax.Array, layer: jax.Array, ck: jax.Array, cv: jax.Array,
                       positions: jax.Array):
    """:func:`attention_inputs` through ``ftjax.kernels.rope_cache`` when the kernel config selects it
    and ``decode_attention`` for a decode call whose projections read stacked weights; else None."""
    ws = (lp["wq"], lp["wk"], lp["wv"])
    b, t, _ = h.shape
    if t != 1 or cfg.norm_offset or cfg.qk_norm not in ("per_head", "none") or \
            not all(isinstance(w, StackedWeight) for w in ws):
        return None
    norm_w = getattr(lp["attn_norm"], "w", lp["attn_norm"])
    dtype = jnp.result_type(norm_w.dtype, h.dtype, ws[0].w.dtype)  # the projections' (norm_dense_decode's)
    norms = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm == "per_head" else (None, None)
    q_dtype = rope_cache.query_dtype(getattr(norms[0], "w", norms[0]).dtype if norms[0] is not None else None, dtype)
    parts_shape = jax.ShapeDtypeStruct((1, b, sum(w.w.shape[-1] for w in ws)), dtype)
    ok = rope_cache.supported(parts_shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ck, q_dtype) and \
        common.dot_dtype_ok(q_dtype)
    auto = dense_decode.auto_for(ws[0].w.dtype)
    how = registry.mode("rope_cache", ok, auto=auto)
    if how == "xla" or registry.mode("decode_attention", ok) == "xla":
        return None
    parts = dense_decode.maybe_norm(h, norm_w, cfg.rms_norm_eps, [w.w for w in ws], ws[0].layer, sum_parts=False)
    if parts is not None:
        qkv = parts[0][0]  # [k_split, B, N] float32 partials, or [1, B, N]
    else:  # the norm kernel is not selected: the projections as the jnp path makes them, as one part
        (q, k, v), _ = norm_project(h, lp["attn_norm"], ws, cfg.rms_norm_eps)
        qkv = jnp.concatenate([q, k, v], axis=-1).reshape(1, b, -1)
    qn, kn = (getattr(n, "w", n) for n in norms) if norms[0] is not None else (None, None)
    qg, ck, cv = rope_cache.rope_cache(qkv, qn, kn, ck, cv, layer,
                                       positions.reshape(b), hq=cfg.num_heads, hkv=cfg.num_kv_heads,
                                       eps=float(cfg.rms_norm_eps), theta=float(cfg.rope_theta), dtype=dtype,
                                       interpret=how == "interpret")
    return GroupedQuery(qg, cfg.num_heads // cfg.num_kv_heads, how == "interpret"), ck, cv


def attention_inputs(cfg: ModelConfig, lp: Params, h: jax.Array, layer: jax.Array, ck: jax.Array, cv: jax.Array,
                     inputs: LayerInputs):
    """The layer's queries and the caches with this call's K/V written at its positions.

    h: the residual stream [B, T, D]; ck, cv: [L_att, B, S_max, Hkv, hd]; layer: the attention
    layer's index (int32 []). Returns (q, ck, cv): q [B, T, Hq, hd] (input norm, projections, q/k
    norms, RoPE), or, for a decode call where the kernel config selects ``rope_cache`` and
    ``decode_attention``, a :class:`GroupedQuery` from one ``rope_cache`` launch that also writes
    K/V (same arithmetic; :func:`cached_attention` takes either)."""
    got = _rope_cache_inputs(cfg, lp, h, layer, ck, cv, inputs.positions)
    if got is not None:
        return got
    qkv, _ = norm_project(h, lp["attn_norm"], (lp["wq"], lp["wk"], lp["wv"]), cfg.rms_norm_eps)
    q, k, v = qk(cfg, lp, h, inputs.positions, qkv)
    return q, *_write_kv(ck, cv, layer, k, v, inputs)


def _write_kv(ck, cv, layer, k, v, inputs: LayerInputs):
    """The caches with this call's k, v [B, T, Hkv, hd] written at its positions (out of range: dropped)."""
    ck = ck.at[layer, inputs.bidx, inputs.positions].set(k.astype(ck.dtype), mode="drop")
    cv = cv.at[layer, inputs.bidx, inputs.positions].set(v.astype(cv.dtype), mode="drop")
    return ck, cv


def mix(cfg: ModelConfig, lp: Params, h: jax.Array, idx: LayerIndex, cache: KVCache, inputs: LayerInputs,
        kv_hook: KVHook | None, hook_xs: Any, hook_carry: Any, gated: bool = False):
    """One attention layer's token mixing: h [B, T, D] -> h + attention output.

    lp: the layer's weights (``attn_norm`` and :func:`param_shapes`'; some may be
    :class:`StackedWeight`); idx.kind: the attention layer's index (its KV cache rows). The KV hook
    (prefix reuse) may write the layer's reused rows first and gets the rows this call wrote.
    Returns (h, cache, hook carry, the hook's layer output or None).
    """
    a = idx.kind
    ck, cv = cache.k, cache.v
    hook_out = None
    with jax.named_scope("attention"):
        if kv_hook is not None:
            ck, cv, hook_carry = kv_hook.before_attention(ck, cv, a, hook_xs, hook_carry)
        if gated:
            q, k, v, gate = gated_qkv(cfg, lp, h, inputs.positions)
            ck, cv = _write_kv(ck, cv, a, k, v, inputs)
        else:
            q, ck, cv = attention_inputs(cfg, lp, h, a, ck, cv, inputs)
        if kv_hook is not None:
            hook_out = kv_hook.layer_output(ck, cv, a, inputs.start)
        o = cached_attention(q, ck, cv, a, inputs.positions)
        if gated:
            b, t = h.shape[:2]
            h = h + project(o.reshape(b, t, -1) * jax.nn.sigmoid(gate), lp["wo"])
        else:
            h = h + attention_output(o, lp["wo"])
    return h, cache._replace(k=ck, v=cv), hook_carry, hook_out
