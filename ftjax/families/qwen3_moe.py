"""Qwen3 MoE (transformers ``qwen3_moe``): every layer attention with per-head q/k RMSNorm + a routed-expert
MoE block (SwiGLU experts, softmax top-k router)."""

from __future__ import annotations

from ftjax.families import positive, refuse
from ftjax.families._standard import StandardMoE


class Qwen3Moe(StandardMoE):
    model_type = "qwen3_moe"
    qk_norm = "per_head"
    default_rms_eps = 1e-6

    def parse(self, d, rope_params, head_dim, source):
        self.refuse_partial_rope(d, source)
        experts = positive(d, ("num_experts", "num_local_experts"), source)
        ffn = positive(d, "moe_intermediate_size", source)
        refuse(d.get("decoder_sparse_step", 1) != 1, source, "decoder_sparse_step",
               "dense MLP layers interleaved with MoE layers")
        refuse(bool(d.get("mlp_only_layers")), source, "mlp_only_layers",
               "dense MLP layers interleaved with MoE layers")
        refuse(bool(d.get("use_sliding_window", False)), source, "use_sliding_window", "sliding-window attention")
        refuse(bool(d.get("shared_expert_intermediate_size")), source, "shared_expert_intermediate_size",
               "shared experts")
        return dict(num_experts=experts, expert_ffn=ffn, norm_topk_prob=bool(d.get("norm_topk_prob", False)))


FAMILY = Qwen3Moe()
