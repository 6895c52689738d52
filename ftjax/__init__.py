"""ftjax: MoE serving with expert offload and layerwise KV offload, in JAX."""
