"""The MoE decoder as pure functions over a params pytree, for every family and layer pattern.

Every layer is a token mixer of its *kind* (``ftjax.layers``: attention, gated attention, Gated
DeltaNet) then the MoE block (``ftjax.layers.moe``): :func:`decoder_layer`, the one layer function
every driver runs. A family lists the kind of each layer (``ftjax.families``); the kinds repeat a
short *pattern* (one kind for qwen3_moe / olmoe / mixtral; 3 Gated DeltaNet + 1 gated attention for
Qwen3.5), and :func:`structure` says where each layer sits.

Params (all on the device):

  embed       [V, D]
  lm_head     [D, V]                 absent when the config ties it to ``embed``
  final_norm  [D]
  layers:     every layer's weights stacked over all L layers: attn_norm [L, D] (the mixer's input
              norm) and the MoE block's (mlp_norm [L, D], router [L, D, E], shared expert);
              each kind's weights stacked over the layers of that kind: [L_kind, ...]
              (``ftjax.layers.attention.param_shapes``, ``ftjax.layers.gated_deltanet.param_shapes``)

The routed experts are not in ``params``: the MoE block calls an *expert function*
(``ftjax.seams.ExpertFn``; ``ftjax.experts.offload``) that owns where expert weights live.

State (``ftjax.seams.KVCache``): the attention layers' K/V cache [L_att, B, S_max, Hkv, hd] and the
Gated DeltaNet layers' conv and recurrent state [L_lin, B, ...]. A forward call writes the state of
its tokens at positions ``start[b] + t`` and attends causally by absolute position, so one function
serves prefill (T tokens), prefix-reuse prefill (start > 0) and decode (T = 1).

Drivers: :func:`forward` is the layer scan: one ``jax.lax.scan`` over the G = L / P blocks of the
pattern, the block's P layers unrolled in its body (maxtext's scannable block); the layer-pipelined
driver (``ftjax.runtime.pipelined``) runs :func:`embed_inputs`, :func:`decoder_layer` per layer and
:func:`final_logits` as programs of their own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ftjax import families, layers
from ftjax.config import ModelConfig
from ftjax.kernels import dense_decode, registry
from ftjax.layers import gated_deltanet, moe
from ftjax.layers.common import StackedWeight, norm_fn
from ftjax.seams import (ExpertFn, ForwardOut, KVCache, KVHook, LayerCarry, LayerIndex, LayerInputs, LayerStats)

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Structure:
    """Where each layer of a model sits (see the module docstring).

    kinds: the kind of each of the L layers; pattern: the shortest repeating unit of ``kinds`` (P
    layers); num_blocks: G = L / P; kind_index: each layer's index among the layers of its kind;
    counts: (kind, layers of that kind) pairs; owner: (weight name, the kind that owns it, or "" for
    the per-layer weights of every layer) pairs.
    """

    kinds: tuple[str, ...]
    pattern: tuple[str, ...]
    num_blocks: int
    kind_index: tuple[int, ...]
    counts: tuple[tuple[str, int], ...]
    owner: tuple[tuple[str, str], ...]

    def count(self, kind: str) -> int:
        """Layers of ``kind``."""
        return dict(self.counts).get(kind, 0)

    def owner_of(self, name: str) -> str:
        """The kind owning weight ``name`` ("" for a weight of every layer)."""
        return dict(self.owner)[name]

    def state_layers(self, fields: tuple[str, ...]) -> int:
        """Layers whose kind owns the cache ``fields`` (("k", "v") or ("conv", "rec"))."""
        return sum(n for k, n in self.counts if layers.get(k).state == fields)


@functools.cache
def structure(cfg: ModelConfig) -> Structure:
    """The :class:`Structure` of ``cfg`` (its family's layer kinds).
    Raises:
      ValueError: a kind that is not registered, or two kinds owning a weight of one name."""
    kinds = families.get(cfg.model_type).layer_kinds(cfg)
    n = len(kinds)
    pattern = next(kinds[:p] for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
    seen: dict[str, int] = {}
    index = []
    for k in kinds:
        index.append(seen.get(k, 0))
        seen[k] = index[-1] + 1
    owner = {name: "" for name in common_param_shapes(cfg)}
    for k in dict.fromkeys(pattern):
        for name in layers.get(k).param_shapes(cfg):
            if name in owner:
                raise ValueError(f"weight {name!r} of layer kind {k!r} is also owned by {owner[name] or 'every layer'}")
            owner[name] = k
    return Structure(kinds, pattern, n // len(pattern), tuple(index), tuple(seen.items()), tuple(owner.items()))


def common_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the weights every layer has (one layer's): the mixer's input norm and the MoE block's."""
    return {"attn_norm": (cfg.hidden_size,), **moe.param_shapes(cfg)}


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes of the whole params pytree (module docstring); no lm_head when tied. Within ``layers``:
    the norms, each kind's weights (kinds in pattern order), then the MoE block's."""
    st = structure(cfg)
    common = common_param_shapes(cfg)
    L = cfg.num_layers
    lay: dict[str, tuple[int, ...]] = {"attn_norm": (L,) + common.pop("attn_norm"),
                                       "mlp_norm": (L,) + common.pop("mlp_norm")}
    for k in dict.fromkeys(st.pattern):
        lay.update({name: (st.count(k),) + s for name, s in layers.get(k).param_shapes(cfg).items()})
    lay.update({name: (L,) + s for name, s in common.items()})
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
                              "layers": lay}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def init_kv_cache(cfg: ModelConfig, batch: int, max_seq_len: int, dtype) -> KVCache:
    """Zeros: K and V [L_att, batch, max_seq_len, Hkv, hd] (``dtype``); the Gated DeltaNet layers' conv
    [L_lin, batch, K-1, conv_dim] (``dtype``) and recurrent state [L_lin, batch, Hv, dk, dv] (float32)."""
    st = structure(cfg)
    shape = (st.state_layers(("k", "v")), batch, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    n_lin = st.state_layers(("conv", "rec"))
    if not n_lin:
        return KVCache(k, v)
    conv, rec = gated_deltanet.state_shapes(cfg, n_lin, batch)
    return KVCache(k, v, jnp.zeros(conv, dtype), jnp.zeros(rec, jnp.float32))


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
    h = norm_fn(cfg.norm_offset)(h, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h @ head).astype(jnp.float32)


def decoder_layer(cfg: ModelConfig, kind: str, lp: Params, idx: LayerIndex, carry: LayerCarry, inputs: LayerInputs,
                  expert_fn: ExpertFn, kv_hook: KVHook | None = None, hook_xs: Any = None):
    """One decoder layer: the token mixer of ``kind`` (its state written into the cache), then the
    MoE block. Every driver calls this same function.

    lp: the layer's weights (its kind's and every layer's, each sliced to this layer or a
    ``StackedWeight``); idx: its index in the stack and in its kind. Returns (new carry, (expert
    stats, the mixer's output for the KV hook or None)).
    """
    start = getattr(expert_fn, "prefetch", None)  # a cached decode layer's guessed experts, copied beside its mixer
    if start is not None and start.applies(carry.h.shape):
        guesses = moe.guess_experts(cfg, lp, carry.h, start.guesses)
        carry = carry._replace(expert_state=start(carry.expert_state, idx.layer, guesses, inputs.valid.reshape(-1)))
    carry, hook_out = token_mixer(cfg, kind, lp, idx, carry, inputs, kv_hook, hook_xs)
    h, state, stats = moe.block(cfg, lp, carry.h, idx, expert_fn, carry.expert_state, inputs)
    return carry._replace(h=h, expert_state=state), (stats, hook_out)


def token_mixer(cfg: ModelConfig, kind: str, lp: Params, idx: LayerIndex, carry: LayerCarry, inputs: LayerInputs,
                kv_hook: KVHook | None = None, hook_xs: Any = None) -> tuple[LayerCarry, Any]:
    """The first half of :func:`decoder_layer`: the token mixer of ``kind`` (attention or Gated DeltaNet),
    its state written into the cache. Returns (the carry with the mixer's residual stream h [B, T, D] and
    cache, the mixer's output for the KV hook or None). A driver that splits a layer at its MoE block
    (``ftjax.runtime.host_split``) calls it and ``ftjax.layers.moe.block`` apart."""
    h, cache, state, hc = carry
    h, cache, hc, hook_out = layers.get(kind).mix(cfg, lp, h, idx, cache, inputs, kv_hook, hook_xs, hc)
    return LayerCarry(h, cache, state, hc), hook_out


def stacked_weights(cfg: ModelConfig, layer_params: Params, token_shape: tuple[int, ...]) -> dict[str, jax.Array]:
    """The weights a call hands its layers whole (``StackedWeight``) rather than sliced: for a decode call
    (tokens [B, T] with T == 1 and B <= ``dense_decode.MAX_ROWS``) while the kernel config selects
    ``dense_decode`` or ``norm_dense_decode`` (under ``auto``: on a GPU for 16-bit weights), every
    projection of the layers' kinds and of the MoE block (3-D stacks), plus the norms where
    ``norm_dense_decode`` runs (a zero-centred family's only where ``dense_decode.norm_auto`` or the kernel's
    name says) and the per-head q/k norms of ``attention`` layers where ``rope_cache`` runs; else none.
    Prefill calls keep the sliced weights: the kernels are GEMVs of few rows.
    ``layer_params`` may hold a subset of the weights: only those present are handed over, and ``auto``
    reads the dtype of the first projection (the router's in a model)."""
    b, t = token_shape
    st = structure(cfg)
    names = ["router", "shared_gate_up", "shared_down", "shared_gate"]
    for k in dict.fromkeys(st.pattern):
        names += layers.get(k).projections
    out = {n: layer_params[n] for n in names if n in layer_params and layer_params[n].ndim == 3}
    dtype = next(iter(out.values())).dtype if out else None
    auto = bool(out) and dense_decode.auto_for(dtype)
    # look-aheads (record=False): the kernels count as applied where the layers' projections run them
    dense_on = registry.mode("dense_decode", auto=auto, record=False) != "xla"
    norm_on = registry.mode("norm_dense_decode", auto=bool(out) and dense_decode.norm_auto(dtype, cfg.norm_offset),
                            record=False) != "xla"
    if t != 1 or b > dense_decode.MAX_ROWS or not (dense_on or norm_on):
        return {}
    if norm_on:
        out.update({n: layer_params[n] for n in ("attn_norm", "mlp_norm") if n in layer_params})
    rope_on = registry.mode("rope_cache", auto=auto, record=False) != "xla" and \
        registry.mode("decode_attention", record=False) != "xla"
    if cfg.qk_norm == "per_head" and rope_on and not cfg.norm_offset and \
            any(layers.get(k).reads_stacked_norms for k in st.pattern):
        out.update({n: layer_params[n] for n in ("q_norm", "k_norm") if n in layer_params})
    return out


def layer_params(cfg: ModelConfig, layer_params_: Params, kind: str, idx: LayerIndex,
                 stacked: dict[str, jax.Array] | None = None) -> Params:
    """One layer's weights out of ``params["layers"]``: every layer's weights at ``idx.layer``, its kind's at
    ``idx.kind`` (dynamic indices), those in ``stacked`` as ``StackedWeight`` instead."""
    st = structure(cfg)
    out = {}
    for name, w in layer_params_.items():
        owner = st.owner_of(name)
        if owner not in ("", kind):
            continue
        at = idx.layer if owner == "" else idx.kind
        out[name] = StackedWeight(stacked[name], at) if stacked and name in stacked else w[at]
    return out


def _block_xs(cfg: ModelConfig, layer_params_: Params) -> Params:
    """``params["layers"]`` as the layer scan's xs: each leaf [L_kind, ...] viewed as [G, per block, ...],
    or left [G, ...] when a block holds one layer of it (every leaf of a one-kind family): a reshaped
    weight stack is a new array to XLA, which copied each such stack whole in every decode step."""
    g = structure(cfg).num_blocks

    def per_block(w):
        return w if w.shape[0] == g else w.reshape((g, w.shape[0] // g) + w.shape[1:])

    return {name: per_block(w) for name, w in layer_params_.items()}


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, valid_len: jax.Array,
            cache: KVCache, expert_fn: ExpertFn, expert_state: Any, all_logits: bool = False,
            kv_hook: KVHook | None = None) -> ForwardOut:
    """Runs T tokens of B sequences through the decoder: one ``lax.scan`` over the blocks of the layer
    pattern.

    Args:
      tokens: int32 [B, T], right-padded; token t of sequence b sits at position start[b] + t.
      start: int32 [B], tokens already in the cache for each sequence (0 for a fresh prefill).
      valid_len: int32 [B], real tokens in this call (the rest is padding); 0 for a sequence
        that has nothing in this call, whose logits are then junk and whose state is left as it was.
      cache: the state of the sequences (``KVCache``), updated in place.
      expert_fn / expert_state: where expert weights come from (``ftjax.experts.offload``); the
        state (slot pools, LRU table) is carried through the scan.
      all_logits: return logits of every position instead of the last valid one.
      kv_hook: optional layerwise KV hook (``ftjax.seams.KVHook``; ``ftjax.kv.layerwise``): loads a
        reused prefix into the cache layer by layer and returns the new chunks. kv_out is then, for
        each of the m new chunks, its KV [L_att, 2, C, Hkv, hd], or for a model with Gated DeltaNet
        layers the tuple (KV, conv [G, Nl, K-1, conv_dim], rec [G, Nl, Hv, dk, dv]): the linear
        states at the chunk's end, by block.
    Raises:
      ValueError: a KV hook on a model whose blocks have other than one attention layer; layers whose stats
        differ in layout (routed ids' shape, the optional counters counted).
    """
    st = structure(cfg)
    p = len(st.pattern)
    h, inputs = embed_inputs(params, tokens, start, valid_len)
    stacked = stacked_weights(cfg, params["layers"], tokens.shape)
    xs_layers = _block_xs(cfg, {k: v for k, v in params["layers"].items() if k not in stacked})
    if kv_hook is not None:
        attn_per_block = sum(layers.get(k).state == ("k", "v") for k in st.pattern)
        if attn_per_block != 1:
            raise ValueError(f"prefix reuse needs one attention layer per block of the layer pattern, got "
                             f"{attn_per_block} in {st.pattern}")
        cache = kv_hook.load_state(cache)
    packed = []  # set while the scan traces the body: (routed ids' shape, optional counters) of the stats it packed

    def body(carry, xs):
        lp_block, blk, hx = xs
        stats, kv, points = [], None, []
        for i, kind in enumerate(st.pattern):
            j, nk = st.pattern[:i].count(kind), st.pattern.count(kind)
            layer = blk * p + i
            # a kind that fills the pattern: its index is the layer's, the same array, so that weights of
            # both (attn_norm and wq/wk/wv) read as one layer's (``norm_project`` fuses them)
            idx = LayerIndex(layer, layer if nk == p else blk * nk + j)
            lp = {}
            for name, w in lp_block.items():
                owner = st.owner_of(name)
                if owner in ("", kind):  # a leaf of one layer a block is that layer's already (_block_xs)
                    per_block = p if owner == "" else nk
                    lp[name] = w if per_block == 1 else w[i if owner == "" else j]
            for name, w in stacked.items():
                owner = st.owner_of(name)
                if owner in ("", kind):
                    lp[name] = StackedWeight(w, idx.layer if owner == "" else idx.kind)
            carry, (s, out) = decoder_layer(cfg, kind, lp, idx, carry, inputs, expert_fn, kv_hook, hx)
            if isinstance(s, LayerStats):
                packed.append(s.layout())
                s = s.packed()
            stats.append(s)
            if layers.get(kind).state == ("k", "v"):
                kv = out
            elif out is not None:
                points.append(out)
        if len(set(packed)) > 1:  # one stacked vector needs one layout in every layer of the pattern
            raise ValueError(f"forward: the layers' stats differ in layout {sorted(set(packed))}")
        stats = jax.tree.map(lambda *a: jnp.stack(a), *stats)
        pts = None
        if points:  # per state point: the block's linear layers stacked [Nl, ...], moved down by the hook
            pts = kv_hook.state_output(tuple(tuple(jnp.stack([lp_[m][part] for lp_ in points]) for part in (0, 1))
                                             for m in range(len(points[0]))))
        return carry, (stats, kv, pts)

    hook_xs = kv_hook.scan_xs() if kv_hook is not None else None
    carry = LayerCarry(h, cache, expert_state, kv_hook.init_carry() if kv_hook is not None else None)
    blocks = jnp.arange(st.num_blocks, dtype=jnp.int32)
    carry, (stats, kv, pts) = jax.lax.scan(body, carry, (xs_layers, blocks, hook_xs))
    stats = jax.tree.map(lambda a: a.reshape((cfg.num_layers,) + a.shape[2:]), stats)
    if packed:
        stats = LayerStats.unpacked(stats, *packed[0])
    kv_out = kv
    if pts is not None:
        kv_out = tuple((kv[m], pts[m][0], pts[m][1]) for m in range(len(kv)))
    logits = final_logits(params, cfg, carry.h, valid_len, all_logits)
    return ForwardOut(logits, carry.cache, carry.expert_state, stats, kv_out)
