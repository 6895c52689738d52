"""The Gated DeltaNet token mixer (layer kind ``gated_deltanet``; Yang, Kautz, Hatamizadeh, "Gated
Delta Networks: Improving Mamba2 with Delta Rule", 2024): the gated delta rule, the short causal
conv in front of it, and the layer around them (transformers ``Qwen3_5MoeGatedDeltaNet``).

Per value head, a state ``S`` [dk, dv] is decayed and corrected once per token t:

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

(g_t <= 0 the log decay, beta_t in (0, 1) the write strength; q and k L2-normalised, q scaled
by dk^-1/2). Two forms compute it:

* :func:`recurrent_gated_delta_rule`: token by token (decode, T = 1; :func:`gated_delta_decode` is
  the layer's one-token step around it, with the q / k norms and the head grouping).
* :func:`chunked_gated_delta_rule`: chunks of :data:`DELTA_CHUNK` tokens. Inside a chunk the
  sequential corrections are solved at once (a unit lower-triangular system, the WY / UT
  transform of DeltaNet); a scan over chunks carries S. Prefill uses this form. It also returns
  S at the end of every chunk, which prefix reuse stores (``ftjax.kv``).

Both follow transformers' torch reference (``models/qwen3_5_moe/modeling_qwen3_5_moe.py``,
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``): float32 throughout,
sequences padded at the end to a multiple of the chunk. Padding tokens (``valid`` False) get
beta = 0 and g = 0, so they leave S exactly as it was: the state after a padded call is the
state after its last real token.

Two Pallas kernels (``ftjax.kernels.gated_delta``) run the chunked form where the kernel config
selects them: ``gated_delta_solve`` for what each chunk computes on its own (:func:`chunk_solve`; else
XLA's batched matmuls and triangular solve) and ``gated_delta`` for the scan over chunks. Two more:
``causal_conv`` (``ftjax.kernels.causal_conv``; auto for calls of >= 64 tokens) for :func:`causal_conv`
and ``gated_delta_step`` (``ftjax.kernels.gated_delta_step``; named only) for :func:`gated_delta_decode`.

Weights of one layer (matrices ``[in, out]``; stacked over the kind's layers in ``params["layers"]``):
``w_qkv [D, 2*Hk*dk + Hv*dv]``, ``w_z [D, Hv*dv]``, ``w_b``, ``w_a [D, Hv]``, ``conv [K, 2*Hk*dk + Hv*dv]``,
``dt_bias``, ``A_log [Hv]``, ``norm [dv]`` (gated RMSNorm, plain weights), ``w_out [Hv*dv, D]``. State per
layer and sequence: the conv state (last K-1 conv inputs, compute dtype) and the recurrent state
``[Hv, dk, dv]`` (float32): ``KVCache.conv`` / ``.rec`` stacked over the kind's layers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig
from ftjax.kernels import causal_conv as conv_kernel
from ftjax.kernels import gated_delta, gated_delta_step
from ftjax.kernels.dense_decode import normed_dtype
from ftjax.layers.common import StackedWeight, layer_weight, norm_project, project
from ftjax.seams import KVCache, KVHook, LayerIndex, LayerInputs

#: Tokens per chunk of the chunked form (transformers' and FLA's default). KV prefix chunks of a
#: hybrid model must be a multiple of it, so a stored state sits on a chunk boundary.
DELTA_CHUNK = 64


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (FLA's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, weight: jax.Array, conv_state: jax.Array, valid_len: jax.Array):
    """Depthwise causal conv over time with SiLU, continuing from ``conv_state``.

    x: [B, T, C] inputs of this call (right-padded); weight: [K, C] (tap K-1 multiplies the
    current token); conv_state: [B, K-1, C], the K-1 inputs before this call (zeros for a fresh
    sequence); valid_len: int32 [B] real tokens of the call. Returns (silu(conv) [B, T, C] in x's
    dtype, the new conv state [B, K-1, C] in x's dtype: the last K-1 inputs up to token valid_len).
    Runs as the ``causal_conv`` kernel where the kernel config selects it (``ftjax.kernels.causal_conv``).
    """
    fast = conv_kernel.maybe(x, weight, conv_state, valid_len)
    if fast is not None:
        return fast
    k = weight.shape[0]
    xs = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    t = x.shape[1]
    out = sum(xs[:, i:i + t].astype(jnp.float32) * weight[i].astype(jnp.float32) for i in range(k))
    new_state = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, k - 1, axis=0))(xs, valid_len)
    return jax.nn.silu(out).astype(x.dtype), new_state


def _heads_first(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # [B, T, H, ...] -> [B, H, T, ...]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token form.

    q, k: [B, T, H, dk] (L2-normalised, heads already repeated to the value heads); v: [B, T, H,
    dv]; g (log decay, <= 0), beta: [B, T, H]; state: float32 [B, H, dk, dv]. Returns (o float32
    [B, T, H, dv], final state).
    """
    q = _heads_first(q) * (q.shape[-1] ** -0.5)
    k, v, g, beta = _heads_first(k), _heads_first(v), _heads_first(g), _heads_first(beta)

    def step(s, xs):
        qt, kt, vt, gt, bt = xs  # [B, H, dk], [B, H, dk], [B, H, dv], [B, H], [B, H]
        s = s * jnp.exp(gt)[..., None, None]
        delta = (vt - jnp.sum(s * kt[..., None], axis=-2)) * bt[..., None]
        s = s + kt[..., None] * delta[..., None, :]
        return s, jnp.sum(s * qt[..., None], axis=-2)

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 2).swapaxes(1, 2), state


