"""OLMoE (transformers ``olmoe``): every layer attention with q/k RMSNorm over the whole projection + a
routed-expert MoE block."""

from __future__ import annotations

from ftjax.families import positive, refuse
from ftjax.families._standard import StandardMoE


class Olmoe(StandardMoE):
    model_type = "olmoe"
    qk_norm = "full"
    default_rms_eps = 1e-5

    def parse(self, d, rope_params, head_dim, source):
        self.refuse_partial_rope(d, source)
        experts = positive(d, "num_experts", source)
        ffn = positive(d, "intermediate_size", source)
        refuse(d.get("clip_qkv") is not None, source, "clip_qkv", "qkv clipping")
        return dict(num_experts=experts, expert_ffn=ffn, norm_topk_prob=bool(d.get("norm_topk_prob", False)))


FAMILY = Olmoe()
