"""Qwen3.5 / Qwen3.6 MoE (transformers ``qwen3_5_moe``; the text model of ``Qwen3_5MoeForConditionalGeneration``
too): Gated DeltaNet layers and gated attention layers in a repeating pattern (3 : 1 in the published
models), zero-centred RMSNorm weights, partial RoPE, and an always-on shared expert beside the routed
experts of every layer. Source: transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ftjax.config import ConfigError, ModelConfig
from ftjax.families import Family, TensorReader, positive, refuse
from ftjax.layers import attention, gated_deltanet, moe

#: ``layer_types`` values of the config, and the layer kind (``ftjax.layers``) each is.
KINDS = {"full_attention": "gated_attention", "linear_attention": "gated_deltanet"}


class Qwen35Moe(Family):
    model_type = "qwen3_5_moe"
    aliases = ("qwen3_5_moe_text",)
    qk_norm = "per_head"
    default_rms_eps = 1e-6

    def unwrap(self, d, source):
        """The text model's fields of a ForConditionalGeneration config (``text_config``), with the
        outer dtype and tied-head flag where the text config leaves them out. The vision tower's
        config is not read: ftjax runs the text model only."""
        if "text_config" not in d:
            return d
        text = d["text_config"]
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: field 'text_config' should be an object, got {type(text).__name__}")
        outer = {k: d[k] for k in ("torch_dtype", "dtype", "tie_word_embeddings") if d.get(k) is not None}
        return {**outer, **{k: v for k, v in text.items() if v is not None}, "model_type": self.model_type}

    def parse(self, d: Mapping[str, Any], rope_params: Mapping[str, Any], head_dim: int, source: str) -> dict:
        """The hybrid fields (transformers' Qwen3_5MoeTextConfig defaults where a field is absent). The
        multimodal rope sections (``mrope_section``) are accepted as they are: for text every section has
        the same position, which reduces them to plain RoPE."""
        n = positive(d, "num_hidden_layers", source)
        types = d.get("layer_types")
        if types is None:
            every = positive(d, "full_attention_interval", source, default=4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if not isinstance(types, list) or len(types) != n or any(t not in KINDS for t in types):
            raise ConfigError(f"{source}: field 'layer_types' must list one of {tuple(KINDS)} per layer "
                              f"({n} layers), got {types!r}")
        refuse("full_attention" not in types, source, "layer_types", "no full_attention layer")
        refuse(d.get("attn_output_gate", True) is not True, source, "attn_output_gate",
               "attention without its output gate")
        prf = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        if not isinstance(prf, (int, float)) or isinstance(prf, bool) or not 0 < prf <= 1 or int(head_dim * prf) % 2:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' must be in (0, 1] and rotate an even "
                              f"number of head dims, got {prf!r}")
        kh = positive(d, "linear_num_key_heads", source, default=16)
        vh = positive(d, "linear_num_value_heads", source, default=32)
        if vh % kh:
            raise ConfigError(f"{source}: 'linear_num_value_heads' ({vh}) must be a multiple of "
                              f"'linear_num_key_heads' ({kh})")
        return dict(num_experts=positive(d, "num_experts", source),
                    expert_ffn=positive(d, "moe_intermediate_size", source),
                    norm_topk_prob=True,  # its router always renormalises the top-k probabilities
                    layer_types=tuple(types), partial_rotary_factor=float(prf), attn_output_gate=True,
                    norm_offset=True, shared_expert_ffn=positive(d, "shared_expert_intermediate_size", source),
                    linear_num_key_heads=kh, linear_num_value_heads=vh,
                    linear_key_head_dim=positive(d, "linear_key_head_dim", source, default=128),
                    linear_value_head_dim=positive(d, "linear_value_head_dim", source, default=128),
                    linear_conv_kernel=positive(d, "linear_conv_kernel_dim", source, default=4))

    def layer_kinds(self, cfg: ModelConfig) -> tuple[str, ...]:
        return tuple(KINDS[t] for t in cfg.layer_types)

    def tensor_prefix(self, has) -> str:
        """"model." (ForCausalLM) or "model.language_model." (ForConditionalGeneration, whose vision tower
        and multi-token-prediction head are not read)."""
        return "model.language_model." if has("model.language_model.embed_tokens.weight") else "model."

    def layer_tensors(self, cfg: ModelConfig, get: TensorReader, prefix: str, layer: int,
                      kind: str) -> dict[str, np.ndarray]:
        p = f"{prefix}layers.{layer}."
        d, fs = cfg.hidden_size, cfg.shared_expert_ffn

        def mat(name, shape):  # shape: ftjax's [in, out]; stored transposed ([out, in])
            return get(name, shape[::-1]).T

        common = moe.param_shapes(cfg)
        out = {"attn_norm": get(p + "input_layernorm.weight", (d,)),
               "mlp_norm": get(p + "post_attention_layernorm.weight", (d,)),
               "router": mat(p + "mlp.gate.weight", common["router"]),
               "shared_gate_up": np.concatenate([mat(p + f"mlp.shared_expert.{n}_proj.weight", (d, fs))
                                                 for n in ("gate", "up")], axis=1),
               "shared_down": mat(p + "mlp.shared_expert.down_proj.weight", common["shared_down"]),
               "shared_gate": mat(p + "mlp.shared_expert_gate.weight", (d, 1))}
        if kind == "gated_attention":
            a, sh = p + "self_attn.", attention.param_shapes(cfg, gated=True)
            out.update(wq=mat(a + "q_proj.weight", sh["wq"]), wk=mat(a + "k_proj.weight", sh["wk"]),
                       wv=mat(a + "v_proj.weight", sh["wv"]), wo=mat(a + "o_proj.weight", sh["wo"]),
                       q_norm=get(a + "q_norm.weight", sh["q_norm"]), k_norm=get(a + "k_norm.weight", sh["k_norm"]))
        else:
            a, sh = p + "linear_attn.", gated_deltanet.param_shapes(cfg)
            conv = get(a + "conv1d.weight", (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel))
            out.update(w_qkv=mat(a + "in_proj_qkv.weight", sh["w_qkv"]), w_z=mat(a + "in_proj_z.weight", sh["w_z"]),
                       w_b=mat(a + "in_proj_b.weight", sh["w_b"]), w_a=mat(a + "in_proj_a.weight", sh["w_a"]),
                       conv=conv[:, 0, :].T, dt_bias=get(a + "dt_bias", sh["dt_bias"]),
                       A_log=get(a + "A_log", sh["A_log"]), norm=get(a + "norm.weight", sh["norm"]),
                       w_out=mat(a + "out_proj.weight", sh["w_out"]))
        return out

    def fused_expert_tensors(self, cfg, prefix, layer):
        p = f"{prefix}layers.{layer}.mlp.experts."
        return p + "gate_up_proj", p + "down_proj"


FAMILY = Qwen35Moe()
