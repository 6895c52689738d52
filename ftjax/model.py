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

The hybrid family (``qwen3_5_moe``: Gated DeltaNet + gated attention layers) lays its layers out
by blocks and has a KV cache for its attention layers only, beside the DeltaNet layers' conv and
recurrent state; :func:`forward` hands it to ``ftjax.hybrid.forward_blocks``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig
from ftjax.experts.state import LayerStats
from ftjax.kernels import decode_attention, dense_decode, flash_prefill, rope_cache, route_decode, select

Params = dict[str, Any]


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each per-layer parameter of one layer (matrices as [in, out]), by family.

    The one table of non-expert shapes: the checkpoint loader, the random-weight builder and
    the memory planner all read it. Stacked over layers, each gets a leading L axis.
    """
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    s = {"attn_norm": (d,), "mlp_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
         "router": (d, cfg.num_experts)}
    if cfg.qk_norm == "per_head":
        s["q_norm"], s["k_norm"] = (hd,), (hd,)
    elif cfg.qk_norm == "full":
        s["q_norm"], s["k_norm"] = (q,), (kv,)
    return s


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes of the whole params pytree (see the module docstring; a hybrid family's layers are
    laid out by blocks, ``ftjax.hybrid.block_param_shapes``); no lm_head when tied."""
    if cfg.is_hybrid:
        from ftjax.hybrid import block_param_shapes  # late import: hybrid imports this module
        layers = block_param_shapes(cfg)
    else:
        layers = {k: (cfg.num_layers,) + v for k, v in layer_param_shapes(cfg).items()}
    shapes: dict[str, Any] = {
        "embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


class KVCache(NamedTuple):
    """Device state of the sequences: k, v [L_att, B, S_max, Hkv, hd] (compute dtype) of the
    full-attention layers (L_att = L outside the hybrid families); for a hybrid family also the
    Gated DeltaNet layers' conv state [G, Nl, B, K-1, conv_dim] (compute dtype) and recurrent
    state [G, Nl, B, Hv, dk, dv] (float32), by block (``ftjax.hybrid``); None otherwise."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array | None = None
    rec: jax.Array | None = None


def init_kv_cache(cfg: ModelConfig, batch: int, max_seq_len: int, dtype) -> KVCache:
    """Zeros: K and V [L_att, batch, max_seq_len, Hkv, hd]; a hybrid family's linear states too."""
    shape = (cfg.num_attention_layers, batch, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    if not cfg.is_hybrid:
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    from ftjax.hybrid import linear_state_shapes  # late import: hybrid imports this module
    conv, rec = linear_state_shapes(cfg, batch)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros(conv, dtype),
                   jnp.zeros(rec, jnp.float32))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled by ``w`` in the input dtype (as transformers does)."""
    with jax.named_scope("norm"):  # names the ops for profiles (experiments/profile_step.py)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return w * y.astype(x.dtype)


def rms_norm_offset(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with zero-centred weights (Qwen3.5 / Qwen3-Next): the float32 normalised x times
    ``1 + w`` in float32, then cast to x's dtype (transformers' ``Qwen3_5MoeRMSNorm``)."""
    with jax.named_scope("norm"):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def norm_fn(cfg: ModelConfig) -> Callable[[jax.Array, jax.Array, float], jax.Array]:
    """The family's RMSNorm: zero-centred weights where ``cfg.norm_offset``."""
    return rms_norm_offset if cfg.norm_offset else rms_norm


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


def cached_attention(q: jax.Array, ck: jax.Array, cv: jax.Array, layer: jax.Array, q_pos: jax.Array) -> jax.Array:
    """:func:`attention` of one layer over the stacked cache, through a Pallas kernel where
    ``FTJAX_KERNELS`` selects one (``ftjax.kernels.select``; default: on GPUs, never on the CPU).

    q: [B, T, Hq, hd]; ck, cv: [L, B, S_max, Hkv, hd]; layer: int32 []; q_pos: int32 [B, T].
    Decode (T = 1): ``ftjax.kernels.decode_attention`` reads only the filled positions
    ``[0, q_pos + 1)`` of each row. Prefill: ``ftjax.kernels.flash_prefill`` (flash attention
    from any start position; its Mosaic GPU variant only for calls whose rows all start at 0).
    Otherwise, and as the reference, the blocked jnp :func:`attention` over the whole cache row.
    q may be a :class:`GroupedQuery` (``ftjax.kernels.rope_cache``'s layout): then the result is the
    decode kernel's :class:`SplitAttention`, its key splits not merged yet (:func:`attention_output`).
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


def route(cfg: ModelConfig, x: jax.Array, w_router: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k router.

    x: [N, D]; w_router: [D, E]. Returns (expert ids int32 [N, k], weights [N, k] in x's dtype).
    Probabilities in float32; renormalised over the top k when ``cfg.norm_topk_prob``.
    """
    with jax.named_scope("router"):
        return top_k_route(cfg, project(x, w_router), x.dtype)


def top_k_route(cfg: ModelConfig, logits: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """:func:`route` from the router's logits [N, E]: (expert ids int32 [N, k], weights [N, k] in
    ``dtype``)."""
    with jax.named_scope("router"):
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w, ids = jax.lax.top_k(probs, cfg.top_k)
        if cfg.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return ids.astype(jnp.int32), w.astype(dtype)


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


#: Environment variable: the fewest rows a dense projection hands the GPU's matmul (0 turns the
#: padding off). Default 4 on a GPU, 0 elsewhere. The engine reads it when it builds a step's
#: static options (``engine.StepOptions.min_dot_rows``), so a changed value compiles new programs;
#: a bare :func:`project` outside :func:`dot_rows` reads it at trace time.
MIN_DOT_ROWS_ENV = "FTJAX_MIN_DOT_ROWS"

# the rows set by dot_rows() for the trace in progress; None: read the variable
_DOT_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ftjax_dot_rows", default=None)


def min_dot_rows() -> int:
    """Rows :func:`project` pads a smaller matmul to: ``FTJAX_MIN_DOT_ROWS``, default 4 on a GPU
    and 0 (no padding) on other backends.
    Raises:
      ValueError: the variable is not a non-negative integer."""
    value = os.environ.get(MIN_DOT_ROWS_ENV, "").strip()
    if not value:
        return 4 if jax.default_backend() == "gpu" else 0
    if not value.isdigit():
        raise ValueError(f"{MIN_DOT_ROWS_ENV}={value!r}: expected a non-negative integer")
    return int(value)


@contextlib.contextmanager
def dot_rows(rows: int | None):
    """Within it (while a step is traced), :func:`project` pads to ``rows`` rows instead of reading
    ``FTJAX_MIN_DOT_ROWS``; None keeps the variable. A jitted step takes ``rows`` from its static
    options (``engine.StepOptions.min_dot_rows``), so that the value is part of the key of its
    compiled programs (jax's trace cache and the engine's): a value read from the environment
    at trace time is not, and a changed variable would reuse the programs traced under the old one.
    Raises:
      ValueError: ``rows`` is neither None nor a non-negative integer."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ValueError(f"dot_rows: expected None or a non-negative integer, got {rows!r}")
    token = _DOT_ROWS.set(rows)
    try:
        yield
    finally:
        _DOT_ROWS.reset(token)


class StackedWeight(NamedTuple):
    """Layer ``layer`` (int32 []) of a dense weight ``w`` [L, K, N] stacked over layers, not sliced:
    what :func:`forward`'s decode steps hand the layer function in place of ``w[layer]`` where the
    dense decode kernel runs (``ftjax.kernels.dense_decode``), so that :func:`project` reads the
    layer's matrix in place instead of XLA copying the slice out of the scan's xs first."""

    w: jax.Array
    layer: jax.Array


#: The dense weights of a layer that :func:`forward` may pass as :class:`StackedWeight` (every
#: family of :data:`LAYER_FNS` uses them only through :func:`project`, :func:`norm_project`,
#: :func:`attention_inputs` and :func:`attention_output`).
STACKED_NAMES = ("wq", "wk", "wv", "wo", "router")
#: The norm weights ([L, K]) :func:`forward` passes stacked where ``norm_dense_decode`` runs (read by
#: that kernel only, through :func:`norm_project`): a layer scan copies each layer's row of its xs
#: out first (a ``memcpy`` kernel per norm and layer in the H200 trace of a decode step).
STACKED_NORMS = ("attn_norm", "mlp_norm")
#: The per-head q/k norm weights ([L, hd]) :func:`forward` passes stacked where ``rope_cache`` runs too
#: (read in place by that kernel; :func:`attention_inputs`).
STACKED_QK_NORMS = ("q_norm", "k_norm")


def layer_weight(w: jax.Array | StackedWeight) -> jax.Array:
    """The layer's own array of a weight that may be a :class:`StackedWeight` (sliced at its layer)."""
    return w.w[w.layer] if isinstance(w, StackedWeight) else w


def project(x: jax.Array, w: jax.Array | StackedWeight) -> jax.Array:
    """``x @ w`` for a dense weight: x [..., K], w [K, N] -> [..., N] in the promoted dtype.

    w may be a :class:`StackedWeight` (``w.w [L, K, N]``, ``w.layer``): where ``FTJAX_KERNELS``
    selects ``dense_decode`` for these operands (at most 16 rows; ``auto``: GPU, 16-bit weights) the kernel
    computes ``x @ w.w[w.layer]`` reading the stacked weight in place; otherwise the layer's
    matrix is sliced and the product below runs on it.

    A batch-1 decode step has one row. The H200 profile (experiments/profile_step.py, issue 13)
    showed XLA lowering those [1, K] x [K, N] products of the layer scan to multiply and reduce
    fusions at ~20% of the HBM bandwidth, while the same products with 4 rows (batch 4) ran as
    GEMMs in less than half the time of the one row (XLA's ``dot-strength-reduction`` pass turns a
    matrix-vector product with (N + 1) * K < 10M into multiply + reduce). So fewer than
    :func:`min_dot_rows` rows (the rows of an enclosing :func:`dot_rows`, where a step sets them)
    are padded with zero rows and sliced back; each row's result is the same product, and the
    padding reads no extra weights. A/B in one H200 session (resident batch-1 decode, 48 layers,
    ``experiments/ab_project.py``): step 8.74 ms plain, 7.88 ms with that pass disabled, 7.84 ms
    padded behind an optimization barrier (the first version: one small ``memcpy`` per
    projection), **7.37 ms padded without it** (XLA does not fold the padding back here).
    """
    if isinstance(w, StackedWeight):
        y = dense_decode.maybe(x, w.w, w.layer)
        if y is not None:
            return y
        w = w.w[w.layer]
    m = _DOT_ROWS.get()
    if m is None:
        m = min_dot_rows()
    rows = math.prod(x.shape[:-1])  # not x.size // K: K may be 0 (then x @ w is zeros)
    if rows >= m:
        return x @ w
    padded = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, m - rows), (0, 0)))
    return (padded @ w)[:rows].reshape(*x.shape[:-1], w.shape[-1])


