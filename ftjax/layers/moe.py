"""The MoE block of every layer: RMSNorm, softmax top-k router, routed experts, and (where the family
has one) an always-on shared expert.

The routed experts are not computed here: the block hands its routing to the *expert function*
(``ftjax.seams.ExpertFn``; ``ftjax.experts.offload`` builds it), which owns where expert weights live
(resident, cached slots, streamed layers, the CPU). This is the seam where offload plugs in without
touching the math.

Weights of one layer (``[in, out]``; stacked over all layers in ``params["layers"]``): ``mlp_norm [D]``,
``router [D, E]``; with a shared expert (``ModelConfig.shared_expert_ffn`` Fs > 0; Qwen3.5 / Qwen3.6)
also ``shared_gate_up [D, 2Fs]`` (gate | up), ``shared_down [Fs, D]`` and ``shared_gate [D, 1]`` (its
output is scaled by the gate's sigmoid).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig
from ftjax.kernels import route_decode
from ftjax.layers.common import StackedWeight, norm_project, norm_project_in_one_launch, project
from ftjax.seams import ExpertFn, LayerIndex, LayerInputs, LayerRouting


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's MoE-block weights (module docstring), by name."""
    d, fs = cfg.hidden_size, cfg.shared_expert_ffn
    s = {"mlp_norm": (d,), "router": (d, cfg.num_experts)}
    if fs:
        s.update(shared_gate_up=(d, 2 * fs), shared_down=(fs, d), shared_gate=(d, 1))
    return s


def top_k_route(cfg: ModelConfig, logits: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The softmax top-k router from its logits [N, E]: (expert ids int32 [N, k], weights [N, k] in
    ``dtype``). Probabilities in float32; renormalised over the top k when ``cfg.norm_topk_prob``."""
    with jax.named_scope("router"):
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w, ids = jax.lax.top_k(probs, cfg.top_k)
        if cfg.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return ids.astype(jnp.int32), w.astype(dtype)


def route(cfg: ModelConfig, x: jax.Array, w_router: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k router of x [N, D] with w_router [D, E]: :func:`top_k_route` of ``x @ w_router``."""
    with jax.named_scope("router"):
        return top_k_route(cfg, project(x, w_router), x.dtype)


def _route_decode(cfg: ModelConfig, lp: dict, h: jax.Array):
    """(ids int32 [N, k], weights [N, k], the normed MLP input x [N, D]) of a decode call's router through
    ``ftjax.kernels.route_decode`` on ``norm_dense_decode``'s partial logits, when the kernel config selects
    both for a router read from the stacked weights (plain and zero-centred norms); else None. Same arithmetic as
    the jnp path (the summed logits rounded to the projection's dtype, softmax, top-k, renormalisation)."""
    router = lp["router"]
    b, t, _ = h.shape
    if not isinstance(router, StackedWeight) or not route_decode.selected(b * t, cfg.num_experts, cfg.top_k):
        return None
    got = norm_project_in_one_launch(h, lp["mlp_norm"], (router,), cfg.rms_norm_eps, offset=cfg.norm_offset,
                                     write_x=True, sum_parts=False)
    if got is None:
        return None
    (parts,), x = got
    routed = route_decode.maybe(parts, jnp.result_type(x.dtype, router.w.dtype), cfg.top_k, cfg.norm_topk_prob,
                                x.dtype)
    return None if routed is None else (*routed, x.reshape(b * t, -1))


def guess_experts(cfg: ModelConfig, lp: dict, h: jax.Array, guesses: int) -> jax.Array:
    """int32 [B*T, G]: the layer's experts guessed from its input h [B, T, D] before its token mixer, the top
    ``guesses`` (G) of its router on h normed by its MoE norm, per token; the prefetch's guess
    (``ftjax.experts.prefetch``)."""
    b, t, _ = h.shape
    with jax.named_scope("guess_experts"):
        # A barrier between h and the guesses' norm: XLA may otherwise fuse that norm's reduction with the token
        # mixer's norm of the same h (a sibling multi-output fusion), and a fused reduction may sum in another
        # order, so the layer's own arithmetic could change with the prefetch on; the guesses only pick copies.
        # A precaution: the fp32 hybrid's difference from resident on an H100 is its cached prefill's, with or
        # without a prefetch (docs/PROFILE.md, 2026-12-07).
        h = jax.lax.optimization_barrier(h)
        (logits,), _ = norm_project(h, lp["mlp_norm"], (lp["router"],), cfg.rms_norm_eps, offset=cfg.norm_offset)
        e = cfg.num_experts
        return jax.lax.top_k(logits.reshape(b * t, e).astype(jnp.float32), min(guesses, e))[1]


def shared_expert(cfg: ModelConfig, lp: dict, x: jax.Array) -> jax.Array:
    """The always-on expert, scaled by its sigmoid gate. x: [N, D] -> [N, D]."""
    fs = cfg.shared_expert_ffn
    gu = project(x, lp["shared_gate_up"])
    y = project(jax.nn.silu(gu[:, :fs]) * gu[:, fs:], lp["shared_down"])
    return jax.nn.sigmoid(project(x, lp["shared_gate"])) * y


def block(cfg: ModelConfig, lp: dict, h: jax.Array, idx: LayerIndex, expert_fn: ExpertFn, expert_state,
          inputs: LayerInputs):
    """The MoE block of one layer: h [B, T, D] -> h + experts(norm(h)) (+ the shared expert).
    idx.layer: the layer (the expert function's flat ids are ``layer * E + expert``).
    Returns (h, expert state, the expert function's LayerStats)."""
    b, t, _ = h.shape
    with jax.named_scope("moe"):
        with jax.named_scope("router"):
            routed = _route_decode(cfg, lp, h)
            if routed is None:
                (logits,), x = norm_project(h, lp["mlp_norm"], (lp["router"],), cfg.rms_norm_eps,
                                            offset=cfg.norm_offset, write_x=True)
        if routed is None:
            x = x.reshape(b * t, -1)
            ids, w = top_k_route(cfg, logits.reshape(b * t, -1), x.dtype)
        else:
            ids, w, x = routed
        y, expert_state, stats = expert_fn(expert_state, idx.layer, LayerRouting(x, ids, w, inputs.valid.reshape(-1)))
        if cfg.shared_expert_ffn:
            with jax.named_scope("shared_expert"):
                y = y.astype(h.dtype) + shared_expert(cfg, lp, x)
        h = h + y.reshape(b, t, -1).astype(h.dtype)
    return h, expert_state, stats
