"""The shared pieces of the families whose every layer is grouped-query attention + a routed-expert
MoE block (qwen3_moe, olmoe, mixtral): the checkpoint names of ``model.layers.{i}.self_attn.*``."""

from __future__ import annotations

import numpy as np

from ftjax.config import ModelConfig
from ftjax.families import Family, TensorReader, refuse
from ftjax.layers import attention


class StandardMoE(Family):
    """A family of ``attention`` layers only (the ``Family`` defaults), its router at ``router_name``."""

    #: the router's tensor under ``model.layers.{i}.``
    router_name: str = "mlp.gate.weight"

    def refuse_partial_rope(self, d, source: str) -> None:
        refuse(d.get("partial_rotary_factor") not in (None, 1, 1.0), source, "partial_rotary_factor", "partial RoPE")

    def layer_tensors(self, cfg: ModelConfig, get: TensorReader, prefix: str, layer: int,
                      kind: str) -> dict[str, np.ndarray]:
        p = f"{prefix}layers.{layer}."
        d = cfg.hidden_size
        out = {"attn_norm": get(p + "input_layernorm.weight", (d,)),
               "mlp_norm": get(p + "post_attention_layernorm.weight", (d,)),
               "router": get(p + self.router_name, (cfg.num_experts, d)).T}
        names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
        for key, shape in attention.param_shapes(cfg).items():
            t = get(f"{p}self_attn.{names[key]}.weight", shape[::-1])
            out[key] = t.T if len(shape) == 2 else t
        return out