def norm_project(cfg: ModelConfig, h: jax.Array, norm_w: jax.Array, ws: tuple, write_x: bool = False):
    """``rms_norm(h)`` and its products with ``ws`` ([..., N_i] each), the normalised rows too
    when ``write_x`` (else None). Where every weight is a :class:`StackedWeight` of one layer and
    ``FTJAX_KERNELS`` selects ``norm_dense_decode`` (decode steps; ``ftjax.kernels.dense_decode``),
    one kernel launch does all of it; otherwise :func:`rms_norm` and :func:`project` per weight.
    h: [..., K]; norm_w: [K], or a :class:`StackedWeight` of the norm weights [L, K] (the kernel
    reads the layer's row in place)."""
    layers = {id(w.layer) for w in (*ws, norm_w) if isinstance(w, StackedWeight)}
    if all(isinstance(w, StackedWeight) for w in ws) and len(layers) == 1:
        g = norm_w.w if isinstance(norm_w, StackedWeight) else norm_w
        got = dense_decode.maybe_norm(h, g, cfg.rms_norm_eps, [w.w for w in ws], ws[0].layer, write_x)
        if got is not None:
            return got
    x = rms_norm(h, layer_weight(norm_w), cfg.rms_norm_eps)
    return [project(x, w) for w in ws], (x if write_x else None)


