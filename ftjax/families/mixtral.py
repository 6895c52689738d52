"""Mixtral (transformers ``mixtral``): every layer attention without q/k norms + a routed-expert MoE block
(``block_sparse_moe``, experts w1 / w3 / w2) that always renormalises its top-k weights."""

from __future__ import annotations

from ftjax.families import positive, refuse
from ftjax.families._standard import StandardMoE


class Mixtral(StandardMoE):
    model_type = "mixtral"
    qk_norm = "none"
    default_rms_eps = 1e-5
    router_name = "block_sparse_moe.gate.weight"

    def parse(self, d, rope_params, head_dim, source):
        self.refuse_partial_rope(d, source)
        experts = positive(d, "num_local_experts", source)
        ffn = positive(d, "intermediate_size", source)
        refuse(d.get("sliding_window") is not None, source, "sliding_window", "sliding-window attention")
        return dict(num_experts=experts, expert_ffn=ffn, norm_topk_prob=True)

    def expert_tensors(self, cfg, prefix, layer, expert):
        p = f"{prefix}layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"


FAMILY = Mixtral()