def gated_delta_decode(q, k, v, g, beta, state):
    """One decode token of the layer: the q / k L2 norms, the heads' grouping and the recurrent step.

    q, k: [B, Hk, dk] the token's queries and keys per key head (the conv's outputs, before the norm);
    v: [B, Hv, dv]; g (log decay, <= 0), beta: [B, Hv]; state: float32 [B, Hv, dk, dv]. Value head h
    reads key head h // (Hv / Hk) (``jnp.repeat`` of the key heads, as transformers' ``repeat_interleave``).
    Returns (o float32 [B, Hv, dv], the new state). Runs as the ``gated_delta_step`` kernel where the
    kernel config selects it (``ftjax.kernels.gated_delta_step``: the state updated in place), else as
    :func:`recurrent_gated_delta_rule` on one token.
    """
    fast = gated_delta_step.maybe(q, k, v, g, beta, state)
    if fast is not None:
        return fast
    rep = v.shape[1] // k.shape[1]
    q = l2_normalize(jnp.repeat(q, rep, axis=1))[:, None]
    k = l2_normalize(jnp.repeat(k, rep, axis=1))[:, None]
    o, state = recurrent_gated_delta_rule(q, k, v[:, None], g[:, None], beta[:, None], state)
    return o[:, 0], state


def chunk_solve(q, k, v, beta, c):
    """What every chunk computes on its own (the WY / UT transform), for all chunks at once.

    q (scaled by dk^-1/2), k: float32 [..., C, dk]; v: [..., C, dv]; beta, c (the cumulative log decay
    inside the chunk): [..., C]; C = the chunk's tokens, ``...`` = batch, heads, chunks. With
    D_ij = exp(c_i - c_j) for j <= i, else 0, and L = strict_lower(beta k k^T * D), returns
    (u = (I + L)^-1 (beta v) [..., C, dv], w = (I + L)^-1 (beta k exp(c)) [..., C, dk],
    the intra-chunk scores q k^T * D [..., C, C]). Runs as the ``gated_delta_solve`` kernel where the
    kernel config selects it (``ftjax.kernels.gated_delta``), else as XLA's batched matmuls and
    triangular solve.
    """
    fast = gated_delta.maybe_solve(q, k, v, beta, c)
    if fast is not None:
        return fast
    chunk = k.shape[-2]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    decay = jnp.exp(jnp.where(lower, c[..., :, None] - c[..., None, :], -jnp.inf))  # [.., i, j]
    system = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay
    unit_lower = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk, dtype=system.dtype)
    solve = lambda rhs: jax.lax.linalg.triangular_solve(  # noqa: E731
        unit_lower, rhs, left_side=True, lower=True, unit_diagonal=True)
    return solve(v_beta), solve(k_beta * jnp.exp(c)[..., None]), jnp.einsum("...id,...jd->...ij", q, k) * decay


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int = DELTA_CHUNK, chunk_states: bool = True):
    """Chunked form (same arguments and results as :func:`recurrent_gated_delta_rule`), plus the
    state at the end of every chunk: float32 [N, B, H, dk, dv], N = ceil(T / chunk) (None with
    ``chunk_states=False``, which keeps the scan from stacking them: 268 MB per layer for an
    8192-token prefill of the 35B-A3B).

    Inside chunk n (positions i, j; c = cumulative log decay within the chunk, D_ij = exp(c_i -
    c_j) for j <= i else 0):
      u = (I + strict_lower(beta k k^T * D))^-1 (beta v)        the corrected values
      w = (I + strict_lower(beta k k^T * D))^-1 (beta k exp(c))  what they read from S
      v' = u - w S;  o = (q exp(c)) S + (q k^T * D) v'
      S <- exp(c_last) S + (k exp(c_last - c))^T v'
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q = _heads_first(q) * (dk ** -0.5)
    k, v, g, beta = _heads_first(k), _heads_first(v), _heads_first(g), _heads_first(beta)
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [B, H, T, ...] -> [B, H, N, chunk, ...], zero-padded at the end
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    c = jnp.cumsum(g, axis=-1)  # [B, H, N, chunk]
    u, w, intra = chunk_solve(q, k, v, beta, c)
    q_read = q * jnp.exp(c)[..., None]
    k_write = k * jnp.exp(c[..., -1:] - c)[..., None]
    chunk_decay = jnp.exp(c[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    fast = gated_delta.maybe(state.astype(jnp.float32), u, w, q_read, k_write, intra, chunk_decay, chunk, chunk_states)
    if fast is not None:  # the scan below as one Pallas kernel (ftjax.kernels.gated_delta)
        o, state, ends = fast
        return jnp.swapaxes(o.reshape(b, h, n * chunk, dv)[:, :, :t], 1, 2), state, ends

    def step(s, xs):
        u_n, w_n, q_n, k_n, a_n, d_n = xs
        v_new = u_n - w_n @ s
        o = q_n @ s + a_n @ v_new
        s = s * d_n + jnp.swapaxes(k_n, -1, -2) @ v_new
        return s, (o, s if chunk_states else None)

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, q_read, k_write, intra, chunk_decay))
    state, (o, ends) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.swapaxes(o, 1, 2), state, ends


# ---- the layer ----------------------------------------------------------------------------------
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one Gated DeltaNet layer's weights (module docstring), by name."""
    d, hv, cd = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_conv_dim
    vd = hv * cfg.linear_value_head_dim
    return {"w_qkv": (d, cd), "w_z": (d, vd), "w_b": (d, hv), "w_a": (d, hv), "conv": (cfg.linear_conv_kernel, cd),
            "dt_bias": (hv,), "A_log": (hv,), "norm": (cfg.linear_value_head_dim,), "w_out": (vd, d)}