def _qk(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, qkv: list | None = None):
    """q, k (normed where the family norms them, rotated) and v [B, T, H, hd] of the normalised
    attention input x [B, T, D], or of its projections ``qkv`` when the caller made them."""
    b, t, _ = x.shape
    hd = cfg.head_dim
    q, k, v = qkv if qkv is not None else (project(x, lp["wq"]), project(x, lp["wk"]), project(x, lp["wv"]))
    if cfg.qk_norm == "full":
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = q.reshape(b, t, cfg.num_heads, hd)
    k = k.reshape(b, t, cfg.num_kv_heads, hd)
    v = v.reshape(b, t, cfg.num_kv_heads, hd)
    if cfg.qk_norm == "per_head":
        q = rms_norm(q, layer_weight(lp["q_norm"]), cfg.rms_norm_eps)
        k = rms_norm(k, layer_weight(lp["k_norm"]), cfg.rms_norm_eps)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


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


def attention_output(o: jax.Array | SplitAttention, wo: jax.Array | StackedWeight) -> jax.Array:
    """The attention block's output projection ``o @ wo`` [B, T, D] of o [B, T, Hq, hd] or of a
    :class:`SplitAttention` (T = 1): where ``FTJAX_KERNELS`` selects ``merge_dense_decode`` for a stacked
    wo, one launch merges the splits and projects (``dense_decode.merge_dense_decode``); otherwise
    the merge (``decode_attention.merge_splits``) and then :func:`project`."""
    if isinstance(o, SplitAttention):
        if isinstance(wo, StackedWeight):
            y = dense_decode.maybe_merge(o.o, o.m, o.l, o.g, o.dtype, wo.w, wo.layer)
            if y is not None:
                return y[:, None]
        o = decode_attention.merge_splits(o.o, o.m, o.l, o.g, o.dtype)
    b, t = o.shape[:2]
    return project(o.reshape(b, t, -1), wo)


