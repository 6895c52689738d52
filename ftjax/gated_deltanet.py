"""The gated delta rule (Gated DeltaNet; Yang, Kautz, Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", 2024) and the short causal conv in front of it, as pure
functions.

Per value head, a state ``S`` [dk, dv] is decayed and corrected once per token t:

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

(g_t <= 0 the log decay, beta_t in (0, 1) the write strength; q and k L2-normalised, q scaled
by dk^-1/2). Two forms compute it:

* :func:`recurrent_gated_delta_rule`: token by token (decode, T = 1).
* :func:`chunked_gated_delta_rule`: chunks of :data:`DELTA_CHUNK` tokens. Inside a chunk the
  sequential corrections are solved at once (a unit lower-triangular system, the WY / UT
  transform of DeltaNet); a scan over chunks carries S. Prefill uses this form. It also returns
  S at the end of every chunk, which prefix reuse stores (``ftjax.kv``).

Both follow transformers' torch reference (``models/qwen3_5_moe/modeling_qwen3_5_moe.py``,
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``): float32 throughout,
sequences padded at the end to a multiple of the chunk. Padding tokens (``valid`` False) get
beta = 0 and g = 0, so they leave S exactly as it was: the state after a padded call is the
state after its last real token.

No Pallas kernel: XLA's batched matmuls and triangular solve compute the chunked form, and
whether they are slow on a GPU has not been measured (no GPU was used to write this).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    dtype, the new conv state [B, K-1, C]: the last K-1 inputs up to token valid_len).
    """
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
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    c = jnp.cumsum(g, axis=-1)  # [B, H, N, chunk]
    lower = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    decay = jnp.exp(jnp.where(lower, c[..., :, None] - c[..., None, :], -jnp.inf))  # [.., i, j]
    system = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay
    unit_lower = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk, dtype=system.dtype)
    solve = lambda rhs: jax.lax.linalg.triangular_solve(  # noqa: E731
        unit_lower, rhs, left_side=True, lower=True, unit_diagonal=True)
    u = solve(v_beta)
    w = solve(k_beta * jnp.exp(c)[..., None])
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_read = q * jnp.exp(c)[..., None]
    k_write = k * jnp.exp(c[..., -1:] - c)[..., None]
    chunk_decay = jnp.exp(c[..., -1])[..., None, None]  # [B, H, N, 1, 1]

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