def state_shapes(cfg: ModelConfig, num_layers: int, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the conv state [L_lin, B, K-1, conv_dim] and recurrent state [L_lin, B, Hv, dk, dv] of
    ``num_layers`` such layers."""
    return ((num_layers, batch, cfg.linear_conv_kernel - 1, cfg.linear_conv_dim),
            (num_layers, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def gated_rms_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float, dtype) -> jax.Array:
    """The DeltaNet output norm: RMSNorm of o (float32) times w in ``dtype``, times silu(z) in
    float32, cast to ``dtype`` (transformers' ``Qwen3_5MoeRMSNormGated``). o, z: [..., dv]."""
    o32 = o.astype(jnp.float32)
    y = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    y = (w * y.astype(dtype)).astype(jnp.float32)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)


#: The Gated DeltaNet mixer's input projections, in the order :func:`mixer` takes their products.
IN_PROJECTIONS = ("w_qkv", "w_z", "w_b", "w_a")


def gated_deltanet(cfg: ModelConfig, lp: dict, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
                   valid: jax.Array, state_points: tuple[tuple[int, int], ...] = ()):
    """One Gated DeltaNet token mixer.

    x: [B, T, D] normed input (right-padded); conv_state [B, K-1, conv_dim]; rec_state float32
    [B, Hv, dk, dv]; valid: bool [B, T]. T = 1 runs the recurrent form (decode), longer calls the
    chunked form. state_points: (batch row, call-relative token count, a multiple of :data:`DELTA_CHUNK`)
    pairs at which that row's state is wanted (prefix reuse stores it with each new KV chunk).
    Returns (y [B, T, D], conv state, recurrent state, a tuple over the state points of (conv
    [K-1, conv_dim], rec [Hv, dk, dv]), or None when there are none): :func:`mixer` of x's
    :data:`IN_PROJECTIONS`.
    """
    projected = [project(x, lp[name]) for name in IN_PROJECTIONS]
    return mixer(cfg, lp, projected, x.dtype, conv_state, rec_state, valid, state_points)


def mixer(cfg: ModelConfig, lp: dict, projected, dtype, conv_state: jax.Array, rec_state: jax.Array,
          valid: jax.Array, state_points: tuple[tuple[int, int], ...] = ()):
    """:func:`gated_deltanet` from the products of its normed input with :data:`IN_PROJECTIONS` (``projected``:
    qkv_in [B, T, conv_dim], z [B, T, Hv*dv], b and a [B, T, Hv]), so a decode step may make them in one launch
    with the input norm (``layers.common.norm_project``); dtype: the normed input's (the output norm's and the
    output projection's input dtype). Returns as it does."""
    qkv_in, z, b_in, a_in = projected
    b, t, _ = qkv_in.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    valid_len = jnp.sum(valid, axis=1, dtype=jnp.int32)
    z = z.reshape(b, t, hv, dv)
    qkv, new_conv = causal_conv(qkv_in, layer_weight(lp["conv"]), conv_state, valid_len)
    q = qkv[..., :hk * dk].reshape(b, t, hk, dk)
    k = qkv[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
    v = qkv[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(b_in)
    g = -jnp.exp(layer_weight(lp["A_log"]).astype(jnp.float32)) * jax.nn.softplus(
        a_in.astype(jnp.float32) + layer_weight(lp["dt_bias"]).astype(jnp.float32))
    beta = jnp.where(valid[..., None], beta, 0)  # padding leaves the state exactly as it is
    g = jnp.where(valid[..., None], g, 0.0)
    points = None
    if t == 1:
        o, rec = gated_delta_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], rec_state)
        o = o[:, None]
    else:
        q = l2_normalize(jnp.repeat(q, hv // hk, axis=2))
        k = l2_normalize(jnp.repeat(k, hv // hk, axis=2))
        o, rec, ends = chunked_gated_delta_rule(q, k, v, g, beta, rec_state, chunk_states=bool(state_points))
        if state_points:
            conv_in = jnp.concatenate([conv_state.astype(qkv_in.dtype), qkv_in], axis=1)  # [B, K-1+T, conv_dim]
            km1 = cfg.linear_conv_kernel - 1
            points = tuple((conv_in[row, p:p + km1], ends[p // DELTA_CHUNK - 1, row]) for row, p in state_points)
    y = gated_rms_norm(o.astype(dtype), z, layer_weight(lp["norm"]), cfg.rms_norm_eps, dtype)
    return project(y.reshape(b, t, hv * dv), lp["w_out"]), new_conv, rec, points


def mix(cfg: ModelConfig, lp: dict, h: jax.Array, idx: LayerIndex, cache: KVCache, inputs: LayerInputs,
        kv_hook: KVHook | None, hook_xs: Any, hook_carry: Any):
    """One Gated DeltaNet layer's token mixing: h [B, T, D] -> h + the mixer's output, its conv and
    recurrent state (``cache.conv[idx.kind]``, ``cache.rec[idx.kind]``) advanced over the call's
    valid tokens. With a KV hook that stores chunks, also the states of its storing rows where they end.
    Returns (h, cache, hook carry, the states at the hook's state points or None)."""
    del hook_xs
    gi = idx.kind
    with jax.named_scope("gated_deltanet"):
        # the input norm and the four projections: one launch in a decode step where norm_dense_decode runs
        norm_w = lp["attn_norm"]
        projected, _ = norm_project(h, norm_w, tuple(lp[n] for n in IN_PROJECTIONS), cfg.rms_norm_eps,
                                    offset=cfg.norm_offset)
        dtype = normed_dtype(h.dtype, getattr(norm_w, "w", norm_w).dtype, cfg.norm_offset)
        points = kv_hook.state_points() if kv_hook is not None else ()
        fused = decode_in_one_launch(cfg, lp, projected, dtype, cache, gi, inputs.valid) if not points else None
        if fused is not None:
            y, cache = fused
            return h + y, cache, hook_carry, None
        y, conv, rec, pts = mixer(cfg, lp, projected, dtype, cache.conv[gi], cache.rec[gi], inputs.valid, points)
        cache = cache._replace(conv=jax.lax.dynamic_update_index_in_dim(cache.conv, conv.astype(cache.conv.dtype),
                                                                         gi, 0),
                               rec=jax.lax.dynamic_update_index_in_dim(cache.rec, rec.astype(cache.rec.dtype), gi, 0))
    return h + y, cache, hook_carry, pts


def _stacked(w) -> tuple[jax.Array, jax.Array]:
    """(a weight stacked over layers, the layer's index) of a :class:`StackedWeight`, or of a layer's own array
    (given a leading axis of 1, index 0)."""
    if isinstance(w, StackedWeight):
        return w.w, jnp.asarray(w.layer, jnp.int32)
    return w[None], jnp.zeros((), jnp.int32)


def decode_in_one_launch(cfg: ModelConfig, lp: dict, projected, dtype, cache: KVCache, gi, valid: jax.Array):
    """:func:`mixer` of one decode token (T = 1) and its cache update as the ``gated_deltanet_decode`` kernel
    (``ftjax.kernels.gated_delta_step.mixer_step``: the conv, gates, norms, rule and output norm in one launch,
    the recurrent state updated in the stacked cache in place), where the kernel config selects it; else None.
    Returns (the output projection's y [B, 1, D], the cache with layer ``gi``'s states updated)."""
    qkv_in, z, b_in, a_in = projected
    b, t, _ = qkv_in.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if t != 1 or qkv_in.dtype != dtype or not (z.dtype == b_in.dtype == a_in.dtype == dtype):
        return None
    how, tiles = gated_delta_step.mixer_mode(hk, hv, dk, dv, qkv_in.shape[-1], cfg.linear_conv_kernel,
                                             cache.rec.dtype, dtype)
    if how == "xla":
        return None
    weights = [_stacked(lp[name]) for name in ("conv", "A_log", "dt_bias", "norm")]
    y, conv, rec = gated_delta_step.mixer_step(
        qkv_in[:, 0], z[:, 0], b_in[:, 0], a_in[:, 0], jnp.sum(valid, axis=1, dtype=jnp.int32), cache.conv,
        cache.rec, jnp.asarray(gi, jnp.int32), *(w for w, _ in weights), jnp.stack([i for _, i in weights]),
        key_heads=hk, eps=cfg.rms_norm_eps, interpret=how == "interpret", **tiles)
    cache = cache._replace(conv=jax.lax.dynamic_update_index_in_dim(cache.conv, conv, gi, 0), rec=rec)
    return project(y[:, None], lp["w_out"]), cache