def _rope_cache_inputs(cfg: ModelConfig, lp: Params, h: jax.Array, layer: jax.Array, ck: jax.Array, cv: jax.Array,
                       positions: jax.Array):
    """:func:`attention_inputs` through ``ftjax.kernels.rope_cache`` when ``FTJAX_KERNELS`` selects it
    and ``decode_attention`` for a decode call whose projections read stacked weights; else None."""
    ws = (lp["wq"], lp["wk"], lp["wv"])
    b, t, _ = h.shape
    if t != 1 or cfg.qk_norm not in ("per_head", "none") or not all(isinstance(w, StackedWeight) for w in ws):
        return None
    norm_w = getattr(lp["attn_norm"], "w", lp["attn_norm"])
    dtype = jnp.result_type(norm_w.dtype, h.dtype, ws[0].w.dtype)  # the projections' (norm_dense_decode's)
    norms = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm == "per_head" else (None, None)
    q_dtype = rope_cache.query_dtype(getattr(norms[0], "w", norms[0]).dtype if norms[0] is not None else None, dtype)
    parts_shape = jax.ShapeDtypeStruct((1, b, sum(w.w.shape[-1] for w in ws)), dtype)
    ok = rope_cache.supported(parts_shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ck, q_dtype) and \
        select.dot_dtype_ok(q_dtype)
    auto = dense_decode.auto_for(ws[0].w.dtype)
    how = select.mode("rope_cache", ok, auto=auto)
    if how == "xla" or select.mode("decode_attention", ok) == "xla":
        return None
    parts = dense_decode.maybe_norm(h, norm_w, cfg.rms_norm_eps, [w.w for w in ws], ws[0].layer, sum_parts=False)
    if parts is not None:
        qkv = parts[0][0]  # [k_split, B, N] float32 partials, or [1, B, N]
    else:  # the norm kernel is not selected: the projections as the jnp path makes them, as one part
        (q, k, v), _ = norm_project(cfg, h, lp["attn_norm"], ws)
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

    h: the residual stream [B, T, D]; ck, cv: [L, B, S_max, Hkv, hd]. Returns (q, ck, cv): q
    [B, T, Hq, hd] (input norm, projections, q/k norms, RoPE: :func:`norm_project`, :func:`_qk`),
    or, for a decode call where ``FTJAX_KERNELS`` selects ``rope_cache`` and ``decode_attention``,
    a :class:`GroupedQuery` from one ``ftjax.kernels.rope_cache`` launch that also writes K/V
    (same arithmetic; :func:`cached_attention` takes either)."""
    got = _rope_cache_inputs(cfg, lp, h, layer, ck, cv, inputs.positions)
    if got is not None:
        return got
    qkv, _ = norm_project(cfg, h, lp["attn_norm"], (lp["wq"], lp["wk"], lp["wv"]))
    q, k, v = _qk(cfg, lp, h, inputs.positions, qkv)
    ck = ck.at[layer, inputs.bidx, inputs.positions].set(k.astype(ck.dtype), mode="drop")
    cv = cv.at[layer, inputs.bidx, inputs.positions].set(v.astype(cv.dtype), mode="drop")
    return q, ck, cv


class KVHook(Protocol):
    """Optional per-layer hook of :func:`forward` for layerwise KV offload (DESIGN.md 1.4).

    Implemented by ``ftjax.kv.layerwise.LayerwiseKV``. With no hook, ``forward`` is unchanged.
    ``scan_xs()``: pytree with leading axis L sliced by the layer scan (may live in host memory),
    or None. ``init_carry()``: pytree carried through the scan (e.g. the next layer's prefetched
    KV), or None. ``before_attention(ck, cv, layer, xs_l, carry) -> (ck, cv, carry)``: may write
    rows of layer ``layer`` of the carried cache before this call's K/V are written.
    ``layer_output(ck, cv, layer, start)``: per-layer scan output, called after this call's K/V
    were written into the caches (start: int32 [B], first position of the call); stacked over
    layers into ``ForwardOut.kv_out``.
    A hybrid family (``ftjax.hybrid``) also calls ``state_points()`` (call-relative token counts
    where stored chunks end), ``state_output(states)`` (the linear layers' states there, moved
    down), ``state_xs()`` and ``load_state(conv, rec, xs)`` (the reused prefix's stored state, as
    scan xs over blocks, written into each block's linear states), and passes attention-layer
    indices (its KV cache's index) as ``layer``.
    """

    def scan_xs(self) -> Any: ...

    def init_carry(self) -> Any: ...

    def before_attention(self, ck: jax.Array, cv: jax.Array, layer: jax.Array, xs: Any,
                         carry: Any) -> tuple[jax.Array, jax.Array, Any]: ...

    def layer_output(self, ck: jax.Array, cv: jax.Array, layer: jax.Array, start: jax.Array) -> Any: ...


class ForwardOut(NamedTuple):
    """logits: float32 [B, V] (last valid token) or [B, T, V] (all); cache; expert state; stats
    stacked over layers (leading axis L); kv_out: the KV hook's stacked per-layer outputs (None
    without a hook)."""

    logits: jax.Array
    cache: KVCache
    expert_state: Any
    layer_stats: Any
    kv_out: Any = None


class LayerInputs(NamedTuple):
    """What every layer of one forward call shares (built once by :func:`forward`).

    positions: int32 [B, T] absolute positions; bidx: int32 [B, 1] batch row ids; valid: bool
    [B, T], False for padding; start: int32 [B], first position of the call.
    """

    positions: jax.Array
    bidx: jax.Array
    valid: jax.Array
    start: jax.Array


class LayerCarry(NamedTuple):
    """What one layer hands the next: the residual stream h [B, T, D], the KV cache k, v
    [L, B, S_max, Hkv, hd], the expert state and the KV hook's carry."""

    h: jax.Array
    k: jax.Array
    v: jax.Array
    expert_state: Any
    hook: Any


def _route_decode(cfg: ModelConfig, lp: Params, h: jax.Array):
    """(ids int32 [N, k], weights [N, k], the normed MLP input x [N, D]) of a decode call's router through
    ``ftjax.kernels.route_decode`` on ``norm_dense_decode``'s partial logits, when ``FTJAX_KERNELS`` selects both
    for a router read from the stacked weights; else None (:func:`norm_project` then :func:`top_k_route`).
    Same arithmetic as that path (the summed logits rounded to the projection's dtype, softmax, top-k,
    renormalisation, weights in x's dtype)."""
    router, norm_w = lp["router"], lp["mlp_norm"]
    b, t, _ = h.shape
    if not isinstance(router, StackedWeight) or not route_decode.selected(b * t, cfg.num_experts, cfg.top_k):
        return None
    g = norm_w.w if isinstance(norm_w, StackedWeight) else norm_w
    got = dense_decode.maybe_norm(h, g, cfg.rms_norm_eps, [router.w], router.layer, write_x=True, sum_parts=False)
    if got is None:
        return None
    (parts,), x = got
    routed = route_decode.maybe(parts, jnp.result_type(x.dtype, router.w.dtype), cfg.top_k, cfg.norm_topk_prob,
                                x.dtype)
    return None if routed is None else (*routed, x.reshape(b * t, -1))


def decoder_layer(cfg: ModelConfig, lp: Params, layer: jax.Array, carry: LayerCarry, inputs: LayerInputs,
                  expert_fn: ExpertFn, kv_hook: KVHook | None = None, hook_xs: Any = None):
    """One decoder layer: attention (K/V written into the cache) then the routed-expert MLP.

    Any driver calls this same function: the layer scan of :func:`forward`, or another driver
    that runs layers one at a time. lp: one layer's slice of ``params["layers"]``; layer: int32 []
    layer index. Returns (new carry, (expert stats, the KV hook's per-layer output or None)).
    """
    h, ck, cv, state, hc = carry
    b, t, _ = h.shape
    positions = inputs.positions
    hy = None
    with jax.named_scope("attention"):
        if kv_hook is not None:
            ck, cv, hc = kv_hook.before_attention(ck, cv, layer, hook_xs, hc)
        q, ck, cv = attention_inputs(cfg, lp, h, layer, ck, cv, inputs)
        if kv_hook is not None:
            hy = kv_hook.layer_output(ck, cv, layer, inputs.start)
        o = cached_attention(q, ck, cv, layer, positions)
        h = h + attention_output(o, lp["wo"])
    with jax.named_scope("moe"):
        with jax.named_scope("router"):
            routed = _route_decode(cfg, lp, h)
            if routed is None:
                (logits,), x = norm_project(cfg, h, lp["mlp_norm"], (lp["router"],), write_x=True)
        if routed is None:
            x = x.reshape(b * t, -1)
            ids, w = top_k_route(cfg, logits.reshape(b * t, -1), x.dtype)
        else:
            ids, w, x = routed
        y, state, stats = expert_fn(state, layer, LayerRouting(x, ids, w, inputs.valid.reshape(-1)))
        h = h + y.reshape(b, t, -1).astype(h.dtype)
    return LayerCarry(h, ck, cv, state, hc), (stats, hy)


#: The layer function of each family (``ModelConfig.model_type``). The three families here share
#: one layer; the hybrid family (layers of two kinds) scans over blocks instead
#: (``ftjax.hybrid.forward_blocks``, which :func:`forward` hands it to).
LAYER_FNS: dict[str, Callable[..., tuple[LayerCarry, Any]]] = {
    "qwen3_moe": decoder_layer, "olmoe": decoder_layer, "mixtral": decoder_layer}


def embed_inputs(params: Params, tokens: jax.Array, start: jax.Array,
                 valid_len: jax.Array) -> tuple[jax.Array, LayerInputs]:
    """The residual stream entering layer 0 (h [B, T, D], the embedding rows of ``tokens``) and
    the :class:`LayerInputs` every layer of the call shares. Arguments as for :func:`forward`."""
    b, t = tokens.shape
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    inputs = LayerInputs(positions, jnp.arange(b)[:, None], jnp.arange(t)[None, :] < valid_len[:, None], start)
    return params["embed"][tokens], inputs


def final_logits(params: Params, cfg: ModelConfig, h: jax.Array, valid_len: jax.Array,
                 all_logits: bool = False) -> jax.Array:
    """Final norm and LM head over the last layer's output h [B, T, D]: float32 logits [B, V] of
    each sequence's last valid token, or [B, T, V] with ``all_logits``."""
    b = h.shape[0]
    if not all_logits:  # a sequence with no valid token here (valid_len 0) reads position 0
        h = h[jnp.arange(b), jnp.maximum(valid_len - 1, 0)]
    h = norm_fn(cfg)(h, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h @ head).astype(jnp.float32)


def stacked_dense(layers: Params, token_shape: tuple[int, ...], qk_norm: str = "none") -> dict[str, jax.Array]:
    """The stacked dense weights (of :data:`STACKED_NAMES`, ``[L, K, N]`` each) that :func:`forward`
    keeps out of its layer scan's xs and passes as :class:`StackedWeight`: all of them for a decode
    call (tokens [B, T] with T == 1 and B <= 16) while ``FTJAX_KERNELS`` selects ``dense_decode`` or
    ``norm_dense_decode`` (``ftjax.kernels.select``; under ``auto``: on a GPU for 16-bit weights,
    ``dense_decode.auto_for``), plus the norms of :data:`STACKED_NORMS` ([L, K]) with ``norm_dense_decode``
    and the per-head q/k norms of :data:`STACKED_QK_NORMS` ([L, hd]; ``qk_norm``: the family's
    ``ModelConfig.qk_norm``) with ``rope_cache``; else
    none (the plain scan, unchanged). Prefill chunks, even small ones, keep the sliced weights: the
    kernels are GEMVs of few rows."""
    b, t = token_shape
    wq = layers.get("wq")
    auto = wq is not None and dense_decode.auto_for(wq.dtype)
    dense_on = select.mode("dense_decode", auto=auto) != "xla"
    norm_on = select.mode("norm_dense_decode", auto=auto) != "xla"
    if t != 1 or b > dense_decode.MAX_ROWS or not (dense_on or norm_on):
        return {}
    out = {k: layers[k] for k in STACKED_NAMES if k in layers and getattr(layers[k], "ndim", 0) == 3}
    if norm_on:
        out.update({k: layers[k] for k in STACKED_NORMS if k in layers and getattr(layers[k], "ndim", 0) == 2})
    if qk_norm == "per_head" and select.mode("rope_cache", auto=auto) != "xla" \
            and select.mode("decode_attention") != "xla":  # rope_cache runs only with it
        out.update({k: layers[k] for k in STACKED_QK_NORMS if k in layers and getattr(layers[k], "ndim", 0) == 2})
    return out


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, valid_len: jax.Array,
            cache: KVCache, expert_fn: ExpertFn, expert_state: Any, all_logits: bool = False,
            kv_hook: KVHook | None = None) -> ForwardOut:
    """Runs T tokens of B sequences through the decoder (one ``lax.scan`` over layers).

    Args:
      tokens: int32 [B, T], right-padded; token t of sequence b sits at position start[b] + t.
      start: int32 [B], tokens already in the cache for each sequence (0 for a fresh prefill).
      valid_len: int32 [B], real tokens in this call (the rest is padding); 0 for a sequence
        that has nothing in this call (chunked prefill of a batch), whose logits are then junk.
      cache: KV cache, updated in place at positions [start, start + T).
      expert_fn / expert_state: where expert weights come from (see ``ftjax.experts.offload``);
        the state (slot pools, LRU table) is carried through the scan.
      all_logits: return logits of every position instead of the last valid one.
      kv_hook: optional layerwise KV hook (:class:`KVHook`; ``ftjax.kv.layerwise``): loads a
        reused prefix into the cache layer by layer and returns new K/V as scan outputs.

    Decode calls (T == 1, B <= 16) with the dense decode kernel selected (:func:`stacked_dense`;
    ``dense_decode.auto_for``) leave wq, wk, wv, wo and the router (and, with the kernels that read
    them in place, the norms of :data:`STACKED_NORMS` and :data:`STACKED_QK_NORMS`) out of the scan's
    xs and hand the layer function :class:`StackedWeight` holders of the stacked arrays instead.

    The layer-pipelined driver (``ftjax.layer_pipeline``) runs the same pieces (:func:`embed_inputs`,
    the family's layer function, :func:`final_logits`) one layer program at a time instead.
    """
    if cfg.is_hybrid:
        from ftjax.hybrid import forward_blocks  # late import: hybrid imports this module
        return forward_blocks(params, cfg, tokens, start, valid_len, cache, expert_fn, expert_state, all_logits,
                              kv_hook)
    h, inputs = embed_inputs(params, tokens, start, valid_len)
    layer_fn = LAYER_FNS[cfg.model_type]
    # decode steps with the dense decode kernel selected: the dense weights stay out of the scan's
    # xs (whose per-layer slices XLA copies before each GEMM) and reach the layer function whole
    stacked = stacked_dense(params["layers"], tokens.shape, cfg.qk_norm)
    layers_xs = {k: v for k, v in params["layers"].items() if k not in stacked}

    packed = []  # set while the scan traces the body: its LayerStats went out as LayerStats.packed's pair

    def body(carry, xs):
        lp, l, hx = xs
        if stacked:
            lp = {**lp, **{k: StackedWeight(w, l) for k, w in stacked.items()}}
        carry, (stats, hy) = layer_fn(cfg, lp, l, carry, inputs, expert_fn, kv_hook, hx)
        if isinstance(stats, LayerStats):
            packed.append(True)
            stats = stats.packed()
        return carry, (stats, hy)

    hook_xs = kv_hook.scan_xs() if kv_hook is not None else None
    carry = LayerCarry(h, cache.k, cache.v, expert_state, kv_hook.init_carry() if kv_hook is not None else None)
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    carry, (stats, kv_out) = jax.lax.scan(body, carry, (layers_xs, layer_ids, hook_xs))
    if packed:
        stats = LayerStats.unpacked(*stats)
    logits = final_logits(params, cfg, carry.h, valid_len, all_logits)
    return ForwardOut(logits, KVCache(carry.k, carry.v), carry.expert_state, stats, kv_out)

